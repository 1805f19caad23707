"""Synthetic routing traces with the structure cache-aware routing exploits.

Used by the tests, ``psr-hf bench-policy`` and (until a trained model ships) ``psr-hf demo``. Real traces come
from ``psr_hf.controller(model).record()``.

Structure: each layer's router scores are ``popularity[l] + token_affinity[x, l] + AR(1) state``, so experts
have skewed popularity (a warm set matters), tokens have preferences (the token prior matters) and consecutive
tokens reuse experts (the cache matters). The pre-gate of layer ``l`` is layer ``l``'s scores plus noise, like a
router applied one layer early.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Trace:
    """One row's routing trace."""

    scores: np.ndarray  # [T, L, E] float32
    pregate: np.ndarray  # [T, L, E] float32 (pregate[:, 0] unused)
    tokens: np.ndarray  # [T] int64


def synthetic_trace(
    num_tokens: int,
    num_layers: int,
    num_experts: int,
    *,
    vocab_size: int = 512,
    seed: int = 0,
    locality: float = 0.8,
    pregate_noise: float = 0.5,
    model_seed: int = 1234,
) -> Trace:
    """A correlated random trace. Traces with the same ``model_seed`` share the "model" (popularity and token
    affinities), so a calibration built from one applies to another with a different ``seed``."""
    model = np.random.default_rng(model_seed)
    popularity = model.standard_normal((num_layers, num_experts)) * 0.7
    affinity = model.standard_normal((vocab_size, num_layers, num_experts)) * 0.8
    rng = np.random.default_rng(seed)
    # Zipf-like token stream
    ranks = np.arange(1, vocab_size + 1)
    probs = 1.0 / ranks
    probs /= probs.sum()
    tokens = rng.choice(vocab_size, size=num_tokens, p=probs).astype(np.int64)
    noise = rng.standard_normal((num_tokens, num_layers, num_experts))
    state = np.empty_like(noise)
    state[0] = noise[0]
    scale = np.sqrt(1.0 - locality**2)
    for t in range(1, num_tokens):
        state[t] = locality * state[t - 1] + scale * noise[t]
    scores = (popularity[None] + affinity[tokens] + state).astype(np.float32)
    pregate = (scores + pregate_noise * rng.standard_normal(scores.shape)).astype(np.float32)
    pregate[:, 0] = 0.0
    return Trace(scores, pregate, tokens)


def own_topk(scores: np.ndarray, top_k: int) -> np.ndarray:
    """[..., K] the router's own top-K of ``scores [..., E]`` (ties to the lower index)."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    return order[..., :top_k]


def calibration_from_trace(trace: Trace, top_k: int, vocab_size: int):
    """A :class:`~psr_hf.policy.Calibration` estimated from a trace, as ``psr-hf calibrate`` does from text."""
    from .calibration import CalibrationBuilder

    T, L, E = trace.scores.shape
    builder = CalibrationBuilder(L, E, vocab_size, top_k)
    finite = np.where(np.isfinite(trace.scores), trace.scores, np.nan)
    score_range = np.nanmax(finite, axis=-1) - np.nanmin(finite, axis=-1)
    builder.add(trace.tokens, own_topk(trace.scores, top_k), score_range)
    return builder.build(metadata={"source": "synthetic trace"})
