"""Typed config (MODEL.md §1): presets, the released config.json, and validation messages."""
import copy
import json
from pathlib import Path

import pytest
import torch

from k3deploy.model.config import K3_CONFIG_PATH, ConfigError, load_config, parse_config, preset_json

SHARED_K3 = Path(__file__).resolve().parents[3] / "shared" / "k3" / "config.json"  # ../shared beside the checkout


def test_presets_parse():
    k3 = load_config("k3")
    assert (k3.num_hidden_layers, k3.hidden_size, k3.num_experts, k3.experts_mxfp4) == (93, 7168, 896, True)
    assert len(k3.kda_layers) == 69 and len(k3.mla_layers) == 24
    assert k3.mla_layers == tuple(range(3, 92, 4)) + (92,)                     # §1.3
    assert k3.num_bank_rows == 8 and k3.kda_proj_size == 12288 and k3.latent_dim == 576
    tiny = load_config("k3-tiny")
    assert tiny.kda_layers == (0, 1, 2, 4, 5, 6) and tiny.mla_layers == (3, 7, 8)
    assert (tiny.num_expert_group, tiny.topk_group, tiny.routed_scaling_factor) == (4, 2, 2.5)
    assert tiny.experts_mxfp4                                                   # quantized path exercised
    sl = load_config("k3-slice")
    assert (sl.num_hidden_layers, sl.num_experts, sl.attn_res_block_size) == (5, 64, 2)
    assert sl.kda_layers == (0, 1, 2) and sl.mla_layers == (3, 4)
    assert sl.hidden_size == k3.hidden_size and sl.routed_expert_hidden_size == k3.routed_expert_hidden_size
    rk = load_config("k3-tp8-rank")                                         # one TP=8 rank's shapes at tp=1
    assert (rk.num_hidden_layers, rk.kda_layers, rk.mla_layers) == (93, k3.kda_layers, k3.mla_layers)
    assert (rk.kda_num_heads, rk.num_attention_heads, rk.vocab_size) == (12, 12, k3.vocab_size // 8)
    assert (rk.intermediate_size, rk.moe_intermediate_size, rk.shared_intermediate_size) == (4224, 384, 768)
    assert rk.num_experts == 448 and rk.experts_mxfp4 and rk.routed_expert_hidden_size == 3584
    from k3deploy.model.sharding import shard_layer
    from k3deploy.model.weights import layer_tensors
    for l in (0, 3, 4):                       # dense KDA, MLA + MoE, KDA + MoE: every tensor the rank's shard shape
        full = {s.name.split(f"layers.{l}.")[1]: torch.empty(s.shape, dtype=torch.uint8, device="meta")
                for s in layer_tensors(k3, l) if s.expert is None or s.expert < 2}
        mine = {s.name.split(f"layers.{l}.")[1]: s.shape for s in layer_tensors(rk, l) if s.expert is None or s.expert < 2}
        sharded = {n: tuple(t.shape) for n, t in shard_layer(k3, l, full, 0, 8).items()}
        # A_log is stored padded to max(heads, head_dim); the router scores the preset's 448 experts, not 896
        other = ("self_attn.A_log", "block_sparse_moe.gate.weight", "block_sparse_moe.gate.e_score_correction_bias")
        assert {n: v for n, v in sharded.items() if n not in other} == {n: v for n, v in mine.items() if n not in other}
        assert len(mine) == len(sharded)
    for name in ("k3", "k3-tiny", "k3-slice", "k3-tp8-rank"):
        c = load_config(name)
        assert parse_config(c.to_json()).config_hash() == c.config_hash()


@pytest.mark.skipif(not SHARED_K3.is_file(), reason="released config.json not available")
def test_k3_preset_is_the_released_file():
    assert K3_CONFIG_PATH.read_bytes() == SHARED_K3.read_bytes()
    assert preset_json("k3") == json.loads(SHARED_K3.read_text())
    assert load_config(SHARED_K3).config_hash() == load_config("k3").config_hash()


def tiny(**changes) -> dict:
    j = copy.deepcopy(preset_json("k3-tiny"))
    for key, value in changes.items():
        target = j["text_config"]
        *path, last = key.split(".")
        for p in path:
            target = target[p]
        target[last] = value
    return j


@pytest.mark.parametrize("changes, key, value, rule", [
    ({"linear_attn_config.kda_layers": [1, 2, 3, 4, 5, 6, 7]}, "kda_layers", "[4]", "both"),
    ({"linear_attn_config.full_attn_layers": [4, 8]}, "full_attn_layers", "[9]", "neither"),
    ({"kv_lora_rank": 0}, "kv_lora_rank", "0", "> 0"),
    ({"kv_lora_rank": -64}, "kv_lora_rank", "-64", "> 0"),
    ({"routed_expert_hidden_size": 100}, "routed_expert_hidden_size", "100", "multiple of 32"),
    ({"hidden_act": "gelu"}, "hidden_act", "gelu", "unknown activation"),
    ({"linear_attn_config.gate_lower_bound": -6.0}, "gate_lower_bound", "-6.0", "[-5, 0)"),
    ({"linear_attn_config.gate_lower_bound": 0.0}, "gate_lower_bound", "0.0", "[-5, 0)"),
])
def test_validation_errors_name_key_value_rule(changes, key, value, rule):
    with pytest.raises(ConfigError) as ei:
        parse_config(tiny(**changes))
    msg = str(ei.value)
    assert key in msg and value in msg and rule in msg, msg


def test_multiple_of_32_only_with_mxfp4():
    j = tiny(routed_expert_hidden_size=100)
    j["text_config"]["quantization_config"] = None
    assert parse_config(j).routed_expert_hidden_size == 100


def test_unknown_preset_lists_choices(tmp_path):
    with pytest.raises(FileNotFoundError, match="k3-tiny"):
        load_config(str(tmp_path / "nope"))
