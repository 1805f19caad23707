"""The settings of the benchmarks' entry points (run_bench, bench_latency, run_sweep, run_free_generation): one
frozen dataclass each, validated once with a message that names the bad value and the fix, and given either as
that object or as keyword arguments."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from psr_hf import RoutingConfig
from psr_hf.bench.free_generation import FreeGenerationSettings, run_free_generation
from psr_hf.bench.offload import BenchSettings, run_bench
from psr_hf.bench.rows import ENGINE, OFFLOAD, RESIDENT, Row
from psr_hf.bench.settings import settings_of
from psr_hf.bench.sweep import SweepSettings, run_sweep
from psr_hf.bench.timing import LatencySettings, bench_latency
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PSR = RoutingConfig(policy="psr", lam=0.3, residency=0.5)
SETTINGS = (BenchSettings, LatencySettings, FreeGenerationSettings, lambda **kw: SweepSettings(model="tiny", **kw))


@pytest.mark.parametrize("make", SETTINGS)
def test_settings_are_frozen(make):
    settings = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.rounds = 9  # type: ignore[misc]


def test_keywords_build_the_settings_and_replace_fields_of_a_given_object():
    built = settings_of(BenchSettings, None, {"model": "tiny", "rounds": 4}, "run_bench")
    assert built == BenchSettings(model="tiny", rounds=4)
    assert settings_of(BenchSettings, built, {"windows": 3}, "run_bench") == BenchSettings(model="tiny", rounds=4,
                                                                                          windows=3)
    assert settings_of(BenchSettings, built, {}, "run_bench") is built


def test_an_unknown_keyword_or_another_settings_object_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"run_bench\(\) got unknown settings roundz; BenchSettings has: model"):
        settings_of(BenchSettings, None, {"roundz": 3}, "run_bench")
    with pytest.raises(TypeError, match="give a BenchSettings"):
        settings_of(BenchSettings, LatencySettings(), {}, "run_bench")


def test_sequences_are_kept_as_tuples():
    settings = BenchSettings(capacities=[0.5], configs=["psr_lam0.3_n1"], texts=["a.txt"], prefetch_budgets=[2])
    assert (settings.capacities, settings.configs, settings.texts, settings.prefetch_budgets) == (
        (0.5,), ("psr_lam0.3_n1",), ("a.txt",), (2,))
    assert BenchSettings(prefetch_budgets="window").budget_from_window
    assert SweepSettings(model="tiny", residencies=[0.5]).residencies == (0.5,)
    assert FreeGenerationSettings(tasks=["text", "text"]).tasks == ("text",)


@pytest.mark.parametrize("make, message", [
    (lambda: BenchSettings(rounds=2), "rounds=2: at least 3 rounds"),
    (lambda: BenchSettings(prefetch_budgets="max"), "prefetch_budgets='max': give budgets"),
    (lambda: LatencySettings(warmup=-1), "warmup=-1 must be >= 0"),
    (lambda: LatencySettings(configs=[Row(OFFLOAD, PSR)]), "the 'resident' row is required"),
    (lambda: LatencySettings(configs=[Row(RESIDENT), Row(RESIDENT)]), "configuration names repeat"),
    (lambda: LatencySettings(configs=[Row(RESIDENT), Row(ENGINE, PSR)]), "engine rows need the 'engine_resident'"),
    (lambda: BenchSettings(count_late=True), r"count_late counts .* add the engine rows"),
    (lambda: LatencySettings(count_late=True, device_routing=False), "device_routing=False routes none there"),
    (lambda: SweepSettings(model="tiny", stage="timing"), "stage='timing': use 'quality'"),
    (lambda: SweepSettings(model="tiny", selfgen_windows=1), "selfgen_windows=1 is too small"),
    (lambda: SweepSettings(model="tiny", residencies=(1.5,)), r"residencies \[1.5\]: give one or more in \(0, 1\)"),
    (lambda: SweepSettings(model="tiny", grid={"psr": dict(policy="psr")}), "'psr' is 'psr_lam0.2_n1'"),
    (lambda: FreeGenerationSettings(max_len=1), "--max-len 1: give at least 2 positions"),
    (lambda: FreeGenerationSettings(configs=["resident"]), "not a routed row name"),
])
def test_a_bad_setting_is_refused_naming_the_value_and_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("entry_point", [run_bench, run_sweep, run_free_generation])
def test_the_entry_points_check_their_settings_before_loading_a_model(entry_point):
    with pytest.raises(ValueError, match="at least 3"):
        entry_point(model="no-such-model", device="cpu", rounds=2)


def test_bench_latency_takes_its_settings_as_an_object_or_as_keywords():
    model = tiny_model("olmoe")
    ids = [torch.randint(3, 200, (1, 4), generator=torch.Generator().manual_seed(1))]
    settings = LatencySettings(configs=[Row(RESIDENT), Row(OFFLOAD, PSR)], rounds=3, warmup=0, offload=False)
    by_object = bench_latency(model, ids, settings)
    by_keywords = bench_latency(model, ids, configs=settings.configs, rounds=3, warmup=0, offload=False)
    assert [row["configuration"] for row in by_object] == [row["configuration"] for row in by_keywords]
    assert [row["copies"] for row in by_object] == [row["copies"] for row in by_keywords]
    assert [len(row["rounds"]) for row in by_object] == [3, 3]
