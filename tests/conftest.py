"""Shared fixtures: one k3-tiny synthetic checkpoint per test session (MODEL.md §1.4A), a 2-layer micro cut of it,
the built deployments, and the k3-tiny-vl checkpoint and deployment (VISION.md §10.1)."""
from __future__ import annotations

import pytest

from k3deploy.model.config import load_config


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped on a machine where torch sees no CUDA device."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_cfg():
    return load_config("k3-tiny")


def _checkpoint(tmp_path_factory, cfg, name: str, seed: int):
    """Write `cfg`'s synthetic checkpoint through the real checkpoint writer; returns its directory."""
    from k3deploy.model.synthetic import write_synthetic
    return write_synthetic(cfg, tmp_path_factory.mktemp(name) / "ckpt", seed=seed)


def _model(ckpt):
    from k3deploy.model.reference import K3Model
    return K3Model.from_checkpoint(ckpt)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_cfg):
    """Path of a k3-tiny synthetic checkpoint (seed 0)."""
    return _checkpoint(tmp_path_factory, tiny_cfg, "k3tiny", 0)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    return _model(tiny_ckpt)


@pytest.fixture(scope="session")
def micro_cfg():
    """2 layers (KDA dense + MLA MoE) cut from k3-tiny: all five ops, fast enough to split prompts everywhere."""
    from k3deploy.model.config import preset_json
    j = preset_json("k3-tiny")
    tc = j["text_config"]
    tc["num_hidden_layers"] = 2
    tc["linear_attn_config"]["kda_layers"] = [1]
    tc["linear_attn_config"]["full_attn_layers"] = [2]
    tc["attn_res_block_size"] = 1
    return load_config(j)


@pytest.fixture(scope="session")
def micro_ckpt(tmp_path_factory, micro_cfg):
    """Path of the micro config's synthetic checkpoint (seed 1)."""
    return _checkpoint(tmp_path_factory, micro_cfg, "micro", 1)


@pytest.fixture(scope="session")
def micro_model(micro_ckpt):
    return _model(micro_ckpt)


def _build(ckpt, out, *extra):
    """Run the main job (export/build_engines.py) as a user would; returns (out, CompletedProcess)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]  # the repository
    r = subprocess.run([sys.executable, str(root / "export" / "build_engines.py"), "--checkpoint", str(ckpt),
                        "--out", str(out), "--max-batch", "4", "--max-num-tokens", "64", *map(str, extra)],
                       capture_output=True, text=True, cwd=root, timeout=1800)
    return out, r


@pytest.fixture(scope="session")
def tiny_build_tp1(tiny_ckpt, tmp_path_factory):
    """The main job on k3-tiny at TP=1 (shared by the pipeline, runtime and serving tests)."""
    return _build(tiny_ckpt, tmp_path_factory.mktemp("build") / "tp1")


@pytest.fixture(scope="session")
def micro_build_tp2(micro_ckpt, tmp_path_factory):
    """The main job at TP=2 / EP=2 on the micro cut of k3-tiny (2 layers: all five ops, 3 segments per layer graph
    per rank)."""
    return _build(micro_ckpt, tmp_path_factory.mktemp("build") / "tp2", "--tp", 2, "--ep", 2)


@pytest.fixture(scope="session")
def tiny_vl_cfg():
    return load_config("k3-tiny-vl")


@pytest.fixture(scope="session")
def tiny_vl_ckpt(tmp_path_factory, tiny_vl_cfg):
    """Path of a k3-tiny-vl synthetic checkpoint (seed 0: its text weights are k3-tiny's, seed 0)."""
    return _checkpoint(tmp_path_factory, tiny_vl_cfg, "k3tinyvl", 0)


@pytest.fixture(scope="session")
def tiny_vl_model(tiny_vl_ckpt):
    return _model(tiny_vl_ckpt)


def _link_tree(src, dst):
    """A copy of the build directory `src` at `dst`: big files hard-linked (every stage replaces its outputs
    atomically, so `src` is never changed), small ones copied."""
    import os
    import shutil

    def link(a, b):
        if os.path.getsize(a) > 1 << 20:
            os.link(a, b)
        else:
            shutil.copy2(a, b)
    shutil.copytree(src, dst, copy_function=link)


@pytest.fixture(scope="session")
def tiny_vl_build(tiny_vl_ckpt, tiny_build_tp1, tmp_path_factory):
    """The main job on k3-tiny-vl at TP=1, run in a copy of the k3-tiny build: the text graphs are the same (same
    text config and weights), so the pipeline keeps their export, verification and engines and builds the vision
    graph, its engine and the two-image smoke (a rerun after adding the vision tower)."""
    out = tmp_path_factory.mktemp("build") / "vl"
    _link_tree(tiny_build_tp1[0], out)
    return _build(tiny_vl_ckpt, out, "-v")       # -v: the stages' per-graph lines (kept / rebuilt)
