"""Triton kernels vs the fp32 references. CPU: TRITON_INTERPRET=1 with tiny shapes (CI). GPU: production head
counts (12, 24, 48, 96 heads per rank), bf16 activations, poisoned pools, poisoned memory around every tensor
(`Guarded`), non-contiguous slots/blocks."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the first triton import

from k3deploy.plugins.kda import kernels as kda_k          # noqa: E402
from k3deploy.plugins.kda import reference as kda_ref      # noqa: E402
from k3deploy.plugins.mla import kernels as mla_k          # noqa: E402
from k3deploy.plugins.moe import kernels as moe_k          # noqa: E402
from k3deploy.plugins.mla import reference as mla_ref      # noqa: E402
from k3deploy.plugins.moe import reference as moe_ref_mod  # noqa: E402
from kernel_checks import Guarded, nan_equal, relerr    # noqa: E402  (tests/kernel_checks.py)

DEV = "cuda" if HAS_CUDA else "cpu"


def test_guarded_catches_a_write_past_the_end():
    G = Guarded()
    t = G(torch.zeros(4, dtype=torch.int32))
    G.check()
    G.bufs[0][G.PAD + t.numel()] = 7           # one element past the tensor
    with pytest.raises(AssertionError, match="outside its tensor"):
        G.check()


# ------------------------------------------------------------------------------------------------- KDA
def _kda_inputs(T, H, K, S, act, seed):
    g = torch.Generator().manual_seed(seed)
    P = H * K
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    d = dict(qkv=r(T, 3 * P).to(act), f=r(T, P).to(act), b=r(T, H).to(act), g=r(T, P).to(act),
             conv_w=r(3 * P, 4) * 0.5, A_log=r(H) * 0.5, dt_bias=r(P) * 0.3, o_norm_w=torch.rand(K, generator=g) + 0.5)
    state = r(S, H, K, K) * 0.1
    conv = r(S, 3 * P, 3).to(act)
    return d, state, conv


def _poison(state, conv, used):
    for s in range(state.shape[0]):
        if s not in used:
            state[s] = float("nan")
            conv[s] = float("nan")


KDA_CASES = [(2, 16, torch.float32)] + ([(12, 128, torch.bfloat16), (24, 128, torch.bfloat16),
                                        (48, 128, torch.bfloat16), (96, 128, torch.bfloat16)] if HAS_CUDA else
                                       [(3, 32, torch.bfloat16)])


@pytest.mark.parametrize("bv", [None, "quarter", "half", "quarter+workspace", "half+workspace", "sentinel",
                                "quarter+tokens-fast", "whole", "whole+sentinel", "default+workspace"])
@pytest.mark.parametrize("H,K,act", KDA_CASES)
def test_kda_decode(H, K, act, bv, monkeypatch):
    """Kernel = reference on the used slots; unused slots untouched (NaN-poisoned). The V tile is the default rule's
    or forced through it (`_decode_block_v`): "quarter" K/4 (16 or 32 at K = 128: small and middle batches), "half"
    K/2 (64: large batches), "whole" K: one program per (token, head), no counter (the tile of the AOT plugin and of
    every K < 128). "sentinel": row 1 is a padding row on slot 0, which the kernel must not write (its output row is
    not checked). "+workspace": the scratch carved from a caller buffer of `kda_decode_workspace_bytes` filled with
    garbage (CUDA graph / TensorRT). "tokens-fast": the grid order of batches above CUDA's grid-y limit (65535),
    forced through `_decode_grid`."""
    slots = torch.tensor([5, 0 if bv and bv.endswith("sentinel") else 2, 7, 3], dtype=torch.int32)
    S = 9
    d, state, conv = _kda_inputs(len(slots), H, K, S, act, seed=H)
    _poison(state, conv, set(slots.tolist()) - {0})
    ro, rs, rc = kda_ref.kda_decode(**d, state=state, conv=conv, slots=slots, num_heads=H, head_dim=K)
    G = Guarded()
    dd = {k: G(v.to(DEV)) for k, v in d.items()}
    st, cv = G(state.to(DEV)), G(conv.to(DEV))
    tile = (K // 4 if bv and bv.startswith("quarter") else K // 2 if bv and bv.startswith("half") else
            K if bv and bv.startswith("whole") else None)
    if tile:
        monkeypatch.setattr(kda_k, "_decode_block_v", lambda n_items, head_dim: tile)
    kw = {}
    if bv and bv.endswith("+workspace"):
        n = kda_k.kda_decode_workspace_bytes(len(slots), H, K)
        assert n > 0 or K < 128 and not tile
        kw["workspace"] = G(torch.full((n,), 0xAB, dtype=torch.uint8, device=DEV))
    if bv == "quarter+tokens-fast":
        monkeypatch.setattr(kda_k, "_decode_grid", lambda batch, heads, nv: ((batch, heads, nv), False))
    o, st2, cv2 = kda_k.kda_decode(**dd, state=st, conv=cv, slots=G(slots.to(DEV)), num_heads=H, head_dim=K,
                                   out=G.empty(len(slots), H * K, dtype=act), **kw)
    G.check()
    assert st2.data_ptr() == st.data_ptr() and cv2.data_ptr() == cv.data_ptr()
    tol = 1e-5 if act == torch.float32 else 2e-2
    real = slots != 0
    assert relerr(o[real.to(o.device)], ro[real]) < tol
    u = slots[real].long()
    assert relerr(st[u], rs[u]) < (1e-5 if act == torch.float32 else 2e-3)
    assert relerr(cv[u], rc[u]) < 1e-6
    unused = [s for s in range(S) if s not in set(slots[real].tolist())]
    assert torch.isnan(st[unused].cpu()).all() and torch.isnan(cv[unused].cpu().float()).all()


def test_kda_decode_counters_grow_without_freeing(monkeypatch):
    """The split kernel's arrival counters: zeroed, at least n, reused while large enough; a larger need allocates a
    new buffer and keeps the old one alive (a CUDA graph captured before may still point at it)."""
    monkeypatch.setattr(kda_k, "_COUNTERS", {})
    monkeypatch.setattr(kda_k, "_COUNTERS_RETIRED", [])
    a = kda_k._counters(torch.device("cpu"), 10)
    assert a.numel() == 4096 and not a.any() and kda_k._counters(torch.device("cpu"), 4096) is a
    b = kda_k._counters(torch.device("cpu"), 5000)
    assert b is not a and b.numel() == 5000 and not b.any() and kda_k._COUNTERS_RETIRED == [a]


def test_kda_decode_grid_order_and_batch_limit():
    """V tiles of a (token, head) adjacent; batches over CUDA's grid-y limit (65535) keep tokens in x."""
    assert kda_k._decode_grid(64, 12, 4) == ((4, 64, 12), True)
    assert kda_k._decode_grid(65535, 12, 4) == ((4, 65535, 12), True)
    assert kda_k._decode_grid(65536, 12, 4) == ((65536, 12, 4), False)


@pytest.mark.parametrize("H,K,act", KDA_CASES[:2] if HAS_CUDA else KDA_CASES)
def test_kda_decode_multi_step(H, K, act):
    """Three consecutive steps through the same slots (state carried in the pools)."""
    slots = torch.tensor([4, 1], dtype=torch.int32)
    d, state, conv = _kda_inputs(2, H, K, 6, act, seed=7)
    st, cv = state.to(DEV), conv.to(DEV)
    rs, rc = state, conv
    for step in range(3):
        d, _, _ = _kda_inputs(2, H, K, 6, act, seed=100 + step)
        ro, rs, rc = kda_ref.kda_decode(**d, state=rs, conv=rc, slots=slots, num_heads=H, head_dim=K)
        o, st, cv = kda_k.kda_decode(**{k: v.to(DEV) for k, v in d.items()}, state=st, conv=cv,
                                     slots=slots.to(DEV), num_heads=H, head_dim=K)
        assert relerr(o, ro) < (1e-5 if act == torch.float32 else 2e-2)


# sequences shorter than the conv window (3 tokens) in the middle and at the end of the batch: the conv fix-up
# kernel must touch only its own sequence's rows. One sequence ([37], [197], [2]) takes chunk_kda's dense path on
# the GPU; on the CPU (no fla) every case runs the torch recurrence after the Triton conv kernels.
@pytest.mark.parametrize("H,K,act,lens", [(2, 16, torch.float32, [2, 5, 13]), (2, 16, torch.float32, [2, 70, 33]),
                                          (2, 16, torch.float32, [31, 5, 1, 2, 40]), (2, 16, torch.float32, [37]),
                                          (2, 16, torch.float32, [4, 2, 1]), (2, 16, torch.float32, [1, 1, 1, 1])] + (
    [(12, 128, torch.bfloat16, [1, 3, 70, 130]), (24, 128, torch.bfloat16, [65, 2]), (48, 128, torch.bfloat16, [3, 64]),
     (96, 128, torch.bfloat16, [2, 67]), (12, 128, torch.bfloat16, [197]), (96, 128, torch.bfloat16, [2]),
     (12, 128, torch.bfloat16, [1, 1, 2, 70])]
    if HAS_CUDA else
    [(2, 32, torch.bfloat16, [1, 3, 9])]))
def test_kda_prefill(H, K, act, lens):
    N = len(lens)
    T = sum(lens)
    S = N + 4
    slots = torch.tensor([S - 1 - 2 * i for i in range(N)], dtype=torch.int32)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    d, state, conv = _kda_inputs(T, H, K, S, act, seed=11)
    _poison(state, conv, set(slots.tolist()))
    ro, rs, rc = kda_ref.kda_prefill(**d, state=state, conv=conv, cu_seqlens=cu, slots=slots, num_heads=H, head_dim=K)
    G = Guarded()
    st, cv = G(state.to(DEV)), G(conv.to(DEV))
    o, st, cv = kda_k.kda_prefill(**{k: G(v.to(DEV)) for k, v in d.items()}, state=st, conv=cv,
                                  cu_seqlens=G(cu.to(DEV)), slots=G(slots.to(DEV)), num_heads=H, head_dim=K,
                                  out=G.empty(T, H * K, dtype=act))
    G.check()
    bf = act == torch.bfloat16 or HAS_CUDA
    assert relerr(o, ro) < (3e-2 if bf else 1e-5)
    u = slots.long()
    assert relerr(st[u], rs[u]) < (2e-2 if bf else 1e-5)
    assert relerr(cv[u], rc[u]) < 1e-6
    unused = [s for s in range(S) if s not in set(slots.tolist())]
    assert torch.isnan(st[unused].cpu()).all() and torch.isnan(cv[unused].cpu().float()).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the inf token's own sequence
@pytest.mark.parametrize("lens,act", [([10, 20], torch.float32), ([10, 1, 2, 17], torch.float32),
                                      ([10, 1, 2, 17], torch.bfloat16)])
def test_kda_prefill_bad_token_stays_in_its_sequence(lens, act):
    """An inf in the last token of the first sequence must not reach the sequences packed after it (their conv
    taps read their slots' history there, not that token), also through 1- and 2-token sequences in between: the
    later sequences' outputs and states stay finite and equal the reference."""
    H, K = 2, 16
    N, T, S = len(lens), sum(lens), len(lens) + 2
    slots = torch.tensor([S - 1 - i for i in range(N)], dtype=torch.int32)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    d, state, conv = _kda_inputs(T, H, K, S, act, seed=3)
    d["qkv"][lens[0] - 1] = float("inf")
    ro, rs, _ = kda_ref.kda_prefill(**d, state=state.clone(), conv=conv.clone(), cu_seqlens=cu, slots=slots,
                                    num_heads=H, head_dim=K)
    o, st, _ = kda_k.kda_prefill(**{k: v.to(DEV) for k, v in d.items()}, state=state.to(DEV), conv=conv.to(DEV),
                                 cu_seqlens=cu.to(DEV), slots=slots.to(DEV), num_heads=H, head_dim=K)
    later, u = slice(lens[0], T), slots[1:].long()
    assert torch.isfinite(ro[later]).all() and torch.isfinite(o[later]).all() and torch.isfinite(st[u]).all()
    bf = HAS_CUDA or act == torch.bfloat16
    assert relerr(o[later], ro[later]) < (3e-2 if bf else 1e-5)
    assert relerr(st[u], rs[u]) < (2e-2 if bf else 1e-5)


def _conv_ref(qkv, w, hist, lens, slots, H, K):
    """The fp32 reference of the conv pass (MODEL.md §4: short_conv + l2norm of q/k per head) as y [3, T, P]."""
    P, out, start = H * K, [], 0
    for n, L in enumerate(lens):
        y, _ = kda_ref.short_conv(qkv[start:start + L], w, hist[slots[n]])
        qk = kda_ref.l2norm(y[:, :2 * P].reshape(L, 2 * H, K)).reshape(L, 2 * P)
        out.append(torch.cat([qk, y[:, 2 * P:]], 1))
        start += L
    return torch.cat(out).reshape(-1, 3, P).transpose(0, 1)


def _within_bf16_ulp(y, ref):
    err = (y.float().cpu() - ref).abs()
    assert (err <= ref.abs() * 2 ** -7 + 1e-6).all(), f"max err {err.max().item():.3g}"


@pytest.mark.parametrize("H,K,lens,layout", [
    (2, 32, [70, 2, 78], "aligned"), (3, 16, [70, 2, 78], "aligned"), (2, 32, [80, 80], "aligned"),
    (2, 32, [3], "aligned"), (2, 32, [70, 2, 78], "base+2B"), (2, 32, [70, 2, 78], "odd stride"),
    (2, 32, [70, 2, 78], "y+2B")])
def test_kda_conv_pass_bf16_pairs(H, K, lens, layout):
    """bf16 conv pass (channel pairs as int32, rows in groups of 4, interior tiles unmasked, approximate ex2/rcp
    SiLU on the GPU) against the fp32 reference conv: every element within one bf16 ulp (2^-7 relative).
    Sequences that straddle tiles, interior tiles and a ragged last tile (T=150), tiles ending exactly at T (160),
    T=3, a 2-token sequence, qkv rows with a stride larger than 3P; a qkv base or y base off by 2 bytes or an odd qkv
    row stride must take the generic path (asserted), the aligned layouts the pair path."""
    T, P = sum(lens), H * K
    D = 3 * P
    g = torch.Generator().manual_seed(5)
    off = 1 if layout == "base+2B" else 16
    wide = torch.randn(T, D + 32 + (layout == "odd stride"), generator=g).to(torch.bfloat16)
    qkv, w = wide[:, off:off + D], torch.randn(D, 4, generator=g) * 0.5
    conv = torch.randn(4, D, 3, generator=g).to(torch.bfloat16)
    slots = [3, 1, 2][:len(lens)]
    ref = _conv_ref(qkv, w, conv, lens, slots, H, K)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    G = Guarded()
    ybuf = G(torch.full((3 * T * P + 1,), float("nan"), dtype=torch.bfloat16, device=DEV))
    y = (ybuf[1:] if layout == "y+2B" else ybuf[:-1]).view(3, T, P)
    qd = G(wide.to(DEV))[:, off:off + D]
    assert kda_k._conv_pairs_ok(qd, y) == (layout == "aligned")
    kda_k._conv_prefill(qd, w.to(DEV), conv.to(DEV), torch.tensor(slots, dtype=torch.int32, device=DEV), cu, y, T, D,
                        P, K)
    G.check()
    _within_bf16_ulp(y, ref)


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_kda_conv_main_kernel_first_rows(act):
    """The main kernel alone (no start fix-up) on one sequence equals the reference with a zero history in every
    row, the first three included: its first tile's masked taps read 0 before token 0 (bf16: the pair path)."""
    H, K, T = 2, 32, 150
    P, D = H * K, 3 * H * K
    g = torch.Generator().manual_seed(6)
    qkv, w = torch.randn(T, D, generator=g).to(act), torch.randn(D, 4, generator=g) * 0.5
    ref = _conv_ref(qkv, w, torch.zeros(1, D, 3), [T], [0], H, K)
    y = torch.full((3, T, P), float("nan"), dtype=act, device=DEV)
    kda_k._conv_main(qkv.to(DEV), w.to(DEV), y, T, D, P, K)
    if act == torch.bfloat16:
        _within_bf16_ulp(y, ref)
    else:
        assert relerr(y.cpu(), ref) < (1e-5 if HAS_CUDA else 1e-6)


def test_kda_state_rows_through_slots():
    """The state gather/scatter around fla's chunk_kda: gather then scatter is the identity on the slots used,
    leaves the other slots alone, and the gathered rows equal the pool rows."""
    H, K, S = 3, 32, 6
    pool = torch.randn(S, H, K, K, device=DEV)
    slots = torch.tensor([4, 1, 3], dtype=torch.int32, device=DEV)
    G = Guarded()
    src, dst = G(pool.clone()), G.empty(3, H, K, K, dtype=torch.float32)
    kda_k._copy_rows(src, dst, G(slots), gather=True)
    assert torch.equal(dst, pool[slots.long()])
    back = G(torch.full_like(pool, float("nan")))
    kda_k._copy_rows(dst, back, G(slots), gather=False)
    G.check()
    assert torch.equal(back[slots.long()], pool[slots.long()])
    assert torch.isnan(back[[0, 2, 5]]).all()


# fp32 operands: exact products under the interpreter; the GPU's tl.dot rounds fp32 operands to TF32 (10-bit mantissa)
FP32_DOT_TOL = 3e-3 if HAS_CUDA else 1e-5


def _static_chunks(lens, BT, nt_max):
    """fla's static chunk indices (prepare_chunk_indices_static), written out: co [N+1] = first chunk row of each
    sequence, ci [nt_max, 2] = (sequence, chunk in it) per row, (-1, 0) past the last chunk."""
    nch = [(L + BT - 1) // BT for L in lens]
    co = torch.tensor([0] + list(torch.tensor(nch).cumsum(0)), dtype=torch.int64)
    rows = [(n, c) for n, m in enumerate(nch) for c in range(m)]
    rows += [(-1, 0)] * (nt_max - len(rows))
    return torch.tensor(rows, dtype=torch.int64), co


@pytest.mark.parametrize("lens,bk", [([150], 16), ([70, 5, 130, 1], 32), ([64, 64], 16), ([70, 1, 64], 32)])
def test_kda_chunk_out_norm_kernel(lens, bk):
    """Our output kernel (o = scale (q 2^gk) h[c]ᵀ + tril(Aqk) vn, then the gated RMSNorm) against torch, fp32,
    dense and varlen; [64, 64] and [70, 1, 64] leave padding chunk rows (sequence -1), which must write nothing:
    the output sits between finite guard rows that must stay as they were. Gate and output through row strides."""
    H, K, BT = 2, 32, kda_k._CHUNK
    T, N, P = sum(lens), len(lens), 2 * 32
    g = torch.Generator().manual_seed(6)
    r = lambda *s: torch.randn(*s, generator=g)               # noqa: E731
    NT = (T + BT - 1) // BT + (N - 1 if N > 1 else 0)
    ci, co = _static_chunks(lens, BT, NT)
    q, vn, gk = r(T, H, K), r(T, H, K), -torch.rand(T, H, K, generator=g)
    h, A = r(NT, H, K, K) * 0.2, r(T, H, BT) * 0.2
    gate_wide = r(T, P + 8)
    gate = gate_wide[:, :P]                                   # row stride P + 8
    wn = torch.rand(K, generator=g) + 0.5
    scale, eps = K ** -0.5, 1e-5
    ref = torch.empty(T, H, K)
    bos = 0
    for n, L in enumerate(lens):
        for c in range((L + BT - 1) // BT):
            rr = slice(bos + c * BT, bos + min((c + 1) * BT, L))
            m = rr.stop - rr.start
            qg = q[rr] * torch.exp2(gk[rr])
            o = scale * torch.einsum("thk,hvk->thv", qg, h[int(co[n]) + c])
            o = o + torch.einsum("hts,shv->thv", torch.tril(A[rr, :, :m].permute(1, 0, 2)), vn[rr])
            ref[rr] = o
        bos += L
    ref = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + eps) * wn * torch.sigmoid(gate.view(T, H, K))
    assert (ci[:, 0] < 0).any() == (lens in ([64, 64], [70, 1, 64]))   # the cases with padding rows have them
    G = Guarded()
    guard = torch.full((T + 8, P + 16), 7.0, device=DEV)          # finite guard rows and columns around out
    out = guard[4:T + 4, :P]
    out.fill_(float("nan"))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    gw = G(gate_wide.to(DEV))
    kda_k._chunk_out_norm_kernel[(NT, H)](
        G(q.to(DEV)), G(gk.to(DEV)), G(h.to(DEV)), G(vn.to(DEV)), G(A.to(DEV)), gw[:, :P], G(wn.to(DEV)), out,
        G(cu.to(DEV)), G(ci.to(DEV)) if N > 1 else None, T, gw.stride(0), out.stride(0), scale, eps, H=H, K=K, BT=BT,
        BK=bk, IS_VARLEN=N > 1, num_warps=4)
    G.check()
    assert relerr(out, ref.reshape(T, P)) < FP32_DOT_TOL
    assert (guard[:4] == 7).all() and (guard[T + 4:] == 7).all() and (guard[:, P:] == 7).all()


@pytest.mark.gpu
@pytest.mark.parametrize("H,lens,act", [(12, [1, 3, 70, 130], torch.bfloat16), (96, [2, 67], torch.bfloat16),
                                        (12, [197], torch.bfloat16), (96, [300], torch.bfloat16),
                                        (48, [64, 1, 128], torch.bfloat16), (12, [64, 64], torch.float32),
                                        (24, [5, 70], torch.float32)])
def test_kda_prefill_chunk_core_equals_chunk_kda_fallback(H, lens, act, monkeypatch):
    """The chunk core (fla-core's chunk stages + our output kernel with the norm fused) against the fallback for
    untested fla-core versions (`_fla_stages()` None: the whole fla-core chunk_kda + our norm kernel) on the same
    inputs: outputs and final states agree. bf16, and fp32 activations (conv output in bf16 for fla) written into an
    output with a row stride."""
    assert kda_k._fla_stages() is not None, "fla-core's stages are not usable here: both runs would take chunk_kda"
    K, N = 128, len(lens)
    T, S = sum(lens), len(lens) + 2
    slots = torch.tensor([S - 1 - i for i in range(N)], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    d, state, conv = _kda_inputs(T, H, K, S, act, seed=21)
    d = {k: v.to(DEV) for k, v in d.items()}
    res = {}
    for core in ("stages", "chunk_kda"):
        if core == "chunk_kda":
            monkeypatch.setattr(kda_k, "_fla_stages", lambda: None)
        st, cv = state.to(DEV), conv.to(DEV)
        wide = torch.full((T, H * K + 64), float("nan"), dtype=act, device=DEV)
        o = kda_k.kda_prefill(**d, state=st, conv=cv, cu_seqlens=cu, slots=slots, num_heads=H, head_dim=K,
                              out=wide[:, :H * K])[0]
        assert torch.isnan(wide[:, H * K:]).all()
        res[core] = (o.float(), st[slots.long()])
    assert relerr(res["stages"][0], res["chunk_kda"][0]) < 1e-2
    assert relerr(res["stages"][1], res["chunk_kda"][1]) < 1e-2


@pytest.mark.parametrize("kw,match", [(dict(lower_bound=-6.0), r"\[-5, 0\)"), (dict(lower_bound=0.0), r"\[-5, 0\)")])
def test_kda_prefill_rejects_bad_options(kw, match):
    """A gate lower bound outside fla's safe-gate range fails before any pool is touched."""
    d, state, conv = _kda_inputs(4, 2, 16, 2, torch.float32, seed=1)
    st0, cv0 = state.clone(), conv.clone()
    with pytest.raises(ValueError, match=match):
        kda_k.kda_prefill(**{k: v.to(DEV) for k, v in d.items()}, state=state.to(DEV), conv=conv.to(DEV),
                          cu_seqlens=torch.tensor([0, 4], dtype=torch.int32, device=DEV),
                          slots=torch.tensor([1], dtype=torch.int32, device=DEV), num_heads=2, head_dim=16, **kw)
    assert torch.equal(state, st0) and torch.equal(conv, cv0)


def test_fla_stages_only_for_tested_versions(monkeypatch, caplog):
    """Another fla-core version: kda_prefill's chunk core falls back to the public chunk_kda (the stages are fla's
    internal API), logged once."""
    fla = pytest.importorskip("fla")
    kda_k._fla_stages.cache_clear()
    monkeypatch.setattr(fla, "__version__", "9.9.9")
    try:
        with caplog.at_level("WARNING", logger=kda_k.__name__):
            assert kda_k._fla_stages() is None and kda_k._fla_stages() is None
        assert sum("9.9.9" in r.getMessage() for r in caplog.records) == 1
    finally:
        kda_k._fla_stages.cache_clear()
    monkeypatch.undo()
    assert kda_k._fla_stages() is not None


# ------------------------------------------------------------------------------------------------- MLA
def mla_decode_ref(q_abs, latent, cache, bt, ctx, H, R, scale):
    cache = cache.clone().cpu().float()
    NB, BS, DL = cache.shape
    B = q_abs.shape[0]
    out = torch.empty(B, H, R)
    for b in range(B):
        p = int(ctx[b])
        cache[int(bt[b, p // BS]), p % BS] = latent[b].float().cpu()
        pos = torch.arange(p + 1)
        C = cache[bt[b].long().cpu()[pos // BS], pos % BS]
        s = (q_abs[b].float().cpu() @ C.T) * scale
        out[b] = torch.softmax(s, -1) @ C[:, :R]
    return out, cache


def _mla_setup(B, H, R, DR, BS, MB, ctx, dt, seed):
    g = torch.Generator().manual_seed(seed)
    NB = B * MB + 3
    cache = torch.full((NB, BS, R + DR), float("nan")).to(dt)
    bt = (torch.randperm(NB - 1, generator=g)[:B * MB].view(B, MB) + 1).int()
    for b in range(B):
        for p in range(int(ctx[b])):
            cache[bt[b, p // BS], p % BS] = torch.randn(R + DR, generator=g).to(dt)
    return cache, bt, g


MLA_CASES = [(12, 64, 16, 16 if HAS_CUDA else 4, torch.float32)] + ([(12, 512, 64, 64, torch.bfloat16), (24, 512, 64, 64, torch.bfloat16),
                                                 (48, 512, 64, 16, torch.bfloat16), (96, 512, 64, 64, torch.bfloat16),
                                                 # fp32 caches at K3's width (the runtime's default pools):
                                                 # their own tiles (`_decode_tiles` itemsize)
                                                 (12, 512, 64, 64, torch.float32), (96, 512, 64, 64, torch.float32)]
                                                if HAS_CUDA else [])


def _split_decode_every_tokens(monkeypatch, tokens: int) -> None:
    """The decode's sequence split with a split every `tokens` cached tokens (`_split_policy`), so that the
    interpreter's short contexts take the split path and the combine kernel (a GPU splits long contexts)."""
    monkeypatch.setattr(mla_k, "_split_policy", lambda BH, BN: (8, tokens))


@pytest.mark.parametrize("H,R,DR,BS,dt", MLA_CASES)
def test_mla_decode(H, R, DR, BS, dt, monkeypatch):
    """Kernel = the fp32 oracle, the new latent written in place; poisoned memory around every tensor. On the CPU
    the 24-token table is split in 3 parts (`_split_decode_every_tokens`)."""
    if not HAS_CUDA:
        _split_decode_every_tokens(monkeypatch, 8)
    ctx = torch.tensor([0, 5, 3 * BS + 1, 6 * BS - 1], dtype=torch.int32)
    B, MB = 4, 6
    cache, bt, g = _mla_setup(B, H, R, DR, BS, MB, ctx, dt, seed=H)
    q = torch.randn(B, H, R + DR, generator=g).to(dt)
    lat = torch.randn(B, R + DR, generator=g).to(dt)
    scale = 192 ** -0.5
    ro, rc = mla_decode_ref(q, lat, cache, bt, ctx, H, R, scale)
    oo, oc = mla_ref.mla_decode(q.float(), lat.float(), cache.float(), bt, ctx, num_heads=H, kv_lora_rank=R, scale=scale)
    assert relerr(ro, oo) < 1e-5                         # own transcription agrees with the oracle
    ro = oo
    G = Guarded()
    c = G(cache.to(DEV))
    o, c2 = mla_k.mla_decode(G(q.to(DEV)), G(lat.to(DEV)), c, G(bt.to(DEV)), G(ctx.to(DEV)), num_heads=H,
                             kv_lora_rank=R, scale=scale, out=G.empty(B, H, R, dtype=dt))
    G.check()
    assert c2.data_ptr() == c.data_ptr()
    # fp32 on the GPU: tl.dot runs TF32 (~3e-4); the interpreter is exact fp32
    assert relerr(o, ro) < ((2e-3 if HAS_CUDA else 1e-5) if dt == torch.float32 else 1e-2)
    assert nan_equal(c.float(), rc)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [12, 96])
def test_mla_decode_long_contexts_many_splits(H):
    """Contexts up to 8191 tokens of a 128-block table (BS 64): the default split count (`_launch_cfg`, >= 256
    tokens per split, 512 for sm_90's 64 x 64 tiles at 96 heads) gives many splits, each sequence's last split
    partial and an empty sequence; poisoned memory around every tensor; equal to the fp32 oracle. (GPU only: 8K-token
    contexts are too slow for the interpreter, where test_mla_decode covers the split path.)"""
    R, DR, BS, MB, dt = 512, 64, 64, 128, torch.bfloat16
    ctx = torch.tensor([0, 300, 4097, 8191], dtype=torch.int32)
    B = 4
    cache, bt, g = _mla_setup(B, H, R, DR, BS, MB, ctx, dt, seed=H + 1)
    q = torch.randn(B, H, R + DR, generator=g).to(dt)
    lat = torch.randn(B, R + DR, generator=g).to(dt)
    scale = 192 ** -0.5
    ro, rc = mla_ref.mla_decode(q.float(), lat.float(), cache.float(), bt, ctx, num_heads=H, kv_lora_rank=R,
                                scale=scale)
    bh, bn = mla_k._decode_tiles(mla_k._device_cap(DEV), H, BS)[:2]
    nsplit = mla_k._launch_cfg(B, H, MB * BS, torch.device(DEV), bn, bh)[2]
    assert nsplit >= 8, nsplit
    G = Guarded()
    c = G(cache.to(DEV))
    o, _ = mla_k.mla_decode(G(q.to(DEV)), G(lat.to(DEV)), c, G(bt.to(DEV)), G(ctx.to(DEV)), num_heads=H,
                            kv_lora_rank=R, scale=scale, out=G.empty(B, H, R, dtype=dt))
    G.check()
    assert relerr(o, ro) < 1e-2
    assert nan_equal(c.float(), rc)


def mla_prefill_ref(q, latent, kv_b, cache, bt, cu, ctx, H, Dn, Dv, R, scale):
    cache = cache.clone().cpu().float()
    NB, BS, DL = cache.shape
    out = torch.empty(q.shape[0], H * Dv)
    W = kv_b.float().cpu().view(H, Dn + Dv, R)
    for n in range(len(cu) - 1):
        a, e = int(cu[n]), int(cu[n + 1])
        for i in range(e - a):
            p = int(ctx[n]) + i
            cache[int(bt[n, p // BS]), p % BS] = latent[a + i].float().cpu()
        tot = int(ctx[n]) + e - a
        pos = torch.arange(tot)
        C = cache[bt[n].long().cpu()[pos // BS], pos % BS]
        kv = torch.einsum("tr,hdr->htd", C[:, :R], W)
        k = torch.cat([kv[..., :Dn], C[None, :, R:].expand(H, tot, DL - R)], -1)
        v = kv[..., Dn:]
        qq = q[a:e].float().cpu().transpose(0, 1)
        s = qq @ k.transpose(1, 2) * scale
        mask = torch.arange(tot)[None, :] <= (int(ctx[n]) + torch.arange(e - a))[:, None]
        s = s.masked_fill(~mask, float("-inf"))
        out[a:e] = (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(e - a, H * Dv)
    return out, cache


@pytest.mark.parametrize("H,R,DR,Dn,Dv,BS", [(2, 32, 8, 16, 16, 4)] + ([(12, 512, 64, 128, 128, 64)] if HAS_CUDA else []))
def test_mla_prefill(H, R, DR, Dn, Dv, BS, monkeypatch):
    dt = torch.bfloat16 if HAS_CUDA else torch.float32
    lens, ctxl = [3, 7], [0, 5]
    ctx = torch.tensor(ctxl, dtype=torch.int32)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    cache, bt, g = _mla_setup(2, H, R, DR, BS, 4, ctx, dt, seed=3)
    q = torch.randn(10, H, Dn + DR, generator=g).to(dt)
    lat = torch.randn(10, R + DR, generator=g).to(dt)
    kv_b = (torch.randn(H * (Dn + Dv), R, generator=g) * R ** -0.5).to(dt)
    scale = (Dn + DR) ** -0.5
    ro, rc = mla_prefill_ref(q, lat, kv_b, cache, bt, cu, ctx, H, Dn, Dv, R, scale)
    oo, _ = mla_ref.mla_prefill(q.float(), lat.float(), kv_b.float(), cache.float(), bt, cu, ctx, num_heads=H,
                                qk_nope_head_dim=Dn, v_head_dim=Dv, kv_lora_rank=R, scale=scale)
    assert relerr(ro, oo) < 1e-5
    ro = oo
    # the default path (CUDA: the graph-safe Triton kernels when BS is a multiple of 16; CPU: SDPA), and SDPA on CUDA
    seen = []
    real = mla_k._mla_prefill_graph_safe
    monkeypatch.setattr(mla_k, "_mla_prefill_graph_safe", lambda *a, **k: seen.append(1) or real(*a, **k))
    for graph_safe in (None, False) if HAS_CUDA else (None,):
        G = Guarded()
        c = G(cache.to(DEV))
        o, c = mla_k.mla_prefill(G(q.to(DEV)), G(lat.to(DEV)), G(kv_b.to(DEV)), c, G(bt.to(DEV)), G(cu.to(DEV)),
                                 G(ctx.to(DEV)), num_heads=H, qk_nope_head_dim=Dn, v_head_dim=Dv, kv_lora_rank=R,
                                 scale=scale, out=G.empty(10, H * Dv, dtype=dt), graph_safe=graph_safe)
        G.check()
        assert relerr(o, ro) < (1e-5 if dt == torch.float32 else 2e-2), graph_safe
        assert nan_equal(c.float(), rc), graph_safe
    assert len(seen) == (1 if HAS_CUDA and BS % 16 == 0 else 0)    # the default's path; graph_safe=False never


def _strided(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """t's values as a view with stride 2 along `dim` (the other entries hold garbage ids)."""
    shape = list(t.shape)
    shape[dim] *= 2
    every_other = tuple(slice(None, None, 2) if d == dim else slice(None) for d in range(t.dim()))
    big = torch.full(shape, 99, dtype=t.dtype, device=t.device)
    big[every_other] = t
    view = big[every_other]
    assert torch.equal(view, t) and not view.is_contiguous()
    return view


def test_index_tensors_may_be_strided_views(monkeypatch):
    """slots / cu_seqlens / context_lens / block tables handed over as strided views (e.g. a column of a bigger
    table) give exactly the results of contiguous copies, in every op (the kernels read them with unit strides:
    they are made contiguous first, `plugins.common.index_i32`)."""
    H, K, act = KDA_CASES[0]
    slots = torch.tensor([5, 2, 7, 3], dtype=torch.int32)
    d, state, conv = _kda_inputs(4, H, K, 9, act, seed=5)
    dd = {k: v.to(DEV) for k, v in d.items()}
    runs = []
    for sl in (slots.to(DEV), _strided(slots.to(DEV))):
        st, cv = state.clone().to(DEV), conv.clone().to(DEV)
        runs.append(kda_k.kda_decode(**dd, state=st, conv=cv, slots=sl, num_heads=H, head_dim=K))
    assert all(nan_equal(a, b) for a, b in zip(*runs))
    lens = [3, 1, 5]
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    d, state, conv = _kda_inputs(9, H, K, 9, act, seed=6)
    dd = {k: v.to(DEV) for k, v in d.items()}
    runs = []
    for c, sl in ((cu.to(DEV), slots[:3].to(DEV)), (_strided(cu.to(DEV)), _strided(slots[:3].to(DEV)))):
        st, cv = state.clone().to(DEV), conv.clone().to(DEV)
        runs.append(kda_k.kda_prefill(**dd, state=st, conv=cv, cu_seqlens=c, slots=sl, num_heads=H, head_dim=K))
    assert all(nan_equal(a, b) for a, b in zip(*runs)) and sum(lens) == 9
    Hm, R, DR, BS, dt = MLA_CASES[0]
    ctx = torch.tensor([0, 5, 2 * BS + 1, 3 * BS - 1], dtype=torch.int32)
    cache, bt, g = _mla_setup(4, Hm, R, DR, BS, 3, ctx, dt, seed=7)
    q, lat = torch.randn(4, Hm, R + DR, generator=g).to(dt), torch.randn(4, R + DR, generator=g).to(dt)
    if not HAS_CUDA:
        _split_decode_every_tokens(monkeypatch, 6)          # the 12-token table in 2 parts
    kw = dict(num_heads=Hm, kv_lora_rank=R, scale=0.1)
    runs = [mla_k.mla_decode(q.to(DEV), lat.to(DEV), cache.clone().to(DEV), b, c, **kw)
            for b, c in ((bt.to(DEV), ctx.to(DEV)), (_strided(bt.to(DEV), 1), _strided(ctx.to(DEV))))]
    assert all(nan_equal(a, b) for a, b in zip(*runs))
    cu2, ctx2 = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)
    qp, lp = torch.randn(5, Hm, 16 + DR, generator=g).to(dt), torch.randn(5, R + DR, generator=g).to(dt)
    kv_b = (torch.randn(Hm * 32, R, generator=g) * R ** -0.5).to(dt)
    kw = dict(num_heads=Hm, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=R, scale=0.1, graph_safe=True)
    runs = [mla_k.mla_prefill(qp.to(DEV), lp.to(DEV), kv_b.to(DEV), cache.clone().to(DEV), b, c, x, **kw)
            for b, c, x in ((bt[:2].to(DEV), cu2.to(DEV), ctx2.to(DEV)),
                            (_strided(bt[:2].to(DEV), 1), _strided(cu2.to(DEV)), _strided(ctx2.to(DEV))))]
    assert all(nan_equal(a, b) for a, b in zip(*runs))


# ------------------------------------------------------------------------------------------------- MoE
_LUT = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def dequant(p, s):
    lo, hi = _LUT[(p & 15).long()], _LUT[(p >> 4).long()]
    return torch.stack([lo, hi], -1).flatten(-2) * torch.exp2(s.float() - 127).repeat_interleave(32, -1)


def situ(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


def moe_ref(x, ids, w, w13p, w13s, w2p, w2s, off):
    E = w13p.shape[0]
    W13, W2 = dequant(w13p, w13s), dequant(w2p, w2s)
    I = W13.shape[1] // 2
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - off
            if 0 <= e < E:
                h = W13[e].double() @ x[t].double()
                y[t] += float(w[t, j]) * (W2[e].double() @ situ(h[:I], h[I:]))
    return y


@pytest.mark.parametrize("E,RL,I,T,k", [(6, 64, 32, 5, 3), (6, 128, 64, 5, 3), (4, 64, 64, 20, 4)] + (
    [(16, 512, 256, 9, 6), (8, 256, 128, 40, 4)] if HAS_CUDA else []))
# K tiles 32 (I = 32: k3-tiny's TP=2 expert slices) and 64; 16-row token tiles, and T*k/E > 16: 64-row ones. GPU:
# 54 pairs (the Triton kernels), 160 pairs at 20 per expert (the Gluon kernels)
def test_mxfp4_moe(E, RL, I, T, k):
    """The kernel (its default kernels and tiles for each shape) equals the fp64 MoE of dequantized weights and the
    fp32 reference, with ids of experts on other EP ranks; poisoned memory around every tensor."""
    g = torch.Generator().manual_seed(5)
    w13p = torch.randint(0, 256, (E, 2 * I, RL // 2), dtype=torch.uint8, generator=g)
    w13s = torch.randint(121, 127, (E, 2 * I, RL // 32), dtype=torch.uint8, generator=g)
    w2p = torch.randint(0, 256, (E, RL, I // 2), dtype=torch.uint8, generator=g)
    w2s = torch.randint(118, 124, (E, RL, I // 32), dtype=torch.uint8, generator=g)
    x = torch.randn(T, RL, generator=g).to(torch.bfloat16)
    off = 2
    ids = torch.stack([torch.randperm(E + 4, generator=g)[:k] for _ in range(T)]).int()   # some non-local (EP)
    w = torch.rand(T, k, generator=g)
    r = moe_ref(x, ids, w, w13p, w13s, w2p, w2s, off)
    ro = moe_ref_mod.mxfp4_moe(x.float(), ids, w, w13p, w13s, w2p, w2s, expert_offset=off)
    assert relerr(ro, r) < 1e-4
    r = ro
    G = Guarded()
    y = moe_k.mxfp4_moe(*(G(a.to(DEV)) for a in (x, ids, w, w13p, w13s, w2p, w2s)),
                        expert_offset=off, out=G.empty(T, RL, dtype=torch.float32))
    G.check()
    assert y.dtype == torch.float32
    assert relerr(y, r) < 1e-2   # h is rounded to bf16 between the two GEMMs


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["default", "legacy"])
def test_mxfp4_moe_production_shape(impl, monkeypatch):
    """K3's per-rank MoE at TP=8 / EP=8 (112 local experts, 3584 -> 3072, top-16, T=64: the benchmark's shape) against
    the fp32 reference, poisoned margins around every tensor: the default (the Gluon kernels on sm_90+) and the
    Triton kernels that larger batches take (forced through `_pick_impl`)."""
    if impl == "legacy":
        monkeypatch.setattr(moe_k, "_pick_impl", lambda *a: "legacy")
    g = torch.Generator().manual_seed(11)
    E, RL, I, T, k = 112, 3584, 3072, 64, 16
    w13p = torch.randint(0, 256, (E, 2 * I, RL // 2), dtype=torch.uint8, generator=g)
    w13s = torch.randint(118, 126, (E, 2 * I, RL // 32), dtype=torch.uint8, generator=g)
    w2p = torch.randint(0, 256, (E, RL, I // 2), dtype=torch.uint8, generator=g)
    w2s = torch.randint(118, 126, (E, RL, I // 32), dtype=torch.uint8, generator=g)
    x = (torch.randn(T, RL, generator=g) * 0.1).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    w = torch.rand(T, k, generator=g)
    dev_args = [a.to(DEV) for a in (x, ids, w, w13p, w13s, w2p, w2s)]
    r = moe_ref_mod.mxfp4_moe(dev_args[0].float(), *dev_args[1:])
    G = Guarded()
    y = moe_k.mxfp4_moe(*(G(a) for a in dev_args), out=G.empty(T, RL, dtype=torch.float32))
    G.check()
    assert relerr(y, r) < 1e-2   # h is rounded to bf16 between the two GEMMs


def test_dequant_odd_nibble_multiply_identity():
    """`_dequant_asm2`'s odd-code step on the GPU: for every byte pair spread into the two bf16 lanes
    (a = b0 | b1 << 16), (z * 0x104) & 0x81C081C0 with z = a & 0x00F000F0 equals (z<<2 | z<<8) & 0x81C081C0, and
    each lane read as bf16 times 2^126 is the high nibble's E2M1 value (MODEL.md §8.3)."""
    assert "mul.lo.u32 x, z, 0x104;" in moe_k._asm2_text(True) and "mul.lo.u32 x, z, 0x104;" in moe_k._asm2_text(False)
    b = torch.arange(256, dtype=torch.int64)
    a = (b[:, None] | (b[None, :] << 16)).reshape(-1)
    z = a & 0x00F000F0
    got = (z * 0x104) & 0x81C081C0
    assert torch.equal(got, ((z << 2) | (z << 8)) & 0x81C081C0)
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    for lane, src in ((got & 0xFFFF, a & 0xFF), (got >> 16, (a >> 16) & 0xFF)):
        val = (lane.to(torch.int32) << 16).view(torch.float32).double() * 2.0 ** 126
        assert torch.equal(val, e2m1[src >> 4])


def test_mxfp4_moe_token_tile_counts_all_ranks_experts(monkeypatch):
    """num_experts (the global routed expert count) sets the token tile under EP: at EP=8 of 896 experts a
    T=256 decode batch puts ~5 pairs on each expert (16-row tiles), not 37 (the local count's estimate). A
    num_experts below expert_offset + E is refused, naming the attribute, by the kernel and the reference."""
    assert moe_k._pick_block_m(256, 16, 112) == 64 and moe_k._pick_block_m(256, 16, 896) == 16
    assert moe_k._pick_block_m(64, 16, 112) == 16
    seen = []
    pick = moe_k._pick_block_m
    monkeypatch.setattr(moe_k, "_pick_block_m", lambda T, k, n: seen.append(n) or pick(T, k, n))
    g = torch.Generator().manual_seed(1)
    E, RL, I, T, k = 2, 64, 64, 3, 2
    args = (torch.randn(T, RL, generator=g), torch.tensor([[4, 5], [5, 9], [0, 4]], dtype=torch.int32),
            torch.rand(T, k, generator=g), torch.randint(0, 256, (E, 2 * I, RL // 2), dtype=torch.uint8, generator=g),
            torch.full((E, 2 * I, RL // 32), 120, dtype=torch.uint8),
            torch.randint(0, 256, (E, RL, I // 2), dtype=torch.uint8, generator=g),
            torch.full((E, RL, I // 32), 120, dtype=torch.uint8))
    args = tuple(a.to(DEV) for a in args)
    y = moe_k.mxfp4_moe(*args, expert_offset=4, num_experts=16)
    y0 = moe_k.mxfp4_moe(*args, expert_offset=4)
    assert seen == [16, E] and torch.equal(y, y0)   # the hint changes the schedule only
    assert relerr(y, moe_ref_mod.mxfp4_moe(*(a.cpu() for a in args), expert_offset=4, num_experts=16)) < 1e-2
    for fn in (moe_k.mxfp4_moe, moe_ref_mod.mxfp4_moe):
        with pytest.raises(ValueError, match="num_experts=5 is below expert_offset"):
            fn(*args, expert_offset=4, num_experts=5)


def test_moe_block_k_divides_both_inner_dims():
    """The MoE kernel's K loops have no column mask: the tile must divide Rl and I (k3-tiny I = 64, TP=2: 32)."""
    from k3deploy.plugins.moe.kernels import default_block_k
    assert default_block_k(3584, 3072) == 64 and default_block_k(3584, 384) == 64
    assert default_block_k(3584, 3072, block_m=64) == 128 and default_block_k(3584, 384, block_m=64) == 128
    assert default_block_k(128, 64) == 64 and default_block_k(128, 32) == 32 and default_block_k(96, 64) == 32
    with pytest.raises(ValueError, match="multiples of 32"):
        default_block_k(128, 48)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [12, 48])
def test_mxfp4_moe_scales_above_one(T):
    """The Triton kernels' inline-PTX dequant (GPU only): with 16-row token tiles (T=12: 9 pairs per expert) the
    programs of experts whose E8M0 exponents exceed 128 (scales > 2^1) take the two-multiply decode, the others the
    folded one; with 64-row tiles (T=48: 36 pairs per expert) every program takes the two-multiply decode. Every
    expert equals the fp64 reference either way."""
    E, RL, I, k = 4, 256, 128, 3
    assert moe_k._pick_block_m(T, k, E) == (16 if T == 12 else 64)
    assert moe_k._pick_impl(torch.device(DEV), T, k, E, RL, I) == "legacy"     # < 64 pairs, or > 32 per expert
    g = torch.Generator().manual_seed(9)
    w13p = torch.randint(0, 256, (E, 2 * I, RL // 2), dtype=torch.uint8, generator=g)
    w13s = torch.randint(110, 126, (E, 2 * I, RL // 32), dtype=torch.uint8, generator=g)
    w2p = torch.randint(0, 256, (E, RL, I // 2), dtype=torch.uint8, generator=g)
    w2s = torch.randint(110, 122, (E, RL, I // 32), dtype=torch.uint8, generator=g)
    w13s[1, 5, 3] = 131          # expert 1: one gate row group above 2^1; expert 3: its whole w2 a factor 2^12 up
    w2s[3] += 12
    x = torch.randn(T, RL, generator=g).to(torch.bfloat16) * 0.05
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    w = torch.rand(T, k, generator=g)
    r = moe_ref(x, ids, w, w13p, w13s, w2p, w2s, 0)
    y = moe_k.mxfp4_moe(*(a.to(DEV) for a in (x, ids, w, w13p, w13s, w2p, w2s))).cpu()
    big = (ids == 3).any(1)
    assert 0 < int(big.sum()) < T
    assert relerr(y[big], r[big]) < 1e-2 and relerr(y[~big], r[~big]) < 1e-2


def _router_device(path, monkeypatch) -> str:
    """Where the router's inputs go for `path`: "kernel" (the Triton top-k: CUDA, or the CPU under the interpreter)
    or "reference" (CPU tensors outside the interpreter: `reference.route_logits`)."""
    if path == "reference":
        monkeypatch.setattr(moe_k, "_INTERPRET", False)
        return "cpu"
    return DEV


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("E,top_k,groups,topk_group,scale", [
    (24, 4, 1, 1, 1.0), (24, 4, 4, 2, 2.5),
    (40, 3, 5, 2, 1.0),             # 8 experts per group, top_k and groups not powers of 2
    (64, 6, 8, 3, 1.0),
    (896, 16, 1, 1, 2.827),         # K3's router: 896 experts, top-16
])
def test_router(path, E, top_k, groups, topk_group, scale, monkeypatch):
    """The router (`route`: fp32 logits GEMM, then the Triton top-k kernel or, on a CPU outside the interpreter,
    torch) equals the noaux_tc reference (ids as sets, weights per id), grouped top-k included, best first; the
    kernel's inputs and outputs sit in poisoned memory (`route_topk` with out=)."""
    dev = _router_device(path, monkeypatch)
    g = torch.Generator().manual_seed(E + groups)
    T = 6
    x = torch.randn(T, 32, generator=g)
    gw = torch.randn(E, 32, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    rids, rw = moe_ref_mod.route(x, gw, bias, top_k=top_k, num_expert_group=groups, topk_group=topk_group,
                                 renormalize=True, scaling=scale)
    G = Guarded()
    z = G((x.float() @ gw.float().t()).to(dev))
    out = (G(torch.empty(T, top_k, dtype=torch.int32, device=dev)), G(torch.empty(T, top_k, device=dev)))
    ids, w = moe_k.route_topk(z, G(bias.to(dev)), top_k=top_k, num_expert_group=groups, topk_group=topk_group,
                              routed_scaling_factor=scale, out=out)
    G.check()
    assert ids is out[0] and w is out[1]
    ids2, w2 = moe_k.route(x.to(dev), gw.to(dev), bias.to(dev), top_k=top_k, num_expert_group=groups,
                           topk_group=topk_group, routed_scaling_factor=scale)
    assert torch.equal(ids2.cpu(), ids.cpu()) and ids2.dtype == torch.int32
    ids, w = ids.cpu().long(), w.cpu()
    for t in range(T):
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        want = dict(zip(rids[t].tolist(), rw[t].tolist()))
        assert got.keys() == want.keys()
        assert all(abs(got[e] - want[e]) < 1e-5 for e in want)
    assert torch.equal(ids, rids)         # best first, as torch.topk (no exact ties in this data)
    if groups > 1:   # every token's experts come from at most topk_group groups
        assert all(len(set((ids[t] // (E // groups)).tolist())) <= topk_group for t in range(T))


def test_router_kernel_compiles_for_sm90():
    """The router's top-k kernel compiles for the H100/H200 (sm_90, ptxas included) without a GPU, at K3's shape
    (1024-wide rows, top-16) and with the group stage (groups and top-k not powers of 2)."""
    from kernel_checks import compile_in_subprocess
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3deploy.plugins.moe.kernels import _route_kernel as fn
sig = {"z_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32", "w_ptr": "*fp32", "E": "i32", "stride_z": "i32",
       "scaling": "fp32"}
for c in ({"EP": 1024, "K": 16, "KP": 16, "G": 1, "GP": 1, "TOPK_GROUP": 1, "RENORM": True},
          {"EP": 64, "K": 3, "KP": 4, "G": 5, "GP": 8, "TOPK_GROUP": 2, "RENORM": False}):
    names = fn.arg_names
    src = ASTSource(fn=fn, signature={n: "constexpr" if n in c else sig[n] for n in names},
                    constexprs={(names.index(k),): v for k, v in c.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print(c["EP"], int("_route_kernel" in k.asm["ptx"]), len(k.asm["cubin"]) > 0)
"""
    assert compile_in_subprocess(code) == [["1024", "1", "True"], ["64", "1", "True"]]


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_router_edge_cases(path, monkeypatch):
    """No renormalization; num_expert_group <= topk_group (no group stage, as the reference); no tokens; a NaN logit
    row ranks its NaN experts first (torch.topk's order) and never picks a padding expert (ids < E)."""
    DEV = _router_device(path, monkeypatch)
    g = torch.Generator().manual_seed(7)
    x, gw, bias = torch.randn(5, 16, generator=g), torch.randn(40, 16, generator=g), torch.randn(40, generator=g) * .1
    for groups, topk_group, renorm in ((1, 1, False), (4, 4, True), (4, 6, False)):
        ids, w = moe_k.route(x.to(DEV), gw.to(DEV), bias.to(DEV), top_k=5, num_expert_group=groups,
                             topk_group=topk_group, routed_scaling_factor=1.5, renormalize=renorm)
        rids, rw = moe_ref_mod.route(x, gw, bias, top_k=5, num_expert_group=groups, topk_group=topk_group,
                                     renormalize=renorm, scaling=1.5)
        assert torch.equal(ids.cpu().long(), rids) and torch.allclose(w.cpu(), rw, atol=1e-6)
    ids, w = moe_k.route_topk(torch.zeros(0, 40, device=DEV), bias.to(DEV), top_k=5, num_expert_group=4,
                              topk_group=2)
    assert ids.shape == (0, 5) and w.shape == (0, 5)
    z = torch.randn(2, 40, generator=g)
    z[1, [3, 17]] = float("nan")
    ids, _ = moe_k.route_topk(z.to(DEV), bias.to(DEV), top_k=5)
    ids = ids.cpu()
    assert set(ids[1, :2].tolist()) == {3, 17} and int(ids.max()) < 40 and len(set(ids[1].tolist())) == 5


def test_router_errors_name_the_field():
    z, bias = torch.zeros(2, 24, device=DEV), torch.zeros(24, device=DEV)
    with pytest.raises(ValueError, match="num_expert_group=5 must divide the 24 experts"):
        moe_k.route_topk(z, bias, top_k=4, num_expert_group=5, topk_group=2)
    with pytest.raises(ValueError, match="top_k=8 exceeds the experts that compete"):
        moe_k.route_topk(z, bias, top_k=8, num_expert_group=6, topk_group=1)
    with pytest.raises(ValueError, match="num_expert_group=24 must divide the 24 experts into groups of at least 2"):
        moe_k.route_topk(z, bias, top_k=2, num_expert_group=24, topk_group=2)


def test_kda_decode_default_tile_rule():
    """`_decode_block_v`: 16 up to 48 (token, head) items, 32 up to 1024, 64 above; a head dim below 128 keeps the
    whole tile (no counter scratch); the workspace bytes at a batch bound every smaller batch's."""
    assert [kda_k._decode_block_v(n, 128) for n in (1, 12, 48, 49, 96, 192, 1024, 1025, 6144)] == \
        [16, 16, 16, 32, 32, 32, 32, 64, 64]
    assert kda_k._decode_block_v(96, 64) == 64 and kda_k._decode_block_v(96, 16) == 16
    assert kda_k.kda_decode_workspace_bytes(300, 12, 64) == 0
    for H in (12, 96):
        for B in (1, 4, 5, 85, 86, 300):
            need = max(kda_k.kda_decode_workspace_bytes(b, H, 128) for b in range(1, B + 1))
            assert kda_k.kda_decode_workspace_bytes(B, H, 128) >= need > 0
