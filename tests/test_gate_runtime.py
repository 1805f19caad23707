"""A margin head on a patched model (psr_hf.patch(..., gate=...), psr_hf.gates.MarginHead) with the shipped
olmoe-routing: the untrained head is Cache-Prior exactly, a non-uniform head changes the routing, its decisions are
deterministic, replay from a recording, and do not depend on the offload's copies; the head round-trips through
safetensors with its shape checked; configurations that cannot carry margins are refused with the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.assets.loading import load_model
from psr_hf.gates import MarginHead
from psr_hf.policy.calibration import Calibration

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

CONFIG = psr_hf.RoutingConfig(policy="cache_prior", lam=0.3, eviction="lru", residency=0.375)


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer, info = load_model("olmoe-routing", "cpu")
    calibration = Calibration.load(info["calibration_file"])
    ids = tokenizer("The committee met on Tuesday to discuss the budget, and after a long debate it decided",
                    return_tensors="pt")["input_ids"]
    return model, calibration, ids


def _hidden(model) -> int:
    return int(model.config.hidden_size)


def _heads(model, calibration):
    uniform = MarginHead.uniform(CONFIG.lam * calibration.delta, _hidden(model), metadata={"model_type": "olmoe"})
    learned = MarginHead.uniform(CONFIG.lam * calibration.delta, _hidden(model))
    with torch.no_grad():
        learned.weight.copy_(torch.randn(learned.weight.shape, generator=torch.Generator().manual_seed(0)))
    return uniform, learned


def _run(model, calibration, ids, gate, offload=None):
    with psr_hf.patched(model, CONFIG, calibration=calibration, gate=gate, offload=offload):
        with psr_hf.controller(model).record() as recorder, torch.no_grad():
            logits = model(input_ids=ids).logits
    (recording,) = recorder.recordings
    return logits, recording


def test_the_untrained_head_is_cache_prior_and_a_learned_one_changes_the_routing(shipped):
    model, calibration, ids = shipped
    uniform, learned = _heads(model, calibration)
    with psr_hf.patched(model, CONFIG, calibration=calibration), torch.no_grad():
        prior = model(input_ids=ids).logits
    same, rec_uniform = _run(model, calibration, ids, uniform)
    torch.testing.assert_close(same, prior, rtol=0, atol=0)
    other, rec_learned = _run(model, calibration, ids, learned)
    assert not np.array_equal(rec_learned.selected, rec_uniform.selected)
    again, rec_again = _run(model, calibration, ids, learned)
    assert torch.equal(again, other) and np.array_equal(rec_again.selected, rec_learned.selected)


def test_a_gated_run_replays_from_its_recording_and_ignores_the_copies(shipped):
    model, calibration, ids = shipped
    _, learned = _heads(model, calibration)
    logits, recording = _run(model, calibration, ids, learned)
    replayed = psr_hf.replay(CONFIG, recording, calibration=calibration)
    np.testing.assert_array_equal(replayed.selected, recording.selected)
    offloaded, rec_offload = _run(model, calibration, ids, learned,
                                  offload=psr_hf.OffloadConfig(device="cpu", check_slots=True))
    np.testing.assert_array_equal(rec_offload.selected, recording.selected)  # the same decisions
    torch.testing.assert_close(offloaded, logits)  # experts computed from the slots: same values up to rounding
    prompt = ids[:, :12]
    with psr_hf.patched(model, CONFIG, calibration=calibration, gate=learned):
        reference = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=1)
    with psr_hf.patched(model, CONFIG, calibration=calibration, gate=learned,
                        offload=psr_hf.OffloadConfig(device="cpu", check_slots=True)):
        generated = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=1)
        assert psr_hf.controller(model).stats().offload.demand > 0
    assert torch.equal(generated, reference)


def test_the_head_round_trips_and_its_shape_and_config_are_checked(shipped, tmp_path):
    model, calibration, ids = shipped
    _, learned = _heads(model, calibration)
    path = learned.save(tmp_path / "gate.safetensors")
    loaded = MarginHead.load(path)
    assert torch.equal(loaded.weight, learned.weight) and torch.equal(loaded.ceiling, learned.ceiling)
    logits, _ = _run(model, calibration, ids, str(path))
    expected, _ = _run(model, calibration, ids, learned)
    assert torch.equal(logits, expected)
    margins = loaded(0, torch.randn(5, loaded.hidden_size))
    assert ((margins > 0) & (margins <= loaded.ceiling[0])).all()
    wrong = MarginHead.uniform([0.5] * 3, loaded.hidden_size)
    with pytest.raises(ValueError, match="MoE layers with hidden size"):
        psr_hf.patch(model, CONFIG, calibration=calibration, gate=wrong)
    with pytest.raises(ValueError, match="policy='cache_prior'"):
        psr_hf.patch(model, psr_hf.RoutingConfig(policy="exact", residency=0.375), calibration=calibration,
                     gate=learned)
    calibration.save(tmp_path / "calibration.safetensors")
    with pytest.raises(ValueError, match="not a psr_hf margin head"):
        MarginHead.load(tmp_path / "calibration.safetensors")
    assert getattr(model, "_psr_hf_controller", None) is None  # refused patches leave the model unpatched
    with psr_hf.patched(model, CONFIG, calibration=calibration, gate=learned):
        ctl = psr_hf.controller(model)
        ctl.reconfigure(psr_hf.RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.375))
        assert ctl.gate is learned  # kept unless gate=False
        ctl.reconfigure(CONFIG, gate=False)
        assert ctl.gate is None


def test_the_engine_refuses_a_gated_model_instead_of_ignoring_its_margins(shipped):
    from psr_hf.engine.graphs import GraphDecoder

    model, calibration, ids = shipped
    _, learned = _heads(model, calibration)
    with psr_hf.patched(model, CONFIG, calibration=calibration, gate=learned):
        decoder = GraphDecoder(model, 64, graphs=False)
        with pytest.raises(RuntimeError, match="do not run gates"):
            decoder.prefill(ids[0, :8].tolist())
            decoder.step(int(ids[0, 8]))
