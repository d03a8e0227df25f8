"""Triton Python-backend model ``k3`` (copied to ``REPO/k3/1/model.py`` by :mod:`serve.repository`).

Decoupled model speaking TensorRT-LLM's tensor names. ``initialize`` builds the runtime once
(``runtime.api.LLM(model_path, backend=...).start()`` -> ``AsyncEngine``); ``execute`` validates each request
and hands it to ``AsyncEngine.submit``, so concurrent Triton requests are batched by the runtime's scheduler
thread. Responses are sent from that thread through each request's response sender:

* ``streaming=true``: one response per token (``output_ids [[tok]]``, ``sequence_length [1]``), then an empty
  response carrying only the FINAL flag (clients see it with ``enable_empty_final_response=True``);
* otherwise one response with all generated tokens (``output_ids [1, n]``, ``sequence_length [n]``) + FINAL.

The final response of a request that completed (not cancelled, no error) also carries ``num_cached_tokens``
(``[1]`` INT32: prompt tokens served from the runtime's prefix cache, 0 when it is off); in streaming mode it is
that final response's only output.

``output_ids`` holds generated tokens only (like TensorRT-LLM with ``exclude_input_in_output=true``).
``end_id`` is the end-of-sequence id as in TensorRT-LLM: it replaces the checkpoint's EOS (``end_id = -1``: no
EOS, generate ``request_output_len`` tokens); ``pad_id`` is accepted and unused (no padding: one sequence per
response); ``stop_words`` is TensorRT-LLM's stop-words list ``[2, N]`` (or ``[1, 2, N]``): row 0 the concatenated
word ids, row 1 the exclusive end offsets padded with -1; each word must be one token (the scheduler stops on
single tokens; a longer word is an error response). ``top_k``/``top_p`` alias ``runtime_top_k``/``runtime_top_p``.

Cancellation: a cancelled request (``sender.is_cancelled()``, seen in the token callback or by a watcher
thread polling active requests) is cancelled in the engine (``eng.cancel``), which frees its KDA slot and
latent blocks; the FINAL flag is still sent. Bad requests and runtime errors become error responses; nothing
raised here escapes ``execute`` or the callbacks.

Custom metrics (``pb_utils.MetricFamily``, label ``model``): gauges ``k3_kda_slots_in_use``,
``k3_latent_blocks_in_use``, ``k3_max_requests_per_step``, ``k3_active_requests`` and, with prefix caching,
``k3_prefix_cache_hit_rate``, ``k3_prefix_cache_tokens``, ``k3_snapshot_pool_bytes``, ``k3_latent_blocks_cached``;
counters ``k3_tokens_generated``, ``k3_preemptions``, ``k3_steps``, ``k3_prefix_cache_hit_tokens``. Updated by the watcher thread, which the token
callback wakes after every token.

Config parameters (string values): ``project_root`` (prepended to ``sys.path``), ``model_path``,
``backend``, ``max_batch``, ``max_num_tokens``, ``max_context``, ``vocab_size`` (optional),
``enable_prefix_caching`` ("true": ``LLM(enable_prefix_caching=True)``).
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
from typing import Any, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

LOGGER = logging.getLogger("k3.triton")

WATCH_INTERVAL_S = 0.05

_SCALARS = {  # name -> (numpy dtype kind(s) accepted, python type)
    "input_lengths": ("iu", int),
    "request_output_len": ("iu", int),
    "end_id": ("iu", int),
    "pad_id": ("iu", int),
    "runtime_top_k": ("iu", int),
    "top_k": ("iu", int),
    "random_seed": ("iu", int),
    "temperature": ("f", float),
    "runtime_top_p": ("f", float),
    "top_p": ("f", float),
    "streaming": ("b", bool),
}


class RequestError(ValueError):
    """A request field is missing or invalid; the message names the field and the fix."""


def _log(level: str, msg: str) -> None:
    """Log through Triton's logger when available (shows up in the server log), else ``logging``."""
    try:
        getattr(pb_utils.Logger, f"log_{level}")(msg)
    except Exception:  # noqa: BLE001 - logging must never fail a request
        getattr(LOGGER, "warning" if level == "warn" else level, LOGGER.info)(msg)


def _input(request, name: str) -> Optional[np.ndarray]:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _scalar(request, name: str):
    arr = _input(request, name)
    if arr is None:
        return None
    kinds, typ = _SCALARS[name]
    if arr.dtype.kind not in kinds:
        raise RequestError(f"{name}: dtype {arr.dtype} not accepted; send "
                           f"{ {'iu': 'INT32', 'f': 'FP32', 'b': 'BOOL'}[kinds] } with shape [1]")
    if arr.size != 1:
        raise RequestError(f"{name}: expected exactly one value (shape [1]), got shape {list(arr.shape)}")
    return typ(arr.reshape(-1)[0])


def parse_request(request, vocab_size: Optional[int]) -> dict:
    """Turn a Triton request into ``{"prompt": list[int], "streaming": bool, "params": dict}``.

    Raises:
        RequestError: naming the offending field and how to fix it.
    """
    ids = _input(request, "input_ids")
    if ids is None:
        raise RequestError("input_ids: missing; send the prompt token ids as INT32 with shape [N], N >= 1")
    if ids.dtype.kind not in "iu":
        raise RequestError(f"input_ids: dtype {ids.dtype} not accepted; send INT32 token ids")
    ids = ids.reshape(-1).astype(np.int64)
    n_in = _scalar(request, "input_lengths")
    if n_in is not None:
        if not 1 <= n_in <= ids.size:
            raise RequestError(f"input_lengths: {n_in} must be in [1, len(input_ids)={ids.size}]")
        ids = ids[:n_in]
    if ids.size == 0:
        raise RequestError("input_ids: empty prompt; send at least one token id")
    if (ids < 0).any() or (vocab_size is not None and (ids >= vocab_size).any()):
        bad = int(ids[(ids < 0) | (ids >= (vocab_size or np.iinfo(np.int64).max))][0])
        raise RequestError(f"input_ids: token id {bad} out of range [0, {vocab_size if vocab_size else 'vocab'}); "
                           "send ids produced by the model's tokenizer")
    max_tokens = _scalar(request, "request_output_len")
    if max_tokens is None:
        raise RequestError("request_output_len: missing; send the number of tokens to generate (INT32 [1], >= 1)")
    if max_tokens < 1:
        raise RequestError(f"request_output_len: {max_tokens} must be >= 1")

    params: dict[str, Any] = {"max_tokens": int(max_tokens)}
    temperature = _scalar(request, "temperature")
    if temperature is not None:
        if not np.isfinite(temperature) or temperature < 0:
            raise RequestError(f"temperature: {temperature} must be a finite number >= 0 (0 = greedy)")
        params["temperature"] = float(temperature)
    for canonical, alias, field in (("runtime_top_k", "top_k", "top_k"), ("runtime_top_p", "top_p", "top_p")):
        a, b = _scalar(request, canonical), _scalar(request, alias)
        if a is not None and b is not None and a != b:
            raise RequestError(f"{canonical}={a} and {alias}={b} disagree; send only one of them")
        v = a if a is not None else b
        if v is None:
            continue
        if field == "top_k" and v < 0:
            raise RequestError(f"{canonical}: {v} must be >= 0 (0 = no top-k)")
        if field == "top_p" and not 0.0 < v <= 1.0:
            raise RequestError(f"{canonical}: {v} must be in (0, 1]")
        params[field] = v
    seed = _scalar(request, "random_seed")
    if seed is not None:
        params["seed"] = int(seed)
    stops: list[int] = []
    sw = _input(request, "stop_words")
    if sw is not None:
        stops += parse_stop_words(sw)
    end_id = _scalar(request, "end_id")
    if end_id is not None:
        params["ignore_eos"] = True           # end_id replaces the checkpoint's EOS (TensorRT-LLM semantics)
        if end_id >= 0:
            stops.append(int(end_id))
    if stops:
        params["stop_token_ids"] = tuple(dict.fromkeys(stops))
    _scalar(request, "pad_id")  # type-checked, otherwise unused
    streaming = bool(_scalar(request, "streaming") or False)
    return {"prompt": [int(x) for x in ids], "streaming": streaming, "params": params}


def parse_stop_words(sw) -> list[int]:
    """TensorRT-LLM stop_words_list [2, N] / [1, 2, N] (ids row, end-offsets row padded with -1) -> stop token ids.
    Raises RequestError for another shape or dtype, bad offsets, or a word longer than one token."""
    import numpy as np
    if sw.dtype.kind not in "iu":
        raise RequestError(f"stop_words: dtype {sw.dtype} not accepted; send INT32 [2, N] (ids, end offsets)")
    a = np.asarray(sw).astype(np.int64)
    if a.ndim == 3 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or a.shape[0] != 2:
        raise RequestError(f"stop_words: shape {list(sw.shape)}; send TensorRT-LLM's [2, N] list: row 0 the word "
                           "ids, row 1 the end offsets (-1 padded)")
    ids, offs = a[0], [int(o) for o in a[1] if o >= 0]
    words, start = [], 0
    for end in offs:
        if not start < end <= len(ids):
            raise RequestError(f"stop_words: offsets {offs} must increase within 1..{len(ids)}")
        words.append([int(t) for t in ids[start:end]])
        start = end
    long = [w for w in words if len(w) != 1]
    if long:
        raise RequestError(f"stop_words: {long[:3]} have more than one token; only single-token stop words are supported")
    return [w[0] for w in words]


def _error_response(msg: str, code=None):
    if code is None:
        code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    err = pb_utils.TritonError(msg) if code is None else pb_utils.TritonError(msg, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


def _tokens_response(tokens: list[int], num_cached_tokens: Optional[int] = None):
    out = [pb_utils.Tensor("output_ids", np.asarray(tokens, dtype=np.int32).reshape(1, -1)),
           pb_utils.Tensor("sequence_length", np.asarray([len(tokens)], dtype=np.int32))]
    if num_cached_tokens is not None:
        out.append(_cached_tensor(num_cached_tokens))
    return pb_utils.InferenceResponse(output_tensors=out)


def _cached_tensor(n: int):
    return pb_utils.Tensor("num_cached_tokens", np.asarray([n], dtype=np.int32))


class _Stream:
    """One in-flight request: its sender, collected tokens and cancellation state."""

    def __init__(self, rid: str, sender, streaming: bool):
        self.rid = rid
        self.sender = sender
        self.streaming = streaming
        self.tokens: list[int] = []
        self.cancelled = False  # client cancelled; engine cancel requested
        self.cancel_sent = False
        self.done = False
        self.request = None  # the engine's Request (num_cached_tokens), set by execute
        self.lock = threading.Lock()

    def client_cancelled(self) -> bool:
        try:
            return bool(self.sender.is_cancelled())
        except Exception:  # noqa: BLE001 - a gone sender counts as cancelled
            return True


class TritonPythonModel:
    """Decoupled Triton model that serves ``runtime.api`` through its ``AsyncEngine``."""

    def initialize(self, args: dict) -> None:
        """Build the runtime once and start the watcher thread."""
        self.model_config = json.loads(args["model_config"])
        self.name = self.model_config.get("name", "k3")
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                f"model {self.name}: set `model_transaction_policy {{ decoupled: true }}` in config.pbtxt "
                "(streaming sends many responses per request)")
        params = {k: v.get("string_value", "") for k, v in self.model_config.get("parameters", {}).items()}
        root = params.get("project_root")
        if root and root not in sys.path:
            sys.path.insert(0, root)
        model_path = params.get("model_path")
        if not model_path:
            raise pb_utils.TritonModelException(
                f"model {self.name}: parameter 'model_path' missing in config.pbtxt; regenerate the repository "
                "with `python -m k3deploy.serve.repository --engines DIR --out REPO`")
        try:
            from k3deploy.runtime.api import LLM, SamplingParams
        except ImportError as e:
            raise pb_utils.TritonModelException(
                f"model {self.name}: cannot import runtime.api ({e}); parameter 'project_root'={root!r} must be "
                "the k3deploy checkout that contains runtime/") from e
        self._SamplingParams = SamplingParams
        kwargs: dict[str, Any] = {"backend": params.get("backend") or "torch"}
        for key in ("max_batch", "max_num_tokens", "max_context"):
            if params.get(key):
                kwargs[key] = int(params[key])
        for key in ("device", "ops", "dense_dtype"):      # torch backend on a GPU (python -m k3deploy.serve.repository --device)
            if params.get(key):
                kwargs[key] = params[key]
        if params.get("cuda_graphs", "").lower() == "true":
            kwargs["cuda_graphs"] = True
        if params.get("enable_prefix_caching", "").lower() == "true":
            kwargs["enable_prefix_caching"] = True
        _log("info", f"k3: loading {model_path} with {kwargs}")
        self.llm = LLM(model_path, **kwargs)
        self.engine = self.llm.start()
        self.vocab_size = self._vocab_size(params)

        self._ids = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_counters: dict[str, float] = {}
        self._init_metrics()
        self._watcher = threading.Thread(target=self._watch, name="k3-triton-watcher", daemon=True)
        self._watcher.start()
        _log("info", f"k3: ready (vocab_size={self.vocab_size})")

    # -- setup helpers -------------------------------------------------------------------------------
    def _vocab_size(self, params: dict) -> Optional[int]:
        for obj, attr in ((self.llm, "vocab_size"), (getattr(self.llm, "cfg", None), "vocab_size"),
                          (getattr(self.llm, "config", None), "vocab_size"),
                          (getattr(getattr(self.llm, "config", None), "text_config", None), "vocab_size")):
            v = getattr(obj, attr, None) if obj is not None else None
            if isinstance(v, int) and v > 0:
                return v
        v = params.get("vocab_size")
        return int(v) if v else None  # None: the runtime's own validation (ValueError) still applies

    def _init_metrics(self) -> None:
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        # The families must outlive their metrics (Triton rejects updates once a family is garbage-collected).
        self._families: list[Any] = []

        def family(name: str, desc: str, kind):
            fam = pb_utils.MetricFamily(name=name, description=desc, kind=kind)
            self._families.append(fam)
            return fam.Metric(labels)

        labels = {"model": self.name}
        try:
            G, C = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
            for key, desc in (("kda_slots_in_use", "KDA state slots held by requests"),
                              ("latent_blocks_in_use", "MLA latent-cache blocks held by requests"),
                              ("max_requests_per_step", "Most requests the scheduler ran in one step"),
                              ("active_requests", "Requests submitted and not yet finished"),
                              ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up"),
                              ("prefix_cache_tokens", "Tokens whose latents the prefix cache holds"),
                              ("snapshot_pool_bytes", "Bytes of KDA snapshots the prefix cache holds"),
                              ("latent_blocks_cached", "MLA latent-cache blocks held only by the prefix cache")):
                self._gauges[key] = family(f"k3_{key}", desc, G)
            for key, desc in (("tokens_generated", "Tokens generated"),
                              ("preemptions", "Requests preempted by the scheduler"),
                              ("steps", "Scheduler steps"),
                              ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")):
                self._counters[key] = family(f"k3_{key}", desc, C)
        except Exception as e:  # noqa: BLE001 - metrics disabled on the server, or an old backend
            _log("warn", f"k3: custom metrics unavailable ({e}); serving without them")
            self._gauges, self._counters, self._families = {}, {}, []

    def _update_metrics(self) -> None:
        if not (self._gauges or self._counters):
            return
        try:
            m = self.engine.metrics()
        except Exception as e:  # noqa: BLE001
            _log("warn", f"k3: engine.metrics() failed: {e}")
            return
        with self._streams_lock:
            m = dict(m, active_requests=len(self._streams))
        for key, metric in self._gauges.items():
            if key in m:
                metric.set(float(m[key]))
        for key, metric in self._counters.items():
            if key in m:
                value = float(m[key])
                delta = value - self._last_counters.get(key, 0.0)
                if delta > 0:
                    metric.increment(delta)
                self._last_counters[key] = max(value, self._last_counters.get(key, 0.0))

    # -- watcher: cancellation + metrics -------------------------------------------------------------
    def _watch(self) -> None:
        last_error = None
        while not self._stop.is_set():
            self._wake.wait(WATCH_INTERVAL_S)
            self._wake.clear()
            try:
                with self._streams_lock:
                    streams = list(self._streams.values())
                for st in streams:
                    if not st.done and (st.cancelled or st.client_cancelled()):
                        self._cancel(st)
                self._update_metrics()
            except Exception as e:  # noqa: BLE001 - the watcher must survive anything
                if repr(e) != last_error:  # log each distinct failure once, not every interval
                    last_error = repr(e)
                    _log("error", f"k3: watcher error: {e!r}")

    def _cancel(self, st: _Stream) -> None:
        with st.lock:
            st.cancelled = True
            if st.cancel_sent or st.done:
                return
            st.cancel_sent = True
        _log("info", f"k3: request {st.rid} cancelled by the client; freeing its slot")
        try:
            self.engine.cancel(st.rid)
        except Exception as e:  # noqa: BLE001 - e.g. already finished
            _log("verbose", f"k3: cancel({st.rid}) -> {e!r}")

    # -- request path ----------------------------------------------------------------------------------
    def _finish(self, st: _Stream, error: Optional[str]) -> None:
        with st.lock:
            if st.done:
                return
            st.done = True
        with self._streams_lock:
            self._streams.pop(st.rid, None)
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            if error is not None:
                st.sender.send(_error_response(f"k3: generation failed: {error}",
                                               getattr(pb_utils.TritonError, "INTERNAL", None)), flags=final)
            elif st.cancelled:
                st.sender.send(flags=final)
            else:
                cached = int(getattr(st.request, "num_cached_tokens", 0) or 0)
                st.sender.send(pb_utils.InferenceResponse(output_tensors=[_cached_tensor(cached)]) if st.streaming
                               else _tokens_response(st.tokens, cached), flags=final)
        except Exception as e:  # noqa: BLE001 - client gone
            _log("verbose", f"k3: final send for {st.rid} failed: {e!r}")
        self._wake.set()

    def _on_token(self, st: _Stream, token: Optional[int], finished: bool, error: Optional[str]) -> None:
        """Engine callback (scheduler thread). Never raises."""
        try:
            if token is not None and not st.cancelled:
                if st.client_cancelled():
                    st.cancelled = True  # the watcher calls engine.cancel (not re-entering the engine here)
                else:
                    st.tokens.append(int(token))
                    if st.streaming:
                        st.sender.send(_tokens_response([int(token)]))
            if finished:
                self._finish(st, error)
            else:
                self._wake.set()
        except Exception as e:  # noqa: BLE001
            _log("error", f"k3: callback for {st.rid} failed: {e!r}")
            st.cancelled = True
            self._wake.set()
            if finished:
                self._finish(st, None)

    def execute(self, requests):
        """Validate and submit every request; responses are sent asynchronously. Returns ``None``."""
        for request in requests:
            try:
                sender = request.get_response_sender()
            except Exception as e:  # noqa: BLE001
                _log("error", f"k3: no response sender: {e!r}")
                continue
            try:
                parsed = parse_request(request, self.vocab_size)
                params = self._SamplingParams(**parsed["params"])
            except (RequestError, ValueError, TypeError) as e:
                self._send_error(sender, str(e))
                continue
            except Exception as e:  # noqa: BLE001
                self._send_error(sender, f"k3: cannot read request: {e!r}")
                continue
            rid = f"{request.request_id() or 'req'}#{next(self._ids)}"
            st = _Stream(rid, sender, parsed["streaming"])
            with self._streams_lock:
                self._streams[rid] = st
            try:
                with self.engine._turn():  # st.request is set before the request's first step can finish it
                    st.request = self.engine.submit(rid, parsed["prompt"], params,
                                                    lambda tok, fin, err, st=st: self._on_token(st, tok, fin, err))
            except ValueError as e:  # runtime validation; names the field
                with self._streams_lock:
                    self._streams.pop(rid, None)
                st.done = True
                self._send_error(sender, f"invalid request: {e}")
            except Exception as e:  # noqa: BLE001
                with self._streams_lock:
                    self._streams.pop(rid, None)
                st.done = True
                self._send_error(sender, f"k3: submit failed: {e!r}", getattr(pb_utils.TritonError, "INTERNAL", None))
        self._wake.set()
        return None

    @staticmethod
    def _send_error(sender, msg: str, code=None) -> None:
        try:
            sender.send(_error_response(msg, code), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # noqa: BLE001
            _log("error", f"k3: could not send error response ({msg}): {e!r}")

    def finalize(self) -> None:
        """Stop the watcher and shut the engine down."""
        self._stop.set()
        self._wake.set()
        try:
            self.engine.shutdown()
            self.llm.executor.close()                 # CUDA graphs before the process exits / NCCL goes
        except Exception as e:  # noqa: BLE001
            _log("warn", f"k3: engine.shutdown() failed: {e!r}")
        self._watcher.join(timeout=5)
