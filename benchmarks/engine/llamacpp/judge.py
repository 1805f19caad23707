"""Issue 53's goal against llama.cpp: the engine all resident at least 1.35x faster than llama.cpp's tg64 in the
same device call. Reads llama-bench's JSON (``-o json``: each repetition's time for 64 tokens) and a ``psr-hf bench
--engine`` record (engine_resident's per-round ms/token); the two programs run one after the other, not
interleaved, so the ratio's 95% interval is Welch's on the log ms/token of llama.cpp's repetitions and the
engine's rounds (unpaired). Met only when the whole interval is at or above the goal.

    python benchmarks/engine/llamacpp/judge.py LLAMACPP_NCMOE0.json BENCH_ENGINE.json[.xz]
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
from pathlib import Path

import numpy as np
from scipy import stats

from psr_hf.bench.goals import ENGINE_LLAMACPP_GOAL as GOAL
from psr_hf.bench.goals import judge_interval


def _record(path: str) -> dict:
    data = Path(path).read_bytes()
    return json.loads(lzma.decompress(data) if path.endswith(".xz") else data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("llamacpp")
    ap.add_argument("bench")
    ap.add_argument("--row", default="engine_resident")
    args = ap.parse_args()
    llama = _record(args.llamacpp)[0]
    llama_ms = np.asarray(llama["samples_ns"], dtype=np.float64) / 1e6 / llama["n_gen"]
    rows = {r["configuration"]: r for r in _record(args.bench)["results"]}
    engine_ms = np.asarray(rows[args.row]["ms_per_token"]["rounds"], dtype=np.float64)
    test = stats.ttest_ind(np.log(llama_ms), np.log(engine_ms), equal_var=False)
    low, high = test.confidence_interval(0.95)
    ratio = math.exp(float(np.log(llama_ms).mean() - np.log(engine_ms).mean()))
    status = judge_interval(math.exp(low), math.exp(high), ratio, GOAL, ">=")["status"]
    print(f"llama.cpp tg64 {llama_ms.mean():.3f} ms/token ({llama_ms.size} repetitions), {args.row} "
          f"{engine_ms.mean():.3f} ms/token ({engine_ms.size} rounds); llama.cpp / engine {ratio:.2f} "
          f"[{math.exp(low):.2f}, {math.exp(high):.2f}] (Welch, unpaired); goal >= {GOAL:g}: {status}")


if __name__ == "__main__":
    main()
