"""Helpers shared by the op references and the model reference."""
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
