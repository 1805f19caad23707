"""Routing statistics of a patched model: copies, replaced router slots and displaced router mass.

:class:`RoutingCounters` are the counts summed over rows and layers, carried from the logical cache's counters to
the :class:`RoutingStats` that :meth:`psr_hf.hf.controller.Controller.stats` returns (docs/transformers.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..offload.store import OffloadStats
    from ..policy.cache import CacheStats


@dataclass(frozen=True)
class RoutingStats:
    """Routing statistics of a patched model.

    Per row (``[R]`` arrays) for the current sequence, and ``total`` over every sequence since :func:`patch` or
    :meth:`Controller.reset_stats`; ``offload``: the physical copies (:class:`~psr_hf.offload.OffloadStats`) of an
    offloaded model over the same tokens. Copies are logical cache insertions summed over all MoE layers, per real
    (unpadded) token; ``replaced`` counts selected experts outside the router's own top-K; ``displaced_mass`` is
    the mean over token-layers of the fraction of the router's own top-K weight whose experts were not executed.
    """

    tokens: np.ndarray
    prefetch_per_token: np.ndarray
    demand_per_token: np.ndarray
    copies_per_token: np.ndarray
    replaced_per_token: np.ndarray
    displaced_mass: np.ndarray
    total: dict[str, float] = field(default_factory=dict)
    offload: OffloadStats | None = None  # physical copies since reset_stats, when the experts are offloaded

    @classmethod
    def of(cls, cache_stats: CacheStats, displaced: np.ndarray, total: "RoutingCounters",
           offload: OffloadStats | None = None) -> "RoutingStats":
        """The statistics of the current sequence from the logical cache's ``[L, R]`` counters
        (:class:`~psr_hf.policy.cache.CacheStats`) and ``[L, R]`` displaced-mass sums, with ``total`` over every
        sequence."""
        s = cache_stats
        tokens = s.steps.max(axis=0)  # [R]
        per = np.maximum(tokens, 1)
        steps = np.maximum(s.steps.sum(axis=0), 1)
        prefetch, demand = s.prefetch.sum(axis=0) / per, s.demand.sum(axis=0) / per
        return cls(
            tokens=tokens,
            prefetch_per_token=prefetch,
            demand_per_token=demand,
            copies_per_token=prefetch + demand,
            replaced_per_token=s.replaced.sum(axis=0) / per,
            displaced_mass=displaced.sum(axis=0) / steps,
            total=total.to_total(),
            offload=offload,
        )

    def __repr__(self) -> str:
        t = self.total
        text = (f"RoutingStats(rows={len(self.tokens)}, tokens={int(t.get('tokens', 0))}, "
                f"copies/tok={t.get('copies_per_token', 0.0):.2f} (demand {t.get('demand_per_token', 0.0):.2f}, "
                f"prefetch {t.get('prefetch_per_token', 0.0):.2f}), replaced/tok={t.get('replaced_per_token', 0.0):.2f}"
                f", displaced_mass={t.get('displaced_mass', 0.0):.4f}")
        return text + (", offloaded)" if self.offload is not None else ")")

    def to_dict(self) -> dict[str, Any]:
        rows = {name: getattr(self, name).tolist() for name in (
            "tokens", "prefetch_per_token", "demand_per_token", "copies_per_token", "replaced_per_token",
            "displaced_mass")}
        out: dict[str, Any] = {"rows": rows, "total": dict(self.total)}
        if self.offload is not None:
            out["offload"] = self.offload.to_dict()
        return out


@dataclass
class RoutingCounters:
    """Routing counts summed over rows and MoE layers, from which :attr:`RoutingStats.total` is made. Mutable:
    the controller adds up the counts of finished sequences (``+``) and takes differences (``-``) to start a new
    statistics interval. Floats, as the logical cache's counters they sum."""

    tokens: float = 0.0  # real (unpadded) tokens: per row, the most steps any layer took
    steps: float = 0.0  # token-layers
    prefetch: float = 0.0  # logical prefetch insertions
    demand: float = 0.0  # logical demand insertions
    replaced: float = 0.0  # selected experts outside the router's own top-K
    displaced: float = 0.0  # displaced router mass, summed over token-layers
    sequences: float = 0.0  # rows that saw tokens

    @classmethod
    def of(cls, cache_stats: CacheStats, displaced: np.ndarray) -> "RoutingCounters":
        """The counts of the current sequence (every row) from the logical cache's counters and the ``[L, R]``
        displaced-mass sums."""
        s = cache_stats
        tokens = s.steps.max(axis=0)  # [R]
        return cls(
            tokens=float(tokens.sum()),
            steps=float(s.steps.sum()),
            prefetch=float(s.prefetch.sum()),
            demand=float(s.demand.sum()),
            replaced=float(s.replaced.sum()),
            displaced=float(displaced.sum()),
            sequences=float((tokens > 0).sum()),  # rows that saw tokens
        )

    def __add__(self, other: "RoutingCounters") -> "RoutingCounters":
        return RoutingCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "RoutingCounters") -> "RoutingCounters":
        return RoutingCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def to_total(self) -> dict[str, float]:
        """The per-token totals of :attr:`RoutingStats.total` (the keys lm-eval records and the CLI prints)."""
        tokens = max(self.tokens, 1.0)
        prefetch, demand = self.prefetch / tokens, self.demand / tokens
        return {
            "sequences": int(self.sequences),
            "tokens": int(self.tokens),
            "prefetch_per_token": float(prefetch),
            "demand_per_token": float(demand),
            "copies_per_token": float(prefetch + demand),
            "replaced_per_token": float(self.replaced / tokens),
            "displaced_mass": float(self.displaced / max(self.steps, 1.0)),
        }
