"""One owner of install and uninstall: the Installer installs everything, wraps what it replaces so that it still
looks like the original, and removes all of it in reverse order, also when an install step fails halfway. A patched
model refuses to be copied or pickled, naming what to do. Its counters travel as named dataclasses into the public
statistics."""

from __future__ import annotations

import inspect

import pytest
import torch

import psr_hf
from psr_hf import OffloadConfig, RoutingConfig
from psr_hf.hf.installation import Installation
from psr_hf.hf.installer import Installer
from psr_hf.hf.statistics import RoutingCounters
from psr_hf.offload.scheduler import CopyCounters
from psr_hf.patches import get_patch
from psr_hf.testing import FAMILIES, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

CONFIG = RoutingConfig(policy="psr", residency=0.5)
IDS = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(0))  # [2, 6]
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _snapshot(model: torch.nn.Module) -> dict:
    """Every module's instance attribute names and hooks, the weights and where they are, the experts
    implementation: everything that patch() may touch."""
    modules = {name: (frozenset(vars(module)), tuple(tuple(getattr(module, d)) for d in _HOOK_DICTS))
               for name, module in model.named_modules()}
    weights = {name: (t.device, t.detach().clone()) for name, t in model.state_dict().items()}
    return {"modules": modules, "weights": weights,
            "experts": getattr(model.config.get_text_config(), "_experts_implementation", None)}


def _assert_as_before(model: torch.nn.Module, before: dict, logits: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="not patched by psr_hf"):
        psr_hf.controller(model)
    after = _snapshot(model)
    assert after["modules"] == before["modules"]
    assert after["experts"] == before["experts"]
    assert after["weights"].keys() == before["weights"].keys()
    for name, (device, value) in before["weights"].items():
        assert after["weights"][name][0] == device and torch.equal(after["weights"][name][1], value), name
    decoder = model.get_decoder()
    for module in (model, decoder):
        assert not any(getattr(module, d) for d in _HOOK_DICTS)
    assert not {"generate", "_reorder_cache", "_psr_hf_controller", "forward"} & set(vars(model))
    assert "forward" not in vars(decoder)
    assert torch.equal(_logits(model), logits)


def _moe_layers(model: torch.nn.Module) -> list:
    return get_patch(model.config.model_type)(model).moe_layers()


# ---------------------------------------------------------------------------------------------- wrapped originals
@pytest.mark.parametrize("family", FAMILIES)
def test_replaced_forwards_look_like_the_originals(family):
    model = tiny_model(family)
    routers = [layer.router for layer in _moe_layers(model)]
    entries = [model, model.get_decoder()]  # the model's and its decoder's forward are wrapped too
    forwards = [module.forward for module in routers + entries]  # bound originals
    generate = model.generate
    with psr_hf.patched(model, CONFIG):
        for router, original in zip(routers + entries, forwards):
            replaced = router.forward
            assert "forward" in vars(router) and replaced.__wrapped__ == original
            assert replaced.__name__ == original.__name__ == "forward"
            assert replaced.__doc__ == original.__doc__
            assert inspect.signature(replaced) == inspect.signature(original)
        assert model.generate.__wrapped__ == generate
        assert model.generate.__name__ == "generate" and model.generate.__doc__ == generate.__doc__
        assert inspect.signature(model.generate) == inspect.signature(generate)
        # transformers 5 models have no _reorder_cache of their own: the installed one reorders the Cache itself
        assert model._reorder_cache.__name__ == "_reorder_cache"
        assert list(inspect.signature(model._reorder_cache).parameters) == ["past_key_values", "beam_idx"]


def test_a_models_own_reorder_cache_is_wrapped_and_restored():
    model = tiny_model("olmoe")
    calls = []

    def _reorder_cache(past_key_values, beam_idx):
        """The model's own reordering."""
        calls.append(beam_idx)
        past_key_values.reorder_cache(beam_idx)
        return past_key_values

    object.__setattr__(model, "_reorder_cache", _reorder_cache)
    with psr_hf.patched(model, CONFIG):
        assert model._reorder_cache.__wrapped__ is _reorder_cache
        assert model._reorder_cache.__doc__ == "The model's own reordering."
        with torch.no_grad():  # beam search goes through it
            model.generate(IDS[:1], max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
        assert calls  # the wrapper called the model's own
    assert vars(model)["_reorder_cache"] is _reorder_cache  # the instance's own attribute is back


# ---------------------------------------------------------------------------------------------- uninstall
@pytest.mark.parametrize("offload", [None, "cpu"], ids=["resident", "offloaded"])
def test_unpatch_leaves_the_model_as_before(offload):
    model = tiny_model("olmoe")
    before, logits = _snapshot(model), _logits(model)
    psr_hf.patch(model, CONFIG, offload=offload)
    ctl = psr_hf.controller(model)
    assert Installer(ctl).installed and (ctl.offload is not None) == (offload is not None)
    with torch.no_grad():
        model.generate(IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)
    psr_hf.unpatch(model)
    assert not Installer(ctl).installed and ctl.offload is None
    for layer in ctl.layers:
        assert "forward" not in vars(layer.router)
    _assert_as_before(model, before, logits)
    Installer(ctl).uninstall()  # a second uninstall has nothing left to do


# ---------------------------------------------------------------------------------------------- copies
@pytest.mark.parametrize("offload", [None, OffloadConfig(device="cpu")], ids=["resident", "offloaded"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copying_a_patched_model_fails_naming_psr_hf_and_what_to_do(tmp_path, offload, how):
    import copy
    import pickle

    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5), offload=offload)
    copies = {"deepcopy": lambda: copy.deepcopy(model), "pickle": lambda: pickle.dumps(model),
              "torch.save": lambda: torch.save(model, tmp_path / "m.pt")}
    with pytest.raises(TypeError, match=r"psr_hf: a patched model cannot be deep-copied or pickled.*unpatch"):
        copies[how]()
    torch.save(model.state_dict(), tmp_path / "state.pt")  # what the message offers works
    psr_hf.unpatch(model)
    copies[how]()  # and the unpatched model copies as before


# ---------------------------------------------------------------------------------------------- a failed install
def _fail_after(method):
    """``method`` runs, then raises: the install step failed after it had installed its part."""
    def step(self, *args, **kwargs):
        method(self, *args, **kwargs)
        raise RuntimeError(f"injected failure after {method.__name__}")
    return step


def _refuse(self, *args, **kwargs):
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("step, fail, offload", [
    ("_install_routers", _fail_after, None),  # routers replaced, nothing else yet
    ("_install_forwards", _refuse, None),  # routers replaced
    ("_install_forwards", _fail_after, None),  # routers replaced, the model's and the decoder's forward wrapped
    ("_install_generate", _fail_after, None),  # all but the controller attribute
    ("_install_offload", _refuse, "cpu"),
    ("_install_offload", _fail_after, "cpu"),  # the experts already in the host store and slots
], ids=["routers", "forwards-before", "forwards-after", "generate-after", "offload-before", "offload-after"])
def test_a_failure_in_the_middle_of_install_leaves_the_model_as_before(step, fail, offload, monkeypatch):
    model = tiny_model("olmoe")
    before, logits = _snapshot(model), _logits(model)
    method = getattr(Installer, step)
    monkeypatch.setattr(Installer, step, fail(method) if fail is _fail_after else fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        psr_hf.patch(model, CONFIG, offload=offload)
    monkeypatch.undo()
    _assert_as_before(model, before, logits)
    psr_hf.patch(model, CONFIG, offload=offload)  # and it can be patched afterwards
    psr_hf.unpatch(model)
    _assert_as_before(model, before, logits)


def test_a_failure_at_the_last_install_step_removes_the_offload_too(monkeypatch):
    """The controller's attribute on the model is set last; failing there undoes every step, the offload included."""
    model = tiny_model("olmoe")
    before, logits = _snapshot(model), _logits(model)
    set_attr = Installation.set_attr

    def refuse_the_marker(self, obj, name, value):
        if name == "_psr_hf_controller":
            raise RuntimeError("injected failure")
        set_attr(self, obj, name, value)

    monkeypatch.setattr(Installation, "set_attr", refuse_the_marker)
    with pytest.raises(RuntimeError, match="injected failure"):
        psr_hf.patch(model, CONFIG, offload=OffloadConfig(device="cpu"))
    monkeypatch.undo()
    _assert_as_before(model, before, logits)


def test_an_undo_step_that_fails_does_not_stop_the_others():
    ran = []
    installation = Installation()
    installation.add(lambda: ran.append("first"))
    installation.add(lambda: (ran.append("second"), 1 / 0))
    installation.add(lambda: ran.append("third"))
    with pytest.raises(ZeroDivisionError):
        installation.undo()
    assert ran == ["third", "second", "first"] and not installation


def test_installing_twice_raises():
    model = tiny_model("olmoe")
    with psr_hf.patched(model, CONFIG):
        with pytest.raises(RuntimeError, match="already installed"):
            Installer(psr_hf.controller(model)).install()


# ---------------------------------------------------------------------------------------------- counters
def test_routing_counters_add_and_subtract_by_name():
    a = RoutingCounters(tokens=4, steps=12, prefetch=2, demand=3, replaced=1, displaced=0.5, sequences=1)
    b = RoutingCounters(tokens=1, steps=3, prefetch=1, demand=0, replaced=0, displaced=0.25, sequences=1)
    assert a + b - b == a
    assert (a - a) == RoutingCounters()
    assert a.to_total() == {"sequences": 1, "tokens": 4, "prefetch_per_token": 0.5, "demand_per_token": 0.75,
                            "copies_per_token": 1.25, "replaced_per_token": 0.25, "displaced_mass": 0.5 / 12}


def test_statistics_keep_their_keys_and_count_across_sequences_and_resets():
    model = tiny_model("olmoe")
    psr_hf.patch(model, CONFIG, offload="cpu")
    try:
        ctl = psr_hf.controller(model)
        with torch.no_grad():
            model(input_ids=IDS)
            first = ctl.stats()
            model(input_ids=IDS[:1])  # a new sequence: the first one's counts move into the totals
            both = ctl.stats()
            ctl.reset_stats()
            zero = ctl.stats()
            model(input_ids=IDS[:1, :3])
            last = ctl.stats()
    finally:
        psr_hf.unpatch(model)
    assert set(first.total) == {"sequences", "tokens", "prefetch_per_token", "demand_per_token", "copies_per_token",
                                "replaced_per_token", "displaced_mass"}
    assert set(first.to_dict()) == {"rows", "total", "offload"}
    assert set(first.offload.to_dict()) == {
        "tokens", "demand", "prefetch", "prefetch_in_time", "prefetch_late", "prefetch_unused", "dropped", "warm",
        "bytes", "wait_ms", "demand_per_token", "prefetch_per_token", "prefetch_in_time_per_token",
        "prefetch_late_per_token", "prefetch_unused_per_token", "dropped_per_token", "bytes_per_token",
        "wait_ms_per_token", "copies_per_token", "warm_copies"}
    assert (first.total["sequences"], first.total["tokens"]) == (2, 12)
    assert (both.total["sequences"], both.total["tokens"]) == (3, 18)
    assert both.total["demand_per_token"] == pytest.approx(
        (first.total["demand_per_token"] * 12 + both.demand_per_token[0] * 6) / 18)
    assert zero.total["tokens"] == 0 and zero.offload.demand == 0
    assert (last.total["sequences"], last.total["tokens"]) == (1, 3) and last.offload.tokens == 3
    assert isinstance(first.offload.bytes, int) and first.offload.bytes > 0


def test_copy_counters_are_named_fields():
    counters = CopyCounters()
    counters.demand += 2
    assert counters == CopyCounters(demand=2) and counters.wait_s == 0.0
