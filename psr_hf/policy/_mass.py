"""Displaced router mass: how much of the router's own top-K weight a cache-aware selection left out (numba).

Private and array-only, like :mod:`._kernels`; called by the HF controller on every layer where a selection
differs from the router's own top-K, so it must cost microseconds, not the tens of microseconds of numpy.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .numba_setup import use_user_cache_folder

use_user_cache_folder()  # before the decorators below

MASS_SOFTMAX = 0  # weight of expert e proportional to exp(z[e]) (softmax routers: z are the logits)
MASS_SIGMOID_BIAS = 1  # weight = z[e] - bias[e] (DeepSeek-V3: z = sigmoid(logits) + bias; -inf = masked, weight 0)


@njit(cache=True, nogil=True)
def _displaced_fraction(z, chosen, positions, mode, bias, out):  # pragma: no cover - compiled
    """For each flat position ``p`` in ``positions``: the fraction of the router's own top-K weight (top-K of
    ``z[p]``, ties to the lower index) whose experts are not in ``chosen[p]``. ``z`` [N, E] float32, ``chosen``
    [N, K] int64, ``positions`` [n] int64, ``bias`` [E] float (read for MASS_SIGMOID_BIAS), ``out`` [n] float64."""
    N, E = z.shape
    K = chosen.shape[1]
    taken = np.zeros(E, dtype=np.bool_)
    executed = np.zeros(E, dtype=np.bool_)
    for i in range(positions.shape[0]):
        p = positions[i]
        row = z[p]
        top = -np.inf
        for e in range(E):
            taken[e] = False
            executed[e] = False
            if row[e] > top:
                top = row[e]
        for k in range(K):
            executed[chosen[p, k]] = True
        own = 0.0
        lost = 0.0
        for k in range(K):
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or row[e] > row[best]):
                    best = e
            taken[best] = True
            if mode == MASS_SOFTMAX:
                w = np.exp(np.float64(row[best]) - top)
            elif np.isfinite(row[best]):
                w = np.float64(row[best]) - bias[best]
            else:
                w = 0.0
            own += w
            if not executed[best]:
                lost += w
        out[i] = lost / own if own > 0 else 0.0
    return out


def displaced_fraction(z: np.ndarray, chosen: np.ndarray, positions: np.ndarray, mode: int,
                       bias: np.ndarray | None = None) -> np.ndarray:
    """``[n]`` displaced fraction of the router's own top-K weight at ``positions`` (see the kernel)."""
    if bias is None:
        bias = np.zeros(z.shape[1], dtype=np.float64)
    out = np.empty(positions.shape[0], dtype=np.float64)
    return _displaced_fraction(z, chosen, positions, mode, bias, out)


@njit(cache=True, nogil=True)
def _boundary_ties(z, K, flags):  # pragma: no cover - compiled
    """Set ``flags[p] = 1`` where the K-th and (K+1)-th largest scores of ``z[p]`` are equal and finite (the
    own top-K is then ambiguous); other flags are left as they are. Returns ``flags``.

    Per position, the smallest of the maxima of ``K + 1`` disjoint groups bounds the (K+1)-th largest from below
    (each group holds an element at least that large), so only the few elements reaching it are ranked (a pass
    without unpredictable branches, then an insertion over those few)."""
    N, E = z.shape
    if K >= E:
        return flags
    G = K + 1
    top = np.empty(G, dtype=z.dtype)  # group maxima, then the G largest so far, descending (insertion)
    cand = np.empty(E, dtype=z.dtype)
    full = E - E % G  # group of element e: e mod G (the inner loop contiguous)
    for p in range(N):
        if flags[p]:
            continue
        row = z[p]
        for c in range(G):
            top[c] = -np.inf
        for base in range(0, full, G):
            for c in range(G):
                v = row[base + c]
                top[c] = v if v > top[c] else top[c]
        for e in range(full, E):
            v = row[e]
            top[e - full] = v if v > top[e - full] else top[e - full]
        thr = top[0]
        for c in range(1, G):
            thr = top[c] if top[c] < thr else thr
        nc = 0
        for e in range(E):  # branch-free compaction of the elements reaching the bound
            v = row[e]
            cand[nc] = v
            nc += v >= thr
        n = 0
        for i in range(nc):
            v = cand[i]
            if n < G:
                j = n
                n += 1
            elif v > top[K]:
                j = K
            else:
                continue
            while j > 0 and top[j - 1] < v:
                top[j] = top[j - 1]
                j -= 1
            top[j] = v
        if n == G and np.isfinite(top[K - 1]) and top[K] == top[K - 1]:
            flags[p] = 1
    return flags


def boundary_ties(z: np.ndarray, top_k: int, flags: np.ndarray) -> np.ndarray:
    """``flags`` ``[N]`` uint8, set to 1 where ``z`` ``[N, E]`` ties across its top-``top_k`` boundary."""
    return _boundary_ties(z, top_k, flags)


@njit(cache=True, nogil=True)
def _finish_layer(plan, K, replaced_col, z, valid, pad_ties, mode, bias, displaced, positions, chosen,
                  flags):  # pragma: no cover
    """Everything the HF controller does with one layer's plan, in one compiled call.

    ``plan`` [N, W] int64 (selected experts in columns 0..K-1, replaced count in ``replaced_col``), ``z`` [N, E]
    float32 scores, ``valid`` [N] uint8 (empty: every position real), ``pad_ties``: 1 to treat a padded position
    whose own top-K ties at the boundary like a real one (the offload loads exactly the plan's experts), 0 to let
    padding run the router's own outputs (torch's pick among the tied; the unpatched model's logits there). Writes ``chosen`` [N, K] int64 (the
    selected experts) and ``flags`` [N] uint8: 1 where the layer must run the selection explicitly (a replaced
    router slot, or a tie across the router's own top-K boundary); adds each replaced
    position's displaced fraction of the router's own top-K weight to ``displaced[p // positions]`` (its row).
    Returns the number of flagged positions."""
    N = plan.shape[0]
    for p in range(N):
        for k in range(K):
            chosen[p, k] = plan[p, k]
        if plan[p, replaced_col] > 0:
            flags[p] = 1
        elif valid.shape[0] and valid[p] == 0 and pad_ties == 0:
            flags[p] = 2  # padding runs the router's own outputs
        else:
            flags[p] = 0
    # a tie across the own top-K boundary: torch's pick is arbitrary, the plan's is the spec's (lower index)
    _boundary_ties(z, K, flags)
    one = np.empty(1, dtype=np.int64)
    out = np.empty(1, dtype=np.float64)
    count = 0
    for p in range(N):
        if flags[p] == 2:
            flags[p] = 0
        count += flags[p]
        if plan[p, replaced_col] > 0:
            one[0] = p
            _displaced_fraction(z, chosen, one, mode, bias, out)
            displaced[p // positions] += out[0]
    return count
