"""CUDA graphs of the decode step for the torch backend.

A decode step of the PyTorch model launches ~500 kernels from Python (k3-slice: 5 layers). At TP > 1 each rank's
GPU work shrinks while launching does not, so an eager step is host-bound and the ranks wait for each other in the
all-reduces (eager TP=2 is no faster than TP=1; the decode-step rows of benchmarks/README.md). `DecodeGraphs` captures the whole decode forward (embedding, every layer
with its all-reduces, head) once per batch bucket and replays it:

* buckets: batch sizes 1, 2, 4, ... up to `max_batch` (and `max_batch` itself); a batch of B runs in the
  smallest bucket >= B, the extra rows are padding rows (token 0, slot 0, context 0, block-table column 0 = block 0:
  MODEL.md §9 sentinels), which touch only block 0 (a padding row attends over the one latent it writes there);
  the KDA decode kernel leaves slot 0 untouched (masked stores), the other ops never index it;
* static inputs: ids [Bmax] int64, slots, context_lens [Bmax] int32, block tables [Bmax, max_blocks] int32,
  cu_seqlens = 0..Bmax, logits rows 0..B; a step copies the batch into the first rows (block-table columns past the
  batch's width keep stale ids: a sequence never reads past its own blocks), sets the padding rows, replays the
  bucket's graph and returns the wanted logits rows (a copy);
* the pools are captured by address: the ops must update them in place (`ops="kernels"`), and the cache must keep
  handing over the same tensors (`HybridCache.pools`); the tensors seen at capture are remembered and a forward
  with any other pool tensor raises ValueError;
* capture (under the model's CUDA device, on a stream of that device): two eager warm-up steps of padding rows
  per bucket (Triton compiles, cuBLAS handles, NCCL communicators), then `torch.cuda.graph` into one memory pool
  shared by all buckets, largest first; collectives (NCCL) are captured with the rest.

Prefill is never captured (its shapes change every step). The MLA decode kernel takes its split count from the
static block-table width and divides each sequence's own context among the splits, so wide tables cost only the
log-sum-exp combine over more (mostly empty) splits.
"""
from __future__ import annotations

import logging
import time

import torch

from k3deploy.model.reference import Batch

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes that get a graph: powers of two below max_batch, then max_batch. ValueError if < 1."""
    if max_batch < 1:
        raise ValueError(f"max_batch = {max_batch}: must be >= 1")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeGraphs:
    """Decode forwards of `model` (a `model.reference.K3Model` on CUDA with in-place ops, or its fused-glue form
    `runtime.fused.FusedModel`: anything with `device`, `ops` and `forward_on_device`) replayed from CUDA graphs.

    pools: the cache's pools {layer: {name: tensor}} (captured by address; the tensors are remembered); max_batch:
    largest decode batch; max_blocks: block-table width (latent blocks per sequence at the longest context).
    `capture=False` runs the same padded static-buffer path eagerly (any device: tests the padding on the CPU).
    Raises ValueError for max_batch/max_blocks < 1, capture on a non-CUDA device, or a model whose ops do not update
    the pools in place."""

    def __init__(self, model, pools: dict, max_batch: int, max_blocks: int, *, capture: bool = True):
        if max_blocks < 1:
            raise ValueError(f"max_blocks = {max_blocks}: must be >= 1")
        self.model, self.capture = model, capture
        self.pools = {l: dict(p) for l, p in pools.items()}        # the tensors the graphs read and write
        self.buckets = batch_buckets(max_batch)
        self.max_batch, self.max_blocks = max_batch, max_blocks
        dev = model.device
        if capture and dev.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device; it is on {dev} (pass device 'cuda' "
                             "and ops 'kernels', or leave CUDA graphs off)")
        i32 = dict(dtype=torch.int32, device=dev)
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.zeros(max_batch, **i32)
        self.context_lens = torch.zeros(max_batch, **i32)
        self.block_tables = torch.zeros(max_batch, max_blocks, **i32)
        self.cu_seqlens = torch.arange(max_batch + 1, **i32)
        self.rows = torch.arange(max_batch, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        self.replays = 0                                    # decode forwards served (tests / logs)
        self.padded_rows = 0                                # padding rows run in those forwards
        self._released = False
        self._check_in_place()
        if capture:
            with torch.cuda.device(dev):
                self._capture_all()

    def _check_in_place(self) -> None:
        from k3deploy.plugins.torch_ops import KernelOps
        if self.model.ops is not KernelOps:
            raise ValueError("CUDA graphs need ops that update the pools in place: use ops 'kernels' "
                             f"(the model runs {getattr(self.model.ops, '__name__', self.model.ops)})")

    def _check_pools(self, pools: dict, what: str) -> None:
        for l, p in self.pools.items():
            for name, t in p.items():
                if pools[l][name] is not t:
                    raise ValueError(f"layer {l} pool {name}: {what}")

    def _static_batch(self, n: int) -> tuple[torch.Tensor, Batch, torch.Tensor]:
        return (self.ids[:n], Batch(self.cu_seqlens[: n + 1], self.slots[:n], self.block_tables[:n],
                                    self.context_lens[:n], decode=True), self.rows[:n])

    def _run(self, n: int) -> torch.Tensor:
        ids, batch, rows = self._static_batch(n)
        logits, new = self.model.forward_on_device(ids, batch, self.pools, rows)
        self._check_pools(new, "the ops returned a new tensor; CUDA graphs need pools updated in place "
                               "(ops 'kernels')")
        return logits

    def _pad(self, lo: int, hi: int) -> None:
        """Rows lo..hi padding rows (token 0, slot 0, context 0, block-table column 0 = sentinel block 0)."""
        for t in (self.ids, self.slots, self.context_lens):
            t[lo:hi].zero_()
        self.block_tables[lo:hi, 0].zero_()

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        dev = self.model.device
        self.block_tables.zero_()
        self._pad(0, self.max_batch)                     # capture on padding rows: only the sentinels are touched
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.no_grad(), torch.cuda.stream(side):
            for n in reversed(self.buckets):
                for _ in range(2):
                    self._run(n)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        pool = None
        with torch.no_grad():
            for n in reversed(self.buckets):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=side):
                    self.logits[n] = self._run(n)
                pool = g.pool()
                self.graphs[n] = g
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        log.info("captured decode graphs for batch sizes %s (block tables %d wide) in %.1f s", self.buckets,
                 self.max_blocks, self.capture_s)

    def release(self) -> None:
        """Destroy the graphs (and their captured NCCL work) after the device finished them; call before tearing
        down the process group: a live graph holding NCCL kernels can hang `destroy_process_group`."""
        if self.graphs:
            torch.cuda.synchronize(self.model.device)
        self.graphs.clear()
        self.logits.clear()
        self._released = True

    def bucket(self, n: int) -> int:
        """The graph batch size a decode batch of n runs in. ValueError when n > max_batch."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} > max_batch {self.max_batch} of the captured graphs")

    def forward(self, ids: torch.Tensor, batch: Batch, pools: dict, logits_index: torch.Tensor | None):
        """A decode forward (same contract as `Executor.forward`): ids [B] int64, batch (decode=True, block tables
        at most `max_blocks` wide), pools (the captured tensors), logits_index [M] rows < B or None (all B rows: a
        view of the graph's output, valid until the next replay) -> (logits [M, vocab] fp32 on the device, pools).
        ValueError for a prefill batch, B > max_batch, wider block tables or other pool tensors; RuntimeError after
        `release`. Nothing is written before the checks pass."""
        if self._released:
            raise RuntimeError("the decode graphs were released (executor closed)")
        if not batch.decode:
            raise ValueError("DecodeGraphs runs decode batches only")
        self._check_pools(pools, "not the tensor the graphs were captured with; recapture after reallocating the "
                                 "cache")
        n, mb = int(ids.shape[0]), int(batch.block_tables.shape[1])
        if mb > self.max_blocks:
            raise ValueError(f"block tables {mb} wide > max_blocks {self.max_blocks} of the captured graphs "
                             "(a context past the graphs' max context)")
        b = self.bucket(n)
        self.ids[:n].copy_(ids, non_blocking=True)
        self.slots[:n].copy_(batch.slots, non_blocking=True)
        self.context_lens[:n].copy_(batch.context_lens, non_blocking=True)
        self.block_tables[:n, :mb].copy_(batch.block_tables, non_blocking=True)
        self._pad(n, b)
        self.replays += 1
        self.padded_rows += b - n
        if self.capture:
            self.graphs[b].replay()
            logits = self.logits[b]
        else:
            with torch.no_grad():
                logits = self._run(b)
        if logits_index is None:
            return logits[:n], pools                     # a view of the graph's output: no copy
        return logits.index_select(0, logits_index.to(logits.device)), pools
