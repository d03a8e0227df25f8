"""The OpenAI front's tool-call path with a scripted token model (no tritonserver): the official `openai` client
over the front's ASGI app sees the tool call K3's XTML output encodes, streamed and not, whatever the weights."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from starlette.testclient import TestClient  # noqa: E402

from k3deploy.runtime.chat import encode_chat  # noqa: E402
from k3deploy.runtime.tokenizer import Tokenizer  # noqa: E402
from k3deploy.serve.openai import FrontConfig, Step, create_app  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"id": "c0", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
USER = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedModel:
    """Stands in for TritonBackend: answers every request with `tokens`, two per response, then "stop"."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.prompts = tokens, []

    async def ready(self) -> bool:
        return True

    async def generate(self, rid, ids, sampling, images=()):
        self.prompts.append(list(ids))
        for i in range(0, len(self.tokens), 2):
            last = i + 2 >= len(self.tokens)
            yield Step(self.tokens[i:i + 2], [], [], finish_reason="stop" if last else None)


@pytest.fixture(scope="module")
def front(tiny_ckpt):
    tok = Tokenizer.from_file(tiny_ckpt / "tiktoken.model")
    prompt = encode_chat(tok, USER, TOOLS, thinking=False)
    full = encode_chat(tok, USER + [CALL], TOOLS, thinking=False, add_generation_prompt=False)
    assert full[:len(prompt)] == prompt
    model = ScriptedModel(full[len(prompt):])                   # what the model writes after the prompt
    app = create_app(model, tok, FrontConfig(max_context=4096))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http), model, prompt


def test_tool_call_non_streamed(front):
    client, model, prompt = front
    r = client.chat.completions.create(model="k3", messages=USER, tools=TOOLS, max_tokens=64,
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    assert model.prompts[-1] == prompt                            # the request's tools reached the prompt
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert not choice.message.content


def test_tool_call_streamed_equals_non_streamed(front):
    client, _, _ = front
    chunks = list(client.chat.completions.create(model="k3", messages=USER, tools=TOOLS, max_tokens=64, stream=True,
                                                 extra_body={"chat_template_kwargs": {"thinking": False}}))
    calls = [c for ch in chunks for d in ch.choices for c in (d.delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather" and calls[0].id
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris", "days": 2}
    assert {c.index for c in calls} == {0}
    assert [d.finish_reason for ch in chunks for d in ch.choices if d.finish_reason] == ["tool_calls"]
