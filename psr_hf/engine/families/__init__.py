"""The engine's model families, one module each: a :class:`~psr_hf.engine.layers.DecodeLayers` subclass with
the family's attention function and KV cache layout (:class:`EngineFamily`: what it provides over the base),
registered for its ``config.model_type`` values with ``@register_layers(...)``, the only place they are named;
and :func:`build_layers`, the factory that picks the family registered for a model and passes the family's own
options on.

The modules of this package are found on its path and imported on the first lookup (:mod:`psr_hf._registry`), so
a family the engine should decode is one file here and nothing else lists it (docs/engine.md, "Adding a family";
``tests/test_patches_family_discovery.py`` proves it). Importing this package imports neither torch nor a family.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from psr_hf._registry import FamilyRegistry

if TYPE_CHECKING:
    from ..attention import StaticKVCache
    from ..layers import DecodeLayers

REGISTRY = FamilyRegistry(__name__, "engine layers")
#: class decorator: ``@register_layers("olmoe")`` registers a DecodeLayers subclass for those model types
register_layers = REGISTRY.register


@runtime_checkable
class EngineFamily(Protocol):
    """What a registered engine family is (the registry's entries, the classes :func:`build_layers` builds): a
    :class:`~psr_hf.engine.layers.DecodeLayers` subclass that provides, over the base class, the family's
    attention and KV cache layout (docs/engine.md, "Adding a family"). The base provides everything else (routers,
    pre-gates, MLPs, shared experts, the final norm, the reference step) and the two class methods below.

    A layer's attention is a module-level function ``(static, tensors, x, position, *cache) -> [1, H]`` that writes
    the cache at ``position``: :meth:`_build_attention` sets it as ``_attention_fn`` with its constants ``_static``,
    which the base's :meth:`_layer_attention` hands out, or a family that mixes two kinds of layer overrides
    :meth:`_layer_attention`. A family may also set ``listing_order`` (where its model types come in the lists of
    supported families) and define ``_prompt_kv`` or ``_transformers_kv`` (the batched prefill)."""

    @classmethod
    def family_options(cls) -> Mapping[str, Any]:
        """The family's own options and their defaults (the keyword-only arguments of its constructor)."""
        ...

    @classmethod
    def from_model(cls, model: Any, max_len: int, **options: Any) -> DecodeLayers:
        """The family's layers over ``model`` with a static KV cache of ``max_len`` positions; ``ValueError`` for an
        option the family does not take."""
        ...

    def _build_attention(self) -> None:
        """References to the family's attention weights (and its attention function with its constants)."""
        ...

    def _build_kv_cache(self) -> StaticKVCache:
        """The family's static KV cache."""
        ...

    def _cache(self, layer: int) -> tuple:
        """The KV cache tensors the family's attention function takes after the position (one layer's)."""
        ...

    def _layer_attention(self, layer: int) -> tuple:
        """``(attention function, its constants, the layer's tensors)`` of decoder layer ``layer``."""
        ...


def layers_class(model_type: str) -> type[EngineFamily] | None:
    """The engine family (DecodeLayers subclass) registered for ``model_type``, or None."""
    return REGISTRY.get(model_type)


def supported_model_types() -> list[str]:
    """Every model type the engine decodes, in listing order (OLMoE, then DeepSeek-V3, then any other by name)."""
    return REGISTRY.model_types()


def build_layers(model: Any, max_len: int, **family_options: Any) -> DecodeLayers:
    """The decode building blocks of ``model`` (a loaded transformers causal LM, in eval mode) with a static KV
    cache of ``max_len`` positions, from the family registered for its model type (or its text config's).

    ``family_options``: options of that family's own, passed on to it (:meth:`EngineFamily.from_model`), which
    refuses one it does not take (``ValueError``): DeepSeek-V3's ``absorb_mla`` (its attention with ``kv_b_proj``
    absorbed, :mod:`psr_hf.engine.families.deepseek_v3`), Qwen3.5/3.6-MoE's and Qwen3-Next's ``gated_delta_kernel``
    (the Gated DeltaNet step as one Triton kernel, :mod:`psr_hf.engine.families.qwen3_5_moe`), every
    family's ``attention_kernels`` (:mod:`psr_hf.engine.families.olmoe`). An option that another registered
    family takes, given at that family's default, is left out for a family without it: it asks nothing of that
    family (the decoders pass ``absorb_mla=True``, ``gated_delta_kernel=None`` and ``attention_kernels=None``
    whatever the model). ``ValueError`` for an unsupported family, rope type or layout."""
    model_type = getattr(model.config, "model_type", None)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = [t for t in (model_type, getattr(text, "model_type", None)) if t]
    for t in types:
        cls = layers_class(t)
        if cls is not None:
            return cls.from_model(model, max_len, **_options_for(cls, family_options))
    raise ValueError(f"the engine does not support model_type {model_type!r}; supported: "
                     f"{', '.join(supported_model_types())}")


def _options_for(cls: type[EngineFamily], options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` less those ``cls`` does not take that some registered family takes with that value as its
    default (see :func:`build_layers`); the family refuses what is left that it does not take."""
    takes = cls.family_options()
    foreign = {name: value for name, value in options.items() if name not in takes}
    if not foreign:
        return dict(options)
    defaults: dict[str, list[Any]] = {}
    for model_type in supported_model_types():
        for name, default in REGISTRY.get(model_type).family_options().items():
            defaults.setdefault(name, []).append(default)
    return {name: value for name, value in options.items()
            if name in takes or not any(value is d or value == d for d in defaults.get(name, ()))}
