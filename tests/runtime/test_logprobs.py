"""Logprobs, stop sequences and bad words through the scheduler (runtime/sampling.py, runtime/scheduler.py), checked
against the fp32 reference run alone (2-layer micro model from conftest)."""
from __future__ import annotations

import math

import pytest
import torch

from k3deploy.model.reference import SequenceState, forward
from k3deploy.runtime.cache import HybridCache
from k3deploy.runtime.executor import TorchExecutor
from k3deploy.runtime.sampling import SamplingParams
from k3deploy.runtime.scheduler import Scheduler

PROMPT = [5, 77, 300, 12, 999, 41, 8, 650, 23, 101]


pytestmark = pytest.mark.usefixtures("one_thread")          # tests/runtime/conftest.py


def reference(model, ids, n):
    """(log-softmax rows of the prompt positions, greedy tokens, log-softmax rows of the generated positions)."""
    st = SequenceState(model.cfg, 256)
    logits, st = forward(model, ids, st)
    prompt_rows = torch.log_softmax(logits.float(), -1)
    toks, rows = [], []
    last = logits[-1]
    for _ in range(n):
        row = torch.log_softmax(last.float(), -1)
        toks.append(int(torch.argmax(row)))
        rows.append(row)
        last, st = forward(model, [toks[-1]], st)
        last = last[-1]
    return prompt_rows, toks, rows


def run(model, params, max_num_tokens=64, prompt=PROMPT):
    cache = HybridCache(model.cfg, 3, 1 + 2 * math.ceil(128 / 16), 16, max_context=128)
    sched = Scheduler(TorchExecutor(model), cache, 2, max_num_tokens, model.cfg.eos_token_id)
    seen = []
    req = sched.add("r", prompt, params, lambda tok, fin, err: seen.append(
        (tok, None if req.logprobs is None or tok is None else len(req.logprobs))))
    sched.run_until_done()
    return req, seen


def test_logprobs_match_the_reference(micro_model):
    prompt_rows, toks, rows = reference(micro_model, PROMPT, 4)
    req, seen = run(micro_model, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2),
                    max_num_tokens=4)                                  # the prompt in 3 chunks
    assert req.output_ids == toks
    assert [n for _, n in seen] == [1, 2, 3, 4]                        # set before each token's callback
    for i, t in enumerate(toks):
        assert req.logprobs[i] == pytest.approx(float(rows[i][t]), abs=1e-4)
        top = torch.topk(rows[i], 3)
        assert [t for t, _ in req.top_logprobs[i]] == top.indices.tolist()
        assert [v for _, v in req.top_logprobs[i]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert req.top_logprobs[i][0][0] == t                          # greedy: the chosen one is the most likely
    assert req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == len(PROMPT)
    want = [float(prompt_rows[p][PROMPT[p + 1]]) for p in range(len(PROMPT) - 1)]
    assert req.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert [t for t, _ in req.prompt_top_logprobs[3]] == torch.topk(prompt_rows[2], 2).indices.tolist()
    whole, _ = run(micro_model, SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0))
    assert whole.prompt_logprobs[1:] == pytest.approx(req.prompt_logprobs[1:], abs=1e-5)   # any chunking
    assert whole.logprobs is None and whole.prompt_top_logprobs[1] == []


def test_stop_sequences_and_bad_words(micro_model):
    _, toks, rows = reference(micro_model, PROMPT, 6)
    req, _ = run(micro_model, SamplingParams(max_tokens=6, ignore_eos=True, stop_sequences=[toks[2:4]]))
    end = next(i for i in range(2, 7) if toks[i - 2:i] == toks[2:4])
    assert req.output_ids == toks[:end] and req.finish_reason == "stop"
    req, _ = run(micro_model, SamplingParams(max_tokens=1, ignore_eos=True, bad_words=[[toks[0]]]))
    masked = rows[0].clone()
    masked[toks[0]] = -math.inf
    assert req.output_ids == [int(torch.argmax(masked))]               # the next best token
    req, _ = run(micro_model, SamplingParams(max_tokens=2, ignore_eos=True, bad_words=[toks[:2]]))
    assert req.output_ids[0] == toks[0] and req.output_ids[1] != toks[1]   # only the word's completion is banned


def test_bad_params_name_the_field():
    for kw, field in ((dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
                      (dict(stop_sequences=[[]]), "stop_sequences"), (dict(bad_words=[["a"]]), "bad_words")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw).validate()
