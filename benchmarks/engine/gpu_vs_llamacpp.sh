#!/usr/bin/env bash
# The engine beside llama.cpp on the same machine (issue 53, Build 5), from the sent tree's root with .llama carried
# (benchmarks/engine/llamacpp/source.sh): builds llama-bench and converts MODEL (default grown-olmoe-routing) to GGUF
# bf16 where the warm machine has not yet (benchmarks/engine/llamacpp/build.sh), then in this call llama-bench tg64
# (5 repetitions, 16 threads) all resident and with the experts of NCMOE layers on the CPU; with INTERLEAVED=1,
# llama-bench and the engine all resident in interleaved rounds (llamacpp/interleaved.py: the goal against
# llama.cpp paired by round); and, with ENGINE=1, `psr-hf bench --engine` on the main rows (ROUNDS, default 5;
# device routing where the row allows it) within the time left (--max-seconds: the rounds that fit). SAVE_BUILD=1 returns the build
# (build_bin.tar.xz.part-*; put them in .llama and carry it to skip the build in a later call).
# Records under $OUT: llamacpp_ncmoe<N>.json, bench_engine.{json,txt}, judged.txt (the goal against llama.cpp:
# benchmarks/engine/llamacpp/judge.py).
set -uo pipefail
START=$SECONDS
source benchmarks/device_env.sh
MODEL=${MODEL:-grown-olmoe-routing}
MODEL=$MODEL bash benchmarks/engine/llamacpp/build.sh || exit 1
export LD_LIBRARY_PATH=$PWD/.llama/build/bin:${LD_LIBRARY_PATH:-}  # also where an unpacked build's libraries lie
if [ "${SAVE_BUILD:-0}" = 1 ]; then  # the built llama-bench and its libraries back, in parts a call returns
  tar -C .llama -cJf - build/bin | split -b 15M - "$OUT/build_bin.tar.xz.part-"
  ls -la "$OUT"/build_bin.tar.xz.part-*
fi
for n in ${NCMOE:-0 8 12}; do
  .llama/build/bin/llama-bench -m ".llama/$MODEL.gguf" -p 0 -n 64 -r 5 -t 16 -ngl 99 --n-cpu-moe "$n" -o json \
      > "$OUT/llamacpp_ncmoe$n.json" 2> "$OUT/llamacpp_ncmoe$n.err" || tail -5 "$OUT/llamacpp_ncmoe$n.err"
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print(f'llama.cpp tg64, experts of {sys.argv[2]} layers on the CPU: {1000 / r[\"avg_ts\"]:.3f} ms/token ({r[\"avg_ts\"]:.1f} +- {r[\"stddev_ts\"]:.1f} tok/s)')" \
      "$OUT/llamacpp_ncmoe$n.json" "$n" 2>/dev/null
  [ -s "$OUT/llamacpp_ncmoe$n.err" ] || rm -f "$OUT/llamacpp_ncmoe$n.err"
done
if [ "${INTERLEAVED:-0}" = 1 ]; then  # the goal against llama.cpp, paired by round (benchmarks/engine/llamacpp/interleaved.py)
  PYTHONUNBUFFERED=1 timeout "$((${TOTAL_S:-580} - (SECONDS - START)))" python3 benchmarks/engine/llamacpp/interleaved.py \
      --model "$MODEL" --gguf ".llama/$MODEL.gguf" --rounds "${ROUNDS:-5}" --json "$OUT/interleaved.json" 2>&1 \
      | grep -v "Loading weights" | tee "$OUT/interleaved.txt" | tail -12
fi
if [ "${ENGINE:-0}" = 1 ]; then
  LEFT=$((${TOTAL_S:-580} - (SECONDS - START)))
  echo "psr-hf bench --engine gets $LEFT s"
  PYTHONUNBUFFERED=1 timeout "$LEFT" python3 -m psr_hf.cli bench --model "$MODEL" --engine \
      --configs "${CONFIGS:-exact_lru,cp_lam0.2,psr_lam0.3_n1,psr_lam0.3_n1_d2}" --hf-configs '' --no-accelerate --rounds "${ROUNDS:-5}" \
      --max-seconds "$((LEFT - 20))" \
      --windows 2 --tokens 64 --json "$OUT/bench_engine.json" 2>&1 | grep -v "Loading weights" \
      | tee "$OUT/bench_engine.txt" | tail -30
  python3 benchmarks/engine/llamacpp/judge.py "$OUT/llamacpp_ncmoe0.json" "$OUT/bench_engine.json" \
      | tee "$OUT/judged.txt"
fi
