"""Calibrate the trained tiny MoE and measure what its model card reports (CPU is enough).

    python examples/train_tiny_moe/model_card.py --model RUN_DIR/model --shards SHARDS_DIR --out CARD_DIR \
        [--windows 16] [--tokens 512] [--calibration-tokens 500000]

0. **Held-out loss** of the model, per source, over the whole held-out split.
1. **Calibration** on the calib split only (``psr_hf.calibrate``: delta, warm set, token prior), saved as
   ``CARD_DIR/calibration.safetensors``.
2. **Did the router specialise?** On held-out windows (spread evenly over the split, so over every source), with exact routing (the router's own top-K), recorded by
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


def window_starts(tokens: np.ndarray, count: int, length: int) -> np.ndarray:
    """Starts of ``count`` non-overlapping windows of ``length`` spread evenly over ``tokens`` (so over every
    source, which the split stores one after another)."""
    if tokens.size < count * length:
        raise SystemExit(f"{tokens.size} tokens: not enough for {count} windows of {length}")
    return np.linspace(0, tokens.size - length, count).astype(np.int64)


def windows_from(tokens: np.ndarray, count: int, length: int) -> list[torch.Tensor]:
    return [torch.from_numpy(tokens[s : s + length].astype(np.int64))[None]
            for s in window_starts(tokens, count, length)]


@torch.no_grad()
def heldout_loss_by_source(model, tokens: np.ndarray, by_source: dict, length: int = 512) -> dict:
    """Next-token loss (nats) of the unpatched model over the whole split, per source and overall, in
    non-overlapping windows of ``length`` (``by_source`` is meta.json's record, in the split's order)."""
    out, offset, total_nll, total_n = {}, 0, 0.0, 0
    for source, record in by_source.items():
        part = tokens[offset : offset + record["tokens"]]
        offset += record["tokens"]
        nll, n = 0.0, 0
        rows = part[: part.size // length * length].reshape(-1, length).astype(np.int64)
        for i in range(0, len(rows), 32):
            ids = torch.from_numpy(rows[i : i + 32])
            logits = model(input_ids=ids).logits.float()
            nll += float(torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"))
            n += ids[:, 1:].numel()
        out[source] = {"tokens": n, "loss": nll / n}
        total_nll, total_n = total_nll + nll, total_n + n
    if offset != tokens.size:
        raise SystemExit(f"meta.json counts {offset} held-out tokens, the file has {tokens.size}: rebuild the shards")
    out["all"] = {"tokens": total_n, "loss": total_nll / total_n}
    return out


def source_at(positions: np.ndarray, by_source: dict) -> list[str]:
    """The source each token position of the split belongs to (``by_source``: meta.json's record, in order)."""
    ends = np.cumsum([r["tokens"] for r in by_source.values()])
    return [list(by_source)[int(i)] for i in np.searchsorted(ends, positions, side="right")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--shards", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--calibration-tokens", type=int, default=500_000,
                   help="calib tokens for the calibration, in rows of 512 spread over the split (default: all)")
    p.add_argument("--calibration", type=Path, help="use this calibration instead of computing one")
    args = p.parse_args()
    import psr_hf
    from psr_hf.eval.divergence import divergence, format_rows, sweep_configs
    from psr_hf.eval.router_stats import recordings, router_stats
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.calibration:
        calibration = psr_hf.Calibration.load(args.calibration)
    else:
        calib_tokens = np.fromfile(args.shards / "calib.bin", dtype=np.uint16)
        rows = max(min(args.calibration_tokens, calib_tokens.size) // 512, 1)
        ids = torch.cat(windows_from(calib_tokens, rows, 512))  # spread over every source of the calib split
        calibration = psr_hf.calibrate(model, ids, batch_size=8)
        calibration.save(args.out / "calibration.safetensors")
    heldout = np.fromfile(args.shards / "heldout.bin", dtype=np.uint16)
    meta = json.loads((args.shards / "meta.json").read_text())
    losses = heldout_loss_by_source(model, heldout, meta["splits"]["heldout"]["by_source"])
    windows = windows_from(heldout, args.windows, args.tokens)
    labels = source_at(window_starts(heldout, args.windows, args.tokens), meta["splits"]["heldout"]["by_source"])
    metrics = router_stats(recordings(model, windows, calibration), labels).to_dict()
    # the same measurements on an untrained model of the same config (seeded): what a router that never learned
    # anything gives on the same windows
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    baseline = router_stats(recordings(untrained, windows), labels).to_dict()
    del untrained
    rows = divergence(model, windows, sweep_configs(), calibration=calibration)
    card = {"model": str(args.model), "heldout_windows": args.windows, "tokens_per_window": args.tokens, "window_sources": labels,
            "heldout_loss": losses, "routing": metrics, "routing_untrained": baseline, "divergence": [r.to_dict() for r in rows]}
    (args.out / "card.json").write_text(json.dumps(card, indent=2))
    print("| held-out source | tokens | loss (nats/token) |\n|---|---|---|")
    for source, r in losses.items():
        print(f"| {source} | {r['tokens']:,} | {r['loss']:.3f} |")
    print()
    print(f"| layer | usage entropy (uniform {metrics['uniform_entropy']:.3f}) | top-8 reuse (random "
          f"{metrics['random_reuse']:.3f}) | pre-gate accuracy | I(expert; source) |")
    print("|---|---|---|---|---|")
    keys = ("usage_entropy", "top_k_reuse", "pregate_accuracy", "source_information")
    for layer in range(len(metrics["usage_entropy"])):
        cells = ["-" if metrics[k][layer] is None else f"{metrics[k][layer]:.3f} ({baseline[k][layer]:.3f})"
                 for k in keys]
        print(f"| {layer} | " + " | ".join(cells) + " |")
    print(f"(in parentheses: an untrained model of the same config, seed 0; windows per source: "
          f"{ {s: labels.count(s) for s in dict.fromkeys(labels)} })")
    print()
    print(format_rows(rows))


if __name__ == "__main__":
    main()
