"""Faults and hostile input: a forward pass stopped anywhere (KeyboardInterrupt, SystemExit, GeneratorExit, a failed
expert copy), expert weights changed after offloading, two threads on one model, right-padded batches, and config
numbers too large for any model. Each leaves the model usable, computing what a fresh model computes, or is refused
with a message that says what to do."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.hf.inputs import cache_keyword
from psr_hf import OffloadConfig, RoutingConfig
from psr_hf.offload.scheduler import SlotScheduler, ThreadLink
from psr_hf.testing import FAMILIES, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

PAD = 0
NEW = 8  # generated tokens: 8 forward passes (the prompt, then 7 single positions)
POLICIES = {
    "exact": RoutingConfig(policy="exact", eviction="score", budget=1, residency=0.5),
    "psr": RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5),
    "spec": RoutingConfig(policy="spec", residency=0.5),
}
OFFLOAD = {"resident": None, "offloaded": OffloadConfig(device="cpu", max_in_flight=1, check_slots=True)}


def _ids(seed: int, rows: int, length: int) -> torch.Tensor:
    return torch.randint(3, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


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


class _Stop:
    """A hook on one MoE block that raises ``error`` at one forward pass: before the block (a pre-hook: the layer's
    part 1 already ran in the previous layer, its selection did not) or after it."""

    def __init__(self, block, error: type, at_forward: int, before: bool):
        self.error, self.at, self.calls = error, at_forward, 0
        if before:
            self.handle = block.register_forward_pre_hook(lambda module, args: self._maybe())
        else:
            self.handle = block.register_forward_hook(lambda module, args, output: self._maybe())

    def _maybe(self):
        call, self.calls = self.calls, self.calls + 1
        if call == self.at:
            raise self.error("injected")


def _assert_slots_consistent(ctl) -> None:
    for st in ctl.offload.scheduler.layers:
        for slot, expert in enumerate(st.slot_expert):
            if expert >= 0:
                assert st.expert_slot[expert] == slot
        assert st.pending == -1  # nothing left to wait for


# ---------------------------------------------------------------------------------------------- interrupts
@pytest.mark.parametrize("offload", sorted(OFFLOAD))
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, GeneratorExit], ids=lambda e: e.__name__)
def test_generate_after_an_interrupt_equals_a_freshly_patched_model(error, policy, offload):
    seed = zlib.crc32(f"{error.__name__}-{policy}-{offload}".encode()) % 1000  # stable across runs
    rng = np.random.default_rng(seed)
    length = int(rng.choice([1, 6]))  # a one-token prompt: the stale state changed tokens with no error
    ids = _ids(seed, 1, length)
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES[policy], offload=OFFLOAD[offload])
    ctl = psr_hf.controller(model)
    layer = int(rng.integers(ctl.num_layers))
    stop = _Stop(ctl.layers[layer].block, error, at_forward=int(rng.integers(NEW - 1)), before=bool(rng.random() < 0.5))
    with pytest.raises(error, match="injected"):
        _generate(model, ids)
    stop.handle.remove()
    if ctl.offload is not None:
        _assert_slots_consistent(ctl)
    tokens, logits = _generate(model, ids)
    want_tokens, want_logits, want_state = _fresh("olmoe", policy, offload, ids)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logits, want_logits)
    np.testing.assert_array_equal(ctl.cache.state, want_state)
    psr_hf.unpatch(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_interrupt_in_a_nested_forward_closes_the_outer_one(family):
    """Composite models call their language model inside their own forward (both wrapped): a stop in the inner
    call closes the forward pass the outer call opened."""
    ids = _ids(3, 1, 1)
    model = tiny_model(family)
    psr_hf.patch(model, POLICIES["psr"])
    ctl = psr_hf.controller(model)
    stop = _Stop(ctl.layers[-1].block, KeyboardInterrupt, at_forward=2, before=True)
    with pytest.raises(KeyboardInterrupt):
        _generate(model, ids)
    stop.handle.remove()
    assert ctl.forward_pass is None
    tokens, logits = _generate(model, ids)
    want_tokens, want_logits, _ = _fresh(family, "psr", "resident", ids)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    psr_hf.unpatch(model)


def test_continuing_the_interrupted_sequence_raises_and_a_new_one_works():
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES["psr"])
    ctl = psr_hf.controller(model)
    ids = _ids(4, 1, 6)
    with torch.no_grad():
        past = model(input_ids=ids, use_cache=True).past_key_values
        stop = _Stop(ctl.layers[1].block, KeyboardInterrupt, at_forward=0, before=False)
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=torch.tensor([[7]]), **{cache_keyword(model): past})
        stop.handle.remove()
        with pytest.raises(RuntimeError, match=r"stopped part-way \(KeyboardInterrupt\).*Start a new sequence"):
            model(input_ids=torch.tensor([[7]]), **{cache_keyword(model): past})
    tokens, _ = _generate(model, ids)
    assert torch.equal(tokens, _fresh("olmoe", "psr", "resident", ids)[0])
    psr_hf.unpatch(model)


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
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for step in range(6):
                if step == 2:
                    _scale_first_layer(model)
                out = model(input_ids=token, use_cache=True, **{cache_keyword(model): past})
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                steps.append(out.logits)
        outputs.append(torch.cat(steps))
        psr_hf.unpatch(model)
    assert torch.equal(outputs[1], outputs[0])


# ---------------------------------------------------------------------------------------------- threads
@pytest.mark.parametrize("offload", sorted(OFFLOAD))
def test_two_threads_generating_on_one_model_are_serialised(offload):
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES["psr"], offload=OFFLOAD[offload])
    prompts = [_ids(10 + i, 1, 1 + i % 3) for i in range(2)]
    expected = [_generate(model, ids)[0] for ids in prompts]  # one thread
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(i):
        try:
            start.wait()
            for _ in range(4):
                results[i].append(_generate(model, prompts[i])[0])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i in range(2):
        assert len(results[i]) == 4 and all(torch.equal(r, expected[i]) for r in results[i])
    psr_hf.unpatch(model)


# ---------------------------------------------------------------------------------------------- right padding
def test_generate_refuses_a_right_padded_batch_and_accepts_left_padding():
    model = tiny_model("olmoe")
    psr_hf.patch(model, POLICIES["psr"])
    ids = _ids(11, 2, 5)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r'right-padded batch \(row 0 .*tokenizer.padding_side = "left"'):
        _generate(model, ids, attention_mask=right)
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    tokens, _ = _generate(model, ids, attention_mask=left)
    assert tokens.shape == (2, 5 + NEW)
    psr_hf.unpatch(model)


def test_the_byte_tokenizer_of_the_random_models_pads_left_and_keeps_it_when_saved(tmp_path):
    """The tokenizer saved beside every random tiny model (save_tiny, the benchmarks) pads on the left, so a batch
    made with it generates correctly."""
    from transformers import AutoTokenizer

    from psr_hf.testing import byte_tokenizer, save_tiny

    tokenizer = byte_tokenizer()
    batch = tokenizer(["a", "abc"], padding=True, return_tensors="pt")
    assert batch["attention_mask"].tolist() == [[0, 0, 1], [1, 1, 1]]
    save_tiny("olmoe", tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).padding_side == "left"


def test_a_parallel_replay_leaves_torchs_thread_count_as_it_was():
    """numba's OpenMP layer sets the process's OpenMP thread count; torch reads it as its own, so a parallel replay
    would silently move a one-thread CLI run onto every core."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one core: numba runs one thread and cannot change torch's count")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rng = np.random.default_rng(0)
        scores = rng.standard_normal((16, 4, 16)).astype(np.float32)
        psr_hf.replay(psr_hf.RoutingConfig(policy="exact", capacity=8), scores,
                      tokens=np.zeros(16, dtype=np.int64), top_k=2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- bounds
@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=17), r"budget=17 exceeds the model's 16 experts per MoE layer"),
    (dict(top_j=17), r"top_j=17 exceeds"),
], ids=["budget", "top_j"])
def test_sizes_beyond_the_models_experts_are_refused_at_patch(kwargs, message):
    model = tiny_model("olmoe")
    with pytest.raises(ValueError, match=message):
        psr_hf.patch(model, RoutingConfig(policy="psr", residency=0.5, **kwargs))
    assert not hasattr(model, "_psr_hf_controller")


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=10**7), r"budget=10000000 must be an int >= 0 and <= 65536"),
    (dict(budget=10**11), r"budget=100000000000 must be an int >= 0 and <= 65536"),
    (dict(window=10**9), r"window=1000000000 must be an int >= 1 and <= 65536"),
    (dict(top_j=10**9), r"top_j=1000000000 must be an int >= 0 and <= 65536"),
    (dict(capacity=10**9, residency=None), r"capacity=1000000000 must be an int >= 1 and <= 65536"),
])
def test_absurd_sizes_are_refused_when_the_config_is_made(kwargs, message):
    values = dict(policy="psr", residency=0.5)
    values.update(kwargs)
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**values)


def test_absurd_offload_numbers_are_refused():
    with pytest.raises(ValueError, match=r"max_in_flight=1000000000 must be an int >= 1 and <= 65536"):
        OffloadConfig(device="cpu", max_in_flight=10**9)
    with pytest.raises(ValueError, match=r"copy_delay_ms=1000000000.0 must be a finite number >= 0 and <= 60000"):
        OffloadConfig(device="cpu", copy_delay_ms=1e9)


def test_a_yaml_with_a_duplicate_key_is_refused(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("policy: psr\nresidency: 0.5\nbudget: 1\nbudget: 3\n")
    with pytest.raises(ValueError, match=r"routing.yaml: key 'budget' appears more than once \(line 4\)"):
        RoutingConfig.load_yaml(path)
    path.write_text("base: &base {policy: psr, residency: 0.5}\n")  # anchors and plain files still load
    with pytest.raises(ValueError, match="unknown RoutingConfig field"):
        RoutingConfig.load_yaml(path)


@pytest.mark.parametrize("name", ["routing.YAML", "routing.Yml", "routing.yml"])
def test_yaml_suffixes_in_any_case_are_read(tmp_path, name):
    path = tmp_path / name
    RoutingConfig(policy="psr", residency=0.25, budget=2).save_yaml(path)
    assert RoutingConfig.coerce(path) == RoutingConfig(policy="psr", residency=0.25, budget=2)
    assert RoutingConfig.coerce(str(path)) == RoutingConfig(policy="psr", residency=0.25, budget=2)


def test_a_path_without_a_yaml_suffix_gets_an_accurate_error(tmp_path):
    with pytest.raises(ValueError, match=r"path to its YAML file, whose name ends in \.yaml or \.yml \(any case\); "
                                         r"got str '.*routing.json', which does not"):
        RoutingConfig.coerce(str(tmp_path / "routing.json"))
