"""The latency benchmark's typed rows (psr_hf.bench.rows) and the routing grid they name (psr_hf.eval.grid): names
are derived from the fields, unique within a grid, and read back to the same row; the committed records read."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from psr_hf import RoutingConfig
from psr_hf.bench.rows import (ACCELERATE, BASELINES, ENGINE, ENGINE_RESIDENT, OFFLOAD, RESIDENT, Row, latency_rows,
                               prefetch_configs, routed)
from psr_hf.bench.sweep import sweep_grid
from psr_hf.eval.divergence import sweep_configs
from psr_hf.eval.grid import entry_name, psr, routing_from_name, routing_grid, routing_name

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [dict(), dict(engine=True), dict(engine=True, prefetch_budgets=(1, 2, 16), predictor=True),
            dict(accelerate=False, engine=True, hf_only=[], prefetch_budgets=(3,))]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("capacities", [(0.5, 0.25), (0.75, 0.1)])
def test_every_row_of_the_grid_reads_back_from_its_unique_name(settings, capacities):
    rows = latency_rows(capacities, **settings)
    names = [row.name for row in rows]
    assert len(set(names)) == len(names)
    for row in rows:
        assert Row.from_name(row.name) == row, row.name


def test_every_grid_entry_is_named_by_its_fields_and_reads_back():
    grids = [BASELINES, sweep_grid(), sweep_grid(evictions=("score",), published=False, lams=(0.125, 1e-3)),
             sweep_grid(lams=(0.2,), psr_windows=(2, 16)), prefetch_configs((1, 2, 64))]
    for grid in grids:
        for name, fields in grid.items():
            assert entry_name(fields) == name and routing_from_name(name) == fields
    assert list(BASELINES) == ["exact_lru", "exact_a_pf", "cp_lam0.2", "psr_lam0.2_n1", "psr_lam0.3_n1", "spec"]
    deeper = psr(0.3, 2, distance=2)  # prefetches ranked two MoE layers ahead
    assert entry_name(deeper) == "psr_lam0.3_n2_d2" and routing_from_name("psr_lam0.3_n2_d2") == deeper
    assert routing_from_name("psr_lam0.3_n2_d1") is None  # distance 1 is the name without _d
    with pytest.raises(ValueError, match="no name"):  # only psr's names carry a distance
        routing_name(RoutingConfig(policy="exact", budget=1, eviction="score", residency=0.5, prefetch_distance=2))
    assert routing_grid(BASELINES.values()) == BASELINES


def test_the_divergence_grid_names_its_configurations_by_the_same_rule():
    configs = sweep_configs((0.5, 0.375), (0.1, 0.3), budget=2, predictor=True)
    for name, config in configs.items():
        stem, _, percent = name.rpartition("_res")
        assert stem == routing_name(config) and float(percent) == 100 * config.residency
        assert RoutingConfig(residency=config.residency, **routing_from_name(stem)) == config
    assert "psr_lam0.3_n2_pred_res37.5" in configs


def test_names_nothing_names_read_back_to_none():
    for name in ("psr", "psr_res50", "cp_lam0.20_res50", "exact_lru_res0", "exact_lru_res50_nocopy", "naive_m0_res50",
                 "engine_spec", "specprefetch_m2", "foo_res50", "exact_lru_res150"):
        assert Row.from_name(name) is None, name
    assert Row.from_name("engine_resident") == Row(ENGINE_RESIDENT)


def test_rows_refuse_fields_that_do_not_go_together():
    routing = RoutingConfig(policy="psr", lam=0.3, residency=0.5)
    with pytest.raises(ValueError, match="no routing"):
        Row(RESIDENT, routing)
    with pytest.raises(ValueError, match="residency"):
        Row(OFFLOAD, RoutingConfig(policy="psr", capacity=8))
    with pytest.raises(ValueError, match="only engine rows"):
        Row(OFFLOAD, routing, copies_skipped=True)
    with pytest.raises(ValueError, match="kind"):
        Row("fast", routing)
    with pytest.raises(ValueError, match="no name"):
        Row(OFFLOAD, RoutingConfig(policy="psr", lam=0.3, residency=0.5, decay_fast=0.4))
    assert Row(ENGINE, routing, copies_skipped=True).name == "engine_psr_lam0.3_n1_res50_nocopy"
    assert routed(ENGINE, BASELINES["exact_lru"], 0.25).routing_name == "exact_lru"
    assert Row(ACCELERATE).routing_name == ACCELERATE and Row(ACCELERATE).residency is None


def _latency_records():
    paths = [*(ROOT / "benchmarks").rglob("*.json"), *(ROOT / "benchmarks").rglob("*.json.xz")]
    for path in sorted(paths):  # the larger superseded records are committed xz-compressed
        try:
            text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
            record = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and record.get("benchmark") == "latency":
            yield path, record["results"]
        if isinstance(record, dict) and record.get("benchmark") == "sweep":
            for entry in record["latency"].values():
                yield path, entry.get("rows", [])


def test_the_committed_records_rows_read_back_to_their_fields():
    seen = 0
    for path, results in _latency_records():
        for result in results:
            row = Row.from_name(result["configuration"])
            assert row is not None, (path, result["configuration"])
            assert (row.kind, row.routing_name) == (result["kind"], result["policy"]), path
            if row.routing is not None:  # the name holds the residency in whole percent (0.375: _res38)
                assert row.residency == round(100 * result["residency"]) / 100, path
                recorded = {k: v for k, v in result["routing"].items() if k not in ("capacity", "residency")}
                assert {k: v for k, v in row.routing.to_dict().items() if k in recorded} == recorded, path
            seen += 1
    assert seen > 100
