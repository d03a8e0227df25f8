"""benchmarks/plot_decode_tp.py: how a decode record's step splits into bars, and the plot from real records."""
import json
from pathlib import Path

import pytest

from kernel_checks import benchmark_module   # tests/kernel_checks.py

ROOT = Path(__file__).resolve().parents[2]


def _module():
    return benchmark_module("plot_decode_tp")


def test_parts_split_the_step():
    """(nccl, other kernels, idle) sum to the unprofiled step; no profile: all idle; NCCL capped by the rest."""
    parts = _module().parts
    rec = {"step_ms_median": 4.0, "kernel_profile": {"gpu_busy_ms_per_step": 3.5, "nccl_ms_per_step": 0.5}}
    assert parts(rec) == pytest.approx((0.5, 3.0, 0.5))
    assert parts({"step_ms_median": 2.0}) == (0.0, 0.0, 2.0)
    over = {"step_ms_median": 1.0, "kernel_profile": {"gpu_busy_ms_per_step": 1.2, "nccl_ms_per_step": 0.1}}
    n, c, i = parts(over)
    assert c == pytest.approx(1.0) and n == 0.0 and i == 0.0              # busy over the step: no negative bars


def test_plot_from_the_fused_records(tmp_path, capsys):
    """The H200 fused / unfused records: one bar each, labelled by ops and batch (they differ), a PNG written."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "d.png"
    src = ROOT / "benchmarks" / "results" / "decode_k3slice_fused-h200.jsonl"
    assert _module().main([str(src), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    n = sum(1 for line in src.read_text().splitlines() if json.loads(line).get("bench") == "decode")
    assert len(lines) == n and any("kernels-unfused B=16" in x for x in lines)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
