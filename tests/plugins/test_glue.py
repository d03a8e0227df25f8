"""The glue kernels (plugins/glue/kernels.py) vs their fp32 definitions (plugins/glue/reference.py). CPU:
TRITON_INTERPRET=1 with small shapes; GPU: K3's widths (d = 7168, 8 bank rows, MLA 1536 / 512 / 64, 12 and 96
heads, latent 3584, shared width 768 and 6144), bf16 activations. Every tensor sits in poisoned memory (`Guarded`):
an out-of-bounds read gives NaN, an out-of-bounds write fails `check()`; unused bank rows are NaN and must stay so.
fp32 activations match the reference to summation order (< 1e-5); bf16 ones within bf16 rounding (< 1.5e-2)."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the first triton import

from k3deploy.plugins.glue import kernels as gk            # noqa: E402
from k3deploy.plugins.glue import reference as gref        # noqa: E402
from kernel_checks import Guarded, relerr                  # noqa: E402  (tests/kernel_checks.py)

DEV = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def _rand(g, *shape, scale=1.0, mean=0.0):
    return torch.randn(*shape, generator=g) * scale + mean


# ------------------------------------------------------------------------------------------------ AttnRes + norm
# (name, P holds the block sum, pending add, store, rows): the five uses in a decoder layer and the head
MODES = [("attn", True, True, "P", False), ("commit", True, True, "bank", False), ("layer0", True, False, "bank", False),
         ("after-commit", False, True, "P", False), ("head", True, True, None, True)]


def _attn_res_case(T, D, nb, act, mode, seed=0):
    name, p_in, has_add, store, use_rows = mode
    g = torch.Generator().manual_seed(seed)
    NBMAX = nb + 2                                            # one spare row past the commit row: must stay NaN
    P = _rand(g, T, D).to(act)
    add = _rand(g, T, D, scale=0.5).to(act) if has_add else None
    bank = torch.full((T, NBMAX, D), float("nan"), dtype=act)
    bank[:, :nb] = (_rand(g, T, nb, D) * torch.rand(T, nb, 1, generator=g) * 3).to(act)   # rows of different norms
    q = _rand(g, D, scale=D ** -0.5 * 4)                     # O(1)-O(4) scores: a non-uniform softmax
    w = _rand(g, D, scale=0.02, mean=1.0).to(act)
    rows = torch.tensor([T - 1, 0] if T > 1 else [0], dtype=torch.long) if use_rows else None
    return P, add, bank, q, w, rows, (p_in, store)


def _check_attn_res(T, D, nb, act, mode):
    P, add, bank, q, w, rows, (p_in, store) = _attn_res_case(T, D, nb, act, mode, seed=T + D + nb)
    y_ref, Pn_ref = gref.attn_res_norm(P if p_in else None, add, bank[:, :nb], q, w.float(), 1e-5, rows)
    G = Guarded()
    Pd, bd = G(P.to(DEV)), G(bank.to(DEV))
    ad = G(add.to(DEV)) if add is not None else None
    y = gk.attn_res_norm(Pd, ad, bd, nb, G(q.to(DEV)), G(w.to(DEV)), 1e-5, restart=not p_in, store=store,
                         rows=G(rows.to(DEV)) if rows is not None else None, out=G.empty(*y_ref.shape, dtype=act))
    G.check()
    tol = TOL[act]
    assert relerr(y, y_ref) < tol, (mode, relerr(y, y_ref))
    if store == "P":
        assert relerr(Pd, Pn_ref) < tol
    else:
        assert torch.equal(Pd.cpu(), P)                       # P untouched
    if store == "bank":
        assert relerr(bd[:, nb], Pn_ref) < tol
    else:
        assert torch.isnan(bd[:, nb].float()).all()
    assert torch.isnan(bd[:, nb + 1:].float()).all() and torch.equal(bd[:, :nb].cpu(), bank[:, :nb])


@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("T,D,nb,act", [(3, 200, 2, torch.float32), (2, 2500, 3, torch.float32),
                                        (3, 200, 0, torch.bfloat16), (2, 300, 4, torch.bfloat16)])
def test_attn_res_norm(T, D, nb, act, mode):
    """Every use of the fused read (attention side, commit, layer 0 = identity read of the embedding, the MLP side
    after a commit, the head with selected rows); D = 2500 takes two column tiles."""
    if mode[0] == "layer0" and nb:
        pytest.skip("layer 0 has no bank rows")
    _check_attn_res(T, D, nb, act, mode)


@gpu
@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("T,nb", [(1, 0), (1, 8), (64, 7), (257, 3)])
def test_attn_res_norm_k3_width(T, nb, mode):
    """K3's width (7168) and bank depth (8 committed rows, 9 sources), bf16, decode and prefill-sized T."""
    if mode[0] == "layer0" and nb:
        pytest.skip("layer 0 has no bank rows")
    _check_attn_res(T, 7168, nb, torch.bfloat16, mode)


@gpu
def test_attn_res_norm_rounds_like_the_bf16_model():
    """With bf16 activations the kernel rounds where the model's tensors are bf16 (P', the AttnRes output, the
    normalized value before the weight multiply, §2.1): it matches a torch emulation of those roundings far closer
    than the fp32 reference (which it misses by bf16 rounding). GPU only: the Triton interpreter (3.9) converts fp32
    to bf16 by truncation, not round-to-nearest-even."""
    P, add, bank, q, w, _, _ = _attn_res_case(4, 256, 3, torch.bfloat16, MODES[0], seed=5)
    bf = torch.bfloat16
    Pn = (P.float() + add.float()).to(bf)
    h = gref.attn_res_mix(torch.cat([bank[:, :3], Pn[:, None]], 1).float(), q, 1e-5).to(bf).float()
    emu = ((h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5)).to(bf).float() * w.float()).to(bf)
    y = gk.attn_res_norm(P.clone().to(DEV), add.to(DEV), bank.to(DEV), 3, q.to(DEV), w.to(DEV), 1e-5)
    ref, _ = gref.attn_res_norm(P, add, bank[:, :3], q, w.float(), 1e-5)
    assert relerr(y, emu) < 2e-3 < relerr(y, ref)


def test_attn_res_norm_argument_errors():
    P = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="store"):
        gk.attn_res_norm(P, None, P[:, None], 0, P[0], P[0], 1e-5, store="x")
    with pytest.raises(ValueError, match="store=None"):
        gk.attn_res_norm(P, None, P[:, None], 0, P[0], P[0], 1e-5, rows=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="restart"):
        gk.attn_res_norm(P, None, P[:, None], 0, P[0], P[0], 1e-5, restart=True)
    with pytest.raises(ValueError, match="both None"):
        gref.attn_res_norm(None, None, P[:, None], P[0], P[0], 1e-5)


# ------------------------------------------------------------------------------------------------ MLA LoRA norms
def _check_lora(T, QR, KR, DR, act, extra=40):
    g = torch.Generator().manual_seed(QR + T)
    y = (_rand(g, T, QR + KR + DR + extra) * 3).to(act)        # + the g_proj columns that share the GEMM output
    qw, kw = _rand(g, QR, scale=0.02, mean=1.0).to(act), _rand(g, KR, scale=0.02, mean=1.0).to(act)
    cq_ref, lat_ref = gref.lora_norms(y, qw.float(), kw.float(), 1e-6, QR, KR, DR)
    G = Guarded()
    cq, lat = gk.lora_norms(G(y.to(DEV)), G(qw.to(DEV)), G(kw.to(DEV)), 1e-6, QR, KR, DR)
    G.check()
    assert cq.dtype == lat.dtype == act and cq.is_contiguous() and lat.shape == (T, KR + DR)
    assert relerr(cq, cq_ref) < TOL[act] and relerr(lat, lat_ref) < TOL[act]
    assert torch.equal(lat[:, KR:].cpu(), y[:, QR + KR: QR + KR + DR])          # k_pe copied raw


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_lora_norms(act):
    _check_lora(3, 96, 64, 16, act)


@gpu
@pytest.mark.parametrize("T", [1, 64, 300])
def test_lora_norms_k3_width(T):
    _check_lora(T, 1536, 512, 64, torch.bfloat16, extra=1536)


# ------------------------------------------------------------------------------------------------ MLA output
def _check_mla_out(T, H, R, Dn, Dv, act, w_dtype):
    g = torch.Generator().manual_seed(T * H)
    ol = _rand(g, T, H, R).to(act)
    kv_b = _rand(g, H * (Dn + Dv), R, scale=R ** -0.5).to(w_dtype)
    gate = (_rand(g, T, H * Dv + 8) * 2).to(act)[:, 8:]        # a strided view, as the GEMM output slice is
    ref = gref.mla_out(ol, kv_b, gate, Dn)
    G = Guarded()
    out = gk.mla_out(G(ol.to(DEV)), G(kv_b.to(DEV)), gate.to(DEV), Dn)
    G.check()
    assert out.dtype == act and out.shape == (T, H * Dv)
    exact = act == w_dtype == torch.float32 and not HAS_CUDA        # fp32 tl.dot runs TF32 on the GPU
    assert relerr(out, ref) < (1e-5 if exact else 1e-2), relerr(out, ref)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_mla_out(T):
    _check_mla_out(T, 4, 64, 32, 64, torch.float32, torch.float32)


def test_mla_out_bf16_activations_fp32_weights():
    """bf16 latents and gate with the fp32 kv_b the interpreter needs (its 16-bit tl.dot is wrong)."""
    _check_mla_out(6, 3, 64, 32, 64, torch.bfloat16, torch.float32)


@gpu
@pytest.mark.parametrize("T,H", [(1, 12), (64, 12), (16, 96), (100, 12)])
def test_mla_out_k3_width(T, H):
    _check_mla_out(T, H, 512, 128, 128, torch.bfloat16, torch.bfloat16)


# ------------------------------------------------------------------------------------------------ MoE output rows
def _check_moe_rows(T, RL, inter, act, yl_on=True, norm_on=True, shared_on=True, lb=25.0):
    g = torch.Generator().manual_seed(RL + inter + T)
    yl = _rand(g, T, RL, scale=2.0) if yl_on else None          # fp32: the MoE op's combine output
    nw = _rand(g, RL, scale=0.02, mean=1.0).to(act) if yl_on and norm_on else None
    gu = (_rand(g, T, 24 + 2 * inter) * 4).to(act) if shared_on else None      # [.. ‖ gate ‖ up] GEMM output
    ref = gref.moe_out_rows(yl.to(act) if yl_on else None, nw.float() if nw is not None else None,
                            gu[:, 24:24 + inter] if shared_on else None, gu[:, 24 + inter:] if shared_on else None,
                            1e-5, 4.0, lb)
    G = Guarded()
    out = gk.moe_out_rows(G(yl.to(DEV)) if yl_on else None, G(nw.to(DEV)) if nw is not None else None,
                          G(gu.to(DEV)) if shared_on else None, inter, 1e-5, 4.0, lb, gate_col=24,
                          out_dtype=act)
    G.check()
    assert out.dtype == act and out.shape == ref.shape
    assert relerr(out, ref) < TOL[act], relerr(out, ref)


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", ["latent+shared", "latent", "shared", "no-norm", "raw-up"])
def test_moe_out_rows(act, parts):
    """The latent norm and the shared SiTU side by side (the latent MoE), either alone (no shared experts; the
    dense MLP's SiTU), without the latent norm, and with the up branch raw (activation_situ_linear_beta null)."""
    _check_moe_rows(3, 128, 64, act, yl_on=parts != "shared", norm_on=parts != "no-norm",
                    shared_on=parts not in ("latent", "no-norm"), lb=None if parts == "raw-up" else 25.0)


def test_moe_out_rows_needs_an_input():
    with pytest.raises(ValueError, match="nothing to compute"):
        gk.moe_out_rows(None, None, None, 0, 1e-5, 4.0, 25.0)


@gpu
@pytest.mark.parametrize("T,RL,inter", [(1, 3584, 768), (64, 3584, 768), (16, 3584, 6144), (8, 0, 4224)])
def test_moe_out_rows_k3_width(T, RL, inter):
    """K3 per TP=8 rank (shared 768), TP=1 (6144), the dense MLP's SiTU at TP=8 (4224, no latent)."""
    _check_moe_rows(T, RL or 8, inter, torch.bfloat16, yl_on=RL > 0)


# ------------------------------------------------------------------------------------------------ greedy pick
def _greedy_case(V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, V, generator=g)
    x[1, [V // 3, V - 1]] = x[1].max() + 1          # a tie in two parts: the lower column wins
    x[2, 7] = float("nan")
    x[3, V // 2] = float("inf")
    x[4, 0] = float("-inf")                          # one -inf: not finite
    x[5] = float("-inf")                             # all -inf: argmax 0, not finite
    x[6, :] = -5.0                                   # constant row: column 0
    x[7, V - 1] = x[7].max() + 1                     # the last column (past the last full block)
    return x.to(dtype)


@pytest.mark.parametrize("programs", [gk.GREEDY_PROGRAMS, 8], ids=["parts", "one-part"])
@pytest.mark.parametrize("V,dtype", [(5000, torch.float32), (300, torch.float32), (9000, torch.bfloat16)])
def test_greedy_pick(V, dtype, programs, monkeypatch):
    """ids = torch.argmax (lowest column on ties: within a part's lanes, across lanes and across parts), checked =
    ids or -1 for rows holding a NaN or an infinity, as the pipeline's torch ops decide; several parts per row, or
    one part of several loads."""
    monkeypatch.setattr(gk, "GREEDY_PROGRAMS", programs)
    x = _greedy_case(V, dtype, seed=V)
    G = Guarded()
    ids, checked = G.empty(8, dtype=torch.long), G.empty(8, dtype=torch.long)
    gk.greedy_pick(G(x.to(DEV)), ids, checked)
    G.check()
    want = torch.argmax(x.float(), -1)
    finite = torch.isfinite(x.float()).all(-1)
    assert torch.equal(checked.cpu(), torch.where(finite, want, -1)), (checked, want, finite)
    real = ~torch.isnan(x.float()).any(-1)           # torch.argmax picks a NaN; the kernel the largest number
    assert torch.equal(ids.cpu()[real], want[real]) and bool(((ids >= 0) & (ids < V)).all())
    assert checked[1] == V // 3 and checked[6] == 0 and checked[7] == V - 1 and ids[5] == 0


# ------------------------------------------------------------------------------------------------ sm_90 compiles
_COMPILE = r'''
import os, re, subprocess, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3deploy.plugins.glue import kernels as gk

def build(fn, const, ptr_types, nw):
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else ptr_types.get(n, "*bf16") if n.endswith("_ptr") else
           "fp32" if n in ("eps", "beta", "lbeta") else "i32" for n in names}
    # pointers 16-byte aligned, and the int arguments that are multiples of 16 at K3's widths (row strides, column
    # offsets, D = 7168) specialized as Triton does at launch
    aligned = [n for n in names if sig[n].startswith("*") or n.startswith("stride") or n.endswith("_off") or n == "D"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": 3})
    print(fn.__name__, k.metadata.shared, int(".local" in k.asm["ptx"]), int("ld.global.v4" in k.asm["ptx"] or
          "ld.global.nc.v4" in k.asm["ptx"]), spill_bytes(k.asm["ptx"]))

def spill_bytes(ptx):
    # register spills are ptxas's decision: its verbose report of the PTX Triton hands it
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")], capture_output=True,
                           text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr))

f32 = {"q_ptr": "*fp32", "w_ptr": "*fp32", "rows_ptr": "*i64"}
for nb, p_in, add, p_out, rows in ((0, 1, 0, 2, 0), (3, 1, 1, 1, 0), (4, 1, 1, 2, 0), (8, 1, 1, 1, 0), (7, 0, 1, 0, 1)):
    rb, bd, warps = gk.attn_res_tiles(7168, nb)
    build(gk._attn_res_norm_kernel, dict(NB=nb, RB=rb, P_IN=p_in, ADD=add, P_OUT=p_out, ROWS=rows, BD=bd), f32,
          warps)
build(gk._lora_norms_kernel, dict(QR=1536, KR=512, DR=64, BQ=2048, BK=512, BR=64), {"qw_ptr": "*fp32", "kvw_ptr": "*fp32"}, 8)
build(gk._mla_out_kernel, dict(DN=128, DV=128, R=512, BT=64, BK=64, BD=64, CDT=tl.bfloat16), {}, 4)
for inter, has_yl in ((768, 1), (4224, 0)):
    build(gk._moe_out_rows_kernel, dict(RL=3584 if has_yl else 0, I=inter, HAS_YL=has_yl, NORM=1, LB=1, BR=4096,
          BI=min(2048, triton.next_power_of_2(inter))), {"yl_ptr": "*fp32", "nw_ptr": "*fp32"}, 8)
'''


def test_glue_kernels_compile_for_sm90():
    """Every glue kernel compiles for sm_90 (no GPU needed; Triton of this machine) at K3's widths and bank depths
    with its wrapper's launch settings: within the 227 KiB of shared memory, no local-memory arrays in the PTX, the
    row kernels' loads vectorized to 16 bytes, and the AttnRes kernel (a whole 7168-wide row in registers) without
    register spills."""
    from kernel_checks import compile_in_subprocess
    out = compile_in_subprocess(_COMPILE)
    assert len(out) == 9, out
    for name, shared, local, vec, spills in out:
        assert int(shared) <= 232448 and local == "0", (name, shared, local)
        assert spills == "0" or name != "_attn_res_norm_kernel", (name, spills, "bytes of register spills")
        assert vec == "1" or name == "_mla_out_kernel", (name, "no 16-byte loads")
