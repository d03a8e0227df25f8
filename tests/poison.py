"""Bad weights for tests: a copy of a checkpoint with chosen elements of one tensor overwritten in place (the bytes of
the shard, as a corrupt download or a diverged training run would leave them; the header stays valid)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from k3deploy.model.checkpoint import DTYPES, Checkpoint


def poison_copy(src: "str | Path", dst: "str | Path", name: str, index, value: float = float("nan")) -> Path:
    """Copy checkpoint `src` to `dst` and set `tensor[index] = value` (index into the stored tensor's shape, any
    numpy index) in the shard holding `name` (float dtypes only). Returns dst."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    ck = Checkpoint(dst)
    fname = ck.weight_map[name]
    e = ck._header(fname)[0][name]
    tdt, ndt = DTYPES[e.dtype]
    count = int(np.prod(e.shape))
    mm = np.memmap(dst / fname, dtype=ndt, mode="r+", offset=e.begin, shape=(count,))
    flat = np.arange(count).reshape(e.shape)[index].reshape(-1)
    v = torch.full((flat.size,), value, dtype=tdt)
    mm[flat] = (v.view(torch.int16).numpy().view(np.uint16) if tdt == torch.bfloat16 else v.numpy())
    mm.flush()
    del mm
    return dst
