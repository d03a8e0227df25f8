"""benchmarks/bench_decode.py's bound, batch list, TTFT and fused / unfused side-by-side records, on the CPU (the
GPU runs of the script are in tests/runtime/test_runtime_gpu.py)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3deploy.model.config import load_config, preset_json

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_decode as bd          # noqa: E402


def test_step_bytes_reproduce_model_md():
    """The bound's bytes on K3's shapes: KDA state + conv history per request and layer at TP=8 as MODEL.md §9 gives
    them (814,080 B, read and written), the MLA latent row 1,152 B (bf16), one expert slice per rank 2,193,408 B
    (§10: w1/w3 [384, 1792] + scales [384, 112], w2 [3584, 192] + [3584, 12]); k3-tp8-rank's dense bf16 bytes are
    K3's per-rank dense bytes but for the router rows (448 of 896 experts)."""
    k3, rank = load_config("k3"), load_config("k3-tp8-rank")
    one = bd.step_bytes(k3, 8, 1, 2, 2, batch=1, attended=0, touched=[])
    assert one["kda_state"] == 69 * 2 * 814_080 and one["mla_latents"] == 24 * 1152 and one["experts"] == 0
    assert bd.expert_bytes(k3, 8, 1) == bd.expert_bytes(rank, 1, 1) == 2_193_408
    assert bd.expert_bytes(k3, 8, 8) == 8 * 2_193_408                  # EP: whole experts
    mine = bd.step_bytes(rank, 1, 1, 2, 2, batch=1, attended=0, touched=[])
    assert mine["kda_state"] == one["kda_state"] and mine["mla_latents"] == one["mla_latents"]
    router = 92 * 448 * (7168 * 2 + 4)
    a_log = 69 * (128 - 128 // 8) * 4      # A_log is stored padded to 128 entries (§4.1), a rank's shard holds 16
    assert mine["dense"] - one["dense"] == a_log - router               # 896 -> 448 router rows
    full = bd.step_bytes(rank, 1, 1, 2, 2, batch=1, attended=0, touched=[], num_experts=896)
    assert full["dense"] == one["dense"] + a_log
    b = bd.step_bytes(rank, 1, 1, 2, 2, batch=16, attended=16 * 4096, touched=[100] * 92)
    assert b["experts"] == 92 * 100 * 2_193_408 and b["mla_latents"] == 24 * (16 * 4096 + 16) * 1152
    assert b["total"] == b["dense"] + b["experts"] + b["kda_state"] + b["mla_latents"]
    assert 23e9 < mine["dense"] < 24e9                                  # 23.7 GB bf16 (model/config.py)


def test_uniform_touched_experts():
    assert bd.uniform_touched(896, 16, 1) == pytest.approx(16)
    assert bd.uniform_touched(448, 16, 64) == pytest.approx(448 * (1 - (1 - 16 / 448) ** 64))
    assert bd.uniform_touched(896, 16, 64, ep=8) == pytest.approx(bd.uniform_touched(896, 16, 64) / 8)
    assert math.isclose(bd.uniform_touched(64, 16, 10_000), 64)


def _run(args, tmp_path, env=None, timeout=900):
    out = tmp_path / "b.jsonl"
    r = subprocess.run([sys.executable, "benchmarks/bench_decode.py", "--device", "cpu", "--no-progress", "--out",
                        str(out), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    return r, [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


def _micro(tmp_path) -> Path:
    j = preset_json("k3-tiny")
    tc = j["text_config"]
    tc["num_hidden_layers"] = 2
    tc["linear_attn_config"].update(kda_layers=[1], full_attn_layers=[2])
    tc["attn_res_block_size"] = 1
    p = tmp_path / "micro.json"
    p.write_text(json.dumps(j))
    return p


def test_batch_list_and_ttft_records(tmp_path):
    """--batch 1,3 runs each size (records in order, bound bytes growing with the batch), --ttft one record per
    length; --check needs one batch size."""
    cfg = _micro(tmp_path)
    r, recs = _run(["--preset", str(cfg), "--batch", "1,3", "--prompt-len", "4", "--steps", "2", "--warmup", "0",
                    "--ttft", "5,9", "--predict-experts", "32"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    dec = [x for x in recs if x["bench"] == "decode"]
    ttft = [x for x in recs if x["bench"] == "ttft"]
    assert [x["batch"] for x in dec] == [1, 3] and [x["prompt_len"] for x in ttft] == [5, 9]
    for x in dec:
        b = x["bound"]
        assert b["total"] == b["dense"] + b["experts"] + b["kda_state"] + b["mla_latents"]
        assert 1 <= b["experts_touched_per_layer"] <= 4 * x["batch"] and x["copy_GBps"] is None
        assert x["predicted"]["experts_per_layer"] == 32 and x["predicted"]["experts"] > 0
    assert dec[1]["bound"]["kda_state"] == 3 * dec[0]["bound"]["kda_state"]
    assert all(x["ttft_ms"] > 0 and x["ttft_first_ms"] > 0 and x["batch"] == 1 for x in ttft)
    r, _ = _run(["--preset", str(cfg), "--batch", "1,2", "--check"], tmp_path)
    assert r.returncode == 2 and "one --batch" in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="CPU under the Triton interpreter (the GPU image's Triton 3.6 interpreter cannot run the "
                           "kernels' loops); the GPU side-by-side run is bench_decode's own command")
def test_fused_and_unfused_side_by_side_under_the_interpreter(tmp_path):
    """--ops kernels,kernels-unfused in one process (CPU, TRITON_INTERPRET=1): one record each, the same bound
    bytes, and the same greedy tokens (fp32: --check passes for both)."""
    cfg = _micro(tmp_path)
    r, recs = _run(["--preset", str(cfg), "--batch", "2", "--prompt-len", "3", "--steps", "1", "--warmup", "0",
                    "--ops", "kernels,kernels-unfused", "--check", "--check-steps", "1"], tmp_path,
                   env={"TRITON_INTERPRET": "1"}, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [x["ops"] for x in recs] == ["kernels", "kernels-unfused"]
    assert recs[0]["bound"]["total"] == recs[1]["bound"]["total"] and all(x["check"]["passed"] for x in recs)
