"""The divergence side of a `psr-hf sweep` record (its stage `quality`, before any timing), as Markdown: per
residency and lam, sg% (selfgen excess perplexity) of Cache-Prior (LRU, as in the paper's main comparison) and of
PSR n=1 (A priority), and their paired difference of excess NLL over the selfgen windows with its 95% interval,
beside the demand copies per token of each; plus the prefetch budget n at lam 0.2.

    python benchmarks/sweep/divergence_table.py benchmarks/sweep/grown-olmoe-routing.json.xz   (or a .json)
"""

from __future__ import annotations

import json
import lzma
import sys

import numpy as np

from psr_hf.eval.divergence import excess_ppl_percent as sg_percent
from psr_hf.eval.stats import mean_interval


def main(path: str) -> None:
    record = json.loads(lzma.open(path).read() if path.endswith(".xz") else open(path).read())
    quality = record["quality"]
    print(f"{record['settings']['model']}: {len(record['selfgen']['ids'])} selfgen windows x "
          f"{record['selfgen']['tokens']} sampled tokens, {len(record['heldout']['ids'])} held-out windows\n")
    print("| residency | lam | Cache-Prior sg% | PSR n=1 sg% | excess NLL PSR - CP [95% CI] | demand copies CP / PSR |")
    print("|---|---|---|---|---|---|")
    for residency in record["settings"]["residencies"]:
        suffix = f"_res{round(residency * 100)}"
        for name in record["grid"]:
            if not name.startswith("cp_lam") or not name[len("cp_lam"):].replace(".", "").isdigit():
                continue
            lam = name[len("cp_lam"):]
            cp, psr = quality.get(name + suffix), quality.get(f"psr_lam{lam}_n1{suffix}")
            if cp is None or psr is None:
                continue
            diff = np.asarray(psr["selfgen"]["window_excess"]) - np.asarray(cp["selfgen"]["window_excess"])
            ci = mean_interval(diff)
            print(f"| {100 * residency:g}% | {lam} | {sg_percent(cp['selfgen']['excess_nll']):.1f} | "
                  f"{sg_percent(psr['selfgen']['excess_nll']):.1f} | {ci.mean:+.4f} [{ci.low:+.4f}, {ci.high:+.4f}] | "
                  f"{cp['selfgen']['demand_per_token']:.1f} / {psr['selfgen']['demand_per_token']:.1f} |")
    print("\n| residency | PSR at lam 0.2 | sg% | copies (demand) per token |")
    print("|---|---|---|---|")
    for residency in record["settings"]["residencies"]:
        suffix = f"_res{round(residency * 100)}"
        for n in (1, 2, 8):
            q = quality.get(f"psr_lam0.2_n{n}{suffix}")
            if q is not None:
                s = q["selfgen"]
                print(f"| {100 * residency:g}% | n={n} | {sg_percent(s['excess_nll']):.1f} | "
                      f"{s['copies_per_token']:.1f} ({s['demand_per_token']:.1f}) |")


if __name__ == "__main__":
    main(sys.argv[1])
