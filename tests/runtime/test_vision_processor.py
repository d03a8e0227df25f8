"""K3's image processor (VISION.md §1): the §1.7 table through image_tokens, §10.1 test 1 with the tiny limits,
pixel-level behaviour (Pillow BICUBIC, the chessboard alpha fill, black padding, normalization, patch order),
decoding every source kind, bad images as one clear error, the prompt helpers."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from k3deploy.model.vision import ProcessorConfig, parse_processor_config
from k3deploy.runtime.vision import (ImageError, build_prompt, expand_placeholders, image_block, image_tokens,
                                     load_image, prepare_images, process_image, resize_plan, to_rgb)

TINY = ProcessorConfig(in_patch_limit=1024, patch_limit_on_one_side=48)     # VISION.md §10.1's test limits

# §1.7: original W x H -> resized, pad (w, h), grid, patches, tokens (production limits)
TABLE = [((1, 1), (1, 1), (27, 27), (1, 2, 2), 4, 1), ((224, 224), (224, 224), (0, 0), (1, 16, 16), 256, 64),
         ((225, 223), (225, 223), (27, 1), (1, 16, 18), 288, 72), ((640, 480), (640, 480), (4, 24), (1, 36, 46), 1656, 414),
         ((1024, 1024), (1024, 1024), (12, 12), (1, 74, 74), 5476, 1369),
         ((1280, 720), (1280, 720), (8, 8), (1, 52, 92), 4784, 1196),
         ((1920, 1080), (1920, 1080), (12, 12), (1, 78, 138), 10764, 2691),
         ((3840, 2160), (3840, 2160), (24, 24), (1, 156, 276), 43056, 10764),
         ((4000, 3000), (4000, 3000), (4, 24), (1, 216, 286), 61776, 15444),
         ((7168, 7168), (3584, 3584), (0, 0), (1, 256, 256), 65536, 16384),
         ((1861, 7041), (1850, 7002), (26, 26), (1, 502, 134), 67268, 16817),
         ((20000, 100), (7168, 35), (0, 21), (1, 4, 512), 2048, 512)]


@pytest.mark.parametrize("orig,resized,pad,grid,patches,tokens", TABLE)
def test_worked_examples(orig, resized, pad, grid, patches, tokens):
    p = resize_plan(*orig)
    assert (p.resized_width, p.resized_height) == resized and (p.pad_width, p.pad_height) == pad
    assert p.grid == grid and p.patches == patches and p.tokens == tokens
    assert image_tokens(*orig) == tokens


def test_tiny_limits_and_patch_bound():
    """§10.1 test 1, and ProcessorConfig.max_patches() bounds every image (brute force over the tiny limits)."""
    for (w, h), resized, pad, grid, tokens in (((1000, 700), (537, 375), (23, 17), (1, 28, 40), 280),
                                               ((2000, 100), (672, 33), (0, 23), (1, 4, 48), 48),
                                               ((112, 112), (112, 112), (0, 0), (1, 8, 8), 16),
                                               ((30, 16), (30, 16), (26, 12), (1, 2, 4), 2)):
        p = resize_plan(w, h, TINY)
        assert ((p.resized_width, p.resized_height), (p.pad_width, p.pad_height), p.grid, p.tokens) == (resized, pad, grid, tokens)
    worst = max(resize_plan(w, h, TINY).patches for w in range(1, 1400, 3) for h in range(1, 1400, 7))
    assert 1024 < worst <= TINY.max_patches()
    assert ProcessorConfig().max_patches() >= 67_268                         # the largest K3 image (§1.7)


def test_pixels_padding_and_patch_order():
    """30x16 RGB: no resize; padding right/bottom is -1 after normalization; patches frame-major, row, column."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (16, 30, 3), dtype=np.uint8)
    im = process_image(Image.fromarray(a), TINY)
    assert im.grid_thw == (1, 2, 4) and im.num_tokens == 2 and (im.width, im.height) == (30, 16)
    pv = im.pixel_values
    assert pv.shape == (8, 3, 14, 14) and pv.dtype == torch.float32
    full = pv.reshape(2, 4, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(28, 56, 3).numpy()
    assert np.allclose(full[:16, :30], (a / 255.0 - 0.5) / 0.5, atol=1e-6)
    assert (full[16:] == -1).all() and (full[:, 30:] == -1).all()


def test_resize_is_pillow_bicubic():
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (700, 1000, 3), dtype=np.uint8))
    im = process_image(img, TINY)
    want = np.asarray(img.resize((537, 375), Image.Resampling.BICUBIC), dtype=np.float32) / 255 * 2 - 1
    full = im.pixel_values.reshape(28, 40, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(392, 560, 3).numpy()
    assert np.allclose(full[:375, :537], want, atol=1e-6) and (full[375:] == -1).all()


def test_alpha_on_chessboard():
    """§1.2: a = alpha/255, rgb = trunc(a·src + (1-a)·bg), bg gray 180 where (y//8 + x//8) is odd, else white."""
    rgba = np.zeros((20, 20, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[..., 3] = 0
    rgba[0, 0, 3] = 255
    rgba[0, 1, 3] = 128
    out = to_rgb(Image.fromarray(rgba, "RGBA"))
    assert tuple(out[0, 0]) == (200, 0, 0)
    assert tuple(out[0, 8]) == (180, 180, 180) and tuple(out[8, 8]) == (255, 255, 255) and tuple(out[5, 2]) == (255,) * 3
    a = np.float32(128) / np.float32(255)
    assert tuple(out[0, 1]) == tuple(np.array([a * 200 + (1 - a) * 255, (1 - a) * 255, (1 - a) * 255], np.float32).astype(np.uint8))
    # palette with transparency -> composited; L without alpha -> plain convert
    p = Image.fromarray(rgba[..., :3]).convert("P")
    p.info["transparency"] = 0
    assert to_rgb(p).shape == (20, 20, 3)
    grey = Image.fromarray(np.full((4, 4), 77, np.uint8), "L")
    assert (to_rgb(grey) == 77).all()


def test_decode_sources(tmp_path):
    img = Image.fromarray(np.random.default_rng(2).integers(0, 256, (16, 30, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    data = buf.getvalue()
    path = tmp_path / "x.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    ims = [process_image(s, TINY) for s in (data, str(path), path, url, img)]
    assert len({im.content_hash for im in ims}) == 1                           # the same pixels every way
    other = process_image(Image.fromarray(np.zeros((16, 30, 3), np.uint8)), TINY)
    assert other.content_hash != ims[0].content_hash
    assert torch.equal(ims[0].pixel_values, ims[4].pixel_values)


@pytest.mark.parametrize("source,match", [
    (b"not an image at all", "images\\[0\\]: not a decodable image"),
    (b"", "images\\[0\\]: empty"),
    ("data:image/png;base64,@@@", "base64 payload does not decode"),
    ("data:image/png,rawdata", "must be 'data:<mime type>;base64"),
    ("https://example.com/cat.png", "remote URL; the runtime does not fetch"),
    ("/no/such/file.png", "is not a file"),
    (12345, "int is not an image"),
])
def test_bad_images_are_one_clear_error(source, match):
    with pytest.raises(ImageError, match=match):
        prepare_images([1, 789, 2], [source], 789, TINY)


def test_zero_size_and_over_limit(monkeypatch):
    import k3deploy.runtime.vision as rv
    with pytest.raises(ImageError, match="size 0x5"):
        process_image(Image.new("RGB", (0, 5)))
    monkeypatch.setattr(rv, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match="11x10 = 110 pixels, over the limit of 100"):
        process_image(Image.new("RGB", (11, 10)))
    buf = io.BytesIO()
    Image.new("RGB", (11, 10)).save(buf, "PNG")
    with pytest.raises(ImageError, match="over the limit"):
        load_image(buf.getvalue())
    monkeypatch.setattr(rv, "MAX_IMAGE_PIXELS", 10 ** 6)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    with pytest.raises(ImageError, match=r"images\[0\]: the image data is broken"):
        load_image(buf.getvalue()[: len(buf.getvalue()) // 2], "images[0]")


def test_prompt_helpers():
    a = process_image(Image.new("RGB", (30, 16)), TINY)                         # 2 tokens
    b = process_image(Image.new("RGB", (112, 112)), TINY)                       # 16 tokens
    assert image_block(a) == "<|media_begin|>image 30x16<|media_content|><|media_pad|><|media_end|>"
    assert expand_placeholders([1, 789, 2, 789], [a, b], 789) == [1, 789, 789, 2] + [789] * 16
    with pytest.raises(ImageError, match="1 image\\(s\\) for 2 <\\|media_pad\\|>"):
        expand_placeholders([1, 789, 2, 789], [a], 789)

    from k3deploy.model.vocab import train_bpe
    from k3deploy.runtime.tokenizer import Tokenizer
    ranks = train_bpe("image 30x16 look at this picture " * 4, 300)
    n = len(ranks)                  # the media tokens at K3's offsets from the first special id (18..21)
    begin, pad = n + 18, n + 21
    tok = Tokenizer(ranks, {begin: "<|media_begin|>", n + 19: "<|media_content|>", n + 20: "<|media_end|>",
                            pad: "<|media_pad|>"})
    ids, ims = build_prompt(tok, "look <|kimi_image_placeholder|> and <|kimi_image_placeholder|>!",
                            [Image.new("RGB", (30, 16)), Image.new("RGB", (112, 112))], pad, TINY)
    assert ids.count(pad) == 18 and [i.num_tokens for i in ims] == [2, 16]
    assert tok.decode(ids).count("image 112x112") == 1 and ids.count(begin) == 2
    with pytest.raises(ImageError, match="2 image\\(s\\) for 1 <\\|kimi_image_placeholder\\|> marker"):
        build_prompt(tok, "one <|kimi_image_placeholder|>", [Image.new("RGB", (4, 4))] * 2, pad, TINY)
    with pytest.raises(ImageError, match="tokenizer: <\\|media_pad\\|> is None"):
        build_prompt(Tokenizer(train_bpe("abc", 260)), "x <|kimi_image_placeholder|>", [Image.new("RGB", (4, 4))], pad)


def test_preprocessor_config():
    assert parse_processor_config(None) == ProcessorConfig()
    assert parse_processor_config(TINY.to_json()) == TINY
    with pytest.raises(ValueError, match="fixed_output_tokens = 64: must be null"):
        parse_processor_config({"media_proc_cfg": {"fixed_output_tokens": 64}})
    with pytest.raises(ValueError, match="in_patch_limit = 0: must be a positive integer"):
        parse_processor_config({"media_proc_cfg": {"in_patch_limit": 0}})
