"""Gated-MLA attention ops over the paged latent cache: the executable definition (fp32). MODEL.md §5.

Schema (ONNX domain `kimi`, plugin_namespace `kimi`, plugin_version `1`; docs/DESIGN.md):

    MlaPrefill(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens) -> (out, cache_out)
        q            [T, H, Dn+Dr]        act    per-head queries (nope ‖ pe, never rotated)
        latent       [T, R+Dr]            act    new tokens' cache rows: c_kv (post-norm, R) ‖ k_pe (raw, Dr)
        kv_b         [H*(Dn+Dv), R]       act    kv_b_proj weight of the rank-local heads
        cache        [NB, BS, R+Dr]       act    paged latent pool; block 0 = padding sentinel
        block_tables [N, MB]              int32
        cu_seqlens   [N+1]                int32  every length >= 1
        context_lens [N]                  int32  tokens already cached before this chunk
        out          [T, H*Dv]            act    causal softmax(q·k / sqrt(Dn+Dr)) · v, fp32 softmax
        attributes: num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank, scale

    MlaDecode(q_abs, latent, cache, block_tables, context_lens) -> (out_latent, cache_out)
        q_abs        [B, H, R+Dr]  q_nope·W_UK ‖ q_pe (absorbed, §5.3);  latent [B, R+Dr]
        out_latent   [B, H, R]     Σ_t p_t · C_t[:R]  (values are the first R columns only)
        attributes: num_heads, kv_lora_rank, scale

Both ops first write the new rows at positions context_lens[n] + i (through the block table), then attend.
The reference returns a new cache; GPU kernels update in place.
"""
from __future__ import annotations

import torch

from k3deploy.plugins.common import acc

from k3deploy.plugins.kda.reference import check_cu_seqlens


def _positions(block_tables: torch.Tensor, block_size: int, n: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids, offsets) of positions start..start+count-1 of sequence n. Raises ValueError past the table."""
    pos = torch.arange(start, start + count, device=block_tables.device)
    if start + count > block_tables.shape[1] * block_size:
        raise ValueError(f"sequence {n}: position {start + count - 1} is past its block table "
                         f"({block_tables.shape[1]} blocks of {block_size})")
    return block_tables[n, pos // block_size].long(), pos % block_size


def paged_write(cache, latent, block_tables, cu_seqlens, context_lens):
    """Write packed rows latent [T, C] into a copy of cache [NB, BS, C]; returns the new cache."""
    lens = check_cu_seqlens(cu_seqlens, latent.shape[0])
    out = cache.clone()
    start = 0
    for n, L in enumerate(lens):
        blk, off = _positions(block_tables, cache.shape[1], n, int(context_lens[n]), L)
        out[blk, off] = latent[start:start + L].to(cache.dtype)
        start += L
    return out


def gather_latents(cache, block_tables, n: int, length: int) -> torch.Tensor:
    """The first `length` cached rows [length, C] of sequence n."""
    blk, off = _positions(block_tables, cache.shape[1], n, 0, length)
    return cache[blk, off]


def mla_prefill(q, latent, kv_b, cache, block_tables, cu_seqlens, context_lens, *, num_heads: int,
                qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int, scale: float):
    """MlaPrefill (schema above): unabsorbed causal attention of each new token over its sequence's
    context + new tokens (§5.2). Returns (out [T, H*Dv] in q's dtype, cache)."""
    H, Dn, Dv, R = num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank
    cache = paged_write(cache, latent, block_tables, cu_seqlens, context_lens)
    lens = check_cu_seqlens(cu_seqlens, q.shape[0])
    wkv = kv_b.to(acc()).view(H, Dn + Dv, R)
    out = torch.empty(q.shape[0], H * Dv, dtype=q.dtype, device=q.device)
    start = 0
    for n, L in enumerate(lens):
        ctx = int(context_lens[n])
        lat = gather_latents(cache, block_tables, n, ctx + L).to(acc())           # [Lk, R+Dr]
        kv = torch.einsum("tr,hdr->htd", lat[:, :R], wkv)                        # [H, Lk, Dn+Dv]
        k = torch.cat([kv[..., :Dn], lat[None, :, R:].expand(H, -1, -1)], -1)    # [H, Lk, Dn+Dr]
        v = kv[..., Dn:]
        qs = q[start:start + L].to(acc()).transpose(0, 1)                          # [H, L, Dn+Dr]
        s = (qs @ k.transpose(1, 2)) * scale                                     # [H, L, Lk]
        qpos = torch.arange(ctx, ctx + L, device=s.device)[:, None]
        s = s.masked_fill(torch.arange(ctx + L, device=s.device)[None, :] > qpos, float("-inf"))
        o = torch.softmax(s, -1) @ v                                             # [H, L, Dv]
        out[start:start + L] = o.transpose(0, 1).reshape(L, H * Dv).to(q.dtype)
        start += L
    return out, cache


def mla_decode(q_abs, latent, cache, block_tables, context_lens, *, num_heads: int, kv_lora_rank: int, scale: float):
    """MlaDecode (schema above): absorbed attention of one new token per sequence over context_len + 1
    latents (§5.3). Returns (out_latent [B, H, R] in q_abs's dtype, cache)."""
    B = q_abs.shape[0]
    cu = torch.arange(B + 1, dtype=torch.int32)
    cache = paged_write(cache, latent, block_tables, cu, context_lens)
    R = kv_lora_rank
    out = torch.empty(B, num_heads, R, dtype=q_abs.dtype, device=q_abs.device)
    for n in range(B):
        lat = gather_latents(cache, block_tables, n, int(context_lens[n]) + 1).to(acc())   # [Lk, R+Dr]
        p = torch.softmax((q_abs[n].to(acc()) @ lat.t()) * scale, -1)                       # [H, Lk]
        out[n] = (p @ lat[:, :R]).to(q_abs.dtype)
    return out, cache
