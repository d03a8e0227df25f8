"""benchmarks/ncu_moe.py: the summary of an Nsight Compute report (runs anywhere; profiling needs a GPU and ncu)."""
import sys

from kernel_checks import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import ncu_moe  # noqa: E402  (benchmarks/)

REPORT = REPO / "benchmarks/results/ncu_moe_T64-h200.txt"


def test_ncu_summary_reads_a_real_report():
    """--summarize on an H200 Nsight Compute report (boost clocks, T=64: `ncu_moe.py --tokens 64` with the legacy and
    the Gluon kernels): four kernels (legacy w13 / w2, Gluon w13 / w2) with duration, DRAM throughput, stall reasons
    and pipe use."""
    recs = ncu_moe.summarize(REPORT.read_text())
    assert [r["kernel"] for r in recs] == ["_moe_w13_kernel", "_moe_w2_kernel", "moe_w13_kernel", "moe_w2_kernel"]
    assert recs[2]["Duration"] == 525.28 and recs[2]["DRAM Throughput"] == 53.42
    assert recs[2]["stalls"]["long_scoreboard"] == 1.85 and recs[2]["pipes"]["alu"] == 48.66
    assert recs[0]["grid"] == "(24, 112, 1)x(128, 1, 1)"


def test_ncu_driver_rejects_too_few_experts(capsys):
    """--experts below the top-16 routing is one argparse error naming the flag (before any GPU is needed)."""
    import pytest
    with pytest.raises(SystemExit) as e:
        ncu_moe.main(["--experts", "8"])
    assert e.value.code == 2 and "--experts 8: top-16 routing needs at least 16" in capsys.readouterr().err
