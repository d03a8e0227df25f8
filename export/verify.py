"""Polygraphy verification of an export directory against the fp32 PyTorch reference.

* `TorchReferenceRunner` — a Polygraphy `BaseRunner` running one graph's PyTorch reference (the modules of
  model/reference.py with the plain reference ops, `ReferenceOps`), on CPU (Polygraphy's PytRunner is GPU-only).
* `OrtModel` — runs a whole export directory with ONNX Runtime following index.json (all TP ranks in this process;
  the collectives of docs/EXPORT_FORMAT.md are done numerically: sums of `*_partial`, concatenation of
  `logits_shard`). `OrtModelRunner` / `TorchModelRunner` wrap the whole model (logits and every layer's pools).
* `verify(onnx_dir, checkpoint)` — per graph of rank 0 (tp == 1: every layer's prefill and decode graph, embed,
  head; any tp: the vision graph of every rank) and end to end, `Comparator.run` + `Comparator.compare_accuracy` with `CompareFunc.simple` and the per-output
  tolerances `TOLERANCES`; recurrent state, conv history and latent cache outputs are compared, not only hidden
  states. Returns (and writes as JSON) a report: per graph, per output max abs / rel error and pass/fail.

With a vision tower, `vision_end_to_end` compares the packed fp32 reference (model.vision.VisionModel.reference: one
sequence, block-diagonal attention) with the vision graph run the way the runtime runs it (segments grouped by
length, one call per group) on mixed grids, a clip included. `previous`: an earlier report of the same export
directory; a graph whose input hash (index.json) and verifier code are unchanged and that passed keeps its result
(`"reused": true`), so adding a vision tower to a verified deployment re-verifies only the new graph and the
end-to-end runs.

Inputs are realistic: a two-sequence scenario (non-contiguous slots and blocks) is run through the reference —
prefill, then a second prefill chunk continuing both sequences (captured), then a decode step (captured) — so the
captured layer inputs carry non-zero KDA state, conv history and cached latents.

CLI: `python -m k3deploy.export.verify --onnx-dir DIR --checkpoint DIR [--report PATH] [--write-polygraphy-data DIR]`;
with `--write-polygraphy-data`, every graph gets `<id>.inputs.json` and `<id>.outputs.json` (Polygraphy JSON: a
list of feed dicts and RunResults) so that
`polygraphy run DIR/<id>.onnx --onnxrt --load-inputs <id>.inputs.json --load-outputs <id>.outputs.json
 --atol 1e-4 --rtol 1e-3` checks one layer. Exit status 0 iff everything passed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.onnxrt import OnnxrtRunner
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator, CompareFunc, IterationResult, RunResults
from polygraphy.json import save_json

from k3deploy.model.config import K3Config, load_config
from k3deploy.model.reference import Batch, K3Model, ReferenceOps, allocate_pools
from k3deploy.export.onnx_export import INDEX_NAME, GraphSpec, WeightSource, build_graph, code_hash

log = logging.getLogger(__name__)

# fp32 vs fp32 (different summation order, absorbed vs unabsorbed MLA): per-output (atol, rtol); "" = default.
# Polygraphy's simple check passes an element when |a-b| <= atol OR |a-b| <= rtol·|b|. Per-layer errors observed on
# k3-tiny are <= 5e-6 abs; through all 9 layers <= 2e-5.
TOLERANCES: dict[str, tuple[float, float]] = {
    "": (1e-4, 1e-3),          # hidden states, bank, KDA state, conv history, latent cache (observed <= 2e-5 e2e)
    "logits": (2e-4, 1e-3),
}
CLI_ATOL, CLI_RTOL = 1e-4, 1e-3   # the tolerance printed for / used by the polygraphy CLI check


def _tol(name: str) -> tuple[float, float]:
    base = name.split(".")[-1]
    return TOLERANCES.get(base, TOLERANCES[""])


def compare_func(names) -> CompareFunc:
    """CompareFunc.simple with the per-output tolerances of TOLERANCES for `names`."""
    atol = {"": TOLERANCES[""][0], **{n: _tol(n)[0] for n in names}}
    rtol = {"": TOLERANCES[""][1], **{n: _tol(n)[1] for n in names}}
    with warnings.catch_warnings():   # deprecated in favour of SimpleCompareFunc (0.60); same behaviour
        warnings.simplefilter("ignore", DeprecationWarning)
        return CompareFunc.simple(check_shapes=True, atol=atol, rtol=rtol)


# ---- runners ---------------------------------------------------------------------------------------------------

class TorchReferenceRunner(BaseRunner):
    """Polygraphy runner for one graph's PyTorch reference (CPU, fp32). `module` is an export.onnx_export.GraphModule
    built with ReferenceOps; inputs/outputs keep the ONNX graph's names."""

    def __init__(self, module, input_meta: TensorMetadata, name: str | None = None):
        super().__init__(name=name, prefix="torch-reference")
        self.module, self.meta = module, input_meta

    def activate_impl(self):
        pass

    def get_input_metadata_impl(self):
        return self.meta

    def infer_impl(self, feed_dict):
        t0 = time.perf_counter()
        with torch.no_grad():
            outs = self.module(*[torch.from_numpy(np.ascontiguousarray(feed_dict[n])) for n in self.module.input_names])
        self.inference_time = time.perf_counter() - t0
        return OrderedDict((n, o.detach().numpy()) for n, o in zip(self.module.output_names, outs))

    def deactivate_impl(self):
        pass


def split_pool(name: str, arr: np.ndarray, tp: int) -> list[np.ndarray]:
    """A tp = 1 pool as the tp ranks hold it: KDA `state` [S, H, V, K] by heads (axis 1); KDA `conv`
    [S, 3P, W-1] = q‖k‖v by heads of each of q, k, v; MLA `cache` replicated."""
    arr = np.asarray(arr)
    if name == "state":
        return [np.ascontiguousarray(a) for a in np.split(arr, tp, axis=1)]
    if name == "conv":
        S, D, W = arr.shape
        parts = np.split(arr.reshape(S, 3, D // 3, W), tp, axis=2)
        return [np.ascontiguousarray(a.reshape(S, -1, W)) for a in parts]
    return [arr] * tp


def merge_pool(name: str, parts: list[np.ndarray]) -> np.ndarray:
    """Inverse of split_pool."""
    if name == "state":
        return np.concatenate(parts, 1)
    if name == "conv":
        S, _, W = parts[0].shape
        return np.concatenate([p.reshape(S, 3, -1, W) for p in parts], 2).reshape(S, -1, W)
    return parts[0]


def _np_dtype(s: str):
    return np.dtype(s)


def meta_from_entry(entry: dict) -> TensorMetadata:
    """Polygraphy TensorMetadata (name, numpy dtype, shape with dim names) of a graph's inputs from its index entry."""
    m = TensorMetadata()
    for i in entry["inputs"]:
        m.add(i["name"], _np_dtype(i["dtype"]), [d if isinstance(d, int) else -1 for d in i["shape"]])
    return m


class OrtModel:
    """An export directory run with ONNX Runtime (CPU), all ranks in-process. `pools[r][l][name]` numpy arrays."""

    def __init__(self, onnx_dir, providers=("CPUExecutionProvider",)):
        self.dir = Path(onnx_dir)
        p = self.dir / INDEX_NAME
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no index.json; export first (python -m k3deploy.export.onnx_export --out {self.dir})")
        self.index = json.loads(p.read_text())
        self.cfg: K3Config = load_config(self.index["config"])
        self.tp = self.index["tp"]
        self.providers = list(providers)
        self._sess: dict[str, ort.InferenceSession] = {}
        self.by_key: dict[tuple, list[dict]] = {}
        for g in self.index["graphs"]:
            self.by_key.setdefault((g["kind"], g["graph"], g["layer"], g["rank"]), []).append(g)
        for v in self.by_key.values():
            v.sort(key=lambda g: g["segment_index"])

    def session(self, entry: dict) -> ort.InferenceSession:
        if entry["id"] not in self._sess:
            so = ort.SessionOptions()
            # no spin-waiting: the PyTorch reference runs in the same process between ORT calls
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._sess[entry["id"]] = ort.InferenceSession(str(self.dir / entry["path"]), so, providers=self.providers)
        return self._sess[entry["id"]]

    def run(self, entry: dict, env: dict) -> dict:
        """Run one graph with the inputs named in its index entry taken from env (numpy arrays); returns {output name:
        array}. Raises KeyError naming inputs missing from env."""
        names = [i["name"] for i in entry["inputs"]]
        missing = [n for n in names if n not in env]
        if missing:
            raise KeyError(f"{entry['id']}: inputs {missing} not available")
        outs = self.session(entry).run(None, {n: env[n] for n in names})
        return dict(zip([o["name"] for o in entry["outputs"]], outs))

    def allocate_pools(self, num_slots: int, num_blocks: int, block_size: int) -> list[dict]:
        """Zeroed pools per rank as numpy arrays: [rank]{layer: {"state" [S,H/tp,K,K], "conv" [S,3P/tp,W-1]} | {"cache" [NB,BS,576]}}."""
        return [{l: {k: v.numpy() for k, v in d.items()} for l, d in
                 allocate_pools(self.cfg, num_slots, num_blocks, block_size, tp=self.tp).items()} for _ in range(self.tp)]

    def _stage(self, key_fn, envs: list[dict]) -> None:
        """Run one graph (all its segments) on every rank, doing the collectives between segments."""
        entries = [self.by_key[key_fn(r)] for r in range(self.tp)]
        for s in range(len(entries[0])):
            outs = [self.run(entries[r][s], envs[r]) for r in range(self.tp)]
            for r in range(self.tp):
                envs[r].update(outs[r])
            for c in entries[0][s]["collectives"]:
                parts = [o[c["output"]] for o in outs]
                val = sum(parts[1:], parts[0].copy()) if c["op"] == "all_reduce_sum" else np.concatenate(parts, -1)
                for r in range(self.tp):
                    envs[r][c["input"]] = val

    def forward(self, ids, batch: Batch, pools: list[dict], logits_index=None) -> tuple[np.ndarray, list[dict]]:
        """ids [T] -> (logits [T or len(logits_index), vocab] fp32, new pools per rank)."""
        meta = {k: np.asarray(getattr(batch, k), dtype=np.int32) for k in ("cu_seqlens", "slots", "block_tables",
                                                                         "context_lens") if getattr(batch, k) is not None}
        ids = np.asarray(ids, dtype=np.int32)
        envs = [{"ids": ids} for _ in range(self.tp)]
        self._stage(lambda r: ("embed", "any", None, r), envs)
        P, bank = envs[0]["P"], None
        g = "decode" if batch.decode else "prefill"
        new = [dict() for _ in range(self.tp)]
        for l in range(self.cfg.num_hidden_layers):
            lenvs = [{"P": P, **meta, **pools[r][l], **({"bank": bank} if bank is not None else {})} for r in range(self.tp)]
            self._stage(lambda r: ("layer", g, l, r), lenvs)
            P = lenvs[0]["P_out"]
            bank = lenvs[0].get("bank_out", bank)
            for r in range(self.tp):
                new[r][l] = {k: lenvs[r][k + "_out"] for k in pools[r][l]}
        idx = np.arange(len(ids), dtype=np.int32) if logits_index is None else np.asarray(logits_index, dtype=np.int32)
        henvs = [{"P": P, "bank": bank, "logits_index": idx} for _ in range(self.tp)]
        self._stage(lambda r: ("head", "any", None, r), henvs)
        return henvs[0]["logits"], new


# ---- scenario and captured inputs --------------------------------------------------------------------------------

@dataclasses.dataclass
class Step:
    ids: torch.Tensor
    batch: Batch
    pools: dict            # pools BEFORE the step (tp = 1 layout)
    layer_in: list         # per layer (P, bank) before the layer
    final: tuple           # (P, bank) before the head
    logits: torch.Tensor
    pools_out: dict


def _capture(model: K3Model, ids, batch: Batch, pools: dict) -> Step:
    P = model.embed(ids)
    bank = P.new_zeros(P.shape[0], 0, P.shape[1])
    rec, new = [], {}
    for l, layer in enumerate(model.layers):
        rec.append((P, bank))
        P, bank, new[l] = layer(P, bank, batch, pools[l], model.comm, model.ops)
    return Step(ids, batch, pools, rec, (P, bank), model.head(P, bank), new)


def scenario(model: K3Model, seed: int = 0) -> list[Step]:
    """prefill (lens 5, 3) -> captured prefill chunk continuing both (lens 4, 2) -> captured decode step.
    Slots [3, 1] and block tables [[5, 2, 9, 7], [4, 11, 1, 8]] (block size 4) are non-contiguous."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    pools = allocate_pools(cfg, num_slots=4, num_blocks=12, block_size=4)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    bt = torch.tensor([[5, 2, 9, 7], [4, 11, 1, 8]], dtype=torch.int32)
    V = cfg.vocab_size
    steps = []
    ctx = [0, 0]
    for lens, decode in (([5, 3], False), ([4, 2], False), ([1, 1], True)):
        ids = torch.randint(3, V, (sum(lens),), generator=g)
        cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
        batch = Batch(cu, slots, bt, torch.tensor(ctx, dtype=torch.int32), decode=decode)
        step = _capture(model, ids, batch, pools)
        steps.append(step)
        pools = step.pools_out
        ctx = [c + n for c, n in zip(ctx, lens)]
    return steps[1:]


def graph_feed(entry: dict, step: Step, cfg: K3Config) -> OrderedDict:
    """The feed dict of one rank-0, tp = 1 graph for a captured step."""
    names = [i["name"] for i in entry["inputs"]]
    b = step.batch
    env = {"cu_seqlens": b.cu_seqlens, "slots": b.slots, "block_tables": b.block_tables, "context_lens": b.context_lens,
           "ids": step.ids.int()}
    if entry["kind"] == "layer":
        P, bank = step.layer_in[entry["layer"]]
        env.update(P=P, bank=bank, **step.pools[entry["layer"]])
    elif entry["kind"] == "head":
        env.update(P=step.final[0], bank=step.final[1],
                   logits_index=torch.arange(step.ids.shape[0], dtype=torch.int32).flip(0))
    return OrderedDict((n, np.ascontiguousarray(env[n].numpy())) for n in names)


# ---- end-to-end runners ---------------------------------------------------------------------------------------

def _e2e_feed(step: Step) -> OrderedDict:
    b = step.batch
    d = OrderedDict(ids=step.ids.int().numpy(), cu_seqlens=b.cu_seqlens.numpy(), slots=b.slots.numpy(),
                    block_tables=b.block_tables.numpy(), context_lens=b.context_lens.numpy(),
                    decode=np.array([b.decode]))
    for l, pools in step.pools.items():
        for k, v in pools.items():
            d[f"layer{l}.{k}"] = v.numpy()
    return d


def _batch_from_feed(f) -> Batch:
    t = lambda k: torch.from_numpy(np.asarray(f[k]))  # noqa: E731
    return Batch(t("cu_seqlens"), t("slots"), t("block_tables"), t("context_lens"), decode=bool(np.asarray(f["decode"])[0]))


class TorchModelRunner(BaseRunner):
    """The whole reference model (tp = 1) as a Polygraphy runner: feeds `ids`, metadata, `decode`, and
    `layer{l}.{pool}`; outputs `logits` and `layer{l}.{pool}_out`."""

    def __init__(self, model: K3Model, meta: TensorMetadata):
        super().__init__(prefix="torch-model")
        self.model, self.meta = model, meta

    def activate_impl(self):
        pass

    def get_input_metadata_impl(self):
        return self.meta

    def infer_impl(self, feed):
        self.inference_time = 0.0
        L = self.model.cfg.num_hidden_layers
        pools = {l: {k.split(".")[1]: torch.from_numpy(np.asarray(v)) for k, v in feed.items() if k.startswith(f"layer{l}.")}
                 for l in range(L)}
        with torch.no_grad():
            logits, new = self.model.forward(torch.from_numpy(np.asarray(feed["ids"])).long(), _batch_from_feed(feed), pools)
        out = OrderedDict(logits=logits.numpy())
        for l in range(L):
            for k, v in new[l].items():
                out[f"layer{l}.{k}_out"] = v.numpy()
        return out

    def deactivate_impl(self):
        pass


class OrtModelRunner(TorchModelRunner):
    """The export directory (any tp) through OrtModel, same feeds/outputs as TorchModelRunner. For tp > 1 the KDA
    pools are split by heads per rank and the results concatenated back (MLA caches are replicated)."""

    def __init__(self, ortm: OrtModel, meta: TensorMetadata):
        BaseRunner.__init__(self, prefix="onnxrt-model")
        self.m, self.meta = ortm, meta

    def infer_impl(self, feed):
        self.inference_time = 0.0
        m, tp, L = self.m, self.m.tp, self.m.cfg.num_hidden_layers
        pools = [{l: {} for l in range(L)} for _ in range(tp)]
        for k, v in feed.items():
            if k.startswith("layer"):
                l, name = int(k[5:].split(".")[0]), k.split(".")[1]
                parts = split_pool(name, v, tp)
                for r in range(tp):
                    pools[r][l][name] = parts[r]
        logits, new = m.forward(feed["ids"], _batch_from_feed(feed), pools)
        out = OrderedDict(logits=logits)
        for l in range(L):
            for name in new[0][l]:
                out[f"layer{l}.{name}_out"] = merge_pool(name, [new[r][l][name] for r in range(tp)])
        return out


# ---- verification ------------------------------------------------------------------------------------------------

def _summarize(acc, names) -> dict:
    """Per output {max_abs, max_rel, passed} from an AccuracyResult of two runners (one iteration or more)."""
    out: dict = {}
    results = list(acc) if not hasattr(acc, "items") else [acc]   # AccuracyResults (list) or one AccuracyResult
    for ar in results:
        for it in (i for _, iters in ar.items() for i in iters):
            for n, r in it.items():
                e = out.setdefault(n, {"max_abs": 0.0, "max_rel": 0.0, "passed": True, "atol": _tol(n)[0], "rtol": _tol(n)[1]})
                e["max_abs"] = max(e["max_abs"], float(r.max_absdiff))
                e["max_rel"] = max(e["max_rel"], float(r.max_reldiff))
                e["passed"] = e["passed"] and bool(r)
    return out


@contextlib.contextmanager
def polygraphy_logging():
    """Polygraphy's global logger for one verification, following this module's logger: at DEBUG (`-v`) it prints
    its warnings; otherwise only its errors (mismatches, shape errors) and warnings outside the comparator.

    The comparator warns "Some values are 0. Will add a small epsilon ..." once per output whose expected values
    hold exact zeros (every pool's untouched rows and sentinels); `CompareFunc.simple` passes an element when
    |a-b| <= atol OR |a-b| <= rtol·|b|, so zeros are judged by atol and the note says nothing about the result. Its
    other warning, an output it skipped, becomes a failure in `compare` (the report lists it). Colours are off:
    Polygraphy prints "'colored' module is not installed" before its first message otherwise."""
    from polygraphy.logger import G_LOGGER
    quiet = {"": G_LOGGER.WARNING} if log.isEnabledFor(logging.DEBUG) else \
        {"": G_LOGGER.WARNING, "comparator/compare.py": G_LOGGER.ERROR}
    colors, G_LOGGER.colors = G_LOGGER.colors, False
    try:
        with G_LOGGER.verbosity(quiet):
            yield
    finally:
        G_LOGGER.colors = colors


def compare(runners, feeds, names) -> dict:
    """Comparator.run over the feed dicts, then compare_accuracy with the per-output tolerances of `names`.

    Returns:
        {"passed": bool, "outputs": {name: {max_abs, max_rel, passed, atol, rtol}}}, plus "not_compared": [names]
        (and passed False) when an output of `names` was missing from a runner's results."""
    with polygraphy_logging():
        res = Comparator.run(runners, data_loader=feeds)
        acc = Comparator.compare_accuracy(res, compare_func=compare_func(names))
    outs = _summarize(acc, names)
    result = {"passed": bool(acc) and all(o["passed"] for o in outs.values()), "outputs": outs}
    missing = [n for n in names if n not in outs]
    if missing:
        result.update(passed=False, not_compared=missing)
    return result


# grids of the vision checks: the graph's feeds are groups of equal length (as the runtime calls it), the end-to-end
# batch mixes lengths and frames (VISION.md §10.1's packed batch)
VISION_FEED_GRIDS = ([(1, 4, 6), (1, 6, 4)], [(1, 8, 8)], [(2, 2, 4), (2, 4, 2)])
VISION_E2E_GRIDS = [(1, 4, 6), (1, 8, 8), (4, 2, 2), (2, 6, 10), (1, 6, 4)]


def _vision_pixels(grids, seed: int, patch_dim: int) -> torch.Tensor:
    """Uniform [-1, 1) patches [L, patch_dim] (the normalized pixel range) for `grids`, seeded."""
    L = sum(t * h * w for t, h, w in grids)
    return torch.rand(L, patch_dim, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def vision_feeds(cfg: K3Config) -> list[OrderedDict]:
    """Feed dicts of the vision graph: one per VISION_FEED_GRIDS group (inputs of model.vision.graph_inputs)."""
    from k3deploy.model.vision import graph_inputs
    v = cfg.vision
    out = []
    for i, grids in enumerate(VISION_FEED_GRIDS):
        ins = graph_inputs(grids, _vision_pixels(grids, i, v.patch_dim), v)
        out.append(OrderedDict((k, np.ascontiguousarray(t.numpy())) for k, t in ins.items()))
    return out


class VisionRunner(BaseRunner):
    """The vision path on a packed batch as a Polygraphy runner: feeds `pixel_values` [L, 588] and `grid_thws`
    [S, 3]; output `features`. `fn(pixel_values, grid_thws) -> features` (the packed reference, or the graph run
    group by group through model.vision.encode_grouped)."""

    def __init__(self, fn, name: str):
        super().__init__(prefix=name)
        self.fn = fn

    def activate_impl(self):
        pass

    def get_input_metadata_impl(self):
        return TensorMetadata().add("pixel_values", np.float32, [-1, -1]).add("grid_thws", np.int64, [-1, 3])

    def infer_impl(self, feed):
        self.inference_time = 0.0
        with torch.no_grad():
            out = self.fn(torch.from_numpy(np.asarray(feed["pixel_values"])), torch.from_numpy(np.asarray(feed["grid_thws"])))
        return OrderedDict(features=np.asarray(out.float()))

    def deactivate_impl(self):
        pass


def verify_code_hash() -> str:
    """sha256 of this verifier's source: part of the key under which a graph's earlier result is reused."""
    return code_hash(("export/verify.py",))


def verify(onnx_dir, checkpoint, report_path=None, polygraphy_data=None, end_to_end: bool = True,
           previous: dict | None = None) -> dict:
    """Compare every rank-0 graph (tp == 1 exports; the vision graph on every rank) and the whole model against the
    PyTorch reference. previous: an earlier report (see the module docstring). Returns the report dict (written to
    report_path as JSON when given). Raises ValueError when the export's config hash differs from the
    checkpoint's."""
    with polygraphy_logging():
        return _verify(onnx_dir, checkpoint, report_path, polygraphy_data, end_to_end, previous)


def _verify(onnx_dir, checkpoint, report_path, polygraphy_data, end_to_end: bool, previous) -> dict:
    src = WeightSource.from_checkpoint(checkpoint)
    cfg = src.cfg
    ortm = OrtModel(onnx_dir)
    if ortm.index["config_hash"] != cfg.config_hash():
        raise ValueError(f"--onnx-dir {onnx_dir}: config_hash {ortm.index['config_hash']} != checkpoint's "
                         f"{cfg.config_hash()}; export this checkpoint again")
    model = K3Model.from_checkpoint(checkpoint, ops=ReferenceOps)
    steps = {"prefill": [], "decode": []}
    for s in scenario(model):
        steps["decode" if s.batch.decode else "prefill"].append(s)
    vcode = verify_code_hash()
    report: dict = {"onnx_dir": str(onnx_dir), "config_hash": cfg.config_hash(), "tp": ortm.tp, "verify_code": vcode,
                    "tolerances": {k: {"atol": a, "rtol": r} for k, (a, r) in TOLERANCES.items()}, "graphs": {}}
    old = (previous or {}).get("graphs", {}) if (previous or {}).get("verify_code") == vcode else {}
    entries = [e for e in ortm.index["graphs"] if ortm.tp == 1 or e["kind"] == "vision"]
    if ortm.tp > 1:
        log.info("tp = %d: per-graph comparison of the text graphs skipped (segments need the collectives); "
                 "end to end only", ortm.tp)
    from tqdm import tqdm
    for entry in tqdm(entries, desc="verify", unit="graph"):
        prev = old.get(entry["id"])
        if prev and prev.get("passed") and prev.get("input_hash") == entry.get("input_hash") and polygraphy_data is None:
            report["graphs"][entry["id"]] = {**prev, "reused": True}
            continue
        spec = GraphSpec(entry["kind"], entry["graph"], entry["layer"], entry["segment"], entry["segment_index"],
                         entry["num_segments"], entry["rank"], entry["tp_size"], entry["ep_size"])
        module, _, _ = build_graph(src, spec, ops=ReferenceOps)
        ref = TorchReferenceRunner(module, meta_from_entry(entry))
        onx = OnnxrtRunner(lambda e=entry: ortm.session(e), name="onnxrt")
        if entry["kind"] == "vision":
            feeds = vision_feeds(cfg)
        else:
            use = steps["decode"] if entry["graph"] == "decode" else steps["prefill"]
            if entry["graph"] == "any":
                use = steps["prefill"] + steps["decode"]
            feeds = [graph_feed(entry, s, cfg) for s in use]
        names = [o["name"] for o in entry["outputs"]]
        r = compare([ref, onx], feeds, names)
        r["input_hash"] = entry.get("input_hash")
        report["graphs"][entry["id"]] = r
        if r["passed"]:
            log.debug("%s: PASS", entry["id"])
        else:
            log.warning("%s: FAIL (%s)", entry["id"], ", ".join(
                [n for n, o in r["outputs"].items() if not o["passed"]] + r.get("not_compared", [])))
        if polygraphy_data is not None:
            write_polygraphy_data(Path(polygraphy_data), entry, ref, feeds)
    if cfg.vision is not None:
        report["vision_end_to_end"] = verify_vision(src, ortm)
    if end_to_end:
        all_steps = steps["prefill"] + steps["decode"]
        feeds = [_e2e_feed(s) for s in all_steps]
        meta = TensorMetadata()
        for k, v in feeds[0].items():
            meta.add(k, v.dtype, [-1] * v.ndim)   # shapes differ between prefill and decode feeds
        names = ["logits"] + [f"layer{l}.{k}_out" for l in range(cfg.num_hidden_layers) for k in all_steps[0].pools[l]]
        report["end_to_end"] = compare([TorchModelRunner(model, meta), OrtModelRunner(ortm, meta)], feeds, names)
    report["passed"] = (all(g["passed"] for g in report["graphs"].values())
                        and all(report.get(k, {}).get("passed", True) for k in ("end_to_end", "vision_end_to_end")))
    if report_path is not None:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(report, indent=1))
    return report


def verify_vision(src: WeightSource, ortm: OrtModel) -> dict:
    """The packed fp32 reference vs rank 0's vision graph run group by group (model.vision.encode_grouped) on
    VISION_E2E_GRIDS; the comparison dict of `compare` (output `features`)."""
    from k3deploy.model.vision import encode_grouped
    v = src.cfg.vision
    entry = ortm.by_key[("vision", "any", None, 0)][0]
    vm = src.vision()

    def graph(px, grids):
        def call(ins):
            return torch.from_numpy(ortm.run(entry, {k: np.ascontiguousarray(t.numpy()) for k, t in ins.items()})["features"])
        return encode_grouped(px, grids, v, call)
    feed = OrderedDict(pixel_values=_vision_pixels(VISION_E2E_GRIDS, 7, v.patch_dim).numpy(),
                       grid_thws=np.asarray(VISION_E2E_GRIDS, dtype=np.int64))
    return compare([VisionRunner(vm.reference, "torch-vision-reference"), VisionRunner(graph, "onnxrt-vision")],
                   [feed], ["features"])


def write_polygraphy_data(out: Path, entry: dict, ref: TorchReferenceRunner, feeds: list) -> tuple[Path, Path]:
    """Write `<id>.inputs.json` (list of feed dicts) and `<id>.outputs.json` (RunResults of the reference runner)."""
    base = out / entry["id"]
    base.parent.mkdir(parents=True, exist_ok=True)
    inp, outp = Path(str(base) + ".inputs.json"), Path(str(base) + ".outputs.json")
    save_json(list(feeds), str(inp))
    with ref:
        iters = [IterationResult(ref.infer(f), runner_name=ref.name) for f in feeds]
    rr = RunResults()
    rr.append((ref.name, iters))
    rr.save(str(outp))
    return inp, outp


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog or "python -m k3deploy.export.verify",
                                 description="Compare an ONNX export against the PyTorch reference with Polygraphy.")
    ap.add_argument("--onnx-dir", required=True, type=Path, help="export directory (index.json)")
    ap.add_argument("--checkpoint", required=True, type=Path, help="checkpoint the export was made from")
    ap.add_argument("--report", type=Path, default=None, help="report JSON path (default ONNX_DIR/verify_report.json)")
    ap.add_argument("--write-polygraphy-data", type=Path, default=None, metavar="DIR",
                    help="write <graph id>.inputs.json / .outputs.json for `polygraphy run --load-inputs/--load-outputs`")
    ap.add_argument("--no-end-to-end", action="store_true", help="skip the whole-model comparison")
    ap.add_argument("--log-level", default="INFO", help="logging level: DEBUG, INFO, WARNING, ERROR (default INFO)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    rep = verify(a.onnx_dir, a.checkpoint, a.report or a.onnx_dir / "verify_report.json", a.write_polygraphy_data,
                 end_to_end=not a.no_end_to_end)
    extra = [(k, rep[k]) for k in ("end_to_end", "vision_end_to_end") if k in rep]
    for gid, g in list(rep["graphs"].items()) + extra:
        worst = max(g["outputs"].values(), key=lambda o: o["max_abs"], default={"max_abs": 0, "max_rel": 0})
        log.info("%-32s %s  worst max_abs %.3g", gid, "PASS" if g["passed"] else "FAIL", worst["max_abs"])
    if a.write_polygraphy_data:
        log.info("check one graph: polygraphy run %s/<id>.onnx --onnxrt --load-inputs %s/<id>.inputs.json "
                 "--load-outputs %s/<id>.outputs.json --atol %g --rtol %g", a.onnx_dir, a.write_polygraphy_data,
                 a.write_polygraphy_data, CLI_ATOL, CLI_RTOL)
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
