"""Plot decode step time per bench_decode record (TP, eager / CUDA graphs, and ops and batch where they vary).

    python benchmarks/plot_decode_tp.py benchmarks/results/decode_k3slice_fused-h200.jsonl \\
        --out benchmarks/results/decode_k3slice_fused-h200.png

One bar per record (label: TP, eager/graphs, ops and B where the records differ): the median step time, split into the GPU time of the NCCL kernels
(from --kernel-profile; waiting for the slower rank included), the other kernels' GPU time, and the rest of the
step (the GPU idle: host launches, Python, sampling); see `parts`. Records without a kernel profile (e.g. CPU
runs) are drawn as one grey bar; matplotlib is needed (`pip install matplotlib`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def parts(rec: dict) -> tuple[float, float, float]:
    """(nccl_ms, compute_ms, idle_ms) summing to the unprofiled median step: compute = the profiled GPU time of the
    non-NCCL kernels (profiling does not slow the kernels); the rest of the step is NCCL kernel time (as far as the
    profiled NCCL time reaches: it includes waiting for the slower rank) and then GPU idle (host-bound)."""
    step = rec["step_ms_median"]
    kp = rec.get("kernel_profile")
    if not kp or not kp.get("gpu_busy_ms_per_step"):
        return 0.0, 0.0, step
    nccl = kp.get("nccl_ms_per_step")                     # all NCCL kernels; older records: the top list only
    if nccl is None:
        nccl = sum(v["ms_per_step"] for k, v in kp["top"].items() if k.startswith("ncclDevKernel"))
    compute = min(max(kp["gpu_busy_ms_per_step"] - nccl, 0.0), step)
    rest = step - compute
    return min(nccl, rest), compute, rest - min(nccl, rest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", nargs="+", type=Path, help="bench_decode --out files")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    a = ap.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        ap.error("needs matplotlib: pip install -e '.[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [json.loads(line) for p in a.jsonl for line in p.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r.get("bench") == "decode"]
    if not recs:
        ap.error("no bench_decode records (\"bench\": \"decode\") in the given files")
    varies = {k for k in ("ops", "batch") if len({r.get(k) for r in recs}) > 1}
    labels = [f"TP={r['tp']} {'graphs' if r.get('cuda_graphs') else 'eager'}"
              + (" bf16" if r.get("dense_dtype") == "bfloat16" else "")        # no dense_dtype: fp32
              + (f"\n{r['ops']}" if "ops" in varies else "") + (f" B={r['batch']}" if "batch" in varies else "")
              + (f" {r['label']}" if r.get("label") else "") + f"\n{r['step_ms_median']:.2f} ms" for r in recs]
    nccl, gpu, idle = zip(*(parts(r) for r in recs))
    fig, ax = plt.subplots(figsize=(1.6 * len(recs) + 2, 4.5))
    x = range(len(recs))
    ax.bar(x, gpu, label="GPU kernels other than NCCL")
    ax.bar(x, nccl, bottom=gpu, label="NCCL kernels (incl. waiting for the other ranks)")
    ax.bar(x, idle, bottom=[g + n for g, n in zip(gpu, nccl)], label="GPU idle (host-bound)", color="lightgrey")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("decode step, ms (median)")
    r0 = recs[0]
    where = r0.get("gpu") or r0.get("device", "")
    ax.set_title(f"{r0['model']} decode" + ("" if "batch" in varies else f", B={r0['batch']}")
                 + f", prompt {r0['prompt_len']}" + ("" if "ops" in varies else f", ops {r0['ops']}") + f" ({where})",
                 fontsize=9)
    ax.set_ylim(0, 1.3 * max(r["step_ms_median"] for r in recs))
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    import io
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from k3deploy.engines.manifest import atomic_write_bytes
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    atomic_write_bytes(a.out, buf.getbuffer())
    for lab, n, g, i in zip(labels, nccl, gpu, idle):
        print(f"{lab.replace(chr(10), ' '):32s} gpu {g:6.2f}  nccl {n:6.2f}  idle {i:6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
