#!/usr/bin/env bash
# The house round 3 refactor's speed on this machine's CPU (issue 50), old build against new in alternating
# processes: psr-hf bench --engine (the engine's eager step, no CUDA graphs) on the shipped olmoe-routing, exact_lru
# and psr_lam0.3_n1 at 50% with their copies-skipped twins, 3 interleaved rounds of 2 windows x 32 tokens, twelve
# processes old new new old ..., then benchmarks/engine/old_vs_new.py. From the repository root, with .venv:
#   OLD=8017a47 OUT=/tmp/cpu_ab bash benchmarks/engine/cpu_house_round3.sh
set -euo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/cpu_ab}
rm -rf /tmp/old_build "$OUT" && mkdir -p /tmp/old_build "$OUT"
git archive "${OLD:?the commit before the refactor}" psr_hf patches | tar x -C /tmp/old_build
ln -sfn ../patches /tmp/old_build/psr_hf/patches
(cd /tmp && PYTHONPATH=/tmp/old_build "$ROOT/.venv/bin/python" -m psr_hf.cli warm-up > /dev/null 2>&1)
N=0
for build in old new new old old new new old old new new old; do
  if [ $build = old ]; then DIR=/tmp/old_build; else DIR=$ROOT; fi
  (cd /tmp && PYTHONPATH=$DIR timeout 300 "$ROOT/.venv/bin/python" -m psr_hf.cli bench --model olmoe-routing --engine \
      --hf-configs '' --configs exact_lru,psr_lam0.3_n1 --capacities 0.5 --rounds 3 --windows 2 --tokens 32 \
      --warmup 1 --json "$OUT/bench_${build}_$N.json" > "$OUT/bench_${build}_$N.txt" 2>&1)
  echo "$build $N done"
  N=$((N + 1))
done
"$ROOT/.venv/bin/python" benchmarks/engine/old_vs_new.py "$OUT" --json "$OUT/old_vs_new.json"
