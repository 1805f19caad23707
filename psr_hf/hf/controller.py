"""The Controller: per-row logical caches carried across the forward passes of a patched model.

It owns the sequence state machine (ARCHITECTURE.md, "The one decision path"): the wrapped forward reads
``input_ids``, the attention mask and the cache length (:mod:`.inputs`); a new sequence resets the rows, padded
positions and rows that finished are marked so they never touch the state. The forward pass is closed however it
ends: after any exception (``KeyboardInterrupt`` and ``SystemExit`` included) the sequence is closed and the
offload's slots made consistent, so the next sequence starts cleanly and continuing the stopped one raises. Calls
from several threads are serialised by one re-entrant lock per model (a whole ``generate()`` at a time).

Each MoE layer's routing is :class:`~.routing.LayerRouting`'s, its prefetch ranking a source of
:mod:`.prefetch_sources`; what is installed on the model is :class:`~.installation.Installer`'s; statistics and
recording live in :mod:`.statistics` and :mod:`.recording`. A batch-1 decoder that runs the layers itself
(:class:`psr_hf.engine.Decoder`) drives the same decode path through :meth:`Controller.step`,
:meth:`Controller.select` and :meth:`Controller.prefetch`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol

import numpy as np
import torch
from numpy.typing import ArrayLike

from ..offload.store import PatchedExpertStore, ResidentExperts
from ..policy.cache import LogicalCache
from ..policy.config import RoutingConfig
from . import inputs
from .inputs import ForwardPass
from .installation import Installer, refuse_copy
from .prefetch_sources import prefetch_source
from .recording import Recorder
from .routing import LayerRouting, Selection, in_backward
from .statistics import RoutingCounters, RoutingStats

if TYPE_CHECKING:
    from ..gates.margin_head import MarginHead
    from ..offload.config import OffloadConfig
    from ..policy.calibration import Calibration
    from ..offload.experts import OffloadedExperts
    from ..offload.placement import OffloadMemory
    from ..patches.base import ArchitecturePatch, MoELayer

logger = logging.getLogger(__name__)


class StateBorrower(Protocol):
    """A device decoder that holds row 0's routing state (:meth:`Controller.lend_state`)."""

    def return_state(self, controller: Controller) -> None:
        """Copy the state, counters and statistics back into ``controller``."""


class Controller:
    """Per-row routing state of one patched model; get it with :func:`psr_hf.controller`.

    One sequence at a time: the model's forward, ``generate()`` and this object's public methods hold one
    re-entrant lock, so calls from several threads run one after the other (a whole ``generate()`` at a time) and
    nested calls in one thread (a composite model calling its language model) pass.

    Attributes: ``config`` (the :class:`RoutingConfig`), ``cache`` (the :class:`~psr_hf.policy.LogicalCache`),
    ``layers`` (the patched MoE layers), ``num_layers``, ``num_experts``, ``top_k``, ``capacity``.
    """

    __deepcopy__ = __reduce_ex__ = refuse_copy  # reached through a submodule that holds it, too

    def __init__(self, model: torch.nn.Module, family: ArchitecturePatch, layers: list[MoELayer], config: RoutingConfig,
                 calibration: Any, predictor: Any = None, gate: MarginHead | str | Path | None = None):
        self.model = model
        self.family = family
        self.layers = layers
        routers = [layer.router for layer in layers]
        shapes = {(int(r.weight.shape[0]), int(r.top_k)) for r in routers}
        if len(shapes) != 1:
            raise ValueError(f"MoE layers differ in (experts, top_k): {sorted(shapes)}; psr_hf needs one shape")
        (self.num_experts, self.top_k), = shapes
        self.num_layers = len(layers)
        self.default_window = family.default_window
        self.routing = LayerRouting(model, family, layers, self.num_experts, self.top_k)
        # where the experts live: the model's own weights until install() offloads them (patch(..., offload=...))
        self.expert_store: PatchedExpertStore = self._resident_store()
        self.routing.store = self.expert_store
        self._fwd: ForwardPass | None = None
        self._lent: StateBorrower | None = None  # a device decoder holding row 0's state (lend_state)
        self._lock = threading.RLock()  # one forward pass or generate() at a time (see the class docstring)
        self._interrupted: str | None = None  # why the last forward pass stopped part-way; None once a new one starts
        self._sequence_positions: int | None = None  # positions the current sequence's routing state has seen
        self._sequence_cache: weakref.ref | None = None  # weak reference to the KV cache its forward passes filled
        self._recover_slots = False  # the store's slots still need abort() (an abort that was itself cut short)
        self._bypass = threading.local()  # .depth: bypassed() blocks open in this thread (other threads route)
        self._recorder: Recorder | None = None
        self._stop_ids: np.ndarray = np.zeros(0, dtype=np.int64)
        self._stop_set: frozenset = frozenset()  # the same ids, for the one-token check
        self._prompt_length = 0  # length of the current generate() call's input ids (cached part included)
        self._in_generate = 0
        self._rows_stop = False  # the running generate() reports stopped rows (rows_stopped)
        self._right_padded: np.ndarray | None = None  # [R] real lengths of mask-less right-padded rows
        self._installer = Installer(self)  # what install() puts on the model; uninstall() removes it
        self._configure(config, calibration, predictor, gate)

    def _configure(self, config: RoutingConfig, calibration: Any, predictor: Any = None,
                   gate: MarginHead | str | Path | None = None) -> None:
        """Everything that follows from the routing config: the logical cache, the prefetch source, the gate,
        fresh rows and zero statistics. All or nothing: everything is built and checked before anything is
        assigned, so a ``ValueError`` leaves the controller as it was."""
        model_shape = dict(num_layers=self.num_layers, num_experts=self.num_experts,
                           hidden_size=int(self.layers[0].router.weight.shape[1]),
                           model_type=getattr(self.family.config, "model_type", None), top_k=self.top_k)
        source = prefetch_source(config.prefetch, predictor, self.predictor, model_shape)
        vocab = getattr(self.family.config, "vocab_size", None)
        cache = LogicalCache(
            config, num_layers=self.num_layers, num_experts=self.num_experts, top_k=self.top_k,
            calibration=calibration, rows=1, default_window=self.default_window, vocab_size=vocab,
        )
        head, unit = _gate_for(gate, config, cache.calibration, model_shape, self.routing.devices[0])
        self.config = config
        self.cache = cache
        self.capacity = cache.capacity
        self.calibration = cache.calibration
        self._calibration_given = None if calibration is None else cache.calibration  # what reconfigure() keeps
        self._uses_tokens = bool(cache.calibration.vocab_size) and config.eviction == "score"
        self.routing.configure(config, cache, source)
        self.routing.gate, self.routing.gate_unit = head, unit
        self._finished = np.zeros(1, dtype=bool)  # [R] rows that ended in generate()
        self._totals = RoutingCounters()  # finished sequences since the last reset_stats()

    # ------------------------------------------------------------------ public
    @property
    def rows(self) -> int:
        return self.cache.rows

    @property
    def predictor(self) -> Any:
        """The learned predictor that ranks prefetches (``RoutingConfig(prefetch="predictor")``), else None."""
        return self.routing.source.predictor

    @property
    def gate(self) -> MarginHead | None:
        """The margin head that sets each token's margin (``patch(..., gate=...)``), else None."""
        return self.routing.gate

    @property
    def offload(self) -> OffloadedExperts | None:
        """The :class:`~psr_hf.offload.OffloadedExperts` of a model patched with ``offload=``, else None (the
        library asks :attr:`expert_store`, which is never None)."""
        store = self.expert_store
        return store if store.offloaded else None

    @property
    def forward_pass(self) -> ForwardPass | None:
        """The forward pass (or :meth:`begin_step` step) open now, None between them."""
        return self._fwd

    def reset(self) -> None:
        """Start a new sequence in every row (a forward pass does this by itself when a sequence starts); also
        after a forward pass that stopped part-way, to continue its KV cache anyway."""
        with self._lock:
            self._reclaim()
            self._new_sequence(self.rows)
            self._sequence_positions = None  # any KV cache may continue from here

    def refresh_experts(self) -> None:
        """Offloaded model: copy every expert slot again from the host store. Changes of the expert weights are
        found by themselves at the next forward pass (version counters, identity, dtype and device of the
        parameters); only edits that bypass the version counter (through ``param.data`` or another alias of the
        storage) need this call."""
        with self._lock:
            self._reclaim()
            self.expert_store.refresh()

    def reset_stats(self) -> None:
        """Zero the totals of :meth:`stats` (the per-row counters of the current sequence are kept), and the
        offload's copy counters."""
        with self._lock:
            self._reclaim()
            self._totals = RoutingCounters() - self._current_totals()
            self.expert_store.reset_stats()

    def reconfigure(self, config: RoutingConfig | Mapping[str, object] | str | Path, calibration: Any = None,
                    predictor: Any = None, gate: MarginHead | str | Path | bool | None = None) -> None:
        """Route with another :class:`RoutingConfig` (or a dict of its fields, or its YAML file) and calibration
        from the next forward pass on, without unpatching: an offloaded model keeps its host store and gets new
        slots if the capacity changed. Starts a new sequence and zeroes every statistic.

        ``calibration``: default (None) the one the model routes with now (given to :func:`~psr_hf.patch` or to
        an earlier ``reconfigure``); ``False`` routes uncalibrated (running bonus scale, the first experts as the
        warm set, no token prior). ``predictor``: for ``prefetch="predictor"`` (default: the one the model has).
        ``gate``: a margin head (default: the one the model has; ``False``: none).

        A refused call (``ValueError``: a gate, predictor or calibration that cannot route with ``config``)
        changes nothing: the model keeps its config, cache, slots and sequence."""
        config = RoutingConfig.coerce(config)
        gate = self.gate if gate is None else None if gate is False else gate
        if calibration is None:
            calibration = self._calibration_given
        elif calibration is False:
            calibration = None
        with self._lock:
            self._reclaim()
            if self._fwd is not None:
                raise RuntimeError("psr_hf: reconfigure() inside a forward pass of the patched model")
            self._configure(config, calibration, predictor, gate)
            self._interrupted = None  # the cache is new: no sequence to continue
            self._sequence_positions = None  # any KV cache may continue with the new state
            self.expert_store.resize(self.capacity)
            self.expert_store.reset_stats()
        logger.info("psr_hf: reconfigured to %s, capacity %d of %d experts", config.policy, self.capacity,
                    self.num_experts)

    def memory(self) -> OffloadMemory:
        """Where the experts are (:class:`~psr_hf.offload.OffloadMemory`); only for an offloaded model."""
        return self.expert_store.memory()

    def stats(self) -> RoutingStats:
        """Copies per token, replaced router slots and displaced router mass, per row and in total."""
        with self._lock:
            self._reclaim()
            total = self._totals + self._current_totals()
            copies = self.expert_store.stats(int(total.tokens))
            return RoutingStats.of(self.cache.stats(), self.routing.displaced, total, copies)

    def record(self) -> Recorder:
        """Start recording (see :class:`~psr_hf.hf.recording.Recorder`); a recording already running is stopped
        first."""
        with self._lock:
            self._reclaim()
            if self._recorder is not None:
                self._recorder.stop()
            self._set_recorder(Recorder(num_layers=self.num_layers, top_k=self.top_k,
                                        default_window=self.default_window, on_stop=self._recording_stopped))
            return self._recorder

    def _set_recorder(self, recorder: Recorder | None) -> None:
        self._recorder = self.routing.recorder = recorder

    def _recording_stopped(self, recorder: Recorder) -> None:
        if self._recorder is recorder:
            self._set_recorder(None)

    @contextlib.contextmanager
    def right_padded(self, lengths: ArrayLike) -> Iterator[None]:
        """Forward passes inside this block that get no attention mask have right-padded rows: positions from
        ``lengths[row]`` on (counted from the start of the sequence) are padding. They run the router's own top-K
        and never touch the state or the statistics, as masked positions do. For callers that pad on the right
        without a mask (lm-eval's loglikelihood batches): the model computes exactly as without this block."""
        previous = self._right_padded
        self._right_padded = np.asarray(lengths, dtype=np.int64).reshape(-1)
        try:
            yield
        finally:
            self._right_padded = previous

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Run the model's own routers inside this block, in this thread: no state is read or changed (used by
        calibration). Calls from other threads route and count as usual; each forward pass still holds the lock."""
        self._bypass.depth = getattr(self._bypass, "depth", 0) + 1
        try:
            yield
        finally:
            self._bypass.depth -= 1

    def discard_sequence(self) -> None:
        """Forget the current sequence: its statistics and recording are dropped, not added to the totals (the
        engine calls this before it re-runs the same sequence from its start on the transformers path, which
        routes and counts it again)."""
        with self._lock:
            self._reclaim()
            if self._fwd is not None:
                raise RuntimeError("psr_hf: a sequence cannot be discarded inside its forward pass")
            self.cache.reset()
            self.routing.displaced[:] = 0.0
            if self._recorder is not None:
                self._recorder.drop_sequence()
            self._sequence_positions, self._sequence_cache = 0, None

    def reorder(self, index: ArrayLike) -> None:
        """Reorder or expand the rows like the KV cache (beam search): new row ``i`` continues old row ``index[i]``."""
        self._reclaim()
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        self.cache.reorder(index)
        self.routing.reorder(index)
        self._finished = self._finished[index]
        if self._recorder is not None:
            self._recorder.reorder(index)

    # ------------------------------------------------------------------ state lent to a device decoder
    # The engine's token graph (psr_hf.engine.token_graph) decides decode steps on the GPU from a copy of row 0's
    # state. While it holds the state, every caller here that reads or changes the state takes it back first
    # (``_reclaim``): the borrower's ``return_state(controller)`` copies the state, counters and statistics back.
    def lend_state(self, borrower: StateBorrower) -> None:
        """Hand row 0's routing state to ``borrower`` (an object with ``return_state(controller)``) until the next
        call that reads or changes it. ``RuntimeError`` inside an open forward pass or step."""
        with self._lock:
            if self._fwd is not None:
                raise RuntimeError("psr_hf: lend_state() while a forward pass of the patched model is open")
            self._reclaim()
            self._lent = borrower

    @property
    def recording(self) -> bool:
        """Whether a recording runs (:meth:`record`)."""
        return self._recorder is not None

    @property
    def lent(self) -> StateBorrower | None:
        """The borrower holding the state (None: the controller holds it)."""
        return self._lent

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the controller's lock (the same thread may nest): a borrower's step, so that no other thread takes
        the state back while the step is launched."""
        with self._lock:
            yield

    def continue_sequence(self, positions: int) -> None:
        """A borrower decoded the current sequence to ``positions`` positions (called from ``return_state``)."""
        self._sequence_positions = int(positions)

    def _reclaim(self) -> None:
        borrower = self._lent
        if borrower is not None:
            self._lent = None
            borrower.return_state(self)

    # ------------------------------------------------------------------ batch-1 external decoder
    # The decode (one row, one position) path of the wrapped forward, for a decoder that runs the layers itself
    # (psr_hf.engine.Decoder). Per token: ``with ctl.step(token_id, position):`` (or begin_step ... end_step),
    # then for each MoE layer in order ``select(layer, z, g_next)`` and, where the layer has a next MoE layer,
    # ``prefetch(layer + 1)`` before the layer's experts run. The router forwards of the HF path run the same
    # helpers (LayerRouting), so both make the same decisions and count the same statistics.
    @property
    def needs_pregate(self) -> bool:
        """Whether the policy reads the next layer's pre-gate (pass ``pregate`` to :meth:`select`)."""
        return self.routing.needs_pregate

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
        self._lock.acquire()
        try:
            self._reclaim()
            if self._fwd is not None:
                raise RuntimeError("psr_hf: begin_step() while a forward pass of the patched model is open")
            if getattr(self._bypass, "depth", 0):
                raise RuntimeError("psr_hf: begin_step() inside bypassed(): the routing state must not change")
            self._check_continuation(position, 1)
            self._start(None, np.array([[int(token_id)]], dtype=np.int64), None, position, 1, 1)
        except BaseException:
            self._lock.release()
            raise

    def end_step(self) -> None:
        """Close the step :meth:`begin_step` opened (its layers go to the recording); releases the lock."""
        self._require_step("end_step")
        try:
            self._close()
        finally:
            self._lock.release()

    def abort_step(self, error: BaseException) -> None:
        """The step stopped part-way with ``error``: close it and its sequence (as an exception inside the wrapped
        forward does; :meth:`reset` or position 0 starts again) and make the offload's slots consistent;
        releases the lock."""
        self._require_step("abort_step")
        try:
            self._abort(error)
        finally:
            self._lock.release()

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
        return self.routing.select(self._require_step("select"), layer, scores, pregate)

    def prefetch(self, layer: int) -> bool:
        """Part 1 of MoE layer ``layer`` (>= 1) from the pre-gate the previous layer's :meth:`select` stored, and,
        offloaded, its prefetch copies: call it after the previous layer's selection, before that layer's experts
        run (its copies overlap with them). Does nothing (returns False) when the policy has no pre-gate, as in
        the HF path."""
        return self.routing.prefetch(self._require_step("prefetch"), layer)

    def joint_scores(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [N, 2E], scores [N, 2E])`` of MoE layer ``layer`` (not the last) on its router input
        ``hidden``: this layer's logits and selection scores, then the next layer's pre-gate from the same matmul:
        the next router's scores on this input, or with ``RoutingConfig(prefetch="predictor")`` the predictor's
        priorities ``softmax(B A x)`` in float32 (docs/ALGORITHM.md, "Prefetch ranking source")."""
        return self.routing.joint_scores(layer, hidden)

    def prefetch_weight(self, layer: int) -> torch.Tensor:
        """``[E, H]``: what ranks the prefetches of layer ``layer + 1`` from layer ``layer``'s router input: the
        next router's weight, or the predictor's ``B A`` (float32) with ``prefetch="predictor"``."""
        return self.routing.prefetch_weight(layer)

    def stacked_weight(self, layer: int) -> torch.Tensor:
        """``[2E, H]`` this router's weight over :meth:`prefetch_weight` (one matmul gives z and the next
        pre-gate), in the family's router dtype; rebuilt when a weight is replaced or changed in place, and at every
        new sequence (device moves)."""
        return self.routing.stacked_weight(layer)

    def _require_step(self, what: str) -> ForwardPass:
        fwd = self._fwd
        if fwd is None or fwd.owner is not None or fwd.thread != threading.get_ident():
            raise RuntimeError(f"psr_hf: {what}() outside a step opened by begin_step() in this thread")
        return fwd

    # ------------------------------------------------------------------ installation
    @property
    def installed(self) -> bool:
        """Whether :meth:`install` put this controller on its model (and :meth:`uninstall` has not removed it)."""
        return self._installer.installed

    def install(self, offload: OffloadConfig | None = None) -> None:
        """Put cache-aware routing on the model, in this order: each MoE router's forward replaced, the forward of
        the model and of its text decoder wrapped, ``generate()`` and ``_reorder_cache()`` wrapped, the experts
        offloaded when ``offload`` (an :class:`~psr_hf.offload.OffloadConfig`, or None) is given, and last the
        model's attribute that :func:`psr_hf.controller` reads. All or nothing: if a step fails, what the earlier
        ones installed is removed and the error is raised. Returns None; :meth:`uninstall` undoes it."""
        self._installer.install(offload)

    def uninstall(self) -> None:
        """Remove everything :meth:`install` put on the model, the latest first (the offload first: the weights
        go back to their devices and the model's own experts implementation is restored), so that the model
        computes exactly as before. Idempotent. Waits for a forward pass or ``generate()`` running in another thread."""
        with self._lock:
            self._reclaim()
            self._installer.uninstall()

    def _resident_store(self) -> ResidentExperts:
        return ResidentExperts([layer.block.experts for layer in self.layers], self.num_experts)

    def attach_store(self, store: PatchedExpertStore) -> None:
        """Route through ``store`` (an :class:`~psr_hf.offload.OffloadedExperts`: its slots follow the cache)."""
        self.expert_store = self.routing.store = store
        self.routing.refresh_devices()  # the routers may have moved to the offload device

    def detach_store(self) -> None:
        """Close the attached store (the weights go back to their devices) and route over the model's own
        experts again."""
        store = self.expert_store
        self.expert_store = self.routing.store = self._resident_store()
        try:
            store.close()
        finally:
            self.routing.refresh_devices()

    # ------------------------------------------------------------------ what the installed wrappers call
    def run_forward(self, module: torch.nn.Module, original: Callable, args: tuple, kwargs: dict) -> Any:
        """The wrapped forward of ``module`` (the model or its decoder; ``original`` bound): opens the forward
        pass, runs ``original`` and closes the forward pass however it ends, holding the controller's lock."""
        if torch.compiler.is_compiling() and self._traces_unpatched():
            return original(*args, **kwargs)
        with self._lock:
            if self._fwd is not None:  # nested in this thread's open forward (composite -> language model)
                return original(*args, **kwargs)
            if getattr(self._bypass, "depth", 0):
                return self._bypassed_forward(original, args, kwargs)
            if self.model.training:  # checkpointing may have been enabled since the last forward pass
                self._installer.route_checkpoints()
            self._open(module, args, kwargs)
            try:
                output = original(*args, **kwargs)
            except BaseException as error:  # KeyboardInterrupt, SystemExit, GeneratorExit too
                self._abort(error)
                raise
            self._close()
            if self._sequence_cache is None:  # a cache the forward created itself (either field name)
                self._remember_cache(inputs.output_cache(output))
            return output

    def run_generate(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        """The wrapped ``generate()``: one whole call at a time, told its stop tokens and prompt length."""
        with self._lock:  # a whole generate() at a time: its forwards continue one sequence
            if not self._outputs_exact:
                # under exact routing the outputs are the unpatched model's whatever the padding, so transformers'
                # own warning is what the user gets
                inputs.refuse_right_padding(kwargs.get("attention_mask"))
                inputs.refuse_assisted_decoding(self.model, kwargs)
            stop = inputs.stop_token_ids(self.model, kwargs)
            previous = self._stop_ids, self._stop_set, self._prompt_length, self._rows_stop
            self._stop_ids, self._prompt_length = stop, inputs.prompt_length(args, kwargs)
            self._stop_set = frozenset(int(t) for t in stop.tolist())
            # greedy and sampled decoding ask the stopping criteria once per step for every row; beam search asks
            # them for candidate beams, which are not rows
            self._rows_stop = (inputs.generation_setting(self.model, kwargs, "num_beams") or 1) == 1
            # a call that continues a cached sequence gives every row new input: rows that finished before run again
            self._finished[:] = False
            self._in_generate += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._in_generate -= 1
                self._stop_ids, self._stop_set, self._prompt_length, self._rows_stop = previous

    def rows_stopped(self, done: torch.Tensor) -> None:
        """generate()'s stopping criteria ended the rows where ``done`` ``[B]`` is true (an end-of-sequence token,
        a stop string, lm-eval's ``until``, any custom criterion): from the next forward pass on, what generate()
        feeds those rows never touches their state, as a row alone would have stopped there."""
        if not (self._in_generate and self._rows_stop) or done.ndim != 1 or done.shape[0] != self._finished.shape[0]:
            return
        self._finished |= done.detach().to("cpu").numpy().astype(bool)

    def router_forward(self, layer: MoELayer, original: Callable) -> Callable:
        """The forward that replaces ``layer``'s router forward ``original`` (bound): the same name, docstring and
        signature (``functools.wraps``; ``__wrapped__`` is ``original``), routed by :class:`LayerRouting`."""
        index = layer.index
        router = layer.router
        following = self.layers[index + 1].router if index + 1 < self.num_layers else None
        routing = self.routing

        @functools.wraps(original)
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() and self._traces_unpatched():
                return original(hidden_states, *args, **kwargs)
            if getattr(self._bypass, "depth", 0):
                return original(hidden_states, *args, **kwargs)
            fwd = self._fwd
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
            if following is not None and routing.needs_pregate:  # read per call: reconfigure() may change it
                return routing.route_joint(fwd, index, router, hidden_states,
                                           lambda: original(hidden_states, *args, **kwargs))
            return routing.route_own(fwd, index, router, original(hidden_states, *args, **kwargs),
                                     hidden_states)

        return forward

    def _traces_unpatched(self) -> bool:
        """Inside a graph torch.compile traces: exact routing on the model's own weights decides nothing on the
        host, so the traced forward is the unpatched one (``fullgraph=True`` holds; nothing is counted or
        recorded inside the graph). Any other routing decides on the host between the layers: the graph breaks
        here, and the rest runs eagerly with the lock and the routing state (``fullgraph=True`` is refused with
        this reason)."""
        offloaded = self.expert_store.offloaded
        if self._outputs_exact and not offloaded:
            return True
        torch._dynamo.graph_break(
            msg=f"psr_hf: policy={self.config.policy!r}"
                + (" with offloaded experts" if offloaded else "")
                + " decides the routing on the host between the layers, so a compiled graph breaks at each MoE layer; "
                  "compile without fullgraph=True, or route with policy='exact' on a model that is not offloaded"
        )
        return False

    # ------------------------------------------------------------------ sequence and rows
    def _current_totals(self) -> RoutingCounters:
        """The counts of the current sequence (every row)."""
        return RoutingCounters.of(self.cache.stats(), self.routing.displaced)

    @property
    def _outputs_exact(self) -> bool:
        """Exact routing: every output is the unpatched model's whatever the routing state holds."""
        return self.config.follows_router

    def _new_sequence(self, rows: int) -> None:
        self._interrupted = None
        self._sequence_positions, self._sequence_cache = 0, None  # set by the sequence's forward passes
        self._recover()  # slots left inconsistent by a stopped forward whose recovery was itself cut short
        self._totals = self._totals + self._current_totals()
        if self._recorder is not None:
            self._recorder.close_sequence()
        if rows != self.cache.rows:
            self.cache.resize(rows)
        else:
            self.cache.reset()
        self.routing.new_sequence(rows)
        self._finished = np.zeros(rows, dtype=bool)
        # every row starts from the warm set: the slots take it
        self.expert_store.new_sequence([self.cache.resident(layer, 0) for layer in range(self.num_layers)])

    # ------------------------------------------------------------------ forward passes
    def _bypassed_forward(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        # the model's own routing (calibration): no state is read or changed, but the store's slots must hold the
        # current weights, and be consistent after an error
        store = self.expert_store
        store.check_device()
        store.sync_weights(self.routing.resident)
        try:
            return original(*args, **kwargs)
        except BaseException:
            store.abort()
            raise

    def _abort(self, error: BaseException) -> None:
        """The open forward pass stopped part-way with ``error``: close it and the sequence it belongs to (its KV
        cache and routing state hold a partial step), and make the store's slots consistent."""
        # first the plain assignments, which nothing can cut short: the next call must not see this forward open
        self._fwd = None
        self._interrupted = type(error).__name__
        self._recover_slots = True
        self.routing.abort_forward()
        if self._recorder is not None:
            self._recorder.drop_forward()  # the stopped forward's layers are not recorded
        self._recover()

    def _remember_cache(self, cache: object) -> None:
        """The KV cache object the current sequence's forward passes fill (a weak reference)."""
        if cache is None or not hasattr(cache, "get_seq_length"):
            return
        try:
            self._sequence_cache = weakref.ref(cache)
        except TypeError:  # not weakly referenceable: not checked
            self._sequence_cache = None

    def _close(self) -> None:
        """The open forward pass ended normally: close it (its layers go to the recording)."""
        fwd, self._fwd = self._fwd, None
        self._sequence_positions = fwd.past + fwd.positions
        if self._recorder is not None:
            self._recorder.end_forward(fwd.tokens, fwd.valid)

    def _recover(self) -> None:
        if not self._recover_slots:
            return
        try:
            self.expert_store.abort()
        except Exception:  # the error that stopped the forward is the one to report; this one is logged
            logger.exception("psr_hf offload: making the slots consistent after a stopped forward pass failed")
            return
        self._recover_slots = False

    def _open(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Read the forward's input ids, mask and cache length, start a new sequence or continue the current one,
        and open the forward pass. Invalid input raises before anything changes."""
        self._reclaim()
        tokens, mask_host = inputs.read_tokens(args, kwargs, needs_ids=self._uses_tokens)
        B, S = tokens.shape
        past = inputs.past_length(kwargs)
        cache = inputs.kv_cache(kwargs)
        # under exact routing the state never changes an output: a forward that continues another cache (a model
        # that is its own assistant in assisted decoding) starts fresh routing state, as transformers just runs it
        restart = self._check_continuation(past, B, cache, restart=self._outputs_exact)
        valid = inputs.real_positions(kwargs, mask_host, B, S, past, self._right_padded)
        self._start(module, tokens, valid, past, B, S, restart)
        if cache is not None and (past == 0 or self._sequence_cache is None):
            self._remember_cache(cache)

    def _check_continuation(self, past: int, B: int, cache: object = None, restart: bool = False) -> bool:
        """A forward of ``B`` rows after ``past`` cached positions (in the KV cache ``cache``, if given) may
        continue the current sequence: the one whose routing state this is, so the same cache object as the
        sequence's forward passes used (when both are known) and as many cached positions as the routing state
        has seen (fewer, a cache cropped in place as assisted decoding does, only under exact routing, which no
        output depends on). Where it may not: a ``RuntimeError``, or with ``restart`` True (the routing state
        starts afresh for this forward)."""
        try:
            self._check_continuing(past, B, cache)
        except RuntimeError:
            if not restart:
                raise
            logger.debug("psr_hf: a forward continues another sequence's KV cache; fresh routing state (exact routing)")
            return True
        return False

    def _check_continuing(self, past: int, B: int, cache: object) -> None:
        if past > 0 and self._interrupted is None:
            # a dead reference: the sequence's cache is gone, so this one (alive all along) is another
            other = cache is not None and self._sequence_cache is not None and cache is not self._sequence_cache()
            if other or (self._sequence_positions is not None and past > self._sequence_positions):
                owner = ("another KV cache (another forward pass started a new sequence in between)" if other
                         else f"a sequence of {self._sequence_positions} positions")
                raise RuntimeError(
                    f"psr_hf: this forward continues a KV cache of {past} positions, but the routing state belongs to "
                    f"{owner}: continuing would route this cache with another sequence's state. Start a new sequence "
                    "(generate() or a forward without past_key_values), or call psr_hf.controller(model).reset() to "
                    "continue this KV cache with fresh routing state"
                )
        if 0 < past < (self._sequence_positions or 0) and self._interrupted is None and not self._outputs_exact:
            raise RuntimeError(
                f"psr_hf: this forward continues a KV cache cropped to {past} positions, but the routing state has "
                f"taken in {self._sequence_positions}: the removed positions (rejected drafts of assisted decoding, "
                "a rolled-back turn) would still steer this sequence's routing. Start a new sequence (generate() or a "
                "forward without past_key_values), or call psr_hf.controller(model).reset() to continue this KV "
                "cache with fresh routing state"
            )
        if past > 0 and self._interrupted is not None:
            raise RuntimeError(
                f"psr_hf: the previous forward pass of this model stopped part-way ({self._interrupted}), so the "
                "sequence it belonged to is closed: its KV cache and routing state hold a partial step. Start a new "
                "sequence (generate() or a forward without past_key_values), or call psr_hf.controller(model)."
                "reset() to continue this KV cache with fresh routing state"
            )
        if past > 0 and B != self.cache.rows:
            raise RuntimeError(
                f"psr_hf: a batch of {B} rows continues a cached sequence of {self.cache.rows} rows; start a new "
                "sequence (empty cache) or reorder the rows with the KV cache"
            )

    def _start(self, module: torch.nn.Module | None, tokens: np.ndarray, valid: np.ndarray | None, past: int, B: int,
               S: int, restart: bool = False) -> None:
        """Open the forward pass of ``tokens`` [B, S] (``valid``: its real positions, None: all) after ``past``
        cached positions: a new sequence when ``past`` is 0 (or ``restart``), else the current one continues."""
        store = self.expert_store
        store.check_device()
        try:  # from here on the state changes: a stop part-way closes the sequence
            self._recover()
            store.sync_weights(self.routing.resident)
            if past == 0 or restart:
                self._new_sequence(B)
            if self._in_generate and past > 0 and (self._stop_ids.size or self._finished.any()):
                valid = self._mark_finished(tokens, valid, prompt=self._prompt_length - past)
            if S == 1:  # decoding runs on the cache's own one-position buffers
                io = self.cache.io
                io.tokens[:, 0] = tokens[:, 0]
                io.valid[:, 0] = 1 if valid is None else valid[:, 0]
            self.routing.begin_forward()
            self._fwd = ForwardPass(B, S, tokens, valid, module, past=past)
        except BaseException as error:
            self._abort(error)
            raise

    def _mark_finished(self, tokens: np.ndarray, valid: np.ndarray | None, prompt: int = 0) -> np.ndarray | None:
        # generate() feeds a row's end-of-sequence token back once, then pad tokens: from that position on the
        # row's outputs are discarded, so they must not touch its state. Only generated tokens count: the first
        # `prompt` positions of this block are prompt (a chat turn continuing a cached sequence holds eos ids)
        if tokens.size == 1 and not self._finished.any():  # batch-1 decoding: no array set operation per token
            if int(tokens[0, 0]) not in self._stop_set or prompt > 0:
                return valid
        hit = np.isin(tokens, self._stop_ids)  # [B, S]
        hit[:, : max(prompt, 0)] = False
        if not hit.any() and not self._finished.any():
            return valid
        done = np.logical_or.accumulate(hit, axis=1) | self._finished[:, None]
        self._finished |= done[:, -1]
        keep = ~done if valid is None else (valid != 0) & ~done
        return None if keep.all() else keep.astype(np.uint8)


def _gate_for(gate: MarginHead | str | Path | None, config: RoutingConfig, calibration: Calibration, shape: dict,
              device: torch.device) -> tuple[MarginHead | None, torch.Tensor | None]:
    """The margin head the routers use and its unit ``lam * delta[l]`` beside it (``ValueError`` where the config
    or calibration cannot carry per-token margins), or (None, None).

    The head is the given one where it already lives on the routers' ``device`` (so training it trains what
    routes), else a copy there (margins computed where the router inputs are, with no transfer per layer): the
    caller's head is never moved. Routers on the meta device hold no values yet, so the head stays where its
    weights are and its margins are moved to the scores."""
    if gate is None:
        return None, None
    from ..gates.margin_head import MarginHead
    from ..policy.margins import margin_scale

    head = MarginHead.coerce(gate)
    head.check(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"], model_type=shape["model_type"])
    if not config.takes_gate:
        raise ValueError(f"gate=: a margin head sets the bonus of a biased policy with a fixed bonus scale; got "
                         f"policy={config.policy!r}, delta_mode={config.delta_mode!r}: use policy='cache_prior' "
                         "(with eviction='lru': the change-based gate) or 'psr', delta_mode='fixed'")
    unit = margin_scale(np.ones(shape["num_layers"]), float(config.lam), calibration.delta)  # lam * delta
    if device.type != "meta" and head.weight.device != device:
        head = copy.deepcopy(head).to(device)
    return head, torch.as_tensor(unit, dtype=torch.float32, device=head.weight.device)
