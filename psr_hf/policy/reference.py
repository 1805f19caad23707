"""Slow, obviously correct pure-Python reference of the logical-cache routing policy.

This module transcribes ``docs/ALGORITHM.md`` rule by rule, with plain loops, sets and ``sorted()`` with explicit
keys, so that it can be read against the spec line by line. The jitted kernels are tested against it on random
traces (docs/policy.md); speed is not a goal here. :class:`ReferenceLayerState` is one (row, layer) and its
:meth:`~ReferenceLayerState.step`; :func:`reference_replay` gives every decision of one batch row.

All policy arithmetic is done in Python floats (float64). numpy inputs are accepted only at the boundary: they
are converted with ``.tolist()`` / ``float()`` before any rule runs, so float32 scores become the exactly equal
float64 values.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

POLICIES = ("exact", "cache_prior", "psr", "spec")
EVICTIONS = ("score", "lru")
DELTA_MODES = ("fixed", "running")

# Policies whose selection adds the routing bonus z + lam * d * m (ALGORITHM.md, "Policies").
_BIASED_POLICIES = ("cache_prior", "psr")


# ---------------------------------------------------------------------------------------------------- helpers
def _floats(values: Any) -> list[float]:
    """A 1-D sequence (list, tuple or numpy array) as a list of Python floats (float64)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


def ranking(values: Sequence[float]) -> list[int]:
    """Indices of ``values`` by descending value, ties to the lower index (ALGORITHM.md ``ranking(v)``).

    ``-inf`` entries sort last (among themselves by index). NaN is not expected and not handled.
    """
    return sorted(range(len(values)), key=lambda e: (-values[e], e))


def topk(values: Sequence[float], k: int) -> list[int]:
    """``ranking(values)[:k]``: the ``k`` largest entries, in rank order."""
    return ranking(values)[:k]


def _argmin_priority(candidates: set[int], priority: Sequence[float]) -> int:
    """The expert to evict from ``candidates``: smallest priority, ties to the lower index."""
    return min(candidates, key=lambda e: (priority[e], e))


def _finite_range(z: Sequence[float]) -> float:
    """``max z - min z`` over the finite entries of ``z`` (masked experts are ``-inf``).

    A row without any finite entry cannot come from a real router; it contributes a range of 0.0 rather than
    raising, so that it cannot poison the running mean with inf/NaN.
    """
    finite = [v for v in z if math.isfinite(v)]
    if not finite:
        return 0.0
    return max(finite) - min(finite)


# ---------------------------------------------------------------------------------------------------- results
@dataclass
class ReferenceStep:
    """One (token, layer) decision.

    ``selected``: S in selection order (rank order of the biased score for cache_prior/psr; ``ranking(g)``
    order for spec at ``l >= 1``; ``topk(z, K)`` order for exact and for spec at ``l = 0``).
    ``prefetch``: prefetch insertions of part 1 in order, as ``(expert, evicted expert or -1 if R was not full)``.
    ``demand``: demand insertions of step 5 in order, as ``(expert, evicted expert or -1 if R was not full)``.
    """

    selected: list[int]
    prefetch: list[tuple[int, int]]
    demand: list[tuple[int, int]]


# ---------------------------------------------------------------------------------------------------- state
class ReferenceLayerState:
    """State of one (row, layer): resident set R, s_fast, s_slow, last_use, running range sum/count, step.

    Attributes (read them freely; :meth:`step` is the only thing that changes them):

    - ``resident``: set[int], the logical resident set R (at most ``capacity`` experts)
    - ``s_fast``, ``s_slow``: list[float] of length E, EMAs of "the router's own top-K contains e"
    - ``last_use``: list[int] of length E, the step at which e was last selected or prefetch-inserted (-1: never)
    - ``range_sum`` (float), ``range_count`` (int): running sum and count of ``max z - min z`` (finite entries)
    - ``step_count``: int, steps taken by this layer since the reset
    """

    def __init__(self, num_experts: int, capacity: int, expert_counts: Sequence[float]):
        """Reset per ALGORITHM.md: R = the ``capacity`` experts with the largest ``expert_counts`` (ties to the
        lower index), statistics zero, ``last_use = -1``, running range and step counter zero.

        ``expert_counts``: E numbers (this layer's row of the calibration's ``expert_counts``).
        """
        counts = _floats(expert_counts)
        if len(counts) != num_experts:
            raise ValueError(f"expert_counts has {len(counts)} entries; expected num_experts={num_experts}")
        if not 1 <= capacity <= num_experts:
            raise ValueError(f"capacity={capacity} must be in [1, num_experts={num_experts}]")
        self.num_experts = int(num_experts)
        self.capacity = int(capacity)
        self.resident: set[int] = set(topk(counts, self.capacity))
        self.s_fast: list[float] = [0.0] * self.num_experts
        self.s_slow: list[float] = [0.0] * self.num_experts
        self.last_use: list[int] = [-1] * self.num_experts
        self.range_sum: float = 0.0
        self.range_count: int = 0
        self.step_count: int = 0

    def __repr__(self) -> str:
        return (
            f"ReferenceLayerState(resident={sorted(self.resident)}, step_count={self.step_count}, "
            f"range_sum={self.range_sum}, range_count={self.range_count})"
        )

    # ------------------------------------------------------------------------------------------------ one step
    def step(
        self,
        *,
        policy: str,
        top_k: int,
        lam: float,
        budget: int,
        window: int,
        eviction: str,
        top_j: int,
        delta_mode: str,
        decay_fast: float,
        decay_slow: float,
        delta: float,
        z: Sequence[float],
        g: Sequence[float] | None,
        prior: Sequence[float],
        layer: int,
    ) -> ReferenceStep:
        """One step of ALGORITHM.md ("One step (token t, layer l)") for this layer; updates the state in place.

        In: the config values; ``delta`` = the calibration's ``delta[l]`` (read only when
        ``delta_mode == "fixed"``); ``z`` = selection scores [E] (may hold ``-inf``, never NaN); ``g`` = the
        pre-gate scores [E], or None where there is none (layer 0); ``prior`` = ``token_prior[x[t], l, :]`` [E];
        ``layer`` = the MoE-layer index ``l`` (part 1 runs only at ``l >= 1``).
        Out: the :class:`ReferenceStep` with S, the prefetch insertions and the demand insertions.

        For ``spec`` the budget and window are ``top_k`` whatever was passed. Part 1 runs for ``spec``, for
        ``psr`` and ``exact`` only when ``budget > 0``, never for ``cache_prior``; it also needs ``g``.
        """
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}; allowed: {POLICIES}")
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction={eviction!r}; allowed: {EVICTIONS}")
        if delta_mode not in DELTA_MODES:
            raise ValueError(f"delta_mode={delta_mode!r}; allowed: {DELTA_MODES}")
        num_experts = self.num_experts
        k = int(top_k)
        if not 1 <= k <= self.capacity:
            raise ValueError(f"top_k={k} must be in [1, capacity={self.capacity}]")
        z = _floats(z)
        g = None if g is None else _floats(g)
        prior = _floats(prior)
        if len(z) != num_experts or len(prior) != num_experts or (g is not None and len(g) != num_experts):
            raise ValueError(f"z, g and prior must each have num_experts={num_experts} entries")
        lam = float(lam)
        budget = int(budget)
        window = int(window)
        top_j = int(top_j)
        if policy == "spec":
            # ALGORITHM.md: spec runs part 1 "with budget K and window K".
            budget = k
            window = k

        # 1. Priority, computed once before any insertion (so insertions in this step do not change it).
        if eviction == "score":
            priority: list[float] = [(self.s_fast[e] + self.s_slow[e]) + prior[e] for e in range(num_experts)]
        else:  # lru
            priority = [float(self.last_use[e]) for e in range(num_experts)]

        # 2. Part 1, insertion from the pre-gate ranking.
        protected: list[int] = []  # B: candidates visited so far (resident or newly inserted), in visit order
        prefetch: list[tuple[int, int]] = []
        # With budget 0 there is no part 1 at all (no insertion, and no protected set B): ALGORITHM.md's closing
        # rule makes psr with LRU, budget 0 and top_j 0 Cache-Prior decision for decision.
        if policy == "spec":
            runs_part1 = True
        elif policy in ("psr", "exact"):
            runs_part1 = budget > 0
        else:  # cache_prior never inserts
            runs_part1 = False
        if layer < 1 or g is None:
            # There is no pre-gate at layer 0 (and none was given here), so nothing to scan.
            runs_part1 = False
        if runs_part1:
            new = 0
            for e in ranking(g)[:window]:
                if e in self.resident:
                    protected.append(e)
                elif new < budget:
                    victim = -1
                    if len(self.resident) == self.capacity:
                        candidates = self.resident - set(protected)
                        if not candidates:
                            # Every resident expert is protected: "stop part 1". (Continuing could not change
                            # anything either: later residents are already in B, later non-residents would meet
                            # the same empty set.)
                            break
                        victim = _argmin_priority(candidates, priority)
                        self.resident.remove(victim)
                    self.resident.add(e)
                    protected.append(e)
                    new += 1
                    prefetch.append((e, victim))
                # else: budget spent and e not resident. Keep scanning, so that resident candidates further down
                # the window still join B.
        protected_set = set(protected)

        # 3. Bonus scale. The running range is a statistic of the token's scores, so it is updated at every step
        # of every policy (step 3 is not limited to the biased policies), the current token included.
        self.range_sum += _finite_range(z)
        self.range_count += 1
        if delta_mode == "fixed":
            d = float(delta)
        else:
            d = self.range_sum / self.range_count

        # 4. Selection.
        if policy in _BIASED_POLICIES:
            m = [1 if e in self.resident else 0 for e in range(num_experts)]
            if top_j > 0:
                # Top-J protection: the router's own top-J get the bonus as if they were resident.
                for e in topk(z, top_j):
                    m[e] = 1
            biased = [float(z[e]) + lam * d * m[e] for e in range(num_experts)]
            # Largest biased score first; ties toward the larger raw z (the router's own order), then lower index.
            selected = sorted(range(num_experts), key=lambda e: (-biased[e], -z[e], e))[:k]
        elif policy == "spec" and layer >= 1 and g is not None:
            # Speculative execution: run the pre-gate's prediction instead of the router's choice.
            selected = topk(g, k)
        else:
            # exact, and spec at layer 0 (no pre-gate): the model's own top-K.
            selected = topk(z, k)
        selected_set = set(selected)

        # 5. Demand insertions, in ascending expert index. Victims spare S (must run now) and, while any other
        # candidate exists, B (just visited or prefetched in part 1).
        demand: list[tuple[int, int]] = []
        for e in sorted(x for x in selected if x not in self.resident):
            victim = -1
            if len(self.resident) == self.capacity:
                candidates = self.resident - (selected_set | protected_set)
                if not candidates:
                    candidates = self.resident - selected_set
                # Non-empty: |S| = K <= C = |R| and e in S is not resident, so R \ S has an element.
                victim = _argmin_priority(candidates, priority)
                self.resident.remove(victim)
            self.resident.add(e)
            demand.append((e, victim))

        # 6. Execution (weights from unmodified scores) is not the policy's business here.

        # 7. Statistics from the router's own top-K, never from S, so the bias cannot reinforce itself.
        own_set = set(topk(z, k))
        for e in range(num_experts):
            own = 1.0 if e in own_set else 0.0
            self.s_fast[e] = decay_fast * self.s_fast[e] + (1 - decay_fast) * own
            self.s_slow[e] = decay_slow * self.s_slow[e] + (1 - decay_slow) * own
        for e in selected:
            self.last_use[e] = self.step_count
        for e, _victim in prefetch:
            self.last_use[e] = self.step_count
        self.step_count += 1

        return ReferenceStep(selected=list(selected), prefetch=prefetch, demand=demand)


# ---------------------------------------------------------------------------------------------------- replay
@dataclass
class ReferenceReplay:
    """Every decision of one batch row.

    ``selected``: [T][L][K], each sorted ascending. ``prefetch_copies`` / ``demand_copies``: [T][L] counts of
    prefetch / demand insertions. ``steps``: [T][L] full decisions. ``final_states``: the state of each layer
    after the last token.
    """

    selected: list[list[list[int]]]
    prefetch_copies: list[list[int]]
    demand_copies: list[list[int]]
    steps: list[list[ReferenceStep]]
    final_states: list[ReferenceLayerState]


def _prior_lookup(token_prior: Any, num_experts: int) -> Callable[[int, int], list[float]]:
    """A function ``(token, layer) -> E floats`` for any accepted form of ``token_prior``.

    A dense array is indexed per lookup (never converted whole: OLMoE's would be 51M Python floats).
    """
    if token_prior is None:
        return lambda token, layer: [0.0] * num_experts
    if callable(token_prior):
        return lambda token, layer: _floats(token_prior(token, layer))
    return lambda token, layer: _floats(token_prior[token][layer])


def reference_replay(
    *,
    policy: str,
    top_k: int,
    capacity: int,
    lam: float,
    budget: int,
    window: int,
    eviction: str,
    top_j: int,
    delta_mode: str,
    decay_fast: float,
    decay_slow: float,
    scores: Any,
    pregate: Any,
    tokens: Any,
    delta: Any,
    expert_counts: Any,
    token_prior: Any,
    prefetch_distance: int = 1,
) -> ReferenceReplay:
    """One batch row.

    scores, pregate: [T][L][E] (nested lists or numpy float32 arrays); pregate[:, l] is unused for
    ``l < prefetch_distance`` (no pre-gate there: the pre-gate of layer l is router l on the input of layer
    ``l - prefetch_distance``); ``pregate=None`` means no pre-gate anywhere (part 1 never runs, spec executes the
    own top-K).
    tokens: [T] ints. delta: [L] floats (used when delta_mode == "fixed"). expert_counts: [L][E].
    token_prior: callable (token:int, layer:int) -> sequence of E floats, or a dense [V][L][E] array/list, or
    None (zero prior).
    Returns a :class:`ReferenceReplay`. Every layer starts from the reset state; tokens are processed in order.
    """
    scores = scores.tolist() if hasattr(scores, "tolist") else scores
    if pregate is not None and hasattr(pregate, "tolist"):
        pregate = pregate.tolist()
    tokens = [int(x) for x in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]
    delta = _floats(delta)
    expert_counts = [_floats(row) for row in (expert_counts.tolist() if hasattr(expert_counts, "tolist") else expert_counts)]

    num_tokens = len(scores)
    if len(tokens) != num_tokens:
        raise ValueError(f"tokens has {len(tokens)} entries; scores has {num_tokens} tokens")
    num_layers = len(expert_counts)
    num_experts = len(expert_counts[0]) if num_layers else 0
    if len(delta) != num_layers:
        raise ValueError(f"delta has {len(delta)} entries; expert_counts has {num_layers} layers")
    prior_of = _prior_lookup(token_prior, num_experts)

    states = [ReferenceLayerState(num_experts, capacity, expert_counts[l]) for l in range(num_layers)]
    result = ReferenceReplay(selected=[], prefetch_copies=[], demand_copies=[], steps=[], final_states=states)
    for t in range(num_tokens):
        if len(scores[t]) != num_layers:
            raise ValueError(f"scores[{t}] has {len(scores[t])} layers; expected {num_layers}")
        row_steps: list[ReferenceStep] = []
        for l in range(num_layers):
            g = pregate[t][l] if (pregate is not None and l >= prefetch_distance) else None
            row_steps.append(
                states[l].step(
                    policy=policy,
                    top_k=top_k,
                    lam=lam,
                    budget=budget,
                    window=window,
                    eviction=eviction,
                    top_j=top_j,
                    delta_mode=delta_mode,
                    decay_fast=decay_fast,
                    decay_slow=decay_slow,
                    delta=delta[l],
                    z=scores[t][l],
                    g=g,
                    prior=prior_of(tokens[t], l),
                    layer=l,
                )
            )
        result.steps.append(row_steps)
        result.selected.append([sorted(s.selected) for s in row_steps])
        result.prefetch_copies.append([len(s.prefetch) for s in row_steps])
        result.demand_copies.append([len(s.demand) for s in row_steps])
    return result
