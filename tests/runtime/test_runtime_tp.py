"""Tensor-parallel runtime (SPMD, one process per rank under torchrun, gloo on CPU): greedy tokens at TP=2
equal TP=1, for the torch backend (TP and EP experts) and the onnxruntime backend on a tp=2 export; the
collectives' profiling counters. (TP on GPUs: tests/runtime/test_cuda.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_onnxruntime_backend_tp2_export_equals_tp1(micro_ckpt, micro_build_tp2):
    out, r = micro_build_tp2
    assert r.returncode == 0, r.stderr
    assert generate(out / "onnx", "onnxruntime", 2) == generate(micro_ckpt, "torch")


def test_tp_without_a_process_group_is_a_clear_error(tiny_ckpt):
    from k3deploy.runtime.api import LLM
    with pytest.raises(ValueError, match="torchrun"):
        LLM(tiny_ckpt, backend="torch", tp=2, ep=2)


_COMM_WORKER = r'''
import json, sys, torch
from k3deploy.model.layers import Comm
from k3deploy.runtime.distributed import init_from_env, shutdown
rank, world = init_from_env("cpu")
c = Comm(rank, world)
c.all_reduce(torch.ones(4))
assert c.stats() == {}                                  # profiling off: nothing recorded
c.profile = True
y = c.all_reduce(torch.full((4,), float(rank + 1)))
z = c.all_reduce(torch.arange(6.).view(2, 3).t())       # non-contiguous input
g = c.all_gather_last(torch.full((2, 3), float(rank)))
st = c.stats()
res = {"y": y.tolist(), "z": z.tolist(), "g": g.tolist(), "stats": st}
c.reset_stats()
res["after_reset"] = c.stats()
if rank == 0:
    print(json.dumps(res))
shutdown()
'''


def test_comm_profiling_counts_and_times_collectives(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_COMM_WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["y"] == [3.0] * 4 and res["z"] == (2 * torch.arange(6.).view(2, 3).t()).tolist()
    assert res["g"] == [[0.0] * 3 + [1.0] * 3] * 2
    st = res["stats"]
    assert st["all_reduce"]["calls"] == 2 and st["all_reduce"]["bytes"] == 16 + 24
    assert st["all_gather"]["calls"] == 1 and st["all_gather"]["bytes"] == 24
    assert st["all_reduce"]["seconds"] > 0 and st["all_gather"]["seconds"] > 0
    assert res["after_reset"] == {}
