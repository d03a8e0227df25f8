"""Deterministic synthetic Kimi K3 weights for any config (MODEL.md §1.4: random weights, experts per §8.3).

Every tensor is drawn from its own torch.Generator seeded from sha256(seed, tensor name), so the result does
not depend on generation order and a single tensor or layer can be regenerated alone. Scales keep a bf16
forward finite and non-degenerate:

* linear weights `[out, in]` ~ N(0, 1/in) (std in^-0.5), embedding ~ N(0, 1);
* RMSNorm weights ~ 1 + 0.02 N(0, 1) (KDA o_norm likewise, f32);
* AttnRes pseudo-queries `*_res_proj [1, d]` ~ N(0, 1/d) -> O(1) scores, a non-uniform softmax;
* KDA: conv weights ~ N(0, 0.5^2) (f32), A_log[:H] = log(U(1, 16)) with zero padding to the stored length
  (max(H, head_dim), like the release, Q1), dt_bias ~ 0.1 N(0, 1);
* router e_score_correction_bias ~ 0.01 N(0, 1) (f32);
* routed experts: logical weights ~ N(0, 1/in), packed with `pack_mxfp4` when the config says MXFP4;
* vision tower (VISION.md §7.1, with a vision_config): the patch embedding `[D, 3, p, p]` ~ N(0, 1/(3p²)), the
  learned position table ~ N(0, 0.5²) (so its resampling shows in the output), the tower's norm0/norm1 like the
  other norms; a synthetic checkpoint with a vision tower also gets the preset's preprocessor_config.json.

CLI: `python -m k3deploy.model.synthetic --preset k3-tiny --out DIR [--seed S] [--force]` streams one shard (layer)
at a time through `model.checkpoint.CheckpointWriter`, so k3-slice (~17 GB on disk) never sits in memory.

Every checkpoint also ships the tokenizer files (`tiktoken.model` + `tokenizer_config.json`, model/vocab.py): the
vocabulary's last 256 ids are K3's special tokens at K3's offsets, so the preset's bos/eos/pad/media ids name them.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import math
import shutil
import sys
from pathlib import Path

import torch

from k3deploy.model.checkpoint import CheckpointWriter
from k3deploy.model.config import PRESETS, ConfigError, K3Config, load_config
from k3deploy.model.vocab import NUM_SPECIAL, write_tokenizer_files
from k3deploy.model.weights import PREFIX, TensorSpec, a_log_stored_size, all_tensors, layer_tensors, model_tensors, vision_tensors
from k3deploy.plugins.moe.mxfp4 import pack_mxfp4

log = logging.getLogger(__name__)

TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8, "F16": torch.float16}
_CHUNK = 1 << 24  # elements drawn per randn call for big tensors (bounds the float32 scratch to 64 MB)


def tensor_generator(seed: int, name: str, device: "str | torch.device" = "cpu") -> torch.Generator:
    """A generator on `device` seeded from sha256(f"{seed}:{name}") (independent of order). CPU and CUDA
    generators are different algorithms: the same seed gives different values on each (see SyntheticSource)."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)
    return torch.Generator(device=device).manual_seed(h)


def _normal(shape: tuple[int, ...], std: float, mean: float, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """mean + std * N(0,1) of `shape` in `dtype` on g's device, drawn in row chunks (deterministic for a given
    shape and generator device)."""
    out = torch.empty(shape, dtype=dtype, device=g.device)
    flat = out.view(-1)
    for i in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - i)
        flat[i:i + n] = torch.randn(n, generator=g, device=g.device).mul_(std).add_(mean).to(dtype)
    return out


def _expert_base(name: str) -> str | None:
    for suf in (".weight_packed", ".weight_scale"):
        if name.endswith(suf) and ".experts." in name:
            return name[: -len(suf)]
    return None


class SyntheticSource:
    """Produces synthetic tensors by name for one config and seed (see module docstring for the recipe).

    `get(name)` returns the tensor in its stored dtype/shape. An MXFP4 expert's packed and scale tensors come
    from the same logical draw (seeded by the name without the suffix); the last pair is cached so a writer
    asking for `weight_packed` then `weight_scale` draws and packs once.

    `device` (default "cpu") is where the tensors are drawn and returned: "cuda" builds big models in seconds
    without a checkpoint on disk (benchmarks/bench_decode.py). The recipe is the same, but a CUDA generator is a
    different random stream from the CPU one, so the values differ from the CPU (= on-disk) checkpoint of the
    same seed; they are deterministic for a given (seed, name, device type).
    """

    def __init__(self, cfg: K3Config, seed: int = 0, device: "str | torch.device" = "cpu"):
        self.cfg, self.seed, self.device = cfg, seed, torch.device(device)
        self.specs: dict[str, TensorSpec] = {s.name: s for s in all_tensors(cfg) + vision_tensors(cfg)}
        self._pair: tuple[str, dict[str, torch.Tensor]] | None = None

    def get(self, name: str) -> torch.Tensor:
        s = self.specs[name]
        base = _expert_base(name)
        if base is not None:
            if self._pair is None or self._pair[0] != base:
                o, i = s.logical if s.logical else (s.shape[0], s.shape[1] * 32)
                w = _normal((o, i), i ** -0.5, 0.0, torch.float32, tensor_generator(self.seed, base, self.device))
                packed, scale = pack_mxfp4(w)
                self._pair = (base, {".weight_packed": packed, ".weight_scale": scale})
            return self._pair[1][name[len(base):]]
        return self._dense(s)

    def _dense(self, s: TensorSpec) -> torch.Tensor:
        g = tensor_generator(self.seed, s.name, self.device)
        dt = TORCH_DTYPES[s.dtype]
        n = s.name
        if n.endswith(".A_log"):
            H = self.cfg.kda_num_heads
            out = torch.zeros(s.shape, dtype=dt, device=self.device)
            out[:H] = torch.log(torch.empty(H, device=self.device).uniform_(1.0, 16.0, generator=g)).to(dt)
            return out
        if n.endswith(("norm.weight", "layernorm.weight", ".norm0.weight", ".norm1.weight")):
            return _normal(s.shape, 0.02, 1.0, dt, g)
        if n.endswith("patch_embed.proj.weight"):
            return _normal(s.shape, (s.shape[1] * s.shape[2] * s.shape[3]) ** -0.5, 0.0, dt, g)
        if n.endswith("patch_embed.pos_emb.weight"):
            return _normal(s.shape, 0.5, 0.0, dt, g)
        if "_conv1d." in n:
            return _normal(s.shape, 0.5, 0.0, dt, g)
        if n.endswith(".dt_bias"):
            return _normal(s.shape, 0.1, 0.0, dt, g)
        if n.endswith(".e_score_correction_bias"):
            return _normal(s.shape, 0.01, 0.0, dt, g)
        if n.endswith("embed_tokens.weight"):
            return _normal(s.shape, 1.0, 0.0, dt, g)
        if len(s.shape) == 2:  # every other 2-D tensor is a linear weight [out, in] (incl. *_res_proj [1, d])
            return _normal(s.shape, s.shape[1] ** -0.5, 0.0, dt, g)
        raise ValueError(f"{n}: no synthetic recipe for a {s.dtype} tensor of shape {s.shape}")


def synthetic_tensors(cfg: K3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """All tensors of `cfg` (text, and the vision tower with a vision_config; full names -> stored dtype/shape),
    deterministic in (seed, name).

    Holds everything in memory: meant for small configs (k3-tiny). For big ones use `write_synthetic`.
    """
    src = SyntheticSource(cfg, seed)
    return {name: src.get(name) for name in sorted(src.specs)}


def synthetic_layer(cfg: K3Config, l: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of decoder layer `l` only (same values as in `synthetic_tensors`)."""
    src = SyntheticSource(cfg, seed)
    return {s.name: src.get(s.name) for s in sorted(layer_tensors(cfg, l), key=lambda s: s.name)}


def synthetic_model_weights(cfg: K3Config, seed: int = 0, device: "str | torch.device" = "cpu") -> dict[str, torch.Tensor]:
    """The model-level tensors keyed as `Checkpoint.model_weights` keys them ("embed_tokens.weight", "norm.weight",
    "output_attn_res_norm.weight", "output_attn_res_proj.weight", "lm_head.weight"), drawn on `device`."""
    src = SyntheticSource(cfg, seed, device)
    out = {}
    for s in model_tensors(cfg):
        rel = s.name[len(PREFIX):]
        out[rel[len("model."):] if rel.startswith("model.") else rel] = src.get(s.name)
    return out


def synthetic_vision_weights(cfg: K3Config, seed: int = 0, device: "str | torch.device" = "cpu") -> dict[str, torch.Tensor]:
    """The vision tower + projector tensors under their released names, as `Checkpoint.vision_weights` returns
    them, drawn on `device` ({} without a vision_config)."""
    src = SyntheticSource(cfg, seed, device)
    return {s.name: src.get(s.name) for s in vision_tensors(cfg)}


def synthetic_layer_weights(cfg: K3Config, l: int, seed: int = 0, device: "str | torch.device" = "cpu",
                            experts: "range | None" = None) -> dict[str, torch.Tensor]:
    """Decoder layer `l` keyed as `Checkpoint.layer_weights` keys it (relative to the layer prefix; KDA A_log
    narrowed to num_heads), drawn on `device` (same values as `synthetic_layer` when device is the CPU).
    `experts`: draw only these routed experts (an EP rank's range; None = all)."""
    src = SyntheticSource(cfg, seed, device)
    prefix = f"{PREFIX}model.layers.{l}."
    out = {}
    for s in sorted(layer_tensors(cfg, l), key=lambda s: s.name):
        if experts is not None and s.expert is not None and s.expert not in experts:
            continue
        out[s.name[len(prefix):]] = src.get(s.name)
    if "self_attn.A_log" in out:
        out["self_attn.A_log"] = out["self_attn.A_log"][: cfg.kda_num_heads]
    return out


def write_synthetic(cfg: K3Config, out: "str | Path", seed: int = 0, overwrite: bool = False,
                    progress: bool = False, device: "str | torch.device" = "cpu") -> Path:
    """Generate and write a synthetic checkpoint shard by shard (one layer in memory at most one tensor at
    a time) plus its tokenizer files (module docstring; none for a vocabulary under 512 ids). Atomic (see
    CheckpointWriter). device: where the tensors are drawn and packed (a CUDA device is much faster for the MXFP4
    experts; its draws differ from the CPU's, so the same seed gives another checkpoint). FileExistsError if `out`
    is non-empty and overwrite is False."""
    src = SyntheticSource(cfg, seed, device)
    pre = None
    if cfg.vision is not None:
        from k3deploy.model.vision import preset_processor
        pre = preset_processor(cfg).to_json()
    with CheckpointWriter(out, cfg, overwrite=overwrite, preprocessor=pre) as w:
        if cfg.vocab_size >= 256 + NUM_SPECIAL:
            write_tokenizer_files(w.tmp, cfg.vocab_size, cfg.max_position_embeddings)
        else:
            log.warning("vocab_size %d < %d: no tokenizer files written", cfg.vocab_size, 256 + NUM_SPECIAL)
        plan = w.plan()
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=sum(s.nbytes for _, specs in plan for s in specs), unit="B", unit_scale=True,
                       desc=f"synthetic {cfg.name}")

        def get(name: str) -> torch.Tensor:
            t = src.get(name).cpu()
            if bar is not None:
                bar.update(src.specs[name].nbytes)
            return t

        for i, specs in plan:
            w.write_shard(i, specs, get)
        if bar is not None:
            bar.close()
    return Path(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog or "python -m k3deploy.model.synthetic",
                                 description="Write a deterministic synthetic Kimi K3 checkpoint (MODEL.md §8 layout).")
    ap.add_argument("--preset", required=True, help=f"config preset ({', '.join(PRESETS)}) or a config.json / checkpoint dir")
    ap.add_argument("--out", required=True, type=Path, help="output directory (must be empty or absent unless --force)")
    ap.add_argument("--seed", type=int, default=0, help="seed (default 0); each tensor is seeded from (seed, name)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    ap.add_argument("--device", default="cpu",
                    help="draw and pack the tensors here (default cpu; cuda is faster, with other draws than cpu)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = load_config(a.preset)
    except (FileNotFoundError, ConfigError) as e:
        print(f"error: --preset {e}", file=sys.stderr)
        return 2
    if a.out.exists() and (not a.out.is_dir() or any(a.out.iterdir())) and not a.force:
        print(f"error: {a.out} is not empty; use --force to replace it", file=sys.stderr)
        return 2
    total = sum(s.nbytes for s in all_tensors(cfg) + vision_tensors(cfg))
    # CheckpointWriter writes into a temporary sibling of --out, then renames: the space counted is its parent's
    parent = next(p for p in a.out.resolve().parents if p.exists())
    free = shutil.disk_usage(parent).free
    if free < total:
        print(f"error: {cfg.name} needs {total / 2**30:.2f} GiB but {parent} has {free / 2**30:.2f} GiB free; "
              "choose another --out or a smaller preset (k3-tiny, k3-slice)", file=sys.stderr)
        return 2
    print(f"writing {cfg.name} (seed {a.seed}, {total / 2**30:.2f} GiB, {cfg.num_hidden_layers + 1} shards) to {a.out}")
    write_synthetic(cfg, a.out, seed=a.seed, overwrite=a.force, progress=True, device=a.device)
    print(f"done: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
