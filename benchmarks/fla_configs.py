"""fla-core kernel configs from Triton autotune results, so a GPU run skips fla's autotuning for shapes it has not
tuned yet (e.g. the KDA prefill at 12 heads when only the 96-head results were carried):

    python benchmarks/fla_configs.py .autotune/decode --out /tmp/fla_configs
    FLA_CACHE_MODE=fuzzy FLA_CONFIG_DIR=/tmp/fla_configs python benchmarks/bench_decode.py --preset k3-tp8-rank ...

Input: directories holding Triton's `<kernel>.autotune.json` files (a TRITON_CACHE_DIR, or what
benchmarks/gpu_run.sh saves as autotune_<mode>.tgz, unpacked). Output: one `<kernel>.json` per fla kernel in
fla-core's config-file format (fla/ops/utils/cache.py: `autotune_entries` keyed by the md5 of the tuning key, each
the fastest config of that key by median time). With FLA_CACHE_MODE=fuzzy fla takes an exact key match, else the
first entry whose key has the same structure (numbers may differ: head count, widths), else autotunes. A fuzzy
match runs a config tuned for another shape: correct, possibly slower than a tuned one (say so next to any number
measured with it). Prints one line per kernel written.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path


def key_hash(key) -> str:
    """fla's `AutotuneKey.key_hash`: md5 of the key as compact JSON with sorted keys."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def collect(dirs: list[Path]) -> dict[str, dict]:
    """{kernel name: {key hash: {"autotune_key", "config"}}} from every `*.autotune.json` under `dirs` (the fastest
    config per key; a later file with the same key replaces an earlier one). ValueError naming a malformed file."""
    out: dict[str, dict] = {}
    for d in dirs:
        for f in sorted(Path(d).rglob("*.autotune.json")):
            try:
                data = json.loads(f.read_text())
                key, timed = data["key"], data["configs_timings"]
                best = min(timed, key=lambda ct: ct[1][0] if isinstance(ct[1], list) else ct[1])[0]
            except (KeyError, ValueError, IndexError, TypeError) as e:
                raise ValueError(f"{f}: not a Triton autotune result ({e})") from None
            name = f.name[: -len(".autotune.json")]
            out.setdefault(name, {})[key_hash(key)] = {"autotune_key": key, "config": best}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/fla_configs.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("dirs", nargs="+", type=Path, help="directories with Triton *.autotune.json files")
    ap.add_argument("--out", type=Path, required=True, help="FLA_CONFIG_DIR to write")
    a = ap.parse_args(argv)
    missing = [d for d in a.dirs if not d.is_dir()]
    if missing:
        print(f"error: not a directory: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    try:
        kernels = collect(a.dirs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    for name, entries in sorted(kernels.items()):
        (a.out / f"{name}.json").write_text(json.dumps({"kernel_name": name, "autotune_entries": entries}, indent=1))
        print(f"{name}: {len(entries)} tuned keys")
    return 0


if __name__ == "__main__":
    sys.exit(main())
