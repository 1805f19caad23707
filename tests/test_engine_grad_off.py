"""psr_hf.engine.grad_off: the engine's per-step calls run with gradients off whatever the caller's mode, and leave
the caller's mode as it was, also when they raise."""

from __future__ import annotations

import pytest
import torch

from psr_hf.engine.grad_off import grad_off


@grad_off
def _mode_inside(fail: bool = False) -> bool:
    if fail:
        raise ValueError("inside")
    return torch.is_grad_enabled()


@pytest.mark.parametrize("caller_grad", [True, False])
def test_the_call_runs_without_gradients_and_restores_the_callers_mode(caller_grad):
    with torch.set_grad_enabled(caller_grad):
        assert _mode_inside() is False
        assert torch.is_grad_enabled() is caller_grad
        with pytest.raises(ValueError, match="inside"):
            _mode_inside(fail=True)
        assert torch.is_grad_enabled() is caller_grad


def test_a_tensor_computed_inside_has_no_graph():
    w = torch.ones(2, requires_grad=True)
    assert grad_off(lambda: w * 2)().requires_grad is False
    assert _mode_inside.__name__ == "_mode_inside"
