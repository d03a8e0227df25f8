"""ONNX form of ``kimi::MlaPrefill`` / ``kimi::MlaDecode``: node schema, dynamo translation, reference body.

Schema (domain ``kimi`` v1; nodes also carry ``plugin_namespace="kimi"``, ``plugin_version="1"``)::

    MlaPrefill(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens) -> (out, cache_out)
        q             [T, H, Dn+Dr]       T(act)  per-head queries, nope ‖ pe (no rotary)
        latent        [T, C]              T       new rows: c_kv (post-norm, R) ‖ k_pe (Dr); C = R + Dr (576 for K3)
        kv_b          [H*(Dn+Dv), R]      T       kv_b_proj weight of the rank-local heads
        cache         [NB, BS, C]         T       paged latent pool; block 0 = padding sentinel
        block_tables  [N, MB]             int32
        cu_seqlens    [N+1]               int32   every length >= 1
        context_lens  [N]                 int32   tokens already cached
        out           [T, H*Dv]           T
        cache_out     [NB, BS, C]         T       cache with the new rows written (TensorRT plugin: in place)
        attributes    num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank (INT, required; INT32 in TensorRT),
                      scale (FLOAT, required; (Dn+Dr)^-0.5)

    MlaDecode(q_abs, latent, cache, block_tables, context_lens) -> (out_latent, cache_out)
        q_abs         [B, H, C]           T       q_nope·W_UK ‖ q_pe
        latent        [B, C]              T
        block_tables  [B, MB] int32, context_lens [B] int32
        out_latent    [B, H, R]           T       Σ_t p_t · cache_t[:R]
        attributes    num_heads, kv_lora_rank (INT), scale (FLOAT)

Body (ONNX Runtime reference): new rows are written with ScatterND at positions context_lens[n] + i through the
block table; then every token attends over all MB*BS positions of its sequence's table, masked to
`position <= context_len + i` (fp32 softmax). Prefill uses the absorbed form (q_nope·W_UK against c_kv, then W_UV
on the attended latent), which equals the reference's unabsorbed attention up to fp32 rounding. Memory is
O(T · MB·BS · C): a reference, not a production kernel. The body cannot raise: zero-length sequences or
positions past the block table are rejected by the torch op / reference (ValueError) and the runtime.
"""
from __future__ import annotations

import onnxscript
from onnxscript import FLOAT, INT32
from onnxscript import opset20 as op

from k3deploy.plugins.onnx_common import KIMI, OnnxOpSpec, emit, make_schema

MLA_PREFILL_SCHEMA = make_schema(
    "MlaPrefill",
    [("q", "T"), ("latent", "T"), ("kv_b", "T"), ("cache", "T"), ("block_tables", "tensor(int32)"),
     ("cu_seqlens", "tensor(int32)"), ("context_lens", "tensor(int32)")],
    [("out", "T"), ("cache_out", "T")],
    [("num_heads", int, None), ("qk_nope_head_dim", int, None), ("v_head_dim", int, None), ("kv_lora_rank", int, None),
     ("scale", float, None)], "MLA prefill over the paged latent cache (docs/DESIGN.md)")
MLA_DECODE_SCHEMA = make_schema(
    "MlaDecode",
    [("q_abs", "T"), ("latent", "T"), ("cache", "T"), ("block_tables", "tensor(int32)"), ("context_lens", "tensor(int32)")],
    [("out_latent", "T"), ("cache_out", "T")],
    [("num_heads", int, None), ("kv_lora_rank", int, None), ("scale", float, None)],
    "MLA absorbed decode over the paged latent cache (docs/DESIGN.md)")


@onnxscript.script(KIMI, default_opset=op)
def MlaPrefill(q: FLOAT, latent: FLOAT, kv_b: FLOAT, cache: FLOAT, block_tables: INT32, cu_seqlens: INT32,
               context_lens: INT32, num_heads: int, qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int,
               scale: float):
    i0 = op.Constant(value_ints=[0])
    i1 = op.Constant(value_ints=[1])
    i2 = op.Constant(value_ints=[2])
    last = op.Constant(value_ints=[-1])
    big = op.Constant(value_ints=[9223372036854775807])
    Tn = op.Shape(q, start=0, end=1)
    Hn = op.Shape(q, start=1, end=2)
    Dq = op.Shape(q, start=2, end=3)
    Cn = op.Shape(cache, start=2, end=3)
    BS = op.Shape(cache, start=1, end=2)
    MB = op.Shape(block_tables, start=1, end=2)
    Rn = op.Shape(kv_b, start=1, end=2)
    Dn = op.Sub(Dq, op.Sub(Cn, Rn))
    cu = op.Cast(cu_seqlens, to=7)
    ctxs = op.Cast(context_lens, to=7)
    starts = op.Slice(cu, i0, last)
    ends = op.Slice(cu, i1, big)
    t = op.Range(op.Constant(value_int=0), op.Squeeze(Tn), op.Constant(value_int=1))
    seq = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(ends, i0), op.Unsqueeze(t, i1)), to=7), i1, keepdims=0)
    abspos = op.Add(op.Sub(t, op.Gather(starts, seq)), op.Gather(ctxs, seq))           # [T] cache position
    bt = op.Reshape(op.Cast(block_tables, to=7), last)
    row0 = op.Mul(seq, MB)
    blk = op.Gather(bt, op.Add(row0, op.Div(abspos, BS)))
    off = op.Mod(abspos, BS)
    cache_out = op.ScatterND(cache, op.Concat(op.Unsqueeze(blk, i1), op.Unsqueeze(off, i1), axis=1),
                             op.CastLike(latent, cache))
    # keys: every position of the token's block-table row
    L = op.Mul(MB, BS)
    kpos = op.Range(op.Constant(value_int=0), op.Squeeze(L), op.Constant(value_int=1))  # [L]
    kblk = op.Gather(bt, op.Add(op.Unsqueeze(row0, i1), op.Unsqueeze(op.Div(kpos, BS), i0)))   # [T, L]
    rows = op.Add(op.Mul(kblk, BS), op.Unsqueeze(op.Mod(kpos, BS), i0))
    flat = op.Reshape(op.Cast(cache_out, to=1), op.Concat(last, Cn, axis=0))
    lat = op.Gather(flat, rows, axis=0)                                                 # [T, L, C]
    mask = op.LessOrEqual(op.Unsqueeze(kpos, i0), op.Unsqueeze(abspos, i1))             # [T, L]
    # absorbed scores: q_nope W_UK ‖ q_pe against c_kv ‖ k_pe
    wkv = op.Reshape(op.Cast(kv_b, to=1), op.Concat(Hn, last, Rn, axis=0))             # [H, Dn+Dv, R]
    w_uk = op.Slice(wkv, i0, Dn, i1)                                                    # [H, Dn, R]
    w_uv = op.Slice(wkv, Dn, big, i1)                                                   # [H, Dv, R]
    qf = op.Cast(q, to=1)
    q_nope = op.Slice(qf, i0, Dn, i2)
    q_pe = op.Slice(qf, Dn, big, i2)
    q_abs = op.Transpose(op.MatMul(op.Transpose(q_nope, perm=[1, 0, 2]), w_uk), perm=[1, 0, 2])  # [T, H, R]
    qa = op.Concat(q_abs, q_pe, axis=2)                                                 # [T, H, C]
    s = op.Mul(op.MatMul(qa, op.Transpose(lat, perm=[0, 2, 1])), op.Constant(value_float=scale))   # [T, H, L]
    s = op.Where(op.Unsqueeze(mask, i1), s, op.Constant(value_float=float("-inf")))
    p = op.Softmax(s, axis=-1)
    o_lat = op.MatMul(p, op.Slice(lat, i0, Rn, i2))                                     # [T, H, R]
    o = op.MatMul(op.Transpose(o_lat, perm=[1, 0, 2]), op.Transpose(w_uv, perm=[0, 2, 1]))   # [H, T, Dv]
    out = op.CastLike(op.Reshape(op.Transpose(o, perm=[1, 0, 2]), op.Concat(Tn, last, axis=0)), q)
    return out, cache_out


@onnxscript.script(KIMI, default_opset=op)
def MlaDecode(q_abs: FLOAT, latent: FLOAT, cache: FLOAT, block_tables: INT32, context_lens: INT32,
              num_heads: int, kv_lora_rank: int, scale: float):
    i0 = op.Constant(value_ints=[0])
    i1 = op.Constant(value_ints=[1])
    i2 = op.Constant(value_ints=[2])
    last = op.Constant(value_ints=[-1])
    Bn = op.Shape(q_abs, start=0, end=1)
    Cn = op.Shape(cache, start=2, end=3)
    BS = op.Shape(cache, start=1, end=2)
    MB = op.Shape(block_tables, start=1, end=2)
    Rn = op.Reshape(op.Constant(value_int=kv_lora_rank), i1)
    seq = op.Range(op.Constant(value_int=0), op.Squeeze(Bn), op.Constant(value_int=1))
    abspos = op.Cast(context_lens, to=7)
    bt = op.Reshape(op.Cast(block_tables, to=7), last)
    row0 = op.Mul(seq, MB)
    blk = op.Gather(bt, op.Add(row0, op.Div(abspos, BS)))
    off = op.Mod(abspos, BS)
    cache_out = op.ScatterND(cache, op.Concat(op.Unsqueeze(blk, i1), op.Unsqueeze(off, i1), axis=1),
                             op.CastLike(latent, cache))
    L = op.Mul(MB, BS)
    kpos = op.Range(op.Constant(value_int=0), op.Squeeze(L), op.Constant(value_int=1))
    kblk = op.Gather(bt, op.Add(op.Unsqueeze(row0, i1), op.Unsqueeze(op.Div(kpos, BS), i0)))
    rows = op.Add(op.Mul(kblk, BS), op.Unsqueeze(op.Mod(kpos, BS), i0))
    flat = op.Reshape(op.Cast(cache_out, to=1), op.Concat(last, Cn, axis=0))
    lat = op.Gather(flat, rows, axis=0)                                                 # [B, L, C]
    mask = op.LessOrEqual(op.Unsqueeze(kpos, i0), op.Unsqueeze(abspos, i1))
    s = op.Mul(op.MatMul(op.Cast(q_abs, to=1), op.Transpose(lat, perm=[0, 2, 1])), op.Constant(value_float=scale))
    s = op.Where(op.Unsqueeze(mask, i1), s, op.Constant(value_float=float("-inf")))
    p = op.Softmax(s, axis=-1)
    out_latent = op.CastLike(op.MatMul(p, op.Slice(lat, i0, Rn, i2)), q_abs)            # [B, H, R]
    return out_latent, cache_out


def mla_prefill_onnx(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens, num_heads: int,
                     qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int, scale: float):
    """Dynamo translation of torch.ops.kimi.mla_prefill: one MlaPrefill node."""
    return emit(MLA_PREFILL_SCHEMA, (q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens),
                dict(num_heads=int(num_heads), qk_nope_head_dim=int(qk_nope_head_dim), v_head_dim=int(v_head_dim),
                     kv_lora_rank=int(kv_lora_rank), scale=float(scale)), 2)


def mla_decode_onnx(q_abs, latent, cache, block_tables, context_lens, num_heads: int, kv_lora_rank: int, scale: float):
    """Dynamo translation of torch.ops.kimi.mla_decode: one MlaDecode node."""
    return emit(MLA_DECODE_SCHEMA, (q_abs, latent, cache, block_tables, context_lens),
                dict(num_heads=int(num_heads), kv_lora_rank=int(kv_lora_rank), scale=float(scale)), 2)


SPECS = {
    "MlaPrefill": OnnxOpSpec("MlaPrefill", MLA_PREFILL_SCHEMA, MlaPrefill, "mla_prefill", mla_prefill_onnx),
    "MlaDecode": OnnxOpSpec("MlaDecode", MLA_DECODE_SCHEMA, MlaDecode, "mla_decode", mla_decode_onnx),
}
