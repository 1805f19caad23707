"""benchmarks/engine/engine_agreement.py, the engine against the HF path on the same patched model, with the check
of the paper's Section 6.9 (perplexity under exact routing, and a routed row's change in NLL from exact in both),
run on the CPU on a tiny OLMoE written as an FP8 checkpoint and offloaded with its e4m3 experts."""

from __future__ import annotations

import json

import pytest
import torch
from module_files import ROOT, load_module

from psr_hf.assets.quantize import quantize_checkpoint
from psr_hf.testing import save_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")


@pytest.fixture(scope="module")
def script():
    return load_module("engine_agreement", ROOT / "benchmarks" / "engine" / "engine_agreement.py")


def test_the_fp8_checkpoint_agrees_between_the_engine_and_the_hf_path_in_perplexity(tmp_path, script):
    save_tiny("olmoe", tmp_path / "bf16", dtype=torch.bfloat16, hidden_size=192, intermediate_size=160)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    out = tmp_path / "agreement.json"
    record = script.main(["--model", str(tmp_path / "fp8"), "--windows", "3", "--tokens", "24", "--offload",
                          "--device", "cpu", "--rows", "psr_lam0.3_n1,cp_lam0.2", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert set(record["policies"]) == {"exact", "psr_lam0.3_n1", "cp_lam0.2"}
    for row in record["policies"].values():
        assert row["expert_format"] == "fp8" and row["dense_fp8"] is False  # the CPU: the torch path
        assert row["engine"]["windows"] == row["hf_prefill"]["windows"] == 3 and row["hf_decode"]["windows"] == 1
        assert row["identical_sets"]["engine_vs_hf_prefill"] > 0.9  # bf16 near ties aside, the same sets
    check = record["section_6_9"]
    ratio = check["exact_engine_over_hf_perplexity_minus_1"]
    assert ratio["n"] == 3 and ratio["ci95"][0] <= ratio["mean"] <= ratio["ci95"][1] and abs(ratio["mean"]) < 0.01
    for name in ("psr_lam0.3_n1", "cp_lam0.2"):
        row, policy = check["rows"][name], record["policies"][name]
        hf = [r - e for r, e in zip(policy["hf_prefill"]["per_window"],
                                    record["policies"]["exact"]["hf_prefill"]["per_window"])]
        assert row["hf_nll_change"]["mean"] == pytest.approx(sum(hf) / 3)
        assert row["engine_minus_hf"]["mean"] == pytest.approx(row["engine_nll_change"]["mean"]
                                                               - row["hf_nll_change"]["mean"])
        assert abs(row["engine_minus_hf"]["mean"]) < 0.05


def test_a_row_no_grid_has_is_refused_before_anything_runs(tmp_path, script):
    with pytest.raises(ValueError, match="--rows 'psr_fast': no routing row has that name"):
        script.main(["--model", "tiny-moe", "--rows", "psr_fast", "--device", "cpu", "--json",
                     str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
