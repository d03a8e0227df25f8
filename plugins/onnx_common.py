"""Shared ONNX plumbing of the `kimi` custom ops (docs/DESIGN.md "Custom ops", docs/EXPORT_FORMAT.md).

Every custom op module `plugins/<op>/onnx.py` declares, per op:

* an `onnx.defs.OpSchema` (built with :func:`make_schema`; NOT registered globally) used by the dynamo exporter's
  translation function to emit one node in domain ``kimi`` (:func:`emit`), carrying the op attributes plus
  ``plugin_namespace="kimi"`` and ``plugin_version="1"``;
* an onnxscript function (the reference body) turned into a model-local ``FunctionProto`` by
  :func:`function_proto`, whose default-domain opset is :data:`OPSET` (it must equal the model's, or
  ``onnx.checker`` rejects the model).

:func:`attach_functions` adds the bodies of every ``kimi`` node type used by a model and the ``kimi`` opset import;
:func:`single_op_model` builds a one-node model (tests, Polygraphy). :func:`translation_table` maps the torch.library
ops (``torch.ops.kimi.*``, plugins/<op>/op.py) to their translation functions for ``torch.onnx.export(dynamo=True)``.

TensorRT note: INT attributes reach a plugin as INT32 (onnx-tensorrt ``loadFields``); every INT attribute here is
< 2^31.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Callable, Sequence

import onnx
import onnxscript
from onnx.defs import OpSchema

log = logging.getLogger(__name__)

OPSET = 20                 # default-domain opset of every exported model and every function body
DOMAIN = "kimi"            # custom node domain == TensorRT plugin namespace
DOMAIN_VERSION = 1
PLUGIN_ATTRS = {"plugin_namespace": "kimi", "plugin_version": "1"}
KIMI = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)
ACT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]

# op modules that register ops (op type -> module path); each defines SPECS: dict[str, OnnxOpSpec]
OP_MODULES = ("k3deploy.plugins.kda.onnx", "k3deploy.plugins.mla.onnx", "k3deploy.plugins.moe.onnx")

_ATTR_TYPES = {int: OpSchema.AttrType.INT, float: OpSchema.AttrType.FLOAT, str: OpSchema.AttrType.STRING}


@dataclasses.dataclass
class OnnxOpSpec:
    """One custom op: ONNX node type, schema, body (onnxscript function) and torch op it translates."""

    name: str                      # ONNX op type, e.g. "KdaPrefill"
    schema: OpSchema
    body: onnxscript.OnnxFunction  # reference body (onnxscript, opset OPSET)
    torch_op: str                  # torch.ops.kimi.<torch_op>
    translate: Callable            # dynamo translation function


def make_schema(name: str, inputs: Sequence[tuple[str, str]], outputs: Sequence[tuple[str, str]],
                attrs: Sequence[tuple[str, type, object]], doc: str = "") -> OpSchema:
    """OpSchema for kimi::name. inputs/outputs: (name, type) with type "T" (act: float/float16/bfloat16) or an
    ONNX type string like "tensor(int32)". attrs: (name, python type, default or None = required).
    plugin_namespace/plugin_version are added as optional STRING attributes."""
    FP = OpSchema.FormalParameter
    alist = []
    for aname, kind, default in attrs:
        if default is None:
            alist.append(OpSchema.Attribute(aname, _ATTR_TYPES[kind], aname))
        else:
            alist.append(OpSchema.Attribute(aname, onnx.helper.make_attribute(aname, kind(default)), aname))
    for aname, val in PLUGIN_ATTRS.items():
        alist.append(OpSchema.Attribute(aname, onnx.helper.make_attribute(aname, val), "TensorRT plugin lookup"))
    return OpSchema(name, DOMAIN, DOMAIN_VERSION, doc=doc,
                    inputs=[FP(n, t) for n, t in inputs], outputs=[FP(n, t) for n, t in outputs],
                    type_constraints=[("T", ACT_TYPES, "activation dtype")], attributes=alist)


def emit(schema: OpSchema, inputs: Sequence, attrs: dict, num_outputs: int):
    """Emit one kimi node inside a dynamo translation function (onnxscript tracing evaluator)."""
    node = onnxscript.values.Op(KIMI, schema.name, schema)
    return node(*inputs, **attrs, **PLUGIN_ATTRS, _outputs=num_outputs)


def function_proto(body: onnxscript.OnnxFunction) -> onnx.FunctionProto:
    """The body's FunctionProto (domain kimi), with plugin_namespace/plugin_version declared as attributes so the
    checker accepts nodes carrying them. Raises RuntimeError if the body's default opset is not OPSET."""
    fp = body.to_function_proto()
    fp.domain = DOMAIN
    declared = set(fp.attribute) | {a.name for a in fp.attribute_proto}
    for a in PLUGIN_ATTRS:
        if a not in declared:
            fp.attribute.append(a)
    ver = {o.domain: o.version for o in fp.opset_import}.get("")
    if ver != OPSET:
        raise RuntimeError(f"function {fp.name}: default-domain opset {ver} != {OPSET}; write the body with "
                           f"onnxscript.opset{OPSET}")
    _explicit_loop_conditions(fp.node)
    return fp


def _explicit_loop_conditions(nodes) -> None:
    """Give every Loop with an omitted `cond` input (onnxscript's `for i in range(n)`) an explicit true constant:
    TensorRT's Loop importer does not accept the empty optional input. Same semantics (ONNX Loop spec)."""
    i = 0
    while i < len(nodes):
        n = nodes[i]
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _explicit_loop_conditions(a.g.node)
        if n.op_type == "Loop" and n.domain in ("", "ai.onnx") and len(n.input) > 1 and n.input[1] == "":
            name = f"{n.output[0]}__loop_true"
            const = onnx.helper.make_node("Constant", [], [name], value=onnx.helper.make_tensor(name, onnx.TensorProto.BOOL, [], [True]))
            n.input[1] = name
            nodes.insert(i, const)
            i += 1
        i += 1


def specs() -> dict[str, OnnxOpSpec]:
    """All custom op specs by ONNX op type (imports the op modules)."""
    out: dict[str, OnnxOpSpec] = {}
    for m in OP_MODULES:
        out.update(importlib.import_module(m).SPECS)
    return out


def translation_table() -> dict:
    """{torch.ops.kimi.<op>.default: translation function} for torch.onnx.export(custom_translation_table=...).
    Imports plugins/<op>/op.py so the torch ops exist."""
    import torch

    import k3deploy.plugins.torch_ops  # noqa: F401  (registers torch.ops.kimi.*)
    return {getattr(torch.ops.kimi, s.torch_op).default: s.translate for s in specs().values()}


def _used_kimi_ops(g: onnx.GraphProto, acc: set) -> set:
    for n in g.node:
        if n.domain == DOMAIN:
            acc.add(n.op_type)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _used_kimi_ops(a.g, acc)
    return acc


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the FunctionProto bodies of every kimi op the graph uses (once) and the kimi opset import (in place).

    Raises ValueError if the model's default-domain opset differs from OPSET (the bodies would be rejected) or a
    kimi node type has no spec."""
    ver = {o.domain: o.version for o in model.opset_import}
    if ver.get("", None) != OPSET:
        raise ValueError(f"model default-domain opset is {ver.get('')}; the kimi function bodies need {OPSET} "
                         f"(export with opset_version={OPSET})")
    used = _used_kimi_ops(model.graph, set())
    if not used:
        return model
    all_specs = specs()
    have = {f.name for f in model.functions if f.domain == DOMAIN}
    todo = sorted(used)
    while todo:  # bodies may call other kimi ops (KdaDecode -> KdaPrefill): add the closure
        name = todo.pop()
        if name in have:
            continue
        if name not in all_specs:
            raise ValueError(f"kimi node type {name!r} has no ONNX spec; known: {sorted(all_specs)}")
        fp = function_proto(all_specs[name].body)
        model.functions.append(fp)
        have.add(name)
        todo.extend(n.op_type for n in fp.node if n.domain == DOMAIN and n.op_type not in have)
    if DOMAIN not in ver:
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    # A body that calls another kimi function (KdaDecode -> KdaPrefill) is made self-contained: TensorRT's parser
    # does not resolve function calls nested in a function it inlines. Ops used at the top level stay nodes.
    nested = {n.op_type for f in model.functions if f.domain == DOMAIN for n in f.node if n.domain == DOMAIN}
    nested -= used
    if nested:
        from onnx import inliner   # not `import onnx.inliner`: that makes `onnx` a local of this whole function
        model.CopyFrom(inliner.inline_selected_functions(model, [(DOMAIN, n) for n in sorted(nested)]))
    return model


def single_op_model(op_type: str, inputs: Sequence[tuple[str, int, Sequence]], outputs: Sequence[tuple[str, int, Sequence]],
                    attrs: dict) -> onnx.ModelProto:
    """A model with one kimi node `op_type` (inputs/outputs: (name, onnx elem type, shape with ints or dim names)),
    its function body attached; checked with onnx.checker full_check (raises onnx.checker.ValidationError)."""
    node = onnx.helper.make_node(op_type, [n for n, _, _ in inputs], [n for n, _, _ in outputs], domain=DOMAIN,
                                 **attrs, **PLUGIN_ATTRS)
    vi = onnx.helper.make_tensor_value_info
    g = onnx.helper.make_graph([node], op_type, [vi(n, t, s) for n, t, s in inputs], [vi(n, t, s) for n, t, s in outputs])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", OPSET),
                                                 onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])
    m.ir_version = 10
    attach_functions(m)
    onnx.checker.check_model(m, full_check=True)
    return m
