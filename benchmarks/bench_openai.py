"""Serving benchmark: the OpenAI-compatible front (serve/openai.py) versus the Triton gRPC path alone, plus guidellm.

    python benchmarks/bench_openai.py --checkpoint CKPT --streams 1,8,32 --out openai.jsonl --plot openai.png
    python benchmarks/bench_openai.py --preset k3-tiny ...            # writes the synthetic checkpoint to a temp dir
    python benchmarks/bench_openai.py --checkpoint CKPT --device cuda --ops kernels --cuda-graphs ...   # on a GPU

What it does:
1. writes a Triton repository for the checkpoint (serve/repository.py; max_batch = the largest --streams) and starts
   tritonserver + the front (serve/launch.py: TritonServer, OpenAIFront), bound to 127.0.0.1;
2. for each concurrency C in --streams, one untimed request per client on each path (first prefills of that batch
   shape), then the two paths alternating --rounds times (the round of median ITL p50 is reported):
   * grpc: C concurrent clients, each sending --requests requests one after the other straight to the `k3` model over
     gRPC streaming (tritonclient.grpc.aio, TensorRT-LLM's tensors), P prompt tokens, T generated tokens
     (end_id -1: exactly T), return_log_probs;
   * front: the same prompts and lengths through `POST /v1/completions` (token-id prompt, stream, ignore_eos,
     logprobs 0, so that every token arrives in a chunk of its own), read as server-sent events with httpx;
   per request: TTFT (send -> first token) and the mean inter-token latency ITL = (last - first token) / (T - 1);
   per run: requests/s and generated tokens/s;
3. with guidellm (`--guidellm PATH`, default `guidellm` on PATH; skipped with a note when absent): `guidellm run`
   at concurrency C against the front's /v1/completions with the same T (prompts from a generated JSON file),
   its requests/s, TTFT and ITL medians.

Output: one JSON line per (path, C) on stdout and appended to --out: {"path": "grpc" | "front" | "guidellm",
"streams", "requests", "req_per_s", "tok_per_s", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "itl_ms_mean"}, and
per C a "front_vs_grpc" line: itl_overhead_ms (front - grpc, per token, p50), itl_overhead_pct (% of the gRPC path's
ITL p50, the bound the front cannot beat), itl_overhead_pct_mean (the same from the mean ITLs), ttft_overhead_ms, and front_cpu_ms_per_token (the front process's own CPU
time, /proc, per generated token) with front_cpu_pct_of_itl: on a machine whose cores the model also uses (a
2-core CPU box) the front's CPU time slows the model itself, so the ITL difference there is contention; the CPU
time is what the front costs wherever it runs. --plot draws ITL and TTFT per C for both paths.
The front's target: < 5% added ITL at 32 streams.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LOG = logging.getLogger("bench_openai")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def summarize(path: str, streams: int, reqs: list[dict], wall: float, out_tokens: int) -> dict:
    ttft = [r["ttft"] * 1e3 for r in reqs]
    itl = [r["itl"] * 1e3 for r in reqs if r["itl"] is not None]
    return {"path": path, "streams": streams, "requests": len(reqs), "req_per_s": len(reqs) / wall,
            "tok_per_s": len(reqs) * out_tokens / wall, "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p90": _pct(ttft, 0.9),
            "itl_ms_p50": _pct(itl, 0.5), "itl_ms_mean": statistics.fmean(itl) if itl else float("nan")}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timing(t0: float, times: list[float]) -> dict:
    return {"ttft": times[0] - t0, "itl": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None}


async def grpc_request(client, ids: list[int], n: int, rid: str) -> dict:
    """One request straight to the k3 model; arrival time of every token."""
    import numpy as np
    from tritonclient.grpc import InferInput

    def t(name, v, dtype, kind):
        a = np.asarray(v, dtype=dtype)
        x = InferInput(name, list(a.shape), kind)
        x.set_data_from_numpy(a)
        return x
    inputs = [t("input_ids", [ids], np.int32, "INT32"), t("input_lengths", [[len(ids)]], np.int32, "INT32"),
              t("request_output_len", [[n]], np.int32, "INT32"), t("streaming", [[True]], np.bool_, "BOOL"),
              t("end_id", [[-1]], np.int32, "INT32"), t("return_log_probs", [[True]], np.bool_, "BOOL")]

    async def reqs():
        yield {"model_name": "k3", "inputs": inputs, "request_id": rid}
    t0, times = time.perf_counter(), []
    it = client.stream_infer(reqs())
    try:
        async for result, error in it:
            if error is not None:
                raise RuntimeError(f"k3: {error}")
            out = result.as_numpy("output_ids")
            now = time.perf_counter()
            times += [now] * (0 if out is None else out.size)
            if len(times) >= n:
                break
    finally:
        it.cancel()
    return _timing(t0, times)


async def front_request(http, url: str, ids: list[int], n: int) -> dict:
    """The same request through the front's /v1/completions (SSE); arrival time of every token-carrying chunk,
    with the token count from the final usage."""
    body = {"model": "k3", "prompt": ids, "max_tokens": n, "stream": True, "ignore_eos": True, "temperature": 0,
            "logprobs": 0, "stream_options": {"include_usage": True}}
    t0, times, usage = time.perf_counter(), [], None
    async with http.stream("POST", url + "/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"front: HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            lp = obj["choices"][0].get("logprobs") if obj.get("choices") else None
            if lp:                                   # one entry per generated token
                times += [time.perf_counter()] * len(lp["tokens"])
    if usage is None or usage["completion_tokens"] != n or len(times) != n:
        raise RuntimeError(f"front: expected {n} tokens, usage {usage}, {len(times)} token chunks")
    return _timing(t0, times)


async def run_path(path: str, streams: int, prompts: list[list[int]], n: int, requests: int, grpc_url: str,
                   front_url: str) -> dict:
    try:
        import httpx2 as httpx          # the openai client's HTTP library in its newest releases
    except ImportError:
        import httpx
    from tritonclient.grpc import aio as grpcaio
    client = grpcaio.InferenceServerClient(grpc_url)
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    http = httpx.AsyncClient(timeout=600, limits=limits)
    results: list[dict] = []

    async def worker(w: int):
        for k in range(requests):
            ids = prompts[(w * requests + k) % len(prompts)]
            if path == "grpc":
                results.append(await grpc_request(client, ids, n, f"b{w}-{k}-{random.random()}"))
            else:
                results.append(await front_request(http, front_url, ids, n))
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(streams)))
        wall = time.perf_counter() - t0
    finally:
        await http.aclose()
        await client.close()
    return summarize(path, streams, results, wall, n)


def run_guidellm(exe: str, front_url: str, streams: int, prompts_text: list[str], n: int, requests: int,
                 workdir: Path) -> dict | None:
    data = workdir / "guidellm_prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "output_tokens_count": n}) + "\n" for p in prompts_text))
    out = workdir / f"guidellm_{streams}.json"
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={front_url[:-3]},request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={streams}", "--constraint",
           f"kind=max_requests,count={streams * requests}", "--data", f"kind=json_file,path={data}",
           "--disable-console-interactive", "--output", f"kind=json,path={out}"]
    LOG.info("guidellm: %s", " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0 or not out.is_file():
        LOG.warning("guidellm failed (%d): %s", r.returncode, r.stderr[-2000:])
        return None
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def med(key, scale=1.0):
        v = m.get(key, {}).get("successful", {})
        return v.get("median", float("nan")) * scale if v else float("nan")
    return {"path": "guidellm", "streams": streams, "requests": m["request_totals"]["successful"],
            "req_per_s": med("requests_per_second"), "tok_per_s": med("output_tokens_per_second"),
            "ttft_ms_p50": med("time_to_first_token_ms"), "itl_ms_p50": med("inter_token_latency_ms"),
            "tpot_ms_p50": med("time_per_output_token_ms")}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for p, style in (("grpc", "o-"), ("front", "s-"), ("guidellm", "^--")):
        pts = sorted((r["streams"], r) for r in rows if r.get("path") == p)
        if not pts:
            continue
        xs = [s for s, _ in pts]
        axes[0].plot(xs, [r["itl_ms_p50"] for _, r in pts], style, label=p)
        axes[1].plot(xs, [r["ttft_ms_p50"] for _, r in pts], style, label=p)
    for ax, t in zip(axes, ("inter-token latency p50 (ms)", "time to first token p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(t)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (with tiktoken.model)")
    src.add_argument("--preset", help="write this preset's synthetic checkpoint to a temporary directory first "
                                      "(drawn on --device)")
    ap.add_argument("--streams", default="1,8,32", help="concurrencies, comma-separated (default %(default)s)")
    ap.add_argument("--requests", type=int, default=2, help="requests per stream and round (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating grpc/front rounds; the median is reported")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default %(default)s)")
    ap.add_argument("--output-tokens", type=int, default=16, help="generated tokens per request (default %(default)s)")
    ap.add_argument("--max-context", type=int, default=1024, help="LLM(max_context) (default %(default)s)")
    ap.add_argument("--device", default=None, help="LLM(device): cpu (default) or cuda[:N]")
    ap.add_argument("--ops", default=None, help="LLM(ops): reference / torch / kernels")
    ap.add_argument("--cuda-graphs", action="store_true", help="LLM(cuda_graphs=True) (CUDA, --ops kernels)")
    ap.add_argument("--dense-dtype", default=None, help="LLM(dense_dtype): float32 or bfloat16")
    ap.add_argument("--guidellm", default=shutil.which("guidellm"), help="guidellm executable (default: on PATH)")
    ap.add_argument("--out", default=None, help="append the JSON lines here")
    ap.add_argument("--plot", default=None, help="write the ITL / TTFT plot here (PNG; needs matplotlib, the bench extra)")
    ap.add_argument("--workdir", default=None, help="keep the repository and logs here (default: temporary)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from k3deploy.runtime.tokenizer import Tokenizer
    from k3deploy.serve.launch import OpenAIFront, TritonServer, free_ports
    from k3deploy.serve.repository import write_repository
    streams = [int(s) for s in a.streams.split(",")]
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_openai_"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = Path(a.checkpoint) if a.checkpoint else work / "ckpt"
    if a.preset and not ckpt.is_dir():
        from k3deploy.model.config import load_config
        from k3deploy.model.synthetic import write_synthetic
        LOG.info("writing the %s synthetic checkpoint to %s", a.preset, ckpt)
        write_synthetic(load_config(a.preset), ckpt, progress=True, device=a.device or "cpu")
    tok = Tokenizer.from_file(ckpt / "tiktoken.model")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while models think and answer questions".split()
    texts = [" ".join(rng.choice(words) for _ in range(a.prompt_tokens * 2)) for _ in range(64)]
    prompts = [tok.encode(t)[:a.prompt_tokens] for t in texts]
    texts = [tok.decode(p) for p in prompts]
    repo = work / "repo"
    write_repository(ckpt, repo, "torch", max_batch=max(streams), max_context=a.max_context, overwrite=True,
                     device=a.device, ops=a.ops, cuda_graphs=a.cuda_graphs, dense_dtype=a.dense_dtype)
    h, g, m, p = free_ports(4)
    rows: list[dict] = []
    meta = {"host": platform.node(), "cpu_count": os.cpu_count(), "device": a.device or "cpu",
            "checkpoint": str(ckpt), "prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens}
    with TritonServer(repo, h, g, m, workdir=work / "triton", startup_timeout=1800) as srv, \
            OpenAIFront(srv.grpc_url, p, log_path=work / "front.log") as front:
        asyncio.run(run_path("grpc", 1, prompts, 2, 1, srv.grpc_url, front.url))          # warm-up
        asyncio.run(run_path("front", 1, prompts, 2, 1, srv.grpc_url, front.url))
        for c in streams:
            first = len(rows)
            per = {"grpc": [], "front": []}
            for path in ("grpc", "front"):            # untimed: first prefills of this batch shape, graph replays
                asyncio.run(run_path(path, c, prompts, a.output_tokens, 1, srv.grpc_url, front.url))
            for _ in range(a.rounds):
                for path in ("grpc", "front"):
                    cpu0 = cpu_seconds(front.pid)
                    r = asyncio.run(run_path(path, c, prompts, a.output_tokens, a.requests, srv.grpc_url, front.url))
                    if path == "front":              # the front's own CPU time per generated token
                        r["front_cpu_ms_per_token"] = 1e3 * (cpu_seconds(front.pid) - cpu0) / (
                            r["requests"] * a.output_tokens)
                    per[path].append(r)
            best = {}
            for path, runs in per.items():
                runs.sort(key=lambda r: r["itl_ms_p50"])
                best[path] = dict(runs[len(runs) // 2], **meta)
                rows.append(best[path])
            g_, f_ = best["grpc"], best["front"]
            rows.append({"path": "front_vs_grpc", "streams": c,
                         "front_cpu_ms_per_token": f_["front_cpu_ms_per_token"],
                         "front_cpu_pct_of_itl": 100 * f_["front_cpu_ms_per_token"] / g_["itl_ms_p50"],
                         "itl_overhead_ms": f_["itl_ms_p50"] - g_["itl_ms_p50"],
                         "itl_overhead_pct": 100 * (f_["itl_ms_p50"] / g_["itl_ms_p50"] - 1),
                         "itl_overhead_pct_mean": 100 * (f_["itl_ms_mean"] / g_["itl_ms_mean"] - 1),
                         "ttft_overhead_ms": f_["ttft_ms_p50"] - g_["ttft_ms_p50"], **meta})
            if a.guidellm:
                gl = run_guidellm(a.guidellm, front.url, c, texts, a.output_tokens, a.requests, work)
                if gl is not None:
                    rows.append(dict(gl, **meta))
            elif c == streams[0]:
                LOG.warning("guidellm not found (pip install guidellm, or --guidellm PATH): its rows are skipped")
            for r in rows[first:]:
                print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
