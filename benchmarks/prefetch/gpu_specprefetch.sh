#!/usr/bin/env bash
# SpecPrefetch's system evaluation on the lent H200 (its Tables 4-5, Figures 1b, 4, 5), one device command:
#   device run:  bash benchmarks/prefetch/gpu_specprefetch.sh
# 0. the cuda test of the engine with a predictor (captured graphs, CUDA slots: router-preserving, same decisions);
# 1. psr-hf profile-window on grown-olmoe-routing: overlap windows, one expert's copy time, M_max;
# 2. psr-hf bench --engine at M_max, 50% and 25% residency: OFF (engine_exact_lru), PRED0
#    (engine_specprefetch_mM_nocopy), SpecPrefetch and Naive Prefetch, with the predictor trained on the CPU
#    (benchmarks/prefetch/predictor_olmoe-routing.safetensors, padded to the grown model's hidden size);
# 3. the same at M_max and 50% with every copy slowed by one and by three expert copy times (2x and 4x slower link);
# 4. the sweep of M at 50% residency, in the time left.
# M and T (one copy, ms) override the profiled values; SKIP="tests window mmax slow2x" leaves out those steps. The records come
# back as one archive, specprefetch_records.tar.gz.
set -uo pipefail
START=$SECONDS
TOTAL_S=${TOTAL_S:-585}
MODEL=${MODEL:-grown-olmoe-routing}  # a CPU check of this script: MODEL=olmoe-routing DEVICE=cpu
DEVICE=${DEVICE:-cuda:0}
source benchmarks/device_env.sh
P=benchmarks/prefetch/predictor_olmoe-routing.safetensors
skipped() { case " ${SKIP:-} " in *" $1 "*) return 0;; esac; return 1; }
skipped tests || timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_prefetch_runtime.py 2>&1 | tail -15 \
    | tee "$OUT/prefetch_cuda_tests.txt"
skipped window || python3 -m psr_hf.cli profile-window --model "$MODEL" --device "$DEVICE" --tokens 64 --json "$OUT/window.json" 2>&1 \
    | grep -v "Loading weights" | tail -25 | tee "$OUT/window.txt"
M=${M:-$(python3 -c "import json; print(min(64, max(1, json.load(open('$OUT/window.json'))['budget'])))" 2>/dev/null || echo 4)}
T=${T:-$(python3 -c "import json; print(json.load(open('$OUT/window.json'))['copy_ms_median'])" 2>/dev/null || echo 0.1)}
SWEEP=$(python3 -c "m=$M; print(','.join(str(x) for x in sorted({1, 2, max(1, m // 2), min(64, 2 * m), 16} - {m})))")
echo "M_max $M, one copy $T ms, sweep $SWEEP (at $((SECONDS - START)) s)"
bench_run() {  # name, budgets, share of the time left (seconds), extra args
  LEFT=$((TOTAL_S - (SECONDS - START)))
  LIMIT=$(( $3 < LEFT ? $3 : LEFT ))
  [ "$LIMIT" -lt 45 ] && { echo "no time left for $1"; return; }
  CONFIGS="exact_lru,$(python3 -c "print(','.join(f'specprefetch_m{m},naive_m{m}' for m in '$2'.split(',')))")"
  timeout "$LIMIT" python3 -m psr_hf.cli bench --model "$MODEL" --device "$DEVICE" --engine --hf-configs '' --no-accelerate \
      --configs "$CONFIGS" --prefetch-budgets "$2" --predictor "$P" --rounds 5 --windows 2 --tokens 64 ${4:-} \
      --json "$OUT/bench_$1.json" --plot "$OUT/bench_$1.png" > "$OUT/bench_$1.txt" 2>"$OUT/bench_$1.err"
  echo "bench $1 exit $? at $((SECONDS - START)) s"
  grep "engine_\|ReadyRecall\|delay" "$OUT/bench_$1.txt" | grep -v "^  round\|^  warm\|goal" | head -40
  grep -i "error\|traceback" "$OUT/bench_$1.err" | tail -3
}
[ -n "${SKIP:-}" ] && echo "skipping: $SKIP"
run() { skipped "$1" || bench_run "$@"; }
run mmax "$M" 200
run slow2x "$M" 110 "--capacities 0.5 --copy-delay-ms $T"
run slow4x "$M" 110 "--capacities 0.5 --copy-delay-ms $(python3 -c "print(3 * $T)")"
run sweep "$SWEEP" 600 "--capacities 0.5"
# the device returns at most 8 files: everything in one archive
ARCHIVE=$(mktemp -d)/specprefetch_records.tar.gz
tar czf "$ARCHIVE" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$ARCHIVE" "$OUT/"
