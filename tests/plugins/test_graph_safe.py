"""CUDA-graph safety of the kernels the TensorRT plugins enqueue: caller workspaces, the graph-safe MLA
prefill, the OpSpec workspace rules, and the ahead-of-time KdaDecode and MlaDecode forms.

CPU (TRITON_INTERPRET=1, tiny shapes): the absorbed varlen MLA prefill kernel equals plugins/mla/reference.py; every
op run with a workspace of exactly ``*_workspace_bytes`` (misaligned base, poisoned contents, guard bytes around it)
equals the run without one and writes nothing outside; workspace rules on symbolic/concrete dims; the AOT module's
pure helpers, their PTX for sm_90 (Triton compiles without a GPU), the MlaDecode entry kernel against the reference,
their tensorrt.plugin glue against a stand-in module.
GPU (skipped without CUDA): each op captured in a ``torch.cuda.CUDAGraph`` with a preallocated workspace (warmed up
eagerly first), replayed on new inputs copied into the captured buffers, equals eager; a capture fails if anything
synchronizes, and the ops other than KdaPrefill (fla allocates internally) must not allocate while captured; the AOT
PTX (KdaDecode, MlaDecode) launched through the CUDA driver with TensorRT's argument convention equals the reference."""
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the first triton import

from k3deploy.plugins import aot_common                       # noqa: E402
from k3deploy.plugins import workspace as wsm                 # noqa: E402
from k3deploy.plugins.kda import kernels as kda_k             # noqa: E402
from k3deploy.plugins.kda import reference as kda_ref         # noqa: E402
from k3deploy.plugins.kda import trt_aot                      # noqa: E402
from k3deploy.plugins.kda.trt import KDA_DECODE, KDA_PREFILL  # noqa: E402
from k3deploy.plugins.mla import kernels as mla_k             # noqa: E402
from k3deploy.plugins.mla import reference as mla_ref         # noqa: E402
from k3deploy.plugins.mla import trt_aot as mla_aot           # noqa: E402
from k3deploy.plugins.mla.trt import MLA_DECODE, MLA_PREFILL  # noqa: E402
from k3deploy.plugins.moe import kernels as moe_k             # noqa: E402
from k3deploy.plugins.moe import reference as moe_ref         # noqa: E402
from k3deploy.plugins.moe import trt_aot as moe_aot           # noqa: E402
from k3deploy.plugins.moe.trt import MXFP4_MOE                # noqa: E402
from k3deploy.plugins.trt_common import ACT, F32, Like, OpSpec, run_kernel, workspace_size  # noqa: E402
from kernel_checks import (DriverKernel, FakeDesc, Guarded, Sym, compile_in_subprocess,  # noqa: E402
                           fake_tensorrt_plugin, nan_equal, relerr)     # (tests/kernel_checks.py)

REPO = Path(__file__).resolve().parents[2]
DEV = "cuda" if HAS_CUDA else "cpu"


# --------------------------------------------------------------------------------------------------- op cases
class Case:
    """One op call on fixed-shape inputs. ``inputs``: name -> tensor (pools included, updated in place by the op);
    ``call(inputs, workspace, out)`` -> tuple of results; ``nbytes``: the op's *_workspace_bytes; ``fresh(seed)``:
    new contents of the same shapes (new metadata too) for graph replays; ``allocates``: the op allocates inside
    (fla) even with a workspace."""

    def __init__(self, name, make, call, nbytes, out_shape, out_dtype, allocates=False, exact=True):
        self.name, self.make, self.call, self.nbytes = name, make, call, nbytes
        self.out_shape, self.out_dtype, self.allocates, self.exact = out_shape, out_dtype, allocates, exact

    def fresh(self, seed):
        return {k: v.to(DEV) for k, v in self.make(seed).items()}

    def new_out(self):
        return torch.empty(self.out_shape, dtype=self.out_dtype, device=DEV)


def _bt(g, N, MB, NB):
    return (torch.randperm(NB - 1, generator=g)[:N * MB].view(N, MB) + 1).int()   # non-contiguous blocks


def mla_decode_case(B=4, H=16, R=64, DR=16, BS=4, MB=6, dt=torch.float32):
    NB = B * MB + 3
    scale = 192 ** -0.5

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        return dict(q_abs=torch.randn(B, H, R + DR, generator=g).to(dt), latent=torch.randn(B, R + DR, generator=g).to(dt),
                    cache=torch.randn(NB, BS, R + DR, generator=g).to(dt), block_tables=_bt(g, B, MB, NB),
                    context_lens=torch.randint(0, MB * BS, (B,), generator=g, dtype=torch.int32))

    def call(x, ws, out):
        o, c = mla_k.mla_decode(x["q_abs"], x["latent"], x["cache"], x["block_tables"], x["context_lens"],
                                num_heads=H, kv_lora_rank=R, scale=scale, out=out, workspace=ws)
        return o, c

    return Case("mla_decode", make, call, mla_k.mla_decode_workspace_bytes(B, H, R, MB, BS), (B, H, R), dt)


def _split(g, T, N):
    cuts = torch.randperm(T - 1, generator=g)[:N - 1] + 1
    return torch.tensor([0] + sorted(cuts.tolist()) + [T], dtype=torch.int32)


def mla_prefill_case(T=13, N=3, H=2, R=32, DR=16, Dn=16, Dv=16, BS=4, MB=8, dt=torch.float32):
    NB = N * MB + 3
    scale = (Dn + DR) ** -0.5

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        cu = _split(g, T, N)
        lens = (cu[1:] - cu[:-1])
        ctx = torch.stack([torch.randint(0, MB * BS - int(n) + 1, (1,), generator=g)[0] for n in lens]).int()
        return dict(q=torch.randn(T, H, Dn + DR, generator=g).to(dt), latent=torch.randn(T, R + DR, generator=g).to(dt),
                    kv_b=(torch.randn(H * (Dn + Dv), R, generator=g) * R ** -0.5).to(dt),
                    cache=torch.randn(NB, BS, R + DR, generator=g).to(dt), block_tables=_bt(g, N, MB, NB),
                    cu_seqlens=cu, context_lens=ctx)

    def call(x, ws, out):
        return mla_k.mla_prefill(x["q"], x["latent"], x["kv_b"], x["cache"], x["block_tables"], x["cu_seqlens"],
                                 x["context_lens"], num_heads=H, qk_nope_head_dim=Dn, v_head_dim=Dv, kv_lora_rank=R,
                                 scale=scale, out=out, graph_safe=True, workspace=ws)

    return Case("mla_prefill", make, call, mla_k.mla_prefill_workspace_bytes(T, H, R, DR, dtype=dt), (T, H * Dv), dt)


def moe_case(E=6, RL=64, I=64, T=5, k=3, off=2):
    def make(seed):
        g = torch.Generator().manual_seed(seed)
        return dict(x=torch.randn(T, RL, generator=g).to(torch.bfloat16),
                    topk_ids=torch.stack([torch.randperm(E + 4, generator=g)[:k] for _ in range(T)]).int(),
                    topk_w=torch.rand(T, k, generator=g),
                    w13_packed=torch.randint(0, 256, (E, 2 * I, RL // 2), dtype=torch.uint8, generator=g),
                    w13_scale=torch.randint(121, 127, (E, 2 * I, RL // 32), dtype=torch.uint8, generator=g),
                    w2_packed=torch.randint(0, 256, (E, RL, I // 2), dtype=torch.uint8, generator=g),
                    w2_scale=torch.randint(118, 124, (E, RL, I // 32), dtype=torch.uint8, generator=g))

    def call(x, ws, out):
        return (moe_k.mxfp4_moe(*x.values(), expert_offset=off, out=out, workspace=ws),)

    return Case("mxfp4_moe", make, call, moe_k.mxfp4_moe_workspace_bytes(T, k, E, I, RL), (T, RL), torch.float32)


def _kda_make(T, H, K, S, act, slots, cu=None):
    def make(seed):
        g = torch.Generator().manual_seed(seed)
        P = H * K
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        d = dict(qkv=r(T, 3 * P).to(act), f=r(T, P).to(act), b=r(T, H).to(act), g=r(T, P).to(act),
                 conv_w=r(3 * P, 4) * 0.5, A_log=r(H) * 0.5, dt_bias=r(P) * 0.3,
                 o_norm_w=torch.rand(K, generator=g) + 0.5, state=r(S, H, K, K) * 0.1, conv=r(S, 3 * P, 3).to(act))
        if cu is not None:
            d["cu_seqlens"] = _split(g, T, cu)
        d["slots"] = torch.tensor(slots, dtype=torch.int32)
        return d
    return make


def kda_prefill_case(T=19, N=3, H=2, K=16, act=torch.float32):
    slots = [5, 1, 3][:N]

    def call(x, ws, out):
        return kda_k.kda_prefill(*x.values(), num_heads=H, head_dim=K, out=out, workspace=ws)

    return Case("kda_prefill", _kda_make(T, H, K, 7, act, slots, cu=N), call,
                kda_k.kda_prefill_workspace_bytes(T, N, H, K, act_dtype=act), (T, H * K), act,
                allocates=kda_k._fla_available(torch.device(DEV)), exact=False)


def kda_decode_case(B=4, H=2, K=16, act=torch.float32, block_v=None):
    """The public entry with its V tile (K = 128: split), or with the V tile `block_v` forced (small K: the split
    kernel at a head width the interpreter runs fast)."""
    slots = [5, 2, 7, 3][:B]

    def call(x, ws, out):
        if block_v is None:
            return kda_k.kda_decode(*x.values(), num_heads=H, head_dim=K, out=out, workspace=ws)
        return kda_k._decode(*x.values(), num_heads=H, head_dim=K, lower_bound=-5.0, norm_eps=1e-5, out=out,
                             workspace=ws, block_v=block_v)

    nbytes = (kda_k.kda_decode_workspace_bytes(B, H, K) if block_v is None else
              wsm.plan_bytes(kda_k._decode_scratch(B, H, K, block_v)))
    return Case("kda_decode", _kda_make(B, H, K, 9, act, slots), call, nbytes, (B, H * K), act)


# mla_decode at BS=16, MB=32: a 512-token table, split in 2 by the default (`_launch_cfg`) on the CPU and the H200
CPU_CASES = [mla_decode_case(), mla_decode_case(BS=16, MB=32), mla_prefill_case(),
             mla_prefill_case(T=21, N=2, H=3), moe_case(), kda_prefill_case(), kda_decode_case(block_v=4)]
GPU_CASES = [mla_decode_case(B=4, H=16, R=512, DR=64, BS=64, MB=8, dt=torch.bfloat16),
             mla_prefill_case(T=37, N=3, H=8, R=512, DR=64, Dn=128, Dv=128, BS=64, MB=4, dt=torch.bfloat16),
             moe_case(E=8, RL=512, I=256, T=9, k=4),           # 36 pairs: the Triton kernels
             moe_case(E=8, RL=512, I=512, T=16, k=4),          # 64 pairs, 8 per expert: the Gluon kernels (sm_90)
             kda_prefill_case(T=75, N=3, H=2, K=64, act=torch.bfloat16),
             kda_prefill_case(T=75, N=1, H=2, K=64, act=torch.bfloat16),   # one sequence: chunk_kda's dense path
             kda_decode_case(B=4, H=4, K=128, act=torch.bfloat16)]


def _clone(x):
    return {k: v.clone() for k, v in x.items()}


# ------------------------------------------------------------------------------------------------ workspace plumbing
def test_workspace_carving_alignment_and_bound():
    items = [((3, 5), torch.float32), ((7,), torch.int32), ((2, 3, 4), torch.bfloat16), ((0,), torch.float32)]
    n = wsm.plan_bytes(items)
    assert n == wsm.WORKSPACE_ALIGN + 256 + 256 + 256 + 0 and wsm.plan_bytes([]) == 0
    base = torch.zeros(n + 4096, dtype=torch.uint8)
    for shift in (0, 1, 3, 255):   # every base alignment fits in plan_bytes
        start = (-base.data_ptr()) % 256 + shift
        ws = wsm.Workspace(base[start:start + n], "cpu", "t")
        assert ws.fits(items)
        ts = [ws.empty(s, d) for s, d in items]
        for t, (s, d) in zip(ts, items):
            assert t.shape == s and t.dtype == d and t.data_ptr() % 256 == 0
        assert ws.used <= n
    small = wsm.Workspace(base[:40], "cpu", "myop")
    assert not small.fits(items)
    with pytest.raises(ValueError, match="myop: workspace of 40 bytes is too small"):
        small.empty((3, 5), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        wsm.Workspace(torch.zeros(4), "cpu")
    alloc = wsm.Workspace(None, "cpu")
    assert not alloc.given and alloc.empty((2, 2), torch.float16).shape == (2, 2) and alloc.fits(items)


@pytest.mark.parametrize("case", CPU_CASES if not HAS_CUDA else GPU_CASES, ids=lambda c: c.name)
def test_workspace_same_result_and_stays_inside(case):
    """Exactly *_workspace_bytes at a misaligned base, filled with 0xFF, guard bytes around it: same results as
    without a workspace (bitwise, except fla's), nothing written outside."""
    x0 = case.fresh(seed=1)
    ref = case.call(_clone(x0), None, case.new_out())
    assert case.nbytes > 0
    guard = 1024
    buf = torch.full((2 * guard + case.nbytes + 8,), 0x5A, dtype=torch.uint8, device=DEV)
    start = guard + 3
    buf[start:start + case.nbytes] = 0xFF
    got = case.call(_clone(x0), buf[start:start + case.nbytes], case.new_out())
    assert (buf[:start] == 0x5A).all() and (buf[start + case.nbytes:] == 0x5A).all(), "wrote outside the workspace"
    for r, o in zip(ref, got):
        if case.exact:
            assert nan_equal(r, o), case.name
        else:
            assert relerr(o, r) < 1e-3, case.name


@pytest.mark.parametrize("H,cap", [(16, None), (96, (9, 0))])
def test_mla_decode_workspace_bytes_bounds_every_smaller_batch(H, cap, monkeypatch):
    """The bound covers every smaller batch and block table, for the 16 x 32 tiles (8 programs per SM, >= 256 tokens
    a split) and sm_90's 64 x 64 ones at 96 heads (whole waves, >= 512 tokens: `_split_policy`), on the CPU's 8 SMs."""
    monkeypatch.setattr(mla_k, "_device_cap", lambda device: cap)
    R, BS = 512, 64
    BH, BN = mla_k._decode_tiles(cap, H, BS)[:2]
    assert (BH, BN) == ((16, 32) if cap is None else (64, 64))
    for MB in (1, 7, 512):
        for batch in (1, 5, 64, 200):
            bound = mla_k.mla_decode_workspace_bytes(batch, H, R, MB, BS, device="cpu")
            for b in range(1, batch + 1):
                for mb in {1, max(1, MB // 2), MB}:
                    _, _, nsplit, _ = mla_k._launch_cfg(b, H, mb * BS, torch.device("cpu"), BN, BH)
                    need = wsm.plan_bytes([((b * H * nsplit, R), torch.float32), ((b * H * nsplit,), torch.float32)])
                    assert need <= bound, (batch, b, MB, mb)


@pytest.mark.parametrize("B,sms,want", [(64, 132, 1), (16, 132, 4), (32, 132, 2), (1, 132, 9), (48, 132, 4),
                                         (64, 8, 1), (3, 8, 4)])
def test_mla_decode_splits_fill_whole_waves(B, sms, want):
    """sm_90's 64 x 64 tiles (one resident program per SM) at 96 heads (2 head groups), 4160-token tables (>= 512
    tokens a split: at most 9): the fewest splits whose (group, split, sequence) programs fill their waves of SMs
    best; B=64 on 132 SMs: 1 split (128 programs, one wave), not 3 (384 programs: 3 waves)."""
    pps, min_tok = mla_k._split_policy(64, 64)
    assert pps == 1
    n = mla_k._num_splits(B, 2, 4160, sms, pps, min_tok)
    fill = lambda k: (2 * B * k) / (-(-2 * B * k // sms) * sms)
    assert n == want and all(fill(k) <= fill(n) for k in range(1, 10)), (n, [fill(k) for k in range(1, 10)])


def test_mla_decode_small_workspace_reduces_splits():
    """A workspace with room for one split's partials only (sized for another GPU): one split, the same result."""
    case = mla_decode_case(BS=16, MB=32)
    BH, BN = mla_k._decode_tiles(mla_k._device_cap(DEV), 16, 16)[:2]
    assert mla_k._launch_cfg(4, 16, 512, torch.device(DEV), BN, BH)[2] > 1      # the default splits this table
    x0 = case.fresh(seed=4)
    ref = case.call(_clone(x0), None, case.new_out())
    one = wsm.plan_bytes([((4 * 16, 64), torch.float32), ((4 * 16,), torch.float32)])
    got = case.call(_clone(x0), torch.zeros(one, dtype=torch.uint8, device=DEV), case.new_out())
    assert relerr(got[0], ref[0]) < (2e-3 if HAS_CUDA else 1e-5) and nan_equal(got[1], ref[1])


# ------------------------------------------------------------------------------------------ graph-safe MLA prefill
@pytest.fixture
def prefill_parts(monkeypatch):
    """force(n): the prefill attention cuts each row tile's keys into n parts (`_prefill_splits` replaced), and the
    workspace bound follows (its cache cleared now and at the end)."""
    def force(n):
        monkeypatch.setattr(mla_k, "_prefill_splits", lambda tiles, sms, capacity: n)
        mla_k._prefill_partials.cache_clear()
    yield force
    mla_k._prefill_partials.cache_clear()


@pytest.fixture
def other_gpus_prefill_tiles(monkeypatch):
    """The attention tiles of GPUs other than sm_90 (32 x 32, mma.sync) on this one (`_prefill_attn_tiles`)."""
    real = mla_k._prefill_attn_tiles
    monkeypatch.setattr(mla_k, "_prefill_attn_tiles", lambda cap_major, itemsize, block_size: real(
        8 if cap_major is not None else None, itemsize, block_size))
    mla_k._prefill_partials.cache_clear()
    yield
    mla_k._prefill_partials.cache_clear()


def _mla_prefill_vs_reference(lens, ctxl, H, R, DR, Dn, Dv, BS, dt, tol, tol_sdpa=None):
    N, T = len(lens), sum(lens)
    MB = max((c + n + BS - 1) // BS for c, n in zip(ctxl, lens)) + 1
    g = torch.Generator().manual_seed(7)
    NB = N * MB + 5
    cache = torch.full((NB, BS, R + DR), float("nan")).to(dt)
    bt = _bt(g, N, MB, NB)
    for n in range(N):
        for p in range(ctxl[n]):
            cache[bt[n, p // BS], p % BS] = torch.randn(R + DR, generator=g).to(dt)
    q = torch.randn(T, H, Dn + DR, generator=g).to(dt)
    lat = torch.randn(T, R + DR, generator=g).to(dt)
    kv_b = (torch.randn(H * (Dn + Dv), R, generator=g) * R ** -0.5).to(dt)
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    ctx = torch.tensor(ctxl, dtype=torch.int32)
    attrs = dict(num_heads=H, qk_nope_head_dim=Dn, v_head_dim=Dv, kv_lora_rank=R, scale=(Dn + DR) ** -0.5)
    ro, rc = mla_ref.mla_prefill(q.float(), lat.float(), kv_b.float(), cache.float(), bt, cu, ctx, **attrs)
    G = Guarded()              # poisoned margins around every tensor of the graph-safe (Triton) path and its scratch
    c = G(cache.to(DEV))
    # workspace and out start as NaN (0xFF bytes): a row never written shows as NaN, not as a small error
    ws = G(torch.full((mla_k.mla_prefill_workspace_bytes(T, H, R, DR, dtype=dt),), 0xFF, dtype=torch.uint8,
                      device=DEV))
    o, c2 = mla_k.mla_prefill(*(G(a.to(DEV)) for a in (q, lat, kv_b)), c, *(G(a.to(DEV)) for a in (bt, cu, ctx)),
                              graph_safe=True, workspace=ws, out=G(torch.full((T, H * Dv), float("nan"), dtype=dt,
                                                                               device=DEV)), **attrs)
    G.check()
    assert not torch.isnan(o).any()
    assert c2.data_ptr() == c.data_ptr()
    assert relerr(o, ro) < tol
    assert nan_equal(c.float(), rc.to(dt).float())
    c = cache.to(DEV)
    o_sdpa, _ = mla_k.mla_prefill(q.to(DEV), lat.to(DEV), kv_b.to(DEV), c, bt.to(DEV), cu.to(DEV), ctx.to(DEV),
                                  graph_safe=False, **attrs)
    assert relerr(o, o_sdpa) < (tol_sdpa or tol)


@pytest.mark.parametrize("lens,ctxl", [([3, 7, 1], [0, 5, 9]), ([13, 2], [6, 0]), ([1], [0]), ([9, 9, 9, 1], [3, 0, 11, 2])])
def test_mla_prefill_graph_safe_matches_reference(lens, ctxl):
    """Several sequences, prefix context in the cache, T*H not a multiple of the row tile (several tiles per
    sequence at BM=16), random (non-contiguous) block tables, NaN outside the written/cached rows."""
    # GPU: fp32 tl.dot runs TF32 (~1e-3) and the SDPA path computes in bf16; the interpreter is exact fp32
    _mla_prefill_vs_reference(lens, ctxl, H=3, R=32, DR=16, Dn=16, Dv=16, BS=16 if HAS_CUDA else 4,
                              dt=torch.float32, tol=2e-3 if HAS_CUDA else 1e-5, tol_sdpa=2e-2 if HAS_CUDA else None)


def _spy_split_grids(monkeypatch) -> list:
    """The launch grids of the split prefill attention kernel from now on (a list that fills as it launches)."""
    grids, real = [], mla_k._mla_prefill_attn_split_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]
    monkeypatch.setattr(mla_k, "_mla_prefill_attn_split_kernel", Spy())
    return grids


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("lens,ctxl", [([3, 7, 1], [0, 21, 9]), ([13, 2], [30, 0]), ([9, 1, 9, 1], [3, 0, 41, 2])])
def test_mla_prefill_split_keys_matches_reference(lens, ctxl, num_splits, monkeypatch, prefill_parts):
    """Each row tile's keys split into parts (one program each, merged by log-sum-exp; the count forced): parts past
    a tile's keys empty (short sequences, 7 parts), rows that see no key of a part (the causal limit inside the
    tile's range), several sequences with and without a cached prefix; poisoned margins and a NaN-filled workspace
    sized by `mla_prefill_workspace_bytes` as above."""
    prefill_parts(num_splits)
    grids = _spy_split_grids(monkeypatch)
    _mla_prefill_vs_reference(lens, ctxl, H=3, R=32, DR=16, Dn=16, Dv=16, BS=16 if HAS_CUDA else 4,
                              dt=torch.float32, tol=2e-3 if HAS_CUDA else 1e-5, tol_sdpa=2e-2 if HAS_CUDA else None)
    assert [g[1] for g in grids] == [num_splits]


def test_mla_prefill_splits_rule():
    """`_prefill_splits`: 1 when the row tiles fill the SMs or the block table is short; otherwise the part count
    with the fewest waves per part (H200: a 256-token chunk after 32K cached tokens at 12 heads = 49 tiles of 64
    rows on 132 SMs -> 8 parts, 392 programs, 3 waves)."""
    rule = mla_k._prefill_splits
    assert rule(132, 132, 1 << 20) == 1 and rule(500, 132, 1 << 20) == 1
    assert rule(49, 132, 33024) == 8
    assert rule(49, 132, 2048) == 2 and rule(49, 132, 1023) == 1           # >= PREFILL_MIN_SPLIT_KEYS keys a part
    assert rule(66, 132, 1 << 20) == 2                                        # 132 programs = one full wave
    assert rule(1, 132, 1 << 20) == mla_k.PREFILL_MAX_SPLITS


@pytest.mark.parametrize("H", [12, 96])
def test_mla_prefill_workspace_bytes_bounds_every_split(H):
    """The workspace bound covers the partials of every smaller prompt in any number of sequences (zero-length ones
    included: more tiles than tokens), on the CPU's parameters (8 SMs, 16-row tiles) through the public function and
    on an H200's (132 SMs, 64-row tiles) through its partials bound (96 heads, 64 tokens in 19 sequences: 114 tiles
    take 8 parts, one sequence's 96 tiles 1)."""
    R, DR = 512, 64
    for T in (1, 11, 64, 256, 700):
        bound = mla_k.mla_prefill_workspace_bytes(T, H, R, DR, device="cpu")
        items = mla_k._prefill_partials(T, H, R, 64, 132)
        h200_rows = items[0][0][0] if items else 0
        for t in range(1, T + 1):
            for sms, bm in ((mla_k.num_sms("cpu"), mla_k._prefill_attn_tiles(None, 2, 64)[0]), (132, 64)):
                for n in range(1, 2 * sms + 2):             # n sequences: up to cdiv(tH, bm) + n - 1 tiles with rows
                    s = mla_k._prefill_splits(-(-t * H // bm) + n - 1, sms, 1 << 20)
                    if s == 1:
                        continue
                    if sms == 132:
                        assert t * H * s <= h200_rows, (T, t, n)
                    else:
                        need = wsm.plan_bytes([((t * H, R + DR), torch.bfloat16), ((t * H, R), torch.bfloat16),
                                               ((t * H * s, R), torch.float32), ((t * H * s,), torch.float32)])
                        assert need <= bound, (T, t, n)


def test_mla_prefill_small_workspace_reduces_splits(monkeypatch, prefill_parts):
    """A workspace without room for all the partials (sized for another GPU) runs fewer parts: as many as fit, 2 of
    4, or 1 for a workspace sized for one part; same result."""
    lens, ctxl = [5, 2], [27, 0]
    BS = 16 if HAS_CUDA else 4
    g = torch.Generator().manual_seed(3)
    H, R, DR, Dn, Dv = 2, 32, 16, 16, 16
    T, N = sum(lens), len(lens)
    MB = max((c + n + BS - 1) // BS for c, n in zip(ctxl, lens)) + 1
    cache = torch.randn(N * MB + 2, BS, R + DR, generator=g)
    bt = _bt(g, N, MB, N * MB + 2)
    q, lat = torch.randn(T, H, Dn + DR, generator=g), torch.randn(T, R + DR, generator=g)
    kv_b = torch.randn(H * (Dn + Dv), R, generator=g) * R ** -0.5
    cu, ctx = torch.tensor([0, 5, 7], dtype=torch.int32), torch.tensor(ctxl, dtype=torch.int32)
    attrs = dict(num_heads=H, qk_nope_head_dim=Dn, v_head_dim=Dv, kv_lora_rank=R, scale=(Dn + DR) ** -0.5)
    args = [a.to(DEV) for a in (q, lat, kv_b)]
    meta = [a.to(DEV) for a in (bt, cu, ctx)]
    prefill_parts(1)
    ref = mla_k.mla_prefill(*args, cache.to(DEV), *meta, graph_safe=True, **attrs)[0]
    grids = _spy_split_grids(monkeypatch)
    sizes = {}
    for n in (1, 2, 4):
        prefill_parts(n)
        sizes[n] = mla_k.mla_prefill_workspace_bytes(T, H, R, DR, dtype=torch.float32, device=DEV)
    assert sizes[1] < sizes[2] < sizes[4]
    for fits, launched in ((1, []), (2, [2])):
        grids.clear()
        got = mla_k.mla_prefill(*args, cache.to(DEV), *meta, graph_safe=True,
                                workspace=torch.zeros(sizes[fits], dtype=torch.uint8, device=DEV), **attrs)[0]
        assert [g[1] for g in grids] == launched
        assert relerr(got, ref) < (2e-3 if HAS_CUDA else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["default", "other GPUs"])
@pytest.mark.parametrize("H", [12, 24, 48, 96])
def test_mla_prefill_graph_safe_gpu_production_heads(H, tiles, request):
    """K3's dims at each heads-per-rank value; the default attention tiles (sm_90: 64 rows x 64 keys on wgmma) and
    the other GPUs' (32 x 32, mma.sync)."""
    if tiles == "other GPUs":
        request.getfixturevalue("other_gpus_prefill_tiles")
    _mla_prefill_vs_reference([37, 1, 90], [70, 0, 130], H=H, R=512, DR=64, Dn=128, Dv=128, BS=64,
                              dt=torch.bfloat16, tol=2e-2, tol_sdpa=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 8])
def test_mla_prefill_graph_safe_gpu_long_context_split(num_splits, monkeypatch, prefill_parts):
    """A 256-token chunk after 4100 cached tokens at 12 heads (K3 at TP=8, the runtime's chunk size): 49 row tiles,
    so the default splits each tile's keys (2 parts on 132 SMs: `_prefill_splits`), and 8 parts forced."""
    bm = mla_k._prefill_attn_tiles(torch.cuda.get_device_capability()[0], 2, 64)[0]
    capacity = (-(-4356 // 64) + 1) * 64                   # the block-table width x block size of the helper
    want = num_splits or mla_k._prefill_splits(-(-256 * 12 // bm), mla_k.num_sms("cuda"), capacity)
    if num_splits:
        prefill_parts(num_splits)
    grids = _spy_split_grids(monkeypatch)
    _mla_prefill_vs_reference([256], [4100], H=12, R=512, DR=64, Dn=128, Dv=128, BS=64, dt=torch.bfloat16,
                              tol=2e-2, tol_sdpa=3e-2)
    assert want > 1 or mla_k.num_sms("cuda") < 64          # an H200 (132 SMs) splits this chunk by default
    assert [g[1] for g in grids] == ([want] if want > 1 else [])


@pytest.mark.gpu
@pytest.mark.parametrize("H", [12, 96])
def test_mla_prefill_graph_safe_gpu_fp32_cache(H):
    """The runtime's fp32 latent pools at K3's dims: the default tiles for 4-byte elements (sm_90: 64 x 16) fit the
    shared memory and match the reference (tf32 dots)."""
    _mla_prefill_vs_reference([37, 1, 90], [70, 0, 130], H=H, R=512, DR=64, Dn=128, Dv=128, BS=64,
                              dt=torch.float32, tol=5e-3, tol_sdpa=3e-2)


def test_mla_prefill_graph_safe_on_cpu_needs_the_interpreter(monkeypatch):
    """graph_safe=True with CPU tensors outside TRITON_INTERPRET=1: one ValueError naming the fix (Triton's own error
    would be "0 active drivers")."""
    monkeypatch.setattr(mla_k, "_INTERPRET", False)
    q, lat, kv_b = torch.zeros(2, 1, 8), torch.zeros(2, 36), torch.zeros(8, 32)
    cache, bt = torch.zeros(2, 16, 36), torch.zeros(1, 1, dtype=torch.int32)
    cu, ctx = torch.tensor([0, 2], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 .* or pass graph_safe=False"):
        mla_k.mla_prefill(q, lat, kv_b, cache, bt, cu, ctx, num_heads=1, qk_nope_head_dim=4, v_head_dim=4,
                          kv_lora_rank=32, scale=0.5, graph_safe=True)


def test_mla_decode_on_cpu_needs_the_interpreter(monkeypatch):
    """mla_decode on CPU tensors outside TRITON_INTERPRET=1: one ValueError naming the fix, as mla_prefill."""
    monkeypatch.setattr(mla_k, "_INTERPRET", False)
    q, lat, cache = torch.zeros(1, 1, 36), torch.zeros(1, 36), torch.zeros(2, 16, 36)
    bt, ctx = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="mla_decode: CPU tensors run the Triton kernels in the interpreter"):
        mla_k.mla_decode(q, lat, cache, bt, ctx, num_heads=1, kv_lora_rank=32, scale=0.5)


def test_mla_decode_tiles_too_big_for_the_gpu_name_the_fix(monkeypatch):
    """A decode tile the GPU's shared memory cannot hold (fp32 latents at K3's width on sm_86 / 89 / 120: 104 of 99
    KiB) fails at launch with Triton's OutOfResources; mla_decode turns it into one ValueError naming the cache dtype
    and the fix."""
    from triton.runtime.errors import OutOfResources

    class TooBig:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise OutOfResources(106496, 101376, "shared memory")
            return launch
    monkeypatch.setattr(mla_k, "_mla_split_kernel", TooBig())
    q, lat, cache = torch.zeros(1, 1, 36), torch.zeros(1, 36), torch.zeros(2, 16, 36)
    bt, ctx = torch.ones(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"torch.float32 latent cache of width 36 do not fit this GPU .*"
                                         r"shared memory.*dense_dtype='bfloat16'"):
        mla_k.mla_decode(q.to(DEV), lat.to(DEV), cache.to(DEV), bt.to(DEV), ctx.to(DEV), num_heads=1,
                         kv_lora_rank=32, scale=0.5)


@pytest.mark.parametrize("R,DR,what", [(48, 16, "kv_lora_rank = 48"), (32, 12, "rope dim .* = 12")])
def test_mla_kernels_name_a_latent_width_that_is_not_a_power_of_2(R, DR, what):
    """The Triton MLA kernels tile R and Dr with `tl.arange`: other widths get one ValueError naming the field (not an
    interpreter / compiler traceback)."""
    q, lat, cache = torch.zeros(1, 1, R + DR), torch.zeros(1, R + DR), torch.zeros(2, 16, R + DR)
    bt, ctx = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"mla_decode: {what}: the Triton kernels need a power of 2"):
        mla_k.mla_decode(q.to(DEV), lat.to(DEV), cache.to(DEV), bt.to(DEV), ctx.to(DEV), num_heads=1,
                         kv_lora_rank=R, scale=0.5)
    qp, kv_b = torch.zeros(1, 1, 4 + DR), torch.zeros(8, R)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"mla_prefill: {what}: the Triton kernels need a power of 2"):
        mla_k.mla_prefill(qp.to(DEV), lat.to(DEV), kv_b.to(DEV), cache.to(DEV), bt.to(DEV), cu.to(DEV), ctx.to(DEV),
                          num_heads=1, qk_nope_head_dim=4, v_head_dim=4, kv_lora_rank=R, scale=0.5, graph_safe=True)


def test_mla_prefill_default_path_and_tiles():
    """Which path graph_safe=None takes, and the attention tiles per GPU generation and cache element size."""
    assert mla_k._graph_safe_default(True, False, False, 64) and mla_k._graph_safe_default(True, False, False, 16)
    assert not mla_k._graph_safe_default(True, False, False, 8)          # GPU key tiles need 16-token blocks: SDPA
    assert not mla_k._graph_safe_default(False, False, False, 64)        # CPU: SDPA
    assert mla_k._graph_safe_default(False, False, True, 64) and mla_k._graph_safe_default(True, True, False, 8)
    # fp32 caches: the graph-safe default only where its tiles are known to fit (sm_90); sm_86/89/120 have 99 KiB
    default = mla_k._graph_safe_default
    assert default(True, False, False, 64, 9, 4) and default(True, False, False, 64, 8, 2)
    assert not default(True, False, False, 64, 8, 4)
    tiles = mla_k._prefill_attn_tiles
    assert tiles(9, 2, 64) == (64, 64, 8) and tiles(9, 4, 64) == (64, 16, 8)
    assert tiles(9, 2, 32) == (64, 32, 8) and tiles(9, 2, 16) == (64, 16, 8)     # BN divides the block size
    assert tiles(8, 2, 64) == (32, 32, 8) and tiles(8, 4, 64) == (16, 16, 4) and tiles(12, 2, 64) == (32, 32, 8)
    assert tiles(None, 4, 4) == (16, 4, 4)


@pytest.mark.parametrize("cap,H,BS,itemsize,limit", [
    (90, 96, 64, 2, 232448), (90, 96, 16, 2, 232448), (80, 96, 64, 2, 166912), (86, 96, 64, 2, 101376),
    (89, 12, 64, 2, 101376), (90, 96, 64, 4, 232448), (90, 12, 64, 4, 232448), (80, 96, 64, 4, 166912),
    (80, 12, 64, 4, 166912)])
def test_mla_decode_default_tiles_fit_shared_memory(cap, H, BS, itemsize, limit):
    """`_decode_tiles`' default for each GPU generation and cache element size compiles (no GPU needed) within its
    shared memory per block at K3's R=512, Dr=64 (bf16: sm_90 64 x 64 x 2 stages, sm_80 64 x 32 x 3, sm_86 / 89
    16-head groups — a 64-head group would need 148 KiB there —; fp32, the runtime's default pools: sm_90 64 x 16
    and 16 x 32, sm_80 16 x 16; the fp32 64 x 64 tile, 432 KiB, failed at launch on the H200 with 64-token blocks)."""
    code = f"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3deploy.plugins.mla import kernels as mk
bh, bn, ns, nw = mk._decode_tiles(({cap // 10}, {cap % 10}), {H}, {BS}, itemsize={itemsize})
fn = mk._mla_split_kernel
names = fn.arg_names
const = dict(BS={BS}, R=512, DR=64, BH=bh, BN=bn, DIRECT=0)
dt = "*bf16" if {itemsize} == 2 else "*fp32"
sig = {{n: "constexpr" if n in const else dt if n in ("q_ptr", "cache_ptr", "out_ptr") else "*fp32" if n in ("po_ptr",
        "plse_ptr") else "*i32" if n.endswith("_ptr") else "fp32" if n == "sm_scale" else "i32" for n in names}}
attrs = {{(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*")}}
src = ASTSource(fn=fn, signature=sig, constexprs={{(names.index(k),): v for k, v in const.items()}}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", {cap}, 32), options={{"num_warps": nw, "num_stages": ns}})
print(k.metadata.shared, bh, bn, ns)
"""
    shared, bh, bn, ns = compile_in_subprocess(code)[-1]
    assert 0 < int(shared) <= limit
    assert int(bh) == (16 if cap in (86, 89) or H <= 16 or (itemsize == 4 and cap == 80) else 64)
    # 2 stages only for the 64 x 64 tile; a 16-token block caps the key tile and keeps 3 (H200: 1.07-1.23x faster)
    assert int(ns) == (2 if (int(bh), int(bn)) == (64, 64) else 3) and int(bn) <= BS
    if itemsize == 4:
        assert int(bn) == (32 if cap == 90 and H <= 16 else 16)


@pytest.mark.parametrize("cap,itemsize,limit", [(90, 2, 232448), (90, 4, 232448), (80, 2, 166912), (80, 4, 166912),
                                               (89, 2, 101376), (86, 2, 101376)])
def test_mla_prefill_default_tiles_fit_shared_memory(cap, itemsize, limit):
    """The default attention tiles at K3's R=512, Dr=64 compile (no GPU needed) within the architecture's shared
    memory per block (sm_90 227 KiB, sm_80 163 KiB, sm_86 / 89 99 KiB: there only 16-bit caches take this path by
    default); on sm_90 they lower to the warpgroup MMA. A bigger key tile for fp32 (64 x 64: 432 KiB) would fail at
    launch on the GPU with Triton's out-of-resources error."""
    code = f"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3deploy.plugins.mla import kernels as mk
bm, bn, nw = mk._prefill_attn_tiles({cap // 10}, {itemsize}, 64)
const = dict(R=512, DR=64, BM=bm, BN=bn, BNS=64)
dt = "*bf16" if {itemsize} == 2 else "*fp32"
for fn in (mk._mla_prefill_attn_kernel, mk._mla_prefill_attn_split_kernel):
    names = fn.arg_names
    sig = {{n: "constexpr" if n in const else dt if n in ("qa_ptr", "cache_ptr", "ol_ptr")
            else "*fp32" if n in ("po_ptr", "plse_ptr") else "*i32" if n.endswith("_ptr")
            else "fp32" if n == "sm_scale" else "i32" for n in names}}
    attrs = {{(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*")}}
    src = ASTSource(fn=fn, signature=sig, constexprs={{(names.index(k),): v for k, v in const.items()}}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", {cap}, 32), options={{"num_warps": nw, "num_stages": 2}})
    print(k.metadata.shared, int("wgmma" in k.asm["ptx"]))
"""
    for shared, wgmma in compile_in_subprocess(code)[-2:]:      # the unsplit and the split kernel
        assert 0 < int(shared) <= limit
        assert wgmma == ("1" if cap == 90 else "0")


# --------------------------------------------------------------------------------------------- OpSpec workspace rules
MLA_P_ATTRS = {"num_heads": 2, "qk_nope_head_dim": 8, "v_head_dim": 6, "kv_lora_rank": 512, "scale": 0.1}
MLA_D_ATTRS = {"num_heads": 2, "kv_lora_rank": 512, "scale": 0.1}
KDA_ATTRS = {"num_heads": 2, "head_dim": 4}
KDA_IN = [("T", 24), ("T", 8), ("T", 2), ("T", 8), (24, 4), (2,), (8,), (4,), ("S", 2, 4, 4), ("S", 24, 3)]
DIMS = {"T": 256, "N": 8, "B": 8, "S": 9, "NB": 100, "MB": 16}


def test_workspace_rules_symbolic_and_concrete():
    dev = torch.device(DEV)
    act = torch.bfloat16
    cases = [
        (KDA_PREFILL, KDA_ATTRS, KDA_IN + [("N + 1",), ("N",)],
         kda_k.kda_prefill_workspace_bytes(256, 8, 2, 4, act_dtype=act, device=dev)),
        (KDA_DECODE, KDA_ATTRS, KDA_IN + [("B",)], kda_k.kda_decode_workspace_bytes(256, 2, 4)),
        (MLA_PREFILL, MLA_P_ATTRS, [("T", 2, 12), ("T", 576), (28, 512), ("NB", 16, 576), ("N", "MB"), ("N + 1",),
                                    ("N",)], mla_k.mla_prefill_workspace_bytes(256, 2, 512, 64, dtype=act)),
        (MLA_DECODE, MLA_D_ATTRS, [("B", 2, 576), ("B", 576), ("NB", 16, 576), ("B", "MB"), ("B",)],
         mla_k.mla_decode_workspace_bytes(8, 2, 512, 16, 16)),
        (MXFP4_MOE, {}, [("T", 64), ("T", 4), ("T", 4), (3, 64, 32), (3, 64, 2), (3, 64, 16), (3, 64, 1)],
         moe_k.mxfp4_moe_workspace_bytes(256, 4, 3, 32, 64)),
    ]
    for spec, attrs, shapes, expect in cases:
        got = workspace_size(spec, attrs, shapes, dims=DIMS)
        assert got == expect, spec.name
        concrete = [tuple(DIMS["N"] + 1 if d == "N + 1" else DIMS.get(d, d) for d in s) for s in shapes]
        assert workspace_size(spec, attrs, concrete) == expect, spec.name
    assert workspace_size(MLA_PREFILL, MLA_P_ATTRS, cases[2][2], dims=DIMS) > 0
    assert workspace_size(MXFP4_MOE, {}, cases[4][2], dims={**DIMS, "T": 1}) < cases[4][3]   # grows with T
    with pytest.raises(ValueError, match="symbolic dim 'MB' has no value"):
        workspace_size(MLA_DECODE, MLA_D_ATTRS, cases[3][2], dims={"B": 8, "NB": 4})
    with pytest.raises(ValueError, match="expected 5 inputs"):
        workspace_size(MLA_DECODE, MLA_D_ATTRS, cases[3][2][:4], dims=DIMS)
    assert dict(MLA_PREFILL.kernel_options) == {"graph_safe": True}
    assert not KDA_PREFILL.kernel_options and not KDA_DECODE.kernel_options and not MLA_DECODE.kernel_options


def test_run_kernel_passes_workspace_and_options(monkeypatch):
    mod = types.ModuleType("fake_ws_kernels")
    seen = {}

    def op(x, state, *, scale, out=None, workspace=None, graph_safe=False):
        seen.update(workspace=workspace, graph_safe=graph_safe)
        out.copy_(x * scale)
        return out, state

    def op_plain(x, state, *, scale):   # no workspace / options in its signature: not passed
        return x * scale, state

    mod.op, mod.op_plain = op, op_plain
    monkeypatch.setitem(sys.modules, "fake_ws_kernels", mod)
    spec = OpSpec("Fake", (("x", ACT), ("state", F32)), (("y", ACT), ("state_out", ("alias", 1))), (),
                  lambda a: [Like(0), Like(1)], "fake_ws_kernels:op", workspace=lambda a, s, d: 64 * s[0][0],
                  kernel_options=(("graph_safe", True), ("unknown_option", 1)))
    x, state, y, ws = torch.randn(4, 8), torch.zeros(2, 8), torch.empty(4, 8), torch.empty(256, dtype=torch.uint8)
    assert workspace_size(spec, {}, [("T", 8), (2, 8)], dims={"T": 4}) == 256
    run_kernel(spec, {"scale": 2.0}, [x, state], [y, state], workspace=ws)
    assert seen["workspace"] is ws and seen["graph_safe"] is True and torch.equal(y, 2 * x)
    plain = OpSpec("Fake", spec.inputs, spec.outputs, (), spec.shape_rule, "fake_ws_kernels:op_plain",
                   kernel_options=(("graph_safe", True),))
    run_kernel(plain, {"scale": 3.0}, [x, state], [y, state], workspace=ws)
    assert torch.equal(y, 3 * x)


def test_plugin_get_workspace_size_from_max_dims():
    try:
        import tensorrt_rtx_bindings as trt
    except ImportError:
        pytest.skip("tensorrt_rtx_bindings not installed")
    from k3deploy.plugins.trt_common import make_plugin_classes

    plugin = make_plugin_classes(MLA_DECODE, trt)[0](MLA_D_ATTRS)
    shapes = [(8, 2, 576), (8, 576), (100, 16, 576), (8, 16), (8,)]
    types_ = [trt.DataType.BF16] * 3 + [trt.DataType.INT32] * 2
    descs = []
    for shp, dt in zip(shapes, types_):
        d = trt.DynamicPluginTensorDesc()
        p = trt.PluginTensorDesc()
        p.type, p.format = dt, trt.TensorFormat.LINEAR
        d.desc, d.min, d.max = p, trt.Dims([1] * len(shp)), trt.Dims(shp)
        descs.append(d)
    assert plugin.get_workspace_size(descs, []) == mla_k.mla_decode_workspace_bytes(8, 2, 512, 16, 16) > 0
    assert plugin.get_workspace_size([], []) == 0


# ------------------------------------------------------------------------------------------------------- AOT form
def test_aot_module_without_tensorrt_plugin():
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        assert not trt_aot.available() and trt_aot.register() == []
        assert not mla_aot.available() and mla_aot.register() == []
    assert trt_aot.AOT_OPS == ("kimi::KdaDecode",) and mla_aot.AOT_OPS == ("kimi::MlaDecode",)


def test_aot_pure_helpers():
    sig = trt_aot.kernel_signature("bfloat16")
    names = list(sig)
    # TensorRT's AOT launch order: input pointers, int32 extras, output pointers; then constexprs
    assert names[:11] == [n for n, _ in trt_aot.INPUTS] and names[11] == "T" and \
        names[12:15] == ["out_ptr", "state_out_ptr", "conv_out_ptr"] and names[15:] == list(trt_aot.CONSTEXPRS)
    assert sig["qkv_ptr"] == "*bf16" and sig["state_ptr"] == "*fp32" and sig["slots_ptr"] == "*i32" and \
        sig["T"] == "i32" and sig["conv_out_ptr"] == "*bf16" and sig["H"] == "constexpr"
    assert trt_aot.kernel_signature("float32")["conv_ptr"] == "*fp32"
    with pytest.raises(ValueError, match="activation dtype"):
        trt_aot.kernel_signature("int8")
    c = trt_aot.kernel_constexprs(12, 128, -5.0, 1e-5)
    assert c == {"H": 12, "K": 128, "LOWER_BOUND": -5.0, "NORM_EPS": 1e-5, "SCALE": 128 ** -0.5}
    with pytest.raises(ValueError, match="power of two"):
        trt_aot.kernel_constexprs(12, 96, -5.0, 1e-5)
    assert trt_aot.num_warps(128) == 8 and trt_aot.num_warps(64) == 4
    lp = trt_aot.launch_params(37, 12, 8, 512)
    assert (lp["grid_x"], lp["grid_y"], lp["grid_z"], lp["block_x"], lp["shared_mem"]) == (37, 12, 1, 256, 512)
    sym = object()   # a TensorRT shape expression passes through untouched
    assert trt_aot.launch_params(sym, 12, 4, 0)["grid_x"] is sym and trt_aot.extra_args(sym) == [sym]
    assert aot_common.pick_ptx_version(90, 84) == 84
    types_ = [t.strip() for t in trt_aot.autotune_types().split(",")]
    assert len(types_) == 14 and types_[0] == "FP32|FP16|BF16" and types_[8] == "FP32|FP32|FP32" and \
        types_[10] == "INT32|INT32|INT32" and types_[12] == "FP32|FP32|FP32" and types_[13] == types_[0]


def test_aot_ptx_version_is_the_older_of_driver_and_ptxas(monkeypatch):
    A = aot_common
    monkeypatch.setattr(A, "driver_ptx_version", lambda: 90)
    monkeypatch.setattr(A, "triton_ptx_version", lambda arch: 94)
    assert A.pick_ptx_version(90) == 90 and A.pick_ptx_version(90, 85) == 85
    monkeypatch.setattr(A, "driver_ptx_version", lambda: None)
    assert A.pick_ptx_version(90) == 94
    monkeypatch.setattr(A, "triton_ptx_version", lambda arch: None)
    assert A.pick_ptx_version(90) is None


def test_strip_hidden_params():
    ptx = (".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n"
           "\t.param .u64 .ptr .global .align 1 k_param_2,\n\t.param .u64 .ptr .global .align 1 k_param_3\n)\n"
           "{\n\tld.param.b64 %rd1, [k_param_0];\n\tld.param.b32 %r1, [k_param_1];\n}\n")
    out = aot_common.strip_hidden_params(ptx, "k", 2)
    assert "k_param_1\n)" in out and "k_param_2" not in out and "k_param_3" not in out
    with pytest.raises(ValueError, match="is used by the kernel"):
        aot_common.strip_hidden_params(ptx, "k", 0)
    with pytest.raises(ValueError, match="expected at least 5"):
        aot_common.strip_hidden_params(ptx, "k", 5)
    with pytest.raises(ValueError, match="no .entry"):
        aot_common.strip_hidden_params(ptx, "other", 1)


def test_aot_kernel_compiles_to_ptx_for_sm90():
    """Triton compiles the entry kernel for sm_90 on a machine without a GPU (a subprocess: no interpreter)."""
    code = ("from triton.backends.compiler import GPUTarget\n"
            "from plugins.kda import trt_aot as A\n"
            "import re\n"
            "for act, H, K, pv in (('bfloat16', 12, 128, None), ('float32', 2, 16, 84)):\n"
            "    name, ptx, w, sh = A.compile_ptx(act, H, K, -5.0, 1e-5, target=GPUTarget('cuda', 90, 32), ptx_version=pv)\n"
            "    n = entry_params(name, ptx)\n"
            "    ver = re.search(r'\\.version (\\S+)', ptx).group(1)\n"
            "    print(name, n, w, sh, '.target sm_90a' in ptx, ver)\n")
    lines = compile_in_subprocess(code)
    assert [ln[0] for ln in lines] == ["_kda_decode_aot_kernel"] * 2
    assert [int(ln[1]) for ln in lines] == [15, 15]          # exactly TensorRT's arguments: 11 in + T + 3 out
    assert [int(ln[2]) for ln in lines] == [8, 4] and all(ln[4] == "True" for ln in lines)
    assert lines[1][5] == "8.4"


def test_mla_aot_kernel_compiles_to_ptx_for_sm90():
    """The MlaDecode entry kernel compiles for sm_90 on a CPU machine with exactly TensorRT's 9 parameters (5 inputs,
    MB and BS, 2 outputs), 4 warps, under 48 KB of shared memory for bf16, with vectorized (16-byte) loads."""
    code = ("from triton.backends.compiler import GPUTarget\n"
            "from plugins.mla import trt_aot as A\n"
            "import re\n"
            "for act, H in (('bfloat16', 12), ('bfloat16', 96), ('float32', 4)):\n"
            "    name, ptx, w, sh = A.compile_ptx(act, H, 512, 576, 192 ** -0.5, target=GPUTarget('cuda', 90, 32))\n"
            "    n = entry_params(name, ptx)\n"
            "    print(name, n, w, sh, '.target sm_90a' in ptx, len(re.findall(r'ld\\.global\\.v4', ptx)))\n")
    lines = compile_in_subprocess(code)
    assert [ln[0] for ln in lines] == ["_mla_decode_aot_kernel"] * 3
    assert [int(ln[1]) for ln in lines] == [9, 9, 9] and [int(ln[2]) for ln in lines] == [4, 4, 4]
    assert all(ln[4] == "True" for ln in lines) and all(int(ln[5]) > 0 for ln in lines)
    assert all(0 < int(ln[3]) <= 48 * 1024 for ln in lines[:2])


def test_mla_aot_pure_helpers():
    sig = mla_aot.kernel_signature("bfloat16")
    names = list(sig)
    assert names == ["q_ptr", "lat_ptr", "cache_ptr", "bt_ptr", "ctx_ptr", "MB", "BS", "out_ptr", "cache_out_ptr",
                     *mla_aot.CONSTEXPRS]
    assert sig["q_ptr"] == "*bf16" and sig["bt_ptr"] == "*i32" and sig["MB"] == "i32" and sig["cache_out_ptr"] == "*bf16"
    assert mla_aot.kernel_signature("float32")["cache_ptr"] == "*fp32"
    with pytest.raises(ValueError, match="activation dtype"):
        mla_aot.kernel_signature("int8")
    c = mla_aot.kernel_constexprs(12, 512, 576, 0.1)
    assert c == {"H": 12, "R": 512, "DR": 64, "BH": 16, "BN": 16, "SCALE": 0.1}
    assert mla_aot.kernel_constexprs(96, 512, 576, 0.1)["BH"] == 16 and mla_aot.num_warps(96) == 4
    with pytest.raises(ValueError, match="power of two"):
        mla_aot.kernel_constexprs(12, 512, 560, 0.1)
    with pytest.raises(ValueError, match="must not exceed"):
        mla_aot.kernel_constexprs(12, 32, 96, 0.1)
    lp = mla_aot.launch_params(5, 96, 4, 1024)
    assert (lp["grid_x"], lp["grid_y"], lp["grid_z"], lp["block_x"], lp["shared_mem"]) == (6, 1, 5, 128, 1024)
    sym = object()
    assert mla_aot.launch_params(sym, 12, 4, 0)["grid_z"] is sym and mla_aot.extra_args(sym, 64) == [sym, 64]
    mla_aot.check_block_size(64)
    mla_aot.check_block_size(sym)            # a runtime dimension: not checkable at build time
    with pytest.raises(ValueError, match="multiple of 16"):
        mla_aot.check_block_size(8)
    assert mla_aot.autotune_types().split(", ") == ["FP32|FP16|BF16"] * 3 + ["INT32|INT32|INT32"] * 2 + \
        ["FP32|FP16|BF16"] * 2


# bf16 on the GPU only: the Triton interpreter's tl.dot on bf16 operands returns garbage (Triton 3.9)
@pytest.mark.parametrize("H,dt", [(3, torch.float32), (20, torch.float32)] + (
    [(12, torch.bfloat16), (96, torch.bfloat16)] if HAS_CUDA else []))
def test_mla_aot_entry_kernel_matches_reference(H, dt):
    """The AOT entry kernel launched the way TensorRT launches it (grid (cdiv(H, BH), 1, B), MB and BS as ints,
    cache_out = the cache) writes the new latents and attends like plugins/mla/reference.py. 20 heads: a full and a
    partial 16-head group (masking). Contexts: empty, one block + 1, a block's last row. A block size that the
    16-token tile does not divide gives NaN outputs, not a wrong attention."""
    R, DR, BS, MB, B = (512, 64, 64, 3, 3) if HAS_CUDA else (32, 16, 16, 4, 3)
    ctx = torch.tensor([0, BS + 1, 2 * BS - 1], dtype=torch.int32)
    g = torch.Generator().manual_seed(H)
    cache = torch.randn(B * MB + 1, BS, R + DR, generator=g).to(dt)
    bt = torch.randperm(B * MB, generator=g).int().view(B, MB) + 1
    q = torch.randn(B, H, R + DR, generator=g).to(dt)
    lat = torch.randn(B, R + DR, generator=g).to(dt)
    ro, rc = mla_ref.mla_decode(q.float(), lat.float(), cache.float(), bt, ctx, num_heads=H, kv_lora_rank=R,
                                scale=0.2)
    c = mla_aot.kernel_constexprs(H, R, R + DR, 0.2)
    cc = cache.to(DEV)
    out = torch.full((B, H, R), float("nan"), dtype=dt, device=DEV)
    lp = mla_aot.launch_params(B, H, mla_aot.num_warps(H), 0)
    mla_aot._mla_decode_aot_kernel[(lp["grid_x"], lp["grid_y"], lp["grid_z"])](
        q.to(DEV), lat.to(DEV), cc, bt.to(DEV), ctx.to(DEV), MB, BS, out, cc, **c, num_warps=mla_aot.num_warps(H))
    assert relerr(out, ro) < (1e-5 if dt == torch.float32 and not HAS_CUDA else 1e-2)
    assert nan_equal(cc.float().cpu(), rc)
    if not HAS_CUDA:   # BS = 8 with the 16-token tile (a 2-block table covering the same 16 rows per sequence)
        out.zero_()
        mla_aot._mla_decode_aot_kernel[(lp["grid_x"], 1, B)](
            q, lat, cache.clone().view(-1, 8, R + DR), (bt[:, :, None] * 2 + torch.arange(2)).reshape(B, -1).int(),
            ctx, 2 * MB, 8, out, cache.clone().view(-1, 8, R + DR), **c, num_warps=mla_aot.num_warps(H))
        assert torch.isnan(out).all()


def test_mla_aot_constant_shape_expressions():
    """_constant reads tensorrt.plugin ShapeExprs: is_constant is a property, constant_value() a method; a symbolic or
    "fake" expression (is_constant raises RuntimeError) stays an expression."""
    class Expr:
        def __init__(self, value=None, fake=False):
            self.value, self.fake = value, fake

        @property
        def is_constant(self):
            if self.fake:
                raise RuntimeError("fake shape expression")
            return self.value is not None

        def constant_value(self):
            return self.value

    sym, fake = Expr(), Expr(fake=True)
    assert mla_aot._constant(Expr(64)) == 64 and mla_aot._constant(np.int32(16)) == 16 and mla_aot._constant(8) == 8
    assert mla_aot._constant(sym) is sym and mla_aot._constant(fake) is fake


def _install_stand_in_qdp(monkeypatch, module, compiled_result):
    """Stand-in tensorrt / tensorrt.plugin modules, the AOT ``module`` unregistered, its compile_ptx recording its
    arguments and returning ``compiled_result``. Returns (the stand-in tensorrt.plugin, the recorded calls)."""
    trt, trtp = fake_tensorrt_plugin()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(module, "_DONE", [])
    compiled = []
    monkeypatch.setattr(module, "compile_ptx", lambda *a, **k: compiled.append(a) or compiled_result)
    return trtp, compiled


def test_aot_qdp_glue_with_stand_in_tensorrt_plugin(monkeypatch):
    """register/autotune/aot_impl wiring against a stand-in tensorrt.plugin (the real one needs TensorRT >= 10.9)."""
    trtp, compiled = _install_stand_in_qdp(monkeypatch, trt_aot, ("kern", "PTX", 8, 512))
    assert trt_aot.available()
    assert trt_aot.register() == ["kimi::KdaDecode"] and trt_aot.register() == ["kimi::KdaDecode"]
    assert {k for k, _ in trtp.defs} == {"register", "autotune", "aot_impl", "impl"}
    T = object()   # symbolic token count
    ins = [FakeDesc((T, 3 * 1536), "BF16"), FakeDesc((T, 1536), "BF16"), FakeDesc((T, 12), "BF16"),
           FakeDesc((T, 1536), "BF16")] + [FakeDesc((n,), "F32") for n in (4608, 12, 1536, 128)] + \
          [FakeDesc(("S", 12, 128, 128), "F32"), FakeDesc(("S", 4608, 3), "BF16"), FakeDesc((T,), "I32")]
    attrs = [np.array([12], np.int32), np.array([128], np.int32), np.array([-5.0], np.float32),
             np.array([1e-5], np.float32)]
    out, st, cv = trtp.defs[("register", "kimi::KdaDecode")](*ins, *attrs)
    assert out.shape_expr == [T, 1536] and out.dtype == "BF16" and st.alias_of is ins[8] and cv.alias_of is ins[9]
    assert trtp.defs[("autotune", "kimi::KdaDecode")](*ins, (out, st, cv)) == [("combo", trt_aot.autotune_types())]
    name, ptx, lp, extra = trtp.defs[("aot_impl", "kimi::KdaDecode")](*ins, *attrs, (out, st, cv), 0)
    assert (name, ptx) == (b"kern", b"PTX")
    assert compiled[0][:3] == ("bfloat16", 12, 128) and compiled[0][3] == pytest.approx(-5.0)
    assert lp.grid_x is T and lp.grid_y == 12 and lp.grid_z == 1 and lp.block_x == 256 and lp.shared_mem == 512
    assert extra == ("exprs", [("i32", T)])


def test_mla_aot_qdp_glue_with_stand_in_tensorrt_plugin(monkeypatch):
    """MlaDecode's register/autotune/aot_impl against a stand-in tensorrt.plugin: output shape [B, H, R] and the
    aliased cache, grid (groups, 1, B) with B symbolic, extras [MB, BS] from the shapes, attributes compiled in; a
    constant block size that the 16-token tile does not divide is refused at build time."""
    trtp, compiled = _install_stand_in_qdp(monkeypatch, mla_aot, ("kern", "PTX", 4, 4096))
    assert mla_aot.available() and mla_aot.register() == ["kimi::MlaDecode"]
    B, MB = object(), object()          # symbolic batch and block-table width
    ins = [FakeDesc((B, 96, 576), "BF16"), FakeDesc((B, 576), "BF16"), FakeDesc(("NB", 64, 576), "BF16"),
           FakeDesc((B, MB), "I32"), FakeDesc((B,), "I32")]
    attrs = [np.array([96], np.int32), np.array([512], np.int32), np.array([0.07], np.float32)]
    out, cache_out = trtp.defs[("register", "kimi::MlaDecode")](*ins, *attrs)
    assert out.shape_expr == [B, 96, 512] and out.dtype == "BF16" and cache_out.alias_of is ins[2]
    assert trtp.defs[("autotune", "kimi::MlaDecode")](*ins, (out, cache_out)) == [("combo", mla_aot.autotune_types())]
    name, ptx, lp, extra = trtp.defs[("aot_impl", "kimi::MlaDecode")](*ins, *attrs, (out, cache_out), 0)
    assert (name, ptx) == (b"kern", b"PTX")
    assert compiled[0][:4] == ("bfloat16", 96, 512, 576) and compiled[0][4] == pytest.approx(0.07)
    assert (lp.grid_x, lp.grid_y) == (6, 1) and lp.grid_z is B and lp.block_x == 128 and lp.shared_mem == 4096
    assert extra == ("exprs", [("i32", MB), ("i32", 64)])
    ins[2] = FakeDesc(("NB", 8, 576), "BF16")
    with pytest.raises(ValueError, match="multiple of 16"):
        trtp.defs[("aot_impl", "kimi::MlaDecode")](*ins, *attrs, (out, cache_out), 0)


def test_register_tensorrt_plugins_aot_falls_back_without_qdp():
    """aot=True where tensorrt.plugin is absent (TensorRT-RTX here): the IPluginV3 for every op, same names; switching
    the choice in the same process is refused."""
    try:
        import tensorrt_rtx_bindings  # noqa: F401
    except ImportError:
        pytest.skip("tensorrt_rtx_bindings not installed")
    code = ("import tensorrt_rtx_bindings as trt\n"
            "from plugins.trt_common import register_tensorrt_plugins\n"
            "names = register_tensorrt_plugins(trt, aot=True)\n"
            "assert register_tensorrt_plugins(trt, aot=True) == names\n"
            "try:\n"
            "    register_tensorrt_plugins(trt, aot=False)\n"
            "    raise SystemExit('no error')\n"
            "except RuntimeError as e:\n"
            "    assert 'aot' in str(e)\n"
            "reg = trt.get_plugin_registry()\n"
            "assert reg.get_creator('KdaDecode', '1', 'kimi') is not None\n"
            "print(','.join(names))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().split(",") == ["kimi::KdaPrefill", "kimi::KdaDecode", "kimi::MlaPrefill",
                                           "kimi::MlaDecode", "kimi::Mxfp4Moe"]


# --------------------------------------------------------------------------------------------- GPU: CUDA graphs
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_cuda_graph_capture_and_replay(case):
    """Warm up eagerly (compiles, autotunes), capture one call with a preallocated workspace and output, then
    replay on new inputs/metadata/pools copied into the captured buffers: equals an eager call on the same data.
    Capturing raises if anything synchronizes; allocations while captured are counted (0 except fla's)."""
    static = case.fresh(seed=10)
    ws = torch.empty(case.nbytes, dtype=torch.uint8, device=DEV)
    out = case.new_out()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            case.call(static, ws, out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        results = case.call(static, ws, out)
        allocated = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - before
    if not case.allocates:
        assert allocated == 0, f"{case.name} allocated {allocated} blocks while captured"
    for seed in (11, 12):
        new = case.fresh(seed=seed)
        expect = case.call(_clone(new), torch.empty_like(ws), case.new_out())
        for k, v in new.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        for e, r in zip(expect, results):
            if case.exact:
                assert nan_equal(r, e), case.name
            else:
                assert relerr(r, e) < 1e-3, case.name


@pytest.mark.gpu
def test_kda_decode_aot_ptx_through_the_driver():
    """The AOT PTX loaded with cuModuleLoadData and launched with TensorRT's convention (inputs, T, outputs; grid
    (T, H); block 32*warps) equals the reference; the single launch is captured in a CUDA graph too."""
    B, H, K, act = 5, 4, 128, torch.bfloat16
    slots = [6, 2, 7, 3, 1]
    x = {k: v.to(DEV) for k, v in _kda_make(B, H, K, 9, act, slots)(3).items()}
    ro, rs, rc = kda_ref.kda_decode(*[v.cpu() for v in x.values()], num_heads=H, head_dim=K)
    name, ptx, warps, shared = trt_aot.compile_ptx("bfloat16", H, K, -5.0, 1e-5)
    kern = DriverKernel(name, ptx, shared)
    out = torch.empty(B, H * K, dtype=act, device=DEV)
    args = [x[k] for k in ("qkv", "f", "b", "g", "conv_w", "A_log", "dt_bias", "o_norm_w", "state", "conv",
                           "slots")] + [B, out, x["state"], x["conv"]]
    packed = kern.params(args)
    lp = trt_aot.launch_params(B, H, warps, shared)

    def launch():
        kern.launch(lp, packed)

    st0, cv0 = x["state"].clone(), x["conv"].clone()
    launch()
    torch.cuda.synchronize()
    u = torch.tensor(slots)
    assert relerr(out, ro) < 2e-2 and relerr(x["state"][u], rs[u]) < 2e-3 and relerr(x["conv"][u], rc[u]) < 1e-6
    first = out.clone()
    x["state"].copy_(st0)
    x["conv"].copy_(cv0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    del graph                      # the graph references the module's function: drop it first
    kern.unload()


@pytest.mark.gpu
def test_mla_decode_aot_ptx_through_the_driver():
    """The MlaDecode AOT PTX loaded with cuModuleLoadData and launched with TensorRT's convention (5 inputs, MB, BS,
    2 outputs; grid (groups, 1, B)) writes the new latents and equals the reference (96 heads: six 16-head programs
    per sequence; above 48 KB of shared memory the launch opts the function in, as TensorRT would have to)."""
    H, R, DR, BS, MB, B, dt = 96, 512, 64, 64, 3, 3, torch.bfloat16
    ctx = torch.tensor([0, BS + 1, 2 * BS - 1], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(B * MB + 1, BS, R + DR, generator=g).to(dt)
    bt = torch.randperm(B * MB, generator=g).int().view(B, MB) + 1
    q = torch.randn(B, H, R + DR, generator=g).to(dt)
    lat = torch.randn(B, R + DR, generator=g).to(dt)
    ro, rc = mla_ref.mla_decode(q.float(), lat.float(), cache.float(), bt, ctx, num_heads=H, kv_lora_rank=R, scale=0.05)
    name, ptx, warps, shared = mla_aot.compile_ptx("bfloat16", H, R, R + DR, 0.05)
    kern = DriverKernel(name, ptx, shared)
    x = [t.to(DEV) for t in (q, lat, cache, bt, ctx)]
    out = torch.full((B, H, R), float("nan"), dtype=dt, device=DEV)
    packed = kern.params(x + [MB, BS, out, x[2]])
    kern.launch(mla_aot.launch_params(B, H, warps, shared), packed)
    torch.cuda.synchronize()
    assert relerr(out, ro) < 2e-2 and nan_equal(x[2].float().cpu(), rc)
    kern.unload()


# ------------------------------------------------------------------------------------- Mxfp4Moe ahead of time
def _moe_case(E, RL, I, T, k, seed=5):
    g = torch.Generator().manual_seed(seed)
    w13p = torch.randint(0, 256, (E, 2 * I, RL // 2), dtype=torch.uint8, generator=g)
    w13s = torch.randint(121, 127, (E, 2 * I, RL // 32), dtype=torch.uint8, generator=g)
    w2p = torch.randint(0, 256, (E, RL, I // 2), dtype=torch.uint8, generator=g)
    w2s = torch.randint(118, 124, (E, RL, I // 32), dtype=torch.uint8, generator=g)
    x = torch.randn(T, RL, generator=g)
    ids = torch.stack([torch.randperm(E + 4, generator=g)[:k] for _ in range(T)]).int()   # some ids non-local (EP)
    w = torch.rand(T, k, generator=g)
    return x, ids, w, w13p, w13s, w2p, w2s


def test_moe_aot_pure_helpers():
    """The four AOT MoE ops' TensorRT parameter order (inputs, extras, outputs), constexprs, grids, type strings."""
    names = {op: list(moe_aot.kernel_signature(op, "bfloat16")) for op in moe_aot.AOT_OPS}
    assert names[moe_aot.SORT][:5] == ["ids_ptr", "M", "order_ptr", "tok_ptr", "offs_ptr"]
    assert names[moe_aot.W13][:6] == ["x_ptr", "tok_ptr", "offs_ptr", "w_ptr", "s_ptr", "h_ptr"]
    assert names[moe_aot.W2][:7] == ["h_ptr", "pair_ptr", "wts_ptr", "offs_ptr", "w_ptr", "s_ptr", "y_ptr"]
    assert names[moe_aot.COMBINE][:3] == ["ypair_ptr", "ids_ptr", "y_ptr"]
    sig = moe_aot.kernel_signature(moe_aot.W13, "bfloat16")
    assert (sig["x_ptr"], sig["w_ptr"], sig["h_ptr"], sig["tok_ptr"]) == ("*bf16", "*u8", "*bf16", "*i32")
    assert moe_aot.kernel_signature(moe_aot.W2, "float32")["y_ptr"] == "*fp32"
    with pytest.raises(ValueError, match="activation dtype"):
        moe_aot.kernel_signature(moe_aot.W13, "int8")
    c = moe_aot.kernel_constexprs(moe_aot.W13, latent=3584, inter=3072, situ_beta=4.0, situ_linear_beta=25.0)
    assert (c["I"], c["RL"], c["BM"], c["BN"], c["BK"], c["DQ"]) == (3072, 3584, 16, 128, 64, 3)
    assert moe_aot.kernel_constexprs(moe_aot.W2, latent=64, inter=32, interpret=True)["DQ"] == 0
    assert moe_aot.kernel_constexprs(moe_aot.COMBINE, num_local_experts=112, expert_offset=224, top_k=16,
                                     latent=3584) == {"E": 112, "EXPERT_OFFSET": 224, "RL": 3584, "K": 16, "BK": 16,
                                                      "BR": 256}
    with pytest.raises(ValueError, match="multiples of 32"):
        moe_aot.kernel_constexprs(moe_aot.W13, latent=48, inter=64)
    T = object()
    grids = {op: moe_aot.launch_params(op, num_local_experts=112, num_tokens=T, latent=3584, inter=3072)
             for op in moe_aot.AOT_OPS}
    assert (grids[moe_aot.SORT]["grid_x"], grids[moe_aot.W13]["grid_x"], grids[moe_aot.W13]["grid_y"]) == (113, 24, 112)
    assert (grids[moe_aot.W2]["grid_x"], grids[moe_aot.COMBINE]["grid_y"]) == (28, 14)
    assert grids[moe_aot.COMBINE]["grid_x"] is T and grids[moe_aot.W2]["block_x"] == 128
    assert moe_aot.autotune_types(moe_aot.W13).split(", ") == ["FP32|FP16|BF16"] + ["INT32|INT32|INT32"] * 2 + \
        ["UINT8|UINT8|UINT8"] * 2 + ["FP32|FP16|BF16"]


@pytest.mark.parametrize("T,k,eo", [(5, 3, 2), (1, 4, 0)])
def test_moe_aot_entry_kernels_match_reference(T, k, eo):
    """The four AOT entry kernels launched in sequence the way TensorRT would (dense tensors, grids of
    launch_params, attributes as constexprs, intermediates as separate tensors) equal plugins/moe/reference.py,
    with some ids outside this rank's experts. CPU: plain-Triton dequant, fp32 products; GPU: the compiled form's
    inline-PTX dequant and bf16 products (h rounded to bf16)."""
    E, RL, I = (6, 64, 64) if not HAS_CUDA else (8, 256, 128)
    x, ids, w, w13p, w13s, w2p, w2s = _moe_case(E, RL, I, T, k)
    act = torch.float32 if not HAS_CUDA else torch.bfloat16
    ref = moe_ref.mxfp4_moe(x.to(act).float(), ids, w, w13p, w13s, w2p, w2s, expert_offset=eo)
    d = {n: t.to(DEV) for n, t in zip(("x", "ids", "w", "w13p", "w13s", "w2p", "w2s"),
                                        (x.to(act), ids, w, w13p, w13s, w2p, w2s))}
    M = T * k
    G = Guarded()
    order, tok, offs = (G.empty(n, dtype=torch.int32) for n in (M, M, E + 1))
    h, ypair, y = G.empty(M, I, dtype=act), G.empty(M, RL, dtype=torch.float32), G.empty(T, RL, dtype=torch.float32)
    kw = dict(num_local_experts=E, expert_offset=eo, top_k=k, latent=RL, inter=I, interpret=not HAS_CUDA)

    def run(op, *args):
        lp = moe_aot.launch_params(op, num_local_experts=E, num_tokens=T, latent=RL, inter=I)
        c = moe_aot.kernel_constexprs(op, **kw)
        moe_aot.ENTRY[op][(lp["grid_x"], lp["grid_y"], lp["grid_z"])](*args, **c, num_warps=moe_aot.NUM_WARPS)

    run(moe_aot.SORT, G(d["ids"]), M, order, tok, offs)
    run(moe_aot.W13, G(d["x"]), tok, offs, G(d["w13p"]), G(d["w13s"]), h)
    run(moe_aot.W2, h, order, G(d["w"]), offs, G(d["w2p"]), G(d["w2s"]), ypair)
    run(moe_aot.COMBINE, ypair, G(d["ids"]), y)
    G.check()
    assert relerr(y, ref) < (1e-4 if not HAS_CUDA else 1e-2)


def test_moe_aot_kernels_compile_to_ptx_for_sm90():
    """The four entry kernels compile for sm_90 on a CPU machine at K3's per-rank shapes (112 local experts,
    Rl 3584, I 3072, top-16) with exactly TensorRT's parameters: sort 1 in + M + 3 out, W13 5 + 1, W2 6 + 1,
    combine 2 + 1."""
    code = ("from triton.backends.compiler import GPUTarget\n"
            "from plugins.moe import trt_aot as A\n"
            "import re\n"
            "kw = dict(num_local_experts=112, expert_offset=112, top_k=16, latent=3584, inter=3072)\n"
            "for op in A.AOT_OPS:\n"
            "    name, ptx, w, sh = A.compile_ptx(op, 'bfloat16', target=GPUTarget('cuda', 90, 32), **kw)\n"
            "    n = entry_params(name, ptx)\n"
            "    print(name, n, w, sh, '.target sm_90a' in ptx)\n")
    lines = compile_in_subprocess(code)
    assert [ln[0] for ln in lines] == ["_moe_sort_aot_kernel", "_moe_w13_aot_kernel", "_moe_w2_aot_kernel",
                                       "_moe_combine_aot_kernel"]
    assert [int(ln[1]) for ln in lines] == [5, 6, 7, 3] and all(ln[4] == "True" for ln in lines)
    assert all(int(ln[3]) <= 227 * 1024 for ln in lines)


def _moe_onnx(w13_as_input=False):
    import onnx
    from onnx import TensorProto, helper

    E, RL, I, k = 6, 64, 32, 2
    shapes = {"w13_packed": (E, 2 * I, RL // 2), "w13_scale": (E, 2 * I, RL // 32), "w2_packed": (E, RL, I // 2),
              "w2_scale": (E, RL, I // 32)}
    inits = [helper.make_tensor(n, TensorProto.UINT8, s, np.zeros(s, np.uint8).tobytes(), raw=True)
             for n, s in shapes.items() if not (w13_as_input and n == "w13_packed")]
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", RL]),
           helper.make_tensor_value_info("ids", TensorProto.INT32, ["T", k]),
           helper.make_tensor_value_info("wts", TensorProto.FLOAT, ["T", k])]
    if w13_as_input:
        ins.append(helper.make_tensor_value_info("w13_packed", TensorProto.UINT8, None))
    pre = helper.make_node("Identity", ["x"], ["x1"], name="pre")
    moe = helper.make_node("Mxfp4Moe", ["x1", "ids", "wts", *shapes], ["y"], name="moe", domain="kimi",
                           expert_offset=6, situ_beta=3.0, situ_linear_beta=20.0, num_experts=12,
                           plugin_namespace="kimi", plugin_version="1")
    post = helper.make_node("Identity", ["y"], ["z"], name="post")
    g = helper.make_graph([pre, moe, post], "layer", ins, [helper.make_tensor_value_info("z", TensorProto.FLOAT,
                                                                                          ["T", RL])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("kimi", 1)]), onnx


def test_decompose_mxfp4_moe_for_aot(tmp_path):
    """build_engines --aot: each kimi::Mxfp4Moe node becomes MoeSortPairs -> MoeExpertsW13 -> MoeExpertsW2 ->
    MoeCombine in its place, wired through new tensors, attributes carried (E from the weights' shape), aot=1;
    mark_aot_nodes does it when asked for Mxfp4Moe; without a static w13 shape the rewrite names the node."""
    from onnx import helper

    from k3deploy.engines.build import mark_aot_nodes

    m, onnx = _moe_onnx()
    assert mark_aot_nodes(m, ["KdaDecode", "Mxfp4Moe"]) == 1
    ops = [(n.op_type, n.domain) for n in m.graph.node]
    assert ops == [("Identity", ""), ("MoeSortPairs", "kimi"), ("MoeExpertsW13", "kimi"), ("MoeExpertsW2", "kimi"),
                   ("MoeCombine", "kimi"), ("Identity", "")]
    sort, w13, w2, comb = m.graph.node[1:5]
    a = lambda n: {x.name: helper.get_attribute_value(x) for x in n.attribute}   # noqa: E731
    assert list(sort.input) == ["ids"] and list(w13.input)[:3] == ["x1", sort.output[1], sort.output[2]]
    assert list(w13.input)[3:] == ["w13_packed", "w13_scale"]
    assert list(w2.input) == [w13.output[0], sort.output[0], "wts", sort.output[2], "w2_packed", "w2_scale"]
    assert list(comb.input) == [w2.output[0], "ids"] and list(comb.output) == ["y"]
    assert a(sort)["num_local_experts"] == 6 and a(sort)["expert_offset"] == 6 and a(comb)["num_local_experts"] == 6
    assert a(w13)["situ_beta"] == pytest.approx(3.0) and a(w13)["situ_linear_beta"] == pytest.approx(20.0)
    assert all(a(n)["aot"] == 1 and a(n)["plugin_namespace"] == b"kimi" for n in (sort, w13, w2, comb))
    onnx.checker.check_model(m)          # a valid graph (custom-domain nodes are not schema-checked)
    assert moe_aot.decompose_mxfp4_moe(m) == 0
    from k3deploy.engines.build import onnx_custom_ops

    path = tmp_path / "layer.onnx"
    onnx.save(_moe_onnx()[0], str(path))      # the manifest lists the ops the AOT engine holds
    assert set(onnx_custom_ops(path)) == {"kimi::Mxfp4Moe"}
    assert set(onnx_custom_ops(path, aot_ops=["Mxfp4Moe"])) == {f"kimi::{n}" for n in ("MoeSortPairs", "MoeExpertsW13",
                                                                                        "MoeExpertsW2", "MoeCombine")}
    bad, _ = _moe_onnx(w13_as_input=True)
    with pytest.raises(ValueError, match="'moe'.*static shape"):
        moe_aot.decompose_mxfp4_moe(bad)


def test_moe_aot_qdp_glue_with_stand_in_tensorrt_plugin(monkeypatch):
    """The four QDP ops against a stand-in tensorrt.plugin: output shapes with T symbolic (M = T*k pairs), the sort's
    extra M, grids from the static weight shapes, attributes compiled in, a symbolic latent width refused."""
    trtp, compiled = _install_stand_in_qdp(monkeypatch, moe_aot, ("kern", "PTX", 4, 1024))
    assert moe_aot.available() and moe_aot.register() == list(moe_aot.AOT_OPS)
    assert {k for k, _ in trtp.defs} == {"register", "autotune", "aot_impl"}
    T = Sym("T")
    E, RL, I, k = 112, 3584, 3072, 16
    ids = FakeDesc((T, k), "I32")
    i32 = lambda v: np.array([v], np.int32)      # noqa: E731
    f32 = lambda v: np.array([v], np.float32)    # noqa: E731
    order, tok, offs = trtp.defs[("register", moe_aot.SORT)](ids, i32(E), i32(224))
    assert order.shape_expr[0].name == "(T*16)" and offs.shape_expr == [E + 1] and offs.dtype == "I32"
    name, ptx, lp, extra = trtp.defs[("aot_impl", moe_aot.SORT)](ids, i32(E), i32(224), (order, tok, offs), 0)
    assert (name, ptx, lp.grid_x, lp.grid_y) == (b"kern", b"PTX", E + 1, 1)
    assert extra[0] == "exprs" and extra[1][0][1].name == "(T*16)"
    assert compiled[-1][:2] == (moe_aot.SORT, "float32")
    x = FakeDesc((T, RL), "BF16")
    w13p, w13s = FakeDesc((E, 2 * I, RL // 2), "U8"), FakeDesc((E, 2 * I, RL // 32), "U8")
    (h,) = [trtp.defs[("register", moe_aot.W13)](x, tok, offs, w13p, w13s, f32(4.0), f32(25.0))]
    assert h.shape_expr[1] == I and h.dtype == "BF16"
    _, _, lp, extra = trtp.defs[("aot_impl", moe_aot.W13)](x, tok, offs, w13p, w13s, f32(4.0), f32(25.0), (h,), 0)
    assert (lp.grid_x, lp.grid_y, lp.block_x, lp.shared_mem, extra) == (24, E, 128, 1024, ("exprs", []))
    assert compiled[-1][:2] == (moe_aot.W13, "bfloat16")
    h = FakeDesc((T * k, I), "BF16")
    w2p, w2s = FakeDesc((E, RL, I // 2), "U8"), FakeDesc((E, RL, I // 32), "U8")
    ypair = trtp.defs[("register", moe_aot.W2)](h, order, FakeDesc((T, k), "F32"), offs, w2p, w2s)
    assert ypair.shape_expr[1] == RL and ypair.dtype == "F32"
    _, _, lp, _ = trtp.defs[("aot_impl", moe_aot.W2)](h, order, FakeDesc((T, k), "F32"), offs, w2p, w2s, (ypair,), 0)
    assert (lp.grid_x, lp.grid_y) == (28, E)
    y = trtp.defs[("register", moe_aot.COMBINE)](FakeDesc((T * k, RL), "F32"), ids, i32(E), i32(224))
    assert y.shape_expr[0] is T and y.shape_expr[1] == RL
    _, _, lp, _ = trtp.defs[("aot_impl", moe_aot.COMBINE)](FakeDesc((T * k, RL), "F32"), ids, i32(E), i32(224),
                                                           (y,), 0)
    assert lp.grid_x is T and lp.grid_y == 14
    with pytest.raises(ValueError, match="latent width must be static"):
        trtp.defs[("aot_impl", moe_aot.W13)](FakeDesc((T, Sym("RL")), "BF16"), tok, offs, w13p, w13s, f32(4.0),
                                             f32(25.0), (h,), 0)


@pytest.mark.gpu
def test_moe_aot_ptx_through_the_driver():
    """The four MoE AOT kernels' PTX (this GPU's target, bf16, inline-PTX dequant) launched through the CUDA driver
    in sequence with TensorRT's convention equal plugins/moe/reference.py at K3-like widths (Rl 512, I 256, 16 local
    experts of 24, top-8, 20 tokens)."""
    E, RL, I, T, k, eo = 16, 512, 256, 20, 8, 4
    x, ids, w, w13p, w13s, w2p, w2s = _moe_case(E, RL, I, T, k, seed=8)
    ref = moe_ref.mxfp4_moe(x.bfloat16().float(), ids, w, w13p, w13s, w2p, w2s, expert_offset=eo)
    d = [t.to(DEV) for t in (x.bfloat16(), ids, w, w13p, w13s, w2p, w2s)]
    M = T * k
    order, tok, offs = (torch.empty(n, dtype=torch.int32, device=DEV) for n in (M, M, E + 1))
    h = torch.empty(M, I, dtype=torch.bfloat16, device=DEV)
    ypair = torch.empty(M, RL, dtype=torch.float32, device=DEV)
    y = torch.full((T, RL), float("nan"), dtype=torch.float32, device=DEV)
    kw = dict(num_local_experts=E, expert_offset=eo, top_k=k, latent=RL, inter=I)
    steps = [(moe_aot.SORT, [d[1], M, order, tok, offs]), (moe_aot.W13, [d[0], tok, offs, d[3], d[4], h]),
             (moe_aot.W2, [h, order, d[2], offs, d[5], d[6], ypair]), (moe_aot.COMBINE, [ypair, d[1], y])]
    kerns = []
    for op, args in steps:
        name, ptx, warps, shared = moe_aot.compile_ptx(op, "bfloat16", **kw)
        kern = DriverKernel(name, ptx, shared)
        kerns.append((kern, kern.params(args)))
        kern.launch(moe_aot.launch_params(op, num_local_experts=E, num_tokens=T, latent=RL, inter=I, warps=warps,
                                          shared=shared), kerns[-1][1])
    torch.cuda.synchronize()
    assert relerr(y, ref) < 2e-2
    for kern, _ in kerns:
        kern.unload()
