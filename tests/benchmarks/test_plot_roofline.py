"""benchmarks/plot_roofline.py: the rows and FLOP counts it plots (no matplotlib needed)."""
import json

import pytest

from kernel_checks import benchmark_module   # tests/kernel_checks.py


def test_plot_roofline_rows_and_drop(tmp_path):
    """benchmarks/plot_roofline.py's rows: % of the file's own copy bandwidth, unchecked records left out, --drop
    removing one family's records by field value (no matplotlib needed for the rows)."""
    pr = benchmark_module("plot_roofline")
    recs = [{"what": "copy", "GBps": 4000.0},
            {"what": "mla_decode", "H": 12, "B": 64, "L": 1000, "correct": True, "us": 100.0, "bytes": 2e8,
             "pct_copy": 0},
            {"what": "mla_decode", "H": 12, "B": 1, "correct": True, "us": 10.0, "bytes": 1e6, "pct_copy": 0},
            {"what": "mxfp4_moe", "T": 64, "experts": 112, "global_experts": 896, "correct": False, "us": 5.0,
             "bytes": 1e9, "pct_copy": 0}]
    f = tmp_path / "run.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    rows = pr.rows_of(str(f), None, (pr.parse_drop("mla_decode:B=1"),))
    flops = 2.0 * 64 * 12 * 1000 * 1088                                      # B x H x L x (576 + 512) x 2
    # 2e8 B in 100 us = 2 TB/s of 4; the roofline point: FLOP per byte and TFLOP/s
    assert rows == [("mla_decode H=12,B=64,L=1000", pytest.approx(50.0), pytest.approx(flops / 2e8),
                     pytest.approx(flops / 100e-6 / 1e12))]
    assert len(pr.rows_of(str(f), None)) == 2                         # the unchecked MoE record never
    moe = {"what": "mxfp4_moe", "T": 64, "experts": 112, "experts_touched": 112, "bytes": 1965293568}
    assert pr.flops_of(moe) == pytest.approx(2 * 3 * 64 * 16 * 3072 * 3584)  # all local: T x top-16 pairs
    assert pr.flops_of({**moe, "global_experts": 896, "local_pairs": 137, "experts_touched": 76,
                        "bytes": 76 * 1965293568 // 112}) == pytest.approx(2 * 3 * 137 * 3072 * 3584)
    assert pr.flops_of({"what": "kda_decode_layers", "B": 64, "H": 12}) == 7 * 64 * 12 * 128 * 128
    with pytest.raises(ValueError, match="WHAT:KEY=VALUE"):
        pr.parse_drop("mla_decode")
