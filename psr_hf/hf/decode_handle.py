"""The decode path of a controller for a batch-1 decoder that runs the layers itself: :class:`DecodeHandle`, which
:meth:`Controller.decode_handle <psr_hf.hf.controller.Controller.decode_handle>` hands out.

The engine (:mod:`psr_hf.engine`) routes through the same controller as the wrapped forward. Per token ``with
handle.step(token_id, position):`` (or :meth:`~DecodeHandle.begin_step` ... :meth:`~DecodeHandle.end_step`), then
for each MoE layer in order ``select(layer, z, pregate)`` and, where the layer has a next MoE layer,
``prefetch(layer + 1)`` before the layer's experts run. The router forwards of the transformers path run the same
helpers (:class:`~.routing.LayerRouting`), so both make the same decisions and count the same statistics.

A decoder that decides decode steps on the GPU (:mod:`psr_hf.engine.token_graph`) borrows row 0's state
(:meth:`~DecodeHandle.lend_state`); the controller takes it back before anything reads or changes the state.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Iterator, Protocol

from numpy.typing import ArrayLike

if TYPE_CHECKING:
    import torch

    from .inputs import ForwardPass
    from .routing import LayerRouting, Selection


class StateBorrower(Protocol):
    """A device decoder that holds row 0's routing state (:meth:`DecodeHandle.lend_state`)."""

    def return_state(self) -> None:
        """Copy the state, counters and statistics back into the controller (through its own references, and
        :meth:`DecodeHandle.continue_sequence`)."""


class SteppedController(Protocol):
    """What a :class:`DecodeHandle` drives: its :class:`~psr_hf.hf.controller.Controller` (which imports this module,
    so it is named here by what the handle reads): the lock, the forward pass open now and the transitions of the
    controller's sequence state machine that a one-row step takes."""

    routing: LayerRouting
    _lock: threading.RLock
    _fwd: ForwardPass | None

    @property
    def _bypassing(self) -> bool: ...

    def _open_step(self, token_id: int, position: int) -> None: ...

    def _close(self, output: object = None) -> None: ...

    def _abort(self, error: BaseException) -> None: ...

    def _decoded_to(self, positions: int) -> None: ...


class DecodeHandle:
    """One controller's decode path for a batch-1 decoder: one-token steps, each MoE layer's selection and
    prefetch, the stacked router weights the decoder multiplies, and row 0's state lent to a device decoder.

    A step holds the controller's lock from :meth:`begin_step` to :meth:`end_step` or :meth:`abort_step`, as a
    forward pass of the model holds it: calls from other threads wait, nested calls in this thread pass."""

    def __init__(self, controller: SteppedController):
        self._controller = controller
        self._routing = controller.routing
        self._lent: StateBorrower | None = None

    @property
    def needs_pregate(self) -> bool:
        """Whether the policy reads the next layer's pre-gate (pass ``pregate`` to :meth:`select`)."""
        return self._routing.needs_pregate

    # ------------------------------------------------------------------ one-token steps
    def begin_step(self, token_id: int, position: int) -> None:
        """Open a one-token forward pass of one row, as the wrapped forward does for ``input_ids`` ``[1, 1]``
        with ``position`` cached positions before it: position 0 starts a new sequence (closing the recording's
        previous one and, offloaded, copying the warm set into the slots), a later one continues the current
        sequence (``RuntimeError`` if the previous forward stopped part-way, or the sequence has several rows).
        The offloaded model's slots are synchronised with its weights (:meth:`OffloadedExperts.sync_weights`).

        Takes the controller's lock until :meth:`end_step` or :meth:`abort_step` (the same thread may nest);
        :meth:`step` pairs them."""
        position = int(position)
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        ctl = self._controller
        ctl._lock.acquire()
        try:
            self.reclaim()
            if ctl._fwd is not None:
                raise RuntimeError("psr_hf: begin_step() while a forward pass of the patched model is open")
            if ctl._bypassing:
                raise RuntimeError("psr_hf: begin_step() inside bypassed(): the routing state must not change")
            ctl._open_step(int(token_id), position)
        except BaseException:
            ctl._lock.release()
            raise

    def end_step(self) -> None:
        """Close the step :meth:`begin_step` opened (its layers go to the recording); releases the lock."""
        self._require_step("end_step")
        try:
            self._controller._close()
        finally:
            self._controller._lock.release()

    def abort_step(self, error: BaseException) -> None:
        """The step stopped part-way with ``error``: close it and its sequence (as an exception inside the wrapped
        forward does; :meth:`Controller.reset` or position 0 starts again) and make the offload's slots
        consistent; releases the lock."""
        self._require_step("abort_step")
        try:
            self._controller._abort(error)
        finally:
            self._controller._lock.release()

    @contextlib.contextmanager
    def step(self, token_id: int, position: int) -> Iterator[None]:
        """:meth:`begin_step`, then :meth:`end_step` when the block ends, :meth:`abort_step` on any exception."""
        self.begin_step(token_id, position)
        try:
            yield
        except BaseException as error:  # KeyboardInterrupt too: the sequence holds a partial step
            self.abort_step(error)
            raise
        self.end_step()

    def select(self, layer: int, scores: ArrayLike, pregate: ArrayLike | None = None) -> Selection:
        """MoE layer ``layer``'s selection in the open step: ``scores`` ``[E]`` (or ``[1, E]``) are the family's
        selection scores of this layer (``router_scores[:E]``), ``pregate`` those of the next MoE layer on this
        layer's input (``router_scores[E:]``; kept only when :attr:`needs_pregate` and a next layer exists).

        Runs part 2 of the layer (parts 1 and 2 where the policy has no pre-gate) on the cache's own buffers,
        the recording, the statistics (copies, replaced slots, displaced mass) and, offloaded, the slot
        scheduler's demand copies (``route(..., mirror=True)``). Exactly the HF router forward's decode path."""
        return self._routing.select(self._require_step("select"), layer, scores, pregate)

    def prefetch(self, layer: int) -> bool:
        """Part 1 of MoE layer ``layer`` (>= 1) from the pre-gate the previous layer's :meth:`select` stored, and,
        offloaded, its prefetch copies: call it after the previous layer's selection, before that layer's experts
        run (its copies overlap with them). Does nothing (returns False) when the policy has no pre-gate, as in
        the HF path."""
        return self._routing.prefetch(self._require_step("prefetch"), layer)

    def stacked_weight(self, layer: int) -> torch.Tensor:
        """``[2E, H]``: MoE layer ``layer``'s router weight over what ranks the next layer's prefetches (one matmul
        gives z and the next pre-gate; :meth:`LayerRouting.stacked_weight <.routing.LayerRouting.stacked_weight>`)."""
        return self._routing.stacked_weight(layer)

    def _require_step(self, what: str) -> ForwardPass:
        fwd = self._controller._fwd
        if fwd is None or fwd.owner is not None or fwd.thread != threading.get_ident():
            raise RuntimeError(f"psr_hf: {what}() outside a step opened by begin_step() in this thread")
        return fwd

    # ------------------------------------------------------------------ row 0's state lent to a device decoder
    def lend_state(self, borrower: StateBorrower) -> None:
        """Hand row 0's routing state to ``borrower`` until the next call that reads or changes it, which takes it
        back first (:meth:`reclaim`: the borrower's ``return_state()`` copies the state, counters and statistics
        back). ``RuntimeError`` inside an open forward pass or step."""
        with self._controller._lock:
            if self._controller._fwd is not None:
                raise RuntimeError("psr_hf: lend_state() while a forward pass of the patched model is open")
            self.reclaim()
            self._lent = borrower

    @property
    def lent(self) -> StateBorrower | None:
        """The borrower holding the state (None: the controller holds it)."""
        return self._lent

    def reclaim(self) -> None:
        """Take the state back from the borrower holding it, if any."""
        borrower = self._lent
        if borrower is not None:
            self._lent = None
            borrower.return_state()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the controller's lock (the same thread may nest): a borrower's step, so that no other thread takes
        the state back while the step is launched."""
        with self._controller._lock:
            yield

    def continue_sequence(self, positions: int) -> None:
        """A borrower decoded the current sequence to ``positions`` positions (called from ``return_state``)."""
        self._controller._decoded_to(int(positions))
