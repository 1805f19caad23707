#!/usr/bin/env bash
# The hybrid families' batched prefill and Qwen3-Next on the lent GPU, one device command: the cuda tests of the
# batched prefill (CUDA graphs vs token by token, Qwen3.5-MoE included) and of the Qwen3.5/Qwen3-Next engine, then
# psr-hf bench-generate on grown-qwen36-routing (time to first token on a 512-token prompt: transformers against
# the engine's batched prefill, all resident). Records under $OUT.
set -uo pipefail
source benchmarks/device_env.sh
timeout "${TEST_S:-200}" python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_engine_prefill.py \
    tests/test_engine_qwen3_5.py 2>&1 | tail -30 | tee "$OUT/hybrid_cuda_tests.txt"
PYTHONUNBUFFERED=1 timeout "${BENCH_S:-330}" python3 -m psr_hf.cli bench-generate --model grown-qwen36-routing \
    --prompt-tokens 512 --new-tokens 64 --rounds "${ROUNDS:-3}" --setups transformers,engine_resident \
    --no-profile --no-by-token --json "$OUT/bench_generate_qwen36.json" 2>&1 | grep -v "Loading weights" \
    | tee "$OUT/bench_generate_qwen36.txt" | tail -30
