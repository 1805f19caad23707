"""Speculative decoding in the harness (psr_hf/hf/speculative.py) and through lm-eval (``speculative=`` of
``--model psr_hf``, psr_hf/eval/lm_model.py), on the shipped models: olmoe-routing verifies, tiny-moe drafts (they
share a tokenizer), float32 on the CPU.

Exact verification must give the target's own greedy tokens, patched or not (the harness bypasses a patched
model's routing and leaves its state alone); the block modes must replay from their recordings
(psr_hf.policy.blocks.replay) to what they executed, count their copies as the replay does, be deterministic and
copy less than exact mode; generation stops at an end-of-sequence token, a stop callable and max_new_tokens; bad
input fails with ValueError. Through lm-eval: the new model args are checked before anything loads, and
``speculative=exact`` serves ``generate_until`` with the texts of normal greedy decoding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.hf.speculative import speculative_generate
from psr_hf.policy.blocks import BlockConfig, replay
from psr_hf.testing import save_tiny, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

PROMPTS = ("It was a truth universally acknowledged that", "The river ran past the old mill, and",
           "Anne had always thought")
NEW = 24  # new tokens per generation
POOL = 24


@pytest.fixture(scope="module")
def shipped():
    """``(target, drafter, tokenizer, calibration)``: olmoe-routing, tiny-moe, their tokenizer and olmoe-routing's
    calibration."""
    from psr_hf.assets.loading import load_model
    from psr_hf.policy.calibration import Calibration

    target, tokenizer, info = load_model("olmoe-routing", "cpu")
    drafter, _, _ = load_model("tiny-moe", "cpu")
    return target, drafter, tokenizer, Calibration.load(info["calibration_file"])


@pytest.fixture(scope="module")
def greedy(shipped):
    """Per prompt: its ids ``[1, S]`` and the unpatched target's greedy ``generate()`` tokens (``NEW`` of them)."""
    target, _, tokenizer, _ = shipped
    out = []
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            tokens = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
        out.append((ids, tokens[0, ids.shape[1]:].tolist()))
    assert all(len(tokens) == NEW for _, tokens in out)  # no end-of-sequence token in these continuations
    return out


def _run(shipped, ids, mode="exact", draft_tokens=4, max_new_tokens=NEW, **kwargs):
    target, drafter, _, calibration = shipped
    return speculative_generate(target, drafter, ids, BlockConfig(mode=mode, pool=POOL), max_new_tokens=max_new_tokens,
                                draft_tokens=draft_tokens, calibration=calibration, **kwargs)


# ---------------------------------------------------------------------------------------------- exact verification
@pytest.mark.parametrize("draft_tokens", [1, 4, 16])
def test_exact_verification_gives_the_targets_greedy_tokens(shipped, greedy, draft_tokens):
    for ids, expected in greedy:
        result = _run(shipped, ids, draft_tokens=draft_tokens)
        assert result.tokens == expected
        assert all(0 <= a <= draft_tokens for a in result.accepted)
    # the drafter is trained on similar text: some drafts are accepted, so a block commits more than one token
    assert draft_tokens == 1 or result.tau > 1.5


def _routing_state(model) -> tuple[dict, np.ndarray]:
    ctl = psr_hf.controller(model)
    return dict(ctl.stats().total), ctl.cache.state.copy()


def test_a_patched_target_is_bypassed_and_its_routing_state_is_left_alone(shipped, greedy):
    target, _, tokenizer, calibration = shipped
    psr_hf.patch(target, psr_hf.RoutingConfig(policy="psr", residency=0.5), calibration=calibration)
    try:
        ids = greedy[0][0]
        with torch.no_grad():  # the patched model routes (and counts) its own generations
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id)
        stats, state = _routing_state(target)
        assert stats["tokens"] > 0 and stats["replaced_per_token"] > 0  # psr steered that generation
        for draft_tokens in (1, 4, 16):
            for ids, expected in greedy:
                assert _run(shipped, ids, draft_tokens=draft_tokens).tokens == expected, draft_tokens
        after_stats, after_state = _routing_state(target)
        assert after_stats == stats
        assert np.array_equal(after_state, state)
    finally:
        psr_hf.unpatch(target)


# ---------------------------------------------------------------------------------------------- block modes
@pytest.mark.parametrize("mode", ["position", "confidence"])
def test_block_modes_replay_count_their_copies_and_copy_less_than_exact(shipped, greedy, mode):
    _, _, _, calibration = shipped
    ids = greedy[0][0]
    result = _run(shipped, ids, mode=mode, draft_tokens=8, record=True)
    again = _run(shipped, ids, mode=mode, draft_tokens=8, record=True)
    assert (again.tokens, again.accepted, again.copies, again.prompt_copies) == (
        result.tokens, result.accepted, result.copies, result.prompt_copies)
    assert all(np.array_equal(x, y) for a, b in zip(again.executed, result.executed) for x, y in zip(a, b))

    config = BlockConfig(mode=mode, pool=POOL)
    replayed = replay(config, result.records, 16, 64, calibration.expert_counts)
    assert len(replayed) == len(result.executed) == result.verifications + 1  # the prompt block first
    for block, executed in zip(replayed, result.executed):
        assert len(block) == len(executed) == 16
        for choice, selected in zip(block, executed):
            assert np.array_equal(choice.selected, selected)
    assert result.prompt_copies == sum(c.copies.size for c in replayed[0])
    assert result.copies == [sum(c.copies.size for c in block) for block in replayed[1:]]
    assert [r.accepted for r in result.records[1:]] == result.accepted

    assert result.tau == pytest.approx(np.mean(result.accepted) + 1)
    committed = [a + 1 for a in result.accepted]  # every block commits tau tokens; max_new_tokens cuts the last
    assert sum(committed[:-1]) < len(result.tokens) == NEW <= sum(committed)

    exact = _run(shipped, ids, mode="exact", draft_tokens=8)
    assert result.copies_per_token < exact.copies_per_token


# ---------------------------------------------------------------------------------------------- stopping
def test_an_end_of_sequence_token_stops_and_is_kept(shipped, greedy):
    ids, expected = greedy[1]
    # the first token of the greedy continuation seen for the first time at index 3 or later
    j = next(i for i in range(3, NEW) if expected[i] not in expected[:i])
    eos = expected[j]
    result = _run(shipped, ids, draft_tokens=16, eos_token_id=eos)
    assert result.tokens == expected[:j + 1]
    for mode in ("position", "confidence"):
        tokens = _run(shipped, ids, mode=mode, draft_tokens=16, eos_token_id=[eos, 10**6]).tokens
        assert len(tokens) <= NEW and (tokens.index(eos) == len(tokens) - 1 if eos in tokens else len(tokens) == NEW)


def test_max_new_tokens_and_the_stop_callable_cut_generation(shipped, greedy):
    ids, expected = greedy[2]
    for max_new_tokens in (1, 5, 7):  # a block of 16 drafts never overshoots
        assert _run(shipped, ids, draft_tokens=16, max_new_tokens=max_new_tokens).tokens == expected[:max_new_tokens]
    for mode in ("position", "confidence"):
        assert len(_run(shipped, ids, mode=mode, draft_tokens=16, max_new_tokens=5).tokens) == 5
    seen = []

    def stop(tokens):
        seen.append(len(tokens))
        return len(tokens) >= 3

    result = _run(shipped, ids, draft_tokens=2, stop=stop)
    assert result.tokens == expected[:len(result.tokens)] and 3 <= len(result.tokens) <= 5  # after the block
    assert seen[-1] == len(result.tokens) and all(n < 3 for n in seen[:-1])


# ---------------------------------------------------------------------------------------------- errors
def test_bad_input_fails_naming_the_problem(shipped, greedy):
    target, drafter, _, _ = shipped
    ids = greedy[0][0]
    with pytest.raises(ValueError, match="needs a prompt of at least one token"):
        _run(shipped, [])
    with pytest.raises(ValueError, match="draft_tokens must be >= 1; got 0"):
        _run(shipped, ids, draft_tokens=0)
    small = tiny_model("olmoe")  # a vocabulary of 256 byte tokens, not the shipped models' 8192
    with pytest.raises(ValueError, match="the drafter's vocabulary differs from the target's"):
        speculative_generate(target, small, ids, BlockConfig(pool=POOL), max_new_tokens=4)
    sigmoid = tiny_model("deepseek_v3")  # the same 256 tokens: refused for its router alone
    with pytest.raises(ValueError, match="block-level selection is defined for softmax routers; deepseek_v3"):
        speculative_generate(sigmoid, small, [5, 6, 7], BlockConfig(pool=8, top_k=2), max_new_tokens=4)


# ---------------------------------------------------------------------------------------------- lm-eval
@pytest.fixture(scope="module")
def weightless(tmp_path_factory):
    """A tiny OLMoE directory with its config and tokenizer but no weights: loading it would fail, so an arg error
    raised on it was raised before anything loaded."""
    path = save_tiny("olmoe", tmp_path_factory.mktemp("weightless") / "olmoe")
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    return path


@pytest.mark.parametrize("args, message", [
    ("speculative=confidence", r"speculative=confidence needs drafter=MODEL: a small model that shares the "
                               r"target's tokenizer"),
    ("speculative=exact,drafter=tiny-moe,engine=true", r"speculative= and engine=true exclude each other"),
    ("speculative=exact,drafter=tiny-moe,offload=cpu", r"speculative= and offload= exclude each other"),
    ("speculative=greedy,drafter=tiny-moe", r"speculative='greedy' must be one of exact, position, confidence"),
    ("drafter=tiny-moe,pool=24", r"drafter, pool are used only with speculative="),
    ("speculative=exact,drafter=tiny_moe", r"drafter='tiny_moe': no model 'tiny_moe'.*did you mean tiny-moe\?"),
    ("speculative=exact,drafter=tiny-moe,draft_tokens=0", r"draft_tokens=0 must be a positive int"),
    ("speculative=exact,drafter=tiny-moe,block_threshold=-1", r"block_threshold=-1 must be a finite number >= 0"),
])
def test_speculative_model_args_fail_before_loading(weightless, args, message):
    from psr_hf.eval.lm_model import PSRLM

    with pytest.raises(ValueError, match=message):
        PSRLM.create_from_arg_string(f"pretrained={weightless},residency=0.5,{args}", {"device": "cpu"})


def _requests():
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", {}, (PROMPTS[0], {"until": ["\n\n"], "max_gen_toks": NEW, "do_sample": False}),
                     0),
            Instance("generate_until", {}, (PROMPTS[2], {"until": ["."], "max_gen_toks": NEW, "do_sample": False}), 1)]


def test_lm_eval_generations_with_exact_verification_equal_normal_greedy_decoding():
    from psr_hf.eval.lm_model import PSRLM

    common = dict(pretrained="olmoe-routing", device="cpu", dtype="float32", batch_size=2, policy="exact",
                  residency=0.5)
    lm = PSRLM(**common, speculative="exact", drafter="tiny-moe", draft_tokens=4, pool=POOL)
    assert lm.block_config == BlockConfig(mode="exact", pool=POOL, top_k=8)
    assert (lm.drafter.dtype, lm.drafter.device) == (lm.model.dtype, lm.model.device)
    outputs = lm.generate_until(_requests())
    plain = PSRLM(**common).generate_until(_requests())
    assert outputs == plain
    assert outputs[1] and "." not in outputs[1]  # cut at the stop string, as lm-eval cuts it
    stats = lm.routing_stats()
    spec = stats["speculative"]
    assert spec["generations"] == 2 and spec["verifications"] > 0 and spec["tokens"] > 0
    assert spec["tau"] == pytest.approx(spec["accepted"] / spec["verifications"] + 1) and spec["tau"] > 1
    assert spec["copies"] > 0 and spec["prompt_copies"] > 0
    assert stats["stats"]["tokens"] == 0  # the block selection routed the generations, not the patched model
    sampling = [type(r)(r.request_type, r.doc, (r.args[0], {**r.args[1], "do_sample": True, "temperature": 0.7}), 0)
                for r in _requests()[:1]]
    with pytest.raises(ValueError, match="speculative=exact accepts drafts greedily; this task samples"):
        lm.generate_until(sampling)
    assert lm.routing_stats()["speculative"]["generations"] == 2


def test_pool_defaults_to_the_routing_capacity_and_a_sigmoid_target_is_refused(tmp_path):
    from psr_hf.eval.lm_model import PSRLM

    lm = PSRLM(pretrained="tiny-moe", device="cpu", dtype="float32", policy="exact", residency=0.25,
               speculative="confidence", drafter="tiny-moe")
    assert lm.block_config.pool == psr_hf.controller(lm.model).capacity == 16 and lm.draft_tokens == 16
    assert lm.routing_stats()["speculative"]["generations"] == 0
    path = save_tiny("deepseek_v3", tmp_path / "deepseek_v3")
    with pytest.raises(ValueError, match="speculative=exact: block-level selection is defined for softmax routers"):
        PSRLM(pretrained=str(path), device="cpu", residency=0.5, speculative="exact", drafter=str(path))
