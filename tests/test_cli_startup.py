"""``psr-hf`` answers ``--help``, ``COMMAND --help``, ``--version`` and argument errors without importing torch,
transformers, numba or numpy: each runs in a fresh interpreter under ``-X importtime``, and the test reads which
modules it imported (no timings: what is imported decides how long a start takes)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from psr_hf.cli import build_parser

HEAVY = ("torch", "transformers", "numba", "numpy", "scipy")
# every command name (aliases too) -> its usage's prog; `psr-hf eval --help` is lm-eval's, an optional extra's
COMMANDS = {name: parser.prog for name, parser in next(a for a in build_parser()._actions
                                                       if isinstance(a, argparse._SubParsersAction)).choices.items()
            if name != "eval"}


@dataclass(frozen=True)
class Answer:
    returncode: int
    out: str
    err: str  # stderr without -X importtime's lines
    imported: frozenset[str]  # top-level packages of every module imported

    def heavy(self) -> list[str]:
        return [name for name in HEAVY if name in self.imported]


def psr_hf(*argv: str) -> Answer:
    """``psr-hf ARGV`` in a new interpreter, with what it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "psr_hf.cli", *argv], capture_output=True,
                          text=True, timeout=120)
    lines = done.stderr.splitlines()
    timing = [line for line in lines if line.startswith("import time:")]
    imported = frozenset(line.rsplit("|", 1)[-1].strip().split(".")[0] for line in timing)
    err = "\n".join(line for line in lines if not line.startswith("import time:"))
    return Answer(done.returncode, done.stdout, err, imported)


def test_the_top_level_help_imports_no_torch():
    answer = psr_hf("--help")
    assert answer.returncode == 0, answer.err
    assert answer.out.startswith("usage: psr-hf") and "--version" in answer.out
    assert "psr_hf" in answer.imported  # the measurement sees the package's own imports
    assert not answer.heavy()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_help_imports_no_torch(command):
    answer = psr_hf(command, "--help")
    assert answer.returncode == 0, answer.err
    assert answer.out.startswith(f"usage: {COMMANDS[command]} ")
    assert not answer.heavy()


def test_version_prints_the_package_version_without_torch():
    from psr_hf.cli import package_version

    answer = psr_hf("--version")
    assert (answer.returncode, answer.out) == (0, f"psr-hf {package_version()}\n")
    assert not answer.heavy()


def test_version_falls_back_to_the_package_string_without_a_distribution(monkeypatch):
    import importlib.metadata

    import psr_hf as package
    from psr_hf.cli import package_version

    assert package_version() == importlib.metadata.version("psr-hf")

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert package_version() == package.__version__


@pytest.mark.parametrize("argv, message", [
    (["demo", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["no-such-command"], "invalid choice: 'no-such-command'"),
    (["bench", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["bench-patch", "--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    (["bench", "--rounds", "three"], "argument --rounds: invalid int value: 'three'"),
    (["bench-plot"], "the following arguments are required: record"),
    (["calibrate", "--text", "t.txt", "--out", "c.safetensors"], "the following arguments are required: --model"),
    ([], "the following arguments are required: command"),
])
def test_an_argument_error_is_argparses_message_without_torch_or_a_traceback(argv, message):
    answer = psr_hf(*argv)
    assert answer.returncode == 2
    assert answer.out == ""
    assert message in answer.err and "error:" in answer.err and "Traceback" not in answer.err
    assert not answer.heavy()


def test_too_few_rounds_are_refused_before_the_header_and_without_torch():
    answer = psr_hf("bench", "--model", "tiny", "--device", "cpu", "--rounds", "1")
    assert answer.returncode == 2
    assert answer.out == ""  # no header above the error
    assert answer.err.startswith("psr-hf bench: error: rounds=1: at least 3 rounds are needed")
    assert "give --rounds 3 or more" in answer.err and "Traceback" not in answer.err
    assert not answer.heavy()


def test_grow_help_lists_every_preset_it_accepts():
    from psr_hf.assets.grow import PRESETS

    top, grow = psr_hf("--help"), psr_hf("grow", "--help")
    grow_line = " ".join(re.search(r"\n    grow +(.*?)\n    \S", top.out, re.S).group(1).split())  # unwrapped
    for preset in PRESETS:
        assert preset in grow_line
        assert preset in " ".join(grow.out.split())
    assert not grow.heavy()


def test_the_names_the_cli_keeps_without_torch_are_the_librarys():
    from psr_hf.bench.generate_latency import SETUPS
    from psr_hf.bench.speculative import DEFAULT_AR
    from psr_hf.bench.timing import MIN_ROUNDS
    from psr_hf.cli.bench import GENERATE_SETUPS
    from psr_hf.cli.options import LATENCY_ROUNDS
    from psr_hf.cli.speculative import DEFAULT_AR as CLI_DEFAULT_AR

    assert GENERATE_SETUPS == SETUPS
    assert CLI_DEFAULT_AR == DEFAULT_AR
    assert LATENCY_ROUNDS == MIN_ROUNDS
