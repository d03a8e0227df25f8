"""runtime/chat.py: K3's XTML chat encoding (CHAT.md §2) and the output parser (§3).

The golden segment lists below were transcribed by hand from the reference renderer (vLLM's
vllm/tokenizers/encoding_k3.py, "Source: huggingface.co/moonshotai/Kimi-K3/blob/main/encoding_k3.py"): each open tag
is <|open|>, tag, then " key", '="', value, '"' per attribute, then <|sep|>; empty text segments are dropped.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3deploy.runtime.chat import OutputParser, encode_chat, merge_deltas, parse_output, render_chat
from k3deploy.runtime.tokenizer import Tokenizer

O, C, S, E = ("<|open|>", True), ("<|close|>", True), ("<|sep|>", True), ("<|end_of_msg|>", True)
EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
          "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
          "`thinking_effort={}`.")


def golden(*items):
    return [it if isinstance(it, tuple) else (it, False) for it in items]


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Tokenizer.from_file(tiny_ckpt / "tiktoken.model")


# ---- rendering: golden segments -----------------------------------------------------------------------------
def test_default_prompt_golden():
    got = render_chat([{"role": "user", "content": "Hi"}])
    assert got == golden(
        O, "message", " role", '="', "system", '"', " type", '="', "thinking-effort", '"', S, EFFORT.format("max"),
        C, "message", S, E,
        O, "message", " role", '="', "user", '"', S, "Hi", C, "message", S, E,
        O, "message", " role", '="', "assistant", '"', S, O, "think", S)


def test_tools_choice_format_no_thinking_golden():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "城市"}}}}}]
    msgs = [{"role": "system", "content": "Be brief.", "name": "ops"},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]}]
    got = render_chat(msgs, tools, thinking=False, tool_choice="required", response_format={"type": "json_object"})
    tools_json = ('[{"function":{"name":"get_weather","parameters":{"properties":{"city":{"description":"城市",'
                  '"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]')
    assert got == golden(
        O, "message", " role", '="', "system", '"', " type", '="', "tool-declare", '"', S,
        "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n" + tools_json + "\n```",
        C, "message", S, E,
        O, "message", " role", '="', "system", '"', " name", '="', "ops", '"', S, "Be brief.", C, "message", S, E,
        O, "message", " role", '="', "user", '"', S, "Weather in ", "Paris?", C, "message", S, E,
        O, "message", " role", '="', "system", '"', " type", '="', "tool-choice", '"', S,
        "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        C, "message", S, E,
        O, "message", " role", '="', "system", '"', " type", '="', "response-format", '"', S,
        "The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data without "
        "markdown code blocks (```json) or any additional formatting.", C, "message", S, E,
        O, "message", " role", '="', "assistant", '"', S, O, "response", S)


def test_tool_round_golden():
    """Assistant reasoning + tool calls of every argument type, results given out of order (re-sorted by
    tool_call_id, name from the matched call), attribute escaping, reasoning_effort as the effort."""
    msgs = [
        {"role": "user", "content": "go", "name": 'R&D "team"'},
        {"role": "assistant", "reasoning_content": "Need two calls.", "content": "Calling.", "tool_calls": [
            {"id": "a1", "type": "function", "function": {"name": "search", "arguments": json.dumps(
                {"q": "k3", "n": 3, "exact": True, "lang": None, "opts": {"b": 1, "a": [1, "x"]}, "tags": ["x", 2]})}},
            {"id": "b2", "type": "function", "function": {"name": "echo", "arguments": {"text": "é <|open|>"}}}]},
        {"role": "tool", "tool_call_id": "b2", "content": "echoed"},
        {"role": "tool", "tool_call_id": "a1", "content": "found"},
    ]
    got = render_chat(msgs, reasoning_effort="low")
    assert got == golden(
        O, "message", " role", '="', "system", '"', " type", '="', "thinking-effort", '"', S, EFFORT.format("low"),
        C, "message", S, E,
        O, "message", " role", '="', "user", '"', " name", '="', "R&amp;D &quot;team&quot;", '"', S, "go",
        C, "message", S, E,
        O, "message", " role", '="', "assistant", '"', S,
        O, "think", S, "Need two calls.", C, "think", S,
        O, "response", S, "Calling.", C, "response", S,
        O, "tools", S,
        O, "call", " tool", '="', "search", '"', " index", '="', "1", '"', S,
        O, "argument", " key", '="', "q", '"', " type", '="', "string", '"', S, "k3", C, "argument", S,
        O, "argument", " key", '="', "n", '"', " type", '="', "number", '"', S, "3", C, "argument", S,
        O, "argument", " key", '="', "exact", '"', " type", '="', "boolean", '"', S, "true", C, "argument", S,
        O, "argument", " key", '="', "lang", '"', " type", '="', "null", '"', S, "null", C, "argument", S,
        O, "argument", " key", '="', "opts", '"', " type", '="', "object", '"', S, '{"b": 1, "a": [1, "x"]}',
        C, "argument", S,
        O, "argument", " key", '="', "tags", '"', " type", '="', "array", '"', S, '["x", 2]', C, "argument", S,
        C, "call", S,
        O, "call", " tool", '="', "echo", '"', " index", '="', "2", '"', S,
        O, "argument", " key", '="', "text", '"', " type", '="', "string", '"', S, "é <|open|>", C, "argument", S,
        C, "call", S,
        C, "tools", S, C, "message", S, E,
        O, "message", " role", '="', "tool", '"', " tool", '="', "search", '"', " index", '="', "1", '"', S, "found",
        C, "message", S, E,
        O, "message", " role", '="', "tool", '"', " tool", '="', "echo", '"', " index", '="', "2", '"', S, "echoed",
        C, "message", S, E,
        O, "message", " role", '="', "assistant", '"', S, O, "think", S)


def test_json_block_dynamic_tools_schema_golden():
    """Arguments that are not JSON go in a `json` element as written; blank reasoning leaves the think element empty;
    a system message with tools declares them dynamically; json_schema's schema sorted; no generation prompt."""
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    msgs = [{"role": "system", "tools": [{"type": "function", "function": {"name": "f"}}]},
            {"role": "assistant", "reasoning_content": "  ", "content": None,
             "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]},
            {"role": "tool", "content": [{"type": "text", "text": "ok"}]}]
    got = render_chat(msgs, thinking_effort="high", add_generation_prompt=False,
                      response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert got == golden(
        O, "message", " role", '="', "system", '"', " type", '="', "thinking-effort", '"', S, EFFORT.format("high"),
        C, "message", S, E,
        O, "message", " role", '="', "system", '"', " type", '="', "tool-declare", '"', S,
        "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to all "
        "existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
        '[{"function":{"name":"f"},"type":"function"}]\n```', C, "message", S, E,
        O, "message", " role", '="', "assistant", '"', S, O, "think", S, C, "think", S, O, "response", S,
        C, "response", S, O, "tools", S,
        O, "call", " tool", '="', "f", '"', " index", '="', "1", '"', S,
        O, "json", " type", '="', "object", '"', S, "{not json", C, "json", S, C, "call", S, C, "tools", S,
        C, "message", S, E,
        O, "message", " role", '="', "tool", '"', " tool", '="', "f", '"', " index", '="', "1", '"', S, "ok",
        C, "message", S, E,
        O, "message", " role", '="', "system", '"', " type", '="', "response-format", '"', S,
        "The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON data without "
        "markdown code blocks (```json) or any additional formatting.\nThe JSON data must match the following "
        'schema:\n```json\n{"properties":{"a":{"type":"integer"},"b":{"type":"string"}},"type":"object"}\n```',
        C, "message", S, E)


def test_thinking_switches():
    off = render_chat([{"role": "user", "content": "x"}], reasoning_effort="none")
    assert off == render_chat([{"role": "user", "content": "x"}], enable_thinking=False)
    assert off == render_chat([{"role": "user", "content": "x"}], thinking=False, enable_thinking=True)
    assert off[-3:] == [O, ("response", False), S] and all("thinking-effort" != t for t, _ in off)
    # thinking_effort wins over reasoning_effort
    assert (render_chat([], reasoning_effort="low", thinking_effort="max")
            == render_chat([], thinking_effort="max"))


@pytest.mark.parametrize("kwargs, field", [
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (dict(messages=["hi"]), "messages[0]"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].name"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}]),
     "messages[0].tool_calls[0].function.arguments"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
     "messages[0].tool_calls[0].function.name"),
    (dict(messages=[], thinking_effort="medium"), "thinking_effort"),
    (dict(messages=[], reasoning_effort="minimal"), "reasoning_effort"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
    (dict(messages=[{"role": "user", "content": [{"type": "audio"}]}]), "messages[0].content[0].type"),
    (dict(messages=[], response_format={"type": "xml"}), "response_format.type"),
    (dict(messages=[], response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(messages=[], tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (dict(messages=[], thinking="yes"), "thinking"),
])
def test_invalid_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        render_chat(**kwargs)
    assert str(e.value).startswith(field), str(e.value)


# ---- tokens -------------------------------------------------------------------------------------------------
def test_encode_chat_tokenizes_each_segment_alone(tok):
    msgs = [{"role": "user", "content": "<|open|>message<|sep|> hi"}]
    ids = encode_chat(tok, msgs)
    segs = render_chat(msgs)
    want = []
    for text, special in segs:
        want += [tok.special_id(text)] if special else tok.encode(text)
    assert ids == want
    specials = [i for i in ids if tok.is_special(i)]
    assert len(specials) == sum(sp for _, sp in segs)                  # the user's "<|open|>" stayed text
    assert tok.decode(ids).count("<|open|>message<|sep|> hi") == 1


# ---- parsing -------------------------------------------------------------------------------------------------
def _assistant_ids(tok, message, thinking=True):
    """The ids the model would write after the generation prompt for `message`."""
    user = [{"role": "user", "content": "q"}]
    prompt = encode_chat(tok, user, thinking=thinking)
    full = encode_chat(tok, user + [message], thinking=thinking, add_generation_prompt=False)
    assert full[:len(prompt)] == prompt
    return full[len(prompt):]


ARG_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 6, 10 ** 6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reasoning=st.text(max_size=30), content=st.text(max_size=30), thinking=st.booleans(),
       calls=st.lists(st.tuples(st.text(min_size=1, max_size=8), st.dictionaries(st.text(max_size=6), ARG_VALUES,
                                                                                 max_size=4)), max_size=3))
def test_render_then_parse_round_trip(tok, reasoning, content, thinking, calls):
    msg = {"role": "assistant", "reasoning_content": reasoning, "content": content,
           "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                          for i, (n, a) in enumerate(calls)]}
    got = parse_output(tok, _assistant_ids(tok, msg, thinking), thinking)
    assert got["reasoning_content"] == (reasoning if thinking and reasoning.strip() else "")
    assert got["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]] == calls


LETTERLESS = st.text(alphabet="0123456789 .,!?-+=:;()\n\t模型思考🙂é", max_size=6)
NAMES = st.text(alphabet="abcxyz_", min_size=1, max_size=5)


@st.composite
def token_streams(draw, tok):
    """Random generated streams: text without letters, stray specials, well-formed and broken markers."""
    O_, C_, S_, E_ = (tok.special_id(s) for s in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))
    enc = tok.encode
    out = []
    for _ in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["text", "text", "special", "marker", "marker", "call", "arg", "broken"]))
        if kind == "text":
            out += enc(draw(LETTERLESS))
        elif kind == "special":
            out.append(draw(st.integers(tok.num_ranks, tok.n_vocab - 1).filter(lambda i: i != E_)))
        elif kind == "marker":
            tag = draw(st.sampled_from(["think", "response", "tools", "call", "argument", "json", "message"]))
            out += [draw(st.sampled_from([O_, C_]))] + enc(tag) + [S_]
        elif kind == "call":
            out += [O_] + enc("call") + enc(" tool") + enc('="') + enc(draw(NAMES)) + enc('"') + [S_]
        elif kind == "arg":
            typ = draw(st.sampled_from(["string", "number", "boolean", "null", "object", "array"]))
            out += [O_] + enc("argument") + enc(" key") + enc('="') + enc(draw(NAMES)) + enc('"') + enc(" type")
            out += enc('="') + enc(typ) + enc('"') + [S_] + enc(draw(LETTERLESS)) + [C_] + enc("argument") + [S_]
        else:
            out += [draw(st.sampled_from([O_, C_]))] + enc(draw(st.sampled_from(["resp", "too", "ca"])))
    if draw(st.booleans()):
        out.append(E_)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), thinking=st.booleans())
def test_streamed_deltas_equal_the_whole(tok, data, thinking):
    ids = data.draw(token_streams(tok))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    whole = parse_output(tok, ids, thinking)
    p = OutputParser(tok, thinking)
    deltas, prev = [], 0
    for c in cuts + [len(ids)]:
        deltas.append(p.feed(ids[prev:c]))
        prev = c
    deltas.append(p.finish())
    assert merge_deltas(deltas) == whole == p.result()
    for d in deltas:                                   # text is letterless: a letter would be marker text leaking
        for key in ("content", "reasoning_content"):
            assert not any(ch.isascii() and ch.isalpha() for ch in d.get(key, "")), d
            assert "<|" not in d.get(key, "")
    for call in whole["tool_calls"][:p.completed_calls]:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    if not thinking:
        assert whole["reasoning_content"] == ""


def test_parser_channels_and_split_markers(tok):
    """Reasoning, then content, then a tool call; the markers split across feeds never leak."""
    msg = {"role": "assistant", "reasoning_content": "think 1", "content": "answer",
           "tool_calls": [{"function": {"name": "f", "arguments": {"s": "a\"b", "n": 2}}}]}
    ids = _assistant_ids(tok, msg)
    p = OutputParser(tok, tool_call_id_prefix="call_x")
    deltas = [p.feed([t]) for t in ids] + [p.finish()]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "think 1"
    assert "".join(d.get("content", "") for d in deltas) == "answer"
    args = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])]
    assert len(args) > 3 and json.loads("".join(args)) == {"s": 'a"b', "n": 2}   # arguments stream in pieces
    first = next(c for d in deltas for c in d.get("tool_calls", []))
    assert first["id"] == "call_x0" and first["function"]["name"] == "f"
    assert p.done and p.completed_calls == 1 and not p.open_call
    c, call = tok.special_id("<|close|>"), tok.encode("call")
    end = next(i for i in range(len(ids)) if ids[i] == c and ids[i + 1:i + 1 + len(call)] == call)
    q = OutputParser(tok)
    q.feed(ids[:end])
    q.finish()
    cut = q.result()["tool_calls"][0]["function"]["arguments"]             # cut inside the call: left as it stood
    assert q.open_call and q.completed_calls == 0 and cut == '{"s": "a\\"b", "n": 2'


# ---- images (VISION.md §8.1, pre-expanded §8.3) --------------------------------------------------------------
class _Img:
    def __init__(self, width, height, num_tokens):
        self.width, self.height, self.num_tokens = width, height, num_tokens


def test_image_parts_render_pre_expanded_blocks_in_order():
    """Every client form of an image part becomes <|media_begin|> `image WxH` <|media_content|> N x <|media_pad|>
    <|media_end|> where it stands; the loader sees the parts' sources and fields in prompt order."""
    seen = []

    def load(source, field):
        seen.append((source, field))
        return _Img(30 + len(seen), 16, len(seen))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "A"},
                                         {"type": "image_url", "image_url": {"url": "data:a", "detail": "low"}},
                                         {"type": "image_url", "image_url": "data:b"}]},
            {"role": "user", "content": [{"type": "image", "image": "data:c"}, {"type": "image", "url": "data:d"},
                                         {"type": "text", "text": "B"}]}]
    got = render_chat(msgs, thinking=False, load_image=load)
    pad, begin, content, end = ("<|media_pad|>", True), ("<|media_begin|>", True), ("<|media_content|>", True), \
        ("<|media_end|>", True)

    def block(w, n):
        return [begin, (f"image {w}x16", False), content] + [pad] * n + [end]
    assert got == golden(
        O, "message", " role", '="', "user", '"', S, "A", *block(31, 1), *block(32, 2), C, "message", S, E,
        O, "message", " role", '="', "user", '"', S, *block(33, 3), *block(34, 4), "B", C, "message", S, E,
        O, "message", " role", '="', "assistant", '"', S, O, "response", S)
    assert seen == [("data:a", "messages[0].content[1]"), ("data:b", "messages[0].content[2]"),
                    ("data:c", "messages[1].content[0]"), ("data:d", "messages[1].content[1]")]


@pytest.mark.parametrize("part, field", [
    ({"type": "image_url"}, "messages[0].content[0].image_url.url"),
    ({"type": "image_url", "image_url": {"url": ""}}, "messages[0].content[0].image_url.url"),
    ({"type": "image", "image": 3}, "messages[0].content[0].image"),
])
def test_image_part_without_a_url_names_the_field(part, field):
    with pytest.raises(ValueError) as e:
        render_chat([{"role": "user", "content": [part]}], load_image=lambda s, f: _Img(1, 1, 1))
    assert str(e.value).startswith(field), str(e.value)


def test_encode_chat_images_with_the_processor(tok, tmp_path):
    """(ids, images) with runtime.vision.process_image as the loader: the pads = each image's num_tokens, in order,
    and the ids = the text prompt's segments around the two blocks."""
    from PIL import Image
    from k3deploy.runtime.chat import encode_chat_images, media_segments
    from k3deploy.runtime.vision import ProcessorConfig, image_tokens, process_image
    proc = ProcessorConfig(in_patch_limit=1024, patch_limit_on_one_side=48)
    Image.new("RGB", (60, 44), (200, 10, 10)).save(tmp_path / "a.png")
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(tmp_path / "a.png")}},
                                         {"type": "text", "text": "and"},
                                         {"type": "image", "image": str(tmp_path / "a.png")}]}]
    ids, images = encode_chat_images(tok, msgs, load_image=lambda s, f: process_image(s, proc, f), thinking=False)
    n = image_tokens(60, 44, proc)
    assert [im.num_tokens for im in images] == [n, n] and n == 6
    pad = tok.special_id("<|media_pad|>")
    assert ids.count(pad) == 2 * n
    want = render_chat([{"role": "user", "content": "X"}], thinking=False)
    i = want.index(("X", False))
    want = want[:i] + media_segments(60, 44, n) + [("and", False)] + media_segments(60, 44, n) + want[i + 1:]
    assert ids == tok.encode_segments(want)
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[0\]: image content needs the vision processor"):
        encode_chat(tok, msgs)
