"""A build never leaves output that loads as complete, and bad weights stop it at the checkpoint step
(export/build_engines.py, runtime.api.resolve_model_dir)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3deploy.export import build_engines as be
from k3deploy.runtime.api import LLM

from poison import poison_copy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "export" / "build_engines.py"
BAD = "language_model.model.layers.2.mlp.down_proj.weight"


def run_cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=1200)


def _bad_name(ckpt) -> str:
    from k3deploy.model.checkpoint import Checkpoint
    return next(n for n in Checkpoint(ckpt).weight_map if n.endswith(".o_proj.weight"))


@pytest.mark.parametrize("mode", ["full", "sampled"])
def test_nan_weight_stops_the_checkpoint_step_naming_the_tensor(tiny_ckpt, tmp_path, mode):
    """The checkpoint step said "valid"; verification failed minutes later (exit 1, max_abs 0.0, no tensor named)."""
    name = _bad_name(tiny_ckpt)
    bad = poison_copy(tiny_ckpt, tmp_path / "nan", name, (slice(None), slice(None)))     # a tensor gone NaN
    r = run_cli("--checkpoint", bad, "--out", tmp_path / "out", "--check-finite", mode)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"tensor {name} in model-" in r.stderr and "NaN/Inf" in r.stderr and "Traceback" not in r.stderr
    assert "[3/7]" not in r.stderr                                     # nothing exported
    assert not (tmp_path / "out" / "onnx").exists() and not (tmp_path / "out" / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match="incomplete build output"):
        LLM(tmp_path / "out", backend="onnxruntime")


def test_failed_rerun_over_a_good_build_does_not_load(tiny_build_tp1, tiny_ckpt, tmp_path):
    """Rebuilding a good deployment from a checkpoint that went bad: the old onnx/ stays on disk but the folder no
    longer loads (it loaded the stale graphs before)."""
    src, r = tiny_build_tp1
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    bad = poison_copy(tiny_ckpt, tmp_path / "nan", _bad_name(tiny_ckpt), (1, 2))
    r2 = run_cli("--checkpoint", bad, "--out", out, "--max-batch", 4, "--max-num-tokens", 64)
    assert r2.returncode == 2 and "NaN/Inf" in r2.stderr
    assert (out / "onnx" / "index.json").is_file() and not (out / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match=r"incomplete build output .* rerun `k3deploy build --out"):
        LLM(out, backend="onnxruntime")


def test_smoke_mismatch_leaves_no_manifest(tiny_build_tp1, tmp_path, monkeypatch, caplog):
    """The repository step wrote manifest.json before the smoke step ran: a smoke mismatch removes it."""
    src, r = tiny_build_tp1
    assert r.returncode == 0
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    (out / "smoke.json").unlink()                                         # every step skips but the smoke
    monkeypatch.setattr(be, "smoke", lambda *a, **k: {"backend": "onnxruntime", "tp": 1, "prompts": [[5]],
                                                       "runtime": [[1]], "reference": [[2]], "match": False})
    ckpt = json.loads((out / "manifest.json").read_text())["checkpoint"]
    rc = be.main(["--checkpoint", ckpt, "--out", str(out), "--max-batch", "4", "--max-num-tokens", "64"])
    assert rc == 1 and "manifest.json removed" in caplog.text
    assert not (out / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match="incomplete build output"):
        LLM(out, backend="onnxruntime")
