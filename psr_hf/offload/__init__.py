"""Where the experts live: the expert stores behind one protocol (``store.py``: the model's own weights, or
offloaded to a host store with a device slot cache per MoE layer that follows the logical cache), the copy
scheduler and the copy links (``docs/ALGORITHM.md``, "Physical scheduling"). ``OffloadConfig`` is torch-free; the
rest loads when first used."""

from __future__ import annotations

from .._lazy import lazy_exports

from .config import OffloadConfig

_LAZY = {
    "ExpertStore": "psr_hf.offload.store",
    "PatchedExpertStore": "psr_hf.offload.store",
    "ResidentExperts": "psr_hf.offload.store",
    "OffloadedExperts": "psr_hf.offload.experts",
    "OffloadStats": "psr_hf.offload.store",
    "OffloadMemory": "psr_hf.offload.placement",
    "OffloadMemoryError": "psr_hf.offload.placement",
    "SlotScheduler": "psr_hf.offload.scheduler",
    "CopyLink": "psr_hf.offload.links",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, eager=["OffloadConfig"])
