"""The divergence a prefetch distance costs (issue 53, Build 3): from a `psr-hf sweep --stage quality` record with
`--psr-distances 2`, each PSR row at distance 2 beside the same row at distance 1, on the same selfgen windows:
the selfgen excess NLL of each (sg% = 100 (exp(excess) - 1), 95% interval over windows), their paired difference
(distance D minus distance 1, a paired t-interval over windows), and the copies, demand copies, replaced experts
and displaced router mass per token of each. Prints a Markdown table.

    python benchmarks/engine/prefetch_distance_table.py benchmarks/sweep/cpu/prefetch_distance/grown-olmoe-routing_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import re

import numpy as np
from scipy import stats


def _interval(values: np.ndarray) -> tuple[float, float, float]:
    mean = float(values.mean())
    half = float(stats.t.ppf(0.975, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    return mean, mean - half, mean + half


def _pct(x: float) -> float:
    return 100 * math.expm1(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("record")
    args = ap.parse_args()
    quality = json.load(open(args.record))["quality"]
    print("| row | residency | sg% [95% CI] | distance D - distance 1, excess NLL [95% CI, paired] | copies/token "
          "(demand) | replaced/token | displaced mass |")
    print("|---|---|---|---|---|---|---|")
    printed = set()
    for name, entry in quality.items():
        far = entry["selfgen"]
        stem, _, residency = name.rpartition("_res")
        if re.search(r"_d\d+$", stem) is None:
            continue
        near_name = re.sub(r"_d\d+$", "", stem) + "_res" + residency
        near = quality[near_name]["selfgen"]
        diff = np.asarray(far["window_excess"]) - np.asarray(near["window_excess"])
        mean, lo, hi = _interval(diff)
        for row, sg in ((near_name, near), (name, far)):
            if row in printed:
                continue
            printed.add(row)
            lo_sg, hi_sg = (_pct(v) for v in sg["excess_nll_ci95"])
            paired = f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}]" if sg is far else ""
            print(f"| {row.rsplit('_res', 1)[0]} | {residency}% | {sg['excess_ppl_pct']:.2f} [{lo_sg:.2f}, {hi_sg:.2f}] | "
                  f"{paired} | {sg['copies_per_token']:.2f} ({sg['demand_per_token']:.2f}) | "
                  f"{sg['replaced_per_token']:.2f} | {sg['displaced_mass']:.4f} |")
    for name in ("exact_a_pf_res50", "cp_lam0.2_res50", "exact_a_pf_res25", "cp_lam0.2_res25"):
        if name in quality:
            sg = quality[name]["selfgen"]
            lo_sg, hi_sg = (_pct(v) for v in sg["excess_nll_ci95"])
            print(f"| {name.rsplit('_res', 1)[0]} | {name.rsplit('_res', 1)[1]}% | {sg['excess_ppl_pct']:.2f} "
                  f"[{lo_sg:.2f}, {hi_sg:.2f}] | | {sg['copies_per_token']:.2f} ({sg['demand_per_token']:.2f}) | "
                  f"{sg['replaced_per_token']:.2f} | {sg['displaced_mass']:.4f} |")


if __name__ == "__main__":
    main()
