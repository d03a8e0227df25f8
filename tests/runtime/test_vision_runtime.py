"""Images through the runtime on k3-tiny-vl (VISION.md §8.3): a two-image prompt equals the reference (torch and
onnxruntime backends), the tower runs once per image with the images of several requests in one call, chunked
prefill cutting through an image's rows gives the prefill's logits, decode never runs the tower, and bad requests
get one clear error."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from k3deploy.model.reference import SequenceState, forward
from k3deploy.model.vision import VisionModel
from k3deploy.runtime.api import LLM, SamplingParams
from k3deploy.runtime.cache import HybridCache
from k3deploy.runtime.executor import TorchExecutor
from k3deploy.runtime.scheduler import Scheduler
from k3deploy.runtime.vision import ImageError, load_processor, pack_images, process_image

PAD, BEGIN, CONTENT, END = 789, 786, 787, 788


pytestmark = pytest.mark.usefixtures("one_thread")          # tests/runtime/conftest.py


def images(ckpt, seed=0):
    """Two images: RGB 30x16 (grid (1, 2, 4): 2 rows) and RGBA 60x44 (grid (1, 4, 6): 6 rows)."""
    rng = np.random.default_rng(seed)
    proc = load_processor(ckpt)
    return [process_image(Image.fromarray(rng.integers(0, 256, (16, 30, 3), dtype=np.uint8)), proc),
            process_image(Image.fromarray(rng.integers(0, 256, (44, 60, 4), dtype=np.uint8), "RGBA"), proc)]


SINGLE = [5, 6, BEGIN, 7, 8, CONTENT, PAD, END, 9, BEGIN, 10, CONTENT, PAD, END, 11, 12]   # one pad per image


def reference_tokens(model, vm, ids, imgs, n):
    px, grids = pack_images(imgs)
    st = SequenceState(model.cfg, len(ids) + n + 1)
    logits, _ = forward(model, ids, st, image_features=vm.reference(px, grids))
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits, _ = forward(model, [out[-1]], st)
    return out


@pytest.fixture(scope="module")
def llm(tiny_vl_ckpt):
    return LLM(tiny_vl_ckpt, max_batch=4, max_num_tokens=64, max_context=128)


@pytest.fixture(scope="module")
def vm(tiny_vl_ckpt):
    return VisionModel.from_checkpoint(tiny_vl_ckpt)


def test_two_images_match_the_reference(llm, tiny_vl_model, vm, tiny_vl_ckpt):
    imgs = images(tiny_vl_ckpt)
    ids, got = llm.prepare_images(SINGLE, [im for im in imgs])
    assert ids.count(PAD) == 8 and len(ids) == len(SINGLE) + 6
    calls = []
    enc = llm.executor.encode_images
    llm.executor.encode_images = lambda px, g: calls.append(g.tolist()) or enc(px, g)
    try:
        out = llm.generate([ids, ids[:5]], SamplingParams(max_tokens=4, ignore_eos=True), images=[imgs, None])
    finally:
        llm.executor.encode_images = enc
    want = reference_tokens(tiny_vl_model, vm, ids, imgs, 4)
    assert out[0].token_ids == want
    assert calls == [[[1, 2, 4], [1, 4, 6]]]                 # one tower call for both images; decode never ran it
    other = images(tiny_vl_ckpt, seed=1)                      # the pixels matter
    assert reference_tokens(tiny_vl_model, vm, ids, other, 4) != want or \
        not torch.equal(vm.reference(*pack_images(other)), vm.reference(*pack_images(imgs)))


def test_images_of_several_requests_in_one_call(llm, tiny_vl_ckpt, tiny_vl_model, vm):
    a, b = images(tiny_vl_ckpt, 2), images(tiny_vl_ckpt, 3)
    ids_a, _ = llm.prepare_images(SINGLE, a)
    ids_b, _ = llm.prepare_images([3, PAD, 4], b[1:])
    calls = []
    enc = llm.executor.encode_images
    llm.executor.encode_images = lambda px, g: calls.append(g.tolist()) or enc(px, g)
    try:
        outs = llm.generate([ids_a, ids_b], SamplingParams(max_tokens=2, ignore_eos=True), images=[a, b[1:]])
    finally:
        llm.executor.encode_images = enc
    assert calls == [[[1, 2, 4], [1, 4, 6], [1, 4, 6]]]       # both requests' images packed into one call
    assert outs[1].token_ids == reference_tokens(tiny_vl_model, vm, ids_b, b[1:], 2)
    assert llm.scheduler.stats["images_encoded"] >= 3


class Recorder:
    """Wraps an executor: keeps the logits of every prefill forward and counts tower calls."""

    def __init__(self, ex):
        self.ex, self.logits, self.tower = ex, [], 0
        self.cfg, self.tp, self.act_dtype, self.device = ex.cfg, ex.tp, ex.act_dtype, ex.device

    def forward(self, ids, batch, pools, index, **kw):
        logits, pools = self.ex.forward(ids, batch, pools, index, **kw)
        if not batch.decode:
            self.logits.append(logits.clone())
        return logits, pools

    def encode_images(self, px, grids):
        self.tower += 1
        return self.ex.encode_images(px, grids)

    def max_image_patches(self):
        return None


def test_chunked_prefill_through_image_rows(tiny_vl_model, vm, tiny_vl_ckpt):
    """Budgets of 7 cut the first image's rows (positions 6 | 7) and the second's (13 | 14 | ... 18): the logits
    after the last chunk equal those of one prefill, and each image is encoded once."""
    imgs = images(tiny_vl_ckpt, 4)
    from k3deploy.runtime.vision import expand_placeholders
    ids = expand_placeholders(SINGLE, imgs, PAD)
    results = []
    for budget in (None, 7, 3):
        ex = Recorder(TorchExecutor(tiny_vl_model, vision=vm))
        cache = HybridCache(tiny_vl_model.cfg, 3, 1 + 2 * math.ceil(64 / 16), 16, max_context=64)
        sched = Scheduler(ex, cache, 2, 64, tiny_vl_model.cfg.eos_token_id)
        req = sched.add("r", ids, SamplingParams(max_tokens=1, ignore_eos=True), images=imgs)
        while sched.has_work():
            sched.step(token_budget=budget)
        assert ex.tower == (1 if budget is None else 2)       # the second image starts in a later chunk
        assert len(ex.logits) == (1 if budget is None else math.ceil(len(ids) / budget))
        assert req.image_rows == {} and req.finish_reason == "length"     # rows dropped once the prefill passed them
        results.append(ex.logits[-1][-1])
    # fp32 chunking noise (matmul row blocking, as tests/runtime/test_runtime.py's split prefills) is ~1e-5; a row
    # spliced at a wrong position moves the logits by ~1e-1
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(results[2], results[0], atol=1e-4, rtol=1e-4)


def test_bad_image_requests(llm, tiny_vl_ckpt):
    imgs = images(tiny_vl_ckpt)
    ids, _ = llm.prepare_images(SINGLE, imgs)
    with pytest.raises(ValueError, match="prompt 0: images: the prompt holds 7 <\\|media_pad\\|>"):
        llm.generate([ids[:7] + ids[8:]], images=[imgs])
    with pytest.raises(ValueError, match="images\\[0\\]: bytes is not a ProcessedImage"):
        llm.generate([ids], images=[[b"png", b"png"]])
    with pytest.raises(ValueError, match="images: 1 image lists for 2 prompts"):
        llm.generate([ids, ids], images=[imgs])
    with pytest.raises(ImageError, match="images\\[1\\]: not a decodable image"):
        llm.prepare_images(SINGLE, [Image.new("RGB", (8, 8)), b"garbage"])
    with pytest.raises(ValueError, match="images"):                                    # submit validates too
        llm.scheduler.add("x", ids, SamplingParams(), images=imgs[:1])
    assert "x" not in llm.scheduler.requests
    # the engine keeps serving after a bad request
    assert len(llm.generate([ids], SamplingParams(max_tokens=1), images=[imgs])[0].token_ids) == 1


def test_text_only_model_refuses_images(tiny_cfg):
    from k3deploy.runtime.vision import request_images
    im = process_image(Image.new("RGB", (30, 16)))
    with pytest.raises(ValueError, match="images: this model has no vision tower"):
        request_images([1, 2], [im], tiny_cfg)


def test_onnxruntime_backend_with_images(tiny_vl_build, tiny_vl_ckpt, tiny_vl_model, vm):
    out, r = tiny_vl_build
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    llm = LLM(out, backend="onnxruntime", max_batch=4, max_num_tokens=8, max_context=64)
    imgs = images(tiny_vl_ckpt, 5)
    ids, _ = llm.prepare_images(SINGLE, imgs)                  # the processor from the build's checkpoint
    got = llm.generate([ids], SamplingParams(max_tokens=3, ignore_eos=True), images=[imgs])[0].token_ids
    assert got == reference_tokens(tiny_vl_model, vm, ids, imgs, 3)
    feats = llm.executor.encode_images(*pack_images(imgs))
    torch.testing.assert_close(feats, vm.reference(*pack_images(imgs)), atol=1e-4, rtol=1e-3)


def test_tensorrt_vision_profiles_pick_and_split(vm):
    """The TensorRT executor's vision calls on CPU with a stand-in engine (no full TensorRT here): each call takes
    the first profile whose ranges hold it, groups larger than a profile's images-per-call are split, sizes no
    profile holds are one ValueError, and the features equal the torch tower's."""
    import types

    from k3deploy.runtime.executor import TensorRTExecutor
    ranges = [((1, 4), (2, 64)), ((1, 4), (1, 300))]                 # per profile: (VB, VL) min / max

    def shape(name, p):
        (b0, l0), (b1, l1) = ranges[p]
        tail = {"pixels": (588,), "pos_idx": (4,), "pos_w": (4,), "time_idx": (), "rope_cos": (12,), "rope_sin": (12,)}
        if name == "merge_idx":
            return (1, 1, 4), (1, 1, 4), (b1 * l1 // 4, 4, 4)
        return (b0, l0) + tail[name], (b0, l0) + tail[name], (b1, l1) + tail[name]
    engine = types.SimpleNamespace(num_optimization_profiles=2, get_tensor_profile_shape=shape)
    ex = TensorRTExecutor.__new__(TensorRTExecutor)
    from k3deploy.model.config import load_config
    ex.dir, ex.cfg = "engines", load_config("k3-tiny-vl")
    g = {"id": "rank0/vision", "kind": "vision"}
    ex.engines, ex.segments = {"rank0/vision": (engine, ["ctx0", "ctx1"])}, {("vision",): [g]}
    calls = []

    def run(graph, feeds):
        ctx, p = ex._vision_context(engine, ["ctx0", "ctx1"], feeds)
        calls.append((p, tuple(feeds["pixels"].shape[:2])))
        return {"features": vm.graph_forward(**feeds)}
    ex._run = run
    assert ex.vision_segments_per_call(64) == 2 and ex.vision_segments_per_call(140) == 1
    grids = [(1, 8, 8), (1, 10, 14), (1, 8, 8), (1, 8, 8)]
    px = torch.rand(sum(t * h * w for t, h, w in grids), 3, 14, 14) * 2 - 1
    got = ex.encode_images(px, torch.tensor(grids))
    assert calls == [(0, (2, 64)), (0, (1, 64)), (1, (1, 140))]
    torch.testing.assert_close(got, vm.forward(px, grids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="fits none of the vision engine's profiles"):
        ex._vision_context(engine, ["ctx0", "ctx1"], {"pixels": torch.zeros(1, 400, 588)})


def test_generate_cli_with_images(tiny_vl_ckpt, tiny_vl_model, vm, tmp_path, capsys):
    from k3deploy.runtime.generate import main
    paths = []
    for i, im in enumerate([Image.fromarray(np.full((16, 30, 3), 90, np.uint8)), Image.new("RGBA", (60, 44), (9, 200, 30, 120))]):
        paths.append(tmp_path / f"{i}.png")
        im.save(paths[-1])
    assert main(["--model", str(tiny_vl_ckpt), "--prompt-ids", ",".join(map(str, SINGLE)), "--image", str(paths[0]),
                 "--image", str(paths[1]), "--max-tokens", "3", "--ignore-eos", "--max-context", "64"]) == 0
    got = [int(t) for t in capsys.readouterr().out.split()]
    proc = load_processor(tiny_vl_ckpt)
    imgs = [process_image(p, proc) for p in paths]
    from k3deploy.runtime.vision import expand_placeholders
    assert got == reference_tokens(tiny_vl_model, vm, expand_placeholders(SINGLE, imgs, PAD), imgs, 3)
    assert main(["--model", str(tiny_vl_ckpt), "--prompt-ids", "1,2", "--image", str(paths[0])]) == 2
    assert "1 image(s) for 0 <|media_pad|>" in capsys.readouterr().err


@pytest.mark.gpu
def test_torch_backend_on_cuda_runs_the_bf16_tower(tiny_vl_ckpt, vm):
    """The torch backend on CUDA: the tower in bf16 with SDPA (VISION.md §12) close to the fp32 reference, and a
    two-image request completes."""
    llm = LLM(tiny_vl_ckpt, device="cuda", max_batch=2, max_num_tokens=64, max_context=64)
    assert llm.executor.vision.dtype == torch.bfloat16 and llm.executor.vision.attention == "sdpa"
    imgs = images(tiny_vl_ckpt, 6)
    px, grids = pack_images(imgs)
    got = llm.executor.encode_images(px, grids).float().cpu()
    ref = vm.reference(px, grids)
    assert float((got - ref).norm() / ref.norm()) < 0.03
    ids, _ = llm.prepare_images(SINGLE, imgs)
    out = llm.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True), images=[imgs])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2
