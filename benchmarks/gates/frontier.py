"""The paper's Section 6.10 frontier on olmoe-routing (CPU, 37.5% residency): does training the gate lower the excess
NLL at the same host loads? Trains three variants on standard-library training text (psr_hf.training.gate):

- ``swap``: the change-based gate (Cache-Prior, LRU) with a learned per-token margin, the routers, attention and
  per-expert LoRA, KL to the exact model plus the smooth host-load penalty;
- ``psr_distilled``: PSR's own router (lam 0.3, n = 1) with attention and per-expert LoRA, KL only;
- ``bonus``: PSR (lam 0.3, n = 1) with a learned, bounded per-token bonus, the routers and the LoRA, KL plus the
  penalty;

then measures on the held-out Persuasion windows and on selfgen windows (sampled from the exact model at
temperature 1) the excess NLL per token over the original exact model, with copies per token from the controller,
of Cache-Prior and untrained PSR at several lam (the training-free frontiers) and of each trained variant. Each
trained variant is compared, paired by window, with each frontier interpolated linearly in copies per token between
its two lam points that bracket the variant's copies (the matched-loads comparison). Writes frontier.json and
frontier.png here (frontier_selfgen.* with --train-text selfgen: trained on the exact model's own samples), and the
trained folders under --keep (for the lm-eval comparison).
Usage: python benchmarks/gates/frontier.py --keep DIR [--train-text stdlib|selfgen] [--tokens 65536] [--windows 16]"""

from __future__ import annotations

import argparse
import json
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
from psr_hf.gates import MarginHead
from psr_hf.training.gate import distill_routing, load_distilled

HERE = Path(__file__).parent
RESIDENCY = 0.375
FRONTIERS = {"cache_prior": (0.05, 0.1, 0.15, 0.2, 0.3, 0.5), "psr": (0.1, 0.2, 0.3, 0.5, 0.8, 1.2)}
LR, ROUTER_LR, HEAD_LR, WARMUP = 1e-3, 2e-4, 1e-2, 20
SELFGEN_TRAIN_SEED = 1000  # the measured selfgen windows use seeds 0, 1, ...


def routing(policy: str, lam: float) -> psr_hf.RoutingConfig:
    extra = {"budget": 1} if policy == "psr" else {"eviction": "lru"}
    return psr_hf.RoutingConfig(policy=policy, lam=lam, residency=RESIDENCY, **extra)


# name -> (policy, lam, margin head?, load penalty)
VARIANTS = {"swap": ("cache_prior", 0.1, True, 0.003), "psr_distilled": ("psr", 0.3, False, 0.0),
            "bonus": ("psr", 0.3, True, 0.003)}


def nll(model, windows) -> np.ndarray:
    """Per window: the mean next-token NLL over its positions after the first."""
    out = []
    with torch.no_grad():
        for w in windows:
            logits = model(input_ids=w).logits[0, :-1].float()
            out.append(float(F.cross_entropy(logits, w[0, 1:])))
    return np.array(out)


def routed(model, config, calibration, windows, gate=None) -> tuple[np.ndarray, float]:
    with psr_hf.patched(model, config, calibration=calibration, gate=gate):
        values = nll(model, windows)
        copies = float(psr_hf.controller(model).stats().total["copies_per_token"])
    return values, copies


def interval(d: np.ndarray) -> list[float]:
    half = stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
    return [float(d.mean() - half), float(d.mean() + half)]


def matched(frontier: list[dict], copies: float) -> tuple[np.ndarray, str] | None:
    """Per-window excess of a frontier interpolated at ``copies`` between the two points that bracket it (by their
    copies per token), or None outside the frontier's range."""
    points = sorted(frontier, key=lambda r: r["copies_per_token"])
    for lo, hi in zip(points, points[1:]):
        if lo["copies_per_token"] <= copies <= hi["copies_per_token"]:
            span = hi["copies_per_token"] - lo["copies_per_token"]
            a = 0.0 if span == 0 else (copies - lo["copies_per_token"]) / span
            values = (1 - a) * np.array(lo["per_window"]) + a * np.array(hi["per_window"])
            return values, f"{lo['row']} .. {hi['row']} ({a:.2f})"
    return None


def measure(original, trained: dict, calibration, windows, name: str) -> dict:
    exact = nll(original, windows)
    rows: dict[str, dict] = {}

    def add(row: str, model, config, gate=None) -> dict:
        values, copies = routed(model, config, calibration, windows, gate)
        d = values - exact
        rows[row] = {"row": row, "excess_nll": float(d.mean()), "ci95": interval(d), "copies_per_token": copies,
                     "per_window": d.tolist()}
        print(f"{name} {row}: excess {d.mean():.4f} {interval(d)}, copies {copies:.2f}", flush=True)
        return rows[row]

    frontiers = {policy: [add(f"{policy}_lam{lam}", original, routing(policy, lam)) for lam in lams]
                 for policy, lams in FRONTIERS.items()}
    comparisons = {}
    for variant, (model, gate) in trained.items():
        policy, lam = VARIANTS[variant][:2]
        row = add(variant, model, routing(policy, lam), gate)
        untrained = rows.get(f"{policy}_lam{lam}") or add(f"{policy}_lam{lam}", original, routing(policy, lam))
        comparisons[variant] = {"untrained_same_lam": _difference(row, np.array(untrained["per_window"]),
                                                                  untrained["row"], untrained["copies_per_token"])}
        for frontier, points in frontiers.items():
            at = matched(points, row["copies_per_token"])
            comparisons[variant][f"{frontier}_matched"] = (
                None if at is None else _difference(row, at[0], at[1], row["copies_per_token"]))
        for key, c in comparisons[variant].items():
            if c is not None:
                print(f"{name} {variant} - {key} ({c['against']}): {c['difference']:.4f} {c['ci95']}, "
                      f"{100 * c['relative']:+.0f}%", flush=True)
    return {"windows": len(windows), "exact_nll": float(exact.mean()), "rows": rows, "comparisons": comparisons}


def _difference(row: dict, baseline: np.ndarray, against: str, copies: float) -> dict:
    d = np.array(row["per_window"]) - baseline
    ci = interval(d)
    return {"against": against, "baseline_copies": copies, "difference": float(d.mean()), "ci95": ci,
            "relative": float(d.mean() / baseline.mean()), "resolved": bool(ci[1] < 0 or ci[0] > 0)}


def train(variant: str, windows, calibration, keep: Path, seed: int) -> dict:
    policy, lam, with_gate, penalty = VARIANTS[variant]
    model, _, _ = load_shipped("olmoe-routing")
    gate = MarginHead.uniform(lam * calibration.delta, model.config.hidden_size) if with_gate else None
    started = time.time()
    result = distill_routing(model, windows, routing(policy, lam), keep / variant, calibration=calibration,
                             steps=len(windows), lr=LR, router_lr=ROUTER_LR, head_lr=HEAD_LR, warmup=WARMUP,
                             seed=seed, gate=gate, load_penalty=penalty, metadata={"variant": variant})
    tenth = max(1, len(result.losses) // 10)
    facts = {"policy": policy, "lam": lam, "margin_head": with_gate, "load_penalty": penalty,
             "steps": len(result.losses), "seconds": time.time() - started,
             "kl_first_tenth": float(np.mean(result.losses[:tenth])),
             "kl_last_tenth": float(np.mean(result.losses[-tenth:]))}
    if result.loads:
        facts |= {"smooth_loads_first_tenth": float(np.mean(result.loads[:tenth])),
                  "smooth_loads_last_tenth": float(np.mean(result.loads[-tenth:]))}
    print(f"trained {variant}: {facts}", flush=True)
    return facts


def plot(record: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    for i, text in enumerate(("held_out", "selfgen")):
        ax = fig.add_subplot(1, 2, i + 1)
        rows = record[text]["rows"]
        for policy, marker in (("cache_prior", "o-"), ("psr", "s-")):
            points = sorted((r for k, r in rows.items() if k.startswith(policy + "_lam")),
                            key=lambda r: r["copies_per_token"])
            ax.plot([r["copies_per_token"] for r in points], [r["excess_nll"] for r in points], marker,
                    label=f"{policy} (untrained, lam sweep)")
        for variant in VARIANTS:
            if variant in rows:
                r = rows[variant]
                ax.errorbar([r["copies_per_token"]], [r["excess_nll"]], fmt="*", markersize=12,
                            yerr=[[r["excess_nll"] - r["ci95"][0]], [r["ci95"][1] - r["excess_nll"]]],
                            label=f"trained: {variant}")
        ax.set_xlabel("host loads (copies) per token")
        ax.set_ylabel("excess NLL over exact (nats/token)")
        ax.set_title(f"olmoe-routing, {text.replace('_', '-')}, 37.5% residency")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=65536, help="training tokens per variant")
    parser.add_argument("--window", type=int, default=256, help="training window (one per step)")
    parser.add_argument("--windows", type=int, default=16, help="measured windows per text")
    parser.add_argument("--eval-tokens", type=int, default=255, help="tokens per measured window")
    parser.add_argument("--keep", type=Path, required=True, help="folder for the trained variants (new)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--train-text", choices=["stdlib", "selfgen"], default="stdlib",
                        help="training text: standard-library sources, or the exact model's own samples (the "
                             "paper's choice; seeds from 1000 on, disjoint from the measured selfgen windows' 0..)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    original, tokenizer, calibration = load_shipped("olmoe-routing")
    windows = token_windows([t for _, t in module_sources(PREDICTOR_MODULES)], tokenizer, tokens=args.tokens,
                            window=args.window, option="--tokens")
    text = "stdlib " + ", ".join(PREDICTOR_MODULES)
    if args.train_text == "selfgen":
        windows = [w.reshape(-1) for w in sample_windows(original, start_tokens(original, windows),
                                                         tokens=args.window - 1, seed=SELFGEN_TRAIN_SEED)]
        text = f"sampled from the exact model, temperature 1, seeds {SELFGEN_TRAIN_SEED} on"
    facts = {v: train(v, windows, calibration, args.keep, args.seed) for v in args.variants}
    trained = {v: load_distilled(load_shipped("olmoe-routing")[0], args.keep / v) for v in args.variants}
    held = text_windows([t for _, t in default_texts("olmoe-routing")], tokenizer, windows=args.windows,
                        tokens=args.eval_tokens)
    selfgen = sample_windows(original, start_tokens(original, held), tokens=args.eval_tokens, seed=0)
    record = {"model": "olmoe-routing (float32, CPU)", "residency": RESIDENCY,
              "train": {"text": text, "tokens": sum(w.numel() for w in windows),
                        "window": args.window, "lr": LR, "router_lr": ROUTER_LR, "head_lr": HEAD_LR,
                        "warmup": WARMUP, "temperature": 0.5, "seed": args.seed, "variants": facts},
              "held_out": {"text": "Persuasion (held out)", "tokens": args.eval_tokens,
                           **measure(original, trained, calibration, held, "held-out")},
              "selfgen": {"text": "sampled from the exact model, temperature 1, seed 0", "tokens": args.eval_tokens,
                          **measure(original, trained, calibration, selfgen, "selfgen")}}
    record["wall_seconds"] = time.time() - started
    name = "frontier" if args.train_text == "stdlib" else "frontier_selfgen"
    (HERE / f"{name}.json").write_text(json.dumps(record, indent=2))
    plot(record, HERE / f"{name}.png")


if __name__ == "__main__":
    main()
