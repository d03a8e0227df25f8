"""TP/EP sharding (MODEL.md §10): shards reassemble exactly, and a sharded reference forward over
torch.distributed (gloo, 2 and 4 processes) equals the unsharded forward."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3deploy.model.checkpoint import Checkpoint
from k3deploy.model.layers import Comm
from k3deploy.model.reference import K3Model, SequenceState, forward
from k3deploy.model.sharding import check_parallel, shard_layer, shard_model
from k3deploy.model.weights import PREFIX, layer_tensors


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 4)])
def test_shards_reassemble_exactly(tiny_ckpt, tiny_cfg, tp, ep):
    ck = Checkpoint(tiny_ckpt)
    for l in range(tiny_cfg.num_hidden_layers):
        full = ck.layer_weights(l)
        parts = [shard_layer(tiny_cfg, l, full, r, tp, ep) for r in range(tp)]
        split = {s.name[len(f"{PREFIX}model.layers.{l}."):]: s.split for s in layer_tensors(tiny_cfg, l)}
        for name, t in full.items():
            kind = split[name]
            if kind == "col":
                assert torch.equal(torch.cat([p[name] for p in parts], 0), t), name
            elif kind == "row":
                assert torch.equal(torch.cat([p[name] for p in parts], 1), t), name
            elif kind == "expert" and ep > 1:
                owners = [p for p in parts if name in p]
                assert len(owners) == 1 and torch.equal(owners[0][name], t), name   # gathered back, once
            elif kind == "expert":
                dim = 1 if ".w2." in name else 0
                assert torch.equal(torch.cat([p[name] for p in parts], dim), t), name
            else:
                assert all(torch.equal(p[name], t) for p in parts), name
    mw = ck.model_weights()
    heads = [shard_model(tiny_cfg, mw, r, tp) for r in range(tp)]
    assert torch.equal(torch.cat([h["embed_tokens.weight"] for h in heads]), mw["embed_tokens.weight"])
    assert torch.equal(torch.cat([h["lm_head.weight"] for h in heads]), mw["lm_head.weight"])


def test_check_parallel_errors(tiny_cfg):
    with pytest.raises(ValueError, match="tp = 3"):
        check_parallel(tiny_cfg, 3, 1)
    with pytest.raises(ValueError, match="ep = 3"):
        check_parallel(tiny_cfg, 2, 3)
    with pytest.raises(ValueError, match="multiple of 32"):
        check_parallel(tiny_cfg, 4, 1)   # 64 / 4 = 16 columns of w2 per rank: not whole MXFP4 groups


def _rank_main(rank, tp, ep, ckpt, ids, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    try:
        torch.set_num_threads(1)
        model = K3Model.from_checkpoint(ckpt, rank=rank, tp=tp, ep=ep, comm=Comm(rank, tp))
        st = SequenceState(model.cfg, 32, tp=tp)
        logits, _ = forward(model, ids[:6], st)                # prefill
        steps = [logits]
        for t in ids[6:]:                                      # decode through the sharded state
            steps.append(forward(model, [int(t)], st)[0])
        if rank == 0:
            torch.save(torch.cat(steps), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 4)])
def test_sharded_forward_over_gloo_equals_unsharded(tiny_ckpt, tiny_model, tiny_cfg, tp, ep, tmp_path):
    ids = torch.randint(0, tiny_cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(7))
    ref_st = SequenceState(tiny_cfg, 32)
    ref = [forward(tiny_model, ids[:6], ref_st)[0]] + [forward(tiny_model, [int(t)], ref_st)[0] for t in ids[6:]]
    ref = torch.cat(ref)
    out = tmp_path / "logits.pt"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_rank_main, args=(tp, ep, str(tiny_ckpt), ids, str(tmp_path / "init"), str(out)),
                       nprocs=tp, join=True, start_method="spawn")
    got = torch.load(out)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
