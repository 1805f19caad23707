#!/usr/bin/env bash
# Issue 53, Build 3, as one device call (snapshot of HEAD; records under $OUT): the cuda tests of prefetch_distance
# (the token graph bitwise the host path with D=2, resident and offloaded, every family; the captured graphs; the
# compiled decision kernel against numba), then the token graph against the host path on grown-olmoe-routing for
# PSR with D=1 and D=2 at 50% (bitwise tokens, logits and statistics; ms/token in interleaved rounds), beside the
# all-resident row; with LATENESS=1 then `psr-hf bench --engine --device-routing off` on the same rows (the host
# path counts which prefetches arrived late: the lateness a distance removes). Each part within its time; TOTAL_S
# bounds the call.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
timeout "$(cap "${TEST_S:-150}")" python3 -m pytest -m cuda -q -p no:cacheprovider --tb=short -k distance \
    tests/test_engine_token_graph.py tests/test_engine_graphs.py tests/test_engine_device_decisions.py 2>&1 \
    | tail -40 > "$OUT/distance_cuda_tests.txt"
tail -8 "$OUT/distance_cuda_tests.txt"
PYTHONUNBUFFERED=1 timeout "$(left)" python3 benchmarks/engine/token_graph_vs_host.py \
    --model grown-olmoe-routing --tokens 64 --rounds "${ROUNDS:-3}" \
    --rows ${ROWS_:-resident_exact psr_lam0.3_n1@0.5 psr_lam0.3_n1_d2@0.5 psr_lam0.3_n2_d2@0.5} \
    --json "$OUT/prefetch_distance.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/prefetch_distance.txt" | tail -20
if [ "${LATENESS:-0}" = 1 ]; then
  PYTHONUNBUFFERED=1 timeout "$(left)" python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine \
      --device-routing off --configs psr_lam0.3_n1,psr_lam0.3_n1_d2 --hf-configs '' --no-accelerate \
      --rounds "${ROUNDS:-3}" --windows 2 --tokens 64 --json "$OUT/lateness.json" 2>&1 | grep -v "Loading weights" \
      | tee "$OUT/lateness.txt" | tail -30
fi
