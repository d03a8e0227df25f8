"""Helpers shared by the op references, the model reference and the kernels."""
from __future__ import annotations

import contextlib

import torch

_ACC = [torch.float32]


def acc() -> torch.dtype:
    """The references' accumulation dtype: fp32, or fp64 inside `compute_dtype(torch.float64)`."""
    return _ACC[-1]


@contextlib.contextmanager
def compute_dtype(dtype: torch.dtype):
    """Run the references in `dtype` (tests use fp64 to check exactness of algebraic identities)."""
    _ACC.append(dtype)
    try:
        yield
    finally:
        _ACC.pop()


_SM_COUNT: dict[int, int] = {}


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA `device` (cached per device index); 8 for a non-CUDA device (the
    Triton interpreter), so launch heuristics stay exercisable on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def index_i32(t: torch.Tensor) -> torch.Tensor:
    """An index tensor of the kernels (slots [N], cu_seqlens [N+1], context_lens [N], block_tables [N, MB]; any
    integer dtype, any device) as a contiguous int32 tensor of the same shape and device: the kernels read it with
    unit strides (the last one for block tables), so a strided view would index other rows. No copy when it already
    is (nothing is allocated inside a CUDA graph then). Values are not checked (int64 ids above 2^31 wrap)."""
    return t.to(torch.int32).contiguous()
