"""The routing grid of the paper's experiments: routing configurations without a residency, named from their fields.

A grid entry is the dict of :class:`~psr_hf.policy.RoutingConfig` fields the constructors here build
(:func:`exact_lru`, :func:`exact_a_pf`, :func:`cache_prior`, :func:`psr`, :func:`spec`, :func:`prefetch_only`).
:func:`routing_name` derives an entry's name (``exact_lru``, ``cp_lam0.2_a_j2_run``, ``psr_lam0.3_n1_lru_pred``,
``psr_lam0.2_n1_w2``, ``specprefetch_m2``, ...) and :func:`routing_from_name` is its inverse: the one place a name is read back (records
and the rows of the goals carry names only). :func:`routing_grid` keys entries by their names. The divergence
(``psr-hf kl``), the latency bench and the sweep (:mod:`psr_hf.bench.rows`) build their configurations here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..policy.config import MAX_EXPERTS, RoutingConfig
from ..policy.policies import POLICY_TABLE

# the name stems of the prefetch-only entries by prefetch source: SpecPrefetch (a learned predictor's ranking) and
# Naive Prefetch (the previous token's scores); their names end in m<budget>
PREFETCH_STEMS = {"predictor": "specprefetch_", "previous": "naive_"}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RoutingConfig)}  # what an entry leaves unset


def exact_lru() -> dict[str, Any]:
    """Exact routing with LRU eviction and no prefetch (the paper's exact+LRU, SpecPrefetch's OFF)."""
    return dict(policy="exact", eviction="lru", budget=0)


def exact_a_pf() -> dict[str, Any]:
    """Exact routing with the A priority (score eviction) and a logical prefetch budget of 1."""
    return dict(policy="exact", eviction="score", budget=1)


def cache_prior(lam: float, *, eviction: str = "lru", top_j: int = 0, running: bool = False) -> dict[str, Any]:
    """Cache-Prior at ``lam``; ``top_j`` protects the router's top J (the published variant, ``running``: its
    running bonus scale)."""
    fields: dict[str, Any] = dict(policy="cache_prior", lam=float(lam), eviction=eviction)
    if top_j:
        fields["top_j"] = top_j
    else:
        fields["budget"] = 0
    if running:
        fields["delta_mode"] = "running"
    return fields


def psr(lam: float, budget: int, *, eviction: str = "score", predictor: bool = False,
        window: int | None = None, distance: int = 1) -> dict[str, Any]:
    """PSR at ``lam`` with prefetch budget ``budget``; ``predictor``: the pre-gate is a learned predictor's ranking;
    ``window``: the pre-gate candidates ranked per step (None: the architecture's default, as the paper's main
    rows; Qwen3.6's also times 2); ``distance``: the prefetch distance (``_d2``: each layer's prefetches ranked
    two MoE layers ahead)."""
    return dict(policy="psr", lam=float(lam), eviction=eviction, budget=budget,
                **({"prefetch": "predictor"} if predictor else {}), **({"window": window} if window else {}),
                **({"prefetch_distance": distance} if distance != 1 else {}))


def spec() -> dict[str, Any]:
    """Speculative execution of the pre-gate's top-K."""
    return dict(policy="spec")


def prefetch_only(budget: int, source: str) -> dict[str, Any]:
    """Exact routing with at most ``budget`` prefetches per layer and token over every expert, ranked by ``source``
    (``predictor``: SpecPrefetch; ``previous``: Naive Prefetch)."""
    return dict(policy="exact", eviction="score", budget=budget, window=MAX_EXPERTS, prefetch=source)


def routing_name(config: RoutingConfig) -> str:
    """The grid's name of ``config`` (its residency or capacity aside), which starts with its policy's paper stem
    (``Policy.paper``); ``ValueError`` for a configuration the grid does not name."""
    c = config
    entry = c.definition
    plain = (c.decay_fast, c.decay_slow) == (_DEFAULTS["decay_fast"], _DEFAULTS["decay_slow"])
    name = _paper_name(c) if plain and entry.paper is not None else None
    if name is None:
        raise ValueError(f"the routing grid has no name for {c}; build grid entries with psr_hf.eval.grid's "
                         f"constructors")
    return name


def _paper_name(c: RoutingConfig) -> str | None:
    """The grid's name of ``c``, a configuration of one of the paper's policies with the default decays; None where
    the grid has none."""
    entry = c.definition
    stem = entry.paper.stem
    pregate = c.prefetch == _DEFAULTS["prefetch"]
    unbiased = c.top_j == 0 and c.delta_mode == _DEFAULTS["delta_mode"]
    near = c.prefetch_distance == 1  # only psr's names carry a distance (_d2)
    if unbiased and near and entry.follows_router:
        if pregate and c.window is None and (c.eviction, c.budget) == ("lru", 0):
            return f"{stem}_lru"
        if pregate and c.window is None and (c.eviction, c.budget) == ("score", 1):
            return f"{stem}_a_pf"
        if c.prefetch in PREFETCH_STEMS and c.eviction == "score" and c.window == MAX_EXPERTS and c.budget >= 1:
            return f"{PREFETCH_STEMS[c.prefetch]}m{c.budget}"
    if pregate and entry.biased and not entry.can_prefetch:
        return (f"{stem}_lam{c.lam:g}" + "_a" * (c.eviction == "score") + (f"_j{c.top_j}" if c.top_j else "")
                + "_run" * (c.delta_mode == "running"))
    if unbiased and entry.biased and entry.can_prefetch and c.prefetch in ("pregate", "predictor"):
        return (f"{stem}_lam{c.lam:g}_n{c.budget}" + (f"_w{c.window}" if c.window is not None else "")
                + "_lru" * (c.eviction == "lru") + "_pred" * (c.prefetch == "predictor")
                + (f"_d{c.prefetch_distance}" if not near else ""))
    if unbiased and pregate and entry.executes_pregate and c.window is None:
        return stem
    return None


def entry_name(fields: Mapping[str, Any]) -> str:
    """:func:`routing_name` of a grid entry (validated as a configuration at residency 0.5)."""
    return routing_name(RoutingConfig(residency=0.5, **fields))


_STEMS = {name: entry.paper.stem for name, entry in POLICY_TABLE.items() if entry.paper is not None}
_NAMES = (
    (re.compile(rf"{_STEMS['exact']}_lru"), lambda m: exact_lru()),
    (re.compile(rf"{_STEMS['exact']}_a_pf"), lambda m: exact_a_pf()),
    (re.compile(_STEMS["spec"]), lambda m: spec()),
    *((re.compile(rf"{stem}m(\d+)"), lambda m, source=source: prefetch_only(int(m[1]), source))
      for source, stem in PREFETCH_STEMS.items()),
    (re.compile(rf"{_STEMS['cache_prior']}_lam([0-9.e+-]+)(_a)?(?:_j(\d+))?(_run)?"),
     lambda m: cache_prior(float(m[1]), eviction="score" if m[2] else "lru", top_j=int(m[3] or 0),
                           running=bool(m[4]))),
    (re.compile(rf"{_STEMS['psr']}_lam([0-9.e+-]+)_n(\d+)(?:_w(\d+))?(_lru)?(_pred)?(?:_d(\d+))?"),
     lambda m: psr(float(m[1]), int(m[2]), eviction="lru" if m[4] else "score", predictor=bool(m[5]),
                   window=int(m[3]) if m[3] else None, distance=int(m[6] or 1))),
)


def routing_from_name(name: str) -> dict[str, Any] | None:
    """The grid entry that :func:`routing_name` names ``name``, or None where no entry has that name."""
    for pattern, build in _NAMES:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        try:
            fields = build(match)
            return fields if entry_name(fields) == name else None
        except ValueError:
            return None
    return None


def prefetch_source_named(name: str) -> str | None:
    """The prefetch source that a requested row name (``--configs``) starts with: ``predictor`` for
    ``specprefetch_*``, ``previous`` for ``naive_*``, else None; any budget, known or not yet."""
    return next((source for source, stem in PREFETCH_STEMS.items() if name.startswith(stem)), None)


def routing_grid(entries: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> entry for ``entries``, each validated and named by :func:`entry_name`, in the given order (an entry
    whose name is taken replaces the earlier one in its place, as dict keys do)."""
    grid: dict[str, dict[str, Any]] = {}
    for fields in entries:
        grid[entry_name(fields)] = dict(fields)
    return grid
