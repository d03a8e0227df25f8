"""benchmarks/sweep_kda_decode_tiles.py: its command line (the sweep itself needs a GPU)."""
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_kda_decode_tiles_cli_errors(tmp_path):
    """benchmarks/sweep_kda_decode_tiles.py: a bad --shapes item is one argparse error naming it; without a GPU the
    script exits 2 with one line saying so and writes nothing."""
    script = ROOT / "benchmarks" / "sweep_kda_decode_tiles.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(script), "--shapes", "12x1,96-4"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2 and "--shapes '96-4': expected HEADSxBATCH" in r.stderr, r.stderr
    if not torch.cuda.is_available():
        out = tmp_path / "t.jsonl"
        r = subprocess.run([sys.executable, str(script), "--out", str(out)], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "error: sweep_kda_decode_tiles.py needs a CUDA GPU (torch.cuda.is_available() is False here)"], r.stderr
        assert not out.exists()
