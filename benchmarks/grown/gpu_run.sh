#!/usr/bin/env bash
# One device command (10-minute limit): train olmoe-routing and moonlight-routing at once on one GPU, calibrate
# olmoe-routing on the calib split, and run `psr-hf bench` on it grown to OLMoE-1B-7B's size (bf16).
#   device run, carry ["shards_tiny_moe"]:  bash benchmarks/grown/gpu_run.sh
set -uo pipefail
START=$SECONDS
MINUTES=${MINUTES:-3.5}
RUNS=${RUNS:-$(mktemp -d)}
# the source tree as psr_hf (patches/ is shipped as psr_hf.patches)
source benchmarks/device_env.sh
python3 -c "import psr_hf.patches, psr_hf.hf" || exit 1
export CUBLAS_WORKSPACE_CONFIG=:4096:8
ARCHS=${ARCHS:-olmoe-routing moonlight-routing}  # all at once on the one GPU (they share it: slower steps)
for arch in $ARCHS; do
    mkdir -p "$OUT/$arch"
    PYTHONUNBUFFERED=1 python3 examples/train_tiny_moe/train.py --arch "$arch" --shards shards_tiny_moe \
        --out "$RUNS/$arch" --minutes "$MINUTES" --batch 128 > "$OUT/$arch/train_stdout.log" 2>&1 &
done
wait
for arch in $ARCHS; do
    cp -r "$RUNS/$arch/model" "$OUT/$arch/" 2>/dev/null; cp "$RUNS/$arch/train_log.json" "$OUT/$arch/" 2>/dev/null
    tail -4 "$OUT/$arch/train_stdout.log"
done
echo "trained at $((SECONDS - START)) s"
rm -rf psr_hf/assets/olmoe_routing && cp -r "$RUNS/olmoe-routing/model" psr_hf/assets/olmoe_routing || exit 1
python3 - <<'PY'
import numpy as np, torch, psr_hf, os
from psr_hf.assets import OLMOE_ROUTING
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(OLMOE_ROUTING, dtype=torch.float32).cuda().eval()
calib = np.fromfile("shards_tiny_moe/calib.bin", dtype=np.uint16).astype(np.int64)
rows = min(calib.size // 512, 256)
ids = torch.from_numpy(calib[: rows * 512].reshape(rows, 512)).cuda()
cal = psr_hf.calibrate(model, ids, batch_size=16, progress=False)
cal.save(OLMOE_ROUTING / "calibration.safetensors")
cal.save(os.environ["OUT"] + "/olmoe-routing/calibration_gpu.safetensors")
print("calibrated on", rows * 512, "tokens")
PY
echo "calibrated at $((SECONDS - START)) s"
LEFT=$((585 - (SECONDS - START)))
timeout "$LEFT" python3 -m psr_hf.cli bench --model grown-olmoe-routing --rounds 3 --windows 2 --tokens 48 \
    --accelerate-tokens 2 --warmup 1 --json "$OUT/bench_grown_olmoe.json" --plot "$OUT/bench_grown_olmoe.png" \
    > "$OUT/bench_grown_olmoe.txt" 2>&1
echo "bench exit $? at $((SECONDS - START)) s"
grep -v "^  round\|^  warm" "$OUT/bench_grown_olmoe.txt" | tail -45
# few files come back: each model as its big shard plus one tar of the rest
for arch in $ARCHS; do
    (cd "$OUT/$arch" && mv model/model-00001-of-00002.safetensors . && tar cf rest.tar model train_log.json \
        train_stdout.log calibration_gpu.safetensors 2>/dev/null; rm -rf model train_log.json train_stdout.log \
        calibration_gpu.safetensors)
done
find "$OUT" -type f | sort
