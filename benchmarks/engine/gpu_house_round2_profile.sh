#!/usr/bin/env bash
# House round 2: benchmarks/engine/profile_host.py (a cProfile of GraphDecoder steps per routing row) run by the
# build after the refactor and by the one before it (_old: that commit's psr_hf/, patches/ and profile_host.py,
# assets linked; carry _old), one process each:  device run:  bash benchmarks/engine/gpu_house_round2_profile.sh
set -uo pipefail
source benchmarks/device_env.sh
ROOT=$PWD
(cd _old && ln -sfn ../patches psr_hf/patches)
for build in new old; do
  if [ $build = old ]; then DIR=$ROOT/_old; else DIR=$ROOT; fi
  (cd $DIR && PYTHONPATH=$DIR timeout 200 python3 benchmarks/engine/profile_host.py --tokens 65 --top 40 --out "$OUT/profile_host_$build.txt" 2>&1 | grep "^==\|Error" | cut -c1-200)
  echo "$build done at $SECONDS s"
done
