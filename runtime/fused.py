"""The torch backend's forward with each decoder layer's glue fused (`ops="kernels"`).

`model.reference.K3Model` runs the glue of a layer — AttnRes reads, RMSNorms, residual adds, dtype casts, the
router's fp32 GEMM, the latent MoE's norm and SiTU — as separate torch ops in fp32, about 110 kernels per decode
layer with bf16 dense weights. `FusedModel` runs the same model (its weights, its five custom ops through
`plugins.torch_ops.KernelOps`, pools updated in place) with activations in the model dtype (`K3Model.dense_dtype`:
bf16 as MODEL.md §0/§3 runs it, or fp32) and one launch per piece of glue (plugins/glue/kernels.py). A KDA + MoE
layer is then 16 launches:

    attn_res_norm (P += pending; commit; AttnRes; input_layernorm)         1
    x @ [q; k; v; g; f_a; b]ᵀ, then f_a-slice @ f_bᵀ                         2   (cuBLAS)
    kda_decode / kda_prefill                                                1+
    o_proj                                                                  1   (cuBLAS)
    attn_res_norm (P += a; AttnRes; post_attention_layernorm)               1
    router logits x @ gateᵀ with fp32 output, top-k (route_topk)            2
    x @ [routed_expert_down; shared gate; shared up]ᵀ                       1   (cuBLAS)
    mxfp4_moe on the down slice (sort, w13, w2, combine; + column permute)  4-5
    moe_out_rows: [RMSNorm(latent) ‖ SiTU(shared gate, up)]                 1
    [routed_expert_up ‖ shared down] in one GEMM (= up(yl) + shared(x))     1   (cuBLAS)

and an MLA layer adds the LoRA norms kernel, the q_b GEMM, the W_UK absorb and the gated W_UV output kernel around
`mla_decode`. The layer's output (o_proj's, the MoE's) is added to the block sum P inside the next AttnRes kernel.
The GEMMs read the model's own weights: `FusedModel` concatenates each group once and leaves the model's Linear
weights as views of the concatenation (no extra copy), so the unfused path (`ops="kernels-unfused"`, K3Model's own
forward) keeps working on the same model. The layers' GEMM weights are stored column-major ([N, K] views of
contiguous [K, N] tensors): cuBLAS runs the decode's few-row GEMMs faster that way (H200, 64 rows: o_proj 57 -> 45
µs, the KDA input projection 180 -> 166 µs; prefill-sized GEMMs 2-16% slower, a small part of a prefill step); the
head stays row-major (its fp32-output GEMM is at the copy rate that way, 8% slower column-major at 64 rows). It holds the router weight in the dense dtype (K3Model keeps it in fp32)
and, on CUDA, kv_b in the dense dtype.

Under tensor parallelism the collectives are the reference's: after o_proj, the routed latent before its norm, and
the MoE output (rank 0 adds the replicated up-projection to its shared-expert partial; the others send only
theirs). Rounding follows the bf16 model: P, every AttnRes output, normalized value and SiTU output are rounded to
bf16; GEMMs accumulate in fp32 and round once; router logits and the routed combine stay fp32.
"""
from __future__ import annotations

import logging
import weakref

import torch

from k3deploy.model.reference import Batch, K3Model, kda_prefill_snapshotting
from k3deploy.plugins.glue import kernels as glue
from k3deploy.plugins.glue.reference import attn_res_query

log = logging.getLogger(__name__)


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ in x's dtype (strided row views are read in place)."""
    return torch.mm(x, w.t())


_MM_OUT_DTYPE = [True]      # torch.mm(..., out_dtype) usable on CUDA (cleared, with a warning, if it is not)


def _mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ wᵀ with an fp32 result: one 16-bit GEMM with fp32 output on CUDA (torch.mm's out_dtype, torch >= 2.8),
    fp32 math on the CPU (no such kernel there) or where that GEMM is refused."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return torch.mm(x, w.t())
    if x.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(x, w.t(), torch.float32)
        except (RuntimeError, TypeError) as e:
            log.warning("torch.mm with out_dtype=float32 failed (%s); router logits and lm_head run as fp32 GEMMs", e)
            _MM_OUT_DTYPE[0] = False
    return torch.mm(x.float(), w.float().t())


def _col_major(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] with the same values stored column-major (a [N, K] view of a contiguous [K, N] tensor): the layer
    GEMMs' weight layout (module docstring)."""
    return w.t().contiguous().t()


def _cat_rows(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One [sum rows (rounded up to 16), K] column-major buffer holding `tensors` [n_i, K] in order, and views of it
    that equal them. The zero padding rows make the GEMM output's row stride a multiple of 16 elements: 16-byte
    aligned rows, and a stride Triton specializes on, so the glue kernels reading those rows vectorize their loads."""
    n = sum(t.shape[0] for t in tensors)
    buf = torch.zeros(tensors[0].shape[1], -(-n // 16) * 16, dtype=tensors[0].dtype, device=tensors[0].device).t()
    views, r = [], 0
    for t in tensors:
        buf[r:r + t.shape[0]].copy_(t)
        views.append(buf[r:r + t.shape[0]])
        r += t.shape[0]
    return buf, views


def _fuse_linears(linears: list) -> tuple[torch.Tensor, list[int]]:
    """Concatenate the weights of `linears` (model.layers.Linear) by rows, point each Linear at its view; returns
    (the buffer, the column offsets of each output in the GEMM result)."""
    buf, views = _cat_rows([lin.weight for lin in linears])
    offs, r = [], 0
    for lin, v in zip(linears, views):
        lin.weight = v
        offs.append(r)
        r += v.shape[0]
    return buf, offs


class _KDA:
    def __init__(self, m, act):
        self.m = m
        P, K, H = m.qkv.weight.shape[0] // 3, m.K, m.H
        self.P = P
        self.w_in, (_, self.g0, self.fa0, self.b0) = _fuse_linears([m.qkv, m.g, m.f_a, m.b])
        m.f_b.weight, m.o.weight = _col_major(m.f_b.weight), _col_major(m.o.weight)
        self.kw = dict(num_heads=H, head_dim=K, lower_bound=m.lower_bound, norm_eps=m.eps)

    def __call__(self, x, batch, pools, comm, ops):
        m, P = self.m, self.P
        y = _mm(x, self.w_in)
        qkv, g = y[:, :P * 3], y[:, self.g0:self.g0 + P]
        f = _mm(y[:, self.fa0:self.fa0 + m.K], m.f_b.weight)
        b = y[:, self.b0:self.b0 + m.H]
        args = (qkv, f, b, g, m.conv_w, m.A_log, m.dt_bias, m.o_norm_w)
        if batch.decode:
            out, st, cv = ops.kda_decode(*args, pools["state"], pools["conv"], batch.slots, **self.kw)
        elif batch.kda_snapshot is not None:
            out, st, cv = kda_prefill_snapshotting(ops.kda_prefill, args, pools["state"], pools["conv"], batch,
                                                   m.layer, **self.kw)
        else:
            out, st, cv = ops.kda_prefill(*args, pools["state"], pools["conv"], batch.cu_seqlens, batch.slots,
                                          **self.kw)
        return comm.all_reduce(_mm(out, m.o.weight)), {"state": st, "conv": cv}


class _MLA:
    def __init__(self, m, act, cfg):
        self.m = m
        self.w_in, (_, self.kv0, self.g0) = _fuse_linears([m.q_a, m.kv_a, m.g])
        m.q_b.weight, m.o.weight = _col_major(m.q_b.weight), _col_major(m.o.weight)
        self.QR, self.Dr = cfg.q_lora_rank, cfg.qk_rope_head_dim
        gpu = m.kv_b.is_cuda and not glue._INTERPRET
        self.kv_b = m.kv_b.to(act) if gpu else m.kv_b          # the interpreter's 16-bit tl.dot is wrong: fp32 there
        self.q_a_norm, self.kv_a_norm = m.q_a_norm, m.kv_a_norm

    def __call__(self, x, batch, pools, comm, ops):
        m = self.m
        T, H = x.shape[0], m.H
        y = _mm(x, self.w_in)
        cq, latent = glue.lora_norms(y, self.q_a_norm, self.kv_a_norm, m.eps, self.QR, m.R, self.Dr)
        q = _mm(cq, m.q_b.weight).view(T, H, m.Dn + self.Dr)
        g = y[:, self.g0:self.g0 + H * m.Dv]
        if batch.decode:
            q_abs = glue.mla_absorb(q, self.kv_b, m.Dn, m.Dv, m.R)
            o_lat, cache = ops.mla_decode(q_abs, latent, pools["cache"], batch.block_tables, batch.context_lens,
                                          num_heads=H, kv_lora_rank=m.R, scale=m.scale)
            o = glue.mla_out(o_lat, self.kv_b, g, m.Dn, out_dtype=x.dtype)
        else:
            o, cache = ops.mla_prefill(q, latent, self.kv_b, pools["cache"], batch.block_tables, batch.cu_seqlens,
                                       batch.context_lens, num_heads=H, qk_nope_head_dim=m.Dn, v_head_dim=m.Dv,
                                       kv_lora_rank=m.R, scale=m.scale)
            o = (o.float() * torch.sigmoid(g.float())).to(x.dtype)
        return comm.all_reduce(_mm(o, m.o.weight)), {"cache": cache}


class _MoE:
    def __init__(self, m, act, cfg, rank):
        self.m, self.cfg, self.rank = m, cfg, rank
        self.gate_w = m.gate_w.to(act)
        shared = m.shared
        self.Rl = m.down.weight.shape[0]
        self.I = shared.gate.weight.shape[0] if shared is not None else 0
        self.w_mid, _ = _fuse_linears([m.down] + ([shared.gate, shared.up] if shared is not None else []))
        if shared is not None:                 # [routed_expert_up ‖ shared down] along the input columns
            w = _col_major(torch.cat([m.up.weight, shared.down.weight], 1))
            m.up.weight, shared.down.weight = w[:, :self.Rl], w[:, self.Rl:]
            self.w_out = w
        else:
            self.w_out = m.up.weight = _col_major(m.up.weight)

    def route(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits z fp32 [T, E] -> (ids int32 [T, k], weights fp32 [T, k]): the top-k kernel on CUDA, its fp32
        definition on the CPU (the interpreter would run one slow program per token)."""
        c = self.cfg
        kw = dict(top_k=c.num_experts_per_token, num_expert_group=c.num_expert_group, topk_group=c.topk_group,
                  renormalize=c.moe_renormalize)
        if z.is_cuda:
            from k3deploy.plugins.moe.kernels import route_topk
            return route_topk(z, self.m.bias, routed_scaling_factor=c.routed_scaling_factor, **kw)
        from k3deploy.plugins.moe.reference import route_logits
        ids, w = route_logits(z, self.m.bias, scaling=c.routed_scaling_factor, **kw)
        return ids.int(), w

    def __call__(self, x, comm, ops):
        m, c = self.m, self.cfg
        ids, wts = self.route(_mm_f32(x, self.gate_w))
        y = _mm(x, self.w_mid)
        yl = ops.mxfp4_moe(y[:, :self.Rl], ids, wts, **m.experts, expert_offset=m.expert_offset,
                           situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta, num_experts=c.num_experts)
        yl = comm.all_reduce(yl)
        rows = glue.moe_out_rows(yl, m.norm_w, y if self.I else None, self.I, c.rms_norm_eps, c.situ_beta,
                                 c.situ_linear_beta, gate_col=self.Rl, out_dtype=x.dtype)
        if self.rank == 0 or not self.I:       # the replicated up-projection is added once, by rank 0
            return comm.all_reduce(_mm(rows, self.w_out))
        return comm.all_reduce(_mm(rows[:, self.Rl:], self.w_out[:, self.Rl:]))


class _Dense:
    def __init__(self, m, cfg):
        self.m, self.cfg = m, cfg
        self.I = m.gate.weight.shape[0]
        self.w_gu, _ = _fuse_linears([m.gate, m.up])
        m.down.weight = _col_major(m.down.weight)

    def __call__(self, x, comm, ops):
        c = self.cfg
        h = glue.moe_out_rows(None, None, _mm(x, self.w_gu), self.I, c.rms_norm_eps, c.situ_beta,
                              c.situ_linear_beta)
        return comm.all_reduce(_mm(h, self.m.down.weight))


class _Layer:
    def __init__(self, layer, act, rank):
        cfg = layer.cfg
        self.l, self.eps = layer.l, cfg.rms_norm_eps
        self.commit = cfg.is_commit(layer.l)
        self.nb = cfg.bank_rows_before(layer.l)
        self.q_attn, self.q_mlp = attn_res_query(*layer.attn_res_w), attn_res_query(*layer.mlp_res_w)
        self.in_norm, self.post_norm = layer.in_norm, layer.post_norm
        self.attn = _KDA(layer.attn, act) if cfg.layer_kind(layer.l) == "kda" else _MLA(layer.attn, act, cfg)
        self.mlp = _MoE(layer.mlp, act, cfg, rank) if cfg.is_moe(layer.l) else _Dense(layer.mlp, cfg)


class FusedModel:
    """`model`'s forward with fused glue (module docstring); same contract as `K3Model.forward` /
    `forward_on_device` (logits fp32), with the model's ops (in-place kernels: `plugins.torch_ops.KernelOps`).
    Built once per model (`FusedModel.of`): it regroups the model's dense weights into concatenated buffers (the
    model's Linear weights become views of them)."""

    _built: "weakref.WeakKeyDictionary[K3Model, FusedModel]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: K3Model) -> "FusedModel":
        """The FusedModel of `model` (built on first use, then shared)."""
        if model not in cls._built:
            cls._built[model] = cls(model)
        return cls._built[model]

    def __init__(self, model: K3Model):
        self.model, self.cfg = model, model.cfg
        act = model.dense_dtype
        self.layers = []
        for layer in model.layers:
            self.layers.append(_Layer(layer, act, model.comm.rank))
            if model.device.type == "cuda":     # the replaced weights' blocks: give them back before the next layer's
                torch.cuda.empty_cache()        # concatenation needs new ones (a full-size model fills the GPU)
        self.q_out = attn_res_query(*model.out_res_w)

    @property
    def ops(self):
        return self.model.ops

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dense_dtype(self) -> torch.dtype:
        return self.model.dense_dtype

    @property
    def comm(self):
        return self.model.comm

    def check_ids(self, ids: torch.Tensor) -> None:
        """`K3Model.check_ids`."""
        self.model.check_ids(ids)

    # K3Model.forward's host side (validate host ids, move the inputs to the device) over this forward_on_device
    forward = K3Model.forward

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        m = self.model
        if m.comm.size == 1:
            return torch.nn.functional.embedding(ids, m.embed_w)
        V = m.embed_w.shape[0]
        local = ids.long() - m.vocab_start
        ok = (local >= 0) & (local < V)
        return m.comm.all_reduce(torch.nn.functional.embedding(local.clamp(0, V - 1), m.embed_w) * ok[:, None])

    def forward_on_device(self, ids: torch.Tensor, batch: Batch, pools: dict,
                          logits_index: torch.Tensor | None = None,
                          image_rows: "tuple[torch.Tensor, torch.Tensor] | None" = None):
        """`K3Model.forward_on_device` (no host reads: CUDA-graph capturable with in-place ops); image_rows as in
        `K3Model.forward_on_device` (VISION.md §8.3: written over the embedding before layer 0)."""
        m, cfg = self.model, self.cfg
        comm, ops, eps = m.comm, m.ops, cfg.rms_norm_eps
        P = self._embed(ids)                              # the block sum, in the model dtype
        if image_rows is not None:
            P = P.index_put((image_rows[0],), image_rows[1].to(P.dtype))
        T, d = P.shape
        bank = P.new_empty(T, max(1, cfg.num_bank_rows), d)
        new, pending = {}, None
        for l, L in enumerate(self.layers):
            x = glue.attn_res_norm(P, pending, bank, L.nb, L.q_attn, L.in_norm, eps,
                                   store="bank" if L.commit else "P")
            a, new[l] = L.attn(x, batch, pools[l], comm, ops)
            x = glue.attn_res_norm(P, a, bank, L.nb + L.commit, L.q_mlp, L.post_norm, eps, restart=L.commit)
            pending = L.mlp(x, comm, ops)
        h = glue.attn_res_norm(P, pending, bank, cfg.bank_rows_after(cfg.num_hidden_layers - 1), self.q_out,
                               m.norm_w, eps, store=None, rows=logits_index)
        return comm.all_gather_last(_mm_f32(h, m.lm_head)), new
