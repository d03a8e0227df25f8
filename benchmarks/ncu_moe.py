"""MXFP4 MoE under Nsight Compute: drive `mxfp4_moe` once with each set of kernels (run this under `ncu`), or
summarize an ncu report. The H200 image ships ncu (/usr/local/cuda/bin/ncu); `bash benchmarks/gpu_run.sh ncu`
runs both.

  ncu --clock-control none --kernel-name regex:'moe_w13|moe_w2' --section SpeedOfLight --section Occupancy \\
      --section SchedulerStats --metrics <METRICS below> python3 benchmarks/ncu_moe.py --tokens 64 > ncu.txt
  python3 benchmarks/ncu_moe.py --summarize ncu.txt

The problem is the benchmark's (benchmarks/bench_kernels.py "moe"): 112 local experts (`--experts`; 64 is
k3-slice), latent 3584, expert width 3072, top-16, random E2M1 bytes, E8M0 exponents 118..125, x ~ N(0, 0.01) bf16. `--clock-control none` keeps the
boost clocks (ncu locks the base clock by default, which turns these kernels compute bound). Summary per kernel:
duration (us), DRAM throughput (% of peak), issue rate, warps, stall reasons (cycles per issued instruction) and
pipe utilization (% of peak).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

METRICS = ("regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,"
           "regex:sm__inst_executed_pipe_.*\\.avg\\.pct_of_peak_sustained_active,"
           "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,"
           "l1tex__data_bank_conflicts_pipe_lsu.sum,dram__bytes_read.sum,smsp__inst_executed.sum")
_KEYS = ("SM Frequency", "Duration", "DRAM Throughput", "Compute (SM) Throughput", "Issued Warp Per Scheduler",
         "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "Theoretical Occupancy",
         "smsp__inst_executed.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
         "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "l1tex__data_bank_conflicts_pipe_lsu.sum")


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def summarize(text: str) -> list[dict]:
    """One dict per kernel launch of an ncu text report (the sections and METRICS above): name, grid, the _KEYS
    values found, `stalls` {reason: cycles per issued instruction > 0.05}, `pipes` {pipe: % of peak > 2}."""
    out = []
    parts = re.split(r"\n  (\S+) (\([\d, ]+\)x\([\d, ]+\)),", text)
    for name, grid, body in zip(parts[1::3], parts[2::3], parts[3::3]):
        rec = {"kernel": name, "grid": grid}
        for k in _KEYS:
            m = re.search(re.escape(k) + r"\s+(\S+\s+)?([\d,.]+)\s*\n", body)
            if m:
                rec[k] = _num(m.group(2))
        rec["stalls"] = {n: _num(v) for n, v in re.findall(
            r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio\s+\S*\s+([\d,.]+)", body)
            if _num(v) > 0.05}
        rec["pipes"] = {n: _num(v) for n, v in re.findall(
            r"sm__inst_executed_pipe_(\w+)\.avg\.pct_of_peak_sustained_active\s+\S*\s+([\d,.]+)", body)
            if _num(v) > 2 and "realtime" not in n}
        out.append(rec)
    return out


IMPLS = ("legacy", "gluon")      # mxfp4_moe's two sets of grouped GEMMs (its `_pick_impl`), forced one per call


def drive(tokens: int, impls: list[str], experts: int = 112) -> None:
    """One `mxfp4_moe` call per set of kernels in `impls` (IMPLS; forced through `_pick_impl`) on the benchmark's
    problem with `tokens` tokens and `experts` local experts (every choice local). SystemExit without CUDA."""
    import torch

    if not torch.cuda.is_available():     # exit 2 with one line, like the other benchmarks
        sys.stderr.write("error: ncu_moe.py needs a CUDA GPU (run it under ncu on the GPU machine); --summarize "
                         "runs anywhere\n")
        raise SystemExit(2)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_common import forced     # benchmarks/, this script's folder
    from k3deploy.plugins.moe import kernels as moe_k

    dev = "cuda"
    E, D, I, K = experts, 3584, 3072, 16
    g = torch.Generator(device=dev).manual_seed(0)
    w13p = torch.randint(0, 256, (E, 2 * I, D // 2), device=dev, dtype=torch.uint8, generator=g)
    w13s = torch.randint(118, 126, (E, 2 * I, D // 32), device=dev, dtype=torch.uint8, generator=g)
    w2p = torch.randint(0, 256, (E, D, I // 2), device=dev, dtype=torch.uint8, generator=g)
    w2s = torch.randint(118, 126, (E, D, I // 32), device=dev, dtype=torch.uint8, generator=g)
    x = torch.randn(tokens, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
    ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(tokens)]).int()
    w = torch.rand(tokens, K, device=dev, generator=g)
    for impl in impls:
        with forced(moe_k, "_pick_impl", impl):
            moe_k.mxfp4_moe(x, ids, w, w13p, w13s, w2p, w2s)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="METRICS (ncu --metrics): " + METRICS)
    ap.add_argument("--tokens", type=int, default=64, help="tokens T (default 64)")
    ap.add_argument("--experts", type=int, default=112,
                    help="local experts, every choice among them (default 112: K3 at EP=8; 64: k3-slice)")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help="comma-separated kernels to call, one call each, in order (default: %(default)s)")
    ap.add_argument("--summarize", metavar="NCU_TXT", help="print one JSON line per kernel of this ncu report instead")
    a = ap.parse_args(argv)
    if a.summarize:
        if not Path(a.summarize).is_file():
            ap.error(f"--summarize {a.summarize}: no such file")
        for rec in summarize(Path(a.summarize).read_text()):
            print(json.dumps(rec))
        return 0
    impls = [i for i in a.impls.split(",") if i]
    if not impls or set(impls) - set(IMPLS):
        ap.error(f"--impls {a.impls!r}: choose from {', '.join(IMPLS)}")
    if a.experts < 16:
        ap.error(f"--experts {a.experts}: top-16 routing needs at least 16")
    drive(a.tokens, impls, a.experts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
