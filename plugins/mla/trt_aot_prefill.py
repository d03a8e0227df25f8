"""Ahead-of-time TensorRT form of ``kimi::MlaPrefill``: four single-launch ``tensorrt.plugin`` ops (QDP, TensorRT
>= 10.9; table and glue in plugins/aot_ops.py) that ``build_engines.py --aot`` rewrites each MlaPrefill node into
(:func:`decompose_mla_prefill`), so prefill engines with MLA layers run without Python.

The chain is ``mla_prefill``'s graph-safe path (plugins/mla/kernels.py: absorbed attention over the paged latent
cache) with each launch a graph node and the scratch (absorbed queries, attended latents) tensors TensorRT
allocates::

    MlaWriteLatents(latent, cache, block_tables, cu, context_lens)  -> cache_out (in place)
    MlaAbsorbQ(q, kv_b)                                            -> qa [T*H, R+Dr] act (q_nope W_UK ‖ q_pe)
    MlaPrefillAttn(qa, cache_out, block_tables, cu, context_lens)  -> ol [T*H, R] act (causal over context + new)
    MlaUpProject(ol, kv_b, q)                                      -> out [T, H*Dv] act (ol W_UVᵀ)

``q`` feeds MlaUpProject only for its token count. Extras (int32, from the shapes): N (sequences), MB (block-table
width), BS (cache block size: exported graphs keep it symbolic, so the kernels take it at run time) and T. An
attention tile of cached tokens must lie inside one cache block: 32 tokens where 32 divides BS, else 16 (both
compiled in, chosen at run time); a block size that 16 does not divide makes the attention write NaN (fails loudly;
the runtime allocates 16, 32 or 64). Tiles: absorption 64 tokens x 128 latent columns (8 warps), attention 32 query
rows (8 warps, 2 stages; mma.sync), up-projection 64 tokens x 64 outputs (4 warps). The JIT op's attention takes
64 x 64 tiles on sm_90 (warpgroup MMA; 64 x 16 for fp32 caches), faster than these 32 x 32 tiles, so on Hopper this
chain's attention is slower than the JIT plugin's (bench_kernels.py --only aot_prefill measures both); moving it to
those tiles needs the launcher to opt into ~216 KiB of shared memory (not done).
Attributes compiled in: num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank, scale; the rope width Dr and the
latent width come from q's and latent's static last dims.
"""
# no `from __future__ import annotations`: tensorrt.plugin reads the QDP functions' annotations as objects

from k3deploy.plugins.aot_ops import KernelOp, make_aot_node, register_table, replace_nodes, static_int

BT, BR, BM, BN, BNS = 64, 128, 32, 32, 64

try:  # the entry kernels need Triton; the tables do not
    import triton
    import triton.language as tl

    from k3deploy.plugins.mla.kernels import (_mla_absorb_q_kernel, _mla_prefill_attn_kernel, _mla_up_kernel,
                                     _write_latents_varlen_kernel)

    @triton.jit
    def _mla_write_aot(lat_ptr, cache_ptr, bt_ptr, cu_ptr, ctx_ptr, N, MB, BS, cache_out_ptr, DL: tl.constexpr,
                       BDL: tl.constexpr, BNS: tl.constexpr):
        """grid (T,): `_write_latents_varlen_kernel` into the aliased cache."""
        _write_latents_varlen_kernel(lat_ptr, cache_out_ptr, bt_ptr, cu_ptr, ctx_ptr, N, DL, MB, BS, DL=DL, BDL=BDL,
                                     BNS=BNS)

    @triton.jit
    def _mla_absorb_aot(q_ptr, w_ptr, T, qa_ptr, H: tl.constexpr, DN: tl.constexpr, BDN: tl.constexpr,
                        DV: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr):
        """grid (cdiv(T, BT), H, R / BR): `_mla_absorb_q_kernel` on dense q [T, H, DN+DR], kv_b [H(DN+DV), R]."""
        _mla_absorb_q_kernel(q_ptr, w_ptr, qa_ptr, T, H, H * (DN + DR), DN + DR, R, DN=DN, BDN=BDN, DV=DV, R=R,
                             DR=DR, BT=BT, BR=BR)

    @triton.jit
    def _mla_attn_aot(qa_ptr, cache_ptr, bt_ptr, cu_ptr, ctx_ptr, N, MB, BS, ol_ptr, H: tl.constexpr,
                      R: tl.constexpr, DR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BNS: tl.constexpr,
                      SCALE: tl.constexpr):
        """grid (cdiv(T*H, BM) + N,): `_mla_prefill_attn_kernel` with BN-token tiles where BN divides the block
        size BS, else 16-token tiles (a runtime branch: both are compiled in); with a block size 16 does not divide,
        program p writes NaN over output rows p*BM .. p*BM+BM-1 instead (a tile would straddle two blocks)."""
        if BS % BN == 0:
            _mla_prefill_attn_kernel(qa_ptr, cache_ptr, bt_ptr, cu_ptr, ctx_ptr, ol_ptr, N, H, MB, SCALE, BS, R=R,
                                     DR=DR, BM=BM, BN=BN, BNS=BNS)
        elif BS % 16 == 0:
            _mla_prefill_attn_kernel(qa_ptr, cache_ptr, bt_ptr, cu_ptr, ctx_ptr, ol_ptr, N, H, MB, SCALE, BS, R=R,
                                     DR=DR, BM=BM, BN=16, BNS=BNS)
        else:
            rows = tl.program_id(0) * BM + tl.arange(0, BM)
            T = tl.load(cu_ptr + N)
            tl.store(ol_ptr + rows[:, None].to(tl.int64) * R + tl.arange(0, R)[None, :],
                     tl.full([BM, R], float("nan"), ol_ptr.dtype.element_ty), mask=(rows < T * H)[:, None])

    @triton.jit
    def _mla_up_aot(ol_ptr, w_ptr, q_ptr, T, out_ptr, H: tl.constexpr, DN: tl.constexpr, DV: tl.constexpr,
                    R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
        """grid (cdiv(T, BT), H, cdiv(DV, BD)): `_mla_up_kernel` (out [T, H*DV] dense)."""
        _mla_up_kernel(ol_ptr, w_ptr, out_ptr, T, H, R, H * DV, DN=DN, DV=DV, R=R, BT=BT, BK=BK, BD=BD)

    ENTRY = dict(write=_mla_write_aot, absorb=_mla_absorb_aot, attn=_mla_attn_aot, up=_mla_up_aot)
except ImportError:  # pragma: no cover - Triton missing: register() returns []
    ENTRY = {}


# ------------------------------------------------------------------------------------------------------ table
ATTRS = (("num_heads", int), ("qk_nope_head_dim", int), ("v_head_dim", int), ("kv_lora_rank", int),
         ("scale", float))


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _widths(d, a) -> dict:
    """Static widths: H, Dn, Dv, R from the attributes; Dr from q's last dim (``q`` or, for the attention, the latent
    width of ``qa``). Raises ValueError unless R and Dr are powers of two (the kernels' tiles; K3: 512 and 64)."""
    H, DN, DV, R = (int(a[k]) for k in ("num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"))
    DR = static_int(d["q"][2], "q's last dim (Dn + Dr)") - DN if "q" in d else \
        static_int(d["qa"][1], "the latent width (R + Dr)") - R
    for name, v in (("kv_lora_rank", R), ("qk_rope_head_dim", DR)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"MlaPrefill AOT: {name} = {v} must be a power of two")
    return dict(H=H, DN=DN, DV=DV, R=R, DR=DR)


def _ops() -> dict:
    e = ENTRY.get
    BTR = (("block_tables", "i32"), ("cu", "i32"), ("context_lens", "i32"))
    return {
        "write": KernelOp(
            "kimi::MlaWriteLatents", e("write"), (("latent", "act"), ("cache", "act")) + BTR,
            (("N", "i32"), ("MB", "i32"), ("BS", "i32")), (("cache_out", "act"),), ATTRS,
            shapes=lambda d, a, c: ["cache"],
            launch=lambda d, a, c: ((d["latent"][0], 1, 1),
                                    [d["context_lens"][0], d["block_tables"][1], d["cache"][1]]),
            constexprs=lambda d, a: dict(DL=static_int(d["latent"][1], "the latent width"),
                                         BDL=_pow2(static_int(d["latent"][1], "the latent width")), BNS=BNS)),
        "absorb": KernelOp(
            "kimi::MlaAbsorbQ", e("absorb"), (("q", "act"), ("kv_b", "act")), (("T", "i32"),), (("qa", "act"),),
            ATTRS,
            shapes=lambda d, a, c: [(d["q"][0] * int(a["num_heads"]),
                                     int(a["kv_lora_rank"]) + _widths(d, a)["DR"])],
            launch=lambda d, a, c: ((c(d["q"][0], BT), int(a["num_heads"]), int(a["kv_lora_rank"]) //
                                     min(int(a["kv_lora_rank"]), BR)), [d["q"][0]]),
            constexprs=lambda d, a: dict(**_widths(d, a), BDN=max(16, _pow2(_widths(d, a)["DN"])), BT=BT,
                                         BR=min(_widths(d, a)["R"], BR)),
            num_warps=8),
        "attn": KernelOp(
            "kimi::MlaPrefillAttn", e("attn"), (("qa", "act"), ("cache", "act")) + BTR,
            (("N", "i32"), ("MB", "i32"), ("BS", "i32")), (("ol", "act"),), ATTRS,
            shapes=lambda d, a, c: [(d["qa"][0], int(a["kv_lora_rank"]))],
            launch=lambda d, a, c: ((c(d["qa"][0], BM) + d["context_lens"][0], 1, 1),
                                    [d["context_lens"][0], d["block_tables"][1], d["cache"][1]]),
            constexprs=lambda d, a: dict(H=int(a["num_heads"]), R=_widths(d, a)["R"], DR=_widths(d, a)["DR"], BM=BM,
                                         BN=BN, BNS=BNS, SCALE=float(a["scale"])),
            num_warps=8, num_stages=2),
        "up": KernelOp(
            "kimi::MlaUpProject", e("up"), (("ol", "act"), ("kv_b", "act"), ("q", "act")), (("T", "i32"),),
            (("out", "act"),), ATTRS,
            shapes=lambda d, a, c: [(d["q"][0], int(a["num_heads"]) * int(a["v_head_dim"]))],
            launch=lambda d, a, c: ((c(d["q"][0], BT), int(a["num_heads"]),
                                     -(-int(a["v_head_dim"]) // min(64, max(16, _pow2(a["v_head_dim"]))))),
                                    [d["q"][0]]),
            constexprs=lambda d, a: dict(H=int(a["num_heads"]), DN=int(a["qk_nope_head_dim"]),
                                         DV=int(a["v_head_dim"]), R=int(a["kv_lora_rank"]), BT=BT,
                                         BK=min(int(a["kv_lora_rank"]), 64),
                                         BD=min(64, max(16, _pow2(a["v_head_dim"])))),
            num_warps=4),
    }


OPS = _ops()              # the four ops in launch order: key -> KernelOp
AOT_OPS = tuple(op.op_id for op in OPS.values())   # their plugin ids ("kimi::...")


# --------------------------------------------------------------------------------------------- the ONNX rewrite
def _expand(node, attrs) -> list:
    missing = [n for n, _ in ATTRS if n not in attrs]
    if missing:
        raise ValueError(f"MlaPrefill node {node.name!r}: attribute(s) {missing} missing (export with "
                         "plugins/mla/onnx.py)")
    q, latent, kv_b, cache, bt, cu, ctx = node.input
    out, cache_out = node.output
    base = out          # tensor names are unique in a valid graph, node names need not be
    qa, ol = f"{base}__mla_qa", f"{base}__mla_ol"

    def mk(key, ins, outs):
        return make_aot_node(OPS[key], ins, outs, f"{base}__{key}", attrs)

    return [mk("write", [latent, cache, bt, cu, ctx], [cache_out]),
            mk("absorb", [q, kv_b], [qa]),
            mk("attn", [qa, cache_out, bt, cu, ctx], [ol]),
            mk("up", [ol, kv_b, q], [out])]


def decompose_mla_prefill(model) -> int:
    """Replace every top-level ``kimi::MlaPrefill`` node of ``model`` (onnx.ModelProto, in place) by the four AOT
    ops of the module docstring (marked ``aot=1``). Returns how many nodes were replaced; ValueError for a node
    missing an attribute."""
    return replace_nodes(model, "MlaPrefill", _expand)


# ----------------------------------------------------------------------------------------------- registration
_DONE: list[str] = []


def register() -> list[str]:
    """Register the four QDP ops with ``tensorrt.plugin`` (idempotent). Returns :data:`AOT_OPS`, or ``[]`` where
    ``tensorrt.plugin`` has no ``aot_impl`` or an entry kernel is missing (no Triton)."""
    return register_table(_DONE, OPS)
