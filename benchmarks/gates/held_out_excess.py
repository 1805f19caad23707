"""A first look at the paper's Section 6.10 question on olmoe-routing (CPU): does distilling PSR's routing lower its
held-out excess NLL at matched copies? Trains a distilled PSR (psr_hf.gates.train, lam 0.3, n = 1, 37.5%) on
standard-library training text, then measures on the held-out Persuasion windows the NLL per token of the original
exact model and, against it, the excess of: Cache-Prior at several lam, untrained PSR at several lam, and the
distilled PSR at lam 0.3, with copies per token from the controller. One record, held_out_excess.json.
Usage: python benchmarks/gates/held_out_excess.py [--tokens 16384] [--windows 8]"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats

import psr_hf
from psr_hf.assets import load_shipped
from psr_hf.assets.texts import default_texts, module_sources, text_windows, token_windows, PREDICTOR_MODULES
from psr_hf.gates.train import apply_distilled, distill_routing

HERE = Path(__file__).parent


def nll(model, windows) -> np.ndarray:
    """Per window: mean next-token NLL over the window's positions after the first."""
    out = []
    with torch.no_grad():
        for w in windows:
            logits = model(input_ids=w).logits[0, :-1].float()
            out.append(float(F.cross_entropy(logits, w[0, 1:])))
    return np.array(out)


def routed(model, config, calibration, windows) -> tuple[np.ndarray, float]:
    with psr_hf.patched(model, config, calibration=calibration):
        values = nll(model, windows)
        stats = psr_hf.controller(model).stats().total
    return values, float(stats["copies_per_token"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--eval-tokens", type=int, default=255)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    model, tokenizer, calibration = load_shipped("olmoe-routing")
    train = token_windows([t for _, t in module_sources(PREDICTOR_MODULES)], tokenizer, tokens=args.tokens,
                          window=args.window, option="--tokens")
    held = text_windows([t for _, t in default_texts("olmoe-routing")], tokenizer, windows=args.windows,
                        tokens=args.eval_tokens)
    exact = nll(model, held)
    rows = {}

    def add(name, values, copies):
        d = values - exact
        half = stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
        rows[name] = {"excess_nll": float(d.mean()), "ci95": [float(d.mean() - half), float(d.mean() + half)],
                      "copies_per_token": copies, "per_window": d.tolist()}
        print(f"{name}: excess {d.mean():.4f} [{d.mean() - half:.4f}, {d.mean() + half:.4f}], copies {copies:.2f}")

    for lam in (0.1, 0.2, 0.3, 0.5):
        prior = psr_hf.RoutingConfig(policy="cache_prior", lam=lam, residency=0.375)
        add(f"cache_prior_lam{lam}", *routed(model, prior, calibration, held))
        add(f"psr_lam{lam}_n1", *routed(model, psr_hf.RoutingConfig(policy="psr", lam=lam, budget=1, residency=0.375),
                                         calibration, held))
    config = psr_hf.RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.375)
    with tempfile.TemporaryDirectory() as folder:
        result = distill_routing(model, train, config, Path(folder) / "d", calibration=calibration,
                                 steps=len(train), lr=1e-3, router_lr=2e-4, warmup=20)
        fresh, _, _ = load_shipped("olmoe-routing")
        distilled = apply_distilled(fresh, result.path)
    for lam in (0.3, 0.5):
        add(f"distilled_psr_lam{lam}_n1",
            *routed(distilled, psr_hf.RoutingConfig(policy="psr", lam=lam, budget=1, residency=0.375), calibration,
                    held))
    paired = {}
    for lam in (0.3, 0.5):  # distilled against untrained PSR at the same lam, paired by window
        trained, untrained = (np.array(rows[f"{kind}psr_lam{lam}_n1"]["per_window"]) for kind in ("distilled_", ""))
        d = trained - untrained
        half = stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
        paired[f"lam{lam}"] = {"difference": float(d.mean()), "ci95": [float(d.mean() - half), float(d.mean() + half)],
                               "relative": float(d.mean() / rows[f"psr_lam{lam}_n1"]["excess_nll"])}
        print(f"distilled - untrained PSR lam {lam}: {d.mean():.4f} [{d.mean() - half:.4f}, {d.mean() + half:.4f}]")
    record = {"model": "olmoe-routing (float32, CPU)", "residency": 0.375, "paired": paired,
              "train": {"text": "stdlib " + ", ".join(PREDICTOR_MODULES), "tokens": sum(w.numel() for w in train),
                        "steps": len(train), "window": args.window, "lr": 1e-3, "router_lr": 2e-4,
                        "ranks": [result.attention_rank, result.expert_rank],
                        "kl_first_10": float(np.mean(result.losses[:10])),
                        "kl_last_10": float(np.mean(result.losses[-10:]))},
              "held_out": {"text": "Persuasion (held out)", "windows": args.windows, "tokens": args.eval_tokens,
                           "exact_nll": float(exact.mean())},
              "rows": rows, "wall_seconds": time.time() - started}
    (HERE / "held_out_excess.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
