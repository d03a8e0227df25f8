"""Write a Triton model repository serving a k3deploy model through the Python backend.

::

    python -m k3deploy.serve.repository --engines DIR --out REPO [--backend torch|onnxruntime|tensorrt]

writes::

    REPO/k3/config.pbtxt        decoupled Python-backend model, TensorRT-LLM's tensorrt_llm contract (token ids)
    REPO/k3/1/model.py          copy of serve/model.py (drives runtime.api through AsyncEngine)
    REPO/k3_text/config.pbtxt   text model with TensorRT-LLM's ensemble names (when DIR holds tiktoken.model)
    REPO/k3_text/1/model.py     copy of serve/text_model.py (tokenizes, calls k3, detokenizes)

``DIR`` is what ``runtime.api.LLM(path, backend=...)`` loads (a checkpoint for ``torch``, an engine directory
for ``onnxruntime``/``tensorrt``). The backend comes from ``DIR/manifest.json`` key ``"backend"`` when present,
else ``--backend``, else ``torch``. The config carries parameters ``project_root`` (prepended to ``sys.path``
in the stub so ``import runtime`` works), ``model_path``, ``backend``, ``max_batch``, ``max_num_tokens``,
``max_context``, when given ``device`` / ``ops`` / ``cuda_graphs`` (torch backend on a GPU: ``--device cuda
--ops kernels --cuda-graphs``), ``enable_prefix_caching`` (``--enable-prefix-caching``: the runtime reuses cached
prefixes, docs/PREFIX_CACHING.md; ``k3deploy build --enable-prefix-caching`` writes it too) with ``num_snapshots`` /
``snapshot_interval`` (``--num-snapshots`` / ``--snapshot-interval``; omitted: the runtime's defaults) and, when
``DIR/config.json`` names it, ``vocab_size`` (used to reject out-of-range ids early).

Every written ``config.pbtxt`` is parsed back with the ModelConfig protobuf shipped in ``tritonclient``
(:func:`validate_config`).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shutil
import sys
from typing import Any, Mapping, Optional, Sequence

LOGGER = logging.getLogger(__name__)

BACKENDS = ("torch", "onnxruntime", "tensorrt")
DEFAULT_MODEL_NAME = "k3"
PROJECT_ROOT = pathlib.Path(__file__).resolve().parent.parent  # holds k3deploy/ (a checkout or site-packages)
MODEL_PY = pathlib.Path(__file__).resolve().parent / "model.py"

# (name, Triton data type, dims, optional, kind): kind "scalar" = dims [1] reshaped to [] (TensorRT-LLM's scalars),
# "ragged" = allow_ragged_batch. The contract of tensorrtllm_backend's tensorrt_llm/config.pbtxt, plus the K3
# extensions num_top_logprobs / return_prompt_log_probs and the image inputs (serve/model.py).
INPUTS: tuple[tuple[str, str, tuple[int, ...], bool, str], ...] = (
    ("input_ids", "TYPE_INT32", (-1,), True, "ragged"),           # optional: a `stop` request carries none
    ("input_lengths", "TYPE_INT32", (1,), True, "scalar"),
    ("request_output_len", "TYPE_INT32", (1,), False, "scalar"),
    ("end_id", "TYPE_INT32", (1,), True, "scalar"),
    ("pad_id", "TYPE_INT32", (1,), True, "scalar"),
    ("stop_words_list", "TYPE_INT32", (2, -1), True, "ragged"),
    ("bad_words_list", "TYPE_INT32", (2, -1), True, "ragged"),
    ("beam_width", "TYPE_INT32", (1,), True, "scalar"),
    ("num_return_sequences", "TYPE_INT32", (1,), True, "scalar"),
    ("temperature", "TYPE_FP32", (1,), True, "scalar"),
    ("runtime_top_k", "TYPE_INT32", (1,), True, "scalar"),
    ("runtime_top_p", "TYPE_FP32", (1,), True, "scalar"),
    ("len_penalty", "TYPE_FP32", (1,), True, "scalar"),
    ("repetition_penalty", "TYPE_FP32", (1,), True, "scalar"),
    ("min_length", "TYPE_INT32", (1,), True, "scalar"),
    ("presence_penalty", "TYPE_FP32", (1,), True, "scalar"),
    ("frequency_penalty", "TYPE_FP32", (1,), True, "scalar"),
    ("random_seed", "TYPE_UINT64", (1,), True, "scalar"),
    ("return_log_probs", "TYPE_BOOL", (1,), True, "scalar"),
    ("exclude_input_in_output", "TYPE_BOOL", (1,), True, "scalar"),
    ("stop", "TYPE_BOOL", (1,), True, "scalar"),
    ("streaming", "TYPE_BOOL", (1,), True, "scalar"),
    ("num_top_logprobs", "TYPE_INT32", (1,), True, "scalar"),
    ("return_prompt_log_probs", "TYPE_BOOL", (1,), True, "scalar"),
    # images (models with a vision tower; serve/model.py): encoded files, one element each, or processed tensors
    ("image_bytes", "TYPE_STRING", (-1,), True, "ragged"),
    ("pixel_values", "TYPE_FP32", (-1, 3, -1, -1), True, "ragged"),
    ("grid_thws", "TYPE_INT64", (-1, 3), True, "ragged"),
)
OUTPUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("output_ids", "TYPE_INT32", (-1, -1)),
    ("sequence_length", "TYPE_INT32", (-1,)),
    ("cum_log_probs", "TYPE_FP32", (-1,)),
    ("output_log_probs", "TYPE_FP32", (-1, -1)),
    ("top_log_prob_ids", "TYPE_INT32", (-1, -1, -1)),
    ("top_log_probs", "TYPE_FP32", (-1, -1, -1)),
    ("prompt_log_probs", "TYPE_FP32", (-1,)),
    ("prompt_top_log_prob_ids", "TYPE_INT32", (-1, -1)),
    ("prompt_top_log_probs", "TYPE_FP32", (-1, -1)),
    ("finish_reason", "TYPE_STRING", (1,)),
    ("num_cached_tokens", "TYPE_INT32", (1,)),  # with the final response: prompt tokens served from the prefix cache
)

# The text model: TensorRT-LLM's ensemble / tensorrt_llm_bls names (serve/text_model.py).
TEXT_MODEL_NAME = "k3_text"
TEXT_MODEL_PY = pathlib.Path(__file__).resolve().parent / "text_model.py"
TEXT_INPUTS: tuple[tuple[str, str, tuple[int, ...], bool, str], ...] = (
    ("text_input", "TYPE_STRING", (1,), False, ""),
    ("max_tokens", "TYPE_INT32", (1,), False, ""),
    ("bad_words", "TYPE_STRING", (-1,), True, ""),
    ("stop_words", "TYPE_STRING", (-1,), True, ""),
    ("exclude_input_in_output", "TYPE_BOOL", (1,), True, ""),
    ("end_id", "TYPE_INT32", (1,), True, ""),
    ("pad_id", "TYPE_INT32", (1,), True, ""),
    ("top_k", "TYPE_INT32", (1,), True, ""),
    ("top_p", "TYPE_FP32", (1,), True, ""),
    ("temperature", "TYPE_FP32", (1,), True, ""),
    ("length_penalty", "TYPE_FP32", (1,), True, ""),
    ("repetition_penalty", "TYPE_FP32", (1,), True, ""),
    ("min_length", "TYPE_INT32", (1,), True, ""),
    ("presence_penalty", "TYPE_FP32", (1,), True, ""),
    ("frequency_penalty", "TYPE_FP32", (1,), True, ""),
    ("random_seed", "TYPE_UINT64", (1,), True, ""),
    ("return_log_probs", "TYPE_BOOL", (1,), True, ""),
    ("beam_width", "TYPE_INT32", (1,), True, ""),
    ("num_return_sequences", "TYPE_INT32", (1,), True, ""),
    ("stream", "TYPE_BOOL", (1,), True, ""),
    ("image_bytes_input", "TYPE_STRING", (-1,), True, ""),      # encoded image files, one per marker in text_input
)
TEXT_OUTPUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("text_output", "TYPE_STRING", (-1,)),
    ("cum_log_probs", "TYPE_FP32", (-1,)),
    ("output_log_probs", "TYPE_FP32", (-1, -1)),
)


class RepositoryError(ValueError):
    """Bad arguments for, or an invalid result of, writing a model repository."""


def resolve_backend(engines: pathlib.Path, flag: Optional[str] = None) -> str:
    """Backend for ``engines``: ``manifest.json["backend"]`` if present, else ``flag``, else ``"torch"``."""
    backend, source = None, None
    manifest = engines / "manifest.json"
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RepositoryError(f"{manifest} is not readable JSON ({e}); fix or delete it") from e
        if isinstance(data, dict) and data.get("backend"):
            backend, source = data["backend"], f"{manifest} key 'backend'"
            if flag and flag != backend:
                LOGGER.warning("--backend %s ignored: %s says %r", flag, manifest, backend)
    if backend is None:
        backend, source = (flag, "--backend") if flag else ("torch", "default")
    if backend not in BACKENDS:
        raise RepositoryError(f"backend {backend!r} (from {source}) is not one of {', '.join(BACKENDS)}")
    return backend


def discover_vocab_size(engines: pathlib.Path) -> Optional[int]:
    """``vocab_size`` from ``engines/manifest.json`` or ``engines/config.json`` (top level or ``text_config``)."""
    for name in ("manifest.json", "config.json"):
        path = engines / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict):
            continue
        for d in (data, data.get("text_config"), data.get("config")):
            if isinstance(d, dict) and isinstance(d.get("vocab_size"), int) and d["vocab_size"] > 0:
                return d["vocab_size"]
    return None


def _dims(d: Sequence[int]) -> str:
    return "[ " + ", ".join(str(x) for x in d) + " ]"


def _render(name: str, inputs, outputs, parameters: Mapping[str, Any], instance_count: int, max_batch_size: int,
            comment: str) -> str:
    lines = [
        f'name: "{name}"',
        'backend: "python"',
        f"max_batch_size: {int(max_batch_size)}  # {comment}",
        "model_transaction_policy { decoupled: true }",
        "input [",
    ]
    ins = []
    for n, t, d, opt, kind in inputs:
        extra = (" optional: true" if opt else "") + (" allow_ragged_batch: true" if kind == "ragged" else "") + (
            " reshape: { shape: [ ] }" if kind == "scalar" else "")
        ins.append(f'  {{ name: "{n}" data_type: {t} dims: {_dims(d)}{extra} }}')
    lines.append(",\n".join(ins))
    lines += ["]", "output ["]
    lines.append(",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {_dims(d)} }}' for n, t, d in outputs))
    lines += ["]", f"instance_group [ {{ count: {int(instance_count)} kind: KIND_CPU }} ]"]
    for key, value in parameters.items():
        if value is None:
            continue
        lines.append(f"parameters: {{ key: {json.dumps(str(key))} value: {{ string_value: {json.dumps(str(value))} }} }}")
    return "\n".join(lines) + "\n"


def render_config(name: str, parameters: Mapping[str, Any], instance_count: int = 1, max_batch_size: int = 1) -> str:
    """Text of ``config.pbtxt`` for the decoupled Python-backend model ``name`` (TensorRT-LLM's tensorrt_llm
    contract: ``max_batch_size`` > 0; each request is one sequence, batched in flight inside runtime/)."""
    return _render(name, INPUTS, OUTPUTS, parameters, instance_count, max_batch_size,
                   "one sequence per request; requests are batched in flight by runtime/ (AsyncEngine)")


def render_text_config(name: str, parameters: Mapping[str, Any], instance_count: int = 1,
                       max_batch_size: int = 1) -> str:
    """Text of ``config.pbtxt`` for the text model (TensorRT-LLM's ensemble names; serve/text_model.py)."""
    return _render(name, TEXT_INPUTS, TEXT_OUTPUTS, parameters, instance_count, max_batch_size,
                   "one text per request, passed on to the token model")


def _model_config_proto():
    """(google.protobuf.text_format, tritonclient's model_config_pb2). RepositoryError naming the extra to install
    when tritonclient is missing (it comes with k3deploy[serve])."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise RepositoryError(f"checking config.pbtxt needs tritonclient's ModelConfig protobuf ({e}); install the "
                              "serving extra: pip install -e '.[serve]' in the checkout") from e
    return text_format, model_config_pb2


def validate_config(text: str, expect_name: Optional[str] = None, *, where: str = "config.pbtxt",
                    text_model: bool = False):
    """Parse ``text`` with tritonclient's ``ModelConfig`` protobuf and check what ``k3`` (or, with ``text_model``,
    the text model) relies on.

    Returns the parsed ``ModelConfig``.

    Raises:
        RepositoryError: the text does not parse, or the model is not a decoupled Python-backend model with
            max_batch_size > 0 and the required inputs/outputs.
    """
    text_format, model_config_pb2 = _model_config_proto()
    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as e:
        raise RepositoryError(f"{where} does not parse as a Triton ModelConfig: {e}") from e
    problems = []
    if expect_name is not None and cfg.name != expect_name:
        problems.append(f"name is {cfg.name!r}, must equal the model directory name {expect_name!r}")
    if cfg.backend != "python":
        problems.append(f"backend is {cfg.backend!r}, must be \"python\"")
    if not cfg.model_transaction_policy.decoupled:
        problems.append("model_transaction_policy.decoupled must be true (streaming sends many responses)")
    if cfg.max_batch_size < 1:
        problems.append(f"max_batch_size is {cfg.max_batch_size}, must be > 0 (TensorRT-LLM clients send a batch "
                        "dimension)")
    inputs = {i.name: i for i in cfg.input}
    want_in, want_out = (TEXT_INPUTS, TEXT_OUTPUTS) if text_model else (INPUTS, OUTPUTS)
    for name, _, _, optional, _ in want_in:
        if name not in inputs and (not optional or name == "input_ids"):
            problems.append(f"input {name!r} is missing")
        elif name in inputs and not optional and inputs[name].optional:
            problems.append(f"input {name!r} must not be optional")
    outputs = {o.name for o in cfg.output}
    for name, _, _ in want_out:
        if name not in outputs:
            problems.append(f"output {name!r} is missing")
    if problems:
        raise RepositoryError(f"{where}: " + "; ".join(problems))
    return cfg


def write_repository(engines: str | pathlib.Path, out: str | pathlib.Path, backend: Optional[str] = None, *,
                     name: str = DEFAULT_MODEL_NAME, max_batch: Optional[int] = None,
                     max_num_tokens: Optional[int] = None,
                     max_context: Optional[int] = None, instance_count: int = 1,
                     project_root: str | pathlib.Path = PROJECT_ROOT, overwrite: bool = False,
                     device: Optional[str] = None, ops: Optional[str] = None,
                     cuda_graphs: bool = False, dense_dtype: Optional[str] = None,
                     enable_prefix_caching: bool = False, num_snapshots: Optional[int] = None,
                     snapshot_interval: Optional[int] = None) -> pathlib.Path:
    """Write ``out/<name>/config.pbtxt`` and ``out/<name>/1/model.py``; return the config's path. When ``engines``
    holds a tokenizer (``tiktoken.model``, found as ``runtime.api.resolve_model_dir`` finds it) the text model
    ``out/k3_text`` (serve/text_model.py, TensorRT-LLM's ensemble names) is written beside it, calling ``<name>``.
    ``device`` / ``ops`` (torch backend: "cuda", "cuda:N", "cpu" / "torch", "kernels", "reference") become
    parameters the model passes to ``LLM(device=..., ops=...)``; omitted = the runtime's defaults (CPU).
    ``cuda_graphs`` becomes ``LLM(cuda_graphs=True)`` (decode steps replayed from CUDA graphs; CUDA, ops "kernels").
    ``dense_dtype`` ("float32" / "bfloat16") becomes ``LLM(dense_dtype=...)`` (torch backend).
    ``enable_prefix_caching`` becomes ``LLM(enable_prefix_caching=True)`` (every backend; docs/PREFIX_CACHING.md),
    with ``num_snapshots`` (snapshot pool rows) and ``snapshot_interval`` (tokens) when given.

    Raises:
        RepositoryError: tritonclient is missing (the serve extra), ``engines`` is not a directory, the backend
            is unknown, a limit is < 1, ``device`` is malformed (or not "cpu" for onnxruntime), ``ops`` /
            ``cuda_graphs`` / ``dense_dtype`` are given for a backend other than torch, ``dense_dtype`` is not
            "float32" or "bfloat16", ``cuda_graphs`` lacks a CUDA ``device`` and ``ops="kernels"``,
            ``num_snapshots`` / ``snapshot_interval`` are given without ``enable_prefix_caching`` or are < 1, or
            ``out/<name>`` exists and ``overwrite`` is false.
    """
    engines = pathlib.Path(engines).resolve()
    out = pathlib.Path(out).resolve()
    if not engines.is_dir():
        raise RepositoryError(f"--engines {engines} is not a directory; pass the checkpoint/engine directory "
                              "that runtime.api.LLM(path) loads")
    for field, v in (("max_batch", max_batch), ("max_num_tokens", max_num_tokens), ("instance_count", instance_count)):
        if v is not None and int(v) < 1:
            raise RepositoryError(f"{field}={v} must be >= 1")
    if cuda_graphs and (ops != "kernels" or not str(device or "").startswith("cuda")):
        raise RepositoryError(f"cuda_graphs needs --device cuda[:N] and --ops kernels (got device={device!r}, "
                              f"ops={ops!r})")
    if max_context is not None and int(max_context) < 1:
        raise RepositoryError(f"max_context={max_context} must be >= 1 (or omitted)")
    check_prefix_caching(enable_prefix_caching, num_snapshots, snapshot_interval)
    resolved = resolve_backend(engines, backend)
    if device is not None:
        from k3deploy.runtime.distributed import parse_device
        try:
            parse_device(device)
        except ValueError as e:
            raise RepositoryError(f"--device: {e}") from e
    if resolved == "onnxruntime" and device is not None and str(device).strip().lower() != "cpu":
        raise RepositoryError(f"--device {device}: the onnxruntime backend runs on the CPU provider; serve a "
                              "checkpoint with the torch backend for the GPU")
    if dense_dtype is not None:
        from k3deploy.model.layers import DENSE_DTYPES, dense_dtype_name
        dense_dtype = dense_dtype_name(dense_dtype)                # K3Model's aliases fp32 / bf16
        if dense_dtype not in DENSE_DTYPES:
            raise RepositoryError(f"--dense-dtype {dense_dtype}: choose {' or '.join(DENSE_DTYPES)}")
    if (ops is not None or cuda_graphs or dense_dtype is not None) and resolved != "torch":
        raise RepositoryError(f"--ops / --cuda-graphs / --dense-dtype apply to the torch backend; {engines} is "
                              f"served by the {resolved} backend")
    from k3deploy.runtime.api import resolve_model_dir
    try:
        tokenizer = resolve_model_dir(engines)["tokenizer"]
    except (OSError, ValueError) as e:
        raise RepositoryError(f"--engines {engines}: {e}") from e
    model_dir, text_dir = out / name, out / TEXT_MODEL_NAME
    _model_config_proto()           # before anything is written: no half-written repository without tritonclient
    for d in (model_dir, text_dir) if tokenizer is not None else (model_dir,):
        if d.exists():
            if not overwrite:
                raise RepositoryError(f"{d} exists; pass --force (overwrite=True) to replace it")
            shutil.rmtree(d)
    (model_dir / "1").mkdir(parents=True)
    params = {
        "project_root": str(pathlib.Path(project_root).resolve()),
        "model_path": str(engines),
        "backend": resolved,
        "max_batch": None if max_batch is None else int(max_batch),            # None: LLM's default (tensorrt:
        "max_num_tokens": None if max_num_tokens is None else int(max_num_tokens),   # the engines' sizes)
        "max_context": None if max_context is None else int(max_context),
        "vocab_size": discover_vocab_size(engines),
        "device": device,
        "ops": ops,
        "cuda_graphs": "true" if cuda_graphs else None,
        "dense_dtype": dense_dtype,
        "enable_prefix_caching": "true" if enable_prefix_caching else None,
        "num_snapshots": None if num_snapshots is None else int(num_snapshots),
        "snapshot_interval": None if snapshot_interval is None else int(snapshot_interval),
    }
    text = render_config(name, params, instance_count)
    validate_config(text, name, where=str(model_dir / "config.pbtxt"))
    (model_dir / "config.pbtxt").write_text(text)
    shutil.copy2(MODEL_PY, model_dir / "1" / "model.py")
    LOGGER.info("wrote %s (backend %s, model %s)", model_dir, resolved, engines)
    if tokenizer is None:
        LOGGER.info("no tiktoken.model in %s: the text model %s is not written", engines, TEXT_MODEL_NAME)
    else:
        (text_dir / "1").mkdir(parents=True)
        tparams = {"project_root": params["project_root"], "tokenizer": str(tokenizer), "token_model": name}
        ttext = render_text_config(TEXT_MODEL_NAME, tparams, instance_count)
        validate_config(ttext, TEXT_MODEL_NAME, where=str(text_dir / "config.pbtxt"), text_model=True)
        (text_dir / "config.pbtxt").write_text(ttext)
        shutil.copy2(TEXT_MODEL_PY, text_dir / "1" / "model.py")
        LOGGER.info("wrote %s (text in, text out, through %s)", text_dir, name)
    return model_dir / "config.pbtxt"


def check_prefix_caching(enable: bool, num_snapshots: Optional[int], snapshot_interval: Optional[int]) -> None:
    """RepositoryError naming the option when num_snapshots / snapshot_interval are given without prefix caching
    or are not integers >= 1 (a snapshot_interval that is no multiple of the latent block size is refused by the
    runtime when the model loads)."""
    for flag, v in (("--num-snapshots", num_snapshots), ("--snapshot-interval", snapshot_interval)):
        if v is None:
            continue
        if not enable:
            raise RepositoryError(f"{flag} {v}: only used with --enable-prefix-caching; add it or drop {flag}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise RepositoryError(f"{flag} {v!r}: give an integer >= 1")


def with_prefix_caching(repo: str | pathlib.Path, out: str | pathlib.Path, num_snapshots: Optional[int] = None,
                        snapshot_interval: Optional[int] = None) -> pathlib.Path:
    """Copy the model repository ``repo`` to ``out`` (replaced) with prefix caching turned on in its ``k3`` model
    (parameters ``enable_prefix_caching`` and, when given, ``num_snapshots`` / ``snapshot_interval``; the others
    kept). Returns ``out``.

    Raises:
        RepositoryError: ``repo`` has no ``k3`` model, its config does not parse, or the values are bad
            (:func:`check_prefix_caching`).
    """
    check_prefix_caching(True, num_snapshots, snapshot_interval)
    text_format, model_config_pb2 = _model_config_proto()
    repo, out = pathlib.Path(repo).resolve(), pathlib.Path(out).resolve()
    src = repo / DEFAULT_MODEL_NAME / "config.pbtxt"
    if not src.is_file():
        raise RepositoryError(f"--repo {repo}: no {DEFAULT_MODEL_NAME}/config.pbtxt; pass a repository written by "
                              "`k3deploy repository` or `k3deploy build`")
    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(src.read_text(), cfg)
    except text_format.ParseError as e:
        raise RepositoryError(f"{src} does not parse as a Triton ModelConfig: {e}") from e
    for key, v in (("enable_prefix_caching", "true"), ("num_snapshots", num_snapshots),
                   ("snapshot_interval", snapshot_interval)):
        if v is not None:
            cfg.parameters[key].string_value = str(v)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(repo, out, symlinks=True)
    text = text_format.MessageToString(cfg)
    validate_config(text, DEFAULT_MODEL_NAME, where=str(out / DEFAULT_MODEL_NAME / "config.pbtxt"))
    (out / DEFAULT_MODEL_NAME / "config.pbtxt").write_text(text)
    return out


def validate_repository(repo: str | pathlib.Path) -> list[pathlib.Path]:
    """Validate every ``<repo>/<model>/config.pbtxt`` that names a Python-backend model; return the paths checked."""
    text_format, model_config_pb2 = _model_config_proto()

    checked = []
    for cfg_path in sorted(pathlib.Path(repo).glob("*/config.pbtxt")):
        text = cfg_path.read_text()
        cfg = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(text, cfg)
        except text_format.ParseError as e:
            raise RepositoryError(f"{cfg_path} does not parse as a Triton ModelConfig: {e}") from e
        if cfg.backend == "python" and cfg.name == DEFAULT_MODEL_NAME:
            validate_config(text, cfg_path.parent.name, where=str(cfg_path))
        elif cfg.backend == "python" and cfg.name == TEXT_MODEL_NAME:
            validate_config(text, cfg_path.parent.name, where=str(cfg_path), text_model=True)
        checked.append(cfg_path)
    return checked


def main(argv: Optional[Sequence[str]] = None, prog: str | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    from k3deploy.model.layers import DENSE_DTYPES, dense_dtype_name
    p = argparse.ArgumentParser(
        prog=prog or "python -m k3deploy.serve.repository",
        description="Write a Triton model repository with the decoupled Python-backend model 'k3' "
                    "(TensorRT-LLM tensor names) that serves the --engines directory through runtime.api.")
    p.add_argument("--engines", required=True, help="checkpoint or engine directory loaded by runtime.api.LLM")
    p.add_argument("--out", required=True, help="model repository directory to write")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="runtime backend when the --engines directory's manifest.json has no 'backend' key (default torch)")
    p.add_argument("--name", default=DEFAULT_MODEL_NAME, help="model name (default %(default)s)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="LLM(max_batch=...) (default: the runtime's, 8; for engines the build's)")
    p.add_argument("--max-num-tokens", type=int, default=None,
                   help="LLM(max_num_tokens=...) (default: the runtime's, 256; for engines the build's)")
    p.add_argument("--max-context", type=int, default=None, help="LLM(max_context=...) (default: runtime's)")
    p.add_argument("--instances", type=int, default=1, help="Python-backend instances (default %(default)s)")
    p.add_argument("--device", default=None, help="LLM(device=...): cpu, cuda or cuda:N (torch backend; default cpu)")
    p.add_argument("--ops", choices=["reference", "torch", "kernels"], default=None,
                   help="LLM(ops=...) of the torch backend (default: reference on the CPU, torch on CUDA)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="LLM(cuda_graphs=True): decode steps replay CUDA graphs (torch backend, CUDA, --ops kernels)")
    p.add_argument("--dense-dtype", choices=list(DENSE_DTYPES), default=None, type=dense_dtype_name,
                   help="LLM(dense_dtype=...) of the torch backend: dense weights and GEMMs, float32 (fp32) or "
                        "bfloat16 (bf16) (default float32; bfloat16 to deploy)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="LLM(enable_prefix_caching=True): reuse the KDA state and latent blocks of prefixes earlier "
                        "requests computed (multi-turn chats, shared system prompts; docs/PREFIX_CACHING.md)")
    p.add_argument("--num-snapshots", type=int, default=None,
                   help="with --enable-prefix-caching: KDA snapshot pool rows, one request's KDA state each "
                        "(default: the runtime's, 2 x max_batch)")
    p.add_argument("--snapshot-interval", type=int, default=None,
                   help="with --enable-prefix-caching: tokens between periodic KDA snapshots, a multiple of the "
                        "latent block size (16 on the CPU, 64 on CUDA, the engines' for tensorrt; the model refuses "
                        "another when it loads) (default: the runtime's, 1024 rounded up to one)")
    p.add_argument("--force", action="store_true", help="replace an existing OUT/<name>")
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    try:
        path = write_repository(args.engines, args.out, args.backend, name=args.name, max_batch=args.max_batch,
                                max_num_tokens=args.max_num_tokens, max_context=args.max_context,
                                instance_count=args.instances, overwrite=args.force, device=args.device,
                                ops=args.ops, cuda_graphs=args.cuda_graphs, dense_dtype=args.dense_dtype,
                                enable_prefix_caching=args.enable_prefix_caching,
                                num_snapshots=args.num_snapshots, snapshot_interval=args.snapshot_interval)
    except RepositoryError as e:
        LOGGER.error("%s", e)
        return 2
    LOGGER.info("repository ready: %s", path.parent.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
