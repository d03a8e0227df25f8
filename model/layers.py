"""Building blocks of the fp32 reference (MODEL.md §2, §6) and the tensor-parallel linear types (§10).

Tensor parallelism is a property of the linear layer's type: `ColumnLinear` holds a slice of the output
rows (no communication), `RowLinear` a slice of the input columns (its partial output is all-reduced through
`Comm`), `Linear` is replicated. `model/sharding.py` cuts checkpoint tensors with the same split names.
"""
from __future__ import annotations

import dataclasses

import torch

from plugins.common import acc


@dataclasses.dataclass
class Comm:
    """The tensor/expert-parallel group of one rank. size == 1 means no communication.

    `group` is a torch.distributed process group (gloo on CPU, NCCL on GPU) or None for the default group.
    """

    rank: int = 0
    size: int = 1
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks (in place for size > 1); returns x."""
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order)."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class Linear:
    """Replicated y = x @ W.T with W [out, in] kept in fp32 (bf16 checkpoint weights are upcast losslessly)."""

    split = "rep"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.to(acc())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(acc()) @ self.weight.t()


class ColumnLinear(Linear):
    """Output rows split across TP ranks (dim 0 of W); the output is the rank's slice, no communication."""

    split = "col"


class RowLinear(Linear):
    """Input columns split across TP ranks (dim 1 of W); the partial product is all-reduced."""

    split = "row"

    def __call__(self, x: torch.Tensor, comm: Comm | None = None) -> torch.Tensor:  # type: ignore[override]
        y = x.to(acc()) @ self.weight.t()
        return comm.all_reduce(y) if comm is not None else y


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """w ⊙ x·rsqrt(mean(x², -1) + eps), fp32 (§2.1). x [..., D], w [D] or None (no weight)."""
    x = x.to(acc())
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.to(acc())


def attn_res(sources: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Block AttnRes read (§6.2): sources [T, R, d] -> [T, d].

    Scores use RMS-normalized sources against the folded query norm_w ⊙ proj_w[0]; the softmax over the R
    sources (fp32, no temperature) mixes the raw sources.
    """
    k = rms_norm(sources, None, eps)
    s = (k * (norm_w.to(acc()) * proj_w.to(acc()).reshape(-1))).sum(-1)
    p = torch.softmax(s, dim=-1)
    return (p[..., None] * sources.to(acc())).sum(1)
