"""The policy table (policies.py) drives RoutingConfig and LogicalCache; the copy plan's layout is defined once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import psr_hf.policy
from psr_hf.policy import _kernels as K_
from psr_hf.policy import policies
from psr_hf.policy import Calibration, LogicalCache, PlanLayout, RoutingConfig
from psr_hf.policy.config import POLICIES
from psr_hf.policy.policies import (
    DEFAULTED_FIELDS,
    OPTIONS,
    PART1_ALWAYS,
    PART1_NEVER,
    PART1_WITH_BUDGET,
    POLICY_TABLE,
    Policy,
    users_of,
)

# ALGORITHM.md's "Policies" table, written out by hand: (part 1, biased selection, executes the pre-gate's top-K)
ALGORITHM_MD = {
    "exact": (PART1_WITH_BUDGET, False, False),
    "cache_prior": (PART1_NEVER, True, False),
    "psr": (PART1_WITH_BUDGET, True, False),
    "spec": (PART1_ALWAYS, False, True),
}
# a value each option takes when it is used (its neutral value is lam 0, budget 0, window None, top_j 0, 'fixed')
USED_VALUE = {"lam": 0.3, "budget": 2, "window": 4, "top_j": 1, "delta_mode": "running"}


def _budgets(budgets: list) -> list[tuple[str, object]]:
    """(policy, budget) pairs the policy accepts at construction: its default (None), 0 where budget is not
    fixed to K, and positive budgets where it reads one."""
    pairs = []
    for name, entry in POLICY_TABLE.items():
        for budget in budgets:
            if budget is None or (budget == 0 and not entry.top_k_window) or (budget > 0 and "budget" in entry.options):
                pairs.append((name, budget))
    return pairs


# ---------------------------------------------------------------------------------------------- the table
def test_the_table_lists_the_policies_of_algorithm_md_with_their_behaviour():
    assert tuple(POLICY_TABLE) == tuple(ALGORITHM_MD)
    for name, (part1, biased, executes_pregate) in ALGORITHM_MD.items():
        entry = POLICY_TABLE[name]
        assert entry.name == name
        assert (entry.part1, entry.biased, entry.executes_pregate) == (part1, biased, executes_pregate), name
        assert entry.description


def test_policies_names_are_derived_from_the_table():
    assert POLICIES == tuple(POLICY_TABLE)
    assert psr_hf.policy.POLICIES == POLICIES
    assert psr_hf.policy.POLICY_TABLE is POLICY_TABLE


def test_kernel_codes_are_distinct():
    codes = [entry.code for entry in POLICY_TABLE.values()]
    assert len(set(codes)) == len(codes)


def test_table_entries_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        POLICY_TABLE["psr"].lam = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes, rule",
    [
        (dict(executes_pregate=True), "either biased or the pre-gate"),
        (dict(options=frozenset({"budget", "window", "top_j", "delta_mode"})), "lam is an option"),
        (dict(part1=PART1_NEVER), "budget is an option"),
        (dict(part1="sometimes"), "part1='sometimes'"),
        (dict(options=frozenset({"lam", "budget", "window", "speed"})), "options"),
        (dict(budget=None), "top_k_window"),
    ],
)
def test_a_contradictory_table_entry_is_rejected_naming_the_rule(changes, rule):
    with pytest.raises(ValueError, match=rule):
        dataclasses.replace(POLICY_TABLE["psr"], **changes)


def test_the_papers_policies_carry_their_labels_and_grid_stems():
    names = {name: (entry.paper.label, entry.paper.stem) for name, entry in POLICY_TABLE.items()}
    assert names == {"exact": ("exact", "exact"), "cache_prior": ("Cache-Prior", "cp"), "psr": ("PSR", "psr"),
                     "spec": ("spec", "spec")}


def test_a_paper_name_taken_by_another_entry_is_rejected():
    psr = POLICY_TABLE["psr"]
    twin = dataclasses.replace(psr, name="psr_twin", code=99)
    with pytest.raises(ValueError, match="paper label 'PSR' or stem 'psr' is taken"):
        policies._table([psr, twin])
    assert policies._table([psr, dataclasses.replace(twin, paper=None)])["psr_twin"].paper is None


@pytest.mark.parametrize("policy", list(POLICY_TABLE))
def test_can_prefetch_is_whether_part1_ever_runs(policy):
    part1, _, _ = ALGORITHM_MD[policy]
    assert POLICY_TABLE[policy].can_prefetch is (part1 != PART1_NEVER)


def test_users_of_lists_the_policies_reading_an_option_in_table_order():
    assert users_of("lam") == ("cache_prior", "psr")
    assert users_of("budget") == ("exact", "psr", "spec")
    for option in OPTIONS:
        assert users_of(option) == tuple(n for n, p in POLICY_TABLE.items() if option in p.options)


def test_policies_module_imports_without_numpy():
    code = "import sys, psr_hf.policy.policies, psr_hf.policy.config; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------------------------------------- RoutingConfig
@pytest.mark.parametrize("policy", list(POLICY_TABLE))
def test_every_policy_takes_its_defaults_from_the_table(policy):
    entry = POLICY_TABLE[policy]
    config = RoutingConfig(policy=policy, residency=0.5)
    assert config.definition is entry
    for name in DEFAULTED_FIELDS:
        assert getattr(config, name) == getattr(entry, name), name
    assert config.window is None


@pytest.mark.parametrize("policy, budget", _budgets([None, 0, 1, 3]))
def test_inserts_biased_and_pregate_flags_follow_the_table(policy, budget):
    entry = POLICY_TABLE[policy]
    config = RoutingConfig(policy=policy, residency=0.5, budget=budget)
    part1, biased, executes_pregate = ALGORITHM_MD[policy]
    resolved = config.budget
    inserts = part1 == PART1_ALWAYS or (part1 == PART1_WITH_BUDGET and resolved > 0)
    assert config.inserts is inserts
    assert config.biased is biased
    assert config.executes_pregate is executes_pregate
    assert config.needs_pregate is (inserts or executes_pregate)
    assert config.inserts is entry.inserts(resolved)


@pytest.mark.parametrize("policy", list(POLICY_TABLE))
@pytest.mark.parametrize("option", OPTIONS)
def test_an_option_is_accepted_exactly_by_the_policies_that_read_it(policy, option):
    kwargs = {option: USED_VALUE[option]}
    if option == "window":
        kwargs["budget"] = None  # the policy's default (exact's 0 keeps a window inert, as in a budget sweep)
    if option in POLICY_TABLE[policy].options:
        config = RoutingConfig(policy=policy, capacity=16, **kwargs)
        assert getattr(config, option) == USED_VALUE[option]
    else:
        with pytest.raises(ValueError, match=f"{option}=.*'{policy}'"):
            RoutingConfig(policy=policy, capacity=16, **kwargs)


def test_messages_name_the_policies_that_read_the_option():
    with pytest.raises(ValueError, match="only exact with budget > 0, psr with budget > 0 and spec use the window"):
        RoutingConfig(policy="cache_prior", capacity=16, window=4)
    with pytest.raises(ValueError, match="use policy='psr' for a prefetch budget"):
        RoutingConfig(policy="cache_prior", capacity=16, budget=1)


def test_routing_config_docstring_shows_the_table():
    for entry in POLICY_TABLE.values():
        assert entry.description in RoutingConfig.__doc__
    assert "{policies}" not in RoutingConfig.__doc__


# ---------------------------------------------------------------------------------------------- LogicalCache
@pytest.mark.parametrize("policy, budget", _budgets([None, 0, 2]))
def test_logical_cache_passes_the_tables_code_and_flags_to_the_kernel(policy, budget):
    entry = POLICY_TABLE[policy]
    config = RoutingConfig(policy=policy, capacity=4, budget=budget)
    cache = LogicalCache(config, num_layers=2, num_experts=8, top_k=2, calibration=Calibration.empty(2, 8))
    mi = cache._mi
    assert mi[K_.MI_POLICY] == entry.code
    assert mi[K_.MI_INSERTS] == int(config.inserts)
    assert mi[K_.MI_BIASED] == int(entry.biased)
    assert mi[K_.MI_EXECUTES_PREGATE] == int(entry.executes_pregate)
    # and the cache asks for the pre-gate exactly when the config says it needs it
    z = np.arange(8, dtype=np.float32)[None]
    if config.needs_pregate:
        with pytest.raises(ValueError, match="pre-gate"):
            cache.step(1, z)
    else:
        cache.step(1, z)


def test_select_of_a_policy_executing_the_pregate_needs_the_pregate():
    config = RoutingConfig(policy="spec", capacity=4)
    cache = LogicalCache(config, num_layers=2, num_experts=8, top_k=2)
    z = np.arange(8, dtype=np.float32)[None]
    cache.prefetch(1, z)
    with pytest.raises(ValueError, match="pre-gate"):
        cache.select(1, z)


# ---------------------------------------------------------------------------------------------- plan layout
FIELD_WIDTHS = {  # what each field holds, stated independently of plan_layout
    "selected": lambda K, P: K,
    "n_prefetch": lambda K, P: 1,
    "prefetch": lambda K, P: P,
    "prefetch_evicted": lambda K, P: P,
    "n_demand": lambda K, P: 1,
    "demand": lambda K, P: K,
    "demand_evicted": lambda K, P: K,
    "n_replaced": lambda K, P: 1,
}


@pytest.mark.parametrize("K", [1, 2, 6, 8])
@pytest.mark.parametrize("P", [0, 1, 3, 8])
def test_plan_layout_tiles_the_plan_width_without_overlap_or_gap(K, P):
    columns = PlanLayout.of(K, P).columns
    assert tuple(K_.plan_layout(K, P)) == tuple(columns)  # the compiled and the Python layout agree
    spans = sorted((getattr(columns, name), width(K, P), name) for name, width in FIELD_WIDTHS.items())
    assert set(columns._fields) == set(FIELD_WIDTHS) | {"width"}
    covered = [0] * columns.width
    for start, width, name in spans:
        for column in range(start, start + width):
            covered[column] += 1
    assert covered == [1] * columns.width
    assert columns.width == 3 * K + 2 * P + 3


def test_step_plan_accessors_read_the_columns_the_kernel_writes():
    # exact with budget 1, window 2, LRU, C = 3 of E = 8, warm set {0, 1, 2}, every last_use -1 (ties: lower index)
    config = RoutingConfig(policy="exact", capacity=3, budget=1, window=2, eviction="lru")
    cache = LogicalCache(config, num_layers=2, num_experts=8, top_k=2)
    pregate = np.array([[0, 9, 0, 0, 0, 8, 0, 0]], dtype=np.float32)  # ranking 1 (resident: joins B), 5
    scores = np.array([[0, 0, 5, 0, 0, 0, 9, 0]], dtype=np.float32)  # top-2: 6, 2
    plan = cache.step(1, scores, pregate)
    # part 1: 5 evicts the least recent of R \ B = {0, 2}: 0. Step 5: 6 evicts from R \ (S + B) = {1, 2, 5} \
    # {6, 2, 1, 5}, empty, so from R \ S = {1, 5}: 1.
    assert plan.plan[0, 0].tolist() == [6, 2, 1, 5, 0, 1, 6, -1, 1, -1, 0]
    assert plan.selected.tolist() == [[[6, 2]]]
    assert plan.prefetch_count.tolist() == [[1]]
    assert plan.prefetch_experts.tolist() == [[[5]]]
    assert plan.prefetch_evicted.tolist() == [[[0]]]
    assert plan.demand_count.tolist() == [[1]]
    assert plan.demand_experts.tolist() == [[[6, -1]]]
    assert plan.demand_evicted.tolist() == [[[1, -1]]]
    assert plan.replaced.tolist() == [[0]]
    assert cache.resident(1).tolist() == [2, 5, 6]


def test_step_plan_replaced_column_holds_the_replaced_router_slots():
    # cache_prior, K = 1, C = 2 of E = 4, warm set {0, 1}, bonus lam * delta = 1: z + m = [1, 1.1, 0, 0.5]
    cal = Calibration.from_arrays(delta=np.full(2, 1.0), expert_counts=np.ones((2, 4)))
    config = RoutingConfig(policy="cache_prior", capacity=2, lam=1.0)
    cache = LogicalCache(config, num_layers=2, num_experts=4, top_k=1, calibration=cal)
    plan = cache.step(0, np.array([[0, 0.1, 0, 0.5]], dtype=np.float32))
    assert plan.plan[0, 0].tolist() == [1, 0, 0, -1, -1, 1]  # K = 1, P = 0: no prefetch columns
    assert plan.replaced_column == 5
    assert plan.replaced.tolist() == [[1]]  # 1 runs instead of the router's own 3
    assert plan.prefetch_experts.shape == (1, 1, 0)
    assert plan.selected.tolist() == [[[1]]] and plan.demand_count.tolist() == [[0]]
    assert cache.stats().replaced.tolist() == [[1], [0]]
