"""Per-token margins on the logical cache (the paper's Section 6.10): the change-based gate keeps a persistent active
set and swaps an expert in only when its score exceeds the weakest selected member's by a margin ``mu``. With one
margin ``mu = lam * delta[l]`` for every token this is Cache-Prior's selection (Equation 1) with LRU demand
insertions; a learned margin ``mu[t, l]`` per token runs through the same kernels by scaling each token's scores by
``lam * delta[l] / mu[t, l] > 0``, which keeps every comparison of the rule (``z_e > z_f + mu``) and the router's own
top-K. The scaled scores are what the policy reads, so a recording replays the gate's decisions.
"""

from __future__ import annotations

import numpy as np

MIN_MARGIN = 1e-6  # below this a margin is no margin; scaling by its inverse would overflow float32 scores


def margin_scale(margins: np.ndarray, lam: float, delta: np.ndarray) -> np.ndarray:
    """``lam * delta[l] / margins[..., l]`` for ``margins [..., L]``: the factor that turns Cache-Prior with bonus
    ``lam * delta[l]`` into the gate with these margins. ``ValueError`` for margins that are not finite or not above
    :data:`MIN_MARGIN`, a ``lam`` or ``delta`` that is not positive, or mismatched layers."""
    margins = np.asarray(margins, dtype=np.float64)
    delta = np.asarray(delta, dtype=np.float64)
    if not np.isfinite(lam) or lam <= 0:
        raise ValueError(f"lam={lam}: per-token margins scale Cache-Prior's bonus; give lam > 0")
    if delta.ndim != 1 or margins.ndim < 1 or margins.shape[-1] != delta.shape[0]:
        raise ValueError(f"margins of shape {margins.shape} need one margin per MoE layer ({delta.shape[0]}) in "
                         "their last axis")
    if not (np.isfinite(delta).all() and (delta > 0).all()):
        raise ValueError("the calibration's delta must be positive at every layer for per-token margins; calibrate "
                         "the model (psr-hf calibrate)")
    if not np.isfinite(margins).all() or (margins < MIN_MARGIN).any():
        raise ValueError(f"margins must be finite and at least {MIN_MARGIN:g}; a gate's margin head bounds them")
    return lam * delta / margins


def margin_scores(scores: np.ndarray, margins: np.ndarray, lam: float, delta: np.ndarray) -> np.ndarray:
    """Selection scores ``[..., L, E]`` scaled per token and layer so that Cache-Prior with ``lam`` (fixed delta,
    LRU, no prefetch) makes the gate's decisions for ``margins [..., L]``; float32, C-contiguous, as the kernels
    read them."""
    scores = np.asarray(scores, dtype=np.float32)
    scale = margin_scale(margins, lam, delta)
    if scores.shape[:-1] != scale.shape:
        raise ValueError(f"scores {scores.shape} and margins {scale.shape} differ in their leading axes")
    return np.ascontiguousarray((scores.astype(np.float64) * scale[..., None]).astype(np.float32))
