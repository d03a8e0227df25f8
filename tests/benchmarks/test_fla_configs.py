"""benchmarks/fla_configs.py: Triton autotune results -> fla-core config files that fla's own loader
(fla.ops.utils.cache, FLA_CACHE_MODE=fuzzy) reads back: exact keys, keys of another shape, and no match."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fla_configs  # noqa: E402


def _cfg(bv, warps):
    return {"kwargs": {"BV": bv}, "num_warps": warps, "num_ctas": 1, "num_stages": 2, "maxnreg": None,
            "pre_hook": None, "ir_override": None}


def test_configs_round_trip_through_flas_loader(tmp_path, monkeypatch):
    cache = pytest.importorskip("fla.ops.utils.cache")
    key = [96, 128, 64, True, "torch.bfloat16", "torch.float32"]
    d = tmp_path / "triton" / "HASH1"
    d.mkdir(parents=True)
    (d / "my_kernel.autotune.json").write_text(json.dumps(
        {"key": key, "configs_timings": [[_cfg(32, 2), [0.5, 0.4, 0.6]], [_cfg(64, 4), [0.3, 0.2, 0.4]]]}))
    out = tmp_path / "fla"
    r = subprocess.run([sys.executable, "benchmarks/fla_configs.py", str(tmp_path / "triton"), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "my_kernel: 1 tuned keys" in r.stdout, r.stdout + r.stderr
    monkeypatch.setenv("FLA_CONFIG_DIR", str(out))
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.FUZZY)
    cache.load_config_file.cache_clear()
    exact = cache.load_cached_config("my_kernel", cache.AutotuneKey(tuple(key)))
    other = cache.load_cached_config("my_kernel", cache.AutotuneKey((12, 128, 64, True, "torch.bfloat16",
                                                                      "torch.float32")))
    assert exact == other == _cfg(64, 4)                       # the fastest, for 96 heads and (fuzzy) for 12
    assert cache.load_cached_config("my_kernel", cache.AutotuneKey((12, 128, 64, False, "torch.bfloat16",
                                                                     "torch.float32"))) is None
    assert fla_configs.key_hash(key) == cache.AutotuneKey.key_hash(tuple(key))


def test_bad_inputs_are_one_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/fla_configs.py", str(tmp_path / "none"), "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "not a directory" in r.stderr
    (tmp_path / "x.autotune.json").write_text("{}")
    r = subprocess.run([sys.executable, "benchmarks/fla_configs.py", str(tmp_path), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "x.autotune.json" in r.stderr
