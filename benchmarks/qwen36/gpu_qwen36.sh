#!/usr/bin/env bash
# The Qwen3.6 shape on the lent GPU (Section 6.9), in device commands of at most 10 minutes each, on one warm machine
# (files written into the ignored .models/ stay while it is warm):
#   STAGE=train   carry ["shards_xz"] (made as benchmarks/grown/gpu_moonlight.sh's header shows): trains
#                 qwen36-routing (train.py --arch qwen36-routing, MINUTES, default 6) into .models/, brings it back as
#                 $OUT/qwen36-routing.tar.part-* (`cat ... | tar x -C ~/.cache/psr_hf/models/`) with its train log,
#                 and runs the engine's CUDA test files in one process beside it ($OUT/cuda_tests.txt; TESTS=0 skips)
#   STAGE=check   the bf16 check of grown-qwen36-routing (bf16_check.py: agreement with the float32 small model,
#                 held-out loss at full size), with the model in $PSR_HF_MODELS/qwen36-routing; on a fresh machine
#                 carry it compressed (the tree without the shipped weights and the 39 MB of xz fit one call):
#                   mkdir -p .models/qwen36-routing.xz; for f in ~/.cache/psr_hf/models/qwen36-routing/*; do
#                       xz -c "$f" > .models/qwen36-routing.xz/$(basename "$f").xz; done   # carry [".models/qwen36-routing.xz"]
#   STAGE=latency the latency stage of `psr-hf sweep` on grown-qwen36-routing (SETTINGS in benchmarks/sweep/gpu_sweep.sh)
# Card and calibration are made on the CPU from the returned model (model_card.py), like olmoe-routing's.
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
export PSR_HF_MODELS=${PSR_HF_MODELS:-$PWD/.models}
ENGINE_TESTS="tests/test_engine_graphs.py tests/test_engine_generate.py tests/test_engine_prefill.py
  tests/test_engine_qwen3_5.py tests/test_hf_cuda.py tests/test_offload_cuda.py tests/test_prefetch_runtime.py"
if [ -d "$PSR_HF_MODELS/qwen36-routing.xz" ] && [ ! -d "$PSR_HF_MODELS/qwen36-routing" ]; then
    unxz_copy "$PSR_HF_MODELS/qwen36-routing.xz" "$PSR_HF_MODELS/qwen36-routing"
fi
case "${STAGE:?STAGE=train, check or latency}" in
train)
    SHARDS=$(mktemp -d)/shards
    unxz_copy shards_xz "$SHARDS"
    if [ "${TESTS:-1}" != 0 ]; then  # the engine's CUDA tests, all files in one process, beside the training
        ( python3 -m pytest -m cuda -q -rA -p no:cacheprovider $ENGINE_TESTS ${DESELECT:-} > "$OUT/cuda_tests.txt" 2>&1
          echo "pytest exit $?" >> "$OUT/cuda_tests.txt" ) &
        tests=$!
    fi
    RUN=$(mktemp -d)/run
    batch=${BATCH:-128}
    minutes=${MINUTES:-6}
    while :; do  # a batch that does not fit is halved, in the time that is left
        timeout $((560 - (SECONDS - START))) python3 examples/train_tiny_moe/train.py --arch qwen36-routing \
            --shards "$SHARDS" --out "$RUN" --minutes "$minutes" --batch "$batch" > "$OUT/train_stdout.log" 2>&1
        rc=$?
        echo "train.py --batch $batch exit $rc at $((SECONDS - START)) s"
        if (( rc == 0 )) || ! grep -q "OutOfMemoryError" "$OUT/train_stdout.log" || (( batch <= 16 )); then break; fi
        batch=$((batch / 2))
        minutes=$(python3 -c "print(max(1.0, $minutes - ($SECONDS - $START) / 60))")
        rm -rf "$RUN"
    done
    grep -v '^{"step"' "$OUT/train_stdout.log" | tail -8
    grep '^{"step"' "$OUT/train_stdout.log" | tail -2
    DEST="$PSR_HF_MODELS/qwen36-routing"
    mkdir -p "$DEST"
    cp "$RUN"/model/* "$RUN/train_log.json" "$DEST/" && \
        tar cf - -C "$PSR_HF_MODELS" qwen36-routing | split -b 15M - "$OUT/qwen36-routing.tar.part-"
    cp -r "$SHARDS" "$PWD/.models/shards" 2>/dev/null || true  # for the later stages on this machine
    [ -n "${tests:-}" ] && { wait "$tests"; tail -3 "$OUT/cuda_tests.txt"; }
    ls -la "$OUT" "$DEST" ;;
check)
    timeout $((580 - (SECONDS - START))) python3 benchmarks/grown/bf16_check.py --models qwen36-routing \
        --windows ${WINDOWS:-8} --tokens 512 --json "$OUT/bf16_check_qwen36.json" 2>&1 | tail -20
    echo "bf16 check exit $? at $((SECONDS - START)) s" ;;
latency)
    bash benchmarks/sweep/gpu_sweep.sh grown-qwen36-routing ;;
*) echo "STAGE=$STAGE: give train, check or latency" >&2; exit 2 ;;
esac
echo "done at $((SECONDS - START)) s"
