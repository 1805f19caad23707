"""The ``psr-hf`` command. The library logs; this module prints."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- demo
DEMO_CONFIGS = [
    ("exact + LRU", dict(policy="exact")),
    ("cache_prior lam 0.2", dict(policy="cache_prior", lam=0.2)),
    ("psr lam 0.2 n=1", dict(policy="psr", lam=0.2, budget=1)),
    ("psr lam 0.3 n=1", dict(policy="psr", lam=0.3, budget=1)),
    ("spec", dict(policy="spec")),
]


def cmd_demo(args: argparse.Namespace) -> int:
    from .policy import RoutingConfig, replay
    from .policy.traces import calibration_from_trace, synthetic_trace

    L, E, K, V = 16, 64, 8, 2048  # OLMoE-1B-7B's routing shape
    print("psr-hf demo: the logical expert cache on a synthetic OLMoE-shaped routing trace")
    print(f"({L} MoE layers x {E} experts, top-{K}; calibration on one trace, replay on another of "
          f"{args.tokens} tokens).")
    print("Model-based generation replaces this trace once the transformers patches land.\n")
    calibration = calibration_from_trace(synthetic_trace(20000, L, E, vocab_size=V, seed=1), K, V)
    trace = synthetic_trace(args.tokens, L, E, vocab_size=V, seed=2)
    rows = []
    for residency in (0.5, 0.25):
        for name, kw in DEMO_CONFIGS:
            config = RoutingConfig(residency=residency, **kw)
            result = replay(config, trace.scores, trace.pregate, trace.tokens, calibration, K)
            c = result.copies_per_token()
            C = config.capacity_for(E, K)
            rows.append([name, f"{residency:.0%} (C={C})", f"{c['demand']:.2f}", f"{c['prefetch']:.2f}",
                         f"{c['total']:.2f}", f"{c['replaced']:.2f}"])
    print(_table(rows, ["policy", "residency", "demand/tok", "prefetch/tok", "copies/tok", "replaced/tok"]))
    print("\ndemand copies stall the layer; prefetch copies are issued one layer early and overlap computation;")
    print("replaced = selected experts outside the router's own top-K (summed over layers).")
    return 0


# ---------------------------------------------------------------------------------------------------- bench-policy
def cmd_bench_policy(args: argparse.Namespace) -> int:
    from .policy.bench import bench_policy

    print(f"psr-hf bench-policy: {args.rounds} interleaved rounds (median over rounds, 95% t-interval of the mean)")
    record = bench_policy(rounds=args.rounds, calls=args.calls, tokens=args.tokens, layers=args.layers,
                          progress=lambda msg: print("  " + msg, file=sys.stderr))
    rows = []
    for r in record["results"]:
        lo, hi = r["ci95"]
        if r["unit"] == "steps/s":
            rows.append([r["case"], f"{r['median'] / 1e6:.3f} M", f"[{lo / 1e6:.3f}, {hi / 1e6:.3f}] M", r["unit"]])
        else:
            rows.append([r["case"], f"{r['median']:.2f}", f"[{lo:.2f}, {hi:.2f}]", r["unit"]])
    print(_table(rows, ["case", "median", "95% CI of mean", "unit"]))
    m = record["machine"]
    print(f"\nmachine: {m['processor']}, {m['cpu_count']} CPUs, python {m['python']}, numba {m['numba']}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
        print(f"JSON record: {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="psr-hf", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="the logical cache under each policy: copies per token")
    p.add_argument("--tokens", type=int, default=2000, help="tokens of the replayed trace (default 2000)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench-policy", help="per-call cost of the policy kernel and replay throughput")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3000, help="batch-1 calls per round and case")
    p.add_argument("--tokens", type=int, default=4000, help="tokens of the replayed trace")
    p.add_argument("--layers", type=int, default=16, help="MoE layers of the replayed trace")
    p.add_argument("--json", help="write the JSON record here")
    p.set_defaults(func=cmd_bench_policy)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"psr-hf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
