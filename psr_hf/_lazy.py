"""Names a package exports without importing them: each loads on first use (PEP 562), so ``import psr_hf`` and
its subpackages cost no torch, numpy or numba until a name that needs them is touched."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping, Sequence


def lazy_exports(package: str, names: Mapping[str, str], eager: Sequence[str] = (),
                 subpackages: Sequence[str] = ()) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``.

    ``names`` maps an exported name to the module that defines it (absolute, or relative to ``package``);
    ``eager`` lists names the package defines itself; ``subpackages`` are reachable as attributes and imported on
    use. A loaded name is stored on the package, so it is looked up once.
    """
    exported = [*eager, *names]

    def __getattr__(name: str) -> Any:
        if name in subpackages:
            return importlib.import_module(f"{package}.{name}")  # the import sets the attribute on the package
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*exported, *subpackages})

    return exported, __getattr__, __dir__
