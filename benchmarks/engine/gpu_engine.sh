#!/usr/bin/env bash
# The engine's GPU run, as one device command (10-minute limit):
#   device run:  bash benchmarks/engine/gpu_engine.sh
# 1. the engine's GPU tests (pytest -m cuda: the Triton MoE kernels, graph capture vs eager, tokens identical across
#    max_in_flight and copy delays); 2. a quick probe (probe.py: eager vs graphs, resident and offloaded, host time
#    split); 3. psr-hf bench --engine on grown-olmoe-routing with the time left (records under $OUT).
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_S:-150}" python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_engine_*.py 2>&1 \
      | tail -40 > "$OUT/engine_cuda_tests.txt"
  tail -15 "$OUT/engine_cuda_tests.txt"
fi
if [ "${PROBE:-1}" = 1 ]; then
  timeout "${PROBE_S:-200}" python3 benchmarks/engine/probe.py --tokens "${TOKENS:-64}" --json "$OUT/probe.json" \
      2>&1 | grep -v "Loading weights" | tail -30 | tee "$OUT/probe.txt"
fi
LEFT=$((585 - (SECONDS - START)))
echo "bench gets $LEFT s"
timeout "$LEFT" python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine --rounds "${ROUNDS:-3}" --windows 2 \
    --tokens "${TOKENS:-64}" --accelerate-tokens 2 --warmup 1 --json "$OUT/bench_engine.json" \
    --plot "$OUT/bench_engine.png" > "$OUT/bench_engine.txt" 2>&1
echo "bench exit $? at $((SECONDS - START)) s"
grep -v "^  round\|^  warm\|row/s\|Loading weights" "$OUT/bench_engine.txt" | tail -60
