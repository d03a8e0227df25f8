"""The fp32 PyTorch reference of the Kimi K3 text model (MODEL.md §3-§7), state-carrying and TP/EP-aware.

Every forward runs over a packed batch described by `Batch` (prefill chunks of several sequences, or decode
with one token per sequence) and reads/writes the decode state through pools addressed by slot (KDA) and
block table (MLA), exactly as the exported graphs and the runtime do. The per-layer decode-state
declaration is `state_spec`; `runtime/cache.py` allocates from it.

Weights are dicts keyed by names relative to the layer prefix (`self_attn.q_proj.weight`, ...) as
`model.checkpoint.Checkpoint.layer_weights` returns them, already sharded for this rank
(`model.sharding`). Local head/expert counts are read from the weight shapes.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from k3deploy.plugins.common import acc

from k3deploy.model.config import K3Config
from k3deploy.model.layers import ColumnLinear, Comm, Linear, RowLinear, attn_res, matmul_t, rms_norm
from k3deploy.model.layers import dense_dtype as dense_dtype_of
from k3deploy.plugins.kda import reference as kda_ref
from k3deploy.plugins.mla import reference as mla_ref
from k3deploy.plugins.moe import reference as moe_ref


# ---- batch metadata and decode-state declaration -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SnapshotRound:
    """One round of a `KdaSnapshot` split: the next piece of every sequence that has one, packed.

    tokens [Tj] int64: the batch's packed rows of the pieces, in order; cu [Nj+1] int32: their offsets in that
    packing; seqs [Nj] int64: the batch sequence of each piece; starts [Nj] int32: where each piece starts in its
    sequence; snap [Cj] int64 and rows [Cj] int64: the batch sequences whose KDA state after this round (their
    piece ends on a snapshot offset) goes to which snapshot row; span: (first, end) when `tokens` is that one
    contiguous range of packed rows (a slice instead of a gather), else None."""

    tokens: torch.Tensor
    cu: torch.Tensor
    seqs: torch.Tensor
    starts: torch.Tensor
    snap: torch.Tensor
    rows: torch.Tensor
    span: tuple[int, int] | None = None

    def to(self, device: "str | torch.device") -> "SnapshotRound":
        """The same round with its index tensors on `device` (span stays on the host)."""
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in (
            "tokens", "cu", "seqs", "starts", "snap", "rows")})

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of packed x [T, ...] this round runs."""
        return x[self.span[0]:self.span[1]] if self.span else x.index_select(0, self.tokens)


@dataclasses.dataclass(frozen=True)
class KdaSnapshot:
    """KDA states to copy from inside a prefill forward (`Batch.kda_snapshot`): for each (seq, offset, row) of `at`,
    every KDA layer's recurrent state and conv history of batch sequence `seq` after its first `offset` tokens of
    this batch go to row `row` of `pools` ({KDA layer: {"state" [R, H, V, K] f32, "conv" [R, 3P, W-1]}},
    runtime.prefix_cache.SnapshotPool.pools; written in place). A sequence may have several offsets. Build it with
    `KdaSnapshot.of`: `rounds` cut every sequence at its offsets and run piece j of every sequence in round j
    (a sequence without offsets runs whole in round 0)."""

    at: tuple[tuple[int, int, int], ...]
    pools: dict = dataclasses.field(repr=False)
    rounds: tuple[SnapshotRound, ...]

    @classmethod
    def of(cls, cu_seqlens: list[int], at, pools: dict) -> "KdaSnapshot":
        """Args: cu_seqlens: the batch's packed offsets (host ints); at: (seq, offset, row) triples,
        0 < offset <= that sequence's length, distinct offsets per sequence and distinct rows; pools: the
        destination rows' tensors.
        Raises ValueError for an offset outside its sequence, an offset or a row named twice."""
        at = tuple(sorted((int(q), int(o), int(r)) for q, o, r in at))
        if len({(q, o) for q, o, _ in at}) != len(at) or len({r for _, _, r in at}) != len(at):
            raise ValueError(f"kda_snapshot {at}: an offset of a sequence or a row named twice")
        cuts: dict[int, list[tuple[int, int]]] = {}
        for q, o, r in at:
            if not 0 <= q < len(cu_seqlens) - 1 or not 0 < o <= cu_seqlens[q + 1] - cu_seqlens[q]:
                raise ValueError(f"kda_snapshot: offset {o} outside sequence {q}")
            cuts.setdefault(q, []).append((o, r))
        pieces: list[list[tuple[int, int, int, int | None]]] = []      # round -> (seq, start, end, row)
        for q in range(len(cu_seqlens) - 1):
            n, start = cu_seqlens[q + 1] - cu_seqlens[q], 0
            ends = cuts.get(q, []) + ([(n, None)] if not cuts.get(q) or cuts[q][-1][0] < n else [])
            for j, (end, row) in enumerate(ends):
                if len(pieces) <= j:
                    pieces.append([])
                pieces[j].append((q, start, end, row))
                start = end

        def t(x, dtype=torch.long):
            return torch.tensor(x, dtype=dtype)
        rounds = []
        for piece in pieces:
            tokens = [cu_seqlens[q] + i for q, a, b, _ in piece for i in range(a, b)]
            cu = [0]
            for _, a, b, _ in piece:
                cu.append(cu[-1] + b - a)
            span = (tokens[0], tokens[-1] + 1) if tokens and tokens[-1] + 1 - tokens[0] == len(tokens) else None
            rounds.append(SnapshotRound(t(tokens), t(cu, torch.int32), t([q for q, _, _, _ in piece]),
                                        t([a for _, a, _, _ in piece], torch.int32),
                                        t([q for q, _, _, r in piece if r is not None]),
                                        t([r for _, _, _, r in piece if r is not None]), span))
        return cls(at, pools, tuple(rounds))

    def to(self, device: "str | torch.device") -> "KdaSnapshot":
        """The same snapshot with its index tensors on `device` (the pools stay where they are)."""
        return dataclasses.replace(self, rounds=tuple(r.to(device) for r in self.rounds))

    def save(self, rnd: SnapshotRound, pools: dict, slots: torch.Tensor, layers) -> None:
        """Copy the KDA state and conv history that `pools` ({layer: {"state", "conv"}}) hold after round `rnd` for
        its snapshotted sequences (batch slots `slots` [N]) into their rows, for each of `layers`."""
        if not rnd.rows.numel():
            return
        src = slots.index_select(0, rnd.snap.to(slots.device)).long()
        for l in layers:
            for name, dst in self.pools[l].items():
                dst.index_copy_(0, rnd.rows.to(dst.device), pools[l][name].index_select(0, src).to(dst))


@dataclasses.dataclass
class Batch:
    """Attention metadata of one forward over N sequences packed into T tokens.

    cu_seqlens [N+1] int32; slots [N] int32 (KDA slot of each sequence, >= 1; 0 = padding sentinel);
    block_tables [N, MB] int32; context_lens [N] int32 (tokens already cached); decode: every sequence
    contributes exactly one token and continues a cached context (uses the decode ops). kda_snapshot (prefill
    only): KDA states to copy at positions inside the sequences (`KdaSnapshot`), or None.
    """

    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    decode: bool = False
    kda_snapshot: KdaSnapshot | None = None

    @property
    def num_seqs(self) -> int:
        return self.slots.shape[0]

    @property
    def last_token_index(self) -> torch.Tensor:
        """Index of each sequence's last token in the packed batch [N]."""
        return (self.cu_seqlens[1:] - 1).long()

    def to(self, device: "str | torch.device") -> "Batch":
        """The same metadata with every tensor on `device` (self when they already are; None fields stay None)."""
        device = torch.device(device)
        ts = (self.cu_seqlens, self.slots, self.block_tables, self.context_lens)
        snap = self.kda_snapshot
        if all(t is None or t.device == device for t in ts + ((snap.rounds[0].tokens,) if snap is not None else ())):
            return self
        return Batch(*(None if t is None else t.to(device) for t in ts), decode=self.decode,
                     kda_snapshot=snap.to(device) if snap is not None else None)


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One decode-state tensor of a layer: shape per unit (`slot` for KDA, `token` for the paged MLA cache)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    unit: str

    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def state_spec(cfg: K3Config, tp: int = 1, act_dtype: torch.dtype = torch.float32) -> dict[int, dict[str, StateSpec]]:
    """Per-layer decode state of one TP rank (§9): KDA `state` [H/tp, V, K] f32 and `conv` [3P/tp, W-1] per slot;
    MLA `cache` [576] per token (replicated over TP). Raises ValueError when tp does not divide the heads."""
    if cfg.kda_num_heads % tp or cfg.num_attention_heads % tp:
        raise ValueError(f"tp = {tp}: must divide the KDA heads ({cfg.kda_num_heads}) and MLA heads ({cfg.num_attention_heads})")
    H, K = cfg.kda_num_heads // tp, cfg.kda_head_dim
    out: dict[int, dict[str, StateSpec]] = {}
    for l in range(cfg.num_hidden_layers):
        if cfg.layer_kind(l) == "kda":
            out[l] = {"state": StateSpec((H, K, K), torch.float32, "slot"),
                      "conv": StateSpec((3 * H * K, cfg.conv_kernel_size - 1), act_dtype, "slot")}
        else:
            out[l] = {"cache": StateSpec((cfg.latent_dim,), act_dtype, "token")}
    return out


def allocate_pools(cfg: K3Config, num_slots: int, num_blocks: int, block_size: int, tp: int = 1,
                   act_dtype: torch.dtype = torch.float32, device="cpu") -> dict[int, dict[str, torch.Tensor]]:
    """Zeroed pools from `state_spec`: KDA [num_slots, *shape], MLA [num_blocks, block_size, 576]."""
    pools: dict[int, dict[str, torch.Tensor]] = {}
    for l, specs in state_spec(cfg, tp, act_dtype).items():
        pools[l] = {}
        for name, s in specs.items():
            lead = (num_slots,) if s.unit == "slot" else (num_blocks, block_size)
            pools[l][name] = torch.zeros(lead + s.shape, dtype=s.dtype, device=device)
    return pools


def _to_device(w: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """w with every tensor on `device` (dtypes kept: MXFP4 codes and scales stay packed uint8)."""
    return {k: v.to(device) for k, v in w.items()}


# ---- the custom ops the modules call ---------------------------------------------------------------

class ReferenceOps:
    """The five custom ops and the MoE router (`route`, §7.2) as their fp32 references. `plugins.torch_ops` offers
    the same names as torch.library ops (for export, and GPU kernels when present); pass either as
    `K3Model(..., ops=)`."""

    kda_prefill = staticmethod(kda_ref.kda_prefill)
    kda_decode = staticmethod(kda_ref.kda_decode)
    mla_prefill = staticmethod(mla_ref.mla_prefill)
    mla_decode = staticmethod(mla_ref.mla_decode)
    mxfp4_moe = staticmethod(moe_ref.mxfp4_moe)
    route = staticmethod(moe_ref.route)


# ---- attention and feed-forward modules -----------------------------------------------------------

def kda_prefill_snapshotting(kda_prefill, args: tuple, state: torch.Tensor, conv: torch.Tensor, batch: Batch,
                             layer: int, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kda_prefill(*args, state, conv, batch.cu_seqlens, batch.slots, **kw)` (an ops' KdaPrefill, args its inputs
    0..7) that also takes the in-step snapshots of `batch.kda_snapshot` for KDA layer `layer`: the sequences run in
    the snapshot's rounds, piece after piece, and after each round the slots of the sequences that stand at a
    snapshot offset are copied into their rows. Each piece continues from its slot as a prefill chunk that starts
    there does, so out and the pools are those of the batch cut at the snapshot offsets.

    Returns:
        (out [T, P], state, conv) as kda_prefill returns them.
    """
    s = batch.kda_snapshot
    acts, weights = args[:4], args[4:]
    whole = None
    for rnd in s.rounds:
        piece = [rnd.take(a) for a in acts]
        out, state, conv = kda_prefill(*piece, *weights, state, conv, rnd.cu, batch.slots.index_select(0, rnd.seqs),
                                       **kw)
        s.save(rnd, {layer: {"state": state, "conv": conv}}, batch.slots, (layer,))
        if len(s.rounds) == 1:                        # every sequence whole: the pieces are the batch
            return out, state, conv
        if whole is None:
            whole = out.new_empty(acts[0].shape[0], out.shape[1])
        if rnd.span:
            whole[rnd.span[0]:rnd.span[1]] = out
        else:
            whole.index_copy_(0, rnd.tokens, out)
    return whole, state, conv


class KDAAttention:
    """KDA layer (§4): q/k/v/f/b/g projections, then the fused `KdaPrefill`/`KdaDecode` op, then o_proj. `layer`:
    its index in the model (the key of its rows in a `KdaSnapshot`'s pools)."""

    def __init__(self, cfg: K3Config, w: dict[str, torch.Tensor], layer: int):
        self.layer = layer
        a = "self_attn."
        self.K = cfg.kda_head_dim
        self.H = w[a + "q_proj.weight"].shape[0] // self.K
        self.lower_bound, self.eps = cfg.gate_lower_bound, cfg.rms_norm_eps
        self.qkv = ColumnLinear(torch.cat([w[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")]))
        self.f_a = Linear(w[a + "f_a_proj.weight"])
        self.f_b = ColumnLinear(w[a + "f_b_proj.weight"])
        self.b = ColumnLinear(w[a + "b_proj.weight"])
        self.g = ColumnLinear(w[a + "g_proj.weight"])
        self.conv_w = torch.cat([w[a + n + ".weight"][:, 0, :] for n in ("q_conv1d", "k_conv1d", "v_conv1d")]).to(acc())
        self.A_log = w[a + "A_log"].to(acc())[: self.H]
        self.dt_bias = w[a + "dt_bias"].to(acc())
        self.o_norm_w = w[a + "o_norm.weight"].to(acc())
        self.o = RowLinear(w[a + "o_proj.weight"])

    def op_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The op's activation and weight inputs 0..7 for normalized layer input x [T, d]."""
        return (self.qkv(x), self.f_b(self.f_a(x)), self.b(x), self.g(x),
                self.conv_w, self.A_log, self.dt_bias, self.o_norm_w)

    def __call__(self, x, batch: Batch, pools: dict, comm: Comm, ops=ReferenceOps):
        args = self.op_inputs(x)
        kw = dict(num_heads=self.H, head_dim=self.K, lower_bound=self.lower_bound, norm_eps=self.eps)
        if batch.decode:
            out, st, cv = ops.kda_decode(*args, pools["state"], pools["conv"], batch.slots, **kw)
        elif batch.kda_snapshot is not None:
            out, st, cv = kda_prefill_snapshotting(ops.kda_prefill, args, pools["state"], pools["conv"], batch,
                                                   self.layer, **kw)
        else:
            out, st, cv = ops.kda_prefill(*args, pools["state"], pools["conv"], batch.cu_seqlens, batch.slots, **kw)
        return self.o(out, comm), {"state": st, "conv": cv}


class MLAAttention:
    """Gated MLA (§5): LoRA q and kv with their 1e-6 norms, no rotary; unabsorbed prefill, absorbed decode."""

    def __init__(self, cfg: K3Config, w: dict[str, torch.Tensor]):
        a = "self_attn."
        self.Dn, self.Dr, self.Dv, self.R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.H = w[a + "q_b_proj.weight"].shape[0] // cfg.q_head_dim
        self.eps, self.scale = cfg.lora_norm_eps, cfg.mla_scale
        self.q_a = Linear(w[a + "q_a_proj.weight"])
        self.q_a_norm = w[a + "q_a_layernorm.weight"].to(acc())
        self.q_b = ColumnLinear(w[a + "q_b_proj.weight"])
        self.kv_a = Linear(w[a + "kv_a_proj_with_mqa.weight"])
        self.kv_a_norm = w[a + "kv_a_layernorm.weight"].to(acc())
        self.kv_b = w[a + "kv_b_proj.weight"].to(acc())                       # [H*(Dn+Dv), R]
        kvb = self.kv_b.view(self.H, self.Dn + self.Dv, self.R)
        self.w_uk, self.w_uv = kvb[:, : self.Dn], kvb[:, self.Dn:]          # [H, Dn, R], [H, Dv, R]
        self.g = ColumnLinear(w[a + "g_proj.weight"])
        self.o = RowLinear(w[a + "o_proj.weight"])

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, Dn+Dr] and the new latent rows [T, R+Dr] (c_kv normalized ‖ k_pe raw)."""
        q = self.q_b(rms_norm(self.q_a(x), self.q_a_norm, self.eps)).view(x.shape[0], self.H, -1)
        kv = self.kv_a(x)
        return q, torch.cat([rms_norm(kv[:, : self.R], self.kv_a_norm, self.eps), kv[:, self.R:]], -1)

    def absorb(self, q: torch.Tensor) -> torch.Tensor:
        """q_abs [T, H, R+Dr] = q_nope · W_UK ‖ q_pe (§5.3)."""
        return torch.cat([torch.einsum("thd,hdr->thr", q[..., : self.Dn], self.w_uk), q[..., self.Dn:]], -1)

    def __call__(self, x, batch: Batch, pools: dict, comm: Comm, ops=ReferenceOps):
        T = x.shape[0]
        q, latent = self.project(x)
        if batch.decode:
            o_lat, cache = ops.mla_decode(self.absorb(q), latent, pools["cache"], batch.block_tables, batch.context_lens,
                                              num_heads=self.H, kv_lora_rank=self.R, scale=self.scale)
            o = torch.einsum("thr,hvr->thv", o_lat.to(acc()), self.w_uv).reshape(T, -1)
        else:
            o, cache = ops.mla_prefill(q, latent, self.kv_b, pools["cache"], batch.block_tables, batch.cu_seqlens,
                                           batch.context_lens, num_heads=self.H, qk_nope_head_dim=self.Dn,
                                           v_head_dim=self.Dv, kv_lora_rank=self.R, scale=self.scale)
        return self.o(o.to(acc()) * torch.sigmoid(self.g(x)), comm), {"cache": cache}


class DenseMLP:
    """SiTU-GLU MLP (§7.1; also the shared experts): column gate/up, row down (all-reduced)."""

    def __init__(self, cfg: K3Config, w: dict[str, torch.Tensor], prefix: str):
        self.gate = ColumnLinear(w[prefix + "gate_proj.weight"])
        self.up = ColumnLinear(w[prefix + "up_proj.weight"])
        self.down = RowLinear(w[prefix + "down_proj.weight"])
        self.beta, self.lbeta = cfg.situ_beta, cfg.situ_linear_beta

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's un-reduced output [T, d]."""
        return self.down(moe_ref.situ(self.gate(x), self.up(x), self.beta, self.lbeta))

    def __call__(self, x, comm: Comm, ops=ReferenceOps):
        return comm.all_reduce(self.partial(x))


def stack_experts(w: dict[str, torch.Tensor], cfg: K3Config) -> tuple[int, dict[str, torch.Tensor]]:
    """Stack this rank's routed experts into the `Mxfp4Moe` weight layout.

    Returns (expert_offset, {w13_packed [E, 2I, R/2], w13_scale [E, 2I, R/32], w2_packed [E, R, I/2],
    w2_scale [E, R, I/32]}) where E = experts present in `w` (contiguous ids). Raises ValueError when the
    experts are bf16 (the op takes MXFP4) or ids are not contiguous.
    """
    m = "block_sparse_moe.experts."
    ids = sorted({int(k[len(m):].split(".")[0]) for k in w if k.startswith(m)})
    if not ids or ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"routed experts {ids[:4]}...: must be a non-empty contiguous range on a rank")
    if m + f"{ids[0]}.w1.weight_packed" not in w:
        raise ValueError("routed experts are not MXFP4 (no weight_packed); the Mxfp4Moe op needs MXFP4 experts (§8.3)")

    def get(e, mat, kind):
        return w[f"{m}{e}.{mat}.weight_{kind}"]

    out = {f"w13_{k}": torch.stack([torch.cat([get(e, "w1", k), get(e, "w3", k)]) for e in ids]) for k in ("packed", "scale")}
    out.update({f"w2_{k}": torch.stack([get(e, "w2", k) for e in ids]) for k in ("packed", "scale")})
    return ids[0], out


class LatentMoE:
    """Stable LatentMoE (§7.2): fp32 noaux_tc router, latent down-projection, MXFP4 routed experts (this
    rank's experts / slice), latent all-reduce BEFORE the latent RMSNorm, up-projection, shared experts."""

    def __init__(self, cfg: K3Config, w: dict[str, torch.Tensor]):
        m = "block_sparse_moe."
        self.cfg = cfg
        self.gate_w = w[m + "gate.weight"].to(acc())
        self.bias = w[m + "gate.e_score_correction_bias"].to(acc())
        self.down = Linear(w[m + "routed_expert_down_proj.weight"])
        self.norm_w = w[m + "routed_expert_norm.weight"].to(acc()) if cfg.latent_moe_use_norm else None
        self.up = Linear(w[m + "routed_expert_up_proj.weight"])
        self.shared = DenseMLP(cfg, w, m + "shared_experts.") if cfg.num_shared_experts else None
        self.expert_offset, self.experts = stack_experts(w, cfg)

    def route(self, x: torch.Tensor, ops=ReferenceOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (expert ids [T, k] int, weights fp32 [T, k]) through `ops.route` (§7.2)."""
        c = self.cfg
        return ops.route(x, self.gate_w, self.bias, top_k=c.num_experts_per_token, num_expert_group=c.num_expert_group,
                         topk_group=c.topk_group, renormalize=c.moe_renormalize, scaling=c.routed_scaling_factor)

    def __call__(self, x, comm: Comm, ops=ReferenceOps):
        c = self.cfg
        ids, wts = self.route(x, ops)
        yl = ops.mxfp4_moe(self.down(x), ids.int(), wts, **self.experts, expert_offset=self.expert_offset,
                               situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta, num_experts=c.num_experts)
        y = self.shared.partial(x) if self.shared is not None else None
        yl = comm.all_reduce(yl)
        y_shared = comm.all_reduce(y) if y is not None else 0.0
        yl = rms_norm(yl, self.norm_w, c.rms_norm_eps) if c.latent_moe_use_norm else yl
        return self.up(yl) + y_shared


class DecoderLayer:
    """One decoder layer with Block AttnRes reads (§6.3): (P, bank) -> (P, bank)."""

    def __init__(self, cfg: K3Config, l: int, w: dict[str, torch.Tensor]):
        self.cfg, self.l = cfg, l
        f = lambda n: w[n].to(acc())  # noqa: E731
        self.in_norm, self.post_norm = f("input_layernorm.weight"), f("post_attention_layernorm.weight")
        self.attn_res_w = (f("self_attention_res_norm.weight"), f("self_attention_res_proj.weight"))
        self.mlp_res_w = (f("mlp_res_norm.weight"), f("mlp_res_proj.weight"))
        self.attn = KDAAttention(cfg, w, l) if cfg.layer_kind(l) == "kda" else MLAAttention(cfg, w)
        self.mlp = LatentMoE(cfg, w) if cfg.is_moe(l) else DenseMLP(cfg, w, "mlp.")

    def linears(self) -> list[Linear]:
        """Every dense projection of this layer (attention, MLP or latent MoE projections, shared experts)."""
        mods = [self.attn, self.mlp, getattr(self.mlp, "shared", None)]
        return [v for m in mods if m is not None for v in vars(m).values() if isinstance(v, Linear)]

    def __call__(self, P: torch.Tensor, bank: torch.Tensor, batch: Batch, pools: dict, comm: Comm, ops=ReferenceOps):
        """P [T, d] running block sum, bank [T, nb, d] committed rows -> (P, bank [T, nb(+1), d], pools)."""
        eps = self.cfg.rms_norm_eps
        h = attn_res(torch.cat([bank, P[:, None]], 1), *self.attn_res_w, eps) if bank.shape[1] else P
        commit = self.cfg.is_commit(self.l)
        if commit:
            bank = torch.cat([bank, P[:, None]], 1)
        a, pools = self.attn(rms_norm(h, self.in_norm, eps), batch, pools, comm, ops)
        P = a if commit else P + a
        h = attn_res(torch.cat([bank, P[:, None]], 1), *self.mlp_res_w, eps)
        P = P + self.mlp(rms_norm(h, self.post_norm, eps), comm, ops)
        return P, bank, pools


class K3Model:
    """The whole text model for one TP/EP rank. `layer_weights(l)` and `model_weights` are (sharded) weight
    dicts; see `from_checkpoint`. Vocabulary is split across TP ranks (masked lookup + all-reduce,
    all-gathered logits).

    The model runs on the device its weights are on (`device`): dense weights are held in fp32 there (or in
    `dense_dtype`: "bfloat16" halves their bytes and runs the projections and lm_head as bf16 GEMMs, the
    embedding a bf16 table; everything else stays fp32), MXFP4 experts stay packed uint8. `forward` moves ids and batch
    metadata to that device; pools must already be there (`allocate_pools(..., device=model.device)`). `ops` picks the five custom ops: `ReferenceOps` (fp32, any
    device), `plugins.torch_ops.TorchOps` (torch.library ops; Triton kernels on CUDA) or
    `plugins.torch_ops.KernelOps` (the CUDA kernels called directly, pools updated in place)."""

    def __init__(self, cfg: K3Config, model_weights: dict, layer_weights, comm: Comm | None = None, ops=ReferenceOps,
                 dense_dtype: "str | torch.dtype | None" = None):
        self.cfg, self.comm, self.ops = cfg, comm or Comm(), ops
        bf16 = dense_dtype_of(dense_dtype) == torch.bfloat16      # "float32" keeps the accumulation dtype
        wdt = torch.bfloat16 if bf16 else acc()
        self.embed_w = model_weights["embed_tokens.weight"].to(wdt)
        self.vocab_start = self.comm.rank * self.embed_w.shape[0]
        self.lm_head = model_weights["lm_head.weight"].to(wdt)
        self.norm_w = model_weights["norm.weight"].to(acc())
        self.out_res_w = (model_weights["output_attn_res_norm.weight"].to(acc()),
                          model_weights["output_attn_res_proj.weight"].to(acc()))
        self.layers = []
        for l in range(cfg.num_hidden_layers):          # cast layer by layer: one layer in fp32 at a time
            layer = DecoderLayer(cfg, l, layer_weights(l))
            if bf16:
                for lin in layer.linears():
                    lin.cast(wdt)
            self.layers.append(layer)

    @property
    def dense_dtype(self) -> torch.dtype:
        """The dtype of the dense weights: projections, embedding and lm_head (fp32 unless `dense_dtype` was
        given); norms, AttnRes, KDA conv/gates, the router, MLA's kv_b and everything the ops compute stay fp32."""
        return self.lm_head.dtype

    @property
    def device(self) -> torch.device:
        """The device of the weights (where forward runs)."""
        return self.embed_w.device

    @classmethod
    def from_checkpoint(cls, path, rank: int = 0, tp: int = 1, ep: int = 1, comm: Comm | None = None,
                        ops=ReferenceOps, device: "str | torch.device" = "cpu",
                        dense_dtype: "str | torch.dtype | None" = None) -> "K3Model":
        """Load (and shard for rank/tp/ep, §10) a checkpoint directory onto `device` (one layer's stored tensors
        at a time pass through host memory); dense weights in `dense_dtype` (default fp32; see `dense_dtype`).
        Raises CheckpointError on a bad checkpoint, ValueError for a bad dense_dtype."""
        dense_dtype_of(dense_dtype)                        # a bad name fails before any loading
        from k3deploy.model.checkpoint import Checkpoint
        from k3deploy.model.sharding import shard_layer, shard_model
        ck = Checkpoint(path)
        cfg = ck.config
        return cls(cfg, _to_device(shard_model(cfg, ck.model_weights(), rank, tp), device),
                   lambda l: _to_device(shard_layer(cfg, l, ck.layer_weights(l), rank, tp, ep), device),
                   comm or Comm(rank, tp), ops, dense_dtype)

    @classmethod
    def from_synthetic(cls, cfg: K3Config, seed: int = 0, rank: int = 0, tp: int = 1, ep: int = 1,
                       comm: Comm | None = None, ops=ReferenceOps, device: "str | torch.device" = "cpu",
                       keep_full: "dict | None" = None, dense_dtype: "str | torch.dtype | None" = None) -> "K3Model":
        """The model with `model.synthetic` weights drawn directly on `device` (no checkpoint on disk; see
        `model.synthetic.SyntheticSource` for the recipe and why CUDA draws differ from the CPU checkpoint of the
        same seed), sharded for rank/tp/ep. Every rank draws the full tensors from the same seeds, so the shards
        agree; an EP rank draws only its own experts. `keep_full`: a dict that receives CPU copies of the unsharded
        weights ({"model": {...}, "layers": {l: {...}}}) to build a TP=1 reference from the same values (small
        configs only). `dense_dtype` as in `from_checkpoint`. Raises ValueError when tp/ep cannot shard cfg or for a
        bad dense_dtype."""
        from k3deploy.model.sharding import check_parallel, shard_layer, shard_model
        from k3deploy.model.synthetic import synthetic_layer_weights, synthetic_model_weights
        check_parallel(cfg, tp, ep)
        dense_dtype_of(dense_dtype)
        per = cfg.num_experts // ep
        mine = range(rank * per, (rank + 1) * per) if ep > 1 and keep_full is None else None

        def model_w():
            w = synthetic_model_weights(cfg, seed, device)
            if keep_full is not None:
                keep_full["model"] = {k: v.cpu() for k, v in w.items()}
            return shard_model(cfg, w, rank, tp)

        def layer_w(l):
            w = synthetic_layer_weights(cfg, l, seed, device, experts=mine)
            if keep_full is not None:
                keep_full.setdefault("layers", {})[l] = {k: v.cpu() for k, v in w.items()}
            return shard_layer(cfg, l, w, rank, tp, ep)

        return cls(cfg, model_w(), layer_w, comm or Comm(rank, tp), ops, dense_dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int -> P [T, d] fp32 (no scaling, §3)."""
        V = self.embed_w.shape[0]
        local = ids.long() - self.vocab_start
        ok = (local >= 0) & (local < V)
        e = self.embed_w[local.clamp(0, V - 1)].to(acc()) * ok[:, None]
        return self.comm.all_reduce(e)

    def head(self, P: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
        """Output AttnRes, final norm and lm_head: [T, d], [T, nb, d] -> logits [T, vocab] fp32."""
        h = attn_res(torch.cat([bank, P[:, None]], 1), *self.out_res_w, self.cfg.rms_norm_eps)
        return self.comm.all_gather_last(matmul_t(rms_norm(h, self.norm_w, self.cfg.rms_norm_eps), self.lm_head))

    def forward(self, ids: torch.Tensor, batch: Batch, pools: dict, logits_index: torch.Tensor | None = None,
                image_rows: "tuple[torch.Tensor, torch.Tensor] | None" = None):
        """ids [T] packed tokens -> (logits [T or len(logits_index), vocab] fp32 on `device`, new pools).
        ids, batch and logits_index may be on the host (they are moved; validating host ids costs no device
        sync); pools must be on `device`. image_rows: (positions [n] int64 into the T tokens, rows [n, d]) written
        over the embedding before layer 0 (the projected image rows at their `<|media_pad|>` positions, VISION.md
        §8.3: they become bank row 0 of AttnRes). Raises ValueError for a token id outside [0, vocab_size)."""
        self.check_ids(ids)
        dev = self.device
        ids, batch = ids.to(dev), batch.to(dev)
        if logits_index is not None:
            logits_index = logits_index.to(dev)
        if image_rows is not None:
            image_rows = (image_rows[0].to(dev), image_rows[1].to(dev))
        return self.forward_on_device(ids, batch, pools, logits_index, image_rows)

    def check_ids(self, ids: torch.Tensor) -> None:
        """Raise ValueError naming the bad ids when a token id is outside [0, vocab_size) (reads ids: pass host ids)."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids: {[int(t) for t in ids if not 0 <= int(t) < self.cfg.vocab_size][:4]} outside "
                             f"[0, vocab_size={self.cfg.vocab_size}); pass ids produced by the model's tokenizer")

    def forward_on_device(self, ids: torch.Tensor, batch: Batch, pools: dict, logits_index: torch.Tensor | None = None,
                          image_rows: "tuple[torch.Tensor, torch.Tensor] | None" = None):
        """`forward` without validation or copies: ids [T] int64, batch (int32 metadata), logits_index [M] int64 and
        image_rows already on `device`, ids trusted (out-of-range ids index out of bounds). Returns (logits [M or T,
        vocab] fp32, pools). No host reads: with in-place ops (KernelOps) the decode step can be captured in a CUDA
        graph (runtime/graphs.py)."""
        P = self.embed(ids)
        if image_rows is not None:
            P = P.index_put((image_rows[0],), image_rows[1].to(P.dtype))
        bank = P.new_zeros(P.shape[0], 0, P.shape[1])
        new = {}
        for l, layer in enumerate(self.layers):
            P, bank, new[l] = layer(P, bank, batch, pools[l], self.comm, self.ops)
        if logits_index is not None:
            P, bank = P[logits_index], bank[logits_index]
        return self.head(P, bank), new


class SequenceState:
    """Decode state of ONE sequence for the convenience forward: slot 1 of a 2-slot KDA pool and enough
    latent blocks for `max_len` tokens. `context_len` counts the tokens already processed. act_dtype: the conv
    history and latent cache dtype (§9: the model dtype, `K3Model.dense_dtype`; fp32 for the reference)."""

    def __init__(self, cfg: K3Config, max_len: int, block_size: int = 16, tp: int = 1, device="cpu",
                 act_dtype: torch.dtype = torch.float32):
        nblk = -(-max_len // block_size)
        self.pools = allocate_pools(cfg, num_slots=2, num_blocks=nblk + 1, block_size=block_size, tp=tp,
                                    act_dtype=act_dtype, device=device)
        self.block_table = torch.arange(1, nblk + 1, dtype=torch.int32)[None]
        self.context_len = 0
        self.max_len = max_len


def forward(model: K3Model, token_ids, state: SequenceState,
            image_features: torch.Tensor | None = None) -> tuple[torch.Tensor, SequenceState]:
    """forward(token_ids, state) -> (logits [L, vocab] fp32, state): prefill of any length L >= 1, or decode
    when L == 1 and context exists — one sequence, the same modules as the batched path (§4.4, §5.3).
    image_features [N, d]: the projected rows of the images whose N `<|media_pad|>` positions token_ids holds
    (VISION.md §8.3; ValueError when the count differs)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    L = ids.shape[0]
    if L < 1:
        raise ValueError("token_ids: empty; pass at least one token")
    if state.context_len + L > state.max_len:
        raise ValueError(f"token_ids: {state.context_len} + {L} tokens exceed the state's max_len {state.max_len}")
    batch = Batch(torch.tensor([0, L], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), state.block_table,
                  torch.tensor([state.context_len], dtype=torch.int32), decode=(L == 1 and state.context_len > 0))
    rows = None
    if image_features is not None:
        from k3deploy.model.vision import check_placeholders
        if model.cfg.vision is None:
            raise ValueError("image_features: the model's config has no vision_config")
        pos = check_placeholders(ids, [image_features.shape[0]], model.cfg.vision.media_placeholder_token_id)
        rows = (torch.tensor(pos, dtype=torch.long), image_features)
    logits, state.pools = model.forward(ids, batch, state.pools, image_rows=rows)
    state.context_len += L
    return logits, state
