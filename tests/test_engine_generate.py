"""psr_hf.engine.attach: model.generate() served by the engine's batch-1 decoder (CPU, float32, eager).

With the engine attached, generate() must give what the patched HF path gives: the same greedy and sampled tokens (same
logits -> same argmax / same multinomial draws under one seed), scores within 1e-4, the same routing selections
and statistics, eos stopping; batch 2 and beam search fall back to the HF path (logged once per reason), a
sequence past max_len re-synchronises on the HF path; detach (and unpatch) restore the forward.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf.hf.inputs import cache_keyword, output_cache
from psr_hf import RoutingConfig, engine
from psr_hf.assets import OLMOE_ROUTING_NAME, load_shipped
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 12
TEXT = "The engine decodes one token at a time, and every step"
PSR = dict(policy="psr", lam=0.2, budget=1, residency=0.5)
EXACT = dict(policy="exact", residency=0.5)
LOGGER = "psr_hf.engine.generate"


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer, calibration = load_shipped(OLMOE_ROUTING_NAME)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    return model, tokenizer, calibration, ids


@contextlib.contextmanager
def _patched(model, policy, calibration=None, attach=True, **kwargs):
    with psr_hf.patched(model, RoutingConfig(**policy), calibration=calibration):
        if attach:
            engine.attach(model, **kwargs)
        try:
            yield psr_hf.controller(model)
        finally:
            engine.detach(model)


def _generate(model, ids, seed=None, **kwargs):
    """generate() from a fresh routing state: (output, recordings, stats)."""
    ctl = psr_hf.controller(model)
    ctl.reset()
    ctl.reset_stats()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad(), ctl.record() as recorder:
        out = model.generate(ids, **kwargs)
    return out, recorder.recordings, ctl.stats()


def _both(model, ids, policy, calibration=None, seed=None, attach_kwargs=None, **kwargs):
    """The same generate() without and with the engine, in the same patch: (hf, engine, attachment)."""
    with _patched(model, policy, calibration, **(attach_kwargs or {})):
        state = engine.attached(model)
        engine.detach(model)
        hf = _generate(model, ids, seed, **kwargs)
        engine.attach(model, **(attach_kwargs or {}))
        state = engine.attached(model)
        ours = _generate(model, ids, seed, **kwargs)
    return hf, ours, state


def _same_routing(a, b) -> None:
    (ra,), (rb,) = a[1], b[1]
    np.testing.assert_array_equal(ra.tokens, rb.tokens)
    np.testing.assert_array_equal(ra.selected, rb.selected)
    sa, sb = a[2], b[2]
    for name in ("tokens", "prefetch_per_token", "demand_per_token", "copies_per_token", "replaced_per_token"):
        assert sa.total[name] == sb.total[name], name
    np.testing.assert_allclose(sa.total["displaced_mass"], sb.total["displaced_mass"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("policy", [PSR, EXACT], ids=["psr", "exact"])
def test_greedy_equals_the_hf_path_with_the_same_routing(shipped, policy):
    model, _, calibration, ids = shipped
    hf, ours, state = _both(model, ids, policy, calibration, max_new_tokens=NEW, do_sample=False)
    assert ours[0].shape[1] == ids.shape[1] + NEW
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert state.served == NEW and state.fallbacks == 0  # the prompt, then every decode step but the last
    assert state.loop_calls == 1  # decoded by the engine's own loop
    _same_routing(hf, ours)
    if policy is PSR:
        assert ours[2].total["replaced_per_token"] > 0


def test_sampling_with_one_seed_draws_the_same_tokens(shipped):
    model, _, calibration, ids = shipped
    hf, ours, state = _both(model, ids, PSR, calibration, seed=1234, max_new_tokens=NEW, do_sample=True, top_k=20)
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert state.served == NEW and state.loop_calls == 1


class _Collect:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


class _StopAfter:
    """A stopping criterion transformers does not know: stop once the sequence has ``length`` tokens."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_the_engine_loop_runs_transformers_processors_criteria_and_streamer(shipped, sample):
    """generate()'s logits processors (repetition penalty, n-gram ban, minimum length, temperature, top-p), a
    stopping criterion of the user's and a streamer: the engine's loop gives what transformers' loop gives."""
    from transformers import StoppingCriteriaList

    model, _, calibration, ids = shipped
    streams = []

    def run(**extra):
        streams.append(_Collect())
        return dict(streamer=streams[-1], **extra)

    kwargs = dict(max_new_tokens=NEW, do_sample=sample, repetition_penalty=1.3, no_repeat_ngram_size=2,
                  min_new_tokens=3, output_scores=True, output_logits=True, return_dict_in_generate=True)
    if sample:
        kwargs.update(temperature=0.7, top_p=0.9)
    stop = ids.shape[1] + NEW - 4
    with _patched(model, PSR, calibration) as _:
        engine.detach(model)
        hf = _generate(model, ids, 7, stopping_criteria=StoppingCriteriaList([_StopAfter(stop)]), **run(**kwargs))
        engine.attach(model)
        state = engine.attached(model)
        ours = _generate(model, ids, 7, stopping_criteria=StoppingCriteriaList([_StopAfter(stop)]), **run(**kwargs))
    assert state.loop_calls == 1
    torch.testing.assert_close(ours[0].sequences, hf[0].sequences, rtol=0, atol=0)
    assert ours[0].sequences.shape[1] == stop
    for field in ("scores", "logits"):
        a, b = getattr(ours[0], field), getattr(hf[0], field)
        assert len(a) == len(b) == stop - ids.shape[1]
        for x, y in zip(a, b):
            finite = torch.isfinite(y)
            assert torch.equal(finite, torch.isfinite(x)) and float((x[finite] - y[finite]).abs().max()) < 1e-4
    assert streams[0].puts == streams[1].puts and streams[0].ended == streams[1].ended == 1
    assert len(streams[1].puts) == 1 + stop - ids.shape[1]  # the prompt, then each new token
    _same_routing(hf, ours)


def test_stop_strings_end_where_transformers_ends(shipped, caplog):
    """Stop strings need generate()'s ``tokenizer``, which transformers does not hand to a decoding loop of one's
    own: transformers' loop runs (logged), the engine serving its forward calls."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    model, tokenizer, calibration, ids = shipped
    hf_free = None
    with _patched(model, EXACT, calibration, attach=False):
        hf_free = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    text = tokenizer.decode(hf_free[0, ids.shape[1] + 3:ids.shape[1] + 5])
    kwargs = dict(max_new_tokens=NEW, do_sample=False, stop_strings=[text.strip() or text], tokenizer=tokenizer)
    hf, ours, state = _both(model, ids, EXACT, calibration, **kwargs)
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert ours[0].shape[1] < ids.shape[1] + NEW and state.loop_calls == 0 and state.fallbacks == 0
    assert any("own loop: argument 'tokenizer'" in r.getMessage() for r in caplog.records if r.name == LOGGER)


def test_scores_and_eos(shipped):
    model, _, calibration, ids = shipped
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True)
    hf, ours, _ = _both(model, ids, PSR, calibration, **kwargs)
    torch.testing.assert_close(ours[0].sequences, hf[0].sequences, rtol=0, atol=0)
    assert len(ours[0].scores) == len(hf[0].scores) == NEW
    for a, b in zip(ours[0].scores, hf[0].scores):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a))
        assert float((a[finite] - b[finite]).abs().max()) < 1e-4
    # stop at the 4th new token, as eos
    eos = int(hf[0].sequences[0, ids.shape[1] + 3])
    first = int((hf[0].sequences[0, ids.shape[1]:] == eos).nonzero()[0])
    hf, ours, _ = _both(model, ids, PSR, calibration, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                        pad_token_id=0)
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert ours[0].shape[1] == ids.shape[1] + first + 1 and int(ours[0][0, -1]) == eos
    # a minimum length holds the end-of-sequence token back (transformers' processor, the engine's own mask)
    hf, ours, state = _both(model, ids, PSR, calibration, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                            pad_token_id=0, min_new_tokens=first + 3)
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert ours[0].shape[1] > ids.shape[1] + first + 1 and state.loop_calls == 1


def test_batch_two_and_beams_fall_back_logging_once(shipped, caplog):
    model, tokenizer, calibration, ids = shipped
    caplog.set_level(logging.INFO, logger=LOGGER)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = torch.cat([ids, torch.cat([torch.full((1, 3), pad), ids[:, :-3]], dim=1)])
    mask = torch.cat([torch.ones_like(ids), torch.cat([torch.zeros(1, 3), torch.ones(1, ids.shape[1] - 3)], 1)
                      ]).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=pad)
    hf, ours, state = _both(model, batch, EXACT, calibration, **kwargs)
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert state.served == 0 and state.fallbacks == 6 and state.loop_calls == 0
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER and "HF path" in r.getMessage()]
    assert len(messages) == 1 and "several rows" in messages[0]
    loops = [r.getMessage() for r in caplog.records if r.name == LOGGER and "own loop" in r.getMessage()]
    assert len(loops) == 1 and "several rows" in loops[0]
    hf, ours, state = _both(model, ids, EXACT, calibration, max_new_tokens=4, do_sample=False, num_beams=2)
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert state.served == 0 and state.fallbacks > 0 and state.loop_calls == 0
    assert any("own loop: generation mode beam_search" in r.getMessage() for r in caplog.records)


def test_past_max_len_continues_on_the_hf_path(shipped):
    model, _, calibration, ids = shipped
    limit = ids.shape[1] + 5
    hf, ours, state = _both(model, ids, EXACT, calibration, attach_kwargs=dict(max_len=limit),
                            max_new_tokens=NEW, do_sample=False)
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert state.served == 1 + 5 and state.fallbacks == NEW - 6  # the prompt and 5 steps fill max_len
    assert state.loop_calls == 0  # the sequence may pass max_len: transformers' loop, whose forwards it serves


def test_detach_and_unpatch_restore_the_forward(shipped):
    model, _, calibration, ids = shipped
    before_patch = vars(model).get("forward")
    with psr_hf.patched(model, RoutingConfig(**EXACT), calibration=calibration):
        patched_forward = vars(model)["forward"]
        engine.attach(model)
        assert model.forward is not patched_forward and engine.attached(model).max_len == min(model.config.max_position_embeddings, 4096)
        with pytest.raises(ValueError, match="already attached"):
            engine.attach(model)
        engine.detach(model)
        assert vars(model)["forward"] is patched_forward and engine.attached(model) is None
        engine.detach(model)  # idempotent
        engine.attach(model, max_len=64)
    # unpatch before detach: the patch's removal restores the model's own forward, the engine is gone
    assert vars(model).get("forward") is before_patch and engine.attached(model) is None
    engine.detach(model)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="patched"):
        engine.attach(model)


def test_tiny_deepseek_v3_greedy():
    model = tiny_model("deepseek_v3")
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    hf, ours, state = _both(model, ids, EXACT, None, attach_kwargs=dict(max_len=64), max_new_tokens=8,
                            do_sample=False, pad_token_id=0)
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert state.served == 8
    _same_routing(hf, ours)


def test_a_returned_cache_passed_to_another_generate_is_refused_or_continued_exactly():
    """generate() with the engine attached returns a cache without tensors. Handed to a second generate(), transformers 5.2x
    replays the sequence from position 0 (which must fail clearly instead of counting the sequence twice), while
    5.17 sends only the new tokens (which the engine continues: the tokens must equal the HF path's)."""
    import psr_hf.engine as engine
    from psr_hf.assets import load_shipped

    model, tokenizer, calibration = load_shipped("olmoe-routing")
    psr_hf.patch(model, psr_hf.RoutingConfig(policy="exact", residency=0.5), calibration=calibration)
    try:
        engine.attach(model)
        ids = tokenizer("It was a truth", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        try:
            again = model.generate(out.sequences, **{cache_keyword(model): output_cache(out)}, max_new_tokens=3,
                                   do_sample=False)
        except RuntimeError as error:
            assert "cannot be passed to another generate" in str(error)
        else:
            engine.detach(model)
            assert torch.equal(again, model.generate(out.sequences, max_new_tokens=3, do_sample=False))
    finally:
        engine.detach(model)
        psr_hf.unpatch(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("policy", [PSR, EXACT], ids=["psr", "exact"])
def test_cuda_graphs_equal_the_hf_path_float32(shipped, policy):
    """On the GPU (CUDA graphs, compiled attention blocks, Triton slot MoE) in float32: the same greedy tokens as
    the patched HF path, scores within 1e-4, the same routing decisions."""
    import copy

    model, _, calibration, ids = shipped
    model = copy.deepcopy(model).to("cuda")
    ids = ids.to("cuda")
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True)
    hf, ours, state = _both(model, ids, policy, calibration, attach_kwargs=dict(max_len=64), **kwargs)
    assert getattr(state.decoder, "graphs", False) and state.decoder.compiled
    assert state.served == NEW and state.fallbacks == 0
    torch.testing.assert_close(ours[0].sequences, hf[0].sequences, rtol=0, atol=0)
    for a, b in zip(ours[0].scores, hf[0].scores):
        finite = torch.isfinite(b)
        assert float((a[finite] - b[finite]).abs().max()) < 1e-4
    _same_routing(hf, ours)


class _NotANumber:
    """A logits processor that breaks the scores."""

    def __call__(self, input_ids, scores):
        return torch.full_like(scores, float("nan"))


def test_sampling_from_broken_scores_raises_as_transformers_does(shipped):
    from transformers import LogitsProcessorList

    model, _, calibration, ids = shipped
    kwargs = dict(max_new_tokens=3, do_sample=True, logits_processor=LogitsProcessorList([_NotANumber()]))
    with _patched(model, EXACT, calibration):
        with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
            model.generate(ids, **kwargs)
        engine.detach(model)
        with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
            model.generate(ids, **kwargs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_the_token_choice_as_a_cuda_graph_draws_the_hf_paths_tokens(shipped, sample, caplog):
    """On the GPU the engine's loop chooses each token by one CUDA graph (the warpers and the minimum length are
    functions of the scores): under one seed it draws the tokens the patched HF path draws, the graph's random
    numbers being the eager calls' (float32)."""
    import copy

    caplog.set_level(logging.DEBUG, logger=LOGGER)
    model, _, calibration, ids = shipped
    model = copy.deepcopy(model).to("cuda")
    ids = ids.to("cuda")
    kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=sample)
    if sample:
        kwargs.update(top_k=20, temperature=0.8, top_p=0.9)
    hf, ours, state = _both(model, ids, PSR, calibration, seed=11, attach_kwargs=dict(max_len=64), **kwargs)
    assert state.loop_calls == 1 and state.decoder.graphs
    captured = [r for r in caplog.records if "token choice captured as a CUDA graph" in r.getMessage()]
    assert len(captured) == 1  # one state of the minimum length: active over every chosen token
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    _same_routing(hf, ours)
    # another call with the same settings (new processor objects) replays the kept graph: the same draws again
    with _patched(model, PSR, calibration, max_len=64):
        again = _generate(model, ids, 11, **kwargs)
        assert len(engine.attached(model).choice_graphs) == 1
        again_too = _generate(model, ids, 11, **kwargs)
        assert len(engine.attached(model).choice_graphs) == 1
    torch.testing.assert_close(again[0], hf[0], rtol=0, atol=0)
    torch.testing.assert_close(again_too[0], hf[0], rtol=0, atol=0)
