"""The rows of the latency benchmark: :class:`Row` (kind, routing, copies skipped), whose name is derived from its
fields, and :func:`latency_rows`, the one grid builder of ``psr-hf bench`` and ``psr-hf sweep``.

Kinds (the records' ``kind``): ``resident`` (the unpatched model, every expert on the device: the reference of
every ratio), ``accelerate`` (``accelerate.dispatch_model`` with the experts on the CPU), ``offload`` (a routing
configuration on the transformers path's offloaded copy), ``engine_resident`` (psr_hf's batch-1 decoder with every
expert cached: the engine rows' reference) and ``engine`` (the decoder on an offloaded copy; with copies skipped,
the same routing on the all-resident copy, so nothing is copied: the paper's Table 9). A routed row's name is its
routing's grid name (:mod:`psr_hf.eval.grid`) with ``engine_`` before it, the residency (``_res50``) and
``_nocopy`` after it; :meth:`Row.from_name` reads a name back (records and the goals' rows carry names only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..eval.grid import (cache_prior, entry_name, exact_a_pf, exact_lru, prefetch_only, prefetch_source_named, psr,
                         routing_from_name, routing_grid, routing_name, spec)
from ..policy.config import RoutingConfig

RESIDENT = "resident"
ACCELERATE = "accelerate"
OFFLOAD = "offload"
ENGINE_RESIDENT = "engine_resident"
ENGINE = "engine"
REFERENCE_KINDS = (RESIDENT, ACCELERATE, ENGINE_RESIDENT)
ROUTED_KINDS = (OFFLOAD, ENGINE)
ENGINE_PREFIX = "engine_"
NOCOPY_SUFFIX = "_nocopy"
RESIDENCY_PREFIX = "_res"

# the paper's Section 6.1 baselines, every one at every capacity (name -> RoutingConfig fields, no residency)
BASELINES: dict[str, dict[str, Any]] = routing_grid(
    [exact_lru(), exact_a_pf(), cache_prior(0.2), psr(0.2, 1), psr(0.3, 1), spec()])
DEFAULT_CAPACITIES = (0.5, 0.25)
EXACT_LRU = entry_name(exact_lru())
PSR_GOAL = entry_name(psr(0.3, 1))  # the PSR row the goals are set for


def capacity_suffix(residency: float) -> str:
    """``_res50`` for residency 0.5 (whole percent)."""
    return f"{RESIDENCY_PREFIX}{round(residency * 100)}"


@dataclass(frozen=True)
class Row:
    """One row of the benchmark: ``kind`` (one of :data:`REFERENCE_KINDS` or :data:`ROUTED_KINDS`), the routed
    kinds' ``routing`` (with its residency) and, for ``engine`` rows, whether the copies are skipped."""

    kind: str
    routing: RoutingConfig | None = None
    copies_skipped: bool = False

    def __post_init__(self) -> None:
        if self.kind in REFERENCE_KINDS:
            if self.routing is not None or self.copies_skipped:
                raise ValueError(f"a {self.kind!r} row has no routing and copies nothing")
        elif self.kind in ROUTED_KINDS:
            if not isinstance(self.routing, RoutingConfig) or self.routing.residency is None:
                raise ValueError(f"a {self.kind!r} row needs a RoutingConfig with a residency, got {self.routing!r}")
            routing_name(self.routing)  # a routing the grid names
            if self.copies_skipped and self.kind != ENGINE:
                raise ValueError("only engine rows skip their copies (the decoder on the all-resident copy)")
        else:
            raise ValueError(f"kind {self.kind!r}; allowed: {', '.join(REFERENCE_KINDS + ROUTED_KINDS)}")

    @property
    def residency(self) -> float | None:
        return None if self.routing is None else float(self.routing.residency)

    @property
    def routing_name(self) -> str:
        """The routing's grid name without the residency (``psr_lam0.3_n1``); a reference row's kind."""
        return self.kind if self.routing is None else routing_name(self.routing)

    @property
    def name(self) -> str:
        """The row's name in tables and records (``engine_psr_lam0.3_n1_res50_nocopy``)."""
        if self.routing is None:
            return self.kind
        return ((ENGINE_PREFIX if self.kind == ENGINE else "") + self.routing_name + capacity_suffix(self.residency)
                + (NOCOPY_SUFFIX if self.copies_skipped else ""))

    @property
    def on_engine(self) -> bool:
        """Whether the row runs psr_hf's decoder (``engine`` or ``engine_resident``)."""
        return self.kind in (ENGINE, ENGINE_RESIDENT)

    def replace(self, **changes: Any) -> Row:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_name(cls, name: str) -> Row | None:
        """The row named ``name``, or None where no row has that name; its residency is the name's whole percent.
        The one place a row's name is read back."""
        if name in REFERENCE_KINDS:
            return cls(name)
        stem, engine, skipped = name, name.startswith(ENGINE_PREFIX), name.endswith(NOCOPY_SUFFIX)
        stem = stem[len(ENGINE_PREFIX) if engine else 0: -len(NOCOPY_SUFFIX) if skipped else None]
        routing, _, percent = stem.rpartition(RESIDENCY_PREFIX)
        fields = routing_from_name(routing) if percent.isdigit() else None
        if fields is None:
            return None
        try:
            row = cls(ENGINE if engine else OFFLOAD, RoutingConfig(residency=int(percent) / 100, **fields), skipped)
        except ValueError:
            return None
        return row if row.name == name else None


def routed(kind: str, fields: dict[str, Any], residency: float, copies_skipped: bool = False) -> Row:
    """The ``kind`` row of the grid entry ``fields`` at ``residency``."""
    return Row(kind, RoutingConfig(residency=float(residency), **fields), copies_skipped)


def prefetch_configs(budgets: Sequence[int], predictor: bool = True) -> dict[str, dict[str, Any]]:
    """SpecPrefetch's system comparison (its Tables 4-5, Figure 4) as grid entries, per prefetch budget ``M``:
    ``specprefetch_mM`` (exact routing, prefetches ranked by the learned predictor, at most M per layer and token,
    over every expert; only with ``predictor``) and ``naive_mM`` (the same with the previous token's scores: Naive
    Prefetch). OFF is ``exact_lru`` (no prefetch); PRED0 is the engine's copies-skipped row of ``specprefetch_mM``,
    measured against the copies-skipped ``exact_lru`` row (:func:`latency_rows` adds both)."""
    entries = []
    for m in budgets:
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"prefetch budget {m!r} must be an int >= 1 (prefetch copies per layer and token)")
        if predictor:
            entries.append(prefetch_only(m, "predictor"))
        entries.append(prefetch_only(m, "previous"))
    return routing_grid(entries)


def _wanted(names: Sequence[str]) -> set[str]:
    return {name.strip() for name in names if name.strip()}


def _named(row: Row, wanted: set[str]) -> bool:
    """Whether ``row`` is asked for by its full name (``psr_lam0.3_n1_res50``) or its routing's (every capacity)."""
    return row.name in wanted or row.routing_name in wanted


def latency_rows(capacities: Sequence[float] = DEFAULT_CAPACITIES, *, accelerate: bool = True,
                 only: Sequence[str] | None = None, engine: bool = False, hf_only: Sequence[str] | None = None,
                 prefetch_budgets: Sequence[int] = (), predictor: bool = False) -> list[Row]:
    """The benchmark's rows: ``resident`` (always: the reference of every ratio), ``accelerate`` (unless
    ``accelerate`` is False) and every :data:`BASELINES` entry at every residency in ``capacities``.

    ``only`` keeps the rows whose full name (``psr_lam0.3_n1_res50``) or routing name (``psr_lam0.3_n1``: every
    capacity) is listed, plus ``resident``; a routing name of the grid beyond the baselines
    (``psr_lam0.3_n1_d2``) adds its rows at every capacity; an unknown name raises ``ValueError``.

    ``engine`` appends ``engine_resident``, an ``engine`` row for every routed row kept and its copies-skipped twin
    (the same decisions on the all-resident copy: the compute part of the row's physical bound). ``hf_only``
    (with ``engine``): of the routed transformers rows, keep only these names (the same rule as ``only``; an empty
    list keeps none); the engine rows still mirror every routed row ``only`` keeps (the transformers rows are the
    slow ones: keep one or two as references). ``prefetch_budgets``: also the rows of :func:`prefetch_configs` (SpecPrefetch's
    ``specprefetch_mM`` only with ``predictor``), at every capacity."""
    if not capacities:
        raise ValueError("capacities is empty; give at least one residency in (0, 1], e.g. 0.5")
    for residency in capacities:
        if not (0.0 < float(residency) <= 1.0):
            raise ValueError(f"capacity {residency!r} must be a residency in (0, 1] (fraction of each layer's experts)")
    suffixes = [capacity_suffix(r) for r in capacities]
    if len(set(suffixes)) != len(suffixes):
        raise ValueError(f"capacities {list(capacities)} repeat a residency (in whole percent)")
    rows = [Row(RESIDENT), Row(ACCELERATE)] if accelerate else [Row(RESIDENT)]
    table = {**BASELINES, **prefetch_configs(list(prefetch_budgets), predictor)}
    rows += [routed(OFFLOAD, fields, residency) for residency in capacities for fields in table.values()]
    if only is not None:
        wanted = _wanted(only)
        if not predictor and any(prefetch_source_named(name) == "predictor" for name in wanted):
            raise ValueError("the specprefetch_m* rows rank prefetches by a learned predictor: they need a "
                             "predictor: --predictor FILE (psr-hf train-predictor) with --prefetch-budgets")
        known = {row.name for row in rows} | {row.routing_name for row in rows}
        # any other routing the grid names (psr_lam0.3_n1_d2, cp_lam0.3_a, ...), at every capacity
        named = {name: routing_from_name(name) for name in sorted(wanted - known)}
        rows += [routed(OFFLOAD, fields, residency) for residency in capacities
                 for fields in named.values() if fields is not None]
        known |= {name for name, fields in named.items() if fields is not None}
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"--configs: unknown {', '.join(unknown)}; allowed: {', '.join(sorted(known))}, or any "
                             "routing the grid names (psr_lam0.3_n1_d2: psr_hf.eval.grid)"
                             + ("" if accelerate else " (accelerate is off: --no-accelerate)"))
        rows = [row for row in rows if row.kind == RESIDENT or _named(row, wanted)]
    if hf_only is not None and not engine:
        raise ValueError("hf_only (--hf-configs) selects the transformers rows kept beside the engine rows; it needs "
                         "engine=True (--engine)")
    if engine:
        offloaded = [row for row in rows if row.kind == OFFLOAD]
        if hf_only is not None:
            keep = _wanted(hf_only)
            unknown = sorted(keep - ({row.name for row in offloaded} | {row.routing_name for row in offloaded}))
            if unknown:
                raise ValueError(f"--hf-configs: unknown {', '.join(unknown)}; allowed: the routed rows "
                                 f"{', '.join(row.name for row in offloaded)} or their policy names")
            rows = [row for row in rows if row.kind != OFFLOAD or _named(row, keep)]
        rows.append(Row(ENGINE_RESIDENT))
        rows += [row.replace(kind=ENGINE) for row in offloaded]
        # copies skipped, for every routed row: its physical bound's compute part, the host's time without copies,
        # OFF (exact_lru's) and PRED0 (SpecPrefetch's: prediction and control, no transfers)
        rows += [row.replace(kind=ENGINE, copies_skipped=True) for row in offloaded]
    return rows
