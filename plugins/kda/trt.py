"""TensorRT IPluginV3 plugins ``kimi::KdaPrefill`` and ``kimi::KdaDecode`` (namespace ``kimi``, version ``1``).

Contract: docs/DESIGN.md "kimi::KdaPrefill / kimi::KdaDecode". Inputs (act = fp32/bf16/fp16, one dtype per node):
``qkv [T,3P] act, f [T,P] act, b [T,H] act, g [T,P] act, conv_w [3P,4] f32, A_log [H] f32, dt_bias [P] f32,
o_norm_w [K] f32, state [S,H,V,K] f32, conv [S,3P,3] act, (Prefill: cu_seqlens [N+1] i32), slots [N] i32``.
Outputs: ``out [T,P] act``, ``state_out`` (= input 8, same buffer), ``conv_out`` (= input 9, same buffer).
Fields (ONNX attributes; INT arrives as INT32): num_heads, head_dim, lower_bound (-5.0), norm_eps (1e-5).
enqueue calls ``plugins.kda.kernels.kda_prefill`` (chunk indices built on the device: no host sync) /
``kda_decode`` (same argument order as the reference) with ``workspace=`` carved from TensorRT's workspace, whose
size is the ops' workspace rule (``kda_prefill_workspace_bytes`` / ``kda_decode_workspace_bytes`` on the profile's
max dims). Both also have ahead-of-time forms: KdaDecode one kernel (plugins/kda/trt_aot.py), KdaPrefill a chain
of nine single-launch ops (plugins/kda/trt_aot_prefill.py).

The pure parts (:data:`KDA_PREFILL`, :data:`KDA_DECODE`) import without TensorRT. ``KdaPrefillPlugin``,
``KdaPrefillPluginCreator``, ``KdaDecodePlugin``, ``KdaDecodePluginCreator`` are built on first access with full
TensorRT (``import tensorrt``); accessing them without TensorRT raises ImportError.
"""

from __future__ import annotations

from k3deploy.plugins.trt_common import ACT, F32, I32, AttrSpec, In, Like, OpSpec, make_plugin_classes, torch_dtype

_ATTRS = (AttrSpec("num_heads", "int"), AttrSpec("head_dim", "int"),
          AttrSpec("lower_bound", "float", -5.0), AttrSpec("norm_eps", "float", 1e-5))
_COMMON_IN = (("qkv", ACT), ("f", ACT), ("b", ACT), ("g", ACT), ("conv_w", F32), ("A_log", F32),
              ("dt_bias", F32), ("o_norm_w", F32), ("state", F32), ("conv", ACT))
_OUT = (("out", ACT), ("state_out", ("alias", 8)), ("conv_out", ("alias", 9)))


def _shape_rule(attrs):
    # out [T, P]: T from qkv, P = num_heads * head_dim (equal to f's second dim)
    return [(In(0, 0), int(attrs["num_heads"]) * int(attrs["head_dim"])), Like(8), Like(9)]


def _prefill_workspace(attrs, shapes, dtypes):
    # qkv [T, 3P], slots [N]; the act dtype sets the conv-output dtype (bf16 for fla when act is fp32)
    from k3deploy.plugins.kda import kernels

    return kernels.kda_prefill_workspace_bytes(shapes[0][0], shapes[11][0], int(attrs["num_heads"]),
                                               int(attrs["head_dim"]), act_dtype=torch_dtype(dtypes[0]))


def _decode_workspace(attrs, shapes, dtypes):
    # B = qkv rows; bound over the default kernel choice for every batch <= B (0 when no split scratch is needed)
    from k3deploy.plugins.kda import kernels

    fn = getattr(kernels, "kda_decode_workspace_bytes", None)
    return 0 if fn is None else fn(shapes[0][0], int(attrs["num_heads"]), int(attrs["head_dim"]))


KDA_PREFILL = OpSpec("KdaPrefill", _COMMON_IN + (("cu_seqlens", I32), ("slots", I32)), _OUT, _ATTRS,
                     _shape_rule, "k3deploy.plugins.kda.kernels:kda_prefill", workspace=_prefill_workspace)
KDA_DECODE = OpSpec("KdaDecode", _COMMON_IN + (("slots", I32),), _OUT, _ATTRS,
                    _shape_rule, "k3deploy.plugins.kda.kernels:kda_decode", workspace=_decode_workspace)

_LAZY = {"KdaPrefillPlugin": (KDA_PREFILL, 0), "KdaPrefillPluginCreator": (KDA_PREFILL, 1),
         "KdaDecodePlugin": (KDA_DECODE, 0), "KdaDecodePluginCreator": (KDA_DECODE, 1)}
__all__ = ["KDA_PREFILL", "KDA_DECODE", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import tensorrt

        spec, which = _LAZY[name]
        return make_plugin_classes(spec, tensorrt)[which]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
