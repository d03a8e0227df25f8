"""Decode steps overlapped with the scheduler's host work (`Scheduler(..., overlap=True)`; the default for the torch
backend on a CUDA GPU with the in-place kernels, `TorchExecutor.overlap_decode`). docs/OVERLAP.md.

A synchronous decode step is plan -> batch metadata on the host -> forward -> sampling (the device-to-host copy of
the ids waits for the forward) -> bookkeeping, and the GPU idles during everything but the forward. Overlapped, the
scheduler launches step n+1 before it reads step n's tokens::

    Scheduler.step():  plan n+1 (step n in flight)  ->  DecodePipeline.launch(n+1)  ->  wait(n)  ->  book n

so the GPU runs step n+1 while the host books step n and plans step n+2. `DecodePipeline` is the device side:

* input ids never visit the host: a row continuing from the step in flight gathers its id from that step's sampled
  ids on the device; a row whose last token the host knows (its first decode after a synchronous step) gets it with
  the metadata;
* the metadata (gather index, host ids, slots, context lengths, block tables) is written into one of two pinned host
  buffers and goes to the device in one non_blocking copy; a buffer is rewritten only after the event recorded
  behind its copy;
* sampling is the greedy argmax on the device (`sampling.sample_batch`'s rule for temperature 0; on CUDA one read
  of the logits gives each row's argmax and whether the row is finite: `plugins.glue.kernels.greedy_pick`); the ids, and the
  logprobs when a row asks for them (`sampling.logprob_tensors`), come back in one non_blocking copy each into
  pinned memory behind an event: `wait` is the only synchronization of a step.

Everything runs in order on the device's current stream, so a step's writes to a slot or a block come before any
later use of them. Off CUDA (tests) the same path runs synchronously with pageable buffers.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from k3deploy.model.reference import Batch
from k3deploy.runtime.sampling import logprob_lists, logprob_tensors


@dataclasses.dataclass(eq=False)
class Ticket:
    """One launched decode step: `reqs` its requests (row order; padding rows not included), `rows` each request's
    row, and the host buffers its sampled ids (and logprobs) land in once `event` completed. `staged`: the
    scheduler's (request, runtime.cache.StagedSnapshot) of states this step computes, published once it completed."""

    reqs: list
    rows: dict
    ids: torch.Tensor
    logprobs: tuple | None
    top_k: list
    event: "torch.cuda.Event | None"
    staged: list = dataclasses.field(default_factory=list)


def _greedy_torch(logits: torch.Tensor, ids: torch.Tensor, checked: torch.Tensor) -> None:
    """`plugins.glue.kernels.greedy_pick`'s contract in torch ops (the CPU): logits [B, V] -> ids [B] int64 argmax,
    checked [B] int64 = ids, or -1 for a row holding a NaN or an infinity."""
    torch.argmax(logits, dim=-1, out=ids)
    checked.copy_(torch.where(torch.isfinite(logits).all(-1), ids, -1))


class DecodePipeline:
    """Device side of overlapped decode steps for `executor` (anything with `device` and `forward_on_device(ids,
    batch, pools, logits_index) -> (logits, pools)` enqueuing a decode forward without host reads: TorchExecutor).

    max_rows: rows per step, padding included; max_blocks: block-table width (latent blocks per request at the
    longest context)."""

    def __init__(self, executor, max_rows: int, max_blocks: int):
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(f"max_rows = {max_rows}, max_blocks = {max_blocks}: both must be >= 1")
        self.executor = executor
        dev = self.device = executor.device
        self.cuda = dev.type == "cuda"
        self.max_rows, self.max_blocks = max_rows, max_blocks
        R, size = max_rows, 4 * max_rows + max_rows * max_blocks
        # [gather index | host ids | slots | context lens | block tables (rows x width, row-major)], int32
        self._host = [torch.zeros(size, dtype=torch.int32, pin_memory=self.cuda) for _ in range(2)]
        self._copied: list = [None, None]               # event behind each host buffer's copy to the device
        self._next = 0
        self._meta = torch.zeros(size, dtype=torch.int32, device=dev)
        self._tokens = torch.zeros(2 * R, dtype=torch.long, device=dev)   # [last sampled ids | host ids]
        self._cu = torch.arange(R + 1, dtype=torch.int32, device=dev)
        self._checked = torch.zeros(R, dtype=torch.long, device=dev)
        self._greedy = _greedy_torch
        if self.cuda:                                    # Triton: imported where it runs
            from k3deploy.plugins.glue.kernels import greedy_pick
            self._greedy = greedy_pick

    def launch(self, reqs: list, src: list[int], host_ids: list[int], slots: list[int], context_lens: list[int],
               block_tables: torch.Tensor, pools: dict, top_k: list[int | None]) -> tuple[Ticket, dict]:
        """Enqueue one decode step of B rows (the first len(reqs) real, the rest padding: host id 0, slot 0, context
        0, block 0) and its greedy sampling; returns (the ticket, the pools the forward returned).

        src[i]: the row of the previous launch whose sampled id is row i's input, or -1 for host_ids[i];
        slots, context_lens: per row; block_tables [B, W] int32 host tensor (W <= max_blocks); top_k[i]: logprob
        alternatives wanted for real row i (None: no logprobs). The previous launch must have been waited for or be
        the one whose ids `src` reads (its sampled ids stay on the device until this launch overwrites them).
        Raises ValueError for more than max_rows rows or a wider block table."""
        B, W = block_tables.shape
        if B > self.max_rows or W > self.max_blocks or len(src) != B:
            raise ValueError(f"decode step of {B} rows x {W} blocks ({len(src)} inputs): the pipeline takes "
                             f"{self.max_rows} rows x {self.max_blocks} blocks")
        # the copies and events must be on the device's stream, whatever device this thread has current
        with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
            return self._launch(reqs, src, host_ids, slots, context_lens, block_tables, pools, top_k)

    def _launch(self, reqs, src, host_ids, slots, context_lens, block_tables, pools, top_k):
        B, W = block_tables.shape
        R, n = self.max_rows, len(reqs)
        k = self._next
        self._next ^= 1
        if self._copied[k] is not None:
            self._copied[k].synchronize()               # the copy that last read this buffer is done
        h = self._host[k]
        a = h.numpy()
        a[0:B] = [s if s >= 0 else R + i for i, s in enumerate(src)]
        a[R:R + B] = host_ids
        a[2 * R:2 * R + B] = slots
        a[3 * R:3 * R + B] = context_lens
        end = 4 * R + B * W
        a[4 * R:end] = block_tables.reshape(-1).numpy()
        md = self._meta
        md[:end].copy_(h[:end], non_blocking=True)
        if self.cuda:
            self._copied[k] = torch.cuda.Event()
            self._copied[k].record()
        self._tokens[R:R + B].copy_(md[R:R + B])
        ids = self._tokens.index_select(0, md[:B])
        batch = Batch(self._cu[:B + 1], md[2 * R:2 * R + B], md[4 * R:end].view(B, W), md[3 * R:3 * R + B],
                      decode=True)
        logits, pools = self.executor.forward_on_device(ids, batch, pools, None)
        logits = logits[:n]                              # the real rows (a view: no copy of the logits)
        sampled = self._tokens[:n]
        checked = self._checked[:n]                      # sampled, or -1 for a row with a NaN / Inf
        self._greedy(logits, sampled, checked)
        out = self._pinned((n,), torch.long)
        out.copy_(checked, non_blocking=True)
        lp = None
        if any(t is not None for t in top_k):
            lp = tuple(self._to_host(t) for t in logprob_tensors(logits, sampled, max(t or 0 for t in top_k)))
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return Ticket(list(reqs), {r: i for i, r in enumerate(reqs)}, out, lp, list(top_k), event), pools

    def wait(self, ticket: Ticket) -> tuple[list[int], list | None]:
        """Block until `ticket`'s step finished; returns (sampled ids per real row, -1 for a row whose logits are
        not all finite; per row None or (logprob, [(id, logprob)]) when any row asked for logprobs, else None).
        Raises what the device raised (a CUDA error of the step)."""
        if ticket.event is not None:
            ticket.event.synchronize()
        ids = ticket.ids.tolist()
        if ticket.logprobs is None:
            return ids, None
        chosen, v, i = ticket.logprobs
        return ids, logprob_lists(chosen.tolist(), v.tolist(), i.tolist(), ticket.top_k)

    def _pinned(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        out = self._pinned(t.shape, t.dtype)
        out.copy_(t, non_blocking=True)
        return out
