"""ONNX form of ``kimi::KdaPrefill`` / ``kimi::KdaDecode``: node schema, dynamo translation, reference body.

Schema (domain ``kimi`` v1; every node also carries ``plugin_namespace="kimi"``, ``plugin_version="1"``)::

    KdaPrefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots)
        -> (out, state_out, conv_out)
    KdaDecode (qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots)
        -> (out, state_out, conv_out)

    input       shape           dtype   meaning
    qkv         [T, 3P]         T(act)  raw q‖k‖v projections (pre-conv), P = H*K
    f           [T, P]          T       f_b_proj(f_a_proj(x))
    b           [T, H]          T       β logits
    g           [T, P]          T       output-gate logits
    conv_w      [3P, W]         f32     depthwise conv weights (W = 4), w[:, W-1] hits the current token
    A_log       [H]             f32
    dt_bias     [P]             f32
    o_norm_w    [K]             f32
    state       [S, H, V, K]    f32     slot pool (Sᵀ per head); slot 0 = padding sentinel
    conv        [S, 3P, W-1]    T       slot pool of raw pre-conv inputs, oldest first
    cu_seqlens  [N+1]           int32   Prefill only; packed offsets, every length >= 1
    slots       [N]             int32   (Decode: [B] with T == B)
    out         [T, P]          T
    state_out   [S, H, V, K]    f32     the pool with the slots' rows replaced (TensorRT plugin: in place)
    conv_out    [S, 3P, W-1]    T
    attributes  num_heads (INT, required), head_dim (INT, required), lower_bound (FLOAT, -5.0),
                norm_eps (FLOAT, 1e-5); INT attributes reach a TensorRT plugin as INT32.

Body (ONNX Runtime reference): per-token sequence ids from cu_seqlens; the causal conv windows are gathered from a
table [pool history rows ‖ this step's tokens], so sequences that start with history (chunked prefill) or are shorter
than the conv window read their slot's history; new histories and final states are scattered back (ScatterND) to the
slots. The delta rule runs token by token in a Loop whose carried state holds one row per sequence [N, H, V, K]
(initialised from the slots), so packed sequences and non-zero initial states need no special casing.
Errors: the body cannot raise; a zero-length sequence or a slot outside [0, S) is undefined behaviour here — the
torch op / reference (plugins/kda/reference.py `check_cu_seqlens`) rejects them with ValueError, and the runtime
validates batches before running graphs. Duplicate slots (padding rows on sentinel slot 0) write last-wins.
"""
from __future__ import annotations

import onnxscript
from onnxscript import FLOAT, INT32
from onnxscript import opset20 as op

from k3deploy.plugins.onnx_common import KIMI, OnnxOpSpec, emit, make_schema

_INPUTS = [("qkv", "T"), ("f", "T"), ("b", "T"), ("g", "T"), ("conv_w", "tensor(float)"), ("A_log", "tensor(float)"),
           ("dt_bias", "tensor(float)"), ("o_norm_w", "tensor(float)"), ("state", "tensor(float)"), ("conv", "T")]
_OUTPUTS = [("out", "T"), ("state_out", "tensor(float)"), ("conv_out", "T")]
_ATTRS = [("num_heads", int, None), ("head_dim", int, None), ("lower_bound", float, -5.0), ("norm_eps", float, 1e-5)]

KDA_PREFILL_SCHEMA = make_schema("KdaPrefill", _INPUTS + [("cu_seqlens", "tensor(int32)"), ("slots", "tensor(int32)")],
                                 _OUTPUTS, _ATTRS, "Fused KDA prefill over packed sequences (docs/DESIGN.md)")
KDA_DECODE_SCHEMA = make_schema("KdaDecode", _INPUTS + [("slots", "tensor(int32)")], _OUTPUTS, _ATTRS,
                                "Fused KDA decode, one token per sequence (docs/DESIGN.md)")



@onnxscript.script(KIMI, default_opset=op)
def KdaPrefill(qkv: FLOAT, f: FLOAT, b: FLOAT, g: FLOAT, conv_w: FLOAT, A_log: FLOAT, dt_bias: FLOAT,
               o_norm_w: FLOAT, state: FLOAT, conv: FLOAT, cu_seqlens: INT32, slots: INT32,
               num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5):
    i0 = op.Constant(value_ints=[0])
    i1 = op.Constant(value_ints=[1])
    i2 = op.Constant(value_ints=[2])
    i3 = op.Constant(value_ints=[3])
    last = op.Constant(value_ints=[-1])
    x = op.Cast(qkv, to=1)                                            # [T, 3P] fp32
    Tn = op.Shape(qkv, start=0, end=1)
    D3 = op.Shape(qkv, start=1, end=2)
    Hn = op.Shape(b, start=1, end=2)
    Kn = op.Shape(o_norm_w, start=0, end=1)
    Wn = op.Shape(conv_w, start=1, end=2)
    Sn = op.Shape(state, start=0, end=1)
    Pn = op.Mul(Hn, Kn)
    Wm1 = op.Sub(Wn, i1)
    cu = op.Cast(cu_seqlens, to=7)
    sl = op.Cast(slots, to=7)
    starts = op.Slice(cu, i0, last)                                   # [N]
    ends = op.Slice(cu, i1, op.Constant(value_ints=[9223372036854775807]))
    t = op.Range(op.Constant(value_int=0), op.Squeeze(Tn), op.Constant(value_int=1))   # [T]
    # sequence of each token = number of sequence ends <= t
    seq = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(ends, i0), op.Unsqueeze(t, i1)), to=7), i1, keepdims=0)
    pos = op.Sub(t, op.Gather(starts, seq))                           # position inside the sequence
    slot_t = op.Gather(sl, seq)
    # causal conv: rows [S*(W-1)] of pool history (slot-major, oldest first) followed by the T new tokens
    hist_rows = op.Reshape(op.Transpose(op.Cast(conv, to=1), perm=[0, 2, 1]), op.Concat(last, D3, axis=0))
    table = op.Concat(hist_rows, x, axis=0)
    base = op.Mul(Sn, Wm1)
    lags = op.Unsqueeze(op.Range(op.Squeeze(Wm1), op.Constant(value_int=-1), op.Constant(value_int=-1)), i0)  # [1, W]
    own = op.Sub(op.Unsqueeze(op.Add(t, base), i1), lags)
    hist = op.Sub(op.Unsqueeze(op.Add(op.Add(op.Mul(slot_t, Wm1), Wm1), pos), i1), lags)
    idx = op.Where(op.GreaterOrEqual(op.Unsqueeze(pos, i1), lags), own, hist)          # [T, W]
    win = op.Gather(table, idx, axis=0)                               # [T, W, 3P]
    yc = op.ReduceSum(op.Mul(win, op.Unsqueeze(op.Transpose(conv_w, perm=[1, 0]), i0)), i1, keepdims=0)
    y = op.Mul(yc, op.Sigmoid(yc))                                    # SiLU, [T, 3P]
    # new conv history of every sequence: its last W-1 raw inputs (may reach into the old history)
    last_t = op.Sub(ends, i1)
    last_pos = op.Sub(op.Sub(ends, starts), i1)
    lags_h = op.Unsqueeze(op.Range(op.Squeeze(op.Sub(Wm1, i1)), op.Constant(value_int=-1), op.Constant(value_int=-1)), i0)
    own_h = op.Sub(op.Unsqueeze(op.Add(last_t, base), i1), lags_h)
    hist_h = op.Sub(op.Unsqueeze(op.Add(op.Add(op.Mul(sl, Wm1), Wm1), last_pos), i1), lags_h)
    idx_h = op.Where(op.GreaterOrEqual(op.Unsqueeze(last_pos, i1), lags_h), own_h, hist_h)   # [N, W-1]
    new_hist = op.Transpose(op.Gather(table, idx_h, axis=0), perm=[0, 2, 1])               # [N, 3P, W-1]
    conv_out = op.ScatterND(conv, op.Unsqueeze(sl, i1), op.CastLike(new_hist, conv))
    # q, k (L2-normalized, q scaled by K^-0.5), v
    shp = op.Concat(Tn, Hn, Kn, axis=0)
    P2 = op.Add(Pn, Pn)
    P3 = op.Add(P2, Pn)
    eps6 = op.Constant(value_float=1e-6)
    qr = op.Reshape(op.Slice(y, i0, Pn, i1), shp)
    kr = op.Reshape(op.Slice(y, Pn, P2, i1), shp)
    v = op.Reshape(op.Slice(y, P2, P3, i1), shp)
    qn = op.Mul(qr, op.Reciprocal(op.Sqrt(op.Add(op.ReduceSum(op.Mul(qr, qr), last, keepdims=1), eps6))))
    q = op.Mul(qn, op.Pow(op.Cast(Kn, to=1), op.Constant(value_float=-0.5)))
    k = op.Mul(kr, op.Reciprocal(op.Sqrt(op.Add(op.ReduceSum(op.Mul(kr, kr), last, keepdims=1), eps6))))
    # log decay and beta
    z = op.Reshape(op.Add(op.Cast(f, to=1), dt_bias), shp)
    lb = op.Constant(value_float=lower_bound)
    gate = op.Mul(lb, op.Sigmoid(op.Mul(op.Unsqueeze(op.Exp(A_log), op.Constant(value_ints=[0, 2])), z)))   # [T, H, K]
    beta = op.Sigmoid(op.Cast(b, to=1))                               # [T, H]
    # delta rule, token by token; work holds one state row per sequence [N, H, V, K]
    work = op.Gather(state, sl, axis=0)
    obuf = op.Mul(v, op.Constant(value_float=0.0))
    for i in range(op.Squeeze(Tn)):
        ii = op.Reshape(i, i1)
        n = op.Gather(seq, ii)
        s0 = op.Gather(work, n, axis=0)                               # [1, H, V, K]
        ki = op.Unsqueeze(op.Gather(k, ii, axis=0), i2)               # [1, H, 1, K]
        s1 = op.Mul(s0, op.Unsqueeze(op.Exp(op.Gather(gate, ii, axis=0)), i2))
        u = op.Sub(op.Gather(v, ii, axis=0), op.ReduceSum(op.Mul(s1, ki), i3, keepdims=0))   # [1, H, V]
        bu = op.Mul(op.Unsqueeze(op.Gather(beta, ii, axis=0), i2), u)
        s2 = op.Add(s1, op.Mul(op.Unsqueeze(bu, i3), ki))
        oi = op.ReduceSum(op.Mul(s2, op.Unsqueeze(op.Gather(q, ii, axis=0), i2)), i3, keepdims=0)   # [1, H, V]
        work = op.ScatterND(work, op.Unsqueeze(n, i1), s2)
        obuf = op.ScatterND(obuf, op.Unsqueeze(ii, i1), oi)
    state_out = op.ScatterND(state, op.Unsqueeze(sl, i1), work)
    # gated RMSNorm per head
    eps = op.Constant(value_float=norm_eps)
    ms = op.ReduceMean(op.Mul(obuf, obuf), last, keepdims=1)
    o = op.Mul(op.Mul(op.Mul(obuf, op.Reciprocal(op.Sqrt(op.Add(ms, eps)))), o_norm_w),
               op.Sigmoid(op.Reshape(op.Cast(g, to=1), shp)))
    out = op.CastLike(op.Reshape(o, op.Concat(Tn, Pn, axis=0)), qkv)
    return out, state_out, conv_out


@onnxscript.script(KIMI, default_opset=op)
def KdaDecode(qkv: FLOAT, f: FLOAT, b: FLOAT, g: FLOAT, conv_w: FLOAT, A_log: FLOAT, dt_bias: FLOAT,
              o_norm_w: FLOAT, state: FLOAT, conv: FLOAT, slots: INT32,
              num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5):
    Bn = op.Shape(qkv, start=0, end=1)
    cu = op.Cast(op.Range(op.Constant(value_int=0), op.Add(op.Squeeze(Bn), op.Constant(value_int=1)),
                          op.Constant(value_int=1)), to=6)
    out, state_out, conv_out = KdaPrefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu, slots,
                                          num_heads=num_heads, head_dim=head_dim, lower_bound=lower_bound,
                                          norm_eps=norm_eps)
    return out, state_out, conv_out


def kda_prefill_onnx(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots,
                     num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5):
    """Dynamo translation of torch.ops.kimi.kda_prefill: one KdaPrefill node."""
    return emit(KDA_PREFILL_SCHEMA, (qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots),
                dict(num_heads=int(num_heads), head_dim=int(head_dim), lower_bound=float(lower_bound),
                     norm_eps=float(norm_eps)), 3)


def kda_decode_onnx(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots,
                    num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5):
    """Dynamo translation of torch.ops.kimi.kda_decode: one KdaDecode node."""
    return emit(KDA_DECODE_SCHEMA, (qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots),
                dict(num_heads=int(num_heads), head_dim=int(head_dim), lower_bound=float(lower_bound),
                     norm_eps=float(norm_eps)), 3)


SPECS = {
    "KdaPrefill": OnnxOpSpec("KdaPrefill", KDA_PREFILL_SCHEMA, KdaPrefill, "kda_prefill", kda_prefill_onnx),
    "KdaDecode": OnnxOpSpec("KdaDecode", KDA_DECODE_SCHEMA, KdaDecode, "kda_decode", kda_decode_onnx),
}
