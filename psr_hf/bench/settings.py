"""How a benchmark's entry point takes its settings: one frozen dataclass per entry point (``BenchSettings``,
``LatencySettings``, ``SweepSettings``, ``FreeGenerationSettings``), validated once in its ``__post_init__``, and
given either as that object or as keyword arguments (``run_bench(model="tiny", rounds=3)``), as the docs, the
CLI and the tests call them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

S = TypeVar("S")


def settings_of(kind: type[S], settings: S | None, fields: Mapping[str, Any], caller: str) -> S:
    """The settings a call ``caller(settings, **fields)`` asks for: ``kind(**fields)`` where no ``settings`` object
    is given, else ``settings`` with ``fields`` replaced. ``TypeError`` naming the unknown keywords and the known
    ones; the settings' own ``ValueError`` for a bad value."""
    known = [f.name for f in dataclasses.fields(kind)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise TypeError(f"{caller}() got unknown settings {', '.join(unknown)}; {kind.__name__} has: "
                        f"{', '.join(known)}")
    if settings is None:
        return kind(**fields)
    if not isinstance(settings, kind):
        raise TypeError(f"{caller}(): the settings object is a {type(settings).__name__}; give a {kind.__name__} "
                        f"or keyword arguments")
    return dataclasses.replace(settings, **fields) if fields else settings


def frozen(instance: object, name: str, value: object) -> None:
    """Set a normalised field of a frozen dataclass from its ``__post_init__`` (sequences become tuples)."""
    object.__setattr__(instance, name, value)
