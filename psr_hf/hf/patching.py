"""patch() / unpatch() / patched() / controller(): install and remove cache-aware routing on a transformers model.

What is installed, and how it is removed, is the :class:`~.installer.Installer`'s business; these functions find
the family, build the controller and hand it to the installer.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from ..patches import get_patch, supported_model_types
from ..policy.config import RoutingConfig
from .controller import Controller
from .installation import CONTROLLER_ATTRIBUTE
from .installer import Installer

if TYPE_CHECKING:
    from ..gates.margin_head import MarginHead
    from ..offload.config import OffloadConfig
    from ..patches.base import ArchitecturePatch

logger = logging.getLogger(__name__)


def family_of(model: torch.nn.Module) -> ArchitecturePatch:
    """The architecture patch (:class:`~psr_hf.patches.base.ArchitecturePatch`) that handles ``model``: its
    model type's, or its text config's for a composite model. ``ValueError`` for a model psr_hf cannot patch."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"psr_hf.patch needs a transformers model (nn.Module with .config), got {type(model).__name__}")
    module = type(model).__module__
    if not module.startswith("transformers."):
        raise ValueError(
            f"{type(model).__name__} comes from {module}, not from transformers: models loaded with "
            "trust_remote_code=True run the hub's own code, which psr_hf cannot patch. Load the native class "
            "instead: AutoModelForCausalLM.from_pretrained(path) without trust_remote_code (transformers has "
            "native OLMoE, DeepSeek-V3/Moonlight, Qwen3.5-MoE and Qwen3-Next)"
        )
    model_type = getattr(model.config, "model_type", None)
    candidates = [model_type]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text is not None and getattr(text, "model_type", None) not in candidates:
        candidates.append(text.model_type)
    supported = supported_model_types()
    for candidate in candidates:
        if candidate in supported:
            return get_patch(candidate)(model)
    raise ValueError(
        f"model_type {model_type!r} ({type(model).__name__}) is not supported by psr_hf; supported: "
        f"{', '.join(supported)}. A new architecture is one module in psr_hf/patches registering itself with "
        "@register_patch"
    )


def patch(model: torch.nn.Module, config: RoutingConfig | Mapping[str, object] | str | Path, calibration: Any = None,
          offload: OffloadConfig | Mapping[str, object] | str | None = None, predictor: Any = None,
          gate: MarginHead | str | Path | None = None) -> torch.nn.Module:
    """Make ``model``'s MoE routing cache-aware, in place; returns the same object.

    Args:
        model: a transformers MoE model of a supported family (OLMoE, DeepSeek-V3/Moonlight, Qwen3.5/3.6-MoE,
            Qwen3-Next), loaded with its native class.
        config: a :class:`RoutingConfig` (or a dict of its fields, or a path to its YAML file).
        calibration: a :class:`Calibration`, a path to one, or None: the ``calibration.safetensors`` beside the
            model when it was loaded from a folder that has one (``psr-hf calibrate --out`` writes it there; the
            shipped models have one), logged; else, and with ``False``, the running bonus scale, warm set = the
            first C experts and a zero token prior, with a warning that recommends calibrating.
        offload: None (the experts stay where the model put them), or a :class:`~psr_hf.OffloadConfig` (or a
            device string such as ``"cuda:0"``): every non-expert weight moves to its device, the routed experts to
            a host store, and each MoE layer gets ``capacity`` expert slots on the device that follow the logical
            cache; :meth:`Controller.memory` reports the memory, :meth:`Controller.stats` the copies.
        predictor: with ``RoutingConfig(prefetch="predictor")``, a :class:`psr_hf.prefetch.Predictor` (SpecPrefetch's
            learned next-layer adapters: ``Predictor.load(path)``) whose priorities replace the pre-gate ranking of
            prefetches (docs/ALGORITHM.md); checked against the model's shape.
        gate: a :class:`psr_hf.gates.MarginHead` (or its path): a learned margin per token and layer for
            ``policy="cache_prior"`` (with LRU eviction: the change-based gate of the paper's Section 6.10) or
            ``"psr"`` (a learned bonus), fixed bonus scale; checked against the model's shape and moved to the
            routers' device. The HF path only.

    Returns the model. Per-row state, statistics and recording: :func:`controller`. Undo with :func:`unpatch`.
    Process-wide settings such as torch's thread count stay the caller's (a small model on a busy CPU runs faster
    on one thread: ``torch.set_num_threads(1)``, docs/cli.md).
    """
    offload_config = None
    if offload is not None:
        from ..offload.config import OffloadConfig

        offload_config = OffloadConfig.coerce(offload)
    if getattr(model, CONTROLLER_ATTRIBUTE, None) is not None:
        raise ValueError(
            "this model is already patched by psr_hf; call psr_hf.unpatch(model) first to patch it with another "
            "configuration (psr_hf.controller(model) gives the current one)"
        )
    routing = RoutingConfig.coerce(config)
    if calibration is None:
        calibration = _calibration_beside(model)
        if calibration is not None:
            logger.info("psr_hf.patch: using the calibration beside the model, %s (calibration=False: none)",
                        calibration)
    elif calibration is False:
        calibration = None
    if offload_config is not None and any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "psr_hf.patch(..., offload=...): the model's weights are on the meta device (built without weights), and "
            "offloading copies them to pinned host memory; load the weights first, then patch (a model patched "
            "without offload may be built on the meta device and loaded later)"
        )
    family = family_of(model)
    layers = family.moe_layers()
    if not layers:
        raise ValueError(f"{type(model).__name__} has no routed MoE layers for psr_hf to patch")
    ctl = Controller(model, family, layers, routing, calibration, predictor, gate)
    if calibration is None and not (routing.biased and routing.delta_mode == "fixed"):
        logger.warning(
            "psr_hf.patch without a calibration: warm set = the first %d experts of each layer and no token prior; "
            "calibrate the model (psr_hf.calibrate or psr-hf calibrate) for the paper's warm set and prior",
            ctl.capacity)
    Installer(ctl).install(offload=offload_config)  # all or nothing: a failure leaves the model as it was
    logger.info("psr_hf: patched %d MoE layers of %s (%s), capacity %d of %d experts", ctl.num_layers,
                type(model).__name__, routing.policy, ctl.capacity, ctl.num_experts)
    return model


def _calibration_beside(model: torch.nn.Module) -> Path | None:
    """The ``calibration.safetensors`` in the folder ``model`` was loaded from, if it has one (else None)."""
    import os

    from ..assets import calibration_beside

    source = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not isinstance(source, str) or not source or not os.path.isdir(source):
        return None
    return calibration_beside(source)


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Remove everything :func:`patch` installed; returns the same model, computing exactly as before."""
    ctl = getattr(model, CONTROLLER_ATTRIBUTE, None)
    if ctl is None:
        raise ValueError("this model is not patched by psr_hf (nothing to unpatch); psr_hf.patch(model, config) patches it")
    Installer(ctl).uninstall()
    return model


@contextlib.contextmanager
def patched(model: torch.nn.Module, config: RoutingConfig | Mapping[str, object] | str | Path, calibration: Any = None,
            offload: OffloadConfig | Mapping[str, object] | str | None = None, predictor: Any = None,
            gate: MarginHead | str | Path | None = None) -> Iterator[torch.nn.Module]:
    """``with psr_hf.patched(model, config) as m: ...``: patched inside the block, unpatched after (even on error)."""
    patch(model, config, calibration=calibration, offload=offload, predictor=predictor, gate=gate)
    try:
        yield model
    finally:
        unpatch(model)


def controller(model: torch.nn.Module) -> Controller:
    """The :class:`Controller` of a patched model: per-row state, ``reset()``, ``stats()``, ``record()``."""
    ctl = getattr(model, CONTROLLER_ATTRIBUTE, None)
    if ctl is None:
        raise ValueError("this model is not patched by psr_hf; call psr_hf.patch(model, config) first")
    return ctl

