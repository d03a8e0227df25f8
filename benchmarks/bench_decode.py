"""Decode-step benchmark of the runtime's torch backend (one GPU, or SPMD over several under torchrun).

    python benchmarks/bench_decode.py --preset k3-tiny --device cuda --batch 8 --prompt-len 64 --steps 16 --check
    python benchmarks/bench_decode.py --preset k3-slice --device cuda --batch 16 --prompt-len 512 --steps 32 \\
        --ops torch,kernels --out bench_decode.jsonl
    python benchmarks/bench_decode.py --preset k3-slice --device cuda --batch 1,16,64 --prompt-len 4096 \\
        --ops kernels,kernels-unfused --cuda-graphs --dense-dtype bfloat16 --kernel-profile 2   # fused vs unfused
    python benchmarks/bench_decode.py --preset k3-tp8-rank --device cuda --batch 1,16,64 --prompt-len 1024 \\
        --ops kernels --cuda-graphs --dense-dtype bfloat16 --kernel-profile 2 --ttft 8192,32768 --predict-experts 896
    torchrun --standalone --nproc-per-node 8 benchmarks/bench_decode.py --preset k3-slice --tp 8 --ep 8 --device cuda
    python benchmarks/bench_decode.py --checkpoint DIR ...      # weights from a checkpoint instead of drawn on the device

What it does, per batch size (`--batch`, comma-separated) and ops variant (`--ops`, comma-separated; the model is
built once; "kernels" = the kernels with each layer's glue fused, runtime/fused.py; "kernels-unfused" = the same
kernels in K3Model's layer code, the side-by-side peer):
1. builds the model for `--preset` with `model.synthetic` weights drawn directly on the device
   (`K3Model.from_synthetic`: no 17 GB k3-slice checkpoint on disk; a CUDA generator draws other values than the
   CPU checkpoint of the same seed), or loads `--checkpoint`; every rank draws the same full tensors and keeps its
   TP/EP shard;
2. runs the runtime itself (`runtime.executor.TorchExecutor`, `runtime.cache.HybridCache` on the device,
   `runtime.scheduler.Scheduler`, greedy sampling on the device): B requests of P random prompt tokens are
   prefilled (chunks of `--max-num-tokens`), then `--warmup` decode steps, then `--steps` timed decode steps:
   one scheduler step = one forward of B tokens + sampling + bookkeeping. With the scheduler's overlapped decode
   (runtime/pipeline.py; on by default on CUDA with ops kernels / kernels-unfused; `--overlap on|off`) a
   step launches the next forward before it books the previous one, so steps are timed back to back without syncs
   (the wall time of each `Scheduler.step()` call, which waits for the step before); then `--steps` more steps run
   synchronously (between `torch.cuda.synchronize()` calls, as without overlap) for `sync_step_ms_median`,
   `forward_ms_median` and `host_ms_median` (the host work that overlap takes off the GPU's critical path);
3. with tp > 1, `--profile-steps` more decode steps with `model.layers.Comm` profiling on (CUDA events around
   every all-reduce / all-gather, no host sync): collective time per step and its share of those steps' time
   (the timed steps run with profiling off);
4. `--check`: teacher-forced comparison with the CPU fp32 reference (TP=1, same weights): the first
   `--check-requests` sequences (prompt + generated tokens) go through one prefill of the model under test and
   of the reference; reports the per-position logits relative error (median, max), the argmax agreement, and the
   agreement of the tokens the benchmark generated (decode path) with the reference's argmax. Pass: median
   relative error <= --check-tol, argmax agreement >= --check-agree, and every generated token the argmax of the
   model's own teacher-forced logits or within 2 E of it, E = the second-largest per-position logit error against
   the reference (`compare_logits`: the logits are judged against the
   reference, the decode path against the model itself; the synthetic models have top-1 margins of a few 1e-3 and
   amplify the kernels' bf16 rounding into routing flips, see docs/DESIGN.md "GPU runtime"). Feasible for
   k3-tiny; for k3-slice the CPU reference needs ~25 GB of host memory and minutes.
5. `--save-logits FILE` / `--compare-to FILE`: the same teacher-forced logits compared with another run's instead
   of the CPU reference (e.g. TP=2 over NCCL against TP=1 on one GPU; same pass rule as --check), plus the greedy
   tokens both runs generated from the same prompts (requests equal throughout, first divergence each).
6. `--kernel-profile STEPS`: STEPS more decode steps under torch.profiler: GPU kernels per step and per layer
   (all of the step's kernels / layers: embedding, head and sampling included), GPU busy time and its share of the
   step (below 1: the step waits on the host), the top kernels.
7. the step's bound (`step_bytes`): the bytes one decode step must move on this rank — dense weights read once
   (bf16 checkpoint tensors at the dense dtype's size, TP-split ones at the rank's share, lm_head whole, the
   batch's embedding rows), the routed experts the batch touches (distinct local experts per MoE layer, counted in
   one more decode step through a recording router, times one expert's MXFP4 bytes), the KDA state and conv
   history read and written, the MLA latents read (mean attended context over the timed steps) — over the device
   copy rate measured at start-up (`bench_common.copy_rate_gbps`, 1 GiB read + written); `bound_fraction` = bound /
   step median. `--predict-experts N` adds the bound with N routed experts per layer (touched experts at the
   uniform-routing expectation N (1 - (1 - k/N)^B), router rows N) and the step predicted at this run's fraction:
   for `k3-tp8-rank` (448 of K3's 896 experts) `--predict-experts 896` is the real TP=8 rank's.
8. `--ttft L1,L2`: per ops variant, time to first token of one request of each prompt length on a fresh cache
   (prefill in chunks of --max-num-tokens, then the first token), run twice: `ttft_ms` is the second run, the first
   (compiles, autotuning) is `ttft_first_ms`. One "bench": "ttft" record each.

Output: one JSON line per batch size and ops variant on stdout (rank 0) and appended to `--out`: step_ms_median / mean / min /
max, tokens_per_s (= batch / median step), overlap (whether the steps were overlapped), sync_step_ms_median (the
synchronous step), forward_ms_median (the executor's forward alone, synchronized) and host_ms_median (the rest of the
synchronous step: batch building, sampling, bookkeeping), prefill_s, build_s, memory,
collectives {op: calls/bytes/ms per step}, collective_ms_per_step, collective_share, per-rank summaries (tp > 1),
check {...}, compare {...}, kernel_profile {...}, copy_GBps, bound {...}, bound_fraction, bound_fraction_forward,
predicted {...}; then the ttft records. Exit status: 0, 1 when --check or --compare-to fails, 2 for
bad arguments.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

log = logging.getLogger("bench_decode")


def parse_args(argv=None):
    """The command line (see the module docstring); argparse exits with status 2 on a bad value."""
    from k3deploy.model.layers import DENSE_DTYPES, dense_dtype_name
    ap = argparse.ArgumentParser(prog="benchmarks/bench_decode.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    src = ap.add_argument_group("model")
    src.add_argument("--preset", default="k3-tiny", help="config preset (k3-tiny, k3-slice, k3) or config.json path; "
                     "weights drawn on the device (default %(default)s)")
    src.add_argument("--checkpoint", type=Path, default=None, help="load this checkpoint instead (overrides --preset)")
    src.add_argument("--seed", type=int, default=0, help="synthetic weight seed (default %(default)s)")
    run = ap.add_argument_group("run")
    run.add_argument("--device", default=None, help="cuda (default when available; cuda:LOCAL_RANK under torchrun), "
                     "cuda:N or cpu")
    run.add_argument("--ops", default=None, help="comma-separated ops variants: torch (torch.library ops = Triton "
                     "kernels; default on CUDA), kernels (kernels in place, no pool copies, fused glue), kernels-unfused "
                          "(the same kernels, unfused glue), reference (fp32; CPU default)")
    run.add_argument("--dense-dtype", default="float32", type=dense_dtype_name, choices=list(DENSE_DTYPES),
                     help="dense weights and their GEMMs: float32 (fp32) or bfloat16 (bf16) (default %(default)s; "
                          "--check still compares with the fp32 reference, which bf16 fails on the synthetic models "
                          "where router scores nearly tie: see the warning it prints)")
    run.add_argument("--tp", type=int, default=None, help="tensor parallelism (default: the torchrun world size)")
    run.add_argument("--ep", type=int, default=1, help="expert parallelism: 1 or tp (default %(default)s)")
    run.add_argument("--dist-backend", default=None, choices=["gloo", "nccl"],
                     help="default nccl on CUDA, gloo on the CPU (gloo + --device cuda:0: several ranks on one GPU)")
    run.add_argument("--batch", "-B", type=_int_list, default=[8], metavar="B[,B...]",
                     help="concurrent requests = decode batch; comma-separated: one run per size (default 8)")
    run.add_argument("--prompt-len", "-P", type=int, default=128, help="prompt tokens per request (default %(default)s)")
    run.add_argument("--steps", "-N", type=int, default=32, help="timed decode steps (default %(default)s)")
    run.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default %(default)s)")
    run.add_argument("--profile-steps", type=int, default=None,
                     help="extra decode steps with collective timing (default: min(steps, 8) when tp > 1, else 0)")
    run.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                     help="overlapped decode steps (runtime/pipeline.py): auto = the runtime's default (on for CUDA "
                          "with ops kernels / kernels-unfused), on (also elsewhere: the same path, synchronous), off "
                          "(default %(default)s)")
    run.add_argument("--cuda-graphs", action="store_true",
                     help="decode steps replay CUDA graphs (runtime/graphs.py; ops kernels only); the Comm collective "
                          "timing is off then (--kernel-profile shows the NCCL kernels)")
    run.add_argument("--kernel-profile", type=int, default=0, metavar="STEPS",
                     help="STEPS more decode steps under torch.profiler: GPU kernels per step, GPU busy time per step "
                          "(union of kernel intervals) and its share of the step, top kernels (default off)")
    run.add_argument("--max-num-tokens", type=int, default=8192, help="prefill tokens per step (default %(default)s)")
    run.add_argument("--ttft", type=_int_list, default=[], metavar="L[,L...]",
                     help="also time the first token of one request of each prompt length (default none)")
    run.add_argument("--predict-experts", type=int, default=None, metavar="N",
                     help="also report the bound and the step predicted with N routed experts per layer (e.g. 896 "
                          "for k3-tp8-rank: K3's TP=8 rank)")
    run.add_argument("--block-size", type=int, default=None,
                     help="latent block size (multiple of 16 on CUDA; default 64 on CUDA, 16 on the CPU: "
                          "runtime.executor.preferred_block_size)")
    chk = ap.add_argument_group("check")
    chk.add_argument("--check", action="store_true",
                     help="compare with the CPU fp32 reference (item 4 of the description below the options); pass: "
                          "median logits rel. error <= --check-tol, argmax agreement >= --check-agree, every decode "
                          "token within 2 E of the model's own argmax (E: the run's logit error scale)")
    chk.add_argument("--check-requests", type=int, default=2, help="sequences compared (default %(default)s)")
    chk.add_argument("--check-steps", type=int, default=4, help="generated tokens compared per sequence (default %(default)s)")
    chk.add_argument("--check-tol", type=float, default=0.15, help="max median logits relative error (default %(default)s)")
    chk.add_argument("--check-agree", type=float, default=0.5, help="min argmax agreement (default %(default)s)")
    out = ap.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="append JSON lines here (rank 0)")
    out.add_argument("--label", default=None, help="free text stored in each record")
    out.add_argument("--save-logits", type=Path, default=None,
                     help="save prompts, generated tokens and teacher-forced logits (torch.save) for --compare-to")
    out.add_argument("--compare-to", type=Path, default=None,
                     help="compare with a --save-logits file of another run (e.g. TP=2 against TP=1): logits on the "
                          "saved sequences and greedy tokens; fails like --check")
    out.add_argument("--compare-tokens", action="store_true",
                     help="with --compare-to: also fail unless every request's greedy tokens equal the saved run's "
                          "(exact; expected with --ops reference, not with the bf16-rounding kernels)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("-v", "--verbose", action="store_true", help="log every library's INFO lines too")
    a = ap.parse_args(argv)
    if any(b < 1 for b in a.batch) or any(n < 1 for n in a.ttft):
        ap.error(f"--batch {a.batch} / --ttft {a.ttft}: every value must be >= 1")
    if len(a.batch) > 1 and (a.check or a.save_logits or a.compare_to):
        ap.error("--check / --save-logits / --compare-to compare one batch size's runs: give one --batch")
    if a.predict_experts is not None and a.predict_experts < 1:
        ap.error(f"--predict-experts {a.predict_experts}: must be >= 1")
    a.batches, a.batch = a.batch, a.batch[0]
    for name in ("prompt_len", "steps", "max_num_tokens", "block_size", "check_requests", "check_steps"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} = {getattr(a, name)}: must be >= 1")
    for name in ("warmup", "kernel_profile", "profile_steps"):
        if (getattr(a, name) or 0) < 0:
            ap.error(f"--{name.replace('_', '-')} = {getattr(a, name)}: must be >= 0")
    if a.warmup < 0 or (a.profile_steps is not None and a.profile_steps < 0):
        ap.error("--warmup / --profile-steps must be >= 0")
    return a


def _int_list(text: str) -> list[int]:
    """argparse type: "1,16,64" -> [1, 16, 64]."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers expected") from None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def build_model(a, cfg, rank: int, tp: int, device: torch.device, keep_full):
    """The rank's K3Model on `device` (ops set later by the executor)."""
    from k3deploy.model.layers import Comm
    from k3deploy.model.reference import K3Model
    comm = Comm(rank, tp)
    if a.checkpoint is not None:
        return K3Model.from_checkpoint(a.checkpoint, rank=rank, tp=tp, ep=a.ep, comm=comm, device=device,
                                       dense_dtype=a.dense_dtype)
    return K3Model.from_synthetic(cfg, seed=a.seed, rank=rank, tp=tp, ep=a.ep, comm=comm, device=device,
                                  keep_full=keep_full, dense_dtype=a.dense_dtype)


def weights_label(a, device: torch.device) -> str:
    """Where the weights come from: "checkpoint", or "synthetic-<device type>-seed<N>" (draws differ by device type)."""
    return "checkpoint" if a.checkpoint is not None else f"synthetic-{device.type}-seed{a.seed}"


def prompts_for(a, vocab: int) -> list[list[int]]:
    """--batch prompts of --prompt-len token ids in [3, vocab), from --seed (the same on every rank and every run)."""
    g = torch.Generator().manual_seed(1000 + a.seed)            # the same on every rank
    return [torch.randint(3, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]


def run_variant(a, executor, prompts, rank: int, progress: bool) -> tuple[dict, dict[str, list[int]]]:
    """Prefill + decode timing with a fresh cache; returns (record fields, tokens per request id)."""
    from k3deploy.runtime.cache import HybridCache
    from k3deploy.runtime.sampling import SamplingParams
    from k3deploy.runtime.scheduler import Scheduler
    cfg, dev = executor.cfg, executor.device
    comm = executor.comm
    prof = a.profile_steps if a.profile_steps is not None else (min(a.steps, 8) if executor.tp > 1 else 0)
    if a.cuda_graphs:
        prof = 0                                   # a replay runs no Python: Comm sees no collective
    overlap = {"auto": executor.overlap_decode, "on": True, "off": False}[a.overlap]
    # + the synchronous pass after overlapped timing, the routing probe, one step in flight
    decode_steps = a.warmup + a.steps + (a.steps + 1 if overlap else 0) + prof + a.kernel_profile + 2
    # a request whose prompt is done decodes one token in each later prefill step (chunked prefill mixes them)
    early = math.ceil(a.batch * a.prompt_len / a.max_num_tokens)
    max_ctx = a.prompt_len + decode_steps + early + 2
    nblocks = 1 + a.batch * math.ceil(max_ctx / a.block_size)
    executor.check_block_size(a.block_size)
    cache = HybridCache(cfg, a.batch + 1, nblocks, a.block_size, executor.tp, executor.act_dtype, dev, max_ctx)
    pool_bytes = sum(t.numel() * t.element_size() for p in cache.pools.values() for t in p.values())
    capture_s = None
    if a.cuda_graphs:
        capture_s = executor.enable_cuda_graphs(cache.pools, a.batch, math.ceil(max_ctx / a.block_size)).capture_s
    sched = Scheduler(executor, cache, a.batch, a.max_num_tokens, eos_token_id=-1, overlap=overlap)
    tokens: dict[str, list[int]] = {}
    errors: list[str] = []

    def collector(rid):
        tokens[rid] = []

        def on_token(tok, finished, error):
            if tok is not None:
                tokens[rid].append(tok)
            if error:
                errors.append(f"{rid}: {error}")
        return on_token

    params = SamplingParams(max_tokens=decode_steps + early + 2, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, params, collector(f"r{i}"))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    _sync(dev)
    t0 = time.perf_counter()
    prefill_steps = 0
    while not all(r.is_decode for r in sched.running) or sched.waiting:
        if not sched.step():
            raise RuntimeError("scheduler made no progress during prefill")
        prefill_steps += 1
        if errors:
            raise RuntimeError(f"prefill failed: {errors[0]}")
    _sync(dev)
    prefill_s = time.perf_counter() - t0
    log.info("prefill: %d requests x %d tokens in %d steps, %.3f s", a.batch, a.prompt_len, prefill_steps, prefill_s)

    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=decode_steps, desc=f"decode ({executor.ops_name})", unit="step", file=sys.stderr)
        except ImportError:
            bar = None

    def decode_step(sync: bool = not overlap) -> float:
        if sync:
            _sync(dev)
        t = time.perf_counter()
        ran = sched.step()
        if sync:
            _sync(dev)
        dt = time.perf_counter() - t
        if errors:
            raise RuntimeError(f"decode failed: {errors[0]}")
        if len(ran) != a.batch:
            raise RuntimeError(f"decode step ran {len(ran)} requests, expected {a.batch}")
        if bar is not None:
            bar.update(1)
        return dt

    for _ in range(a.warmup):
        decode_step()
    times, fwd_times, sync_times = [], [], []
    inner = executor.forward

    def timed_forward(*args):                  # the model's share of a step (the GPU is idle before it: free)
        _sync(dev)
        t = time.perf_counter()
        out = inner(*args)
        _sync(dev)
        fwd_times.append(time.perf_counter() - t)
        return out
    ctx0 = sum(r.num_computed for r in sched.running)
    if not overlap:
        executor.forward = timed_forward
    try:
        for i in range(a.steps):
            times.append(decode_step())
            if bar is None and (i + 1) % max(1, a.steps // 4) == 0:
                log.info("decode step %d/%d: %.3f ms", i + 1, a.steps, times[-1] * 1e3)
    finally:
        executor.__dict__.pop("forward", None)
    attended = (ctx0 + sum(r.num_computed for r in sched.running)) / 2 + a.batch / 2   # mean keys per step, all requests
    if overlap:                                # the same steps synchronously: forward and host time apart
        sched.set_overlap(False)
        decode_step(sync=True)
        executor.forward = timed_forward
        try:
            sync_times = [decode_step(sync=True) for _ in range(a.steps)]
        finally:
            del executor.forward
        sched.set_overlap(True)
    else:
        sync_times = times
    coll, coll_ms, share, prof_times = {}, None, None, []
    if prof:
        comm.reset_stats()
        comm.profile = True
        try:
            prof_times = [decode_step() for _ in range(prof)]
        finally:
            comm.profile = False
        st = comm.stats()
        coll = {op: {"calls_per_step": v["calls"] / prof, "bytes_per_step": v["bytes"] / prof,
                     "ms_per_step": v["seconds"] * 1e3 / prof} for op, v in st.items()}
        total = sum(v["seconds"] for v in st.values())
        coll_ms = total * 1e3 / prof
        share = total / sum(prof_times)
    kprof = None
    if a.kernel_profile:
        if dev.type != "cuda":
            log.warning("--kernel-profile on %s: torch.profiler records no GPU kernels here (empty profile)", dev)
        kprof = kernel_profile(decode_step, a.kernel_profile, statistics.median(times) * 1e3, sync=lambda: _sync(dev))
        kprof["kernels_per_layer"] = round(kprof["kernels_per_step"] / cfg.num_hidden_layers, 2)
    touched = probe_routing(executor, sched)
    if bar is not None:
        bar.close()
    for rid in list(sched.requests):
        sched.cancel(rid)
    med = statistics.median(times)
    rec = {
        "ops": executor.ops_name, "cuda_graphs": a.cuda_graphs, "graph_capture_s": capture_s,
        "graph_replays": executor.graphs.replays if executor.graphs is not None else None,
        "prefill_steps": prefill_steps, "prefill_s": round(prefill_s, 4),
        "prefill_tokens_per_s": round(a.batch * a.prompt_len / prefill_s, 1),
        "step_ms_median": round(med * 1e3, 4), "step_ms_mean": round(statistics.fmean(times) * 1e3, 4),
        "step_ms_min": round(min(times) * 1e3, 4), "step_ms_max": round(max(times) * 1e3, 4),
        "tokens_per_s": round(a.batch / med, 1),
        "overlap": overlap, "sync_step_ms_median": round(statistics.median(sync_times) * 1e3, 4),
        "forward_ms_median": round(statistics.median(fwd_times) * 1e3, 4),
        "host_ms_median": round((statistics.median(sync_times) - statistics.median(fwd_times)) * 1e3, 4),
        "profile_steps": prof,
        "profiled_step_ms_median": round(statistics.median(prof_times) * 1e3, 4) if prof_times else None,
        "collectives": coll, "collective_ms_per_step": None if coll_ms is None else round(coll_ms, 4),
        "collective_share": None if share is None else round(share, 4),
        "kernel_profile": kprof, "pools_gib": _gib(pool_bytes),
        "mem_peak_gib": _gib(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None,
    }
    rec.update(bound_record(a, executor, attended, touched, med, statistics.median(fwd_times)))
    return rec, tokens


def probe_routing(executor, sched) -> list[int]:
    """Distinct local routed experts per MoE layer (layer order) in one more decode step of the running batch, run
    eagerly through K3Model's own layer code with a recording router (the CUDA graphs and the fused glue are set
    aside for that step; the routing is the model's either way, up to rounding)."""
    model = executor.model
    base, seen = model.ops, []

    class Recording(base):
        @staticmethod
        def route(x, *args, **kw):
            ids, w = base.route(x, *args, **kw)
            seen.append(ids)
            return ids, w
    graphs, runner = executor.graphs, executor.runner
    executor.graphs, executor.runner, model.ops = None, model, Recording
    try:
        sched.step()
    finally:
        executor.graphs, executor.runner, model.ops = graphs, runner, base
    moe = [layer.mlp for layer in model.layers if model.cfg.is_moe(layer.l)]
    out = []
    for ids, mlp in zip(seen, moe):
        lo, n = mlp.expert_offset, mlp.experts["w13_packed"].shape[0]
        ids = ids.long()
        out.append(int(torch.unique(ids[(ids >= lo) & (ids < lo + n)]).numel()))
    return out


@functools.lru_cache(maxsize=8)
def expert_bytes(cfg, tp: int, ep: int) -> int:
    """Bytes of one routed expert on a rank: its w1, w2, w3 (MXFP4 packed + scales, or bf16) over tp in TP mode
    (ep == 1: every rank holds every expert's slice), whole in EP mode."""
    from k3deploy.model.weights import layer_tensors
    l = cfg.first_k_dense_replace
    n = sum(s.nbytes for s in layer_tensors(cfg, l) if s.expert == 0)
    return n // tp if ep == 1 else n


def uniform_touched(num_experts: int, top_k: int, batch: int, ep: int = 1) -> float:
    """Expected distinct experts of one rank that `batch` tokens pick, each its top_k of num_experts uniformly:
    E_local (1 - (1 - k/E)^B), E_local = E / ep."""
    return num_experts / ep * (1 - (1 - top_k / num_experts) ** batch)


@functools.lru_cache(maxsize=8)
def _dense_specs(cfg) -> tuple:
    """Every layer's non-expert checkpoint tensors (model.weights.layer_tensors), built once per config."""
    from k3deploy.model.weights import layer_tensors
    return tuple(s for l in range(cfg.num_hidden_layers) for s in layer_tensors(cfg, l) if s.expert is None)


def step_bytes(cfg, tp: int, ep: int, dense_itemsize: int, act_itemsize: int, batch: int, attended: float,
               touched: list[float], num_experts: int | None = None) -> dict:
    """The bytes one decode step of `batch` requests must move on one rank (module docstring, item 7): dense
    weights (checkpoint BF16 tensors at `dense_itemsize` bytes, col / row / vocab splits at 1/tp, lm_head whole on
    the rank, `batch` embedding rows), `touched` experts per MoE layer x `expert_bytes`, KDA state (fp32) and conv
    history (`act_itemsize`) read + written per request, MLA latents read: `attended` keys (all requests, mean per
    step) + the rows written. num_experts: the router's rows (default cfg.num_experts). Returns {dense, experts,
    kda_state, mla_latents, total} in bytes."""
    from k3deploy.model.weights import BYTES, model_tensors
    E = num_experts or cfg.num_experts

    def nbytes(s):
        n = s.nbytes // BYTES[s.dtype] * (dense_itemsize if s.dtype == "BF16" else BYTES[s.dtype])
        if s.name.endswith(("gate.weight", "gate.e_score_correction_bias")) and ".block_sparse_moe." in s.name:
            n = n // cfg.num_experts * E
        return n // tp if s.split in ("col", "row", "vocab") else n
    dense = sum(nbytes(s) for s in _dense_specs(cfg))
    for s in model_tensors(cfg):
        dense += batch * cfg.hidden_size * dense_itemsize if "embed_tokens" in s.name else nbytes(s)
    H, K = cfg.kda_num_heads // tp, cfg.kda_head_dim
    kda = len(cfg.kda_layers) * batch * 2 * (H * K * K * 4 + 3 * H * K * (cfg.conv_kernel_size - 1) * act_itemsize)
    mla = len(cfg.mla_layers) * (attended + batch) * cfg.latent_dim * act_itemsize
    experts = sum(touched) * expert_bytes(cfg, tp, ep)
    total = dense + experts + kda + mla
    return {"dense": int(dense), "experts": int(experts), "kda_state": int(kda), "mla_latents": int(mla),
            "total": int(total)}


def bound_record(a, executor, attended: float, touched: list[int], step_s: float, forward_s: float) -> dict:
    """The record's bound fields (module docstring, item 7): copy_GBps (measured at start-up; None off CUDA, then
    only the bytes), bound {bytes..., experts_touched_per_layer, experts_touched_uniform, ms}, bound_fraction (bound /
    step median), bound_fraction_forward (bound / forward median), and with --predict-experts N: predicted
    {experts, bound bytes and ms, step_ms at this run's fraction}."""
    cfg, tp, ep = executor.cfg, executor.tp, a.ep
    dsz = torch.empty((), dtype=executor.model.dense_dtype).element_size()
    asz = torch.empty((), dtype=executor.act_dtype).element_size()
    b = step_bytes(cfg, tp, ep, dsz, asz, a.batch, attended, touched)
    b["experts_touched_per_layer"] = round(statistics.fmean(touched), 2) if touched else 0.0
    b["experts_touched_uniform"] = round(uniform_touched(cfg.num_experts, cfg.num_experts_per_token, a.batch, ep), 2)
    b["attended_keys_per_step"] = round(attended, 1)
    rate = a.copy_gbps
    b["ms"] = round(b["total"] / rate / 1e6, 4) if rate else None
    rec = {"copy_GBps": round(rate, 1) if rate else None, "bound": b,
           "bound_fraction": round(b["ms"] / (step_s * 1e3), 4) if rate else None,
           "bound_fraction_forward": round(b["ms"] / (forward_s * 1e3), 4) if rate else None, "predicted": None}
    if a.predict_experts:
        N = a.predict_experts
        n_moe = sum(cfg.is_moe(l) for l in range(cfg.num_hidden_layers))
        p = step_bytes(cfg, tp, ep, dsz, asz, a.batch, attended,
                       [uniform_touched(N, cfg.num_experts_per_token, a.batch, ep)] * n_moe, num_experts=N)
        p["experts_per_layer"] = N
        p["experts_touched_uniform"] = round(uniform_touched(N, cfg.num_experts_per_token, a.batch, ep), 2)
        p["ms"] = round(p["total"] / rate / 1e6, 4) if rate else None
        p["step_ms"] = round(p["ms"] / rec["bound_fraction"], 4) if rate else None
        rec["predicted"] = p
    return rec


def kernel_profile(step, n: int, unprofiled_step_ms: float, top: int = 12, sync=lambda: None) -> dict:
    """Run `step` n times under torch.profiler (CPU + CUDA activities), with `sync()` (the device) before the profiler
    starts and before it stops: an overlapped step launched earlier is not in the profile, the last one launched is
    (all of it). Returns per step: kernels_per_step (GPU
    kernels incl. memcpy/memset, not the profiler's user annotations such as "nccl:all_reduce"), gpu_busy_ms_per_step
    (union of the kernels' device intervals: overlapping streams count once), nccl_ms_per_step (NCCL kernels, which
    include waiting for the slower rank), step_ms_median of the profiled steps (the profiler slows the host) and
    gpu_busy_share = busy / `unprofiled_step_ms` (the timed steps' median, ms; kernels run as fast under the
    profiler); top: the `top` kernels by device time {name: {"calls_per_step", "ms_per_step"}}. A share well below 1
    means the step waits on the host (launches, Python, syncs), not on the GPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=acts) as prof:
        times = [step() for _ in range(n)]
        sync()
    spans, per_name = [], {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False) or e.name.startswith("nccl:"):
            continue
        t0, t1 = e.time_range.start, e.time_range.end
        spans.append((t0, t1))
        c, us = per_name.get(e.name, (0, 0.0))
        per_name[e.name] = (c + 1, us + (t1 - t0))
    busy, end = 0.0, float("-inf")
    for t0, t1 in sorted(spans):
        if t1 > end:
            busy += t1 - max(t0, end)
            end = t1
    busy_ms = busy / 1e3 / n
    nccl_ms = sum(us for name, (_, us) in per_name.items() if name.startswith("ncclDevKernel")) / 1e3 / n
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"steps": n, "kernels_per_step": len(spans) / n, "gpu_busy_ms_per_step": round(busy_ms, 4),
            "nccl_ms_per_step": round(nccl_ms, 4), "step_ms_median": round(statistics.median(times) * 1e3, 4),
            "gpu_busy_share": round(busy_ms / unprofiled_step_ms, 4) if spans else None,
            "top": {name[:120]: {"calls_per_step": c / n, "ms_per_step": round(us / 1e3 / n, 4)}
                    for name, (c, us) in ranked}}


def _check_sequences(a, prompts, tokens) -> tuple[list[list[int]], int]:
    """The first --check-requests sequences (prompt + first k generated tokens) and k."""
    n = min(a.check_requests, len(prompts))
    k = min([a.check_steps] + [len(tokens[f"r{i}"]) - 1 for i in range(n)])
    return [prompts[i] + tokens[f"r{i}"][:k] for i in range(n)], k


def teacher_forced_logits(executor, seqs: list[list[int]], k: int, block_size: int, model=None) -> torch.Tensor:
    """One prefill of `seqs` (fresh pools) through `executor` (every rank must call it) or, with `model`, through
    that model's own forward (the CPU reference). Returns fp32 CPU logits [len(seqs) * (k + 1), vocab]: for each
    sequence, the predictions of its last k + 1 positions (= of generated tokens 0..k)."""
    from k3deploy.model.reference import Batch, allocate_pools
    cfg = executor.cfg
    n, lens = len(seqs), [len(s) for s in seqs]
    rows, off = [], 0
    for L in lens:
        rows.extend(range(off + L - k - 1, off + L))
        off += L
    mb = max(math.ceil(L / block_size) for L in lens)
    bt = torch.arange(1, n * mb + 1, dtype=torch.int32).view(n, mb)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    batch = Batch(cu, torch.arange(1, n + 1, dtype=torch.int32), bt, torch.zeros(n, dtype=torch.int32))
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    idx = torch.tensor(rows, dtype=torch.long)
    if model is not None:
        with torch.no_grad():
            out, _ = model.forward(ids, batch, allocate_pools(cfg, n + 1, n * mb + 1, block_size), idx)
        return out.float()
    pools = allocate_pools(cfg, n + 1, n * mb + 1, block_size, executor.tp, executor.act_dtype, executor.device)
    out, _ = executor.forward(ids, batch, pools, idx)
    return out.float().cpu()


def compare_logits(a, test: torch.Tensor, ref: torch.Tensor, targets: list[list[int]],
                   expected: list[list[int]] | None = None) -> dict:
    """Metrics of `test` logits against `ref` logits (both [n * (k + 1), vocab], request-major: request i's
    positions 0..k are rows i * (k + 1) ..); `targets` are the tokens the run under test generated at those
    positions ([n][k + 1]); `expected` (--compare-to) the saved run's generated tokens, which were teacher-forced
    (None for --check: both sides were teacher-forced with the run's own tokens).

    Two questions, kept apart. Are the logits close? Median relative error and argmax agreement (of the logits
    under test with the reference's). Does the decode path follow the model's own logits? At every position whose
    prefix the run under test shared with the teacher-forced sequence (--check: all; --compare-to: up to and
    including the first position where the runs' tokens differ), the generated token g must be the argmax t of the
    logits under test there, or a near tie in them: test[t] - test[g] <= 2 E, E = the run's logit error scale, the
    second-largest over positions of max |test - ref| (a decode step's GEMMs round differently from the prefill's,
    by about as much as the logits under test differ from the reference's; one wild position cannot set E). Tokens
    that differ from the reference's are listed with the reference's preference ("gap").
    Pass: median relative error <= --check-tol, argmax agreement >= --check-agree, no inconsistent decode token
    ("failed" lists the rules that did not hold)."""
    n = len(targets)
    per = ref.shape[0] // n
    rel = ((test.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1).clamp_min(1e-30))
    row_err = (test.double() - ref.double()).abs().amax(dim=-1).sort(descending=True).values
    scale = float(row_err[min(1, len(row_err) - 1)])          # the second-largest: one wild position cannot set it
    ref_arg, own_arg = ref.argmax(-1), test.argmax(-1)
    gen_flat = torch.tensor([t for tg in targets for t in tg])
    top2 = ref.topk(2, dim=-1).values
    divergences, inconsistent = [], 0
    for i in range(n):
        for j in range(per):
            p, g = i * per + j, targets[i][j]
            want = int(ref_arg[p]) if expected is None else expected[i][j]
            own_gap = float(test[p, own_arg[p]] - test[p, g])
            consistent = own_gap <= 2 * scale
            inconsistent += not consistent
            if g != want or not consistent:
                divergences.append({"request": i, "position": j, "token": g, "expected": want,
                                    "gap": float(ref[p, want] - ref[p, g]), "own_argmax": int(own_arg[p]),
                                    "own_gap": own_gap, "consistent": consistent})
            if expected is not None and g != expected[i][j]:
                break                                   # the prefixes differ from here on
    res = {
        "requests": n, "steps": len(targets[0]) - 1, "positions": int(ref.shape[0]),
        "logits_relerr_median": float(rel.median()), "logits_relerr_max": float(rel.max()),
        "logit_error_scale": scale,
        "argmax_agreement": float((own_arg == ref_arg).float().mean()),
        "decode_token_agreement": float((gen_flat == ref_arg).float().mean()),
        "ref_margin_min": float((top2[:, 0] - top2[:, 1]).min()),
        "divergences": divergences, "inconsistent_decode_tokens": inconsistent,
        "tokens": [list(tg) for tg in targets], "ref_argmax": ref_arg.view(n, -1).tolist(),
        "tol": a.check_tol, "min_agreement": a.check_agree,
    }
    rules = (("logits_relerr_median > tol", res["logits_relerr_median"] <= a.check_tol),
             ("argmax_agreement < min_agreement", res["argmax_agreement"] >= a.check_agree),
             ("inconsistent_decode_tokens > 0", inconsistent == 0))
    res["failed"] = [name for name, ok in rules if not ok]
    res["passed"] = not res["failed"]
    return res


def _explain_bf16_failure(rec: dict, other_dtype: str | None, failed: list[str]) -> None:
    """After a failed --check / --compare-to between a bf16 and an fp32 dense run (rec["dense_dtype"] and
    other_dtype) whose `failed` rules are only the logits ones (error, argmax agreement; not decode tokens off the
    model's own logits or --compare-tokens, which rounding does not explain): say why that is expected on the
    synthetic models and what to compare instead; nothing otherwise."""
    logits_only = all(r.startswith(("logits_relerr", "argmax_agreement")) for r in failed)
    if logits_only and {rec["dense_dtype"], other_dtype} == {"bfloat16", "float32"}:
        log.warning("bf16 dense weights against fp32: the synthetic models' near-tied router scores flip under bf16 "
                    "rounding, so late positions differ by 20-30% (README 'GPU runtime'); compare bf16 with a bf16 "
                    "run (--save-logits / --compare-to) or --check with --dense-dtype float32")


def check_against_reference(a, executor, ref_model, prompts, tokens, rank: int) -> dict | None:
    """Teacher-forced logits of the model under test (all ranks) vs the CPU reference (rank 0). Returns the
    metrics on rank 0, None elsewhere."""
    seqs, k = _check_sequences(a, prompts, tokens)
    test = teacher_forced_logits(executor, seqs, k, a.block_size)
    if rank != 0:
        return None
    ref = teacher_forced_logits(executor, seqs, k, a.block_size, model=ref_model)
    return compare_logits(a, test, ref, [tokens[f"r{i}"][:k + 1] for i in range(len(seqs))])


def _generated_equal(mine: dict[str, list[int]], theirs: dict[str, list[int]]) -> dict:
    """Greedy tokens of two runs of the same prompts over the length both generated (the runs may decode different
    numbers of steps, e.g. profiling steps at TP > 1): requests equal throughout, and the first divergence per request
    (None: equal; 0 for a request this run lacks or generated nothing for)."""
    first = {}
    for rid, ref in theirs.items():
        got = mine.get(rid) or []
        first[rid] = 0 if not got else next((i for i in range(min(len(got), len(ref))) if got[i] != ref[i]), None)
    return {"requests": len(theirs), "requests_equal": sum(v is None for v in first.values()),
            "tokens_compared": sum(min(len(mine.get(r) or []), len(t)) for r, t in theirs.items()),
            "first_divergence": first}


_SAVED_META = ("model", "weights", "tp", "ep", "device", "batch", "prompt_len", "block_size", "dense_dtype")


def save_run(path: Path, a, rec: dict, executor, prompts, tokens) -> None:
    """--save-logits (rank 0 writes; every rank runs the prefill): the run's prompts, generated tokens and
    teacher-forced logits of its first --check-requests sequences, keyed by ops variant, for --compare-to in a later
    run (e.g. TP=2 against TP=1). Written to a temp file, then renamed (engines.manifest.atomic_write_bytes).
    Raises ValueError when `path` exists but is not such a file."""
    import io
    from k3deploy.engines.manifest import atomic_write_bytes
    seqs, k = _check_sequences(a, prompts, tokens)
    logits = teacher_forced_logits(executor, seqs, k, a.block_size)
    if executor.comm.rank != 0:
        return
    data = _load_saved(path) if path.exists() else {}
    data[rec["ops"]] = {"meta": {x: rec[x] for x in _SAVED_META},
                        "prompts": prompts, "tokens": tokens, "seqs": seqs, "k": k, "logits": logits}
    buf = io.BytesIO()
    torch.save(data, buf)
    atomic_write_bytes(path, buf.getbuffer())


def _load_saved(path: Path) -> dict:
    """A --save-logits file (tensors, lists and dicts only: loaded with weights_only=True). ValueError otherwise."""
    try:
        data = torch.load(path, weights_only=True)
    except Exception as e:          # noqa: BLE001 - any unreadable file gets the same message
        raise ValueError(f"{path}: not a bench_decode --save-logits file (torch.load: {type(e).__name__}); write "
                         "it with --save-logits") from e
    if not isinstance(data, dict) or not all(isinstance(v, dict) and "logits" in v for v in data.values()):
        raise ValueError(f"{path}: not a bench_decode --save-logits file")
    return data


def check_saved(path: Path, variants: list[str], rec: dict, prompts) -> dict:
    """The --compare-to file's runs of `variants` after checking they can be compared with this run: same model,
    weights (a CUDA generator draws other weights than the CPU one), block size and prompts. `rec` holds this run's
    "model", "weights", "block_size". Returns {ops: saved run}. Raises ValueError naming the mismatch and the fix."""
    data = _load_saved(path)
    missing = [v for v in variants if v not in data]
    if missing:
        raise ValueError(f"--compare-to {path}: no saved run of ops {missing} (has {sorted(data)}); "
                         "save one with the same --ops")
    for v in variants:
        saved = data[v]
        for key in ("model", "weights", "block_size"):
            if saved["meta"].get(key) != rec[key]:
                raise ValueError(f"--compare-to {path}: saved {key} {saved['meta'].get(key)!r} != this run's "
                                 f"{rec[key]!r}; compare runs of the same model, weights (--seed, and CPU vs CUDA "
                                 "draws) and --block-size")
        if saved["prompts"] != prompts:
            raise ValueError(f"--compare-to {path}: saved prompts differ (use the same --batch, --prompt-len, --seed)")
    return {v: data[v] for v in variants}


def compare_run(saved: dict, a, executor, tokens) -> dict | None:
    """--compare-to: teacher-force the saved run's sequences (`saved`: one ops variant's entry, already checked by
    `check_saved` against this run) through this model and compare logits with the saved ones; compare the greedy
    tokens both runs generated from the same prompts. Every rank calls it. Returns the metrics on rank 0 (None
    elsewhere); "passed" follows --check-tol / --check-agree and, with --compare-tokens, needs every request's
    greedy tokens equal."""
    seqs, k = saved["seqs"], saved["k"]
    if any(len(tokens[f"r{i}"]) < k + 1 for i in range(len(seqs))):   # every rank has the same tokens: all raise
        raise ValueError(f"--compare-to: this run generated fewer than the saved run's {k + 1} tokens per request; "
                         "use the same --warmup / --steps / --profile-steps as the saved run")
    test = teacher_forced_logits(executor, seqs, k, a.block_size)
    if executor.comm.rank != 0:
        return None
    targets = [tokens[f"r{i}"][:k + 1] for i in range(len(seqs))]
    res = compare_logits(a, test, saved["logits"], targets, [saved["tokens"][f"r{i}"][:k + 1]
                                                             for i in range(len(seqs))])
    res["against"] = saved["meta"]
    res["greedy"] = _generated_equal(tokens, saved["tokens"])
    if a.compare_tokens:
        if res["greedy"]["requests_equal"] != res["greedy"]["requests"]:
            res["failed"].append("--compare-tokens: requests with unequal greedy tokens")
        res["passed"] = not res["failed"]
    return res


def main(argv=None) -> int:
    """Build the model, time every --ops variant (bench_variant), tear the process group down. Returns the exit
    status: 0, 1 when --check / --compare-to fails, 2 for bad arguments or a --compare-to file of another run."""
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from k3deploy.model.config import load_config
    from k3deploy.runtime.distributed import init_from_env, resolve_device, shutdown
    device_arg = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        rank, world = init_from_env(device_arg, a.dist_backend)
        device = resolve_device(device_arg)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        log.setLevel(logging.INFO)                          # progress lines from rank 0 even without -v
    try:
        tp = a.tp or world
        if tp != world:
            raise ValueError(f"--tp {tp}: launch {tp} processes (torchrun --nproc-per-node {tp}); world size is {world}")
        if a.checkpoint is not None and not (a.checkpoint / "config.json").is_file():
            raise FileNotFoundError(f"--checkpoint {a.checkpoint}: not a checkpoint directory (no config.json); write "
                                    "one with python -m k3deploy.model.synthetic or leave it out to draw --preset's weights")
        cfg = load_config(a.checkpoint if a.checkpoint is not None else a.preset)
        variants = (a.ops or ("torch" if device.type == "cuda" else "reference")).split(",")
        if a.block_size is None:                    # one size for every variant: their logits are compared
            from k3deploy.runtime.executor import preferred_block_size
            a.block_size = preferred_block_size(device, "kernels")
        from k3deploy.model.sharding import check_parallel
        check_parallel(cfg, tp, a.ep)
        if a.compare_to is not None and not a.compare_to.is_file():
            raise FileNotFoundError(f"--compare-to {a.compare_to}: no such file (write it with --save-logits first)")
        if a.compare_to is not None and a.save_logits is not None and \
                a.compare_to.resolve() == a.save_logits.resolve():
            raise ValueError("--save-logits and --compare-to name the same file: the run would compare with itself")
        if a.compare_tokens and a.compare_to is None:
            raise ValueError("--compare-tokens needs --compare-to FILE")
        for v in variants:
            from k3deploy.runtime.executor import resolve_ops
            resolve_ops(v, device)
        if a.cuda_graphs and (device.type != "cuda" or any(v not in ("kernels", "kernels-unfused") for v in variants)):
            raise ValueError("--cuda-graphs: needs a CUDA device and --ops kernels and/or kernels-unfused (the pools "
                             "are updated in place)")
        saved_runs = {}
        if a.compare_to is not None:                # before the run: a mismatch would only show at its end
            saved_runs = check_saved(a.compare_to, variants, {"model": str(a.checkpoint) if a.checkpoint else cfg.name,
                                                 "weights": weights_label(a, device), "block_size": a.block_size},
                        prompts_for(a, cfg.vocab_size))
        if a.save_logits is not None and a.save_logits.exists():
            _load_saved(a.save_logits)              # merging into it needs a --save-logits file
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        shutdown()
        return 2
    progress = rank == 0 and not a.no_progress and sys.stderr.isatty()
    log.info("building %s on %s (tp %d ep %d, %s)", a.checkpoint or cfg.name, device, tp, a.ep,
             "checkpoint" if a.checkpoint else f"synthetic seed {a.seed} drawn on the device")
    keep_full = {} if (a.check and rank == 0 and a.checkpoint is None) else None
    from bench_common import copy_rate_gbps
    a.copy_gbps = copy_rate_gbps(device) if device.type == "cuda" else None     # before the weights fill the memory
    if a.copy_gbps:
        log.info("device copy rate %.0f GB/s", a.copy_gbps)
    _sync(device)
    t0 = time.perf_counter()
    model = build_model(a, cfg, rank, tp, device, keep_full)
    _sync(device)
    build_s = time.perf_counter() - t0
    weights_gib = _gib(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
    log.info("model built in %.1f s%s", build_s, f" ({weights_gib} GiB on the device)" if weights_gib is not None else "")
    ref_model = None
    if a.check and rank == 0:
        from k3deploy.model.reference import K3Model, ReferenceOps
        if a.checkpoint is not None:
            ref_model = K3Model.from_checkpoint(a.checkpoint, ops=ReferenceOps)
        else:
            ref_model = K3Model(cfg, keep_full["model"], lambda l: keep_full["layers"].pop(l), None, ReferenceOps)
        log.info("CPU fp32 reference built for --check")
    base = {
        "bench": "decode", "model": str(a.checkpoint) if a.checkpoint else cfg.name,
        "weights": weights_label(a, device),
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "tp": tp, "ep": a.ep, "world": world, "dense_dtype": a.dense_dtype,
        "dist_backend": (torch.distributed.get_backend() if world > 1 else None),
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "prompt_len": a.prompt_len, "steps": a.steps, "warmup": a.warmup,
        "block_size": a.block_size, "max_num_tokens": a.max_num_tokens, "build_s": round(build_s, 2),
        "weights_gib": weights_gib, "label": a.label,
    }
    try:
        import triton
        base["triton"] = triton.__version__
    except ImportError:
        base["triton"] = None
    status = 0
    try:
        for B in a.batches:
            a.batch = B
            prompts = prompts_for(a, cfg.vocab_size)
            for v in variants:
                status = max(status, bench_variant(a, v, model, ref_model, prompts, {**base, "batch": B}, rank,
                                                   world, progress, saved_runs.get(v)))
        for v in variants if a.ttft else ():
            bench_ttft(a, v, model, base, rank, progress)
    except ValueError as e:                     # e.g. a block size the GPU kernels cannot use
        print(f"error: {e}", file=sys.stderr)
        status = 2
    finally:
        shutdown()
    return status


def bench_variant(a, v: str, model, ref_model, prompts, base: dict, rank: int, world: int, progress: bool,
                  saved: dict | None = None) -> int:
    """Time one ops variant, then --save-logits / --compare-to (against `saved`, the checked --compare-to entry of
    this variant) / --check; rank 0 prints and appends the record. Returns 0, or 1 when a comparison failed. The
    executor (and its CUDA graphs) is closed before returning, also on errors (a graph holding NCCL kernels must go
    before the process group). ValueError from the runtime (e.g. an unusable --block-size)."""
    from k3deploy.runtime.executor import TorchExecutor
    executor = TorchExecutor(model, ops=v)
    status = 0
    try:
        rec, tokens = run_variant(a, executor, prompts, rank, progress)
        rec = {**base, **rec}
        if world > 1:
            kp = {key: x for key, x in (rec["kernel_profile"] or {}).items() if key != "top"} or None
            mine = {"rank": rank, "step_ms_median": rec["step_ms_median"], "kernel_profile": kp,
                    "collective_ms_per_step": rec["collective_ms_per_step"], "collective_share": rec["collective_share"]}
            everyone = [None] * world
            torch.distributed.all_gather_object(everyone, mine)
            rec["per_rank"] = everyone
        if a.save_logits is not None:
            save_run(a.save_logits, a, rec, executor, prompts, tokens)
        if saved is not None:
            res = compare_run(saved, a, executor, tokens)
            rec["compare"] = res
            if rank == 0 and res["passed"]:
                log.info("compare passed (%s): median logits rel. err %.3g, argmax agreement %.2f, requests with "
                         "equal greedy tokens %d/%d", v, res["logits_relerr_median"], res["argmax_agreement"],
                         res["greedy"]["requests_equal"], res["greedy"]["requests"])
            if rank == 0 and not res["passed"]:
                status = 1
                log.error("compare failed (%s): median logits rel. err %.3g (tol %.3g), argmax agreement %.2f, "
                          "requests with equal greedy tokens %d/%d, decode tokens off the model's own logits %d", v,
                          res["logits_relerr_median"], a.check_tol, res["argmax_agreement"],
                          res["greedy"]["requests_equal"], res["greedy"]["requests"], res["inconsistent_decode_tokens"])
                _explain_bf16_failure(rec, res["against"].get("dense_dtype"), res["failed"])
        if a.check:
            res = check_against_reference(a, executor, ref_model, prompts, tokens, rank)
            rec["check"] = res
            if rank == 0 and res["passed"]:
                log.info("check passed (%s): median logits rel. err %.3g, argmax agreement %.2f", v,
                         res["logits_relerr_median"], res["argmax_agreement"])
            if rank == 0 and not res["passed"]:
                status = 1
                log.error("check failed (%s): median logits rel. err %.3g (tol %.3g), argmax agreement %.2f, "
                          "decode tokens off the model's own logits %d", v, res["logits_relerr_median"], a.check_tol,
                          res["argmax_agreement"], res["inconsistent_decode_tokens"])
                _explain_bf16_failure(rec, "float32", res["failed"])
    finally:
        executor.close()                                    # graphs go before the process group
    rec["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if rank == 0:
        line = json.dumps(rec)
        print(line, flush=True)
        if a.out is not None:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            with a.out.open("a") as f:
                f.write(line + "\n")
        kp = rec["kernel_profile"] or {}
        log.info("%s ops=%s B=%d: decode step %.3f ms median (%.3f mean%s), %.1f tokens/s%s%s%s", rec["model"], v,
                 rec["batch"], rec["step_ms_median"], rec["step_ms_mean"],
                 f"; overlapped, {rec['sync_step_ms_median']:.3f} ms synchronous" if rec["overlap"] else "",
                 rec["tokens_per_s"],
                 "" if rec["bound_fraction"] is None else
                 f", bound {rec['bound']['ms']:.3f} ms = {100 * rec['bound_fraction']:.1f}% reached",
                 "" if not kp.get("kernels_per_layer") else
                 f", {kp['kernels_per_layer']:.1f} kernels/layer, GPU busy {100 * (kp['gpu_busy_share'] or 0):.1f}%",
                 "" if rec["collective_share"] is None else
                 f", collectives {rec['collective_ms_per_step']:.3f} ms/step = {100 * rec['collective_share']:.1f}%")
    return status


def run_ttft(a, executor, length: int) -> dict:
    """Time to first token of one request of `length` random tokens on a fresh cache (module docstring, item 8):
    wall seconds from `Scheduler.add` to its first token, twice. Returns {prompt_len, ttft_ms (second run),
    ttft_first_ms, prefill_steps, prefill_tokens_per_s}."""
    from k3deploy.runtime.cache import HybridCache
    from k3deploy.runtime.sampling import SamplingParams
    from k3deploy.runtime.scheduler import Scheduler
    cfg, dev = executor.cfg, executor.device
    g = torch.Generator().manual_seed(2000 + a.seed + length)
    prompt = torch.randint(3, cfg.vocab_size, (length,), generator=g).tolist()
    runs = []
    for _ in range(2):
        cache = HybridCache(cfg, 2, 1 + math.ceil((length + 2) / a.block_size), a.block_size, executor.tp,
                            executor.act_dtype, dev, length + 2)
        sched = Scheduler(executor, cache, 1, a.max_num_tokens, eos_token_id=-1)
        got = []
        _sync(dev)
        t0 = time.perf_counter()
        sched.add("t", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                  lambda tok, finished, error: got.append((tok, error)))
        steps = 0
        while not any(tok is not None for tok, _ in got):
            if not sched.step() or any(e for _, e in got):
                raise RuntimeError(f"ttft: the {length}-token prefill made no progress or failed: {got}")
            steps += 1
        _sync(dev)
        runs.append(time.perf_counter() - t0)
        sched.run_until_done()
    return {"prompt_len": length, "ttft_ms": round(runs[1] * 1e3, 3), "ttft_first_ms": round(runs[0] * 1e3, 3),
            "prefill_steps": steps, "prefill_tokens_per_s": round(length / runs[1], 1)}


def bench_ttft(a, v: str, model, base: dict, rank: int, progress: bool) -> None:
    """--ttft for ops variant v: one "bench": "ttft" record per prompt length (rank 0 prints and appends)."""
    from k3deploy.runtime.executor import TorchExecutor
    executor = TorchExecutor(model, ops=v)
    try:
        for L in a.ttft:
            rec = {**base, "bench": "ttft", "ops": executor.ops_name, "batch": 1, **run_ttft(a, executor, L),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            if rank == 0:
                line = json.dumps(rec)
                print(line, flush=True)
                if a.out is not None:
                    with a.out.open("a") as f:
                        f.write(line + "\n")
                log.info("%s ops=%s: TTFT %d tokens %.1f ms (first run %.1f ms)", rec["model"], v, L, rec["ttft_ms"],
                         rec["ttft_first_ms"])
    finally:
        executor.close()


if __name__ == "__main__":
    sys.exit(main())
