"""Each kimi op's ONNX function body (run by ONNX Runtime) against its fp32 reference (plugins/<op>/reference.py).

Tolerance (fp32, different summation order): atol 2e-5, rtol 1e-4 on outputs and updated pools. Cases cover T=1, T not
a multiple of the chunk size 64, a sequence shorter than the conv window, several packed sequences with non-zero
initial states (chunked prefill, starting mid-chunk), non-contiguous slots / block tables, and the rejection of a
zero-length sequence (ValueError from the torch op `torch.ops.kimi.*`, i.e. the reference's `check_cu_seqlens`;
the ONNX body cannot raise, the runtime validates batches before running graphs).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import k3deploy.plugins.torch_ops  # noqa: F401  (torch.ops.kimi.*)
from k3deploy.plugins.kda import reference as kda_ref
from k3deploy.plugins.mla import reference as mla_ref
from k3deploy.plugins.moe import reference as moe_ref
from k3deploy.plugins.moe.mxfp4 import pack_mxfp4
from k3deploy.plugins.onnx_common import OPSET, function_proto, single_op_model, specs

ATOL, RTOL = 2e-5, 1e-4
F32, I32, U8 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT32, onnx.TensorProto.UINT8
_ELEM = {torch.float32: F32, torch.int32: I32, torch.uint8: U8}


def run_body(op_type: str, inputs: dict, outputs: dict, attrs: dict) -> list[np.ndarray]:
    """Build a one-node model (dynamic leading dims), check it fully, run it in ORT."""
    ins = [(n, _ELEM[v.dtype], [f"{n}_d{i}" for i in range(v.dim())]) for n, v in inputs.items()]
    outs = [(n, _ELEM[dt], [f"{n}_d{i}" for i in range(r)]) for n, (dt, r) in outputs.items()]
    m = single_op_model(op_type, ins, outs, attrs)
    onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.numpy() for k, v in inputs.items()})


def assert_close(got, exp, names):
    for g, e, n in zip(got, exp, names):
        np.testing.assert_allclose(g, e.numpy(), atol=ATOL, rtol=RTOL, err_msg=n)


# ---- KDA ---------------------------------------------------------------------------------------------------

def kda_inputs(lens, slots, S=8, H=2, K=8, W=4, seed=0, zero_state=False):
    g = torch.Generator().manual_seed(seed)
    T, P = sum(lens), H * K
    r = lambda *s, sc=1.0: torch.randn(*s, generator=g) * sc  # noqa: E731
    return dict(qkv=r(T, 3 * P), f=r(T, P), b=r(T, H), g=r(T, P), conv_w=r(3 * P, W, sc=0.5), A_log=r(H, sc=0.3),
                dt_bias=r(P, sc=0.3), o_norm_w=torch.rand(K, generator=g) + 0.5,
                state=torch.zeros(S, H, K, K) if zero_state else r(S, H, K, K, sc=0.2),
                conv=torch.zeros(S, 3 * P, W - 1) if zero_state else r(S, 3 * P, W - 1),
                cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32),
                slots=torch.tensor(slots, dtype=torch.int32))


KDA_OUT = {"out": (torch.float32, 2), "state_out": (torch.float32, 4), "conv_out": (torch.float32, 3)}


@pytest.mark.parametrize("lens,slots,zero", [
    ([1], [3], True),                      # T = 1, fresh state
    ([1], [3], False),                     # T = 1 continuing a state
    ([70], [1], False),                    # T not a multiple of the chunk size 64
    ([2], [5], False),                     # shorter than the conv window (W = 4): history comes from the pool
    ([3, 1, 65, 2], [6, 2, 7, 1], False),  # packed, non-zero initial states (chunked prefill mid-chunk), non-contiguous slots
])
def test_kda_prefill(lens, slots, zero):
    inp = kda_inputs(lens, slots, zero_state=zero)
    got = run_body("KdaPrefill", inp, KDA_OUT, dict(num_heads=2, head_dim=8))
    exp = kda_ref.kda_prefill(*inp.values(), num_heads=2, head_dim=8)
    assert_close(got, exp, list(KDA_OUT))
    # the torch.library op is the reference on CPU
    assert_close([t.numpy() for t in torch.ops.kimi.kda_prefill(*inp.values(), 2, 8)], exp, list(KDA_OUT))


def test_kda_decode():
    inp = kda_inputs([1, 1, 1], [4, 0, 2], seed=1)
    inp.pop("cu_seqlens")
    got = run_body("KdaDecode", inp, KDA_OUT, dict(num_heads=2, head_dim=8, lower_bound=-5.0, norm_eps=1e-5))
    exp = kda_ref.kda_decode(*inp.values(), num_heads=2, head_dim=8)
    assert_close(got, exp, list(KDA_OUT))


def test_kda_prefill_then_decode_equals_one_prefill():
    """Chunked state hand-over through the pools: body(prefill 5) -> body(decode 1) == reference(prefill 6)."""
    inp = kda_inputs([6], [2], seed=2, zero_state=True)
    first = {k: (v[:5] if k in ("qkv", "f", "b", "g") else v) for k, v in inp.items()}
    first["cu_seqlens"] = torch.tensor([0, 5], dtype=torch.int32)
    _, st, cv = run_body("KdaPrefill", first, KDA_OUT, dict(num_heads=2, head_dim=8))
    dec = {k: (v[5:] if k in ("qkv", "f", "b", "g") else v) for k, v in inp.items() if k != "cu_seqlens"}
    dec["state"], dec["conv"] = torch.from_numpy(st), torch.from_numpy(cv)
    out, st2, cv2 = run_body("KdaDecode", dec, KDA_OUT, dict(num_heads=2, head_dim=8))
    exp = kda_ref.kda_prefill(*inp.values(), num_heads=2, head_dim=8)
    np.testing.assert_allclose(out, exp[0][5:].numpy(), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(st2, exp[1].numpy(), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(cv2, exp[2].numpy(), atol=ATOL, rtol=RTOL)


def test_kda_zero_length_sequence_rejected():
    inp = kda_inputs([2, 3], [1, 2])
    inp["cu_seqlens"] = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    inp["slots"] = torch.tensor([1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="zero-length sequence"):
        torch.ops.kimi.kda_prefill(*inp.values(), 2, 8)


# ---- MLA ---------------------------------------------------------------------------------------------------

def mla_inputs(lens, ctx, tables, NB=10, BS=4, H=2, Dn=8, Dr=4, Dv=6, R=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, C = sum(lens), R + Dr
    return dict(q=torch.randn(T, H, Dn + Dr, generator=g), latent=torch.randn(T, C, generator=g),
                kv_b=torch.randn(H * (Dn + Dv), R, generator=g) * 0.3, cache=torch.randn(NB, BS, C, generator=g),
                block_tables=torch.tensor(tables, dtype=torch.int32),
                cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32),
                context_lens=torch.tensor(ctx, dtype=torch.int32))


MLA_ATTRS = dict(num_heads=2, qk_nope_head_dim=8, v_head_dim=6, kv_lora_rank=16, scale=12 ** -0.5)


@pytest.mark.parametrize("lens,ctx,tables", [
    ([1], [0], [[3, 0, 0]]),                             # T = 1, empty context
    ([9], [0], [[7, 2, 5]]),                             # several non-contiguous blocks
    ([3, 1, 2], [5, 0, 2], [[4, 9, 0], [1, 0, 0], [8, 6, 0]]),   # packed with cached contexts, mid-block starts
])
def test_mla_prefill(lens, ctx, tables):
    inp = mla_inputs(lens, ctx, tables)
    outs = {"out": (torch.float32, 2), "cache_out": (torch.float32, 3)}
    got = run_body("MlaPrefill", inp, outs, MLA_ATTRS)
    exp = mla_ref.mla_prefill(*inp.values(), **MLA_ATTRS)
    assert_close(got, exp, list(outs))


def test_mla_decode():
    inp = mla_inputs([1, 1, 1], [5, 0, 11], [[4, 9, 2], [1, 0, 0], [8, 6, 3]])
    R = 16
    g = torch.Generator().manual_seed(3)
    dec = dict(q_abs=torch.randn(3, 2, R + 4, generator=g), latent=inp["latent"], cache=inp["cache"],
               block_tables=inp["block_tables"], context_lens=inp["context_lens"])
    attrs = dict(num_heads=2, kv_lora_rank=R, scale=0.2)
    outs = {"out_latent": (torch.float32, 3), "cache_out": (torch.float32, 3)}
    got = run_body("MlaDecode", dec, outs, attrs)
    assert_close(got, mla_ref.mla_decode(*dec.values(), **attrs), list(outs))


def test_mla_zero_length_sequence_rejected():
    inp = mla_inputs([2, 1], [0, 0], [[1, 2, 0], [3, 0, 0]])
    inp["cu_seqlens"] = torch.tensor([0, 2, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="zero-length sequence"):
        torch.ops.kimi.mla_prefill(*inp.values(), 2, 8, 6, 16, 0.3)


# ---- MoE ---------------------------------------------------------------------------------------------------

def moe_inputs(T=5, E=4, k=2, Rl=64, I=32, offset=0, n_global=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13p, w13s = pack_mxfp4(torch.randn(E, 2 * I, Rl, generator=g) * 0.1)
    w2p, w2s = pack_mxfp4(torch.randn(E, Rl, I, generator=g) * 0.1)
    ids = torch.stack([torch.randperm(n_global, generator=g)[:k] for _ in range(T)]).int()
    return dict(x=torch.randn(T, Rl, generator=g), topk_ids=ids, topk_w=torch.rand(T, k, generator=g),
                w13_packed=w13p, w13_scale=w13s, w2_packed=w2p, w2_scale=w2s)


@pytest.mark.parametrize("T,offset,lbeta", [(1, 0, 25.0), (7, 4, 25.0), (3, 0, None)])
def test_mxfp4_moe(T, offset, lbeta):
    """EP partial sums (experts offset..offset+3 of 8 global), T = 1, and situ_linear_beta None (attribute 0.0)."""
    inp = moe_inputs(T=T, offset=offset)
    attrs = dict(expert_offset=offset, situ_beta=4.0, situ_linear_beta=0.0 if lbeta is None else lbeta,
                 num_experts=8 if offset else 0)
    got = run_body("Mxfp4Moe", inp, {"y": (torch.float32, 2)}, attrs)
    exp = moe_ref.mxfp4_moe(*inp.values(), expert_offset=offset, situ_beta=4.0, situ_linear_beta=lbeta,
                            num_experts=attrs["num_experts"])
    np.testing.assert_allclose(got[0], exp.numpy(), atol=ATOL, rtol=RTOL)


# ---- function contract ------------------------------------------------------------------------------------

def test_function_bodies_declare_contract():
    for name, spec in specs().items():
        fp = function_proto(spec.body)
        assert fp.domain == "kimi" and fp.name == name
        assert {o.domain: o.version for o in fp.opset_import}[""] == OPSET
        declared = set(fp.attribute) | {a.name for a in fp.attribute_proto}
        assert {"plugin_namespace", "plugin_version"} <= declared
        assert {a for a in spec.schema.attributes} <= declared, name
