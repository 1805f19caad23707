"""Issue 53's goal against llama.cpp: benchmarks/engine/llamacpp/judge.py judged from the committed H200 records
(llama-bench's repetitions and the engine's rounds of the same device call), and interleaved.py (the paired
comparison on a GPU) refusing what it cannot run with the reason."""

from __future__ import annotations

import json
import lzma
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "engine" / "h200" / "vs_llamacpp"


def test_the_judge_reads_both_records_and_gives_the_ratio_of_their_geometric_means():
    llama = json.loads((RECORDS / "llamacpp_ncmoe0.json").read_text())[0]
    bench = json.loads(lzma.decompress((RECORDS / "bench_engine.json.xz").read_bytes()))
    engine = next(r for r in bench["results"] if r["configuration"] == "engine_resident")["ms_per_token"]["rounds"]
    llama_ms = [ns / 1e6 / llama["n_gen"] for ns in llama["samples_ns"]]
    geometric = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
    expected = geometric(llama_ms) / geometric(engine)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/engine/llamacpp/judge.py"),
                          str(RECORDS / "llamacpp_ncmoe0.json"), str(RECORDS / "bench_engine.json.xz")],
                         capture_output=True, text=True, check=True).stdout
    assert f"llama.cpp / engine {expected:.2f} [" in out
    verdict = out.rsplit(": ", 1)[1].strip()
    assert verdict == ("met" if expected >= 1.35 else "not met" if expected < 1.2 else verdict)


def test_the_interleaved_comparison_says_what_it_needs_before_loading_anything():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/engine/llamacpp/interleaved.py"), "--gguf",
                          str(RECORDS / "missing.gguf"), "--llama-bench", sys.executable], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "--gguf" in out.stderr and "no such file" in out.stderr
    assert "build.sh" in out.stderr  # where the file comes from
