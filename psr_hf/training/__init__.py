"""Training that runs the patched model (room 4, above ``hf``: it patches the model and reads peft): distilled
routing and the margin heads of the cache-aware gates (:mod:`psr_hf.training.gate`, ``psr-hf train-gate``;
docs/gates.md). What it trains lives below it: the margin head and its relaxation in :mod:`psr_hf.gates`. The
names below load on first use.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_LAZY = {
    "distill_routing": "psr_hf.training.gate",
    "apply_distilled": "psr_hf.training.gate",
    "load_distilled": "psr_hf.training.gate",
    "DistillationResult": "psr_hf.training.gate",
    "scaled_ranks": "psr_hf.training.gate",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, eager=())
