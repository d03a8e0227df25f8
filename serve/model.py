"""Triton Python-backend model ``k3`` (copied to ``REPO/k3/1/model.py`` by :mod:`serve.repository`).

Decoupled model with the tensor contract of TensorRT-LLM's ``tensorrt_llm`` model (tensorrtllm_backend
``all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt``): ``max_batch_size`` > 0, ``input_ids [1, L]``
(ragged), scalars ``[1, 1]`` reshaped to ``[1]``. Each request carries one sequence (batch 1) and goes to the
runtime's in-flight batcher: ``initialize`` builds ``runtime.api.LLM(model_path, backend=...).start()`` once
(``AsyncEngine``); ``execute`` validates each request and hands it to ``AsyncEngine.submit``; responses are sent from
the scheduler thread through each request's response sender.

Inputs: ``input_ids``, ``input_lengths``, ``request_output_len`` (required), ``end_id`` (replaces the checkpoint's
EOS; -1: none), ``pad_id`` (unused: one sequence per response), ``temperature``, ``runtime_top_k``,
``runtime_top_p``, ``random_seed``, ``streaming``, ``return_log_probs``, ``exclude_input_in_output`` (default true;
false puts the prompt before the generated ids of a non-streamed response), ``stop_words_list`` /
``bad_words_list`` (TensorRT-LLM's ``[1, 2, N]``: row 0 the words' ids concatenated, row 1 their exclusive end
offsets, -1 padded; a stop word ends the request when the output ends with it, a bad word's last token is never
sampled after the rest of it), ``stop`` (true: cancel the in-flight request with the same request id),
``beam_width`` / ``num_return_sequences`` (1 only), penalties at their neutral values only. K3 extensions:
``num_top_logprobs`` (k: the k most likely tokens per generated token) and ``return_prompt_log_probs``.

Images (a model with a vision tower, VISION.md §8): ``image_bytes`` (BYTES ``[1, S]``: one encoded image file per
element, processed here with the model's processor) or ``pixel_values`` (FP32 ``[1, L, 3, 14, 14]``) + ``grid_thws``
(INT64 ``[1, S, 3]``), the processor's own outputs (§1.5). ``input_ids`` holds each image's block in order with
either ONE ``<|media_pad|>`` per image (expanded here to the image's token count) or the count pre-expanded
(``parse_images`` / ``image_prompt``).

Outputs (batch 1, beam 1): ``output_ids [1, 1, n]``, ``sequence_length [1, 1]``; with ``return_log_probs``
``output_log_probs [1, 1, n]`` and ``cum_log_probs [1, 1]`` (natural log, the model's distribution); with
``num_top_logprobs`` ``top_log_prob_ids`` / ``top_log_probs [1, 1, n, k]``; with ``return_prompt_log_probs``
``prompt_log_probs [1, L]`` (NaN for the first token) and, with ``num_top_logprobs``,
``prompt_top_log_prob_ids`` / ``prompt_top_log_probs [1, L, k]`` (in the first response); ``finish_reason [1, 1]``
("stop" | "length") and ``num_cached_tokens [1, 1]`` (prompt tokens served from the runtime's prefix cache, 0 when it
is off; docs/PREFIX_CACHING.md) in the last response.

* ``streaming=true``: one response per token; the last token's response carries the FINAL flag (a cancelled
  request ends with an empty FINAL response);
* otherwise one response with all generated tokens + FINAL.

Limits (`check_context`, and in `parse_request`): ``request_output_len`` plus the prompt must fit the runtime's
max_context (an error saying how many fit, never a silent cut); ``end_id``, ``stop_words_list`` and ``bad_words_list`` ids must be below
vocab_size. Health (`_check_engine`, run by the watcher): when the runtime's engine stops serving (its scheduler
thread died), every request in flight gets an error naming why and the stub exits, so that the launcher, which
supervises the stubs, reports the server unhealthy instead of a server that stays "ready" and never answers.

Cancellation: a cancelled request (``sender.is_cancelled()``, seen in the token callback or by a watcher
thread polling active requests, or a ``stop`` request) is cancelled in the engine (``eng.cancel``), which frees its
KDA slot and latent blocks; the FINAL flag is still sent. Bad requests and runtime errors become error responses;
nothing raised here escapes ``execute`` or the callbacks.

Custom metrics (``pb_utils.MetricFamily``, label ``model``): gauges ``k3_kda_slots_in_use``,
``k3_latent_blocks_in_use``, ``k3_max_requests_per_step``, ``k3_active_requests`` and, with prefix caching,
``k3_prefix_cache_hit_rate``, ``k3_prefix_cache_tokens``, ``k3_snapshot_pool_bytes``, ``k3_latent_blocks_cached``;
counters ``k3_tokens_generated``, ``k3_preemptions``, ``k3_steps``, ``k3_prefix_cache_hit_tokens``. Updated by the watcher thread, which the token
callback wakes after every token.

Config parameters (string values): ``project_root`` (prepended to ``sys.path``), ``model_path``,
``backend``, ``max_batch``, ``max_num_tokens``, ``max_context``, ``vocab_size`` (optional),
``enable_prefix_caching`` ("true": ``LLM(enable_prefix_caching=True)``) with ``num_snapshots`` and
``snapshot_interval`` (optional integers, passed to LLM).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
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
    "random_seed": ("iu", int),
    "temperature": ("f", float),
    "runtime_top_p": ("f", float),
    "streaming": ("b", bool),
    "return_log_probs": ("b", bool),
    "exclude_input_in_output": ("b", bool),
    "stop": ("b", bool),
    "beam_width": ("iu", int),
    "num_return_sequences": ("iu", int),
    "min_length": ("iu", int),
    "repetition_penalty": ("f", float),
    "presence_penalty": ("f", float),
    "frequency_penalty": ("f", float),
    "len_penalty": ("f", float),
    "num_top_logprobs": ("iu", int),
    "return_prompt_log_probs": ("b", bool),
}
# Accepted only at these values (no such sampling in the runtime); another value is an error naming the input.
_NEUTRAL = {"beam_width": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "len_penalty": 1.0}


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
                           f"{ {'iu': 'INT32', 'f': 'FP32', 'b': 'BOOL'}[kinds] } with shape [1, 1]")
    if arr.size != 1:
        raise RequestError(f"{name}: expected one value (shape [1, 1]: one sequence per request), got shape "
                           f"{list(arr.shape)}")
    return typ(arr.reshape(-1)[0])


def parse_request(request, vocab_size: Optional[int]) -> dict:
    """Turn a Triton request into ``{"prompt": list[int], "streaming": bool, "params": dict, "stop": bool,
    "return_log_probs": bool, "prompt_log_probs": bool, "top_logprobs": int, "exclude_input": bool}``
    (module docstring).

    Raises:
        RequestError: naming the offending field and how to fix it.
    """
    if _scalar(request, "stop"):
        return {"stop": True}
    ids = _input(request, "input_ids")
    if ids is None:
        raise RequestError("input_ids: missing; send the prompt token ids as INT32 with shape [1, N], N >= 1")
    if ids.dtype.kind not in "iu":
        raise RequestError(f"input_ids: dtype {ids.dtype} not accepted; send INT32 token ids")
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise RequestError(f"input_ids: shape {list(ids.shape)} holds {ids.shape[0]} sequences; send one sequence "
                           "per request ([1, N]): the runtime batches requests in flight")
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
        raise RequestError("request_output_len: missing; send the number of tokens to generate (INT32 [1, 1], >= 1)")
    if max_tokens < 1:
        raise RequestError(f"request_output_len: {max_tokens} must be >= 1")
    for name, neutral in _NEUTRAL.items():
        v = _scalar(request, name)
        if v is not None and v != neutral:
            raise RequestError(f"{name}: {v} is not supported; send {neutral} or omit it")
    if (_scalar(request, "min_length") or 0) > 1:
        raise RequestError("min_length: not supported; omit it (or send 0 / 1)")

    params: dict[str, Any] = {"max_tokens": int(max_tokens)}
    temperature = _scalar(request, "temperature")
    if temperature is not None:
        if not np.isfinite(temperature) or temperature < 0:
            raise RequestError(f"temperature: {temperature} must be a finite number >= 0 (0 = greedy)")
        params["temperature"] = float(temperature)
    top_k, top_p = _scalar(request, "runtime_top_k"), _scalar(request, "runtime_top_p")
    if top_k is not None:
        if top_k < 0:
            raise RequestError(f"runtime_top_k: {top_k} must be >= 0 (0 = no top-k)")
        params["top_k"] = int(top_k)
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"runtime_top_p: {top_p} must be in (0, 1]")
        params["top_p"] = float(top_p)
    seed = _scalar(request, "random_seed")
    if seed is not None:
        params["seed"] = int(seed)
    stops, seqs = [], []
    sw = _input(request, "stop_words_list")
    if sw is not None:
        for w in parse_words(sw, "stop_words_list"):
            (stops if len(w) == 1 else seqs).append(w[0] if len(w) == 1 else tuple(w))
    bw = _input(request, "bad_words_list")
    if bw is not None:
        params["bad_words"] = tuple(tuple(w) for w in parse_words(bw, "bad_words_list"))
    end_id = _scalar(request, "end_id")
    if end_id is not None and (end_id < -1 or (vocab_size is not None and end_id >= vocab_size)):
        raise RequestError(f"end_id: {end_id} outside [0, vocab_size={vocab_size or 'vocab'}) (or -1: no end id)")
    words = stops + [t for w in seqs for t in w] + [t for w in params.get("bad_words", ()) for t in w]
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in words):
        bad = [t for t in words if not 0 <= t < vocab_size][:5]
        raise RequestError(f"stop_words_list / bad_words_list: ids {bad} outside "
                           f"[0, vocab_size={vocab_size}); the model never emits them")
    if end_id is not None:
        params["ignore_eos"] = True           # end_id replaces the checkpoint's EOS (TensorRT-LLM semantics)
        if end_id >= 0:
            stops.append(int(end_id))
    if stops:
        params["stop_token_ids"] = tuple(dict.fromkeys(stops))
    if seqs:
        params["stop_sequences"] = tuple(dict.fromkeys(seqs))
    logprobs = bool(_scalar(request, "return_log_probs") or False)
    k = _scalar(request, "num_top_logprobs") or 0
    prompt_lp = bool(_scalar(request, "return_prompt_log_probs") or False)
    if not 0 <= k <= 20:
        raise RequestError(f"num_top_logprobs: {k} must be in 0..20")
    if logprobs or k:
        params["logprobs"] = int(k)
    if prompt_lp:
        params["prompt_logprobs"] = int(k)
    _scalar(request, "pad_id")  # type-checked, otherwise unused
    exclude = _scalar(request, "exclude_input_in_output")
    return {"prompt": [int(x) for x in ids], "streaming": bool(_scalar(request, "streaming") or False),
            "params": params, "stop": False, "return_log_probs": logprobs or bool(k), "top_logprobs": int(k),
            "prompt_log_probs": prompt_lp, "exclude_input": True if exclude is None else bool(exclude)}


def check_context(parsed: dict, max_context: Optional[int]) -> None:
    """Refuse a request whose prompt + request_output_len exceeds max_context (RequestError naming
    request_output_len and how many tokens fit)."""
    n, want = len(parsed["prompt"]), parsed["params"]["max_tokens"]
    if max_context is not None and n + want > max_context:
        raise RequestError(f"request_output_len: {want} plus the prompt's {n} tokens exceed max_context = "
                           f"{max_context} tokens per request; send at most {max(0, max_context - n)}"
                           + ("" if n < max_context else " (shorten the prompt)"))



def parse_words(words, name: str) -> list[list[int]]:
    """TensorRT-LLM's words list [2, N] / [1, 2, N] (ids row, end-offsets row padded with -1) -> token sequences.
    Raises RequestError naming `name` for another shape or dtype, or bad offsets."""
    if words.dtype.kind not in "iu":
        raise RequestError(f"{name}: dtype {words.dtype} not accepted; send INT32 [1, 2, N] (ids, end offsets)")
    a = np.asarray(words).astype(np.int64)
    if a.ndim == 3 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or a.shape[0] != 2:
        raise RequestError(f"{name}: shape {list(words.shape)}; send TensorRT-LLM's [1, 2, N] list: row 0 the word "
                           "ids, row 1 the end offsets (-1 padded)")
    ids, offs = a[0], [int(o) for o in a[1] if o >= 0]
    out, start = [], 0
    for end in offs:
        if not start < end <= len(ids):
            raise RequestError(f"{name}: offsets {offs} must increase within 1..{len(ids)}")
        out.append([int(t) for t in ids[start:end]])
        start = end
    return out


def parse_images(request, llm) -> list:
    """The request's images as runtime.vision.ProcessedImage, in prompt order (module docstring): ``image_bytes``
    decoded and processed with ``llm.processor``, or ``pixel_values`` [1, L, 3, p, p] FP32 split by ``grid_thws``
    [1, S, 3] (L = sum of t*h*w). [] without image inputs.

    Raises:
        RequestError: naming the input (both forms given, one tensor of the pair missing, shapes that disagree, a
            model without a vision tower); runtime.vision.ImageError naming ``image_bytes[k]`` for a bad file.
    """
    raw, pv, grid = (_input(request, n) for n in ("image_bytes", "pixel_values", "grid_thws"))
    if raw is None and pv is None and grid is None:
        return []
    if llm.cfg.vision is None:
        raise RequestError("image_bytes: this model has no vision tower (its config.json has no vision_config); "
                           "send text only")
    if raw is not None and (pv is not None or grid is not None):
        raise RequestError("image_bytes: send the images either as image_bytes or as pixel_values + grid_thws, "
                           "not both")
    from k3deploy.runtime.vision import ProcessedImage, process_image
    if raw is not None:
        proc = llm.processor
        return [process_image(bytes(b), proc, f"image_bytes[{k}]") for k, b in enumerate(raw.reshape(-1))]
    if pv is None or grid is None:
        raise RequestError(f"{'grid_thws' if grid is None else 'pixel_values'}: missing; processed images need "
                           "pixel_values [1, L, 3, p, p] (FP32) and grid_thws [1, S, 3] (INT64) together")
    import torch
    p = llm.cfg.vision.patch_size
    pv = pv[0] if pv.ndim == 5 and pv.shape[0] == 1 else pv
    grid = grid[0] if grid.ndim == 3 and grid.shape[0] == 1 else grid
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.dtype.kind not in "iu" or (grid < 1).any():
        raise RequestError(f"grid_thws: shape {list(grid.shape)} dtype {grid.dtype}; send INT64 [1, S, 3] rows "
                           "(t, h, w) >= 1, one per image")
    sizes = [int(t) * int(h) * int(w) for t, h, w in grid]
    if pv.ndim != 4 or tuple(pv.shape[1:]) != (3, p, p) or pv.shape[0] != sum(sizes):
        raise RequestError(f"pixel_values: shape {list(pv.shape)}; grid_thws needs [1, {sum(sizes)}, 3, {p}, {p}] "
                           "(the patches of every image, end to end)")
    out, start = [], 0
    for (t, h, w), n in zip(grid, sizes):
        px = torch.from_numpy(np.ascontiguousarray(pv[start:start + n], dtype=np.float32))
        out.append(ProcessedImage(px, (int(t), int(h), int(w)), int(w) * p, int(h) * p))
        start += n
    return out


def image_prompt(prompt: list[int], images: list, pad_id: int) -> list[int]:
    """``input_ids`` for ``images``: one ``<|media_pad|>`` (``pad_id``) per image, expanded to each image's
    ``num_tokens`` (runtime.vision.expand_placeholders), or already sum(num_tokens) of them (kept as is).
    Raises RequestError naming input_ids otherwise."""
    n, need = sum(1 for t in prompt if t == pad_id), sum(im.num_tokens for im in images)
    if n == need:
        return prompt
    if n == len(images):
        from k3deploy.runtime.vision import expand_placeholders
        return expand_placeholders(prompt, images, pad_id)
    raise RequestError(f"input_ids: {n} <|media_pad|> (id {pad_id}) for {len(images)} image(s) of "
                       f"{[im.num_tokens for im in images]} tokens; put one <|media_pad|> per image in its block "
                       f"(expanded here) or {need} pre-expanded")


def _error_response(msg: str, code=None):
    if code is None:
        code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    err = pb_utils.TritonError(msg) if code is None else pb_utils.TritonError(msg, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


def _tokens_response(st: "_Stream", tokens: list[int], first: int, final_reason: Optional[str] = None,
                     prompt: bool = False):
    """Response with `tokens` (output tokens first..first+len) of `st` in TensorRT-LLM's shapes (module docstring)."""
    ids = (st.prompt if prompt and not st.streaming and not st.exclude_input else []) + tokens
    out = [pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, 1, -1)),
           pb_utils.Tensor("sequence_length", np.asarray([[len(ids)]], dtype=np.int32))]
    req = st.req
    if st.return_log_probs and req is not None and req.logprobs is not None:
        lps = req.logprobs[first:first + len(tokens)]
        out += [pb_utils.Tensor("output_log_probs", np.asarray(lps, dtype=np.float32).reshape(1, 1, -1)),
                pb_utils.Tensor("cum_log_probs", np.asarray([[sum(req.logprobs[:first + len(tokens)])]],
                                                            dtype=np.float32))]
        if st.top_logprobs:
            tops = req.top_logprobs[first:first + len(tokens)]
            out += _top_tensors("top_log_prob", tops, st.top_logprobs, (1, 1, len(tokens), st.top_logprobs))
    if prompt and st.prompt_log_probs and req is not None and req.prompt_logprobs is not None:
        lp = [np.nan if v is None else v for v in req.prompt_logprobs]
        out.append(pb_utils.Tensor("prompt_log_probs", np.asarray(lp, dtype=np.float32).reshape(1, -1)))
        if st.top_logprobs:
            out += _top_tensors("prompt_top_log_prob", req.prompt_top_logprobs, st.top_logprobs,
                                (1, len(lp), st.top_logprobs))
    if final_reason is not None:
        out.append(pb_utils.Tensor("finish_reason", np.asarray([[final_reason.encode()]], dtype=np.object_)))
        out.append(pb_utils.Tensor("num_cached_tokens", np.asarray([[getattr(req, "num_cached_tokens", 0) or 0]],
                                                                   dtype=np.int32)))
    return pb_utils.InferenceResponse(output_tensors=out)


def _top_tensors(prefix: str, tops, k: int, shape) -> list:
    """`{prefix}_ids` / `{prefix}s` tensors of shape `shape` from [(id, logprob)] lists (None rows: -1 / NaN)."""
    ids = np.full((len(tops), k), -1, dtype=np.int32)
    vals = np.full((len(tops), k), np.nan, dtype=np.float32)
    for i, row in enumerate(tops):
        for j, (t, v) in enumerate(row or ()):
            ids[i, j], vals[i, j] = t, v
    return [pb_utils.Tensor(f"{prefix}_ids", ids.reshape(shape)), pb_utils.Tensor(f"{prefix}s", vals.reshape(shape))]


class _Stream:
    """One in-flight request: its sender, collected tokens and cancellation state."""

    def __init__(self, rid: str, sender, parsed: dict, triton_id: str = ""):
        self.rid = rid
        self.triton_id = triton_id  # the client's request id (a `stop` request names it)
        self.sender = sender
        self.streaming = parsed["streaming"]
        self.prompt = parsed["prompt"]
        self.exclude_input = parsed["exclude_input"]
        self.return_log_probs = parsed["return_log_probs"]
        self.top_logprobs = parsed["top_logprobs"]
        self.prompt_log_probs = parsed["prompt_log_probs"]
        self.req = None  # the scheduler's Request (logprobs), set before its first callback
        self.tokens: list[int] = []
        self.cancelled = False  # client cancelled; engine cancel requested
        self.cancel_sent = False
        self.done = False
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
        for key in ("max_batch", "max_num_tokens", "max_context", "num_snapshots", "snapshot_interval"):
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
        self.max_context = getattr(getattr(self.llm, "cache", None), "max_context", None)

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
                              ("latent_blocks_in_use",
                               "MLA latent-cache blocks not free (held by requests or the prefix cache)"),
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
                self._check_engine()
            except Exception as e:  # noqa: BLE001 - the watcher must survive anything
                if repr(e) != last_error:  # log each distinct failure once, not every interval
                    last_error = repr(e)
                    _log("error", f"k3: watcher error: {e!r}")

    def _check_engine(self) -> None:
        """The engine no longer serving is fatal for this stub (module docstring): error every request in flight,
        log why, end the process (the launcher sees the stub die and fails the server's readiness)."""
        health = getattr(self.engine, "health", None)
        reason = health() if health is not None and not self._stop.is_set() else None
        if reason is None:
            return
        _log("error", f"k3: the runtime engine stopped serving ({reason}); failing every request in flight and "
                      "ending this stub so that the launcher reports the server unhealthy")
        with self._streams_lock:
            streams = list(self._streams.values())
        for st in streams:
            self._finish(st, f"the runtime engine stopped serving: {reason}")
        sys.stderr.flush()
        os._exit(3)

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
    def _finish(self, st: _Stream, error: Optional[str], token: Optional[int] = None) -> None:
        """Send the FINAL response (with the last token when streaming) and forget the stream."""
        with st.lock:
            if st.done:
                return
            st.done = True
        with self._streams_lock:
            self._streams.pop(st.rid, None)
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        reason = getattr(st.req, "finish_reason", None)
        try:
            if error is not None:
                st.sender.send(_error_response(f"k3: generation failed: {error}",
                                               getattr(pb_utils.TritonError, "INTERNAL", None)), flags=final)
            elif st.cancelled or reason == "cancelled":
                st.sender.send(flags=final)
            elif st.streaming:
                if token is None:
                    st.sender.send(flags=final)
                else:
                    st.sender.send(_tokens_response(st, [token], len(st.tokens) - 1, reason,
                                                    prompt=len(st.tokens) == 1), flags=final)
            else:
                st.sender.send(_tokens_response(st, st.tokens, 0, reason, prompt=True), flags=final)
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
                    if st.streaming and not finished:
                        st.sender.send(_tokens_response(st, [int(token)], len(st.tokens) - 1,
                                                        prompt=len(st.tokens) == 1))
            if finished:
                self._finish(st, error, None if token is None or st.cancelled else int(token))
            else:
                self._wake.set()
        except Exception as e:  # noqa: BLE001
            _log("error", f"k3: callback for {st.rid} failed: {e!r}")
            st.cancelled = True
            self._wake.set()
            if finished:
                self._finish(st, None)

    def _stop_by_id(self, triton_id: str) -> int:
        """A `stop` request: cancel the in-flight requests sent with this request id. Returns how many."""
        with self._streams_lock:
            hits = [st for st in self._streams.values() if triton_id and st.triton_id == triton_id]
        for st in hits:
            st.cancelled = True
            self._cancel(st)
        return len(hits)

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
                if parsed["stop"]:
                    n = self._stop_by_id(request.request_id())
                    _log("info", f"k3: stop request {request.request_id()!r} cancelled {n} request(s)")
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                params = self._SamplingParams(**parsed["params"])
                images = parse_images(request, self.llm)
                if images:
                    parsed["prompt"] = image_prompt(parsed["prompt"], images,
                                                    self.llm.cfg.vision.media_placeholder_token_id)
                check_context(parsed, self.max_context)      # on the prompt as the model sees it (images expanded)
            except (RequestError, ValueError, TypeError) as e:
                self._send_error(sender, str(e))
                continue
            except Exception as e:  # noqa: BLE001
                self._send_error(sender, f"k3: cannot read request: {e!r}")
                continue
            rid = f"{request.request_id() or 'req'}#{next(self._ids)}"
            st = _Stream(rid, sender, parsed, request.request_id() or "")
            with self._streams_lock:
                self._streams[rid] = st
            try:
                with self.engine._turn():            # st.req is set before the scheduler can call back
                    st.req = self.engine.submit(rid, parsed["prompt"], params,
                                                lambda tok, fin, err, st=st: self._on_token(st, tok, fin, err),
                                                images=images or None)
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
