"""Typed Kimi K3 text configuration (MODEL.md §1).

`load_config(source)` accepts a preset name (`k3`, `k3-tiny`, `k3-slice`), a checkpoint directory holding
`config.json`, a path to a `config.json`, or an already-parsed dict (either the multimodal wrapper with
`text_config` or a bare text config). Every validation error is a `ConfigError` (a `ValueError`) naming the
key, the bad value and the rule.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

K3_CONFIG_PATH = Path(__file__).with_name("k3_config.json")


class ConfigError(ValueError):
    """A config key has a value the model cannot run with; the message names key, value and rule."""


@dataclasses.dataclass(frozen=True)
class K3Config:
    """Kimi K3 text-model configuration. Layer indices are 0-indexed (config.json lists are 1-indexed, §1.3)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    gate_lower_bound: float
    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    first_k_dense_replace: int
    intermediate_size: int
    situ_beta: float
    situ_linear_beta: float | None
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    latent_moe_use_norm: bool
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    attn_res_block_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    experts_mxfp4: bool
    name: str = dataclasses.field(default="custom", compare=False)
    lora_norm_eps: float = 1e-6  # MLA q_a/kv_a norms (§2.1, Q4)
    source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def kda_proj_size(self) -> int:
        """P = KDA heads x head_dim (12288 for K3)."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one MLA latent cache row: kv_lora_rank + qk_rope_head_dim (576 for K3, §5.3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_scale(self) -> float:
        return self.q_head_dim ** -0.5

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def num_bank_rows(self) -> int:
        """Rows the AttnRes bank reaches: ceil(num_layers / block) (8 for K3, §1.2)."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    def layer_kind(self, layer: int) -> str:
        """'kda' or 'mla' for 0-indexed `layer`."""
        return "kda" if layer in self._kda_set else "mla"

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def is_commit(self, layer: int) -> bool:
        """True where the AttnRes bank gets a new row before attention (§6.3)."""
        return layer % self.attn_res_block_size == 0

    def bank_rows_before(self, layer: int) -> int:
        """Committed bank rows when `layer` starts (0 at layer 0)."""
        return math.ceil(layer / self.attn_res_block_size)

    def bank_rows_after(self, layer: int) -> int:
        return self.bank_rows_before(layer) + (1 if self.is_commit(layer) else 0)

    @property
    def _kda_set(self) -> frozenset:
        return frozenset(self.kda_layers)

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of every field that shapes the math (first 16 hex digits)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("source", "name")}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        """The released config.json layout (multimodal wrapper) that reproduces this config."""
        return copy.deepcopy(self.source)


# ---- presets ----------------------------------------------------------------------------------

K3_TINY_JSON: dict = {
    "model_type": "kimi_k3", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "text_config": {
        "model_type": "kimi_linear", "vocab_size": 1024, "hidden_size": 256,
        "num_hidden_layers": 9, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 64, "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8, 9]},
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "intermediate_size": 512,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 2,
        "moe_intermediate_size": 64, "routed_expert_hidden_size": 128, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_expert_group": 4, "topk_group": 2, "moe_renormalize": True, "routed_scaling_factor": 2.5,
        "attn_res_block_size": 4, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "dtype": "bfloat16",
        "quantization_config": None,
    },
}


def _k3_json() -> dict:
    return json.loads(K3_CONFIG_PATH.read_text())


def _k3_slice_json() -> dict:
    """MODEL.md §1.4B: K3 with 5 layers (3 KDA + 2 MLA), AttnRes block 2, 64 experts."""
    j = _k3_json()
    tc = j["text_config"]
    tc["num_hidden_layers"] = 5
    tc["linear_attn_config"]["kda_layers"] = [1, 2, 3]
    tc["linear_attn_config"]["full_attn_layers"] = [4, 5]
    tc["attn_res_block_size"] = 2
    tc["num_experts"] = 64
    return j


def _tiny_json() -> dict:
    j = copy.deepcopy(K3_TINY_JSON)
    # k3-tiny keeps MXFP4 experts so the quantized path is exercised everywhere (64 and 128 are multiples of 32).
    j["text_config"]["quantization_config"] = copy.deepcopy(_k3_json()["text_config"]["quantization_config"])
    return j


PRESETS = {"k3": _k3_json, "k3-tiny": _tiny_json, "k3-slice": _k3_slice_json}


# ---- parsing ----------------------------------------------------------------------------------

def _get(tc: dict, key: str, kind=int, required: bool = True, default: Any = None, where: str = "text_config"):
    if key not in tc or tc[key] is None:
        if required:
            raise ConfigError(f"{where}.{key}: missing; it is required (MODEL.md §1.2)")
        return default
    v = tc[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ConfigError(f"{where}.{key} = {v!r}: must be an integer")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ConfigError(f"{where}.{key} = {v!r}: must be a number")
    if kind is bool and not isinstance(v, bool):
        raise ConfigError(f"{where}.{key} = {v!r}: must be true or false")
    return float(v) if kind is float else v


def _positive(tc: dict, key: str, where: str = "text_config") -> int:
    v = _get(tc, key, where=where)
    if v <= 0:
        raise ConfigError(f"{where}.{key} = {v}: must be > 0")
    return v


def parse_config(raw: dict, name: str = "custom") -> K3Config:
    """Parse a config.json dict (wrapper with `text_config`, or a bare text config) into a validated K3Config.

    Raises ConfigError naming the key, the value and the violated rule.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
    tc = raw.get("text_config", raw)
    if not isinstance(tc, dict):
        raise ConfigError("text_config: must be a JSON object (MODEL.md §1.1)")
    top = raw if "text_config" in raw else {}
    if top.get("model_type", "kimi_k3") != "kimi_k3":
        raise ConfigError(f"model_type = {top.get('model_type')!r}: expected 'kimi_k3' (the Kimi K3 wrapper config, "
                          "MODEL.md §1.1); this is a checkpoint of another model family")
    if tc.get("model_type", "kimi_linear") != "kimi_linear":
        raise ConfigError(f"text_config.model_type = {tc.get('model_type')!r}: expected 'kimi_linear'")
    act = tc.get("hidden_act", "situ")
    if act != "situ":
        raise ConfigError(f"text_config.hidden_act = {act!r}: unknown activation; only 'situ' (SiTU-GLU, §2.2) is supported")
    if tc.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"text_config.moe_router_activation_func = {tc.get('moe_router_activation_func')!r}: only 'sigmoid' is supported")
    if tc.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"text_config.topk_method = {tc.get('topk_method')!r}: only 'noaux_tc' is supported")
    if tc.get("mla_use_nope", True) is not True:
        raise ConfigError("text_config.mla_use_nope = false: K3 MLA has no rotary embedding; only true is supported (§5.2)")
    if tc.get("mla_use_output_gate", True) is not True:
        raise ConfigError("text_config.mla_use_output_gate = false: only gated MLA is supported (§5.2)")
    lac = tc.get("linear_attn_config")
    if not isinstance(lac, dict):
        raise ConfigError("text_config.linear_attn_config: missing; it holds the KDA settings (§1.2)")
    where_l = "text_config.linear_attn_config"
    if lac.get("use_full_rank_gate", True) is not True:
        raise ConfigError(f"{where_l}.use_full_rank_gate = false: only the full-rank output gate is supported")

    L = _positive(tc, "num_hidden_layers")
    kda1 = lac.get("kda_layers")
    mla1 = lac.get("full_attn_layers")
    for key, lst in (("kda_layers", kda1), ("full_attn_layers", mla1)):
        if not isinstance(lst, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in lst):
            raise ConfigError(f"{where_l}.{key} = {lst!r}: must be a list of 1-indexed layer numbers")
        bad = [x for x in lst if not 1 <= x <= L]
        if bad:
            raise ConfigError(f"{where_l}.{key}: entries {bad} outside 1..num_hidden_layers={L} (the lists are 1-indexed)")
        dup = sorted({x for x in lst if lst.count(x) > 1})
        if dup:
            raise ConfigError(f"{where_l}.{key}: layers {dup} are listed more than once")
    overlap = sorted(set(kda1) & set(mla1))
    if overlap:
        raise ConfigError(f"{where_l}: layers {overlap} are in both kda_layers and full_attn_layers; each layer has one kind")
    missing = sorted(set(range(1, L + 1)) - set(kda1) - set(mla1))
    if missing:
        raise ConfigError(f"{where_l}: layers {missing} are in neither kda_layers nor full_attn_layers; the lists must cover 1..{L}")

    if tc.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"text_config.moe_layer_freq = {tc.get('moe_layer_freq')!r}: only 1 (every layer after "
                          "first_k_dense_replace is MoE, §1.2) is supported")
    if tc.get("num_nextn_predict_layers", 0) not in (0, None):
        raise ConfigError(f"text_config.num_nextn_predict_layers = {tc.get('num_nextn_predict_layers')!r}: K3 ships no "
                          "MTP head; only 0 is supported")
    quant = tc.get("quantization_config")
    mxfp4 = False
    if quant:
        w = ((quant.get("config_groups") or {}).get("group_0") or {}).get("weights") or {}
        if w and (w.get("num_bits") != 4 or w.get("group_size") != 32 or w.get("type") != "float"):
            raise ConfigError("text_config.quantization_config.config_groups.group_0.weights: "
                              f"num_bits={w.get('num_bits')} group_size={w.get('group_size')} type={w.get('type')!r}; "
                              "MXFP4 needs num_bits 4, group_size 32, type float (§8.3)")
        fmt = quant.get("format")
        if quant.get("quant_method") != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
            raise ConfigError(f"text_config.quantization_config: quant_method={quant.get('quant_method')!r} format={fmt!r}; "
                              "only compressed-tensors 'mxfp4-pack-quantized' is supported (§8.3)")
        mxfp4 = True

    slb = tc.get("activation_situ_linear_beta", 25.0)
    cfg = K3Config(
        vocab_size=_positive(tc, "vocab_size"),
        hidden_size=_positive(tc, "hidden_size"),
        num_hidden_layers=L,
        num_attention_heads=_positive(tc, "num_attention_heads"),
        q_lora_rank=_positive(tc, "q_lora_rank"),
        kv_lora_rank=_positive(tc, "kv_lora_rank"),
        qk_nope_head_dim=_positive(tc, "qk_nope_head_dim"),
        qk_rope_head_dim=_get(tc, "qk_rope_head_dim"),
        v_head_dim=_positive(tc, "v_head_dim"),
        kda_num_heads=_positive(lac, "num_heads", where_l),
        kda_head_dim=_positive(lac, "head_dim", where_l),
        conv_kernel_size=_positive(lac, "short_conv_kernel_size", where_l),
        gate_lower_bound=_get(lac, "gate_lower_bound", float, where=where_l),
        kda_layers=tuple(sorted(x - 1 for x in kda1)),
        mla_layers=tuple(sorted(x - 1 for x in mla1)),
        first_k_dense_replace=_get(tc, "first_k_dense_replace"),
        intermediate_size=_positive(tc, "intermediate_size"),
        situ_beta=_get(tc, "activation_situ_beta", float),
        situ_linear_beta=None if slb is None else _get(tc, "activation_situ_linear_beta", float),
        num_experts=_positive(tc, "num_experts"),
        num_experts_per_token=_positive(tc, "num_experts_per_token"),
        num_shared_experts=_get(tc, "num_shared_experts"),
        moe_intermediate_size=_positive(tc, "moe_intermediate_size"),
        routed_expert_hidden_size=_positive(tc, "routed_expert_hidden_size"),
        latent_moe_use_norm=_get(tc, "latent_moe_use_norm", bool, required=False, default=True),
        num_expert_group=_get(tc, "num_expert_group", required=False, default=1),
        topk_group=_get(tc, "topk_group", required=False, default=1),
        moe_renormalize=_get(tc, "moe_renormalize", bool, required=False, default=True),
        routed_scaling_factor=_get(tc, "routed_scaling_factor", float, required=False, default=1.0),
        attn_res_block_size=_positive(tc, "attn_res_block_size"),
        rms_norm_eps=_get(tc, "rms_norm_eps", float),
        max_position_embeddings=_positive(tc, "max_position_embeddings"),
        bos_token_id=_get(top or tc, "bos_token_id", required=False, default=-1),
        eos_token_id=_get(top or tc, "eos_token_id", required=False, default=-1),
        pad_token_id=_get(top or tc, "pad_token_id", required=False, default=-1),
        experts_mxfp4=mxfp4,
        name=name,
        source=copy.deepcopy(raw) if "text_config" in raw else {"model_type": "kimi_k3", "text_config": copy.deepcopy(raw)},
    )
    _validate(cfg)
    return cfg


def _validate(c: K3Config) -> None:
    t = "text_config"
    if c.rms_norm_eps <= 0:
        raise ConfigError(f"{t}.rms_norm_eps = {c.rms_norm_eps}: must be > 0")
    if c.qk_rope_head_dim < 0:
        raise ConfigError(f"{t}.qk_rope_head_dim = {c.qk_rope_head_dim}: must be >= 0")
    if not -5.0 <= c.gate_lower_bound < 0:
        raise ConfigError(f"{t}.linear_attn_config.gate_lower_bound = {c.gate_lower_bound}: must be in [-5, 0) (log "
                          "decay bound, §4.2; the GPU kernels' safe gate keeps chunk-local products in fp32 range only "
                          "down to -5, K3 uses -5)")
    if c.conv_kernel_size < 2:
        raise ConfigError(f"{t}.linear_attn_config.short_conv_kernel_size = {c.conv_kernel_size}: must be >= 2")
    if c.num_experts_per_token > c.num_experts:
        raise ConfigError(f"{t}.num_experts_per_token = {c.num_experts_per_token}: must be <= num_experts = {c.num_experts}")
    if c.num_expert_group < 1 or c.num_experts % c.num_expert_group:
        raise ConfigError(f"{t}.num_expert_group = {c.num_expert_group}: must divide num_experts = {c.num_experts}")
    if not 1 <= c.topk_group <= c.num_expert_group:
        raise ConfigError(f"{t}.topk_group = {c.topk_group}: must be in 1..num_expert_group = {c.num_expert_group}")
    if c.num_expert_group > 1 and c.num_expert_group > c.topk_group:
        per_group = c.num_experts // c.num_expert_group
        if per_group < 2:
            raise ConfigError(f"{t}.num_expert_group = {c.num_expert_group}: the group score sums the top-2 experts, so each group needs >= 2")
        if c.topk_group * per_group < c.num_experts_per_token:
            raise ConfigError(f"{t}.topk_group = {c.topk_group}: the kept groups hold {c.topk_group * per_group} experts, "
                              f"fewer than num_experts_per_token = {c.num_experts_per_token}")
    if not 0 <= c.first_k_dense_replace <= c.num_hidden_layers:
        raise ConfigError(f"{t}.first_k_dense_replace = {c.first_k_dense_replace}: must be in 0..num_hidden_layers")
    if c.experts_mxfp4:
        for key, v in (("routed_expert_hidden_size", c.routed_expert_hidden_size), ("moe_intermediate_size", c.moe_intermediate_size)):
            if v % 32:
                raise ConfigError(f"{t}.{key} = {v}: must be a multiple of 32 when experts are MXFP4 (group size 32, §8.3)")


def load_config(source: "str | Path | dict") -> K3Config:
    """Load a K3Config from a preset name, a checkpoint directory, a config.json path or a dict.

    Raises ConfigError (bad values), FileNotFoundError (no such preset or file, with the choices).
    """
    if isinstance(source, dict):
        return parse_config(source)
    s = str(source)
    if s in PRESETS:
        return parse_config(PRESETS[s](), name=s)
    p = Path(s)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{s}: neither a preset ({', '.join(PRESETS)}) nor a directory/file with config.json")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e}); restore the checkpoint's config.json") from e
    return parse_config(raw, name=p.parent.name)


def preset_json(name: str) -> dict:
    """The config.json dict of a preset (the `k3` preset is the released file, unedited)."""
    if name not in PRESETS:
        raise FileNotFoundError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()

