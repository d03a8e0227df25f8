"""ONNX form of ``kimi::Mxfp4Moe``: node schema, dynamo translation, reference body.

Schema (domain ``kimi`` v1; nodes also carry ``plugin_namespace="kimi"``, ``plugin_version="1"``)::

    Mxfp4Moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale) -> y
        x           [T, Rl]         T(act)  latent tokens
        topk_ids    [T, k]          int32   global expert ids
        topk_w      [T, k]          f32     combine weights
        w13_packed  [E, 2I, Rl/2]   uint8   rows 0..I-1 = w1 (gate), I..2I-1 = w3 (up); E2M1, low nibble = even col
        w13_scale   [E, 2I, Rl/32]  uint8   E8M0: factor 2^(u-127) per 32 columns
        w2_packed   [E, Rl, I/2]    uint8
        w2_scale    [E, Rl, I/32]   uint8
        y           [T, Rl]         f32     Σ_k w_k · w2_e(SiTU(w1_e x, w3_e x)) over local choices
                                            (expert_offset <= id < expert_offset + E); other ids add 0
        attributes  expert_offset (INT, 0; INT32 in TensorRT), situ_beta (FLOAT, 4.0),
                    situ_linear_beta (FLOAT, 25.0; <= 0 means no tanh on the up projection)

Body (ONNX Runtime reference): dequantizes all E local experts (nibbles via integer Div/Mod, E2M1 table Gather,
scales via Pow(2, u-127); byte 255 is not rejected here — the checkpoint loader rejects it), computes every expert
densely for every token and combines with a [T, E] weight matrix built from the top-k choices.
"""
from __future__ import annotations

import onnxscript
from onnxscript import FLOAT, INT32, UINT8
from onnxscript import opset20 as op

from k3deploy.plugins.onnx_common import KIMI, OnnxOpSpec, emit, make_schema

MXFP4_MOE_SCHEMA = make_schema(
    "Mxfp4Moe",
    [("x", "T"), ("topk_ids", "tensor(int32)"), ("topk_w", "tensor(float)"), ("w13_packed", "tensor(uint8)"),
     ("w13_scale", "tensor(uint8)"), ("w2_packed", "tensor(uint8)"), ("w2_scale", "tensor(uint8)")],
    [("y", "tensor(float)")],
    [("expert_offset", int, 0), ("situ_beta", float, 4.0), ("situ_linear_beta", float, 25.0), ("num_experts", int, 0)],
    "MXFP4 routed experts, EP partial sum (docs/DESIGN.md)")


@onnxscript.script(KIMI, default_opset=op)
def Mxfp4Moe(x: FLOAT, topk_ids: INT32, topk_w: FLOAT, w13_packed: UINT8, w13_scale: UINT8, w2_packed: UINT8,
             w2_scale: UINT8, expert_offset: int = 0, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
             num_experts: int = 0):
    # num_experts only guides the GPU kernels' token tile (plugins/moe/reference.py); the body ignores it
    i0 = op.Constant(value_ints=[0])
    i1 = op.Constant(value_ints=[1])
    last = op.Constant(value_ints=[-1])
    lut = op.Constant(value_floats=[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    g32 = op.Constant(value_ints=[32])
    sixteen = op.Constant(value_int=16)
    two = op.Constant(value_float=2.0)
    bias = op.Constant(value_float=127.0)
    # dequantize w13 [E, 2I, Rl]
    p13 = op.Cast(w13_packed, to=7)
    c13 = op.Concat(op.Unsqueeze(op.Mod(p13, sixteen), last), op.Unsqueeze(op.Div(p13, sixteen), last), axis=-1)
    E = op.Shape(w13_packed, start=0, end=1)
    R13 = op.Shape(w13_packed, start=1, end=2)
    G13 = op.Shape(w13_scale, start=2, end=3)
    v13 = op.Reshape(op.Gather(lut, op.Cast(c13, to=7)), op.Concat(E, R13, G13, g32, axis=0))
    f13 = op.Unsqueeze(op.Pow(two, op.Sub(op.Cast(w13_scale, to=1), bias)), last)
    w13 = op.Reshape(op.Mul(v13, f13), op.Concat(E, R13, last, axis=0))
    # dequantize w2 [E, Rl, I]
    p2 = op.Cast(w2_packed, to=7)
    c2 = op.Concat(op.Unsqueeze(op.Mod(p2, sixteen), last), op.Unsqueeze(op.Div(p2, sixteen), last), axis=-1)
    R2 = op.Shape(w2_packed, start=1, end=2)
    G2 = op.Shape(w2_scale, start=2, end=3)
    v2 = op.Reshape(op.Gather(lut, op.Cast(c2, to=7)), op.Concat(E, R2, G2, g32, axis=0))
    f2 = op.Unsqueeze(op.Pow(two, op.Sub(op.Cast(w2_scale, to=1), bias)), last)
    w2 = op.Reshape(op.Mul(v2, f2), op.Concat(E, R2, last, axis=0))
    # every expert on every token
    In = op.Div(R13, op.Constant(value_ints=[2]))
    xf = op.Cast(x, to=1)
    h = op.MatMul(op.Unsqueeze(xf, i0), op.Transpose(w13, perm=[0, 2, 1]))            # [E, T, 2I]
    gate = op.Slice(h, i0, In, op.Constant(value_ints=[2]))
    up = op.Slice(h, In, op.Constant(value_ints=[9223372036854775807]), op.Constant(value_ints=[2]))
    beta = op.Constant(value_float=situ_beta)
    act = op.Mul(op.Mul(beta, op.Tanh(op.Div(gate, beta))), op.Sigmoid(gate))
    lb = op.Constant(value_float=situ_linear_beta)
    has_lb = op.Greater(lb, op.Constant(value_float=0.0))
    lb_safe = op.Where(has_lb, lb, op.Constant(value_float=1.0))
    up2 = op.Where(has_lb, op.Mul(lb_safe, op.Tanh(op.Div(up, lb_safe))), up)
    ye = op.MatMul(op.Mul(act, up2), op.Transpose(w2, perm=[0, 2, 1]))               # [E, T, Rl]
    # combine weights [T, E]
    local = op.Sub(op.Cast(topk_ids, to=7), op.Constant(value_int=expert_offset))
    eids = op.Range(op.Constant(value_int=0), op.Squeeze(E), op.Constant(value_int=1))
    hit = op.Equal(op.Unsqueeze(local, last), eids)                                     # [T, k, E]
    cw = op.ReduceSum(op.Where(hit, op.Unsqueeze(op.Cast(topk_w, to=1), last), op.Constant(value_float=0.0)),
                      i1, keepdims=0)                                                   # [T, E]
    y = op.ReduceSum(op.Mul(op.Unsqueeze(op.Transpose(cw, perm=[1, 0]), last), ye), i0, keepdims=0)
    return y


def mxfp4_moe_onnx(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, expert_offset: int = 0,
                   situ_beta: float = 4.0, situ_linear_beta: float = 25.0, num_experts: int = 0):
    """Dynamo translation of torch.ops.kimi.mxfp4_moe: one Mxfp4Moe node."""
    return emit(MXFP4_MOE_SCHEMA, (x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale),
                dict(expert_offset=int(expert_offset), situ_beta=float(situ_beta),
                     situ_linear_beta=float(situ_linear_beta), num_experts=int(num_experts)), 1)


SPECS = {"Mxfp4Moe": OnnxOpSpec("Mxfp4Moe", MXFP4_MOE_SCHEMA, Mxfp4Moe, "mxfp4_moe", mxfp4_moe_onnx)}
