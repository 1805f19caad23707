"""The offload under faults: a copy that cannot be issued or fails in the copy thread, an interrupt between a
slot's assignment and its copy, expert weights changed after offloading, and CPU offload run again with other slot
layouts. Each leaves the slots consistent and the model computing what a freshly patched model computes, or fails
with a message that says what to do. The fault helpers (greedy generation with its step logits, a freshly patched
model's outputs, the slots' consistency) serve the controller's fault tests too (``tests/test_hf_faults.py``)."""

from __future__ import annotations

import pytest
import torch

import psr_hf
from psr_hf import OffloadConfig, RoutingConfig
from psr_hf.hf.inputs import cache_keyword, output_cache
from psr_hf.offload.links import ThreadLink
from psr_hf.offload.scheduler import SlotScheduler
from psr_hf.testing import tiny_model
from test_offload import _ids

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

PAD = 0
NEW = 8  # generated tokens: 8 forward passes (the prompt, then 7 single positions)
POLICIES = {
    "exact": RoutingConfig(policy="exact", eviction="score", budget=1, residency=0.5),
    "psr": RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
    "spec": RoutingConfig(policy="spec", residency=0.5),
}
OFFLOAD = {"resident": None, "offloaded": OffloadConfig(device="cpu", max_in_flight=1, check_slots=True)}


def _generate(model, ids, new=NEW, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=PAD, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _fresh(family, policy, offload, ids, seed=0):
    """Tokens, step logits and the final logical state of a freshly patched model."""
    model = tiny_model(family, seed=seed)
    psr_hf.patch(model, POLICIES[policy], offload=OFFLOAD[offload])
    try:
        tokens, logits = _generate(model, ids)
        return tokens, logits, psr_hf.controller(model).cache.state.copy()
    finally:
        psr_hf.unpatch(model)


def _assert_slots_consistent(ctl) -> None:
    for st in ctl.offload.scheduler.layers:
        for slot, expert in enumerate(st.slot_expert):
            if expert >= 0:
                assert st.expert_slot[expert] == slot
        assert st.pending == -1  # nothing left to wait for


# ---------------------------------------------------------------------------------------------- failed copies
def test_a_copy_that_cannot_be_issued_fails_clearly_and_the_next_generate_is_correct(monkeypatch):
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES["psr"], offload=OFFLOAD["offloaded"])
    ctl = psr_hf.controller(model)
    ids = _ids(5, 1, 1)
    copy, calls = ThreadLink.copy, []

    def fail_once(self, *args):
        calls.append(args[0])
        if len(calls) == 20:  # a copy during decoding, after its slot was assigned
            raise OSError("injected copy failure")
        copy(self, *args)

    monkeypatch.setattr(ThreadLink, "copy", fail_once)
    with pytest.raises(RuntimeError, match=r"copy of expert \d+ into slot \d+ of MoE layer \d+ could not be issued "
                                           r"\(OSError: injected copy failure\).*start a new sequence"):
        _generate(model, ids)
    monkeypatch.undo()
    _assert_slots_consistent(ctl)
    tokens, logits = _generate(model, ids)  # check_slots: every executed slot is verified against the host store
    want_tokens, want_logits, _ = _fresh("olmoe", "psr", "offloaded", ids)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    psr_hf.unpatch(model)


def test_a_copy_that_fails_in_the_copy_thread_fails_clearly_once():
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES["psr"], offload=OffloadConfig(device="cpu"))
    ctl = psr_hf.controller(model)
    ids = _ids(6, 1, 1)
    sched = ctl.offload.scheduler
    expert = next(e for e in range(ctl.num_experts) if e not in ctl.cache.resident(0))  # copied on demand later
    good = sched._src[0][expert]
    sched._src[0][expert] = [torch.zeros(3) for _ in good]  # the wrong shape: the thread's copy_ raises
    with pytest.raises(RuntimeError, match=rf"copy of expert {expert} into slot \d+ of MoE layer 0 failed"):
        for seed in range(20):  # until some token needs that expert
            _generate(model, _ids(100 + seed, 1, 4))
    sched._src[0][expert] = good
    tokens, logits = _generate(model, ids)  # the error does not stick, and the emptied slot is copied again
    want_tokens, want_logits, _ = _fresh("olmoe", "psr", "offloaded", ids)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    psr_hf.unpatch(model)


def test_an_interrupt_between_the_slot_maps_and_the_copy_empties_the_slot(monkeypatch):
    """KeyboardInterrupt can arrive between any two bytecodes: here after a slot was assigned, before its copy."""
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES["psr"], offload=OFFLOAD["offloaded"])
    ids = _ids(7, 1, 1)
    copy, calls = ThreadLink.copy, []

    def interrupt_once(self, *args):
        calls.append(args[0])
        if len(calls) == 30:  # the slot maps say the slot holds its expert; its copy was never issued
            raise KeyboardInterrupt
        copy(self, *args)

    monkeypatch.setattr(ThreadLink, "copy", interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        _generate(model, ids)
    monkeypatch.undo()
    tokens, logits = _generate(model, ids)
    want_tokens, want_logits, _ = _fresh("olmoe", "psr", "offloaded", ids)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    psr_hf.unpatch(model)


def test_an_interrupt_between_a_decision_and_its_copies_empties_the_slots(monkeypatch):
    """The scheduler's kernel decided copies (the slot maps say the slots hold their experts) and the interrupt
    comes before the first of them is issued."""
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES["psr"], offload=OFFLOAD["offloaded"])
    ids = _ids(8, 1, 1)
    after, calls = SlotScheduler._after, []

    def interrupt_once(self, result):
        calls.append(int(self._misc[15]))  # N_ACTIONS: copies decided, none issued yet
        if len(calls) > 12 and calls[-1] and not hasattr(self, "_interrupted"):  # decoding
            self._interrupted = True
            raise KeyboardInterrupt
        after(self, result)

    monkeypatch.setattr(SlotScheduler, "_after", interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        _generate(model, ids)
    monkeypatch.undo()
    ctl = psr_hf.controller(model)
    _assert_slots_consistent(ctl)
    offload = ctl.offload
    offload.link.synchronize()
    for layer, st in enumerate(offload.scheduler.layers):  # a slot the maps keep holds its expert's weights
        for slot, expert in enumerate(st.slot_expert.tolist()):
            if expert >= 0:
                for name, buf in offload.slots[layer].items():
                    assert torch.equal(buf[slot], offload.placement.store[layer][name][expert]), (layer, slot, name)
    tokens, logits = _generate(model, ids)
    want_tokens, want_logits, _ = _fresh("olmoe", "psr", "offloaded", ids)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    psr_hf.unpatch(model)


# ---------------------------------------------------------------------------------------------- weight changes
def _scale_first_layer(model):
    experts = psr_hf.controller(model).layers[0].block.experts
    with torch.no_grad():
        experts.gate_up_proj.mul_(1.5)
        experts.down_proj[3].neg_()  # a view: shares the parameter's version counter


def _load_other(model):
    model.load_state_dict(tiny_model("olmoe", seed=1).state_dict())


def _assign_other(model):
    model.load_state_dict(tiny_model("olmoe", seed=1).state_dict(), assign=True)


CHANGES = {
    "in-place": (_scale_first_layer, torch.float32),
    "load_state_dict": (_load_other, torch.float32),
    "load_state_dict-assign": (_assign_other, torch.float32),
    "to-bfloat16": (lambda model: model.to(torch.bfloat16), torch.bfloat16),
    "half": (lambda model: model.half(), torch.float16),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_an_offloaded_model_computes_with_weights_changed_after_offloading(change):
    """After a first generate (slots filled), the weights change; the offloaded model then equals a resident
    patched model with the same change (float32: bitwise for a one-token prompt)."""
    apply, dtype = CHANGES[change]
    ids = _ids(8, 1, 1)
    resident, offloaded = tiny_model("olmoe"), tiny_model("olmoe")
    psr_hf.patch(resident, POLICIES["psr"])
    psr_hf.patch(offloaded, POLICIES["psr"], offload=OFFLOAD["offloaded"])
    for model in (resident, offloaded):
        _generate(model, ids)
        apply(model)
    want_tokens, want_logits = _generate(resident, ids)
    tokens, logits = _generate(offloaded, ids)
    assert psr_hf.controller(offloaded).offload.slots[0]["gate_up_proj"].dtype == dtype  # the slots followed
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    psr_hf.unpatch(offloaded)
    # unpatch puts the changed weights back where they were, as a resident model has them
    for (name, a), b in zip(offloaded.state_dict().items(), resident.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    psr_hf.unpatch(resident)


def test_weights_changed_in_the_middle_of_a_sequence_are_used_from_the_next_step():
    ids = _ids(9, 1, 4)
    outputs = []
    for offload in (None, OFFLOAD["offloaded"]):
        model = tiny_model("olmoe")
        psr_hf.patch(model, POLICIES["psr"], offload=offload)
        steps = []
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            past, token = output_cache(out), out.logits[:, -1:].argmax(-1)
            for step in range(6):
                if step == 2:
                    _scale_first_layer(model)
                out = model(input_ids=token, use_cache=True, **{cache_keyword(model): past})
                past, token = output_cache(out), out.logits[:, -1:].argmax(-1)
                steps.append(out.logits)
        outputs.append(torch.cat(steps))
        psr_hf.unpatch(model)
    assert torch.equal(outputs[1], outputs[0])


# ---------------------------------------------------------------------------------------------- CPU determinism
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_cpu_offload_is_bitwise_deterministic_across_calls_and_slot_layouts(family, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = tiny_model(family)
        psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
                     offload=OffloadConfig(device="cpu"))
        assert torch.get_num_threads() == threads
        block = _ids(9, 2, 12)
        logits, generated, layouts = [], [], set()
        for i in range(3):
            with torch.no_grad():
                logits.append(model(block).logits)
            generated.append(_generate(model, block[:1], new=5)[1])
            with torch.no_grad():  # another sequence in between leaves another slot layout
                model(_ids(30 + i, 3, 9))
            layouts.add(tuple(tuple(st.slot_expert.tolist()) for st in psr_hf.controller(model).offload.scheduler.layers))
        assert len(layouts) > 1  # the slots held the experts in other places between the calls
        assert all(torch.equal(x, logits[0]) for x in logits)
        assert all(torch.equal(x, generated[0]) for x in generated)
    finally:
        torch.set_num_threads(before)
