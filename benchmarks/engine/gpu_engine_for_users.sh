#!/usr/bin/env bash
# The engine where users meet it (issue "The engine where users meet it"), on the lent GPU, from the repository root:
#   device run:  STAGE=generate bash benchmarks/engine/gpu_engine_for_users.sh
#   device run:  STAGE=engine_rounds ENGINE_ROUNDS=40 bash benchmarks/engine/gpu_engine_for_users.sh
#   device run:  STAGE=free bash benchmarks/engine/gpu_engine_for_users.sh
#   device run:  STAGE=harness bash benchmarks/engine/gpu_engine_for_users.sh
# generate: the cuda tests of the engine and the controller, the token choice's kernels
#   (benchmarks/engine/token_choice_kernels.py), then psr-hf bench-generate on grown-olmoe-routing (time to first
#   token with the batched prefill, generate() against the engine's own step, the profiles); ROUNDS=N sets its
#   rounds (default 3).
# engine_rounds: bench-generate of the two engine setups alone with ENGINE_ROUNDS rounds (default 24), for the
#   ratios' intervals.
# free: psr-hf bench-free (free-generation timing, the paper's Table 6) at 50% and 25%.
# harness: lm-eval generate_until runs through the engine and through the harness for the Table 5 configurations,
#   then psr-hf compare-implementations on them.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
case "${STAGE:-generate}" in
generate)
  timeout 90 python3 -m psr_hf.cli warm-up 2>&1 | tail -1
  timeout 200 python3 -m pytest -m cuda -q -p no:cacheprovider --continue-on-collection-errors \
      tests/test_engine_graphs.py tests/test_engine_generate.py tests/test_engine_prefill.py tests/test_hf_cuda.py \
      tests/test_offload_cuda.py tests/test_prefetch_runtime.py 2>&1 | tail -25 > "$OUT/cuda_tests.txt"
  tail -3 "$OUT/cuda_tests.txt"
  echo "tests done at $((SECONDS - START)) s"
  timeout 120 python3 benchmarks/engine/token_choice_kernels.py "$OUT/token_choice_kernels.json"
  timeout ${BENCH_TIMEOUT:-300} python3 -m psr_hf.cli bench-generate --model grown-olmoe-routing --rounds ${ROUNDS:-3} --prompt-tokens 512 \
      --new-tokens 64 --json "$OUT/bench_generate.json" 2>/dev/null | tee "$OUT/bench_generate.txt"
  ;;
engine_rounds)
  timeout ${BENCH_TIMEOUT:-500} python3 -m psr_hf.cli bench-generate --model grown-olmoe-routing \
      --rounds "${ENGINE_ROUNDS:-24}" --prompt-tokens 512 --new-tokens 64 --no-by-token --no-profile \
      --setups engine_resident,engine_offloaded --json "$OUT/bench_generate_engine_rounds.json" 2>/dev/null \
      | tee "$OUT/bench_generate_engine_rounds.txt"
  ;;
free)
  ${FREE_COMMAND:?set FREE_COMMAND}
  ;;
harness)
  ${HARNESS_COMMAND:?set HARNESS_COMMAND}
  ;;
esac
echo "done at $((SECONDS - START)) s"
