#!/usr/bin/env bash
# Issue 53, the kernels' tiles: one device call (snapshot of HEAD; records under $OUT). First the cuda tests of the
# kernels whose tiles or callers changed (the slot MoE, the fused GEMV now also the attention's output projection,
# the attention kernels in every family's engine), then the slot MoE's tiles (moe_tiles_bench.py: each kernel by
# itself), the fused GEMV's configurations on q/k/v, o_proj and the router (gemv_bench.py, against cuBLAS; with
# programmatic dependent launches too), the
# decode attention's splits at short contexts, and, with TESTS=1, the token graph's cuda tests last. TOTAL_S bounds
# the call.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
  *H200*) HBM=4800 ;;
  *) HBM=3350 ;;
esac
timeout "$(cap "${KTEST_S:-150}")" python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_engine_moe.py \
    tests/test_engine_gemv_kernel.py tests/test_engine_decode_attention_kernel.py tests/test_engine_attention_kernels.py 2>&1 | tail -15 \
    | tee "$OUT/kernels_cuda_tests.txt" | tail -4
PYTHONUNBUFFERED=1 timeout "$(cap "${TILES_S:-200}")" python3 benchmarks/engine/moe_tiles_bench.py \
    --hbm-gbps "$HBM" --json "$OUT/moe_tiles.json" 2>&1 | tee "$OUT/moe_tiles.txt" | tail -8
PYTHONUNBUFFERED=1 timeout "$(cap "${GEMV_S:-100}")" python3 benchmarks/engine/gemv_bench.py --shapes qkv o_proj router \
    --hbm-tbps "$(python3 -c "print($HBM / 1000)")" --configs auto 4x512x4x1 8x512x4x1 2x1024x4x1 4x1024x4x1 \
    4x1024x8x1 8x1024x8x1 2x2048x4x1 4x2048x4x1 4x2048x8x1 1x2048x4x1 4x512x4x1x1 4x1024x4x1x1 8x256x4x1 \
    4x512x2x1 4x256x4x1 4x512x4x1x1x1 4x1024x4x1x1x1 4x2048x4x1x1x1 4x2048x8x1x1x1 2x2048x4x1x1x1 \
    8x1024x8x1x1x1 --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.txt" | grep -v "^ *[0-9]*x" | tail -12
PYTHONUNBUFFERED=1 timeout "$(cap "${ATT_S:-60}")" python3 benchmarks/engine/decode_attention_bench.py \
    --lengths 1024 --positions 100 300 --splits 2 4 8 16 --block-t 64 --rounds 5 --replays 100 \
    --json "$OUT/decode_attention_splits.json" 2>&1 | tee "$OUT/decode_attention_splits.txt" | tail -4
if [ "${TESTS:-0}" = 1 ]; then
  timeout "$(left)" python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_engine_token_graph.py \
      tests/test_engine_graph_launch_probe.py 2>&1 | tail -8 | tee "$OUT/cuda_token_graph_tests.txt"
fi
