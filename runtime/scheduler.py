"""Continuous batching over the hybrid cache (one rank's view; the executor hides TP).

Each `step()`:

1. walks the running requests oldest first (FCFS): a request past its prefill contributes 1 decode token, one
   still prefilling a chunk of up to the remaining token budget (a prefill may be cut at any token);
2. admits waiting requests oldest first while a KDA slot, free latent blocks and token budget remain;
3. when a running request needs latent blocks that are not free, the newest running request is preempted
   (slot and blocks freed at once) and later recomputed: prompt + tokens generated so far as a new prefill;
4. runs the decode tokens as one forward (`Batch(decode=True)`, optionally padded with sentinel rows: slot 0,
   block 0, context 0) and the prefill chunks as a second forward (`Batch(decode=False)`), writes the returned
   pools back into the cache, samples a token for every request whose pending tokens are all processed, and
   finishes requests (max_tokens, stop/eos, max_context): their slot and blocks are freed at once.

With prefix caching (`HybridCache(num_snapshots > 0)`, docs/PREFIX_CACHING.md) admission first restores the
deepest published snapshot of the request's tokens (`_admit`), prefill chunks end at the periodic snapshot
positions (`_align_chunk`), and after a completed step the requests standing at one are snapshotted
(`_publish_snapshots`), as is every request that finishes normally (`_cache_finished`), at the end of its prompt +
reply, where the next turn of a conversation resumes.

Events go to each request's `on_token(token_id | None, finished, error)` callback. Not thread safe: the
`AsyncEngine` serializes calls with its lock.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from k3deploy.model.reference import Batch
from k3deploy.runtime.cache import HybridCache
from k3deploy.runtime.prefix_cache import check_content_keys
from k3deploy.runtime.sampling import SamplingParams, make_generator, sample_batch, validate_prompt

log = logging.getLogger(__name__)

OnToken = Callable[[int | None, bool, str | None], None]


@dataclasses.dataclass(eq=False)
class Request:
    """One request's scheduling state. all_ids = prompt + output; num_computed = leading tokens of all_ids in
    the cache; prefill_end = len(all_ids) when it was (re)admitted (tokens before it go through prefill).
    content_keys: (start, end, digest) spans folded into its prefix-cache keys (runtime/prefix_cache.py);
    num_cached_tokens: prompt tokens restored from the prefix cache at its first admission."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_token: OnToken | None = None
    arrival: int = 0
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    prefill_end: int = 0
    status: str = "waiting"                       # waiting | running | finished
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    content_keys: tuple = ()
    num_cached_tokens: int = 0
    admissions: int = 0

    @property
    def all_ids(self) -> list[int]:
        """prompt + output as a new list (O(tokens): the per-step paths use num_tokens / token_slice)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """len(all_ids) without building it."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] (0 <= start <= stop) in O(stop - start): a decode step at a long context copies one
        token, not the whole prompt."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p: stop - p]
        return self.prompt_ids[start:] + self.output_ids[: stop - p]

    @property
    def is_decode(self) -> bool:
        return self.status == "running" and self.num_computed >= self.prefill_end > 0


class Scheduler:
    """Continuous-batching scheduler. `executor.forward(ids, batch, pools, logits_index) -> (logits, pools)`.

    max_batch: running requests at once (<= cache slots - 1); max_num_tokens: tokens per step (decode + prefill);
    decode_pad_multiple: pad the decode batch to a multiple of this with sentinel rows (engines with fixed
    batch buckets); eos_token_id: stops a request unless ignore_eos (< 0 = none).
    """

    def __init__(self, executor, cache: HybridCache, max_batch: int = 8, max_num_tokens: int = 256,
                 eos_token_id: int = -1, decode_pad_multiple: int | None = None):
        if max_num_tokens < 1 or max_batch < 1:
            raise ValueError(f"max_num_tokens = {max_num_tokens}, max_batch = {max_batch}: both must be >= 1")
        self.executor, self.cache = executor, cache
        self.max_batch = min(max_batch, cache.num_slots - 1)
        self.max_num_tokens = max_num_tokens
        self.eos_token_id = eos_token_id
        self.decode_pad_multiple = decode_pad_multiple
        self.vocab_size = executor.cfg.vocab_size
        self.max_context = cache.max_context
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.stats = {"tokens_generated": 0, "preemptions": 0, "steps": 0, "max_requests_per_step": 0}
        self.last_step_requests: list[str] = []

    # ---- requests -------------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids, params: SamplingParams, on_token: OnToken | None = None,
            content_keys=None) -> Request:
        """Validate and queue a request. content_keys: optional (start, end, digest) spans of the prompt whose
        tokens stand for content hashed to digest (an image: its placeholder tokens and the processed image's
        content hash), folded into the prefix-cache keys (runtime.prefix_cache.check_content_keys). Raises
        ValueError naming the field (prompt_ids, request_id, content_keys or a SamplingParams field); nothing is
        queued then."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        params.validate()
        ids = validate_prompt(prompt_ids, self.vocab_size, self.max_context)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id = {request_id!r}: must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id = {request_id!r}: already in flight")
        self.cache.check_admissible(len(ids))
        keys = check_content_keys(content_keys, len(ids))
        req = Request(request_id, ids, params, on_token, self._arrivals, generator=make_generator(params),
                      content_keys=keys)
        self._arrivals += 1
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def cancel(self, request_id: str) -> bool:
        """Finish a queued or running request as "cancelled" (slot and blocks freed now). False if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "cancelled", None, notify_token=None)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def metrics(self) -> dict:
        """Slots and blocks in use (blocks: held by requests or cached prefixes), the step counters and, with
        prefix caching, `HybridCache.prefix_metrics`."""
        return {"kda_slots_in_use": self.cache.slots_in_use, "latent_blocks_in_use": self.cache.blocks_in_use,
                **self.stats, **self.cache.prefix_metrics()}

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix (requests in flight keep their own state); returns how many snapshots."""
        return self.cache.reset_prefix_cache()

    # ---- internals ------------------------------------------------------------------------------------
    def _notify(self, req: Request, token: int | None, finished: bool, error: str | None) -> None:
        if req.on_token is None:
            return
        try:
            req.on_token(token, finished, error)
        except Exception:  # a consumer's bug must not stop the engine
            log.exception("on_token callback of request %s raised", req.request_id)

    def _finish(self, req: Request, reason: str, error: str | None, notify_token: int | None) -> None:
        if reason in ("stop", "length"):
            self._cache_finished(req)
        self.cache.free(req.request_id)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.requests.get(req.request_id) is req:   # not a new request re-submitted under the same id
            del self.requests[req.request_id]
        req.status, req.finish_reason, req.error = "finished", reason, error
        self._notify(req, notify_token, True, error)

    def _preempt(self, req: Request) -> None:
        """Free req's slot and blocks; it is recomputed (prompt + output so far) when readmitted."""
        log.info("preempting request %s (%d tokens cached)", req.request_id, req.num_computed)
        self.cache.free(req.request_id)
        self.running.remove(req)
        req.status, req.num_computed, req.prefill_end = "waiting", 0, 0
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: r.arrival)
        self.stats["preemptions"] += 1

    def _cache_finished(self, req: Request) -> None:
        """Snapshot a request that finished normally at its last computed token (prompt + reply but the last
        sampled token): where the next turn of the conversation resumes. Cancelled or failed requests are not."""
        if self.cache.prefix_caching and req.status == "running" and req.request_id in self.cache:
            self.cache.publish(req.request_id, req.token_slice, final=True, keys=req.content_keys)

    def _publish_snapshots(self, group: list[tuple[Request, int]]) -> None:
        """After a step completed: snapshot every running request of `group` that stands at a periodic snapshot
        position (its chunk was cut there by `_align_chunk`)."""
        if not self.cache.prefix_caching:
            return
        for req, _ in group:
            if req.status == "running" and req.num_computed % self.cache.snapshot_interval == 0:
                self.cache.publish(req.request_id, req.token_slice, keys=req.content_keys)

    def _align_chunk(self, req: Request, n: int) -> int:
        """The request's next prefill chunk of at most n tokens, cut at a periodic snapshot position (prefix caching,
        `HybridCache.chunk_end`) so that a step ends exactly there."""
        return self.cache.chunk_end(req.request_id, n, req.content_keys)

    def _admit(self, req: Request, budget: int) -> int:
        """Give the first waiting request `req` a slot, restoring its deepest cached prefix (prefix caching), and
        reserve its first chunk of at most `budget` tokens; returns the chunk's tokens, or 0 when it does not fit
        (nothing stays allocated then)."""
        rid = req.request_id
        snap = self.cache.lookup(rid, req.token_slice, req.num_tokens, req.content_keys)
        self.cache.allocate(rid, snap)
        cached = snap.length if snap is not None else 0
        n = self._align_chunk(req, min(req.num_tokens - cached, budget, self.cache.room(rid)))
        if n <= 0:
            self.cache.free(rid)
            return 0
        self.waiting.pop(0)
        req.status, req.num_computed, req.prefill_end = "running", cached, req.num_tokens
        if not req.admissions:
            req.num_cached_tokens = min(cached, len(req.prompt_ids))
        req.admissions += 1
        if self.cache.prefix_caching:
            self.cache.record_admission(req.num_tokens, cached)
        self.running.append(req)
        self.cache.append(rid, n)
        return n

    def _plan(self, budget: int) -> list[tuple[Request, int]]:
        """Choose (request, tokens) for this step and reserve their cache room."""
        plan: list[tuple[Request, int]] = []
        preempted: set[str] = set()
        self.running.sort(key=lambda r: r.arrival)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            rid = req.request_id
            n = 1 if req.is_decode else self._align_chunk(req, min(req.num_tokens - req.num_computed, budget))
            while not self.cache.can_append(rid, n):
                room = self.cache.room(rid)
                if not req.is_decode and room > 0:
                    n = room                           # cut the prefill chunk at what fits
                    break
                victim = self.running[-1]
                preempted.add(victim.request_id)
                self._preempt(victim)
                if victim is req:
                    break
            if req.status != "running":
                break                                  # req preempted itself: it was the newest
            self.cache.append(rid, n)
            plan.append((req, n))
            budget -= n
            i += 1
        while (self.waiting and budget > 0 and len(self.running) < self.max_batch and self.cache.free_slots
               and self.waiting[0].request_id not in preempted):
            req = self.waiting[0]
            if min(req.num_tokens, budget, self.cache.room(None)) <= 0:
                break
            n = self._admit(req, budget)
            if n <= 0:
                break
            plan.append((req, n))
            budget -= n
        return plan

    def _batch(self, group: list[tuple[Request, int]], decode: bool) -> tuple[torch.Tensor, Batch, torch.Tensor]:
        rids: list[str | None] = [r.request_id for r, _ in group]
        ids = [t for r, n in group for t in r.token_slice(r.num_computed, r.num_computed + n)]
        lens = [n for _, n in group]
        slots = [self.cache.slot(r.request_id) for r, _ in group]
        ctx = [r.num_computed for r, _ in group]
        if decode and self.decode_pad_multiple:
            pad = -len(group) % self.decode_pad_multiple
            rids += [None] * pad
            ids += [0] * pad
            lens += [1] * pad
            slots += [0] * pad
            ctx += [0] * pad
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        batch = Batch(cu, torch.tensor(slots, dtype=torch.int32), self.cache.block_tables(rids),
                      torch.tensor(ctx, dtype=torch.int32), decode=decode)
        logits_index = (cu[1: len(group) + 1] - 1).long()
        return torch.tensor(ids, dtype=torch.long), batch, logits_index

    def _run(self, group: list[tuple[Request, int]], decode: bool) -> None:
        ids, batch, index = self._batch(group, decode)
        try:
            logits, pools = self.executor.forward(ids, batch, self.cache.pools, index)
        except Exception as e:
            log.exception("forward failed; finishing the %d requests of this batch with an error", len(group))
            for req, _ in group:
                if req.status != "finished":           # an earlier row's error callback may have cancelled it
                    self._finish(req, "error", f"{type(e).__name__}: {e}", notify_token=None)
            return
        self.cache.set_pools(pools)
        rows = [row for row, (req, n) in enumerate(group) if req.num_computed + n >= req.num_tokens]
        toks = {}
        if rows:                                       # one batched draw (logits may be on a GPU)
            sel = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
            toks = dict(zip(rows, sample_batch(sel, [group[r][0].params for r in rows],
                                               [group[r][0].generator for r in rows])))
        for row, (req, n) in enumerate(group):
            if req.status == "finished":               # cancelled by an earlier row's callback in this loop
                continue
            req.num_computed += n
            if req.num_computed < req.num_tokens:
                continue                               # prefill not done yet: nothing to sample
            tok = toks[row]
            req.output_ids.append(tok)
            self.stats["tokens_generated"] += 1
            p = req.params
            if tok in p.stop_token_ids or (tok == self.eos_token_id and not p.ignore_eos):
                self._finish(req, "stop", None, notify_token=tok)
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_context:
                self._finish(req, "length", None, notify_token=tok)
            else:
                self._notify(req, tok, False, None)
        self._publish_snapshots(group)

    # ---- one step -------------------------------------------------------------------------------------
    def step(self, token_budget: int | None = None) -> list[str]:
        """Schedule and run one step; returns the ids of the requests that ran. token_budget overrides
        max_num_tokens for this step only (tests use it to cut prefills at chosen offsets)."""
        plan = self._plan(token_budget or self.max_num_tokens)
        if not plan:
            return []
        decode = [(r, n) for r, n in plan if r.is_decode]
        prefill = [(r, n) for r, n in plan if not r.is_decode]
        self.last_step_requests = [r.request_id for r, _ in plan]
        self.stats["steps"] += 1
        self.stats["max_requests_per_step"] = max(self.stats["max_requests_per_step"], len(plan))
        if decode:
            self._run(decode, decode=True)
        prefill = [(r, n) for r, n in prefill if r.status != "finished"]   # a decode row's callback may cancel one
        if prefill:
            self._run(prefill, decode=False)
        return self.last_step_requests

    def run_until_done(self) -> None:
        """Step until nothing is waiting or running."""
        while self.has_work():
            if not self.step() and self.has_work():
                raise RuntimeError("scheduler made no progress with requests pending (cache too small?)")
