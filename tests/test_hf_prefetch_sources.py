"""ARCHITECTURE.md's claim about prefetch sources: a new one is one class registered in
``psr_hf/hf/prefetch_sources.py`` plus its name in ``RoutingConfig``'s list, and the controller, the recording
and replay() take it with no other change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
import psr_hf.hf.prefetch_sources as sources
import psr_hf.policy.config as config_module
from psr_hf import RoutingConfig
from psr_hf.testing import tiny_model


@pytest.fixture()
def reversed_pregate_source(monkeypatch):
    """A toy source: the pre-gate's ranking turned upside down (the experts the next router likes least)."""
    monkeypatch.setattr(config_module, "PREFETCH_SOURCES", (*config_module.PREFETCH_SOURCES, "reversed"))
    monkeypatch.setattr(sources, "_SOURCES", dict(sources._SOURCES))

    @sources.register_source("reversed")
    class ReversedPregate(sources.PregateRanking):
        def next_pregate(self, layer, computed):
            return None if computed is None else -computed

        def block_pregate(self, layer, stored, scores, valid):
            return None if stored is None else -stored

    return ReversedPregate


def _generate(model, config):
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    with psr_hf.patched(model, config):
        ctl = psr_hf.controller(model)
        with ctl.record() as rec, torch.no_grad():
            model.generate(ids, max_new_tokens=6, do_sample=False)
        return type(ctl.routing.source), rec.recordings[0], ctl.stats().total


def test_a_registered_source_ranks_the_prefetches_and_replays(reversed_pregate_source):
    model = tiny_model("olmoe")
    spec = dict(policy="exact", residency=0.5, budget=1)  # exact: the router inputs do not depend on the ranking
    source, rec, totals = _generate(model, RoutingConfig(**spec, prefetch="reversed"))
    assert source is reversed_pregate_source
    _, pregate_rec, _ = _generate(model, RoutingConfig(**spec))
    # the recorded ranking is the pre-gate's, negated (layer 0 has no pre-gate)
    np.testing.assert_array_equal(rec.pregate[:, 1:], -pregate_rec.pregate[:, 1:])
    assert totals["prefetch_per_token"] > 0
    result = psr_hf.replay(RoutingConfig(**spec, prefetch="reversed"), rec)
    np.testing.assert_array_equal(result.selected, rec.selected)


def test_an_unregistered_source_is_refused_by_name():
    with pytest.raises(ValueError, match="prefetch='reversed' is not supported"):
        RoutingConfig(policy="psr", residency=0.5, prefetch="reversed")


def test_psr_steered_by_a_registered_source_replays(reversed_pregate_source):
    config = RoutingConfig(policy="psr", residency=0.5, lam=0.3, budget=1, prefetch="reversed")
    _, rec, totals = _generate(tiny_model("olmoe"), config)
    assert totals["prefetch_per_token"] > 0
    np.testing.assert_array_equal(psr_hf.replay(config, rec).selected, rec.selected)


def test_every_registered_source_is_a_prefetch_ranking_and_the_predictor_has_what_a_source_reads():
    import inspect

    from psr_hf.prefetch import Predictor

    for name, cls in sources._SOURCES.items():
        source = cls.__new__(cls)
        assert isinstance(source, sources.PrefetchRanking), name
    wanted = {n for n in dir(sources.RankingPredictor) if not n.startswith("_")}
    assert wanted == {"weight", "check"}
    for method in wanted:
        assert callable(getattr(Predictor, method, None)), method
    assert (list(inspect.signature(Predictor.weight).parameters)
            == list(inspect.signature(sources.RankingPredictor.weight).parameters))
