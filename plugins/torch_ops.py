"""`TorchOps`: the five custom ops as torch.library ops (`torch.ops.kimi.*`), drop-in for
`model.reference.ReferenceOps` (same method names and keyword arguments): `K3Model(..., ops=TorchOps)`.

On CPU the ops run the fp32 references; on CUDA the Triton kernels of plugins/<op>/kernels.py when they import.
Under `torch.export` / `torch.onnx.export(dynamo=True)` the ops stay opaque (fake impls) and
`plugins.onnx_common.translation_table()` turns each into one `kimi` ONNX node.

`KernelOps`: the same five methods calling the CUDA kernels directly, pools updated in place (the GPU runtime's
no-copy option, `LLM(..., device="cuda", ops="kernels")`). Both also offer `route` (the MoE router, §7.2): its
top-k as a Triton kernel on CUDA, the fp32 reference elsewhere.
"""
from __future__ import annotations

import torch

import k3deploy.plugins.kda.op  # noqa: F401  (registers torch.ops.kimi.kda_*)
import k3deploy.plugins.mla.op  # noqa: F401
import k3deploy.plugins.moe.op  # noqa: F401


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
                  situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0, num_experts: int = 0):
        lb = 0.0 if situ_linear_beta is None else float(situ_linear_beta)
        return torch.ops.kimi.mxfp4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale,
                                        int(expert_offset), float(situ_beta), lb, int(num_experts))

    @staticmethod
    def route(x, gate_w, bias, *, top_k: int, num_expert_group: int = 1, topk_group: int = 1,
              renormalize: bool = True, scaling: float = 1.0):
        """The router, x [T, d], gate_w [E, d], bias [E] -> (ids [T, k] int, weights fp32 [T, k]) (not a custom
        op: its torch form exports as standard ONNX ops): the Triton top-k kernel on CUDA (`KernelOps.route`), the
        fp32 reference elsewhere (and while tracing for export)."""
        if x.device.type == "cuda":
            return KernelOps.route(x, gate_w, bias, top_k=top_k, num_expert_group=num_expert_group,
                                   topk_group=topk_group, renormalize=renormalize, scaling=scaling)
        return _moe_ref().route(x, gate_w, bias, top_k=top_k, num_expert_group=num_expert_group,
                                topk_group=topk_group, renormalize=renormalize, scaling=scaling)


def _moe_ref():
    from k3deploy.plugins.moe import reference
    return reference


def _kernels(op: str):
    import importlib
    try:
        return importlib.import_module(f"k3deploy.plugins.{op}.kernels")
    except ImportError as e:
        raise ImportError(f"KernelOps needs the Triton kernels of plugins/{op}/kernels.py (pip install .[gpu]): {e}") from e


class KernelOps:
    """Same interface as model.reference.ReferenceOps, calling the Triton kernels of plugins/<op>/kernels.py
    directly: the pools are updated IN PLACE and returned (the torch.library ops must return fresh tensors, so
    `TorchOps` clones every pool it is handed — on CUDA that is a full copy of each layer's pool per call).
    CUDA tensors (or CPU tensors under TRITON_INTERPRET=1). Not traceable by torch.export; the runtime only.
    Raises ImportError when Triton or a kernel module is missing."""

    @staticmethod
    def kda_prefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots, *,
                    num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5):
        return _kernels("kda").kda_prefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens,
                                           slots, num_heads=int(num_heads), head_dim=int(head_dim),
                                           lower_bound=float(lower_bound), norm_eps=float(norm_eps))

    @staticmethod
    def kda_decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, *,
                   num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5):
        return _kernels("kda").kda_decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots,
                                          num_heads=int(num_heads), head_dim=int(head_dim),
                                          lower_bound=float(lower_bound), norm_eps=float(norm_eps))

    @staticmethod
    def mla_prefill(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens, *, num_heads: int,
                    qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int, scale: float):
        return tuple(_kernels("mla").mla_prefill(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens,
                                                 num_heads=int(num_heads), qk_nope_head_dim=int(qk_nope_head_dim),
                                                 v_head_dim=int(v_head_dim), kv_lora_rank=int(kv_lora_rank),
                                                 scale=float(scale)))

    @staticmethod
    def mla_decode(q_abs, latent, cache, block_tables, context_lens, *, num_heads: int, kv_lora_rank: int,
                   scale: float):
        return tuple(_kernels("mla").mla_decode(q_abs, latent, cache, block_tables, context_lens,
                                                num_heads=int(num_heads), kv_lora_rank=int(kv_lora_rank),
                                                scale=float(scale)))

    @staticmethod
    def mxfp4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, *, expert_offset: int = 0,
                  situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0, num_experts: int = 0):
        return _kernels("moe").mxfp4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale,
                                         expert_offset=int(expert_offset), situ_beta=float(situ_beta),
                                         situ_linear_beta=situ_linear_beta, num_experts=int(num_experts))

    @staticmethod
    def route(x, gate_w, bias, *, top_k: int, num_expert_group: int = 1, topk_group: int = 1,
              renormalize: bool = True, scaling: float = 1.0):
        """The router, x [T, d], gate_w [E, d], bias [E] -> (ids int32 [T, k], weights fp32 [T, k]): the fp32
        logits GEMM, then the Triton top-k kernel (plugins/moe/kernels.py `route`; its ValueErrors)."""
        return _kernels("moe").route(x, gate_w, bias, top_k=int(top_k), num_expert_group=int(num_expert_group),
                                     topk_group=int(topk_group), routed_scaling_factor=float(scaling),
                                     renormalize=bool(renormalize))
