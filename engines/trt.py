"""Import whichever TensorRT is installed: full ``tensorrt`` first, else TensorRT-RTX (``tensorrt_rtx_bindings``).

``K3DEPLOY_TRT=tensorrt`` or ``K3DEPLOY_TRT=tensorrt-rtx`` forces one flavor.

    from k3deploy.engines.trt import load_trt
    info = load_trt()          # TrtInfo(module, flavor, version)
    trt = info.module

Differences that matter to engines/: TensorRT-RTX builds ahead of time for explicit compute capabilities
(``ComputeCapability.SM75/80/86/89/120/121``, not SM90) without a GPU, treats timing-cache calls as no-ops, cannot
deserialize an engine without a CUDA driver, and has no ``add_plugin_v3``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from types import ModuleType

FLAVORS = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx_bindings"}
INSTALL_HINT = ("no TensorRT found: install full TensorRT (Linux + NVIDIA GPU, from NVIDIA's package index or an NGC "
                "container, see README 'Quick start') or TensorRT-RTX "
                "(`pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings`, builds engines on CPU)")
FLAVOR_HINT = {"tensorrt": "full TensorRT is not installed: install it from NVIDIA's package index or use an NGC "
                           "container (Linux + NVIDIA GPU; README 'Quick start')",
               "tensorrt-rtx": "TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13-libs "
                               "tensorrt-rtx-cu13-bindings"}


@dataclasses.dataclass(frozen=True)
class TrtInfo:
    """module: the imported TensorRT module; flavor: ``"tensorrt"`` or ``"tensorrt-rtx"``; version: e.g. ``"1.7.1.116"``."""

    module: ModuleType
    flavor: str
    version: str

    @property
    def is_rtx(self) -> bool:
        return self.flavor == "tensorrt-rtx"

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


@functools.lru_cache(maxsize=None)
def load_trt(flavor: str | None = None) -> TrtInfo:
    """Import TensorRT. flavor: ``"tensorrt"``, ``"tensorrt-rtx"`` or None (env ``K3DEPLOY_TRT``, else full TensorRT
    first, then RTX). Raises ImportError with install instructions when none (or not the requested one) is installed,
    ValueError for an unknown flavor."""
    flavor = flavor or os.environ.get("K3DEPLOY_TRT") or None
    if flavor is not None and flavor not in FLAVORS:
        raise ValueError(f"TensorRT flavor {flavor!r} unknown; use one of {sorted(FLAVORS)} (env K3DEPLOY_TRT)")
    errors = []
    for name in [flavor] if flavor else list(FLAVORS):
        try:
            mod = importlib.import_module(FLAVORS[name])
        except ImportError as e:
            errors.append(f"{FLAVORS[name]}: {e}")
            continue
        return TrtInfo(mod, name, str(mod.__version__))
    raise ImportError((FLAVOR_HINT[flavor] if flavor else INSTALL_HINT) + " (" + "; ".join(errors) + ")")


def available() -> bool:
    """True when some TensorRT flavor imports."""
    try:
        load_trt()
    except ImportError:
        return False
    return True


def cuda_device_count() -> int:
    """Number of CUDA devices visible through the driver (0 when there is no driver), without importing torch."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    n = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value
