"""Checkpoint writer / lazy reader / validation (MODEL.md §8) on synthetic k3-tiny weights."""
import copy
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from k3deploy.model.checkpoint import INDEX_NAME, Checkpoint, CheckpointError, CheckpointWriter, shard_name, write_checkpoint
from k3deploy.model.config import K3_TINY_JSON, load_config, parse_config
from k3deploy.model.synthetic import synthetic_layer, synthetic_tensors, write_synthetic
from k3deploy.model.weights import PREFIX, all_tensors, layer_tensors

CFG = load_config("k3-tiny")
L1 = f"{PREFIX}model.layers.1."               # a KDA + MoE layer
ALOG = L1 + "self_attn.A_log"
QPROJ = L1 + "self_attn.q_proj.weight"
EXPERT = L1 + "block_sparse_moe.experts.3.w1.weight_packed"
N_SHARDS = CFG.num_hidden_layers + 1
SHARD1 = shard_name(2, N_SHARDS)              # layer 1 lives in shard 2


@pytest.fixture(scope="module")
def tensors():
    return synthetic_tensors(CFG, seed=0)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, tensors):
    d = tmp_path_factory.mktemp("ck") / "tiny"
    write_checkpoint(d, CFG, tensors)
    return d


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def write_variant(tmp_path, tensors, **changes) -> Path:
    """Write `tensors` with some entries replaced (value) or removed (None), without inventory checks."""
    t = dict(tensors)
    for k, v in changes.items():
        if v is None:
            del t[k]
        else:
            t[k] = v
    d = tmp_path / "ck"
    write_checkpoint(d, CFG, t, strict=False)
    return d


def one_error(d: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(d).validate()
    assert len(ei.value.problems) == 1, ei.value.problems
    return ei.value


# ---- round trip and layout ------------------------------------------------------------------------

def test_round_trip_exact(ckpt_dir, tensors):
    ck = Checkpoint(ckpt_dir)
    ck.validate()
    assert ck.config.config_hash() == CFG.config_hash() and ck.config.experts_mxfp4
    assert json.loads((ckpt_dir / "config.json").read_text()) == CFG.to_json()
    names = {s.name for s in all_tensors(CFG)}
    assert set(ck.weight_map) == names == set(tensors)
    for name, t in tensors.items():
        got = ck.get(name)
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(bits(got), bits(t)), name
    assert ck.get(EXPERT).dtype == torch.uint8
    assert ck.get(L1 + "input_layernorm.weight").dtype == torch.bfloat16


def test_layout(ckpt_dir):
    index = json.loads((ckpt_dir / INDEX_NAME).read_text())
    files = sorted(p.name for p in ckpt_dir.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-{N_SHARDS:06d}.safetensors" for i in range(1, N_SHARDS + 1)]
    assert index["weight_map"][QPROJ] == SHARD1
    assert index["weight_map"][PREFIX + "lm_head.weight"] == files[-1]
    assert index["weight_map"][PREFIX + "model.embed_tokens.weight"] == files[-1]
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in all_tensors(CFG))
    assert not [p for p in ckpt_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    # other readers agree on the files
    from safetensors.torch import load_file
    assert torch.equal(load_file(ckpt_dir / SHARD1)[EXPERT], Checkpoint(ckpt_dir).get(EXPERT))


def test_layer_and_model_weights(ckpt_dir, tensors):
    ck = Checkpoint(ckpt_dir)
    lw = ck.layer_weights(1)
    assert set(lw) == {s.name[len(L1):] for s in layer_tensors(CFG, 1)}
    assert "block_sparse_moe.experts.3.w1.weight_packed" in lw and "self_attn.q_proj.weight" in lw
    H = CFG.kda_num_heads
    assert lw["self_attn.A_log"].shape == (H,)
    assert torch.equal(lw["self_attn.A_log"], tensors[ALOG][:H])
    assert torch.equal(bits(lw["self_attn.q_proj.weight"]), bits(tensors[QPROJ]))
    mla = ck.layer_weights(3)
    assert "self_attn.kv_b_proj.weight" in mla and "self_attn.A_log" not in mla
    assert "mlp.gate_proj.weight" in ck.layer_weights(0)
    mw = ck.model_weights()
    assert set(mw) == {"embed_tokens.weight", "norm.weight", "output_attn_res_norm.weight",
                       "output_attn_res_proj.weight", "lm_head.weight"}
    assert torch.equal(bits(mw["lm_head.weight"]), bits(tensors[PREFIX + "lm_head.weight"]))


def test_synthetic_is_per_tensor_deterministic(tensors):
    layer = synthetic_layer(CFG, 1, seed=0)
    assert all(torch.equal(bits(v), bits(tensors[k])) for k, v in layer.items())
    other = synthetic_tensors(CFG, seed=1)
    assert not torch.equal(bits(other[QPROJ]), bits(tensors[QPROJ]))
    a_log = tensors[ALOG]
    H = CFG.kda_num_heads
    assert a_log.shape == (max(H, CFG.kda_head_dim),) and bool((a_log[H:] == 0).all())
    assert bool(((a_log[:H] >= 0) & (a_log[:H] <= torch.log(torch.tensor(16.0)))).all())
    proj = tensors[L1 + "mlp_res_proj.weight"].float()
    assert proj.abs().min() > 0 and proj.std() > 0           # AttnRes pseudo-queries are non-zero


def test_lazy_reading_opens_only_needed_shard(ckpt_dir, tmp_path, tensors):
    d = tmp_path / "partial"
    shutil.copytree(ckpt_dir, d)
    for p in d.glob("*.safetensors"):
        if p.name != SHARD1:
            p.unlink()
    ck = Checkpoint(d)                                        # needs config + index only
    lw = ck.layer_weights(1)                                  # only shard 2 is read
    assert torch.equal(lw["block_sparse_moe.experts.3.w1.weight_packed"], tensors[EXPERT])
    with pytest.raises(CheckpointError, match=rf"{shard_name(N_SHARDS, N_SHARDS)}.*missing"):
        ck.get("lm_head.weight")


def test_bf16_experts_and_short_a_log_accepted(tmp_path):
    cfg = dataclasses.replace(CFG, experts_mxfp4=False)       # config.json still says MXFP4: files decide (Q13)
    t = synthetic_tensors(cfg, seed=0)
    H = CFG.kda_num_heads
    for s in all_tensors(cfg):
        if s.name.endswith(".A_log"):
            t[s.name] = t[s.name][:H].clone()                 # A_log with exactly num_heads entries
    write_checkpoint(tmp_path / "bf", cfg, t)
    ck = Checkpoint(tmp_path / "bf")
    ck.validate()
    assert not ck.config.experts_mxfp4
    lw = ck.layer_weights(1)
    assert lw["block_sparse_moe.experts.3.w1.weight"].dtype == torch.bfloat16
    assert lw["block_sparse_moe.experts.3.w1.weight"].shape == (CFG.moe_intermediate_size, CFG.routed_expert_hidden_size)
    assert lw["self_attn.A_log"].shape == (H,)


def test_vision_tensors_skipped(tmp_path, tensors):
    d = write_variant(tmp_path, tensors, **{"vision_tower.patch_embed.weight": torch.zeros(4, 4, dtype=torch.bfloat16)})
    ck = Checkpoint(d)
    ck.validate()
    assert not any("vision" in k for k in ck.model_weights())


# ---- atomic writing ------------------------------------------------------------------------------

def test_failed_write_leaves_nothing(tmp_path, tensors):
    out = tmp_path / "out"

    def boom(name):
        if name == QPROJ:
            raise RuntimeError("disk full")
        return tensors[name]

    with pytest.raises(RuntimeError):
        with CheckpointWriter(out, CFG) as w:
            for i, specs in w.plan():
                w.write_shard(i, specs, boom)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_refuses_non_empty_dir_unless_overwrite(tmp_path, tensors):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        write_checkpoint(out, CFG, tensors)
    write_checkpoint(out, CFG, tensors, overwrite=True)
    assert not (out / "keep.txt").exists()
    Checkpoint(out).validate()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_strict_writer_rejects_wrong_inventory(tmp_path, tensors):
    t = dict(tensors)
    del t[QPROJ]
    with pytest.raises(CheckpointError, match=QPROJ.replace(".", r"\.")):
        write_checkpoint(tmp_path / "x", CFG, t)
    assert not (tmp_path / "x").exists()


def test_synthetic_cli(tmp_path):
    from k3deploy.model.synthetic import main
    out = tmp_path / "cli"
    assert main(["--preset", "k3-tiny", "--out", str(out), "--seed", "3"]) == 0
    Checkpoint(out).validate()
    assert main(["--preset", "k3-tiny", "--out", str(out)]) == 2      # non-empty without --force
    assert main(["--preset", "k3-tiny", "--out", str(out), "--force"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


def test_synthetic_cli_bad_preset_and_no_space(tmp_path, capsys, monkeypatch):
    """One line and exit 2, before anything is written: an unknown preset, and a checkpoint larger than the free
    space (the k3 preset is ~1.45 TiB)."""
    import shutil
    from k3deploy.model.synthetic import main
    assert main(["--preset", "k3-huge", "--out", str(tmp_path / "a")]) == 2
    assert "--preset k3-huge: neither a preset" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 * 2**30, 9 * 2**30, 2**30))
    assert main(["--preset", "k3", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "needs 1453.66 GiB" in err and "1.00 GiB free" in err and not (tmp_path / "b").exists()


# ---- corruptions: one clear error naming tensor and file each ----------------------------------------

def test_missing_tensor(tmp_path, tensors):
    err = one_error(write_variant(tmp_path, tensors, **{QPROJ: None}))
    assert QPROJ in str(err) and INDEX_NAME in str(err) and "missing" in str(err)


def test_wrong_shape(tmp_path, tensors):
    err = one_error(write_variant(tmp_path, tensors, **{QPROJ: tensors[QPROJ][:-1].clone()}))
    assert QPROJ in str(err) and SHARD1 in str(err) and "shape" in str(err)
    assert str(list(tensors[QPROJ].shape)) in str(err)


def test_wrong_dtype(tmp_path, tensors):
    err = one_error(write_variant(tmp_path, tensors, **{QPROJ: tensors[QPROJ].float()}))
    assert QPROJ in str(err) and SHARD1 in str(err) and "F32" in str(err) and "BF16" in str(err)


def test_truncated_shard(tmp_path, ckpt_dir):
    d = tmp_path / "ck"
    shutil.copytree(ckpt_dir, d)
    path = d / SHARD1
    os.truncate(path, path.stat().st_size - 1)                # cuts the last tensor of the data blob
    err = one_error(d)
    assert SHARD1 in str(err) and "truncated" in str(err)
    ck = Checkpoint(d)
    last = max(ck._header(SHARD1)[0].items(), key=lambda kv: kv[1].end)[0]
    assert last in str(err)
    os.truncate(path, path.stat().st_size // 3)               # most of the shard gone: still one line
    err = one_error(d)
    assert f"shard {SHARD1} is truncated" in str(err) and "more end past it" in str(err)


def test_index_names_missing_shard(tmp_path, ckpt_dir):
    d = tmp_path / "ck"
    shutil.copytree(ckpt_dir, d)
    (d / SHARD1).unlink()
    err = one_error(d)
    assert SHARD1 in str(err) and "missing" in str(err) and L1 in str(err)
    # an index that points one tensor at a file that does not exist
    index = json.loads((d / INDEX_NAME).read_text())
    shutil.copy(ckpt_dir / SHARD1, d / SHARD1)
    index["weight_map"][QPROJ] = "model-00099-of-000010.safetensors"
    (d / INDEX_NAME).write_text(json.dumps(index))
    err = one_error(d)
    assert "model-00099-of-000010.safetensors" in str(err) and QPROJ in str(err)


def test_config_weights_mismatch(tmp_path):
    big = copy.deepcopy(K3_TINY_JSON)
    big["text_config"]["hidden_size"] = 512
    big["text_config"]["quantization_config"] = CFG.to_json()["text_config"]["quantization_config"]
    wrong = synthetic_tensors(parse_config(big), seed=0)      # weights made for hidden_size 512
    write_checkpoint(tmp_path / "ck", CFG, wrong, strict=False)  # config.json says 256
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(tmp_path / "ck").validate()
    first = ei.value.problems[0]
    assert "config/weights mismatch" in first and "hidden_size" in first and "512" in first
    assert QPROJ in str(ei.value) and SHARD1 in str(ei.value)


def test_nonzero_a_log_padding(tmp_path, tensors):
    bad = tensors[ALOG].clone()
    bad[-1] = 0.5
    d = write_variant(tmp_path, tensors, **{ALOG: bad})
    err = one_error(d)
    assert ALOG in str(err) and SHARD1 in str(err) and "padding" in str(err)
    with pytest.raises(CheckpointError, match=ALOG.replace(".", r"\.")):
        Checkpoint(d).layer_weights(1)
    Checkpoint(d).layer_weights(2)                            # other layers stay readable


def test_all_problems_reported_at_once(tmp_path, tensors):
    other = L1 + "self_attn.o_proj.weight"
    d = write_variant(tmp_path, tensors, **{QPROJ: None, other: tensors[other].float()})
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(d).validate()
    assert len(ei.value.problems) == 2
    assert QPROJ in str(ei.value) and other in str(ei.value)


def test_incomplete_directory_is_not_a_checkpoint(tmp_path, ckpt_dir):
    d = tmp_path / "ck"
    shutil.copytree(ckpt_dir, d)
    (d / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match="index"):
        Checkpoint(d)


def test_write_synthetic_streams_same_values(tmp_path, tensors):
    write_synthetic(CFG, tmp_path / "s", seed=0)
    ck = Checkpoint(tmp_path / "s")
    for name in (QPROJ, EXPERT, ALOG, PREFIX + "lm_head.weight"):
        assert torch.equal(bits(ck.get(name)), bits(tensors[name]))


def test_synthetic_weights_drawn_in_memory_equal_the_checkpoint(tiny_ckpt, tiny_cfg, tiny_model):
    """The in-memory / on-device generator path (K3Model.from_synthetic) reuses model.synthetic: on the CPU it
    reproduces the written checkpoint bit for bit; an EP rank draws only its own experts."""
    from k3deploy.model.reference import K3Model, SequenceState, forward
    from k3deploy.model.synthetic import synthetic_layer_weights, synthetic_model_weights
    ck = Checkpoint(tiny_ckpt)
    for l in (0, 1, 4):
        a, b = ck.layer_weights(l), synthetic_layer_weights(tiny_cfg, l, seed=0)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = ck.model_weights(), synthetic_model_weights(tiny_cfg, seed=0)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    part = synthetic_layer_weights(tiny_cfg, 1, seed=0, experts=range(4, 8))
    assert {int(k.split(".")[2]) for k in part if ".experts." in k} == {4, 5, 6, 7}
    m = K3Model.from_synthetic(tiny_cfg, seed=0)
    p = [5, 6, 7, 8]
    with torch.no_grad():
        logits = [forward(model, p, SequenceState(tiny_cfg, 64))[0] for model in (m, tiny_model)]
    assert torch.equal(*logits)
