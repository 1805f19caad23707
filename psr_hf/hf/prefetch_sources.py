"""Prefetch sources: what ranks part 1's candidates of the next MoE layer (docs/ALGORITHM.md, "Prefetch ranking
source").

``RoutingConfig.prefetch`` names one; :func:`prefetch_source` builds it once, when the controller applies the
config, and the controller calls it at fixed points and never asks which it is. A source replaces the pre-gate
``g`` and nothing else. The three: :class:`PregateRanking` (the next router on this layer's input, the default),
:class:`LearnedPredictorRanking` (SpecPrefetch's ``softmax(B A x)``; the predictor is read by duck typing, so
this room never imports ``psr_hf.prefetch``) and :class:`PreviousTokenRanking` (each row's previous token's
scores of that layer). A new source is one class here registered with :func:`register_source`, plus its name
in ``psr_hf/policy/config.py``'s ``PREFETCH_SOURCES`` and its row in docs/ALGORITHM.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from ..policy.calibration import Calibration


class RankingPredictor(Protocol):
    """What a learned predictor gives a source (``psr_hf.prefetch.Predictor`` is one; read by duck typing, so this
    room never imports ``psr_hf.prefetch``)."""

    def weight(self, pair: int) -> torch.Tensor:
        """``[E, H]`` float32: the ranking of MoE layer ``pair + 1`` from layer ``pair``'s router input."""

    def check(self, **model_shape: object) -> None:
        """``ValueError`` where the predictor was trained for another model."""


@runtime_checkable
class PrefetchRanking(Protocol):
    """What the controller asks a prefetch source, at fixed points and never which it is. :class:`PregateRanking`
    is the default implementation and the base of the others; a new source implements these and registers."""

    predictor: RankingPredictor | None

    def ranking_weight(self, layer: int, following: torch.nn.Module) -> torch.Tensor: ...

    def weight_owner(self, following: torch.nn.Module) -> object: ...

    def priorities(self, raw: torch.Tensor, both: torch.Tensor, num_experts: int) -> torch.Tensor: ...

    def start(self, rows: int, calibration: "Calibration") -> None: ...

    def reorder(self, index: np.ndarray) -> None: ...

    def next_pregate(self, layer: int, computed: np.ndarray | None) -> np.ndarray | None: ...

    def block_pregate(self, layer: int, stored: np.ndarray | None, scores: np.ndarray,
                      valid: np.ndarray | None) -> np.ndarray | None: ...

    def remember(self, layer: int, scores: np.ndarray, valid: np.ndarray | None) -> None: ...


_SOURCES: dict[str, type["PregateRanking"]] = {}


def register_source(name: str) -> Callable[[type["PregateRanking"]], type["PregateRanking"]]:
    """Class decorator: the source that ``RoutingConfig(prefetch=name)`` selects."""
    def register(cls: type["PregateRanking"]) -> type["PregateRanking"]:
        _SOURCES[name] = cls
        return cls
    return register


def prefetch_source(name: str, predictor: RankingPredictor | None, current: RankingPredictor | None,
                    model_shape: dict[str, object]) -> PrefetchRanking:
    """The source ``RoutingConfig(prefetch=name)`` ranks with. ``predictor``: the one given to ``patch`` or
    ``reconfigure``; ``current``: the one the model has now (kept by ``reconfigure`` without a new one);
    ``model_shape``: ``num_layers``, ``num_experts``, ``hidden_size``, ``model_type``, ``top_k``, which a
    learned predictor is checked against. ``ValueError`` for a predictor that does not fit the source."""
    return _SOURCES[name].build(predictor, current, model_shape)


def predicted_priorities(logits: torch.Tensor) -> torch.Tensor:
    """A learned predictor's token-level priorities from its logits: ``softmax`` in float32."""
    return torch.softmax(logits.float(), dim=-1)


@register_source("pregate")
class PregateRanking:
    """The pre-gate: the next MoE layer's router applied to this layer's router input. The base of every source:
    each method is a point where the controller asks for the ranking, and this one answers with the pre-gate."""

    predictor: RankingPredictor | None = None  # the learned predictor ranked with (None: none)

    @classmethod
    def build(cls, predictor: RankingPredictor | None, current: RankingPredictor | None,
              model_shape: dict[str, object]) -> "PregateRanking":
        if predictor is not None:
            raise ValueError("a predictor was given but the RoutingConfig ranks prefetches by the pre-gate "
                             "(prefetch='pregate'); set RoutingConfig(prefetch='predictor', ...) to use it")
        return cls()

    def ranking_weight(self, layer: int, following: torch.nn.Module) -> torch.Tensor:
        """``[E, H]``: what ranks the prefetches of MoE layer ``layer + 1`` (router ``following``) from layer
        ``layer``'s router input, stacked under this layer's router weight for one matmul."""
        return following.weight

    def weight_owner(self, following: torch.nn.Module) -> object:
        """The object whose identity (and version counter, for a tensor) says the stacked weight is stale."""
        return following.weight

    def priorities(self, raw: torch.Tensor, both: torch.Tensor, num_experts: int) -> torch.Tensor:
        """``[N, 2E]``: the joint matmul's scores ``both`` (logits ``raw``) with the pre-gate half as this source's
        ranking."""
        return both

    def start(self, rows: int, calibration: "Calibration") -> None:
        """A new sequence of ``rows`` rows starts."""

    def reorder(self, index: np.ndarray) -> None:
        """The rows are reordered like the KV cache: new row ``i`` continues old row ``index[i]``."""

    def next_pregate(self, layer: int, computed: np.ndarray | None) -> np.ndarray | None:
        """``[B, 1, E]``: the ranking of MoE layer ``layer`` at a decode step, given the pre-gate ``computed``
        on the previous layer's input (None: none was computed)."""
        return computed

    def block_pregate(self, layer: int, stored: np.ndarray | None, scores: np.ndarray,
                      valid: np.ndarray | None) -> np.ndarray | None:
        """``[B, S, E]``: the ranking of MoE layer ``layer`` (>= 1) for a block of positions, given the pre-gate
        ``stored`` by the previous layer and this layer's ``scores`` ``[B, S, E]`` (``valid``: real positions)."""
        return stored

    def remember(self, layer: int, scores: np.ndarray, valid: np.ndarray | None) -> None:
        """MoE layer ``layer`` ran with ``scores`` ``[B, S, E]`` (``valid``: real positions, None: all)."""


@register_source("predictor")
class LearnedPredictorRanking(PregateRanking):
    """A learned predictor's priorities ``softmax(B A x)`` (a :class:`psr_hf.prefetch.Predictor`, read by duck
    typing: ``weight(pair)`` and ``check(...)``), checked against the model."""

    def __init__(self, predictor: RankingPredictor):
        self.predictor = predictor

    @classmethod
    def build(cls, predictor: RankingPredictor | None, current: RankingPredictor | None,
              model_shape: dict[str, object]) -> "LearnedPredictorRanking":
        if predictor is None:
            predictor = current
        if predictor is None:
            raise ValueError("RoutingConfig(prefetch='predictor') needs the predictor: patch(model, config, "
                             "predictor=psr_hf.prefetch.Predictor.load(path)) (train one with psr-hf "
                             "train-predictor)")
        if not callable(getattr(predictor, "weight", None)) or not callable(getattr(predictor, "check", None)):
            raise ValueError(f"predictor must be a psr_hf.prefetch.Predictor (psr_hf.prefetch.Predictor.load(path) "
                             f"reads a saved one); got {type(predictor).__name__}")
        predictor.check(**model_shape)
        return cls(predictor)

    def ranking_weight(self, layer: int, following: torch.nn.Module) -> torch.Tensor:
        return self.predictor.weight(layer)  # B A, float32

    def weight_owner(self, following: torch.nn.Module) -> object:
        return self.predictor

    def priorities(self, raw: torch.Tensor, both: torch.Tensor, num_experts: int) -> torch.Tensor:
        E = num_experts
        return torch.cat((both[:, :E].float(), predicted_priorities(raw[:, E:])), dim=-1)


@register_source("previous")
class PreviousTokenRanking(PregateRanking):
    """Naive Prefetch: each row's last real scores of a layer rank that layer's prefetches for the next token. At
    a sequence start the ranking is the calibration's expert counts (the experts the router picks most often:
    mostly the warm set, already resident)."""

    def __init__(self) -> None:
        self._previous: np.ndarray | None = None  # [L, R, E] each row's last real z per layer

    def start(self, rows: int, calibration: "Calibration") -> None:
        counts = np.asarray(calibration.expert_counts, dtype=np.float32)  # [L, E]
        self._previous = np.repeat(counts[:, None, :], rows, axis=1)  # [L, R, E], a writable copy

    def reorder(self, index: np.ndarray) -> None:
        self._previous = np.ascontiguousarray(self._previous[:, index])

    def next_pregate(self, layer: int, computed: np.ndarray | None) -> np.ndarray:
        return self._previous[layer][:, None].copy()  # the previous token's scores (not yet rewritten)

    def block_pregate(self, layer: int, stored: np.ndarray | None, scores: np.ndarray,
                      valid: np.ndarray | None) -> np.ndarray:
        # each position's ranking: the scores of the row's previous real position at this layer (this block's,
        # or the one before the block), before remember() updates them
        B, S, E = scores.shape
        g = np.empty((B, S, E), dtype=np.float32)
        for b in range(B):
            last = self._previous[layer, b]
            for s in range(S):
                g[b, s] = last
                if valid is None or valid[b, s]:
                    last = scores[b, s]
        return g

    def remember(self, layer: int, scores: np.ndarray, valid: np.ndarray | None) -> None:
        previous = self._previous[layer]
        if valid is None:
            previous[:] = scores[:, -1]
            return
        for b in range(scores.shape[0]):
            real = np.flatnonzero(valid[b])
            if real.size:
                previous[b] = scores[b, real[-1]]
