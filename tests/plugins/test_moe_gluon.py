"""The Gluon MXFP4 MoE GEMMs (plugins/moe/kernels_gluon.py: what `mxfp4_moe` runs for decode-sized batches on sm_90+).

GPU: against the MoE reference (plugins/moe/reference.py) with poisoned margins around every tensor, several token
tiles per expert, experts on other EP ranks, factors above 2^1 (the two-multiply branch), every token tile and K tile
the tile rules pick. CPU (CI): the Triton interpreter cannot run Gluon, so the kernels are compiled for sm_90 offline
(every register re-layout is asserted trivial at compile time), and the host-side column order and tile rules are
checked against the kernels' operand order; shape errors name the fix."""
import os

import pytest
import torch

from kernel_checks import DEV, Guarded, check_e2m1_decode, compile_in_subprocess, relerr
from k3deploy.plugins.moe import reference as moe_ref

try:
    from k3deploy.plugins.moe import kernels_gluon as kg
except ImportError as e:     # a Triton without Gluon
    kg, GLUON_ERR = None, repr(e)
need_gluon = pytest.mark.skipif(kg is None, reason="this Triton has no Gluon (triton.experimental.gluon)")
compiled = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                              reason="Gluon kernels run compiled only (the Triton interpreter cannot run Gluon)")


def moe_k():
    from k3deploy.plugins.moe import kernels
    return kernels


@pytest.fixture
def gluon_gemms(monkeypatch):
    """`mxfp4_moe` on the Gluon kernels whatever the batch (`_pick_impl` forced; the kernels still choose their
    tiles from the shapes)."""
    monkeypatch.setattr(moe_k(), "_pick_impl", lambda *a: "gluon")


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
@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("E,RL,I,T,k", [
    (8, 256, 256, 9, 4),        # 5 pairs per expert: 8-token tiles; 256 columns per copy
    (4, 512, 128, 30, 3),       # 23: 32-token tiles; I = 128: 128 columns per copy
    (6, 256, 384, 13, 5),       # 11: 16-token tiles; I = 384: 128 columns
    (5, 384, 256, 7, 2),        # 3: 8-token tiles; Rl = 384: 128 columns
    (6, 512, 256, 11, 4),       # 8: 8-token tiles, 256 columns
    (4, 256, 512, 30, 3),       # 23: 32-token tiles, 256 columns
    (3, 256, 128, 20, 2),       # 14: 32-token tiles, some split to 8 / 16 tokens
    (4, 512, 256, 50, 3),       # 38: two 32-token tiles per expert
    (3, 1152, 1152, 12, 2),     # 36 E8M0 groups per row: the scale scan's second, partial load (fold test below)
    (6, 256, 256, 40, 4),       # 27: 32-token tiles
])
def test_gluon_moe_matches_reference(E, RL, I, T, k, gluon_gemms, monkeypatch):
    """Against the reference and the Triton kernels, with poisoned margins and a workspace of
    `mxfp4_moe_workspace_bytes`; the tiles are the rules' (`resolve_tiles`) for each shape."""
    (x, ids, w, w13p, w13s, w2p, w2s), off = _problem(E, RL, I, T, k)
    r = moe_ref.mxfp4_moe(x.float(), ids, w, w13p, w13s, w2p, w2s, expert_offset=off)
    G = Guarded()
    nbytes = moe_k().mxfp4_moe_workspace_bytes(T, k, E, I, RL, device=DEV)     # poisoned margins around it too
    y = moe_k().mxfp4_moe(*(G(a.to(DEV)) for a in (x, ids, w, w13p, w13s, w2p, w2s)), expert_offset=off,
                          out=G.empty(T, RL, dtype=torch.float32),
                          workspace=G(torch.zeros(nbytes, dtype=torch.uint8, device=DEV)))
    G.check()
    assert relerr(y, r) < 1e-2        # h is rounded to bf16 between the GEMMs, as in the other kernels
    mk = moe_k()
    monkeypatch.setattr(mk, "_pick_impl", lambda *a: "legacy")
    legacy = mk.mxfp4_moe(*(a.to(DEV) for a in (x, ids, w, w13p, w13s, w2p, w2s)), expert_offset=off)
    assert relerr(y, legacy) < 1e-2


# pairs per local expert (one per token, each token's second choice on another EP rank): every token-tile width and
# split the kernels take, at and around the 8 / 16 / 32 boundaries and over several tiles
TILE_COUNTS = [0, 1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 48, 49, 64, 65]


@need_gluon
@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("block_m", [32, 16, 8])
def test_gluon_moe_every_tile_width(block_m, gluon_gemms, monkeypatch):
    """Experts with 0 .. 65 pairs (TILE_COUNTS) under each token tile (`_token_tile` forced; 16 and 32 with their
    splits to 8 / 16 tokens): every pair row equals the reference (per row, so a pair computed twice or never cannot
    hide in a norm), with the workspace filled with 0xFF bytes (NaN in h and the pair outputs: a row never written
    shows) and poisoned margins around every tensor."""
    monkeypatch.setattr(kg, "_token_tile", lambda pairs_per_expert: block_m)
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
                          out=G.empty(T, RL, dtype=torch.float32),
                          workspace=G(torch.full((nbytes,), 255, dtype=torch.uint8, device=DEV)))
    G.check()
    y = y.double().cpu()
    assert torch.isfinite(y).all()
    assert float(((y - r).norm(dim=1) / r.norm(dim=1)).max()) < 1e-2


@need_gluon
@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("RL,I,group", [(256, 128, 1), (1152, 1152, 35)])
def test_gluon_moe_factors_above_two(RL, I, group, gluon_gemms):
    """An expert whose factors exceed 2^1 takes the two-multiply decode (checked per program, by a scan of all the
    program's E8M0 groups: at width 1152 the large factor of w13 sits in group 35, in the scan's second, partial
    load); it and the others equal the reference."""
    (x, ids, w, w13p, w13s, w2p, w2s), off = _problem(4, RL, I, 12, 3, seed=9, hi_scale_expert=1, hi_group=group)
    off = 0
    ids = ids % 4
    r = moe_ref.mxfp4_moe(x.float(), ids, w, w13p, w13s, w2p, w2s, expert_offset=off)
    y = moe_k().mxfp4_moe(*(a.to(DEV) for a in (x, ids, w, w13p, w13s, w2p, w2s))).cpu()
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
    with pytest.raises(ValueError, match="multiples of 128; mxfp4_moe runs the legacy Triton kernels"):
        kg.check_shapes(64, 64)                    # k3-tiny
    with pytest.raises(ValueError, match="expert width 320 must be multiples of 128"):
        kg.check_shapes(256, 320)
    kg.check_shapes(3584, 3072)                    # k3 per-rank shapes
    with pytest.raises(ValueError, match="multiple of 128"):
        kg.permute_columns(torch.zeros(2, 96))
    with pytest.raises(ValueError, match="block_n=96 must be a multiple of 16 x num_warps = 64"):
        kg.layouts(96, 4)


@need_gluon
@pytest.mark.parametrize("sub,bm", [(2, 16), (2, 8), (2, 32), (1, 16)])
# the tiles the rules pick: 256 columns per copy with 16-, 8- and 32-token tiles (each with its register cap), and
# 128 columns (widths that 256 does not divide)
@pytest.mark.parametrize("kernel,sig", [
    ("moe_w13_kernel", {"x_ptr": "*bf16", "tok_ptr": "*i32", "offs_ptr": "*i32", "w_ptr": "*i16", "s_ptr": "*u8",
                        "h_ptr": "*bf16", "beta": "fp32", "lbeta": "fp32"}),
    ("moe_w2_kernel", {"h_ptr": "*bf16", "pair_ptr": "*i32", "wts_ptr": "*fp32", "offs_ptr": "*i32",
                       "w_ptr": "*i16", "s_ptr": "*u8", "y_ptr": "*fp32"}),
])
def test_gluon_kernels_compile_for_sm90(kernel, sig, sub, bm):
    """Both kernels compile for sm_90 without a GPU (ptxas included): the decode's inline PTX assembles and every
    reshape / permute / split that forms the mma.sync operands is a register renaming (`assert_trivial=True`
    raises otherwise). Shared memory: the ring of weight words and activation tiles (stages x sub x (rows x 64
    bytes + tokens x 256 bytes)) and the scale scan's reduction scratch (<= 2 KB, live beside the ring: the first
    copies are in flight during the scan), nothing for the operands. In a
    subprocess: a kernel run under TRITON_INTERPRET=1 earlier in this process leaves triton.language patched for
    the interpreter."""
    bn, nw, stages = kg.BLOCK_N, kg.NUM_WARPS, kg.STAGES
    tiles = kg.resolve_tiles(3584, 3072 if sub == 2 else 3200, pairs_per_expert={8: 8, 16: 12, 32: 16}[bm])
    assert (tiles["block_m"], tiles["block_k"]) == (bm, 128 * sub)
    maxnreg = tiles["maxnreg"]
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
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": {nw}, "maxnreg": {maxnreg}}})
ptx = k.asm["ptx"]
print(k.metadata.shared, int("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx),
      int("prmt.b32 w" in ptx and "mul.lo.u32 v, v, 0x1040" in ptx))
"""
    shared, has_mma, has_decode = compile_in_subprocess(code)[-1]
    ring = stages * sub * (bn * 64 + bm * 256)
    assert ring <= int(shared) <= ring + 2048 and has_mma == "1" and has_decode == "1"


def test_default_impl_choice(monkeypatch):
    """`mxfp4_moe`'s kernels (`_pick_impl`): the Gluon kernels on a CUDA device for decode-sized batches and the
    widths they take, the legacy kernels otherwise (the CPU, the interpreter, < 64 or > 32 per expert (token,
    choice) pairs, widths that are not multiples of 128)."""
    mk = moe_k()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(mk, "_INTERPRET", False)
    gluon = "gluon" if kg is not None else "legacy"
    assert mk._pick_impl(cuda, 64, 16, 112, 3584, 3072) == gluon          # K3 at TP=8: 9 pairs per expert
    assert mk._pick_impl(cuda, 256, 16, 896, 3584, 3072) == gluon         # EP=8: ~5 pairs per expert
    assert mk._pick_impl(cuda, 256, 16, 112, 3584, 3072) == "legacy"      # 37 pairs: the 64-row token tiles
    assert mk._pick_impl(cuda, 128, 16, 112, 3584, 3072) == gluon         # 18 pairs: 32-token tiles
    assert mk._pick_impl(cuda, 128, 16, 64, 3584, 3072) == gluon          # 32 pairs (k3-slice at TP=1)
    assert mk._pick_impl(cpu, 64, 16, 112, 3584, 3072) == "legacy"
    assert mk._pick_impl(cuda, 2, 16, 112, 3584, 3072) == "legacy"        # 32 pairs: host-bound when eager
    assert mk._pick_impl(cuda, 4, 16, 112, 3584, 3072) == gluon
    assert mk._pick_impl(cuda, 5, 3, 6, 64, 64) == "legacy"               # k3-tiny widths
    assert mk._pick_impl(cuda, 64, 16, 112, 3584, 3200) == gluon          # 128 columns per copy
    assert mk._pick_impl(cuda, 64, 16, 112, 3584, 3136) == "legacy"       # 3136 % 128 != 0
    monkeypatch.setattr(mk, "_INTERPRET", True)
    assert mk._pick_impl(cuda, 64, 16, 112, 3584, 3072) == "legacy"


@need_gluon
def test_resolve_tiles_defaults_and_launch_arguments(monkeypatch):
    """One place picks the Gluon tiles (`resolve_tiles`), and `grouped_gemms` launches both kernels with them
    (kernels replaced by recorders: the launch itself needs a GPU): grids (I / (BN/2), E) and (Rl / BN, E), the
    constexpr tiles and layouts, and the activations copied in the kernels' column order."""
    t = kg.resolve_tiles(3584, 3072, pairs_per_expert=9)
    assert t == dict(block_k=256, block_m=16, maxnreg=128, split_m=True)
    assert not kg.resolve_tiles(3584, 3072, pairs_per_expert=3)["split_m"]       # 8-token tiles: nothing to split
    t32 = kg.resolve_tiles(3584, 3072, pairs_per_expert=16)     # 32-token tiles from 13 pairs per expert
    assert (t32["block_m"], t32["maxnreg"], t32["split_m"]) == (32, 168, True)
    assert kg.resolve_tiles(3584, 3072, pairs_per_expert=12)["block_m"] == 16
    assert kg.resolve_tiles(3584, 3200, pairs_per_expert=1)["block_k"] == 128     # 3200 % 256 != 0
    assert kg.resolve_tiles(3584, 3072, pairs_per_expert=1)["block_m"] == 8
    with pytest.raises(ValueError, match="multiples of 128"):
        kg.resolve_tiles(3584, 3136)
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
                     xperm, situ_beta=4.0, situ_linear_beta=25.0, pairs_per_expert=3)
    (n13, g13, a13, k13), (n2, g2, a2, k2) = launches
    assert (n13, g13, n2, g2) == ("w13", (I // 64, 3), "w2", (RL // 128, 3))
    assert (k13["BM"], k13["BN"], k13["STAGES"], k13["SUB"], k13["NW"], k13["num_warps"]) == (8, 128, 2, 2, 4, 4)
    assert (k13["NG"], k2["NG"], k13["maxnreg"], k2["maxnreg"]) == (RL // 32, I // 32, 128, 128)
    assert (k13["SPLIT_M"], k2["SPLIT_M"]) == (False, False)      # 8-token tiles: nothing to split
    assert k13["LW"] == kg.layouts(128, 4, 8, 2)["LW"] and k2["BN"] == 128
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


@need_gluon
def test_decode_ptx_gives_e2m1_times_the_factor():
    """The shipped decode's PTX (`_dq_asm`, on checkpoint words: code j at bits 4j..4j+3) gives output
    i = (n_i, n_{i+4}) x the E8M0 factor, folded (2^(s-1) factor bits) and not (2^(s-127) after x 2^126), for every
    code in every position (interpreted: kernel_checks.run_decode_ptx)."""
    check_e2m1_decode(kg._dq_asm, lambda codes: sum(c << 4 * j for j, c in enumerate(codes)))
