#!/usr/bin/env bash
# Speculative decoding on the lent GPU (docs/speculative.md, "Table 9 here"), one device command of at most 10 minutes:
#   TESTS=1 (default) the CUDA tests of tests/test_engine_speculative.py first ($OUT/cuda_tests.txt)
#   then `psr-hf bench-speculative` on grown-olmoe-routing with tiny-moe as drafter: PROBLEMS (default 80) HumanEval
#   prompts, NEW (default 48) new tokens each, K (default 16,8), ROUNDS (default 3) -> $OUT/NAME.json (default speculative_h200); EXTRA: more options (--rows, --configs)
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1
if [ "${TESTS:-1}" != 0 ]; then
    python3 -m pytest -m cuda -q -rA -p no:cacheprovider tests/test_engine_speculative.py > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest exit $? at $((SECONDS - START)) s" | tee -a "$OUT/cuda_tests.txt"
    tail -4 "$OUT/cuda_tests.txt"
fi
timeout $((590 - (SECONDS - START))) python3 -m psr_hf.cli bench-speculative --model grown-olmoe-routing \
    --device cuda:0 --problems "${PROBLEMS:-80}" --k "${K:-16,8}" --max-new-tokens "${NEW:-48}" \
    --rounds "${ROUNDS:-3}" --prompt-file benchmarks/speculative/humaneval_first80.json ${EXTRA:-} --json "$OUT/${NAME:-speculative_h200}.json" 2>&1 | grep -v Warning | tail -40
echo "bench exit ${PIPESTATUS[0]} at $((SECONDS - START)) s"
