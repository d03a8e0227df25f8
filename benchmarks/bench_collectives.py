"""Time the decode step's collectives alone: the all-reduces and the logits all-gather of one TP decode step.

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_collectives.py --preset k3-slice --batch 16 \\
        --device cuda --out collectives.jsonl
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_collectives.py --device cpu      # gloo, eager only

A decode step of B tokens at TP=n (model.reference / runtime.executor) sums partial outputs with
`Comm.all_reduce` on [B, hidden_size] fp32 (embedding, every attention output, every dense MLP and shared expert)
and [B, routed_expert_hidden_size] fp32 (the routed latent experts: EP sums their outputs with an all-reduce,
no all-to-all), and gathers the vocabulary-parallel logits with `Comm.all_gather_last` ([B, vocab / n] per rank).
A k3-slice step makes 11 + 4 such all-reduces and one all-gather (bench_decode.py's `collectives` counts them:
the per-step total is the counts times these times). bench_decode.py times them inside the step, where they
include waiting for the slowest rank; here every rank
starts together (barrier), so the numbers are the collectives' own cost. The default `--dtypes fp32,bf16` also
times the bf16 message (half the bytes) that a bf16 collective would send.

Modes: `eager` = `--iters` calls back to back between two CUDA events (wall clock on the CPU; per call: the
mean); `graph` (CUDA only)
= the same calls captured in one CUDA graph and replayed (as `--cuda-graphs` decode runs them). Each is repeated
`--repeats` times; the median is reported. Output: one JSON line per (op, dtype, mode) on rank 0: us (median per
call), bytes (this rank's input), algbw_gbs = bytes / time, busbw_gbs = NCCL's bus bandwidth (all-reduce:
2 (n-1)/n x bytes / time; all-gather: (n-1) x bytes / time), correct (every rank's check). Each collective's result
is checked once, eagerly (rank-dependent values, exact sum / concatenation); a wrong result on any rank exits 1.
The timed calls reduce the same buffer over and over (its values grow; only the time is used). Exit 2: bad
arguments or world size 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

log = logging.getLogger("bench_collectives")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; argparse exits with status 2 naming a bad option."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-slice", help="config preset or config.json path (default %(default)s)")
    ap.add_argument("--batch", "-B", type=int, default=16, help="decode tokens per step (default %(default)s)")
    ap.add_argument("--device", default=None, help="cuda (default when available; cuda:LOCAL_RANK) or cpu (gloo)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16 (default %(default)s)")
    ap.add_argument("--iters", type=int, default=20, help="calls per timing (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=10, help="timings per record (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="append JSON lines here (rank 0)")
    a = ap.parse_args(argv)
    bad = [d for d in a.dtypes.split(",") if d not in DTYPES]
    if bad:
        ap.error(f"--dtypes {a.dtypes!r}: {bad} unknown; choose from {sorted(DTYPES)}")
    for name in ("batch", "iters", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} {getattr(a, name)}: must be >= 1")
    return a


def bus_bandwidth(op: str, nbytes: int, seconds: float, world: int) -> float:
    """NCCL's bus bandwidth in GB/s of one collective: `nbytes` = this rank's input; all-reduce 2 (n-1)/n x
    bytes / time, all-gather (n-1) x bytes / time (nccl-tests' PERFORMANCE.md)."""
    factor = 2 * (world - 1) / world if op == "all_reduce" else world - 1
    return factor * nbytes / seconds / 1e9


def check(op: str, shape: tuple[int, int], dtype: torch.dtype, device, rank: int, world: int) -> bool:
    """One collective of `op` ("all_reduce" | "all_gather") on a [B, D] tensor of `dtype` filled with rank + 1
    (integers: exact in bf16 too): True when every element of this rank's result is right (sum 1 + .. + world;
    part r all r + 1)."""
    import torch.distributed as dist
    x = torch.full(shape, float(rank + 1), dtype=dtype, device=device)
    if op == "all_reduce":
        dist.all_reduce(x)
        return bool((x == world * (world + 1) // 2).all())
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return all(bool((p == r + 1).all()) for r, p in enumerate(parts))


def time_calls(call, iters: int, repeats: int, mode: str, device) -> float:
    """Seconds per call of the collective `call()`: the median over `repeats` of the mean of `iters` back-to-back
    calls, every rank starting after a barrier; `mode` "eager" (CUDA events; wall clock on the CPU) or "graph" (the
    iters calls captured in one CUDA graph after 3 warm-up calls on a side stream, then replayed; CUDA only)."""
    import torch.distributed as dist
    cuda = device.type == "cuda"
    if mode == "graph":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                       # NCCL warm-up outside the capture
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                call()
        run = g.replay
    else:
        for _ in range(3):
            call()

        def run():
            for _ in range(iters):
                call()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def main(argv=None) -> int:
    """Time every (message, dtype, mode) on every rank; rank 0 prints and appends the records. Returns 0, 1 when a
    check failed on any rank, 2 for world size 1, a vocabulary the world size does not divide, or a bad preset."""
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch.distributed as dist
    from k3deploy.model.config import load_config
    from k3deploy.runtime.distributed import init_from_env, resolve_device, shutdown
    device_arg = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        rank, world = init_from_env(device_arg)
        device = resolve_device(device_arg)
        cfg = load_config(a.preset)
        if world < 2:
            raise ValueError("world size 1: launch with torchrun --nproc-per-node N (N >= 2)")
        if cfg.vocab_size % world:
            raise ValueError(f"vocab_size {cfg.vocab_size} is not divisible by the world size {world}")
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        shutdown()
        return 2
    msgs = [("all_reduce", "hidden", (a.batch, cfg.hidden_size)),
            ("all_reduce", "latent", (a.batch, cfg.routed_expert_hidden_size)),
            ("all_gather", "logits", (a.batch, cfg.vocab_size // world))]
    modes = ["eager", "graph"] if device.type == "cuda" else ["eager"]
    ok, recs = True, []
    for op, what, shape in msgs:
        for dname in a.dtypes.split(","):
            dt = DTYPES[dname]
            good = check(op, shape, dt, device, rank, world)
            flag = torch.tensor([1.0 if good else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)               # correct only if every rank's result was
            good = bool(flag.item() == 1.0)
            ok &= good
            x = torch.randn(shape, device=device).to(dt)
            if op == "all_reduce":
                def call(x=x):
                    dist.all_reduce(x)
            else:
                parts = [torch.empty_like(x) for _ in range(world)]

                def call(x=x, parts=parts):
                    dist.all_gather(parts, x)
            nbytes = x.numel() * x.element_size()
            for mode in modes:
                t = time_calls(call, a.iters, a.repeats, mode, device)
                bus = bus_bandwidth(op, nbytes, t, world)
                recs.append({"bench": "collectives", "op": op, "message": what, "shape": list(shape), "dtype": dname,
                             "mode": mode, "tp": world, "backend": dist.get_backend(), "device": str(device),
                             "us": round(t * 1e6, 2), "bytes": nbytes, "algbw_gbs": round(nbytes / t / 1e9, 4),
                             "busbw_gbs": round(bus, 4), "correct": good})
                if rank == 0:
                    log.info("%s %s %s %s: %.1f us", op, what, dname, mode, t * 1e6)
    if rank == 0:
        lines = "".join(json.dumps(r) + "\n" for r in recs)
        sys.stdout.write(lines)
        if a.out is not None:
            with open(a.out, "a") as f:
                f.write(lines)
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
