"""benchmarks/bench_kernels.py: its command line (the benchmark itself needs a GPU)."""
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernels_cli_errors():
    """benchmarks/bench_kernels.py: a bad --config is one argparse error naming the option (before torch loads); the
    default config on a machine without a GPU exits 2 with one line saying so."""
    bench = ROOT / "benchmarks" / "bench_kernels.py"
    r = subprocess.run([sys.executable, str(bench), "--config", "no-such-preset"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "--config 'no-such-preset'" in r.stderr and "preset" in r.stderr, r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, str(bench)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "error: bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False here)"], r.stderr
