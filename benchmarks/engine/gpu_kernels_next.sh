#!/usr/bin/env bash
# What the decode kernels still need on a GPU, as one device call (snapshot of HEAD; records under $OUT): the cuda
# tests of the attention kernels in every family's engine (DeepSeek-V3's and Qwen's default waits for them), of the
# decode attention kernel (float32 MLA now refused) and of the device decisions compiled against numba (after the
# float64 params fix), of the token graph against the host path (the compiled execution weights in both); the
# decision kernel's bench with every variant (the offloaded and token-prior ones were cut
# last time); the attention kernels' A/B in the token graph at a 4096-slot cache, where the torch attention reads
# every slot. Each part within its time; TOTAL_S bounds the call.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
timeout "$(cap "${TEST_S:-240}")" python3 -m pytest -m cuda -q -p no:cacheprovider --tb=short \
    tests/test_engine_attention_kernels.py tests/test_engine_decode_attention_kernel.py \
    tests/test_engine_device_decisions.py tests/test_engine_token_graph.py 2>&1 | tail -60 \
    > "$OUT/kernels_cuda_tests.txt"
tail -15 "$OUT/kernels_cuda_tests.txt"
PYTHONUNBUFFERED=1 timeout "$(cap "${DECIDE_S:-120}")" python3 benchmarks/engine/decide_kernel_bench.py \
    --variants psr_offloaded_prior psr_offloaded psr_prior psr cache_prior exact_offloaded exact --warps 4 8 \
    --json "$OUT/decide_kernel.json" > "$OUT/decide_kernel.txt" 2>&1; tail -30 "$OUT/decide_kernel.txt"
PYTHONUNBUFFERED=1 timeout "$(left)" python3 benchmarks/engine/token_graph_vs_host.py \
    --model grown-olmoe-routing --tokens 64 --rounds "${ROUNDS:-5}" --residency 0.5 --torch-attention --max-len 4096 \
    --rows resident_exact psr_lam0.3_n1@0.5 --json "$OUT/attention_kernels_ab_4096.json" 2>&1 \
    | grep -v "Loading weights" | tee "$OUT/attention_kernels_ab_4096.txt" | tail -12
