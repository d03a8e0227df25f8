"""k3-tiny exported in full with export/onnx_export.py, run with ONNX Runtime, checked against the PyTorch reference.

Tolerances (fp32 both sides): logits atol 2e-4 / rtol 1e-3 (export/verify.py TOLERANCES; observed ~3e-6);
greedy decoding must give identical tokens for 32 steps; the Polygraphy CLI check uses atol 1e-4 / rtol 1e-3.
The tp=2 check exports layers 0 (KDA, dense MLP, commit) and 3 (MLA, latent MoE with shared experts) prefill
segments for two ranks and compares the segment-wise execution (sum between segments) with the tp=1 graphs.
Slow-ish on 2 cores (~2-3 min, dominated by torch.onnx.export of ~40 graphs); module-scoped fixtures share the work.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from k3deploy.export.onnx_export import export_model
from k3deploy.export.verify import CLI_ATOL, CLI_RTOL, OrtModel, merge_pool, split_pool, verify
from k3deploy.model.config import load_config
from k3deploy.model.reference import Batch, K3Model, allocate_pools

POLYGRAPHY = str(Path(sys.executable).with_name("polygraphy"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from k3deploy.model.synthetic import write_synthetic
    return write_synthetic(load_config("k3-tiny"), tmp_path_factory.mktemp("ck") / "k3-tiny")


@pytest.fixture(scope="module")
def export_dir(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("onnx")
    export_model(ckpt, out, tp=1, progress=False)
    return out


@pytest.fixture(scope="module")
def model(ckpt) -> K3Model:
    return K3Model.from_checkpoint(ckpt)


def test_index_and_files(export_dir, ckpt):
    idx = json.loads((export_dir / "index.json").read_text())
    cfg = load_config(ckpt)
    assert idx["format_version"] == 1 and idx["config_hash"] == cfg.config_hash() and idx["opset"] == 20
    assert len(idx["graphs"]) == 2 + 2 * cfg.num_hidden_layers
    moe_nodes = 0
    for g in idx["graphs"]:
        path = export_dir / g["path"]
        assert path.is_file() and Path(str(path) + ".data").is_file()
        onnx.checker.check_model(str(path), full_check=True)
        m = onnx.load(str(path), load_external_data=False)
        meta = {p.key: p.value for p in m.metadata_props}
        assert meta["k3.config_hash"] == cfg.config_hash() and meta["k3.graph"] == g["graph"]
        assert meta["k3.tp_rank"] == "0" and meta["k3.tp_size"] == "1"
        if g["kind"] == "layer":
            assert meta["k3.layer"] == str(g["layer"]) and meta["k3.layer_kind"] == cfg.layer_kind(g["layer"])
            fnames = {f.name for f in m.functions}
            kinds = {n.op_type for n in m.graph.node if n.domain == "kimi"}
            assert kinds <= fnames and kinds
            assert all({"plugin_namespace", "plugin_version"} <= {a.name for a in n.attribute}
                       for n in m.graph.node if n.domain == "kimi")
            for n in m.graph.node:   # the global expert count reaches the MoE kernels' token-tile choice
                if n.op_type == "Mxfp4Moe":
                    assert onnx.helper.get_node_attr_value(n, "num_experts") == cfg.num_experts
                    moe_nodes += 1
    assert moe_nodes > 0
    dims = {d for g in idx["graphs"] for io in g["inputs"] for d in io["shape"] if isinstance(d, str)}
    assert dims == {"T", "B", "N", "N1", "S", "NB", "BS", "MB", "M"}


def test_rerun_skips_unchanged(export_dir, ckpt):
    before = {p: p.stat().st_mtime_ns for p in export_dir.rglob("*.onnx")}
    n_graphs = len(json.loads((export_dir / "index.json").read_text())["graphs"])
    export_model(ckpt, export_dir, tp=1, progress=False, layers=[0], graphs=("decode",))
    after = {p: p.stat().st_mtime_ns for p in export_dir.rglob("*.onnx")}
    assert before == after
    # a partial export keeps the other graphs in the index: it never shrinks to the subset
    assert len(json.loads((export_dir / "index.json").read_text())["graphs"]) == n_graphs


def _prefill_batch(lens, slots, bt, ctx=None):
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    return Batch(cu, torch.tensor(slots, dtype=torch.int32), torch.tensor(bt, dtype=torch.int32),
                 torch.tensor(ctx or [0] * len(lens), dtype=torch.int32))


def test_logits_match_reference(export_dir, model):
    cfg = model.cfg
    ortm = OrtModel(export_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (9,), generator=g)
    batch = _prefill_batch([6, 3], [2, 1], [[3, 1, 0], [2, 4, 5]])
    pools = allocate_pools(cfg, 3, 6, 4)
    ref, ref_pools = model.forward(ids, batch, pools)
    got, got_pools = ortm.forward(ids.numpy(), batch, [{l: {k: v.numpy() for k, v in d.items()} for l, d in pools.items()}])
    np.testing.assert_allclose(got, ref.numpy(), atol=2e-4, rtol=1e-3)
    for l in ref_pools:
        for k, v in ref_pools[l].items():
            np.testing.assert_allclose(got_pools[0][l][k], v.numpy(), atol=1e-4, rtol=1e-3, err_msg=f"layer {l} {k}")


def test_greedy_decode_32_steps(export_dir, model):
    """Prefill graphs then decode graphs: identical greedy tokens for two packed sequences over 32 steps."""
    cfg = model.cfg
    ortm = OrtModel(export_dir)
    bt = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [20, 19, 18, 17, 16, 15, 14, 13, 12, 11]]   # 40 tokens per sequence
    prompts = [[5, 17, 99, 3, 250], [7, 8, 1000]]
    ids = torch.tensor(prompts[0] + prompts[1])
    batch = _prefill_batch([5, 3], [1, 2], bt)
    tpools = allocate_pools(cfg, 3, 21, 4)
    opools = [{l: {k: v.numpy() for k, v in d.items()} for l, d in tpools.items()}]
    last = batch.last_token_index
    tl, tpools = model.forward(ids, batch, tpools, logits_index=last)
    ol, opools = ortm.forward(ids.numpy(), batch, opools, logits_index=last.numpy())
    ctx = [5, 3]
    t_tok, o_tok = [tl.argmax(-1).tolist()], [ol.argmax(-1).tolist()]
    for _ in range(31):
        dec = Batch(torch.arange(3, dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
                    torch.tensor(bt, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32), decode=True)
        tl, tpools = model.forward(torch.tensor(t_tok[-1]), dec, tpools)
        ol, opools = ortm.forward(np.array(o_tok[-1]), dec, opools)
        t_tok.append(tl.argmax(-1).tolist())
        o_tok.append(ol.argmax(-1).tolist())
        ctx = [c + 1 for c in ctx]
    assert o_tok == t_tok
    assert len(t_tok) == 32


def test_verify_report_and_polygraphy_cli(export_dir, ckpt, tmp_path):
    """export/verify.py passes every graph and end to end; the Polygraphy CLI check passes on layer 0's prefill
    graph and fails (non-zero exit) once a weight in that graph's ONNX is perturbed."""
    data = tmp_path / "pgd"
    rep = verify(export_dir, ckpt, tmp_path / "report.json", data)
    assert rep["passed"], json.dumps({k: v for k, v in rep["graphs"].items() if not v["passed"]}, indent=1)
    assert {"P_out", "bank_out", "state_out", "conv_out"} <= set(rep["graphs"]["rank0/layer000.prefill"]["outputs"])
    assert json.loads((tmp_path / "report.json").read_text())["passed"]
    gid = "rank0/layer000.prefill"
    onnx_path = export_dir / (gid + ".onnx")
    cmd = [POLYGRAPHY, "run", None, "--onnxrt", "--load-inputs", str(data / (gid + ".inputs.json")),
           "--load-outputs", str(data / (gid + ".outputs.json")), "--atol", str(CLI_ATOL), "--rtol", str(CLI_RTOL)]
    ok = subprocess.run([*cmd[:2], str(onnx_path), *cmd[3:]], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    # perturb the largest float initializer (a projection weight) by 1 % of its scale
    m = onnx.load(str(onnx_path))
    init = max((i for i in m.graph.initializer if i.data_type == onnx.TensorProto.FLOAT), key=lambda i: np.prod(i.dims))
    arr = onnx.numpy_helper.to_array(init).copy()
    arr.flat[: arr.size // 4] += 0.05 * np.abs(arr).max()
    init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    bad = tmp_path / "bad" / "layer.onnx"
    bad.parent.mkdir()
    onnx.save_model(m, str(bad), save_as_external_data=True, location="layer.onnx.data")
    res = subprocess.run([*cmd[:2], str(bad), *cmd[3:]], capture_output=True, text=True)
    assert res.returncode != 0, res.stdout[-3000:]


def test_tp2_segments_equal_tp1(ckpt, export_dir, tmp_path):
    """tp=2 (ep=2) per-rank segment graphs, run with a sum between segments, equal the tp=1 layer graphs
    (layers 0 and 3, prefill) and the embed/head collectives (vocab split) give the tp=1 values."""
    out = tmp_path / "tp2"
    idx = export_model(ckpt, out, tp=2, ep=2, layers=[0, 3], graphs=("prefill",), progress=False)
    segs = [g for g in idx["graphs"] if g["kind"] == "layer" and g["layer"] == 3]
    assert sorted((g["rank"], g["segment_index"], g["segment"]) for g in segs) == \
        [(r, i, s) for r in (0, 1) for i, s in enumerate(("attn", "mlp", "post"))]
    mlp = next(g for g in segs if g["segment"] == "mlp" and g["rank"] == 1)
    assert {"op": "all_reduce_sum", "output": "moe_latent_partial", "input": "moe_latent"} in mlp["collectives"]
    t1, t2 = OrtModel(export_dir), OrtModel(out)
    cfg = t1.cfg
    g = torch.Generator().manual_seed(1)
    T, d = 7, cfg.hidden_size
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g).numpy().astype(np.int32)
    e1 = {"ids": ids}
    t1._stage(lambda r: ("embed", "any", None, r), [e1])
    e2 = [{"ids": ids} for _ in range(2)]
    t2._stage(lambda r: ("embed", "any", None, r), e2)
    np.testing.assert_allclose(e2[0]["P"], e1["P"], atol=1e-6)
    batch = _prefill_batch([4, 3], [2, 1], [[3, 1, 0], [2, 4, 5]], ctx=[2, 0])
    meta = {k: getattr(batch, k).numpy() for k in ("cu_seqlens", "slots", "block_tables", "context_lens")}
    for l in (0, 3):
        nb = cfg.bank_rows_before(l)
        env = {"P": e1["P"], **meta}
        if nb:
            env["bank"] = torch.randn(T, nb, d, generator=g).numpy()
        pools = {k: torch.randn(*v.shape, generator=g).numpy() * 0.1
                 for k, v in allocate_pools(cfg, 3, 6, 4)[l].items()}
        one = [dict(env, **pools)]
        t1._stage(lambda r: ("layer", "prefill", l, r), one)
        split = {k: split_pool(k, v, 2) for k, v in pools.items()}
        two = [dict(env, **{k: v[r] for k, v in split.items()}) for r in range(2)]
        t2._stage(lambda r: ("layer", "prefill", l, r), two)
        np.testing.assert_allclose(two[0]["P_out"], one[0]["P_out"], atol=1e-4, rtol=1e-3)
        for k in pools:
            got = merge_pool(k, [two[r][k + "_out"] for r in range(2)])
            np.testing.assert_allclose(got, one[0][k + "_out"], atol=1e-5, rtol=1e-4, err_msg=f"layer {l} {k}")
        if cfg.is_commit(l):
            np.testing.assert_allclose(two[1]["bank_out"], one[0]["bank_out"], atol=1e-6)
    bank = torch.randn(T, idx["bank_rows_final"], d, generator=g).numpy()
    h1 = [{"P": e1["P"], "bank": bank, "logits_index": np.array([6, 0, 3], dtype=np.int32)}]
    h2 = [dict(h1[0]) for _ in range(2)]
    t1._stage(lambda r: ("head", "any", None, r), h1)
    t2._stage(lambda r: ("head", "any", None, r), h2)
    np.testing.assert_allclose(h2[0]["logits"], h1[0]["logits"], atol=2e-4, rtol=1e-3)


class _FixedRunner(BaseRunner):
    """A Polygraphy runner returning fixed outputs."""

    def __init__(self, name, outputs):
        super().__init__(name=name)
        self.outputs = outputs

    def activate_impl(self):
        pass

    def get_input_metadata_impl(self):
        return TensorMetadata().add("x", np.float32, [2])

    def infer_impl(self, feed_dict):
        self.inference_time = 0.0
        return dict(self.outputs)

    def deactivate_impl(self):
        pass


def test_compare_quiet_by_default_fails_an_output_not_compared(capsys, caplog):
    """verify.compare: Polygraphy's "Some values are 0" note and its 'colored' notice print only when the module
    logs at DEBUG (-v); an output that one runner lacks is not silently skipped: the result fails and names it."""
    import logging

    from k3deploy.export.verify import compare
    z = np.array([0.0, 1.0], dtype=np.float32)      # an exact zero, as every pool holds
    feeds = [{"x": z}]
    ok = compare([_FixedRunner("ref", {"a": z}), _FixedRunner("onnxrt", {"a": z})], feeds, ["a"])
    assert ok["passed"] and "not_compared" not in ok
    quiet = capsys.readouterr()
    assert "Some values are 0" not in quiet.out + quiet.err and "colored" not in quiet.out + quiet.err
    with caplog.at_level(logging.DEBUG, logger="k3deploy.export.verify"):
        compare([_FixedRunner("ref", {"a": z}), _FixedRunner("onnxrt", {"a": z})], feeds, ["a"])
    assert "Some values are 0" in capsys.readouterr().out
    bad = compare([_FixedRunner("ref", {"a": z, "b": z}), _FixedRunner("onnxrt", {"a": z})], feeds, ["a", "b"])
    assert not bad["passed"] and bad["not_compared"] == ["b"] and bad["outputs"]["a"]["passed"]
