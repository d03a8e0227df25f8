"""benchmarks/bench_prefix_cache.py runs end to end on the CPU with tiny sizes (the H200 run uses the defaults)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_prefix_cache.py"


def test_help():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "--snapshot-interval" in r.stdout and "TTFT" in r.stdout


def test_bad_arguments_exit_2():
    r = subprocess.run([sys.executable, str(SCRIPT), "--turns", "4", "--history", "64", "--reply-len", "16"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "must exceed --reply-len" in r.stderr


def test_tiny_run_on_the_cpu(micro_ckpt, tmp_path):
    """All three scenarios on the 2-layer micro checkpoint: turns after the first resume after the previous reply,
    the users after the first resume inside the system prompt, every record has its measurements."""
    out, png = tmp_path / "prefix.jsonl", tmp_path / "prefix.png"
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(micro_ckpt), "--device", "cpu", "--turns", "3",
           "--history", "48", "--reply-len", "3", "--users", "3", "--system-len", "20", "--question-len", "4",
           "--snapshot-interval", "16", "--max-num-tokens", "32", "--cold-len", "30", "--repeats", "1",
           "--out", str(out)]
    if importlib.util.find_spec("matplotlib") is not None:
        cmd += ["--plot", str(png)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = {rec["scenario"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    conv, shared, cost = recs["conversation"], recs["shared"], recs["snapshot_cost"]
    turns = conv["turns"]
    assert [t["prompt_tokens"] for t in turns] == [13, 29, 45]
    assert turns[0]["cached_tokens"] == 0
    assert [t["cached_tokens"] for t in turns[1:]] == [t["prompt_tokens"] - 16 + 3 - 1 for t in turns[1:]]
    assert all(t["ttft_s_on"] > 0 and t["ttft_s_off"] > 0 and t["ratio_bound"] >= 1 for t in turns)
    assert shared["on"]["cached_tokens"] == 2 * 16 and shared["off"]["cached_tokens"] == 0
    assert shared["on"]["prefix_metrics"]["snapshots_taken"] > 0 and shared["off"]["prefix_metrics"] is None
    # one 30-token chunk with a snapshot inside it (16), then the end of the request (30): no extra prefill step
    assert cost["snapshots_per_prefill"] == 2 and cost["prefill_steps_on"] == cost["prefill_steps_off"] == 1
    assert cost["prefill_s_off"] > 0 and cost["snapshot_copy_ms_total"] > 0
    assert str(png) not in cmd or png.stat().st_size > 0
