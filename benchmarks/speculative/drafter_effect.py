"""The drafter's effect on routing (docs/speculative.md, "The drafter in the routing"): on the CPU, olmoe-routing (the
small float32 twin of grown-olmoe-routing, whose routing growing leaves unchanged) with tiny-moe drafting, on the
timed HumanEval prompts. Usage: python benchmarks/speculative/drafter_effect.py --json OUT [--problems 80]."""

from __future__ import annotations

import argparse
import json
import time

from psr_hf.assets.loading import load_model
from psr_hf.bench.drafter_effect import drafter_effect
from psr_hf.bench.prompt_sets import tokenized
from psr_hf.bench.speculative import humaneval_first
from psr_hf.policy.blocks import BlockConfig
from psr_hf.policy.calibration import Calibration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", required=True)
    parser.add_argument("--problems", type=int, default=80)
    parser.add_argument("--new", type=int, default=48, help="new tokens per prompt (the timing run's)")
    parser.add_argument("--modes", default="position,confidence")
    parser.add_argument("--k", type=int, default=16)
    args = parser.parse_args()
    target, tokenizer, info = load_model("olmoe-routing", "cpu")
    drafter, _, _ = load_model("tiny-moe", "cpu")
    calibration = Calibration.load(info["calibration_file"])
    prompts = [p.ids for p in tokenized(humaneval_first(args.problems), tokenizer, 512 - args.new - args.k - 2)]
    record = {"format": "psr_hf drafter effect", "model": "olmoe-routing (float32, CPU)", "drafter": "tiny-moe",
              "problems": args.problems, "new_tokens": args.new, "k": args.k, "pool": 24, "results": {}}
    for mode in args.modes.split(","):
        begin = time.perf_counter()
        effect = drafter_effect(target, drafter, prompts, BlockConfig(mode=mode, pool=24), draft_tokens=args.k,
                                max_new_tokens=args.new, calibration=calibration)
        record["results"][mode] = {**effect.to_dict(), "seconds": round(time.perf_counter() - begin, 1)}
        print(mode, record["results"][mode], flush=True)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
