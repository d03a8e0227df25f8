"""Vision tower benchmark (VISION.md §9): the runtime's torch tower against a plain eager transcription of the
reference, as a fraction of the bf16 GEMM peak measured in the same run, plus the time to first token of an
image prompt.

    python benchmarks/bench_vision.py --device cuda --out bench_vision.jsonl --plot bench_vision.png
    python benchmarks/bench_vision.py --device cpu --preset k3-tiny-vl --sizes 56,112 --depths 2 --iters 1 \\
        --gemm 256 --ttft-preset k3-tiny-vl --ttft-image 56 --ttft-text 8      # the CPU smoke (tests/benchmarks)

What it measures, per tower depth (`--depths`: 2 = k3-vision-slice, 27 = K3's full tower; random weights drawn on
the device, `model.synthetic`) and image size (`--sizes`: square images of S x S pixels, `--images-per-call` of them
packed into one call):

* `ours`: `model.vision.VisionModel.forward` in bf16 (what the torch backend runs on CUDA): packed GEMMs over all
  patches, SDPA attention over [images, 12, ℓ, 128] (FlashAttention on the GPU), §12 numerics;
* `peer`: `VisionModel.reference` in bf16: the release's eager path (F.interpolate position rows, complex RoPE,
  attention over the packed sequence with a materialized block-diagonal [L, L] mask and scores); skipped (null,
  with the reason) when its [heads, L, L] fp32 scores would exceed `--peer-max-gib`;
* `gemm_peak_tflops`: the best of `--gemm`³ bf16 matmuls timed in this run (the bound the tower is judged against).

For each: median ms per call over `--iters` (after `--warmup`), images/s, patches/s, tokens/s (merged image tokens
= `<|media_pad|>` rows the text model receives), TFLOP/s from `model.vision.tower_flops` (GEMMs + attention) and
its fraction of the GEMM peak; `speedup` = peer ms / ours ms. Targets (not asserted): >= 50% of the GEMM peak at
1024², >= 3x the eager peer.

TTFT (`--ttft-preset`, default k3-vision-slice: k3-slice's text model + a 2-block tower): one `--ttft-image`² image
+ `--ttft-text` text tokens through the runtime (TorchExecutor with its vision tower, HybridCache, Scheduler):
seconds from submitting the request to its first token, with the tower's share, next to the same prompt length
of text only.

Output: one JSON line per record on stdout and appended to `--out`; `--plot PNG` draws ms per image (ours vs peer)
and the fraction of the GEMM peak per size. Exit status 0, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from k3deploy.model.config import load_config, preset_json  # noqa: E402
from k3deploy.model.vision import VisionModel, merged_tokens, tower_flops  # noqa: E402

log = logging.getLogger("bench_vision")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median wall milliseconds of fn() (device synchronized around each call)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def gemm_peak(n: int, device: torch.device, iters: int) -> float:
    """Best TFLOP/s of n x n x n bf16 matmuls (fp32 accumulation) on `device`."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    reps = 10 if device.type == "cuda" else 1
    best = min(time_ms(lambda: [a @ b for _ in range(reps)], device, 1, 1) for _ in range(max(2, iters)))
    return 2 * n ** 3 * reps / (best / 1e3) / 1e12


def tower_config(preset: str, depth: int) -> dict:
    """`preset`'s config.json with vt_num_hidden_layers = depth."""
    j = preset_json(preset)
    j["vision_config"]["vt_num_hidden_layers"] = depth
    return j


def image_grid(size: int, cfg) -> tuple[int, int, int]:
    """Grid of an S x S image under the release's processor (runtime.vision.resize_plan)."""
    from k3deploy.runtime.vision import resize_plan
    return resize_plan(size, size).grid


def bench_tower(a, device: torch.device, peak: float) -> list[dict]:
    out = []
    for depth in a.depths:
        cfg = load_config(tower_config(a.preset, depth))
        vm = VisionModel.from_synthetic(cfg, seed=0, dtype=torch.bfloat16 if a.dtype == "bfloat16" else torch.float32,
                                        device=device)
        v = cfg.vision
        vm.warmup()                                # the serving tower: compiled once, shape-generic
        for size in a.sizes:
            grid = image_grid(size, cfg)
            grids = [grid] * a.images_per_call
            L = sum(t * h * w for t, h, w in grids)
            px = (torch.rand(L, 3, v.patch_size, v.patch_size, device=device) * 2 - 1)
            fl = tower_flops(v, grids)
            with torch.no_grad():
                ours = time_ms(lambda: vm.forward(px, grids), device, a.iters, a.warmup)
                peer_gib = v.num_heads * L * L * 4 / 2 ** 30
                peer, why = None, None
                if peer_gib <= a.peer_max_gib:
                    peer = time_ms(lambda: vm.reference(px, grids), device, a.iters, a.warmup)
                else:
                    why = f"[{v.num_heads}, {L}, {L}] fp32 scores = {peer_gib:.1f} GiB > --peer-max-gib {a.peer_max_gib}"
                if a.check and peer is not None:
                    x, y = vm.forward(px, grids).float(), vm.reference(px, grids).float()
                    rel = float((x - y).norm() / y.norm())
                else:
                    rel = None
            n_tok = sum(merged_tokens(grids))
            rec = {"bench": "vision_tower", "preset": a.preset, "depth": depth, "size": size, "grid": list(grid),
                   "images_per_call": a.images_per_call, "patches": L, "tokens": n_tok, "dtype": a.dtype,
                   "ours_ms": ours, "peer_ms": peer, "peer_skipped": why,
                   "speedup": None if peer is None else peer / ours,
                   "images_per_s": a.images_per_call / (ours / 1e3), "patches_per_s": L / (ours / 1e3),
                   "tokens_per_s": n_tok / (ours / 1e3), "tflop": fl["total"] / 1e12,
                   "tflop_attention": fl["attention"] / 1e12, "ours_tflops": fl["total"] / (ours / 1e3) / 1e12,
                   "peer_tflops": None if peer is None else fl["total"] / (peer / 1e3) / 1e12,
                   "gemm_peak_tflops": peak}
            rec["ours_frac_peak"] = rec["ours_tflops"] / peak
            rec["peer_frac_peak"] = None if peer is None else rec["peer_tflops"] / peak
            rec["ours_vs_peer_rel_err"] = rel
            out.append(rec)
            emit(rec, a.out)
        del vm
    return out


def bench_ttft(a, device: torch.device) -> dict:
    """Seconds from submit to first token for one image + text, through the runtime on `device`."""
    from k3deploy.model.reference import K3Model
    from k3deploy.runtime.api import SamplingParams
    from k3deploy.runtime.cache import HybridCache
    from k3deploy.runtime.executor import TorchExecutor
    from k3deploy.runtime.scheduler import Scheduler
    from k3deploy.runtime.vision import process_image
    from PIL import Image
    cfg = load_config(a.ttft_preset)
    cuda = device.type == "cuda"
    from k3deploy.plugins.torch_ops import TorchOps
    from k3deploy.model.reference import ReferenceOps
    t0 = time.perf_counter()
    model = K3Model.from_synthetic(cfg, seed=0, device=device, ops=TorchOps if cuda else ReferenceOps,
                                   dense_dtype="bfloat16" if cuda else None)
    vm = VisionModel.from_synthetic(cfg, seed=0, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    build_s = time.perf_counter() - t0
    ex = TorchExecutor(model, vision=vm)
    import numpy as np
    img = process_image(Image.fromarray(np.random.default_rng(0).integers(0, 256, (a.ttft_image, a.ttft_image, 3),
                                                                           dtype=np.uint8)))
    pad = cfg.vision.media_placeholder_token_id
    text = [(7 * i + 3) % 1000 + 1 for i in range(a.ttft_text)]
    ids = text[: a.ttft_text // 2] + [pad] * img.num_tokens + text[a.ttft_text // 2:]
    bs = ex.preferred_block_size()
    ctx = -(-(len(ids) + 8) // bs) * bs

    def run(images):
        cache = HybridCache(cfg, 2, 1 + ctx // bs, bs, ex.tp, ex.act_dtype, device, ctx)
        sched = Scheduler(ex, cache, 1, max(len(ids), 1), cfg.eos_token_id)
        first = []
        sched.add("r", ids if images else [t if t != pad else 5 for t in ids], SamplingParams(max_tokens=1, ignore_eos=True),
                  lambda tok, fin, err: first.append(time.perf_counter()), images=images)
        _sync(device)
        t = time.perf_counter()
        sched.run_until_done()
        _sync(device)
        return first[0] - t

    tower = lambda: ex.encode_images(img.pixel_values, torch.tensor([img.grid_thw]))   # noqa: E731
    for _ in range(a.warmup):
        run([img])
        run(None)
    ttft = statistics.median(run([img]) for _ in range(a.iters))
    text_only = statistics.median(run(None) for _ in range(a.iters))
    with torch.no_grad():
        tower_ms = time_ms(tower, device, a.iters, a.warmup)
    rec = {"bench": "ttft", "preset": a.ttft_preset, "image": a.ttft_image, "grid": list(img.grid_thw),
           "image_tokens": img.num_tokens, "text_tokens": a.ttft_text, "prompt_tokens": len(ids),
           "ttft_s": ttft, "text_only_ttft_s": text_only, "tower_ms": tower_ms,
           "tower_share": tower_ms / 1e3 / ttft, "build_s": build_s}
    emit(rec, a.out)
    return rec


def emit(rec: dict, path: Path | None) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if path is not None:
        with open(path, "a") as f:
            f.write(line + "\n")


def plot(records: list[dict], path: Path) -> None:
    """ms per image (ours vs peer) and the fraction of the GEMM peak, per size, one line per depth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for depth in sorted({r["depth"] for r in records}):
        rs = [r for r in records if r["depth"] == depth]
        xs = [r["size"] for r in rs]
        ax1.plot(xs, [r["ours_ms"] / r["images_per_call"] for r in rs], "o-", label=f"ours, {depth} blocks")
        pe = [(r["size"], r["peer_ms"] / r["images_per_call"]) for r in rs if r["peer_ms"]]
        if pe:
            ax1.plot(*zip(*pe), "x--", label=f"eager peer, {depth} blocks")
        ax2.plot(xs, [r["ours_frac_peak"] for r in rs], "o-", label=f"{depth} blocks")
    ax1.set(xlabel="image side (px)", ylabel="ms per image", yscale="log", title="vision tower, bf16")
    ax2.set(xlabel="image side (px)", ylabel="fraction of the bf16 GEMM peak", title="ours: TFLOP/s / GEMM peak")
    ax2.axhline(0.5, color="gray", lw=0.5)
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated integers like 448,1024") from None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python benchmarks/bench_vision.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--preset", default="k3-vision-slice", help="tower shapes (default %(default)s: K3's)")
    ap.add_argument("--depths", type=_ints, default=[2, 27], help="tower blocks to measure (default 2,27)")
    ap.add_argument("--sizes", type=_ints, default=[448, 1024, 1792], help="square image sides in px (default 448,1024,1792)")
    ap.add_argument("--images-per-call", type=int, default=1, help="images of one size packed per call (default 1)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="tower dtype (default bf16)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per measurement (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first (default %(default)s)")
    ap.add_argument("--gemm", type=int, default=8192, help="side of the bf16 GEMM whose TFLOP/s is the peak (default 8192)")
    ap.add_argument("--peer-max-gib", type=float, default=40.0,
                    help="skip the eager peer when its [heads, L, L] fp32 scores exceed this (default %(default)s)")
    ap.add_argument("--check", action="store_true", help="also report ours vs peer relative error")
    ap.add_argument("--ttft-preset", default="k3-vision-slice", help="model of the TTFT run (default %(default)s)")
    ap.add_argument("--ttft-image", type=int, default=1024, help="TTFT image side in px (default %(default)s)")
    ap.add_argument("--ttft-text", type=int, default=64, help="TTFT text tokens (default %(default)s)")
    ap.add_argument("--no-ttft", action="store_true", help="skip the TTFT run")
    ap.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of the tower records")
    a = ap.parse_args(argv)
    for name in ("images_per_call", "iters", "gemm", "ttft_image", "ttft_text"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not a.depths or min(a.depths) < 1 or not a.sizes or min(a.sizes) < 1:
        ap.error("--depths and --sizes must be positive integers")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: torch sees no CUDA device; pass --device cpu", file=sys.stderr)
        return 2
    try:
        load_config(tower_config(a.preset, 1))
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        print(f"error: --preset {a.preset}: {e} (it needs a vision_config: k3-vision-slice, k3-tiny-vl, k3)", file=sys.stderr)
        return 2
    env = {"bench": "env", "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else
           platform.processor() or platform.machine(), "torch": torch.__version__}
    peak = gemm_peak(a.gemm, device, a.iters)
    env["gemm_peak_tflops"] = peak
    emit(env, a.out)
    records = bench_tower(a, device, peak)
    if not a.no_ttft:
        bench_ttft(a, device)
    if a.plot is not None:
        plot(records, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
