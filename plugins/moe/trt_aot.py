"""Ahead-of-time TensorRT form of ``kimi::Mxfp4Moe``: four ``tensorrt.plugin`` (QDP, TensorRT >= 10.9) ops, each
ONE Triton kernel compiled to PTX and baked into the engine, so engines with MoE layers run without Python. Shared AOT
helpers: plugins/aot_common.py.

An AOT plugin is exactly one launch with no workspace, while ``mxfp4_moe`` (plugins/moe/kernels.py) is four launches
sharing scratch. ``build_engines.py --aot`` therefore rewrites every ``kimi::Mxfp4Moe`` node of a layer's ONNX
(:func:`decompose_mxfp4_moe`) into the four launches as graph nodes, the scratch becoming tensors that TensorRT
allocates between them:

    MoeSortPairs(topk_ids)                                      -> order [M] i32, tok [M] i32, offs [E+1] i32
    MoeExpertsW13(x, tok, offs, w13_packed, w13_scale)          -> h [M, I] act        (SiTU fused)
    MoeExpertsW2(h, order, topk_w, offs, w2_packed, w2_scale)   -> ypair [M, Rl] f32   (times the combine weight)
    MoeCombine(ypair, topk_ids)                                 -> y [T, Rl] f32       (the node's output)

with M = T*k (token, choice) pairs. The kernels are those of ``mxfp4_moe`` (on-device counting sort by local expert,
grouped GEMMs with MXFP4 dequantized in registers, fixed grids): the entry kernels here only turn TensorRT's dense
tensors into their strides, compiled in as constexprs. Parameters in TensorRT's AOT order (inputs, int32 extras,
outputs; STACK.md §1b); the only extra is ``M`` for the sort. Attributes (compiled in): MoeSortPairs and MoeCombine
``num_local_experts`` (E, from the weights' shape at rewrite time) and ``expert_offset``; MoeExpertsW13
``situ_beta``, ``situ_linear_beta``. Token tile 16 rows (decode-sized batches: `_pick_block_m`'s choice up to 16
pairs per expert; prefill engines get correct but slower 16-row tiles), K tile :func:`default_block_k`, 128 output
columns, 4 warps, 3 stages, the folded-scale dequant (``DQ=3``) as on the GPU JIT path.

Use: ``engines.build`` / ``build_engines.py --aot`` (full TensorRT >= 10.9): ``register()`` then the rewrite.
These four ops have no JIT (``@trtp.impl``) form: only the rewrite creates them.

Pure helpers (tested on a CPU machine): signatures, constexprs, launch parameters, :func:`compile_ptx`, the rewrite;
the entry kernels run under the Triton interpreter against ``mxfp4_moe`` (tests/plugins/test_graph_safe.py).
"""
# no `from __future__ import annotations`: tensorrt.plugin reads the QDP functions' annotations as objects

import functools
from typing import Any, Tuple

import numpy as np

from k3deploy.plugins.aot_common import (autotune_string, compile_entry, entry_signature, qdp_available, register_qdp,
                                 scalar)
from k3deploy.plugins.aot_ops import replace_nodes, static_int

SORT, W13, W2, COMBINE = "kimi::MoeSortPairs", "kimi::MoeExpertsW13", "kimi::MoeExpertsW2", "kimi::MoeCombine"
AOT_OPS = (SORT, W13, W2, COMBINE)
# (inputs, extras, outputs) per op: (name, class) as in plugins/aot_common.entry_signature
PARAMS = {
    SORT: ((("ids_ptr", "i32"),), (("M", "i32"),), (("order_ptr", "i32"), ("tok_ptr", "i32"), ("offs_ptr", "i32"))),
    W13: ((("x_ptr", "act"), ("tok_ptr", "i32"), ("offs_ptr", "i32"), ("w_ptr", "u8"), ("s_ptr", "u8")), (),
          (("h_ptr", "act"),)),
    W2: ((("h_ptr", "act"), ("pair_ptr", "i32"), ("wts_ptr", "f32"), ("offs_ptr", "i32"), ("w_ptr", "u8"),
          ("s_ptr", "u8")), (), (("y_ptr", "f32"),)),
    COMBINE: ((("ypair_ptr", "f32"), ("ids_ptr", "i32")), (), (("y_ptr", "f32"),)),
}
CONSTEXPRS = {
    SORT: ("E", "EXPERT_OFFSET", "K", "BLOCK"),
    W13: ("I", "RL", "BETA", "LBETA", "BM", "BN", "BK", "DQ", "CDT", "SG"),
    W2: ("I", "RL", "BM", "BN", "BK", "DQ", "CDT", "SG"),
    COMBINE: ("E", "EXPERT_OFFSET", "RL", "K", "BK", "BR"),
}
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, SORT_BLOCK = 16, 128, 4, 3, 1024

try:  # the entry kernels need Triton; the pure helpers do not
    import triton
    import triton.language as tl

    from k3deploy.plugins.moe.kernels import _moe_combine_kernel, _moe_sort_kernel, _moe_w2_kernel, _moe_w13_kernel

    @triton.jit
    def _moe_sort_aot_kernel(ids_ptr, M, order_ptr, tok_ptr, offs_ptr, E: tl.constexpr, EXPERT_OFFSET: tl.constexpr,
                             K: tl.constexpr, BLOCK: tl.constexpr):
        """grid (E + 1, 1, 1): `_moe_sort_kernel` (pairs sorted by local expert, offs[E+1])."""
        _moe_sort_kernel(ids_ptr, order_ptr, tok_ptr, offs_ptr, M, E, EXPERT_OFFSET, K, BLOCK)

    @triton.jit
    def _moe_w13_aot_kernel(x_ptr, tok_ptr, offs_ptr, w_ptr, s_ptr, h_ptr, I: tl.constexpr, RL: tl.constexpr,
                            BETA: tl.constexpr, LBETA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, DQ: tl.constexpr, CDT: tl.constexpr, SG: tl.constexpr):
        """grid (cdiv(I, BN), E, 1): `_moe_w13_kernel` on dense x [T, RL], w13 [E, 2I, RL/2], scales [E, 2I, RL/32],
        h [M, I]."""
        _moe_w13_kernel(x_ptr, tok_ptr, offs_ptr, w_ptr, s_ptr, h_ptr, RL, 2 * I * (RL // 2), RL // 2,
                        2 * I * (RL // 32), RL // 32, I, I, RL, BETA, LBETA, BM, BN, BK, DQ, CDT, SG)

    @triton.jit
    def _moe_w2_aot_kernel(h_ptr, pair_ptr, wts_ptr, offs_ptr, w_ptr, s_ptr, y_ptr, I: tl.constexpr,
                           RL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DQ: tl.constexpr,
                           CDT: tl.constexpr, SG: tl.constexpr):
        """grid (cdiv(RL, BN), E, 1): `_moe_w2_kernel` on dense h [M, I], w2 [E, RL, I/2], scales [E, RL, I/32],
        ypair [M, RL]."""
        _moe_w2_kernel(h_ptr, pair_ptr, wts_ptr, offs_ptr, w_ptr, s_ptr, y_ptr, I, RL * (I // 2), I // 2,
                       RL * (I // 32), I // 32, RL, I, RL, BM, BN, BK, DQ, CDT, SG)

    @triton.jit
    def _moe_combine_aot_kernel(ypair_ptr, ids_ptr, y_ptr, E: tl.constexpr, EXPERT_OFFSET: tl.constexpr,
                                RL: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
        """grid (T, cdiv(RL, BR), 1): `_moe_combine_kernel` (y [T, RL] = the token's local pairs summed)."""
        _moe_combine_kernel(ypair_ptr, ids_ptr, y_ptr, RL, E, EXPERT_OFFSET, RL, K, BK, BR)

    ENTRY = {SORT: _moe_sort_aot_kernel, W13: _moe_w13_aot_kernel, W2: _moe_w2_aot_kernel,
             COMBINE: _moe_combine_aot_kernel}
except ImportError:  # pragma: no cover - Triton missing: nothing to compile, register() returns []
    triton = None
    ENTRY = {}


# ------------------------------------------------------------------------------------------------- pure helpers
def kernel_signature(op: str, act: str) -> dict[str, str]:
    """Triton signature of ``op``'s entry kernel (parameter order, constexprs included) for activation dtype ``act``
    (x and h). Raises ValueError for an unsupported dtype, KeyError for an unknown op."""
    ins, extra, outs = PARAMS[op]
    return entry_signature(ins, extra, outs, CONSTEXPRS[op], act, op)


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _combine_block(latent: int) -> int:
    """Columns per combine program (as ``mxfp4_moe``): the latent width rounded up to a power of two, at most 256."""
    return min(256, _pow2(latent))


def kernel_constexprs(op: str, *, num_local_experts: int = 0, expert_offset: int = 0, top_k: int = 0,
                      latent: int = 0, inter: int = 0, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                      interpret: bool = False) -> dict[str, Any]:
    """Values compiled into ``op``'s PTX (attributes and shapes: E, expert_offset, k, Rl, I, SiTU betas) plus the
    tiles. ``interpret``: plain-Triton dequant and fp32 products (the Triton interpreter, tests) instead of the
    GPU's inline-PTX dequant (DQ=3) and bf16 products. Raises ValueError for widths that are not multiples of 32."""
    from k3deploy.plugins.moe.kernels import _scan_groups, default_block_k

    if op == SORT:
        return {"E": int(num_local_experts), "EXPERT_OFFSET": int(expert_offset), "K": int(top_k),
                "BLOCK": SORT_BLOCK}
    if op == COMBINE:
        return {"E": int(num_local_experts), "EXPERT_OFFSET": int(expert_offset), "RL": int(latent), "K": int(top_k),
                "BK": _pow2(top_k), "BR": _combine_block(latent)}
    RL, I = int(latent), int(inter)
    tiles = {"I": I, "RL": RL, "BM": BLOCK_M, "BN": BLOCK_N, "BK": default_block_k(RL, I, BLOCK_M),
             "DQ": 0 if interpret else 3, "CDT": tl.float32 if interpret else tl.bfloat16,
             "SG": _scan_groups((RL if op == W13 else I) // 32)}
    if op == W13:
        return {"I": I, "RL": RL, "BETA": float(situ_beta), "LBETA": float(situ_linear_beta),
                **{k: tiles[k] for k in ("BM", "BN", "BK", "DQ", "CDT", "SG")}}
    return tiles


def launch_params(op: str, *, num_local_experts: int = 0, num_tokens=None, latent: int = 0, inter: int = 0,
                  warps: int = NUM_WARPS, shared: int = 0) -> dict[str, Any]:
    """Launch of ``op``'s entry kernel (grids as ``mxfp4_moe``'s): sort (E+1, 1, 1); W13 (cdiv(I, 128), E, 1);
    W2 (cdiv(Rl, 128), E, 1); combine (T, cdiv(Rl, BR), 1). ``num_tokens`` may be a TensorRT shape expression."""
    E = int(num_local_experts)
    grid = {SORT: (E + 1, 1, 1), W13: (-(-int(inter) // BLOCK_N), E, 1), W2: (-(-int(latent) // BLOCK_N), E, 1),
            COMBINE: (num_tokens, -(-int(latent) // _combine_block(latent)) if latent else 1, 1)}[op]
    return {"grid_x": grid[0], "grid_y": grid[1], "grid_z": grid[2], "block_x": 32 * int(warps), "block_y": 1,
            "block_z": 1, "shared_mem": int(shared)}


def autotune_types(op: str) -> str:
    """``AutoTuneCombination`` type string of ``op``'s inputs then outputs."""
    ins, _, outs = PARAMS[op]
    return autotune_string(ins + outs)


@functools.lru_cache(maxsize=None)
def _compile_cached(op, act, items, target, ptx_version):
    ins, extra, outs = PARAMS[op]
    return compile_entry(ENTRY[op], kernel_signature(op, act), kernel_constexprs(op, **dict(items)),
                         num_warps=NUM_WARPS, num_stages=NUM_STAGES, n_args=len(ins) + len(extra) + len(outs),
                         what=op, target=target, ptx_version=ptx_version)


def compile_ptx(op: str, act: str, target=None, ptx_version: int | None = None, **attrs) -> tuple[str, str, int, int]:
    """Compile ``op``'s entry kernel for activation dtype ``act`` with ``attrs`` (:func:`kernel_constexprs`'s
    keywords): ``(kernel name, PTX, num_warps, static shared bytes)``. ``target``/``ptx_version`` as in
    plugins/aot_common.compile_entry. Cached. RuntimeError without Triton, ValueError for a bad dtype or width."""
    if not ENTRY:
        raise RuntimeError("Mxfp4Moe AOT needs Triton (pip install triton)")
    return _compile_cached(op, act, tuple(sorted(attrs.items())), target, ptx_version)


# --------------------------------------------------------------------------------------------- the ONNX rewrite
def _static_dims(model, name: str):
    """Dims of graph tensor ``name`` from the initializers or value_info (None where unknown or symbolic)."""
    g = model.graph
    for init in g.initializer:
        if init.name == name:
            return list(init.dims)
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        if vi.name == name:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
            return dims if dims else None
    return None


def decompose_mxfp4_moe(model) -> int:
    """Replace every top-level ``kimi::Mxfp4Moe`` node of ``model`` (onnx.ModelProto, in place) by the four AOT
    ops (module docstring), marked ``aot=1``, in the node's place (topological order kept; plugins/aot_ops.py
    :func:`~plugins.aot_ops.replace_nodes`). E is read from ``w13_packed``'s static shape (an initializer or a shaped
    graph input); ValueError naming the node otherwise. Returns how many nodes were replaced."""
    from onnx import helper

    def expand(node, attrs):
        x, ids, wts, w13, s13, w2, s2 = node.input
        dims = _static_dims(model, w13)
        if not dims or dims[0] is None:
            raise ValueError(f"Mxfp4Moe node {node.name!r}: the AOT form needs the static shape of {w13!r} "
                             "(E local experts); export the weights as initializers")
        base = node.output[0]      # tensor names are unique in a valid graph, node names need not be
        t = {k: f"{base}__moe_{k}" for k in ("order", "tok", "offs", "h", "ypair")}
        common = dict(domain="kimi", plugin_namespace="kimi", plugin_version="1", aot=1)
        eo = int(attrs.get("expert_offset", 0))
        return [
            helper.make_node("MoeSortPairs", [ids], [t["order"], t["tok"], t["offs"]], name=f"{base}__sort",
                             num_local_experts=int(dims[0]), expert_offset=eo, **common),
            helper.make_node("MoeExpertsW13", [x, t["tok"], t["offs"], w13, s13], [t["h"]], name=f"{base}__w13",
                             situ_beta=float(attrs.get("situ_beta", 4.0)),
                             situ_linear_beta=float(attrs.get("situ_linear_beta", 25.0)), **common),
            helper.make_node("MoeExpertsW2", [t["h"], t["order"], wts, t["offs"], w2, s2], [t["ypair"]],
                             name=f"{base}__w2", **common),
            helper.make_node("MoeCombine", [t["ypair"], ids], list(node.output), name=f"{base}__combine",
                             num_local_experts=int(dims[0]), expert_offset=eo, **common),
        ]

    return replace_nodes(model, "Mxfp4Moe", expand)


# ----------------------------------------------------------------------------------------------- registration
def available() -> bool:
    """True where ``tensorrt.plugin`` has ``aot_impl`` (TensorRT >= 10.9) and Triton is importable."""
    return bool(ENTRY) and qdp_available()


_DONE: list[str] = []


def register() -> list[str]:
    """Register the four QDP ops (register + autotune + aot_impl) with ``tensorrt.plugin``. Idempotent. Returns
    :data:`AOT_OPS`, or ``[]`` (nothing registered) where :func:`available` is False."""
    return register_qdp(_DONE, ENTRY.get(SORT), AOT_OPS, _define_qdp)


def _static(expr, what: str) -> int:
    """A shape expression that must be a build-time constant (a weight or latent width) as an int
    (plugins/aot_ops.static_int; ValueError otherwise)."""
    return static_int(expr, what)


def _define_qdp(trt, trtp) -> None:
    import numpy.typing as npt

    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    TD = trtp.TensorDesc
    I32 = npt.NDArray[np.int32]
    F32 = npt.NDArray[np.float32]

    def launch(op, act, extra, lp_kw, **attrs):
        name, ptx, warps, shared = compile_ptx(op, act, **attrs)
        lp = trtp.KernelLaunchParams()
        for key, value in launch_params(op, warps=warps, shared=shared, **lp_kw).items():
            setattr(lp, key, value)
        return name.encode(), ptx.encode(), lp, trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in extra])

    @trtp.register(SORT)
    def _sort_desc(topk_ids: TD, num_local_experts: I32, expert_offset: I32) -> Tuple[TD, TD, TD]:
        m = topk_ids.shape_expr[0] * topk_ids.shape_expr[1]
        E = int(scalar(num_local_experts))
        return (trtp.from_shape_expr((m,), dtype=trt.int32), trtp.from_shape_expr((m,), dtype=trt.int32),
                trtp.from_shape_expr((E + 1,), dtype=trt.int32))

    @trtp.autotune(SORT)
    def _sort_tune(topk_ids, outputs):
        return [trtp.AutoTuneCombination(autotune_types(SORT))]

    @trtp.aot_impl(SORT)
    def _sort_aot(topk_ids, num_local_experts, expert_offset, outputs, tactic):
        E = int(scalar(num_local_experts))
        return launch(SORT, "float32", [topk_ids.shape_expr[0] * topk_ids.shape_expr[1]], dict(num_local_experts=E),
                      num_local_experts=E, expert_offset=int(scalar(expert_offset)),
                      top_k=_static(topk_ids.shape_expr[1], "top-k"))

    @trtp.register(W13)
    def _w13_desc(x: TD, tok: TD, offs: TD, w13_packed: TD, w13_scale: TD, situ_beta: F32,
                  situ_linear_beta: F32) -> TD:
        return trtp.from_shape_expr((tok.shape_expr[0], w13_packed.shape_expr[1] // 2), dtype=x.dtype)

    @trtp.autotune(W13)
    def _w13_tune(x, tok, offs, w13_packed, w13_scale, outputs):
        return [trtp.AutoTuneCombination(autotune_types(W13))]

    @trtp.aot_impl(W13)
    def _w13_aot(x, tok, offs, w13_packed, w13_scale, situ_beta, situ_linear_beta, outputs, tactic):
        E = _static(w13_packed.shape_expr[0], "the local expert count")
        RL, I = _static(x.shape_expr[1], "the latent width"), _static(w13_packed.shape_expr[1], "2I") // 2
        return launch(W13, names[x.dtype], [], dict(num_local_experts=E, inter=I), latent=RL, inter=I,
                      situ_beta=float(scalar(situ_beta)), situ_linear_beta=float(scalar(situ_linear_beta)))

    @trtp.register(W2)
    def _w2_desc(h: TD, order: TD, topk_w: TD, offs: TD, w2_packed: TD, w2_scale: TD) -> TD:
        return trtp.from_shape_expr((h.shape_expr[0], w2_packed.shape_expr[1]), dtype=trt.float32)

    @trtp.autotune(W2)
    def _w2_tune(h, order, topk_w, offs, w2_packed, w2_scale, outputs):
        return [trtp.AutoTuneCombination(autotune_types(W2))]

    @trtp.aot_impl(W2)
    def _w2_aot(h, order, topk_w, offs, w2_packed, w2_scale, outputs, tactic):
        E = _static(w2_packed.shape_expr[0], "the local expert count")
        RL, I = _static(w2_packed.shape_expr[1], "the latent width"), _static(h.shape_expr[1], "I")
        return launch(W2, names[h.dtype], [], dict(num_local_experts=E, latent=RL), latent=RL, inter=I)

    @trtp.register(COMBINE)
    def _combine_desc(ypair: TD, topk_ids: TD, num_local_experts: I32, expert_offset: I32) -> TD:
        return trtp.from_shape_expr((topk_ids.shape_expr[0], ypair.shape_expr[1]), dtype=trt.float32)

    @trtp.autotune(COMBINE)
    def _combine_tune(ypair, topk_ids, outputs):
        return [trtp.AutoTuneCombination(autotune_types(COMBINE))]

    @trtp.aot_impl(COMBINE)
    def _combine_aot(ypair, topk_ids, num_local_experts, expert_offset, outputs, tactic):
        RL = _static(ypair.shape_expr[1], "the latent width")
        return launch(COMBINE, "float32", [], dict(num_tokens=topk_ids.shape_expr[0], latent=RL),
                      num_local_experts=int(scalar(num_local_experts)), expert_offset=int(scalar(expert_offset)),
                      latent=RL, top_k=_static(topk_ids.shape_expr[1], "top-k"))
