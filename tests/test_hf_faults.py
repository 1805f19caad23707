"""The controller under faults and hostile calls: a forward pass stopped anywhere (KeyboardInterrupt, SystemExit,
GeneratorExit), a KV cache continued after another prompt's forward pass, two threads generating on one model, and
right-padded batches. Each leaves the model usable, computing what a freshly patched model computes, or is refused
with a message that says what to do."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.hf.inputs import cache_keyword, output_cache
from psr_hf.testing import FAMILIES, tiny_model
from test_offload import _ids
from test_offload_faults import NEW, OFFLOAD, POLICIES, _assert_slots_consistent, _fresh, _generate

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")


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
        past = output_cache(model(input_ids=ids, use_cache=True))
        stop = _Stop(ctl.layers[1].block, KeyboardInterrupt, at_forward=0, before=False)
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=torch.tensor([[7]]), **{cache_keyword(model): past})
        stop.handle.remove()
        with pytest.raises(RuntimeError, match=r"stopped part-way \(KeyboardInterrupt\).*Start a new sequence"):
            model(input_ids=torch.tensor([[7]]), **{cache_keyword(model): past})
    tokens, _ = _generate(model, ids)
    assert torch.equal(tokens, _fresh("olmoe", "psr", "resident", ids)[0])
    psr_hf.unpatch(model)


# ---------------------------------------------------------------------------------------------- continuation
def _step(model, token, cache):
    with torch.no_grad():
        return model(input_ids=token, use_cache=True, **{cache_keyword(model): cache})


@pytest.mark.parametrize("longer", [False, True])  # the prompt in between shorter or longer than the first
def test_continuing_a_kv_cache_after_another_prompts_forward_raises(longer):
    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5))
    first = _step(model, _ids(4, 1, 6), None)
    _step(model, _ids(5, 1, 9 if longer else 3), None)  # another prompt: a new routing sequence
    token = first.logits[:, -1:].argmax(-1)
    with pytest.raises(RuntimeError, match=r"KV cache of 6 positions.*belongs to .*reset\(\)"):
        _step(model, token, output_cache(first))
    psr_hf.controller(model).reset()  # what the message says: continue this cache with fresh routing state
    assert _step(model, token, output_cache(first)).logits.shape[1] == 1


def test_continuing_the_same_cache_and_generate_with_it_still_work():
    model = tiny_model("olmoe")
    psr_hf.patch(model, RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5))
    out = _step(model, _ids(6, 1, 5), None)
    for _ in range(3):
        out = _step(model, out.logits[:, -1:].argmax(-1), output_cache(out))
    ids = _ids(7, 1, 4)
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        more = model.generate(first.sequences, **{cache_keyword(model): output_cache(first)}, max_new_tokens=3,
                              do_sample=False, pad_token_id=0)
    assert more.shape[1] == first.sequences.shape[1] + 3


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
