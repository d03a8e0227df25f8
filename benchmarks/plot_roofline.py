"""Roofline plot (% of the copy bandwidth measured in the same run) from bench_kernels.py JSON lines.

Usage: python benchmarks/plot_roofline.py RUN.jsonl [RUN2.jsonl ...] [--only WHAT,..] [--drop WHAT:KEY=VALUE]
        [--final-defaults] [--title TEXT] [--out results/roofline.png]
Each file's records are scaled by that file's own copy bandwidth; with several files, `--only` picks which kernel
families ("what") to take from each file, in order (e.g. `--only kda_decode --only mxfp4_moe --only mla_decode`).
Only records whose correctness check passed in their run are plotted; `--drop mla_decode:B=1` leaves out the records
of a family with that field value (repeatable).
--final-defaults: for run 3, plot the variant that the code's defaults selected after that run (MLA 96 heads:
{"block_h": 64}; MoE: {"impl": "legacy", block_n 128}); each is a measurement of that same run (correctness-checked
there), taken with explicit arguments.
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


def rows_of(path: str, only: set | None, final: bool, drop: tuple = ()) -> list[tuple[str, float]]:
    """(label, % of copy) of the checked records of one run, minus those matching a `drop` (what, key, value)."""
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
        if final and r["what"] == "mla_decode" and r["H"] > 16:
            us = r["variants"].get('{"block_h": 64}', us)
        if final and r["what"] == "mxfp4_moe":
            us = r["variants"].get('{"impl": "legacy", "block_n13": 128, "block_n2": 128}', us)
        pct = 100 * r["bytes"] / us / 1e3 / copy
        rows.append((r["what"] + " " + ",".join(f"{k}={r[k]}" for k in LABEL_KEYS if k in r), pct))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_kernels.py JSON lines files")
    ap.add_argument("--only", action="append", default=None,
                    help="comma-separated kernel families to take from the file at the same position")
    ap.add_argument("--drop", action="append", default=[],
                    help="WHAT:KEY=VALUE: leave out that family's records with that field value (repeatable)")
    ap.add_argument("--final-defaults", action="store_true", help="run 3 only: see the module docstring")
    ap.add_argument("--title", default="k3deploy Triton kernels on H200: memory roofline fraction")
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
        rows += rows_of(path, set(a.only[i].split(",")) if a.only else None, a.final_defaults, drop)
    for w, k, v in drop:     # a misspelled family or field drops nothing: say so
        if not any(json.loads(line).get("what") == w and str(json.loads(line).get(k)) == v
                   for path in a.runs for line in open(path)):
            print(f"warning: --drop {w}:{k}={v} matched no record", file=sys.stderr)
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.barh(range(len(rows)), [p for _, p in rows])
    ax.axvline(100, color="k", ls="--", lw=1)
    ax.axvline(85, color="g", ls=":", lw=1)
    ax.axvline(70, color="r", ls=":", lw=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in rows], fontsize=7)
    ax.set_xlabel("% of the copy bandwidth measured in the same run; bytes = compulsory HBM traffic")
    ax.set_title(a.title)
    fig.tight_layout()
    out = a.out or os.path.join(os.path.dirname(a.runs[0]), "roofline.png")
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)
    for label, pct in rows:
        print(f"{pct:6.1f}%  {label}")


if __name__ == "__main__":
    main()
