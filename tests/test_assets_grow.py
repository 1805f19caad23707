"""psr_hf.assets.grow: a small MoE model grown to real-size dimensions computes the small model's function, so it
routes exactly as the small one under every policy; bad models and targets are refused with clear errors.

Tolerance of the logit comparisons: the grown model computes the same sums with zero-padded extra terms, but in
another blocking and order (longer matrix products, RMSNorm means over more entries, ``sqrt(2)`` query scales that
are not powers of two), so float32 results differ by rounding only: a few ulps of the largest activations, which
compound over the layers. ``LOGIT_RTOL`` bounds the difference relative to the largest logit at 1e-5 (about 80
float32 ulps); measured: at most 4.4e-7 of the largest logit on the random tiny models (max abs 2.7e-7) and 8.4e-7
on the trained tiny-moe (max abs 1.4e-5 for logits up to 17). Mapping errors exceed it (measured: the hidden norms'
epsilon left at the small model's, 3e-2 of the largest logit; only DeepSeek-V3's latent norm at 4x its epsilon,
6e-5). Padded hidden dimensions are checked to stay exactly zero, and the routing decisions to be identical.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.assets import TINY_MOE, load_tiny_moe
from psr_hf.assets.grow import (MOONLIGHT_16B_A3B, OLMOE_1B_7B, PRESETS, GrowTarget, default_target, grow,
                                grow_pretrained, target_by_name)
from psr_hf.assets.grow_families.base import norm_input_scale
from psr_hf.assets.grow_families.qwen3_5_moe import QWEN3_6_35B_A3B
from psr_hf.assets.grow_families.qwen3_next import QWEN3_NEXT_80B_A3B
from psr_hf.cli import main
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("quiet_psr_hf")

LOGIT_RTOL = 1e-5
RESIDENCY = 0.5

# small random models shaped like the real small ones (hidden 64), and reduced targets of the same code path
# whose hidden ratio is 4 (sqrt(4) = 2: the norm scales are exact) and whose head dimensions double
OLMOE_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=16,
                   num_hidden_layers=3, num_experts=8, num_experts_per_tok=2)
OLMOE_CI = OLMOE_1B_7B.with_dims(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=32,
                                 expert_intermediate_size=24)
DEEPSEEK_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                      num_experts_per_tok=2, n_group=1, topk_group=1, num_hidden_layers=3, first_k_dense_replace=1,
                      n_shared_experts=2, moe_intermediate_size=16, intermediate_size=64, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None)
MOONLIGHT_CI = MOONLIGHT_16B_A3B.with_dims(hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                                           expert_intermediate_size=24, dense_intermediate_size=96, kv_lora_rank=64,
                                           qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32)
# Qwen3.5/3.6-MoE: its head dimensions are kept (the tiny config's 16); the hidden size x4, the heads x2 with
# the grouping kept (query heads per key/value head, value heads per key head)
QWEN_SMALL = dict(num_hidden_layers=4)
QWEN_CI = QWEN3_6_35B_A3B.with_dims(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                    expert_intermediate_size=64, shared_expert_intermediate_size=64,
                                    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                                    linear_value_head_dim=16)
# Qwen3-Next: the same reduced dimensions (its tiny model has Qwen3.5's head dimensions and a dense MLP layer)
QWEN_NEXT_CI = QWEN3_NEXT_80B_A3B.with_dims(**{k: v for k, v in QWEN_CI.dims().items() if k not in ("name", "family")})
# the shipped tiny-moe (hidden 128, 4 heads of 32, experts of 64) to hidden 512, 8 heads of 64, experts of 96
TINY_MOE_CI = OLMOE_1B_7B.with_dims(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                                    expert_intermediate_size=96)

# every policy of the table, exact with both evictions
POLICIES = {
    "exact-lru": dict(policy="exact", eviction="lru"),
    "exact-score": dict(policy="exact", eviction="score", budget=1),
    "cache_prior": dict(policy="cache_prior"),
    "psr": dict(policy="psr"),
    "spec": dict(policy="spec"),
}


def _ids(vocab: int, rows: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def _assert_same_logits(small: torch.Tensor, big: torch.Tensor) -> float:
    diff = (small - big).abs().max().item()
    scale = small.abs().max().item()
    assert diff <= LOGIT_RTOL * scale, f"max |logit difference| {diff:.3g} > {LOGIT_RTOL} x {scale:.3g}"
    return diff


def _qwen(seed: int = 3, family: str = "qwen3_5_moe_text", **overrides):
    """A tiny Qwen3.5-MoE (or Qwen3-Next) with non-trivial norms (its zero-centred norms start at zero, the gated
    norm at one)."""
    return tiny_model(family, seed=seed, norm_noise=0.2, **{**QWEN_SMALL, **overrides})


def _case(family: str):
    if family == "olmoe":
        return tiny_model("olmoe", seed=3, **OLMOE_SMALL), OLMOE_CI
    if family == "qwen3_5_moe_text":
        return _qwen(), QWEN_CI
    if family == "qwen3_next":
        return _qwen(family="qwen3_next"), QWEN_NEXT_CI
    return tiny_model("deepseek_v3", seed=3, **DEEPSEEK_SMALL), MOONLIGHT_CI


def _stream_scale(small, big) -> float:
    """The factor the grown residual stream carries (1 where the grown epsilon shrank with the hidden ratio)."""
    r = big.config.hidden_size / small.config.hidden_size
    return norm_input_scale(r, small.config.rms_norm_eps, big.config.rms_norm_eps)


@pytest.fixture(scope="module", params=["olmoe", "deepseek_v3", "qwen3_5_moe_text", "qwen3_next"])
def grown(request):
    small, target = _case(request.param)
    return small, grow(small, target), target


# ---------------------------------------------------------------------------------------------------- exactness
def test_the_grown_model_has_the_target_dims_and_computes_the_small_models_logits(grown):
    small, big, target = grown
    assert big is not small and big.config.hidden_size == target.hidden_size
    assert big.config.num_attention_heads == target.num_attention_heads
    ids = _ids(small.config.vocab_size)
    with torch.no_grad():
        out_small = small(ids, output_hidden_states=True)
        out_big = big(ids, output_hidden_states=True)
    _assert_same_logits(out_small.logits, out_big.logits)
    H, c = small.config.hidden_size, _stream_scale(small, big)
    last = len(out_small.hidden_states) - 1  # the final norm's output: not the stream, not scaled
    for i, (hs_small, hs_big) in enumerate(zip(out_small.hidden_states, out_big.hidden_states, strict=True)):
        assert torch.count_nonzero(hs_big[..., H:]) == 0  # padded hidden dimensions stay exactly zero
        real = hs_big[..., :H] / (1.0 if i == last else c)
        assert (hs_small - real).abs().max() <= LOGIT_RTOL * max(1.0, hs_small.abs().max().item())


def test_the_small_model_is_untouched_and_the_defaults_follow_it():
    small, target = _case("olmoe")
    before = {k: v.clone() for k, v in small.state_dict().items()}
    big = grow(small, target)
    assert all(torch.equal(before[k], v) for k, v in small.state_dict().items())
    assert big.model.embed_tokens.weight.dtype == torch.float32 and big.device == small.device
    half = grow(small, target, dtype=torch.bfloat16)
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16
    assert half.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    # the norm scales are powers of two here (ratio 4): the real entries of a hidden norm are w / 2 exactly
    w = small.model.norm.weight.to(torch.bfloat16)
    assert torch.equal(half.model.norm.weight[:64], w / 2) and not half.model.norm.weight[64:].any()


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_query_lora_and_both_rope_layouts_are_exact(interleave):
    small = tiny_model("deepseek_v3", seed=4, **{**DEEPSEEK_SMALL, "q_lora_rank": 16, "rope_interleave": interleave})
    big = grow(small, MOONLIGHT_CI.with_dims(q_lora_rank=64))
    ids = _ids(small.config.vocab_size, seed=2)
    with torch.no_grad():
        _assert_same_logits(small(ids).logits, big(ids).logits)


def test_grouped_query_attention_and_clip_qkv_are_exact():
    # 2 query heads per key/value head grown to 1 (each key/value head repeated), q/k/v clamped
    small = tiny_model("olmoe", seed=5, **{**OLMOE_SMALL, "num_key_value_heads": 2, "clip_qkv": 0.05})
    big = grow(small, OLMOE_CI)
    assert big.config.clip_qkv == pytest.approx(0.05 * 2 ** 0.25)
    ids = _ids(small.config.vocab_size, seed=3)
    with torch.no_grad():
        _assert_same_logits(small(ids).logits, big(ids).logits)


@pytest.mark.parametrize("family, target", [("qwen3_5_moe_text", QWEN_CI), ("qwen3_next", QWEN_NEXT_CI)])
def test_qwen_gated_delta_net_and_gated_attention_grow_exactly_with_repeated_key_heads(family, target):
    """Fewer heads per key head in the target (one query head per key/value head, one value head per Gated DeltaNet
    key head): each small key head is repeated (Qwen3-Next: with its share of the fused value heads); the stream
    carries sqrt(4) = 2."""
    small = _qwen(seed=5, family=family)
    big = grow(small, target.with_dims(num_key_value_heads=8, linear_num_key_heads=8))
    assert _stream_scale(small, big) == 2.0 and big.config.rms_norm_eps == small.config.rms_norm_eps
    assert big.config.layer_types == small.config.layer_types
    ids = _ids(small.config.vocab_size, seed=4)
    with torch.no_grad():
        _assert_same_logits(small(ids).logits, big(ids).logits)


@pytest.mark.parametrize("family, preset, name", [("qwen3_5_moe_text", QWEN3_6_35B_A3B, "Qwen3.6-35B-A3B"),
                                                  ("qwen3_next", QWEN3_NEXT_80B_A3B, "Qwen3-Next-80B-A3B")])
def test_the_qwen_presets_are_transformers_defaults(family, preset, name):
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    defaults = (Qwen3_5MoeTextConfig if family == "qwen3_5_moe_text" else Qwen3NextConfig)()
    assert default_target(family) is preset and target_by_name(name) is preset
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim"):
        assert getattr(preset, field) == getattr(defaults, field), field
    assert preset.expert_intermediate_size == defaults.moe_intermediate_size


def test_qwen_grow_keeps_the_head_dimensions():
    with pytest.raises(ValueError, match="keeps Qwen3.5/3.6's head dimensions.*target head_dim=32 against the "
                                         "model's 16"):
        grow(_qwen(), QWEN_CI.with_dims(head_dim=32))
    with pytest.raises(ValueError, match="linear_num_value_heads=6 is not a multiple of linear_num_key_heads=4"):
        QWEN_CI.with_dims(linear_num_value_heads=6)
    with pytest.raises(ValueError, match="are Qwen3.5/3.6-MoE fields; leave them None for an OLMoE target"):
        OLMOE_CI.with_dims(linear_num_key_heads=4)


# ---------------------------------------------------------------------------------------------------- routing
def _run(model, ids, config, calibration):
    with psr_hf.patched(model, config, calibration=calibration):
        ctl = psr_hf.controller(model)
        with torch.no_grad(), ctl.record() as recorder:
            logits = model(ids).logits
            tokens = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
        return logits, tokens, recorder.recordings, ctl.stats().total


def test_the_grown_model_routes_exactly_as_the_small_one_under_every_policy(grown):
    small, big, _ = grown
    ids = _ids(small.config.vocab_size, length=32, seed=5)
    calibration = psr_hf.calibrate(small, _ids(small.config.vocab_size, rows=4, length=48, seed=6), progress=False)
    for name, fields in POLICIES.items():
        config = RoutingConfig(residency=RESIDENCY, **fields)
        logits_s, tokens_s, recs_s, stats_s = _run(small, ids, config, calibration)
        logits_b, tokens_b, recs_b, stats_b = _run(big, ids, config, calibration)
        _assert_same_logits(logits_s, logits_b)
        assert torch.equal(tokens_s, tokens_b), name
        assert len(recs_s) == len(recs_b) > 0
        for r_s, r_b in zip(recs_s, recs_b, strict=True):  # every token-layer's selected experts
            assert (r_s.selected == r_b.selected).all(), name
            for a, b in ((r_s.scores, r_b.scores), (r_s.pregate, r_b.pregate)):  # router scores and pre-gates
                assert abs(a - b).max() <= LOGIT_RTOL * max(1.0, abs(a).max()), name
        # the policies that deviate from the router's top-K did deviate: the decisions compared are not trivial
        assert (stats_s["replaced_per_token"] > 0) == (fields["policy"] != "exact"), name
        # the counters (tokens, copies, replaced slots) are equal; the displaced router mass is a sum of router
        # weights, equal up to float rounding
        mass_s, mass_b = stats_s.pop("displaced_mass"), stats_b.pop("displaced_mass")
        assert stats_s == stats_b and mass_b == pytest.approx(mass_s, rel=1e-6, abs=1e-9), name


# ---------------------------------------------------------------------------------------------------- tiny-moe
def test_the_shipped_tiny_moe_grows_exactly():
    model, tokenizer, _ = load_tiny_moe()
    big = grow(model, TINY_MOE_CI)
    assert big.config.hidden_size == 512 and big.model.layers[0].mlp.experts.down_proj.shape == (64, 512, 96)
    ids = tokenizer("Anne Elliot walked along the shore at Lyme.", return_tensors="pt").input_ids
    with torch.no_grad():
        _assert_same_logits(model(ids).logits, big(ids).logits)


def test_grow_logs_the_parameter_counts(caplog):
    small, target = _case("olmoe")
    with caplog.at_level(logging.INFO, logger="psr_hf.assets.grow"):
        grow(small, target)
    message = caplog.records[-1].getMessage()
    assert "parameters" in message and "MB" in message and target.name in message


# ---------------------------------------------------------------------------------------------------- errors
def test_a_model_that_is_not_a_mixture_of_experts_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32))
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    for model in (gpt2, llama):
        with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
            grow(model, OLMOE_CI)


def test_a_target_smaller_than_the_model_or_of_another_family_is_refused():
    small, _ = _case("olmoe")
    with pytest.raises(ValueError, match=r"smaller than the model: hidden_size=32 < the model's 64"):
        grow(small, OLMOE_1B_7B.with_dims(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="must be a multiple of the model's 16"):
        grow(small, OLMOE_1B_7B.with_dims(hidden_size=192, num_attention_heads=8, num_key_value_heads=8,
                                          head_dim=24))
    with pytest.raises(ValueError, match="is for deepseek_v3 models; this model is olmoe"):
        grow(small, MOONLIGHT_CI)
    deepseek, _ = _case("deepseek_v3")
    with pytest.raises(ValueError, match="a query LoRA cannot be added"):
        grow(deepseek, MOONLIGHT_CI.with_dims(q_lora_rank=32))


def test_rope_types_that_depend_on_the_head_size_are_refused():
    small = tiny_model("olmoe", **OLMOE_SMALL,
                       rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope type 'dynamic'.*grow maps default, linear RoPE only"):
        grow(small, OLMOE_CI)


def test_bad_preset_names_and_bad_targets_say_what_is_known():
    with pytest.raises(ValueError, match="known targets: olmoe-1b-7b, moonlight-16b-a3b, qwen3.6-35b-a3b, "
                                         "qwen3-next-80b-a3b; did you mean olmoe-1b-7b"):
        target_by_name("olmoe-1b7b")
    assert target_by_name("OLMoE-1B-7B") is OLMOE_1B_7B
    assert list(PRESETS) == ["olmoe-1b-7b", "moonlight-16b-a3b", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b"]
    assert default_target(tiny_model("deepseek_v3").config) is MOONLIGHT_16B_A3B
    with pytest.raises(ValueError, match="grow has no target for model type 'llama'"):
        default_target("llama")
    with pytest.raises(ValueError, match="must equal hidden_size=2048"):
        OLMOE_1B_7B.with_dims(head_dim=64)
    with pytest.raises(ValueError, match="no dimension 'hidden'; its dimensions: hidden_size"):
        OLMOE_1B_7B.with_dims(hidden=512)
    with pytest.raises(ValueError, match="num_key_value_heads=8 must equal num_attention_heads=16"):
        dataclasses.replace(MOONLIGHT_16B_A3B, num_key_value_heads=8)
    with pytest.raises(ValueError, match="family='mixtral'"):
        GrowTarget(name="x", family="mixtral", hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
                   expert_intermediate_size=8)
    assert OLMOE_1B_7B.hidden_size == 2048 and OLMOE_1B_7B.head_dim == 128
    assert (MOONLIGHT_16B_A3B.expert_intermediate_size, MOONLIGHT_16B_A3B.dense_intermediate_size) == (1408, 11264)


def test_grow_pretrained_saves_a_deepseek_model_that_reloads_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    from psr_hf.testing import save_tiny

    save_tiny("deepseek_v3", tmp_path / "small", seed=3, **DEEPSEEK_SMALL)
    out = grow_pretrained(tmp_path / "small", tmp_path / "grown", MOONLIGHT_CI, dtype=torch.float32)
    small = AutoModelForCausalLM.from_pretrained(tmp_path / "small", dtype=torch.float32).eval()
    big = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert big.config.kv_lora_rank == 64 and (out / "tokenizer.json").is_file()
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # readable as the user's files are
    assert torch.equal(big.model.layers[1].mlp.gate.e_score_correction_bias,
                       small.model.layers[1].mlp.gate.e_score_correction_bias)
    ids = _ids(small.config.vocab_size, seed=7)
    with torch.no_grad():
        _assert_same_logits(small(ids).logits, big(ids).logits)


def test_grow_pretrained_refuses_a_directory_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        grow_pretrained(TINY_MOE, tmp_path, TINY_MOE_CI)


# ---------------------------------------------------------------------------------------------------- CLI
def test_the_cli_grows_tiny_moe_to_a_reduced_target(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "grown"
    overrides = ["hidden_size=256", "num_attention_heads=4", "num_key_value_heads=4", "head_dim=64",
                 "expert_intermediate_size=80"]
    argv = ["grow", "--model", "tiny-moe", "--target", "olmoe-1b-7b", "--out", str(out), "--dtype", "float32"]
    assert main([*argv, *(a for o in overrides for a in ("--override", o))]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and line.startswith("grew tiny-moe (olmoe, 8.7 M parameters) to olmoe-1b-7b with")
    record = json.loads((out / "grown_from.json").read_text())
    assert record["target_dims"]["hidden_size"] == 256 and record["source_dims"]["hidden"] == 128
    assert (out / "tokenizer.json").is_file() and (out / "calibration.safetensors").is_file()

    small, tokenizer, _ = load_tiny_moe()
    big = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(out).vocab_size == tokenizer.vocab_size
    ids = tokenizer("Sir Walter Elliot, of Kellynch Hall", return_tensors="pt").input_ids
    with torch.no_grad():
        _assert_same_logits(small(ids).logits, big(ids).logits)


def test_the_cli_names_a_bad_target_or_override(tmp_path, capsys):
    assert main(["grow", "--model", "tiny-moe", "--target", "olmoe", "--out", str(tmp_path / "x")]) == 2
    assert "known targets: olmoe-1b-7b, moonlight-16b-a3b" in capsys.readouterr().err
    assert main(["grow", "--model", "tiny-moe", "--override", "hidden=1", "--out", str(tmp_path / "x")]) == 2
    assert "no dimension 'hidden'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
