"""Regenerate results/roofline.png from a bench jsonl (checked kernels only).
Usage: python benchmarks/plot_roofline.py results/h200_run3.jsonl [--final-defaults]
--final-defaults: for run 3, plot the variant that the code's defaults now select where they were changed after
the run (MLA 96 heads: {"block_h": 64}; MoE: {"impl": "legacy", block_n 128}); each is a measurement of that
same run (correctness-checked there), taken with explicit arguments."""
import json, os, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
final = "--final-defaults" in sys.argv
recs = [json.loads(l) for l in open(path)]
copy = next(r["GBps"] for r in recs if r["what"] == "copy")
rows = []
for r in recs:
    if "pct_copy" not in r or not r.get("correct") or r.get("us") != r.get("us"):
        continue
    us = r["us"]
    if final and r["what"] == "mla_decode" and r["H"] > 16:
        us = r["variants"].get('{"block_h": 64}', us)
    if final and r["what"] == "mxfp4_moe":
        us = r["variants"].get('{"impl": "legacy", "block_n13": 128, "block_n2": 128}', us)
    pct = 100 * r["bytes"] / us / 1e3 / copy
    lab = r["what"] + " " + ",".join(f"{k}={r[k]}" for k in ("H", "B", "L", "T") if k in r)
    rows.append((lab, pct))
fig, ax = plt.subplots(figsize=(10, 5))
ax.barh(range(len(rows)), [p for _, p in rows])
ax.axvline(100, color="k", ls="--", lw=1); ax.axvline(85, color="g", ls=":", lw=1); ax.axvline(70, color="r", ls=":", lw=1)
ax.set_yticks(range(len(rows))); ax.set_yticklabels([l for l, _ in rows], fontsize=7)
ax.set_xlabel(f"% of measured copy bandwidth ({copy / 1e3:.2f} TB/s), bytes = compulsory HBM traffic")
ax.set_title("k3deploy Triton kernels on H200 (run 3, final defaults): memory roofline fraction")
fig.tight_layout(); fig.savefig(os.path.join(os.path.dirname(path), "roofline.png"), dpi=110)
for l, p in rows:
    print(f"{p:6.1f}%  {l}")
