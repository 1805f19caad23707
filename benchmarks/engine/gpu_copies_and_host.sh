#!/usr/bin/env bash
# Issue 53: where the token graph loses time when it copies experts and when the host launches it, as one device
# call (snapshot of HEAD; records under $OUT). First what one graph launch costs the host by the graph's size
# (graph_launch_probe.py: by shape, after another operation, with N graphs alive, before and after torch.profiler),
# then the copy kernel against the DMA engines (copy_kernel_bench.py: programs x block sizes, GB/s), the token
# graph's launch and host time per step without torch.profiler in the process (token_graph_launch.*), then its
# profile (token_graph_profile.py: its GPU time per token
# replayed back to back, the host's time per step with cProfile's split, the kernels by device time) all resident
# and PSR at 50%, with 4 decision warps; with TESTS=1 the token graph's cuda tests run first. On the lent H100 of 2026-12-07 the token graph was slower than the host
# path whenever it copied (0.77x at 50%): this says whether its copies or its launch are why. TOTAL_S bounds the call.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
if [ "${TESTS:-0}" = 1 ]; then  # first, the token graph's cuda tests (the reset after a reconfigure, the inputs' ring)
  timeout "$(cap "${TESTS_S:-300}")" python3 -m pytest -q -m cuda tests/test_engine_token_graph.py 2>&1 | tail -4 \
      | tee "$OUT/cuda_token_graph_tests.txt"
fi
PYTHONUNBUFFERED=1 timeout "$(cap "${PROBE_S:-60}")" python3 benchmarks/engine/graph_launch_probe.py \
    --json "$OUT/graph_launch.json" 2>&1 | tee "$OUT/graph_launch.txt"
PYTHONUNBUFFERED=1 timeout "$(cap "${COPY_S:-120}")" python3 benchmarks/engine/copy_kernel_bench.py \
    --json "$OUT/copy_kernel.json" 2>&1 | tee "$OUT/copy_kernel.txt"
PYTHONUNBUFFERED=1 timeout "$(cap "${CLEAN_S:-150}")" python3 benchmarks/engine/token_graph_profile.py \
    --model grown-olmoe-routing --decide-warps 4 --rounds 3 --no-kernel-profile \
    --json "$OUT/token_graph_launch.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/token_graph_launch.txt" \
    | grep "=="
PYTHONUNBUFFERED=1 timeout "$(left)" python3 benchmarks/engine/token_graph_profile.py --model grown-olmoe-routing \
    --decide-warps 4 --json "$OUT/token_graph_profile.json" 2>&1 | grep -v "Loading weights" \
    | tee "$OUT/token_graph_profile.txt" | tail -60
