"""Prefix caching (runtime/prefix_cache.py, HybridCache, Scheduler; docs/PREFIX_CACHING.md): a cache hit behaves
like a miss.

Bit-exact equality needs the same arithmetic on both sides. The CPU reference's GEMMs round a row differently
for different row counts (below ~16 rows), and the absorbed MLA decode differs from the prefill, so a batched run
with caching on (other chunks, restored state computed by an earlier request's decode steps) differs from one
with caching off in the last bits. `SerialExecutor` therefore runs every token alone, as a one-token prefill of
its sequence: each token's logits are then a function of its id, its position and the state before it, and a
hit that restores the right state (KDA recurrent state + conv history, latent blocks) gives bit-identical logits,
while a wrong snapshot position, a stale conv history, a mis-copied partial block or an overwritten shared block
changes them. The scheduler, the cache and the prefix index do not know the executor is serial. The batched
executor is compared too (tokens equal, logits close).
"""
from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from k3deploy.model.config import load_config
from k3deploy.model.reference import Batch
from k3deploy.runtime.cache import HybridCache, plan_memory
from k3deploy.runtime.executor import TorchExecutor
from k3deploy.runtime.prefix_cache import PrefixChain, check_content_keys
from k3deploy.runtime.sampling import SamplingParams
from k3deploy.runtime.scheduler import Scheduler

MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread (the reference is many small ops) and no denormals (the decaying KDA state)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)


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


class SerialExecutor:
    """`TorchExecutor` on the CPU reference, run one token at a time: every token of a forward is a one-token
    prefill of its sequence, in order (see the module docstring). Records every token's logits by (request id,
    position): the scheduler's cache maps slots to requests (`self.sched`, set after the scheduler is built)."""

    def __init__(self, model):
        self.inner = TorchExecutor(model)
        self.cfg, self.tp, self.act_dtype, self.device = model.cfg, 1, torch.float32, model.device
        self.sched = None
        self.logits: dict[tuple[str, int], torch.Tensor] = {}

    def forward(self, ids, batch, pools, logits_index):
        cache = self.sched.cache
        owner = {cache.slot(r): r for r in self.sched.requests if r in cache}
        cu = batch.cu_seqlens.tolist()
        last = []
        for n in range(len(cu) - 1):
            rid, ctx = owner[int(batch.slots[n])], int(batch.context_lens[n])
            for j in range(cu[n + 1] - cu[n]):
                one = Batch(torch.tensor([0, 1], dtype=torch.int32), batch.slots[n:n + 1],
                            batch.block_tables[n:n + 1], torch.tensor([ctx + j], dtype=torch.int32))
                logits, pools = self.inner.forward(ids[cu[n] + j: cu[n] + j + 1], one, pools,
                                                   torch.zeros(1, dtype=torch.long))
                pos = ctx + j
                if (rid, pos) in self.logits:              # a recompute after preemption: the same bits
                    assert torch.equal(self.logits[(rid, pos)], logits[0]), (rid, pos)
                self.logits[(rid, pos)] = logits[0]
            last.append(logits[0])
        rows = {c - 1: n for n, c in enumerate(cu[1:])}
        return torch.stack([last[rows[int(i)]] for i in logits_index]), pools


def make(model, *, caching: bool, serial: bool = True, max_batch=3, block_size=4, num_blocks=65, interval=8,
         snapshots=8, max_context=96):
    cache = HybridCache(model.cfg, max_batch + 1, num_blocks, block_size, max_context=max_context,
                        num_snapshots=snapshots if caching else 0, snapshot_interval=interval if caching else None)
    ex = SerialExecutor(model) if serial else TorchExecutor(model)
    sched = Scheduler(ex, cache, max_batch, 16, eos_token_id=-1)
    if serial:
        ex.sched = sched
    return sched


class Run:
    """The tokens every request of one scheduler generated."""

    def __init__(self, sched):
        self.sched, self.tokens = sched, {}

    def add(self, rid, prompt, n, keys=None):
        self.tokens[rid] = []

        def on_token(tok, finished, error):
            assert error is None, error
            if tok is not None:
                self.tokens[rid].append(tok)
        self.sched.add(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True), on_token, keys)


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
TOTALS = {"hit_tokens": 0, "partial_hits": 0, "evictions": 0, "preemptions": 0, "cancels": 0}


def machine(model):
    """The conversation-tree state machine over `model` (caching on vs off, both with SerialExecutor)."""

    class PrefixCacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.on, self.off = Run(make(model, caching=True)), Run(make(model, caching=False))
            cache, allocate = self.on.sched.cache, self.on.sched.cache.allocate

            def counting_allocate(rid, snapshot=None):        # count restores that copy a partial block
                TOTALS["partial_hits"] += snapshot is not None and snapshot.length % cache.block_size != 0
                return allocate(rid, snapshot)
            cache.allocate = counting_allocate
            self.prompts: dict[str, list[int]] = {}
            self.n = 0
            self.shared = {}

        def _submit(self, data, parent: list[int]):
            rnd = random.Random(data.draw(st.integers(0, 2 ** 16), label="seed"))
            fresh = [rnd.randrange(3, model.cfg.vocab_size) for _ in range(data.draw(st.integers(1, 12), label="new"))]
            prompt = (parent + fresh)[-MAX_PROMPT:] if len(parent) < MAX_PROMPT else parent[:MAX_PROMPT - 1] + fresh[:1]
            rid = f"r{self.n}"
            self.n += 1
            self.prompts[rid] = prompt
            n = data.draw(st.integers(1, 5), label="max_tokens")
            for run in (self.on, self.off):
                run.add(rid, prompt, n)
            self.step(data.draw(st.integers(1, 12), label="budget"), data.draw(st.integers(0, 6), label="steps"))

        def _finished(self) -> list[str]:
            return [r for r in self.prompts if r not in self.on.sched.requests]

        @initialize(data=st.data())
        def first(self, data):
            self._submit(data, [])

        @precondition(lambda self: len(self.on.sched.requests) < 5 and self._finished())
        @rule(data=st.data())
        def next_turn(self, data):
            """The next turn of a finished conversation: its prompt + reply + new tokens."""
            rid = data.draw(st.sampled_from(self._finished()))
            self._submit(data, self.prompts[rid] + self.on.tokens[rid])

        @precondition(lambda self: len(self.on.sched.requests) < 5)
        @rule(data=st.data())
        def branch(self, data):
            """A prompt sharing a prefix of random length with an earlier prompt or reply (or nothing)."""
            seqs = [p for p in self.prompts.values()] + [self.prompts[r] + t for r, t in self.on.tokens.items()]
            parent = data.draw(st.sampled_from(seqs))
            self._submit(data, parent[:data.draw(st.integers(0, len(parent)), label="cut")])

        @rule(budget=st.integers(1, 12), steps=st.integers(1, 4))
        def step(self, budget, steps):
            for _ in range(steps):
                for run in (self.on, self.off):
                    run.sched.step(token_budget=budget)

        @precondition(lambda self: self.on.sched.requests)
        @rule(data=st.data())
        def cancel(self, data):
            if data.draw(st.integers(0, 2)):                  # rarer than the other rules
                return
            rid = data.draw(st.sampled_from(sorted(self.on.sched.requests)))
            TOTALS["cancels"] += 1
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
            assert cache.slots_in_use == 0 and self.off.sched.cache.blocks_in_use == 0
            cache.reset_prefix_cache()
            assert cache.blocks_in_use == 0 and not len(cache.index) and cache.prefix_metrics()["prefix_cache_tokens"] == 0
            cache.check_consistent()

    return PrefixCacheMachine


def test_caching_on_equals_off_bit_exact_random_conversation_trees(micro_model, fast_dequant):
    """Random conversation trees (prompts sharing prefixes of random lengths with earlier prompts and replies),
    random chunk budgets, preemptions and cancels: caching on gives every request the tokens and logits of caching
    off, bit for bit; after every step the cache invariants hold and no snapshot's blocks or KDA rows changed; the
    pools are empty once the requests ended and the cache is reset."""
    for k in TOTALS:
        TOTALS[k] = 0
    run_state_machine_as_test(machine(micro_model), settings=settings(
        max_examples=8, stateful_step_count=30, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    # the examples exercised what they are for
    assert all(TOTALS.values()), TOTALS
