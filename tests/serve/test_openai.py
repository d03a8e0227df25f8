"""The OpenAI-compatible front (serve/openai.py) with the official `openai` client, against the real tritonserver
serving k3-tiny, both started by `python -m k3deploy.serve.launch --repo REPO --openai-port P` (once per module).

The model's weights are random: whatever it generates, the API must stay well-formed, so the tests check
agreement (streamed = non-streamed, usage = the rendered prompt), shapes and the parameters, not the text.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import pathlib
import random
import re
import signal
import socket
import time
import urllib.request

import pytest

if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton not installed (pip install nvidia-pytriton)", allow_module_level=True)
openai = pytest.importorskip("openai", reason="the official openai client is not installed (pip install openai)")
try:                                     # the openai client's HTTP library: httpx (httpx2 in its newest releases)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx", reason="httpx, the openai client's HTTP library, is not installed")

from k3deploy.runtime.chat import encode_chat  # noqa: E402
from k3deploy.runtime.tokenizer import Tokenizer  # noqa: E402
from k3deploy.serve import repository as repo_mod  # noqa: E402
from k3deploy.serve.launch import free_ports  # noqa: E402
from k3client import launcher  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
WAIT_S = 120
KEY = "test-key"
INTERVAL = 16                            # tokens between periodic KDA snapshots (`serve --snapshot-interval`)
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


class Env:
    def __init__(self, proc, urls: dict, tok: Tokenizer):
        self.proc, self.urls, self.tok = proc, urls, tok
        self.client = openai.OpenAI(base_url=urls["openai"], api_key=KEY, max_retries=0, timeout=WAIT_S)

    def metric(self, url: str, name: str) -> float | None:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)
        return None if m is None else float(m.group(1))

    def wait_metric(self, url: str, name: str, pred) -> float | None:
        deadline = time.monotonic() + WAIT_S
        v = self.metric(url, name)
        while not (v is not None and pred(v)) and time.monotonic() < deadline:
            time.sleep(0.1)
            v = self.metric(url, name)
        return v

    @property
    def front_metrics(self) -> str:
        return self.urls["openai"][: -len("/v1")] + "/metrics"


@pytest.fixture(scope="module")
def env(tiny_ckpt, tmp_path_factory):
    repo = tmp_path_factory.mktemp("openai") / "repo"
    repo_mod.write_repository(tiny_ckpt, repo, "torch", max_batch=16, max_context=512)
    metrics, port = free_ports(2)
    with launcher(repo, "--enable-prefix-caching", "--snapshot-interval", str(INTERVAL), "--num-snapshots", "64",
                  "--metrics-port", str(metrics), "--openai-port", str(port), "--api-key", KEY,
                  "--max-request-bytes", str(4 << 20), root=ROOT) as (proc, urls):
        yield Env(proc, urls, Tokenizer.from_file(tiny_ckpt / "tiktoken.model"))


def greedy(**kw):
    return dict(model="k3", temperature=0, **kw)


def test_models_health_metrics_and_auth(env):
    assert [m.id for m in env.client.models.list().data] == ["k3"]
    base = env.urls["openai"][: -len("/v1")]
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        assert r.status == 200
    r = httpx.get(env.urls["openai"] + "/models")                      # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(env.urls["openai"] + "/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    big = httpx.post(env.urls["openai"] + "/chat/completions", content=b"x" * (5 << 20),     # over the 4 MiB set
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=WAIT_S)
    assert big.status_code == 413 and "error" in big.json()
    assert "k3_front_requests_total" in httpx.get(env.front_metrics).text


def test_chat_streamed_equals_non_streamed(env):
    """Thinking on (the default): same greedy answer streamed and not; usage = the rendered prompt; logprobs per
    generated token; deltas never carry marker text."""
    kw = greedy(messages=MSGS, max_tokens=8, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    full = env.client.chat.completions.create(**kw)
    prompt = encode_chat(env.tok, MSGS)
    assert full.usage.prompt_tokens == len(prompt) and full.usage.completion_tokens == 8
    assert full.usage.total_tokens == len(prompt) + 8 and full.usage.prompt_tokens_details.cached_tokens == 0
    choice = full.choices[0]
    assert choice.finish_reason in ("length", "stop", "tool_calls") and choice.message.role == "assistant"
    assert len(choice.logprobs.content) == 8
    for entry in choice.logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token               # greedy: the chosen one is the most likely
    chunks = list(env.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens == len(prompt) and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].choices == []
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == (choice.message.model_extra.get("reasoning_content") or "")
    assert content == (choice.message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == 8
    for d in deltas:
        for text in (d.content or "", getattr(d, "reasoning_content", None) or ""):
            assert "<|" not in text


def test_thinking_off_tools_declared(env):
    kw = greedy(messages=MSGS, max_tokens=6, tools=TOOLS, tool_choice="auto",
                extra_body={"chat_template_kwargs": {"thinking": False}})
    r = env.client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == len(encode_chat(env.tok, MSGS, TOOLS, thinking=False, tool_choice="auto"))
    msg = r.choices[0].message
    assert msg.model_extra.get("reasoning_content") is None              # no think channel without thinking
    for call in msg.tool_calls or []:
        assert call.type == "function" and call.id
        if r.choices[0].finish_reason == "tool_calls":
            assert isinstance(json.loads(call.function.arguments), dict)
    low = env.client.chat.completions.create(**greedy(messages=MSGS, max_tokens=2, reasoning_effort="low"))
    assert low.usage.prompt_tokens == len(encode_chat(env.tok, MSGS, reasoning_effort="low"))


def test_stop_max_tokens_and_seed(env):
    base = env.client.completions.create(model="k3", prompt="The quick brown fox", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert base.usage.completion_tokens == 12 and base.choices[0].finish_reason == "length"
    cut = next((i for i in range(1, len(text) - 1) if text.find(text[i:i + 2]) == i and text[i:i + 2].strip()), None)
    assert cut is not None, f"no 2-character stop string to cut {text!r} at"
    stop = text[cut:cut + 2]
    r = env.client.completions.create(model="k3", prompt="The quick brown fox", max_tokens=12, temperature=0,
                                      stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 12                              # generation stopped there, not at the limit
    seeded = [env.client.chat.completions.create(model="k3", messages=MSGS, max_tokens=6, temperature=1.0, seed=7,
                                                 extra_body={"ignore_eos": True}) for _ in range(2)]
    a, b = (s.choices[0].message for s in seeded)
    assert (a.content, a.model_extra.get("reasoning_content")) == (b.content, b.model_extra.get("reasoning_content"))


def test_completions_echo_logprobs_score_the_prompt(env):
    """Log-likelihood evaluation: echo + logprobs with max_tokens 0 gives every prompt token's logprob."""
    prompt = "The quick brown fox jumps"
    ids = env.tok.encode(prompt)
    r = env.client.completions.create(model="k3", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    assert "".join(lp.tokens) == prompt and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    again = env.client.completions.create(model="k3", prompt=ids, max_tokens=2, echo=True, logprobs=1, temperature=0)
    lp2 = again.choices[0].logprobs
    assert lp2.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)   # scoring is stable
    assert len(lp2.tokens) == len(ids) + again.usage.completion_tokens


def test_16_concurrent_streams(env):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model="k3", messages=[{"role": "user", "content": f"count to {i}"}], max_tokens=5, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage, [c for c in chunks if c.choices]

    async def run():
        client = openai.AsyncOpenAI(base_url=env.urls["openai"], api_key=KEY, max_retries=0, timeout=WAIT_S)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(16)))
        finally:
            await client.close()
    results = asyncio.run(run())
    for i, (usage, chunks) in enumerate(results):
        assert usage.completion_tokens == 5
        assert usage.prompt_tokens == len(encode_chat(env.tok, [{"role": "user", "content": f"count to {i}"}]))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    assert env.wait_metric(env.urls["metrics"], "k3_max_requests_per_step", lambda v: v > 1) > 1


def test_disconnect_mid_stream_frees_the_slot(env):
    body = {"model": "k3", "messages": MSGS, "max_tokens": 400, "stream": True, "ignore_eos": True,
            "chat_template_kwargs": {"thinking": False}}
    with httpx.Client(timeout=WAIT_S) as c:
        with c.stream("POST", env.urls["openai"] + "/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200, r.read()
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: ")
                if lines >= 3:
                    break
            assert env.metric(env.urls["metrics"], "k3_kda_slots_in_use") >= 1
    assert env.wait_metric(env.urls["metrics"], "k3_kda_slots_in_use", lambda v: v == 0) == 0
    def cached():                                               # prefix caching is on here: blocks it holds
        return env.metric(env.urls["metrics"], "k3_latent_blocks_cached")
    env.wait_metric(env.urls["metrics"], "k3_latent_blocks_in_use", lambda v: v == cached())
    assert env.metric(env.urls["metrics"], "k3_latent_blocks_in_use") == cached()     # the request's own: freed
    assert env.wait_metric(env.front_metrics, "k3_front_requests_running", lambda v: v == 0) == 0


@pytest.mark.parametrize("kw, param", [
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (dict(messages=MSGS, n=2), "n"),
    (dict(messages=MSGS, temperature=3), "temperature"),
    (dict(messages=MSGS, logprobs=True, top_logprobs=30), "top_logprobs"),
    (dict(messages=MSGS, max_tokens=0), "max_tokens"),
    (dict(messages=MSGS, max_tokens=100000), "max_tokens"),
    (dict(messages=MSGS, max_completion_tokens=100000), "max_completion_tokens"),
    (dict(messages=MSGS, seed=2 ** 64), "seed"),
    (dict(messages=MSGS, extra_body={"chat_template_kwargs": {"thinking_effort": "medium"}}),
     "chat_template_kwargs.thinking_effort"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
     "messages[0].content[0]"),
    (dict(messages=MSGS, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     "tool_choice"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].name"),
])
def test_bad_chat_requests_are_400_naming_the_param(env, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        env.client.chat.completions.create(model="k3", **kw)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body


def test_cached_tokens_of_a_resumed_prompt(env):
    """Prefix caching is on in this repository: a request of one generated token leaves its state at the end of its
    prompt; a prompt extending it resumes there, and usage.prompt_tokens_details.cached_tokens says how many prompt
    tokens came from the cache (the first, and a prompt differing in its first token: 0)."""
    rnd = random.Random(5)
    p = [rnd.randrange(3, 700) for _ in range(40)]
    first = env.client.completions.create(**greedy(prompt=p, max_tokens=1, extra_body={"ignore_eos": True}))
    assert first.usage.prompt_tokens == 40 and first.usage.prompt_tokens_details.cached_tokens == 0
    longer = p + [11, 12, 13]
    warm = env.client.completions.create(**greedy(prompt=longer, max_tokens=4, extra_body={"ignore_eos": True}))
    assert warm.usage.prompt_tokens == 43 and warm.usage.prompt_tokens_details.cached_tokens == 40, warm.usage
    cold = env.client.completions.create(**greedy(prompt=[7] + longer[1:], max_tokens=4,
                                                  extra_body={"ignore_eos": True}))
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


def test_cached_tokens_of_a_chat_turn_a_stream_and_a_prompt_list(env):
    """The repository is served with `--enable-prefix-caching --snapshot-interval 16`. A chat's second turn resumes
    inside the history it shares with the first turn's prompt (at least its last 16-token snapshot position,
    less than its whole prompt), streamed with include_usage the same count in the usage chunk; a completions
    request with two prompts extending an earlier one sums both prompts' cached tokens; the server's
    k3_prefix_cache_tokens gauge holds the cached prefixes."""
    msgs = [{"role": "system", "content": "You answer in one word. " * 6}, {"role": "user", "content": "Sky colour?"}]
    kw = dict(max_tokens=5, extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": False}})
    one = env.client.chat.completions.create(**greedy(messages=msgs, **kw))
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = msgs + [{"role": "assistant", "content": one.choices[0].message.content or ""},
                    {"role": "user", "content": "And grass?"}]
    two = env.client.chat.completions.create(**greedy(messages=turn2, **kw))
    p1, p2 = (encode_chat(env.tok, m, thinking=False) for m in (msgs, turn2))
    shared = next(i for i, (a, b) in enumerate(zip(p1 + [-1], p2)) if a != b)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert two.usage.prompt_tokens == len(p2) and shared // INTERVAL * INTERVAL <= cached < len(p2), (cached, shared)
    assert shared >= 2 * INTERVAL
    chunks = list(env.client.chat.completions.create(**greedy(messages=turn2, stream=True,
                                                              stream_options={"include_usage": True}, **kw)))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= cached
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == two.choices[0].message.content
    rnd = random.Random(9)
    p = [rnd.randrange(3, 700) for _ in range(3 * INTERVAL)]
    env.client.completions.create(**greedy(prompt=p, max_tokens=1, extra_body={"ignore_eos": True}))
    both = env.client.completions.create(**greedy(prompt=[p + [5, 6], p + [7]], max_tokens=2,
                                                  extra_body={"ignore_eos": True}))
    assert both.usage.prompt_tokens == 2 * len(p) + 3
    assert both.usage.prompt_tokens_details.cached_tokens == 2 * len(p), both.usage
    assert env.wait_metric(env.urls["metrics"], "k3_prefix_cache_tokens", lambda v: v >= len(p)) >= len(p)


def test_bad_requests_leave_the_server_serving(env):
    with pytest.raises(openai.BadRequestError) as e:
        env.client.completions.create(model="k3", prompt=[1, 10 ** 6], max_tokens=2)
    assert e.value.param == "prompt"
    r = httpx.post(env.urls["openai"] + "/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        env.client.chat.completions.create(model="gpt-4", messages=MSGS)
    ok = env.client.chat.completions.create(**greedy(messages=MSGS, max_tokens=2))
    assert ok.usage.completion_tokens >= 1


def test_launcher_stops_both_cleanly(env):
    """Last: SIGTERM to `serve.launch` stops the front and tritonserver, exit code 0, ports closed."""
    env.proc.send_signal(signal.SIGTERM)
    assert env.proc.wait(timeout=90) == 0
    for url in (env.urls["openai"], env.urls["grpc"]):
        host, port = re.search(r"([\d.]+):(\d+)", url).groups()
        with socket.socket() as s:
            assert s.connect_ex((host, int(port))) != 0
