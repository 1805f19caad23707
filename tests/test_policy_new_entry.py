"""ARCHITECTURE.md's claim about policies: a policy that combines behaviours the kernels already have is one
``Policy`` entry in ``POLICY_TABLE``; RoutingConfig, LogicalCache, replay(), the Controller and the frontier's
labels take it with no other change (none of them tests a policy's name)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.bench.frontier import family
from psr_hf.policy import policies
from psr_hf.policy.traces import calibration_from_trace, synthetic_trace
from psr_hf.testing import tiny_model

NEW = "psr_lru"  # PSR's behaviour with LRU eviction by default: no rule the kernels lack


@pytest.fixture()
def new_policy(monkeypatch):
    psr = policies.POLICY_TABLE["psr"]
    code = 1 + max(entry.code for entry in policies.POLICY_TABLE.values())
    # paper=None: a policy the paper does not have (the frontier labels it by its name, the grid does not name it)
    entry = dataclasses.replace(psr, name=NEW, code=code, eviction="lru", description="PSR with LRU eviction",
                                paper=None)
    monkeypatch.setitem(policies.POLICY_TABLE, NEW, entry)
    return entry


def test_a_new_entry_decides_what_its_behaviours_decide(new_policy):
    trace = synthetic_trace(48, 3, 16, seed=4)
    calibration = calibration_from_trace(trace, 4, 512)
    args = dict(scores=trace.scores, pregate=trace.pregate, tokens=trace.tokens, calibration=calibration, top_k=4)
    ours = psr_hf.replay(RoutingConfig(policy=NEW, capacity=8, lam=0.3), **args)
    same = psr_hf.replay(RoutingConfig(policy="psr", capacity=8, lam=0.3, eviction="lru"), **args)
    other = psr_hf.replay(RoutingConfig(policy="psr", capacity=8, lam=0.3, eviction="score"), **args)
    np.testing.assert_array_equal(ours.selected, same.selected)
    np.testing.assert_array_equal(ours.prefetch_copies, same.prefetch_copies)
    assert not np.array_equal(ours.demand_copies, other.demand_copies)  # its default eviction is its own


def test_a_new_entry_patches_generates_replays_and_gets_a_frontier_label(new_policy):
    config = RoutingConfig(policy=NEW, residency=0.5)
    assert (config.lam, config.budget, config.eviction) == (new_policy.lam, new_policy.budget, "lru")
    model = tiny_model("olmoe")
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    with psr_hf.patched(model, config):
        with psr_hf.controller(model).record() as rec, torch.no_grad():
            model.generate(ids, max_new_tokens=6, do_sample=False)
    recording = rec.recordings[0]
    np.testing.assert_array_equal(psr_hf.replay(config, recording).selected, recording.selected)
    assert family({"name": "x", "policy": NEW, "eviction": "lru", "budget": 1}) == NEW


def test_a_new_entry_outside_the_paper_has_no_grid_name(new_policy):
    from psr_hf.eval.grid import routing_name

    assert routing_name(RoutingConfig(policy="psr", residency=0.5, eviction="lru")) == "psr_lam0.2_n1_lru"
    with pytest.raises(ValueError, match="the routing grid has no name"):
        routing_name(RoutingConfig(policy=NEW, residency=0.5))
