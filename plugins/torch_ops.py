"""`TorchOps`: the five custom ops as torch.library ops (`torch.ops.kimi.*`), drop-in for
`model.reference.ReferenceOps` (same method names and keyword arguments): `K3Model(..., ops=TorchOps)`.

On CPU the ops run the fp32 references; on CUDA the Triton kernels of plugins/<op>/kernels.py when they import.
Under `torch.export` / `torch.onnx.export(dynamo=True)` the ops stay opaque (fake impls) and
`plugins.onnx_common.translation_table()` turns each into one `kimi` ONNX node.
"""
from __future__ import annotations

import torch

import plugins.kda.op  # noqa: F401  (registers torch.ops.kimi.kda_*)
import plugins.mla.op  # noqa: F401
import plugins.moe.op  # noqa: F401


class TorchOps:
    """Same interface as model.reference.ReferenceOps, dispatching to torch.ops.kimi.*."""

    @staticmethod
    def kda_prefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots, *,
                    num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5):
        return torch.ops.kimi.kda_prefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens,
                                          slots, int(num_heads), int(head_dim), float(lower_bound), float(norm_eps))

    @staticmethod
    def kda_decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, *,
                   num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5):
        return torch.ops.kimi.kda_decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots,
                                         int(num_heads), int(head_dim), float(lower_bound), float(norm_eps))

    @staticmethod
    def mla_prefill(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens, *, num_heads: int,
                    qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int, scale: float):
        return torch.ops.kimi.mla_prefill(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens,
                                          int(num_heads), int(qk_nope_head_dim), int(v_head_dim), int(kv_lora_rank),
                                          float(scale))

    @staticmethod
    def mla_decode(q_abs, latent, cache, block_tables, context_lens, *, num_heads: int, kv_lora_rank: int,
                   scale: float):
        return torch.ops.kimi.mla_decode(q_abs, latent, cache, block_tables, context_lens, int(num_heads),
                                         int(kv_lora_rank), float(scale))

    @staticmethod
    def mxfp4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, *, expert_offset: int = 0,
                  situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0):
        lb = 0.0 if situ_linear_beta is None else float(situ_linear_beta)
        return torch.ops.kimi.mxfp4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale,
                                        int(expert_offset), float(situ_beta), lb)
