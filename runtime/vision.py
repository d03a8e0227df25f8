"""K3's image processor (VISION.md §1) and the image side of a request (§8).

    img = process_image("photo.png")                    # path, bytes, a data: URL or a PIL image
    img.grid_thw, img.num_tokens, img.pixel_values     # (1, gh, gw); (gh/2)(gw/2); [gh·gw, 3, 14, 14] fp32
    image_tokens(1024, 1024)                            # 1369: <|media_pad|> positions of a 1024x1024 image
    ids, images = prepare_images(prompt_ids, [png_bytes, "data:image/png;base64,..."], media_pad_id)
    ids, images = build_prompt(tokenizer, "look: <|kimi_image_placeholder|>", ["cat.png"], media_pad_id)

Steps (§1.2-§1.5, pixel-exact with the release): decode with Pillow; the navit resize plan (`resize_plan`: never
upscales, patch budget on the unpadded floor grid, at most `patch_limit_on_one_side` patches a side); Pillow
BICUBIC resize in the image's own mode (Pillow resizes P/1 with NEAREST and RGBA premultiplied); alpha composited on
the 8-pixel white/gray chessboard after the resize; zero (black) padding right and bottom to a multiple of 28
pixels; normalize (u8/255 - mean)/std in fp32; patchify frame-major, then patch row, then patch column.

A request carries `ProcessedImage`s and a pre-expanded prompt: each image's `<|media_pad|>` repeated
`image.num_tokens` times where its rows go (§8.3, §13 Q7). `prepare_images` does that expansion for a tokenized
prompt holding one `<|media_pad|>` per image (what the released processor's prompt block has), `build_prompt` for
text with `<|kimi_image_placeholder|>` markers (the chat encoder's). Every bad image is one `ImageError` (a
ValueError) naming the image and the fix: not decodable, zero size, over MAX_IMAGE_PIXELS or MAX_IMAGE_BYTES, a
remote URL.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import io
import logging
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from k3deploy.model.vision import ProcessorConfig, check_placeholders, parse_processor_config
from k3deploy.runtime.chat import (IMAGE_PLACEHOLDER, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END,  # noqa: F401
                                   MEDIA_PAD, text_image_segments)

log = logging.getLogger(__name__)

MAX_IMAGE_PIXELS = 89_478_485        # decoded W x H above this is refused (Pillow's decompression-bomb limit)
MAX_IMAGE_BYTES = 64 << 20           # encoded bytes (or a data: URL's payload) above this are refused


class ImageError(ValueError):
    """An image cannot be used; the message names the image and the fix."""


@dataclasses.dataclass(frozen=True)
class ResizePlan:
    """The navit plan of one image (§1.3): original width x height, resized size, right/bottom padding in pixels,
    grid (t=1, gh, gw) in patches, patches gh·gw and merged tokens (gh/2)(gw/2)."""

    width: int
    height: int
    resized_width: int
    resized_height: int
    pad_width: int
    pad_height: int
    grid: tuple[int, int, int]

    @property
    def patches(self) -> int:
        return self.grid[1] * self.grid[2]

    @property
    def tokens(self) -> int:
        return (self.grid[1] // 2) * (self.grid[2] // 2)


def resize_plan(width: int, height: int, proc: ProcessorConfig | None = None) -> ResizePlan:
    """§1.3 for an image of `width` x `height` pixels (>= 1 each). Raises ImageError for a zero or negative size."""
    proc = proc or ProcessorConfig()
    W, H = int(width), int(height)
    if W < 1 or H < 1:
        raise ImageError(f"image: size {W}x{H}; an image needs at least 1x1 pixels")
    p, S, lim = proc.patch_size, proc.patch_limit_on_one_side, proc.in_patch_limit
    s1 = math.sqrt(lim / (max(1, W // p) * max(1, H // p)))
    s = min(1.0, s1, S * p / W, S * p / H)
    w2, h2 = min(max(1, int(W * s)), S * p), min(max(1, int(H * s)), S * p)
    f = proc.factor
    pw, ph = (f - w2 % f) % f, (f - h2 % f) % f
    return ResizePlan(W, H, w2, h2, pw, ph, (1, (h2 + ph) // p, (w2 + pw) // p))


def image_tokens(width: int, height: int, proc: ProcessorConfig | None = None) -> int:
    """`<|media_pad|>` positions an image of width x height pixels takes: (gh/2)(gw/2) of its resize plan (§1.7:
    225x223 -> 72, 4000x3000 -> 15,444, 1861x7041 -> 16,817 with the release's limits)."""
    return resize_plan(width, height, proc).tokens


@dataclasses.dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One processed image: pixel_values [gh·gw, 3, p, p] fp32 in [-1, 1] (§1.5), grid_thw (1, gh, gw), the
    original width / height (for the prompt block), and `content_hash` (sha256 of the pixels and grid: equal for
    images the tower sees identically; prefix caches fold it into their block hashes)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    width: int
    height: int

    @property
    def num_patches(self) -> int:
        return self.grid_thw[0] * self.grid_thw[1] * self.grid_thw[2]

    @property
    def num_tokens(self) -> int:
        """Rows the projector writes for this image = `<|media_pad|>` positions it takes (§8.2)."""
        return (self.grid_thw[1] // 2) * (self.grid_thw[2] // 2)

    @functools.cached_property
    def content_hash(self) -> str:
        h = hashlib.sha256(np.asarray(self.grid_thw, dtype=np.int64).tobytes())
        h.update(self.pixel_values.contiguous().numpy().tobytes())
        return h.hexdigest()


def _describe(source) -> str:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"{len(source)} bytes"
    if isinstance(source, str) and source.startswith("data:"):
        return f"data URL ({len(source)} chars)"
    return repr(source) if isinstance(source, (str, Path)) else type(source).__name__


def data_url_bytes(url: str, name: str = "image") -> bytes:
    """The payload of a `data:<mime type>;base64,<data>` URL. Raises ImageError (named `name`): not that form, over
    MAX_IMAGE_BYTES, base64 that does not decode."""
    head, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise ImageError(f"{name}: a data: URL must be 'data:<mime type>;base64,<data>'; got {url[:40]!r}...")
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ImageError(f"{name}: data URL payload over {MAX_IMAGE_BYTES >> 20} MiB; send a smaller image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{name}: the data URL's base64 payload does not decode ({e})") from None


def load_image(source, name: str = "image"):
    """Decode `source` to a PIL image: a path (str / Path), bytes, a `data:[mime];base64,...` URL or a PIL image
    (returned as is). `name` prefixes the error. Raises ImageError: not decodable, empty, over MAX_IMAGE_BYTES or
    MAX_IMAGE_PIXELS, an http(s) URL (never fetched here), a missing file, a zero size."""
    from PIL import Image, UnidentifiedImageError
    if isinstance(source, Image.Image):
        img = source
    else:
        data = None
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
        elif isinstance(source, str) and source.startswith("data:"):
            data = data_url_bytes(source, name)
        elif isinstance(source, str) and source.split("://")[0].lower() in ("http", "https"):
            raise ImageError(f"{name}: {source[:60]!r} is a remote URL; the runtime does not fetch images: pass the "
                             "image's bytes, a local path or a data: URL")
        elif isinstance(source, (str, Path)):
            p = Path(source)
            if not p.is_file():
                raise ImageError(f"{name}: {str(source)[:80]!r} is not a file; pass a path, bytes or a data: URL")
            if p.stat().st_size > MAX_IMAGE_BYTES:
                raise ImageError(f"{name}: {p} is over {MAX_IMAGE_BYTES >> 20} MiB; send a smaller image")
            data = p.read_bytes()
        else:
            raise ImageError(f"{name}: {type(source).__name__} is not an image; pass a path, bytes, a data: URL or a "
                             "PIL image")
        if not data:
            raise ImageError(f"{name}: empty ({_describe(source)}); pass the image's bytes")
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError(f"{name}: {len(data)} bytes, over {MAX_IMAGE_BYTES >> 20} MiB; send a smaller image")
        try:
            img = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            why = "not an image format Pillow reads" if isinstance(e, UnidentifiedImageError) else str(e)
            raise ImageError(f"{name}: not a decodable image ({_describe(source)}: {why}); send a PNG, JPEG, WebP, "
                             "GIF or BMP file") from None
        _check_pixels(img.size, name)
        try:
            img.load()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise ImageError(f"{name}: the image data is broken ({_describe(source)}: {e}); send the whole file") from None
    _check_pixels(img.size, name)
    return img


def _check_pixels(size: tuple[int, int], name: str) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ImageError(f"{name}: size {w}x{h}; an image needs at least 1x1 pixels")
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageError(f"{name}: {w}x{h} = {w * h:,} pixels, over the limit of {MAX_IMAGE_PIXELS:,}; downscale it "
                         "first (the model sees at most ~13 MP anyway, VISION.md §1.3)")


def _chessboard(h: int, w: int, proc: ProcessorConfig) -> np.ndarray:
    """[h, w, 1] float32 background: gray where (y//sq + x//sq) is odd, white elsewhere (§1.2)."""
    sq, white, gray = proc.chessboard
    y, x = np.arange(h)[:, None] // sq, np.arange(w)[None] // sq
    return np.where((y + x) % 2 == 1, gray, white).astype(np.float32)[..., None]


def to_rgb(img, proc: ProcessorConfig | None = None) -> np.ndarray:
    """[h, w, 3] uint8 of a (resized) PIL image: RGB as is; no alpha and no transparency -> convert("RGB");
    otherwise alpha-composited on the chessboard, uint8_trunc(a·src + (1-a)·bg), a = alpha/255 in fp32 (§1.2)."""
    proc = proc or ProcessorConfig()
    if img.mode == "RGB":
        return np.asarray(img, dtype=np.uint8)
    if "A" not in img.getbands() and "transparency" not in img.info:
        return np.asarray(img.convert("RGB"), dtype=np.uint8)
    rgba = np.asarray(img.convert("RGBA"), dtype=np.float32)
    a = rgba[..., 3:] / np.float32(255)
    bg = _chessboard(rgba.shape[0], rgba.shape[1], proc)
    return (a * rgba[..., :3] + (np.float32(1) - a) * bg).astype(np.uint8)


def process_image(source, proc: ProcessorConfig | None = None, name: str = "image") -> ProcessedImage:
    """Decode (`load_image`), resize, fill alpha, pad, normalize and patchify one image (§1.2-§1.5). Raises
    ImageError (see `load_image`)."""
    from PIL import Image
    proc = proc or ProcessorConfig()
    img = load_image(source, name)
    plan = resize_plan(img.width, img.height, proc)
    if (plan.resized_width, plan.resized_height) != img.size:
        img = img.resize((plan.resized_width, plan.resized_height), Image.Resampling.BICUBIC)
    rgb = to_rgb(img, proc)
    h2, w2 = plan.resized_height + plan.pad_height, plan.resized_width + plan.pad_width
    u8 = np.zeros((h2, w2, 3), np.uint8)
    u8[: rgb.shape[0], : rgb.shape[1]] = rgb
    mean, std = np.asarray(proc.image_mean, np.float32), np.asarray(proc.image_std, np.float32)
    v = (u8.astype(np.float32) / np.float32(255) - mean) / std
    p, (_, gh, gw) = proc.patch_size, plan.grid
    patches = v.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return ProcessedImage(torch.from_numpy(np.ascontiguousarray(patches)), plan.grid, plan.width, plan.height)


def pack_images(images: Sequence[ProcessedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [L, 3, p, p] fp32, grid_thws [S, 3] int64): the images' patches end to end (§1.5)."""
    return (torch.cat([im.pixel_values for im in images]),
            torch.tensor([im.grid_thw for im in images], dtype=torch.int64))


def image_block(image: "ProcessedImage | tuple[int, int]") -> str:
    """The prompt text of one image (§8.1): `<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`
    with the ORIGINAL width x height; one `<|media_pad|>`, expanded by `expand_placeholders`."""
    w, h = (image.width, image.height) if isinstance(image, ProcessedImage) else image
    return f"{MEDIA_BEGIN}image {w}x{h}{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"


def expand_placeholders(prompt_ids: Sequence[int], images: Sequence[ProcessedImage], media_pad_id: int) -> list[int]:
    """The k-th `<|media_pad|>` of a prompt holding exactly one per image replaced by images[k].num_tokens copies
    (§8.3). Raises ImageError when the prompt's placeholders are not one per image."""
    ids = [int(t) for t in prompt_ids]
    pos = [i for i, t in enumerate(ids) if t == media_pad_id]
    if len(pos) != len(images):
        raise ImageError(f"images: {len(images)} image(s) for {len(pos)} <|media_pad|> (id {media_pad_id}) in the "
                         "prompt; put one image block (runtime.vision.image_block) per image, in order")
    out, last = [], 0
    for p, im in zip(pos, images):
        out += ids[last:p] + [media_pad_id] * im.num_tokens
        last = p + 1
    return out + ids[last:]


def process_images(sources: Sequence, proc: ProcessorConfig | None = None) -> list[ProcessedImage]:
    """`process_image` of each source; errors name the image as images[i]."""
    return [s if isinstance(s, ProcessedImage) else process_image(s, proc, f"images[{i}]") for i, s in enumerate(sources)]


def prepare_images(prompt_ids: Sequence[int], sources: Sequence, media_pad_id: int,
                   proc: ProcessorConfig | None = None) -> tuple[list[int], list[ProcessedImage]]:
    """A tokenized prompt with one `<|media_pad|>` per image (in order) + the images as bytes / data: URLs / paths /
    PIL images / ProcessedImage -> (the request's pre-expanded prompt ids, its ProcessedImages): what
    `LLM.generate(..., images=)` and `AsyncEngine.submit(..., images=)` take. Raises ImageError."""
    images = process_images(sources, proc)
    return expand_placeholders(prompt_ids, images, media_pad_id), images


def build_prompt(tokenizer, text: str, sources: Sequence, media_pad_id: int,
                 proc: ProcessorConfig | None = None) -> tuple[list[int], list[ProcessedImage]]:
    """Text with one `<|kimi_image_placeholder|>` marker per image -> (pre-expanded prompt ids, ProcessedImages):
    the text is ordinary text and the n-th marker becomes the n-th image's block with its `<|media_pad|>` expanded
    (runtime.chat.text_image_segments; the tokenizer must name the four media tokens). Raises ImageError for a
    marker / image count mismatch, a bad image, or a tokenizer that does not map `<|media_pad|>` to media_pad_id
    (§13 Q12)."""
    images = process_images(sources, proc)
    n = text.count(IMAGE_PLACEHOLDER)
    if n != len(images):
        raise ImageError(f"images: {len(images)} image(s) for {n} {IMAGE_PLACEHOLDER} marker(s) in the text; "
                         "put one marker where each image goes")
    got = tokenizer.special_ids.get(MEDIA_PAD)
    if got != media_pad_id:
        raise ImageError(f"tokenizer: {MEDIA_PAD} is {got}, the model's media_placeholder_token_id is "
                         f"{media_pad_id}; use the checkpoint's tokenizer (tokenizer_config.json special tokens)")
    return tokenizer.encode_segments(text_image_segments(text, images)), images


def load_processor(checkpoint_dir: "str | Path | None" = None, raw: dict | None = None) -> ProcessorConfig:
    """The processor of a model: `raw` (a parsed preprocessor_config.json) or the file in checkpoint_dir when
    present, else VISION.md §1.1's defaults (§13 Q5). Raises ValueError naming a bad key."""
    if raw is None and checkpoint_dir is not None:
        p = Path(checkpoint_dir) / "preprocessor_config.json"
        if p.is_file():
            import json
            try:
                raw = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: not valid JSON ({e}); restore the checkpoint's file") from e
            return parse_processor_config(raw, str(p))
    return parse_processor_config(raw)


def check_images(images, cfg, max_patches: int | None = None) -> list[ProcessedImage]:
    """Validate a request's images for model config `cfg` (a K3Config): a list of ProcessedImage, a vision tower in
    the model, each image's grid valid for it and within `max_patches` (an engine's profile). Raises ValueError
    naming `images[i]` and the fix."""
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"images: expected a list of ProcessedImage, got {type(images).__name__}")
    if images and cfg.vision is None:
        raise ValueError("images: this model has no vision tower (config.json has no vision_config); send text only")
    from k3deploy.model.vision import check_grids
    for i, im in enumerate(images):
        if not isinstance(im, ProcessedImage):
            raise ValueError(f"images[{i}]: {type(im).__name__} is not a ProcessedImage; process raw images with "
                             "runtime.vision.prepare_images (or LLM.prepare_images), which also expands the prompt")
        check_grids([im.grid_thw], cfg.vision)
        p = cfg.vision.patch_size
        if tuple(im.pixel_values.shape) != (im.num_patches, 3, p, p):
            raise ValueError(f"images[{i}]: pixel_values {list(im.pixel_values.shape)}, expected "
                             f"[{im.num_patches}, 3, {p}, {p}] for grid {im.grid_thw}")
        if max_patches is not None and im.num_patches > max_patches:
            raise ValueError(f"images[{i}]: {im.num_patches} patches ({im.width}x{im.height}), over the "
                             f"{max_patches} the vision engine was built for; rebuild with --vision-max-patches "
                             f"{im.num_patches} or send a smaller image")
    return list(images)


def request_images(prompt_ids: Sequence[int], images, cfg, max_patches: int | None = None) -> list[ProcessedImage]:
    """`check_images` plus the count check of a pre-expanded prompt (Σ num_tokens placeholders, §8.3)."""
    images = check_images(images, cfg, max_patches)
    if cfg.vision is not None:
        check_placeholders(prompt_ids, [im.num_tokens for im in images], cfg.vision.media_placeholder_token_id)
    return images
