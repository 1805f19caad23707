"""Hand-worked tiny examples for the pure-Python reference policy (psr_hf.policy.reference).

Every expected decision below is derived by hand from spec/ALGORITHM.md in the comments, not from running the
code, so these tests pin the reference to the spec text.
"""

import math

import numpy as np
import pytest

from psr_hf.policy.reference import POLICIES, ReferenceLayerState, reference_replay

NEG_INF = -math.inf

# Config values shared by the direct step() calls; each test overrides what it exercises.
BASE = dict(
    top_k=2,
    lam=0.0,
    budget=0,
    window=8,
    eviction="score",
    top_j=0,
    delta_mode="fixed",
    decay_fast=0.5,
    decay_slow=0.98,
)


def _step(state, **kwargs):
    args = dict(BASE)
    args.update(kwargs)
    return state.step(**args)


def test_policies_tuple():
    assert POLICIES == ("exact", "cache_prior", "psr", "spec")


def test_part1_evicts_lowest_priority_unprotected_and_demand_spares_b():
    # E=6, K=2, C=3. Reset: R = 3 largest counts [6,5,4,3,2,1] -> {0,1,2}.
    state = ReferenceLayerState(6, 3, [6, 5, 4, 3, 2, 1])
    assert state.resident == {0, 1, 2}
    # Priority (score), computed once: s_fast = s_slow = 0, so p = prior = [0.0, 0.5, 0.2, 0.0, 0.0, 0.0].
    # g = [0,0,1,3,2,0]: ranking(g) = [3,4,2,0,1,5]; window 3 -> candidates [3,4,2]; budget 1.
    #  - 3 not in R, new=0<1, R full: evict argmin p over R\B = {0,1,2} -> p0=0.0 -> evict 0.
    #    R={1,2,3}, B=[3], prefetch (3, 0), new=1.
    #  - 4 not in R, budget spent -> skipped, but the scan continues.
    #  - 2 in R -> B=[3,2] (a resident candidate after the budget is spent still joins B).
    # Selection: lam*d = 0.5*2.0 = 1.0; z = [0.0, 0.1, -0.2, -0.5, 2.0, 1.5];
    #  biased (m=1 on {1,2,3}) = [0.0, 1.1, 0.8, 0.5, 2.0, 1.5] -> S = [4, 5].
    # Demand, S\R = [4,5] ascending:
    #  - 4: R\(S u B) = {1,2,3}\{4,5,3,2} = {1} -> evict 1 (though p1=0.5 is the *highest* priority: 2 and 3
    #    are spared because they are in B). R={2,3,4}.
    #  - 5: R\(S u B) = {} -> fall back to R\S = {2,3}: p2=0.2, p3=0.0 -> evict 3. R={2,4,5}.
    out = _step(
        state,
        policy="psr",
        lam=0.5,
        budget=1,
        window=3,
        delta=2.0,
        z=[0.0, 0.1, -0.2, -0.5, 2.0, 1.5],
        g=[0.0, 0.0, 1.0, 3.0, 2.0, 0.0],
        prior=[0.0, 0.5, 0.2, 0.0, 0.0, 0.0],
        layer=1,
    )
    assert out.selected == [4, 5]
    assert out.prefetch == [(3, 0)]
    assert out.demand == [(4, 1), (5, 3)]
    assert state.resident == {2, 4, 5}
    # Statistics from own topk(z,2) = [4,5]; last_use for S and for the prefetch insertion (3), even though 3 was
    # evicted again in the same step.
    assert state.s_fast == [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    assert state.s_slow == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.02, 0.02])
    assert state.last_use == [-1, -1, -1, 0, 0, 0]
    assert state.step_count == 1
    # Running range is tracked for every step: max - min = 2.0 - (-0.5).
    assert (state.range_sum, state.range_count) == (2.5, 1)


def test_biased_ties_go_to_larger_raw_z_then_lower_index_and_top_j_gets_bonus():
    # E=4, K=2, C=2, counts [0,3,3,0] -> ranking [1,2,0,3] -> R = {1,2}. cache_prior, lam=1, fixed d=1, LRU.
    state = ReferenceLayerState(4, 2, [0, 3, 3, 0])
    assert state.resident == {1, 2}
    common = dict(policy="cache_prior", lam=1.0, delta=1.0, eviction="lru", g=None, prior=[0.0] * 4, layer=0)
    # Step 0: z = [3.0, 0.5, -1.0, 1.5]; biased = [3.0, 1.5, 0.0, 1.5].
    #  0 first (3.0); 1 and 3 tie at 1.5 -> larger raw z wins: 3 (1.5 > 0.5), although 1 has the lower index
    #  and is resident. S = [0, 3].
    # Demand [0,3]; LRU priority = last_use = all -1:
    #  - 0: R\(S u B) = {1,2}, tie -> lower index -> evict 1. R={0,2}.
    #  - 3: R\(S u B) = {2} -> evict 2. R={0,3}.
    out = _step(state, z=[3.0, 0.5, -1.0, 1.5], **common)
    assert out.selected == [0, 3]
    assert out.prefetch == []
    assert out.demand == [(0, 1), (3, 2)]
    assert state.resident == {0, 3}
    assert state.last_use == [0, -1, -1, 0]
    # Step 1 with top_j=1: z = [0.0, 0.9, 0.2, 0.0]; topk(z,1) = [1] gets the bonus as if resident:
    #  m = [1,1,0,1], biased = [1.0, 1.9, 0.2, 1.0]. 1 first; 0 and 3 tie at 1.0 with equal raw z 0.0
    #  -> lower index 0. S = [1, 0]. (Without top_j, biased[1] = 0.9 and S would be [0, 3].)
    # Demand [1]: R\(S u B) = {0,3}\{1,0} = {3} -> evict 3. R = {0,1}.
    out = _step(state, z=[0.0, 0.9, 0.2, 0.0], top_j=1, **common)
    assert out.selected == [1, 0]
    assert out.demand == [(1, 3)]
    assert state.resident == {0, 1}
    assert state.last_use == [1, 1, -1, 0]
    assert state.step_count == 2


def test_lam_zero_gives_own_topk_and_lru_evicts_least_recent():
    # One layer (l = 0, so no part 1), E=5, K=2, C=3, psr with budget 0, lam 0, LRU; numpy float32 inputs.
    # Reset: counts [1,1,1,0,0] -> R = {0,1,2}.
    scores = np.array(
        [
            [[0.0, 0.0, 0.0, 1.0, 2.0]],
            [[2.0, 0.0, 1.0, -1.0, -2.0]],
            [[-1.0, 3.0, -2.0, 2.0, -3.0]],
        ],
        dtype=np.float32,
    )  # [T=3, L=1, E=5]
    # lam = 0: biased = z + 0.0, ties by raw z then index = ranking(z), so S = own topk(z, 2) every step.
    # t=0: S = [4,3]. p = last_use = all -1. Demand [3,4]:
    #   3: R\S = {0,1,2}, all -1 -> evict 0; R={1,2,3}.  4: R\S = {1,2} -> evict 1; R={2,3,4}.
    #   last_use[3] = last_use[4] = 0.
    # t=1: S = [0,2]. p = [-1,-1,-1,0,0]. Demand [0]: R\S = {3,4}, both 0 -> lower index 3; R={0,2,4}.
    #   last_use[0] = last_use[2] = 1.
    # t=2: S = [1,3]. p = [1,-1,1,0,0]. Demand [1,3]:
    #   1: R\S = {0,2,4}: p = 1,1,0 -> evict 4 (least recently used, not the lowest index); R={0,1,2}.
    #   3: R\S = {0,2}: p = 1,1 -> evict 0; R={1,2,3}.
    #   last_use[1] = last_use[3] = 2.
    replay = reference_replay(
        policy="psr",
        top_k=2,
        capacity=3,
        lam=0.0,
        budget=0,
        window=2,
        eviction="lru",
        top_j=0,
        delta_mode="fixed",
        decay_fast=0.5,
        decay_slow=0.98,
        scores=scores,
        pregate=np.zeros_like(scores),
        tokens=np.array([7, 8, 9]),
        delta=np.array([5.0]),
        expert_counts=np.array([[1.0, 1.0, 1.0, 0.0, 0.0]]),
        token_prior=None,
    )
    assert replay.selected == [[[3, 4]], [[0, 2]], [[1, 3]]]
    assert [[s.selected for s in row] for row in replay.steps] == [[[4, 3]], [[0, 2]], [[1, 3]]]
    assert replay.demand_copies == [[2], [1], [2]]
    assert replay.prefetch_copies == [[0], [0], [0]]
    assert [row[0].demand for row in replay.steps] == [[(3, 0), (4, 1)], [(0, 3)], [(1, 4), (3, 0)]]
    final = replay.final_states[0]
    assert final.resident == {1, 2, 3}
    assert final.last_use == [1, 2, 1, 2, 0]
    assert final.step_count == 3


def test_running_delta_includes_current_token_and_part1_stops_when_all_resident_protected():
    # E=4, K=2, C=2, counts [0,0,1,1] -> ranking [2,3,0,1] -> R = {2,3}. psr, lam 1, budget 3, window 4, score,
    # running delta (the fixed delta argument 0.0 must be ignored), zero prior, layer 1.
    state = ReferenceLayerState(4, 2, [0, 0, 1, 1])
    common = dict(policy="psr", lam=1.0, budget=3, window=4, delta_mode="running", delta=0.0, prior=[0.0] * 4, layer=1)
    # Step 0: g = [1,0,4,3] -> ranking [2,3,0,1].
    #  2 in R -> B=[2]; 3 in R -> B=[2,3]; 0 not in R, new=0<3, R full, R\B = {} -> stop part 1. No prefetch.
    # z = [0.5, 2.0, 1.0, -inf]: finite range 2.0 - 0.5 = 1.5; d = 1.5/1 = 1.5.
    #  biased (m=1 on {2,3}) = [0.5, 2.0, 2.5, -inf] -> S = [2, 1].
    # Demand [1]: R\(S u B) = {2,3}\{2,1,3} = {} -> R\S = {3} -> evict 3. R = {1,2}.
    # Stats: own topk(z,2) = [1,2] -> s_fast[1] = s_fast[2] = 0.5, s_slow = 0.02. last_use[1] = last_use[2] = 0.
    out = _step(state, z=[0.5, 2.0, 1.0, NEG_INF], g=[1.0, 0.0, 4.0, 3.0], **common)
    assert out.selected == [2, 1]
    assert out.prefetch == []
    assert out.demand == [(1, 3)]
    assert state.resident == {1, 2}
    # Step 1: priority p = s_fast + s_slow + 0 = [0, 0.52, 0.52, 0]. g = [0,0,0,1] -> ranking [3,0,1,2].
    #  3 not in R, new 0<3, R\B = {1,2}: tie at 0.52 -> lower index 1 -> evict 1. R={2,3}, B=[3], (3,1).
    #  0 not in R, new 1<3, R\B = {2} -> evict 2. R={0,3}, B=[3,0], (0,2).
    #  1 not in R, new 2<3, R\B = {} -> stop part 1 (budget 3 not used up).
    # z = [0.0, 2.0, 0.0, 3.5]: range 3.5; running d = (1.5 + 3.5) / 2 = 2.5.
    #  biased (m=1 on {0,3}) = [2.5, 2.0, 0.0, 6.0] -> S = [3, 0]; no demand.
    #  (Excluding the current token, d = 1.5 would give [3, 1]; so would the fixed delta 0.0.)
    out = _step(state, z=[0.0, 2.0, 0.0, 3.5], g=[0.0, 0.0, 0.0, 1.0], **common)
    assert out.prefetch == [(3, 1), (0, 2)]
    assert out.selected == [3, 0]
    assert out.demand == []
    assert state.resident == {0, 3}
    assert (state.range_sum, state.range_count) == (5.0, 2)
    # own topk(z,2) = [3,1]: s_fast[1] = 0.5*0.5 + 0.5 = 0.75, s_fast[2] = 0.25, s_fast[3] = 0.5.
    assert state.s_fast == [0.0, 0.75, 0.25, 0.5]
    # last_use: S {3,0} and prefetches {3,0} at step 1; 1 and 2 from step 0.
    assert state.last_use == [1, 0, 0, 1]
    assert state.step_count == 2


def test_spec_inserts_and_executes_pregate_topk_with_budget_and_window_k():
    # E=4, K=2, C=2, counts [1,1,0,0] -> R = {0,1}. spec: budget = window = K = 2 whatever is passed (0 here).
    # Priority (score) = prior = [0.3, 0.1, 0.0, 0.0].
    # Layer 1: g = [0,1,3,2] -> ranking [2,3,1,0] -> window 2 -> [2,3].
    #  2 not in R, new 0<2, R\B = {0,1}: p1 = 0.1 < p0 = 0.3 -> evict 1. R={0,2}, B=[2], (2,1).
    #  3 not in R, new 1<2, R\B = {0} -> evict 0. R={2,3}, (3,0).
    # S = ranking(g)[:2] = [2,3], although the router's own top-2 is [0,1]. No demand.
    state = ReferenceLayerState(4, 2, [1, 1, 0, 0])
    spec = dict(policy="spec", budget=0, window=0, delta=1.0, prior=[0.3, 0.1, 0.0, 0.0])
    out = _step(state, z=[5.0, 4.0, 0.0, 0.0], g=[0.0, 1.0, 3.0, 2.0], layer=1, **spec)
    assert out.selected == [2, 3]
    assert out.prefetch == [(2, 1), (3, 0)]
    assert out.demand == []
    assert state.resident == {2, 3}
    # Statistics come from the router's own top-K [0,1], not from S.
    assert state.s_fast == [0.5, 0.5, 0.0, 0.0]
    # Layer 0: no pre-gate, so no part 1 and S = topk(z, 2) = [2, 1] for z = [0, 1, 2, 0.5].
    # Demand [2]: R = {0,1}, R\S = {0} -> evict 0. R = {1,2}.
    state0 = ReferenceLayerState(4, 2, [1, 1, 0, 0])
    out = _step(state0, z=[0.0, 1.0, 2.0, 0.5], g=None, layer=0, **spec)
    assert out.selected == [2, 1]
    assert out.prefetch == []
    assert out.demand == [(2, 0)]
    assert state0.resident == {1, 2}
