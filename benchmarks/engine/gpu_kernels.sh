#!/usr/bin/env bash
# The decode kernels' GPU run, as one device command (snapshot packed with OLD=<commit> for the decision kernel's
# before/after): benchmarks/engine/decide_kernel_bench.py by the old build then the new one, the fused GEMV and the
# decode attention kernels' benches where present (gemv_bench.py, decode_attention_bench.py), their cuda tests with
# the token graph's and the device decisions', then benchmarks/engine/token_graph_profile.py. Records under $OUT.
set -uo pipefail
source benchmarks/device_env.sh
ROOT=$PWD
if [ -d _old ]; then
  (cd _old && PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout "${DECIDE_S:-60}" python3 "$ROOT/benchmarks/engine/decide_kernel_bench.py" \
      --json "$OUT/decide_kernel_old.json" > "$OUT/decide_kernel_old.txt" 2>&1); tail -12 "$OUT/decide_kernel_old.txt"
fi
PYTHONUNBUFFERED=1 timeout "${DECIDE_S:-60}" python3 benchmarks/engine/decide_kernel_bench.py \
    --json "$OUT/decide_kernel.json" > "$OUT/decide_kernel.txt" 2>&1; tail -12 "$OUT/decide_kernel.txt"
for bench in gemv decode_attention; do
  [ -f "benchmarks/engine/${bench}_bench.py" ] || continue
  PYTHONUNBUFFERED=1 timeout "${KERNEL_BENCH_S:-60}" python3 "benchmarks/engine/${bench}_bench.py" \
      --json "$OUT/${bench}.json" > "$OUT/${bench}.txt" 2>&1; tail -30 "$OUT/${bench}.txt"
done
tests=(tests/test_engine_device_decisions.py tests/test_engine_token_graph.py)
for t in tests/test_engine_gemv_kernel.py tests/test_engine_decode_attention_kernel.py tests/test_engine_attention_kernels.py; do [ -f "$t" ] && tests+=("$t"); done
timeout "${TEST_S:-200}" python3 -m pytest -m cuda -q -p no:cacheprovider "${tests[@]}" 2>&1 | tail -40 \
    > "$OUT/kernels_cuda_tests.txt"
tail -15 "$OUT/kernels_cuda_tests.txt"
PYTHONUNBUFFERED=1 timeout "${PROFILE_S:-130}" python3 benchmarks/engine/token_graph_profile.py \
    --model grown-olmoe-routing --json "$OUT/token_graph_profile.json" 2>&1 | grep -v "Loading weights" \
    > "$OUT/token_graph_profile.txt"; grep "^==" "$OUT/token_graph_profile.txt"
