"""Offload: experts in a host store, a device slot cache per MoE layer that follows the logical cache, and the
copy scheduler (``docs/ALGORITHM.md``, "Physical scheduling"). ``OffloadConfig`` is torch-free; the rest loads
when first used."""

from __future__ import annotations

from .._lazy import lazy_exports

from .config import OffloadConfig

_LAZY = {
    "OffloadedExperts": "psr_hf.offload.experts",
    "OffloadStats": "psr_hf.offload.experts",
    "OffloadMemory": "psr_hf.offload.placement",
    "OffloadMemoryError": "psr_hf.offload.placement",
    "SlotScheduler": "psr_hf.offload.scheduler",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, eager=["OffloadConfig"])
