"""psr-hf sweep (psr_hf.bench.sweep): the grid, the selfgen sampler, resuming an interrupted sweep (at the
divergence stage and at a timed round), the points with both measurements, and the command end to end on the CPU
with the tiny random model (transformers offload path)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from psr_hf import RoutingConfig
from psr_hf.bench.rows import OFFLOAD, RESIDENT, Row
from psr_hf.bench.timing import bench_latency
from psr_hf.bench.sweep import SweepStopped, run_sweep, select, sweep_grid
from psr_hf.eval.selfgen import sample_windows, start_tokens
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

SMALL = dict(model="tiny", device="cpu", residencies=(0.5,), rounds=3, windows=1, tokens=5, selfgen_windows=2,
             selfgen_tokens=12, heldout_windows=2, heldout_tokens=12, calibration_tokens=256)


def _grid():
    return select(sweep_grid(lams=(0.3,), budgets=(1,), published=False),
                  ["exact_lru", "cp_lam0.3", "psr_lam0.3_n1", "psr_lam0.3_n1_lru", "spec"])


def test_grid_covers_the_papers_configurations():
    grid = sweep_grid()
    assert len(grid) == 3 + 5 * (2 + 2 * 3 + 3)
    assert grid["cp_lam0.2"] == dict(policy="cache_prior", lam=0.2, eviction="lru", budget=0)
    assert grid["psr_lam0.15_n8"] == dict(policy="psr", lam=0.15, eviction="score", budget=8)
    assert grid["cp_lam0.25_j2_run"]["delta_mode"] == "running" and grid["cp_lam0.1_j1"]["top_j"] == 1
    only_a = sweep_grid(evictions=("score",), published=False)
    assert "cp_lam0.2_a" in only_a and "cp_lam0.2" not in only_a and "psr_lam0.2_n1_lru" not in only_a
    with pytest.raises(ValueError, match="evictions"):
        sweep_grid(evictions=("fifo",))
    with pytest.raises(ValueError, match="budgets"):
        sweep_grid(budgets=(0,))
    windowed = sweep_grid(lams=(0.2,), budgets=(1,), psr_windows=(2,))
    assert windowed["psr_lam0.2_n1_w2"] == dict(policy="psr", lam=0.2, eviction="score", budget=1, window=2)
    assert len(windowed) == len(sweep_grid(lams=(0.2,), budgets=(1,))) + 1  # PSR with the A priority only
    with pytest.raises(ValueError, match="psr_windows"):
        sweep_grid(psr_windows=(0,))
    with pytest.raises(ValueError, match="unknown psr_lam9"):
        select(grid, ["psr_lam9"])


def test_selfgen_sampling_is_seeded_and_follows_the_model():
    from psr_hf.assets import load_shipped

    model = load_shipped("tiny-moe")[0]  # trained: its samples are far from uniform
    prompts = start_tokens(model, [torch.tensor([[5, 6, 7]])] * 2)
    a = sample_windows(model, prompts, tokens=10, seed=3)
    b = sample_windows(model, prompts, tokens=10, seed=3)
    c = sample_windows(model, prompts, tokens=10, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    assert a[0].shape == (1, prompts[0].numel() + 10) and not torch.equal(a[0], a[1])  # seed + window index
    # the samples follow the model: their mean NLL under it is near the entropy, far below a uniform draw's
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=a[0]).logits[0, :-1].double(), -1)
    nll = float(-logp.gather(1, a[0][0, 1:, None]).mean())
    assert nll < np.log(model.config.vocab_size) - 2.0
    with pytest.raises(ValueError, match="temperature"):
        sample_windows(model, prompts, tokens=2, temperature=0.0)


def test_bench_rounds_resume_where_they_stopped():
    model = tiny_model("olmoe")
    ids = [torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(1))]
    configs = [Row(RESIDENT), Row(OFFLOAD, RoutingConfig(policy="psr", lam=0.3, residency=0.5))]
    seen = {}

    def keep(r, results):
        seen.update({k: [list(run) for run in v] for k, v in results.items()})

    stopped = bench_latency(model, ids, configs=configs, rounds=3, offload=False, on_round=keep,
                            stop=lambda: len(seen.get(RESIDENT, [])) >= 1)
    assert len(stopped[0]["rounds"]) == 1 and len(seen[RESIDENT]) == 1
    rows = bench_latency(model, ids, configs=configs, rounds=3, offload=False, resume=seen)
    assert [len(r["rounds"]) for r in rows] == [3, 3]
    assert rows[1]["rounds"][0]["ms"] == stopped[1]["rounds"][0]["ms"]  # the first round is the saved one
    with pytest.raises(ValueError, match="same number of timed rounds"):
        bench_latency(model, ids, configs=configs, rounds=3, offload=False, resume={RESIDENT: seen[RESIDENT]})


def test_sweep_stops_continues_and_measures_every_point(tmp_path):
    path = tmp_path / "sweep.json"
    grid = _grid()
    with pytest.raises(SweepStopped, match="run the same command"):
        run_sweep(**SMALL, grid=grid, json_path=path, max_minutes=0.0)
    first = json.loads(path.read_text())
    assert first["quality"] == {} and len(first["selfgen"]["ids"]) == 2  # sampled and saved before stopping
    with pytest.raises(ValueError, match="other settings"):
        run_sweep(**{**SMALL, "tokens": 6}, grid=grid, json_path=path)
    with pytest.raises(SweepStopped, match="divergence stage is done"):
        run_sweep(**SMALL, grid=grid, json_path=path, stage="quality", quality_device="cpu")
    quality_only = json.loads(path.read_text())
    assert set(quality_only["quality"]) == {name + "_res50" for name in grid} and quality_only["latency"] == {}
    with pytest.raises(ValueError, match="quality_device"):  # another divergence device: another sweep
        run_sweep(**SMALL, grid=grid, json_path=path, quality_device="meta")
    record = run_sweep(**SMALL, grid=grid, json_path=path)
    assert record["selfgen"]["ids"] == first["selfgen"]["ids"]  # continued, not sampled again
    assert record["quality"] == quality_only["quality"]
    saved = json.loads(path.read_text())
    assert saved["points"] == json.loads(json.dumps(record["points"]))
    points = {p["name"]: p for p in record["points"]}
    assert set(points) == {name + "_res50" for name in grid}
    exact = points["exact_lru_res50"]
    assert exact["sg_pct"] == 0.0 and exact["heldout_excess_nll"] == 0.0  # exact routing is the model's own
    assert points["psr_lam0.3_n1_res50"]["sg_pct"] > 0.0
    for p in points.values():
        assert len(p["round_ms"]) == 3 and p["ms_ci95"][0] <= p["ms"] <= p["ms_ci95"][1]
        assert len(p["selfgen_window_excess"]) == 2
        assert p["sg_pct_ci95"][0] <= p["sg_pct"] <= p["sg_pct_ci95"][1]
    assert set(record["frontier"]["_res50"]) <= set(points)
    assert {o["verdict"] for o in record["orderings"]} <= {"reproduced", "reversed", "not resolved"}
    # a finished record is final: running again measures nothing more and gives the same points; what is derived
    # from the measurements (points, front, verdicts) is derived again, so a stale or edited verdict is replaced
    stale = json.loads(path.read_text())
    stale["orderings"] = [{**o, "verdict": "stale"} for o in stale["orderings"]]
    path.write_text(json.dumps(stale))
    again = run_sweep(**SMALL, grid=grid, json_path=path)
    assert [p["name"] for p in again["points"]] == [p["name"] for p in record["points"]]
    assert [p["ms"] for p in again["points"]] == pytest.approx([p["ms"] for p in record["points"]], rel=1e-5)
    # (derived again from the record's 6-digit measurements: equal to the first derivation up to that rounding)
    assert [o["verdict"] for o in again["orderings"]] == [o["verdict"] for o in record["orderings"]]
    assert json.loads(path.read_text())["orderings"] == again["orderings"]


def test_cli_sweep_writes_record_plot_and_tables(tmp_path, capsys):
    from psr_hf.cli import main

    out = tmp_path / "s.json"
    args = ["sweep", "--model", "tiny", "--device", "cpu", "--residencies", "0.5", "--lams", "0.3", "--budgets", "1",
            "--no-published", "--psr-windows", "2", "--configs", "exact_lru,cp_lam0.3,psr_lam0.3_n1,psr_lam0.3_n1_w2",
            "--windows", "1", "--tokens", "4",
            "--selfgen-windows", "2", "--selfgen-tokens", "10", "--heldout-windows", "2", "--heldout-tokens", "10",
            "--calibration-tokens", "256", "--json", str(out), "--plot", str(tmp_path / "f.png"),
            "--markdown", str(tmp_path / "t.md")]
    assert main(args) == 0
    text = capsys.readouterr().out
    # the PSR row of Table 2 (the configuration's own name appears only in some timing-dependent verdicts)
    assert "PSR n=1, lam=0.3" in text and "PSR n=1, window 2, lam=0.3" in text and "sg%" in text
    assert (tmp_path / "f.png").stat().st_size > 0 and "exact" in (tmp_path / "t.md").read_text()
    assert main(args[:-6] + ["--json", str(out), "--max-minutes", "0"]) == 0  # complete: nothing left to stop
    assert main(["sweep", "--model", "tiny", "--device", "cpu", "--evictions", "fifo"]) == 2
    assert "evictions" in capsys.readouterr().err
    assert main(["sweep", "--model", "tiny", "--device", "cpu", "--psr-windows", "0"]) == 2
    assert "--psr-windows" in capsys.readouterr().err


def test_timing_first_then_the_divergence(tmp_path):
    """--stage latency times the rows alone (the GPU first, while the model is on the device); the divergence stage
    then completes the same record and the points join both."""
    path = tmp_path / "sweep.json"
    grid = select(_grid(), ["exact_lru", "psr_lam0.3_n1"])
    with pytest.raises(SweepStopped, match="divergence stage is still to run"):
        run_sweep(**SMALL, grid=grid, json_path=path, stage="latency")
    timed = json.loads(path.read_text())
    assert timed["quality"] == {} and "selfgen" not in timed and "rows" in timed["latency"]["_res50"]
    record = run_sweep(**SMALL, grid=grid, json_path=path)
    assert record["latency"]["_res50"]["rows"] == timed["latency"]["_res50"]["rows"]  # not timed again
    assert {p["name"] for p in record["points"]} == {"exact_lru_res50", "psr_lam0.3_n1_res50"}
    with pytest.raises(ValueError, match="stage="):
        run_sweep(**SMALL, grid=grid, json_path=tmp_path / "other.json", stage="timing")


def test_a_timing_stopped_by_the_deadline_continues(tmp_path):
    """--max-minutes reached in the timing stage: the record keeps what was timed (here: no round yet) and the
    same command times the rest."""
    path = tmp_path / "sweep.json"
    grid = select(_grid(), ["exact_lru", "cp_lam0.3"])
    with pytest.raises(SweepStopped, match="run the same command to continue"):
        run_sweep(**SMALL, grid=grid, json_path=path, stage="latency", max_minutes=0.0)
    stopped = json.loads(path.read_text())
    assert "rows" not in stopped["latency"]["_res50"] and stopped["quality"] == {}
    with pytest.raises(SweepStopped, match="divergence stage is still to run"):
        run_sweep(**SMALL, grid=grid, json_path=path, stage="latency")
    assert len(json.loads(path.read_text())["latency"]["_res50"]["rows"][0]["rounds"]) == 3


def test_the_two_stages_run_apart_join_into_the_sweep_run_in_one_record(tmp_path):
    """The divergence stage on one machine and the timing on another, joined (``psr-hf sweep --join``), give the
    record of one sweep: the same divergence, the timing, and the points derived from both."""
    from psr_hf.bench.sweep import join_stages

    grid = select(sweep_grid(lams=(0.3,), budgets=(1,), published=False), ["exact_lru", "psr_lam0.3_n1"])
    quality, latency = tmp_path / "quality.json", tmp_path / "latency.json"
    with pytest.raises(SweepStopped, match="divergence stage is done"):
        run_sweep(**SMALL, grid=grid, json_path=quality, stage="quality")
    with pytest.raises(SweepStopped, match="rows are timed"):
        run_sweep(**SMALL, grid=grid, json_path=latency, stage="latency")
    with pytest.raises(ValueError, match="the same record"):
        join_stages(quality, quality)
    started = tmp_path / "started.json"
    with pytest.raises(SweepStopped):
        run_sweep(**SMALL, grid=grid, json_path=started, max_minutes=0.0)  # nothing measured yet
    with pytest.raises(ValueError, match="neither .* holds the whole latency stage"):
        join_stages(quality, started)
    other = tmp_path / "other.json"
    with pytest.raises(SweepStopped):
        run_sweep(**{**SMALL, "tokens": 6}, grid=grid, json_path=other, stage="latency")
    with pytest.raises(ValueError, match="different sweeps .*tokens"):
        join_stages(quality, other)
    join_stages(latency, quality)
    joined = json.loads(latency.read_text())
    assert joined["quality"] == json.loads(quality.read_text())["quality"] and joined["latency"]
    record = run_sweep(**SMALL, grid=grid, json_path=latency)  # complete: nothing is measured again
    assert {p["name"] for p in record["points"]} == {"exact_lru_res50", "psr_lam0.3_n1_res50"}
    assert all(p["ms"] > 0 and p["sg_pct"] is not None for p in record["points"])
    with pytest.raises(ValueError, match="both .* hold the divergence stage"):
        join_stages(latency, quality)
