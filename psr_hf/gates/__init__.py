"""Trainable cache-aware gates (the paper's Section 6.10): a learned, bounded per-token margin on the logical cache
(:class:`~psr_hf.gates.margin_head.MarginHead`), read by ``psr_hf.patch(model, config, gate=...)``, and the
relaxation a head trains through (:mod:`.relaxation`). The training itself patches the model, so it sits above
``hf``: :mod:`psr_hf.training.gate` (``psr-hf train-gate``). The names below load on first use.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_LAZY = {
    "MarginHead": "psr_hf.gates.margin_head",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, eager=())
