#!/usr/bin/env python
"""The main job: a Kimi K3 checkpoint to a verified deployment.

    python export/build_engines.py [--checkpoint DIR] [--out DIR] [--tp N] [--ep M]
        [--backend tensorrt|tensorrt-rtx|onnxruntime] [--target-cc sm86 ...] [--max-batch B]
        [--max-num-tokens T] [--max-context L] [--check-finite full|sampled] [--aot]
        [--enable-prefix-caching [--num-snapshots N] [--snapshot-interval T]] [--dry-run] [--force]

Steps (each with progress and a one-line summary; skipped on a rerun whose inputs hash the same, redone with
--force): checkpoint (load + validate, every float tensor finite: --check-finite) -> plan -> export (shard per TP/EP rank, ONNX per layer) -> verify
(Polygraphy: ONNX Runtime vs the PyTorch reference, per layer, states included) -> engines (whatever TensorRT is
installed, or a clear skip) -> repository (manifest.json + Triton model repository) -> smoke (generate a few tokens
with the runtime and compare them with the reference).

This script is the pipeline's orchestrator: it is the one place that calls every stage (export, engines, serve,
runtime); no stage imports a later one.

With a vision_config (VISION.md) the export adds each rank's vision graph (tower + projector), verify compares it
(and the grouped runtime form against the packed reference), the engines step builds it with two profiles of
images per call (`--vision-max-patches`, `--vision-max-images`), manifest.json lists them under "vision", and the
smoke step adds a two-image prompt. Graphs whose inputs are unchanged keep their export, verification and engine.

Output layout (OUT): manifest.json, plan.txt, onnx/ (docs/EXPORT_FORMAT.md), verify/report.json, engines/
(rank{r}/*.plan + manifest.json), triton/ (model repository), smoke.json, .steps.json (step hashes).
manifest.json exists only while OUT is a complete, verified deployment: a failed or running step removes it, and
`runtime.api.LLM(OUT)` refuses an OUT without it.
Exit status: 0 success, 1 verification or smoke mismatch, 2 bad input (one message naming the field and the fix).
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from k3deploy.model.checkpoint import Checkpoint, CheckpointError
from k3deploy.model.config import ConfigError, load_config

log = logging.getLogger("build_engines")
DEFAULT_PRESET = "k3-tiny"
STEPS = ("checkpoint", "plan", "export", "verify", "engines", "repository", "smoke")


class BuildError(Exception):
    """A failure with one clear message for the user (exit 2)."""


def cache_dir() -> Path:
    """Where the embedded default checkpoint is generated: $K3DEPLOY_CACHE or ~/.cache/k3deploy."""
    return Path(os.environ.get("K3DEPLOY_CACHE", Path.home() / ".cache" / "k3deploy"))


def default_checkpoint() -> Path:
    """The embedded default: a synthetic k3-tiny checkpoint, generated on first use."""
    from k3deploy.model.synthetic import write_synthetic
    path = cache_dir() / f"{DEFAULT_PRESET}-seed0"
    if (path / "model.safetensors.index.json").is_file():
        log.info("using the embedded default checkpoint %s (synthetic %s)", path, DEFAULT_PRESET)
        if not (path / "tiktoken.model").is_file():     # generated before checkpoints carried their tokenizer
            from k3deploy.model.vocab import write_tokenizer_files
            cfg = load_config(DEFAULT_PRESET)
            write_tokenizer_files(path, cfg.vocab_size, cfg.max_position_embeddings)
        return path
    log.info("no --checkpoint given: generating the embedded default (synthetic %s, seed 0) into %s", DEFAULT_PRESET, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_synthetic(load_config(DEFAULT_PRESET), path, seed=0, overwrite=True, progress=True)
    return path


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def checkpoint_fingerprint(path: Path) -> str:
    """Content hash of config.json and the index, plus name/size/mtime of every file (cheap for 1.5 TB)."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        p = path / name
        if p.is_file():
            h.update(p.read_bytes())
    for p in sorted(path.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def write_json_atomic(obj, path: Path) -> None:
    """Write JSON to a temporary sibling, then rename: a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


class Pipeline:
    """Runs the steps, skipping those whose input hash and outputs are unchanged (state in OUT/.steps.json)."""

    def __init__(self, out: Path, force: bool):
        self.out, self.force = out, force
        self.state_path = out / ".steps.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.is_file() and not force else {}
        self.ran: list[str] = []
        self.skipped: list[str] = []

    MARKERS = {"repository": "manifest.json", "smoke": "smoke.json"}

    def invalidate_from(self, name: str) -> None:
        """A step is about to run: forget its record and remove the files that mark this and later steps done
        (manifest.json of the repository step, smoke.json), so a failure leaves nothing looking complete and
        those steps run again. Later steps whose own inputs are unchanged are still skipped."""
        self.state.pop(name, None)
        for later in STEPS[STEPS.index(name):]:
            if later in self.MARKERS:
                (self.out / self.MARKERS[later]).unlink(missing_ok=True)
        write_json_atomic(self.state, self.state_path)

    def run(self, i: int, name: str, inputs, outputs: list[Path], fn):
        """Run step `name` unless its input hash matches the last run and all `outputs` exist. fn() returns
        (summary line, result); the result is stored in the state and returned."""
        key = _sha(inputs)
        prev = self.state.get(name)
        t0 = time.time()
        if prev and prev.get("hash") == key and all(p.exists() for p in outputs):
            self.skipped.append(name)
            log.info("[%d/%d] %-10s skipped (inputs unchanged): %s", i, len(STEPS), name, prev.get("summary", ""))
            return prev.get("result")
        log.info("[%d/%d] %-10s ...", i, len(STEPS), name)
        self.invalidate_from(name)
        summary, result = fn()
        self.state[name] = {"hash": key, "summary": summary, "result": result}
        write_json_atomic(self.state, self.state_path)
        self.ran.append(name)
        log.info("[%d/%d] %-10s done in %.1f s: %s", i, len(STEPS), name, time.time() - t0, summary)
        return result


def pick_backend(requested: str | None) -> str:
    """The engine builder: the requested one, else full TensorRT, else TensorRT-RTX, else onnxruntime (no engines)."""
    from k3deploy.engines.trt import load_trt
    if requested == "onnxruntime":
        return requested
    flavors = [requested] if requested else ["tensorrt", "tensorrt-rtx"]
    for fl in flavors:
        try:
            load_trt(fl)
            return fl
        except (ImportError, RuntimeError, ValueError) as e:
            if requested:
                raise BuildError(f"--backend {requested}: {e}; or omit --backend to use what is installed")
    return "onnxruntime"


def engine_dims(cfg, max_batch: int, max_num_tokens: int, max_context: int, block_size: int) -> dict:
    """Ranges of the pool / block-table dims for the engine profiles (runtime pools are fixed per deployment)."""
    slots = max_batch + 1
    mb = -(-max_context // block_size)
    nb = max_batch * mb + 1
    return {"S": (slots, slots, slots), "NB": (nb, nb, nb), "BS": (block_size,) * 3, "MB": (1, mb, mb),
            "N1": (2, max_batch + 1, max_batch + 1),
            "M": (1, max_batch, max_num_tokens)}


SMALL_IMAGES = 4096        # patches: the vision engine's first profile (most images, VISION.md §11.3)


def vision_profiles(max_patches: int, max_images: int, max_frames: int) -> list[dict]:
    """The vision engine's two profiles [small images, large images] as named-dim ranges: VL (patches per segment)
    up to min(4096, max_patches) with up to `max_images` segments per call, then up to max_patches one segment per
    call; VN (merged tokens) and VT (frames) follow (VISION.md §11.3: attention is quadratic in VL)."""
    small = min(SMALL_IMAGES, max_patches)
    out = []
    for lmax, bmax, opt in ((small, max_images, min(1656, small)), (max_patches, 1, min(10764, max_patches))):
        out.append({"VB": (1, 1, bmax), "VL": (4, opt, lmax), "VN": (1, max(1, opt // 4), max(1, bmax * lmax // 4)),
                    "VT": (1, 1, max_frames)})
    return out


def vision_manifest(cfg, profiles: list[dict], processor) -> dict:
    """manifest.json's "vision" entry: the graph per rank, the processor limits and, per engine profile, the patches
    per segment and segments per call it takes."""
    return {"graph": "rank{r}/vision", "media_placeholder_token_id": cfg.vision.media_placeholder_token_id,
            "processor": processor.to_json()["media_proc_cfg"], "max_patches_per_image": profiles[-1]["VL"][2],
            "profiles": [{"patches_per_segment": [p["VL"][0], p["VL"][2]], "segments_per_call": [p["VB"][0], p["VB"][2]],
                          "patches_per_call": [p["VL"][0], p["VB"][2] * p["VL"][2]]} for p in profiles]}


def smoke_images(ckpt: Path):
    """Two deterministic test images (an RGB gradient 30x16 and an RGBA noise image 60x44, alpha exercising the
    chessboard fill), processed with the checkpoint's processor."""
    import numpy as np
    from PIL import Image

    from k3deploy.runtime.vision import load_processor, process_image
    proc = load_processor(ckpt)
    y, x = np.mgrid[0:16, 0:30]
    a = np.stack([x * 8, y * 15, (x + y) * 5], -1).astype(np.uint8)
    b = np.random.default_rng(0).integers(0, 256, (44, 60, 4), dtype=np.uint8)
    return [process_image(Image.fromarray(a, "RGB"), proc), process_image(Image.fromarray(b, "RGBA"), proc)]


def _generate_tp(out: Path, backend: str, tp: int, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from `tp` runtime processes (torchrun, one per TP rank, gloo on CPU / NCCL on GPU)."""
    import subprocess
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", "-m",
           "k3deploy.runtime.generate", "--model", str(out), "--backend", backend, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-tokens", str(steps), "--ignore-eos"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if r.returncode != 0:
        raise RuntimeError(f"smoke generation on {tp} ranks failed: {r.stderr.strip().splitlines()[-1:]}")
    return [int(t) for t in r.stdout.split()]


def smoke(out: Path, ckpt: Path, backend: str, steps: int = 8, tp: int = 1, **llm_kw) -> dict:
    """Greedy-generate `steps` tokens for two prompts (with a vision tower, a third one holding two images) with the
    runtime on `backend` (tp > 1: one process per rank under torchrun; text prompts only) and with the unsharded
    reference (model.reference.forward; images through model.vision.VisionModel.reference); returns both and
    whether they match. llm_kw: the sizes the engines were built for (max_batch, max_num_tokens, max_context)."""
    import torch

    from k3deploy.model.reference import K3Model, SequenceState, forward
    from k3deploy.runtime.api import LLM, SamplingParams
    cfg = load_config(ckpt)
    prompts = [[(7 * i + 3) % cfg.vocab_size for i in range(n)] for n in (5, 11)]
    images: list = [None, None]
    feats: list = [None, None]
    if cfg.vision is not None and tp == 1:
        from k3deploy.model.vision import VisionModel
        from k3deploy.runtime.vision import expand_placeholders, pack_images
        imgs = smoke_images(ckpt)
        pad = cfg.vision.media_placeholder_token_id
        prompts.append(expand_placeholders([11, 12, pad, 13, 14, 15, pad, 16], imgs, pad))
        images.append(imgs)
        px, grids = pack_images(imgs)
        feats.append(VisionModel.from_checkpoint(ckpt).reference(px, grids))
    ref_model = K3Model.from_checkpoint(ckpt)
    want = []
    for p, f in zip(prompts, feats):
        st = SequenceState(cfg, len(p) + steps + 1)
        logits, _ = forward(ref_model, p, st, image_features=f)
        toks = []
        for _ in range(steps):
            t = int(torch.argmax(logits[-1]))
            toks.append(t)
            logits, _ = forward(ref_model, [t], st)
        want.append(toks)
    if tp > 1:
        got = [_generate_tp(out, backend, tp, p, steps) for p in prompts]
    else:
        llm = LLM(str(out), backend=backend, **llm_kw)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True),
                                                 images=images if len(prompts) > 2 else None)]
    return {"backend": backend, "tp": tp, "prompts": prompts, "images": [None if i is None else [m.grid_thw for m in i]
                                                                         for i in images],
            "runtime": got, "reference": want, "match": got == want}


def build(args) -> int:
    """Run the pipeline for parsed CLI `args`; returns the exit status (0 ok, 1 verification/smoke mismatch).
    Raises BuildError / CheckpointError / ConfigError / ValueError / OSError with one message for the user."""
    if args.aot:   # before anything is written (the plan included), --dry-run too
        try:
            aot_backend = args.backend if args.backend not in (None, "tensorrt") else pick_backend(args.backend)
        except BuildError:   # --backend tensorrt requested, not importable
            from k3deploy.engines.trt import FLAVOR_HINT
            raise BuildError(f"--aot: ahead-of-time plugins need full TensorRT >= 10.9; {FLAVOR_HINT['tensorrt']}; "
                             "or drop --aot") from None
        if aot_backend != "tensorrt":
            raise BuildError(f"--aot: ahead-of-time plugins need full TensorRT (--backend tensorrt), not "
                             f"{aot_backend}; install TensorRT >= 10.9 or drop --aot")
    ckpt = Path(args.checkpoint) if args.checkpoint else default_checkpoint()
    if not ckpt.exists():
        raise BuildError(f"--checkpoint {ckpt}: does not exist; point it at a K3 checkpoint directory")
    if ckpt.is_file():
        raise BuildError(f"--checkpoint {ckpt}: is a file; pass the checkpoint directory ({ckpt.parent})")
    if not (ckpt / "config.json").is_file():
        raise BuildError(f"--checkpoint {ckpt}: no config.json there; point it at a K3 checkpoint directory")
    cfg = load_config(ckpt)
    config_only = not (ckpt / "model.safetensors.index.json").is_file()
    from k3deploy.export.plan import make_plan
    from k3deploy.model.sharding import check_parallel
    ep = args.ep if args.ep is not None else 1
    check_parallel(cfg, args.tp, ep)
    max_context = args.max_context or min(cfg.max_position_embeddings, 4096)
    if args.block_size > max(64, max_context):
        raise BuildError(f"--block-size {args.block_size}: larger than a request (--max-context {max_context}); "
                         "pass --block-size 64 (the default) or a multiple of 16 up to --max-context")
    processor = vision_max = None
    if cfg.vision is not None:
        from k3deploy.runtime.vision import load_processor
        processor = load_processor(ckpt)
        vision_max = args.vision_max_patches or processor.max_patches()
        if vision_max < 4:
            raise BuildError(f"--vision-max-patches {vision_max}: an image takes at least 4 patches (2x2); pass >= 4")
    plan = make_plan(cfg, args.tp, ep, max_batch=args.max_batch, max_context=max_context, block_size=args.block_size,
                     vision_patches=vision_max, prefix_caching=args.enable_prefix_caching,
                     num_snapshots=args.num_snapshots)
    from k3deploy.engines.build import parse_target_cc
    try:   # the spelling (sm86 / 86 / 8.6) is checked here, support by the installed RTX below
        targets = parse_target_cc(args.target_cc)
    except ValueError as e:
        raise BuildError(f"--target-cc: {e}") from e
    if args.dry_run or config_only:
        if config_only and not args.dry_run:
            print(f"{ckpt} holds only config.json: printing the plan (there are no weights to export)")
        print(plan.report())
        return 0

    backend = pick_backend(args.backend)
    out = Path(args.out) if args.out else Path("out") / f"{ckpt.name}-tp{args.tp}-ep{ep}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise BuildError(f"--out {out}: not writable ({e.strerror}); choose a directory you can write") from e
    if backend == "tensorrt-rtx" and targets:   # refuse an unbuildable target now, not at step 5
        from k3deploy.engines.build import check_target_cc, load_trt
        try:
            check_target_cc(load_trt(backend), targets)
        except ValueError as e:
            raise BuildError(f"--target-cc: {e}") from e
    target = [t.lower() for t in targets] or (["sm86"] if backend == "tensorrt-rtx" else None)   # what step 5 builds
    pipe = Pipeline(out, args.force)
    fp = checkpoint_fingerprint(ckpt)

    def step_checkpoint():
        ck = Checkpoint(ckpt)
        ck.validate()
        fin = ck.check_finite(sample=args.check_finite == "sampled", progress=sys.stderr.isatty())
        how = (f"{fin['tensors']} float/scale tensors finite" if not fin["sampled"] else
               f"{fin['tensors']} float/scale tensors finite in samples ({fin['bytes_read']:,} of "
               f"{fin['bytes_stored']:,} B read)")
        return (f"{ckpt} valid ({ck.data_bytes():,} B, config {cfg.config_hash()}; {how})",
                {"bytes": ck.data_bytes(), "finite": args.check_finite})

    pipe.run(1, "checkpoint", [fp, args.check_finite], [], step_checkpoint)

    def step_plan():
        (out / "plan.txt").write_text(plan.report() + "\n")
        print(plan.report())
        return f"{plan.weights.total:,} B of weights per rank, {len(plan.cfg.kda_layers)} KDA + {len(plan.cfg.mla_layers)} MLA layers", None

    pipe.run(2, "plan", [fp, args.tp, ep, args.max_batch, max_context, args.enable_prefix_caching, args.num_snapshots],
             [out / "plan.txt"],
             step_plan)

    from k3deploy.export.onnx_export import code_hash, export_model
    onnx_dir = out / "onnx"
    exp_inputs = [fp, args.tp, ep, code_hash()]
    if cfg.vision is not None:
        from k3deploy.export.onnx_export import _VISION_CODE_FILES
        exp_inputs.append(code_hash(_VISION_CODE_FILES))

    def step_export():
        index = export_model(ckpt, onnx_dir, tp=args.tp, ep=ep)
        return f"{len(index['graphs'])} graphs for {args.tp} rank(s) in {onnx_dir}", None

    pipe.run(3, "export", exp_inputs, [onnx_dir / "index.json"], step_export)

    def step_verify():
        from k3deploy.export.verify import verify
        prev_path = out / "verify" / "report.json"
        try:    # graphs verified before with unchanged inputs keep their result (export.verify: previous)
            previous = json.loads(prev_path.read_text()) if prev_path.is_file() else None
        except json.JSONDecodeError:
            previous = None
        report = verify(onnx_dir, ckpt, previous=previous)
        (out / "verify").mkdir(exist_ok=True)
        write_json_atomic(report, out / "verify" / "report.json")
        results = dict(report["graphs"])
        for k in ("end_to_end", "vision_end_to_end"):
            if k in report:
                results[k] = report[k]
        bad = [k for k, r in results.items() if not r["passed"]]
        scope = "" if args.tp == 1 else ", end to end: TP > 1 segments are compared together"
        return (f"{len(results) - len(bad)}/{len(results)} comparisons pass "
                f"({'every output and state within tolerance' if not bad else 'FAILED: ' + ', '.join(bad[:5])}{scope})",
                {"failed": bad})

    verified = pipe.run(4, "verify", exp_inputs, [out / "verify" / "report.json"], step_verify)
    if verified and verified["failed"]:
        log.error("Polygraphy verification failed for %s; see %s", verified["failed"], out / "verify" / "report.json")
        return 1

    eng_dir = out / "engines"
    dims = engine_dims(cfg, args.max_batch, args.max_num_tokens, max_context, args.block_size)
    from k3deploy.engines.build import default_profile_dims
    profile_dims = default_profile_dims(args.max_batch, args.max_num_tokens, dims)
    vprofiles = None
    if cfg.vision is not None:
        vprofiles = vision_profiles(vision_max, args.vision_max_images or args.max_batch, cfg.vision.pos_emb_time)
        for prof, vp in zip(profile_dims, vprofiles):
            prof.update(vp)

    def step_engines():
        if backend == "onnxruntime":
            return ("skipped: no TensorRT installed here (install the `rtx` extra for ahead-of-time RTX builds, or "
                    "TensorRT on a GPU host); the runtime serves the ONNX graphs with onnxruntime"), {"built": False}
        from k3deploy.engines.build import build_all
        m = build_all(onnx_dir, eng_dir, target_cc=target, profile_dims=profile_dims, force=args.force,
                      trt_flavor=backend, aot=args.aot)
        return f"{len(m['engines'])} {backend} engines in {eng_dir} (target {target or 'this GPU'})", {"built": True}

    engines = pipe.run(5, "engines", exp_inputs + [backend, target, args.max_batch, args.max_num_tokens, profile_dims,
                                                   args.aot],
                       [eng_dir / "manifest.json"] if backend != "onnxruntime" else [], step_engines)
    # The runtime can execute engines only with full TensorRT on a GPU; otherwise it serves the ONNX graphs.
    serve_backend = "tensorrt" if backend == "tensorrt" else "onnxruntime"

    def step_repository():
        from k3deploy.serve.repository import write_repository
        manifest = {"format": "k3deploy.build/1", "checkpoint": str(ckpt.resolve()), "onnx": "onnx",
                    "engines_dir": "engines" if engines and engines.get("built") else None,
                    "engine_flavor": backend if engines and engines.get("built") else None,
                    "backend": serve_backend, "tp": args.tp, "ep": ep, "config_hash": cfg.config_hash(),
                    "max_batch": args.max_batch, "max_num_tokens": args.max_num_tokens, "max_context": max_context,
                    "block_size": args.block_size, "enable_prefix_caching": args.enable_prefix_caching,
                    "num_snapshots": plan.memory.num_snapshots if plan.memory and args.enable_prefix_caching else None,
                    "snapshot_interval": args.snapshot_interval,
                    "verify_report": "verify/report.json", "triton_repository": "triton",
                    "vision": vision_manifest(cfg, vprofiles, processor) if vprofiles else None}
        write_json_atomic(manifest, out / "manifest.json")
        cfg_path = write_repository(out, out / "triton", serve_backend, max_batch=args.max_batch,
                                    max_num_tokens=args.max_num_tokens, max_context=max_context, overwrite=True,
                                    enable_prefix_caching=args.enable_prefix_caching,
                                    num_snapshots=args.num_snapshots, snapshot_interval=args.snapshot_interval)
        return f"manifest.json + Triton repository {cfg_path.parent.parent} (backend {serve_backend})", None

    pipe.run(6, "repository", exp_inputs + [backend, serve_backend, args.max_batch, args.max_num_tokens, max_context,
                                         args.block_size, vprofiles, args.enable_prefix_caching, args.num_snapshots,
                                         args.snapshot_interval],
             [out / "manifest.json", out / "triton"], step_repository)

    def step_smoke():
        try:
            res = smoke(out, ckpt, serve_backend, tp=args.tp, max_batch=args.max_batch,
                        max_num_tokens=args.max_num_tokens, max_context=max_context)
        except BaseException:
            (out / "manifest.json").unlink(missing_ok=True)        # unverified: OUT must not look complete
            raise
        write_json_atomic(res, out / "smoke.json")
        verdict = "equal to the reference" if res["match"] else "DIFFER from the reference"
        return (f"{serve_backend} greedy tokens on {args.tp} rank(s) for {len(res['prompts'])} prompts {verdict}",
                {"match": res["match"]})

    sm = pipe.run(7, "smoke", exp_inputs + [serve_backend, args.max_batch, args.max_num_tokens, max_context],
                  [out / "smoke.json"], step_smoke)
    if not sm["match"]:
        (out / "manifest.json").unlink(missing_ok=True)            # OUT must not look complete
        log.error("smoke generation differs from the reference; see %s (manifest.json removed: %s is not a "
                  "deployment)", out / "smoke.json", out)
        return 1
    log.info("deployment ready in %s (ran: %s; skipped: %s)", out, ", ".join(pipe.ran) or "-", ", ".join(pipe.skipped) or "-")
    return 0


def parse_args(argv=None, prog=None):
    """The CLI's arguments; exits 2 with a message naming the flag for a value < 1."""
    plan_only = argv is not None and list(argv[:1]) == ["--dry-run"] and str(prog or "").endswith(" plan")
    description = ("The deployment plan of a checkpoint (weights and shapes per rank, decode state, the cache plan, "
                   "the graphs): build's plan step alone, allocating no weights; it takes build's options."
                   if plan_only else __doc__.split("\n\n")[0])
    ap = argparse.ArgumentParser(prog=prog or "python export/build_engines.py", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="K3 checkpoint directory (config.json, index, shards). Default: the embedded "
                                         "k3-tiny synthetic checkpoint, generated on first use. A directory with only "
                                         "config.json prints the plan.")
    ap.add_argument("--out", help="output directory (default out/<checkpoint name>-tp<N>-ep<M>)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; must divide the KDA and MLA heads (default 1)")
    ap.add_argument("--ep", type=int, default=None, help="expert-parallel ranks: 1 (experts split by TP) or equal to --tp (default 1)")
    ap.add_argument("--backend", choices=["tensorrt", "tensorrt-rtx", "onnxruntime"], default=None,
                    help="engine builder (default: tensorrt if installed, else tensorrt-rtx, else onnxruntime = no engines)")
    ap.add_argument("--target-cc", nargs="+", default=None,
                    help="compute capabilities for ahead-of-time TensorRT-RTX builds, e.g. sm86 sm89 or sm86,sm89 "
                         "(default sm86)")
    ap.add_argument("--max-batch", type=int, default=8, help="decode profile: max sequences per step (default 8)")
    ap.add_argument("--max-num-tokens", type=int, default=256, help="prefill profile: max packed tokens per step (default 256)")
    ap.add_argument("--max-context", type=int, default=None, help="max tokens per request (default min(config, 4096))")
    ap.add_argument("--vision-max-patches", type=int, default=None,
                    help="with a vision tower: patches one image may take in the vision engine (default: the bound of "
                         "the checkpoint's processor limits, 67,588 for K3's; a serving cap below it refuses larger "
                         "images, VISION.md §13 Q8)")
    ap.add_argument("--vision-max-images", type=int, default=None,
                    help="with a vision tower: equal-size small images (<= 4096 patches) per vision engine call "
                         "(default --max-batch)")
    ap.add_argument("--block-size", type=int, default=64,
                    help="latent cache tokens per block, fixed in the engine profiles; a multiple of 16 (default 64: "
                         "the MLA kernels' key tiles stay inside one block, so 16 caps them at 16 keys)")
    ap.add_argument("--check-finite", choices=["full", "sampled"], default="full",
                    help="checkpoint step: read every float tensor and MXFP4 scale whole for NaN/Inf (full, default; "
                         "K3: ~199 GB of the 1.56 TB, the FP4 codes need no reading) or every tensor up to 64 KiB and "
                         "8 windows of 4 KiB of larger ones (sampled: ~8 GB for K3; catches a tensor gone NaN, "
                         "not a single bad value); docs/OPERATIONS.md")
    ap.add_argument("--aot", action="store_true",
                    help="full TensorRT >= 10.9 only: every kimi op as ahead-of-time plugins (PTX baked into the "
                         "engines, no Python at runtime; Mxfp4Moe, KdaPrefill and MlaPrefill as chains of "
                         "single-launch ops; AOT MlaDecode does not split the context, so it is slower at long "
                         "contexts; the KdaPrefill chain needs fla-core 0.6.0)")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="serve with prefix caching: the Triton repository runs LLM(enable_prefix_caching=True), which "
                         "reuses the KDA state and latent blocks of prefixes earlier requests computed (multi-turn "
                         "chats, shared system prompts); the plan budgets its snapshot pool. Engines are unchanged "
                         "(docs/PREFIX_CACHING.md)")
    ap.add_argument("--num-snapshots", type=int, default=None,
                    help="with --enable-prefix-caching: KDA snapshot pool rows (one request's KDA state each), "
                         "budgeted by the plan and served (default: 2 x --max-batch)")
    ap.add_argument("--snapshot-interval", type=int, default=None,
                    help="with --enable-prefix-caching: tokens between periodic KDA snapshots, a multiple of "
                         "--block-size (default: 1024 rounded up to one)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan only; allocates no weights; checks the --target-cc spelling but not the "
                         "backend (except with --aot) or which targets it supports (plan on a machine without "
                         "TensorRT; the real run checks them first)")
    ap.add_argument("--force", action="store_true", help="redo every step even when its inputs are unchanged")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    a = ap.parse_args(argv)
    for name in ("tp", "max_batch", "max_num_tokens", "max_context", "ep", "vision_max_patches", "vision_max_images"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    from k3deploy.serve.repository import RepositoryError, check_prefix_caching
    try:
        check_prefix_caching(a.enable_prefix_caching, a.num_snapshots, a.snapshot_interval)
    except RepositoryError as e:
        ap.error(str(e))
    if a.snapshot_interval is not None and a.snapshot_interval % a.block_size:
        ap.error(f"--snapshot-interval {a.snapshot_interval}: must be a multiple of --block-size {a.block_size}")
    if a.block_size < 16 or a.block_size % 16:
        ap.error(f"--block-size {a.block_size}: must be a positive multiple of 16 (16, 32, 64, ...; the MLA "
                 "kernels' key tiles take 16 tokens at least)")
    return a


def main(argv=None, prog=None) -> int:
    """CLI entry: every failure becomes one `error: ...` line and exit status 2 (1 for a mismatch)."""
    args = parse_args(argv, prog)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    if not args.verbose:
        # Each step prints its progress and one summary line (this module's logger); the stages' own INFO lines
        # (one per graph or engine) and onnxscript / onnx_ir's (each graph rewrite: hundreds per export) show
        # with -v only. Warnings and errors always show.
        for name in ("k3deploy", "onnxscript", "onnx_ir"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return build(args)
    except (BuildError, CheckpointError, ConfigError, ValueError, FileNotFoundError) as e:
        log.error("error: %s", e)
        return 2
    except OSError as e:
        if e.errno == errno.ENOSPC:
            log.error("error: disk full while writing %s; free space or choose another --out (partial files were "
                      "written under temporary names and are not used)", e.filename or "the output")
        else:
            log.error("error: %s", e)
        return 2
    except Exception as e:  # noqa: BLE001 - one message, never a bare traceback; -v shows it
        log.debug("traceback", exc_info=True)
        log.error("error: %s: %s (rerun with -v for the traceback)", type(e).__name__, e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
