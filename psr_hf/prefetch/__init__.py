"""SpecPrefetch (the SpecPrefetch paper): learned low-rank next-layer predictors that rank experts for
prefetching only (the native router still decides what runs), their training, recall metrics and baselines.

:class:`~psr_hf.prefetch.predictor.Predictor` is what ``psr_hf.patch(model, RoutingConfig(prefetch="predictor"),
predictor=...)`` reads. The names below load on first use.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_LAZY = {
    "Predictor": "psr_hf.prefetch.predictor",
    "record_router_inputs": "psr_hf.prefetch.train",
    "train_predictor": "psr_hf.prefetch.train",
    "train_module": "psr_hf.prefetch.train",
    "distillation_loss": "psr_hf.prefetch.train",
    "LowRankAdapters": "psr_hf.prefetch.train",
    "SingleMLP": "psr_hf.prefetch.train",
    "PairMLP": "psr_hf.prefetch.train",
    "expert_recall": "psr_hf.prefetch.recall",
    "recall_table": "psr_hf.prefetch.recall",
    "format_recall_table": "psr_hf.prefetch.recall",
    "PreGate": "psr_hf.prefetch.recall",
    "PreviousToken": "psr_hf.prefetch.recall",
    "profile_window": "psr_hf.prefetch.window",
    "WindowProfile": "psr_hf.prefetch.window",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, eager=())
