#!/usr/bin/env bash
# The engine's first GPU run, as one device command (10-minute limit):
#   device run:  bash benchmarks/engine/gpu_engine.sh
# 1. the engine's GPU tests (pytest -m cuda: the Triton MoE kernels, graph capture vs eager, tokens identical across
#    max_in_flight and copy delays); 2. psr-hf bench --engine on grown-olmoe-routing (records under $OUT).
set -uo pipefail
START=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import psr_hf.patches" 2>/dev/null || ln -sfn ../patches psr_hf/patches
export PYTHONPATH=$PWD
timeout "${TEST_S:-200}" python3 -m pytest -m cuda -x -q tests/test_engine_moe.py tests/test_engine_graphs.py \
    tests/test_engine_layers.py 2>&1 | tail -30 | tee "$OUT/engine_cuda_tests.txt"
LEFT=$((580 - (SECONDS - START)))
timeout "$LEFT" python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine --rounds 3 --windows 2 \
    --tokens "${TOKENS:-64}" --accelerate-tokens 2 --warmup 1 --json "$OUT/bench_engine.json" \
    --plot "$OUT/bench_engine.png" > "$OUT/bench_engine.txt" 2>&1
echo "bench exit $? at $((SECONDS - START)) s"
grep -v "^  round\|^  warm\|row/s" "$OUT/bench_engine.txt" | tail -60
