"""Where a verification's time goes in the engine (docs/speculative.md, "Where the time goes"): grown-olmoe-routing with
tiny-moe drafting on the GPU, block selection with confidence weights at k = 16, a cProfile of a few HumanEval
continuations after a warm-up. Usage: python benchmarks/speculative/profile_verification.py --out FILE"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from psr_hf.assets.loading import load_model
from psr_hf.bench.prompt_sets import load_prompt_sets, tokenized
from psr_hf.engine.speculative import SpeculativeEngine
from psr_hf.policy.blocks import BlockConfig
from psr_hf.policy.calibration import Calibration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    target, tokenizer, info = load_model("grown-olmoe-routing", "cuda:0")
    drafter, _, _ = load_model("tiny-moe", "cuda:0")
    drafter = drafter.to(torch.bfloat16)
    calibration = Calibration.load(info["calibration_file"])
    prompts = load_prompt_sets("benchmarks/speculative/humaneval_first80.json", ["humaneval"])[0]
    items = tokenized(prompts, tokenizer, 400)[:args.prompts]
    engine = SpeculativeEngine(target, drafter, BlockConfig(mode="confidence", pool=24), draft_tokens=16,
                               max_len=512, calibration=calibration)
    engine.generate(items[0].ids, 8)
    profile = cProfile.Profile()
    runs = []
    profile.enable()
    for p in items:
        runs.append(engine.generate(p.ids, args.new))
    profile.disable()
    blocks = sum(len(r.accepted) for r in runs)
    text = io.StringIO()
    text.write(f"{len(items)} prompts, {sum(len(r.tokens) for r in runs)} tokens, {blocks} verifications; drafting "
               f"{1e3 * sum(r.draft_s for r in runs) / blocks:.2f} ms and verifying "
               f"{1e3 * sum(r.verify_s for r in runs) / blocks:.2f} ms per verification (under the profiler)\n")
    for key in ("tottime", "cumtime"):
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(25)
    out = text.getvalue()
    for prefix in ("/opt/", "/root/", "/work/"):
        out = "\n".join(line.replace(line[line.find(prefix):line.find("site-packages/") + 14], "")
                        if prefix in line and "site-packages/" in line else line for line in out.splitlines())
    with open(args.out, "w") as f:
        f.write(out)
    print(out[:6000])


if __name__ == "__main__":
    main()
