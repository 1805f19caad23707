"""Gradient checkpointing whose every checkpointed call carries the routing decisions of its own forward pass.

transformers checkpoints a layer by calling the layer's ``_gradient_checkpointing_func(run, *args)``, and the
backward pass calls ``run`` again to recompute the layer. The routing decisions were made on the host from the
logical cache at the time of the forward pass and cannot be recomputed, so psr_hf wraps that function: the first
call of ``run`` records the layer's decisions into a record of its own, and each later call (the recomputation)
replays them. Each forward pass's layers are recomputed with their own decisions however many forwards run before
one backward, and a record lives exactly as long as the autograd graph that holds its call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"  # transformers' per-module attribute
_ROUTING_MARK = "__psr_hf_routing__"


def checkpointing_modules(model: Any) -> list:
    """The modules of ``model`` that transformers may checkpoint (they carry ``gradient_checkpointing``)."""
    return [module for module in model.modules() if hasattr(module, "gradient_checkpointing")]


def route_checkpoints(modules: Iterable, routing: Any) -> None:
    """Wrap the checkpoint function of each of ``modules`` that has one (set by transformers when checkpointing is
    enabled, again at every enable call) so its calls record and replay ``routing``'s decisions."""
    for module in modules:
        function = vars(module).get(CHECKPOINT_FUNCTION)
        if function is not None and getattr(function, _ROUTING_MARK, None) is not routing:
            setattr(module, CHECKPOINT_FUNCTION, _routed(function, routing))


def unroute_checkpoints(modules: Iterable) -> None:
    """Put back the checkpoint functions :func:`route_checkpoints` wrapped (the latest ones transformers set)."""
    for module in modules:
        function = vars(module).get(CHECKPOINT_FUNCTION)
        if getattr(function, _ROUTING_MARK, None) is not None:
            setattr(module, CHECKPOINT_FUNCTION, function.__wrapped__)


def _routed(function: Callable, routing: Any) -> Callable:
    @functools.wraps(function)
    def checkpoint(run: Callable, *args: Any, **kwargs: Any) -> Any:
        record: dict = {}  # MoE layer -> its decisions in this call's forward
        calls = 0

        def run_routed(*a: Any, **k: Any) -> Any:
            nonlocal calls
            replay = calls > 0
            calls += 1
            with routing.checkpointed(record, replay=replay):
                return run(*a, **k)

        return function(run_routed, *args, **kwargs)

    setattr(checkpoint, _ROUTING_MARK, routing)
    return checkpoint
