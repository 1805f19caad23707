"""``psr-hf demo`` (generation under exact and cache-aware routing on a small model) and ``psr-hf warm-up``
(the policy kernels compiled into numba's cache ahead of a first run)."""

from __future__ import annotations

import argparse

from .._text import text_table
from .console import compile_notice, err
from .options import Subparsers, add_model, add_plot, add_threads, set_threads


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("demo", help="generate under exact and cache-aware routing on a small model: copies "
                                           "per token")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    add_model(p, "tiny-moe", built=False, also="random (a seeded random tiny OLMoE, byte vocabulary)",
              note="; a model directory's calibration.safetensors is its calibration")
    add_threads(p)
    add_plot(p, "a plot of excess NLL against copies per token")
    p.set_defaults(func=run_demo)

    p = subparsers.add_parser("warm-up", help="compile the policy kernels into numba's cache (make install runs "
                                              "this; the first demo or generate() then starts without compiling)")
    p.set_defaults(func=warm_up)


def run_demo(args: argparse.Namespace) -> int:
    from ..assets.loading import model_hidden_size
    from ..demo import DEMO_CONFIGS, DEMO_SHAPE, RANDOM, run_demo as demo
    from ..policy.policies import POLICY_TABLE

    # a typo fails here, before anything loads
    set_threads(args, hidden_size=model_hidden_size(args.model, {RANDOM: DEMO_SHAPE["hidden_size"]}))
    with compile_notice():
        result = demo(new_tokens=args.new_tokens, model=args.model, progress=True)
    print(f"psr-hf demo: {result['model']}")
    print(f"calibrated on {result['calibration_tokens']} tokens; {len(result['prompts'])} prompts in one "
          f"left-padded batch, {result['new_tokens']} greedy tokens each.")
    if args.model == "random":
        print("Random weights: the continuations are noise; the routing numbers are the point.")
    elif args.model == "tiny-moe":
        print("An 8.7 M-parameter model trained for 7.4 minutes on one GPU: expect locally fluent, globally "
              "meaningless text; the routing numbers are the point.")
    print()
    runs = result["runs"]
    exact = {name for name, fields in DEMO_CONFIGS if POLICY_TABLE[fields["policy"]].follows_router}
    for p, prompt in enumerate(result["prompts"]):
        print(f"prompt {p + 1}: {prompt!r}")
        for run in runs:
            if run.name in exact and run.residency != runs[0].residency:
                continue  # exact routing gives the same text at every residency
            label = "exact" if run.name in exact else f"{run.name} @ {run.residency:.0%}"
            print(f"  {label:<28} {run.texts[p]!r}")
        print()
    rows = []
    for run in runs:
        s = run.stats
        rows.append([run.name, f"{run.residency:.0%} (C={run.capacity})", f"{s['demand_per_token']:.2f}",
                     f"{s['prefetch_per_token']:.2f}", f"{s['copies_per_token']:.2f}", f"{s['replaced_per_token']:.2f}",
                     f"{s['displaced_mass']:.3f}", f"{s['excess_nll']:.4f}", f"{s['same_tokens_as_exact']:.0%}"])
    print(text_table(rows, ["policy", "residency", "demand/tok", "prefetch/tok", "copies/tok", "replaced/tok",
                            "displaced mass", "excess NLL", "tokens = exact"]))
    print("\ncopies are logical expert loads summed over the MoE layers, per token (prompt and generated);")
    print("demand copies stall the layer, prefetch copies are issued one layer early and overlap computation;")
    print("replaced = selected experts outside the router's own top-K; displaced mass = the share of the router's")
    print("own top-K weight that was not executed (mean over token-layers); excess NLL = nats per token over exact")
    print(f"routing on {result['kl']} (an estimate of the KL divergence from exact routing).")
    if args.plot:
        from ..eval.divergence import plot_divergence

        title = f"psr-hf demo: {args.model}, " + result["kl"]
        print(f"plot: {plot_divergence(result['divergence'], args.plot, title=title)}")
    return 0


def warm_up(args: argparse.Namespace) -> int:
    import time

    import torch

    from ..testing import warm_up as compile_kernels

    torch.set_num_threads(1)
    # said on its own line before the bar starts: a notice from numba's compile event would land inside the bar
    # wherever stderr is not a terminal (make install's output, a log)
    err("psr-hf warm-up: compiling the policy kernels into numba's cache (18 s on the quiet 2-core CI "
        "machine, longer on a busy one; seconds where they are cached already)")
    start = time.perf_counter()
    runs = compile_kernels(progress=True)
    print(f"psr-hf warm-up: policy kernels compiled and cached ({runs} runs, {time.perf_counter() - start:.1f} s)")
    return 0
