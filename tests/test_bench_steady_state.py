"""benchmarks/engine/bench_steady_state.py: a bench record judged again without each window's first timed steps."""

import json
import lzma

import numpy as np
import pytest

from module_files import ROOT, load_module

steady = load_module("bench_steady_state", ROOT / "benchmarks" / "engine" / "bench_steady_state.py")


def _record(first_step_ms: dict[str, float]) -> dict:
    """Two engine rows, 3 rounds of 2 windows of 5 positions; each row's first timed step costs what it is given."""
    rng = np.random.default_rng(0)
    results = []
    for name, base in (("engine_resident", 1.5), ("engine_psr_lam0.3_n1_res50", 3.0)):
        rounds = []
        for _ in range(3):
            ms = [[first_step_ms[name]] + list(base + 0.01 * rng.standard_normal(4)) for _ in range(2)]
            rounds.append({"ms": ms, "ms_per_token": float(np.mean(ms)), "stats": {}})
        means = [r["ms_per_token"] for r in rounds]
        results.append({"configuration": name, "kind": "engine", "residency": None if "resident" in name else 0.5,
                        "rounds": rounds, "ms_per_token": {"mean": float(np.mean(means)), "rounds": means},
                        "copies": {"copies_per_token": 7.0, "demand_per_token": 0.1}})
    return {"results": results, "machine": {"device": "NVIDIA H100 80GB HBM3", "device_type": "cuda"},
            "settings": {"expert_copy": {"ms_median": 0.24}}}


def test_dropping_the_first_step_removes_a_capture_it_carried_and_nothing_else():
    record = _record({"engine_resident": 1.5, "engine_psr_lam0.3_n1_res50": 60.0})
    rows = {row["configuration"]: row for row in steady.steady_rows(record, 1)}
    for name, row in rows.items():
        kept = [t for r in record["results"] if r["configuration"] == name
                for rnd in r["rounds"][:1] for w in rnd["ms"] for t in w[1:]]
        assert row["rounds"][0]["ms_per_token"] == pytest.approx(np.mean(kept))
    assert rows["engine_psr_lam0.3_n1_res50"]["ms_per_token"]["mean"] == pytest.approx(3.0, abs=0.05)
    original = {r["configuration"]: r["ms_per_token"]["mean"] for r in record["results"]}
    assert original["engine_psr_lam0.3_n1_res50"] > 8  # the capture dominated the mean
    assert rows["engine_resident"]["ms_per_token"]["mean"] == pytest.approx(original["engine_resident"], abs=0.05)


def test_dropping_every_position_is_refused():
    with pytest.raises(ValueError, match="empty"):
        steady.steady_rows(_record({"engine_resident": 1.5, "engine_psr_lam0.3_n1_res50": 3.0}), 5)


def test_the_command_reads_an_xz_record_and_writes_its_judgement(tmp_path, capsys):
    path = tmp_path / "bench.json.xz"
    with lzma.open(path, "wt") as f:
        json.dump(_record({"engine_resident": 1.5, "engine_psr_lam0.3_n1_res50": 60.0}), f)
    out = steady.main([str(path), "--pair", "engine_psr_lam0.3_n1_res50", "engine_resident",
                       "--json", str(tmp_path / "out.json")])
    printed = capsys.readouterr().out
    assert "engine_psr_lam0.3_n1_res50 / engine_resident: 2.0" in printed
    assert json.loads((tmp_path / "out.json").read_text())["drop"] == 1
    assert not any("host time" in g["goal"] for g in out["goals"])
