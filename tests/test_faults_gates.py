"""Faults and hostile input around trained gates (issue 47) on the shipped olmoe-routing (CPU): a refused
``reconfigure()`` changes nothing, offloaded or not; ``patch(..., gate=head)`` leaves the caller's head where it
was; a distilled folder with a broadcastable, non-finite, missing or misshapen router is refused with a
``ValueError`` naming the file and the tensor by every entry point, before the model changes."""

from __future__ import annotations

import copy

import pytest
import torch

import psr_hf
from psr_hf.assets import load_shipped
from psr_hf.gates import MarginHead
from psr_hf.training.gate import apply_distilled, distill_routing, load_distilled

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

CONFIG = psr_hf.RoutingConfig(policy="cache_prior", lam=0.3, eviction="lru", residency=0.375)
# a gate needs a fixed bonus scale: every one of these is refused while the model has a gate
REFUSED = [psr_hf.RoutingConfig(policy="exact", residency=0.5),
           psr_hf.RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.25, delta_mode="running")]


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer, calibration = load_shipped("olmoe-routing")
    prompt = tokenizer(["The committee met on Tuesday to discuss the budget, and"], return_tensors="pt")
    return model, calibration, prompt


def _learned(model, calibration) -> MarginHead:
    head = MarginHead.uniform(CONFIG.lam * calibration.delta, model.config.hidden_size)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)))
    return head


def _generate(model, prompt):
    with torch.no_grad():
        return model.generate(**prompt, max_new_tokens=10, do_sample=False, pad_token_id=1)


# ---------------------------------------------------------------------------------------------- reconfigure()
@pytest.mark.parametrize("offload", [None, "cpu"], ids=["on-the-model", "offloaded"])
@pytest.mark.parametrize("refused", REFUSED, ids=["exact", "running-scale"])
def test_a_reconfigure_the_gate_refuses_changes_nothing(shipped, offload, refused):
    model, calibration, prompt = shipped
    offload = None if offload is None else psr_hf.OffloadConfig(device=offload, check_slots=True)
    with psr_hf.patched(model, CONFIG, calibration=calibration, gate=_learned(model, calibration), offload=offload):
        ctl = psr_hf.controller(model)
        before = _generate(model, prompt)
        state = (ctl.config, ctl.cache, ctl.capacity, ctl.calibration, ctl.gate, ctl.routing.source)
        with pytest.raises(ValueError, match="gate=: a margin head sets the bonus"):
            ctl.reconfigure(refused)
        assert (ctl.config, ctl.cache, ctl.capacity, ctl.calibration, ctl.gate, ctl.routing.source) == state
        assert ctl.routing.cache is ctl.cache
        assert torch.equal(_generate(model, prompt), before)
        if offload is not None:
            assert ctl.offload.capacity == ctl.capacity


# ---------------------------------------------------------------------------------------------- the caller's head
def test_patching_a_model_on_the_meta_device_leaves_the_callers_head_and_runs_once_loaded(shipped):
    real, calibration, prompt = shipped
    head = _learned(real, calibration)
    original = copy.deepcopy(head)
    with torch.device("meta"):
        model = type(real)(real.config)
    psr_hf.patch(model, CONFIG, calibration=calibration, gate=head)
    try:
        for name, tensor in head.state_dict().items():
            assert tensor.device.type == "cpu" and torch.equal(tensor, original.state_dict()[name]), name
        model.to_empty(device="cpu")
        model.load_state_dict(real.state_dict())
        for name, buffer in real.named_buffers():  # non-persistent buffers (rotary frequencies)
            model.get_buffer(name).copy_(buffer)
        generated = _generate(model.eval(), prompt)
    finally:
        psr_hf.unpatch(model)
    with psr_hf.patched(real, CONFIG, calibration=calibration, gate=original):
        assert torch.equal(generated, _generate(real, prompt))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_head_on_another_device_stays_there_and_the_model_routes_with_a_copy(shipped):
    real, calibration, prompt = shipped
    head = _learned(real, calibration)
    original = copy.deepcopy(head)
    model = copy.deepcopy(real).cuda()
    with psr_hf.patched(model, CONFIG, calibration=calibration, gate=head):
        routed = psr_hf.controller(model).gate
        assert routed is not head and routed.weight.device.type == "cuda"
        generated = _generate(model, {k: v.cuda() for k, v in prompt.items()})
    for name, tensor in head.state_dict().items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, original.state_dict()[name]), name
    with psr_hf.patched(real, CONFIG, calibration=calibration, gate=original):
        assert torch.equal(generated.cpu(), _generate(real, prompt))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_distillation_on_the_gpu_trains_the_callers_head_and_leaves_it_on_its_device(shipped, tmp_path):
    real, calibration, prompt = shipped
    model = copy.deepcopy(real).cuda()
    head = MarginHead.uniform(CONFIG.lam * calibration.delta, model.config.hidden_size)
    start = head.bias.detach().clone()
    windows = [prompt["input_ids"][0].cuda()]
    distill_routing(model, windows, CONFIG, tmp_path / "out", calibration=calibration, steps=3, attention_rank=0,
                    expert_rank=0, head_lr=1e-1, warmup=1, gate=head, load_penalty=0.1)
    saved = MarginHead.load(tmp_path / "out" / "gate.safetensors")
    assert head.bias.device.type == "cpu" and not torch.equal(head.bias.detach(), start)
    assert torch.equal(head.bias.detach(), saved.bias) and head.metadata == saved.metadata


# ---------------------------------------------------------------------------------------------- distilled folders
@pytest.fixture(scope="module")
def folder(tmp_path_factory, shipped):
    """A distilled folder (routers only, one step) from a copy of the shipped model."""
    model, calibration, prompt = shipped
    out = tmp_path_factory.mktemp("distilled") / "routing"
    distill_routing(copy.deepcopy(model), [prompt["input_ids"][0]], CONFIG, out, calibration=calibration, steps=1,
                    attention_rank=0, expert_rank=0, warmup=1)
    return out


def _corrupt(folder, tmp_path, how: str):
    """A copy of ``folder`` whose ``routing.safetensors`` has one router tensor altered (``how``); its header kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(folder / "routing.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    weight = tensors["router.3"]
    if how == "row":
        tensors["router.3"] = weight[0].contiguous()  # [H]: broadcast, every expert would get the same row
    elif how == "nan":
        weight[2, 5] = float("nan")
    elif how == "missing":
        del tensors["router.3"]
    elif how == "shape":
        tensors["router.3"] = weight[:, :-1].contiguous()
    out = tmp_path / how
    out.mkdir()
    save_file(tensors, str(out / "routing.safetensors"), metadata=meta)
    return out


CORRUPTIONS = {"row": r"shape \(128,\), expected \(64, 128\)", "nan": "not finite",
               "missing": "is missing", "shape": r"shape \(64, 127\), expected \(64, 128\)"}


@pytest.mark.parametrize("entry", ["apply_distilled", "load_distilled"])
@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_distilled_folder_with_a_bad_router_is_refused_before_the_model_changes(shipped, folder, tmp_path, how,
                                                                                  entry):
    model = copy.deepcopy(shipped[0])
    routers = [layer.mlp.gate.weight.detach().clone() for layer in model.model.layers]
    bad = _corrupt(folder, tmp_path, how)
    load = apply_distilled if entry == "apply_distilled" else load_distilled
    with pytest.raises(ValueError, match=rf"routing.safetensors.*router\.3.*{CORRUPTIONS[how]}") as error:
        load(model, bad)
    assert str(bad) in str(error.value)
    for layer, before in zip(model.model.layers, routers):  # not one router was copied
        assert torch.equal(layer.mlp.gate.weight, before)


@pytest.mark.parametrize("how", ["row", "nan", "missing", "shape"])
def test_lm_evals_distilled_arg_refuses_a_bad_router_naming_the_file_and_tensor(folder, tmp_path, how):
    from psr_hf.eval.lm_model import PSRLM

    bad = _corrupt(folder, tmp_path, how)
    with pytest.raises(ValueError, match=rf"routing.safetensors.*router\.3.*{CORRUPTIONS[how]}"):
        PSRLM(pretrained="olmoe-routing", device="cpu", dtype="float32", batch_size=1, policy="psr", lam=0.3,
              budget=1, residency=0.375, distilled=str(bad))
