#!/usr/bin/env bash
# The latency stage of `psr-hf sweep` on the lent GPU, continuing a committed record whose divergence stage ran on
# the CPU (the grown model's small float32 twin computes the same function):
#   device run:  bash benchmarks/sweep/gpu_sweep.sh grown-olmoe-routing
# It copies benchmarks/sweep/MODEL.json to $OUT (unless $OUT already holds it), times the rows for MINUTES
# (default 7: a round started before then still ends inside the 10-minute command limit) and writes the record back to $OUT, with the frontier plot and
# the Markdown tables once it is complete (exit 0; exit 3: incomplete, run again with the returned record put back
# in benchmarks/sweep/). The sweep's settings must be the ones the record was started with (SETTINGS below).
#
# grown-moonlight-routing: a sweep belongs to one set of model files (benchmarks/grown/moonlight_routing_sha256.txt
# names the ones behind the committed divergence record), and moonlight-routing is built, not shipped: it does not
# fit beside the tree in one device command, and a rebuild differs (cuDNN attention backward is not deterministic).
# So its sweep starts from a new record, timing first, on the machine that built the model, within its idle window
# (files written into ignored folders stay while the machine is warm; carry ["shards_xz"] for the build):
#   PSR_HF_MODELS=$PWD/.models bash benchmarks/grown/gpu_moonlight.sh             # 8.5 min; the model comes back
#   NEW=1 STAGE=latency PSR_HF_MODELS=$PWD/.models bash benchmarks/sweep/gpu_sweep.sh grown-moonlight-routing
# then, on the CPU with the returned model unpacked into ~/.cache/psr_hf/models/:
#   psr-hf sweep --model grown-moonlight-routing --device cuda:0 <SETTINGS below> --stage quality --json RECORD
#   psr-hf sweep ... --stage all --json RECORD --plot ... --markdown ...          # joins both (no device needed)
#
# grown-qwen36-routing (Section 6.9; benchmarks/qwen36/): the model is built (benchmarks/qwen36/gpu_qwen36.sh) and
# carried xz-compressed (benchmarks/qwen36/qwen36_routing_sha256.txt names its files); the divergence stage runs on
# the CPU while the GPU times, and the two records are joined:
#   psr-hf sweep --model grown-qwen36-routing --device cuda:0 <SETTINGS> --stage quality --json QUALITY   # CPU
#   NEW=1 STAGE=latency PSR_HF_MODELS=$PWD/.models bash benchmarks/sweep/gpu_sweep.sh grown-qwen36-routing   # GPU
#   psr-hf sweep --model grown-qwen36-routing --device cuda:0 <SETTINGS> --join QUALITY --json RECORD ...  # CPU
set -uo pipefail
MODEL=${1:-grown-olmoe-routing}
source benchmarks/device_env.sh
# the Moonlight shape (26 MoE layers, 3 residencies) times the paper's main rows only, so that it fits one
# session's device time after its build: exact+LRU, exact+A+prefetch, spec, Cache-Prior (LRU) and PSR n=1 (A) at
# every lam; CONFIGS= (empty) times the whole grid
LAMS="0.1 0.15 0.2 0.25 0.3"
MAIN="exact_lru,exact_a_pf,spec$(for l in $LAMS; do printf ',cp_lam%s,psr_lam%s_n1' "$l" "$l"; done)"
# the Qwen3.6 shape (Section 6.9, Figure 6): exact+LRU, exact+A+prefetch, and per lam 0.1, 0.2, 0.3 Cache-Prior (LRU),
# Cache-Prior with the router's top-2 kept, PSR n=1 with the architecture's pre-gate window of 4 and with 2
QWEN36="exact_lru,exact_a_pf$(for l in 0.1 0.2 0.3; do printf ',cp_lam%s,cp_lam%s_j2,psr_lam%s_n1,psr_lam%s_n1_w2' "$l" "$l" "$l" "$l"; done)"
EXTRA=""
case "$MODEL" in
  grown-moonlight-routing) RES=0.5,0.375,0.25; CONFIGS=${CONFIGS-$MAIN} ;;
  grown-qwen36-routing) RES=0.5,0.375,0.25; CONFIGS=${CONFIGS-$QWEN36}; EXTRA="--lams 0.1,0.2,0.3 --psr-windows 2" ;;
  *) RES=0.5,0.25; CONFIGS=${CONFIGS-} ;;
esac
SETTINGS="--residencies $RES --selfgen-windows 16 --heldout-windows 8 --quality-device cpu${EXTRA:+ $EXTRA}${CONFIGS:+ --configs $CONFIGS}"
[ -f "$OUT/$MODEL.json" ] || [ -n "${NEW:-}" ] || cp "benchmarks/sweep/$MODEL.json" "$OUT/$MODEL.json"
python3 -m psr_hf.cli sweep --model "$MODEL" --device cuda:0 $SETTINGS --stage "${STAGE:-all}" --max-minutes "${MINUTES:-7}" \
    --json "$OUT/$MODEL.json" --plot "$OUT/$MODEL.png" --markdown "$OUT/$MODEL.md" 2>"$OUT/$MODEL.err"
status=$?
grep -v "it/s\]\|row/s\]" "$OUT/$MODEL.err" | tail -5
echo "psr-hf sweep exit $status"
