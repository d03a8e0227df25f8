"""Shared fixtures: one k3-tiny synthetic checkpoint per test session (MODEL.md §1.4A)."""
from __future__ import annotations

import pytest

from model.config import load_config


@pytest.fixture(scope="session")
def tiny_cfg():
    return load_config("k3-tiny")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_cfg):
    """Path of a k3-tiny synthetic checkpoint (seed 0) written through the real checkpoint writer."""
    from model.synthetic import write_synthetic
    return write_synthetic(tiny_cfg, tmp_path_factory.mktemp("k3tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    from model.reference import K3Model
    return K3Model.from_checkpoint(tiny_ckpt)
