"""TensorRT IPluginV3 plugin ``kimi::Mxfp4Moe`` (namespace ``kimi``, version ``1``).

Contract: docs/DESIGN.md. Inputs ``x [T,Rl] act, topk_ids [T,k] i32, topk_w [T,k] f32, w13_packed [E,2I,Rl/2] u8,
w13_scale [E,2I,Rl/32] u8, w2_packed [E,Rl,I/2] u8, w2_scale [E,Rl,I/32] u8``; output ``y [T,Rl] f32`` (EP partial
sum over local experts). Fields: expert_offset (INT32, default 0), situ_beta (4.0), situ_linear_beta (25.0), num_experts
(INT32, 0).
enqueue calls ``plugins.moe.kernels.mxfp4_moe`` (on-device counting sort, fixed grids) with ``workspace=`` carved
from TensorRT's workspace (size: ``mxfp4_moe_workspace_bytes`` on the profile's max dims); a JIT Python plugin
(sort + two grouped GEMMs + combine = four launches). ``Mxfp4MoePlugin`` / ``Mxfp4MoePluginCreator`` are built on
first access with full TensorRT; :data:`MXFP4_MOE` imports without it.
"""

from __future__ import annotations

from k3deploy.plugins.trt_common import ACT, F32, I32, U8, AttrSpec, Like, OpSpec, make_plugin_classes

def _workspace(attrs, shapes, dtypes):
    # x [T, Rl], topk_ids [T, k], w13_packed [E, 2I, Rl/2]
    from k3deploy.plugins.moe import kernels

    return kernels.mxfp4_moe_workspace_bytes(shapes[0][0], shapes[1][1], shapes[3][0], shapes[3][1] // 2,
                                             shapes[0][1])


MXFP4_MOE = OpSpec(
    "Mxfp4Moe",
    (("x", ACT), ("topk_ids", I32), ("topk_w", F32), ("w13_packed", U8), ("w13_scale", U8), ("w2_packed", U8),
     ("w2_scale", U8)),
    (("y", F32),),
    (AttrSpec("expert_offset", "int", 0, minimum=0), AttrSpec("situ_beta", "float", 4.0),
     AttrSpec("situ_linear_beta", "float", 25.0), AttrSpec("num_experts", "int", 0, minimum=0)),
    lambda a: [Like(0)],
    "k3deploy.plugins.moe.kernels:mxfp4_moe",
    workspace=_workspace,
)

_LAZY = {"Mxfp4MoePlugin": (MXFP4_MOE, 0), "Mxfp4MoePluginCreator": (MXFP4_MOE, 1)}
__all__ = ["MXFP4_MOE", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import tensorrt

        spec, which = _LAZY[name]
        return make_plugin_classes(spec, tensorrt)[which]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
