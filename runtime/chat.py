"""K3's XTML chat encoding and the parser of what the model writes back (CHAT.md §2, §3).

    ids = encode_chat(tok, messages, tools, thinking=True, tool_choice="auto")    # the prompt, token ids
    parser = OutputParser(tok, thinking=True)
    for token in generated: delta = parser.feed([token])                           # OpenAI delta dicts
    parser.finish(); parser.result()                                               # the same, run to the end

Rendering emits segments `(text, special)`; each is tokenized on its own and a special segment is one special id, so
user-, tool- and attribute-supplied text is always ordinary text. Markers: open tag = `<|open|>` + tag + attributes
(` key`, `="`, escaped value, `"`) + `<|sep|>`; close tag = `<|close|>` + tag + `<|sep|>`; a message ends with
`<|end_of_msg|>`. Invalid input is one ValueError naming the field (`messages[2].tool_calls[0].function.arguments`).

The output parser is one incremental state machine over generated token ids: text goes to the channel it is in
(reasoning in `think`, content in `response`, tool-call arguments in `tools`), markers never reach a delta (the
text between a `<|open|>`/`<|close|>` and its `<|sep|>` is held until the marker is complete), UTF-8 split across
tokens is held until complete, and each tool call's `arguments` streams as a JSON object as the values arrive:
string values character by character, other values when their element closes. A finished call's arguments are
valid JSON; a call cut off by the length limit is left as it stood.
"""
from __future__ import annotations

import codecs
import json
from typing import Any, Iterable, Sequence

Segment = tuple[str, bool]          # (text, special): special text is one special token's name

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MEDIA_BEGIN, MEDIA_CONTENT = "<|media_begin|>", "<|media_content|>"
MEDIA_END, MEDIA_PAD = "<|media_end|>", "<|media_pad|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"     # where an image goes in plain text (VISION.md §8.1)
THINKING_EFFORTS = ("low", "high", "max")
ROLES = ("system", "user", "assistant", "tool")

__all__ = ["encode_chat", "encode_chat_images", "render_chat", "thinking_enabled", "image_segments", "image_source",
           "media_segments", "text_image_segments", "OutputParser", "parse_output", "merge_deltas", "Segment",
           "THINKING_EFFORTS"]


# ---- segments ---------------------------------------------------------------------------------------------
def _text(s: Any) -> list[Segment]:
    s = str(s)
    return [(s, False)] if s else []


def _escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    out: list[Segment] = [(OPEN, True), *_text(tag)]
    for key, value in attrs:
        out += _text(f" {key}") + _text('="') + _text(_escape(value)) + _text('"')
    return out + [(SEP, True)]


def _close(tag: str) -> list[Segment]:
    return [(CLOSE, True), *_text(tag), (SEP, True)]


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _sorted(value: Any) -> Any:
    """Every dict's keys sorted, recursively (lists keep their order)."""
    if isinstance(value, dict):
        return {k: _sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _system(kind: str, body: str) -> list[Segment]:
    return _open("message", [("role", "system"), ("type", kind)]) + _text(body.strip()) + _close("message") + [(END, True)]


def _tool_declare(tools: Any, dynamic: bool = False) -> list[Segment]:
    if dynamic:
        head = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n")
    else:
        head = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
    body = f"{head}```json\n{_compact(_sorted(tools))}\n```"
    return _open("message", [("role", "system"), ("type", "tool-declare")]) + _text(body) + _close("message") + [(END, True)]


def image_source(part: dict, field: str) -> str:
    """The image reference of one content part, as OpenAI / vLLM / Hugging Face clients write it:
    `{"type": "image_url", "image_url": {"url": U}}` (or `"image_url": U`), `{"type": "image", "image": U}` (or
    `"url": U`, or an `image_url` as above). U is what the caller's loader takes (a `data:` URL, an http(s) URL, ...);
    OpenAI's `detail` is ignored (the processor's resize plan decides). Raises ValueError naming the missing field."""
    if part.get("type") == "image" and "image_url" not in part:
        url, where = part.get("image", part.get("url")), f"{field}.image"
    else:
        v = part.get("image_url")
        url, where = (v.get("url") if isinstance(v, dict) else v), f"{field}.image_url.url"
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: an image part needs the image as a URL string, e.g. "
                         "{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}")
    return url


def media_segments(width: int, height: int, num_tokens: int) -> list[Segment]:
    """One image's prompt (VISION.md §8.1, pre-expanded as §8.3): `<|media_begin|>`, the text `image {W}x{H}` (the
    ORIGINAL size), `<|media_content|>`, `num_tokens` x `<|media_pad|>`, `<|media_end|>`."""
    return [(MEDIA_BEGIN, True), (f"image {int(width)}x{int(height)}", False), (MEDIA_CONTENT, True),
            *[(MEDIA_PAD, True)] * int(num_tokens), (MEDIA_END, True)]


def text_image_segments(text: str, images, field: str = "text") -> list[Segment]:
    """`text` as ordinary text with its n-th IMAGE_PLACEHOLDER replaced by the n-th image's `media_segments` (an
    image has `width`, `height`, `num_tokens`). Raises ValueError naming `field` unless the markers are one per
    image."""
    parts = text.split(IMAGE_PLACEHOLDER)
    if len(parts) - 1 != len(images):
        raise ValueError(f"{field}: {len(parts) - 1} {IMAGE_PLACEHOLDER} marker(s) for {len(images)} image(s); put "
                         "one marker where each image goes")
    out = _text(parts[0])
    for image, rest in zip(images, parts[1:]):
        out += media_segments(image.width, image.height, image.num_tokens) + _text(rest)
    return out


def image_segments(part: dict, field: str, load=None) -> list[Segment]:
    """The prompt of one `image` / `image_url` content part (`media_segments`). `load(source, field)` turns the
    part's `image_source` into an image with `width`, `height` (original pixels) and `num_tokens` (its
    `<|media_pad|>` count), e.g. runtime.vision.process_image; it raises ValueError naming `field` for a bad image.
    Without `load` (no vision processor) this raises ValueError naming `field`."""
    if load is None:
        raise ValueError(f"{field}: image content needs the vision processor, which this deployment does not run; "
                         "send text content parts only")
    image = load(image_source(part, field), field)
    return media_segments(image.width, image.height, image.num_tokens)


def _content(content: Any, field: str, load=None) -> list[Segment]:
    if content is None:
        return []
    if isinstance(content, str):
        return _text(content)
    if not isinstance(content, list):
        raise ValueError(f"{field}: expected a string or a list of content parts, got {type(content).__name__}")
    out: list[Segment] = []
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{where}: expected a content part object, got {type(part).__name__}")
        kind = part.get("type")
        if kind in ("image", "image_url"):
            out += image_segments(part, where, load)
        elif kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.text: a text part needs a string 'text'")
            out += _text(part["text"])
        else:
            raise ValueError(f"{where}.type = {kind!r}: supported content parts are 'text', 'image' and 'image_url'")
    return out


# ---- options and messages ---------------------------------------------------------------------------------
def _options(thinking, enable_thinking, reasoning_effort, thinking_effort) -> tuple[bool, str]:
    """(thinking on, effort) from the switches of CHAT.md §2; ValueError naming a bad field."""
    for name, v in (("thinking", thinking), ("enable_thinking", enable_thinking)):
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{name} = {v!r}: must be true or false")
    on = thinking if thinking is not None else (True if enable_thinking is None else enable_thinking)
    effort, source = thinking_effort, "thinking_effort"
    if reasoning_effort == "none":
        on = False
    elif reasoning_effort is not None and thinking_effort is None:
        effort, source = reasoning_effort, "reasoning_effort"
    if effort is None:
        effort = "max"
    if effort not in THINKING_EFFORTS:
        allowed = ", ".join(THINKING_EFFORTS) + (" or none" if source == "reasoning_effort" else "")
        raise ValueError(f"{source} = {effort!r}: Kimi K3 supports {allowed}")
    return on, effort


def thinking_enabled(thinking: bool | None = None, enable_thinking: bool | None = None,
                     reasoning_effort: str | None = None, thinking_effort: str | None = None) -> bool:
    """Whether `encode_chat` with these switches opens the think channel (ValueError naming a bad field)."""
    return _options(thinking, enable_thinking, reasoning_effort, thinking_effort)[0]


def _arguments(args: Any, field: str) -> tuple[dict, str | None]:
    """Tool-call arguments -> (object, None) or ({}, raw text) for a string that is not JSON."""
    if args is None:
        return {}, None
    if isinstance(args, dict):
        return args, None
    if isinstance(args, str):
        if not args.strip():
            return {}, None
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return {}, args
        if not isinstance(parsed, dict):
            raise ValueError(f"{field}: {args[:60]!r} is JSON but not an object; tool-call arguments are a JSON "
                             "object of argument names to values")
        return parsed, None
    raise ValueError(f"{field}: expected a JSON object or a JSON object string, got {type(args).__name__}")


def _xtml_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array"


def _calls(message: dict, field: str) -> list[tuple[str, dict, str | None]]:
    """An assistant's tool_calls -> [(name, arguments, raw json text or None)], validated."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError(f"{field}.tool_calls: expected a list")
    out = []
    for j, call in enumerate(calls):
        where = f"{field}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise ValueError(f"{where}: expected an object")
        fn = call.get("function", call)
        fwhere = f"{where}.function" if "function" in call else where
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{fwhere}.name: a tool call needs the function's name")
        args, raw = _arguments(fn.get("arguments"), f"{fwhere}.arguments")
        out.append((fn["name"], args, raw))
    return out


def _resort_tool_results(items: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(field, message) pairs with each run of tool messages re-sorted into the preceding assistant's tool_calls
    order by tool_call_id (the matched call's name becomes the message's `tool`); a run with an unmatched message
    stays as given."""
    out: list[tuple[str, dict]] = []
    index: dict[str, tuple[int, Any]] = {}
    i = 0
    while i < len(items):
        field, m = items[i]
        if m.get("role") != "tool":
            if m.get("role") == "assistant":
                index = {}
                for pos, call in enumerate(m.get("tool_calls") or [], 1):
                    if isinstance(call, dict) and call.get("id") is not None and str(call["id"]) not in index:
                        fn = call.get("function")
                        index[str(call["id"])] = (pos, fn.get("name") if isinstance(fn, dict) else call.get("name"))
            out.append(items[i])
            i += 1
            continue
        run = []
        while i < len(items) and items[i][1].get("role") == "tool":
            t = items[i][1]
            cid = t.get("tool_call_id", t.get("id"))
            run.append((index.get(str(cid)) if cid is not None else None, len(run), items[i]))
            i += 1
        if any(match is None for match, _, _ in run):
            out += [item for _, _, item in run]
            continue
        for (pos, name), _, (field, t) in sorted(run, key=lambda r: (r[0][0], r[1])):
            if name is not None:
                t = dict(t, tool=name)
                if "name" in t:
                    t["name"] = name
            out.append((field, t))
    return out


def _assistant(message: dict, field: str, thinking: bool, load=None) -> list[Segment]:
    out: list[Segment] = []
    if thinking:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        out += _open("think")
        if reasoning is not None and str(reasoning).strip():
            out += _text(reasoning)
        out += _close("think")
    out += _open("response") + _content(message.get("content"), f"{field}.content", load) + _close("response")
    calls = _calls(message, field)
    if calls:
        out += _open("tools")
        for index, (name, args, raw) in enumerate(calls, 1):
            out += _open("call", [("tool", name), ("index", index)])
            if raw is not None:
                out += _open("json", [("type", "object")]) + _text(raw) + _close("json")
            else:
                for key, value in args.items():
                    out += _open("argument", [("key", key), ("type", _xtml_type(value))])
                    out += _text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                    out += _close("argument")
            out += _close("call")
        out += _close("tools")
    return out


def _response_format_body(rf: Any) -> str | None:
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else rf
    if kind in (None, "text"):
        return None
    head = ("The system is invoked with `response_format={}`.\nYour response must be raw JSON data without markdown "
            "code blocks (```json) or any additional formatting.")
    if kind == "json_object":
        return head.format("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema") if isinstance(rf, dict) else None
        if not isinstance(js, dict):
            raise ValueError("response_format.json_schema: type 'json_schema' needs a json_schema object "
                             "({'name': ..., 'schema': {...}})")
        schema = js.get("schema", js.get("json_schema", js))
        return (head.format("json_schema") + "\nThe JSON data must match the following schema:\n"
                f"```json\n{_compact(_sorted(schema))}\n```")
    raise ValueError(f"response_format.type = {kind!r}: choose 'text', 'json_object' or 'json_schema'")


def render_chat(messages: list, tools: list | None = None, *, thinking: bool | None = None,
                enable_thinking: bool | None = None, reasoning_effort: str | None = None,
                thinking_effort: str | None = None, tool_choice: Any = None, response_format: Any = None,
                add_generation_prompt: bool = True, load_image=None) -> list[Segment]:
    """The XTML segments of a conversation (CHAT.md §2; arguments as `encode_chat`; `load_image` as in
    `image_segments`). Raises ValueError naming the field."""
    on, effort = _options(thinking, enable_thinking, reasoning_effort, thinking_effort)
    if not isinstance(messages, list):
        raise ValueError(f"messages: expected a list of message objects, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: expected a message object, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role = {m.get('role')!r}: choose one of {', '.join(ROLES)}")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools: expected a list of tool objects ({'type': 'function', 'function': {...}})")
    if tool_choice not in (None, "auto", "none", "required"):
        raise ValueError(f"tool_choice = {tool_choice!r}: choose 'auto', 'none' or 'required' (a named function "
                         "cannot be forced without constrained decoding)")
    rf_body = _response_format_body(response_format)

    out: list[Segment] = []
    if tools:
        out += _tool_declare(tools)
    if on:
        out += _system("thinking-effort",
                       "`thinking_effort` guides on how much to think in your thinking channel (not including the "
                       "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                       f"Now the system is invoked with `thinking_effort={effort}`.")
    calls: list | None = None
    n_tool = 0
    for field, m in _resort_tool_results([(f"messages[{i}]", m) for i, m in enumerate(messages)]):
        role = m["role"]
        if role in ("user", "system"):
            if role == "system" and m.get("tools"):
                out += _tool_declare(m["tools"], dynamic=True)
                continue
            attrs = [("role", role)] + ([("name", m["name"])] if m.get("name") else [])
            out += _open("message", attrs) + _content(m.get("content"), f"{field}.content", load_image)
            out += _close("message")
            out += [(END, True)]
        elif role == "tool":
            n_tool += 1
            name = m.get("tool", m.get("name"))
            if name is None and calls is not None and n_tool <= len(calls):
                name = calls[n_tool - 1]
            if name is None:
                raise ValueError(f"{field}.name: a tool message needs the tool's name: give 'name' (or 'tool'), "
                                 "or a 'tool_call_id' / position matching the preceding assistant's tool_calls")
            out += _open("message", [("role", "tool"), ("tool", name), ("index", n_tool)])
            out += _content(m.get("content"), f"{field}.content", load_image) + _close("message") + [(END, True)]
        else:
            calls = [name for name, _, _ in _calls(m, field)] if m.get("tool_calls") else None
            n_tool = 0
            attrs = [("role", "assistant")] + ([("name", m["name"])] if m.get("name") else [])
            out += _open("message", attrs) + _assistant(m, field, on, load_image) + _close("message") + [(END, True)]
    if tool_choice == "required":
        out += _system("tool-choice", "The system is invoked with `tool_choice=required`.\n"
                                      "You MUST call tools in the next message.")
    elif tool_choice == "none":
        out += _system("tool-choice", "The system is invoked with `tool_choice=none`.\n"
                                      "You MUST NOT call any tools in the next message.")
    if rf_body is not None:
        out += _system("response-format", rf_body)
    if add_generation_prompt:
        out += _open("message", [("role", "assistant")]) + _open("think" if on else "response")
    return out


def encode_chat(tokenizer, messages, tools=None, *, thinking=None, enable_thinking=None, reasoning_effort=None,
                thinking_effort=None, tool_choice=None, response_format=None, add_generation_prompt=True) -> list[int]:
    """Token ids of a K3 chat prompt (CHAT.md §2).

    Args:
        tokenizer: runtime.tokenizer.Tokenizer (its tokenizer_config.json names K3's special tokens).
        messages: OpenAI-style messages: role system / user / assistant / tool; content a string or parts
            (`text`; `image` / `image_url` go through `image_segments`); assistant `reasoning_content` (or
            `reasoning`) and `tool_calls` ({id, function: {name, arguments: object or JSON string}}); tool
            `tool_call_id` and `name`; a system message with `tools` declares more tools.
        tools: OpenAI tool objects, declared in a system message (keys sorted, compact JSON).
        thinking / enable_thinking: thinking on (default) or off; reasoning_effort "none" turns it off, another
            value is the effort unless thinking_effort is given; thinking_effort: low, high or max (default max).
        tool_choice: None / "auto" (nothing rendered), "none", "required".
        response_format: None / {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}.
        add_generation_prompt: end with the assistant's open message and open think (thinking) / response.
    Returns:
        list[int]: the prompt.
    Raises:
        ValueError: naming the field (an unknown role, a tool message with no resolvable name, arguments that are
            JSON but not an object, an unknown effort, ...).
    """
    segments = render_chat(messages, tools, thinking=thinking, enable_thinking=enable_thinking,
                           reasoning_effort=reasoning_effort, thinking_effort=thinking_effort,
                           tool_choice=tool_choice, response_format=response_format,
                           add_generation_prompt=add_generation_prompt)
    return tokenizer.encode_segments(segments)


def encode_chat_images(tokenizer, messages, tools=None, *, load_image, **options) -> tuple[list[int], list]:
    """A K3 chat prompt with images: (token ids, images in prompt order) (CHAT.md §2, VISION.md §8).

    Args:
        tokenizer, messages, tools, **options: as `encode_chat` (thinking, enable_thinking, reasoning_effort,
            thinking_effort, tool_choice, response_format, add_generation_prompt).
        load_image: `(source, field) -> image` for each `image` / `image_url` part, in prompt order: `source` is the
            part's `image_source`, `field` names the part (`messages[i].content[j]`); the image has `width`,
            `height` (original pixels) and `num_tokens`, e.g. `lambda s, f: runtime.vision.process_image(s, proc, f)`.
            It raises ValueError naming `field` for a bad image.
    Returns:
        (ids, images): ids hold each image's block with its `<|media_pad|>` pre-expanded to `num_tokens` copies
        (what `LLM.generate(..., images=)` takes with the images processed), images = load_image's results.
    Raises:
        ValueError: naming the field (as `encode_chat`, or load_image's error).
    """
    images: list = []

    def load(source, field):
        image = load_image(source, field)
        images.append(image)
        return image
    segments = render_chat(messages, tools, load_image=load, **options)
    return tokenizer.encode_segments(segments), images


# ---- output parsing ---------------------------------------------------------------------------------------
def _attrs(text: str) -> dict[str, str]:
    """` key="value"` pairs of a marker, values unescaped (`&quot;` then `&amp;`)."""
    out, i = {}, 0
    while True:
        eq = text.find('="', i)
        if eq < 0:
            return out
        end = text.find('"', eq + 2)
        if end < 0:
            return out
        key = text[i:eq].split()[-1] if text[i:eq].split() else ""
        out[key] = text[eq + 2:end].replace("&quot;", '"').replace("&amp;", "&")
        i = end + 1


def _json_value(raw: str) -> Any:
    """A non-string argument's value: its JSON, or the raw text when it is not strict JSON (NaN / Infinity too)."""
    def reject(c):
        raise ValueError(c)
    try:
        return json.loads(raw, parse_constant=reject)
    except ValueError:
        return raw


class OutputParser:
    """The incremental parser of generated token ids (CHAT.md §3; module docstring).

    Args:
        tokenizer: runtime.tokenizer.Tokenizer with K3's special tokens.
        thinking: the prompt ended with the open `think` tag (True) or the open `response` tag (False).
        tool_call_id_prefix: tool call i gets id `{prefix}{i}`.
    `feed(ids)` returns the OpenAI delta of those tokens (a dict with any of `reasoning_content`, `content`,
    `tool_calls`; {} when nothing is ready); `finish()` flushes what is held at the end of generation. Attributes:
    `done` (the message was closed or ended), `completed_calls` (tool calls whose `call` element closed),
    `open_call` (a call is open: the output was cut inside it).
    """

    def __init__(self, tokenizer, thinking: bool = True, tool_call_id_prefix: str = "call_"):
        self._tok = tokenizer
        self._O, self._C, self._S, self._E = (tokenizer.special_id(s) for s in (OPEN, CLOSE, SEP, END))
        self._prefix = tool_call_id_prefix
        self._mode = "reasoning" if thinking else "content"
        self._marker: tuple[str, list[bytes]] | None = None      # ("open" | "close", tag bytes) until <|sep|>
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._arg: dict | None = None                            # {"type", "raw"} of the open argument / json
        self._nargs = 0
        self.completed_calls = 0
        self.open_call = False
        self.done = False
        self._calls = 0
        self._delta: dict = {}
        self._all: list[dict] = []

    # -- emitting --
    def _emit(self, key: str, text: str) -> None:
        if text:
            self._delta[key] = self._delta.get(key, "") + text

    def _emit_call(self, **entry) -> None:
        calls = self._delta.setdefault("tool_calls", [])
        if calls and calls[-1]["index"] == entry["index"] and "id" not in entry:
            fn = calls[-1]["function"]
            fn["arguments"] = fn.get("arguments", "") + entry["function"]["arguments"]
        else:
            calls.append(entry)

    def _args(self, text: str) -> None:
        self._emit_call(index=self._calls - 1, function={"arguments": text})

    def _text(self, s: str) -> None:
        if not s:
            return
        m = self._mode
        if m in ("reasoning", "content"):
            self._emit("reasoning_content" if m == "reasoning" else "content", s)
        elif m == "argument" and self._arg["type"] == "string":
            self._args(json.dumps(s, ensure_ascii=False)[1:-1])
        elif m in ("argument", "json"):
            self._arg["raw"].append(s)

    def _flush(self) -> None:
        self._text(self._dec.decode(b"", final=True))

    # -- the tools channel --
    def _start_call(self, attrs: dict) -> None:
        if not attrs.get("tool"):
            self._mode = "skip_call"                            # a call without a name is dropped
            return
        i = self._calls
        self._calls += 1
        self._nargs, self.open_call, self._mode = 0, True, "call"
        self._emit_call(index=i, id=f"{self._prefix}{i}", type="function",
                        function={"name": attrs["tool"], "arguments": "{"})

    def _member(self, key: str) -> None:
        self._args((", " if self._nargs else "") + json.dumps(key, ensure_ascii=False) + ": ")
        self._nargs += 1

    def _start_arg(self, attrs: dict) -> None:
        kind = attrs.get("type", "string")
        self._member(attrs.get("key", ""))
        if kind == "string":
            self._args('"')
        self._arg, self._mode = {"type": kind, "raw": []}, "argument"

    def _end_arg(self) -> None:
        if self._mode == "argument":
            if self._arg["type"] == "string":
                self._args('"')
            else:
                raw = "".join(self._arg["raw"])
                self._args(json.dumps(_json_value(raw), ensure_ascii=False))
        elif self._mode == "json":
            obj = _json_value("".join(self._arg["raw"]))
            for k, v in (obj.items() if isinstance(obj, dict) else ()):
                self._member(str(k))
                self._args(json.dumps(v, ensure_ascii=False))
        self._arg, self._mode = None, "call"

    def _end_call(self) -> None:
        if self._mode == "skip_call":
            self._mode = "tools"
            return
        self._end_arg()
        self._args("}")
        self.completed_calls += 1
        self.open_call, self._mode = False, "tools"

    # -- markers --
    def _on_marker(self, kind: str, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace")
        words = text.split()
        tag = words[0] if words else ""
        m = self._mode
        if kind == "open":
            if tag == "response" and m in ("reasoning", "content", "idle"):
                self._mode = "content"
            elif tag == "tools" and m in ("reasoning", "content", "idle"):
                self._mode = "tools"
            elif tag == "call" and m == "tools":
                self._start_call(_attrs(text[len(tag):]))
            elif tag == "argument" and m == "call":
                self._start_arg(_attrs(text[len(tag):]))
            elif tag == "json" and m == "call":
                self._arg, self._mode = {"type": "object", "raw": []}, "json"
            return
        if tag == "think" and m == "reasoning":
            self._mode = "content"
        elif tag == "response" and m == "content":
            self._mode = "idle"
        elif (tag == "argument" and m == "argument") or (tag == "json" and m == "json"):
            self._end_arg()
        elif tag == "call" and m in ("call", "argument", "json", "skip_call"):
            self._end_call()
        elif tag == "tools" and m in ("tools", "call", "argument", "json", "skip_call"):
            if m != "tools":
                self._end_call()
            self._mode = "idle"
        elif tag == "message":
            self.done = True

    # -- public --
    def feed(self, token_ids: Iterable[int]) -> dict:
        """Consume generated ids; returns their delta ({} when nothing is ready)."""
        self._delta = {}
        for t in token_ids:
            t = int(t)
            if self.done:
                break
            if not self._tok.is_special(t):
                if self._marker is not None:
                    self._marker[1].append(self._tok.token_bytes(t))
                else:
                    self._text(self._dec.decode(self._tok.token_bytes(t)))
                continue
            self._flush()
            if t in (self._O, self._C):
                self._marker = ("open" if t == self._O else "close", [])   # a marker left open is dropped
            elif t == self._S:
                if self._marker is not None:
                    kind, parts = self._marker
                    self._marker = None
                    self._on_marker(kind, b"".join(parts))
            elif t == self._E:
                self._marker, self.done = None, True
        return self._commit()

    def finish(self) -> dict:
        """End of generation: flush held UTF-8 bytes (a marker still open is dropped). Returns the last delta."""
        self._delta = {}
        self._flush()
        self._marker = None
        return self._commit()

    def _commit(self) -> dict:
        d, self._delta = self._delta, {}
        if d:
            self._all.append(d)
        return d

    def result(self) -> dict:
        """Everything emitted so far, merged (`merge_deltas`)."""
        return merge_deltas(self._all)


def merge_deltas(deltas: Iterable[dict]) -> dict:
    """Accumulate OpenAI deltas as a client does: {"reasoning_content": str, "content": str, "tool_calls": [{"id",
    "type", "function": {"name", "arguments"}}]} (tool calls in index order)."""
    out = {"reasoning_content": "", "content": "", "tool_calls": []}
    calls: dict[int, dict] = {}
    for d in deltas:
        out["reasoning_content"] += d.get("reasoning_content") or ""
        out["content"] += d.get("content") or ""
        for c in d.get("tool_calls") or ():
            call = calls.setdefault(c["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            if c.get("id"):
                call["id"] = c["id"]
            fn = c.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def parse_output(tokenizer, token_ids: Sequence[int], thinking: bool = True, tool_call_id_prefix: str = "call_") -> dict:
    """The non-streamed result: `OutputParser` fed every id, then finished, merged (`merge_deltas`)."""
    p = OutputParser(tokenizer, thinking, tool_call_id_prefix)
    p.feed(token_ids)
    p.finish()
    return p.result()
