"""Which V tile should the fused KDA decode take at a given batch? (the data behind `_decode_block_v`)

Times `plugins.kda.kernels.kda_decode` with each V tile forced (16, 32, 64, 128 = K; bench_common.forced) and with
its own rule (`_decode_block_v`) as a decode step is deployed: one CUDA graph of N steps, each on pools of its own
(K3's 69 KDA layers each own their state and conv pools; a replay touches each pool once and `do_bench` clears L2
before each replay, so a step never finds its state in L2), per step = replay / N. Rounds interleave the tiles; the median per tile. One JSON line per (heads, batch) on stdout and appended to --out:
`us` {tile: µs per step}, `best` (the fastest tile), `default_tile` (what `_decode_block_v` picks). Timing only: the
tiles' results are checked against the reference in tests/plugins/test_kernels.py (`test_kda_decode`, GPU cases) and
by bench_kernels.py's kda_decode family. Needs a CUDA GPU (exit status 2 otherwise).

    PYTHONPATH=. python3 benchmarks/sweep_kda_decode_tiles.py --shapes 12x1,12x16,96x1 --out /tmp/kda_tiles.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

TILES = (16, 32, 64, 128)
SHAPES = "12x1,12x2,12x4,12x8,12x16,12x21,12x32,96x1,96x2,96x4"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'12x1,96x4' -> [(12, 1), (96, 4)] (heads x batch); ValueError naming the bad item."""
    shapes = []
    for item in text.split(","):
        h, _, b = item.strip().partition("x")
        if not (h.isdigit() and b.isdigit() and int(h) > 0 and int(b) > 0):
            raise ValueError(f"{item!r}: expected HEADSxBATCH with positive integers, e.g. 12x64")
        shapes.append((int(h), int(b)))
    return shapes


def main(argv=None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated HEADSxBATCH (default: %(default)s)")
    ap.add_argument("--head-dim", type=int, default=128, help="K = V per head (K3: %(default)s)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per graph, each on its own pools "
                                                          "(default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default: %(default)s)")
    ap.add_argument("--out", default="kda_decode_tiles.jsonl", help="JSON lines appended here (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        ap.error(f"--shapes {e}")
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds: must be >= 1")
    import torch
    if not torch.cuda.is_available():
        print("error: sweep_kda_decode_tiles.py needs a CUDA GPU (torch.cuda.is_available() is False here)",
              file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from bench_common import capture_graph, forced, kda_decode_inputs   # benchmarks/, this script's folder
    from k3deploy.plugins.kda import kernels as kda_k
    K, N, dev = args.head_dim, args.steps, "cuda"

    with open(args.out, "a") as fout:
        for H, B in shapes:
            steps = [kda_decode_inputs(B, H, K, dev) for _ in range(N)]
            outs = [torch.empty(B, H * K, dtype=torch.bfloat16, device=dev) for _ in range(N)]
            tiles = [t for t in TILES if t <= K and K % t == 0]
            graphs = {}
            for t in tiles + [None]:          # captured with the tile forced: the graph keeps it
                with forced(kda_k, "_decode_block_v", t):
                    graphs[str(t) if t else "default"] = capture_graph([
                        lambda x=x, o=o: kda_k.kda_decode(**x[0], state=x[1], conv=x[2], slots=x[3], num_heads=H,
                                                          head_dim=K, out=o)
                        for x, o in zip(steps, outs)])
            times = {name: [] for name in graphs}
            for _ in range(args.rounds):
                for name, g in graphs.items():
                    times[name].append(do_bench(g.replay, warmup=10, rep=40, return_mode="median") * 1e3 / N)
            us = {name: round(statistics.median(ts), 3) for name, ts in times.items()}
            rec = dict(H=H, B=B, n_items=B * H, K=K, steps=N, rounds=args.rounds, us=us,
                       best=min((v, k) for k, v in us.items() if k != "default")[1],
                       default_tile=kda_k._decode_block_v(B * H, K), gpu=torch.cuda.get_device_name(0))
            print(json.dumps(rec), flush=True)
            fout.write(json.dumps(rec) + "\n")
            del steps, outs, graphs
    return 0


if __name__ == "__main__":
    sys.exit(main())
