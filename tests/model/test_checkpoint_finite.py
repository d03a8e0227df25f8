"""Bad weights are caught where they enter: `Checkpoint.check_finite` (model/checkpoint.py) names every tensor holding
NaN/Inf (or an MXFP4 scale with the E8M0 NaN code), full or sampled; a config of another model family is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from k3deploy.model.checkpoint import SAMPLE_WHOLE, Checkpoint, CheckpointError
from k3deploy.model.config import ConfigError, load_config, parse_config, preset_json

from poison import poison_copy

EMBED = "language_model.model.embed_tokens.weight"          # bf16 [1024, 256] = 512 KiB: sampled in windows


def _scale_name(ck: Checkpoint) -> str:
    return next(n for n in ck.weight_map if n.endswith(".weight_scale"))


def test_clean_checkpoint_passes_both_modes(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    full, sampled = ck.check_finite(), ck.check_finite(sample=True)
    assert full["tensors"] == sampled["tensors"] > 0
    assert full["bytes_read"] == full["bytes_stored"] and sampled["bytes_read"] < full["bytes_read"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_value_is_named_with_its_index(tiny_ckpt, tmp_path, value):
    name = "language_model.model.layers.3.self_attn.o_proj.weight"
    bad = poison_copy(tiny_ckpt, tmp_path / "bad", name, (5, 7), value)
    ck = Checkpoint(bad)
    ck.validate()                                            # the structure is fine: only the values are bad
    with pytest.raises(CheckpointError) as ei:
        ck.check_finite()
    msg = str(ei.value)
    assert name in msg and "1 NaN/Inf values" in msg and "[5, 7]" in msg and "model-00004" in msg


def test_every_bad_tensor_is_listed(tiny_ckpt, tmp_path):
    a = poison_copy(tiny_ckpt, tmp_path / "a", EMBED, (3, slice(None)))
    ck = Checkpoint(tiny_ckpt)
    scale = _scale_name(ck)
    b = poison_copy(a, tmp_path / "b", "language_model.model.norm.weight", 0)
    entry = ck._header(ck.weight_map[scale])[0][scale]
    data = np.memmap(b / ck.weight_map[scale], dtype=np.uint8, mode="r+", offset=entry.begin, shape=(1,))
    data[0] = 255                                            # E8M0 NaN (MODEL.md §8.3)
    data.flush()
    del data
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(b).check_finite()
    probs = ei.value.problems
    assert len(probs) == 3
    assert any(EMBED in p and "256 NaN/Inf" in p for p in probs)
    assert any("norm.weight" in p for p in probs)
    assert any(scale in p and "E8M0 scale code 255" in p for p in probs)


def test_sampled_mode_reads_windows_and_catches_a_tensor_gone_nan(tiny_ckpt, tmp_path):
    ck = Checkpoint(tiny_ckpt)
    e = ck._header(ck.weight_map[EMBED])[0][EMBED]
    assert e.end - e.begin > SAMPLE_WHOLE
    whole = poison_copy(tiny_ckpt, tmp_path / "whole", EMBED, (slice(None), slice(None)))
    with pytest.raises(CheckpointError, match=f"{EMBED}.*in the sampled windows"):
        Checkpoint(whole).check_finite(sample=True)
    # a single value outside the windows is what sampling gives up (the full check still finds it)
    one = poison_copy(tiny_ckpt, tmp_path / "one", EMBED, (600, 3))
    Checkpoint(one).check_finite(sample=True)
    with pytest.raises(CheckpointError, match=EMBED):
        Checkpoint(one).check_finite()


def test_top_level_model_type_of_another_family_is_refused(tmp_path):
    j = preset_json("k3-tiny")
    j["model_type"] = "llama"
    with pytest.raises(ConfigError, match=r"^model_type = 'llama': expected 'kimi_k3'"):
        parse_config(j)
    (tmp_path / "config.json").write_text(json.dumps(j))
    with pytest.raises(ConfigError, match="model_type"):
        load_config(tmp_path)
    j["model_type"] = "kimi_k3"
    assert parse_config(j).vocab_size == load_config("k3-tiny").vocab_size
