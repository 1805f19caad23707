"""psr_hf.engine.Decoder, the eager batch-1 decoder, against the patched HF model it is built from (CPU, float32).

The decoder drives the same Controller as the HF path (its decode handle's begin_step / select / prefetch /
end_step), so it must make the same decisions: exact routing gives HF's greedy tokens and per-step logits (within
1e-4 of the step's largest |logit|; measured at most 5.4e-7) and the same routing statistics; psr and spec select
the same experts at every token-layer as HF's generate() (whose prompt runs as one block) and count the same
copies; the offloaded decoder (CPU slots) computes what the resident one does; the decoder's recordings replay to
its own selections. Copy counts and replaced slots are compared exactly; the displaced mass (a float sum over
scores that differ by float noise between a block matmul and a one-row matmul) within 1e-5 relative (measured at
most 4.2e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.engine import Decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

NEW = 6  # tokens generated per call
MAX_LEN = 64
LOGITS_TOL = 1e-4  # relative to the largest |logit| of the step
POLICIES = {
    "exact": dict(policy="exact", residency=0.5),
    "psr": dict(policy="psr", lam=0.2, budget=1, residency=0.5),
    "spec": dict(policy="spec", residency=0.5),
    "psr_distance2": dict(policy="psr", lam=0.2, budget=2, residency=0.5, prefetch_distance=2),
}
EXACT_COUNTS = ("tokens", "prefetch_per_token", "demand_per_token", "copies_per_token", "replaced_per_token")


@pytest.fixture(scope="module")
def case(engine_case):
    """``case(name)``: (model, prompt ids [1, S], calibration, pad id), from conftest's ``engine_case``."""
    return engine_case


def _hf(model, ids, pad):
    """The patched model's greedy generate(): sequences [1, S + n], per-step logits [n, V], its recording, stats."""
    ctl = psr_hf.controller(model)
    with torch.no_grad(), ctl.record() as recorder:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)[:, 0].float(), recorder.recordings, ctl.stats()


def _engine(model, ids, decoder=None, batched=None):
    """The decoder's greedy generation: sequences, per-step logits, its recording, stats."""
    ctl = psr_hf.controller(model)
    decoder = decoder or Decoder(model, MAX_LEN)
    with ctl.record() as recorder:
        sequences, logits = decoder.generate_greedy(ids, NEW, return_logits=True, batched=batched)
    return sequences, logits, recorder.recordings, ctl.stats()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _assert_same_stats(actual, expected) -> None:
    for name in EXACT_COUNTS:
        np.testing.assert_array_equal(getattr(actual, name), getattr(expected, name), err_msg=name)
        assert actual.total[name] == expected.total[name], name
    np.testing.assert_allclose(actual.displaced_mass, expected.displaced_mass, rtol=1e-5, atol=1e-9)


def _assert_same_selections(actual: list, expected: list) -> None:
    assert len(actual) == len(expected) == 1
    a, e = actual[0], expected[0]
    np.testing.assert_array_equal(a.tokens, e.tokens)
    np.testing.assert_array_equal(a.selected, e.selected)  # every token-layer
    np.testing.assert_allclose(a.scores, e.scores, rtol=1e-4, atol=1e-4)


def _fresh(model) -> None:
    ctl = psr_hf.controller(model)
    ctl.reset()
    ctl.reset_stats()


# ---------------------------------------------------------------------------------------------- exact routing
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "shipped"])
def test_exact_routing_gives_hf_greedy_tokens_logits_and_stats(case, name):
    model, ids, calibration, pad = case(name)
    with psr_hf.patched(model, RoutingConfig(**POLICIES["exact"]), calibration=calibration):
        hf_seq, hf_logits, hf_rec, hf_stats = _hf(model, ids, pad)
        _fresh(model)
        seq, logits, rec, stats = _engine(model, ids)
    assert seq.shape[1] > ids.shape[1]
    torch.testing.assert_close(seq, hf_seq, rtol=0, atol=0)
    assert logits.shape == hf_logits.shape
    for step in range(logits.shape[0]):
        assert _rel(logits[step], hf_logits[step]) < LOGITS_TOL, step
    _assert_same_selections(rec, hf_rec)
    _assert_same_stats(stats, hf_stats)
    assert stats.total["replaced_per_token"] == 0.0  # exact: the router's own top-K everywhere


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name", ["olmoe", "qwen3_5_moe_text", "deepseek_v3"])
def test_the_triton_slot_moe_decodes_the_torch_ones_tokens_weighing_the_experts_itself(case, name):
    """With the Triton slot MoE (triton's interpreter), a softmax router's weights (OLMoE; Qwen3.5, which
    renormalises them over the selected experts) are computed inside its first kernel and a sigmoid router's
    (DeepSeek-V3) beforehand; either way the tokens, the routing and the weights left in the buffers are the torch
    slot MoE's."""
    pytest.importorskip("triton")
    model, ids, calibration, _ = case(name)
    runs = {}
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), calibration=calibration):
        for backend in ("torch", "triton"):
            _fresh(model)
            decoder = Decoder(model, MAX_LEN, backend=backend)
            runs[backend] = (*_engine(model, ids, decoder), decoder.layers.buffers.expert_weights.clone())
    (seq, logits, rec, stats, weights), (t_seq, t_logits, t_rec, t_stats, t_weights) = runs["torch"], runs["triton"]
    torch.testing.assert_close(t_seq, seq, rtol=0, atol=0)
    assert _rel(t_logits, logits) < LOGITS_TOL
    _assert_same_selections(t_rec, rec)
    _assert_same_stats(t_stats, stats)
    torch.testing.assert_close(t_weights, weights, rtol=1e-5, atol=0)  # float32: a few ulps (summation order, exp)


# ---------------------------------------------------------------------------------------------- policies
@pytest.mark.parametrize("policy", ["psr", "spec", "psr_distance2"])
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "shipped"])
def test_policies_select_the_experts_of_the_hf_path(case, name, policy):
    model, ids, calibration, pad = case(name)
    with psr_hf.patched(model, RoutingConfig(**POLICIES[policy]), calibration=calibration):
        hf_seq, hf_logits, hf_rec, hf_stats = _hf(model, ids, pad)
        _fresh(model)
        seq, logits, rec, stats = _engine(model, ids)
    torch.testing.assert_close(seq, hf_seq, rtol=0, atol=0)
    for step in range(logits.shape[0]):
        assert _rel(logits[step], hf_logits[step]) < LOGITS_TOL, step
    _assert_same_selections(rec, hf_rec)
    _assert_same_stats(stats, hf_stats)
    assert stats.total["replaced_per_token"] > 0  # the policy did route away from the router's own top-K


def test_the_decoders_recordings_replay_to_its_own_selections(case):
    model, ids, calibration, _ = case("shipped")
    for policy in ("psr", "spec"):
        config = RoutingConfig(**POLICIES[policy])
        with psr_hf.patched(model, config, calibration=calibration):
            _, _, recordings, _ = _engine(model, ids)
            counts = psr_hf.controller(model).cache.stats()
        (recording,) = recordings
        result = psr_hf.replay(config, recording, calibration=calibration)
        np.testing.assert_array_equal(result.selected, recording.selected)
        assert result.prefetch_copies.sum() == counts.prefetch[:, 0].sum()
        assert result.demand_copies.sum() == counts.demand[:, 0].sum()
        assert result.replaced.sum() == counts.replaced[:, 0].sum() > 0


# ---------------------------------------------------------------------------------------------- offload
@pytest.mark.parametrize("batched", [False, True], ids=["prompt_by_token", "prompt_batched"])
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3", "shipped"])
def test_offloaded_decoder_computes_what_the_resident_one_does(case, name, batched):
    model, ids, calibration, _ = case(name)
    config = RoutingConfig(**POLICIES["psr"])
    with psr_hf.patched(model, config, calibration=calibration):
        seq, logits, rec, stats = _engine(model, ids, batched=batched)
    offload = psr_hf.OffloadConfig(device="cpu", check_slots=True)
    with psr_hf.patched(model, config, calibration=calibration, offload=offload):
        ctl = psr_hf.controller(model)
        off_seq, off_logits, off_rec, off_stats = _engine(model, ids, batched=batched)
        copies = ctl.offload.stats(int(off_stats.total["tokens"]))
        # the offload engine has no decode selection left pending: a later HF forward asks the device
        assert all(p is None for p in ctl.offload._pending)
    torch.testing.assert_close(off_seq, seq, rtol=0, atol=0)
    if batched:  # the prompt block runs transformers' experts, resident or over the offload's slots: float noise
        assert _rel(off_logits, logits) < LOGITS_TOL
    else:  # the engine's slot MoE on the same weights, copied into slots
        torch.testing.assert_close(off_logits, logits, rtol=0, atol=0)
    _assert_same_selections(off_rec, rec)
    _assert_same_stats(off_stats, stats)
    # the slots followed the logical cache: one physical copy per logical insertion, after the warm set
    assert copies.demand + copies.prefetch - copies.dropped > 0
    if not batched:  # a prompt block loads the experts its positions run in groups of at most C (the HF path)
        assert copies.demand == round(off_stats.total["demand_per_token"] * off_stats.total["tokens"])


# ---------------------------------------------------------------------------------------------- controller API
def test_controller_step_api_guards_and_sequences(case):
    model, ids, _, _ = case("olmoe")
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"])):
        ctl = psr_hf.controller(model)
        handle = ctl.decode_handle()
        with pytest.raises(RuntimeError, match="outside a step"):
            handle.select(0, np.zeros(ctl.num_experts, dtype=np.float32))
        decoder = Decoder(model, MAX_LEN)
        first = decoder.prefill(ids).clone()
        # a step that stops part-way closes the sequence: continuing raises, a new sequence starts cleanly
        with pytest.raises(KeyboardInterrupt):
            with handle.step(5, decoder.position):
                handle.select(0, np.zeros(ctl.num_experts, dtype=np.float32))
                raise KeyboardInterrupt
        with pytest.raises(RuntimeError, match="stopped part-way"):
            decoder.step(5)
        again = decoder.prefill(ids)
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        assert ctl.stats().tokens.tolist() == [ids.shape[1]]
        # the HF path runs normally after the engine
        with torch.no_grad():
            model(ids)


@pytest.mark.parametrize("kind", ["eager", "graph_decoder_eager"])
@pytest.mark.parametrize("name", ["olmoe", "deepseek_v3"])
def test_a_token_chosen_on_the_device_steps_as_the_same_token_given(case, name, kind):
    """``step_chosen`` (the token in the decoder's token buffer, read by a callback after the first launch)
    decodes what ``step(token)`` decodes, with the same decisions; a callback that stops the sequence steps
    nothing, and the next step decodes as if the stop had not been tried."""
    from psr_hf.engine import GraphDecoder

    model, ids, calibration, _ = case(name)
    tokens = [5, 17, 9, 33]
    with psr_hf.patched(model, RoutingConfig(**POLICIES["psr"]), calibration=calibration):
        make = (lambda: Decoder(model, MAX_LEN)) if kind == "eager" else (
            lambda: GraphDecoder(model, MAX_LEN, graphs=False))
        runs = {}
        for mode in ("given", "chosen"):
            decoder = make()
            ctl = psr_hf.controller(model)
            with ctl.record() as recorder:
                decoder.prefill(ids)
                logits = []
                for i, token in enumerate(tokens):
                    if mode == "given":
                        logits.append(decoder.step(token).float().clone())
                        continue
                    if i == 2:  # a stop: nothing is stepped
                        position = decoder.position
                        assert decoder.step_chosen(lambda: None) == (None, None)
                        assert decoder.position == position
                    decoder.layers.buffers.token.fill_(token)
                    out, read = decoder.step_chosen(lambda t=token: t)
                    assert read == token
                    logits.append(out.float().clone())
            runs[mode] = (torch.stack(logits), recorder.recordings)
        with pytest.raises(ValueError, match="continues a sequence"):
            make().step_chosen(lambda: 1)
    (given, rec_given), (chosen, rec_chosen) = runs["given"], runs["chosen"]
    assert _rel(chosen, given) < LOGITS_TOL
    np.testing.assert_array_equal(rec_chosen[-1].selected, rec_given[-1].selected)
    np.testing.assert_array_equal(rec_chosen[-1].tokens, rec_given[-1].tokens)
