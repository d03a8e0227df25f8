"""Triton kernels of a decoder layer's glue (GPU; CPU tensors under TRITON_INTERPRET=1): everything between the
projections (cuBLAS) and the five custom ops, one launch each (`greedy_pick`: two). fp32 definitions:
plugins/glue/reference.py.

* `attn_res_norm`: pending residual add + optional bank commit + Block AttnRes (scores over the bank and the
  block sum, softmax, mix) + the RMSNorm after it (MODEL.md §6.2-§6.3, §2.1);
* `lora_norms`: MLA's q_a / kv_a RMSNorms and the latent cache row [c_kv ‖ k_pe] from one GEMM output (§5.2);
* `mla_absorb`: q_nope·W_UK ‖ q_pe for the decode (the MLA prefill's absorb kernel, plugins/mla/kernels.py);
* `mla_out`: W_UV up-projection of the absorbed decode's latent output with the sigmoid gate (§5.3);
* `moe_out_rows`: RMSNorm of the combined routed latent and the shared experts' SiTU into one buffer (§7.2, §2.2);
* `greedy_pick`: after the head, each row's argmax and whether its logits are all finite, in one read of them.

Activations are in the model dtype `adt` (bf16 or fp32, the output tensor's dtype); math is fp32 and rounds to
`adt` where the model's tensors are `adt`: the block sum P, the AttnRes output, a norm's normalized value before
its weight multiply and its result (§2.1: w ⊙ cast(x·rsqrt(mean x² + eps))), the SiTU output. With fp32 activations
no rounding happens and the kernels match the fp32 reference to summation order.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _warps(n: int) -> int:
    return 8 if n >= 2048 else 4


@triton.jit
def _p_new(prow, arow, cc, cm, dst, P_IN: tl.constexpr, ADD: tl.constexpr):
    """P' = P + add of one column tile, rounded to the activation dtype (dst's element type), as fp32 [BD]."""
    adt = dst.dtype.element_ty
    pn = tl.zeros(cc.shape, tl.float32)
    if P_IN:
        pn += tl.load(prow + cc, mask=cm, other=0.0).to(tl.float32)
    if ADD:
        pn += tl.load(arow + cc, mask=cm, other=0.0).to(tl.float32)
    return pn.to(adt).to(tl.float32)


@triton.jit
def _attn_res_norm_kernel(p_ptr, add_ptr, bank_ptr, q_ptr, w_ptr, out_ptr, rows_ptr,
                          stride_p, stride_add, stride_bt, stride_br, stride_out, D, eps,
                          NB: tl.constexpr, RB: tl.constexpr, P_IN: tl.constexpr, ADD: tl.constexpr,
                          P_OUT: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr):
    """One program per output row, the whole row (BD >= D columns) in registers, one read of every source: the
    block sum P' = P + add (P_IN / ADD; stored to P with P_OUT 1, to bank row NB with P_OUT 2) starts an online
    softmax over the sources (running max, denominator and unnormalized mix), then bank rows 0..NB-1 join it RB
    rows at a time; the mix is rounded, normalized and multiplied by w."""
    i = tl.program_id(0)
    t = tl.load(rows_ptr + i).to(tl.int64) if ROWS else i.to(tl.int64)
    adt = out_ptr.dtype.element_ty
    prow = p_ptr + t * stride_p
    orow = out_ptr + i.to(tl.int64) * stride_out
    cc = tl.arange(0, BD)
    cm = cc < D
    qv = tl.load(q_ptr + cc, mask=cm, other=0.0).to(tl.float32)
    pn = _p_new(prow, add_ptr + t * stride_add, cc, cm, orow, P_IN, ADD)
    if P_OUT == 1:
        tl.store(prow + cc, pn.to(adt), mask=cm)
    if P_OUT == 2:
        tl.store(bank_ptr + t * stride_bt + NB * stride_br + cc, pn.to(adt), mask=cm)
    m = tl.sum(pn * qv, 0) * tl.rsqrt(tl.sum(pn * pn, 0) / D + eps)      # P's score; its weight exp(0) = 1
    z = 1.0
    mix = pn
    for r0 in tl.static_range(0, NB, RB):
        r = r0 + tl.arange(0, RB)
        rm = r < NB
        v = tl.load(bank_ptr + t * stride_bt + r[:, None].to(tl.int64) * stride_br + cc[None, :],
                    mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        s = tl.where(rm, tl.sum(v * qv[None, :], 1) * tl.rsqrt(tl.sum(v * v, 1) / D + eps), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(s - m_new)
        z = z * alpha + tl.sum(e, 0)
        mix = mix * alpha + tl.sum(v * e[:, None], 0)
        m = m_new
    h = (mix / z).to(adt).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / D + eps)
    w = tl.load(w_ptr + cc, mask=cm, other=0.0).to(tl.float32)
    tl.store(orow + cc, ((h * rstd).to(adt).to(tl.float32) * w).to(adt), mask=cm)


def attn_res_norm(P: torch.Tensor, add: torch.Tensor | None, bank: torch.Tensor, num_rows: int,
                  query: torch.Tensor, norm_w: torch.Tensor, eps: float, *, restart: bool = False,
                  store: str | None = "P", rows: torch.Tensor | None = None, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Residual add + AttnRes read + RMSNorm of one decoder-layer step (MODEL.md §6.3; definition:
    `reference.attn_res_norm`), one launch.

    P [T, d] the block sum in the activation dtype (`restart`: ignored, the block restarts from `add`, as after a
    commit); add [T, d] the pending residual or None; bank [T, >= num_rows (+1 with store "bank"), d] committed rows
    (rows 0..num_rows-1 are sources); query [d] fp32 (`reference.attn_res_query`); norm_w [d]; rows [M] int token
    rows to read (None: all T). store: "P" writes P' = P + add into P, "bank" into bank row num_rows (a commit), None
    nothing (rows only with None). Every row of P, add, bank needs unit stride in its last dim. Returns out [M, d]
    (allocated in P's dtype when None). ValueError for a bad store / rows combination."""
    if store not in ("P", "bank", None):
        raise ValueError(f"attn_res_norm: store={store!r} must be 'P', 'bank' or None")
    if rows is not None and store is not None:
        raise ValueError("attn_res_norm: rows select outputs of a read whose P' is not stored; pass store=None")
    if restart and add is None:
        raise ValueError("attn_res_norm: restart needs the residual `add` (the block restarts from it)")
    T, D = P.shape
    M = T if rows is None else rows.shape[0]
    if out is None:
        out = torch.empty(M, D, dtype=P.dtype, device=P.device)
    if M == 0:
        return out
    a = add if add is not None else P
    RB, BD, warps = attn_res_tiles(D, int(num_rows))
    _attn_res_norm_kernel[(M,)](
        P, a, bank, query, norm_w, out, rows if rows is not None else P,
        P.stride(0), a.stride(0), bank.stride(0), bank.stride(1), out.stride(0), D, float(eps),
        NB=int(num_rows), RB=RB, P_IN=not restart,
        ADD=add is not None, P_OUT={"P": 1, "bank": 2, None: 0}[store], ROWS=rows is not None, BD=BD,
        num_warps=warps)
    return out


def attn_res_tiles(D: int, num_rows: int) -> tuple[int, int, int]:
    """(RB bank rows per load, BD columns = the row padded to a power of 2, warps) of `_attn_res_norm_kernel` for
    width D and num_rows bank sources: at K3's width (7168: BD 8192, 16 warps) up to 4 bank rows load at once and
    deeper banks 2 at a time, which keeps every value in registers (no spills, offline Triton 3.6 for sm_90)."""
    return (4 if num_rows <= 4 else 2), triton.next_power_of_2(D), 16 if D >= 2048 else 4


@triton.jit
def _rms_row(x, w, cm, n, eps, dst):
    """RMSNorm of one row tile x [B] fp32 (n valid entries) with weight w, rounded as the model does (§2.1) to dst's
    element type."""
    adt = dst.dtype.element_ty
    x = tl.where(cm, x, 0.0)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    return ((x * rstd).to(adt).to(tl.float32) * w).to(adt)


@triton.jit
def _lora_norms_kernel(y_ptr, qw_ptr, kvw_ptr, cq_ptr, lat_ptr, stride_y, stride_cq, stride_lat, eps,
                       QR: tl.constexpr, KR: tl.constexpr, DR: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                       BR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    adt = cq_ptr.dtype.element_ty
    row = y_ptr + t * stride_y
    cq = tl.arange(0, BQ)
    qm = cq < QR
    x = tl.load(row + cq, mask=qm, other=0.0).to(adt).to(tl.float32)
    w = tl.load(qw_ptr + cq, mask=qm, other=0.0).to(tl.float32)
    tl.store(cq_ptr + t * stride_cq + cq, _rms_row(x, w, qm, QR, eps, cq_ptr), mask=qm)
    ck = tl.arange(0, BK)
    km = ck < KR
    x = tl.load(row + QR + ck, mask=km, other=0.0).to(adt).to(tl.float32)
    w = tl.load(kvw_ptr + ck, mask=km, other=0.0).to(tl.float32)
    tl.store(lat_ptr + t * stride_lat + ck, _rms_row(x, w, km, KR, eps, lat_ptr), mask=km)
    cr = tl.arange(0, BR)
    rm = cr < DR
    pe = tl.load(row + QR + KR + cr, mask=rm, other=0.0)
    tl.store(lat_ptr + t * stride_lat + KR + cr, pe.to(adt), mask=rm)


def lora_norms(y: torch.Tensor, q_norm_w: torch.Tensor, kv_norm_w: torch.Tensor, eps: float, q_rank: int,
               kv_rank: int, rope_dim: int, *, out_dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's LoRA norms from one GEMM output (MODEL.md §5.2; definition: `reference.lora_norms`), one launch.
    y [T, >= q_rank + kv_rank + rope_dim] (unit last stride) = q_a_proj(x) ‖ kv_a_proj_with_mqa(x) ‖ ...;
    returns (cq [T, q_rank], latent [T, kv_rank + rope_dim]) contiguous in `out_dtype` (default y's dtype)."""
    T = y.shape[0]
    dt = out_dtype or y.dtype
    cq = torch.empty(T, q_rank, dtype=dt, device=y.device)
    lat = torch.empty(T, kv_rank + rope_dim, dtype=dt, device=y.device)
    if T:
        BQ = triton.next_power_of_2(q_rank)
        _lora_norms_kernel[(T,)](y, q_norm_w, kv_norm_w, cq, lat, y.stride(0), cq.stride(0), lat.stride(0), float(eps),
                                 QR=q_rank, KR=kv_rank, DR=rope_dim, BQ=BQ, BK=triton.next_power_of_2(kv_rank),
                                 BR=max(2, triton.next_power_of_2(rope_dim)), num_warps=_warps(BQ))
    return cq, lat


@triton.jit
def _mla_out_kernel(ol_ptr, w_ptr, g_ptr, out_ptr, T, H, stride_w, stride_g, stride_out,
                    DN: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    BD: tl.constexpr, CDT: tl.constexpr):
    """grid (cdiv(T, BT), H, cdiv(DV, BD)): out[t, h*DV + d] = (sum_r ol[t, h, r] W_UV_h[d, r]) * sigmoid(g[t, h*DV
    + d]), W_UV_h = kv_b rows h*(DN+DV)+DN ..; fp32 accumulation, operands in CDT."""
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
        acc += tl.dot(ol.to(CDT), w.to(CDT))
    cols = h * DV + dd
    g = tl.load(g_ptr + tt[:, None].to(tl.int64) * stride_g + cols[None, :], mask=tm[:, None] & dm[None, :],
                other=0.0).to(tl.float32)
    tl.store(out_ptr + tt[:, None].to(tl.int64) * stride_out + cols[None, :],
             (acc / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty), mask=tm[:, None] & dm[None, :])


def mla_out(o_latent: torch.Tensor, kv_b: torch.Tensor, g: torch.Tensor, qk_nope_head_dim: int, *,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W_UV up-projection and sigmoid gate of the absorbed MLA decode (MODEL.md §5.3; definition:
    `reference.mla_out`), one launch. o_latent [T, H, R] contiguous, kv_b [H*(Dn+Dv), R] (unit last stride; fp32
    under the Triton interpreter, whose 16-bit tl.dot is wrong), g [T, H*Dv] (unit last stride). Returns [T, H*Dv]
    in `out_dtype` (default g's dtype)."""
    T, H, R = o_latent.shape
    Dv = kv_b.shape[0] // H - qk_nope_head_dim
    out = torch.empty(T, H * Dv, dtype=out_dtype or g.dtype, device=g.device)
    if T:
        BT = 16 if T <= 16 else 32 if T <= 32 else 64
        BD = min(64, max(16, triton.next_power_of_2(Dv)))
        cdt = tl.float32 if (_INTERPRET or kv_b.dtype == torch.float32) else tl.bfloat16
        _mla_out_kernel[(triton.cdiv(T, BT), H, triton.cdiv(Dv, BD))](
            o_latent.contiguous(), kv_b, g, out, T, H, kv_b.stride(0), g.stride(0), out.stride(0),
            DN=qk_nope_head_dim, DV=Dv, R=R, BT=BT, BK=min(R, 64), BD=BD, CDT=cdt, num_warps=4)
    return out


def mla_absorb(q: torch.Tensor, kv_b: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int
               ) -> torch.Tensor:
    """q_abs [T, H, R+Dr] = q_nope·W_UK ‖ q_pe (MODEL.md §5.3) in q's dtype: the MLA prefill's absorb kernel
    (plugins/mla/kernels.py `_mla_absorb_q_kernel`) on the decode's queries, one launch. q [T, H, Dn+Dr] with unit
    last stride, kv_b [H*(Dn+Dv), R] (fp32 under the Triton interpreter, whose 16-bit tl.dot is wrong)."""
    from k3deploy.plugins.mla.kernels import _mla_absorb_q_kernel
    T, H, DQ = q.shape
    Dn, R = qk_nope_head_dim, kv_lora_rank
    qa = torch.empty(T, H, R + DQ - Dn, dtype=q.dtype, device=q.device)
    if T:
        gpu = q.is_cuda and not _INTERPRET
        BT = 16 if T <= 16 else 64 if gpu else 16
        BR = min(R, 128 if gpu else 64)
        _mla_absorb_q_kernel[(triton.cdiv(T, BT), H, R // BR)](
            q, kv_b, qa, T, H, q.stride(0), q.stride(1), kv_b.stride(0), DN=Dn, BDN=max(16, triton.next_power_of_2(Dn)),
            DV=v_head_dim, R=R, DR=DQ - Dn, BT=BT, BR=BR, num_warps=8 if gpu else 4)
    return qa


@triton.jit
def _situ_row(grow, orow, gate_off, up_off, beta, lbeta, I: tl.constexpr, LB: tl.constexpr, BI: tl.constexpr):
    """orow[:I] = SiTU(grow[gate_off:][:I], grow[up_off:][:I]) (§2.2; tanh(x) = 2 sigmoid(2x) - 1), fp32 math."""
    adt = orow.dtype.element_ty
    for c0 in range(0, I, BI):
        cc = c0 + tl.arange(0, BI)
        cm = cc < I
        g = tl.load(grow + gate_off + cc, mask=cm, other=0.0).to(tl.float32)
        u = tl.load(grow + up_off + cc, mask=cm, other=0.0).to(tl.float32)
        a = beta * (2.0 / (1.0 + tl.exp(-2.0 * g / beta)) - 1.0) / (1.0 + tl.exp(-g))
        if LB:
            u = lbeta * (2.0 / (1.0 + tl.exp(-2.0 * u / lbeta)) - 1.0)
        tl.store(orow + cc, (a * u).to(adt), mask=cm)


@triton.jit
def _moe_out_rows_kernel(yl_ptr, nw_ptr, gu_ptr, out_ptr, stride_yl, stride_gu, gate_off, up_off, stride_out, eps,
                         beta, lbeta, RL: tl.constexpr, I: tl.constexpr, HAS_YL: tl.constexpr, NORM: tl.constexpr,
                         LB: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    """grid (T, roles): with HAS_YL, role 0 writes out[t, :RL] = RMSNorm(cast(yl[t])) (NORM; else the cast row)
    and role 1 (if launched) out[t, RL:RL+I] = SiTU(gate, up); without, role 0 writes the SiTU at column 0."""
    t = tl.program_id(0).to(tl.int64)
    role = tl.program_id(1)
    adt = out_ptr.dtype.element_ty
    orow = out_ptr + t * stride_out
    grow = gu_ptr + t * stride_gu
    if HAS_YL:
        if role == 0:
            cr = tl.arange(0, BR)
            rm = cr < RL
            x = tl.load(yl_ptr + t * stride_yl + cr, mask=rm, other=0.0).to(adt)
            if NORM:
                w = tl.load(nw_ptr + cr, mask=rm, other=0.0).to(tl.float32)
                x = _rms_row(x.to(tl.float32), w, rm, RL, eps, out_ptr)
            tl.store(orow + cr, x, mask=rm)
        else:
            _situ_row(grow, orow + RL, gate_off, up_off, beta, lbeta, I, LB, BI)
    else:
        _situ_row(grow, orow, gate_off, up_off, beta, lbeta, I, LB, BI)


def moe_out_rows(yl: torch.Tensor | None, norm_w: torch.Tensor | None, gu: torch.Tensor | None, inter: int,
                 eps: float, beta: float, linear_beta: float | None, *, gate_col: int = 0, up_col: int | None = None,
                 out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The rows the latent MoE's (or dense MLP's) output GEMM reads, one launch (MODEL.md §7.2, §2.2; definition:
    `reference.moe_out_rows`): out[:, :Rl] = RMSNorm(yl) cast to the activation dtype first (the combine's bf16
    result; norm_w None: no norm), out[:, Rl:Rl+inter] = SiTU(gate, up) with gate = gu[:, gate_col:gate_col+inter],
    up = gu[:, up_col:up_col+inter] (default up_col = gate_col + inter). yl [T, Rl] (any float dtype) or None;
    gu [T, >= ...] or None (inter then 0). Rows need unit last strides. Returns out [T, Rl + inter] (allocated in
    `out_dtype`, default gu's / yl's dtype, when None). ValueError when both yl and gu are None."""
    if yl is None and gu is None:
        raise ValueError("moe_out_rows: nothing to compute (yl and gu are both None)")
    src = yl if yl is not None else gu
    T = src.shape[0]
    RL = yl.shape[1] if yl is not None else 0
    inter = inter if gu is not None else 0
    if out is None:
        out = torch.empty(T, RL + inter, dtype=out_dtype or (gu if gu is not None else yl).dtype, device=src.device)
    roles = (yl is not None) + (gu is not None)
    if T:
        up_col = gate_col + inter if up_col is None else up_col
        _moe_out_rows_kernel[(T, roles)](
            yl if yl is not None else out, norm_w if norm_w is not None else out, gu if gu is not None else out, out,
            yl.stride(0) if yl is not None else 0, gu.stride(0) if gu is not None else 0, gate_col, up_col,
            out.stride(0), float(eps), float(beta), float(linear_beta or 1.0), RL=RL, I=inter,
            HAS_YL=yl is not None, NORM=norm_w is not None, LB=linear_beta is not None,
            BR=max(2, triton.next_power_of_2(RL)), BI=min(2048, max(2, triton.next_power_of_2(inter))),
            num_warps=_warps(max(RL, min(inter, 2048))))
    return out


# ------------------------------------------------------------------------------------------------ greedy pick
GREEDY_BLOCK = 2048        # logits per load of `_greedy_part_kernel`
GREEDY_PROGRAMS = 512      # (row, part) programs to aim for: about 4 per SM of an H100 / H200


@triton.jit
def _greedy_part_kernel(x_ptr, val_ptr, idx_ptr, bad_ptr, V, stride_x, PART, NPART, BV: tl.constexpr):
    """Program (row b, part p): the largest logit of columns [p PART, (p + 1) PART) and its lowest column (0 with no
    value above -inf), and whether the part holds a NaN or an infinity."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    best = tl.full([BV], float("-inf"), tl.float32)
    at = tl.zeros([BV], tl.int32)
    bad = tl.zeros([BV], tl.int1)
    lo = p * PART
    for c0 in range(lo, tl.minimum(lo + PART, V), BV):
        c = c0 + tl.arange(0, BV)
        x = tl.load(x_ptr + b * stride_x + c, mask=c < V, other=float("-inf")).to(tl.float32)
        bad |= ((x != x) | (tl.abs(x) == float("inf"))) & (c < V)
        up = x > best                       # strict: a lane keeps its first column of a tie
        best = tl.where(up, x, best)
        at = tl.where(up, c, at)
    mx = tl.max(best, 0)
    i = tl.min(tl.where(best == mx, at, 2147483647), 0)
    o = b * NPART + p
    tl.store(val_ptr + o, mx)
    tl.store(idx_ptr + o, tl.where(mx > float("-inf"), i, 0))
    tl.store(bad_ptr + o, tl.max(bad.to(tl.int32), 0))


@triton.jit
def _greedy_merge_kernel(val_ptr, idx_ptr, bad_ptr, ids_ptr, checked_ptr, NPART, BP: tl.constexpr):
    """Row b: the parts' largest logit at its lowest column -> ids[b]; checked[b] = ids[b], or -1 when a part holds
    a NaN or an infinity."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BP)
    pm = p < NPART
    v = tl.load(val_ptr + b * NPART + p, mask=pm, other=float("-inf"))
    i = tl.load(idx_ptr + b * NPART + p, mask=pm, other=0)
    bad = tl.load(bad_ptr + b * NPART + p, mask=pm, other=0)
    mx = tl.max(v, 0)
    best = tl.min(tl.where(pm & (v == mx), i, 2147483647), 0)
    best = tl.where(mx > float("-inf"), best, 0).to(tl.int64)
    tl.store(ids_ptr + b, best)
    tl.store(checked_ptr + b, tl.where(tl.max(bad, 0) > 0, -1, best))


def greedy_pick(logits: torch.Tensor, ids: torch.Tensor, checked: torch.Tensor) -> None:
    """The greedy token of each row in one read of the logits: ids[b] = argmax of logits[b] (lowest column on ties,
    as torch.argmax; 0 for a row of -inf), checked[b] = ids[b], or -1 when the row holds a NaN or an infinity (the
    rows `sampling.usable` would not pass as finite). Two launches, no host reads (CUDA-graph safe).

    Args:
        logits: [B, V] fp32 / bf16, unit stride in the last dim, V < 2^31.
        ids, checked: [B] int64 outputs (ids may be the next step's input tokens).
    """
    B, V = logits.shape
    if B == 0:
        return
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    npart = max(1, min(triton.cdiv(GREEDY_PROGRAMS, B), triton.cdiv(V, GREEDY_BLOCK)))
    part = triton.cdiv(triton.cdiv(V, npart), GREEDY_BLOCK) * GREEDY_BLOCK
    npart = triton.cdiv(V, part)
    val = torch.empty(B * npart, dtype=torch.float32, device=logits.device)
    idx = torch.empty(B * npart, dtype=torch.int32, device=logits.device)
    bad = torch.empty(B * npart, dtype=torch.int32, device=logits.device)
    _greedy_part_kernel[(B, npart)](logits, val, idx, bad, V, logits.stride(0), part, npart, BV=GREEDY_BLOCK,
                                    num_warps=8)
    _greedy_merge_kernel[(B,)](val, idx, bad, ids, checked, npart, BP=max(2, triton.next_power_of_2(npart)),
                               num_warps=1)
