"""Executors: run one packed forward layer by layer on a backend.

Common interface (what `runtime.scheduler.Scheduler` calls)::

    logits, pools = executor.forward(ids, batch, pools, logits_index)
    logits, pools = executor.forward(ids, batch, pools, logits_index, image_rows=(positions, rows))   # prefill
    features = executor.encode_images(pixel_values, grid_thws)     # models with a vision tower (VISION.md §8.3)

ids [T] int64 packed tokens; batch: `model.reference.Batch` (decode=True: one token per sequence, decode graphs);
pools: {layer: {"state", "conv"} | {"cache"}} as allocated by `runtime.cache.HybridCache` (slot 0 / block 0
sentinels); logits_index [M] int64 rows whose logits are wanted. Returns logits [M, vocab] fp32 and the updated
pools (new tensors or the same ones updated in place; the caller writes them back either way). A prefill batch may
carry `batch.kda_snapshot` (`model.reference.KdaSnapshot`: KDA states copied into prefix-cache snapshot rows at
positions inside the step): the torch backend copies them inside each KDA layer, the graph backends run the batch
as one forward per snapshot round (`Executor.forward_in_rounds`).

Backends:
* `TorchExecutor`: `model.reference.K3Model` on the CPU (fp32 reference ops) or on a CUDA GPU (fp32 weights and
  activations, the five custom ops as Triton kernels: `ops="torch"` the torch.library ops, `ops="kernels"` the
  kernels in place with each layer's glue fused (`runtime.fused.FusedModel`), `ops="kernels-unfused"` the same
  kernels inside K3Model's own layer code, `ops="reference"` the fp32 references on the GPU for debugging); TP > 1
  as one process per rank (SPMD). Logits come back on the executor's device.
* `OnnxRuntimeExecutor`: the per-layer graphs of an export directory (docs/EXPORT_FORMAT.md, index.json), one
  `onnxruntime.InferenceSession` per graph; pools are passed in as inputs and the `*_out` outputs taken back.
  tp > 1: the rank's segments with the collectives between them (SPMD, one process per rank).
* `TensorRTExecutor`: the per-layer engines of an engine directory (engines/ `manifest.json`), name-based I/O,
  pool outputs bound to the pool input buffers (in place). Needs full TensorRT, the `kimi` plugins and a CUDA GPU;
  it cannot run on a machine without them and raises ImportError / RuntimeError saying so.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from k3deploy.model.config import K3Config, load_config
from k3deploy.model.reference import Batch, K3Model
from k3deploy.plugins.workspace import WORKSPACE_RULES, workspace_rules_of

log = logging.getLogger(__name__)


OPS = ("reference", "torch", "kernels", "kernels-unfused")
KERNEL_OPS = ("torch", "kernels", "kernels-unfused")       # the names that run the Triton kernels


def resolve_ops(ops, device: torch.device) -> tuple[str, object]:
    """(name, ops class) for `ops` = None | "reference" | "torch" | "kernels" | "kernels-unfused" | an ops class on
    `device`. None = "reference" on the CPU, "torch" on CUDA. "kernels" and "kernels-unfused" both give
    `KernelOps` (the executor fuses the glue around them for "kernels"). Raises ValueError for an unknown name or
    the in-place kernels on the CPU (the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1)."""
    import os
    if ops is not None and not isinstance(ops, str):
        return ops_name(ops), ops
    name = ops or ("torch" if device.type == "cuda" else "reference")
    if name not in OPS:
        raise ValueError(f"ops = {ops!r}: choose {', '.join(map(repr, OPS))}")
    if name == "reference":
        from k3deploy.model.reference import ReferenceOps
        return name, ReferenceOps
    if name.startswith("kernels") and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"ops = {name!r}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1); "
                         "use ops 'reference' or 'torch' on the CPU")
    from k3deploy.plugins.torch_ops import KernelOps, TorchOps
    return name, TorchOps if name == "torch" else KernelOps


def ops_name(ops) -> str:
    """"reference" / "torch" / "kernels" for ReferenceOps / TorchOps / KernelOps, else the class name."""
    n = getattr(ops, "__name__", type(ops).__name__)
    return {"ReferenceOps": "reference", "TorchOps": "torch", "KernelOps": "kernels"}.get(n, n)


def check_block_size(block_size: int, device: torch.device, ops_name: str) -> None:
    """Raise ValueError when the latent block size cannot run on the GPU MLA decode kernel (CUDA with the "torch"
    or "kernels" ops needs a multiple of 16 tokens: its tl.dot tiles never straddle two paged blocks)."""
    if device.type == "cuda" and ops_name in KERNEL_OPS and block_size % 16:
        raise ValueError(f"block_size = {block_size}: the GPU MLA decode kernel needs latent blocks of a multiple of "
                         f"16 tokens (16, 32, 64, ...); the runtime default there is {GPU_BLOCK_SIZE}")


GPU_BLOCK_SIZE = 64     # latent tokens per block for the CUDA kernels (the MLA key tile never straddles two blocks)
CPU_BLOCK_SIZE = 16     # elsewhere: finer paging, no kernel to feed


def preferred_block_size(device: torch.device, ops_name: str) -> int:
    """Latent block size (tokens) the runtime allocates when the caller gives none: 64 on CUDA with the "torch" /
    "kernels" ops — the MLA decode and prefill tiles take at most one block's keys, so 16-token blocks cap them at
    16 keys (FlashMLA takes 64 too) —, 16 elsewhere (the CPU references)."""
    return GPU_BLOCK_SIZE if device.type == "cuda" and ops_name in KERNEL_OPS else CPU_BLOCK_SIZE


POOL_DIMS = ("S", "NB", "BS", "MB", "M")    # KDA slots, latent blocks, tokens per block, block-table width, tokens


def check_workspace_rules(manifest: dict, where: str = "manifest.json") -> None:
    """ValueError unless the engines' plugin workspaces were sized by this code's rules (`manifest["workspace_rules"]`,
    1 when absent, against plugins.workspace.WORKSPACE_RULES): a plugin's enqueue carves its scratch by the running
    rules out of the bytes TensorRT reserved at build time, so older engines could be written past their workspace."""
    got = workspace_rules_of(manifest)
    if got != WORKSPACE_RULES:
        raise ValueError(f"{where}: engines built with plugin workspace rules {got}, this k3deploy uses "
                         f"{WORKSPACE_RULES} (the kimi plugins' scratch sizes changed); rebuild the engines: "
                         "python export/build_engines.py (or python -m k3deploy.engines.build)")


def engine_pool_dims(manifest: dict, where: str = "manifest.json") -> dict[str, tuple[int, int]]:
    """{dim: (lo, hi)} of the dims S, NB, BS, MB, M that every optimization profile of an engine directory takes
    (`manifest["profile_dims"]`, the named-dim (min, opt, max) ranges engines/build.py recorded; export/
    build_engines.py fixes S = max_batch + 1, NB, BS and caps MB <= ceil(max_context / BS) and the tokens of a step
    M <= max_num_tokens). {} for manifests without
    them (built before they were recorded). ValueError naming the dim when the profiles share no value."""
    out: dict[str, tuple[int, int]] = {}
    for prof in manifest.get("profile_dims") or []:
        for name in POOL_DIMS:
            if name in prof:
                mn, _, mx = (int(v) for v in prof[name])
                lo, hi = out.get(name, (mn, mx))
                out[name] = (max(lo, mn), min(hi, mx))
    for name, (lo, hi) in out.items():
        if lo > hi:
            raise ValueError(f"{where}: the engines' profiles share no value of {name}; rebuild them with one "
                             f"{'--block-size' if name == 'BS' else 'set of pool sizes'}")
    return out


class Executor:
    """Base class: `cfg` (K3Config), `tp`, `act_dtype` of the pools it expects, `device` they live on."""

    cfg: K3Config
    tp: int = 1
    act_dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    ops_name: str = "graph"

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError when this executor cannot use latent blocks of `block_size` tokens."""
        check_block_size(block_size, self.device, self.ops_name)

    def preferred_block_size(self) -> int:
        """Latent block size (tokens) for a cache when the caller gives none (`preferred_block_size`)."""
        return preferred_block_size(self.device, self.ops_name)

    def default_max_context(self) -> int | None:
        """Tokens per request this executor is built for (engines fix it), or None (the config's limit)."""
        return None

    def default_max_batch(self) -> int | None:
        """Requests per step this executor is built for (engines fix it), or None (the runtime's default)."""
        return None

    def default_num_blocks(self) -> int | None:
        """Latent blocks this executor's pools must have (engines fix it), or None (sized from max_context)."""
        return None

    def default_max_num_tokens(self) -> int | None:
        """Tokens per step this executor is built for (engines cap it), or None (the runtime's default)."""
        return None

    def check_cache(self, num_slots: int, num_blocks: int, max_blocks: int, max_batch: int | None = None,
                    max_num_tokens: int | None = None) -> None:
        """Raise ValueError when this executor cannot run pools of these sizes or these limits (engines fix them);
        here: any."""

    def forward(self, ids: torch.Tensor, batch: Batch, pools: dict, logits_index: torch.Tensor, image_rows=None):
        """ids [T] int64 packed tokens, batch (`model.reference.Batch`), pools {layer: {name: tensor}},
        logits_index [M] int64, image_rows None or (positions [n] int64, rows [n, d]) -> (logits [M, vocab] fp32,
        updated pools). ValueError for an invalid batch."""
        raise NotImplementedError

    overlap_decode: bool = False        # the scheduler overlaps decode steps with its host work by default

    forward_on_device = None            # executors that enqueue a decode forward without host reads define it

    def forward_in_rounds(self, ids: torch.Tensor, batch: Batch, pools: dict, logits_index: torch.Tensor,
                          image_rows=None):
        """`forward` of a prefill batch with `batch.kda_snapshot`, for a forward that cannot copy a state from inside
        itself: one forward per snapshot round (`model.reference.SnapshotRound`: each piece continues its sequence's
        cache from where the previous round left it), the KDA states saved into the snapshot rows after each round.
        Arguments, returns and errors as `forward`; no content span crosses a snapshot offset (the scheduler places
        none inside one), so every image row lies in one round."""
        snap = batch.kda_snapshot
        where = {}                                     # packed row -> (round, row in that round)
        for j, rnd in enumerate(snap.rounds):
            where.update((g, (j, i)) for i, g in enumerate(rnd.tokens.tolist()))
        index = [where[g] for g in logits_index.tolist()]
        images = [] if image_rows is None else [where[g] for g in image_rows[0].tolist()]
        kda = [l for l in pools if "state" in pools[l]]
        out = None
        for j, rnd in enumerate(snap.rounds):
            want = [k for k, (r, _) in enumerate(index) if r == j]
            local = [index[k][1] for k in want] or [int(rnd.cu[-1]) - 1]      # a forward wants one logits row
            rows = None
            keep = [k for k, (r, _) in enumerate(images) if r == j]
            if keep:
                rows = (torch.tensor([images[k][1] for k in keep], dtype=torch.long), image_rows[1][keep])
            seqs = rnd.seqs.to(batch.slots.device)
            sub = Batch(rnd.cu.to(batch.cu_seqlens.device), batch.slots[seqs], batch.block_tables[seqs],
                        batch.context_lens[seqs] + rnd.starts.to(batch.context_lens.device))
            logits, pools = self.forward(rnd.take(ids), sub, pools,
                                         torch.tensor(local, dtype=torch.long, device=logits_index.device), rows)
            snap.save(rnd, pools, batch.slots, kda)
            if out is None:
                out = logits.new_empty(len(index), logits.shape[1])
            if want:
                out[torch.tensor(want, device=out.device)] = logits
        return out, pools

    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """Images packed end to end (pixel_values [L, 3, p, p] fp32, grid_thws [S, 3]) -> features [N, d] (VISION.md
        §2-§6), one tower run for all of them. ValueError when the model has no vision tower or a grid is bad."""
        raise ValueError("images: this model has no vision tower (config.json has no vision_config)")

    def max_image_patches(self) -> int | None:
        """Patches one image may take on this executor (a vision engine's profile), None when unbounded."""
        return None

    def close(self) -> None:
        """Release backend resources (sessions, engines)."""


class TorchExecutor(Executor):
    """The PyTorch model (`model.reference.K3Model`). `model` is a loaded K3Model (used on its own device; `ops`
    replaces its ops when given) or a checkpoint directory, loaded onto `device`.

    device: "cpu" (default), "cuda" (cuda:LOCAL_RANK under torchrun) or "cuda:N" (runtime.distributed.
    resolve_device). ops: "reference" (fp32 references; the CPU default), "torch" (torch.library ops = Triton
    kernels on CUDA; the CUDA default), "kernels" (the CUDA kernels called directly, pools updated in place:
    no per-call pool copy; each layer's glue fused: runtime.fused), "kernels-unfused" (the same kernels in K3Model's
    layer code: the glue as separate torch ops, for A/B comparisons), or an ops class. On CUDA the dense weights are fp32 on the GPU (MXFP4 experts stay
    packed uint8) and the kernels use bf16/TF32 internally where their tests say so; the pools must be on
    `self.device` (HybridCache(..., device=executor.device)). dense_dtype: "bfloat16" keeps the dense weights
    (projections, embedding, lm_head) in bf16 and runs those GEMMs in bf16 (K3Model; default fp32); `act_dtype`, the
    dtype of the KDA conv history and MLA latent cache pools it expects, follows it (MODEL.md §9: the model dtype;
    the KDA recurrent state stays fp32), except for ops "kernels" on the CPU: the Triton interpreter (3.9)
    computes bf16 `tl.dot` wrongly (MLA decode off by ~1e9), so fp32 pools there.

    With tp > 1 this process is TP rank `rank` of an initialized torch.distributed group of tp processes (gloo on
    CPU, NCCL on GPU; see runtime/distributed.py): it loads its shard and the model's RowLinear / latent
    reductions all-reduce over the group. Every rank runs the same scheduler on the same requests (SPMD) and gets
    the same all-gathered logits. profile_comm: count and time the collectives (model.layers.Comm.stats()).
    Raises ValueError for a bad device, ops name or dense_dtype, or when the group does not match tp, RuntimeError
    when CUDA is asked for and absent, CheckpointError for a bad checkpoint."""

    def __init__(self, model: "K3Model | str | Path", tp: int = 1, ep: int = 1, rank: int = 0, *,
                 device: "str | torch.device | None" = None, ops=None, profile_comm: bool = False,
                 dense_dtype: "str | torch.dtype | None" = None, vision=None):
        from k3deploy.runtime.distributed import resolve_device
        self.vision = vision
        if isinstance(model, K3Model):
            from k3deploy.model.layers import dense_dtype as dense_dtype_of
            if dense_dtype is not None and (dense_dtype_of(dense_dtype) or torch.float32) != model.dense_dtype:
                raise ValueError(f"dense_dtype = {dense_dtype!r}: the model passed in holds {model.dense_dtype} "
                                 "dense weights; give dense_dtype when loading it (K3Model.from_checkpoint / "
                                 "from_synthetic)")
            self.model = model
            if device is not None and resolve_device(device) != model.device:
                raise ValueError(f"device = {str(device)!r}: the model passed in lives on {model.device}")
            self.device = model.device
            if ops is not None:
                self.ops_name, self.model.ops = resolve_ops(ops, self.device)
            else:
                self.ops_name = ops_name(model.ops)
        else:
            from k3deploy.model.layers import Comm
            self.device = resolve_device(device)
            self.ops_name, ops_cls = resolve_ops(ops, self.device)
            comm = None
            if tp > 1:
                from k3deploy.runtime.distributed import check_group
                check_group(tp, rank)
                comm = Comm(rank, tp)
            self.model = K3Model.from_checkpoint(model, rank=rank, tp=tp, ep=ep, comm=comm, ops=ops_cls,
                                                 device=self.device, dense_dtype=dense_dtype)
            if self.model.cfg.vision is not None:
                from k3deploy.model.vision import VisionModel
                vdt = torch.bfloat16 if self.device.type == "cuda" else torch.float32
                self.vision = VisionModel.from_checkpoint(model, dtype=vdt, device=self.device)
        if self.vision is not None:
            self.vision.warmup()                       # compiles a CUDA tower now, not at the first image
        if profile_comm:
            self.model.comm.profile = True
        self.cfg, self.tp, self.rank = self.model.cfg, self.model.comm.size, self.model.comm.rank
        self.act_dtype = self.model.dense_dtype        # the pools' conv history and latent cache: the model dtype
        if self.device.type != "cuda" and self.ops_name.startswith("kernels"):
            self.act_dtype = torch.float32             # the Triton interpreter's bf16 tl.dot is wrong (Triton 3.9)
        self.runner = self.model                       # what forward runs: K3Model, or its fused-glue form
        if self.ops_name == "kernels":
            from k3deploy.runtime.fused import FusedModel
            self.runner = FusedModel.of(self.model)
        if self.device.type == "cuda":
            log.info("torch executor on %s, ops %s, tp %d rank %d", self.device, self.ops_name, self.tp, self.rank)

    @property
    def comm(self):
        """The model's `model.layers.Comm` (collective counters: `comm.stats()` when profiling)."""
        return self.model.comm

    graphs = None

    def enable_cuda_graphs(self, pools: dict, max_batch: int, max_blocks: int, *, capture: bool = True):
        """Capture the decode step in CUDA graphs (runtime.graphs.DecodeGraphs: one per batch bucket up to
        max_batch, block tables max_blocks wide, the cache's `pools` by address); decode forwards replay them from
        then on. Needs ops "kernels" on CUDA (capture=False: the same padded path run eagerly, any device).
        Collective timing (`comm.profile`) does not see replayed collectives. Raises ValueError otherwise."""
        from k3deploy.runtime.graphs import DecodeGraphs
        if self.comm.profile:
            raise ValueError("profile_comm and CUDA graphs exclude each other (a replay runs no Python); "
                             "time the graphs' collectives with a kernel profile instead")
        self.close()                                        # graphs captured before (other pools or sizes)
        self.graphs = DecodeGraphs(self.runner, pools, max_batch, max_blocks, capture=capture)
        return self.graphs

    def close(self) -> None:
        """Release the CUDA graphs (before the process group is destroyed)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def forward(self, ids, batch, pools, logits_index, image_rows=None):
        """See `Executor.forward`; logits [M, vocab] fp32 on `self.device`. Decode batches replay the CUDA graphs
        when `enable_cuda_graphs` was called."""
        # the scheduler may run in another thread (AsyncEngine): Triton launches on the *current* CUDA device
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            if self.graphs is not None and batch.decode:
                self.model.check_ids(ids)
                return self.graphs.forward(ids, batch, pools, logits_index)
            with torch.no_grad():
                return self.runner.forward(ids, batch, pools, logits_index, image_rows=image_rows)

    @property
    def overlap_decode(self) -> bool:
        """Whether the scheduler overlaps decode steps with its host work by default (runtime/pipeline.py): on CUDA
        with the in-place kernels (ops "kernels" / "kernels-unfused")."""
        return self.device.type == "cuda" and self.ops_name in ("kernels", "kernels-unfused")

    def forward_on_device(self, ids, batch, pools, logits_index):
        """A decode forward whose inputs are on `self.device` already, enqueued without host reads or syncs (the
        overlapped decode of runtime/pipeline.py): ids [B] int64 produced on the device (not validated), batch
        (decode=True, int32 metadata on the device), logits_index [M] int64 on the device or None (every row). The
        decode graphs when enabled (logits_index None: a view of the graph's output, valid until its next replay),
        else the runner's `forward_on_device`. Returns (logits [M, vocab] fp32 on the device, pools)."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            if self.graphs is not None and batch.decode:
                return self.graphs.forward(ids, batch, pools, logits_index)
            with torch.no_grad():
                return self.runner.forward_on_device(ids, batch, pools, logits_index)

    def encode_images(self, pixel_values, grid_thws):
        """See `Executor.encode_images`; features in the tower's dtype on `self.device`."""
        if self.vision is None:
            if self.cfg.vision is not None:
                raise ValueError("images: this executor holds the text model only; pass TorchExecutor(model, "
                                 "vision=model.vision.VisionModel...) or load it from the checkpoint directory")
            return super().encode_images(pixel_values, grid_thws)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            with torch.no_grad():
                return self.vision.forward(pixel_values.to(self.device), grid_thws)


# ---- onnxruntime ------------------------------------------------------------------------------------------

def read_index(onnx_dir: "str | Path") -> dict:
    """index.json of an export directory. Raises FileNotFoundError (no index: export incomplete) or ValueError
    (wrong format/version)."""
    p = Path(onnx_dir) / "index.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: missing; the ONNX export is incomplete or {onnx_dir} is not an export directory "
                                "(run python -m k3deploy.export.onnx_export --checkpoint CKPT --out DIR)")
    index = json.loads(p.read_text())
    if index.get("format") != "k3deploy.onnx" or index.get("format_version") != 1:
        raise ValueError(f"{p}: format {index.get('format')!r} version {index.get('format_version')!r}; "
                         "this runtime reads k3deploy.onnx version 1 (docs/EXPORT_FORMAT.md)")
    return index


_NP = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64}


class GraphExecutor(Executor):
    """Shared driver of the exported graphs (docs/EXPORT_FORMAT.md): embed -> every layer's prefill or decode graph
    -> head, threading P, the AttnRes bank and the pools. A graph is one or more segments (tp > 1: split at the
    collectives); `_stage` runs them in order and performs each segment's `collectives` (index.json) over the
    initialized torch.distributed group between them (SPMD, one process per rank). Subclasses load rank `rank`'s
    graphs with `_init_segments` and run one segment in `_run(g, env)`."""

    comm = None
    rank = 0

    def _init_segments(self, index: dict, rank: int, where: str) -> dict[tuple, list[dict]]:
        """{graph key: [segment dicts of rank `rank`, in order]}; joins the process group when tp > 1.
        ValueError when a graph is missing or the group does not match the export's tp."""
        self.tp, self.rank = int(index.get("tp", 1)), rank
        if self.tp > 1:
            from k3deploy.model.layers import Comm
            from k3deploy.runtime.distributed import check_group
            check_group(self.tp, rank)
            self.comm = Comm(rank, self.tp)
        segments: dict[tuple, list[dict]] = {}
        for g in index["graphs"]:
            if g.get("rank", 0) == rank:
                key = ("layer", g["layer"], g["graph"]) if g["kind"] == "layer" else (g["kind"],)
                segments.setdefault(key, []).append(g)
        for v in segments.values():
            v.sort(key=lambda g: g.get("segment_index", 0))
        missing = [k for k in [("embed",), ("head",)] + [("layer", l, m) for l in range(self.cfg.num_hidden_layers)
                                                            for m in ("prefill", "decode")] if k not in segments]
        if missing:
            raise ValueError(f"{where}: rank {rank} graphs {missing[:4]} missing; re-export / rebuild")
        return segments

    def _run(self, g: dict, env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run one segment `g` (an index.json graph entry) on `env` -> its outputs by name."""
        raise NotImplementedError

    def _stage(self, key: tuple, env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run every segment of one graph in order, doing its collectives (tp > 1) between segments."""
        for g in self.segments[key]:
            out = self._run(g, env)
            env.update(out)
            for c in g.get("collectives", []):
                t = out[c["output"]]
                env[c["input"]] = (self.comm.all_reduce(t.clone()) if c["op"] == "all_reduce_sum"
                                   else self.comm.all_gather_last(t))
        return env

    def encode_images(self, pixel_values, grid_thws):
        """See `Executor.encode_images`: the vision graph once per group of equal-length images
        (model.vision.encode_grouped); features fp32."""
        from k3deploy.model.vision import encode_grouped
        seg = self.segments.get(("vision",))
        if seg is None:
            if self.cfg.vision is not None:
                raise ValueError("images: the export has no vision graph; export the checkpoint again")
            return super().encode_images(pixel_values, grid_thws)
        return encode_grouped(pixel_values, grid_thws, self.cfg.vision, lambda ins: self._run(seg[0], ins)["features"],
                              self.vision_segments_per_call)

    def vision_segments_per_call(self, length: int) -> int:
        """Segments of `length` patches one vision call may hold (engines: their profiles'; here unbounded)."""
        return 1 << 30

    def forward(self, ids, batch, pools, logits_index, image_rows=None):
        """ids [T] int64, batch (model.reference.Batch), pools (per layer), image_rows -> (logits [M, vocab] fp32 on
        the CPU, new pools). The graphs' function bodies cannot raise, so the batch is validated here: ValueError for
        a zero-length sequence or offsets that do not cover the T tokens. A `batch.kda_snapshot` runs as one forward
        per snapshot round (`forward_in_rounds`)."""
        from k3deploy.plugins.kda.reference import check_cu_seqlens
        if batch.kda_snapshot is not None:
            return self.forward_in_rounds(ids, batch, pools, logits_index, image_rows)
        if not batch.decode:
            check_cu_seqlens(batch.cu_seqlens, int(ids.shape[0]))
        meta = {"cu_seqlens": batch.cu_seqlens, "slots": batch.slots, "block_tables": batch.block_tables,
                "context_lens": batch.context_lens}
        P = self._stage(("embed",), {"ids": ids})["P"]
        if image_rows is not None:      # the image rows replace the embedding before layer 0 (VISION.md §8.3)
            P = P.index_put((image_rows[0].to(P.device),), image_rows[1].to(P.device, P.dtype))
        bank = P.new_zeros(P.shape[0], 0, P.shape[1])
        kind = "decode" if batch.decode else "prefill"
        new = {}
        for l in range(self.cfg.num_hidden_layers):
            env = self._stage(("layer", l, kind), {"P": P, "bank": bank, **meta, **pools[l]})
            P, bank = env["P_out"], env.get("bank_out", bank)
            new[l] = {name: env[name + "_out"] for name in pools[l]}
        logits = self._stage(("head",), {"P": P, "bank": bank, "logits_index": logits_index})["logits"]
        return logits.float().cpu(), new


class OnnxRuntimeExecutor(GraphExecutor):
    """Runs rank `rank`'s graphs of an export directory with onnxruntime (CPU provider by default).

    tp == 1 exports hold one graph per layer; tp > 1 exports hold segments whose `collectives` (index.json) this
    executor performs over the initialized torch.distributed group (sum all-reduce of `*_partial`, all-gather of
    `logits_shard`), SPMD like the torch executor. Raises FileNotFoundError/ValueError for a missing or foreign
    index.json or a group that does not match the export's tp, ImportError when onnxruntime is not installed.
    """

    def __init__(self, onnx_dir: "str | Path", providers: list[str] | None = None, threads: int | None = None,
                 rank: int = 0):
        import onnxruntime as ort
        self.dir = Path(onnx_dir)
        self.index = read_index(self.dir)
        self.cfg = load_config(self.index["config"])
        if self.index.get("config_hash") not in (None, self.cfg.config_hash()):
            raise ValueError(f"{self.dir}/index.json: config_hash {self.index['config_hash']} does not match its config "
                             f"({self.cfg.config_hash()}); re-export")
        self.segments = self._init_segments(self.index, rank, f"{self.dir}/index.json")
        if self.index.get("act_dtype", "float32") != "float32":
            raise NotImplementedError(f"act_dtype {self.index['act_dtype']}: only float32 exports are supported")
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        providers = providers or ["CPUExecutionProvider"]
        self.sessions: dict[str, "ort.InferenceSession"] = {
            g["id"]: ort.InferenceSession(str(self.dir / g["path"]), opts, providers=providers)
            for segs in self.segments.values() for g in segs}

    def _run(self, g: dict, env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inp = {}
        for spec in g["inputs"]:
            t = env[spec["name"]]
            inp[spec["name"]] = np.ascontiguousarray(t.detach().cpu().numpy().astype(_NP[spec["dtype"]], copy=False))
        names = [o["name"] for o in g["outputs"]]
        outs = self.sessions[g["id"]].run(names, inp)
        return {n: torch.from_numpy(np.asarray(o)) for n, o in zip(names, outs)}

    def close(self) -> None:
        self.sessions.clear()


# ---- TensorRT ---------------------------------------------------------------------------------------------

class TensorRTExecutor(GraphExecutor):
    """Per-layer TensorRT engines (engines/ `manifest.json`, entries `rank{r}/<graph>.plan` with `onnx` naming the
    graph of index.json) of TP rank `rank`, run on one CUDA GPU with name-based I/O. tp > 1: one process per rank
    (SPMD, `cuda:LOCAL_RANK`), the segments' collectives done between engines over the torch.distributed group
    (NCCL on GPUs; see `GraphExecutor`) — the "runtime reduces between per-rank engines" form of the cross-rank
    reduction (no in-engine IDistCollectiveLayer).

    Pools live on the GPU (torch CUDA tensors); each pool input and its `*_out` output are bound to the same buffer
    (the kimi plugins update in place), so the returned pools are the input tensors. Needs full TensorRT
    (`import tensorrt`), a CUDA device and the kimi plugins (`plugins.trt_common.register_tensorrt_plugins`).
    Raises ImportError naming the missing package, RuntimeError without a GPU, FileNotFoundError/ValueError for a
    missing or incomplete manifest. It cannot run on a CPU-only machine (never run: no TensorRT here, README).
    """

    def __init__(self, engine_dir: "str | Path", onnx_dir: "str | Path | None" = None, device: int = 0,
                 rank: int = 0):
        try:
            import tensorrt as trt
        except ImportError as e:
            raise ImportError("backend 'tensorrt' needs full TensorRT (Linux + NVIDIA GPU, from NVIDIA's package index "
                              "or an NGC container: README 'Quick start'); "
                              f"it is not importable here ({e}). Use backend='onnxruntime' or 'torch' instead.") from e
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'tensorrt' needs a CUDA GPU; torch sees none. Use 'onnxruntime' or 'torch'.")
        from k3deploy.plugins.trt_common import register_tensorrt_plugins
        self.trt, self.device = trt, torch.device("cuda", device)
        self.dir = Path(engine_dir)
        mpath = self.dir / "manifest.json"
        if not mpath.is_file():
            raise FileNotFoundError(f"{mpath}: missing; build engines with python -m k3deploy.engines.build")
        manifest = json.loads(mpath.read_text())
        check_workspace_rules(manifest, str(mpath))
        self.pool_dims = engine_pool_dims(manifest, str(mpath))
        # the same plugin forms as the build (engines built with --aot hold the AOT ops of every kimi op)
        register_tensorrt_plugins(trt, aot=any(e.get("aot_ops") for e in manifest.get("engines", {}).values()))
        self.index = read_index(onnx_dir or self.dir)
        self.cfg = load_config(self.index["config"])
        self.segments = self._init_segments(self.index, rank, str(mpath))
        plans = {entry.get("onnx"): plan for plan, entry in manifest.get("engines", {}).items()}
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engines: dict[str, tuple] = {}
        self.stream = torch.cuda.Stream(self.device)
        for segs in self.segments.values():
            for g in segs:
                plan = plans.get(g["path"])
                if plan is None:
                    raise ValueError(f"{mpath}: no engine for graph {g['path']} (rank {rank}); rebuild the engines")
                engine = self._runtime.deserialize_cuda_engine((self.dir / plan).read_bytes())
                if engine is None:
                    raise RuntimeError(f"{self.dir / plan}: TensorRT could not deserialize the engine "
                                       "(version/GPU mismatch?)")
                if g["kind"] == "vision":      # one context per profile: a call picks the one its sizes fit
                    ctxs = []
                    for p in range(engine.num_optimization_profiles):
                        ctxs.append(engine.create_execution_context())
                        if p and not ctxs[-1].set_optimization_profile_async(p, self.stream.cuda_stream):
                            raise RuntimeError(f"{self.dir / plan}: cannot select optimization profile {p}")
                    self.engines[g["id"]] = (engine, ctxs)
                    continue
                ctx = engine.create_execution_context()
                profile = self.profile_for(g, engine.num_optimization_profiles)
                if profile and not ctx.set_optimization_profile_async(profile, self.stream.cuda_stream):
                    raise RuntimeError(f"{self.dir / plan}: cannot select optimization profile {profile}")
                self.engines[g["id"]] = (engine, ctx)
        self.stream.synchronize()
        vis = self.engines.get(f"rank{rank}/vision")
        self._vision_max = None
        if vis is not None:   # the largest patches per image any profile takes (pixels [VB, VL, 3p²])
            self._vision_max = max(int(vis[0].get_tensor_profile_shape("pixels", p)[2][1])
                                   for p in range(vis[0].num_optimization_profiles))

    def max_image_patches(self) -> int | None:
        """Patches per image the vision engine's profiles take at most (VL max), None without one."""
        return self._vision_max

    def vision_segments_per_call(self, length: int) -> int:
        """The most segments (VB) of `length` patches any vision profile takes (1 when none holds that length:
        the call then reports the sizes)."""
        engine = self.engines[next(k for k in self.engines if k.endswith("/vision"))][0]
        best = 1
        for p in range(engine.num_optimization_profiles):
            mn, _, mx = engine.get_tensor_profile_shape("pixels", p)
            if mn[1] <= length <= mx[1]:
                best = max(best, int(mx[0]))
        return best

    def _vision_context(self, engine, ctxs, feeds: dict):
        """The context of the first profile whose ranges hold every input shape of this call. ValueError naming
        the sizes when none does."""
        for p, ctx in enumerate(ctxs):
            if all(all(lo <= d <= hi for d, lo, hi in zip(feeds[n].shape, *engine.get_tensor_profile_shape(n, p)[::2]))
                   for n in feeds):
                return ctx, p
        raise ValueError(f"images: a vision call of {tuple(feeds['pixels'].shape[:2])} (segments, patches each) fits "
                         f"none of the vision engine's profiles in {self.dir}; rebuild with larger --vision-max-patches "
                         "/ --vision-max-images, or send smaller images")

    def preferred_block_size(self) -> int:
        """The (smallest) block size the engines' profiles take (`engine_pool_dims`); 16 for manifests that record
        none (export/build_engines.py fixed 16 before it took --block-size)."""
        return self.pool_dims.get("BS", (CPU_BLOCK_SIZE,))[0]

    def default_max_batch(self) -> int | None:
        """Requests per step the engines' KDA pools take (S - 1), when the manifest records them."""
        return self.pool_dims["S"][1] - 1 if "S" in self.pool_dims else None

    def default_num_blocks(self) -> int | None:
        """Latent blocks of the engines' pools (NB), when the manifest records them."""
        return self.pool_dims["NB"][1] if "NB" in self.pool_dims else None

    def default_max_num_tokens(self) -> int | None:
        """Tokens per step the engines' profiles take at most (M), when the manifest records them."""
        return self.pool_dims["M"][1] if "M" in self.pool_dims else None

    def default_max_context(self) -> int | None:
        """Tokens per request the engines' block tables hold (MB x BS), when the manifest records them."""
        if "MB" in self.pool_dims and "BS" in self.pool_dims:
            return self.pool_dims["MB"][1] * self.pool_dims["BS"][0]
        return None

    def _check(self, dim: str, value: int, field: str, fix: str) -> None:
        """ValueError naming `field` when `value` lies outside the engines' range of `dim`."""
        lo, hi = self.pool_dims.get(dim, (value, value))
        if not lo <= value <= hi:
            took = f"{lo}" if lo == hi else f"{lo}..{hi}"
            raise ValueError(f"{field} = {value}: the engines in {self.dir} were built for {took}; {fix}")

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError when the engines' profiles take another latent block size than `block_size`."""
        self._check("BS", block_size, "block_size", f"omit block_size or rebuild with --block-size {block_size}")

    def check_cache(self, num_slots: int, num_blocks: int, max_blocks: int, max_batch: int | None = None,
                    max_num_tokens: int | None = None) -> None:
        """Raise ValueError naming the LLM argument when the cache's slots, latent blocks or block-table width
        (max_context / block_size) lie outside the engines' profiles, or max_batch / max_num_tokens exceed what they
        take (TensorRT would fail at the first step otherwise)."""
        for field, value, most in (("max_batch", max_batch, self.default_max_batch()),
                                   ("max_num_tokens", max_num_tokens, self.default_max_num_tokens())):
            if value is not None and most is not None and value > most:
                raise ValueError(f"{field} = {value}: the engines in {self.dir} take at most {most}; pass {field} "
                                 f"<= {most} (or omit it) or rebuild with --{field.replace('_', '-')} {value}")
        self._check("S", num_slots, "KDA slots (max_batch + 1)", "pass the build's --max-batch (default 8) or rebuild")
        if max_blocks > self.pool_dims.get("MB", (1, max_blocks))[1]:
            ctx = self.default_max_context()
            raise ValueError(f"max_context: {max_blocks} blocks per request exceed the engines' block tables in "
                             f"{self.dir}; pass max_context <= {ctx} (or omit it) or rebuild with a larger "
                             "--max-context")
        self._check("NB", num_blocks, "num_blocks",
                    "omit num_blocks / memory_budget and pass the build's --max-batch and --max-context")

    @staticmethod
    def profile_for(graph: dict, num_profiles: int) -> int:
        """Optimization profile a graph's context runs with (engines/build.py builds [prefill, decode]): 1 for a
        layer's decode graph when its engine has that profile, else 0 (prefill graphs; embed/head, which serve both
        phases and whose prefill range covers decode batches)."""
        return 1 if graph.get("kind") == "layer" and graph.get("graph") == "decode" and num_profiles > 1 else 0

    _TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32,
              "int64": torch.int64}

    def _run(self, g: dict, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        engine, ctx = self.engines[g["id"]]
        profile = None
        if isinstance(ctx, list):
            ctx, profile = self._vision_context(engine, ctx, feeds)
        state_io = g.get("state_io", {})
        aliased = {o: i for i, o in state_io.items()}
        outs: dict[str, torch.Tensor] = {}
        for spec in g["inputs"]:
            name = spec["name"]
            t = feeds[name].to(self.device, self._TORCH[spec["dtype"]]).contiguous()
            feeds[name] = t
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise ValueError(f"{g['path']}: input {name} of shape {tuple(t.shape)} lies outside the engine's "
                                 f"optimization profile {profile if profile is not None else self.profile_for(g, engine.num_optimization_profiles)} "
                                 f"(manifest.json in {self.dir} lists its ranges); rebuild the engines for these sizes")
            ctx.set_tensor_address(name, t.data_ptr())
        for spec in g["outputs"]:
            name = spec["name"]
            if name in aliased:
                t = feeds[aliased[name]]                    # in place: output bound to the pool input buffer
            else:
                shape = tuple(ctx.get_tensor_shape(name))
                t = torch.empty(shape, dtype=self._TORCH[spec["dtype"]], device=self.device)
            ctx.set_tensor_address(name, t.data_ptr())
            outs[name] = t
        # the cache's in-place copies (prefix-cache restores and snapshots) and the input copies above run on the
        # current stream: the engine's stream must see them
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT execution of {g['id']} failed")
        self.stream.synchronize()
        return outs

    def close(self) -> None:
        self.engines.clear()
