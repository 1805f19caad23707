"""Architecture patches, one module per model family (shipped in the wheel as ``psr_hf.patches``).

Each module describes one family: how to find its MoE layers, the router's selection scores, the execution
weights from unmodified scores, the pre-gate and the default pre-gate window, and registers itself with
:func:`register_patch`. Adding an architecture is adding one file here and listing it in ``FAMILY_MODULES``.
"""

from __future__ import annotations

import importlib
from typing import Callable, TypeVar

T = TypeVar("T")

# Families shipped with psr_hf (model_type -> module). Modules are imported on first lookup, so importing
# psr_hf.patches costs nothing and never imports torch.
FAMILY_MODULES: dict[str, str] = {
    "olmoe": "psr_hf.patches.olmoe",
    "deepseek_v3": "psr_hf.patches.deepseek_v3",
    "qwen3_5_moe": "psr_hf.patches.qwen3_5_moe",
    "qwen3_5_moe_text": "psr_hf.patches.qwen3_5_moe",
    "qwen3_next": "psr_hf.patches.qwen3_next",
}

_REGISTRY: dict[str, object] = {}


def register_patch(*model_types: str) -> Callable[[T], T]:
    """Class decorator: register an architecture patch for the given ``config.model_type`` values."""
    if not model_types:
        raise ValueError("register_patch needs at least one model_type")

    def decorator(cls: T) -> T:
        for model_type in model_types:
            if model_type in _REGISTRY and _REGISTRY[model_type] is not cls:
                raise ValueError(f"model_type {model_type!r} is already registered by {_REGISTRY[model_type]!r}")
            _REGISTRY[model_type] = cls
        return cls

    return decorator


def get_patch(model_type: str) -> object:
    """The registered patch for ``model_type``; ``ValueError`` listing the supported ones otherwise."""
    if model_type not in _REGISTRY and model_type in FAMILY_MODULES:
        importlib.import_module(FAMILY_MODULES[model_type])
    if model_type not in _REGISTRY:
        supported = sorted(set(FAMILY_MODULES) | set(_REGISTRY)) or ["none yet"]
        raise ValueError(
            f"model_type {model_type!r} is not supported by psr_hf; supported: {', '.join(supported)}. "
            "A new architecture is one module in psr_hf/patches registering itself with @register_patch."
        )
    return _REGISTRY[model_type]


def supported_model_types() -> list[str]:
    return sorted(set(FAMILY_MODULES) | set(_REGISTRY))
