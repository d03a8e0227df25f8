"""Layer-by-layer ONNX export of Kimi K3 (docs/EXPORT_FORMAT.md is the contract; keep them in sync).

`export_model(checkpoint, out, tp=1, ep=1)` writes, for every TP rank r, `rank{r}/embed.onnx`, `rank{r}/head.onnx`
and per decoder layer l a prefill and a decode graph (`rank{r}/layer{l:03d}.{prefill|decode}.onnx`; for tp > 1 three
segments `.attn`, `.mlp`, `.post` split at the all-reduce points), with a vision_config `rank{r}/vision.onnx` (the
vision tower + projector, replicated: model.vision.VisionModel.graph_forward, VISION.md §11.2), each with its weights
as external data next to it, then `index.json`. The graphs are `torch.onnx.export(dynamo=True)` traces of the fp32 reference modules of
model/reference.py run with `plugins.torch_ops.TorchOps`, whose custom ops become `kimi` nodes with
model-local function bodies (plugins/onnx_common.py).

CLI: `python -m k3deploy.export.onnx_export --checkpoint DIR --out DIR [--tp N] [--ep M] [--layers 0,3] [--graphs prefill,decode]`.
Errors: ValueError naming the option for bad tp/ep/layers; model.checkpoint.CheckpointError for a bad checkpoint.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch

from k3deploy.model.config import K3Config
from k3deploy.model.layers import Comm, attn_res, rms_norm
from k3deploy.model.reference import Batch, DecoderLayer, LatentMoE, state_spec
from k3deploy.plugins.onnx_common import DOMAIN, DOMAIN_VERSION, OPSET, attach_functions, translation_table
from k3deploy.plugins.torch_ops import TorchOps

log = logging.getLogger(__name__)


def _not_torchvision_notice(record: logging.LogRecord) -> bool:
    """torch.onnx warns, once per exported graph and per torchvision op it would register, that torchvision is not
    installed; our graphs use no torchvision op, so those lines (4 per graph: 448 of a TP=2 build log) are dropped."""
    return not record.getMessage().startswith("torchvision is not installed")


logging.getLogger("torch.onnx._internal.exporter._registration").addFilter(_not_torchvision_notice)

FORMAT_VERSION = 1
EXPORTER_VERSION = "1"
INDEX_NAME = "index.json"
_CODE_FILES = ("export/onnx_export.py", "plugins/onnx_common.py", "plugins/kda/onnx.py", "plugins/mla/onnx.py",
               "plugins/moe/onnx.py", "model/reference.py", "model/layers.py")
_VISION_CODE_FILES = ("export/onnx_export.py", "model/vision.py")
_ROOT = Path(__file__).resolve().parent.parent

# example sizes used for tracing (all distinct and >= 2 so that no dynamic dim is specialised)
_EX = dict(T=7, N=2, S=5, NB=9, BS=4, MB=3, B=3, M=2)
# the vision graph's trace: 3 clips of 2 frames, 24 patches each (VB=3, VL=24, VN=9, VT=2)
_VISION_EX_GRIDS = [(2, 2, 6), (2, 6, 2), (2, 2, 6)]
VISION_DIMS = {"pixels": {0: "VB", 1: "VL"}, "pos_idx": {0: "VB", 1: "VL"}, "pos_w": {0: "VB", 1: "VL"},
               "time_idx": {0: "VB", 1: "VL"}, "rope_cos": {0: "VB", 1: "VL"}, "rope_sin": {0: "VB", 1: "VL"},
               "merge_idx": {0: "VN", 1: "VT"}}


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """One exported graph. kind: embed|layer|head; graph: prefill|decode|any; segment: full|attn|mlp|post."""

    kind: str
    graph: str
    layer: int | None
    segment: str
    segment_index: int
    num_segments: int
    rank: int
    tp: int
    ep: int

    @property
    def id(self) -> str:
        if self.kind != "layer":   # embed, head, vision
            return f"rank{self.rank}/{self.kind}"
        seg = "" if self.segment == "full" else f".{self.segment}"
        return f"rank{self.rank}/layer{self.layer:03d}.{self.graph}{seg}"

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep > 1 else 0


@dataclasses.dataclass
class Port:
    """A graph input: name, example tensor, dynamic axes {axis: dim name}."""

    name: str
    example: torch.Tensor
    dims: dict[int, str]


# ---- graph modules ------------------------------------------------------------------------------------------

class GraphModule(torch.nn.Module):
    """Wraps one graph's forward `fn(dict of named inputs, ops) -> dict of named outputs` as an nn.Module with
    positional inputs in `input_names` order and a tuple of outputs in `output_names` order. `ops` is TorchOps for
    export, ReferenceOps (or TorchOps) for running the PyTorch reference (export/verify.py)."""

    def __init__(self, fn: Callable, input_names: list[str], output_names: list[str], ops=TorchOps):
        super().__init__()
        self.fn, self.input_names, self.output_names, self.ops = fn, list(input_names), list(output_names), ops

    def forward(self, *args):
        out = self.fn(dict(zip(self.input_names, args)), self.ops)
        return tuple(out[n] for n in self.output_names)


def _batch(d: dict, decode: bool) -> Batch:
    return Batch(d.get("cu_seqlens"), d.get("slots"), d.get("block_tables"), d.get("context_lens"), decode=decode)


def _pools(d: dict, kind: str) -> dict:
    return {"state": d["state"], "conv": d["conv"]} if kind == "kda" else {"cache": d["cache"]}


def _bank(d: dict, P: torch.Tensor, nb: int) -> torch.Tensor:
    return d["bank"] if nb else P.new_zeros(P.shape[0], 0, P.shape[1])


def layer_fn(cfg: K3Config, l: int, layer: DecoderLayer, graph: str, segment: str) -> Callable:
    """The forward of one layer graph/segment (see docs/EXPORT_FORMAT.md for names)."""
    kind, nb, commit, eps = cfg.layer_kind(l), cfg.bank_rows_before(l), cfg.is_commit(l), cfg.rms_norm_eps
    decode = graph == "decode"
    pool_out = {"kda": ("state", "conv"), "mla": ("cache",)}[kind]
    comm = Comm()

    def full(d, ops):
        P, bank = d["P"], _bank(d, d["P"], nb)
        P2, bank2, pools = layer(P, bank, _batch(d, decode), _pools(d, kind), comm, ops)
        out = {"P_out": P2, "bank_out": bank2}
        out.update({k + "_out": pools[k] for k in pool_out})
        return out

    def attn(d, ops):
        P, bank = d["P"], _bank(d, d["P"], nb)
        h = attn_res(torch.cat([bank, P[:, None]], 1), *layer.attn_res_w, eps) if nb else P
        a, pools = layer.attn(rms_norm(h, layer.in_norm, eps), _batch(d, decode), _pools(d, kind), comm, ops)
        out = {"attn_partial": a}
        out.update({k + "_out": pools[k] for k in pool_out})
        return out

    def mlp(d, ops):
        P, bank, a = d["P"], _bank(d, d["P"], nb), d["attn"]
        if commit:
            bank = torch.cat([bank, P[:, None]], 1)
        P = a if commit else P + a
        x = rms_norm(attn_res(torch.cat([bank, P[:, None]], 1), *layer.mlp_res_w, eps), layer.post_norm, eps)
        out = {"P_mid": P, "bank_out": bank}
        m = layer.mlp
        if isinstance(m, LatentMoE):
            ids, wts = m.route(x)
            out["moe_latent_partial"] = ops.mxfp4_moe(m.down(x), ids.int(), wts, **m.experts, expert_offset=m.expert_offset,
                                                      situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta,
                                                      num_experts=cfg.num_experts)
            if m.shared is not None:
                out["mlp_partial"] = m.shared.partial(x)
        else:
            out["mlp_partial"] = m.partial(x)
        return out

    def post(d, ops):
        P = d["P_mid"]
        m = layer.mlp
        if isinstance(m, LatentMoE):
            yl = d["moe_latent"]
            yl = rms_norm(yl, m.norm_w, eps) if cfg.latent_moe_use_norm else yl
            P = P + m.up(yl)
            if m.shared is not None:
                P = P + d["mlp"]
        else:
            P = P + d["mlp"]
        return {"P_out": P}

    return {"full": full, "attn": attn, "mlp": mlp, "post": post}[segment]


def layer_ports(cfg: K3Config, l: int, graph: str, segment: str, tp: int) -> tuple[list[Port], list[str]]:
    """(inputs, output names) of a layer graph/segment, with example tensors for tracing."""
    d, kind, nb = cfg.hidden_size, cfg.layer_kind(l), cfg.bank_rows_before(l)
    spec = state_spec(cfg, tp)[l]
    tok = "B" if graph == "decode" else "T"
    T = _EX[tok]
    f32, i32 = torch.float32, torch.int32
    P = Port("P", torch.randn(T, d), {0: tok})
    bank = [Port("bank", torch.randn(T, nb, d), {0: tok})] if nb else []
    if graph == "prefill":
        N = _EX["N"]
        lens = [T - (N - 1)] + [1] * (N - 1)
        meta = [Port("cu_seqlens", torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=i32), {0: "N1"})]
        nseq = N
    else:
        meta, nseq = [], T
    if kind == "kda":
        meta.append(Port("slots", torch.arange(1, nseq + 1, dtype=i32), {0: "N" if graph == "prefill" else "B"}))
        S = _EX["S"] + nseq
        pools = [Port("state", torch.zeros((S,) + spec["state"].shape, dtype=f32), {0: "S"}),
                 Port("conv", torch.zeros((S,) + spec["conv"].shape, dtype=f32), {0: "S"})]
        pool_out = ["state_out", "conv_out"]
    else:
        MB, BS = _EX["MB"], _EX["BS"]
        n = "N" if graph == "prefill" else "B"
        meta += [Port("block_tables", torch.arange(1, nseq * MB + 1, dtype=i32).view(nseq, MB), {0: n, 1: "MB"}),
                 Port("context_lens", torch.zeros(nseq, dtype=i32), {0: n})]
        pools = [Port("cache", torch.zeros(nseq * MB + 1, BS, cfg.latent_dim), {0: "NB", 1: "BS"})]
        pool_out = ["cache_out"]
    commit_out = ["bank_out"] if cfg.is_commit(l) else []
    moe = cfg.is_moe(l)
    has_mlp_partial = (not moe) or cfg.num_shared_experts > 0
    if segment == "full":
        return [P, *bank, *meta, *pools], ["P_out", *commit_out, *pool_out]
    if segment == "attn":
        return [P, *bank, *meta, *pools], ["attn_partial", *pool_out]
    if segment == "mlp":
        outs = ["P_mid", *commit_out] + (["mlp_partial"] if has_mlp_partial else []) + (["moe_latent_partial"] if moe else [])
        return [P, *bank, Port("attn", torch.randn(T, d), {0: tok})], outs
    ins = [Port("P_mid", torch.randn(T, d), {0: tok})]
    if has_mlp_partial:
        ins.append(Port("mlp", torch.randn(T, d), {0: tok}))
    if moe:
        ins.append(Port("moe_latent", torch.randn(T, cfg.routed_expert_hidden_size), {0: tok}))
    return ins, ["P_out"]


class EmbedHead:
    """The rank's vocabulary shard of the embedding and lm_head plus the output norms (model-level weights)."""

    def __init__(self, cfg: K3Config, mw: dict[str, torch.Tensor], rank: int, tp: int):
        self.cfg, self.rank, self.tp = cfg, rank, tp
        self.embed_w = mw["embed_tokens.weight"].float()
        self.lm_head = mw["lm_head.weight"].float()
        self.norm_w = mw["norm.weight"].float()
        self.out_res_w = (mw["output_attn_res_norm.weight"].float(), mw["output_attn_res_proj.weight"].float())
        self.vocab_start = rank * self.embed_w.shape[0]

    def embed(self, d, ops):
        V = self.embed_w.shape[0]
        local = d["ids"].long() - self.vocab_start
        ok = (local >= 0) & (local < V)
        P = self.embed_w[local.clamp(0, V - 1)] * ok[:, None].float()
        return {"P": P, "P_partial": P}

    def head(self, d, ops):
        P, bank = d["P"][d["logits_index"].long()], d["bank"][d["logits_index"].long()]
        eps = self.cfg.rms_norm_eps
        h = attn_res(torch.cat([bank, P[:, None]], 1), *self.out_res_w, eps)
        logits = rms_norm(h, self.norm_w, eps) @ self.lm_head.t()
        return {"logits": logits, "logits_shard": logits}


def embed_ports(cfg: K3Config, tp: int) -> tuple[list[Port], list[str]]:
    return [Port("ids", torch.arange(_EX["T"], dtype=torch.int32), {0: "T"})], ["P" if tp == 1 else "P_partial"]


def head_ports(cfg: K3Config, tp: int) -> tuple[list[Port], list[str]]:
    T, d, nbf = _EX["T"], cfg.hidden_size, cfg.bank_rows_after(cfg.num_hidden_layers - 1)
    return ([Port("P", torch.randn(T, d), {0: "T"}), Port("bank", torch.randn(T, nbf, d), {0: "T"}),
             Port("logits_index", torch.tensor([T - 1, 0], dtype=torch.int32), {0: "M"})],
            ["logits" if tp == 1 else "logits_shard"])


def vision_ports(cfg: K3Config) -> tuple[list[Port], list[str]]:
    """(inputs, outputs) of the vision graph (VISION.md §11.2 with a batch of equal-length segments): pixels
    [VB, VL, 3p²], pos_idx / pos_w [VB, VL, K], time_idx [VB, VL], rope_cos / rope_sin [VB, VL, Dh/2], merge_idx
    [VN, VT, 4] -> features [VN, text hidden]."""
    from k3deploy.model.vision import graph_inputs
    v = cfg.vision
    L = sum(t * h * w for t, h, w in _VISION_EX_GRIDS)
    g = torch.Generator().manual_seed(0)
    ins = graph_inputs(_VISION_EX_GRIDS, torch.rand(L, v.patch_dim, generator=g) * 2 - 1, v)
    return [Port(n, ins[n], VISION_DIMS[n]) for n in ins], ["features"]


def vision_fn(model) -> Callable:
    """The vision graph's forward: model.vision.VisionModel.graph_forward on the named inputs."""
    def fn(d, ops):
        return {"features": model.graph_forward(**d)}
    return fn


def collectives(spec: GraphSpec, outputs: list[str]) -> list[dict]:
    """The collectives a runtime runs on this graph's outputs (tp > 1), docs/EXPORT_FORMAT.md."""
    if spec.tp == 1:
        return []
    out = []
    for n in outputs:
        if n.endswith("_partial"):
            out.append({"op": "all_reduce_sum", "output": n, "input": n[: -len("_partial")]})
        elif n == "logits_shard":
            out.append({"op": "all_gather_last", "output": n, "input": "logits"})
    return out


# ---- export of one graph --------------------------------------------------------------------------------------

def _dtype_name(elem: int) -> str:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)).name


def _io(values) -> list[dict]:
    out = []
    for v in values:
        tt = v.type.tensor_type
        shape = [d.dim_param if d.dim_param else int(d.dim_value) for d in tt.shape.dim]
        out.append({"name": v.name, "shape": shape, "dtype": _dtype_name(tt.elem_type)})
    return out


def trace_to_onnx(module: GraphModule, ports: list[Port], optimize: bool = True) -> onnx.ModelProto:
    """torch.onnx.export(dynamo=True) of a GraphModule, kimi function bodies attached, opset OPSET.
    optimize=False skips onnxscript's graph optimizer (faster export, larger graphs; same results)."""
    dims: dict[str, torch.export.Dim] = {}

    def dim(name):
        if name not in dims:
            dims[name] = torch.export.Dim(name, min=1, max=1 << 30)
        return dims[name]

    dyn = tuple({a: dim(n) for a, n in p.dims.items()} or None for p in ports)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module.eval(), tuple(p.example for p in ports), dynamo=True, opset_version=OPSET,
                                 input_names=[p.name for p in ports], output_names=module.output_names,
                                 dynamic_shapes={"args": dyn}, custom_translation_table=translation_table(),
                                 optimize=optimize, verbose=False)
    model = prog.model_proto
    attach_functions(model)
    return model


def _hash_tensors(h, tensors: dict[str, torch.Tensor]) -> None:
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def code_hash(files: tuple[str, ...] = _CODE_FILES) -> str:
    """sha256 of the exporter's own sources (a code change invalidates earlier exports); `files` default: the text
    graphs' sources (the vision graph's: _VISION_CODE_FILES)."""
    h = hashlib.sha256(EXPORTER_VERSION.encode())
    for f in files:
        p = _ROOT / f
        h.update(p.read_bytes() if p.is_file() else b"")
    return h.hexdigest()


def save_atomic(model: onnx.ModelProto, path: Path) -> None:
    """Save `model` to `path` with its initializers in `path.name + '.data'` next to it (temp dir + rename),
    after onnx.checker full check (which includes strict shape inference) on the saved file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent))
    try:
        data_name = path.name + ".data"
        onnx.save_model(model, tmp / path.name, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=1024)
        onnx.checker.check_model(str(tmp / path.name), full_check=True)
        for f in (tmp / data_name, tmp / path.name):
            if f.exists():
                os.chmod(f, 0o644)
        if (tmp / data_name).exists():
            os.replace(tmp / data_name, path.parent / data_name)
        os.replace(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_json_atomic(obj, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# ---- the whole model ------------------------------------------------------------------------------------------

def plan(cfg: K3Config, tp: int, ep: int, layers: list[int] | None = None,
         graphs: tuple[str, ...] = ("prefill", "decode")) -> list[GraphSpec]:
    """Every graph to export, rank-major, in execution order (the vision graph last on each rank, when the config
    has one and no `layers` subset is asked for)."""
    out = []
    segs = ("full",) if tp == 1 else ("attn", "mlp", "post")
    for r in range(tp):
        out.append(GraphSpec("embed", "any", None, "full", 0, 1, r, tp, ep))
        for l in (range(cfg.num_hidden_layers) if layers is None else layers):
            for g in graphs:
                for i, s in enumerate(segs):
                    out.append(GraphSpec("layer", g, l, s, i, len(segs), r, tp, ep))
        out.append(GraphSpec("head", "any", None, "full", 0, 1, r, tp, ep))
        if cfg.vision is not None and layers is None:
            out.append(GraphSpec("vision", "any", None, "full", 0, 1, r, tp, ep))
    return out


class WeightSource:
    """Sharded weights per rank, from a checkpoint directory (model.checkpoint.Checkpoint) or in memory
    (`cfg` + `layer_weights(l)` + `model_weights()` callables, unsharded, names relative as the Checkpoint gives;
    `vision_weights()` with a vision_config: the released names). `processor`: the preprocessor_config.json dict
    (None: VISION.md §1.1's defaults)."""

    def __init__(self, cfg: K3Config, layer_weights: Callable, model_weights: Callable,
                 vision_weights: Callable | None = None, processor: dict | None = None):
        self.cfg, self._lw, self._mw, self._vw = cfg, layer_weights, model_weights, vision_weights
        self.processor = processor
        self._cache: dict = {}

    @classmethod
    def from_checkpoint(cls, path) -> "WeightSource":
        from k3deploy.model.checkpoint import Checkpoint
        ck = Checkpoint(path)
        return cls(ck.config, ck.layer_weights, ck.model_weights,
                   ck.vision_weights if ck.config.vision is not None else None, ck.preprocessor_config())

    def vision(self):
        """The fp32 vision model (model.vision.VisionModel), replicated on every rank. ValueError without one."""
        from k3deploy.model.vision import VisionModel
        if self._vw is None:
            raise ValueError("this model has no vision tower (config.json has no vision_config)")
        if "vision" not in self._cache:
            self._cache["vision"] = VisionModel(self.cfg.vision, self._vw())
        return self._cache["vision"]

    def layer(self, l: int, rank: int, tp: int, ep: int) -> dict[str, torch.Tensor]:
        """Decoder layer l's weights (names relative to the layer prefix, A_log trimmed) sharded for rank of tp/ep (§10)."""
        from k3deploy.model.sharding import shard_layer
        key = ("layer", l)
        if key not in self._cache:
            self._cache = {key: self._lw(l)}  # keep one layer's full weights at a time
        return shard_layer(self.cfg, l, self._cache[key], rank, tp, ep)

    def model(self, rank: int, tp: int) -> dict[str, torch.Tensor]:
        """Model-level weights (embedding, norms, output AttnRes, lm_head) with the vocabulary sharded for rank of tp."""
        from k3deploy.model.sharding import shard_model
        return shard_model(self.cfg, self._mw(), rank, tp)


def build_graph(src: WeightSource, spec: GraphSpec, ops=TorchOps) -> tuple[GraphModule, list[Port], dict]:
    """(module, input ports, weights dict it embeds) of one graph spec; `ops` selects export (TorchOps) or the
    plain reference (ReferenceOps)."""
    cfg = src.cfg
    if spec.kind == "vision":
        vm = src.vision()
        ports, outs = vision_ports(cfg)
        return GraphModule(vision_fn(vm), [p.name for p in ports], outs, ops), ports, vm.weights()
    if spec.kind == "layer":
        w = src.layer(spec.layer, spec.rank, spec.tp, spec.ep)
        layer = DecoderLayer(cfg, spec.layer, w)
        ports, outs = layer_ports(cfg, spec.layer, spec.graph, spec.segment, spec.tp)
        fn = layer_fn(cfg, spec.layer, layer, spec.graph, spec.segment)
    else:
        w = src.model(spec.rank, spec.tp)
        eh = EmbedHead(cfg, w, spec.rank, spec.tp)
        ports, outs = (embed_ports if spec.kind == "embed" else head_ports)(cfg, spec.tp)
        fn = eh.embed if spec.kind == "embed" else eh.head
    return GraphModule(fn, [p.name for p in ports], outs, ops), ports, w


def input_hash(cfg: K3Config, spec: GraphSpec, weights: dict, code: str) -> str:
    """sha256 (hex) of everything a graph depends on: the text config (`text_hash`; the vision graph: the vision
    config and its own code), graph spec, the exporter's code hash and the weights' bytes; stored as the file's
    k3.input_hash so an unchanged graph is not exported again (adding a vision tower keeps every text graph)."""
    if spec.kind == "vision":
        code, conf = code_hash(_VISION_CODE_FILES), cfg.vision_hash()
    else:
        conf = cfg.text_hash()
    h = hashlib.sha256(code.encode())
    h.update(conf.encode())
    h.update(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode())
    _hash_tensors(h, weights)
    return h.hexdigest()


def _metadata(cfg: K3Config, spec: GraphSpec, ihash: str) -> dict[str, str]:
    return {"k3.format_version": str(FORMAT_VERSION), "k3.config_hash": cfg.config_hash(), "k3.kind": spec.kind,
            "k3.graph": spec.graph, "k3.layer": str(-1 if spec.layer is None else spec.layer),
            "k3.layer_kind": cfg.layer_kind(spec.layer) if spec.layer is not None else "",
            "k3.segment": spec.segment, "k3.tp_rank": str(spec.rank), "k3.tp_size": str(spec.tp),
            "k3.ep_rank": str(spec.ep_rank), "k3.ep_size": str(spec.ep), "k3.input_hash": ihash}


def _existing_hash(path: Path) -> str | None:
    """k3.input_hash of an existing complete export at `path` (graph proto only), else None."""
    if not path.is_file() or not Path(str(path) + ".data").is_file():
        return None
    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception:  # a damaged file is simply exported again
        return None
    return {p.key: p.value for p in m.metadata_props}.get("k3.input_hash")


def export_graph(src: WeightSource, spec: GraphSpec, out: Path, code: str, optimize: bool = True) -> dict:
    """Export one graph, or skip it when the file at its path already carries the same `k3.input_hash`
    (same exporter code, config, graph spec and weights); returns its index.json entry."""
    cfg = src.cfg
    module, ports, weights = build_graph(src, spec)
    ihash = input_hash(cfg, spec, weights, code)
    rel = spec.id + ".onnx"
    path = out / rel
    if _existing_hash(path) == ihash:
        log.info("%s: unchanged (input hash), skipped", rel)
        model = onnx.load(str(path), load_external_data=False)
    else:
        model = trace_to_onnx(module, ports, optimize)
        for k, v in _metadata(cfg, spec, ihash).items():
            model.metadata_props.add(key=k, value=v)
        model.producer_name, model.producer_version = "k3deploy.export", EXPORTER_VERSION
        save_atomic(model, path)
    ins, outs = _io(model.graph.input), _io(model.graph.output)
    onames = [o["name"] for o in outs]
    return {"id": spec.id, "path": rel, "kind": spec.kind, "graph": spec.graph, "layer": spec.layer,
            "layer_kind": cfg.layer_kind(spec.layer) if spec.layer is not None else None,
            "segment": spec.segment, "segment_index": spec.segment_index, "num_segments": spec.num_segments,
            "rank": spec.rank, "tp_size": spec.tp, "ep_rank": spec.ep_rank, "ep_size": spec.ep,
            "inputs": ins, "outputs": outs,
            "state_io": {p: p + "_out" for p in ("state", "conv", "cache") if p + "_out" in onames},
            "collectives": collectives(spec, onames), "input_hash": ihash}


def _untouched_entries(out: Path, entries: list[dict], cfg: K3Config, tp: int, ep: int) -> list[dict]:
    """For a partial export (--layers / --graphs): the previous index's entries of graphs this run did not
    export (same config, tp and ep, file present), so index.json never shrinks to the subset."""
    p = out / INDEX_NAME
    if not p.is_file():
        return []
    try:
        prev = json.loads(p.read_text())
    except json.JSONDecodeError:
        return []
    if (prev.get("config_hash"), prev.get("tp"), prev.get("ep")) != (cfg.config_hash(), tp, ep):
        return []
    done = {e["path"] for e in entries}
    return [e for e in prev.get("graphs", []) if e["path"] not in done and (out / e["path"]).is_file()]


def export_model(src: "WeightSource | str | Path", out: "str | Path", tp: int = 1, ep: int = 1,
                 layers: list[int] | None = None, graphs: tuple[str, ...] = ("prefill", "decode"),
                 progress: bool = True, optimize: bool = True) -> dict:
    """Export every graph of the model (see module docstring) into `out`; returns the index dict (also written
    to out/index.json). Raises ValueError naming tp/ep/layers/graphs when they are invalid."""
    from k3deploy.model.sharding import check_parallel
    if not isinstance(src, WeightSource):
        src = WeightSource.from_checkpoint(src)
    cfg = src.cfg
    check_parallel(cfg, tp, ep)
    if layers is not None:
        bad = [l for l in layers if not 0 <= l < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"layers {bad}: outside 0..{cfg.num_hidden_layers - 1}")
    if not graphs or set(graphs) - {"prefill", "decode"}:
        raise ValueError(f"graphs = {graphs}: choose from prefill, decode")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    code = code_hash()
    specs = plan(cfg, tp, ep, layers, graphs)
    entries = []
    it = specs
    if progress:
        from tqdm import tqdm
        it = tqdm(specs, desc="export onnx", unit="graph")
    for spec in it:
        entries.append(export_graph(src, spec, out, code, optimize))
    if layers is not None or set(graphs) != {"prefill", "decode"}:
        entries += _untouched_entries(out, entries, cfg, tp, ep)
    spec_tp = state_spec(cfg, tp)
    vision = None
    if cfg.vision is not None:
        from k3deploy.model.vision import parse_processor_config
        proc = parse_processor_config(src.processor)
        vision = {"processor": proc.to_json(), "media_placeholder_token_id": cfg.vision.media_placeholder_token_id,
                  "max_patches_per_image": proc.max_patches(), "dims": {"VB": "segments per call",
                  "VL": "patches per segment", "VN": "merged tokens", "VT": "frames per segment"}}
    index = {
        "format": "k3deploy.onnx", "format_version": FORMAT_VERSION, "config_hash": cfg.config_hash(),
        "vision": vision,
        "config": cfg.to_json(), "opset": OPSET, "custom_domain": DOMAIN, "custom_opset": DOMAIN_VERSION,
        "tp": tp, "ep": ep, "act_dtype": "float32", "num_layers": cfg.num_hidden_layers,
        "bank_rows_final": cfg.bank_rows_after(cfg.num_hidden_layers - 1),
        "layers": [{"layer": l, "kind": cfg.layer_kind(l), "moe": cfg.is_moe(l), "commit": cfg.is_commit(l),
                    "bank_rows_in": cfg.bank_rows_before(l), "bank_rows_out": cfg.bank_rows_after(l),
                    "state": {k: {"shape": list(s.shape), "dtype": str(s.dtype).replace("torch.", ""), "unit": s.unit}
                              for k, s in spec_tp[l].items()}}
                   for l in range(cfg.num_hidden_layers)],
        "graphs": entries,
    }
    _write_json_atomic(index, out / INDEX_NAME)
    log.info("exported %d graphs to %s", len(entries), out)
    return index


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated layer indices like 0,3") from None


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog or "python -m k3deploy.export.onnx_export",
                                 description="Export a K3 checkpoint layer by layer to ONNX (docs/EXPORT_FORMAT.md).")
    ap.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, type=Path, help="output directory (index.json + rank*/ graphs)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    ap.add_argument("--ep", type=int, default=None, help="expert-parallel ranks: 1 or tp (default 1)")
    ap.add_argument("--layers", type=_int_list, default=None, help="only these layers, e.g. 0,3 (default all)")
    ap.add_argument("--graphs", default="prefill,decode", help="layer graph kinds (default prefill,decode)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    ap.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        export_model(a.checkpoint, a.out, tp=a.tp, ep=a.ep or 1, layers=a.layers,
                     graphs=tuple(g for g in a.graphs.split(",") if g), progress=not a.no_progress)
    except ValueError as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
