"""KDA (Kimi Delta Attention) ops: the executable definition (fp32 torch oracle). MODEL.md §4.

Schema (ONNX domain `kimi`, plugin_namespace `kimi`, plugin_version `1`; see docs/DESIGN.md):

    KdaPrefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots)
        -> (out, state_out, conv_out)
    KdaDecode (qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots)
        -> (out, state_out, conv_out)

    qkv      [T, 3P]        act    raw q‖k‖v projections (pre-conv), P = H*K
    f        [T, P]         act    f_b_proj(f_a_proj(x)), decay-gate pre-activation
    b        [T, H]         act    β logits (b_proj(x))
    g        [T, P]         act    output-gate logits (g_proj(x))
    conv_w   [3P, W]        f32    depthwise causal conv weights (q‖k‖v), W = 4; w[:, W-1] hits the current token
    A_log    [H]            f32    per-head log rate (trimmed to H, §8.4 step 4)
    dt_bias  [P]            f32
    o_norm_w [K]            f32    gated RMSNorm weight, shared by heads
    state    [S, H, V, K]   f32    slot pool, stored Sᵀ per head (§4.5); slot 0 = padding sentinel
    conv     [S, 3P, W-1]   act    slot pool of raw pre-conv inputs, oldest first (§4.4)
    cu_seqlens [N+1]        int32  packed offsets (Prefill); every length >= 1
    slots    [N]            int32  slot of each sequence (Decode: N == T, one token each)
    out      [T, P]         act    gated-RMSNorm output, before o_proj
    attributes: num_heads=H, head_dim=K (=V), lower_bound=-5.0, norm_eps=1e-5 (INT attrs arrive as INT32 in TensorRT)

The reference returns new pools (it never writes its inputs); GPU kernels update in place.
"""
from __future__ import annotations

import torch

from k3deploy.plugins.common import acc
import torch.nn.functional as F

L2_EPS = 1e-6  # on the sum of squares, inside the sqrt (fla l2norm, §4.2 step 6)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """Validate packed offsets [N+1] against T; returns the lengths. Raises ValueError on a zero-length
    sequence, non-monotone offsets or a total that is not T."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cu_seqlens = {cu}: must start at 0 and hold N+1 >= 2 offsets")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if any(n <= 0 for n in lens):
        raise ValueError(f"cu_seqlens = {cu}: sequence lengths {lens} must all be >= 1 (zero-length sequence in the pack)")
    if cu[-1] != total:
        raise ValueError(f"cu_seqlens[-1] = {cu[-1]}: must equal the number of packed tokens T = {total}")
    return lens


def short_conv(x: torch.Tensor, w: torch.Tensor, hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU for ONE sequence (§4.2 step 2, §4.4).

    x [L, D] raw inputs; w [D, W] f32; hist [D, W-1] the W-1 previous raw inputs (oldest first, zeros at start).
    Returns y [L, D] fp32 = silu(sum_j w[:, j] * xext[t + j]) and the new history [D, W-1] (last W-1 raw inputs).
    """
    W = w.shape[1]
    xext = torch.cat([hist.to(acc()), x.to(acc()).t()], dim=1)  # [D, W-1+L]
    cols = xext.unfold(1, W, 1)  # [D, L, W]
    y = (cols * w.to(acc())[:, None, :]).sum(-1).t()
    return F.silu(y), xext[:, xext.shape[1] - (W - 1):]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, fp32 (§4.2 step 6)."""
    x = x.to(acc())
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int, lower_bound: float) -> torch.Tensor:
    """Log decay g [T, H, K] = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)) in (lb, 0), fp32 (§4.2 step 4)."""
    T = f.shape[0]
    z = (f.to(acc()) + dt_bias.to(acc())).view(T, num_heads, -1)
    return lower_bound * torch.sigmoid(torch.exp(A_log.to(acc()))[None, :, None] * z)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """Token-by-token delta rule for one sequence (§4.2 step 7), fp32, state layout [H, V, K].

    q, k [L, H, K] (q already normalized and scaled, k normalized); v [L, H, V]; g [L, H, K] log decay;
    beta [L, H]; state [H, V, K]. Returns o [L, H, V] and the final state [H, V, K].
    """
    S = state.to(acc()).clone()
    outs = []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, None, :]                        # S <- diag(alpha) S   (K axis)
        u = v[t] - torch.einsum("hvk,hk->hv", S, k[t])              # prediction error
        S = S + beta[t][:, None, None] * u[:, :, None] * k[t][:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", S, q[t]))
    return torch.stack(outs), S


def delta_rule_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """The chunked (prefill) form of §4.3 for one sequence; same arguments and results as
    `delta_rule_recurrent`, computed chunk by chunk with exponentials of differences only."""
    L, H, K = q.shape
    S = state.to(acc()).transpose(1, 2).clone()                       # [H, K, V] K-major for the formulas
    outs = []
    for s0 in range(0, L, chunk_size):
        sl = slice(s0, min(L, s0 + chunk_size))
        Q, Kc, V, G = (x[sl].transpose(0, 1).to(acc()) for x in (q, k, v, g))   # [H, n, *]
        B = beta[sl].t().to(acc())                                       # [H, n]
        G = G.cumsum(1)                                              # cumulative log decay [H, n, K]
        n = Q.shape[1]
        D = torch.exp((G[:, :, None, :] - G[:, None, :, :]).clamp(max=0))  # exp(G_i - G_j) for j <= i
        strict = torch.tril(torch.ones(n, n, dtype=torch.bool, device=Q.device), -1)
        zero = torch.zeros((), dtype=Q.dtype, device=Q.device)
        incl = torch.tril(torch.ones(n, n, dtype=torch.bool, device=Q.device))
        Lm = torch.where(strict, B[:, :, None] * torch.einsum("hic,hjc,hijc->hij", Kc, Kc, D), zero)
        eye = torch.eye(n, dtype=Q.dtype, device=Q.device).expand(H, n, n)
        Tm = torch.linalg.solve_triangular(eye + Lm, torch.diag_embed(B), upper=False, unitriangular=True)
        W = Tm @ (torch.exp(G) * Kc)
        U = Tm @ V
        Vnew = U - W @ S
        Aqk = torch.where(incl, torch.einsum("hic,hjc,hijc->hij", Q, Kc, D), zero)
        outs.append(((Q * torch.exp(G)) @ S + Aqk @ Vnew).transpose(0, 1))
        Gl = G[:, -1:, :]                                            # [H, 1, K]
        S = torch.exp(Gl).transpose(1, 2) * S + (torch.exp(Gl - G) * Kc).transpose(1, 2) @ Vnew
    return torch.cat(outs), S.transpose(1, 2)


def gated_rmsnorm(o: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """z = o * rsqrt(mean(o^2) + eps) * w * sigmoid(g) per head, fp32 (§4.2 step 8). o, g [T, H, V]; w [V]."""
    o = o.to(acc())
    return o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * w.to(acc()) * torch.sigmoid(g.to(acc()))


def kda_prefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu_seqlens, slots, *,
                num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5, chunked: bool = False):
    """KdaPrefill (module docstring has the schema). Sequences continue from their slots' state and conv
    history. Returns (out [T, P] in qkv's dtype, state [S, H, V, K] f32, conv [S, 3P, W-1]).

    Raises ValueError for a zero-length sequence, a slot outside [0, S) or mismatched shapes.
    """
    T = qkv.shape[0]
    H, K = num_heads, head_dim
    P = H * K
    if qkv.shape[-1] != 3 * P or f.shape != (T, P) or b.shape != (T, H) or g.shape != (T, P):
        raise ValueError(f"KDA shapes: qkv {tuple(qkv.shape)}, f {tuple(f.shape)}, b {tuple(b.shape)}, g {tuple(g.shape)} "
                         f"do not match num_heads={H}, head_dim={K}")
    lens = check_cu_seqlens(cu_seqlens, T)
    if slots.shape[0] != len(lens):
        raise ValueError(f"slots has {slots.shape[0]} entries for {len(lens)} sequences")
    sl = [int(s) for s in slots.tolist()]
    if any(not 0 <= s < state.shape[0] for s in sl):
        raise ValueError(f"slots {sl} outside the pool [0, {state.shape[0]})")
    state_out, conv_out = state.clone(), conv.clone()
    out = torch.empty(T, P, dtype=qkv.dtype, device=qkv.device)
    gate = kda_gate(f, A_log, dt_bias, H, lower_bound)
    beta = torch.sigmoid(b.to(acc()))
    rule = delta_rule_chunked if chunked else delta_rule_recurrent
    start = 0
    for n, L in enumerate(lens):
        t = slice(start, start + L)
        y, hist = short_conv(qkv[t], conv_w, conv[sl[n]])
        conv_out[sl[n]] = hist.to(conv.dtype)
        q = l2norm(y[:, :P].view(L, H, K)) * K ** -0.5
        k = l2norm(y[:, P:2 * P].view(L, H, K))
        v = y[:, 2 * P:].view(L, H, K)
        o, S = rule(q, k, v, gate[t], beta[t], state[sl[n]])
        state_out[sl[n]] = S
        out[t] = gated_rmsnorm(o, g[t].view(L, H, K), o_norm_w, norm_eps).reshape(L, P).to(qkv.dtype)
        start += L
    return out, state_out, conv_out


def kda_decode(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, *,
               num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5):
    """KdaDecode: one token per sequence (T == B == len(slots)); same math as a prefill of length-1 sequences."""
    B = qkv.shape[0]
    if slots.shape[0] != B:
        raise ValueError(f"KdaDecode: slots has {slots.shape[0]} entries for {B} tokens (one token per sequence)")
    cu = torch.arange(B + 1, dtype=torch.int32)
    return kda_prefill(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, cu, slots,
                       num_heads=num_heads, head_dim=head_dim, lower_bound=lower_bound, norm_eps=norm_eps)
