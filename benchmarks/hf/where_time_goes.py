"""Host time per token inside the patched model, by psr_hf function (decode, batch 1, OLMoE-1B-7B shape, random
weights): cProfile over ``generate()``, so it names whatever functions the controller has and wraps nothing.

The unpatched router is timed with a wall-clock wrapper around its forward, as the baseline. cProfile adds its
own cost to every call; compare functions with each other, not with the bench's ms/token. Run on a GPU:
``python benchmarks/hf/where_time_goes.py [--policy psr] [--new-tokens 128] [--top 25]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import psr_hf
from psr_hf.bench.workloads import build_random_model, olmoe_1b_7b_config, prompt_ids


def _generate(model, ids, tokens: int) -> None:
    with torch.no_grad():
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    torch.cuda.synchronize()


def _unpatched_router_us(model, ids, tokens: int) -> float:
    calls: list[float] = []
    routers = [layer.mlp.gate for layer in model.model.layers]
    for router in routers:
        forward = router.forward

        def timed(*args, _forward=forward, **kwargs):
            start = time.perf_counter()
            try:
                return _forward(*args, **kwargs)
            finally:
                calls.append(time.perf_counter() - start)
        router.forward = timed
    try:
        _generate(model, ids, tokens)
    finally:
        for router in routers:
            del router.forward
    return 1e6 * sum(calls) / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default="psr")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=25, help="psr_hf functions listed, by own time")
    args = parser.parse_args()
    model = build_random_model(olmoe_1b_7b_config(), device="cuda", dtype=torch.bfloat16)
    ids = prompt_ids(model.config.vocab_size, 32, 0).cuda()
    unpatched = _unpatched_router_us(model, ids, args.new_tokens)
    psr_hf.patch(model, psr_hf.RoutingConfig(policy=args.policy, residency=0.5))
    _generate(model, ids, 8)  # warm-up: kernel compilation, caches
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    _generate(model, ids, args.new_tokens)
    profile.disable()
    wall = (time.perf_counter() - start) / args.new_tokens * 1e3
    tokens = args.new_tokens + 1
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive, own, cumulative, callers)
    ours = [(f"{file.rpartition('psr_hf/')[2]}:{name}", calls, own, cumulative)
            for (file, _, name), (calls, _, own, cumulative, _) in stats.items() if "psr_hf/" in file]
    print(f"unpatched router: {unpatched:.1f} us per call")
    print(f"policy {args.policy}: {wall:.2f} ms/token wall under cProfile (incl. prefill); psr_hf functions by "
          f"own time, per token:")
    for name, calls, own, cumulative in sorted(ours, key=lambda row: -row[2])[:args.top]:
        print(f"  {name:<58} own {1e3 * own / tokens:6.3f} ms  cum {1e3 * cumulative / tokens:6.3f} ms  "
              f"x {calls / tokens:5.1f}/token")


if __name__ == "__main__":
    main()
