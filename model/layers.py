"""Building blocks of the fp32 reference (MODEL.md §2, §6) and the tensor-parallel linear types (§10).

Tensor parallelism is a property of the linear layer's type: `ColumnLinear` holds a slice of the output
rows (no communication), `RowLinear` a slice of the input columns (its partial output is all-reduced through
`Comm`), `Linear` is replicated. `model/sharding.py` cuts checkpoint tensors with the same split names.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from k3deploy.plugins.common import acc
from k3deploy.plugins.glue.reference import attn_res, rms_norm  # noqa: F401  (the reference's building blocks)


@dataclasses.dataclass
class Comm:
    """The tensor/expert-parallel group of one rank. size == 1 means no communication.

    `group` is a torch.distributed process group (gloo on CPU, NCCL on GPU; gloo also takes CUDA tensors, staged
    through host memory) or None for the default group. Tensors may live on any device the group's backend
    supports; they must be dense.

    Collective timing (opt-in): with `profile = True` every collective is counted and timed per op name
    ("all_reduce", "all_gather"): CUDA tensors with a pair of CUDA events on the current stream (no host sync; the
    events are resolved by `stats()`), CPU tensors with `time.perf_counter` around the blocking call. With
    `profile = False` (the default) a collective costs one attribute test more than the bare torch.distributed
    call, and nothing is recorded. The time is what the collective takes in the stream, including waiting for
    the slowest rank to arrive.
    """

    rank: int = 0
    size: int = 1
    group: object = None
    profile: bool = False
    _calls: dict = dataclasses.field(default_factory=dict, repr=False)
    _bytes: dict = dataclasses.field(default_factory=dict, repr=False)
    _seconds: dict = dataclasses.field(default_factory=dict, repr=False)
    _pending: list = dataclasses.field(default_factory=list, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks (in place for size > 1 when x is contiguous); returns the summed tensor."""
        if self.size > 1:
            import torch.distributed as dist
            if not x.is_contiguous():
                x = x.contiguous()
            if self.profile:
                t = self._start(x)
                dist.all_reduce(x, group=self.group)
                self._stop("all_reduce", x, t)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order)."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(self.size)]
        x = x.contiguous()
        if self.profile:
            t = self._start(x)
            dist.all_gather(parts, x, group=self.group)
            self._stop("all_gather", x, t)
        else:
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    # ---- profiling ----
    def _start(self, x: torch.Tensor):
        if x.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _stop(self, op: str, x: torch.Tensor, t0) -> None:
        self._calls[op] = self._calls.get(op, 0) + 1
        self._bytes[op] = self._bytes.get(op, 0) + x.numel() * x.element_size()
        if isinstance(t0, float):
            self._seconds[op] = self._seconds.get(op, 0.0) + time.perf_counter() - t0
        else:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pending.append((op, t0, ev))

    def stats(self) -> dict[str, dict[str, float]]:
        """{op: {"calls", "bytes", "seconds"}} accumulated since the last `reset_stats` (synchronizes the
        device first when CUDA events are pending). Empty when profiling was off or size == 1. `bytes` counts
        this rank's input (all_reduce: the reduced tensor; all_gather: the local part)."""
        if self._pending:
            torch.cuda.synchronize()
            for op, a, b in self._pending:
                self._seconds[op] = self._seconds.get(op, 0.0) + a.elapsed_time(b) / 1e3
            self._pending.clear()
        return {op: {"calls": n, "bytes": self._bytes.get(op, 0), "seconds": self._seconds.get(op, 0.0)}
                for op, n in sorted(self._calls.items())}

    def reset_stats(self) -> None:
        """Forget the counters (and drop pending CUDA events without waiting for them)."""
        self._calls.clear()
        self._bytes.clear()
        self._seconds.clear()
        self._pending.clear()


DENSE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dense_dtype_name(name: str) -> str:
    """The canonical dense_dtype name of an alias: "fp32" -> "float32", "bf16" -> "bfloat16" (else unchanged); the
    argparse `type` of every --dense-dtype option."""
    return {"fp32": "float32", "bf16": "bfloat16"}.get(name, name)


def dense_dtype(name: "str | torch.dtype | None") -> torch.dtype | None:
    """The dtype of the dense weights for a `dense_dtype` argument: None (keep fp32), "float32", "bfloat16" (or
    "fp32" / "bf16", or the torch dtypes). Raises ValueError naming the field for anything else."""
    if name is None or isinstance(name, torch.dtype) and name in DENSE_DTYPES.values():
        return name
    alias = dense_dtype_name(str(name))
    if alias not in DENSE_DTYPES:
        raise ValueError(f"dense_dtype = {name!r}: choose 'float32' (the reference precision) or 'bfloat16' "
                         "(half the weight bytes; bf16 GEMMs)")
    return DENSE_DTYPES[alias]


def matmul_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in the accumulation dtype: x [..., in], w [out, in] -> [..., out] in acc(). A bf16 w (dense_dtype)
    multiplies bf16-rounded x in a bf16 GEMM (torch.matmul on bf16; its output rounded to bf16, then widened);
    any other w multiplies in acc() as the reference always did."""
    if w.dtype == torch.bfloat16:
        return (x.to(torch.bfloat16) @ w.t()).to(acc())
    return x.to(acc()) @ w.t()


class Linear:
    """Replicated y = x @ W.T with W [out, in] in fp32 (bf16 checkpoint weights are upcast losslessly), or in the
    dtype `cast` set (bf16: `matmul_t`). y is returned in the accumulation dtype (fp32)."""

    split = "rep"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.to(acc())

    def cast(self, dtype: torch.dtype) -> None:
        """Keep W in `dtype` from now on (K3Model's dense_dtype)."""
        self.weight = self.weight.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_t(x, self.weight)


class ColumnLinear(Linear):
    """Output rows split across TP ranks (dim 0 of W); the output is the rank's slice, no communication."""

    split = "col"


class RowLinear(Linear):
    """Input columns split across TP ranks (dim 1 of W); the partial product is all-reduced."""

    split = "row"

    def __call__(self, x: torch.Tensor, comm: Comm | None = None) -> torch.Tensor:  # type: ignore[override]
        y = matmul_t(x, self.weight)
        return comm.all_reduce(y) if comm is not None else y
