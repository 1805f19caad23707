"""The numba kernels against the pure-Python reference, decision for decision, on many random traces; a parallel
replay leaves torch's thread count as it was."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.policy import Calibration, LogicalCache, RoutingConfig, replay
from psr_hf.policy.reference import reference_replay
from psr_hf.policy.traces import calibration_from_trace, synthetic_trace

# every policy and option
OPTION_SETS = [
    ("exact", {}),
    ("exact", dict(eviction="score")),
    ("exact", dict(budget=1, eviction="score")),
    ("exact", dict(budget=3, eviction="lru", window=5)),
    ("cache_prior", {}),
    ("cache_prior", dict(eviction="score", lam=0.5)),
    ("cache_prior", dict(top_j=2, delta_mode="running")),
    ("psr", {}),
    ("psr", dict(lam=0.3, budget=2, window=4)),
    ("psr", dict(eviction="lru", top_j=1)),
    ("psr", dict(budget=0)),
    ("psr", dict(delta_mode="running", lam=1.0, decay_fast=0.7, decay_slow=0.9)),
    ("spec", {}),
    ("spec", dict(eviction="lru")),
    ("psr", dict(lam=0.3, budget=2, window=4, prefetch_distance=2)),
    ("exact", dict(budget=2, eviction="score", window=3, prefetch_distance=2)),
]


def _reference(config: RoutingConfig, K: int, trace, cal: Calibration):
    return reference_replay(
        policy=config.policy, top_k=K, capacity=config.capacity_for(trace.scores.shape[2], K), lam=config.lam,
        budget=config.budget_for(K), window=config.window_for(K), eviction=config.eviction, top_j=config.top_j,
        delta_mode=config.delta_mode, decay_fast=config.decay_fast, decay_slow=config.decay_slow,
        scores=trace.scores, pregate=trace.pregate, tokens=trace.tokens, delta=cal.delta,
        expert_counts=cal.expert_counts, token_prior=cal.prior, prefetch_distance=config.prefetch_distance,
    )


def _kernel_steps(config: RoutingConfig, K: int, trace, cal: Calibration):
    T, L, E = trace.scores.shape
    cache = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, calibration=cal)
    plans = []
    for layer in range(L):
        g = trace.pregate[None, :, layer] if layer >= 1 else None
        plans.append(cache.step(layer, trace.scores[None, :, layer], g, trace.tokens[None]))
    return cache, plans


def _assert_same_decisions(config, K, trace, cal):
    ref = _reference(config, K, trace, cal)
    cache, plans = _kernel_steps(config, K, trace, cal)
    T, L, _ = trace.scores.shape
    for layer in range(L):
        plan = plans[layer]
        for t in range(T):
            step = ref.steps[t][layer]
            where = f"{config} token {t} layer {layer}"
            assert plan.selected[0, t].tolist() == step.selected, where
            n_pf = int(plan.prefetch_count[0, t])
            assert list(zip(plan.prefetch_experts[0, t, :n_pf].tolist(),
                            plan.prefetch_evicted[0, t, :n_pf].tolist())) == step.prefetch, where
            n_d = int(plan.demand_count[0, t])
            assert list(zip(plan.demand_experts[0, t, :n_d].tolist(),
                            plan.demand_evicted[0, t, :n_d].tolist())) == step.demand, where
        assert cache.resident(layer).tolist() == sorted(ref.final_states[layer].resident)
    result = replay(config, trace.scores, trace.pregate, trace.tokens, cal, K)
    np.testing.assert_array_equal(result.selected, np.array(ref.selected))
    np.testing.assert_array_equal(result.prefetch_copies, np.array(ref.prefetch_copies))
    np.testing.assert_array_equal(result.demand_copies, np.array(ref.demand_copies))


def _capacities(E: int, K: int) -> list[int]:
    return sorted({K, K + 1, (K + E) // 2, E - 1, E} - {E + 1} if E > K else {K})


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("E,K", [(16, 2), (16, 4), (64, 6), (64, 8)])
def test_kernel_matches_reference_on_random_traces(seed, E, K):
    V = 40
    trace = synthetic_trace(40, 3, E, vocab_size=V, seed=seed, locality=0.6 + 0.1 * seed)
    cal = calibration_from_trace(synthetic_trace(200, 3, E, vocab_size=V, seed=seed + 50), K, V)
    for C, (policy, kw) in itertools.product(_capacities(E, K), OPTION_SETS):
        _assert_same_decisions(RoutingConfig(policy=policy, capacity=C, **kw), K, trace, cal)


@pytest.mark.parametrize("K", [2, 8])
def test_kernel_matches_reference_with_256_experts(K):
    E, V = 256, 30
    trace = synthetic_trace(24, 2, E, vocab_size=V, seed=7)
    cal = calibration_from_trace(synthetic_trace(100, 2, E, vocab_size=V, seed=8), K, V)
    two_layers = [(policy, kw) for policy, kw in OPTION_SETS[::2] if kw.get("prefetch_distance", 1) < 2]
    for C, (policy, kw) in itertools.product([K, 64, E], two_layers):
        _assert_same_decisions(RoutingConfig(policy=policy, capacity=C, **kw), K, trace, cal)


def _tied_trace(seed: int, T: int, L: int, E: int, V: int):
    """Scores on a coarse grid, so biased scores tie and tie-breaking decides."""
    base = synthetic_trace(T, L, E, vocab_size=V, seed=seed)
    scores = (np.round(base.scores * 2) / 2).astype(np.float32)
    pregate = (np.round(base.pregate * 2) / 2).astype(np.float32)
    return type(base)(scores, pregate, base.tokens)


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_reference_when_scores_tie(seed):
    E, K, V = 16, 4, 20
    trace = _tied_trace(seed, 50, 3, E, V)
    # delta 0.5 and lam 1: the bonus equals the grid step, so biased scores of residents tie with others
    cal = Calibration.from_arrays(delta=np.full(3, 0.5), expert_counts=np.ones((3, E)))
    for C, (policy, kw) in itertools.product([4, 8], OPTION_SETS):
        if "lam" not in kw and policy in ("cache_prior", "psr"):
            kw = dict(kw, lam=1.0)
        _assert_same_decisions(RoutingConfig(policy=policy, capacity=C, **kw), K, trace, cal)


def test_kernel_matches_reference_with_group_masked_scores():
    """DeepSeek-V3 selection scores: experts outside the kept groups are -inf."""
    E, K, V, groups, kept = 32, 4, 20, 8, 3
    base = synthetic_trace(40, 3, E, vocab_size=V, seed=3)
    scores = base.scores.copy()
    pregate = base.pregate.copy()
    for arr in (scores, pregate):
        grouped = arr.reshape(40, 3, groups, E // groups)
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # top-2 per group, as DeepSeek-V3
        drop = np.argsort(-group_score, axis=-1, kind="stable")[..., kept:]
        np.put_along_axis(grouped, drop[..., None].repeat(E // groups, -1), -np.inf, axis=-2)
    trace = type(base)(scores, pregate, base.tokens)
    cal = calibration_from_trace(synthetic_trace(200, 3, E, vocab_size=V, seed=4), K, V)
    for C, (policy, kw) in itertools.product([4, 16], OPTION_SETS):
        _assert_same_decisions(RoutingConfig(policy=policy, capacity=C, **kw), K, trace, cal)


@pytest.mark.parametrize("policy,kw", OPTION_SETS)
def test_prefetch_then_select_equals_step(policy, kw):
    E, K, L, T, V = 16, 4, 3, 30, 25
    trace = synthetic_trace(T, L, E, vocab_size=V, seed=11)
    cal = calibration_from_trace(synthetic_trace(200, L, E, vocab_size=V, seed=12), K, V)
    config = RoutingConfig(policy=policy, capacity=6, **kw)
    whole = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, calibration=cal)
    split = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, calibration=cal)
    for t in range(T):
        tok = trace.tokens[None, t : t + 1]
        for layer in range(L):
            z = trace.scores[None, t, layer]
            g = trace.pregate[None, t, layer] if layer >= 1 else None
            a = whole.step(layer, z, g, tok)
            prefetched = None
            if config.inserts and layer >= config.prefetch_distance:
                prefetched = split.prefetch(layer, g, tok)
            b = split.select(layer, z, tok, pregate=g if policy == "spec" else None)
            assert a.selected.tolist() == b.selected.tolist()
            assert a.demand_experts.tolist() == b.demand_experts.tolist()
            assert a.demand_evicted.tolist() == b.demand_evicted.tolist()
            if prefetched is not None:
                assert a.prefetch_experts.tolist() == prefetched.prefetch_experts.tolist()
                assert a.prefetch_evicted.tolist() == prefetched.prefetch_evicted.tolist()
    np.testing.assert_array_equal(whole.state, split.state)


def test_select_without_prefetch_is_an_error():
    cache = LogicalCache(RoutingConfig(policy="psr", capacity=4), num_layers=2, num_experts=8, top_k=2)
    z = np.zeros((1, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="before prefetch"):
        cache.select(1, z)
    cache.prefetch(1, z)
    with pytest.raises(ValueError, match="twice"):
        cache.prefetch(1, z)


@pytest.mark.parametrize("policy,kw", OPTION_SETS)
def test_step_io_on_the_caches_own_buffers_equals_step(policy, kw):
    E, K, L, T, V, B = 16, 4, 3, 20, 25, 2
    traces = [synthetic_trace(T, L, E, vocab_size=V, seed=21 + b) for b in range(B)]
    cal = calibration_from_trace(synthetic_trace(200, L, E, vocab_size=V, seed=12), K, V)
    config = RoutingConfig(policy=policy, capacity=6, **kw)
    a = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, calibration=cal, rows=B)
    b = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, calibration=cal, rows=B)
    valid = np.array([[True], [False]])
    for t in range(T):
        tok = np.array([[tr.tokens[t]] for tr in traces])
        row_valid = valid if t % 3 == 0 else np.ones((B, 1), dtype=bool)
        for layer in range(L):
            z = np.stack([tr.scores[t, layer] for tr in traces])[:, None]
            g = np.stack([tr.pregate[t, layer] for tr in traces])[:, None]
            want = a.step(layer, z, g if layer else None, tok, row_valid)
            b.io.scores[:] = z
            b.io.pregate[:] = g
            b.io.tokens[:] = tok
            b.io.valid[:] = row_valid
            got = b.step_io(layer)
            np.testing.assert_array_equal(got.plan, want.plan)
    np.testing.assert_array_equal(a.state, b.state)


def test_step_io_split_mode_and_errors():
    cache = LogicalCache(RoutingConfig(policy="psr", capacity=4), num_layers=2, num_experts=8, top_k=2)
    cache.io.pregate[:] = np.arange(8, dtype=np.float32)
    plan = cache.step_io(1, "prefetch")
    assert plan.prefetch_count[0, 0] == 1 and plan.prefetch_experts[0, 0, 0] == 7
    cache.io.scores[:] = np.arange(8, dtype=np.float32)[::-1].copy()
    plan = cache.step_io(1, "select")
    assert sorted(plan.selected[0, 0].tolist()) == [0, 1]
    with pytest.raises(ValueError, match="mode"):
        cache.step_io(1, "both-ish")
    with pytest.raises(ValueError, match="layer"):
        cache.step_io(2)
    cache.io.scores[0, 0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        cache.step_io(0)
    cache.resize(3)
    assert cache.io.scores.shape == (3, 1, 8)


def test_a_parallel_replay_leaves_torchs_thread_count_as_it_was():
    """numba's OpenMP layer sets the process's OpenMP thread count; torch reads it as its own, so a parallel replay
    would silently move a one-thread CLI run onto every core."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one core: numba runs one thread and cannot change torch's count")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rng = np.random.default_rng(0)
        scores = rng.standard_normal((16, 4, 16)).astype(np.float32)
        psr_hf.replay(psr_hf.RoutingConfig(policy="exact", capacity=8), scores,
                      tokens=np.zeros(16, dtype=np.int64), top_k=2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
