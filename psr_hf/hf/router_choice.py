"""Exact routing runs what the model's own router picks, ties included.

The policy ranks the selection scores with ties to the lower index (ALGORITHM.md); the router's own top-k breaks
ties its own way (torch's, which differs between devices and kernels), and its scores can tie where the policy's
do not (a float32 softmax rounds logits one ulp apart together). Where the two top-K sets differ, the scores the
exact policy sees are raised, for the router's picks only, to the next float above the best expert it left out:
the smallest change after which the policy's top-K is the router's, so the executed experts, the logical cache
and a recording's replay all agree with the unpatched model.
"""

from __future__ import annotations

import numpy as np


def follow_router_choice(scores: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """``scores`` ``[N, E]`` float32 selection scores and ``picks`` ``[N, K]`` the router's own experts per
    position: the scores whose top-K (ties to the lower index) is ``picks`` at every position. Returns ``scores``
    itself where every position already agrees, else a copy with the disagreeing positions' picks raised."""
    N, E = scores.shape
    picked = np.zeros((N, E), dtype=bool)
    np.put_along_axis(picked, picks, True, axis=1)
    best_left_out = np.where(picked, -np.inf, scores).max(axis=1)  # [N]
    worst_picked = np.where(picked, scores, np.inf).min(axis=1)  # [N]
    rows = np.flatnonzero(~(worst_picked > best_left_out))
    if rows.size == 0:
        return scores
    out = scores.copy()
    floor = np.nextafter(best_left_out[rows].astype(np.float32), np.float32(np.inf))  # [n]
    sub = out[rows]
    out[rows] = np.where(picked[rows], np.maximum(sub, floor[:, None]), sub)
    return out
