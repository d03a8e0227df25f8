"""CUDA-graph capture for the benchmark scripts (bench_kernels.py, sweep_kda_decode_tiles.py): one helper."""
from __future__ import annotations

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
