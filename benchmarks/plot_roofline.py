"""Roofline plot from bench_kernels.py JSON lines: left, % of the copy bandwidth measured in the same run; right, the
roofline itself — arithmetic intensity (FLOP per compulsory HBM byte) against achieved TFLOP/s, under the measured
copy bandwidth's slope and the H200's bf16 dense tensor-core peak (989 TFLOP/s, NVIDIA's specification, not measured).
FLOPs per record (`flops_of`; K3's shapes): KDA decode 7 x B x H x 128 x 128 (state decay, k^T S, the rank-1 update,
S q), MLA absorbed decode 2 x B x H x L x (576 + 512) (scores over R + Dr, values over R), MXFP4 MoE 2 x 3 x pairs x
I x R (w13 and w2; I x R from the record's weight bytes per touched expert at 0.53125 bytes per weight, pairs = the
record's local_pairs, else T x 16 when every choice is local).

Usage: python benchmarks/plot_roofline.py RUN.jsonl [RUN2.jsonl ...] [--only WHAT,..] [--drop WHAT:KEY=VALUE]
        [--title TEXT] [--out results/roofline.png]
Each file's records are scaled by that file's own copy bandwidth; with several files, `--only` picks which kernel
families ("what") to take from each file, in order (e.g. `--only kda_decode --only mxfp4_moe --only mla_decode`).
Only records whose correctness check passed in their run are plotted; `--drop mla_decode:B=1` leaves out the records
of a family with that field value (repeatable).
"""
import argparse
import json
import os
import sys


LABEL_KEYS = ("H", "B", "L", "T", "experts", "global_experts")


def parse_drop(text: str) -> tuple[str, str, str]:
    """'WHAT:KEY=VALUE' -> (what, key, value); ValueError naming the expected form."""
    what, sep, rest = text.partition(":")
    key, eq, value = rest.partition("=")
    if not (sep and eq and what and key and value):
        raise ValueError(f"--drop {text!r}: expected WHAT:KEY=VALUE, e.g. mla_decode:B=1")
    return what, key, value


H200_BF16_TFLOPS = 989.0        # dense bf16 tensor-core peak, H200 SXM specification
K3_HEAD_DIM, K3_TOP_K = 128, 16
MXFP4_BYTES_PER_WEIGHT = 0.5 * (1 + 1 / 16)          # E2M1 nibbles + one E8M0 byte per 32 weights


def flops_of(r: dict) -> float | None:
    """FLOPs of one bench_kernels record (module docstring), None for a family without a count here."""
    what = r["what"]
    if what in ("kda_decode", "kda_decode_layers"):
        return 7.0 * r["B"] * r["H"] * K3_HEAD_DIM * K3_HEAD_DIM
    if what == "mla_decode" and "L" in r:
        return 2.0 * r["B"] * r["H"] * r["L"] * (576 + 512)
    if what == "mxfp4_moe" and r.get("experts_touched"):
        pairs = r.get("local_pairs") or (r["T"] * K3_TOP_K if not r.get("global_experts") else None)
        ir = r["bytes"] / r["experts_touched"] / (3 * MXFP4_BYTES_PER_WEIGHT)
        return None if pairs is None else 2.0 * 3 * pairs * ir
    return None


def rows_of(path: str, only: set | None, drop: tuple = ()) -> list[tuple[str, float, float, float]]:
    """(label, % of copy, FLOP per byte or nan, TFLOP/s or nan) of the checked records of one run, minus those
    matching a `drop` (what, key, value)."""
    recs = [json.loads(line) for line in open(path)]
    copy = next(r["GBps"] for r in recs if r["what"] == "copy")
    rows = []
    for r in recs:
        if "pct_copy" not in r or not r.get("correct") or r.get("us") != r.get("us"):
            continue
        if only and r["what"] not in only:
            continue
        if any(r["what"] == w and str(r.get(k)) == v for w, k, v in drop):
            continue
        us = r["us"]
        pct = 100 * r["bytes"] / us / 1e3 / copy
        fl = flops_of(r)
        ai, tf = (fl / r["bytes"], fl / us / 1e6) if fl else (float("nan"), float("nan"))
        rows.append((r["what"] + " " + ",".join(f"{k}={r[k]}" for k in LABEL_KEYS if k in r), pct, ai, tf))
    return rows


def copy_of(path: str) -> float:
    """The copy bandwidth (GB/s) a bench_kernels run measured."""
    return next(json.loads(line)["GBps"] for line in open(path) if json.loads(line)["what"] == "copy")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_kernels.py JSON lines files")
    ap.add_argument("--only", action="append", default=None,
                    help="comma-separated kernel families to take from the file at the same position")
    ap.add_argument("--drop", action="append", default=[],
                    help="WHAT:KEY=VALUE: leave out that family's records with that field value (repeatable)")
    ap.add_argument("--title", default="k3deploy Triton kernels on H200: memory roofline fraction",
                    help="the figure title")
    ap.add_argument("--out", default=None, help="PNG path (default: roofline.png beside the first file)")
    a = ap.parse_args()
    try:
        drop = tuple(parse_drop(d) for d in a.drop)
    except ValueError as e:
        ap.error(str(e))
    if a.only and len(a.only) != len(a.runs):
        ap.error(f"--only given {len(a.only)} times for {len(a.runs)} files: give it once per file or not at all")
    try:
        import matplotlib
    except ImportError:
        ap.error("needs matplotlib: pip install -e '.[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for i, path in enumerate(a.runs):
        rows += rows_of(path, set(a.only[i].split(",")) if a.only else None, drop)
    for w, k, v in drop:     # a misspelled family or field drops nothing: say so
        if not any(json.loads(line).get("what") == w and str(json.loads(line).get(k)) == v
                   for path in a.runs for line in open(path)):
            print(f"warning: --drop {w}:{k}={v} matched no record", file=sys.stderr)
    fig, (ax, rl) = plt.subplots(1, 2, figsize=(17, 6), gridspec_kw={"width_ratios": [1, 1]})
    ax.barh(range(len(rows)), [r[1] for r in rows])
    ax.axvline(100, color="k", ls="--", lw=1)
    ax.axvline(85, color="g", ls=":", lw=1)
    ax.axvline(70, color="r", ls=":", lw=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=7)
    ax.set_xlabel("% of the copy bandwidth measured in the same run; bytes = compulsory HBM traffic")
    ax.set_title(a.title, fontsize=9)
    copy = min(copy_of(p) for p in a.runs)                       # the slowest run's copy: the lowest roof drawn
    pts = [r for r in rows if r[2] == r[2]]
    knee = H200_BF16_TFLOPS * 1e3 / copy
    xs = [0.1, max([r[2] for r in pts] + [knee]) * 3]       # past the knee: the flat roof is drawn to the right
    rl.plot([xs[0], knee, xs[1]], [copy * xs[0] / 1e3, H200_BF16_TFLOPS, H200_BF16_TFLOPS], "k-", lw=1)
    rl.text(xs[0] * 1.2, copy * xs[0] * 1.5 / 1e3, f"copy {copy / 1e3:.2f} TB/s (measured)", fontsize=7)
    rl.text(knee * 1.1, H200_BF16_TFLOPS * 1.1, "bf16 dense 989 TFLOP/s (spec)", fontsize=7)
    fams = sorted({r[0].split()[0] for r in pts})
    for i, fam in enumerate(fams):
        mine = [r for r in pts if r[0].split()[0] == fam]
        rl.scatter([r[2] for r in mine], [r[3] for r in mine], s=14, label=fam, color=f"C{i}")
        for r in mine:
            rl.annotate(r[0].split(" ", 1)[1] if " " in r[0] else "", (r[2], r[3]), fontsize=5,
                        xytext=(3, 2), textcoords="offset points")
    rl.set_xscale("log")
    rl.set_yscale("log")
    rl.set_xlabel("arithmetic intensity, FLOP per compulsory HBM byte")
    rl.set_ylabel("achieved TFLOP/s")
    rl.set_title("roofline (FLOPs: module docstring)", fontsize=9)
    rl.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = a.out or os.path.join(os.path.dirname(a.runs[0]), "roofline.png")
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)
    for label, pct, ai, tf in rows:
        print(f"{pct:6.1f}%  {ai:8.2f} FLOP/B  {tf:7.2f} TFLOP/s  {label}")


if __name__ == "__main__":
    main()
