"""The per-layer glue of a decoder layer as fp32 torch definitions (MODEL.md §2.1, §2.2, §5.3, §6.2-§6.3, §7.2).

`rms_norm` and `attn_res` are the reference model's building blocks (model/layers.py re-exports them; SiTU is
plugins/moe/reference.py's `situ`); the other functions define what each kernel of plugins/glue/kernels.py computes, in fp32 and without the
kernels' rounding to the activation dtype (their tests compare the two):

* `attn_res_norm`: the pending residual add, an optional bank commit, the Block AttnRes read and the RMSNorm that
  follows it (§6.3: every AttnRes read is followed by input_layernorm, post_attention_layernorm or model.norm);
* `lora_norms`: MLA's two LoRA RMSNorms (eps 1e-6) and the latent cache row [c_kv ‖ k_pe] (§5.2, §5.3);
* `mla_absorb`: the absorbed decode's query q_nope·W_UK ‖ q_pe (§5.3);
* `mla_out`: the absorbed decode's value up-projection W_UV with the sigmoid output gate (§5.3);
* `moe_out_rows`: the latent MoE's RMSNorm of the combined latent next to the shared experts' SiTU (§7.2), one row
  of the buffer the output GEMM [routed_expert_up_proj ‖ shared down_proj] reads.
"""
from __future__ import annotations

import torch

from k3deploy.plugins.common import acc
from k3deploy.plugins.moe.reference import situ


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """w ⊙ x·rsqrt(mean(x², -1) + eps), fp32 (§2.1). x [..., D], w [D] or None (no weight)."""
    x = x.to(acc())
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.to(acc())


def attn_res_query(norm_w: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    """The folded AttnRes pseudo-query q = *_res_norm.weight ⊙ *_res_proj.weight[0] [d] fp32 (§6.2)."""
    return norm_w.to(acc()) * proj_w.to(acc()).reshape(-1)


def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    """Block AttnRes with a folded query (§6.2): sources [T, R, d], query [d] -> [T, d] fp32: softmax over the R
    sources of (RMS-normalized source · query), then the mix of the raw sources."""
    k = rms_norm(sources, None, eps)
    p = torch.softmax((k * query.to(acc())).sum(-1), dim=-1)
    return (p[..., None] * sources.to(acc())).sum(1)


def attn_res(sources: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Block AttnRes read (§6.2): sources [T, R, d] -> [T, d].

    Scores use RMS-normalized sources against the folded query norm_w ⊙ proj_w[0]; the softmax over the R
    sources (fp32, no temperature) mixes the raw sources.
    """
    return attn_res_mix(sources, attn_res_query(norm_w, proj_w), eps)


def attn_res_norm(P: torch.Tensor | None, add: torch.Tensor | None, bank: torch.Tensor, query: torch.Tensor,
                  norm_w: torch.Tensor, eps: float, rows: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One AttnRes read of a decoder layer with its residual write and the RMSNorm after it (§6.3), fp32.

    P [T, d] running block sum (None: it was just committed, the block restarts from `add`); add [T, d] the pending
    residual (the previous attention or MLP output) or None; bank [T, NB, d] committed rows (NB >= 0); query [d]
    (`attn_res_query`); norm_w [d] the following RMSNorm's weight; rows [M] token rows to read (None: all).
    Returns (y [M, d] = RMSNorm(AttnRes(bank ++ [P'])), P' [T, d] = P + add).
    """
    if P is None and add is None:
        raise ValueError("attn_res_norm: P and add are both None; the block sum needs one of them")
    Pn = add.to(acc()) if P is None else P.to(acc()) if add is None else P.to(acc()) + add.to(acc())
    src = torch.cat([bank.to(acc()), Pn[:, None]], 1)
    if rows is not None:
        src = src[rows]
    return rms_norm(attn_res_mix(src, query, eps), norm_w, eps), Pn


def lora_norms(y: torch.Tensor, q_norm_w: torch.Tensor, kv_norm_w: torch.Tensor, eps: float, q_rank: int,
               kv_rank: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's LoRA norms (§5.2): y [T, >= q_rank + kv_rank + rope_dim] holding q_a_proj(x) ‖ kv_a_proj_with_mqa(x)
    (‖ anything) -> (cq [T, q_rank] = RMSNorm_eps(q_a; q_a_layernorm), latent [T, kv_rank + rope_dim] =
    RMSNorm_eps(c_kv; kv_a_layernorm) ‖ k_pe raw), fp32; eps is the LoRA norms' 1e-6."""
    qa, kv = y[:, :q_rank], y[:, q_rank: q_rank + kv_rank + rope_dim]
    return rms_norm(qa, q_norm_w, eps), torch.cat([rms_norm(kv[:, :kv_rank], kv_norm_w, eps),
                                                   kv[:, kv_rank:].to(acc())], -1)


def mla_absorb(q: torch.Tensor, kv_b: torch.Tensor, qk_nope_head_dim: int) -> torch.Tensor:
    """The absorbed decode query (§5.3): q [T, H, Dn+Dr], kv_b [H*(Dn+Dv), R] -> q_abs [T, H, R+Dr] fp32 =
    q_nope·W_UK ‖ q_pe."""
    T, H, _ = q.shape
    R = kv_b.shape[1]
    w_uk = kv_b.to(acc()).view(H, -1, R)[:, :qk_nope_head_dim]
    q = q.to(acc())
    return torch.cat([torch.einsum("thd,hdr->thr", q[..., :qk_nope_head_dim], w_uk), q[..., qk_nope_head_dim:]], -1)


def mla_out(o_latent: torch.Tensor, kv_b: torch.Tensor, g: torch.Tensor, qk_nope_head_dim: int) -> torch.Tensor:
    """The absorbed decode's output before o_proj (§5.3): o_latent [T, H, R], kv_b [H*(Dn+Dv), R] (rows of head h:
    W_UK then W_UV), g [T, H*Dv] the g_proj output -> [T, H*Dv] fp32 = (W_UV_h ō_h) ⊙ σ(g)."""
    T, H, R = o_latent.shape
    w_uv = kv_b.to(acc()).view(H, -1, R)[:, qk_nope_head_dim:]
    o = torch.einsum("thr,hvr->thv", o_latent.to(acc()), w_uv).reshape(T, -1)
    return o * torch.sigmoid(g.to(acc()))


def moe_out_rows(yl: torch.Tensor | None, norm_w: torch.Tensor | None, gate: torch.Tensor | None,
                 up: torch.Tensor | None, eps: float, beta: float, linear_beta: float | None) -> torch.Tensor:
    """The input rows of the latent MoE's output GEMM (§7.2): [RMSNorm(yl; routed_expert_norm) ‖ SiTU(gate, up)],
    fp32 [T, Rl + I]. yl [T, Rl] the combined routed latent (None: no routed part, e.g. the dense MLP's SiTU alone;
    norm_w None: latent_moe_use_norm off), gate / up [T, I] the shared experts' (None: none)."""
    parts = []
    if yl is not None:
        parts.append(rms_norm(yl, norm_w, eps) if norm_w is not None else yl.to(acc()))
    if gate is not None:
        parts.append(situ(gate, up, beta, linear_beta))
    return torch.cat(parts, -1)
