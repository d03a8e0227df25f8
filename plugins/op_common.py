"""Shared plumbing of the torch.library ops (plugins/<op>/op.py)."""
from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)


def cuda_kernels(op: str):
    """The module `k3deploy.plugins.<op>.kernels` when CUDA is available and it imports, else None (the CPU
    reference then stays the only implementation; a warning says why)."""
    if not torch.cuda.is_available():
        return None
    try:
        return importlib.import_module(f"k3deploy.plugins.{op}.kernels")
    except Exception as e:  # triton missing or kernels broken
        log.warning("plugins.%s.kernels not importable (%s); kimi::%s_* have no CUDA implementation", op, e, op)
        return None
