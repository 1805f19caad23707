"""replay(): run the policy over a recorded single-row routing trace, layer by layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .cache import LogicalCache
from .config import DEFAULT_WINDOW, RoutingConfig


@dataclass(frozen=True)
class ReplayResult:
    """Decisions of :func:`replay` for a trace of ``T`` tokens and ``L`` MoE layers."""

    selected: np.ndarray  # [T, L, K] int64, each row sorted ascending
    prefetch_copies: np.ndarray  # [T, L] int64 prefetch insertions
    demand_copies: np.ndarray  # [T, L] int64 demand insertions
    replaced: np.ndarray  # [T, L] int64 selected experts outside the router's own top-K

    def copies_per_token(self) -> dict[str, float]:
        """Mean prefetch, demand and total copies per token (summed over layers), and replaced router slots."""
        T = max(self.selected.shape[0], 1)
        prefetch = float(self.prefetch_copies.sum()) / T
        demand = float(self.demand_copies.sum()) / T
        return {
            "prefetch": prefetch,
            "demand": demand,
            "total": prefetch + demand,
            "replaced": float(self.replaced.sum()) / T,
        }

    def __repr__(self) -> str:
        T, L, K = self.selected.shape
        c = self.copies_per_token()
        return (f"ReplayResult(tokens={T}, layers={L}, top_k={K}, copies/tok={c['total']:.2f} (demand "
                f"{c['demand']:.2f}, prefetch {c['prefetch']:.2f}), replaced/tok={c['replaced']:.2f})")


@dataclass(frozen=True)
class Recording:
    """One batch row's routing trace, captured from a patched model (``psr_hf.controller(model).record()``).

    Only real positions are kept (padding and the positions of rows that finished are dropped), in order.
    ``replay(config, recording, calibration=...)`` re-runs the policy on it and reproduces ``selected``.
    """

    scores: np.ndarray  # [T, L, E] float32 selection scores z
    pregate: np.ndarray  # [T, L, E] float32 pre-gates (pregate[:, 0] is zero: layer 0 has none)
    tokens: np.ndarray  # [T] int64 input token ids
    selected: np.ndarray  # [T, L, K] int64 experts the model executed, each row sorted ascending
    top_k: int
    default_window: int  # the architecture's pre-gate window
    sequence: int = 0  # which sequence (reset) of the recording this row belongs to
    row: int = 0  # the batch row it was in

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __repr__(self) -> str:
        T, L, E = self.scores.shape
        return (f"Recording(tokens={T}, layers={L}, experts={E}, top_k={self.top_k}, sequence={self.sequence}, "
                f"row={self.row})")


def replay(
    config: RoutingConfig,
    scores: Any,
    pregate: Any = None,
    tokens: Any = None,
    calibration: Any = None,
    top_k: int | None = None,
    *,
    default_window: int | None = None,
) -> ReplayResult:
    """Replay the routing policy over one row's trace.

    Args:
        config: the routing policy (a :class:`RoutingConfig` or a dict of its fields).
        scores: float32 ``[T, L, E]`` selection scores of every MoE layer, or a :class:`Recording` (which then
            supplies ``pregate``, ``tokens``, ``top_k`` and ``default_window``).
        pregate: float32 ``[T, L, E]`` pre-gate scores (``pregate[:, l]`` is layer ``l``'s router on the input of
            layer ``l-1``'s MoE block); ``pregate[:, 0]`` is never read, since layer 0 has no pre-gate. May be
            None for policies that never read it (cache_prior, exact without budget).
        tokens: int ``[T]`` input token ids.
        calibration: a :class:`Calibration` (or path / mapping), or None (see :class:`LogicalCache`).
        top_k: the model's K.
        default_window: the pre-gate window when ``config.window`` is None (the architecture's default;
            8 when neither it nor a recording gives one).

    Returns:
        :class:`ReplayResult` with ``selected [T, L, K]`` (sorted ascending), ``prefetch_copies [T, L]`` and
        ``demand_copies [T, L]``.
    """
    if isinstance(scores, Recording):
        if pregate is not None or tokens is not None:
            raise ValueError("pass either a Recording or scores/pregate/tokens arrays, not both")
        rec = scores
        scores, pregate, tokens = rec.scores, rec.pregate, rec.tokens
        top_k = rec.top_k if top_k is None else top_k
        default_window = rec.default_window if default_window is None else default_window
    if top_k is None:
        raise ValueError("top_k is required (the model's number of experts per token)")
    if tokens is None:
        raise ValueError("tokens are required ([T] input token ids)")
    if default_window is None:
        default_window = DEFAULT_WINDOW
    z = np.asarray(scores)
    if z.ndim != 3:
        raise ValueError(f"scores must have shape [T, L, E], got {z.shape}")
    T, L, E = z.shape
    if T == 0:
        raise ValueError("scores hold no tokens (T = 0)")
    g = None
    if pregate is not None:
        g = np.asarray(pregate)
        if g.shape != z.shape:
            raise ValueError(f"pregate has shape {g.shape}; expected {z.shape} like scores")
    tok = np.asarray(tokens)
    if tok.ndim != 1 or tok.shape[0] != T:
        raise ValueError(f"tokens must have shape [T] = ({T},), got {tok.shape}")
    cache = LogicalCache(
        config, num_layers=L, num_experts=E, top_k=top_k, calibration=calibration, rows=1,
        default_window=default_window,
    )
    K = cache.top_k
    selected = np.empty((T, L, K), dtype=np.int64)
    prefetch = np.empty((T, L), dtype=np.int64)
    demand = np.empty((T, L), dtype=np.int64)
    replaced = np.empty((T, L), dtype=np.int64)
    tok2 = tok.reshape(1, T)
    # [L, 1, T, E]: every layer's block contiguous; layers run in parallel threads (each layer's state
    # depends only on that layer's own history, so this is the same as running them one after another)
    z_l = np.ascontiguousarray(np.moveaxis(z, 1, 0)[:, None], dtype=np.float32) if np.issubdtype(z.dtype, np.floating) else z
    g_l = None if g is None else np.moveaxis(g, 1, 0)[:, None]
    plans = cache.step_all_layers(z_l, g_l, tok2)
    for layer, plan in enumerate(plans):
        selected[:, layer] = np.sort(plan.selected[0], axis=-1)
        prefetch[:, layer] = plan.prefetch_count[0]
        demand[:, layer] = plan.demand_count[0]
        replaced[:, layer] = plan.replaced[0]
    return ReplayResult(selected, prefetch, demand, replaced)
