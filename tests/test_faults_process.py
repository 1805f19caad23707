"""Faults at the edges of the process: records of the wrong shape reach ``psr-hf`` as one ``error:`` line naming
the file (exit status 2), and ``patch()``/``unpatch()`` leave torch's process-wide thread count as the caller set
it."""

from __future__ import annotations

import json

import numba
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.bench.sweep import sweep_grid
from psr_hf.cli import main
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("quiet_psr_hf")

TS = "2026-11-29T10-00-00.000000"
INNER = "psr_hf__pretrained=__models__olmoe"


def _error_line(capsys, name: str) -> str:
    """The one ``error:`` line on stderr, which names the file ``name``."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err and name in lines[0], err
    return lines[0]


# ------------------------------------------------------------------------------------------- psr-hf compare
def _sample(doc_id: int, acc: float) -> dict:
    return {"doc_id": doc_id, "filter": "none", "metrics": ["acc"], "doc_hash": f"d{doc_id}",
            "prompt_hash": f"p{doc_id}", "acc": acc}


def _run(root, *, samples_lines: list | None = None, results: dict | None = None):
    """``root`` as lm-eval's --output_path with one task, ``arc_easy``; ``samples_lines`` and ``results`` replace
    the well-formed ones."""
    inner = root / INNER
    inner.mkdir(parents=True)
    lines = samples_lines if samples_lines is not None else [_sample(i, float(i % 2)) for i in range(4)]
    (inner / f"samples_arc_easy_{TS}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    record = {"results": {"arc_easy": {}}, "group_subtasks": {}, "config": {"model": "psr_hf"}}
    record.update(results or {})
    (inner / f"results_{TS}.json").write_text(json.dumps(record))
    return root


@pytest.mark.parametrize("case, shape, named", [
    ("samples line is an array", {"samples_lines": [_sample(0, 1.0), [0, "none", 1.0]]},
     f"samples_arc_easy_{TS}.jsonl, line 2"),
    ("samples line is a number", {"samples_lines": [7]}, f"samples_arc_easy_{TS}.jsonl, line 1"),
    ("group_subtasks is a list", {"results": {"group_subtasks": ["arc_easy"]}}, "group_subtasks"),
    ("a group's subtasks are a number", {"results": {"group_subtasks": {"arc": 3}}}, "group_subtasks"),
    ("config is a list", {"results": {"config": ["psr_hf"]}}, "config"),
])
def test_compare_refuses_valid_json_of_the_wrong_shape_in_one_line(tmp_path, capsys, case, shape, named):
    reference = _run(tmp_path / "reference")
    bad = _run(tmp_path / "bad", **shape)
    assert main(["compare", f"ref={reference}", f"bad={bad}"]) == 2
    line = _error_line(capsys, str(bad / INNER))
    assert named in line


# ------------------------------------------------------------------------------------------- psr-hf sweep
_SWEEP = ["sweep", "--model", "tiny", "--device", "cpu", "--residencies", "0.5", "--lams", "0.3", "--budgets", "1",
          "--no-published", "--configs", "exact_lru", "--windows", "1", "--tokens", "4", "--selfgen-windows", "2",
          "--selfgen-tokens", "10", "--heldout-windows", "2", "--heldout-tokens", "10"]


def _shell(**fields) -> dict:
    """A sweep record's outer fields (version 1) with one grid entry and nothing measured; ``fields`` replace
    some."""
    grid = {"exact_lru": sweep_grid(published=False)["exact_lru"]}
    return {"benchmark": "sweep", "version": 1, "settings": {"residencies": [0.5]}, "grid": grid, "quality": {},
            "latency": {}, **fields}


@pytest.mark.parametrize("record, named", [
    ([1, 2, 3], "a JSON object"),
    ("sweep", "a JSON object"),
    (_shell(settings=["tiny"]), "settings"),
])
def test_sweep_refuses_a_json_record_of_the_wrong_shape_in_one_line(tmp_path, capsys, record, named):
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    assert main([*_SWEEP, "--json", str(path)]) == 2
    assert named in _error_line(capsys, str(path))


@pytest.mark.parametrize("record, named, both", [
    ([{"benchmark": "sweep"}], "a JSON object", False),
    (_shell(selfgen={}, quality=5), "quality", False),
    (_shell(selfgen={}, quality={"exact_lru_res50": {}}, latency="none"), "latency", False),  # divergence whole
    (_shell(settings={}), "settings.residencies", True),  # the same settings in both: compared, then read
])
def test_sweep_join_refuses_a_record_of_the_wrong_shape_in_one_line(tmp_path, capsys, record, named, both):
    mine, other = tmp_path / "mine.json", tmp_path / "other.json"
    mine.write_text(json.dumps(record if both else _shell()))
    other.write_text(json.dumps(record))
    assert main([*_SWEEP, "--json", str(mine), "--join", str(other)]) == 2
    assert named in _error_line(capsys, str(mine if both else other))


# ------------------------------------------------------------------------------------------- threads
@pytest.mark.parametrize("offload", [None, "cpu"])
@pytest.mark.parametrize("env", [{}, {"PSR_HF_THREADS": "1"}])
def test_patch_and_unpatch_leave_torchs_thread_count_as_the_caller_set_it(monkeypatch, env, offload):
    for name in ("PSR_HF_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    try:
        torch.set_num_threads(2)
        model = tiny_model("olmoe")
        seen: list[tuple[int, int]] = []
        model.model.layers[-1].register_forward_hook(
            lambda *_: seen.append((torch.get_num_threads(), numba.get_num_threads())))
        ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model(ids)
        psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5),
                     offload=None if offload is None else psr_hf.OffloadConfig(device=offload))
        assert torch.get_num_threads() == 2  # a small model on the CPU: still the caller's count
        with torch.no_grad():
            model(ids)
        assert torch.get_num_threads() == 2
        psr_hf.unpatch(model)
        assert torch.get_num_threads() == 2
        with torch.no_grad():
            model(ids)
        # unpatched, patched, unpatched: each forward ran on the caller's threads
        assert seen == [(2, numba_threads)] * 3 and numba.get_num_threads() == numba_threads
    finally:
        torch.set_num_threads(before)


def test_loading_a_shipped_model_leaves_torchs_thread_count_as_the_caller_set_it(monkeypatch):
    from psr_hf.assets import load_shipped

    for name in ("PSR_HF_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        load_shipped("tiny-moe")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
