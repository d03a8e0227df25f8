"""benchmarks/bench_decode.py: the decode-step benchmark of the runtime (JSON lines, --check against the fp32
reference, --compare-to a saved run, TP under torchrun; the step's bound, batch lists, TTFT, the fused and unfused
kernel paths side by side): its plumbing on the CPU, and on the GPU with the kernels, CUDA graphs and NCCL (GPU
tests: `gpu` marker; K3_TEST_DEVICE=cpu runs their logic on the CPU)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3deploy.model.config import load_config, preset_json

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_decode as bd          # noqa: E402
# K3_TEST_DEVICE=cpu runs the GPU tests' logic on the CPU (developing them); "cuda" (the default) makes them GPU tests
DEV = os.environ.get("K3_TEST_DEVICE", "cuda")
DEV_TYPE = torch.device(DEV).type


def on_device(test):
    """A test of the runtime on DEV: marked `gpu` (skipped without CUDA) unless K3_TEST_DEVICE=cpu runs it here."""
    return pytest.mark.gpu(test) if DEV_TYPE == "cuda" else test


def gpus(n: int):
    """Skip unless this machine has n CUDA GPUs (NCCL puts one rank per GPU)."""
    have = torch.cuda.device_count() if DEV_TYPE == "cuda" else 0
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs (NCCL puts one rank per GPU); "
                                               f"this machine has {have}")


@on_device
def test_bench_decode_on_gpu(tmp_path):
    """benchmarks/bench_decode.py on k3-tiny with weights drawn on the GPU: both kernel variants, --check."""
    out = tmp_path / "b.jsonl"
    r = subprocess.run([sys.executable, "benchmarks/bench_decode.py", "--preset", "k3-tiny", "--device", DEV,
                        "--batch", "4", "--prompt-len", "16", "--steps", "4", "--warmup", "1", "--ops", "torch,kernels",
                        "--check", "--kernel-profile", "2", "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["ops"] for x in recs] == ["torch", "kernels"]
    for x in recs:
        assert x["device"].startswith(DEV_TYPE) and x["step_ms_median"] > 0 and x["check"]["passed"], x
        kp = x["kernel_profile"]
        if DEV_TYPE == "cuda":                  # the decode step launches kernels; busy time is a part of the step
            assert kp["kernels_per_step"] > 10 and 0 < kp["gpu_busy_share"] <= 1.05 and kp["top"], kp


@pytest.mark.gpu
@pytest.mark.skipif(DEV_TYPE != "cuda", reason="CUDA graphs need a CUDA GPU (K3_TEST_DEVICE is cpu)")
def test_bench_decode_cuda_graphs_on_gpu(tmp_path):
    """bench_decode --cuda-graphs on k3-tiny: graphs captured, --check against the CPU reference passes, the
    kernel profile sees the replayed kernels."""
    out = tmp_path / "b.jsonl"
    r = subprocess.run([sys.executable, "benchmarks/bench_decode.py", "--preset", "k3-tiny", "--device", DEV,
                        "--batch", "4", "--prompt-len", "16", "--steps", "4", "--warmup", "1", "--ops", "kernels",
                        "--cuda-graphs", "--check", "--kernel-profile", "2", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["cuda_graphs"] and rec["graph_capture_s"] > 0 and rec["check"]["passed"], rec
    assert rec["graph_replays"] >= 5 and rec["check"]["decode_token_agreement"] >= 0.5, rec   # decode ran in graphs
    assert rec["kernel_profile"]["kernels_per_step"] > 10, rec["kernel_profile"]


@on_device
def test_bench_decode_tp2_collectives_on_gpu0(tmp_path):
    """bench_decode under torchrun, 2 ranks on one GPU over gloo: CUDA-event collective timing per step."""
    out = tmp_path / "b.jsonl"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "benchmarks/bench_decode.py", "--preset", "k3-tiny", "--device",
                        "cuda:0" if DEV_TYPE == "cuda" else "cpu", "--dist-backend",
                        "gloo", "--tp", "2", "--ep", "2", "--batch", "2", "--prompt-len", "8", "--steps", "3",
                        "--warmup", "1", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["tp"] == 2 and len(rec["per_rank"]) == 2 and rec["collectives"]["all_reduce"]["calls_per_step"] == 27
    assert 0 < rec["collective_share"] < 1


@pytest.mark.gpu
@pytest.mark.parametrize("n", [pytest.param(2, marks=gpus(2)), pytest.param(4, marks=gpus(4))])
def test_bench_decode_tp_nccl_on_n_gpus(tmp_path, n):
    """bench_decode on k3-tiny: TP=1 on one GPU saved, then TP=n / EP=n over NCCL on n GPUs compared with it
    (teacher-forced logits, greedy tokens) and with the CPU reference (--check); NCCL collectives timed."""
    out, saved = tmp_path / "b.jsonl", tmp_path / "tp1.pt"
    base = ["benchmarks/bench_decode.py", "--preset", "k3-tiny", "--batch", "4", "--prompt-len", "16", "--steps", "4",
            "--warmup", "1", "--ops", "kernels", "--check", "--out", str(out)]
    r = subprocess.run([sys.executable] + base + ["--device", "cuda:0", "--save-logits", str(saved)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] + base
                       + ["--device", "cuda", "--tp", str(n), "--ep", str(n), "--compare-to", str(saved)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    one, many = [json.loads(x) for x in out.read_text().splitlines()]
    assert many["dist_backend"] == "nccl" and many["nccl_nvls_enable"] == "0" and many["tp"] == n
    assert {x["rank"] for x in many["per_rank"]} == set(range(n)) and many["device"] == "cuda:0"
    assert many["collectives"]["all_reduce"]["calls_per_step"] == 27 and 0 < many["collective_share"] < 1
    assert one["check"]["passed"] and many["check"]["passed"] and many["compare"]["passed"], (one, many)


def test_compare_logits_judges_decode_tokens_by_the_models_own_logits():
    """bench_decode.compare_logits: the decode path must follow the logits under test (each generated token their
    argmax or within twice the run's logit error scale of it), the logits must be close to the reference's.
    --check (expected None) judges every position, so garbage after a near tie fails and one wildly wrong position
    cannot raise the error scale; --compare-to judges up to the first position where the runs' tokens differ."""
    import argparse
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_decode import compare_logits
    a = argparse.Namespace(check_tol=0.15, check_agree=0.5)
    ref = torch.zeros(6, 5)                                   # 2 requests x 3 positions, vocab 5
    ref[torch.arange(6), torch.tensor([1, 2, 3, 4, 0, 1])] = 10.0
    test = ref + 0.006 * torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0]).repeat(6, 1)    # every row 0.006 off
    test[4, 3] = 9.995                                        # request 1, position 1: token 3 0.011 behind in test
    gen = [[1, 2, 3], [4, 3, 1]]
    res = compare_logits(a, test, ref, gen)
    assert res["logit_error_scale"] == pytest.approx(0.006, abs=1e-6) and res["inconsistent_decode_tokens"] == 0
    d = res["divergences"]
    assert [(x["request"], x["position"], x["expected"], x["own_argmax"], x["consistent"]) for x in d] == \
        [(1, 1, 0, 0, True)]
    assert d[0]["gap"] == pytest.approx(10.0) and d[0]["own_gap"] == pytest.approx(0.011, abs=1e-5)  # <= 2 x 0.006
    assert res["passed"], res
    garbage = compare_logits(a, test, ref, [[1, 2, 3], [4, 3, 2]])            # then a token 10 behind
    assert [(x["position"], x["consistent"]) for x in garbage["divergences"]] == [(1, True), (2, False)]
    assert garbage["inconsistent_decode_tokens"] == 1 and garbage["failed"] == ["inconsistent_decode_tokens > 0"]
    wild = test.clone()
    wild[4, 3], wild[4, 2] = 9.9, 50.0                        # this position's logits wildly off elsewhere
    res = compare_logits(a, wild, ref, gen)                   # token 3 is 40 behind token 2 in them: inconsistent
    assert res["logit_error_scale"] == pytest.approx(0.006, abs=1e-6) and res["inconsistent_decode_tokens"] == 1
    assert compare_logits(a, ref, ref, [[1, 2, 3], [4, 0, 1]])["divergences"] == []
    # --compare-to: the saved run generated [4, 0, 1] for request 1; this run [4, 3, 9]: judged at position 1 only
    res = compare_logits(a, test, ref, [[1, 2, 3], [4, 3, 9]], [[1, 2, 3], [4, 0, 1]])
    assert [(x["position"], x["expected"], x["consistent"]) for x in res["divergences"]] == [(1, 0, True)]
    assert res["passed"]


def test_bench_decode_compare_mistakes_fail_before_the_run(tmp_path):
    """--compare-to with another batch, seed or ops, a file that is not a --save-logits file, the same file for
    --save-logits, and a negative --kernel-profile: exit 2 with the field named, before any model is built."""
    saved, junk = tmp_path / "tp1.pt", tmp_path / "junk.json"
    base = [sys.executable, "benchmarks/bench_decode.py", "--preset", "k3-tiny", "--device", "cpu", "--batch", "2",
            "--prompt-len", "6", "--steps", "1", "--warmup", "0"]
    r = subprocess.run(base + ["--save-logits", str(saved)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0 and saved.is_file(), r.stderr
    junk.write_text("{}")
    for extra, msg in ((["--batch", "3"], "saved prompts differ"), (["--seed", "1"], "saved weights"),
                       (["--ops", "torch"], "no saved run of ops ['torch']"),
                       (["--save-logits", str(saved)], "name the same file"),
                       (["--kernel-profile", "-1"], "--kernel-profile = -1")):
        r = subprocess.run(base + ["--compare-to", str(saved)] + extra, capture_output=True, text=True, cwd=ROOT,
                           timeout=600)
        assert r.returncode == 2 and msg in r.stderr and "building" not in r.stderr, (extra, r.stderr)
    r = subprocess.run(base + ["--compare-to", str(junk)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "not a bench_decode --save-logits file" in r.stderr, r.stderr


def _bench_cpu_tp1_then_tp2(tmp_path, *extra) -> tuple[dict, dict]:
    """bench_decode on k3-tiny on the CPU with --check: TP=1 saved, then TP=2 / EP=2 under torchrun (gloo) compared
    with it; both must exit 0. Returns their records."""
    out, saved = tmp_path / "b.jsonl", tmp_path / "tp1.pt"
    base = ["benchmarks/bench_decode.py", "--preset", "k3-tiny", "--device", "cpu", "--batch", "2", "--prompt-len",
            "6", "--steps", "2", "--warmup", "1", "--check", "--check-steps", "2", "--out", str(out), *extra]
    r = subprocess.run([sys.executable] + base + ["--save-logits", str(saved)], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] + base
                       + ["--tp", "2", "--ep", "2", "--compare-to", str(saved)], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    one, two = [json.loads(x) for x in out.read_text().splitlines()]
    return one, two


def test_bench_decode_bf16_dense_cpu_single_and_tp2(tmp_path):
    """bench_decode --dense-dtype bfloat16 on the CPU: --check against the fp32 reference passes (logits within the
    tolerance, every greedy divergence a near tie; the argmax share is not required: k3-tiny's top-1 margins are
    below bf16 rounding at some of the 6 positions) but is not exact (the bf16 GEMMs ran); TP=2 / EP=2 over gloo
    with bf16 weights passes the compare with the saved bf16 TP=1 run (median relative error < 0.1) and records
    both runs' dense dtype."""
    # 6 positions of a synthetic model: the argmax share is noisy, so --check-agree 0
    one, two = _bench_cpu_tp1_then_tp2(tmp_path, "--dense-dtype", "bfloat16", "--check-agree", "0")
    assert one["dense_dtype"] == two["dense_dtype"] == "bfloat16"
    assert one["check"]["passed"] and 1e-5 < one["check"]["logits_relerr_median"] < 0.1, one["check"]
    assert two["check"]["passed"] and two["compare"]["passed"], (two["check"], two["compare"])
    assert two["compare"]["logits_relerr_median"] < 0.1 and two["compare"]["against"]["dense_dtype"] == "bfloat16"


def test_bench_decode_cpu_single_and_tp2(tmp_path):
    """The benchmark's plumbing on the CPU: JSON lines, --check against the reference, and under torchrun (gloo)
    the per-step collective counts and share."""
    one, two = _bench_cpu_tp1_then_tp2(tmp_path)
    cmp = two["compare"]                                   # TP=2 against the saved TP=1 run: fp32 reference ops
    assert cmp["passed"] and cmp["logits_relerr_max"] < 1e-4 and cmp["against"]["tp"] == 1
    assert cmp["greedy"]["requests_equal"] == 2 and cmp["greedy"]["tokens_compared"] > 0
    assert "compare" not in one
    assert one["tp"] == 1 and one["collective_share"] is None and one["check"]["logits_relerr_max"] == 0.0
    assert two["tp"] == 2 and two["dist_backend"] == "gloo" and len(two["per_rank"]) == 2
    assert two["collectives"]["all_reduce"]["calls_per_step"] == 27 and 0 < two["collective_share"] < 1
    assert two["check"]["passed"] and two["check"]["logits_relerr_max"] < 1e-4
    for rec in (one, two):
        assert rec["step_ms_median"] > 0 and rec["tokens_per_s"] > 0 and rec["prefill_s"] > 0


# ---- the step's bound, batch lists, TTFT, fused / unfused side by side (CPU) -----------------------------

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


def _run_cpu(args, tmp_path, env=None, timeout=900):
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
    r, recs = _run_cpu(["--preset", str(cfg), "--batch", "1,3", "--prompt-len", "4", "--steps", "2", "--warmup", "0",
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
    r, _ = _run_cpu(["--preset", str(cfg), "--batch", "1,2", "--check"], tmp_path)
    assert r.returncode == 2 and "one --batch" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU under the Triton interpreter (the GPU image's Triton 3.6 interpreter cannot run the "
                           "kernels' loops); the GPU side-by-side run is bench_decode's own command")
def test_fused_and_unfused_side_by_side_under_the_interpreter(tmp_path):
    """--ops kernels,kernels-unfused in one process (CPU, TRITON_INTERPRET=1): one record each, the same bound
    bytes, and the same greedy tokens (fp32: --check passes for both)."""
    cfg = _micro(tmp_path)
    r, recs = _run_cpu(["--preset", str(cfg), "--batch", "2", "--prompt-len", "3", "--steps", "1", "--warmup", "0",
                    "--ops", "kernels,kernels-unfused", "--check", "--check-steps", "1"], tmp_path,
                   env={"TRITON_INTERPRET": "1"}, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [x["ops"] for x in recs] == ["kernels", "kernels-unfused"]
    assert recs[0]["bound"]["total"] == recs[1]["bound"]["total"] and all(x["check"]["passed"] for x in recs)
