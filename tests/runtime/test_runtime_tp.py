"""Tensor-parallel runtime (SPMD, one process per rank under torchrun, gloo on CPU): greedy tokens at TP=2
equal TP=1, for the torch backend (TP and EP experts) and the onnxruntime backend on a tp=2 export."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "5,6,7,8,9,10,11"


def generate(model, backend, nproc=1, *extra):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    r = subprocess.run(launcher + ["-m", "k3deploy.runtime.generate", "--model", str(model), "--backend", backend,
                                   "--prompt-ids", PROMPT, "--max-tokens", "6", "--ignore-eos", *extra],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("ep", ["1", "2"])
def test_torch_backend_tp2_equals_tp1(tiny_ckpt, ep):
    assert generate(tiny_ckpt, "torch", 2, "--ep", ep) == generate(tiny_ckpt, "torch")


def test_onnxruntime_backend_tp2_export_equals_tp1(tiny_ckpt, tiny_build_tp2):
    out, r = tiny_build_tp2
    assert r.returncode == 0, r.stderr
    assert generate(out / "onnx", "onnxruntime", 2) == generate(tiny_ckpt, "torch")


def test_tp_without_a_process_group_is_a_clear_error(tiny_ckpt):
    from k3deploy.runtime.api import LLM
    with pytest.raises(ValueError, match="torchrun"):
        LLM(tiny_ckpt, backend="torch", tp=2, ep=2)
