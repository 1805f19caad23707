#!/usr/bin/env bash
# The token graph's GPU run, as one device command: benchmarks/engine/decide_kernel_bench.py (the decision kernel
# alone, by feature and warps), its cuda tests (device decisions compiled vs numba, the token
# graph vs the host-routed GraphDecoder on tiny models), benchmarks/engine/token_graph_profile.py (the GPU's time per
# token, host time per step, kernels), benchmarks/engine/token_graph_vs_host.py on grown-olmoe-routing (bitwise
# tokens/logits, statistics, ms/token in interleaved rounds) and benchmarks/engine/device_decisions_record.py
# (device vs numba decisions on teacher-forced windows of every policy), each within its time (a time of 0 skips
# that part; VS_HOST_ARGS adds arguments to token_graph_vs_host.py, e.g. --torch-attention). Records under $OUT.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
if [ "${DECIDE_S:-90}" != 0 ]; then
  PYTHONUNBUFFERED=1 timeout "${DECIDE_S:-90}" python3 benchmarks/engine/decide_kernel_bench.py \
      --json "$OUT/decide_kernel.json" 2>&1 | tee "$OUT/decide_kernel.txt" | tail -30
fi
if [ "${TEST_S:-240}" != 0 ]; then
  timeout "${TEST_S:-240}" python3 -m pytest -m cuda -q -x -p no:cacheprovider tests/test_engine_device_decisions.py \
      tests/test_engine_token_graph.py 2>&1 | tail -40 > "$OUT/token_graph_cuda_tests.txt"
  tail -25 "$OUT/token_graph_cuda_tests.txt"
fi
if [ "${PROFILE_S:-150}" != 0 ]; then
  PYTHONUNBUFFERED=1 timeout "${PROFILE_S:-150}" python3 benchmarks/engine/token_graph_profile.py \
      --model grown-olmoe-routing --json "$OUT/token_graph_profile.json" 2>&1 | grep -v "Loading weights" \
      | tee "$OUT/token_graph_profile.txt" | tail -45
fi
PYTHONUNBUFFERED=1 timeout "${VS_HOST_S:-200}" python3 benchmarks/engine/token_graph_vs_host.py \
    --model grown-olmoe-routing --tokens "${TOKENS:-64}" --rounds "${ROUNDS:-5}" --residency ${RESIDENCY:-0.5 0.25} \
    ${VS_HOST_ARGS:-} --json "$OUT/token_graph_vs_host.json" 2>&1 | grep -v "Loading weights" \
    | tee "$OUT/token_graph_vs_host.txt" | tail -40
LEFT=$((${TOTAL_S:-570} - (SECONDS - START)))
echo "the decisions record gets $LEFT s"
PYTHONUNBUFFERED=1 timeout "$LEFT" python3 benchmarks/engine/device_decisions_record.py \
    --model grown-olmoe-routing --windows "${WINDOWS:-2}" --tokens "${RECORD_TOKENS:-128}" \
    --json "$OUT/device_decisions_record.json" 2>&1 | grep -v "Loading weights" \
    | tee "$OUT/device_decisions_record.txt" | tail -16
