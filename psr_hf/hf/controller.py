"""The Controller: per-row logical caches carried across the forward passes of a patched model.

It is the torch side of the one decision path (ARCHITECTURE.md, "The one decision path"):

1. the forward of the model (and of its text decoder, for direct calls) is wrapped: it reads ``input_ids``, the
   attention mask and the cache length: a new sequence resets the rows, padded positions and rows that finished
   are marked so they never touch the state. The wrapper closes the forward pass however it ends: after any
   exception (``KeyboardInterrupt``, ``SystemExit`` and ``GeneratorExit`` included, for which torch's
   ``always_call`` forward hooks do not run) the routing state of the sequence is closed and the offload's slots
   made consistent, so the next sequence starts cleanly and continuing the stopped one raises. Calls from several
   threads are serialised by one re-entrant lock per model (a whole ``generate()`` at a time);
2. each MoE router's forward is replaced: it runs the model's own router, computes the selection scores of this
   layer and the pre-gate of the next, moves both to the host in **one** transfer, and asks the
   :class:`~psr_hf.policy.LogicalCache` for the selection;
3. where the selection equals the router's own top-K the router's own outputs are returned untouched (so exact
   routing is bitwise the unpatched model); elsewhere the selected experts with weights from the unmodified scores;
4. a batch-1 decoder that runs the layers itself (:class:`psr_hf.engine.Decoder`) drives the same decode path
   through :meth:`Controller.step` (or ``begin_step``/``end_step``), :meth:`Controller.select` and
   :meth:`Controller.prefetch`, which share their helpers with the wrapped forward and the router forwards.

Policy rules live only in the kernels; nothing here decides which expert runs. The controller is also the one
owner of what is installed on the model (:meth:`Controller.install`, :meth:`Controller.uninstall`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..policy._kernels import RESIDENT
from ..policy._mass import _finish_layer
from ..policy.cache import LogicalCache, StepPlan
from ..policy.config import RoutingConfig
from ..policy.replaying import Recording
from .masks import valid_positions

logger = logging.getLogger(__name__)

_CACHE_KWARGS = ("past_key_values", "cache")  # transformers 5.17 / 5.23+ names of the KV cache argument
_ATTR = "_psr_hf_controller"  # the model's instance attribute that holds its Controller while it is patched


def cache_keyword(model: torch.nn.Module) -> str:
    """The name of ``model.forward``'s KV cache argument: ``cache`` from transformers 5.23 (``past_key_values``
    warns there), ``past_key_values`` before (5.17 knows only that)."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


@dataclass(frozen=True)
class RoutingStats:
    """Routing statistics of a patched model.

    Per row (``[R]`` arrays) for the current sequence, and ``total`` over every sequence since :func:`patch` or
    :meth:`Controller.reset_stats`; ``offload``: the physical copies (:class:`~psr_hf.offload.OffloadStats`) of an
    offloaded model over the same tokens. Copies are logical cache insertions summed over all MoE layers, per real
    (unpadded) token; ``replaced`` counts selected experts outside the router's own top-K; ``displaced_mass`` is
    the mean over token-layers of the fraction of the router's own top-K weight whose experts were not executed.
    """

    tokens: np.ndarray
    prefetch_per_token: np.ndarray
    demand_per_token: np.ndarray
    copies_per_token: np.ndarray
    replaced_per_token: np.ndarray
    displaced_mass: np.ndarray
    total: dict[str, float] = field(default_factory=dict)
    offload: Any = None  # OffloadStats (physical copies since reset_stats) when the experts are offloaded

    def __repr__(self) -> str:
        t = self.total
        text = (f"RoutingStats(rows={len(self.tokens)}, tokens={int(t.get('tokens', 0))}, "
                f"copies/tok={t.get('copies_per_token', 0.0):.2f} (demand {t.get('demand_per_token', 0.0):.2f}, "
                f"prefetch {t.get('prefetch_per_token', 0.0):.2f}), replaced/tok={t.get('replaced_per_token', 0.0):.2f}"
                f", displaced_mass={t.get('displaced_mass', 0.0):.4f}")
        return text + (", offloaded)" if self.offload is not None else ")")

    def to_dict(self) -> dict[str, Any]:
        rows = {name: getattr(self, name).tolist() for name in (
            "tokens", "prefetch_per_token", "demand_per_token", "copies_per_token", "replaced_per_token",
            "displaced_mass")}
        out: dict[str, Any] = {"rows": rows, "total": dict(self.total)}
        if self.offload is not None:
            out["offload"] = self.offload.to_dict()
        return out


@dataclass(frozen=True)
class Selection:
    """What :meth:`Controller.select` decided for one MoE layer of a batch-1 decode step.

    ``experts``: the ``K`` executed expert ids (host int64, the logical cache's order); ``tensor``: the same
    memory as a ``[1, K]`` int64 tensor (the host staging buffer, pinned and reused for a CUDA device: copy it to
    the device before the next :meth:`Controller.select` of a layer on that device); ``own``: whether the
    selection is the router's own top-K (nothing replaced, no tie across its top-K boundary): then the HF path
    returns the router's own outputs."""

    experts: np.ndarray
    tensor: torch.Tensor
    own: bool


@dataclass
class RoutingCounters:
    """Routing counts summed over rows and MoE layers, from which :attr:`RoutingStats.total` is made. Mutable:
    the controller adds up the counts of finished sequences (``+``) and takes differences (``-``) to start a new
    statistics interval. Floats, as the logical cache's counters they sum."""

    tokens: float = 0.0  # real (unpadded) tokens: per row, the most steps any layer took
    steps: float = 0.0  # token-layers
    prefetch: float = 0.0  # logical prefetch insertions
    demand: float = 0.0  # logical demand insertions
    replaced: float = 0.0  # selected experts outside the router's own top-K
    displaced: float = 0.0  # displaced router mass, summed over token-layers
    sequences: float = 0.0  # rows that saw tokens

    def __add__(self, other: "RoutingCounters") -> "RoutingCounters":
        return RoutingCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "RoutingCounters") -> "RoutingCounters":
        return RoutingCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def to_total(self) -> dict[str, float]:
        """The per-token totals of :attr:`RoutingStats.total` (the keys lm-eval records and the CLI prints)."""
        tokens = max(self.tokens, 1.0)
        prefetch, demand = self.prefetch / tokens, self.demand / tokens
        return {
            "sequences": int(self.sequences),
            "tokens": int(self.tokens),
            "prefetch_per_token": float(prefetch),
            "demand_per_token": float(demand),
            "copies_per_token": float(prefetch + demand),
            "replaced_per_token": float(self.replaced / tokens),
            "displaced_mass": float(self.displaced / max(self.steps, 1.0)),
        }


class Installation:
    """What a :class:`Controller` installed on a model, as the steps that undo it: :meth:`undo` runs them in
    reverse order, so each original is restored over what was installed after it."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def __bool__(self) -> bool:
        return bool(self._undo)

    def add(self, undo: Callable[[], None]) -> None:
        """Remember ``undo`` (no arguments), which removes one thing that was just installed."""
        self._undo.append(undo)

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name`` to ``value`` as an instance attribute (bypassing ``nn.Module.__setattr__``), remembering
        how to restore what the instance had: its own previous attribute, or none (the class's shows again)."""
        had = name in vars(obj)
        previous = vars(obj).get(name)
        object.__setattr__(obj, name, value)

        def undo() -> None:
            if had:
                object.__setattr__(obj, name, previous)
            elif name in vars(obj):
                object.__delattr__(obj, name)

        self._undo.append(undo)

    def undo(self) -> None:
        """Undo every step, the latest first. A step that fails does not stop the others; the first error is
        raised after all of them ran."""
        error: BaseException | None = None
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as exc:  # keep restoring: a half-removed patch is worse than one error
                error = error or exc
        if error is not None:
            raise error


_COPY_REFUSED = (
    "psr_hf: a patched model cannot be deep-copied or pickled (torch.save(model), multiprocessing): its routing state "
    "holds a lock, the offload's copy thread and the replaced router forwards. Copy or pickle the unpatched model "
    "(psr_hf.unpatch(model), or psr_hf.patched(...) as a block) and patch the copy; to store weights use "
    "model.save_pretrained() or torch.save(model.state_dict()), which work on a patched model"
)


def _refuse_copy(*_: Any) -> Any:
    """``__deepcopy__`` / ``__reduce_ex__`` of a patched model and of its controller."""
    raise TypeError(_COPY_REFUSED)


class _Forward:
    """What the opening of the current forward pass learned about it (:meth:`Controller._open`)."""

    __slots__ = ("rows", "positions", "tokens", "valid", "owner", "thread", "past")

    def __init__(self, rows: int, positions: int, tokens: np.ndarray, valid: np.ndarray | None, owner: Any,
                 past: int = 0):
        self.rows = rows  # B
        self.positions = positions  # S
        self.past = past  # cached positions before this forward
        self.tokens = tokens  # [B, S] int64
        self.valid = valid  # [B, S] uint8, or None when every position is real
        self.owner = owner  # the module whose forward opened this forward pass
        self.thread = threading.get_ident()  # the thread that runs it


class Recorder:
    """Captures, per row, the selection scores, pre-gates, token ids and selected experts of every MoE layer.

    Use as a context manager (``with psr_hf.controller(model).record() as rec: model.generate(...)``) or call
    :meth:`stop`. ``rec.recordings`` then holds one :class:`~psr_hf.policy.Recording` per (sequence, row) with only
    the real positions; ``psr_hf.policy.replay(config, recording, calibration=...)`` reproduces its ``selected``.
    """

    def __init__(self, controller: "Controller"):
        self._controller = controller
        self.recordings: list[Recording] = []
        self._chunks: list[tuple[np.ndarray, ...]] = []  # per forward: z [B,S,L,E], g, selected [B,S,L,K], tokens, valid
        self._layers: dict[int, tuple[np.ndarray, np.ndarray | None, np.ndarray]] = {}
        self._sequence = 0
        self.active = True

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> list[Recording]:
        """Stop recording; returns :attr:`recordings` (the open sequence is closed)."""
        if self.active:
            self._close_sequence()
            self.active = False
            if self._controller._recorder is self:
                self._controller._recorder = None
        return self.recordings

    # called by the controller
    def _layer(self, layer: int, z: np.ndarray, g: np.ndarray | None, selected: np.ndarray) -> None:
        self._layers[layer] = (np.array(z, dtype=np.float32), None if g is None else np.array(g, dtype=np.float32),
                               np.array(selected))

    def _end_forward(self, fwd: _Forward) -> None:
        ctl = self._controller
        if len(self._layers) != ctl.num_layers:  # the forward did not reach every MoE layer (an error)
            self._layers.clear()
            return
        B, S = fwd.rows, fwd.positions
        L = ctl.num_layers
        z = np.stack([self._layers[layer][0] for layer in range(L)], axis=2)  # [B, S, L, E]
        g = np.zeros_like(z)
        for layer in range(L):
            if self._layers[layer][1] is not None:
                g[:, :, layer] = self._layers[layer][1]
        selected = np.stack([self._layers[layer][2] for layer in range(L)], axis=2)  # [B, S, L, K]
        valid = np.ones((B, S), dtype=bool) if fwd.valid is None else fwd.valid.astype(bool)
        self._chunks.append((z, g, selected, fwd.tokens.copy(), valid))
        self._layers.clear()

    def _reorder(self, index: np.ndarray) -> None:
        self._chunks = [tuple(a[index] for a in chunk) for chunk in self._chunks]

    def _close_sequence(self) -> None:
        if not self._chunks:
            return
        ctl = self._controller
        z, g, selected, tokens, valid = (np.concatenate(parts, axis=1) for parts in zip(*self._chunks))
        for row in range(z.shape[0]):
            keep = valid[row]
            self.recordings.append(Recording(
                scores=np.ascontiguousarray(z[row, keep]),
                pregate=np.ascontiguousarray(g[row, keep]),
                tokens=np.ascontiguousarray(tokens[row, keep], dtype=np.int64),
                selected=np.sort(selected[row, keep], axis=-1).astype(np.int64),
                top_k=ctl.top_k,
                default_window=ctl.default_window,
                sequence=self._sequence,
                row=row,
            ))
        self._chunks = []
        self._sequence += 1


def predicted_priorities(logits: torch.Tensor) -> torch.Tensor:
    """A learned predictor's token-level priorities from its logits: ``softmax`` in float32."""
    return torch.softmax(logits.float(), dim=-1)


class Controller:
    """Per-row routing state of one patched model; get it with :func:`psr_hf.controller`.

    One sequence at a time: the model's forward, ``generate()`` and this object's public methods hold one
    re-entrant lock, so calls from several threads run one after the other (a whole ``generate()`` at a time) and
    nested calls in one thread (a composite model calling its language model) pass.

    Attributes: ``config`` (the :class:`RoutingConfig`), ``cache`` (the :class:`~psr_hf.policy.LogicalCache`),
    ``layers`` (the patched MoE layers), ``num_layers``, ``num_experts``, ``top_k``, ``capacity``.
    """

    __deepcopy__ = __reduce_ex__ = _refuse_copy  # reached through a submodule that holds it, too

    def __init__(self, model: torch.nn.Module, family: Any, layers: list, config: RoutingConfig,
                 calibration: Any, predictor: Any = None):
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
        self.offload: Any = None  # the OffloadEngine when the experts are offloaded (patch(..., offload=...))
        self._fwd: _Forward | None = None
        self._lock = threading.RLock()  # one forward pass or generate() at a time (see the class docstring)
        self._interrupted: str | None = None  # why the last forward pass stopped part-way; None once a new one starts
        self._sequence_positions: int | None = None  # positions the current sequence's routing state has seen
        self._sequence_cache: Any = None  # weak reference to the KV cache its forward passes filled
        self._recover_offload = False  # the offload's slots still need recover() (an abort that was itself cut short)
        self._pregate: list[np.ndarray | None] = [None] * self.num_layers  # host pre-gate of each layer, this forward
        self._bypass = 0
        # layer -> (positions, count, chosen [N, K], flags [N]) of the last forward pass that ran with grad in training
        # mode: a backward pass that recomputes layers (gradient checkpointing) routes them as that pass did
        self._decisions: dict[int, tuple[int, int, torch.Tensor, np.ndarray]] = {}
        self._recorder: Recorder | None = None
        self._stop_ids: np.ndarray = np.zeros(0, dtype=np.int64)
        self._prompt_length = 0  # length of the current generate() call's input ids (cached part included)
        self._in_generate = 0
        self._right_padded: np.ndarray | None = None  # [R] real lengths of mask-less right-padded rows
        self._installation = Installation()  # what install() put on the model; uninstall() removes it
        self._stacked: dict[int, tuple[tuple, torch.Tensor]] = {}  # layer -> (weights' identity, [2E, H])
        self._pinned: dict[torch.device, torch.Tensor] = {}  # host staging buffers for selections, per device
        self._staging_views: dict[tuple, tuple[np.ndarray, torch.Tensor]] = {}
        self._flags = np.zeros(1, dtype=np.uint8)
        self._devices = [layer.router.weight.device for layer in layers]
        self._all_valid = np.zeros(0, dtype=np.uint8)  # the kernels read an empty mask as "every position real"
        # the family's router bias per layer on the host (displaced mass), read at every sequence start: a model built
        # on the meta device has none until its weights load, and training or load_state_dict may change it
        self._mass_bias: list[np.ndarray] = [np.zeros(0)] * len(layers)
        self.predictor: Any = None
        self._previous: np.ndarray | None = None  # prefetch="previous": [L, R, E] each row's last real z per layer
        self._configure(config, calibration, predictor)

    def _set_predictor(self, config: RoutingConfig, predictor: Any) -> None:
        """The learned prefetch ranking of ``RoutingConfig(prefetch="predictor")`` (a
        :class:`psr_hf.prefetch.Predictor`, read by duck typing: ``weight(pair)`` and ``check(...)``), checked
        against the model."""
        if config.prefetch != "predictor":
            if predictor is not None:
                raise ValueError("a predictor was given but the RoutingConfig ranks prefetches by the pre-gate "
                                 "(prefetch='pregate'); set RoutingConfig(prefetch='predictor', ...) to use it")
            self.predictor = None
            return
        if predictor is None:
            raise ValueError("RoutingConfig(prefetch='predictor') needs the predictor: patch(model, config, "
                             "predictor=psr_hf.prefetch.Predictor.load(path)) (train one with psr-hf "
                             "train-predictor)")
        if not callable(getattr(predictor, "weight", None)) or not callable(getattr(predictor, "check", None)):
            raise ValueError(f"predictor must be a psr_hf.prefetch.Predictor (psr_hf.prefetch.Predictor.load(path) "
                             f"reads a saved one); got {type(predictor).__name__}")
        hidden = int(self.layers[0].router.weight.shape[1])
        model_type = getattr(self.family.config, "model_type", None)
        predictor.check(num_layers=self.num_layers, num_experts=self.num_experts, hidden_size=hidden,
                        model_type=model_type, top_k=self.top_k)
        self.predictor = predictor

    def _configure(self, config: RoutingConfig, calibration: Any, predictor: Any = None) -> None:
        """Everything that follows from the routing config: the logical cache, fresh rows and zero statistics."""
        self._set_predictor(config, predictor)
        self._stacked.clear()
        self._from_previous = config.prefetch == "previous"
        vocab = getattr(self.family.config, "vocab_size", None)
        cache = LogicalCache(
            config, num_layers=self.num_layers, num_experts=self.num_experts, top_k=self.top_k,
            calibration=calibration, rows=1, default_window=self.default_window, vocab_size=vocab,
        )
        self.config = config
        self.cache = cache
        self.capacity = cache.capacity
        self.calibration = cache.calibration
        self._calibration_given = None if calibration is None else cache.calibration  # what reconfigure() keeps
        self._needs_pregate = config.needs_pregate
        self._spec = config.executes_pregate
        self._uses_tokens = bool(cache.calibration.vocab_size) and config.eviction == "score"
        self._displaced = np.zeros((self.num_layers, 1))  # [L, R] displaced-mass sums
        self._finished = np.zeros(1, dtype=bool)  # [R] rows that ended in generate()
        self._totals = RoutingCounters()  # finished sequences since the last reset_stats()
        self._start_previous(1)

    # ------------------------------------------------------------------ public
    @property
    def rows(self) -> int:
        return self.cache.rows

    def reset(self) -> None:
        """Start a new sequence in every row (a forward pass does this by itself when a sequence starts); also
        after a forward pass that stopped part-way, to continue its KV cache anyway."""
        with self._lock:
            self._new_sequence(self.rows)
            self._sequence_positions = None  # any KV cache may continue from here

    def refresh_experts(self) -> None:
        """Offloaded model: copy every expert slot again from the host store. Changes of the expert weights are
        found by themselves at the next forward pass (version counters, identity, dtype and device of the
        parameters); only edits that bypass the version counter (through ``param.data`` or another alias of the
        storage) need this call."""
        with self._lock:
            if self.offload is None:
                raise ValueError("this model is not offloaded: its experts compute from the model's own weights")
            self.offload.refresh()

    def reset_stats(self) -> None:
        """Zero the totals of :meth:`stats` (the per-row counters of the current sequence are kept), and the
        offload's copy counters."""
        with self._lock:
            self._totals = RoutingCounters() - self._current_totals()
            if self.offload is not None:
                self.offload.reset_stats()

    def reconfigure(self, config: Any, calibration: Any = None, predictor: Any = None) -> None:
        """Route with another :class:`RoutingConfig` (or a dict of its fields, or its YAML file) and calibration
        from the next forward pass on, without unpatching: an offloaded model keeps its host store and gets new
        slots if the capacity changed. Starts a new sequence and zeroes every statistic.

        ``calibration``: default (None) the one the model routes with now (given to :func:`~psr_hf.patch` or to
        an earlier ``reconfigure``); ``False`` routes uncalibrated (running bonus scale, the first experts as the
        warm set, no token prior). ``predictor``: for ``prefetch="predictor"`` (default: the one the model has)."""
        config = RoutingConfig.coerce(config)
        if predictor is None and config.prefetch == "predictor":
            predictor = self.predictor
        if calibration is None:
            calibration = self._calibration_given
        elif calibration is False:
            calibration = None
        with self._lock:
            if self._fwd is not None:
                raise RuntimeError("psr_hf: reconfigure() inside a forward pass of the patched model")
            self._configure(config, calibration, predictor)
            self._interrupted = None  # the cache is new: no sequence to continue
            self._sequence_positions = None  # any KV cache may continue with the new state
            if self.offload is not None:
                if self.offload.capacity != self.capacity:
                    self.offload.resize(self.capacity)
                self.offload.reset_stats()
        logger.info("psr_hf: reconfigured to %s, capacity %d of %d experts", config.policy, self.capacity,
                    self.num_experts)

    def memory(self) -> Any:
        """Where the experts are (:class:`~psr_hf.offload.OffloadMemory`); only for an offloaded model."""
        if self.offload is None:
            raise ValueError("this model is not offloaded: patch it with offload=psr_hf.OffloadConfig(...)")
        return self.offload.memory()

    def stats(self) -> RoutingStats:
        """Copies per token, replaced router slots and displaced router mass, per row and in total."""
        with self._lock:
            return self._stats()

    def _stats(self) -> RoutingStats:
        s = self.cache.stats()
        tokens = s.steps.max(axis=0)  # [R]
        per = np.maximum(tokens, 1)
        steps = np.maximum(s.steps.sum(axis=0), 1)
        prefetch, demand = s.prefetch.sum(axis=0) / per, s.demand.sum(axis=0) / per
        total = self._totals + self._current_totals()
        return RoutingStats(
            tokens=tokens,
            prefetch_per_token=prefetch,
            demand_per_token=demand,
            copies_per_token=prefetch + demand,
            replaced_per_token=s.replaced.sum(axis=0) / per,
            displaced_mass=self._displaced.sum(axis=0) / steps,
            total=total.to_total(),
            offload=None if self.offload is None else self.offload.stats(int(total.tokens)),
        )

    def record(self) -> Recorder:
        """Start recording (see :class:`Recorder`); a recording already running is stopped first."""
        with self._lock:
            if self._recorder is not None:
                self._recorder.stop()
            self._recorder = Recorder(self)
            return self._recorder

    @contextlib.contextmanager
    def right_padded(self, lengths: Any) -> Iterator[None]:
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
        """Run the model's own routers inside this block: no state is read or changed (used by calibration)."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    # ------------------------------------------------------------------ batch-1 external decoder
    # The decode (one row, one position) path of the wrapped forward, for a decoder that runs the layers itself
    # (psr_hf.engine.Decoder). Per token: ``with ctl.step(token_id, position):`` (or begin_step ... end_step),
    # then for each MoE layer in order ``select(layer, z, g_next)`` and, where the layer has a next MoE layer,
    # ``prefetch(layer + 1)`` before the layer's experts run. The router forwards of the HF path run the same
    # helpers (_start, _decode_select, _decide, _decode_prefetch, _close), so both make the same decisions and
    # count the same statistics; the rules stay in the LogicalCache.
    @property
    def needs_pregate(self) -> bool:
        """Whether the policy reads the next layer's pre-gate (pass ``pregate`` to :meth:`select`)."""
        return self._needs_pregate

    def begin_step(self, token_id: int, position: int) -> None:
        """Open a one-token forward pass of one row, as the wrapped forward does for ``input_ids`` ``[1, 1]``
        with ``position`` cached positions before it: position 0 starts a new sequence (closing the recording's
        previous one and, offloaded, copying the warm set into the slots), a later one continues the current
        sequence (``RuntimeError`` if the previous forward stopped part-way, or the sequence has several rows).
        The offloaded model's slots are synchronised with its weights (:meth:`OffloadEngine.sync_weights`).

        Takes the controller's lock until :meth:`end_step` or :meth:`abort_step` (the same thread may nest);
        :meth:`step` pairs them."""
        position = int(position)
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        self._lock.acquire()
        try:
            if self._fwd is not None:
                raise RuntimeError("psr_hf: begin_step() while a forward pass of the patched model is open")
            if self._bypass:
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

    def select(self, layer: int, scores: Any, pregate: Any = None) -> Selection:
        """MoE layer ``layer``'s selection in the open step: ``scores`` ``[E]`` (or ``[1, E]``) are the family's
        selection scores of this layer (``router_scores[:E]``), ``pregate`` those of the next MoE layer on this
        layer's input (``router_scores[E:]``; kept only when :attr:`needs_pregate` and a next layer exists).

        Runs part 2 of the layer (parts 1 and 2 where the policy has no pre-gate) on the cache's own buffers,
        the recording, the statistics (copies, replaced slots, displaced mass) and, offloaded, the slot
        scheduler's demand copies (``route(..., mirror=True)``). Exactly the HF router forward's decode path."""
        self._require_step("select")
        E = self.num_experts
        z = np.ascontiguousarray(np.asarray(scores, dtype=np.float32).reshape(1, 1, E))
        mode = "select" if self._needs_pregate and (layer or layer + 1 < self.num_layers) else "both"
        plan = self._decode_select(layer, z[:, 0], mode)
        count, tensor, _, chosen = self._decide(layer, plan, z)
        if self._from_previous:
            if layer + 1 < self.num_layers:  # the previous token's scores of the next layer, then this token's
                self._pregate[layer + 1] = self._previous[layer + 1][:, None].copy()
            self._remember(layer, z)
        elif pregate is not None and self._needs_pregate and layer + 1 < self.num_layers:
            # a copy: the caller's buffer is rewritten by the next layer before this pre-gate is read
            self._pregate[layer + 1] = np.array(pregate, dtype=np.float32, order="C").reshape(1, 1, E)
        return Selection(experts=chosen[0], tensor=tensor, own=count == 0)

    def prefetch(self, layer: int) -> bool:
        """Part 1 of MoE layer ``layer`` (>= 1) from the pre-gate the previous layer's :meth:`select` stored, and,
        offloaded, its prefetch copies: call it after the previous layer's selection, before that layer's experts
        run (its copies overlap with them). Does nothing (returns False) when the policy has no pre-gate, as in
        the HF path."""
        self._require_step("prefetch")
        if not self._needs_pregate:
            return False
        g = self._pregate[layer] if 0 < layer < self.num_layers else None
        if g is None:
            raise RuntimeError(f"psr_hf: prefetch({layer}) before select({layer - 1}) gave its pre-gate")
        self._decode_prefetch(layer, g[:, 0])
        return True

    def _require_step(self, what: str) -> _Forward:
        fwd = self._fwd
        if fwd is None or fwd.owner is not None or fwd.thread != threading.get_ident():
            raise RuntimeError(f"psr_hf: {what}() outside a step opened by begin_step() in this thread")
        return fwd

    # ------------------------------------------------------------------ installation
    @property
    def installed(self) -> bool:
        """Whether :meth:`install` put this controller on its model (and :meth:`uninstall` has not removed it)."""
        return bool(self._installation)

    def install(self, offload: Any = None) -> None:
        """Put cache-aware routing on the model, in this order: each MoE router's forward replaced, the forward of
        the model and of its text decoder wrapped, ``generate()`` and ``_reorder_cache()`` wrapped, the experts
        offloaded when ``offload`` (an :class:`~psr_hf.offload.OffloadConfig`, or None) is given, and last the
        model's attribute that :func:`psr_hf.controller` reads. All or nothing: if a step fails, what the earlier
        ones installed is removed and the error is raised. Returns None; :meth:`uninstall` undoes it."""
        if self.installed:
            raise RuntimeError("psr_hf: this controller is already installed; uninstall() it first")
        try:
            self._install_routers()
            self._install_forwards()
            self._install_generate()
            if offload is not None:
                self._install_offload(offload)
            self._installation.set_attr(self.model, _ATTR, self)
            # copy.deepcopy and pickle (torch.save(model) too) look these up on the instance first
            self._installation.set_attr(self.model, "__deepcopy__", _refuse_copy)
            self._installation.set_attr(self.model, "__reduce_ex__", _refuse_copy)
        except BaseException:
            try:
                self.uninstall()
            except Exception:  # the install step's error is the one to report; this one is logged
                logger.exception("psr_hf: removing what a failed install had put on the model failed as well")
            raise

    def uninstall(self) -> None:
        """Remove everything :meth:`install` put on the model, the latest first (the offload first: the weights
        go back to their devices and the model's own experts implementation is restored), so that the model
        computes exactly as before. Idempotent. Waits for a forward pass or ``generate()`` running in another thread."""
        with self._lock:
            self._installation.undo()

    def _install_routers(self) -> None:
        for layer in self.layers:
            router = layer.router
            self._installation.set_attr(router, "forward", self._router_forward(layer, router.forward))

    def _install_forwards(self) -> None:
        # the model itself, and its decoder for direct calls (the composite model's language model). A wrapper of
        # forward rather than forward hooks: torch runs always_call forward hooks only after an Exception, and the
        # forward pass must be closed after any BaseException (Ctrl-C in a notebook, SystemExit, GeneratorExit)
        for module in dict.fromkeys((self.model, self.family.decoder())):
            self._installation.set_attr(module, "forward", self._forward_wrapper(module, module.forward))

    def _install_generate(self) -> None:
        model = self.model
        self._installation.set_attr(model, "_reorder_cache",
                                    self._reorder_cache_wrapper(getattr(model, "_reorder_cache", None)))
        if hasattr(model, "generate"):
            self._installation.set_attr(model, "generate", self._generate_wrapper(model.generate))

    def _install_offload(self, config: Any) -> None:
        """Move the experts to a host store with device slots (:class:`~psr_hf.offload.OffloadEngine`)."""
        from ..offload.engine import OffloadEngine

        engine = OffloadEngine(self.model, self.layers, self.num_experts, self.capacity, config)

        def detach() -> None:
            self.offload = None
            try:
                engine.close()
            finally:
                self._devices = [layer.router.weight.device for layer in self.layers]

        self._installation.add(detach)
        self.offload = engine
        # the routers may have moved to the offload device: the selections are staged for that device
        self._devices = [layer.router.weight.device for layer in self.layers]

    # ------------------------------------------------------------------ sequence and rows
    def _current_totals(self) -> RoutingCounters:
        """The counts of the current sequence (every row)."""
        s = self.cache.stats()
        tokens = s.steps.max(axis=0)  # [R]
        return RoutingCounters(
            tokens=float(tokens.sum()),
            steps=float(s.steps.sum()),
            prefetch=float(s.prefetch.sum()),
            demand=float(s.demand.sum()),
            replaced=float(s.replaced.sum()),
            displaced=float(self._displaced.sum()),
            sequences=float((tokens > 0).sum()),  # rows that saw tokens
        )

    def _discard_sequence(self) -> None:
        """Forget the current sequence: its statistics and recording are dropped, not added to the totals (the
        engine calls this before it re-runs the same sequence from its start on the transformers path, which
        routes and counts it again)."""
        with self._lock:
            if self._fwd is not None:
                raise RuntimeError("psr_hf: a sequence cannot be discarded inside its forward pass")
            self.cache.reset()
            self._displaced[:] = 0.0
            if self._recorder is not None:
                self._recorder._chunks = []
            self._sequence_positions, self._sequence_cache = 0, None

    @property
    def _outputs_exact(self) -> bool:
        """Exact routing: every output is the unpatched model's whatever the routing state holds."""
        return self.config.policy == "exact"

    def _read_mass_bias(self) -> None:
        biases = [self.family.mass_bias(layer.router) for layer in self.layers]
        self._mass_bias = [np.zeros(0) if b is None else b for b in biases]

    def _new_sequence(self, rows: int) -> None:
        self._interrupted = None
        self._sequence_positions, self._sequence_cache = 0, None  # set by the sequence's forward passes
        self._recover()  # slots left inconsistent by a stopped forward whose recovery was itself cut short
        self._totals = self._totals + self._current_totals()
        if self._recorder is not None:
            self._recorder._close_sequence()
        self._stacked.clear()  # the model may have moved between sequences
        self._devices = [layer.router.weight.device for layer in self.layers]
        self._read_mass_bias()
        if rows != self.cache.rows:
            self.cache.resize(rows)
        else:
            self.cache.reset()
        self._displaced = np.zeros((self.num_layers, rows))
        self._finished = np.zeros(rows, dtype=bool)
        self._start_previous(rows)
        if self.offload is not None:  # every row starts from the warm set: copy it into the slots
            self.offload.new_sequence([self.cache.resident(layer, 0) for layer in range(self.num_layers)])

    def reorder(self, index: Any) -> None:
        """Reorder or expand the rows like the KV cache (beam search): new row ``i`` continues old row ``index[i]``."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        self.cache.reorder(index)
        self._displaced = self._displaced[:, index]
        self._finished = self._finished[index]
        if self._previous is not None:
            self._previous = np.ascontiguousarray(self._previous[:, index])
        if self._recorder is not None:
            self._recorder._reorder(index)

    # ------------------------------------------------------------------ forward passes
    def _forward_wrapper(self, module: torch.nn.Module, original: Callable) -> Callable:
        """The forward that replaces ``module``'s (the model's or its decoder's; ``original`` bound): the same name,
        docstring and signature (``functools.wraps``), which opens the forward pass, runs ``original`` and closes
        the forward pass however it ends, holding the controller's lock."""

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                if self._fwd is not None:  # nested in this thread's open forward (composite -> language model)
                    return original(*args, **kwargs)
                if self._bypass:
                    return self._bypassed_forward(original, args, kwargs)
                self._open(module, args, kwargs)
                try:
                    output = original(*args, **kwargs)
                except BaseException as error:  # KeyboardInterrupt, SystemExit, GeneratorExit too
                    self._abort(error)
                    raise
                self._close()
                if self._sequence_cache is None:  # a cache the forward created itself (either field name)
                    cache = getattr(output, "past_key_values", None)
                    self._remember_cache(getattr(output, "cache", None) if cache is None else cache)
                return output

        return forward

    def _bypassed_forward(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        # the model's own routing (calibration): no state is read or changed, but an offloaded model's slots must
        # hold the current weights, and be consistent after an error
        if self.offload is not None:
            self._check_offload_device()
            self.offload.sync_weights(self._resident)
        try:
            return original(*args, **kwargs)
        except BaseException:
            if self.offload is not None:
                self.offload.abort()
            raise

    def _abort(self, error: BaseException) -> None:
        """The open forward pass stopped part-way with ``error``: close it and the sequence it belongs to (its KV
        cache and routing state hold a partial step), and make the offload's slots consistent."""
        # first the plain assignments, which nothing can cut short: the next call must not see this forward open
        self._fwd = None
        self._interrupted = type(error).__name__
        self._recover_offload = self.offload is not None
        self._pregate = [None] * self.num_layers
        if self._recorder is not None:
            self._recorder._layers.clear()  # the stopped forward's layers are not recorded
        self._recover()

    def _remember_cache(self, cache: Any) -> None:
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
            self._recorder._end_forward(fwd)

    def _recover(self) -> None:
        if not self._recover_offload:
            return
        if self.offload is not None:
            try:
                self.offload.abort()
            except Exception:  # the error that stopped the forward is the one to report; this one is logged
                logger.exception("psr_hf offload: making the slots consistent after a stopped forward pass failed")
                return
        self._recover_offload = False

    def _check_offload_device(self) -> None:
        device = self.layers[0].router.weight.device
        if device != self.offload.device:
            raise ValueError(
                f"psr_hf offload: the model's weights are on {device}, but it was offloaded to compute on "
                f"{self.offload.device} (the model was moved after patching); psr_hf.unpatch(model), move it, and "
                f"patch it again with OffloadConfig(device=...)"
            )

    def _open(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Read the forward's input ids, mask and cache length, start a new sequence or continue the current one,
        and open the forward pass. Invalid input raises before anything changes."""
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        mask = kwargs.get("attention_mask")
        mask_host = None
        if ids is not None:
            B, S = int(ids.shape[0]), int(ids.shape[1])
            if (isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[0] == B and mask.shape[1] >= S
                    and mask.device == ids.device):
                # token ids and the mask of these positions in one transfer (one synchronisation)
                both = torch.cat((ids.detach().long(), mask[:, -S:].detach().long()), dim=1).cpu().numpy()
                tokens, mask_host = np.ascontiguousarray(both[:, :S]), both[:, S:]
            else:
                tokens = ids.detach().to("cpu", torch.int64).numpy()
        else:
            embeds = kwargs.get("inputs_embeds")
            if embeds is None:
                raise ValueError("psr_hf: the forward got neither input_ids nor inputs_embeds")
            if self._uses_tokens:
                raise ValueError(
                    "psr_hf: score eviction with a calibrated token prior needs the input token ids, but the model "
                    "was called with inputs_embeds only; pass input_ids (or patch with eviction='lru')"
                )
            B, S = int(embeds.shape[0]), int(embeds.shape[1])
            tokens = np.zeros((B, S), dtype=np.int64)
        past = self._past_length(kwargs)
        cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        # under exact routing the state never changes an output: a forward that continues another cache (a model
        # that is its own assistant in assisted decoding) starts fresh routing state, as transformers just runs it
        restart = self._check_continuation(past, B, cache, restart=self._outputs_exact)
        if mask_host is not None:
            valid = None if mask_host.all() else (mask_host != 0).astype(np.uint8)
        else:
            valid = valid_positions(mask, B, S, past, kwargs.get("cache_position"))
        if mask is None and self._right_padded is not None:
            valid = self._valid_from_lengths(self._right_padded, B, S, past)
        self._start(module, tokens, valid, past, B, S, restart)
        if cache is not None and (past == 0 or self._sequence_cache is None):
            self._remember_cache(cache)

    def _check_continuation(self, past: int, B: int, cache: Any = None, restart: bool = False) -> bool:
        """A forward of ``B`` rows after ``past`` cached positions (in the KV cache ``cache``, if given) may
        continue the current sequence: the one whose routing state this is, so the same cache object as the
        sequence's forward passes used (when both are known) and no more cached positions than the routing state
        has seen (fewer: a cache cropped in place, as assisted decoding does). Where it may not: a
        ``RuntimeError``, or with ``restart`` True (the routing state starts afresh for this forward)."""
        try:
            self._check_continuing(past, B, cache)
        except RuntimeError:
            if not restart:
                raise
            logger.debug("psr_hf: a forward continues another sequence's KV cache; fresh routing state (exact routing)")
            return True
        return False

    def _check_continuing(self, past: int, B: int, cache: Any) -> None:
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

    def _start(self, module: Any, tokens: np.ndarray, valid: np.ndarray | None, past: int, B: int, S: int,
               restart: bool = False) -> None:
        """Open the forward pass of ``tokens`` [B, S] (``valid``: its real positions, None: all) after ``past``
        cached positions: a new sequence when ``past`` is 0 (or ``restart``), else the current one continues."""
        if self.offload is not None:
            self._check_offload_device()
        try:  # from here on the state changes: a stop part-way closes the sequence
            if self.offload is not None:
                self._recover()
                self.offload.sync_weights(self._resident)
            if past == 0 or restart:
                self._new_sequence(B)
            if self._in_generate and past > 0 and self._stop_ids.size:
                valid = self._mark_finished(tokens, valid, prompt=self._prompt_length - past)
            if S == 1:  # decoding runs on the cache's own one-position buffers
                io = self.cache.io
                io.tokens[:, 0] = tokens[:, 0]
                io.valid[:, 0] = 1 if valid is None else valid[:, 0]
            self._pregate = [None] * self.num_layers
            self._decisions = {}
            self._fwd = _Forward(B, S, tokens, valid, module, past=past)
        except BaseException as error:
            self._abort(error)
            raise

    @staticmethod
    def _past_length(kwargs: dict) -> int:
        cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        if cache is None:
            return 0
        if hasattr(cache, "get_seq_length"):
            return int(cache.get_seq_length())
        raise ValueError(
            f"psr_hf: unsupported KV cache type {type(cache).__name__} (no get_seq_length()); use a transformers Cache"
        )

    @staticmethod
    def _valid_from_lengths(lengths: np.ndarray, B: int, S: int, past: int) -> np.ndarray | None:
        if lengths.shape != (B,):
            raise ValueError(f"psr_hf: right_padded() got {lengths.shape[0]} lengths for a batch of {B} rows")
        valid = past + np.arange(S)[None, :] < lengths[:, None]  # [B, S]
        return None if valid.all() else valid.astype(np.uint8)

    def _mark_finished(self, tokens: np.ndarray, valid: np.ndarray | None, prompt: int = 0) -> np.ndarray | None:
        # generate() feeds a row's end-of-sequence token back once, then pad tokens: from that position on the
        # row's outputs are discarded, so they must not touch its state. Only generated tokens count: the first
        # `prompt` positions of this block are prompt (a chat turn continuing a cached sequence holds eos ids)
        hit = np.isin(tokens, self._stop_ids)  # [B, S]
        hit[:, : max(prompt, 0)] = False
        if not hit.any() and not self._finished.any():
            return valid
        done = np.logical_or.accumulate(hit, axis=1) | self._finished[:, None]
        self._finished |= done[:, -1]
        keep = ~done if valid is None else (valid != 0) & ~done
        return None if keep.all() else keep.astype(np.uint8)

    def _reorder_cache_wrapper(self, original: Callable | None) -> Callable:
        """The model's ``_reorder_cache`` (None: it has none, and the KV cache reorders itself) that also reorders
        the per-row state like the KV cache (beam search)."""
        if original is None:
            def _reorder_cache(past_key_values: Any, beam_idx: torch.Tensor) -> Any:
                """Reorder the KV cache ``past_key_values`` and psr_hf's per-row state by ``beam_idx``; returns the
                reordered cache."""
                return self._reorder_cache(None, past_key_values, beam_idx)

            return _reorder_cache

        @functools.wraps(original)
        def reorder_cache(past_key_values: Any, beam_idx: torch.Tensor) -> Any:
            return self._reorder_cache(original, past_key_values, beam_idx)

        return reorder_cache

    def _generate_wrapper(self, original: Callable) -> Callable:
        """The model's ``generate`` that also tells the controller the stop tokens and the prompt length."""

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            return self._generate(original, *args, **kwargs)

        return generate

    def _reorder_cache(self, original: Callable | None, past: Any, beam_idx: torch.Tensor) -> Any:
        self.reorder(beam_idx.detach().to("cpu").numpy())
        if original is not None:
            return original(past, beam_idx)
        past.reorder_cache(beam_idx)
        return past

    def _generate(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        with self._lock:  # a whole generate() at a time: its forwards continue one sequence
            return self._generate_locked(original, *args, **kwargs)

    def _refuse_right_padding(self, mask: Any) -> None:
        """generate() continues every row from the batch's last position: a row whose attention mask has a 0 after
        its last 1 (padding on the right while other rows are longer) would continue from padding. Under exact
        routing the outputs are the unpatched model's whatever the padding, so transformers' own warning is what
        the user gets; under a cache-aware policy the garbage continuation would be charged to the routing."""
        if self._outputs_exact:
            return
        if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[1] == 0:
            return
        real = mask.detach() != 0
        padded = (~real[:, -1] & real.any(dim=1)).to("cpu")  # [B]: a real token before, padding at the end
        if bool(padded.any()):
            rows = np.flatnonzero(padded.numpy()).tolist()
            raise ValueError(
                f"psr_hf: generate() got a right-padded batch (row{'s' if len(rows) > 1 else ''} "
                f"{', '.join(map(str, rows[:8]))}{', ...' if len(rows) > 8 else ''} of the attention_mask end in "
                "padding after real tokens): generation continues every row from the last position, so right "
                "padding gives garbage continuations (transformers only warns), which a comparison of policies "
                'would charge to the routing. Pad on the left: tokenizer.padding_side = "left"'
            )

    def _generate_locked(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        self._refuse_right_padding(kwargs.get("attention_mask"))
        eos = kwargs.get("eos_token_id")
        if eos is None:
            config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
            eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, torch.Tensor):
            eos = eos.tolist()
        stop = np.asarray([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), dtype=np.int64)
        prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if prompt is None:
            prompt = kwargs.get("inputs_embeds")
        previous = self._stop_ids, self._prompt_length
        self._stop_ids = stop
        self._prompt_length = int(prompt.shape[1]) if isinstance(prompt, torch.Tensor) and prompt.ndim >= 2 else 0
        # a call that continues a cached sequence gives every row new input: rows that finished before run again
        self._finished[:] = False
        self._in_generate += 1
        try:
            return original(*args, **kwargs)
        finally:
            self._in_generate -= 1
            self._stop_ids, self._prompt_length = previous

    # ------------------------------------------------------------------ routing
    def _router_forward(self, layer: Any, original: Callable) -> Callable:
        """The forward that replaces ``layer``'s router forward ``original`` (bound): the same name, docstring and
        signature (``functools.wraps``; ``__wrapped__`` is ``original``), the routing of this module's docstring."""
        index = layer.index
        router = layer.router
        following = self.layers[index + 1].router if index + 1 < self.num_layers else None

        @functools.wraps(original)
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._bypass:
                return original(hidden_states, *args, **kwargs)
            fwd = self._fwd
            if fwd is None and index in self._decisions and _in_backward():
                return self._recompute(index, router, original(hidden_states, *args, **kwargs))
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
            if following is not None and self._needs_pregate:  # read per call: reconfigure() may change it
                return self._route_joint(index, router, following, hidden_states,
                                         lambda: original(hidden_states, *args, **kwargs))
            own = original(hidden_states, *args, **kwargs)
            return self._route_own(index, router, own)

        return forward

    def _route_own(self, layer: int, router: Any, own: tuple) -> tuple:
        """Layers that need no pre-gate of the next layer: the router runs first, its logits give the scores."""
        fwd = self._fwd
        with torch.no_grad():  # the host's copy only: nothing of it is saved for a backward pass
            z = self.family.selection_scores(router, own[0].detach())  # [N, E]
        z_host = _host(z).reshape(fwd.rows, fwd.positions, self.num_experts)  # the one transfer of this layer
        if fwd.positions == 1:
            # part 1 of this layer already ran in the previous layer's call when the policy inserts
            plan = self._decode_select(layer, z_host[:, 0], "select" if self._needs_pregate and layer else "both")
        else:
            if self._from_previous and layer:
                self._pregate[layer] = self._previous_pregate(layer, z_host)
            plan = self.cache.step(layer, z_host, self._pregate[layer], fwd.tokens, fwd.valid)
        if self._from_previous:
            self._remember(layer, z_host)
        return self._execute(layer, router, plan, z_host, own[0], own, None)

    def _route_joint(self, layer: int, router: Any, following: Any, hidden: torch.Tensor,
                     run_own: Callable[[], tuple]) -> tuple:
        """This layer's scores and the next layer's pre-gate from one matmul, moved to the host in one transfer;
        the model's own router runs afterwards, and only where the selection is the router's own top-K."""
        fwd = self._fwd
        B, S, E = fwd.rows, fwd.positions, self.num_experts
        with torch.no_grad():  # the host's copy and the untrained path's logits: nothing saved for a backward pass
            raw, both = self.joint_scores(layer, hidden)
        host = _host(both)  # [N, 2E]: this layer's z | next pre-gate
        logits = _Lazy(raw, E)  # this layer's logits, sliced only if the selection needs them
        # C-contiguous halves: the policy kernels are compiled for C-contiguous arrays only (one specialisation)
        z_host = np.ascontiguousarray(host[:, :E]).reshape(B, S, E)
        g_next = np.ascontiguousarray(host[:, E:]).reshape(B, S, E)
        if self._from_previous and S == 1:  # the previous token's scores of the next layer (not yet rewritten)
            g_next = self._previous[layer + 1][:, None].copy()
        if S == 1:
            # decoding: part 2 of this layer, then part 1 of the next (its prefetches are known while this layer
            # computes), on the cache's own buffers
            plan = self._decode_select(layer, host[:, :E], "select")
            result = self._execute(layer, router, plan, z_host, logits, None, run_own)
            self._decode_prefetch(layer + 1, g_next[:, 0])
        else:
            # a block of positions: parts 1 and 2 of this layer for each position in order
            if self._from_previous and layer:
                self._pregate[layer] = self._previous_pregate(layer, z_host)
            plan = self.cache.step(layer, z_host, self._pregate[layer], fwd.tokens, fwd.valid)
            result = self._execute(layer, router, plan, z_host, logits, None, run_own)
        if self._from_previous:
            self._remember(layer, z_host)
        self._pregate[layer + 1] = g_next
        return result

    def joint_scores(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [N, 2E], scores [N, 2E])`` of MoE layer ``layer`` (not the last) on its router input
        ``hidden``: this layer's logits and selection scores, then the next layer's pre-gate from the same matmul:
        the next router's scores on this input, or with ``RoutingConfig(prefetch="predictor")`` the predictor's
        priorities ``softmax(B A x)`` in float32 (docs/ALGORITHM.md, "Prefetch ranking source")."""
        raw, both = self.family.joint_scores(self.layers[layer].router, self.layers[layer + 1].router, hidden,
                                             self.stacked_weight(layer))
        if self.predictor is not None:
            E = self.num_experts
            both = torch.cat((both[:, :E].float(), predicted_priorities(raw[:, E:])), dim=-1)
        return raw, both

    def prefetch_weight(self, layer: int) -> torch.Tensor:
        """``[E, H]``: what ranks the prefetches of layer ``layer + 1`` from layer ``layer``'s router input: the
        next router's weight, or the predictor's ``B A`` (float32) with ``prefetch="predictor"``."""
        if self.predictor is not None:
            return self.predictor.weight(layer)
        return self.layers[layer + 1].router.weight

    def stacked_weight(self, layer: int) -> torch.Tensor:
        """``[2E, H]`` this router's weight over :meth:`prefetch_weight` (one matmul gives z and the next
        pre-gate), in the family's router dtype; rebuilt when a weight is replaced or changed in place, and at every
        new sequence (device moves)."""
        a = self.layers[layer].router.weight
        b = self.layers[layer + 1].router.weight if self.predictor is None else self.predictor
        cached = self._stacked.get(layer)
        key = (a._version, a.data_ptr(), a.dtype, a.device) + (
            (b._version, b.data_ptr()) if isinstance(b, torch.Tensor) else (id(b),))
        if cached is None or cached[0] is not a or cached[1] is not b or cached[2] != key:
            following = self.prefetch_weight(layer).detach().to(device=a.device, dtype=a.dtype)
            stacked = self.family.stacked_router_weight(a.detach(), following)
            cached = self._stacked[layer] = (a, b, key, stacked)
        return cached[3]

    def _execute(self, layer: int, router: Any, plan: StepPlan, z_host: np.ndarray, logits: torch.Tensor,
                 own: tuple | None, run_own: Callable[[], tuple] | None) -> tuple:
        """The router's triple for the selection in ``plan``: the router's own outputs (``own``, or computed by
        ``run_own``) where the selection is its own top-K, the selected experts with weights from the unmodified
        scores elsewhere. Where the router's K-th and (K+1)-th scores tie, its own top-K is torch's arbitrary
        pick; the policy's (ties to the lower index) runs instead, so the executed experts are always the
        logical cache's."""
        count, chosen_dev_view, flags, _ = self._decide(layer, plan, z_host)
        device = self._devices[layer]
        N = self._fwd.rows * self._fwd.positions
        training = self.model.training
        if training:
            # the weights' gradients flow through the router's own logits (the joint matmul's are detached), and a
            # recomputation in the backward pass computes the same ones, also after a forward without grad
            # (reentrant checkpointing); in eval mode the joint matmul's: outputs never depend on the grad mode
            own = own if own is not None else run_own()
            logits = own[0]
        if count == 0:
            result = own if own is not None else run_own()  # the router's own choice: its own outputs, bitwise
            chosen_dev = None
        else:
            chosen_dev = chosen_dev_view.to(device, non_blocking=True) if device.type == "cuda" else chosen_dev_view
            if count < N and own is None:
                own = run_own()
            result = self._assemble(router, logits, own, count, N, chosen_dev, flags)
        if training:
            kept = None if chosen_dev is None else chosen_dev.clone()
            self._decisions[layer] = (N, count, kept, flags[:N].copy())
        return result

    def _assemble(self, router: Any, logits: Any, own: tuple | None, count: int, N: int, chosen: torch.Tensor,
                  flags: np.ndarray) -> tuple:
        """The router's triple when ``count`` of the ``N`` positions (``flags``) run ``chosen`` instead of the
        router's own top-K: their weights from the unmodified scores, the router's own outputs elsewhere."""
        if isinstance(logits, _Lazy):
            logits = logits.value()
        if count == N:
            return logits, self.family.execution_weights(router, logits, chosen), chosen
        _, weights, indices = own
        mask = torch.from_numpy(flags[:N].astype(bool)).to(chosen.device)[:, None]
        new_weights = self.family.execution_weights(router, logits, chosen).to(weights.dtype)
        return logits, torch.where(mask, new_weights, weights), torch.where(mask, chosen, indices)

    def _recompute(self, layer: int, router: Any, own: tuple) -> tuple:
        """A layer recomputed in the backward pass (gradient checkpointing): the selection the forward pass made,
        with weights from the recomputed logits, so the gradients are those of the routed forward."""
        N, count, chosen, flags = self._decisions[layer]
        if self.offload is not None:
            raise RuntimeError(
                "psr_hf: gradient checkpointing recomputes layers in the backward pass, whose expert slots have "
                "changed since the forward pass; train without offload (psr_hf.patch(..., offload=None))"
            )
        if own[0].shape[0] != N:
            raise RuntimeError(
                f"psr_hf: MoE layer {layer} was recomputed in the backward pass with {own[0].shape[0]} positions, but "
                f"the forward pass routed {N}; run the backward of the last forward pass"
            )
        if count == 0:
            return own
        return self._assemble(router, own[0], own, count, N, chosen, flags)

    # ------------------------------------------------------------------ prefetch="previous" (Naive Prefetch)
    def _start_previous(self, rows: int) -> None:
        """At a sequence start the previous-token ranking of every layer is the calibration's expert counts (the
        experts the router picks most often: mostly the warm set, already resident)."""
        if not self._from_previous:
            self._previous = None
            return
        counts = np.asarray(self.calibration.expert_counts, dtype=np.float32)  # [L, E]
        self._previous = np.repeat(counts[:, None, :], rows, axis=1)  # [L, R, E], a writable copy

    def _remember(self, layer: int, z_host: np.ndarray) -> None:
        """Keep each row's last real z of ``layer`` (``z_host`` [B, S, E]) as the next token's ranking."""
        fwd = self._fwd
        previous = self._previous[layer]
        valid = fwd.valid
        if valid is None:
            previous[:] = z_host[:, -1]
            return
        for b in range(z_host.shape[0]):
            real = np.flatnonzero(valid[b])
            if real.size:
                previous[b] = z_host[b, real[-1]]

    def _previous_pregate(self, layer: int, z_host: np.ndarray) -> np.ndarray:
        """``[B, S, E]``: each position's ranking for ``layer`` = the scores of the row's previous real position at
        this layer (this block's, or the one before the block), before :meth:`_remember` updates them."""
        fwd = self._fwd
        B, S, E = z_host.shape
        g = np.empty((B, S, E), dtype=np.float32)
        valid = fwd.valid
        for b in range(B):
            last = self._previous[layer, b]
            for s in range(S):
                g[b, s] = last
                if valid is None or valid[b, s]:
                    last = z_host[b, s]
        return g

    def _decode_select(self, layer: int, z: np.ndarray, mode: str) -> StepPlan:
        """One position per row (decoding): part 2 of ``layer`` (``mode`` "select"), or parts 1 and 2 ("both"),
        on the cache's own buffers for the scores ``z`` [B, E]; spec executes the pre-gate that the previous layer
        stored for this one."""
        io = self.cache.io
        io.scores[:, 0] = z
        if self._spec and layer:
            io.pregate[:, 0] = self._pregate[layer][:, 0]
        return self.cache.step_io(layer, mode)

    def _decode_prefetch(self, layer: int, g: np.ndarray) -> None:
        """One position per row (decoding): part 1 of ``layer`` from its pre-gate ``g`` [B, E] (the previous
        layer's input through this layer's router), and the offload's prefetch copies of its insertions."""
        self.cache.io.pregate[:, 0] = g
        plan = self.cache.step_io(layer, "prefetch")
        if self.offload is not None and self._mirrors():
            self.offload.prefetch(layer, plan, self._resident_view(layer))

    def _decide(self, layer: int, plan: StepPlan,
                z_host: np.ndarray) -> tuple[int, torch.Tensor, np.ndarray, np.ndarray]:
        """What every caller does with a layer's plan: record it, count its statistics (:func:`_finish_layer`),
        write the selected experts into the host staging buffer and tell the offload. Returns the number of
        positions whose selection is not the router's own top-K, the staging tensor ``[N, K]`` (host; pinned
        for a CUDA device), the per-position flags (1: not the router's own) and the staging buffer as an array."""
        fwd = self._fwd
        N, K = fwd.rows * fwd.positions, self.top_k
        if self._recorder is not None:
            self._recorder._layer(layer, z_host, self._pregate[layer], plan.selected)
        device = self._devices[layer]
        chosen, chosen_dev_view = self._staging(N, device)
        flags = self._flags if N == 1 else np.empty(N, dtype=np.uint8)
        count = _finish_layer(plan.plan.reshape(N, -1), K, plan.replaced_column, z_host.reshape(N, -1),
                              self._all_valid if fwd.valid is None else fwd.valid.reshape(N),
                              int(self.offload is not None), self.family.router_mass, self._mass_bias[layer], self._displaced[layer], fwd.positions,
                              chosen, flags)
        if self.offload is not None:
            mirror = self._mirrors()
            resident = None if fwd.rows != 1 else self._resident_view(layer) if mirror else self._resident(layer)
            self.offload.route(layer, plan, chosen, mirror, resident)
        return count, chosen_dev_view, flags, chosen

    def _mirrors(self) -> bool:
        """One row and one real position: the offload's slots follow this step's plan exactly."""
        fwd = self._fwd
        return fwd.rows == 1 and fwd.positions == 1 and (fwd.valid is None or bool(fwd.valid[0, 0]))

    def _resident_view(self, layer: int) -> np.ndarray:
        """[E] row 0's logical cache at ``layer`` as a view of the state (nonzero: cached), for a scheduler call
        that reads it at once (the mirror decode path, where it is rarely read at all)."""
        return self.cache.state[layer, 0, RESIDENT]

    def _resident(self, layer: int) -> np.ndarray:
        """[E] bool: row 0's logical cache at ``layer``."""
        return self.cache.state[layer, 0, RESIDENT] != 0

    def _staging(self, rows: int, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
        """A host ``[rows, K]`` int64 buffer for the selection and a tensor over the same memory. For a CUDA
        device it is pinned and reused (one per device), so the copy to the device is asynchronous: the buffer is
        rewritten only after the next device-to-host transfer from that device, which waits for this copy."""
        key = (device, rows)
        view = self._staging_views.get(key)
        if view is None:
            size = rows * self.top_k
            if device.type == "cuda":
                pinned = self._pinned.get(device)
                if pinned is None or pinned.numel() < size:
                    pinned = self._pinned[device] = torch.empty(max(size, 4096), dtype=torch.int64, pin_memory=True)
                    self._staging_views = {k: v for k, v in self._staging_views.items() if k[0] != device}
                tensor = pinned[:size].view(rows, self.top_k)
                view = self._staging_views[key] = (tensor.numpy(), tensor)
            else:  # the tensor is used as it is by the layer, so never reused
                tensor = torch.empty((rows, self.top_k), dtype=torch.int64)
                view = (tensor.numpy(), tensor)
        return view


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (where gradient checkpointing recomputes layers)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is None or task() >= 0


class _Lazy:
    """The first ``E`` columns of a ``[N, 2E]`` tensor, sliced on first use (a torch call costs microseconds)."""

    __slots__ = ("raw", "E")

    def __init__(self, raw: torch.Tensor, E: int):
        self.raw, self.E = raw, E

    def value(self) -> torch.Tensor:
        return self.raw[:, : self.E]


def _host(t: torch.Tensor) -> np.ndarray:
    """A device tensor as a float32 host array (one device-to-host copy, which synchronises). bfloat16 widens
    on the host by a bit shift (exact, and cheaper than a torch conversion)."""
    h = t.cpu()
    if h.dtype == torch.float32:
        return h.numpy()
    if h.dtype == torch.bfloat16:
        return (h.view(torch.int16).numpy().astype(np.int32) << 16).view(np.float32)
    return h.float().numpy()
