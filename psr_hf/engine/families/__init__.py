"""The engine's model families, one module each: a :class:`~psr_hf.engine.layers.DecodeLayers` subclass with
the family's attention function and KV cache layout, registered for its ``config.model_type`` values with
``@register_layers(...)``, the only place they are named.

The modules of this package are found on its path and imported on the first lookup (:mod:`psr_hf._registry`), so
a family the engine should decode is one file here and nothing else lists it (docs/engine.md, "Adding a family";
``tests/test_patches_family_discovery.py`` proves it). Importing this package imports neither torch nor a family.
"""

from __future__ import annotations

from psr_hf._registry import FamilyRegistry

REGISTRY = FamilyRegistry(__name__, "engine layers")
#: class decorator: ``@register_layers("olmoe")`` registers a DecodeLayers subclass for those model types
register_layers = REGISTRY.register


def layers_class(model_type: str) -> type | None:
    """The DecodeLayers subclass registered for ``model_type``, or None."""
    return REGISTRY.get(model_type)


def supported_model_types() -> list[str]:
    """Every model type the engine decodes, in listing order (OLMoE, then DeepSeek-V3, then any other by name)."""
    return REGISTRY.model_types()
