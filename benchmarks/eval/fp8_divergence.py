"""What FP8 weights add to exact routing's divergence, beside what cache-aware routing adds (issue 49, item 4).

The model (default the shipped ``olmoe-routing``, in float32 on the CPU: its bf16 weights upcast) is written as a
block-wise FP8 checkpoint (``psr_hf.assets.quantize.quantize_checkpoint``, what ``psr-hf quantize`` runs) and
loaded back dequantized (``load_fp8_dequantized``), so both models compute in float32 and differ only by their
weights' rounding to e4m3 with one scale per 128x128 block. On the windows of a sweep's quality record (its selfgen
windows, sampled from the bf16 model's exact routing, and its held-out windows), for each window:

- FP8-exact against bf16-exact: the mean per-token NLL difference (on selfgen text an estimate of the KL
  divergence FP8 adds), with a 95% t-interval over windows and its excess perplexity (``sg%``);
- each routing row on both models (``psr_hf.eval.divergence.divergence``, the shipped calibration): its excess over
  its own model's exact routing, the FP8 row's excess over bf16-exact (the two added per window), and how much
  routing's own excess changes in FP8 (FP8 row's minus bf16 row's, paired by window).

With ``--fp8-selfgen`` (the default) the selfgen windows are also sampled from FP8-exact, with the record's prompts
and seeds (``selfgen_fp8``): on that text an FP8 row's excess over FP8-exact estimates its KL divergence in the FP8
regime, where exact routing is the FP8 checkpoint's own (the paper's Section 6.9 setting), and FP8-exact -
bf16-exact estimates minus the KL divergence of bf16-exact from FP8-exact (bf16-exact did not write the text).
Prints a table and writes a JSON record with every window's numbers.

    python benchmarks/eval/fp8_divergence.py --record benchmarks/sweep/cpu/prefetch_distance/grown-olmoe-routing_quality.json \
        --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from psr_hf import RoutingConfig
from psr_hf.assets import resolve_model
from psr_hf.assets.loading import load_model
from psr_hf.assets.quantize import load_fp8_dequantized, quantize_checkpoint
from psr_hf.cli.console import write_json
from psr_hf.eval.divergence import token_nll, divergence, excess_ppl_percent
from psr_hf.eval.grid import routing_from_name
from psr_hf.eval.selfgen import sample_windows
from psr_hf.eval.stats import mean_interval


def _excess(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    """Mean over windows of the per-token NLL difference ``a - b``, its 95% interval, sg% and the windows'."""
    per_window = np.array([float((x - y).mean()) for x, y in zip(a, b)])
    out = _mean(per_window)
    low, high = out["excess_nll_ci95"]
    return {**out, "excess_ppl_pct_ci95": [excess_ppl_percent(low), excess_ppl_percent(high)],
            "window_excess": per_window.tolist()}


def _mean(per_window: np.ndarray) -> dict:
    """A per-window excess NLL's mean, 95% interval over windows and excess perplexity."""
    interval = mean_interval(per_window)
    mean = float(per_window.mean())
    return {"excess_nll": mean, "excess_nll_ci95": [interval.low, interval.high],
            "excess_ppl_pct": excess_ppl_percent(mean)}


def _nlls(model: torch.nn.Module, windows: list[torch.Tensor]) -> list[np.ndarray]:
    model.eval()
    return [token_nll(model, w) for w in windows]


def _rows(model: torch.nn.Module, windows: list[torch.Tensor], configs: dict[str, RoutingConfig],
          calibration: str | None) -> dict[str, dict]:
    return {row.name: row.to_dict() for row in divergence(model, windows, configs, calibration=calibration)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="olmoe-routing", help="a model psr_hf loads on the CPU (float32)")
    ap.add_argument("--record", required=True, help="a sweep's quality record: its selfgen and held-out windows")
    ap.add_argument("--configs", default="cp_lam0.2,psr_lam0.2_n1,psr_lam0.3_n1,psr_lam0.3_n2",
                    help="routing rows by their grid names (comma-separated)")
    ap.add_argument("--residencies", default="0.5,0.25")
    ap.add_argument("--windows", type=int, default=None, help="the first N windows of each text (default all)")
    ap.add_argument("--fp8-selfgen", action=argparse.BooleanOptionalAction, default=True,
                    help="also sample the selfgen windows from FP8-exact (the record's prompts and seeds) and score "
                         "every row on them: the FP8 regime's own diagnostic (default on)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    record = json.loads(Path(args.record).read_text())
    texts = {"selfgen": record["selfgen"]["ids"], "heldout": record["heldout"]["ids"]}
    windows = {k: [torch.tensor([ids]) for ids in v[:args.windows]] for k, v in texts.items()}
    drawn = record["selfgen"]
    configs = {}
    for name in args.configs.split(","):
        fields = routing_from_name(name.strip())
        if fields is None:
            raise ValueError(f"--configs: {name!r} is not a routing row's name (psr_hf.eval.grid names them)")
        for residency in (float(r) for r in args.residencies.split(",")):
            configs[f"{name.strip()}_res{round(100 * residency):g}"] = RoutingConfig(**fields, residency=residency)
    start = time.perf_counter()
    bf16, _, info = load_model(args.model, "cpu")
    calibration = info.get("calibration_file")
    source = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as folder:
        report = quantize_checkpoint(str(source.directory), f"{folder}/fp8")
        fp8 = load_fp8_dequantized(f"{folder}/fp8", torch.float32)
    if args.fp8_selfgen:  # the FP8 regime's own diagnostic text: the same prompts and seeds, sampled from FP8-exact
        prompts = [w[0, :n] for w, n in zip(windows["selfgen"], drawn["prompt_tokens"])]
        windows["selfgen_fp8"] = sample_windows(fp8, prompts, tokens=int(drawn["tokens"]), seed=int(drawn["seed"]))
    out = {"benchmark": "fp8_divergence", "model": args.model, "record": args.record,
           "calibration": info.get("calibration"), "quantized": {"weights": report.quantized, "kept": dict(report.kept),
                         "bytes_before": report.bytes_before, "bytes_after": report.bytes_after},
           "windows": {k: len(v) for k, v in windows.items()},
           "tokens_per_window": {k: int(v[0].shape[1]) for k, v in windows.items()}, "texts": {}}
    if args.fp8_selfgen:
        out["selfgen_fp8"] = {"seed": int(drawn["seed"]), "tokens": int(drawn["tokens"]),
                              "ids": [w.reshape(-1).tolist() for w in windows["selfgen_fp8"]]}
    for text, ws in windows.items():
        exact_bf16, exact_fp8 = _nlls(bf16, ws), _nlls(fp8, ws)
        rows_bf16 = _rows(bf16, ws, configs, calibration)
        rows_fp8 = _rows(fp8, ws, configs, calibration)
        gap = np.array([float((a - b).mean()) for a, b in zip(exact_fp8, exact_bf16)])
        fp8_vs_bf16, change = {}, {}
        for name, row in rows_fp8.items():
            own = np.asarray(row["window_excess"])
            fp8_vs_bf16[name] = _mean(own + gap)  # the FP8 row's excess over bf16-exact: its own plus FP8's
            change[name] = _mean(own - np.asarray(rows_bf16[name]["window_excess"]))  # routing's own, FP8 - bf16
        out["texts"][text] = {"fp8_exact_vs_bf16_exact": _excess(exact_fp8, exact_bf16),
                              "rows_bf16": rows_bf16, "rows_fp8": rows_fp8, "rows_fp8_vs_bf16_exact": fp8_vs_bf16,
                              "routing_excess_fp8_minus_bf16": change}
    out["wall_s"] = time.perf_counter() - start
    _print(out)
    if args.json:
        write_json(args.json, out)
    return out


def _print(out: dict) -> None:
    for text, t in out["texts"].items():
        e = t["fp8_exact_vs_bf16_exact"]
        lo, hi = e["excess_nll_ci95"]
        print(f"== {text} ({out['windows'][text]} windows of {out['tokens_per_window'][text]} tokens): FP8-exact - "
              f"bf16-exact {e['excess_nll']:+.4f} nats/token [{lo:+.4f}, {hi:+.4f}], {e['excess_ppl_pct']:.2f}%")
        print(f"   {'row':<24} {'bf16 vs bf16-exact':>22} {'FP8 vs FP8-exact':>22} {'FP8 vs bf16-exact':>22} "
              f"{'routing FP8 - bf16 [95% CI]':>30} {'copies/token bf16 / FP8':>24}")
        for name, row in t["rows_bf16"].items():
            f8, both, change = (t["rows_fp8"][name], t["rows_fp8_vs_bf16_exact"][name],
                                t["routing_excess_fp8_minus_bf16"][name])
            cells = [f"{r['excess_ppl_pct']:6.2f}% ({r['excess_nll']:+.4f})" for r in (row, f8, both)]
            lo, hi = change["excess_nll_ci95"]
            print(f"   {name:<24} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22} "
                  f"{change['excess_nll']:+.4f} [{lo:+.4f}, {hi:+.4f}]".ljust(30)
                  + f" {row['copies_per_token']:>11.2f} / {f8['copies_per_token']:<10.2f}")
    print(f"wall {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
