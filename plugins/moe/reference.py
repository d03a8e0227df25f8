"""Latent MoE ops: the noaux_tc router and the MXFP4 routed experts, executable definition (fp32). MODEL.md §7.2, §8.3.

Schema (ONNX domain `kimi`, plugin_namespace `kimi`, plugin_version `1`; docs/DESIGN.md):

    Mxfp4Moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale) -> y
        x          [T, Rl]          act    latent tokens (routed_expert_down_proj output)
        topk_ids   [T, k]           int32  global expert ids
        topk_w     [T, k]           f32    combine weights (unbiased, renormalized, scaled)
        w13_packed [E, 2I, Rl/2]    u8     rows 0..I-1 = w1 (gate), I..2I-1 = w3 (up); E2M1, low nibble = even column
        w13_scale  [E, 2I, Rl/32]   u8     E8M0, factor 2^(u-127) per 32 input columns (u = 255 invalid)
        w2_packed  [E, Rl, I/2]     u8
        w2_scale   [E, Rl, I/32]    u8
        y          [T, Rl]          f32    Σ_k w_k · w2_e(SiTU(w1_e x, w3_e x)) over choices with
                                          expert_offset <= id < expert_offset + E (others add 0: EP partial sum)
        attributes: expert_offset (0), situ_beta (4.0), situ_linear_beta (25.0), num_experts (0: routed experts
                    over all EP ranks, a scheduling hint for the GPU kernels; 0 = E, no expert parallelism; when
                    set, >= expert_offset + E. y does not depend on it)

The router is plain ONNX in graphs; `route` here is its definition.
"""
from __future__ import annotations

import torch

from k3deploy.plugins.common import acc

from k3deploy.plugins.moe.mxfp4 import pack_mxfp4 as quant_mxfp4  # noqa: F401  (re-exported for the op contract)
from k3deploy.plugins.moe.mxfp4 import unpack_mxfp4 as dequant_mxfp4


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU-GLU, fp32 (§2.2): [beta*tanh(g/beta)*sigmoid(g)] * [lb*tanh(u/lb)] (up raw if lb is None)."""
    g, u = gate.to(acc()), up.to(acc())
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return a * (u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta))


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, *, top_k: int, num_expert_group: int = 1,
          topk_group: int = 1, renormalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc router (§7.2): x [T, d], gate_w [E, d], bias [E] -> (ids [T, k] int64, weights [T, k] f32).

    fp32 logits and sigmoid; the correction bias only selects; groups (when G > 1 and G > topk_group) keep the
    topk_group groups with the largest top-2 sums and mask the rest with -inf; weights are the unbiased scores,
    renormalized (sum + 1e-20) and multiplied by `scaling`.
    """
    return route_logits(x.to(acc()) @ gate_w.to(acc()).t(), bias, top_k=top_k, num_expert_group=num_expert_group,
                        topk_group=topk_group, renormalize=renormalize, scaling=scaling)


def route_logits(z: torch.Tensor, bias: torch.Tensor, *, top_k: int, num_expert_group: int = 1, topk_group: int = 1,
                 renormalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` after its GEMM: router logits z [T, E] (any float dtype, used in fp32), bias [E] -> (ids [T, k]
    int64, weights [T, k] f32), best first."""
    s = torch.sigmoid(z.to(acc()))
    sel = s + bias.to(acc())
    if num_expert_group > 1 and num_expert_group > topk_group:
        T, E = sel.shape
        grp = sel.view(T, num_expert_group, E // num_expert_group).topk(2, dim=-1).values.sum(-1)   # [T, G]
        keep = torch.zeros_like(grp, dtype=torch.bool).scatter(1, grp.topk(topk_group, dim=-1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // num_expert_group, dim=1), float("-inf"))
    ids = sel.topk(top_k, dim=-1).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scaling


def check_num_experts(num_experts: int, expert_offset: int, local_experts: int) -> int:
    """The Mxfp4Moe attribute num_experts (0 = no EP: this rank's E): returns the global routed expert count.
    ValueError naming the attribute when it is set below expert_offset + E."""
    if num_experts and num_experts < expert_offset + local_experts:
        raise ValueError(f"Mxfp4Moe: num_experts={num_experts} is below expert_offset + local experts = "
                         f"{expert_offset} + {local_experts}; set it to the model's routed expert count "
                         "(config num_experts) or 0")
    return num_experts or local_experts


def mxfp4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, *, expert_offset: int = 0,
              situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0, num_experts: int = 0) -> torch.Tensor:
    """Mxfp4Moe (schema above). Returns y [T, Rl] f32 (the weighted sum over the local experts' choices).
    ValueError on a num_experts below expert_offset + E (:func:`check_num_experts`)."""
    E, two_i = w13_packed.shape[:2]
    check_num_experts(num_experts, expert_offset, E)
    I = two_i // 2
    xf = x.to(acc())
    y = torch.zeros(x.shape[0], x.shape[1], dtype=acc(), device=x.device)
    local = topk_ids.long() - expert_offset
    for e in torch.unique(local).tolist():
        if not 0 <= e < E:
            continue
        tok, slot = (local == e).nonzero(as_tuple=True)
        w13 = dequant_mxfp4(w13_packed[e], w13_scale[e]).to(acc())          # [2I, Rl]
        h = xf[tok] @ w13.t()
        a = situ(h[:, :I], h[:, I:], situ_beta, situ_linear_beta)
        ye = a @ dequant_mxfp4(w2_packed[e], w2_scale[e]).to(acc()).t()     # [n, Rl]
        y.index_add_(0, tok, topk_w[tok, slot, None].to(acc()) * ye)
    return y
