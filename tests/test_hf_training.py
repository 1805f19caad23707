"""Training a patched model: gradients flow through the routed layers, gradient checkpointing recomputes them with
the forward pass's routing decisions, and under exact routing the gradients are the unpatched model's, bitwise.
Also what a transformers user does besides: right-padded generate() under exact routing, DeepSeek-V3 group limits
that keep fewer experts than top-K, and models built on the meta device."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import psr_hf
from psr_hf.testing import tiny_model

FAMILIES = ("olmoe", "deepseek_v3", "qwen3_5_moe", "qwen3_next")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


def _gradients(model: torch.nn.Module, checkpointing: bool | str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one training step; ``checkpointing`` True (transformers' default, non-reentrant),
    "reentrant" or False."""
    ids, mask = _batch()
    train_with_checkpointing(model, checkpointing)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def train_with_checkpointing(model: torch.nn.Module, checkpointing: bool | str) -> None:
    """Training mode, gradients zeroed, and ``checkpointing`` True (transformers' default, non-reentrant), "reentrant"
    or False."""
    model.train()
    model.zero_grad(set_to_none=True)
    # transformers 5.24 names it activation checkpointing; older releases gradient checkpointing
    options = {"use_reentrant": checkpointing == "reentrant"}
    if not checkpointing:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    elif hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def base_models():
    torch.manual_seed(0)
    return {family: tiny_model(family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_routing_trains_as_the_unpatched_model_with_and_without_checkpointing(family, base_models,
                                                                                     quiet_psr_hf):
    reference = _gradients(copy.deepcopy(base_models[family]), checkpointing=False)
    model = copy.deepcopy(base_models[family])
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="exact", residency=0.5))
    for checkpointing in (False, True, "reentrant"):
        loss, grads = _gradients(model, checkpointing)
        assert torch.equal(loss, reference[0]) and _same(grads, reference[1]), checkpointing


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_recomputes_psrs_routing_and_the_routers_get_gradients(family, base_models, quiet_psr_hf):
    model = copy.deepcopy(base_models[family])
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", lam=0.3, residency=0.5))
    plain = _gradients(model, checkpointing=False)
    for checkpointing in (True, "reentrant"):
        checkpointed = _gradients(model, checkpointing=checkpointing)
        assert torch.equal(plain[0], checkpointed[0]) and _same(plain[1], checkpointed[1]), checkpointing
    routers = [layer.router.weight for layer in psr_hf.controller(model).layers]
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(w)] in plain[1] and plain[1][names[id(w)]].abs().sum() > 0 for w in routers)
    assert psr_hf.controller(model).stats().total["replaced_per_token"] > 0  # psr changed the routing here


def test_a_layer_called_outside_a_forward_pass_is_still_an_error_outside_backward(base_models, quiet_psr_hf):
    model = copy.deepcopy(base_models["olmoe"])
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="psr", residency=0.5))
    _gradients(model, checkpointing=True)  # leaves the last training forward's decisions
    layer = psr_hf.controller(model).layers[0]
    with pytest.raises(RuntimeError, match="ran outside a forward pass"):
        layer.router(torch.zeros(3, model.config.hidden_size))


def test_right_padded_generate_under_exact_routing_is_the_unpatched_models(base_models, caplog):
    model = copy.deepcopy(base_models["olmoe"]).eval()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(2))
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    kwargs = dict(input_ids=ids, attention_mask=right, max_new_tokens=5, do_sample=False)
    unpatched = model.generate(**kwargs)
    caplog.set_level(logging.ERROR, logger="psr_hf")
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=0.5)):
        assert torch.equal(model.generate(**kwargs), unpatched)
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", residency=0.5)):
        with pytest.raises(ValueError, match="right-padded batch"):
            model.generate(**kwargs)


@pytest.mark.parametrize("policy", ["exact", "psr"])
def test_a_group_limit_that_keeps_fewer_experts_than_top_k_routes_as_transformers(policy, quiet_psr_hf):
    """8 experts in 2 groups, 1 group kept, top-8 (transformers' own tester config): transformers' top-k picks the
    masked experts too; under exact routing (and psr with every expert resident) the outputs are its own."""
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3", n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=8).eval()
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    logits = model(input_ids=ids).logits
    tokens = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy=policy, residency=1.0)):
        assert torch.equal(model(input_ids=ids).logits, logits)
        assert torch.equal(model.generate(input_ids=ids, max_new_tokens=4, do_sample=False), tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_built_on_the_meta_device_patches_and_runs_once_its_weights_load(family, base_models, quiet_psr_hf):
    real = base_models[family].eval()
    with torch.device("meta"):
        model = type(real)(real.config)
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="exact", residency=0.5))
    model.to_empty(device="cpu")
    model.load_state_dict(real.state_dict())
    for name, buffer in real.named_buffers():  # non-persistent buffers (rotary frequencies) are not in a state dict
        model.get_buffer(name).copy_(buffer)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(4))
    assert torch.equal(model.eval()(input_ids=ids).logits, real(input_ids=ids).logits)


def test_offloading_a_model_on_the_meta_device_says_to_load_the_weights_first(base_models):
    with torch.device("meta"):
        model = type(base_models["olmoe"])(base_models["olmoe"].config)
    with pytest.raises(ValueError, match="meta device.*load the weights first"):
        psr_hf.patch(model, psr_hf.RoutingConfig(policy="exact", residency=0.5), offload="cpu")


def test_in_eval_mode_the_outputs_do_not_depend_on_whether_grad_is_enabled(base_models, quiet_psr_hf):
    model = copy.deepcopy(base_models["deepseek_v3"]).eval()
    ids, mask = _batch()
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", lam=0.3, residency=0.5)):
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits.detach(), expected)


def test_a_model_that_is_its_own_assistant_decodes_as_unpatched_under_exact_routing(base_models, quiet_psr_hf):
    """Assisted decoding with the model as its own assistant interleaves two KV caches on one model: under exact
    routing each switch starts fresh routing state (no output depends on it); a cache-aware policy refuses assisted
    decoding before it runs."""
    model = copy.deepcopy(base_models["olmoe"]).eval()
    ids = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(6))
    kwargs = dict(input_ids=ids, max_new_tokens=6, do_sample=False, assistant_model=model)
    unpatched = model.generate(**kwargs)
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="exact", residency=0.5)):
        assert torch.equal(model.generate(**kwargs), unpatched)
    with psr_hf.patched(model, psr_hf.RoutingConfig(policy="psr", residency=0.5)):
        with pytest.raises(ValueError, match="assisted decoding"):
            model.generate(**kwargs)
