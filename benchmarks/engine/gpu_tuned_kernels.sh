#!/usr/bin/env bash
# Issue 53, kernels toward the memory bound, as one device call (snapshot of HEAD, with OLD=<commit> the build
# before for the same-call baseline; records under $OUT, the printed output in $OUT/log.txt). In order, within
# TOTAL_S: the cuda tests of the kernels that changed; the slot MoE's tiles and the fused GEMV's configurations
# swept, the ones shown faster written into the package's tuned-tiles table (psr_hf/engine/tuned_tiles.json, copied
# to $OUT and to /tmp for a chained call); the decode attention in one launch against two; the token graph's cuda
# tests with the table; then the token graph all resident and PSR at 50% replayed back to back (GPU time per token)
# and stepped (host time), by the build before (_old) and this one, alternately.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
LOG=$OUT/log.txt
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
  *H200*) HBM=4800 ;;
  *) HBM=3350 ;;
esac
TABLE=psr_hf/engine/tuned_tiles.json
echo "== kernel cuda tests" | tee -a "$LOG"
timeout "$(cap "${KTEST_S:-130}")" python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_engine_moe.py \
    tests/test_engine_gemv_kernel.py tests/test_engine_decode_attention_kernel.py \
    tests/test_engine_attention_kernels.py tests/test_engine_device_decisions.py 2>&1 | tail -12 | tee -a "$LOG"
echo "== slot MoE tiles" | tee -a "$LOG"
PYTHONUNBUFFERED=1 timeout "$(cap "${TILES_S:-150}")" python3 benchmarks/engine/moe_tiles_bench.py --hbm-gbps "$HBM" \
    --table "$TABLE" --json "$OUT/moe_tiles.json" 2>&1 | tee -a "$LOG" | tail -6
echo "== fused GEMV configurations" | tee -a "$LOG"
PYTHONUNBUFFERED=1 timeout "$(cap "${GEMV_S:-60}")" python3 benchmarks/engine/gemv_bench.py --shapes qkv o_proj \
    --hbm-tbps "$(python3 -c "print($HBM / 1000)")" --table "$TABLE" --configs auto 4x512x4x1 8x512x4x1 \
    2x1024x4x1 4x1024x4x1 4x1024x8x1 8x1024x8x1 2x2048x4x1 4x2048x4x1 4x2048x8x1 4x512x4x1x1 4x1024x4x1x1 \
    4x2048x4x1x1 4x512x4x1x1x1 4x1024x4x1x1x1 4x2048x4x1x1x1 --json "$OUT/gemv.json" 2>&1 | tee -a "$LOG" \
    | grep -v "^  [0-9]" | tail -8
cp "$TABLE" "$OUT/tuned_tiles.json"; cp "$TABLE" /tmp/tuned_tiles.json
echo "== decode attention, one launch against two" | tee -a "$LOG"
PYTHONUNBUFFERED=1 timeout "$(cap "${ATT_S:-40}")" python3 benchmarks/engine/decode_attention_bench.py \
    --lengths 1024 --positions 100 500 --rounds 5 --replays 100 --json "$OUT/decode_attention.json" 2>&1 \
    | tee -a "$LOG" | tail -6
echo "== token graph cuda tests" | tee -a "$LOG"
timeout "$(cap "${TG_S:-150}")" python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_engine_token_graph.py \
    2>&1 | tail -8 | tee -a "$LOG"
for build in old new old new; do
  [ "$(left)" -gt 50 ] || break
  echo "== token graph, build $build" | tee -a "$LOG"
  dir=.; [ "$build" = old ] && dir=_old
  [ -d "$dir" ] || continue
  (cd "$dir" && PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout "$(cap 80)" python3 "$OLDPWD/benchmarks/engine/token_graph_profile.py" \
      --model grown-olmoe-routing --decide-warps 4 --rounds 3 --no-kernel-profile \
      --json "$OUT/profile_${build}.json" 2>&1 | grep "==" | tee -a "$LOG")
done
