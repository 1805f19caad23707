"""RoutingConfig: per-policy defaults, validation messages, derived values, YAML round trip and hostile YAML files,
replace()."""

import dataclasses
import math
import re

import pytest

from psr_hf.policy.config import DEFAULT_WINDOW, DELTA_MODES, EVICTIONS, POLICIES, RoutingConfig

FIELD_NAMES = [f.name for f in dataclasses.fields(RoutingConfig)]


def _pattern(*fragments: str) -> str:
    """A regex matching the literal ``fragments`` in this order (messages are single lines)."""
    return ".*".join(re.escape(fragment) for fragment in fragments)


# ---------------------------------------------------------------------------------------------- defaults
@pytest.mark.parametrize(
    "policy, lam, budget, eviction",
    [
        ("psr", 0.2, 1, "score"),
        ("cache_prior", 0.2, 0, "lru"),
        ("exact", 0.0, 0, "lru"),
        ("spec", 0.0, None, "score"),
    ],
)
def test_unset_fields_take_the_policy_defaults(policy, lam, budget, eviction):
    config = RoutingConfig(policy=policy, capacity=16)
    assert config.lam == lam
    assert isinstance(config.lam, float)
    assert config.budget == budget
    assert config.eviction == eviction
    assert config.window is None


def test_default_policy_is_psr():
    config = RoutingConfig(residency=0.25)
    assert config.policy == "psr"
    assert (config.lam, config.budget, config.eviction, config.window) == (0.2, 1, "score", None)


def test_shared_defaults_are_top_j_zero_fixed_delta_and_paper_decays():
    config = RoutingConfig(capacity=16)
    assert config.top_j == 0
    assert config.delta_mode == "fixed"
    assert config.decay_fast == 0.5
    assert config.decay_slow == 0.98


def test_explicit_values_override_the_policy_defaults():
    config = RoutingConfig(policy="psr", capacity=16, lam=0.35, budget=3, eviction="lru", window=5)
    assert (config.lam, config.budget, config.eviction, config.window) == (0.35, 3, "lru", 5)


def test_integer_lam_is_stored_as_float():
    config = RoutingConfig(policy="psr", capacity=16, lam=1)
    assert config.lam == 1.0
    assert isinstance(config.lam, float)


def test_module_constants_list_the_allowed_values():
    assert POLICIES == ("exact", "cache_prior", "psr", "spec")
    assert EVICTIONS == ("score", "lru")
    assert DELTA_MODES == ("fixed", "running")
    assert DEFAULT_WINDOW == 8


# ---------------------------------------------------------------------------------------------- capacity / residency
@pytest.mark.parametrize("kwargs", [{}, {"capacity": 16, "residency": 0.25}], ids=["neither", "both"])
def test_exactly_one_of_capacity_and_residency_is_required(kwargs):
    with pytest.raises(ValueError, match=_pattern("capacity=", "residency=")) as info:
        RoutingConfig(policy="psr", **kwargs)
    assert "exactly one" in str(info.value)


def test_capacity_alone_and_residency_alone_are_accepted():
    assert RoutingConfig(capacity=16).residency is None
    assert RoutingConfig(residency=0.25).capacity is None


# ---------------------------------------------------------------------------------------------- invalid values
INVALID = [
    pytest.param(
        dict(policy="bogus", capacity=16),
        _pattern("policy='bogus'", "allowed: exact, cache_prior, psr, spec"),
        id="unknown-policy",
    ),
    pytest.param(
        dict(capacity=16, eviction="fifo"), _pattern("eviction='fifo'", "allowed: score, lru"), id="unknown-eviction"
    ),
    pytest.param(
        dict(capacity=16, delta_mode="adaptive"),
        _pattern("delta_mode='adaptive'", "allowed: fixed, running"),
        id="unknown-delta-mode",
    ),
    pytest.param(dict(capacity=16, lam=-0.1), _pattern("lam=-0.1", "finite number >= 0"), id="negative-lam"),
    pytest.param(dict(capacity=16, lam=math.nan), _pattern("lam=nan", "finite number >= 0"), id="nan-lam"),
    pytest.param(dict(capacity=16, lam=math.inf), _pattern("lam=inf", "finite number >= 0"), id="inf-lam"),
    pytest.param(dict(capacity=16, lam="0.2"), _pattern("lam='0.2'", "finite number >= 0"), id="string-lam"),
    pytest.param(
        dict(policy="exact", capacity=16, lam=0.2),
        _pattern("lam=0.2", "policy='exact'", "cache_prior", "psr"),
        id="lam-with-exact",
    ),
    pytest.param(
        dict(policy="spec", capacity=16, lam=0.2),
        _pattern("lam=0.2", "policy='spec'", "cache_prior", "psr"),
        id="lam-with-spec",
    ),
    pytest.param(
        dict(policy="cache_prior", capacity=16, budget=1),
        _pattern("budget=1", "policy='cache_prior'", "budget=0"),
        id="budget-with-cache-prior",
    ),
    pytest.param(dict(capacity=16, budget=-1), _pattern("budget=-1", "int >= 0"), id="negative-budget"),
    pytest.param(dict(capacity=16, budget=1.5), _pattern("budget=1.5", "int >= 0"), id="float-budget"),
    pytest.param(
        dict(policy="cache_prior", capacity=16, window=4),
        _pattern("window=4", "policy='cache_prior'"),
        id="window-with-cache-prior",
    ),
    pytest.param(dict(capacity=16, window=0), _pattern("window=0", "int >= 1"), id="window-0"),
    pytest.param(
        dict(policy="exact", capacity=16, top_j=2),
        _pattern("top_j=2", "policy='cache_prior' or 'psr'", "'exact'"),
        id="top-j-with-exact",
    ),
    pytest.param(dict(capacity=16, top_j=-1), _pattern("top_j=-1", "int >= 0"), id="negative-top-j"),
    pytest.param(
        dict(policy="spec", capacity=16, delta_mode="running"),
        _pattern("delta_mode='running'", "policy='cache_prior' or 'psr'", "'spec'"),
        id="running-delta-with-spec",
    ),
    pytest.param(dict(capacity=16, decay_fast=1.0), _pattern("decay_fast=1.0", "[0, 1)"), id="decay-fast-1"),
    pytest.param(dict(capacity=16, decay_slow=-0.1), _pattern("decay_slow=-0.1", "[0, 1)"), id="decay-slow-negative"),
    pytest.param(dict(capacity=0), _pattern("capacity=0", "int >= 1"), id="capacity-0"),
    pytest.param(dict(capacity=True), _pattern("capacity=True", "int >= 1"), id="bool-capacity"),
    pytest.param(dict(capacity=16.0), _pattern("capacity=16.0", "int >= 1"), id="float-capacity"),
    pytest.param(dict(residency=0.0), _pattern("residency=0.0", "(0, 1]"), id="residency-0"),
    pytest.param(dict(residency=1.5), _pattern("residency=1.5", "(0, 1]"), id="residency-1.5"),
    pytest.param(dict(residency=True), _pattern("residency=True", "(0, 1]"), id="bool-residency"),
]


@pytest.mark.parametrize("kwargs, message", INVALID)
def test_invalid_value_is_rejected_naming_the_field_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(policy="exact", capacity=16, lam=0.0),
        dict(policy="exact", capacity=16, budget=2, window=4),
        dict(policy="psr", capacity=16, budget=0, top_j=2, eviction="lru"),
        dict(policy="cache_prior", capacity=16, top_j=3, delta_mode="running"),
        dict(policy="psr", capacity=16, delta_mode="running", decay_fast=0.0, decay_slow=0.0),
        dict(policy="spec", residency=1.0),
        dict(policy="spec", residency=1),
    ],
)
def test_valid_boundary_combinations_are_accepted(kwargs):
    config = RoutingConfig(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=10**7), r"budget=10000000 must be an int >= 0 and <= 65536"),
    (dict(budget=10**11), r"budget=100000000000 must be an int >= 0 and <= 65536"),
    (dict(window=10**9), r"window=1000000000 must be an int >= 1 and <= 65536"),
    (dict(top_j=10**9), r"top_j=1000000000 must be an int >= 0 and <= 65536"),
    (dict(capacity=10**9, residency=None), r"capacity=1000000000 must be an int >= 1 and <= 65536"),
])
def test_absurd_sizes_are_refused_when_the_config_is_made(kwargs, message):
    values = dict(policy="psr", residency=0.5)
    values.update(kwargs)
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**values)


def test_a_misspelled_policy_gets_a_suggestion():
    import psr_hf

    with pytest.raises(ValueError, match=r"policy='pssr' is not supported; allowed: .*did you mean 'psr'\?"):
        psr_hf.RoutingConfig(policy="pssr", residency=0.5)


# ---------------------------------------------------------------------------------------------- capacity_for
@pytest.mark.parametrize("residency", [0.5, 0.25, 0.375, 0.125, 1.0])
def test_capacity_for_rounds_residency_times_num_experts(residency):
    num_experts = 64
    expected = round(residency * num_experts)  # these products are exact integers
    assert expected == residency * num_experts
    assert RoutingConfig(residency=residency).capacity_for(num_experts, top_k=8) == expected


def test_capacity_for_residency_of_64_experts_gives_paper_slot_counts():
    assert RoutingConfig(residency=0.5).capacity_for(64, 8) == 32
    assert RoutingConfig(residency=0.25).capacity_for(64, 8) == 16
    assert RoutingConfig(residency=0.375).capacity_for(64, 8) == 24


def test_capacity_for_returns_explicit_capacity_between_top_k_and_num_experts():
    assert RoutingConfig(capacity=8).capacity_for(64, 8) == 8
    assert RoutingConfig(capacity=64).capacity_for(64, 8) == 64
    assert RoutingConfig(capacity=20).capacity_for(64, 8) == 20


def test_capacity_below_top_k_is_rejected():
    with pytest.raises(ValueError, match=_pattern("capacity=4", "top-k (8)")):
        RoutingConfig(capacity=4).capacity_for(64, 8)


def test_residency_giving_fewer_slots_than_top_k_is_rejected():
    with pytest.raises(ValueError, match=_pattern("residency=0.0625", "= 4 slots", "top-k (8)")):
        RoutingConfig(residency=0.0625).capacity_for(64, 8)


def test_capacity_above_num_experts_is_rejected():
    with pytest.raises(ValueError, match=_pattern("capacity=65", "exceeds", "(64)")):
        RoutingConfig(capacity=65).capacity_for(64, 8)


# ---------------------------------------------------------------------------------------------- window / budget
@pytest.mark.parametrize("top_k", [2, 6, 8])
def test_spec_window_and_budget_are_top_k(top_k):
    config = RoutingConfig(policy="spec", capacity=16)
    assert config.window_for(top_k) == top_k
    assert config.window_for(top_k, default=4) == top_k
    assert config.budget_for(top_k) == top_k


def test_window_for_defaults_to_eight():
    assert RoutingConfig(capacity=16).window_for(top_k=8) == 8
    assert RoutingConfig(capacity=16).window_for(top_k=8) == DEFAULT_WINDOW


def test_window_for_uses_the_architecture_default_when_window_is_unset():
    assert RoutingConfig(capacity=16).window_for(top_k=6, default=4) == 4


def test_explicit_window_wins_over_the_architecture_default():
    assert RoutingConfig(capacity=16, window=3).window_for(top_k=6, default=4) == 3


def test_budget_for_returns_the_configured_budget_for_non_spec_policies():
    assert RoutingConfig(capacity=16).budget_for(8) == 1
    assert RoutingConfig(capacity=16, budget=3).budget_for(8) == 3
    assert RoutingConfig(policy="exact", capacity=16, budget=2).budget_for(8) == 2
    assert RoutingConfig(policy="cache_prior", capacity=16).budget_for(8) == 0


# ---------------------------------------------------------------------------------------------- inserts / biased
@pytest.mark.parametrize(
    "kwargs, inserts",
    [
        (dict(policy="psr", budget=0), False),
        (dict(policy="psr", budget=1), True),
        (dict(policy="exact", budget=2), True),
        (dict(policy="exact"), False),
        (dict(policy="cache_prior"), False),
        (dict(policy="spec"), True),
    ],
)
def test_inserts_is_true_only_for_policies_that_run_part_one(kwargs, inserts):
    assert RoutingConfig(capacity=16, **kwargs).inserts is inserts


@pytest.mark.parametrize("policy, biased", [("psr", True), ("cache_prior", True), ("exact", False), ("spec", False)])
def test_biased_is_true_for_the_policies_with_a_routing_bonus(policy, biased):
    assert RoutingConfig(policy=policy, capacity=16).biased is biased


# ---------------------------------------------------------------------------------------------- serialisation
ROUND_TRIP = [
    pytest.param(dict(residency=0.25), id="psr-defaults"),
    pytest.param(dict(policy="cache_prior", capacity=16, top_j=2, delta_mode="running"), id="cache-prior"),
    pytest.param(dict(policy="exact", capacity=24, budget=2, window=4), id="exact-prefetch"),
    pytest.param(dict(policy="exact", residency=0.5), id="exact"),
    pytest.param(dict(policy="spec", residency=0.375), id="spec"),
    pytest.param(
        dict(policy="psr", capacity=32, lam=0.35, budget=3, window=12, eviction="lru", decay_fast=0.3, decay_slow=0.9),
        id="psr-custom",
    ),
]


@pytest.mark.parametrize("kwargs", ROUND_TRIP)
def test_yaml_round_trip_gives_an_equal_config(tmp_path, kwargs):
    config = RoutingConfig(**kwargs)
    path = tmp_path / "routing.yaml"
    config.save_yaml(path)
    loaded = RoutingConfig.load_yaml(path)
    assert loaded == config
    assert dataclasses.asdict(loaded) == dataclasses.asdict(config)


def test_saved_yaml_lists_every_field_with_resolved_defaults(tmp_path):
    import yaml

    path = tmp_path / "routing.yaml"
    RoutingConfig(policy="cache_prior", residency=0.25).save_yaml(path)
    data = yaml.safe_load(path.read_text())
    assert list(data) == FIELD_NAMES
    assert data["lam"] == 0.2
    assert data["budget"] == 0
    assert data["eviction"] == "lru"


def test_hand_written_yaml_takes_policy_defaults(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("policy: cache_prior\ncapacity: 16\n")
    assert RoutingConfig.load_yaml(path) == RoutingConfig(policy="cache_prior", capacity=16)


@pytest.mark.parametrize("kwargs", ROUND_TRIP)
def test_to_dict_from_dict_round_trip_gives_an_equal_config(kwargs):
    config = RoutingConfig(**kwargs)
    assert RoutingConfig.from_dict(config.to_dict()) == config


def test_from_dict_with_an_unknown_key_lists_the_allowed_names():
    with pytest.raises(ValueError, match=_pattern("capacty", "allowed: " + ", ".join(FIELD_NAMES))):
        RoutingConfig.from_dict({"policy": "psr", "capacty": 16})


def test_yaml_file_holding_a_list_is_rejected(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("- psr\n- 16\n")
    with pytest.raises(ValueError, match=_pattern("expected a YAML mapping", "got list")):
        RoutingConfig.load_yaml(path)


def test_yaml_file_with_invalid_values_is_rejected_like_the_constructor(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("policy: cache_prior\ncapacity: 16\nbudget: 2\n")
    with pytest.raises(ValueError, match=_pattern("budget=2", "policy='cache_prior'")):
        RoutingConfig.load_yaml(path)


def test_a_yaml_with_a_duplicate_key_is_refused(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("policy: psr\nresidency: 0.5\nbudget: 1\nbudget: 3\n")
    with pytest.raises(ValueError, match=r"routing.yaml: key 'budget' appears more than once \(line 4\)"):
        RoutingConfig.load_yaml(path)
    path.write_text("base: &base {policy: psr, residency: 0.5}\n")  # anchors and plain files still load
    with pytest.raises(ValueError, match="unknown RoutingConfig field"):
        RoutingConfig.load_yaml(path)


@pytest.mark.parametrize("text, message", [
    ("policy: [psr]\nresidency: 0.5\n", r"policy=\['psr'\] is not supported; allowed: .*\(a policy name, as a string\)"),
    ("policy: !!python/object/apply:os.system ['true']\n", r"YAML tags that build objects are refused"),
    ("policy: psr\n  residency: [0.5\n", r"not valid YAML"),
])
def test_a_hostile_routing_yaml_is_a_value_error_naming_the_problem(tmp_path, text, message):
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        RoutingConfig.load_yaml(path)


@pytest.mark.parametrize("name", ["routing.YAML", "routing.Yml", "routing.yml"])
def test_yaml_suffixes_in_any_case_are_read(tmp_path, name):
    path = tmp_path / name
    RoutingConfig(policy="psr", residency=0.25, budget=2).save_yaml(path)
    assert RoutingConfig.coerce(path) == RoutingConfig(policy="psr", residency=0.25, budget=2)
    assert RoutingConfig.coerce(str(path)) == RoutingConfig(policy="psr", residency=0.25, budget=2)


def test_a_path_without_a_yaml_suffix_gets_an_accurate_error(tmp_path):
    with pytest.raises(ValueError, match=r"path to its YAML file, whose name ends in \.yaml or \.yml \(any case\); "
                                         r"got str '.*routing.json', which does not"):
        RoutingConfig.coerce(str(tmp_path / "routing.json"))


# ---------------------------------------------------------------------------------------------- replace / frozen
def test_replace_policy_re_resolves_the_policy_defaults():
    psr = RoutingConfig(policy="psr", residency=0.25)
    cache_prior = psr.replace(policy="cache_prior")
    assert cache_prior == RoutingConfig(policy="cache_prior", residency=0.25)
    assert (cache_prior.budget, cache_prior.eviction) == (0, "lru")


def test_replace_policy_drops_explicit_values_of_the_old_policy():
    psr = RoutingConfig(policy="psr", capacity=16, lam=0.5, budget=3, eviction="lru")
    exact = psr.replace(policy="exact")
    assert (exact.lam, exact.budget, exact.eviction) == (0.0, 0, "lru")
    spec = psr.replace(policy="spec")
    assert (spec.lam, spec.budget, spec.eviction) == (0.0, None, "score")


def test_replace_policy_keeps_values_given_in_the_same_call():
    changed = RoutingConfig(capacity=16).replace(policy="cache_prior", lam=0.4)
    assert (changed.policy, changed.lam, changed.budget) == ("cache_prior", 0.4, 0)


def test_replace_without_policy_change_keeps_explicit_values():
    config = RoutingConfig(policy="psr", capacity=16, budget=3, eviction="lru")
    changed = config.replace(lam=0.1)
    assert (changed.lam, changed.budget, changed.eviction) == (0.1, 3, "lru")


def test_replace_capacity_on_a_residency_config_switches_to_capacity():
    changed = RoutingConfig(residency=0.25).replace(capacity=24)
    assert (changed.capacity, changed.residency) == (24, None)
    assert changed.capacity_for(64, 8) == 24


def test_replace_residency_on_a_capacity_config_switches_to_residency():
    changed = RoutingConfig(capacity=24).replace(residency=0.5)
    assert (changed.capacity, changed.residency) == (None, 0.5)
    assert changed.capacity_for(64, 8) == 32


def test_replace_validates_the_result():
    with pytest.raises(ValueError, match=_pattern("eviction='fifo'", "allowed: score, lru")):
        RoutingConfig(capacity=16).replace(eviction="fifo")


def test_replace_leaves_the_original_unchanged():
    config = RoutingConfig(capacity=16)
    config.replace(policy="exact", capacity=32)
    assert config == RoutingConfig(capacity=16)


def test_config_is_frozen():
    config = RoutingConfig(capacity=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lam = 0.3  # type: ignore[misc]
    assert config.lam == 0.2


def test_equal_configs_hash_equal():
    assert hash(RoutingConfig(capacity=16)) == hash(RoutingConfig(capacity=16, lam=0.2, budget=1))
    assert RoutingConfig(capacity=16) != RoutingConfig(capacity=17)


def test_spec_accepts_budget_and_window_equal_to_top_k_and_rejects_others():
    config = RoutingConfig(policy="spec", capacity=16, budget=8, window=8)
    assert (config.budget_for(8), config.window_for(8)) == (8, 8)
    for kwargs, name in ((dict(budget=2), "budget"), (dict(window=4), "window")):
        config = RoutingConfig(policy="spec", capacity=16, **kwargs)
        with pytest.raises(ValueError, match=f"{name}=.*policy='spec'.*K = 8"):
            config.budget_for(8) if name == "budget" else config.window_for(8)
    with pytest.raises(ValueError, match="budget=0"):
        RoutingConfig(policy="spec", capacity=16, budget=0)


def test_window_is_kept_with_budget_zero_for_budget_sweeps():
    for policy in ("psr", "exact"):
        config = RoutingConfig(policy=policy, capacity=16, budget=0, window=4)
        assert config.window_for(8) == 4 and not config.inserts
