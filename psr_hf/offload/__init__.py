"""Offload: experts in a host store, a device slot cache per MoE layer that follows the logical cache, and the
copy scheduler (``docs/ALGORITHM.md``, "Physical scheduling"). ``OffloadConfig`` is torch-free; the rest loads
when first used."""

from __future__ import annotations

import importlib
from typing import Any

from .config import OffloadConfig

_LAZY = {
    "OffloadedExperts": "psr_hf.offload.experts",
    "OffloadStats": "psr_hf.offload.experts",
    "OffloadMemory": "psr_hf.offload.placement",
    "OffloadMemoryError": "psr_hf.offload.placement",
    "SlotScheduler": "psr_hf.offload.scheduler",
}

__all__ = ["OffloadConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psr_hf.offload' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
