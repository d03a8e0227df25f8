"""benchmarks/bench_openai.py on the CPU: one stream through Triton's gRPC path and through the OpenAI front, the
records it writes (the front-vs-gRPC line included)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("tritonclient") is None, reason="needs the serve extra (tritonclient)")
def test_tiny_run_writes_records(tiny_ckpt, tmp_path):
    out = tmp_path / "openai.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "benchmarks/bench_openai.py", "--checkpoint", str(tiny_ckpt), "--streams", "1",
                        "--requests", "1", "--rounds", "1", "--prompt-tokens", "8", "--output-tokens", "3",
                        "--max-context", "128", "--guidellm", "", "--out", str(out)],   # guidellm: not here
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    paths = {x["path"]: x for x in recs}
    assert {"grpc", "front", "front_vs_grpc"} <= set(paths), recs
    for p in ("grpc", "front"):
        assert paths[p]["streams"] == 1 and paths[p]["requests"] == 1 and paths[p]["tok_per_s"] > 0
        assert paths[p]["ttft_ms_p50"] > 0 and paths[p]["itl_ms_p50"] > 0
    assert "itl_overhead_ms" in paths["front_vs_grpc"]
