"""Where KDA prefill's time goes: per-kernel GPU time of our KdaPrefill op and of fla-core's chunk_kda (the peer),
from torch.profiler, at K3 per-rank shapes (T tokens in one sequence).

Usage (GPU with fla-core; or `bash benchmarks/gpu_run.sh profile`, which installs fla-core and sets $OUT):
    python benchmarks/profile_kda_prefill.py --out $OUT/profile.jsonl [--heads 12,96] [--tokens 32768]
One JSON line per (heads, variant): what="kda_prefill_profile", variant, us (CUDA-event median of --reps calls),
kernels {kernel name: GPU us per call} (the profiler's device time over --prof-iters calls / iters), and for the
intra-card CP variants rel_err against the same call without it. Variants:
  ours            kda_prefill (conv + beta + fla's gate/intra/state stages + our output kernel with the gated
                  norm fused)
  ours_fla        kda_prefill's fallback for untested fla-core versions (`_fla_stages` None): conv + beta + fla's
                  whole chunk_kda + our norm kernel
  ours_ok32_w8_s2 ours with the output kernel's K step, warps and stages forced (32/64, 4/8, 2/3; the default
                  K step 64 / 4 warps / 2 stages is `ours`)
  peer            chunk_kda pre-gated (fp32 gate, bf16 beta, L2-normalized q/k given), as bench_kernels.py times it
  core_ours_flags chunk_kda alone under our op's flags (in-kernel gate, safe_gate, state_v_first, bf16 beta), dense
  core_varlen_cp  the same through cu_seqlens, under torch.inference_mode with fla's intra-card context
                  parallelism (FLA_INTRACARD_CP=1: the sequence split into sub-sequences scanned side by side)
  peer_varlen_cp  the peer's call the same way
Autotune happens in the warm-up calls (fla: minutes on a fresh machine); the profiled calls follow it.
"""
import argparse
import json
import os
import statistics
import sys
from unittest import mock

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", default="/tmp/k3deploy_bench/profile.jsonl", help="JSON lines output (default: %(default)s)")
ap.add_argument("--heads", default="12,96", help="comma-separated heads per rank (default: %(default)s)")
ap.add_argument("--tokens", type=int, default=32768, help="tokens in the one sequence (default: %(default)s)")
ap.add_argument("--reps", type=int, default=20, help="timed calls per variant (default: %(default)s)")
ap.add_argument("--prof-iters", type=int, default=3, help="profiled calls per variant (default: %(default)s)")
ap.add_argument("--variants", default="ours,ours_fla,peer,core_ours_flags,ours_ok32_w4_s2,ours_ok32_w4_s3,"
                                      "ours_ok32_w8_s2,ours_ok64_w4_s3,ours_ok64_w8_s2,ours_ok64_w8_s3",
                help="comma-separated variants (default: %(default)s)")
args = ap.parse_args()
try:
    HEADS = [int(h) for h in args.heads.split(",")]
except ValueError:
    ap.error(f"--heads {args.heads!r}: expected comma-separated integers, e.g. 12,96")
if args.tokens < 64 or args.reps < 1 or args.prof_iters < 1:
    ap.error("--tokens must be >= 64, --reps and --prof-iters >= 1")

try:
    import torch
    from fla.ops.kda import chunk_kda
except ImportError as e:
    ap.exit(2, f"error: profile_kda_prefill.py needs torch and fla-core on a CUDA GPU ({e})\n")
if not torch.cuda.is_available():
    ap.exit(2, "error: profile_kda_prefill.py needs a CUDA GPU (torch.cuda.is_available() is False here)\n")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3deploy.plugins.kda import kernels as kda_k  # noqa: E402

K = 128
dev = "cuda"
os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
fout = open(args.out, "w")


def emit(**kw):
    print(json.dumps(kw), flush=True)
    fout.write(json.dumps(kw) + "\n")
    fout.flush()


def time_us(fn, reps):
    """Median GPU time of one call (CUDA events around each call), us."""
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def kernels_us(fn, iters):
    """GPU time per call of each kernel fn launches ({name: us}), largest first."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0:
            rows[e.key[:120]] = rows.get(e.key[:120], 0.0) + t / iters
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("inf")


class intracard_cp:
    """FLA_INTRACARD_CP=1 for the duration (fla reads it at each call)."""
    def __enter__(self):
        self.old = os.environ.get("FLA_INTRACARD_CP")
        os.environ["FLA_INTRACARD_CP"] = "1"

    def __exit__(self, *a):
        if self.old is None:
            os.environ.pop("FLA_INTRACARD_CP", None)
        else:
            os.environ["FLA_INTRACARD_CP"] = self.old


torch.manual_seed(0)
emit(what="env", gpu=torch.cuda.get_device_name(0), torch=torch.__version__, tokens=args.tokens)
for H in HEADS:
    T, P = args.tokens, H * K
    d = dict(qkv=torch.randn(T, 3 * P, device=dev).bfloat16(), f=torch.randn(T, P, device=dev).bfloat16(),
             b=torch.randn(T, H, device=dev).bfloat16(), g=torch.randn(T, P, device=dev).bfloat16(),
             conv_w=torch.randn(3 * P, 4, device=dev) * 0.5, A_log=torch.randn(H, device=dev) * 0.5,
             dt_bias=torch.randn(P, device=dev) * 0.3, o_norm_w=torch.rand(K, device=dev) + 0.5)
    state = torch.zeros(3, H, K, K, device=dev)
    conv = torch.zeros(3, 3 * P, 3, device=dev).bfloat16()
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    slots = torch.tensor([2], dtype=torch.int32, device=dev)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, H, K, device=dev).bfloat16()
    gg = (-5.0 * torch.sigmoid(torch.randn(1, T, H, K, device=dev))).float()
    be = torch.sigmoid(torch.randn(1, T, H, device=dev)).bfloat16()
    fr = torch.randn(1, T, H, K, device=dev).bfloat16()
    h0 = torch.zeros(1, H, K, K, device=dev)
    cu64 = cu.long()
    ours_kw = dict(initial_state=h0, output_final_state=True, use_gate_in_kernel=True, A_log=d["A_log"],
                   dt_bias=d["dt_bias"], safe_gate=True, lower_bound=-5.0, state_v_first=True)
    def ours(fallback=False, out_cfg=None):
        """kda_prefill, with the output kernel's tiles `out_cfg` in place of `_OUT_CFG`'s, or (fallback) on fla's
        chunk_kda (A/B variants of this benchmark)."""
        def call():
            with mock.patch.dict(kda_k._OUT_CFG, out_cfg or {}), \
                    mock.patch.object(kda_k, "_fla_stages", (lambda: None) if fallback else kda_k._fla_stages):
                return kda_k.kda_prefill(**d, state=state, conv=conv, cu_seqlens=cu, slots=slots, num_heads=H,
                                         head_dim=K)
        return call
    variants = {
        "ours": ours(),
        "ours_fla": ours(fallback=True),
        **{f"ours_ok{bk}_w{w}_s{st}": ours(out_cfg=dict(block_k=bk, num_warps=w, num_stages=st))
           for bk in (32, 64) for w in (4, 8) for st in (2, 3)},
        "peer": lambda: chunk_kda(q, k, v, gg, be, initial_state=h0, output_final_state=True),
        "core_ours_flags": lambda: chunk_kda(q, k, v, fr, be, **ours_kw),
        "core_varlen_cp": lambda: chunk_kda(q, k, v, fr, be, cu_seqlens=cu64, cu_seqlens_cpu=cu64.cpu(), **ours_kw),
        "peer_varlen_cp": lambda: chunk_kda(q, k, v, gg, be, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu64, cu_seqlens_cpu=cu64.cpu()),
    }
    base_of = {"core_varlen_cp": "core_ours_flags", "peer_varlen_cp": "peer"}
    results = {}
    for name in args.variants.split(","):
        fn = variants.get(name)
        if fn is None:
            emit(what="kda_prefill_profile", H=H, variant=name, error=f"unknown variant; choose from {list(variants)}")
            continue
        try:
            cp = name.endswith("_cp")
            with torch.inference_mode():
                if cp:
                    with intracard_cp():
                        r = fn(); fn()
                        us = time_us(fn, args.reps)
                        ks = kernels_us(fn, args.prof_iters)
                else:
                    r = fn(); fn()
                    us = time_us(fn, args.reps)
                    ks = kernels_us(fn, args.prof_iters)
            rec = dict(what="kda_prefill_profile", H=H, T=T, variant=name, us=us, kernels=ks)
            if isinstance(r, tuple) and not name.startswith("ours"):
                results[name] = (r[0].float().clone(), r[1].float().clone())
                if name in base_of and base_of[name] in results:
                    o0, s0 = results[base_of[name]]
                    rec["rel_err_vs_" + base_of[name]] = max(rel(r[0].float(), o0), rel(r[1].float(), s0))
            emit(**rec)
        except Exception as e:
            emit(what="kda_prefill_profile", H=H, variant=name, error=repr(e)[:400])
    del d, q, k, v, gg, be, fr, results
    torch.cuda.empty_cache()
