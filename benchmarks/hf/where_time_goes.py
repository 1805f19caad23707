"""Host time per MoE layer inside the patched router, by part (decode, batch 1, OLMoE-1B-7B shape, random weights).

Wraps the controller's parts with wall-clock timers (the device-to-host copy in ``_host`` includes waiting for
the device). Run on a GPU: ``python benchmarks/hf/where_time_goes.py [--policy psr] [--new-tokens 128]``.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import psr_hf
import importlib

controller_module = importlib.import_module("psr_hf.hf.controller")
from psr_hf.bench.workloads import build_random_model, olmoe_1b_7b_config, prompt_ids

TOTALS: dict[str, list[float]] = collections.defaultdict(list)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name].append(time.perf_counter() - start)
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default="psr")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    model = build_random_model(olmoe_1b_7b_config(), device="cuda", dtype=torch.bfloat16)
    ids = prompt_ids(model.config.vocab_size, 32, 0).cuda()
    routers = [layer.mlp.gate for layer in model.model.layers]
    # unpatched router time
    hooks = []
    for router in routers:
        router.forward = timed("unpatched router", router.forward)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    for router in routers:
        del router.forward
    unpatched = TOTALS.pop("unpatched router")
    TOTALS.clear()
    config = psr_hf.RoutingConfig(policy=args.policy, residency=0.5)
    psr_hf.patch(model, config)
    ctl = psr_hf.controller(model)
    controller_module._host = timed("_host (D2H + wait)", controller_module._host)
    for name in ("_route_joint", "_route_own", "_execute", "_on_forward", "_stacked_weight", "_staging"):
        setattr(ctl, name, timed(name, getattr(ctl, name)))
    ctl.cache.step_io = timed("step_io", ctl.cache.step_io)
    family = ctl.family
    family.joint_scores = timed("joint_scores", family.joint_scores)
    family.execution_weights = timed("execution_weights", family.execution_weights)
    # the router forward closures were built at patch time and call ctl._route_*: re-patch to pick up wrappers
    for layer in ctl.layers:
        layer.router.forward = timed("patched router (total)", ctl._router_forward(layer, type(layer.router).forward.__get__(layer.router)))
    with torch.no_grad():  # warm-up: kernel compilation, caches
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    TOTALS.clear()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.new_tokens * 1e3
    tokens = args.new_tokens + 1
    print(f"unpatched router: {1e6 * sum(unpatched) / len(unpatched):.1f} us per call")
    print(f"policy {args.policy}: {wall:.2f} ms/token wall (incl. prefill); per call mean us, calls per token:")
    for name, values in sorted(TOTALS.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:<26} {1e6 * sum(values) / len(values):8.1f} us  x {len(values) / tokens:5.1f}/token "
              f"= {1e3 * sum(values) / tokens:6.3f} ms/token")


if __name__ == "__main__":
    main()
