"""The vision path's model side (VISION.md): processor constants (§1.1), the per-batch host tables (§3, §6.1,
§11.1), the MoonViT-V2 tower + PatchMergerV2 projector (§2-§6) and the text splice (§8.3).

Two forwards of the same math, written independently:

* `VisionModel.reference(pixel_values, grid_thws)` — the fp32 reference as the release computes it: one packed
  sequence, `F.interpolate` of the learned table per segment, complex-number 2-D RoPE, attention over the packed
  sequence with a block-diagonal mask (§4.2's eager fallback), the merge as a reshape per segment.
* `VisionModel.forward(pixel_values, grid_thws)` — the serving form: segments grouped by (frames, length)
  (`group_segments`), each group one call of `graph_forward` on host tables (`graph_inputs`: bilinear/bicubic
  taps, a time-row index, RoPE cos/sin, the merge gather index). `graph_forward` is what export/onnx_export.py
  traces into one ONNX graph (§11.2; attention as standard MatMul/Softmax over `[B, heads, ℓ, Dh]`: a call holds
  equal-length segments, so no mask is needed, §11.3) and what the runtime's onnxruntime / TensorRT executors run.

dtype float32 (default) is the reference precision; bfloat16 follows §12 (BF16 GEMMs with FP32 accumulation,
norms / RoPE / GELU / merge in FP32 with one rounding), with SDPA attention (FlashAttention on CUDA).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from k3deploy.model.config import K3Config, VisionConfig

log = logging.getLogger(__name__)

ROPE_THETA = 10000.0      # §3.3, fixed in code
TIME_THETA = 10000.0      # §3.2
MAX_GRID_SIDE = 512       # RoPE table limit in patches (§3.3, asserted by the reference)


# ---- processor constants (§1.1) --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProcessorConfig:
    """The image processor's `media_proc_cfg` (VISION.md §1.1; defaults = the release's published values).

    in_patch_limit: patch budget of one image (checked on the unpadded floor grid, §1.3); patch_limit_on_one_side:
    max patches per row/column; chessboard: (square px, white, gray) of the alpha background (§1.2)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    chessboard: tuple[int, int, int] = (8, 255, 180)
    fill_stage: str = "after_resize"

    @property
    def factor(self) -> int:
        """Pixels per merged token side: merge_kernel_size x patch_size (28)."""
        return self.merge_kernel_size * self.patch_size

    def max_patches(self) -> int:
        """An upper bound of the patches one image can take: the floor grid holds at most in_patch_limit patches and
        the 28-pixel padding adds at most 2 rows and 2 columns of at most patch_limit_on_one_side patches (67,588 for
        the release's limits; the largest image found, 1861x7041, takes 67,268, §1.7)."""
        return self.in_patch_limit + 4 * self.patch_limit_on_one_side + 4

    def to_json(self) -> dict:
        """The preprocessor_config.json this config reads back as (`{"media_proc_cfg": {...}}`)."""
        sq, white, gray = self.chessboard
        return {"media_proc_cfg": {
            "patch_size": self.patch_size, "merge_kernel_size": self.merge_kernel_size,
            "in_patch_limit": self.in_patch_limit, "patch_limit_on_one_side": self.patch_limit_on_one_side,
            "fixed_output_tokens": None, "image_mean": list(self.image_mean), "image_std": list(self.image_std),
            "transparent_bg_config": {"type": "chessboard", "square_size": sq, "white": white, "gray": gray},
            "transparent_bg_fill_stage": self.fill_stage}}


# The test configs' processor limits (VISION.md §10.1: production values except these).
PROCESSOR_PRESETS: dict[str, dict] = {"k3-tiny-vl": {"in_patch_limit": 1024, "patch_limit_on_one_side": 48}}


def preset_processor(cfg: K3Config) -> ProcessorConfig:
    """The processor a synthetic checkpoint of `cfg` ships: §1.1's values, with the test limits of §10.1 for the
    k3-tiny-vl preset (looked up by `cfg.name`)."""
    return ProcessorConfig(**PROCESSOR_PRESETS.get(cfg.name, {}))


def parse_processor_config(raw: dict | None, where: str = "preprocessor_config.json") -> ProcessorConfig:
    """preprocessor_config.json (its `media_proc_cfg`, or the top level) -> ProcessorConfig; None -> the defaults.
    Keys missing from the file take §1.1's values; differing values are logged (§13 Q5). Raises ValueError naming
    the key for a bad value, a non-null `fixed_output_tokens` (§13 Q11) or a fill stage other than after_resize."""
    base = ProcessorConfig()
    if raw is None:
        return base
    m = raw.get("media_proc_cfg", raw) if isinstance(raw, dict) else None
    if not isinstance(m, dict):
        raise ValueError(f"{where}: expected a JSON object with media_proc_cfg")
    w = f"{where}: media_proc_cfg"
    kw = {}
    for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
        if key in m:
            v = m[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{w}.{key} = {v!r}: must be a positive integer")
            kw[key] = v
    for key in ("image_mean", "image_std"):
        if key in m:
            v = m[key]
            if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) for x in v)):
                raise ValueError(f"{w}.{key} = {v!r}: must be a list of 3 numbers (R, G, B)")
            if key == "image_std" and min(v) <= 0:
                raise ValueError(f"{w}.image_std = {v!r}: must be > 0")
            kw[key] = tuple(float(x) for x in v)
    if m.get("fixed_output_tokens") is not None:
        raise ValueError(f"{w}.fixed_output_tokens = {m['fixed_output_tokens']!r}: must be null; a fixed token count "
                         "would no longer match the image's grid (VISION.md §13 Q11)")
    stage = m.get("transparent_bg_fill_stage", base.fill_stage)
    if stage != "after_resize":
        raise ValueError(f"{w}.transparent_bg_fill_stage = {stage!r}: only 'after_resize' is supported (§1.2)")
    bg = m.get("transparent_bg_config")
    if bg is not None:
        if not isinstance(bg, dict) or bg.get("type", "chessboard") != "chessboard":
            raise ValueError(f"{w}.transparent_bg_config = {bg!r}: only a chessboard background is supported (§1.2)")
        kw["chessboard"] = (int(bg.get("square_size", 8)), int(bg.get("white", 255)), int(bg.get("gray", 180)))
    cfg = ProcessorConfig(**kw)
    diff = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(base, f.name)}
    if diff and (where, str(diff)) not in _LOGGED:
        _LOGGED.add((where, str(diff)))
        log.info("%s differs from VISION.md §1.1's defaults: %s", where, diff)
    return cfg


_LOGGED: set = set()     # (file, differences) already logged once


# ---- grids and host tables (§3, §6.1, §11.1) ----------------------------------------------------------------------

def check_grids(grid_thws, v: VisionConfig) -> list[tuple[int, int, int]]:
    """grid_thws [S, 3] (tensor, array or list of (t, h, w)) -> list of int triples. Raises ValueError naming the
    segment: t outside 1..init_pos_emb_time, h or w odd or < 2 (the 2x2 merge), or a side over 512 patches."""
    g = np.asarray(grid_thws.cpu() if isinstance(grid_thws, torch.Tensor) else grid_thws, dtype=np.int64)
    if g.ndim != 2 or g.shape[1] != 3 or g.shape[0] == 0:
        raise ValueError(f"grid_thws: shape {list(g.shape)}, expected [segments >= 1, 3] of (t, h, w)")
    out = []
    for s, (t, h, w) in enumerate(g.tolist()):
        if not 1 <= t <= v.pos_emb_time:
            raise ValueError(f"grid_thws[{s}] = ({t}, {h}, {w}): t must be in 1..{v.pos_emb_time} frames per segment "
                             "(init_pos_emb_time temporal rows, §3.2)")
        if h < 2 or w < 2 or h % 2 or w % 2:
            raise ValueError(f"grid_thws[{s}] = ({t}, {h}, {w}): h and w must be even and >= 2 (the 2x2 merge, §6.1)")
        if h > MAX_GRID_SIDE or w > MAX_GRID_SIDE:
            raise ValueError(f"grid_thws[{s}] = ({t}, {h}, {w}): a side over {MAX_GRID_SIDE} patches exceeds the RoPE "
                             "table (§3.3)")
        out.append((t, h, w))
    return out


def merged_tokens(grids: Iterable[tuple[int, int, int]]) -> list[int]:
    """Merged (output) tokens per segment: (h/2)(w/2), independent of t (§6.1)."""
    return [(h // 2) * (w // 2) for _, h, w in grids]


def axis_taps(n: int, m: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """1-D resampling taps of PyTorch `F.interpolate(align_corners=False, antialias=False)` from n to m samples:
    (indices [m, k] int64, weights [m, k] float64), k = 2 (bilinear: half-pixel source clamped at 0) or 4 (bicubic:
    A = -0.75, indices clamped to the border, source not clamped). VISION.md §3.1."""
    d = np.arange(m, dtype=np.float64)
    scale = n / m
    if mode == "bilinear":
        src = np.maximum((d + 0.5) * scale - 0.5, 0.0)
        i0 = np.minimum(np.floor(src).astype(np.int64), n - 1)
        i1 = np.minimum(i0 + 1, n - 1)
        lam = src - i0
        return np.stack([i0, i1], 1), np.stack([1 - lam, lam], 1)
    if mode == "bicubic":
        A = -0.75
        src = (d + 0.5) * scale - 0.5
        fl = np.floor(src)
        t = src - fl

        def c1(x):   # |x| <= 1
            return ((A + 2) * x - (A + 3)) * x * x + 1

        def c2(x):   # 1 < |x| < 2
            return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A
        w = np.stack([c2(t + 1), c1(t), c1(1 - t), c2(2 - t)], 1)
        idx = np.clip(fl.astype(np.int64)[:, None] + np.arange(-1, 3)[None], 0, n - 1)
        return idx, w
    raise ValueError(f"mode = {mode!r}: choose 'bilinear' or 'bicubic'")


def pos_taps(grids: Sequence[tuple[int, int, int]], v: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per patch token, the taps into the flattened learned table `[H*W, D]`: (indices [L, K] int64, weights
    [L, K] float32), K = 4 (bilinear) or 16 (bicubic); frames of a clip repeat the spatial taps (§3.1)."""
    idx, wts = [], []
    for t, h, w in grids:
        ri, rw = axis_taps(v.pos_emb_height, h, v.interpolation)
        ci, cw = axis_taps(v.pos_emb_width, w, v.interpolation)
        i2 = (ri[:, None, :, None] * v.pos_emb_width + ci[None, :, None, :]).reshape(h * w, -1)
        w2 = (rw[:, None, :, None] * cw[None, :, None, :]).reshape(h * w, -1)
        idx.append(np.tile(i2, (t, 1)))
        wts.append(np.tile(w2, (t, 1)))
    return np.concatenate(idx), np.concatenate(wts).astype(np.float32)


def time_index(grids: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """[L] int64 row of `[0; Tt]` each token adds: 0 (no temporal term) for a still image, f + 1 for frame f of a
    clip with t > 1 (§3.2)."""
    return np.concatenate([np.zeros(h * w, np.int64) if t == 1 else np.repeat(np.arange(1, t + 1), h * w)
                           for t, h, w in grids])


def temporal_table(v: VisionConfig) -> torch.Tensor:
    """Tt [init_pos_emb_time, D] fp32: [sin(f·ω) | cos(f·ω)], ω_k = 10000^(-k/(D/2)) (§3.2)."""
    half = v.hidden_size // 2
    omega = TIME_THETA ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = torch.arange(v.pos_emb_time, dtype=torch.float64)[:, None] * omega[None]
    return torch.cat([ang.sin(), ang.cos()], 1).float()


def rope_tables(grids: Sequence[tuple[int, int, int]], head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token (cos, sin) [L, head_dim/2] float32 of the 2-D RoPE (§3.3): pair 2m turns by j·φ_m (column),
    pair 2m+1 by i·φ_m (row), φ_m = 10000^(-4m/head_dim); frames of a clip share the spatial angles."""
    phi = ROPE_THETA ** (-4.0 * np.arange(head_dim // 4) / head_dim)
    cos, sin = [], []
    for t, h, w in grids:
        n = max(h, w)                                  # cos / sin of k·φ for k < max(h, w), gathered per token
        ang = np.arange(n)[:, None] * phi[None]
        c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        i, j = np.divmod(np.arange(h * w), w)
        for tab, out in ((c, cos), (s, sin)):
            out.append(np.tile(np.stack([tab[j], tab[i]], -1).reshape(h * w, head_dim // 2), (t, 1)))
    return np.concatenate(cos), np.concatenate(sin)


def merge_index(grids: Sequence[tuple[int, int, int]], offsets: Sequence[int] | None = None) -> np.ndarray:
    """[N, t, 4] int64 (one t for all segments): merged token (r, c) of a segment gathers, per frame, its 4 source
    tokens in (dy, dx) = (0,0), (0,1), (1,0), (1,1) order (§6.1). offsets: each segment's first token (default
    packed end to end). Raises ValueError for segments of different t."""
    ts = {t for t, _, _ in grids}
    if len(ts) != 1:
        raise ValueError(f"merge_index: segments with t = {sorted(ts)}; one gather table takes one t")
    rows, off = [], 0
    for s, (t, h, w) in enumerate(grids):
        base = off if offsets is None else offsets[s]
        r, c = np.divmod(np.arange((h // 2) * (w // 2)), w // 2)
        dy, dx = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])
        sp = (2 * r[:, None] + dy[None]) * w + (2 * c[:, None] + dx[None])            # [n, 4]
        f = np.arange(t)[None, :, None] * (h * w)
        rows.append(base + f + sp[:, None, :])
        off += t * h * w
    return np.concatenate(rows)


def group_segments(grids: Sequence[tuple[int, int, int]]) -> list[list[int]]:
    """Segment indices grouped by (t, t·h·w), in first-appearance order: one group = one call of the graph
    (equal-length segments batch as [B, ℓ] with no attention mask, §11.2)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for s, (t, h, w) in enumerate(grids):
        groups.setdefault((t, t * h * w), []).append(s)
    return list(groups.values())


def encode_grouped(pixel_values: torch.Tensor, grid_thws, v: VisionConfig, call, max_segments=None) -> torch.Tensor:
    """Run a packed batch through a one-group backend: segments grouped by (t, length) (`group_segments`), each
    group's `graph_inputs` passed to `call(inputs) -> features [n, text_hidden]` (the torch graph_forward, an
    onnxruntime session, a TensorRT engine), the rows put back in input order -> [N, text_hidden].
    max_segments(length) -> int: segments one call may hold (an engine profile's limit; default unbounded).
    Raises ValueError for bad grids or a patch count that does not match them."""
    grids = check_grids(grid_thws, v)
    lens = [t * h * w for t, h, w in grids]
    if pixel_values.shape[0] != sum(lens):
        raise ValueError(f"pixel_values: {pixel_values.shape[0]} patches, grid_thws needs {sum(lens)}")
    starts = np.concatenate([[0], np.cumsum(lens)])
    outs: list = [None] * len(grids)
    calls = []
    for group in group_segments(grids):
        t, h, w = grids[group[0]]
        cap = max(1, max_segments(t * h * w)) if max_segments else len(group)
        calls += [group[i:i + cap] for i in range(0, len(group), cap)]
    for group in calls:
        sub = [grids[s] for s in group]
        rows = torch.cat([pixel_values[starts[s]:starts[s + 1]] for s in group])
        feats = call(graph_inputs(sub, rows, v))
        for s, f in zip(group, feats.split(merged_tokens(sub))):
            outs[s] = f
    return torch.cat(outs)


GRAPH_INPUTS = ("pixels", "pos_idx", "pos_w", "time_idx", "rope_cos", "rope_sin", "merge_idx")


def graph_inputs(grids: Sequence[tuple[int, int, int]], pixels: torch.Tensor, v: VisionConfig) -> dict[str, torch.Tensor]:
    """The graph's inputs for B segments of equal t and length ℓ whose patches are `pixels` [B·ℓ, 3, p, p] (or
    [B·ℓ, 3p²]): pixels [B, ℓ, 3p²] fp32, pos_idx [B, ℓ, K] int32, pos_w [B, ℓ, K] fp32, time_idx [B, ℓ] int32,
    rope_cos / rope_sin [B, ℓ, Dh/2] fp32, merge_idx [N, t, 4] int32 (into the B·ℓ tokens). Raises ValueError for
    segments of different lengths or frames, or pixels that do not match the grids."""
    ls = {t * h * w for t, h, w in grids}
    if len(ls) != 1:
        raise ValueError(f"graph_inputs: segment lengths {sorted(ls)}; one call takes equal-length segments "
                         "(group_segments)")
    B, ell = len(grids), ls.pop()
    if pixels.shape[0] != B * ell:
        raise ValueError(f"pixels: {pixels.shape[0]} patches for grids totalling {B * ell}")
    pi, pw = pos_taps(grids, v)
    cos, sin = rope_tables(grids, v.head_dim)
    t = torch.from_numpy
    i32 = lambda a: t(a.astype(np.int32))  # noqa: E731  (int32 metadata, as the text graphs')
    return {"pixels": pixels.reshape(B, ell, v.patch_dim).float(),
            "pos_idx": i32(pi).reshape(B, ell, -1), "pos_w": t(pw).reshape(B, ell, -1),
            "time_idx": i32(time_index(grids)).reshape(B, ell),
            "rope_cos": t(cos).reshape(B, ell, -1), "rope_sin": t(sin).reshape(B, ell, -1),
            "merge_idx": i32(merge_index(grids))}


# ---- the model ----------------------------------------------------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with FP32 statistics and the weight multiply in FP32 before one rounding (§4.1)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x.float(), approximate="tanh").to(x.dtype)


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x.float()).to(x.dtype)


def _attn_out_and_mlp(x, o, wo, norm1, fc0, fc1, eps: float) -> torch.Tensor:
    """x + o·woᵀ, then + fc1(GELU-tanh(fc0(RMSNorm(·)))) (§4.1)."""
    x = x + o @ wo.t()
    return x + _gelu_tanh(_rms(x, norm1, eps) @ fc0.t()) @ fc1.t()


def _block(x, cos, sin, norm0, wqkv, wo, norm1, fc0, fc1, H: int, Dh: int, eps: float, attention: str):
    """One pre-norm tower block over B equal segments (§4): x [B, ℓ, D] in the weights' dtype, cos / sin
    [B, ℓ, 1, Dh/2] fp32 -> [B, ℓ, D]. attention: "sdpa" (F.scaled_dot_product_attention) or "math" (explicit
    softmax, the fp32 reference's)."""
    B, ell = x.shape[0], x.shape[1]

    def rope(u):                                                                     # [B, ℓ, H, Dh]
        a, b = u.float().unflatten(-1, (Dh // 2, 2)).unbind(-1)
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)
    qkv = (_rms(x, norm0, eps) @ wqkv.t()).reshape(B, ell, 3, H, Dh)
    q, k, val = rope(qkv[:, :, 0]).transpose(1, 2), rope(qkv[:, :, 1]).transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
    if attention == "sdpa":
        o = F.scaled_dot_product_attention(q, k, val)
    else:
        o = torch.softmax((q @ k.transpose(-1, -2)) * Dh ** -0.5, -1) @ val
    return _attn_out_and_mlp(x, o.transpose(1, 2).reshape(B, ell, H * Dh), wo, norm1, fc0, fc1, eps)


def _compiled_block():
    """`_block` through torch.compile; the eager `_block` (one warning) where compiling fails."""
    compiled = torch.compile(_block)
    state = {"fn": compiled}

    def call(*args):
        if state["fn"] is compiled:
            try:
                return compiled(*args)
            except Exception as e:          # no working compiler stack here: the eager block is the same math
                log.warning("vision tower: torch.compile failed (%s: %s); running the blocks eagerly",
                            type(e).__name__, e)
                state["fn"] = _block
        return _block(*args)
    return call


@dataclasses.dataclass
class _Block:
    norm0: torch.Tensor
    norm1: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    fc0: torch.Tensor
    fc1: torch.Tensor


class VisionModel:
    """MoonViT-V2 tower + PatchMergerV2 projector of `cfg.vision` (VISION.md §2-§6).

    weights: {released name (§7.1): tensor} (any dtype; kept in `dtype` on `device`). dtype: torch.float32 (the
    reference) or torch.bfloat16 (§12). `time_table` (Tt, §3.2) is rebuilt, not loaded; it may be replaced (tests
    zero it). Raises KeyError naming a missing tensor, ValueError for a bad dtype."""

    def __init__(self, v: VisionConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: "str | torch.device" = "cpu"):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype = {dtype}: the vision tower runs in float32 (reference) or bfloat16 (§12)")
        self.v, self.dtype, self.device = v, dtype, torch.device(device)

        def w(name):
            if name not in weights:
                raise KeyError(f"vision weights: {name} missing (VISION.md §7.1)")
            return weights[name].to(self.device, dtype)
        t = "vision_tower."
        self.patch_w = w(t + "patch_embed.proj.weight").reshape(v.hidden_size, v.patch_dim)
        self.pos_table = w(t + "patch_embed.pos_emb.weight")                     # [H, W, D]
        self.blocks = [_Block(*(w(f"{t}encoder.blocks.{l}.{n}.weight") for n in
                                ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1")))
                       for l in range(v.num_layers)]
        self.final_norm = w(t + "encoder.final_layernorm.weight")
        self.proj0, self.proj2 = w("mm_projector.proj.0.weight"), w("mm_projector.proj.2.weight")
        self.post_norm = w("mm_projector.post_norm.weight")
        self.time_table = temporal_table(v).to(self.device, dtype)               # BF16 with the module (§13 Q4)
        self.attention = "math" if dtype == torch.float32 else "sdpa"
        # bf16 on CUDA: each block through torch.compile (its norms, RoPE, GELU and residuals fused; GEMMs and SDPA
        # as eager), shape-generic after the second distinct input shape; elsewhere the eager block
        self._block = _compiled_block() if dtype == torch.bfloat16 and self.device.type == "cuda" else _block

    def warmup(self) -> None:
        """Compile the bf16 CUDA blocks ahead of the first image: two calls of other segment counts and lengths,
        after which inputs of any shape reuse one compiled graph. A no-op for the eager tower."""
        if self._block is _block:
            return
        with torch.no_grad():
            for grids in ([(1, 4, 4)], [(1, 4, 6), (1, 4, 6)]):
                n = sum(t * h * w for t, h, w in grids)
                self.forward(torch.zeros(n, self.v.patch_dim, device=self.device), grids)

    @classmethod
    def from_checkpoint(cls, path, dtype: torch.dtype = torch.float32, device="cpu") -> "VisionModel":
        """Load the tower of a checkpoint directory. Raises CheckpointError (no vision_config, missing tensors)."""
        from k3deploy.model.checkpoint import Checkpoint
        ck = Checkpoint(path)
        return cls(ck.config.vision, ck.vision_weights(), dtype, device)

    @classmethod
    def from_synthetic(cls, cfg: K3Config, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu") -> "VisionModel":
        """The tower with `model.synthetic` weights drawn on `device` (no checkpoint)."""
        from k3deploy.model.synthetic import synthetic_vision_weights
        return cls(cfg.vision, synthetic_vision_weights(cfg, seed, device), dtype, device)

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors the graph embeds (for export hashing): {name: tensor in this model's dtype}."""
        out = {"patch_w": self.patch_w, "pos_table": self.pos_table, "final_norm": self.final_norm,
               "proj0": self.proj0, "proj2": self.proj2, "post_norm": self.post_norm}
        for l, b in enumerate(self.blocks):
            out.update({f"blocks.{l}.{k}": getattr(b, k) for k in ("norm0", "norm1", "wqkv", "wo", "fc0", "fc1")})
        return out

    # ---- shared pieces ----
    def _attn_out_and_mlp(self, x, b: _Block, o):
        return _attn_out_and_mlp(x, o, b.wo, b.norm1, b.fc0, b.fc1, self.v.norm_eps)

    def _project(self, m: torch.Tensor) -> torch.Tensor:
        """Merged rows [N, 4D] -> features [N, T] (§6.2: no pre-norm, erf GELU, post RMSNorm eps 1e-5)."""
        h = _gelu_erf(m.to(self.dtype) @ self.proj0.t())
        return _rms(h @ self.proj2.t(), self.post_norm, self.v.projector_eps)

    # ---- the serving form (one graph call) ----
    def graph_forward(self, pixels, pos_idx, pos_w, time_idx, rope_cos, rope_sin, merge_idx) -> torch.Tensor:
        """One call over B equal-length segments (inputs of `graph_inputs`) -> features [N, text_hidden] in this
        model's dtype. Attention is over each segment's ℓ tokens ([B, heads, ℓ, Dh], no mask)."""
        v = self.v
        B, ell = pixels.shape[0], pixels.shape[1]
        H, Dh = v.num_heads, v.head_dim
        x = pixels.to(self.dtype) @ self.patch_w.t()                                 # [B, ℓ, D]
        table = self.pos_table.reshape(-1, v.hidden_size).float()
        pos = 0.0
        pos_idx, time_idx, merge_idx = pos_idx.long(), time_idx.long(), merge_idx.long()   # ONNX GatherND: int64
        for k in range(pos_idx.shape[-1]):                                           # 4 (bilinear) or 16 taps
            pos = pos + table[pos_idx[..., k]] * pos_w[..., k, None]
        times = torch.cat([self.time_table.new_zeros(1, v.hidden_size), self.time_table])
        x = x + (pos.to(self.dtype) + times[time_idx]).to(self.dtype)
        cos, sin = rope_cos[:, :, None], rope_sin[:, :, None]                        # [B, ℓ, 1, Dh/2]
        block = self._block if not torch.onnx.is_in_onnx_export() else _block
        for b in self.blocks:
            x = block(x, cos, sin, b.norm0, b.wqkv, b.wo, b.norm1, b.fc0, b.fc1, H, Dh, v.norm_eps, self.attention)
        x = _rms(x, self.final_norm, v.norm_eps).reshape(B * ell, v.hidden_size)
        m = x[merge_idx].float().mean(1)                                             # [N, t, 4, D] -> mean over frames
        return self._project(m.reshape(m.shape[0], 4 * v.hidden_size))              # 2x2 concat: [N, 4D]

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """pixel_values [L, 3, p, p] (or [L, 3p²]) of segments packed end to end, grid_thws [S, 3] -> features
        [N, text_hidden] (N = Σ (h/2)(w/2), segments in input order) in this model's dtype, on its device: one
        `graph_forward` call per group of equal (t, length) segments (`encode_grouped`). Raises ValueError for bad
        grids or a patch count that does not match them."""
        def call(ins):
            return self.graph_forward(**{k: t.to(self.device) for k, t in ins.items()})
        return encode_grouped(pixel_values, grid_thws, self.v, call)

    # ---- the reference (independent of the host tables) ----
    def reference(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """The release's computation on one packed sequence: F.interpolate position rows (+ time rows), complex
        2-D RoPE, attention over the whole packed sequence with a block-diagonal mask, per-segment merge. Same
        contract as `forward`; O(L²) memory (small inputs only)."""
        v = self.v
        grids = check_grids(grid_thws, v)
        D, H, Dh = v.hidden_size, v.num_heads, v.head_dim
        L = sum(t * h * w for t, h, w in grids)
        x = pixel_values.reshape(L, v.patch_dim).to(self.dtype) @ self.patch_w.t()
        E = self.pos_table.float().permute(2, 0, 1)[None]                            # [1, D, H, W]
        pos, freqs = [], []
        phi = 1.0 / ROPE_THETA ** (torch.arange(0, Dh, 4)[: Dh // 4].float() / Dh)
        for t, h, w in grids:
            if (h, w) == (v.pos_emb_height, v.pos_emb_width):
                p2 = E[0].permute(1, 2, 0).reshape(h * w, D)
            else:
                p2 = F.interpolate(E, size=(h, w), mode=v.interpolation, align_corners=False)[0].permute(1, 2, 0)
                p2 = p2.reshape(h * w, D)
            p2 = p2.to(self.dtype)
            pos.append(p2.repeat(t, 1) if t == 1 else torch.cat([p2 + self.time_table[f] for f in range(t)]))
            flat = torch.arange(h * w)
            xs, ys = (flat % w).float(), (flat // w).float()
            cis = torch.cat([torch.polar(torch.ones(h * w, Dh // 4), torch.outer(xs, phi))[..., None],
                             torch.polar(torch.ones(h * w, Dh // 4), torch.outer(ys, phi))[..., None]], -1)
            freqs.append(cis.reshape(h * w, Dh // 2).repeat(t, 1))
        x = x + torch.cat(pos).to(self.dtype)
        freqs = torch.cat(freqs).to(self.device)[:, None]                            # [L, 1, Dh/2] complex64
        seg = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor([t * h * w for t, h, w in grids]))
        mask = (seg[:, None] == seg[None]).to(self.device)                           # block diagonal [L, L]

        def rope(u):
            c = torch.view_as_complex(u.float().reshape(L, H, Dh // 2, 2).contiguous())
            return torch.view_as_real(c * freqs).flatten(-2).to(self.dtype)
        for b in self.blocks:
            qkv = (_rms(x, b.norm0, v.norm_eps) @ b.wqkv.t()).reshape(L, 3, H, Dh)
            q, k, val = rope(qkv[:, 0]), rope(qkv[:, 1]), qkv[:, 2]
            s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(Dh)
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
            o = torch.einsum("hqk,khd->qhd", p, val.float()).to(self.dtype).reshape(L, H * Dh)
            x = self._attn_out_and_mlp(x, b, o)
        x = _rms(x, self.final_norm, v.norm_eps)
        merged, off = [], 0
        for t, h, w in grids:                                                        # [t, r, dy, c, dx, D]
            xs = x[off: off + t * h * w].float().reshape(t, h // 2, 2, w // 2, 2, D).mean(0)
            merged.append(xs.permute(0, 2, 1, 3, 4).reshape((h // 2) * (w // 2), 4 * D))
            off += t * h * w
        return self._project(torch.cat(merged))


# ---- the splice into the text sequence (§8.3) -----------------------------------------------------------------

def placeholder_positions(ids: Sequence[int] | torch.Tensor, pad_id: int) -> list[int]:
    """Positions of `<|media_pad|>` (pad_id) in a pre-expanded prompt, in order."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return [i for i, t in enumerate(ids) if t == pad_id]


def check_placeholders(ids: Sequence[int] | torch.Tensor, tokens_per_image: Sequence[int], pad_id: int) -> list[int]:
    """The placeholder positions of a pre-expanded prompt; raises ValueError when their count is not the images'
    Σ N_k (§8.3: each image's `<|media_pad|>` must be expanded into exactly its N_k copies before the text model)."""
    pos = placeholder_positions(ids, pad_id)
    want = sum(tokens_per_image)
    if len(pos) != want:
        raise ValueError(f"images: the prompt holds {len(pos)} <|media_pad|> (id {pad_id}) positions, the "
                         f"{len(tokens_per_image)} image(s) take {want} ({', '.join(map(str, tokens_per_image)) or 'none'}); "
                         "expand each image's placeholder into its image_tokens(width, height) copies "
                         "(runtime.vision.expand_placeholders) and pass the images in prompt order")
    return pos


def splice(embeds: torch.Tensor, ids: torch.Tensor, features: torch.Tensor, pad_id: int) -> torch.Tensor:
    """E[pos_k] = F_k: the embedding rows at the placeholder positions of `ids` [T] replaced by `features`
    [N, d] in order (§8.3); a new tensor. Raises ValueError when the placeholders are not exactly N."""
    pos = torch.tensor(check_placeholders(ids, [features.shape[0]], pad_id), dtype=torch.long, device=embeds.device)
    out = embeds.clone()
    out[pos] = features.to(embeds.dtype)
    return out


# ---- cost model (§9) ------------------------------------------------------------------------------------------------

def tower_flops(v: VisionConfig, grids: Sequence[tuple[int, int, int]]) -> dict[str, int]:
    """Dense FLOPs of one forward over `grids` (§9): {"gemm": patch embedding + blocks + projector GEMMs,
    "attention": 4·ℓ²·Q per segment per block (QKᵀ and PV), "total"}. K3: 792.7 MFLOP per patch + 92.3 MFLOP per
    merged token + 165,888·ℓ² per segment."""
    D, Q, I, M, T = v.hidden_size, v.qkv_hidden_size, v.intermediate_size, v.merged_size, v.text_hidden_size
    L = sum(t * h * w for t, h, w in grids)
    N = sum(merged_tokens(grids))
    gemm = 2 * L * (v.patch_dim * D + v.num_layers * (D * 3 * Q + Q * D + 2 * D * I)) + 2 * N * (M * M + M * T)
    attn = sum(4 * (t * h * w) ** 2 * Q * v.num_layers for t, h, w in grids)
    return {"gemm": gemm, "attention": attn, "total": gemm + attn}


def activation_bytes(v: VisionConfig, patches: int, itemsize: int = 2) -> dict[str, int]:
    """Bytes of the largest activations of one call over `patches` tokens (merged tokens = patches/4), in a dtype of
    `itemsize` bytes, attention never materializing ℓ x ℓ (§9): tokens [L, D], qkv [L, 3Q], MLP hidden [L, I],
    merged [N, 4D], features [N, T]; "peak" = tokens + the larger of qkv and the MLP hidden (one block live)."""
    N = patches // 4
    out = {"tokens": patches * v.hidden_size, "qkv": patches * 3 * v.qkv_hidden_size,
           "mlp_hidden": patches * v.intermediate_size, "merged": N * v.merged_size, "features": N * v.text_hidden_size}
    out = {k: n * itemsize for k, n in out.items()}
    out["peak"] = out["tokens"] + max(out["qkv"], out["mlp_hidden"]) + out["features"]
    return out
