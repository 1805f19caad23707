"""Block-level expert selection for speculative decoding (the paper's Section 7; rules in docs/speculative.md):
per verification block and MoE layer, one eligible set from the router's demand at every position, weighted per
position, pruned toward a persistent pool of ``P`` experts with LRU replacement; every position routes within
it. numpy and numba only: the harness (:mod:`psr_hf.hf.speculative`), the engine and :func:`replay` call the same
:meth:`BlockPool.select`, so they make the same decisions for the same scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ._block_kernels import _select_layer

BLOCK_MODES = ("exact", "position", "confidence")
DEFAULT_THRESHOLD = 0.02
DEFAULT_RESCUE_AT = 0.3


@dataclass(frozen=True)
class BlockConfig:
    """``mode``: ``exact`` (each position its own top-K: the union is copied), ``position`` (AcceptMoE's
    position weights) or ``confidence`` (the drafter's cumulative confidence, with the top-1 rescue at
    ``rescue_at``); ``pool``: experts per layer kept between blocks (``P``); ``top_k``: the model's K (8:
    OLMoE's), which the harness and the engine check against the target's routers (a recording replays without
    the model, so a config states its K); ``threshold``: the weighted router mass a missing expert needs to join a
    block's eligible set."""

    mode: str = "confidence"
    pool: int = 24
    top_k: int = 8
    threshold: float = DEFAULT_THRESHOLD
    rescue_at: float = DEFAULT_RESCUE_AT

    def __post_init__(self) -> None:
        if self.mode not in BLOCK_MODES:
            raise ValueError(f"BlockConfig.mode must be one of {', '.join(BLOCK_MODES)}; got {self.mode!r}")
        if int(self.top_k) < 1:
            raise ValueError(f"BlockConfig.top_k must be >= 1; got {self.top_k}")
        if int(self.pool) < int(self.top_k):
            raise ValueError(f"BlockConfig.pool ({self.pool}) must be at least top_k ({self.top_k}): every position "
                             "routes top_k experts within the pool")
        if not (np.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"BlockConfig.threshold must be a finite number >= 0; got {self.threshold}")
        if not (np.isfinite(self.rescue_at) and 0 <= self.rescue_at <= 1):
            raise ValueError(f"BlockConfig.rescue_at must be in [0, 1]; got {self.rescue_at}")

    def check_experts(self, num_experts: int) -> None:
        if self.pool > num_experts:
            raise ValueError(f"BlockConfig.pool ({self.pool}) exceeds the model's {num_experts} experts per layer")

    def check_top_k(self, top_k: int) -> None:
        """``ValueError`` unless ``top_k`` is the model's: every position would execute another number of experts
        than the model routes, and exact verification would not be the model's greedy decoding."""
        if int(self.top_k) != int(top_k):
            raise ValueError(f"BlockConfig.top_k ({self.top_k}) is not the model's top-K ({top_k}): every position "
                             f"would run {self.top_k} experts; use BlockConfig(top_k={top_k})")


@dataclass(frozen=True)
class BlockWeights:
    """One block's per-position demand weights ``[S]`` and rescue flags ``[S]`` (shared by its layers)."""

    weights: np.ndarray
    rescue: np.ndarray


@dataclass(frozen=True)
class LayerChoice:
    """One layer of one block: ``selected [S, K]`` (each row ascending), the experts copied (``copies``,
    ascending: the executed union less the pool before the block) and the demand ``[E]`` that chose them."""

    selected: np.ndarray
    copies: np.ndarray
    demand: np.ndarray


@dataclass(frozen=True)
class BlockRecord:
    """A recorded block: ``scores [L, S, E]`` float32, the drafter's ``confidences [S - 1]`` and the ``accepted``
    count (both None for the prompt)."""

    scores: np.ndarray
    confidences: np.ndarray | None
    accepted: int | None


def _ranking(z: np.ndarray) -> np.ndarray:
    """Indices of each row by descending value, ties to the lower index."""
    return np.argsort(-z, axis=-1, kind="stable")


class BlockPool:
    """The logical pools of one sequence (every MoE layer) and the block in progress: :meth:`begin_prompt` or
    :meth:`begin_block`, then :meth:`select` for each layer in order, then :meth:`end_block`."""

    def __init__(self, config: BlockConfig, num_layers: int, num_experts: int,
                 expert_counts: np.ndarray | None = None):
        config.check_experts(num_experts)
        self.config = config
        self.num_layers, self.num_experts = int(num_layers), int(num_experts)
        L, E, P = self.num_layers, self.num_experts, config.pool
        if expert_counts is None:
            warm = np.tile(np.arange(E), (L, 1))
        else:
            counts = np.asarray(expert_counts, dtype=np.float64)
            if counts.shape != (L, E):
                raise ValueError(f"expert_counts has shape {counts.shape}; expected ({L}, {E})")
            warm = _ranking(counts)
        self._members = np.zeros((L, E), dtype=bool)
        np.put_along_axis(self._members, warm[:, :P], True, axis=1)
        self._stamps = np.zeros((L, E), dtype=np.int64)
        self.blocks = 0  # verification blocks ended (n)
        self.accepted_at_least = np.zeros(0, dtype=np.int64)  # n_d for d = 1, 2, ...
        self._stamp = 0
        self._block: BlockWeights | None = None
        self._exact = False
        self._next_layer = 0

    def members(self, layer: int) -> np.ndarray:
        """``[E]`` bool: the pool of ``layer``."""
        return self._members[layer].copy()

    # ------------------------------------------------------------------ a block's weights
    def begin_prompt(self, length: int) -> BlockWeights:
        """Start the prompt block (``length`` positions, exact, unit weights)."""
        if int(length) < 1:
            raise ValueError(f"a prompt block needs at least one position; got {length}")
        S = int(length)
        return self._begin(BlockWeights(np.ones(S), np.zeros(S, dtype=bool)), exact=True)

    def begin_block(self, confidences: Sequence[float] | np.ndarray) -> BlockWeights:
        """Start a verification block of ``len(confidences) + 1`` positions; ``confidences[i]`` is the
        drafter's probability of draft ``i + 1``."""
        c = np.asarray(confidences, dtype=np.float64).reshape(-1)
        if c.size and not (np.all(np.isfinite(c)) and np.all((c >= 0) & (c <= 1))):
            raise ValueError("drafter confidences must be probabilities in [0, 1]")
        S, mode = c.size + 1, self.config.mode
        rescue = np.zeros(S, dtype=bool)
        if mode == "exact":
            weights = np.ones(S)
        elif mode == "position":
            counts = np.zeros(S - 1)
            known = min(S - 1, self.accepted_at_least.size)
            counts[:known] = self.accepted_at_least[:known]
            weights = np.concatenate(([1.0], (1.0 + counts) / (2.0 + self.blocks)))
        else:
            weights = np.concatenate(([1.0], np.sqrt(np.cumprod(c))))
            rescue = weights >= self.config.rescue_at
        return self._begin(BlockWeights(weights, rescue), exact=mode == "exact")

    def _begin(self, block: BlockWeights, exact: bool) -> BlockWeights:
        if self._block is not None:
            raise ValueError("a block is already open: end_block() it before starting another")
        self._block, self._exact, self._next_layer = block, exact, 0
        self._stamp += 1
        return block

    # ------------------------------------------------------------------ one layer
    def select(self, layer: int, z: np.ndarray) -> LayerChoice:
        """Rules 1-6 of docs/speculative.md for ``layer`` of the open block, on scores ``z [S, E]``."""
        block = self._block
        if block is None:
            raise ValueError("select() outside a block: call begin_prompt() or begin_block() first")
        if layer != self._next_layer:
            raise ValueError(f"select() for layer {layer}, but the block's next layer is {self._next_layer}: "
                             "layers are selected in order, once per block")
        S, E, K = block.weights.size, self.num_experts, self.config.top_k
        z = np.asarray(z, dtype=np.float32)
        if z.shape != (S, E):
            raise ValueError(f"scores have shape {z.shape}; this block expects ({S}, {E})")
        if not np.all(np.isfinite(z)):
            raise ValueError("router scores must be finite: block selection ranks softmax logits")
        selected = np.empty((S, K), dtype=np.int64)
        demand = np.empty(E, dtype=np.float64)
        copies = _select_layer(np.ascontiguousarray(z), block.weights, block.rescue, self._members[layer],
                               self._stamps[layer], self._stamp, K, self.config.pool, float(self.config.threshold),
                               self._exact, selected, demand)
        self._next_layer += 1
        return LayerChoice(selected=selected, copies=copies, demand=demand)

    def end_block(self, accepted: int | None) -> None:
        """Close the open block; ``accepted``: its accepted drafts (None for the prompt, which counts nothing)."""
        block = self._block
        if block is None:
            raise ValueError("end_block() without an open block")
        if self._next_layer != self.num_layers:
            raise ValueError(f"end_block() after {self._next_layer} of {self.num_layers} layers were selected")
        k = block.weights.size - 1
        if accepted is not None:
            if not 0 <= int(accepted) <= k:
                raise ValueError(f"accepted must be in 0..{k} for a block of {k} drafts; got {accepted}")
            if self.accepted_at_least.size < k:
                self.accepted_at_least = np.concatenate(
                    (self.accepted_at_least, np.zeros(k - self.accepted_at_least.size, dtype=np.int64)))
            self.accepted_at_least[:int(accepted)] += 1
            self.blocks += 1
        self._block = None


def replay(config: BlockConfig, records: Sequence[BlockRecord], num_layers: int, num_experts: int,
           expert_counts: np.ndarray | None = None) -> list[list[LayerChoice]]:
    """The choices of every recorded block (a prompt record first, or verification blocks only), per layer."""
    pool = BlockPool(config, num_layers, num_experts, expert_counts)
    out = []
    for record in records:
        scores = np.asarray(record.scores, dtype=np.float32)
        if scores.ndim != 3 or scores.shape[0] != num_layers:
            raise ValueError(f"a record's scores have shape {scores.shape}; expected ({num_layers}, S, {num_experts})")
        if record.confidences is None:
            pool.begin_prompt(scores.shape[1])
        else:
            pool.begin_block(record.confidences)
        out.append([pool.select(layer, scores[layer]) for layer in range(num_layers)])
        pool.end_block(record.accepted)
    return out
