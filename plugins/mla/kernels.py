"""MLA Triton kernels (GPU; also run on CPU tensors under TRITON_INTERPRET=1). MODEL.md §5.2-5.3, DESIGN.md.

mla_decode : write the new latent at context_lens[b] (tiny kernel), then absorbed latent attention over the paged
             cache, split-K along the sequence (fixed split count from the cache capacity: no host sync, CUDA-graph
             safe), fp32 online softmax, values = first R=512 latent columns; then a combine kernel (log-sum-exp).
mla_prefill: write the new latents, then per sequence: gather its latents, up-project with kv_b, torch SDPA
             (causal with context offset), fp32 softmax inside SDPA.

Same signatures as plugins.mla.reference; the cache is updated in place and returned.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _write_latent_kernel(lat_ptr, cache_ptr, bt_ptr, ctx_ptr, stride_lat, stride_bt,
                         BS: tl.constexpr, DL: tl.constexpr, BDL: tl.constexpr):
    b = tl.program_id(0)
    pos = tl.load(ctx_ptr + b)
    blk = tl.load(bt_ptr + b * stride_bt + pos // BS).to(tl.int64)
    d = tl.arange(0, BDL)
    x = tl.load(lat_ptr + b * stride_lat + d, mask=d < DL)
    tl.store(cache_ptr + (blk * BS + pos % BS) * DL + d, x.to(cache_ptr.dtype.element_ty), mask=d < DL)


@triton.jit
def _mla_split_kernel(
    q_ptr, cache_ptr, bt_ptr, ctx_ptr, po_ptr, plse_ptr,
    stride_qb, stride_qh, stride_bt, sm_scale,
    H, NSPLIT, TOK_PER_SPLIT,
    BS: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
):
    """grid (head groups, splits, B). One program: BH heads of one sequence over TOK_PER_SPLIT tokens.
    BN divides BS and TOK_PER_SPLIT is a multiple of BN, so every [BN, 576] tile lies inside ONE paged block:
    its block id is one scalar load and the tile is BN*576 contiguous elements (coalesced 16-byte loads that
    the pipeliner turns into cp.async stages), read once for all BH heads."""
    hg = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2)
    hh = hg * BH + tl.arange(0, BH)
    hmask = hh < H
    dr = tl.arange(0, R)
    dp = tl.arange(0, DR)
    rn = tl.arange(0, BN)
    DL: tl.constexpr = R + DR
    q_base = q_ptr + b * stride_qb + hh[:, None] * stride_qh
    qn = tl.load(q_base + dr[None, :], mask=hmask[:, None], other=0.0)                  # [BH, R]
    qp = tl.load(q_base + R + dp[None, :], mask=hmask[:, None], other=0.0)              # [BH, DR]
    L = tl.load(ctx_ptr + b) + 1
    start = sp * TOK_PER_SPLIT
    end = tl.minimum(start + TOK_PER_SPLIT, L)
    m_i = tl.zeros([BH], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, R], dtype=tl.float32)
    qscale = sm_scale * 1.4426950408889634
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    last = tl.maximum(end - 1, 0)
    # block id of the next tile is loaded one iteration ahead (loop-carried), so the tile loads do not depend
    # on a load of the same iteration and the pipeliner gives them num_stages - 1 shared-memory buffers
    blk_next = tl.load(bt_row + tl.minimum(start, last) // BS).to(tl.int64)
    for n0 in range(start, end, BN):
        blk = blk_next
        blk_next = tl.load(bt_row + tl.minimum(n0 + BN, last) // BS).to(tl.int64)
        tok = n0 + rn
        tmask = tok < end
        tile = cache_ptr + (blk * BS + n0 % BS) * DL + rn[:, None] * DL                 # [BN, 1] row starts
        kn = tl.load(tile + dr[None, :], mask=tmask[:, None], other=0.0)                # [BN, R]
        kp = tl.load(tile + R + dp[None, :], mask=tmask[:, None], other=0.0)            # [BN, DR]
        s = tl.dot(qn, tl.trans(kn)) + tl.dot(qp, tl.trans(kp))                          # [BH, BN] fp32
        s = s * qscale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kn.dtype), kn)
        m_i = m_new
    # partial results: acc / l and lse (base 2)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    off = (b * H + hh) * NSPLIT + sp
    tl.store(po_ptr + off[:, None].to(tl.int64) * R + dr[None, :], o, mask=hmask[:, None])
    tl.store(plse_ptr + off, lse, mask=hmask)


@triton.jit
def _mla_combine_kernel(po_ptr, plse_ptr, out_ptr, H, NSPLIT, stride_ob, stride_oh,
                        R: tl.constexpr, BSPLIT: tl.constexpr):
    """out[b, h] = sum_s w_s po[s], w = softmax over splits of lse (base 2); splits in chunks of BSPLIT."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * H + h) * NSPLIT
    s = tl.arange(0, BSPLIT)
    m = tl.full([BSPLIT], float("-inf"), tl.float32)
    for s0 in range(0, NSPLIT, BSPLIT):
        m = tl.maximum(m, tl.load(plse_ptr + base + s0 + s, mask=(s0 + s) < NSPLIT, other=float("-inf")))
    mx = tl.max(m, axis=0)
    dr = tl.arange(0, R)
    o = tl.zeros([R], dtype=tl.float32)
    den = tl.zeros([BSPLIT], dtype=tl.float32)
    for s0 in range(0, NSPLIT, BSPLIT):
        smask = (s0 + s) < NSPLIT
        lse = tl.load(plse_ptr + base + s0 + s, mask=smask, other=float("-inf"))
        w = tl.where(lse > float("-inf"), tl.exp2(lse - mx), 0.0)
        den += w
        po = tl.load(po_ptr + (base + s0 + s)[:, None].to(tl.int64) * R + dr[None, :],
                     mask=(smask & (w > 0))[:, None], other=0.0)
        o += tl.sum(po * w[:, None], axis=0)
    o = o / tl.sum(den, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dr, o.to(out_ptr.dtype.element_ty))


_SM_COUNT = {}


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _launch_cfg(B, H, capacity, device, BN, BH=None, programs_per_sm=8):
    """Split-K along the sequence: enough (head group, split, sequence) programs for `programs_per_sm` per SM
    (several resident CTAs per SM and a short tail), each split at least 256 tokens. Fixed from the cache
    capacity (no host sync; CUDA-graph safe)."""
    if BH is None:
        # H200 run 3 (benchmarks/RESULTS.md): at 96 heads BH=64 took 2591 us vs 4248 (BH=32) at B=64, L=32768
        BH = 16 if H <= 16 else 64
    ngroups = triton.cdiv(H, BH)
    target = programs_per_sm * _num_sms(device)
    nsplit = max(1, min(triton.cdiv(target, B * ngroups), triton.cdiv(capacity, 256)))
    tok = triton.cdiv(triton.cdiv(capacity, nsplit), BN) * BN
    nsplit = triton.cdiv(capacity, tok)
    return BH, ngroups, nsplit, tok


def _pow2_divisor(n: int) -> int:
    return n & -n


def mla_decode(q_abs, latent, cache, block_tables, context_lens, *, num_heads: int, kv_lora_rank: int, scale: float,
               out=None, num_splits: int | None = None, block_h: int | None = None, block_n: int | None = None,
               num_stages: int | None = None, num_warps: int | None = None, programs_per_sm: int = 8):
    """MlaDecode: writes latent[b] at context_lens[b], attends over context_lens[b]+1 latents.
    Returns (out_latent [B, H, R] in q_abs dtype, cache)."""
    B, H, DL = q_abs.shape
    R = kv_lora_rank
    DR = DL - R
    NB, BS, DLc = cache.shape
    assert H == num_heads and DLc == DL and latent.shape == (B, DL) and cache.is_contiguous()
    dev = q_abs.device
    if q_abs.dtype != cache.dtype:
        q_abs = q_abs.to(cache.dtype)
    if q_abs.stride(-1) != 1:
        q_abs = q_abs.contiguous()
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    ctx = context_lens if context_lens.dtype == torch.int32 else context_lens.to(torch.int32)
    if out is None:
        out = torch.empty(B, H, R, dtype=q_abs.dtype, device=dev)
    if B == 0:
        return out, cache
    _write_latent_kernel[(B,)](latent, cache, bt, ctx, latent.stride(0), bt.stride(0),
                               BS=BS, DL=DL, BDL=triton.next_power_of_2(DL), num_warps=4)
    capacity = bt.shape[1] * BS
    # a tile never straddles two paged blocks: BN is a power of two dividing BS
    BN = min(block_n or 32, _pow2_divisor(BS))
    if BN < 16 and dev.type == "cuda":
        raise ValueError(f"cache block_size = {BS}: the GPU decode kernel needs blocks of a multiple of 16 tokens "
                         "(tl.dot tiles); allocate the latent pool with block_size 16, 32 or 64")
    BH, ngroups, nsplit, tok = _launch_cfg(B, H, capacity, dev, BN, block_h, programs_per_sm)
    if num_splits is not None:
        nsplit = num_splits
        tok = triton.cdiv(triton.cdiv(capacity, nsplit), BN) * BN
    po = torch.empty(B * H * nsplit, R, dtype=torch.float32, device=dev)
    plse = torch.empty(B * H * nsplit, dtype=torch.float32, device=dev)
    _mla_split_kernel[(ngroups, nsplit, B)](
        q_abs, cache, bt, ctx, po, plse, q_abs.stride(0), q_abs.stride(1), bt.stride(0), float(scale),
        H, nsplit, tok, BS=BS, R=R, DR=DR, BH=BH, BN=BN,
        num_warps=num_warps or (4 if BH <= 16 else 8), num_stages=num_stages or 3)
    _mla_combine_kernel[(B, H)](po, plse, out, H, nsplit, out.stride(0), out.stride(1),
                                R=R, BSPLIT=min(16, max(2, triton.next_power_of_2(nsplit))), num_warps=4)
    return out, cache


def _write_latents_prefill(latent, cache, block_tables, cu_seqlens, context_lens):
    T = latent.shape[0]
    NB, BS, DL = cache.shape
    dev = latent.device
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    N = lens.shape[0]
    seq = torch.repeat_interleave(torch.arange(N, device=dev), lens, output_size=T)
    pos = torch.arange(T, device=dev) - cu[:-1][seq] + context_lens.long()[seq]
    blk = block_tables.long()[seq, pos // BS]
    cache.view(NB * BS, DL).index_copy_(0, blk * BS + pos % BS, latent.to(cache.dtype))


def mla_prefill(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens, *, num_heads: int,
                qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int, scale: float):
    """MlaPrefill: writes the new latents, then causal unabsorbed attention over context + new tokens.
    Returns (out [T, H*Dv] in q dtype, cache)."""
    T, H, Dqk = q.shape
    Dn, Dv, R = qk_nope_head_dim, v_head_dim, kv_lora_rank
    NB, BS, DL = cache.shape
    _write_latents_prefill(latent, cache, block_tables, cu_seqlens, context_lens)
    cu = [int(x) for x in cu_seqlens.tolist()]
    ctxl = [int(x) for x in context_lens.tolist()]
    out = torch.empty(T, H * Dv, dtype=q.dtype, device=q.device)
    cdt = torch.bfloat16 if q.device.type == "cuda" else torch.float32
    wkv = kv_b.to(cdt).view(H, Dn + Dv, R)
    flat = cache.view(NB * BS, DL)
    for n in range(len(cu) - 1):
        Ln = cu[n + 1] - cu[n]
        tot = ctxl[n] + Ln
        pos = torch.arange(tot, device=q.device)
        rows = block_tables[n].long()[pos // BS] * BS + pos % BS
        C = flat.index_select(0, rows).to(cdt)                                   # [tot, 576]
        kv = torch.einsum("tr,hdr->htd", C[:, :R], wkv)                          # [H, tot, Dn+Dv]
        k = torch.cat([kv[..., :Dn], C[None, :, R:].expand(H, tot, DL - R)], -1)  # [H, tot, Dqk]
        v = kv[..., Dn:]
        qq = q[cu[n]:cu[n + 1]].to(cdt).transpose(0, 1)                           # [H, Ln, Dqk]
        if ctxl[n] == 0:
            o = F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale)
        else:
            i = torch.arange(Ln, device=q.device)[:, None]
            j = torch.arange(tot, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qq, k, v, attn_mask=(j <= ctxl[n] + i), scale=scale)
        out[cu[n]:cu[n + 1]] = o.transpose(0, 1).reshape(Ln, H * Dv).to(q.dtype)
    return out, cache
