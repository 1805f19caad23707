#!/usr/bin/env bash
# One device command (10-minute limit): `make moonlight-routing` on the lent GPU, then the bf16 check of its grown
# Moonlight-16B-A3B-size version (bf16_check.py). The tree plus carried files must stay under 64 MiB, so the token
# files travel xz-compressed (the whole corpus, 24.7 MiB of training tokens, in about 11 MiB), made beforehand with
#   python examples/train_tiny_moe/make_shards.py --corpus CORPUS --tokenizer psr_hf/assets/tiny_moe \
#       --out shards_tiny_moe
#   mkdir shards_xz && cp -r shards_tiny_moe/{meta.json,tokenizer} shards_xz/ && \
#       for f in train calib heldout; do xz -9 -c shards_tiny_moe/$f.bin > shards_xz/$f.bin.xz; done
#   device run, carry ["shards_xz"]:  bash benchmarks/grown/gpu_moonlight.sh
# Brings back $OUT/moonlight-routing.tar.part-* (model, calibration, card, train log; a returned file must stay
# under 16 MiB): `cat moonlight-routing.tar.part-* | tar x -C ~/.cache/psr_hf/models/` (or $PSR_HF_MODELS), and
# $OUT/bf16_check_moonlight.json. MINUTES (default 4.5) leaves room for the card and the check.
set -euo pipefail
START=$SECONDS
source benchmarks/device_env.sh
export PYTHONPATH=$PWD CUBLAS_WORKSPACE_CONFIG=:4096:8
export PSR_HF_MODELS=${PSR_HF_MODELS:-$(mktemp -d)}
if [ -z "${SHARDS:-}" ] && [ -d shards_xz ]; then
    SHARDS=$(mktemp -d)/shards
    unxz_copy shards_xz "$SHARDS"
fi
SHARDS=${SHARDS:-shards_tiny_moe} MINUTES=${MINUTES:-4.5} PYTHON=${PYTHON:-python3} \
    CARD_ARGS=${CARD_ARGS:---windows 16 --tokens 512 --calibration-tokens 131072} \
    bash examples/train_tiny_moe/build_routing_model.sh moonlight-routing 2>&1 | tee "$OUT/build_stdout.log" \
    | grep -v "^{\"step\"\|it/s\]" | tail -20
echo "built at $((SECONDS - START)) s"
tar cf - -C "$PSR_HF_MODELS" moonlight-routing | split -b 15M - "$OUT/moonlight-routing.tar.part-"
ls -la "$PSR_HF_MODELS/moonlight-routing"
timeout $((590 - (SECONDS - START))) python3 benchmarks/grown/bf16_check.py --models moonlight-routing \
    --windows 8 --tokens 512 --json "$OUT/bf16_check_moonlight.json" || echo "bf16 check exit $?"
echo "done at $((SECONDS - START)) s"
