"""Training a margin head (the paper's Section 6.10: the change-based gate's learned per-token margin and PSR's
bounded per-token bonus) on the shipped olmoe-routing (CPU): the per-position caches the relaxation reads are the
logical cache's, the relaxed training forward computes the hard routing, the margins get the gradients of
the KL and the smooth host loads, a load penalty lowers the real copies, and what is written loads into a fresh
model that routes as the trained one did, replayably and with the offload's copies changing nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.assets import load_shipped
from psr_hf.assets.texts import module_sources, token_windows
from psr_hf.gates import MarginHead
from psr_hf.training.gate import _kl, _relax, distill_routing, load_distilled
from psr_hf.policy import LogicalCache

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

SWAP = psr_hf.RoutingConfig(policy="cache_prior", lam=0.3, eviction="lru", residency=0.375)
BONUS = psr_hf.RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.375)


@pytest.mark.parametrize("config", [SWAP, BONUS, psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=2,
                                                                     eviction="score", residency=0.25)],
                         ids=["cache-prior-lru", "psr-n1", "psr-n2-score"])
def test_the_cache_each_position_selected_from_is_the_logical_caches_between_its_two_parts(config):
    E, L, K, S = 16, 3, 2, 40
    rng = np.random.default_rng(0)
    z = rng.standard_normal((1, S, E)).astype(np.float32)
    g = rng.standard_normal((1, S, E)).astype(np.float32)
    block = LogicalCache(config, num_layers=L, num_experts=E, top_k=K)
    stepped = LogicalCache(config, num_layers=L, num_experts=E, top_k=K)
    for layer in (1, 2):
        before = block.resident_mask(layer) != 0
        sets = block.step(layer, z, g).selection_sets(before[None])
        for s in range(S):  # one position at a time: part 1, read the cache, then part 2
            stepped.prefetch(layer, g[:, s])
            np.testing.assert_array_equal(sets[0, s], stepped.resident_mask(layer) != 0)
            stepped.select(layer, z[:, s])
        np.testing.assert_array_equal(block.resident_mask(layer), stepped.resident_mask(layer))
    assert sets.sum(-1).max() == block.capacity


def _windows(tokenizer, tokens=512, window=128):
    return token_windows([t for _, t in module_sources(["functools"])], tokenizer, tokens=tokens, window=window,
                         option="--text")


@pytest.mark.parametrize("config", [SWAP, BONUS], ids=["swap-gate", "bounded-bonus"])
def test_the_relaxed_training_forward_is_the_hard_routing_and_its_margins_get_gradients(config):
    model, tokenizer, calibration = load_shipped("olmoe-routing")
    window = _windows(tokenizer)[0].reshape(1, -1)
    with torch.no_grad():
        teacher = model(input_ids=window).logits
    head = MarginHead.uniform(config.lam * calibration.delta, model.config.hidden_size)
    with torch.no_grad():
        head.weight.normal_(0, 0.3)  # margins that differ per token
    model.train()
    with psr_hf.patched(model, config, calibration=calibration, gate=head):
        with torch.no_grad():
            hard = model(input_ids=window).logits
        _relax(model, config, temperature=0.5)
        relaxed = model(input_ids=window).logits
        loads = psr_hf.controller(model).routing.relaxation.loads
    model.eval()
    # the surrogate changes gradients only: the same selection and weights (its zero-weight candidates run in the
    # experts' batched matmuls, which may round their other rows differently)
    torch.testing.assert_close(relaxed, hard, rtol=1e-4, atol=1e-4)
    kl = _kl(relaxed, teacher, None)
    (kl_grad,) = torch.autograd.grad(kl, head.bias, retain_graph=True)
    (load_grad,) = torch.autograd.grad(loads, head.bias)
    assert kl_grad.abs().sum() > 0
    # a larger margin keeps more of the cache: the smooth host loads fall as every layer's margin rises
    assert (load_grad < 0).all(), load_grad
    assert float(loads) > 0


def _copies(model, config, calibration, windows, gate) -> float:
    with torch.no_grad(), psr_hf.patched(model, config, calibration=calibration, gate=gate):
        for w in windows:
            model(input_ids=w.reshape(1, -1))
        return float(psr_hf.controller(model).stats().total["copies_per_token"])


def test_a_load_penalty_trains_the_swap_gate_to_fewer_copies_and_the_result_routes_as_trained(tmp_path):
    model, tokenizer, calibration = load_shipped("olmoe-routing")
    windows = _windows(tokenizer)
    untrained = MarginHead.uniform(SWAP.lam * calibration.delta, model.config.hidden_size)
    before = _copies(model, SWAP, calibration, windows, untrained)
    head = MarginHead.uniform(SWAP.lam * calibration.delta, model.config.hidden_size)
    result = distill_routing(model, windows, SWAP, tmp_path / "swap", calibration=calibration, steps=8,
                             attention_rank=0, expert_rank=0, lr=1e-3, router_lr=2e-4, head_lr=3e-2, warmup=2,
                             gate=head, load_penalty=0.1)
    assert len(result.loads) == 8 and result.loads[-1] < result.loads[0]
    fresh, trained = load_distilled(load_shipped("olmoe-routing")[0], result.path)
    assert trained.metadata["model_type"] == "olmoe" and float(trained.metadata["load_penalty"]) == 0.1
    torch.testing.assert_close(trained.weight, head.weight, rtol=0, atol=0)
    after = _copies(fresh, SWAP, calibration, windows, trained)
    assert after < 0.8 * before, (before, after)
    prompt = windows[0][:24].reshape(1, -1)  # the loaded model and gate route as the trained ones
    outputs = []
    for net in (model, fresh):
        with torch.no_grad(), psr_hf.patched(net, SWAP, calibration=calibration, gate=trained):
            outputs.append(net.generate(input_ids=prompt, max_new_tokens=6, do_sample=False))
    assert torch.equal(outputs[0], outputs[1])
    recordings = []  # the trained gate's routing replays from its recording and ignores the offload's copies
    for offload in (None, psr_hf.OffloadConfig(device="cpu", check_slots=True)):
        with psr_hf.patched(fresh, SWAP, calibration=calibration, gate=trained, offload=offload):
            with psr_hf.controller(fresh).record() as recorder, torch.no_grad():
                fresh(input_ids=windows[1].reshape(1, -1))
        recordings += recorder.recordings
    np.testing.assert_array_equal(psr_hf.replay(SWAP, recordings[0], calibration=calibration).selected,
                                  recordings[0].selected)
    np.testing.assert_array_equal(recordings[1].selected, recordings[0].selected)
    other, _, _ = load_shipped("tiny-moe")
    with pytest.raises(ValueError):
        load_distilled(other, result.path)


def test_gates_train_only_bonuses_with_a_fixed_scale_and_a_positive_temperature(tmp_path):
    model, tokenizer, calibration = load_shipped("olmoe-routing")
    windows = _windows(tokenizer, tokens=256)
    head = MarginHead.uniform(0.3 * calibration.delta, model.config.hidden_size)
    exact = psr_hf.RoutingConfig(policy="exact", residency=0.375)
    with pytest.raises(ValueError, match="cache_prior or psr"):
        distill_routing(model, windows, exact, tmp_path / "a", calibration=calibration, steps=1, gate=head)
    with pytest.raises(ValueError, match="cache_prior or psr"):
        distill_routing(model, windows, exact, tmp_path / "a", calibration=calibration, steps=1, load_penalty=0.1)
    with pytest.raises(ValueError, match="temperature"):
        distill_routing(model, windows, SWAP, tmp_path / "a", calibration=calibration, steps=1, gate=head,
                        temperature=0.0)


def test_the_command_trains_a_margin_head_that_load_distilled_returns(tmp_path, capsys):
    from psr_hf.cli import main

    out = tmp_path / "bonus"
    assert main(["train-gate", "--tokens", "256", "--window", "128", "--gate", "--load-penalty", "0.01",
                 "--attention-rank", "0", "--expert-rank", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "smooth host loads per token" in printed and "gate.safetensors" in printed
    model, gate = load_distilled(load_shipped("olmoe-routing")[0], out)
    assert isinstance(gate, MarginHead) and gate.metadata["load_penalty"] == "0.01"
    assert main(["train-gate", "--gate", "--temperature", "0", "--out", str(tmp_path / "other")]) == 2
    assert "temperature" in capsys.readouterr().err
