"""The hybrid decode-state cache (MODEL.md §9, docs/DESIGN.md "Conventions") and its memory planner.

Pools are allocated from `model.reference.state_spec`, one set per layer of one TP rank:

* KDA layer: `state [S, H/tp, V, K] f32` and `conv [S, 3P/tp, W-1] act` (S = slots). **Slot 0 is the padding
  sentinel**; a request owns one slot (>= 1) in every KDA layer; the slot is zeroed when it is handed out and
  returned at finish, cancel or preemption.
* MLA layer: `cache [NB, BS, 576] act` (NB blocks of BS tokens, replicated over TP). **Block 0 is the padding
  sentinel**; a request owns a block table (list of block ids >= 1) that grows as its tokens arrive.

`HybridCache` does the bookkeeping (never leaks: every id handed out is in exactly one of the free lists or one
request's allocation). `plan_memory` derives slot/block counts from a memory budget and formats the plan.
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

    @property
    def kda_bytes_per_request(self) -> int:
        return self.kda_state_bytes + self.kda_conv_bytes

    @property
    def total_bytes(self) -> int:
        return self.slot_pool_bytes + self.block_pool_bytes

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
            ("total", b(self.total_bytes)),
            ("budget", b(self.budget_bytes)),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_memory(cfg: K3Config, tp: int = 1, ep: int = 1, budget_bytes: int | None = None, max_batch: int = 8,
                max_context: int | None = None, block_size: int = 64,
                act_dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
    """Plan the decode-state pools of one rank.

    budget_bytes: device memory available for the pools on one rank (after weights and activations); None =
    exactly enough for `max_batch` requests at `max_context`. Slots = max_batch + 1; blocks = 1 + as many as fit
    in the budget after the slot pools, capped at what max_batch full-context requests can use.
    Raises ValueError naming the argument when tp/ep cannot shard cfg, a size is < 1, or the budget cannot hold
    the slot pools plus one request at max_context.
    """
    check_parallel(cfg, tp, ep)
    max_context = max_context or cfg.max_position_embeddings
    for name, v in (("max_batch", max_batch), ("max_context", max_context), ("block_size", block_size)):
        if v < 1:
            raise ValueError(f"{name} = {v}: must be >= 1")
    spec = state_spec(cfg, tp, act_dtype)
    kda = [l for l in spec if "state" in spec[l]]
    mla = [l for l in spec if "cache" in spec[l]]
    kda_state = sum(spec[l]["state"].nbytes() for l in kda)
    kda_conv = sum(spec[l]["conv"].nbytes() for l in kda)
    per_token = sum(spec[l]["cache"].nbytes() for l in mla)
    block_bytes = per_token * block_size
    bpr = math.ceil(max_context / block_size)
    slot_pool = (max_batch + 1) * (kda_state + kda_conv)
    want_blocks = max_batch * bpr
    if budget_bytes is None:
        budget_bytes = slot_pool + (want_blocks + 1) * block_bytes
    usable = (budget_bytes - slot_pool) // block_bytes - 1 if block_bytes else want_blocks
    if usable < bpr:
        need = slot_pool + (bpr + 1) * block_bytes
        raise ValueError(f"budget_bytes = {budget_bytes:,}: too small; the slot pools ({slot_pool:,} B for max_batch "
                         f"{max_batch}) plus one request at max_context {max_context:,} need {need:,} B on each rank; "
                         "raise the budget or lower max_batch / max_context")
    nblocks = 1 + min(usable, want_blocks)
    return MemoryPlan(tp=tp, ep=ep, act_dtype=act_dtype, block_size=block_size, max_batch=max_batch,
                      max_context=max_context, budget_bytes=budget_bytes, kda_layers=len(kda), mla_layers=len(mla),
                      kda_state_bytes=kda_state, kda_conv_bytes=kda_conv, latent_bytes_per_token=per_token,
                      block_bytes=block_bytes, blocks_per_request=bpr,
                      bytes_per_request=kda_state + kda_conv + bpr * block_bytes, num_slots=max_batch + 1,
                      num_blocks=nblocks, slot_pool_bytes=slot_pool, block_pool_bytes=nblocks * block_bytes)


# ---- the cache -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Alloc:
    slot: int
    blocks: list[int]
    num_tokens: int = 0          # tokens whose latents are (or are being) written
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


class HybridCache:
    """KDA slot pools + paged MLA latent pools of one rank, with per-request allocations.

    `pools[layer]` = {"state", "conv"} (KDA) or {"cache"} (MLA), shaped as in the module docstring. The
    reference ops return new pool tensors: `set_pools` writes them back. Slots and blocks are handed out lowest
    id first (deterministic). Raises CacheFull when a slot/blocks are not free (nothing changes then),
    KeyError for an unknown request id, ValueError for a duplicate one.
    """

    def __init__(self, cfg: K3Config, num_slots: int, num_blocks: int, block_size: int, tp: int = 1,
                 act_dtype: torch.dtype = torch.float32, device="cpu", max_context: int | None = None):
        if num_slots < 2 or num_blocks < 2 or block_size < 1:
            raise ValueError(f"num_slots = {num_slots}, num_blocks = {num_blocks}, block_size = {block_size}: "
                             "need >= 2 slots and blocks (0 is the sentinel) and block_size >= 1")
        self.cfg, self.tp, self.act_dtype = cfg, tp, act_dtype
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.max_context = min(max_context or cfg.max_position_embeddings, (num_blocks - 1) * block_size)
        self.pools = allocate_pools(cfg, num_slots, num_blocks, block_size, tp, act_dtype, device)
        self.kda_layers = [l for l, p in self.pools.items() if "state" in p]
        self.mla_layers = [l for l, p in self.pools.items() if "cache" in p]
        self._free_slots = list(range(1, num_slots))
        self._free_blocks = list(range(1, num_blocks))     # a min-heap (heapq): the lowest free ids go first
        self._allocs: dict[str, _Alloc] = {}

    @classmethod
    def from_plan(cls, cfg: K3Config, plan: MemoryPlan, device="cpu") -> "HybridCache":
        return cls(cfg, plan.num_slots, plan.num_blocks, plan.block_size, plan.tp, plan.act_dtype, device,
                   plan.max_context)

    # -- counts --
    @property
    def slots_in_use(self) -> int:
        return self.num_slots - 1 - len(self._free_slots)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - 1 - len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

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
        return self.blocks_needed(rid, n) <= len(self._free_blocks)

    def room(self, rid: str | None) -> int:
        """Tokens that can still be appended to `rid` (or to a new request when None) with the free blocks."""
        if rid is None:
            return len(self._free_blocks) * self.block_size
        a = self._allocs[rid]
        return (len(a.blocks) + len(self._free_blocks)) * self.block_size - a.num_tokens

    # -- allocation --
    def allocate(self, rid: str) -> int:
        """Give `rid` the lowest free slot, zeroed in every KDA layer, and an empty block table; returns the slot."""
        if rid in self._allocs:
            raise ValueError(f"request_id {rid!r}: already holds a slot")
        if not self._free_slots:
            raise CacheFull(f"no free KDA slot ({self.num_slots - 1} in use)")
        self._free_slots.sort()
        slot = self._free_slots.pop(0)
        for l in self.kda_layers:
            self.pools[l]["state"][slot].zero_()
            self.pools[l]["conv"][slot].zero_()
        self._allocs[rid] = _Alloc(slot, [])
        return slot

    def append(self, rid: str, n: int) -> int:
        """Reserve room for `n` more tokens of `rid` (growing its block table); returns the context length before
        them (= where they are written). All or nothing: raises CacheFull when the blocks are not free."""
        a = self._allocs[rid]
        need = self.blocks_needed(rid, n)
        if need > len(self._free_blocks):
            raise CacheFull(f"request {rid!r}: needs {need} more latent blocks, {len(self._free_blocks)} free")
        if need:
            a.add_blocks([heapq.heappop(self._free_blocks) for _ in range(need)])   # O(need log F), no sort
        start = a.num_tokens
        a.num_tokens += n
        return start

    def free(self, rid: str) -> None:
        """Return the slot and blocks of `rid` (no-op for an unknown id)."""
        a = self._allocs.pop(rid, None)
        if a is None:
            return
        self._free_slots.append(a.slot)
        for blk in a.blocks:
            heapq.heappush(self._free_blocks, blk)

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
        """Assert the no-leak invariant: every slot/block >= 1 is free or owned by exactly one request."""
        slots = list(self._free_slots) + [a.slot for a in self._allocs.values()]
        blocks = list(self._free_blocks) + [b for a in self._allocs.values() for b in a.blocks]
        if sorted(slots) != list(range(1, self.num_slots)) or sorted(blocks) != list(range(1, self.num_blocks)):
            raise AssertionError("cache bookkeeping broken: slots/blocks leaked or doubly owned")
