"""``psr-hf train-gate`` (docs/gates.md): distil a model routed by the logical cache (PSR by default, at the
paper's 37.5% residency, lam 0.3, n = 1) to the frozen exact model, training its routers and LoRA adapters on
attention and on each expert through peft, and with ``--gate`` a margin head (the change-based gate with
``--policy cache_prior``, the bounded per-token bonus with ``psr``); writes a folder that
:func:`psr_hf.training.gate.load_distilled` loads."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..assets.texts import PREDICTOR_MODULES
from .console import compile_notice, err
from .options import add_device, add_model, add_seed, add_texts, add_threads, load_model_of


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train-gate", help="distil the routed model to the exact one (routers, attention and "
                                                 "per-expert LoRA through peft, with --gate a margin head; the "
                                                 "paper's Section 6.10); writes a folder, resumable")
    add_model(p, "olmoe-routing", built=False)
    add_texts(p, "training text (repeatable; default: standard-library sources other than the excess-nll and bench "
                 "windows': " + ", ".join(PREDICTOR_MODULES) + ")")
    p.add_argument("--tokens", type=int, default=16384, help="training tokens (default 16384)")
    p.add_argument("--window", type=int, default=256, help="tokens per window, one window per step (default 256)")
    p.add_argument("--steps", type=int, help="optimiser steps (default: one pass over the windows)")
    p.add_argument("--policy", default="psr", choices=["psr", "cache_prior"],
                   help="the routing distilled through (default psr; cache_prior evicts by LRU, the change-based "
                        "gate's rule)")
    p.add_argument("--gate", action="store_true", help="also train a margin head: a learned per-token margin "
                                                       "(cache_prior) or bonus (psr), written as gate.safetensors")
    p.add_argument("--load-penalty", type=float, default=0.0,
                   help="weight of the smooth host loads per token beside the KL (default 0)")
    p.add_argument("--temperature", type=float, default=0.5,
                   help="the relaxation's temperature, in units of lam * delta (default 0.5)")
    p.add_argument("--head-lr", type=float, help="the margin head's peak learning rate (default: --lr)")
    p.add_argument("--lam", type=float, default=0.3, help="bonus lam (default 0.3, the paper's)")
    p.add_argument("--budget", type=int, default=1, help="PSR's insertions per layer and token n (default 1)")
    p.add_argument("--residency", type=float, default=0.375, help="cache residency C/E (default 0.375)")
    p.add_argument("--attention-rank", type=int, help="LoRA rank on attention (default: the paper's 16 at width "
                                                      "2048, scaled to the model's width, at least 1; 0: none)")
    p.add_argument("--expert-rank", type=int, help="LoRA rank per expert (default: the paper's 8 at width 2048, "
                                                   "scaled likewise; 0: none)")
    p.add_argument("--lr", type=float, default=1e-3, help="adapters' peak learning rate (default 1e-3: the paper's "
                                                          "1e-4 is for millions of tokens)")
    p.add_argument("--router-lr", type=float, default=2e-4, help="routers' peak learning rate (default 2e-4, the "
                                                                 "paper's ratio of 1 to 5)")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps (default 20)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    # its own check (_check): a folder that --resume continues is not empty
    p.add_argument("--out", dest="out_folder", required=True,
                   help="folder to write (new or empty, or with --resume the one cut short)")
    add_device(p)
    add_seed(p, "the training")
    add_threads(p)
    p.set_defaults(func=train_gate)


def _check(args: argparse.Namespace) -> None:
    out = Path(args.out_folder)
    if args.resume and not (out / "checkpoint.safetensors").is_file():
        raise ValueError(f"--resume: {out} holds no checkpoint.safetensors; start without --resume")
    if not args.resume and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder; give another, or --resume to continue "
                         "its checkpoint")
    for name in ("tokens", "window", "checkpoint_every"):
        if getattr(args, name) < (2 if name != "checkpoint_every" else 0):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} is too small")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps}: give at least 1")


def train_gate(args: argparse.Namespace) -> int:
    from .. import RoutingConfig
    from ..assets.texts import token_windows, training_texts
    from ..gates.margin_head import MarginHead
    from ..policy.calibration import Calibration
    from ..policy.policies import POLICY_TABLE
    from ..training.gate import distill_routing

    _check(args)
    fields = dict(policy=args.policy, lam=args.lam, residency=args.residency)
    if POLICY_TABLE[args.policy].can_prefetch:  # psr: its budget
        fields["budget"] = args.budget
    else:  # cache_prior: LRU eviction, the change-based gate's rule
        fields["eviction"] = "lru"
    config = RoutingConfig(**fields)
    texts, names = training_texts(args.text)
    model, tokenizer, info = load_model_of(args)
    beside = info.pop("calibration_file", None)
    if beside is None:
        raise ValueError(f"{args.model} has no calibration beside it; calibrate it first (psr-hf calibrate)")
    calibration = Calibration.load(beside)
    gate = MarginHead.uniform(config.lam * calibration.delta, model.config.hidden_size) if args.gate else None
    windows = token_windows(texts, tokenizer, tokens=args.tokens, window=args.window, option="--tokens")
    steps = args.steps or len(windows)
    err(f"psr-hf train-gate: {sum(w.numel() for w in windows)} tokens in {len(windows)} windows of "
        f"{', '.join(names)}; {steps} steps through {config.policy} (lam {config.lam}, residency {args.residency})")
    with compile_notice():
        result = distill_routing(model, windows, config, args.out_folder, calibration=calibration,
                                 steps=steps, attention_rank=args.attention_rank, expert_rank=args.expert_rank,
                                 lr=args.lr, router_lr=args.router_lr, warmup=args.warmup, seed=args.seed,
                                 metadata={"model": info["name"], "texts": ", ".join(names)}, progress=True,
                                 checkpoint_every=args.checkpoint_every, resume=args.resume, gate=gate,
                                 load_penalty=args.load_penalty, temperature=args.temperature, head_lr=args.head_lr)
    n = max(1, min(10, len(result.losses) // 2))
    head, tail = result.losses[:n], result.losses[-n:]
    print(f"psr-hf train-gate: {info['name']}: {steps} steps, attention rank {result.attention_rank}, expert rank "
          f"{result.expert_rank}; KL to the exact model, mean of the first and the last {n} steps: "
          f"{sum(head) / len(head):.4f} -> {sum(tail) / len(tail):.4f}")
    if result.loads:
        print(f"smooth host loads per token, mean of the first and the last {n} steps: "
              f"{sum(result.loads[:n]) / n:.2f} -> {sum(result.loads[-n:]) / n:.2f}")
    print(f"distilled routing: {result.path}" + (" (with its margin head, gate.safetensors)" if args.gate else ""))
    return 0
