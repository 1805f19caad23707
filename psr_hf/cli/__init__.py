"""The ``psr-hf`` command (docs/cli.md), the one part of psr_hf that prints. Each command group is a module that
registers its sub-commands (``register``) and runs them; the options they share are defined once in
:mod:`.options`. :func:`main` parses, checks rounds, devices and output paths before any work, and prints an error
in what was given as one line on stderr (exit status 2) without a traceback. Building the parser imports no torch
(nor transformers, numba or numpy): ``--help``, ``--version`` and argument errors answer at once, and a command
imports what it needs when it runs (tests/test_cli_startup.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import bench, demo, evaluation, excess_nll, free_generation, gates, models, prefetch, quantize, speculative, sweep
from .options import check_device, check_outputs, check_rounds

DESCRIPTION = (
    "Cache-aware expert routing for transformers Mixture-of-Experts models: run the demo, measure how far a routing "
    "policy moves a model from exact routing (excess-nll) and how many expert copies it needs, calibrate a model, "
    "grow a small trained model to real-size dimensions with the same routing (grow), benchmark "
    "the policy kernels and offloaded decoding, train a learned next-layer prefetch predictor and measure its expert "
    "recall (train-predictor, recall), compare lm-eval runs, or run lm-eval with --model psr_hf (eval). "
    "Models are named the same way everywhere: tiny-moe (shipped), a local model directory, or a hub id "
    "(owner/name; from the local cache when offline). `psr-hf COMMAND --help` describes each command."
)
# the order in --help
GROUPS = (demo, models, quantize, bench, free_generation, speculative, sweep, excess_nll, prefetch, gates, evaluation)


def package_version() -> str:
    """The installed distribution's version, or psr_hf's own where it runs from a checkout without one."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("psr-hf")
    except PackageNotFoundError:
        from .. import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="psr-hf", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:  # argparse cannot pass on arguments that look like options: lm-eval gets them all
        args = argparse.Namespace(command="eval", verbose=False, func=evaluation.run_lm_eval, lm_eval_args=argv[1:])
    else:
        args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        check_rounds(args)  # cheap, so first: check_device may import torch
        check_device(args)
        check_outputs(args)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"psr-hf {args.command}: error: {exc}", file=sys.stderr)
        return 2
