"""Shared plumbing for the ``kimi`` TensorRT IPluginV3 plugins (namespace ``kimi``, version ``1``).

Two layers:

* **Pure Python** (no TensorRT, no GPU needed; unit-tested on CPU): :class:`OpSpec` describes one op
  (inputs, outputs, attributes, output-shape rule, dtype rule, in-place aliases, kernel entry point);
  :func:`fields_from_attrs` / :func:`attrs_from_fields` convert attributes <-> plugin fields,
  :func:`output_shapes` evaluates the shape rule on concrete or symbolic dims, :func:`supports_combination`
  decides TensorRT's format/dtype queries.
* **TensorRT adapters**: :func:`make_plugin_classes` builds an ``IPluginV3`` (OneCore + OneBuild[V2] + OneRuntime)
  class and an ``IPluginCreatorV3One`` class for a spec *given a TensorRT module* (full ``tensorrt`` in production;
  the tests pass ``tensorrt_rtx_bindings``, which has the same plugin base classes). :func:`register_tensorrt_plugins`
  registers every ``kimi`` creator with full TensorRT.

In-place state (KDA ``state``/``conv`` pools, MLA ``cache``): the op's outputs ``state_out``/``conv_out``/``cache_out``
alias the pool inputs. The plugins declare this through ``IPluginV3OneBuildV2.get_aliased_input`` where available, and
**the runtime binds the same device buffer to the pool input and its ``*_out`` output** so the update is copy-free.
If TensorRT ever hands ``enqueue`` two different buffers (e.g. during build-time timing), ``enqueue`` first copies the
input pool into the output buffer and updates that one, so the input is never written.

Plugins written in Python only live in the process that registered them: call :func:`register_tensorrt_plugins`
before ``Runtime.deserialize_cuda_engine`` and before parsing ONNX with the plugins (otherwise the parser inlines the
FunctionProto reference body, see docs/DESIGN.md and STACK.md §1c).

Known gap (CUDA graphs): ``enqueue`` launches the Triton kernels through torch on TensorRT's stream without
copies, but those kernels still allocate scratch through torch's caching allocator and the KDA/MLA prefill paths
read ``cu_seqlens`` on the host (a device sync), so an engine with these plugins is not yet CUDA-graph capturable.
Fix: plan scratch as the plugin workspace (``get_workspace_size``) and pass host-side sequence metadata as plugin
shape inputs (``tensorrt_plugin_shape_input_indices``).

TODO(aot): an AOT ``tensorrt.plugin`` form (``@trtp.register`` + ``@trtp.aot_impl``) is not offered. AOT embeds exactly
one precompiled PTX kernel per tactic with launch parameters as shape expressions and does not serialize attributes;
our ops (``plugins/<op>/kernels.py``) are sequences of several Triton launches plus torch glue (chunked KDA, paged MLA,
grouped MXFP4 MoE), so each would first have to become a single kernel with attributes as constexprs. It also cannot
be built or tested here: TensorRT-RTX has no ``add_plugin_v3``/QDP support and full TensorRT is not installable on
this machine or the H200 test image (STACK.md §0, §1b). Revisit once a kernel is single-launch.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

logger = logging.getLogger(__name__)

PLUGIN_NAMESPACE = "kimi"
PLUGIN_VERSION = "1"

# dtype classes of op inputs/outputs
ACT = "act"  # activation dtype: float32, bfloat16 or float16; every ACT tensor of one node has the same dtype
F32 = "f32"
I32 = "i32"
U8 = "u8"
ACT_DTYPES = ("float32", "bfloat16", "float16")
_CLASS_DTYPES = {ACT: ACT_DTYPES, F32: ("float32",), I32: ("int32",), U8: ("uint8",)}


@dataclasses.dataclass(frozen=True)
class AttrSpec:
    """One op attribute. ``kind`` is ``"int"`` (ONNX INT -> plugin field INT32) or ``"float"`` (FLOAT32).

    ``default`` of ``None`` means required."""

    name: str
    kind: str
    default: float | int | None = None


@dataclasses.dataclass(frozen=True)
class In:
    """Symbolic dim: dimension ``dim`` of input ``index``."""

    index: int
    dim: int


@dataclasses.dataclass(frozen=True)
class Like:
    """Output shape rule: same shape as input ``index``."""

    index: int


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Static description of one ``kimi`` op, shared by the TensorRT plugin and the CPU tests.

    inputs/outputs: ``(name, dtype_class)``; an output's class may also be ``("alias", i)`` meaning
    "same dtype and shape as input i, same buffer" (in-place pool update).
    shape_rule(attrs) -> one entry per output: :class:`Like` or a tuple of dims (``int`` or :class:`In`).
    kernel: ``"module:function"``; called as ``function(*inputs, **attrs)`` returning one tensor or a tuple
    (one per output, pools may be returned updated in place).
    """

    name: str
    inputs: tuple[tuple[str, Any], ...]
    outputs: tuple[tuple[str, Any], ...]
    attrs: tuple[AttrSpec, ...]
    shape_rule: Callable[[Mapping[str, Any]], Sequence[Any]]
    kernel: str

    @property
    def aliases(self) -> dict[int, int]:
        """``{output_index: input_index}`` for outputs that update an input in place."""
        return {o: cls[1] for o, (_, cls) in enumerate(self.outputs) if isinstance(cls, tuple)}

    @property
    def field_names(self) -> list[str]:
        return [a.name for a in self.attrs]


# ----------------------------------------------------------------------------------------------- fields (pure Python)
def fields_from_attrs(spec: OpSpec, attrs: Mapping[str, Any]) -> list[tuple[str, np.ndarray, str]]:
    """Attributes -> ``[(name, 1-element array, kind)]`` in spec order (int -> int32, float -> float32).

    Raises ValueError naming the attribute when it is missing without default, unknown, or an int >= 2**31."""
    unknown = set(attrs) - set(spec.field_names)
    if unknown:
        raise ValueError(f"{spec.name}: unknown attribute(s) {sorted(unknown)}; expected {spec.field_names}")
    out = []
    for a in spec.attrs:
        value = attrs.get(a.name, a.default)
        if value is None:
            raise ValueError(f"{spec.name}: attribute {a.name!r} is required (set it on the ONNX node)")
        if a.kind == "int":
            if int(value) != value or not -(2**31) <= int(value) < 2**31:
                raise ValueError(f"{spec.name}: attribute {a.name!r}={value!r} must be an int32 (TRT narrows INT to INT32)")
            out.append((a.name, np.array([int(value)], dtype=np.int32), "int"))
        else:
            out.append((a.name, np.array([float(value)], dtype=np.float32), "float"))
    return out


def attrs_from_fields(spec: OpSpec, fields: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``[(name, data)]`` (TensorRT PluginFields or :func:`fields_from_attrs` output) -> attribute dict.

    Unknown names are ignored (the ONNX parser only forwards declared names anyway); missing names take the
    default; a missing required attribute or empty data raises ValueError naming the field."""
    kinds = {a.name: a.kind for a in spec.attrs}
    got: dict[str, Any] = {}
    for name, data in fields:
        if name not in kinds:
            continue
        arr = np.asarray(data).reshape(-1)
        if arr.size < 1:
            raise ValueError(f"{spec.name}: plugin field {name!r} is empty; give it one value")
        got[name] = int(arr[0]) if kinds[name] == "int" else float(arr[0])
    for a in spec.attrs:
        if a.name not in got:
            if a.default is None:
                raise ValueError(f"{spec.name}: plugin field {a.name!r} is missing and has no default; "
                                 f"set attribute {a.name!r} on the ONNX node")
            got[a.name] = a.default
    return got


# ------------------------------------------------------------------------------------------ shapes / dtypes (pure)
def output_shapes(spec: OpSpec, attrs: Mapping[str, Any], input_shapes: Sequence[Sequence[Any]]) -> list[tuple]:
    """Evaluate the output-shape rule on concrete (int) or symbolic (str) input dims.

    Raises ValueError when an input the rule refers to is missing or has too few dims."""
    if len(input_shapes) != len(spec.inputs):
        raise ValueError(f"{spec.name}: expected {len(spec.inputs)} inputs, got {len(input_shapes)}")
    shapes = []
    for rule in spec.shape_rule(attrs):
        if isinstance(rule, Like):
            shapes.append(tuple(input_shapes[rule.index]))
            continue
        dims = []
        for d in rule:
            if isinstance(d, In):
                shp = input_shapes[d.index]
                if d.dim >= len(shp):
                    raise ValueError(f"{spec.name}: input {spec.inputs[d.index][0]!r} needs rank > {d.dim}, got {shp}")
                dims.append(shp[d.dim])
            else:
                dims.append(int(d))
        shapes.append(tuple(dims))
    return shapes


def _act_dtype(spec: OpSpec, dtypes: Sequence[str]) -> str | None:
    for i, (_, cls) in enumerate(spec.inputs):
        if cls == ACT and i < len(dtypes):
            return dtypes[i]
    return None


def output_dtypes(spec: OpSpec, input_dtypes: Sequence[str]) -> list[str]:
    """Output dtype names (``"float32"``, ``"bfloat16"``, ...) from input dtype names."""
    act = _act_dtype(spec, input_dtypes)
    out = []
    for _, cls in spec.outputs:
        if isinstance(cls, tuple):
            out.append(input_dtypes[cls[1]])
        elif cls == ACT:
            out.append(act)
        else:
            out.append(_CLASS_DTYPES[cls][0])
    return out


def supports_combination(spec: OpSpec, pos: int, dtypes: Sequence[str], formats_linear: Sequence[bool]) -> bool:
    """TensorRT's ``supports_format_combination`` as a pure function.

    pos indexes inputs then outputs; ``dtypes``/``formats_linear`` describe positions ``0..pos`` (later ones are
    ignored, as TensorRT only guarantees earlier positions are decided). Rules: LINEAR only; inputs/outputs
    match their dtype class; all ACT tensors share input 0's-act dtype; aliased outputs share their input's dtype."""
    if not formats_linear[pos]:
        return False
    n_in = len(spec.inputs)
    cls = spec.inputs[pos][1] if pos < n_in else spec.outputs[pos - n_in][1]
    dt = dtypes[pos]
    if isinstance(cls, tuple):  # aliased output
        return dt == dtypes[cls[1]]
    if dt not in _CLASS_DTYPES[cls]:
        return False
    if cls == ACT:
        act = _act_dtype(spec, dtypes[: min(pos + 1, n_in)])
        return act is None or dt == act
    return True


# ------------------------------------------------------------------------------------------------ torch from pointer
_TYPESTR = {"float32": "<f4", "float16": "<f2", "bfloat16": "<i2", "int32": "<i4", "uint8": "|u1",
            "int64": "<i8", "int8": "|i1", "bool": "|b1"}


class _CudaBuffer:
    """Minimal ``__cuda_array_interface__`` (v3) view of a raw device pointer (no ownership, no sync)."""

    def __init__(self, ptr: int, shape: Sequence[int], typestr: str):
        self.__cuda_array_interface__ = {"shape": tuple(int(s) for s in shape), "typestr": typestr,
                                         "data": (int(ptr), False), "version": 3, "strides": None, "stream": None}


def tensor_from_ptr(ptr: int, shape: Sequence[int], dtype: str, device: int | None = None):
    """Wrap a contiguous device buffer as a torch tensor without copying.

    ptr: CUDA device pointer (int); shape: dims; dtype: name from :data:`_TYPESTR`.
    Returns a ``torch.Tensor`` on ``cuda:device`` (current device by default) that aliases the buffer; the caller keeps
    the memory alive. Zero-element tensors get a fresh empty tensor. Raises ValueError for unknown dtypes."""
    import torch

    if dtype not in _TYPESTR:
        raise ValueError(f"tensor_from_ptr: unsupported dtype {dtype!r}; known {sorted(_TYPESTR)}")
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    torch_dtype = getattr(torch, dtype)
    if int(np.prod(shape)) == 0 or ptr == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype, device=dev)
    t = torch.as_tensor(_CudaBuffer(ptr, shape, _TYPESTR[dtype]), device=dev)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def run_kernel(spec: OpSpec, attrs: Mapping[str, Any], inputs: list, outputs: list) -> None:
    """Call ``spec.kernel`` on torch tensors and leave results in ``outputs`` (device tensors, already on the right
    stream). Aliased pools are updated in the output buffer: when it differs from the input buffer the input is copied
    there first, so the input is never modified. When the kernel takes ``out=``, output 0 is passed so it is written in
    place. Works on CPU tensors too. Raises RuntimeError when the kernel returns a wrong output count."""
    module_name, fn_name = spec.kernel.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)  # lazy: kernels need triton + CUDA
    args = list(inputs)
    for o, i in spec.aliases.items():
        if outputs[o].data_ptr() != inputs[i].data_ptr():
            outputs[o].copy_(inputs[i])
        args[i] = outputs[o]
    kwargs = dict(attrs)
    if 0 not in spec.aliases and "out" in inspect.signature(fn).parameters:
        kwargs["out"] = outputs[0]
    result = fn(*args, **kwargs)
    result = result if isinstance(result, (tuple, list)) else (result,)
    if len(result) != len(outputs):
        raise RuntimeError(f"{spec.kernel} returned {len(result)} tensors, {spec.name} has {len(outputs)} outputs")
    for dst, src in zip(outputs, result):
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src.reshape(dst.shape))


# -------------------------------------------------------------------------------------------------- TensorRT adapters
def _dtype_maps(trt) -> tuple[dict, dict]:
    names = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "UINT8": "uint8",
             "INT64": "int64", "INT8": "int8", "BOOL": "bool"}
    to_name = {getattr(trt.DataType, k): v for k, v in names.items() if hasattr(trt.DataType, k)}
    return to_name, {v: k for k, v in to_name.items()}


_CLASS_CACHE: dict[tuple[str, int], tuple[type, type]] = {}


def make_plugin_classes(spec: OpSpec, trt) -> tuple[type, type]:
    """Build ``(PluginClass, CreatorClass)`` for ``spec`` on TensorRT module ``trt`` (``tensorrt`` or a module with the
    same plugin API, e.g. ``tensorrt_rtx_bindings``). Cached per (op, module). Nothing is registered here."""
    key = (spec.name, id(trt))
    if key in _CLASS_CACHE:
        return _CLASS_CACHE[key]
    to_name, from_name = _dtype_maps(trt)
    build_base = getattr(trt, "IPluginV3OneBuildV2", trt.IPluginV3OneBuild)  # V2 adds get_aliased_input
    bases = (trt.IPluginV3, trt.IPluginV3OneCore, build_base, trt.IPluginV3OneRuntime)
    field_types = {"int": trt.PluginFieldType.INT32, "float": trt.PluginFieldType.FLOAT32}

    class Plugin(*bases):
        def __init__(self, attrs: Mapping[str, Any]):
            for base in bases:
                base.__init__(self)
            self.plugin_name = spec.name
            self.plugin_namespace = PLUGIN_NAMESPACE
            self.plugin_version = PLUGIN_VERSION
            self.num_outputs = len(spec.outputs)
            self.attrs = dict(attrs)

        # core
        def get_capability_interface(self, kind):
            return self

        def clone(self):
            c = Plugin(self.attrs)
            c.__dict__.update(self.__dict__)
            c.attrs = dict(self.attrs)
            return c

        # build
        def get_output_data_types(self, input_types):
            names = output_dtypes(spec, [to_name.get(t, str(t)) for t in input_types])
            return [from_name[n] for n in names]

        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            outs = []
            for rule in spec.shape_rule(self.attrs):
                if isinstance(rule, Like):
                    outs.append(trt.DimsExprs(inputs[rule.index]))
                    continue
                d = trt.DimsExprs(len(rule))
                for j, dim in enumerate(rule):
                    d[j] = inputs[dim.index][dim.dim] if isinstance(dim, In) else expr_builder.constant(int(dim))
                outs.append(d)
            return outs

        def supports_format_combination(self, pos, in_out, num_inputs):
            descs = [in_out[i].desc for i in range(pos + 1)]
            return supports_combination(spec, pos, [to_name.get(d.type, str(d.type)) for d in descs],
                                        [d.format == trt.TensorFormat.LINEAR for d in descs])

        def get_aliased_input(self, output_index):
            return spec.aliases.get(int(output_index), -1)

        def configure_plugin(self, inp, out):
            pass

        def get_workspace_size(self, input_desc, output_desc):
            return 0

        def get_valid_tactics(self):
            return []

        def set_tactic(self, tactic):
            pass

        # runtime
        def on_shape_change(self, inp, out):
            pass

        def attach_to_context(self, context):
            return self.clone()

        def get_fields_to_serialize(self):
            # PluginField does not own its numpy buffer: keep arrays (and the collection) alive on the plugin
            self._field_arrays = fields_from_attrs(spec, self.attrs)
            self._field_collection = trt.PluginFieldCollection(
                [trt.PluginField(n, a, field_types[k]) for n, a, k in self._field_arrays])
            return self._field_collection

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            import torch

            def wrap(desc, ptr):
                return tensor_from_ptr(ptr, tuple(desc.dims), to_name[desc.type])

            with torch.cuda.stream(torch.cuda.ExternalStream(int(stream))):
                ins = [wrap(d, p) for d, p in zip(input_desc, inputs)]
                outs = [wrap(d, p) for d, p in zip(output_desc, outputs)]
                run_kernel(spec, self.attrs, ins, outs)
            return 0

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name = spec.name
            self.plugin_namespace = PLUGIN_NAMESPACE
            self.plugin_version = PLUGIN_VERSION
            self._empty = [np.array([], dtype=np.int32 if a.kind == "int" else np.float32) for a in spec.attrs]
            self.field_names = trt.PluginFieldCollection(
                [trt.PluginField(a.name, e, field_types[a.kind]) for a, e in zip(spec.attrs, self._empty)])

        def create_plugin(self, name, fc, phase):
            return Plugin(attrs_from_fields(spec, [(f.name, f.data) for f in fc]))

    Plugin.__name__ = Plugin.__qualname__ = f"{spec.name}Plugin"
    Creator.__name__ = Creator.__qualname__ = f"{spec.name}PluginCreator"
    _CLASS_CACHE[key] = (Plugin, Creator)
    return Plugin, Creator


def all_specs() -> list[OpSpec]:
    """Every ``kimi`` op spec (KdaPrefill, KdaDecode, MlaPrefill, MlaDecode, Mxfp4Moe)."""
    from plugins.kda import trt as kda
    from plugins.mla import trt as mla
    from plugins.moe import trt as moe

    return [kda.KDA_PREFILL, kda.KDA_DECODE, mla.MLA_PREFILL, mla.MLA_DECODE, moe.MXFP4_MOE]


_REGISTERED: dict[int, list] = {}


def register_tensorrt_plugins(trt=None) -> list[str]:
    """Register every ``kimi`` plugin creator with TensorRT's plugin registry (idempotent per module).

    trt: TensorRT module; default ``import tensorrt`` (full TensorRT). Call before parsing ONNX with plugins and before
    deserializing engines that contain them. Returns ``["kimi::KdaPrefill", ...]``.
    Raises ImportError (with the install hint) when TensorRT is missing. Do not use with ``tensorrt_rtx_bindings`` in
    a process that then parses ONNX: TensorRT-RTX's parser aborts the process on Python creators (STACK.md §1a)."""
    if trt is None:
        try:
            import tensorrt as trt
        except ImportError as e:
            raise ImportError("register_tensorrt_plugins needs full TensorRT: pip install tensorrt") from e
    if id(trt) not in _REGISTERED:
        registry = trt.get_plugin_registry()
        creators = []
        for spec in all_specs():
            creator = make_plugin_classes(spec, trt)[1]()
            if not registry.register_creator(creator, PLUGIN_NAMESPACE):
                raise RuntimeError(f"TensorRT refused to register {PLUGIN_NAMESPACE}::{spec.name}")
            creators.append(creator)  # keep Python objects alive as long as the registry uses them
        _REGISTERED[id(trt)] = creators
        logger.info("registered %d kimi TensorRT plugin creators", len(creators))
    return [f"{PLUGIN_NAMESPACE}::{c.name}" for c in _REGISTERED[id(trt)]]
