"""The change-based gate of the paper's Section 6.10 on the logical cache (psr_hf.policy.margins).

An independent implementation of the gate, written from the paper's text: each MoE layer keeps a persistent
active set of C experts; a token runs the K best members by score, and an expert outside the set is swapped in
only when its score exceeds the weakest selected member's by the margin; swapped-in experts join the set, which
then drops its least recently used members that the token does not run (spec/ALGORITHM.md's LRU and tie rules).
With one margin for every token it must make Cache-Prior's decisions (Equation 1 on a model-defined cache, the
paper's numerical check); with a margin per token, the policy kernels fed the scaled scores must make its
decisions.
"""

from __future__ import annotations

import numpy as np
import pytest

from psr_hf.policy import RoutingConfig, replay
from psr_hf.policy.calibration import Calibration
from psr_hf.policy.margins import margin_scale, margin_scores


def _better(z: np.ndarray, e: int, f: int) -> bool:
    """Score order of two experts on the same side of the set: the larger score, ties to the lower index."""
    return z[e] > z[f] or (z[e] == z[f] and e < f)


def swap_gate(z: np.ndarray, margins: np.ndarray, expert_counts: np.ndarray, capacity: int, top_k: int) -> np.ndarray:
    """``z [T, L, E]``, ``margins [T, L]``: the executed experts ``[T, L, K]`` (ascending)."""
    T, L, E = z.shape
    out = np.zeros((T, L, top_k), dtype=np.int64)
    for layer in range(L):
        warm = sorted(range(E), key=lambda e: (-expert_counts[layer, e], e))[:capacity]
        active = set(warm)
        last_use = {e: -1 for e in range(E)}
        for t in range(T):
            s = z[t, layer].astype(np.float64)
            mu = float(margins[t, layer])
            members = sorted(active, key=lambda e: (-s[e], e))
            chosen = members[:top_k]
            outside = sorted(set(range(E)) - active, key=lambda e: (-s[e], e))
            for e in outside:  # best outsider first, against the weakest member still chosen
                kept = [f for f in chosen if f in active]
                if not kept:
                    break
                weakest = kept[0]
                for f in kept[1:]:
                    if _better(s, weakest, f):
                        weakest = f
                # an outsider whose score ties the member's biased score is preferred (ties toward the raw score)
                if s[e] >= s[weakest] + mu:
                    chosen[chosen.index(weakest)] = e
                else:
                    break
            for e in sorted(set(chosen) - active):
                if len(active) == capacity:
                    candidates = sorted(active - set(chosen))
                    victim = min(candidates, key=lambda f: (last_use[f], f))
                    active.remove(victim)
                active.add(e)
            for e in chosen:
                last_use[e] = t
            out[t, layer] = sorted(chosen)
    return out


@pytest.fixture(scope="module")
def trace():
    rng = np.random.default_rng(7)
    T, L, E = 48, 3, 16
    # router-like scores: a drifting per-layer preference plus per-token noise, so the set changes now and then
    drift = np.cumsum(rng.normal(0, 0.3, size=(T, L, E)), axis=0)
    z = (drift + rng.normal(0, 1.0, size=(T, L, E))).astype(np.float32)
    counts = rng.integers(0, 100, size=(L, E)).astype(np.float64)
    delta = np.full(L, 4.0)
    return z, Calibration.from_arrays(delta=delta, expert_counts=counts)


@pytest.mark.parametrize("capacity,lam", [(6, 0.25), (8, 0.1), (4, 0.6)])
def test_one_margin_for_every_token_is_cache_prior_decision_for_decision(trace, capacity, lam):
    z, cal = trace
    T, L, E = z.shape
    margins = np.broadcast_to(lam * cal.delta, (T, L))
    gate = swap_gate(z, margins, cal.expert_counts, capacity, top_k=2)
    prior = replay(RoutingConfig(policy="cache_prior", capacity=capacity, lam=lam, eviction="lru"), z,
                   tokens=np.zeros(z.shape[0], dtype=np.int64), calibration=cal, top_k=2)
    assert np.array_equal(gate, prior.selected)
    exact = replay(RoutingConfig(policy="exact", capacity=capacity), z, tokens=np.zeros(z.shape[0], dtype=np.int64),
                   calibration=cal, top_k=2)
    assert not np.array_equal(gate, exact.selected)  # the margin does change what runs


def test_a_margin_per_token_runs_through_the_kernels_on_scaled_scores(trace):
    z, cal = trace
    T, L, E = z.shape
    lam = 0.3
    rng = np.random.default_rng(3)
    # powers of two relative to lam * delta: the scaled scores are exact, so decisions must agree exactly
    margins = lam * cal.delta * 2.0 ** rng.integers(-3, 3, size=(T, L))
    gate = swap_gate(z, margins, cal.expert_counts, 6, top_k=2)
    scaled = margin_scores(z, margins, lam, cal.delta)
    kernels = replay(RoutingConfig(policy="cache_prior", capacity=6, lam=lam, eviction="lru"), scaled,
                     tokens=np.zeros(z.shape[0], dtype=np.int64), calibration=cal, top_k=2)
    assert np.array_equal(gate, kernels.selected)
    uniform = swap_gate(z, np.broadcast_to(lam * cal.delta, (T, L)), cal.expert_counts, 6, top_k=2)
    assert not np.array_equal(gate, uniform)  # per-token margins are not the uniform rule
    # scaling keeps each token's own top-K (the statistics and the exact fallback read it)
    own = np.argsort(-z, axis=-1, kind="stable")[..., :2]
    assert np.array_equal(np.sort(own, -1), np.sort(np.argsort(-scaled, axis=-1, kind="stable")[..., :2], -1))


def test_bad_margins_are_refused_with_the_fix():
    delta = np.array([2.0, 3.0])
    with pytest.raises(ValueError, match="lam > 0"):
        margin_scale(np.ones(2), 0.0, delta)
    with pytest.raises(ValueError, match="one margin per MoE layer"):
        margin_scale(np.ones(3), 0.3, delta)
    with pytest.raises(ValueError, match="calibrate"):
        margin_scale(np.ones(2), 0.3, np.array([2.0, 0.0]))
    with pytest.raises(ValueError, match="finite"):
        margin_scale(np.array([1.0, np.nan]), 0.3, delta)
    with pytest.raises(ValueError, match="leading axes"):
        margin_scores(np.zeros((4, 2, 8)), np.ones((3, 2)), 0.3, delta)
    assert margin_scale(np.array([0.6, 0.9]), 0.3, delta) == pytest.approx([1.0, 1.0])
