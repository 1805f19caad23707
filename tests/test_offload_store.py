"""The expert stores and the copy links through their protocols (``psr_hf.offload.store``, ``psr_hf.offload.links``).

A patched model's controller holds one :class:`PatchedExpertStore`, never None: :class:`ResidentExperts` (the
model's own weights, slot = expert id) unless the model is offloaded, :class:`OffloadedExperts` then; the
speculative engine's :class:`ExpertSlots` is an :class:`ExpertStore` too. Each is driven here only through its
protocol: a layer computed from what the store says (its experts module and the slots of the selected experts)
gives the same output whichever store holds the experts. That the whole model's outputs are the same resident and
offloaded is ``tests/test_offload.py``'s ``test_offloaded_outputs_equal_the_patched_model`` (the transformers
path) and ``tests/test_engine_decoder.py``'s ``test_offloaded_decoder_computes_what_the_resident_one_does`` (the
engine), which now run through the stores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import psr_hf
from psr_hf import OffloadConfig, RoutingConfig
from psr_hf.engine.speculative import ExpertSlots
from psr_hf.offload.experts import OffloadedExperts
from psr_hf.offload.links import CopyLink, CudaLink, RuntimeLink, ThreadLink, new_link
from psr_hf.offload.fp8_experts import Fp8OffloadedExperts
from psr_hf.offload.store import ExpertStore, Fp8ExpertStore, PatchedExpertStore, ResidentExperts
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

CONFIG = RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5)
OFFLOAD = OffloadConfig(device="cpu", check_slots=True)
TOKENS = (5, 9, 11, 5, 30, 9)


def _members(protocol: type) -> set[str]:
    """The members a protocol names: its methods and its annotated attributes (its bases' too)."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls is object or cls.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return names


def _layer_output(store: ExpertStore, layer: int, experts: np.ndarray, hidden: torch.Tensor) -> torch.Tensor:
    """One position's MoE output of ``layer`` computed from what ``store`` says: the slots of ``experts`` and the
    experts module over the slots, through transformers' grouped experts function (as the speculative engine)."""
    slots = torch.from_numpy(store.decode_slots(layer, experts.reshape(1, -1)))  # [1, K]
    weights = torch.linspace(0.1, 0.9, experts.size, dtype=hidden.dtype).reshape(1, -1)
    out = ALL_EXPERTS_FUNCTIONS["grouped_mm"](store.experts_module(layer), hidden, slots, weights)
    store.decode_done(layer)
    return out


def _decode_through_store(model: torch.nn.Module) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """Decode :data:`TOKENS` through the controller's decode handle with seeded router scores, computing every layer
    from the controller's store; the selected experts and the outputs of every token-layer."""
    ctl = psr_hf.controller(model)
    handle = ctl.decode_handle()
    store = ctl.expert_store
    rng = np.random.default_rng(0)
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    chosen, outputs = [], []
    for position, token in enumerate(TOKENS):
        with handle.step(token, position):
            for layer in range(ctl.num_layers):
                scores = rng.standard_normal(ctl.num_experts).astype(np.float32)
                pregate = rng.standard_normal(ctl.num_experts).astype(np.float32)
                last = layer + 1 == ctl.num_layers
                selection = handle.select(layer, scores, None if last else pregate)
                if not last:
                    handle.prefetch(layer + 1)
                chosen.append(selection.experts.copy())
                outputs.append(_layer_output(store, layer, selection.experts, hidden))
    return chosen, outputs


def test_each_store_computes_a_layer_the_same_through_the_protocol():
    model = tiny_model("olmoe")
    runs = {}
    for name, offload in (("resident", None), ("offloaded", OFFLOAD)):
        with psr_hf.patched(model, CONFIG, offload=offload):
            store = psr_hf.controller(model).expert_store
            assert isinstance(store, PatchedExpertStore)
            assert store.offloaded == (offload is not None)
            runs[name] = _decode_through_store(model)
    (chosen, resident), (off_chosen, offloaded) = runs["resident"], runs["offloaded"]
    assert all(np.array_equal(a, b) for a, b in zip(chosen, off_chosen))  # the store never changes a decision
    assert all(torch.equal(a, b) for a, b in zip(resident, offloaded))
    # the speculative engine's slots: the same experts loaded into half the slots, the same outputs
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    layers = psr_hf.patches.get_patch("olmoe")(model).moe_layers()
    slots = ExpertSlots([layer.block.experts for layer in layers], len(chosen[0]) * 2, torch.device("cpu"))
    assert isinstance(slots, ExpertStore) and slots.offloaded
    for i, experts in enumerate(chosen):
        layer = i % len(layers)
        slots.reset()
        slots.load(layer, experts)
        assert torch.equal(_layer_output(slots, layer, experts, hidden), resident[i])


def test_the_slots_a_store_names_hold_the_experts_it_names():
    model = tiny_model("olmoe")
    with psr_hf.patched(model, CONFIG, offload=OFFLOAD):
        ctl = psr_hf.controller(model)
        store = ctl.expert_store
        assert store.capacity == ctl.capacity
        handle = ctl.decode_handle()
        with handle.step(7, 0):
            for layer in range(ctl.num_layers):
                scores = np.arange(ctl.num_experts, dtype=np.float32)[::-1].copy()
                last = layer + 1 == ctl.num_layers
                selection = handle.select(layer, scores, None if last else scores)
                if not last:
                    handle.prefetch(layer + 1)
                slots = torch.from_numpy(store.decode_slots(layer, selection.experts))
                experts = torch.from_numpy(selection.experts)
                for name, weights in store.slot_weights(layer).items():
                    assert weights.shape[0] == store.capacity
                    assert torch.equal(weights[slots], store.expert_weights(layer)[name][experts])
                store.decode_done(layer)


def test_the_controller_holds_a_store_and_offload_reads_it():
    model = tiny_model("olmoe")
    psr_hf.patch(model, CONFIG)
    ctl = psr_hf.controller(model)
    assert isinstance(ctl.expert_store, ResidentExperts) and ctl.offload is None
    psr_hf.unpatch(model)
    psr_hf.patch(model, CONFIG, offload=OFFLOAD)
    ctl = psr_hf.controller(model)
    assert isinstance(ctl.expert_store, OffloadedExperts) and ctl.offload is ctl.expert_store
    psr_hf.unpatch(model)
    assert isinstance(ctl.expert_store, ResidentExperts) and ctl.offload is None  # the offload closed
    assert ctl.routing.store is ctl.expert_store


def test_the_resident_store_is_the_models_own_weights_and_moves_nothing():
    model = tiny_model("olmoe")
    with psr_hf.patched(model, CONFIG):
        ctl = psr_hf.controller(model)
        store = ctl.expert_store
        module = ctl.layers[0].block.experts
        assert store.capacity == ctl.num_experts and store.experts_module(0) is module
        assert store.slot_weights(0)["gate_up_proj"] is module.gate_up_proj
        assert store.expert_weights(0)["down_proj"] is module.down_proj
        experts = np.array([3, 1, 2], dtype=np.int64)
        assert np.array_equal(store.decode_slots(0, experts), experts)  # slot = expert id
        assert store.stats(10) is None and store.lend_slots() is None and store.unsupported_on_device() is None
        assert store.sync_weights(lambda layer: np.zeros(ctl.num_experts, dtype=bool)) is False
        store.check_device()  # computes wherever the model put it
        with pytest.raises(ValueError, match="not offloaded"):
            ctl.refresh_experts()
        with pytest.raises(ValueError, match="not offloaded"):
            ctl.memory()
        assert ctl.stats().offload is None


def test_the_offloaded_store_keeps_its_slots_for_the_same_capacity_and_says_what_the_device_cannot_do():
    model = tiny_model("olmoe")
    with psr_hf.patched(model, CONFIG, offload=OFFLOAD):
        store = psr_hf.controller(model).expert_store
        slots = store.slot_weights(0)
        store.resize(store.capacity)
        assert store.slot_weights(0) is slots
        store.resize(store.capacity + 1)
        assert store.slot_weights(0)["gate_up_proj"].shape[0] == store.capacity
        assert "check_slots" in store.unsupported_on_device()
        store.check_device()
        store.device = torch.device("meta")  # as if the model had moved away from the offload device
        with pytest.raises(ValueError, match="moved after patching"):
            store.check_device()
        store.device = torch.device("cpu")
    with psr_hf.patched(model, CONFIG, offload=OffloadConfig(device="cpu")):
        assert psr_hf.controller(model).expert_store.unsupported_on_device() is None


def test_every_copy_link_has_the_protocols_members_and_the_cpu_gets_the_thread():
    members = _members(CopyLink)
    assert {"copy", "wait", "read_done", "prepare", "synchronize", "wait_s"} <= members
    for cls in (ThreadLink, CudaLink, RuntimeLink):
        missing = {m for m in members - {"wait_s"} if not callable(getattr(cls, m, None))}
        assert not missing, (cls.__name__, missing)
    link = new_link(torch.device("cpu"), 0.0)
    try:
        assert isinstance(link, ThreadLink) and isinstance(link, CopyLink)
        dst, src = [[[torch.zeros(2)]]], [[[torch.ones(2)]]]
        assert link.prepare(dst, src) == (dst, src)
        link.copy(0, 0, 0, 0, dst[0][0], src[0][0])
        link.wait(0)
        assert torch.equal(dst[0][0][0], src[0][0][0]) and link.done(0) and link.complete() == 0
    finally:
        link.close()


def test_every_store_has_the_protocols_members():
    for protocol, classes in ((PatchedExpertStore, (ResidentExperts, OffloadedExperts, Fp8OffloadedExperts)),
                              (ExpertStore, (ExpertSlots,)), (Fp8ExpertStore, (Fp8OffloadedExperts,))):
        members = _members(protocol) - {"offloaded", "capacity", "weight_format", "slot_generation"}
        for cls in classes:
            missing = {m for m in members if not callable(getattr(cls, m, None))}
            assert not missing, (cls.__name__, missing)
            assert isinstance(cls.offloaded, bool)
            assert cls is OffloadedExperts or cls is Fp8OffloadedExperts or isinstance(cls.slot_generation, int)
            assert cls.weight_format == ("fp8" if protocol is Fp8ExpertStore or cls is Fp8OffloadedExperts
                                         else "model"), cls.__name__


def test_an_offloaded_stores_slot_generation_changes_exactly_when_its_slots_are_allocated_again():
    model = tiny_model("olmoe", dtype=torch.float32)
    with psr_hf.patched(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
                        offload=psr_hf.OffloadConfig(device="cpu")):
        ctl = psr_hf.controller(model)
        store = ctl.expert_store
        first = store.slot_generation
        ctl.reconfigure(RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.5))  # same capacity
        assert store.slot_generation == first
        ctl.reconfigure(RoutingConfig(policy="psr", lam=0.2, budget=1, residency=0.25))  # fewer slots
        assert store.slot_generation == first + 1
