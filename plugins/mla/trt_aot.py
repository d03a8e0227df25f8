"""Ahead-of-time TensorRT form of ``kimi::MlaDecode``: a ``tensorrt.plugin`` (QDP, TensorRT >= 10.9) whose
``@trtp.aot_impl`` returns ONE Triton kernel compiled to PTX, baked into the engine: engines run it without Python
(trtexec, Triton's TensorRT backend, C++). Shared AOT helpers: plugins/aot_common.py.

Kernel: :func:`_mla_decode_aot_kernel`, grid ``(cdiv(H, BH), 1, B)``: each program writes sequence b's new latent
into the paged cache (every head group writes the same row: identical bytes), waits on a CTA barrier, then attends
over all ``context_lens[b] + 1`` cached latents with ``plugins.mla.kernels._mla_attend`` (the loop of the JIT split
kernel) and stores the normalized output. No split along the sequence: an AOT plugin is one launch and gets no
scratch for split partials, so a long context is read by ``B * cdiv(H, BH)`` programs only (fewer than the GPU's
SMs at small B); the JIT plugin (plugins/mla/trt.py) splits and combines and stays the fast path.

Parameters in TensorRT's AOT order (inputs, int32 extras, outputs; STACK.md §1b): ``q_abs, latent, cache,
block_tables, context_lens, MB, BS, out, cache_out``. ``MB`` (block-table width) and ``BS`` (cache block size) are
extras taken from the inputs' shape expressions, so one PTX serves every profile; the token tile is ``BN = 16``
tokens, which needs ``BS % 16 == 0`` (the runtime allocates pools with block sizes 16, 32 or 64; exported graphs
keep BS symbolic, so it is checked at build time only where it is a constant, and the kernel writes NaN outputs
for any other block size instead of a wrong attention). Constexprs (attributes are not serialized for AOT):
``H, R, DR, BH, BN, SCALE``. Tensors are dense (TensorRT), so strides follow from the shapes; pointers are compiled
as 16-byte aligned. ``cache_out`` aliases ``cache``.

Launch configuration: 16 heads per program, 4 warps, 2 pipeline stages — 37 KB of shared memory for a bf16/fp16
cache, under the 48 KB a launch gets without opting in (whether TensorRT's AOT launcher opts kernels into more is
not verified); an fp32 cache needs 104 KB. At 96 heads that is 6 programs per sequence, each reading the whole
context (no split): expect the AOT form to be several times slower than the JIT split kernel at long contexts and
small batches (not timed yet).

Use: ``plugins.register_tensorrt_plugins(aot=True)``; an ONNX node carrying ``aot=1`` (besides
``plugin_namespace``) then takes this implementation; the JIT ``@trtp.impl`` registered alongside runs the split
kernels through torch (``mla_decode``).

Pure helpers (tested on a CPU machine): :func:`kernel_signature`, :func:`kernel_constexprs`, :func:`launch_params`,
:func:`extra_args`, :func:`autotune_types`, :func:`compile_ptx`; the entry kernel itself runs under the Triton
interpreter against the reference (tests/plugins/test_graph_safe.py).
"""
# no `from __future__ import annotations`: tensorrt.plugin reads the QDP functions' annotations as objects

import functools
from typing import Any, Tuple

import numpy as np

from k3deploy.plugins.aot_common import (autotune_string, compile_entry, entry_signature, qdp_available, register_qdp,
                                 scalar)


PLUGIN_ID = "kimi::MlaDecode"
AOT_OPS = (PLUGIN_ID,)
INPUTS = (("q_ptr", "act"), ("lat_ptr", "act"), ("cache_ptr", "act"), ("bt_ptr", "i32"), ("ctx_ptr", "i32"))
EXTRA = (("MB", "i32"), ("BS", "i32"))
OUTPUTS = (("out_ptr", "act"), ("cache_out_ptr", "act"))
CONSTEXPRS = ("H", "R", "DR", "BH", "BN", "SCALE")
BLOCK_N = 16          # token tile: divides every supported cache block size (16, 32, 64)

try:  # the entry kernel needs Triton; the pure helpers do not
    import triton
    import triton.language as tl

    from k3deploy.plugins.mla.kernels import _mla_attend, _write_latent

    @triton.jit
    def _mla_decode_aot_kernel(q_ptr, lat_ptr, cache_ptr, bt_ptr, ctx_ptr, MB, BS, out_ptr, cache_out_ptr,
                               H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr,
                               BN: tl.constexpr, SCALE: tl.constexpr):
        """grid (cdiv(H, BH), 1, B): write latent b, barrier, attend over its whole context, store out[b, heads]."""
        DL: tl.constexpr = R + DR
        hg = tl.program_id(0)
        b = tl.program_id(2)
        _write_latent(lat_ptr, cache_out_ptr, bt_ptr, ctx_ptr, b, DL, MB, BS, DL, 2 * R)   # DR <= R: DL <= 2R
        tl.debug_barrier()     # the row just written is read below by other threads of this program
        hh = hg * BH + tl.arange(0, BH)
        hmask = hh < H
        L = tl.load(ctx_ptr + b) + 1
        acc, m_i, l_i = _mla_attend(q_ptr, cache_out_ptr, bt_ptr + b.to(tl.int64) * MB, b, hh, hmask, H * DL, DL,
                                    0, L, SCALE * 1.4426950408889634, BS, R, DR, BH, BN)
        o = acc / l_i[:, None]                       # L >= 1: l > 0
        o = tl.where(BS % BN == 0, o, float("nan"))  # a tile would straddle two blocks: fail loudly
        dr = tl.arange(0, R)
        tl.store(out_ptr + (b * H + hh)[:, None].to(tl.int64) * R + dr[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None])
except ImportError:  # pragma: no cover - Triton missing: nothing to compile, register() returns []
    triton = None
    _mla_decode_aot_kernel = None


# ------------------------------------------------------------------------------------------------- pure helpers
BLOCK_H, NUM_WARPS, NUM_STAGES = 16, 4, 2   # 37 KB of shared memory for bf16 (module docstring)


def block_h(num_heads: int) -> int:
    """Heads per program: 16 at every head count (64-head programs need 129 KB of shared memory)."""
    return BLOCK_H


def num_warps(num_heads: int) -> int:
    """Warps per program."""
    return NUM_WARPS


def kernel_signature(act: str) -> dict[str, str]:
    """Triton signature of :func:`_mla_decode_aot_kernel` for activation dtype ``act`` (the latent pool's dtype;
    constexprs included, in parameter order). Raises ValueError for an unsupported dtype."""
    return entry_signature(INPUTS, EXTRA, OUTPUTS, CONSTEXPRS, act, "MlaDecode")


def kernel_constexprs(num_heads: int, kv_lora_rank: int, latent_dim: int, scale: float) -> dict[str, Any]:
    """Attribute values baked into the PTX: H, R, DR = latent_dim - R, BH, BN, SCALE. Raises ValueError unless R and
    DR are powers of two with DR <= R (the kernel's tile shapes; K3: 512 and 64)."""
    R, DR = int(kv_lora_rank), int(latent_dim) - int(kv_lora_rank)
    for name, v in (("kv_lora_rank", R), ("latent_dim - kv_lora_rank", DR)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"MlaDecode AOT: {name} = {v} must be a power of two")
    if DR > R:
        raise ValueError(f"MlaDecode AOT: rope dim {DR} must not exceed kv_lora_rank {R}")
    return {"H": int(num_heads), "R": R, "DR": DR, "BH": block_h(num_heads), "BN": BLOCK_N, "SCALE": float(scale)}


def check_block_size(block_size) -> None:
    """Raise ValueError when ``block_size`` (an int; shape expressions are not checked) is not a multiple of the
    token tile: a tile would straddle two paged blocks."""
    if isinstance(block_size, (int, np.integer)) and int(block_size) % BLOCK_N:
        raise ValueError(f"MlaDecode AOT: cache block size {int(block_size)} must be a multiple of {BLOCK_N} "
                         "(allocate the latent pool with block_size 16, 32 or 64)")


def launch_params(batch, num_heads: int, warps: int, shared: int) -> dict[str, Any]:
    """Launch of the entry kernel: grid (cdiv(H, BH), 1, B), block (32 * warps). ``batch`` may be an int or a TensorRT
    shape expression (``q_abs.shape_expr[0]``); it is passed through unchanged."""
    groups = -(-int(num_heads) // block_h(num_heads))
    return {"grid_x": groups, "grid_y": 1, "grid_z": batch, "block_x": 32 * int(warps), "block_y": 1, "block_z": 1,
            "shared_mem": int(shared)}


def extra_args(block_table_width, block_size) -> list:
    """The int32 extra kernel arguments, in order: [MB, BS] (ints or shape expressions)."""
    return [block_table_width, block_size]


def autotune_types() -> str:
    """``AutoTuneCombination`` type string: q/latent/cache/out in one activation dtype (FP32|FP16|BF16), int32
    block tables and context lengths."""
    return autotune_string(INPUTS + OUTPUTS)


@functools.lru_cache(maxsize=None)
def _compile_cached(act, num_heads, kv_lora_rank, latent_dim, scale, target, ptx_version):
    return compile_entry(_mla_decode_aot_kernel, kernel_signature(act),
                         kernel_constexprs(num_heads, kv_lora_rank, latent_dim, scale), num_warps=num_warps(num_heads),
                         num_stages=NUM_STAGES, n_args=len(INPUTS) + len(EXTRA) + len(OUTPUTS), what="MlaDecode",
                         target=target, ptx_version=ptx_version)


def compile_ptx(act: str, num_heads: int, kv_lora_rank: int, latent_dim: int, scale: float, target=None,
                ptx_version: int | None = None) -> tuple[str, str, int, int]:
    """Compile the entry kernel: returns ``(kernel name, PTX text, num_warps, static shared bytes)``. ``target`` and
    ``ptx_version`` as in plugins/aot_common.py :func:`compile_entry` (default: this machine's GPU, else sm_90; the
    older of the driver's and ptxas's PTX ISA). Cached per arguments. Raises RuntimeError without Triton,
    ValueError for an unsupported dtype or latent split."""
    if _mla_decode_aot_kernel is None:
        raise RuntimeError("MlaDecode AOT needs Triton (pip install triton)")
    return _compile_cached(act, int(num_heads), int(kv_lora_rank), int(latent_dim), float(scale), target, ptx_version)


# ----------------------------------------------------------------------------------------------- registration
def available() -> bool:
    """True where ``tensorrt.plugin`` has ``aot_impl`` (TensorRT >= 10.9) and Triton is importable."""
    return _mla_decode_aot_kernel is not None and qdp_available()


_DONE: list[str] = []


def register() -> list[str]:
    """Register the ``kimi::MlaDecode`` QDP (register + autotune + aot_impl + JIT impl) with ``tensorrt.plugin``.
    Idempotent. Returns ``["kimi::MlaDecode"]``, or ``[]`` (nothing registered) where :func:`available` is False."""
    return register_qdp(_DONE, _mla_decode_aot_kernel, AOT_OPS, _define_qdp)


def _constant(expr):
    """A shape expression's value where it is a build-time constant (``tensorrt.plugin.ShapeExpr.is_constant`` /
    ``constant_value()``), an int as is, else the expression itself (also for a "fake" expression, whose
    ``is_constant`` raises RuntimeError)."""
    if isinstance(expr, (int, np.integer)):
        return int(expr)
    try:
        constant = expr.is_constant
    except (AttributeError, RuntimeError):
        return expr
    return int(expr.constant_value()) if constant else expr


def _define_qdp(trt, trtp) -> None:
    import numpy.typing as npt

    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    TD = trtp.TensorDesc

    @trtp.register(PLUGIN_ID)
    def _desc(q_abs: TD, latent: TD, cache: TD, block_tables: TD, context_lens: TD,
              num_heads: npt.NDArray[np.int32], kv_lora_rank: npt.NDArray[np.int32],
              scale: npt.NDArray[np.float32]) -> Tuple[TD, TD]:
        R = int(scalar(kv_lora_rank))
        return trtp.from_shape_expr((q_abs.shape_expr[0], q_abs.shape_expr[1], R), dtype=q_abs.dtype), cache.aliased()

    @trtp.autotune(PLUGIN_ID)
    def _autotune(q_abs, latent, cache, block_tables, context_lens, outputs):
        return [trtp.AutoTuneCombination(autotune_types())]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(q_abs, latent, cache, block_tables, context_lens, num_heads, kv_lora_rank, scale, outputs, tactic):
        H, R = int(scalar(num_heads)), int(scalar(kv_lora_rank))
        bs = _constant(cache.shape_expr[1])
        check_block_size(bs)
        latent_dim = _constant(cache.shape_expr[2])
        if not isinstance(latent_dim, int):
            raise ValueError("MlaDecode AOT: the cache's latent dimension must be static (kv_lora_rank + rope dim)")
        name, ptx, warps, shared = compile_ptx(names[cache.dtype], H, R, latent_dim, float(scalar(scale)))
        lp = trtp.KernelLaunchParams()
        for key, value in launch_params(q_abs.shape_expr[0], H, warps, shared).items():
            setattr(lp, key, value)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in
                                             extra_args(block_tables.shape_expr[1], cache.shape_expr[1])])
        return name.encode(), ptx.encode(), lp, extra

    @trtp.impl(PLUGIN_ID)
    def _impl(q_abs, latent, cache, block_tables, context_lens, num_heads, kv_lora_rank, scale, outputs, stream):
        # JIT form (nodes without aot=1): the split kernels through torch. No TensorRT workspace reaches a QDP impl,
        # so the split partials come from torch's caching allocator: not capture-safe inside TensorRT's own CUDA
        # graphs (the IPluginV3 MlaDecode, plugins/mla/trt.py, carves them from the workspace instead)
        import torch

        from k3deploy.plugins.mla.kernels import mla_decode
        from k3deploy.plugins.trt_common import tensor_from_ptr

        tnames = {**names, trt.int32: "int32"}

        def wrap(t):
            return tensor_from_ptr(t.data_ptr, tuple(t.shape), tnames[t.dtype])

        with torch.cuda.stream(torch.cuda.ExternalStream(int(stream))):
            out, cache_out = (wrap(t) for t in outputs)   # cache_out aliases the pool input
            mla_decode(wrap(q_abs), wrap(latent), cache_out, wrap(block_tables), wrap(context_lens),
                       num_heads=int(scalar(num_heads)), kv_lora_rank=int(scalar(kv_lora_rank)),
                       scale=float(scalar(scale)), out=out)
