"""The runtime's torch backend on a CUDA device (`LLM(..., device="cuda")`: the kernels, CUDA graphs, TP over NCCL
or gloo on GPUs), and on the CPU the device plumbing (device strings, ops and backend checks, block-size rules, bf16
dense weights) and the kernel paths under the Triton interpreter.

GPU tests carry the `gpu` marker (skipped without CUDA; torch 2.11+cu130, triton 3.6, fla-core on the H200 image);
K3_TEST_DEVICE=cpu runs their logic on the CPU instead. Reference: the CPU fp32 model (`model.reference`,
ReferenceOps), one request alone, greedy argmax.

Tolerances. The GPU kernels round to bf16 where their own tests say so (tests/plugins/test_kernels.py: KDA prefill runs
fla's chunk_kda on bf16 q/k/v/gate inputs, rel. err. < 3e-2; MLA prefill bf16 SDPA < 2e-2; MoE bf16 activations
< 1e-2; MLA decode TF32 < 2e-3). The synthetic models amplify such perturbations: on k3-tiny (9 layers) a 1e-3
relative perturbation of the embeddings moves the logits by 0.4-6 %, and rounding the ops' inputs to bf16 on the
CPU (the `Emulated` ops below) already changes the greedy path within 6 tokens for ~40 % of random prompts, mostly
through MoE routing flips (top-k gaps down to 1e-5). So:
* device plumbing (weights, pools, batches, sampling on the GPU) is checked exactly on k3-tiny with the fp32
  reference ops on the GPU (`ops="reference"`): tokens equal, logits within 1e-3 (fp32 on both sides, only the
  summation order differs: ~1e-6 per GEMM, amplified ~10-60x);
* the kernels are checked token for token on a 2-layer model cut from k3-tiny (`micro`: one KDA dense layer + one
  MLA MoE layer, so all five ops) on prompts whose CPU greedy path survives bf16 rounding plus 1e-2 relative
  noise on every op output (chosen at test time on the CPU); logits within 5e-2 per position;
* on the full k3-tiny the kernels are checked statistically: median per-position logits rel. err. <= 0.15 and
  argmax agreement >= 50 % (bf16 emulation gives ~2-3e-2 and ~85 %; a broken path gives ~1.4 and ~0 %).
"""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3deploy.model.reference import K3Model, ReferenceOps, SequenceState, forward

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
# K3_TEST_DEVICE=cpu runs the GPU tests' logic on the CPU (developing them; ops "kernels" then needs
# TRITON_INTERPRET=1); "cuda" (the default) makes them GPU tests
DEV = os.environ.get("K3_TEST_DEVICE", "cuda")
DEV_TYPE = torch.device(DEV).type


def on_device(test):
    """A test of the runtime on DEV: marked `gpu` (skipped without CUDA) unless K3_TEST_DEVICE=cpu runs it here."""
    return pytest.mark.gpu(test) if DEV_TYPE == "cuda" else test


cuda_only = pytest.mark.skipif(DEV_TYPE != "cuda", reason="CUDA graphs need a CUDA GPU (K3_TEST_DEVICE is cpu)")


def gpus(n: int):
    """Skip unless this machine has n CUDA GPUs (NCCL puts one rank per GPU)."""
    have = torch.cuda.device_count() if DEV_TYPE == "cuda" else 0
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs (NCCL puts one rank per GPU); "
                                               f"this machine has {have}")


KERNEL_OPS = ["torch", "kernels"]


pytestmark = pytest.mark.usefixtures("one_thread")          # tests/runtime/conftest.py


# ---- helpers ------------------------------------------------------------------------------------------------

def _bf(t):
    return t.to(torch.bfloat16).to(t.dtype)


def _tf32(t):
    i = t.float().contiguous().view(torch.int32)
    return ((i + (1 << 12)) & ~((1 << 13) - 1)).view(torch.float32)


class Emulated:
    """CPU stand-in for the GPU kernels' precision: bf16 (or TF32 for MLA decode) where the kernels round,
    plus relative Gaussian noise `rel` on every op output (their internal roundings). Pools stay exact."""

    def __init__(self, rel: float, seed: int, bf16: bool = True):
        self.g, self.rel, self.r = torch.Generator().manual_seed(seed), rel, _bf if bf16 else (lambda t: t)
        self.t = _tf32 if bf16 else (lambda t: t)

    def n(self, t):
        return t * (1 + self.rel * torch.randn(t.shape, generator=self.g)) if self.rel else t

    def kda_prefill(self, qkv, f, b, *a, **k):
        o, s, c = ReferenceOps.kda_prefill(self.r(qkv), self.r(f), self.r(b), *a, **k)
        return self.n(self.r(o)), s, c

    def kda_decode(self, *a, **k):
        o, s, c = ReferenceOps.kda_decode(*a, **k)
        return self.n(o), s, c

    def mla_prefill(self, q, latent, kv_b, *a, **k):
        o, c = ReferenceOps.mla_prefill(self.r(q), self.r(latent), self.r(kv_b), *a, **k)
        return self.n(self.r(o)), c

    def mla_decode(self, q, latent, cache, *a, **k):
        o, c = ReferenceOps.mla_decode(self.t(q), self.t(latent), self.t(cache), *a, **k)
        return self.n(o), c

    def mxfp4_moe(self, x, *a, **k):
        return self.n(ReferenceOps.mxfp4_moe(self.r(x), *a, **k))

    route = staticmethod(ReferenceOps.route)     # fp32 on the GPU too


def _with_ops(model: K3Model, ops) -> K3Model:
    m = K3Model.__new__(K3Model)
    m.__dict__.update(model.__dict__)
    m.ops = ops
    return m


def greedy_path(model: K3Model, prompt: list[int], n: int, max_len: int = 256) -> list[int]:
    """Greedy tokens of one request run alone (prefill, then one decode per token)."""
    st = SequenceState(model.cfg, max_len, device=model.device, act_dtype=model.dense_dtype)
    with torch.no_grad():
        logits, st = forward(model, prompt, st)
        out = []
        for i in range(n):
            out.append(int(torch.argmax(logits[-1])))
            if i + 1 < n:
                logits, st = forward(model, [out[-1]], st)
    return out


def teacher_forced(model: K3Model, prompt: list[int], tokens: list[int], all_prompt_rows: bool = False,
                   max_len: int = 256) -> torch.Tensor:
    """fp32 CPU logits predicting tokens[0..] (prefill of the prompt, then decodes of tokens[:-1]); with
    all_prompt_rows the prefill rows of every prompt position come first."""
    st = SequenceState(model.cfg, max_len, device=model.device)
    with torch.no_grad():
        logits, st = forward(model, prompt, st)
        rows = [logits] if all_prompt_rows else [logits[-1:]]
        for t in tokens[:-1]:
            logits, st = forward(model, [t], st)
            rows.append(logits)
    return torch.cat(rows).float().cpu()


def relerr_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double().cpu(), b.double().cpu()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


_STABLE: dict = {}


def stable_prompts(model: K3Model, count: int, lengths, n_tokens: int, trials, thr: float, seed: int = 7,
                   candidates: int = 12, prefix: tuple = ()) -> list[list[int]]:
    """The `count` most stable of `candidates` random prompts (lengths cycled, after `prefix`): stability = the worst
    rel. error of the teacher-forced logits of the CPU greedy path (n_tokens) under every Emulated(rel, seed, bf16)
    of `trials` (infinite when an argmax changes); each chosen one must stay below `thr`. Cached per arguments."""
    key = (id(model), count, tuple(lengths), n_tokens, tuple(trials), thr, seed, candidates, tuple(prefix))
    if key in _STABLE:
        return _STABLE[key]
    g = torch.Generator().manual_seed(seed)
    scored = []
    for i in range(candidates):
        p = list(prefix) + torch.randint(3, model.cfg.vocab_size, (lengths[i % len(lengths)],), generator=g).tolist()
        toks = greedy_path(model, p, n_tokens)
        ref = teacher_forced(model, p, toks)
        worst = 0.0
        for rel, s, bf16 in trials:
            emu = teacher_forced(_with_ops(model, Emulated(rel, s, bf16)), p, toks)
            worst = max(worst, float(relerr_rows(emu, ref).max()) if emu.argmax(-1).tolist() == toks else math.inf)
            if worst > thr:
                break
        scored.append((worst, i, p))
    best = sorted(scored)[:count]
    assert all(w <= thr for w, _, _ in best), \
        f"only {sum(w <= thr for w, _, _ in scored)} of {candidates} candidate prompts are stable under {trials}"
    _STABLE[key] = [p for _, _, p in sorted(best, key=lambda x: x[1])]
    return _STABLE[key]


# bf16 rounding alone (the kernels' own rounding: ~4e-3 on micro), then + relative noise on every op output at
# 5e-3 (2 seeds) and 1e-2 (3 seeds): the most stable prompts of 12 stay within ~2e-2 under all of these
KERNEL_TRIALS = ((0.0, 0, True), (5e-3, 1, True), (5e-3, 2, True), (1e-2, 3, True), (1e-2, 4, True),
                 (1e-2, 5, True))
FP32_TRIALS = ((1e-5, 0, False),)                                         # fp32 summation-order noise


def gpu_model(ckpt, ops: str, device: str = DEV) -> K3Model:
    from k3deploy.runtime.executor import resolve_ops
    from k3deploy.runtime.distributed import resolve_device
    dev = resolve_device(device)
    return K3Model.from_checkpoint(ckpt, ops=resolve_ops(ops, dev)[1], device=dev)


def gpu_runner(ckpt, ops: str, device: str = DEV):
    """What the runtime's executor runs for `ops`: the fused-glue form (runtime.fused.FusedModel) for "kernels", else
    the K3Model of `gpu_model` (same forward contract, so `teacher_forced` / `forward` take either)."""
    m = gpu_model(ckpt, ops, device)
    if ops == "kernels":
        from k3deploy.runtime.fused import FusedModel
        return FusedModel.of(m)
    return m


# ---- GPU: device plumbing with the fp32 reference ops -------------------------------------------------------

@on_device
def test_reference_ops_on_gpu_equal_cpu(tiny_ckpt, tiny_model):
    """k3-tiny, fp32 reference ops on the GPU: weights, pools, batch metadata and sampling on the device give the
    CPU's greedy tokens (3 requests batched, continuous batching) and logits within 1e-3."""
    from k3deploy.runtime.api import LLM, SamplingParams
    prompts = stable_prompts(tiny_model, 3, [3, 9, 17], 6, FP32_TRIALS, 1e-4)
    want = [greedy_path(tiny_model, p, 6) for p in prompts]
    with LLM(tiny_ckpt, device=DEV, ops="reference", max_batch=4, max_num_tokens=16, max_context=64) as llm:
        assert llm.cache.pools[0]["state"].device.type == DEV_TYPE and llm.executor.device.type == DEV_TYPE
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        assert [o.token_ids for o in outs] == want
        m = llm.executor.model
        for p, toks in zip(prompts, want):
            rel = relerr_rows(teacher_forced(m, p, toks), teacher_forced(tiny_model, p, toks))
            assert float(rel.max()) < 1e-3, rel


# ---- GPU: the kernels ---------------------------------------------------------------------------------------

@on_device
@pytest.mark.parametrize("ops", KERNEL_OPS)
def test_kernels_on_gpu_match_cpu_reference(micro_ckpt, micro_model, ops):
    """micro (KDA + MLA + MoE), Triton kernels: greedy tokens of 3 batched requests equal the CPU reference's,
    and the teacher-forced logits of the generated positions (prefill's last row + decode rows) are within 5e-2."""
    from k3deploy.runtime.api import LLM, SamplingParams
    prompts = stable_prompts(micro_model, 3, [4, 7, 12], 6, KERNEL_TRIALS, 5e-2)
    want = [greedy_path(micro_model, p, 6) for p in prompts]
    # 16-token blocks: the 12-token prompt's tokens cross a block boundary (the CUDA default, 64, would not)
    with LLM(micro_ckpt, device=DEV, ops=ops, max_batch=3, max_num_tokens=16, max_context=64, block_size=16) as llm:
        assert llm.executor.ops_name == ops
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
        m = llm.executor.runner                   # the fused glue for ops "kernels"
        rels = [relerr_rows(teacher_forced(m, p, t), teacher_forced(micro_model, p, t)) for p, t in zip(prompts, want)]
    assert got == want, f"relerr per position: {[r.tolist() for r in rels]}"
    for r in rels:
        assert float(r.max()) < 5e-2, r


@on_device
@pytest.mark.parametrize("ops", KERNEL_OPS)
def test_kernels_on_gpu_logits_close_on_k3_tiny(tiny_ckpt, tiny_model, ops):
    """k3-tiny, Triton kernels: statistics of the logits over 4 prompts x (all prompt positions + 4 decode steps)
    against the CPU fp32 reference (see the module docstring for the thresholds); ops "kernels" with the fused glue."""
    m = gpu_runner(tiny_ckpt, ops)
    g = torch.Generator().manual_seed(3)
    rels, agree = [], []
    for n in (5, 11, 19, 30):
        p = torch.randint(3, 1024, (n,), generator=g).tolist()
        toks = greedy_path(tiny_model, p, 4)
        ref = teacher_forced(tiny_model, p, toks, True)
        got = teacher_forced(m, p, toks, True)
        assert torch.isfinite(got).all()
        rels.append(relerr_rows(got, ref))
        agree.append(got.argmax(-1) == ref.argmax(-1))
    rel, agree = torch.cat(rels), torch.cat(agree).float()
    msg = f"median {float(rel.median()):.3g} p90 {float(rel.quantile(0.9)):.3g} max {float(rel.max()):.3g} " \
          f"agreement {float(agree.mean()):.2f} over {rel.numel()} positions"
    print(msg)
    assert float(rel.median()) <= 0.15 and float(agree.mean()) >= 0.5, msg


def _gpu_sched(ckpt_or_model, ops, max_batch=1, max_num_tokens=256, max_context=256, block_size=16):
    from k3deploy.runtime.cache import HybridCache
    from k3deploy.runtime.executor import TorchExecutor
    from k3deploy.runtime.scheduler import Scheduler
    ex = TorchExecutor(ckpt_or_model, device=None if isinstance(ckpt_or_model, K3Model) else DEV, ops=ops)
    cfg = ex.cfg
    cache = HybridCache(cfg, max_batch + 1, 1 + max_batch * math.ceil(max_context / block_size), block_size,
                        device=ex.device, max_context=max_context)
    return Scheduler(ex, cache, max_batch, max_num_tokens, cfg.eos_token_id)


class _Collect:
    def __init__(self):
        self.tokens, self.error = [], None

    def __call__(self, tok, finished, error):
        if tok is not None:
            self.tokens.append(tok)
        if error:
            self.error = error


@on_device
@pytest.mark.parametrize("ops", KERNEL_OPS)
def test_chunked_prefill_equals_one_shot_on_gpu(micro_ckpt, micro_model, ops):
    """A 100-token prompt prefilled in two chunks (cut at 5 and at 64 = fla's chunk size) gives the one-shot
    prefill's tokens, KDA state (rel. 2e-2: bf16 inside chunk_kda, other chunk alignment) and conv history."""
    from k3deploy.runtime.sampling import SamplingParams
    p = stable_prompts(micro_model, 1, [100], 3, KERNEL_TRIALS, 5e-2, seed=11)[0]
    m = gpu_model(micro_ckpt, ops)

    def run(first):
        sched = _gpu_sched(m, ops)
        col = _Collect()
        sched.add("r", p, SamplingParams(max_tokens=3, ignore_eos=True), col)
        if first is not None:
            sched.step(token_budget=first)
            assert sched.requests["r"].num_computed == first
        sched.step()
        c, slot = sched.cache, sched.cache.slot("r")
        states = {l: (c.pools[l]["state"][slot].cpu(), c.pools[l]["conv"][slot].cpu()) for l in c.kda_layers}
        sched.run_until_done()
        assert col.error is None
        return col.tokens, states

    ref_tokens, ref_states = run(None)
    assert ref_tokens == greedy_path(micro_model, p, 3)
    for cut in (5, 64):
        tokens, states = run(cut)
        assert tokens == ref_tokens, f"cut at {cut}"
        for l, (st, cv) in states.items():
            assert float(relerr_rows(st.flatten()[None], ref_states[l][0].flatten()[None])) < 2e-2, (cut, l)
            torch.testing.assert_close(cv, ref_states[l][1], atol=1e-4, rtol=1e-4)


@on_device
@pytest.mark.parametrize("ops", KERNEL_OPS)
def test_decode_reproduces_prefill_on_gpu(micro_ckpt, micro_model, ops):
    """Logits of 5 tokens decoded one by one (KdaDecode, MlaDecode) equal those of one prefill over the same
    tokens (KdaPrefill, MlaPrefill) within 5e-2, with the same argmax; ops "kernels" with the fused glue."""
    p = stable_prompts(micro_model, 1, [12], 6, KERNEL_TRIALS, 5e-2, seed=13)[0]
    cont = greedy_path(micro_model, p, 6)
    m = gpu_runner(micro_ckpt, ops)
    dec = teacher_forced(m, p, cont)[1:]                              # rows of the 5 decode steps
    with torch.no_grad():
        full, _ = forward(m, p + cont[:-1], SequenceState(m.cfg, 64, device=m.device))
    pre = full[len(p):].float().cpu()
    rel = relerr_rows(dec, pre)
    assert float(rel.max()) < 5e-2, rel
    assert dec.argmax(-1).tolist() == pre.argmax(-1).tolist() == cont[1:]


@on_device
@pytest.mark.parametrize("ops", KERNEL_OPS)
def test_reused_slot_behaves_like_fresh_on_gpu(tiny_ckpt, ops):
    """k3-tiny on the GPU: after a request finishes, its slot and blocks are poisoned with NaN; the next request
    (same slot 1, same blocks) gives the tokens of a fresh cache and finite logits."""
    from k3deploy.runtime.sampling import SamplingParams
    g = torch.Generator().manual_seed(12)
    pa, pb = torch.randint(3, 1024, (9,), generator=g).tolist(), torch.randint(3, 1024, (14,), generator=g).tolist()
    m = gpu_model(tiny_ckpt, ops)
    fresh = _gpu_sched(m, ops)
    col_fresh = _Collect()
    fresh.add("b", pb, SamplingParams(max_tokens=4, ignore_eos=True), col_fresh)
    fresh.run_until_done()
    sched = _gpu_sched(m, ops)
    finite = []
    inner = sched.executor.forward

    def checked(ids, batch, pools, idx):
        logits, pools = inner(ids, batch, pools, idx)
        assert logits.device.type == DEV_TYPE
        finite.append(bool(torch.isfinite(logits).all()))
        return logits, pools
    sched.executor.forward = checked
    sched.add("a", pa, SamplingParams(max_tokens=3, ignore_eos=True), _Collect())
    sched.run_until_done()
    c = sched.cache
    assert c.free_slot_ids() == [1]
    for l in c.kda_layers:
        c.pools[l]["state"][1] = float("nan")
        c.pools[l]["conv"][1] = float("nan")
    for l in c.mla_layers:
        c.pools[l]["cache"][c.free_block_ids()] = float("nan")
    finite.clear()
    col = _Collect()
    sched.add("b", pb, SamplingParams(max_tokens=4, ignore_eos=True), col)
    sched.run_until_done()
    assert finite and all(finite)
    assert col.error is None and col.tokens == col_fresh.tokens and len(col.tokens) == 4


@pytest.mark.gpu
@pytest.mark.skipif(DEV_TYPE != "cuda", reason="the block-size rule is the CUDA kernel's (K3_TEST_DEVICE is cpu)")
def test_block_size_not_multiple_of_16_is_refused_on_gpu(micro_ckpt):
    from k3deploy.runtime.api import LLM
    with pytest.raises(ValueError, match="multiple of 16"):
        LLM(micro_ckpt, device="cuda", block_size=8, max_context=64)
    LLM(micro_ckpt, device="cuda", ops="reference", block_size=8, max_context=64)     # the fp32 references can
    for ops in ("torch", "kernels", "reference"):                 # the default: 64-token blocks for the kernels
        with LLM(micro_ckpt, device="cuda", ops=ops, max_batch=2, max_context=200) as llm:
            assert llm.cache.block_size == (16 if ops == "reference" else 64), ops
            assert llm.cache.num_blocks == 1 + 2 * math.ceil(200 / llm.cache.block_size)


def _generate(model, nproc: int, prompt: list[int], *extra) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    r = subprocess.run(launcher + ["-m", "k3deploy.runtime.generate", "--model", str(model), "--backend", "torch",
                                   "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "6", "--ignore-eos",
                                   *extra], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()


@on_device
def test_tp2_two_ranks_on_gpu0_with_gloo_equals_tp1(micro_ckpt, micro_model):
    """TP=2 / EP=2 as two processes on ONE GPU over gloo (NCCL cannot put two ranks on one GPU; torch's
    ProcessGroupGloo has CUDA all_reduce and all_gather works that stage through pinned host memory —
    torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, AsyncAllreduceCUDAWork / AsyncAllgatherCUDAWork): the same
    greedy tokens as TP=1 on that GPU and as the CPU reference."""
    p = stable_prompts(micro_model, 1, [7], 6, KERNEL_TRIALS, 5e-2, seed=17)[0]
    one = "cuda:0" if DEV_TYPE == "cuda" else "cpu"
    tp1 = _generate(micro_ckpt, 1, p, "--device", one)
    tp2 = _generate(micro_ckpt, 2, p, "--device", one, "--dist-backend", "gloo", "--ep", "2")
    assert tp2 == tp1 == [str(t) for t in greedy_path(micro_model, p, 6)]



@pytest.mark.gpu
@cuda_only
def test_cuda_graph_decode_equals_eager_on_gpu(micro_ckpt, micro_model):
    """LLM(cuda_graphs=True): the decode steps replay graphs (buckets 1, 2, 4, 5; batches shrink as requests of
    different lengths finish, so some run with padding rows) and give the eager kernels' tokens and the CPU
    reference's; 6 requests over 5 slots (reuse), cache consistent afterwards. The eager run steps synchronously,
    the graph run with the runtime's default overlapped decode steps (runtime/pipeline.py: pinned metadata,
    device-side ids, one event per step)."""
    from k3deploy.runtime.api import LLM, SamplingParams
    prompts = stable_prompts(micro_model, 6, [4, 7, 12, 5, 9, 3], 6, KERNEL_TRIALS, 5e-2, seed=23)
    lens = [6, 2, 5, 3, 6, 4]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
    kw = dict(device=DEV, ops="kernels", max_batch=5, max_num_tokens=64, max_context=64, block_size=16)  # 2 blocks
    with LLM(micro_ckpt, **kw) as llm:
        llm.scheduler.set_overlap(False)
        eager = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(micro_ckpt, cuda_graphs=True, **kw) as llm:
        graphs = [o.token_ids for o in llm.generate(prompts, params)]
        g = llm.executor.graphs
        assert g.capture and sorted(g.graphs) == [1, 2, 4, 5] and g.replays >= 5 and g.padded_rows > 0
        assert llm.scheduler.stats["overlapped_steps"] >= 3, llm.scheduler.stats
        llm.cache.check_consistent()
    assert graphs == eager == [greedy_path(micro_model, p, n) for p, n in zip(prompts, lens)]


@pytest.mark.gpu
@cuda_only
def test_prefix_caching_with_kernels_and_cuda_graphs_on_gpu(micro_ckpt, micro_model):
    """LLM(enable_prefix_caching=True) with the in-place kernels and CUDA-graph decode: the second turns restore
    the first turn's end snapshot (copies outside the graphs, into the captured pools) and give the tokens of
    caching off and of the CPU reference; the cache stays consistent."""
    from k3deploy.runtime.api import LLM, SamplingParams
    p1 = stable_prompts(micro_model, 1, [40], 6, KERNEL_TRIALS, 5e-2, seed=31)[0]
    r1 = greedy_path(micro_model, p1, 6)
    p2 = stable_prompts(micro_model, 2, [9, 13], 4, KERNEL_TRIALS, 5e-2, seed=32, prefix=tuple(p1 + r1))
    kw = dict(device=DEV, ops="kernels", max_batch=4, max_num_tokens=64, max_context=128, block_size=16,
              cuda_graphs=True)
    got = {}
    for caching in (False, True):
        extra = dict(enable_prefix_caching=True, snapshot_interval=32) if caching else {}
        with LLM(micro_ckpt, **kw, **extra) as llm:
            a = llm.generate([p1], SamplingParams(max_tokens=6, ignore_eos=True))
            b = llm.generate(p2, SamplingParams(max_tokens=4, ignore_eos=True))
            got[caching] = [o.token_ids for o in a + b]
            if caching:
                assert [o.num_cached_tokens for o in b] == [len(p1) + 5] * 2
                assert llm.executor.graphs.replays > 0
            llm.cache.check_consistent()
    assert got[True] == got[False] == [r1] + [greedy_path(micro_model, p, 4) for p in p2]


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_caching_random_conversation_trees_on_gpu(micro_ckpt, micro_model, seed):
    """A random conversation tree on the in-place kernels with CUDA-graph decode: a root turn, then branches that
    share random-length prefixes of its prompt + reply, sent in random waves under a random chunk budget, with
    periodic snapshots every 16 tokens (several inside one prefill chunk). Caching on gives the tokens of caching
    off and of the CPU reference, the branches reuse cached prefixes, and the pools are empty once the cache is
    reset."""
    import random

    from k3deploy.runtime.api import LLM, SamplingParams
    rnd = random.Random(seed)
    root = stable_prompts(micro_model, 1, [rnd.randrange(30, 60)], 6, KERNEL_TRIALS, 5e-2, seed=40 + seed)[0]
    hist = root + greedy_path(micro_model, root, 6)
    branches, cuts = [], {}
    for i in range(5):
        cut = rnd.randrange(8, len(hist) + 1)
        branches += stable_prompts(micro_model, 1, [rnd.randrange(3, 15)], 4, KERNEL_TRIALS, 5e-2,
                                   seed=50 + 10 * seed + i, prefix=tuple(hist[:cut]))
        cuts[id(branches[-1])] = cut
    rnd.shuffle(branches)
    waves, i = [[root]], 0
    while i < len(branches):
        k = rnd.randrange(1, 4)
        waves.append(branches[i:i + k])
        i += k
    kw = dict(device=DEV, ops="kernels", max_batch=4, max_num_tokens=rnd.choice([16, 24, 64]), max_context=128,
              block_size=16, cuda_graphs=True)
    got = {}
    for caching in (False, True):
        extra = dict(enable_prefix_caching=True, snapshot_interval=16, num_snapshots=64) if caching else {}
        with LLM(micro_ckpt, **kw, **extra) as llm:
            outs = []
            for wave in waves:
                n = 6 if wave[0] is root else 4
                outs += llm.generate(wave, SamplingParams(max_tokens=n, ignore_eos=True))
                llm.cache.check_consistent()
            got[caching] = [o.token_ids for o in outs]
            if caching:        # each branch resumes at its shared prefix's last snapshot position at least
                for p, o in zip((p for wave in waves for p in wave), outs):
                    cut, done = (0, 0) if p is root else (cuts[id(p)], len(root) + 5)    # root: its end snapshot
                    floor = done if cut >= done else cut // 16 * 16
                    assert floor <= o.num_cached_tokens < len(p), (floor, o.num_cached_tokens, len(p))
                assert sum(o.num_cached_tokens for o in outs) > 0
                llm.reset_prefix_cache()
                assert llm.cache.blocks_in_use == 0 and llm.cache.slots_in_use == 0
    want = [greedy_path(micro_model, p, 6 if p is root else 4) for wave in waves for p in wave]
    assert got[True] == got[False] == want


@pytest.mark.gpu
@cuda_only
def test_bf16_dense_weights_on_gpu_graphs_equal_eager(micro_ckpt):
    """dense_dtype="bfloat16" on the GPU with the kernels: bf16 cuBLAS GEMMs for the projections, the decode step
    replayed from CUDA graphs gives the eager bf16 run's tokens; the weights take about half the fp32 bytes."""
    from k3deploy.runtime.api import LLM, SamplingParams
    prompts, params = [[5, 17, 301, 42], [9, 8, 7]], SamplingParams(max_tokens=5, ignore_eos=True)
    kw = dict(device=DEV, ops="kernels", max_batch=2, max_num_tokens=64, max_context=64, block_size=16)  # 2 blocks
    with LLM(micro_ckpt, **kw) as llm:
        fp32 = sum(lin.weight.numel() * lin.weight.element_size() for layer in llm.executor.model.layers
                   for lin in layer.linears())
    with LLM(micro_ckpt, dense_dtype="bfloat16", **kw) as llm:
        m = llm.executor.model
        assert m.dense_dtype == torch.bfloat16 and m.device.type == "cuda"
        assert sum(lin.weight.numel() * lin.weight.element_size() for layer in m.layers
                   for lin in layer.linears()) * 2 == fp32
        eager = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(micro_ckpt, dense_dtype="bfloat16", cuda_graphs=True, **kw) as llm:
        graphs = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.executor.graphs.replays >= 4
    assert graphs == eager


@pytest.mark.gpu
@pytest.mark.parametrize("n", [pytest.param(2, marks=gpus(2)), pytest.param(4, marks=gpus(4))])
def test_tp_nccl_on_n_gpus_equals_tp1(micro_ckpt, micro_model, n):
    """TP=n / EP=n over NCCL, one rank per GPU (NCCL_NVLS_ENABLE=0 by runtime.distributed): the same greedy tokens
    as TP=1 on one GPU and as the CPU reference, eager and with the decode step (NCCL all-reduces included) replayed
    from CUDA graphs."""
    p = stable_prompts(micro_model, 1, [7], 6, KERNEL_TRIALS, 5e-2, seed=17)[0]
    tp1 = _generate(micro_ckpt, 1, p, "--device", "cuda:0")
    tpn = _generate(micro_ckpt, n, p, "--device", "cuda", "--ep", str(n))
    assert tpn == tp1 == [str(t) for t in greedy_path(micro_model, p, 6)]
    graphs = ["--ops", "kernels", "--cuda-graphs", "--max-context", "64"]     # NCCL all-reduces inside the graphs
    assert _generate(micro_ckpt, n, p, "--device", "cuda", "--ep", str(n), *graphs) == tp1


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:-1", "cpu:1", "", "tpu:0"])
def test_bad_device_strings_are_clear_errors(tiny_ckpt, bad):
    from k3deploy.runtime.api import LLM
    with pytest.raises(ValueError, match=r"expected 'cpu', 'cuda' or 'cuda:N'"):
        LLM(tiny_ckpt, device=bad)


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_says_so(tiny_ckpt, capsys):
    from k3deploy.runtime.api import LLM
    from k3deploy.runtime.generate import main
    with pytest.raises(RuntimeError, match="torch sees no CUDA GPU"):
        LLM(tiny_ckpt, device="cuda")
    assert main(["--model", str(tiny_ckpt), "--device", "cuda:0", "--prompt-ids", "1,2"]) == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err


def test_ops_and_backend_device_validation(tiny_ckpt):
    from k3deploy.runtime.api import LLM
    with pytest.raises(ValueError, match="ops = 'fast'"):
        LLM(tiny_ckpt, ops="fast")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="need a CUDA device"):
            LLM(tiny_ckpt, ops="kernels")
    with pytest.raises(ValueError, match="onnxruntime backend runs on the CPU"):
        LLM(tiny_ckpt, backend="onnxruntime", device="cuda")
    with pytest.raises(ValueError, match="only the torch backend takes ops"):
        LLM(tiny_ckpt, backend="onnxruntime", ops="torch")


def test_block_size_rule_and_nccl_environment(monkeypatch):
    from k3deploy.runtime.distributed import nccl_environment
    from k3deploy.runtime.executor import check_block_size
    cuda = torch.device("cuda", 0)
    for ops in ("torch", "kernels"):
        with pytest.raises(ValueError, match="block_size = 8: .*multiple of 16"):
            check_block_size(8, cuda, ops)
        check_block_size(48, cuda, ops)
    check_block_size(8, cuda, "reference")
    check_block_size(8, torch.device("cpu"), "torch")
    from k3deploy.runtime.executor import engine_pool_dims, preferred_block_size
    assert [preferred_block_size(cuda, o) for o in ("torch", "kernels", "reference")] == [64, 64, 16]
    assert preferred_block_size(torch.device("cpu"), "torch") == 16
    from k3deploy.export.build_engines import engine_dims
    prefill, decode = ({**engine_dims(None, 4, 256, 1000, 64), "T": t} for t in ((1, 256, 256), (1, 4, 4)))
    dims = engine_pool_dims({"profile_dims": [prefill, decode]})                # T differs per profile: not kept
    assert dims == {"S": (5, 5), "NB": (65, 65), "BS": (64, 64), "MB": (1, 16), "M": (1, 256)}   # 16 = ceil(1000/64)
    assert engine_pool_dims({}) == {}                                     # a manifest from before profile_dims
    with pytest.raises(ValueError, match="e/manifest.json: the engines' profiles share no value of BS; rebuild them "
                                         "with one --block-size"):
        engine_pool_dims({"profile_dims": [{"BS": (16, 16, 16)}, {"BS": (64, 64, 64)}]}, "e/manifest.json")
    from k3deploy.runtime.executor import TensorRTExecutor                # its size rules need no TensorRT
    trt_ex = TensorRTExecutor.__new__(TensorRTExecutor)
    trt_ex.dir, trt_ex.pool_dims = "engines", dims
    assert (trt_ex.preferred_block_size(), trt_ex.default_max_batch(), trt_ex.default_max_context()) == (64, 4, 1024)
    trt_ex.check_block_size(64)
    trt_ex.check_cache(5, 65, 16)
    for call, msg in ((lambda: trt_ex.check_block_size(16), "block_size = 16: the engines in engines were built for "
                       "64; omit block_size or rebuild with --block-size 16"),
                      (lambda: trt_ex.check_cache(2, 65, 16), r"KDA slots \(max_batch \+ 1\) = 2: .* built for 5; pass "
                       "the build's --max-batch"),
                      (lambda: trt_ex.check_cache(5, 65, 16, max_batch=5), "max_batch = 5: .* take at most 4"),
                      (lambda: trt_ex.check_cache(5, 65, 17), "max_context: 17 blocks per request exceed .* pass "
                       "max_context <= 1024"),
                      (lambda: trt_ex.check_cache(5, 60, 16), "num_blocks = 60: .* built for 65; omit num_blocks")):
        with pytest.raises(ValueError, match=msg):
            call()
    trt_ex.pool_dims = {}                                        # an older manifest: 16, as those builds fixed
    assert trt_ex.preferred_block_size() == 16 and trt_ex.default_max_batch() is None
    trt_ex.check_block_size(32)
    trt_ex.check_cache(2, 7, 3)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert nccl_environment()["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")                         # the user's choice wins
    assert nccl_environment()["NCCL_NVLS_ENABLE"] == "1"


def test_cpu_behaviour_unchanged_with_device_and_torch_ops(tiny_ckpt, tiny_model, capsys):
    """device="cpu" with the torch.library ops (CPU = the references) and the CLI flags give the reference's
    tokens; logits stay on the CPU."""
    from k3deploy.runtime.api import LLM, SamplingParams
    from k3deploy.runtime.generate import main
    p = [5, 6, 7, 8, 9, 10, 11]
    want = greedy_path(tiny_model, p, 4)
    with LLM(tiny_ckpt, device="cpu", ops="torch", max_batch=2, max_context=64) as llm:
        assert llm.executor.ops_name == "torch" and llm.device == torch.device("cpu")
        assert llm.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids == want
    assert main(["--model", str(tiny_ckpt), "--device", "cpu", "--ops", "reference", "--prompt-ids",
                 ",".join(map(str, p)), "--max-tokens", "4", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in want]


_INTERP = r'''
import sys, torch
torch.set_num_threads(1)
from k3deploy.runtime.api import LLM, SamplingParams
ps = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [9] * 20]
out = []
for ops in ("reference", "kernels"):
    with LLM(sys.argv[1], ops=ops, max_batch=2, max_num_tokens=9, max_context=64, device='cpu') as llm:
        res = llm.generate(ps, SamplingParams(max_tokens=3, ignore_eos=True))
        assert all(o.finish_reason == "length" for o in res), [(o.finish_reason, o.error) for o in res]
        out.append([o.token_ids for o in res])
print(out[0] == out[1], out)
'''


_PROBE = r'''
import torch, triton, triton.language as tl
@triton.jit
def _k(x_ptr, n):
    for i in range(0, n, 1):      # a loop bounded by a kernel argument, as in most of our kernels
        tl.store(x_ptr + i, i)
x = torch.zeros(3, dtype=torch.int32)
_k[(1,)](x, 3)
assert x.tolist() == [0, 1, 2], x
'''


def _interp_env() -> dict:
    return {**os.environ, "TRITON_INTERPRET": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@functools.lru_cache(maxsize=None)
def _probe_interpreter() -> tuple[int | None, str]:
    """(exit code, stderr) of `_PROBE` under TRITON_INTERPRET=1, once per session; (None, why) on a timeout."""
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                           env=_interp_env())
        return r.returncode, r.stderr
    except subprocess.TimeoutExpired:
        return None, "the interpreter probe ran over 300 s"


def _interpreter_problem() -> str | None:
    """Why this machine's Triton interpreter cannot run our kernels, or None (probed once, in a subprocess). Seen on
    the H200 image (Triton 3.6, NumPy 2.4): its interpreter fails on any loop bounded by a kernel argument ("only
    0-dimensional arrays can be converted to Python scalars"); Triton 3.9 (the CPU CI) runs them."""
    rc, err = _probe_interpreter()
    if rc == 0:
        return None
    if rc is not None and "only 0-dimensional arrays can be converted to Python scalars" in err:
        import numpy
        import triton
        return (f"Triton {triton.__version__}'s interpreter (NumPy {numpy.__version__}) cannot run a loop bounded by "
                "a kernel argument ('only 0-dimensional arrays can be converted to Python scalars'); the CPU CI runs "
                "this test with Triton 3.9")
    raise AssertionError(f"the Triton interpreter probe failed for another reason: {err[-2000:]}")


def _run_interpreted(script_text: str, ckpt, tmp_path) -> str:
    """Run `script_text` with argv[1] = ckpt in a subprocess under TRITON_INTERPRET=1; returns its stdout. Skips
    (with the reason) where the Triton interpreter itself cannot run our kernels (`_interpreter_problem`)."""
    why = _interpreter_problem()
    if why:
        pytest.skip(why)
    script = tmp_path / "interp_script.py"
    script.write_text(script_text)
    env = _interp_env()
    r = subprocess.run([sys.executable, str(script), str(ckpt)], capture_output=True, text=True, cwd=ROOT,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


_GRAPHS_INTERP = r'''
import sys, torch
torch.set_num_threads(1)
from k3deploy.runtime.api import LLM, SamplingParams
ps = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [9] * 12, [17, 18, 19], [1, 2, 3, 4, 5, 6]]
params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 2, 5, 3, 4)]   # batches shrink: padding rows
out, stats = [], []
for ops, pad, overlap in (("reference", None, False), ("kernels", None, False), ("kernels", 4, False),
                          ("kernels", None, True)):
    with LLM(sys.argv[1], ops=ops, max_batch=5, max_num_tokens=64, max_context=64, decode_pad_multiple=pad,
             device='cpu') as llm:
        if ops == "kernels":     # the graphs' padded static-buffer path, run eagerly (no CUDA here)
            g = llm._enable_graphs(capture=False)
        llm.scheduler.set_overlap(overlap)     # the overlapped steps' device-side inputs into the static buffers
        res = llm.generate(ps, params)
        assert all(o.finish_reason == "length" for o in res), [(o.finish_reason, o.error) for o in res]
        out.append([o.token_ids for o in res])
        llm.cache.check_consistent()
        if ops == "kernels":
            stats.append((g.buckets, g.replays, g.padded_rows))
        if overlap:
            assert llm.scheduler.stats["overlapped_steps"] >= 3, llm.scheduler.stats
print(out[0] == out[1] == out[2] == out[3], stats, out)
'''


def test_decode_graph_padding_path_under_the_interpreter(micro_ckpt, tmp_path):
    """runtime.graphs.DecodeGraphs without capture (CPU, TRITON_INTERPRET=1, fp32 kernels), sized by LLM as for
    capture: decode batches of 5, 4, 3, 2, 1 (staggered max_tokens) copied into the static buffers and run in buckets
    1/2/4/5 with padding rows (slot 0, block 0), and with decode_pad_multiple=4 (batches padded to 8 by the
    scheduler, graphs sized 8), and with overlapped decode steps (runtime/pipeline.py: inputs already on the device):
    the reference's tokens exactly; the cache stays consistent."""
    import ast
    out = _run_interpreted(_GRAPHS_INTERP, micro_ckpt, tmp_path)
    ok, rest = out.split(" ", 1)
    assert ok == "True", out
    (buckets, replays, padded), (buckets8, replays8, padded8), overlapped = \
        ast.literal_eval(rest[: rest.index(")]") + 2])
    assert buckets == [1, 2, 4, 5] and replays == 4 and padded == 1, out    # batches 5, 4, 3 (in 4), 1
    assert buckets8 == [1, 2, 4, 8] and replays8 == 4, out   # the scheduler pads 5 -> 8: sized for it, no error
    assert overlapped == (buckets, replays, padded), out     # overlapped steps: the same decode batches


def test_decode_graphs_refuse_what_they_cannot_capture(micro_ckpt):
    """Clear errors: reference ops (pools not in place), capture on the CPU, other pool tensors, a batch above
    max_batch, block tables wider than max_blocks, a prefill batch."""
    from k3deploy.runtime.api import LLM
    from k3deploy.runtime.graphs import batch_buckets
    assert batch_buckets(1) == [1] and batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)
    from k3deploy.model.reference import Batch
    from k3deploy.plugins.torch_ops import KernelOps
    with LLM(micro_ckpt, max_batch=2, max_context=32) as llm:
        with pytest.raises(ValueError, match="ops 'kernels'"):
            llm.executor.enable_cuda_graphs(llm.cache.pools, 2, 2, capture=False)
        llm.executor.model.ops = KernelOps                  # the checks below run before any kernel
        g = llm.executor.enable_cuda_graphs(llm.cache.pools, 2, 2, capture=False)

        def batch(n, width=1, decode=True):
            return (torch.zeros(n, dtype=torch.long), Batch(torch.arange(n + 1, dtype=torch.int32),
                    torch.ones(n, dtype=torch.int32), torch.ones(n, width, dtype=torch.int32),
                    torch.zeros(n, dtype=torch.int32), decode=decode), torch.arange(n))
        with pytest.raises(ValueError, match="decode batch of 3 > max_batch 2"):
            g.forward(*batch(3)[:2], llm.cache.pools, batch(3)[2])
        with pytest.raises(ValueError, match="3 wide > max_blocks 2"):
            g.forward(*batch(1, 3)[:2], llm.cache.pools, batch(1)[2])
        with pytest.raises(ValueError, match="decode batches only"):
            g.forward(*batch(1, decode=False)[:2], llm.cache.pools, batch(1)[2])
        other = {l: {k: t.clone() for k, t in p.items()} for l, p in llm.cache.pools.items()}
        with pytest.raises(ValueError, match="not the tensor the graphs were captured with"):
            g.forward(*batch(1)[:2], other, batch(1)[2])
        assert g.replays == 0
    with pytest.raises(ValueError, match="CUDA"):
        LLM(micro_ckpt, max_batch=2, max_context=32, cuda_graphs=True)


def test_kernel_ops_in_place_through_the_runtime_under_the_interpreter(micro_ckpt, tmp_path):
    """KernelOps (the Triton kernels called directly, pools updated in place) through the scheduler: chunked
    prefill (9-token budget), 3 requests over 2 slots (reuse). CPU under TRITON_INTERPRET=1 (the kernels compute
    in fp32 there), so the tokens equal the reference's exactly."""
    out = _run_interpreted(_INTERP, micro_ckpt, tmp_path)
    assert out.startswith("True"), out


def test_llm_bf16_dense_weights_and_their_errors(tiny_ckpt, tmp_path, monkeypatch):
    """LLM(dense_dtype="bfloat16") on the CPU: the executor's model holds bf16 dense weights, and the runtime's greedy
    tokens (scheduler, cache, sampling) equal the bf16 model's own prefill-then-decode path; a bad name and a
    backend other than torch are one clear error each."""
    from k3deploy.runtime.api import LLM, SamplingParams
    p = [5, 17, 301, 42, 7]
    with LLM(tiny_ckpt, device="cpu", dense_dtype="bfloat16", max_batch=2, max_context=64) as llm:
        assert llm.executor.model.dense_dtype == torch.bfloat16
        pools = llm.cache.pools.values()                  # §9: conv history and latents in the model dtype
        assert {t.dtype for p in pools for n, t in p.items() if n != "state"} == {torch.bfloat16}
        assert {p["state"].dtype for p in pools if "state" in p} == {torch.float32}
        got = llm.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
        assert got == greedy_path(llm.executor.model, p, 5)
    monkeypatch.setenv("TRITON_INTERPRET", "1")                 # ops "kernels" on CPU tensors
    with LLM(tiny_ckpt, device="cpu", ops="kernels", dense_dtype="bfloat16", max_batch=1, max_context=16) as llm:
        assert llm.executor.act_dtype == torch.float32     # Triton's interpreter: bf16 tl.dot is wrong there
        assert {t.dtype for p in llm.cache.pools.values() for t in p.values()} == {torch.float32}
    with pytest.raises(ValueError, match="dense_dtype = 'float16'"):
        LLM(tiny_ckpt, dense_dtype="float16", max_batch=1, max_context=16)
    for bad in (0, -16, 1.5, True):
        with pytest.raises(ValueError, match=f"block_size = {bad!r}: give a positive int"):
            LLM(tiny_ckpt, block_size=bad, max_batch=1, max_context=16)
    with pytest.raises(ValueError, match="only the torch backend takes dense_dtype"):
        LLM(tiny_ckpt, backend="onnxruntime", dense_dtype="bfloat16")
