#!/usr/bin/env bash
# lm-eval runs of the paper's Section 6.10 comparison on olmoe-routing (float32, CPU, 37.5% residency): exact
# routing, the untrained rules at the trained variants' lam and at their matched copies, and the trained variants of
# benchmarks/gates/frontier.py (--keep TRAINED). Offline tasks of eval_configs/tasks, all their documents.
# Usage: benchmarks/gates/lm_eval_runs.sh TRAINED OUT [RUN ...]   (RUN: a name below; default all)
set -euo pipefail
trained=$1 out=$2
shift 2
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
base="pretrained=olmoe-routing,dtype=float32,residency=0.375"
declare -A runs=(
  [exact]="policy=exact"
  [cache_prior_lam0.1]="policy=cache_prior,lam=0.1,eviction=lru"
  [cache_prior_lam0.15]="policy=cache_prior,lam=0.15,eviction=lru"
  [psr_lam0.2]="policy=psr,lam=0.2,budget=1"
  [psr_lam0.3]="policy=psr,lam=0.3,budget=1"
  [swap]="policy=cache_prior,lam=0.1,eviction=lru,distilled=$trained/swap"
  [psr_distilled]="policy=psr,lam=0.3,budget=1,distilled=$trained/psr_distilled"
  [bonus]="policy=psr,lam=0.3,budget=1,distilled=$trained/bonus"
)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(exact cache_prior_lam0.1 cache_prior_lam0.15 psr_lam0.2 psr_lam0.3 swap psr_distilled bonus)
for name in "${names[@]}"; do
  lm-eval --model psr_hf --model_args "$base,${runs[$name]}" --include_path eval_configs/tasks \
      --tasks psr_mmlu_exemplars,psr_heldout_ppl,psr_heldout_continuation --batch_size 8 --log_samples \
      --output_path "$out/$name"
done
