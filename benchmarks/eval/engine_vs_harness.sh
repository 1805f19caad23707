#!/usr/bin/env bash
# lm-eval's generate_until through the engine (engine=true) and through the harness (engine=false) for the paper's
# Table 5 configurations: psr_heldout_continuation on grown-olmoe-routing, experts 50% offloaded, --log_samples.
# On the lent GPU, from the repository root, with .lm_eval_wheels carried (lm-eval and the packages it needs
# that the GPU image lacks):
#   CONFIGS="exact_lru_res50 cp_lam0.2_res50" bash benchmarks/eval/engine_vs_harness.sh
# One tarball comes back: $OUT/engine_vs_harness.tgz (RUN_harness/, RUN_engine/ and their logs), rewritten after
# every configuration. LIMIT=N runs the first N documents.
# .lm_eval_wheels is not committed; make it where these install:
#   pip download --no-deps -d .lm_eval_wheels lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.0 \
#     multiprocess==0.70.18 more-itertools==11.2.1 pytablewriter==1.2.1 dataproperty==1.1.1 mbstrdecoder==1.1.5 \
#     tabledata==1.3.5 typepy==1.3.5 tcolorpy==0.1.7 pathvalidate==3.3.1 chardet==5.2.0 pytz==2026.6
# (the run recorded here used an lm-eval wheel with its bundled task folders removed, 2.3 MB in all, to stay within
# the device tree's limit; only the include-path task runs)
set -uo pipefail
START=$SECONDS
MODEL=${MODEL:-grown-olmoe-routing}
DEVICE=${DEVICE:-cuda:0}
OFFLOAD=${OFFLOAD:-cuda}
CONFIGS=${CONFIGS:-exact_lru_res50 cp_lam0.2_res50 psr_lam0.3_n1_res50 psr_lam0.2_n1_res50}
WORK=${WORK:-/tmp/engine_vs_harness}
[ -f benchmarks/device_env.sh ] && source benchmarks/device_env.sh
if ! python3 -c "import lm_eval" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .lm_eval_wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$WORK"
for config in $CONFIGS; do
  for impl in harness:false engine:true; do
    name=${config}_${impl%%:*}
    t0=$SECONDS
    timeout 200 python3 -m psr_hf.cli eval run --model psr_hf --include_path eval_configs/tasks \
        --tasks psr_heldout_continuation ${LIMIT:+--limit $LIMIT} --device "$DEVICE" --batch_size 16 --log_samples \
        --output_path "$WORK/$name" \
        --model_args "pretrained=$MODEL,config=eval_configs/runs/olmoe/$config.yaml,offload=$OFFLOAD,engine=${impl#*:}" \
        > "$WORK/$name.log" 2>&1
    echo "$name: exit $?, $((SECONDS - t0)) s; $(grep -ho 'psr_hf engine: .*' "$WORK/$name.log" | tail -1)"
  done
  # after every configuration, so that a call stopped at its time limit still returns what finished
  tar -czf "${OUT:-.}/engine_vs_harness.tgz" -C "$WORK" .
done
echo "done at $((SECONDS - START)) s"
