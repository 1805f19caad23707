#!/usr/bin/env bash
# Issue 47 on the lent GPU, one device command:  bash benchmarks/hf/gpu_faults_round4.sh
# psr-hf warm-up, then every cuda-marked test of the suite with the reasons of its skips (the image has no lm_eval
# and no nbformat: those tests skip with the reason instead of failing to collect), then this CPU tests on
# the image's torch and transformers. Records: $OUT/cuda_tests.txt, $OUT/faults_tests.txt.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee "$OUT/versions.txt"
timeout 90 python3 -m psr_hf.cli warm-up 2>&1 | tail -1
timeout "${CUDA_S:-420}" python3 -m pytest -m cuda -q -rs -p no:cacheprovider tests 2>&1 | tail -80 > "$OUT/cuda_tests.txt"
tail -4 "$OUT/cuda_tests.txt"
echo "cuda tests done at $((SECONDS - START)) s"
timeout "${FAULTS_S:-120}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_faults_routing.py 2>&1 \
    | tail -30 > "$OUT/faults_tests.txt"
tail -3 "$OUT/faults_tests.txt"
echo "done at $((SECONDS - START)) s"
