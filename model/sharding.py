"""Tensor / expert-parallel weight sharding (MODEL.md §10), driven by the `split` of model/weights.py.

`col` cuts dim 0 (output rows / heads), `row` cuts dim 1 (input columns), `vocab` cuts dim 0 of the
embedding and lm_head, `rep` is replicated. Routed experts: EP mode (ep == tp) gives rank r the whole
experts r*E/ep .. (r+1)*E/ep-1; TP mode (ep == 1) gives every rank every expert with w1/w3 cut by rows and
w2 by columns (packed bytes and E8M0 scales alike, so each rank's share must be whole 32-groups).
The rank's partial outputs are summed by the RowLinear / latent all-reduce of model/layers.py.
"""
from __future__ import annotations

import torch

from k3deploy.model.config import K3Config
from k3deploy.model.weights import PREFIX, layer_tensors, model_tensors


def check_parallel(cfg: K3Config, tp: int, ep: int) -> None:
    """Raise ValueError naming the setting when tp/ep cannot shard cfg."""
    if tp < 1 or ep < 1:
        raise ValueError(f"tp = {tp}, ep = {ep}: both must be >= 1")
    if ep not in (1, tp):
        raise ValueError(f"ep = {ep}: must be 1 (experts tensor-parallel) or equal to tp = {tp} (one expert group per rank)")
    for what, n in (("KDA heads (linear_attn_config.num_heads)", cfg.kda_num_heads),
                    ("MLA heads (num_attention_heads)", cfg.num_attention_heads),
                    ("vocab_size", cfg.vocab_size), ("intermediate_size", cfg.intermediate_size),
                    ("shared expert width", max(cfg.shared_intermediate_size, tp))):
        if n % tp:
            raise ValueError(f"tp = {tp} does not divide the {what} = {n}; pick a tp that divides it")
    if cfg.num_experts % ep:
        raise ValueError(f"ep = {ep} does not divide num_experts = {cfg.num_experts}; pick an ep that divides it")
    if ep == 1 and tp > 1:
        I = cfg.moe_intermediate_size
        if I % tp or (cfg.experts_mxfp4 and (I // tp) % 32):
            raise ValueError(f"tp = {tp}: moe_intermediate_size {I} / tp must be a multiple of 32 for MXFP4 experts "
                             "in TP mode; use ep = tp instead")


def _cut(t: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim=dim)[rank].contiguous() if n > 1 else t


def shard_layer(cfg: K3Config, l: int, w: dict[str, torch.Tensor], rank: int, tp: int, ep: int = 1) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of decoder layer l's weights (names relative to the layer prefix)."""
    check_parallel(cfg, tp, ep)
    if tp == 1:
        return w
    prefix = f"{PREFIX}model.layers.{l}."
    split = {s.name[len(prefix):]: s.split for s in layer_tensors(cfg, l)}
    per = cfg.num_experts // ep
    out = {}
    for name, t in w.items():
        kind = split.get(name, "rep")
        if kind == "col":
            out[name] = _cut(t, 0, rank, tp)
        elif kind == "row":
            out[name] = _cut(t, 1, rank, tp)
        elif kind == "expert":
            e = int(name.split("experts.")[1].split(".")[0])
            if ep > 1:
                if rank * per <= e < (rank + 1) * per:
                    out[name] = t
            else:
                out[name] = _cut(t, 1 if ".w2." in name else 0, rank, tp)
        else:
            out[name] = t
    return out


def shard_model(cfg: K3Config, w: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank's share of the model-level tensors: embedding and lm_head by vocab rows, the rest replicated."""
    vocab = {s.name.rsplit(".", 2)[-2] + ".weight" for s in model_tensors(cfg) if s.split == "vocab"}
    return {name: _cut(t, 0, rank, tp) if name in vocab else t for name, t in w.items()}
