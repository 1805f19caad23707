#!/usr/bin/env bash
# The host path's record run on the lent GPU, one device command (10-minute limit):
#   device run:  bash benchmarks/engine/gpu_host_path_final.sh
# 1. the offload's cuda tests and the engine's timing/replay ones (raw copy calls, raw launches);
# 2. psr-hf bench --engine on grown-olmoe-routing: exact_lru, cp_lam0.2, psr_lam0.3_n1 and their copies-skipped
#    twins at 50% and 25%, 5 interleaved rounds;
# 3. psr-hf sweep's timing stage for the main rows at 50% and 25%, completing
#    benchmarks/sweep/h200/host_path/grown-olmoe-routing_main_rows.json, whose divergence stage ran on the CPU;
# 4. (if time is left) profile_host.py --gpu-floor: engine_resident's GPU time per token with no host work.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
timeout 90 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_offload_cuda.py tests/test_engine_graphs.py \
    -k "offload_cuda or timing_never or replay or one_graph" 2>&1 | tail -25 > "$OUT/cuda_tests.txt"
tail -2 "$OUT/cuda_tests.txt"
timeout 240 python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine --hf-configs '' \
    --configs exact_lru,cp_lam0.2,psr_lam0.3_n1 --capacities 0.5,0.25 --no-accelerate --rounds 5 --windows 2 \
    --tokens 64 --warmup 1 --json "$OUT/bench_engine.json" > "$OUT/bench_engine.txt" 2>"$OUT/bench_engine.err"
echo "bench exit $? at $((SECONDS - START)) s"
grep -v "^  round\|^  warm" "$OUT/bench_engine.txt" | head -16
grep "^goal engine\|^engine host" "$OUT/bench_engine.txt" | cut -c1-400
LAMS="0.1 0.15 0.2 0.25 0.3"
MAIN="exact_lru,exact_a_pf,spec$(for l in $LAMS; do printf ',cp_lam%s,psr_lam%s_n1' "$l" "$l"; done)"
REC=grown-olmoe-routing_main_rows
cp "benchmarks/sweep/h200/host_path/$REC.json" "$OUT/$REC.json"
LEFT=$((${TOTAL_S:-585} - 60 - (SECONDS - START)))
timeout "$LEFT" python3 -m psr_hf.cli sweep --model grown-olmoe-routing --device cuda:0 --residencies 0.5,0.25 \
    --selfgen-windows 16 --heldout-windows 8 --quality-device cpu --configs "$MAIN" --stage all \
    --max-minutes $(( (LEFT - 40) / 60 )) --json "$OUT/$REC.json" --plot "$OUT/$REC.png" --markdown "$OUT/$REC.md" \
    > "$OUT/sweep.txt" 2>"$OUT/sweep.err"
echo "sweep exit $? at $((SECONDS - START)) s"
grep "^| 50%\|^| 25%" "$OUT/sweep.txt" | cut -c1-200
LEFT=$((${TOTAL_S:-585} - (SECONDS - START)))
[ "$LEFT" -gt 30 ] && timeout "$LEFT" python3 benchmarks/engine/profile_host.py --gpu-floor --out "$OUT/gpu_floor.txt" 2>&1 \
    | grep "^==\|Error" | cut -c1-300
echo "done at $((SECONDS - START)) s"
