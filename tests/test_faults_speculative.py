"""Faults and hostile input in speculative decoding (psr_hf.hf.speculative, psr_hf.engine.speculative) on tiny
random top-4 OLMoE models (CPU, float32).

A BlockConfig whose top_k is not the model's is refused by the harness and the engine, and the model's own gives
exact verification the target's greedy tokens; while a speculative_generate runs in one thread, a plain
``generate()`` of the same patched model in another waits for it and then routes and counts as if it ran alone, and
an unpatched target's calls from another thread pass the block routing untouched; an interrupt inside a
verification block propagates as itself, and the next call works.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import psr_hf
from psr_hf.hf.speculative import speculative_generate
from psr_hf.policy.blocks import BlockConfig
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

TOP_K = 4  # the tiny OLMoE's num_experts_per_tok (16 experts, 3 MoE layers)
EXACT = BlockConfig(mode="exact", pool=8, top_k=TOP_K)
NEW = 16
EOS = 1  # the tiny models' end-of-sequence token (pad 0)


def _model(seed: int = 0, norm_noise: float = 0.0) -> torch.nn.Module:
    """A tiny OLMoE whose experts are redrawn at std 0.2: at the tiny models' 0.02 the experts a position runs barely
    move its logits, so running the wrong experts would go unseen in the tokens."""
    model = tiny_model("olmoe", seed=seed, norm_noise=norm_noise)
    generator = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


@pytest.fixture
def target():
    return _model()


@pytest.fixture(scope="module")
def drafter():
    """The target's weights with noisy norms: it agrees with the target often, not always."""
    return _model(norm_noise=0.1)


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=EOS)
    return out[0, ids.shape[1]:].tolist()


def _speculative(target, drafter, ids, config=EXACT):
    return speculative_generate(target, drafter, ids, config, max_new_tokens=NEW, draft_tokens=4,
                                eos_token_id=EOS).tokens


# ---------------------------------------------------------------------------------------------- the model's top-K
def test_exact_verification_on_a_top_4_model_gives_greedy_tokens_and_another_top_k_is_refused(target, drafter):
    for seed in range(3):
        ids = _prompt(seed)
        assert _speculative(target, drafter, ids) == _greedy(target, ids)
    with pytest.raises(ValueError, match=r"BlockConfig\.top_k \(8\) is not the model's top-K \(4\).*"
                                         r"BlockConfig\(top_k=4\)"):
        _speculative(target, drafter, _prompt(0), BlockConfig(mode="exact", pool=8, top_k=8))


def test_the_engine_refuses_a_block_top_k_other_than_the_models(target, drafter):
    from psr_hf.engine.speculative import SpeculativeEngine

    with pytest.raises(ValueError, match=r"BlockConfig\.top_k \(8\) is not the model's top-K \(4\).*"
                                         r"BlockConfig\(top_k=4\)"):
        SpeculativeEngine(target, drafter, BlockConfig(mode="confidence", pool=8, top_k=8), draft_tokens=4,
                          max_len=64, graphs=False)


# ---------------------------------------------------------------------------------------------- threads
class _PauseOnce:
    """A forward pre-hook on the drafter: its first call (inside speculative_generate, with the target's routing
    taken over) announces itself, waits for the other thread to start, then gives it time to reach the model."""

    def __init__(self, drafter):
        self.inside, self.other_started = threading.Event(), threading.Event()
        self.handle = drafter.register_forward_pre_hook(self._pause)

    def _pause(self, module, args):
        if not self.inside.is_set():
            self.inside.set()
            self.other_started.wait(timeout=30)
            time.sleep(0.5)  # the other thread's generate() reaches the model here, unless it waits for this call


def _race(target, drafter, ids_speculative, ids_plain):
    """A speculative_generate of ``ids_speculative`` in one thread and, while it runs, a plain ``generate()`` of
    ``ids_plain`` in another; ``(speculative tokens, plain tokens)``, or the first error either thread raised."""
    pause = _PauseOnce(drafter)
    results, errors = {}, []

    def speculative():
        try:
            results["speculative"] = _speculative(target, drafter, ids_speculative)
        except BaseException as error:  # noqa: BLE001 - raised in the test's thread below
            errors.append(error)

    def plain():
        try:
            pause.other_started.set()
            results["plain"] = _greedy(target, ids_plain)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    first = threading.Thread(target=speculative)
    first.start()
    try:
        assert pause.inside.wait(timeout=60)
        second = threading.Thread(target=plain)
        second.start()
        second.join(timeout=120)
    finally:
        pause.other_started.set()
        first.join(timeout=120)
        pause.handle.remove()
    if errors:
        raise errors[0]
    return results["speculative"], results["plain"]


def test_a_plain_generate_in_another_thread_waits_and_routes_as_if_alone(target, drafter):
    ids_speculative, ids_plain = _prompt(0), _prompt(1)
    exact = _greedy(target, ids_speculative)
    psr_hf.patch(target, psr_hf.RoutingConfig(policy="psr", residency=0.5))
    try:
        ctl = psr_hf.controller(target)
        alone = _greedy(target, ids_plain)
        alone_stats = dict(ctl.stats().total)
        assert alone_stats["tokens"] > 0 and alone_stats["replaced_per_token"] > 0  # psr steers this generation

        ctl.reset_stats()
        speculative, plain = _race(target, drafter, ids_speculative, ids_plain)
        assert plain == alone
        assert dict(ctl.stats().total) == alone_stats
        assert speculative == exact
    finally:
        psr_hf.unpatch(target)


def test_block_routing_passes_another_threads_calls_of_an_unpatched_target_through(target, drafter):
    ids_speculative, ids_plain = _prompt(0), _prompt(1)
    expected = _greedy(target, ids_speculative), _greedy(target, ids_plain)
    assert _race(target, drafter, ids_speculative, ids_plain) == expected


# ---------------------------------------------------------------------------------------------- interrupts
class _InterruptAt:
    """A forward hook on one decoder layer that raises KeyboardInterrupt at its ``at``-th call (0: the prompt)."""

    def __init__(self, layer, at: int):
        self.at, self.calls = at, 0
        self.handle = layer.register_forward_hook(self._maybe)

    def _maybe(self, module, args, output):
        call, self.calls = self.calls, self.calls + 1
        if call == self.at:
            raise KeyboardInterrupt("injected")


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_an_interrupt_in_a_verification_block_propagates_and_the_next_call_works(target, drafter, patched):
    ids = _prompt(2)
    expected = _greedy(target, ids)
    if patched:
        psr_hf.patch(target, psr_hf.RoutingConfig(policy="psr", residency=0.5))
    try:
        if patched:
            routed = _greedy(target, ids)
            stats = dict(psr_hf.controller(target).stats().total)
        interrupt = _InterruptAt(target.model.layers[1], at=2)  # the second verification block
        caught = None
        try:
            _speculative(target, drafter, ids)
        except BaseException as error:  # noqa: BLE001 - a KeyboardInterrupt must not stop the test session
            caught = error
        finally:
            interrupt.handle.remove()
        assert type(caught) is KeyboardInterrupt, repr(caught)
        assert interrupt.calls == 3
        assert _speculative(target, drafter, ids) == expected
        if patched:  # its own routing is back: a plain generate() routes and counts as before
            psr_hf.controller(target).reset_stats()
            assert _greedy(target, ids) == routed
            assert dict(psr_hf.controller(target).stats().total) == stats
    finally:
        if patched:
            psr_hf.unpatch(target)
