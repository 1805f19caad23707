#!/usr/bin/env bash
# The decode kernels in one device call, by priority within TOTAL_S: their cuda tests (the fused GEMV, the decode
# attention, OLMoE's attention kernels in the engine, the device decisions compiled vs numba, the token graph vs the
# host path), then the token graph with the attention kernels against the torch attention on grown-olmoe-routing
# (benchmarks/engine/token_graph_vs_host.py --torch-attention: bitwise host vs device, the kernels' speed-up in
# interleaved rounds), then the decision kernel by the old build (_old/, OLD=<commit> snapshot) and the new one, then
# the attention and GEMV kernel benches, then the device decisions record on olmoe-routing. Records under $OUT.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
ROOT=$PWD
timeout "$(cap "${TEST_S:-190}")" python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_engine_gemv_kernel.py \
    tests/test_engine_decode_attention_kernel.py tests/test_engine_attention_kernels.py \
    tests/test_engine_device_decisions.py tests/test_engine_token_graph.py 2>&1 | tail -40 > "$OUT/kernels_cuda_tests.txt"
tail -12 "$OUT/kernels_cuda_tests.txt"
PYTHONUNBUFFERED=1 timeout "$(cap "${AB_S:-170}")" python3 benchmarks/engine/token_graph_vs_host.py \
    --model grown-olmoe-routing --tokens 64 --rounds "${ROUNDS:-5}" --residency 0.5 --torch-attention \
    --rows resident_exact psr_lam0.3_n1@0.5 --json "$OUT/attention_kernels_ab.json" 2>&1 | grep -v "Loading weights" \
    | tee "$OUT/attention_kernels_ab.txt" | tail -12
if [ -d _old ] && [ "$(left)" -gt 60 ]; then
  (cd _old && PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout "$(cap 45)" python3 "$ROOT/benchmarks/engine/decide_kernel_bench.py" \
      --json "$OUT/decide_kernel_old.json" > "$OUT/decide_kernel_old.txt" 2>&1); tail -10 "$OUT/decide_kernel_old.txt"
fi
if [ "$(left)" -gt 40 ]; then
  PYTHONUNBUFFERED=1 timeout "$(cap 45)" python3 benchmarks/engine/decide_kernel_bench.py \
      --json "$OUT/decide_kernel.json" > "$OUT/decide_kernel.txt" 2>&1; tail -10 "$OUT/decide_kernel.txt"
fi
if [ "$(left)" -gt 20 ]; then
  PYTHONUNBUFFERED=1 timeout "$(cap 45)" python3 benchmarks/engine/decode_attention_bench.py \
      --json "$OUT/decode_attention.json" > "$OUT/decode_attention.txt" 2>&1; tail -12 "$OUT/decode_attention.txt"
fi
if [ "$(left)" -gt 20 ]; then
  PYTHONUNBUFFERED=1 timeout "$(cap 50)" python3 benchmarks/engine/gemv_bench.py --shapes qkv o_proj router \
      --configs auto 4x512x4x1 8x512x4x1 16x256x4x1 32x256x8x1 --json "$OUT/gemv.json" > "$OUT/gemv.txt" 2>&1
  tail -20 "$OUT/gemv.txt"
fi
if [ "$(left)" -gt 30 ]; then  # the device decisions against numba on teacher-forced windows (the small model)
  PYTHONUNBUFFERED=1 timeout "$(left)" python3 benchmarks/engine/device_decisions_record.py --model olmoe-routing \
      --windows 2 --tokens 128 --json "$OUT/device_decisions_record.json" 2>&1 | grep -v "Loading weights" \
      > "$OUT/device_decisions_record.txt"; tail -8 "$OUT/device_decisions_record.txt"
fi
