"""The hybrid decode-state cache (MODEL.md §9, docs/DESIGN.md "Conventions") and its memory planner.

Pools are allocated from `model.reference.state_spec`, one set per layer of one TP rank:

* KDA layer: `state [S, H/tp, V, K] f32` and `conv [S, 3P/tp, W-1] act` (S = slots). **Slot 0 is the padding
  sentinel**; a request owns one slot (>= 1) in every KDA layer; the slot is zeroed when it is handed out and
  returned at finish, cancel or preemption.
* MLA layer: `cache [NB, BS, 576] act` (NB blocks of BS tokens, replicated over TP). **Block 0 is the padding
  sentinel**; a request owns a block table (list of block ids >= 1) that grows as its tokens arrive.

`HybridCache` does the bookkeeping (never leaks: every slot is free or one request's; every block is free or
held, with reference counts, by requests and prefix-cache snapshots). `plan_memory` derives slot/block/snapshot
counts from a memory budget and formats the plan.

Prefix caching (`num_snapshots > 0`, runtime/prefix_cache.py, docs/PREFIX_CACHING.md): a snapshot pool of KDA rows
and an index of published prefixes. Full latent blocks are then shared read-only between requests and snapshots;
a block a request will still write into is never shared (a restored partial block is copied first). Blocks held
only by snapshots count as available: taking one evicts the least recently used snapshots.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import math

import torch

from k3deploy.model.config import K3Config
from k3deploy.model.reference import allocate_pools, state_spec
from k3deploy.model.sharding import check_parallel
from k3deploy.runtime.prefix_cache import (PrefixChain, PrefixIndex, Snapshot, SnapshotPool, TokenSlice,
                                           copy_tensors, default_snapshot_interval, inside_span)

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30


class CacheFull(RuntimeError):
    """No free KDA slot or not enough free latent blocks for the asked allocation (nothing was allocated)."""


class AdmissionError(ValueError):
    """A request can never fit this cache (its tokens exceed the latent capacity or max_context)."""


# ---- memory planner -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Decode-state memory of ONE rank (bytes are exact integers).

    kda_state_bytes / kda_conv_bytes: per request, summed over the KDA layers (context independent).
    latent_bytes_per_token: over the MLA layers (replicated over TP). block_bytes = block_size x that.
    num_slots includes sentinel slot 0 (= max_batch + 1); num_blocks includes sentinel block 0.
    bytes_per_request: KDA + the latent blocks of one request at max_context.
    num_snapshots: prefix-cache snapshot rows (0 = prefix caching off), each kda_bytes_per_request; their pool
    (snapshot_pool_bytes) is budgeted apart from the slots and blocks.
    """

    tp: int
    ep: int
    act_dtype: torch.dtype
    block_size: int
    max_batch: int
    max_context: int
    budget_bytes: int
    kda_layers: int
    mla_layers: int
    kda_state_bytes: int
    kda_conv_bytes: int
    latent_bytes_per_token: int
    block_bytes: int
    blocks_per_request: int
    bytes_per_request: int
    num_slots: int
    num_blocks: int
    slot_pool_bytes: int
    block_pool_bytes: int
    num_snapshots: int = 0
    snapshot_pool_bytes: int = 0

    @property
    def kda_bytes_per_request(self) -> int:
        return self.kda_state_bytes + self.kda_conv_bytes

    @property
    def total_bytes(self) -> int:
        return self.slot_pool_bytes + self.block_pool_bytes + self.snapshot_pool_bytes

    @property
    def token_capacity(self) -> int:
        """Tokens the usable blocks (all but the sentinel) hold, shared by all requests."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def full_context_requests(self) -> int:
        """How many requests at max_context fit at once in the blocks."""
        return (self.num_blocks - 1) // self.blocks_per_request

    def table(self) -> str:
        """The plan as an aligned text table (bytes exact, MiB/GiB for reading)."""
        def b(n: int) -> str:
            return f"{n:,} B ({n / GiB:.2f} GiB)" if n >= GiB else f"{n:,} B ({n / MiB:.1f} MiB)"
        rows = [
            ("parallel", f"TP={self.tp} EP={self.ep}, act dtype {str(self.act_dtype).replace('torch.', '')}"),
            ("layers", f"{self.kda_layers} KDA + {self.mla_layers} MLA"),
            ("KDA state / request", b(self.kda_state_bytes)),
            ("KDA conv / request", b(self.kda_conv_bytes)),
            ("KDA total / request", b(self.kda_bytes_per_request)),
            ("latent / token", f"{self.latent_bytes_per_token:,} B"),
            ("latent / block", f"{self.block_bytes:,} B (block_size {self.block_size})"),
            (f"request @ {self.max_context:,} tokens", b(self.bytes_per_request)),
            ("slots", f"{self.num_slots} (max_batch {self.max_batch} + sentinel 0)"),
            ("blocks", f"{self.num_blocks:,} (incl. sentinel 0) = {self.token_capacity:,} tokens"),
            ("full-context requests", str(self.full_context_requests)),
            ("slot pools", b(self.slot_pool_bytes)),
            ("block pools", b(self.block_pool_bytes)),
            ("snapshot pool", f"{self.num_snapshots} x KDA total = {b(self.snapshot_pool_bytes)}"
             + ("" if self.num_snapshots else " (prefix caching off)")),
            ("total", b(self.total_bytes)),
            ("budget", b(self.budget_bytes)),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_memory(cfg: K3Config, tp: int = 1, ep: int = 1, budget_bytes: int | None = None, max_batch: int = 8,
                max_context: int | None = None, block_size: int = 64,
                act_dtype: torch.dtype = torch.bfloat16, num_snapshots: int = 0) -> MemoryPlan:
    """Plan the decode-state pools of one rank.

    budget_bytes: device memory available for the pools on one rank (after weights and activations); None =
    exactly enough for `max_batch` requests at `max_context`. Slots = max_batch + 1; num_snapshots: prefix-cache
    snapshot rows of KDA state + conv history (one request's KDA bytes each; 0 = prefix caching off), budgeted
    before the blocks; blocks = 1 + as many as fit in the budget after the slot and snapshot pools, capped at what
    max_batch full-context requests can use (cached prefixes live in blocks no running request needs).
    Raises ValueError naming the argument when tp/ep cannot shard cfg, a size is < 1 (num_snapshots < 0), or the
    budget cannot hold the slot and snapshot pools plus one request at max_context.
    """
    check_parallel(cfg, tp, ep)
    max_context = max_context or cfg.max_position_embeddings
    for name, v in (("max_batch", max_batch), ("max_context", max_context), ("block_size", block_size)):
        if v < 1:
            raise ValueError(f"{name} = {v}: must be >= 1")
    if num_snapshots < 0:
        raise ValueError(f"num_snapshots = {num_snapshots}: must be >= 0 (0 = prefix caching off)")
    spec = state_spec(cfg, tp, act_dtype)
    kda = [l for l in spec if "state" in spec[l]]
    mla = [l for l in spec if "cache" in spec[l]]
    kda_state = sum(spec[l]["state"].nbytes() for l in kda)
    kda_conv = sum(spec[l]["conv"].nbytes() for l in kda)
    per_token = sum(spec[l]["cache"].nbytes() for l in mla)
    block_bytes = per_token * block_size
    bpr = math.ceil(max_context / block_size)
    slot_pool = (max_batch + 1) * (kda_state + kda_conv)
    snap_pool = num_snapshots * (kda_state + kda_conv)
    want_blocks = max_batch * bpr
    if budget_bytes is None:
        budget_bytes = slot_pool + snap_pool + (want_blocks + 1) * block_bytes
    usable = (budget_bytes - slot_pool - snap_pool) // block_bytes - 1 if block_bytes else want_blocks
    if usable < bpr:
        need = slot_pool + snap_pool + (bpr + 1) * block_bytes
        snaps = f" and the snapshot pool ({snap_pool:,} B for {num_snapshots} snapshots)" if num_snapshots else ""
        raise ValueError(f"budget_bytes = {budget_bytes:,}: too small; the slot pools ({slot_pool:,} B for max_batch "
                         f"{max_batch}){snaps} plus one request at max_context {max_context:,} need {need:,} B on each "
                         "rank; raise the budget or lower max_batch / max_context"
                         + (" / num_snapshots" if num_snapshots else ""))
    nblocks = 1 + min(usable, want_blocks)
    return MemoryPlan(tp=tp, ep=ep, act_dtype=act_dtype, block_size=block_size, max_batch=max_batch,
                      max_context=max_context, budget_bytes=budget_bytes, kda_layers=len(kda), mla_layers=len(mla),
                      kda_state_bytes=kda_state, kda_conv_bytes=kda_conv, latent_bytes_per_token=per_token,
                      block_bytes=block_bytes, blocks_per_request=bpr,
                      bytes_per_request=kda_state + kda_conv + bpr * block_bytes, num_slots=max_batch + 1,
                      num_blocks=nblocks, slot_pool_bytes=slot_pool, block_pool_bytes=nblocks * block_bytes,
                      num_snapshots=num_snapshots, snapshot_pool_bytes=snap_pool)


# ---- the cache -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Alloc:
    slot: int
    blocks: list[int]
    num_tokens: int = 0          # tokens whose latents are (or are being) written
    last_snapshot: int = 0       # prefix-cache snapshot position it was restored from or last published
    # `blocks` as int32 (first len(blocks) entries; capacity doubles): block_tables copies rows of it instead of
    # converting a Python list per step, which costs O(context) host time at long contexts
    table: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))

    def add_blocks(self, ids: list[int]) -> None:
        n, cap = len(self.blocks), self.table.numel()
        if n + len(ids) > cap:
            grown = torch.zeros(max(n + len(ids), 2 * cap), dtype=torch.int32)
            grown[:n] = self.table[:n]
            self.table = grown
        self.table[n: n + len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.blocks += ids


@dataclasses.dataclass(eq=False)
class StagedSnapshot:
    """A snapshot taken but not published yet (`HybridCache.stage`): KDA rows in snapshot-pool row `row` (copied,
    or written by the step in progress), `blocks` held for tokens [0, length) of the request `rid` (`alloc`), its
    key chain `chain`. `HybridCache.confirm` publishes it, `HybridCache.drop` gives row and blocks back."""

    rid: str
    alloc: _Alloc
    chain: PrefixChain
    length: int
    row: int
    blocks: tuple[int, ...]
    final: bool = False


class HybridCache:
    """KDA slot pools + paged MLA latent pools of one rank, with per-request allocations, and (num_snapshots > 0)
    the prefix cache: a snapshot pool of KDA rows and an index of published prefixes.

    `pools[layer]` = {"state", "conv"} (KDA) or {"cache"} (MLA), shaped as in the module docstring. The
    reference ops return new pool tensors: `set_pools` writes them back; every copy the cache makes (restore,
    snapshot) is in place, so CUDA-graph addresses stay valid. Slots, blocks and snapshot rows are handed out
    lowest id first (deterministic). Raises CacheFull when a slot/blocks are not free (nothing changes then),
    KeyError for an unknown request id, ValueError for a duplicate one, or (constructor) for sizes < 2 or a
    snapshot_interval that is not a positive multiple of block_size.

    Prefix caching: `lookup` finds the deepest published snapshot of a request's tokens, `allocate(rid, snapshot)`
    restores it into the new slot (copy-on-restore; full blocks shared, a partial block copied), `publish` adds the
    request's state after a given number of its tokens (block aligned while it runs, any position when it
    finishes); `stage` takes such a snapshot for a state that a step not completed yet computes, `confirm` publishes
    it after that step, `drop` gives it back. snapshot_interval (tokens, default
    runtime.prefix_cache.default_snapshot_interval) is where periodic snapshots go (`snapshot_positions`: the executor
    copies them from inside a prefill step, `model.reference.KdaSnapshot`). Blocks held only by snapshots are
    `available`: taking one evicts snapshots, least recently used first; `reset_prefix_cache` evicts them all.
    """

    def __init__(self, cfg: K3Config, num_slots: int, num_blocks: int, block_size: int, tp: int = 1,
                 act_dtype: torch.dtype = torch.float32, device="cpu", max_context: int | None = None,
                 num_snapshots: int = 0, snapshot_interval: int | None = None):
        if num_slots < 2 or num_blocks < 2 or block_size < 1:
            raise ValueError(f"num_slots = {num_slots}, num_blocks = {num_blocks}, block_size = {block_size}: "
                             "need >= 2 slots and blocks (0 is the sentinel) and block_size >= 1")
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots = {num_snapshots}: must be >= 0 (0 = prefix caching off)")
        self.cfg, self.tp, self.act_dtype = cfg, tp, act_dtype
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.max_context = min(max_context or cfg.max_position_embeddings, (num_blocks - 1) * block_size)
        self.pools = allocate_pools(cfg, num_slots, num_blocks, block_size, tp, act_dtype, device)
        self.kda_layers = [l for l, p in self.pools.items() if "state" in p]
        self.mla_layers = [l for l, p in self.pools.items() if "cache" in p]
        self._free_slots = list(range(1, num_slots))
        self._free_blocks = list(range(1, num_blocks))     # a min-heap (heapq): the lowest free ids go first
        self._allocs: dict[str, _Alloc] = {}
        self._holders = [0] * num_blocks                   # requests whose block table holds the block
        self._cached = [0] * num_blocks                    # snapshots holding it
        self._reclaimable = 0                              # blocks held by snapshots only
        self.snapshots: SnapshotPool | None = None
        self.index: PrefixIndex | None = None
        self.snapshot_interval: int | None = None
        self.prefix_stats = dict.fromkeys(("queries", "query_tokens", "hits", "hit_tokens", "snapshots_taken",
                                           "evictions"), 0)
        if num_snapshots:
            interval = default_snapshot_interval(block_size) if snapshot_interval is None else snapshot_interval
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1 or interval % block_size:
                raise ValueError(f"snapshot_interval = {snapshot_interval!r}: must be a positive multiple of the "
                                 f"latent block size {block_size} (tokens between KDA snapshots)")
            self.snapshot_interval = interval
            self.snapshots = SnapshotPool(self.pools, self.kda_layers, num_snapshots)
            self.index = PrefixIndex(block_size)
            self._free_rows = list(range(num_snapshots))
            self._chains: dict[str, PrefixChain] = {}
            self._staged: set[StagedSnapshot] = set()
            self._valid = [0] * num_blocks                 # tokens of a snapshot-held block that snapshots cover
            self._cached_tokens = 0

    @classmethod
    def from_plan(cls, cfg: K3Config, plan: MemoryPlan, device="cpu", snapshot_interval: int | None = None
                  ) -> "HybridCache":
        return cls(cfg, plan.num_slots, plan.num_blocks, plan.block_size, plan.tp, plan.act_dtype, device,
                   plan.max_context, plan.num_snapshots, snapshot_interval)

    # -- counts --
    @property
    def prefix_caching(self) -> bool:
        return self.index is not None

    @property
    def slots_in_use(self) -> int:
        return self.num_slots - 1 - len(self._free_slots)

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by requests or snapshots (not free)."""
        return self.num_blocks - 1 - len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def available_blocks(self) -> int:
        """Free blocks plus those only snapshots hold (evicting every snapshot frees exactly these)."""
        return len(self._free_blocks) + self._reclaimable

    def free_slot_ids(self) -> list[int]:
        return sorted(self._free_slots)

    def free_block_ids(self) -> list[int]:
        return sorted(self._free_blocks)

    def __contains__(self, rid: str) -> bool:
        return rid in self._allocs

    # -- admission --
    def check_admissible(self, total_tokens: int, field: str = "prompt_ids") -> None:
        """Raise AdmissionError when a request that may reach `total_tokens` cached tokens can never fit."""
        if total_tokens > self.max_context:
            raise AdmissionError(f"{field}: the request needs up to {total_tokens} tokens of context; this cache holds "
                                 f"at most {self.max_context} per request (max_context / latent blocks); shorten it")

    def blocks_needed(self, rid: str, n: int) -> int:
        """Extra blocks `append(rid, n)` would take."""
        a = self._allocs[rid]
        return max(0, math.ceil((a.num_tokens + n) / self.block_size) - len(a.blocks))

    def can_append(self, rid: str, n: int) -> bool:
        return self.blocks_needed(rid, n) <= self.available_blocks

    def room(self, rid: str | None) -> int:
        """Tokens that can still be appended to `rid` (or to a new request when None) with the available blocks."""
        if rid is None:
            return self.available_blocks * self.block_size
        a = self._allocs[rid]
        return (len(a.blocks) + self.available_blocks) * self.block_size - a.num_tokens

    # -- allocation --
    def allocate(self, rid: str, snapshot: Snapshot | None = None) -> int:
        """Give `rid` the lowest free slot and returns it: zeroed in every KDA layer with an empty block table, or,
        with a `snapshot` from `lookup`, restored from it (its KDA rows copied into the slot, its full blocks shared,
        its partial block copied into a new block; `num_tokens(rid)` = snapshot.length)."""
        if rid in self._allocs:
            raise ValueError(f"request_id {rid!r}: already holds a slot")
        if not self._free_slots:
            raise CacheFull(f"no free KDA slot ({self.num_slots - 1} in use)")
        self._free_slots.sort()
        slot = self._free_slots.pop(0)
        a = self._allocs[rid] = _Alloc(slot, [])
        if snapshot is None:
            for l in self.kda_layers:
                self.pools[l]["state"][slot].zero_()
                self.pools[l]["conv"][slot].zero_()
        else:
            self._restore(a, snapshot)
        return slot

    def append(self, rid: str, n: int) -> int:
        """Reserve room for `n` more tokens of `rid` (growing its block table); returns the context length before
        them (= where they are written). All or nothing: raises CacheFull when the blocks are not available."""
        a = self._allocs[rid]
        need = self.blocks_needed(rid, n)
        if need > self.available_blocks:
            raise CacheFull(f"request {rid!r}: needs {need} more latent blocks, {self.available_blocks} available")
        if need:
            a.add_blocks([self._take_block() for _ in range(need)])
        start = a.num_tokens
        a.num_tokens += n
        return start

    def free(self, rid: str) -> None:
        """Return the slot and blocks of `rid` (no-op for an unknown id); blocks shared with snapshots stay cached."""
        if self.index is not None:
            self._chains.pop(rid, None)
        a = self._allocs.pop(rid, None)
        if a is None:
            return
        self._free_slots.append(a.slot)
        for blk in a.blocks:
            self._hold(blk, -1)

    def _hold(self, blk: int, delta: int, snapshot: bool = False) -> None:
        """Add `delta` holders of `blk` (a request's table, or a snapshot); a block nobody holds is free."""
        h, c = self._holders[blk], self._cached[blk]
        was = h == 0 and c > 0
        if snapshot:
            c += delta
            self._cached[blk] = c
        else:
            h += delta
            self._holders[blk] = h
        if h < 0 or c < 0:
            raise AssertionError(f"block {blk} released more often than held")
        self._reclaimable += (h == 0 and c > 0) - was
        if h == 0 and c == 0:
            heapq.heappush(self._free_blocks, blk)

    def _take_block(self) -> int:
        """The lowest free block for one request, evicting least recently used snapshots that hold a block no
        request holds until one is free (snapshots whose blocks running requests share stay)."""
        while not self._free_blocks:
            if not self._evict_lru(reclaim=True):
                raise CacheFull("no free latent block")
        blk = heapq.heappop(self._free_blocks)
        self._holders[blk] = 1
        return blk

    # -- prefix cache --
    def _chain(self, rid: str, keys=()) -> PrefixChain:
        if rid not in self._chains:
            self._chains[rid] = PrefixChain(self.block_size, keys)
        return self._chains[rid]

    def lookup(self, rid: str, tokens: TokenSlice, num_tokens: int, keys=()) -> Snapshot | None:
        """The deepest published snapshot of a prefix of `rid`'s tokens (`tokens(start, stop)` gives them, num_tokens
        in all, `keys` its content keys) that leaves at least one token to compute and that `allocate` can restore
        now (a partial block needs an available block besides the snapshot's own); None without prefix caching or
        a match. The match becomes the most recently used snapshot."""
        if self.index is None:
            return None
        chain = self._chain(rid, keys)                 # kept for the request's own snapshots (`publish`)
        snap = self.index.match(chain, tokens, num_tokens - 1) if len(self.index) else None
        if snap is not None and snap.length % self.block_size:
            pinned = sum(1 for b in snap.blocks if self._holders[b] == 0)   # no longer available once restored
            if self.available_blocks - pinned < 1:
                return None
        return snap

    def _restore(self, a: _Alloc, snap: Snapshot) -> None:
        k, r = divmod(snap.length, self.block_size)
        self.snapshots.load(self.pools, snap.row, a.slot)
        ids = list(snap.blocks[:k])
        for b in ids:
            self._hold(b, +1)
        if r:                                         # copy-on-write: the request appends to its own copy
            src = snap.blocks[k]
            self._hold(src, +1)                       # alive while a block is found (may evict `snap` itself)
            dst = self._take_block()
            _copy_rows([self.pools[l]["cache"] for l in self.mla_layers], src, dst, r)
            self._hold(src, -1)
            ids.append(dst)
        a.add_blocks(ids)
        a.num_tokens = a.last_snapshot = snap.length

    def publish(self, rid: str, tokens: TokenSlice, final: bool = False, keys=(), length: int | None = None) -> bool:
        """Snapshot `rid` after its first `length` tokens (default num_tokens(rid)): copy its KDA slot into a snapshot
        row (evicting the least recently used snapshot when none is free) and hold the latent blocks of those tokens.

        Args:
            tokens: `tokens(start, stop)` gives the request's token ids.
            final: the request is finishing and will not write again (any length; else block-aligned only: a
                running request still appends to its partial block).
            keys: the request's content keys (as given to `lookup`, which already recorded them).
            length: 0 < length <= num_tokens(rid). Call only when the slot holds the state after exactly `length`
                tokens and the step that wrote them completed.
        Returns:
            False (nothing done) without prefix caching, for a length it cannot take (0, past num_tokens, not block
            aligned while running, inside a content span), when no row can be freed, or when the same prefix is
            already published (then it becomes the most recent); True when published.
        """
        if self.index is None:
            return False
        a, chain = self._allocs[rid], self._chain(rid, keys)
        length = a.num_tokens if length is None else length
        if not self._snapshottable(a, length, final, chain.keys):
            return False
        key, base = chain.key(length, tokens)
        a.last_snapshot = max(a.last_snapshot, length)
        if key in self.index:
            self.index.touch(key)
            return False
        row = self._take_row(final)
        if row is None:
            return False
        self.snapshots.save(self.pools, a.slot, row)
        blocks = tuple(a.blocks[: math.ceil(length / self.block_size)])
        self._hold_snapshot_blocks(blocks, length)
        self.index.add(Snapshot(key, base, length, row, blocks, final))
        self.prefix_stats["snapshots_taken"] += 1
        return True

    def stage(self, rid: str, length: int, final: bool = False, keys=(), copy: bool = True) -> StagedSnapshot | None:
        """Take a snapshot of `rid` after its first `length` tokens without publishing it: a snapshot row (evicting the
        least recently used snapshot when none is free) and holds on the latent blocks of those tokens, which stay
        out of reach of every request until `confirm` or `drop`. For a state that a step in flight (or the step
        about to run) computes: `confirm` once that step completed, `drop` when it failed.

        Args:
            length, final, keys: as for `publish`.
            copy: copy the slot's KDA rows into the row now (in stream order: after the steps enqueued so far);
                False when the next forward writes them itself (`model.reference.KdaSnapshot`).
        Returns:
            The staged snapshot, or None (nothing done) where `publish` would do nothing for the length or the row.
        """
        if self.index is None:
            return None
        a, chain = self._allocs[rid], self._chain(rid, keys)
        if not self._snapshottable(a, length, final, chain.keys):
            return None
        row = self._take_row(final)
        if row is None:
            return None
        if copy:
            self.snapshots.save(self.pools, a.slot, row)
        blocks = tuple(a.blocks[: math.ceil(length / self.block_size)])
        for b in blocks:
            self._hold(b, +1)                         # held like a request's table: neither free nor evictable
        staged = StagedSnapshot(rid, a, chain, length, row, blocks, final)
        self._staged.add(staged)
        return staged

    def confirm(self, staged: StagedSnapshot, tokens: TokenSlice) -> bool:
        """Publish a staged snapshot (its step completed); `tokens(start, stop)` gives the request's token ids.
        Returns False (its row and blocks given back) when it was dropped already (`reset_prefix_cache`), for a
        prefix already published (that one becomes the most recent) or a length inside a content span."""
        if staged not in self._staged:
            return False
        self._staged.discard(staged)
        key, base = staged.chain.key(staged.length, tokens)
        if self._allocs.get(staged.rid) is staged.alloc:
            staged.alloc.last_snapshot = max(staged.alloc.last_snapshot, staged.length)
        if key in self.index:
            self.index.touch(key)
            self._release(staged)
            return False
        self._hold_snapshot_blocks(staged.blocks, staged.length)
        for b in staged.blocks:
            self._hold(b, -1)
        self.index.add(Snapshot(key, base, staged.length, staged.row, staged.blocks, staged.final))
        self.prefix_stats["snapshots_taken"] += 1
        return True

    def drop(self, staged: StagedSnapshot) -> None:
        """Give back a staged snapshot's row and blocks (its step failed); no-op when confirmed or dropped already."""
        if staged in self._staged:
            self._staged.discard(staged)
            self._release(staged)

    def _release(self, staged: StagedSnapshot) -> None:
        self._free_rows.append(staged.row)
        for b in staged.blocks:
            self._hold(b, -1)

    def _snapshottable(self, a: _Alloc, length: int, final: bool, keys) -> bool:
        """A snapshot of `a` after `length` tokens can be taken: tokens it holds, block aligned unless final, not
        inside a content span."""
        return 0 < length <= a.num_tokens and (final or length % self.block_size == 0) and not inside_span(length, keys)

    def _take_row(self, final: bool) -> int | None:
        """The lowest free snapshot row for a snapshot of kind `final` (end of request, else periodic); when none is
        free, evicting the least recently used snapshot — of the same kind once that kind holds half the rows, so
        that a burst of periodic snapshots (one long prompt) cannot evict every conversation's end-of-reply
        snapshot, nor the reverse. None when nothing can be evicted (all rows staged)."""
        if not self._free_rows:
            same = sum(s.final == final for s in self.index.entries.values())
            if not self._evict_lru(final=final if 2 * same >= self.snapshots.rows else None):
                return None
        self._free_rows.sort()
        return self._free_rows.pop(0)

    def _hold_snapshot_blocks(self, blocks: tuple[int, ...], length: int) -> None:
        """One more snapshot hold on each of `blocks`, the blocks of tokens [0, length)."""
        k, r = divmod(length, self.block_size)
        for i, b in enumerate(blocks):
            if not self._cached[b]:
                self._valid[b] = r if i == k else self.block_size
                self._cached_tokens += self._valid[b]
            self._hold(b, +1, snapshot=True)

    def _evict_lru(self, count: bool = True, final: bool | None = None, reclaim: bool = False) -> bool:
        """Drop the least recently used snapshot (its row and its holds on blocks) — of kind `final` unless None,
        holding a block no request holds when `reclaim`; False when there is none."""
        if self.index is None:
            return False
        snap = next((s for s in self.index.entries.values() if (final is None or s.final == final)
                     and (not reclaim or any(self._holders[b] == 0 for b in s.blocks))), None)
        if snap is None:
            return False
        self.index.remove(snap.key)
        self._free_rows.append(snap.row)
        for b in snap.blocks:
            if self._cached[b] == 1:
                self._cached_tokens -= self._valid[b]
            self._hold(b, -1, snapshot=True)
        self.prefix_stats["evictions"] += count
        return True

    def reset_prefix_cache(self) -> int:
        """Drop every snapshot, staged ones too (their rows and blocks go back to the free lists); returns how many
        published ones."""
        for staged in list(self._staged if self.index is not None else ()):
            self.drop(staged)
        n = 0
        while self._evict_lru(count=False):
            n += 1
        return n

    def snapshot_positions(self, rid: str, start: int, end: int, keys=()) -> list[int]:
        """Where periodic snapshots go strictly inside `rid`'s prefill chunk of tokens [start, end): every multiple of
        snapshot_interval outside every content span, but those less than snapshot_interval tokens after the
        snapshot before them (restored from or published: one more row for little). A chunk that ends on a multiple
        is snapshotted after its step instead. [] without prefix caching."""
        if self.index is None:
            return []
        step, last, out = self.snapshot_interval, self._allocs[rid].last_snapshot, []
        for cut in range((start // step + 1) * step, end, step):
            if not inside_span(cut, keys) and cut - last >= step:
                out.append(cut)
                last = cut
        return out

    def record_admission(self, num_tokens: int, cached: int) -> None:
        """Count one admitted request of `num_tokens` tokens of which `cached` came from the prefix cache."""
        st = self.prefix_stats
        st["queries"] += 1
        st["query_tokens"] += num_tokens
        st["hits"] += cached > 0
        st["hit_tokens"] += cached

    def prefix_metrics(self) -> dict:
        """Prefix-cache gauges and counters ({} when it is off): prefix_cache_hit_rate (cached / looked-up tokens
        of admitted requests), prefix_cache_hit_tokens, prefix_cache_query_tokens, prefix_cache_tokens (tokens
        whose latents snapshots hold now), snapshots_in_use, snapshot_pool_bytes (rows in use x bytes per row),
        latent_blocks_cached (blocks only snapshots hold), snapshots_taken, snapshot_evictions."""
        if self.index is None:
            return {}
        st = self.prefix_stats
        return {"prefix_cache_hit_rate": st["hit_tokens"] / st["query_tokens"] if st["query_tokens"] else 0.0,
                "prefix_cache_hit_tokens": st["hit_tokens"], "prefix_cache_query_tokens": st["query_tokens"],
                "prefix_cache_tokens": self._cached_tokens, "snapshots_in_use": len(self.index),
                "snapshot_pool_bytes": len(self.index) * self.snapshots.bytes_per_row,
                "latent_blocks_cached": self._reclaimable, "snapshots_taken": st["snapshots_taken"],
                "snapshot_evictions": st["evictions"]}

    # -- views --
    def slot(self, rid: str) -> int:
        return self._allocs[rid].slot

    def blocks(self, rid: str) -> list[int]:
        return list(self._allocs[rid].blocks)

    def num_tokens(self, rid: str) -> int:
        return self._allocs[rid].num_tokens

    def block_tables(self, rids: list[str | None]) -> torch.Tensor:
        """[N, MB] int32 block tables of `rids` (None = padding row), right-padded with sentinel block 0."""
        allocs = [self._allocs[r] if r is not None else None for r in rids]
        mb = max([1] + [len(a.blocks) for a in allocs if a is not None])
        out = torch.zeros(len(rids), mb, dtype=torch.int32)
        for i, a in enumerate(allocs):
            if a is not None and a.blocks:
                out[i, : len(a.blocks)] = a.table[: len(a.blocks)]
        return out

    def set_pools(self, pools: dict) -> None:
        """Write back the pools a forward returned (same layers, shapes and dtypes)."""
        for l, p in pools.items():
            for name, t in p.items():
                old = self.pools[l][name]
                if t.shape != old.shape or t.dtype != old.dtype:
                    raise ValueError(f"layer {l} pool {name}: got {t.dtype} {tuple(t.shape)}, "
                                     f"expected {old.dtype} {tuple(old.shape)}")
                self.pools[l][name] = t

    def check_consistent(self) -> None:
        """Assert the bookkeeping invariants (between steps): every slot >= 1 is free or owned by exactly one
        request; every block >= 1 is free or held, and its hold counts equal the request tables, staged snapshots
        and snapshots that list it; no request lists a block twice; a block a request will still write into (from
        its partial block on) is held by that request alone; a snapshot's partial block by that snapshot alone;
        snapshot rows are free or used by exactly one snapshot or staged snapshot."""
        slots = list(self._free_slots) + [a.slot for a in self._allocs.values()]
        if sorted(slots) != list(range(1, self.num_slots)):
            raise AssertionError("cache bookkeeping broken: slots leaked or doubly owned")
        holders, cached = [0] * self.num_blocks, [0] * self.num_blocks
        B = self.block_size
        for rid, a in self._allocs.items():
            if len(set(a.blocks)) != len(a.blocks) or a.num_tokens > len(a.blocks) * B:
                raise AssertionError(f"request {rid}: block table {a.blocks} repeats a block or is too short")
            for b in a.blocks:
                holders[b] += 1
        staged = list(self._staged) if self.index is not None else []
        for st in staged:
            if len(st.blocks) != math.ceil(st.length / B):
                raise AssertionError(f"staged snapshot at {st.length}: {len(st.blocks)} blocks")
            for b in st.blocks:
                holders[b] += 1
        snaps = list(self.index.entries.values()) if self.index is not None else []
        for s in snaps:
            if len(s.blocks) != math.ceil(s.length / B):
                raise AssertionError(f"snapshot at {s.length}: {len(s.blocks)} blocks")
            for b in s.blocks:
                cached[b] += 1
        free = list(self._free_blocks)
        if len(set(free)) != len(free) or any(holders[b] or cached[b] for b in free) or 0 in free:
            raise AssertionError("cache bookkeeping broken: a free block is held, listed twice, or the sentinel")
        held = {b for b in range(1, self.num_blocks) if holders[b] or cached[b]}
        if held | set(free) != set(range(1, self.num_blocks)):
            raise AssertionError("cache bookkeeping broken: blocks leaked (neither free nor held)")
        if holders != self._holders or cached != self._cached:
            raise AssertionError("cache bookkeeping broken: block hold counts differ from the tables and snapshots")
        if self._reclaimable != sum(1 for b in range(self.num_blocks) if not holders[b] and cached[b]):
            raise AssertionError("cache bookkeeping broken: reclaimable block count")
        for rid, a in self._allocs.items():
            for b in a.blocks[a.num_tokens // B:]:
                if holders[b] != 1 or cached[b]:
                    raise AssertionError(f"request {rid}: block {b} it will write into is shared")
        for s in snaps:
            if s.length % B and (holders[s.blocks[-1]] or cached[s.blocks[-1]] != 1):
                raise AssertionError(f"snapshot at {s.length}: its partial block {s.blocks[-1]} is shared")
        if self.index is not None:
            rows = list(self._free_rows) + [s.row for s in snaps] + [st.row for st in staged]
            if sorted(rows) != list(range(self.snapshots.rows)):
                raise AssertionError("cache bookkeeping broken: snapshot rows leaked or doubly used")
            if self._cached_tokens != sum(self._valid[b] for b in range(self.num_blocks) if cached[b]):
                raise AssertionError("cache bookkeeping broken: cached token count")


def _copy_rows(caches: list[torch.Tensor], src: int, dst: int, rows: int) -> None:
    """cache[dst, :rows] <- cache[src, :rows] for every latent pool, in place."""
    copy_tensors([c[dst, :rows] for c in caches], [c[src, :rows] for c in caches])
