"""The controller's decode handle, the engine's step API: one handle per controller; a step holds the controller's
lock as a forward pass does; row 0's state lent to a device decoder comes back before anything reads or changes it,
and a borrower that decoded further continues the sequence from there. The Controller itself keeps the user API and
the sequence state machine: the steps are the handle's, the installed callables the installer's."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import psr_hf
from psr_hf import RoutingConfig
from psr_hf.hf.controller import Controller
from psr_hf.hf.decode_handle import DecodeHandle
from psr_hf.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "quiet_psr_hf")

CONFIG = RoutingConfig(policy="psr", lam=0.3, budget=1, residency=0.5)


@pytest.fixture(scope="module")
def model():
    return tiny_model("olmoe")


@pytest.fixture
def ctl(model):
    with psr_hf.patched(model, CONFIG):
        yield psr_hf.controller(model)


def _step(handle: DecodeHandle, ctl: Controller, token: int, position: int) -> None:
    """One decode step through the handle, with seeded scores for every MoE layer."""
    rng = np.random.default_rng(position)
    with handle.step(token, position):
        for layer in range(ctl.num_layers):
            last = layer + 1 == ctl.num_layers
            scores = rng.standard_normal(ctl.num_experts).astype(np.float32)
            pregate = None if last else rng.standard_normal(ctl.num_experts).astype(np.float32)
            handle.select(layer, scores, pregate if handle.needs_pregate else None)
            if not last and handle.needs_pregate:
                handle.prefetch(layer + 1)


class Borrower:
    """A device decoder's stand-in: counts how often the state came back, and says how far it decoded."""

    def __init__(self, handle: DecodeHandle, decoded_to: int | None = None):
        self.handle, self.decoded_to, self.returned = handle, decoded_to, 0

    def return_state(self) -> None:
        self.returned += 1
        if self.decoded_to is not None:
            self.handle.continue_sequence(self.decoded_to)


def test_the_controller_hands_out_one_handle_and_keeps_the_user_api(ctl):
    assert isinstance(ctl.decode_handle(), DecodeHandle) and ctl.decode_handle() is ctl.decode_handle()
    public = {name for name in dir(Controller) if not name.startswith("_")}
    assert public == {"predictor", "gate", "offload", "forward_pass", "recording", "decode_handle", "reset",
                      "refresh_experts", "reset_stats", "reconfigure", "memory", "stats", "record", "right_padded",
                      "bypassed", "discard_sequence", "reorder"}


@pytest.mark.parametrize("take_back", ["stats", "reset", "forward", "record", "step"])
def test_a_lent_state_comes_back_before_anything_reads_or_changes_it(ctl, model, take_back):
    handle = ctl.decode_handle()
    _step(handle, ctl, 5, 0)
    borrower = Borrower(handle)
    handle.lend_state(borrower)
    assert handle.lent is borrower and borrower.returned == 0
    if take_back == "forward":
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6]]))
    elif take_back == "record":
        ctl.record().stop()
    elif take_back == "step":
        _step(handle, ctl, 6, 1)
    else:
        getattr(ctl, take_back)()
    assert handle.lent is None and borrower.returned == 1
    ctl.stats()
    assert borrower.returned == 1  # taken back once


def test_a_borrower_that_decoded_further_continues_the_sequence_from_there(ctl):
    handle = ctl.decode_handle()
    _step(handle, ctl, 5, 0)
    _step(handle, ctl, 6, 1)
    with pytest.raises(RuntimeError, match="routing state belongs to a sequence of 2 positions"):
        _step(handle, ctl, 7, 4)
    ctl.reset()
    _step(handle, ctl, 5, 0)
    _step(handle, ctl, 6, 1)
    handle.lend_state(Borrower(handle, decoded_to=4))  # the device decoded positions 2 and 3
    _step(handle, ctl, 7, 4)
    assert handle.lent is None


def test_lending_inside_an_open_step_raises_and_nothing_is_lent(ctl):
    handle = ctl.decode_handle()
    with handle.step(5, 0):
        with pytest.raises(RuntimeError, match=r"lend_state\(\) while a forward pass"):
            handle.lend_state(Borrower(handle))
    assert handle.lent is None


def test_a_step_holds_the_controllers_lock_and_a_refused_step_releases_it(ctl):
    handle = ctl.decode_handle()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ctl.stats(), done.set()))
    handle.begin_step(5, 0)
    try:
        with handle.holding():  # the same thread nests
            waiter.start()
            assert not done.wait(0.2)  # another thread waits for the step
    finally:
        handle.end_step()
    assert done.wait(10)
    waiter.join()
    with pytest.raises(ValueError, match="position must be >= 0"):
        handle.begin_step(5, -1)
    with ctl.bypassed(), pytest.raises(RuntimeError, match=r"begin_step\(\) inside bypassed\(\)"):
        handle.begin_step(5, 0)
    with pytest.raises(RuntimeError, match=r"end_step\(\) outside a step opened by begin_step\(\)"):
        handle.end_step()
    other = threading.Thread(target=ctl.stats)  # every refusal released the lock
    other.start()
    other.join(10)
    assert not other.is_alive()
