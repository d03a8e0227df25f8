"""benchmarks/bench_gemm_layout.py: its GEMMs are the fused runtime's (shapes and calls of one decode step), and the
CLI runs on the CPU at k3-tiny's shapes and writes its records (its numbers mean something on a GPU only; nothing here
is timed)."""
from __future__ import annotations

import collections
import json
import os

import pytest
import torch

from kernel_checks import benchmark_module   # tests/kernel_checks.py

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the first triton import (the fused glue kernels)


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("bench_gemm_layout")


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0 and "--rows" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--rows", "0"], ["--rows", "a"], ["--iters", "0"], ["--preset", "nope"],
                                  ["--device", "tpu"], ["--device", "meta"]])
def test_bad_arguments_exit_2(bench, args, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu"] + args)
    assert e.value.code == 2 and args[0] in capsys.readouterr().err


def test_gemms_are_the_fused_decode_steps(bench, tiny_ckpt, tiny_cfg, monkeypatch):
    """Every GEMM weight one fused decode step of k3-tiny multiplies by (runtime/fused.py's `_mm` / `_mm_f32`),
    with its count, is what `step_gemms` times: the benchmark measures the runtime's GEMMs."""
    from k3deploy.model.reference import Batch, K3Model, allocate_pools
    from k3deploy.runtime import fused as fm
    seen = collections.Counter()
    for name in ("_mm", "_mm_f32"):
        real = getattr(fm, name)
        monkeypatch.setattr(fm, name, lambda x, w, real=real: seen.update([tuple(w.shape)]) or real(x, w))
    model = fm.FusedModel(K3Model.from_checkpoint(tiny_ckpt, device="cpu"))
    n = 2
    batch = Batch(torch.arange(n + 1, dtype=torch.int32), torch.arange(1, n + 1, dtype=torch.int32),
                  torch.arange(1, 4 * n + 1, dtype=torch.int32).view(n, 4), torch.tensor([3, 1], dtype=torch.int32),
                  decode=True)
    with torch.no_grad():
        model.forward(torch.tensor([5, 7]), batch, allocate_pools(tiny_cfg, n + 1, 4 * n + 1, 16, device="cpu"))
    want = collections.Counter()
    for N, K, calls in bench.step_gemms(tiny_cfg).values():
        want[(N, K)] += calls
    assert seen == want, (seen, want)


def test_tiny_run_writes_records(bench, tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    assert bench.main(["--device", "cpu", "--preset", "k3-tiny", "--rows", "1,3", "--iters", "1",
                       "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs == [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    gemms = [r for r in recs if r["name"] != "step"]
    assert {r["name"] for r in gemms} == set(bench.step_gemms(bench.load_config("k3-tiny")))
    assert all(r["row_us"] > 0 and r["col_us"] > 0 and r["bound_us"] is None for r in gemms)
    for M in (1, 3):
        step = next(r for r in recs if r["name"] == "step" and r["M"] == M)
        part = [r for r in gemms if r["M"] == M]
        assert step["row_us"] == pytest.approx(sum(r["calls"] * r["row_us"] for r in part), abs=0.1)
    pytest.importorskip("matplotlib")          # the plot: the bench extra
    png = tmp_path / "g.png"
    bench.plot(recs, png)
    assert png.stat().st_size > 0
