"""The options several commands share (``--model``, ``--device``, ``--threads``, the records and plots they write,
seeds, calibrations, rounds), each defined once here, and what is done with them before a command runs: the
rounds a benchmark needs, the device a left-out ``--device`` means, output paths checked before the work, the
thread decision (docs/cli.md#threads: one torch thread for a small model on a CPU unless told), comma-separated
lists."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .._threads import SMALL_HIDDEN
from ..assets import NAMED_MODELS
from ..assets.loading import BUILT_HIDDEN_SIZES, GROWN, RANDOM_OLMOE, TINY, load_model, model_hidden_size
from .console import err

#: the models small enough for a CPU: where --device is not given, they run there
SMALL_MODELS = ("tiny", "tiny-moe", "olmoe-routing", "moonlight-routing", "qwen36-routing")
THREADS_HELP = ("torch intra-op threads (and numba's); default: 1 for a small model on a CPU (hidden size <= "
                f"{SMALL_HIDDEN}), torch's default otherwise, or OMP_NUM_THREADS where it is set")
_OUTPUTS = ("out", "json", "plot", "markdown")  # every option that names a path the command writes
#: the rounds a latency benchmark needs at least: psr_hf.bench.timing.MIN_ROUNDS, named here because that module
#: imports torch (tests/test_cli_startup.py keeps the two equal)
LATENCY_ROUNDS = 3
LATENCY_ROUNDS_WHY = "latency ratios come from a paired t-test over rounds (the round is the unit)"
#: what ``ArgumentParser.add_subparsers()`` returns, where each command group registers its commands
Subparsers = argparse._SubParsersAction


def add_model(parser: argparse.ArgumentParser, default: str | None = None, *, built: bool = True, also: str = "",
              note: str = "") -> None:
    """``--model``: the named models, with ``built`` the ones :func:`psr_hf.assets.loading.load_model` builds too,
    ``also`` the command's own; required where there is no ``default``."""
    names = f"{', '.join(NAMED_MODELS)} (small, trained)"
    if built:
        names += (f", {' or '.join(GROWN)} (grown to real size when loaded; for a GPU), {TINY} or {RANDOM_OLMOE} "
                  "(random weights)")
    if also:
        names += f", {also}"
    default_text = f"; default {default}" if default else ""
    parser.add_argument("--model", default=default, required=default is None,
                        help=f"{names}, a model directory or a hub id owner/name (docs/models.md){default_text}{note}")


def add_device(parser: argparse.ArgumentParser, default: str | None = "cpu", note: str = "") -> None:
    """``--device``; ``None``: the small models on the CPU, the others on ``cuda:0`` (:func:`check_device`)."""
    if default is None:
        text = (f"torch device (default: cpu for the small models {', '.join(SMALL_MODELS[:-1])} and "
                f"{SMALL_MODELS[-1]}, cuda:0 for the others)")
    else:
        text = f"torch device to run the model on (default {default}{note})"
    parser.add_argument("--device", default=default, help=text)


def add_threads(parser: argparse.ArgumentParser, help: str = THREADS_HELP) -> None:
    parser.add_argument("--threads", type=int, help=help)


def add_json(parser: argparse.ArgumentParser, help: str = "write the JSON record here") -> None:
    parser.add_argument("--json", help=help)


def add_plot(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--plot", metavar="FILE", help=f"write {what} here (PNG)")


def add_out(parser: argparse.ArgumentParser, help: str, *, directory: bool = False) -> None:
    """``--out`` (required): a file, or with ``directory`` a folder created new or empty."""
    parser.add_argument("--out", required=True, help=help)
    parser.set_defaults(out_is_directory=directory)


def add_seed(parser: argparse.ArgumentParser, of: str = "the random models' weights") -> None:
    parser.add_argument("--seed", type=int, default=0, help=f"seed of {of} (default 0)")


def add_rounds(parser: argparse.ArgumentParser, default: int | None, what: str = "interleaved rounds", *,
               minimum: int = 1, why: str = "", default_help: str | None = None) -> None:
    """``--rounds``: at least ``minimum`` (``why``: the reason an error gives), checked by :func:`check_rounds`;
    ``default_help``: what ``--help`` says of a default the command decides when it runs (``default`` None)."""
    parser.add_argument("--rounds", type=int, default=default,
                        help=f"{what}, at least {minimum} ({default_help or f'default {default}'})")
    parser.set_defaults(rounds_minimum=(minimum, why))


def add_latency_rounds(parser: argparse.ArgumentParser, what: str = "interleaved rounds") -> None:
    """``--rounds`` of a latency benchmark: :data:`LATENCY_ROUNDS` by default and at least."""
    add_rounds(parser, LATENCY_ROUNDS, what, minimum=LATENCY_ROUNDS, why=LATENCY_ROUNDS_WHY)


def add_texts(parser: argparse.ArgumentParser, help: str, option: str = "--text") -> None:
    """A repeatable text-file option (empty: the command's default text)."""
    parser.add_argument(option, action="append", default=[], metavar="FILE", help=help)


def add_calibration(parser: argparse.ArgumentParser) -> None:
    """``--calibration`` and ``--calibration-tokens`` (:func:`psr_hf.eval.calibration.model_calibration`)."""
    parser.add_argument("--calibration", help="a saved calibration (.safetensors) of this model (default: the "
                                              "calibration.safetensors beside the model, else calibrate on "
                                              "standard-library modules other than the windows')")
    parser.add_argument("--calibration-tokens", type=int, default=8192,
                        help="tokens of the default calibration on standard-library modules (default 8192)")


def comma_floats(option: str, text: str) -> list[float]:
    """The numbers of a comma-separated option value; ``ValueError`` naming ``option`` otherwise."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} {text}: expected comma-separated numbers, e.g. 0.5,0.25") from None
    if not values:
        raise ValueError(f"{option} {text!r}: give at least one number")
    return values


def comma_ints(option: str, text: str) -> list[int]:
    """The integers >= 1 of a comma-separated option value; ``ValueError`` naming ``option`` otherwise."""
    values = comma_floats(option, text)
    if any(v != int(v) or v < 1 for v in values):
        raise ValueError(f"{option} {text}: expected comma-separated integers >= 1, e.g. 2,4,8")
    return [int(v) for v in values]


def check_rounds(args: argparse.Namespace) -> None:
    """``--rounds`` below the command's minimum refused before anything prints or loads (the benchmark would
    refuse it too, but only after the command's header)."""
    if getattr(args, "rounds", None) is None:
        return  # a command without --rounds, or one that picks them itself
    minimum, why = getattr(args, "rounds_minimum", (1, ""))
    if args.rounds < minimum:
        needed = f"at least {minimum} round{'s are' if minimum > 1 else ' is'} needed{f'; {why}' if why else ''}"
        raise ValueError(f"rounds={args.rounds}: {needed}: give --rounds {minimum} or more")


def check_device(args: argparse.Namespace) -> None:
    """Resolve a --device left out (small models: cpu, others: cuda:0) and refuse a CUDA device that this torch
    cannot use, before anything loads (a sweep's ``--stage quality`` uses only its ``--quality-device``;
    ``--join`` brings measured stages)."""
    if not hasattr(args, "device"):
        return
    if args.device is None:
        args.device = "cpu" if getattr(args, "model", None) in SMALL_MODELS else "cuda:0"
    if getattr(args, "join", None):
        return  # joined stages are measured already (a stage still missing needs its device: load_model says so)
    option, used = "--device", args.device
    if getattr(args, "stage", None) == "quality" and getattr(args, "quality_device", None):
        option, used = "--quality-device", args.quality_device  # a sweep's divergence stage alone runs there
    if str(used).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            build = "a CPU build of torch" if torch.version.cuda is None else "no CUDA device visible"
            raise ValueError(f"{option} {used}: torch sees no CUDA device ({build}); use {option} cpu")


def check_outputs(args: argparse.Namespace) -> None:
    """Every output path of the command checked before its work (a failed write after an hour of work loses it)."""
    from .._paths import check_output

    for name in _OUTPUTS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            check_output(f"--{name}", value, directory=name == "out" and getattr(args, "out_is_directory", False))


def set_threads(args: argparse.Namespace, *, device: str = "cpu", hidden_size: int | None = None) -> int:
    """``--threads`` where given, else the library's decision for the model; returns torch's intra-op threads."""
    import torch

    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: give at least 1")
        import numba

        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    else:
        from .._threads import decide

        decide(hidden_size, device)
    logging.getLogger("psr_hf.cli").info("torch intra-op threads: %d", torch.get_num_threads())
    return torch.get_num_threads()


def set_threads_for_model(args: argparse.Namespace) -> None:
    """:func:`set_threads` for ``--model`` on ``--device`` (a typo in the model's name fails here)."""
    set_threads(args, device=args.device, hidden_size=model_hidden_size(args.model, BUILT_HIDDEN_SIZES))


def load_model_of(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """The threads for ``--model`` on ``--device``, then the model, its tokenizer and its description: what the
    commands that run one model (excess-nll, train-predictor, recall, profile-window) do first."""
    set_threads_for_model(args)
    err(f"psr-hf {args.command}: loading {args.model} on {args.device}")
    return load_model(args.model, args.device, seed=args.seed)
