"""Calibrate a trained small MoE of ``train.py`` and measure what its model card reports (CPU is enough).

    python examples/train_tiny_moe/model_card.py --model RUN_DIR/model --shards SHARDS_DIR --out CARD_DIR \
        [--windows 16] [--tokens 512] [--calibration-tokens 500000]

Any family psr_hf patches works (tiny-moe and olmoe-routing: OLMoE; moonlight-routing: DeepSeek-V3): the number of
experts E and the top-K come from the model, and the tables count MoE layers only (``MoE layer (decoder layer)``;
DeepSeek-V3's first decoder layer is dense, so its MoE layer 0 is decoder layer 1).

0. **Held-out loss** of the model, per source, over the whole held-out split.
1. **Calibration** on the calib split only (``psr_hf.calibrate``: delta, warm set, token prior), saved as
   ``CARD_DIR/calibration.safetensors``.
2. **Did the router specialise?** On held-out windows (spread evenly over the split, so over every source), with exact routing (the router's own top-K), recorded by
   the controller: per MoE layer the entropy of expert usage against the uniform ``ln E``; the reuse of the top-K
   between consecutive tokens (mean ``|S_t & S_t-1| / K``; a random router gives about K/E); and the accuracy of
   the next MoE layer's router applied one layer early (the pre-gate: mean ``|topK(g) & topK(z)| / K``; none for
   the first MoE layer).
3. **Distance from exact routing and copies** of exact+LRU, and of cache_prior and psr (budget 1) for lam in
   {0.1, 0.2, 0.3} at 50% and 25% residency: ``psr_hf.eval.divergence`` on the same held-out windows.

Writes ``CARD_DIR/card.json`` and prints the tables (Markdown) for the model card.
"""

from __future__ import annotations

import argparse
import json
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
def heldout_loss_by_source(model, tokens: np.ndarray, by_source: dict, length: int = 512,
                           max_tokens: int | None = None) -> dict:
    """Next-token loss (nats) of the unpatched model over the whole split, per source and overall, in
    non-overlapping windows of ``length`` (``by_source`` is meta.json's record, in the split's order);
    ``max_tokens``: only the first windows of each source, at most that many tokens (a quick check)."""
    out, offset, total_nll, total_n = {}, 0, 0.0, 0
    for source, record in by_source.items():
        part = tokens[offset : offset + record["tokens"]]
        offset += record["tokens"]
        nll, n = 0.0, 0
        rows = part[: part.size // length * length].reshape(-1, length).astype(np.int64)
        if max_tokens is not None:
            rows = rows[: max(max_tokens // length, 1)]
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


def plot(card: dict, train_log: dict | None, out: Path) -> None:
    """The card's figure: training and calib loss per step (with ``train_log``), and excess NLL against demand
    copies per token of cache_prior and psr over lam at each residency, exact+LRU at zero excess."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = card["divergence"]
    for r in rows:
        r.update(r["routing"])  # policy, residency, lam
    residencies = sorted({r["residency"] for r in rows}, reverse=True)
    panels = len(residencies) + (train_log is not None)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.8))
    axes = list(np.atleast_1d(axes))
    if train_log is not None:
        ax = axes.pop(0)
        log = train_log["log"]
        ax.plot([e["step"] for e in log], [e["loss"] for e in log], label="train (batch)", lw=1)
        evals = [e for e in log if "calib_loss" in e]
        ax.plot([e["step"] for e in evals], [e["calib_loss"] for e in evals], "o-", label="calib (train.py: first 131k tokens, bf16)")
        ax.axhline(card["heldout_loss"]["all"]["loss"], color="k", ls=":", label="held-out, all sources (fp32)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_ylim(bottom=min(e["loss"] for e in log) - 0.2, top=6)
        ax.set_title(f"training: {train_log['tokens_seen'] / 1e6:.0f} M tokens")
        ax.legend(fontsize=8)
    for ax, residency in zip(axes, residencies):
        here = [r for r in rows if r["residency"] == residency]
        for policy, marker in (("cache_prior", "s-"), ("psr", "o-")):
            pts = sorted((r for r in here if r["policy"] == policy), key=lambda r: r["lam"])
            x = [r["demand_per_token"] for r in pts]
            ax.errorbar(x, [r["excess_nll"] for r in pts],
                        yerr=[[r["excess_nll"] - r["excess_nll_ci95"][0] for r in pts],
                              [r["excess_nll_ci95"][1] - r["excess_nll"] for r in pts]],
                        fmt=marker, capsize=3, label=policy if policy == "cache_prior" else "psr (budget 1)")
            for r in pts:
                ax.annotate(f"{r['lam']:g}", (r["demand_per_token"], r["excess_nll"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
        exact = next(r for r in here if r["policy"] == "exact")
        ax.plot([exact["demand_per_token"]], [0], "k^", label="exact + LRU")
        ax.set_xscale("log")
        ax.set_xlabel("demand copies per token (log)")
        ax.set_ylabel("excess NLL over exact (nats/token)")
        ax.set_title(f"{residency:.0%} residency (labels: lam)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


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
    p.add_argument("--plot-only", action="store_true", help="redraw CARD_DIR/card.png from CARD_DIR/card.json")
    p.add_argument("--train-log", type=Path, help="train.py's train_log.json: adds the loss curve to the figure")
    p.add_argument("--loss-tokens", type=int, help="score the held-out loss on at most this many tokens of each "
                                                   "source (default: the whole split; for quick checks)")
    args = p.parse_args()
    if args.plot_only:
        plot(json.loads((args.out / "card.json").read_text()),
             json.loads(args.train_log.read_text()) if args.train_log else None, args.out / "card.png")
        return
    import psr_hf
    from psr_hf.eval.divergence import divergence, format_rows, paired_difference, sweep_configs
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
    losses = heldout_loss_by_source(model, heldout, meta["splits"]["heldout"]["by_source"],
                                    max_tokens=args.loss_tokens)
    # the routed MoE layers' decoder indices (a dense layer's MLP has no router): psr_hf's layers are these
    moe_layers = [i for i, layer in enumerate(model.model.layers)
                  if hasattr(getattr(getattr(layer, "mlp", None), "gate", None), "top_k")]
    windows = windows_from(heldout, args.windows, args.tokens)
    labels = source_at(window_starts(heldout, args.windows, args.tokens), meta["splits"]["heldout"]["by_source"])
    metrics = router_stats(recordings(model, windows, calibration), labels).to_dict()
    if len(metrics["usage_entropy"]) != len(moe_layers):
        raise SystemExit(f"psr_hf recorded {len(metrics['usage_entropy'])} MoE layers, the model has {moe_layers}")
    # the same measurements on an untrained model of the same config (seeded): what a router that never learned
    # anything gives on the same windows
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    baseline = router_stats(recordings(untrained, windows), labels).to_dict()
    del untrained
    rows = divergence(model, windows, sweep_configs(), calibration=calibration)
    # the paper's ordering, pair by pair: psr minus cache_prior at the same lam and residency, paired by window
    ordering = []
    for r in rows:
        if r.routing["policy"] != "psr":
            continue
        cp = next(c for c in rows if c.routing["policy"] == "cache_prior" and c.capacity == r.capacity
                  and c.routing["lam"] == r.routing["lam"])
        diff, ci = paired_difference(r, cp)
        ordering.append({"residency": r.routing["residency"], "lam": r.routing["lam"], "psr": r.name,
                         "cache_prior": cp.name, "excess_nll_difference": diff, "ci95": ci,
                         "demand_psr": r.demand_per_token, "demand_cache_prior": cp.demand_per_token})
    card = {"model": str(args.model), "model_type": model.config.model_type, "moe_decoder_layers": moe_layers,
            "num_experts": metrics["num_experts"], "top_k": metrics["top_k"],
            "heldout_windows": args.windows, "tokens_per_window": args.tokens,
            "window_sources": labels, "heldout_loss": losses, "routing": metrics, "routing_untrained": baseline,
            "divergence": [r.to_dict() for r in rows], "ordering": ordering}
    (args.out / "card.json").write_text(json.dumps(card, indent=2))
    print("| held-out source | tokens | loss (nats/token) |\n|---|---|---|")
    for source, r in losses.items():
        print(f"| {source} | {r['tokens']:,} | {r['loss']:.3f} |")
    print()
    K, E = metrics["top_k"], metrics["num_experts"]
    print(f"{model.config.model_type}: {len(moe_layers)} MoE layers of {len(model.model.layers)}, {E} experts, "
          f"top-{K}")
    print(f"| MoE layer (decoder layer) | usage entropy (uniform ln {E} = {metrics['uniform_entropy']:.3f}) | "
          f"top-{K} reuse (random {K}/{E} = {metrics['random_reuse']:.3f}) | pre-gate accuracy | "
          f"I(expert; source) |")
    print("|---|---|---|---|---|")
    keys = ("usage_entropy", "top_k_reuse", "pregate_accuracy", "source_information")
    for layer in range(len(metrics["usage_entropy"])):
        cells = ["-" if metrics[k][layer] is None else f"{metrics[k][layer]:.3f} ({baseline[k][layer]:.3f})"
                 for k in keys]
        print(f"| {layer} ({moe_layers[layer]}) | " + " | ".join(cells) + " |")
    print(f"(in parentheses: an untrained model of the same config, seed 0; windows per source: "
          f"{ {s: labels.count(s) for s in dict.fromkeys(labels)} })")
    print()
    print(format_rows(rows))
    print("\n| residency | lam | excess NLL psr - cache_prior [95% CI, paired by window] | demand psr / cache_prior |")
    print("|---|---|---|---|")
    for o in ordering:
        print(f"| {o['residency']:.0%} | {o['lam']} | {o['excess_nll_difference']:+.4f} [{o['ci95'][0]:+.4f}, "
              f"{o['ci95'][1]:+.4f}] | {o['demand_psr']:.2f} / {o['demand_cache_prior']:.2f} |")
    train_log = json.loads(args.train_log.read_text()) if args.train_log else None
    plot(card, train_log, args.out / "card.png")
    print(f"figure: {args.out / 'card.png'}")


if __name__ == "__main__":
    main()
