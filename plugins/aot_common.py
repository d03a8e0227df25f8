"""Shared helpers of the ahead-of-time ``tensorrt.plugin`` forms (QDP with ``@trtp.aot_impl``, TensorRT >= 10.9):
one Triton kernel compiled to PTX per plugin, baked into the engine and launched by TensorRT without Python
(STACK.md §1b). Users: plugins/kda/trt_aot.py (``kimi::KdaDecode``), plugins/mla/trt_aot.py (``kimi::MlaDecode``),
plugins/moe/trt_aot.py (``kimi::Mxfp4Moe`` as four single-launch ops), plugins/aot_ops.py (the table-driven chains
of plugins/kda/trt_aot_prefill.py and plugins/mla/trt_aot_prefill.py).

TensorRT's AOT launch passes exactly: input pointers, then the int32 extra arguments, then output pointers. Triton
>= 3.3 appends hidden scratch pointers to every kernel, so :func:`compile_entry` removes them from the PTX
(:func:`strip_hidden_params`) and refuses kernels that need global/profile scratch. Attributes are not serialized
for AOT: they are compiled in as constexprs. All helpers here run on a CPU machine (Triton compiles for ``sm_90``
without a GPU).
"""
# no `from __future__ import annotations`: tensorrt.plugin reads the QDP functions' annotations as objects

import inspect
import logging
import re
from typing import Any, Callable

import numpy as np

logger = logging.getLogger(__name__)

try:
    import triton
except ImportError:  # pragma: no cover - the compile helpers then raise; pure helpers still work
    triton = None


ACT_NAMES = ("float32", "float16", "bfloat16")          # activation dtypes an AOT entry kernel is compiled for
TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
TRT_TYPE_NAMES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16"}


def entry_signature(inputs, extra, outputs, constexprs, act: str, what: str) -> dict[str, str]:
    """Triton signature of an AOT entry kernel in TensorRT's parameter order: ``inputs`` and ``outputs`` are
    ``(name, class)`` pointers with class ``"act"`` (dtype ``act``), ``"f32"``, ``"i32"`` or ``"u8"``; ``extra`` are
    ``(name, "i32")`` scalars between them; ``constexprs`` names follow. Raises ValueError (naming ``what``) for an
    ``act`` not in :data:`ACT_NAMES`."""
    if act not in TRITON_TYPES:
        raise ValueError(f"{what} AOT: activation dtype {act!r} not in {ACT_NAMES}")
    types = {"act": "*" + TRITON_TYPES[act], "f32": "*fp32", "i32": "*i32", "u8": "*u8"}
    sig = {n: types[c] for n, c in inputs}
    sig.update({n: c for n, c in extra})
    sig.update({n: types[c] for n, c in outputs})
    sig.update({n: "constexpr" for n in constexprs})
    return sig


def autotune_string(pointers) -> str:
    """``AutoTuneCombination`` type string for ``(name, class)`` pointers (inputs then outputs): every ``"act"``
    position takes FP32|FP16|BF16 together, ``"f32"`` stays FP32, ``"i32"`` INT32 and ``"u8"`` UINT8 in each
    combination."""
    n = len(ACT_NAMES)
    cls = {"act": "|".join(TRT_TYPE_NAMES[a] for a in ACT_NAMES), "f32": "|".join(["FP32"] * n),
           "i32": "|".join(["INT32"] * n), "u8": "|".join(["UINT8"] * n)}
    return ", ".join(cls[c] for _, c in pointers)


def scalar(x) -> Any:
    """Plugin attribute value -> Python scalar (QDP hands numpy arrays for array-annotated attributes)."""
    return np.asarray(x).reshape(-1)[0].item()


def qdp_available() -> bool:
    """True where ``tensorrt.plugin`` has ``aot_impl`` (TensorRT >= 10.9) and Triton is importable."""
    if triton is None:
        return False
    try:
        import tensorrt.plugin as trtp
    except Exception:
        return False
    return hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams")


def register_qdp(done: list, kernel, ops: tuple, define: Callable) -> list[str]:
    """Register an op's QDP once: ``define(tensorrt, tensorrt.plugin)`` runs the decorators and ``ops`` are appended
    to the module's ``done`` list. Returns the registered ids, or ``[]`` (nothing registered) where the entry
    ``kernel`` is missing (no Triton) or :func:`qdp_available` is False."""
    if done:
        return list(done)
    if kernel is None or not qdp_available():
        return []
    import tensorrt as trt
    import tensorrt.plugin as trtp

    define(trt, trtp)
    done.extend(ops)
    logger.info("registered %s as ahead-of-time tensorrt.plugin ops", ", ".join(ops))
    return list(done)


_ENTRY_RE = r"\.entry\s+{name}\s*\((?P<params>[^)]*)\)"


def strip_hidden_params(ptx: str, kernel_name: str, n_args: int) -> str:
    """Drop the parameters after the first ``n_args`` from ``kernel_name``'s ``.entry`` (Triton's hidden
    global/profile scratch pointers), which TensorRT's AOT launch does not pass. Raises ValueError when the entry is
    missing, has fewer than ``n_args`` parameters, or the kernel body reads a parameter that would be dropped."""
    m = re.search(_ENTRY_RE.format(name=re.escape(kernel_name)), ptx)
    if m is None:
        raise ValueError(f"no .entry {kernel_name} in the PTX")
    params = [p.strip() for p in m.group("params").split(",") if p.strip()]
    if len(params) < n_args:
        raise ValueError(f"{kernel_name}: PTX has {len(params)} parameters, expected at least {n_args}")
    body = ptx[m.end():]
    for p in params[n_args:]:
        pname = p.split()[-1]
        if re.search(r"\b" + re.escape(pname) + r"\b", body):
            raise ValueError(f"{kernel_name}: hidden parameter {pname} is used by the kernel (global/profile "
                             "scratch); TensorRT's AOT launch cannot pass it")
    kept = ",\n\t".join(params[:n_args])
    return ptx[:m.start("params")] + "\n\t" + kept + "\n" + ptx[m.end("params"):]


def ast_source(fn, signature: dict, constexprs: dict):
    """triton.compiler.ASTSource across Triton versions (3.3+: constexprs in the signature; older: constants=)."""
    params = inspect.signature(triton.compiler.ASTSource.__init__).parameters
    if "constexprs" in params:
        return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    sig = {k: v for k, v in signature.items() if v != "constexpr"}
    return triton.compiler.ASTSource(fn=fn, signature=sig, constants=constexprs)


def default_target():
    """The ``GPUTarget`` to compile for: the current CUDA GPU's, else ``sm_90`` (a build machine without a GPU)."""
    from triton.backends.compiler import GPUTarget

    try:
        target = triton.runtime.driver.active.get_current_target()
        if target.backend == "cuda":
            return target
    except Exception:   # no GPU driver (CPU build machine)
        pass
    return GPUTarget("cuda", 90, 32)   # Hopper


def driver_ptx_version() -> int | None:
    """Highest PTX ISA version (e.g. 90 for a CUDA 13.0 driver) the installed CUDA driver can JIT, or None without a
    driver. The engine's PTX is JIT-compiled by the driver when TensorRT loads it, so it must not be newer."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0 or v.value <= 0:
            return None
        from triton.backends.nvidia.compiler import ptx_get_version

        return ptx_get_version(f"{v.value // 1000}.{(v.value % 1000) // 10}")
    except Exception:   # no driver, or a Triton without this helper / not knowing this CUDA version
        return None


def triton_ptx_version(arch: int) -> int | None:
    """PTX ISA version Triton emits by default for ``arch`` (that of the ptxas it assembles with), or None."""
    try:
        from triton.backends.nvidia import compiler as nv

        try:
            version = nv.get_ptxas(arch).version
        except TypeError:   # older Triton: get_ptxas() without arch
            version = nv.get_ptxas().version
        return nv.ptx_get_version(version)
    except Exception:
        return None


def pick_ptx_version(arch: int, requested: int | None = None) -> int | None:
    """``requested``, else the older of what the driver can load and what Triton's ptxas accepts (None = Triton's
    default)."""
    if requested is not None:
        return int(requested)
    known = [v for v in (driver_ptx_version(), triton_ptx_version(arch)) if v is not None]
    return min(known) if known else None


def compile_entry(fn, signature: dict, constexprs: dict, *, num_warps: int, n_args: int, what: str,
                  num_stages: int | None = None, target=None, ptx_version: int | None = None) -> tuple[str, str, int, int]:
    """Compile the entry kernel ``fn`` (Triton ``signature`` in parameter order, constexprs included) for ``target``
    (default: the current GPU, else ``sm_90``) at PTX ISA ``ptx_version`` (default :func:`pick_ptx_version`).
    Every pointer parameter is declared 16-byte aligned (``tt.divisibility``, as Triton's own launcher specializes;
    TensorRT's tensors are 256-byte aligned), so loads vectorize and pipeline.
    Returns ``(kernel name, PTX with exactly n_args parameters, num_warps, static shared bytes)``.
    Raises RuntimeError when Triton is missing or the kernel needs global/profile scratch (``what`` names the op)."""
    if triton is None:
        raise RuntimeError(f"{what} AOT needs Triton (pip install triton)")
    target = target if target is not None else default_target()
    options = {"num_warps": int(num_warps)}
    if num_stages is not None:
        options["num_stages"] = int(num_stages)
    pv = pick_ptx_version(target.arch, ptx_version)
    if pv is not None:
        options["ptx_version"] = int(pv)
    src = ast_source(fn, signature, constexprs)
    names = list(signature)
    src.attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    compiled = triton.compile(src, target=target, options=options)
    md = compiled.metadata
    for field in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, field, 0):
            raise RuntimeError(f"{what} AOT kernel needs {field}={getattr(md, field)}; TensorRT cannot provide it")
    ptx = strip_hidden_params(compiled.asm["ptx"], md.name, n_args)
    return md.name, ptx, int(md.num_warps), int(md.shared)
