"""The checkpoint's tensor inventory, derived from a K3Config (MODEL.md §4.1, §5.1, §6.1, §7, §8.2, §8.3; the vision
tower and projector: VISION.md §7.1, `vision_tensors`).

Every consumer (checkpoint validation, synthetic writer, parameter report, sharding, export) reads this one
declaration instead of hard-coding names. `split` tells how tensor parallelism cuts the tensor (§10):
`col` (dim 0), `row` (dim 1), `rep` (replicated), `vocab` (dim 0 of embedding / lm_head), `expert`
(one routed expert's tensor; EP assigns whole experts, TP cuts w1/w3 by rows and w2 by columns).
"""
from __future__ import annotations

import dataclasses

from k3deploy.model.config import K3Config

PREFIX = "language_model."
BYTES = {"BF16": 2, "F32": 4, "U8": 1, "F16": 2}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor. `shape` is the stored shape; `logical` the dequantized weight shape for MXFP4."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    split: str
    layer: int | None = None
    expert: int | None = None
    logical: tuple[int, ...] | None = None  # set for MXFP4 weight_packed tensors (the [out, in] weight)

    @property
    def nbytes(self) -> int:
        n = BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n

    @property
    def params(self) -> int:
        """Parameters this tensor represents (MXFP4: the logical weight; scales count 0)."""
        if self.name.endswith(".weight_scale"):
            return 0
        shape = self.logical or self.shape
        n = 1
        for s in shape:
            n *= s
        return n


def a_log_stored_size(cfg: K3Config) -> int:
    """A_log is stored padded to max(num_heads, head_dim) entries in the release (§4.1, Q1)."""
    return max(cfg.kda_num_heads, cfg.kda_head_dim)


def layer_tensors(cfg: K3Config, l: int) -> list[TensorSpec]:
    """Checkpoint tensors of decoder layer `l` (0-indexed)."""
    p = f"{PREFIX}model.layers.{l}."
    d, H = cfg.hidden_size, cfg.kda_num_heads
    out: list[TensorSpec] = []

    def add(name, shape, dtype="BF16", split="rep", **kw):
        out.append(TensorSpec(p + name, tuple(shape), dtype, split, l, **kw))

    for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
        add(f"{n}.weight", [d])
    add("self_attention_res_proj.weight", [1, d])
    add("mlp_res_proj.weight", [1, d])
    a = "self_attn."
    if cfg.layer_kind(l) == "kda":
        P, K = cfg.kda_proj_size, cfg.kda_head_dim
        for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
            add(f"{a}{n}.weight", [P, d], split="col")
        for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
            add(f"{a}{n}.weight", [P, 1, cfg.conv_kernel_size], "F32", "col")
        add(f"{a}f_a_proj.weight", [K, d])
        add(f"{a}f_b_proj.weight", [P, K], split="col")
        add(f"{a}A_log", [a_log_stored_size(cfg)], "F32", "col")
        add(f"{a}dt_bias", [P], "F32", "col")
        add(f"{a}b_proj.weight", [H, d], split="col")
        add(f"{a}o_norm.weight", [K], "F32")
        add(f"{a}o_proj.weight", [d, P], split="row")
    else:
        Hm = cfg.num_attention_heads
        add(f"{a}q_a_proj.weight", [cfg.q_lora_rank, d])
        add(f"{a}q_a_layernorm.weight", [cfg.q_lora_rank])
        add(f"{a}q_b_proj.weight", [Hm * cfg.q_head_dim, cfg.q_lora_rank], split="col")
        add(f"{a}kv_a_proj_with_mqa.weight", [cfg.latent_dim, d])
        add(f"{a}kv_a_layernorm.weight", [cfg.kv_lora_rank])
        add(f"{a}kv_b_proj.weight", [Hm * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank], split="col")
        add(f"{a}g_proj.weight", [Hm * cfg.v_head_dim, d], split="col")
        add(f"{a}o_proj.weight", [d, Hm * cfg.v_head_dim], split="row")
    if not cfg.is_moe(l):
        I = cfg.intermediate_size
        add("mlp.gate_proj.weight", [I, d], split="col")
        add("mlp.up_proj.weight", [I, d], split="col")
        add("mlp.down_proj.weight", [d, I], split="row")
        return out
    m = "block_sparse_moe."
    E, R, I, S = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    add(f"{m}gate.weight", [E, d])
    add(f"{m}gate.e_score_correction_bias", [E], "F32")
    add(f"{m}routed_expert_down_proj.weight", [R, d])
    if cfg.latent_moe_use_norm:
        add(f"{m}routed_expert_norm.weight", [R])
    add(f"{m}routed_expert_up_proj.weight", [d, R])
    if S:
        add(f"{m}shared_experts.gate_proj.weight", [S, d], split="col")
        add(f"{m}shared_experts.up_proj.weight", [S, d], split="col")
        add(f"{m}shared_experts.down_proj.weight", [d, S], split="row")
    for e in range(E):
        for w, (o, i) in (("w1", (I, R)), ("w2", (R, I)), ("w3", (I, R))):
            base = f"{m}experts.{e}.{w}."
            if cfg.experts_mxfp4:
                add(base + "weight_packed", [o, i // 2], "U8", "expert", expert=e, logical=(o, i))
                add(base + "weight_scale", [o, i // 32], "U8", "expert", expert=e)
            else:
                add(base + "weight", [o, i], split="expert", expert=e)
    return out


def model_tensors(cfg: K3Config) -> list[TensorSpec]:
    """Non-layer text tensors: embedding, final norm, output AttnRes, lm_head (§8.2)."""
    d, V = cfg.hidden_size, cfg.vocab_size
    return [
        TensorSpec(PREFIX + "model.embed_tokens.weight", (V, d), "BF16", "vocab"),
        TensorSpec(PREFIX + "model.norm.weight", (d,), "BF16", "rep"),
        TensorSpec(PREFIX + "model.output_attn_res_norm.weight", (d,), "BF16", "rep"),
        TensorSpec(PREFIX + "model.output_attn_res_proj.weight", (1, d), "BF16", "rep"),
        TensorSpec(PREFIX + "lm_head.weight", (V, d), "BF16", "vocab"),
    ]


VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def vision_tensors(cfg: K3Config) -> list[TensorSpec]:
    """The vision tower + projector tensors under their released names (VISION.md §7.1): all BF16, never quantized,
    replicated on every rank (§9); [] for a config without a vision tower. 2 + 6 x layers + 1 + 3 tensors."""
    v = cfg.vision
    if v is None:
        return []
    D, Q, I, p = v.hidden_size, v.qkv_hidden_size, v.intermediate_size, v.patch_size
    t = "vision_tower."
    out = [TensorSpec(t + "patch_embed.proj.weight", (D, 3, p, p), "BF16", "rep"),
           TensorSpec(t + "patch_embed.pos_emb.weight", (v.pos_emb_height, v.pos_emb_width, D), "BF16", "rep")]
    for l in range(v.num_layers):
        b = f"{t}encoder.blocks.{l}."
        out += [TensorSpec(b + "norm0.weight", (D,), "BF16", "rep"), TensorSpec(b + "norm1.weight", (D,), "BF16", "rep"),
                TensorSpec(b + "wqkv.weight", (3 * Q, D), "BF16", "rep"), TensorSpec(b + "wo.weight", (D, Q), "BF16", "rep"),
                TensorSpec(b + "mlp.fc0.weight", (I, D), "BF16", "rep"), TensorSpec(b + "mlp.fc1.weight", (D, I), "BF16", "rep")]
    out.append(TensorSpec(t + "encoder.final_layernorm.weight", (D,), "BF16", "rep"))
    M, T = v.merged_size, v.text_hidden_size
    out += [TensorSpec("mm_projector.proj.0.weight", (M, M), "BF16", "rep"),
            TensorSpec("mm_projector.proj.2.weight", (T, M), "BF16", "rep"),
            TensorSpec("mm_projector.post_norm.weight", (T,), "BF16", "rep")]
    return out


def all_tensors(cfg: K3Config) -> list[TensorSpec]:
    """Every text-model tensor of the checkpoint, model-level first, then layers in order."""
    out = model_tensors(cfg)
    for l in range(cfg.num_hidden_layers):
        out.extend(layer_tensors(cfg, l))
    return out
