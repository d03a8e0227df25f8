"""The vision tower reference on k3-tiny-vl (VISION.md §10.1 tests 2-8), its config, checkpoint tensors and counts,
and the splice into the text model (§8.3)."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3deploy.model.config import ConfigError, load_config, preset_json
from k3deploy.model.vision import (VisionModel, axis_taps, check_grids, check_placeholders, graph_inputs, merge_index,
                                   pos_taps, rope_tables, splice, tower_flops)

GRIDS = [(1, 4, 6), (1, 8, 8), (4, 2, 2), (2, 6, 10)]          # §10.1 test 2: L = 24 + 64 + 16 + 120 = 224


@pytest.fixture(scope="module")
def vl_cfg():
    return load_config("k3-tiny-vl")


@pytest.fixture(scope="module")
def vm(vl_cfg):
    """The fp32 tower with synthetic weights (the values of a written k3-tiny-vl checkpoint, seed 0)."""
    return VisionModel.from_synthetic(vl_cfg, seed=0)


def pixels(grids, seed=0, patch=14):
    L = sum(t * h * w for t, h, w in grids)
    return torch.rand(L, 3, patch, patch, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# ---- config, inventory, counts ---------------------------------------------------------------------------------

def test_presets_and_counts(vl_cfg):
    from k3deploy.model.params import param_report
    v = vl_cfg.vision
    assert (v.hidden_size, v.num_heads, v.head_dim, v.qkv_hidden_size, v.num_layers) == (64, 4, 24, 96, 2)
    assert v.media_placeholder_token_id == 789 and (vl_cfg.bos_token_id, vl_cfg.eos_token_id, vl_cfg.pad_token_id) == (768, 770, 1023)
    assert vl_cfg.text_hash() == load_config("k3-tiny").text_hash()          # the same text model as k3-tiny
    r = param_report(vl_cfg)
    assert (r["vision_tower_params"], r["projector_params"], r["vision_params"]) == (156_736, 131_328, 288_064)
    from k3deploy.model.weights import vision_tensors
    k3 = vision_tensors(load_config("k3"))                      # (param_report(k3) itself: tests/model/test_params.py)
    assert sum(s.params for s in k3 if s.name.startswith("vision_tower.")) == 401_214_464
    assert sum(s.params for s in k3) == 447_358_976 and sum(s.nbytes for s in k3) == 894_717_952
    assert param_report(load_config("k3-vision-slice"))["vision_params"] == 80_306_176
    assert load_config("k3-vision-slice").vision.num_layers == 2 and load_config("k3-slice").vision is None
    f = tower_flops(load_config("k3").vision, [(1, 16, 16)])                 # 224²: ≈ 0.22 TFLOP (§9)
    assert 0.2e12 < f["total"] < 0.24e12


@pytest.mark.parametrize("key,value,match", [
    ("pos_emb_interpolation_mode", "nearest", "vision_config.pos_emb_interpolation_mode = 'nearest'"),
    ("projector_hidden_act", "gelu_tanh", "vision_config.projector_hidden_act = 'gelu_tanh': only 'gelu'"),
    ("qkv_hidden_size", 100, "vision_config.qkv_hidden_size = 100"),
    ("text_hidden_size", 128, "vision_config.text_hidden_size = 128: must equal text_config.hidden_size = 256"),
    ("linear_bias", True, "vision_config.linear_bias = True"),
    ("merge_kernel_size", [3, 3], "vision_config.merge_kernel_size"),
    ("vt_num_hidden_layers", None, "vision_config.vt_num_hidden_layers: missing"),
])
def test_bad_vision_config_names_the_key(key, value, match):
    j = preset_json("k3-tiny-vl")
    j["vision_config"][key] = value
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace("[", r"\[")):
        load_config(j)


def test_bad_placeholder_id():
    for pad, match in ((1024, r"outside|\[0, vocab_size=1024\)"), (770, "equals eos_token_id")):
        j = preset_json("k3-tiny-vl")
        j["media_placeholder_token_id"] = pad
        with pytest.raises(ConfigError, match=f"config.media_placeholder_token_id = {pad}"):
            load_config(j)


def test_checkpoint_round_trip_and_errors(tmp_path, vl_cfg):
    from k3deploy.model.checkpoint import Checkpoint, CheckpointError, write_checkpoint
    from k3deploy.model.synthetic import synthetic_vision_weights
    from k3deploy.model.weights import all_tensors, vision_tensors
    assert len(vision_tensors(load_config("k3"))) == 168                                       # §7.1
    text = {s.name: torch.zeros(s.shape, dtype=torch.uint8 if s.dtype == "U8" else
                                torch.float32 if s.dtype == "F32" else torch.bfloat16) for s in all_tensors(vl_cfg)}
    vis = synthetic_vision_weights(vl_cfg)
    assert all(t.dtype == torch.bfloat16 for t in vis.values())
    write_checkpoint(tmp_path / "ok", vl_cfg, {**text, **vis})
    ck = Checkpoint(tmp_path / "ok")
    ck.validate()
    got = ck.vision_weights()
    assert set(got) == set(vis) and all(torch.equal(got[k], vis[k]) for k in vis)
    # a text-only checkpoint under a config with vision_config: one problem naming the fix
    write_checkpoint(tmp_path / "text", vl_cfg, text, strict=False)
    with pytest.raises(CheckpointError, match="has a vision_config but .* names no vision_tower"):
        Checkpoint(tmp_path / "text").validate()
    # a quantized-looking (wrong dtype) and an extra vision tensor are named
    bad = dict(vis)
    bad["vision_tower.encoder.blocks.0.wo.weight"] = bad["vision_tower.encoder.blocks.0.wo.weight"].float()
    bad["vision_tower.encoder.blocks.0.wo.bias"] = torch.zeros(64, dtype=torch.bfloat16)
    write_checkpoint(tmp_path / "bad", vl_cfg, {**text, **bad}, strict=False)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path / "bad").validate()
    msg = str(e.value)
    assert "blocks.0.wo.weight" in msg and "dtype F32, expected BF16" in msg and "unexpected tensor vision_tower.encoder.blocks.0.wo.bias" in msg


# ---- §10.1 tests -----------------------------------------------------------------------------------------------

def test_packed_equals_per_segment(vm):
    """§10.1 test 2: the packed batch -> [38, 256]; packed == each segment alone (reference), and the serving
    form (grouped host tables) == the reference."""
    px = pixels(GRIDS)
    packed = vm.reference(px, GRIDS)
    assert packed.shape == (38, 256)
    parts, off = [], 0
    for g in GRIDS:
        n = g[0] * g[1] * g[2]
        parts.append(vm.reference(px[off:off + n], [g]))
        off += n
    assert (packed - torch.cat(parts)).abs().max() <= 1e-5
    assert (vm.forward(px, GRIDS) - packed).abs().max() <= 1e-5
    assert packed.std() > 0.5                    # post-normed rows: not degenerate


def test_temporal_rows_are_the_only_difference(vm):
    """§10.1 test 3: t = 2 of two identical frames differs from t = 1 only through the time rows."""
    img = pixels([(1, 4, 6)], seed=3)
    clip = torch.cat([img, img])
    one, two = vm.reference(img, [(1, 4, 6)]), vm.reference(clip, [(2, 4, 6)])
    assert (one - two).abs().max() > 1e-2
    vz = copy.copy(vm)                                                  # the same tower with Tt = 0
    vz.time_table = torch.zeros_like(vm.time_table)
    assert (vz.reference(img, [(1, 4, 6)]) - vz.reference(clip, [(2, 4, 6)])).abs().max() <= 1e-5
    assert (vz.forward(clip, [(2, 4, 6)]) - vz.reference(img, [(1, 4, 6)])).abs().max() <= 1e-5


@pytest.mark.parametrize("grid,match", [((1, 3, 4), "even"), ((1, 4, 5), "even"), ((5, 2, 2), "t must be in 1..4"),
                                        ((1, 514, 2), "over 512 patches"), ((1, 0, 2), "even and >= 2")])
def test_bad_grids_rejected(vl_cfg, vm, grid, match):
    """§10.1 test 4."""
    with pytest.raises(ValueError, match=match):
        check_grids([grid], vl_cfg.vision)
    with pytest.raises(ValueError, match="grid_thws"):
        vm.forward(torch.zeros(max(1, grid[0] * grid[1] * grid[2]), 3, 14, 14), [grid])


def test_rope_pairs(vl_cfg):
    """§10.1 test 5: pair 2m turns with the column, pair 2m+1 with the row; a 1 x w grid and its h x 1 transpose
    swap the even and odd pairs' angles."""
    Dh = vl_cfg.vision.head_dim
    cw, sw = rope_tables([(1, 1, 6)], Dh)
    ch, sh = rope_tables([(1, 6, 1)], Dh)
    ang_w, ang_h = np.arctan2(sw, cw), np.arctan2(sh, ch)
    assert np.allclose(ang_w[:, 1::2], 0) and np.allclose(ang_h[:, 0::2], 0)          # rows fixed / columns fixed
    assert np.allclose(ang_w[:, 0::2], ang_h[:, 1::2]) and np.abs(ang_w[:, 0::2]).max() > 1
    phi = 10000.0 ** (-4.0 * np.arange(Dh // 4) / Dh)                 # φ_m = 10000^(-4m/Dh), m = 0..Dh/4-1
    assert np.allclose(cw[:, 2], np.cos(np.arange(6) * phi[1]))


def test_rope_tables_equal_the_per_token_angles(vl_cfg):
    """The tables gathered from per-axis cos / sin are exactly cos / sin of each token's angle (§3.3), frames of a
    clip repeating the spatial rows, segments concatenated."""
    Dh = vl_cfg.vision.head_dim
    grids = [(1, 6, 10), (3, 4, 2), (1, 12, 4)]
    phi = 10000.0 ** (-4.0 * np.arange(Dh // 4) / Dh)
    want = []
    for t, h, w in grids:
        i, j = np.divmod(np.arange(h * w), w)
        ang = np.stack([j[:, None] * phi, i[:, None] * phi], -1).reshape(h * w, Dh // 2)
        want.append(np.tile(ang, (t, 1)))
    ang = np.concatenate(want)
    cos, sin = rope_tables(grids, Dh)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == (sum(t * h * w for t, h, w in grids), Dh // 2)
    assert np.array_equal(cos, np.cos(ang).astype(np.float32)) and np.array_equal(sin, np.sin(ang).astype(np.float32))


def test_compiled_blocks_fall_back_to_eager(vl_cfg, monkeypatch, caplog):
    """Where torch.compile cannot build the blocks, the tower warns once and runs the same eager blocks."""
    from k3deploy.model import vision as V

    def broken(fn):
        def call(*a):
            raise RuntimeError("no compiler here")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    from k3deploy.model.synthetic import synthetic_vision_weights
    w = synthetic_vision_weights(vl_cfg)
    eager = VisionModel(vl_cfg.vision, w, dtype=torch.bfloat16)
    assert eager._block is V._block                          # the CPU tower is never compiled
    eager.warmup()                                           # a no-op for it
    tower = VisionModel(vl_cfg.vision, w, dtype=torch.bfloat16)
    tower._block = V._compiled_block()
    px = pixels(GRIDS[:2], seed=4)
    with caplog.at_level("WARNING", logger="k3deploy.model.vision"):
        got = tower.forward(px, GRIDS[:2])
        again = tower.forward(px, GRIDS[:2])
    assert sum("torch.compile failed" in r.getMessage() for r in caplog.records) == 1
    want = eager.forward(px, GRIDS[:2])
    assert torch.equal(got, want) and torch.equal(again, want)


def test_tower_norm_eps(vm):
    """§10.1 test 6: an all-zero row normalizes to zeros (no NaN) and the eps is 2^-23 (§4.1)."""
    from k3deploy.model.vision import _rms
    assert vm.v.norm_eps == 2.0 ** -23
    x = torch.zeros(2, 64)
    x[1, 0] = 1e-3
    y = _rms(x, torch.ones(64), vm.v.norm_eps)
    assert torch.equal(y[0], torch.zeros(64)) and torch.isfinite(y).all()
    want = 1e-3 / np.sqrt((1e-3) ** 2 / 64 + 2.0 ** -23)        # 2^-7 would give ~0.07, 1e-5 ~0.02
    assert abs(float(y[1, 0]) - want) < 1e-4 * want


def test_splice_equals_in_model_expansion(tiny_vl_model, vm, vl_cfg):
    """§10.1 test 7: two images with pre-expanded placeholders give the embedding sequence of the reference's
    in-model expansion (one placeholder per image, the sequence grows by N_k - 1 at each); the spliced rows are
    bank row 0 of AttnRes."""
    pad = vl_cfg.vision.media_placeholder_token_id
    grids = [(1, 2, 4), (1, 4, 6)]
    feats = vm.reference(pixels(grids, seed=5), grids)
    n = [2, 6]
    single = [3, 4, pad, 5, 6, 7, pad, 8]
    expanded = [3, 4] + [pad] * n[0] + [5, 6, 7] + [pad] * n[1] + [8]
    # the reference form (KimiK3ForConditionalGeneration._merge_input_ids_with_image_features): walk the ids,
    # replace the k-th placeholder by image k's rows
    emb = tiny_vl_model.embed(torch.tensor(single))
    rows, k, off = [], 0, 0
    for i, t in enumerate(single):
        if t == pad:
            rows.append(feats[off: off + n[k]])
            off += n[k]
            k += 1
        else:
            rows.append(emb[i:i + 1])
    ref = torch.cat(rows)
    got = splice(tiny_vl_model.embed(torch.tensor(expanded)), torch.tensor(expanded), feats, pad)
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="holds 8 <\\|media_pad\\|> .* take 9"):
        check_placeholders(expanded, [2, 7], pad)
    # bank row 0: the first layer commits P = the spliced embedding
    layer0 = tiny_vl_model.layers[0]
    assert vl_cfg.is_commit(0)
    from k3deploy.model.reference import Batch, allocate_pools
    pools = allocate_pools(vl_cfg, 2, 4, 16)
    batch = Batch(torch.tensor([0, len(expanded)], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                  torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    _, bank, _ = layer0(got, got.new_zeros(len(expanded), 0, 256), batch, pools[0], tiny_vl_model.comm)
    assert torch.equal(bank[:, 0], got)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_taps_match_interpolate(vl_cfg, mode):
    """§10.1 test 8 (and the bicubic switch of §13 Q1): the host taps reproduce F.interpolate on random 8x8 tables."""
    v = dataclasses.replace(vl_cfg.vision, interpolation=mode)
    E = torch.randn(8, 8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for h, w in ((2, 2), (4, 6), (8, 8), (10, 14), (28, 40)):
        idx, wts = pos_taps([(1, h, w)], v)
        ours = (E.reshape(64, 5)[torch.from_numpy(idx)] * torch.from_numpy(wts).double()[..., None]).sum(1)
        want = F.interpolate(E.permute(2, 0, 1)[None], size=(h, w), mode=mode, align_corners=False)[0]
        assert (ours - want.permute(1, 2, 0).reshape(h * w, 5)).abs().max() < 1e-6, (h, w)
    i, wt = axis_taps(8, 8, "bilinear")
    assert (i[:, 0] == np.arange(8)).all() and np.allclose(wt[:, 0], 1)          # (8, 8): no resampling


def test_bicubic_tower_differs(vl_cfg, vm):
    """The interpolation switch reaches the tower: a bicubic copy gives other features on a resampled grid."""
    from k3deploy.model.synthetic import synthetic_vision_weights
    vb = VisionModel(dataclasses.replace(vl_cfg.vision, interpolation="bicubic"), synthetic_vision_weights(vl_cfg))
    px = pixels([(1, 4, 6)], seed=2)
    a, b = vm.reference(px, [(1, 4, 6)]), vb.reference(px, [(1, 4, 6)])
    assert (a - b).abs().max() > 1e-3 and (vb.forward(px, [(1, 4, 6)]) - b).abs().max() <= 1e-5


def test_merge_index_layout():
    """§6.1: merged token (r, c) gathers frame-major (0,0), (0,1), (1,0), (1,1) of its 2x2 block."""
    m = merge_index([(2, 2, 4)])
    assert m.shape == (2, 2, 4)
    assert m[1].tolist() == [[2, 3, 6, 7], [10, 11, 14, 15]]
    ins = graph_inputs([(1, 2, 4), (1, 4, 2)], torch.zeros(16, 588), load_config("k3-tiny-vl").vision)
    assert ins["merge_idx"][2:].flatten().tolist() == [8, 9, 10, 11, 12, 13, 14, 15]


def test_bf16_tower_close_to_fp32(vl_cfg):
    """The §12 bf16 path (what the torch backend runs on CUDA) stays close to the fp32 reference."""
    from k3deploy.model.synthetic import synthetic_vision_weights
    w = synthetic_vision_weights(vl_cfg)
    px = pixels(GRIDS, seed=9)
    ref = VisionModel(vl_cfg.vision, w).reference(px, GRIDS)
    bf = VisionModel(vl_cfg.vision, w, dtype=torch.bfloat16).forward(px, GRIDS).float()
    assert ((bf - ref).norm() / ref.norm()) < 0.03
