"""MXFP4 codec (MODEL.md §8.3) against compressed-tensors' MXFP4 compressor and the E2M1 / E8M0 tables."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from k3deploy.plugins.moe.mxfp4 import E2M1_VALUES, e8m0_to_float, pack_mxfp4, unpack_mxfp4

ct_mx = pytest.importorskip("compressed_tensors.compressors.mxfp4.base")
from compressed_tensors.compressors.mx_utils import decompress_mx_scale  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

# The release's quantization_config weights args (§8.3).
ARGS = QuantizationArgs(num_bits=4, type="float", group_size=32, strategy="group", symmetric=True,
                        dynamic=False, scale_dtype=torch.uint8, observer="minmax")
SCHEME = QuantizationScheme(targets=["Linear"], weights=ARGS)
MX = ct_mx.MXFP4PackedCompressor


def ct_compress(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own path: min/max observer -> calculate_qparams (generate_mx_scales) -> compressor."""
    m, n = w.shape
    g = w.reshape(m, n // 32, 32)
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), ARGS)
    out = MX.compress({"weight": w, "weight_scale": scale}, SCHEME)
    return out["weight_packed"], out["weight_scale"]


def ct_decompress(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return MX.decompress({"weight_packed": packed, "weight_scale": scale}, SCHEME)["weight"]


def _special_rows(n: int) -> torch.Tensor:
    """Rows exercising ties, clamping, zeros (+0 / -0), tiny negatives and subnormals."""
    rows = torch.zeros(4, n)
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0,
                         0.24, 0.26, 5.01, -0.0, -1e-3, 1e-3, 2.9, 3.1])
    rows[0, : ties.numel()] = ties
    rows[1, :32] = -0.0
    rows[2, :32] = torch.linspace(-7, 7, 32) * 2.0 ** -130            # subnormal group -> u = 0
    rows[3, :32] = torch.tensor([1.75 * 2.0 ** 10] + [2.0 ** 9] * 31)  # amax rounds up to the next power of 2
    return rows


# float16 is left out: compressed-tensors computes 2^(u-127) in the input dtype, which underflows to 0 in
# fp16 for small groups and is then replaced by an eps (u = 127); ours keeps the E8M0 recipe in every dtype.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_bit_exact_vs_compressed_tensors(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(60, 256, generator=g) * torch.exp2(torch.randint(-12, 12, (60, 1), generator=g).float())
    w = torch.cat([w, _special_rows(256)]).to(dtype)
    p_ct, s_ct = ct_compress(w)
    p, s = pack_mxfp4(w)
    assert p.dtype == s.dtype == torch.uint8
    assert p.shape == (64, 128) and s.shape == (64, 8)
    assert torch.equal(s, s_ct)
    assert torch.equal(p, p_ct)
    # decoding agrees with compressed-tensors (bf16 output) and is exact in float32
    ours = unpack_mxfp4(p, s)
    assert ours.dtype == torch.float32 and ours.shape == w.shape
    assert torch.equal(ours.to(torch.bfloat16), ct_decompress(p_ct, s_ct).to(torch.bfloat16))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32), min_size=64, max_size=64),
       st.integers(min_value=-40, max_value=40), st.sampled_from([torch.float32, torch.bfloat16]))
def test_pack_matches_compressed_tensors_property(vals, shift, dtype):
    w = (torch.tensor(vals, dtype=torch.float32).reshape(1, 64) * 2.0 ** shift).to(dtype)
    p_ct, s_ct = ct_compress(w)
    p, s = pack_mxfp4(w)
    assert torch.equal(s, s_ct) and torch.equal(p, p_ct)


def test_pack_leading_dims_and_roundtrip_of_representable_values():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g)
    codes[..., ::32] = 7                                    # each group's max is 6 -> scale 2^k exactly
    vals = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))[codes]
    k = torch.randint(-30, 30, (3, 5, 2), generator=g).float()
    w = vals * torch.exp2(k).repeat_interleave(32, dim=-1)
    p, s = pack_mxfp4(w)
    assert p.shape == (3, 5, 32) and s.shape == (3, 5, 2)
    assert torch.equal(s.float() - 127, k)
    assert torch.equal(unpack_mxfp4(p, s), w)
    # same bytes as compressing the flattened 2-D matrix with compressed-tensors
    p_ct, s_ct = ct_compress(w.reshape(15, 64))
    assert torch.equal(p.reshape(15, 32), p_ct) and torch.equal(s.reshape(15, 2), s_ct)


def test_all_16_e2m1_codes_and_nibble_order():
    table = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    assert table[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    lo = torch.arange(16, dtype=torch.uint8)
    hi = (lo + 5) % 16
    packed = (lo | (hi << 4)).reshape(1, 16)                # 32 columns: even = lo code, odd = hi code
    out = unpack_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))[0]
    for c in range(16):
        assert out[2 * c].item() == table[c], f"code {c} (low nibble, even column)"
        assert out[2 * c + 1].item() == table[(c + 5) % 16], f"code {(c + 5) % 16} (high nibble, odd column)"
    assert torch.signbit(out[16]) and out[16] == 0          # code 8 is -0
    assert not torch.signbit(out[0])
    # compressed-tensors' own FP4 table agrees (bf16 unpack of the same bytes)
    assert torch.equal(unpack_fp4_from_uint8(packed, 1, 32, torch.float32)[0], out)


def test_all_256_e8m0_bytes():
    u = torch.arange(255, dtype=torch.uint8)
    f = e8m0_to_float(u)
    assert f.dtype == torch.float32
    for i in range(255):
        assert f[i].item() == math.ldexp(1.0, i - 127), f"E8M0 byte {i}"
    assert f[0].item() == 2.0 ** -127 and f[0] > 0                # u = 0 is 2^-127, not 0 (Q12)
    assert torch.equal(f.to(torch.bfloat16), decompress_mx_scale(u))
    # through unpack: code 2 (= 1.0) times each scale
    packed = torch.full((255, 16), 0x22, dtype=torch.uint8)
    out = unpack_mxfp4(packed, u.reshape(255, 1))
    assert torch.equal(out, f.reshape(255, 1).expand(255, 32))


def test_scale_255_rejected():
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    scale = torch.tensor([[127, 127], [127, 255]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"255.*\(1, 1\).*NaN.*OCP"):
        unpack_mxfp4(packed, scale)


def test_pack_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="NaN or inf"):
        pack_mxfp4(torch.tensor([float("inf")] + [0.0] * 31))
    with pytest.raises(TypeError):
        pack_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match"):
        unpack_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


def test_pack_never_emits_nan_scale():
    w = torch.full((1, 32), 3.0e38)                          # amax rounds up to 2^128 (inf in float32)
    _, s = pack_mxfp4(w)
    assert int(s.max()) < 255
