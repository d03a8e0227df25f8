"""One bad request never harms another (runtime/scheduler.py, runtime/sampling.py, runtime/api.py; CPU, k3-tiny).

A scheduler step is atomic per request: a request that fails (NaN/Inf logits, a sampler failure) ends alone with an
error, its slot and blocks freed, and every other request's tokens equal its solo run. Sampling is finite for every
accepted parameter. Bad fields and sizes are one ValueError naming them.
"""
from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import torch

from k3deploy.runtime import scheduler as sched_mod
from k3deploy.runtime.api import LLM, SamplingParams
from k3deploy.runtime.sampling import NonFiniteLogits, make_generator, sample

from poison import poison_copy

WAIT = 300  # hang guard for event waits (not a timing assertion)


pytestmark = pytest.mark.usefixtures("one_thread")          # tests/runtime/conftest.py


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(tiny_ckpt, max_batch=8, max_num_tokens=64, max_context=256) as m:
        yield m


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1024, (n,), generator=g).tolist()


def solo(llm: LLM, p: list[int], params: SamplingParams) -> list[int]:
    """The tokens of one request run alone (nothing else in the scheduler)."""
    assert not llm.scheduler.has_work()
    out = llm.generate([p], params)[0]
    assert out.finish_reason in ("length", "stop"), out
    return out.token_ids


def assert_empty(llm: LLM) -> None:
    m = llm.metrics()
    assert (m["kda_slots_in_use"], m["latent_blocks_in_use"]) == (0, 0), m
    llm.cache.check_consistent()
    assert not llm.scheduler.requests


class PoisonLogits:
    """Executor wrapper: NaN logits for request `rid`'s rows once it has produced `after` tokens (what bad weights
    reached by one request look like to the scheduler)."""

    def __init__(self, sched, rid: str, after: int):
        self.inner, self.sched, self.rid, self.after, self.hits = sched.executor, sched, rid, after, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, ids, batch, pools, index):
        logits, pools = self.inner.forward(ids, batch, pools, index)
        req = self.sched.requests.get(self.rid)
        if req is not None and self.rid in self.sched.cache and len(req.output_ids) >= self.after:
            rows = (batch.slots[: logits.shape[0]] == self.sched.cache.slot(self.rid)).nonzero().reshape(-1)
            if rows.numel():
                logits = logits.clone()
                logits[rows] = float("nan")
                self.hits += 1
        return logits, pools


@contextlib.contextmanager
def poisoned(llm: LLM, rid: str, after: int):
    """llm's scheduler with PoisonLogits for `rid` while the block runs."""
    inner = llm.scheduler.executor
    llm.scheduler.executor = PoisonLogits(llm.scheduler, rid, after)
    try:
        yield llm.scheduler.executor
    finally:
        llm.scheduler.executor = inner


# ---- sampling ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-30, 1e30, 3.4e38])
def test_every_accepted_temperature_samples_finite(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1024, generator=g) * 30
    p = SamplingParams(temperature=temperature, top_k=50, top_p=0.9, seed=1)
    tok = sample(logits, p, make_generator(p))
    assert 0 <= tok < 1024
    if temperature < 1e-20:                                   # a vanishing temperature is greedy
        assert tok == int(torch.argmax(logits))
    with pytest.raises(NonFiniteLogits, match="not finite"):
        sample(torch.tensor([0.0, float("nan"), 1.0]), p, make_generator(p))


def test_tiny_temperature_beside_greedy_harms_no_one(llm):
    """temperature=1e-38 overflowed logits / T to inf, softmax to NaN; multinomial raised after the step had
    advanced the pools, the step was retried on the advanced state, and every request got wrong tokens or raised."""
    a, b = [3, 10, 17, 24, 31], [9, 9, 9]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    want_a, want_b = solo(llm, a, greedy), solo(llm, b, greedy)
    outs = llm.generate([a, b], [greedy, SamplingParams(max_tokens=8, temperature=1e-38, seed=1, ignore_eos=True)])
    assert [o.error for o in outs] == [None, None]
    assert outs[0].token_ids == want_a
    assert outs[1].token_ids == want_b                        # T -> 0 draws the argmax
    assert_empty(llm)
    assert llm.generate([a], greedy)[0].token_ids == want_a   # and the engine keeps serving


# ---- atomic steps ------------------------------------------------------------------------------------------

def test_nan_logits_fail_only_that_request(llm):
    ps = [prompt(6, 1), prompt(30, 2), prompt(3, 3), prompt(12, 4)]
    params = [SamplingParams(max_tokens=7, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.8, top_k=40, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=7, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=1.0, seed=5, ignore_eos=True)]
    want = [solo(llm, p, sp) for p, sp in zip(ps, params)]
    eng = llm.start()
    got: dict[str, list] = {}
    done = threading.Semaphore(0)

    def collect(rid):
        got[rid] = [[], None]

        def cb(tok, fin, err):
            if tok is not None:
                got[rid][0].append(tok)
            if fin:
                got[rid][1] = err
                done.release()
        return cb
    with poisoned(llm, "bad", after=2) as ex:
        with eng._turn():                                     # all in the same steps
            for i, (p, sp) in enumerate(zip(ps, params)):
                eng.submit(f"r{i}", p, sp, collect(f"r{i}"))
            eng.submit("bad", prompt(9, 9), SamplingParams(max_tokens=7, ignore_eos=True), collect("bad"))
        for _ in range(5):
            assert done.acquire(timeout=WAIT)
    assert ex.hits >= 1
    toks, err = got.pop("bad")
    assert len(toks) == 2 and err is not None and "not finite" in err
    for i in range(4):
        assert got[f"r{i}"] == [want[i], None], i
    assert_empty(llm)


def test_sampler_failure_is_retried_row_by_row(llm, monkeypatch):
    """The batched draw raising (after advancing some generators) costs nothing: each row is drawn alone from its
    generator's state before the batch, so seeded requests still give their solo tokens."""
    ps = [prompt(5, 20), prompt(7, 21), prompt(4, 22)]
    params = [SamplingParams(max_tokens=5, temperature=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    want = [solo(llm, p, sp) for p, sp in zip(ps, params)]
    real = sched_mod.sample_batch
    calls = []

    def flaky(logits, prm, gens):
        calls.append(len(prm))
        if len(calls) % 2:
            real(logits[:1], prm[:1], gens[:1])               # advance a generator, then fail
            raise RuntimeError("device lost for a moment")
        return real(logits, prm, gens)
    monkeypatch.setattr(sched_mod, "sample_batch", flaky)
    outs = llm.generate(ps, params)
    assert calls and [o.token_ids for o in outs] == want and all(o.error is None for o in outs)
    assert_empty(llm)


def test_nan_weights_error_instead_of_tokens(tiny_ckpt, tmp_path):
    """A NaN in one row of the embedding (a bad weight only one token reaches): the requests holding that token end
    with an error naming non-finite logits (greedy served [0, 0, ...] before), the others are unaffected."""
    with LLM(tiny_ckpt, max_batch=4, max_context=256) as clean:
        healthy = [prompt(6, 40), prompt(9, 41)]
        greedy = SamplingParams(max_tokens=6, ignore_eos=True)
        want = [o.token_ids for o in clean.generate(healthy, greedy)]
    seen = {t for p, w in zip(healthy, want) for t in p + w}
    bad_tok = next(t for t in range(3, 1024) if t not in seen)
    bad = poison_copy(tiny_ckpt, tmp_path / "nan", "language_model.model.embed_tokens.weight", (bad_tok, 7))
    with LLM(bad, max_batch=4, max_context=256) as llm:
        outs = llm.generate([healthy[0], [5, bad_tok, 6], healthy[1]], greedy)
        assert [o.token_ids for o in (outs[0], outs[2])] == want
        assert outs[1].finish_reason == "error" and "not finite" in outs[1].error and outs[1].token_ids == []
        with pytest.raises(RuntimeError, match="not finite"):
            list(llm.stream([bad_tok], greedy))
        assert_empty(llm)


class _Boom(BaseException):
    pass


def test_engine_thread_death_fails_every_request_at_once(tiny_ckpt):
    with LLM(tiny_ckpt, max_batch=2, max_context=256) as llm:
        eng = llm.start()
        assert eng.health() is None
        ev, errs = threading.Event(), []
        real_step = llm.scheduler.step

        def step(*a, **k):
            if llm.scheduler.stats["steps"] >= 2:
                raise _Boom("executor lost its device")
            return real_step(*a, **k)
        llm.scheduler.step = step

        def cb(tok, fin, err):
            if fin:
                errs.append(err)
                if len(errs) == 2:
                    ev.set()
        for i in range(2):
            eng.submit(f"d{i}", prompt(4, i), SamplingParams(max_tokens=200, ignore_eos=True), cb)
        assert ev.wait(WAIT)
        assert all("scheduler thread died" in e and "executor lost its device" in e for e in errs)
        assert "executor lost its device" in eng.health()
        assert llm.cache.slots_in_use == 0 and llm.cache.blocks_in_use == 0


# ---- fields and sizes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,params", [
    ("stop_token_ids", SamplingParams(stop_token_ids=5)),                # was a TypeError
    ("stop_token_ids", SamplingParams(stop_token_ids=[1024])),           # >= vocab: never emitted
    ("stop_token_ids", SamplingParams(stop_token_ids=[-1])),
    ("max_tokens", SamplingParams(max_tokens=10 ** 9)),                  # was cut at the context end silently
    ("max_tokens", SamplingParams(max_tokens=254)),                      # 3 + 254 > max_context 256
    ("temperature", SamplingParams(temperature=float("inf"))),
    ("seed", SamplingParams(seed=2 ** 64)),
    ("ignore_eos", SamplingParams(ignore_eos="yes")),
])
def test_bad_fields_name_the_field(llm, field, params):
    with pytest.raises(ValueError, match=field):
        llm.generate([[1, 2, 3]], params)
    with pytest.raises(ValueError, match=field):
        llm.start().submit("x", [1, 2, 3], params)
    assert_empty(llm)


def test_max_tokens_error_says_how_many_fit(llm):
    with pytest.raises(ValueError, match=r"max_tokens = 1000000000: .* 5 tokens .* max_context = 256 .* at most 251"):
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=10 ** 9))
    out = llm.generate([prompt(250, 7)], SamplingParams(max_tokens=6, ignore_eos=True))[0]    # the bound itself fits
    assert out.error is None and len(out.token_ids) == 6


@pytest.mark.parametrize("kwargs,field", [
    ({"max_batch": 0}, "max_batch"), ({"max_context": -5}, "max_context"), ({"max_num_tokens": 0}, "max_num_tokens"),
    ({"num_blocks": 1}, "num_blocks"), ({"max_batch": 2.5}, "max_batch"), ({"max_batch": True}, "max_batch"),
    ({"memory_budget": 0}, "memory_budget"),
])
def test_bad_sizes_name_the_argument(tiny_ckpt, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} = "):
        LLM(tiny_ckpt, **kwargs)


# ---- chaos -------------------------------------------------------------------------------------------------

def test_chaos_cancels_and_a_poisoned_request(tiny_ckpt):
    """32 requests (greedy, seeded sampling, a vanishing temperature) from 4 client threads at random moments, 8 of
    them cancelled at random points, one poisoned (NaN logits after its 3rd token), on a cache small enough to
    preempt: every healthy request's tokens equal its solo run, cancelled and poisoned ones got a prefix of theirs,
    and every slot and block comes back."""
    with LLM(tiny_ckpt, max_batch=8, max_num_tokens=64, max_context=256, num_blocks=8) as llm:
        _chaos(llm)


def _chaos(llm: LLM) -> None:
    rnd = random.Random(33)
    reqs = []
    for i in range(32):
        kind = i % 4
        sp = (SamplingParams(max_tokens=rnd.randint(2, 6), ignore_eos=True) if kind in (0, 1) else
              SamplingParams(max_tokens=rnd.randint(2, 6), temperature=0.9, top_k=rnd.choice([0, 30]), seed=i,
                             ignore_eos=True) if kind == 2 else
              SamplingParams(max_tokens=rnd.randint(2, 6), temperature=1e-38, seed=i, ignore_eos=True))
        reqs.append((f"c{i}", prompt(rnd.randint(1, 30), 100 + i), sp))
    want = {rid: solo(llm, p, sp) for rid, p, sp in reqs}
    cancel_at = {rid: rnd.randint(0, 4) for rid, _, _ in rnd.sample(reqs[1:], 8)}
    poison_rid = reqs[0][0]
    eng = llm.start()
    got = {rid: [[], None, False] for rid, _, _ in reqs}
    done = threading.Semaphore(0)

    def cb_for(rid):
        def cb(tok, fin, err):
            g = got[rid]
            if tok is not None:
                g[0].append(tok)
                if len(g[0]) == cancel_at.get(rid, -1):
                    g[2] = eng.cancel(rid)                   # from the scheduler thread, mid-step
            if fin:
                g[1] = err
                done.release()
        return cb

    def client(chunk):
        r = random.Random(chunk[0][0])
        for rid, p, sp in chunk:
            time.sleep(r.random() * 0.01)
            eng.submit(rid, p, sp, cb_for(rid))
            if cancel_at.get(rid) == 0:
                got[rid][2] = eng.cancel(rid)                # cancelled while queued or prefilling
    threads = [threading.Thread(target=client, args=(reqs[k::4],)) for k in range(4)]
    with poisoned(llm, poison_rid, after=3) as ex:
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        for _ in reqs:
            assert done.acquire(timeout=WAIT)
    assert ex.hits >= 1 and llm.scheduler.stats["preemptions"] > 0
    toks, err, _ = got.pop(poison_rid)
    assert "not finite" in err and toks == want[poison_rid][:3]
    healthy = 0
    for rid, (toks, err, cancelled) in got.items():
        assert err is None, (rid, err)
        if cancelled:
            assert toks == want[rid][: len(toks)], rid
        else:
            assert toks == want[rid], rid
            healthy += 1
    assert healthy >= 23
    assert_empty(llm)
