#!/usr/bin/env bash
# Tests and benchmarks on a GPU machine (written for the project's H200 image: the system python3 with
# torch 2.11+cu130 and triton 3.6, no network; not .venv). From the repo root:
#   bash benchmarks/gpu_run.sh tests|bench|profile|ncu|decode|tp|fused   (results under $OUT, default /tmp/out)
# tests : GPU pytest of the kernels, CUDA-graph capture and the GPU runtime -> $OUT/junit.xml, $OUT/pytest.log
#         (PYTEST_ARGS overrides the files; it is re-parsed by the shell: PYTEST_ARGS='tests/a.py -k "x and not y"')
#         On a fresh H200 the default files take more than 10 minutes (tests/plugins/test_kernels.py alone: ~90 of
#         its GPU tests in 570 s, compiles and fla autotuning included): split them with PYTEST_ARGS
# bench : benchmarks/bench_kernels.py (KDA decode/prefill, graph, MLA, MoE) -> $OUT/bench.jsonl + roofline.png
# profile: benchmarks/profile_kda_prefill.py: per-kernel GPU time of KDA prefill, ours vs chunk_kda -> $OUT/profile.jsonl
#         (PROFILE_ARGS overrides its arguments)
# ncu   : Nsight Compute on the MXFP4 MoE GEMMs at boost clocks, T in NCU_TOKENS (default "64 1"), configurations
#         NCU_IMPLS (default legacy,gluon), NCU_EXPERTS local experts (default 112; 64: k3-slice)
#         -> $OUT/ncu_moe_T<T>.txt + $OUT/ncu_summary.jsonl
# decode: benchmarks/bench_decode.py on k3-slice, B=16 (synthetic weights on the device; DECODE_ARGS overrides)
# tp    : (several GPUs) bench_decode TP=1 on cuda:0 saved, then TP=EP=N over NCCL for N = 2, 4, .. <= GPUs compared
#         with it (logits, greedy tokens) -> $OUT/decode_tp.jsonl (TP_ARGS overrides the model/run arguments)
# fused : the fused decode path: the GPU tests of the fused glue and the overlapped steps (-> junit.xml, pytest.log;
#         ~150 s with .autotune/tests carried), k3-slice fused vs unfused at B=1/16/64 and 4K prompts (-> decode.jsonl;
#         ~45 s per batch size after a 25 s prefill, more at B=64), k3-tp8-rank at B=1/16/64 (1K prompts) and TTFT
#         8K / 32K (-> rank.jsonl; more than 190 s; fla configs reused across shapes: benchmarks/fla_configs.py);
#         each part has its own timeout (FUSED_TESTS_TIMEOUT, FUSED_SLICE_TIMEOUT, FUSED_RANK_TIMEOUT); FUSED_PARTS
#         (default "tests slice rank") picks parts, FUSED_BATCH (default 1,16,64) the k3-slice batch sizes
# fla-core travels as a wheel in .whl/ (not in git): python3 -m pip download fla-core==0.6.0 --no-deps -d .whl
# Triton autotune results (fla autotunes for minutes on a fresh machine) are saved per mode to $OUT/autotune_<mode>.tgz;
# carry them into the next call of the SAME mode as .autotune/<mode>/ (not in git):
#   mkdir -p .autotune/bench && tar xzf OUTDIR/autotune_bench.tgz -C .autotune/bench   (OUTDIR: where $OUT came back)
# Never feed tests' results to bench: fla's tuning keys omit T, so picks made at test sizes (T ~ 100) would be reused
# at T=32768 (chunk_kda ran 1.3x slower that way on an H200).
set -u -o pipefail          # a failing benchmark fails the script through its `| tee | tail`
usage() { sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  tests|bench|profile|ncu|decode|tp|fused) ;;
  -h|--help) usage; exit 0 ;;
  *) echo "error: say what to run: tests, bench, profile, ncu, decode, tp or fused" >&2; usage >&2; exit 2 ;;
esac
MODE=$1
G=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$G" -ge 1 ] || { echo "error: $1 needs an NVIDIA GPU (nvidia-smi lists none here)" >&2; exit 2; }
if [ "$1" = tp ]; then
  [ "$G" -ge 2 ] || { echo "error: tp needs 2 or more GPUs, this machine has $G" >&2; exit 2; }
fi
if [ "$1" != ncu ] && ! ls .whl/*.whl >/dev/null 2>&1; then     # ncu profiles the MoE only: no fla-core
  echo "error: .whl/ holds no wheels; on a machine with network run: pip download fla-core==0.6.0 --no-deps -d .whl" >&2
  exit 2
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Triton keys each *.autotune.json by its version, the GPU target, the kernel source and the tuning key: a result
# from an earlier machine of the same kind is reused, one that does not match is ignored
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache_$MODE}
mkdir -p "$TRITON_CACHE_DIR"
if [ -d ".autotune/$MODE" ]; then cp -r ".autotune/$MODE/." "$TRITON_CACHE_DIR"/; fi
save_autotune() {
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/autotune_$MODE.tgz" -T -) || true
}
trap save_autotune EXIT
if [ "$1" != ncu ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: installing .whl/*.whl failed" >&2; exit 2; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
case "$1" in
  tests)
    # PYTEST_TIMEOUT is this script's whole-run limit; pytest-timeout (on the device image) would read it as a
    # per-test limit too, so pytest runs without it
    eval timeout "${PYTEST_TIMEOUT:-420}" env -u PYTEST_TIMEOUT python3 -m pytest -q -rs ${PYTEST_ARGS:-tests/plugins/test_kernels.py tests/plugins/test_graph_safe.py tests/runtime/test_cuda.py} \
      --junitxml="$OUT/junit.xml" 2>&1 | tail -60 | tee "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
    echo "PYTEST_RC=$rc" | tee -a "$OUT/pytest.log"
    exit "$rc" ;;
  bench)
    J=""; [ -f "${JUNIT:-}" ] && J="--junit $JUNIT"
    timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_kernels.py --out "$OUT/bench.jsonl" $J ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
  profile)
    timeout "${PROFILE_TIMEOUT:-540}" python3 benchmarks/profile_kda_prefill.py --out "$OUT/profile.jsonl" ${PROFILE_ARGS:-} \
      2>&1 | tee "$OUT/profile.log" | tail -40 ;;
  ncu)
    command -v ncu >/dev/null || { echo "error: ncu (Nsight Compute) is not on PATH" >&2; exit 2; }
    M=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import ncu_moe; print(ncu_moe.METRICS)')
    rc=0
    for T in ${NCU_TOKENS:-64 1}; do
      timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --kernel-name regex:'moe_w13|moe_w2' --section SpeedOfLight \
        --section Occupancy --section SchedulerStats --metrics "$M" python3 benchmarks/ncu_moe.py --tokens "$T" \
        ${NCU_IMPLS:+--impls "$NCU_IMPLS"} ${NCU_EXPERTS:+--experts "$NCU_EXPERTS"} > "$OUT/ncu_moe_T$T.txt" 2>&1 \
        || { echo "error: ncu failed for T=$T; the end of $OUT/ncu_moe_T$T.txt:" >&2
             tail -5 "$OUT/ncu_moe_T$T.txt" >&2; rc=1; continue; }
      python3 benchmarks/ncu_moe.py --summarize "$OUT/ncu_moe_T$T.txt" | sed "s/^{/{\"T\": $T, /" \
        | tee -a "$OUT/ncu_summary.jsonl" || rc=1
    done
    exit $rc ;;
  decode)
    timeout "${DECODE_TIMEOUT:-540}" python3 benchmarks/bench_decode.py --out "$OUT/decode.jsonl" \
      ${DECODE_ARGS:---preset k3-slice --device cuda --batch 16 --prompt-len 512 --steps 32 --ops torch,kernels} \
      2>&1 | tee "$OUT/decode.log" | tail -40 ;;
  tp)
    rc=0
    A=${TP_ARGS:---preset k3-slice --batch 16 --prompt-len 512 --steps 32 --ops kernels --profile-steps 8}
    rm -f /tmp/tp1.pt
    A1=${A//--compare-tokens/}                # TP=1 saves what the others compare with
    timeout "${TP_TIMEOUT:-270}" python3 benchmarks/bench_decode.py --device cuda:0 $A1 --save-logits /tmp/tp1.pt \
      --out "$OUT/decode_tp.jsonl" 2>&1 | tee "$OUT/tp1.log" | tail -5 || rc=1
    for ((n = 2; n <= G; n *= 2)); do
      timeout "${TP_TIMEOUT:-270}" python3 -m torch.distributed.run --standalone --nproc-per-node $n \
        benchmarks/bench_decode.py --device cuda --tp $n --ep $n $A --compare-to /tmp/tp1.pt \
        --out "$OUT/decode_tp.jsonl" 2>&1 | tee "$OUT/tp$n.log" | tail -5 || rc=1
    done
    exit $rc ;;
  fused)
    rc=0
    PARTS=" ${FUSED_PARTS:-tests slice rank} "
    export TRITON_CACHE_DIR=/tmp/triton_cache_fused_tests             # tests' tuning apart from the benchmarks'
    mkdir -p "$TRITON_CACHE_DIR"
    if [ -d .autotune/tests ]; then cp -r .autotune/tests/. "$TRITON_CACHE_DIR"/; fi
    T=tests/runtime/test_cuda.py
    if [[ $PARTS == *" tests "* ]]; then
      G=tests/plugins/test_glue.py
      timeout "${FUSED_TESTS_TIMEOUT:-200}" python3 -m pytest -q -rs "$G::test_attn_res_norm" \
        "$G::test_attn_res_norm_k3_width" "$G::test_attn_res_norm_rounds_like_the_bf16_model" \
        tests/runtime/test_fused.py::test_fused_kernels_on_gpu_against_unfused_and_reference \
        "$T::test_decode_reproduces_prefill_on_gpu[kernels]" "$T::test_chunked_prefill_equals_one_shot_on_gpu[kernels]" \
        "$T::test_cuda_graph_decode_equals_eager_on_gpu" --junitxml="$OUT/junit.xml" 2>&1 | tail -40 \
        | tee "$OUT/pytest.log"
      prc=${PIPESTATUS[0]}
      echo "PYTEST_RC=$prc" | tee -a "$OUT/pytest.log"
      [ "$prc" = 0 ] || rc=1
    fi
    export TRITON_CACHE_DIR=/tmp/triton_cache_decode
    mkdir -p "$TRITON_CACHE_DIR"
    if [ -d .autotune/decode ]; then cp -r .autotune/decode/. "$TRITON_CACHE_DIR"/; fi
    python3 benchmarks/fla_configs.py "$TRITON_CACHE_DIR" --out /tmp/fla_configs | tee "$OUT/fla_configs.txt"
    export FLA_CACHE_MODE=fuzzy FLA_CONFIG_DIR=/tmp/fla_configs
    [[ $PARTS == *" slice "* ]] && { timeout "${FUSED_SLICE_TIMEOUT:-300}" python3 benchmarks/bench_decode.py \
      --preset k3-slice --device cuda --batch "${FUSED_BATCH:-1,16,64}" --prompt-len 4096 --steps 16 --warmup 2 --ops kernels,kernels-unfused --cuda-graphs \
      --dense-dtype bfloat16 --kernel-profile 2 --no-progress --out "$OUT/decode.jsonl" 2>&1 \
      | tee "$OUT/decode.log" | grep -v '^{' | tail -12 || rc=1; }
    [[ $PARTS == *" rank "* ]] && { timeout "${FUSED_RANK_TIMEOUT:-600}" python3 benchmarks/bench_decode.py --preset k3-tp8-rank --device cuda \
      --batch 1,16,64 --prompt-len 1024 --steps 8 --warmup 2 --ops kernels --cuda-graphs --dense-dtype bfloat16 \
      --kernel-profile 2 --ttft 8192,32768 --predict-experts 896 --no-progress --out "$OUT/rank.jsonl" 2>&1 \
      | tee "$OUT/rank.log" | grep -v '^{' | tail -12 || rc=1; }
    exit $rc ;;
esac
