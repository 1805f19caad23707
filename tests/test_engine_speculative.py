"""psr_hf.engine.SpeculativeEngine: speculative decoding with block-level expert selection in the engine.

CPU (eager verification, the drafter's GraphDecoder with graphs=False): the same tokens, accepted counts and copies
as the harness (psr_hf.hf.speculative.speculative_generate) for every mode, and exact verification gives AR greedy
decoding's tokens. CUDA (marked ``cuda``): the captured verification graphs against the eager run and, under exact
verification, AR greedy decoding's tokens in bf16.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from psr_hf.assets.loading import load_model
from psr_hf.engine.speculative import SpeculativeEngine
from psr_hf.hf.speculative import speculative_generate
from psr_hf.policy.blocks import BlockConfig
from psr_hf.policy.calibration import Calibration

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

PROMPTS = ("def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n",
           "It is a truth universally acknowledged, that a single man")
NEW = 24


@pytest.fixture(scope="module")
def models():
    target, tokenizer, info = load_model("olmoe-routing", "cpu")
    drafter, _, _ = load_model("tiny-moe", "cpu")
    return target, drafter, tokenizer, Calibration.load(info["calibration_file"])


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("mode", ["exact", "position", "confidence"])
def test_engine_makes_the_harness_decisions_on_the_cpu(models, mode):
    target, drafter, tokenizer, cal = models
    config = BlockConfig(mode=mode, pool=24)
    engine = SpeculativeEngine(target, copy.deepcopy(drafter), config, draft_tokens=4, max_len=160, calibration=cal)
    for text in PROMPTS:
        ids = _ids(tokenizer, text)
        harness = speculative_generate(target, drafter, ids, config, max_new_tokens=NEW, draft_tokens=4,
                                       calibration=cal)
        run = engine.generate(ids, NEW)
        assert run.tokens == harness.tokens
        assert run.accepted == harness.accepted
        assert run.copies == harness.copies
        assert len(run.tokens) == NEW


def test_exact_verification_in_the_engine_is_ar_greedy_decoding(models):
    target, drafter, tokenizer, cal = models
    engine = SpeculativeEngine(target, copy.deepcopy(drafter), BlockConfig(mode="exact", pool=24), draft_tokens=8,
                               max_len=160, calibration=cal)
    for text in PROMPTS:
        ids = _ids(tokenizer, text)
        greedy = target.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
        assert engine.generate(ids, NEW).tokens == greedy


def test_copies_skipped_keeps_the_bookkeeping_and_moves_nothing(models):
    target, drafter, tokenizer, cal = models
    engine = SpeculativeEngine(target, copy.deepcopy(drafter), BlockConfig(mode="confidence", pool=24),
                               draft_tokens=4, max_len=160, calibration=cal, copies=False)
    before = [b["gate_up_proj"].clone() for b in engine.experts.buffers]
    run = engine.generate(_ids(tokenizer, PROMPTS[0]), 8)
    assert sum(run.copies) > 0
    assert all(torch.equal(a, b["gate_up_proj"]) for a, b in zip(before, engine.experts.buffers))


def _held_slots_hold_their_experts(slots) -> bool:
    for m, (store, buffers) in enumerate(zip(slots.store, slots.buffers)):
        for e in np.flatnonzero(slots.slot_of[m] >= 0):
            slot = slots.slot_of[m][e]
            if not (torch.equal(buffers["gate_up_proj"][slot], store[0][e]) and
                    torch.equal(buffers["down_proj"][slot], store[1][e])):
                return False
    return True


def test_the_setup_reuses_slots_that_still_hold_an_expert_and_decoding_always_copies(models):
    target, drafter, tokenizer, cal = models
    engine = SpeculativeEngine(target, copy.deepcopy(drafter), BlockConfig(mode="confidence", pool=24),
                               draft_tokens=4, max_len=160, calibration=cal)
    slots = engine.experts
    a, b = (_ids(tokenizer, text) for text in PROMPTS)
    moved = []
    runs = []
    for ids in (a, b, a):
        before = slots.transfers
        runs.append(engine.generate(ids, 12))
        moved.append(slots.transfers - before)
        assert _held_slots_hold_their_experts(slots)
    first, again = runs[0], runs[2]
    assert again.tokens == first.tokens and again.copies == first.copies
    # the second run of prompt a found its warm pool and prompt experts in slots: fewer transfers, but every
    # decode-time load is still a transfer
    assert sum(first.copies) <= moved[2] < moved[0]


def test_a_run_with_the_copies_skipped_follows_the_run_it_is_given(models):
    target, drafter, tokenizer, cal = models
    config = BlockConfig(mode="confidence", pool=24)
    engine = SpeculativeEngine(target, copy.deepcopy(drafter), config, draft_tokens=4, max_len=160, calibration=cal)
    skipped = SpeculativeEngine(target, engine.drafter, config, draft_tokens=4, max_len=160, calibration=cal,
                                copies=False, experts=engine.experts)
    ids = _ids(tokenizer, PROMPTS[1])
    run = engine.generate(ids, 16)
    before = engine.experts.transfers
    follow = skipped.generate(ids, 16, forced=run)
    assert engine.experts.transfers == before
    assert follow.tokens == run.tokens and follow.accepted == run.accepted
    assert len(follow.copies) == len(run.copies)
    assert engine.generate(ids, 16).tokens == run.tokens  # slots a skipped run assigned are not trusted
    longer = SpeculativeEngine(target, engine.drafter, config, draft_tokens=2, max_len=160, calibration=cal,
                               copies=False, experts=engine.experts)
    with pytest.raises(ValueError, match="forced"):
        longer.generate(ids, 16, forced=run)


def test_engine_refuses_what_it_cannot_run(models):
    import psr_hf
    from psr_hf.testing import tiny_model

    target, drafter, tokenizer, cal = models
    config = BlockConfig(mode="confidence", pool=24)
    with pytest.raises(ValueError, match="draft_tokens"):
        SpeculativeEngine(target, copy.deepcopy(drafter), config, draft_tokens=0)
    other = tiny_model("olmoe")  # a byte-level vocabulary of 256
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeEngine(target, other, config, draft_tokens=2, max_len=64)
    patched = copy.deepcopy(target)
    psr_hf.patch(patched, psr_hf.RoutingConfig(policy="exact", residency=0.5))
    with pytest.raises(ValueError, match="unpatched"):
        SpeculativeEngine(patched, copy.deepcopy(drafter), config)
    engine = SpeculativeEngine(target, copy.deepcopy(drafter), config, draft_tokens=4, max_len=64, calibration=cal)
    with pytest.raises(ValueError, match="max_len"):
        engine.generate(list(range(40)), 30)
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([], 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("mode", ["exact", "position", "confidence"])
def test_captured_verification_equals_the_eager_run_in_bf16_on_cuda(models, mode):
    target, drafter, tokenizer, cal = models
    target = copy.deepcopy(target).to("cuda", torch.bfloat16)
    drafter = copy.deepcopy(drafter).to("cuda", torch.bfloat16)
    config = BlockConfig(mode=mode, pool=24)
    graphs = SpeculativeEngine(target, copy.deepcopy(drafter), config, draft_tokens=8, max_len=256, calibration=cal)
    eager = SpeculativeEngine(target, copy.deepcopy(drafter), config, draft_tokens=8, max_len=256, calibration=cal,
                              graphs=False)
    for text in PROMPTS:
        ids = _ids(tokenizer, text)
        a, b = graphs.generate(ids, 48), eager.generate(ids, 48)
        assert a.tokens == b.tokens and a.accepted == b.accepted and a.copies == b.copies


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_exact_verification_is_ar_greedy_decoding_in_float32_on_cuda(models):
    target, drafter, tokenizer, cal = models
    target, drafter = copy.deepcopy(target).cuda(), copy.deepcopy(drafter).cuda()
    # float32 grouped matmuls have no capturable CUDA kernel: the verification runs eagerly
    engine = SpeculativeEngine(target, drafter, BlockConfig(mode="exact", pool=24), draft_tokens=16, max_len=256,
                               calibration=cal, graphs=False)
    for text in PROMPTS:
        ids = _ids(tokenizer, text)
        greedy = target.generate(torch.tensor([ids], device="cuda"), max_new_tokens=48,
                                 do_sample=False)[0, len(ids):].tolist()
        assert engine.generate(ids, 48).tokens == greedy


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("k", [16, 8])
def test_exact_verification_leaves_ar_greedy_only_at_near_ties_in_bf16_on_cuda(models, k):
    from psr_hf.engine.graphs import GraphDecoder
    import psr_hf

    target, drafter, tokenizer, cal = models
    reference = copy.deepcopy(target).cuda()  # float32: how close the two candidates are
    target = copy.deepcopy(target).to("cuda", torch.bfloat16)
    drafter = copy.deepcopy(drafter).to("cuda", torch.bfloat16)
    engine = SpeculativeEngine(target, drafter, BlockConfig(mode="exact", pool=24), draft_tokens=k, max_len=256,
                               calibration=cal)
    ar_model = copy.deepcopy(target)
    psr_hf.patch(ar_model, psr_hf.RoutingConfig(policy="exact", residency=1.0))
    ar = GraphDecoder(ar_model, 256)
    for text in PROMPTS:
        ids = _ids(tokenizer, text)
        greedy = ar.generate_greedy(ids, 64)[0, len(ids):].tolist()
        tokens = engine.generate(ids, 64).tokens
        first = next((i for i, (x, y) in enumerate(zip(tokens, greedy)) if x != y), None)
        if first is None:
            continue
        # a batched (k+1)-position pass and one-token steps round differently in bf16: they may part only where
        # the two tokens' logits are within bf16's rounding of each other
        with torch.no_grad():
            logits = reference(torch.tensor([ids + greedy[:first]], device="cuda")).logits[0, -1]
        gap = abs(float(logits[tokens[first]] - logits[greedy[first]]))
        assert gap < 0.1, f"exact verification left AR greedy decoding at token {first}, a logit gap of {gap:.3f}"
