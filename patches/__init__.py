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

from psr_hf._registry import FamilyRegistry

REGISTRY = FamilyRegistry(__name__, "a patch")
#: class decorator: ``@register_patch("olmoe")`` registers an ArchitecturePatch subclass for those model types
register_patch = REGISTRY.register


def get_patch(model_type: str) -> type:
    """The patch class registered for ``model_type``; ``ValueError`` listing the supported ones otherwise."""
    cls = REGISTRY.get(model_type)
    if cls is None:
        supported = REGISTRY.model_types() or ["none yet"]
        raise ValueError(
            f"model_type {model_type!r} is not supported by psr_hf; supported: {', '.join(supported)}. "
            "A new architecture is one module in psr_hf/patches registering itself with @register_patch."
        )
    return cls


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` a patch module on this package's path registers, sorted."""
    return REGISTRY.model_types()
