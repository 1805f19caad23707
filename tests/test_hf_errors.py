"""patch()/unpatch()/controller() fail loudly, with a message naming the problem, and always leave the model clean."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, OlmoeForCausalLM

import psr_hf
from psr_hf.hf.inputs import cache_keyword, output_cache
from psr_hf import RoutingConfig
from psr_hf.hf.installation import Installation
from psr_hf.testing import FAMILIES, tiny_config, tiny_model
from psr_hf.policy.calibration import Calibration, CalibrationBuilder

CONFIG = RoutingConfig(policy="psr", residency=0.5)
IDS = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(0))  # [1, 8]
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


class RemoteCodeOlmoe(OlmoeForCausalLM):
    """Stands in for a class loaded with ``trust_remote_code=True``: its module is not transformers'."""


pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")


@pytest.fixture(scope="module")
def olmoe():
    return tiny_model("olmoe")


@pytest.fixture
def model(olmoe):
    yield olmoe
    try:
        psr_hf.unpatch(olmoe)
    except ValueError:
        pass


def _snapshot(model: torch.nn.Module) -> dict:
    """Every module's instance attributes (names) and hooks: what patch() may touch."""
    return {
        name: (frozenset(vars(module)), tuple(tuple(getattr(module, d)) for d in _HOOK_DICTS))
        for name, module in model.named_modules()
    }


def _assert_clean(model: torch.nn.Module, before: dict) -> None:
    with pytest.raises(ValueError, match="not patched by psr_hf"):
        psr_hf.controller(model)
    assert _snapshot(model) == before


# ---------------------------------------------------------------------------------------------- patch / unpatch
def test_patching_twice_raises(model):
    psr_hf.patch(model, CONFIG)
    with pytest.raises(ValueError, match="already patched by psr_hf.*psr_hf.unpatch"):
        psr_hf.patch(model, RoutingConfig(policy="exact", residency=0.5))
    assert psr_hf.controller(model).config == CONFIG  # the first patch is still in place


def test_unpatching_an_unpatched_model_raises(model):
    with pytest.raises(ValueError, match="not patched by psr_hf.*nothing to unpatch"):
        psr_hf.unpatch(model)


def test_controller_of_an_unpatched_model_raises(model):
    with pytest.raises(ValueError, match=r"not patched by psr_hf; call psr_hf.patch\(model, config\)"):
        psr_hf.controller(model)


def _tiny_mixtral():
    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2)
    return AutoModelForCausalLM.from_config(config)


def _tiny_llama():
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("build, model_type", [(_tiny_mixtral, "mixtral"), (_tiny_llama, "llama")],
                         ids=["mixtral", "llama"])
def test_an_unsupported_architecture_raises(build, model_type):
    model = build()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=f"model_type '{model_type}'.*is not supported by psr_hf; supported: "
                                         ".*deepseek_v3.*olmoe.*qwen3_next"):
        psr_hf.patch(model, CONFIG)
    _assert_clean(model, before)


def test_a_model_class_from_outside_transformers_raises():
    model = RemoteCodeOlmoe(tiny_config("olmoe"))
    before = _snapshot(model)
    with pytest.raises(ValueError, match="RemoteCodeOlmoe comes from .*not from transformers.*trust_remote_code"):
        psr_hf.patch(model, CONFIG)
    _assert_clean(model, before)


def test_a_module_without_a_config_raises():
    with pytest.raises(ValueError, match="needs a transformers model .*got Linear"):
        psr_hf.patch(torch.nn.Linear(2, 2), CONFIG)


def _calibration(num_layers: int, num_experts: int, vocab_size: int) -> Calibration:
    builder = CalibrationBuilder(num_layers, num_experts, vocab_size=vocab_size, top_k=4)
    builder.add(np.array([3, 4]), np.tile(np.arange(4), (2, num_layers, 1)), np.ones((2, num_layers)))
    return builder.build()


@pytest.mark.parametrize("calibration, fragments", [
    (Calibration.empty(4, 16), "made for 4 MoE layers x 16 experts, but the model has 3 x 16"),
    (Calibration.empty(3, 32), "made for 3 MoE layers x 32 experts, but the model has 3 x 16"),
    (_calibration(3, 16, vocab_size=100), "token prior over 100 token ids, but the model's vocabulary has 256"),
], ids=["layers", "experts", "vocabulary"])
def test_a_calibration_of_another_model_raises(model, calibration, fragments):
    before = _snapshot(model)
    with pytest.raises(ValueError, match=fragments):
        psr_hf.patch(model, CONFIG, calibration=calibration)
    _assert_clean(model, before)


@pytest.mark.parametrize("config, fragments", [
    (42, "config must be a psr_hf.RoutingConfig .*got int"),
    ("psr", "config must be a psr_hf.RoutingConfig .*got str"),
    ({"policy": "psr", "residency": 0.5, "lamda": 0.2}, r"unknown RoutingConfig field\(s\) \['lamda'\]"),
    (RoutingConfig(policy="psr", capacity=2), r"capacity=2 is below the model's top-k \(4\)"),
], ids=["int", "str", "unknown-field", "capacity-below-top-k"])
def test_an_invalid_config_raises(model, config, fragments):
    before = _snapshot(model)
    with pytest.raises(ValueError, match=fragments):
        psr_hf.patch(model, config)
    _assert_clean(model, before)


def test_a_config_dict_is_accepted(model):
    psr_hf.patch(model, {"policy": "cache_prior", "residency": 0.5})
    assert psr_hf.controller(model).config == RoutingConfig(policy="cache_prior", residency=0.5)


def test_a_bad_offload_argument_leaves_the_model_untouched(model):
    before = _snapshot(model)
    with pytest.raises(ValueError, match="offload must be a psr_hf.OffloadConfig"):
        psr_hf.patch(model, CONFIG, offload=object())
    _assert_clean(model, before)


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=17), r"budget=17 exceeds the model's 16 experts per MoE layer"),
    (dict(top_j=17), r"top_j=17 exceeds"),
], ids=["budget", "top_j"])
def test_sizes_beyond_the_models_experts_are_refused_at_patch(kwargs, message):
    model = tiny_model("olmoe")
    with pytest.raises(ValueError, match=message):
        psr_hf.patch(model, RoutingConfig(policy="psr", residency=0.5, **kwargs))
    assert not hasattr(model, "_psr_hf_controller")


# ---------------------------------------------------------------------------------------------- calls
def test_an_attention_mask_it_cannot_read_raises(model):
    """2D and 4D masks (and dicts of them) are read (tests/test_hf_masks.py); a 3D one names what is accepted."""
    psr_hf.patch(model, CONFIG)
    mask = torch.ones(1, 8, 8)
    message = (r"needs an attention_mask that marks padding: 2D \[batch, past \+ length\] = \[1, >= 8\], 4D .*"
               r"got \(1, 8, 8\)")
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(input_ids=IDS, attention_mask=mask)


def test_a_batch_size_change_while_continuing_a_sequence_raises(model):
    psr_hf.patch(model, CONFIG)
    with torch.no_grad():
        past = output_cache(model(input_ids=IDS, use_cache=True))
        with pytest.raises(RuntimeError, match="a batch of 2 rows continues a cached sequence of 1 rows"):
            model(input_ids=torch.tensor([[5], [6]]), **{cache_keyword(model): past})


def test_inputs_embeds_without_ids_raise_when_the_token_prior_is_needed(model):
    psr_hf.patch(model, CONFIG, calibration=_calibration(3, 16, vocab_size=256))
    with torch.no_grad(), pytest.raises(ValueError, match="token prior needs the input token ids.*inputs_embeds"):
        model(inputs_embeds=model.get_input_embeddings()(IDS))


def test_a_moe_block_called_outside_the_model_raises(model):
    psr_hf.patch(model, CONFIG)
    layer = psr_hf.controller(model).layers[0]
    with torch.no_grad(), pytest.raises(RuntimeError, match="MoE layer 0 ran outside a forward pass"):
        layer.block(torch.randn(1, 2, 64))


def test_an_error_inside_a_forward_leaves_the_controller_usable(model):
    psr_hf.patch(model, CONFIG)
    ctl = psr_hf.controller(model)
    with torch.no_grad(), ctl.record() as recorder:
        model(input_ids=IDS)
        expected = ctl.cache.state.copy()
        with pytest.raises(IndexError):
            model(input_ids=torch.full((1, 8), 999))  # fails in the embedding, after the pre-hook
        with pytest.raises(ValueError, match="attention_mask that marks padding"):
            model(input_ids=IDS, attention_mask=torch.ones(1, 8, 8))  # fails in the pre-hook
        model(input_ids=IDS)
    np.testing.assert_array_equal(ctl.cache.state, expected)
    assert [r.num_tokens for r in recorder.recordings] == [8, 8]
    np.testing.assert_array_equal(recorder.recordings[0].selected, recorder.recordings[1].selected)


# ---------------------------------------------------------------------------------------------- removal
@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_removes_every_attribute_and_hook(family):
    model = tiny_model(family)
    before = _snapshot(model)
    psr_hf.patch(model, CONFIG)
    ctl = psr_hf.controller(model)
    assert _snapshot(model) != before
    assert all("forward" in vars(layer.router) for layer in ctl.layers)
    assert {"generate", "_reorder_cache"} <= set(vars(model))
    assert "forward" in vars(model) and "forward" in vars(ctl.family.decoder())  # the wrapped entry points
    with torch.no_grad():
        model.generate(IDS, max_new_tokens=2, do_sample=False, pad_token_id=0)
    psr_hf.unpatch(model)
    _assert_clean(model, before)
    for layer in ctl.layers:
        assert "forward" not in vars(layer.router)
        assert layer.router.forward.__func__ is type(layer.router).forward
    assert model.generate.__func__ is type(model).generate
    assert model.forward.__func__ is type(model).forward
    assert "_reorder_cache" not in vars(model)
    assert all(not getattr(module, d) for module in model.modules() for d in _HOOK_DICTS)


def test_patched_unpatches_on_exception(model):
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match="inside the block"), psr_hf.patched(model, CONFIG) as patched:
        assert patched is model and psr_hf.controller(model).config == CONFIG
        raise RuntimeError("inside the block")
    _assert_clean(model, before)


def test_a_failed_install_leaves_the_model_clean(model, monkeypatch):
    """An error while the forwards are being wrapped (the model's done, the decoder's failing) undoes what was
    already installed."""
    before = _snapshot(model)
    decoder = model.get_decoder()
    set_attr = Installation.set_attr

    def refuse_the_decoder(self, obj, name, value):
        if obj is decoder and name == "forward":
            raise RuntimeError("no forward wrapper on this decoder")
        set_attr(self, obj, name, value)

    monkeypatch.setattr(Installation, "set_attr", refuse_the_decoder)
    with pytest.raises(RuntimeError, match="no forward wrapper on this decoder"):
        psr_hf.patch(model, CONFIG)
    monkeypatch.undo()
    _assert_clean(model, before)
