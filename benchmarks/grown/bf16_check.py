"""On a GPU: the shipped routing models against their grown real-size versions in bf16 (the issue's check 3).

For each model: held-out loss (nats/token) of the small model in float32 and bf16 and of the grown model in bf16,
and the share of token-layer pairs where exact routing selects the identical expert set (small fp32 vs small
bf16, small fp32 vs grown bf16, small bf16 vs grown bf16), on windows of Persuasion vol. I (held out).
    python benchmarks/grown/bf16_check.py --windows 8 --tokens 512 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import psr_hf
from psr_hf.assets import HELD_OUT_TEXT, shipped_dir
from transformers import AutoModelForCausalLM, AutoTokenizer
from psr_hf.assets.grow import default_target, grow
from psr_hf.bench.workloads import text_windows


def run(model, ids, top_k):
    """(mean NLL per token, [windows][L, T, K] sorted selections) under exact routing with every expert cached."""
    E = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.n_routed_experts
    nll, sel = [], []
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", capacity=E)), torch.no_grad():
        for w in ids:
            with psr_hf.controller(model).record() as rec:
                out = model(w.cuda(), labels=w.cuda())
            nll.append(out.loss.item())
            sel.append(np.stack([np.sort(r.selected.reshape(-1, top_k), axis=1) for r in rec.recordings]))
    return float(np.mean(nll)), sel


def same(a, b):
    return float(np.mean([(x == y).all(axis=-1).mean() for x, y in zip(a, b)]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--json", required=True)
    p.add_argument("--models", default="olmoe-routing,moonlight-routing", help="named models (shipped or built), comma-separated")
    args = p.parse_args()
    records = []
    for name in args.models.split(","):
        t0 = time.time()
        small = AutoModelForCausalLM.from_pretrained(shipped_dir(name), dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(shipped_dir(name))
        small = small.cuda()
        ids = [w[:, : args.tokens] for w in text_windows([HELD_OUT_TEXT.read_text()], tokenizer,
                                                          windows=args.windows, tokens=args.tokens)]
        k = small.config.num_experts_per_tok
        nll32, s32 = run(small, ids, k)
        big = grow(small, default_target(small.config), dtype=torch.bfloat16)
        nllg, sg = run(big, ids, k)
        del big
        small16 = small.to(torch.bfloat16)
        nll16, s16 = run(small16, ids, k)
        rec = {"model": name, "windows": args.windows, "tokens": args.tokens, "target": default_target(small.config).name,
               "heldout_nll": {"small_fp32": nll32, "small_bf16": nll16, "grown_bf16": nllg},
               "identical_sets": {"small_fp32_vs_small_bf16": same(s32, s16), "small_fp32_vs_grown_bf16": same(s32, sg),
                                  "small_bf16_vs_grown_bf16": same(s16, sg)},
               "seconds": time.time() - t0}
        print(json.dumps(rec))
        records.append(rec)
        del small, small16
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}, f, indent=2)


if __name__ == "__main__":
    main()
