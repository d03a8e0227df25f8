"""benchmarks/bench_common.py: the KDA decode inputs the benchmarks time, against the kernel and the reference
(CPU: TRITON_INTERPRET=1)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the first triton import

from k3deploy.plugins.kda import kernels as kda_k          # noqa: E402
from k3deploy.plugins.kda import reference as kda_ref      # noqa: E402
from kernel_checks import benchmark_module, relerr         # noqa: E402  (tests/kernel_checks.py)


def test_bench_common_kda_inputs_drive_the_kernel():
    """benchmarks/bench_common.py's KDA decode inputs (what bench_kernels.py and the tile sweep time): the shapes and
    dtypes its docstring gives, slots a permutation of 1..B, and the kernel on them equals the fp32 reference."""
    bc = benchmark_module("bench_common")
    B, H, K = 3, 2, 16
    d, state, conv, slots = bc.kda_decode_inputs(B, H, K, "cpu", torch.float32)
    P = H * K
    assert {k: tuple(v.shape) for k, v in d.items()} == {"qkv": (B, 3 * P), "f": (B, P), "b": (B, H), "g": (B, P),
                                                         "conv_w": (3 * P, 4), "A_log": (H,), "dt_bias": (P,),
                                                         "o_norm_w": (K,)}
    assert state.shape == (B + 1, H, K, K) and conv.shape == (B + 1, 3 * P, 3) and slots.dtype == torch.int32
    assert sorted(slots.tolist()) == [1, 2, 3]
    ro, rs, _ = kda_ref.kda_decode(**d, state=state.clone(), conv=conv.clone(), slots=slots, num_heads=H, head_dim=K)
    o, st, _ = kda_k.kda_decode(**d, state=state.clone(), conv=conv.clone(), slots=slots, num_heads=H, head_dim=K)
    assert relerr(o, ro) < 1e-5 and relerr(st[slots.long()], rs[slots.long()]) < 1e-5
