#!/usr/bin/env bash
# The host path's record runs on the lent GPU, two device commands (10-minute limit each):
#   device run:  STAGE=bench bash benchmarks/engine/gpu_host_path_final.sh
#   device run:  STAGE=sweep bash benchmarks/engine/gpu_host_path_final.sh
# STAGE=bench:
#   1. psr-hf warm-up (the numba kernels compiled once, not inside a timed row or a test's budget);
#   2. every cuda test of the offload, the engine's graphs and the learned prefetch (raw copy calls against torch's,
#      max_in_flight 1/2/4 and delayed copies bitwise equal, one graph per layer against one per body, replay);
#   3. psr-hf bench --engine on grown-olmoe-routing: exact_lru, cp_lam0.2, psr_lam0.3_n1 and specprefetch_m1
#      (with the shipped predictor) and their copies-skipped twins at 50% and 25%, 5 interleaved rounds;
#   4. profile_host.py: where the host time goes now (cProfile per row).
# STAGE=sweep: psr-hf sweep's timing stage for the main rows at 50% and 25%, completing
#   benchmarks/sweep/h200/host_path/grown-olmoe-routing_main_rows.json, whose divergence stage ran on the CPU.
set -uo pipefail
START=$SECONDS
TOTAL_S=${TOTAL_S:-585}
source benchmarks/device_env.sh
if [ "${STAGE:-bench}" = bench ]; then
  timeout 90 python3 -m psr_hf.cli warm-up 2>&1 | tail -1
  timeout 170 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_offload_cuda.py tests/test_engine_graphs.py \
      tests/test_prefetch_runtime.py 2>&1 | tail -25 > "$OUT/cuda_tests.txt"
  tail -3 "$OUT/cuda_tests.txt"
  echo "tests done at $((SECONDS - START)) s"
  LEFT=$((TOTAL_S - 75 - (SECONDS - START)))
  timeout "$LEFT" python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine --hf-configs '' \
      --configs exact_lru,cp_lam0.2,psr_lam0.3_n1,specprefetch_m1 --prefetch-budgets 1 \
      --predictor benchmarks/prefetch/predictor_olmoe-routing.safetensors --capacities 0.5,0.25 --no-accelerate \
      --rounds 5 --windows 2 --tokens 64 --warmup 1 --json "$OUT/bench_engine.json" \
      > "$OUT/bench_engine.txt" 2>"$OUT/bench_engine.err"
  echo "bench exit $? at $((SECONDS - START)) s"
  grep -v "^  round\|^  warm" "$OUT/bench_engine.txt" | head -22 | cut -c1-200
  grep "^goal engine\|^goal PRED0\|^engine host\|nocopy /" "$OUT/bench_engine.txt" | cut -c1-400
  tail -c 600 "$OUT/bench_engine.err" | tr '\r' '\n' | grep -i "error\|traceback" | tail -3
  LEFT=$((TOTAL_S - (SECONDS - START)))
  [ "$LEFT" -gt 40 ] && timeout "$LEFT" python3 benchmarks/engine/profile_host.py --out "$OUT/profile_host.txt" 2>&1 \
      | grep "^==\|Error" | cut -c1-300
else
  LAMS="0.1 0.15 0.2 0.25 0.3"
  MAIN="exact_lru,exact_a_pf,spec$(for l in $LAMS; do printf ',cp_lam%s,psr_lam%s_n1' "$l" "$l"; done)"
  REC=grown-olmoe-routing_main_rows
  # the record's divergence stage (run on the CPU), without its earlier timing: the sweep times every row again
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); r['latency'] = {}
[r.pop(k, None) for k in ('latency_windows', 'machine', 'points', 'frontier', 'orderings')]
json.dump(r, open(sys.argv[2], 'w'))" "benchmarks/sweep/h200/host_path/before_slot_book/$REC.json" "$OUT/$REC.json"
  timeout 60 python3 -m psr_hf.cli warm-up 2>&1 | tail -1
  LEFT=$((TOTAL_S - 30 - (SECONDS - START)))
  timeout "$LEFT" python3 -m psr_hf.cli sweep --model grown-olmoe-routing --device cuda:0 --residencies 0.5,0.25 \
      --selfgen-windows 16 --heldout-windows 8 --quality-device cpu --configs "$MAIN" --stage all \
      --max-minutes $(( (LEFT - 40) / 60 )) --json "$OUT/$REC.json" --plot "$OUT/$REC.png" --markdown "$OUT/$REC.md" \
      > "$OUT/sweep.txt" 2>"$OUT/sweep.err"
  echo "sweep exit $? at $((SECONDS - START)) s"
  grep "^| 50%\|^| 25%" "$OUT/sweep.txt" | cut -c1-200
fi
echo "done at $((SECONDS - START)) s"
