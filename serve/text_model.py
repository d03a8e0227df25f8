"""Triton Python-backend text model ``k3_text`` (copied to ``REPO/k3_text/1/model.py`` by :mod:`serve.repository`).

Text in, text out, with the tensor names of TensorRT-LLM's ``ensemble`` / ``tensorrt_llm_bls`` models, so clients
written for them work unchanged: ``text_input`` (the prompt, encoded as ordinary text: no chat template, no BOS,
special-token names stay text), ``max_tokens``, ``stream``, ``stop_words`` / ``bad_words`` (strings, each encoded to
token ids), ``end_id``, ``pad_id``, ``top_k``, ``top_p``, ``temperature``, ``random_seed``, ``return_log_probs``,
``exclude_input_in_output`` (default true; false puts the prompt before a non-streamed ``text_output``),
``beam_width`` / ``num_return_sequences`` (1) and the penalties at their neutral values. Outputs ``text_output
[1, 1]`` (special tokens left out; streamed: the text of each new token, UTF-8 split across tokens held until
complete), with ``return_log_probs`` ``output_log_probs [1, 1, n]`` and ``cum_log_probs [1, 1]``.

Images (a model with a vision tower): ``image_bytes_input`` (BYTES ``[1, S]``, one encoded image file per element)
with one ``<|kimi_image_placeholder|>`` marker per image in ``text_input``; the n-th marker becomes the n-th
image's block (VISION.md §8.1: ``<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>``, the
original size read from the file's header) and the files go to the token model's ``image_bytes``, which processes
them and expands each ``<|media_pad|>`` to the image's token count.

Each request becomes one streamed BLS request to the token model (parameter ``token_model``, ``k3``). A client that
cancels gets its token-model request stopped with TensorRT-LLM's ``stop`` input (same request id), which frees its
slot and blocks. Config parameters: ``project_root``, ``tokenizer`` (tiktoken.model path), ``token_model``.
"""

from __future__ import annotations

import codecs
import itertools
import json
import sys
import threading
import typing
import uuid
from typing import Optional

import numpy as np
import triton_python_backend_utils as pb_utils

_NEUTRAL = {"beam_width": 1, "num_return_sequences": 1, "length_penalty": 1.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0}
_PASS = (("end_id", "end_id", np.int32), ("pad_id", "pad_id", np.int32), ("top_k", "runtime_top_k", np.int32),
         ("top_p", "runtime_top_p", np.float32), ("temperature", "temperature", np.float32),
         ("random_seed", "random_seed", np.uint64))


class RequestError(ValueError):
    """A request field is missing or invalid; the message names the field."""


def _input(request, name: str) -> Optional[np.ndarray]:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _one(request, name: str):
    a = _input(request, name)
    if a is None:
        return None
    if a.size != 1:
        raise RequestError(f"{name}: expected one value (shape [1, 1]: one text per request), got {list(a.shape)}")
    v = a.reshape(-1)[0]
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v


def _words(request, name: str, tok) -> list[list[int]]:
    """A STRING [1, N] list of words (or one comma-separated string, TensorRT-LLM's preprocessing) -> ids."""
    a = _input(request, name)
    if a is None:
        return []
    words = []
    for v in a.reshape(-1):
        s = v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
        words += [w for w in s.split(",") if w] if a.size == 1 else ([s] if s else [])
    return [ids for ids in (tok.encode(w) for w in words) if ids]


def _words_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's [1, 2, N] words list: concatenated ids, end offsets padded with -1."""
    flat = [t for w in words for t in w]
    offs = list(itertools.accumulate(len(w) for w in words))
    return np.array([[flat, offs + [-1] * (len(flat) - len(offs))]], dtype=np.int32)


def image_text_segments(text: str, images: list[bytes]) -> list[tuple[str, bool]]:
    """``text`` with its n-th ``<|kimi_image_placeholder|>`` replaced by the n-th image's block with one
    ``<|media_pad|>`` (runtime.chat.text_image_segments; the original size from the file's header), as tokenizer
    segments: the text stays ordinary text. Raises RequestError naming text_input (marker count) or
    image_bytes_input[k] (not an image)."""
    import io
    from PIL import Image, UnidentifiedImageError
    from k3deploy.runtime.chat import text_image_segments
    heads = []
    for k, data in enumerate(images):
        try:
            with Image.open(io.BytesIO(data)) as im:
                heads.append(_Head(*im.size))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise RequestError(f"image_bytes_input[{k}]: not a decodable image ({len(data)} bytes: {e}); send a "
                               "PNG, JPEG, WebP, GIF or BMP file") from None
    try:
        return text_image_segments(text, heads, "text_input")
    except ValueError as e:
        raise RequestError(str(e)) from None


class _Head(typing.NamedTuple):
    """An image as its prompt block needs it here: the original size, one <|media_pad|> (k3 expands it)."""
    width: int
    height: int
    num_tokens: int = 1


class TritonPythonModel:
    """Decoupled text model over the token model ``k3`` (module docstring)."""

    def initialize(self, args: dict) -> None:
        cfg = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
        root = params.get("project_root")
        if root and root not in sys.path:
            sys.path.insert(0, root)
        from k3deploy.runtime.tokenizer import Tokenizer
        if not params.get("tokenizer"):
            raise pb_utils.TritonModelException("k3_text: parameter 'tokenizer' (tiktoken.model) missing; "
                                                "regenerate the repository with `k3deploy repository`")
        self.tok = Tokenizer.from_file(params["tokenizer"])
        self.token_model = params.get("token_model") or "k3"
        self._ids = itertools.count()

    def _parse(self, request) -> dict:
        text = _one(request, "text_input")
        if text is None:
            raise RequestError("text_input: missing; send the prompt as a STRING tensor of shape [1, 1]")
        max_tokens = _one(request, "max_tokens")
        if max_tokens is None or int(max_tokens) < 1:
            raise RequestError(f"max_tokens: {max_tokens!r}; send the number of tokens to generate (INT32 [1, 1], >= 1)")
        for name, neutral in _NEUTRAL.items():
            v = _one(request, name)
            if v is not None and v != neutral:
                raise RequestError(f"{name}: {v} is not supported; send {neutral} or omit it")
        if (_one(request, "min_length") or 0) > 1:
            raise RequestError("min_length: not supported; omit it (or send 0 / 1)")
        images = _input(request, "image_bytes_input")
        images = [] if images is None else [bytes(b) for b in images.reshape(-1)]
        ids = self.tok.encode_segments(image_text_segments(text, images)) if images else self.tok.encode(text)
        if not ids:
            raise RequestError("text_input: empty prompt; send some text")
        inputs = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
                  "request_output_len": np.array([[int(max_tokens)]], np.int32),
                  "streaming": np.array([[True]], np.bool_)}
        if images:
            inputs["image_bytes"] = np.array([images], np.object_)
        for name, target, dtype in _PASS:
            v = _one(request, name)
            if v is not None:
                inputs[target] = np.array([[v]], dtype)
        for name, target in (("stop_words", "stop_words_list"), ("bad_words", "bad_words_list")):
            words = _words(request, name, self.tok)
            if words:
                inputs[target] = _words_list(words)
        logprobs = bool(_one(request, "return_log_probs") or False)
        if logprobs:
            inputs["return_log_probs"] = np.array([[True]], np.bool_)
        exclude = _one(request, "exclude_input_in_output")
        return {"inputs": inputs, "stream": bool(_one(request, "stream") or False), "logprobs": logprobs,
                "prefix": "" if exclude is None or exclude else text}

    def execute(self, requests):
        for request in requests:
            try:
                sender = request.get_response_sender()
            except Exception:  # noqa: BLE001
                continue
            try:
                parsed = self._parse(request)
            except (RequestError, ValueError, TypeError) as e:
                self._send_error(sender, str(e))
                continue
            rid = f"{request.request_id() or 'text'}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            threading.Thread(target=self._serve, args=(sender, parsed, rid), daemon=True).start()
        return None

    def _request(self, tensors: dict, rid: str):
        return pb_utils.InferenceRequest(
            model_name=self.token_model, request_id=rid,
            inputs=[pb_utils.Tensor(k, v) for k, v in tensors.items()],
            requested_output_names=["output_ids", "output_log_probs", "finish_reason"])

    def _serve(self, sender, parsed: dict, rid: str) -> None:
        """One request: stream the token model's responses back as text (runs on its own thread)."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        text, lps, stopped = [], [], False
        try:
            for resp in self._request(parsed["inputs"], rid).exec(decoupled=True):
                if resp.has_error():
                    self._send_error(sender, resp.error().message())
                    return
                if not stopped and sender.is_cancelled():
                    stopped = True                                    # free the token model's slot now
                    self._request({"stop": np.array([[True]], np.bool_),
                                   "request_output_len": np.array([[1]], np.int32)}, rid).exec(decoupled=True)
                ids = pb_utils.get_output_tensor_by_name(resp, "output_ids")
                if ids is None or stopped:
                    continue
                ids = [int(t) for t in ids.as_numpy().reshape(-1)]
                lp = pb_utils.get_output_tensor_by_name(resp, "output_log_probs")
                lps += [] if lp is None else [float(v) for v in lp.as_numpy().reshape(-1)]
                piece = dec.decode(self.tok.decode_bytes(ids, skip_special=True))
                text.append(piece)
                if parsed["stream"]:
                    sender.send(self._response(piece, lps[-len(ids):] if lp is not None else [], lps,
                                               parsed["logprobs"]))
            tail = dec.decode(b"", final=True)
            if stopped:
                sender.send(flags=final)
            elif parsed["stream"]:
                sender.send(self._response(tail, [], lps, parsed["logprobs"]) if tail else None, flags=final)
            else:
                sender.send(self._response(parsed["prefix"] + "".join(text) + tail, lps, lps, parsed["logprobs"]),
                            flags=final)
        except Exception as e:  # noqa: BLE001 - never leave the client without a final response
            self._send_error(sender, f"k3_text: {e!r}")

    @staticmethod
    def _response(text: str, lps, all_lps, logprobs: bool):
        out = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))]
        if logprobs:
            out += [pb_utils.Tensor("output_log_probs", np.asarray(lps or [], np.float32).reshape(1, 1, -1)),
                    pb_utils.Tensor("cum_log_probs", np.asarray([[sum(all_lps)]], np.float32))]
        return pb_utils.InferenceResponse(output_tensors=out)

    @staticmethod
    def _send_error(sender, msg: str) -> None:
        try:
            code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
            err = pb_utils.TritonError(msg) if code is None else pb_utils.TritonError(msg, code)
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001 - client gone
            pass

    def finalize(self) -> None:
        pass
