"""Cost of the checkpoint step's finite check (model/checkpoint.py `Checkpoint.check_finite`), measured on a checkpoint
and projected onto the released K3 inventory.

    python benchmarks/bench_finite_check.py                          # a k3-tiny synthetic checkpoint (written to a temp dir)
    python benchmarks/bench_finite_check.py --checkpoint DIR --repeat 3 --out finite.jsonl

Measures (1) the bit test's throughput on one thread (the same chunked test `check_finite` runs, over 256 MiB in
memory), (2) for `full` and `sampled`, the wall seconds of `check_finite` on the checkpoint (median of --repeat runs;
after the first run the shards are in the page cache, so this is the CPU cost, not the disk's) and from it the
per-tensor overhead (time not explained by the bytes). It then projects the K3 checkpoint (model.weights inventory of
the `k3` config: how many tensors and bytes each mode reads) as
max(bytes / --disk-gbps, bytes / (bit-test throughput x workers)) + tensors x overhead / workers.
--disk-gbps is an assumption about the storage holding the checkpoint (give yours: NVMe reads ~2-7 GB/s, network
file systems far less). One JSON line per mode on stdout (and appended to --out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def k3_inventory() -> dict:
    """{mode: (tensors read, bytes read)} of the released K3 config, from model.weights."""
    from k3deploy.model.checkpoint import _ITEMSIZE, SAMPLE_WHOLE, SAMPLE_WINDOW, SAMPLE_WINDOWS, Checkpoint
    from k3deploy.model.config import load_config
    from k3deploy.model.weights import all_tensors
    rule = Checkpoint._finite_rule
    n = full = sampled = stored = 0
    for s in all_tensors(load_config("k3")):
        size = _ITEMSIZE[s.dtype] * int(np.prod(s.shape, dtype=np.int64))
        stored += size
        if rule(s.name, s.dtype) is None:
            continue
        n += 1
        full += size
        sampled += min(size, SAMPLE_WINDOWS * SAMPLE_WINDOW) if size > SAMPLE_WHOLE else size
    return {"tensors": n, "full": full, "sampled": sampled, "stored": stored}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None, help="checkpoint to measure (default: k3-tiny synthetic)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per mode (default %(default)s)")
    ap.add_argument("--disk-gbps", type=float, default=2.0, help="storage read bandwidth assumed for the K3 "
                                                                  "projection, GB/s (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines here too")
    a = ap.parse_args(argv)
    from k3deploy.model.checkpoint import Checkpoint
    tmp = None
    ckpt = a.checkpoint
    if ckpt is None:
        from k3deploy.model.config import load_config
        from k3deploy.model.synthetic import write_synthetic
        tmp = tempfile.TemporaryDirectory(prefix="bench_finite_")
        ckpt = write_synthetic(load_config("k3-tiny"), Path(tmp.name) / "ckpt", seed=0)
    ck = Checkpoint(ckpt)
    ck.validate()
    inv = k3_inventory()
    workers = min(8, os.cpu_count() or 1)
    from k3deploy.model.checkpoint import FINITE_CHUNK
    buf = np.random.default_rng(0).integers(0, 1 << 16, size=1 << 27, dtype=np.uint16)
    m = np.uint16(0x7F80)
    t0 = time.perf_counter()
    for i in range(0, buf.size, FINITE_CHUNK):
        np.count_nonzero((buf[i:i + FINITE_CHUNK] & m) == m)
    bit_gbps = buf.nbytes / (time.perf_counter() - t0) / 1e9
    del buf
    for mode in ("full", "sampled"):
        sample = mode == "sampled"
        ck.check_finite(sample=sample)                       # warm the page cache
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            res = ck.check_finite(sample=sample)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        per_tensor = max(0.0, t - res["bytes_read"] / (bit_gbps * 1e9 * workers)) * workers / res["tensors"]
        k3_bytes = inv[mode]
        cpu_s = k3_bytes / (bit_gbps * 1e9 * workers)
        disk_s = k3_bytes / (a.disk_gbps * 1e9)
        row = {"mode": mode, "checkpoint": str(ckpt), "tensors": res["tensors"], "bytes_read": res["bytes_read"],
               "seconds_median": round(t, 4), "bit_test_gbps_one_thread": round(bit_gbps, 3), "workers": workers,
               "per_tensor_us": round(per_tensor * 1e6, 1),
               "k3_tensors": inv["tensors"], "k3_bytes_read": k3_bytes, "k3_bytes_stored": inv["stored"],
               "k3_disk_gbps_assumed": a.disk_gbps,
               "k3_seconds_projected": round(max(disk_s, cpu_s) + inv["tensors"] * per_tensor / workers, 1)}
        line = json.dumps(row)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
