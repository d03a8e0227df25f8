"""Hugging Face checkpoint layout of Kimi K3: writing, lazy reading, validation (MODEL.md §8, §8.4, Q1, Q13).

Layout written (§8.1): `config.json` (the config's `to_json()`), shards `model-{i:05d}-of-{n:06d}.safetensors`
(decoder layer l in shard l+1, model-level tensors and, with a vision_config, the vision tower + projector in the
last shard n = num_hidden_layers + 1, as the release keeps them in its last shard, VISION.md §7.1), optionally
`preprocessor_config.json` (the image processor's `media_proc_cfg`, §1.1), and
`model.safetensors.index.json` = `{"metadata": {"total_size"}, "weight_map": {name: shard}}`, written last.
A checkpoint is built in a temporary sibling directory and renamed into place, so a partial write never
looks complete. Tensor names, stored shapes and dtypes come from `model.weights` (routed experts MXFP4 as
`weight_packed`/`weight_scale` U8 when the config says so, else bf16 `weight`).

Reading (`Checkpoint`) parses each shard's safetensors header itself (8-byte little-endian length N, then N
bytes of JSON, data offsets relative to 8+N; tensor order is never assumed) and memory-maps one tensor at a
time; shards are opened only when one of their tensors is needed.

`Checkpoint.check_finite` reads the values: every float tensor must hold no NaN/Inf and no MXFP4 scale may be the
E8M0 NaN code 255 (§8.3; the E2M1 codes of `weight_packed` have no non-finite value and are not read). It streams
one memory-mapped chunk at a time (bit tests on the raw bytes, no conversion) and names each bad tensor;
`sample=True` reads every tensor up to 64 KiB whole and larger ones in 8 windows of 4 KiB (first and last
included), for checkpoints too large to read in full before every build (docs/OPERATIONS.md gives the costs).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from k3deploy.model.config import K3Config, load_config
from k3deploy.model.weights import (BYTES, PREFIX, VISION_PREFIXES, TensorSpec, all_tensors, layer_tensors,
                                    model_tensors, vision_tensors)

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
PREPROCESSOR_NAME = "preprocessor_config.json"   # the image processor's settings (VISION.md §1.1), when present
LAYER_PREFIX = PREFIX + "model.layers."
SKIP_PREFIXES = VISION_PREFIXES  # vision tower + projector: validated only when the config has a vision_config
MAX_LISTED = 60  # problems spelled out in a CheckpointError message; all are in `.problems`

# safetensors dtype string -> (torch dtype, numpy dtype used to memory-map the raw bytes)
DTYPES = {
    "BF16": (torch.bfloat16, np.uint16), "F16": (torch.float16, np.float16), "F32": (torch.float32, np.float32),
    "F64": (torch.float64, np.float64), "U8": (torch.uint8, np.uint8), "I8": (torch.int8, np.int8),
    "I16": (torch.int16, np.int16), "I32": (torch.int32, np.int32), "I64": (torch.int64, np.int64),
    "BOOL": (torch.bool, np.bool_),
}
TORCH_TO_ST = {t: s for s, (t, _) in DTYPES.items()}
_ITEMSIZE = {s: np.dtype(n).itemsize for s, (_, n) in DTYPES.items()}

# finiteness as bit tests on the raw values: (unsigned view, mask); a value is NaN/Inf iff (bits & mask) == mask
# (float: all exponent bits set; MXFP4 E8M0 scale: 0xFF, §8.3)
_NONFINITE_BITS = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000),
                   "F64": (np.uint64, 0x7FF0000000000000)}
_SCALE_BITS = (np.uint8, 0xFF)
FINITE_CHUNK = 1 << 18          # values per bit test (512 KiB of bf16: stays in cache)
SAMPLE_WHOLE = 64 << 10         # sample=True: tensors up to this many bytes are read whole ...
SAMPLE_WINDOWS, SAMPLE_WINDOW = 8, 4 << 10     # ... larger ones in this many windows of this many bytes


class CheckpointError(ValueError):
    """A checkpoint is unusable. `.problems` lists every problem found (each names the tensor and/or file)."""

    def __init__(self, problems: "list[str] | str", where: "str | Path" = ""):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = f"checkpoint {where}: " if where else ""
        if len(self.problems) == 1:
            msg = head + self.problems[0]
        else:
            shown = self.problems[:MAX_LISTED]
            msg = head + f"{len(self.problems)} problems:\n  - " + "\n  - ".join(shown)
            if len(self.problems) > MAX_LISTED:
                msg += f"\n  ... and {len(self.problems) - MAX_LISTED} more (see CheckpointError.problems)"
        super().__init__(msg)


def shard_name(i: int, n: int) -> str:
    """Shard file name as in the release (§8.1): 5-digit index, 6-digit total, 1-based."""
    return f"model-{i:05d}-of-{n:06d}.safetensors"


def num_shards(cfg: K3Config) -> int:
    """One shard per decoder layer plus one for the model-level tensors."""
    return cfg.num_hidden_layers + 1


def shard_of(cfg: K3Config, spec: TensorSpec) -> int:
    """1-based shard index of a text tensor: layer l -> l+1, model-level -> last."""
    return spec.layer + 1 if spec.layer is not None else num_shards(cfg)


def allowed_forms(cfg: K3Config, spec: TensorSpec) -> tuple[list[tuple[int, ...]], list[str]]:
    """Stored shapes and dtypes accepted for `spec`: the inventory's, plus A_log with exactly num_heads
    entries (§8.4 step 4) and a BF16 e_score_correction_bias (§8.4 step 5, Q9)."""
    shapes, dtypes = [spec.shape], [spec.dtype]
    if spec.name.endswith(".A_log") and spec.shape != (cfg.kda_num_heads,):
        shapes.append((cfg.kda_num_heads,))
    if spec.name.endswith(".e_score_correction_bias"):
        dtypes.append("BF16")
    return shapes, dtypes


# ---- writing ------------------------------------------------------------------------------------

def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU tensor, without a copy when it is already contiguous."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, items: list[tuple[str, str, tuple[int, ...]]],
                      get: Callable[[str], torch.Tensor], metadata: dict | None = None) -> int:
    """Write one safetensors file, fetching tensors one at a time (so a shard never has to sit in memory).

    items: (name, safetensors dtype, shape) for every tensor; data is laid out in lexicographic name order
    (as the release, §8.1). get(name) must return a tensor of exactly that dtype and shape (else ValueError).
    Returns the data bytes written (sum of tensor sizes).
    """
    items = sorted(items)
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    for name, dt, shape in items:
        n = _ITEMSIZE[dt] * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)  # pad so the data blob starts 8-byte aligned (like the safetensors writer)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for name, dt, shape in items:
            t = get(name)
            if TORCH_TO_ST.get(t.dtype) != dt or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: got {TORCH_TO_ST.get(t.dtype, t.dtype)} {tuple(t.shape)}, "
                                 f"declared {dt} {tuple(shape)} for {path.name}")
            f.write(_tensor_bytes(t))
            del t  # drop it before fetching the next one (keeps one big tensor alive at a time)
    return off


class CheckpointWriter:
    """Atomic, streaming writer of the §8 layout. Use as a context manager:

    >>> with CheckpointWriter(out, cfg) as w:            # doctest: +SKIP
    ...     for i, specs in w.plan():  w.write_shard(i, specs, get)

    Everything goes into a temporary sibling directory; `commit()` (called on a clean `with` exit) writes
    the index last and renames the directory to `path`. An existing non-empty `path` is a FileExistsError
    unless overwrite=True (then it is replaced as a whole). On an exception nothing is left behind.
    """

    def __init__(self, path: "str | Path", cfg: K3Config, overwrite: bool = False, preprocessor: dict | None = None):
        self.path, self.cfg, self.overwrite = Path(path), cfg, overwrite
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(f"{self.path}: exists and is not a directory")
        if self.path.is_dir() and any(self.path.iterdir()) and not overwrite:
            raise FileExistsError(f"{self.path}: directory is not empty; pass overwrite=True (CLI: --force) to replace it")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.partial-", dir=self.path.parent))
        os.chmod(self.tmp, 0o755)  # mkdtemp makes it 0700; the finished checkpoint is an ordinary directory
        self.n = num_shards(cfg)
        self.weight_map: dict[str, str] = {}
        self.total = 0
        (self.tmp / CONFIG_NAME).write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
        if preprocessor is not None:
            (self.tmp / PREPROCESSOR_NAME).write_text(json.dumps(preprocessor, indent=2) + "\n")

    def plan(self) -> list[tuple[int, list[TensorSpec]]]:
        """(1-based shard index, specs) for every shard: layers 0..L-1, then model-level (+ vision) tensors."""
        out = [(l + 1, layer_tensors(self.cfg, l)) for l in range(self.cfg.num_hidden_layers)]
        return out + [(self.n, model_tensors(self.cfg) + vision_tensors(self.cfg))]

    def write_shard(self, i: int, items: "Iterable[TensorSpec | tuple[str, str, tuple]]",
                    get: Callable[[str], torch.Tensor]) -> None:
        """Write shard i (1-based) holding `items` (TensorSpecs or (name, dtype, shape)); get(name) -> tensor."""
        items = [(s.name, s.dtype, tuple(s.shape)) if isinstance(s, TensorSpec) else (s[0], s[1], tuple(s[2]))
                 for s in items]
        fname = shard_name(i, self.n)
        self.total += write_safetensors(self.tmp / fname, items, get)
        for name, _, _ in items:
            self.weight_map[name] = fname

    def commit(self) -> Path:
        """Write the index (last), then move the finished directory to `path`."""
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        old = None
        if self.path.is_dir():
            if any(self.path.iterdir()):
                if not self.overwrite:
                    raise FileExistsError(f"{self.path}: became non-empty while writing; not replacing it")
                old = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=self.path.parent))
                os.rename(self.path, old / "ckpt")
            else:
                self.path.rmdir()
        try:
            os.rename(self.tmp, self.path)
        except OSError:
            if old is not None:
                os.rename(old / "ckpt", self.path)  # put the previous checkpoint back
                old.rmdir()
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        log.info("wrote checkpoint %s (%d tensors, %d bytes)", self.path, len(self.weight_map), self.total)
        return self.path

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise


def write_checkpoint(path: "str | Path", cfg: K3Config, tensors: Mapping[str, torch.Tensor], *,
                     overwrite: bool = False, strict: bool = True, preprocessor: dict | None = None) -> Path:
    """Write `tensors` (full names -> tensors in stored dtype) as a §8 checkpoint at `path` (atomic).

    strict=True (default): the names must be exactly the inventory of `model.weights.all_tensors(cfg)` (plus
    `vision_tensors(cfg)` when the config has a vision tower) with its shapes and dtypes (CheckpointError listing
    every difference); without a vision_config, `vision_tower.*`/`mm_projector.*` extras are allowed and go to the
    last shard. strict=False writes whatever is given (test fixtures for corrupt checkpoints): inventory names to
    their shard, unknown layer tensors to their layer's shard, anything else to the last shard.
    preprocessor: written as preprocessor_config.json when given (VISION.md §1.1).
    """
    specs = {s.name: s for s in all_tensors(cfg) + vision_tensors(cfg)}
    if strict:
        problems = [f"missing tensor {n}" for n in specs if n not in tensors]
        for n, t in tensors.items():
            s = specs.get(n)
            if s is None:
                if not n.startswith(SKIP_PREFIXES) or cfg.vision is not None:
                    problems.append(f"unexpected tensor {n} (not in the inventory for this config)")
            else:
                shapes, dtypes = allowed_forms(cfg, s)
                if tuple(t.shape) not in shapes or TORCH_TO_ST.get(t.dtype) not in dtypes:
                    problems.append(f"{n}: got {TORCH_TO_ST.get(t.dtype, t.dtype)} {tuple(t.shape)}, "
                                    f"expected {s.dtype} {s.shape}")
        if problems:
            raise CheckpointError(problems, f"{path} (not written)")
    n = num_shards(cfg)
    by_shard: dict[int, list] = collections.defaultdict(list)
    for name, t in tensors.items():
        if name in specs:
            i = shard_of(cfg, specs[name])
        elif name.startswith(LAYER_PREFIX) and name[len(LAYER_PREFIX):].split(".")[0].isdigit():
            i = min(int(name[len(LAYER_PREFIX):].split(".")[0]) + 1, n)
        else:
            i = n
        if t.dtype not in TORCH_TO_ST:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored in safetensors here")
        by_shard[i].append((name, TORCH_TO_ST[t.dtype], tuple(t.shape)))
    with CheckpointWriter(path, cfg, overwrite=overwrite, preprocessor=preprocessor) as w:
        for i in sorted(by_shard):
            w.write_shard(i, by_shard[i], tensors.__getitem__)
    return Path(path)


# ---- reading ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def read_header(path: Path) -> tuple[dict[str, _Entry], int]:
    """Parse a safetensors header: returns ({name: entry with absolute offsets}, file size).

    Raises CheckpointError (naming the file) for a short file, an absurd header length or invalid JSON.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path.name}: {size} bytes, too short for a safetensors header (truncated shard)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{path.name}: header length {n} runs past the end of the {size}-byte file (truncated shard)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path.name}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: safetensors header is not a JSON object")
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        try:
            b, e = (int(x) for x in h["data_offsets"])
            out[name] = _Entry(str(h["dtype"]), tuple(int(s) for s in h["shape"]), 8 + n + b, 8 + n + e)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path.name}: header entry of tensor {name} is malformed ({e!r})") from e
    return out, size


def _rel(name: str, prefix: str) -> str:
    return name[len(prefix):] if name.startswith(prefix) else name


class Checkpoint:
    """Lazy reader of a §8 checkpoint directory.

    `Checkpoint(path)` reads config.json and the index only (CheckpointError if either is missing or broken,
    ConfigError for a bad config). Shard headers are parsed on first use; tensor data is memory-mapped.
    `.config` is the parsed K3Config, with `experts_mxfp4` set from the files: routed experts are MXFP4
    iff `weight_packed` tensors are present (Q13), whatever quantization_config says.
    """

    def __init__(self, path: "str | Path"):
        self.path = Path(path)
        index_path = self.path / INDEX_NAME
        if not (self.path / CONFIG_NAME).is_file():
            raise CheckpointError(f"{CONFIG_NAME} is missing", self.path)
        if not index_path.is_file():
            raise CheckpointError(f"{INDEX_NAME} is missing (incomplete or not a sharded checkpoint)", self.path)
        try:
            index = json.loads(index_path.read_text())
            self.weight_map: dict[str, str] = dict(index["weight_map"])
            self.total_size = index.get("metadata", {}).get("total_size")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{INDEX_NAME}: not a valid index ({e!r}); it needs a weight_map", self.path) from e
        cfg = load_config(self.path)
        packed = any(n.endswith(".weight_packed") and ".experts." in n for n in self.weight_map)
        if packed != cfg.experts_mxfp4:
            log.info("%s: experts are %s in the files; config.json says %s (files win, Q13)", self.path,
                     "MXFP4" if packed else "bf16", "MXFP4" if cfg.experts_mxfp4 else "bf16")
            cfg = dataclasses.replace(cfg, experts_mxfp4=packed)
        self.config: K3Config = cfg
        self._headers: dict[str, tuple[dict[str, _Entry], int]] = {}
        self._layer_files: dict | None = None

    # -- low level --
    def _header(self, fname: str) -> tuple[dict[str, _Entry], int]:
        if fname not in self._headers:
            p = self.path / fname
            if not p.is_file():
                raise CheckpointError(f"{fname}: shard file is missing (named by {INDEX_NAME})", self.path)
            self._headers[fname] = read_header(p)
        return self._headers[fname]

    def _full(self, name: str) -> str:
        if name in self.weight_map or name.startswith((PREFIX,) + SKIP_PREFIXES):
            return name
        return PREFIX + name if PREFIX + name in self.weight_map else name

    def _entry(self, name: str) -> tuple[str, _Entry]:
        fname = self.weight_map.get(name)
        if fname is None:
            raise CheckpointError(f"tensor {name} is not in the weight_map of {INDEX_NAME}", self.path)
        entries, size = self._header(fname)
        e = entries.get(name)
        if e is None:
            raise CheckpointError(f"tensor {name}: {INDEX_NAME} puts it in {fname}, but that shard's header lacks it", self.path)
        prob = self._entry_problem(name, fname, e, size)
        if prob:
            raise CheckpointError(prob, self.path)
        return fname, e

    @staticmethod
    def _entry_problem(name: str, fname: str, e: _Entry, size: int) -> str | None:
        if e.dtype not in DTYPES:
            return f"tensor {name} in {fname}: unsupported dtype {e.dtype}"
        want = _ITEMSIZE[e.dtype] * int(np.prod(e.shape, dtype=np.int64))
        if e.end - e.begin != want or e.begin > e.end:
            return (f"tensor {name} in {fname}: data_offsets span {e.end - e.begin} bytes but "
                    f"{e.dtype} {list(e.shape)} needs {want}")
        if e.end > size:
            return (f"tensor {name} in {fname}: data ends at byte {e.end} but the file has {size} bytes "
                    "(truncated shard)")
        return None

    def get(self, name: str) -> torch.Tensor:
        """The stored tensor `name` (full name, or without the `language_model.` prefix), memory-mapped,
        in its stored dtype (safetensors BF16 -> torch.bfloat16). Raises CheckpointError naming tensor and file."""
        name = self._full(name)
        fname, e = self._entry(name)
        tdt, ndt = DTYPES[e.dtype]
        count = int(np.prod(e.shape, dtype=np.int64))
        if count == 0:
            return torch.empty(e.shape, dtype=tdt)
        # mode "c" (copy-on-write): a writable view of the mapping, so torch does not warn; the file is never changed.
        arr = np.memmap(self.path / fname, dtype=ndt, mode="c", offset=e.begin, shape=(count,))
        t = torch.from_numpy(arr)
        if tdt == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t.reshape(e.shape)

    # -- inventory / validation --
    def specs(self) -> list[TensorSpec]:
        """The expected tensors (model.weights inventory for `.config`: the text model, then the vision tower and
        projector when the config has a vision_config)."""
        return all_tensors(self.config) + vision_tensors(self.config)

    def _check_specs(self, specs: Iterable[TensorSpec], skip_files: "set[str] | None" = None) -> list[str]:
        """Problems of `specs` (presence, shape, dtype, offsets, A_log padding). A shard that cannot be opened
        is reported once (with how many of these tensors it holds); files in skip_files are not reported."""
        problems = []
        H = self.config.kda_num_heads
        bad_files: dict[str, list[str]] = collections.defaultdict(list)
        for s in specs:
            fname = self.weight_map.get(s.name)
            if fname is None:
                home = self._layer_file(s.layer)
                where = f" (the rest of its layer is in {home})" if home else ""
                problems.append(f"missing tensor {s.name}: not in the weight_map of {INDEX_NAME}{where}")
                continue
            if skip_files and fname in skip_files:
                continue
            try:
                entries, size = self._header(fname)
            except CheckpointError:
                bad_files[fname].append(s.name)
                continue
            e = entries.get(s.name)
            if e is None:
                problems.append(f"missing tensor {s.name}: {INDEX_NAME} puts it in {fname}, but that shard's header lacks it")
                continue
            shapes, dtypes = allowed_forms(self.config, s)
            if e.shape not in shapes:
                problems.append(f"tensor {s.name} in {fname}: shape {list(e.shape)}, expected "
                                + " or ".join(str(list(x)) for x in shapes))
            if e.dtype not in dtypes:
                problems.append(f"tensor {s.name} in {fname}: dtype {e.dtype}, expected {' or '.join(dtypes)}")
            prob = self._entry_problem(s.name, fname, e, size)
            if prob:
                problems.append(prob)
            elif s.name.endswith(".A_log") and e.dtype in ("F32", "BF16") and len(e.shape) == 1 and e.shape[0] > H:
                tail = self.get(s.name)[H:]
                if bool((tail != 0).any()):
                    problems.append(self._a_log_problem(s.name, fname, tail))
        for fname, names in bad_files.items():
            try:
                self._header(fname)
            except CheckpointError as err:
                problems.append(f"{err.problems[0]} (it holds {len(names)} needed tensors, e.g. {names[0]})")
        return problems

    def _layer_file(self, layer: int | None) -> str | None:
        """The shard holding most of `layer`'s tensors (model-level tensors: layer None), for messages."""
        if self._layer_files is None:
            votes: dict = collections.defaultdict(collections.Counter)
            for n, f in self.weight_map.items():
                rest = n[len(LAYER_PREFIX):].split(".")[0] if n.startswith(LAYER_PREFIX) else ""
                votes[int(rest) if rest.isdigit() else None][f] += 1
            self._layer_files = {k: c.most_common(1)[0][0] for k, c in votes.items()}
        return self._layer_files.get(layer)

    def _a_log_problem(self, name: str, fname: str, tail: torch.Tensor) -> str:
        H = self.config.kda_num_heads
        return (f"tensor {name} in {fname}: padding entries [{H}:] must be zero, found "
                f"{int((tail != 0).sum())} non-zero (only the first num_heads={H} are used, §8.4 / Q1)")

    def validate(self) -> None:
        """Check the whole checkpoint against the `model.weights` inventory of `.config`; raise one
        CheckpointError listing ALL problems: missing shard files, unreadable/truncated shards, missing
        tensors, wrong shape or dtype (each naming tensor and file), unexpected text tensors (e.g. extra
        layers), non-zero A_log padding, total_size mismatch, plus a hint when the shapes consistently look
        made for a different config value (config/weights mismatch). Returns None when all is well."""
        problems: list[str] = []
        by_file: dict[str, list[str]] = collections.defaultdict(list)
        for name, f in self.weight_map.items():
            by_file[f].append(name)
        bad_files = set()
        for f, names in sorted(by_file.items()):
            if not (self.path / f).is_file():
                shown = ", ".join(sorted(names)[:3]) + (f", ... ({len(names)} tensors)" if len(names) > 3 else "")
                problems.append(f"{INDEX_NAME} names shard {f}, which is missing (it should hold {shown})")
                bad_files.add(f)
                continue
            try:
                entries, size = self._header(f)
            except CheckpointError as err:
                problems.extend(err.problems)
                bad_files.add(f)
                continue
            cut = sorted((n for n, e in entries.items()           # well-formed entries past the end of the file
                          if e.end > size and e.dtype in DTYPES
                          and e.end - e.begin == _ITEMSIZE[e.dtype] * int(np.prod(e.shape, dtype=np.int64))),
                         key=lambda n: -entries[n].end)
            if cut:      # one line per shard, not one per tensor past the end
                shown = ", ".join(cut[:3]) + (f" and {len(cut) - 3} more" if len(cut) > 3 else "")
                problems.append(f"shard {f} is truncated: the file has {size} bytes but its header places data up to "
                                f"byte {entries[cut[0]].end} ({shown} end past it); download or write it again")
                bad_files.add(f)
                continue
            for name, e in entries.items():
                if (name.startswith(SKIP_PREFIXES) and self.config.vision is None) or name not in self.weight_map:
                    prob = self._entry_problem(name, f, e, size)  # inventory tensors are checked below
                    if prob:
                        problems.append(prob)
        expected = self.specs()
        vision_hint = self._no_vision_hint()
        if vision_hint:
            problems.append(vision_hint)
            expected = all_tensors(self.config)
        problems += self._check_specs(expected, skip_files=bad_files)
        names = {s.name for s in expected}
        vision = self.config.vision is not None   # then the vision names must be exactly those of §7.1
        extra = [n for n in self.weight_map if n not in names and (vision or not n.startswith(SKIP_PREFIXES))]
        problems += [f"unexpected tensor {n} in {self.weight_map[n]}: not in the inventory for this {CONFIG_NAME}"
                     for n in sorted(extra)]
        if not problems and self.total_size is not None:
            actual = self.data_bytes()
            if actual != self.total_size:
                problems.append(f"{INDEX_NAME}: metadata.total_size = {self.total_size}, but the shards hold {actual} bytes")
        hint = self._mismatch_hint(expected)
        if hint:
            problems.insert(0, hint)
        if problems:
            raise CheckpointError(problems, self.path)

    def _mismatch_hint(self, expected: list[TensorSpec]) -> str | None:
        """If many tensors differ from the inventory by one consistent dimension, name the config key."""
        pairs: collections.Counter = collections.Counter()
        for s in expected:
            f = self.weight_map.get(s.name)
            if f is None or f not in self._headers:
                continue
            e = self._headers[f][0].get(s.name)
            if e is None or len(e.shape) != len(s.shape) or e.shape in allowed_forms(self.config, s)[0]:
                continue
            pairs.update((a, b) for a, b in zip(s.shape, e.shape) if a != b)
        if not pairs:
            return None
        (want, got), count = pairs.most_common(1)[0]
        if count < 3:
            return None
        keys = [f.name for f in dataclasses.fields(self.config)
                if isinstance(getattr(self.config, f.name), int) and not isinstance(getattr(self.config, f.name), bool)
                and getattr(self.config, f.name) == want]
        if not keys and self.config.kda_proj_size == want:
            keys = ["kda_num_heads*kda_head_dim"]
        key = " or ".join(keys) or "a derived size"
        return (f"config/weights mismatch: {count} tensor dims are {got} where {CONFIG_NAME} implies {want} "
                f"({key} = {want}); the weights look made for {key} = {got}")

    # -- structured access --
    def layer_weights(self, l: int) -> dict[str, torch.Tensor]:
        """Tensors of decoder layer `l`, keyed relative to `language_model.model.layers.{l}.` (e.g.
        "self_attn.q_proj.weight", "block_sparse_moe.experts.3.w1.weight_packed"), stored dtypes, memory-mapped.
        KDA `self_attn.A_log` is narrowed to num_heads after checking the padding is zero.
        Raises CheckpointError listing every problem of this layer (missing/misshaped tensors, bad padding).
        """
        if not 0 <= l < self.config.num_hidden_layers:
            raise IndexError(f"layer {l} outside 0..{self.config.num_hidden_layers - 1}")
        specs = layer_tensors(self.config, l)
        problems = self._check_specs(specs)
        if problems:
            raise CheckpointError(problems, self.path)
        prefix = f"{LAYER_PREFIX}{l}."
        out = {_rel(s.name, prefix): self.get(s.name) for s in specs}
        if "self_attn.A_log" in out:
            out["self_attn.A_log"] = out["self_attn.A_log"][: self.config.kda_num_heads]
        return out

    def model_weights(self) -> dict[str, torch.Tensor]:
        """Model-level tensors keyed "embed_tokens.weight", "norm.weight", "output_attn_res_norm.weight",
        "output_attn_res_proj.weight", "lm_head.weight" (stored dtypes, memory-mapped)."""
        specs = model_tensors(self.config)
        problems = self._check_specs(specs)
        if problems:
            raise CheckpointError(problems, self.path)
        return {_rel(_rel(s.name, PREFIX + "model."), PREFIX): self.get(s.name) for s in specs}

    def _no_vision_hint(self) -> str | None:
        """One problem instead of 168 when the config has a vision_config and the files hold no vision tensor."""
        if self.config.vision is None or any(n.startswith(SKIP_PREFIXES) for n in self.weight_map):
            return None
        return (f"{CONFIG_NAME} has a vision_config but {INDEX_NAME} names no vision_tower.* / mm_projector.* tensor; "
                "add the vision tower's tensors (VISION.md §7.1) or remove vision_config to serve the text model only")

    def vision_weights(self) -> dict[str, torch.Tensor]:
        """The vision tower + projector tensors under their released names (VISION.md §7.1), BF16, memory-mapped.
        Raises CheckpointError listing every missing or misshaped one, or when the config has no vision_config."""
        specs = vision_tensors(self.config)
        if not specs:
            raise CheckpointError(f"{CONFIG_NAME} has no vision_config: this checkpoint has no vision tower", self.path)
        hint = self._no_vision_hint()
        problems = [hint] if hint else self._check_specs(specs)
        if problems:
            raise CheckpointError(problems, self.path)
        return {s.name: self.get(s.name) for s in specs}

    def preprocessor_config(self) -> dict | None:
        """The parsed preprocessor_config.json next to config.json, None when absent. Raises CheckpointError for
        invalid JSON."""
        p = self.path / PREPROCESSOR_NAME
        if not p.is_file():
            return None
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{PREPROCESSOR_NAME}: not valid JSON ({e}); restore the checkpoint's file", self.path) from e

    # -- values --
    @staticmethod
    def _finite_rule(name: str, dtype: str):
        """(unsigned numpy view, mask) that flags a non-finite value of this tensor, or None (nothing to check)."""
        if dtype in _NONFINITE_BITS:
            return _NONFINITE_BITS[dtype]
        if dtype == "U8" and name.endswith(".weight_scale"):
            return _SCALE_BITS
        return None

    def finite_plan(self, sample: bool = False) -> dict[str, list[tuple[str, int, int]]]:
        """{shard: [(tensor, bytes read, bytes stored)]} of every tensor `check_finite` reads."""
        out: dict[str, list] = collections.defaultdict(list)
        for name, fname in self.weight_map.items():
            e = self._header(fname)[0].get(name)
            if e is None or self._finite_rule(name, e.dtype) is None:
                continue
            n = e.end - e.begin
            out[fname].append((name, min(n, SAMPLE_WINDOWS * SAMPLE_WINDOW) if sample and n > SAMPLE_WHOLE else n, n))
        return dict(out)

    def _nonfinite(self, data: np.ndarray, fname: str, name: str, sample: bool) -> str | None:
        """The problem of one tensor of shard `fname` (memory-mapped bytes `data`): count and first index of its
        non-finite values; None when it has none."""
        e = self._headers[fname][0][name]
        view, mask = self._finite_rule(name, e.dtype)
        arr = data[e.begin: e.end].view(view)
        count = arr.size
        sampled = sample and e.end - e.begin > SAMPLE_WHOLE
        if sampled:
            step = SAMPLE_WINDOW // arr.itemsize
            spans = [(int(a), int(a) + step) for a in np.linspace(0, count - step, SAMPLE_WINDOWS).astype(np.int64)]
        else:
            spans = [(a, min(a + FINITE_CHUNK, count)) for a in range(0, count, FINITE_CHUNK)]
        bad, first, m = 0, None, view(mask)
        for a, b in spans:
            hit = (arr[a:b] & m) == m
            k = int(np.count_nonzero(hit))
            if k:
                bad += k
                first = a + int(np.argmax(hit)) if first is None else first
        if not bad:
            return None
        where = [int(i) for i in np.unravel_index(first, e.shape)] if e.shape else []
        what = "E8M0 scale code 255 (NaN, §8.3)" if e.dtype == "U8" else "NaN/Inf values"
        return (f"tensor {name} in {fname}: {bad} {what}{' in the sampled windows' if sampled else ''}, the first at "
                f"index {where}; the weights are corrupt (a bad download or a diverged run): fetch or export them "
                "again")

    def _check_shard(self, fname: str, items: list, sample: bool, bar) -> list[str]:
        problems = []
        data = np.memmap(self.path / fname, dtype=np.uint8, mode="r")      # one mapping per shard
        try:
            for name, nbytes, _ in items:
                prob = self._nonfinite(data, fname, name, sample)
                if prob:
                    problems.append(prob)
                if bar is not None:
                    bar.update(nbytes)
        finally:
            del data
        return problems

    def check_finite(self, sample: bool = False, progress: bool = False) -> dict:
        """Check that every float tensor is finite and every MXFP4 scale is not NaN (see the module docstring).
        Call after `validate` (shards readable, offsets inside the files).

        Args:
            sample: read tensors over 64 KiB in 8 windows of 4 KiB instead of whole (every tensor is read).
            progress: show a tqdm bar over the bytes to read.
        Returns:
            {"tensors": tensors checked, "bytes_read", "bytes_stored": stored bytes of those tensors, "sampled"}.
        Raises:
            CheckpointError listing every tensor holding a non-finite value (name, shard, count, first index).
        """
        plan = self.finite_plan(sample)
        items = [it for v in plan.values() for it in v]
        total = sum(b for _, b, _ in items)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="finite check" + (" (sampled)" if sample else ""))
        workers = min(8, os.cpu_count() or 1, max(1, len(plan)))   # numpy releases the GIL in the bit tests
        try:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                found = pool.map(lambda f: self._check_shard(f, plan[f], sample, bar), sorted(plan))
                problems = [p for ps in found for p in ps]
        finally:
            if bar is not None:
                bar.close()
        if problems:
            raise CheckpointError(problems, self.path)
        return {"tensors": len(items), "bytes_read": total, "bytes_stored": sum(n for _, _, n in items),
                "sampled": sample}

    def data_bytes(self) -> int:
        """Sum of the data sizes of every tensor in every shard header (reads all headers)."""
        files = sorted(set(self.weight_map.values()))
        return sum(e.end - e.begin for f in files for e in self._header(f)[0].values())
