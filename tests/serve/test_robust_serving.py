"""A hostile but ordinary user against a served k3-tiny (real tritonserver from nvidia-pytriton on loopback, behind
the launcher's HTTP front): one bad request or a vanishing client never harms anyone else.

One server for the module. Its checkpoint has a NaN in the embedding row of one token (POISON, chosen so that no
healthy request here reaches it): a request holding that token is the poisoned one; every other request must give
exactly the tokens of its solo run (runtime.api.LLM on the clean checkpoint, one request at a time).
"""
from __future__ import annotations

import importlib.util
import json
import random
import signal
import threading

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient[all] not installed")
pytest.importorskip("aiohttp", reason="aiohttp not installed (the serve extra)")
if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton not installed (pip install nvidia-pytriton)", allow_module_level=True)

from k3client import WAIT_S, generate, grpc_stream, http_child, http_post, metric, req, tokens_of, wait_metric  # noqa: E402
from poison import poison_copy  # noqa: E402

from k3deploy.runtime.api import LLM, SamplingParams  # noqa: E402
from k3deploy.serve import repository as repo_mod  # noqa: E402
from k3deploy.serve.launch import TritonServer, free_ports  # noqa: E402

EMBED = "language_model.model.embed_tokens.weight"
CASE1 = ([3, 10, 17, 24, 31], [9, 9, 9])


def _chaos_plan(vocab: int) -> list[dict]:
    """32 requests: kind, prompt, sampling fields (HTTP names), and what the client does."""
    rnd = random.Random(7)

    def p():
        return [rnd.randrange(3, vocab) for _ in range(rnd.randint(2, 12))]
    plan = []
    for i in range(8):
        plan.append({"kind": "grpc", "prompt": p(), "n": rnd.randint(2, 6)})
    for i in range(6):
        plan.append({"kind": "grpc_cancel", "prompt": p(), "n": 40, "cancel_after": rnd.randint(1, 3), "end_id": -1})
    for i in range(6):
        plan.append({"kind": "sse", "prompt": p(), "n": rnd.randint(2, 6)})
    for i in range(4):
        sampling = {"temperature": 1e-38, "random_seed": i} if i % 2 else {"temperature": 0.8, "random_seed": 100 + i}
        plan.append({"kind": "http", "prompt": p(), "n": rnd.randint(2, 6), **sampling})
    for i in range(6):
        plan.append({"kind": "kill", "prompt": p(), "n": 2000, "end_id": -1, "streaming": bool(i % 2),
                     "after": rnd.uniform(0.2, 1.5)})
    plan.append({"kind": "grpc", "prompt": p(), "n": 6, "temperature": 1e-38, "random_seed": 5})
    plan.append({"kind": "poison", "prompt": None, "n": 6})
    rnd.shuffle(plan)
    return plan


def _params(r: dict) -> SamplingParams:
    """The runtime's SamplingParams equal to a request's Triton fields (end_id -1: no EOS)."""
    n = r["cancel_after"] if r["kind"] == "grpc_cancel" else r["n"]       # a cancelled stream: its first tokens
    t = float(np.float32(r.get("temperature", 0.0)))                      # what the model receives: FP32
    return SamplingParams(max_tokens=n, temperature=t, seed=r.get("random_seed"), ignore_eos="end_id" in r)


class Env:
    def __init__(self, server: TritonServer, solo, vocab: int, poison: int, plan: list[dict]):
        self.server, self.solo, self.vocab, self.poison, self.plan = server, solo, vocab, poison, plan
        self.http, self.grpc, self.metrics = server.http_url, server.grpc_url, server.metrics_url

    def idle(self) -> None:
        """Every slot and block back (the server's own gauges)."""
        assert wait_metric(self.metrics, "k3_kda_slots_in_use", lambda v: v == 0) == 0
        assert wait_metric(self.metrics, "k3_latent_blocks_in_use", lambda v: v == 0) == 0


@pytest.fixture(scope="module")
def env(tiny_ckpt, tiny_cfg, tmp_path_factory):
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                                  # the reference's many small ops: one thread is faster
    vocab = tiny_cfg.vocab_size
    plan = _chaos_plan(vocab)
    cache: dict = {}
    clean = LLM(tiny_ckpt, backend="torch", max_batch=8)

    def solo(prompt, params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params)
        if key not in cache:
            out = clean.generate([list(prompt)], params)[0]
            assert out.error is None, out
            cache[key] = out.token_ids
        return cache[key]
    used = {t for p in CASE1 for t in p}
    for r in plan:
        if r["prompt"] is not None and r["kind"] != "kill":
            used |= set(r["prompt"]) | set(solo(r["prompt"], _params(r)))
    for p in CASE1 + ([1, 2, 3], [4, 4]):
        used |= set(p) | set(solo(p, SamplingParams(max_tokens=8)))
    poison = next(t for t in range(3, vocab) if t not in used)
    tmp = tmp_path_factory.mktemp("robust")
    bad = poison_copy(tiny_ckpt, tmp / "ckpt", EMBED, (poison, 0))
    repo_mod.write_repository(bad, tmp / "repo", "torch", max_batch=8)
    h, g, m = free_ports(3)
    with TritonServer(tmp / "repo", h, g, m, exit_timeout=5, startup_timeout=600) as srv:
        yield Env(srv, solo, vocab, poison, plan)
    clean.shutdown()
    torch.set_num_threads(threads)


def _body(prompt, n, **extra) -> dict:
    return {"input_ids": list(prompt), "request_output_len": n, **extra}


# ---- 1. a vanishing temperature beside greedy requests -----------------------------------------------------------

def test_tiny_temperature_harms_no_one(env):
    """Two concurrent HTTP generate bodies, one with temperature=1e-38: no error came back and the greedy requests
    got wrong tokens (the sampler's NaN was raised after the step had advanced the pools)."""
    a, b = CASE1
    out = {}
    ts = [threading.Thread(target=lambda: out.__setitem__("a", generate(env.http, _body(a, 8)))),
          threading.Thread(target=lambda: out.__setitem__("b", generate(env.http, _body(b, 8, temperature=1e-38,
                                                                                        random_seed=1))))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(WAIT_S)
    for k, p in (("a", a), ("b", b)):                       # T -> 0 is greedy
        status, objs = out[k]
        assert status == 200, objs
        assert tokens_of(objs) == env.solo(p, SamplingParams(max_tokens=8)), k
    env.idle()


# ---- 2. request bodies the bundled Triton crashes on ---------------------------------------------------------

@pytest.mark.parametrize("path,mb,chunked", [("generate", 4, False), ("infer", 8, False), ("generate", 50, False),
                                             ("generate_stream", 4, True)])
def test_large_bodies_get_413_and_the_server_lives(env, path, mb, chunked):
    """~4 MB on /generate (8 MB on /infer) killed tritonserver with SIGSEGV."""
    ids = ",".join(["5"] * (mb << 19))                       # "5," per id: mb MiB of JSON
    body = f'{{"input_ids":[{ids}],"request_output_len":1}}'.encode()
    if chunked:                                              # no Content-Length: cut while reading
        import http.client
        host, port = env.http.rsplit(":", 1)
        c = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        c.request("POST", f"/v2/models/k3/{path}", body=(body[i:i + 65536] for i in range(0, len(body), 65536)),
                  encode_chunked=True)
        r = c.getresponse()
        status, text = r.status, r.read().decode()
        c.close()
    else:
        status, text = http_post(env.http, f"/v2/models/k3/{path}", body)
    assert status == 413, (status, text[:300])
    assert "exceeds the limit of 3,145,728 bytes" in json.loads(text.split("data: ")[-1])["error"]
    assert env.server.is_alive() and env.server.is_ready() and env.server.failure is None
    status, objs = generate(env.http, _body([1, 2, 3], 8))
    assert status == 200 and tokens_of(objs) == env.solo([1, 2, 3], SamplingParams(max_tokens=8))


# ---- 5. a client killed mid-request is cancelled ---------------------------------------------------------------

@pytest.mark.parametrize("path,streaming", [("generate_stream", False), ("generate_stream", True),
                                            ("generate", False)])
def test_killed_http_client_frees_its_slot(env, path, streaming):
    """5 killed curls on generate_stream kept 5 of 8 slots until all their tokens were generated."""
    env.idle()
    before = metric(env.metrics, "k3_tokens_generated")
    body = _body([3, 1, 4], 4000, end_id=-1, **({"streaming": True} if streaming else {}))
    child = http_child(env.http, f"/v2/models/k3/{path}", body)
    try:
        assert wait_metric(env.metrics, "k3_kda_slots_in_use", lambda v: v >= 1) >= 1
        assert wait_metric(env.metrics, "k3_tokens_generated", lambda v: v >= before + 2) >= before + 2
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    env.idle()
    assert metric(env.metrics, "k3_tokens_generated") - before < 4000     # cancelled, not run to the end


# ---- 7. small fields, one clear error each ---------------------------------------------------------------------

def _cases(vocab):
    return [
        ("request_output_len 10^9", _body([1, 2, 3], 10 ** 9), "request_output_len: 1000000000 plus the prompt's 3 "
                                                              "tokens exceed max_context"),
        ("int32 wrap", _body([1, 2, 3], 99999999999), "request_output_len: 99999999999 does not fit INT32"),
        ("id wrap", _body([99999999999], 4), "input_ids: 99999999999 does not fit INT32"),
        ("end_id >= vocab", _body([1, 2], 4, end_id=vocab), f"end_id: {vocab} outside [0, vocab_size={vocab})"),
        ("stop word >= vocab", _body([1, 2], 4, stop_words_list=[[[vocab + 5], [1]]]),
         f"stop_words_list / bad_words_list: ids [{vocab + 5}]"),
        ("unknown field", _body([1, 2], 4, request_output_len2=3), "unknown field 'request_output_len2'"),
        ("bool as int", _body([1, 2], True), "request_output_len: true is not an integer"),
        ("NaN literal", None, "NaN is not a JSON number"),
        ("malformed JSON", None, "request body is not valid JSON: Expecting ',' delimiter at line 1 column 22"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_small_cases_name_the_field(env, case):
    label, body, needle = _cases(env.vocab)[case]
    raw = {"NaN literal": b'{"input_ids": [1], "request_output_len": 2, "temperature": NaN}',
           "malformed JSON": b'{"input_ids": [1, 2] "request_output_len": 4}'}.get(label)
    status, text = http_post(env.http, "/v2/models/k3/generate", raw if raw is not None else json.dumps(body).encode())
    assert status == 400, (label, status, text)             # was 200 / 500
    assert needle in json.loads(text)["error"], (label, text)
    assert env.server.is_ready()


def test_grpc_limits_name_the_field(env):
    big = grpc_stream(env.grpc, req([1, 2, 3], 10 ** 9))
    assert big["error"] and "request_output_len: 1000000000" in big["error"] and "send at most" in big["error"]
    end = grpc_stream(env.grpc, req([1, 2], 4, end_id=np.array([env.vocab], np.int32)))
    assert end["error"] and f"end_id: {env.vocab}" in end["error"]
    ok = grpc_stream(env.grpc, req([4, 4], 8))
    assert ok["error"] is None and ok["tokens"] == env.solo([4, 4], SamplingParams(max_tokens=8))


# ---- chaos -------------------------------------------------------------------------------------------------

def test_chaos_32_streams_cancels_kills_and_one_poisoned(env):
    """32 concurrent requests over gRPC and HTTP: 6 cancelled by their gRPC client, 6 HTTP clients SIGKILLed
    mid-request, one vanishing temperature, one poisoned (its prompt holds the NaN-embedding token): every healthy
    request's tokens equal its solo run, the poisoned one ends with an error naming non-finite logits, and every
    slot and block comes back."""
    env.idle()
    before = metric(env.metrics, "k3_tokens_generated")
    results: dict[int, object] = {}
    errors: list = []

    def fields(r) -> dict:
        f = {k: r[k] for k in ("temperature", "random_seed", "end_id", "streaming") if k in r}
        return f

    def run(i, r):
        try:
            prompt = r["prompt"] if r["prompt"] is not None else [7, env.poison, 9]
            f = fields(r)
            if r["kind"] in ("grpc", "grpc_cancel", "poison"):
                np_f = {k: np.array([v], {"temperature": np.float32, "random_seed": np.uint64, "end_id": np.int32,
                                          "streaming": np.bool_}[k]) for k, v in f.items()}
                np_f["streaming"] = np.array([True])
                results[i] = grpc_stream(env.grpc, req(prompt, r["n"], **np_f), cancel_after=r.get("cancel_after"))
            elif r["kind"] in ("sse", "http"):
                results[i] = generate(env.http, _body(prompt, r["n"], **f, **({"streaming": True} if r["kind"] == "sse"
                                                                                else {})), stream=r["kind"] == "sse")
            else:                                            # kill
                child = http_child(env.http, f"/v2/models/k3/generate{'_stream' if r['streaming'] else ''}",
                                   _body(prompt, r["n"], **f))
                threading.Event().wait(r["after"])
                child.send_signal(signal.SIGKILL)
                child.wait()
                results[i] = "killed"
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((i, r["kind"], e))
    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(env.plan)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    assert not errors, errors
    assert len(results) == 32
    for i, r in enumerate(env.plan):
        got = results[i]
        if r["kind"] == "poison":
            assert got["error"] and "not finite" in got["error"] and got["tokens"] == [], got
        elif r["kind"] == "kill":
            assert got == "killed"
        elif r["kind"] in ("grpc", "grpc_cancel"):
            assert got["error"] is None, (r, got)
            assert got["tokens"] == env.solo(r["prompt"], _params(r)), r
        else:
            status, objs = got
            assert status == 200 and all("error" not in o for o in objs), (r, objs)
            assert tokens_of(objs) == env.solo(r["prompt"], _params(r)), r
    env.idle()
    assert metric(env.metrics, "k3_tokens_generated") - before < 6 * 2000     # the killed clients were cancelled
    assert env.server.failure is None and env.server.is_ready()
