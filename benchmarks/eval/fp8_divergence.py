"""What FP8 weights add to exact routing's divergence, beside what cache-aware routing adds (issue 49, item 4).

The model (default the shipped ``olmoe-routing``, in float32 on the CPU: its bf16 weights upcast) is written as a
block-wise FP8 checkpoint (``psr_hf.assets.quantize.quantize_checkpoint``, what ``psr-hf quantize`` runs) and
loaded back dequantized (``load_fp8_dequantized``), so both models compute in float32 and differ only by their
weights' rounding to e4m3 with one scale per 128x128 block. On the windows of a sweep's quality record (its selfgen
windows, sampled from the bf16 model's exact routing, and its held-out windows), for each window:

- FP8-exact against bf16-exact: the mean per-token NLL difference (on selfgen text an estimate of the KL
  divergence FP8 adds), with a 95% t-interval over windows and its excess perplexity (``sg%``);
- each routing row on both models (``psr_hf.eval.divergence.divergence``, the shipped calibration): its excess over
  its own model's exact routing, and the FP8 row's excess over bf16-exact (the two added per window).

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
from psr_hf.eval.divergence import _token_nll, divergence, excess_ppl_percent
from psr_hf.eval.grid import routing_from_name
from psr_hf.eval.stats import mean_interval


def _excess(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    """Mean over windows of the per-token NLL difference ``a - b``, its 95% interval and sg%."""
    per_window = np.array([float((x - y).mean()) for x, y in zip(a, b)])
    interval = mean_interval(per_window)
    mean = float(per_window.mean())
    return {"excess_nll": mean, "excess_nll_ci95": [interval.low, interval.high],
            "excess_ppl_pct": excess_ppl_percent(mean),
            "excess_ppl_pct_ci95": [excess_ppl_percent(interval.low), excess_ppl_percent(interval.high)],
            "window_excess": per_window.tolist()}


def _nlls(model: torch.nn.Module, windows: list[torch.Tensor]) -> list[np.ndarray]:
    model.eval()
    return [_token_nll(model, w) for w in windows]


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
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    record = json.loads(Path(args.record).read_text())
    texts = {"selfgen": record["selfgen"]["ids"], "heldout": record["heldout"]["ids"]}
    windows = {k: [torch.tensor([ids]) for ids in v[:args.windows]] for k, v in texts.items()}
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
    out = {"benchmark": "fp8_divergence", "model": args.model, "record": args.record,
           "calibration": info.get("calibration"), "quantized": str(report),
           "windows": {k: len(v) for k, v in windows.items()},
           "tokens_per_window": {k: int(v[0].shape[1]) for k, v in windows.items()}, "texts": {}}
    for text, ws in windows.items():
        exact_bf16, exact_fp8 = _nlls(bf16, ws), _nlls(fp8, ws)
        rows_bf16 = _rows(bf16, ws, configs, calibration)
        rows_fp8 = _rows(fp8, ws, configs, calibration)
        gap = np.array([float((a - b).mean()) for a, b in zip(exact_fp8, exact_bf16)])
        fp8_vs_bf16 = {}
        for name, row in rows_fp8.items():  # the FP8 row's excess over bf16-exact: its own excess plus FP8's
            per_window = np.asarray(row["window_excess"]) + gap
            interval = mean_interval(per_window)
            fp8_vs_bf16[name] = {"excess_nll": float(per_window.mean()),
                                 "excess_nll_ci95": [interval.low, interval.high],
                                 "excess_ppl_pct": excess_ppl_percent(float(per_window.mean()))}
        out["texts"][text] = {"fp8_exact_vs_bf16_exact": _excess(exact_fp8, exact_bf16),
                              "rows_bf16": rows_bf16, "rows_fp8": rows_fp8, "rows_fp8_vs_bf16_exact": fp8_vs_bf16}
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
        print(f"   {'row':<24} {'bf16 vs bf16-exact':>24} {'FP8 vs FP8-exact':>24} {'FP8 vs bf16-exact':>24} "
              f"{'copies/token bf16 / FP8':>24}")
        for name, row in t["rows_bf16"].items():
            f8, both = t["rows_fp8"][name], t["rows_fp8_vs_bf16_exact"][name]
            cells = [f"{r['excess_ppl_pct']:6.2f}% ({r['excess_nll']:+.4f})" for r in (row, f8, both)]
            print(f"   {name:<24} {cells[0]:>24} {cells[1]:>24} {cells[2]:>24} "
                  f"{row['copies_per_token']:>11.2f} / {f8['copies_per_token']:<10.2f}")
    print(f"wall {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
