"""Typed Kimi K3 configuration: the text model (MODEL.md §1) and, when present, the vision tower (VISION.md §0.1).

`load_config(source)` accepts a preset name (`k3`, `k3-tiny`, `k3-slice`, `k3-tiny-vl`, `k3-vision-slice`, `k3-tp8-rank`), a
checkpoint directory holding `config.json`, a path to a `config.json`, or an already-parsed dict (either the
multimodal wrapper with `text_config` and optionally `vision_config`, or a bare text config). Every validation
error is a `ConfigError` (a `ValueError`) naming the key, the bad value and the rule.
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


TOWER_NORM_EPS = 2.0 ** -23   # the tower's RMSNorms are built without eps: FP32's epsilon (VISION.md §4.1, §13 Q2)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """MoonViT-V2 tower + PatchMergerV2 projector (VISION.md §0.1), parsed from `vision_config` and the wrapper's
    `media_placeholder_token_id`. No layer has a bias; the merge is sd2_tpool with a 2x2 kernel."""

    patch_size: int
    hidden_size: int            # vt_hidden_size, D
    num_layers: int             # vt_num_hidden_layers
    num_heads: int              # vt_num_attention_heads
    qkv_hidden_size: int        # attention width Q (head dim = Q / heads, not D / heads)
    intermediate_size: int      # vt_intermediate_size
    pos_emb_height: int         # init_pos_emb_height: rows of the learned table
    pos_emb_width: int          # init_pos_emb_width
    pos_emb_time: int           # init_pos_emb_time: temporal sin/cos rows = max frames per segment
    interpolation: str          # pos_emb_interpolation_mode: "bilinear" (§13 Q1) or "bicubic"
    merge_kernel: tuple[int, int]
    mm_hidden_size: int
    text_hidden_size: int
    projector_eps: float        # projector_ln_eps
    media_placeholder_token_id: int
    norm_eps: float = TOWER_NORM_EPS

    @property
    def head_dim(self) -> int:
        """Dh = qkv_hidden_size / heads (128 for K3)."""
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """Width entering the projector: mm_hidden_size x 2 x 2 (4096 for K3)."""
        return self.mm_hidden_size * self.merge_kernel[0] * self.merge_kernel[1]

    @property
    def patch_dim(self) -> int:
        """Flattened patch width 3 x p x p (588 for p = 14)."""
        return 3 * self.patch_size * self.patch_size


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
    vision: VisionConfig | None = None  # the vision tower + projector when the config has `vision_config`
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
        """sha256 of the canonical JSON of every field that shapes the math, the vision tower's included when
        there is one (first 16 hex digits)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("source", "name", "vision")}
        if self.vision is not None:
            d["vision"] = dataclasses.asdict(self.vision)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def text_hash(self) -> str:
        """sha256 (16 hex digits) of the fields the text graphs depend on: config_hash without the vision tower and
        the special token ids (bos/eos/pad), so adding a vision tower leaves the text graphs' hashes unchanged."""
        skip = ("source", "name", "vision", "bos_token_id", "eos_token_id", "pad_token_id")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def vision_hash(self) -> str | None:
        """sha256 (16 hex digits) of the vision config, None without one."""
        if self.vision is None:
            return None
        return hashlib.sha256(json.dumps(dataclasses.asdict(self.vision), sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        """The released config.json layout (multimodal wrapper) that reproduces this config."""
        return copy.deepcopy(self.source)


# ---- presets ----------------------------------------------------------------------------------

K3_TINY_JSON: dict = {
    "model_type": "kimi_k3", "tie_word_embeddings": False,
    # K3's 256 special tokens sit after the 768 BPE ranks at K3's offsets: id = 768 + (K3 id - 163584)
    "bos_token_id": 768, "eos_token_id": 770, "pad_token_id": 1023, "media_placeholder_token_id": 789,
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
    """MODEL.md §1.4B: K3 with 5 layers (3 KDA + 2 MLA), AttnRes block 2, 64 experts; text only (no vision_config:
    `k3-vision-slice` adds the tower)."""
    j = _k3_json()
    j.pop("vision_config")
    tc = j["text_config"]
    tc["num_hidden_layers"] = 5
    tc["linear_attn_config"]["kda_layers"] = [1, 2, 3]
    tc["linear_attn_config"]["full_attn_layers"] = [4, 5]
    tc["attn_res_block_size"] = 2
    tc["num_experts"] = 64
    return j


K3_TP8_RANK_EXPERTS = 448     # routed experts per layer of the k3-tp8-rank preset: K3's 896 halved to fit one H200


def _k3_tp8_rank_json() -> dict:
    """K3 as one rank of TP = 8 holds it (MODEL.md §10), written as a tp = 1 config: the 93 layers in K3's order
    (69 KDA + 24 MLA, AttnRes block 12), 12 KDA and 12 MLA heads (q/k/v/g [1536, 7168], q_b [2304, 1536], kv_b
    [3072, 512], o_proj [7168, 1536]), the rank's dense MLP (intermediate 4224) and shared experts (2 x 384 = 768),
    the rank's vocabulary rows (20480 of embed_tokens / lm_head), and each routed expert as the rank's TP slice
    (moe_intermediate_size 384: w1 / w3 [384, 3584], w2 [3584, 384], MXFP4). Replicated tensors (router, latent
    down / up, MLA LoRA, norms, f_a) keep K3's shapes. Only the routed expert count differs: 448 of 896 per layer
    (K3_TP8_RANK_EXPERTS; 23.7 GB dense bf16 + 90.4 GB of MXFP4 expert slices, where 896 would need 180.8 GB).
    Without the all-reduces a rank's step does, this is the per-rank work of K3 at TP = 8 on one GPU. Text only."""
    j = _k3_json()
    j.pop("vision_config")
    tc = j["text_config"]
    tc.update(num_attention_heads=12, num_key_value_heads=12, intermediate_size=4224, moe_intermediate_size=384,
              vocab_size=20480, num_experts=K3_TP8_RANK_EXPERTS)
    tc["linear_attn_config"]["num_heads"] = 12
    return j


def _tiny_json() -> dict:
    j = copy.deepcopy(K3_TINY_JSON)
    # k3-tiny keeps MXFP4 experts so the quantized path is exercised everywhere (64 and 128 are multiples of 32).
    j["text_config"]["quantization_config"] = copy.deepcopy(_k3_json()["text_config"]["quantization_config"])
    return j


# VISION.md §10.1. Special ids: k3-tiny's 256 special tokens sit at 768..1023, at K3's offsets from its first
# special id (163584), so `<|media_pad|>` = 768 + 21 = 789 (VISION.md §10.1 writes 1000 and bos/eos/pad 1/2/0;
# this layout keeps the tokenizer of k3-tiny and K3 the same shape).
K3_TINY_VISION_CONFIG: dict = {
    "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
    "vt_hidden_size": 64, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 4,
    "qkv_hidden_size": 96, "vt_intermediate_size": 256,
    "norm_type": "rmsnorm", "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh",
    "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2", "mm_hidden_size": 64, "text_hidden_size": 256,
    "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "_attn_implementation": "eager",
}


def _tiny_vl_json() -> dict:
    """VISION.md §10.1: k3-tiny's text model + a 2-block tower (D 64, 4 heads of 24, 8x8 table, 4 time rows)."""
    j = _tiny_json()
    j.update({"bos_token_id": 768, "eos_token_id": 770, "pad_token_id": 1023, "media_placeholder_token_id": 789,
              "image_placeholder": "<|kimi_image_placeholder|>", "architectures": ["KimiK3ForConditionalGeneration"],
              "vision_config": copy.deepcopy(K3_TINY_VISION_CONFIG)})
    return j


def _vision_slice_json() -> dict:
    """VISION.md §10.2: k3-slice's text model + K3's vision_config with 2 blocks (every vision kernel shape of K3)."""
    j = _k3_slice_json()
    j["vision_config"] = _k3_json()["vision_config"]
    j["vision_config"]["vt_num_hidden_layers"] = 2
    return j


PRESETS = {"k3": _k3_json, "k3-tiny": _tiny_json, "k3-slice": _k3_slice_json, "k3-tiny-vl": _tiny_vl_json,
           "k3-vision-slice": _vision_slice_json, "k3-tp8-rank": _k3_tp8_rank_json}


# ---- parsing ----------------------------------------------------------------------------------

def _get(tc: dict, key: str, kind=int, required: bool = True, default: Any = None, where: str = "text_config"):
    if key not in tc or tc[key] is None:
        if required:
            ref = "MODEL.md §1.2" if where.startswith("text_config") else "VISION.md §0.1"
            raise ConfigError(f"{where}.{key}: missing; it is required ({ref})")
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


_VISION_FIXED = {  # key -> (the only supported value, why)
    "norm_type": ("rmsnorm", "the tower's norms are RMSNorm (§4.1)"),
    "mlp_type": ("mlp2", "fc0 -> gelu_tanh -> fc1 (§4.3)"),
    "activation_func": ("gelu_pytorch_tanh", "the reference hard-codes tanh-GELU in the tower (§4.3)"),
    "pos_emb_type": ("divided_fixed", "learned 2-D table + fixed sin/cos time rows (§3)"),
    "merge_type": ("sd2_tpool", "mean over frames, 2x2 spatial concat (§6.1)"),
    "mm_projector_type": ("patchmergerv2", "PatchMergerMLPV2 with post-norm (§6.2)"),
    "projector_hidden_act": ("gelu", "the projector hard-codes exact erf GELU; other values are refused (§13 Q10)"),
    "attn_bias": (False, "K3's tower has no biases (§0)"),
    "linear_bias": (False, "K3's tower has no biases (§0)"),
    "patch_embed_proj_bias": (False, "K3's tower has no biases (§0)"),
}


def parse_vision_config(raw: dict, text_hidden: int, vocab_size: int, special_ids: dict[str, int]) -> VisionConfig:
    """The wrapper's `vision_config` (+ `media_placeholder_token_id`) -> VisionConfig (VISION.md §0.1).

    text_hidden / vocab_size: the text model's, which the projector output and the placeholder id must fit;
    special_ids: {key: id} the placeholder must differ from (bos/eos/pad). Raises ConfigError naming the key."""
    vc = raw["vision_config"]
    w = "vision_config"
    if not isinstance(vc, dict):
        raise ConfigError(f"{w}: must be a JSON object (VISION.md §0.1)")
    for key, (want, why) in _VISION_FIXED.items():
        v = vc.get(key, want)
        if v != want:
            raise ConfigError(f"{w}.{key} = {v!r}: only {want!r} is supported ({why})")
    mode = vc.get("pos_emb_interpolation_mode", "bilinear")
    if mode not in ("bilinear", "bicubic"):
        raise ConfigError(f"{w}.pos_emb_interpolation_mode = {mode!r}: choose 'bilinear' (the release, §13 Q1) or 'bicubic'")
    mk = vc.get("merge_kernel_size", [2, 2])
    if list(mk) != [2, 2]:
        raise ConfigError(f"{w}.merge_kernel_size = {mk!r}: only [2, 2] is supported (sd2_tpool, §6.1)")
    heads, qkv = _positive(vc, "vt_num_attention_heads", w), _positive(vc, "qkv_hidden_size", w)
    if qkv % heads or (qkv // heads) % 4:
        raise ConfigError(f"{w}.qkv_hidden_size = {qkv}: must be vt_num_attention_heads ({heads}) x a head dim "
                          "divisible by 4 (2-D RoPE rotates (column, row) pairs, §3.3)")
    D = _positive(vc, "vt_hidden_size", w)
    if D % 2:
        raise ConfigError(f"{w}.vt_hidden_size = {D}: must be even (sin|cos time rows, §3.2)")
    mm = _positive(vc, "mm_hidden_size", w)
    if mm != D:
        raise ConfigError(f"{w}.mm_hidden_size = {mm}: must equal vt_hidden_size = {D} (the merge concatenates tower rows)")
    th = _positive(vc, "text_hidden_size", w)
    if th != text_hidden:
        raise ConfigError(f"{w}.text_hidden_size = {th}: must equal text_config.hidden_size = {text_hidden} (the "
                          "projector writes over text embedding rows, §8.3)")
    eps = _get(vc, "projector_ln_eps", float, where=w)
    if eps <= 0:
        raise ConfigError(f"{w}.projector_ln_eps = {eps}: must be > 0")
    pad = _get(raw, "media_placeholder_token_id", where="config")
    if not 0 <= pad < vocab_size:
        raise ConfigError(f"config.media_placeholder_token_id = {pad}: must be a token id in [0, vocab_size={vocab_size})")
    same = [k for k, v in special_ids.items() if v == pad]
    if same:
        raise ConfigError(f"config.media_placeholder_token_id = {pad}: equals {same[0]}; the image placeholder needs "
                          "its own id (`<|media_pad|>`, §8.1)")
    return VisionConfig(
        patch_size=_positive(vc, "patch_size", w), hidden_size=D, num_layers=_positive(vc, "vt_num_hidden_layers", w),
        num_heads=heads, qkv_hidden_size=qkv, intermediate_size=_positive(vc, "vt_intermediate_size", w),
        pos_emb_height=_positive(vc, "init_pos_emb_height", w), pos_emb_width=_positive(vc, "init_pos_emb_width", w),
        pos_emb_time=_positive(vc, "init_pos_emb_time", w), interpolation=mode, merge_kernel=(2, 2),
        mm_hidden_size=mm, text_hidden_size=th, projector_eps=eps, media_placeholder_token_id=pad)


def parse_config(raw: dict, name: str = "custom") -> K3Config:
    """Parse a config.json dict (wrapper with `text_config` and optionally `vision_config`, or a bare text config)
    into a validated K3Config (`.vision` set when the wrapper has a `vision_config`).

    Raises ConfigError naming the key, the value and the violated rule.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
    tc = raw.get("text_config", raw)
    if not isinstance(tc, dict):
        raise ConfigError("text_config: must be a JSON object (MODEL.md §1.1)")
    top = raw if "text_config" in raw else {}
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
        vision=None,
        name=name,
        source=copy.deepcopy(raw) if "text_config" in raw else {"model_type": "kimi_k3", "text_config": copy.deepcopy(raw)},
    )
    _validate(cfg)
    if top.get("vision_config") is not None:
        ids = {f"{k}_token_id = {getattr(cfg, k + '_token_id')}": getattr(cfg, k + "_token_id") for k in ("bos", "eos", "pad")}
        cfg = dataclasses.replace(cfg, vision=parse_vision_config(top, cfg.hidden_size, cfg.vocab_size, ids))
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

