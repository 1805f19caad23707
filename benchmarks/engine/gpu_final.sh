#!/usr/bin/env bash
# The engine's record run on the lent H200, one device command (10-minute limit):
#   device run:  bash benchmarks/engine/gpu_final.sh
# 1. a few GPU tests (compiled blocks, timing invariance, generate() against the HF path in float32);
# 2. bf16 agreement and held-out perplexity, engine vs HF path (engine_agreement.py);
# 3. psr-hf bench --engine: every engine row, transformers references resident and psr_lam0.3_n1, 5 rounds.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
timeout 75 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_engine_graphs.py tests/test_engine_generate.py \
    -k "compiled or timing_never or equal_the_hf_path" 2>&1 | tail -15 > "$OUT/engine_cuda_tests.txt"
tail -3 "$OUT/engine_cuda_tests.txt"
timeout "${AGREE_S:-150}" python3 benchmarks/engine/engine_agreement.py --windows 4 --tokens 256 --decode-windows 1 \
    --json "$OUT/bf16_agreement.json" 2>&1 | grep -v "Loading weights\|Warning\|warn" | cut -c1-400
LEFT=$((${TOTAL_S:-555} - (SECONDS - START)))
echo "bench gets $LEFT s"
timeout "$LEFT" python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine --hf-configs psr_lam0.3_n1 \
    --no-accelerate --rounds "${ROUNDS:-5}" --windows 2 --tokens 64 --warmup 1 --json "$OUT/bench_engine.json" \
    --plot "$OUT/bench_engine.png" > "$OUT/bench_engine.txt" 2>"$OUT/bench_engine.err"
echo "bench exit $? at $((SECONDS - START)) s"
tail -c 2000 "$OUT/bench_engine.err" | tr '\r' '\n' | tail -3
grep -v "^  round\|^  warm" "$OUT/bench_engine.txt" | tail -70
