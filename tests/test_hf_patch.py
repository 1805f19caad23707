"""The HuggingFace integration on tiny random models of every supported family (CPU, offline, float32).

Exact routing is bitwise the unpatched model; rows, padding and finished rows never touch another row's (or their
own) state; recordings replay to the live selections; beam search carries the per-row state with the KV cache;
execution weights are the model's own router weights for the executed experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.hf.inputs import cache_keyword, output_cache
from psr_hf.testing import FAMILIES, tiny_model
from psr_hf.patches import get_patch
from psr_hf.policy.calibration import Calibration, CalibrationBuilder

PAD = 0  # the tiny models' pad token (eos = 1, bos = 2)
NEW = 6  # tokens generated per call
RESIDENCY = 0.5  # 8 of 16 experts per layer



pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")


# ---------------------------------------------------------------------------------------------- inputs
def _tokens(seed: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=generator)  # no pad / eos / bos among them


LONG = _tokens(1, 8)  # row 0 of the padded batch
SHORT = _tokens(2, 5)  # row 1, left-padded to 8
OTHER = _tokens(3, 8)  # replaces row 1 where rows are compared
LEFT_IDS = torch.stack([LONG, torch.cat([torch.full((3,), PAD), SHORT])])  # [2, 8]
LEFT_MASK = torch.tensor([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]])  # [2, 8]


def _generate(model, ids: torch.Tensor, mask: torch.Tensor | None = None, new: int = NEW, **kwargs) -> torch.Tensor:
    if ids.ndim == 1:
        ids = ids[None]
    if mask is not None:
        kwargs["attention_mask"] = mask
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=PAD, **kwargs)


def _logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    if ids.ndim == 1:
        ids = ids[None]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _record(model, run) -> list:
    """``run()`` under a recorder of the patched ``model``; the recordings of every (sequence, row)."""
    with psr_hf.controller(model).record() as recorder:
        run()
    return recorder.recordings


def _assert_same_decisions(actual, expected, length: int | None = None) -> None:
    """Recordings agree on tokens and selected experts (scores up to float noise) over the first ``length``."""
    n = expected.num_tokens if length is None else length
    assert actual.num_tokens >= n
    np.testing.assert_array_equal(actual.tokens[:n], expected.tokens[:n])
    np.testing.assert_array_equal(actual.selected[:n], expected.selected[:n])
    np.testing.assert_allclose(actual.scores[:n], expected.scores[:n], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(actual.pregate[:n], expected.pregate[:n], rtol=1e-4, atol=1e-4)


def _assert_identical(actual, expected) -> None:
    for name in ("tokens", "selected", "scores", "pregate"):
        np.testing.assert_array_equal(getattr(actual, name), getattr(expected, name), err_msg=name)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", params=FAMILIES)
def shared(request):
    """One tiny model per family for the whole module. eos is switched off so that every row generates
    ``NEW`` tokens under every policy (the finished-rows test sets its own eos)."""
    model = tiny_model(request.param)
    model.generation_config.eos_token_id = None
    return request.param, model


@pytest.fixture
def family(shared) -> str:
    return shared[0]


@pytest.fixture
def model(shared):
    """The family's shared model, unpatched again after the test whatever happened."""
    model = shared[1]
    yield model
    try:
        psr_hf.unpatch(model)
    except ValueError:
        pass  # not patched


@dataclass(frozen=True)
class Reference:
    single_logits: torch.Tensor
    batch_logits: torch.Tensor
    single_tokens: torch.Tensor
    batch_tokens: torch.Tensor


@pytest.fixture(scope="module")
def reference(shared) -> Reference:
    """The unpatched model's outputs on the shared inputs."""
    model = shared[1]
    return Reference(
        single_logits=_logits(model, LONG),
        batch_logits=_logits(model, LEFT_IDS, LEFT_MASK),
        single_tokens=_generate(model, LONG),
        batch_tokens=_generate(model, LEFT_IDS, LEFT_MASK),
    )


def _score_range(scores: np.ndarray) -> np.ndarray:
    """``max z - min z`` over the finite entries, per (token, layer): ``[T, L, E] -> [T, L]``."""
    finite = np.isfinite(scores)
    high = np.where(finite, scores, -np.inf).max(axis=-1)
    low = np.where(finite, scores, np.inf).min(axis=-1)
    return (high - low).astype(np.float64)


@pytest.fixture(scope="module")
def calibration(shared) -> Calibration:
    """A calibration of the family's model from a recording of exact routing on held-out prompts."""
    model = shared[1]
    prompts = torch.stack([_tokens(seed, 8) for seed in (10, 11, 12)])
    with psr_hf.patched(model, RoutingConfig(policy="exact", residency=RESIDENCY)):
        ctl = psr_hf.controller(model)
        recordings = _record(model, lambda: _generate(model, prompts))
        builder = CalibrationBuilder(ctl.num_layers, ctl.num_experts, vocab_size=256, top_k=ctl.top_k)
    for recording in recordings:
        builder.add(recording.tokens, recording.selected, _score_range(recording.scores))
    return builder.build()


# ---------------------------------------------------------------------------------------------- exact routing
@pytest.mark.parametrize("budget", [0, 1])
@pytest.mark.parametrize("eviction", ["lru", "score"])
def test_exact_routing_is_bitwise_the_unpatched_model(model, reference, eviction, budget):
    config = RoutingConfig(policy="exact", residency=RESIDENCY, eviction=eviction, budget=budget)
    with psr_hf.patched(model, config):
        single_logits = _logits(model, LONG)
        batch_logits = _logits(model, LEFT_IDS, LEFT_MASK)
        single_tokens = _generate(model, LONG)
        batch_tokens = _generate(model, LEFT_IDS, LEFT_MASK)
        totals = psr_hf.controller(model).stats().total
    assert torch.equal(single_logits, reference.single_logits)
    assert torch.equal(batch_logits, reference.batch_logits)
    assert torch.equal(single_tokens, reference.single_tokens)
    assert torch.equal(batch_tokens, reference.batch_tokens)
    # the logical cache did run (and, with a budget, prefetched) while the outputs stayed exact
    assert totals["tokens"] > 0 and totals["replaced_per_token"] == 0
    assert (totals["prefetch_per_token"] > 0) == (budget > 0)

    # and after unpatch
    assert torch.equal(_logits(model, LONG), reference.single_logits)
    assert torch.equal(_logits(model, LEFT_IDS, LEFT_MASK), reference.batch_logits)
    assert torch.equal(_generate(model, LEFT_IDS, LEFT_MASK), reference.batch_tokens)


def test_unpatch_after_a_biased_policy_restores_the_unpatched_model(model, reference):
    with psr_hf.patched(model, RoutingConfig(policy="psr", residency=RESIDENCY)):
        _generate(model, LEFT_IDS, LEFT_MASK)
        assert psr_hf.controller(model).stats().total["replaced_per_token"] > 0  # outputs did change here
    assert torch.equal(_logits(model, LEFT_IDS, LEFT_MASK), reference.batch_logits)
    assert torch.equal(_generate(model, LONG), reference.single_tokens)


def test_bypassed_runs_the_models_own_routing_and_leaves_the_state_alone(model, reference):
    with psr_hf.patched(model, RoutingConfig(policy="psr", residency=RESIDENCY)):
        ctl = psr_hf.controller(model)
        _logits(model, LONG)  # a sequence in progress
        state, counters = ctl.cache.state.copy(), ctl.cache.counters.copy()
        with ctl.bypassed(), ctl.record() as recorder:
            logits = _logits(model, LEFT_IDS, LEFT_MASK)
        np.testing.assert_array_equal(ctl.cache.state, state)
        np.testing.assert_array_equal(ctl.cache.counters, counters)
    assert torch.equal(logits, reference.batch_logits)
    assert recorder.recordings == []


def test_reset_returns_every_row_to_the_calibrated_warm_set(model, calibration):
    with psr_hf.patched(model, RoutingConfig(policy="psr", residency=RESIDENCY), calibration=calibration):
        ctl = psr_hf.controller(model)
        _generate(model, LEFT_IDS, LEFT_MASK)
        assert ctl.cache.rows == 2 and ctl.stats().tokens.tolist() == [8 + NEW - 1, 5 + NEW - 1]
        moved = [not np.array_equal(ctl.cache.resident(layer, row), calibration.warm_set(layer, ctl.capacity))
                 for layer in range(ctl.num_layers) for row in range(2)]
        assert any(moved)
        ctl.reset()
        assert ctl.stats().tokens.tolist() == [0, 0]
        for layer in range(ctl.num_layers):
            for row in range(2):
                np.testing.assert_array_equal(ctl.cache.resident(layer, row),
                                              calibration.warm_set(layer, ctl.capacity))


# ---------------------------------------------------------------------------------------------- rows
@pytest.mark.parametrize("policy", ["psr", "cache_prior", "spec"])
def test_each_row_of_a_padded_batch_decides_as_the_row_alone(model, policy):
    with psr_hf.patched(model, RoutingConfig(policy=policy, residency=RESIDENCY)):
        batch = _record(model, lambda: _generate(model, LEFT_IDS, LEFT_MASK))
        alone = _record(model, lambda: (_generate(model, LONG), _generate(model, SHORT)))
        replaced = psr_hf.controller(model).stats().total["replaced_per_token"]
    assert replaced > 0  # the policy did change selections, so the state mattered
    assert [r.num_tokens for r in batch] == [8 + NEW - 1, 5 + NEW - 1]  # padding is not recorded
    assert [(r.sequence, r.row) for r in batch] == [(0, 0), (0, 1)]
    _assert_same_decisions(batch[0], alone[0])
    _assert_same_decisions(batch[1], alone[1])


def test_generating_the_same_prompt_twice_repeats_tokens_and_recordings(model):
    with psr_hf.patched(model, RoutingConfig(policy="psr", residency=RESIDENCY)):
        ctl = psr_hf.controller(model)
        recordings = []
        outputs, tokens = [], []
        for _ in range(2):
            recordings += _record(model, lambda: outputs.append(_generate(model, LEFT_IDS, LEFT_MASK)))
            tokens.append(ctl.stats().tokens.copy())
    assert torch.equal(outputs[0], outputs[1])
    np.testing.assert_array_equal(tokens[0], tokens[1])
    first, second = recordings[:2], recordings[2:]
    for a, b in zip(first, second):
        _assert_identical(a, b)


def test_changing_the_second_row_leaves_the_first_rows_decisions_unchanged(model):
    with psr_hf.patched(model, RoutingConfig(policy="psr", residency=RESIDENCY)):
        ctl = psr_hf.controller(model)
        with_other = []
        recordings = _record(model, lambda: with_other.append(_generate(model, torch.stack([LONG, OTHER]))))
        state_other = ctl.cache.state[:, 0].copy()
        with_padded = []
        recordings += _record(model, lambda: with_padded.append(_generate(model, LEFT_IDS, LEFT_MASK)))
        state_padded = ctl.cache.state[:, 0].copy()
    assert not torch.equal(with_other[0][1], with_padded[0][1])  # the second rows did differ
    assert torch.equal(with_other[0][0], with_padded[0][0])
    _assert_same_decisions(recordings[0], recordings[2])
    np.testing.assert_array_equal(state_other, state_padded)


# ---------------------------------------------------------------------------------------------- replay
REPLAY_POLICIES = {
    "exact-budget1": dict(policy="exact", budget=1),
    "cache_prior": dict(policy="cache_prior"),
    "psr-score": dict(policy="psr", eviction="score"),
    "psr-lru": dict(policy="psr", eviction="lru"),
    "spec": dict(policy="spec"),
    "psr-distance2": dict(policy="psr", eviction="score", prefetch_distance=2),
}


@pytest.mark.parametrize("calibrated", [False, True], ids=["uncalibrated", "calibrated"])
@pytest.mark.parametrize("policy", list(REPLAY_POLICIES))
def test_replay_of_a_recording_equals_the_live_selections(model, calibration, policy, calibrated):
    config = RoutingConfig(residency=RESIDENCY, **REPLAY_POLICIES[policy])
    calibration = calibration if calibrated else None
    with psr_hf.patched(model, config, calibration=calibration):
        ctl = psr_hf.controller(model)
        recordings = _record(model, lambda: _generate(model, LEFT_IDS, LEFT_MASK))
        counts = ctl.cache.stats()
    assert len(recordings) == 2
    for recording in recordings:
        result = psr_hf.replay(config, recording, calibration=calibration)
        np.testing.assert_array_equal(result.selected, recording.selected)
        # the copies the live run counted for this row are the replay's
        assert result.prefetch_copies.sum() == counts.prefetch[:, recording.row].sum()
        assert result.demand_copies.sum() == counts.demand[:, recording.row].sum()
        assert result.replaced.sum() == counts.replaced[:, recording.row].sum()


def test_prefetch_distance_ranks_a_layer_from_the_router_input_that_many_layers_earlier(model):
    """prefetch_distance D: the pre-gate recorded at layer l is router l's selection scores on layer l - D's router
    input (captured in the same run), and D changes the decisions (the option is not ignored)."""
    recorded = {}
    for distance in (1, 2):
        config = RoutingConfig(policy="psr", residency=RESIDENCY, budget=2, prefetch_distance=distance)
        with psr_hf.patched(model, config):
            ctl = psr_hf.controller(model)
            inputs = {layer.index: [] for layer in ctl.layers}
            hooks = [layer.router.register_forward_pre_hook(
                lambda module, args, index=layer.index: inputs[index].append(args[0].detach().reshape(
                    -1, args[0].shape[-1]))) for layer in ctl.layers]
            try:
                recording = _record(model, lambda: _generate(model, LONG))[0]
            finally:
                for hook in hooks:
                    hook.remove()
            routers, family = [layer.router for layer in ctl.layers], ctl.routing.family
        recorded[distance] = recording
        with torch.no_grad():
            for l in range(distance, len(routers)):
                hidden = torch.cat(inputs[l - distance])[:recording.num_tokens]
                want = family.selection_scores(routers[l], torch.nn.functional.linear(hidden, routers[l].weight))
                np.testing.assert_allclose(recording.pregate[:, l], want.float().numpy(), rtol=1e-5, atol=1e-5,
                                           err_msg=f"D={distance}, layer {l}")
        assert psr_hf.replay(config, recording).selected.tolist() == recording.selected.tolist()
    assert recorded[1].selected.tolist() != recorded[2].selected.tolist()


def test_a_calibration_changes_the_decisions(model, calibration):
    # guards the calibrated replay test against a calibration that is silently ignored
    config = RoutingConfig(policy="psr", residency=RESIDENCY)
    with psr_hf.patched(model, config, calibration=calibration):
        calibrated = _record(model, lambda: _generate(model, LONG))[0]
    uncalibrated = psr_hf.replay(config, calibrated)
    assert not np.array_equal(uncalibrated.selected, calibrated.selected)


# ---------------------------------------------------------------------------------------------- beam search
def test_beam_search_state_follows_the_cache_reordering(model, monkeypatch):
    config = RoutingConfig(policy="psr", residency=RESIDENCY)
    with psr_hf.patched(model, config):
        ctl = psr_hf.controller(model)
        reorders = []
        reorder = ctl.reorder

        def spy(index):
            reorders.append(np.asarray(index).tolist())
            reorder(index)

        monkeypatch.setattr(ctl, "reorder", spy)
        out = []
        recordings = _record(model, lambda: out.append(
            _generate(model, LONG, num_beams=2, num_return_sequences=2)))
        replaced = ctl.stats().total["replaced_per_token"]
        monkeypatch.undo()
        # the same token histories, each run afresh as one prompt: the recorded (beam) decisions must be these
        forced = _record(model, lambda: [_logits(model, torch.from_numpy(r.tokens)) for r in recordings])
    sequences = out[0]
    assert sequences.shape == (2, 8 + NEW)
    assert replaced > 0
    # once per step; after the prompt both beams continue the first row (the rows are expanded copies)
    assert len(reorders) == NEW and reorders[0] == [0, 0]
    assert len(recordings) == 2
    for recording, teacher_forced in zip(recordings, forced):
        assert recording.num_tokens == 8 + NEW - 1
        np.testing.assert_array_equal(recording.tokens[:8], LONG.numpy())
        # the recorded row's scores belong to its own token history (rows moved with the KV cache) ...
        _assert_same_decisions(recording, teacher_forced)
        # ... and its selections were made by the state of that history (the state moved with the rows)
        np.testing.assert_array_equal(psr_hf.replay(config, recording).selected, recording.selected)


# ---------------------------------------------------------------------------------------------- weights
def _router_weights_reference(family: str, router, logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """ALGORITHM.md step 6, written out per family: the model's own router weights of the experts ``selected``."""
    if family == "deepseek_v3":
        weights = logits.float().sigmoid().gather(1, selected)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    weights = torch.softmax(logits.float(), dim=-1).gather(1, selected)
    normalise = True if family.startswith("qwen3_5_moe") else router.norm_topk_prob  # Qwen3.5 always renormalises
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _first_router(model, family):
    patch = get_patch(model.config.model_type)(model)
    return patch, patch.moe_layers()[0].router


def test_execution_weights_equal_the_routers_own_weights(model, family):
    patch, router = _first_router(model, family)
    hidden = torch.randn(16, router.weight.shape[1], generator=torch.Generator().manual_seed(0))
    configured = getattr(router, "norm_topk_prob", None)  # None: the router always renormalises (Qwen3.5)
    try:
        for norm_topk_prob in ([configured] if configured is None else [False, True]):
            if norm_topk_prob is not None:
                router.norm_topk_prob = norm_topk_prob
            with torch.no_grad():
                logits, weights, indices = router(hidden)
                # the router's own top-K: bitwise, in the router's order
                assert torch.equal(patch.execution_weights(router, logits, indices), weights)
                # in another order: the same weights, permuted
                order = torch.argsort(indices, dim=-1)
                permuted = patch.execution_weights(router, logits, indices.gather(1, order))
                torch.testing.assert_close(permuted, weights.gather(1, order), rtol=1e-6, atol=0)
                # a random set of experts, mostly outside the router's top-K: ALGORITHM.md step 6 written out
                generator = torch.Generator().manual_seed(1)
                forced = torch.stack([torch.randperm(router.weight.shape[0], generator=generator)[: router.top_k]
                                      for _ in range(hidden.shape[0])])
                assert sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(forced, indices)) > 8
                expected = _router_weights_reference(family, router, logits, forced)
                torch.testing.assert_close(patch.execution_weights(router, logits, forced), expected,
                                           rtol=1e-6, atol=1e-7)
    finally:
        if configured is not None:
            router.norm_topk_prob = configured


def test_deepseek_weights_of_a_forced_set_equal_the_router_forced_to_that_set():
    """DeepSeek's correction bias steers selection without touching the weights, so the router itself can be
    made to pick any set: its weights for that set must be the execution weights of the set."""
    model = tiny_model("deepseek_v3")
    patch, router = _first_router(model, "deepseek_v3")
    forced_set = torch.tensor([1, 3, 5, 6])  # within 2 of the 4 groups of 4, so group-limited routing keeps it
    with torch.no_grad():
        router.e_score_correction_bias.fill_(-5.0)
        router.e_score_correction_bias[forced_set] = 5.0
        hidden = torch.randn(16, router.weight.shape[1], generator=torch.Generator().manual_seed(0))
        logits, weights, indices = router(hidden)
        assert all(set(row.tolist()) == set(forced_set.tolist()) for row in indices)
        assert torch.equal(patch.execution_weights(router, logits, indices), weights)
        ascending = patch.execution_weights(router, logits, forced_set.expand(16, 4))
        torch.testing.assert_close(ascending, weights.gather(1, torch.argsort(indices, dim=-1)), rtol=1e-6, atol=0)


def test_executed_experts_run_with_the_routers_weights_of_the_selected_set(model, family):
    """End to end: what the experts module receives is the selection with its unmodified-score weights."""
    with psr_hf.patched(model, RoutingConfig(policy="psr", residency=RESIDENCY)):
        ctl = psr_hf.controller(model)
        seen = {}

        def capture(layer):
            def router_hook(module, args, output):
                seen.setdefault(layer, {})["logits"] = output[0].detach()

            def experts_hook(module, args):
                seen[layer]["indices"], seen[layer]["weights"] = args[1].detach(), args[2].detach()

            return router_hook, experts_hook

        handles = []
        for layer in ctl.layers:
            router_hook, experts_hook = capture(layer.index)
            handles.append(layer.router.register_forward_hook(router_hook))
            handles.append(layer.block.experts.register_forward_pre_hook(experts_hook))
        try:
            _logits(model, LEFT_IDS, LEFT_MASK)
        finally:
            for handle in handles:
                handle.remove()
        replaced = 0
        for layer in ctl.layers:
            logits, indices, weights = (seen[layer.index][k] for k in ("logits", "indices", "weights"))
            own = torch.topk(ctl.family.selection_scores(layer.router, logits), ctl.top_k, dim=-1).indices
            replaced += sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(own, indices))
            expected = _router_weights_reference(family, layer.router, logits, indices)
            torch.testing.assert_close(weights.float(), expected, rtol=1e-6, atol=1e-7)
        assert replaced > 0


# ---------------------------------------------------------------------------------------------- padding
def test_right_padding_without_a_mask_does_not_change_the_real_positions(model):
    """lm-eval's loglikelihood batches: right padding, no attention mask."""
    right = torch.stack([LONG, torch.cat([SHORT, torch.full((3,), PAD)])])
    with psr_hf.patched(model, RoutingConfig(policy="psr", residency=RESIDENCY)):
        batch = _record(model, lambda: _logits(model, right))
        alone = _record(model, lambda: _logits(model, SHORT))[0]
    assert batch[1].num_tokens == 8  # without a mask every position counts as a token ...
    _assert_same_decisions(batch[1], alone, length=5)  # ... but the real ones come first and decide alone


@pytest.mark.parametrize("policy", ["psr", "spec", "cache_prior"])
def test_padded_positions_do_not_change_state(model, policy):
    with psr_hf.patched(model, RoutingConfig(policy=policy, residency=RESIDENCY)):
        ctl = psr_hf.controller(model)
        _logits(model, LEFT_IDS, LEFT_MASK)
        padded_state, padded_counters = ctl.cache.state[:, 1].copy(), ctl.cache.counters[:, 1].copy()
        padded_tokens = ctl.stats().tokens[1]
        _logits(model, SHORT)
        state, counters = ctl.cache.state[:, 0].copy(), ctl.cache.counters[:, 0].copy()
        tokens = ctl.stats().tokens[0]
    assert padded_tokens == tokens == 5
    np.testing.assert_array_equal(padded_state, state)  # resident sets, statistics, last use
    np.testing.assert_allclose(padded_counters, counters, rtol=1e-5)  # the running score range is a float sum


# ---------------------------------------------------------------------------------------------- finished rows
def _eos_for_the_first_row(generated: torch.Tensor) -> tuple[int, int]:
    """``(j, token)``: a token that row 0 of ``generated`` ``[2, T]`` first produces at step ``j >= 1`` and row 1
    never does, to serve as the end-of-sequence token that stops row 0 alone."""
    candidates = [(j, int(t)) for j, t in enumerate(generated[0].tolist())
                  if j >= 1 and int(t) not in generated[0, :j].tolist() and int(t) not in generated[1].tolist()]
    assert candidates, "no usable eos candidate: change the prompts"
    return candidates[0]


@pytest.mark.parametrize("eos_from", ["argument", "generation_config"])
def test_rows_that_finished_stop_changing_their_state(model, eos_from, monkeypatch):
    config = RoutingConfig(policy="psr", residency=RESIDENCY)
    prompts = torch.stack([LONG, OTHER])
    new = 8
    with psr_hf.patched(model, config):
        ctl = psr_hf.controller(model)
        free = _generate(model, prompts, new=new)[:, 8:]  # no eos: every row runs to the end
        j, eos = _eos_for_the_first_row(free)
        kwargs = {}
        if eos_from == "argument":
            kwargs["eos_token_id"] = eos
        else:
            monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
        recordings = _record(model, lambda: _generate(model, prompts, new=new, **kwargs))
        tokens = ctl.stats().tokens.copy()
        finished_state = ctl.cache.state[:, 0].copy()
        # row 0 alone, stopped by length right after the step that generated the eos
        _generate(model, LONG, new=j + 1)
        stopped_state = ctl.cache.state[:, 0].copy()
    row0, row1 = recordings
    # the eos was fed back once, then padding: neither was recorded nor counted
    np.testing.assert_array_equal(row0.tokens, np.concatenate([LONG.numpy(), free[0, :j].numpy()]))
    np.testing.assert_array_equal(row1.tokens, np.concatenate([OTHER.numpy(), free[1, : new - 1].numpy()]))
    np.testing.assert_array_equal(tokens, [8 + j, 8 + new - 1])
    np.testing.assert_array_equal(finished_state, stopped_state)



def test_a_generate_call_continuing_a_cached_sequence_routes_its_whole_prompt(model):
    """A chat turn continues the KV cache of the previous generate() call: its prompt holds eos ids (end of the
    previous turns), and a row that finished in the previous call runs again."""
    config = RoutingConfig(policy="psr", residency=RESIDENCY)
    prompts = torch.stack([LONG, OTHER])
    new = 8
    with psr_hf.patched(model, config):
        ctl = psr_hf.controller(model)
        j, eos = _eos_for_the_first_row(_generate(model, prompts, new=new)[:, 8:])
        turn = torch.tensor([[50, eos, 60], [70, eos, 80]])
        options = dict(do_sample=False, pad_token_id=PAD, eos_token_id=eos)
        with torch.no_grad(), ctl.record() as recorder:
            first = model.generate(prompts, max_new_tokens=new, return_dict_in_generate=True, **options)
            history = torch.cat([first.sequences, turn], dim=1)  # [2, 8 + new + 3]
            mask = torch.ones_like(history)
            mask[0, 8 + j : 8 + new] = 0  # row 0's eos and padding from the first call
            second = model.generate(history, attention_mask=mask, **{cache_keyword(model): output_cache(first)},
                                    max_new_tokens=3, **options)
        tokens = ctl.stats().tokens.tolist()
        # row 1 never finished: its whole history as one prompt must decide as the two calls did
        forced = _record(model, lambda: _logits(model, second[1, :-1]))[0]
    row0, row1 = recorder.recordings
    assert second.shape[1] == 8 + new + 3 + 3 and eos not in second[:, 8 + new + 3 :].tolist()
    np.testing.assert_array_equal(row1.tokens, second[1, :-1].numpy())
    _assert_same_decisions(row1, forced)
    # row 0: the first call up to its eos, then the whole new turn and what it generated
    expected = torch.cat([LONG, first.sequences[0, 8 : 8 + j], second[0, 8 + new : -1]])
    np.testing.assert_array_equal(row0.tokens, expected.numpy())
    assert tokens == [row0.num_tokens, row1.num_tokens]
