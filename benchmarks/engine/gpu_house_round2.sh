#!/usr/bin/env bash
# The house round 2 checks on the lent GPU (a refactor: every decision and output unchanged), two device commands:
#   device run (carry _old):  STAGE=tests bash benchmarks/engine/gpu_house_round2.sh
#   device run (carry _old):  STAGE=ab bash benchmarks/engine/gpu_house_round2.sh
# STAGE=tests: psr-hf warm-up, then every cuda-marked test of the suite.
# STAGE=ab: the controller's host path alone (controller_host_path.py, old/new alternating), then the engine bench on grown-olmoe-routing (exact_lru and psr_lam0.3_n1 at 50%, with their copies-skipped
#   twins) run by the code before the refactor (_old: `git archive` of that commit's psr_hf/ and patches/, the
#   assets linked) and after it, alternating old/new/old/new, one process each, so the host time per MoE layer
#   and ms/token of the two builds are measured on one machine in one call.
set -uo pipefail
START=$SECONDS
ROOT=$PWD
source benchmarks/device_env.sh
if [ "${STAGE:-tests}" = tests ]; then
  timeout 90 python3 -m psr_hf.cli warm-up 2>&1 | tail -1
  timeout 480 python3 -m pytest -m cuda -q -p no:cacheprovider --continue-on-collection-errors tests 2>&1 | tail -40 > "$OUT/cuda_tests.txt"
  tail -4 "$OUT/cuda_tests.txt"
else
  (cd _old && ln -sfn ../patches psr_hf/patches)
  for i in 1 2 3 4; do
    for build in old new; do
      if [ $build = old ]; then DIR=$ROOT/_old; else DIR=$ROOT; fi
      for policy in psr exact; do
        echo -n "$build "; (cd /tmp && PYTHONPATH=$DIR timeout 60 python3 "$ROOT/benchmarks/engine/controller_host_path.py" \
            $policy 2>/dev/null | grep "host us")
      done
    done
  done 2>&1 | tee "$OUT/controller_host_path.txt"
  echo "host path done at $((SECONDS - START)) s"
  for build in ${BUILDS:-old new old new}; do
    if [ $build = old ]; then DIR=_old; else DIR=.; fi
    N=$(ls "$OUT" | grep -c "^bench_${build}.*json" || true)
    (cd $DIR && PYTHONPATH=$PWD timeout 140 python3 -m psr_hf.cli bench --model grown-olmoe-routing --engine \
        --hf-configs '' --configs exact_lru,psr_lam0.3_n1 --capacities 0.5 --no-accelerate \
        --rounds 3 --windows 2 --tokens 64 --warmup 1 --json "$OUT/bench_${build}_$N.json" \
        > "/tmp/bench_${build}_$N.txt" 2>/dev/null)
    echo "$build $N exit $? at $((SECONDS - START)) s"
    grep "^engine\|^engine host" "/tmp/bench_${build}_$N.txt" | cut -c1-250
  done
fi
echo "done at $((SECONDS - START)) s"
