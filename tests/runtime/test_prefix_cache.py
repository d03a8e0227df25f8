"""Prefix caching (runtime/prefix_cache.py, HybridCache, Scheduler; docs/PREFIX_CACHING.md): a cache hit behaves
like a miss.

Bit-exact equality needs the same arithmetic on both sides. The CPU reference's GEMMs round a row differently
for different row counts (below ~16 rows), and the absorbed MLA decode differs from the prefill, so a batched run
with caching on (other chunks, restored state computed by an earlier request's decode steps) differs from one
with caching off in the last bits. The equality tests' executor therefore runs every token alone, as a one-token prefill of
its sequence: each token's logits are then a function of its id, its position and the state before it, and a
hit that restores the right state (KDA recurrent state + conv history, latent blocks) gives bit-identical logits,
while a wrong snapshot position, a stale conv history, a mis-copied partial block or an overwritten shared block
changes them. The scheduler, the cache and the prefix index do not know the executor is serial (`RecordingExecutor`;
its `forward_on_device` runs the same path, so overlapped decode steps are compared the same way). The batched
executor is compared too (tokens equal, logits close).
"""
from __future__ import annotations

import math
import random

import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from k3deploy.model.config import load_config
from k3deploy.model.reference import Batch, KdaSnapshot
from k3deploy.runtime.cache import CacheFull, HybridCache, plan_memory
from k3deploy.runtime.executor import Executor, TorchExecutor
from k3deploy.runtime.prefix_cache import PrefixChain, check_content_keys
from k3deploy.runtime.sampling import SamplingParams
from k3deploy.runtime.scheduler import Scheduler

MiB = 1 << 20


pytestmark = pytest.mark.usefixtures("one_thread")          # tests/runtime/conftest.py


@pytest.fixture
def fast_dequant(monkeypatch):
    """Memoize the MXFP4 dequantization of the reference MoE (the same values, computed once per expert matrix):
    it is most of a one-token forward's time."""
    from k3deploy.plugins.moe import reference as moe_ref
    inner = moe_ref.dequant_mxfp4
    memo: dict = {}

    def dequant(packed, scale):
        key = (packed.data_ptr(), scale.data_ptr(), tuple(packed.shape))
        if key not in memo:
            memo[key] = (packed, inner(packed, scale))          # keep the tensors alive: their addresses are keys
        return memo[key][1]
    monkeypatch.setattr(moe_ref, "dequant_mxfp4", dequant)


class RecordingExecutor:
    """`TorchExecutor` on the CPU reference that records the logits of every sequence's last token by (request id,
    position) (the scheduler's cache maps slots to requests: `self.sched`, set after the scheduler is built).
    serial: run every token alone, as a one-token prefill of its sequence, in order (see the module docstring);
    an in-step KDA snapshot (`Batch.kda_snapshot`) is then taken by the one-token forward that ends at its position.
    rounds: take the in-step snapshots as the graph backends do, one whole forward per snapshot round
    (`Executor.forward_in_rounds`), instead of inside each KDA layer.
    `forward_on_device` (the overlapped decode steps) runs the same path."""

    def __init__(self, model, serial: bool = True, rounds: bool = False):
        self.inner, self.serial = TorchExecutor(model), serial
        self.cfg, self.tp, self.act_dtype, self.device = model.cfg, 1, torch.float32, model.device
        self.rounds = rounds
        self.sched = None
        self.logits: dict[tuple[str, int], torch.Tensor] = {}

    def _record(self, rid: str, pos: int, row: torch.Tensor) -> None:
        if self.serial and (rid, pos) in self.logits:      # a recompute after preemption: the same bits
            assert torch.equal(self.logits[(rid, pos)], row), (rid, pos)
        self.logits[(rid, pos)] = row

    def forward_on_device(self, ids, batch, pools, logits_index):
        return self.forward(ids, batch, pools, logits_index)

    def forward(self, ids, batch, pools, logits_index, image_rows=None):
        assert image_rows is None, "text only"
        if self.rounds and batch.kda_snapshot is not None:
            return Executor.forward_in_rounds(self, ids, batch, pools, logits_index)
        cache = self.sched.cache
        owner = {cache.slot(r): r for r in self.sched.requests if r in cache}
        cu = batch.cu_seqlens.tolist()
        if not self.serial:
            logits, pools = self.inner.forward(ids, batch, pools, logits_index)
            for n, row in enumerate(logits):               # the scheduler asks for each sequence's last token
                self._record(owner[int(batch.slots[n])], int(batch.context_lens[n]) + cu[n + 1] - cu[n] - 1, row)
            return logits, pools
        snap = batch.kda_snapshot
        at = {(seq, offset): row for seq, offset, row in snap.at} if snap is not None else {}
        last = []
        for n in range(len(cu) - 1):
            rid, ctx = owner[int(batch.slots[n])], int(batch.context_lens[n])
            for j in range(cu[n + 1] - cu[n]):
                here = None
                if (n, j + 1) in at:                       # the state after this token is a snapshot's
                    here = KdaSnapshot.of([0, 1], [(0, 1, at[(n, j + 1)])], snap.pools)
                one = Batch(torch.tensor([0, 1], dtype=torch.int32), batch.slots[n:n + 1],
                            batch.block_tables[n:n + 1], torch.tensor([ctx + j], dtype=torch.int32), kda_snapshot=here)
                logits, pools = self.inner.forward(ids[cu[n] + j: cu[n] + j + 1], one, pools,
                                                   torch.zeros(1, dtype=torch.long))
                self._record(rid, ctx + j, logits[0])
            last.append(logits[0])
        if logits_index is None:                           # every row: a decode step's one token per sequence
            return torch.stack(last), pools
        rows = {c - 1: n for n, c in enumerate(cu[1:])}
        return torch.stack([last[rows[int(i)]] for i in logits_index]), pools


def make(model, *, caching: bool, serial: bool = True, max_batch=3, block_size=4, num_blocks=65, interval=8,
         snapshots=8, max_context=96, max_num_tokens=16, overlap=False, rounds=False):
    cache = HybridCache(model.cfg, max_batch + 1, num_blocks, block_size, max_context=max_context,
                        num_snapshots=snapshots if caching else 0, snapshot_interval=interval if caching else None)
    ex = RecordingExecutor(model, serial, rounds)
    sched = Scheduler(ex, cache, max_batch, max_num_tokens, eos_token_id=-1, overlap=overlap)
    ex.sched = sched
    return sched


class Run:
    """The tokens every request of one scheduler generated."""

    def __init__(self, sched):
        self.sched, self.tokens, self.reqs = sched, {}, {}

    def add(self, rid, prompt, n, keys=None, stop=()):
        self.tokens[rid] = []

        def on_token(tok, finished, error):
            assert error is None, error
            if tok is not None:
                self.tokens[rid].append(tok)
        params = SamplingParams(max_tokens=n, ignore_eos=True, stop_token_ids=tuple(stop))
        self.reqs[rid] = self.sched.add(rid, prompt, params, on_token, content_keys=keys)
        return self.reqs[rid]


def shared_contents(cache: HybridCache) -> dict:
    """{snapshot: (its blocks' latent rows in every MLA layer, its KDA rows)}: what no one may write while it
    lives."""
    out = {}
    for snap in cache.index.entries.values():
        lat = [cache.pools[l]["cache"][list(snap.blocks)].clone() for l in cache.mla_layers]
        kda = [cache.snapshots.pools[l][n][snap.row].clone() for l in cache.kda_layers for n in ("state", "conv")]
        out[snap] = (lat, kda)
    return out


MAX_PROMPT = 40
TOTALS = {"hit_tokens": 0, "partial_hits": 0, "evictions": 0, "preemptions": 0, "cancels": 0, "stops": 0,
          "in_step": 0, "several_in_a_chunk": 0}


def machine(model, overlap: bool = False, rounds: bool = False):
    """The conversation-tree state machine over `model` (caching on vs off, both with the serial RecordingExecutor,
    both with overlapped decode steps or both without; rounds: the executor takes in-step snapshots in rounds)."""

    class PrefixCacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            kw = dict(overlap=overlap, rounds=rounds)
            self.on, self.off = Run(make(model, caching=True, **kw)), Run(make(model, caching=False, **kw))
            cache, allocate = self.on.sched.cache, self.on.sched.cache.allocate

            def counting_allocate(rid, snapshot=None):        # count restores that copy a partial block
                TOTALS["partial_hits"] += snapshot is not None and snapshot.length % cache.block_size != 0
                return allocate(rid, snapshot)
            cache.allocate = counting_allocate
            stage_in_step = self.on.sched._stage_in_step

            def counting_stage_in_step(group):                # count the snapshots taken inside prefill steps
                out = stage_in_step(group)
                TOTALS["in_step"] += len(out)
                rows = [row for row, _, _ in out]
                TOTALS["several_in_a_chunk"] += len(rows) > len(set(rows))
                return out
            self.on.sched._stage_in_step = counting_stage_in_step
            self.prompts: dict[str, list[int]] = {}
            self.cancelled: set[str] = set()
            self.n = 0
            self.shared = {}

        def _submit(self, data, parent: list[int], steps: int | None = None):
            rnd = random.Random(data.draw(st.integers(0, 2 ** 16), label="seed"))
            fresh = [rnd.randrange(3, model.cfg.vocab_size) for _ in range(data.draw(st.integers(1, 12), label="new"))]
            prompt = (parent + fresh)[:MAX_PROMPT] if len(parent) < MAX_PROMPT else parent[:MAX_PROMPT - 1] + fresh[:1]
            rid = f"r{self.n}"
            self.n += 1
            self.prompts[rid] = prompt
            n = data.draw(st.integers(1, 5), label="max_tokens")
            share = data.draw(st.sampled_from([0.0, 0.0, 0.3, 0.6]), label="stop share")   # of the vocabulary
            stop = [t for t in range(model.cfg.vocab_size) if rnd.random() < share]
            for run in (self.on, self.off):
                run.add(rid, prompt, n, stop=stop)
            if steps is None:
                steps = data.draw(st.integers(0, 6), label="steps")
            self.step(data.draw(st.integers(1, 12), label="budget"), steps)

        def _finished(self) -> list[str]:
            return [r for r in self.prompts if r not in self.on.sched.requests]

        @initialize(data=st.data())
        def first(self, data):
            self._submit(data, [])

        @precondition(lambda self: len(self.on.sched.requests) < 5 and self._finished())
        @rule(data=st.data())
        def next_turn(self, data):
            """The next turn of a finished conversation (the latest ones first): its prompt + reply + new tokens."""
            rid = data.draw(st.sampled_from(self._finished()[::-1]))
            self._submit(data, self.prompts[rid] + self.on.tokens[rid])

        @precondition(lambda self: len(self.on.sched.requests) < 5)
        @rule(data=st.data())
        def branch(self, data):
            """A prompt sharing a prefix of random length with an earlier prompt or reply (or nothing)."""
            seqs = [p for p in self.prompts.values()] + [self.prompts[r] + t for r, t in self.on.tokens.items()]
            parent = data.draw(st.sampled_from(seqs))
            self._submit(data, parent[:data.draw(st.integers(0, len(parent)), label="cut")])

        def _stopping(self) -> list[str]:
            """Requests whose stop token is in the overlapped step in flight (caching on; on the CPU it already ran)."""
            t = self.on.sched._inflight
            return [] if t is None else [r.request_id for r, tok in zip(t.reqs, t.ids.tolist())
                                         if tok in r.params.stop_token_ids]

        @precondition(lambda self: len(self.on.sched.requests) < 4 and self._stopping())
        @rule(data=st.data())
        def arrive_on_a_stop(self, data):
            """A request arrives while a request's stop token is in flight, one step runs (it admits the newcomer, so
            it books the step in flight before running synchronously), then the next turn of that conversation."""
            stopping = self._stopping()
            seqs = [p for p in self.prompts.values()] + [self.prompts[r] + t for r, t in self.on.tokens.items()]
            parent = data.draw(st.sampled_from(seqs))
            self._submit(data, parent[:data.draw(st.integers(0, len(parent)), label="cut")], steps=1)
            for rid in stopping:
                if rid not in self.on.sched.requests and len(self.on.sched.requests) < 5:
                    self._submit(data, self.prompts[rid] + self.on.tokens[rid])

        @rule(budget=st.integers(1, 12), steps=st.integers(1, 4))
        def step(self, budget, steps):
            for _ in range(steps):
                for run in (self.on, self.off):
                    run.sched.step(token_budget=budget)
                if self._stopping():
                    break                                    # the next rule may land in that window

        @precondition(lambda self: self.on.sched.requests)
        @rule(data=st.data())
        def cancel(self, data):
            if data.draw(st.integers(0, 2)):                  # rarer than the other rules
                return
            rid = data.draw(st.sampled_from(sorted(self.on.sched.requests)))
            TOTALS["cancels"] += 1
            self.cancelled.add(rid)
            for run in (self.on, self.off):
                run.sched.cancel(rid)

        @precondition(lambda self: self.on.sched.running)
        @rule(data=st.data())
        def preempt(self, data):
            if data.draw(st.integers(0, 1)):
                return
            rid = data.draw(st.sampled_from(sorted(r.request_id for r in self.on.sched.running)))
            for run in (self.on, self.off):
                req = run.sched.requests.get(rid)
                if req is not None and req.status == "running":
                    run.sched._preempt(req)

        @invariant()
        def cache_invariants(self):
            cache = self.on.sched.cache
            cache.check_consistent()
            self.off.sched.cache.check_consistent()
            now = shared_contents(cache)
            for snap, (lat, kda) in now.items():
                if snap in self.shared:                      # the same snapshot lived through the step: unchanged
                    old_lat, old_kda = self.shared[snap]
                    assert all(torch.equal(a, b) for a, b in zip(lat, old_lat)), f"shared block written: {snap}"
                    assert all(torch.equal(a, b) for a, b in zip(kda, old_kda)), f"snapshot row written: {snap}"
            self.shared = {s: self.shared.get(s, c) for s, c in now.items()}

        def teardown(self):
            for run in (self.on, self.off):
                run.sched.run_until_done()
            self.cache_invariants()
            on_l, off_l = self.on.sched.executor.logits, self.off.sched.executor.logits
            for rid, prompt in self.prompts.items():
                a, b = self.on.tokens[rid], self.off.tokens[rid]
                k = min(len(a), len(b))                       # a cancel may cut the runs at different lengths
                assert a[:k] == b[:k], f"{rid}: tokens {a} (caching on) != {b} (off)"
                assert rid in self.cancelled or len(a) == len(b), f"{rid}: {len(a)} tokens on, {len(b)} off"
                for i in range(k):                            # the logits that chose each token
                    pos = len(prompt) - 1 + i
                    assert torch.equal(on_l[(rid, pos)], off_l[(rid, pos)]), f"{rid}: logits at {pos} differ"
            common = on_l.keys() & off_l.keys()
            assert all(torch.equal(on_l[k], off_l[k]) for k in common)
            cache = self.on.sched.cache
            st_ = cache.prefix_stats
            TOTALS["hit_tokens"] += st_["hit_tokens"]
            TOTALS["evictions"] += st_["evictions"]
            TOTALS["preemptions"] += self.on.sched.stats["preemptions"]
            TOTALS["stops"] += sum(1 for r in self.on.reqs.values() if r.finish_reason == "stop")
            assert cache.slots_in_use == 0 and self.off.sched.cache.blocks_in_use == 0
            cache.reset_prefix_cache()
            assert cache.blocks_in_use == 0 and not len(cache.index) and cache.prefix_metrics()["prefix_cache_tokens"] == 0
            cache.check_consistent()

    return PrefixCacheMachine


@pytest.mark.parametrize("overlap, rounds", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["sync-layers", "overlap-layers", "sync-rounds", "overlap-rounds"])
def test_caching_on_equals_off_bit_exact_random_conversation_trees(micro_model, fast_dequant, overlap, rounds):
    """Random conversation trees (prompts sharing prefixes of random lengths with earlier prompts and replies),
    random chunk budgets, stop tokens (landing while other requests arrive), preemptions and cancels, with decode
    steps synchronous or overlapped, and periodic snapshots (several in one chunk) taken inside the KDA layers or by
    one forward per snapshot round: caching
    on gives every request the tokens and logits of caching off, bit for bit; after every step the cache invariants
    hold and no snapshot's blocks or KDA rows changed; the pools are empty once the requests ended and the cache is
    reset."""
    for k in TOTALS:
        TOTALS[k] = 0
    run_state_machine_as_test(machine(micro_model, overlap, rounds), settings=settings(
        max_examples=8, stateful_step_count=30, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    assert all(TOTALS.values()), TOTALS                      # the examples exercised what they are for


def _stop_under_overlap(model, caching: bool, prompt: list[int], stop: int, at: int, arrival: bool):
    """Request "a" (stop token `stop`, its output token `at`) runs with overlapped decode steps until that token is in
    flight; with `arrival`, request "b" arrives then (the next step admits it, so it books the step in flight first).
    After both ended, "c" (fresh tokens: the slot "a" left) and "a2" (a's next turn) run. Returns (run, slots by
    request, prompts)."""
    sched = make(model, caching=caching, overlap=True, max_batch=2, max_context=64)
    run, slots, allocate = Run(sched), {}, sched.cache.allocate

    def recording_allocate(rid, snapshot=None):
        slots[rid] = allocate(rid, snapshot)
        return slots[rid]
    sched.cache.allocate = recording_allocate
    a = run.add("a", prompt, 8, stop=[stop])
    while not (len(a.output_ids) == at and sched._inflight is not None and a in sched._inflight.rows):
        assert a.status != "finished"
        sched.step()
    prompts = {"a": prompt, "c": [12, 13, 14, 15]}
    if arrival:
        prompts["b"] = [7, 8, 9, 10, 11]
        run.add("b", prompts["b"], 3)
    sched.run_until_done()
    assert a.finish_reason == "stop" and run.tokens["a"][-1] == stop
    run.add("c", prompts["c"], 3)
    sched.run_until_done()
    prompts["a2"] = prompt + run.tokens["a"] + [20, 21]
    run.add("a2", prompts["a2"], 3)
    sched.run_until_done()
    sched.cache.check_consistent()
    return run, slots, prompts


@pytest.mark.parametrize("arrival", [True, False], ids=["request-arrives", "step-in-flight"])
def test_a_stop_under_overlap_snapshots_the_state_it_computed(micro_model, fast_dequant, arrival):
    """A request that stops on a token read while another step is in flight: when a request arrives in that window
    (the step booked before a synchronous one), its end snapshot is at prompt + reply minus the stop token, the
    state its last completed step computed; when the next overlapped step holds its dropped row, the snapshot is at
    prompt + the whole reply, published once that step completed. Its next turn resumes there with caching off's
    tokens and logits bit for bit, and the request admitted into the slot it left behaves like one in a fresh
    slot."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, 1000) for _ in range(10)]
    probe = make(micro_model, caching=False, max_batch=2, max_context=64)
    probe_run = Run(probe)
    probe_run.add("p", prompt, 8)
    probe.run_until_done()
    reply = probe_run.tokens["p"]
    at = next(i for i in range(2, 8) if reply[i] not in reply[:i])     # a stop token after two decode steps
    (on, slots, prompts), (off, _, _) = (_stop_under_overlap(micro_model, c, prompt, reply[at], at, arrival)
                                         for c in (True, False))
    assert on.tokens == off.tokens and on.tokens["a"] == reply[:at + 1]
    on_l, off_l = on.sched.executor.logits, off.sched.executor.logits
    for rid, p in prompts.items():
        for i in range(len(on.tokens[rid])):
            pos = len(p) - 1 + i
            assert torch.equal(on_l[(rid, pos)], off_l[(rid, pos)]), (rid, pos)
    assert slots["c"] == slots["a"]
    want = len(prompt) + at if arrival else len(prompt) + at + 1
    assert on.reqs["a2"].num_cached_tokens == want, (on.reqs["a2"].num_cached_tokens, want)
    cache = on.sched.cache
    assert cache.reset_prefix_cache() and cache.blocks_in_use == 0 and cache.slots_in_use == 0


def test_periodic_snapshots_during_overlapped_decode(micro_model, fast_dequant):
    """Decode steps that reach a multiple of snapshot_interval: overlapped, the snapshots are staged after the step
    that computes the state and published once it completed, at the same positions and with the same KDA rows as
    with synchronous steps (bit for bit); a request branching from the reply resumes at the last one with caching
    off's logits. A step that fails publishes nothing it staged, and gives back its rows and blocks."""
    rng = random.Random(4)
    prompt = [rng.randrange(3, 1000) for _ in range(6)]
    rows = {}
    for overlap in (False, True):
        sched = make(micro_model, caching=True, overlap=overlap, max_batch=2, max_context=64)
        run = Run(sched)
        run.add("a", prompt, 14)
        sched.run_until_done()
        cache = sched.cache
        rows[overlap] = {snap.length: [cache.snapshots.pools[l][n][snap.row].clone() for l in cache.kda_layers
                                       for n in ("state", "conv")] for snap in cache.index.entries.values()}
        assert sorted(rows[overlap]) == [8, 16, 19], sorted(rows[overlap])
        if overlap:
            assert sched.stats["overlapped_steps"] >= 10
            branch = prompt + run.tokens["a"][:12] + [5, 6]
            b = run.add("b", branch, 3)
            sched.run_until_done()
            off = make(micro_model, caching=False, max_batch=2, max_context=64)
            off_run = Run(off)
            off_run.add("b", branch, 3)
            off.run_until_done()
            assert b.num_cached_tokens == 16 and run.tokens["b"] == off_run.tokens["b"]
            for i in range(3):
                pos = len(branch) - 1 + i
                assert torch.equal(sched.executor.logits[("b", pos)], off.executor.logits[("b", pos)]), pos
    for length, want in rows[False].items():
        assert all(torch.equal(x, y) for x, y in zip(rows[True][length], want)), length
    # a failing step: the snapshot it staged (at 8) is dropped, nothing leaks
    sched = make(micro_model, caching=True, overlap=True, max_batch=2, max_context=64)
    req = sched.add("a", prompt, SamplingParams(max_tokens=14, ignore_eos=True))
    wait = sched.pipeline.wait

    def failing(ticket):
        if any(staged.length == 8 for _, staged in ticket.staged):
            raise RuntimeError("device error")
        return wait(ticket)
    sched.pipeline.wait = failing
    sched.run_until_done()
    assert req.finish_reason == "error" and "device error" in req.error
    assert not len(sched.cache.index) and sched.cache.blocks_in_use == 0 and sched.cache.slots_in_use == 0
    sched.cache.check_consistent()


# ---- keys, chain and content keys (the image hook) ------------------------------------------------------------

def test_content_keys_are_validated_naming_the_field():
    assert check_content_keys(None, 10) == ()
    assert check_content_keys([(4, 8, "b"), (0, 2, b"a")], 10) == ((0, 2, b"a"), (4, 8, b"b"))
    for bad, why in (([(0, 11, "x")], "0 <= start < end <= 10"), ([(3, 3, "x")], "start < end"),
                     ([(0, 2, "")], "non-empty"), ([(0, 2)], "triple"), ([(0, 4, "a"), (3, 6, "b")], "overlap"),
                     (5, "list of"), ([(True, 2, "x")], "token positions")):
        with pytest.raises(ValueError, match="content_keys") as e:
            check_content_keys(bad, 10)
        assert why in str(e.value)


def test_chain_digests_tokens_and_content():
    toks = list(range(3, 40))
    sl = lambda a, b: toks[a:b]                                  # noqa: E731
    a, b = PrefixChain(4), PrefixChain(4)
    assert a.base(5, sl) == b.base(5, sl) and a.key(21, sl) == b.key(21, sl)
    assert len({a.key(n, sl)[0] for n in range(1, 30)}) == 29          # every length has its own key
    other = toks[:6] + [999] + toks[7:]
    c = PrefixChain(4)
    osl = lambda x, y: other[x:y]                                # noqa: E731
    assert c.base(1, osl) == a.base(1, sl) and all(c.base(k, osl) != a.base(k, sl) for k in range(2, 6))
    img1, img2 = PrefixChain(4, [(9, 13, b"cat")]), PrefixChain(4, [(9, 13, b"dog")])
    assert img1.base(2, sl) == a.base(2, sl)                     # blocks before the image are shared
    assert img1.base(3, sl) != img2.base(3, sl) != a.base(3, sl)
    assert img1.base(3, sl) == PrefixChain(4, [(9, 13, b"cat")]).base(3, sl)


def test_images_share_state_only_with_the_same_content(micro_model):
    """Content keys: a prompt whose image placeholder tokens carry another content hash misses; the same hash
    hits; no snapshot position lies inside a span (the match stops before the image)."""
    sched = make(micro_model, caching=True, serial=False, interval=8, max_context=64, snapshots=16)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(30)]
    run = Run(sched)
    run.add("cat", prompt, 3, [(12, 20, "cat")])
    sched.run_until_done()
    positions = sorted(s.length for s in sched.cache.index.entries.values())
    assert positions == [8, 24, 32]                  # every 8 tokens and the end (32 = 30 + 3 - 1); 16 is in the image
    turn = prompt + run.tokens["cat"] + [7, 8, 9]
    for rid, keys, cached in (("dog", [(12, 20, "dog")], 8), ("cat2", [(12, 20, "cat")], 32), ("none", None, 8),
                              ("inside", [(12, 20, "cat"), (30, 34, "x")], 24)):
        req = run.add(rid, turn, 2, keys)
        sched.run_until_done()
        assert req.num_cached_tokens == cached, rid
    sched.cache.check_consistent()


# ---- the cache alone: restore, publish, eviction, accounting ------------------------------------------------

def test_restore_copies_state_and_partial_block_and_evicts_lru(micro_cfg):
    cache = HybridCache(micro_cfg, 3, 9, 4, num_snapshots=2, snapshot_interval=8)
    toks = list(range(3, 40))
    sl = lambda a, b: toks[a:b]                                  # noqa: E731
    kda, mla = cache.kda_layers[0], cache.mla_layers[0]
    cache.allocate("a")
    cache.append("a", 8)
    cache.pools[kda]["state"][1] = 1.5
    assert cache.publish("a", sl)                               # block aligned while running: ok
    cache.append("a", 2)
    assert not cache.publish("a", sl)                           # 10 tokens: a running request keeps writing block 2
    cache.pools[kda]["state"][1] = 2.5
    cache.pools[mla]["cache"][cache.blocks("a")[2], :2] = 7.0
    assert cache.publish("a", sl, final=True)                   # the end of a finished request: any length
    blocks = cache.blocks("a")
    cache.free("a")
    cache.check_consistent()
    assert cache.blocks_in_use == 3 and cache.available_blocks == 8 and cache.prefix_metrics()["prefix_cache_tokens"] == 10
    snap = cache.lookup("b", sl, 12)
    assert snap.length == 10
    cache.allocate("b", snap)
    assert cache.num_tokens("b") == 10 and cache.blocks("b")[:2] == blocks[:2] and cache.blocks("b")[2] != blocks[2]
    assert torch.equal(cache.pools[mla]["cache"][cache.blocks("b")[2], :2], cache.pools[mla]["cache"][blocks[2], :2])
    assert (cache.pools[kda]["state"][cache.slot("b")] == 2.5).all()
    cache.check_consistent()
    assert cache.lookup("c", sl, 10).length == 8                # at most num_tokens - 1 tokens are reused
    assert cache.lookup("d", lambda a, b: [5] * (b - a), 12) is None
    # a third snapshot, periodic, evicts the least recently used periodic one: periodic snapshots hold half the
    # rows (8), so the end-of-request one (10) stays although the lookup of "c" used 8 after it
    cache.append("b", 6)
    assert cache.publish("b", sl)
    assert sorted(s.length for s in cache.index.entries.values()) == [10, 16]
    assert cache.prefix_stats["evictions"] == 1
    cache.free("b")
    # blocks held only by snapshots are available: taking them evicts snapshots
    cache.allocate("e")
    cache.append("e", 32)                                       # all 8 blocks
    assert not len(cache.index) and cache.prefix_stats["evictions"] == 3
    cache.free("e")
    cache.check_consistent()
    assert cache.blocks_in_use == 0 and cache.reset_prefix_cache() == 0


def test_eviction_spares_what_it_cannot_free_and_keeps_half_the_rows_per_kind(micro_cfg):
    """Taking a latent block evicts only snapshots holding a block no request holds (a snapshot whose blocks a
    running request shares frees nothing and stays); a burst of periodic snapshots (one long prompt) evicts
    end-of-request snapshots only until periodic ones hold half the rows, then its own oldest."""
    toks = list(range(3, 90))
    sl = lambda a, b: toks[a:b]                                  # noqa: E731
    cache = HybridCache(micro_cfg, 3, 7, 4, num_snapshots=4, snapshot_interval=4)
    cache.allocate("a")
    cache.append("a", 8)
    assert cache.publish("a", sl, length=4) and cache.publish("a", sl, length=8)    # a still holds both blocks
    cache.allocate("o")
    cache.append("o", 4)
    assert cache.publish("o", lambda a, b: [9] * (b - a), final=True)
    cache.free("o")                                             # its block is held by its snapshot alone
    cache.allocate("b")
    cache.append("b", 16)                                       # 4 free blocks, then the one o's snapshot holds
    assert sorted(s.length for s in cache.index.entries.values()) == [4, 8]
    assert cache.prefix_stats["evictions"] == 1
    with pytest.raises(CacheFull):
        cache.append("b", 4)                                    # a's snapshots would free nothing: they stay
    assert len(cache.index) == 2
    cache.check_consistent()
    cache.free("a")
    cache.free("b")
    assert cache.reset_prefix_cache() == 2

    cache = HybridCache(micro_cfg, 4, 40, 4, num_snapshots=4, snapshot_interval=4)
    for rid in ("x", "y", "z", "w"):                            # four finished conversations fill the pool
        cache.allocate(rid)
        cache.append(rid, 6)
        assert cache.publish(rid, lambda a, b, r=rid: [ord(r)] * (b - a), final=True)
        cache.free(rid)
    cache.allocate("long")
    cache.append("long", 24)
    for n in range(4, 25, 4):                                   # six periodic snapshots of one prompt
        assert cache.publish("long", sl, length=n)
    kinds = sorted((s.final, s.length) for s in cache.index.entries.values())
    assert kinds == [(False, 20), (False, 24), (True, 6), (True, 6)], kinds
    cache.free("long")
    cache.check_consistent()


def test_snapshot_interval_and_sizes_are_validated(micro_cfg):
    with pytest.raises(ValueError, match="snapshot_interval = 6: must be a positive multiple of the latent block size 4"):
        HybridCache(micro_cfg, 3, 9, 4, num_snapshots=2, snapshot_interval=6)
    with pytest.raises(ValueError, match="snapshot_interval = 0: must be a positive multiple"):   # not the default
        HybridCache(micro_cfg, 3, 9, 4, num_snapshots=2, snapshot_interval=0)
    with pytest.raises(ValueError, match="num_snapshots = -1"):
        HybridCache(micro_cfg, 3, 9, 4, num_snapshots=-1)
    assert HybridCache(micro_cfg, 3, 9, 64, num_snapshots=1).snapshot_interval == 1024
    assert HybridCache(micro_cfg, 3, 9, 48, num_snapshots=1).snapshot_interval == 1056


def test_memory_plan_budgets_the_snapshot_pool():
    """K3 (MODEL.md §9): one snapshot = one request's KDA state + conv history per rank: 414.0 + 14.6 MiB at TP=1,
    51.8 + 1.8 MiB at TP=8, computed by plan_memory from the config; the pool is budgeted before the blocks."""
    cfg = load_config("k3")
    for tp, state_mib, total_mib in ((1, "414.0", "428.6"), (8, "51.8", "53.6")):
        p = plan_memory(cfg, tp, tp, None, max_batch=8, max_context=8192, block_size=64, num_snapshots=16)
        assert f"{p.kda_state_bytes / MiB:.1f}" == state_mib
        assert p.snapshot_pool_bytes == 16 * p.kda_bytes_per_request and f"{p.kda_bytes_per_request / MiB:.1f}" == total_mib
        assert p.total_bytes == p.slot_pool_bytes + p.block_pool_bytes + p.snapshot_pool_bytes
        assert "snapshot pool" in p.table() and f"{p.snapshot_pool_bytes:,} B" in p.table()
    budget = 80 << 30
    off = plan_memory(cfg, 8, 8, budget, max_batch=64, max_context=131_072, block_size=64)
    on = plan_memory(cfg, 8, 8, budget, max_batch=64, max_context=131_072, block_size=64, num_snapshots=128)
    assert on.num_slots == off.num_slots and on.total_bytes <= budget
    assert on.total_bytes + on.block_bytes > budget                # the snapshots took exactly their bytes of blocks
    assert off.num_blocks - on.num_blocks in (on.snapshot_pool_bytes // on.block_bytes,
                                              math.ceil(on.snapshot_pool_bytes / on.block_bytes))
    with pytest.raises(ValueError, match="snapshot pool"):
        plan_memory(cfg, 1, 1, 40 << 30, max_batch=8, max_context=8192, block_size=64, num_snapshots=100)


# ---- fixed conversations: k3-tiny bit-exact (serial), batched close ----------------------------------------

def conversations(sched) -> tuple[Run, dict[str, list[int]]]:
    """Three users sharing a 24-token system prompt (the second and third arrive once the first's prefill passed
    16 tokens), then each user's second turn (prompt + reply + a new message), then a branch from the middle of the
    first reply. Returns (run, prompts)."""
    rng = random.Random(11)
    words = lambda n: [rng.randrange(3, 1000) for _ in range(n)]           # noqa: E731
    system = words(24)
    run, prompts = Run(sched), {}
    for u in range(3):
        prompts[f"u{u}"] = system + words(3 + 4 * u)
        run.add(f"u{u}", prompts[f"u{u}"], 4)
        while u == 0 and sched.requests["u0"].num_computed < 16:
            sched.step()
    sched.run_until_done()
    for u in range(3):
        prompts[f"u{u}t2"] = prompts[f"u{u}"] + run.tokens[f"u{u}"] + words(5)
        run.add(f"u{u}t2", prompts[f"u{u}t2"], 3)
    prompts["branch"] = prompts["u0"] + run.tokens["u0"][:2] + words(2)
    run.add("branch", prompts["branch"], 3)
    sched.run_until_done()
    return run, prompts


@pytest.mark.parametrize("serial", [True, False], ids=["serial-bit-exact", "batched"])
def test_conversations_on_k3_tiny(tiny_model, fast_dequant, serial):
    """k3-tiny (9 layers, AttnRes, grouped top-k MoE), periodic snapshots taken inside the prefill step's KDA layers
    or by one forward per snapshot round: caching on gives the tokens of caching off; the logits that chose them are
    bit-identical with the serial executor and within fp32 rounding batched; the later turns reused the system
    prompt (periodic snapshot at 16) and the first turns' replies (end snapshots). Both ways take the same
    snapshots (their pool rows bit for bit with the serial executor)."""
    kw = dict(serial=serial, max_batch=3, block_size=8, num_blocks=1 + 3 * 8, interval=16, snapshots=12,
              max_context=64, max_num_tokens=20)
    off = make(tiny_model, caching=False, **kw)
    b, prompts = conversations(off)
    snaps = {}
    for rounds in (False, True):
        on = make(tiny_model, caching=True, rounds=rounds, **kw)
        batches, forward = [], on.executor.forward

        def recording(ids, batch, *args, **kwargs):
            batches.append(batch)
            return forward(ids, batch, *args, **kwargs)
        on.executor.forward = recording
        a, _ = conversations(on)
        assert a.tokens == b.tokens
        for rid, p in prompts.items():
            for i in range(len(a.tokens[rid])):
                x, y = on.executor.logits[(rid, len(p) - 1 + i)], off.executor.logits[(rid, len(p) - 1 + i)]
                if serial:
                    assert torch.equal(x, y), (rid, i)
                else:
                    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        st_ = on.cache.prefix_stats      # u1, u2 and the branch resume at 16, each second turn after its first reply
        assert (st_["hits"], st_["hit_tokens"]) == (6, 3 * 16 + sum(len(prompts[f"u{u}"]) + 3 for u in range(3)))
        assert any(x.kda_snapshot is not None for x in batches)
        cache = on.cache
        snaps[rounds] = {s.key: (s.length, [cache.snapshots.pools[l][n][s.row].clone() for l in cache.kda_layers
                                             for n in ("state", "conv")]) for s in cache.index.entries.values()}
        cache.check_consistent()
        assert cache.reset_prefix_cache() and cache.blocks_in_use == 0 and cache.slots_in_use == 0

    assert {k: n for k, (n, _) in snaps[True].items()} == {k: n for k, (n, _) in snaps[False].items()}
    for key, (length, got) in snaps[True].items():
        for x, y in zip(got, snaps[False][key][1]):
            if serial:
                assert torch.equal(x, y), length
            else:
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


# ---- the API, the onnxruntime backend, TP ---------------------------------------------------------------------

def _two_turns(llm, p1, n=4):
    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    o1 = llm.generate([p1], sp)[0]
    p2 = p1 + o1.token_ids + [5, 6, 7]
    return o1, p2, llm.generate([p2], sp)[0]


def test_llm_enable_prefix_caching(tiny_ckpt):
    """LLM(enable_prefix_caching=True): the second turn resumes after the first reply (num_cached_tokens), gives
    caching off's tokens; metrics; content keys through the engine; reset empties the pools; bad arguments name
    themselves; memory_budget budgets the snapshot pool."""
    from k3deploy.runtime.api import LLM
    kw = dict(max_batch=2, max_num_tokens=32, max_context=128)
    for bad, msg in ((dict(snapshot_interval=32), "snapshot_interval = 32: only used with enable_prefix_caching"),
                     (dict(enable_prefix_caching=True, num_snapshots=0), "num_snapshots = 0"),
                     (dict(enable_prefix_caching=True, snapshot_interval=24), "snapshot_interval = 24: must be a "
                                                                              "positive multiple of the latent block size 16"),
                     (dict(enable_prefix_caching="yes"), "enable_prefix_caching = 'yes'")):
        with pytest.raises(ValueError, match=msg):
            LLM(tiny_ckpt, **kw, **bad)
    p1 = list(range(10, 30))
    off = LLM(tiny_ckpt, **kw)
    assert "prefix_cache_hit_rate" not in off.metrics()
    _, p2, want = _two_turns(off, p1)
    llm = LLM(tiny_ckpt, enable_prefix_caching=True, snapshot_interval=32, **kw)
    assert llm.cache.snapshots.rows == 4 and llm.cache.snapshot_interval == 32
    o1, _, o2 = _two_turns(llm, p1)
    assert o1.num_cached_tokens == 0 and o2.num_cached_tokens == len(p1) + len(o1.token_ids) - 1
    assert o2.token_ids == want.token_ids and o2.num_cached_tokens < len(p2)
    m = llm.metrics()
    assert m["prefix_cache_hit_tokens"] == o2.num_cached_tokens and 0 < m["prefix_cache_hit_rate"] < 1
    assert m["snapshot_pool_bytes"] == m["snapshots_in_use"] * llm.cache.snapshots.bytes_per_row > 0
    assert m["latent_blocks_in_use"] == m["latent_blocks_cached"] > 0 and m["prefix_cache_tokens"] > 0
    eng = llm.start()
    done = []
    r = eng.submit("img", p2, SamplingParams(max_tokens=2), lambda t, f, e: f and done.append(e),
                   content_keys=[(0, 4, "sha256:ab")])
    with pytest.raises(ValueError, match="content_keys"):
        eng.submit("bad", p2, SamplingParams(max_tokens=2), content_keys=[(0, 99, "x")])
    deadline = time.monotonic() + 120
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)                                       # a busy loop here would starve the engine's thread
    assert done == [None] and r.num_cached_tokens == 0        # other content: no shared prefix at all
    assert llm.reset_prefix_cache() > 0
    m = llm.metrics()
    assert m["latent_blocks_in_use"] == m["snapshots_in_use"] == m["kda_slots_in_use"] == 0
    llm.shutdown()
    budget = LLM(tiny_ckpt, enable_prefix_caching=True, num_snapshots=3, memory_budget=4 << 20, **kw)
    assert budget.plan.num_snapshots == 3 and budget.cache.snapshots.rows == 3
    assert budget.plan.snapshot_pool_bytes == 3 * budget.cache.snapshots.bytes_per_row


def test_onnxruntime_backend_with_prefix_caching(tiny_build_tp1):
    """The onnxruntime backend (per-layer graphs take the pools as inputs and return new ones): the restored slot
    and copied blocks live in the cache's pools like the torch backend's; the periodic snapshots inside its 32-token
    prefill chunks (at 16 and 48) are taken by one forward per snapshot round; caching on gives caching off's
    tokens, for the second turn (resumed after the first reply) and for a prompt sharing 50 tokens (resumed at 48)."""
    from k3deploy.runtime.api import LLM
    out, r = tiny_build_tp1
    assert r.returncode == 0, r.stderr[-3000:]
    kw = dict(backend="onnxruntime", max_batch=2, max_num_tokens=32, max_context=256)
    p1 = list(range(40, 110))
    p3 = p1[:50] + [7, 8, 9]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    on = LLM(out, enable_prefix_caching=True, snapshot_interval=16, num_snapshots=8, **kw)
    rounds, forward_in_rounds = [], on.executor.forward_in_rounds
    on.executor.forward_in_rounds = lambda *a, **k: rounds.append(len(a[1].kda_snapshot.rounds)) or forward_in_rounds(
        *a, **k)
    o1, p2, o2 = _two_turns(on, p1)
    o3 = on.generate([p3], sp)[0]
    off = LLM(out, **kw)
    _, _, want = _two_turns(off, p1)
    assert rounds == [2, 2], rounds                  # chunks [0, 32) and [32, 64) of the first turn
    assert o2.token_ids == want.token_ids and o2.num_cached_tokens == len(p1) + len(o1.token_ids) - 1
    assert o3.num_cached_tokens == 48 and o3.token_ids == off.generate([p3], sp)[0].token_ids


TP_SCRIPT = """
import json, sys
from k3deploy.runtime.api import LLM, SamplingParams
from k3deploy.runtime.distributed import init_from_env, shutdown
rank, world = init_from_env("cpu")
llm = LLM(sys.argv[1], max_batch=2, max_num_tokens=16, max_context=96, enable_prefix_caching=True, snapshot_interval=16,
          num_snapshots=3)
decisions = []
publish = llm.cache.publish
llm.cache.publish = lambda rid, *a, **k: decisions.append(("publish", rid, llm.cache.num_tokens(rid),
                                                           publish(rid, *a, **k))) or decisions[-1][-1]
sp = SamplingParams(max_tokens=3, ignore_eos=True)
hist, outs = list(range(5, 25)), []
for turn in range(3):
    o = llm.generate([hist, hist[:18] + [9, 9]], sp)
    outs.append([[x.token_ids, x.num_cached_tokens] for x in o])
    hist = hist + o[0].token_ids + [7 + turn]
    decisions.append(("evictions", llm.cache.prefix_stats["evictions"]))
json.dump({"outs": outs, "decisions": decisions}, open(sys.argv[2] + f".{rank}", "w"))
llm.executor.close()
shutdown()
"""


def test_tp2_ranks_take_identical_decisions(tiny_ckpt, tmp_path):
    """TP=2 over gloo (one process per rank): both ranks publish, hit and evict the same snapshots, and generate
    the same tokens as TP=1 with caching off."""
    import subprocess
    import sys
    from k3deploy.runtime.api import LLM
    from pathlib import Path
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script), str(tiny_ckpt), str(tmp_path / "out")], capture_output=True, text=True,
                       cwd=root, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    import json
    a, b = (json.loads((tmp_path / f"out.{k}").read_text()) for k in (0, 1))
    assert a == b
    assert any(d[0] == "publish" and d[-1] for d in a["decisions"]) and a["decisions"][-1][1] > 0
    assert a["outs"][1][0][1] > 0                                   # the second turn hit
    off = LLM(tiny_ckpt, max_batch=2, max_num_tokens=16, max_context=96)
    hist = list(range(5, 25))
    for turn in range(3):
        o = off.generate([hist, hist[:18] + [9, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert [x.token_ids for x in o] == [t for t, _ in a["outs"][turn]], turn
        hist = hist + o[0].token_ids + [7 + turn]


def test_build_plan_with_prefix_caching(capsys, tmp_path):
    """`k3deploy plan --enable-prefix-caching` (build --dry-run) budgets the runtime's default snapshot pool:
    2 x max_batch rows of one request's KDA state + conv history."""
    from k3deploy.cli import main
    from k3deploy.export.build_engines import parse_args
    from k3deploy.export.plan import make_plan
    assert parse_args(["--enable-prefix-caching"]).enable_prefix_caching and not parse_args([]).enable_prefix_caching
    for bad, msg in ((["--num-snapshots", "4"], "--num-snapshots 4: only used with --enable-prefix-caching"),
                     (["--enable-prefix-caching", "--num-snapshots", "0"], "--num-snapshots 0: give an integer >= 1"),
                     (["--enable-prefix-caching", "--snapshot-interval", "100"], "multiple of --block-size 64")):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    cfg = load_config("k3-tiny")
    p = make_plan(cfg, 2, 2, max_batch=8, max_context=4096, prefix_caching=True)
    assert p.memory.num_snapshots == 16 and p.memory.snapshot_pool_bytes == 16 * p.kda_bytes_per_request
    assert make_plan(cfg, 2, 2, max_batch=8, max_context=4096).memory.num_snapshots == 0
    import json
    from k3deploy.model.config import preset_json
    (tmp_path / "config.json").write_text(json.dumps(preset_json("k3-tiny")))      # a config-only checkpoint
    assert main(["plan", "--checkpoint", str(tmp_path), "--enable-prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert "snapshot pool           16 x KDA total" in out and "snapshot pool (prefix cache) 16 x that" in out
    p = make_plan(load_config("k3"), 8, 8, max_batch=8, max_context=4096, prefix_caching=True, num_snapshots=4)
    assert p.memory is None and "snapshot pool (prefix cache) 4 x that = 224,686,080 B" in p.report()


def test_images_key_the_cache_by_content(tiny_vl_ckpt):
    """k3-tiny-vl with two images: the second turn resumes after the first reply without running the tower, with
    caching off's tokens; the same token ids with other pixels resume only before the first image."""
    import numpy as np
    from PIL import Image

    from k3deploy.runtime.api import LLM
    from k3deploy.runtime.vision import process_image
    PAD, BEGIN, CONTENT, END = 789, 786, 787, 788
    prompt = [5, 6, BEGIN, 7, 8, CONTENT, PAD, END] + list(range(20, 40)) + [BEGIN, 10, CONTENT, PAD, END, 11, 12]

    def pictures(llm, seed):
        rng = np.random.default_rng(seed)
        return [process_image(Image.fromarray(rng.integers(0, 256, (16, 30, 3), dtype=np.uint8)), llm.processor),
                process_image(Image.fromarray(rng.integers(0, 256, (44, 60, 3), dtype=np.uint8)), llm.processor)]
    kw = dict(max_batch=2, max_num_tokens=64, max_context=128)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(tiny_vl_ckpt, **kw, **(dict(enable_prefix_caching=True, snapshot_interval=16) if caching else {}))
        ids, imgs = llm.prepare_images(prompt, pictures(llm, 0))
        first = llm.generate([ids], sp, images=[imgs])[0]
        turn = ids + first.token_ids + [50, 51]
        calls = []
        enc = llm.executor.encode_images
        llm.executor.encode_images = lambda px, g: calls.append(len(g)) or enc(px, g)
        second = llm.generate([turn], sp, images=[imgs])[0]
        _, other = llm.prepare_images(prompt, pictures(llm, 1))
        third = llm.generate([turn], sp, images=[other])[0]
        outs[caching] = (first.token_ids, second.token_ids, third.token_ids)
        if caching:
            pad0 = ids.index(PAD)
            assert second.num_cached_tokens == len(ids) + len(first.token_ids) - 1, (second.num_cached_tokens, len(ids))
            assert sum(calls) == 2 and third.num_cached_tokens <= pad0, (calls, third.num_cached_tokens)  # `third` only
    assert outs[True] == outs[False]
