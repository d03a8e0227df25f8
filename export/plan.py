"""The deployment plan: per-rank weights, per-rank activation/state shapes, the graph/engine list and the
decode-state memory plan, computed from the config alone (no weights allocated). MODEL.md §9, §10, §11; with a
vision_config also the vision tower's replicated weights and the activations of its largest call (VISION.md §9).

`make_plan(cfg, tp, ep, ...)` returns a `DeploymentPlan`; `DeploymentPlan.report()` formats it as the tables
`python export/build_engines.py --dry-run` prints.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from k3deploy.model.config import K3Config
from k3deploy.model.sharding import check_parallel
from k3deploy.model.weights import all_tensors, vision_tensors
from k3deploy.runtime.cache import MemoryPlan, plan_memory

GB, GiB, MiB = 10 ** 9, 2 ** 30, 2 ** 20
H200_BYTES = 141 * GB  # HBM3e per H200 (the product's nominal 141 GB)


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Weight bytes held by ONE rank, by how they are split (§10)."""

    replicated: int
    sharded: int
    experts: int
    vision: int = 0          # vision tower + projector, replicated on every rank (VISION.md §9, §13 Q9)

    @property
    def total(self) -> int:
        return self.replicated + self.sharded + self.experts + self.vision


def _split_totals(cfg: K3Config) -> tuple[int, int, int]:
    """Checkpoint bytes of the replicated, sharded and routed-expert tensors (summed once per config)."""
    key = cfg.config_hash()
    if key not in _TOTALS:
        rep = sh = ex = 0
        for t in all_tensors(cfg):
            if t.split == "rep":
                rep += t.nbytes
            elif t.split == "expert":
                ex += t.nbytes
            else:
                sh += t.nbytes
        _TOTALS[key] = (rep, sh, ex)
    return _TOTALS[key]


_TOTALS: dict[str, tuple[int, int, int]] = {}


def weight_bytes_per_rank(cfg: K3Config, tp: int, ep: int) -> WeightBytes:
    """Checkpoint bytes (stored dtypes: bf16/f32, MXFP4 experts 0.53125 B/param) one rank holds at tp/ep.
    Sharded tensors divide exactly (check_parallel); EP ranks hold num_experts/ep whole experts, TP-mode
    ranks a 1/tp slice of every expert. Raises ValueError when tp/ep cannot shard cfg."""
    check_parallel(cfg, tp, ep)
    rep, sh, ex = _split_totals(cfg)
    return WeightBytes(rep, sh // tp, ex // (ep if ep > 1 else tp), sum(s.nbytes for s in vision_tensors(cfg)))


def smallest_fit(cfg: K3Config, gpu_bytes: int, reserve: float = 0.1) -> tuple[int, WeightBytes] | None:
    """The fewest GPUs (everything n-way sharded: tp = ep = n) whose per-rank weights fit in
    (1 - reserve) x gpu_bytes, or None. Candidates are the n that divide the heads and experts."""
    for n in range(1, 257):
        try:
            w = weight_bytes_per_rank(cfg, n, n)
        except ValueError:
            continue
        if w.total <= (1 - reserve) * gpu_bytes:
            return n, w
    return None


def rank_shapes(cfg: K3Config, tp: int, ep: int) -> list[tuple[str, str]]:
    """Per-rank activation, state and weight-slice shapes (the seed's TP=8 table, symbolic T / B)."""
    H, K = cfg.kda_num_heads // tp, cfg.kda_head_dim
    Hm = cfg.num_attention_heads // tp
    E = cfg.num_experts // ep if ep > 1 else cfg.num_experts
    k = cfg.num_experts_per_token
    R = cfg.routed_expert_hidden_size
    return [
        ("KDA Q/K/V/G2", f"[T,{H},{K}]"),
        ("KDA beta", f"[T,{H}]"),
        ("KDA decay", f"[T,{H},{K}]"),
        ("KDA F_a (replicated)", f"[T,{K}]"),
        ("KDA recurrent state", f"[{H},{K},{K}] fp32"),
        ("KDA conv history", f"[{3 * H * K},{cfg.conv_kernel_size - 1}]"),
        ("MLA q (prefill)", f"[T,{Hm},{cfg.q_head_dim}]"),
        ("MLA q_latent (decode)", f"[B,{Hm},{cfg.latent_dim}]"),
        ("MLA latent (replicated)", f"[T,{cfg.latent_dim}]"),
        ("MoE router logits", f"[T,{cfg.num_experts}] fp32"),
        ("MoE experts per rank", f"{E}" + ("" if ep > 1 else f" (each 1/{tp} of I={cfg.moe_intermediate_size})")),
        ("MoE dispatch", f"[T*{k},{R}]"),
        ("AttnRes bank", f"[T,{cfg.num_bank_rows},{cfg.hidden_size}] (transient)"),
    ]


def vision_report(cfg: K3Config, patches: int) -> list[str]:
    """The plan's vision section: the call's largest activations (bf16) and FLOPs at `patches` patches (one image
    of the processor's largest grid)."""
    from k3deploy.model.vision import activation_bytes, tower_flops
    v = cfg.vision
    side = max(2, 2 * round(math.sqrt(patches) / 2))
    fl = tower_flops(v, [(1, side, max(2, 2 * (patches // side // 2)))])
    act = activation_bytes(v, patches)
    lines = [f"-- vision tower ({v.num_layers} blocks, D {v.hidden_size}, {v.num_heads} heads x {v.head_dim}; "
             f"replicated on every rank; one call of {patches:,} patches, bf16)"]
    for k, shape in (("tokens", f"[{patches},{v.hidden_size}]"), ("qkv", f"[{patches},{3 * v.qkv_hidden_size}]"),
                     ("mlp_hidden", f"[{patches},{v.intermediate_size}]"),
                     ("features", f"[{patches // 4},{v.text_hidden_size}]"), ("peak", "")):
        lines.append(f"  {k:<12} {shape:<16} {act[k]:>16,} B ({act[k] / MiB:9.1f} MiB)")
    lines.append(f"  FLOPs        GEMMs {fl['gemm'] / 1e12:.1f} T + attention {fl['attention'] / 1e12:.1f} T "
                 "(flash attention: no [ℓ,ℓ] scores)")
    return lines


def graph_list(cfg: K3Config, tp: int) -> list[str]:
    """The per-rank graphs/engines the pipeline produces: embed, each layer's prefill and decode graph (tp > 1:
    three segments each, attn/mlp/post), head, and `vision` with a vision_config (docs/EXPORT_FORMAT.md)."""
    segs = [""] if tp == 1 else [".attn", ".mlp", ".post"]
    names = ["embed"] + [f"layer{l:03d}.{g}{s}" for l in range(cfg.num_hidden_layers) for g in ("prefill", "decode")
                         for s in segs] + ["head"] + (["vision"] if cfg.vision is not None else [])
    return [f"rank{r}/{n}" for r in range(tp) for n in names]


@dataclasses.dataclass
class DeploymentPlan:
    cfg: K3Config
    tp: int
    ep: int
    gpu_bytes: int
    weights: WeightBytes
    memory: MemoryPlan | None
    memory_error: str | None
    request_bytes_1m: int
    request_bytes_1m_tp1: int
    kda_bytes_per_request: int
    latent_bytes_per_token: int
    max_batch_at_context: int
    smallest: tuple[int, WeightBytes] | None
    max_context: int = 0
    act_dtype: torch.dtype = torch.bfloat16
    vision_patches: int = 0          # patches of the largest vision call (the processor's bound)
    num_snapshots: int = 0           # prefix-cache snapshot pool rows (0: prefix caching off)

    @property
    def fits(self) -> bool:
        return self.weights.total < self.gpu_bytes

    def report(self) -> str:
        c, w = self.cfg, self.weights
        lines = [f"== plan: {c.name} ({c.num_hidden_layers} layers: {len(c.kda_layers)} KDA + {len(c.mla_layers)} MLA), "
                 f"TP={self.tp} EP={self.ep}, config {c.config_hash()}", "-- weights per rank"]
        rows = [("replicated", w.replicated), ("sharded (attention, dense, vocab)", w.sharded),
                ("routed experts", w.experts)]
        if w.vision:
            rows.append(("vision tower + projector (replicated)", w.vision))
        for k, v in rows + [("total", w.total)]:
            lines.append(f"  {k:<38} {v:>18,} B  ({v / GB:8.2f} GB)")
        gpus = f"{self.tp} x {self.gpu_bytes / GB:.0f} GB GPUs"
        if self.fits:
            lines.append(f"  fits {gpus} with {(self.gpu_bytes - w.total) / GB:.2f} GB per rank left for cache and activations")
        else:
            lines.append(f"  DOES NOT FIT {gpus}: {w.total / GB:.2f} GB of weights per rank > {self.gpu_bytes / GB:.0f} GB")
            if self.smallest:
                n, sw = self.smallest
                lines.append(f"  smallest fit at {self.gpu_bytes / GB:.0f} GB per GPU: {n} GPUs (TP={n}, EP={n}: "
                             f"{sw.total / GB:.2f} GB = {sw.total / GiB:.1f} GiB per rank), or {self.tp} GPUs with "
                             f">= {math.ceil(w.total / GB / 0.9)} GB each (weights + 10% for activations; "
                             "i.e. 256 GB-class GPUs), before KV/state")
        lines.append("-- per-rank shapes")
        lines += [f"  {k:<26} {v}" for k, v in rank_shapes(c, self.tp, self.ep)]
        lines.append("-- decode state per request")
        lines.append(f"  KDA state + conv per rank   {self.kda_bytes_per_request:,} B ({self.kda_bytes_per_request / MiB:.1f} MiB)"
                     " = one prefix-cache snapshot")
        if self.num_snapshots:
            pool = self.num_snapshots * self.kda_bytes_per_request
            lines.append(f"  snapshot pool (prefix cache) {self.num_snapshots} x that = {pool:,} B ({pool / GiB:.2f} GiB) "
                         "per rank, budgeted apart from the slots and latent blocks")
        lines.append(f"  latent per token per rank   {self.latent_bytes_per_token:,} B")
        lines.append(f"  one request at 1M context   {self.request_bytes_1m:,} B ({self.request_bytes_1m / GiB:.2f} GiB) per rank; "
                     f"whole model (TP=1) {self.request_bytes_1m_tp1:,} B ({self.request_bytes_1m_tp1 / GiB:.2f} GiB)")
        lines.append(f"  max batch at max context    {self.max_batch_at_context} (requests of max_context "
                     f"{self.max_context:,} tokens that the memory left after the weights and the activation reserve "
                     f"holds, {str(self.act_dtype).replace('torch.', '')} latents and conv history: a bound, not the "
                     "engines' slots, which are max_batch, below)")
        if c.vision is not None:
            lines += vision_report(c, self.vision_patches)
        lines.append("-- cache plan (one rank)")
        lines.append(self.memory.table() if self.memory else f"  {self.memory_error}")
        g = graph_list(c, self.tp)
        lines.append(f"-- graphs/engines: {len(g)} ({', '.join(g[:3])}, ..., {g[-1]})")
        return "\n".join(lines)


def make_plan(cfg: K3Config, tp: int = 1, ep: int = 1, *, gpu_bytes: int = H200_BYTES, max_batch: int = 8,
              max_context: int | None = None, block_size: int = 64, act_dtype: torch.dtype = torch.bfloat16,
              activation_reserve: float = 0.1, vision_patches: int | None = None,
              prefix_caching: bool = False, num_snapshots: int | None = None) -> DeploymentPlan:
    """Plan a deployment of cfg on tp ranks of gpu_bytes each. The cache budget per rank is what the weights
    (the vision tower's included) leave after `activation_reserve` of the GPU. vision_patches: patches of the
    largest vision call (default: the release processor's bound, 67,588). prefix_caching adds the snapshot pool
    to the cache plan: num_snapshots rows (default: the runtime's, runtime.prefix_cache.default_num_snapshots) of
    one request's KDA bytes each. Raises ValueError (naming tp/ep) when they cannot shard cfg."""
    from k3deploy.runtime.prefix_cache import default_num_snapshots
    snapshots = (num_snapshots or default_num_snapshots(max_batch)) if prefix_caching else 0
    weights = weight_bytes_per_rank(cfg, tp, ep)
    max_context = max_context or cfg.max_position_embeddings
    budget = int(gpu_bytes * (1 - activation_reserve)) - weights.total
    one = plan_memory(cfg, tp, ep, None, 1, 1 << 20, block_size, act_dtype)
    one_tp1 = plan_memory(cfg, 1, 1, None, 1, 1 << 20, block_size, act_dtype)
    ctx = plan_memory(cfg, tp, ep, None, 1, max_context, block_size, act_dtype)
    memory, err = None, None
    try:
        memory = plan_memory(cfg, tp, ep, budget, max_batch, max_context, block_size, act_dtype, snapshots)
    except ValueError as e:
        err = f"no cache plan: {e}" if budget > 0 else f"no cache plan: the weights leave no memory ({budget / GB:.1f} GB)"
    max_b = max(0, budget // ctx.bytes_per_request) if budget > 0 else 0
    patches = 0
    if cfg.vision is not None:
        from k3deploy.model.vision import ProcessorConfig
        patches = vision_patches or ProcessorConfig().max_patches()
    return DeploymentPlan(cfg, tp, ep, gpu_bytes, weights, memory, err,
                          request_bytes_1m=one.bytes_per_request, request_bytes_1m_tp1=one_tp1.bytes_per_request, kda_bytes_per_request=one.kda_bytes_per_request,
                          latent_bytes_per_token=one.latent_bytes_per_token, max_batch_at_context=int(max_b),
                          smallest=None if weights.total < gpu_bytes else smallest_fit(cfg, gpu_bytes),
                          max_context=max_context, act_dtype=act_dtype, vision_patches=patches,
                          num_snapshots=snapshots)
