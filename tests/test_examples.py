"""The example scripts run and report what they claim."""

from __future__ import annotations

import runpy
from pathlib import Path

from psr_hf.testing import FAMILIES

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_patch_and_generate_example_replays_every_family(capsys):
    runpy.run_path(str(EXAMPLES / "patch_and_generate.py"), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [line.split()[0] for line in lines] == list(FAMILIES)
    assert all(line.endswith("replay ok True") for line in lines)
