"""The engine on the hybrid decoders of Qwen3.5/3.6-MoE (psr_hf/engine/families/qwen3_5_moe.py) and Qwen3-Next
(qwen3_next.py: fused Gated DeltaNet projections, a dense MLP layer in the tiny config), CPU, float32: generate()
through the engine gives the patched transformers path's tokens, scores within 1e-4 and routing decisions, for the
causal LMs and the image-text model on text, exact and PSR routing, resident and offloaded; the Gated DeltaNet
state starts every sequence from zero; the layers' step equals the model's own forward position by position.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig, engine
from psr_hf.engine.families import build_layers
from psr_hf.testing import tiny_model
from test_engine_generate import _generate as _fresh_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

POLICIES = {"exact": dict(policy="exact", residency=0.5), "psr": dict(policy="psr", lam=0.2, budget=1, residency=0.5)}
NEW = 8


def _model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model with non-trivial norms (the zero-centred norms start at zero, the gated norm at one)."""
    return tiny_model(model_type, seed=seed, norm_noise=0.2)


def _ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, seed=None, **kwargs):
    """generate() from a fresh routing state: (output, its one recording, stats)."""
    out, (recording,), stats = _fresh_generate(model, ids, seed, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
                                               output_scores=True, return_dict_in_generate=True, **kwargs)
    return out, recording, stats


def _both(model, ids, policy, offload=None, seed=None, **kwargs):
    """The same generate() on the transformers path and through the engine, in one patch."""
    with psr_hf.patched(model, RoutingConfig(**POLICIES[policy]), offload=offload):
        hf = _generate(model, ids, seed, **kwargs)
        engine.attach(model, max_len=64)
        try:
            ours = _generate(model, ids, seed, **kwargs)
            state = engine.attached(model)
            served, fallbacks, loops = state.served, state.fallbacks, state.loop_calls
        finally:
            engine.detach(model)
    return hf, ours, (served, fallbacks, loops)


def _same(hf, ours) -> None:
    assert torch.equal(ours[0].sequences, hf[0].sequences)
    for a, b in zip(ours[0].scores, hf[0].scores):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a))
        assert float((a[finite] - b[finite]).abs().max()) < 1e-4
    np.testing.assert_array_equal(ours[1].selected, hf[1].selected)
    for name in ("tokens", "prefetch_per_token", "demand_per_token", "copies_per_token", "replaced_per_token"):
        assert ours[2].total[name] == hf[2].total[name], name


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next"],
                         ids=["causal_lm", "image_text", "qwen3_next"])
@pytest.mark.parametrize("policy", ["exact", "psr"])
def test_generate_through_the_engine_equals_the_transformers_path(model_type, policy):
    model = _model(model_type)
    hf, ours, (served, fallbacks, loops) = _both(model, _ids(1, 9), policy, do_sample=False)
    assert (served, fallbacks, loops) == (NEW, 0, 1)  # the prompt and every step, in the engine's own loop
    _same(hf, ours)
    if policy == "psr":
        assert ours[2].total["replaced_per_token"] > 0  # the policy steered somewhere


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_next"])
def test_sampling_and_offload_equal_the_transformers_path(model_type):
    model = _model(model_type, seed=3)
    offload = psr_hf.OffloadConfig(device="cpu", check_slots=True)
    hf, ours, (served, fallbacks, _) = _both(model, _ids(2, 7), "psr", offload=offload, seed=5, do_sample=True,
                                             top_k=20)
    assert served == NEW and fallbacks == 0
    _same(hf, ours)
    assert ours[2].total["copies_per_token"] > 0  # offloaded: the slots were refilled


def test_every_sequence_starts_from_a_cleared_recurrent_state():
    """Two generate() calls in a row through the engine: the second equals a fresh transformers run (the Gated
    DeltaNet's convolution window and recurrent state of the first sequence are gone)."""
    model = _model("qwen3_5_moe_text", seed=4)
    first, second = _ids(3, 8), _ids(4, 5)
    with psr_hf.patched(model, RoutingConfig(**POLICIES["exact"])):
        want = _generate(model, second)
        engine.attach(model, max_len=64)
        try:
            _generate(model, first)
            layers = engine.attached(model).decoder.layers
            assert any(float(t.abs().sum()) > 0 for t in layers.kv.recurrent if t is not None)
            got = _generate(model, second)
        finally:
            engine.detach(model)
    _same(want, got)


@pytest.mark.parametrize("model_type, layers_class", [("qwen3_5_moe_text", "Qwen35MoeLayers"),
                                                       ("qwen3_next", "Qwen3NextLayers")])
def test_the_layers_step_equals_the_models_forward_position_by_position(model_type, layers_class):
    model = _model(model_type, seed=6)
    ids = _ids(5, 12)[0].tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    layers = build_layers(model, max_len=len(ids) + 1)
    assert type(layers).__name__ == layers_class
    kinds = model.config.layer_types
    assert [layers.kv.conv[i] is not None for i in range(len(kinds))] == [k == "linear_attention" for k in kinds]
    got = torch.stack([layers.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5
    again = torch.stack([layers.decode_step_reference(t, p)[0].clone() for p, t in enumerate(ids)])
    assert torch.equal(again, got)  # position 0 cleared the recurrent state


def test_a_layer_pattern_without_full_attention_is_refused():
    model = tiny_model("qwen3_5_moe_text", layer_types=["linear_attention"] * 4)
    with pytest.raises(ValueError, match="expect both linear-attention and full-attention layers"):
        build_layers(model, max_len=8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("policy", ["exact", "psr"])
def test_cuda_graphs_equal_the_transformers_path_float32(policy, offloaded):
    """On the GPU (CUDA graphs, compiled attention blocks, the Triton slot MoE) in float32: the transformers path's
    greedy tokens, its scores within 1e-4, its routing decisions."""
    model = _model("qwen3_5_moe_text", seed=7).to("cuda")
    offload = psr_hf.OffloadConfig(device="cuda") if offloaded else None
    hf, ours, (served, fallbacks, loops) = _both(model, _ids(6, 9).to("cuda"), policy, offload=offload,
                                                 do_sample=False)
    assert (served, fallbacks, loops) == (NEW, 0, 1)
    _same(hf, ours)
