"""Ahead-of-time TensorRT form of ``kimi::KdaDecode``: a ``tensorrt.plugin`` (QDP, TensorRT >= 10.9) whose
``@trtp.aot_impl`` returns ONE Triton kernel compiled to PTX, baked into the engine: engines run it without Python
(trtexec, Triton's TensorRT backend, C++).

Kernel: the fused decode step ``plugins.kda.kernels._kda_decode_kernel`` with ``BV = head_dim`` (one program per
(token, head) holds the whole [K, K] state tile; no scratch, no atomics), called from a thin entry kernel
:func:`_kda_decode_aot_kernel` whose parameters follow the AOT launch convention (input pointers, then int32 extra
arguments, then output pointers; STACK.md §1b): ``qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv,
slots, T, out, state_out, conv_out``. The attributes are constexprs (AOT does not serialize attributes; floats cannot
be extra arguments): ``H, K, LOWER_BOUND, NORM_EPS, SCALE``. Strides are ``3P, P, H, P, P`` (TensorRT tensors are
dense). ``state``/``conv`` are updated through ``state_out``/``conv_out``, which alias them (``TensorDesc.aliased``).
Launch: grid ``(T, H, 1)`` with ``T = qkv.shape_expr[0]`` (a TensorRT shape expression), block ``num_warps * 32``,
the kernel's static shared memory. Triton >= 3.3 appends hidden scratch pointers to every kernel; TensorRT passes
exactly the declared arguments, so ``plugins.aot_common.strip_hidden_params`` removes them from the PTX when they are
unused (the kernel needs no global/profile scratch) and refuses otherwise.

Every kimi op has an AOT form. An AOT plugin is exactly one precompiled kernel launch with launch parameters as shape
expressions, so KdaDecode (here) and MlaDecode (plugins/mla/trt_aot.py: one kernel without the split along the
sequence) are single ops, while the multi-launch ops become chains of single-launch ops that ``--aot`` builds rewrite
their nodes into: Mxfp4Moe (four: sort, two grouped GEMMs, combine; plugins/moe/trt_aot.py), KdaPrefill (nine: conv,
conv history, chunk indices, then fla-core's chunk stages and our output kernel; plugins/kda/trt_aot_prefill.py),
MlaPrefill (four: latent write, W_UK absorption, paged attention, W_UV; plugins/mla/trt_aot_prefill.py). The JIT
IPluginV3 plugins (plugins/trt_common.py) stay for engines built without ``--aot``; each is CUDA-graph safe with
the caller workspace (see plugins/trt_common.py for the exact limits).

Use: ``plugins.register_tensorrt_plugins(aot=True)`` (registers this QDP instead of the KdaDecode IPluginV3); with
``network.add_plugin(trtp.op.kimi.KdaDecode(...), aot=True)``, or an ONNX node carrying the bool attribute
``aot=1`` (besides ``plugin_namespace``), TensorRT takes the AOT implementation; the JIT ``@trtp.impl`` registered
alongside runs the same single kernel through torch. :func:`register` returns ``[]`` and registers nothing where
``tensorrt.plugin`` with ``aot_impl`` or Triton is not importable.

Pure helpers (tested on a CPU machine): :func:`kernel_signature`, :func:`kernel_constexprs`, :func:`launch_params`
(works on ints and on TensorRT shape expressions), :func:`autotune_types`, :func:`compile_ptx` (Triton compiles for
``sm_90`` without a GPU); the op-independent ones (PTX parameter stripping, PTX ISA choice) are in plugins/aot_common.py.
"""
# no `from __future__ import annotations`: tensorrt.plugin reads the QDP functions' annotations as objects

import functools
from typing import Any, Tuple

import numpy as np

from k3deploy.plugins.aot_common import (autotune_string, compile_entry, entry_signature, qdp_available, register_qdp,
                                 scalar)


PLUGIN_ID = "kimi::KdaDecode"
AOT_OPS = (PLUGIN_ID,)
# kernel parameters in AOT order: (name, dtype class) — "act", "f32", "i32" pointers, then the extra int, then outputs
INPUTS = (("qkv_ptr", "act"), ("f_ptr", "act"), ("b_ptr", "act"), ("g_ptr", "act"), ("convw_ptr", "f32"),
          ("alog_ptr", "f32"), ("dtb_ptr", "f32"), ("onw_ptr", "f32"), ("state_ptr", "f32"), ("conv_ptr", "act"),
          ("slots_ptr", "i32"))
EXTRA = (("T", "i32"),)
OUTPUTS = (("out_ptr", "act"), ("state_out_ptr", "f32"), ("conv_out_ptr", "act"))
CONSTEXPRS = ("H", "K", "LOWER_BOUND", "NORM_EPS", "SCALE")

try:  # the entry kernel needs Triton (and the decode kernel); the pure helpers do not
    import triton
    import triton.language as tl

    from k3deploy.plugins.kda.kernels import _kda_decode_kernel

    @triton.jit
    def _kda_decode_aot_kernel(qkv_ptr, f_ptr, b_ptr, g_ptr, convw_ptr, alog_ptr, dtb_ptr, onw_ptr, state_ptr,
                               conv_ptr, slots_ptr, T, out_ptr, state_out_ptr, conv_out_ptr,
                               H: tl.constexpr, K: tl.constexpr, LOWER_BOUND: tl.constexpr,
                               NORM_EPS: tl.constexpr, SCALE: tl.constexpr):
        """grid (T, H): the fused KdaDecode step with BV = K, pools updated through the aliased outputs."""
        if tl.program_id(0) < T:
            P: tl.constexpr = H * K
            _kda_decode_kernel(qkv_ptr, f_ptr, b_ptr, g_ptr, convw_ptr, alog_ptr, dtb_ptr, onw_ptr,
                               state_out_ptr, conv_out_ptr, slots_ptr, out_ptr, out_ptr, slots_ptr,
                               3 * P, P, H, P, P, LOWER_BOUND, NORM_EPS, SCALE, H=H, K=K, P=P, BV=K,
                               PREFETCH=True)
except ImportError:  # pragma: no cover - Triton missing: nothing to compile, register() returns []
    triton = None
    _kda_decode_aot_kernel = None


# ------------------------------------------------------------------------------------------------- pure helpers
def num_warps(head_dim: int) -> int:
    """Warps of the whole-tile decode program (the rule of kernels.kda_decode for BV = K)."""
    return 8 if head_dim * head_dim >= 16384 else 4


def kernel_signature(act: str) -> dict[str, str]:
    """Triton signature of :func:`_kda_decode_aot_kernel` for activation dtype ``act`` (constexprs included, in
    parameter order). Raises ValueError for an unsupported dtype."""
    return entry_signature(INPUTS, EXTRA, OUTPUTS, CONSTEXPRS, act, "KdaDecode")


def kernel_constexprs(num_heads: int, head_dim: int, lower_bound: float, norm_eps: float) -> dict[str, Any]:
    """Attribute values baked into the PTX. Raises ValueError unless head_dim is a power of two."""
    K = int(head_dim)
    if K <= 0 or K & (K - 1):
        raise ValueError(f"KdaDecode AOT: head_dim {K} must be a power of two")
    return {"H": int(num_heads), "K": K, "LOWER_BOUND": float(lower_bound), "NORM_EPS": float(norm_eps),
            "SCALE": float(K) ** -0.5}


def launch_params(num_tokens, num_heads: int, warps: int, shared: int) -> dict[str, Any]:
    """Launch of the entry kernel: grid (T, H, 1), block (32 * warps). ``num_tokens`` may be an int or a TensorRT
    shape expression (``qkv.shape_expr[0]``); it is passed through unchanged."""
    return {"grid_x": num_tokens, "grid_y": int(num_heads), "grid_z": 1, "block_x": 32 * int(warps), "block_y": 1,
            "block_z": 1, "shared_mem": int(shared)}


def extra_args(num_tokens) -> list:
    """The int32 extra kernel arguments, in order: [T]."""
    return [num_tokens]


def autotune_types() -> str:
    """``AutoTuneCombination`` type string: activations FP32|FP16|BF16 together, fp32 weights/state, int32 slots."""
    return autotune_string(INPUTS + OUTPUTS)


@functools.lru_cache(maxsize=None)
def _compile_cached(act, num_heads, head_dim, lower_bound, norm_eps, target, ptx_version):
    return compile_entry(_kda_decode_aot_kernel, kernel_signature(act),
                         kernel_constexprs(num_heads, head_dim, lower_bound, norm_eps), num_warps=num_warps(head_dim),
                         n_args=len(INPUTS) + len(EXTRA) + len(OUTPUTS), what="KdaDecode", target=target,
                         ptx_version=ptx_version)


def compile_ptx(act: str, num_heads: int, head_dim: int, lower_bound: float = -5.0, norm_eps: float = 1e-5,
                target=None, ptx_version: int | None = None) -> tuple[str, str, int, int]:
    """Compile the entry kernel: returns ``(kernel name, PTX text, num_warps, static shared bytes)``.

    target: ``triton.backends.compiler.GPUTarget`` (default: the current GPU, else ``GPUTarget("cuda", 90, 32)``).
    ptx_version: PTX ISA of the ``.version`` line (e.g. 84); default: the older of what this machine's driver loads
    and what Triton's ptxas accepts (plugins/aot_common.py :func:`pick_ptx_version`). Build on (or pass the
    version of) the deployment driver: a newer ISA than the driver knows fails when TensorRT loads the engine.
    Triton also assembles the PTX with ptxas, so an ISA too old for the code fails here, not at load.
    Cached per arguments. Raises RuntimeError without Triton."""
    if _kda_decode_aot_kernel is None:
        raise RuntimeError("KdaDecode AOT needs Triton (pip install triton)")
    return _compile_cached(act, int(num_heads), int(head_dim), float(lower_bound), float(norm_eps), target,
                           ptx_version)


# ----------------------------------------------------------------------------------------------- registration
def available() -> bool:
    """True where ``tensorrt.plugin`` has ``aot_impl`` (TensorRT >= 10.9) and Triton is importable."""
    return _kda_decode_aot_kernel is not None and qdp_available()


_DONE: list[str] = []


def register() -> list[str]:
    """Register the ``kimi::KdaDecode`` QDP (register + autotune + aot_impl + JIT impl) with ``tensorrt.plugin``.
    Idempotent. Returns ``["kimi::KdaDecode"]``, or ``[]`` (nothing registered) where :func:`available` is False."""
    return register_qdp(_DONE, _kda_decode_aot_kernel, AOT_OPS, _define_qdp)


def _define_qdp(trt, trtp) -> None:
    import numpy.typing as npt

    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    TD = trtp.TensorDesc

    @trtp.register(PLUGIN_ID)
    def _desc(qkv: TD, f: TD, b: TD, g: TD, conv_w: TD, A_log: TD, dt_bias: TD, o_norm_w: TD, state: TD, conv: TD,
              slots: TD, num_heads: npt.NDArray[np.int32], head_dim: npt.NDArray[np.int32],
              lower_bound: npt.NDArray[np.float32], norm_eps: npt.NDArray[np.float32]) -> Tuple[TD, TD, TD]:
        # INT/FLOAT ONNX attributes reach plugins as INT32/FLOAT32 fields: 1-element arrays
        P = int(scalar(num_heads)) * int(scalar(head_dim))
        return trtp.from_shape_expr((qkv.shape_expr[0], P), dtype=qkv.dtype), state.aliased(), conv.aliased()

    @trtp.autotune(PLUGIN_ID)
    def _autotune(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, outputs):
        return [trtp.AutoTuneCombination(autotune_types())]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, num_heads, head_dim, lower_bound,
             norm_eps, outputs, tactic):
        H, K = int(scalar(num_heads)), int(scalar(head_dim))
        name, ptx, warps, shared = compile_ptx(names[qkv.dtype], H, K, scalar(lower_bound), scalar(norm_eps))
        lp = trtp.KernelLaunchParams()
        for key, value in launch_params(qkv.shape_expr[0], H, warps, shared).items():
            setattr(lp, key, value)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in extra_args(qkv.shape_expr[0])])
        return name.encode(), ptx.encode(), lp, extra

    @trtp.impl(PLUGIN_ID)
    def _impl(qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w, state, conv, slots, num_heads, head_dim, lower_bound,
              norm_eps, outputs, stream):
        # JIT form (nodes without aot=1): the same single kernel through torch (BV = K: no scratch)
        import torch

        from k3deploy.plugins.kda.kernels import _decode
        from k3deploy.plugins.trt_common import tensor_from_ptr

        tnames = {**names, trt.int32: "int32"}

        def wrap(t):
            return tensor_from_ptr(t.data_ptr, tuple(t.shape), tnames[t.dtype])

        K = int(scalar(head_dim))
        with torch.cuda.stream(torch.cuda.ExternalStream(int(stream))):
            ins = [wrap(t) for t in (qkv, f, b, g, conv_w, A_log, dt_bias, o_norm_w)]
            out, st, cv = (wrap(t) for t in outputs)   # state/conv outputs alias the pool inputs
            _decode(*ins, st, cv, wrap(slots), num_heads=int(scalar(num_heads)), head_dim=K,
                    lower_bound=float(scalar(lower_bound)), norm_eps=float(scalar(norm_eps)), out=out,
                    workspace=None, block_v=K)
