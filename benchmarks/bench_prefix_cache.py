"""Prefix-caching benchmark of the runtime (torch backend): TTFT and throughput with caching on and off.

    python benchmarks/bench_prefix_cache.py --preset k3-slice --device cuda --out prefix.jsonl --plot prefix.png
    python benchmarks/bench_prefix_cache.py --preset k3-tiny --device cpu --turns 3 --history 96 --reply-len 4 \\
        --users 3 --system-len 32 --question-len 8 --snapshot-interval 16 --max-num-tokens 64   # CPU, seconds

The model is built once (`model.synthetic` weights drawn on the device, as benchmarks/bench_decode.py does, or
`--checkpoint`); every scenario runs the real scheduler (`runtime.scheduler.Scheduler`, `runtime.cache.HybridCache`,
greedy sampling) on a fresh cache, once with prefix caching off and once on (`--snapshot-interval`, default 1024
tokens; `--num-snapshots`, default 2 x max batch), after an untimed warm-up (Triton compiles and autotuning):

1. conversation: `--turns` turns of one user whose history grows by history/turns tokens per turn (a new user
   message, then a `--reply-len`-token reply) up to `--history` tokens; turn t's prompt is the whole history so
   far plus the new message, as a chat client re-sends it. Per turn: prompt tokens, tokens served from the cache
   (`num_cached_tokens`), TTFT (submit to first token, device synchronized) on and off and their ratio, and the
   bound of that ratio if prefill time scaled with the tokens computed (prompt / uncached tokens);
2. shared: `--users` users with one `--system-len`-token system prompt and their own `--question-len`-token
   question, `--reply-len` tokens each; the first user runs alone (it computes the system prompt; with caching it
   leaves snapshots every `--snapshot-interval` tokens), then the others arrive together. TTFT median / p90 and
   max of the others, wall time and generated tokens/s of the whole scenario;
3. snapshot cost: a cold `--cold-len`-token prompt (nothing to reuse) prefilled with caching off and on, `--repeats`
   times each alternately: the median extra prefill time with caching on (the KDA copies into the snapshot pool,
   taken inside the prefill step at each snapshot position, and the hash chain) as a share of the off time
   (target < 3 %), the prefill steps each took (the same number: a snapshot costs no step of its own), and the
   time of the copies made between steps alone (synchronized around each, in a separate run; the copies inside a
   step are part of that step's time).

Output: one JSON line per scenario on stdout (and appended to `--out`): the run's settings, {"scenario":
"conversation", "turns": [...], "ttft_ratio_first_turn_at_8k": ...}, {"scenario": "shared", "off": {...}, "on": {...}},
{"scenario": "snapshot_cost", ...}; `--plot FILE` draws TTFT per turn on and off (needs matplotlib, the `bench`
extra). Targets (docs/PREFIX_CACHING.md): >= 5x lower TTFT from the second turn at 8K history; snapshots < 3 %
of prefill time. Exit status 0, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

log = logging.getLogger("bench_prefix_cache")


def parse_args(argv=None):
    """The command line (see the module docstring); argparse exits with status 2 on a bad value."""
    from k3deploy.model.layers import DENSE_DTYPES, dense_dtype_name
    ap = argparse.ArgumentParser(prog="benchmarks/bench_prefix_cache.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    m = ap.add_argument_group("model")
    m.add_argument("--preset", default="k3-slice", help="config preset (k3-tiny, k3-slice) or config.json path; "
                   "weights drawn on the device (default %(default)s)")
    m.add_argument("--checkpoint", type=Path, default=None, help="load this checkpoint instead (overrides --preset)")
    m.add_argument("--seed", type=int, default=0, help="synthetic weight seed and prompt seed (default %(default)s)")
    m.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    m.add_argument("--ops", default=None, help="torch (Triton kernels; CUDA default), kernels (in place), reference "
                   "(fp32; CPU default)")
    m.add_argument("--dense-dtype", default=None, type=dense_dtype_name, choices=list(DENSE_DTYPES),
                   help="dense weights and GEMMs (default bfloat16 on CUDA, as deployed; float32 on the CPU)")
    m.add_argument("--cuda-graphs", action="store_true", help="decode steps replay CUDA graphs (ops kernels)")
    r = ap.add_argument_group("runtime")
    r.add_argument("--block-size", type=int, default=None, help="latent block size (default 64 on CUDA, 16 on the CPU)")
    r.add_argument("--max-num-tokens", type=int, default=8192, help="prefill tokens per step (default %(default)s)")
    r.add_argument("--max-batch", type=int, default=None, help="running requests (default: --users)")
    r.add_argument("--snapshot-interval", type=int, default=None,
                   help="tokens between periodic KDA snapshots (default 1024 rounded up to a block multiple)")
    r.add_argument("--num-snapshots", type=int, default=None, help="snapshot pool rows (default 2 x max batch)")
    s = ap.add_argument_group("scenarios")
    s.add_argument("--scenarios", default="conversation,shared,snapshot_cost",
                   help="comma-separated subset of conversation, shared, snapshot_cost (default all)")
    s.add_argument("--turns", type=int, default=16, help="conversation turns (default %(default)s)")
    s.add_argument("--history", type=int, default=16384, help="conversation tokens after the last turn (default %(default)s)")
    s.add_argument("--reply-len", type=int, default=32, help="tokens generated per turn / user (default %(default)s)")
    s.add_argument("--users", type=int, default=32, help="users of the shared scenario (default %(default)s)")
    s.add_argument("--system-len", type=int, default=4096, help="shared system prompt tokens (default %(default)s)")
    s.add_argument("--question-len", type=int, default=128, help="each user's own tokens (default %(default)s)")
    s.add_argument("--cold-len", type=int, default=6000,
                   help="snapshot cost: prompt tokens (default %(default)s: one chunk of --max-num-tokens 8192 with "
                        "snapshots inside it at every multiple of the interval, 1024 ... 5120)")
    s.add_argument("--repeats", type=int, default=3, help="snapshot cost: runs per mode (default %(default)s)")
    o = ap.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    o.add_argument("--plot", type=Path, default=None, help="PNG of TTFT per conversation turn, on and off")
    o.add_argument("--label", default=None, help="free text stored in each record")
    o.add_argument("-v", "--verbose", action="store_true", help="log every library's INFO lines too")
    a = ap.parse_args(argv)
    for name in ("turns", "history", "reply_len", "users", "system_len", "question_len", "cold_len", "repeats",
                 "max_num_tokens", "block_size", "max_batch", "snapshot_interval", "num_snapshots"):
        v = getattr(a, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} = {v}: must be >= 1")
    if a.history // a.turns <= a.reply_len:
        ap.error(f"--history {a.history} / --turns {a.turns} = {a.history // a.turns} tokens per turn: must exceed "
                 f"--reply-len {a.reply_len} (each turn adds a user message and a reply)")
    bad = set(a.scenarios.split(",")) - {"conversation", "shared", "snapshot_cost"}
    if bad:
        ap.error(f"--scenarios: unknown {sorted(bad)}; choose from conversation, shared, snapshot_cost")
    return a


class Bench:
    """One model, schedulers on fresh caches (caching on or off), timed with device synchronization."""

    def __init__(self, a, executor):
        self.a, self.ex, self.dev = a, executor, executor.device
        self.rng = torch.Generator().manual_seed(1000 + a.seed)
        per_turn = a.history // a.turns
        need = max(a.history + a.reply_len, a.users * (a.system_len + a.question_len + a.reply_len), a.cold_len)
        self.max_context = max(a.history, a.system_len + a.question_len, a.cold_len) + a.reply_len + per_turn
        self.num_blocks = 1 + 2 * math.ceil(need / a.block_size) + a.users     # room for the cached prefixes too
        self.max_batch = a.max_batch or a.users

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(3, self.ex.cfg.vocab_size, (n,), generator=self.rng).tolist()

    def scheduler(self, caching: bool):
        from k3deploy.runtime.cache import HybridCache
        from k3deploy.runtime.prefix_cache import default_num_snapshots
        from k3deploy.runtime.scheduler import Scheduler
        a = self.a
        rows = (a.num_snapshots or default_num_snapshots(self.max_batch)) if caching else 0
        cache = HybridCache(self.ex.cfg, self.max_batch + 1, self.num_blocks, a.block_size, self.ex.tp,
                            self.ex.act_dtype, self.dev, self.max_context, rows,
                            a.snapshot_interval if caching else None)
        if a.cuda_graphs:
            self.ex.enable_cuda_graphs(cache.pools, self.max_batch, math.ceil(self.max_context / a.block_size))
        return Scheduler(self.ex, cache, self.max_batch, a.max_num_tokens, eos_token_id=-1)

    def run(self, sched, prompts: dict[str, list[int]], n: int, arrive: dict[str, float] | None = None) -> dict:
        """Submit `prompts` (all now), step until done. Returns {rid: {"ttft_s", "tokens", "cached"}}, "wall_s" and
        "prefill_steps" (prefill forwards)."""
        from k3deploy.runtime.sampling import SamplingParams
        out, reqs, first, errors = {}, {}, {}, []
        prefills, forward = [], self.ex.forward

        def counting(ids, batch, *args, **kw):
            prefills.append(not batch.decode)
            return forward(ids, batch, *args, **kw)
        self.ex.forward = counting
        self.sync()
        t0 = time.perf_counter()

        def cb(rid):
            def on_token(tok, finished, error):
                if error:
                    errors.append(f"{rid}: {error}")
                if tok is not None:
                    if rid not in first:
                        self.sync()
                        first[rid] = time.perf_counter()
                    out.setdefault(rid, []).append(tok)
            return on_token
        for rid, p in prompts.items():
            reqs[rid] = sched.add(rid, p, SamplingParams(max_tokens=n, ignore_eos=True), cb(rid))
        try:
            sched.run_until_done()
            self.sync()
        finally:
            del self.ex.forward                   # the executor's own method again
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]}")
        res = {rid: {"ttft_s": first[rid] - t0, "tokens": out[rid], "cached": reqs[rid].num_cached_tokens}
               for rid in prompts}
        res["wall_s"], res["prefill_steps"] = wall, sum(prefills)
        return res

    def close(self, sched) -> None:
        for rid in list(sched.requests):
            sched.cancel(rid)
        if self.a.cuda_graphs:
            self.ex.close()


def warmup(b: Bench) -> None:
    """Compile and autotune outside the timed runs: a long prefill, decode steps, a restored second turn, and the
    shared scenario's batch of users (decode at that batch size, restores into many slots)."""
    sched = b.scheduler(True)
    p = b.tokens(min(b.a.cold_len, 2 * b.a.max_num_tokens, b.max_context - 8))
    r = b.run(sched, {"w": p}, 4)
    b.run(sched, {"w2": p + r["w"]["tokens"] + b.tokens(3)}, 4)
    b.run(sched, {f"w{i + 3}": p[: 2 * b.a.block_size] + b.tokens(3) for i in range(b.max_batch)}, 4)
    b.close(sched)


def conversation(b: Bench) -> dict:
    a = b.a
    per_turn = a.history // a.turns
    messages = [b.tokens(per_turn - a.reply_len) for _ in range(a.turns)]
    rows: list[dict] = [{} for _ in range(a.turns)]
    for caching in (False, True):
        sched, hist = b.scheduler(caching), []
        mode = "on" if caching else "off"
        for t in range(a.turns):
            prompt = hist + messages[t]
            r = b.run(sched, {"turn": prompt}, a.reply_len)["turn"]
            rows[t].update({"turn": t + 1, "prompt_tokens": len(prompt), f"ttft_s_{mode}": round(r["ttft_s"], 5)})
            if caching:
                rows[t]["cached_tokens"] = r["cached"]
            hist = prompt + r["tokens"]
            log.info("conversation %s turn %d: %d tokens, TTFT %.4f s, %d cached", mode, t + 1, len(prompt),
                     r["ttft_s"], r["cached"])
        b.close(sched)
    for row in rows:
        row["ttft_ratio"] = round(row["ttft_s_off"] / row["ttft_s_on"], 3)
        computed = row["prompt_tokens"] - row["cached_tokens"]
        row["ratio_bound"] = round(row["prompt_tokens"] / computed, 3)
        row["ratio_pct_of_bound"] = round(100 * row["ttft_ratio"] / row["ratio_bound"], 1)
    at8k = next((r for r in rows[1:] if r["prompt_tokens"] >= 8192), None)
    return {"scenario": "conversation", "turns": rows,
            "ttft_ratio_first_turn_at_8k": at8k["ttft_ratio"] if at8k else None,
            "ttft_ratio_min_from_turn_2": min((r["ttft_ratio"] for r in rows[1:]), default=None),
            "target_ratio": 5.0}


def shared(b: Bench) -> dict:
    a = b.a
    system = b.tokens(a.system_len)
    prompts = {f"u{i}": system + b.tokens(a.question_len) for i in range(a.users)}
    res = {"scenario": "shared", "users": a.users}
    for caching in (False, True):
        sched = b.scheduler(caching)
        first = b.run(sched, {"u0": prompts["u0"]}, a.reply_len)
        rest = b.run(sched, {k: v for k, v in prompts.items() if k != "u0"}, a.reply_len)
        ttfts = sorted(rest[k]["ttft_s"] for k in prompts if k != "u0") or [0.0]
        wall = first["wall_s"] + rest["wall_s"]
        res["on" if caching else "off"] = {
            "first_user_ttft_s": round(first["u0"]["ttft_s"], 5),
            "ttft_median_s": round(statistics.median(ttfts), 5),
            "ttft_p90_s": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 5),
            "ttft_max_s": round(ttfts[-1], 5), "wall_s": round(wall, 4),
            "generated_tokens_per_s": round(a.users * a.reply_len / wall, 1),
            "cached_tokens": sum(rest[k]["cached"] for k in prompts if k != "u0"),
            "prefix_metrics": sched.cache.prefix_metrics() or None}
        log.info("shared %s: TTFT median %.4f s, wall %.3f s", "on" if caching else "off",
                 res["on" if caching else "off"]["ttft_median_s"], wall)
        b.close(sched)
    res["ttft_median_ratio"] = round(res["off"]["ttft_median_s"] / res["on"]["ttft_median_s"], 3)
    res["throughput_ratio"] = round(res["on"]["generated_tokens_per_s"] / res["off"]["generated_tokens_per_s"], 3)
    return res


def snapshot_cost(b: Bench) -> dict:
    a = b.a
    times = {False: [], True: []}
    snaps, steps = 0, {}
    for i in range(a.repeats):
        p = b.tokens(a.cold_len)                     # fresh tokens: nothing to reuse
        for caching in (False, True):
            sched = b.scheduler(caching)
            r = b.run(sched, {"c": p}, 1)
            times[caching].append(r["c"]["ttft_s"])
            steps[caching] = r["prefill_steps"]
            if caching:
                snaps = sched.cache.prefix_stats["snapshots_taken"]
            b.close(sched)
    # the copies between steps alone: synchronized around each of one more cold prefill
    sched, copy_s = b.scheduler(True), []

    def timed(fn):
        def call(*args, **kw):
            b.sync()
            t = time.perf_counter()
            out = fn(*args, **kw)
            b.sync()
            copy_s.append(time.perf_counter() - t)
            return out
        return call
    sched.cache.publish, sched.cache.stage = timed(sched.cache.publish), timed(sched.cache.stage)
    b.run(sched, {"c": b.tokens(a.cold_len)}, 1)
    b.close(sched)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"scenario": "snapshot_cost", "cold_tokens": a.cold_len, "repeats": a.repeats,
            "prefill_s_off": round(off, 5), "prefill_s_on": round(on, 5),
            "overhead_pct": round(100 * (on - off) / off, 2), "snapshots_per_prefill": snaps,
            "prefill_steps_off": steps[False], "prefill_steps_on": steps[True],
            "snapshot_copy_ms_total": round(1e3 * sum(copy_s), 4),
            "snapshot_copy_pct": round(100 * sum(copy_s) / off, 2), "target_pct": 3.0}


def plot(path: Path, conv: dict, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = conv["turns"]
    x = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["ttft_s_off"] * 1e3 for r in rows], "o-", label="prefix caching off")
    ax.plot(x, [r["ttft_s_on"] * 1e3 for r in rows], "o-", label="prefix caching on")
    ax.set_xlabel("prompt tokens (conversation history)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import build_model, weights_label
    from k3deploy.model.config import load_config
    from k3deploy.runtime.distributed import resolve_device
    from k3deploy.runtime.executor import TorchExecutor, preferred_block_size
    from k3deploy.runtime.prefix_cache import default_snapshot_interval
    try:
        device = resolve_device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        a.dense_dtype = a.dense_dtype or ("bfloat16" if device.type == "cuda" else "float32")
        a.ops = a.ops or ("torch" if device.type == "cuda" else "reference")      # the executor's defaults
        a.ep = 1
        cfg = load_config(a.checkpoint if a.checkpoint is not None else a.preset)
        a.block_size = a.block_size or preferred_block_size(device, "kernels")
        if a.snapshot_interval is not None and a.snapshot_interval % a.block_size:
            raise ValueError(f"--snapshot-interval {a.snapshot_interval}: must be a multiple of --block-size "
                             f"{a.block_size}")
        if a.cuda_graphs and (device.type != "cuda" or a.ops != "kernels"):
            raise ValueError("--cuda-graphs: needs a CUDA device and --ops kernels")
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = build_model(a, cfg, 0, 1, device, None)
    executor = TorchExecutor(model, ops=a.ops)
    executor.check_block_size(a.block_size)
    build_s = time.perf_counter() - t0
    log.info("model %s built on %s in %.1f s (ops %s, dense %s)", cfg.name, device, build_s, executor.ops_name,
             a.dense_dtype)
    b = Bench(a, executor)
    base = {"bench": "prefix_cache", "model": str(a.checkpoint) if a.checkpoint else cfg.name,
            "weights": weights_label(a, device), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__, "ops": executor.ops_name, "dense_dtype": a.dense_dtype,
            "cuda_graphs": a.cuda_graphs, "block_size": a.block_size, "max_num_tokens": a.max_num_tokens,
            "max_batch": b.max_batch, "reply_len": a.reply_len, "build_s": round(build_s, 2), "label": a.label}
    t = time.perf_counter()
    warmup(b)
    log.info("warm-up %.1f s", time.perf_counter() - t)
    records = []
    with torch.no_grad():
        for name in a.scenarios.split(","):
            t = time.perf_counter()
            rec = {**base, **{"conversation": conversation, "shared": shared, "snapshot_cost": snapshot_cost}[name](b)}
            rec["snapshot_interval"] = a.snapshot_interval or default_snapshot_interval(a.block_size)
            rec["seconds"] = round(time.perf_counter() - t, 2)
            rec["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            records.append(rec)
            line = json.dumps(rec)
            print(line, flush=True)
            if a.out is not None:
                a.out.parent.mkdir(parents=True, exist_ok=True)
                with a.out.open("a") as f:
                    f.write(line + "\n")
    conv = next((r for r in records if r["scenario"] == "conversation"), None)
    if a.plot is not None and conv is not None:
        plot(a.plot, conv, f"{base['model']} on {base['gpu']}: TTFT per turn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
