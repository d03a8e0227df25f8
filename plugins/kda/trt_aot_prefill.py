"""Ahead-of-time TensorRT form of ``kimi::KdaPrefill``: nine single-launch ``tensorrt.plugin`` ops (QDP, TensorRT
>= 10.9; table and glue in plugins/aot_ops.py) that ``build_engines.py --aot`` rewrites each KdaPrefill node into
(:func:`decompose_kda_prefill`), so prefill engines with KDA layers run without Python.

The chain is ``kda_prefill``'s GPU path (plugins/kda/kernels.py, fla-core's stages + our output kernel) with every
launch a graph node and every scratch buffer a tensor TensorRT allocates; always the varlen form (N is dynamic),
chunk indices built on the device with fla's fixed-shape convention (NT = cdiv(T, 64) + N - 1 rows, padding rows
(-1, 0))::

    KdaConvBeta(qkv, conv_w, b)                        -> y [3, T, P] y, beta [T, H] y, Akk [T, H, 64] y (zeros)
    KdaConvStart(qkv, conv_w, conv, slots, cu, y)      -> y (in place), conv_out (in place)
    KdaChunkPrep(state, slots, cu, b)                  -> state (pass-through), h0 [N, H, K, K] f32, ci [NT, 2] i32,
                                                          co [N+1] i32
    KdaGateCumsum(f, A_log, dt_bias, cu, ci)           -> gk [T, H, K] f32 (log2 gate cumsum within chunks)
    KdaIntraChunk(y, gk, beta, cu, ci)                 -> Aqk [T, H, 64] y (diagonal blocks), Akkd [T, H, 16] f32
    KdaInterSolve(y, gk, beta, Aqk, Akkd, Akk, cu, ci) -> Aqk, Akk (both in place; Akk = the WY inverse)
    KdaRecomputeWU(y, beta, Akk, gk, cu, ci)           -> w, u, kg [T, H, K] y
    KdaStatePass(kg, w, u, gk, h0, cu, co)             -> h [NT, H, K, K] y, vn [T, H, K] y, ht [N, H, K, K] f32
    KdaChunkOut(y, gk, h, vn, Aqk, g, o_norm_w, cu, ci, ht, slots, state)
                                                       -> out [T, P] act, state_out (in place)

``y`` = the chunk compute dtype (bf16 for fp32 activations, else the activations'). With one sequence (N = 1, an
int32 extra of every chunk op) the entries call the kernels' dense forms (no chunk-index loads; the JIT path's
choice for one sequence), with several their varlen forms: a runtime branch, both compiled in (the state pass: varlen
only, see its entry). Entry kernels: ours
(`_conv_main_tile` + `_beta_tile` on a flat grid; `_conv_start_kernel` then, after a CTA barrier, `_conv_hist_kernel`;
`_copy_rows_kernel` + the chunk-index builder; `_chunk_out_norm_kernel` + the final-state scatter) and fla-core's
stage kernels called as device functions (the raw ``triton.jit`` functions under fla's autotune/heuristics wrappers)
with the configs fla's autotuner chose on an H200 (T=32768, 12 and 96 heads): gate cumsum BS=64 /
4 warps, intra sub-chunk 1 warp, inter-solve BK=32 / 1 warp, WY recompute 4 warps, state pass 4 warps with
:func:`state_config` (BV=32 / 4 stages below 48 heads, BV=64 / 2 stages from 48). fla-core's internal kernels are only used for the versions plugins/kda/kernels.py tested
(``_FLA_STAGES_VERSIONS``); with another version (or without fla-core) :func:`register` registers nothing and
``build_engines.py --aot`` refuses (exit 2, naming KdaPrefill). fla reads machine properties at import (tf32 support, ``tl.gather``): compile on the deployment
GPU's machine, as TensorRT builds are.

``Akk`` must be zero above the diagonal (the solve writes the lower triangle only; fla zero-fills it with torch):
``KdaConvBeta`` writes it as zeros with H more program columns of full-width stores (cheaper than zeroing the
upper triangle inside the 1-warp solve programs).

Attributes compiled in: num_heads, head_dim (all ops), lower_bound (gate), norm_eps (output). Errors: ValueError from
:func:`decompose_kda_prefill` for a node missing an attribute.
"""
# no `from __future__ import annotations`: tensorrt.plugin reads the QDP functions' annotations as objects

import os

from k3deploy.plugins.aot_ops import KernelOp, make_aot_node, register_table, replace_nodes

BT, BC = 64, 16                         # fla's KDA chunk and sub-chunk sizes (kernels._CHUNK)
CONV_BT = 16                            # conv / beta / Akk-zeroing token tile (the JIT conv pass's, kernels._CONV_BT)
COPY_BLOCK = 4096                       # fp32 elements per state-row copy program
GATE_BS, SOLVE_BK = 64, 32


def state_config(num_heads: int) -> tuple[int, int]:
    """(BV, pipeline stages) of the inter-chunk state pass: what fla's autotuner picks on an H200, BV=32 / 4 stages
    below 48 heads (twice the programs of BV=64: 2*H per sequence is few) and BV=64 / 2 stages from 48."""
    return (32, 4) if num_heads < 48 else (64, 2)
OUT_BK = 64                             # kernels._OUT_CFG block_k

try:  # the entry kernels need Triton, our kernels and fla-core's stage kernels; the tables do not
    import triton
    import triton.language as tl

    from k3deploy.plugins.kda.kernels import (_FLA_STAGES_VERSIONS, _beta_tile, _chunk_out_norm_kernel, _conv_hist_kernel,
                                     _conv_main_tile, _conv_start_kernel, _copy_rows_kernel)

    import fla
    if getattr(fla, "__version__", None) not in _FLA_STAGES_VERSIONS:
        raise ImportError(f"fla-core {getattr(fla, '__version__', '?')} (tested: {_FLA_STAGES_VERSIONS})")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as _fla_h_tuned
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_kernel_inter_solve_fused as _fla_solve_tuned
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_kernel_intra_sub_chunk as _fla_intra_tuned
    from fla.ops.kda.gate import kda_gate_chunk_cumsum_vector_kernel as _fla_gate_tuned
    from fla.ops.kda.wy_fast import recompute_w_u_fwd_kda_kernel as _fla_wu_tuned
    from fla.ops.utils.constant import RCP_LN2
    from fla.utils import IS_GATHER_SUPPORTED

    def _raw(kernel):
        """The triton.jit function under fla's heuristics/autotune wrappers."""
        from triton.runtime.autotuner import Autotuner, Heuristics

        while isinstance(kernel, (Autotuner, Heuristics)):
            kernel = kernel.fn
        return kernel

    _fla_gate, _fla_intra, _fla_solve = _raw(_fla_gate_tuned), _raw(_fla_intra_tuned), _raw(_fla_solve_tuned)
    _fla_wu, _fla_h = _raw(_fla_wu_tuned), _raw(_fla_h_tuned)

    @triton.jit
    def _i64(x):
        """A scalar argument as int64 (offsets past 2^31 elements; a plain int under the interpreter)."""
        return tl.full((), 0, tl.int64) + x

    @triton.jit
    def _kda_conv_beta_aot(qkv_ptr, convw_ptr, b_ptr, T, y_ptr, beta_ptr, akk_ptr, H: tl.constexpr,
                           K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr):
        """grid (cdiv(T, BT) * (4H + 1),), the 4H + 1 column blocks of a token tile fastest (as the JIT conv pass's
        flat grid: programs in flight read whole rows): column blocks < 3H run `_conv_main_tile` (one head of K
        channels), block 3H beta = sigmoid(b) for the same tokens, blocks 3H+1+h zero Akk[tokens, h, :] (CH = 64
        columns)."""
        P: tl.constexpr = H * K
        NCOL: tl.constexpr = 4 * H + 1
        pt = tl.program_id(0) // NCOL
        col = tl.program_id(0) % NCOL
        if col < 3 * H:
            _conv_main_tile(qkv_ptr, convw_ptr, y_ptr, T, 3 * P, pt, col, D=3 * P, P=P, BT=BT, BD=K, PAIRS=True)
        elif col == 3 * H:
            _beta_tile(b_ptr, beta_ptr, T, H, pt, H=H, BT=BT, BH=BH)
        else:
            tt = pt * BT + tl.arange(0, BT)
            p = akk_ptr + (tt.to(tl.int64)[:, None] * H + (col - 3 * H - 1)) * CH + tl.arange(0, CH)[None, :]
            tl.store(p, tl.zeros([BT, CH], dtype=akk_ptr.dtype.element_ty), mask=(tt < T)[:, None])

    @triton.jit
    def _kda_conv_start_aot(qkv_ptr, convw_ptr, conv_ptr, slots_ptr, cu_ptr, y_ptr, T, y_out_ptr, conv_out_ptr,
                            H: tl.constexpr, K: tl.constexpr):
        """grid (N, 3H): sequence n's first three conv rows from its slot's history (`_conv_start_kernel`), then,
        after a CTA barrier (the history just read is overwritten next), its new history (`_conv_hist_kernel`);
        y and conv are written in place through their aliases."""
        P: tl.constexpr = H * K
        _conv_start_kernel(qkv_ptr, convw_ptr, conv_out_ptr, slots_ptr, cu_ptr, y_out_ptr, T, 3 * P, D=3 * P, P=P,
                           BD=K)
        tl.debug_barrier()
        _conv_hist_kernel(qkv_ptr, conv_out_ptr, slots_ptr, cu_ptr, 3 * P, D=3 * P, BD=K)

    @triton.jit
    def _chunk_index_body(cu_ptr, ci_ptr, co_ptr, T, N, BT: tl.constexpr, BR: tl.constexpr, BNS: tl.constexpr):
        """fla's static chunk indices from cu_seqlens [N+1] (one program): co[n] = sum_{j<n} cdiv(len_j, BT);
        ci[r] = (sequence, chunk within it) of chunk row r < NT = cdiv(T, BT) + N - 1, (-1, 0) past the last."""
        total = tl.full((), 0, tl.int32)
        tl.store(co_ptr, total)
        for s0 in range(0, N, BNS):
            idx = s0 + tl.arange(0, BNS)
            m = idx < N
            nt = tl.where(m, (tl.load(cu_ptr + idx + 1, mask=m, other=0) - tl.load(cu_ptr + idx, mask=m, other=0)
                              + BT - 1) // BT, 0)
            tl.store(co_ptr + 1 + idx, tl.cumsum(nt, axis=0) + total, mask=m)
            total += tl.sum(nt, axis=0)
        NT = (T + BT - 1) // BT + N - 1
        for r0 in range(0, NT, BR):
            r = r0 + tl.arange(0, BR)
            seq = tl.zeros([BR], dtype=tl.int32)
            before = tl.zeros([BR], dtype=tl.int32)
            base = tl.full((), 0, tl.int32)
            for s0 in range(0, N, BNS):
                idx = s0 + tl.arange(0, BNS)
                m = idx < N
                nt = tl.where(m, (tl.load(cu_ptr + idx + 1, mask=m, other=0)
                                  - tl.load(cu_ptr + idx, mask=m, other=0) + BT - 1) // BT, 0)
                done = m[None, :] & ((tl.cumsum(nt, axis=0) + base)[None, :] <= r[:, None])    # [BR, BNS]
                seq += tl.sum(done.to(tl.int32), axis=1)
                before += tl.sum(tl.where(done, nt[None, :], 0), axis=1)
                base += tl.sum(nt, axis=0)
            valid = r < total
            rm = r < NT
            tl.store(ci_ptr + 2 * r, tl.where(valid, seq, -1), mask=rm)
            tl.store(ci_ptr + 2 * r + 1, tl.where(valid, r - before, 0), mask=rm)

    @triton.jit
    def _kda_prep_aot(state_ptr, slots_ptr, cu_ptr, b_ptr, T, N, state_out_ptr, h0_ptr, ci_ptr, co_ptr,
                      H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr,
                      BNS: tl.constexpr):
        """grid (N + 1, cdiv(H*K*K, BLOCK)): programs n < N gather slot n's state into h0[n]; program (N, 0) builds
        the chunk indices (`_chunk_index_body`). The state passes through (state_out aliases it)."""
        if tl.program_id(0) < N:
            _copy_rows_kernel(state_ptr, h0_ptr, slots_ptr, H * K * K, BLOCK=BLOCK, GATHER=True)
        elif tl.program_id(1) == 0:
            _chunk_index_body(cu_ptr, ci_ptr, co_ptr, T, N, BT=BT, BR=BR, BNS=BNS)

    @triton.jit
    def _kda_gate_aot(f_ptr, alog_ptr, dtb_ptr, cu_ptr, ci_ptr, T, N, gk_ptr, H: tl.constexpr, K: tl.constexpr,
                      BT: tl.constexpr, BS: tl.constexpr, LOWER_BOUND: tl.constexpr, SCALE: tl.constexpr):
        """grid (cdiv(K, BS) * NT, H): fla's lower-bound gate + chunk-local cumsum (log2 units)."""
        if N == 1:
            _fla_gate(f_ptr, alog_ptr, dtb_ptr, gk_ptr, SCALE, cu_ptr, ci_ptr, LOWER_BOUND, T, H=H, S=K, BT=BT,
                      BS=BS, REVERSE=False, HAS_A=True, HAS_BIAS=True, HAS_SCALE=True, IS_VARLEN=False,
                      USE_LOWER_BOUND=True, USE_GRAPH=True)
        else:
            _fla_gate(f_ptr, alog_ptr, dtb_ptr, gk_ptr, SCALE, cu_ptr, ci_ptr, LOWER_BOUND, T, H=H, S=K, BT=BT,
                      BS=BS, REVERSE=False, HAS_A=True, HAS_BIAS=True, HAS_SCALE=True, IS_VARLEN=True,
                      USE_LOWER_BOUND=True, USE_GRAPH=True)

    @triton.jit
    def _kda_intra_aot(y_ptr, gk_ptr, beta_ptr, cu_ptr, ci_ptr, T, N, aqk_ptr, akkd_ptr, H: tl.constexpr,
                       K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr,
                       GATE_SHIFT: tl.constexpr, USE_GATHER: tl.constexpr):
        """grid (NT, BT/BC, H): fla's intra sub-chunk kernel (safe gate) on q = y[0], k = y[1]."""
        k_ptr = y_ptr + _i64(T) * (H * K)
        if N == 1:
            _fla_intra(y_ptr, k_ptr, gk_ptr, beta_ptr, aqk_ptr, akkd_ptr, SCALE, cu_ptr, ci_ptr, T, H=H, HV=H, K=K,
                       BT=BT, BC=BC, BK=BK, IS_VARLEN=False, GATE_SHIFT=GATE_SHIFT, USE_GATHER=USE_GATHER,
                       USE_GRAPH=True)
        else:
            _fla_intra(y_ptr, k_ptr, gk_ptr, beta_ptr, aqk_ptr, akkd_ptr, SCALE, cu_ptr, ci_ptr, T, H=H, HV=H, K=K,
                       BT=BT, BC=BC, BK=BK, IS_VARLEN=True, GATE_SHIFT=GATE_SHIFT, USE_GATHER=USE_GATHER,
                       USE_GRAPH=True)

    @triton.jit
    def _kda_solve_aot(y_ptr, gk_ptr, beta_ptr, aqk_ptr, akkd_ptr, akk_ptr, cu_ptr, ci_ptr, T, N, aqk_out_ptr,
                       akk_out_ptr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                       BK: tl.constexpr, SCALE: tl.constexpr):
        """grid (NT, H): fla's fused inter-sub-chunk + triangular solve (off-diagonal Aqk blocks, Akk = the WY
        inverse: its lower triangle; KdaConvBeta zeroed the rest), both in place."""
        akk_ptr = akk_out_ptr
        k_ptr = y_ptr + _i64(T) * (H * K)
        if N == 1:
            _fla_solve(y_ptr, k_ptr, gk_ptr, beta_ptr, aqk_out_ptr, akkd_ptr, akk_ptr, SCALE, cu_ptr, ci_ptr, T, H=H,
                       HV=H, K=K, BT=BT, BC=BC, NC=BT // BC, BK=BK, IS_VARLEN=False, USE_SAFE_GATE=True,
                       USE_GRAPH=True)
        else:
            _fla_solve(y_ptr, k_ptr, gk_ptr, beta_ptr, aqk_out_ptr, akkd_ptr, akk_ptr, SCALE, cu_ptr, ci_ptr, T, H=H,
                       HV=H, K=K, BT=BT, BC=BC, NC=BT // BC, BK=BK, IS_VARLEN=True, USE_SAFE_GATE=True,
                       USE_GRAPH=True)

    @triton.jit
    def _kda_wu_aot(y_ptr, beta_ptr, akk_ptr, gk_ptr, cu_ptr, ci_ptr, T, N, w_ptr, u_ptr, kg_ptr, H: tl.constexpr,
                    K: tl.constexpr, BT: tl.constexpr):
        """grid (NT, H): fla's WY recompute: w, u = Akk (beta k exp2(gk)), Akk (beta v); kg = k exp2(g_last - gk)."""
        k_ptr = y_ptr + _i64(T) * (H * K)
        v_ptr = k_ptr + _i64(T) * (H * K)
        if N == 1:
            _fla_wu(y_ptr, k_ptr, kg_ptr, kg_ptr, v_ptr, beta_ptr, w_ptr, u_ptr, akk_ptr, gk_ptr, cu_ptr, ci_ptr, T,
                    H=H, HV=H, K=K, V=K, BT=BT, BK=64, BV=64, STORE_QG=False, STORE_KG=True, IS_VARLEN=False,
                    USE_GRAPH=True)
        else:
            _fla_wu(y_ptr, k_ptr, kg_ptr, kg_ptr, v_ptr, beta_ptr, w_ptr, u_ptr, akk_ptr, gk_ptr, cu_ptr, ci_ptr, T,
                    H=H, HV=H, K=K, V=K, BT=BT, BK=64, BV=64, STORE_QG=False, STORE_KG=True, IS_VARLEN=True,
                    USE_GRAPH=True)

    @triton.jit
    def _kda_state_aot(kg_ptr, w_ptr, u_ptr, gk_ptr, h0_ptr, cu_ptr, co_ptr, T, N, h_ptr, vn_ptr, ht_ptr,
                       H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
        """grid (K/BV * N * H,): fla's inter-chunk state pass (states before each chunk, new values, final states;
        state_v_first layout [V, K]); varlen form only (N unused): it differs from the dense one by two offset loads
        per program, and with both compiled in, their pipelining buffers add up past the 227 KB of shared memory."""
        _fla_h(kg_ptr, u_ptr, w_ptr, vn_ptr, gk_ptr, gk_ptr, h_ptr, h0_ptr, ht_ptr, cu_ptr, co_ptr, T, H=H, HV=H,
               K=K, V=K, BT=BT, BV=BV, USE_G=False, USE_GK=True, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True,
               SAVE_NEW_VALUE=True, STATE_V_FIRST=True, IS_VARLEN=True)

    @triton.jit
    def _kda_out_aot(y_ptr, gk_ptr, h_ptr, vn_ptr, aqk_ptr, g_ptr, onw_ptr, cu_ptr, ci_ptr, ht_ptr, slots_ptr,
                     state_ptr, T, N, NT, out_ptr, state_out_ptr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, SCALE: tl.constexpr, NORM_EPS: tl.constexpr, BLOCK: tl.constexpr):
        """grid (NT + N, H): rows < NT: `_chunk_out_norm_kernel` (chunk output + gated RMSNorm); row NT + n copies
        the final state ht[n, h] into the pool row of slot n (in place through state_out)."""
        if tl.program_id(0) < NT:
            if N == 1:
                _chunk_out_norm_kernel(y_ptr, gk_ptr, h_ptr, vn_ptr, aqk_ptr, g_ptr, onw_ptr, out_ptr, cu_ptr, ci_ptr,
                                       T, H * K, H * K, SCALE, NORM_EPS, H=H, K=K, BT=BT, BK=BK, IS_VARLEN=False)
            else:
                _chunk_out_norm_kernel(y_ptr, gk_ptr, h_ptr, vn_ptr, aqk_ptr, g_ptr, onw_ptr, out_ptr, cu_ptr, ci_ptr,
                                       T, H * K, H * K, SCALE, NORM_EPS, H=H, K=K, BT=BT, BK=BK, IS_VARLEN=True)
        else:
            n = (tl.program_id(0) - NT).to(tl.int64)
            hh = tl.program_id(1)
            dst = state_out_ptr + (tl.load(slots_ptr + n).to(tl.int64) * H + hh) * (K * K)
            src = ht_ptr + (n * H + hh) * (K * K)
            for c0 in range(0, K * K, BLOCK):
                cc = c0 + tl.arange(0, BLOCK)
                tl.store(dst + cc, tl.load(src + cc))

    ENTRY = dict(conv=_kda_conv_beta_aot, start=_kda_conv_start_aot, prep=_kda_prep_aot, gate=_kda_gate_aot,
                 intra=_kda_intra_aot, solve=_kda_solve_aot, wu=_kda_wu_aot, state=_kda_state_aot, out=_kda_out_aot)
    # fla's gather helper does not run under the Triton interpreter (CPU tests): its fallback path there
    USE_GATHER = bool(IS_GATHER_SUPPORTED) and os.environ.get("TRITON_INTERPRET", "0") != "1"
except ImportError:  # pragma: no cover - Triton or the tested fla-core missing: register() returns []
    ENTRY = {}
    RCP_LN2, USE_GATHER = 1.4426950408889634, False


# ------------------------------------------------------------------------------------------------------ table
def _hk(a):
    return int(a["num_heads"]), int(a["head_dim"])


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


HK = (("num_heads", int), ("head_dim", int))
CU = (("cu", "i32"), ("ci", "i32"))
TN = (("T", "i32"), ("N", "i32"))


def _nt(T, N, cdiv):
    """Chunk rows of the fixed-shape varlen chunk index: cdiv(T, 64) + N - 1."""
    return cdiv(T, BT) + N - 1


def _ops() -> dict:
    e = ENTRY.get
    P = lambda a: _hk(a)[0] * _hk(a)[1]          # noqa: E731
    return {
        "conv": KernelOp(
            "kimi::KdaConvBeta", e("conv"), (("qkv", "act"), ("conv_w", "f32"), ("b", "act")), (("T", "i32"),),
            (("y", "y"), ("beta", "y"), ("akk", "y")), HK,
            shapes=lambda d, a, c: [(3, d["qkv"][0], P(a)), (d["qkv"][0], _hk(a)[0]), (d["qkv"][0], _hk(a)[0], BT)],
            launch=lambda d, a, c: ((c(d["qkv"][0], CONV_BT) * (4 * _hk(a)[0] + 1), 1, 1), [d["qkv"][0]]),
            constexprs=lambda d, a: dict(H=_hk(a)[0], K=_hk(a)[1], BT=CONV_BT, BH=_pow2(_hk(a)[0]), CH=BT)),
        "start": KernelOp(
            "kimi::KdaConvStart", e("start"),
            (("qkv", "act"), ("conv_w", "f32"), ("conv", "act"), ("slots", "i32"), ("cu", "i32"), ("y", "y")),
            (("T", "i32"),), (("y_out", "y"), ("conv_out", "act")), HK,
            shapes=lambda d, a, c: ["y", "conv"],
            launch=lambda d, a, c: ((d["slots"][0], 3 * _hk(a)[0], 1), [d["qkv"][0]]),
            constexprs=lambda d, a: dict(H=_hk(a)[0], K=_hk(a)[1])),
        "prep": KernelOp(
            "kimi::KdaChunkPrep", e("prep"), (("state", "f32"), ("slots", "i32"), ("cu", "i32"), ("b", "act")),
            (("T", "i32"), ("N", "i32")), (("state_out", "f32"), ("h0", "f32"), ("ci", "i32"), ("co", "i32")), HK,
            shapes=lambda d, a, c: ["state", (d["slots"][0], _hk(a)[0], _hk(a)[1], _hk(a)[1]),
                                    (_nt(d["b"][0], d["slots"][0], c), 2), (d["slots"][0] + 1,)],
            launch=lambda d, a, c: ((d["slots"][0] + 1, c(_hk(a)[0] * _hk(a)[1] ** 2, COPY_BLOCK), 1),
                                    [d["b"][0], d["slots"][0]]),
            constexprs=lambda d, a: dict(H=_hk(a)[0], K=_hk(a)[1], BT=BT, BLOCK=COPY_BLOCK, BR=128, BNS=64)),
        "gate": KernelOp(
            "kimi::KdaGateCumsum", e("gate"), (("f", "act"), ("A_log", "f32"), ("dt_bias", "f32")) + CU,
            TN, (("gk", "f32"),), HK + (("lower_bound", float),),
            shapes=lambda d, a, c: [(d["f"][0], _hk(a)[0], _hk(a)[1])],
            launch=lambda d, a, c: ((d["ci"][0] * -(-_hk(a)[1] // GATE_BS), _hk(a)[0], 1), [d["f"][0], d["cu"][0] - 1]),
            constexprs=lambda d, a: dict(H=_hk(a)[0], K=_hk(a)[1], BT=BT, BS=GATE_BS,
                                         LOWER_BOUND=float(a["lower_bound"]), SCALE=RCP_LN2),
            num_warps=4, num_stages=3),
        "intra": KernelOp(
            "kimi::KdaIntraChunk", e("intra"), (("y", "y"), ("gk", "f32"), ("beta", "y")) + CU, TN,
            (("aqk", "y"), ("akkd", "f32")), HK + (("lower_bound", float),),
            shapes=lambda d, a, c: [(d["y"][1], _hk(a)[0], BT), (d["y"][1], _hk(a)[0], BC)],
            launch=lambda d, a, c: ((d["ci"][0], BT // BC, _hk(a)[0]), [d["y"][1], d["cu"][0] - 1]),
            constexprs=lambda d, a: dict(H=_hk(a)[0], K=_hk(a)[1], BT=BT, BC=BC, BK=_pow2(_hk(a)[1]),
                                         SCALE=_hk(a)[1] ** -0.5, GATE_SHIFT=-float(a["lower_bound"]) * RCP_LN2,
                                         USE_GATHER=USE_GATHER),
            num_warps=1, num_stages=3),
        "solve": KernelOp(
            "kimi::KdaInterSolve", e("solve"),
            (("y", "y"), ("gk", "f32"), ("beta", "y"), ("aqk", "y"), ("akkd", "f32"), ("akk", "y")) + CU, TN,
            (("aqk_out", "y"), ("akk_out", "y")), HK,
            shapes=lambda d, a, c: ["aqk", "akk"],
            launch=lambda d, a, c: ((d["ci"][0], _hk(a)[0], 1), [d["y"][1], d["cu"][0] - 1]),
            constexprs=lambda d, a: dict(H=_hk(a)[0], K=_hk(a)[1], BT=BT, BC=BC, BK=SOLVE_BK,
                                         SCALE=_hk(a)[1] ** -0.5),
            num_warps=1, num_stages=3),
        "wu": KernelOp(
            "kimi::KdaRecomputeWU", e("wu"), (("y", "y"), ("beta", "y"), ("akk", "y"), ("gk", "f32")) + CU,
            TN, (("w", "y"), ("u", "y"), ("kg", "y")), HK,
            shapes=lambda d, a, c: [(d["y"][1], _hk(a)[0], _hk(a)[1])] * 3,
            launch=lambda d, a, c: ((d["ci"][0], _hk(a)[0], 1), [d["y"][1], d["cu"][0] - 1]),
            constexprs=lambda d, a: dict(H=_hk(a)[0], K=_hk(a)[1], BT=BT),
            num_warps=4, num_stages=3),
        "state": KernelOp(
            "kimi::KdaStatePass", e("state"),
            (("kg", "y"), ("w", "y"), ("u", "y"), ("gk", "f32"), ("h0", "f32"), ("cu", "i32"), ("co", "i32")),
            TN, (("h", "y"), ("vn", "y"), ("ht", "f32")), HK,
            shapes=lambda d, a, c: [(_nt(d["kg"][0], d["co"][0] - 1, c), _hk(a)[0], _hk(a)[1], _hk(a)[1]),
                                    (d["kg"][0], _hk(a)[0], _hk(a)[1]),
                                    (d["co"][0] - 1, _hk(a)[0], _hk(a)[1], _hk(a)[1])],
            launch=lambda d, a, c: (((d["co"][0] - 1) * (_hk(a)[0] * -(-_hk(a)[1] // state_config(_hk(a)[0])[0])),
                                     1, 1), [d["kg"][0], d["co"][0] - 1]),
            constexprs=lambda d, a: dict(H=_hk(a)[0], K=_hk(a)[1], BT=BT, BV=state_config(_hk(a)[0])[0]),
            num_warps=4, num_stages=lambda a: state_config(_hk(a)[0])[1]),
        "out": KernelOp(
            "kimi::KdaChunkOut", e("out"),
            (("y", "y"), ("gk", "f32"), ("h", "y"), ("vn", "y"), ("aqk", "y"), ("g", "act"), ("o_norm_w", "f32"))
            + CU + (("ht", "f32"), ("slots", "i32"), ("state", "f32")),
            TN + (("NT", "i32"),), (("out", "act"), ("state_out", "f32")), HK + (("norm_eps", float),),
            shapes=lambda d, a, c: [(d["g"][0], P(a)), "state"],
            launch=lambda d, a, c: ((d["ci"][0] + d["slots"][0], _hk(a)[0], 1),
                                    [d["g"][0], d["slots"][0], d["ci"][0]]),
            constexprs=lambda d, a: dict(H=_hk(a)[0], K=_hk(a)[1], BT=BT, BK=min(OUT_BK, _hk(a)[1]),
                                         SCALE=_hk(a)[1] ** -0.5, NORM_EPS=float(a["norm_eps"]),
                                         BLOCK=min(COPY_BLOCK, _hk(a)[1] ** 2)),
            num_warps=4, num_stages=2),
    }


OPS = _ops()              # the nine ops in launch order: key -> KernelOp
AOT_OPS = tuple(op.op_id for op in OPS.values())   # their plugin ids ("kimi::...")


# --------------------------------------------------------------------------------------------- the ONNX rewrite
def _expand(node, attrs) -> list:
    for a in ("num_heads", "head_dim"):
        if a not in attrs:
            raise ValueError(f"KdaPrefill node {node.name!r}: attribute {a!r} missing (export with plugins/kda/onnx.py)")
    attrs = {"lower_bound": -5.0, "norm_eps": 1e-5, **attrs}
    qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu, slots = node.input
    out, state_out, conv_out = node.output
    base = out          # tensor names are unique in a valid graph, node names need not be
    t = {k: f"{base}__kda_{k}" for k in ("y0", "beta", "akk0", "y", "state1", "h0", "ci", "co", "gk", "aqk0", "akkd",
                                          "aqk", "akk", "w", "u", "kg", "h", "vn", "ht")}

    def mk(key, ins, outs):
        return make_aot_node(OPS[key], ins, outs, f"{base}__{key}", attrs)

    return [
        mk("conv", [qkv, conv_w, b], [t["y0"], t["beta"], t["akk0"]]),
        mk("start", [qkv, conv_w, conv, slots, cu, t["y0"]], [t["y"], conv_out]),
        mk("prep", [state, slots, cu, b], [t["state1"], t["h0"], t["ci"], t["co"]]),
        mk("gate", [f, A_log, dt_bias, cu, t["ci"]], [t["gk"]]),
        mk("intra", [t["y"], t["gk"], t["beta"], cu, t["ci"]], [t["aqk0"], t["akkd"]]),
        mk("solve", [t["y"], t["gk"], t["beta"], t["aqk0"], t["akkd"], t["akk0"], cu, t["ci"]],
           [t["aqk"], t["akk"]]),
        mk("wu", [t["y"], t["beta"], t["akk"], t["gk"], cu, t["ci"]], [t["w"], t["u"], t["kg"]]),
        mk("state", [t["kg"], t["w"], t["u"], t["gk"], t["h0"], cu, t["co"]], [t["h"], t["vn"], t["ht"]]),
        mk("out", [t["y"], t["gk"], t["h"], t["vn"], t["aqk"], g, o_norm_w, cu, t["ci"], t["ht"], slots, t["state1"]],
           [out, state_out]),
    ]


def decompose_kda_prefill(model) -> int:
    """Replace every top-level ``kimi::KdaPrefill`` node of ``model`` (onnx.ModelProto, in place) by the nine AOT
    ops of the module docstring (marked ``aot=1``). Returns how many nodes were replaced; ValueError for a node
    without num_heads/head_dim."""
    return replace_nodes(model, "KdaPrefill", _expand)


# ----------------------------------------------------------------------------------------------- registration
_DONE: list[str] = []


def register() -> list[str]:
    """Register the nine QDP ops with ``tensorrt.plugin`` (idempotent). Returns :data:`AOT_OPS`, or ``[]`` where
    ``tensorrt.plugin`` has no ``aot_impl`` or an entry kernel is missing (no Triton, or no tested fla-core)."""
    return register_table(_DONE, OPS)
