#!/usr/bin/env bash
# SpecPrefetch on the CPU (2 cores), the shipped trained models: predictors, recall tables, psr with the learned
# pre-gate. Writes the records beside this script (OUT=... to change). Takes about 15 minutes. MODELS picks the
# models (moonlight-routing once `make moonlight-routing` has built it); EXTRA=0 leaves out the rank-24 and kl runs.
set -euo pipefail
OUT=${OUT:-benchmarks/prefetch}
PY=${PY:-.venv/bin/python}
STDLIB=$($PY -c "import textwrap, argparse, json.decoder as d, collections as c; print(textwrap.__file__, argparse.__file__, d.__file__, c.__file__)")
HELD=""; for f in $STDLIB; do HELD="$HELD --heldout-text $f"; done
for m in ${MODELS:-tiny-moe olmoe-routing moonlight-routing}; do
  $PY -m psr_hf.cli train-predictor --model $m --tokens 131072 --out "$OUT/predictor_$m.safetensors" \
      --dtype bf16 2>/dev/null | tee "$OUT/train_$m.txt"
  # held out: Persuasion (prose the models never saw) and the standard-library window modules (code, like training)
  $PY -m psr_hf.cli recall --model $m --predictor "$OUT/predictor_$m.safetensors" --train-tokens 131072 \
      --heldout-tokens 8192 --json "$OUT/recall_${m}_persuasion.json" 2>/dev/null | tee "$OUT/recall_${m}_persuasion.txt"
  $PY -m psr_hf.cli recall --model $m --predictor "$OUT/predictor_$m.safetensors" --train-tokens 131072 \
      --heldout-tokens 8192 $HELD --json "$OUT/recall_${m}_stdlib.json" 2>/dev/null | tee "$OUT/recall_${m}_stdlib.txt"
done
[ "${EXTRA:-1}" = 0 ] && exit 0
# the paper's relative size (r (D + E) / (E D) ~ 0.5 for its models): rank 24 on olmoe-routing
$PY -m psr_hf.cli recall --model olmoe-routing --rank 24 --train-tokens 131072 --heldout-tokens 8192 \
    --json "$OUT/recall_olmoe-routing_rank24_persuasion.json" 2>/dev/null | tee "$OUT/recall_olmoe-routing_rank24_persuasion.txt"
# PSR steered by the learned ranking against PSR with the plain pre-gate (paired over windows)
$PY -m psr_hf.cli kl --model olmoe-routing --predictor "$OUT/predictor_olmoe-routing.safetensors" --windows 8 \
    --tokens 256 --residencies 0.5,0.25 --lams 0.2,0.3 --json "$OUT/kl_olmoe-routing_predictor.json" 2>/dev/null \
    | tee "$OUT/kl_olmoe-routing_predictor.txt"
