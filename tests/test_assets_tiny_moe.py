"""The trained tiny OLMoE shipped in psr_hf/assets: it loads offline, it learned, its routers specialised, and the
policies behave on its real router traces as the spec and the paper say (CPU, offline)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from test_policy_kernel import _assert_same_decisions

import psr_hf
from psr_hf.assets import CALIBRATION, TINY_MOE, load_tiny_moe
from psr_hf.eval.router_stats import RouterStats, recordings, router_stats
from psr_hf.policy.replaying import Recording

HELD_OUT = Path(__file__).resolve().parents[1] / "psr_hf" / "assets" / "persuasion_vol1.txt"


@pytest.fixture(scope="module")
def shipped(one_torch_thread):
    return load_tiny_moe()


@pytest.fixture(scope="module")
def windows(shipped):
    """Four held-out windows of 128 tokens from *Persuasion* (never in the model's training or calibration)."""
    _, tokenizer, _ = shipped
    ids = tokenizer(HELD_OUT.read_text(encoding="utf-8")[:40_000], add_special_tokens=False,
                    verbose=False)["input_ids"]  # verbose: a long text is cut into windows here
    return [torch.tensor([ids[i : i + 128]]) for i in range(0, 4 * 128, 128)]


@pytest.fixture(scope="module")
def traces(shipped, windows):
    model, _, calibration = shipped
    return recordings(model, windows, calibration)


def _untrained(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_it_loads_offline_with_olmoes_routing_shape_and_its_calibration_matches():
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_MOE)
    config = model.config
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("olmoe", 64, 8)
    assert config.norm_topk_prob is False and config.num_hidden_layers >= 4
    weights = [p for p in TINY_MOE.glob("*.safetensors") if p.name != CALIBRATION]
    assert weights and sum(p.stat().st_size for p in weights) <= 25e6
    tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_MOE)
    assert len(tokenizer) == config.vocab_size
    text = "It is a truth universally acknowledged, that"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    cal = psr_hf.Calibration.load(TINY_MOE / CALIBRATION)
    assert (cal.num_layers, cal.num_experts, cal.vocab_size) == (4, 64, config.vocab_size)
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", residency=0.25), calibration=cal)  # validated here
    assert psr_hf.controller(model).capacity == 16
    psr_hf.unpatch(model)


@torch.no_grad()
def _nll(model, windows) -> float:
    return float(np.mean([float(model(input_ids=w, labels=w).loss) for w in windows]))


def test_it_learned_held_out_text_far_better_than_an_untrained_model(shipped, windows):
    model, _, _ = shipped
    trained = _nll(model, windows)
    untrained = _nll(_untrained(model.config), windows)
    assert untrained > 0.9 * math.log(model.config.vocab_size)  # about uniform: 9.0 nats
    # measured 4.92 against 9.02 on these windows (the card: 3.97 nats/token over all held-out Austen)
    assert trained < 6.0 and trained < untrained - 3.0, (trained, untrained)


def test_its_routers_specialised_beyond_an_untrained_router(shipped, windows, traces):
    model, _, _ = shipped
    trained = router_stats(traces)
    untrained = router_stats(recordings(_untrained(model.config), windows))
    assert trained.tokens == 4 * 128 and trained.num_experts == 64 and trained.top_k == 8
    # the load-balancing loss keeps usage near uniform, but below it
    assert all(h < trained.uniform_entropy for h in trained.usage_entropy)
    # locality: consecutive tokens share far more of their top-8 than a router that ignores its input (8/64)
    assert trained.top_k_reuse[0] > 2.5 * trained.random_reuse
    assert trained.top_k_reuse[0] > untrained.top_k_reuse[0] + 0.1  # measured 0.40 against 0.21
    # the next layer's router applied one layer early finds most of that layer's top-8, more than untrained
    for layer in range(2, 4):
        assert trained.pregate_accuracy[layer] > 0.6
        assert trained.pregate_accuracy[layer] > untrained.pregate_accuracy[layer] + 0.1


def _recording(selected_rows: list[list[int]], E: int = 4, K: int = 2) -> Recording:
    """A one-layer recording whose router ranks ``selected_rows[t]`` first at token t."""
    T = len(selected_rows)
    scores = np.zeros((T, 1, E), dtype=np.float32)
    for t, row in enumerate(selected_rows):
        scores[t, 0, row] = [2.0, 1.0][: len(row)]
    return Recording(scores=scores, pregate=np.zeros_like(scores), tokens=np.zeros(T, dtype=np.int64),
                     selected=np.sort(np.array(selected_rows))[:, None], top_k=K, default_window=K)


def test_router_stats_on_hand_made_recordings():
    # label "a" always uses experts {0, 1}, label "b" always {2, 3}: reuse 1, usage uniform over 4 experts
    # (entropy ln 4), and the experts tell the label apart completely: I(expert; label) = ln 2
    recs = [_recording([[0, 1]] * 3), _recording([[2, 3]] * 3)]
    stats = router_stats(recs, labels=["a", "b"])
    assert stats.tokens == 6 and stats.top_k_reuse == [1.0]
    assert stats.usage_entropy[0] == pytest.approx(math.log(4))
    assert stats.source_information[0] == pytest.approx(math.log(2))
    assert stats.pregate_accuracy == [None]
    # alternating sets: no reuse; one label: no information
    alternating = router_stats([_recording([[0, 1], [2, 3], [0, 1]])], labels=["a"])
    assert alternating.top_k_reuse == [0.0] and alternating.source_information == [0.0]
    assert router_stats(recs).source_information is None
    assert isinstance(stats, RouterStats) and stats.to_dict()["random_reuse"] == 0.5
    with pytest.raises(ValueError, match="one label per recording"):
        router_stats(recs, labels=["a"])
    with pytest.raises(ValueError, match="at least one recording"):
        router_stats([])
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        recordings(None, [torch.zeros(2, 3, dtype=torch.long)])


KERNEL_CONFIGS = [
    dict(policy="exact", eviction="lru"),
    dict(policy="exact", eviction="score", budget=1),
    dict(policy="cache_prior", lam=0.2),
    dict(policy="psr", lam=0.2, budget=1),
    dict(policy="psr", lam=0.3, budget=2, eviction="lru", top_j=1),
    dict(policy="spec"),
]


@pytest.mark.parametrize("fields", KERNEL_CONFIGS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("residency", [0.5, 0.25])
def test_the_kernel_matches_the_reference_on_the_models_router_traces(shipped, traces, fields, residency):
    _, _, calibration = shipped
    config = psr_hf.RoutingConfig(residency=residency, **fields)
    trace = traces[0]
    _assert_same_decisions(config, trace.top_k, trace, calibration)


def test_the_patched_model_makes_the_decisions_its_replay_makes(shipped, windows):
    model, _, calibration = shipped
    config = psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.25)
    with psr_hf.patched(model, config, calibration=calibration):
        with psr_hf.controller(model).record() as rec, torch.no_grad():
            model(input_ids=windows[1])
    (recording,) = rec.recordings
    replayed = psr_hf.replay(config, recording, calibration=calibration)
    np.testing.assert_array_equal(replayed.selected, recording.selected)
    assert replayed.replaced.sum() > 0  # psr did steer the routing on this text


@pytest.mark.parametrize("residency", [0.5, 0.25])
def test_on_real_traces_psr_needs_fewer_demand_copies_than_cache_prior_at_the_same_lam(shipped, traces,
                                                                                         residency):
    """The paper's ordering on copies (Section 5): at the same lam, psr's one-layer-early prefetch leaves fewer
    demand copies than cache_prior, which in turn needs far fewer than exact routing with LRU."""
    _, _, calibration = shipped

    def demand(**fields) -> float:
        config = psr_hf.RoutingConfig(residency=residency, **fields)
        return float(np.mean([psr_hf.replay(config, r, calibration=calibration).copies_per_token()["demand"]
                              for r in traces]))

    exact = demand(policy="exact", eviction="lru")
    for lam in (0.1, 0.2, 0.3):
        cache_prior = demand(policy="cache_prior", lam=lam)
        psr = demand(policy="psr", lam=lam, budget=1)
        assert psr < cache_prior < exact, (lam, psr, cache_prior, exact)


def test_offloading_the_trained_model_keeps_its_tokens(shipped, windows):
    model, _, calibration = shipped
    config = psr_hf.RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.25)
    prompt = windows[2][:, :24]
    with psr_hf.patched(model, config, calibration=calibration):
        reference = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=1)
    with psr_hf.patched(model, config, calibration=calibration,
                        offload=psr_hf.OffloadConfig(device="cpu", check_slots=True)):
        offloaded = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=1)
        stats = psr_hf.controller(model).stats().offload
        assert stats.demand > 0 and stats.prefetch > 0
    assert torch.equal(reference, offloaded)


@torch.no_grad()
def test_the_shipped_tokenizer_pads_on_the_left_so_a_batch_generates_what_each_prompt_generates_alone(shipped):
    """generate() continues every row after its last position: with the shipped tokenizer's default (left)
    padding each row's greedy tokens equal its prompt's alone, unpatched and patched; right padding (transformers
    only warns) changed the shorter prompt's continuation."""
    model, tokenizer, calibration = shipped
    assert tokenizer.padding_side == "left"
    assert transformers.AutoTokenizer.from_pretrained(TINY_MOE).padding_side == "left"
    prompts = ["The experts of", "Once upon a time", "It was"]
    alone = {}

    def batched(tok) -> torch.Tensor:
        batch = tok(prompts, return_tensors="pt", padding=True)
        return model.generate(**batch, max_new_tokens=12, do_sample=False)[:, batch["input_ids"].shape[1]:]

    def single(prompt: str) -> torch.Tensor:
        ids = tokenizer(prompt, return_tensors="pt")
        return model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:]

    for label, patch_kwargs in [("unpatched", None), ("psr", dict(calibration=calibration))]:
        if patch_kwargs is not None:
            psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", residency=0.25), **patch_kwargs)
        try:
            out = batched(tokenizer)
            alone[label] = [single(p) for p in prompts]
            for i, expected in enumerate(alone[label]):
                assert torch.equal(out[i], expected), (label, prompts[i])
        finally:
            if patch_kwargs is not None:
                psr_hf.unpatch(model)
    right = transformers.AutoTokenizer.from_pretrained(TINY_MOE, padding_side="right")
    wrong = batched(right)
    assert any(not torch.equal(wrong[i], alone["unpatched"][i]) for i in range(len(prompts)))
