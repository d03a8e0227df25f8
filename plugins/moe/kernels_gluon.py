"""MXFP4 grouped GEMMs of `mxfp4_moe` in Gluon (Triton's explicit-layout dialect): GPU only, sm_90+ (the decode's
mul.rn.bf16x2; the MMAs are mma.sync).
The Triton interpreter cannot run Gluon, so the CPU runs plugins/moe/kernels.py's Triton kernels; CI compiles these
for sm_90 offline (tests/plugins/test_moe_gluon.py). MODEL.md §7.2, §8.3. Speed against the Triton kernels:
bench_kernels.py --only moe on an H200.

Why a second form: in the Triton kernels the compiler picks the register layouts, so the packed bytes are unpacked
and re-packed around the decode (~3.9 SASS instructions per weight; ncu: ALU-bound). Here each thread decodes its
MXFP4 bytes straight into the registers of its mma.sync operand, 8 codes per 32-bit word with 13 integer ops and
4 bf16x2 multiplies:

* K is relabelled within each 128-column step (a GEMM's K order is free when both operands use the same one). The
  thread with t = lane % 4 takes weight columns [32t, 32t + 32) of the step: 16 contiguous bytes of a row (4
  words, exactly one E8M0 group), and the same activation columns.
* A word holds codes n0..n7 (code j at bits 4j .. 4j+3 = column 8u + j of word u); decode output i (0..3) is the
  bf16 pair (n_i, n_{i+4}): both halves need the same shifts, so one 32-bit op serves two weights.
* Output i of the thread's words q = 2m + r (m, r in {0, 1}) feeds MMA m of output i at k = 8r + 2t + l (l: bf16
  lane), i.e. real column 32t + 16m + 8r + 4l + i of the step. The activations are stored once per call in that
  order (`permute_columns`: position 32i + 8t + 4m + 2r + l; moe_w13_kernel writes h in it for moe_w2_kernel), so
  a thread's B operands are 16-byte pieces of one row. The layout changes are reshapes / permutes / splits of
  registers only, asserted at compile time (`convert_layout(..., assert_trivial=True)`).
* Swap AB: weights are the A operand (16 rows per MMA), tokens the B operand (8 per MMA: 8-, 16- or 32-token tiles
  by the experts' mean pairs, `_token_tile`; with 16- or 32-token tiles, a tile of <= 8 pairs runs as an 8-token
  one and, with 32, one of <= 16 pairs as a 16-token one: `SPLIT_M`). Weight words and the activation tile stream
  through a cp.async ring in shared memory (the tile is copied once per CTA and read by every warp; `sub`
  128-column steps per copy: 256 columns = 128 bytes of each weight row where the widths allow). A program's first
  copies are in flight while it scans its E8M0 bytes for the fold decision (one round trip), and the next token
  tile's while it stores the current one; 128 registers per thread with 8/16-token tiles (4 programs per SM, no
  spills), 168 with 32-token tiles (3 per SM).
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

BLOCK_K = 128      # K columns per step (4 threads x 32)
BLOCK_N = 128      # weight rows per program (4 warps x 32 rows: no spills under the register caps below)
NUM_WARPS = 4
STAGES = 2         # cp.async ring slots
# cp.async global -> shared: `async_load` from Triton 3.7 on (3.9 keeps the old name only to raise), before that
# `async_copy_global_to_shared` (Triton 3.6, the H200 image)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


def _dq_finish(out: str, folded: bool) -> str:
    """PTX that ends the decode of one bf16x2 pair placed in v (magnitude bits 8:6, sign 15 of each half, garbage
    elsewhere): keep those bits, rebias by 2^126 unless `folded`, multiply by the factor $5 into `out`."""
    rebias = "" if folded else "mul.rn.bf16x2 v, v, bias;"
    return f"""
        and.b32 v, v, 0x81C081C0;
        {rebias}
        mul.rn.bf16x2 {out}, v, $5;"""


def _dq_asm(folded: bool) -> str:
    """PTX of `_decode`: $4 = one 32-bit word (codes n0..n7), $5 = the E8M0 factor as bf16x2 bits (folded:
    2^(s-1), else 2^(s-127)); $0..$3 = (n0, n4), (n1, n5), (n2, n6), (n3, n7) as bf16x2. Per pair: z = the two
    codes (mask), z * (2^a + 2^b) = z << a | z << b (the copies never overlap: no carry), & 0x81C081C0 keeps the
    magnitude at bf16 bits 8:6 and the sign at bit 15 of both halves: value x 2^-126 (0.5 is a bf16 subnormal,
    kept by mul.bf16x2), then x the factor (unfolded: first x 2^126). (n2, n6), (n3, n7) come from the word with
    the bytes of each half swapped (one prmt), like (n0, n4), (n1, n5). E8M0 edges on the unfolded path (taken
    only when a program's largest exponent exceeds 128): s = 0 (2^-127) decodes as 0, s = 255 (NaN in OCP MX) as
    inf / NaN; the legacy kernels do the same."""
    def pair(out, src, mask, mult):
        return f"""
        and.b32 v, {src}, {mask};
        mul.lo.u32 v, v, {mult};""" + _dq_finish(out, folded)
    return ("""
        {
        .reg .b32 v, w, bias;
        mov.b32 bias, 0x7E807E80;
        prmt.b32 w, $4, 0, 0x2301;"""
            + pair("$0", "$4", "0x000F000F", "0x1040")
            + pair("$1", "$4", "0x00F000F0", "0x104")
            + pair("$2", "w", "0x000F000F", "0x1040")
            + pair("$3", "w", "0x00F000F0", "0x104")
            + """
        }
        """)


_DQ = gl.constexpr(_dq_asm(False))
_DQ_FOLDED = gl.constexpr(_dq_asm(True))


@gluon.jit
def _decode(p, sc, FOLDED: gl.constexpr):
    """p int16 [R, C] (a 32-bit word = two consecutive int16 of a thread), sc int32 [R, C] bf16x2 factor bits
    (equal over each pair) -> 4 bf16 [R, C]: output i holds codes (n_i, n_{i+4}) of each word."""
    if FOLDED:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(asm=_DQ_FOLDED, constraints="=r,=r,=r,=r,r,r,r", args=[p, sc],
                                                   dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                                   is_pure=True, pack=2)
    else:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(asm=_DQ, constraints="=r,=r,=r,=r,r,r,r", args=[p, sc],
                                                   dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                                   is_pure=True, pack=2)
    return o0, o1, o2, o3


@gluon.jit
def _w_operands(o, BN: gl.constexpr, LA: gl.constexpr):
    """Decoded output i [BN, 32] of a step (thread t: elements 8t + 4m + 2r + l: word q = 2m + r, lane l) -> the two
    mma.sync A operands [BN, 16] (m = 0, 1) with k = 8r + 2t + l."""
    v = o.reshape([BN, 4, 2, 2, 2]).permute([0, 3, 1, 4, 2])
    v0, v1 = v.split()
    return (gl.convert_layout(v0.reshape([BN, 16]), LA, assert_trivial=True),
            gl.convert_layout(v1.reshape([BN, 16]), LA, assert_trivial=True))


@gluon.jit
def _x_operands(xv, BM: gl.constexpr, LB: gl.constexpr):
    """Activations bf16 [BM, 128] of one step in `permute_columns` order (thread t: positions 32i + 8t + e, i < 4,
    e < 8) -> the 8 mma.sync B operands [16, BM] in the order (i, m) = (0,0), (0,1), (1,0), .. (3,1): position
    32i + 8t + 4m + 2r + l = real column 32t + 16m + 8r + 4l + i of the step goes to k = 8r + 2t + l, matching
    `_w_operands` of decoded output i. Only register selection: no instruction."""
    v = xv.reshape([BM, 2, 2, 4, 2, 2, 2]).permute([0, 5, 3, 6, 1, 2, 4])
    v0, v1 = v.split()
    a, b = v0.split()
    x00, x20 = a.split()
    x10, x30 = b.split()
    c, d = v1.split()
    x01, x21 = c.split()
    x11, x31 = d.split()
    return (gl.convert_layout(x00.reshape([BM, 16]).permute([1, 0]), LB, assert_trivial=True),
            gl.convert_layout(x01.reshape([BM, 16]).permute([1, 0]), LB, assert_trivial=True),
            gl.convert_layout(x10.reshape([BM, 16]).permute([1, 0]), LB, assert_trivial=True),
            gl.convert_layout(x11.reshape([BM, 16]).permute([1, 0]), LB, assert_trivial=True),
            gl.convert_layout(x20.reshape([BM, 16]).permute([1, 0]), LB, assert_trivial=True),
            gl.convert_layout(x21.reshape([BM, 16]).permute([1, 0]), LB, assert_trivial=True),
            gl.convert_layout(x30.reshape([BM, 16]).permute([1, 0]), LB, assert_trivial=True),
            gl.convert_layout(x31.reshape([BM, 16]).permute([1, 0]), LB, assert_trivial=True))


@gluon.jit
def _scale_load(sp, rows, g0, stride_s, NGS: gl.constexpr, LS: gl.constexpr):
    """E8M0 bytes uint8 [BN, NGS] of weight rows `rows` [BN] (layout SliceLayout(1, LS)), groups g0 .. g0+NGS-1
    (LS: group 4j + t in thread t)."""
    gg = gl.arange(0, NGS, layout=gl.SliceLayout(0, LS))
    return gl.load(sp + rows[:, None] * stride_s + (g0 + gg)[None, :])


@gluon.jit
def _scale_part(sb, j: gl.constexpr, BN: gl.constexpr, SUB: gl.constexpr):
    """Groups 4j .. 4j+3 [BN, 4] of the slot's E8M0 bytes sb [BN, 4 SUB] (SUB 1 or 2; register selection only)."""
    if SUB == 1:
        part = sb
    else:
        p0, p1 = sb.reshape([BN, 2, 4]).permute([0, 2, 1]).split()
        part = p0 if j == 0 else p1
    return part


@gluon.jit
def _scale_bits(s, BN: gl.constexpr, FOLDED: gl.constexpr, LW: gl.constexpr):
    """E8M0 bytes [BN, 4] (one group per quad thread) -> bf16x2 factor bits (folded: 2^(s-1), else 2^(s-127))
    broadcast over the thread's [BN, 32] int16 word tile of layout LW."""
    if FOLDED:
        b = s.to(gl.int32) * 0x00800080 + 0x3F003F00
    else:
        b = s.to(gl.int32) * 0x00800080
    b = gl.join(b, b)
    b = gl.join(b, b)
    b = gl.join(b, b)
    return gl.convert_layout(b.reshape([BN, 32]), LW, assert_trivial=True)


@gluon.jit
def _mma_step(acc, p, sc, x00, x01, x10, x11, x20, x21, x30, x31, FOLDED: gl.constexpr, BN: gl.constexpr,
              LA: gl.constexpr):
    """acc [BN, BM] += one 128-column step: weight words p int16 [BN, 32] (factor bits sc) times the step's
    activation operands (weights are the mma.sync A operand, tokens the B operand: "swap AB")."""
    o0, o1, o2, o3 = _decode(p, sc, FOLDED)
    a0, a1 = _w_operands(o0, BN, LA)
    acc = mma_v2(a0, x00, acc)
    acc = mma_v2(a1, x01, acc)
    a0, a1 = _w_operands(o1, BN, LA)
    acc = mma_v2(a0, x10, acc)
    acc = mma_v2(a1, x11, acc)
    a0, a1 = _w_operands(o2, BN, LA)
    acc = mma_v2(a0, x20, acc)
    acc = mma_v2(a1, x21, acc)
    a0, a1 = _w_operands(o3, BN, LA)
    acc = mma_v2(a0, x30, acc)
    return mma_v2(a1, x31, acc)


@gluon.jit
def _copy_slot(wbuf, xbuf, slot, wptr, aptr, n, nv, SUB: gl.constexpr, LXC: gl.constexpr):
    """Start the cp.async copies of slot n (SUB 128-column steps: weight words and activation tile) into ring slot
    `slot`, as one commit group. In 32-row tiles only the tile's first nv activation rows (its pairs) are read and
    the rows past them zero-filled (no global read: the activation copies of a 32-row tile cost as much L2 traffic
    as its weights, and a tile is often half padding); 8- and 16-row tiles read every row (padding rows repeat a
    real one: L2 hits), which is faster there (H200)."""
    BM: gl.constexpr = aptr.shape[0]
    _async_load(wbuf.index(slot), wptr + n * (32 * SUB))
    if BM >= 32:
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, LXC))
        _async_load(xbuf.index(slot), aptr + n * (128 * SUB), mask=(rows < nv)[:, None])
    else:
        _async_load(xbuf.index(slot), aptr + n * (128 * SUB))
    async_copy.commit_group()


@gluon.jit
def _ring(BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr):
    """The cp.async ring of one program: (wbuf, xbuf). wbuf int16 [STAGES, BN, 32 SUB] holds the weight words of
    STAGES copies, xbuf bf16 [STAGES, BM, 128 SUB] the activation tiles (read by every warp; in every odd row the
    64-byte blocks are swapped pairwise, so the 16-byte reads of rows g and g + 1 by one quarter warp fall on
    different banks)."""
    SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    SX: gl.constexpr = gl.SwizzledSharedLayout(32, 1, 2, [1, 0])
    wbuf = gl.allocate_shared_memory(gl.int16, [STAGES, BN, 32 * SUB], SH)
    xbuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 128 * SUB], SX)
    return wbuf, xbuf


@gluon.jit
def _fill(wbuf, xbuf, wptr, a_ptr, arows, nv, stride_a, nslots, STAGES: gl.constexpr, SUB: gl.constexpr,
          LXC: gl.constexpr):
    """Start a token tile: the activation pointers aptr [BM, 128 SUB] of rows arows (SliceLayout(1, LXC)) of A
    (bf16 [*, K], `permute_columns` order; of its nv pairs: `_copy_slot` reads only those in 32-row tiles, and in
    smaller ones the padding rows read a real row of A — token 0 for x, the expert's last pair for h —: L2 hits)
    and the ring's first
    STAGES - 1 copies (past the last copy: repeats of it, L2 hits). Returns aptr."""
    kk = gl.arange(0, 128 * SUB, layout=gl.SliceLayout(0, LXC))
    aptr = a_ptr + arows[:, None] * stride_a + kk[None, :]
    for s in gl.static_range(STAGES - 1):
        _copy_slot(wbuf, xbuf, s, wptr, aptr, gl.minimum(s, nslots - 1), nv, SUB, LXC)
    return aptr


@gluon.jit
def _gemm(wbuf, xbuf, wptr, aptr, nv, sp, wrows, stride_s, nslots,
          BM: gl.constexpr, BN: gl.constexpr, FOLDED: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr,
          LXL: gl.constexpr, LW: gl.constexpr, LS: gl.constexpr, MMA: gl.constexpr, LXC: gl.constexpr):
    """fp32 [BN, BM] = W[wrows] · A[arows]ᵀ over K = nslots x 128 SUB columns, for a token tile `_fill` started
    (wbuf, xbuf: `_ring`; wptr: `_start`; aptr: `_fill`; W the int16 view of one expert's packed E2M1 rows; sp its
    E8M0 rows, wrows SliceLayout(1, LW)). BM (LXL: `layouts(.., BM, ..)`) may be less than the ring's rows: the
    first BM rows of each activation tile are read (a 16-row tile with <= 8 pairs computes as an 8-token tile:
    half the MMAs and activation reads; a 32-row one with <= 8 / <= 16 pairs as an 8- / 16-token tile). Each
    iteration starts the copy STAGES - 1 ahead, waits for its own, and runs the SUB 128-column steps of one slot;
    the E8M0 bytes of the next slot are loaded into registers. Returns with every copy landed (the next `_fill`
    reuses the slots; cp.async copies are ordered only by waits)."""
    LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    srows = gl.convert_layout(wrows, gl.SliceLayout(1, LS), assert_trivial=True)
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    sb = _scale_load(sp, srows, 0, stride_s, 4 * SUB, LS)
    for i in range(nslots):
        _copy_slot(wbuf, xbuf, (i + STAGES - 1) % STAGES, wptr, aptr, gl.minimum(i + STAGES - 1, nslots - 1), nv,
                   SUB, LXC)
        sb_n = _scale_load(sp, srows, gl.minimum(i + 1, nslots - 1) * (4 * SUB), stride_s, 4 * SUB, LS)
        async_copy.wait_group(STAGES - 1)
        cur = i % STAGES
        for j in gl.static_range(SUB):
            sc = _scale_bits(_scale_part(sb, j, BN, SUB), BN, FOLDED, LW)
            xs = xbuf.index(cur).slice(128 * j, 128, 1)
            if BM < xbuf.shape[1]:
                xs = xs.slice(0, BM, 0)
            xv = xs.load(LXL)
            x00, x01, x10, x11, x20, x21, x30, x31 = _x_operands(xv, BM, LB)
            pw = wbuf.index(cur).slice(32 * j, 32, 1).load(LW)
            acc = _mma_step(acc, pw, sc, x00, x01, x10, x11, x20, x21, x30, x31, FOLDED, BN, LA)
        sb = sb_n
    async_copy.wait_group(0)
    return acc


@gluon.jit
def _gemm_fold(fold, wbuf, xbuf, wptr, aptr, nv, sp, wrows, stride_s, nslots,
               BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, LXL: gl.constexpr,
               LW: gl.constexpr, LS: gl.constexpr, MMA: gl.constexpr, LXC: gl.constexpr):
    """`_gemm` with one multiply per weight pair when `fold` (every factor of the program's rows <= 2^1: a uniform
    branch), else two."""
    if fold:
        acc = _gemm(wbuf, xbuf, wptr, aptr, nv, sp, wrows, stride_s, nslots, BM, BN, True, STAGES, SUB, LXL, LW,
                    LS, MMA, LXC)
    else:
        acc = _gemm(wbuf, xbuf, wptr, aptr, nv, sp, wrows, stride_s, nslots, BM, BN, False, STAGES, SUB, LXL,
                    LW, LS, MMA, LXC)
    return acc


@gluon.jit
def _situ(g, u, beta, lbeta):
    # 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25); tanh(x) = 2 sigmoid(2x) - 1
    tg = 2.0 / (1.0 + gl.exp(-2.0 * g / beta)) - 1.0
    tu = 2.0 / (1.0 + gl.exp(-2.0 * u / lbeta)) - 1.0
    return beta * tg * (1.0 / (1.0 + gl.exp(-g))) * lbeta * tu


@gluon.jit
def _scale_max(sp, rows, stride_s, NG: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr):
    """Largest E8M0 exponent of weight rows `rows` [BN] (any 1-D layout) over all NG groups (a multiple of 4):
    4-byte loads of 32 groups per row at a time, NG / 32 per row, all issued before the first is used (one memory
    round trip of latency)."""
    LSC: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    gg = gl.arange(0, 32, layout=gl.SliceLayout(0, LSC))
    r = gl.convert_layout(rows, gl.SliceLayout(1, LSC))
    acc = gl.zeros([BN, 32], gl.int32, LSC)
    for q in gl.static_range((NG + 31) // 32):
        s = gl.load(sp + r[:, None] * stride_s + (32 * q + gg)[None, :], mask=(32 * q + gg < NG)[None, :], other=0)
        acc = gl.maximum(acc, s.to(gl.int32))
    return gl.reduce(gl.reduce(acc, 1, _maximum), 0, _maximum)


@gluon.jit
def _maximum(a, b):
    # a Gluon combine function (gl.max wraps a triton.jit one, which TRITON_INTERPRET=1 swaps for the interpreter's)
    return gl.maximum(a, b)


@gluon.jit
def _token_rows(tok_ptr, m0, hi_off, BM: gl.constexpr, LXC: gl.constexpr):
    """int64 [BM] (SliceLayout(1, LXC)): the token of sorted pairs m0 .. m0 + BM (past hi_off: token 0, unused)."""
    mx = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, LXC))
    return gl.load(tok_ptr + mx, mask=mx < hi_off, other=0).to(gl.int64)


@gluon.jit
def _pair_rows(m0, hi_off, BM: gl.constexpr, LXC: gl.constexpr):
    """int64 [BM] (SliceLayout(1, LXC)): h rows m0 .. m0 + BM, clamped to the expert's last pair hi_off - 1."""
    return gl.minimum(m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, LXC)), hi_off - 1).to(gl.int64)


@gluon.jit
def _start(wbuf, xbuf, w_ptr, s_ptr, e, stride_we, stride_se, wrows, stride_w, stride_s, K, a_ptr, arows, nv,
           stride_a,
           BN: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, NW: gl.constexpr, NG: gl.constexpr,
           LXC: gl.constexpr, LWC: gl.constexpr):
    """A program's start on expert e (packed words w_ptr int16 [E, *, K/4], E8M0 s_ptr uint8 [E, *, K/32]) for
    weight rows wrows [BN] (SliceLayout(1, LW)) and the first token tile's activation rows arows (A bf16 [*, K]):
    the ring's (`_ring`) first copies (`_fill`), in flight while the program's NG = K/32 E8M0 groups are scanned.
    Returns (sp: the expert's scales, wptr: the words of copy 0 of rows wrows, aptr, nslots = K / (128 SUB),
    fold: every factor <= 2^1, so one multiply per weight pair)."""
    wp = w_ptr + e.to(gl.int64) * stride_we
    sp = s_ptr + e.to(gl.int64) * stride_se
    jj = gl.arange(0, 32 * SUB, layout=gl.SliceLayout(0, LWC))
    wptr = wp + gl.convert_layout(wrows, gl.SliceLayout(1, LWC))[:, None] * stride_w + jj[None, :]
    nslots = K // (128 * SUB)
    aptr = _fill(wbuf, xbuf, wptr, a_ptr, arows, nv, stride_a, nslots, STAGES, SUB, LXC)
    fold = _scale_max(sp, wrows, stride_s, NG, BN, NW) <= 128
    return sp, wptr, aptr, nslots, fold


@gluon.jit
def _w13_tile(fold, wbuf, xbuf, wptr, aptr, sp, wrows, stride_s, nslots, x_ptr, tok_ptr, stride_x, h_ptr,
              stride_h, m0, hi_off, pid_n, beta, lbeta, BM: gl.constexpr, BMC: gl.constexpr, BN: gl.constexpr,
              STAGES: gl.constexpr, SUB: gl.constexpr, LXC: gl.constexpr, LXL: gl.constexpr, LW: gl.constexpr,
              LS: gl.constexpr, MMA: gl.constexpr):
    """One token tile of moe_w13_kernel (pairs m0 .. m0 + BMC, BMC <= BM the ring's rows; LXL: `layouts(.., BMC,
    ..)`): the GEMM, the next tile's first copies (issued before this tile's epilogue, so they overlap it), SiTU
    and the store of h. Returns the next tile's aptr."""
    HN: gl.constexpr = BN // 2
    acc = _gemm_fold(fold, wbuf, xbuf, wptr, aptr, hi_off - m0, sp, wrows, stride_s, nslots, BMC, BN, STAGES, SUB,
                     LXL, LW, LS, MMA, LXC)
    if m0 + BM < hi_off:
        aptr = _fill(wbuf, xbuf, wptr, x_ptr, _token_rows(tok_ptr, m0 + BM, hi_off, BM, LXC), hi_off - m0 - BM,
                     stride_x, nslots,
                     STAGES, SUB, LXC)
    g, u = acc.reshape([BN // 16, 2, 8, BMC]).permute([0, 2, 3, 1]).split()
    hval = _situ(g.reshape([HN, BMC]), u.reshape([HN, BMC]), beta, lbeta)   # [HN, BMC]: h transposed
    mo = m0 + gl.arange(0, BMC, layout=gl.SliceLayout(0, hval.type.layout))
    n = pid_n * HN + gl.arange(0, HN, layout=gl.SliceLayout(1, hval.type.layout))
    cc = n % 128    # = 32 t + 16 m + 8 r + 4 l + i  ->  stored at 32 i + 8 t + 4 m + 2 r + l
    col = n - cc + 32 * (cc % 4) + 8 * (cc // 32) + 4 * ((cc // 16) % 2) + 2 * ((cc // 8) % 2) + (cc // 4) % 2
    gl.store(h_ptr + mo[None, :].to(gl.int64) * stride_h + col[:, None], hval.to(gl.bfloat16),
             mask=(mo < hi_off)[None, :])
    return aptr


@gluon.jit
def moe_w13_kernel(x_ptr, tok_ptr, offs_ptr, w_ptr, s_ptr, h_ptr,
                   stride_x, stride_we, stride_w, stride_se, stride_s, stride_h,
                   I, RL, beta, lbeta,
                   BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, NW: gl.constexpr,
                   NG: gl.constexpr, LXC: gl.constexpr, LXL: gl.constexpr, LXL8: gl.constexpr, LXL16: gl.constexpr,
                   LWC: gl.constexpr, LW: gl.constexpr, LS: gl.constexpr, MMA: gl.constexpr,
                   SPLIT_M: gl.constexpr):
    """h [pairs, I] bf16 (columns in `permute_columns` order) = SiTU(x[tok] · W1ᵀ, x[tok] · W3ᵀ) for the pairs of
    expert program_id(1) (offs), columns program_id(0) * BN/2 .. + BN/2: the program's BN weight rows are BN/2
    gate rows n and the up rows I + n, interleaved per 8 rows. x bf16 [T, RL] in `permute_columns` order; w_ptr
    the int16 view of w13_packed [E, 2I, RL/2]; I % (BN/2) == 0, RL % (128 SUB) == 0. Layouts and SUB, NW:
    `layouts(BN, num_warps, BM, SUB)`. SPLIT_M (BM = 16 or 32): a tile of <= 8 pairs computes as an 8-token tile
    (LXL8: fewer MMAs and activation reads), with BM = 32 one of <= 16 pairs as a 16-token tile (LXL16)."""
    pid_n = gl.program_id(0)
    e = gl.program_id(1)
    lo_off = gl.load(offs_ptr + e)
    hi_off = gl.load(offs_ptr + e + 1)
    if hi_off > lo_off:
        wbuf, xbuf = _ring(BM, BN, STAGES, SUB)
        HN: gl.constexpr = BN // 2
        # tile rows 16a + 8b + j: b = 0 gate row pid_n * HN + 8a + j, b = 1 the matching up row (I + ..): the pair sits
        # in one thread (rows g and g + 8 of an mma tile), so gate and up split without data movement
        c = gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
        wrows = (pid_n * HN + (c // 16) * 8 + c % 8 + gl.where((c // 8) % 2 == 1, I, 0)).to(gl.int64)
        sp, wptr, aptr, nslots, fold = _start(
            wbuf, xbuf, w_ptr, s_ptr, e, stride_we, stride_se, wrows, stride_w, stride_s, RL, x_ptr,
            _token_rows(tok_ptr, lo_off, hi_off, BM, LXC), hi_off - lo_off, stride_x, BN, STAGES, SUB, NW, NG, LXC,
            LWC)
        for m0 in range(lo_off, hi_off, BM):
            if SPLIT_M and hi_off - m0 <= 8:
                aptr = _w13_tile(fold, wbuf, xbuf, wptr, aptr, sp, wrows, stride_s, nslots, x_ptr, tok_ptr, stride_x,
                                 h_ptr, stride_h, m0, hi_off, pid_n, beta, lbeta, BM, 8, BN, STAGES, SUB, LXC, LXL8, LW,
                                 LS, MMA)
            elif SPLIT_M and BM == 32 and hi_off - m0 <= 16:
                aptr = _w13_tile(fold, wbuf, xbuf, wptr, aptr, sp, wrows, stride_s, nslots, x_ptr, tok_ptr, stride_x,
                                 h_ptr, stride_h, m0, hi_off, pid_n, beta, lbeta, BM, 16, BN, STAGES, SUB, LXC, LXL16,
                                 LW, LS, MMA)
            else:
                aptr = _w13_tile(fold, wbuf, xbuf, wptr, aptr, sp, wrows, stride_s, nslots, x_ptr, tok_ptr, stride_x,
                                 h_ptr, stride_h, m0, hi_off, pid_n, beta, lbeta, BM, BM, BN, STAGES, SUB, LXC, LXL, LW,
                                 LS, MMA)


@gluon.jit
def _w2_tile(fold, wbuf, xbuf, wptr, aptr, sp, wrows, stride_s, nslots, h_ptr, stride_h, pair_ptr, wts_ptr,
             y_ptr, stride_y, m0, hi_off, pid_n, BM: gl.constexpr, BMC: gl.constexpr, BN: gl.constexpr,
             STAGES: gl.constexpr, SUB: gl.constexpr, LXC: gl.constexpr, LXL: gl.constexpr, LW: gl.constexpr,
             LS: gl.constexpr, MMA: gl.constexpr):
    """One token tile of moe_w2_kernel (pairs m0 .. m0 + BMC, as `_w13_tile`): the GEMM, the next tile's first
    copies, the routing weights and the store of the pair rows. Returns the next tile's aptr."""
    acc = _gemm_fold(fold, wbuf, xbuf, wptr, aptr, hi_off - m0, sp, wrows, stride_s, nslots, BMC, BN, STAGES, SUB,
                     LXL, LW, LS, MMA, LXC)
    if m0 + BM < hi_off:
        aptr = _fill(wbuf, xbuf, wptr, h_ptr, _pair_rows(m0 + BM, hi_off, BM, LXC), hi_off - m0 - BM, stride_h,
                     nslots, STAGES, SUB, LXC)
    mo = m0 + gl.arange(0, BMC, layout=gl.SliceLayout(0, MMA))
    omask = mo < hi_off
    pair = gl.load(pair_ptr + mo, mask=omask, other=0).to(gl.int64)
    wt = gl.load(wts_ptr + pair, mask=omask, other=0.0)
    no = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    gl.store(y_ptr + pair[None, :] * stride_y + no[:, None], acc * wt[None, :], mask=omask[None, :])
    return aptr


@gluon.jit
def moe_w2_kernel(h_ptr, pair_ptr, wts_ptr, offs_ptr, w_ptr, s_ptr, y_ptr,
                  stride_h, stride_we, stride_w, stride_se, stride_s, stride_y,
                  I, RL,
                  BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, NW: gl.constexpr,
                  NG: gl.constexpr, LXC: gl.constexpr, LXL: gl.constexpr, LXL8: gl.constexpr, LXL16: gl.constexpr,
                  LWC: gl.constexpr, LW: gl.constexpr, LS: gl.constexpr, MMA: gl.constexpr,
                  SPLIT_M: gl.constexpr):
    """y[pair, n] fp32 = w_pair · (h[m] · W2ᵀ) for the sorted pairs m of expert program_id(1), columns
    program_id(0) * BN ..; h bf16 [pairs, I] in `permute_columns` order (written by moe_w13_kernel); w_ptr the
    int16 view of w2_packed [E, RL, I/2]; RL % BN == 0, I % (128 SUB) == 0. Layouts and SUB, NW:
    `layouts(BN, num_warps, BM, SUB)`; SPLIT_M as in moe_w13_kernel."""
    pid_n = gl.program_id(0)
    e = gl.program_id(1)
    lo_off = gl.load(offs_ptr + e)
    hi_off = gl.load(offs_ptr + e + 1)
    if hi_off > lo_off:
        wbuf, xbuf = _ring(BM, BN, STAGES, SUB)
        c = gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
        wrows = (pid_n * BN + c).to(gl.int64)
        sp, wptr, aptr, nslots, fold = _start(
            wbuf, xbuf, w_ptr, s_ptr, e, stride_we, stride_se, wrows, stride_w, stride_s, I, h_ptr,
            _pair_rows(lo_off, hi_off, BM, LXC), hi_off - lo_off, stride_h, BN, STAGES, SUB, NW, NG, LXC, LWC)
        for m0 in range(lo_off, hi_off, BM):
            if SPLIT_M and hi_off - m0 <= 8:
                aptr = _w2_tile(fold, wbuf, xbuf, wptr, aptr, sp, wrows, stride_s, nslots, h_ptr, stride_h, pair_ptr,
                                wts_ptr, y_ptr, stride_y, m0, hi_off, pid_n, BM, 8, BN, STAGES, SUB, LXC, LXL8, LW, LS,
                                MMA)
            elif SPLIT_M and BM == 32 and hi_off - m0 <= 16:
                aptr = _w2_tile(fold, wbuf, xbuf, wptr, aptr, sp, wrows, stride_s, nslots, h_ptr, stride_h, pair_ptr,
                                wts_ptr, y_ptr, stride_y, m0, hi_off, pid_n, BM, 16, BN, STAGES, SUB, LXC, LXL16, LW,
                                LS, MMA)
            else:
                aptr = _w2_tile(fold, wbuf, xbuf, wptr, aptr, sp, wrows, stride_s, nslots, h_ptr, stride_h, pair_ptr,
                                wts_ptr, y_ptr, stride_y, m0, hi_off, pid_n, BM, BM, BN, STAGES, SUB, LXC, LXL, LW, LS,
                                MMA)


def _lxl(block_m: int, nb: int):
    """LXL of `layouts` for block_m tokens and 2^nb warps."""
    tokens = [[8, 0]] * (block_m > 8) + [[16, 0]] * (block_m > 16)
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64]] + tokens,
                                      lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[0, 0]] * nb, block_bases=[], shape=[block_m, 128])


@functools.lru_cache(maxsize=None)
def layouts(block_n: int, num_warps: int, block_m: int = 16, sub: int = 1) -> dict:
    """The kernels' constexpr arguments for BN = block_n weight rows, `num_warps` (4 or 8) warps, block_m (8, 16, 32)
    tokens and `sub` (1, 2) 128-column steps per copy (g = lane // 4, t = lane % 4). MMA: the mma.sync
    accumulator [BN, BM], warps stacked along the weight rows: warp w, rows 16w + g and 16w + 8 + g (+ 16 num_warps
    j), tokens 2t, 2t + 1 (+ 8, 16, 24). LW: weight words [BN, 32] int16 with the same rows, 16 bytes of a row per
    thread (words 4t .. 4t+3). LS: a copy's scales [BN, 4 sub] (rows as LW, groups 4j + t). LWC / LXC: the cp.async
    copies of the weight words [BN, 32 sub] and of the activation tile [BM, 128 sub] (16 bytes per thread and
    copy). LXL: a step's activations read into registers: rows g (and g + 8, ..), positions 32i + 8t + e, every warp
    the same; LXL8 / LXL16: the same for 8 / 16 rows (the split paths of a 16- or 32-token tile). ValueError for
    other warps / tokens / sub, or block_n not a multiple of 16 num_warps."""
    if num_warps not in (4, 8) or block_m not in (8, 16, 32) or sub not in (1, 2):
        raise ValueError(f"kernels_gluon.layouts: num_warps={num_warps} must be 4 or 8, block_m={block_m} 8, 16 "
                         f"or 32 and sub={sub} 1 or 2")
    nb = num_warps.bit_length() - 1
    rows = 16 * num_warps
    if block_n % rows:
        raise ValueError(f"kernels_gluon.layouts: block_n={block_n} must be a multiple of 16 x num_warps = {rows}")
    reps = [[rows << j, 0] for j in range((block_n // rows).bit_length() - 1)]
    lw = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]] + reps,
                                    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                    warp_bases=[[16 << j, 0] for j in range(nb)], block_bases=[], shape=[block_n, 32])
    return dict(
        NW=num_warps,
        SUB=sub,
        LXC=gl.BlockedLayout([1, 8], [2, 16] if sub == 1 else [1, 32], [num_warps, 1], [1, 0]),
        LWC=lw if sub == 1 else gl.BlockedLayout([1, 8], [8 // sub, 4 * sub], [num_warps, 1], [1, 0]),
        LXL=_lxl(block_m, nb),
        LXL8=_lxl(8, nb),
        LXL16=_lxl(16, nb),
        LW=lw,
        LS=gl.DistributedLinearLayout(reg_bases=[[0, 4 << j] for j in range(sub.bit_length() - 1)] + [[8, 0]] + reps,
                                      lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16 << j, 0] for j in range(nb)], block_bases=[],
                                      shape=[block_n, 4 * sub]),
        MMA=gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8]))


def permute_columns(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Activations [T, C] (C % 128 == 0, any float dtype) -> bf16 [T, C] with each 128-column block stored in the
    kernels' operand order: position 32i + 8t + 4m + 2r + l holds column 32t + 16m + 8r + 4l + i (module
    docstring). One copy; `out` (bf16 [T, C], contiguous) receives it when given. ValueError for other widths."""
    T, C = x.shape
    if C % 128:
        raise ValueError(f"permute_columns: width {C} must be a multiple of 128")
    out = torch.empty(T, C, dtype=torch.bfloat16, device=x.device) if out is None else out
    out.view(T, C // 128, 4, 4, 2, 2, 2).copy_(x.view(T, C // 128, 4, 2, 2, 2, 4).permute(0, 1, 6, 2, 3, 4, 5))
    return out


def check_shapes(latent: int, inter: int) -> None:
    """The Gluon GEMMs load whole tiles without masks: ValueError unless latent (Rl) and inter (I) are multiples of
    BLOCK_K = BLOCK_N = 128 (K columns per copy, gate rows per program / 2, Rl rows per program)."""
    if latent % BLOCK_K or inter % BLOCK_K:
        raise ValueError(f"mxfp4_moe (Gluon kernels): latent width {latent} and expert width {inter} must be "
                         f"multiples of {BLOCK_K}; mxfp4_moe runs the legacy Triton kernels for these shapes")


def _token_tile(pairs_per_expert: int) -> int:
    """Tokens per tile for experts with `pairs_per_expert` (token, choice) pairs on average: 8 up to 8, 16 up to 12,
    else 32 (the fastest of the three at each, on an H200)."""
    return 8 if pairs_per_expert <= 8 else 16 if pairs_per_expert <= 12 else 32


def resolve_tiles(latent: int, inter: int, pairs_per_expert: int = 16) -> dict:
    """The Gluon GEMMs' tiles for latent width Rl and expert width I: block_k K columns per copy (256 where both
    widths allow, else 128), block_m tokens per tile (`_token_tile`), maxnreg the register cap per thread (128 with
    8/16-token tiles: 4 programs per SM without spills; 168 with 32-token tiles, which spill under 128: 3 per SM) and
    split_m (16- and 32-token tiles: a tile of <= 8 pairs runs the 8-token MMAs and activation reads, and with
    32-token tiles one of <= 16 pairs the 16-token ones). ValueError (`check_shapes`) for widths the kernels cannot
    take."""
    check_shapes(latent, inter)
    block_m = _token_tile(pairs_per_expert)
    return dict(block_k=256 if latent % 256 == 0 and inter % 256 == 0 else 128, block_m=block_m,
                maxnreg=128 if block_m <= 16 else 168, split_m=block_m >= 16)


def grouped_gemms(x, tok, order, wts, offs, w13_packed, w13_scale, w2_packed, w2_scale, h, ypair, xperm, *,
                  situ_beta: float, situ_linear_beta: float, pairs_per_expert: int) -> None:
    """The two grouped GEMMs of `kernels.mxfp4_moe` (same sort buffers tok / order / offs int32 and pair outputs):
    x [T, Rl] (bf16/fp32) is copied into xperm (bf16 [T, Rl], `permute_columns`), then h [pairs, I] bf16 (permuted
    columns) and ypair [pairs, Rl] fp32 = w_pair · h · W2ᵀ. Weights: MXFP4 as in `kernels.mxfp4_moe` (uint8,
    contiguous rows). Tiles: `resolve_tiles` for the mean (token, choice) pairs per expert `pairs_per_expert`
    (ValueError for widths the kernels cannot take)."""
    T, RL = x.shape
    E, I2, _ = w13_packed.shape
    I = I2 // 2
    t = resolve_tiles(RL, I, pairs_per_expert)
    bm, sub = t["block_m"], t["block_k"] // BLOCK_K
    opts = dict(num_warps=NUM_WARPS, maxnreg=t["maxnreg"], SPLIT_M=t["split_m"])
    permute_columns(x, out=xperm)
    w13 = w13_packed.view(torch.int16)
    w2 = w2_packed.view(torch.int16)
    lay = layouts(BLOCK_N, NUM_WARPS, bm, sub)
    moe_w13_kernel[(I // (BLOCK_N // 2), E)](
        xperm, tok, offs, w13, w13_scale, h,
        xperm.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), h.stride(0),
        I, RL, float(situ_beta), float(situ_linear_beta), BM=bm, BN=BLOCK_N, STAGES=STAGES, NG=RL // 32,
        **lay, **opts)
    moe_w2_kernel[(RL // BLOCK_N, E)](
        h, order, wts, offs, w2, w2_scale, ypair,
        h.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), ypair.stride(0),
        I, RL, BM=bm, BN=BLOCK_N, STAGES=STAGES, NG=I // 32, **lay, **opts)
