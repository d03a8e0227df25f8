"""The runtime API that serve/ builds on (docs/DESIGN.md "Runtime API").

    llm = LLM(path, backend="torch" | "onnxruntime" | "tensorrt", max_batch=None, max_num_tokens=None, max_context=None)
    llm = LLM(path, backend="torch", device="cuda")          # the torch backend on a GPU (Triton kernels)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))   # -> list[RequestOutput]
    for tok in llm.stream([1, 2, 3], SamplingParams(max_tokens=8)): ...      # yields token ids
    eng = llm.start()                                       # AsyncEngine, one scheduler thread (idempotent)
    eng.submit(request_id, prompt_ids, params, on_token)    # on_token(token_id | None, finished, error)
    eng.cancel(request_id); eng.metrics(); eng.shutdown()
    llm = LLM(path, enable_prefix_caching=True)             # reuse cached prefixes (docs/PREFIX_CACHING.md)

Images (models with a vision tower, VISION.md; docs/VISION.md): a request takes `images=[ProcessedImage, ...]` with
its prompt ids pre-expanded (each image's `<|media_pad|>` repeated image.num_tokens times, in image order)::

    ids, images = llm.prepare_images(prompt_ids, [png_bytes, "data:image/png;base64,..."])   # one pad per image
    ids, images = llm.build_prompt("Describe <|kimi_image_placeholder|>", ["cat.png"])         # needs a tokenizer
    out = llm.generate([ids], images=[images])[0]

`path` is a checkpoint directory (config.json + safetensors index), an ONNX export directory (index.json), an
engine directory (engines/ manifest.json) or a build output directory whose manifest.json names them
(`checkpoint`, `onnx` / `onnx_dir`, `engines` / `engine_dir`; relative to the directory) or holds them as
subdirectories `checkpoint/`, `onnx/`, `engines/`. A build output directory (it has `.steps.json`) without its
manifest.json is an incomplete or failed build and is refused (FileNotFoundError). A `tiktoken.model` next to the
checkpoint (or in `path`) gives `llm.tokenizer`.

Invalid requests raise ValueError naming the field (prompt_ids, max_tokens, temperature, top_k, top_p, seed,
stop_token_ids, request_id, images) from `generate`, `stream` and `submit`; requests already in flight are
unaffected.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import queue
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from k3deploy.runtime.cache import HybridCache, plan_memory
from k3deploy.runtime.sampling import SamplingParams
from k3deploy.runtime.scheduler import Scheduler

log = logging.getLogger(__name__)

__all__ = ["LLM", "SamplingParams", "RequestOutput", "AsyncEngine", "resolve_model_dir"]


@dataclasses.dataclass
class RequestOutput:
    """request_id; prompt_ids; token_ids generated (a stop/eos token that ended the request is included);
    finish_reason "length" | "stop" | "cancelled" | "error"; error: message when finish_reason == "error".
    With SamplingParams.logprobs: logprobs[i] (natural log) and top_logprobs[i] ([(id, logprob)], most likely first)
    of token_ids[i]; with prompt_logprobs: prompt_logprobs / prompt_top_logprobs per prompt token (None first).
    num_cached_tokens: prompt tokens served from the prefix cache instead of prefilled (0 when it is off)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list | None = None
    num_cached_tokens: int = 0


def _first_key(d: dict, *keys):
    for k in keys:
        if d.get(k):
            return d[k]
    return None


def resolve_model_dir(path: "str | Path") -> dict[str, Path | None]:
    """Find {"checkpoint", "onnx", "engines", "tokenizer"} under `path` (None where absent). See module docstring."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory (expected a checkpoint, ONNX export, engine or build dir)")
    found: dict[str, Path | None] = {"checkpoint": None, "onnx": None, "engines": None, "tokenizer": None}
    manifest = root / "manifest.json"
    if (root / ".steps.json").is_file() and not manifest.is_file():
        raise FileNotFoundError(f"{root}: an incomplete build output (no manifest.json: the build failed, was "
                                "interrupted or is still running; it writes manifest.json only when every step "
                                f"passed); rerun `k3deploy build --out {root}` until it exits 0")
    if manifest.is_file():
        try:
            m = json.loads(manifest.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{manifest}: not valid JSON ({e})") from e
        if isinstance(m.get("engines"), dict) and "format" in m:
            found["engines"] = root                              # an engines/ manifest
        for key, names in (("checkpoint", ("checkpoint", "checkpoint_dir")), ("onnx", ("onnx", "onnx_dir")),
                           ("engines", ("engine_dir", "engines_dir", "engines")), ("tokenizer", ("tokenizer",))):
            v = _first_key(m, *names)
            if isinstance(v, str):
                found[key] = (root / v).resolve()
    if found["checkpoint"] is None:
        for c in (root, root / "checkpoint"):
            if (c / "config.json").is_file() and (c / "model.safetensors.index.json").is_file():
                found["checkpoint"] = c
                break
    if found["onnx"] is None:
        for c in (root, root / "onnx"):
            if (c / "index.json").is_file():
                found["onnx"] = c
                break
    if found["engines"] is None and (root / "engines" / "manifest.json").is_file():
        found["engines"] = root / "engines"
    if found["tokenizer"] is None:
        for c in (root, found["checkpoint"]):
            if c is not None and (c / "tiktoken.model").is_file():
                found["tokenizer"] = c / "tiktoken.model"
                break
    return found


class AsyncEngine:
    """One scheduler thread that batches every submitted request. Thread safe: submit/cancel/metrics/shutdown get
    the engine lock before the scheduler's next step starts (at most the step in progress delays them). Callbacks
    run on the scheduler thread and must be quick; they may call submit/cancel."""

    def __init__(self, scheduler: Scheduler):
        self._sched = scheduler
        self._cv = threading.Condition(threading.RLock())
        self._stop = False
        self._callers = 0                      # API calls waiting for the lock (`_turn`); guarded by _callers_lock
        self._callers_lock = threading.Lock()
        self.failure: str | None = None        # why the scheduler thread died (None while it runs or after shutdown)
        self._thread = threading.Thread(target=self._loop, name="k3-scheduler", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def _turn(self):
        """The engine lock for an API call, taken before the scheduler's next step. Python's locks are not fair: the
        scheduler thread takes the lock back between steps before a waiting caller wakes up, so a cancel could wait
        many steps (61 on an idle 2-core machine; under CI load a request reached its 4000 tokens first). The loop
        steps aside while a caller is waiting."""
        with self._callers_lock:
            self._callers += 1
        try:
            self._cv.acquire()
        finally:                               # also when the wait is interrupted (KeyboardInterrupt)
            with self._callers_lock:
                self._callers -= 1
        try:
            yield
        finally:
            self._cv.notify_all()
            self._cv.release()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def health(self) -> str | None:
        """None while the engine serves; else why not ("shut down", or the error that ended the scheduler thread:
        every request in flight then was finished with that error)."""
        if self.failure is not None:
            return self.failure
        if self._stop:
            return "engine is shut down"
        if not self._thread.is_alive():
            return "scheduler thread is not running"
        return None

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None,
               on_token: Callable[[int | None, bool, str | None], None] | None = None, images=None, *,
               content_keys=None):
        """Queue a request; returns its scheduler Request (read-only for callers; `num_cached_tokens` is set when
        it is admitted). images: its ProcessedImages with prompt_ids pre-expanded (module docstring; their content
        hashes key the prefix cache). content_keys: more (start, end, digest) spans for the prefix cache
        (Scheduler.add). Raises ValueError naming the field for a bad request, RuntimeError after shutdown."""
        with self._turn():
            if self._stop:
                raise RuntimeError("engine is shut down")
            return self._sched.add(request_id, prompt_ids, params or SamplingParams(), on_token, images,
                                   content_keys=content_keys)

    def cancel(self, request_id: str) -> bool:
        """Free the request's slot and blocks now (after the step in progress); on_token(None, True, None)
        follows. Returns False for an unknown or already finished request."""
        with self._turn():
            return self._sched.cancel(request_id)

    def metrics(self) -> dict:
        """{"kda_slots_in_use", "latent_blocks_in_use", "tokens_generated", "preemptions", "steps",
        "max_requests_per_step"} and, with prefix caching, the prefix-cache metrics (HybridCache.prefix_metrics)."""
        with self._turn():
            return self._sched.metrics()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix (after the step in progress); returns how many snapshots were dropped."""
        with self._turn():
            return self._sched.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the thread; requests still in flight finish as "cancelled", and an overlapped step in flight is booked
        (unless called from a callback on the scheduler thread). Idempotent."""
        with self._turn():
            self._stop = True
        if threading.current_thread() is not self._thread:
            self._thread.join()
        with self._cv:
            for rid in list(self._sched.requests):
                self._sched.cancel(rid)
            if threading.current_thread() is not self._thread:     # not from inside a step (a callback)
                self._sched.run_until_done()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and (self._callers or not self._sched.has_work()):
                        self._cv.wait(0.05 if self._callers else None)   # a caller's turn ends with notify_all
                    if self._stop:
                        return
                    try:
                        self._sched.step()
                    except Exception:                # keep serving; the step's requests were finished with an error
                        log.exception("scheduler step failed")
        except BaseException as e:                   # the thread ends: no request may wait for it
            self.failure = f"scheduler thread died: {type(e).__name__}: {e}"
            log.critical("%s; failing every request in flight", self.failure)
            with self._cv:
                for rid in list(self._sched.requests):
                    self._sched.fail(rid, self.failure)


class LLM:
    """Load a model on a backend and generate. See the module docstring for `path`.

    backend: "torch" (the PyTorch model, needs a checkpoint), "onnxruntime" (needs an ONNX export), "tensorrt"
    (needs engines + export index; full TensorRT and a GPU). device (torch backend): "cpu" (default; the fp32
    reference), "cuda" (cuda:LOCAL_RANK under torchrun) or "cuda:N": weights, decode-state pools and batch metadata
    on that GPU, logits sampled there (runtime.distributed.resolve_device); the tensorrt backend takes "cuda[:N]"
    and onnxruntime only "cpu". ops (torch backend): "reference" | "torch" | "kernels" (each layer's glue fused
    around them: runtime/fused.py) | "kernels-unfused" (runtime.executor.TorchExecutor; default "reference" on the CPU, "torch" = the Triton kernels on CUDA, which need a block_size
    multiple of 16). dense_dtype (torch backend): "float32" (default; the reference precision) or "bfloat16" (dense
    weights and their GEMMs in bf16: half the bytes of the step's largest reads; K3Model; the KDA conv history and
    MLA latent cache pools then hold bf16 too, MODEL.md §9, the KDA state stays fp32). profile_comm: count and
    time the TP collectives (`llm.executor.comm.stats()`).
    cuda_graphs (torch backend, CUDA, ops "kernels"): decode steps replay CUDA graphs captured at start-up, one per
    batch bucket up to max_batch (runtime/graphs.py; capture takes a few warm-up steps per bucket).
    max_batch: requests running at once (KDA slots = max_batch + 1; default 8, tensorrt: the engines');
    max_num_tokens: tokens per scheduler step (default 256, tensorrt: the engines');
    max_context: tokens per request (default: the config's max_position_embeddings; tensorrt: what the engines'
    block tables hold). enable_prefix_caching: reuse the KDA state and latent blocks of prefixes earlier requests
    computed (docs/PREFIX_CACHING.md; every backend): snapshot_interval tokens (a multiple of block_size; default
    1024 rounded up to one) between periodic KDA snapshots, num_snapshots rows in the snapshot pool (default
    2 x max_batch; each one request's KDA state + conv history, budgeted apart from the slots and blocks). block_size / num_blocks / memory_budget size the latent pool (default:
    enough for max_batch requests at max_context; memory_budget in bytes goes through `plan_memory`); block_size
    (tokens per latent block) defaults to the executor's `preferred_block_size()`: 64 on CUDA with the torch /
    kernels ops (the MLA kernels' key tiles stay inside one block), the engines' profile value for tensorrt, 16
    otherwise; num_blocks counts blocks of that size. The tensorrt backend allocates the pools its engines fix
    (slots, blocks, block size) and refuses a max_batch, max_num_tokens or max_context above the build's or another
    block_size / num_blocks (ValueError naming the argument).
    decode_pad_multiple pads decode batches with sentinel rows. tp / ep: tensor / expert parallelism of the torch
    backend (default: the torch.distributed world size; this process is its rank — launch one process per rank with
    torchrun, runtime/distributed.py); the onnxruntime backend takes tp from the export. Raises FileNotFoundError when the backend's
    files are absent, ImportError when its package is missing, ValueError for bad sizes or a bad device/ops,
    RuntimeError when a CUDA device is asked for and torch sees none.
    """

    def __init__(self, path: "str | Path", backend: str = "torch", max_batch: int | None = None,
                 max_num_tokens: int | None = None,
                 max_context: int | None = None, *, block_size: int | None = None, num_blocks: int | None = None,
                 memory_budget: int | None = None, decode_pad_multiple: int | None = None,
                 tp: int | None = None, ep: int = 1, device: "str | torch.device | None" = None,
                 ops: str | None = None, profile_comm: bool = False, cuda_graphs: bool = False,
                 dense_dtype: str | None = None, enable_prefix_caching: bool = False,
                 snapshot_interval: int | None = None, num_snapshots: int | None = None):
        from k3deploy.runtime.distributed import parse_device
        for name, v in (("max_batch", max_batch), ("max_num_tokens", max_num_tokens), ("max_context", max_context),
                        ("num_blocks", num_blocks), ("memory_budget", memory_budget),
                        ("decode_pad_multiple", decode_pad_multiple)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "num_blocks" else 1)):
                raise ValueError(f"{name} = {v!r}: give an integer >= {2 if name == 'num_blocks' else 1} or omit it"
                                 + (" (block 0 is the padding sentinel)" if name == "num_blocks" else ""))
        self.paths = resolve_model_dir(path)
        self.backend = backend
        dev = parse_device(device)                          # ValueError for a malformed string, before any loading
        if backend != "torch" and ops is not None:
            raise ValueError(f"ops = {ops!r}: only the torch backend takes ops (backend is {backend!r})")
        if backend != "torch" and dense_dtype is not None:
            raise ValueError(f"dense_dtype = {dense_dtype!r}: only the torch backend takes dense_dtype (backend is "
                             f"{backend!r}; exports and engines fix their own precision)")
        if backend == "onnxruntime" and dev.type != "cpu":
            raise ValueError(f"device = {str(device)!r}: the onnxruntime backend runs on the CPU provider; "
                             "use backend 'torch' with device 'cuda' for the GPU")
        if backend == "tensorrt" and device is not None and dev.type != "cuda":
            raise ValueError(f"device = {str(device)!r}: the tensorrt backend runs on a CUDA GPU ('cuda' or 'cuda:N')")
        import torch.distributed as dist
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.tp, self.ep, self.rank = tp or world, ep, rank
        self.executor = self._make_executor(backend, device, ops, profile_comm, dense_dtype)
        cfg = self.cfg = self.executor.cfg
        max_context = max_context or min(self.executor.default_max_context() or math.inf, cfg.max_position_embeddings)
        if max_batch is None:
            max_batch = self.executor.default_max_batch() or 8
        if max_num_tokens is None:
            max_num_tokens = self.executor.default_max_num_tokens() or 256
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise ValueError(f"block_size = {block_size!r}: give a positive int (tokens per latent block; a multiple "
                             "of 16 for the GPU kernels) or omit it")
        if block_size is None:
            block_size = self.executor.preferred_block_size()
        self.executor.check_block_size(block_size)
        snapshots = self._snapshot_rows(enable_prefix_caching, snapshot_interval, num_snapshots, max_batch)
        device = self.device = self.executor.device
        if memory_budget is not None:
            plan = plan_memory(cfg, self.executor.tp, 1, memory_budget, max_batch, max_context, block_size,
                               self.executor.act_dtype, snapshots)
            self.plan = plan
            log.info("memory plan:\n%s", plan.table())
            self.executor.check_cache(plan.num_slots, plan.num_blocks, math.ceil(max_context / block_size),
                                      max_batch, max_num_tokens)
            cache = HybridCache.from_plan(cfg, plan, device, snapshot_interval)
        else:
            # engines fix the pools: their slots and blocks, whatever this LLM's (smaller) max_batch / max_context
            slots = (self.executor.default_max_batch() or max_batch) + 1
            if num_blocks is None:
                num_blocks = self.executor.default_num_blocks() or 1 + max_batch * math.ceil(max_context / block_size)
            self.executor.check_cache(slots, num_blocks, math.ceil(max_context / block_size), max_batch,
                                      max_num_tokens)
            cache = HybridCache(cfg, slots, num_blocks, block_size, self.executor.tp, self.executor.act_dtype,
                                device, max_context, snapshots, snapshot_interval)
        if cache.prefix_caching:
            log.info("prefix caching on: %d snapshots of %.1f MiB (KDA state + conv history), every %d tokens",
                     snapshots, cache.snapshots.bytes_per_row / 2**20, cache.snapshot_interval)
        self.cache = cache
        self.scheduler = Scheduler(self.executor, cache, max_batch, max_num_tokens, cfg.eos_token_id,
                                   decode_pad_multiple)
        if cuda_graphs:
            if backend != "torch":
                raise ValueError(f"cuda_graphs: only the torch backend captures CUDA graphs (backend is {backend!r})")
            self._enable_graphs(capture=True)
        self._engine: AsyncEngine | None = None
        self._ids = itertools.count()
        self._tokenizer = None
        self._processor = None

    @staticmethod
    def _snapshot_rows(enable: bool, interval, rows, max_batch: int) -> int:
        """Snapshot pool rows for enable_prefix_caching / num_snapshots (0 = off). ValueError naming the argument
        for snapshot_interval / num_snapshots without enable_prefix_caching or a num_snapshots < 1."""
        if not isinstance(enable, bool):
            raise ValueError(f"enable_prefix_caching = {enable!r}: pass True or False")
        if not enable:
            for name, v in (("snapshot_interval", interval), ("num_snapshots", rows)):
                if v is not None:
                    raise ValueError(f"{name} = {v!r}: only used with enable_prefix_caching=True")
            return 0
        if rows is None:
            from k3deploy.runtime.prefix_cache import default_num_snapshots
            return default_num_snapshots(max_batch)
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"num_snapshots = {rows!r}: give a positive int (snapshot pool rows) or omit it")
        return rows

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix; returns how many snapshots were dropped (0 when prefix caching is off)."""
        return self._engine.reset_prefix_cache() if self._engine else self.scheduler.reset_prefix_cache()

    def _enable_graphs(self, capture: bool = True):
        """Capture the decode graphs for this LLM's scheduler and cache: batch buckets up to max_batch rounded up to
        the decode pad multiple (padded batches run in them too), block tables max_context / block_size wide.
        capture=False: the same padded path eagerly (tests on the CPU). Returns the DecodeGraphs."""
        sched, cache = self.scheduler, self.cache
        m = sched.decode_pad_multiple or 1
        width = math.ceil(cache.max_context / cache.block_size)
        if width > 4096:
            log.warning("cuda_graphs: block tables %d wide (max_context %d): every decode step's MLA combine walks "
                        "splits sized for it; pass a smaller max_context if contexts stay shorter", width,
                        cache.max_context)
        return self.executor.enable_cuda_graphs(cache.pools, math.ceil(sched.max_batch / m) * m, width,
                                                capture=capture)

    def _found(self) -> str:
        """What resolve_model_dir found, for error messages: "checkpoint=DIR, onnx=none, ..."."""
        return ", ".join(f"{k}={v if v is not None else 'none'}" for k, v in self.paths.items())

    def _make_executor(self, backend: str, device=None, ops=None, profile_comm: bool = False, dense_dtype=None):
        p = self.paths
        if backend == "torch":
            if p["checkpoint"] is None:
                raise FileNotFoundError(f"backend 'torch' needs a checkpoint (config.json + model.safetensors.index.json); "
                                        f"found none ({self._found()})")
            from k3deploy.runtime.executor import TorchExecutor
            return TorchExecutor(p["checkpoint"], tp=self.tp, ep=self.ep, rank=self.rank, device=device, ops=ops,
                                 profile_comm=profile_comm, dense_dtype=dense_dtype)
        if backend == "onnxruntime":
            if p["onnx"] is None:
                raise FileNotFoundError(f"backend 'onnxruntime' needs an ONNX export directory with index.json; found none "
                                        f"({self._found()}); give the directory export/build_engines.py wrote "
                                        "(out/<name>/), or the torch backend with a checkpoint")
            from k3deploy.runtime.executor import OnnxRuntimeExecutor
            return OnnxRuntimeExecutor(p["onnx"], rank=self.rank)
        if backend == "tensorrt":
            from k3deploy.runtime.executor import TensorRTExecutor
            if p["engines"] is None:
                raise FileNotFoundError(f"backend 'tensorrt' needs an engine directory with manifest.json; found none ({self._found()})")
            from k3deploy.runtime.distributed import resolve_device
            idx = resolve_device(device).index if device is not None else 0
            return TensorRTExecutor(p["engines"], p["onnx"], device=idx or 0, rank=self.rank)
        raise ValueError(f"backend = {backend!r}: choose 'torch', 'onnxruntime' or 'tensorrt'")

    @property
    def processor(self):
        """The image processor's settings (model.vision.ProcessorConfig): the checkpoint's preprocessor_config.json,
        else the export's copy in index.json, else VISION.md §1.1's defaults. ValueError without a vision tower."""
        if self.cfg.vision is None:
            raise ValueError("images: this model has no vision tower (config.json has no vision_config)")
        if self._processor is None:
            from k3deploy.runtime.vision import load_processor
            index = getattr(self.executor, "index", None) or {}
            raw = None if self.paths["checkpoint"] else (index.get("vision") or {}).get("processor")
            self._processor = load_processor(self.paths["checkpoint"], raw)
            if self._processor.patch_size != self.cfg.vision.patch_size:
                raise ValueError(f"preprocessor_config.json: patch_size {self._processor.patch_size} != "
                                 f"vision_config.patch_size {self.cfg.vision.patch_size}; restore the checkpoint's files")
        return self._processor

    def prepare_images(self, prompt_ids: Sequence[int], images: Sequence) -> tuple[list[int], list]:
        """(pre-expanded prompt ids, ProcessedImages) from a tokenized prompt holding one `<|media_pad|>` per image
        and the images as paths / bytes / data: URLs / PIL images (runtime.vision.prepare_images with this model's
        processor and placeholder id). Raises runtime.vision.ImageError (a ValueError)."""
        from k3deploy.runtime.vision import prepare_images
        proc = self.processor
        return prepare_images(prompt_ids, images, self.cfg.vision.media_placeholder_token_id, proc)

    def build_prompt(self, text: str, images: Sequence) -> tuple[list[int], list]:
        """(pre-expanded prompt ids, ProcessedImages) from text with one `<|kimi_image_placeholder|>` per image
        (runtime.vision.build_prompt with `llm.tokenizer`). Raises ValueError without a tokenizer, ImageError."""
        from k3deploy.runtime.vision import build_prompt
        if self.tokenizer is None:
            raise ValueError("build_prompt: no tokenizer (tiktoken.model) next to the checkpoint; tokenize the prompt "
                             "yourself and use prepare_images")
        proc = self.processor
        return build_prompt(self.tokenizer, text, images, self.cfg.vision.media_placeholder_token_id, proc)

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (runtime.tokenizer.Tokenizer), or None when no tiktoken.model is present."""
        if self._tokenizer is None and self.paths["tokenizer"] is not None:
            from k3deploy.runtime.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_file(self.paths["tokenizer"])
        return self._tokenizer

    # ---- background engine ----
    def start(self) -> AsyncEngine:
        """Start (once) and return the background engine."""
        if self._engine is None or not self._engine.running:
            self._engine = AsyncEngine(self.scheduler)
        return self._engine

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def metrics(self) -> dict:
        """The scheduler's counters and gauges (`AsyncEngine.metrics`; with prefix caching the prefix-cache metrics
        of docs/PREFIX_CACHING.md), read through the engine while it runs."""
        return self._engine.metrics() if self._engine else self.scheduler.metrics()

    # ---- synchronous helpers ----
    def generate(self, prompts: Sequence[Sequence[int]], params: "SamplingParams | Sequence[SamplingParams] | None" = None,
                 images: "Sequence | None" = None) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order. A single prompt (list of ints)
        is accepted too (then `images` is that prompt's list). images: per prompt a list of ProcessedImage (or None)
        with the prompt pre-expanded (module docstring). Every request is validated before any runs: ValueError
        names the field."""
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
            images = None if images is None else [images]
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"images: {len(images)} image lists for {len(prompts)} prompts; give one list (or None) "
                             "per prompt")
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        prompts = [self.scheduler.check(pr, p) for pr, p in zip(prompts, plist)]
        images = list(images) if images is not None else [None] * len(prompts)
        if any(im is not None for im in images):
            from k3deploy.runtime.vision import request_images
            for i, (pr, im) in enumerate(zip(prompts, images)):
                if im is not None:
                    try:
                        request_images(pr, im, self.cfg, self.executor.max_image_patches())
                    except ValueError as e:
                        raise ValueError(f"prompt {i}: {e}") from None
        outs: list[RequestOutput] = []
        done = threading.Semaphore(0)
        for pr, p, im in zip(prompts, plist, images):
            out = RequestOutput(f"gen-{next(self._ids)}", list(pr), [], "")
            outs.append(out)
            reqs: list = []

            def on_token(tok, finished, error, out=out, reqs=reqs):
                if tok is not None:
                    out.token_ids.append(tok)
                if finished:
                    r = reqs[0]
                    out.finish_reason, out.error = r.finish_reason, error
                    out.logprobs, out.top_logprobs = r.logprobs, r.top_logprobs
                    out.prompt_logprobs, out.prompt_top_logprobs = r.prompt_logprobs, r.prompt_top_logprobs
                    out.num_cached_tokens = r.num_cached_tokens
                    done.release()
            with self._engine._turn() if self._engine is not None else contextlib.nullcontext():
                reqs.append(self._submit(out.request_id, pr, p, on_token, im))   # before its first callback can run
        self._wait(done, len(outs))
        return outs

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, images=None) -> Iterator[int]:
        """Yield the generated token ids of one request as they come (images: its ProcessedImages, the prompt
        pre-expanded). ValueError (naming the field) is raised at the first next(); closing the iterator early
        cancels the request. Raises RuntimeError when the request ends with an error."""
        params = params or SamplingParams()
        rid = f"stream-{next(self._ids)}"
        q: "queue.Queue[tuple]" = queue.Queue()
        self._submit(rid, prompt_ids, params, lambda tok, fin, err: q.put((tok, fin, err)), images)
        finished = False
        try:
            while True:
                if self._engine is None:
                    while q.empty():
                        self.scheduler.step()
                tok, finished, err = q.get()
                if tok is not None:
                    yield tok
                if finished:
                    if err:
                        raise RuntimeError(f"request {rid} failed: {err}")
                    return
        finally:
            if not finished:
                self.cancel(rid)

    def cancel(self, request_id: str) -> bool:
        return self._engine.cancel(request_id) if self._engine else self.scheduler.cancel(request_id)

    def _submit(self, rid, prompt_ids, params, on_token, images=None):
        if self._engine is not None:
            return self._engine.submit(rid, prompt_ids, params, on_token, images)
        return self.scheduler.add(rid, prompt_ids, params, on_token, images)

    def _wait(self, done: threading.Semaphore, n: int) -> None:
        for _ in range(n):
            while not done.acquire(blocking=self._engine is not None):
                if not self.scheduler.step() and not self.scheduler.has_work():
                    raise RuntimeError("generate: scheduler idle with requests unfinished")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.executor.close()
