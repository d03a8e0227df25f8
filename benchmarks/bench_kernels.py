"""Our Triton kernels vs the peers at K3 per-rank shapes (TP=8: 12 heads; TP=1: 96), on one GPU (written for an H200).

Usage (GPU; or `bash benchmarks/gpu_run.sh bench`, which sets up fla-core and $OUT):
    PYTHONUNBUFFERED=1 python benchmarks/bench_kernels.py --out $OUT/bench.jsonl [--junit $OUT/junit.xml] [--only ...]
Each record: what, shape, us, peer_us, ratio (peer/ours, >1 = we are faster), bytes, GBps, pct_copy, correct.
Speeds are reported only for kernels whose correctness check passed in the same run (in-script check at the bench
shape; plus the pytest junit results when given). A roofline PNG is written beside --out.
"""
import argparse, json, math, os, statistics, sys, time, xml.etree.ElementTree as ET
from unittest import mock

FAMILIES = "kda_decode,layers,graph,mla,mla_prefill,moe,router,kda_prefill,aot_prefill"
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", default="/tmp/k3deploy_bench/bench.jsonl",
                help="JSON lines output; roofline.png goes beside it (default: %(default)s)")
ap.add_argument("--junit", default=None,
                help="junit XML of a pytest run of tests/plugins/test_kernels.py on the same machine: a failed test "
                     "family marks its kernels' records correct=false")
ap.add_argument("--only", default=FAMILIES,
                help=f"comma-separated families to run (default: all = {FAMILIES}); record names: kda_decode, "
                     "kda_decode_layers (one step of several layers in a CUDA graph, with the state-traffic floors), "
                     "cuda_graph_decode_step, "
                     "mla_decode, mla_prefill (torch SDPA vs the graph-safe Triton path), mxfp4_moe, moe_router (top-k "
                     "after the logits GEMM), kda_prefill, aot_prefill (the "
                     "--aot engines' KdaPrefill/MlaPrefill chains "
                     "vs the JIT ops)")
ap.add_argument("--rounds", type=int, default=3,
                help="KDA decode and MoE: interleaved timing rounds over all variants (and KDA decode's peer); each "
                     "variant reports the median and the spread (default: %(default)s)")
ap.add_argument("--prefill-heads", default=None,
                help="KDA prefill (and the AOT chains): comma-separated heads per rank to time at T=32768 (default: "
                     "the --config's heads / 8 and all of them: 12,96 for K3)")
ap.add_argument("--prefill-breakdown", action=argparse.BooleanOptionalAction, default=True,
                help="KDA prefill: also time chunk_kda under each flag combination and our varlen path (each new "
                     "combination autotunes fla's kernels: minutes on a fresh machine); --no-prefill-breakdown keeps "
                     "ours, the peer, both in CUDA graphs and our conv/norm passes, and checks a dense two-call split")
ap.add_argument("--moe-tokens", default="64,1,8,256",
                help="MoE: comma-separated token counts T (default: %(default)s)")
ap.add_argument("--moe-experts", default="112",
                help="MoE: comma-separated local expert counts (default %(default)s = K3 at TP=8 / EP=8; 64 = k3-slice "
                     "at TP=1, 896 = K3 at TP=1: ~15 GB of MXFP4 weights plus ~60 GB for the bf16 peer)")
ap.add_argument("--moe-global-experts", type=int, default=0,
                help="MoE: routed experts over all EP ranks (default 0 = the local count: every choice local); 896 "
                     "with --moe-experts 112 = K3 at EP=8 as deployed, each token's 16 choices drawn over 896 experts, "
                     "~1/8 of them on this rank's 112")
ap.add_argument("--config", default="k3-slice",
                help="model config whose per-layer dims the shapes take (a preset name or a checkpoint directory; "
                     "default %(default)s = K3's dims with 5 layers and 64 experts): KDA head dim, MLA latent / rope / "
                     "head dims, routed-expert sizes and top-k; heads per rank = its heads / 8 (TP=8) and all of them "
                     "(TP=1). Expert counts come from --moe-experts")
args = ap.parse_args()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3deploy.model.config import load_config   # noqa: E402
try:
    CFG = load_config(args.config)
except Exception as e:       # unknown preset, missing or bad config.json
    ap.error(f"--config {args.config!r}: {e}")
if CFG.num_attention_heads != CFG.kda_num_heads or CFG.kda_num_heads % 8:
    ap.error(f"--config {args.config!r}: the bench needs equal KDA and MLA heads, divisible by 8 for TP=8 "
             f"(got {CFG.kda_num_heads} / {CFG.num_attention_heads})")
# the inputs and peers below are written for K3's conv width, gate bound and SiTU constants
_K3_FIXED = dict(conv_kernel_size=4, gate_lower_bound=-5.0, situ_beta=4.0, situ_linear_beta=25.0)
if any(getattr(CFG, k) != v for k, v in _K3_FIXED.items()):
    ap.error(f"--config {args.config!r}: the bench assumes K3's {_K3_FIXED}; got "
             f"{ {k: getattr(CFG, k) for k in _K3_FIXED} }")
H8, H1 = CFG.kda_num_heads // 8, CFG.kda_num_heads     # heads per rank at TP=8 and TP=1 (K3: 12, 96)
KK = CFG.num_experts_per_token                         # routed experts per token (K3: 16)
ONLY = set(args.only.split(","))
ROUNDS = args.rounds
if ROUNDS < 1:
    ap.error("--rounds: must be >= 1")
try:
    PREFILL_HEADS = [int(h_) for h_ in args.prefill_heads.split(",")] if args.prefill_heads else [H8, H1]
except ValueError:
    ap.error(f"--prefill-heads {args.prefill_heads!r}: expected comma-separated integers, e.g. 12,96")
if ONLY - set(FAMILIES.split(",")):
    ap.error(f"--only: unknown {sorted(ONLY - set(FAMILIES.split(',')))}; choose from {FAMILIES}")


def int_list(flag: str, text: str, least: int, example: str) -> list:
    """The comma-separated integers of option `flag` (each >= least); an argparse error naming the option else."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if not vals or min(vals) < least:
        ap.error(f"{flag} {text!r}: expected comma-separated integers >= {least}, e.g. {example}")
    return vals


MOE_TOKENS = int_list("--moe-tokens", args.moe_tokens, 1, "64,8")
MOE_GLOBAL = args.moe_global_experts
if MOE_GLOBAL < 0:
    ap.error(f"--moe-global-experts {MOE_GLOBAL}: give the routed experts over all EP ranks (896 for K3), or 0")
MOE_EXPERTS = int_list("--moe-experts", args.moe_experts, KK, f"112,64 (top-{KK} needs {KK})")

try:                                                  # after --help, which needs neither
    import torch, triton                              # noqa: E402
    import triton.language as tl                      # noqa: E402
    from triton.testing import do_bench               # noqa: E402
except ImportError as e:
    ap.exit(2, f"error: bench_kernels.py needs torch and Triton on a CUDA GPU ({e}); install the gpu extra: "
               "pip install -e '.[gpu]'\n")
if not torch.cuda.is_available():
    ap.exit(2, "error: bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False here)\n")

from k3deploy.plugins.kda import kernels as kda_k   # noqa: E402
from k3deploy.plugins.mla import kernels as mla_k   # noqa: E402
from k3deploy.plugins.moe import kernels as moe_k   # noqa: E402
from k3deploy.plugins.moe.reference import route_logits   # noqa: E402
import bench_common                        # noqa: E402  (benchmarks/, this script's folder)
from bench_common import capture_graph, forced     # noqa: E402

os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
dev = "cuda"
fout = open(args.out, "w")
RECS = []


def out(**kw):
    RECS.append(kw)
    print(json.dumps(kw), flush=True)
    fout.write(json.dumps(kw) + "\n"); fout.flush()


def bench(fn, rep=200):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# pytest results (same run), per family
fam_ok = {}
if args.junit and os.path.exists(args.junit):
    for tc in ET.parse(args.junit).getroot().iter("testcase"):
        name = tc.get("name")
        fam = name.split("[")[0].replace("test_", "")
        bad = any(c.tag in ("failure", "error") for c in tc)
        fam_ok[fam] = fam_ok.get(fam, True) and not bad
out(what="env", gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__, pytest=fam_ok,
    config=CFG.name, heads_per_rank=[H8, H1])

x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
COPY = 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6
out(what="copy", GBps=COPY)
del x, y

try:
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    HAVE_FLA = True
except Exception as e:
    HAVE_FLA = False
    out(what="fla_import", error=repr(e)[:300])

try:   # the whole-step KDA decode peer's ops (fla-core 0.6.0)
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    HAVE_FLA_FULL = True
except Exception as e:
    HAVE_FLA_FULL = False
    out(what="fla_full_step_import", error=repr(e)[:300])

K = CFG.kda_head_dim


def kda_decode_inputs(B, H, act=torch.bfloat16):
    """`bench_common.kda_decode_inputs` at this config's head width on the GPU."""
    return bench_common.kda_decode_inputs(B, H, K, dev, act)


def kda_decode_bytes(B, H):
    """Compulsory HBM bytes of one KDA decode step: state read+write, conv history read+write, activations."""
    P = H * K
    return B * (H * K * K * 4 * 2 + 3 * P * 3 * 2 * 2 + (3 * P + 2 * P + H) * 2 + P * 2)


def peer_kda_decode_call(B, H):
    """A thunk running fla's fused_recurrent_kda (the peer: recurrence only) on fresh inputs of B tokens."""
    q = torch.nn.functional.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1).bfloat16()
    kk = torch.nn.functional.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(B, 1, H, K, device=dev).bfloat16()
    gg = (-5.0 * torch.sigmoid(torch.randn(B, 1, H, K, device=dev))).float()
    be = torch.sigmoid(torch.randn(B, 1, H, device=dev)).bfloat16()
    h0 = torch.randn(B, H, K, K, device=dev) * 0.1
    return lambda: fused_recurrent_kda(q, kk, v, gg, be, initial_state=h0, output_final_state=True)


def peer_full_kda_decode_call(d, state, conv, slots, H):
    """A thunk running the whole KDA decode step with fla-core's ops, composed as a serving stack would (the peer of
    our fused step, where `peer_kda_decode_call` is the recurrence alone): `causal_conv1d_update` + SiLU for q, k and
    v (three launches, each on its own batch-ordered [B, P, 4] history: no slot gather, which favours the peer), then
    `fused_recurrent_kda_fwd` updating `state` [S, H, K, K] in place through `ssm_state_indices` = slots (V-first
    rows = our layout; L2 norm, lower-bound gate and beta sigmoid in its kernel), then `rms_norm_gated` (sigmoid
    gate, eps 1e-5). Same inputs as ours (`kda_decode_inputs`); the thunk returns the bf16 [B, P] output. fla rounds
    the conv outputs to bf16 before the recurrence (we keep fp32), so its state error is larger than ours."""
    B, P = slots.shape[0], H * K
    caches = [torch.zeros(B, P, 4, dtype=conv.dtype, device=conv.device) for _ in range(3)]
    for i, c in enumerate(caches):
        c[:, :, 1:] = conv[slots.long(), i * P:(i + 1) * P]
    ws = [d["conv_w"][i * P:(i + 1) * P].contiguous() for i in range(3)]
    idx = slots.to(torch.int32)

    def step():
        q, k, v = (causal_conv1d_update(d["qkv"][:, i * P:(i + 1) * P], caches[i], weight=ws[i], activation="silu")[0]
                   for i in range(3))
        o, _ = fused_recurrent_kda_fwd(
            q.view(B, 1, H, K), k.view(B, 1, H, K), v.view(B, 1, H, K), d["f"].view(B, 1, H, K), d["b"].view(B, 1, H),
            A_log=d["A_log"], dt_bias=d["dt_bias"], scale=K ** -0.5, initial_state=state, inplace_final_state=True,
            ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True)
        return rms_norm_gated(o.view(B * H, K), d["g"].view(B * H, K), d["o_norm_w"], None, activation="sigmoid",
                              eps=1e-5).view(B, P)
    return step


PEER_FULL = ("fla causal_conv1d_update x3 + fused_recurrent_kda_fwd (slots, L2 norm, gate, beta in kernel) + "
             "rms_norm_gated: the whole step, 5 launches")


def torch_kda_decode(d, state, conv, slots, H):
    """fp32 torch transcription of one decode step (check only)."""
    B = slots.shape[0]; P = H * K; sl = slots.long()
    X = conv[sl].float(); xn = d["qkv"].float()
    win = torch.cat([X, xn[:, :, None]], -1)
    y = torch.nn.functional.silu((win * d["conv_w"][None]).sum(-1))
    q, k, v = y[:, :P].view(B, H, K), y[:, P:2 * P].view(B, H, K), y[:, 2 * P:].view(B, H, K)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    gate = -5.0 * torch.sigmoid(d["A_log"].exp()[None, :, None] * (d["f"].float() + d["dt_bias"]).view(B, H, K))
    beta = torch.sigmoid(d["b"].float())
    S = state[sl] * gate.exp()[:, :, None, :]
    u = v - torch.einsum("bhvk,bhk->bhv", S, k)
    S = S + beta[:, :, None, None] * u[..., None] * k[:, :, None, :]
    o = torch.einsum("bhvk,bhk->bhv", S, q)
    z = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + 1e-5) * d["o_norm_w"] * torch.sigmoid(d["g"].float().view(B, H, K))
    return z.reshape(B, P), S


# ------------------------------------------------------------------ KDA decode
if "kda_decode" in ONLY:
    for H in (H8, H1):
        for B in (1, 64, 256):
            try:
                d, state, conv, slots = kda_decode_inputs(B, H)
                st0, cv0 = state.clone(), conv.clone()
                ro, rS = torch_kda_decode(d, st0, cv0, slots, H)
                ok = fam_ok.get("kda_decode", True)
                res, errs, fns, tile_of = {}, {}, {}, {}
                # the default (the kernel's V-tile rule, "{}") and each V tile forced (`_decode_block_v`)
                for bv in (None, 32, 64, 16, 128):
                    name = json.dumps({} if bv is None else dict(block_v=bv))
                    state.copy_(st0); conv.copy_(cv0)
                    with forced(kda_k, "_decode_block_v", bv):
                        o, _, _ = kda_k.kda_decode(**d, state=state, conv=conv, slots=slots, num_heads=H, head_dim=K)
                    e1, e2 = rel(o.float(), ro), rel(state[slots.long()], rS)
                    errs[name] = (e1, e2)
                    if not (e1 < 2e-2 and e2 < 1e-3):
                        ok = ok and bv is not None; res[name] = f"wrong: {e1:.2e} {e2:.2e}"; continue
                    fns[name] = lambda: kda_k.kda_decode(**d, state=state, conv=conv, slots=slots, num_heads=H,
                                                         head_dim=K)
                    tile_of[name] = bv
                err_o, err_s = max(e[0] for e in errs.values()), max(e[1] for e in errs.values())
                nbytes = kda_decode_bytes(B, H)
                peer_full_err = None
                if HAVE_FLA:
                    fns["peer"] = peer_kda_decode_call(B, H)
                if HAVE_FLA_FULL:
                    try:   # the whole-step peer, checked like ours on pristine copies first
                        stp = st0.clone()
                        po = peer_full_kda_decode_call(d, stp, cv0, slots, H)()
                        peer_full_err = (rel(po.float(), ro), rel(stp[slots.long()], rS))
                        if peer_full_err[0] < 2e-2 and peer_full_err[1] < 2e-2:
                            fns["peer_full"] = peer_full_kda_decode_call(d, state, conv, slots, H)
                        del stp
                    except Exception as e:
                        peer_full_err = repr(e)[:300]
                # microsecond kernels: ROUNDS interleaved rounds over all variants and the peer, median per variant
                # (one pass alone varies between identical configurations)
                times = {name: [] for name in fns}
                for _ in range(ROUNDS):
                    for name, fn_v in fns.items():
                        with forced(kda_k, "_decode_block_v", tile_of.get(name)):
                            times[name].append(bench(fn_v, rep=50) * 1e3)
                peer_ts = times.pop("peer", None)
                peer = statistics.median(peer_ts) / 1e3 if peer_ts else float("nan")
                full_ts = times.pop("peer_full", None)
                peer_full = statistics.median(full_ts) / 1e3 if full_ts else float("nan")
                spreads = {name: [min(ts), max(ts)] for name, ts in times.items()}
                for name, ts in times.items():
                    res[name] = statistics.median(ts)
                best = min(((statistics.median(ts) / 1e3, n) for n, ts in times.items()), default=None)
                ms = res["{}"] / 1e3 if (ok and "{}" in times) else float("nan")   # headline = the defaults
                out(what="kda_decode", H=H, B=B, correct=ok, err_o=err_o, err_state=err_s, us=ms * 1e3, variants=res,
                    best_variant=best[1] if best else None, us_best=best[0] * 1e3 if best else None,
                    peer="fla fused_recurrent_kda (recurrence only)", peer_us=peer * 1e3, ratio=peer / ms,
                    spreads=spreads, peer_spread=[min(peer_ts), max(peer_ts)] if peer_ts else None, rounds=ROUNDS,
                    peer_full=PEER_FULL, peer_full_us=peer_full * 1e3, ratio_full=peer_full / ms,
                    peer_full_err=peer_full_err,
                    bytes=nbytes, GBps=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / COPY)
                del d, state, conv
            except Exception as e:
                out(what="kda_decode", H=H, B=B, error=repr(e)[:400])

# ------------------------------------------------------------------ KDA decode: layers in a CUDA graph
# A decode step as deployed: one CUDA graph running the KDA decode of L layers, each on its own state pool (so no layer
# finds its state in L2: L * pool >= 2 GiB, or 32 layers: 1.5 GiB at 12 heads B=64), no Python between kernels; time
# per layer = replay / L. The peer is fla's fused_recurrent_kda captured the same way (recurrence only: no conv, gate,
# norm). Checked: layer 0's output and state of one eager call, for the defaults and each timed variant, against the
# fp32 torch step (and the kda_decode tests of a --junit run). Beside each: `floors_us` (state_floors), what the
# same bytes cost in the same graph form without the fused math.


def graph_us_per_call(calls, rep=20):
    """Median replay time of `capture_graph(calls)` / len(calls), in us (`rep`: do_bench's time budget in ms)."""
    return bench(capture_graph(calls).replay, rep=rep) * 1e3 / len(calls)


@triton.jit
def _floor_state_kernel(state_ptr, slots_ptr, H: tl.constexpr, K: tl.constexpr, BV: tl.constexpr):
    """The state traffic of `_kda_decode_kernel` alone (same grid order, slots, [BV, K] tiles): S = -S in place."""
    iv = tl.program_id(0)
    t = tl.program_id(1)
    h = tl.program_id(2)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    p = state_ptr + (slot * H + h) * (K * K) + iv * BV * K + tl.arange(0, BV)[:, None] * K + tl.arange(0, K)[None, :]
    tl.store(p, -tl.load(p))


@triton.jit
def _floor_step_kernel(vec_ptr, g_ptr, onw_ptr, state_ptr, slots_ptr, out_ptr, oacc_ptr, cnt_ptr, norm_eps,
                       H: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr):
    """`_kda_decode_kernel` without its prologue: the delta rule on the same tiles with q, k, alpha, v, beta read
    from an L2-resident scratch (vec [B*H, 5, K] fp32), o rows stored; NORM: plus its last-arriver counter and the
    gated output RMSNorm (grid (K // BV, B, H), K // BV > 1)."""
    iv = tl.program_id(0)
    t = tl.program_id(1)
    h = tl.program_id(2)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    ck = tl.arange(0, K)
    cvv = iv * BV + tl.arange(0, BV)
    s_ptrs = state_ptr + (slot * H + h) * (K * K) + cvv[:, None] * K + ck[None, :]
    base = vec_ptr + (t * H + h).to(tl.int64) * (5 * K)
    q = tl.load(base + ck)
    k = tl.load(base + K + ck)
    alpha = tl.load(base + 2 * K + ck)
    S = tl.load(s_ptrs) * alpha[None, :]
    u = tl.load(base + 3 * K + cvv) - tl.sum(S * k[None, :], axis=1)
    S = S + (tl.load(base + 4 * K) * u)[:, None] * k[None, :]
    tl.store(s_ptrs, S, mask=(cvv[:, None] * 0 + slot) != 0)
    oa = oacc_ptr + (t * H + h).to(tl.int64) * K
    tl.store(oa + cvv, tl.sum(S * q[None, :], axis=1))
    if NORM:
        prev = tl.atomic_add(cnt_ptr + t * H + h, 1, sem="acq_rel")
        if prev == K // BV - 1:
            of = tl.load(oa + ck, volatile=True)
            gf = tl.load(g_ptr + (t * H + h) * K + ck).to(tl.float32)
            rs = 1.0 / tl.sqrt(tl.sum(of * of, axis=0) / K + norm_eps)
            tl.store(out_ptr + (t * H + h) * K + ck,
                     (of * rs * tl.load(onw_ptr + ck) / (1.0 + tl.exp(-gf))).to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(cnt_ptr + t * H + h, 0)


@triton.jit
def _floor_copy_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    """A contiguous fp32 copy, BLOCK elements per program."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i))


def state_floors(B, H, L, nbytes):
    """Per-layer us, in one CUDA graph of L layers like the decode step, of what the KDA decode's bytes cost without
    its math: "state_inplace": only the state read + write of our kernel (its default V tile, grid order and warps,
    randomly permuted slots like the layers', one pool per layer: 101 of the 105 MB at 12 heads B=64);
    "copy_16KB": a contiguous copy of all the step's bytes (half read, half written), 16 KB per program;
    "torch_neg": the same through torch's elementwise kernel. (torch's copy_ becomes a memcpy node in a graph: not
    an SM floor.) With several V tiles also "step_no_norm" / "step_with_norm" (`_floor_step_kernel`: our step
    without the conv/norm/gate prologue, without / with the cross-tile counter and output norm). At 12 heads B=64
    the differences price each part; at large shapes the fused kernel hides part of the counter's cost behind its
    longer programs (step_with_norm can exceed the fused step there)."""
    bv = kda_k._decode_block_v(B * H, K)
    pools = [torch.zeros(B + 1, H, K, K, device=dev) for _ in range(L)]
    slots = (torch.randperm(B, device=dev) + 1).int()
    (grid, fast) = kda_k._decode_grid(B, H, K // bv)
    if not fast:
        raise ValueError(f"state_floors: B={B} takes the tokens-fast grid, which _floor_state_kernel does not model")
    nw = kda_k._decode_num_warps(bv, K)
    res = dict(state_inplace=graph_us_per_call([lambda p_=p_: _floor_state_kernel[grid](p_, slots, H=H, K=K, BV=bv,
                                                                                          num_warps=nw)
                                                 for p_ in pools]))
    if bv < K:
        vec = torch.rand(B * H * 5 * K, device=dev) * 0.1
        g_ = torch.randn(B, H * K, device=dev).bfloat16()
        onw = torch.rand(K, device=dev) + 0.5
        o_ = torch.empty_like(g_)
        oacc = torch.empty(B * H * K, device=dev)
        cnt = torch.zeros(B * H, dtype=torch.int32, device=dev)
        for name, norm in (("step_no_norm", False), ("step_with_norm", True)):
            res[name] = graph_us_per_call([lambda p_=p_, norm=norm: _floor_step_kernel[grid](
                vec, g_, onw, p_, slots, o_, oacc, cnt, 1e-5, H=H, K=K, BV=bv, NORM=norm, num_warps=nw)
                for p_ in pools])
        del vec, g_, o_, oacc, cnt
    del pools
    n = nbytes // 8 // 4096 * 4096                       # fp32 elements each way, whole 16 KB blocks
    src = [torch.zeros(n, device=dev) for _ in range(L)]
    dst = [torch.empty_like(s_) for s_ in src]
    res["copy_16KB"] = graph_us_per_call([lambda s_=s_, d_=d_: _floor_copy_kernel[(n // 4096,)](s_, d_, BLOCK=4096,
                                                                                               num_warps=4)
                                          for s_, d_ in zip(src, dst)])
    res["torch_neg"] = graph_us_per_call([lambda s_=s_, d_=d_: torch.neg(s_, out=d_) for s_, d_ in zip(src, dst)])
    del src, dst
    return res


if "layers" in ONLY:
    for H, B in ((H8, 64), (H1, 256), (H8, 256), (H1, 64)):
        try:
            pool_bytes = (B + 1) * H * K * K * 4
            L = max(4, min(32, math.ceil(2 * 1024**3 / pool_bytes)))
            layers = [kda_decode_inputs(B, H) for _ in range(L)]
            d0, sl0 = layers[0][0], layers[0][3]
            st0, cv0 = layers[0][1].clone(), layers[0][2].clone()   # pristine: the timed graphs update the pools
            ro, rS = torch_kda_decode(d0, st0.clone(), cv0.clone(), sl0, H)
            # other V tiles forced in the graph too (`_decode_block_v`): the latency-bound target shape, and 32 above
            # 1024 (token, head) items (the default there: 64)
            checks = [64, 16, 128] if (H, B) == (H8, 64) else [32] if B * H > 1024 else []

            def layer0_ok(block_v=None):
                st1 = st0.clone()
                with forced(kda_k, "_decode_block_v", block_v):
                    o1, _, _ = kda_k.kda_decode(**d0, state=st1, conv=cv0.clone(), slots=sl0, num_heads=H,
                                                head_dim=K)
                return rel(o1.float(), ro) < 2e-2 and rel(st1[sl0.long()], rS) < 1e-3
            if not (layer0_ok() and fam_ok.get("kda_decode", True)):   # no speed for a wrong kernel
                out(what="kda_decode_layers", H=H, B=B, correct=False)
                del layers
                continue
            outs = [torch.empty(B, H * K, dtype=torch.bfloat16, device=dev) for _ in range(L)]

            def ours():
                return [lambda d=d, st=st, cv=cv, sl=sl, o=o: kda_k.kda_decode(
                    **d, state=st, conv=cv, slots=sl, num_heads=H, head_dim=K, out=o)
                    for (d, st, cv, sl), o in zip(layers, outs)]

            def tiled_us(bv):       # captured with the tile forced: the graph keeps it
                with forced(kda_k, "_decode_block_v", bv):
                    return graph_us_per_call(ours())
            us = graph_us_per_call(ours())
            variants = {json.dumps(dict(block_v=bv)): tiled_us(bv) if layer0_ok(bv) else "wrong" for bv in checks}
            nbytes = kda_decode_bytes(B, H)
            rec = dict(what="kda_decode_layers", H=H, B=B, layers=L, correct=True, us=us, variants=variants,
                       bytes=nbytes, GBps=nbytes / us / 1e3, pct_copy=100 * nbytes / us / 1e3 / COPY)
            del layers, outs, st0, cv0
            if HAVE_FLA:
                try:
                    pl = [peer_kda_decode_call(B, H) for _ in range(L)]
                    rec.update(peer="fla fused_recurrent_kda (recurrence only)", peer_us=graph_us_per_call(pl))
                    rec["ratio"] = rec["peer_us"] / us
                    del pl
                except Exception as e:
                    rec["peer_error"] = repr(e)[:300]
            if HAVE_FLA_FULL:
                try:   # the whole step, layer 0 checked against the fp32 torch step first
                    ins = [kda_decode_inputs(B, H) for _ in range(L)]
                    d1, st1, cv1, sl1 = ins[0]
                    ro1, rS1 = torch_kda_decode(d1, st1.clone(), cv1.clone(), sl1, H)
                    stc = st1.clone()
                    po = peer_full_kda_decode_call(d1, stc, cv1, sl1, H)()
                    rec["peer_full_err"] = err = [rel(po.float(), ro1), rel(stc[sl1.long()], rS1)]
                    if err[0] < 2e-2 and err[1] < 2e-2:
                        pl = [peer_full_kda_decode_call(*x, H) for x in ins]
                        rec.update(peer_full=PEER_FULL, peer_full_us=graph_us_per_call(pl))
                        rec["ratio_full"] = rec["peer_full_us"] / us
                        del pl
                    del ins, stc
                except Exception as e:
                    rec["peer_full_error"] = repr(e)[:300]
            try:
                rec.update(floors_us=state_floors(B, H, L, nbytes))
            except Exception as e:
                rec["floors_error"] = repr(e)[:300]
            out(**rec)
        except Exception as e:
            out(what="kda_decode_layers", H=H, B=B, error=repr(e)[:400])
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ MLA decode
R, DR = CFG.kv_lora_rank, CFG.qk_rope_head_dim
MLA_SCALE = (CFG.qk_nope_head_dim + DR) ** -0.5


def mla_inputs(B, H, L, BS=64):
    MB = triton.cdiv(L + 1, BS)
    NB = B * MB + 1
    cache = torch.randn(NB, BS, R + DR, device=dev).bfloat16()
    bt = (torch.randperm(B * MB, device=dev) + 1).int().view(B, MB)
    ctx = torch.full((B,), L - 1, dtype=torch.int32, device=dev)
    q = torch.randn(B, H, R + DR, device=dev).bfloat16()
    lat = torch.randn(B, R + DR, device=dev).bfloat16()
    return q, lat, cache, bt, ctx


if "mla" in ONLY:
    for H, B, L in ((H8, 64, 32768), (H1, 64, 32768), (H8, 1, 32768), (H1, 1, 32768), (H8, 64, 8192),
                    (H1, 8, 32768), (H1, 64, 8192)):
        try:
            q, lat, cache, bt, ctx = mla_inputs(B, H, L)
            BS = cache.shape[1]
            scale = MLA_SCALE
            o, _ = mla_k.mla_decode(q, lat, cache, bt, ctx, num_heads=H, kv_lora_rank=R, scale=scale)
            # contiguous view of each sequence's L latents for the peer / check
            pos = torch.arange(L, device=dev)
            rows = (bt.long()[:, pos // BS] * BS + pos % BS)                     # [B, L]
            C = cache.view(-1, R + DR)[rows]                                     # [B, L, 576]

            def peer_fn():
                s = torch.bmm(q, C.transpose(1, 2)).float() * scale
                p = torch.softmax(s, -1).to(torch.bfloat16)
                return torch.bmm(p, C[:, :, :R])
            ref = torch.softmax(torch.bmm(q.float(), C.float().transpose(1, 2)) * scale, -1) @ C[:, :, :R].float() \
                if B * H * L <= 64 * 12 * 32768 else None
            err = rel(o.float(), ref) if ref is not None else rel(o.float(), peer_fn().float())
            ok = err < 1e-2 and fam_ok.get("mla_decode", True)
            del ref
            nbytes = B * L * (R + DR) * 2
            ms = bench(lambda: mla_k.mla_decode(q, lat, cache, bt, ctx, num_heads=H, kv_lora_rank=R, scale=scale),
                       rep=200) if ok else float("nan")
            peer = bench(peer_fn)
            graph = {}
            if B == 1 and ok:
                # B=1 in CUDA graphs (no host launch time): 8 calls, each on its own sequence and cache (8 x 38 MB,
                # so no call finds its latents in the 50 MB L2), per-call time; the peer likewise on contiguous copies
                ins = [(q, lat, cache, bt, ctx)] + [mla_inputs(B, H, L) for _ in range(7)]
                conts = [C] + [x[2].view(-1, R + DR)[(x[3].long()[:, pos // BS] * BS + pos % BS)] for x in ins[1:]]
                graph["us"] = graph_us_per_call([lambda x=x: mla_k.mla_decode(*x, num_heads=H, kv_lora_rank=R,
                                                                              scale=scale) for x in ins])

                def peer_of(qq, cc):
                    p = torch.softmax(torch.bmm(qq, cc.transpose(1, 2)).float() * scale, -1).to(torch.bfloat16)
                    return torch.bmm(p, cc[:, :, :R])
                graph["peer_us"] = graph_us_per_call([lambda x=x, cc=cc: peer_of(x[0], cc)
                                                      for x, cc in zip(ins, conts)])
                graph["ratio"] = graph["peer_us"] / graph["us"]
                del ins, conts
            out(what="mla_decode", H=H, B=B, L=L, correct=ok, err=err, us=ms * 1e3, cuda_graph=graph,
                peer="torch bmm-softmax-bmm (contiguous cache)", peer_us=peer * 1e3,
                ratio=peer / ms, bytes=nbytes, GBps=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / COPY)
            del q, lat, cache, C
        except Exception as e:
            out(what="mla_decode", H=H, B=B, L=L, error=repr(e)[:400])
    torch.cuda.empty_cache()

# ------------------------------------------------------------------ CUDA graph decode step (one KDA + one MLA layer, B=1)
# `us` ("cold"): one graph of N_STEP decode steps, each a KDA layer + an MLA layer (8192-token context) on pools of
# its own, as in a model whose layers each own their pools: a replay touches each pool once and do_bench clears L2
# before each replay, so no step finds its state or latents in L2; per step = replay / N_STEP. `us_hot`: 100 replays
# of one step's graph over the same pools per timed run (after the first, its 1.5-12 MB of pools are in L2).
# Checked first: the first KDA step against the fp32 torch step, the first MLA step against fp32 attention over its
# cache.
N_STEP = 8


def mla_fp32_ref(q, cache, bt, L):
    """fp32 softmax(q·Cᵀ·scale)·C[:, :, :R] over the first L latents of each sequence's blocks ([B, H, R])."""
    BS = cache.shape[1]
    pos = torch.arange(L, device=dev)
    C = cache.view(-1, R + DR)[bt.long()[:, pos // BS] * BS + pos % BS].float()
    return torch.softmax(torch.bmm(q.float(), C.transpose(1, 2)) * MLA_SCALE, -1) @ C[:, :, :R]


if "graph" in ONLY:
    for H in (H8, H1):
        try:
            kins = [kda_decode_inputs(1, H) for _ in range(N_STEP)]
            mins = [mla_inputs(1, H, 8192) for _ in range(N_STEP)]
            d, state, conv, slots = kins[0]
            st0, cv0 = state.clone(), conv.clone()   # pristine: the timed graphs update the pools
            ro, rS = torch_kda_decode(d, st0.clone(), cv0.clone(), slots, H)
            st = st0.clone()
            o1, _, _ = kda_k.kda_decode(**d, state=st, conv=cv0.clone(), slots=slots, num_heads=H, head_dim=K)
            q, lat, cache, bt, ctx = mins[0]
            cc = cache.clone()
            o2, _ = mla_k.mla_decode(q, lat, cc, bt, ctx, num_heads=H, kv_lora_rank=R, scale=MLA_SCALE)
            err_kda = [rel(o1.float(), ro), rel(st[slots.long()], rS)]
            err_mla = rel(o2.float(), mla_fp32_ref(q, cc, bt, int(ctx[0]) + 1))
            ok = err_kda[0] < 2e-2 and err_kda[1] < 1e-3 and err_mla < 1e-2
            del st, cc
            kouts = [torch.empty(1, H * K, dtype=torch.bfloat16, device=dev) for _ in range(N_STEP)]
            mouts = [torch.empty(1, H, R, dtype=torch.bfloat16, device=dev) for _ in range(N_STEP)]
            kda_steps = [lambda x=x, o=o: kda_k.kda_decode(**x[0], state=x[1], conv=x[2], slots=x[3], num_heads=H,
                                                           head_dim=K, out=o) for x, o in zip(kins, kouts)]
            mla_steps = [lambda x=x, o=o: mla_k.mla_decode(*x, num_heads=H, kv_lora_rank=R, scale=MLA_SCALE, out=o)
                         for x, o in zip(mins, mouts)]
            both = [f for pair in zip(kda_steps, mla_steps) for f in pair]
            us, us_hot = {}, {}
            for name, calls in (("kda", kda_steps), ("mla_L8192", mla_steps), ("kda+mla", both)):
                if ok:
                    us[name] = bench(capture_graph(calls).replay, rep=100) * 1e3 / N_STEP
                    gph = capture_graph(calls[:len(calls) // N_STEP], warmup=3)
                    n = 100   # 100 replays of the one step
                    us_hot[name] = bench(lambda: [gph.replay() for _ in range(n)], rep=300) / n * 1e3
            # the KDA step's V tile forced (`_decode_block_v`), cold
            kda_variants = {}
            for bv in (16, 32, 64, 128):
                st = st0.clone()
                with forced(kda_k, "_decode_block_v", bv):
                    o3, _, _ = kda_k.kda_decode(**d, state=st, conv=cv0.clone(), slots=slots, num_heads=H,
                                                head_dim=K)
                    if ok and rel(o3.float(), ro) < 2e-2 and rel(st[slots.long()], rS) < 1e-3:
                        kda_variants[f"block_v={bv}"] = bench(capture_graph(
                            [lambda x=x, o=o: kda_k.kda_decode(**x[0], state=x[1], conv=x[2], slots=x[3],
                                                               num_heads=H, head_dim=K, out=o)
                             for x, o in zip(kins, kouts)]).replay, rep=100) * 1e3 / N_STEP
            out(what="cuda_graph_decode_step", H=H, B=1, L=8192, correct=ok, err_kda=err_kda, err_mla=err_mla,
                us=us, us_hot=us_hot, kda_variants=kda_variants, steps_per_graph=N_STEP)
            del kins, mins, kouts, mouts, kda_steps, mla_steps, both
        except Exception as e:
            out(what="cuda_graph_decode_step", H=H, error=repr(e)[:400])
    torch.cuda.empty_cache()

# ------------------------------------------------------------------ MLA prefill: SDPA vs the graph-safe Triton path
# `mla_prefill`'s CUDA default, the graph-safe path (absorbed Triton kernels, fixed grids, workspace: also what CUDA
# graphs and the TensorRT plugin run), against graph_safe=False (per sequence, up-projected K/V, torch SDPA; reads
# cu_seqlens on the host), one prompt of T tokens without prefix, one
# with a 4096-token prefix in the paged cache, and a 256-token chunk after 32768 cached tokens (a long prompt's chunked
# prefill at the runtime's default step budget, max_num_tokens=256).
if "mla_prefill" in ONLY:
    for H, T, C in ((H8, 4096, 0), (H1, 4096, 0), (H8, 2048, 4096), (H1, 2048, 4096), (H8, 256, 4096),
                    (H8, 256, 32768), (H1, 256, 32768)):
        try:
            Dn, Dv = CFG.qk_nope_head_dim, CFG.v_head_dim
            BS = 64
            MB = triton.cdiv(C + T, BS)
            cache = torch.randn(MB + 1, BS, R + DR, device=dev).bfloat16()
            bt = (torch.randperm(MB, device=dev) + 1).int().view(1, MB)
            cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
            ctx = torch.tensor([C], dtype=torch.int32, device=dev)
            q = torch.randn(T, H, Dn + DR, device=dev).bfloat16()
            lat = torch.randn(T, R + DR, device=dev).bfloat16()
            kv_b = (torch.randn(H * (Dn + Dv), R, device=dev) * R ** -0.5).bfloat16()
            attrs = dict(num_heads=H, qk_nope_head_dim=Dn, v_head_dim=Dv, kv_lora_rank=R, scale=(Dn + DR) ** -0.5)
            ws = torch.empty(mla_k.mla_prefill_workspace_bytes(T, H, R, DR), dtype=torch.uint8, device=dev)
            sdpa = lambda: mla_k.mla_prefill(q, lat, kv_b, cache, bt, cu, ctx, graph_safe=False, **attrs)   # noqa: E731
            tri = lambda: mla_k.mla_prefill(q, lat, kv_b, cache, bt, cu, ctx, graph_safe=True, workspace=ws,  # noqa: E731
                                            **attrs)
            o_tri = tri()[0].float()
            err = rel(o_tri, sdpa()[0].float())
            ok = fam_ok.get("mla_prefill", True) and err < 3e-2
            us_sdpa, us_tri = bench(sdpa, rep=100) * 1e3, bench(tri, rep=100) * 1e3
            variants = {}
            if T == 256:   # the 256-token chunks: the key-range split (`_prefill_splits`) against one part
                with forced(mla_k, "_prefill_splits", 1):
                    variants['{"num_splits": 1}'] = (bench(tri, rep=100) * 1e3
                                                     if rel(tri()[0].float(), o_tri) < 1e-2 else "wrong")
            # attention FLOPs (absorbed: q.k over R + DR, p.v over R), row t sees C + t + 1 keys
            flops = 2 * H * (T * C + T * (T + 1) // 2) * (2 * R + DR)
            bm = mla_k._prefill_attn_tiles(torch.cuda.get_device_capability()[0], 2, BS)[0]
            out(what="mla_prefill", H=H, T=T, context=C, correct=ok, err_triton_vs_sdpa=err,
                num_splits=mla_k._prefill_splits(triton.cdiv(T * H, bm), mla_k.num_sms(dev), MB * BS),
                us=us_tri if ok else float("nan"), path="graph_safe=True (absorbed Triton, the CUDA default)",
                peer="graph_safe=False (per-sequence up-projected K/V + torch SDPA)", peer_us=us_sdpa,
                ratio=us_sdpa / us_tri if ok else float("nan"), variants=variants,
                attn_TFLOPs=flops / us_tri / 1e6 if ok else float("nan"))
            del cache, q, lat, kv_b, ws
        except Exception as e:
            out(what="mla_prefill", H=H, T=T, error=repr(e)[:400])

# ------------------------------------------------------------------ MoE
# MoE: the default (`_pick_impl`: the Gluon kernels for decode-sized batches of >= 64 pairs on sm_90+,
# plugins/moe/kernels_gluon.py, else the legacy Triton kernels) and each set of kernels forced, timed side by side
MOE_VARIANTS = {"{}": None, '{"impl": "legacy"}': "legacy", '{"impl": "gluon"}': "gluon"}


def bench_moe(E: int) -> None:
    """The MoE family for E local experts (112: K3 at TP=8 / EP=8; 64: k3-slice at TP=1; 896: K3 at TP=1) of
    3584 -> 3072, top-16: ours (default and MOE_VARIANTS) and the bf16 peer at each of MOE_TOKENS, one JSON line
    per T (an error record when the family fails, e.g. out of memory)."""
    D, I = CFG.routed_expert_hidden_size, CFG.moe_intermediate_size
    try:
        w13p = torch.randint(0, 256, (E, 2 * I, D // 2), device=dev, dtype=torch.uint8)
        w13s = torch.randint(118, 126, (E, 2 * I, D // 32), device=dev, dtype=torch.uint8)
        w2p = torch.randint(0, 256, (E, D, I // 2), device=dev, dtype=torch.uint8)
        w2s = torch.randint(118, 126, (E, D, I // 32), device=dev, dtype=torch.uint8)
        lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], device=dev, dtype=torch.bfloat16)

        def deq(p, s):
            w = torch.stack([lut[(p & 15).long()], lut[(p >> 4).long()]], -1).flatten(-2)
            return w * torch.exp2(s.float() - 127).to(torch.bfloat16).repeat_interleave(32, -1)
        w13 = torch.cat([deq(w13p[i:i + 16], w13s[i:i + 16]) for i in range(0, E, 16)])
        w2 = torch.cat([deq(w2p[i:i + 16], w2s[i:i + 16]) for i in range(0, E, 16)])

        def situ(g, u):
            return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
        NG = max(MOE_GLOBAL, E)      # routed experts over all EP ranks; this rank holds experts 0 .. E-1
        for T in MOE_TOKENS:
            xl = torch.randn(T, D, device=dev, dtype=torch.bfloat16) * 0.1
            ids = torch.stack([torch.randperm(NG, device=dev)[:KK] for _ in range(T)]).int()
            wts = torch.rand(T, KK, device=dev)
            flat = ids.reshape(-1).long()
            mine = torch.nonzero(flat < E).squeeze(1)         # the (token, choice) pairs of this rank's experts
            touched = torch.unique(flat[mine]).numel()
            order = mine[torch.argsort(flat[mine])]; counts = torch.bincount(flat[mine], minlength=E)
            offs = torch.cumsum(counts, 0).to(torch.int32); tok = order // KK

            def grouped():
                a = xl[tok]
                h = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)
                g = situ(h[:, :I].float(), h[:, I:].float()).to(torch.bfloat16)
                o = torch._grouped_mm(g, w2.transpose(1, 2), offs=offs)
                yy = torch.zeros(T, D, device=dev, dtype=torch.float32)
                yy.index_add_(0, tok, o.float() * wts.reshape(-1)[order][:, None]); return yy
            ref = grouped()
            yk = moe_k.mxfp4_moe(xl, ids, wts, w13p, w13s, w2p, w2s, num_experts=NG)
            err = rel(yk, ref)
            ok = err < 2e-2 and fam_ok.get("mxfp4_moe", True)
            mx_bytes = touched * (2 * I * (D // 2 + D // 32) + D * (I // 2 + I // 32))
            bf_bytes = touched * 3 * D * I * 2
            res = {}
            fns = {}
            call = lambda: moe_k.mxfp4_moe(xl, ids, wts, w13p, w13s, w2p, w2s, num_experts=NG)   # noqa: E731
            for name, impl in (MOE_VARIANTS.items() if ok else ()):   # each checked once, then timed in rounds
                try:
                    with forced(moe_k, "_pick_impl", impl):
                        y2 = call()
                    if rel(y2, ref) > 2e-2:
                        res[name] = "mismatch"; continue
                    fns[name] = impl
                except Exception as e:
                    res[name] = repr(e)[:200]
            # ROUNDS interleaved rounds over the variants, median per variant (one pass of the same code varies
            # between its place in the list and between calls)
            times = {name: [] for name in fns}
            for _ in range(ROUNDS):
                for name, impl in list(fns.items()):
                    try:
                        with forced(moe_k, "_pick_impl", impl):
                            times[name].append(bench(call, rep=50) * 1e3)
                    except Exception as e:     # e.g. out of memory: this variant drops out, the others go on
                        res[name] = repr(e)[:200]
                        del fns[name], times[name]
            spreads = {name: [min(ts), max(ts)] for name, ts in times.items()}
            for name, ts in times.items():
                res[name] = statistics.median(ts)
            best = min(((statistics.median(ts), json.loads(n)) for n, ts in times.items()), default=None,
                       key=lambda b: b[0])
            us_default = res.get("{}") if isinstance(res.get("{}"), float) else float("nan")
            ms = us_default / 1e3
            peer = bench(grouped, rep=100)
            out(what="mxfp4_moe", T=T, experts=E, global_experts=NG, local_pairs=int(mine.numel()),
                experts_touched=touched, correct=ok, err=err, us=ms * 1e3,
                variants=res, spreads=spreads, rounds=ROUNDS, best=best[1] if best else None,
                us_best=best[0] if best else None,
                peer="bf16 dequantized weights + torch._grouped_mm", peer_us=peer * 1e3,
                ratio=peer / ms, bytes=mx_bytes, GBps=mx_bytes / ms / 1e6, pct_copy=100 * mx_bytes / ms / 1e6 / COPY,
                peer_pct_copy=100 * bf_bytes / peer / 1e6 / COPY)
    except Exception as e:
        out(what="mxfp4_moe", experts=E, error=repr(e)[:400])


if "moe" in ONLY:
    for E_ in MOE_EXPERTS:
        bench_moe(E_)
        torch.cuda.empty_cache()        # its weights (~75 GB at 896 experts) go back before the next count

# ------------------------------------------------------------------ MoE router (after its fp32 logits GEMM)
# K3's router over all 896 routed experts, top-16 (MODEL.md §7.2): our Triton `_route_kernel` (one program per token)
# against the torch reference path (`reference.route_logits`: sigmoid, add, topk, gather, renormalize), both eager
# (host-bound at these sizes) and as one call in a CUDA graph (the decode step's setting).
if "router" in ONLY:
    NE = load_config("k3").num_experts      # the router scores every routed expert of the full model (K3: 896)
    for T in (1, 64, 256):
        try:
            z = torch.randn(T, NE, device=dev)
            bias = 0.1 * torch.randn(NE, device=dev)
            kw = dict(top_k=KK, routed_scaling_factor=1.0)      # K3's config (its scaling 2.827 costs nothing more)
            ids, w = moe_k.route_topk(z, bias, **kw)
            pids, pw = torch.empty_like(ids), torch.empty_like(w)

            def peer():
                rids, rw = route_logits(z, bias, top_k=KK, num_expert_group=1, topk_group=1, renormalize=True,
                                        scaling=1.0)
                return pids.copy_(rids), pw.copy_(rw)
            rids, rw = peer()
            ok = bool(torch.equal(ids, rids)) and rel(w, rw) < 1e-6 and fam_ok.get("router", True)
            ours = lambda: moe_k.route_topk(z, bias, out=(ids, w), **kw)     # noqa: E731
            us, peer_us = bench(ours) * 1e3, bench(peer) * 1e3
            g_us, g_peer = graph_us_per_call([ours] * 16), graph_us_per_call([peer] * 16)   # 16 calls per graph
            out(what="moe_router", T=T, experts=NE, top_k=KK, correct=ok, us=us if ok else float("nan"),
                peer="torch (reference.route_logits, then copies into int32 ids / fp32 weights)", peer_us=peer_us, ratio=peer_us / us,
                graph_us=g_us if ok else float("nan"), graph_peer_us=g_peer, graph_ratio=g_peer / g_us)
        except Exception as e:
            out(what="moe_router", T=T, error=repr(e)[:400])

# ------------------------------------------------------------------ KDA prefill
def graphed(fn):
    """fn captured in a CUDA graph (after two warm-up calls on a side stream): returns the replay; an error at
    capture is returned as the stage's value by the caller's try."""
    s_ = torch.cuda.Stream()
    s_.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s_):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s_)
    g_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_):
        fn()
    return g_.replay


if "kda_prefill" in ONLY and HAVE_FLA:
    for H in PREFILL_HEADS:
        try:
            T = 32768
            P = H * K
            d = dict(qkv=torch.randn(T, 3 * P, device=dev).bfloat16(), f=torch.randn(T, P, device=dev).bfloat16(),
                     b=torch.randn(T, H, device=dev).bfloat16(), g=torch.randn(T, P, device=dev).bfloat16(),
                     conv_w=torch.randn(3 * P, 4, device=dev) * 0.5, A_log=torch.randn(H, device=dev) * 0.5,
                     dt_bias=torch.randn(P, device=dev) * 0.3, o_norm_w=torch.rand(K, device=dev) + 0.5)
            state = torch.zeros(3, H, K, K, device=dev); conv = torch.zeros(3, 3 * P, 3, device=dev).bfloat16()
            cu = torch.tensor([0, T], dtype=torch.int32, device=dev); slots = torch.tensor([2], dtype=torch.int32, device=dev)
            # in-script check at the bench shape (the fp32 reference is too slow at T=32768; pytest checks every
            # path against it): the one-sequence call (chunk_kda's dense path) against the same prompt in two
            # calls, the second through the varlen graph-safe path with a one-token sequence packed behind it
            state.zero_(); conv.zero_()
            o_one = kda_k.kda_prefill(**d, state=state, conv=conv, cu_seqlens=cu, slots=slots, num_heads=H,
                                      head_dim=K)[0].clone()
            s_one = state[2].clone()
            state.zero_(); conv.zero_()
            h = T // 2
            part = lambda a, b: {k_: (v_[a:b] if v_.shape[0] == T else v_) for k_, v_ in d.items()}
            kda_k.kda_prefill(**part(0, h), state=state, conv=conv, cu_seqlens=torch.tensor([0, h], dtype=torch.int32,
                              device=dev), slots=slots, num_heads=H, head_dim=K)
            if args.prefill_breakdown:
                d2 = {k_: (torch.cat([v_[h:], v_[:1]]) if v_.shape[0] == T else v_) for k_, v_ in d.items()}
                cu2, sl2 = [0, T - h, T - h + 1], [2, 1]
            else:   # dense only (no varlen combination to autotune): the second half as one sequence
                d2, cu2, sl2 = part(h, T), [0, T - h], [2]
            o_two = kda_k.kda_prefill(**d2, state=state, conv=conv, cu_seqlens=torch.tensor(cu2, dtype=torch.int32,
                                      device=dev), slots=torch.tensor(sl2, dtype=torch.int32, device=dev),
                                      num_heads=H, head_dim=K)[0]
            err = max(rel(o_two[:T - h].float(), o_one[h:].float()), rel(state[2], s_one))
            del o_one, o_two, d2
            ok = fam_ok.get("kda_prefill", True) and err < 1e-2
            fn = lambda: kda_k.kda_prefill(**d, state=state, conv=conv, cu_seqlens=cu, slots=slots, num_heads=H, head_dim=K)
            ms = bench(fn, rep=100) if ok else float("nan")
            q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
            kk = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
            v = torch.randn(1, T, H, K, device=dev).bfloat16()
            gg = (-5.0 * torch.sigmoid(torch.randn(1, T, H, K, device=dev))).float()
            be = torch.sigmoid(torch.randn(1, T, H, device=dev)).bfloat16()
            h0 = torch.zeros(1, H, K, K, device=dev)
            peer = bench(lambda: chunk_kda(q, kk, v, gg, be, initial_state=h0, output_final_state=True), rep=100)
            # where our time goes: chunk_kda alone under each of our flags, on the same inputs
            fr = torch.randn(1, T, H, K, device=dev).bfloat16(); br = torch.randn(1, T, H, device=dev).bfloat16()
            alog, dtb = d["A_log"], d["dt_bias"]
            cu64 = cu.long()
            be32 = be.float()
            ours_kw = dict(initial_state=h0, output_final_state=True, use_gate_in_kernel=True, A_log=alog, dt_bias=dtb,
                           safe_gate=True, lower_bound=-5.0, state_v_first=True, cu_seqlens=cu64)

            def ours_call(beta, **kw):   # chunk_kda under our op's flags (ours_kw), some of them overridden
                return lambda: chunk_kda(q, kk, v, fr, beta, **{**ours_kw, **kw})
            stages = {} if not args.prefill_breakdown else {
                "pregated_safe_gate": lambda: chunk_kda(q, kk, v, gg, be, initial_state=h0, output_final_state=True,
                                                        safe_gate=True, lower_bound=-5.0),
                "gate_in_kernel_safe": lambda: chunk_kda(q, kk, v, fr, be, initial_state=h0, output_final_state=True,
                                                         use_gate_in_kernel=True, A_log=alog, dt_bias=dtb,
                                                         safe_gate=True, lower_bound=-5.0),
                "ours_flags": ours_call(br, use_beta_sigmoid_in_kernel=True),
                "pregated_varlen": lambda: chunk_kda(q, kk, v, gg, be, initial_state=h0, output_final_state=True,
                                                     cu_seqlens=cu64),
                "ours_flags_k_first": ours_call(br, use_beta_sigmoid_in_kernel=True, state_v_first=False),
                "ours_flags_no_beta_sigmoid": ours_call(be),
                # is the beta-sigmoid cost fp32 beta itself? is varlen the spread?
                "ours_flags_fp32_beta_pre": ours_call(be32),
                "ours_flags_no_varlen": ours_call(br, use_beta_sigmoid_in_kernel=True, cu_seqlens=None),
                "ours_flags_bf16_beta_no_varlen": ours_call(be, cu_seqlens=None),
            }
            # our own passes alone
            y = torch.empty(3, T, P, dtype=torch.bfloat16, device=dev)
            stages["our_conv_pass"] = lambda: kda_k._conv_prefill(d["qkv"], d["conv_w"], conv, slots, cu, y, T,
                                                                  3 * P, P, K)
            # the same T as 256 prompts of 128 tokens: 256 sequence starts for the fix-up kernel
            cu_m = torch.arange(0, T + 1, 128, device=dev).int()
            slots_m = torch.full((T // 128,), 2, dtype=torch.int32, device=dev)
            stages["our_conv_pass_256x128"] = lambda: kda_k._conv_prefill(d["qkv"], d["conv_w"], conv, slots_m, cu_m,
                                                                          y, T, 3 * P, P, K)
            # our op through the varlen path: the same tokens as two sequences (T - 1 and 1 tokens)
            cu2 = torch.tensor([0, T - 1, T], dtype=torch.int32, device=dev)
            sl2 = torch.tensor([2, 1], dtype=torch.int32, device=dev)
            if args.prefill_breakdown:
                stages["ours_varlen_2seq"] = lambda: kda_k.kda_prefill(**d, state=state, conv=conv, cu_seqlens=cu2,
                                                                       slots=sl2, num_heads=H, head_dim=K)

            def chunk_kda_fallback():
                """our op with fla's whole chunk_kda in place of our chunk core (its fallback for untested fla-core
                versions: `_fla_stages` None)"""
                with mock.patch.object(kda_k, "_fla_stages", lambda: None):
                    return kda_k.kda_prefill(**d, state=state, conv=conv, cu_seqlens=cu, slots=slots, num_heads=H,
                                             head_dim=K)
            stages["ours_chunk_kda_fallback"] = chunk_kda_fallback
            # both captured in CUDA graphs (no Python launch overhead: the GPU time of our op vs the peer's)
            to_graph = {"ours_cuda_graph": fn,
                        "peer_cuda_graph": lambda: chunk_kda(q, kk, v, gg, be, initial_state=h0, output_final_state=True)}
            stages.update(to_graph)
            o_n = torch.randn(T, H, K, device=dev).bfloat16(); out_n = torch.empty(T, P, device=dev).bfloat16()
            stages["our_norm_pass"] = lambda: kda_k._gated_norm_kernel[(triton.cdiv(T, 16), H)](
                o_n, d["g"], d["o_norm_w"], out_n, T, d["g"].stride(0), out_n.stride(0), 1e-5, H=H, K=K, BT=16,
                num_warps=4)
            breakdown = {}
            for name, fn_s in stages.items():
                try:
                    fn_s = graphed(fn_s) if name in to_graph else fn_s
                    fn_s()
                    breakdown[name] = bench(fn_s, rep=100) * 1e3
                except Exception as e:
                    breakdown[name] = repr(e)[:200]
            og, pg = breakdown.get("ours_cuda_graph"), breakdown.get("peer_cuda_graph")
            graph_ratio = pg / og if ok and isinstance(og, float) and isinstance(pg, float) else None
            # compulsory HBM bytes: the op's activations in (qkv, f, b, g) and out (bf16 [T, P]), the fp32 state read
            # and written once (prefill is compute-bound: the fraction of copy shows how far from the memory roof)
            nbytes = sum(d[k_].numel() * d[k_].element_size() for k_ in ("qkv", "f", "b", "g")) + T * P * 2 \
                + 2 * H * K * K * 4
            out(what="kda_prefill", H=H, T=T, correct=ok, err_one_vs_split_varlen=err,
                conv_cfg=dict(BT=kda_k._CONV_BT, num_warps=kda_k._CONV_WARPS), out_cfg=kda_k._OUT_CFG, us=ms * 1e3,
                peer="fla chunk_kda (recurrence only, pre-gated)",
                peer_us=peer * 1e3, ratio=peer / ms, ratio_cuda_graphs=graph_ratio, Mtok_per_s=T / ms / 1e3,
                bytes=nbytes, GBps=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / COPY,
                chunk_kda_us_by_flags=breakdown)
            del d, q, kk, v, gg
        except Exception as e:
            out(what="kda_prefill", H=H, error=repr(e)[:400])

# ------------------------------------------------------------------ AOT prefill chains (build_engines.py --aot)
# The chains of single-launch ops an --aot engine runs for KdaPrefill / MlaPrefill (plugins/*/trt_aot_prefill.py),
# launched by Triton with the same configs as their PTX, vs the JIT ops; both captured in CUDA graphs (GPU time).
if "aot_prefill" in ONLY:
    from onnx import helper as onnx_helper
    from k3deploy.plugins import aot_ops
    from k3deploy.plugins.kda import trt_aot_prefill as kda_pre
    from k3deploy.plugins.mla import trt_aot_prefill as mla_pre

    def chain(mod, op_type, names, outs, env, **attrs):
        node = onnx_helper.make_node(op_type, list(names), list(outs), name="n0", domain="kimi", **attrs)
        model = onnx_helper.make_model(onnx_helper.make_graph([node], "g", [], []))
        getattr(mod, f"decompose_{op_type[:3].lower()}_prefill")(model)
        ops = {op.name: op for op in mod.OPS.values()}
        return lambda: aot_ops.run_nodes(model.graph.node, dict(env), ops), model.graph.node, ops

    def per_op_us(nodes, ops, env):
        """GPU time of each node of the chain alone (CUDA graphs), on the tensors of one full run (env)."""
        res = {}
        for nd in nodes:
            op = ops[nd.op_type]
            attrs = {a_.name: onnx_helper.get_attribute_value(a_) for a_ in nd.attribute if a_.name in dict(op.attrs)}
            ins = {n_: env[i_] for (n_, _), i_ in zip(op.inputs, nd.input)}
            try:
                res[op.name] = bench(graphed(lambda: aot_ops.run_op(op, ins, attrs)), rep=50) * 1e3
            except Exception as e:
                res[op.name] = repr(e)[:120]
        return res

    for H in PREFILL_HEADS:
        if not (kda_pre.ENTRY and HAVE_FLA):
            out(what="aot_kda_prefill", H=H, error="needs fla-core 0.6.0"); break
        try:
            T, P = 32768, H * K
            d = dict(qkv=torch.randn(T, 3 * P, device=dev).bfloat16(), f=torch.randn(T, P, device=dev).bfloat16(),
                     b=torch.randn(T, H, device=dev).bfloat16(), g=torch.randn(T, P, device=dev).bfloat16(),
                     conv_w=torch.randn(3 * P, 4, device=dev) * 0.5, A_log=torch.randn(H, device=dev) * 0.5,
                     dt_bias=torch.randn(P, device=dev) * 0.3, o_norm_w=torch.rand(K, device=dev) + 0.5,
                     state=torch.zeros(3, H, K, K, device=dev), conv=torch.zeros(3, 3 * P, 3, device=dev).bfloat16(),
                     cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=dev),
                     slots=torch.tensor([2], dtype=torch.int32, device=dev))
            run, nodes, ops = chain(kda_pre, "KdaPrefill", d, ("out", "state_out", "conv_out"), d, num_heads=H,
                                    head_dim=K, lower_bound=-5.0, norm_eps=1e-5)
            env = run()
            o_aot = env["out"].clone()
            s_aot = d["state"][2].clone()
            d["state"].zero_(); d["conv"].zero_()
            jit = lambda: kda_k.kda_prefill(**d, num_heads=H, head_dim=K)
            o_jit = jit()[0].clone()
            err = max(rel(o_aot.float(), o_jit.float()), rel(s_aot, d["state"][2]))
            ok = err < 2e-2
            res = {n_: bench(graphed(f_), rep=100) * 1e3 for n_, f_ in (("aot_chain", run), ("jit", jit))} if ok else {}
            out(what="aot_kda_prefill", H=H, T=T, correct=ok, err_vs_jit=err, us=res.get("aot_chain"),
                jit_us=res.get("jit"), ratio=res["jit"] / res["aot_chain"] if ok else None, note="CUDA graphs",
                per_op_us=per_op_us(nodes, ops, env) if ok else None)
            del d, o_aot, o_jit, env
        except Exception as e:
            out(what="aot_kda_prefill", H=H, error=repr(e)[:400])
    for H in PREFILL_HEADS:
        try:
            T, BS, Dn, Dv = 4096, 64, CFG.qk_nope_head_dim, CFG.v_head_dim
            MB = T // BS + 1
            m = dict(q=torch.randn(T, H, Dn + DR, device=dev).bfloat16(),
                     latent=torch.randn(T, R + DR, device=dev).bfloat16(),
                     kv_b=(torch.randn(H * (Dn + Dv), R, device=dev) * R ** -0.5).bfloat16(),
                     cache=torch.zeros(MB + 1, BS, R + DR, device=dev).bfloat16(),
                     block_tables=(torch.arange(MB, device=dev) + 1).int().view(1, MB),
                     cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=dev),
                     context_lens=torch.tensor([0], dtype=torch.int32, device=dev))
            attrs = dict(num_heads=H, qk_nope_head_dim=Dn, v_head_dim=Dv, kv_lora_rank=R, scale=(Dn + DR) ** -0.5)
            run, nodes, ops = chain(mla_pre, "MlaPrefill", m, ("out", "cache_out"), m, **attrs)
            jit = lambda: mla_k.mla_prefill(*m.values(), graph_safe=True, **attrs)
            env = run()
            err = rel(env["out"].float(), jit()[0].float())
            ok = err < 2e-2
            res = {n_: bench(graphed(f_), rep=100) * 1e3 for n_, f_ in (("aot_chain", run), ("jit", jit))} if ok else {}
            out(what="aot_mla_prefill", H=H, T=T, correct=ok, err_vs_jit=err, us=res.get("aot_chain"),
                jit_us=res.get("jit"), ratio=res["jit"] / res["aot_chain"] if ok else None, note="CUDA graphs",
                per_op_us=per_op_us(nodes, ops, env) if ok else None)
            del m, env
        except Exception as e:
            out(what="aot_mla_prefill", H=H, error=repr(e)[:400])
    torch.cuda.empty_cache()

# ------------------------------------------------------------------ plot
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in RECS if "pct_copy" in r and r.get("correct") and r.get("us") == r.get("us")]
    fig, ax = plt.subplots(figsize=(10, 5))
    labels = []
    for r in rows:
        keys = ("H", "B", "L", "T", "experts")
        lab = r["what"] + " " + ",".join(f"{k}={r[k]}" for k in keys if k in r)
        labels.append(lab)
    ax.barh(range(len(rows)), [r["pct_copy"] for r in rows])
    ax.axvline(100, color="k", ls="--", lw=1); ax.axvline(85, color="g", ls=":", lw=1); ax.axvline(70, color="r", ls=":", lw=1)
    ax.set_yticks(range(len(rows))); ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel(f"% of measured copy bandwidth ({COPY / 1e3:.2f} TB/s), bytes = compulsory HBM traffic")
    ax.set_title("k3deploy Triton kernels on H200: memory roofline fraction")
    fig.tight_layout(); fig.savefig(os.path.join(os.path.dirname(args.out), "roofline.png"), dpi=110)
except Exception as e:
    print("plot failed", repr(e))
print("DONE", flush=True)
