"""The launcher's HTTP front: the public HTTP port, in front of tritonserver's own HTTP endpoint.

The bundled Triton 2.51 mishandles its HTTP input: a body of ~4 MB or more crashes the server (SIGSEGV on
``/generate``, 8 MB on ``/infer``; gRPC refuses 50 MB cleanly), malformed JSON is an HTTP 500 naming no field,
integers too large for an input's type wrap silently (99999999999 -> 1215752191 as INT32), unknown fields are ignored,
and a client that disconnects from a non-streaming ``/generate`` or ``/generate_stream`` is never cancelled (Triton
signals the Python model only when a response fails to send). tritonserver therefore listens on an internal
loopback port and this front, an aiohttp server on a thread of the launcher, owns ``--http-port``:

* every request body is capped at ``MAX_BODY_BYTES`` (3 MiB: 256K-token prompts as JSON fit; Triton crashes at ~4 MB)
  before anything reaches tritonserver: HTTP 413 with a JSON error naming the limit (``Content-Length`` and
  ``Expect: 100-continue`` are answered before the body is sent; chunked bodies are cut at the limit);
* ``POST /v2/models/<m>[/versions/<v>]/generate`` and ``.../generate_stream`` (Triton's generate extension) are
  served here: the JSON body is parsed (400 naming the problem: position of a syntax error, an unknown field, a value
  that does not fit the input's type or shape in the model config) and sent to tritonserver over gRPC, whose stream
  is cancelled the moment the HTTP client disconnects (the k3 model then frees the request's slot and blocks).
  Responses have Triton's format: one JSON object (``/generate``, exactly one response) or server-sent events
  ``data: {...}`` (``/generate_stream``); each output flattened, a one-element output as a scalar; errors as
  ``{"error": msg}`` (400 before any event; an ``error`` event after);
* readiness (``/v2/health/ready``, ``/v2/models/<m>[/versions/<v>]/ready``) answers 503 with the supervisor's reason
  once the launcher found tritonserver or a model stub dead (`Front.fail`), which also fails every request in
  flight here at once; everything else is proxied to tritonserver as it is.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Callable, Optional

import numpy as np

LOGGER = logging.getLogger(__name__)

MAX_BODY_BYTES = 3 << 20
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length"}
_INT_TYPES = {"TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
              "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32, "TYPE_UINT64": np.uint64}
_FLOAT_TYPES = {"TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64}
_WIRE = {"TYPE_BOOL": "BOOL", "TYPE_STRING": "BYTES", "TYPE_FP16": "FP16", "TYPE_FP32": "FP32", "TYPE_FP64": "FP64",
         **{k: k[5:] for k in _INT_TYPES}}


class RequestError(ValueError):
    """A request the front refuses: `status` and a message naming the problem."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


def _too_large(n: Optional[int]) -> str:
    size = f"{n:,} bytes" if n is not None else "more"
    return (f"request body of {size} exceeds the limit of {MAX_BODY_BYTES:,} bytes ({MAX_BODY_BYTES >> 20} MiB) "
            "that this server accepts over HTTP; send fewer tokens, or large tensors over gRPC")


def parse_body(raw: bytes) -> dict:
    """The JSON object of a generate request. Raises RequestError(400) saying what is malformed and where."""
    def no_constant(c):
        raise ValueError(f"{c} is not a JSON number")
    try:
        body = json.loads(raw, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                                f"(character {e.pos})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"request body must be a JSON object of input names to values, got a "
                                f"{type(body).__name__}")
    return body


def to_tensor(name: str, value, spec: dict, batched: bool) -> np.ndarray:
    """One generate field as the array the model config declares (`spec`: the config's input entry). A scalar or a
    list of lower rank gets leading 1s (a batch of one when the model batches). Raises RequestError(400) naming the
    field when a value does not fit the type (an integer out of range, a float that overflows, a non-boolean) or
    the shape."""
    dt = spec.get("data_type", "")
    dims = [int(d) for d in spec.get("dims", [])]
    dims = ([1] if batched else []) + dims
    if dt == "TYPE_STRING":
        flat = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in _flatten(flat)):
            raise RequestError(400, f"{name}: expected text (a string or a list of strings)")
        arr = np.array([v.encode() for v in _flatten(flat)], dtype=np.object_).reshape(np.shape(flat))
    else:
        leaves = list(_flatten(value))
        if dt == "TYPE_BOOL":
            if not all(isinstance(v, bool) for v in leaves):
                raise RequestError(400, f"{name}: expected true or false")
            arr = np.array(value, dtype=np.bool_)
        elif dt in _INT_TYPES:
            t = _INT_TYPES[dt]
            info = np.iinfo(t)
            for v in leaves:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise RequestError(400, f"{name}: {json.dumps(v)} is not an integer ({dt[5:]} in the model config)")
                if not info.min <= v <= info.max:
                    raise RequestError(400, f"{name}: {v} does not fit {dt[5:]} (the model's type for it; "
                                            f"[{info.min}, {info.max}]); it would wrap around")
            arr = np.array(value, dtype=t)
        elif dt in _FLOAT_TYPES:
            t = _FLOAT_TYPES[dt]
            for v in leaves:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise RequestError(400, f"{name}: {json.dumps(v)} is not a number")
            with np.errstate(over="ignore"):
                arr = np.array(value, dtype=t)
            if not np.isfinite(arr).all():
                raise RequestError(400, f"{name}: a value overflows {dt[5:]} (the model's type for it)")
        else:
            raise RequestError(400, f"{name}: the model's type {dt} is not accepted over HTTP generate; use gRPC")
    try:
        if arr.ndim < len(dims):
            arr = arr.reshape((1,) * (len(dims) - arr.ndim) + arr.shape)
    except ValueError:
        pass
    if arr.ndim != len(dims) or any(d >= 0 and d != s for d, s in zip(dims, arr.shape)):
        raise RequestError(400, f"{name}: shape {list(arr.shape)} does not match the model's dims {dims} "
                                "(-1: any length)")
    return arr


def _flatten(v):
    if isinstance(v, list):
        for x in v:
            yield from _flatten(x)
    else:
        yield v


def response_json(result, model: str, version: str, rid: str) -> dict:
    """Triton's generate response object of one InferResult: outputs flattened, one element as a scalar."""
    resp = result.get_response()
    out: dict = {"id": rid} if rid else {}
    out.update(model_name=resp.model_name or model, model_version=resp.model_version or version)
    for o in resp.outputs:
        a = result.as_numpy(o.name).reshape(-1)
        vals = [v.decode(errors="replace") if isinstance(v, bytes) else v for v in a.tolist()]
        out[o.name] = vals[0] if len(vals) == 1 else vals
    return out


class Front:
    """The HTTP front (module docstring) on `host:port`, over tritonserver's HTTP at `upstream_http` and gRPC at
    `upstream_grpc` ("host:port"). `start()` binds (OSError when the port is taken) and serves on a daemon thread;
    `fail(reason)` turns readiness to 503 and fails what is in flight; `stop()` closes it. Thread safe."""

    def __init__(self, host: str, port: int, upstream_http: str, upstream_grpc: str):
        self.host, self.port = host, int(port)
        self.upstream_http, self.upstream_grpc = upstream_http, upstream_grpc
        self.failure: Optional[str] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner = None
        self._inflight: set = set()            # gRPC calls of generate requests being served
        self._configs: dict = {}

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "Front":
        started: "asyncio.Future | None" = None
        ready = threading.Event()
        box: dict = {}

        def run():
            nonlocal started
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                box["error"] = e
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
            loop.close()

        self._thread = threading.Thread(target=run, name="k3-http-front", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        LOGGER.info("HTTP front on %s:%d (bodies <= %d bytes) -> tritonserver http %s, grpc %s", self.host, self.port,
                    MAX_BODY_BYTES, self.upstream_http, self.upstream_grpc)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop = self._thread = None

    def fail(self, reason: str) -> None:
        """Readiness false with `reason`; every generate request in flight ends now with a 503 error naming it."""
        self.failure = reason
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: [c.cancel() for c in list(self._inflight)])

    async def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, web
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        for path in ("/v2/models/{model}/generate", "/v2/models/{model}/versions/{version}/generate"):
            app.router.add_post(path, self._generate, expect_handler=self._expect)
            app.router.add_post(path + "_stream", self._generate_stream, expect_handler=self._expect)
        for path in ("/v2/health/ready", "/v2/models/{model}/ready", "/v2/models/{model}/versions/{version}/ready"):
            app.router.add_get(path, self._ready)
        app.router.add_route("*", "/{tail:.*}", self._proxy, expect_handler=self._expect)
        self._session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10), auto_decompress=False)
        self._grpc = None          # made on first use: no gRPC threads exist yet when the launcher forks tritonserver
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()

    async def _close(self) -> None:
        for c in list(self._inflight):
            c.cancel()
        await self._runner.cleanup()
        await self._session.close()
        if self._grpc is not None:
            await self._grpc.close()

    # -- request handling ----------------------------------------------------------------------------
    async def _expect(self, request):
        """Answer `Expect: 100-continue` with 413 when Content-Length is over the cap, before the body is sent."""
        from aiohttp import web
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return web.json_response({"error": _too_large(request.content_length)}, status=413)
        if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        return None

    async def _read(self, request) -> bytes:
        from aiohttp import web
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise RequestError(413, _too_large(request.content_length))
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, _too_large(None)) from None

    async def _ready(self, request):
        from aiohttp import web
        if self.failure is not None:
            return web.json_response({"error": f"not ready: {self.failure}"}, status=503)
        return await self._proxy(request)

    async def _proxy(self, request):
        from aiohttp import ClientError, web
        try:
            body = await self._read(request)
        except RequestError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP and k.lower() != "expect"}
        try:
            async with self._session.request(request.method, f"http://{self.upstream_http}{request.path_qs}",
                                             headers=headers, data=body if body else None) as up:
                resp = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                     if k.lower() not in _HOP})
                await resp.prepare(request)
                async for chunk in up.content.iter_chunked(1 << 16):
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except ClientError as e:
            reason = self.failure or f"tritonserver is not reachable ({e})"
            return web.json_response({"error": reason}, status=503)

    async def _request(self, request) -> tuple[dict, str, str, str]:
        """(gRPC stream request dict, model, version, request id) of a generate request. Raises RequestError."""
        from tritonclient.grpc import InferInput
        from tritonclient.utils import InferenceServerException
        if self.failure is not None:
            raise RequestError(503, f"the server failed: {self.failure}")
        model, version = request.match_info["model"], request.match_info.get("version", "")
        body = parse_body(await self._read(request))
        key = (model, version)
        if self._grpc is None:
            from tritonclient.grpc.aio import InferenceServerClient
            self._grpc = InferenceServerClient(self.upstream_grpc)
        if key not in self._configs:
            try:
                cfg = await self._grpc.get_model_config(model, version, as_json=True)
            except InferenceServerException as e:
                raise RequestError(404 if "unknown model" in str(e).lower() or "not found" in str(e).lower()
                                   else 503, e.message()) from None
            self._configs[key] = cfg["config"]
        cfg = self._configs[key]
        specs = {i["name"]: i for i in cfg.get("input", [])}
        rid = body.pop("id", "")
        params = body.pop("parameters", None)
        if not isinstance(rid, str) or (params is not None and not isinstance(params, dict)):
            raise RequestError(400, "id must be a string and parameters a JSON object")
        unknown = sorted(set(body) - set(specs))
        if unknown:
            raise RequestError(400, f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                                    f"model {model} takes {', '.join(specs)} (and 'id', 'parameters')")
        batched = int(cfg.get("max_batch_size", 0) or 0) > 0
        inputs = []
        for name, value in body.items():
            arr = to_tensor(name, value, specs[name], batched)
            inp = InferInput(name, list(arr.shape), _WIRE[specs[name]["data_type"]])
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        req = {"model_name": model, "model_version": version, "inputs": inputs, "request_id": rid,
               "parameters": params, "enable_empty_final_response": True}
        return req, model, version, rid

    async def _results(self, req: dict, on_result) -> None:
        """Send one gRPC stream request and call `await on_result(InferResult)` for each response with outputs
        until the final one. The stream is cancelled whenever this ends early: the HTTP client went away (the handler
        is cancelled), `fail`, or an error. Raises RequestError for an error response or a broken stream."""
        import grpc
        from tritonclient.utils import InferenceServerException

        async def one():
            yield req
        call = self._grpc.stream_infer(one())
        self._inflight.add(call)
        try:
            async for result, error in call:
                if error is not None:                  # the model's error response: 400 as Triton's HTTP answers
                    raise RequestError(400, error.message())
                resp = result.get_response()
                if resp.outputs:
                    await on_result(result)
                final = resp.parameters["triton_final_response"] if "triton_final_response" in resp.parameters \
                    else None
                if final is None or final.bool_param:
                    return
        except asyncio.CancelledError:
            if self.failure is not None:               # fail(): answer with the reason
                raise RequestError(503, f"the server failed: {self.failure}") from None
            raise                                      # the client went away
        except (InferenceServerException, grpc.RpcError) as e:
            detail = e.message() if isinstance(e, InferenceServerException) else e.details()
            raise RequestError(503, f"the server failed: {self.failure}" if self.failure
                               else f"tritonserver stream broke: {detail}") from None
        finally:
            call.cancel()                              # a no-op once the stream ended; else the model cancels
            self._inflight.discard(call)

    async def _generate(self, request):
        from aiohttp import web
        try:
            req, model, version, rid = await self._request(request)
            got = []

            async def keep(result):
                got.append(result)
            await self._results(req, keep)
            if len(got) != 1:
                raise RequestError(400, f"generate expects exactly one response, the model sent {len(got)}; use "
                                        "generate_stream for a model that streams (streaming=true)")
            return web.json_response(response_json(got[0], model, version, rid))
        except RequestError as e:
            return web.json_response({"error": str(e)}, status=e.status)

    async def _generate_stream(self, request):
        from aiohttp import web
        box: dict = {}

        def event(obj) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()
        try:
            req, model, version, rid = await self._request(request)

            async def send(result):
                if "resp" not in box:
                    box["resp"] = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
                    await box["resp"].prepare(request)
                await box["resp"].write(event(response_json(result, model, version, rid)))
            await self._results(req, send)
        except RequestError as e:
            if "resp" not in box:
                return web.Response(status=e.status, body=event({"error": str(e)}),
                                    content_type="text/event-stream", charset="utf-8")
            await box["resp"].write(event({"error": str(e)}))
        if "resp" not in box:
            return web.Response(status=200, body=b"", content_type="text/event-stream", charset="utf-8")
        await box["resp"].write_eof()
        return box["resp"]
