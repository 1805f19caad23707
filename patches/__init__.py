"""Architecture patches, one module per model family (shipped in the wheel as ``psr_hf.patches``).

Each module describes one family: how to find its MoE layers, the router's selection scores, the execution
weights from unmodified scores, the pre-gate and the default pre-gate window, and its tiny random test config
(:class:`~psr_hf.patches.base.ArchitecturePatch`); it declares the ``config.model_type`` values it handles with
``@register_patch("model_type", ...)``, the only place they are named. Adding an architecture is adding one file
here: every module of this package (``base`` and private ``_*`` modules aside) is found on :data:`__path__` and
imported on the first lookup, which registers its patch. Importing ``psr_hf.patches`` itself imports neither the
family modules nor torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, TypeVar

T = TypeVar("T")

# modules of this package that are not families: the base class every family module imports
_NOT_FAMILIES = frozenset({"base"})

_REGISTRY: dict[str, type] = {}  # model_type -> patch class, filled by @register_patch as family modules import


def register_patch(*model_types: str) -> Callable[[T], T]:
    """Class decorator: register an architecture patch class for the given ``config.model_type`` values.

    Returns the class unchanged; ``ValueError`` if no model type is given or one is registered by another class.
    """
    if not model_types:
        raise ValueError("register_patch needs at least one model_type")

    def decorator(cls: T) -> T:
        for model_type in model_types:
            if model_type in _REGISTRY and _REGISTRY[model_type] is not cls:
                raise ValueError(f"model_type {model_type!r} is already registered by {_REGISTRY[model_type]!r}")
            _REGISTRY[model_type] = cls
        return cls

    return decorator


def _discover() -> None:
    """Import every family module on this package's path that is not imported yet (importing registers it).

    The path is scanned on every call, not once: a folder added to ``__path__`` later (a plugin, a test) is seen.
    """
    for module in pkgutil.iter_modules(__path__):
        if module.name in _NOT_FAMILIES or module.name.startswith("_"):
            continue
        importlib.import_module(f"{__name__}.{module.name}")


def get_patch(model_type: str) -> type:
    """The patch class registered for ``model_type``; ``ValueError`` listing the supported ones otherwise."""
    if model_type not in _REGISTRY:
        _discover()
    if model_type not in _REGISTRY:
        supported = sorted(_REGISTRY) or ["none yet"]
        raise ValueError(
            f"model_type {model_type!r} is not supported by psr_hf; supported: {', '.join(supported)}. "
            "A new architecture is one module in psr_hf/patches registering itself with @register_patch."
        )
    return _REGISTRY[model_type]


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` a patch module on this package's path registers, sorted."""
    _discover()
    return sorted(_REGISTRY)
