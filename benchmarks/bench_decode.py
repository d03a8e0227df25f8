"""Decode-step benchmark of the runtime's torch backend (one GPU, or SPMD over several under torchrun).

    python benchmarks/bench_decode.py --preset k3-tiny --device cuda --batch 8 --prompt-len 64 --steps 16 --check
    python benchmarks/bench_decode.py --preset k3-slice --device cuda --batch 16 --prompt-len 512 --steps 32 \\
        --ops torch,kernels --out bench_decode.jsonl
    torchrun --standalone --nproc-per-node 8 benchmarks/bench_decode.py --preset k3-slice --tp 8 --ep 8 --device cuda
    python benchmarks/bench_decode.py --checkpoint DIR ...      # weights from a checkpoint instead of drawn on the device

What it does, per ops variant (`--ops`, comma-separated; the model is built once):
1. builds the model for `--preset` with `model.synthetic` weights drawn directly on the device
   (`K3Model.from_synthetic`: no 17 GB k3-slice checkpoint on disk; a CUDA generator draws other values than the
   CPU checkpoint of the same seed), or loads `--checkpoint`; every rank draws the same full tensors and keeps its
   TP/EP shard;
2. runs the runtime itself (`runtime.executor.TorchExecutor`, `runtime.cache.HybridCache` on the device,
   `runtime.scheduler.Scheduler`, greedy sampling on the device): B requests of P random prompt tokens are
   prefilled (chunks of `--max-num-tokens`), then `--warmup` decode steps, then `--steps` timed decode steps:
   one scheduler step = one forward of B tokens + sampling + bookkeeping, wall time between
   `torch.cuda.synchronize()` calls;
3. with tp > 1, `--profile-steps` more decode steps with `model.layers.Comm` profiling on (CUDA events around
   every all-reduce / all-gather, no host sync): collective time per step and its share of those steps' time
   (the timed steps run with profiling off);
4. `--check`: teacher-forced comparison with the CPU fp32 reference (TP=1, same weights): the first
   `--check-requests` sequences (prompt + generated tokens) go through one prefill of the model under test and
   of the reference; reports the per-position logits relative error (median, max), the argmax agreement, and the
   agreement of the tokens the benchmark generated (decode path) with the reference's argmax. Pass: median
   relative error <= --check-tol and agreement >= --check-agree (statistical on purpose: the synthetic models
   amplify the kernels' bf16 rounding into routing flips, see docs/DESIGN.md "GPU runtime"). Feasible for
   k3-tiny; for k3-slice the CPU reference needs ~25 GB of host memory and minutes.

Output: one JSON line per ops variant on stdout (rank 0) and appended to `--out`: step_ms_median / mean / min /
max, tokens_per_s (= batch / median step), forward_ms_median (the executor's forward alone, synchronized) and
host_ms_median (the rest of the step: batch building, sampling, bookkeeping), prefill_s, build_s, memory,
collectives {op: calls/bytes/ms per step}, collective_ms_per_step, collective_share, per-rank summaries (tp > 1),
check {...}. Exit status: 0, 1 when --check fails, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
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
                     "kernels; default on CUDA), kernels (kernels in place, no pool copies), reference (fp32; CPU default)")
    run.add_argument("--tp", type=int, default=None, help="tensor parallelism (default: the torchrun world size)")
    run.add_argument("--ep", type=int, default=1, help="expert parallelism: 1 or tp (default %(default)s)")
    run.add_argument("--dist-backend", default=None, choices=["gloo", "nccl"],
                     help="default nccl on CUDA, gloo on the CPU (gloo + --device cuda:0: several ranks on one GPU)")
    run.add_argument("--batch", "-B", type=int, default=8, help="concurrent requests = decode batch (default %(default)s)")
    run.add_argument("--prompt-len", "-P", type=int, default=128, help="prompt tokens per request (default %(default)s)")
    run.add_argument("--steps", "-N", type=int, default=32, help="timed decode steps (default %(default)s)")
    run.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default %(default)s)")
    run.add_argument("--profile-steps", type=int, default=None,
                     help="extra decode steps with collective timing (default: min(steps, 8) when tp > 1, else 0)")
    run.add_argument("--max-num-tokens", type=int, default=8192, help="prefill tokens per step (default %(default)s)")
    run.add_argument("--block-size", type=int, default=16, help="latent block size (multiple of 16 on CUDA)")
    chk = ap.add_argument_group("check")
    chk.add_argument("--check", action="store_true", help="compare with the CPU fp32 reference (see above)")
    chk.add_argument("--check-requests", type=int, default=2, help="sequences compared (default %(default)s)")
    chk.add_argument("--check-steps", type=int, default=4, help="generated tokens compared per sequence (default %(default)s)")
    chk.add_argument("--check-tol", type=float, default=0.15, help="max median logits relative error (default %(default)s)")
    chk.add_argument("--check-agree", type=float, default=0.5, help="min argmax agreement (default %(default)s)")
    out = ap.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="append JSON lines here (rank 0)")
    out.add_argument("--label", default=None, help="free text stored in each record")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    for name in ("batch", "prompt_len", "steps", "max_num_tokens", "block_size", "check_requests", "check_steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} = {getattr(a, name)}: must be >= 1")
    if a.warmup < 0 or (a.profile_steps is not None and a.profile_steps < 0):
        ap.error("--warmup / --profile-steps must be >= 0")
    return a


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def build_model(a, cfg, rank: int, tp: int, device: torch.device, keep_full):
    """The rank's K3Model on `device` (ops set later by the executor)."""
    from model.layers import Comm
    from model.reference import K3Model
    comm = Comm(rank, tp)
    if a.checkpoint is not None:
        return K3Model.from_checkpoint(a.checkpoint, rank=rank, tp=tp, ep=a.ep, comm=comm, device=device)
    return K3Model.from_synthetic(cfg, seed=a.seed, rank=rank, tp=tp, ep=a.ep, comm=comm, device=device,
                                  keep_full=keep_full)


def prompts_for(a, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + a.seed)            # the same on every rank
    return [torch.randint(3, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]


def run_variant(a, executor, prompts, rank: int, progress: bool) -> tuple[dict, dict[str, list[int]]]:
    """Prefill + decode timing with a fresh cache; returns (record fields, tokens per request id)."""
    from runtime.cache import HybridCache
    from runtime.sampling import SamplingParams
    from runtime.scheduler import Scheduler
    cfg, dev = executor.cfg, executor.device
    comm = executor.comm
    prof = a.profile_steps if a.profile_steps is not None else (min(a.steps, 8) if executor.tp > 1 else 0)
    decode_steps = a.warmup + a.steps + prof
    max_ctx = a.prompt_len + decode_steps + 2
    nblocks = 1 + a.batch * math.ceil(max_ctx / a.block_size)
    executor.check_block_size(a.block_size)
    cache = HybridCache(cfg, a.batch + 1, nblocks, a.block_size, executor.tp, torch.float32, dev, max_ctx)
    pool_bytes = sum(t.numel() * t.element_size() for p in cache.pools.values() for t in p.values())
    sched = Scheduler(executor, cache, a.batch, a.max_num_tokens, eos_token_id=-1)
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

    params = SamplingParams(max_tokens=decode_steps + 2, ignore_eos=True)
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

    def decode_step() -> float:
        _sync(dev)
        t = time.perf_counter()
        ran = sched.step()
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
    times, fwd_times = [], []
    inner = executor.forward

    def timed_forward(*args):                  # the model's share of a step (the GPU is idle before it: free)
        _sync(dev)
        t = time.perf_counter()
        out = inner(*args)
        _sync(dev)
        fwd_times.append(time.perf_counter() - t)
        return out
    executor.forward = timed_forward
    try:
        for i in range(a.steps):
            times.append(decode_step())
            if bar is None and (i + 1) % max(1, a.steps // 4) == 0:
                log.info("decode step %d/%d: %.3f ms", i + 1, a.steps, times[-1] * 1e3)
    finally:
        del executor.forward
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
    if bar is not None:
        bar.close()
    for rid in list(sched.requests):
        sched.cancel(rid)
    med = statistics.median(times)
    rec = {
        "ops": executor.ops_name, "prefill_steps": prefill_steps, "prefill_s": round(prefill_s, 4),
        "prefill_tokens_per_s": round(a.batch * a.prompt_len / prefill_s, 1),
        "step_ms_median": round(med * 1e3, 4), "step_ms_mean": round(statistics.fmean(times) * 1e3, 4),
        "step_ms_min": round(min(times) * 1e3, 4), "step_ms_max": round(max(times) * 1e3, 4),
        "tokens_per_s": round(a.batch / med, 1),
        "forward_ms_median": round(statistics.median(fwd_times) * 1e3, 4),
        "host_ms_median": round((med - statistics.median(fwd_times)) * 1e3, 4), "profile_steps": prof,
        "profiled_step_ms_median": round(statistics.median(prof_times) * 1e3, 4) if prof_times else None,
        "collectives": coll, "collective_ms_per_step": None if coll_ms is None else round(coll_ms, 4),
        "collective_share": None if share is None else round(share, 4),
        "pools_gib": _gib(pool_bytes),
        "mem_peak_gib": _gib(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None,
    }
    return rec, tokens


def check_against_reference(a, executor, ref_model, prompts, tokens, rank: int) -> dict | None:
    """Teacher-forced logits of the model under test (all ranks) vs the CPU reference (rank 0). Returns the
    metrics on rank 0, None elsewhere."""
    from model.reference import Batch, allocate_pools
    cfg, dev = executor.cfg, executor.device
    n = min(a.check_requests, len(prompts))
    k = min([a.check_steps] + [len(tokens[f"r{i}"]) - 1 for i in range(n)])
    seqs, rows, targets = [], [], []
    for i in range(n):
        gen = tokens[f"r{i}"]
        seqs.append(prompts[i] + gen[:k])
        targets.append(gen[:k + 1])
    lens = [len(s) for s in seqs]
    off = 0
    for L in lens:
        rows.extend(range(off + L - k - 1, off + L))          # predictions of gen[0..k]
        off += L
    bs = a.block_size
    mb = max(math.ceil(L / bs) for L in lens)
    bt = torch.arange(1, n * mb + 1, dtype=torch.int32).view(n, mb)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    batch = Batch(cu, torch.arange(1, n + 1, dtype=torch.int32), bt, torch.zeros(n, dtype=torch.int32))
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    idx = torch.tensor(rows, dtype=torch.long)
    pools = allocate_pools(cfg, n + 1, n * mb + 1, bs, executor.tp, torch.float32, dev)
    test, _ = executor.forward(ids, batch, pools, idx)
    test = test.float().cpu()
    del pools
    if rank != 0:
        return None
    with torch.no_grad():
        ref, _ = ref_model.forward(ids, batch, allocate_pools(cfg, n + 1, n * mb + 1, bs), idx)
    rel = ((test.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1).clamp_min(1e-30))
    ref_arg = ref.argmax(-1)
    gen_flat = torch.tensor([t for tg in targets for t in tg])
    top2 = ref.topk(2, dim=-1).values
    res = {
        "requests": n, "steps": k, "positions": len(rows),
        "logits_relerr_median": float(rel.median()), "logits_relerr_max": float(rel.max()),
        "argmax_agreement": float((test.argmax(-1) == ref_arg).float().mean()),
        "decode_token_agreement": float((gen_flat == ref_arg).float().mean()),
        "ref_margin_min": float((top2[:, 0] - top2[:, 1]).min()),
        "tokens": [tg for tg in targets], "ref_argmax": ref_arg.view(n, k + 1).tolist(),
        "tol": a.check_tol, "min_agreement": a.check_agree,
    }
    res["passed"] = bool(res["logits_relerr_median"] <= a.check_tol and res["argmax_agreement"] >= a.check_agree
                         and res["decode_token_agreement"] >= a.check_agree)
    return res


def main(argv=None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from model.config import load_config
    from runtime.distributed import init_from_env, resolve_device, shutdown
    from runtime.executor import TorchExecutor
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
        cfg = load_config(a.checkpoint if a.checkpoint is not None else a.preset)
        variants = (a.ops or ("torch" if device.type == "cuda" else "reference")).split(",")
        from model.sharding import check_parallel
        check_parallel(cfg, tp, a.ep)
        for v in variants:
            from runtime.executor import resolve_ops
            resolve_ops(v, device)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        shutdown()
        return 2
    progress = rank == 0 and not a.no_progress and sys.stderr.isatty()
    log.info("building %s on %s (tp %d ep %d, %s)", a.checkpoint or cfg.name, device, tp, a.ep,
             "checkpoint" if a.checkpoint else f"synthetic seed {a.seed} drawn on the device")
    keep_full = {} if (a.check and rank == 0 and a.checkpoint is None) else None
    _sync(device)
    t0 = time.perf_counter()
    model = build_model(a, cfg, rank, tp, device, keep_full)
    _sync(device)
    build_s = time.perf_counter() - t0
    weights_gib = _gib(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
    log.info("model built in %.1f s%s", build_s, f" ({weights_gib} GiB on the device)" if weights_gib is not None else "")
    ref_model = None
    if a.check and rank == 0:
        from model.reference import K3Model, ReferenceOps
        if a.checkpoint is not None:
            ref_model = K3Model.from_checkpoint(a.checkpoint, ops=ReferenceOps)
        else:
            ref_model = K3Model(cfg, keep_full["model"], lambda l: keep_full["layers"].pop(l), None, ReferenceOps)
        log.info("CPU fp32 reference built for --check")
    prompts = prompts_for(a, cfg.vocab_size)
    base = {
        "bench": "decode", "model": str(a.checkpoint) if a.checkpoint else cfg.name,
        "weights": "checkpoint" if a.checkpoint else f"synthetic-{device.type}-seed{a.seed}",
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "tp": tp, "ep": a.ep, "world": world,
        "dist_backend": (torch.distributed.get_backend() if world > 1 else None),
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "batch": a.batch, "prompt_len": a.prompt_len, "steps": a.steps, "warmup": a.warmup,
        "block_size": a.block_size, "max_num_tokens": a.max_num_tokens, "build_s": round(build_s, 2),
        "weights_gib": weights_gib, "label": a.label,
    }
    try:
        import triton
        base["triton"] = triton.__version__
    except ImportError:
        base["triton"] = None
    status = 0
    for v in variants:
        executor = TorchExecutor(model, ops=v)
        rec, tokens = run_variant(a, executor, prompts, rank, progress)
        rec = {**base, **rec}
        if world > 1:
            mine = {"rank": rank, "step_ms_median": rec["step_ms_median"],
                    "collective_ms_per_step": rec["collective_ms_per_step"], "collective_share": rec["collective_share"]}
            everyone = [None] * world
            torch.distributed.all_gather_object(everyone, mine)
            rec["per_rank"] = everyone
        if a.check:
            res = check_against_reference(a, executor, ref_model, prompts, tokens, rank)
            rec["check"] = res
            if rank == 0 and not res["passed"]:
                status = 1
                log.error("check failed (%s): median logits rel. err %.3g (tol %.3g), argmax agreement %.2f, "
                          "decode-token agreement %.2f (min %.2f)", v, res["logits_relerr_median"], a.check_tol,
                          res["argmax_agreement"], res["decode_token_agreement"], a.check_agree)
        rec["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        if rank == 0:
            line = json.dumps(rec)
            print(line, flush=True)
            if a.out is not None:
                a.out.parent.mkdir(parents=True, exist_ok=True)
                with a.out.open("a") as f:
                    f.write(line + "\n")
            log.info("%s ops=%s: decode step %.3f ms median (%.3f mean), %.1f tokens/s%s", rec["model"], v,
                     rec["step_ms_median"], rec["step_ms_mean"], rec["tokens_per_s"],
                     "" if rec["collective_share"] is None else
                     f", collectives {rec['collective_ms_per_step']:.3f} ms/step = {100 * rec['collective_share']:.1f}%")
    shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
