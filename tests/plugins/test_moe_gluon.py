"""The Gluon MXFP4 MoE GEMMs (plugins/moe/kernels_gluon.py, `mxfp4_moe(impl="gluon")`).

GPU: against the MoE reference (plugins/moe/reference.py) with poisoned margins around every tensor, several token
tiles per expert, experts on other EP ranks, factors above 2^1 (the two-multiply branch) and every tile / warp
choice the benchmark times. CPU (CI): the Triton interpreter cannot run Gluon, so the kernels are compiled for sm_90
offline (every register re-layout is asserted trivial at compile time), and the host-side column order is checked
against the kernels' operand order; shape errors name the fix."""
import os

import pytest
import torch

from kernel_checks import DEV, Guarded, compile_in_subprocess, relerr
from k3deploy.plugins.moe import reference as moe_ref

HAS_CUDA = torch.cuda.is_available()
try:
    from k3deploy.plugins.moe import kernels_gluon as kg
except ImportError as e:     # a Triton without Gluon
    kg, GLUON_ERR = None, repr(e)
need_gluon = pytest.mark.skipif(kg is None, reason="this Triton has no Gluon (triton.experimental.gluon)")
gpu_only = pytest.mark.skipif(not HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1",
                              reason="Gluon kernels run on a CUDA GPU only (the Triton interpreter cannot run Gluon)")


def _problem(E, RL, I, T, k, seed=3, hi_scale_expert=None, hi_group=1):
    g = torch.Generator().manual_seed(seed)
    w13p = torch.randint(0, 256, (E, 2 * I, RL // 2), dtype=torch.uint8, generator=g)
    w13s = torch.randint(118, 127, (E, 2 * I, RL // 32), dtype=torch.uint8, generator=g)
    w2p = torch.randint(0, 256, (E, RL, I // 2), dtype=torch.uint8, generator=g)
    w2s = torch.randint(116, 124, (E, RL, I // 32), dtype=torch.uint8, generator=g)
    if hi_scale_expert is not None:   # factors 2^4 .. 2^12 up: above 2^1, the two-multiply decode
        w13s[hi_scale_expert, 3, hi_group] = 131
        w2s[hi_scale_expert] += 12
    x = torch.randn(T, RL, generator=g).to(torch.bfloat16) * 0.1
    off = 2
    ids = torch.stack([torch.randperm(E + 3, generator=g)[:k] for _ in range(T)]).int()   # some on other ranks
    w = torch.rand(T, k, generator=g)
    return (x, ids, w, w13p, w13s, w2p, w2s), off


@need_gluon
@gpu_only
@pytest.mark.parametrize("E,RL,I,T,k,cfg", [
    (8, 256, 256, 9, 4, {}),                                         # < 16 pairs per expert
    (4, 512, 128, 30, 3, dict(block_n13=128, block_n2=128, num_stages=2)),   # 9-17 pairs: 16- and 32-token tiles
    (6, 256, 384, 13, 5, dict(num_warps=8)),
    (5, 384, 256, 7, 2, dict(block_n13=128, block_n2=128, num_warps=8)),
    (8, 256, 256, 5, 2, dict(block_m=8)),                            # 8-token tiles (T * k / E <= 8: default)
    (6, 512, 256, 11, 4, dict(block_k=256, num_stages=2)),           # 256 columns per copy
    (4, 256, 512, 30, 3, dict(block_k=256, num_warps=8)),
    (3, 256, 128, 20, 2, dict(block_m=8, block_n13=64, block_n2=64)),   # 5-8 pairs: 8-token tiles
    (4, 512, 256, 50, 3, dict(block_k=256, block_m=16)),             # 19-26 pairs: two 16-token tiles
    (6, 512, 512, 11, 4, dict(block_k=512, maxnreg=255)),            # no register cap in effect
    (3, 1152, 1152, 12, 2, {}),      # 36 E8M0 groups per row: the scale scan's second, partial load (fold test below)
    (8, 256, 256, 9, 4, dict(block_m=16)),       # 16-token tiles of <= 8 pairs: computed as 8-token tiles
    (4, 512, 256, 50, 3, dict(block_m=16, SPLIT_M=False)),     # every tile computed as 16 tokens
    (4, 512, 256, 50, 3, dict(block_m=32)),      # 19-26 pairs: one 32-token tile each
    (3, 256, 128, 70, 3, dict(block_m=32, block_n13=64, block_n2=64)),  # 28-41 pairs: 32 + 8 / 16 tokens
    (6, 256, 256, 40, 4, dict(block_m=32, maxnreg=168)),      # 14-22 pairs under a 168-register cap
    (4, 512, 256, 50, 3, dict(block_m=32, SPLIT_M=False)),     # every tile computed as 32 tokens
])
def test_gluon_moe_matches_reference(E, RL, I, T, k, cfg, monkeypatch):
    """Against the reference with poisoned margins; cfg: mxfp4_moe's tiles, and SPLIT_M (upper case: the module
    default of kernels_gluon)."""
    cfg = dict(cfg)
    if "SPLIT_M" in cfg:
        monkeypatch.setattr(kg, "SPLIT_M", cfg.pop("SPLIT_M"))
    (x, ids, w, w13p, w13s, w2p, w2s), off = _problem(E, RL, I, T, k)
    r = moe_ref.mxfp4_moe(x.float(), ids, w, w13p, w13s, w2p, w2s, expert_offset=off)
    G = Guarded()
    nbytes = moe_k().mxfp4_moe_workspace_bytes(T, k, E, I, RL, device=DEV)     # poisoned margins around it too
    y = moe_k().mxfp4_moe(*(G(a.to(DEV)) for a in (x, ids, w, w13p, w13s, w2p, w2s)), expert_offset=off,
                          impl="gluon", out=G.empty(T, RL, dtype=torch.float32),
                          workspace=G(torch.zeros(nbytes, dtype=torch.uint8, device=DEV)), **cfg)
    G.check()
    assert relerr(y, r) < 1e-2        # h is rounded to bf16 between the GEMMs, as in the other kernels
    legacy = moe_k().mxfp4_moe(*(a.to(DEV) for a in (x, ids, w, w13p, w13s, w2p, w2s)), expert_offset=off,
                               impl="legacy")
    assert relerr(y, legacy) < 1e-2


# pairs per local expert (one per token, each token's second choice on another EP rank): every token-tile width and
# split the kernels take, at and around the 8 / 16 / 32 boundaries and over several tiles
TILE_COUNTS = [0, 1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 48, 49, 64, 65]


@need_gluon
@gpu_only
@pytest.mark.parametrize("cfg", [dict(block_m=32), dict(block_m=32, split_m=False), dict(block_m=16),
                                 dict(block_m=16, split_m=False), dict(block_m=8)])
def test_gluon_moe_every_tile_width(cfg):
    """Experts with 0 .. 65 pairs (TILE_COUNTS) under each token tile and split choice: every pair row equals the
    reference (per row, so a pair computed twice or never cannot hide in a norm), with the workspace filled with
    0xFF bytes (NaN in h and the pair outputs: a row never written shows) and poisoned margins around every tensor."""
    E, RL, I = len(TILE_COUNTS), 256, 256
    g = torch.Generator().manual_seed(5)
    w13p = torch.randint(0, 256, (E, 2 * I, RL // 2), dtype=torch.uint8, generator=g)
    w13s = torch.randint(118, 127, (E, 2 * I, RL // 32), dtype=torch.uint8, generator=g)
    w2p = torch.randint(0, 256, (E, RL, I // 2), dtype=torch.uint8, generator=g)
    w2s = torch.randint(116, 124, (E, RL, I // 32), dtype=torch.uint8, generator=g)
    local = torch.repeat_interleave(torch.arange(E), torch.tensor(TILE_COUNTS))
    T = local.numel()
    local = local[torch.randperm(T, generator=g)]
    ids = torch.stack([local, torch.full((T,), E)], 1).int()          # expert E: another rank's
    x = torch.randn(T, RL, generator=g).to(torch.bfloat16) * 0.1
    w = torch.rand(T, 2, generator=g)
    r = moe_ref.mxfp4_moe(x.float(), ids, w, w13p, w13s, w2p, w2s, num_experts=E + 1)
    G = Guarded()
    nbytes = moe_k().mxfp4_moe_workspace_bytes(T, 2, E, I, RL, device=DEV)
    y = moe_k().mxfp4_moe(*(G(a.to(DEV)) for a in (x, ids, w, w13p, w13s, w2p, w2s)), num_experts=E + 1,
                          impl="gluon", out=G.empty(T, RL, dtype=torch.float32),
                          workspace=G(torch.full((nbytes,), 255, dtype=torch.uint8, device=DEV)), **cfg)
    G.check()
    y = y.double().cpu()
    assert torch.isfinite(y).all()
    assert float(((y - r).norm(dim=1) / r.norm(dim=1)).max()) < 1e-2


@need_gluon
@gpu_only
@pytest.mark.parametrize("RL,I,group", [(256, 128, 1), (1152, 1152, 35)])
def test_gluon_moe_factors_above_two(RL, I, group):
    """An expert whose factors exceed 2^1 takes the two-multiply decode (checked per program, by a scan of all the
    program's E8M0 groups: at width 1152 the large factor of w13 sits in group 35, in the scan's second, partial
    load); it and the others equal the reference."""
    (x, ids, w, w13p, w13s, w2p, w2s), off = _problem(4, RL, I, 12, 3, seed=9, hi_scale_expert=1, hi_group=group)
    off = 0
    ids = ids % 4
    r = moe_ref.mxfp4_moe(x.float(), ids, w, w13p, w13s, w2p, w2s, expert_offset=off)
    y = moe_k().mxfp4_moe(*(a.to(DEV) for a in (x, ids, w, w13p, w13s, w2p, w2s)), impl="gluon",
                          block_n13=128, block_n2=128).cpu()
    big = (ids == 1).any(1)
    assert 0 < int(big.sum()) < x.shape[0]
    assert relerr(y[big], r[big]) < 1e-2 and relerr(y[~big], r[~big]) < 1e-2


@need_gluon
def test_permute_columns_pairs_each_column_with_its_weight():
    """`permute_columns` puts activation column c where the kernels' B operand for the weight of column c sits: in
    a 128-column step, thread t (lane % 4) reads positions 32i + 8t + 4m + 2r + l for decode output i, MMA m,
    register r, lane l; the weight there is code n_{i+4l} of the thread's word q = 2m + r, i.e. column
    8 (4t + q) + i + 4l. Every column of the step appears once."""
    cols = torch.arange(256, dtype=torch.float32)[None, :]
    xp = kg.permute_columns(cols)
    seen = set()
    for step in range(2):
        for t in range(4):
            for i in range(4):
                for m in range(2):
                    for r in range(2):
                        for lane in range(2):
                            pos = 128 * step + 32 * i + 8 * t + 4 * m + 2 * r + lane
                            weight_col = 128 * step + 8 * (4 * t + 2 * m + r) + i + 4 * lane
                            assert int(xp[0, pos]) == weight_col
                            seen.add(weight_col)
    assert seen == set(range(256))
    assert xp.dtype == torch.bfloat16


@need_gluon
def test_gluon_shape_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiples of block_k = 128.*impl='legacy'"):
        kg.check_shapes(64, 64, 256, 256)          # k3-tiny
    with pytest.raises(ValueError, match="block_n13 / 2 = 256"):
        kg.check_shapes(256, 384, 512, 256)
    kg.check_shapes(3584, 3072, 256, 256, 256)     # k3 per-rank shapes
    with pytest.raises(ValueError, match="block_k=64 must be 128, 256 or 512"):
        kg.check_shapes(3584, 3072, 256, 256, 64)
    with pytest.raises(ValueError, match="multiple of 128"):
        kg.permute_columns(torch.zeros(2, 96))
    with pytest.raises(ValueError, match="block_n=96 must be a multiple of 16 x num_warps = 64"):
        kg.layouts(96, 4)
    if not HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1":
        (x, ids, w, w13p, w13s, w2p, w2s), off = _problem(2, 128, 128, 3, 2)
        with pytest.raises(ValueError, match="impl='gluon' needs a CUDA device"):
            moe_k().mxfp4_moe(x, ids, w, w13p, w13s, w2p, w2s, impl="gluon")


@need_gluon
@pytest.mark.parametrize("stages,sub,bm,nw,bn", [(2, 2, 16, 4, 128), (2, 2, 8, 4, 128), (4, 1, 16, 4, 256),
                                                 (2, 4, 16, 8, 256), (2, 2, 32, 4, 128)])
# the GPU default (2 slots, 256 columns, 128 rows, 16 or 8 tokens), 128 columns with 4 slots and 256 rows, 512 columns
# with 8 warps, 32-token tiles (resolve_tiles' register cap for each)
@pytest.mark.parametrize("kernel,sig", [
    ("moe_w13_kernel", {"x_ptr": "*bf16", "tok_ptr": "*i32", "offs_ptr": "*i32", "w_ptr": "*i16", "s_ptr": "*u8",
                        "h_ptr": "*bf16", "beta": "fp32", "lbeta": "fp32"}),
    ("moe_w2_kernel", {"h_ptr": "*bf16", "pair_ptr": "*i32", "wts_ptr": "*fp32", "offs_ptr": "*i32",
                       "w_ptr": "*i16", "s_ptr": "*u8", "y_ptr": "*fp32"}),
])
def test_gluon_kernels_compile_for_sm90(kernel, sig, stages, sub, bm, nw, bn):
    """Both kernels compile for sm_90 without a GPU (ptxas included): the decode's inline PTX assembles and every
    reshape / permute / split that forms the mma.sync operands is a register renaming (`assert_trivial=True`
    raises otherwise). Shared memory: the ring of weight words and activation tiles (stages x sub x (rows x 64
    bytes + tokens x 256 bytes)) and the scale scan's reduction scratch (<= 2 KB, live beside the ring: the first
    copies are in flight during the scan), nothing for the operands. In a
    subprocess: a kernel run under TRITON_INTERPRET=1 earlier in this process leaves triton.language patched for
    the interpreter."""
    const = {"BM": bm, "BN": bn, "STAGES": stages, "NG": 112, "SPLIT_M": bm >= 16}
    code = f"""
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from k3deploy.plugins.moe import kernels_gluon as kg
sig, const = {sig!r}, {const!r}
const.update(kg.layouts({bn}, {nw}, {bm}, {sub}))
fn = kg.{kernel}
names = fn.arg_names
full = {{n: "constexpr" if n in const else sig.get(n, "i32") for n in names}}
attrs = {{(names.index(n),): [["tt.divisibility", 16]] for n in names
         if full[n].startswith("*") or n.startswith("stride")}}
src = GluonASTSource(fn=fn, signature=full, constexprs={{(names.index(k),): v for k, v in const.items()}},
                     attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options={{"num_warps": {nw}, "maxnreg": kg.resolve_tiles(4096, 4096, block_n13={bn}, block_n2={bn},
                                                                      block_k={128 * sub}, block_m={bm},
                                                                      num_warps={nw})["maxnreg"]}})
ptx = k.asm["ptx"]
print(k.metadata.shared, int("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx),
      int("prmt.b32 w" in ptx and "mul.lo.u32 v, v, 0x1040" in ptx))
"""
    shared, has_mma, has_decode = compile_in_subprocess(code)[-1]
    ring = stages * sub * (bn * 64 + bm * 256)
    assert ring <= int(shared) <= ring + 2048 and has_mma == "1" and has_decode == "1"


def moe_k():
    from k3deploy.plugins.moe import kernels
    return kernels


def test_default_impl_choice(monkeypatch):
    """`mxfp4_moe` without impl: the Gluon kernels on a CUDA device for decode-sized batches and the widths and tiles
    they take, the legacy kernels otherwise (the CPU, the interpreter, < 64 or > 32 per expert (token, choice)
    pairs, widths that are not multiples of 128, tiles only the legacy kernels take)."""
    mk = moe_k()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(mk, "_INTERPRET", False)
    gluon = "gluon" if kg is not None else "legacy"
    assert mk.pick_impl(cuda, 64, 16, 112, 3584, 3072) == gluon          # K3 at TP=8: 9 pairs per expert
    assert mk.pick_impl(cuda, 256, 16, 896, 3584, 3072) == gluon         # EP=8: ~5 pairs per expert
    assert mk.pick_impl(cuda, 256, 16, 112, 3584, 3072) == "legacy"      # 37 pairs: the 64-row token tiles
    assert mk.pick_impl(cuda, 128, 16, 112, 3584, 3072) == gluon         # 18 pairs: 32-token tiles (run 19)
    assert mk.pick_impl(cuda, 128, 16, 64, 3584, 3072) == gluon          # 32 pairs (k3-slice at TP=1)
    assert mk.pick_impl(cuda, 128, 16, 64, 3584, 3072, num_stages=8) == "legacy"   # 32-token ring above sm_90's smem
    assert mk.pick_impl(cpu, 64, 16, 112, 3584, 3072) == "legacy"
    assert mk.pick_impl(cuda, 2, 16, 112, 3584, 3072) == "legacy"        # 32 pairs: host-bound when eager
    assert mk.pick_impl(cuda, 4, 16, 112, 3584, 3072) == gluon
    assert mk.pick_impl(cuda, 5, 3, 6, 64, 64) == "legacy"               # k3-tiny widths
    assert mk.pick_impl(cuda, 64, 16, 112, 3584, 3072, block_k=64) == "legacy"
    assert mk.pick_impl(cuda, 64, 16, 112, 3584, 3072, block_m=64) == "legacy"
    assert mk.pick_impl(cuda, 64, 16, 112, 3584, 3072, block_n13=96) == "legacy"
    assert mk.pick_impl(cuda, 64, 16, 112, 3584, 3072, num_stages=3) == "legacy"   # the legacy default depth
    assert mk.pick_impl(cuda, 64, 16, 112, 3584, 3072, num_stages=4) == gluon
    assert mk.pick_impl(cuda, 64, 16, 112, 3584, 3072, maxnreg=32) == "legacy"
    monkeypatch.setattr(mk, "_INTERPRET", True)
    assert mk.pick_impl(cuda, 64, 16, 112, 3584, 3072) == "legacy"


def test_mxfp4_moe_refuses_mixed_or_unknown_impl_arguments_before_any_launch(monkeypatch):
    """An unknown impl, or legacy-only knobs with impl='gluon', raise before anything runs (no sort launch)."""
    mk = moe_k()
    (x, ids, w, w13p, w13s, w2p, w2s), off = _problem(2, 128, 128, 3, 2)
    monkeypatch.setattr(mk, "_sort_pairs", lambda *a, **k: pytest.fail("launched before validating"))
    with pytest.raises(ValueError, match="impl='fast' must be 'legacy', 'gluon' or 'dot_scaled'"):
        mk.mxfp4_moe(x, ids, w, w13p, w13s, w2p, w2s, impl="fast")
    if HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="dequant applies to impl='legacy' only"):
            mk.mxfp4_moe(*(a.cuda() for a in (x, ids, w, w13p, w13s, w2p, w2s)), impl="gluon", dequant=2)


def test_ncu_summary_reads_a_real_report():
    """benchmarks/ncu_moe.py --summarize on run 14's Nsight Compute report (boost clocks, T=64): four kernels
    (legacy w13 / w2, Gluon w13 / w2) with duration, DRAM throughput, stall reasons and pipe use."""
    import sys
    from kernel_checks import REPO
    sys.path.insert(0, str(REPO / "benchmarks"))
    import ncu_moe

    recs = ncu_moe.summarize((REPO / "benchmarks/results/h200_run14_g_ncu_T64_real_clocks.txt").read_text())
    assert [r["kernel"] for r in recs] == ["_moe_w13_kernel", "_moe_w2_kernel", "moe_w13_kernel", "moe_w2_kernel"]
    assert recs[2]["Duration"] == 525.28 and recs[2]["DRAM Throughput"] == 53.42
    assert recs[2]["stalls"]["long_scoreboard"] == 1.85 and recs[2]["pipes"]["alu"] == 48.66
    assert recs[0]["grid"] == "(24, 112, 1)x(128, 1, 1)"


@need_gluon
def test_resolve_tiles_defaults_and_launch_arguments(monkeypatch):
    """One place fills in and checks the Gluon tiles (`resolve_tiles`), and `grouped_gemms` launches both kernels
    with them (kernels replaced by recorders: the launch itself needs a GPU): grids (I / (BN/2), E) and (Rl / BN, E),
    the constexpr tiles and layouts, and the activations copied in the kernels' column order."""
    t = kg.resolve_tiles(3584, 3072, pairs_per_expert=9)
    assert t == dict(block_n13=128, block_n2=128, block_k=256, block_m=16, num_warps=4, stages=2, maxnreg=128,
                     split_m=True)
    assert kg.resolve_tiles(3584, 3072, **t) == t                               # the result is a valid argument set
    assert not kg.resolve_tiles(3584, 3072, pairs_per_expert=9, split_m=False)["split_m"]
    assert not kg.resolve_tiles(3584, 3072, pairs_per_expert=3)["split_m"]       # 8-token tiles: nothing to split
    assert kg.resolve_tiles(3584, 3072, block_n13=256)["maxnreg"] == 255       # 64 rows per warp: 128 would spill
    assert kg.resolve_tiles(3584, 3072, block_k=512)["maxnreg"] == 255
    assert kg.resolve_tiles(3584, 3072, block_n13=256, block_n2=256, num_warps=8, pairs_per_expert=9)["maxnreg"] == 128
    t32 = kg.resolve_tiles(3584, 3072, pairs_per_expert=16)     # 32-token tiles from 13 pairs per expert (run 19)
    assert (t32["block_m"], t32["maxnreg"], t32["split_m"]) == (32, 168, True)
    assert kg.resolve_tiles(3584, 3072, pairs_per_expert=12)["block_m"] == 16
    assert kg.resolve_tiles(3584, 3072, block_m=32, block_k=512)["maxnreg"] == 255
    assert kg.resolve_tiles(3584, 3072, block_m=32, block_n13=256, block_n2=256, num_warps=8)["maxnreg"] == 255
    assert kg.ring_bytes(128, 32, 2, 2) == 65536
    with pytest.raises(ValueError, match="needs 262144 bytes of shared memory"):      # sm_90: 232448 per CTA
        kg.resolve_tiles(3584, 3072, block_m=32, stages=8)
    kg.resolve_tiles(3584, 3072, block_m=16, stages=8)                                # 197632 bytes: fits
    assert kg.resolve_tiles(3584, 3200, pairs_per_expert=1)["block_k"] == 128     # 3200 % 256 != 0
    assert kg.resolve_tiles(3584, 3072, pairs_per_expert=1)["block_m"] == 8
    with pytest.raises(ValueError, match="num_stages=3 must be 2, 4 or 8"):
        kg.resolve_tiles(3584, 3072, stages=3)
    with pytest.raises(ValueError, match="maxnreg=32 must be 64 .. 255"):
        kg.resolve_tiles(3584, 3072, maxnreg=32)
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, grid, args, kw))
    monkeypatch.setattr(kg, "moe_w13_kernel", Recorder("w13"))
    monkeypatch.setattr(kg, "moe_w2_kernel", Recorder("w2"))
    (x, ids, w, w13p, w13s, w2p, w2s), _ = _problem(3, 256, 512, 5, 2)
    M, I, RL = 10, 512, 256
    h, ypair = torch.empty(M, I, dtype=torch.bfloat16), torch.empty(M, RL)
    xperm = torch.empty(5, RL, dtype=torch.bfloat16)
    z = torch.zeros(M, dtype=torch.int32)
    kg.grouped_gemms(x, z, z, w.reshape(-1), torch.zeros(4, dtype=torch.int32), w13p, w13s, w2p, w2s, h, ypair,
                     xperm, situ_beta=4.0, situ_linear_beta=25.0, num_warps=8, pairs_per_expert=3)
    (n13, g13, a13, k13), (n2, g2, a2, k2) = launches
    assert (n13, g13, n2, g2) == ("w13", (I // 64, 3), "w2", (RL // 128, 3))
    assert (k13["BM"], k13["BN"], k13["STAGES"], k13["SUB"], k13["NW"], k13["num_warps"]) == (8, 128, 2, 2, 8, 8)
    assert (k13["NG"], k2["NG"], k13["maxnreg"], k2["maxnreg"]) == (RL // 32, I // 32, 128, 128)
    assert (k13["SPLIT_M"], k2["SPLIT_M"]) == (False, False)      # 8-token tiles: nothing to split
    assert k13["LW"] == kg.layouts(128, 8, 8, 2)["LW"] and k2["BN"] == 128
    assert a13[0] is xperm and torch.equal(xperm, kg.permute_columns(x)) and a2[0] is h
    assert a13[3].dtype == torch.int16 and a13[3].shape == (3, 2 * I, RL // 4)
    launches.clear()                # 16-token tiles: the split path is on, with the 8-row activation layout
    kg.grouped_gemms(x, z, z, w.reshape(-1), torch.zeros(4, dtype=torch.int32), w13p, w13s, w2p, w2s, h, ypair,
                     xperm, situ_beta=4.0, situ_linear_beta=25.0, pairs_per_expert=9)
    (_, _, _, k13), (_, _, _, k2) = launches
    assert (k13["BM"], k13["SPLIT_M"], k2["SPLIT_M"]) == (16, True, True)
    assert k13["LXL8"] == kg.layouts(128, 4, 8, 2)["LXL"] != k13["LXL"]
    launches.clear()                # 32-token tiles: split to 8 or 16 tokens, with those activation layouts
    kg.grouped_gemms(x, z, z, w.reshape(-1), torch.zeros(4, dtype=torch.int32), w13p, w13s, w2p, w2s, h, ypair,
                     xperm, situ_beta=4.0, situ_linear_beta=25.0, pairs_per_expert=20)
    (_, _, _, k13), (_, _, _, k2) = launches
    assert (k13["BM"], k13["SPLIT_M"], k2["SPLIT_M"], k13["maxnreg"]) == (32, True, True, 168)
    assert k13["LXL16"] == kg.layouts(128, 4, 16, 2)["LXL"] != k13["LXL"]
    assert k13["LXL8"] == kg.layouts(128, 4, 8, 2)["LXL"]


def _run_decode_ptx(asm: str, word: int, factor_bits: int) -> list[int]:
    """Interpret the integer / bf16x2 PTX of a decode (kernels_gluon._dq_asm, moe_decode_floor.dq_asm14) on one
    32-bit word: mov, and, shl, mul.lo.u32, prmt (mode 0x2301: bytes swapped within each half) and mul.rn.bf16x2
    (products of exact powers of two and E2M1 values: exact in fp32, so rounding never enters). $4 = word,
    $5 = factor bits; returns $0..$3."""
    import re
    import struct

    def bf(b):
        return struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0]

    def to_bf(x):
        b = struct.unpack("<I", struct.pack("<f", x))[0]
        assert b & 0xFFFF == 0, x                 # exactly a bf16
        return b >> 16

    reg = {"$4": word, "$5": factor_bits}
    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), asm
    for stmt in (x.strip() for x in body[1:-1].split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        m = re.fullmatch(r"([a-z][\w.]*)\s+(.*)", stmt, re.S)
        assert m, f"unparsed PTX statement {stmt!r}"
        op, args = m.group(1), [x.strip() for x in m.group(2).split(",")]
        val = [reg[x] if x in reg else int(x, 0) for x in args[1:]]
        if op == "mov.b32":
            r = val[0]
        elif op == "and.b32":
            r = val[0] & val[1]
        elif op == "shl.b32":
            r = val[0] << val[1]
        elif op == "mul.lo.u32":
            r = val[0] * val[1]
        elif op == "prmt.b32":
            assert val[2] == 0x2301, hex(val[2])
            r = ((val[0] & 0x00FF00FF) << 8) | ((val[0] >> 8) & 0x00FF00FF)
        elif op == "mul.rn.bf16x2":
            r = to_bf(bf(val[0]) * bf(val[1])) | to_bf(bf(val[0] >> 16) * bf(val[1] >> 16)) << 16
        else:
            raise AssertionError(f"unexpected PTX {op}")
        reg[args[0]] = r & 0xFFFFFFFF
    return [reg[f"${i}"] for i in range(4)]


@need_gluon
def test_decode_ptx_and_the_relaid_candidate_decode_e2m1(monkeypatch):
    """The shipped decode (checkpoint words: code j at bits 4j..4j+3) and benchmarks/moe_decode_floor.py's `dec14`
    candidate (10 integer instructions per 8 weights instead of 13, on words re-laid by `relay_word`) both give
    output i = (n_i, n_{i+4}) x the E8M0 factor, folded (2^(s-1) factor bits) and not (2^(s-127) after x 2^126);
    and each of the floor script's variants really edits the kernels' source (or it would time the unchanged
    kernels under another name)."""
    import math
    import random
    import struct
    from pathlib import Path
    from kernel_checks import REPO
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import moe_decode_floor as fl

    e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6]

    def val(c):
        return (-1.0 if c & 8 else 1.0) * e2m1[c & 7]

    def bf(b):
        return struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0]
    rnd = random.Random(0)
    src = Path(REPO / "plugins/moe/kernels_gluon.py").read_text()
    for folded in (True, False):
        for trial in range(300):
            codes = [rnd.randrange(16) for _ in range(8)] if trial else list(range(8))
            s = rnd.randrange(100, 129) if folded else rnd.randrange(60, 200)
            fbits = (s * 0x00800080 + (0x3F003F00 if folded else 0)) & 0xFFFFFFFF   # kernels_gluon._scale_bits
            word = sum(c << 4 * j for j, c in enumerate(codes))
            for asm, w in ((kg._dq_asm(folded), word), (fl.dq_asm14(folded), fl.relay_word(codes))):
                out = _run_decode_ptx(asm, w, fbits)
                for i in range(4):
                    for got, c in ((bf(out[i]), codes[i]), (bf(out[i] >> 16), codes[i + 4])):
                        want = val(c) * 2.0 ** (s - 127)
                        assert got == want and math.copysign(1, got) == math.copysign(1, want), (folded, codes, i)
    assert tuple(fl._edits()) == fl.VARIANTS      # the CLI's variant names (checked without Triton) = the edits
    for name, edits in fl._edits().items():      # each edit applies exactly once; a moved decode is one clear error
        assert fl.edit_source(src, edits) != src, name
        with pytest.raises(ValueError, match="occurs 0 times.*update moe_decode_floor._edits"):
            fl.edit_source(src.replace(edits[-1][0], "moved"), edits)
