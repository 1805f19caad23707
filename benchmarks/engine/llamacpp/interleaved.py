"""The engine all resident against llama.cpp's tg64, in interleaved rounds of one process (issue 53's goal: the
engine at least 1.35x faster than llama.cpp in the same call). Each round runs ``llama-bench`` once (one
repetition of ``--tokens`` generated tokens, a subprocess) and the engine once over the same number of held-out
tokens, teacher-forced and waiting for every token as ``psr-hf bench`` does, the order turned each round; the
ratio llama.cpp / engine is paired by round (geometric mean, 95% t-interval on the log ratios). Prints each round,
the ratio and the verdict, and writes a JSON record.

    python benchmarks/engine/llamacpp/interleaved.py --gguf .llama/grown-olmoe-routing.gguf --json OUT.json

Needs ``.llama/build/bin/llama-bench`` (benchmarks/engine/llamacpp/build.sh) and a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from psr_hf.bench.goals import ENGINE_LLAMACPP_GOAL as GOAL
from psr_hf.bench.goals import judge_interval
from psr_hf.cli.console import write_json


def _llama_ms(binary: Path, gguf: Path, tokens: int, ncmoe: int, threads: int) -> float:
    """One llama-bench repetition of ``tokens`` generated tokens: ms per token."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-r", "1", "-t", str(threads),
                          "-ngl", "99", "--n-cpu-moe", str(ncmoe), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    run = json.loads(out)[0]
    return run["avg_ns"] / 1e6 / run["n_gen"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="grown-olmoe-routing")
    ap.add_argument("--gguf", required=True, help="the same model as GGUF (benchmarks/engine/llamacpp/build.sh)")
    ap.add_argument("--llama-bench", default=".llama/build/bin/llama-bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ncmoe", type=int, default=0, help="llama.cpp's --n-cpu-moe (0: everything on the GPU)")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    binary, gguf = Path(args.llama_bench), Path(args.gguf)
    for path, what in ((binary, "--llama-bench"), (gguf, "--gguf")):
        if not path.is_file():
            raise SystemExit(f"{what} {path}: no such file; build llama-bench and convert the model with "
                             "benchmarks/engine/llamacpp/build.sh on the device")
    if args.rounds < 3:
        raise SystemExit(f"--rounds {args.rounds}: at least 3 rounds for an interval")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("interleaved.py needs a CUDA GPU")
    import psr_hf
    from psr_hf.assets.loading import load_model
    from psr_hf.assets.texts import measured_texts, text_windows
    from psr_hf.bench.common import paired_summary
    from psr_hf.bench.decode import decode_engine_window
    from psr_hf.engine.token_graph import graph_decoder

    model, tokenizer, info = load_model(args.model, "cuda")
    experts = int(model.config.get_text_config().num_experts)
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="exact", capacity=experts),
                 calibration=info.get("calibration_file"))  # every expert cached: the bench's engine_resident
    decoder = graph_decoder(model, args.tokens + 2)
    texts, _ = measured_texts(args.model, [], option="--model")
    window = text_windows(texts, tokenizer, windows=1, tokens=args.tokens)[0].to("cuda")
    decode_engine_window(decoder, window, device="cuda")  # warm: compile, capture
    _llama_ms(binary, gguf, args.tokens, args.ncmoe, args.threads)
    engine, llama = [], []
    for r in range(args.rounds):
        for part in (("llama", "engine") if r % 2 == 0 else ("engine", "llama")):
            if part == "llama":
                llama.append(_llama_ms(binary, gguf, args.tokens, args.ncmoe, args.threads))
            else:
                run = decode_engine_window(decoder, window, device="cuda")
                engine.append(sum(run.ms) / len(run.ms))
        print(f"round {r + 1}: llama.cpp {llama[-1]:.3f} ms/token, engine {engine[-1]:.3f} ms/token", flush=True)
    ratio = paired_summary(llama, engine)
    low, high = ratio["ci95"]
    status = judge_interval(low, high, ratio["ratio"], GOAL, ">=")["status"]
    print(f"llama.cpp / engine (all resident, tg{args.tokens}, paired over {args.rounds} interleaved rounds): "
          f"{ratio['ratio']:.2f} [{low:.2f}, {high:.2f}]; goal >= {GOAL:g}: {status}")
    record = {"model": args.model, "device": torch.cuda.get_device_name(), "tokens": args.tokens,
              "ncmoe": args.ncmoe, "decoder": type(decoder).__name__, "llama_ms": llama, "engine_ms": engine,
              "ratio": ratio, "goal": GOAL, "status": status,
              "protocol": "per round one llama-bench repetition (-p 0 -n tokens -r 1) and one engine window of the "
                          "held-out text, teacher-forced, the device synchronised after every token"}
    if args.json:
        write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
