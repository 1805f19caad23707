"""Invariants of the logical cache (property-based where it fits), batches, padding, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psr_hf.policy import Calibration, LogicalCache, RoutingConfig, replay
from psr_hf.policy.traces import calibration_from_trace, own_topk, synthetic_trace

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    E = draw(st.sampled_from([8, 16, 64]))
    K = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k < E]))
    C = draw(st.integers(K, E))
    policy = draw(st.sampled_from(["exact", "cache_prior", "psr", "spec"]))
    kw: dict = {}
    if policy in ("cache_prior", "psr"):
        kw["lam"] = draw(st.sampled_from([0.0, 0.1, 0.3, 2.0]))
        kw["top_j"] = draw(st.integers(0, K))
        kw["delta_mode"] = draw(st.sampled_from(["fixed", "running"]))
    if policy in ("exact", "psr"):
        kw["budget"] = draw(st.integers(0, 3))
        if kw["budget"] > 0:
            kw["window"] = draw(st.integers(1, 10))
    kw["eviction"] = draw(st.sampled_from(["score", "lru"]))
    seed = draw(st.integers(0, 10_000))
    locality = draw(st.sampled_from([0.0, 0.5, 0.9]))
    return E, K, RoutingConfig(policy=policy, capacity=C, **kw), seed, locality


def _run(config, E, K, seed, locality, T=30, L=3, V=30):
    trace = synthetic_trace(T, L, E, vocab_size=V, seed=seed, locality=locality)
    cal = calibration_from_trace(synthetic_trace(100, L, E, vocab_size=V, seed=seed + 1), K, V)
    cache = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, calibration=cal)
    steps = []
    for t in range(T):
        for layer in range(L):
            before = set(cache.resident(layer).tolist())
            g = trace.pregate[None, t, layer] if layer >= 1 else None
            plan = cache.step(layer, trace.scores[None, t, layer], g, trace.tokens[None, t : t + 1])
            steps.append((t, layer, before, set(cache.resident(layer).tolist()), plan))
    return trace, cal, cache, steps


@SETTINGS
@given(cases())
def test_cache_never_exceeds_capacity_and_selected_experts_are_resident(case):
    E, K, config, seed, locality = case
    _, _, cache, steps = _run(config, E, K, seed, locality)
    for t, layer, before, after, plan in steps:
        selected = plan.selected[0, 0].tolist()
        assert len(after) <= cache.capacity
        assert len(set(selected)) == K
        assert set(selected) <= after, "every executed expert is in the logical cache after the step"
        # replaying the copy plan on the cache before the step gives the cache after it
        demand = plan.demand_experts[0, 0, : plan.demand_count[0, 0]].tolist()
        prefetch = plan.prefetch_experts[0, 0, : plan.prefetch_count[0, 0]].tolist()
        assert demand == sorted(demand)
        assert set(demand) <= set(selected)
        cache_set = set(before)
        inserts = list(zip(prefetch, plan.prefetch_evicted[0, 0].tolist())) + \
            list(zip(demand, plan.demand_evicted[0, 0].tolist()))
        for expert, victim in inserts:
            assert expert not in cache_set, "only experts outside the cache are inserted"
            if victim >= 0:
                assert victim in cache_set
                cache_set.discard(victim)
            cache_set.add(expert)
        assert cache_set == after
        assert len(after) == len(before), "a full cache stays full: every insertion evicts one expert"


@SETTINGS
@given(cases())
def test_prefetch_insertions_never_exceed_the_budget(case):
    E, K, config, seed, locality = case
    _, _, cache, steps = _run(config, E, K, seed, locality)
    for t, layer, before, after, plan in steps:
        n = int(plan.prefetch_count[0, 0])
        assert n <= cache.budget
        if layer == 0 or not config.inserts:
            assert n == 0
        inserted = plan.prefetch_experts[0, 0, :n].tolist()
        assert len(set(inserted)) == n


@SETTINGS
@given(cases())
def test_same_inputs_give_the_same_decisions_on_every_run(case):
    E, K, config, seed, locality = case
    trace = synthetic_trace(25, 3, E, vocab_size=30, seed=seed, locality=locality)
    cal = calibration_from_trace(synthetic_trace(100, 3, E, vocab_size=30, seed=seed + 1), K, 30)
    a = replay(config, trace.scores, trace.pregate, trace.tokens, cal, K)
    b = replay(config, trace.scores.copy(), trace.pregate.copy(), trace.tokens.copy(), cal, K)
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_array_equal(a.prefetch_copies, b.prefetch_copies)
    np.testing.assert_array_equal(a.demand_copies, b.demand_copies)


@SETTINGS
@given(cases())
def test_lam_zero_gives_the_routers_own_top_k(case):
    E, K, config, seed, locality = case
    if config.policy not in ("cache_prior", "psr"):
        config = RoutingConfig(policy="psr", capacity=config.capacity, lam=0.0, eviction=config.eviction)
    else:
        config = config.replace(lam=0.0)
    trace = synthetic_trace(25, 3, E, vocab_size=30, seed=seed, locality=locality)
    result = replay(config, trace.scores, trace.pregate, trace.tokens, None, K)
    np.testing.assert_array_equal(result.selected, np.sort(own_topk(trace.scores, K), axis=-1))
    assert result.replaced.sum() == 0


@SETTINGS
@given(cases())
def test_psr_with_lru_budget_zero_and_no_top_j_is_cache_prior(case):
    E, K, config, seed, locality = case
    lam = config.lam if config.policy in ("cache_prior", "psr") else 0.2
    trace = synthetic_trace(30, 3, E, vocab_size=30, seed=seed, locality=locality)
    cal = calibration_from_trace(synthetic_trace(100, 3, E, vocab_size=30, seed=seed + 1), K, 30)
    psr = RoutingConfig(policy="psr", capacity=config.capacity, lam=lam, budget=0, eviction="lru")
    cp = RoutingConfig(policy="cache_prior", capacity=config.capacity, lam=lam)
    a = replay(psr, trace.scores, trace.pregate, trace.tokens, cal, K)
    b = replay(cp, trace.scores, trace.pregate, trace.tokens, cal, K)
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_array_equal(a.demand_copies, b.demand_copies)


def test_exact_routing_selects_the_routers_top_k_whatever_the_cache():
    trace = synthetic_trace(50, 4, 64, seed=3)
    for config in (RoutingConfig(policy="exact", residency=0.25),
                   RoutingConfig(policy="exact", residency=0.5, budget=2, eviction="score")):
        result = replay(config, trace.scores, trace.pregate, trace.tokens, None, 8)
        np.testing.assert_array_equal(result.selected, np.sort(own_topk(trace.scores, 8), axis=-1))


def test_cache_aware_routing_needs_fewer_demand_copies_than_exact():
    """Sanity of direction on a trace with locality: the bonus keeps routing on resident experts."""
    trace = synthetic_trace(400, 4, 64, vocab_size=200, seed=5)
    cal = calibration_from_trace(synthetic_trace(3000, 4, 64, vocab_size=200, seed=6), 8, 200)
    exact = replay(RoutingConfig(policy="exact", residency=0.5), trace.scores, trace.pregate, trace.tokens, cal, 8)
    cp = replay(RoutingConfig(policy="cache_prior", residency=0.5), trace.scores, trace.pregate, trace.tokens, cal, 8)
    psr = replay(RoutingConfig(policy="psr", residency=0.5), trace.scores, trace.pregate, trace.tokens, cal, 8)
    assert cp.demand_copies.sum() < exact.demand_copies.sum()
    assert psr.demand_copies.sum() < cp.demand_copies.sum()
    assert psr.prefetch_copies.sum() > 0


# ---------------------------------------------------------------------------------------------------- batches
def _batch_case(seed=0, B=3, S=12, E=16, K=4, L=2, V=30):
    rng = np.random.default_rng(seed)
    traces = [synthetic_trace(S, L, E, vocab_size=V, seed=seed * 10 + b) for b in range(B)]
    cal = calibration_from_trace(synthetic_trace(200, L, E, vocab_size=V, seed=99), K, V)
    valid = np.ones((B, S), dtype=bool)
    valid[0, :3] = False  # left padding
    valid[1, -4:] = False  # right padding
    valid[2, rng.choice(S, 3, replace=False)] = False  # anywhere
    return traces, cal, valid


@pytest.mark.parametrize("policy", ["exact", "cache_prior", "psr", "spec"])
def test_rows_are_independent_and_padding_never_touches_state(policy):
    traces, cal, valid = _batch_case()
    B, S = valid.shape
    L, E, K = 2, 16, 4
    config = RoutingConfig(policy=policy, capacity=6)
    batch = LogicalCache(config, num_layers=L, num_experts=E, top_k=K, calibration=cal, rows=B)
    scores = np.stack([t.scores for t in traces])  # [B, S, L, E]
    pregate = np.stack([t.pregate for t in traces])
    tokens = np.stack([t.tokens for t in traces])
    plans = [batch.step(layer, scores[:, :, layer], pregate[:, :, layer] if layer else None, tokens, valid)
             for layer in range(L)]
    for b in range(B):
        keep = valid[b]
        alone = replay(config, traces[b].scores[keep], traces[b].pregate[keep], traces[b].tokens[keep], cal, K)
        for layer in range(L):
            got = np.sort(plans[layer].selected[b][keep], axis=-1)
            np.testing.assert_array_equal(got, alone.selected[:, layer])
            np.testing.assert_array_equal(plans[layer].demand_count[b][keep], alone.demand_copies[:, layer])
            np.testing.assert_array_equal(plans[layer].prefetch_count[b][keep], alone.prefetch_copies[:, layer])
            # padded positions: the router's own top-K and no copies
            pad = ~keep
            np.testing.assert_array_equal(
                plans[layer].selected[b][pad], own_topk(traces[b].scores[pad, layer], K))
            assert plans[layer].demand_count[b][pad].sum() == 0
            assert plans[layer].prefetch_count[b][pad].sum() == 0
    assert batch.stats().steps[0].tolist() == valid.sum(axis=1).tolist()


def test_a_fully_padded_block_leaves_the_state_unchanged():
    traces, cal, _ = _batch_case()
    cache = LogicalCache(RoutingConfig(policy="psr", capacity=6), num_layers=2, num_experts=16, top_k=4,
                         calibration=cal, rows=1)
    cache.step(0, traces[0].scores[None, :5, 0], None, traces[0].tokens[None, :5])
    before = cache.state.copy(), cache.counters.copy()
    cache.step(0, traces[0].scores[None, 5:, 0], None, traces[0].tokens[None, 5:],
               valid=np.zeros((1, 7), dtype=bool))
    np.testing.assert_array_equal(cache.state, before[0])
    np.testing.assert_array_equal(cache.counters, before[1])


def test_reorder_follows_beam_search_and_expands_rows():
    traces, cal, _ = _batch_case()
    cache = LogicalCache(RoutingConfig(policy="psr", capacity=6), num_layers=2, num_experts=16, top_k=4,
                         calibration=cal, rows=2)
    scores = np.stack([traces[0].scores[:6, 0], traces[1].scores[:6, 0]])
    cache.step(0, scores, None, np.stack([traces[0].tokens[:6], traces[1].tokens[:6]]))
    old = cache.state.copy()
    cache.reorder([1, 1, 0])
    assert cache.rows == 3
    np.testing.assert_array_equal(cache.state[:, 0], old[:, 1])
    np.testing.assert_array_equal(cache.state[:, 1], old[:, 1])
    np.testing.assert_array_equal(cache.state[:, 2], old[:, 0])
    # and the kernel now runs on the new rows
    plan = cache.step(0, np.repeat(scores[:1, :1], 3, axis=0), None, np.zeros((3, 1), dtype=np.int64))
    assert plan.selected.shape == (3, 1, 4)
    with pytest.raises(ValueError, match="reorder index"):
        cache.reorder([3])


def test_reset_restores_the_warm_set():
    traces, cal, _ = _batch_case()
    cache = LogicalCache(RoutingConfig(policy="psr", capacity=6), num_layers=2, num_experts=16, top_k=4,
                         calibration=cal)
    warm = cache.resident(0).tolist()
    assert warm == cal.warm_set(0, 6).tolist()
    cache.step(0, traces[0].scores[None, :, 0], None, traces[0].tokens[None])
    assert cache.stats().steps.sum() > 0
    cache.reset()
    assert cache.resident(0).tolist() == warm
    assert cache.stats().steps.sum() == 0


def test_without_calibration_the_warm_set_is_the_first_experts_and_delta_runs(caplog):
    with caplog.at_level("WARNING"):
        cache = LogicalCache(RoutingConfig(policy="psr", capacity=5), num_layers=2, num_experts=16, top_k=4)
    assert cache.resident(1).tolist() == [0, 1, 2, 3, 4]
    assert cache.delta_mode == "running"
    assert "calibrat" in caplog.text


# ---------------------------------------------------------------------------------------------------- bad input
def _cache(**kw):
    return LogicalCache(RoutingConfig(policy="psr", capacity=4), num_layers=2, num_experts=8, top_k=2,
                        calibration=Calibration.from_arrays(delta=[1.0, 1.0], expert_counts=np.ones((2, 8)),
                                                            token_prior=np.zeros((10, 2, 8))), **kw)


def test_nan_scores_raise_and_leave_the_state_untouched():
    cache = _cache()
    before = cache.state.copy()
    z = np.zeros((1, 3, 8), dtype=np.float32)
    z[0, 2, 5] = np.nan
    with pytest.raises(ValueError, match=r"NaN.*\(0, 2\)"):
        cache.step(0, z, tokens=np.zeros((1, 3), dtype=np.int64))
    np.testing.assert_array_equal(cache.state, before)
    z[0, 2, 5] = np.inf
    with pytest.raises(ValueError, match="inf"):
        cache.step(0, z, tokens=np.zeros((1, 3), dtype=np.int64))


def test_nan_pregate_raises():
    cache = _cache()
    g = np.zeros((1, 1, 8), dtype=np.float32)
    g[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="pregate"):
        cache.step(1, np.zeros((1, 1, 8), dtype=np.float32), g, np.zeros((1, 1), dtype=np.int64))


def test_token_ids_outside_the_calibration_vocabulary_raise():
    cache = _cache()
    z = np.zeros((1, 1, 8), dtype=np.float32)
    for bad in (10, -1):
        with pytest.raises(ValueError, match="token ids"):
            cache.step(0, z, tokens=np.array([[bad]]))


def test_wrong_shapes_and_dtypes_raise():
    cache = _cache()
    with pytest.raises(ValueError, match="shape"):
        cache.step(0, np.zeros((1, 1, 7), dtype=np.float32), tokens=[[0]])
    with pytest.raises(ValueError, match="rows"):
        cache.step(0, np.zeros((2, 1, 8), dtype=np.float32), tokens=[[0], [0]])
    with pytest.raises(ValueError, match="floating"):
        cache.step(0, np.zeros((1, 1, 8), dtype=np.int64), tokens=[[0]])
    with pytest.raises(ValueError, match="integer"):
        cache.step(0, np.zeros((1, 1, 8), dtype=np.float32), tokens=[[0.5]])
    with pytest.raises(ValueError, match="pre-gate"):
        cache.step(1, np.zeros((1, 1, 8), dtype=np.float32), tokens=[[0]])
    with pytest.raises(ValueError, match="layer"):
        cache.step(2, np.zeros((1, 1, 8), dtype=np.float32), tokens=[[0]])
    with pytest.raises(ValueError, match="top_k=2 finite"):
        cache.step(0, np.full((1, 1, 8), -np.inf, dtype=np.float32), tokens=[[0]])


def test_replay_rejects_bad_arrays_with_messages():
    trace = synthetic_trace(10, 2, 8, seed=0)
    config = RoutingConfig(policy="psr", capacity=4)
    with pytest.raises(ValueError, match=r"\[T, L, E\]"):
        replay(config, trace.scores[0], trace.pregate, trace.tokens, None, 2)
    with pytest.raises(ValueError, match="pregate has shape"):
        replay(config, trace.scores, trace.pregate[:, :1], trace.tokens, None, 2)
    with pytest.raises(ValueError, match="tokens must have shape"):
        replay(config, trace.scores, trace.pregate, trace.tokens[:5], None, 2)
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        replay(RoutingConfig(policy="psr", capacity=9), trace.scores, trace.pregate, trace.tokens, None, 2)
    with pytest.raises(ValueError, match="below the model's top-k"):
        replay(RoutingConfig(policy="psr", capacity=2), trace.scores, trace.pregate, trace.tokens, None, 4)
    bad = trace.scores.copy()
    bad[3, 1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        replay(config, bad, trace.pregate, trace.tokens, None, 2)
    with pytest.raises(ValueError, match="calibration was made for"):
        replay(config, trace.scores, trace.pregate, trace.tokens,
               Calibration.from_arrays(delta=[1.0] * 3, expert_counts=np.ones((3, 8))), 2)


def test_typed_arrays_with_wrong_shapes_raise_instead_of_reaching_the_kernel_unchecked():
    """The hot path hands typed arrays to the kernel, which checks shapes before touching memory or state."""
    cache = _cache()
    before = cache.state.copy()
    f32, i64 = np.float32, np.int64
    cases = [
        (0, np.zeros((1, 1, 7), f32), None, np.zeros((1, 1), i64), "shape"),  # wrong E
        (0, np.zeros((2, 1, 8), f32), None, np.zeros((2, 1), i64), "rows"),  # wrong B
        (0, np.zeros((1, 2, 8), f32), None, np.zeros((1, 1), i64), "tokens"),  # tokens shorter than scores
        (1, np.zeros((1, 2, 8), f32), np.zeros((1, 1, 8), f32), np.zeros((1, 2), i64), "pregate"),  # short g
        (5, np.zeros((1, 1, 8), f32), None, np.zeros((1, 1), i64), "layer"),  # layer out of range
    ]
    for layer, z, g, t, match in cases:
        with pytest.raises(ValueError, match=match):
            cache.step(layer, z, g, t)
    np.testing.assert_array_equal(cache.state, before)
