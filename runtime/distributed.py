"""Tensor-parallel process groups for the runtime (SPMD: one process per TP rank, all running the same scheduler).

Launch with torchrun, e.g. `torchrun --nproc-per-node 2 -m runtime.generate --model DIR --backend torch ...`:
`init_from_env()` reads RANK / WORLD_SIZE and initializes torch.distributed (NCCL when CUDA is available, else gloo).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def init_from_env() -> tuple[int, int]:
    """Initialize the default process group from torchrun's environment; returns (rank, world_size).
    Without WORLD_SIZE (or WORLD_SIZE == 1) nothing is initialized and (0, 1) is returned."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        log.info("rank %d/%d initialized (%s)", dist.get_rank(), world, backend)
    return dist.get_rank(), dist.get_world_size()


def check_group(tp: int, rank: int) -> None:
    """Raise ValueError unless torch.distributed is initialized with world size tp and this process is `rank`."""
    if not dist.is_initialized():
        raise ValueError(f"tp = {tp}: needs torch.distributed initialized with {tp} processes "
                         "(launch with torchrun --nproc-per-node TP; runtime.distributed.init_from_env)")
    if dist.get_world_size() != tp or dist.get_rank() != rank:
        raise ValueError(f"tp = {tp}, rank = {rank}: the process group has world size {dist.get_world_size()} and "
                         f"this process is rank {dist.get_rank()}; launch one process per TP rank")


def shutdown() -> None:
    """Destroy the process group (call before exit: a live gloo group can abort the process at teardown)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
