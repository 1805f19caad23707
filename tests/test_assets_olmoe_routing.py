"""The shipped trained model with OLMoE-1B-7B's routing geometry (``olmoe-routing``): loadable offline by name
everywhere a model is named, with the geometry its card states, a calibration that fits it, and exact growth to a
reduced real-size target (the same code path as the full size) with identical routing under every policy.
``moonlight-routing`` is built, not shipped: tests/test_examples_train_tiny_moe.py builds one with the same command
and loads it by name; tests/test_assets_grow.py grows DeepSeek-V3 models."""

from __future__ import annotations

import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.assets import OLMOE_ROUTING, OLMOE_ROUTING_NAME, SHIPPED, load_shipped, resolve_model
from psr_hf.assets.grow import OLMOE_1B_7B, grow
from psr_hf.cli import main

pytestmark = pytest.mark.usefixtures("quiet_psr_hf")

# reduced targets of the same code path (hidden 128 -> 512: ratio 4, exact power-of-two norm scales)
REDUCED = {
    OLMOE_ROUTING_NAME: OLMOE_1B_7B.with_dims(hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                                              head_dim=64, expert_intermediate_size=48),
}
TEXT = "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement, never took up"


@pytest.fixture(scope="module")
def shipped():
    return OLMOE_ROUTING_NAME, *load_shipped(OLMOE_ROUTING_NAME)


def test_the_name_resolves_offline_to_the_shipped_directory_with_its_card():
    assert SHIPPED[OLMOE_ROUTING_NAME] == OLMOE_ROUTING
    source = resolve_model(OLMOE_ROUTING_NAME)
    assert (source.kind, source.model_type, source.hidden_size) == ("shipped", "olmoe", 128)
    for name in ("README.md", "card.json", "card.png", "calibration.safetensors", "tokenizer.json"):
        assert (OLMOE_ROUTING / name).is_file(), name


def test_the_model_has_olmoe_1b_7bs_routing_geometry(shipped):
    _, model, tokenizer, _ = shipped
    c = model.config  # OLMoE-1B-7B: 16 MoE layers, 64 experts, top-8, softmax without renormalising
    assert (c.num_hidden_layers, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == (16, 64, 8, False)
    assert tokenizer.padding_side == "left"


def test_the_shipped_calibration_fits_and_the_model_speaks(shipped):
    name, model, tokenizer, calibration = shipped
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5), calibration=calibration)
    try:
        with torch.no_grad():
            out = model(ids, labels=ids)
        assert psr_hf.controller(model).stats().total["replaced_per_token"] >= 0
    finally:
        psr_hf.unpatch(model)
    assert out.loss.item() < 6.0  # trained: far below a uniform guess over 8192 tokens (9.0 nats)


POLICIES = [dict(policy="exact", eviction="lru"), dict(policy="cache_prior"), dict(policy="psr", lam=0.3, budget=1),
            dict(policy="spec")]


def test_grown_to_a_reduced_real_size_it_computes_the_same_logits_and_routing(shipped):
    name, model, tokenizer, calibration = shipped
    big = grow(model, REDUCED[name])
    ids = torch.stack([tokenizer(t, return_tensors="pt").input_ids[0, :20] for t in (TEXT, TEXT[::-1])])
    for fields in POLICIES:
        config = RoutingConfig(residency=0.25, **fields)
        results = []
        for m in (model, big):
            with psr_hf.patched(m, config, calibration=calibration), torch.no_grad():
                with psr_hf.controller(m).record() as recorder:
                    logits = m(ids).logits
                results.append((logits, recorder.recordings, psr_hf.controller(m).stats().total))
        (ls, rs, ss), (lb, rb, sb) = results
        assert (ls - lb).abs().max() <= 1e-5 * ls.abs().max(), fields
        for a, b in zip(rs, rb, strict=True):
            assert (a.selected == b.selected).all(), fields
        assert ss["copies_per_token"] == sb["copies_per_token"], fields


def test_psr_hf_excess_nll_accepts_the_name_and_uses_held_out_text(capsys):
    assert main(["excess-nll", "--model", OLMOE_ROUTING_NAME, "--windows", "1", "--tokens", "32", "--residencies", "0.5",
                 "--lams", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "persuasion_vol1.txt" in out and "psr" in out
