"""Helpers shared by the benchmark scripts (bench_kernels.py, sweep_kda_decode_tiles.py, ncu_moe.py,
moe_decode_floor.py, profile_kda_prefill.py, bench_decode.py): CUDA-graph capture, the KDA decode step's inputs, the
kernels' own choices forced for A/B timing, and the device copy rate. Imported from the scripts' own folder
(``python benchmarks/<script>.py``)."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch


def capture_graph(calls, warmup=1):
    """One CUDA graph of `calls` (a list of thunks) in order, after `warmup` eager passes on a side stream (Triton
    compiles and fla autotunes there, not during capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            for fn in calls:
                fn()
    torch.cuda.current_stream().wait_stream(s)
    gph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gph):
        for fn in calls:
            fn()
    return gph


def kda_decode_inputs(B: int, H: int, K: int, device, act: torch.dtype = torch.bfloat16):
    """Random inputs of one KDA decode step (`plugins.kda.kernels.kda_decode`, MODEL.md §4) for B tokens, H heads of
    width K, P = H*K: (d, state, conv, slots) with d = {qkv [B, 3P], f [B, P], b [B, H], g [B, P] in `act`; conv_w
    [3P, 4], A_log [H], dt_bias [P], o_norm_w [K] fp32}, state [B+1, H, K, K] fp32, conv [B+1, 3P, 3] `act` and
    slots [B] int32 = a permutation of 1..B (slot 0, the padding sentinel, unused)."""
    P = H * K
    d = dict(qkv=torch.randn(B, 3 * P, device=device).to(act), f=torch.randn(B, P, device=device).to(act),
             b=torch.randn(B, H, device=device).to(act), g=torch.randn(B, P, device=device).to(act),
             conv_w=torch.randn(3 * P, 4, device=device) * 0.5, A_log=torch.randn(H, device=device) * 0.5,
             dt_bias=torch.randn(P, device=device) * 0.3, o_norm_w=torch.rand(K, device=device) + 0.5)
    state = torch.randn(B + 1, H, K, K, device=device) * 0.1
    conv = torch.randn(B + 1, 3 * P, 3, device=device).to(act)
    slots = (torch.randperm(B, device=device) + 1).int()
    return d, state, conv, slots


@contextlib.contextmanager
def forced(module, rule: str, value):
    """Within the block, `module`'s choice function `rule` returns `value` whatever its arguments (the kernels'
    private variants for A/B timing: e.g. ``forced(kda_k, "_decode_block_v", 32)``, ``forced(moe_k, "_pick_impl",
    "legacy")``); value None leaves the rule as it is. A CUDA graph captured inside keeps the forced choice."""
    if value is None:
        yield
        return
    with mock.patch.object(module, rule, lambda *args, **kwargs: value):
        yield


def copy_rate_gbps(device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """The device's copy rate in GB/s: a contiguous copy of `nbytes` (read) into another buffer (written), 2 * nbytes
    per copy over the median of `reps` CUDA-event-timed copies after 3 warm-up copies (the bound of
    benchmarks/bench_decode.py divides the bytes a step must move by it). CUDA only."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * nbytes / sorted(times)[len(times) // 2] / 1e9
