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
   finishes requests (max_tokens, stop/eos): their slot and blocks are freed at once.

A step is atomic per request: whatever can fail for one request is checked at `add` (sampling parameters, stop ids
within the vocabulary, prompt + max_tokens within max_context) or isolated after the forward (NaN/Inf logits, a
failure while sampling or finishing it): that request alone ends with an error, slot and blocks freed, and every
other request's state and tokens are as if it had never been there. A forward that raises fails its whole batch
(every row's state is suspect then), each request with the error.

Images (VISION.md §8.3): a request's prompt holds each image's `<|media_pad|>` expanded to its rows. Before a
prefill forward, every image whose rows this step's chunks reach and that is not cached yet goes through ONE
`executor.encode_images` call (images of all the step's requests packed); its rows stay cached on the request and
each chunk writes its slice over the embedding (`image_rows`); an image's rows are dropped once the prefill has
passed them (a preempted request encodes them again). Decode steps never run the tower.

Overlapped decode (`overlap`, runtime/pipeline.py; on by default where the executor says so: the torch backend on
a CUDA GPU with the in-place kernels): a step whose plan is decode only, with every request greedy and without bad
words, is launched before the tokens of the step in flight are read, then that step is booked (tokens, logprobs,
stop checks, callbacks). Planning counts an in-flight request's token as pending: a request whose pending token
ends it by length gets no next row; one that ends on a stop token / eos / stop sequence already has a row in the
step launched meanwhile, whose output is dropped. Any other step (prefill chunks, sampled rows, bad words) books
the step in flight first and runs synchronously, as does a step whose launch fails. `step()` returns the requests
it launched; their tokens arrive with the next step (`run_until_done` books the last one).

With prefix caching (`HybridCache(num_snapshots > 0)`, docs/PREFIX_CACHING.md) admission first restores the
deepest published snapshot of the request's tokens (`_admit`). A prefill chunk that holds periodic snapshot
positions has the executor copy the KDA state at each of them inside the step (`_stage_in_step`,
`Batch.kda_snapshot`); a chunk or decode step that ends on one is snapshotted after it. Snapshots are published
only once the step that computed their state completed: after a synchronous step (`_publish_snapshots`, the staged
in-step ones), after booking an overlapped step (`_drain`: the ones `_stage_periodic` staged when it was launched).
Every request that finishes normally is snapshotted after the tokens its steps computed (`_cache_finished`): prompt
+ reply but the last token, or the whole reply when its dropped row is in the overlapped step in flight; that is
where the next turn of a conversation resumes. An image's rows are keyed by its content hash (its span of pad
positions is a content key); a restored prefix that holds an image never runs the tower for it. Requests asking
for prompt logprobs compute their whole prompt (no lookup).

Events go to each request's `on_token(token_id | None, finished, error)` callback. When the params ask for
them, a token's logprob (and top alternatives) is on the Request (`logprobs[-1]`, `top_logprobs[-1]`) before its
callback fires, and a prefill chunk fills `prompt_logprobs` for the prompt tokens it predicts (logits of every
chunk position). Not thread safe: the `AsyncEngine` serializes calls with its lock.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Callable

import torch

from k3deploy.model.reference import Batch, KdaSnapshot
from k3deploy.runtime.cache import HybridCache
from k3deploy.runtime.prefix_cache import check_content_keys
from k3deploy.runtime.sampling import (NON_FINITE, SamplingParams, ban, make_generator, sample, sample_batch,
                                       token_logprobs, validate_prompt)

log = logging.getLogger(__name__)

OnToken = Callable[[int | None, bool, str | None], None]


@dataclasses.dataclass(eq=False)
class Request:
    """One request's scheduling state. all_ids = prompt + output; num_computed = leading tokens of all_ids in
    the cache; prefill_end = len(all_ids) when it was (re)admitted (tokens before it go through prefill).
    With params.logprobs: logprobs[i] / top_logprobs[i] ([(id, logprob)]) of output token i. With
    params.prompt_logprobs: prompt_logprobs[i] / prompt_top_logprobs[i] of prompt token i (None for i = 0).
    content_keys: (start, end, digest) spans folded into its prefix-cache keys (runtime/prefix_cache.py; its
    images' spans with their content hashes first); num_cached_tokens: prompt tokens restored from the prefix
    cache at its first admission."""

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
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    images: list = dataclasses.field(default_factory=list)        # runtime.vision.ProcessedImage, prompt order
    pad_positions: list[int] = dataclasses.field(default_factory=list)   # prompt positions of the image rows
    image_ends: list[int] = dataclasses.field(default_factory=list)      # image k owns pad_positions[ends[k-1]:ends[k]]
    image_rows: dict = dataclasses.field(default_factory=dict)           # k -> cached features [N_k, d]
    content_keys: tuple = ()
    num_cached_tokens: int = 0
    admissions: int = 0

    def image_span(self, k: int) -> tuple[int, int]:
        """Indices into pad_positions of image k's rows."""
        return (self.image_ends[k - 1] if k else 0), self.image_ends[k]

    def images_in(self, start: int, stop: int) -> list[int]:
        """Images with rows at prompt positions [start, stop)."""
        lo, hi = bisect.bisect_left(self.pad_positions, start), bisect.bisect_left(self.pad_positions, stop)
        if lo >= hi:
            return []
        return list(range(bisect.bisect_right(self.image_ends, lo), bisect.bisect_right(self.image_ends, hi - 1) + 1))

    def image_keys(self) -> list[tuple[int, int, str]]:
        """(first, last + 1, content hash) of each image's pad positions: its prefix-cache content keys."""
        return [(self.pad_positions[a], self.pad_positions[b - 1] + 1, im.content_hash)
                for im, (a, b) in ((im, self.image_span(k)) for k, im in enumerate(self.images))]

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
    batch buckets); eos_token_id: stops a request unless ignore_eos (< 0 = none); overlap: overlapped decode steps
    (module docstring; None = `executor.overlap_decode`, False when absent). ValueError for overlap=True with an
    executor that has no `forward_on_device`.
    """

    def __init__(self, executor, cache: HybridCache, max_batch: int = 8, max_num_tokens: int = 256,
                 eos_token_id: int = -1, decode_pad_multiple: int | None = None, overlap: bool | None = None):
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
        self.stats = {"tokens_generated": 0, "preemptions": 0, "steps": 0, "max_requests_per_step": 0,
                      "images_encoded": 0, "overlapped_steps": 0}
        self.last_step_requests: list[str] = []
        self.pipeline = None                      # runtime.pipeline.DecodePipeline while overlap is on
        self._inflight = None                     # the launched, not yet booked overlapped step (its Ticket)
        if getattr(executor, "overlap_decode", False) if overlap is None else overlap:
            self.set_overlap(True)

    def set_overlap(self, on: bool) -> None:
        """Turn overlapped decode steps on or off (module docstring); the step in flight is booked first. ValueError
        when turning it on for an executor without `forward_on_device`."""
        self._drain()
        if not on:
            self.pipeline = None
            return
        if self.pipeline is not None:
            return
        if getattr(self.executor, "forward_on_device", None) is None:
            raise ValueError(f"overlap: {type(self.executor).__name__} cannot launch a decode step without host reads "
                             "(no forward_on_device); use the torch backend or overlap=False")
        from k3deploy.runtime.pipeline import DecodePipeline
        m = self.decode_pad_multiple or 1
        self.pipeline = DecodePipeline(self.executor, -(-self.max_batch // m) * m,
                                       -(-self.max_context // self.cache.block_size))

    # ---- requests -------------------------------------------------------------------------------------
    def check(self, prompt_ids, params: SamplingParams) -> list[int]:
        """Validate a request without queuing it; returns the prompt as a list of ints. Raises ValueError naming
        the field: params (not SamplingParams), a SamplingParams field, stop_token_ids outside the vocabulary,
        prompt_ids, or max_tokens when prompt + max_tokens exceed max_context (no silent cut at the context end)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        params.validate()
        params.check_vocab(self.vocab_size)
        ids = validate_prompt(prompt_ids, self.vocab_size, self.max_context)
        self.cache.check_admissible(len(ids))
        if len(ids) + params.max_tokens > self.max_context:
            raise ValueError(f"max_tokens = {params.max_tokens}: the prompt's {len(ids)} tokens plus {params.max_tokens} "
                             f"exceed max_context = {self.max_context} tokens per request; ask for at most "
                             f"{self.max_context - len(ids)}")
        return ids

    def add(self, request_id: str, prompt_ids, params: SamplingParams, on_token: OnToken | None = None,
            images=None, content_keys=None) -> Request:
        """Validate (`check`) and queue a request. images: its runtime.vision.ProcessedImage list, the prompt
        pre-expanded (each image's `<|media_pad|>` repeated image.num_tokens times, runtime.vision.prepare_images);
        their content hashes key the prefix cache over their pad positions. content_keys: more (start, end, digest)
        spans of the prompt whose tokens stand for content hashed to digest, folded into the prefix-cache keys
        (runtime.prefix_cache.check_content_keys). Raises ValueError naming the field (prompt_ids, request_id,
        images, content_keys, max_tokens or another SamplingParams field); nothing is queued then."""
        ids = self.check(prompt_ids, params)
        imgs: list = []
        if images is not None:
            from k3deploy.runtime.vision import request_images
            imgs = request_images(ids, images, self.executor.cfg, self.executor.max_image_patches())
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id = {request_id!r}: must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id = {request_id!r}: already in flight")
        req = Request(request_id, ids, params, on_token, self._arrivals, generator=make_generator(params))
        if params.logprobs is not None:
            req.logprobs, req.top_logprobs = [], []
        if params.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_top_logprobs = [None], [None]
        if imgs:
            pad = self.executor.cfg.vision.media_placeholder_token_id
            req.images, req.pad_positions = imgs, [i for i, t in enumerate(ids) if t == pad]
            for im in imgs:
                req.image_ends.append((req.image_ends[-1] if req.image_ends else 0) + im.num_tokens)
        images_keys = req.image_keys() if self.cache.prefix_caching else []     # hashing pixels only when used
        req.content_keys = check_content_keys(images_keys + list(content_keys or ()), len(ids))
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

    def fail(self, request_id: str, error: str) -> bool:
        """Finish a queued or running request with `error` (slot and blocks freed now). False if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "error", error, notify_token=None)
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
        """Snapshot a request that finished normally (stop or length) after the tokens its steps computed, where the
        next turn of the conversation resumes: prompt + reply but the last sampled token, published now (its last
        step completed; a row reserved for a step not launched holds nothing); with a row in the overlapped step in
        flight, prompt + the whole reply (that row computes the last token), staged now and published when that step
        completed (`_drain`). Cancelled or failed requests are not snapshotted, nor requests waiting for readmission."""
        if not (self.cache.prefix_caching and req.status == "running" and req.request_id in self.cache):
            return
        ticket = self._inflight
        if ticket is None or req not in ticket.rows:
            self.cache.publish(req.request_id, req.token_slice, final=True, keys=req.content_keys,
                               length=req.num_computed)
        elif not any(r is req for r, _ in ticket.staged):       # else a periodic snapshot of that step is this one
            staged = self.cache.stage(req.request_id, req.num_computed, final=True, keys=req.content_keys)
            if staged is not None:
                ticket.staged.append((req, staged))

    def _publish_snapshots(self, group: list[tuple[Request, int]]) -> None:
        """After a synchronous step completed: snapshot every running request of `group` that stands at a periodic
        snapshot position (its chunk ended there, or a decode step reached it)."""
        if not self.cache.prefix_caching:
            return
        for req, _ in group:
            if req.status == "running" and req.num_computed % self.cache.snapshot_interval == 0:
                self.cache.publish(req.request_id, req.token_slice, keys=req.content_keys, length=req.num_computed)

    def _stage_periodic(self, ticket, group: list[tuple[Request, int]]) -> None:
        """After launching an overlapped step: stage a snapshot of every request of `group` that it brings to a
        periodic snapshot position (the slot copy is ordered after the step, before the next one is launched);
        `_drain` publishes them once the step completed."""
        if not self.cache.prefix_caching:
            return
        for req, _ in group:
            if req.num_computed % self.cache.snapshot_interval == 0:
                staged = self.cache.stage(req.request_id, req.num_computed, keys=req.content_keys)
                if staged is not None:
                    ticket.staged.append((req, staged))

    def _stage_in_step(self, group: list[tuple[Request, int]]) -> list[tuple[int, Request, object]]:
        """Before a prefill step: stage a snapshot at every periodic snapshot position strictly inside each chunk
        (`HybridCache.snapshot_positions`), its KDA rows to be written by the forward (`Batch.kda_snapshot`).
        Returns [(row in group, request, runtime.cache.StagedSnapshot)]."""
        if not self.cache.prefix_caching:
            return []
        out = []
        for row, (req, n) in enumerate(group):
            rid = req.request_id
            for pos in self.cache.snapshot_positions(rid, req.num_computed, req.num_computed + n, req.content_keys):
                staged = self.cache.stage(rid, pos, keys=req.content_keys, copy=False)
                if staged is None:
                    break                              # every row staged: no deeper one either
                out.append((row, req, staged))
        return out

    def _admit(self, req: Request, budget: int) -> int:
        """Give the first waiting request `req` a slot, restoring its deepest cached prefix (prefix caching; not for
        requests that want prompt logprobs), and reserve its first chunk of at most `budget` tokens; returns the chunk's tokens, or 0 when it does not fit
        (nothing stays allocated then)."""
        rid = req.request_id
        snap = None
        if req.prompt_logprobs is None:                # prompt logprobs need every prompt position computed
            snap = self.cache.lookup(rid, req.token_slice, req.num_tokens, req.content_keys)
        self.cache.allocate(rid, snap)
        cached = snap.length if snap is not None else 0
        n = min(req.num_tokens - cached, budget, self.cache.room(rid))
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
            if self._ends_in_flight(req):
                i += 1                                 # its token in flight ends it (length): no next row
                continue
            rid = req.request_id
            n = 1 if req.is_decode else min(req.num_tokens - req.num_computed, budget)
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

    def _ends_in_flight(self, req: Request) -> bool:
        """req's last token is still in flight (an overlapped step: num_computed caught up with num_tokens) and
        reaches max_tokens or max_context."""
        return (req.num_computed == req.num_tokens and req.status == "running"
                and (len(req.output_ids) + 1 >= req.params.max_tokens or req.num_tokens + 1 >= self.max_context))

    def _batch(self, group: list[tuple[Request, int]], decode: bool, staged=()
               ) -> tuple[torch.Tensor, Batch, torch.Tensor, list[int]]:
        """(ids, batch, logits_index, first logits row of each request): one row per request (its last token),
        or one per chunk position for a prefill whose prompt logprobs are wanted; `staged` (`_stage_in_step`)
        become the batch's `kda_snapshot`."""
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
        snap = None
        if staged:
            snap = KdaSnapshot.of(cu.tolist(), [(row, st.length - r.num_computed, st.row) for row, r, st in staged],
                                  self.cache.snapshots.pools)
        batch = Batch(cu, torch.tensor(slots, dtype=torch.int32), self.cache.block_tables(rids),
                      torch.tensor(ctx, dtype=torch.int32), decode=decode, kda_snapshot=snap)
        index, first = [], []
        for row, (r, n) in enumerate(group):
            first.append(len(index))
            end = int(cu[row + 1])
            index += range(end - n, end) if self._wants_prompt_logprobs(r, n, decode) else [end - 1]
        return torch.tensor(ids, dtype=torch.long), batch, torch.tensor(index, dtype=torch.long), first

    @staticmethod
    def _wants_prompt_logprobs(r: Request, n: int, decode: bool) -> bool:
        """A prefill chunk [num_computed, +n) predicts prompt tokens whose logprobs are still missing."""
        return (not decode and r.prompt_logprobs is not None
                and r.num_computed + 1 < len(r.prompt_ids) and len(r.prompt_logprobs) < len(r.prompt_ids))

    def _fill_prompt_logprobs(self, group, logits, first, decode: bool) -> None:
        rows, targets, ks, owners = [], [], [], []
        for row, (r, n) in enumerate(group):
            if not self._wants_prompt_logprobs(r, n, decode):
                continue
            need = len(r.prompt_logprobs)              # the first prompt token without its logprob
            for j in range(n):
                p = r.num_computed + j                 # position p's logits predict token p + 1
                if need <= p + 1 < len(r.prompt_ids):  # (after a preemption the recomputed ones are known)
                    rows.append(first[row] + j)
                    targets.append(r.prompt_ids[p + 1])
                    ks.append(r.params.prompt_logprobs)
                    owners.append(r)
        if not rows:
            return
        for r, (lp, top) in zip(owners, token_logprobs(logits[torch.tensor(rows, device=logits.device)], targets, ks)):
            r.prompt_logprobs.append(lp)
            r.prompt_top_logprobs.append(top)

    def _banned(self, r: Request) -> list[int]:
        """Last tokens of the request's bad words whose other tokens end its sequence."""
        out = []
        for w in r.params.bad_words:
            k = len(w) - 1
            if k == 0 or (k <= r.num_tokens and r.token_slice(r.num_tokens - k, r.num_tokens) == list(w[:-1])):
                out.append(int(w[-1]))
        return out

    def _encode_images(self, group: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Run the tower once for every image whose rows this step's chunks reach and that is not cached (all
        requests' images in one call); returns the group without the requests finished by a failed call."""
        need = [(req, k) for req, n in group for k in req.images_in(req.num_computed, req.num_computed + n)
                if k not in req.image_rows]
        if not need:
            return group
        from k3deploy.runtime.vision import pack_images
        try:
            feats = self.executor.encode_images(*pack_images([req.images[k] for req, k in need]))
        except Exception as e:
            log.exception("vision tower failed; finishing the requests of its %d images with an error", len(need))
            for req in {id(r): r for r, _ in need}.values():
                if req.status != "finished":
                    self._finish(req, "error", f"{type(e).__name__}: {e}", notify_token=None)
            return [(r, n) for r, n in group if r.status != "finished"]
        for (req, k), f in zip(need, feats.split([req.images[k].num_tokens for req, k in need])):
            req.image_rows[k] = f
        self.stats["images_encoded"] += len(need)
        return group

    @staticmethod
    def _image_rows(group: list[tuple[Request, int]]):
        """(positions [n] int64 in the packed prefill batch, rows [n, d]) of the image rows the chunks hold, or None."""
        pos, rows, off = [], [], 0
        for req, n in group:
            a, b = req.num_computed, req.num_computed + n
            for k in req.images_in(a, b):
                s, e = req.image_span(k)
                lo = max(s, bisect.bisect_left(req.pad_positions, a))
                hi = min(e, bisect.bisect_left(req.pad_positions, b))
                pos += [off + p - a for p in req.pad_positions[lo:hi]]
                rows.append(req.image_rows[k][lo - s: hi - s])
            off += n
        return (torch.tensor(pos, dtype=torch.long), torch.cat(rows)) if pos else None

    @staticmethod
    def _drop_used_rows(req: Request) -> None:
        """Forget the cached rows of images the prefill has passed."""
        for k in [k for k in req.image_rows if req.pad_positions[req.image_ends[k] - 1] < req.num_computed]:
            del req.image_rows[k]

    def _run(self, group: list[tuple[Request, int]], decode: bool) -> None:
        image_rows = None
        if not decode and any(r.images for r, _ in group):
            group = self._encode_images(group)
            if not group:
                return
            image_rows = self._image_rows(group)
        staged = [] if decode else self._stage_in_step(group)
        ids, batch, index, first = self._batch(group, decode, staged)
        try:
            kw = {"image_rows": image_rows} if image_rows is not None else {}
            logits, pools = self.executor.forward(ids, batch, self.cache.pools, index, **kw)
            self.cache.set_pools(pools)
        except Exception as e:
            log.exception("forward failed; finishing the %d requests of this batch with an error", len(group))
            for _, _, st in staged:
                self.cache.drop(st)
            for req, _ in group:
                if req.status != "finished":           # an earlier row's error callback may have cancelled it
                    self._finish(req, "error", f"{type(e).__name__}: {e}", notify_token=None)
            return
        self._fill_prompt_logprobs(group, logits, first, decode)
        rows = [row for row, (req, n) in enumerate(group) if req.num_computed + n >= req.num_tokens]
        last = [first[r + 1] - 1 if r + 1 < len(first) else len(index) - 1 for r in rows]
        toks, lps = self._sample(group, rows, last, logits)
        for row, (req, n) in enumerate(group):
            if req.status == "finished":               # cancelled by an earlier row's callback in this loop
                continue
            req.num_computed += n
            if req.image_rows:
                self._drop_used_rows(req)
            if req.num_computed < req.num_tokens:
                continue                               # prefill not done yet: nothing to sample
            try:
                tok = toks[row]
                if isinstance(tok, str):
                    self._finish(req, "error", tok, notify_token=None)
                else:
                    self._emit(req, tok, lps.get(row))
            except Exception as e:                     # this request alone; the others' tokens are already drawn
                log.exception("finishing request %s failed", req.request_id)
                if req.status != "finished":
                    self._finish(req, "error", f"{type(e).__name__}: {e}", notify_token=None)
        for _, req, st in staged:                      # the step completed: the states it copied are valid
            if req.finish_reason == "error":
                self.cache.drop(st)
            else:
                self.cache.confirm(st, req.token_slice)
        self._publish_snapshots(group)

    def _sample(self, group: list[tuple[Request, int]], rows: list[int], last: list[int], logits
                ) -> tuple[dict[int, int | str], dict[int, tuple]]:
        """({row: token id, or an error message for that request alone}, {row: (logprob, top logprobs)} for the
        rows whose params ask for them) for the group rows that sample; `last[i]` is row rows[i]'s logits row."""
        if not rows:
            return {}, {}
        reqs = [group[r][0] for r in rows]
        banned = [self._banned(q) if q.params.bad_words else [] for q in reqs]
        states = [r.generator.get_state() if r.generator is not None else None for r in reqs]
        sel = logits if len(last) == logits.shape[0] else logits[torch.tensor(last, device=logits.device)]
        try:                                           # one batched draw (logits may be on a GPU)
            kw = {"banned": banned} if any(banned) else {}
            drawn = sample_batch(sel, [r.params for r in reqs], [r.generator for r in reqs], **kw)
        except Exception:                              # isolate the failing row: draw each one alone
            log.exception("batched sampling failed; sampling the %d rows one by one", len(rows))
            drawn = []
            for j, (r, state) in enumerate(zip(reqs, states)):
                if state is not None:
                    r.generator.set_state(state)       # undo the partial batched draw: same tokens as solo
                try:
                    row = ban(sel[j: j + 1], [banned[j]])[0] if banned[j] else sel[j]
                    drawn.append(sample(row, r.params, r.generator))
                except Exception as e:
                    drawn.append(f"{type(e).__name__}: {e}")
        toks = {row: NON_FINITE if t is None else t for row, t in zip(rows, drawn)}
        want = [j for j, q in enumerate(reqs) if q.logprobs is not None and isinstance(toks[rows[j]], int)]
        lps = {}
        if want:
            sub = sel if len(want) == sel.shape[0] else sel[torch.tensor(want, device=sel.device)]
            got = token_logprobs(sub, [toks[rows[j]] for j in want], [reqs[j].params.logprobs for j in want])
            lps = {rows[j]: g for j, g in zip(want, got)}
        return toks, lps

    def _emit(self, req: Request, tok: int, logprob: tuple | None = None) -> None:
        """Append a sampled token (and its (logprob, top logprobs)) to req and notify; finish it at a stop/eos
        token, a stop sequence or max_tokens."""
        req.output_ids.append(tok)
        if logprob is not None:
            req.logprobs.append(logprob[0])
            req.top_logprobs.append(logprob[1])
        self.stats["tokens_generated"] += 1
        p = req.params
        if (tok in p.stop_token_ids or (tok == self.eos_token_id and not p.ignore_eos)
                or any(len(w) <= len(req.output_ids) and req.output_ids[-len(w):] == list(w)
                       for w in p.stop_sequences)):
            self._finish(req, "stop", None, notify_token=tok)
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_context:
            self._finish(req, "length", None, notify_token=tok)
        else:
            self._notify(req, tok, False, None)

    # ---- overlapped decode ------------------------------------------------------------------------------
    def _overlappable(self, plan: list[tuple[Request, int]]) -> bool:
        """The plan can run as an overlapped step: decode rows only, greedy without bad words (sampled rows draw
        on the host with the request's CPU generator)."""
        return (self.pipeline is not None and bool(plan) and len(plan) <= self.pipeline.max_rows
                and all(r.is_decode and r.params.temperature == 0 and not r.params.bad_words for r, _ in plan))

    def _launch(self, group: list[tuple[Request, int]]):
        """Enqueue the decode step of `group` (one token each) behind the step in flight; returns its Ticket. A row
        whose input token is the in-flight step's (num_computed == num_tokens) reads it on the device."""
        prev = self._inflight.rows if self._inflight is not None else {}
        src, host = [], []
        for r, _ in group:
            if r.num_computed == r.num_tokens:
                if r not in prev:
                    raise RuntimeError(f"request {r.request_id}: its input token is in no step in flight")
                src.append(prev[r])
                host.append(0)
            else:
                src.append(-1)
                host.append(r.token_slice(r.num_computed, r.num_computed + 1)[0])
        rids: list[str | None] = [r.request_id for r, _ in group]
        slots = [self.cache.slot(rid) for rid in rids]
        ctx = [r.num_computed for r, _ in group]
        pad = -len(group) % self.decode_pad_multiple if self.decode_pad_multiple else 0
        src += [-1] * pad
        host += [0] * pad
        slots += [0] * pad
        ctx += [0] * pad
        rids += [None] * pad
        ticket, pools = self.pipeline.launch([r for r, _ in group], src, host, slots, ctx,
                                             self.cache.block_tables(rids), self.cache.pools,
                                             [r.params.logprobs for r, _ in group])
        self.cache.set_pools(pools)
        for r, _ in group:
            r.num_computed += 1
        self._stage_periodic(ticket, group)
        return ticket

    def _drain(self, ticket=None) -> list[str]:
        """Book an overlapped step (default: the one in flight, which is then cleared): wait for its tokens, then
        `_emit` each row of a request still unfinished (a row of a request finished meanwhile is dropped). A device
        error finishes the step's requests with it. Returns the step's request ids ([] when none was in flight)."""
        if ticket is None:
            ticket, self._inflight = self._inflight, None
            if ticket is None:
                return []
        booked = [r.request_id for r in ticket.reqs]
        try:
            toks, lps = self.pipeline.wait(ticket)
        except Exception as e:
            log.exception("overlapped decode step failed; finishing its %d requests with an error", len(ticket.reqs))
            for _, staged in ticket.staged:
                self.cache.drop(staged)
            for req in ticket.reqs:
                if req.status != "finished":
                    self._finish(req, "error", f"{type(e).__name__}: {e}", notify_token=None)
            return booked
        for row, req in enumerate(ticket.reqs):
            if req.status == "finished":               # stopped, cancelled or failed while this step ran
                continue
            if toks[row] < 0:                          # its logits row was NaN/Inf: this request alone fails
                self._finish(req, "error", NON_FINITE, notify_token=None)
            else:
                self._emit(req, toks[row], lps[row] if lps is not None else None)
        for req, staged in ticket.staged:              # the step completed: its snapshots are the states it left
            if toks[ticket.rows[req]] < 0:
                self.cache.drop(staged)
            else:
                self.cache.confirm(staged, req.token_slice)
        return booked

    def _step_overlapped(self, plan: list[tuple[Request, int]]) -> list[str]:
        """Launch `plan` (decode rows) behind the step in flight, then book that one."""
        prev = self._inflight
        try:
            ticket = self._launch(plan)
        except Exception:
            log.exception("overlapped decode launch failed; running the step synchronously")
            self._drain()
            return self._run_plan([(r, n) for r, n in plan if r.status == "running"])
        self._inflight = ticket
        self._record(plan)
        self.stats["overlapped_steps"] += 1
        if prev is not None:
            self._drain(prev)
        return self.last_step_requests

    # ---- one step -------------------------------------------------------------------------------------
    def step(self, token_budget: int | None = None) -> list[str]:
        """Schedule and run one step; returns the ids of the requests that ran (an overlapped step: those it
        launched; a step with nothing new to run after booking the step in flight: that step's). token_budget
        overrides max_num_tokens for this step only (tests use it to cut prefills at chosen offsets)."""
        budget = token_budget or self.max_num_tokens
        plan = self._plan(budget)
        if self._overlappable(plan):
            return self._step_overlapped(plan)
        booked = []
        if self._inflight is not None:                 # book the step in flight before a synchronous one
            booked = self._drain()
            plan = [(r, n) for r, n in plan if r.status == "running"] if plan else self._plan(budget)
        return self._run_plan(plan) if plan else booked

    def _record(self, plan: list[tuple[Request, int]]) -> None:
        self.last_step_requests = [r.request_id for r, _ in plan]
        self.stats["steps"] += 1
        self.stats["max_requests_per_step"] = max(self.stats["max_requests_per_step"], len(plan))

    def _run_plan(self, plan: list[tuple[Request, int]]) -> list[str]:
        """Run a plan synchronously: its decode rows as one forward, then its prefill chunks as another."""
        if not plan:
            return []
        decode = [(r, n) for r, n in plan if r.is_decode]
        prefill = [(r, n) for r, n in plan if not r.is_decode]
        self._record(plan)
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
        self._drain()                                  # an overlapped step of finished requests may be in flight
