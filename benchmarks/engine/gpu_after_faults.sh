#!/usr/bin/env bash
# After the faults-round-3 fixes (the engine reads router weights and checks its tensors each step): every cuda
# test of the offload, the engine and the learned prefetch, and a 3-round bench of psr_lam0.3_n1 at 50% to see
# that the checks cost no measurable time.   device run:  bash benchmarks/engine/gpu_after_faults.sh
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
timeout 90 python3 -m psr_hf.cli warm-up 2>&1 | tail -1
timeout 200 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_offload_cuda.py tests/test_engine_graphs.py \
    tests/test_prefetch_runtime.py tests/test_hf_cuda.py tests/test_engine_generate.py tests/test_engine_moe.py 2>&1 | tail -25 > "$OUT/cuda_tests_after_faults.txt"
tail -3 "$OUT/cuda_tests_after_faults.txt"
echo "tests done at $((SECONDS - START)) s"
timeout 200 python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine --hf-configs '' --configs psr_lam0.3_n1 \
    --capacities 0.5 --no-accelerate --rounds 3 --windows 2 --tokens 64 --warmup 1 --json "$OUT/bench_after_faults.json" \
    > "$OUT/bench_after_faults.txt" 2>"$OUT/bench_after_faults.err"
grep "^engine_\|^engine host" "$OUT/bench_after_faults.txt" | cut -c1-200
echo "done at $((SECONDS - START)) s"
