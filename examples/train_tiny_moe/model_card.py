"""Calibrate the trained tiny MoE and measure what its model card reports (CPU is enough).

    python examples/train_tiny_moe/model_card.py --model RUN_DIR/model --shards SHARDS_DIR --out CARD_DIR \
        [--windows 16] [--tokens 512] [--calibration-tokens 200000]

1. **Calibration** on the calib split only (``psr_hf.calibrate``: delta, warm set, token prior), saved as
   ``CARD_DIR/calibration.safetensors``.
2. **Did the router specialise?** On held-out windows, with exact routing (the router's own top-K), recorded by
   the controller: per layer the entropy of expert usage against the uniform ``ln 64``; the reuse of the top-8
   between consecutive tokens (mean ``|S_t & S_t-1| / 8``; a random router gives about 8/64); and the accuracy of
   the next layer's router applied one layer early (the pre-gate: mean ``|top8(g) & top8(z)| / 8``).
3. **Distance from exact routing and copies** of exact+LRU, and of cache_prior and psr (budget 1) for lam in
   {0.1, 0.2, 0.3} at 50% and 25% residency: ``psr_hf.eval.divergence`` on the same held-out windows.

Writes ``CARD_DIR/card.json`` and prints the tables (Markdown) for the model card.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch


def windows_from(tokens: np.ndarray, count: int, length: int) -> list[torch.Tensor]:
    """``count`` consecutive non-overlapping windows ``[1, length]`` from the start of ``tokens``."""
    if tokens.size < count * length:
        raise SystemExit(f"{tokens.size} tokens: not enough for {count} windows of {length}")
    return [torch.from_numpy(tokens[i * length : (i + 1) * length].astype(np.int64))[None] for i in range(count)]


def routing_metrics(model, windows: list[torch.Tensor], calibration) -> dict:
    """Expert-usage entropy, consecutive top-K reuse and pre-gate accuracy per MoE layer (exact routing)."""
    import psr_hf

    config = psr_hf.RoutingConfig(policy="exact", eviction="score", budget=1, residency=1.0)  # pre-gate computed
    with psr_hf.patched(model, config, calibration=calibration):
        ctl = psr_hf.controller(model)
        K, E, L = ctl.top_k, ctl.num_experts, ctl.num_layers
        with ctl.record() as rec:
            for w in windows:
                with torch.no_grad():
                    model(input_ids=w)
    counts = np.zeros((L, E))
    reuse = np.zeros(L)
    hits = np.zeros(L)
    steps = 0
    pairs = 0
    for r in rec.recordings:
        own = np.argsort(-r.scores, axis=-1, kind="stable")[:, :, :K]  # [T, L, K]
        pre = np.argsort(-r.pregate, axis=-1, kind="stable")[:, :, :K]
        member = np.zeros((own.shape[0], L, E), dtype=bool)
        np.put_along_axis(member, own, True, axis=-1)
        counts += member.sum(axis=0)
        reuse += (member[1:] & member[:-1]).sum(axis=(0, 2)) / K
        pairs += own.shape[0] - 1
        for layer in range(1, L):
            hits[layer] += np.take_along_axis(member[:, layer], pre[:, layer], axis=-1).sum() / K
        steps += own.shape[0]
    p = counts / counts.sum(axis=1, keepdims=True)
    entropy = -(p * np.log(np.where(p > 0, p, 1))).sum(axis=1)
    return {
        "tokens": steps,
        "uniform_entropy": math.log(E),
        "usage_entropy": entropy.tolist(),
        "top_k_reuse": (reuse / pairs).tolist(),
        "random_reuse": K / E,
        "pregate_accuracy": [None] + (hits[1:] / steps).tolist(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--shards", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--calibration-tokens", type=int, default=200_000)
    p.add_argument("--calibration", type=Path, help="use this calibration instead of computing one")
    args = p.parse_args()
    import psr_hf
    from psr_hf.eval.divergence import divergence, format_rows, sweep_configs
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.calibration:
        calibration = psr_hf.Calibration.load(args.calibration)
    else:
        calib_tokens = np.fromfile(args.shards / "calib.bin", dtype=np.uint16)[: args.calibration_tokens]
        ids = torch.from_numpy(calib_tokens[: calib_tokens.size // 512 * 512].astype(np.int64)).view(-1, 512)
        calibration = psr_hf.calibrate(model, ids, batch_size=8)
        calibration.save(args.out / "calibration.safetensors")
    heldout = np.fromfile(args.shards / "heldout.bin", dtype=np.uint16)
    windows = windows_from(heldout, args.windows, args.tokens)
    metrics = routing_metrics(model, windows, calibration)
    rows = divergence(model, windows, sweep_configs(), calibration=calibration)
    card = {"model": str(args.model), "heldout_windows": args.windows, "tokens_per_window": args.tokens,
            "routing": metrics, "divergence": [r.to_dict() for r in rows]}
    (args.out / "card.json").write_text(json.dumps(card, indent=2))
    print("| layer | usage entropy (uniform %.3f) | top-8 reuse (random %.3f) | pre-gate accuracy |" % (
        metrics["uniform_entropy"], metrics["random_reuse"]))
    print("|---|---|---|---|")
    for layer, (h, reuse, acc) in enumerate(zip(metrics["usage_entropy"], metrics["top_k_reuse"],
                                               metrics["pregate_accuracy"])):
        print(f"| {layer} | {h:.3f} | {reuse:.3f} | {'-' if acc is None else f'{acc:.3f}'} |")
    print()
    print(format_rows(rows))


if __name__ == "__main__":
    main()
