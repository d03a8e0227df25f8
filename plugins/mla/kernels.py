"""MLA Triton kernels (GPU; also run on CPU tensors under TRITON_INTERPRET=1). MODEL.md §5.2-5.3, DESIGN.md.

mla_decode : write the new latent at context_lens[b] (tiny kernel), then absorbed latent attention over the paged
             cache, split-K along the sequence (fixed split count from the cache capacity: no host sync, CUDA-graph
             safe), fp32 online softmax, values = first R=512 latent columns; then a combine kernel (log-sum-exp).
mla_prefill: write the new latents, then either (graph_safe=False; the default on the CPU) per sequence: gather its
             latents, up-project with kv_b, torch SDPA (causal with context offset; reads cu_seqlens on the host), or
             (graph_safe=True: the default on CUDA, the faster path there, what the TensorRT plugin runs) the
             absorbed form: q_nope through W_UK (Triton GEMM), the paged
             decode kernel generalized to several query tokens per sequence (rows = tokens x heads, per-row
             causal limit, (sequence, tile) of each program found on the device in a fixed grid
             cdiv(T*H, BM) + N; when those tiles leave SMs idle, each tile's keys are split into parts merged
             by the decode's combine kernel), W_UV after (Triton GEMM): no host reads, scratch from the workspace.

Workspace convention (plugins/workspace.py): `workspace=` uint8 scratch, sizes from `mla_decode_workspace_bytes`
and `mla_prefill_workspace_bytes`.

Same signatures as plugins.mla.reference; the cache is updated in place and returned.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from k3deploy.plugins.common import index_i32, num_sms
from k3deploy.plugins.workspace import WORKSPACE_ALIGN, Workspace, plan_bytes

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")   # as Triton reads it


@triton.jit
def _write_latent(lat_ptr, cache_ptr, bt_ptr, ctx_ptr, b, stride_lat, stride_bt, BS, DL: tl.constexpr,
                  BDL: tl.constexpr):
    """cache[block_tables[b, p // BS], p % BS] = latent[b] at p = context_lens[b] (BS may be a runtime int)."""
    pos = tl.load(ctx_ptr + b)
    blk = tl.load(bt_ptr + b * stride_bt + pos // BS).to(tl.int64)
    d = tl.arange(0, BDL)
    x = tl.load(lat_ptr + b * stride_lat + d, mask=d < DL)
    tl.store(cache_ptr + (blk * BS + pos % BS) * DL + d, x.to(cache_ptr.dtype.element_ty), mask=d < DL)


@triton.jit
def _write_latent_kernel(lat_ptr, cache_ptr, bt_ptr, ctx_ptr, stride_lat, stride_bt,
                         BS: tl.constexpr, DL: tl.constexpr, BDL: tl.constexpr):
    _write_latent(lat_ptr, cache_ptr, bt_ptr, ctx_ptr, tl.program_id(0), stride_lat, stride_bt, BS, DL, BDL)


@triton.jit
def _mla_attend(q_ptr, cache_ptr, bt_row, b, hh, hmask, stride_qb, stride_qh, start, end, qscale, BS,
                R: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr):
    """Online softmax of BH heads (hh, masked by hmask) of sequence b over its cached tokens [start, end), read
    through the block-table row `bt_row` in [BN, R+DR] tiles that each lie inside one paged block (BN divides BS;
    BS may be a runtime int). qscale = softmax scale * log2(e). Returns (acc [BH, R] fp32 unnormalized, m [BH] base-2
    running max, l [BH] denominator; l = 0 for an empty range)."""
    dr = tl.arange(0, R)
    dp = tl.arange(0, DR)
    rn = tl.arange(0, BN)
    DL: tl.constexpr = R + DR
    q_base = q_ptr + b * stride_qb + hh[:, None] * stride_qh
    qn = tl.load(q_base + dr[None, :], mask=hmask[:, None], other=0.0)                  # [BH, R]
    qp = tl.load(q_base + R + dp[None, :], mask=hmask[:, None], other=0.0)              # [BH, DR]
    m_i = tl.zeros([BH], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, R], dtype=tl.float32)
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
    return acc, m_i, l_i


@triton.jit
def _mla_split_kernel(
    q_ptr, cache_ptr, bt_ptr, ctx_ptr, po_ptr, plse_ptr, out_ptr,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, sm_scale,
    H, NSPLIT,
    BS: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, DIRECT: tl.constexpr,
):
    """grid (head groups, splits, B). One program: BH heads of one sequence over one of NSPLIT equal parts of ITS
    context (L = context_lens[b] + 1 tokens; a part is cdiv(L, NSPLIT) rounded up to BN), so a sequence shorter than
    the block-table width still spreads over all splits (mixed batches, CUDA graphs sized for the longest context).
    BN divides BS and the part is a multiple of BN, so every [BN, 576] tile lies inside ONE paged block:
    its block id is one scalar load and the tile is BN*576 contiguous elements (coalesced 16-byte loads that
    the pipeliner turns into cp.async stages), read once for all BH heads. DIRECT (NSPLIT = 1): the normalized
    output goes to out [B, H, R] in its dtype, with no partials and no combine."""
    hg = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2)
    hh = hg * BH + tl.arange(0, BH)
    hmask = hh < H
    dr = tl.arange(0, R)
    L = tl.load(ctx_ptr + b) + 1
    part = tl.cdiv(tl.cdiv(L, NSPLIT), BN) * BN
    start = sp * part
    end = tl.minimum(start + part, L)
    acc, m_i, l_i = _mla_attend(q_ptr, cache_ptr, bt_ptr + b.to(tl.int64) * stride_bt, b, hh, hmask, stride_qb,
                                stride_qh, start, end, sm_scale * 1.4426950408889634, BS, R, DR, BH, BN)
    # partial results: acc / l and lse (base 2)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + hh[:, None] * stride_oh + dr[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        off = (b * H + hh) * NSPLIT + sp
        tl.store(po_ptr + off[:, None].to(tl.int64) * R + dr[None, :], o, mask=hmask[:, None])
        tl.store(plse_ptr + off, lse, mask=hmask)


@triton.jit
def _mla_combine_kernel(po_ptr, plse_ptr, out_ptr, H, NSPLIT, stride_ob, stride_oh,
                        R: tl.constexpr, BSPLIT: tl.constexpr):
    """out[b, h] = sum_s w_s po[s], w = softmax over splits of lse (base 2); splits in chunks of BSPLIT."""
    b = tl.program_id(0).to(tl.int64)      # prefill: b = token, b * H * R can pass 2^31
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


def _split_policy(BH: int, BN: int) -> tuple[int, int]:
    """(programs per SM to aim for, least tokens per split) of the decode's sequence split for a BH x BN tile: the
    64 x 64 tiles (216 KiB of shared memory: one resident program per SM) fill whole waves of SMs with 512 tokens
    per split or more (`_num_splits`), the smaller tiles (several resident per SM) aim at 8 per SM with 256."""
    return (1, 512) if BH >= 64 and BN >= 64 else (8, 256)


@functools.lru_cache(maxsize=4096)
def _num_splits(B: int, ngroups: int, capacity: int, sms: int, programs_per_sm: int, min_tok: int) -> int:
    """Splits of each sequence's context for B sequences x ngroups head groups on `sms` SMs, each split at least
    `min_tok` of the `capacity` tokens. Several resident programs per SM: enough programs for programs_per_sm x sms.
    One (programs_per_sm 1): the splits are equally long, so a partial last wave idles SMs for a whole split; the
    fewest splits whose programs fill their waves best (searched up to four waves)."""
    cap = max(1, triton.cdiv(capacity, min_tok))
    per = B * ngroups
    if programs_per_sm > 1:
        return max(1, min(triton.cdiv(programs_per_sm * sms, per), cap))
    best, fill = 1, (0, 1)                   # fill = programs / (waves x SMs) as a fraction (num, den)
    for n in range(1, min(cap, triton.cdiv(4 * sms, per)) + 1):
        num, den = per * n, triton.cdiv(per * n, sms) * sms
        if num * fill[1] > fill[0] * den:
            best, fill = n, (num, den)
    return best


def _launch_cfg(B, H, capacity, device, BN, BH):
    """Split-K along the sequence for BH-head groups and BN-key tiles: `_num_splits` with `_split_policy`'s programs
    per SM and least tokens per split. Fixed from the cache capacity (no host sync; CUDA-graph safe). Returns (BH,
    head groups, splits, tokens per split)."""
    pps, min_tok = _split_policy(BH, BN)
    ngroups = triton.cdiv(H, BH)
    nsplit = _num_splits(B, ngroups, capacity, num_sms(device), pps, min_tok)
    nsplit, tok = _split_tokens(capacity, nsplit, BN)
    return BH, ngroups, nsplit, tok


def _split_tokens(capacity, nsplit, BN):
    """(splits, tokens per split): tokens a multiple of BN, splits = what is needed to cover `capacity`."""
    tok = triton.cdiv(triton.cdiv(capacity, max(1, nsplit)), BN) * BN
    return triton.cdiv(capacity, tok), tok


def _device_cap(device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA `device`; None for the CPU (the Triton interpreter)."""
    device = torch.device(device)
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _decode_tiles(cap: tuple[int, int] | None, H: int, BS: int, itemsize: int = 2) -> tuple[int, int, int, int]:
    """(BH heads per program, BN keys per tile, stages, warps) of `_mla_split_kernel` on a GPU of compute capability
    `cap` (None: the interpreter); BN is capped by the largest power of 2 dividing BS (a tile never straddles two
    paged blocks). H <= 16 (K3 at TP=8): 16 x 32, 3 stages, 4 warps (91 KiB of shared memory at R=512, offline).
    More heads: 64-head groups (each latent tile read once for more heads) where they fit — sm_90 / sm_100: 64 x 64,
    2 stages, 8 warps (216 KiB, wgmma; 16- / 32-token blocks cap the key tile and keep 3 stages), sm_80 / 87 and the
    interpreter: 64 x 32, 3 stages, 8 warps (148 KiB of sm_80's 163) —, else (sm_86 / 89 / 120: 99 KiB per block)
    16-head groups as for H <= 16.
    A cache of `itemsize` 4 (fp32: the runtime's pools unless dense_dtype is bf16) doubles every tile's bytes
    (offline Triton 3.6, R=512): sm_90 / 100 take 16 x 32 (180 KiB) up to 16 heads and 64 x 16 (220 KiB) above,
    sm_80 / 87 16 x 16 (108 KiB), the 99 KiB GPUs 16 x 16 with 2 stages (104 KiB: too big there at R=512; the
    launch's out-of-resources error becomes a ValueError asking for a 16-bit cache, `mla_decode`)."""
    wide = cap is not None and cap[0] in (9, 10)          # 227 KiB of shared memory per block
    if H <= 16:
        bh, bn = 16, 32
    elif cap is None or cap in ((8, 0), (8, 7)):
        bh, bn = 64, 32
    elif wide:
        bh, bn = 64, 64
    else:
        bh, bn = 16, 32
    if itemsize > 2 and cap is not None:
        bh, bn = (bh, 32 if bh <= 16 else 16) if wide else (16, 16)
    bn = min(bn, _pow2_divisor(BS))
    # 2 stages only for the 64 x 64 tile (216 KiB; capped by a 16- or 32-token block it keeps 3, which is faster
    # there) and for fp32 on the 99 KiB GPUs
    small = itemsize > 2 and cap is not None and not wide and cap not in ((8, 0), (8, 7))
    stages = 2 if (bh >= 64 and bn >= 64) or small else 3
    return bh, bn, stages, 4 if bh <= 16 else 8


def _default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def mla_decode_workspace_bytes(batch: int, num_heads: int, kv_lora_rank: int, max_blocks: int, block_size: int, *,
                               device=None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Workspace bytes of :func:`mla_decode` (split partials `po [B*H*S, R]` fp32, `plse [B*H*S]` fp32) for every
    batch <= `batch` and block-table width <= `max_blocks` (the split count S shrinks as B grows, so the bound is
    the max over B' <= batch). device: where the kernel runs (its SM count and compute capability set the tiles and
    S: `_decode_tiles`, `_split_policy`; default: CUDA if present); dtype: the latent cache's (its element size
    sets the tiles too)."""
    dev = torch.device(device) if device is not None else _default_device()
    BH, BN = _decode_tiles(_device_cap(dev), int(num_heads), int(block_size), dtype.itemsize)[:2]
    pps, min_tok = _split_policy(BH, BN)
    return _decode_ws_bytes(int(batch), int(num_heads), int(kv_lora_rank), int(max_blocks), int(block_size),
                            num_sms(dev), BH, pps, min_tok)


@functools.lru_cache(maxsize=256)   # evaluated by every TensorRT enqueue: cache the O(batch) bound
def _decode_ws_bytes(batch, num_heads, kv_lora_rank, max_blocks, block_size, num_sms, BH, programs_per_sm,
                     min_tok) -> int:
    capacity = max_blocks * block_size
    if batch <= 0 or capacity <= 0:
        return 0
    rows = 0
    ngroups = triton.cdiv(num_heads, BH)
    for b in range(1, int(batch) + 1):   # nsplit(b) <= this bound, which is monotone in the capacity
        rows = max(rows, b * num_heads * _num_splits(b, ngroups, capacity, num_sms, programs_per_sm, min_tok))
    return plan_bytes([((rows, kv_lora_rank), torch.float32), ((rows,), torch.float32)])


def _pow2_divisor(n: int) -> int:
    return n & -n


def _check_triton_inputs(op: str, is_cuda: bool, R: int, DR: int) -> None:
    """The Triton MLA kernels' own limits, as one ValueError naming the field: CPU tensors need the interpreter
    (TRITON_INTERPRET=1 before this module is imported), and the latent widths R (kv_lora_rank) and Dr (rope dim,
    the cache width minus R) must be powers of 2 (their tiles are `tl.arange` ranges; K3: 512 and 64)."""
    if not is_cuda and not _INTERPRET:
        raise ValueError(f"{op}: CPU tensors run the Triton kernels in the interpreter: set TRITON_INTERPRET=1 before "
                         "plugins.mla.kernels is imported" + (", or pass graph_safe=False (torch SDPA)"
                                                              if op == "mla_prefill" else ""))
    for name, v in (("kv_lora_rank", R), ("rope dim (cache width - kv_lora_rank)", DR)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"{op}: {name} = {v}: the Triton kernels need a power of 2 (K3: kv_lora_rank 512, "
                             "rope 64)")


def mla_decode(q_abs, latent, cache, block_tables, context_lens, *, num_heads: int, kv_lora_rank: int, scale: float,
               out=None, workspace: torch.Tensor | None = None):
    """MlaDecode (MODEL.md §5.3): writes latent[b] at context_lens[b], attends over context_lens[b]+1 latents.

    Tiles and the split along the sequence: `_decode_tiles` and `_split_policy` per GPU generation and cache dtype.
    Inputs already contiguous, in the cache dtype and with int32 metadata (what the TensorRT plugin hands over) are
    used without copies. CPU tensors run under the Triton interpreter (TRITON_INTERPRET=1).

    Args:
        q_abs [B, H, R+Dr] (q_nope·W_UK ‖ q_pe), latent [B, R+Dr]: act; R = kv_lora_rank, R and Dr powers of 2.
        cache [NB, BS, R+Dr] act: the paged latent pool (block 0 = the padding sentinel), contiguous.
        block_tables [B, MB], context_lens [B]: int (schema: plugins/mla/reference.py).
        num_heads, kv_lora_rank, scale: H, R and the softmax scale (MODEL.md §5.3).
        out: optional [B, H, R] destination in the cache dtype.
        workspace: optional uint8 scratch (size: :func:`mla_decode_workspace_bytes`) for the split partials; a
            smaller one (sized for another GPU) gets fewer, longer splits.
    Returns:
        (out_latent [B, H, R] in the cache dtype, cache): the cache updated in place.
    Raises:
        ValueError on CPU tensors outside the interpreter, for kv_lora_rank or the rope width not a power of 2, on
        CUDA for a cache block size that is not a multiple of 16, and for tiles the GPU's shared memory cannot hold
        (an fp32 cache on a 99 KiB GPU)."""
    B, H, DL = q_abs.shape
    R = kv_lora_rank
    DR = DL - R
    NB, BS, DLc = cache.shape
    assert H == num_heads and DLc == DL and latent.shape == (B, DL) and cache.is_contiguous()
    _check_triton_inputs("mla_decode", q_abs.is_cuda, R, DR)
    dev = q_abs.device
    if q_abs.dtype != cache.dtype:
        q_abs = q_abs.to(cache.dtype)
    if q_abs.stride(-1) != 1:
        q_abs = q_abs.contiguous()
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    bt, ctx = index_i32(block_tables), index_i32(context_lens)
    if out is None:
        out = torch.empty(B, H, R, dtype=q_abs.dtype, device=dev)
    if B == 0:
        return out, cache
    _write_latent_kernel[(B,)](latent, cache, bt, ctx, latent.stride(0), bt.stride(0),
                               BS=BS, DL=DL, BDL=triton.next_power_of_2(DL), num_warps=4)
    capacity = bt.shape[1] * BS
    BH, BN, stages, warps = _decode_tiles(_device_cap(dev), H, BS, cache.element_size())
    if BN < 16 and dev.type == "cuda":
        raise ValueError(f"cache block_size = {BS}: the GPU decode kernel needs blocks of a multiple of 16 tokens "
                         "(tl.dot tiles); allocate the latent pool with block_size 16, 32 or 64")
    BH, ngroups, nsplit, tok = _launch_cfg(B, H, capacity, dev, BN, BH)
    ws = Workspace(workspace, dev, "mla_decode")
    if not ws.fits([((B * H * nsplit, R), torch.float32), ((B * H * nsplit,), torch.float32)]):
        # a workspace sized for another device (SM count): fewer, longer splits
        fit = (ws.remaining() - WORKSPACE_ALIGN) // ((R + 1) * 4 * B * H)
        nsplit, tok = _split_tokens(capacity, max(1, fit), BN)
    direct = nsplit == 1
    po = ws.empty((0 if direct else B * H * nsplit, R), torch.float32)
    plse = ws.empty((0 if direct else B * H * nsplit,), torch.float32)
    try:
        _mla_split_kernel[(ngroups, nsplit, B)](
            q_abs, cache, bt, ctx, po, plse, out, q_abs.stride(0), q_abs.stride(1), bt.stride(0), out.stride(0),
            out.stride(1), float(scale), H, nsplit, BS=BS, R=R, DR=DR, BH=BH, BN=BN, DIRECT=direct,
            num_warps=warps, num_stages=stages)
    except triton.runtime.errors.OutOfResources as e:
        raise ValueError(f"mla_decode: the {BH} x {BN} tiles over a {cache.dtype} latent cache of width {DL} do not "
                         f"fit this GPU ({e}); use a 16-bit cache (the torch backend's "
                         "LLM(dense_dtype='bfloat16') allocates bf16 latents)") from e
    if not direct:
        _mla_combine_kernel[(B, H)](po, plse, out, H, nsplit, out.stride(0), out.stride(1),
                                    R=R, BSPLIT=min(16, max(2, triton.next_power_of_2(nsplit))), num_warps=4)
    return out, cache


# ------------------------------------------------------------------------------------------ prefill, graph-safe path
@triton.jit
def _seq_of_token(cu_ptr, N, t, BNS: tl.constexpr):
    """Sequence index of packed token t: the number of n in 1..N with cu_seqlens[n] <= t (chunked; no host)."""
    cnt = tl.full((), 0, tl.int32)
    for s0 in range(0, N, BNS):
        idx = s0 + tl.arange(0, BNS)
        c = tl.load(cu_ptr + 1 + idx, mask=idx < N, other=2147483647)
        cnt += tl.sum((c <= t).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _find_row_tile(cu_ptr, N, H, pid, BM: tl.constexpr, BNS: tl.constexpr):
    """(sequence, row tile) of program `pid` when sequence n owns cdiv(len_n * H, BM) consecutive programs;
    sequence -1 for programs past the last tile (the grid is the upper bound cdiv(T*H, BM) + N)."""
    seq = tl.full((), -1, tl.int32)
    tile = tl.full((), 0, tl.int32)
    base = tl.full((), 0, tl.int32)
    for s0 in range(0, N, BNS):
        idx = s0 + tl.arange(0, BNS)
        m = idx < N
        a = tl.load(cu_ptr + idx, mask=m, other=0)
        b = tl.load(cu_ptr + idx + 1, mask=m, other=0)
        nt = tl.where(m, ((b - a) * H + BM - 1) // BM, 0)
        end = tl.cumsum(nt, axis=0) + base
        start = end - nt
        hit = m & (start <= pid) & (pid < end)
        seq = tl.maximum(seq, tl.max(tl.where(hit, idx, -1), axis=0))
        tile += tl.sum(tl.where(hit, pid - start, 0), axis=0)
        base += tl.sum(nt, axis=0)
    return seq, tile


@triton.jit
def _write_latents_varlen_kernel(lat_ptr, cache_ptr, bt_ptr, cu_ptr, ctx_ptr, N, stride_lat, stride_bt, BS,
                                 DL: tl.constexpr, BDL: tl.constexpr, BNS: tl.constexpr):
    """grid (T,): latent row t -> cache position context_lens[n] + (t - cu_seqlens[n]) of its sequence n. BS (the
    cache block size) is a runtime value: the AOT form (plugins/mla/trt_aot_prefill.py) takes it from the shapes."""
    t = tl.program_id(0)
    n = _seq_of_token(cu_ptr, N, t, BNS)
    pos = tl.load(ctx_ptr + n) + t - tl.load(cu_ptr + n)
    blk = tl.load(bt_ptr + n.to(tl.int64) * stride_bt + pos // BS).to(tl.int64)
    d = tl.arange(0, BDL)
    x = tl.load(lat_ptr + t.to(tl.int64) * stride_lat + d, mask=d < DL)
    tl.store(cache_ptr + (blk * BS + pos % BS) * DL + d, x.to(cache_ptr.dtype.element_ty), mask=d < DL)


@triton.jit
def _mla_absorb_q_kernel(q_ptr, w_ptr, qa_ptr, T, H, stride_qt, stride_qh, stride_w,
                         DN: tl.constexpr, BDN: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, DR: tl.constexpr,
                         BT: tl.constexpr, BR: tl.constexpr):
    """grid (cdiv(T, BT), H, R // BR): qa[t, h, r] = sum_d q_nope[t, h, d] W_UK_h[d, r] (W_UK_h = kv_b rows
    h*(DN+DV) .. h*(DN+DV)+DN-1), fp32 accumulation; the r-tile-0 programs also copy q_pe to qa[t, h, R:]."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    pid_r = tl.program_id(2)
    tt = pid_t * BT + tl.arange(0, BT)
    tm = tt < T
    dn = tl.arange(0, BDN)
    dm = dn < DN
    rr = pid_r * BR + tl.arange(0, BR)
    q_rows = q_ptr + tt[:, None].to(tl.int64) * stride_qt + h * stride_qh
    qn = tl.load(q_rows + dn[None, :], mask=tm[:, None] & dm[None, :], other=0.0)            # [BT, BDN]
    w = tl.load(w_ptr + (h * (DN + DV) + dn)[:, None].to(tl.int64) * stride_w + rr[None, :],
                mask=dm[:, None], other=0.0)                                                  # [BDN, BR]
    acc = tl.dot(qn.to(w.dtype), w)                                                           # [BT, BR] fp32
    qa_rows = qa_ptr + (tt[:, None].to(tl.int64) * H + h) * (R + DR)
    tl.store(qa_rows + rr[None, :], acc.to(qa_ptr.dtype.element_ty), mask=tm[:, None])
    if pid_r == 0:
        dp = tl.arange(0, DR)
        qp = tl.load(q_rows + DN + dp[None, :], mask=tm[:, None], other=0.0)
        tl.store(qa_rows + R + dp[None, :], qp.to(qa_ptr.dtype.element_ty), mask=tm[:, None])


@triton.jit
def _tile_rows(cu_ptr, ctx_ptr, n, tile, H, BM: tl.constexpr):
    """Rows of row tile `tile` of sequence n (`_find_row_tile`; rows = token-major, head-minor: row = t*H + h):
    (rows [BM] global row ids; rmask [BM] rows of sequence n; lim [BM] = keys 0 .. lim-1 visible to each row
    (context_lens[n] + its position + 1: the causal limit; 1 for masked rows); kv_end = the largest lim).
    Called after the program's `n < 0` return: loading before it makes ptxas spill (Triton 3.6, sm_90)."""
    t0 = tl.load(cu_ptr + n)
    t1 = tl.load(cu_ptr + n + 1)
    ctx = tl.load(ctx_ptr + n)
    row0 = t0 * H + tile * BM
    rows = row0 + tl.arange(0, BM)
    rmask = rows < t1 * H
    lim = tl.where(rmask, ctx + rows // H - t0 + 1, 1)
    kv_end = ctx + (tl.minimum(row0 + BM, t1 * H) - 1) // H - t0 + 1
    return rows, rmask, lim, kv_end


@triton.jit
def _prefill_attend(qa_ptr, cache_ptr, bt_row, rows, rmask, lim, start, end, qscale, BS,
                    R: tl.constexpr, DR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Online softmax of the BM query rows `rows` of one sequence (absorbed queries qa [T*H, R+DR]) over its cached
    keys [start, end) (start a multiple of BN), row r seeing keys < lim[r]; [BN, R+DR] latent tiles inside one paged
    block each (BN divides BS), read once for all BM rows. qscale = softmax scale * log2(e). Returns (acc [BM, R]
    fp32 unnormalized, m [BM] base-2 running max, l [BM] denominator; l = 0 for a row that sees no key of the range)."""
    dr = tl.arange(0, R)
    dp = tl.arange(0, DR)
    rn = tl.arange(0, BN)
    DL: tl.constexpr = R + DR
    q_base = qa_ptr + rows[:, None].to(tl.int64) * DL
    qn = tl.load(q_base + dr[None, :], mask=rmask[:, None], other=0.0)                        # [BM, R]
    qp = tl.load(q_base + R + dp[None, :], mask=rmask[:, None], other=0.0)                    # [BM, DR]
    m_i = tl.zeros([BM], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, R], dtype=tl.float32)
    last = tl.maximum(end - 1, 0)
    # block id of the next tile loaded one iteration ahead (as in _mla_split_kernel: lets the pipeliner stage tiles)
    blk_next = tl.load(bt_row + tl.minimum(start, last) // BS).to(tl.int64)
    for n0 in range(start, end, BN):
        blk = blk_next
        blk_next = tl.load(bt_row + tl.minimum(n0 + BN, last) // BS).to(tl.int64)
        tok = n0 + rn
        tmask = tok < end
        tile_ptr = cache_ptr + (blk * BS + n0 % BS) * DL + rn[:, None] * DL
        kn = tl.load(tile_ptr + dr[None, :], mask=tmask[:, None], other=0.0)                  # [BN, R]
        kp = tl.load(tile_ptr + R + dp[None, :], mask=tmask[:, None], other=0.0)              # [BN, DR]
        s = tl.dot(qn, tl.trans(kn)) + tl.dot(qp, tl.trans(kp))                              # [BM, BN] fp32
        s = s * qscale
        s = tl.where(tok[None, :] < lim[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row with no visible key yet (a later part of a split key range) keeps m = -inf: exponents from 0
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kn.dtype), kn)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _mla_prefill_attn_kernel(
    qa_ptr, cache_ptr, bt_ptr, cu_ptr, ctx_ptr, ol_ptr, N, H, stride_bt, sm_scale, BS,
    R: tl.constexpr, DR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BNS: tl.constexpr,
):
    """grid (cdiv(T*H, BM) + N,). The absorbed paged kernel of mla_decode generalized to several query tokens:
    one program = BM consecutive query rows (token-major, head-minor: row = t*H + h) of ONE sequence n; row r of
    token t sees cached latents 0 .. context_lens[n] + (t - cu_seqlens[n]) (its causal limit). Each [BN, 576]
    latent tile lies inside one paged block (BN divides BS) and is read once for all BM rows; fp32 online softmax
    (base 2); values = first R latent columns; out_latent[r] = softmax-weighted sum (act dtype). BS (cache block
    size, a multiple of BN) is a runtime value, as in the AOT form."""
    n, tile = _find_row_tile(cu_ptr, N, H, tl.program_id(0), BM, BNS)
    if n < 0:
        return
    rows, rmask, lim, kv_end = _tile_rows(cu_ptr, ctx_ptr, n, tile, H, BM)
    acc, m_i, l_i = _prefill_attend(qa_ptr, cache_ptr, bt_ptr + n.to(tl.int64) * stride_bt, rows, rmask, lim, 0,
                                    kv_end, sm_scale * 1.4426950408889634, BS, R, DR, BM, BN)
    o = acc / l_i[:, None]
    dr = tl.arange(0, R)
    tl.store(ol_ptr + rows[:, None].to(tl.int64) * R + dr[None, :], o.to(ol_ptr.dtype.element_ty),
             mask=rmask[:, None])


@triton.jit
def _mla_prefill_attn_split_kernel(
    qa_ptr, cache_ptr, bt_ptr, cu_ptr, ctx_ptr, po_ptr, plse_ptr, N, H, NSPLIT, stride_bt, sm_scale, BS,
    R: tl.constexpr, DR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BNS: tl.constexpr,
):
    """grid (cdiv(T*H, BM) + N, NSPLIT): `_mla_prefill_attn_kernel` with each row tile's keys [0, kv_end) cut into
    NSPLIT parts (cdiv(kv_end, NSPLIT) keys rounded up to BN; the last parts may be empty), one program per (tile,
    part), for prompts whose row tiles alone leave SMs idle (a 256-token chunk after a long context at 12 heads:
    48 tiles). Row r's partial result goes to po [r*NSPLIT + s, R] fp32 (acc / l) and plse [r*NSPLIT + s] (base-2
    log-sum-exp, -inf where the part holds no visible key); `_mla_combine_kernel` merges the parts, as in decode."""
    sp = tl.program_id(1)
    n, tile = _find_row_tile(cu_ptr, N, H, tl.program_id(0), BM, BNS)
    if n < 0:
        return
    rows, rmask, lim, kv_end = _tile_rows(cu_ptr, ctx_ptr, n, tile, H, BM)
    part = tl.cdiv(tl.cdiv(kv_end, NSPLIT), BN) * BN
    start = sp * part
    if start >= kv_end:             # an empty part (a short tile's keys in few parts): no q load, no partial rows
        tl.store(plse_ptr + rows.to(tl.int64) * NSPLIT + sp, tl.full([BM], float("-inf"), tl.float32), mask=rmask)
        return
    acc, m_i, l_i = _prefill_attend(qa_ptr, cache_ptr, bt_ptr + n.to(tl.int64) * stride_bt, rows, rmask, lim,
                                    start, tl.minimum(start + part, kv_end), sm_scale * 1.4426950408889634, BS,
                                    R, DR, BM, BN)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    off = rows.to(tl.int64) * NSPLIT + sp
    dr = tl.arange(0, R)
    tl.store(po_ptr + off[:, None] * R + dr[None, :], o, mask=rmask[:, None])
    tl.store(plse_ptr + off, lse, mask=rmask)


@triton.jit
def _mla_up_kernel(ol_ptr, w_ptr, out_ptr, T, H, stride_w, stride_out,
                   DN: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BD: tl.constexpr):
    """grid (cdiv(T, BT), H, cdiv(DV, BD)): out[t, h*DV + d] = sum_r out_latent[t, h, r] W_UV_h[d, r]
    (W_UV_h = kv_b rows h*(DN+DV)+DN ..), fp32 accumulation."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    pid_d = tl.program_id(2)
    tt = pid_t * BT + tl.arange(0, BT)
    tm = tt < T
    dd = pid_d * BD + tl.arange(0, BD)
    dm = dd < DV
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    w_rows = w_ptr + (h * (DN + DV) + DN + dd)[None, :].to(tl.int64) * stride_w
    for k0 in range(0, R, BK):
        kk = k0 + tl.arange(0, BK)
        ol = tl.load(ol_ptr + (tt[:, None].to(tl.int64) * H + h) * R + kk[None, :], mask=tm[:, None], other=0.0)
        w = tl.load(w_rows + kk[:, None], mask=dm[None, :], other=0.0)                      # [BK, BD] = W_UV^T
        acc += tl.dot(ol.to(w.dtype), w)
    tl.store(out_ptr + tt[:, None].to(tl.int64) * stride_out + h * DV + dd[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=tm[:, None] & dm[None, :])


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# split key ranges of the prefill attention (`_prefill_splits`): at most this many parts, each covering at least
# this many keys of the block-table capacity
PREFILL_MAX_SPLITS = 8
PREFILL_MIN_SPLIT_KEYS = 1024


def _prefill_splits(tiles: int, sms: int, capacity: int) -> int:
    """Key-range parts of the prefill attention for `tiles` row tiles with rows (at most cdiv(T*H, BM) + N - 1 for
    N sequences) on `sms` SMs (one 64 x 64 program per SM on sm_90; on other GPUs several 32 x 32 programs fit an
    SM, so the rule splits more than needed there: untimed), from host-known sizes only (CUDA-graph safe):
    1 when the tiles fill the SMs, else the s <= PREFILL_MAX_SPLITS (and <= capacity /
    PREFILL_MIN_SPLIT_KEYS, capacity = the block-table width x block size: the longest context the batch may hold,
    not this one's) with the least time in waves, ceil(tiles * s / sms) / s (the smaller s on a tie). Parts are
    sized from each tile's own keys: a short prompt in a wide table splits into parts of few keys, most of them
    empty (they only store their -inf log-sum-exp)."""
    if tiles >= sms:
        return 1
    smax = max(1, min(PREFILL_MAX_SPLITS, capacity // PREFILL_MIN_SPLIT_KEYS))
    return min(range(1, smax + 1), key=lambda s: (-(-tiles * s // sms) / s, s))


def mla_prefill_workspace_bytes(num_tokens: int, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, *,
                                dtype: torch.dtype = torch.bfloat16, device=None) -> int:
    """Workspace bytes of the graph-safe :func:`mla_prefill` path for up to `num_tokens` packed tokens: absorbed
    queries `[T*H, R+Dr]` and latent outputs `[T*H, R]` in the cache dtype `dtype`, plus, for prompts split along
    the keys (`_prefill_splits`), the partials `po [T*H*S, R]` and `plse [T*H*S]` fp32 (bound: the largest
    T'*H*S over T' <= num_tokens, any number of sequences, any context length). device: where the kernels run (its SM
    count and compute capability set S and the row tile; default: CUDA if present). A smaller workspace makes
    `mla_prefill` use fewer parts."""
    rows = int(num_tokens) * int(num_heads)
    if rows <= 0:
        return 0
    dev = torch.device(device) if device is not None else _default_device()
    cap = _device_cap(dev)
    bm = _prefill_attn_tiles(cap[0] if cap else None, dtype.itemsize, 64)[0]
    return plan_bytes([((rows, kv_lora_rank + qk_rope_head_dim), dtype), ((rows, kv_lora_rank), dtype)]
                      + _prefill_partials(int(num_tokens), int(num_heads), int(kv_lora_rank), bm, num_sms(dev)))


@functools.lru_cache(maxsize=256)   # evaluated by every TensorRT enqueue: cache the O(num_tokens) bound
def _prefill_partials(num_tokens, num_heads, kv_lora_rank, bm, sms) -> list:
    """The partials of the largest split over T' <= num_tokens tokens in any number of sequences (T' tokens in N
    sequences: up to cdiv(T' H, bm) + N - 1 row tiles with rows, N unbounded: zero-length sequences count):
    [(po), (plse)] or []."""
    most = [1] * (sms + 1)          # most[t] = the most parts any tile count >= t gets (>= sms tiles: 1)
    for t in range(sms - 1, 0, -1):
        most[t] = max(most[t + 1], _prefill_splits(t, sms, 1 << 62))
    prows = 0
    for t in range(1, num_tokens + 1):
        lo = triton.cdiv(t * num_heads, bm)          # tiles with rows, one sequence; more sequences: more
        if lo < sms and most[lo] > 1:
            prows = max(prows, t * num_heads * most[lo])
    return [((prows, kv_lora_rank), torch.float32), ((prows,), torch.float32)] if prows else []


def _prefill_attn_tiles(cap_major: int | None, itemsize: int, block_size: int) -> tuple[int, int, int]:
    """(BM query rows, BN keys, warps) of `_mla_prefill_attn_kernel` for a GPU of compute capability major
    `cap_major` (None: the CPU interpreter) and a cache of `itemsize`-byte elements; BN is capped by the largest
    power of 2 dividing `block_size` (a key tile never straddles two cache blocks).
    sm_90: 64 rows run on the warpgroup MMA (faster than the 32 x 32 mma.sync tiles); the
    key tile keeps the kernel's shared memory within sm_90's 227 KiB at R=512 (offline Triton 3.6: bf16 64 x 64 and
    fp32 64 x 16 216 KiB each, fp32 64 x 64 432 KiB). Other GPUs: bf16 32 x 32 (74 KiB), fp32 16 x 16 with 4 warps
    (104 KiB: fits sm_80's 163 KiB, not the 99 KiB of sm_86 / 89 / 120, where `_graph_safe_default` keeps fp32 caches
    on SDPA; fp32 32 x 32 needs 208 KiB)."""
    if cap_major is None:
        bm, bn, nw = 16, 32, 4
    elif cap_major == 9:
        bm, bn, nw = 64, (64 if itemsize <= 2 else 16), 8
    else:
        bm, bn, nw = (32, 32, 8) if itemsize <= 2 else (16, 16, 4)
    return bm, min(bn, _pow2_divisor(block_size)), nw


def _graph_safe_default(is_cuda: bool, capturing: bool, has_workspace: bool, block_size: int,
                        cap_major: int | None = None, itemsize: int = 2) -> bool:
    """`mla_prefill`'s path when graph_safe is None: graph-safe under capture or with a workspace, and on CUDA when
    the cache block size is a multiple of 16 (its key tiles need 16 tokens) and the attention tiles are known to fit
    the GPU's shared memory: 16-bit caches anywhere, fp32 caches on sm_90 (`_prefill_attn_tiles`); else SDPA."""
    fits = itemsize <= 2 or cap_major == 9
    return capturing or has_workspace or (is_cuda and _pow2_divisor(block_size) >= 16 and fits)


def _mla_prefill_graph_safe(q, latent, kv_b, cache, bt, cu, ctx, out, H, Dn, Dv, R, scale, workspace, cap_major):
    T = q.shape[0]
    N = ctx.shape[0]
    NB, BS, DL = cache.shape
    DR = DL - R
    dev = q.device
    gpu = dev.type == "cuda"
    if q.stride(-1) != 1:
        q = q.contiguous()
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    kv_b = kv_b if kv_b.stride(-1) == 1 else kv_b.contiguous()
    if T == 0:
        return out, cache
    BNS = 64
    _write_latents_varlen_kernel[(T,)](latent, cache, bt, cu, ctx, N, latent.stride(0), bt.stride(0),
                                       BS=BS, DL=DL, BDL=triton.next_power_of_2(DL), BNS=BNS, num_warps=4)
    ws = Workspace(workspace, dev, "mla_prefill")
    qa = ws.empty((T * H, DL), cache.dtype)
    ol = ws.empty((T * H, R), cache.dtype)
    BT = 64 if gpu else 16
    BR = min(R, 128 if gpu else 64)
    _mla_absorb_q_kernel[(triton.cdiv(T, BT), H, R // BR)](
        q, kv_b, qa, T, H, q.stride(0), q.stride(1), kv_b.stride(0),
        DN=Dn, BDN=max(16, triton.next_power_of_2(Dn)), DV=Dv, R=R, DR=DR, BT=BT, BR=BR,
        num_warps=8 if gpu else 4)   # sm_90: no spills at 8 warps (4 warps spill at BR=128)
    BM, BN, nw = _prefill_attn_tiles(cap_major, cache.element_size(), BS)
    if BN < 16 and gpu:
        raise ValueError(f"cache block_size = {BS}: the GPU prefill kernel needs blocks of a multiple of 16 tokens")
    tiles = triton.cdiv(T * H, BM) + N                 # grid: an upper bound; programs past the last tile return
    nsplit = _prefill_splits(tiles - 1, num_sms(dev), bt.shape[1] * BS)

    def partials(s):
        return [((T * H * s, R), torch.float32), ((T * H * s,), torch.float32)]
    if nsplit > 1 and not ws.fits(partials(nsplit)):
        # a workspace sized for another device or dtype: as many parts as fit
        nsplit = next((s for s in range(nsplit - 1, 1, -1) if ws.fits(partials(s))), 1)
    attn_cfg = dict(BS=BS, R=R, DR=DR, BM=BM, BN=BN, BNS=BNS, num_warps=nw, num_stages=2)
    if nsplit == 1:
        _mla_prefill_attn_kernel[(tiles,)](qa, cache, bt, cu, ctx, ol, N, H, bt.stride(0), float(scale), **attn_cfg)
    else:
        po, plse = (ws.empty(shape, dt) for shape, dt in partials(nsplit))
        _mla_prefill_attn_split_kernel[(tiles, nsplit)](qa, cache, bt, cu, ctx, po, plse, N, H, nsplit, bt.stride(0),
                                                        float(scale), **attn_cfg)
        _mla_combine_kernel[(T, H)](po, plse, ol, H, nsplit, H * R, R, R=R,
                                    BSPLIT=min(16, max(2, triton.next_power_of_2(nsplit))), num_warps=4)
    BD = min(64, max(16, triton.next_power_of_2(Dv)))
    _mla_up_kernel[(triton.cdiv(T, BT), H, triton.cdiv(Dv, BD))](
        ol, kv_b, out, T, H, kv_b.stride(0), out.stride(0),
        DN=Dn, DV=Dv, R=R, BT=BT, BK=min(R, 64), BD=BD, num_warps=4)
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
                qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int, scale: float, out=None,
                graph_safe: bool | None = None, workspace: torch.Tensor | None = None):
    """MlaPrefill (MODEL.md §5.2): writes the new latents, then causal attention over context + new tokens.

    Two paths. graph_safe=True: the absorbed Triton path (q_nope through W_UK, paged attention over the latents,
    W_UV after), four launches with fixed grids (five when each row tile's keys are split into parts merged by
    log-sum-exp, `_prefill_splits`: only when the row tiles alone leave SMs idle, e.g. a 256-token chunk after a
    long context at 12 heads), no host reads, scratch from `workspace`; the attention tiles: `_prefill_attn_tiles`.
    graph_safe=False: per sequence, gather + up-project the latents, torch SDPA (reads cu_seqlens / context_lens on
    the host). graph_safe=None (`_graph_safe_default`): the Triton path under CUDA-graph capture, with a workspace,
    and on CUDA when the cache block size is a multiple of 16 and the cache is 16-bit or the GPU sm_90 (there it is
    the faster path); else SDPA. The TensorRT plugin passes True.

    Args:
        q [T, H, Dn+Dr], latent [T, R+Dr], kv_b [H*(Dn+Dv), R]: act (R = kv_lora_rank and Dr powers of 2 on the
            Triton path).
        cache [NB, BS, R+Dr] act: the paged latent pool, contiguous.
        block_tables [N, MB], cu_seqlens [N+1], context_lens [N]: int (schema: plugins/mla/reference.py).
        num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank, scale: H, Dn, Dv, R, softmax scale (MODEL.md §5.2).
        out: optional [T, H*Dv] destination in q's dtype.
        graph_safe: the path (above).
        workspace: optional uint8 scratch of the Triton path (size: :func:`mla_prefill_workspace_bytes` with the
            cache's dtype); a smaller one (sized for another GPU) gets fewer key parts.
    Returns:
        (out [T, H*Dv] in q's dtype, cache): the cache updated in place.
    Raises:
        ValueError on the Triton path for a CUDA cache block size that is not a multiple of 16, CPU tensors outside
        the Triton interpreter (also when graph_safe=None picked it because a workspace was given), and
        kv_lora_rank or the rope width not a power of 2."""
    T, H, Dqk = q.shape
    Dn, Dv, R = qk_nope_head_dim, v_head_dim, kv_lora_rank
    NB, BS, DL = cache.shape
    assert H == num_heads and DL > R and cache.is_contiguous()
    cap = _device_cap(q.device)
    cap_major = cap[0] if cap else None
    if graph_safe is None:
        graph_safe = _graph_safe_default(q.is_cuda, _capturing(q.device), workspace is not None, BS, cap_major,
                                         cache.element_size())
    if out is None:
        out = torch.empty(T, H * Dv, dtype=q.dtype, device=q.device)
    if graph_safe:
        _check_triton_inputs("mla_prefill", q.is_cuda, R, DL - R)
        bt, cu, ctx = index_i32(block_tables), index_i32(cu_seqlens), index_i32(context_lens)
        return _mla_prefill_graph_safe(q, latent, kv_b, cache, bt, cu, ctx, out, H, Dn, Dv, R, scale, workspace,
                                       cap_major)
    _write_latents_prefill(latent, cache, block_tables, cu_seqlens, context_lens)
    cu = [int(x) for x in cu_seqlens.tolist()]
    ctxl = [int(x) for x in context_lens.tolist()]
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
