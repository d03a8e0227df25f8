"""Overlapped decode steps (runtime/pipeline.py, `Scheduler(..., overlap=True)`) on the CPU: k3-tiny with the fp32
reference ops, where the pipeline runs the same bookkeeping as on a GPU (device-side id gather, the staged metadata,
device argmax and logprobs) synchronously. Every workload is run with overlap on and off: the same tokens, finish
reasons and logprobs, each greedy request's tokens equal to the request run alone, the cache consistent afterwards,
and the overlapped steps counted (the path ran)."""
from __future__ import annotations

import math

import pytest
import torch

from k3deploy.model.reference import SequenceState, forward
from k3deploy.runtime.cache import HybridCache
from k3deploy.runtime.executor import TorchExecutor
from k3deploy.runtime.sampling import SamplingParams
from k3deploy.runtime.scheduler import Scheduler


pytestmark = pytest.mark.usefixtures("one_thread")          # tests/runtime/conftest.py


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_SOLO: dict = {}


def _solo(model, p: list[int], n: int) -> list[int]:
    """Greedy tokens of one request run alone (model.reference.forward), cached."""
    key = (tuple(p), n)
    if key not in _SOLO:
        st = SequenceState(model.cfg, 256)
        with torch.no_grad():
            logits, st = forward(model, p, st)
            out = []
            for i in range(n):
                out.append(int(torch.argmax(logits[-1])))
                if i + 1 < n:
                    logits, st = forward(model, [out[-1]], st)
        _SOLO[key] = out
    return _SOLO[key]


class _Req:
    def __init__(self):
        self.tokens, self.finished, self.events_after_finish = [], False, 0

    def __call__(self, tok, finished, error):
        if self.finished:
            self.events_after_finish += 1
        if tok is not None:
            self.tokens.append(tok)
        self.finished = self.finished or finished


def _sched(model, overlap, max_batch=3, max_num_tokens=16, num_blocks=None, block_size=16, max_context=128, **kw):
    cache = HybridCache(model.cfg, max_batch + 1, num_blocks or 1 + max_batch * math.ceil(max_context / block_size),
                        block_size, max_context=max_context)
    return Scheduler(TorchExecutor(model), cache, max_batch, max_num_tokens, model.cfg.eos_token_id,
                     overlap=overlap, **kw)


def _run(sched, arrivals: dict[int, list]):
    """Step until done; arrivals[k] = [(rid, prompt, params)] added before step k. Returns {rid: (_Req, Request)}."""
    out, k = {}, 0
    while sched.has_work() or any(s >= k for s in arrivals):
        for rid, p, params in arrivals.get(k, []):
            out[rid] = (_Req(), None)
            out[rid] = (out[rid][0], sched.add(rid, p, params, out[rid][0]))
        sched.step()
        k += 1
        assert k < 500
    sched.run_until_done()
    sched.cache.check_consistent()
    assert sched.cache.slots_in_use == 0 and sched.cache.blocks_in_use == 0
    return out


def _same(a: dict, b: dict) -> None:
    for rid in a:
        (ca, ra), (cb, rb) = a[rid], b[rid]
        assert ca.tokens == cb.tokens and ra.finish_reason == rb.finish_reason, (rid, ca.tokens, cb.tokens)
        assert ra.output_ids == ca.tokens and ca.finished and ca.events_after_finish == 0, rid
        if ra.logprobs is not None:
            assert len(ra.logprobs) == len(ca.tokens)
            torch.testing.assert_close(torch.tensor(ra.logprobs), torch.tensor(rb.logprobs), rtol=1e-5, atol=1e-5)
            assert [[i for i, _ in t] for t in ra.top_logprobs] == [[i for i, _ in t] for t in rb.top_logprobs]


def test_overlap_equals_synchronous_steps(tiny_model):
    """Continuous batching over 3 slots with chunked prefill (16-token budget), a request with logprobs, one that
    stops on a stop token and one on a stop sequence (each leaves a dropped row in the step launched meanwhile),
    a seeded sampled request and one with bad words (their steps run synchronously), and requests arriving
    mid-way into freed slots: overlap on and off give the same tokens, finish reasons and logprobs; the greedy
    requests' tokens are their solo tokens (cut at the stop)."""
    m = tiny_model
    pa, pb, pc, pd, pe, pf = (_prompt(n, s) for n, s in ((9, 1), (20, 2), (5, 3), (12, 4), (7, 5), (6, 6)))
    sb, sd = _solo(m, pb, 8), _solo(m, pd, 8)
    arrivals = {
        0: [("a", pa, SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2)),
            ("b", pb, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[sb[3]]))],
        1: [("d", pd, SamplingParams(max_tokens=8, ignore_eos=True, stop_sequences=[sd[2:4]]))],
        5: [("e", pe, SamplingParams(max_tokens=6, ignore_eos=True))],
        9: [("c", pc, SamplingParams(max_tokens=4, temperature=0.8, seed=7, ignore_eos=True)),
            ("f", pf, SamplingParams(max_tokens=5, ignore_eos=True, bad_words=[[_solo(m, pf, 5)[1]]]))],
    }
    on, off = _sched(m, True), _sched(m, False)
    got, want = _run(on, arrivals), _run(off, arrivals)
    _same(got, want)
    assert on.stats["overlapped_steps"] >= 4 and off.stats["overlapped_steps"] == 0, on.stats
    assert got["a"][0].tokens == _solo(m, pa, 9) and got["e"][0].tokens == _solo(m, pe, 6)
    assert got["b"][0].tokens == sb[:sb.index(sb[3]) + 1] and got["b"][1].finish_reason == "stop"
    assert got["d"][0].tokens == sd[:4] and got["d"][1].finish_reason == "stop"
    assert got["f"][0].tokens[1] != _solo(m, pf, 5)[1]


def test_overlap_leaves_out_rows_of_requests_ending_by_length(tiny_model):
    """Two greedy requests ending by length (max_tokens 6 and 9): the overlapped steps compute exactly the decode
    rows the tokens need (none for a request whose in-flight token was its last), and give the solo tokens."""
    m = tiny_model
    sched = _sched(m, True)
    rows = []
    launch = sched.pipeline.launch

    def counting(reqs, *a, **kw):
        rows.append(len(reqs))
        return launch(reqs, *a, **kw)
    sched.pipeline.launch = counting
    pa, pb = _prompt(6, 11), _prompt(10, 12)
    got = _run(sched, {0: [("a", pa, SamplingParams(max_tokens=6, ignore_eos=True)),
                           ("b", pb, SamplingParams(max_tokens=9, ignore_eos=True))]})
    assert got["a"][0].tokens == _solo(m, pa, 6) and got["b"][0].tokens == _solo(m, pb, 9)
    assert sum(rows) == (6 - 1) + (9 - 1), rows       # every token after the prefill's first, no dropped row


def test_overlap_with_preemption_and_padding(tiny_model):
    """A latent pool too small for three growing requests (preemption recomputes the newest, its in-flight token
    kept) and decode batches padded to a multiple of 4 with sentinel rows: solo tokens, overlap on and off alike."""
    m = tiny_model
    ps = [_prompt(n, 20 + n) for n in (14, 11, 9)]
    arrivals = {0: [(f"r{i}", p, SamplingParams(max_tokens=18, ignore_eos=True)) for i, p in enumerate(ps)]}
    kw = dict(num_blocks=1 + 6, block_size=8, max_context=64, decode_pad_multiple=4)
    on, off = _sched(m, True, **kw), _sched(m, False, **kw)
    got, want = _run(on, arrivals), _run(off, arrivals)
    _same(got, want)
    assert on.stats["preemptions"] >= 1 and on.stats["overlapped_steps"] >= 4, on.stats
    for i, p in enumerate(ps):
        assert got[f"r{i}"][0].tokens == _solo(m, p, 18)


def test_cancel_while_a_step_is_in_flight(tiny_model):
    """Cancelling a request whose token is in flight: it finishes "cancelled" at once (slot and blocks free), the
    in-flight token is dropped (no event after the finish), its tokens are a prefix of its solo tokens; a request
    admitted into the freed slot, and the one still running, give their solo tokens."""
    m = tiny_model
    sched = _sched(m, True, max_batch=2)
    pa, pb, pz = _prompt(8, 31), _prompt(10, 32), _prompt(6, 33)
    ca, cb, cz = _Req(), _Req(), _Req()
    sched.add("a", pa, SamplingParams(max_tokens=12, ignore_eos=True), ca)
    sched.add("b", pb, SamplingParams(max_tokens=12, ignore_eos=True), cb)
    while sched.stats["overlapped_steps"] < 3:
        sched.step()
    assert sched._inflight is not None and any(r.request_id == "a" for r in sched._inflight.reqs)
    slot = sched.cache.slot("a")
    assert sched.cancel("a") and ca.finished and "a" not in sched.cache
    sched.add("z", pz, SamplingParams(max_tokens=5, ignore_eos=True), cz)
    sched.run_until_done()
    assert ca.events_after_finish == 0 and ca.tokens == _solo(m, pa, 12)[:len(ca.tokens)] and 0 < len(ca.tokens) < 12
    assert cb.tokens == _solo(m, pb, 12) and cz.tokens == _solo(m, pz, 5)
    assert sched.cache.free_slot_ids() == [1, 2] and slot in (1, 2)
    sched.cache.check_consistent()


def test_a_non_finite_row_fails_only_its_request(tiny_model):
    """An overlapped step whose logits row of one request turns NaN (a bad weight reached that request): that
    request finishes "error" naming the non-finite logits, with no token for the bad row; the other request in the
    same steps gives its solo tokens; slots and blocks are all free afterwards."""
    m = tiny_model
    sched = _sched(m, True, max_batch=2)
    fwd = sched.executor.forward_on_device
    poisoned = {"slot": None}

    def poisoning(ids, batch, pools, rows):
        logits, pools = fwd(ids, batch, pools, rows)
        if poisoned["slot"] is not None:
            bad = (batch.slots[: logits.shape[0]] == poisoned["slot"]).nonzero().flatten()
            logits = logits.clone()
            logits[bad, 7] = float("nan")
        return logits, pools
    sched.executor.forward_on_device = poisoning
    pa, pb = _prompt(8, 41), _prompt(9, 42)
    ca, cb = _Req(), _Req()
    ra = sched.add("a", pa, SamplingParams(max_tokens=10, ignore_eos=True), ca)
    sched.add("b", pb, SamplingParams(max_tokens=10, ignore_eos=True), cb)
    while sched.stats["overlapped_steps"] < 2:
        sched.step()
    poisoned["slot"] = sched.cache.slot("a")
    sched.run_until_done()
    assert ra.finish_reason == "error" and "not finite" in ra.error and ca.finished and ca.events_after_finish == 0
    assert ca.tokens == _solo(m, pa, 10)[:len(ca.tokens)] and len(ca.tokens) < 10
    assert cb.tokens == _solo(m, pb, 10)
    assert sched.cache.slots_in_use == 0 and sched.cache.blocks_in_use == 0
    sched.cache.check_consistent()


def test_overlap_switch_and_defaults(tiny_model):
    """The CPU torch executor does not overlap by default (nothing to gain); overlap=True there runs the pipeline;
    an executor without forward_on_device is refused with a clear error; set_overlap(False) books the step in
    flight and returns to synchronous steps."""
    m = tiny_model
    assert _sched(m, None).pipeline is None
    sched = _sched(m, True)
    c = _Req()
    p = _prompt(7, 41)
    sched.add("a", p, SamplingParams(max_tokens=8, ignore_eos=True), c)
    while sched.stats["overlapped_steps"] < 2:
        sched.step()
    sched.set_overlap(False)
    assert sched.pipeline is None and sched._inflight is None
    sched.run_until_done()
    assert c.tokens == _solo(m, p, 8)

    class NoDevicePath:
        cfg, overlap_decode, forward_on_device = m.cfg, False, None
    with pytest.raises(ValueError, match="forward_on_device"):
        Scheduler(NoDevicePath(), HybridCache(m.cfg, 3, 9, 16), 2, 16, overlap=True)


def test_llm_generate_stream_and_engine_with_overlap(tiny_ckpt, tiny_model):
    """The API on overlapped steps: LLM.generate (synchronous stepping), LLM.stream and the AsyncEngine thread give
    the solo tokens; a stream closed early cancels its request, and the cache ends consistent."""
    from k3deploy.runtime.api import LLM
    m = tiny_model
    ps = [_prompt(n, 50 + n) for n in (5, 9, 13)]
    with LLM(tiny_ckpt, max_batch=3, max_context=128) as llm:
        llm.scheduler.set_overlap(True)
        outs = llm.generate(ps, SamplingParams(max_tokens=6, ignore_eos=True))
        assert [o.token_ids for o in outs] == [_solo(m, p, 6) for p in ps]
        assert [o.finish_reason for o in outs] == ["length"] * 3 and llm.scheduler.stats["overlapped_steps"] >= 3
        it = llm.stream(ps[0], SamplingParams(max_tokens=6, ignore_eos=True))
        assert [next(it) for _ in range(3)] == _solo(m, ps[0], 3)
        it.close()
        eng = llm.start()
        got = llm.generate(ps[1:], SamplingParams(max_tokens=5, ignore_eos=True))
        assert [o.token_ids for o in got] == [_solo(m, p, 5) for p in ps[1:]]
        eng.shutdown()
        llm.scheduler.run_until_done()
        llm.cache.check_consistent()
        assert llm.cache.slots_in_use == 0
