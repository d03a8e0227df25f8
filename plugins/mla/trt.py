"""TensorRT IPluginV3 plugins ``kimi::MlaPrefill`` and ``kimi::MlaDecode`` (namespace ``kimi``, version ``1``).

Contract: docs/DESIGN.md. act = fp32/bf16/fp16 (one dtype per node; the latent pool has the act dtype).

* MlaPrefill inputs ``q [T,H,Dn+Dr], latent [T,576], kv_b [H*(Dn+Dv),R], cache [NB,BS,576], block_tables [N,MB] i32,
  cu_seqlens [N+1] i32, context_lens [N] i32``; outputs ``out [T, H*Dv] act``, ``cache_out`` (= input 3, same buffer).
  Fields: num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank (INT32), scale (FLOAT32).
* MlaDecode inputs ``q_abs [B,H,576], latent [B,576], cache, block_tables [B,MB] i32, context_lens [B] i32``; outputs
  ``out_latent [B,H,R] act`` (R = kv_lora_rank), ``cache_out`` (= input 2). Fields: num_heads, kv_lora_rank, scale.

enqueue calls ``plugins.mla.kernels.mla_prefill`` (``graph_safe=True``: the absorbed Triton path, no host reads) /
``mla_decode`` with ``workspace=`` carved from TensorRT's workspace (sizes: ``mla_prefill_workspace_bytes`` /
``mla_decode_workspace_bytes`` on the profile's max dims). Both are JIT Python plugins (several launches each);
MlaDecode also has an ahead-of-time form (one kernel, no split along the sequence): plugins/mla/trt_aot.py;
MlaPrefill one as a chain of four single-launch ops: plugins/mla/trt_aot_prefill.py.
Plugin/creator classes (``MlaPrefillPlugin``, ``MlaPrefillPluginCreator``, ``MlaDecodePlugin``,
``MlaDecodePluginCreator``) are built on first access with full TensorRT; the specs import without it.
"""

from __future__ import annotations

from k3deploy.plugins.trt_common import ACT, I32, AttrSpec, In, Like, OpSpec, make_plugin_classes, torch_dtype

def _prefill_workspace(attrs, shapes, dtypes):
    # q [T, H, Dn+Dr], cache [NB, BS, R+Dr] (act dtype)
    from k3deploy.plugins.mla import kernels

    R = int(attrs["kv_lora_rank"])
    return kernels.mla_prefill_workspace_bytes(shapes[0][0], int(attrs["num_heads"]), R, shapes[3][2] - R,
                                               dtype=torch_dtype(dtypes[3]))


def _decode_workspace(attrs, shapes, dtypes):
    # q_abs [B, H, 576], cache [NB, BS, 576], block_tables [B, MB]
    from k3deploy.plugins.mla import kernels

    return kernels.mla_decode_workspace_bytes(shapes[0][0], int(attrs["num_heads"]), int(attrs["kv_lora_rank"]),
                                              shapes[3][1], shapes[2][1], dtype=torch_dtype(dtypes[2]))


MLA_PREFILL = OpSpec(
    "MlaPrefill",
    (("q", ACT), ("latent", ACT), ("kv_b", ACT), ("cache", ACT), ("block_tables", I32), ("cu_seqlens", I32),
     ("context_lens", I32)),
    (("out", ACT), ("cache_out", ("alias", 3))),
    (AttrSpec("num_heads", "int"), AttrSpec("qk_nope_head_dim", "int"), AttrSpec("v_head_dim", "int"),
     AttrSpec("kv_lora_rank", "int"), AttrSpec("scale", "float")),
    lambda a: [(In(0, 0), int(a["num_heads"]) * int(a["v_head_dim"])), Like(3)],
    "k3deploy.plugins.mla.kernels:mla_prefill",
    workspace=_prefill_workspace,
    kernel_options=(("graph_safe", True),),
)
MLA_DECODE = OpSpec(
    "MlaDecode",
    (("q_abs", ACT), ("latent", ACT), ("cache", ACT), ("block_tables", I32), ("context_lens", I32)),
    (("out_latent", ACT), ("cache_out", ("alias", 2))),
    (AttrSpec("num_heads", "int"), AttrSpec("kv_lora_rank", "int"), AttrSpec("scale", "float")),
    lambda a: [(In(0, 0), In(0, 1), int(a["kv_lora_rank"])), Like(2)],
    "k3deploy.plugins.mla.kernels:mla_decode",
    workspace=_decode_workspace,
)

_LAZY = {"MlaPrefillPlugin": (MLA_PREFILL, 0), "MlaPrefillPluginCreator": (MLA_PREFILL, 1),
         "MlaDecodePlugin": (MLA_DECODE, 0), "MlaDecodePluginCreator": (MLA_DECODE, 1)}
__all__ = ["MLA_PREFILL", "MLA_DECODE", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import tensorrt

        spec, which = _LAZY[name]
        return make_plugin_classes(spec, tensorrt)[which]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
