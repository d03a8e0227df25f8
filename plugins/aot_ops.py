"""Table-driven ahead-of-time ops: an op that is several kernel launches becomes a chain of single-launch
``tensorrt.plugin`` ops (QDP with ``@trtp.aot_impl``, TensorRT >= 10.9), one :class:`KernelOp` each, and the
``--aot`` build rewrites the op's ONNX node into that chain (its scratch becomes tensors TensorRT allocates between
the launches). Users: plugins/kda/trt_aot_prefill.py (``kimi::KdaPrefill``, nine launches) and
plugins/mla/trt_aot_prefill.py (``kimi::MlaPrefill``, four launches). The hand-written single ops (KdaDecode,
MlaDecode, the four MoE ops) predate this table and keep their modules.

A :class:`KernelOp` names its entry kernel's parameters in TensorRT's AOT order (input pointers, int32 extra
arguments, output pointers; STACK.md §1b), the node attributes it compiles in, and three rules evaluated on input
dims that are ints (tests, the torch executor :func:`run_op`) or TensorRT shape expressions (the QDP): output
shapes (or the input an output aliases), the launch grid and extra arguments, the constexprs (these need static
dims: :func:`static_int`). Pointer dtype classes (plugins/aot_common.py :func:`~plugins.aot_common.entry_signature`):
``act`` (the op's activation dtype), ``y`` (the compute dtype of the chunked KDA kernels: bf16 where activations are
fp32, as plugins/kda/kernels.py does), ``f32``, ``i32``, ``u8``.

Aliasing rule the rewrites follow: a tensor an op writes in place (declared by an output that aliases an input) has
that op as its only consumer, and later ops read the aliasing output; so TensorRT's data dependencies order every
in-place write after all reads of the old contents.

:func:`define_qdp` registers a table with ``tensorrt.plugin`` (register + autotune + aot_impl; these ops have no JIT
``@trtp.impl``: only the rewrite creates them). Pure parts run on a CPU machine: the rules, :func:`compile_op`
(Triton compiles for ``sm_90`` without a GPU), :func:`run_op` under the Triton interpreter.
"""
# no `from __future__ import annotations`: tensorrt.plugin reads the QDP functions' annotations as objects

import dataclasses
import functools
import inspect
from typing import Any, Callable, Tuple

import numpy as np

from k3deploy.plugins.aot_common import ACT_NAMES, TRT_TYPE_NAMES, compile_entry, register_qdp, scalar

POINTER_CLASSES = ("act", "y", "f32", "i32", "u8")


@dataclasses.dataclass(frozen=True)
class KernelOp:
    """One single-launch AOT op (module docstring).

    op_id: ``"kimi::Name"``; entry: the Triton entry kernel (None without Triton); inputs / extra / outputs:
    ``(name, class)`` in the entry's parameter order (extra classes are ``"i32"``); attrs: ``(name, int | float)``
    node attributes (compiled in, so also the QDP's attribute parameters, in this order); shapes(dims, attrs, cdiv)
    -> per output a dims tuple or the name of the input it aliases; launch(dims, attrs, cdiv) -> ((gx, gy, gz),
    [extra values]); constexprs(dims, attrs) -> the entry's constexpr values. ``dims`` maps input names to dims
    tuples (ints or shape expressions), ``attrs`` attribute names to Python scalars, ``cdiv`` is ceiling division
    on those dims."""
    op_id: str
    entry: Any
    inputs: tuple
    extra: tuple
    outputs: tuple
    attrs: tuple
    shapes: Callable
    launch: Callable
    constexprs: Callable
    num_warps: int = 4
    num_stages: Any = None          # an int, None (Triton's default) or a function of the attributes

    @property
    def name(self) -> str:
        return self.op_id.split("::")[1]

    def stages(self, attrs: dict):
        """Software-pipelining stages for an op instance with ``attrs``."""
        return self.num_stages(attrs) if callable(self.num_stages) else self.num_stages


def int_cdiv(a, b):
    """Ceiling division of ints (the ``cdiv`` of the rules outside TensorRT)."""
    return -(-a // b)


def static_int(expr, what: str) -> int:
    """A dim that must be a build-time constant (a width, a head count) as an int: ints pass; a TensorRT shape
    expression must be constant (``is_constant`` property, ``constant_value()`` method). Raises ValueError naming
    ``what`` otherwise."""
    if isinstance(expr, (int, np.integer)):
        return int(expr)
    try:
        if expr.is_constant:
            return int(expr.constant_value())
    except (AttributeError, RuntimeError):
        pass
    raise ValueError(f"AOT: {what} must be static (a constant dimension of the engine's profiles)")


def _y_name(act: str) -> str:
    return "bfloat16" if act == "float32" else act


def pointer_dtype(cls: str, act: str) -> str:
    """dtype name of a pointer of class ``cls`` for activation dtype ``act``."""
    return {"act": act, "y": _y_name(act), "f32": "float32", "i32": "int32", "u8": "uint8"}[cls]


def signature(op: KernelOp, act: str) -> dict[str, str]:
    """Triton signature of ``op``'s entry kernel for activation dtype ``act`` (constexprs named by the caller are
    appended by :func:`compile_op`). Raises ValueError for an ``act`` not in ACT_NAMES."""
    if act not in ACT_NAMES:
        raise ValueError(f"{op.op_id} AOT: activation dtype {act!r} not in {ACT_NAMES}")
    tt = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int32": "*i32", "uint8": "*u8"}
    sig = {n: tt[pointer_dtype(c, act)] for n, c in op.inputs}
    sig.update({n: c for n, c in op.extra})
    sig.update({n: tt[pointer_dtype(c, act)] for n, c in op.outputs})
    return sig


def autotune_types(op: KernelOp) -> str:
    """``AutoTuneCombination`` string of ``op``'s inputs then outputs: one combination per activation dtype
    (FP32, FP16, BF16); an op without ``act`` pointers is keyed by its ``y`` pointers (FP16, BF16)."""
    ptrs = op.inputs + op.outputs
    acts = ACT_NAMES if any(c == "act" for _, c in ptrs) else ("float16", "bfloat16")
    trt = {**TRT_TYPE_NAMES, "int32": "INT32", "uint8": "UINT8"}
    return ", ".join("|".join(trt[pointer_dtype(c, a)] for a in acts) for _, c in ptrs)


def op_act(op: KernelOp, dtypes: dict) -> str:
    """The activation dtype name of an op instance from its inputs' dtype names (``dtypes``: input name -> name):
    that of the first ``act`` input, else of the first ``y`` input."""
    for cls in ("act", "y"):
        for n, c in op.inputs:
            if c == cls:
                return dtypes[n]
    raise ValueError(f"{op.op_id}: no activation input")


@functools.lru_cache(maxsize=None)
def _compile_cached(op, act, consts, stages, target, ptx_version):
    # the table's names need not be the entry's parameter names: map them by position
    sig = dict(zip(op.entry.arg_names, signature(op, act).values()))
    sig.update({k: "constexpr" for k, _ in consts})
    return compile_entry(op.entry, sig, dict(consts), num_warps=op.num_warps, num_stages=stages,
                         n_args=len(op.inputs) + len(op.extra) + len(op.outputs), what=op.op_id, target=target,
                         ptx_version=ptx_version)


def compile_op(op: KernelOp, act: str, dims: dict, attrs: dict, target=None, ptx_version=None) -> tuple:
    """Compile ``op``'s entry for activation dtype ``act`` with the constexprs of (``dims``, ``attrs``):
    ``(kernel name, PTX, num_warps, static shared bytes)`` (plugins/aot_common.compile_entry; cached).
    RuntimeError without Triton; ValueError for a non-static dim the constexprs need."""
    if op.entry is None:
        raise RuntimeError(f"{op.op_id} AOT needs Triton (pip install triton)")
    consts = tuple(op.constexprs(dims, attrs).items())
    return _compile_cached(op, act, consts, op.stages(attrs), target, ptx_version)


def _torch_dtypes():
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32,
            "uint8": torch.uint8}


def tensor_dims(op: KernelOp, tensors: dict) -> dict:
    """Input name -> dims tuple (ints) of concrete torch ``tensors`` (the rules' ``dims``)."""
    return {n: tuple(int(d) for d in tensors[n].shape) for n, _ in op.inputs}


def tensor_act(op: KernelOp, tensors: dict) -> str:
    """:func:`op_act` of concrete torch ``tensors``: the activation dtype name. KeyError for an unsupported dtype."""
    names = {v: k for k, v in _torch_dtypes().items()}
    return op_act(op, {n: names[tensors[n].dtype] for n, _ in op.inputs})


def allocate_outputs(op: KernelOp, tensors: dict, attrs: dict, y_dtype=None, fill=None) -> dict:
    """``op``'s outputs for the input tensors ``tensors`` (name -> dense torch tensor): an aliasing output is its
    input tensor; a new one ``torch.empty`` of the rule's shape and the class dtype (``y_dtype`` overrides class
    ``y``: the interpreter cannot run bf16 dots), filled with ``fill`` when given (tests poison with NaN)."""
    import torch

    dt = _torch_dtypes()
    act = tensor_act(op, tensors)
    outs = {}
    for (name, cls), shape in zip(op.outputs, op.shapes(tensor_dims(op, tensors), attrs, int_cdiv)):
        if isinstance(shape, str):
            outs[name] = tensors[shape]
            continue
        d = y_dtype if (cls == "y" and y_dtype is not None) else dt[pointer_dtype(cls, act)]
        outs[name] = torch.empty(shape, dtype=d, device=tensors[op.inputs[0][0]].device)
        if fill is not None:
            outs[name].fill_(fill if d.is_floating_point else -1)
    return outs


def kernel_args(op: KernelOp, tensors: dict, outs: dict, attrs: dict) -> tuple[tuple, list]:
    """For concrete tensors (``tensors``: input name -> dense torch tensor, ``outs``: output name -> tensor, as from
    :func:`allocate_outputs`): ``((gx, gy, gz) ints, [input tensors, int extras, output tensors])`` in TensorRT's
    AOT parameter order."""
    grid, extra = op.launch(tensor_dims(op, tensors), attrs, int_cdiv)
    args = [tensors[n] for n, _ in op.inputs] + [int(e) for e in extra] + [outs[n] for n, _ in op.outputs]
    return tuple(int(g) for g in grid), args


def run_op(op: KernelOp, tensors: dict, attrs: dict, y_dtype=None, fill=None) -> dict:
    """Launch ``op``'s entry kernel through Triton's JIT (the GPU, or the interpreter with ``TRITON_INTERPRET=1``) on
    ``tensors`` (input name -> dense torch tensor); returns output name -> tensor (:func:`allocate_outputs`; an
    aliasing output is written in place). A grid with a zero dimension (no tokens) launches nothing."""
    outs = allocate_outputs(op, tensors, attrs, y_dtype, fill)
    grid, args = kernel_args(op, tensors, outs, attrs)
    if all(grid):
        stages = op.stages(attrs)
        op.entry[grid](*args, **op.constexprs(tensor_dims(op, tensors), attrs), num_warps=op.num_warps,
                       **({"num_stages": stages} if stages else {}))
    return outs


def run_nodes(nodes, env: dict, ops, run: Callable = run_op, **kw) -> dict:
    """Execute rewritten ONNX ``nodes`` in order without TensorRT: each node's op (``ops``: op type -> KernelOp) runs
    through ``run(op, inputs, attrs, **kw)`` (default :func:`run_op`); ``env`` maps tensor names to torch tensors and
    receives the outputs. Returns ``env``. What tests use to check a rewrite against the op's reference."""
    from onnx import helper

    for node in nodes:
        op = ops[node.op_type]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in dict(op.attrs)}
        res = run(op, {n: env[i] for (n, _), i in zip(op.inputs, node.input)}, attrs, **kw)
        env.update({o: res[n] for (n, _), o in zip(op.outputs, node.output)})
    return env


# --------------------------------------------------------------------------------------------- the QDP glue
def _attr_values(op: KernelOp, values) -> dict:
    return {n: t(scalar(v)) for (n, t), v in zip(op.attrs, values)}


def define_qdp(trt, trtp, ops) -> None:
    """Register every :class:`KernelOp` of ``ops`` with ``tensorrt.plugin``: ``@trtp.register`` (output descs:
    shapes from the rule, dtypes from the classes, aliases through ``TensorDesc.aliased()``), ``@trtp.autotune``
    (:func:`autotune_types`) and ``@trtp.aot_impl`` (:func:`compile_op`, launch parameters and ``SymInt32`` extras
    from the rule, grids as shape expressions with ``trtp.cdiv``). The functions' signatures are built from the
    table (``__signature__``), as tensorrt.plugin reads parameters and annotations through ``inspect``. At build
    time the registered functions raise ValueError for a dim a rule needs static that is not (:func:`static_int`)."""
    import numpy.typing as npt

    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16", trt.int32: "int32"}
    trt_dt = {"float32": trt.float32, "float16": trt.float16, "bfloat16": trt.bfloat16, "int32": trt.int32}
    if hasattr(trt, "uint8"):
        names[trt.uint8], trt_dt["uint8"] = "uint8", trt.uint8
    TD = trtp.TensorDesc
    ann = {int: npt.NDArray[np.int32], float: npt.NDArray[np.float32]}
    P = inspect.Parameter

    def params(op, with_attrs):
        ps = [P(n, P.POSITIONAL_OR_KEYWORD, annotation=TD) for n, _ in op.inputs]
        if with_attrs:
            ps += [P(n, P.POSITIONAL_OR_KEYWORD, annotation=ann[t]) for n, t in op.attrs]
        return ps

    def cdiv(a, b):
        return int_cdiv(int(a), int(b)) if isinstance(a, (int, np.integer)) else trtp.cdiv(a, b)

    for op in ops:
        def desc(*args, _op=op):
            ins = dict(zip((n for n, _ in _op.inputs), args))
            attrs = _attr_values(_op, args[len(_op.inputs):])
            act = op_act(_op, {n: names[d.dtype] for n, d in ins.items()})
            outs = []
            for (name, cls), shape in zip(_op.outputs, _op.shapes({n: d.shape_expr for n, d in ins.items()},
                                                                  attrs, cdiv)):
                outs.append(ins[shape].aliased() if isinstance(shape, str)
                            else trtp.from_shape_expr(tuple(shape), dtype=trt_dt[pointer_dtype(cls, act)]))
            return tuple(outs) if len(outs) > 1 else outs[0]

        ret = Tuple[tuple(TD for _ in op.outputs)] if len(op.outputs) > 1 else TD
        desc.__signature__ = inspect.Signature(params(op, True), return_annotation=ret)
        desc.__annotations__ = {**{p.name: p.annotation for p in params(op, True)}, "return": ret}
        trtp.register(op.op_id)(desc)

        def tune(*args, _op=op):
            return [trtp.AutoTuneCombination(autotune_types(_op))]

        tune.__signature__ = inspect.Signature(params(op, False) + [P("outputs", P.POSITIONAL_OR_KEYWORD)])
        trtp.autotune(op.op_id)(tune)

        def aot(*args, _op=op):
            ins = dict(zip((n for n, _ in _op.inputs), args))
            attrs = _attr_values(_op, args[len(_op.inputs):len(_op.inputs) + len(_op.attrs)])
            dims = {n: d.shape_expr for n, d in ins.items()}
            act = op_act(_op, {n: names[d.dtype] for n, d in ins.items()})
            kname, ptx, warps, shared = compile_op(_op, act, dims, attrs)
            grid, extra = _op.launch(dims, attrs, cdiv)
            lp = trtp.KernelLaunchParams()
            for key, value in zip(("grid_x", "grid_y", "grid_z"), grid):
                setattr(lp, key, value)
            lp.block_x, lp.block_y, lp.block_z, lp.shared_mem = 32 * warps, 1, 1, shared
            return (kname.encode(), ptx.encode(), lp,
                    trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in extra]))

        aot.__signature__ = inspect.Signature(params(op, True) + [P("outputs", P.POSITIONAL_OR_KEYWORD),
                                                                  P("tactic", P.POSITIONAL_OR_KEYWORD)])
        trtp.aot_impl(op.op_id)(aot)


def register_table(done: list, ops: dict) -> list[str]:
    """Register a module's table of KernelOps (``ops``: key -> KernelOp) with tensorrt.plugin once
    (plugins/aot_common.register_qdp + :func:`define_qdp`). Returns their op ids, or ``[]`` where an entry kernel is
    missing (no Triton, or fla-core for KdaPrefill) or tensorrt.plugin has no ``aot_impl``."""
    table = list(ops.values())
    entry = table[0].entry if all(op.entry is not None for op in table) else None
    return register_qdp(done, entry, tuple(op.op_id for op in table),
                        lambda trt, trtp: define_qdp(trt, trtp, table))


# ------------------------------------------------------------------------------------------ the ONNX rewrite
def replace_nodes(model, op_type: str, expand: Callable) -> int:
    """Replace every top-level node of domain ``kimi`` and type ``op_type`` of ``model`` (onnx.ModelProto, in place)
    by ``expand(node, attrs)``'s nodes, in the node's place (topological order kept); the ``kimi`` opset is added
    when missing. Returns how many nodes were replaced. ``expand`` raises ValueError for a node it cannot lower."""
    import onnx
    from onnx import helper

    g = model.graph
    new_nodes, n = [], 0
    for node in g.node:
        if node.domain != "kimi" or node.op_type != op_type:
            new_nodes.append(node)
            continue
        new_nodes += expand(node, {a.name: helper.get_attribute_value(a) for a in node.attribute})
        n += 1
    if n:
        del g.node[:]
        g.node.extend(new_nodes)
        if not any(o.domain == "kimi" for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid("kimi", 1))
    return n


def make_aot_node(op: KernelOp, inputs, outputs, name: str, attrs: dict):
    """An ONNX node for ``op`` (domain ``kimi``, ``plugin_namespace``/``plugin_version``, ``aot=1``) with the
    attributes ``op`` declares taken from ``attrs`` (a missing one raises KeyError)."""
    from onnx import helper

    vals = {n: t(attrs[n]) for n, t in op.attrs}
    return helper.make_node(op.name, list(inputs), list(outputs), name=name, domain="kimi", plugin_namespace="kimi",
                            plugin_version="1", aot=1, **vals)
