"""``torch.no_grad()`` for the engine's per-step calls at no cost where gradients are already off.

A step runs on the host's path between two tokens, whose time the engine's goals count in microseconds; the
``@torch.no_grad()`` decorator saves and restores the grad mode on every call (about 1.8 us), even inside
``generate()`` or a benchmark, which turn gradients off once for the whole loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def grad_off(fn: F) -> F:
    """``fn`` with gradients off: called as it is where they are off already, else inside ``torch.no_grad()``."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
