#!/usr/bin/env bash
# The house round 3 refactor's GPU run (issue 50: behaviour and speed unchanged), from the snapshot that
# benchmarks/device_snapshot.sh packs with OLD=<the commit before the refactor>:
#   device run (carry .gpu):  bash .gpu/unpack.sh && cd /tmp/snap && STAGE=ab bash benchmarks/engine/gpu_house_round3.sh
# STAGE=tests: psr-hf warm-up, then the cuda tests of the files named in TESTS (default: the engine's and the copy
#   runtime's), the tail under $OUT/cuda_tests.txt.
# STAGE=ab: the controller's host path alone (controller_host_path.py) old/new alternating, then psr-hf bench --engine
#   on grown-olmoe-routing (exact_lru and psr_lam0.3_n1 at 50% with their copies-skipped twins, 3 interleaved rounds
#   of 2 windows x 64 tokens; the host decides per layer, --device-routing off: the old build's token graph has a
#   capture fault fixed since) by the old build (_old/) and the new one in alternating processes, old new new old ...
#   (so neither build is always the first or the last process), until AB_S seconds are spent; the records are tarred
#   into $OUT/house_round3_bench.tar.gz and compared by benchmarks/engine/old_vs_new.py.
set -uo pipefail
START=$SECONDS
ROOT=$PWD
source benchmarks/device_env.sh
if [ "${STAGE:-tests}" = tests ]; then
  timeout 90 python3 -m psr_hf.cli warm-up 2>&1 | tail -1
  timeout "${TEST_S:-400}" python3 -m pytest -m cuda -q -p no:cacheprovider ${TESTS:-tests/test_engine_*.py tests/test_prefetch_runtime.py} \
      2>&1 | tail -40 > "$OUT/cuda_tests.txt"
  tail -6 "$OUT/cuda_tests.txt"
else
  [ -d _old ] || { echo "no _old/: pack the snapshot with OLD=<commit> (benchmarks/device_snapshot.sh)"; exit 2; }
  for build in old new; do
    if [ $build = old ]; then DIR=$ROOT/_old; else DIR=$ROOT; fi
    (cd /tmp && PYTHONPATH=$DIR timeout 90 python3 -m psr_hf.cli warm-up 2>&1 | tail -1)
  done
  for i in 1 2; do
    for build in old new; do
      if [ $build = old ]; then DIR=$ROOT/_old; else DIR=$ROOT; fi
      for policy in psr exact; do
        echo -n "$build "; (cd /tmp && PYTHONPATH=$DIR timeout 60 python3 "$ROOT/benchmarks/engine/controller_host_path.py" \
            $policy 2>/dev/null | grep "host us")
      done
    done
  done 2>&1 | tee "$OUT/controller_host_path.txt"
  echo "host path done at $((SECONDS - START)) s"
  mkdir -p /tmp/ab
  N=0
  for build in old new new old old new new old old new new old; do
    [ $((SECONDS - START)) -lt "${AB_S:-520}" ] || break
    if [ $build = old ]; then DIR=_old; else DIR=.; fi
    (cd $DIR && PYTHONPATH=$PWD timeout 120 python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine \
        --hf-configs '' --configs exact_lru,psr_lam0.3_n1 --capacities 0.5 --no-accelerate --device-routing off \
        --rounds 3 --windows 2 --tokens 64 --warmup 1 --json "/tmp/ab/bench_${build}_$N.json" \
        > "/tmp/ab/bench_${build}_$N.txt" 2>&1)
    echo "$build $N exit $? at $((SECONDS - START)) s"
    grep "^engine" "/tmp/ab/bench_${build}_$N.txt" | cut -c1-160
    N=$((N + 1))
  done
  (cd /tmp/ab && tar czf "$OUT/house_round3_bench.tar.gz" bench_*)
  python3 benchmarks/engine/old_vs_new.py /tmp/ab --json "$OUT/old_vs_new.json" 2>&1 | tee "$OUT/old_vs_new.txt"
fi
echo "done at $((SECONDS - START)) s"
