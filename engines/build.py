"""Build TensorRT engines from per-layer ONNX files (strongly typed, two optimization profiles, shared timing cache).

Library::

    from k3deploy.engines.build import build_all, build_engine, profiles_from_dims
    manifest = build_all("out/onnx", "out/engines", target_cc="sm86", max_batch=8, max_num_tokens=256)

CLI::

    python -m k3deploy.engines.build --onnx-dir out/onnx --out out/engines --target-cc sm86 --max-batch 8 --max-num-tokens 256

Every ``**/*.onnx`` under ``--onnx-dir`` becomes ``<same relative path>.plan`` under ``--out`` (``rank0/layer003.decode.onnx`` ->
``rank0/layer003.decode.plan``); external data must sit next to its ONNX. ``manifest.json`` (engines/manifest.py) records what
was built; an engine is rebuilt only when its ONNX (+ external data) hash or the build options changed, its plan is
missing, or ``--force`` is given.

Profiles: input dims come from the ONNX ``dim_param`` names. :func:`default_profile_dims` gives two profiles:
``prefill`` (T in [1, max_num_tokens]; N, B in [1, max_batch]) and ``decode`` (T, N, B in [1, max_batch]).
Any other symbolic dim (pool sizes S/NB, block-table width MB, ...) must be given with ``--dim NAME=MIN:OPT:MAX``
(or ``extra_dims``). A dim_param may be an expression of names (``"N + 1"``); it is evaluated per min/opt/max.

Plugins: with full TensorRT the ``kimi`` plugins are registered before parsing (``register_tensorrt_plugins``), so the
parser maps every ``kimi`` node (it carries ``plugin_namespace``) to its plugin; unregistered, it would silently
inline the node's ONNX function body, the O(context) reference (STACK.md §1c). ``aot=True`` (``--aot``) registers
the ahead-of-time forms where ``tensorrt.plugin`` has them (PTX baked into the engine, no Python at runtime): KdaDecode
and MlaDecode as one kernel each, marked ``aot=1`` for the parser; Mxfp4Moe, KdaPrefill and MlaPrefill rewritten into
chains of single-launch ops (four, nine and four: plugins/moe/trt_aot.py, plugins/kda/trt_aot_prefill.py,
plugins/mla/trt_aot_prefill.py); the manifest records them per engine (``aot_ops``).
TensorRT-RTX registers nothing: its parser aborts on Python plugins, and the nodes are inlined from their bodies.

TensorRT-RTX (``engines.trt``) builds ahead of time for ``target_cc`` (``sm75/80/86/89/120/121``; no ``sm90``) with no
GPU. Without a GPU it cannot deserialize the plan, so the metadata is then checked on the network and the profiles
before serialization (``verified: "network"`` in the manifest); with a GPU it is read back from the engine
(``verified: "engine"``). RTX treats timing-cache calls as no-ops; the cache file is still loaded/saved.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

from k3deploy.engines import manifest as mf
from k3deploy.engines.trt import TrtInfo, cuda_device_count, load_trt
from k3deploy.plugins.trt_common import eval_dim  # noqa: F401  (one dim-expression evaluator; re-exported)
from k3deploy.plugins.workspace import WORKSPACE_RULES, workspace_rules_of

logger = logging.getLogger(__name__)

Triple = tuple[Any, Any, Any]
DEFAULT_TIMING_CACHE = "timing.cache"
_STD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


# -------------------------------------------------------------------------------------------------------- plugins
def register_build_plugins(info: TrtInfo, aot: bool = False) -> list[str]:
    """Register the ``kimi`` plugins with full TensorRT before parsing; nothing for TensorRT-RTX (its parser aborts on
    Python plugins; the nodes are then inlined from their function bodies). Returns the op types registered ahead of
    time (with ``aot`` where ``tensorrt.plugin`` supports AOT: KdaDecode, MlaDecode, Mxfp4Moe, KdaPrefill (needs a
    tested fla-core), MlaPrefill; else ``[]``; the last three are rewritten into chains of AOT ops at parse time:
    :func:`mark_aot_nodes`).
    Raises ValueError for ``aot`` with TensorRT-RTX, and for ``aot`` when any op's AOT form could not be registered
    (an --aot engine must run without Python; the message names the ops and what to install)."""
    if info.is_rtx:
        if aot:
            raise ValueError("aot (--aot): TensorRT-RTX has no tensorrt.plugin AOT plugins; build with full TensorRT "
                             "(engines.build --flavor tensorrt, build_engines.py --backend tensorrt) or drop --aot")
        return []
    from k3deploy.plugins.kda import trt_aot as kda_aot
    from k3deploy.plugins.mla import trt_aot as mla_aot
    from k3deploy.plugins.trt_common import register_tensorrt_plugins

    register_tensorrt_plugins(info.module, aot=aot)
    if not aot:
        return []
    ops = [pid.split("::")[1] for pid in kda_aot.register() + mla_aot.register()]
    for op_type, (module, _) in _DECOMPOSED.items():
        if importlib.import_module(module).register():
            ops.append(op_type)
    missing = sorted({"KdaDecode", "MlaDecode", *_DECOMPOSED} - set(ops))
    if missing:
        raise ValueError(f"--aot: no ahead-of-time form could be registered for {', '.join(missing)}: it needs "
                         "TensorRT >= 10.9 (tensorrt.plugin with aot_impl) and Triton, and KdaPrefill needs fla-core "
                         "0.6.0 (pip install -e '.[gpu]'); without them those engines would need Python. Install "
                         "them or drop --aot")
    return ops


# op type -> (module, rewrite function): ops whose AOT form is a chain of single-launch ops
_DECOMPOSED = {"Mxfp4Moe": ("k3deploy.plugins.moe.trt_aot", "decompose_mxfp4_moe"),
               "KdaPrefill": ("k3deploy.plugins.kda.trt_aot_prefill", "decompose_kda_prefill"),
               "MlaPrefill": ("k3deploy.plugins.mla.trt_aot_prefill", "decompose_mla_prefill")}


def aot_sources_sha256() -> str:
    """sha256 over the sources that make the AOT kernels' PTX (which an AOT engine embeds): in the build options
    of ``aot`` builds, so a kernel change rebuilds those engines."""
    import hashlib

    import triton

    h = hashlib.sha256(f"triton {triton.__version__}".encode())   # Triton generates every AOT kernel's PTX
    for mod in ("k3deploy.plugins.aot_common", "k3deploy.plugins.aot_ops", "k3deploy.plugins.kda.trt_aot", "k3deploy.plugins.kda.trt_aot_prefill",
                "k3deploy.plugins.kda.kernels", "k3deploy.plugins.mla.trt_aot", "k3deploy.plugins.mla.trt_aot_prefill", "k3deploy.plugins.mla.kernels",
                "k3deploy.plugins.moe.trt_aot", "k3deploy.plugins.moe.kernels"):
        h.update(Path(importlib.import_module(mod).__file__).read_bytes())
    try:   # the KdaPrefill chain compiles fla-core's stage kernels in, with machine-dependent choices
        import fla
        from fla.utils import IS_GATHER_SUPPORTED, IS_TF32_SUPPORTED
        h.update(f"{fla.__version__} tf32={IS_TF32_SUPPORTED} gather={IS_GATHER_SUPPORTED}".encode())
    except Exception:   # noqa: BLE001 - no fla-core: no KdaPrefill AOT ops either
        h.update(b"no fla")
    return h.hexdigest()


def mark_aot_nodes(model, op_types: Sequence[str]) -> int:
    """Set the attribute ``aot=1`` on every top-level node of domain ``kimi`` whose op type is in ``op_types`` (the
    ONNX form of ``network.add_plugin(..., aot=True)``, STACK.md §1b); Mxfp4Moe, KdaPrefill and MlaPrefill nodes of
    those types are replaced by their chains of AOT ops instead (``_DECOMPOSED``). Returns how many nodes were marked
    or replaced."""
    import onnx

    n = 0
    for op_type, (module, fn) in _DECOMPOSED.items():
        if op_type in op_types:
            n += getattr(importlib.import_module(module), fn)(model)
    for node in model.graph.node:
        if node.domain == "kimi" and node.op_type in op_types:
            keep = [a for a in node.attribute if a.name != "aot"]
            del node.attribute[:]
            node.attribute.extend(keep + [onnx.helper.make_attribute("aot", 1)])
            n += 1
    return n


def _parse(trt, network, trt_logger, onnx_path: Path, aot_ops: Sequence[str]):
    """Parse ``onnx_path`` into ``network``; with ``aot_ops`` the model is loaded (external data left on disk), its
    nodes marked by :func:`mark_aot_nodes` and parsed from memory with the file's path (for the external data)."""
    parser = trt.OnnxParser(network, trt_logger)
    if aot_ops:
        import onnx

        model = onnx.load(str(onnx_path), load_external_data=False)
        logger.info("%s: %d node(s) marked aot=1", onnx_path.name, mark_aot_nodes(model, aot_ops))
        ok = parser.parse(model.SerializeToString(), str(onnx_path))
    else:
        ok = parser.parse_from_file(str(onnx_path))
    if not ok:
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    return parser


# -------------------------------------------------------------------------------------------------------- profiles
def default_profile_dims(max_batch: int = 8, max_num_tokens: int = 256,
                         extra_dims: Mapping[str, Triple] | None = None) -> list[dict[str, Triple]]:
    """Two profiles as ``[prefill, decode]`` dicts ``{dim_name: (min, opt, max)}``.

    prefill: T = (1, max_num_tokens, max_num_tokens), N = B = (1, max_batch, max_batch);
    decode: T = N = B = (1, max_batch, max_batch) (decode packs one token per sequence, T == B).
    extra_dims (e.g. pool sizes) are added to both. Raises ValueError for max_batch/max_num_tokens < 1 or
    max_num_tokens < max_batch."""
    if max_batch < 1 or max_num_tokens < 1:
        raise ValueError(f"max_batch={max_batch} and max_num_tokens={max_num_tokens} must be >= 1")
    if max_num_tokens < max_batch:
        raise ValueError(f"max_num_tokens={max_num_tokens} must be >= max_batch={max_batch} (a prefill step "
                         f"can hold one token per sequence)")
    batch = (1, max_batch, max_batch)
    prefill = {"T": (1, max_num_tokens, max_num_tokens), "N": batch, "B": batch}
    decode = {"T": batch, "N": batch, "B": batch}
    for d in (prefill, decode):
        d.update(extra_dims or {})
    return [prefill, decode]


def onnx_input_dims(onnx_path: str | Path) -> dict[str, list[int | str]]:
    """Graph inputs (initializers excluded) -> dims, each an int (fixed) or a str (dim_param). Loads no weights.

    Raises ValueError naming an input with unknown rank or an unnamed dynamic dim."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.tensor_type.HasField("shape"):
            raise ValueError(f"{onnx_path}: input {vi.name!r} has no shape; export it with a static rank")
        dims = []
        for k, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.dim_param:
                dims.append(d.dim_param)
            else:
                raise ValueError(f"{onnx_path}: input {vi.name!r} dim {k} is dynamic but unnamed; give it a "
                                 f"dim_param (torch.export.Dim name) so a profile range can be assigned")
        out[vi.name] = dims
    return out


def profiles_from_dims(onnx_path: str | Path, profile_dims: Sequence[Mapping[str, Triple]]
                       ) -> list[dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]:
    """Per profile, ``{input_name: (min_shape, opt_shape, max_shape)}`` derived from the ONNX inputs' symbolic dims.

    profile_dims: one ``{dim_name: (min, opt, max)}`` per profile (see :func:`default_profile_dims`).
    Raises ValueError naming the input, the dim and the fix when a dim has no range or min <= opt <= max fails."""
    inputs = onnx_input_dims(onnx_path)
    profiles = []
    for p, dims in enumerate(profile_dims):
        prof = {}
        for name, shape in inputs.items():
            triple = []
            for k in range(3):
                vals = {d: v[k] for d, v in dims.items()}
                try:
                    triple.append(tuple(d if isinstance(d, int) else eval_dim(d, vals) for d in shape))
                except KeyError as e:
                    raise ValueError(f"{onnx_path}: input {name!r} has symbolic dim {e.args[0]!r} with no range in "
                                     f"profile {p}; pass --dim {e.args[0]}=MIN:OPT:MAX (extra_dims)") from None
            mn, op, mx = triple
            if not all(a <= b <= c for a, b, c in zip(mn, op, mx)) or min(mn, default=1) < 0:
                raise ValueError(f"{onnx_path}: input {name!r} profile {p}: need 0 <= min <= opt <= max per dim, "
                                 f"got {mn} / {op} / {mx}; fix the dim ranges")
            prof[name] = (mn, op, mx)
        profiles.append(prof)
    return profiles


# ------------------------------------------------------------------------------------------------------ TRT helpers
# Messages TensorRT-RTX logs as errors when it builds ahead of time on a machine without a GPU driver; the build
# itself succeeds (verified by the metadata checks), so they are logged at debug level instead.
_NO_GPU_NOISE = ("cudaError 35", "CUDA driver version is insufficient", "timing cache will not be used",
                 "Failed to deserialize timing cache")
# Parser notes on the inlined kimi function bodies (repeated internal node names; U8 MXFP4 constants widened to
# INT32 when the MoE body is inlined instead of mapped to the plugin): expected, logged at debug level.
_BODY_NOISE = ("output tensors of this new instance will not be queryable", "is being converted to INT32")


def _trt_logger(trt):
    """A TensorRT ILogger forwarding to the `tensorrt` Python logger (no-GPU noise of AOT builds at debug)."""
    no_gpu = cuda_device_count() == 0
    levels = {trt.ILogger.Severity.INTERNAL_ERROR: logging.CRITICAL, trt.ILogger.Severity.ERROR: logging.ERROR,
              trt.ILogger.Severity.WARNING: logging.WARNING, trt.ILogger.Severity.INFO: logging.DEBUG,
              trt.ILogger.Severity.VERBOSE: logging.DEBUG}
    trt_log = logging.getLogger("tensorrt")

    class _Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            level = levels.get(severity, logging.INFO)
            if (no_gpu and any(n in msg for n in _NO_GPU_NOISE)) or any(n in msg for n in _BODY_NOISE):
                level = logging.DEBUG
            trt_log.log(level, "%s", msg)

    return _Logger()


def parse_target_cc(target_cc: str | Sequence[str] | None) -> list[str]:
    """``"sm86"`` / ``"86"`` / ``"8.6"`` / ``"sm86,sm89"`` / ``"sm86 sm89"`` / a list of any of these ->
    ``["SM86", ...]`` (ComputeCapability member names): both CLIs (``engines.build``, ``export/build_engines.py``)
    take ``--target-cc sm86 sm89`` and ``--target-cc sm86,sm89``.

    Repeats are dropped. Raises ValueError for malformed or empty values."""
    if target_cc is None:
        return []
    raw = [target_cc] if isinstance(target_cc, str) else list(target_cc)
    items = [part for x in raw for part in str(x).replace(",", " ").split()]
    if not items:
        raise ValueError(f"target_cc {target_cc!r} names no target; use e.g. 'sm86' or 'sm86,sm89'")
    out = []
    for item in items:
        s = str(item).strip().lower().removeprefix("sm").replace(".", "").replace("_", "")
        if not s.isdigit():
            raise ValueError(f"target_cc {item!r} not understood; use e.g. 'sm86' or 'sm86,sm89'")
        if f"SM{s}" not in out:
            out.append(f"SM{s}")
    return out


def check_target_cc(trt_info: TrtInfo, targets: list[str]) -> list[str]:
    """The ahead-of-time targets a TensorRT-RTX build will use (``parse_target_cc`` names; [] -> ["CURRENT"] on a
    GPU machine). ValueError naming target_cc when a target is not one the installed TensorRT-RTX knows, or when
    none is given without a GPU. Full TensorRT: [] (it builds for the GPU it runs on)."""
    if not trt_info.is_rtx:
        return []
    members = trt_info.module.ComputeCapability.__members__
    supported = [m.lower() for m in members if m.startswith("SM")]
    if not targets:
        if cuda_device_count() == 0:
            raise ValueError(f"TensorRT-RTX without a GPU needs target_cc (e.g. 'sm86'); supported: {supported}")
        return ["CURRENT"]
    for t in targets:
        if t not in members:
            raise ValueError(f"target_cc {t.lower()!r} not supported by TensorRT-RTX {trt_info.version}; supported: "
                             f"{supported} (SM90/Hopper is not)")
    return targets


def _set_compute_capability(trt_info: TrtInfo, config, targets: list[str]) -> list[str]:
    if not trt_info.is_rtx:
        if targets:
            logger.warning("target_cc %s ignored: full TensorRT builds for the GPU it runs on", targets)
        return ["current"]
    members = trt_info.module.ComputeCapability.__members__
    targets = check_target_cc(trt_info, targets)
    config.num_compute_capabilities = len(targets)
    for i, t in enumerate(targets):
        config.set_compute_capability(members[t], i)
    return [t.lower() for t in targets]


class TimingCacheFile:
    """A timing cache kept in one file and shared by every engine built through this object.

    ``attach(config)`` creates the config's cache from the current bytes (the file, read once; empty if missing) and
    sets it; ``save()`` serializes that cache back into memory and atomically onto the file, so the next engine starts
    from everything learned so far. (A TensorRT cache object is not reused across builder configs: its lifetime is
    tied to the config that created it.) ``loaded_bytes``: size of the bytes the last ``attach`` started from.
    TensorRT-RTX accepts the calls but does no timing (its cache stays a small header)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data: bytes | None = None
        self.loaded_bytes = 0
        self._live = None  # (config, cache) of the current build

    def attach(self, config) -> None:
        if self.data is None:
            self.data = self.path.read_bytes() if self.path.is_file() else b""
            logger.info("timing cache %s: %s", self.path, f"loaded {len(self.data)} bytes" if self.data else "new")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # RTX: "timing cache operations are no-ops"
            cache = config.create_timing_cache(self.data)
            if cache is None and self.data:
                logger.warning("timing cache %s unreadable; starting a fresh one", self.path)
                self.data, cache = b"", config.create_timing_cache(b"")
            if cache is None or not config.set_timing_cache(cache, False):
                raise RuntimeError(f"timing cache {self.path} does not match this TensorRT; delete the file")
        self.loaded_bytes = len(self.data)
        self._live = (config, cache)

    def save(self) -> None:
        if self._live is None:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.data = bytes(self._live[1].serialize())
        self._live = None
        mf.atomic_write_bytes(self.path, self.data)


def _dtype_name(trt, dt) -> str:
    names = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64",
             "INT8": "int8", "UINT8": "uint8", "BOOL": "bool", "FP8": "float8_e4m3fn", "FP4": "float4_e2m1",
             "E8M0": "float8_e8m0", "INT4": "int4"}
    return next((v for k, v in names.items() if getattr(trt.DataType, k, None) == dt), str(dt))


def _tensor_meta(trt, t) -> dict:
    return {"name": t.name, "shape": list(t.shape), "dtype": _dtype_name(trt, t.dtype),
            "is_shape_tensor": bool(t.is_shape_tensor)}


def onnx_custom_ops(onnx_path: str | Path, trt=None, aot_ops: Sequence[str] = ()) -> dict[str, dict[str, str]]:
    """``{"namespace::OpType": {"version": v, "impl": ...}}`` for every non-standard-domain node of the top graph
    (namespace = ``plugin_namespace`` attribute, else the node domain; version = ``plugin_version`` or ``"1"``).
    impl: ``"plugin"`` when a creator is registered in ``trt``'s registry (the engine then needs that plugin at
    runtime), ``"function-body"`` when not (the parser inlined the ONNX local function), ``"unknown"`` without trt.
    aot_ops: the graph as an AOT build parses it (:func:`mark_aot_nodes`: Mxfp4Moe, KdaPrefill and MlaPrefill
    rewritten into their chains of AOT ops)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    if aot_ops:
        mark_aot_nodes(model, aot_ops)
    ops = {}
    for node in model.graph.node:
        if node.domain in _STD_DOMAINS:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        ns = attrs.get("plugin_namespace", node.domain.encode())
        ver = attrs.get("plugin_version", b"1")
        impl = "unknown"
        if trt is not None:  # all_creators, not get_creator: a miss there logs a TensorRT error
            found = any((c.name, c.plugin_version, c.plugin_namespace) == (node.op_type, ver.decode(), ns.decode())
                        for c in trt.get_plugin_registry().all_creators)
            impl = "plugin" if found else "function-body"
        ops[f"{ns.decode()}::{node.op_type}"] = {"version": ver.decode(), "impl": impl}
    return ops


# ------------------------------------------------------------------------------------------------------------ build
def build_engine(onnx_path: str | Path, plan_path: str | Path,
                 profiles: Sequence[Mapping[str, Triple]], *, target_cc: str | Sequence[str] | None = None,
                 timing_cache: str | Path | TimingCacheFile | None = None,
                 shape_values: Sequence[Mapping[str, Triple]] | None = None,
                 opt_level: int | None = None, trt_flavor: str | None = None, aot: bool = False) -> dict:
    """Parse ``onnx_path`` (external data next to it) into a strongly typed network and write the plan atomically.

    profiles: one ``{input_name: (min_shape, opt_shape, max_shape)}`` per optimization profile (profile i = index i
    at runtime); every network input must appear (see :func:`profiles_from_dims`).
    target_cc: TensorRT-RTX compute capabilities (``"sm86"``); required on RTX without a GPU; ignored by full TRT.
    timing_cache: file path or shared :class:`TimingCacheFile` (loaded before, saved after the build).
    shape_values: per profile ``{input_name: (min_values, opt_values, max_values)}`` for inputs TensorRT treats as
    shape tensors (values that determine shapes).
    aot: full TensorRT only: the AOT forms of every kimi op (see the module docstring).
    Returns metadata: ``inputs``/``outputs`` (name, shape with -1 = dynamic, dtype, is_shape_tensor), ``profiles``
    (read back from the profile objects), ``compute_capability``, ``plan_bytes``, ``plan_sha256``, ``plugins``,
    ``aot_ops``, ``verified`` ("engine" when the plan was deserialized and checked, "network" otherwise), ``notes``.
    Raises RuntimeError with the parser errors / on build failure, ValueError for missing or bad profile entries or
    ``aot`` with TensorRT-RTX."""
    import hashlib

    info = load_trt(trt_flavor)
    trt = info.module
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"onnx_path {onnx_path} does not exist")
    if not profiles:
        raise ValueError("profiles is empty; give at least one {input: (min, opt, max)} dict")
    aot_ops = register_build_plugins(info, aot)
    trt_logger = _trt_logger(trt)
    builder = trt.Builder(trt_logger)
    flags = 0
    if not info.is_rtx and info.major < 11:  # TRT 11 and RTX are always strongly typed
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = _parse(trt, network, trt_logger, onnx_path, aot_ops)  # noqa: F841  (the network refers to it)

    config = builder.create_builder_config()
    if opt_level is not None:
        config.builder_optimization_level = int(opt_level)
    ccs = _set_compute_capability(info, config, parse_target_cc(target_cc))
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    outputs = [network.get_output(i) for i in range(network.num_outputs)]
    trt_profiles = []
    for p, shapes in enumerate(profiles):
        prof = builder.create_optimization_profile()
        for t in inputs:
            if t.is_shape_tensor:
                vals = (shape_values[p] if shape_values and p < len(shape_values) else {}).get(t.name)
                if vals is None:
                    raise ValueError(f"{onnx_path}: input {t.name!r} is a shape tensor; give its value range in "
                                     f"shape_values[{p}][{t.name!r}] = (min, opt, max)")
                prof.set_shape_input(t.name, *[tuple(int(x) for x in v) for v in vals])
            if t.name not in shapes:
                if -1 in tuple(t.shape):
                    raise ValueError(f"{onnx_path}: profile {p} has no shapes for dynamic input {t.name!r}; "
                                     f"add it (profiles_from_dims derives it from the ONNX dim names)")
                continue
            prof.set_shape(t.name, *[tuple(int(x) for x in s) for s in shapes[t.name]])
        if config.add_optimization_profile(prof) < 0:
            raise ValueError(f"{onnx_path}: profile {p} rejected by TensorRT (shapes {dict(shapes)}); "
                             f"check min <= opt <= max and the fixed dims")
        trt_profiles.append(prof)

    cache = TimingCacheFile(timing_cache) if isinstance(timing_cache, (str, Path)) else timing_cache
    if cache is not None:
        cache.attach(config)
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build {onnx_path} (see the 'tensorrt' log records above)")
    logger.info("built %s in %.2fs (%d bytes)", plan_path, time.perf_counter() - t0, plan.nbytes)
    if cache is not None:
        cache.save()
    data = bytes(plan)
    mf.atomic_write_bytes(plan_path, data)

    meta = {
        "inputs": [_tensor_meta(trt, t) for t in inputs],
        "outputs": [_tensor_meta(trt, t) for t in outputs],
        "profiles": [{t.name: [list(s) for s in prof.get_shape(t.name)] for t in inputs if not t.is_shape_tensor}
                     for prof in trt_profiles],
        "compute_capability": ccs,
        "plan_bytes": len(data),
        "plan_sha256": hashlib.sha256(data).hexdigest(),
        "plugins": onnx_custom_ops(onnx_path, trt, aot_ops),
        "aot_ops": sorted(aot_ops),
        "notes": [],
    }
    if cache is not None:
        meta["timing_cache"] = {"path": str(cache.path), "loaded_bytes": cache.loaded_bytes}
    _check_network_meta(meta, profiles, onnx_path)
    meta["verified"] = _verify_engine(info, trt_logger, data, meta)
    if meta["verified"] == "network":
        meta["notes"].append("no CUDA device: plan not deserialized; I/O and profiles checked on the network")
    if aot_ops:
        meta["notes"].append("AOT ops: kernels above 48 KB of shared memory (e.g. the KdaPrefill chain's, up to 148 KB) "
                             "need TensorRT's AOT launcher to opt them in, not verified without TensorRT here: run "
                             "one request through the engines after building")
    if info.is_rtx:
        meta["notes"].append("TensorRT-RTX: timing cache is a no-op; kernels are JIT-compiled on first run "
                             "(use a runtime cache in runtime/)")
    return meta


def _check_network_meta(meta: dict, profiles: Sequence[Mapping[str, Triple]], onnx_path: Path) -> None:
    """Profiles read back from TensorRT must equal the requested ones; raises RuntimeError otherwise."""
    for p, (got, want) in enumerate(zip(meta["profiles"], profiles)):
        for name, shapes in got.items():
            if name in want and [list(s) for s in want[name]] != shapes:
                raise RuntimeError(f"{onnx_path}: profile {p} input {name!r}: TensorRT kept {shapes}, asked {want[name]}")


def _verify_engine(info: TrtInfo, trt_logger, plan: bytes, meta: dict) -> str:
    """Deserialize the plan when a CUDA device exists and compare I/O and profile shapes with ``meta``.

    Returns "engine" (checked on the engine) or "network" (no device). Raises RuntimeError on a mismatch."""
    if cuda_device_count() == 0:
        return "network"
    trt = info.module
    engine = trt.Runtime(trt_logger).deserialize_cuda_engine(plan)
    if engine is None:
        raise RuntimeError("built plan does not deserialize on this machine (compute capability not targeted?)")
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    want = [t["name"] for t in meta["inputs"] + meta["outputs"]]
    if sorted(names) != sorted(want):
        raise RuntimeError(f"engine I/O {names} differs from network I/O {want}")
    if engine.num_optimization_profiles != len(meta["profiles"]):
        raise RuntimeError(f"engine has {engine.num_optimization_profiles} profiles, expected {len(meta['profiles'])}")
    for p, prof in enumerate(meta["profiles"]):
        for name, shapes in prof.items():
            got = [list(s) for s in engine.get_tensor_profile_shape(name, p)]
            if got != shapes:
                raise RuntimeError(f"engine profile {p} input {name!r} is {got}, expected {shapes}")
    return "engine"


def find_onnx(onnx_dir: str | Path) -> list[Path]:
    """Every ``**/*.onnx`` under onnx_dir, sorted, as paths relative to it. Raises FileNotFoundError when none."""
    onnx_dir = Path(onnx_dir)
    if not onnx_dir.is_dir():
        raise FileNotFoundError(f"--onnx-dir {onnx_dir} is not a directory")
    found = sorted(p.relative_to(onnx_dir) for p in onnx_dir.rglob("*.onnx"))
    if not found:
        raise FileNotFoundError(f"no *.onnx under {onnx_dir}; run the export first")
    return found


def build_all(onnx_dir: str | Path, out_dir: str | Path, *, target_cc: str | Sequence[str] | None = None,
              max_batch: int = 8, max_num_tokens: int = 256, extra_dims: Mapping[str, Triple] | None = None,
              profile_dims: Sequence[Mapping[str, Triple]] | None = None,
              shape_values: Sequence[Mapping[str, Triple]] | None = None, force: bool = False,
              timing_cache: str | Path | None = None, opt_level: int | None = None,
              trt_flavor: str | None = None, progress: bool = True, aot: bool = False) -> dict:
    """Build (or skip when unchanged) an engine for every ONNX under ``onnx_dir``; returns the manifest dict.

    Plans mirror the ONNX layout (``rank0/layer003.decode.onnx`` -> ``out_dir/rank0/layer003.decode.plan``). profile_dims defaults to
    :func:`default_profile_dims` (max_batch, max_num_tokens, extra_dims). timing_cache defaults to
    ``out_dir/timing.cache`` and is shared by all engines. The manifest is rewritten after every engine, so an
    interrupted build keeps what finished. aot: see :func:`build_engine` (part of the build options: changing it
    rebuilds). Raises like :func:`build_engine` (the failing ONNX is named)."""
    from tqdm import tqdm

    info = load_trt(trt_flavor)
    register_build_plugins(info, aot)          # before any output: aot with TensorRT-RTX fails here
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dims = list(profile_dims) if profile_dims else default_profile_dims(max_batch, max_num_tokens, extra_dims)
    cache = TimingCacheFile(timing_cache or out_dir / DEFAULT_TIMING_CACHE)
    old = None if force else mf.read_manifest(out_dir)
    if old is not None and old["tensorrt"] != {"flavor": info.flavor, "version": info.version}:
        logger.info("TensorRT changed (%s -> %s %s): rebuilding everything", old["tensorrt"], info.flavor, info.version)
        old = None
    if old is not None and workspace_rules_of(old) != WORKSPACE_RULES:
        logger.info("plugin workspace rules changed (%s -> %s): rebuilding everything", workspace_rules_of(old),
                    WORKSPACE_RULES)
        old = None
    manifest = mf.new_manifest(info.flavor, info.version)
    manifest["profile_dims"] = _jsonable(dims)      # the runtime reads the pools' fixed sizes (BS) from here
    manifest["workspace_rules"] = WORKSPACE_RULES   # the runtime refuses engines sized by other rules
    files = find_onnx(onnx_dir)
    built = skipped = 0
    for rel in tqdm(files, desc="engines", unit="engine", disable=not progress):
        src, plan_rel = onnx_dir / rel, rel.with_suffix(".plan").as_posix()
        try:
            profiles = profiles_from_dims(src, dims)
            options = _jsonable({"flavor": info.flavor, "version": info.version,
                                 "target_cc": parse_target_cc(target_cc), "profiles": profiles,
                                 "shape_values": shape_values, "opt_level": opt_level, "aot": bool(aot),
                                 "aot_sources": aot_sources_sha256() if aot else None})
            cfg_hash, src_hash = mf.config_hash(options), mf.onnx_source_sha256(src)
            entry = (old or {}).get("engines", {}).get(plan_rel)
            if mf.is_up_to_date(entry, out_dir / plan_rel, src_hash, cfg_hash):
                logger.info("up to date: %s", plan_rel)
                manifest["engines"][plan_rel] = entry
                skipped += 1
            else:
                meta = build_engine(src, out_dir / plan_rel, profiles, target_cc=target_cc, timing_cache=cache,
                                    shape_values=shape_values, opt_level=opt_level, trt_flavor=trt_flavor, aot=aot)
                manifest["engines"][plan_rel] = {"onnx": rel.as_posix(), "onnx_sha256": src_hash,
                                                 "config_hash": cfg_hash, "options": options, **meta}
                built += 1
        except Exception as e:
            raise RuntimeError(f"building {src} failed: {e}") from e
        mf.write_manifest(out_dir, manifest)
    dropped = set((old or {}).get("engines", {})) - set(manifest["engines"])
    if dropped:
        logger.info("dropped manifest entries whose ONNX is gone (plans left on disk): %s", sorted(dropped))
    manifest["model_config_hash"] = _export_config_hash(onnx_dir)
    mf.write_manifest(out_dir, manifest)
    logger.info("%d engine(s) built, %d up to date -> %s", built, skipped, out_dir)
    return manifest


def _export_config_hash(onnx_dir: Path) -> str | None:
    """The model's K3Config.config_hash() recorded by the export (onnx_dir/index.json), or None for other ONNX."""
    import json
    p = onnx_dir / "index.json"
    try:
        return json.loads(p.read_text()).get("config_hash") if p.is_file() else None
    except (json.JSONDecodeError, AttributeError):
        return None


def _jsonable(x):
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# -------------------------------------------------------------------------------------------------------------- CLI
def _parse_dim(text: str) -> tuple[str, Triple]:
    try:
        name, rng = text.split("=")
        mn, op, mx = (int(v) for v in rng.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dim {text!r}: expected NAME=MIN:OPT:MAX, e.g. S=2:9:9") from None
    return name.strip(), (mn, op, mx)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog or "python -m k3deploy.engines.build", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Plans mirror the ONNX tree (rank0/layer003.decode.onnx -> rank0/layer003.decode.plan); "
                                        "manifest.json records sources, options and I/O. Exit status: 0 built, 1 a "
                                        "build failed (no TensorRT, a bad ONNX file, ...), 2 bad arguments.")
    ap.add_argument("--onnx-dir", required=True, help="folder searched for **/*.onnx (external data next to each)")
    ap.add_argument("--out", required=True, help="output folder for plans, manifest.json and timing.cache")
    ap.add_argument("--target-cc", nargs="+", default=None,
                    help="TensorRT-RTX target(s), e.g. sm86, sm86 sm89 or sm86,sm89 (required on RTX without a GPU)")
    ap.add_argument("--max-batch", type=int, default=8,
                    help="max sequences per step (decode profile B/T/N max; default 8)")
    ap.add_argument("--max-num-tokens", type=int, default=256,
                    help="max tokens per prefill step (prefill T max; default 256)")
    ap.add_argument("--dim", action="append", type=_parse_dim, default=[], metavar="NAME=MIN:OPT:MAX",
                    help="range of another symbolic dim for both profiles (repeatable), e.g. --dim S=2:9:9")
    ap.add_argument("--timing-cache", default=None, help=f"timing cache file (default OUT/{DEFAULT_TIMING_CACHE})")
    ap.add_argument("--opt-level", type=int, default=None, help="builder optimization level 0-5 (TRT default 3)")
    ap.add_argument("--flavor", choices=["tensorrt", "tensorrt-rtx"], default=None,
                    help="force a TensorRT flavor (default: full TensorRT if installed, else RTX)")
    ap.add_argument("--aot", action="store_true",
                    help="full TensorRT >= 10.9: every kimi op as ahead-of-time plugins (PTX in the engine, no "
                         "Python at runtime; Mxfp4Moe/KdaPrefill/MlaPrefill as chains of single-launch ops); refused "
                         "with TensorRT-RTX")
    ap.add_argument("--force", action="store_true", help="rebuild every engine even when unchanged")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="-v: info, -vv: debug incl. TensorRT log")
    args = ap.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        parse_target_cc(args.target_cc)
    except ValueError as e:
        ap.error(f"--target-cc: {e}")                    # exit 2, one line, before any engine is built
    try:
        manifest = build_all(args.onnx_dir, args.out, target_cc=args.target_cc, max_batch=args.max_batch,
                             max_num_tokens=args.max_num_tokens, extra_dims=dict(args.dim), force=args.force,
                             timing_cache=args.timing_cache, opt_level=args.opt_level, trt_flavor=args.flavor,
                             progress=not args.no_progress, aot=args.aot)
    except (ImportError, ValueError, FileNotFoundError, RuntimeError) as e:
        logger.error("%s", e)
        return 1
    print(f"manifest: {Path(args.out) / mf.MANIFEST_NAME} ({len(manifest['engines'])} engines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
