"""A first look at the paper's Section 6.10 question on olmoe-routing (CPU): does distilling PSR's routing lower its
excess NLL at matched copies? Trains a distilled PSR (psr_hf.gates.train: lam 0.3, n = 1, 37.5% residency) on
standard-library training text, then measures, on the held-out Persuasion windows and on selfgen windows (sampled
from the exact model at temperature 1, psr_hf.eval.selfgen), the excess NLL per token over the original exact model
of Cache-Prior and untrained PSR at several lam and of the distilled PSR, with copies per token from the controller,
and the distilled-minus-untrained differences paired by window. One record, distilled_excess.json.
Usage: python benchmarks/gates/distilled_excess.py [--tokens 16384] [--windows 16]"""

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
from psr_hf.assets.texts import PREDICTOR_MODULES, default_texts, module_sources, text_windows, token_windows
from psr_hf.eval.selfgen import sample_windows, start_tokens
from psr_hf.gates.train import apply_distilled, distill_routing

HERE = Path(__file__).parent
LAMS = (0.1, 0.2, 0.3, 0.5)
DISTILLED_LAMS = (0.3, 0.5)


def _psr(lam: float) -> psr_hf.RoutingConfig:
    return psr_hf.RoutingConfig(policy="psr", lam=lam, budget=1, residency=0.375)


def nll(model, windows) -> np.ndarray:
    """Per window: the mean next-token NLL over its positions after the first."""
    out = []
    with torch.no_grad():
        for w in windows:
            logits = model(input_ids=w).logits[0, :-1].float()
            out.append(float(F.cross_entropy(logits, w[0, 1:])))
    return np.array(out)


def routed(model, config, calibration, windows) -> tuple[np.ndarray, float]:
    with psr_hf.patched(model, config, calibration=calibration):
        values = nll(model, windows)
        copies = float(psr_hf.controller(model).stats().total["copies_per_token"])
    return values, copies


def _interval(d: np.ndarray) -> list[float]:
    half = stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
    return [float(d.mean() - half), float(d.mean() + half)]


def measure(model, distilled, calibration, windows, name: str) -> dict:
    exact = nll(model, windows)
    rows = {}
    runs = [(f"cache_prior_lam{lam}", model, psr_hf.RoutingConfig(policy="cache_prior", lam=lam, residency=0.375))
            for lam in LAMS] + [(f"psr_lam{lam}_n1", model, _psr(lam)) for lam in LAMS] + [
            (f"distilled_psr_lam{lam}_n1", distilled, _psr(lam)) for lam in DISTILLED_LAMS]
    for row, net, config in runs:
        values, copies = routed(net, config, calibration, windows)
        d = values - exact
        rows[row] = {"excess_nll": float(d.mean()), "ci95": _interval(d), "copies_per_token": copies,
                     "per_window": d.tolist()}
        print(f"{name} {row}: excess {d.mean():.4f} {_interval(d)}, copies {copies:.2f}")
    paired = {}
    for lam in DISTILLED_LAMS:  # distilled against untrained PSR at the same lam, paired by window
        trained, untrained = (np.array(rows[f"{kind}psr_lam{lam}_n1"]["per_window"]) for kind in ("distilled_", ""))
        d = trained - untrained
        paired[f"lam{lam}"] = {"difference": float(d.mean()), "ci95": _interval(d),
                               "relative": float(d.mean() / rows[f"psr_lam{lam}_n1"]["excess_nll"])}
        print(f"{name} distilled - untrained PSR lam {lam}: {d.mean():.4f} {_interval(d)}")
    return {"windows": len(windows), "exact_nll": float(exact.mean()), "rows": rows, "paired": paired}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384, help="training tokens")
    parser.add_argument("--window", type=int, default=256, help="training window (one per step)")
    parser.add_argument("--windows", type=int, default=16, help="measured windows per text")
    parser.add_argument("--eval-tokens", type=int, default=255, help="tokens per measured window")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    model, tokenizer, calibration = load_shipped("olmoe-routing")
    train = token_windows([t for _, t in module_sources(PREDICTOR_MODULES)], tokenizer, tokens=args.tokens,
                          window=args.window, option="--tokens")
    held = text_windows([t for _, t in default_texts("olmoe-routing")], tokenizer, windows=args.windows,
                        tokens=args.eval_tokens)
    selfgen = sample_windows(model, start_tokens(model, held), tokens=args.eval_tokens, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        result = distill_routing(model, train, _psr(0.3), Path(folder) / "d", calibration=calibration,
                                 steps=len(train), lr=1e-3, router_lr=2e-4, warmup=20)
        original, _, _ = load_shipped("olmoe-routing")
        distilled = apply_distilled(load_shipped("olmoe-routing")[0], result.path)
    record = {"model": "olmoe-routing (float32, CPU)", "residency": 0.375,
              "train": {"text": "stdlib " + ", ".join(PREDICTOR_MODULES), "tokens": sum(w.numel() for w in train),
                        "steps": len(train), "window": args.window, "lr": 1e-3, "router_lr": 2e-4,
                        "ranks": [result.attention_rank, result.expert_rank],
                        "kl_first_10": float(np.mean(result.losses[:10])),
                        "kl_last_10": float(np.mean(result.losses[-10:]))},
              "held_out": {"text": "Persuasion (held out)", "tokens": args.eval_tokens,
                           **measure(original, distilled, calibration, held, "held-out")},
              "selfgen": {"text": "sampled from the exact model, temperature 1, seed 0", "tokens": args.eval_tokens,
                          **measure(original, distilled, calibration, selfgen, "selfgen")},
              "wall_seconds": time.time() - started}
    (HERE / "distilled_excess.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
