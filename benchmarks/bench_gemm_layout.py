"""The decode step's dense GEMMs in both weight layouts: row-major W [N, K] (the checkpoint's) against column-major
(a [N, K] view of a contiguous [K, N] tensor: what runtime/fused.py stores for the layer projections).

    python benchmarks/bench_gemm_layout.py --device cuda --out gemm_layout.jsonl --plot gemm_layout.png
    python benchmarks/bench_gemm_layout.py --device cpu --preset k3-tiny --rows 1,4 --iters 2   # the CPU smoke

The GEMMs are those of `runtime.fused.FusedModel` for one rank of `--preset` (shapes from the weight inventory,
`model.weights.all_tensors`; each concatenated group padded to 16 rows as the runtime pads it): per KDA layer the
input projection [q; k; v; g; f_a; b], f_b and o_proj; per MLA layer [q_a; kv_a; g], q_b and o_proj; per MoE layer
the router (fp32 output), [routed down; shared gate; shared up] and [routed up ‖ shared down]; per dense layer
[gate; up] and down; the head (fp32 output). For each GEMM and each row count M (`--rows`: decode batches and a
prefill chunk) a random bf16 x [M, K] times the weight in each layout, through `torch.mm` as the runtime calls it,
timed as the median of `--iters` calls (on CUDA: CUDA graphs of 20 calls each, after a warm-up) with the bound
(weight + activation bytes at the device's copy rate measured in the same run; CUDA only).

Output: one JSON line per (GEMM, M) on stdout and appended to `--out` ({bench, gpu, torch, copy_GBps, name, N, K,
M, calls (per decode step), row_us, col_us, bound_us}), then one line per M summing calls x time over the step
(`name` "step"); `--plot PNG` draws row / col time per GEMM and M. Exit status 0, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from k3deploy.model.config import load_config  # noqa: E402
from k3deploy.model.weights import PREFIX, all_tensors  # noqa: E402

log = logging.getLogger("bench_gemm_layout")

# GEMM name -> (layers it runs in, how runtime/fused.py builds its weight, weight-name suffixes): "cat" = rows
# concatenated and padded to 16 (`_fuse_linears`), "one" = one weight as it is, "cols" = columns concatenated
GROUPS = {
    "kda_in": ("kda", "cat", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.g_proj",
                              "self_attn.f_a_proj", "self_attn.b_proj"]),
    "kda_f_b": ("kda", "one", ["self_attn.f_b_proj"]),
    "kda_o": ("kda", "one", ["self_attn.o_proj"]),
    "mla_in": ("mla", "cat", ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.g_proj"]),
    "mla_q_b": ("mla", "one", ["self_attn.q_b_proj"]),
    "mla_o": ("mla", "one", ["self_attn.o_proj"]),
    "moe_router": ("moe", "one", ["block_sparse_moe.gate"]),
    "moe_mid": ("moe", "cat", ["block_sparse_moe.routed_expert_down_proj", "block_sparse_moe.shared_experts.gate_proj",
                               "block_sparse_moe.shared_experts.up_proj"]),
    "moe_out": ("moe", "cols", ["block_sparse_moe.routed_expert_up_proj",
                                "block_sparse_moe.shared_experts.down_proj"]),
    "dense_gu": ("dense", "cat", ["mlp.gate_proj", "mlp.up_proj"]),
    "dense_down": ("dense", "one", ["mlp.down_proj"]),
}
FP32_OUT = {"moe_router", "lm_head"}           # GEMMs with an fp32 result (torch.mm's out_dtype), kept row-major


def _runs_in(cfg, layer: int, kind: str) -> bool:
    if kind in ("kda", "mla"):
        return cfg.layer_kind(layer) == kind
    return cfg.is_moe(layer) == (kind == "moe")


def step_gemms(cfg) -> dict[str, tuple[int, int, int]]:
    """{name: (N, K, calls per decode step)} of the fused runtime's GEMMs for `cfg` (module docstring; weights a
    layer lacks, such as absent shared experts, are left out of its group)."""
    specs = all_tensors(cfg)
    shapes = {s.name: tuple(s.shape) for s in specs if s.expert is None}
    out: dict[str, tuple[int, int, int]] = {}
    for l in range(cfg.num_hidden_layers):
        for name, (kind, how, parts) in GROUPS.items():
            ws = [shapes[n] for n in (f"{PREFIX}model.layers.{l}.{p}.weight" for p in parts) if n in shapes]
            if not _runs_in(cfg, l, kind) or not ws:
                continue
            if how == "cols":
                N, K = ws[0][0], sum(w[1] for w in ws)
            else:
                N, K = sum(w[0] for w in ws), ws[0][1]
                N = -(-N // 16) * 16 if how == "cat" else N
            out[name] = (N, K, out.get(name, (0, 0, 0))[2] + 1)
    head = next(tuple(s.shape) for s in specs if s.name.endswith("lm_head.weight"))
    out["lm_head"] = (head[0], head[1], 1)
    return out


def _mm(x: torch.Tensor, w: torch.Tensor, fp32: bool) -> torch.Tensor:
    if fp32 and x.is_cuda:
        return torch.mm(x, w.t(), torch.float32)
    return torch.mm(x, w.t())


def time_us(fn, device: torch.device, iters: int) -> float:
    """Median µs of one call of `fn` over `iters` timings (CUDA: graphs of 20 calls, CUDA events)."""
    fn()
    if device.type != "cuda":
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6
    from bench_common import capture_graph      # benchmarks/, this script's folder
    reps = 20
    g = capture_graph([fn] * reps)
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts)


def run(preset: str, rows: list[int], device: torch.device, iters: int) -> list[dict]:
    """Records of the module docstring for `preset` at each M in `rows`."""
    cfg = load_config(preset)
    gemms = step_gemms(cfg)
    bw = None
    if device.type == "cuda":
        from bench_common import copy_rate_gbps
        bw = copy_rate_gbps(device)
    meta = {"bench": "gemm_layout", "preset": preset, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "copy_GBps": round(bw, 1) if bw else None}
    recs = []
    g = torch.Generator(device=device).manual_seed(0)
    for name, (N, K, calls) in gemms.items():
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=g)
        wc = w.t().contiguous().t()
        fp32 = name in FP32_OUT
        for M in rows:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g)
            ref, got = _mm(x, w, fp32).float(), _mm(x, wc, fp32).float()
            err = float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-30))
            if err > 2e-2:
                raise RuntimeError(f"{name} M={M}: the layouts disagree (max rel. error {err:.3g})")
            r = time_us(lambda: _mm(x, w, fp32), device, iters)
            c = time_us(lambda: _mm(x, wc, fp32), device, iters)
            bound = (N * K + M * (N + K)) * 2 / (bw * 1e3) if bw else None
            rec = dict(meta, name=name, N=N, K=K, M=M, calls=calls, row_us=round(r, 2), col_us=round(c, 2),
                       bound_us=round(bound, 2) if bound else None)
            recs.append(rec)
            log.info("%-10s N=%6d K=%6d M=%5d  row-major %8.1f us  column-major %8.1f us  (%.2fx)%s", name, N, K, M,
                     r, c, r / c, f"  bound {bound:.1f} us" if bound else "")
        del w, wc
    for M in rows:                               # the step: calls x time, the head in its row-major layout
        part = [r for r in recs if r["M"] == M]
        recs.append(dict(meta, name="step", M=M,
                         row_us=round(sum(r["calls"] * r["row_us"] for r in part), 1),
                         col_us=round(sum(r["calls"] * (r["row_us"] if r["name"] in FP32_OUT else r["col_us"])
                                          for r in part), 1),
                         bound_us=round(sum(r["calls"] * r["bound_us"] for r in part), 1) if bw else None))
    return recs


def plot(recs: list[dict], path: Path) -> None:
    """Row-major / column-major time per GEMM (bars), one panel per M."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted({r["M"] for r in recs})
    fig, axes = plt.subplots(1, len(rows), figsize=(4.5 * len(rows), 4), squeeze=False)
    for ax, M in zip(axes[0], rows):
        part = [r for r in recs if r["M"] == M and r["name"] != "step"]
        ax.bar(range(len(part)), [r["row_us"] / r["col_us"] for r in part])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(part)), [r["name"] for r in part], rotation=60, ha="right", fontsize=8)
        ax.set_title(f"M = {M}")
        ax.set_ylabel("row-major time / column-major time")
    fig.suptitle(f"{recs[0]['preset']} GEMMs, {recs[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    """The CLI (module docstring). Returns the exit status."""
    head, rest = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(description=head, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest)
    ap.add_argument("--preset", default="k3-slice", help="model preset (default k3-slice; k3-tp8-rank: one TP=8 rank)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (or cuda:N) or cpu (default: %(default)s, cuda where a GPU is present)")
    ap.add_argument("--rows", default="1,16,64,8192", help="comma-separated row counts M (default 1,16,64,8192)")
    ap.add_argument("--iters", type=int, default=5, help="timings per point, median (default 5)")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of the records")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rows = [int(v) for v in a.rows.split(",") if v]
    except ValueError:
        ap.error(f"--rows {a.rows!r}: give comma-separated positive integers, e.g. 1,16,64")
    if not rows or min(rows) < 1:
        ap.error(f"--rows {a.rows!r}: give comma-separated positive integers, e.g. 1,16,64")
    if a.iters < 1:
        ap.error(f"--iters {a.iters}: time at least once")
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install -e '.[bench]'")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        ap.error(f"--device {a.device}: use cuda, cuda:N or cpu")
    if device.type not in ("cuda", "cpu"):
        ap.error(f"--device {a.device}: use cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here (use --device cpu)")
    try:
        load_config(a.preset)
    except (ValueError, FileNotFoundError, KeyError) as e:
        ap.error(f"--preset {a.preset}: {e}")
    recs = run(a.preset, rows, device, a.iters)
    with open(a.out, "a") if a.out else contextlib.nullcontext() as f:
        for r in recs:
            line = json.dumps(r)
            sys.stdout.write(line + "\n")
            if f is not None:
                f.write(line + "\n")
    if a.plot:
        plot(recs, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
