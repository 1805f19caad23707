"""The paper's Section 6.9 (Figure 6's latency spread, Table 8's latency and KL columns) from a `psr-hf sweep`
record of grown-qwen36-routing, beside the paper's numbers, as Markdown.

KL is the sweep's selfgen excess NLL: the mean of log p_exact - log p_policy over tokens sampled from the exact
model, an estimate of KL(exact || policy) per token. Ratios are paired over the interleaved rounds (t interval of
the per-round log ratios).

    python benchmarks/qwen36/section69_table.py benchmarks/sweep/grown-qwen36-routing.json
"""

from __future__ import annotations

import json
import sys

from psr_hf.eval.stats import paired_log_ratio

# Section 6.9 of the paper (Qwen3.6-35B-A3B in FP8): per residency the span of the cache-aware configurations,
# exact+LRU, and the speedup of PSR lam 0.2 over exact+LRU
PAPER_SPAN = {0.5: (22.0, 22.8, 23.7, 1.05), 0.375: (22.2, 23.5, 26.0, 1.12), 0.25: (22.7, 24.9, 30.0, 1.25)}
# Table 8 and the text at 25%: name -> (ms, copies per token, KL); None where the paper gives none
PAPER_25 = {"exact_lru": (30.0, 54, 0.0), "cp_lam0.2": (23.6, None, 0.051), "psr_lam0.2_n1": (24.1, None, 0.029),
            "psr_lam0.2_n1_w2": (23.5, None, 0.036), "cp_lam0.2_j2": (23.5, None, 0.047),
            "cp_lam0.3": (22.7, None, 0.119)}
LABELS = {"exact_lru": "exact+LRU", "cp_lam0.2": "Cache-Prior lam 0.2", "psr_lam0.2_n1": "PSR lam 0.2, n=1, window 4",
          "psr_lam0.2_n1_w2": "PSR lam 0.2, n=1, window 2", "cp_lam0.2_j2": "Cache-Prior J=2 lam 0.2",
          "cp_lam0.3": "Cache-Prior lam 0.3"}


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(path: str) -> None:
    record = json.loads(open(path).read())
    points = {p["name"]: p for p in record["points"]}
    rows = {suffix: {r["configuration"]: r for r in entry["rows"]} for suffix, entry in record["latency"].items()}
    print(f"{record['settings']['model']} on {record['machine']['device']}: {record['settings']['rounds']} "
          f"interleaved rounds of {record['settings']['windows']} windows x {record['settings']['tokens']} tokens; "
          f"KL over {len(record['selfgen']['ids'])} selfgen windows of {record['selfgen']['tokens']} tokens\n")
    print("| residency | engine, all resident | cache-aware span (fastest .. slowest) | exact+LRU | "
          "exact+LRU / PSR lam 0.2 [95% CI] | paper: span, exact+LRU, ratio |")
    print("|---|---|---|---|---|---|")
    for residency in record["settings"]["residencies"]:
        suffix = f"_res{round(residency * 100)}"
        here = [p for p in points.values() if p["residency"] == residency]
        aware = [p["ms"] for p in here if p["policy"] in ("cache_prior", "psr")]
        lru, psr = points[f"exact_lru{suffix}"], points[f"psr_lam0.2_n1{suffix}"]
        ratio = paired_log_ratio(lru["round_ms"], psr["round_ms"])
        resident = rows[suffix]["engine_resident"]["ms_per_token"]
        lo, hi, paper_lru, paper_ratio = PAPER_SPAN[residency]
        print(f"| {residency:.1%} | {resident['mean']:.2f} [{resident['ci95'][0]:.2f}, {resident['ci95'][1]:.2f}] | "
              f"{min(aware):.2f} .. {max(aware):.2f} | {lru['ms']:.2f} [{lru['ms_ci95'][0]:.2f}, "
              f"{lru['ms_ci95'][1]:.2f}] ({lru['copies_per_token']:.1f} copies) | {ratio.ratio:.2f} "
              f"[{ratio.low:.2f}, {ratio.high:.2f}] | {lo}-{hi}, {paper_lru}, {paper_ratio} |")
    print("\nAt 25% residency (C=64), Table 8's latency and KL columns:\n")
    print("| configuration | ms [95% CI] | copies/token | KL (selfgen excess NLL) [95% CI] | paper ms | paper copies "
          "| paper KL |")
    print("|---|---|---|---|---|---|---|")
    for name, (ms, copies, kl) in PAPER_25.items():
        p = points[f"{name}_res25"]
        ci = p["ms_ci95"]
        sg_low, sg_high = selfgen_interval(record, f"{name}_res25")
        print(f"| {LABELS[name]} | {p['ms']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] | {p['copies_per_token']:.1f} | "
              f"{p['selfgen_excess_nll']:.4f} [{sg_low:.4f}, {sg_high:.4f}] | {ms} | {fmt(copies, 0)} | "
              f"{fmt(kl, 3)} |")


def selfgen_interval(record: dict, name: str) -> tuple[float, float]:
    """The 95% interval of a row's selfgen excess NLL over the windows (the divergence stage's own)."""
    low, high = record["quality"][name]["selfgen"]["excess_nll_ci95"]
    return float(low), float(high)


if __name__ == "__main__":
    main(sys.argv[1])
