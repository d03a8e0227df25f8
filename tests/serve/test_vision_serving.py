"""Images through the serving stack on k3-tiny-vl (VISION.md §8): the real tritonserver serving the k3 and k3_text
models and the OpenAI front, all started by `python -m k3deploy.serve.launch --repo REPO --openai-port P` (once for
the module), queried with the official `openai` client and with tritonclient.

The weights are random, so answers are compared with the runtime's own (`LLM.generate` with the same processed
images) and usage with the rendered prompt; an image the server dropped or mis-ordered changes the answer
(`test_the_images_change_the_answer`).
"""
from __future__ import annotations

import base64
import http.server
import importlib.util
import io
import pathlib
import queue
import threading
import time
import types

import numpy as np
import pytest

if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton not installed (pip install nvidia-pytriton)", allow_module_level=True)
openai = pytest.importorskip("openai", reason="the official openai client is not installed (pip install openai)")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[all] not installed")
from PIL import Image  # noqa: E402

from k3deploy.runtime.api import LLM, SamplingParams  # noqa: E402
from k3deploy.runtime.chat import encode_chat_images, parse_output, text_image_segments  # noqa: E402
from k3deploy.runtime.vision import image_tokens, pack_images, process_image  # noqa: E402
from k3deploy.serve import repository as repo_mod  # noqa: E402
from k3deploy.serve.launch import OpenAIFront, free_ports  # noqa: E402
from k3client import launcher  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
WAIT_S = 120
N = 6                                            # tokens generated per request


def _png(w, h, seed, mode="RGB", fmt="PNG") -> bytes:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a if len(mode) > 1 else a[..., 0], mode).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


A, B = _png(60, 44, 1, "RGBA"), _png(30, 16, 2, fmt="JPEG")     # 6 and 2 image tokens on k3-tiny-vl


class _Images(http.server.BaseHTTPRequestHandler):
    """A local image server: /a.png (A), /missing (404), /moved (302 to /a.png); counts its requests."""
    hits: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        if self.path == "/a.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(A)))
            self.end_headers()
            self.wfile.write(A)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


def loader(proc):
    """encode_chat_images' loader for the tests' data: URLs: the processed image (runtime.vision.process_image)."""
    return lambda source, field: process_image(base64.b64decode(source.split(",", 1)[1]), proc, field)


class Env:
    def __init__(self, urls, llm):
        self.urls, self.llm, self.tok, self.proc = urls, llm, llm.tokenizer, llm.processor
        self.pad = llm.cfg.vision.media_placeholder_token_id
        self.client = openai.OpenAI(base_url=urls["openai"], api_key="none", max_retries=0, timeout=WAIT_S)
        self.load = loader(self.proc)

    def expected(self, ids, images, n=N):
        """The runtime's greedy tokens for a pre-expanded prompt and its processed images."""
        return list(self.llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                      images=[images] if images else None)[0].token_ids)


@pytest.fixture(scope="module")
def env(tiny_vl_ckpt, tmp_path_factory):
    repo = tmp_path_factory.mktemp("vision_serving") / "repo"
    repo_mod.write_repository(tiny_vl_ckpt, repo, "torch", max_batch=8, max_context=1024)
    (port,) = free_ports(1)
    with launcher(repo, "--openai-port", str(port), root=ROOT) as (_, urls):
        yield Env(urls, LLM(tiny_vl_ckpt, backend="torch", max_batch=4, max_context=1024))


@pytest.fixture(scope="module")
def image_server():
    _Images.hits = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", _Images.hits
    finally:
        srv.shutdown()
        srv.server_close()


def two_images(first=A, second=B):
    return [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": data_url(first)}},
        {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": data_url(second, "image/jpeg")}}]}]


def greedy(messages, **kw):
    return dict(model="k3", messages=messages, max_tokens=N, temperature=0,
                extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": False}}, **kw)


def test_the_images_change_the_answer(env):
    """The runtime's answer depends on the images and their order, so the comparisons below can catch a server
    that drops or swaps them."""
    ids, images = encode_chat_images(env.tok, two_images(), load_image=env.load, thinking=False)
    want = env.expected(ids, images)
    assert want != env.expected(ids, None)
    swapped, imgs2 = encode_chat_images(env.tok, two_images(B, A), load_image=env.load, thinking=False)
    assert env.expected(swapped, imgs2) != want


def test_two_image_chat_streamed_and_not(env):
    msgs = two_images()
    ids, images = encode_chat_images(env.tok, msgs, load_image=env.load, thinking=False)
    assert ids.count(env.pad) == image_tokens(60, 44, env.proc) + image_tokens(30, 16, env.proc) == 8
    want = parse_output(env.tok, env.expected(ids, images), thinking=False)
    r = env.client.chat.completions.create(**greedy(msgs))
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == N
    assert (r.choices[0].message.content or "") == want["content"]
    chunks = list(env.client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                     **greedy(msgs)))
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == N
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["content"]
    hf = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "image": data_url(A)},
                                       {"type": "text", "text": "with"}, {"type": "image", "url": data_url(B)}]}]
    assert env.client.chat.completions.create(**greedy(hf)).usage.prompt_tokens == len(ids)


_BOMB = None


def _over_the_pixel_limit() -> bytes:
    """A 1-bit 10000x9000 PNG (90 M pixels, over runtime.vision.MAX_IMAGE_PIXELS; ~12 KiB encoded)."""
    global _BOMB
    if _BOMB is None:
        buf = io.BytesIO()
        Image.new("1", (10000, 9000)).save(buf, "PNG")
        _BOMB = buf.getvalue()
    return _BOMB


@pytest.mark.parametrize("url, needle", [
    (data_url(b"hello"), "not a decodable image"),
    (data_url(A[: len(A) // 2]), "broken"),
    ("data:image/png;base64,@@@@", "base64"),
    ("data:,", "data: URL must be"),
    ("/etc/hosts", "not an image URL"),
    (None, "pixels, over the limit"),
])
def test_bad_image_is_400_naming_the_part(env, url, needle):
    url = url or data_url(_over_the_pixel_limit())
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(A)}}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "and"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            env.client.chat.completions.create(stream=stream, **greedy(msgs))
        assert e.value.status_code == 400 and e.value.param == "messages[2].content[1]", e.value.body
        assert needle in e.value.body["message"], e.value.body
    ok = env.client.chat.completions.create(**greedy(two_images()))          # the server keeps serving
    assert ok.usage.completion_tokens == N


def test_remote_url_refused_by_default(env, image_server):
    base, hits = image_server
    msgs = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url", "image_url": {"url": f"{base}/a.png"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        env.client.chat.completions.create(**greedy(msgs))
    assert e.value.param == "messages[0].content[1]" and "--allowed-media-hosts" in e.value.body["message"]
    assert hits == []                                                         # nothing was fetched


def test_remote_url_through_the_allow_list(env, image_server):
    """A second front with --allowed-media-hosts 127.0.0.1 fetches the image itself: the same prompt and answer as
    the data: URL; other hosts, HTTP errors and redirects are 400s naming the part."""
    base, hits = image_server
    (port,) = free_ports(1)
    with OpenAIFront(env.urls["grpc"], port, allowed_media_hosts=["127.0.0.1"]) as front:
        client = openai.OpenAI(base_url=front.url, api_key="none", max_retries=0, timeout=WAIT_S)

        def msgs(url):
            return [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                 {"type": "image_url", "image_url": {"url": url}}]}]
        r = client.chat.completions.create(**greedy(msgs(f"{base}/a.png")))
        inline = env.client.chat.completions.create(**greedy(msgs(data_url(A))))
        assert hits == ["/a.png"]
        assert r.usage.prompt_tokens == inline.usage.prompt_tokens
        assert r.choices[0].message.content == inline.choices[0].message.content
        for url, needle in ((base.replace("127.0.0.1", "localhost") + "/a.png", "not in --allowed-media-hosts"),
                            (f"{base}/missing", "HTTP 404"), (f"{base}/moved", "redirects are not followed")):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(**greedy(msgs(url)))
            assert e.value.param == "messages[0].content[1]" and needle in e.value.body["message"], e.value.body


# ---- the Triton models, with tritonclient -------------------------------------------------------------------
def stream(url: str, model: str, fields: dict) -> tuple[list[int], list[str], str | None]:
    """One streamed gRPC request: (output_ids, text_output pieces, error)."""
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    ids, texts = [], []
    try:
        inputs = []
        for name, a in fields.items():
            dtype = {"i": "INT32", "f": "FP32", "b": "BOOL", "O": "BYTES"}[a.dtype.kind]
            dtype = "INT64" if a.dtype == np.int64 else dtype
            inputs.append(grpcclient.InferInput(name, list(a.shape), dtype))
            inputs[-1].set_data_from_numpy(a)
        client.async_stream_infer(model, inputs, request_id="v", enable_empty_final_response=True)
        deadline = time.monotonic() + WAIT_S
        while True:
            result, error = q.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                return ids, texts, str(error)
            for name, out in (("output_ids", ids), ("text_output", texts)):
                a = result.as_numpy(name)
                if a is not None:
                    out += [int(x) for x in a.reshape(-1)] if name == "output_ids" else [a.reshape(-1)[0].decode()]
            if result.get_response().parameters["triton_final_response"].bool_param:
                return ids, texts, None
    finally:
        client.stop_stream()
        client.close()


def one(v, dtype=np.int32):
    return np.array([[v]], dtype)


def test_k3_takes_image_bytes_or_processed_tensors(env):
    """input_ids with one <|media_pad|> per image + image_bytes: the runtime's answer; the same with the pads
    pre-expanded, and with pixel_values + grid_thws instead of the files; bad inputs are errors naming them."""
    tok = env.tok
    processed = [process_image(A, env.proc), process_image(B, env.proc)]
    text = "look <|kimi_image_placeholder|> and <|kimi_image_placeholder|>"
    heads = [types.SimpleNamespace(width=w, height=h, num_tokens=1) for w, h in ((60, 44), (30, 16))]
    single = tok.encode_segments(text_image_segments(text, heads))             # one pad per image
    full = tok.encode_segments(text_image_segments(text, processed))           # pre-expanded
    want = env.expected(full, processed)
    files = np.array([[A, B]], np.object_)
    base = {"request_output_len": one(N), "end_id": one(-1), "streaming": one(True, np.bool_)}
    for ids, images in ((single, {"image_bytes": files}), (full, {"image_bytes": files})):
        got, _, err = stream(env.urls["grpc"], "k3", {"input_ids": np.array([ids], np.int32), **base, **images})
        assert err is None and got == want
    px, grids = pack_images(processed)
    tensors = {"pixel_values": px.numpy()[None], "grid_thws": grids.numpy()[None]}
    got, _, err = stream(env.urls["grpc"], "k3", {"input_ids": np.array([single], np.int32), **base, **tensors})
    assert err is None and got == want
    bad = [({"input_ids": np.array([single + [env.pad]], np.int32), "image_bytes": files}, "input_ids"),
           ({"input_ids": np.array([single], np.int32), "image_bytes": np.array([[A, b"nope"]], np.object_)},
            "image_bytes[1]"),
           ({"input_ids": np.array([single], np.int32), "image_bytes": files, **tensors}, "not both"),
           ({"input_ids": np.array([single], np.int32), "pixel_values": tensors["pixel_values"]}, "grid_thws"),
           ({"input_ids": np.array([single], np.int32), "pixel_values": tensors["pixel_values"][:, 1:],
             "grid_thws": tensors["grid_thws"]}, "pixel_values")]
    for fields, needle in bad:
        got, _, err = stream(env.urls["grpc"], "k3", {**base, **fields})
        assert err is not None and needle in err and not got, (needle, err)
    got, _, err = stream(env.urls["grpc"], "k3", {"input_ids": np.array([single], np.int32), **base,
                                                 "image_bytes": files})
    assert err is None and got == want                                        # still serving


def test_k3_text_takes_images(env):
    text = "look <|kimi_image_placeholder|> and <|kimi_image_placeholder|>"
    processed = [process_image(A, env.proc), process_image(B, env.proc)]
    want = env.expected(env.tok.encode_segments(text_image_segments(text, processed)), processed)
    fields = {"text_input": np.array([[text.encode()]], np.object_), "max_tokens": one(N), "end_id": one(-1),
              "image_bytes_input": np.array([[A, B]], np.object_)}
    _, texts, err = stream(env.urls["grpc"], "k3_text", fields)
    assert err is None and "".join(texts) == env.tok.decode(want, skip_special=True)
    _, _, err = stream(env.urls["grpc"], "k3_text", dict(fields, image_bytes_input=np.array([[A]], np.object_)))
    assert err is not None and "text_input" in err


# ---- the pipeline's own repository ---------------------------------------------------------------------------
def test_build_repository_serves_images(tiny_vl_build):
    """The Triton repository the main job wrote for k3-tiny-vl (onnxruntime over the exported graphs, vision.onnx
    included) serves a two-image chat through the front: the onnxruntime runtime's answer, usage = the prompt."""
    from k3deploy.serve.launch import TritonServer
    out, r = tiny_vl_build
    assert r.returncode == 0, r.stderr[-3000:]
    llm = LLM(out, backend="onnxruntime", max_batch=4)
    h, g, port = free_ports(3)
    with TritonServer(out / "triton", h, g, exit_timeout=5, startup_timeout=600) as srv, \
            OpenAIFront(srv.grpc_url, port) as front:
        client = openai.OpenAI(base_url=front.url, api_key="none", max_retries=0, timeout=WAIT_S)
        ids, images = encode_chat_images(llm.tokenizer, two_images(), load_image=loader(llm.processor), thinking=False)
        want = list(llm.generate([ids], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
                                 images=[images])[0].token_ids)
        got = client.chat.completions.create(**greedy(two_images()))
        assert got.usage.prompt_tokens == len(ids)
        assert (got.choices[0].message.content or "") == parse_output(llm.tokenizer, want, thinking=False)["content"]
