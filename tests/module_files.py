"""Loading a Python file of the repository that is not part of the package (the offline tasks' ``utils.py``, the
example runs' scripts) as a module, for the tests that exercise it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK_UTILS = ROOT / "eval_configs" / "tasks" / "utils.py"


def load_module(name: str, path: Path):
    """The module ``name`` executed from ``path``, registered in ``sys.modules`` (dataclasses look their module up
    while the module runs)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
