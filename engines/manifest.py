"""``manifest.json`` of an engine directory: what was built, from what, with which options.

Layout (``format`` 1)::

    {"format": 1,
     "tensorrt": {"flavor": "tensorrt-rtx", "version": "1.7.1.116"},
     "profile_dims": [{"M": [1, 1, 256], "BS": [64, 64, 64], ...}, ...],   # named-dim ranges per profile
     "engines": {"rank0/layer0.plan": {
         "onnx": "rank0/layer0.onnx", "onnx_sha256": "...",      # .onnx plus its external-data files
         "config_hash": "...", "options": {...},                # build options that went into config_hash
         "compute_capability": ["sm86"], "profiles": [{"x": [[1, 8], [16, 8], [256, 8]]}, ...],
         "inputs": [{"name", "shape", "dtype", "is_shape_tensor"}], "outputs": [...],
         "plugins": {"kimi::KdaPrefill": {"version": "1", "impl": "plugin" | "function-body" | "unknown"}},
         "plan_bytes": 123, "plan_sha256": "...",
         "verified": "engine" | "network", "notes": [...]}}}

``verified`` says how the I/O metadata was checked: ``"engine"`` = read back from the deserialized engine (needs a
GPU), ``"network"`` = from the parsed network and the optimization profiles before serialization (TensorRT-RTX on
a machine without a GPU cannot deserialize).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT = 1


def sha256_file(path: str | os.PathLike, h=None) -> str:
    """Hex sha256 of a file (streamed). Pass ``h`` to keep updating an existing hash object."""
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def onnx_source_sha256(onnx_path: str | os.PathLike) -> str:
    """sha256 over the ``.onnx`` file and, in sorted order, every external-data file it references (weights live
    there, so a weight change must trigger a rebuild). Raises FileNotFoundError naming a missing data file."""
    import onnx

    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    locations = set()
    for tensor in onnx.external_data_helper._get_all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(e.value for e in tensor.external_data if e.key == "location")
    h = hashlib.sha256()
    sha256_file(onnx_path, h)
    for loc in sorted(locations):
        data = onnx_path.parent / loc
        if not data.is_file():
            raise FileNotFoundError(f"{onnx_path}: external data file {loc!r} not found next to the ONNX ({data})")
        h.update(loc.encode())
        sha256_file(data, h)
    return h.hexdigest()


def config_hash(options: Mapping[str, Any]) -> str:
    """Stable sha256 of JSON-serializable build options (key order does not matter)."""
    return hashlib.sha256(json.dumps(options, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def atomic_write_bytes(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder + ``os.replace`` (readers never see a partial
    file). Creates parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def new_manifest(flavor: str, version: str) -> dict:
    return {"format": FORMAT, "tensorrt": {"flavor": flavor, "version": version}, "engines": {}}


def read_manifest(out_dir: str | os.PathLike) -> dict | None:
    """Return the manifest of ``out_dir`` or None when there is none. Raises ValueError for an unreadable or
    wrong-format manifest (fix: delete it or rebuild with --force)."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it or rebuild with --force") from e
    if data.get("format") != FORMAT or not isinstance(data.get("engines"), dict):
        raise ValueError(f"{path}: field 'format' is {data.get('format')!r}, expected {FORMAT}; "
                         f"delete it or rebuild with --force")
    return data


def write_manifest(out_dir: str | os.PathLike, manifest: Mapping[str, Any]) -> Path:
    """Atomically write ``manifest.json`` into ``out_dir``; returns its path."""
    path = Path(out_dir) / MANIFEST_NAME
    atomic_write_bytes(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return path


def is_up_to_date(entry: Mapping[str, Any] | None, plan_path: str | os.PathLike, onnx_sha256: str,
                  cfg_hash: str) -> bool:
    """True when ``entry`` (a manifest engine entry) was built from the same source hash and build-options hash and
    the plan file still exists: then the build can be skipped."""
    return (entry is not None and Path(plan_path).is_file() and entry.get("onnx_sha256") == onnx_sha256
            and entry.get("config_hash") == cfg_hash)
