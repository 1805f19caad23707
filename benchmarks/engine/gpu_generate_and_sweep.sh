#!/usr/bin/env bash
# Issue 53, Build 5's other two measurements, as one device call after gpu_vs_llamacpp.sh (snapshot of HEAD; records
# under $OUT): psr-hf bench-generate on grown-olmoe-routing (a 512-token prompt: the engine's prompt forward against
# transformers' in the same run, then 64 new tokens), and the sweep's timing stage for grown-olmoe-routing's main
# rows with exactly the settings of the committed divergence stage
# (benchmarks/sweep/cpu/prefetch_distance/grown-olmoe-routing_quality.json), so that the two join here afterwards:
#   psr-hf sweep <the same arguments> --stage all --json latency.json --join <that record>
# gives Table 2, the frontier and the orderings' verdicts without running either stage again.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
PYTHONUNBUFFERED=1 timeout "$(cap "${GENERATE_S:-200}")" python3 -m psr_hf.cli bench-generate --model grown-olmoe-routing \
    --rounds "${ROUNDS:-3}" --prompt-tokens 512 --new-tokens 64 --json "$OUT/bench_generate.json" 2>/dev/null \
    | tee "$OUT/bench_generate.txt" | tail -20
echo "== bench-generate done at $((SECONDS - START)) s"
PYTHONUNBUFFERED=1 timeout "$(left)" python3 -m psr_hf.cli sweep --model grown-olmoe-routing \
    --configs exact_a_pf,cp_lam0.2,psr_lam0.2_n1,psr_lam0.2_n1_d2,psr_lam0.3_n1,psr_lam0.3_n1_d2,psr_lam0.3_n2,psr_lam0.3_n2_d2 \
    --psr-distances 2 --selfgen-windows 16 --selfgen-tokens 256 --heldout-windows 8 --heldout-tokens 256 \
    --quality-device cpu --stage latency --json "$OUT/sweep_latency.json" 2>&1 | grep -v "Loading weights" \
    | tee "$OUT/sweep_latency.txt" | tail -20
echo "== done at $((SECONDS - START)) s"
