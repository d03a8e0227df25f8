"""MXFP4 codec of the routed experts (MODEL.md §8.3, compressed-tensors `mxfp4-pack-quantized`, OCP MX v1.0).

A logical weight `W [..., C]` (C = input columns, a multiple of 32) is stored as two uint8 tensors:

* `packed [..., C/2]`: byte j holds column 2j in the low nibble and column 2j+1 in the high nibble.
  A nibble is an E2M1 code: bit 3 = sign, bits 0..2 index `E2M1_VALUES` (code 8 is -0).
* `scale [..., C/32]`: E8M0 biased exponent u per group of 32 columns; factor `2^(u-127)`
  (u = 0 -> 2^-127 as in the spec and compressed-tensors; u = 255 is NaN in the OCP spec -> rejected).

`W[..., c] = E2M1(nibble) * 2^(scale[..., c // 32] - 127)`.
"""
from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# All 16 codes: 0..7 positive, 8..15 negative (8 = -0.0).
E2M1_CODE_VALUES = torch.cat([_E2M1, -_E2M1])
SCALE_NAN = 255
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_BOUNDS[[1, 3, 5]] = torch.nextafter(_BOUNDS[[1, 3, 5]], torch.zeros(3))


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes `scale` (uint8, any shape) to float32 factors 2^(u-127), bit-exact.

    u >= 1 is the normal float32 2^(u-127); u = 0 is the float32 subnormal 2^-127. Raises ValueError
    if any byte is 255 (NaN in the OCP MX spec, never valid in a checkpoint, §8.3 / Q12).
    """
    if scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 scale must be uint8 (E8M0), got {scale.dtype}")
    bad = scale == SCALE_NAN
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"MXFP4 scale byte 255 at index {idx} ({int(bad.sum())} such bytes): E8M0 code 255 is NaN in "
                         "the OCP MX spec and must not occur in a checkpoint (MODEL.md §8.3)")
    u = scale.to(torch.int32)
    # float32 bit patterns: exponent field u for u >= 1; 2^-127 is the subnormal with mantissa 0x400000.
    bits = torch.where(u == 0, torch.full_like(u, 0x00400000), u << 23)
    return bits.view(torch.float32)


def unpack_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize MXFP4 to float32 (MODEL.md §8.3).

    packed: uint8 `[..., C/2]` (low nibble = even column). scale: uint8 `[..., C/32]` (E8M0).
    Returns float32 `[..., C]` on packed's device. Values are exact (every E2M1 x 2^k product is a float32,
    except for scales u >= 253 where 4 or 6 x 2^(u-127) exceeds the float32 range and becomes inf).
    Raises ValueError for shape mismatches or a scale byte 255 (NaN), TypeError for non-uint8 inputs.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"MXFP4 packed weights must be uint8, got {packed.dtype}")
    C = packed.shape[-1] * 2
    if packed.shape[:-1] != scale.shape[:-1] or C != scale.shape[-1] * GROUP:
        raise ValueError(f"MXFP4 shapes do not match: packed {tuple(packed.shape)} holds {C} columns, "
                         f"scale {tuple(scale.shape)} covers {scale.shape[-1] * GROUP} (group size {GROUP})")
    factor = e8m0_to_float(scale).to(packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], C)
    vals = E2M1_CODE_VALUES.to(packed.device)[codes.long()]
    return (vals.reshape(*scale.shape, GROUP) * factor.unsqueeze(-1)).reshape(*packed.shape[:-1], C)


def _scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent per group from float32 `amax` (>= 0), compressed-tensors `generate_mx_scales` recipe.

    Round amax to a power of two in bit space (add 1 << 21 to the float32 pattern: rounds up iff the
    significand is >= 1.75, else truncates), then u = 127 + log2(p) - 2 (2 = floor(log2(6))), clamped to
    [0, 254]. amax = 0 (and tiny subnormals) give u = 0 as in compressed-tensors. For amax >= 1.75 * 2^127
    (rounds to 2^128 = inf) compressed-tensors' scale is meaningless; we give u = 253 and never the NaN code 255.
    """
    bits = amax.view(torch.int32) + (1 << 21)
    exp_field = (bits >> 23) & 0xFF                      # biased exponent of the rounded power of two
    u = torch.where(exp_field == 0, torch.zeros_like(exp_field), exp_field - 2)
    return u.clamp(0, SCALE_NAN - 1)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Magnitude code 0..7 (uint8) of |x| (float32) rounded to the nearest E2M1 value (ties to even, clamp 6).

    Same thresholds as compressed-tensors `cast_to_fp4`: <=0.25 ->0, <0.75 ->0.5, <=1.25 ->1, <1.75 ->1.5,
    <=2.5 ->2, <3.5 ->3, <=5 ->4, else 6. The code is the number of boundaries strictly below |x|; the
    inclusive boundaries (0.75, 1.75, 3.5) are moved one float32 ulp down to make them strict.
    """
    a = x.abs()
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for b in _BOUNDS.tolist():
        code += a > b
    return code


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `w` (float32/bf16/fp16 `[..., C]`, C a multiple of 32) to MXFP4 (MODEL.md §8.3 encoding recipe).

    Per group of 32 columns: amax = max|w|; u = E8M0 exponent of amax (see `_scale_exponent`); each element
    q = w / 2^(u-127) (computed in w's dtype) is rounded to the nearest E2M1 value (ties to even code, clamp
    +-6); the sign bit is set iff q < 0 (a small negative becomes code 8 = -0, while -0.0 and quotients that
    underflow to -0.0 become code 0, exactly as compressed-tensors does).
    Returns `(packed uint8 [..., C/2], scale uint8 [..., C/32])`, bit-identical to compressed-tensors'
    MXFP4PackedCompressor for float32/bf16 inputs with |w| < 1.75 * 2^127 (for fp16 input compressed-tensors
    computes 2^(u-127) in fp16, which underflows for tiny groups; we do not copy that). float64 input is
    rounded to float32 first.
    Raises ValueError if C is not a multiple of 32 or w has non-finite values; TypeError for non-float input.
    """
    if not w.is_floating_point():
        raise TypeError(f"pack_mxfp4 needs a floating-point tensor, got {w.dtype}")
    if w.ndim == 0 or w.shape[-1] % GROUP:
        raise ValueError(f"pack_mxfp4: last dim of shape {tuple(w.shape)} must be a multiple of {GROUP} (MXFP4 group size)")
    # Work in the input dtype for bf16/f32 (compressed-tensors divides in the input dtype, which decides how
    # subnormal quotients round and so the sign of a zero code); other dtypes go through float32.
    x = w if w.dtype in (torch.float32, torch.bfloat16) else w.to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("pack_mxfp4: input has NaN or inf values; MXFP4 cannot encode them")
    lead, C = x.shape[:-1], x.shape[-1]
    g = x.reshape(*lead, C // GROUP, GROUP)
    u = _scale_exponent(g.abs().amax(dim=-1).to(torch.float32).contiguous())
    q = (g / e8m0_to_float(u.to(torch.uint8)).to(x.dtype).unsqueeze(-1)).to(torch.float32)  # exact unless subnormal
    codes = _round_e2m1(q) | ((q < 0).to(torch.uint8) << 3)
    codes = codes.reshape(*lead, C // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.contiguous(), u.to(torch.uint8)
