"""What the callables installed on a patched model do: :class:`WrappedCalls`.

The :class:`~.installer.Installer` replaces each MoE router's forward and wraps the forward of the model and of its
decoder, ``generate()``, ``_get_stopping_criteria()`` and ``_reorder_cache()`` with the callables made here. Each
keeps the original's name, docstring and signature (``functools.wraps``) and runs its call through the controller's
sequence state machine: a forward pass is opened before the original runs and closed however it ends, holding the
controller's lock; ``generate()`` tells the controller its stop tokens and prompt length; a router forward is
routed by the controller's :class:`~.routing.LayerRouting`.
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import inputs
from .checkpointing import route_checkpoints
from .routing import in_backward

if TYPE_CHECKING:
    from ..patches.base import MoELayer
    from .controller import Controller


class WrappedCalls:
    """The callables installed on ``controller``'s model, and what each of them runs."""

    def __init__(self, controller: Controller):
        self.controller = controller
        self.checkpointing: list[torch.nn.Module] = []  # the modules transformers may checkpoint (the installer's)

    # ------------------------------------------------------------------ the wrappers
    def wrap_forward(self, module: torch.nn.Module, original: Callable) -> Callable:
        """The forward that replaces ``module``'s (the model's or its decoder's; ``original`` bound)."""

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.run_forward(module, original, args, kwargs)

        return forward

    def wrap_generate(self, original: Callable) -> Callable:
        """The model's ``generate`` that also tells the controller the stop tokens and the prompt length."""

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            return self.run_generate(original, args, kwargs)

        return generate

    def wrap_stopping_criteria(self, original: Callable) -> Callable:
        """The model's ``_get_stopping_criteria`` whose list also tells the controller which rows each step stopped
        (stop strings, lm-eval's ``until``, any custom criterion), so the pad tokens generate() feeds a stopped row
        afterwards never touch its routing state or statistics."""
        from transformers import StoppingCriteriaList

        ctl = self.controller

        class RowStops(StoppingCriteriaList):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                done = super().__call__(input_ids, scores, **kwargs)
                ctl._rows.stopped(done)
                return done

            def __deepcopy__(self, memo: dict) -> StoppingCriteriaList:  # a plain list: the controller is not copied
                return StoppingCriteriaList(copy.deepcopy(list(self), memo))

        @functools.wraps(original)
        def get_stopping_criteria(*args: Any, **kwargs: Any) -> Any:
            criteria = original(*args, **kwargs)
            return RowStops(criteria) if isinstance(criteria, StoppingCriteriaList) else criteria

        return get_stopping_criteria

    def wrap_reorder_cache(self, original: Callable | None) -> Callable:
        """The model's ``_reorder_cache`` (None: it has none, and the KV cache reorders itself) that also reorders
        the per-row state like the KV cache (beam search)."""
        ctl = self.controller

        def reorder(past: Any, beam_idx: torch.Tensor) -> Any:
            ctl.reorder(beam_idx.detach().to("cpu").numpy())
            if original is not None:
                return original(past, beam_idx)
            past.reorder_cache(beam_idx)
            return past

        if original is None:
            def _reorder_cache(past_key_values: Any, beam_idx: torch.Tensor) -> Any:
                """Reorder the KV cache ``past_key_values`` and psr_hf's per-row state by ``beam_idx``; returns the
                reordered cache."""
                return reorder(past_key_values, beam_idx)

            return _reorder_cache

        @functools.wraps(original)
        def reorder_cache(past_key_values: Any, beam_idx: torch.Tensor) -> Any:
            return reorder(past_key_values, beam_idx)

        return reorder_cache

    def wrap_router(self, layer: MoELayer, original: Callable) -> Callable:
        """The forward that replaces ``layer``'s router forward ``original`` (bound): the same name, docstring and
        signature (``functools.wraps``; ``__wrapped__`` is ``original``), routed by :class:`~.routing.LayerRouting`."""
        ctl = self.controller
        index = layer.index
        router = layer.router
        routing = ctl.routing

        @functools.wraps(original)
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() and self._traces_unpatched():
                return original(hidden_states, *args, **kwargs)
            if ctl._bypassing:
                return original(hidden_states, *args, **kwargs)
            fwd = ctl._fwd
            if fwd is None and routing.replayable(index) and in_backward():
                return routing.recompute(index, router, original(hidden_states, *args, **kwargs))
            if fwd is None:
                raise RuntimeError(
                    f"psr_hf: MoE layer {index} ran outside a forward pass of the patched model; call the model (or "
                    "its decoder) so the routing state sees the input ids and the attention mask"
                )
            if fwd.thread != threading.get_ident():
                raise RuntimeError(
                    f"psr_hf: MoE layer {index} ran in another thread while a forward pass of the patched model is "
                    "open; calls of the model (and of its decoder) from several threads run one after the other, "
                    "but its layers called directly do not: call the model"
                )
            if routing.ranks_ahead(index):  # read per call: reconfigure() may change it
                return routing.route_joint(fwd, index, router, hidden_states,
                                           lambda: original(hidden_states, *args, **kwargs))
            return routing.route_own(fwd, index, router, original(hidden_states, *args, **kwargs),
                                     hidden_states)

        return forward

    # ------------------------------------------------------------------ what the wrappers run
    def run_forward(self, module: torch.nn.Module, original: Callable, args: tuple, kwargs: dict) -> Any:
        """The wrapped forward of ``module`` (the model or its decoder; ``original`` bound): opens the forward
        pass, runs ``original`` and closes the forward pass however it ends, holding the controller's lock."""
        ctl = self.controller
        if torch.compiler.is_compiling() and self._traces_unpatched():
            return original(*args, **kwargs)
        with ctl._lock:
            if ctl._fwd is not None:  # nested in this thread's open forward (composite -> language model)
                return original(*args, **kwargs)
            if ctl._bypassing:
                return self._bypassed_forward(original, args, kwargs)
            if ctl.model.training:  # checkpointing may have been enabled since the last forward pass
                route_checkpoints(self.checkpointing, ctl.routing)
            ctl._open(module, args, kwargs)
            try:
                output = original(*args, **kwargs)
            except BaseException as error:  # KeyboardInterrupt, SystemExit, GeneratorExit too
                ctl._abort(error)
                raise
            ctl._close(output)
            return output

    def run_generate(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        """The wrapped ``generate()``: one whole call at a time, told its stop tokens and prompt length."""
        ctl = self.controller
        with ctl._lock:  # a whole generate() at a time: its forwards continue one sequence
            if not ctl.config.follows_router:
                # under exact routing the outputs are the unpatched model's whatever the padding, so transformers'
                # own warning is what the user gets
                inputs.refuse_right_padding(kwargs.get("attention_mask"))
                inputs.refuse_assisted_decoding(ctl.model, kwargs)
            stop = inputs.stop_token_ids(ctl.model, kwargs)
            prompt_length = inputs.prompt_length(args, kwargs)
            per_row = (inputs.generation_setting(ctl.model, kwargs, "num_beams") or 1) == 1
            with ctl._rows.generating(stop, prompt_length, per_row):
                return original(*args, **kwargs)

    def _traces_unpatched(self) -> bool:
        """Inside a graph torch.compile traces: exact routing on the model's own weights decides nothing on the
        host, so the traced forward is the unpatched one (``fullgraph=True`` holds; nothing is counted or
        recorded inside the graph). Any other routing decides on the host between the layers: the graph breaks
        here, and the rest runs eagerly with the lock and the routing state (``fullgraph=True`` is refused with
        this reason)."""
        ctl = self.controller
        offloaded = ctl.expert_store.offloaded
        if ctl.config.follows_router and not offloaded:
            return True
        torch._dynamo.graph_break(
            msg=f"psr_hf: policy={ctl.config.policy!r}"
                + (" with offloaded experts" if offloaded else "")
                + " decides the routing on the host between the layers, so a compiled graph breaks at each MoE layer; "
                  "compile without fullgraph=True, or route with policy='exact' on a model that is not offloaded"
        )
        return False

    def _bypassed_forward(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        # the model's own routing (calibration): no state is read or changed, but the store's slots must hold the
        # current weights, and be consistent after an error
        ctl = self.controller
        store = ctl.expert_store
        store.check_device()
        store.sync_weights(ctl.routing.resident)
        try:
            return original(*args, **kwargs)
        except BaseException:
            store.abort()
            raise
