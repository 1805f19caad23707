#!/usr/bin/env bash
# Issue 53: the decision kernel with its loads issued together, and late prefetches in a real decode, in one device
# call (snapshot of HEAD with OLD=<commit>: the build before in _old; records under $OUT, the printed output in
# $OUT/log.txt):
#   1. `pytest -m cuda` over every test file that has a cuda test (WORKERS pytest-xdist workers, default 8);
#   2. the decision kernel alone (decide_kernel_bench.py), L2 warm (decisions replayed back to back) and cold (as
#      in a decode step), this build and the build before, warps 4 and 8;
#   3. the device's decisions against the numba kernels' on teacher-forced windows of every policy
#      (device_decisions_record.py), then `psr-hf bench --engine --count-late` on PSR at prefetch distances 1-3 and Cache-Prior at 50%: the
#      prefetches each layer still waited for in a teacher-forced decode (a diagnostic: the counting kernels are
#      timed with the rows);
#   4. the token graph replayed back to back, all resident and PSR at 50%, this build (decision kernel at 4 and 8
#      warps) and the build before (4 warps; token_graph_profile.py, with its kernels under torch.profiler).
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
cuda_suite "${TESTS_S:-150}"
for build in new old; do
  dir=.; [ "$build" = old ] && dir=_old
  [ -d "$dir" ] || continue
  for temp in cold warm; do
    [ "$(left)" -gt 60 ] || break
    flag=""; [ "$temp" = cold ] && flag="--cold"
    echo "== decision kernel, build $build, L2 $temp" | tee -a "$LOG"
    (cd "$dir" && PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout "$(cap 45)" python3 "$OLDPWD/benchmarks/engine/decide_kernel_bench.py" \
        $flag --warps 4 8 --rounds 3 --variants exact cache_prior psr_offloaded psr_offloaded_prior \
        --json "$OUT/decide_${build}_${temp}.json" 2>&1 | tee -a "$LOG")
  done
done
if [ "$(left)" -gt 250 ]; then
  echo "== the device's decisions against the numba kernels' on teacher-forced windows, every policy" | tee -a "$LOG"
  PYTHONUNBUFFERED=1 timeout "$(cap 50)" python3 benchmarks/engine/device_decisions_record.py --model olmoe-routing \
      --windows 2 --tokens 128 --json "$OUT/device_decisions_record.json" 2>&1 | grep -v "Loading weights" \
      > "$OUT/device_decisions_record.txt"; tail -3 "$OUT/device_decisions_record.txt" | tee -a "$LOG"
fi
if [ "$(left)" -gt 200 ]; then
  echo "== late prefetches in a teacher-forced decode (psr-hf bench --count-late)" | tee -a "$LOG"
  PYTHONUNBUFFERED=1 timeout "$(cap "${LATE_S:-170}")" python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine --count-late \
      --configs "${LATE_CONFIGS:-cp_lam0.2,psr_lam0.3_n1,psr_lam0.3_n1_d2,psr_lam0.3_n1_d3}" --hf-configs '' \
      --no-accelerate --capacities 0.5 --rounds 3 --windows 2 --tokens 64 --json "$OUT/bench_count_late.json" 2>&1 \
      | grep -v "Loading weights\|^bench:" > "$OUT/bench_count_late.txt"
  head -20 "$OUT/bench_count_late.txt" | tee -a "$LOG"
fi
for build in new old; do
  dir=.; warps="4 8"; [ "$build" = old ] && { dir=_old; warps=4; }
  [ -d "$dir" ] && [ "$(left)" -gt 60 ] || continue
  echo "== token graph, build $build" | tee -a "$LOG"
  (cd "$dir" && PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout "$(cap 130)" python3 "$OLDPWD/benchmarks/engine/token_graph_profile.py" \
      --model grown-olmoe-routing --decide-warps $warps --rounds 2 \
      --json "$OUT/profile_${build}.json" 2>&1 | grep -v "Loading weights" > "$OUT/profile_${build}.txt"
   grep "==\|decide_kernel\|gate_up_kernel\|down_kernel\|linear_many" "$OUT/profile_${build}.txt" | tee -a "$LOG")
done
echo "== done at $((SECONDS - START)) s" | tee -a "$LOG"
