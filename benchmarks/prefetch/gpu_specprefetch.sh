#!/usr/bin/env bash
# SpecPrefetch's system evaluation on the lent H200 (its Tables 4-5, Figures 1b, 4, 5), one device command:
#   device run:  bash benchmarks/prefetch/gpu_specprefetch.sh
# 1. psr-hf profile-window on grown-olmoe-routing: overlap windows, one expert's copy time, M_max;
# 2. psr-hf bench --engine: OFF (engine_exact_lru), PRED0 (engine_specprefetch_m*_nocopy), SpecPrefetch and Naive
#    Prefetch at M_max and a sweep, at 50% and 25% residency, with the predictor trained on the CPU
#    (benchmarks/prefetch/predictor_olmoe-routing.safetensors, padded to the grown model's hidden size);
# 3. the same at M_max with every copy slowed by one and by three expert copy times (a 2x and a 4x slower link).
set -uo pipefail
START=$SECONDS
python3 -c "import psr_hf.patches" 2>/dev/null || ln -sfn ../patches psr_hf/patches
export PYTHONPATH=$PWD
P=benchmarks/prefetch/predictor_olmoe-routing.safetensors
python3 -m psr_hf.cli profile-window --model grown-olmoe-routing --tokens 64 --json "$OUT/window.json" 2>&1 \
    | grep -v "Loading weights" | tail -25 | tee "$OUT/window.txt"
M=$(python3 -c "import json; print(max(1, json.load(open('$OUT/window.json'))['budget']))")
T=$(python3 -c "import json; print(json.load(open('$OUT/window.json'))['copy_ms_median'])")
SWEEP=$(python3 -c "m=$M; print(','.join(str(x) for x in sorted({1, 2, max(1, m // 2), m, 2 * m, 16})))")
echo "M_max $M, one copy $T ms, sweep $SWEEP"
run() {  # name, budgets, extra args
  LEFT=$((${TOTAL_S:-570} - (SECONDS - START)))
  [ "$LEFT" -lt 60 ] && { echo "no time left for $1"; return; }
  CONFIGS="exact_lru,$(python3 -c "print(','.join(f'specprefetch_m{m},naive_m{m}' for m in '$2'.split(',')))")"
  timeout "$LEFT" python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine --hf-configs '' --no-accelerate \
      --configs "$CONFIGS" --prefetch-budgets "$2" --predictor "$P" --rounds 5 --windows 2 --tokens 64 ${3:-} \
      --json "$OUT/bench_$1.json" --plot "$OUT/bench_$1.png" > "$OUT/bench_$1.txt" 2>"$OUT/bench_$1.err"
  echo "bench $1 exit $? at $((SECONDS - START)) s"
  grep -v "^  round\|^  warm" "$OUT/bench_$1.txt" | grep "engine\|goal\|M_max" | head -40
}
run sweep "$SWEEP"
run slow2x "$M" "--copy-delay-ms $T"
run slow4x "$M" "--copy-delay-ms $(python3 -c "print(3 * $T)")"
