"""``psr-hf excess-nll`` (also ``psr-hf kl``): the excess NLL over exact routing, an estimate of the KL divergence
from it, and the copies per token of routing policies on text windows (:mod:`psr_hf.eval.divergence`)."""

from __future__ import annotations

import argparse
from typing import Any

from .console import compile_notice, write_json
from .options import (add_calibration, add_device, add_json, add_model, add_plot, add_seed, add_texts, add_threads,
                      comma_floats, load_model_of)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("excess-nll", aliases=["kl"],
                              help="excess NLL over exact routing (a KL diagnostic) and copies per token of "
                                   "exact+LRU, cache_prior and psr over a lam grid at each residency, on text windows")
    add_model(p, "tiny-moe", note="; shipped and grown models default to held-out text")
    add_device(p)
    add_texts(p, "text to cut windows from (repeatable; default: the held-out Persuasion text for the shipped "
                 "models, standard-library sources otherwise)")
    p.add_argument("--windows", type=int, default=4, help="text windows to score (default 4)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per window after the first (default 256)")
    p.add_argument("--residencies", default="0.5,0.25",
                   help="comma-separated shares of each layer's experts that are resident (default 0.5,0.25)")
    p.add_argument("--lams", default="0.1,0.2,0.3",
                   help="comma-separated cache bonuses lam of cache_prior and psr (default 0.1,0.2,0.3)")
    p.add_argument("--budget", type=int, default=1, help="psr's budget (default 1)")
    p.add_argument("--predictor", help="a SpecPrefetch predictor (.safetensors) of this model: adds psr rows that "
                                       "rank their prefetches by it (..._pred_...) and compares each with its "
                                       "pre-gate twin (paired excess NLL, demand copies)")
    add_calibration(p)
    add_seed(p)
    add_json(p)
    add_plot(p, "a plot of excess NLL (95%% interval) against copies per token (a line per policy, a panel per "
                "residency)")
    add_threads(p)
    p.set_defaults(func=excess_nll)


def excess_nll(args: argparse.Namespace) -> int:
    from ..assets.texts import measured_texts, text_windows
    from ..eval.calibration import model_calibration
    from ..eval.divergence import divergence, format_rows, predictor_pairs, sweep_configs

    # a shipped trained model never saw its held-out text; the standard library is in its training
    texts, text_names = measured_texts(args.model, args.text, option="--text", name=str)
    residencies, lams = comma_floats("--residencies", args.residencies), comma_floats("--lams", args.lams)
    sweep_configs(residencies, lams, args.budget, predictor=bool(args.predictor))  # bad values fail before loading
    model, tokenizer, info = load_model_of(args)
    beside = info.pop("calibration_file", None)  # the record names it by info["calibration"]
    windows = text_windows(texts, tokenizer, windows=args.windows, tokens=args.tokens)
    # the file given, else the one saved beside the model, else other standard-library modules than the windows'
    calibration, how = model_calibration(model, tokenizer, tokens=args.calibration_tokens,
                                         calibration=args.calibration or None, beside=beside,
                                         beside_name=info.get("calibration"), bar=True)
    calibrated_on = how["file"] if "file" in how else f"{how['tokens']} tokens of stdlib {', '.join(how['modules'])}"
    print(f"psr-hf {args.command}: {info['name']}, {len(windows)} window(s) x {args.tokens + 1} tokens, excess NLL "
          f"over exact routing (nats per token; 95% interval over windows); text: {', '.join(text_names)}; "
          f"calibration: {calibrated_on}")
    predictor = None
    if args.predictor:
        from ..bench.offload import load_bench_predictor

        predictor, _ = load_bench_predictor(args.predictor, model)  # a shipped model's serves its grown version
    with compile_notice():
        rows = divergence(model, windows, sweep_configs(residencies, lams, args.budget, predictor=bool(predictor)),
                          calibration=calibration, progress=True, predictor=predictor)
    print(format_rows(rows))
    pairs = predictor_pairs(rows)
    for pair in pairs:
        lo, hi = pair["excess_nll_diff_ci95"]
        print(f"{pair['predictor']} - {pair['pregate']}: excess NLL {pair['excess_nll_diff']:+.4f} [{lo:+.4f}, "
              f"{hi:+.4f}] nats/token (paired over windows); demand copies/token {pair['demand_per_token'][0]:.2f} "
              f"vs {pair['demand_per_token'][1]:.2f}")
    if args.json:
        write_json(args.json, {"model": info, "windows": len(windows), "tokens": args.tokens, "texts": text_names,
                               "calibration": calibrated_on, "predictor": args.predictor,
                               "rows": [r.to_dict() for r in rows], "predictor_pairs": pairs})
    if args.plot:
        from ..eval.divergence import plot_divergence

        title = f"psr-hf {args.command}: {info['name']}, {len(windows)} windows x {args.tokens + 1} tokens"
        print(f"plot: {plot_divergence(rows, args.plot, title=title)}")
    return 0
