"""Block-level expert selection for speculative decoding (psr_hf.policy.blocks) against an independent reference.

The reference below (``ref_*``) is written from docs/speculative.md, section "The rules", only: plain Python
loops, Python sets and ``sorted()`` with explicit keys, slow on purpose. The tests drive the package's
:class:`BlockPool` step by step and through :func:`replay` on random traces (with deliberate exact score ties)
and compare every selected set, copy list and pool with the reference, then check a few consequences of the
rules directly (exact mode, threshold 0 and a huge threshold, the rescue of position 0, pool size, copies,
determinism) and the input checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from psr_hf.policy.blocks import BlockConfig, BlockPool, BlockRecord, replay

MODES = ("exact", "position", "confidence")


# --------------------------------------------------------------------------------------------------------------
# The reference (docs/speculative.md, "The rules")
# --------------------------------------------------------------------------------------------------------------


def ref_weights(mode, confidences, history, rescue_at=0.3):
    """``(w, r)`` of a verification block of ``k = len(confidences)`` drafts; ``history``: the accepted counts of
    the earlier verification blocks of this sequence (``n = len(history)``)."""
    k = len(confidences)
    w = [1.0] * (k + 1)
    r = [False] * (k + 1)
    if mode == "position":
        n = len(history)
        for d in range(1, k + 1):
            n_d = sum(1 for a in history if a >= d)
            w[d] = (1.0 + n_d) / (2.0 + n)
    elif mode == "confidence":
        product = 1.0
        for d in range(1, k + 1):
            product *= float(confidences[d - 1])
            w[d] = product ** 0.5
        r = [w[d] >= rescue_at for d in range(k + 1)]
    elif mode != "exact":
        raise AssertionError(mode)
    return w, r


def ref_rank(row, experts):
    """``experts`` by descending score in ``row``, ties to the lower index."""
    return sorted(experts, key=lambda e: (-float(row[e]), e))


def ref_softmax(row):
    values = [float(x) for x in row]
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [x / total for x in exps]


def ref_layer(z, w, r, pool, stamps, stamp, *, top_k, size, threshold, exact):
    """One layer of a block (rules 1-6). ``pool``: set of experts; ``stamps``: dict expert -> last-use stamp
    (updated in place). Returns ``(selected: list of sorted lists, copies: sorted list, new pool: set, D)``."""
    positions, experts = z.shape
    own = []
    q = [[0.0] * experts for _ in range(positions)]
    for d in range(positions):
        ranked = ref_rank(z[d], range(experts))
        own.append(ranked[:top_k])
        p = ref_softmax(z[d])
        for e in own[d]:
            q[d][e] = p[e]
    demand = [sum(w[d] * q[d][e] for d in range(positions)) for e in range(experts)]
    total = sum(w)
    if exact:
        selected = [list(t) for t in own]
    else:
        eligible = set(pool) | {e for e in range(experts) if e not in pool and demand[e] >= threshold * total}
        selected = []
        for d in range(positions):
            ranked = ref_rank(z[d], eligible)
            chosen = ranked[:top_k]
            t = own[d][0]
            if r[d] and t not in chosen:
                chosen = [t] + ranked[: top_k - 1]
            selected.append(chosen)
    executed = set()
    for chosen in selected:
        executed |= set(chosen)
    copies = sorted(e for e in executed if e not in pool)
    for e in executed:
        stamps[e] = stamp
    candidates = set(pool) | executed
    new_pool = set(sorted(candidates, key=lambda e: (-stamps[e], -demand[e], e))[:size])
    for e in list(stamps):
        if e not in new_pool:
            del stamps[e]
    return [sorted(c) for c in selected], copies, new_pool, demand


def ref_warm(counts_row, size, experts):
    if counts_row is None:
        return set(range(size))
    return set(sorted(range(experts), key=lambda e: (-float(counts_row[e]), e))[:size])


def ref_sequence(mode, records, *, layers, experts, top_k, size, threshold=0.02, rescue_at=0.3, expert_counts=None):
    """Per block: dict with ``w``, ``r`` (None for the prompt), and per layer ``selected``, ``copies``, ``pool``
    (after the block, sorted list), ``before`` (pool before the block) and ``demand``."""
    pools = []
    stamps = []
    for layer in range(layers):
        row = None if expert_counts is None else expert_counts[layer]
        warm = ref_warm(row, size, experts)
        pools.append(warm)
        stamps.append({e: 0 for e in warm})
    history = []
    out = []
    for number, (scores, confidences, accepted) in enumerate(records, start=1):
        prompt = confidences is None
        if prompt:
            w = [1.0] * scores.shape[1]
            r = [False] * scores.shape[1]
        else:
            w, r = ref_weights(mode, confidences, history, rescue_at)
        block = {"w": None if prompt else w, "r": None if prompt else r, "layers": []}
        for layer in range(layers):
            before = sorted(pools[layer])
            selected, copies, new_pool, demand = ref_layer(
                scores[layer], w, r, pools[layer], stamps[layer], number,
                top_k=top_k, size=size, threshold=threshold, exact=prompt or mode == "exact")
            pools[layer] = new_pool
            block["layers"].append({"selected": selected, "copies": copies, "pool": sorted(new_pool),
                                    "before": before, "demand": demand})
        if not prompt:
            history.append(accepted)
        out.append(block)
    return out


# --------------------------------------------------------------------------------------------------------------
# Random traces and the package drivers
# --------------------------------------------------------------------------------------------------------------


def random_case(seed, experts, top_k):
    """A random sequence: settings and records ``(scores [L, S, E] float32, confidences or None, accepted)``."""
    rng = np.random.default_rng(seed)
    layers = int(rng.integers(3, 5))
    size = int(rng.integers(top_k, experts + 1))
    if seed % 3 == 0:
        size = top_k  # the smallest pool: many copies and rescues
    threshold = float(rng.choice([0.0, 0.005, 0.02, 0.02, 0.08]))
    rescue_at = float(rng.choice([0.3, 0.3, 0.5]))
    counts = None if seed % 2 else rng.integers(0, 4, size=(layers, experts)).astype(np.int64)
    bias = rng.normal(size=(layers, experts)) * 1.5  # popular experts, so the pool matters
    blocks = int(rng.integers(5, 31))

    def scores(positions):
        scale = float(rng.choice([0.5, 1.0, 3.0]))
        z = rng.normal(size=(layers, positions, experts)) * scale + bias[:, None, :]
        kind = rng.random(size=(layers, positions))
        z = np.where((kind < 0.35)[..., None], np.round(z, 1), z)  # exact ties in some rows
        z = np.where((kind > 0.96)[..., None], 0.0, z)  # a constant row: every expert ties
        return z.astype(np.float32)

    records = [(scores(int(rng.integers(1, 21))), None, None)]
    for _ in range(blocks):
        k = int(rng.integers(2, 17))
        c = rng.beta(3.0, 1.0, size=k)
        special = rng.random(size=k)
        c = np.where(special < 0.05, 0.0, np.where(special > 0.95, 1.0, c))
        records.append((scores(k + 1), c.astype(np.float64), int(rng.integers(0, k + 1))))
    return dict(layers=layers, experts=experts, top_k=top_k, size=size, threshold=threshold,
                rescue_at=rescue_at, expert_counts=counts, records=records)


def make_config(mode, case):
    return BlockConfig(mode=mode, pool=case["size"], top_k=case["top_k"], threshold=case["threshold"],
                       rescue_at=case["rescue_at"])


def reference_for(mode, case):
    return ref_sequence(mode, case["records"], layers=case["layers"], experts=case["experts"],
                        top_k=case["top_k"], size=case["size"], threshold=case["threshold"],
                        rescue_at=case["rescue_at"], expert_counts=case["expert_counts"])


def run_steps(mode, case):
    """The package step by step: per block ``(weights or None, choices per layer, members per layer)``."""
    pool = BlockPool(make_config(mode, case), num_layers=case["layers"], num_experts=case["experts"],
                     expert_counts=case["expert_counts"])
    out = []
    for scores, confidences, accepted in case["records"]:
        if confidences is None:
            pool.begin_prompt(scores.shape[1])
            weights = None
        else:
            weights = pool.begin_block(confidences)
        choices = [pool.select(layer, scores[layer]) for layer in range(case["layers"])]
        pool.end_block(accepted)
        members = [np.asarray(pool.members(layer)).copy() for layer in range(case["layers"])]
        out.append((weights, choices, members))
    return out


def records_of(case):
    return [BlockRecord(scores=s, confidences=c, accepted=a) for s, c, a in case["records"]]


def run_replay(mode, case):
    return replay(make_config(mode, case), records_of(case), num_layers=case["layers"],
                  num_experts=case["experts"], expert_counts=case["expert_counts"])


def as_sets(choice):
    selected = np.asarray(choice.selected)
    return [list(map(int, row)) for row in selected]


def assert_choice_matches(choice, expected, where):
    selected = np.asarray(choice.selected)
    assert selected.dtype == np.int64, where
    assert selected.shape == (len(expected["selected"]), len(expected["selected"][0])), where
    assert as_sets(choice) == expected["selected"], f"{where}: selected"
    copies = np.asarray(choice.copies)
    assert copies.dtype == np.int64, where
    assert copies.tolist() == expected["copies"], f"{where}: copies"
    np.testing.assert_allclose(np.asarray(choice.demand, dtype=np.float64), expected["demand"],
                               rtol=1e-6, atol=1e-12, err_msg=f"{where}: demand")


CASES = [(seed, experts, top_k) for experts in (16, 64) for top_k in (4, 8) for seed in range(3)]


def case_id(param):
    seed, experts, top_k = param
    return f"seed{seed}-E{experts}-K{top_k}"


# --------------------------------------------------------------------------------------------------------------
# Random traces against the reference
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("params", CASES, ids=case_id)
def test_block_pool_steps_match_reference_on_random_traces(params, mode):
    case = random_case(*params)
    expected = reference_for(mode, case)
    got = run_steps(mode, case)
    assert len(got) == len(expected)
    for b, ((weights, choices, members), block) in enumerate(zip(got, expected)):
        if block["w"] is not None:
            np.testing.assert_allclose(np.asarray(weights.weights, dtype=np.float64), block["w"], rtol=1e-12,
                                       atol=0, err_msg=f"block {b}: weights")
            assert np.asarray(weights.rescue, dtype=bool).tolist() == block["r"], f"block {b}: rescue"
        for layer, (choice, exp) in enumerate(zip(choices, block["layers"])):
            where = f"{mode} block {b} layer {layer}"
            assert_choice_matches(choice, exp, where)
            assert np.flatnonzero(members[layer]).tolist() == exp["pool"], f"{where}: pool"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("params", CASES, ids=case_id)
def test_replay_matches_reference_on_random_traces(params, mode):
    case = random_case(*params)
    expected = reference_for(mode, case)
    got = run_replay(mode, case)
    assert len(got) == len(expected)
    for b, (choices, block) in enumerate(zip(got, expected)):
        assert len(choices) == case["layers"]
        for layer, (choice, exp) in enumerate(zip(choices, block["layers"])):
            assert_choice_matches(choice, exp, f"replay {mode} block {b} layer {layer}")


@pytest.mark.parametrize("mode", MODES)
def test_replay_equals_step_by_step(mode):
    case = random_case(11, 64, 8)
    stepped = run_steps(mode, case)
    replayed = run_replay(mode, case)
    for (_, choices, _), again in zip(stepped, replayed, strict=True):
        for a, b in zip(choices, again, strict=True):
            assert as_sets(a) == as_sets(b)
            assert np.asarray(a.copies).tolist() == np.asarray(b.copies).tolist()
            np.testing.assert_array_equal(np.asarray(a.demand), np.asarray(b.demand))


def test_reference_hand_example():
    """The reference itself on a hand-worked block (so it is pinned to the rules, not only to the package).

    E=6, K=2, P=2, pool {0, 1} (no calibration), confidence mode, threshold 0.02, one block with k=2 drafts,
    confidences (0.25, 0.2): w = (1, 0.5, sqrt(0.05) ~ 0.2236), r = (T, T, F). Scores: position 0 prefers 5
    then 0; position 1 prefers 1 then 0; position 2 prefers 4 then 3 (mass tiny, w small: 4 and 3 stay out).
    """
    z = np.full((3, 6), -20.0, dtype=np.float32)
    z[0, 5], z[0, 0] = 10.0, 9.0
    z[1, 1], z[1, 0] = 10.0, 9.0
    z[2, 4], z[2, 3], z[2, 0], z[2, 1] = 0.0, -0.1, -0.2, -0.3
    z[2, 2], z[2, 5] = -0.4, -0.5
    w, r = ref_weights("confidence", [0.25, 0.2], [])
    assert w[:2] == [1.0, 0.5] and abs(w[2] - math.sqrt(0.05)) < 1e-15
    assert r == [True, True, False]
    stamps = {0: 0, 1: 0}
    selected, copies, pool, demand = ref_layer(z, w, r, {0, 1}, stamps, 1, top_k=2, size=2, threshold=0.02,
                                               exact=False)
    # W ~ 1.7236, threshold * W ~ 0.0345; D[5] ~ 0.731 joins A, and D[4] ~ 0.2236 * 0.211 ~ 0.047 and
    # D[3] ~ 0.2236 * 0.191 ~ 0.043 join too; D[2] = 0 stays out. A = {0, 1, 3, 4, 5}.
    assert demand[4] >= 0.02 * sum(w) and demand[3] >= 0.02 * sum(w)
    assert selected == [[0, 5], [0, 1], [3, 4]]
    assert copies == [3, 4, 5]
    # X = {0, 1, 3, 4, 5}, all stamp 1; D: 5 ~ 0.731, 0 ~ 0.269 + 0.5 * 0.269 = 0.403, 1 ~ 0.5 * 0.731 = 0.366
    assert pool == {0, 5}
    assert stamps == {0: 1, 5: 1}


# --------------------------------------------------------------------------------------------------------------
# Consequences of the rules, checked directly
# --------------------------------------------------------------------------------------------------------------


def own_top_k(row, k):
    return sorted(np.argsort(-row.astype(np.float64), kind="stable")[:k].tolist())


@pytest.mark.parametrize("params", [(1, 16, 4), (2, 64, 8)], ids=case_id)
def test_exact_mode_executes_each_positions_own_top_k(params):
    case = random_case(*params)
    for block, (scores, _, _) in zip(run_steps("exact", case), case["records"]):
        _, choices, _ = block
        for layer, choice in enumerate(choices):
            expected = [own_top_k(scores[layer, d], case["top_k"]) for d in range(scores.shape[1])]
            assert as_sets(choice) == expected


@pytest.mark.parametrize("mode", ["position", "confidence"])
def test_threshold_zero_makes_every_demanded_expert_eligible(mode):
    case = random_case(4, 64, 4)
    case["threshold"] = 0.0
    case["size"] = 4
    for scores, confidences, _ in case["records"]:
        if confidences is not None:
            confidences[:] = np.clip(confidences, 0.05, 1.0)  # w > 0: every own top-K expert has demand
    for (_, choices, _), (scores, _, _) in zip(run_steps(mode, case), case["records"]):
        for layer, choice in enumerate(choices):
            demanded = set(np.flatnonzero(np.asarray(choice.demand) > 0).tolist())
            expected = [own_top_k(scores[layer, d], case["top_k"]) for d in range(scores.shape[1])]
            assert all(set(row) <= demanded for row in expected)
            assert as_sets(choice) == expected  # every demanded expert eligible: each position its own top-K


@pytest.mark.parametrize("mode", ["position", "confidence"])
def test_huge_threshold_keeps_positions_in_the_pool_except_rescued_top1(mode):
    case = random_case(5, 64, 8)
    case["threshold"] = 1e6
    case["size"] = 12
    previous = [sorted(ref_warm(None if case["expert_counts"] is None else case["expert_counts"][layer],
                                case["size"], case["experts"])) for layer in range(case["layers"])]
    rescued_outside = 0
    for (weights, choices, members), (scores, confidences, _) in zip(run_steps(mode, case), case["records"]):
        for layer, choice in enumerate(choices):
            pool = set(previous[layer])
            rows = as_sets(choice)
            if confidences is None:  # the prompt runs exact
                assert rows == [own_top_k(scores[layer, d], case["top_k"]) for d in range(scores.shape[1])]
            else:
                rescue = np.asarray(weights.rescue, dtype=bool)
                for d, row in enumerate(rows):
                    outside = set(row) - pool
                    top1 = int(np.argsort(-scores[layer, d].astype(np.float64), kind="stable")[0])
                    if rescue[d]:
                        assert outside <= {top1}
                        rescued_outside += len(outside)
                    else:
                        assert not outside
                if mode == "position":
                    assert np.asarray(choice.copies).size == 0
            previous[layer] = np.flatnonzero(members[layer]).tolist()
    if mode == "confidence":
        assert rescued_outside > 0  # the trace did exercise a rescue from outside the pool


def _rescue_pool(threshold=10.0):
    """E=8, K=2, P=2, pool {0, 1}; a prompt whose top-2 is {0, 1} keeps it."""
    cfg = BlockConfig(mode="confidence", pool=2, top_k=2, threshold=threshold, rescue_at=0.3)
    pool = BlockPool(cfg, num_layers=1, num_experts=8, expert_counts=None)
    prompt = np.zeros((1, 8), dtype=np.float32)
    prompt[0, 0], prompt[0, 1] = 5.0, 4.0
    pool.begin_prompt(1)
    pool.select(0, prompt)
    pool.end_block(None)
    assert np.flatnonzero(pool.members(0)).tolist() == [0, 1]
    return pool


def test_confidence_mode_rescues_position_zero_even_with_zero_confidence():
    pool = _rescue_pool()
    weights = pool.begin_block([0.0, 0.0, 0.0])
    assert np.asarray(weights.weights).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert np.asarray(weights.rescue, dtype=bool).tolist() == [True, False, False, False]
    z = np.zeros((4, 8), dtype=np.float32)
    z[:, 7], z[:, 0], z[:, 1] = 9.0, 1.0, 0.5  # every position's top-1 is 7, outside the pool
    choice = pool.select(0, z)
    assert as_sets(choice) == [[0, 7], [0, 1], [0, 1], [0, 1]]
    assert np.asarray(choice.copies).tolist() == [7]


def test_confidence_product_below_0_09_is_not_rescued():
    pool = _rescue_pool()
    # products: 0.5, 0.1, 0.089 -> w = 0.707, 0.316, 0.298: positions 0, 1, 2 rescued, 3 not
    weights = pool.begin_block([0.5, 0.2, 0.89])
    np.testing.assert_allclose(np.asarray(weights.weights), [1.0, 0.5 ** 0.5, 0.1 ** 0.5, 0.089 ** 0.5],
                               rtol=1e-12)
    assert np.asarray(weights.rescue, dtype=bool).tolist() == [True, True, True, False]
    z = np.zeros((4, 8), dtype=np.float32)
    z[:, 6], z[:, 1], z[:, 0] = 9.0, 1.0, 0.5
    choice = pool.select(0, z)
    assert as_sets(choice) == [[1, 6], [1, 6], [1, 6], [0, 1]]
    assert np.asarray(choice.copies).tolist() == [6]


def test_weight_equal_to_rescue_at_is_rescued():
    """r[d] = (w[d] >= rescue_at): 0.25 ** 0.5 is exactly 0.5, so rescue_at = 0.5 rescues positions 1 and 2."""
    cfg = BlockConfig(mode="confidence", pool=2, top_k=2, threshold=10.0, rescue_at=0.5)
    pool = BlockPool(cfg, num_layers=1, num_experts=8, expert_counts=None)
    weights = pool.begin_block([0.25, 1.0, 0.99])
    assert np.asarray(weights.weights)[:3].tolist() == [1.0, 0.5, 0.5]
    assert np.asarray(weights.rescue, dtype=bool).tolist() == [True, True, True, False]
    assert ref_weights("confidence", [0.25, 1.0, 0.99], [], rescue_at=0.5)[1] == [True, True, True, False]
    z = np.zeros((4, 8), dtype=np.float32)
    z[:, 7], z[:, 0], z[:, 1] = 9.0, 1.0, 0.5
    assert as_sets(pool.select(0, z)) == [[0, 7], [0, 7], [0, 7], [0, 1]]


@pytest.mark.parametrize("seed", [0, 3, 7])
def test_rescue_flags_follow_confidence_products(seed):
    rng = np.random.default_rng(seed)
    pool = _rescue_pool()
    for _ in range(20):
        k = int(rng.integers(2, 17))
        c = rng.uniform(0.0, 1.0, size=k)
        weights = pool.begin_block(c)
        rescue = np.asarray(weights.rescue, dtype=bool)
        assert rescue[0]
        products = np.cumprod(c)
        for d in range(1, k + 1):
            if products[d - 1] < 0.0899:
                assert not rescue[d]
            elif products[d - 1] > 0.0901:
                assert rescue[d]
        pool.select(0, np.zeros((k + 1, 8), dtype=np.float32))
        pool.end_block(int(rng.integers(0, k + 1)))


def test_position_weights_count_committed_drafts():
    cfg = BlockConfig(mode="position", pool=2, top_k=2, threshold=0.02, rescue_at=0.3)
    pool = BlockPool(cfg, num_layers=1, num_experts=4, expert_counts=None)
    pool.begin_prompt(3)
    pool.select(0, np.zeros((3, 4), dtype=np.float32))
    pool.end_block(None)  # the prompt does not count
    history = []
    for accepted in [2, 0, 3, 1]:
        weights = pool.begin_block([0.5, 0.5, 0.5])
        expected, _ = ref_weights("position", [0.5] * 3, history)
        np.testing.assert_allclose(np.asarray(weights.weights), expected, rtol=1e-12)
        assert not np.asarray(weights.rescue, dtype=bool).any()
        pool.select(0, np.zeros((4, 4), dtype=np.float32))
        pool.end_block(accepted)
        history.append(accepted)
    # after accepted counts 2, 0, 3, 1: n = 4, n_1 = 3, n_2 = 2, n_3 = 1
    weights = pool.begin_block([0.5, 0.5, 0.5])
    np.testing.assert_allclose(np.asarray(weights.weights), [1.0, 4 / 6, 3 / 6, 2 / 6], rtol=1e-12)


def test_warm_set_is_the_largest_expert_counts_ties_to_lower_index():
    counts = np.array([[1, 5, 5, 0, 3, 5], [0, 0, 0, 0, 0, 0]], dtype=np.int64)
    cfg = BlockConfig(mode="exact", pool=3, top_k=2, threshold=0.02, rescue_at=0.3)
    pool = BlockPool(cfg, num_layers=2, num_experts=6, expert_counts=counts)
    assert np.flatnonzero(pool.members(0)).tolist() == [1, 2, 5]
    assert np.flatnonzero(pool.members(1)).tolist() == [0, 1, 2]
    plain = BlockPool(cfg, num_layers=2, num_experts=6, expert_counts=None)
    assert np.flatnonzero(plain.members(0)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("params", [(0, 16, 4), (1, 64, 8), (2, 16, 8)], ids=case_id)
def test_pool_never_exceeds_p_and_copies_are_executed_union_minus_previous_pool(params, mode):
    case = random_case(*params)
    previous = [sorted(ref_warm(None if case["expert_counts"] is None else case["expert_counts"][layer],
                                case["size"], case["experts"])) for layer in range(case["layers"])]
    for _, choices, members in run_steps(mode, case):
        for layer, choice in enumerate(choices):
            executed = set(np.asarray(choice.selected).ravel().tolist())
            copies = np.asarray(choice.copies).tolist()
            assert copies == sorted(executed - set(previous[layer]))
            now = np.asarray(members[layer], dtype=bool)
            assert now.shape == (case["experts"],)
            assert now.sum() == case["size"]  # never more than P (and exactly P: K <= P <= E)
            assert set(np.flatnonzero(now).tolist()) <= set(previous[layer]) | executed
            previous[layer] = np.flatnonzero(now).tolist()


@pytest.mark.parametrize("mode", MODES)
def test_replay_twice_gives_identical_results(mode):
    case = random_case(8, 64, 4)
    first = run_replay(mode, case)
    second = run_replay(mode, case)
    assert len(first) == len(second) == len(case["records"])
    for a_block, b_block in zip(first, second, strict=True):
        for a, b in zip(a_block, b_block, strict=True):
            np.testing.assert_array_equal(np.asarray(a.selected), np.asarray(b.selected))
            np.testing.assert_array_equal(np.asarray(a.copies), np.asarray(b.copies))
            np.testing.assert_array_equal(np.asarray(a.demand), np.asarray(b.demand))


# --------------------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------------------


def _raises(build):
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value).strip()


@pytest.mark.parametrize(
    "settings, experts",
    [
        (dict(mode="confidence", pool=3, top_k=4), 16),  # pool < top_k
        (dict(mode="confidence", pool=17, top_k=4), 16),  # pool > num_experts
        (dict(mode="greedy", pool=8, top_k=4), 16),  # unknown mode
        (dict(mode="position", pool=8, top_k=4, threshold=-0.01), 16),  # threshold < 0
    ],
    ids=["pool-below-top-k", "pool-above-experts", "unknown-mode", "negative-threshold"],
)
def test_invalid_settings_raise_value_error(settings, experts):
    _raises(lambda: BlockPool(BlockConfig(**settings), num_layers=2, num_experts=experts))


def _fresh(mode="confidence", layers=2, experts=8):
    cfg = BlockConfig(mode=mode, pool=4, top_k=2, threshold=0.02, rescue_at=0.3)
    return BlockPool(cfg, num_layers=layers, num_experts=experts)


def test_select_before_begin_raises_value_error():
    pool = _fresh()
    _raises(lambda: pool.select(0, np.zeros((3, 8), dtype=np.float32)))


@pytest.mark.parametrize("shape", [(4, 8), (3, 9), (3,), (1, 3, 8)])
def test_scores_of_the_wrong_shape_raise_value_error(shape):
    pool = _fresh()
    pool.begin_block([0.5, 0.5])  # S = 3 positions, E = 8
    _raises(lambda: pool.select(0, np.zeros(shape, dtype=np.float32)))


@pytest.mark.parametrize("confidences", [[0.5, 1.5], [-0.1, 0.5], [0.5, float("nan")]])
def test_confidences_outside_unit_interval_raise_value_error(confidences):
    pool = _fresh()
    _raises(lambda: pool.begin_block(confidences))


@pytest.mark.parametrize("accepted", [-1, 3])
def test_accepted_outside_0_to_k_raises_value_error(accepted):
    pool = _fresh()
    pool.begin_block([0.5, 0.5])  # k = 2
    for layer in range(2):
        pool.select(layer, np.zeros((3, 8), dtype=np.float32))
    _raises(lambda: pool.end_block(accepted))


def test_select_out_of_layer_order_raises_value_error():
    pool = _fresh(layers=3)
    pool.begin_block([0.5, 0.5])
    z = np.zeros((3, 8), dtype=np.float32)
    _raises(lambda: pool.select(1, z))  # layer 1 before layer 0
    other = _fresh(layers=3)
    other.begin_block([0.5, 0.5])
    other.select(0, z)
    _raises(lambda: other.select(2, z))  # skips layer 1
    again = _fresh(layers=3)
    again.begin_prompt(3)
    again.select(0, z)
    _raises(lambda: again.select(0, z))  # the same layer twice
    last = _fresh(layers=3)
    last.begin_prompt(3)
    _raises(lambda: last.select(3, z))  # no such layer
