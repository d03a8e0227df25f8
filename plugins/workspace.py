"""Caller-provided scratch memory for the GPU kernels (plugins/<op>/kernels.py): the workspace convention.

Every kernel entry point takes an optional keyword ``workspace: torch.Tensor | None = None`` (1-D ``uint8`` on the
kernel's device) and has a module-level ``<entry>_workspace_bytes(...)`` computed from shape quantities only (an
upper bound for every problem no larger than its arguments; the TensorRT plugins evaluate it on the profile's max
dims, plugins/trt_common.py). With a workspace every scratch tensor is carved out of it (:class:`Workspace`), so a
CUDA-graph capture or a TensorRT ``enqueue`` allocates nothing; without one the scratch is allocated as before.

Layout rule shared by both sides: items are carved in a fixed order, each starting at a :data:`WORKSPACE_ALIGN`
(256) byte aligned *address*; :func:`plan_bytes` adds one alignment of slack for a base pointer that is not itself
aligned. So ``plan_bytes(items)`` bytes always hold ``items`` carved by :class:`Workspace`.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

WORKSPACE_ALIGN = 256
# Version of the `*_workspace_bytes` rules. A TensorRT engine's workspace is sized by the rules of the code that
# built it (get_workspace_size at build time) while enqueue carves it by the running code's rules, so engines
# record it (engines/build.py, manifest "workspace_rules") and the runtime refuses others. Bump it whenever a rule
# can grow. 2: KdaDecode's V tile at K >= 128 splits (counter scratch) at every batch.
WORKSPACE_RULES = 2


def workspace_rules_of(manifest: dict) -> int:
    """The `WORKSPACE_RULES` an engine manifest's engines were sized by (1: recorded before the field existed)."""
    return int(manifest.get("workspace_rules", 1))


def align_up(n: int, align: int = WORKSPACE_ALIGN) -> int:
    """Smallest multiple of ``align`` >= n."""
    return (int(n) + align - 1) // align * align


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    return int(math.prod(int(s) for s in shape)) * dtype.itemsize


def plan_bytes(items: Iterable[tuple[Sequence[int], torch.dtype]]) -> int:
    """Workspace bytes that hold ``items`` ((shape, dtype) in carve order) for any base pointer; 0 for no items."""
    sizes = [nbytes(s, d) for s, d in items]
    if not sizes:
        return 0
    return WORKSPACE_ALIGN + sum(align_up(n) for n in sizes)


class Workspace:
    """Carves aligned scratch tensors out of a caller's workspace, or allocates them when there is none.

    buf: 1-D contiguous uint8 tensor or None; device: where allocations go when ``buf`` is None; owner: name used in
    error messages. :meth:`empty` raises ValueError (naming the owner and the ``*_workspace_bytes`` helper) when the
    workspace is too small. Views alias ``buf``: nothing is allocated, nothing synchronizes."""

    def __init__(self, buf: torch.Tensor | None, device, owner: str = "kernel"):
        self.owner = owner
        self.device = torch.device(device) if buf is None else buf.device
        if buf is not None:
            if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
                raise ValueError(f"{owner}: workspace must be a contiguous 1-D uint8 tensor, got "
                                 f"{buf.dtype} shape {tuple(buf.shape)}")
            if torch.device(device).type != buf.device.type:
                raise ValueError(f"{owner}: workspace is on {buf.device}, the tensors on {device}")
        self.buf = buf
        self._base = 0 if buf is None else buf.data_ptr()
        self._off = 0

    @property
    def given(self) -> bool:
        return self.buf is not None

    @property
    def used(self) -> int:
        """Bytes of ``buf`` consumed so far (alignment padding included)."""
        return self._off

    def _next_start(self) -> int:
        return align_up(self._base + self._off) - self._base

    def remaining(self) -> int:
        """Bytes still available to the next item, after aligning it (0 without a workspace)."""
        if self.buf is None:
            return 0
        return max(0, self.buf.numel() - self._next_start())

    def fits(self, items: Iterable[tuple[Sequence[int], torch.dtype]]) -> bool:
        """Whether ``items`` ((shape, dtype) in carve order) fit in what is left (always True without a workspace)."""
        if self.buf is None:
            return True
        off = self._off
        for shape, dtype in items:
            off = align_up(self._base + off) - self._base + nbytes(shape, dtype)
        return off <= self.buf.numel()

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of ``shape``/``dtype``: a view of the workspace, or a fresh allocation."""
        shape = tuple(int(s) for s in shape)
        if self.buf is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        start = self._next_start()
        n = nbytes(shape, dtype)
        if start + n > self.buf.numel():
            raise ValueError(f"{self.owner}: workspace of {self.buf.numel()} bytes is too small (needs at least "
                             f"{start + n} bytes so far); size it with the op's *_workspace_bytes() helper")
        self._off = start + n
        return self.buf[start:start + n].view(dtype).view(shape)
