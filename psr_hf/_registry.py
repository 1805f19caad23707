"""Model families registered per layer, one module each: the engine's decode layers
(:mod:`psr_hf.engine.families`), grow's mappings (:mod:`psr_hf.assets.grow_families`) and the
transformers path's patches (``psr_hf.patches``).

A :class:`FamilyRegistry` belongs to one package. Its ``register`` decorator records a class for the
``config.model_type`` values it names; every module of the package (``base`` and private ``_*`` modules aside)
is found on the package's ``__path__`` (pkgutil) and imported on the first lookup, which registers it. So a
family is one new file in that package, and nothing else lists it. Stdlib only.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import sys
from typing import Callable, TypeVar

T = TypeVar("T")


class FamilyRegistry:
    """``model_type -> class`` for the family modules of ``package`` (its dotted name).

    A registered class may set ``listing_order`` (an int): where its model types come in :meth:`model_types`
    and in the messages built from it; classes without one come after, each group by name.
    """

    def __init__(self, package: str, what: str):
        self.package = package
        self.what = what  # what a registered class is, for messages ("engine layers", "grow mapping")
        self._entries: dict[str, type] = {}

    def register(self, *model_types: str) -> Callable[[T], T]:
        """Class decorator: register the class for the given ``config.model_type`` values; returns it unchanged.
        ``ValueError`` if no model type is given or one is registered by another class."""
        if not model_types:
            raise ValueError(f"registering {self.what} needs at least one model_type")

        def decorator(cls: T) -> T:
            for model_type in model_types:
                known = self._entries.get(model_type)
                if known is not None and known is not cls:
                    raise ValueError(f"model_type {model_type!r} is already registered by {known!r} ({self.what})")
                self._entries[model_type] = cls
            return cls

        return decorator

    def discover(self) -> None:
        """Import every family module on the package's path not imported yet (importing registers it). The path
        is read on every call: a folder added to ``__path__`` later (a plugin, a test) is seen."""
        for module in pkgutil.iter_modules(sys.modules[self.package].__path__):
            if module.name == "base" or module.name.startswith("_"):
                continue
            importlib.import_module(f"{self.package}.{module.name}")

    def get(self, model_type: str) -> type | None:
        """The class registered for ``model_type``, or None."""
        if model_type not in self._entries:
            self.discover()
        return self._entries.get(model_type)

    def model_types(self) -> list[str]:
        """Every registered model type, in listing order (the class docstring)."""
        self.discover()
        return sorted(self._entries, key=lambda t: (getattr(self._entries[t], "listing_order", math.inf), t))
