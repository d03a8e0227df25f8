"""Devices and tensor-parallel process groups for the runtime (SPMD: one process per TP rank, all running the same
scheduler).

Launch with torchrun, e.g. `torchrun --nproc-per-node 2 -m k3deploy.runtime.generate --model DIR --backend torch ...`:
`init_from_env(device)` reads RANK / WORLD_SIZE / LOCAL_RANK and initializes torch.distributed: gloo for the CPU,
NCCL for CUDA (rank r on GPU LOCAL_RANK; NVLink multicast off, `NCCL_NVLS_ENABLE=0`, unless the environment sets
it). `resolve_device` turns the user's device string into a torch.device with the errors a user can act on.
"""
from __future__ import annotations

import inspect
import logging
import os
import re

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_device(device: "str | torch.device | None") -> torch.device:
    """"cpu" (also None), "cuda" or "cuda:N" (or a torch.device) -> torch.device, without touching CUDA.
    "cuda" stays index-less (see `resolve_device`). Raises ValueError naming the accepted forms."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device = {str(device)!r}: expected 'cpu', 'cuda' or 'cuda:N'")
        return device
    m = _DEVICE_RE.match(device.strip().lower()) if isinstance(device, str) else None
    if m is None or (m.group(1) == "cpu" and m.group(2) not in (None, "0")):
        raise ValueError(f"device = {device!r}: expected 'cpu', 'cuda' or 'cuda:N' (N = a GPU index)")
    kind, idx = m.groups()
    return torch.device("cuda", int(idx)) if kind == "cuda" and idx is not None else torch.device(kind)


def local_rank() -> int:
    """LOCAL_RANK from torchrun's environment (0 when absent)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(device: "str | torch.device | None") -> torch.device:
    """The concrete device for this process: "cpu"/None -> cpu; "cuda" -> cuda:LOCAL_RANK under torchrun
    (WORLD_SIZE > 1), else the current CUDA device; "cuda:N" -> cuda:N.

    Raises ValueError for a malformed string or a GPU index that does not exist (naming how many are visible and
    what to pass instead), RuntimeError when CUDA is asked for and torch sees no GPU."""
    dev = parse_device(device)
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise RuntimeError(f"device = {str(device)!r}: torch sees no CUDA GPU (torch.cuda.is_available() is False: "
                           f"torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                           "use device 'cpu' or install a CUDA build of torch")
    n = torch.cuda.device_count()
    if dev.index is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            idx = local_rank()
            if idx >= n:
                raise ValueError(f"device = 'cuda': this is local rank {idx} but only {n} CUDA device(s) are visible; "
                                 "launch at most one process per GPU (torchrun --nproc-per-node <= GPUs), or, to test "
                                 "several ranks on one GPU, pass device 'cuda:0' with the gloo backend")
        else:
            idx = torch.cuda.current_device()
        return torch.device("cuda", idx)
    if dev.index >= n:
        raise ValueError(f"device = {str(device)!r}: only {n} CUDA device(s) are visible (cuda:0 .. cuda:{n - 1})")
    return dev


def nccl_environment() -> dict[str, str]:
    """Set the NCCL environment our machines need unless the user set it: `NCCL_NVLS_ENABLE=0` (NVLink multicast
    off). Returns the NCCL_* variables in effect. Called by `init_from_env` before NCCL initializes."""
    if "NCCL_NVLS_ENABLE" not in os.environ:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    return {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}


def init_from_env(device: "str | torch.device | None" = None, backend: str | None = None) -> tuple[int, int]:
    """Initialize the default process group from torchrun's environment; returns (rank, world_size).

    Without WORLD_SIZE (or WORLD_SIZE == 1) nothing is initialized and (0, 1) is returned. `device` is the one
    the model runs on (default CPU): CPU -> gloo; CUDA -> `torch.cuda.set_device(resolve_device(device))` and
    NCCL, with `NCCL_NVLS_ENABLE=0` set unless already in the environment. `backend` overrides the choice
    ("gloo" with device "cuda:0" puts several ranks on one GPU: gloo stages CUDA tensors through host memory;
    NCCL refuses two ranks on one GPU). Raises ValueError / RuntimeError as `resolve_device`, ValueError for an
    unknown backend or NCCL with a CPU device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dev = resolve_device(device)
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend = {backend!r}: choose 'gloo' or 'nccl'")
        if backend == "nccl" and dev.type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA device; pass device 'cuda' (or use gloo on the CPU)")
        kw = {}
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            if backend == "nccl":
                nccl_environment()                                # NVLink multicast must stay off on our machines
                if dev.index != local_rank():
                    log.warning("rank on %s but LOCAL_RANK is %d: NCCL cannot share one GPU between ranks", dev,
                                local_rank())
                if "device_id" in inspect.signature(dist.init_process_group).parameters:
                    kw["device_id"] = dev
        dist.init_process_group(backend, **kw)
        log.info("rank %d/%d initialized (%s, %s, NCCL_NVLS_ENABLE=%s)", dist.get_rank(), world, backend, dev,
                 os.environ.get("NCCL_NVLS_ENABLE"))
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
