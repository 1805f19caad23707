"""The SpecPrefetch commands (docs/prefetch.md): ``psr-hf train-predictor`` (the learned next-layer expert
predictor), ``psr-hf profile-window`` (the window-aware prefetch budget) and ``psr-hf recall`` (ExpertRecall@M
of the predictor and its baselines)."""

from __future__ import annotations

import argparse
from typing import Any

from .._text import text_table
from ..assets.texts import PREDICTOR_MODULES
from .console import compile_notice, err, write_json
from .options import (add_device, add_json, add_model, add_out, add_seed, add_texts, add_threads, comma_floats,
                      load_model_of)

PREDICTOR_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train-predictor", help="train SpecPrefetch's low-rank next-layer expert predictor of "
                                                      "a model (prefetch ranking only) on text; writes .safetensors")
    add_model(p)
    p.add_argument("--tokens", type=int, default=32768, help="training tokens (default 32768)")
    add_out(p, "predictor file to write (.safetensors)")
    _training_options(p)
    p.set_defaults(func=train_predictor)

    p = subparsers.add_parser("profile-window", help="SpecPrefetch's window-aware budget: per layer pair the overlap "
                                                     "window (prediction available -> next layer's experts start) on "
                                                     "the engine, one expert's copy time, and the budget M_max they "
                                                     "allow")
    add_model(p, "grown-olmoe-routing")
    add_device(p, None)
    p.add_argument("--tokens", type=int, default=64, help="decode positions measured (default 64)")
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps first (default 8)")
    p.add_argument("--copies", type=int, default=20, help="timed copies of one expert (default 20)")
    p.add_argument("--quantile", type=float, default=0.5,
                   help="M_max = this quantile of floor(W / t_copy) over every event (default 0.5, the median)")
    add_seed(p)
    add_json(p)
    add_threads(p)
    p.set_defaults(func=profile_window)

    p = subparsers.add_parser("recall", help="next-layer ExpertRecall@M of SpecPrefetch and baselines (pre-gate, "
                                             "previous token, single MLP, ProMoE-style MLP) on held-out text (the "
                                             "paper's Tables 1-3)")
    add_model(p, "tiny-moe")
    p.add_argument("--predictor", help="a trained SpecPrefetch predictor (.safetensors) to evaluate instead of "
                                       "training one (the baselines still train)")
    p.add_argument("--train-tokens", type=int, default=16384, help="training tokens of the learned methods "
                                                                   "(default 16384)")
    p.add_argument("--heldout-tokens", type=int, default=4096, help="evaluated tokens (default 4096)")
    add_texts(p, "held-out text (repeatable; default: the held-out Persuasion text for the shipped models, "
                 "standard-library window modules otherwise)", option="--heldout-text")
    p.add_argument("--budgets", help="comma-separated candidate budgets M (default K/2,K,K+2)")
    add_json(p)
    _training_options(p)
    p.set_defaults(func=recall)


def _training_options(p: argparse.ArgumentParser) -> None:
    """The options of the predictor's training, which train-predictor and recall share."""
    add_texts(p, "training text (repeatable; default: standard-library sources other than the excess-nll and bench "
                 "windows': " + ", ".join(PREDICTOR_MODULES) + ")")
    p.add_argument("--rank", type=int, help="SpecPrefetch's adapter rank r (default: the paper's 64, capped at the "
                                            "model's experts and hidden size)")
    p.add_argument("--epochs", type=int, default=1, help="training epochs (default 1, the paper's)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate (default 1e-3: the paper's 1e-4 is for millions of tokens; a CPU run "
                        "trains on tens of thousands)")
    p.add_argument("--batch-size", type=int, default=64, help="tokens per optimiser step (default 64)")
    p.add_argument("--window", type=int, default=256, help="tokens per forward window (default 256)")
    p.add_argument("--dtype", default="bf16", choices=list(PREDICTOR_DTYPES),
                   help="training precision: bf16 (autocast over float32 master weights, the default) or fp32")
    add_device(p)
    add_seed(p, "the training and of random models")
    add_threads(p)


def _rank(args: argparse.Namespace, model: Any) -> int:
    """--rank, or the paper's r = 64 capped at the model's experts and hidden size (the rank of B A)."""
    from ..prefetch.train import model_facts

    if args.rank is not None:
        return args.rank
    facts = model_facts(model)
    return min(64, facts["num_experts"], facts["hidden_size"])


def _dtype(args: argparse.Namespace) -> Any:
    import torch

    return getattr(torch, PREDICTOR_DTYPES[args.dtype])


def train_predictor(args: argparse.Namespace) -> int:
    from ..assets.texts import token_windows, training_texts
    from ..prefetch.train import train_predictor as train

    model, tokenizer, info = load_model_of(args)
    texts, names = training_texts(args.text)
    windows = token_windows(texts, tokenizer, tokens=args.tokens, window=args.window, option="--tokens")
    err(f"psr-hf train-predictor: {sum(w.numel() for w in windows)} tokens in {len(windows)} windows of "
        f"{', '.join(names)}")
    predictor = train(model, windows, rank=_rank(args, model), epochs=args.epochs, lr=args.lr,
                      batch_size=args.batch_size, dtype=_dtype(args), seed=args.seed, progress=True)
    predictor.metadata.update(model=str(info["name"]), texts=", ".join(names))
    predictor.save(args.out)
    meta = predictor.metadata
    print(f"psr-hf train-predictor: {info['name']}: {predictor.num_pairs} layer pairs, rank {predictor.rank}, "
          f"{predictor.num_parameters:,} parameters; {meta['tokens']} tokens, {meta['steps']} steps "
          f"({meta['precision']}); KL {float(meta['initial_loss']):.4f} -> {float(meta['final_loss']):.4f} "
          f"(final loss)")
    print(f"predictor: {args.out}")
    return 0


def recall(args: argparse.Namespace) -> int:
    import time

    from ..assets.texts import measured_texts, token_windows, training_texts
    from ..prefetch.recall import format_recall_table, recall_table

    started = time.perf_counter()
    model, tokenizer, info = load_model_of(args)
    texts, names = training_texts(args.text)
    train = token_windows(texts, tokenizer, tokens=args.train_tokens, window=args.window, option="--train-tokens")
    # a shipped trained model never saw its held-out text
    held_texts, held_names = measured_texts(args.model, args.heldout_text, option="--heldout-text")
    held = token_windows(held_texts, tokenizer, tokens=args.heldout_tokens, window=args.window,
                         option="--heldout-tokens")
    budgets = [int(x) for x in comma_floats("--budgets", args.budgets)] if args.budgets else None
    err(f"psr-hf recall: training on {args.train_tokens} tokens of {', '.join(names)}; evaluating on "
        f"{args.heldout_tokens} tokens of {', '.join(held_names)}")
    record = recall_table(model, train, held, rank=_rank(args, model), budgets=budgets, predictor=args.predictor,
                          epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, dtype=_dtype(args),
                          seed=args.seed, progress=True)
    record.update(model_name=str(info["name"]), train_texts=names, heldout_texts=held_names,
                  wall_seconds=time.perf_counter() - started)
    print(f"psr-hf recall: {info['name']}: next-layer ExpertRecall@M on held-out text ({', '.join(held_names)})")
    print(format_recall_table(record))
    if args.json:
        write_json(args.json, record, ensure_ascii=False)
    return 0


def profile_window(args: argparse.Namespace) -> int:
    from ..assets.texts import measured_texts, text_windows
    from ..bench.common import quiet_uncalibrated
    from ..prefetch.window import profile_unpatched

    model, tokenizer, info = load_model_of(args)
    texts, _ = measured_texts(args.model, [], option="--text")
    (ids,) = text_windows(texts[:1], tokenizer, windows=1, tokens=args.tokens)
    with quiet_uncalibrated(), compile_notice():
        profile = profile_unpatched(model, ids[0].tolist(), warmup=args.warmup, copies=args.copies,
                                    quantile=args.quantile)
    record = profile.to_dict()
    record.update(model=str(info["name"]), tokens=args.tokens)
    rows = [[str(pair), f"{w:.3f}", str(m)] for pair, (w, m) in
            enumerate(zip(record["window_ms_per_pair"], record["budget_per_pair"]))]
    print(f"psr-hf profile-window: {info['name']} on {profile.device} "
          f"({'CUDA graphs' if record['notes']['graphs'] else 'eager'}), {record['positions']} decode positions; "
          f"one expert ({profile.bytes_per_expert / 1e6:.2f} MB) copies in {profile.copy_time_ms:.3f} ms (median of "
          f"{len(record['copy_ms'])})")
    print(text_table(rows, ["pair l -> l+1", "window W_l ms (median)", "floor(W_l / t_copy)"]))
    exceeding = ", ".join(f"{k} copies {100 * v:.0f}%" for k, v in record["exceeding"].items())
    print(f"M_max = {profile.budget} (the {args.quantile:g} quantile over every event of floor(W / t_copy)); events "
          f"whose window is shorter than: {exceeding}")
    if args.json:
        write_json(args.json, record)
    return 0
