"""MXFP4 routed-expert MoE Triton kernels (GPU; CPU tensors under TRITON_INTERPRET=1). MODEL.md §7.2, §8.3.

mxfp4_moe: tokens' (token, expert) pairs are sorted by local expert (one Triton counting-sort launch, grid E+1:
  stable, fixed shapes, no host sync), then
  kernel 1: per (expert, I-tile) grouped GEMM x·W13ᵀ with the MXFP4 weights dequantized in registers
            (E2M1 bits placed into bf16 by integer ops, scaled by the E8M0 factor with one bf16x2 multiply per
            two weights through inline PTX on the GPU; plain Triton arithmetic in the interpreter), gate and up
            tiles of the same columns in one program, SiTU fused in fp32, h written in bf16;
  kernel 2: per (expert, Rl-tile) h·W2ᵀ the same way, times the pair's routing weight, written per pair;
  (on CUDA sm_90+ for decode-sized batches the Gluon GEMMs of plugins/moe/kernels_gluon.py take kernels 1 and 2's
  place: `_pick_impl`)
  combine: fp32 sum over the k choices (one Triton launch; deterministic; non-local choices contribute 0).
  Scratch (sort buffers, h, per-pair outputs) comes from `workspace=` when given (plugins/workspace.py).
route: the fp32 router: the logits GEMM in torch (cuBLAS), then one Triton program per token (`_route_kernel`:
  sigmoid, + correction bias for selection only, optional group stage, top-k, renormalize, scale).
Hopper has no FP4 MMA: the MMAs are bf16 with fp32 accumulation.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

from k3deploy.plugins.moe.reference import check_num_experts, route_logits
from k3deploy.plugins.workspace import Workspace, plan_bytes

log = logging.getLogger(__name__)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dequant_ref(p, s):
    """Plain Triton decode (interpreter / fallback): p uint8 [BN, BKH] packed, s uint8 [BN, BKH] scale per byte.
    Returns (lo, hi) fp32 = even / odd columns."""
    pi = p.to(tl.int32)
    sc = tl.exp2(s.to(tl.float32) - 127.0)
    c = pi & 15
    mag = c & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, m * 0.5, tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m))
    lo = tl.where((c & 8) != 0, -v, v) * sc
    c = (pi >> 4) & 15
    mag = c & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, m * 0.5, tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m))
    hi = tl.where((c & 8) != 0, -v, v) * sc
    return lo, hi


def _asm2_text(folded: bool) -> str:
    """PTX of `_dequant_asm2`: the same steps for bytes 0-1 (prmt selector 0x4140 -> outputs $0 even columns, $2
    odd) and bytes 2-3 (0x4342 -> $1, $3). folded: one mul.bf16x2 by 2^(s-1) (bits `s*128 + 0x3F00` per lane,
    valid for s <= 128) instead of 2^126 then 2^(s-127)."""
    if folded:
        scale, rebias = "mad.lo.u32 sc, sc, 128, 0x3F003F00;", ""
    else:
        scale, rebias = "shl.b32 sc, sc, 7;", "mul.rn.bf16x2 x, x, bias;"

    def half(sel, even, odd):
        return f"""
        prmt.b32 a, $4, 0, {sel};
        prmt.b32 sc, $5, 0, {sel};
        {scale}
        shl.b32 x, a, 6;
        shl.b32 y, a, 12;
        or.b32 x, x, y;
        and.b32 x, x, 0x81C081C0;
        {rebias}
        mul.rn.bf16x2 {even}, x, sc;
        and.b32 z, a, 0x00F000F0;
        mul.lo.u32 x, z, 0x104;
        and.b32 x, x, 0x81C081C0;
        {rebias}
        mul.rn.bf16x2 {odd}, x, sc;"""
    return ("""
        {
        .reg .b32 a, x, y, z, sc, bias;
        mov.b32 bias, 0x7E807E80;""" + half("0x4140", "$0", "$2") + half("0x4342", "$1", "$3") + """
        }
        """)


_ASM2 = tl.constexpr(_asm2_text(False))    # a jit function reads a global only as a constexpr
_ASM2_FOLDED = tl.constexpr(_asm2_text(True))


@triton.jit
def _dequant_asm2(p, s, FOLDED: tl.constexpr):
    """GPU decode: p uint8 [BN, BKH] packed; s uint8 [BN, BKH] the E8M0
    exponent of each byte's group. Per 32-bit word (4 bytes, 8 weights): one prmt spreads two bytes into the two
    bf16 lanes; even codes (low nibbles): magnitude bits << 6 to bf16 bits 8:6 and sign << 12 to bit 15, one lop3
    `(a<<6 | a<<12) & 0x81C081C0` (the two shifted copies never overlap inside that mask); odd codes (high nibbles):
    `(z * 0x104) & 0x81C081C0` with z = `a & 0x00F000F0` (z<<2 | z<<8 as one multiply: the copies never overlap,
    so no carry; `test_dequant_odd_nibble_multiply_identity`). The result is the E2M1 value times 2^-126 (0.5 is a
    bf16 subnormal), so mul.bf16x2 by 2^126 makes it exact; the scale 2^(s-127) is `s << 7` as bf16 bits (E8M0
    s <= 254; s = 0 gives 0). FOLDED (only when every s <= 128): one multiply by 2^(s-1) does both. About 3.5
    instructions per weight (3 folded)."""
    if FOLDED:
        lo, hi = tl.inline_asm_elementwise(asm=_ASM2_FOLDED, constraints="=r,=r,=r,=r,r,r", args=[p, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(asm=_ASM2, constraints="=r,=r,=r,=r,r,r", args=[p, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _scale_max(sg, rows, rmask, stride_s, NG, BN: tl.constexpr, SG: tl.constexpr):
    """Largest E8M0 exponent in rows `rows` (all NG groups) of one expert's scales, SG groups per load (SG divides
    NG: no column mask, so the loads vectorize)."""
    m = tl.zeros([BN, SG], dtype=tl.int32)
    for g0 in range(0, NG, SG):
        gg = g0 + tl.arange(0, SG)
        m = tl.maximum(m, tl.load(sg + rows[:, None].to(tl.int64) * stride_s + gg[None, :], mask=rmask[:, None],
                                  other=0).to(tl.int32))
    return tl.max(tl.max(m, axis=1), axis=0)


def _scan_groups(ng: int) -> int:
    """Groups per load of `_scale_max`: the largest power of two <= 16 dividing ng."""
    return next(g for g in (16, 8, 4, 2, 1) if ng % g == 0)


@triton.jit
def _load_wtile(w_ptr, s_ptr, rows, rmask, j0, stride_w, stride_s,
                BN: tl.constexpr, BKH: tl.constexpr, DQ: tl.constexpr, CDT: tl.constexpr):
    """Dequantized (lo, hi) [BN, BKH] tiles of rows `rows`, packed columns j0 .. j0+BKH.
    DQ: 0 plain Triton (interpreter), 2 `_dequant_asm2`, 3 its folded form (GPU; only for scales <= 128: the
    kernels pick 2 or 3 per program with `_scale_max`)."""
    jj = tl.arange(0, BKH)
    p = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + (j0 + jj)[None, :], mask=rmask[:, None], other=0)
    gg = tl.arange(0, BKH // 16)
    s = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_s + (j0 // 16 + gg)[None, :], mask=rmask[:, None], other=127)
    if DQ >= 2:
        se = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
        lo, hi = _dequant_asm2(p, se, DQ == 3)
    else:
        se = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
        lo, hi = _dequant_ref(p, se)
        lo = lo.to(CDT)
        hi = hi.to(CDT)
    return lo, hi


@triton.jit
def _load_x_split(base, rows, rmask, k0, stride, BM: tl.constexpr, BK: tl.constexpr):
    """(even, odd) columns [BM, BK/2] of rows `rows` of a row-major matrix, columns k0 .. k0+BK: one contiguous
    [BM, BK] load split in registers (faster than two stride-2 loads)."""
    kk = tl.arange(0, BK)
    xv = tl.load(base + rows[:, None] * stride + (k0 + kk)[None, :], mask=rmask[:, None], other=0.0)
    return tl.split(tl.reshape(xv, (BM, BK // 2, 2)))


@triton.jit
def _situ(g, u, beta, lbeta):
    # 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25); tanh(x) = 2 sigmoid(2x) - 1
    tg = 2.0 / (1.0 + tl.exp(-2.0 * g / beta)) - 1.0
    tu = 2.0 / (1.0 + tl.exp(-2.0 * u / lbeta)) - 1.0
    return beta * tg * (1.0 / (1.0 + tl.exp(-g))) * lbeta * tu


@triton.jit
def _w13_tile(x_ptr, tok, mmask, stride_x, wg, sg, nn, nmask, stride_w, stride_s, I, RL,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DQ: tl.constexpr, CDT: tl.constexpr):
    """fp32 (gate, up) [BM, BN] accumulators of x[tok] · W13ᵀ over the whole K = RL for rows nn of one expert."""
    BKH: tl.constexpr = BK // 2
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for j0 in range(0, RL // 2, BKH):
        xe, xo = _load_x_split(x_ptr, tok, mmask, 2 * j0, stride_x, BM, BK)
        xe = xe.to(CDT)
        xo = xo.to(CDT)
        glo, ghi = _load_wtile(wg, sg, nn, nmask, j0, stride_w, stride_s, BN, BKH, DQ, CDT)
        acc_g = tl.dot(xe, tl.trans(glo), acc_g)
        acc_g = tl.dot(xo, tl.trans(ghi), acc_g)
        ulo, uhi = _load_wtile(wg, sg, nn + I, nmask, j0, stride_w, stride_s, BN, BKH, DQ, CDT)
        acc_u = tl.dot(xe, tl.trans(ulo), acc_u)
        acc_u = tl.dot(xo, tl.trans(uhi), acc_u)
    return acc_g, acc_u


@triton.jit
def _w2_tile(h_ptr, mm, mmask, stride_h, wg, sg, nn, nmask, stride_w, stride_s, I,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DQ: tl.constexpr, CDT: tl.constexpr):
    """fp32 [BM, BN] accumulator of h[mm] · W2ᵀ over the whole K = I for rows nn of one expert."""
    BKH: tl.constexpr = BK // 2
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for j0 in range(0, I // 2, BKH):
        he, ho = _load_x_split(h_ptr, mm.to(tl.int64), mmask, 2 * j0, stride_h, BM, BK)
        wlo, whi = _load_wtile(wg, sg, nn, nmask, j0, stride_w, stride_s, BN, BKH, DQ, CDT)
        acc = tl.dot(he.to(CDT), tl.trans(wlo), acc)
        acc = tl.dot(ho.to(CDT), tl.trans(whi), acc)
    return acc


@triton.jit
def _moe_w13_kernel(
    x_ptr, tok_ptr, offs_ptr, w_ptr, s_ptr, h_ptr,
    stride_x, stride_we, stride_w, stride_se, stride_s, stride_h,
    I, RL, beta, lbeta,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DQ: tl.constexpr, CDT: tl.constexpr, SG: tl.constexpr,
):
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    lo_off = tl.load(offs_ptr + e)
    hi_off = tl.load(offs_ptr + e + 1)
    if hi_off <= lo_off:
        return
    nn = pid_n * BN + tl.arange(0, BN)
    nmask = nn < I
    wg = w_ptr + e.to(tl.int64) * stride_we
    sg = s_ptr + e.to(tl.int64) * stride_se
    if DQ == 3:   # one multiply per weight pair when this program's scales allow it (uniform branch)
        fold = tl.maximum(_scale_max(sg, nn, nmask, stride_s, RL // 32, BN, SG),
                          _scale_max(sg, nn + I, nmask, stride_s, RL // 32, BN, SG)) <= 128
    for m0 in range(lo_off, hi_off, BM):
        mm = m0 + tl.arange(0, BM)
        mmask = mm < hi_off
        tok = tl.load(tok_ptr + mm, mask=mmask, other=0).to(tl.int64)
        if DQ == 3:
            if fold:
                acc_g, acc_u = _w13_tile(x_ptr, tok, mmask, stride_x, wg, sg, nn, nmask, stride_w, stride_s, I, RL,
                                         BM, BN, BK, 3, CDT)
            else:
                acc_g, acc_u = _w13_tile(x_ptr, tok, mmask, stride_x, wg, sg, nn, nmask, stride_w, stride_s, I, RL,
                                         BM, BN, BK, 2, CDT)
        else:
            acc_g, acc_u = _w13_tile(x_ptr, tok, mmask, stride_x, wg, sg, nn, nmask, stride_w, stride_s, I, RL,
                                     BM, BN, BK, DQ, CDT)
        hval = _situ(acc_g, acc_u, beta, lbeta)
        tl.store(h_ptr + mm[:, None].to(tl.int64) * stride_h + nn[None, :], hval.to(h_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _moe_w2_kernel(
    h_ptr, pair_ptr, wts_ptr, offs_ptr, w_ptr, s_ptr, y_ptr,
    stride_h, stride_we, stride_w, stride_se, stride_s, stride_y,
    I, RL,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DQ: tl.constexpr, CDT: tl.constexpr, SG: tl.constexpr,
):
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    lo_off = tl.load(offs_ptr + e)
    hi_off = tl.load(offs_ptr + e + 1)
    if hi_off <= lo_off:
        return
    nn = pid_n * BN + tl.arange(0, BN)
    nmask = nn < RL
    wg = w_ptr + e.to(tl.int64) * stride_we
    sg = s_ptr + e.to(tl.int64) * stride_se
    if DQ == 3:
        fold = _scale_max(sg, nn, nmask, stride_s, I // 32, BN, SG) <= 128
    for m0 in range(lo_off, hi_off, BM):
        mm = m0 + tl.arange(0, BM)
        mmask = mm < hi_off
        if DQ == 3:
            if fold:
                acc = _w2_tile(h_ptr, mm, mmask, stride_h, wg, sg, nn, nmask, stride_w, stride_s, I, BM, BN, BK, 3, CDT)
            else:
                acc = _w2_tile(h_ptr, mm, mmask, stride_h, wg, sg, nn, nmask, stride_w, stride_s, I, BM, BN, BK, 2, CDT)
        else:
            acc = _w2_tile(h_ptr, mm, mmask, stride_h, wg, sg, nn, nmask, stride_w, stride_s, I, BM, BN, BK, DQ, CDT)
        pair = tl.load(pair_ptr + mm, mask=mmask, other=0).to(tl.int64)
        wt = tl.load(wts_ptr + pair, mask=mmask, other=0.0)
        tl.store(y_ptr + pair[:, None] * stride_y + nn[None, :], acc * wt[:, None], mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _moe_sort_kernel(ids_ptr, order_ptr, tok_ptr, offs_ptr, M, E, expert_offset,
                     K: tl.constexpr, BLOCK: tl.constexpr):
    """grid (E + 1,): counting sort of the M = T*K (token, choice) pairs by local expert, stable, deterministic,
    fixed shapes, no host sync. Program e writes offs[e] = #pairs with key < e (key = id - expert_offset, or E
    for a non-local id; offs[E] = #local pairs) and, for e < E, the pair ids (order) and token ids (tok) of its
    pairs at offs[e] .. in pair order."""
    e = tl.program_id(0)
    n_lt = tl.full((), 0, tl.int32)
    for m0 in range(0, M, BLOCK):
        mm = m0 + tl.arange(0, BLOCK)
        mk = mm < M
        key = tl.load(ids_ptr + mm, mask=mk, other=0) - expert_offset
        key = tl.where((key >= 0) & (key < E), key, E)
        n_lt += tl.sum((mk & (key < e)).to(tl.int32), axis=0)
    tl.store(offs_ptr + e, n_lt)
    if e < E:
        run = n_lt
        for m0 in range(0, M, BLOCK):
            mm = m0 + tl.arange(0, BLOCK)
            mk = mm < M
            key = tl.load(ids_ptr + mm, mask=mk, other=0) - expert_offset
            hit = mk & (key == e)
            hi = hit.to(tl.int32)
            pos = run + tl.cumsum(hi, axis=0) - 1
            tl.store(order_ptr + pos, mm, mask=hit)
            tl.store(tok_ptr + pos, mm // K, mask=hit)
            run += tl.sum(hi, axis=0)


@triton.jit
def _moe_combine_kernel(ypair_ptr, ids_ptr, y_ptr, RL, E, expert_offset, stride_y,
                        K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """grid (T, cdiv(RL, BR)): y[t] = sum over the token's local choices of ypair[t*K + j] (fp32; the rows of
    non-local choices are never read, so ypair needs no zeroing)."""
    t = tl.program_id(0)
    cc = tl.program_id(1) * BR + tl.arange(0, BR)
    cm = cc < RL
    j = tl.arange(0, BK)
    key = tl.load(ids_ptr + t * K + j, mask=j < K, other=-1) - expert_offset
    local = (j < K) & (key >= 0) & (key < E)
    yp = tl.load(ypair_ptr + (t * K + j)[:, None].to(tl.int64) * RL + cc[None, :],
                 mask=local[:, None] & cm[None, :], other=0.0)
    tl.store(y_ptr + t.to(tl.int64) * stride_y + cc, tl.sum(yp, axis=0), mask=cm)


def _sort_pairs(ids, E, expert_offset, ws):
    """(order, tok, offs) of the (token, choice) pairs of ids [T, k] int32 (contiguous) sorted by local expert
    (see _moe_sort_kernel)."""
    T, k = ids.shape
    M = T * k
    order = ws.empty((M,), torch.int32)
    tok = ws.empty((M,), torch.int32)
    offs = ws.empty((E + 1,), torch.int32)
    _moe_sort_kernel[(E + 1,)](ids, order, tok, offs, M, E, int(expert_offset), K=k, BLOCK=1024, num_warps=4)
    return order, tok, offs


def _h_dtype(device) -> torch.dtype:
    # interpreter (CPU): fp32 math (its bf16 dot is unreliable)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def mxfp4_moe_workspace_bytes(num_tokens: int, top_k: int, num_experts: int, intermediate_size: int,
                              hidden_size: int, *, device=None) -> int:
    """Workspace bytes of :func:`mxfp4_moe` (plugins/workspace.py convention) for up to `num_tokens` tokens with
    `top_k` choices, `num_experts` local experts, intermediate size I and latent size Rl (`hidden_size`): sort
    buffers (pair order, token ids, expert offsets; int32), h `[T*k, I]` (bf16 on the GPU), per-pair outputs
    `[T*k, Rl]` fp32, and on the GPU the activations in the Gluon kernels' column order `[T, Rl]` bf16 (whichever
    kernels run). device: where it runs (default CUDA if present)."""
    M = int(num_tokens) * int(top_k)
    if M <= 0:
        return 0
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    return plan_bytes(_workspace_plan(int(num_tokens), M, num_experts, intermediate_size, hidden_size, dev))


def _workspace_plan(T, M, num_experts, inter, latent, dev):
    """(shape, dtype) of each workspace buffer, in the order `mxfp4_moe` takes them."""
    plan = [((M,), torch.int32), ((M,), torch.int32), ((num_experts + 1,), torch.int32),
            ((M, inter), _h_dtype(dev)), ((M, latent), torch.float32)]
    return plan + ([((T, latent), torch.bfloat16)] if dev.type == "cuda" else [])


def _pick_block_m(T, k, num_experts):
    """Token tile of the legacy grouped GEMMs from the mean (token, choice) pairs per expert, T*k / num_experts
    with the GLOBAL routed expert count (under EP the T*k pairs spread over all ranks' experts): one 16-row tile
    when an expert gets few tokens (decode), else 64 rows so each weight tile is dequantized once for more
    tokens."""
    avg = triton.cdiv(T * k, max(num_experts, 1))
    return 16 if avg <= 16 else 64


def default_block_k(latent: int, inter: int, block_m: int = 16) -> int:
    """K tile of the legacy grouped GEMMs for `block_m`-row token tiles: the largest power of two <= 64 for 16-row
    tiles, <= 128 for 64-row tiles (the faster K tile of each), and >= 32 (the MXFP4 group), dividing both the
    latent width Rl (inner dim of w13) and the expert width I (inner dim of w2). The K loops load whole tiles
    without a column mask, so a tile that does not divide a row would read past it: k3-tiny (I = 64) and its TP=2
    expert slices (I = 32). ValueError when no such tile exists."""
    bk = 128 if block_m >= 64 else 64
    while bk > 32 and (latent % bk or inter % bk):
        bk //= 2
    if latent % bk or inter % bk:
        raise ValueError(f"mxfp4_moe: latent width {latent} and expert width {inter} must be multiples of 32 "
                         "(the MXFP4 group, MODEL.md §8.3)")
    return bk


def mxfp4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, *, expert_offset: int = 0,
              situ_beta: float = 4.0, situ_linear_beta: float = 25.0, num_experts: int = 0, out=None,
              workspace: torch.Tensor | None = None):
    """Mxfp4Moe (MODEL.md §7.2, §8.3): y [T, Rl] fp32 = sum over local choices of w * w2_e(SiTU(w1_e x, w3_e x)).

    The grouped GEMMs (`_pick_impl`): the Gluon kernels of plugins/moe/kernels_gluon.py (MXFP4 bytes decoded
    straight into the mma.sync operand registers, weights and activation tiles through a cp.async ring; tiles:
    `kernels_gluon.resolve_tiles`) on CUDA sm_90+ for decode-sized batches, else the Triton kernels here (MXFP4
    dequantized to bf16 tiles in registers by inline PTX, 128 output columns, the token tile `_pick_block_m`, the
    K tile :func:`default_block_k`; plain Triton arithmetic in the interpreter). Every launch has a grid fixed by
    the shapes (no host reads): CUDA-graph safe.

    Args:
        x [T, Rl]: bf16 / fp32 activations.
        topk_ids [T, k] int: global expert ids (ids outside expert_offset .. expert_offset + E contribute 0);
            topk_w [T, k] fp32: their routing weights.
        w13_packed [E, 2I, Rl/2] uint8 (E2M1 pairs, low nibble = even column), w13_scale [E, 2I, Rl/32] uint8
            (E8M0); w2_packed [E, Rl, I/2], w2_scale [E, Rl, I/32] likewise (Rl and I multiples of 32).
        expert_offset: the first local expert's global id (EP); situ_beta, situ_linear_beta: SiTU's constants
            (MODEL.md §7.2).
        num_experts: routed experts over all EP ranks (0 = E, no EP): the token tiles divide T*k by it.
        out: optional [T, Rl] fp32 destination.
        workspace: optional uint8 scratch (size: :func:`mxfp4_moe_workspace_bytes`) for the sort buffers, h and
            the per-pair outputs.
    Returns:
        y [T, Rl] fp32: the sum over this rank's experts (an EP partial sum).
    Raises:
        ValueError for num_experts below expert_offset + E (plugins.moe.reference.check_num_experts) and for
        widths that are not multiples of 32.
    """
    T, RL = x.shape
    k = topk_ids.shape[1]
    E, I2, _ = w13_packed.shape
    I = I2 // 2
    dev = x.device
    n_global = check_num_experts(num_experts, int(expert_offset), E)
    impl = _pick_impl(dev, T, k, n_global, RL, I)
    block_m = _pick_block_m(T, k, n_global)
    block_k = default_block_k(RL, I, block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(T, RL, dtype=torch.float32, device=dev)
    if T == 0:
        return out
    ws = Workspace(workspace, dev, "mxfp4_moe")
    ids = topk_ids if topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() else \
        topk_ids.to(torch.int32).contiguous()
    order, tok, offs = _sort_pairs(ids, E, int(expert_offset), ws)
    wts = topk_w.reshape(-1)
    wts = wts if wts.dtype == torch.float32 and wts.is_contiguous() else wts.to(torch.float32).contiguous()
    h = ws.empty((T * k, I), _h_dtype(dev))
    ypair = ws.empty((T * k, RL), torch.float32)   # rows of local pairs only are written, and only those read
    if impl == "gluon":
        from k3deploy.plugins.moe import kernels_gluon
        kernels_gluon.grouped_gemms(x, tok, order, wts, offs, w13_packed, w13_scale, w2_packed, w2_scale, h, ypair,
                                    ws.empty((T, RL), torch.bfloat16), situ_beta=situ_beta,
                                    situ_linear_beta=situ_linear_beta,
                                    pairs_per_expert=triton.cdiv(T * k, n_global))
    else:
        on_gpu = dev.type == "cuda" and not _INTERPRET
        # the folded-scale decode with 16-row token tiles; with 64-row tiles the unfolded one is faster
        dequant = (3 if block_m < 64 else 2) if on_gpu else 0
        cdt = tl.bfloat16 if dev.type == "cuda" else tl.float32   # interpreter: fp32 math (its bf16 dot is unreliable)
        bn = 128
        _moe_w13_kernel[(triton.cdiv(I, bn), E)](
            x, tok, offs, w13_packed, w13_scale, h,
            x.stride(0), w13_packed.stride(0), w13_packed.stride(1), w13_scale.stride(0), w13_scale.stride(1),
            h.stride(0), I, RL, float(situ_beta), float(situ_linear_beta),
            BM=block_m, BN=bn, BK=block_k, DQ=dequant, CDT=cdt, SG=_scan_groups(RL // 32), num_warps=4,
            num_stages=3)
        _moe_w2_kernel[(triton.cdiv(RL, bn), E)](
            h, order, wts, offs, w2_packed, w2_scale, ypair,
            h.stride(0), w2_packed.stride(0), w2_packed.stride(1), w2_scale.stride(0), w2_scale.stride(1),
            ypair.stride(0), I, RL, BM=block_m, BN=bn, BK=block_k, DQ=dequant, CDT=cdt, SG=_scan_groups(I // 32),
            num_warps=4, num_stages=3)
    BR = min(256, triton.next_power_of_2(RL))
    _moe_combine_kernel[(T, triton.cdiv(RL, BR))](ypair, ids, out, RL, E, int(expert_offset), out.stride(0),
                                                 K=k, BK=triton.next_power_of_2(k), BR=BR, num_warps=4)
    return out


def _pick_impl(dev, T: int, k: int, num_experts: int, latent: int, inter: int) -> str:
    """The grouped GEMMs of `mxfp4_moe`: "gluon" on a CUDA device of compute capability >= 9.0 (its decode's
    bf16x2 multiply; not the interpreter) whose Triton has Gluon, for decode-sized batches of at least 64 (token,
    choice) pairs and at most 32 per expert on average over the `num_experts` routed experts of all ranks (the Gluon
    kernels take 8/16/32-token tiles; above 32 per expert the legacy kernels' 64-row tiles are faster), for widths
    the Gluon kernels take (`kernels_gluon.resolve_tiles`); else "legacy". Below 64 pairs (T=1, 2 at top-16) eager
    calls are host-bound and the Gluon path's launches cost more Python time, while its kernels take no longer on
    the GPU."""
    if dev.type != "cuda" or _INTERPRET or T * k < 64 or triton.cdiv(T * k, max(num_experts, 1)) > 32 \
            or not _has_gluon():
        return "legacy"
    try:
        if torch.cuda.get_device_capability(dev) < (9, 0):
            return "legacy"
    except (RuntimeError, AssertionError):     # no driver here (tests on the CPU): the caller's device decides
        pass
    from k3deploy.plugins.moe import kernels_gluon
    try:
        kernels_gluon.resolve_tiles(latent, inter)
    except ValueError:
        return "legacy"
    return "gluon"


@functools.lru_cache(maxsize=None)
def _has_gluon() -> bool:
    """Whether plugins.moe.kernels_gluon imports (a Triton with Gluon and the names it uses)."""
    try:
        from k3deploy.plugins.moe import kernels_gluon  # noqa: F401
    except Exception as e:     # ImportError, or an AttributeError from a Gluon whose names moved
        log.warning("mxfp4_moe: Gluon kernels unavailable (%r; they need Triton >= 3.6 with Gluon): the slower "
                    "legacy Triton kernels run", e)
        return False
    return True


@triton.jit
def _route_kernel(z_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_z, scaling,
                  EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr):
    """One token: router logits z [E] fp32 -> its top-K experts (ids int32 [K], best first) and weights fp32 [K].
    EP, KP, GP: E, K, G rounded up to powers of 2. sigmoid; selection on score + correction bias; with G > 1 groups
    (E / G experts each) only the TOPK_GROUP groups with the largest top-2 sums compete; weights = the unbiased
    scores of the chosen, / their sum (RENORM; + 1e-20), x scaling. Ties go to the lower index (torch.topk's order on
    exact ties is unspecified)."""
    t = tl.program_id(0)
    e = tl.arange(0, EP)
    valid = e < E
    z = tl.load(z_ptr + t * stride_z + e, mask=valid, other=0.0)
    s = 1.0 / (1.0 + tl.exp(-z))
    sel = s + tl.load(bias_ptr + e, mask=valid, other=0.0)
    sel = tl.where(valid, tl.where(sel != sel, float("inf"), sel), float("-inf"))     # NaN ranks first, as in topk
    if G > 1:
        EG = E // G
        grp = e // EG
        gi = tl.arange(0, GP)
        gscore = tl.full([GP], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            in_g = valid & (grp == g)
            v = tl.where(in_g, sel, float("-inf"))
            first = tl.argmax(v, 0, tie_break_left=True)
            m1 = tl.max(v, 0)
            m2 = tl.max(tl.where(e == first, float("-inf"), v), 0)
            gscore = tl.where(gi == g, m1 + m2, gscore)
        keep = gi < 0
        for j in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, 0, tie_break_left=True)
            keep = keep | (gi == best)
            gscore = tl.where(gi == best, float("-inf"), gscore)
        kept = tl.sum(tl.where((grp[:, None] == gi[None, :]) & keep[None, :], 1, 0), 1) > 0
        sel = tl.where(kept, sel, float("-inf"))
    kk = tl.arange(0, KP)
    ids = tl.zeros([KP], tl.int32)
    for j in tl.static_range(K):
        best = tl.argmax(sel, 0, tie_break_left=True)
        ids = tl.where(kk == j, best, ids)
        sel = tl.where(e == best, float("-inf"), sel)
    # the chosen experts' scores: their logits gathered and the same sigmoid (one load instead of K reductions)
    zk = tl.load(z_ptr + t * stride_z + ids, mask=kk < K, other=0.0)
    ws = tl.where(kk < K, 1.0 / (1.0 + tl.exp(-zk)), 0.0)
    if RENORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + t * K + kk, ws * scaling, mask=kk < K)


def route(x, gate_w, correction_bias, *, top_k: int = 16, num_expert_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0, renormalize: bool = True, out=None):
    """fp32 router (MODEL.md §7.2, noaux_tc): x [T, d] any float dtype, gate_w [E, d], correction_bias [E] (used
    for the selection only): the fp32 logits x·gate_wᵀ in torch (cuBLAS on the GPU), then `route_topk`. Returns
    (topk_ids int32 [T, k] best first, topk_w fp32 [T, k]); out and errors as in `route_topk`."""
    z = x.float() @ gate_w.float().t()
    return route_topk(z, correction_bias, top_k=top_k, num_expert_group=num_expert_group, topk_group=topk_group,
                      routed_scaling_factor=routed_scaling_factor, renormalize=renormalize, out=out)


def route_topk(z, correction_bias, *, top_k: int = 16, num_expert_group: int = 1, topk_group: int = 1,
               routed_scaling_factor: float = 1.0, renormalize: bool = True, out=None):
    """The router after its GEMM: logits z fp32 [T, E] (rows contiguous), correction_bias [E] -> (topk_ids int32
    [T, k] best first, topk_w fp32 [T, k]): sigmoid scores, selection on score + bias, optional group stage
    (num_expert_group groups ranked by the sum of their top-2 biased scores, topk_group kept; only when
    num_expert_group > topk_group), top-k, weights = the unbiased scores of the chosen, renormalized (sum + 1e-20)
    and times routed_scaling_factor. On CUDA and under TRITON_INTERPRET=1 one `_route_kernel` program per token;
    on a CPU otherwise the reference (`reference.route_logits`). out: optional (ids, weights) to write (contiguous,
    shapes and dtypes as returned). ValueError for top_k above the experts competing, or groups that do not divide
    E into groups of >= 2."""
    z = z.float().contiguous()
    T, E = z.shape
    grouped = num_expert_group > 1 and num_expert_group > topk_group
    if grouped and (E % num_expert_group or E // num_expert_group < 2):
        raise ValueError(f"route: num_expert_group={num_expert_group} must divide the {E} experts into groups of "
                         "at least 2 (a group's score is its top-2 sum)")
    if top_k > (E // num_expert_group * topk_group if grouped else E):
        raise ValueError(f"route: top_k={top_k} exceeds the experts that compete ({E} experts, "
                         f"{num_expert_group} groups, {topk_group} kept)")
    ids, w = out if out is not None else (torch.empty(T, top_k, dtype=torch.int32, device=z.device),
                                          torch.empty(T, top_k, dtype=torch.float32, device=z.device))
    if z.device.type == "cuda" or _INTERPRET:
        if T:
            G = num_expert_group if grouped else 1
            _route_kernel[(T,)](z, correction_bias.float().contiguous(), ids, w, E, z.stride(0),
                                float(routed_scaling_factor), EP=triton.next_power_of_2(E), K=top_k,
                                KP=triton.next_power_of_2(top_k), G=G, GP=triton.next_power_of_2(G),
                                TOPK_GROUP=topk_group if grouped else 1, RENORM=bool(renormalize),
                                num_warps=1 if E <= 2048 else 4)     # one warp: every reduction in shuffles
        return ids, w
    rids, rw = route_logits(z, correction_bias, top_k=top_k, num_expert_group=num_expert_group,
                            topk_group=topk_group, renormalize=renormalize, scaling=routed_scaling_factor)
    ids.copy_(rids)
    w.copy_(rw)
    return ids, w
