#!/usr/bin/env bash
# Issue 53: this build (the router's product in the fused GEMV, a softmax router's weights inside the slot MoE, the
# host's checks before the token is read) and its programmatic dependent launches (device_decisions.PDL_BY_DEFAULT,
# off as committed; switched on here in a copy of the package, _pdl), in two device calls on one warm machine
# (snapshot of HEAD with OLD=<commit>: the build before in _old; records under $OUT, the printed output in
# $OUT/log.txt):
#   PART=1: the token graph all resident and PSR at 50% replayed back to back (GPU time per token) and stepped (host
#           time, the host's checks alone) by the build before, this one and this one with PDL, in turn; then the
#           token graph's cuda tests (bitwise the host path) as committed;
#   PART=2: the token graph's cuda tests with PDL; the slot MoE's (its softmax weights compiled), the graphs', the
#           kernels' and FP8's cuda tests; then, in the time left, the kernels of every row and of the copies-skipped
#           twins of PSR and Cache-Prior under torch.profiler, with PSR's late prefetches counted on the device.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
if [ ! -d _pdl ]; then  # this build with PDL_BY_DEFAULT on, beside it
  mkdir -p _pdl && cp -r psr_hf _pdl/ && ln -sfn ../patches _pdl/patches 2>/dev/null
  sed -i 's/^PDL_BY_DEFAULT = False$/PDL_BY_DEFAULT = True/' _pdl/psr_hf/engine/device_decisions.py
  grep -q '^PDL_BY_DEFAULT = True$' _pdl/psr_hf/engine/device_decisions.py || { echo "PDL switch not found"; exit 1; }
fi
case "${PART:-1}" in
1)
  for build in new old pdl new old pdl; do
    [ "$(left)" -gt "${KEEP_S:-240}" ] || break
    echo "== token graph, build $build" | tee -a "$LOG"
    dir=.; [ "$build" = old ] && dir=_old; [ "$build" = pdl ] && dir=_pdl
    [ -d "$dir" ] || continue
    n=$(ls "$OUT"/profile_"$build"_*.json 2>/dev/null | wc -l)
    (cd "$dir" && PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout "$(cap 90)" python3 "$OLDPWD/benchmarks/engine/token_graph_profile.py" \
        --model grown-olmoe-routing --decide-warps 4 --rounds 3 --no-kernel-profile \
        --json "$OUT/profile_${build}_$n.json" 2>&1 | grep "==\|host checks" | tee -a "$LOG")
  done
  echo "== token graph cuda tests" | tee -a "$LOG"
  timeout "$(cap 400)" python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_engine_token_graph.py \
      2>&1 | tail -8 | tee -a "$LOG"
  ;;
2)
  echo "== token graph cuda tests, PDL on" | tee -a "$LOG"
  (cd _pdl && PYTHONPATH=$PWD timeout "$(cap 250)" python3 -m pytest -q -m cuda -p no:cacheprovider --rootdir "$OLDPWD" \
      "$OLDPWD/tests/test_engine_token_graph.py" 2>&1 | tail -8 | tee -a "$LOG")
  echo "== kernel cuda tests" | tee -a "$LOG"
  timeout "$(cap 250)" python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_engine_moe.py \
      tests/test_engine_graphs.py tests/test_engine_gemv_kernel.py tests/test_engine_decode_attention_kernel.py \
      tests/test_engine_device_decisions.py tests/test_engine_attention_kernels.py tests/test_engine_fp8.py 2>&1 \
      | tail -12 | tee -a "$LOG"
  if [ "$(left)" -gt 60 ]; then
    echo "== token graph kernels, with the twins" | tee -a "$LOG"
    PYTHONUNBUFFERED=1 timeout "$(cap 150)" python3 benchmarks/engine/token_graph_profile.py --model grown-olmoe-routing \
        --decide-warps 4 --rounds 2 --twins --count-late --json "$OUT/profile_kernels_twins.json" 2>&1 \
        | grep -v "Loading weights" \
        > "$OUT/profile_kernels_twins.txt"
    grep "==" "$OUT/profile_kernels_twins.txt" | tee -a "$LOG"
  fi
  ;;
esac
echo "== done at $((SECONDS - START)) s" | tee -a "$LOG"
