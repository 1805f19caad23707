"""A `psr-hf bench` record judged again without the first timed positions of every window (issue 53).

In records made before the token graph decoder re-captured its graph at ``reset()``, the first device-decided step
after a ``Controller.reconfigure()`` re-captured the token graph inside the timed window (53-85 ms on the lent
H100), and the bench switches a shared decoder between rows with ``reconfigure()`` every round: most rows carried
that capture in their mean ms/token and host time. This drops the first ``--drop`` timed positions of every window
of every row alike (all rows, so the paired ratios stay paired), recomputes each row's per-round ms/token, and
prints the comparisons (and any ``--pair A B``) and goals as the bench judges them (host times are not in the record
per position, so their goals are left out). Prints a table; ``--json`` writes the recomputed rows, comparisons and
goals.

    python benchmarks/engine/bench_steady_state.py benchmarks/engine/h100/launch/call5_bench_engine.json.xz
"""

from __future__ import annotations

import argparse
import json
import lzma

import numpy as np

from psr_hf.bench.common import summarize
from psr_hf.bench.goals import compare_rows, comparisons, evaluate_goals
from psr_hf.bench.report import goal_line
from psr_hf.cli.console import write_json


def steady_rows(record: dict, drop: int) -> list[dict]:
    """The record's rows with the first ``drop`` timed positions of every window removed from every round."""
    rows = []
    for row in record["results"]:
        rounds = [{**r, "ms": [list(window[drop:]) for window in r["ms"]]} for r in row["rounds"]]
        if any(not window for r in rounds for window in r["ms"]):
            raise ValueError(f"--drop {drop} leaves a window of {row['configuration']} empty")
        means = [float(np.mean([t for window in r["ms"] for t in window])) for r in rounds]
        for r, mean in zip(rounds, means):
            r["ms_per_token"] = mean
        rows.append({**row, "rounds": rounds, "ms_per_token": summarize(means), "host_us_per_token": None,
                     "host_us_per_moe_layer": None})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("record", help="a psr-hf bench JSON record (.json or .json.xz)")
    ap.add_argument("--drop", type=int, default=1, help="timed positions dropped at the start of every window")
    ap.add_argument("--pair", nargs=2, action="append", default=[], metavar=("NUMERATOR", "DENOMINATOR"),
                    help="one more paired ratio of two rows (repeatable)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    opener = lzma.open if args.record.endswith(".xz") else open
    with opener(args.record, "rt") as f:
        record = json.load(f)
    rows = steady_rows(record, args.drop)
    device = record["machine"].get("device") or ""
    copy = (record["settings"].get("expert_copy") or {}).get("ms_median")
    goals = [g for g in evaluate_goals(rows, cuda=record["machine"].get("device_type") == "cuda", device=device,
                                       expert_copy_ms=copy) if "host time" not in g["goal"]]
    pairs = comparisons(rows) + [compare_rows(rows, a, b) for a, b in args.pair]
    original = {row["configuration"]: row["ms_per_token"]["mean"] for row in record["results"]}
    print(f"{args.record}: the first {args.drop} timed position(s) of every window dropped ({device})")
    print(f"{'row':<40} {'ms/token, all':>14} {'without':>9}  [95% CI]")
    for row in rows:
        s = row["ms_per_token"]
        print(f"{row['configuration']:<40} {original[row['configuration']]:>14.3f} {s['mean']:>9.3f}  "
              f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]")
    for c in pairs:
        if c is not None and c.get("ratio") is not None:
            print(f"{c['numerator']} / {c['denominator']}: {c['ratio']:.2f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]")
    for g in goals:
        print(goal_line(g, device))
    out = {"record": args.record, "drop": args.drop, "results": rows, "comparisons": pairs, "goals": goals}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
