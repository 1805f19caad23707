"""The Controller: per-row logical caches carried across the forward passes of a patched model, with the user API
and the sequence state machine (ARCHITECTURE.md, "The one decision path").

A forward pass starts a new sequence or continues the current one (:mod:`.routed_sequence` says whether it may);
padded positions and the rows that finished (:mod:`.finished_rows`) never touch the state. A forward pass is closed
however it ends: after any exception (``KeyboardInterrupt`` and ``SystemExit`` included) the sequence is closed and
the offload's slots made consistent, so the next sequence starts cleanly and continuing the stopped one raises. The
callables installed on the model (:mod:`.wrapped_calls`) and the engine's decode handle (:mod:`.decode_handle`)
drive the machine through its underscored transitions, under one re-entrant lock per model.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np
import torch
from numpy.typing import ArrayLike

from ..offload.store import PatchedExpertStore, ResidentExperts
from ..policy.cache import LogicalCache
from ..policy.config import RoutingConfig
from . import inputs
from .decode_handle import DecodeHandle
from .finished_rows import FinishedRows
from .inputs import ForwardPass
from .installation import Installation, refuse_copy
from .margin_gate import gate_for
from .prefetch_sources import prefetch_source
from .recording import Recorder
from .routed_sequence import RoutedSequence
from .routing import LayerRouting
from .statistics import RoutingCounters, RoutingStats

if TYPE_CHECKING:
    from ..gates.margin_head import MarginHead
    from ..offload.experts import OffloadedExperts
    from ..offload.placement import OffloadMemory
    from ..patches.base import ArchitecturePatch, MoELayer

logger = logging.getLogger(__name__)


class Controller:
    """Per-row routing state of one patched model; get it with :func:`psr_hf.controller`.

    One sequence at a time: the model's forward, ``generate()``, a decode handle's step and this object's public
    methods hold one re-entrant lock, so calls from several threads run one after the other (a whole ``generate()``
    at a time) and nested calls in one thread (a composite model calling its language model) pass.

    Attributes: ``config`` (the :class:`RoutingConfig`), ``cache`` (the :class:`~psr_hf.policy.LogicalCache`),
    ``expert_store`` (where the experts live, a :class:`~psr_hf.offload.PatchedExpertStore`), ``layers`` (the
    patched MoE layers), ``num_layers``, ``num_experts``, ``top_k``, ``capacity``.
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
        # where the experts live: the model's own weights until the installer offloads them (patch(..., offload=))
        self.expert_store: PatchedExpertStore = ResidentExperts([layer.block.experts for layer in layers],
                                                                self.num_experts)
        self.routing.store = self.expert_store
        self.installation = Installation()  # what the installer put on the model (psr_hf.hf.installer)
        self._fwd: ForwardPass | None = None
        self._lock = threading.RLock()  # one forward pass or generate() at a time (see the class docstring)
        self._sequence = RoutedSequence()  # the sequence the routing state belongs to
        self._recover_slots = False  # the store's slots still need abort() (an abort that was itself cut short)
        self._bypass = threading.local()  # .depth: bypassed() blocks open in this thread (other threads route)
        self._recorder: Recorder | None = None
        self._rows = FinishedRows()  # rows of the running generate() that finished
        self._right_padded: np.ndarray | None = None  # [R] real lengths of mask-less right-padded rows
        self._decode = DecodeHandle(self)  # the engine's steps; it holds row 0's state while lent to a device
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
        head, unit = gate_for(gate, config, cache.calibration, model_shape, self.routing.devices[0])
        self.config = config
        self.cache = cache
        self.capacity = cache.capacity
        self.calibration = cache.calibration
        self._calibration_given = None if calibration is None else cache.calibration  # what reconfigure() keeps
        self._uses_tokens = bool(cache.calibration.vocab_size) and config.eviction == "score"
        self.routing.configure(config, cache, source)
        self.routing.gate, self.routing.gate_unit = head, unit
        self._rows.reset(1)
        self._totals = RoutingCounters()  # finished sequences since the last reset_stats()

    # ------------------------------------------------------------------ public
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
        """The forward pass (or decode handle's step) open now, None between them."""
        return self._fwd

    @property
    def recording(self) -> bool:
        """Whether a recording runs (:meth:`record`)."""
        return self._recorder is not None

    def decode_handle(self) -> DecodeHandle:
        """The decode path for a batch-1 decoder that runs the layers itself (the engine): one-token steps, each
        MoE layer's selection and prefetch, row 0's state lent to a device decoder (:class:`DecodeHandle`)."""
        return self._decode

    def reset(self) -> None:
        """Start a new sequence in every row (a forward pass does this by itself when a sequence starts); also
        after a forward pass that stopped part-way, to continue its KV cache anyway."""
        with self._lock:
            self._reclaim()
            self._new_sequence(self.cache.rows)
            self._sequence.positions = None  # any KV cache may continue from here

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
            self._sequence.interrupted = None  # the cache is new: no sequence to continue
            self._sequence.positions = None  # any KV cache may continue with the new state
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
            self._sequence.start()

    def reorder(self, index: ArrayLike) -> None:
        """Reorder or expand the rows like the KV cache (beam search): new row ``i`` continues old row ``index[i]``."""
        self._reclaim()
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        self.cache.reorder(index)
        self.routing.reorder(index)
        self._rows.reorder(index)
        if self._recorder is not None:
            self._recorder.reorder(index)

    # ------------------------------------------------------------------ the sequence state machine
    @property
    def _bypassing(self) -> bool:
        """Whether a :meth:`bypassed` block is open in this thread."""
        return getattr(self._bypass, "depth", 0) > 0

    def _reclaim(self) -> None:
        """Take row 0's state back from a device decoder holding it (:meth:`DecodeHandle.lend_state`)."""
        self._decode.reclaim()

    def _current_totals(self) -> RoutingCounters:
        """The counts of the current sequence (every row)."""
        return RoutingCounters.of(self.cache.stats(), self.routing.displaced)

    def _new_sequence(self, rows: int) -> None:
        self._sequence.interrupted = None
        self._sequence.start()
        self._recover()  # slots left inconsistent by a stopped forward whose recovery was itself cut short
        self._totals = self._totals + self._current_totals()
        if self._recorder is not None:
            self._recorder.close_sequence()
        if rows != self.cache.rows:
            self.cache.resize(rows)
        else:
            self.cache.reset()
        self.routing.new_sequence(rows)
        self._rows.reset(rows)
        # every row starts from the warm set: the slots take it
        self.expert_store.new_sequence([self.cache.resident(layer, 0) for layer in range(self.num_layers)])

    def _open(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A wrapped forward's transition: read its input ids, mask and cache length, start a new sequence or
        continue the current one, and open the forward pass. Invalid input raises before anything changes."""
        self._reclaim()
        tokens, mask_host = inputs.read_tokens(args, kwargs, needs_ids=self._uses_tokens)
        B, S = tokens.shape
        past = inputs.past_length(kwargs)
        cache = inputs.kv_cache(kwargs)
        # under exact routing the state never changes an output: a forward that continues another cache (a model
        # that is its own assistant in assisted decoding) starts fresh routing state, as transformers just runs it
        exact = self.config.follows_router
        restart = self._sequence.check_continuation(past, B, self.cache.rows, cache, exact=exact, restart=exact)
        valid = inputs.real_positions(kwargs, mask_host, B, S, past, self._right_padded)
        self._start(module, tokens, valid, past, B, S, restart)
        if cache is not None and (past == 0 or not self._sequence.knows_cache):
            self._sequence.remember_cache(cache)

    def _open_step(self, token_id: int, position: int) -> None:
        """A decode handle's transition: open the one-token forward pass of ``token_id`` after ``position`` cached
        positions (the handle holds the lock)."""
        self._sequence.check_continuation(position, 1, self.cache.rows, exact=self.config.follows_router)
        self._start(None, np.array([[token_id]], dtype=np.int64), None, position, 1, 1)

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
            valid = self._rows.mark(tokens, valid, past)
            if S == 1:  # decoding runs on the cache's own one-position buffers
                io = self.cache.io
                io.tokens[:, 0] = tokens[:, 0]
                io.valid[:, 0] = 1 if valid is None else valid[:, 0]
            self.routing.begin_forward()
            self._fwd = ForwardPass(B, S, tokens, valid, module, past=past)
        except BaseException as error:
            self._abort(error)
            raise

    def _close(self, output: object = None) -> None:
        """The open forward pass ended normally: close it (its layers go to the recording). ``output``: the model's,
        whose KV cache becomes the sequence's where none is known yet (a cache the forward created itself)."""
        fwd, self._fwd = self._fwd, None
        self._sequence.positions = fwd.past + fwd.positions
        if self._recorder is not None:
            self._recorder.end_forward(fwd.tokens, fwd.valid)
        if output is not None and not self._sequence.knows_cache:
            self._sequence.remember_cache(inputs.output_cache(output))

    def _abort(self, error: BaseException) -> None:
        """The open forward pass stopped part-way with ``error``: close it and the sequence it belongs to (its KV
        cache and routing state hold a partial step), and make the store's slots consistent."""
        # first the plain assignments, which nothing can cut short: the next call must not see this forward open
        self._fwd = None
        self._sequence.interrupted = type(error).__name__
        self._recover_slots = True
        self.routing.abort_forward()
        if self._recorder is not None:
            self._recorder.drop_forward()  # the stopped forward's layers are not recorded
        self._recover()

    def _recover(self) -> None:
        if not self._recover_slots:
            return
        try:
            self.expert_store.abort()
        except Exception:  # the error that stopped the forward is the one to report; this one is logged
            logger.exception("psr_hf offload: making the slots consistent after a stopped forward pass failed")
            return
        self._recover_slots = False

    def _decoded_to(self, positions: int) -> None:
        """A device decoder that held the state decoded the current sequence to ``positions`` positions."""
        self._sequence.positions = positions
