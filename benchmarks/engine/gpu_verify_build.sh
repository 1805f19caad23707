#!/usr/bin/env bash
# Issue 53: the whole cuda test suite of this build, then its token graph beside the build before, in one device call
# (snapshot of HEAD with OLD=<commit>: the build before in _old; records under $OUT, the printed output in
# $OUT/log.txt):
#   1. `pytest -m cuda` over every test file that has a cuda test, on WORKERS (default 8) pytest-xdist workers sharing the GPU (the
#      compilers' work is most of a fresh machine's test time, and it is the CPU's): failures with their short
#      tracebacks in $OUT/cuda_tests.txt;
#   2. in the time left, the token graph all resident and PSR at 50% replayed back to back (GPU time per token) and
#      stepped (host time) by this build and the build before (token_graph_profile.py records);
#   3. then this build's kernels under torch.profiler, with the copies-skipped twins and PSR's late prefetches.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
cuda_suite "${TESTS_S:-400}"
for build in new old; do
  [ "$(left)" -gt 100 ] || break
  dir=.; [ "$build" = old ] && dir=_old
  [ -d "$dir" ] || continue
  echo "== token graph, build $build" | tee -a "$LOG"
  n=$(ls "$OUT"/profile_"$build"_*.json 2>/dev/null | wc -l)
  (cd "$dir" && PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout "$(cap 90)" python3 "$OLDPWD/benchmarks/engine/token_graph_profile.py" \
      --model grown-olmoe-routing --decide-warps 4 --rounds 3 --no-kernel-profile \
      --json "$OUT/profile_${build}_$n.json" 2>&1 | grep "==\|host checks" | tee -a "$LOG")
done
if [ "$(left)" -gt 80 ]; then
  echo "== token graph kernels, with the twins and late prefetches counted" | tee -a "$LOG"
  PYTHONUNBUFFERED=1 timeout "$(cap 150)" python3 benchmarks/engine/token_graph_profile.py --model grown-olmoe-routing \
      --decide-warps 4 --rounds 2 --twins --count-late --json "$OUT/profile_kernels_twins.json" 2>&1 \
      | grep -v "Loading weights" > "$OUT/profile_kernels_twins.txt"
  grep "==" "$OUT/profile_kernels_twins.txt" | tee -a "$LOG"
fi
echo "== done at $((SECONDS - START)) s" | tee -a "$LOG"
