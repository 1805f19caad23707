"""numba kernel of one layer of a verification block (docs/speculative.md, "The rules", 1-6). Private and
array-only: :meth:`psr_hf.policy.blocks.BlockPool.select` validates its inputs and calls it. A host-side numpy
version of these rules costs about 200 us per layer, which the engine pays once per MoE layer and block."""

from __future__ import annotations

import numpy as np
from numba import njit

from .numba_setup import use_user_cache_folder; use_user_cache_folder()  # noqa: E702 (before the njit)


@njit(cache=True)
def _select_layer(z, weights, rescue, members, stamps, stamp, top_k, pool, threshold, exact, selected,
                  demand):  # pragma: no cover - compiled
    """Rules 1-6 for scores ``z [S, E]`` (float32): writes ``selected [S, K]`` (rows ascending) and ``demand [E]``,
    updates ``members`` and ``stamps`` of the layer's pool in place; returns the copied experts, ascending."""
    S, E = z.shape
    K = top_k
    ranking = np.empty((S, E), dtype=np.int64)
    demand[:] = 0.0
    total_weight = 0.0
    for d in range(S):
        total_weight += weights[d]
        row = z[d]
        order = np.argsort(-row, kind="mergesort")  # stable: ties to the lower index
        ranking[d] = order
        top = np.float64(row[order[0]])
        norm = 0.0
        for e in range(E):
            norm += np.exp(np.float64(row[e]) - top)
        for j in range(K):
            e = order[j]
            demand[e] += weights[d] * (np.exp(np.float64(row[e]) - top) / norm)
    eligible = members.copy()
    if not exact:
        limit = threshold * total_weight
        for e in range(E):
            if demand[e] >= limit:
                eligible[e] = True
    for d in range(S):
        if exact:
            for j in range(K):
                selected[d, j] = ranking[d, j]
        else:
            top1 = ranking[d, 0]
            j = 0
            if rescue[d] and not eligible[top1]:
                selected[d, 0] = top1
                j = 1
            for i in range(E):
                if j == K:
                    break
                e = ranking[d, i]
                if eligible[e]:
                    selected[d, j] = e
                    j += 1
        selected[d].sort()
    used = np.zeros(E, dtype=np.bool_)
    for d in range(S):
        for j in range(K):
            used[selected[d, j]] = True
    n_copies = 0
    for e in range(E):
        if used[e] and not members[e]:
            n_copies += 1
    copies = np.empty(n_copies, dtype=np.int64)
    n_copies = 0
    for e in range(E):
        if used[e]:
            if not members[e]:
                copies[n_copies] = e
                n_copies += 1
            stamps[e] = stamp
    # the new pool: the P candidates with the latest stamps, ties toward the larger demand, then the lower index
    candidate = np.zeros(E, dtype=np.bool_)
    for e in range(E):
        candidate[e] = members[e] or used[e]
        members[e] = False
    for _ in range(pool):
        best = -1
        for e in range(E):
            if not candidate[e]:
                continue
            if best < 0 or stamps[e] > stamps[best] or (stamps[e] == stamps[best] and demand[e] > demand[best]):
                best = e
        if best < 0:
            break
        members[best] = True
        candidate[best] = False
    return copies
