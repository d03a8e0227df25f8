"""The main job: `python export/build_engines.py` end to end on k3-tiny, the K3 dry-run plan,
idempotent reruns, and every error path with one clear message."""
from __future__ import annotations

import errno
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3deploy.export import build_engines as be
from k3deploy.export.plan import make_plan
from k3deploy.model.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "export" / "build_engines.py"


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=1200)


# ---- the real K3 plan --------------------------------------------------------------------------------------

def test_k3_dry_run_matches_seed_table_and_model_md(tmp_path):
    """Config-only checkpoint dir -> the plan; numbers from the seed's TP=8 table and MODEL.md §9-§11."""
    ck = tmp_path / "k3"
    ck.mkdir()
    shutil.copy(ROOT / "model" / "k3_config.json", ck / "config.json")
    r = run_cli("--checkpoint", ck, "--tp", 8, "--ep", 8)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for row in ("KDA Q/K/V/G2               [T,12,128]", "KDA beta                   [T,12]",
                "KDA decay                  [T,12,128]", "KDA recurrent state        [12,128,128] fp32",
                "KDA conv history           [4608,3]", "KDA F_a (replicated)       [T,128]",
                "MLA q_latent (decode)      [B,12,576]", "MLA latent (replicated)    [T,576]",
                "MoE experts per rank       112", "MoE dispatch               [T*16,3584]"):
        assert row in out, row
    # 205,056,582,464 B of text weights per rank + the replicated vision tower and projector (VISION.md §9)
    assert "vision tower + projector (replicated)         894,717,952 B" in out
    assert "205,951,300,416 B" in out and "DOES NOT FIT 8 x 141 GB" in out and "16 GPUs" in out
    assert "-- vision tower (27 blocks, D 1024, 12 heads x 128" in out and "mlp_hidden   [67588,4096]" in out
    assert "27,648 B" in out                       # latent per token per rank (§9)
    assert "29,440,401,408 B" in out              # one request at 1M context, whole model (§9)
    assert "53.6 MiB" in out                       # KDA slice per request at TP=8 (§9)
    p = make_plan(load_config("k3"), 8, 8)
    assert (p.weights.replicated, p.weights.sharded, p.weights.experts) == (11_498_150_400, 12_751_423_808, 180_807_008_256)
    assert p.weights.vision == 894_717_952 and p.weights.total == 205_056_582_464 + 894_717_952
    assert p.smallest[0] == 16 and not p.fits
    assert make_plan(load_config("k3"), 1, 1).kda_bytes_per_request == 434_110_464 + 15_261_696


def test_dry_run_of_a_weightful_checkpoint_allocates_nothing(tiny_ckpt, tmp_path):
    r = run_cli("--checkpoint", tiny_ckpt, "--dry-run", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert "== plan:" in r.stdout and not (tmp_path / "o").exists()


# ---- the default run end to end ----------------------------------------------------------------------------

def test_default_run_end_to_end_tp1(tiny_build_tp1):
    out, r = tiny_build_tp1
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "verify" / "report.json").read_text())
    assert report["passed"] and report["graphs"] and all(g["passed"] for g in report["graphs"].values())
    assert any("state_out" in g["outputs"] and "conv_out" in g["outputs"] for g in report["graphs"].values())
    assert report["end_to_end"]["passed"]
    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["match"] and smoke["runtime"] == smoke["reference"] and len(smoke["runtime"][0]) == 8
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["onnx"] == "onnx" and (out / "triton" / "k3" / "config.pbtxt").is_file()
    check_engines(out)


def test_default_log_is_each_steps_summary(tiny_build_tp1):
    """Without -v the log holds each step's start and one-line summary (plus progress bars and the plan); no
    Polygraphy notes ("[W] ... Some values are 0", the 'colored' module notice) and none of the stages' own
    per-graph / per-engine lines, which -v shows."""
    import re
    out, r = tiny_build_tp1
    assert r.returncode == 0, r.stdout + r.stderr
    for i, step in enumerate(be.STEPS, 1):
        assert re.search(rf"^\[{i}/{len(be.STEPS)}\] {step:<10} done in [0-9.]+ s: \S", r.stderr, re.M), (step, r.stderr)
    log = r.stdout + r.stderr
    assert "Some values are 0" not in log and "'colored' module" not in log, log
    assert not re.search(r"^\[[WE]\]", log, re.M), log
    assert ": PASS" not in log and ".plan in " not in log, log      # verify's per-graph and engines' per-plan lines


def check_engines(out: Path) -> None:
    """Every graph of the export has an engine whose recorded I/O equals the graph's and which has the prefill
    and decode profiles (TensorRT-RTX is in the test extra, so the engines step must have built them)."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX (the rtx extra) builds the engines")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine_flavor"] == "tensorrt-rtx"
    index = json.loads((out / "onnx" / "index.json").read_text())
    em = json.loads((out / "engines" / "manifest.json").read_text())
    assert em["model_config_hash"] == index["config_hash"] == manifest["config_hash"]
    by_onnx = {e["onnx"]: e for e in em["engines"].values()}
    assert len(by_onnx) == len(index["graphs"])
    mla_engines = 0
    for g in index["graphs"]:
        e = by_onnx[g["path"]]
        assert [i["name"] for i in e["inputs"]] == [i["name"] for i in g["inputs"]], g["id"]
        assert {o["name"] for o in e["outputs"]} == {o["name"] for o in g["outputs"]}, g["id"]
        assert len(e["options"]["profiles"]) == 2, g["id"]               # prefill and decode
        if any(i["name"] == "cache" for i in e["inputs"]):                # an MLA layer: 64-token latent blocks
            mla_engines += 1
            assert all({shape[1] for shape in prof["cache"]} == {64} for prof in e["options"]["profiles"]), g["id"]
        assert e["compute_capability"] == ["sm86"]
        assert (out / "engines" / e.get("plan", g["path"].replace(".onnx", ".plan"))).is_file()
        # no plugin is registered with TensorRT-RTX: every kimi node was lowered through its function body
        assert all(p["impl"] == "function-body" for p in e["plugins"].values()), (g["id"], e["plugins"])
    assert mla_engines > 0
    from k3deploy.runtime.executor import engine_pool_dims                  # what LLM(backend="tensorrt") takes and checks
    dims = engine_pool_dims(em)
    assert dims["BS"] == (manifest["block_size"],) * 2 == (64, 64) and dims["S"] == (manifest["max_batch"] + 1,) * 2
    assert dims["MB"][1] * 64 >= manifest["max_context"] and dims["NB"][0] == dims["NB"][1]
    kimi = {op for e in by_onnx.values() for op in e["plugins"]}
    assert {"kimi::KdaDecode", "kimi::MlaDecode", "kimi::Mxfp4Moe"} <= kimi, kimi


def test_rerun_does_no_work_and_force_redoes(tiny_build_tp1, tiny_ckpt, tmp_path):
    src, r = tiny_build_tp1
    out = tmp_path / "copy"
    shutil.copytree(src, out)   # a copy: the shared build stays as it was for other tests
    assert r.returncode == 0
    again = run_cli("--checkpoint", tiny_ckpt, "--out", out, "--max-batch", 4, "--max-num-tokens", 64)
    assert again.returncode == 0, again.stderr
    log = again.stderr
    for step in ("checkpoint", "plan", "export", "verify", "engines", "repository", "smoke"):
        assert f"{step:<10} skipped" in log, (step, log)
    state = json.loads((out / ".steps.json").read_text())
    onnx_mtime = (out / "onnx" / "index.json").stat().st_mtime_ns
    # one changed input reruns exactly the steps that depend on it
    changed = run_cli("--checkpoint", tiny_ckpt, "--out", out, "--max-batch", 3, "--max-num-tokens", 64)
    assert changed.returncode == 0, changed.stderr
    for step in ("checkpoint", "export", "verify"):
        assert f"{step:<10} skipped" in changed.stderr, step
    for step in ("plan", "engines", "repository", "smoke"):
        assert f"{step:<10} done" in changed.stderr, step
    assert (out / "onnx" / "index.json").stat().st_mtime_ns == onnx_mtime
    forced = run_cli("--checkpoint", tiny_ckpt, "--out", out, "--max-batch", 4, "--max-num-tokens", 64, "--force")
    assert forced.returncode == 0, forced.stderr
    assert "skipped (inputs unchanged)" not in forced.stderr
    assert json.loads((out / ".steps.json").read_text()).keys() == state.keys()


def test_run_tp2_ep2(micro_build_tp2):
    out, r = micro_build_tp2
    assert r.returncode == 0, r.stdout + r.stderr
    index = json.loads((out / "onnx" / "index.json").read_text())
    assert {g["rank"] for g in index["graphs"]} == {0, 1}
    report = json.loads((out / "verify" / "report.json").read_text())
    assert report["passed"] and report["end_to_end"]["passed"]
    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["tp"] == 2 and smoke["match"] and smoke["runtime"] == smoke["reference"]
    check_engines(out)


# ---- errors: one clear message, non-zero exit, nothing partial looking complete ------------------------------

def _copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("case", ["missing_shard", "truncated_shard", "no_config", "tp", "ep", "target_cc", "aot",
                                  "aot_dry_run", "aot_backend_tensorrt", "ckpt_missing", "ckpt_file"])
def test_error_paths(case, tiny_ckpt, tmp_path):
    ck = _copy_ckpt(tiny_ckpt, tmp_path / "ck")
    args = ["--checkpoint", ck, "--out", tmp_path / "out"]
    shards = sorted(ck.glob("model-*.safetensors"))
    if case == "missing_shard":
        shards[2].unlink()
        want = shards[2].name
    elif case == "truncated_shard":
        data = shards[3].read_bytes()
        shards[3].write_bytes(data[: len(data) // 2])
        want = shards[3].name
    elif case == "no_config":
        (ck / "config.json").unlink()
        want = "config.json"
    elif case == "tp":
        args += ["--tp", 3]
        want = "tp = 3"
    elif case == "ep":
        args += ["--tp", 2, "--ep", 3]
        want = "ep = 3"
    elif case == "aot":   # AOT plugins need full TensorRT: refused before step 1
        args += ["--backend", "onnxruntime", "--aot"]
        want = "--aot: ahead-of-time plugins need full TensorRT"
    elif case == "aot_dry_run":   # no --backend, full TensorRT not installed: refused by --dry-run too
        if importlib.util.find_spec("tensorrt") is not None:
            pytest.skip("full TensorRT is installed here: --aot is valid")
        args += ["--aot", "--dry-run"]
        want = "--aot: ahead-of-time plugins need full TensorRT"
    elif case == "aot_backend_tensorrt":   # --backend tensorrt --aot without full TensorRT: one message, no RTX hint
        if importlib.util.find_spec("tensorrt") is not None:
            pytest.skip("full TensorRT is installed here: --aot is valid")
        args += ["--backend", "tensorrt", "--aot"]
        want = "--aot: ahead-of-time plugins need full TensorRT >= 10.9; full TensorRT is not installed"
    elif case == "ckpt_missing":
        args[1] = ck / "nope"
        want = "does not exist"
    elif case == "ckpt_file":
        args[1] = ck / "config.json"
        want = f"is a file; pass the checkpoint directory ({ck})"
    else:   # refused before step 1, not after the export
        pytest.importorskip("tensorrt_rtx_bindings", reason="the target check needs the rtx extra")
        args += ["--backend", "tensorrt-rtx", "--target-cc", "sm90"]
        want = "--target-cc: target_cc 'sm90' not supported"
    r = run_cli(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert want in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_failed_rerun_leaves_nothing_looking_complete(tiny_build_tp1, tiny_ckpt, tmp_path):
    """A rerun whose export fails (a shard went missing after the first build) removes manifest.json: the old
    deployment no longer looks complete over a half-redone output."""
    src, r = tiny_build_tp1
    assert r.returncode == 0
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    ck = _copy_ckpt(tiny_ckpt, tmp_path / "ck")      # same bytes and mtimes: every step would be skipped ...
    sorted(ck.glob("model-*.safetensors"))[1].unlink()   # ... but a shard is gone: the checkpoint step reruns and fails
    r2 = run_cli("--checkpoint", ck, "--out", out, "--max-batch", 4, "--max-num-tokens", 64)
    assert r2.returncode == 2 and "model-00002" in r2.stderr
    assert not (out / "manifest.json").exists() and not (out / "smoke.json").exists()


def test_bad_arguments():
    for args, field in ((["--max-context", "0"], "--max-context"), (["--tp", "0"], "--tp"), (["--ep", "0"], "--ep"),
                        (["--block-size", "24"], "--block-size"), (["--block-size", "0"], "--block-size")):
        r = run_cli(*args)
        last = r.stderr.strip().splitlines()[-1]                   # argparse prints the usage (every flag) first
        assert r.returncode == 2 and f"error: {field}" in last, (args, r.stderr)
    h = run_cli("--help")
    assert h.returncode == 0 and "--dry-run" in h.stdout and "--target-cc" in h.stdout


def test_block_size_larger_than_a_request_is_refused(tiny_ckpt):
    r = run_cli("--checkpoint", tiny_ckpt, "--block-size", "8192", "--max-context", "4096", "--dry-run")
    assert r.returncode == 2 and "error: --block-size 8192: larger than a request (--max-context 4096)" in r.stderr


def test_unwritable_out(tiny_ckpt, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = run_cli("--checkpoint", tiny_ckpt, "--out", blocker / "sub")
    assert r.returncode == 2 and "--out" in r.stderr and "not writable" in r.stderr


def test_disk_full_leaves_no_complete_looking_output(tiny_ckpt, tmp_path, monkeypatch, caplog):
    """ENOSPC while writing the ONNX: exit 2 with the message; no index.json / manifest.json left behind."""
    import k3deploy.export.onnx_export as eo

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "onnx"))

    monkeypatch.setattr(eo, "save_atomic", full)
    rc = be.main(["--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / "out"), "--backend", "onnxruntime"])
    assert rc == 2
    assert "disk full" in caplog.text
    assert not (tmp_path / "out" / "onnx" / "index.json").exists()
    assert not (tmp_path / "out" / "manifest.json").exists()
