"""OpenAI-compatible HTTP front for the Triton ``k3`` model (CHAT.md §4).

    python -m k3deploy.serve.openai --triton-grpc 127.0.0.1:8001 --port 8080 [--api-key KEY]
    k3deploy serve --repo REPO --openai-port 8080          # tritonserver and this front together (serve/launch.py)

FastAPI + uvicorn. Chat requests are rendered with K3's XTML encoding (runtime/chat.py), sent as token ids to the
``k3`` model over one gRPC stream per request (tritonclient.grpc.aio, TensorRT-LLM's tensor names), and the
generated ids are parsed back into ``reasoning_content`` / ``content`` / ``tool_calls`` by the same incremental
parser for streamed and non-streamed answers.

Endpoints: ``POST /v1/chat/completions`` (stream or not; ``stream_options.include_usage``; ``tools``,
``tool_choice``, ``response_format``; ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop``, ``logprobs`` / ``top_logprobs``, ``ignore_eos``; ``chat_template_kwargs``
{thinking, enable_thinking, thinking_effort} and ``reasoning_effort``; ``n`` = 1), ``POST /v1/completions``
(``prompt`` text, token ids or a list of either; ``echo``; ``logprobs``; ``max_tokens`` 0 with ``echo`` scores the
prompt only), ``GET /v1/models``, ``GET /health`` (503 until Triton's model is ready), ``GET /metrics``
(Prometheus). ``usage.prompt_tokens`` is the rendered prompt's length, ``completion_tokens`` the tokens generated
(the stop token included), ``prompt_tokens_details.cached_tokens`` the model's ``num_cached_tokens`` output (0
without it).

Images (a model with a vision tower, VISION.md §8): chat content parts ``{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}`` (or ``{"type": "image", "image": URL}``). The front decodes each image (a bad one is
a 400 naming ``messages[i].content[j]``), renders its block with the ``<|media_pad|>`` pre-expanded to the image's
token count (so ``usage.prompt_tokens`` counts the image tokens exactly) and sends the encoded files to ``k3`` as
``image_bytes``. Remote ``http(s)`` URLs are refused unless ``--allowed-media-hosts`` lists their host; then the
front fetches them itself (``FETCH_TIMEOUT_S``, at most ``MAX_IMAGE_BYTES``, no redirects).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; a bad request is HTTP 400 naming
the parameter. A client that disconnects cancels its gRPC stream, so Triton cancels the request and the runtime
frees its slot and blocks. ``--api-key`` requires ``Authorization: Bearer KEY`` on ``/v1/*``; bodies over
``--max-request-bytes`` get 413; the front binds to 127.0.0.1 unless ``--host`` says otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import pathlib
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

LOGGER = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
MAX_TOP_LOGPROBS = 20
FETCH_TIMEOUT_S = 10.0          # a remote image (an --allowed-media-hosts URL) must arrive within this


# ---- errors ---------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type_: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _field_error(e: ValueError, default: str) -> APIError:
    """A ValueError of runtime/chat.py ("messages[0].role = ...: ...") -> 400 naming its leading field."""
    m = re.match(r"^([A-Za-z_][\w.\[\]]*)", str(e))
    return APIError(str(e), m.group(1) if m else default)


# ---- request fields -------------------------------------------------------------------------------------------
def _get(body: dict, name: str, kinds, default=None, check=None, why: str = ""):
    """body[name] of one of `kinds` (None -> default), passing `check`; APIError naming `name` otherwise."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise APIError(f"{name}: expected {'/'.join(k.__name__ for k in kinds)}, got a boolean", name)
    if not isinstance(v, kinds):
        raise APIError(f"{name}: expected {'/'.join(k.__name__ for k in kinds)}, got {type(v).__name__}", name)
    if check is not None and not check(v):
        raise APIError(f"{name} = {v!r}: {why}", name)
    return v


@dataclasses.dataclass
class Sampling:
    """What one generation asks of the token model."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None          # None: off; k: the chosen token's logprob + k alternatives
    prompt_logprobs: bool = False


def _sampling(body: dict, max_tokens: Optional[int], max_context: Optional[int], prompt_len: int,
              prompt_param: str, max_tokens_param: str = "max_tokens") -> Sampling:
    """Common sampling fields (OpenAI names, vLLM's extras top_k / ignore_eos); APIError naming a bad one."""
    if _get(body, "n", (int,), 1) != 1:
        raise APIError("n: only n = 1 is supported; send one request per choice", "n")
    if _get(body, "best_of", (int,), 1) != 1:
        raise APIError("best_of: only 1 is supported", "best_of")
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                          ("min_tokens", 0)):
        if _get(body, name, (int, float), neutral) != neutral:
            raise APIError(f"{name}: not supported; omit it or send {neutral}", name)
    t = _get(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "must be in [0, 2]")
    top_p = _get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "must be in (0, 1]")
    top_k = _get(body, "top_k", (int,), 0, lambda v: v >= -1, "must be -1 or 0 (off) or a positive integer")
    seed = _get(body, "seed", (int,), None, lambda v: -2 ** 63 <= v < 2 ** 64, "must be in [-2**63, 2**64)")
    ignore_eos = _get(body, "ignore_eos", (bool,), False)
    if max_context is not None:
        if prompt_len >= max_context:
            raise APIError(f"This model's maximum context length is {max_context} tokens; the prompt has "
                           f"{prompt_len} tokens", prompt_param, code="context_length_exceeded")
        room = max_context - prompt_len
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(f"This model's maximum context length is {max_context} tokens; you requested "
                           f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)",
                           max_tokens_param, code="context_length_exceeded")
    return Sampling(max_tokens=max_tokens if max_tokens is not None else 16, temperature=float(t),
                    top_p=float(top_p), top_k=max(int(top_k), 0), seed=seed, ignore_eos=ignore_eos)


def _stops(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or not all(isinstance(x, str) for x in s):
        raise APIError("stop: expected a string or a list of strings", "stop")
    return [x for x in s if x]


class StopStrings:
    """Text-level stop strings over one stream of text: `push(text)` returns what may be shown now (text that could
    begin a stop string is held back); `hit` once a stop string appeared (the text is cut before it)."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.held, self.hit = list(stops), "", False

    def push(self, text: str) -> str:
        if not self.stops or self.hit:
            return "" if self.hit else text
        s = self.held + text
        cut = min((i for i in (s.find(x) for x in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held, self.hit = "", True
            return s[:cut]
        keep = max((n for x in self.stops for n in range(min(len(x) - 1, len(s)), 0, -1) if s.endswith(x[:n])),
                   default=0)
        self.held = s[len(s) - keep:] if keep else ""
        return s[:len(s) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out


# ---- the Triton side ------------------------------------------------------------------------------------------
class TritonModelError(Exception):
    """The token model answered an error (the message is Triton's)."""


@dataclasses.dataclass
class Step:
    """One response of the token model."""
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[float]]] = None
    prompt_top: Optional[list[list[tuple[int, float]]]] = None
    cached_tokens: Optional[int] = None


def _pairs(ids, vals) -> list[list[tuple[int, float]]]:
    return [[(int(i), float(v)) for i, v in zip(ri, rv) if i >= 0] for ri, rv in zip(ids, vals)]


class TritonBackend:
    """Streams generations from the Triton token model over gRPC (one stream per request)."""

    def __init__(self, url: str, model: str = "k3"):
        self.url, self.model = url, model
        self._client = None

    @property
    def client(self):
        """The gRPC client, made on first use inside the serving event loop (grpc.aio channels bind to it)."""
        if self._client is None:
            from tritonclient.grpc import aio as grpcaio
            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready() and await self.client.is_model_ready(self.model))
        except Exception:  # noqa: BLE001 - not reachable = not ready
            return False

    async def parameters(self) -> dict[str, str]:
        """The token model's config parameters (model_path, max_context, ...)."""
        cfg = await self.client.get_model_config(self.model, as_json=True)
        return {k: v.get("string_value", "") for k, v in cfg.get("config", {}).get("parameters", {}).items()}

    async def generate(self, rid: str, ids: list[int], s: Sampling, images: Sequence["EncodedImage"] = ()
                       ) -> AsyncIterator[Step]:
        """Yield the token model's responses for prompt `ids` (with `images`' files as `image_bytes`) until the
        last; closing the iterator early cancels the request in Triton (and so in the runtime). Raises
        TritonModelError for an error response."""
        import numpy as np
        from tritonclient.grpc import InferInput

        def tensor(name, value, dtype, triton):
            a = np.asarray(value, dtype=dtype)
            t = InferInput(name, list(a.shape), triton)
            t.set_data_from_numpy(a)
            return t
        inputs = [tensor("input_ids", [ids], np.int32, "INT32"), tensor("input_lengths", [[len(ids)]], np.int32, "INT32"),
                  tensor("request_output_len", [[s.max_tokens]], np.int32, "INT32"),
                  tensor("streaming", [[True]], np.bool_, "BOOL"),
                  tensor("temperature", [[s.temperature]], np.float32, "FP32"),
                  tensor("runtime_top_p", [[s.top_p]], np.float32, "FP32"),
                  tensor("runtime_top_k", [[s.top_k]], np.int32, "INT32")]
        if s.seed is not None:
            inputs.append(tensor("random_seed", [[s.seed & 0xFFFF_FFFF_FFFF_FFFF]], np.uint64, "UINT64"))
        if s.ignore_eos:
            inputs.append(tensor("end_id", [[-1]], np.int32, "INT32"))
        if s.logprobs is not None:
            inputs.append(tensor("return_log_probs", [[True]], np.bool_, "BOOL"))
            inputs.append(tensor("num_top_logprobs", [[s.logprobs]], np.int32, "INT32"))
        if s.prompt_logprobs:
            inputs.append(tensor("return_prompt_log_probs", [[True]], np.bool_, "BOOL"))
        if images:
            inputs.append(tensor("image_bytes", [[im.data for im in images]], np.object_, "BYTES"))

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "request_id": rid}
        it = self.client.stream_infer(requests())
        try:
            async for result, error in it:
                if error is not None:
                    raise TritonModelError(str(error))
                step = self._step(result)
                yield step
                final = result.get_response().parameters.get("triton_final_response")
                if step.finish_reason is not None or (final is not None and final.bool_param):
                    return
        finally:
            it.cancel()

    @staticmethod
    def _step(result) -> Step:
        def get(name):
            try:
                return result.as_numpy(name)
            except Exception:  # noqa: BLE001 - output not in this response
                return None
        ids, lps = get("output_ids"), get("output_log_probs")
        tokens = [] if ids is None else [int(t) for t in ids.reshape(-1)]
        step = Step(tokens, [] if lps is None else [float(v) for v in lps.reshape(-1)], [])
        tid, tv = get("top_log_prob_ids"), get("top_log_probs")
        if tid is not None and tv is not None:
            step.top = _pairs(tid.reshape(-1, tid.shape[-1]), tv.reshape(-1, tv.shape[-1]))
        plp = get("prompt_log_probs")
        if plp is not None:
            step.prompt_logprobs = [None if v != v else float(v) for v in plp.reshape(-1)]
            pid, pv = get("prompt_top_log_prob_ids"), get("prompt_top_log_probs")
            if pid is not None and pv is not None:
                step.prompt_top = _pairs(pid.reshape(-1, pid.shape[-1]), pv.reshape(-1, pv.shape[-1]))
        reason = get("finish_reason")
        if reason is not None:
            r = reason.reshape(-1)[0]
            step.finish_reason = r.decode() if isinstance(r, bytes) else str(r)
        cached = get("num_cached_tokens")
        if cached is not None:
            step.cached_tokens = int(cached.reshape(-1)[0])
        return step


# ---- metrics --------------------------------------------------------------------------------------------------
class Metrics:
    """The front's Prometheus metrics (its own registry)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        r = self.registry = CollectorRegistry()
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.requests = Counter("k3_front_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.running = Gauge("k3_front_requests_running", "Generations in flight", registry=r)
        self.prompt_tokens = Counter("k3_front_prompt_tokens", "Prompt tokens sent to the model", registry=r)
        self.generation_tokens = Counter("k3_front_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("k3_front_time_to_first_token_seconds", "Request arrival to first token", buckets=lat,
                              registry=r)
        self.itl = Histogram("k3_front_inter_token_latency_seconds", "Time between consecutive tokens",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        self.e2e = Histogram("k3_front_request_latency_seconds", "Request arrival to last token", buckets=lat,
                             registry=r)


# ---- the app --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class FrontConfig:
    """served_model: the name /v1/models lists and requests may name; max_context: prompt + generated tokens per
    request (None: not checked here); api_key: required Bearer token (None: open); vision / allowed_media_hosts: the
    image side (module docstring)."""
    served_model: str = "k3"
    max_context: Optional[int] = None
    api_key: Optional[str] = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    vision: Optional["FrontVision"] = None          # None: the model has no vision tower (image parts are a 400)
    allowed_media_hosts: tuple[str, ...] = ()       # hosts (or host:port) whose http(s) image URLs the front fetches


class _BodyLimit:
    """ASGI middleware: 413 (OpenAI error shape) for a body over `limit` bytes, by Content-Length or as it arrives."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = dict(scope.get("headers") or []).get(b"content-length")
        if size is not None and size.isdigit() and int(size) > self.limit:
            return await self._reject(send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return msg
        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send):
        body = json.dumps(APIError(f"request body over {self.limit} bytes", None, 413).body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def create_app(backend: TritonBackend, tokenizer, cfg: FrontConfig):
    """The FastAPI app (module docstring). `backend` streams from Triton; `tokenizer` is runtime.tokenizer's."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="k3deploy OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics()
    app.state.metrics = metrics
    created = int(time.time())

    def error(e: APIError, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(str(exc.detail), None, exc.status_code).body(), status_code=exc.status_code)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if cfg.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {cfg.api_key}":
                e = APIError("invalid API key: send 'Authorization: Bearer <key>'", None, 401, code="invalid_api_key")
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    async def read_json(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != cfg.served_model:
            raise APIError(f"model = {model!r}: this server serves {cfg.served_model!r}", "model", 404,
                           code="model_not_found")
        return body

    @app.get("/health")
    async def health():
        ok = await backend.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_page():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {"id": cfg.served_model, "object": "model", "created": created, "owned_by": "k3deploy"}
        if cfg.max_context:
            card["max_model_len"] = cfg.max_context
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = await read_json(request)
            job = await asyncio.to_thread(_chat_job, body, tokenizer, cfg)     # images are decoded (or fetched) here
        except APIError as e:
            return error(e, "chat")
        return await _respond(request, job, backend, tokenizer, metrics, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await read_json(request)
            jobs = _completion_jobs(body, tokenizer, cfg)
        except APIError as e:
            return error(e, "completions")
        return await _respond_many(request, jobs, backend, tokenizer, metrics, "completions")

    app.add_middleware(_BodyLimit, limit=cfg.max_request_bytes)
    return app


# ---- images ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EncodedImage:
    """One image of a chat request as the front sends it: the encoded file (`data`, sent as `image_bytes`), its
    original size (the prompt block's `image {W}x{H}`), its `<|media_pad|>` count and the part it came from."""
    data: bytes
    width: int
    height: int
    num_tokens: int
    field: str


@dataclasses.dataclass(frozen=True)
class FrontVision:
    """The model's image side as the front needs it: the processor settings (model.vision.ProcessorConfig, for the
    token counts), and the most patches one image may take (the vision engine's build; None: the processor's bound)."""
    processor: Any
    max_patches: Optional[int] = None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):        # a redirect could lead off the allowed hosts
        return None


def fetch_image(url: str, field: str, allowed_hosts: Sequence[str]) -> bytes:
    """GET an http(s) image URL whose host (or host:port) is in `allowed_hosts`: at most MAX_IMAGE_BYTES within
    FETCH_TIMEOUT_S, redirects not followed. Raises ValueError naming `field`: refused (no hosts allowed, or another
    host), an HTTP error, a timeout, too large."""
    from k3deploy.runtime.vision import MAX_IMAGE_BYTES
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    if not allowed_hosts:
        raise ValueError(f"{field}: remote image URL {url[:80]!r} refused: this server fetches no URLs unless its "
                         "front is started with --allowed-media-hosts HOST[,HOST...] (k3deploy serve / k3deploy "
                         "openai); send the image inline as a data: URL ('data:image/png;base64,...')")
    try:
        netloc = f"{host}:{parts.port}" if parts.port else host
    except ValueError:
        netloc = host
    if host not in allowed_hosts and netloc not in allowed_hosts:
        raise ValueError(f"{field}: host {host!r} of {url[:80]!r} is not in --allowed-media-hosts "
                         f"({', '.join(allowed_hosts)}); send the image as a data: URL or allow that host")
    deadline, chunks, size = time.monotonic() + FETCH_TIMEOUT_S, [], 0
    try:
        opener = urllib.request.build_opener(_NoRedirect)
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "k3deploy"}), timeout=FETCH_TIMEOUT_S) as r:
            while chunk := r.read(1 << 16):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise ValueError(f"{field}: {url[:80]!r} is over {MAX_IMAGE_BYTES >> 20} MiB; send a smaller image")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not complete after {FETCH_TIMEOUT_S:.0f} s")
    except urllib.error.HTTPError as e:
        hint = " (redirects are not followed: give the final URL)" if 300 <= e.code < 400 else ""
        raise ValueError(f"{field}: fetching {url[:80]!r} failed: HTTP {e.code} {e.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as e:          # TimeoutError is an OSError
        raise ValueError(f"{field}: fetching {url[:80]!r} failed ({getattr(e, 'reason', e)})") from None
    return b"".join(chunks)


def load_request_image(source: str, field: str, cfg: FrontConfig) -> EncodedImage:
    """One image part's image (runtime.chat.encode_chat_images' loader): a `data:` URL, or an http(s) URL of an
    allowed host (`fetch_image`); decoded and checked with runtime.vision.load_image (the processor's limits); its
    token count from the resize plan. Raises ValueError naming `field` (runtime.vision.ImageError for a bad image)."""
    from k3deploy.runtime.vision import data_url_bytes, load_image, resize_plan
    if cfg.vision is None:
        raise ValueError(f"{field}: model {cfg.served_model!r} has no vision tower (its config.json has no "
                         "vision_config); send text content parts only")
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        data = data_url_bytes(source, field)
    elif scheme in ("http", "https"):
        data = fetch_image(source, field, cfg.allowed_media_hosts)
    else:
        raise ValueError(f"{field}: {source[:40]!r} is not an image URL; send 'data:<mime type>;base64,<data>' (or an "
                         "http(s) URL of a host in --allowed-media-hosts)")
    with load_image(data, field) as img:
        width, height = img.size
    plan = resize_plan(width, height, cfg.vision.processor)
    if cfg.vision.max_patches is not None and plan.patches > cfg.vision.max_patches:
        raise ValueError(f"{field}: {width}x{height} takes {plan.patches} patches, over the {cfg.vision.max_patches} "
                         "the model's vision engine was built for; send a smaller image")
    return EncodedImage(data, width, height, plan.tokens, field)


def front_vision(model_path: Optional[str], found: dict, tok) -> tuple[Optional[Any], Optional[FrontVision]]:
    """(model config or None, FrontVision or None) of the token model's files: the config of its checkpoint (else
    of its ONNX export's index.json), the processor (the checkpoint's preprocessor_config.json, else the export's
    copy, else VISION.md §1.1), the largest image of its build (`manifest.json` vision.max_patches_per_image).
    Raises ValueError when `tok` does not map `<|media_pad|>` to the model's media_placeholder_token_id."""
    from k3deploy.model.config import load_config
    index = {}
    if found.get("checkpoint"):
        cfg = load_config(found["checkpoint"])
    elif found.get("onnx"):
        index = json.loads((found["onnx"] / "index.json").read_text())
        cfg = load_config(index["config"])
    else:
        return None, None
    if cfg.vision is None:
        return cfg, None
    from k3deploy.runtime.chat import MEDIA_PAD
    from k3deploy.runtime.vision import load_processor
    pad = tok.special_id(MEDIA_PAD) if MEDIA_PAD in tok.special_ids else None
    if pad != cfg.vision.media_placeholder_token_id:
        raise ValueError(f"tokenizer: {MEDIA_PAD} is {pad}, the model's media_placeholder_token_id is "
                         f"{cfg.vision.media_placeholder_token_id}; use the checkpoint's tokenizer (--tokenizer)")
    proc = load_processor(found.get("checkpoint"), None if found.get("checkpoint") else
                          (index.get("vision") or {}).get("processor"))
    max_patches = None
    manifest = pathlib.Path(model_path or ".") / "manifest.json"
    if model_path and manifest.is_file():
        max_patches = ((json.loads(manifest.read_text()).get("vision") or {}).get("max_patches_per_image"))
    return cfg, FrontVision(proc, max_patches)


# ---- jobs -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Job:
    """One generation: the prompt, the sampling, and how to present it."""
    kind: str                              # "chat" | "completion"
    ids: list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool
    stops: list[str]
    model: str
    thinking: bool = False                 # chat: the prompt opened the think channel
    tools: bool = False                    # chat: tool calls are reported
    echo_text: str = ""                    # completion: the prompt text shown before the output (echo)
    echo: bool = False
    discard_output: bool = False           # completion with max_tokens 0 (echo scoring)
    index: int = 0
    logprobs: Optional[int] = None
    images: list = dataclasses.field(default_factory=list)     # chat: EncodedImage per image part, prompt order


def _chat_job(body: dict, tok, cfg: FrontConfig) -> Job:
    from k3deploy.runtime.chat import encode_chat_images, thinking_enabled
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages: a non-empty list of messages is required", "messages")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise APIError("functions: deprecated; send tools and tool_choice", "functions")
    kw = _get(body, "chat_template_kwargs", (dict,), {})
    unknown = set(kw) - {"thinking", "enable_thinking", "thinking_effort"}
    if unknown:
        raise APIError(f"chat_template_kwargs: unknown keys {sorted(unknown)}; K3 takes thinking, enable_thinking, "
                       "thinking_effort", "chat_template_kwargs")
    tools = _get(body, "tools", (list,), None)
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, dict):
        raise APIError("tool_choice: a named function cannot be forced; send 'auto', 'none' or 'required'",
                       "tool_choice")
    if tool_choice is not None and tool_choice not in ("auto", "none", "required"):
        raise APIError(f"tool_choice = {tool_choice!r}: choose 'auto', 'none' or 'required'", "tool_choice")
    if tool_choice == "required" and not tools:
        raise APIError("tool_choice: 'required' needs tools", "tool_choice")
    rf = _get(body, "response_format", (dict,), None)
    reasoning_effort = _get(body, "reasoning_effort", (str,), None)
    try:
        ids, images = encode_chat_images(
            tok, messages, tools, load_image=lambda source, field: load_request_image(source, field, cfg),
            thinking=kw.get("thinking"), enable_thinking=kw.get("enable_thinking"), reasoning_effort=reasoning_effort,
            thinking_effort=kw.get("thinking_effort"), tool_choice=tool_choice, response_format=rf)
    except ValueError as e:
        err = _field_error(e, "messages")
        if err.param in ("thinking", "enable_thinking", "thinking_effort"):
            err.param = f"chat_template_kwargs.{err.param}"
        raise err from None
    thinking = thinking_enabled(kw.get("thinking"), kw.get("enable_thinking"), reasoning_effort,
                                kw.get("thinking_effort"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise APIError(f"{name} = {max_tokens!r}: must be an integer >= 1", name)
    s = _sampling(body, max_tokens, cfg.max_context, len(ids), "messages", name)
    if _get(body, "logprobs", (bool,), False):
        s.logprobs = _get(body, "top_logprobs", (int,), 0, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                          f"must be in 0..{MAX_TOP_LOGPROBS}")
    elif body.get("top_logprobs") is not None:
        raise APIError("top_logprobs: needs logprobs = true", "top_logprobs")
    so = _get(body, "stream_options", (dict,), {})
    return Job("chat", ids, s, bool(_get(body, "stream", (bool,), False)), bool(so.get("include_usage")),
               _stops(body), body.get("model") or cfg.served_model, thinking=thinking,
               tools=bool(tools) and tool_choice != "none", logprobs=s.logprobs, images=images)


def _completion_jobs(body: dict, tok, cfg: FrontConfig) -> list[Job]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise APIError("prompt: send a string, a list of token ids, or a list of those", "prompt")
    if body.get("suffix"):
        raise APIError("suffix: not supported", "suffix")
    echo = bool(_get(body, "echo", (bool,), False))
    k = _get(body, "logprobs", (int,), None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"must be in 0..{MAX_TOP_LOGPROBS}")
    max_tokens = _get(body, "max_tokens", (int,), 16, lambda v: v >= 0, "must be an integer >= 0")
    if max_tokens == 0 and not echo:
        raise APIError("max_tokens = 0: only with echo = true (scoring the prompt)", "max_tokens")
    so = _get(body, "stream_options", (dict,), {})
    jobs = []
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            ids, text = tok.encode(p), p
        else:
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tok.n_vocab for t in p):
                raise APIError(f"{where}: token ids must be integers in [0, {tok.n_vocab})", where)
            ids, text = list(p), tok.decode(p, skip_special=True)
        if not ids:
            raise APIError(f"{where}: empty prompt", where)
        s = _sampling(body, max(max_tokens, 1), cfg.max_context, len(ids), where)
        s.logprobs = k
        s.prompt_logprobs = echo and k is not None
        jobs.append(Job("completion", ids, s, bool(_get(body, "stream", (bool,), False)), bool(so.get("include_usage")),
                        _stops(body), body.get("model") or cfg.served_model, echo_text=text if echo else "",
                        echo=echo, discard_output=max_tokens == 0, index=i, logprobs=k))
    return jobs


# ---- running a job --------------------------------------------------------------------------------------------
def _token_str(tok, t: int) -> str:
    return tok.token_bytes(t).decode("utf-8", errors="replace")


class _Run:
    """One job's generation, turned into OpenAI pieces as the token model's responses arrive."""

    def __init__(self, job: Job, tok, backend: TritonBackend, metrics: Metrics):
        from k3deploy.runtime.chat import OutputParser
        import codecs
        self.job, self.tok, self.backend, self.metrics = job, tok, backend, metrics
        self.rid = f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.parser = OutputParser(tok, job.thinking, f"call_{uuid.uuid4().hex[:12]}_") if job.kind == "chat" else None
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.stop = {"content": StopStrings(job.stops), "reasoning_content": StopStrings(job.stops),
                     "text": StopStrings(job.stops)}
        self.tokens: list[int] = []
        self.finish_reason: Optional[str] = None
        self.cached = 0
        self.calls = 0
        self.prompt_lps: Optional[list] = None
        self.prompt_top: Optional[list] = None

    def _delta_chat(self, token_ids: list[int], final: bool) -> dict:
        d = self.parser.feed(token_ids)
        if final:
            tail = self.parser.finish()
            for key in ("content", "reasoning_content"):
                if tail.get(key):
                    d[key] = d.get(key, "") + tail[key]
            d.setdefault("tool_calls", []).extend(tail.get("tool_calls", []))
        out = {}
        for key in ("reasoning_content", "content"):
            text = self.stop[key].push(d.get(key, ""))
            if final:
                text += self.stop[key].flush()
            if text:
                out[key] = text
        if self.job.tools and d.get("tool_calls"):
            out["tool_calls"] = d["tool_calls"]
        return out

    def _delta_text(self, token_ids: list[int], final: bool) -> str:
        text = self.dec.decode(self.tok.decode_bytes(token_ids, skip_special=True))
        if final:
            text += self.dec.decode(b"", final=True)
        text = self.stop["text"].push(text)
        return text + (self.stop["text"].flush() if final else "")

    def stopped(self) -> bool:
        return any(s.hit for s in self.stop.values())

    async def pieces(self) -> AsyncIterator[tuple[Any, Optional[list]]]:
        """Yield (delta | text, logprob entries) per token-model response, then a last (delta | text, []) piece;
        sets finish_reason. Leaving early (a stop string, a disconnect) cancels the request."""
        job, start, last = self.job, time.monotonic(), None
        self.metrics.running.inc()
        self.metrics.prompt_tokens.inc(len(job.ids))
        try:
            gen = self.backend.generate(self.rid, job.ids, job.sampling, job.images)
            try:
                async for step in gen:
                    now = time.monotonic()
                    if step.prompt_logprobs is not None:
                        self.prompt_lps, self.prompt_top = step.prompt_logprobs, step.prompt_top
                    if step.cached_tokens is not None:
                        self.cached = step.cached_tokens
                    if step.tokens:
                        self.metrics.generation_tokens.inc(len(step.tokens))
                        if last is None:
                            self.metrics.ttft.observe(now - start)
                        else:
                            self.metrics.itl.observe(now - last)
                        last = now
                    if job.discard_output:
                        continue
                    self.tokens += step.tokens
                    final = step.finish_reason is not None
                    lps = self._logprob_entries(step) if job.logprobs is not None else None
                    piece = (self._delta_chat(step.tokens, final) if job.kind == "chat"
                             else self._delta_text(step.tokens, final))
                    if final:
                        self.finish_reason = step.finish_reason
                    if self.stopped():
                        self.finish_reason = "stop"
                        yield piece, lps
                        return
                    yield piece, lps
            finally:
                await gen.aclose()
            if self.finish_reason is None:
                self.finish_reason = "stop" if job.discard_output else "length"
        finally:
            self.metrics.running.dec()
            self.metrics.e2e.observe(time.monotonic() - start)
        if job.kind == "chat" and self.parser.completed_calls and job.tools and self.finish_reason == "stop" \
                and not self.stopped():
            self.finish_reason = "tool_calls"

    def _logprob_entries(self, step: Step) -> list:
        out = []
        for i, t in enumerate(step.tokens):
            lp = step.logprobs[i] if i < len(step.logprobs) else None
            top = step.top[i] if i < len(step.top) else []
            out.append((t, lp, top))
        return out

    def usage(self) -> dict:
        n = 0 if self.job.discard_output else len(self.tokens)
        return {"prompt_tokens": len(self.job.ids), "completion_tokens": n, "total_tokens": len(self.job.ids) + n,
                "prompt_tokens_details": {"cached_tokens": self.cached}}


def _chat_logprobs(tok, entries) -> dict:
    def one(t, lp):
        b = tok.token_bytes(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
    return {"content": [dict(one(t, lp), top_logprobs=[one(a, v) for a, v in top]) for t, lp, top in entries]}


def _completion_logprobs(tok, entries, offset: int) -> tuple[dict, int]:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp, top in entries:
        s = _token_str(tok, t)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else {_token_str(tok, a): v for a, v in top})
        out["text_offset"].append(offset)
        offset += 0 if tok.is_special(t) else len(s)
    return out, offset


def _merge_logprobs(a: Optional[dict], b: dict) -> dict:
    if a is None:
        return b
    for k in a:
        a[k] = a[k] + b[k]
    return a


def _prompt_entries(run: _Run) -> list:
    lps = run.prompt_lps or [None] * len(run.job.ids)
    tops = run.prompt_top or [[] for _ in run.job.ids]
    return [(t, lps[i] if i < len(lps) else None, None if i == 0 else (tops[i] if i < len(tops) else []))
            for i, t in enumerate(run.job.ids)]


async def _watch_disconnect(request, task: asyncio.Task) -> None:
    while not task.done():
        if await request.is_disconnected():
            task.cancel()
            return
        await asyncio.sleep(0.1)


async def _respond(request, job: Job, backend, tok, metrics: Metrics, endpoint: str):
    return await _respond_many(request, [job], backend, tok, metrics, endpoint)


async def _respond_many(request, jobs: list[Job], backend, tok, metrics: Metrics, endpoint: str):
    """Run the jobs (one per prompt / choice) and answer: one JSON object, or an SSE stream when they stream."""
    created = int(time.time())
    runs = [_Run(j, tok, backend, metrics) for j in jobs]
    rid = runs[0].rid
    if jobs[0].stream:
        metrics.requests.labels(endpoint, "200").inc()
        return StreamingResponse(_sse(runs, rid, created, tok), media_type="text/event-stream")

    async def collect(run: _Run):
        parts, entries = [], []
        async for piece, lps in run.pieces():
            parts.append(piece)
            entries += lps or []
        return parts, entries
    task = asyncio.ensure_future(asyncio.gather(*(collect(r) for r in runs)))
    watcher = asyncio.ensure_future(_watch_disconnect(request, task))
    try:
        results = await task
    except asyncio.CancelledError:                       # the client went away: its generations are cancelled
        metrics.requests.labels(endpoint, "499").inc()
        return JSONResponse(APIError("client disconnected", None, 499).body(), status_code=499)
    except TritonModelError as e:
        return _model_error(e, metrics, endpoint, jobs[0])
    finally:
        watcher.cancel()
    choices = [_choice(run, parts, entries, tok) for run, (parts, entries) in zip(runs, results)]
    usage = _sum_usage(runs)
    metrics.requests.labels(endpoint, "200").inc()
    obj = "chat.completion" if jobs[0].kind == "chat" else "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": jobs[0].model, "choices": choices,
                         "usage": usage})


def _model_error(e: TritonModelError, metrics, endpoint, job: Optional[Job] = None):
    msg = str(e)
    bad = "invalid request" in msg or "INVALID_ARG" in msg
    k = re.search(r"\bimage(?:s|_bytes)\[(\d+)\]", msg)         # the model names image k: the part it came from
    param = job.images[int(k.group(1))].field if k and job is not None and int(k.group(1)) < len(job.images) else None
    err = APIError(msg, param, 400 if bad else 500, "invalid_request_error" if bad else "server_error")
    metrics.requests.labels(endpoint, str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status)


def _sum_usage(runs: list[_Run]) -> dict:
    us = [r.usage() for r in runs]
    out = {k: sum(u[k] for u in us) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    out["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in us)}
    return out


def _choice(run: _Run, parts: list, entries: list, tok) -> dict:
    job = run.job
    if job.kind == "chat":
        from k3deploy.runtime.chat import merge_deltas
        m = merge_deltas(parts)
        msg = {"role": "assistant", "content": m["content"] or (None if m["tool_calls"] else ""),
               "reasoning_content": m["reasoning_content"] or None}
        if m["tool_calls"]:
            msg["tool_calls"] = m["tool_calls"]
        return {"index": job.index, "message": msg, "finish_reason": run.finish_reason,
                "logprobs": None if job.logprobs is None else _chat_logprobs(tok, entries)}
    text = job.echo_text + "".join(parts)
    lp = None
    if job.logprobs is not None:
        lp, offset = _completion_logprobs(tok, _prompt_entries(run), 0) if job.echo else (None, 0)
        gen, _ = _completion_logprobs(tok, entries, len(job.echo_text) if job.echo else 0)
        lp = _merge_logprobs(lp, gen)
    return {"index": job.index, "text": text, "logprobs": lp, "finish_reason": run.finish_reason}


def _sse_line(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _sse(runs: list[_Run], rid: str, created: int, tok) -> AsyncIterator[bytes]:
    """The SSE stream of one or more runs (choices interleaved as their tokens arrive)."""
    job0 = runs[0].job
    chat = job0.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage_key = {"usage": None} if job0.include_usage else {}

    def chunk(index, payload, finish=None, logprobs=None):
        c = {"index": index, **payload, "logprobs": logprobs, "finish_reason": finish}
        return _sse_line({"id": rid, "object": obj, "created": created, "model": job0.model, "choices": [c],
                          **usage_key})
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: _Run):
        try:
            job, offset, echoed = run.job, 0, not run.job.echo
            if chat:
                await queue.put(chunk(job.index, {"delta": {"role": "assistant", "content": ""}}))

            async def echo():                   # the prompt (and its logprobs) before the generated text
                nonlocal offset
                lp = None
                if job.logprobs is not None:
                    lp, offset = _completion_logprobs(tok, _prompt_entries(run), 0)
                else:
                    offset = len(job.echo_text)
                await queue.put(chunk(job.index, {"text": job.echo_text}, logprobs=lp))
            async for piece, lps in run.pieces():
                if not echoed:
                    await echo()
                    echoed = True
                if not (piece or lps):
                    continue
                if chat:
                    await queue.put(chunk(job.index, {"delta": piece}, logprobs=_chat_logprobs(tok, lps) if lps else None))
                else:
                    lpo = None
                    if lps:
                        lpo, offset = _completion_logprobs(tok, lps, offset)
                    await queue.put(chunk(job.index, {"text": piece}, logprobs=lpo))
            if not echoed:
                await echo()
            await queue.put(chunk(job.index, {"delta": {}} if chat else {"text": ""}, finish=run.finish_reason))
        except TritonModelError as e:
            await queue.put(_sse_line(APIError(str(e), None, 500, "server_error").body()))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(r)) for r in runs]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
                continue
            yield item
        if job0.include_usage:
            yield _sse_line({"id": rid, "object": obj, "created": created, "model": job0.model, "choices": [],
                             "usage": _sum_usage(runs)})
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:                         # a disconnect closes this generator: cancel the generations
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- CLI ------------------------------------------------------------------------------------------------------
async def _discover(backend: TritonBackend, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await backend.parameters()
        except Exception as e:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot read the config of model {backend.model!r} at {backend.url}: {e}") from e
            await asyncio.sleep(0.5)


def load_front(triton_url: str, model: str = "k3", tokenizer: Optional[str] = None,
               max_context: Optional[int] = None, served_model: Optional[str] = None, api_key: Optional[str] = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, timeout: float = 60.0,
               allowed_media_hosts: Sequence[str] = ()):
    """(app, FrontConfig): the tokenizer and max_context default to what the token model's config parameters name
    (model_path's tiktoken.model; max_context, else the checkpoint's max_position_embeddings); the image side comes
    from model_path's files (`front_vision`); `allowed_media_hosts`: hosts (or host:port) whose http(s) image URLs
    the front fetches (none by default).
    Raises RuntimeError when Triton's model config cannot be read, FileNotFoundError without a tokenizer,
    ValueError for a tokenizer that does not match the model's image placeholder."""
    from k3deploy.runtime.tokenizer import Tokenizer
    async def discover():
        probe = TritonBackend(triton_url, model)
        try:
            return await _discover(probe, timeout)
        finally:
            await probe.close()
    params = asyncio.run(discover())                # model_path: the tokenizer, context and image side
    backend = TritonBackend(triton_url, model)      # its client is made in the server's event loop
    from k3deploy.runtime.api import resolve_model_dir
    found = resolve_model_dir(params["model_path"]) if params.get("model_path") else {}
    if tokenizer is None:
        if not found.get("tokenizer"):
            raise FileNotFoundError(f"model {model!r} ({params.get('model_path')}) has no tiktoken.model: the front "
                                    "needs the checkpoint's tokenizer (tiktoken.model + tokenizer_config.json); copy "
                                    "them beside its weights (`k3deploy synthetic` writes them), or start the front "
                                    "alone with `k3deploy openai --tokenizer PATH`")
        tokenizer = str(found["tokenizer"])
    tok = Tokenizer.from_file(tokenizer)
    model_cfg, vision = front_vision(params.get("model_path"), found, tok)
    if max_context is None:
        if params.get("max_context"):
            max_context = int(params["max_context"])
        elif model_cfg is not None:
            max_context = model_cfg.max_position_embeddings
    hosts = tuple(dict.fromkeys(h.strip().lower() for h in allowed_media_hosts if h.strip()))
    cfg = FrontConfig(served_model or model, max_context, api_key, max_request_bytes, vision, hosts)
    if vision is not None:
        LOGGER.info("images: on (remote URLs from %s)", ", ".join(hosts) if hosts else "no host: data: URLs only")
    return create_app(backend, tok, cfg), cfg


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """CLI entry point; returns the process exit code."""
    p = argparse.ArgumentParser(prog=prog or "python -m k3deploy.serve.openai",
                                description="OpenAI-compatible HTTP front for the Triton k3 model (chat and text "
                                            "completions, streaming, tools, thinking, logprobs, /metrics).")
    p.add_argument("--triton-grpc", required=True, help="Triton gRPC endpoint host:port (e.g. 127.0.0.1:8001)")
    p.add_argument("--model", default="k3", help="Triton token model name (default %(default)s)")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    p.add_argument("--tokenizer", default=None, help="tiktoken.model (default: the one beside the model's checkpoint)")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + generated tokens per request (default: the model's max_context parameter, else "
                        "the checkpoint's max_position_embeddings)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default %(default)s: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default %(default)s)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted (default %(default)s)")
    p.add_argument("--allowed-media-hosts", default="",
                   help="comma-separated hosts (or host:port) whose http(s) image URLs the front may fetch "
                        "(default: none; images come as data: URLs)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for Triton's model (default %(default)s)")
    p.add_argument("--log-level", default="INFO", help="logging level (default %(default)s)")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app, cfg = load_front(a.triton_grpc, a.model, a.tokenizer, a.max_context, a.served_model_name, a.api_key,
                              a.max_request_bytes, a.timeout, a.allowed_media_hosts.split(","))
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        LOGGER.error("%s", e)
        return 2
    import uvicorn
    LOGGER.info("serving %s on http://%s:%d/v1 (Triton %s, max_context %s)", cfg.served_model, a.host, a.port,
                a.triton_grpc, cfg.max_context)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level.lower(), access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
