"""Excess NLL over exact routing (psr_hf.eval.divergence, psr-hf excess-nll) on the tiny random model (CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.eval.divergence import divergence, format_rows, sweep_configs
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")


def _windows(n: int, length: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (1, length), generator=g) for _ in range(n)]


def _nll(model, ids) -> np.ndarray:
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
    return -logp.gather(1, ids[0, 1:, None])[:, 0].numpy()


def test_exact_routing_has_no_excess_and_a_biased_policy_is_measured_exactly():
    model = tiny_model("olmoe")
    windows = _windows(3, 24)
    configs = {"exact": RoutingConfig(policy="exact", residency=0.25),
               "psr": RoutingConfig(policy="psr", lam=0.5, residency=0.25)}
    exact, psr = divergence(model, windows, configs)
    assert exact.excess_nll == 0.0 and exact.excess_nll_ci95 == (0.0, 0.0) and exact.replaced_per_token == 0
    assert exact.tokens == psr.tokens == 3 * 23 and exact.windows == 3 and exact.capacity == 4
    # by hand: per window the mean per-token NLL difference, then the mean over windows
    reference = [_nll(model, w) for w in windows]
    with psr_hf.patched(model, configs["psr"]):
        patched = [_nll(model, w) for w in windows]
    by_hand = np.mean([float((a - b).mean()) for a, b in zip(patched, reference)])
    assert psr.replaced_per_token > 0 and psr.excess_nll != 0.0
    assert psr.excess_nll == pytest.approx(by_hand, rel=1e-12, abs=1e-15)
    assert psr.excess_ppl_pct == pytest.approx(100 * math.expm1(by_hand))
    assert psr.excess_nll_ci95[0] <= psr.excess_nll <= psr.excess_nll_ci95[1]
    assert getattr(model, "_psr_hf_controller", None) is None  # unpatched after each configuration
    assert "psr" in format_rows([exact, psr])


def test_the_sweep_is_the_issue_grid():
    configs = sweep_configs((0.5, 0.25), (0.1, 0.2, 0.3))
    assert len(configs) == 2 * (1 + 2 * 3)
    assert configs["psr_lam0.3_n1_res25"] == RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.25)
    assert configs["cp_lam0.1_res50"] == RoutingConfig(policy="cache_prior", lam=0.1, residency=0.5)
    assert configs["exact_lru_res50"] == RoutingConfig(policy="exact", eviction="lru", budget=0, residency=0.5)


def test_bad_windows_and_a_patched_model_are_refused():
    model = tiny_model("olmoe")
    with pytest.raises(ValueError, match=r"T >= 2"):
        divergence(model, [torch.tensor([[5]])], {"e": RoutingConfig(policy="exact", residency=0.5)})
    with psr_hf.patched(model, RoutingConfig(policy="exact", residency=0.5)):
        with pytest.raises(ValueError, match="needs the unpatched model"):
            divergence(model, _windows(1, 4), {"e": RoutingConfig(policy="exact", residency=0.5)})


@pytest.mark.parametrize("model", [None, "tiny"])
def test_psr_hf_excess_nll_prints_the_table_and_writes_json(tmp_path, model):
    out = tmp_path / "kl.json"
    run = subprocess.run([sys.executable, "-m", "psr_hf.cli", "excess-nll", "--windows", "2", "--tokens", "16",
                          "--residencies", "0.5", "--lams", "0.2", "--calibration-tokens", "1024",
                          "--json", str(out)] + (["--model", model] if model else []),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "psr_lam0.2_n1_res50" in run.stdout and "excess NLL" in run.stdout
    record = json.loads(out.read_text())
    assert [r["name"] for r in record["rows"]] == ["exact_lru_res50", "cp_lam0.2_res50", "psr_lam0.2_n1_res50"]
    assert record["rows"][0]["excess_nll"] == 0.0 and record["rows"][0]["tokens"] == 2 * 16
    if model is None:  # the shipped trained model: its own calibration, windows of the held-out text
        assert record["model"]["name"] == "tiny-moe"
        assert record["calibration"].endswith("calibration.safetensors")
        assert record["texts"] == ["held-out: persuasion_vol1.txt"]
    else:
        assert record["calibration"].startswith("1024 tokens of stdlib")
        assert record["texts"][0].startswith("stdlib:")
