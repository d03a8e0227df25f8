"""Parameter and byte accounting from the tensor inventory, with no tensor memory (MODEL.md §11).

Counts come from `model.weights` TensorSpecs (shapes only). Conventions of §11: MXFP4 experts count their
logical weight (scales count 0 params but their bytes); A_log counts as stored (128 for K3); "active per
token" = every non-routed text parameter + top-k routed experts in each MoE layer, including lm_head but
excluding the input embedding table (the "104B"), also reported with the embedding (Q8).

CLI: `python -m model.params PRESET|DIR` prints one `name: value` line per count.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from model.config import K3Config, load_config
from model.weights import PREFIX, TensorSpec, all_tensors

# Vision tower + projector bytes of the release (§11); they are not part of the text inventory.
K3_VISION_BYTES = 894_717_952
EMBED = PREFIX + "model.embed_tokens.weight"
LM_HEAD = PREFIX + "lm_head.weight"


def _has_vision(cfg: K3Config) -> bool:
    """True for the released K3 model (the only config shipped with the vision tower)."""
    return "vision_config" in cfg.source and cfg.config_hash() == load_config("k3").config_hash()


def param_report(cfg: K3Config, specs: list[TensorSpec] | None = None) -> dict[str, int]:
    """Counts for `cfg` (ordered dict of name -> int). `specs` defaults to `all_tensors(cfg)`.

    Keys: total_params, routed_expert_params, non_expert_params, embedding_params, lm_head_params,
    moe_layers, params_per_expert (one expert of one MoE layer), active_routed_params, active_params
    (lm_head in, embedding out), active_params_with_embedding, checkpoint_bytes (text tensors as stored),
    routed_expert_bytes, non_expert_bytes, and for K3 vision_bytes and checkpoint_bytes_with_vision.
    """
    specs = all_tensors(cfg) if specs is None else specs
    routed = [s for s in specs if s.expert is not None]
    total = sum(s.params for s in specs)
    routed_params = sum(s.params for s in routed)
    moe_layers = [l for l in range(cfg.num_hidden_layers) if cfg.is_moe(l)]
    per_expert: dict[int, int] = {}
    for s in routed:
        if s.expert == 0:
            per_expert[s.layer] = per_expert.get(s.layer, 0) + s.params
    active_routed = sum(cfg.num_experts_per_token * per_expert.get(l, 0) for l in moe_layers)
    embed = sum(s.params for s in specs if s.name == EMBED)
    lm_head = sum(s.params for s in specs if s.name == LM_HEAD)
    active = total - routed_params + active_routed - embed
    nbytes = sum(s.nbytes for s in specs)
    routed_bytes = sum(s.nbytes for s in routed)
    out = {
        "total_params": total,
        "routed_expert_params": routed_params,
        "non_expert_params": total - routed_params,
        "embedding_params": embed,
        "lm_head_params": lm_head,
        "moe_layers": len(moe_layers),
        "params_per_expert": per_expert.get(moe_layers[0], 0) if moe_layers else 0,
        "active_routed_params": active_routed,
        "active_params": active,
        "active_params_with_embedding": active + embed,
        "checkpoint_bytes": nbytes,
        "routed_expert_bytes": routed_bytes,
        "non_expert_bytes": nbytes - routed_bytes,
    }
    if _has_vision(cfg):
        out["vision_bytes"] = K3_VISION_BYTES
        out["checkpoint_bytes_with_vision"] = nbytes + K3_VISION_BYTES
    return out


def report_for(source: str) -> dict[str, int]:
    """Report for a preset name or a checkpoint directory. For a directory holding an index, the expert
    format is taken from the files (Q13) and two measured values are added: `file_data_bytes` (sum of all
    tensor data in the shard headers) and `index_total_size` (the index's metadata.total_size)."""
    p = Path(source)
    if (p / "model.safetensors.index.json").is_file():
        from model.checkpoint import Checkpoint
        ck = Checkpoint(p)
        out = param_report(ck.config)
        out["file_data_bytes"] = ck.data_bytes()
        if ck.total_size is not None:
            out["index_total_size"] = int(ck.total_size)
        return out
    return param_report(load_config(source))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m model.params PRESET|DIR\n"
              "Print parameter and byte counts (MODEL.md §11) of a preset (k3, k3-tiny, k3-slice), a config.json\n"
              "or a checkpoint directory, one 'name: value' line each.")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    for k, v in report_for(argv[0]).items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
