"""Parameter and byte accounting from the tensor inventory, with no tensor memory (MODEL.md §11).

Counts come from `model.weights` TensorSpecs (shapes only). Conventions of §11: MXFP4 experts count their
logical weight (scales count 0 params but their bytes); A_log counts as stored (128 for K3); "active per
token" = every non-routed text parameter + top-k routed experts in each MoE layer, including lm_head but
excluding the input embedding table (the "104B"), also reported with the embedding (Q8). With a vision_config the
vision tower and projector are counted apart (VISION.md §9: 401,214,464 + 46,144,512 = 447,358,976 for K3, all BF16).

CLI: `python -m k3deploy.model.params PRESET|DIR` prints one `name: value` line per count.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from k3deploy.model.config import K3Config, load_config
from k3deploy.model.weights import PREFIX, TensorSpec, all_tensors, vision_tensors

EMBED = PREFIX + "model.embed_tokens.weight"
LM_HEAD = PREFIX + "lm_head.weight"


def param_report(cfg: K3Config, specs: list[TensorSpec] | None = None) -> dict[str, int]:
    """Counts for `cfg` (ordered dict of name -> int). `specs` defaults to `all_tensors(cfg)`.

    Keys: total_params, routed_expert_params, non_expert_params, embedding_params, lm_head_params,
    moe_layers, params_per_expert (one expert of one MoE layer), active_routed_params, active_params
    (lm_head in, embedding out), active_params_with_embedding, checkpoint_bytes (text tensors as stored),
    routed_expert_bytes, non_expert_bytes; with a vision_config also vision_tower_params, projector_params,
    vision_params, vision_bytes, total_params_with_vision and checkpoint_bytes_with_vision (VISION.md §9).
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
    vis = vision_tensors(cfg)
    if vis:
        tower = sum(s.params for s in vis if s.name.startswith("vision_tower."))
        vparams, vbytes = sum(s.params for s in vis), sum(s.nbytes for s in vis)
        out.update({"vision_tower_params": tower, "projector_params": vparams - tower, "vision_params": vparams,
                    "vision_bytes": vbytes, "total_params_with_vision": total + vparams,
                    "checkpoint_bytes_with_vision": nbytes + vbytes})
    return out


def meta_weights(cfg: K3Config):
    """(model-level weights, layer l -> weights) as meta-device tensors in the checkpoint's shapes and dtypes,
    A_log trimmed to num_heads as the loader does (§8.4): a K3Model built from them allocates no memory."""
    import torch
    dt = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}

    def t(spec: TensorSpec):
        shape = (cfg.kda_num_heads,) if spec.name.endswith("A_log") else spec.shape
        return torch.empty(shape, dtype=dt[spec.dtype], device="meta")

    from k3deploy.model.weights import layer_tensors, model_tensors
    model_w = {s.name.rsplit(".", 2)[-2] + ".weight" if "lm_head" in s.name or "embed_tokens" in s.name
               else s.name[len(PREFIX + "model."):]: t(s) for s in model_tensors(cfg)}

    def layer_w(l: int):
        pre = f"{PREFIX}model.layers.{l}."
        return {s.name[len(pre):]: t(s) for s in layer_tensors(cfg, l)}
    return model_w, layer_w


def module_params(cfg: K3Config) -> int:
    """Parameters held by the reference model (model.reference.K3Model) built on the meta device (no memory):
    every distinct tensor the modules keep (views such as MLA's W_UK/W_UV count once), MXFP4 codes as 2 logical
    weights per byte, scales as 0. Equals `param_report(cfg)["total_params"]` minus the A_log padding the
    loader trims (69 x 32 for K3), which is what the release's count includes (§11)."""
    import torch

    from k3deploy.model.reference import K3Model
    from k3deploy.plugins.common import compute_dtype
    model_w, layer_w = meta_weights(cfg)
    with compute_dtype(torch.float32):
        model = K3Model(cfg, model_w, layer_w)
    seen: dict[int, int] = {}
    keep: list = []   # holds every base tensor so no id() is reused while counting

    def count(key, t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        keep.append(base)
        if id(base) not in seen:
            seen[id(base)] = (2 * t.numel() if "packed" in str(key) else 0) if t.dtype == torch.uint8 else base.numel()

    def visit(obj, depth=0):
        if depth > 8 or isinstance(obj, (int, float, str, bool, type(None), type)):
            return
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) \
            else vars(obj).items() if hasattr(obj, "__dict__") else ()
        for k, v in items:
            if isinstance(v, torch.Tensor):
                count(k, v)
            else:
                visit(v, depth + 1)
    visit(model)
    return sum(seen.values())


def report_for(source: str) -> dict[str, int]:
    """Report for a preset name or a checkpoint directory. For a directory holding an index, the expert
    format is taken from the files (Q13) and two measured values are added: `file_data_bytes` (sum of all
    tensor data in the shard headers) and `index_total_size` (the index's metadata.total_size)."""
    p = Path(source)
    if (p / "model.safetensors.index.json").is_file():
        from k3deploy.model.checkpoint import Checkpoint
        ck = Checkpoint(p)
        out = param_report(ck.config)
        out["file_data_bytes"] = ck.data_bytes()
        if ck.total_size is not None:
            out["index_total_size"] = int(ck.total_size)
        return out
    return param_report(load_config(source))


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prog = prog or "python -m k3deploy.model.params"
    modules = "--modules" in argv
    argv = [a for a in argv if a != "--modules"]
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(f"usage: {prog} PRESET|DIR [--modules]\n"
              "Print parameter and byte counts (MODEL.md §11) of a preset (k3, k3-tiny, k3-slice), a config.json\n"
              "or a checkpoint directory, one 'name: value' line each. --modules also builds the reference model on\n"
              "the meta device (no memory; ~30 s for K3) and prints the parameters its modules hold.")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        rep = report_for(argv[0])
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for k, v in rep.items():
        print(f"{k}: {v}")
    if modules:
        cfg = load_config(argv[0])
        m = module_params(cfg)
        print(f"reference_module_params: {m}")
        print(f"a_log_padding_params: {rep['total_params'] - m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
