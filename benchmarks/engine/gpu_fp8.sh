#!/usr/bin/env bash
# Issue 49's FP8 measurements on the lent GPU, one device command (from the snapshot of benchmarks/device_snapshot.sh):
#   bash .gpu/unpack.sh && cd /tmp/snap && bash benchmarks/engine/gpu_fp8.sh
# 1. the cuda tests of the FP8 slot MoE and of the engine in FP8;
# 2. benchmarks/engine/moe_fp8_bench.py: the FP8 slot MoE against the bf16 one in CUDA graphs of layers;
# 3. olmoe-routing grown to OLMoE-1B-7B's dimensions (psr-hf grow, bf16), written as an FP8 checkpoint
#    (psr-hf quantize), and psr-hf bench --engine on both folders in alternating processes (bf16 fp8 fp8 bf16 ...):
#    ms/token all resident and at 50% (exact_lru, cp_lam0.2, psr_lam0.3_n1 with their copies-skipped twins), the
#    copies' bytes and wait per token (CAPACITIES, default 1.0,0.5: at 1.0 every expert sits in a slot of the
#    offload's store, the FP8 folder's rows all resident in FP8, which the resident row is not), until TOTAL_S
#    seconds are spent (CONFIGS: the routed rows; KERNEL_S=0 skips step 2); with AGREE_S=<seconds>, first the
#    Section 6.9 check on the FP8 folder (engine_agreement.py --offload); with DENSE_S=<seconds>, the FP8 dense
#    projections against the model's weights in interleaved rounds (token_graph_vs_host.py --dense-model).
#    Records under $OUT.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
HBM=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo 4800 || echo 3350)
timeout "${TEST_S:-120}" python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_engine_moe_fp8.py \
    tests/test_engine_fp8.py 2>&1 | tail -30 > "$OUT/fp8_cuda_tests.txt"
tail -6 "$OUT/fp8_cuda_tests.txt"
[ "${KERNEL_S:-100}" = 0 ] || timeout "${KERNEL_S:-100}" python3 benchmarks/engine/moe_fp8_bench.py --json "$OUT/moe_fp8.json" --hbm-gbps "$HBM" \
    > "$OUT/moe_fp8.txt" 2>&1
tail -12 "$OUT/moe_fp8.txt"
timeout 240 python3 -m psr_hf.cli grow --model olmoe-routing --target olmoe-1b-7b --dtype bf16 --device cuda \
    --out /tmp/olmoe-bf16 2>&1 | tail -2
timeout 240 python3 -m psr_hf.cli quantize /tmp/olmoe-bf16 /tmp/olmoe-fp8 2>&1 | tail -2
echo "checkpoints written at $((SECONDS - START)) s"
if [ "${AGREE_S:-0}" != 0 ]; then  # the paper's Section 6.9 check on the FP8 folder, offloaded (FP8 experts and, on
  # the GPU, FP8 dense projections): perplexity under exact routing and PSR's NLL change, engine against the HF path
  timeout "$AGREE_S" python3 benchmarks/engine/engine_agreement.py --model /tmp/olmoe-fp8 --offload --windows 17 \
      --tokens 256 --decode-windows 0 --rows psr_lam0.2_n1 --residency 0.25 --json "$OUT/fp8_agreement.json" 2>&1 \
      | grep -v "Loading weights\|Warning\|warn" | tail -4 | tee "$OUT/fp8_agreement.txt"
fi
if [ "${DENSE_S:-0}" != 0 ]; then  # the FP8 dense projections against the model's weights, side by side
  timeout "$DENSE_S" python3 benchmarks/engine/token_graph_vs_host.py --model /tmp/olmoe-fp8 --dense-model \
      --rows exact_lru@1.0 psr_lam0.3_n1@0.5 --tokens 64 --rounds 5 --json "$OUT/dense_fp8_ab.json" 2>&1 \
      | grep -v "Loading weights\|Warning\|warn" | tail -12 | tee "$OUT/dense_fp8_ab.txt"
fi
mkdir -p /tmp/fp8
N=0
for format in bf16 fp8 fp8 bf16 bf16 fp8 fp8 bf16; do
  [ $((SECONDS - START)) -lt "${TOTAL_S:-450}" ] || break
  timeout 130 python3 -m psr_hf.cli bench --model /tmp/olmoe-$format --engine --hf-configs '' \
      --configs "${CONFIGS:-exact_lru,cp_lam0.2,psr_lam0.3_n1}" --capacities "${CAPACITIES:-1.0,0.5}" --no-accelerate --rounds 3 --windows 2 \
      --tokens 64 --warmup 1 --json "/tmp/fp8/bench_${format}_$N.json" > "/tmp/fp8/bench_${format}_$N.txt" 2>&1
  echo "$format $N exit $? at $((SECONDS - START)) s"
  grep "^engine" "/tmp/fp8/bench_${format}_$N.txt" | cut -c1-160
  N=$((N + 1))
done
(cd /tmp/fp8 && tar czf "$OUT/fp8_bench.tar.gz" bench_*)
echo "done at $((SECONDS - START)) s"
