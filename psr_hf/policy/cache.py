"""LogicalCache: per-(row, layer) policy state and the validating front of the numba kernels.

This is the one decision path: the HF integration, the offload scheduler, the engine and :func:`replay` all
call :meth:`LogicalCache.step` (or its split form :meth:`LogicalCache.prefetch` + :meth:`LogicalCache.select`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._threads import keep_torch_threads
from . import _kernels as K_
from . import _mass
from .calibration import Calibration
from .config import DEFAULT_WINDOW, RoutingConfig

logger = logging.getLogger(__name__)

_MODES = {"both": 0, "prefetch": 1, "select": 2}
_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)
_EVICTION_CODES = {"score": K_.EVICT_SCORE, "lru": K_.EVICT_LRU}


@dataclass(frozen=True)
class PlanLayout:
    """Where each field of a copy plan lies, for top-``top_k`` routing and at most ``max_prefetch`` prefetch
    insertions. ``columns`` comes from the kernels' :func:`~psr_hf.policy._kernels.plan_layout`, the one
    definition of the layout; build with :meth:`of`."""

    top_k: int
    max_prefetch: int
    columns: K_.PlanColumns  # first column of each field, and the width

    @classmethod
    def of(cls, top_k: int, max_prefetch: int) -> "PlanLayout":
        """The layout of a plan for ``top_k`` and ``max_prefetch`` (the prefetch budget P)."""
        # py_func: the same function as the kernels', run by Python (no compiled dispatch for a few additions)
        return cls(int(top_k), int(max_prefetch), K_.plan_layout.py_func(int(top_k), int(max_prefetch)))

    @property
    def width(self) -> int:
        """Columns of the plan."""
        return self.columns.width


class StepPlan:
    """Decisions of one layer over a block ``[B, S]``: the selection and the copy plan.

    Unused entries (past a count, or a position that ran only part 1) are -1. An evicted expert of -1 means the
    slot was free. (A slotted class rather than a dataclass: it is built once per layer and token.)
    """

    __slots__ = ("plan", "layout")

    def __init__(self, plan: np.ndarray, layout: PlanLayout):
        self.plan = plan  # [B, S, W] int64, columns in layout
        self.layout = layout

    def __repr__(self) -> str:
        B, S = self.plan.shape[:2]
        demand = int(np.maximum(self.demand_count, 0).sum())
        prefetch = int(np.maximum(self.prefetch_count, 0).sum())
        replaced = int(np.maximum(self.replaced, 0).sum())
        # one position: its K selected experts (a few numbers); a block: only its shape and totals
        what = f"selected={self.selected[0, 0].tolist()}" if B * S == 1 else f"block=[{B}, {S}], K={self.top_k}"
        return f"StepPlan({what}, demand={demand}, prefetch={prefetch}, replaced={replaced})"

    @property
    def top_k(self) -> int:
        """K: experts executed per position."""
        return self.layout.top_k

    @property
    def max_prefetch(self) -> int:
        """P: the prefetch budget, the plan's room for prefetch insertions per position."""
        return self.layout.max_prefetch

    def _cols(self, start: int, width: int) -> np.ndarray:
        return self.plan[:, :, start : start + width]

    @property
    def selected(self) -> np.ndarray:
        """[B, S, K] experts to execute, in selection order (the router's order for exact routing)."""
        return self._cols(self.layout.columns.selected, self.layout.top_k)

    @property
    def prefetch_count(self) -> np.ndarray:
        """[B, S] prefetch insertions (copies to queue)."""
        return self.plan[:, :, self.layout.columns.n_prefetch]

    @property
    def prefetch_experts(self) -> np.ndarray:
        """[B, S, P] experts inserted by part 1, in insertion order."""
        return self._cols(self.layout.columns.prefetch, self.layout.max_prefetch)

    @property
    def prefetch_evicted(self) -> np.ndarray:
        """[B, S, P] the expert each prefetch insertion evicted (-1: none)."""
        return self._cols(self.layout.columns.prefetch_evicted, self.layout.max_prefetch)

    @property
    def demand_count(self) -> np.ndarray:
        """[B, S] demand insertions (copies the layer waits for)."""
        return self.plan[:, :, self.layout.columns.n_demand]

    @property
    def demand_experts(self) -> np.ndarray:
        """[B, S, K] experts inserted on demand, ascending."""
        return self._cols(self.layout.columns.demand, self.layout.top_k)

    @property
    def demand_evicted(self) -> np.ndarray:
        """[B, S, K] the expert each demand insertion evicted (-1: none)."""
        return self._cols(self.layout.columns.demand_evicted, self.layout.top_k)

    def selection_sets(self, before: np.ndarray) -> np.ndarray:
        """``[B, S, E]`` bool: the logical cache each position's selection read (after its part 1), rebuilt from
        the cache ``before`` the block (``[B, E]`` bool) and this plan's insertions and evictions in order."""
        before = np.asarray(before, dtype=bool)
        B, S = self.plan.shape[:2]
        sets = np.empty((B, S, before.shape[-1]), dtype=bool)
        prefetch, prefetch_out = self.prefetch_experts, self.prefetch_evicted
        demand, demand_out = self.demand_experts, self.demand_evicted
        for b in range(B):
            cache = before[b].copy()
            for s in range(S):
                _insert(cache, prefetch[b, s], prefetch_out[b, s])
                sets[b, s] = cache  # the selection reads the cache between part 1 and its demand insertions
                _insert(cache, demand[b, s], demand_out[b, s])
        return sets

    @property
    def replaced_column(self) -> int:
        """Column of ``plan`` holding :attr:`replaced`."""
        return self.layout.columns.n_replaced

    @property
    def replaced(self) -> np.ndarray:
        """[B, S] selected experts outside the router's own top-K (router slots replaced)."""
        return self.plan[:, :, self.replaced_column]


def _insert(cache: np.ndarray, experts: np.ndarray, evicted: np.ndarray) -> None:
    """Apply one part's insertions (-1 ends them) and the evictions they made (-1: a free slot) to ``cache``."""
    for e, out in zip(experts, evicted):
        if e < 0:
            break
        if out >= 0:
            cache[out] = False
        cache[e] = True


@dataclass(frozen=True)
class CacheStats:
    """Counters per MoE layer and row since the last reset: ``[L, R]`` arrays."""

    steps: np.ndarray  # token-layer steps of real (unpadded) positions
    prefetch: np.ndarray  # prefetch insertions
    demand: np.ndarray  # demand insertions
    replaced: np.ndarray  # router slots replaced

    def per_token(self) -> dict[str, np.ndarray]:
        """Per row ``[R]``: copies per token (summed over layers) and replaced slots per token."""
        tokens = np.maximum(self.steps.max(axis=0), 1)
        return {
            "tokens": self.steps.max(axis=0),
            "prefetch_per_token": self.prefetch.sum(axis=0) / tokens,
            "demand_per_token": self.demand.sum(axis=0) / tokens,
            "replaced_per_token": self.replaced.sum(axis=0) / tokens,
        }

    def __repr__(self) -> str:
        L, R = self.steps.shape
        tokens = int(self.steps.max(axis=0).sum()) if self.steps.size else 0
        per = max(tokens, 1)
        return (f"CacheStats(layers={L}, rows={R}, tokens={tokens}, demand/tok={self.demand.sum() / per:.2f}, "
                f"prefetch/tok={self.prefetch.sum() / per:.2f}, replaced/tok={self.replaced.sum() / per:.2f})")


@dataclass(frozen=True)
class IOBuffers:
    """The cache's own one-position buffers for :meth:`LogicalCache.step_io` (a decoder's hot path): fill
    ``scores``/``pregate`` ``[R, 1, E]`` float32, ``tokens`` ``[R, 1]`` int64 and ``valid`` ``[R, 1]`` uint8 (1 =
    real position; starts all ones) in place, call ``step_io(layer)``, read ``plan``. Replaced (new arrays) by
    ``resize()`` and ``reorder()``, so fetch ``cache.io`` again after those."""

    scores: np.ndarray
    pregate: np.ndarray
    tokens: np.ndarray
    valid: np.ndarray
    plan: StepPlan  # overwritten by every step_io call


@dataclass(frozen=True)
class KernelSettings:
    """What the kernels read of a :class:`LogicalCache`'s policy and calibration, in their own types, for another
    implementation of the same step (the engine's device kernel, :mod:`psr_hf.engine.device_decisions`): the
    state layout is :attr:`STATE_PLANES` x E float64 planes and :attr:`COUNTERS` float64 counters per (layer,
    row), in the order of :mod:`._kernels` (``S_FAST, S_SLOW, LAST_USE, RESIDENT, PROTECTED, INSERTED``;
    ``RANGE_SUM, RANGE_COUNT, STEP, PENDING, STEPS, PREFETCH, DEMAND, REPLACED``)."""

    STATE_PLANES = K_.N_PLANES
    COUNTERS = K_.R_SIZE

    top_j: int
    running: bool  # delta_mode "running" (in effect: a biased policy without calibration runs it too)
    inserts: bool  # part 1 runs (at layers >= distance)
    distance: int  # RoutingConfig.prefetch_distance: layer l's pre-gate is router l on layer l - distance's input
    biased: bool
    executes_pregate: bool
    lru: bool  # eviction "lru" (else "score")
    lam: float
    decay_fast: float
    decay_slow: float
    flush: float  # s_fast below s_slow * flush is flushed to zero (_update_statistics)
    delta: np.ndarray  # [L] float64: the fixed bonus scale per layer
    fallback_prior: np.ndarray  # [L * E] float64: the prior of a token never seen in calibration
    vocab_size: int  # 0: no token prior
    token_seen: np.ndarray  # [V] int64 (1: seen in calibration)
    prior_indptr: np.ndarray  # [V * L + 1] int64, row token * L + layer
    prior_experts: np.ndarray  # [nnz] uint16
    prior_values: np.ndarray  # [nnz] float32


class LogicalCache:
    """The deterministic logical expert cache of every MoE layer for ``rows`` independent batch rows.

    Args:
        config: the routing policy.
        num_layers: the model's MoE layers (MoE layers only, in model order).
        num_experts: routed experts per MoE layer.
        top_k: experts each token runs per MoE layer.
        calibration: a :class:`Calibration` (or anything :meth:`Calibration.coerce` accepts). ``None``: warm set
            = the first C experts, zero token prior, and (for biased policies with ``delta_mode='fixed'``) the
            running bonus scale instead, with a warning that recommends calibrating.
        rows: batch rows (each has its own state).
        default_window: the architecture's pre-gate window, used when ``config.window`` is None.
        vocab_size: the model's vocabulary, checked against the calibration's token prior.
    """

    def __init__(
        self,
        config: RoutingConfig,
        *,
        num_layers: int,
        num_experts: int,
        top_k: int,
        calibration: Any = None,
        rows: int = 1,
        default_window: int = DEFAULT_WINDOW,
        vocab_size: int | None = None,
    ):
        if isinstance(config, dict):
            config = RoutingConfig.from_dict(config)
        if not isinstance(config, RoutingConfig):
            raise ValueError(f"config must be a psr_hf.RoutingConfig, got {type(config).__name__}")
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("top_k", top_k), ("rows", rows)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
        if config.top_j > num_experts:
            raise ValueError(f"top_j={config.top_j} exceeds num_experts={num_experts}")
        self.config = config
        self.num_layers, self.num_experts, self.top_k = int(num_layers), int(num_experts), int(top_k)
        self.capacity = config.capacity_for(self.num_experts, self.top_k)
        self.window = config.window_for(self.top_k, default_window)
        self.budget = config.budget_for(self.top_k)
        self.distance = config.prefetch_distance
        if self.distance > 1 and self.distance >= self.num_layers:
            raise ValueError(f"prefetch_distance={self.distance} reaches past the model's {self.num_layers} MoE layers: "
                             f"no layer would get a prefetch; use at most {self.num_layers - 1}")
        delta_mode = config.delta_mode
        if calibration is None:
            calibration = Calibration.empty(self.num_layers, self.num_experts)
            if config.biased and delta_mode == "fixed":
                logger.warning(
                    "no calibration given: using the running bonus scale (delta_mode='running'), warm set = the "
                    "first %d experts and a zero token prior; calibrate the model (psr-hf calibrate) for the "
                    "paper's fixed delta, warm set and token prior", self.capacity)
                delta_mode = "running"
        else:
            if isinstance(calibration, (str, Path)):  # a file: its tensors are checked against this model unread
                calibration = Calibration.load(calibration, num_layers=self.num_layers,
                                               num_experts=self.num_experts, vocab_size=vocab_size)
            calibration = Calibration.coerce(calibration)
        calibration.check(num_layers=self.num_layers, num_experts=self.num_experts, vocab_size=vocab_size,
                          top_k=self.top_k)
        self.calibration = calibration
        self.delta_mode = delta_mode

        L, E = self.num_layers, self.num_experts
        seen = calibration.token_seen.astype(np.int64) if calibration.vocab_size else np.zeros(0, dtype=np.int64)
        self._mi = np.zeros(K_.MI_SIZE + seen.size, dtype=np.int64)
        # the kernels branch on what the policy does (its table entry's flags), never on its name
        self._mi[K_.MI_POLICY] = config.definition.code
        self._mi[K_.MI_EVICTION] = _EVICTION_CODES[config.eviction]
        self._mi[K_.MI_K] = self.top_k
        self._mi[K_.MI_C] = self.capacity
        self._mi[K_.MI_BUDGET] = self.budget
        self._mi[K_.MI_WINDOW] = self.window
        self._mi[K_.MI_TOP_J] = config.top_j
        self._mi[K_.MI_RUNNING] = int(delta_mode == "running")
        self._mi[K_.MI_INSERTS] = int(config.inserts)
        self._mi[K_.MI_BIASED] = int(config.biased)
        self._mi[K_.MI_EXECUTES_PREGATE] = int(config.executes_pregate)
        self._mi[K_.MI_VOCAB] = calibration.vocab_size
        self._mi[K_.MI_DISTANCE] = self.distance
        self._mi[K_.MI_SIZE :] = seen
        self._mf = np.concatenate([
            np.array([config.lam, config.decay_fast, config.decay_slow], dtype=np.float64),
            np.asarray(calibration.delta, dtype=np.float64),
            np.asarray(calibration.marginal, dtype=np.float64).reshape(L * E),
        ])
        self._prior = (
            np.ascontiguousarray(calibration.prior_indptr, dtype=np.int64),
            np.ascontiguousarray(calibration.prior_experts, dtype=np.uint16),
            np.ascontiguousarray(calibration.prior_values, dtype=np.float32),
        )
        warm = np.zeros((self.num_layers, self.num_experts), dtype=np.float64)
        for layer in range(self.num_layers):
            warm[layer, calibration.warm_set(layer, self.capacity)] = 1
        self._warm = warm
        self.plan_layout = PlanLayout.of(self.top_k, self.budget)
        self._plan_width = self.plan_layout.width
        nf, ni = K_.scratch_sizes.py_func(self.num_experts, self.top_k, min(self.window, self.num_experts),
                                          config.top_j, self.budget)
        self._scratch = (np.zeros(nf, dtype=np.float64), np.zeros(ni, dtype=np.int64))
        self._no_pregate = np.zeros((0, 0, 0), dtype=np.float32)
        self._no_valid = np.zeros((0, 0), dtype=np.uint8)  # the kernel reads an empty mask as "all positions real"
        self._no_valid_flat = np.zeros(0, dtype=np.uint8)  # the same for finish_layer's [N] mask
        self._placeholder: dict[int, np.ndarray] = {}
        self._needs_pregate = config.needs_pregate
        self._allocate(int(rows))

    # ------------------------------------------------------------------ rows
    def _allocate(self, rows: int) -> None:
        L, E = self.num_layers, self.num_experts
        self.state = np.zeros((L, rows, K_.N_PLANES, E), dtype=np.float64)  # [L, R, planes, E]
        self.counters = np.zeros((L, rows, K_.R_SIZE), dtype=np.float64)  # [L, R, fields]
        self._rebuild_table()
        self.reset()

    def _rebuild_table(self) -> None:
        # the kernel reads the cache's arrays through their addresses; rebuilt whenever one is reallocated
        self._table = K_.make_table(self._mi, self._mf, self.state, self.counters, *self._prior, *self._scratch)
        R, E = self.rows, self.num_experts
        self.io = IOBuffers(
            scores=np.zeros((R, 1, E), dtype=np.float32),
            pregate=np.zeros((R, 1, E), dtype=np.float32),
            tokens=np.zeros((R, 1), dtype=np.int64),
            valid=np.ones((R, 1), dtype=np.uint8),
            plan=StepPlan(np.full((R, 1, self._plan_width), -1, dtype=np.int64), self.plan_layout),
        )
        K_.set_io_buffers(self._table, self.io.scores, self.io.pregate, self.io.tokens, self.io.valid,
                          self.io.plan.plan)

    @property
    def rows(self) -> int:
        return int(self.state.shape[1])

    def reset(self, rows: Any = None) -> None:
        """Reset ``rows`` (default: all) to the start of a new sequence: warm set, zero statistics."""
        index = np.arange(self.rows, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= self.rows):
            raise ValueError(f"rows {index.tolist()} out of range for {self.rows} rows")
        K_._reset_rows(index, self._warm, self.state, self.counters)

    def resize(self, rows: int) -> None:
        """Start over with ``rows`` fresh rows (a new batch)."""
        if rows < 1:
            raise ValueError(f"rows={rows} must be >= 1")
        self._allocate(int(rows))

    def reorder(self, index: Any) -> None:
        """Reorder or expand the rows like the KV cache: new row ``i`` takes the state of old row ``index[i]``
        (beam search, ``num_return_sequences``)."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        if index.size == 0 or index.min() < 0 or index.max() >= self.rows:
            raise ValueError(f"reorder index must be non-empty with entries in [0, {self.rows})")
        self.state = np.ascontiguousarray(self.state[:, index])
        self.counters = np.ascontiguousarray(self.counters[:, index])
        self._rebuild_table()

    # ------------------------------------------------------------------ inspection
    def resident(self, layer: int, row: int = 0) -> np.ndarray:
        """Experts in the logical cache of ``layer`` for ``row``, ascending."""
        return np.flatnonzero(self.state[layer, row, K_.RESIDENT])

    def resident_mask(self, layer: int, row: int = 0) -> np.ndarray:
        """``[E]`` float64: ``row``'s logical cache at ``layer`` as a view of the state (nonzero: cached), for a
        caller that reads it at once (the next step changes it)."""
        return self.state[layer, row, K_.RESIDENT]

    def finish_layer(self, plan: StepPlan, scores: np.ndarray, valid: np.ndarray | None, pad_ties: bool,
                     mass_mode: int, mass_bias: np.ndarray, displaced: np.ndarray, chosen: np.ndarray,
                     flags: np.ndarray) -> int:
        """What a caller that executes a layer's ``plan`` (``[B, S]`` positions, ``N = B * S``) needs of it, in one
        compiled call: the selected experts into ``chosen`` ``[N, K]`` int64 and ``flags`` ``[N]`` uint8 (1 where
        the layer must run the selection explicitly: a replaced router slot, or a tie across the router's own
        top-K boundary), and each replaced position's displaced fraction of the router's own top-K weight added to
        ``displaced[row]`` (``[B]`` float64). ``scores``: the layer's ``[B, S, E]`` float32 selection scores;
        ``valid``: ``[B, S]`` real positions (None: all); ``pad_ties``: treat a padded position whose own top-K
        ties at the boundary like a real one (an offload loads exactly the plan's experts); ``mass_mode``,
        ``mass_bias``: how the family's router weighs an expert (``router_mass``, ``mass_bias``). Returns the
        number of flagged positions."""
        B, S = plan.plan.shape[:2]
        N = B * S
        valid = self._no_valid_flat if valid is None else valid.reshape(N)
        return _mass._finish_layer(plan.plan.reshape(N, -1), self.top_k, plan.replaced_column, scores.reshape(N, -1),
                                   valid, int(pad_ties), mass_mode, mass_bias, displaced, S, chosen, flags)

    def kernel_settings(self) -> KernelSettings:
        """The policy and calibration as the kernels read them (:class:`KernelSettings`)."""
        mi, mf, L = self._mi, self._mf, self.num_layers
        return KernelSettings(
            top_j=int(mi[K_.MI_TOP_J]), running=bool(mi[K_.MI_RUNNING]), inserts=bool(mi[K_.MI_INSERTS]),
            distance=int(mi[K_.MI_DISTANCE]), biased=bool(mi[K_.MI_BIASED]),
            executes_pregate=bool(mi[K_.MI_EXECUTES_PREGATE]),
            lru=int(mi[K_.MI_EVICTION]) == K_.EVICT_LRU, lam=float(mf[K_.MF_LAM]),
            decay_fast=float(mf[K_.MF_DECAY_FAST]), decay_slow=float(mf[K_.MF_DECAY_SLOW]),
            flush=min(1.0, 1.0 - float(mf[K_.MF_DECAY_FAST])) * K_.FLUSH_RATIO,
            delta=mf[K_.MF_SIZE : K_.MF_SIZE + L].copy(), fallback_prior=mf[K_.MF_SIZE + L :].copy(),
            vocab_size=int(mi[K_.MI_VOCAB]), token_seen=mi[K_.MI_SIZE :].copy(), prior_indptr=self._prior[0],
            prior_experts=self._prior[1], prior_values=self._prior[2])

    def stats(self) -> CacheStats:
        r = self.counters
        as_int = lambda j: r[:, :, j].astype(np.int64)  # noqa: E731
        return CacheStats(as_int(K_.R_STEPS), as_int(K_.R_PREFETCH), as_int(K_.R_DEMAND), as_int(K_.R_REPLACED))

    # ------------------------------------------------------------------ steps
    def _inputs(self, layer, scores, pregate, tokens, valid, need_pregate: bool):
        if type(layer) is not int and not isinstance(layer, np.integer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r} must be an int in [0, {self.num_layers})")
        E = self.num_experts
        z = self._scores("scores", scores, E) if scores is not None else None
        g = self._scores("pregate", pregate, E) if pregate is not None else None
        ref = z if z is not None else g
        B, S = ref.shape[:2]
        if B != self.rows:
            raise ValueError(
                f"the block has {B} rows but the cache holds {self.rows}; call resize({B}) for a new batch "
                "or reorder() to follow beam search"
            )
        if z is not None and g is not None and g.shape != z.shape:
            raise ValueError(f"pregate has shape {g.shape} but scores have {z.shape}")
        if need_pregate and layer >= self.distance and g is None:
            raise ValueError(
                f"policy={self.config.policy!r} needs the pre-gate scores of layer {layer} (part 1 inserts the "
                "next layer's predicted experts); pass pregate="
            )
        if type(tokens) is np.ndarray and tokens.dtype is _I64 and tokens.shape == (B, S) and tokens.flags.c_contiguous:
            t = tokens
        elif tokens is None:
            if self.calibration.vocab_size and self.config.eviction == "score":
                raise ValueError("tokens are needed to look up the calibration's token prior; pass tokens=")
            t = np.zeros((B, S), dtype=np.int64)
        else:
            t = np.asarray(tokens)
            if t.shape != (B, S):
                t = t.reshape(B, S) if t.size == B * S else None
                if t is None:
                    raise ValueError(f"tokens must have shape [B, S] = ({B}, {S}), got {np.shape(tokens)}")
            if not np.issubdtype(t.dtype, np.integer):
                raise ValueError(f"tokens must be integer ids, got dtype {t.dtype}")
            t = np.ascontiguousarray(t, dtype=np.int64)
        if valid is None:
            v = self._no_valid
        else:
            v = np.asarray(valid)
            if v.shape != (B, S):
                raise ValueError(f"valid must have shape [B, S] = ({B}, {S}), got {v.shape}")
            v = np.ascontiguousarray(v, dtype=np.uint8)
        return z, g, t, v

    @staticmethod
    def _scores(name: str, value: Any, E: int) -> np.ndarray:
        if (type(value) is np.ndarray and value.dtype is _F32 and value.ndim == 3 and value.shape[2] == E
                and value.flags.c_contiguous):
            return value  # the hot path: nothing to convert (the kernels are compiled for C-contiguous arrays)
        a = np.asarray(value)
        if not np.issubdtype(a.dtype, np.floating):
            raise ValueError(f"{name} must be floating point, got dtype {a.dtype}")
        if a.ndim == 2:
            a = a[:, None, :]
        if a.ndim != 3 or a.shape[2] != E:
            raise ValueError(f"{name} must have shape [B, S, {E}] or [B, {E}], got {np.shape(value)}")
        return np.ascontiguousarray(a, dtype=np.float32)

    def _fast(self, mode, layer, scores, pregate, tokens, valid) -> StepPlan | None:
        """The hot path: arrays that already have the kernel's dtypes go straight to the kernel, which checks
        shapes and values before touching any state. None on any error code: the caller then runs the checked
        path, which raises with a precise message."""
        if not (type(scores) is np.ndarray and scores.dtype is _F32 and scores.ndim == 3 and type(layer) is int
                and scores.flags.c_contiguous and type(tokens) is np.ndarray and tokens.dtype is _I64
                and tokens.ndim == 2 and tokens.flags.c_contiguous and valid is None
                and (pregate is None or type(pregate) is np.ndarray and pregate.dtype is _F32
                     and pregate.ndim == 3 and pregate.flags.c_contiguous)):
            return None
        code, plan = self._call(layer, mode, scores, pregate, tokens, self._no_valid)
        return plan if code == K_.OK else None

    def _zeros(self, rows: int) -> np.ndarray:
        """Placeholder scores [rows, 1, E] for part 1 alone (never read)."""
        z = self._placeholder.get(rows)
        if z is None:
            z = self._placeholder[rows] = np.zeros((rows, 1, self.num_experts), dtype=np.float32)
        return z

    def _call(self, layer, mode, z, g, t, v) -> tuple[int, StepPlan]:
        """One kernel call on a block; the kernel checks shapes and values before touching any state."""
        plan = np.empty((z.shape[0], z.shape[1], self._plan_width), dtype=np.int64)
        code = K_._step_table(layer, mode, self._table, z, self._no_pregate if g is None else g, t, v, plan)
        return code, StepPlan(plan, self.plan_layout)

    def _run(self, layer, mode, z, g, t, v) -> StepPlan:
        B, S = t.shape
        if z is None:
            z = self._zeros(B) if S == 1 else np.zeros((B, S, self.num_experts), dtype=np.float32)
        code, plan = self._call(layer, mode, z, g, t, v)
        if code != K_.OK:
            self._raise(code, layer, z, g, t, v)
        return plan

    def _raise(self, code, layer, z, g, t, v) -> None:
        where = ""
        if code in (K_.ERR_SCORES, K_.ERR_PREGATE):
            a = z if code == K_.ERR_SCORES else g
            real = np.ones(a.shape[:2], dtype=bool) if v.size == 0 else (v != 0)
            bad = np.argwhere((np.isnan(a) | np.isposinf(a)).any(axis=-1) & real)
            where = f" at (row, position) {tuple(int(i) for i in bad[0])}" if len(bad) else ""
        messages = {
            K_.ERR_SCORES: f"scores of layer {layer} contain NaN or +inf{where}; only -inf (masked experts) is allowed",
            K_.ERR_PREGATE: f"pregate of layer {layer} contains NaN or +inf{where}; only -inf is allowed",
            K_.ERR_TOKEN: (
                f"token ids must lie in [0, {self.calibration.vocab_size or 'inf'}) (the calibration's "
                f"vocabulary); got values in [{t.min()}, {t.max()}]"
            ),
            K_.ERR_FEW_FINITE: f"scores of layer {layer} have fewer than top_k={self.top_k} finite entries",
            K_.ERR_NO_PART1: (
                f"select() at layer {layer} before prefetch(): policy={self.config.policy!r} runs part 1 first"
            ),
            K_.ERR_PART1_TWICE: f"prefetch() at layer {layer} twice without select() in between",
            K_.ERR_SHAPE: "array shapes do not match the cache (rows, experts, positions)",
        }
        raise ValueError(messages.get(code, f"policy kernel error {code}"))

    def step(self, layer: int, scores: Any, pregate: Any = None, tokens: Any = None, valid: Any = None) -> StepPlan:
        """Part 1 and part 2 for every position of a block, in position order.

        Args:
            layer: MoE-layer index.
            scores: float ``[B, S, E]`` (or ``[B, E]``) selection scores of this layer.
            pregate: float ``[B, S, E]`` pre-gate of this layer (its router on the previous MoE block's input);
                required at ``layer >= 1`` by policies that insert (psr, spec, exact with budget).
            tokens: int ``[B, S]`` input token ids (for the token prior).
            valid: bool ``[B, S]``; False marks padding, which uses the router's own top-K and leaves the state
                untouched.
        """
        plan = self._fast(K_.MODE_BOTH, layer, scores, pregate, tokens, valid)
        if plan is not None:
            return plan
        z, g, t, v = self._inputs(layer, scores, pregate, tokens, valid, self._needs_pregate)
        return self._run(layer, K_.MODE_BOTH, z, g, t, v)

    def step_io(self, layer: int, mode: str = "both") -> StepPlan:
        """One position per row from the cache's own buffers ``self.io`` (see :class:`IOBuffers`): no array is
        passed, so this is the cheapest call (what a decoder runs once per layer and token). ``mode``: "both"
        (parts 1 and 2, like :meth:`step`), "prefetch" (part 1, like :meth:`prefetch`) or "select" (part 2).
        Returns ``self.io.plan``, overwritten by the next call."""
        m = _MODES.get(mode)
        if m is None:
            raise ValueError(f"mode={mode!r}; allowed: {', '.join(_MODES)}")
        code = K_._step_io(layer, m, self._table)
        if code != K_.OK:
            io = self.io
            if not (type(layer) is int or isinstance(layer, np.integer)) or not 0 <= layer < self.num_layers:
                raise ValueError(f"layer={layer!r} must be an int in [0, {self.num_layers})")
            self._raise(code, layer, io.scores, io.pregate, io.tokens, io.valid)
        return self.io.plan

    def step_all_layers(self, scores: Any, pregate: Any = None, tokens: Any = None, valid: Any = None) -> list[StepPlan]:
        """:meth:`step` for every layer of a recorded block at once, layers in parallel threads.

        ``scores``, ``pregate``: float32 ``[L, B, S, E]`` (``pregate[0]`` is not read). Only for recorded traces:
        in a live forward pass a layer's scores depend on the previous layer's output. Gives exactly the
        decisions of calling :meth:`step` layer by layer (each layer's state depends only on its own history).
        """
        L, E = self.num_layers, self.num_experts
        z = np.asarray(scores)
        if z.ndim != 4 or z.shape[0] != L or z.shape[3] != E:
            raise ValueError(f"scores must have shape [L={L}, B, S, E={E}], got {z.shape}")
        if not np.issubdtype(z.dtype, np.floating):
            raise ValueError(f"scores must be floating point, got dtype {z.dtype}")
        z = np.ascontiguousarray(z, dtype=np.float32)
        if pregate is None:
            if self._needs_pregate and L > 1:
                raise ValueError(f"policy={self.config.policy!r} needs the pre-gate scores; pass pregate=")
            g = np.zeros_like(z)
        else:
            g = np.asarray(pregate)
            if g.shape != z.shape:
                raise ValueError(f"pregate has shape {g.shape}; expected {z.shape} like scores")
            if not np.issubdtype(g.dtype, np.floating):
                raise ValueError(f"pregate must be floating point, got dtype {g.dtype}")
            g = np.ascontiguousarray(g, dtype=np.float32)
        _, _, t, v = self._inputs(0, z[0], None, tokens, valid, False)
        B, S = t.shape
        plan = np.empty((L, B, S, self._plan_width), dtype=np.int64)
        codes = np.zeros(L, dtype=np.int64)
        with keep_torch_threads():
            K_._step_all_layers(K_.MODE_BOTH, self._mi, self._mf, z, g, t, v, self.state, self.counters,
                                *self._prior, plan, codes)
        for layer in range(L):
            if codes[layer] != K_.OK:
                self._raise(int(codes[layer]), layer, z[layer], g[layer], t, v)
        return [StepPlan(plan[layer], self.plan_layout) for layer in range(L)]

    def prefetch(self, layer: int, pregate: Any, tokens: Any = None, valid: Any = None) -> StepPlan:
        """Part 1 alone for one position per row (``[B, E]`` or ``[B, 1, E]``), run as soon as the previous
        layer's MoE computation is launched; its insertions are the prefetch copies to queue. Follow it with
        :meth:`select` for the same layer."""
        if type(pregate) is np.ndarray and pregate.ndim == 3 and pregate.shape[1] == 1:
            plan = self._fast(K_.MODE_INSERT, layer, self._zeros(pregate.shape[0]), pregate, tokens, valid)
            if plan is not None:
                return plan
        _, g, t, v = self._inputs(layer, None, pregate, tokens, valid, True)
        if g.shape[1] != 1:
            raise ValueError("prefetch() takes one position per row; use step() for blocks")
        return self._run(layer, K_.MODE_INSERT, None, g, t, v)

    def select(self, layer: int, scores: Any, tokens: Any = None, valid: Any = None, pregate: Any = None) -> StepPlan:
        """Part 2 alone for one position per row, after :meth:`prefetch` for this layer (or none at layer 0 / for
        policies that do not insert). ``spec`` needs the same ``pregate`` again."""
        if type(scores) is np.ndarray and scores.ndim == 3 and scores.shape[1] == 1:
            plan = self._fast(K_.MODE_SELECT, layer, scores, pregate, tokens, valid)
            if plan is not None:
                return plan
        z, g, t, v = self._inputs(layer, scores, pregate, tokens, valid, self.config.executes_pregate)
        if z.shape[1] != 1:
            raise ValueError("select() takes one position per row; use step() for blocks")
        return self._run(layer, K_.MODE_SELECT, z, g, t, v)
