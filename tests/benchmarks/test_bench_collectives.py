"""benchmarks/bench_collectives.py: the decode step's collectives timed over a process group (CPU, gloo)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_collectives_messages_and_bus_bandwidth(tmp_path):
    """benchmarks/bench_collectives.py, 2 ranks over gloo on the CPU: the decode step's three messages of k3-tiny
    (all-reduce [B, hidden], [B, latent]; all-gather [B, vocab / 2]) in fp32 and bf16, each checked exact, with
    NCCL's bus-bandwidth factors; run alone (world size 1) it refuses with exit 2."""
    from k3deploy.model.config import load_config
    c = load_config("k3-tiny")
    out = tmp_path / "c.jsonl"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "benchmarks/bench_collectives.py", "--preset", "k3-tiny", "--device", "cpu", "--batch", "3",
                        "--iters", "2", "--repeats", "2", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["op"], x["dtype"], x["mode"]) for x in recs] == [
        (op, d, "eager") for op in ("all_reduce", "all_reduce", "all_gather") for d in ("fp32", "bf16")]
    shapes = [[3, c.hidden_size], [3, c.routed_expert_hidden_size], [3, c.vocab_size // 2]]
    for x, shape in zip(recs, [s for s in shapes for _ in range(2)]):
        assert x["shape"] == shape and x["correct"] and x["tp"] == 2 and x["backend"] == "gloo", x
        assert x["bytes"] == shape[0] * shape[1] * (4 if x["dtype"] == "fp32" else 2) and x["us"] > 0
        # bus bandwidth factors at n = 2: all-reduce 2 (n-1)/n = 1, all-gather n-1 = 1
        assert x["busbw_gbs"] == pytest.approx(x["algbw_gbs"], rel=0.02, abs=0.011), x
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_collectives import bus_bandwidth
    assert bus_bandwidth("all_reduce", 4e9, 1.0, 4) == pytest.approx(6.0)       # 2 * 3/4 * 4 GB/s
    assert bus_bandwidth("all_gather", 4e9, 1.0, 4) == pytest.approx(12.0)      # 3 * 4 GB/s
    r = subprocess.run([sys.executable, "benchmarks/bench_collectives.py", "--device", "cpu"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "torchrun" in r.stderr, r.stderr
