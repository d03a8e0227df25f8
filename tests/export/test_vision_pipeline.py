"""The main job on k3-tiny-vl (VISION.md §10.1): export, Polygraphy verification, the TensorRT-RTX vision engine and a
two-image smoke, run on top of the k3-tiny build (the text graphs are unchanged and are kept)."""
from __future__ import annotations

import json

import pytest


def test_pipeline_builds_the_vision_path(tiny_vl_build):
    out, r = tiny_vl_build
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    log = r.stdout + r.stderr
    index = json.loads((out / "onnx" / "index.json").read_text())
    vision = [g for g in index["graphs"] if g["kind"] == "vision"]
    assert [g["id"] for g in vision] == ["rank0/vision"] and len(index["graphs"]) == 21
    assert [i["name"] for i in vision[0]["inputs"]] == ["pixels", "pos_idx", "pos_w", "time_idx", "rope_cos",
                                                         "rope_sin", "merge_idx"]
    assert vision[0]["outputs"] == [{"name": "features", "shape": ["VN", 256], "dtype": "float32"}]
    assert index["vision"]["media_placeholder_token_id"] == 789
    assert index["vision"]["processor"]["media_proc_cfg"]["in_patch_limit"] == 1024
    assert log.count("unchanged (input hash), skipped") == 20          # the text graphs were kept

    report = json.loads((out / "verify" / "report.json").read_text())
    assert report["passed"] and report["vision_end_to_end"]["passed"]
    assert report["graphs"]["rank0/vision"]["passed"] and not report["graphs"]["rank0/vision"].get("reused")
    assert all(g.get("reused") for k, g in report["graphs"].items() if k != "rank0/vision")
    assert report["end_to_end"]["passed"]                               # the whole text model, re-run

    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["match"] and smoke["images"][2] == [[1, 2, 4], [1, 4, 6]] and len(smoke["runtime"]) == 3
    assert smoke["prompts"][2].count(789) == 8 and len(smoke["runtime"][2]) == 8

    manifest = json.loads((out / "manifest.json").read_text())
    v = manifest["vision"]
    assert v["max_patches_per_image"] == 1220                            # 1024 + 4 x 48 + 4 (tiny limits)
    assert [p["patches_per_segment"] for p in v["profiles"]] == [[4, 1220], [4, 1220]]
    assert [p["segments_per_call"] for p in v["profiles"]] == [[1, 4], [1, 1]]
    assert "-- vision tower (2 blocks, D 64, 4 heads x 24" in (out / "plan.txt").read_text()


def test_vision_engine_in_the_engines_manifest(tiny_vl_build):
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX (the rtx extra) builds the engines")
    out, r = tiny_vl_build
    assert r.returncode == 0
    assert "1 engine(s) built, 20 up to date" in r.stdout + r.stderr
    em = json.loads((out / "engines" / "manifest.json").read_text())
    e = em["engines"]["rank0/vision.plan"]
    assert e["onnx"] == "rank0/vision.onnx" and e["compute_capability"] == ["sm86"] and e["plugins"] == {}
    assert [i["name"] for i in e["inputs"]] == ["pixels", "pos_idx", "pos_w", "time_idx", "rope_cos", "rope_sin",
                                                "merge_idx"]
    assert [i["dtype"] for i in e["inputs"]] == ["float32", "int32", "float32", "int32", "float32", "float32", "int32"]
    p0, p1 = e["options"]["profiles"]
    assert p0["pixels"] == [[1, 4, 588], [1, 1220, 588], [4, 1220, 588]]      # images per call x patches per image
    assert p1["pixels"] == [[1, 4, 588], [1, 1220, 588], [1, 1220, 588]]
    assert p0["merge_idx"][2] == [1220, 4, 4]                                  # merged tokens, frames, 2x2
    assert (out / "engines" / "rank0" / "vision.plan").stat().st_size == e["plan_bytes"] > 0
    assert em["model_config_hash"] == manifest_hash(out)


def manifest_hash(out):
    return json.loads((out / "manifest.json").read_text())["config_hash"]
