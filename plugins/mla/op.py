"""torch.library ops ``kimi::mla_prefill`` / ``kimi::mla_decode`` (ONNX/TensorRT name: MlaPrefill / MlaDecode).

Signatures, shapes and dtypes are those of plugins/mla/reference.py (module docstring); the CPU implementation is
the reference (functional: returns a new cache; raises ValueError for a zero-length sequence or a position past the
block table). Fake impls: MlaPrefill `out [T, H*Dv]` in q's dtype, MlaDecode `out_latent [B, H, R]`, `cache_out`
like `cache`. CUDA: `plugins/mla/kernels.py` functions of the same name when importable (given a cloned cache).
"""
from __future__ import annotations


import torch

from k3deploy.plugins.op_common import cuda_kernels

from k3deploy.plugins.mla import reference as ref



@torch.library.custom_op("kimi::mla_prefill", mutates_args=())
def mla_prefill(q: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor, cache: torch.Tensor,
                block_tables: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor, num_heads: int,
                qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MlaPrefill -> (out [T, H*Dv], cache_out [NB, BS, R+Dr])."""
    return ref.mla_prefill(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens, num_heads=num_heads,
                           qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, kv_lora_rank=kv_lora_rank,
                           scale=scale)


@mla_prefill.register_fake
def _(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens, num_heads, qk_nope_head_dim, v_head_dim,
      kv_lora_rank, scale):
    return q.new_empty(q.shape[0], num_heads * v_head_dim), torch.empty_like(cache)


@torch.library.custom_op("kimi::mla_decode", mutates_args=())
def mla_decode(q_abs: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, num_heads: int, kv_lora_rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MlaDecode -> (out_latent [B, H, R], cache_out)."""
    return ref.mla_decode(q_abs, latent, cache, block_tables, context_lens, num_heads=num_heads,
                          kv_lora_rank=kv_lora_rank, scale=scale)


@mla_decode.register_fake
def _(q_abs, latent, cache, block_tables, context_lens, num_heads, kv_lora_rank, scale):
    return q_abs.new_empty(q_abs.shape[0], num_heads, kv_lora_rank), torch.empty_like(cache)


def _register_cuda() -> None:
    kernels = cuda_kernels("mla")
    if kernels is None:
        return
    if hasattr(kernels, "mla_prefill"):
        @mla_prefill.register_kernel("cuda")
        def _(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens, num_heads, qk_nope_head_dim, v_head_dim,
              kv_lora_rank, scale):
            return tuple(kernels.mla_prefill(q, latent, kv_b, cache.clone(), block_tables, cu_seqlens, context_lens,
                                             num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
                                             v_head_dim=v_head_dim, kv_lora_rank=kv_lora_rank, scale=scale))
    if hasattr(kernels, "mla_decode"):
        @mla_decode.register_kernel("cuda")
        def _(q_abs, latent, cache, block_tables, context_lens, num_heads, kv_lora_rank, scale):
            return tuple(kernels.mla_decode(q_abs, latent, cache.clone(), block_tables, context_lens,
                                            num_heads=num_heads, kv_lora_rank=kv_lora_rank, scale=scale))


_register_cuda()
