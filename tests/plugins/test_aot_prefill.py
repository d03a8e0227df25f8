"""Ahead-of-time KdaPrefill and MlaPrefill: the ``--aot`` rewrites into chains of single-launch ops
(plugins/kda/trt_aot_prefill.py, plugins/mla/trt_aot_prefill.py, table and glue in plugins/aot_ops.py).

CPU (TRITON_INTERPRET=1, tiny shapes): an ONNX model with one KdaPrefill / MlaPrefill node is rewritten and its nodes
are executed in order with each op's entry kernel (plugins.aot_ops.run_nodes; new tensors poisoned with NaN): the
outputs and the updated pools equal the op's reference, pool rows of other slots/blocks untouched. One exception,
stated: fla-core's inter-chunk state kernel does not run under the interpreter (it calls ``.to`` on a loop index),
so on the CPU that node runs `_state_pass_torch` (the same recurrence in torch); on the GPU all nine run through
Triton. The entries compile to sm_90 PTX with exactly TensorRT's parameters; the tensorrt.plugin glue runs against a
stand-in module with symbolic shapes. GPU: the same chains through Triton's JIT and as PTX launched through the CUDA
driver the way TensorRT's AOT launcher does, at K3's head sizes.
"""
import os

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the first triton import

import onnx                                          # noqa: E402
from onnx import helper                              # noqa: E402

from k3deploy.plugins import aot_ops                          # noqa: E402
from k3deploy.plugins.kda import reference as kda_ref         # noqa: E402
from k3deploy.plugins.kda import trt_aot_prefill as kda_pre   # noqa: E402
from k3deploy.plugins.mla import reference as mla_ref         # noqa: E402
from k3deploy.plugins.mla import trt_aot_prefill as mla_pre   # noqa: E402
from kernel_checks import (DriverKernel, FakeDesc, Sym, compile_in_subprocess,  # noqa: E402
                           fake_tensorrt_plugin, nan_equal, relerr)

DEV = "cuda" if HAS_CUDA else "cpu"
needs_kda_chain = pytest.mark.skipif(not kda_pre.ENTRY, reason="needs Triton and fla-core 0.6.0 (the KdaPrefill "
                                                                 "chain compiles fla-core's stage kernels in)")
KDA_NAMES = ("qkv", "f", "b", "g", "conv_w", "A_log", "dt_bias", "o_norm_w", "state", "conv", "cu_seqlens", "slots")
MLA_NAMES = ("q", "latent", "kv_b", "cache", "block_tables", "cu_seqlens", "context_lens")


def _one_node_model(op_type, inputs, outputs, **attrs):
    node = helper.make_node(op_type, list(inputs), list(outputs), name="n0", domain="kimi", plugin_namespace="kimi",
                            plugin_version="1", **attrs)
    return helper.make_model(helper.make_graph([node], "g", [], []))


# --------------------------------------------------------------------------------------------------- KdaPrefill
def _kda_inputs(lens, H, K, S, slots, act, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, P = sum(lens), H * K
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(qkv=r(T, 3 * P).to(act), f=r(T, P).to(act), b=r(T, H).to(act), g=r(T, P).to(act),
                conv_w=r(3 * P, 4) * 0.5, A_log=r(H) * 0.5, dt_bias=r(P) * 0.3,
                o_norm_w=torch.rand(K, generator=g) + 0.5, state=r(S, H, K, K) * 0.1, conv=r(S, 3 * P, 3).to(act),
                cu_seqlens=torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32),
                slots=torch.tensor(slots, dtype=torch.int32))


def _state_pass_torch(op, ins, attrs, **kw):
    """fla's inter-chunk state pass in torch (CPU only; module docstring): per sequence and chunk of 64 tokens,
    h[c] = S; vn = u - w Sᵀ; S = S * exp2(gk[last])[k] + vnᵀ kg (S is [V, K] per head, gk in log2 units)."""
    kg, w, u, gk, h0, cu, co = (ins[n] for n, _ in op.inputs)
    H, K = attrs["num_heads"], attrs["head_dim"]
    T, N = kg.shape[0], co.shape[0] - 1
    h = torch.full((-(-T // 64) + N - 1, H, K, K), float("nan"))
    vn = torch.full((T, H, K), float("nan"))
    ht = torch.full((N, H, K, K), float("nan"))
    for n in range(N):
        S = h0[n].clone()
        b, e = int(cu[n]), int(cu[n + 1])
        for c, t0 in enumerate(range(b, e, 64)):
            t1 = min(t0 + 64, e)
            h[int(co[n]) + c] = S
            vn[t0:t1] = u[t0:t1] - torch.einsum("thk,hvk->thv", w[t0:t1], S)
            S = S * torch.exp2(gk[t1 - 1])[:, None, :] + torch.einsum("thv,thk->hvk", vn[t0:t1], kg[t0:t1])
        ht[n] = S
    return dict(h=h, vn=vn, ht=ht)


def _run_chain(model, env, ops, run):
    if HAS_CUDA:
        return aot_ops.run_nodes(model.graph.node, env, ops, run=run, fill=float("nan"))

    def cpu_run(op, ins, attrs, **kw):   # fp32 compute dtype: the interpreter's bf16 dots are broken
        if op.name == "KdaStatePass":
            return _state_pass_torch(op, ins, attrs)
        return run(op, ins, attrs, y_dtype=torch.float32, fill=float("nan"))

    return aot_ops.run_nodes(model.graph.node, env, ops, run=cpu_run)


def _kda_chain_vs_reference(lens, H, K, slots, act, run, tol):
    S = max(slots) + 2
    x = {k: v.to(DEV) for k, v in _kda_inputs(lens, H, K, S, slots, act).items()}
    model = _one_node_model("KdaPrefill", KDA_NAMES, ["out", "state_out", "conv_out"], num_heads=H, head_dim=K,
                            lower_bound=-5.0, norm_eps=1e-5)
    assert kda_pre.decompose_kda_prefill(model) == 1
    st0, cv0 = x["state"].clone(), x["conv"].clone()
    env = _run_chain(model, dict(x), {op.name: op for op in kda_pre.OPS.values()}, run)
    ro, rs, rc = kda_ref.kda_prefill(*[x[n].cpu().float() if x[n].is_floating_point() else x[n].cpu()
                                       for n in KDA_NAMES[:8]], st0.cpu(), cv0.cpu().float(), x["cu_seqlens"].cpu(),
                                     x["slots"].cpu(), num_heads=H, head_dim=K)
    assert env["state_out"].data_ptr() == x["state"].data_ptr() and env["conv_out"].data_ptr() == x["conv"].data_ptr()
    assert relerr(env["out"], ro) < tol
    assert relerr(env["state_out"], rs) < tol
    assert torch.equal(env["conv_out"].cpu(), rc.to(act))      # the history is raw inputs: copied exactly
    others = [s for s in range(S) if s not in slots]
    assert torch.equal(env["state_out"][others], st0[others]) and torch.equal(env["conv_out"][others], cv0[others])


@needs_kda_chain
@pytest.mark.parametrize("lens", [[37, 1, 62], [70], [2, 64, 65]])
def test_kda_prefill_aot_chain_matches_reference(lens):
    """Nine launches, node by node: several sequences (one shorter than the conv window, lengths around the 64-token
    chunk), one sequence, non-contiguous slots; fp32 activations (the y tensors in fp32 on the CPU, bf16 on the GPU
    as the JIT path)."""
    slots = [5, 1, 3][:len(lens)]
    _kda_chain_vs_reference(lens, 2, 32, slots, torch.float32, aot_ops.run_op, 2e-2 if HAS_CUDA else 1e-4)


@pytest.mark.gpu
@needs_kda_chain
@pytest.mark.parametrize("H", [4, 12])
def test_kda_prefill_aot_chain_gpu_k3_heads(H):
    """bf16 activations, head_dim 128 (K3), through Triton's JIT on the GPU."""
    _kda_chain_vs_reference([100, 3, 190], H, 128, [6, 2, 4], torch.bfloat16, aot_ops.run_op, 3e-2)


# --------------------------------------------------------------------------------------------------- MlaPrefill
def _mla_inputs(lens, ctxl, H, R, DR, Dn, Dv, BS, dt, seed=3):
    g = torch.Generator().manual_seed(seed)
    N, T = len(lens), sum(lens)
    MB = max((c + n + BS - 1) // BS for c, n in zip(ctxl, lens)) + 1
    NB = N * MB + 5
    cache = torch.full((NB, BS, R + DR), float("nan")).to(dt)
    bt = (torch.randperm(NB - 1, generator=g)[:N * MB].view(N, MB) + 1).int()
    for n in range(N):
        for p in range(ctxl[n]):
            cache[bt[n, p // BS], p % BS] = torch.randn(R + DR, generator=g).to(dt)
    return dict(q=torch.randn(T, H, Dn + DR, generator=g).to(dt), latent=torch.randn(T, R + DR, generator=g).to(dt),
                kv_b=(torch.randn(H * (Dn + Dv), R, generator=g) * R ** -0.5).to(dt), cache=cache, block_tables=bt,
                cu_seqlens=torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32),
                context_lens=torch.tensor(ctxl, dtype=torch.int32))


def _mla_chain_vs_reference(lens, ctxl, H, R, DR, Dn, Dv, BS, dt, run, tol):
    x = {k: v.to(DEV) for k, v in _mla_inputs(lens, ctxl, H, R, DR, Dn, Dv, BS, dt).items()}
    attrs = dict(num_heads=H, qk_nope_head_dim=Dn, v_head_dim=Dv, kv_lora_rank=R, scale=(Dn + DR) ** -0.5)
    model = _one_node_model("MlaPrefill", MLA_NAMES, ["out", "cache_out"], **attrs)
    assert mla_pre.decompose_mla_prefill(model) == 1
    cache0 = x["cache"].clone()
    ro, rc = mla_ref.mla_prefill(*[x[n].cpu().float() for n in ("q", "latent", "kv_b")], cache0.cpu().float(),
                                 *[x[n].cpu() for n in ("block_tables", "cu_seqlens", "context_lens")], **attrs)
    env = _run_chain(model, dict(x), {op.name: op for op in mla_pre.OPS.values()}, run)
    assert env["cache_out"].data_ptr() == x["cache"].data_ptr()
    assert relerr(env["out"], ro) < tol
    assert nan_equal(env["cache_out"].float(), rc.to(dt).float())     # other blocks keep their NaN poison


@pytest.mark.parametrize("lens,ctxl,BS", [([3, 7, 1], [0, 5, 9], 16), ([1], [0], 16), ([9, 9, 9, 1], [3, 0, 18, 2], 16),
                                         ([9, 9, 9, 1], [3, 0, 40, 2], 32)])
def test_mla_prefill_aot_chain_matches_reference(lens, ctxl, BS):
    """Four launches, node by node: prefix context in the cache, several sequences, random block tables, the cache
    block size a runtime extra (16: the 16-token attention tiles; 32: the 32-token ones)."""
    _mla_chain_vs_reference(lens, ctxl, H=3, R=32, DR=16, Dn=16, Dv=16, BS=BS, dt=torch.float32,
                            run=aot_ops.run_op, tol=2e-3 if HAS_CUDA else 1e-5)


def test_mla_prefill_aot_attention_refuses_a_straddling_block_size():
    """A cache block size the 16-token tile does not divide: the attention writes NaN (loud), not a wrong result."""
    x = {k: v.to(DEV) for k, v in _mla_inputs([5], [3], 2, 32, 16, 16, 16, 8, torch.float32).items()}
    attrs = dict(num_heads=2, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, scale=0.2)
    model = _one_node_model("MlaPrefill", MLA_NAMES, ["out", "cache_out"], **attrs)
    mla_pre.decompose_mla_prefill(model)
    env = _run_chain(model, dict(x), {op.name: op for op in mla_pre.OPS.values()}, aot_ops.run_op)
    assert torch.isnan(env["out__mla_ol"]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("H", [12, 96])
def test_mla_prefill_aot_chain_gpu_k3_heads(H):
    _mla_chain_vs_reference([37, 1, 90], [70, 0, 130], H=H, R=512, DR=64, Dn=128, Dv=128, BS=64, dt=torch.bfloat16,
                            run=aot_ops.run_op, tol=2e-2)


# ------------------------------------------------------------------------------------------------ the rewrites
def test_decompose_prefill_nodes_order_attributes_and_aliasing():
    """The rewrites keep the graph's tensor names at the ends, mark every node aot=1 with the op's attributes, and
    every tensor an op updates in place has that op as its only consumer (so TensorRT orders the write after every
    read of the old contents); a node without its attributes is refused."""
    cases = [(kda_pre, "KdaPrefill", KDA_NAMES, ["out", "state_out", "conv_out"],
              dict(num_heads=12, head_dim=128), 9),
             (mla_pre, "MlaPrefill", MLA_NAMES, ["out", "cache_out"],
              dict(num_heads=12, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512, scale=0.07), 4)]
    for mod, op_type, ins, outs, attrs, count in cases:
        model = _one_node_model(op_type, ins, outs, **attrs)
        assert getattr(mod, f"decompose_{op_type[:3].lower()}_prefill")(model) == 1
        nodes = list(model.graph.node)
        assert [n.op_type for n in nodes] == [op.name for op in mod.OPS.values()] and len(nodes) == count
        produced = {o for n in nodes for o in n.output}
        assert set(outs) <= produced
        assert {i for n in nodes for i in n.input} - produced == set(ins)   # every graph input used, nothing dangling
        ops = {op.name: op for op in mod.OPS.values()}
        real = dict(q=(5, 12, 192), qa=(60, 576), latent=(5, 576), cache=(9, 64, 576))
        for n in nodes:
            a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
            assert a["aot"] == 1 and a["plugin_namespace"] == b"kimi" and n.domain == "kimi"
            op = ops[n.op_type]
            assert {k for k, _ in op.attrs} == set(a) - {"aot", "plugin_namespace", "plugin_version"}
            dims = {k: real.get(k, (7, 7, 7, 7)) for k, _ in op.inputs}
            for (oname, _), shape in zip(op.outputs, op.shapes(dims,
                                                               {**attrs, "lower_bound": -5.0, "norm_eps": 1e-5},
                                                               aot_ops.int_cdiv)):
                if isinstance(shape, str):
                    aliased = n.input[[k for k, _ in op.inputs].index(shape)]
                    consumers = [m.name for m in nodes if aliased in m.input]
                    assert consumers == [n.name], (op.name, aliased, consumers)
        model = _one_node_model(op_type, ins, outs, **{k: v for k, v in list(attrs.items())[1:]})
        with pytest.raises(ValueError, match="missing"):
            getattr(mod, f"decompose_{op_type[:3].lower()}_prefill")(model)


def test_mark_aot_nodes_rewrites_prefill_ops(tmp_path):
    """engines.build.mark_aot_nodes rewrites KdaPrefill / MlaPrefill only when asked, and onnx_custom_ops (the
    manifest's plugin list) names the chains' thirteen ops, not the replaced ones."""
    from k3deploy.engines.build import mark_aot_nodes, onnx_custom_ops

    kda = _one_node_model("KdaPrefill", KDA_NAMES, ["out", "state_out", "conv_out"], num_heads=2, head_dim=32)
    assert mark_aot_nodes(kda, ["KdaDecode"]) == 0 and [n.op_type for n in kda.graph.node] == ["KdaPrefill"]
    mla = _one_node_model("MlaPrefill", MLA_NAMES, ["mout", "cache_out"], num_heads=2, qk_nope_head_dim=16,
                          v_head_dim=16, kv_lora_rank=32, scale=0.2)
    kda.graph.node.extend(mla.graph.node)
    onnx.save(kda, tmp_path / "two.onnx")
    ops = onnx_custom_ops(tmp_path / "two.onnx", aot_ops=["KdaPrefill", "MlaPrefill"])
    assert sorted(ops) == sorted(kda_pre.AOT_OPS + mla_pre.AOT_OPS)
    assert mark_aot_nodes(kda, ["KdaPrefill", "MlaPrefill"]) == 2
    assert [n.op_type for n in kda.graph.node] == [op.name for op in kda_pre.OPS.values()] + \
        [op.name for op in mla_pre.OPS.values()]
    assert any(o.domain == "kimi" for o in kda.opset_import)


# --------------------------------------------------------------------------------------------------------- PTX
def test_prefill_aot_kernels_compile_to_ptx_for_sm90():
    """All thirteen entries compile for sm_90 on a CPU machine at K3 per-rank widths (KDA 12 heads x 128; MLA 12
    heads, R 512, Dr 64) with exactly TensorRT's parameters (inputs + extras + outputs) and at most 227 KB of
    shared memory."""
    code = ("from triton.backends.compiler import GPUTarget\n"
            "from plugins.aot_ops import compile_op\n"
            "from plugins.kda import trt_aot_prefill as K\n"
            "from plugins.mla import trt_aot_prefill as M\n"
            "t = GPUTarget('cuda', 90, 32)\n"
            "ka = dict(num_heads=12, head_dim=128, lower_bound=-5.0, norm_eps=1e-5)\n"
            "ma = dict(num_heads=12, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512, scale=192 ** -0.5)\n"
            "md = dict(q=(1, 12, 192), qa=(12, 576), latent=(1, 576), cache=(9, 64, 576))\n"
            "for mod, attrs, dims in ((K, ka, {}), (M, ma, md)):\n"
            "    for op in (mod.OPS.values() if mod.ENTRY else []):\n"
            "        name, ptx, w, sh = compile_op(op, 'bfloat16', dims, attrs, target=t)\n"
            "        n = len(op.inputs) + len(op.extra) + len(op.outputs)\n"
            "        print(op.name, entry_params(name, ptx), n, w, sh, '.target sm_90a' in ptx)\n")
    lines = compile_in_subprocess(code)
    names = [ln[0] for ln in lines]
    assert names[-4:] == ["MlaWriteLatents", "MlaAbsorbQ", "MlaPrefillAttn", "MlaUpProject"]
    if kda_pre.ENTRY:
        assert names[:9] == [op.name for op in kda_pre.OPS.values()]
    for ln in lines:
        assert ln[1] == ln[2] and ln[5] == "True" and 0 <= int(ln[4]) <= 227 * 1024, ln


# ------------------------------------------------------------------------------------- tensorrt.plugin glue
def test_prefill_aot_qdp_glue_with_stand_in_tensorrt_plugin(monkeypatch):
    """aot_ops.define_qdp against a stand-in tensorrt.plugin: output descs (shapes symbolic in T and N, class
    dtypes, aliases), the autotune string, launch grids as shape expressions (trtp.cdiv), int32 extras, and the
    constexprs handed to the compiler; a symbolic latent width is refused for MLA."""
    trt, trtp = fake_tensorrt_plugin()
    compiled = []
    monkeypatch.setattr(aot_ops, "compile_op", lambda op, act, dims, attrs: compiled.append((op.name, act, attrs))
                        or ("kern", "PTX", 4, 2048))
    aot_ops.define_qdp(trt, trtp, list(kda_pre.OPS.values()) + list(mla_pre.OPS.values()))
    assert {k for k, _ in trtp.defs} == {"register", "autotune", "aot_impl"}
    assert len(trtp.defs) == 3 * 13
    T, N = Sym("T"), Sym("N")
    i32 = lambda v: np.array([v], np.int32)      # noqa: E731
    f32 = lambda v: np.array([v], np.float32)    # noqa: E731
    prep = kda_pre.OPS["prep"]
    ins = [FakeDesc(("S", 12, 128, 128), "F32"), FakeDesc((N,), "I32"), FakeDesc((N + 1,), "I32"),
           FakeDesc((T, 12), "F32")]
    st, h0, ci, co = trtp.defs[("register", prep.op_id)](*ins, i32(12), i32(128))
    assert st.alias_of is ins[0] and h0.shape_expr[0] is N and h0.dtype == "F32" and ci.dtype == "I32"
    assert ci.shape_expr[0].name == "((cdiv(T,64)+N)-1)" and co.shape_expr[0].name == "(N+1)"
    assert trtp.defs[("autotune", prep.op_id)](*ins, (st, h0, ci, co)) == \
        [("combo", "FP32|FP32|FP32, INT32|INT32|INT32, INT32|INT32|INT32, FP32|FP16|BF16, FP32|FP32|FP32, "
                   "FP32|FP32|FP32, INT32|INT32|INT32, INT32|INT32|INT32")]
    name, ptx, lp, extra = trtp.defs[("aot_impl", prep.op_id)](*ins, i32(12), i32(128), (st, h0, ci, co), 0)
    assert (name, ptx, lp.grid_x.name, lp.grid_y, lp.block_x, lp.shared_mem) == (b"kern", b"PTX", "(N+1)", 48, 128,
                                                                                 2048)
    assert extra == ("exprs", [("i32", T), ("i32", N)]) and compiled[-1] == ("KdaChunkPrep", "float32",
                                                                             {"num_heads": 12, "head_dim": 128})
    conv = kda_pre.OPS["conv"]
    cins = [FakeDesc((T, 4608), "F32"), FakeDesc((4608, 4), "F32"), FakeDesc((T, 12), "F32")]
    y, beta, akk = trtp.defs[("register", conv.op_id)](*cins, i32(12), i32(128))
    assert y.dtype == "BF16" and beta.dtype == "BF16" and y.shape_expr[0] == 3   # fp32 activations: bf16 compute
    assert akk.shape_expr[1:] == [12, 64] and akk.dtype == "BF16"
    _, _, lp, _ = trtp.defs[("aot_impl", conv.op_id)](*cins, i32(12), i32(128), (y, beta, akk), 0)
    assert lp.grid_x.name == "(cdiv(T,16)*49)" and lp.grid_y == 1      # flat grid: 4H + 1 column blocks per tile
    out = kda_pre.OPS["out"]
    oins = [FakeDesc((3, T, 1536), "BF16"), FakeDesc((T, 12, 128), "F32"), FakeDesc((Sym("NT"), 12, 128, 128), "BF16"),
            FakeDesc((T, 12, 128), "BF16"), FakeDesc((T, 12, 64), "BF16"), FakeDesc((T, 1536), "BF16"),
            FakeDesc((128,), "F32"), FakeDesc((N + 1,), "I32"), FakeDesc((Sym("NT"), 2), "I32"),
            FakeDesc((N, 12, 128, 128), "F32"), FakeDesc((N,), "I32"), FakeDesc(("S", 12, 128, 128), "F32")]
    o, so = trtp.defs[("register", out.op_id)](*oins, i32(12), i32(128), f32(1e-5))
    assert o.shape_expr[0] is T and o.shape_expr[1] == 1536 and o.dtype == "BF16" and so.alias_of is oins[-1]
    _, _, lp, extra = trtp.defs[("aot_impl", out.op_id)](*oins, i32(12), i32(128), f32(1e-5), (o, so), 0)
    assert lp.grid_x.name == "(NT+N)" and lp.grid_y == 12 and extra[1][2][1].name == "NT" and extra[1][1][1] is N
    assert compiled[-1][2]["norm_eps"] == pytest.approx(1e-5)
    attn = mla_pre.OPS["attn"]
    mattrs = [i32(12), i32(128), i32(128), i32(512), f32(0.07)]
    mins = [FakeDesc((T * 12, 576), "BF16"), FakeDesc(("NB", "BS", 576), "BF16"), FakeDesc((N, "MB"), "I32"),
            FakeDesc((N + 1,), "I32"), FakeDesc((N,), "I32")]
    (ol,) = [trtp.defs[("register", attn.op_id)](*mins, *mattrs)]
    assert ol.shape_expr[1] == 512 and ol.dtype == "BF16"
    _, _, lp, extra = trtp.defs[("aot_impl", attn.op_id)](*mins, *mattrs, (ol,), 0)
    assert lp.grid_x.name == "(cdiv((T*12),32)+N)" and lp.block_x == 128
    assert extra == ("exprs", [("i32", N), ("i32", "MB"), ("i32", "BS")])
    absorb = mla_pre.OPS["absorb"]
    with pytest.raises(ValueError, match="must be static"):
        trtp.defs[("register", absorb.op_id)](FakeDesc((T, 12, Sym("D")), "BF16"), FakeDesc((3072, 512), "BF16"),
                                              *mattrs)


def test_register_table_with_stand_in_tensorrt_plugin(monkeypatch):
    """register_table registers a table once (its op ids, a second call registers nothing new) and nothing where an
    entry kernel is missing."""
    import sys

    trt, trtp = fake_tensorrt_plugin()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    done = []
    assert aot_ops.register_table(done, mla_pre.OPS) == list(mla_pre.AOT_OPS)
    assert len(trtp.defs) == 3 * 4
    assert aot_ops.register_table(done, mla_pre.OPS) == list(mla_pre.AOT_OPS) and len(trtp.defs) == 3 * 4
    import dataclasses
    broken = dict(mla_pre.OPS, up=dataclasses.replace(mla_pre.OPS["up"], entry=None))
    assert aot_ops.register_table([], broken) == []


# ----------------------------------------------------------------------------------------- through the driver
def _driver_run(op, ins, attrs, fill=None, **kw):
    """Launch ``op``'s AOT PTX (this GPU's target) through the CUDA driver with TensorRT's convention."""
    outs = aot_ops.allocate_outputs(op, ins, attrs, fill=fill)
    grid, args = aot_ops.kernel_args(op, ins, outs, attrs)
    name, ptx, warps, shared = aot_ops.compile_op(op, aot_ops.tensor_act(op, ins), aot_ops.tensor_dims(op, ins), attrs)
    kern = DriverKernel(name, ptx, shared)
    packed = kern.params(args)
    kern.launch(dict(grid_x=grid[0], grid_y=grid[1], grid_z=grid[2], block_x=32 * warps, block_y=1, block_z=1,
                     shared_mem=shared), packed)
    torch.cuda.synchronize()
    kern.unload()
    return outs


@pytest.mark.gpu
@needs_kda_chain
def test_kda_prefill_aot_ptx_through_the_driver():
    """The nine KdaPrefill PTX modules launched in sequence through the CUDA driver (TensorRT's AOT convention; above
    48 KB of shared memory the function is opted in) equal the reference at 4 heads x 128, bf16."""
    _kda_chain_vs_reference([100, 3, 190], 4, 128, [6, 2, 4], torch.bfloat16, _driver_run, 3e-2)


@pytest.mark.gpu
def test_mla_prefill_aot_ptx_through_the_driver():
    """The four MlaPrefill PTX modules through the CUDA driver equal the reference at 16 heads, R 512, Dr 64, BS 64."""
    _mla_chain_vs_reference([37, 1, 90], [70, 0, 130], H=16, R=512, DR=64, Dn=128, Dv=128, BS=64, dt=torch.bfloat16,
                            run=_driver_run, tol=2e-2)
