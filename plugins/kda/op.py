"""torch.library ops ``kimi::kda_prefill`` / ``kimi::kda_decode`` (ONNX/TensorRT name: KdaPrefill / KdaDecode).

Signatures, shapes and dtypes are those of plugins/kda/reference.py (module docstring): the CPU implementation IS
the reference (functional: returns new pools; raises ValueError for a zero-length sequence in cu_seqlens, a slot
outside the pool or mismatched shapes). The fake (meta) implementation gives `out [T, H*K]` in qkv's dtype and
pools shaped like the inputs, so `torch.export` keeps the op opaque. When CUDA is available and
`plugins/kda/kernels.py` imports, its functions of the same name are the CUDA implementation; they update pools in
place, so the wrapper hands them clones (a custom op's outputs must not alias its inputs).
"""
from __future__ import annotations


import torch

from k3deploy.plugins.op_common import cuda_kernels

from k3deploy.plugins.kda import reference as ref



@torch.library.custom_op("kimi::kda_prefill", mutates_args=())
def kda_prefill(qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, g: torch.Tensor, conv_w: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_w: torch.Tensor, state: torch.Tensor,
                conv: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor, num_heads: int, head_dim: int,
                lower_bound: float = -5.0, norm_eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KdaPrefill over packed sequences -> (out [T, P], state_out [S, H, V, K] f32, conv_out [S, 3P, W-1])."""
    return ref.kda_prefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots,
                           num_heads=num_heads, head_dim=head_dim, lower_bound=lower_bound, norm_eps=norm_eps)


@kda_prefill.register_fake
def _(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots, num_heads, head_dim,
      lower_bound=-5.0, norm_eps=1e-5):
    return qkv.new_empty(qkv.shape[0], num_heads * head_dim), torch.empty_like(state), torch.empty_like(conv)


@torch.library.custom_op("kimi::kda_decode", mutates_args=())
def kda_decode(qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, g: torch.Tensor, conv_w: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_w: torch.Tensor, state: torch.Tensor,
               conv: torch.Tensor, slots: torch.Tensor, num_heads: int, head_dim: int,
               lower_bound: float = -5.0, norm_eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KdaDecode, one token per sequence (T == B == len(slots))."""
    return ref.kda_decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots,
                          num_heads=num_heads, head_dim=head_dim, lower_bound=lower_bound, norm_eps=norm_eps)


@kda_decode.register_fake
def _(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, num_heads, head_dim,
      lower_bound=-5.0, norm_eps=1e-5):
    return qkv.new_empty(qkv.shape[0], num_heads * head_dim), torch.empty_like(state), torch.empty_like(conv)


def _register_cuda() -> None:
    kernels = cuda_kernels("kda")
    if kernels is None:
        return
    if hasattr(kernels, "kda_prefill"):
        @kda_prefill.register_kernel("cuda")
        def _(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots, num_heads, head_dim,
              lower_bound=-5.0, norm_eps=1e-5):
            out, st, cv = kernels.kda_prefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state.clone(), conv.clone(),
                                              cu_seqlens, slots, num_heads=num_heads, head_dim=head_dim,
                                              lower_bound=lower_bound, norm_eps=norm_eps)
            return out, st, cv
    if hasattr(kernels, "kda_decode"):
        @kda_decode.register_kernel("cuda")
        def _(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, num_heads, head_dim,
              lower_bound=-5.0, norm_eps=1e-5):
            out, st, cv = kernels.kda_decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state.clone(), conv.clone(),
                                             slots, num_heads=num_heads, head_dim=head_dim, lower_bound=lower_bound,
                                             norm_eps=norm_eps)
            return out, st, cv


_register_cuda()
