"""Tests for engines/ (TensorRT-RTX ahead-of-time builds on CPU) and the pure parts of plugins/*/trt.py.

Engine tests build a small ONNX with a ``kimi``-domain custom node (plugin_namespace/plugin_version attributes, a
FunctionProto body with a Scan recurrence, symbolic dims, external-data weights) for sm86 with two profiles.
They skip when ``tensorrt_rtx_bindings`` is not importable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3deploy.plugins.kda.trt import KDA_DECODE, KDA_PREFILL
from k3deploy.plugins.mla.trt import MLA_DECODE, MLA_PREFILL
from k3deploy.plugins.moe.trt import MXFP4_MOE
from k3deploy.plugins.trt_common import (attrs_from_fields, fields_from_attrs, make_plugin_classes, output_dtypes,
                                output_shapes, supports_combination)

REPO = Path(__file__).resolve().parents[2]
KDA_ATTRS = {"num_heads": 2, "head_dim": 4}
MLA_P_ATTRS = {"num_heads": 2, "qk_nope_head_dim": 8, "v_head_dim": 6, "kv_lora_rank": 512, "scale": 0.1}
MLA_D_ATTRS = {"num_heads": 2, "kv_lora_rank": 512, "scale": 0.1}


def _rtx():
    try:
        import tensorrt_rtx_bindings
    except ImportError:
        pytest.skip("tensorrt_rtx_bindings not installed (pip install tensorrt-rtx-cu13-libs "
                    "tensorrt-rtx-cu13-bindings); engine builds need it on a machine without full TensorRT")
    return tensorrt_rtx_bindings


# ------------------------------------------------------------------------------------------- plugin pure-Python parts
@pytest.mark.parametrize("spec,attrs", [(KDA_PREFILL, KDA_ATTRS), (KDA_DECODE, KDA_ATTRS),
                                        (MLA_PREFILL, MLA_P_ATTRS), (MLA_DECODE, MLA_D_ATTRS), (MXFP4_MOE, {})])
def test_fields_roundtrip_and_defaults(spec, attrs):
    fields = fields_from_attrs(spec, attrs)
    assert [n for n, _, _ in fields] == spec.field_names
    for _, arr, kind in fields:
        assert arr.dtype == (np.int32 if kind == "int" else np.float32) and arr.shape == (1,)
    back = attrs_from_fields(spec, [(n, a) for n, a, _ in fields])
    defaults = {a.name: a.default for a in spec.attrs if a.default is not None}
    assert back == pytest.approx({**defaults, **attrs})


def test_fields_errors_name_the_field():
    with pytest.raises(ValueError, match="'head_dim' is required"):
        fields_from_attrs(KDA_PREFILL, {"num_heads": 2})
    with pytest.raises(ValueError, match="'expert_offset'.*int32"):
        fields_from_attrs(MXFP4_MOE, {"expert_offset": 2**31})
    with pytest.raises(ValueError, match="unknown attribute"):
        fields_from_attrs(MXFP4_MOE, {"experts": 3})
    with pytest.raises(ValueError, match="'num_heads' is missing"):
        attrs_from_fields(KDA_DECODE, [("head_dim", np.array([4], np.int32))])
    for bad in ("num_experts", "expert_offset"):   # refused when the engine is built, not at enqueue
        with pytest.raises(ValueError, match=f"'{bad}'=-1 is below its minimum 0"):
            fields_from_attrs(MXFP4_MOE, {bad: -1})
        with pytest.raises(ValueError, match=f"'{bad}'=-1 is below its minimum 0"):
            attrs_from_fields(MXFP4_MOE, [(bad, np.array([-1], np.int32))])
    # INT attributes arrive as INT32, FLOAT as FLOAT32; unknown fields (plugin_namespace...) are ignored
    got = attrs_from_fields(KDA_DECODE, [("num_heads", np.array([3], np.int32)), ("head_dim", np.array([8], np.int32)),
                                         ("norm_eps", np.array([1e-6], np.float32)), ("plugin_version", b"1")])
    assert got["num_heads"] == 3 and isinstance(got["num_heads"], int) and got["lower_bound"] == -5.0
    assert got["norm_eps"] == pytest.approx(1e-6)


def test_output_shapes_follow_design():
    kda_in = [("T", 24), ("T", 8), ("T", 2), ("T", 8), (24, 4), (2,), (8,), (4,), ("S", 2, 4, 4), ("S", 24, 3)]
    assert output_shapes(KDA_PREFILL, KDA_ATTRS, kda_in + [("N+1",), ("N",)]) == \
        [("T", 8), ("S", 2, 4, 4), ("S", 24, 3)]
    assert output_shapes(KDA_DECODE, KDA_ATTRS, kda_in + [("B",)])[0] == ("T", 8)
    mla_p = [("T", 2, 12), ("T", 576), (28, 512), ("NB", 16, 576), ("N", "MB"), ("N+1",), ("N",)]
    assert output_shapes(MLA_PREFILL, MLA_P_ATTRS, mla_p) == [("T", 12), ("NB", 16, 576)]
    mla_d = [("B", 2, 576), ("B", 576), ("NB", 16, 576), ("B", "MB"), ("B",)]
    assert output_shapes(MLA_DECODE, MLA_D_ATTRS, mla_d) == [("B", 2, 512), ("NB", 16, 576)]
    moe = [("T", 64), ("T", 4), ("T", 4), (3, 64, 32), (3, 64, 2), (3, 64, 16), (3, 64, 1)]
    assert output_shapes(MXFP4_MOE, {}, moe) == [("T", 64)]
    with pytest.raises(ValueError, match="expected 5 inputs"):
        output_shapes(MLA_DECODE, MLA_D_ATTRS, mla_d[:4])


def test_dtypes_aliases_and_format_combinations():
    kda_types = ["bfloat16"] * 4 + ["float32"] * 5 + ["bfloat16", "int32", "int32"]
    assert output_dtypes(KDA_PREFILL, kda_types) == ["bfloat16", "float32", "bfloat16"]
    assert KDA_PREFILL.aliases == {1: 8, 2: 9} and KDA_DECODE.aliases == {1: 8, 2: 9}
    assert MLA_PREFILL.aliases == {1: 3} and MLA_DECODE.aliases == {1: 2} and MXFP4_MOE.aliases == {}
    assert output_dtypes(MXFP4_MOE, ["float16", "int32", "float32"] + ["uint8"] * 4) == ["float32"]
    full = kda_types + ["bfloat16", "float32", "bfloat16"]
    lin = [True] * len(full)
    assert all(supports_combination(KDA_PREFILL, p, full, lin) for p in range(len(full)))
    bad = lambda p, dt: supports_combination(KDA_PREFILL, p, full[:p] + [dt] + full[p + 1:], lin)  # noqa: E731
    assert not bad(0, "int32")          # act must be float
    assert not bad(1, "float16")        # all act tensors share one dtype
    assert not bad(8, "bfloat16")       # state is fp32
    assert not bad(11, "int64")         # metadata is int32
    assert not bad(13, "bfloat16")      # state_out has state's dtype
    assert not supports_combination(KDA_PREFILL, 3, full, [True, True, True, False])  # LINEAR only
    assert supports_combination(MXFP4_MOE, 3, ["float32", "int32", "float32", "uint8"], [True] * 4)


def test_run_kernel_inplace_and_copy(monkeypatch):
    """enqueue's torch part on CPU: aliased pools update in place; distinct buffers leave the input untouched."""
    import types

    import torch

    from k3deploy.plugins.trt_common import ACT, F32, Like, OpSpec, run_kernel

    mod = types.ModuleType("fake_kimi_kernels")
    calls = []

    def op(x, state, *, scale, out=None):
        calls.append(out is not None)
        state.add_(1.0)
        y = x * scale
        if out is not None:
            out.copy_(y)
            return out, state
        return y, state

    mod.op = op
    monkeypatch.setitem(sys.modules, "fake_kimi_kernels", mod)
    spec = OpSpec("Fake", (("x", ACT), ("state", F32)), (("y", ACT), ("state_out", ("alias", 1))), (),
                  lambda a: [Like(0), Like(1)], "fake_kimi_kernels:op")
    x, state, y = torch.randn(4, 8), torch.zeros(2, 8), torch.empty(4, 8)
    run_kernel(spec, {"scale": 2.0}, [x, state], [y, state])  # runtime binds one buffer to state in/out
    assert torch.equal(y, 2 * x) and torch.all(state == 1) and calls == [True]
    state_out = torch.full((2, 8), 9.0)
    run_kernel(spec, {"scale": 3.0}, [x, state], [y, state_out])
    assert torch.all(state == 1) and torch.all(state_out == 2) and torch.equal(y, 3 * x)
    mod.op = lambda x, state, *, scale: (x,)
    with pytest.raises(RuntimeError, match="returned 1 tensors"):
        run_kernel(spec, {"scale": 1.0}, [x, state], [y, state])


def test_parse_target_cc_spellings():
    """Both CLIs' spellings of the TensorRT-RTX targets: space- or comma-separated, with or without "sm" / dots."""
    from k3deploy.engines.build import parse_target_cc
    assert parse_target_cc(None) == [] and parse_target_cc("sm86") == ["SM86"]
    assert parse_target_cc("sm86,sm89") == parse_target_cc(["sm86", "sm89"]) == ["SM86", "SM89"]
    assert parse_target_cc(["sm86,8.9", "120"]) == parse_target_cc("sm86 sm89, sm120") == ["SM86", "SM89", "SM120"]
    assert parse_target_cc(["sm86", "86", "sm89"]) == ["SM86", "SM89"]                  # repeats dropped
    with pytest.raises(ValueError, match="target_cc 'hopper' not understood"):
        parse_target_cc(["sm86", "hopper"])
    for empty in ("", ",", [" "]):
        with pytest.raises(ValueError, match="names no target"):
            parse_target_cc(empty)


def test_engines_build_cli_rejects_a_bad_target_before_building(tmp_path, capsys):
    """`python -m k3deploy.engines.build --target-cc hopper`: exit 2 with one line naming the flag, no engine built."""
    from k3deploy.engines.build import main
    with pytest.raises(SystemExit) as e:
        main(["--onnx-dir", str(tmp_path), "--out", str(tmp_path / "e"), "--target-cc", "sm86", "hopper"])
    assert e.value.code == 2
    assert "--target-cc: target_cc 'hopper' not understood" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_load_trt_names_the_missing_flavor(monkeypatch):
    """Asking for a flavor that is not installed names that flavor and how to get it (not the other one)."""
    import importlib

    from k3deploy.engines import trt as et

    real = importlib.import_module
    monkeypatch.setattr(et.importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ImportError(f"No module named {name!r}"))
                        if name in et.FLAVORS.values() else real(name))
    et.load_trt.cache_clear()
    try:
        with pytest.raises(ImportError, match="full TensorRT is not installed") as ei:
            et.load_trt("tensorrt")
        assert "tensorrt-rtx-cu13" not in str(ei.value)
        with pytest.raises(ImportError, match="pip install tensorrt-rtx-cu13-libs"):
            et.load_trt("tensorrt-rtx")
        with pytest.raises(ImportError, match="no TensorRT found"):
            et.load_trt()
    finally:
        et.load_trt.cache_clear()


def test_plugins_package_without_tensorrt():
    import importlib.util

    from k3deploy import plugins

    assert callable(plugins.register_tensorrt_plugins)
    if importlib.util.find_spec("tensorrt") is None:
        with pytest.raises(ImportError, match="pip install tensorrt"):
            plugins.register_tensorrt_plugins()
        import k3deploy.plugins.kda.trt as kda_trt

        with pytest.raises(ImportError):
            kda_trt.KdaPrefillPlugin  # noqa: B018 - built lazily with full TensorRT only


@pytest.mark.parametrize("spec,attrs", [(KDA_PREFILL, {"num_heads": 2, "head_dim": 4}),
                                        (MLA_DECODE, {"num_heads": 3, "kv_lora_rank": 8, "scale": 0.1}),
                                        (MXFP4_MOE, {})])
def test_plugin_output_shapes_through_the_expression_builder(spec, attrs):
    """Plugin.get_output_shapes (the path TensorRT's builder calls) gives the shape rule's dims: input dims passed
    through, constants from expr_builder.constant. The builder objects are stand-ins (IExprBuilder cannot be made
    without a build); the plugin class is the real one on TensorRT-RTX's base classes."""
    import types

    rtx = _rtx()

    class Dims(list):                                   # stand-in for trt.DimsExprs: DimsExprs(n) / DimsExprs(other)
        def __init__(self, x):
            super().__init__([None] * x if isinstance(x, int) else x)

    fake = types.SimpleNamespace(**{k: getattr(rtx, k) for k in dir(rtx) if not k.startswith("__")})
    fake.DimsExprs = Dims
    builder = types.SimpleNamespace(constant=lambda v: ("const", v))
    plugin = make_plugin_classes(spec, fake)[0](attrs)
    full = {a.name: a.default for a in spec.attrs} | attrs
    ins = [Dims([f"i{k}d{j}" for j in range(4)]) for k in range(len(spec.inputs))]
    got = [list(d) for d in plugin.get_output_shapes(ins, [], builder)]
    want = [[("const", d) if isinstance(d, int) else d for d in shp]
            for shp in output_shapes(spec, full, [list(x) for x in ins])]
    assert got == want and len(got) == len(spec.outputs)


def test_plugin_classes_through_rtx_base_classes():
    trt = _rtx()
    plugin_cls, creator_cls = make_plugin_classes(KDA_PREFILL, trt)
    creator = creator_cls()
    assert (creator.name, creator.plugin_namespace, creator.plugin_version) == ("KdaPrefill", "kimi", "1")
    assert [f.name for f in creator.field_names] == KDA_PREFILL.field_names
    fc = trt.PluginFieldCollection([trt.PluginField("num_heads", np.array([2], np.int32), trt.PluginFieldType.INT32),
                                    trt.PluginField("head_dim", np.array([4], np.int32), trt.PluginFieldType.INT32)])
    plugin = creator.create_plugin("KdaPrefill", fc, trt.TensorRTPhase.BUILD)
    assert isinstance(plugin, plugin_cls) and plugin.num_outputs == 3
    assert (plugin.plugin_name, plugin.plugin_namespace, plugin.plugin_version) == ("KdaPrefill", "kimi", "1")
    ser = plugin.get_fields_to_serialize()
    assert {f.name: float(np.asarray(f.data)[0]) for f in ser} == pytest.approx(
        {"num_heads": 2, "head_dim": 4, "lower_bound": -5.0, "norm_eps": 1e-5})
    again = creator.create_plugin("KdaPrefill", ser, trt.TensorRTPhase.RUNTIME)  # deserialization path
    import gc

    gc.collect()
    _ = [np.full(64, 7, np.int64) for _ in range(100)]  # reuse freed memory: fields must own their buffers
    again = creator.create_plugin("KdaPrefill", ser, trt.TensorRTPhase.RUNTIME)
    assert again.attrs == pytest.approx(plugin.attrs) and plugin.clone().attrs == plugin.attrs
    assert again.attrs["num_heads"] == 2 and isinstance(again.attrs["num_heads"], int)
    DT = trt.DataType
    types = [DT.BF16] * 4 + [DT.FLOAT] * 5 + [DT.BF16, DT.INT32, DT.INT32]
    assert plugin.get_output_data_types(types) == [DT.BF16, DT.FLOAT, DT.BF16]
    assert [plugin.get_aliased_input(i) for i in range(3)] == [-1, 8, 9]
    assert plugin.get_workspace_size([], []) == 0

    def desc(dt):
        d = trt.DynamicPluginTensorDesc()
        p = trt.PluginTensorDesc()
        p.type, p.format = dt, trt.TensorFormat.LINEAR
        d.desc = p
        return d

    io = [desc(t) for t in types + [DT.BF16, DT.FLOAT, DT.BF16]]
    assert all(plugin.supports_format_combination(p, io, 12) for p in range(15))
    io[8] = desc(DT.HALF)
    assert not plugin.supports_format_combination(8, io, 12)


def test_register_creators_in_subprocess():
    """Registering Python creators with TensorRT-RTX works; parsing with them aborts RTX, so only query here."""
    _rtx()
    code = ("import tensorrt_rtx_bindings as trt\n"
            "from plugins.trt_common import register_tensorrt_plugins\n"
            "names = register_tensorrt_plugins(trt)\n"
            "assert register_tensorrt_plugins(trt) == names\n"
            "reg = trt.get_plugin_registry()\n"
            "for n in names:\n"
            "    assert reg.get_creator(n.split('::')[1], '1', 'kimi') is not None, n\n"
            "print(','.join(names))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().split(",") == ["kimi::KdaPrefill", "kimi::KdaDecode", "kimi::MlaPrefill",
                                           "kimi::MlaDecode", "kimi::Mxfp4Moe"]


# ------------------------------------------------------------------------------------------------------ engine builds
def make_test_onnx(path: Path, weight_value: float = 1.0, act: int | None = None) -> Path:
    """ONNX with one ``kimi::Decay`` node: ``x [T,8] bf16, state [S,8] f32, cu_seqlens ["N + 1"] i32,
    slots [N] i32 -> y [T,8] bf16, state_out [S,8] f32``; body: Scan over T of ``s = 0.5*s + x_t*w`` starting from
    ``state[slots[0]]``, final state scattered back; ``w [8]`` stored as external data. act: activation
    TensorProto type of x/y (default BFLOAT16)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper as nh

    act = TP.BFLOAT16 if act is None else act

    body = h.make_graph(
        [h.make_node("Mul", ["s_in", "half"], ["s_dec"]), h.make_node("Mul", ["x_t", "w"], ["xw"]),
         h.make_node("Add", ["s_dec", "xw"], ["s_out"]), h.make_node("Identity", ["s_out"], ["y_t"])],
        "scan_body",
        [h.make_tensor_value_info("s_in", TP.FLOAT, [8]), h.make_tensor_value_info("x_t", TP.FLOAT, [8])],
        [h.make_tensor_value_info("s_out", TP.FLOAT, [8]), h.make_tensor_value_info("y_t", TP.FLOAT, [8])])
    const = lambda name, dt, dims, vals: h.make_node(  # noqa: E731
        "Constant", [], [name], value=h.make_tensor(name, dt, dims, vals))
    fn = h.make_function("kimi", "Decay", ["x", "w", "state", "cu_seqlens", "slots"], ["y", "state_out"], [
        const("half", TP.FLOAT, [], [0.5]), const("zero", TP.INT64, [], [0]), const("last", TP.INT64, [], [-1]),
        h.make_node("Cast", ["x"], ["xf"], to=TP.FLOAT),
        h.make_node("Gather", ["slots", "zero"], ["slot0"], axis=0),
        h.make_node("Gather", ["state", "slot0"], ["s0"], axis=0),
        h.make_node("Scan", ["s0", "xf"], ["s_last", "ys"], num_scan_inputs=1, body=body),
        h.make_node("Gather", ["cu_seqlens", "last"], ["ntok"], axis=0),
        h.make_node("Cast", ["ntok"], ["ntok_f"], to=TP.FLOAT),
        h.make_node("Add", ["ys", "ntok_f"], ["yf"]),
        h.make_node("Cast", ["yf"], ["y"], to=act),
        h.make_node("Cast", ["slot0"], ["slot64"], to=TP.INT64),
        h.make_node("Unsqueeze", ["slot64", "zero"], ["idx1"]),
        h.make_node("Unsqueeze", ["idx1", "zero"], ["idx"]),
        h.make_node("Unsqueeze", ["s_last", "zero"], ["upd"]),
        h.make_node("ScatterND", ["state", "idx", "upd"], ["state_out"]),
    ], [h.make_opsetid("", 20)], attributes=["num_heads", "plugin_namespace", "plugin_version"])
    graph = h.make_graph(
        [h.make_node("Decay", ["x", "w", "state", "cu_seqlens", "slots"], ["y", "state_out"], domain="kimi",
                     num_heads=2, plugin_namespace="kimi", plugin_version="1")],
        "decay_layer",
        [h.make_tensor_value_info("x", act, ["T", 8]), h.make_tensor_value_info("state", TP.FLOAT, ["S", 8]),
         h.make_tensor_value_info("cu_seqlens", TP.INT32, ["N + 1"]), h.make_tensor_value_info("slots", TP.INT32, ["N"])],
        [h.make_tensor_value_info("y", act, ["T", 8]), h.make_tensor_value_info("state_out", TP.FLOAT, ["S", 8])],
        [nh.from_array(np.full(8, weight_value, np.float32), "w")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20), h.make_opsetid("kimi", 1)], functions=[fn])
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=path.name + ".data", size_threshold=0)
    return path


DIMS = {"S": (2, 4, 8)}


def test_test_onnx_runs_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    import onnx

    p = make_test_onnx(tmp_path / "m.onnx", weight_value=2.0, act=onnx.TensorProto.FLOAT)  # ORT numpy: no bf16
    assert (tmp_path / "m.onnx.data").is_file()

    assert not any(i.data_location != onnx.TensorProto.EXTERNAL
                   for i in onnx.load(str(p), load_external_data=False).graph.initializer)
    sess = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
    x = np.ones((3, 8), dtype=np.float32)
    state = np.zeros((3, 8), np.float32)
    state[1] = 4.0
    y, state_out = sess.run(None, {"x": x, "state": state,
                                   "cu_seqlens": np.array([0, 3], np.int32), "slots": np.array([1], np.int32)})
    # s: 4 -> 2+2=4 -> 4 -> 4 ; y = s + ntok(3)
    np.testing.assert_allclose(y, np.full((3, 8), 7.0))
    np.testing.assert_allclose(state_out[1], 4.0)
    np.testing.assert_allclose(state_out[0], 0.0)


def test_profiles_from_dims(tmp_path):
    from k3deploy.engines.build import default_profile_dims, eval_dim, profiles_from_dims

    p = make_test_onnx(tmp_path / "m.onnx")
    prefill, decode = profiles_from_dims(p, default_profile_dims(4, 16, DIMS))
    assert prefill["x"] == ((1, 8), (16, 8), (16, 8))
    assert decode["x"] == ((1, 8), (4, 8), (4, 8))
    assert prefill["cu_seqlens"] == ((2,), (5,), (5,)) and prefill["slots"] == ((1,), (4,), (4,))
    assert prefill["state"] == ((2, 8), (4, 8), (8, 8))
    assert eval_dim("2*S - 1", {"S": 3}) == 5
    with pytest.raises(ValueError, match="dim 'S'.*--dim S=MIN:OPT:MAX"):
        profiles_from_dims(p, default_profile_dims(4, 16))
    with pytest.raises(ValueError, match="unsupported dim expression"):
        eval_dim("__import__('os')", {})
    with pytest.raises(ValueError, match="max_num_tokens=2 must be >= max_batch=4"):
        default_profile_dims(4, 2)


def _engine_tree(tmp_path: Path) -> Path:
    onnx_dir = tmp_path / "onnx"
    make_test_onnx(onnx_dir / "rank0" / "layer0.onnx")
    make_test_onnx(onnx_dir / "rank0" / "layer1.onnx", weight_value=3.0)
    return onnx_dir


def test_build_all_sm86_two_profiles(tmp_path):
    _rtx()
    from k3deploy.engines.build import build_all
    from k3deploy.engines.manifest import read_manifest

    onnx_dir, out = _engine_tree(tmp_path), tmp_path / "engines"
    manifest = build_all(onnx_dir, out, target_cc="sm86", max_batch=4, max_num_tokens=16, extra_dims=DIMS,
                         progress=False)
    assert set(manifest["engines"]) == {"rank0/layer0.plan", "rank0/layer1.plan"}
    assert read_manifest(out) == json.loads(json.dumps(manifest))
    assert manifest["tensorrt"]["flavor"] in ("tensorrt", "tensorrt-rtx")
    e = manifest["engines"]["rank0/layer0.plan"]
    assert (out / "rank0" / "layer0.plan").stat().st_size == e["plan_bytes"] > 0
    assert e["compute_capability"] == (["sm86"] if manifest["tensorrt"]["flavor"] == "tensorrt-rtx" else ["current"])
    ins = {t["name"]: t for t in e["inputs"]}
    outs = {t["name"]: t for t in e["outputs"]}
    assert list(ins) == ["x", "state", "cu_seqlens", "slots"] and list(outs) == ["y", "state_out"]
    assert (ins["x"]["dtype"], ins["x"]["shape"]) == ("bfloat16", [-1, 8])
    assert (ins["cu_seqlens"]["dtype"], ins["slots"]["dtype"]) == ("int32", "int32")
    assert (outs["y"]["dtype"], outs["state_out"]["dtype"]) == ("bfloat16", "float32")
    assert len(e["profiles"]) == 2
    assert e["profiles"][0]["x"] == [[1, 8], [16, 8], [16, 8]] and e["profiles"][1]["x"] == [[1, 8], [4, 8], [4, 8]]
    assert e["profiles"][1]["cu_seqlens"] == [[2], [5], [5]]
    assert e["plugins"] == {"kimi::Decay": {"version": "1", "impl": "function-body"}}
    assert e["options"]["aot"] is False and e["options"]["aot_sources"] is None and e["aot_ops"] == []
    assert e["verified"] in ("engine", "network")
    assert e["onnx"] == "rank0/layer0.onnx" and len(e["onnx_sha256"]) == 64
    assert e["onnx_sha256"] != manifest["engines"]["rank0/layer1.plan"]["onnx_sha256"]  # weights differ
    assert (out / "timing.cache").is_file()
    assert not list(out.rglob("*.tmp"))
    from k3deploy.plugins.workspace import WORKSPACE_RULES
    from k3deploy.runtime.executor import check_workspace_rules
    assert manifest["workspace_rules"] == WORKSPACE_RULES
    check_workspace_rules(manifest)                      # what TensorRTExecutor checks first: these engines pass


def test_rebuild_skip_force_and_timing_cache(tmp_path):
    _rtx()
    from k3deploy.engines.build import build_all, main

    onnx_dir, out = _engine_tree(tmp_path), tmp_path / "engines"
    kw = dict(target_cc="sm86", max_batch=4, max_num_tokens=16, extra_dims=DIMS, progress=False)
    first = build_all(onnx_dir, out, **kw)
    plans = {p: (out / p).stat() for p in first["engines"]}
    cache = out / "timing.cache"
    assert cache.is_file() and first["engines"]["rank0/layer0.plan"]["timing_cache"]["loaded_bytes"] == 0

    # unchanged -> nothing rebuilt (plan files untouched, entries identical)
    second = build_all(onnx_dir, out, **kw)
    assert second["engines"] == first["engines"]
    for p, st in plans.items():
        assert (out / p).stat().st_ino == st.st_ino and (out / p).stat().st_mtime_ns == st.st_mtime_ns

    # changed weights (external data only) -> only that engine rebuilt, reusing the timing cache file
    make_test_onnx(onnx_dir / "rank0" / "layer1.onnx", weight_value=5.0)
    third = build_all(onnx_dir, out, **kw)
    assert third["engines"]["rank0/layer0.plan"] == first["engines"]["rank0/layer0.plan"]
    l1 = third["engines"]["rank0/layer1.plan"]
    assert l1["onnx_sha256"] != first["engines"]["rank0/layer1.plan"]["onnx_sha256"]
    assert l1["timing_cache"]["loaded_bytes"] == cache.stat().st_size > 0

    # changed build options -> rebuilt
    fourth = build_all(onnx_dir, out, **{**kw, "max_num_tokens": 32})
    assert fourth["engines"]["rank0/layer0.plan"]["config_hash"] != first["engines"]["rank0/layer0.plan"]["config_hash"]
    assert fourth["engines"]["rank0/layer0.plan"]["profiles"][0]["x"][2] == [32, 8]

    # engines of other plugin workspace rules (or of a manifest from before they were recorded) -> all rebuilt
    from k3deploy.engines.manifest import read_manifest, write_manifest
    old = read_manifest(out)
    old.pop("workspace_rules")
    write_manifest(out, old)
    inodes = {p: (out / p).stat().st_ino for p in fourth["engines"]}
    fifth = build_all(onnx_dir, out, **{**kw, "max_num_tokens": 32})
    assert all((out / p).stat().st_ino != ino for p, ino in inodes.items()) and "workspace_rules" in fifth

    # plan deleted -> rebuilt
    (out / "rank0" / "layer0.plan").unlink()
    build_all(onnx_dir, out, **{**kw, "max_num_tokens": 32})
    assert (out / "rank0" / "layer0.plan").is_file()

    # --force through the CLI rebuilds everything
    before = {p: (out / p).stat().st_ino for p in first["engines"]}
    rc = main(["--onnx-dir", str(onnx_dir), "--out", str(out), "--target-cc", "sm86", "--max-batch", "4",
               "--max-num-tokens", "32", "--dim", "S=2:4:8", "--force", "--no-progress"])
    assert rc == 0
    assert all((out / p).stat().st_ino != ino for p, ino in before.items())


def test_full_trt_build_registers_the_plugins():
    """With full TensorRT the build registers every kimi creator before parsing (else the parser would inline the
    reference function bodies). Stand-in for full TensorRT: the RTX bindings' registry, in a subprocess that never
    parses afterwards (RTX's parser aborts on Python creators)."""
    _rtx()
    code = ("import tensorrt_rtx_bindings as trt\n"
            "from engines.trt import TrtInfo\n"
            "from engines.build import register_build_plugins\n"
            "assert register_build_plugins(TrtInfo(trt, 'tensorrt', '10.16.0')) == []   # no AOT asked\n"
            "reg = trt.get_plugin_registry()\n"
            "ops = ('KdaPrefill', 'KdaDecode', 'MlaPrefill', 'MlaDecode', 'Mxfp4Moe')\n"
            "print(','.join(n for n in ops if reg.get_creator(n, '1', 'kimi') is not None))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "KdaPrefill,KdaDecode,MlaPrefill,MlaDecode,Mxfp4Moe"


def test_register_build_plugins_aot_op_types(monkeypatch):
    """With full TensorRT and aot, the op types handed to the parser step are those whose AOT forms registered:
    KdaDecode, MlaDecode, and Mxfp4Moe, KdaPrefill, MlaPrefill (rewritten into chains of ops); refused (ValueError
    naming the ops) where tensorrt.plugin lacks aot_impl or one chain is missing."""
    import k3deploy.engines.build as eb
    import k3deploy.plugins.trt_common as tc
    from k3deploy.engines.trt import TrtInfo
    from k3deploy.plugins.kda import trt_aot as kda_aot
    from k3deploy.plugins.mla import trt_aot as mla_aot
    from k3deploy.plugins.kda import trt_aot_prefill as kda_pre
    from k3deploy.plugins.mla import trt_aot_prefill as mla_pre
    from k3deploy.plugins.moe import trt_aot as moe_aot

    monkeypatch.setattr(tc, "register_tensorrt_plugins", lambda trt, aot=False: [])
    info = TrtInfo(object(), "tensorrt", "10.16.0")
    for ok in (True, False):
        monkeypatch.setattr(kda_aot, "register", lambda ok=ok: ["kimi::KdaDecode"] if ok else [])
        monkeypatch.setattr(mla_aot, "register", lambda ok=ok: ["kimi::MlaDecode"] if ok else [])
        for chain in (moe_aot, kda_pre, mla_pre):
            monkeypatch.setattr(chain, "register", lambda ok=ok, c=chain: list(c.AOT_OPS) if ok else [])
        if ok:
            assert eb.register_build_plugins(info, aot=True) == ["KdaDecode", "MlaDecode", "Mxfp4Moe", "KdaPrefill",
                                                                 "MlaPrefill"]
        else:
            with pytest.raises(ValueError, match="KdaDecode, KdaPrefill, MlaDecode, MlaPrefill, Mxfp4Moe.*fla-core"):
                eb.register_build_plugins(info, aot=True)
        assert eb.register_build_plugins(info) == []
    # one chain missing (e.g. fla-core not 0.6.0): refused, naming it
    monkeypatch.setattr(kda_aot, "register", lambda: ["kimi::KdaDecode"])
    monkeypatch.setattr(mla_aot, "register", lambda: ["kimi::MlaDecode"])
    for chain in (moe_aot, mla_pre):
        monkeypatch.setattr(chain, "register", lambda c=chain: list(c.AOT_OPS))
    monkeypatch.setattr(kda_pre, "register", lambda: [])
    with pytest.raises(ValueError, match=r"registered for KdaPrefill:"):
        eb.register_build_plugins(info, aot=True)


def test_build_engine_registers_plugins_before_parsing(tmp_path, monkeypatch):
    """build_engine asks for the kimi plugins (register_build_plugins: full TensorRT registers, RTX nothing) before it
    parses, and hands the AOT op types it got to the parser step; the AOT source hash changes with the sources."""
    _rtx()
    import k3deploy.engines.build as eb

    calls = []
    real_parse = eb._parse
    monkeypatch.setattr(eb, "register_build_plugins", lambda info, aot=False: calls.append(("register", aot)) or [])
    monkeypatch.setattr(eb, "_parse", lambda *a: calls.append(("parse", list(a[4]))) or real_parse(*a))
    onnx_dir = _engine_tree(tmp_path)
    src = onnx_dir / "rank0" / "layer0.onnx"
    profiles = eb.profiles_from_dims(src, eb.default_profile_dims(4, 16, DIMS))
    eb.build_engine(src, tmp_path / "l0.plan", profiles, target_cc="sm86")
    assert calls == [("register", False), ("parse", [])]
    h = eb.aot_sources_sha256()
    assert len(h) == 64 and h == eb.aot_sources_sha256()


def test_aot_marking_and_parse_from_memory(tmp_path):
    """--aot builds: mark_aot_nodes sets aot=1 once, on the named kimi nodes only; a marked model parsed from memory
    with its file path (how an AOT build parses) still finds its external data; TensorRT-RTX registers no plugins
    and refuses aot before writing anything."""
    import onnx

    trt = _rtx()
    from k3deploy.engines.build import _parse, _trt_logger, build_all, mark_aot_nodes, register_build_plugins
    from k3deploy.engines.trt import load_trt

    onnx_dir = _engine_tree(tmp_path)
    path = onnx_dir / "rank0" / "layer0.onnx"
    m = onnx.load(str(path), load_external_data=False)
    assert mark_aot_nodes(m, ["Decay"]) == 1 and mark_aot_nodes(m, ["Decay"]) == 1 and mark_aot_nodes(m, ["X"]) == 0
    marks = [a for n in m.graph.node for a in n.attribute if a.name == "aot"]
    assert len(marks) == 1 and marks[0].i == 1
    assert [n.op_type for n in m.graph.node if any(a.name == "aot" for a in n.attribute)] == ["Decay"]
    info = load_trt("tensorrt-rtx") if trt.__name__ == "tensorrt_rtx_bindings" else load_trt()
    if info.is_rtx:
        assert register_build_plugins(info) == []
        with pytest.raises(ValueError, match="aot"):
            register_build_plugins(info, aot=True)
        with pytest.raises(ValueError, match="aot"):
            build_all(onnx_dir, tmp_path / "e", target_cc="sm86", extra_dims=DIMS, progress=False, aot=True)
        assert not (tmp_path / "e").exists()
    log = _trt_logger(info.module)
    network = info.module.Builder(log).create_network(0)
    import k3deploy.engines.build as eb

    marked = []
    real_mark = eb.mark_aot_nodes
    eb.mark_aot_nodes = lambda model, ops: marked.append(list(ops)) or real_mark(model, ops)
    try:
        parser = _parse(info.module, network, log, path, ["Decay"])   # noqa: F841  (the network needs its parser)
    finally:
        eb.mark_aot_nodes = real_mark
    assert marked == [["Decay"]]
    assert [network.get_input(i).name for i in range(network.num_inputs)] == ["x", "state", "cu_seqlens", "slots"]
    assert network.num_outputs == 2 and network.num_layers > 0


def test_cli_help_and_errors(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "k3deploy.engines.build", "--help"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--max-num-tokens" in r.stdout and "--target-cc" in r.stdout
    _rtx()
    onnx_dir = _engine_tree(tmp_path)
    from k3deploy.engines.build import main

    assert main(["--onnx-dir", str(onnx_dir), "--out", str(tmp_path / "e"), "--target-cc", "sm86",
                 "--no-progress"]) == 1  # S has no range
    assert main(["--onnx-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "e"), "--no-progress"]) == 1
    from k3deploy.engines.build import build_all

    with pytest.raises(RuntimeError, match="dim 'S'"):
        build_all(onnx_dir, tmp_path / "e", target_cc="sm86", progress=False)
    if _rtx().__name__ == "tensorrt_rtx_bindings" and not _full_trt_installed():
        with pytest.raises(RuntimeError, match="SM90/Hopper is not"):
            build_all(onnx_dir, tmp_path / "e", target_cc="sm90", extra_dims=DIMS, progress=False)


def _full_trt_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt") is not None
