"""lm-eval from the command line (docs/lm-eval.md): ``psr-hf compare`` (paired comparison of ``--log_samples``
runs; with ``--implementations``, engine runs against harness runs: docs/engine-vs-harness.md) and ``psr-hf eval``
(lm-eval itself, with ``--model psr_hf`` registered)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._text import text_table
from .console import write_json
from .options import add_json, add_seed


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("compare", help="paired comparison of lm-eval --log_samples runs with a reference: "
                                              "points, McNemar, Holm (the paper's Tables 3-4); --implementations: "
                                              "engine runs against harness runs (Table 5)")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="lm-eval --output_path directories (or LABEL=PATH); the first is the reference; with "
                        "--implementations, one harness and one engine run per configuration, both labelled with "
                        "the configuration (without a label: its routing grid name from the model args)")
    p.add_argument("--implementations", action="store_true",
                   help="engine against harness (the paper's Table 5): per pair of configurations, the difference "
                        "in the engine minus that in the harness, sign-flip tests, Holm; and per configuration the "
                        "outcomes on which the two implementations differ. Engine runs have model arg engine=true")
    p.add_argument("--baselines", metavar="CONFIG[,CONFIG...]",
                   help="with --implementations: every configuration against each of these in turn, leaving out "
                        "earlier baselines (default: the first configuration)")
    p.add_argument("--pair", action="append", default=[], metavar="CONFIG:BASELINE",
                   help="with --implementations: test CONFIG against BASELINE (repeat; instead of --baselines)")
    p.add_argument("--metric", action="append", default=[], metavar="TASK=METRIC[,FILTER]",
                   help="metric (and filter) of a task instead of the default; repeat for several (columns)")
    p.add_argument("--tasks", help="comma-separated tasks to compare (default: every task of the reference)")
    add_json(p)
    p.add_argument("--alpha", type=float, default=0.05, help="level of Holm's correction and of the dagger (0.05)")
    p.add_argument("--permutations", type=int, default=None,
                   help="sign-flip tests (IFEval instruction level; every test with --implementations): exact when "
                        "2^k <= N, else N Monte Carlo draws (default 100000; 10000 with --implementations)")
    add_seed(p, "the Monte Carlo sign flips")
    p.set_defaults(func=compare)

    p = subparsers.add_parser("eval", add_help=False, help="lm-eval with --model psr_hf registered; every argument "
                                                           "after `eval` goes to lm-eval as it is (psr-hf eval "
                                                           "--help: lm-eval's)")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments, passed on as they are")
    p.set_defaults(func=run_lm_eval)


def _metrics(specs: list[str]) -> dict[str, list[str]]:
    metrics: dict[str, list[str]] = {}
    for spec in specs:
        task, sep, metric = spec.partition("=")
        if not (sep and task and metric):
            raise ValueError(f"--metric {spec}: expected TASK=METRIC or TASK=METRIC,FILTER")
        metrics.setdefault(task, []).append(metric)
    return metrics


def compare(args: argparse.Namespace) -> int:
    from ..eval.compare import compare_runs, load_run, parse_run_argument

    if args.implementations:
        return compare_implementations(args)
    if args.baselines or args.pair:
        raise ValueError("--baselines and --pair pair configurations of --implementations; add --implementations")
    if len(args.runs) < 2:
        raise ValueError("give a reference run and at least one run to compare with it")
    metrics = _metrics(args.metric)
    runs = [load_run(path, label) for label, path in map(parse_run_argument, args.runs)]
    tasks = [t for t in args.tasks.split(",") if t] if args.tasks else None
    comparison = compare_runs(runs[0], runs[1:], metrics=metrics, tasks=tasks, alpha=args.alpha,
                              permutations=100_000 if args.permutations is None else args.permutations,
                              seed=args.seed)
    print(comparison.to_markdown())
    units = {c.name: c.unit for c in comparison.columns}
    rows = []
    for cell in comparison.cells:
        ref_side = cell.counts.get("reference_only", cell.counts.get("reference_better", 0))
        run_side = cell.counts.get("run_only", cell.counts.get("run_better", 0))
        digits = 2 if units[cell.column] == "points" else 4
        rows.append([cell.run, cell.column, cell.n, f"{cell.difference:+.{digits}f}", f"{cell.se:.{digits}f}",
                     f"{ref_side}/{run_side}", cell.test, f"{cell.p:.3g}", f"{cell.p_holm:.3g}"])
    print(text_table(rows, ["run", "column", "n", "difference", "SE", "discordant ref/run", "test", "p", "p Holm"]))
    print("\ndiscordant: questions only the reference / only the run got right (clustered and other metrics: units "
          "where the reference / the run scored higher); n: paired units (IFE-I: prompts).")
    if args.json:
        write_json(args.json, comparison.to_dict(), ensure_ascii=False)
    return 0


def compare_implementations(args: argparse.Namespace) -> int:
    """``psr-hf compare --implementations RUN...``: the engine's runs against the harness's (the paper's Table 5)."""
    from ..eval.compare import parse_run_argument
    from ..eval.implementations import compare_implementations as compare_engine_with_harness
    from ..eval.implementations import load_implementation_run

    if len(args.runs) < 2:
        raise ValueError("give a harness run and an engine run of each configuration (LABEL=PATH, the same label "
                         "for both)")
    if args.pair and args.baselines:
        raise ValueError("give --pair or --baselines, not both")
    pairs = None
    for spec in args.pair:
        configuration, sep, baseline = spec.partition(":")
        if not (sep and configuration and baseline):
            raise ValueError(f"--pair {spec}: expected CONFIG:BASELINE")
        pairs = (pairs or []) + [(configuration, baseline)]
    baselines = [b for b in args.baselines.split(",") if b] if args.baselines else None
    runs = [load_implementation_run(path, label) for label, path in map(parse_run_argument, args.runs)]
    tasks = [t for t in args.tasks.split(",") if t] if args.tasks else None
    comparison = compare_engine_with_harness(
        runs, pairs=pairs, baselines=baselines, metrics=_metrics(args.metric), tasks=tasks, alpha=args.alpha,
        permutations=10_000 if args.permutations is None else args.permutations, seed=args.seed)
    print(comparison.to_markdown())
    if args.json:
        write_json(args.json, comparison.to_dict(), ensure_ascii=False)
    return 0


def run_lm_eval(args: argparse.Namespace) -> int:
    """``psr-hf eval ARGS...`` runs ``lm-eval ARGS...`` with psr_hf's model registered (``--model psr_hf``)."""
    from lm_eval.__main__ import cli_evaluate

    from ..eval.lm_eval_hook import register as register_model

    register_model()  # what the start-up hook does, also where site-packages .pth files are not read (python -S)
    saved, sys.argv = sys.argv, ["lm-eval", *args.lm_eval_args]  # lm-eval's CLI reads sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
