"""Parameter / byte accounting (MODEL.md §11) from the inventory, checked against the release numbers and a
written k3-tiny checkpoint."""
import pytest
import torch

from k3deploy.model.checkpoint import Checkpoint
from k3deploy.model.config import load_config
from k3deploy.model.params import main, param_report, report_for
from k3deploy.model.synthetic import write_synthetic


def test_k3_counts_match_release():
    r = param_report(load_config("k3"))
    assert r["total_params"] == 2_779_484_478_208
    assert r["routed_expert_params"] == 2_722_740_830_208
    assert r["non_expert_params"] == 56_743_648_000
    assert r["params_per_expert"] == 33_030_144
    assert r["moe_layers"] == 92
    assert r["embedding_params"] == r["lm_head_params"] == 1_174_405_120
    assert r["active_params"] == 104_189_614_848                    # lm_head in, input embedding out
    assert r["active_params_with_embedding"] == 104_189_614_848 + 1_174_405_120 == 105_364_019_968
    assert r["routed_expert_bytes"] == 1_446_456_066_048
    assert r["non_expert_bytes"] == 113_509_540_864
    assert r["checkpoint_bytes"] == 1_446_456_066_048 + 113_509_540_864
    assert r["vision_bytes"] == 894_717_952
    assert r["checkpoint_bytes_with_vision"] == 1_560_860_324_864   # the release's metadata.total_size
    assert (r["vision_tower_params"], r["projector_params"], r["vision_params"]) == (401_214_464, 46_144_512, 447_358_976)
    assert r["total_params_with_vision"] == 2_779_484_478_208 + 447_358_976


def test_presets_without_vision():
    for name in ("k3-tiny", "k3-slice"):
        r = param_report(load_config(name))
        assert "checkpoint_bytes_with_vision" not in r
        assert r["active_params"] < r["total_params"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("p") / "tiny"
    write_synthetic(load_config("k3-tiny"), d, seed=0)
    return d


def test_k3_tiny_counts_match_written_checkpoint(tiny_dir):
    cfg = load_config("k3-tiny")
    r = param_report(cfg)
    ck = Checkpoint(tiny_dir)
    # count from the actual stored tensors: MXFP4 packed bytes hold 2 params, scales none
    total = routed = embed = 0
    nbytes = 0
    per_expert = 0
    for name in ck.weight_map:
        t = ck.get(name)
        nbytes += t.numel() * t.element_size()
        n = 0 if name.endswith(".weight_scale") else t.numel() * (2 if name.endswith(".weight_packed") else 1)
        total += n
        if ".experts." in name:
            routed += n
            if ".layers.1.block_sparse_moe.experts.0." in name:
                per_expert += n
        if name.endswith("embed_tokens.weight"):
            embed = n
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert r["total_params"] == total
    assert r["routed_expert_params"] == routed
    assert r["params_per_expert"] == per_expert == 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size
    assert r["active_params"] == total - routed + moe_layers * cfg.num_experts_per_token * per_expert - embed
    assert r["checkpoint_bytes"] == nbytes == ck.total_size == ck.data_bytes()
    d = report_for(str(tiny_dir))
    assert d["file_data_bytes"] == d["index_total_size"] == d["checkpoint_bytes"] == nbytes


def test_cli_prints_name_value_lines(capsys, tiny_dir):
    assert main(["k3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    kv = dict(line.split(": ") for line in lines)
    assert int(kv["total_params"]) == 2_779_484_478_208
    assert int(kv["active_params"]) == 104_189_614_848
    assert main([str(tiny_dir)]) == 0
    kv = dict(line.split(": ") for line in capsys.readouterr().out.strip().splitlines())
    assert int(kv["file_data_bytes"]) == int(kv["checkpoint_bytes"])
    assert main([]) == 2
    capsys.readouterr()
    assert main(["no-such-preset"]) == 2   # one error line, no traceback
    assert capsys.readouterr().err.startswith("error: no-such-preset: neither a preset")


@pytest.mark.parametrize("preset", ["k3-tiny", "k3"])
def test_reference_model_on_meta_device_holds_the_inventory(preset):
    """The fp32 reference modules, built on the meta device (no memory), hold exactly the checkpoint's parameters
    minus the A_log padding the loader trims (32 per KDA layer for K3: 2,208) — §11's total is reproduced."""
    from k3deploy.model.params import module_params
    cfg = load_config(preset)
    pad = len(cfg.kda_layers) * (max(cfg.kda_num_heads, cfg.kda_head_dim) - cfg.kda_num_heads)
    held = module_params(cfg)
    assert held + pad == param_report(cfg)["total_params"]
    if preset == "k3":
        assert pad == 2_208 and held + pad == 2_779_484_478_208
