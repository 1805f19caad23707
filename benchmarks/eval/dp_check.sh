#!/usr/bin/env bash
# Data-parallel lm-eval with psr_hf: `accelerate launch` over 2 GPUs against one process, per-sample results compared.
# Runs on a machine with 2 GPUs and psr_hf[eval] installed; OUT: where results go (default out/dp_check).
#   bash benchmarks/eval/dp_check.sh
set -uo pipefail
OUT=${OUT:-out/dp_check}
MODEL=${MODEL:-$OUT/tiny_olmoe}
LIMIT=${LIMIT:-24}
mkdir -p "$OUT"
[ -d "$MODEL" ] || python3 -c "from psr_hf.testing import save_tiny; save_tiny('olmoe', '$MODEL')"
ARGS="pretrained=$MODEL,dtype=float32,policy=psr,lam=0.3,budget=1,residency=0.5"
COMMON=(--model psr_hf --include_path eval_configs/tasks --tasks psr_mmlu_exemplars,psr_heldout_ppl,psr_humaneval_local
        --confirm_run_unsafe_code --limit "$LIMIT" --batch_size 4 --gen_kwargs max_gen_toks=24 --log_samples)
LAUNCH=(accelerate launch --num_processes 2 --num_machines 1 --multi_gpu --mixed_precision no --dynamo_backend no)
run() {
  local name=$1; shift; local t0=$SECONDS
  "$@" --output_path "$OUT/$name" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || tail -15 "$OUT/$name.log"
}
run single python3 -m lm_eval "${COMMON[@]}" --device cuda:0 --model_args "$ARGS"
run dp "${LAUNCH[@]}" -m lm_eval "${COMMON[@]}" --model_args "$ARGS"
run single_offload python3 -m lm_eval "${COMMON[@]}" --device cuda:0 --model_args "$ARGS,offload=cuda:0"
run dp_offload "${LAUNCH[@]}" -m lm_eval "${COMMON[@]}" --model_args "$ARGS,offload=cuda"
for pair in "single dp" "single_offload dp_offload" "single single_offload"; do
  set -- $pair
  python3 benchmarks/eval/dp_equivalence.py "$OUT/$1" "$OUT/$2" --json "$OUT/equal_$1_$2.json" || true
done
