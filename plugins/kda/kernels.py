"""KDA Triton kernels (GPU; also run on CPU tensors under TRITON_INTERPRET=1). MODEL.md §4, DESIGN.md KdaDecode.

kda_decode : ONE fused kernel per layer step: conv-history update + SiLU, L2 norm q/k, q scale, lower-bound
             gate, beta sigmoid, delta rule on the fp32 state in place through slot indices ([S,H,V,K] = S^T per
             head), gated output RMSNorm. Each (token, head)'s state is split into V tiles of 16 / 32 / 64 rows
             (`_decode_block_v`), one program each; the last program of a (token, head) to finish (atomic counter)
             does the output norm over all V and the q/k conv-history store.
kda_prefill: Triton conv pass over the packed tokens + a fix-up of each sequence's first three tokens from the
             slot's conv history (L2 norm of q/k fused) + conv-history update + beta = sigmoid(b); then fla-core's
             chunk stages (gate cumsum, intra-chunk WY solve, inter-chunk state pass; one sequence: dense, several:
             static chunk indices) and our output kernel with the gated RMSNorm fused (for fla-core versions
             whose internal stages were not tested here: fla-core's whole `chunk_kda` + our gated-RMSNorm kernel);
             initial/final states gathered/scattered through slots by Triton copies. Where fla or CUDA is
             unavailable (CPU CI) the delta rule falls back to a torch token recurrence. No host sync (the TensorRT plugin relies on it), scratch
             from `workspace=` (`kda_prefill_workspace_bytes`); fla's intermediates still come from torch's caching
             allocator (plugins/trt_common.py says what that means for capture).

Same signatures as plugins.kda.reference; pools are updated in place and returned.
"""
from __future__ import annotations

import functools
import logging
import os
import types

import torch
import triton
import triton.language as tl

from k3deploy.plugins.common import index_i32
from k3deploy.plugins.workspace import Workspace, plan_bytes

_log = logging.getLogger(__name__)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_ASM = tl.constexpr(not _INTERPRET)     # inline PTX in kernels (GPU builds only)
_NEG_LOG2E = tl.constexpr(-1.4426950408889634)     # the conv pass folds SiLU's exp argument into its weights
_NEG_LN2 = tl.constexpr(-0.6931471805599453)
_LN2SQ = tl.constexpr(0.4804530139182014)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


# --------------------------------------------------------------------------------------------------
# Decode: fully fused
# --------------------------------------------------------------------------------------------------
@triton.jit
def _prefetch_l2(ptrs):
    """``prefetch.global.L2`` of the 128-byte line at each pointer (GPU only: inline PTX). Holds no data registers
    (one dummy output register per call), so a tile's DRAM reads start before the code that needs them; the later
    loads hit L2."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _conv_silu(x, hist, w, sel3):
    """Depthwise causal conv of one channel vector + SiLU. x [C] new input, hist [C, 4] (cols 0..2 = history,
    col 3 ignored), w [C, 4] -> (y [C] fp32, window [C, 4] = [h0, h1, h2, x])."""
    win = tl.where(sel3, x.to(tl.float32)[:, None], hist.to(tl.float32))
    y = tl.sum(win * w, axis=1)
    return y * _sigmoid(y), win


@triton.jit
def _store_hist(conv_base, ch, win, j4, slot):
    """New conv history of channels ch = window[:, 1:4] (the last three raw inputs); nothing for slot 0."""
    cdt = conv_base.dtype.element_ty
    m = (ch * 0 + slot) != 0           # a tensor comparison: the interpreter rejects scalar-combined masks
    tl.store(conv_base + ch * 3 + 0, tl.sum(tl.where((j4 == 1)[None, :], win, 0.0), axis=1).to(cdt), mask=m)
    tl.store(conv_base + ch * 3 + 1, tl.sum(tl.where((j4 == 2)[None, :], win, 0.0), axis=1).to(cdt), mask=m)
    tl.store(conv_base + ch * 3 + 2, tl.sum(tl.where((j4 == 3)[None, :], win, 0.0), axis=1).to(cdt), mask=m)


@triton.jit
def _kda_decode_kernel(
    qkv_ptr, f_ptr, b_ptr, g_ptr, convw_ptr, alog_ptr, dtb_ptr, onw_ptr,
    state_ptr, conv_ptr, slots_ptr, out_ptr, oacc_ptr, cnt_ptr,
    stride_qkv, stride_f, stride_b, stride_g, stride_out,
    lower_bound, norm_eps, scale,
    H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, BV: tl.constexpr, PREFETCH: tl.constexpr,
    IV_FAST: tl.constexpr = 0,
):
    """grid (B, H, K // BV), or (K // BV, B, H) with IV_FAST: a (token, head)'s V tiles launched side by side, so
    they share its q/k prologue reads in L2 and the last one's output norm follows soon. Each program owns the
    [BV, K] rows of S^T for value channels v0..v0+BV.
    PREFETCH (GPU only): the state tile is prefetched into L2 as soon as the slot is known, so its DRAM reads
    overlap the conv/norm/gate prologue (loading it into registers that early doubles the registers).
    q/k conv + L2 norm are recomputed by every V-tile program (cheap); the v conv, state and output rows are
    split. With several V tiles, the q/k conv history and the output RMSNorm (a reduction over all V) are done
    by the last program of the (token, head) to arrive (atomic counter, acq_rel; it resets the counter)."""
    if IV_FAST:
        iv = tl.program_id(0)
        t = tl.program_id(1)
        h = tl.program_id(2)
    else:
        t = tl.program_id(0)
        h = tl.program_id(1)
        iv = tl.program_id(2)
    NV: tl.constexpr = K // BV
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # slot 0 = the padding sentinel (CUDA-graph padding rows): its pools stay untouched (masked stores below)
    ck = tl.arange(0, K)
    cvv = iv * BV + tl.arange(0, BV)
    s_tile = state_ptr + (slot * H + h) * (K * K) + iv * BV * K        # [BV, K] fp32, contiguous rows
    if PREFETCH:
        _prefetch_l2(s_tile + tl.arange(0, BV * K // 32) * 32)
    j4 = tl.arange(0, 4)
    hist_mask = (j4 < 3)[None, :]
    sel3 = (j4 == 3)[None, :]
    conv_base = conv_ptr + slot * (3 * P * 3)
    cq = h * K + ck
    ckk = P + h * K + ck
    cv = 2 * P + h * K + cvv
    xq = tl.load(qkv_ptr + t * stride_qkv + cq)
    xk = tl.load(qkv_ptr + t * stride_qkv + ckk)
    xv = tl.load(qkv_ptr + t * stride_qkv + cv)
    hq = tl.load(conv_base + cq[:, None] * 3 + j4[None, :], mask=hist_mask, other=0.0)   # [K, 4]
    hk = tl.load(conv_base + ckk[:, None] * 3 + j4[None, :], mask=hist_mask, other=0.0)
    hv = tl.load(conv_base + cv[:, None] * 3 + j4[None, :], mask=hist_mask, other=0.0)
    yq, winq = _conv_silu(xq, hq, tl.load(convw_ptr + cq[:, None] * 4 + j4[None, :]), sel3)
    yk, wink = _conv_silu(xk, hk, tl.load(convw_ptr + ckk[:, None] * 4 + j4[None, :]), sel3)
    yv, winv = _conv_silu(xv, hv, tl.load(convw_ptr + cv[:, None] * 4 + j4[None, :]), sel3)
    _store_hist(conv_base, cv, winv, j4, slot)        # v history: channels owned by this program only

    q = yq * (1.0 / tl.sqrt(tl.sum(yq * yq, axis=0) + 1e-6)) * scale
    k = yk * (1.0 / tl.sqrt(tl.sum(yk * yk, axis=0) + 1e-6))
    fv = tl.load(f_ptr + t * stride_f + h * K + ck).to(tl.float32)
    dtb = tl.load(dtb_ptr + h * K + ck)
    a = tl.exp(tl.load(alog_ptr + h))
    alpha = tl.exp(lower_bound * _sigmoid(a * (fv + dtb)))              # [K]
    beta = _sigmoid(tl.load(b_ptr + t * stride_b + h).to(tl.float32))

    s_ptrs = s_tile + tl.arange(0, BV)[:, None] * K + ck[None, :]      # rows = v, cols = k
    S = tl.load(s_ptrs)
    S = S * alpha[None, :]
    u = yv - tl.sum(S * k[None, :], axis=1)                               # [BV]
    S = S + (beta * u)[:, None] * k[None, :]
    tl.store(s_ptrs, S, mask=(cvv[:, None] * 0 + slot) != 0)
    o = tl.sum(S * q[None, :], axis=1)                                    # [BV]
    if NV == 1:
        _store_hist(conv_base, cq, winq, j4, slot)
        _store_hist(conv_base, ckk, wink, j4, slot)
        rs = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / K + norm_eps)
        w = tl.load(onw_ptr + cvv)
        gv = tl.load(g_ptr + t * stride_g + h * K + cvv).to(tl.float32)
        tl.store(out_ptr + t * stride_out + h * K + cvv, (o * rs * w * _sigmoid(gv)).to(out_ptr.dtype.element_ty))
    else:
        oa = oacc_ptr + (t * H + h).to(tl.int64) * K
        tl.store(oa + cvv, o)
        prev = tl.atomic_add(cnt_ptr + t * H + h, 1, sem="acq_rel")
        if prev == NV - 1:
            _store_hist(conv_base, cq, winq, j4, slot)
            _store_hist(conv_base, ckk, wink, j4, slot)
            of = tl.load(oa + ck, volatile=True)
            wf = tl.load(onw_ptr + ck)
            gf = tl.load(g_ptr + t * stride_g + h * K + ck).to(tl.float32)
            rs = 1.0 / tl.sqrt(tl.sum(of * of, axis=0) / K + norm_eps)
            tl.store(out_ptr + t * stride_out + h * K + ck, (of * rs * wf * _sigmoid(gf)).to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(cnt_ptr + t * H + h, 0)


_COUNTERS = {}
_COUNTERS_RETIRED = []    # outgrown buffers stay allocated: a CUDA graph captured earlier may still use them


def _counters(device, n):
    """int32 [>= n] zeroed arrival counters of the split decode kernel on `device` (calls without a workspace), kept
    zero by the kernel. Grows only outside CUDA-graph capture: RuntimeError when a capture would need a larger one
    (run the largest batch eagerly first, or pass `workspace=`)."""
    buf = _COUNTERS.get(str(device))
    if buf is None or buf.numel() < n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kda_decode: {n} counters needed during CUDA-graph capture, "
                               f"{0 if buf is None else buf.numel()} allocated; run the largest batch eagerly "
                               "before capturing, or pass workspace= (kda_decode_workspace_bytes)")
        if buf is not None:
            _COUNTERS_RETIRED.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[str(device)] = buf
    return buf


def _check_last_contig(*xs):
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _decode_block_v(n_items: int, K: int) -> int:
    """V tile of the split kernel for n_items = tokens x heads: K below 128 (one program per (token, head)), else
    16 up to 48 items, 32 up to 1024, 64 above: the fastest tile per batch with each layer's pools its own, as
    deployed (on an H200: benchmarks/sweep_kda_decode_tiles.py)."""
    return K if K < 128 else (16 if n_items <= 48 else 32 if n_items <= 1024 else 64)


def _decode_num_warps(block_v: int, head_dim: int) -> int:
    """Warps of `_kda_decode_kernel` for a [block_v, head_dim] fp32 state tile: 8 from 16384 elements (64 KB) up,
    else 4 (plugins/kda/trt_aot.py `num_warps` repeats it for the whole tile without importing Triton)."""
    return 8 if block_v * head_dim >= 16384 else 4


def _decode_grid(batch: int, num_heads: int, nv: int) -> tuple[tuple[int, int, int], bool]:
    """(launch grid, IV_FAST) of `_kda_decode_kernel`: (nv, batch, heads) with IV_FAST (the V tiles of a (token,
    head) adjacent, sharing its q/k prologue reads in L2) for batch <= 65535 (CUDA's limit on grid dimension y),
    else (batch, heads, nv)."""
    if batch <= 65535:
        return (nv, batch, num_heads), True
    return (batch, num_heads, nv), False


def _decode_scratch(batch: int, num_heads: int, head_dim: int, block_v: int) -> list:
    """(shape, dtype) of the split kernel's scratch in carve order: fp32 output accumulator, int32 counters."""
    n = batch * num_heads
    return [] if block_v >= head_dim else [((n * head_dim,), torch.float32), ((n,), torch.int32)]


def kda_decode_workspace_bytes(batch: int, num_heads: int, head_dim: int) -> int:
    """Scratch bytes `kda_decode` needs for `batch` tokens (plugins/workspace.py convention): 0 for the
    whole-tile V split; else an fp32 [batch*H*K] accumulator + int32 [batch*H] counters. The V tile
    (`_decode_block_v`) either splits at every batch (K >= 128) or never (K < 128), so the bytes at `batch` bound
    every smaller batch too."""
    return plan_bytes(_decode_scratch(batch, num_heads, head_dim, _decode_block_v(batch * num_heads, head_dim)))


def kda_decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, *,
               num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5, out=None,
               workspace: torch.Tensor | None = None):
    """KdaDecode (MODEL.md §4, DESIGN.md): one token per request; updates `state` and `conv` in place.

    Args:
        qkv [B, 3P], f [B, P], b [B, H], g [B, P]: activations (fp32 / bf16 / fp16; P = H*K).
        conv_w [3P, 4], A_log [H], dt_bias [P], o_norm_w [K]: fp32 weights.
        state [S, H, K, K] fp32 (Sᵀ per head), conv [S, 3P, 3] act: the pools, contiguous.
        slots [B] int (any integer dtype): the pool row of each token; slot 0 is the padding sentinel (CUDA-graph
            padding rows): its rows compute an output but write neither pool (the fp32 reference does write it).
        num_heads, head_dim: H and K (K a power of 2); lower_bound, norm_eps: MODEL.md §4.
        out: optional [B, P] act destination (any row stride).
        workspace: optional uint8 device buffer of >= `kda_decode_workspace_bytes(B, H, K)` bytes for the split
            kernel's scratch (CUDA graph / TensorRT enqueue: nothing is allocated then).
    Returns:
        (out [B, P] act, state, conv): the same pool tensors, updated in place.
    Raises:
        AssertionError on mismatched shapes or a K that is not a power of 2; RuntimeError when a CUDA-graph
        capture without `workspace` would need more arrival counters than were allocated eagerly.
    """
    return _decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, num_heads=num_heads,
                   head_dim=head_dim, lower_bound=lower_bound, norm_eps=norm_eps, out=out, workspace=workspace,
                   block_v=_decode_block_v(qkv.shape[0] * num_heads, head_dim))


def _decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, *, num_heads, head_dim,
            lower_bound, norm_eps, out, workspace, block_v):
    """`kda_decode` with the V tile `block_v` (a power of 2 dividing K) given: the whole tile K (no scratch) is the
    JIT form of the AOT plugin (plugins/kda/trt_aot.py)."""
    B = qkv.shape[0]
    H, K = num_heads, head_dim
    P = H * K
    assert qkv.shape[1] == 3 * P and f.shape == (B, P) and b.shape == (B, H) and g.shape == (B, P)
    assert state.is_contiguous() and conv.is_contiguous() and state.shape[1:] == (H, K, K)
    assert conv.shape[1:] == (3 * P, 3) and slots.shape[0] == B
    assert K & (K - 1) == 0 and K % block_v == 0
    qkv, f, b, g = _check_last_contig(qkv, f, b, g)
    conv_w, slots = conv_w.contiguous(), index_i32(slots)
    if out is None:
        out = torch.empty(B, P, dtype=qkv.dtype, device=qkv.device)
    if B == 0:
        return out, state, conv
    scalars = (float(lower_bound), float(norm_eps), float(K) ** -0.5)
    BV = block_v
    NV = K // BV
    if NV > 1:
        if workspace is not None:
            ws = Workspace(workspace, qkv.device, "kda_decode")
            (oshape, odt), (cshape, cdt) = _decode_scratch(B, H, K, BV)
            oacc = ws.empty(oshape, odt)
            cnt = ws.empty(cshape, cdt).zero_()   # the kernel leaves counters at zero; a fresh workspace is garbage
        else:
            oacc = torch.empty(B * H * K, dtype=torch.float32, device=qkv.device)
            cnt = _counters(qkv.device, B * H)
    else:
        oacc = cnt = out
    grid, iv_fast = _decode_grid(B, H, NV)
    _kda_decode_kernel[grid](
        qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, out, oacc, cnt,
        qkv.stride(0), f.stride(0), b.stride(0), g.stride(0), out.stride(0), *scalars,
        H=H, K=K, P=P, BV=BV, PREFETCH=qkv.is_cuda and not _INTERPRET, IV_FAST=int(iv_fast),
        num_warps=_decode_num_warps(BV, K),
    )
    return out, state, conv


# --------------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------------
# conv main kernel: 16-token tiles, 4 warps, a flat grid with the column blocks fastest (the fastest tiling tried
# on an H200 at T=32768, 12 and 96 heads)
_CONV_BT, _CONV_WARPS = 16, 4


def _conv_pairs_ok(qkv, y) -> bool:
    """Whether the bf16 channel-pair path may run for qkv [T, 3P] and y [3, T, P] (`_conv_prefill`): it reads qkv
    and writes y as int32, so both must be bf16 with
    4-byte aligned bases and an even qkv row stride (an odd stride, e.g. a slice of a wider projection output,
    takes the generic path)."""
    return (qkv.dtype == y.dtype == torch.bfloat16 and qkv.stride(0) % 2 == 0 and qkv.data_ptr() % 4 == 0
            and y.data_ptr() % 4 == 0)


def _conv_main(qkv, conv_w, y, T, D, P, K):
    """`_conv_main_kernel` over the packed tokens as one sequence (x_{<0} = 0; shapes as `_conv_prefill`); bf16
    takes the channel-pair path where `_conv_pairs_ok`."""
    _conv_main_kernel[(triton.cdiv(T, _CONV_BT) * triton.cdiv(D, K),)](
        qkv, conv_w, y, T, qkv.stride(0), D=D, P=P, BT=_CONV_BT, BD=K, PAIRS=_conv_pairs_ok(qkv, y),
        num_warps=_CONV_WARPS)


def _conv_prefill(qkv, conv_w, conv, slots, cu32, y, T, D, P, K):
    """y = SiLU(causal conv) of the packed tokens, q/k rows L2-normalized (MODEL.md §4), in two launches.

    qkv [T, D=3P] act (row stride free, last dim contiguous); conv_w [D, 4] fp32; conv [S, D, 3] act (the slots'
    conv history, read only); slots [N] int32; cu32 [N+1] int32; y [3, T, P] (written; q, k, v).
    `_conv_main` convolves the packed tokens as if they were one sequence (no token->sequence lookups, so every
    load is independent); `_conv_start_kernel` then rewrites the first three tokens of each sequence with the
    slot's history in place of the previous sequence's tokens (one head per program)."""
    _conv_main(qkv, conv_w, y, T, D, P, K)
    _conv_start_kernel[(slots.shape[0], triton.cdiv(D, K))](
        qkv, conv_w, conv, slots, cu32, y, T, qkv.stride(0), D=D, P=P, BD=K, num_warps=4)


@triton.jit
def _conv_tap(qkv_ptr, convw_ptr, tt, cc, stride_qkv, mask, cmask, j: tl.constexpr):
    """Tap j of the causal conv from the packed input: x_{t-3+j} [BT, BD] * w[:, j] fp32, x taken where `mask`
    (and t-3+j >= 0), else 0."""
    r = tt - 3 + j
    x = tl.load(qkv_ptr + r[:, None].to(tl.int64) * stride_qkv + cc[None, :], mask=mask & (r >= 0)[:, None], other=0.0)
    return x.to(tl.float32) * tl.load(convw_ptr + cc * 4 + j, mask=cmask, other=0.0)[None, :]


@triton.jit
def _conv_hist_tap(qkv_ptr, convw_ptr, conv_ptr, slot, pos, tt, cc, stride_qkv, m2, cmask, D: tl.constexpr,
                   j: tl.constexpr):
    """Tap j for the rows of one sequence at positions `pos` (tokens tt): x_{t-3+j} from the packed input where
    pos-3+j >= 0, else the slot's conv history column pos+j (a select, never a difference: another sequence's
    inf/NaN cannot leak in)."""
    p = pos - 3 + j
    hm = m2 & (p < 0)[:, None]
    hv = tl.load(conv_ptr + slot * (D * 3) + cc[None, :] * 3 + (p + 3)[:, None], mask=hm, other=0.0)
    w = tl.load(convw_ptr + cc * 4 + j, mask=cmask, other=0.0)[None, :]
    xw = _conv_tap(qkv_ptr, convw_ptr, tt, cc, stride_qkv, m2 & (p >= 0)[:, None], cmask, j)
    return tl.where(hm, hv.to(tl.float32) * w, xw)


@triton.jit
def _conv_store(acc, y_ptr, tt, cc, m2, T, P: tl.constexpr, IS_QK):
    """SiLU, the L2 norm of q/k rows (the block is one head: BD == head_dim), store into y [3, T, P]."""
    y = acc * _sigmoid(acc)
    nrm = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) + 1e-6)
    y = tl.where(IS_QK, y * nrm[:, None], y)
    tl.store(y_ptr + (cc // P)[None, :].to(tl.int64) * T * P + tt[:, None].to(tl.int64) * P + (cc % P)[None, :],
             y.to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _conv_main_kernel(qkv_ptr, convw_ptr, y_ptr, T, stride_qkv, D: tl.constexpr, P: tl.constexpr,
                      BT: tl.constexpr, BD: tl.constexpr, PAIRS: tl.constexpr = True):
    """grid (cdiv(T, BT) * cdiv(D, BD),), the column blocks fastest (programs in flight read whole rows):
    `_conv_main_tile` of each (token tile, column block)."""
    NC: tl.constexpr = (D + BD - 1) // BD
    pt = tl.program_id(0) // NC
    pc = tl.program_id(0) % NC
    _conv_main_tile(qkv_ptr, convw_ptr, y_ptr, T, stride_qkv, pt, pc, D, P, BT, BD, PAIRS)


@triton.jit
def _conv_main_tile(qkv_ptr, convw_ptr, y_ptr, T, stride_qkv, pt, pc, D: tl.constexpr, P: tl.constexpr,
                    BT: tl.constexpr, BD: tl.constexpr, PAIRS: tl.constexpr):
    """Token tile pt, column block pc: y[c // P, t, c % P] = silu(sum_j w[c,j] x_{t-3+j}[c]) over the packed tokens
    as one sequence (x_{<0} = 0); the rows of each sequence's first three tokens are rewritten afterwards by
    `_conv_start_kernel` (whatever this kernel left there, inf/NaN included, is overwritten, not combined).
    PAIRS (bf16 in and out, 4-byte aligned: `_conv_pairs_ok`): `_conv_main_pairs`; else the generic path below
    (fp32 or mixed dtypes, unaligned bf16)."""
    if PAIRS and qkv_ptr.dtype.element_ty == tl.bfloat16 and y_ptr.dtype.element_ty == tl.bfloat16:
        _conv_main_pairs(qkv_ptr, convw_ptr, y_ptr, T, stride_qkv, pt, pc, P, BT, BD)
    else:
        cc = pc * BD + tl.arange(0, BD)
        cmask = cc < D
        tt = pt * BT + tl.arange(0, BT)
        m2 = (tt < T)[:, None] & cmask[None, :]
        acc = _conv_tap(qkv_ptr, convw_ptr, tt, cc, stride_qkv, m2, cmask, 0)
        acc += _conv_tap(qkv_ptr, convw_ptr, tt, cc, stride_qkv, m2, cmask, 1)
        acc += _conv_tap(qkv_ptr, convw_ptr, tt, cc, stride_qkv, m2, cmask, 2)
        acc += _conv_tap(qkv_ptr, convw_ptr, tt, cc, stride_qkv, m2, cmask, 3)
        _conv_store(acc, y_ptr, tt, cc, m2, T, P, (pc * BD) < 2 * P)


@triton.jit
def _sigmoid_ex2(a):
    """1 / (1 + 2^a) = sigmoid(-a ln2): the GPU's approximate ex2 and rcp (flush-to-zero, no range fix-ups;
    relative error ~2^-21, far below bf16's 2^-8); the plain formula under the interpreter."""
    if _ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 e; ex2.approx.ftz.f32 e, $1; add.ftz.f32 e, e, 0f3F800000; rcp.approx.ftz.f32 $0, e; }",
            "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / (1.0 + tl.exp2(a))


@triton.jit
def _pack_bf16x2(lo, hi):
    """Two fp32 tiles of one shape rounded to bf16 (nearest even) and packed into an int32 tile of that shape:
    lo in bits 0-15, hi in 16-31 (little-endian: lo is the even channel in memory)."""
    if _ASM:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        lb = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hb = hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        return lb | (hb << 16)


@triton.jit
def _ld_pairs(ptrs, rows, T, MASKED: tl.constexpr):
    """bf16 channel pairs loaded as int32 at ptrs [G, HB] (token rows [G]) -> (even, odd) fp32 [G, HB], one integer
    op per value (even channel: the low half shifted up; odd: the high half masked); MASKED: rows outside [0, T)
    read as 0."""
    if MASKED:
        v = tl.load(ptrs, mask=((rows >= 0) & (rows < T))[:, None], other=0)
    else:
        v = tl.load(ptrs)
    return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _taps4(w0, w1, w2, w3, x0, x1, x2, x3):
    """sum_j w_j[None, :] * x_j over the 4 conv taps (x_j [G, HB], w_j [HB])."""
    return x0 * w0[None, :] + x1 * w1[None, :] + x2 * w2[None, :] + x3 * w3[None, :]


@triton.jit
def _conv_out_rows(acc_e, acc_o, yptrs, rows, T, IS_QK, MASKED: tl.constexpr):
    """SiLU, the L2 norm of q/k rows (the pair block is one head), bf16 pack, store at yptrs [G, HB] (int32).
    acc = -log2(e) * (the conv sum x), the weights carry the factor: SiLU(x) = x * sigmoid(x) = -ln2 * acc / (1 + 2^acc),
    and the -ln2 goes into the row norm's scale (q, k) or one multiply (v)."""
    ye = acc_e * _sigmoid_ex2(acc_e)
    yo = acc_o * _sigmoid_ex2(acc_o)
    if IS_QK:
        nrm = (1.0 / tl.sqrt(tl.sum(ye * ye + yo * yo, axis=1) * _LN2SQ + 1e-6)) * _NEG_LN2
        ye = ye * nrm[:, None]
        yo = yo * nrm[:, None]
    else:
        ye = ye * _NEG_LN2
        yo = yo * _NEG_LN2
    if MASKED:
        tl.store(yptrs, _pack_bf16x2(ye, yo), mask=(rows < T)[:, None])
    else:
        tl.store(yptrs, _pack_bf16x2(ye, yo))


@triton.jit
def _conv_row_groups(xp, wp, yp, r0, rs, ys, T, IS_QK, HB: tl.constexpr, MASKED: tl.constexpr):
    """Outputs of rows r0 + m (m = 0..3; r0 [G] = every 4th token) from the 7 input rows r0-3 .. r0+3, each loaded
    and unpacked once: out_m = sum_j w_j x_{m+j}. xp [G, HB] int32 pointers to rows r0 (rs: row stride in pairs),
    wp [2 HB] pointers to each channel's 4 fp32 weights, yp [G, HB] int32 pointers to output rows r0 (ys: row
    stride in int32 units)."""
    we0, wo0 = tl.split(tl.reshape(tl.load(wp + 0) * _NEG_LOG2E, [HB, 2]))     # -log2(e) folded in: _conv_out_rows
    we1, wo1 = tl.split(tl.reshape(tl.load(wp + 1) * _NEG_LOG2E, [HB, 2]))
    we2, wo2 = tl.split(tl.reshape(tl.load(wp + 2) * _NEG_LOG2E, [HB, 2]))
    we3, wo3 = tl.split(tl.reshape(tl.load(wp + 3) * _NEG_LOG2E, [HB, 2]))
    e0, o0 = _ld_pairs(xp - 3 * rs, r0 - 3, T, MASKED)
    e1, o1 = _ld_pairs(xp - 2 * rs, r0 - 2, T, MASKED)
    e2, o2 = _ld_pairs(xp - rs, r0 - 1, T, MASKED)
    e3, o3 = _ld_pairs(xp, r0, T, MASKED)
    e4, o4 = _ld_pairs(xp + rs, r0 + 1, T, MASKED)
    e5, o5 = _ld_pairs(xp + 2 * rs, r0 + 2, T, MASKED)
    e6, o6 = _ld_pairs(xp + 3 * rs, r0 + 3, T, MASKED)
    _conv_out_rows(_taps4(we0, we1, we2, we3, e0, e1, e2, e3), _taps4(wo0, wo1, wo2, wo3, o0, o1, o2, o3),
                   yp, r0, T, IS_QK, MASKED)
    _conv_out_rows(_taps4(we0, we1, we2, we3, e1, e2, e3, e4), _taps4(wo0, wo1, wo2, wo3, o1, o2, o3, o4),
                   yp + ys, r0 + 1, T, IS_QK, MASKED)
    _conv_out_rows(_taps4(we0, we1, we2, we3, e2, e3, e4, e5), _taps4(wo0, wo1, wo2, wo3, o2, o3, o4, o5),
                   yp + 2 * ys, r0 + 2, T, IS_QK, MASKED)
    _conv_out_rows(_taps4(we0, we1, we2, we3, e3, e4, e5, e6), _taps4(wo0, wo1, wo2, wo3, o3, o4, o5, o6),
                   yp + 3 * ys, r0 + 3, T, IS_QK, MASKED)


@triton.jit
def _conv_main_pairs(qkv_ptr, convw_ptr, y_ptr, T, stride_qkv, pt, pc, P: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr):
    """`_conv_main_kernel` for bf16 activations: channel pairs as int32 (`_ld_pairs`, `_pack_bf16x2`) and the
    tile's tokens in groups of 4 consecutive rows (`_conv_row_groups`), so each input row is loaded and unpacked
    once per 4 outputs instead of once per tap. Interior tiles run without masks. Needs qkv and y 4-byte aligned
    with an even stride_qkv (`_conv_pairs_ok`; the AOT entry: TensorRT buffers, stride 3P), BD = the head dim (the
    q/k row norm spans the block), BT a multiple of 4 with BT/4 a power of 2. pt, pc: this program's token tile and
    column block."""
    HB: tl.constexpr = BD // 2
    G: tl.constexpr = BT // 4
    NB: tl.constexpr = P // BD
    c0 = pc * BD
    cp = tl.arange(0, HB)
    r0 = pt * BT + 4 * tl.arange(0, G)
    rs = stride_qkv // 2
    xp = qkv_ptr.to(tl.pointer_type(tl.int32)) + r0[:, None].to(tl.int64) * rs + (c0 // 2 + cp)[None, :]
    wp = convw_ptr + (c0 + tl.arange(0, BD)) * 4
    yrow = ((pc // NB) * T + r0).to(tl.int64) * (P // 2) + (pc % NB) * HB
    yp = y_ptr.to(tl.pointer_type(tl.int32)) + yrow[:, None] + cp[None, :]
    IS_QK = c0 < 2 * P
    if (pt * BT >= 3) & (pt * BT + BT <= T):     # interior tile: no masks
        _conv_row_groups(xp, wp, yp, r0, rs, P // 2, T, IS_QK, HB, False)
    else:
        _conv_row_groups(xp, wp, yp, r0, rs, P // 2, T, IS_QK, HB, True)


@triton.jit
def _conv_start_kernel(qkv_ptr, convw_ptr, conv_ptr, slots_ptr, cu_ptr, y_ptr, T, stride_qkv, D: tl.constexpr,
                       P: tl.constexpr, BD: tl.constexpr):
    """grid (N, cdiv(D, BD)): rows of the first min(3, len) tokens of sequence n, their taps before the sequence
    start taken from slot n's conv history."""
    n = tl.program_id(0)
    cc = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cc < D
    start = tl.load(cu_ptr + n)
    length = tl.load(cu_ptr + n + 1) - start
    slot = tl.load(slots_ptr + n).to(tl.int64)
    pos = tl.arange(0, 4)
    tt = start + pos
    m2 = ((pos < 3) & (pos < length))[:, None] & cmask[None, :]
    acc = _conv_hist_tap(qkv_ptr, convw_ptr, conv_ptr, slot, pos, tt, cc, stride_qkv, m2, cmask, D, 0)
    acc += _conv_hist_tap(qkv_ptr, convw_ptr, conv_ptr, slot, pos, tt, cc, stride_qkv, m2, cmask, D, 1)
    acc += _conv_hist_tap(qkv_ptr, convw_ptr, conv_ptr, slot, pos, tt, cc, stride_qkv, m2, cmask, D, 2)
    acc += _conv_tap(qkv_ptr, convw_ptr, tt, cc, stride_qkv, m2, cmask, 3)
    _conv_store(acc, y_ptr, tt, cc, m2, T, P, (tl.program_id(1) * BD) < 2 * P)


@triton.jit
def _conv_hist_kernel(qkv_ptr, conv_ptr, slots_ptr, cu_ptr, stride_qkv, D: tl.constexpr, BD: tl.constexpr):
    """New history of sequence n = last 3 raw inputs of [old history ‖ new tokens]."""
    n = tl.program_id(0)
    cc = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cc < D
    start = tl.load(cu_ptr + n)
    L = tl.load(cu_ptr + n + 1) - start
    slot = tl.load(slots_ptr + n).to(tl.int64)
    base = conv_ptr + slot * (D * 3) + cc * 3
    old0 = tl.load(base + 0, mask=cmask, other=0.0)
    old1 = tl.load(base + 1, mask=cmask, other=0.0)
    old2 = tl.load(base + 2, mask=cmask, other=0.0)
    for j in tl.static_range(3):
        # index into the extended sequence [old0, old1, old2, x_0 .. x_{L-1}] at L + j
        e = tl.zeros([BD], dtype=tl.int32) + L + j
        xv = tl.load(qkv_ptr + (start + e - 3).to(tl.int64) * stride_qkv + cc, mask=cmask & (e >= 3), other=0.0)
        hv = tl.where(e == 0, old0, tl.where(e == 1, old1, old2))
        v = tl.where(e >= 3, xv.to(conv_ptr.dtype.element_ty), hv)
        tl.store(base + j, v, mask=cmask)


@triton.jit
def _gated_norm_kernel(o_ptr, g_ptr, w_ptr, out_ptr, T, stride_g, stride_out, norm_eps,
                       H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    tt = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1)
    tm = (tt < T)[:, None]
    t64 = tt.to(tl.int64)[:, None]
    ck = tl.arange(0, K)[None, :]
    o = tl.load(o_ptr + (t64 * H + h) * K + ck, mask=tm, other=0.0).to(tl.float32)
    gv = tl.load(g_ptr + t64 * stride_g + h * K + ck, mask=tm, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + ck)
    rs = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / K + norm_eps)
    tl.store(out_ptr + t64 * stride_out + h * K + ck, (o * rs[:, None] * w * _sigmoid(gv)).to(out_ptr.dtype.element_ty),
             mask=tm)


# --------------------------------------------------------------------------------------------------
# Prefill chunk core: fla-core's gate-cumsum, intra-chunk and inter-chunk state stages, then our output kernel
# with the gated RMSNorm fused (MODEL.md §4)
# --------------------------------------------------------------------------------------------------
_CHUNK = 64                              # tokens per chunk (fla's KDA chunk size)
# the output kernel's K step / warps / stages: the fastest at T=32768, 12 and 96 heads (profile_kda_prefill.py)
_OUT_CFG = dict(block_k=64, num_warps=4, num_stages=2)
_FLA_STAGES_VERSIONS = ("0.6.0",)        # fla-core versions whose internal stage functions were tested here


@functools.lru_cache(maxsize=None)
def _fla_stages():
    """fla-core's KDA stage functions (gate cumsum, intra-chunk WY solve, inter-chunk state pass, static chunk
    indices) as a namespace where the installed fla-core is a version listed in `_FLA_STAGES_VERSIONS`, else None:
    they are internal API, so another version (or a failed import) makes kda_prefill call the public `chunk_kda`
    instead (logged once: the result is cached)."""
    try:
        import fla
        if getattr(fla, "__version__", None) not in _FLA_STAGES_VERSIONS:
            _log.warning("fla-core %s: KdaPrefill's chunk core was tested with %s only; using fla's chunk_kda",
                         getattr(fla, "__version__", "?"), ", ".join(_FLA_STAGES_VERSIONS))
            return None
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
        from fla.ops.kda.gate import kda_gate_chunk_cumsum
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.index import prepare_chunk_indices_static
    except Exception as e:                                  # noqa: BLE001 - any import failure means "not usable"
        _log.warning("fla-core stage functions unavailable (%s); using fla's chunk_kda", e)
        return None
    return types.SimpleNamespace(gate_cumsum=kda_gate_chunk_cumsum, intra=chunk_kda_fwd_intra,
                                 state_pass=chunk_gated_delta_rule_fwd_h, rcp_ln2=RCP_LN2,
                                 chunk_indices=prepare_chunk_indices_static)


@triton.jit
def _chunk_out_norm_kernel(q_ptr, gk_ptr, h_ptr, vn_ptr, a_ptr, gate_ptr, w_ptr, out_ptr, cu_ptr, ci_ptr, T,
                           stride_gate, stride_out, scale, norm_eps, H: tl.constexpr, K: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """grid (NT, H): output of one chunk row and head, gated RMSNorm fused (MODEL.md §4):
    o = scale * (q * exp2(gk)) h[c]ᵀ + tril(Aqk) vn;  out = o / sqrt(mean(o²) + eps) * w * sigmoid(gate).
    q, vn [T, H, K] act (vn = V-dim values, V = K); gk [T, H, K] fp32 log2 gate cumsum within the chunk; h [NT, H, V, K]
    act (state before each chunk); Aqk [T, H, BT] act (scale included); gate [T, H*K] act (row stride stride_gate);
    w [K] fp32; out [T, H*K] act (row stride stride_out). Varlen: chunk row c -> (sequence, chunk) from ci [NT, 2]
    int64 (fla's static chunk indices; sequence -1: padding, writes nothing), cu [N+1] int32; dense: one sequence."""
    i_tg = tl.program_id(0)
    i_h = tl.program_id(1)
    if IS_VARLEN:
        i_n = tl.load(ci_ptr + i_tg * 2).to(tl.int32)
        if i_n < 0:
            return
        i_t = tl.load(ci_ptr + i_tg * 2 + 1).to(tl.int32)
        bos = tl.load(cu_ptr + i_n).to(tl.int64)
        L = tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos
    else:
        i_t = i_tg
        bos = tl.zeros([], dtype=tl.int64)
        L = T + bos
    rows = i_t * BT + tl.arange(0, BT)
    m_t = (rows < L)[:, None]
    tok = (bos + rows)[:, None]
    o_k = tl.arange(0, K)[None, :]
    o = tl.zeros([BT, K], dtype=tl.float32)
    hrow = h_ptr + (i_tg.to(tl.int64) * H + i_h) * K * K + tl.arange(0, K)[:, None] * K    # h[c] rows v
    for kk in range(0, K, BK):
        ck = kk + tl.arange(0, BK)[None, :]
        tk = (tok * H + i_h) * K + ck
        qv = tl.load(q_ptr + tk, mask=m_t, other=0.0)
        qg = (qv * tl.exp2(tl.load(gk_ptr + tk, mask=m_t, other=0.0).to(tl.float32))).to(qv.dtype)
        o = tl.dot(qg, tl.trans(tl.load(hrow + ck)).to(qg.dtype), o)                               # [BT, V]
    o = o * scale
    tk = (tok * H + i_h) * K + o_k
    vv = tl.load(vn_ptr + tk, mask=m_t, other=0.0)
    cols = tl.arange(0, BT)[None, :]
    a = tl.load(a_ptr + (tok * H + i_h) * BT + cols, mask=m_t, other=0.0)
    a = tl.where(tl.arange(0, BT)[:, None] >= cols, a, 0.0).to(vv.dtype)
    o = tl.dot(a, vv, o)
    gt = tl.load(gate_ptr + tok * stride_gate + i_h * K + o_k, mask=m_t, other=0.0).to(tl.float32)
    rs = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / K + norm_eps)
    y = o * rs[:, None] * tl.load(w_ptr + o_k) * _sigmoid(gt)
    tl.store(out_ptr + tok * stride_out + i_h * K + o_k, y.to(out_ptr.dtype.element_ty), mask=m_t)


def _chunk_core(q, k, v, f, beta, A_log, dt_bias, g, o_norm_w, h0, cu32, cu64, out, *, H, K, lower_bound, norm_eps,
                st):
    """Chunked delta rule + output norm of the packed tokens: writes `out` [T, P] and returns the final states
    [N, H, V, K] fp32. q, k (L2-normalized), v, f [T, P] y-dtype contiguous; beta [T, H]; g [T, P] (output gate,
    any row stride); h0 [N, H, V, K] fp32 initial states (gathered from the slots); cu32 [N+1] int32 and cu64
    [N+1] int64 scratch (filled here). st: `_fla_stages()`. One sequence: dense; several: fla's static chunk indices
    (fixed shape nt_max = cdiv(T, 64) + N - 1, built on the device: no host sync). The output kernel's tiles:
    `_OUT_CFG`. fla's stages are called without fla's `input_guard` (which switches to the tensors' device): like
    our own launches they run on the current CUDA device, which must hold the tensors."""
    T = q.shape[0]
    N = h0.shape[0]
    BT = _CHUNK
    view = lambda x: x.view(1, T, H, K)                      # noqa: E731
    varlen = N > 1
    ci = co = None
    NT = triton.cdiv(T, BT)
    if not varlen:
        cu64 = None
    else:
        cu64.copy_(cu32)
        NT = NT + N - 1
        ci, co = st.chunk_indices(cu64, BT, NT)
    gk = st.gate_cumsum(g=view(f), A_log=A_log, chunk_size=BT, scale=st.rcp_ln2, dt_bias=dt_bias, cu_seqlens=cu64,
                        chunk_indices=ci, lower_bound=lower_bound, use_graph=varlen)
    w, u, _, kg, Aqk, _ = st.intra(q=view(q), k=view(k), v=view(v), gk=gk, beta=beta.view(1, T, H), scale=K ** -0.5,
                                   cu_seqlens=cu64, chunk_size=BT, chunk_indices=ci, safe_gate=True,
                                   disable_recompute=False, use_graph=varlen)
    h, vn, ht = st.state_pass(k=kg, w=w, u=u, gk=gk, initial_state=h0, output_final_state=True, cu_seqlens=cu64,
                              chunk_indices=ci, chunk_offsets=co, chunk_size=BT, state_v_first=True)
    oc = _OUT_CFG
    _chunk_out_norm_kernel[(NT, H)](q, gk, h, vn, Aqk, g, o_norm_w, out, cu32, ci, T, g.stride(0), out.stride(0),
                                    K ** -0.5, float(norm_eps), H=H, K=K, BT=BT, BK=min(oc["block_k"], K),
                                    IS_VARLEN=varlen, num_warps=oc["num_warps"], num_stages=oc["num_stages"])
    return ht


def _fla_available(device) -> bool:
    """Whether KdaPrefill's chunk core runs fla-core's stages: on CUDA with fla-core importable. On CUDA without it
    the torch token recurrence runs instead (about 10x slower prefill on k3-slice, H200): logged once."""
    if device.type != "cuda":
        return False
    return _import_fla()


@functools.lru_cache(maxsize=None)
def _import_fla() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
        return True
    except Exception as e:  # noqa: BLE001 - any import failure means the fallback
        _log.warning("fla-core is not importable on this CUDA machine (%s): KdaPrefill falls back to a torch token "
                     "recurrence, about 10x slower; install the gpu extra (pip install 'k3deploy[gpu]', "
                     "fla-core 0.6.0)", e)
        return False


def _delta_rule_torch(q, k, v, fraw, beta, A_log, dt_bias, state, cu, slots, H, K, lower_bound):
    """CPU fallback of the chunk stage: token recurrence in fp32 (q, k L2-normalized by the conv kernel, beta
    [T, H] = sigmoid(b) from the prologue kernel)."""
    T = q.shape[0]
    qf = q.float().view(T, H, K)
    kf = k.float().view(T, H, K)
    qf = qf * K ** -0.5          # q, k arrive L2-normalized from the conv kernel
    vf = v.float().view(T, H, K)
    gate = lower_bound * torch.sigmoid(torch.exp(A_log.float())[None, :, None] * (fraw.float() + dt_bias.float()).view(T, H, K))
    beta = beta.float()
    o = torch.empty(T, H, K, dtype=torch.float32, device=q.device)
    cu_l = cu.tolist()
    for n in range(len(cu_l) - 1):
        s = int(slots[n])
        S = state[s].clone()
        for t in range(cu_l[n], cu_l[n + 1]):
            S = S * torch.exp(gate[t])[:, None, :]
            u = vf[t] - torch.einsum("hvk,hk->hv", S, kf[t])
            S = S + beta[t][:, None, None] * u[:, :, None] * kf[t][:, None, :]
            o[t] = torch.einsum("hvk,hk->hv", S, qf[t])
        state[s] = S
    return o


@triton.jit
def _beta_kernel(b_ptr, beta_ptr, T, stride_b, H: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """beta[t, :] = sigmoid(b[t, :]) computed in fp32, stored in beta's dtype (chunk_kda then skips its own
    sigmoid). b [T, H] act (row stride stride_b), beta [T, H] contiguous; BH = next power of 2 >= H.
    grid (cdiv(T, BT),)."""
    _beta_tile(b_ptr, beta_ptr, T, stride_b, tl.program_id(0), H, BT, BH)


@triton.jit
def _beta_tile(b_ptr, beta_ptr, T, stride_b, pt, H: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """`_beta_kernel` for token tile pt (rows pt*BT .. pt*BT+BT-1 of b [T, H] -> beta [T, H]); also called by the
    AOT KdaConvBeta entry on its flat grid."""
    tt = pt * BT + tl.arange(0, BT)
    hh = tl.arange(0, BH)
    m = (tt < T)[:, None] & (hh < H)[None, :]
    t64 = tt.to(tl.int64)[:, None]
    bv = tl.load(b_ptr + t64 * stride_b + hh[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(beta_ptr + t64 * H + hh[None, :], _sigmoid(bv).to(beta_ptr.dtype.element_ty), mask=m)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, idx_ptr, ROW, BLOCK: tl.constexpr, GATHER: tl.constexpr):
    """grid (N, cdiv(ROW, BLOCK)): GATHER: dst[n] = src[idx[n]], else dst[idx[n]] = src[n] (rows of ROW fp32)."""
    n = tl.program_id(0)
    cc = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cc < ROW
    i = tl.load(idx_ptr + n).to(tl.int64)
    if GATHER:
        tl.store(dst_ptr + n.to(tl.int64) * ROW + cc, tl.load(src_ptr + i * ROW + cc, mask=m), mask=m)
    else:
        tl.store(dst_ptr + i * ROW + cc, tl.load(src_ptr + n.to(tl.int64) * ROW + cc, mask=m), mask=m)


def _copy_rows(src, dst, idx, gather: bool):
    N = idx.shape[0]
    row = src[0].numel() if gather else dst[0].numel()
    if N and row:
        BLOCK = 4096
        _copy_rows_kernel[(N, triton.cdiv(row, BLOCK))](src, dst, idx, row, BLOCK=BLOCK, GATHER=gather, num_warps=4)


def _prefill_scratch(T: int, N: int, H: int, K: int, act_dtype, use_fla: bool) -> list:
    """(shape, dtype) of kda_prefill's scratch in carve order: conv output y (q‖k‖v), beta = sigmoid(b), and
    with fla: gathered initial states, int64 cu_seqlens, f in y's dtype when it differs
    from the activations."""
    P = H * K
    ydt = torch.bfloat16 if use_fla and act_dtype == torch.float32 else act_dtype
    items = [((3, T, P), ydt), ((T, H), ydt)]
    if use_fla:
        items += [((N, H, K, K), torch.float32), ((N + 1,), torch.int64)]
        if ydt != act_dtype:
            items += [((T, P), ydt)]
    return items


def kda_prefill_workspace_bytes(num_tokens: int, num_seqs: int, num_heads: int, head_dim: int, *,
                                act_dtype: torch.dtype = torch.bfloat16, device=None) -> int:
    """Workspace bytes of :func:`kda_prefill` for up to `num_tokens` packed tokens of up to `num_seqs` sequences
    (plugins/workspace.py convention). device: where it runs (default CUDA if present); the fla path (CUDA + fla)
    needs the gathered initial states too. fla's own intermediates (chunk_kda) are not covered: they come from
    torch's caching allocator."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if num_tokens <= 0:
        return 0
    return plan_bytes(_prefill_scratch(int(num_tokens), int(num_seqs), int(num_heads), int(head_dim), act_dtype,
                                       _fla_available(dev)))


def kda_prefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots, *,
                num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5, out=None,
                workspace: torch.Tensor | None = None):
    """KdaPrefill (MODEL.md §4): varlen packed prefill continuing from the slots' state/conv history; in place.

    Chunk core on the GPU with fla-core: fla-core's gate cumsum, intra-chunk and inter-chunk state stages, then
    `_chunk_out_norm_kernel` (the chunk output with the gated RMSNorm fused); for a fla-core version outside
    `_FLA_STAGES_VERSIONS` (its stages are internal API) fla-core's public `chunk_kda`, then `_gated_norm_kernel`.
    Several sequences: chunk indices built on the device with a fixed shape, so no host sync on either path. Without
    fla-core or CUDA (CPU CI) a torch token recurrence in fp32. beta = sigmoid(b) is stored in the conv output's
    dtype (bf16 on the GPU path).

    Args:
        qkv [T, 3P], f [T, P], b [T, H], g [T, P]: packed activations, bf16 or fp32 (P = H*K).
        conv_w [3P, 4], A_log [H], dt_bias [P], o_norm_w [K]: fp32 weights.
        state [S, H, K, K] fp32 (Sᵀ per head), conv [S, 3P, 3] act: the pools.
        cu_seqlens [N+1] int (every length >= 1), slots [N] int: schema of plugins/kda/reference.py.
        num_heads, head_dim: H and K; lower_bound (in [-5, 0)), norm_eps: MODEL.md §4.
        out: optional [T, P] act destination (any row stride).
        workspace: optional uint8 scratch (size: :func:`kda_prefill_workspace_bytes`) for the conv output, beta,
            the gathered initial states and the int64 cu_seqlens; fla's intermediates come from torch's caching
            allocator (plugins/trt_common.py says what that means for capture).
    Returns:
        (out [T, P] act, state, conv): the pools updated in place.
    Raises:
        ValueError for lower_bound outside [-5, 0) (on every device, so a config that the GPU path would refuse
        fails on the CPU too); AssertionError on mismatched shapes.
    """
    T = qkv.shape[0]
    H, K = num_heads, head_dim
    P = H * K
    D = 3 * P
    N = slots.shape[0]
    if not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"kda_prefill: lower_bound={lower_bound} must be in [-5, 0): the GPU path's safe gate "
                         "(fla-core) keeps chunk-local gate products in fp32 range only there (MODEL.md §4: -5)")
    assert qkv.shape[1] == D and f.shape == (T, P) and b.shape == (T, H) and g.shape == (T, P)
    assert cu_seqlens.shape[0] == N + 1
    dev = qkv.device
    qkv, f, b, g = _check_last_contig(qkv, f, b, g)
    conv_w, slots = conv_w.contiguous(), index_i32(slots)
    cu32 = index_i32(cu_seqlens)
    if out is None:
        out = torch.empty(T, P, dtype=qkv.dtype, device=dev)
    if T == 0:
        return out, state, conv
    use_fla = _fla_available(dev)
    ws = Workspace(workspace, dev, "kda_prefill")
    scratch = iter(_prefill_scratch(T, N, H, K, qkv.dtype, use_fla))
    y = ws.empty(*next(scratch))
    beta = ws.empty(*next(scratch))
    _beta_kernel[(triton.cdiv(T, 64),)](b, beta, T, b.stride(0), H=H, BT=64, BH=triton.next_power_of_2(H), num_warps=4)
    _conv_prefill(qkv, conv_w, conv, slots, cu32, y, T, D, P, K)
    _conv_hist_kernel[(N, triton.cdiv(D, 256))](qkv, conv, slots, cu32, qkv.stride(0), D=D, BD=256, num_warps=4)
    q, k, v = y[0], y[1], y[2]
    st = _fla_stages() if use_fla else None
    if use_fla:
        from fla.ops.kda import chunk_kda
        h0 = ws.empty(*next(scratch))                                 # [N, H, V, K] (state_v_first layout)
        _copy_rows(state, h0, slots, gather=True)
        cu64 = ws.empty(*next(scratch))
        if y.dtype != qkv.dtype:
            fa = ws.empty(*next(scratch))
            fa.copy_(f)
        else:
            fa = f if f.dtype == q.dtype else f.to(q.dtype)
    if st is not None:
        fa = fa if fa.is_contiguous() else fa.contiguous()
        ht = _chunk_core(q, k, v, fa, beta, A_log, dt_bias, g, o_norm_w, h0, cu32, cu64, out, H=H, K=K,
                         lower_bound=lower_bound, norm_eps=norm_eps, st=st)
        _copy_rows(ht if ht.dtype == state.dtype else ht.to(state.dtype), state, slots, gather=False)
        return out, state, conv
    if use_fla:
        # one sequence: chunk_kda's dense path (no chunk index, no varlen: faster)
        varlen = {} if N == 1 else dict(cu_seqlens=cu64.copy_(cu32), use_graph=True, max_num_seqs=N)
        o, ht = chunk_kda(
            q.view(1, T, H, K), k.view(1, T, H, K), v.view(1, T, H, K), fa.view(1, T, H, K), beta.view(1, T, H),
            scale=K ** -0.5, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=False,
            A_log=A_log, dt_bias=dt_bias, safe_gate=True, lower_bound=lower_bound, state_v_first=True, **varlen)
        _copy_rows(ht if ht.dtype == state.dtype else ht.to(state.dtype), state, slots, gather=False)
        o = o.view(T, H, K)
    else:
        o = _delta_rule_torch(q, k, v, f, beta, A_log, dt_bias, state, cu32, slots, H, K, lower_bound)
    o = o if o.is_contiguous() else o.contiguous()
    _gated_norm_kernel[(triton.cdiv(T, 16), H)](o, g, o_norm_w, out, T, g.stride(0), out.stride(0), float(norm_eps),
                                               H=H, K=K, BT=16, num_warps=4)
    return out, state, conv
