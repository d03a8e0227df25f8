"""benchmarks/bench_vision.py runs on the CPU at tiny sizes and writes its records (the GPU numbers come from the
H200 run; nothing here is timed)."""
from __future__ import annotations

import json

import pytest

from kernel_checks import benchmark_module   # tests/kernel_checks.py


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("bench_vision")


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0 and "--images-per-call" in capsys.readouterr().out


def test_tiny_run_writes_records(bench, tmp_path, capsys):
    out = tmp_path / "v.jsonl"
    assert bench.main(["--device", "cpu", "--preset", "k3-tiny-vl", "--sizes", "28,56", "--depths", "2", "--iters", "1",
                       "--warmup", "0", "--gemm", "128", "--check", "--ttft-preset", "k3-tiny-vl", "--ttft-image", "28",
                       "--ttft-text", "4", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    env, towers, ttft = recs[0], [x for x in recs if x["bench"] == "vision_tower"], recs[-1]
    assert env["bench"] == "env" and env["gemm_peak_tflops"] > 0
    assert [t["grid"] for t in towers] == [[1, 2, 2], [1, 4, 4]] and [t["tokens"] for t in towers] == [1, 4]
    for t in towers:
        assert t["ours_ms"] > 0 and t["peer_ms"] > 0 and t["ours_frac_peak"] > 0
        assert t["ours_vs_peer_rel_err"] < 0.05                   # the bf16 serving form tracks the eager reference
    assert ttft["bench"] == "ttft" and ttft["prompt_tokens"] == 5 and ttft["ttft_s"] > 0 and ttft["tower_ms"] > 0
    assert bench.main(["--preset", "k3-tiny", "--device", "cpu"]) == 2
    assert "vision_config" in capsys.readouterr().err
