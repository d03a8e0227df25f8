"""How much of the Gluon MXFP4 MoE's time is the MXFP4 decode?

Times `mxfp4_moe` (its Gluon kernels, forced through `_pick_impl`) on the bench_kernels MoE problem (112 experts,
3584 -> 3072, top-16; random codes and E8M0 factors 2^-9 .. 2^-2) beside copies of plugins/moe/kernels_gluon.py whose
decode PTX (`_dq_asm`) is replaced:

* ``no_decode``: the 32-bit word itself becomes the four bf16x2 operands (4 moves, no integer or bf16 work; the
  factors go unused): what the kernels reach when decoding is free.
* ``no_scale_mul``: the decode without its bf16x2 multiplies by the E8M0 factor (13 instead of 17 instructions per
  8 weights).
* ``dec14``: the cheapest decode found for a word whose bits were re-laid at load time (an exhaustive search over
  bit layouts of 8 codes per 32-bit word extracted with masks, shifts, one multiply and byte permutes; per 16-bit half:
  bits 0-2 magnitude / 14 sign of output 2, 3-5 / 12 of output 1, 6-8 / 15 of output 0 (in place), 9-11 / 13 of output
  3, read through a byte swap): 10 integer + 4 bf16x2 instructions per 8 weights instead of 13 + 4.

The replaced kernels compute wrong values (the checkpoint's words are not re-laid): timing only, no check. Each
variant is one CUDA graph of 5 calls; rounds interleave the variants; median, min and max µs per call and % of the
copy bandwidth measured in the same run (on the MXFP4 weight and scale bytes the routed experts touch). One JSON line
per (T, variant) on stdout and appended to --out: us / min_us / max_us (µs per call), bytes (weights and scales
touched), pct_copy, copy_GBps, speedup_vs_unchanged (the unchanged kernels' median / this one's). Needs a CUDA GPU
of compute capability >= 9.0 with Gluon (exit status 2 otherwise, or when an edit no longer matches the kernels).

    PYTHONPATH=. python3 benchmarks/moe_decode_floor.py --tokens 64,8 --rounds 9 --out /tmp/moe_floor.jsonl
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys
from pathlib import Path

import torch

log = logging.getLogger("moe_decode_floor")

NO_DECODE = """
        {
        mov.b32 $0, $4;
        mov.b32 $1, $4;
        mov.b32 $2, $4;
        mov.b32 $3, $4;
        }
        """


# ``dec14``'s layout of a re-laid word, per 16-bit half (half 0: codes n0..n3, half 1: n4..n7): output i takes code
# n_i (n_{i+4}) with its 3 magnitude bits at RELAID[i][0] and its sign bit at RELAID[i][1]
RELAID = {0: ((6, 7, 8), 15), 1: ((3, 4, 5), 12), 2: ((0, 1, 2), 14), 3: ((9, 10, 11), 13)}


def relay_word(codes: list[int]) -> int:
    """Eight E2M1 codes n0..n7 (ints 0..15, as kernels_gluon reads a checkpoint word: code j at bits 4j..4j+3) ->
    the re-laid 32-bit word `dq_asm14` decodes (RELAID)."""
    w = 0
    for i, (mag, sign) in RELAID.items():
        for half, c in ((0, codes[i]), (1, codes[i + 4])):
            for b in range(3):
                w |= ((c >> b) & 1) << (mag[b] + 16 * half)
            w |= ((c >> 3) & 1) << (sign + 16 * half)
    return w


def dq_asm14(folded: bool) -> str:
    """PTX of the decode of a re-laid word (module docstring, ``dec14``; `relay_word`): $4 the word, $5 the factor
    bits as in kernels_gluon._dq_asm; $0..$3 the four bf16x2 operands (n_i, n_{i+4}) x the factor."""
    from k3deploy.plugins.moe.kernels_gluon import _dq_finish

    def fin(out):
        return _dq_finish(out, folded)
    return ("""
        {
        .reg .b32 v, w, bias;
        mov.b32 bias, 0x7E807E80;
        mov.b32 v, $4;""" + fin("$0") + """
        shl.b32 v, $4, 3;""" + fin("$1") + """
        and.b32 v, $4, 0x40074007;
        mul.lo.u32 v, v, 0x42;""" + fin("$2") + """
        prmt.b32 w, $4, 0, 0x2301;
        and.b32 v, w, 0x002E002E;
        mul.lo.u32 v, v, 0x420;""" + fin("$3") + """
        }
        """)


VARIANTS = ("no_decode", "no_scale_mul", "dec14")     # the keys of `_edits()` (which needs Triton)


def _edits() -> dict:
    """variant name -> [(text of plugins/moe/kernels_gluon.py, its replacement)]: each text must occur exactly once
    (`edit_source`), so that no variant times the unchanged decode under its own name (the bench's factors all take
    the folded decode, `_DQ_FOLDED`)."""
    plain, folded = "_DQ = gl.constexpr(_dq_asm(False))", "_DQ_FOLDED = gl.constexpr(_dq_asm(True))"

    def both(a: str, b: str) -> list:
        return [(plain, f"_DQ = gl.constexpr({a})"), (folded, f"_DQ_FOLDED = gl.constexpr({b})")]
    return {
        "no_decode": both(repr(NO_DECODE), repr(NO_DECODE)),
        "no_scale_mul": [("mul.rn.bf16x2 {out}, v, $5;", "mov.b32 {out}, v;")],
        "dec14": both(repr(dq_asm14(False)), repr(dq_asm14(True))),
    }


def edit_source(source: str, edits: list) -> str:
    """`source` with each (text, replacement) of `edits` applied. ValueError naming the text when it does not occur
    exactly once (the decode moved: update `_edits`)."""
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"{old!r} occurs {source.count(old)} times in plugins/moe/kernels_gluon.py (expected "
                             "once): update moe_decode_floor._edits()")
        source = source.replace(old, new)
    return source


def load_variant(name: str, source: str, tmpdir: Path):
    """A copy of kernels_gluon from `source`, imported as plugins.moe.kernels_gluon_<name> (written to tmpdir: Gluon
    reads the kernels' source from their file)."""
    path = tmpdir / f"kernels_gluon_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"plugins.moe.kernels_gluon_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def capture_graphs(mods: dict, call, ws_bytes: int, out_shape: tuple, dev) -> tuple[dict, list]:
    """One CUDA graph of 5 `call(out, workspace)` per module of `mods` ({name: a kernels_gluon module}), each
    captured with that module as plugins.moe.kernels_gluon (`mxfp4_moe` imports it at every call; the unchanged
    module is put back afterwards, also on errors). out: fp32 `out_shape`, workspace: uint8 [ws_bytes], one pair
    per graph. Returns ({name: graph}, the tensors the graphs write into: keep them alive while replaying)."""
    import k3deploy.plugins.moe as pm
    unchanged = pm.kernels_gluon
    graphs, keep = {}, []
    try:
        for name, mod in mods.items():
            pm.kernels_gluon = sys.modules["k3deploy.plugins.moe.kernels_gluon"] = mod
            out = torch.empty(out_shape, device=dev)
            ws = torch.zeros(ws_bytes, dtype=torch.uint8, device=dev)
            keep.append((out, ws))
            call(out, ws)           # compiles this module's kernels outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(5):
                    call(out, ws)
            graphs[name] = g
    finally:
        pm.kernels_gluon = sys.modules["k3deploy.plugins.moe.kernels_gluon"] = unchanged
    return graphs, keep


def copy_gbps(dev) -> float:
    """Best of 5 device copies of 1 GiB: bytes read + written per second / 1e9."""
    x = torch.empty(1 << 28, device=dev)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        y.copy_(x)
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e))
    return 2 * x.numel() * 4 / best / 1e6


def main(argv=None) -> int:
    """The CLI (module docstring). Returns the exit status: 0, or 2 without a suitable GPU or when the kernels'
    decode no longer matches a variant's edits."""
    head, rest = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(description=head, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest)
    ap.add_argument("--tokens", default="64,8", help="comma-separated token counts T (default 64,8)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds (default 9)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated variants timed beside the unchanged kernels (default all three)")
    ap.add_argument("--tmpdir", type=Path, default=Path("/tmp/moe_decode_floor"),
                    help="where the variant modules are written (default /tmp/moe_decode_floor)")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        ap.error(f"--variants {','.join(bad)}: choose from {', '.join(VARIANTS)}")
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: time at least one round")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        log.error("needs a CUDA GPU of compute capability >= 9.0 (the Gluon kernels' bf16x2 decode)")
        return 2
    from bench_common import forced     # benchmarks/, this script's folder
    try:
        from k3deploy.plugins.moe import kernels as mk
        from k3deploy.plugins.moe import kernels_gluon as kg0
    except ImportError as e:
        log.error("needs Triton with Gluon (pip install -e '.[gpu]'): %s", e)
        return 2
    edits = _edits()
    source = Path(kg0.__file__).read_text()
    a.tmpdir.mkdir(parents=True, exist_ok=True)
    try:
        edited = {v: edit_source(source, edits[v]) for v in names}
    except ValueError as e:
        log.error("%s", e)
        return 2
    mods = {"unchanged": kg0} | {v: load_variant(v, src, a.tmpdir) for v, src in edited.items()}
    dev = torch.device("cuda")
    E, D, I, K = 112, 3584, 3072, 16
    torch.manual_seed(0)
    w13p = torch.randint(0, 256, (E, 2 * I, D // 2), device=dev, dtype=torch.uint8)
    w13s = torch.randint(118, 126, (E, 2 * I, D // 32), device=dev, dtype=torch.uint8)
    w2p = torch.randint(0, 256, (E, D, I // 2), device=dev, dtype=torch.uint8)
    w2s = torch.randint(118, 126, (E, D, I // 32), device=dev, dtype=torch.uint8)
    copy = copy_gbps(dev)
    log.info("copy bandwidth %.0f GB/s", copy)
    for T in (int(t) for t in a.tokens.split(",") if t):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16) * 0.1
        ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).int()
        wts = torch.rand(T, K, device=dev)
        touched = torch.unique(ids).numel()
        nbytes = touched * (2 * I * (D // 2 + D // 32) + D * (I // 2 + I // 32))
        with forced(mk, "_pick_impl", "gluon"):
            graphs, keep = capture_graphs(mods, lambda out, ws: mk.mxfp4_moe(
                x, ids, wts, w13p, w13s, w2p, w2s, out=out, workspace=ws),
                mk.mxfp4_moe_workspace_bytes(T, K, E, I, D, device=dev), (T, D), dev)
        times = {n: [] for n in graphs}
        for r in range(a.rounds):
            for n, g in graphs.items():
                g.replay()
                s, e = torch.cuda.Event(True), torch.cuda.Event(True)
                s.record()
                g.replay()
                e.record()
                torch.cuda.synchronize()
                times[n].append(s.elapsed_time(e) * 1e3 / 5)
            log.info("T=%d round %d/%d", T, r + 1, a.rounds)
        for n, ts in times.items():
            med = statistics.median(ts)
            rec = dict(what="moe_decode_floor", T=T, variant=n, us=med, min_us=min(ts), max_us=max(ts),
                       rounds=a.rounds, bytes=nbytes, pct_copy=100 * nbytes / med / 1e3 / copy, copy_GBps=copy,
                       speedup_vs_unchanged=statistics.median(times["unchanged"]) / med,
                       gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=mk.triton.__version__)
            line = json.dumps(rec)
            print(line, flush=True)
            if a.out:
                with a.out.open("a") as f:
                    f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
