"""grow's model families, one module each: a :class:`~psr_hf.assets.grow_families.base.GrowFamily` subclass that
maps the family's attention and config fields exactly and names its preset target, registered for its
``config.model_type`` values with ``@register_grow(...)``, the only place they are named.

The modules of this package are found on its path and imported on the first lookup (:mod:`psr_hf._registry`), so
a family :func:`psr_hf.assets.grow.grow` should grow is one file here and nothing else lists it
(``tests/test_patches_family_discovery.py`` proves it). Importing this package imports neither torch nor a family.
"""

from __future__ import annotations

from typing import Any

from psr_hf._registry import FamilyRegistry

REGISTRY = FamilyRegistry(__name__, "a grow mapping")
#: class decorator: ``@register_grow("olmoe")`` registers a GrowFamily subclass for those model types
register_grow = REGISTRY.register


def grow_family(model_type: str) -> Any:
    """The mapping (a GrowFamily instance) registered for ``model_type``, or None."""
    cls = REGISTRY.get(model_type)
    return None if cls is None else cls()


def grow_model_types() -> list[str]:
    """Every model type grow maps, in listing order (OLMoE, then DeepSeek-V3, then any other by name)."""
    return REGISTRY.model_types()
