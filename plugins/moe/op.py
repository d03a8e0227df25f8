"""torch.library op ``kimi::mxfp4_moe`` (ONNX/TensorRT name: Mxfp4Moe).

Signature, shapes and dtypes: plugins/moe/reference.py (module docstring). CPU implementation = the reference;
fake impl: `y [T, Rl] f32`. `situ_linear_beta <= 0` means "no tanh on the up projection" (the reference's None;
ONNX attributes cannot be None). CUDA: `plugins/moe/kernels.py:mxfp4_moe` when importable.
"""
from __future__ import annotations


import torch

from k3deploy.plugins.op_common import cuda_kernels

from k3deploy.plugins.moe import reference as ref



def _lbeta(v: float):
    return None if v is None or v <= 0 else v


@torch.library.custom_op("kimi::mxfp4_moe", mutates_args=())
def mxfp4_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, w13_packed: torch.Tensor,
              w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, expert_offset: int = 0,
              situ_beta: float = 4.0, situ_linear_beta: float = 25.0, num_experts: int = 0) -> torch.Tensor:
    """Mxfp4Moe -> y [T, Rl] f32 (EP partial sum over this rank's experts)."""
    return ref.mxfp4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, expert_offset=expert_offset,
                         situ_beta=situ_beta, situ_linear_beta=_lbeta(situ_linear_beta), num_experts=num_experts)


@mxfp4_moe.register_fake
def _(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, expert_offset=0, situ_beta=4.0,
      situ_linear_beta=25.0, num_experts=0):
    return x.new_empty(x.shape[0], x.shape[1], dtype=torch.float32)


def _register_cuda() -> None:
    kernels = cuda_kernels("moe")
    if kernels is None:
        return
    if hasattr(kernels, "mxfp4_moe"):
        @mxfp4_moe.register_kernel("cuda")
        def _(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, expert_offset=0, situ_beta=4.0,
              situ_linear_beta=25.0, num_experts=0):
            return kernels.mxfp4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale,
                                     expert_offset=expert_offset, situ_beta=situ_beta,
                                     situ_linear_beta=_lbeta(situ_linear_beta), num_experts=num_experts)


_register_cuda()
