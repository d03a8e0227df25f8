"""runtime/: cache, scheduler, executors, API, tokenizer (CPU, k3-tiny synthetic checkpoint from conftest).

Reference for every token comparison: `model.reference.forward` with a `SequenceState`, one request alone
(prefill of the prompt, then one decode per token), greedy argmax of the fp32 logits.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from k3deploy.model.config import load_config
from k3deploy.model.reference import K3Model, SequenceState, forward
from k3deploy.runtime.api import LLM, SamplingParams
from k3deploy.runtime.cache import AdmissionError, HybridCache, plan_memory
from k3deploy.runtime.executor import TorchExecutor
from k3deploy.runtime.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[2]
WAIT = 300  # seconds an Event wait may take before the test gives up (a hang guard, not a timing assertion)


pytestmark = pytest.mark.usefixtures("one_thread")          # tests/runtime/conftest.py


def solo_greedy(model: K3Model, prompt: list[int], n: int, max_len: int = 512) -> list[int]:
    """Greedy tokens of one request run alone through model.reference.forward."""
    st = SequenceState(model.cfg, max_len)
    logits, st = forward(model, prompt, st)
    out = []
    for i in range(n):
        out.append(int(torch.argmax(logits[-1])))
        if i + 1 < n:
            logits, st = forward(model, [out[-1]], st)
    return out


def make_sched(model, max_batch=4, max_num_tokens=64, max_context=512, block_size=16, num_blocks=None, **kw):
    cfg = model.cfg
    if num_blocks is None:
        num_blocks = 1 + max_batch * math.ceil(max_context / block_size)
    cache = HybridCache(cfg, max_batch + 1, num_blocks, block_size, max_context=max_context)
    return Scheduler(TorchExecutor(model), cache, max_batch, max_num_tokens, cfg.eos_token_id, **kw)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


class Collector:
    """on_token callback that records tokens and the final event."""

    def __init__(self):
        self.tokens, self.finished, self.error, self.done = [], False, None, threading.Event()

    def __call__(self, tok, finished, error):
        if tok is not None:
            self.tokens.append(tok)
        if finished:
            self.finished, self.error = True, error
            self.done.set()


def prompt(n: int, seed: int, vocab: int = 1024) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# ---- memory planner --------------------------------------------------------------------------------------

def test_memory_plan_reproduces_model_md_9():
    cfg = load_config("k3")
    p = plan_memory(cfg, tp=1, ep=1, budget_bytes=None, max_batch=1, max_context=1 << 20, block_size=64,
                    act_dtype=torch.bfloat16)
    assert p.latent_bytes_per_token == 27_648
    assert p.kda_state_bytes == 434_110_464 and f"{p.kda_state_bytes / 2**20:.1f}" == "414.0"
    assert p.kda_conv_bytes == 15_261_696 and f"{p.kda_conv_bytes / 2**20:.1f}" == "14.6"
    assert p.bytes_per_request == 29_440_401_408
    assert p.bytes_per_request - p.kda_bytes_per_request == 28_991_029_248
    p8 = plan_memory(cfg, tp=8, ep=8, budget_bytes=None, max_batch=1, max_context=1 << 20, block_size=64,
                     act_dtype=torch.bfloat16)
    assert p8.kda_bytes_per_request == 69 * 814_080 and f"{p8.kda_bytes_per_request / 2**20:.1f}" == "53.6"
    assert p8.latent_bytes_per_token == 27_648                       # replicated over TP
    table = p.table()
    assert "434,110,464 B" in table and "29,440,401,408 B" in table


def test_memory_plan_budget_and_admission():
    cfg = load_config("k3")
    budget = 80 << 30
    p = plan_memory(cfg, 8, 8, budget, max_batch=64, max_context=131_072, block_size=64, act_dtype=torch.bfloat16)
    assert p.num_slots == 65 and p.total_bytes <= budget
    assert p.total_bytes + p.block_bytes > budget                   # no whole block left over
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_memory(cfg, 1, 1, 1 << 30, max_batch=8, max_context=1 << 20, block_size=64, act_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="tp = 3"):
        plan_memory(cfg, 3, 1, None, 1, 1024, 64, torch.bfloat16)
    tiny = load_config("k3-tiny")
    cache = HybridCache(tiny, 3, 5, 4)                              # 4 usable blocks = 16 tokens
    assert cache.max_context == 16
    with pytest.raises(AdmissionError, match="prompt_ids"):
        cache.check_admissible(17)


def test_cache_bookkeeping(tiny_cfg):
    cache = HybridCache(tiny_cfg, num_slots=3, num_blocks=6, block_size=4)
    l = cache.kda_layers[0]
    cache.pools[l]["state"][1] = float("nan")
    assert cache.allocate("a") == 1 and not cache.pools[l]["state"][1].isnan().any()   # zeroed on allocation
    assert cache.append("a", 5) == 0 and cache.blocks("a") == [1, 2]
    assert cache.append("a", 3) == 5 and cache.blocks("a") == [1, 2]
    assert cache.allocate("b") == 2
    with pytest.raises(Exception, match="slot"):
        cache.allocate("c")
    with pytest.raises(Exception, match="blocks"):
        cache.append("b", 13)                                       # all or nothing
    assert cache.blocks("b") == [] and cache.free_blocks == 3
    cache.free("a")
    cache.check_consistent()
    assert cache.slots_in_use == 1 and cache.blocks_in_use == 0
    cache.free("b")
    assert cache.slots_in_use == 0
    # block tables (kept as int32 rows that grow by doubling) equal the block lists, right-padded with block 0
    big = HybridCache(tiny_cfg, num_slots=3, num_blocks=40, block_size=2)
    big.allocate("a"), big.allocate("b")
    for n in (1, 2, 1, 5, 9, 3, 17):
        for r in ("a", "b"):
            big.append(r, n)
            tabs = big.block_tables(["a", None, "b"])
            for row, rid in ((0, "a"), (2, "b")):
                got = tabs[row].tolist()
                assert got[: len(big.blocks(rid))] == big.blocks(rid) and not any(got[len(big.blocks(rid)):])
            assert tabs[1].eq(0).all() and tabs.dtype == torch.int32
    assert big.block_tables([None]).tolist() == [[0]]


# ---- scheduler correctness -------------------------------------------------------------------------------

def test_batch_invariance_greedy(tiny_model):
    """8 requests of mixed lengths arriving at different steps == each run alone."""
    lengths = [1, 7, 23, 3, 40, 12, 2, 31]
    prompts = [prompt(n, i) for i, n in enumerate(lengths)]
    n_out = [5, 3, 6, 4, 3, 5, 6, 4]
    sched = make_sched(tiny_model, max_batch=4, max_num_tokens=24)
    cols = {}
    arrive = {0: [0, 1], 1: [2], 3: [3, 4], 4: [5], 6: [6, 7]}     # step -> request indices
    step = 0
    while step <= max(arrive) or sched.has_work():
        for i in arrive.get(step, []):
            cols[i] = Collector()
            sched.add(f"r{i}", prompts[i], greedy(n_out[i]), cols[i])
        sched.step()
        step += 1
    assert sched.stats["max_requests_per_step"] >= 3
    for i, p in enumerate(prompts):
        assert cols[i].finished and cols[i].error is None
        assert cols[i].tokens == solo_greedy(tiny_model, p, n_out[i]), f"request {i} (prompt length {len(p)})"
    assert sched.cache.slots_in_use == 0 and sched.cache.blocks_in_use == 0
    sched.cache.check_consistent()


def test_request_token_slice_and_steps_without_all_ids(tiny_model, monkeypatch):
    """Request.token_slice equals all_ids[start:stop] on every range across the prompt / output seam; the scheduler's
    steps never build all_ids (an O(context) list copy per request per step: 1.7 ms of host time per decode step at
    B=16 and 4K-token prompts, bench_decode.py on an H200)."""
    from k3deploy.runtime.scheduler import Request
    r = Request("r", list(range(5)), greedy(3), output_ids=[50, 51, 52])
    assert r.num_tokens == 8
    for a in range(9):
        for b in range(a, 9):
            assert r.token_slice(a, b) == r.all_ids[a:b], (a, b)
    sched = make_sched(tiny_model, max_batch=2, max_num_tokens=8)
    cols = [Collector(), Collector()]
    for i, c in enumerate(cols):
        sched.add(f"r{i}", prompt(11, i), greedy(4), c)
    built = []
    monkeypatch.setattr(Request, "all_ids", property(lambda self: built.append(1) or self.prompt_ids + self.output_ids))
    sched.run_until_done()
    assert not built and all(c.finished and len(c.tokens) == 4 for c in cols)
    assert [c.tokens for c in cols] == [solo_greedy(tiny_model, prompt(11, i), 4) for i in range(2)]


STATE_ATOL, STATE_RTOL = 1e-5, 1e-4   # fp32 KDA state after a split vs unsplit prefill (matmul row blocking)


def _split_run(model, p, first: int | None):
    """Prefill p cut after `first` tokens (None = unsplit), then one decode. Returns (tokens, KDA states, slot)."""
    sched = make_sched(model, max_batch=1, max_num_tokens=4 * len(p))
    col = Collector()
    sched.add("r", p, greedy(2), col)
    if first is not None:
        sched.step(token_budget=first)
        assert sched.requests["r"].num_computed == first
    sched.step()                                       # rest of the prefill + first sampled token
    slot = sched.cache.slot("r")
    states = {l: (sched.cache.pools[l]["state"][slot].clone(), sched.cache.pools[l]["conv"][slot].clone())
              for l in sched.cache.kda_layers}
    sched.run_until_done()
    return col.tokens, states


def _compare_splits(model, p, offsets):
    ref_tokens, ref_states = _split_run(model, p, None)
    assert ref_tokens == solo_greedy(model, p, 2)
    for s in offsets:
        tokens, states = _split_run(model, p, s)
        assert tokens == ref_tokens, f"split at {s}"
        for l, (st, cv) in states.items():
            torch.testing.assert_close(st, ref_states[l][0], atol=STATE_ATOL, rtol=STATE_RTOL, msg=f"split {s} layer {l}")
            torch.testing.assert_close(cv, ref_states[l][1], atol=STATE_ATOL, rtol=STATE_RTOL, msg=f"split {s} layer {l}")


def test_chunk_boundaries_every_offset(micro_model):
    """A 129-token prompt split at every offset in [1, 128] (= 2 x the 64-token KDA chunk)."""
    _compare_splits(micro_model, prompt(129, 7), range(1, 129))


def test_chunk_boundaries_tiny(tiny_model):
    _compare_splits(tiny_model, prompt(129, 8), [1, 63, 64, 65, 128])


def test_slot_reuse_after_nan_poison(tiny_model):
    """A freed slot (and freed blocks) filled with NaN is zeroed before reuse: output finite and identical."""
    pa, pb = prompt(9, 11), prompt(14, 12)
    fresh = make_sched(tiny_model, max_batch=1)
    col_fresh = Collector()
    fresh.add("b", pb, greedy(4), col_fresh)
    fresh.run_until_done()

    sched = make_sched(tiny_model, max_batch=1)
    finite = []
    inner = sched.executor.forward

    def checked(ids, batch, pools, idx):
        logits, pools = inner(ids, batch, pools, idx)
        finite.append(bool(torch.isfinite(logits).all()))
        return logits, pools
    sched.executor.forward = checked
    sched.add("a", pa, greedy(3), Collector())
    sched.run_until_done()
    c = sched.cache
    assert c.free_slot_ids() == [1]
    for l in c.kda_layers:
        c.pools[l]["state"][1] = float("nan")
        c.pools[l]["conv"][1] = float("nan")
    for l in c.mla_layers:
        c.pools[l]["cache"][c.free_block_ids()] = float("nan")
    finite.clear()
    col = Collector()
    sched.add("b", pb, greedy(4), col)
    sched.run_until_done()
    assert finite and all(finite)
    assert col.tokens == col_fresh.tokens == solo_greedy(tiny_model, pb, 4)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_padding_rows_touch_only_sentinels(tiny_model):
    """Decode padded to 4 rows with sentinel rows; 3 running requests but a 2-token budget: every slot and block
    (live or free, sentinel 0 excluded) that the step's requests neither owned before nor own after it hashes
    the same before and after the step."""
    sched = make_sched(tiny_model, max_batch=6, max_num_tokens=2, decode_pad_multiple=4, block_size=4)
    for i in range(3):
        sched.add(f"r{i}", prompt(3, 20 + i), greedy(6), Collector())
    c = sched.cache
    checked, padded = 0, []
    inner = sched.executor.forward

    def spy(ids, batch, pools, idx):
        if batch.decode:
            padded.append(batch.num_seqs - len(idx))         # rows without logits = padding rows
        return inner(ids, batch, pools, idx)
    sched.executor.forward = spy
    while sched.has_work():
        owners0, h0 = _owners(sched), _hashes(c)
        ran = set(sched.step())
        owners1, h1 = _owners(sched), _hashes(c)
        for key in h0:
            if owners0.get(key) in ran or owners1.get(key) in ran:
                continue
            assert h0[key] == h1[key], f"{key} (owner {owners0.get(key)}) changed by a step that did not use it"
            checked += 1
    assert checked > 0 and padded and min(padded) >= 1 and c.slots_in_use == 0   # every decode batch had sentinel rows


def _owners(sched) -> dict:
    c = sched.cache
    out = {}
    for rid in list(sched.requests):
        if rid in c:
            out[("slot", c.slot(rid))] = rid
            out.update({("block", b): rid for b in c.blocks(rid)})
    return out


def _hashes(c: HybridCache) -> dict:
    h = {("slot", s): "".join(_digest(c.pools[l][n][s]) for l in c.kda_layers for n in ("state", "conv"))
         for s in range(1, c.num_slots)}
    h.update({("block", b): "".join(_digest(c.pools[l]["cache"][b]) for l in c.mla_layers)
              for b in range(1, c.num_blocks)})
    return h


def test_cancel_mid_generation_frees_everything(tiny_ckpt):
    # 4000 tokens per request: they are still running when the test cancels them, however slow the machine
    with LLM(tiny_ckpt, max_batch=3, max_num_tokens=32, max_context=4096) as llm:
        eng = llm.start()
        assert llm.start() is eng
        m0 = eng.metrics()
        assert m0["kda_slots_in_use"] == 0 and m0["latent_blocks_in_use"] == 0
        got3 = [threading.Event() for _ in range(3)]
        cols = []
        for i in range(3):
            col = Collector()

            def cb(tok, fin, err, col=col, ev=got3[i]):
                Collector.__call__(col, tok, fin, err)
                if len(col.tokens) >= 3:
                    ev.set()
            cols.append(col)
            eng.submit(f"c{i}", prompt(5 + i, 30 + i), SamplingParams(max_tokens=4000, ignore_eos=True), cb)
        for ev in got3:
            assert ev.wait(WAIT)
        for i in range(3):
            assert eng.cancel(f"c{i}")
            assert cols[i].done.wait(WAIT) and cols[i].error is None
        m = eng.metrics()
        assert m["kda_slots_in_use"] == 0 and m["latent_blocks_in_use"] == 0
        assert not eng.cancel("c0")                                   # already finished
        llm.cache.check_consistent()


def test_engine_steps_aside_for_a_waiting_caller(tiny_ckpt):
    """Python's locks are not fair: the scheduler thread re-takes its lock between steps ahead of a waiting
    cancel/submit/metrics (61 steps seen on an idle machine; under CI load a request reached its 4000 tokens before
    its cancel got in). A caller waiting for the engine lock registers (AsyncEngine._turn), and while one is
    registered the loop starts no new step."""
    with LLM(tiny_ckpt, max_batch=1, max_num_tokens=32, max_context=4096) as llm:
        eng = llm.start()
        col = Collector()
        eng.submit("r", prompt(5, 1), SamplingParams(max_tokens=4000, ignore_eos=True), col)
        while eng.metrics()["steps"] < 3 and not col.done.is_set():
            time.sleep(0.01)
        got = []
        with eng._turn():                        # hold the engine lock: a metrics() call must register and wait
            th = threading.Thread(target=lambda: got.append(eng.metrics()))
            th.start()
            while eng._callers == 0 and th.is_alive():
                time.sleep(0.001)
            assert eng._callers == 1 and not got
        th.join(WAIT)
        assert got and eng._callers == 0
        with eng._callers_lock:                  # what _turn does before it blocks on the engine lock
            eng._callers += 1
        try:
            time.sleep(0.05)
            s0 = eng._sched.stats["steps"]
            time.sleep(0.3)                      # ~1 ms per step here: hundreds of steps if the loop did not wait
            assert eng._sched.stats["steps"] <= s0 + 1     # at most the step that was in progress at s0
        finally:
            with eng._callers_lock:
                eng._callers -= 1
        assert eng.cancel("r") and col.done.wait(WAIT) and col.error is None
        assert len(col.tokens) < 4000


@pytest.mark.parametrize("who", ["later", "earlier", "self", "prefilling"])
def test_callback_cancelling_a_request_of_the_same_step(tiny_model, who):
    """A token callback may cancel any request (AsyncEngine allows it), including one whose row comes later in the
    step being delivered or one still prefilling in the same step: that request gets exactly one final event and
    nothing after it, the others finish normally, and every slot and block comes back."""
    s = make_sched(tiny_model, max_batch=4, max_num_tokens=16)
    rids = ("a", "b", "c", "p") if who == "prefilling" else ("a", "b", "c")
    events = {r: [] for r in rids}
    target = {"later": "c", "earlier": "a", "self": "b", "prefilling": "p"}[who]

    def cb(rid):
        def f(tok, fin, err):   # (the scheduler logs and swallows a callback's exceptions: record, check later)
            events[rid].append((tok, fin))
            if rid == "b" and tok is not None and len(events["b"]) == 2:   # b's second token: cancel the target
                t = s.requests[target]
                events["target_prefilling"] = not t.is_decode
                events["cancelled"] = s.cancel(target)
        return f
    for i, rid in enumerate(rids):
        s.add(rid, prompt(60 if rid == "p" else 3, 50 + i), greedy(6), cb(rid))
    s.run_until_done()
    assert events.pop("cancelled") is True
    assert events.pop("target_prefilling") is (who == "prefilling")
    for r, ev in events.items():
        assert [fin for _, fin in ev].index(True) == len(ev) - 1, f"{r}: events after its final one: {ev}"
    assert events[target][-1][0] is None
    assert len([t for t, _ in events[target] if t is not None]) < 6
    assert all(len(ev) == 6 for r, ev in events.items() if r != target)     # 6 tokens, the last one final
    assert s.cache.slots_in_use == 0 and s.cache.blocks_in_use == 0
    s.cache.check_consistent()


def test_preemption_matches_unconstrained(tiny_model):
    prompts = [prompt(10, 40 + i) for i in range(3)]
    n = 12
    # 3 requests x up to 21 cached tokens = 6 blocks of 4 each; only 12 usable blocks -> preemptions
    tight = make_sched(tiny_model, max_batch=3, max_num_tokens=64, block_size=4, num_blocks=13, max_context=48)
    cols = [Collector() for _ in prompts]
    for i, p in enumerate(prompts):
        tight.add(f"p{i}", p, greedy(n), cols[i])
    tight.run_until_done()
    assert tight.stats["preemptions"] > 0
    for p, col in zip(prompts, cols):
        assert col.finished and col.tokens == solo_greedy(tiny_model, p, n)
    assert tight.cache.slots_in_use == 0 and tight.cache.blocks_in_use == 0
    tight.cache.check_consistent()


@pytest.mark.parametrize("field,kwargs", [
    ("prompt_ids", {"prompt": []}),
    ("prompt_ids", {"prompt": [1, 1024]}),
    ("prompt_ids", {"prompt": [-1, 2]}),
    ("prompt_ids", {"prompt": list(range(3, 3 + 257))}),               # longer than max_context 256
    ("max_tokens", {"params": SamplingParams(max_tokens=0)}),
    ("top_p", {"params": SamplingParams(top_p=0.0)}),
    ("top_p", {"params": SamplingParams(top_p=1.5)}),
    ("temperature", {"params": SamplingParams(temperature=-0.1)}),
])
def test_bad_requests_raise_and_others_unaffected(tiny_ckpt, tiny_model, field, kwargs, _shared_llm):
    llm = _shared_llm
    eng = llm.start()
    good = Collector()
    p = prompt(6, 50)
    eng.submit(f"good-{field}-{len(str(kwargs))}", p, greedy(4), good)
    bad_prompt = kwargs.get("prompt", [1, 2, 3])
    bad_params = kwargs.get("params", SamplingParams())
    with pytest.raises(ValueError, match=field):
        eng.submit("bad", bad_prompt, bad_params, Collector())
    with pytest.raises(ValueError, match=field):
        llm.generate([bad_prompt], bad_params)
    assert good.done.wait(WAIT) and good.error is None
    assert good.tokens == solo_greedy(tiny_model, p, 4)


@pytest.fixture(scope="module")
def _shared_llm(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_batch=4, max_num_tokens=32, max_context=256)
    yield llm
    llm.shutdown()


def test_generate_stream_and_seeded_sampling(tiny_ckpt, tiny_model):
    llm = LLM(tiny_ckpt, max_batch=4, max_num_tokens=16, max_context=256)
    p = prompt(8, 60)
    outs = llm.generate([p, prompt(3, 61)], SamplingParams(max_tokens=4, ignore_eos=True))
    assert outs[0].token_ids == solo_greedy(tiny_model, p, 4) and outs[0].finish_reason == "length"
    assert list(llm.stream(p, SamplingParams(max_tokens=4, ignore_eos=True))) == outs[0].token_ids
    sp = SamplingParams(max_tokens=6, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([p], sp)[0].token_ids
    mixed = llm.generate([prompt(20, 62), p, prompt(5, 63)],
                         [SamplingParams(max_tokens=3, temperature=1.0, seed=9), sp, greedy(7)])[1].token_ids
    assert alone == mixed
    stop = outs[0].token_ids[1]
    o = llm.generate([p], SamplingParams(max_tokens=10, stop_token_ids=[stop], ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.token_ids == outs[0].token_ids[:2]
    # closing a stream early cancels it and frees its slot
    it = llm.stream(p, SamplingParams(max_tokens=50, ignore_eos=True))
    next(it)
    it.close()
    assert llm.metrics()["kda_slots_in_use"] == 0 and llm.metrics()["latent_blocks_in_use"] == 0


def test_sample_batch_equals_row_by_row():
    from k3deploy.runtime.sampling import SamplingParams, make_generator, sample, sample_batch
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    logits[2, 7] = logits[2, 9] = 99.0                                   # a tie: the lowest id wins
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=1), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2), SamplingParams()]
    rowwise = [sample(logits[i], p, make_generator(p)) for i, p in enumerate(params)]
    assert sample_batch(logits, params, [make_generator(p) for p in params]) == rowwise
    assert rowwise[2] == 7


def test_cli_prints_generated_ids(tiny_ckpt, tiny_model):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "k3deploy.runtime.generate", "--model", str(tiny_ckpt), "--backend", "torch",
                        "--prompt-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=WAIT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(t) for t in solo_greedy(tiny_model, [1, 2, 3], 3)]
    h = subprocess.run([sys.executable, "-m", "k3deploy.runtime.generate", "--help"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=WAIT)
    assert h.returncode == 0 and "--prompt-ids" in h.stdout
    e = subprocess.run([sys.executable, "-m", "k3deploy.runtime.generate", "--model", str(tiny_ckpt), "--backend", "torch",
                        "--ep", "2", "--prompt-ids", "1"], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=WAIT)
    assert e.returncode == 2 and "torchrun --standalone --nproc-per-node 2" in e.stderr, e.stderr


# ---- onnxruntime backend ---------------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("k3deploy.export.onnx_export") is None,
                    reason="export/onnx_export.py (python -m k3deploy.export.onnx_export) is not written yet")
def test_onnxruntime_matches_torch(micro_model, micro_ckpt, tmp_path_factory):
    """Greedy tokens of the onnxruntime backend == torch backend == solo reference. Uses the 2-layer micro model
    (KDA + dense MLP, MLA + MXFP4 MoE, AttnRes commits): exporting k3-tiny takes ~100 s on this CPU."""
    pytest.importorskip("onnxruntime")
    ckpt = micro_ckpt
    out = tmp_path_factory.mktemp("ort") / "onnx"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "k3deploy.export.onnx_export", "--checkpoint", str(ckpt), "--out", str(out),
                        "--no-progress", "--log-level", "WARNING"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    prompts = [prompt(n, 70 + n) for n in (1, 9, 20)]
    sp = greedy(4)
    kw = dict(max_batch=4, max_num_tokens=16, max_context=128, decode_pad_multiple=4)
    a = [o.token_ids for o in LLM(out, backend="onnxruntime", **kw).generate(prompts, sp)]
    b = [o.token_ids for o in LLM(ckpt, backend="torch", **kw).generate(prompts, sp)]
    assert a == b
    assert a == [solo_greedy(micro_model, p, 4) for p in prompts]


def test_tensorrt_backend_says_why_it_cannot_run(tmp_path):
    if importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available():
        pytest.skip("full TensorRT and a GPU are present: the error path is not reachable")
    from k3deploy.runtime.executor import TensorRTExecutor
    with pytest.raises((ImportError, RuntimeError), match="tensorrt|CUDA"):
        TensorRTExecutor(tmp_path)


def test_tensorrt_decode_graphs_run_with_the_decode_profile():
    """engines/build.py builds [prefill, decode] profiles; a layer's decode graph selects profile 1 (its own T = B
    range), everything else profile 0, and a single-profile engine always 0. (Engine execution itself cannot run
    here: no full TensorRT.)"""
    from k3deploy.engines.build import default_profile_dims
    from k3deploy.runtime.executor import TensorRTExecutor
    prefill, decode = default_profile_dims(max_batch=8, max_num_tokens=256)
    assert decode["T"] == (1, 8, 8) and prefill["T"] == (1, 256, 256)     # index 1 = the decode range
    pick = TensorRTExecutor.profile_for
    assert pick({"kind": "layer", "graph": "decode"}, 2) == 1
    assert pick({"kind": "layer", "graph": "prefill"}, 2) == 0
    assert pick({"kind": "embed"}, 2) == 0 and pick({"kind": "head"}, 2) == 0
    assert pick({"kind": "layer", "graph": "decode"}, 1) == 0
    # an input shape outside the profile (set_input_shape -> False) is one ValueError naming the input and profile
    ex = TensorRTExecutor.__new__(TensorRTExecutor)
    ex.dir, ex.device = "engines", torch.device("cpu")
    ctx = types.SimpleNamespace(set_input_shape=lambda name, shape: False)
    ex.engines = {"g": (types.SimpleNamespace(num_optimization_profiles=2), ctx)}
    g = {"id": "g", "path": "rank0/layer0.decode.onnx", "kind": "layer", "graph": "decode",
         "inputs": [{"name": "cache", "dtype": "float32"}], "outputs": []}
    with pytest.raises(ValueError, match=r"rank0/layer0.decode.onnx: input cache of shape \(3, 4\) lies outside the "
                                         r"engine's optimization profile 1 \(manifest.json in engines"):
        ex._run(g, {"cache": torch.zeros(3, 4)})


def test_engines_of_other_workspace_rules_are_refused():
    """TensorRTExecutor's first check: a manifest whose plugin workspaces were sized by other rules (or that predates
    the field) is one ValueError naming the manifest, both rule versions and the rebuild command."""
    from k3deploy.plugins.workspace import WORKSPACE_RULES
    from k3deploy.runtime.executor import check_workspace_rules
    check_workspace_rules({"workspace_rules": WORKSPACE_RULES})
    for manifest, got in (({}, 1), ({"workspace_rules": WORKSPACE_RULES + 1}, WORKSPACE_RULES + 1)):
        with pytest.raises(ValueError) as e:
            check_workspace_rules(manifest, "ENG/manifest.json")
        msg = str(e.value)
        assert msg.startswith(f"ENG/manifest.json: engines built with plugin workspace rules {got}, this k3deploy "
                              f"uses {WORKSPACE_RULES}") and "python export/build_engines.py" in msg, msg


def test_llm_sizes_its_cache_from_engine_profiles(tiny_ckpt, tiny_model, monkeypatch):
    """The tensorrt backend's size rules, run through LLM with a torch executor that carries an engine manifest's
    pool dims (no TensorRT here): the pools get the engines' slots, blocks and block size whatever this LLM's smaller
    max_batch / max_context; defaults come from the engines; larger or other sizes are one ValueError naming the
    argument; and the runtime still generates what the model generates alone."""
    from k3deploy.export.build_engines import engine_dims
    from k3deploy.runtime.api import LLM
    from k3deploy.runtime.executor import TensorRTExecutor, TorchExecutor, engine_pool_dims

    class Sized(TorchExecutor):
        pass
    for name in ("preferred_block_size", "default_max_context", "default_max_batch", "default_num_blocks",
                 "default_max_num_tokens", "_check", "check_block_size", "check_cache"):
        setattr(Sized, name, getattr(TensorRTExecutor, name))
    ex = Sized(tiny_model)
    prof = engine_dims(None, 4, 64, 256, 64)                     # --max-batch 4 --max-num-tokens 64 --max-context 256
    ex.dir, ex.pool_dims = "ENG", engine_pool_dims({"profile_dims": [prof, prof]})
    monkeypatch.setattr(LLM, "_make_executor", lambda self, *a, **k: ex)
    llm = LLM(tiny_ckpt)
    c = llm.cache
    assert (c.num_slots, c.num_blocks, c.block_size, c.max_context) == (5, 17, 64, 256)
    assert (llm.scheduler.max_batch, llm.scheduler.max_num_tokens) == (4, 64)
    small = LLM(tiny_ckpt, max_batch=2, max_context=100)        # smaller limits: the engines' pools all the same
    assert (small.cache.num_slots, small.cache.num_blocks, small.scheduler.max_batch) == (5, 17, 2)
    p = prompt(9, 3)
    assert small.generate([p], greedy(4))[0].token_ids == solo_greedy(tiny_model, p, 4)
    for kw, msg in (({"max_batch": 5}, "max_batch = 5: the engines in ENG take at most 4; pass max_batch <= 4"),
                    ({"max_num_tokens": 128}, "max_num_tokens = 128: .* at most 64; .* --max-num-tokens 128"),
                    ({"max_context": 512}, "max_context: 8 blocks per request exceed the engines' block tables in "
                                           "ENG; pass max_context <= 256"),
                    ({"block_size": 16}, "block_size = 16: the engines in ENG were built for 64"),
                    ({"num_blocks": 9}, "num_blocks = 9: the engines in ENG were built for 17")):
        with pytest.raises(ValueError, match=msg):
            LLM(tiny_ckpt, **kw)


def test_graph_executor_rejects_a_zero_length_sequence():
    """The ONNX function bodies cannot raise, so the executor validates packed offsets before running graphs."""
    from k3deploy.model.reference import Batch
    from k3deploy.runtime.executor import OnnxRuntimeExecutor
    ex = OnnxRuntimeExecutor.__new__(OnnxRuntimeExecutor)       # forward's validation runs before any graph
    batch = Batch(torch.tensor([0, 3, 3], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
                  torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="zero-length"):
        ex.forward(torch.arange(3), batch, {}, torch.tensor([2]))
