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

CUDA graphs. ``enqueue`` wraps TensorRT's pointers as torch tensors (:func:`tensor_from_ptr`, no copies), runs
the op's kernels on TensorRT's stream (``torch.cuda.ExternalStream``) and hands the kernel ``workspace=``: a uint8 view
of TensorRT's workspace, sized by the spec's workspace rule (:func:`workspace_size`; ``get_workspace_size`` evaluates
it on the profile's max dims, ``enqueue`` on the actual dims, which needs no more). With it, per op:

* ``KdaDecode``, ``MlaDecode``, ``Mxfp4Moe``, ``MlaPrefill`` (the plugin passes ``graph_safe=True``: the absorbed Triton
  path, not the eager SDPA one): only Triton launches with grids fixed by the shapes, all scratch carved from the
  workspace, no host reads of device data, no allocation, no synchronization; aliased pools are updated in place.
  (Inputs must be dense, int32 metadata, one activation dtype: what the format rules below guarantee; otherwise a
  kernel converts, which allocates.)
* ``KdaPrefill`` (``graph_safe=True``): our launches (token map, conv, conv history, state gather/scatter, gated
  RMSNorm) as above, and fla-core's ``chunk_kda(use_graph=True, max_num_seqs=N)``: chunk indices built on the device
  with a fixed shape, no host sync. fla still allocates its intermediates (gates, WY factors, chunk states, output,
  final state, chunk indices) through torch's caching allocator: fine inside ``torch.cuda.graph`` (private pool), but
  inside a capture that torch does not know about (TensorRT capturing the engine) those blocks return to the
  allocator after ``enqueue`` while the graph still uses them. So a KdaPrefill engine can only be captured through
  torch (``torch.cuda.graph`` around ``execute_async_v3`` on the capturing stream, so these allocations land in the
  graph's pool; not verified with TensorRT), never by a capture torch does not see.
* First calls are not capture-safe for any op: they JIT-compile the Triton kernels (and fla autotunes, benchmarking
  with syncs). Run one ``execute_async_v3`` per shape before capturing (STACK.md §7.1). TensorRT's build-time timing
  enqueues eagerly, which usually does this warm-up.
* ``enqueue`` itself is Python (GIL, launch-config arithmetic on the host); a captured graph replays without it.

Verified: CPU interpreter tests (tests/plugins/test_graph_safe.py: kernels vs references, workspace bounds and guards,
rules); the ``torch.cuda.CUDAGraph`` capture/replay tests there are for the H200. No TensorRT engine with these
plugins has run (full TensorRT is not installable here nor on the H200 image).

Ahead of time: ``kimi::KdaDecode`` and ``kimi::MlaDecode`` also exist as ``tensorrt.plugin`` QDPs with
``@trtp.aot_impl`` (TensorRT >= 10.9; plugins/kda/trt_aot.py, plugins/mla/trt_aot.py, helpers in
plugins/aot_common.py): one Triton kernel each, compiled to PTX, baked into the engine, no Python at runtime; choose
them with ``register_tensorrt_plugins(aot=True)``. ``kimi::Mxfp4Moe``, ``kimi::KdaPrefill`` and ``kimi::MlaPrefill`` are
several launches each, and an AOT plugin is exactly one precompiled kernel, so their AOT forms are chains of
single-launch ops that the ``--aot`` build rewrites their nodes into (plugins/moe/trt_aot.py,
plugins/kda/trt_aot_prefill.py, plugins/mla/trt_aot_prefill.py; table and glue: plugins/aot_ops.py).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import logging
import operator
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

    ``default`` of ``None`` means required; ``minimum``: the smallest value the op accepts (None = any)."""

    name: str
    kind: str
    default: float | int | None = None
    minimum: float | int | None = None


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
    workspace: ``rule(attrs, input_shapes, input_dtypes) -> bytes`` on concrete dims (the kernel module's
    ``*_workspace_bytes``; an upper bound for every smaller problem); None = no scratch. Evaluate it through
    :func:`workspace_size` (symbolic dims too). The plugin asks for it in ``get_workspace_size`` (profile max dims) and
    hands the kernel ``workspace=`` (a uint8 view of TensorRT's workspace) in ``enqueue``.
    kernel_options: extra keyword arguments the plugin passes to the kernel (e.g. ``graph_safe=True``), only those
    the kernel's signature accepts.
    """

    name: str
    inputs: tuple[tuple[str, Any], ...]
    outputs: tuple[tuple[str, Any], ...]
    attrs: tuple[AttrSpec, ...]
    shape_rule: Callable[[Mapping[str, Any]], Sequence[Any]]
    kernel: str
    workspace: Callable[[Mapping[str, Any], Sequence[Sequence[int]], Sequence[str]], int] | None = None
    kernel_options: tuple[tuple[str, Any], ...] = ()

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

    Raises ValueError naming the attribute when it is missing without default, unknown, an int >= 2**31, or below
    its ``minimum``."""
    unknown = set(attrs) - set(spec.field_names)
    if unknown:
        raise ValueError(f"{spec.name}: unknown attribute(s) {sorted(unknown)}; expected {spec.field_names}")
    out = []
    for a in spec.attrs:
        value = attrs.get(a.name, a.default)
        if value is None:
            raise ValueError(f"{spec.name}: attribute {a.name!r} is required (set it on the ONNX node)")
        _check_minimum(spec, a, value)
        if a.kind == "int":
            if int(value) != value or not -(2**31) <= int(value) < 2**31:
                raise ValueError(f"{spec.name}: attribute {a.name!r}={value!r} must be an int32 (TRT narrows INT to INT32)")
            out.append((a.name, np.array([int(value)], dtype=np.int32), "int"))
        else:
            out.append((a.name, np.array([float(value)], dtype=np.float32), "float"))
    return out


def _check_minimum(spec: OpSpec, a: AttrSpec, value) -> None:
    if a.minimum is not None and value < a.minimum:
        raise ValueError(f"{spec.name}: attribute {a.name!r}={value!r} is below its minimum {a.minimum}; fix it on the "
                         "ONNX node")


def attrs_from_fields(spec: OpSpec, fields: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``[(name, data)]`` (TensorRT PluginFields or :func:`fields_from_attrs` output) -> attribute dict.

    Unknown names are ignored (the ONNX parser only forwards declared names anyway); missing names take the
    default; a missing required attribute, empty data or a value below its ``minimum`` raises ValueError naming the
    field."""
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
        _check_minimum(spec, a, got[a.name])
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


# ------------------------------------------------------------------------------------------------- workspace (pure)
def torch_dtype(name: str):
    """torch dtype of a dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    import torch

    return getattr(torch, name)


_DEFAULT_DTYPES = {ACT: "bfloat16", F32: "float32", I32: "int32", U8: "uint8"}


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def eval_dim(expr: str, values: Mapping[str, int]) -> int:
    """Evaluate a symbolic dim (an ONNX dim_param such as ``"T"``, ``"N + 1"``, ``"2*S"``: names, ints, + - * //)
    with integer ``values``. Used for engine profiles (engines/build.py) and plugin workspace sizes.

    Raises KeyError naming the missing dim and ValueError for unsupported syntax."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in values:
                raise KeyError(node.id)
            return int(values[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported dim expression {expr!r}")

    try:
        tree = ast.parse(str(expr).strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"unsupported dim expression {expr!r}") from e
    return ev(tree)


def _eval_dim(expr: Any, dims: Mapping[str, int] | None, op: str) -> int:
    """A concrete, non-negative dim from an int or a symbolic dim (see :func:`eval_dim`). ValueError naming `op`
    for a dim without a value, bad syntax or a negative result."""
    if isinstance(expr, (int, np.integer)):
        value = int(expr)
    else:
        try:
            value = eval_dim(expr, dims or {})
        except KeyError as e:
            raise ValueError(f"{op}: symbolic dim {e.args[0]!r} has no value; pass dims={{{e.args[0]!r}: max}}") from None
        except ValueError as e:
            raise ValueError(f"{op}: {e} (names, ints, + - * // only)") from None
    if value < 0:
        raise ValueError(f"{op}: dim {expr!r} = {value} is negative; use the profile's max dims")
    return value


def workspace_size(spec: OpSpec, attrs: Mapping[str, Any], input_shapes: Sequence[Sequence[Any]],
                   input_dtypes: Sequence[str] | None = None, dims: Mapping[str, int] | None = None) -> int:
    """Workspace bytes of ``spec`` for the given input shapes (what ``get_workspace_size`` returns for the max dims).

    input_shapes: concrete ints or symbolic dims (names / expressions of names, resolved through ``dims``, e.g. the
    profile maxima ``{"T": 256, "N": 8}``); input_dtypes: dtype names (default: bf16 activations, the class dtype
    otherwise). Returns 0 for specs without a workspace rule. Raises ValueError for a wrong input count, an unknown
    symbolic dim or a negative dim."""
    if len(input_shapes) != len(spec.inputs):
        raise ValueError(f"{spec.name}: expected {len(spec.inputs)} inputs, got {len(input_shapes)}")
    if spec.workspace is None:
        return 0
    shapes = [tuple(_eval_dim(d, dims, spec.name) for d in shp) for shp in input_shapes]
    if input_dtypes is None:
        input_dtypes = [_DEFAULT_DTYPES[cls] for _, cls in spec.inputs]
    full = {a.name: a.default for a in spec.attrs}
    full.update(attrs)
    return int(spec.workspace(full, shapes, list(input_dtypes)))


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


def run_kernel(spec: OpSpec, attrs: Mapping[str, Any], inputs: list, outputs: list, workspace=None) -> None:
    """Call ``spec.kernel`` on torch tensors and leave results in ``outputs`` (device tensors, already on the right
    stream). Aliased pools are updated in the output buffer: when it differs from the input buffer the input is copied
    there first, so the input is never modified. When the kernel takes ``out=``, output 0 is passed so it is written in
    place; ``workspace`` (uint8 tensor) is passed as ``workspace=`` and ``spec.kernel_options`` as keywords when the
    kernel accepts them. Works on CPU tensors too. Raises RuntimeError when the kernel returns a wrong output count."""
    module_name, fn_name = spec.kernel.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)  # lazy: kernels need triton + CUDA
    args = list(inputs)
    for o, i in spec.aliases.items():
        if outputs[o].data_ptr() != inputs[i].data_ptr():
            outputs[o].copy_(inputs[i])
        args[i] = outputs[o]
    kwargs = dict(attrs)
    params = inspect.signature(fn).parameters
    if 0 not in spec.aliases and "out" in params:
        kwargs["out"] = outputs[0]
    kwargs.update({k: v for k, v in spec.kernel_options if k in params})
    if workspace is not None and "workspace" in params:
        kwargs["workspace"] = workspace
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
            # profile max dims -> bytes; the kernel carves its scratch out of it (plugins/workspace.py)
            if spec.workspace is None or len(input_desc) != len(spec.inputs):
                return 0
            return workspace_size(spec, self.attrs, [tuple(int(x) for x in d.max) for d in input_desc],
                                  [to_name.get(d.desc.type, "float32") for d in input_desc])

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
                ws = None
                if spec.workspace is not None and int(workspace):
                    # bytes for the actual dims (<= what get_workspace_size gave for the max dims)
                    n = workspace_size(spec, self.attrs, [tuple(d.dims) for d in input_desc],
                                       [to_name[d.type] for d in input_desc])
                    ws = tensor_from_ptr(int(workspace), (n,), "uint8") if n else None
                run_kernel(spec, self.attrs, ins, outs, workspace=ws)
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
    from k3deploy.plugins.kda import trt as kda
    from k3deploy.plugins.mla import trt as mla
    from k3deploy.plugins.moe import trt as moe

    return [kda.KDA_PREFILL, kda.KDA_DECODE, mla.MLA_PREFILL, mla.MLA_DECODE, moe.MXFP4_MOE]


_REGISTERED: dict[int, tuple[bool, list, list[str]]] = {}


def register_tensorrt_plugins(trt=None, aot: bool = False) -> list[str]:
    """Register every ``kimi`` plugin creator with TensorRT's plugin registry (idempotent per module).

    trt: TensorRT module; default ``import tensorrt`` (full TensorRT). Call before parsing ONNX with plugins and before
    deserializing engines that contain them. Returns ``["kimi::KdaPrefill", ...]`` in :func:`all_specs` order.
    aot: register ``kimi::KdaDecode`` and ``kimi::MlaDecode`` as ahead-of-time ``tensorrt.plugin`` QDPs
    (plugins/kda/trt_aot.py, plugins/mla/trt_aot.py: one Triton kernel each compiled to PTX and baked into the
    engine, no Python at runtime) instead of the Python IPluginV3s, and the single-launch ops that
    ``build_engines.py --aot`` rewrites ``kimi::Mxfp4Moe``, ``kimi::KdaPrefill`` and ``kimi::MlaPrefill`` into
    (plugins/moe/trt_aot.py, plugins/kda/trt_aot_prefill.py, plugins/mla/trt_aot_prefill.py); where
    ``tensorrt.plugin`` (TensorRT >= 10.9) or Triton is missing this logs a warning and registers the IPluginV3s.
    The choice is made once per process (a second call with the other ``aot`` raises RuntimeError).
    Raises ImportError (with the install hint) when TensorRT is missing. Do not use with ``tensorrt_rtx_bindings`` in
    a process that then parses ONNX: TensorRT-RTX's parser aborts the process on Python creators (STACK.md §1a)."""
    if trt is None:
        try:
            import tensorrt as trt
        except ImportError as e:
            raise ImportError("register_tensorrt_plugins needs full TensorRT: pip install tensorrt") from e
    if id(trt) in _REGISTERED and _REGISTERED[id(trt)][0] != bool(aot):
        raise RuntimeError(f"kimi plugins are already registered with aot={_REGISTERED[id(trt)][0]} in this process; "
                           "choose aot once, before the first registration")
    if id(trt) not in _REGISTERED:
        aot_names: list[str] = []
        if aot:
            from k3deploy.plugins.kda import trt_aot as kda_aot
            from k3deploy.plugins.mla import trt_aot as mla_aot
            from k3deploy.plugins.moe import trt_aot as moe_aot

            from k3deploy.plugins.kda import trt_aot_prefill as kda_pre
            from k3deploy.plugins.mla import trt_aot_prefill as mla_pre

            aot_names = kda_aot.register() + mla_aot.register()
            # new op names (MoeSortPairs, KdaConvBeta, MlaAbsorbQ, ...): the IPluginV3s of Mxfp4Moe, KdaPrefill and
            # MlaPrefill stay for graphs that were not rewritten
            for chain in (moe_aot, kda_pre, mla_pre):
                chain.register()
            if not aot_names:
                logger.warning("aot=True but tensorrt.plugin (TensorRT >= 10.9) with aot_impl, or Triton, is not "
                               "importable: every kimi op stays a JIT Python plugin")
        registry = trt.get_plugin_registry()
        creators, names = [], []
        for spec in all_specs():
            name = f"{PLUGIN_NAMESPACE}::{spec.name}"
            names.append(name)
            if name in aot_names:
                continue   # registered by tensorrt.plugin (QDP) under the same name/namespace/version
            creator = make_plugin_classes(spec, trt)[1]()
            if not registry.register_creator(creator, PLUGIN_NAMESPACE):
                raise RuntimeError(f"TensorRT refused to register {name}")
            creators.append(creator)  # keep Python objects alive as long as the registry uses them
        _REGISTERED[id(trt)] = (bool(aot), creators, names)
        logger.info("registered %d kimi TensorRT plugin creators (%s ahead of time)", len(names),
                    ", ".join(aot_names) or "none")
    return list(_REGISTERED[id(trt)][2])
