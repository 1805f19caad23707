"""The displaced-router-mass kernel against a direct numpy computation."""

from __future__ import annotations

import numpy as np
import pytest

from psr_hf.policy._mass import MASS_SIGMOID_BIAS, MASS_SOFTMAX, displaced_fraction


def _reference(z, chosen, positions, mode, bias):
    out = []
    for p in positions:
        row = z[p].astype(np.float64)
        own = np.argsort(-row, kind="stable")[: chosen.shape[1]]  # ties to the lower index
        if mode == MASS_SOFTMAX:
            weight = np.exp(row - row.max())
        else:
            weight = np.where(np.isfinite(row), row - bias, 0.0)
        lost = sum(weight[e] for e in own if e not in set(chosen[p].tolist()))
        out.append(lost / weight[own].sum())
    return np.array(out)


@pytest.mark.parametrize("mode", [MASS_SOFTMAX, MASS_SIGMOID_BIAS])
@pytest.mark.parametrize("seed", range(3))
def test_displaced_fraction_matches_direct_computation(mode, seed):
    rng = np.random.default_rng(seed)
    N, E, K = 40, 16, 4
    z = rng.normal(size=(N, E)).astype(np.float32)
    bias = rng.normal(scale=0.05, size=E)
    if mode == MASS_SIGMOID_BIAS:
        z = (1 / (1 + np.exp(-z)) + bias).astype(np.float32)
        z[:, 8:][rng.random((N, 8)) < 0.5] = -np.inf  # group-masked experts
    z[0, :4] = z[0, 4]  # ties
    chosen = np.stack([rng.choice(np.flatnonzero(np.isfinite(z[p])), K, replace=False) for p in range(N)])
    chosen[1] = np.argsort(-z[1].astype(np.float64), kind="stable")[:K]  # the own top-K: nothing displaced
    positions = np.arange(N, dtype=np.int64)
    got = displaced_fraction(z, chosen.astype(np.int64), positions, mode, bias)
    np.testing.assert_allclose(got, _reference(z, chosen, positions, mode, bias), rtol=1e-6, atol=1e-12)
    assert got[1] == 0.0 and ((got >= 0) & (got <= 1)).all() and got.max() > 0


def test_boundary_ties_flags_exactly_the_ambiguous_top_k():
    from psr_hf.policy._mass import boundary_ties

    rng = np.random.default_rng(0)
    N, E, K = 200, 16, 4
    z = rng.integers(0, 6, size=(N, E)).astype(np.float32)  # many ties
    z[:5, 10:] = -np.inf
    z[5] = -np.inf
    z[5, :K] = 1.0  # exactly K finite scores: the top-K is unambiguous
    flags = np.zeros(N, dtype=np.uint8)
    flags[7] = 1  # already set: left as it is
    boundary_ties(z, K, flags)
    ordered = -np.sort(-z.astype(np.float64), axis=1)
    expected = (ordered[:, K - 1] == ordered[:, K]) & np.isfinite(ordered[:, K - 1])
    expected[7] = True
    np.testing.assert_array_equal(flags.astype(bool), expected)
    assert 0 < expected.sum() < N
