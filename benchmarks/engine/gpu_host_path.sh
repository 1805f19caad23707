#!/usr/bin/env bash
# The engine host path on the lent GPU, one device command (10-minute limit):
#   device run:  bash benchmarks/engine/gpu_host_path.sh
# 1. the offload's and the engine graphs' cuda tests (raw copy calls against torch's, one graph per layer against
#    one per body, timing never changes outputs);
# 2. host_calls.py: the host cost of single calls and of the wait for a graph (event against a pinned flag);
# 3. profile_host.py: cProfile of GraphDecoder steps on grown-olmoe-routing (PROFILE=0 skips it);
# 4. psr-hf bench --engine on grown-olmoe-routing (CONFIGS, ROUNDS, RESIDENCIES), the rest of TOTAL_S (BENCH=0 skips it).
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
python3 -c "from psr_hf.offload import cuda_runtime; print(cuda_runtime.available())"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider ${TEST_FILES:-tests/test_offload_cuda.py tests/test_engine_graphs.py} \
      2>&1 | tail -25 > "$OUT/cuda_tests.txt"
  tail -4 "$OUT/cuda_tests.txt"
fi
timeout 60 python3 benchmarks/engine/host_calls.py --json "$OUT/host_calls.json" 2>&1 | tail -14
if [ "${PROFILE:-1}" = 1 ]; then
  timeout 200 python3 benchmarks/engine/profile_host.py --out "$OUT/profile_host.txt" 2>&1 | grep "^==\|Error\|error" | cut -c1-300
fi
[ "${BENCH:-1}" = 1 ] || exit 0
LEFT=$((${TOTAL_S:-570} - (SECONDS - START)))
echo "bench gets $LEFT s"
timeout "$LEFT" python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine --hf-configs '' \
    --configs "${CONFIGS:-exact_lru,cp_lam0.2,psr_lam0.3_n1}" --capacities "${RESIDENCIES:-0.5,0.25}" \
    --no-accelerate --rounds "${ROUNDS:-5}" --windows 2 --tokens 64 --warmup 1 --json "$OUT/bench_engine.json" \
    > "$OUT/bench_engine.txt" 2>"$OUT/bench_engine.err"
echo "bench exit $? at $((SECONDS - START)) s"
tail -c 1500 "$OUT/bench_engine.err" | tr '\r' '\n' | grep -v "it/s\]" | tail -4
grep -v "^  round\|^  warm" "$OUT/bench_engine.txt" | tail -45
