"""Statistics from scipy and statsmodels: the one place psr_hf turns measurements into intervals and tests.

- intervals: :func:`mean_interval` (Student t, independent values: benchmark rounds, text windows),
  :func:`normal_interval` (a known standard error), :func:`mean_over_tasks` (tasks taken as independent) and
  :func:`standard_error`;
- :func:`paired_log_ratio`: the ratio of paired values (two configurations timed in the same rounds);
- paired tests of a run B against a reference A on the same questions, as :class:`PairedStatistic`:
  :func:`paired_binary` (exact McNemar), :func:`paired_clustered` (cluster-robust SE and :func:`sign_flip_test`),
  :func:`paired_perplexity_ratio` and :func:`paired_continuous`;
- :func:`paired_t_test`: the one t-test of paired differences (no p-value where t is undefined);
  :func:`holm`: Holm's correction over a family of tests.

Used by :mod:`psr_hf.eval` (divergence, compare) and by every benchmark in :mod:`psr_hf.bench`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean with its standard error and the interval ``[low, high]`` at ``level`` (nan where undefined)."""

    mean: float
    se: float
    low: float
    high: float
    level: float = LEVEL


@dataclass(frozen=True)
class RatioInterval:
    """The ratio of paired values: ``ratio`` = exp(mean log ratio), ``[low, high]`` its interval at ``level``,
    ``p`` the two-sided p-value of the log ratios against 0 (None where undefined: fewer than 2 pairs, or every
    log ratio equal), ``ratios`` the per-pair ratios in order."""

    ratio: float
    low: float
    high: float
    p: float | None
    ratios: tuple[float, ...]
    level: float = LEVEL


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level!r} must be in (0, 1), e.g. 0.95")


def standard_error(values: Sequence[float] | np.ndarray) -> float:
    """The standard error of the mean of ``values``, sd (n - 1 degrees of freedom) / sqrt(n)
    (``scipy.stats.sem``); nan with fewer than 2 values."""
    from scipy import stats

    a = np.asarray(values, dtype=np.float64)
    if a.size < 2:
        return math.nan
    return float(stats.sem(a))


def mean_interval(values: Sequence[float] | np.ndarray, level: float = LEVEL) -> Interval:
    """The mean of ``values`` (one number per independent repetition) with its Student t interval at ``level``
    (``scipy.stats.t.interval``, n - 1 degrees of freedom).

    Fewer than 2 values: nan ``se`` and bounds (the mean is the single value; nan for none). Equal values: a
    zero-width interval at the mean (scipy's t has no zero scale)."""
    from scipy import stats

    _check_level(level)
    a = np.asarray(values, dtype=np.float64)
    mean = float(a.mean()) if a.size else math.nan
    se = standard_error(a)
    if not math.isfinite(se):
        return Interval(mean, se, math.nan, math.nan, level)
    if se == 0.0:
        return Interval(mean, 0.0, mean, mean, level)
    low, high = stats.t.interval(level, a.size - 1, loc=mean, scale=se)
    return Interval(mean, se, float(low), float(high), level)


def normal_interval(mean: float, se: float, level: float = LEVEL) -> Interval:
    """``mean`` with the normal interval ``mean +- z se`` at ``level`` (``scipy.stats.norm.interval``) for a
    known standard error ``se`` (nan bounds for a nan ``se``; zero width for a zero one)."""
    from scipy import stats

    _check_level(level)
    if not math.isfinite(se) or se == 0.0:
        bound = mean if se == 0.0 else math.nan
        return Interval(float(mean), float(se), bound, bound, level)
    low, high = stats.norm.interval(level, loc=mean, scale=se)
    return Interval(float(mean), float(se), float(low), float(high), level)


@dataclass(frozen=True)
class TTest:
    """A one-sample t-test of paired differences against 0: ``statistic``, the two-sided ``p`` and ``df``; both
    None where t is undefined (fewer than 2 pairs, or every difference equal: zero variance), with the ``reason``."""

    statistic: float | None
    p: float | None
    df: int
    reason: str | None = None


def paired_t_test(differences: Sequence[float] | np.ndarray) -> TTest:
    """``scipy.stats.ttest_1samp`` of ``differences`` against 0, with n - 1 degrees of freedom. Equal differences
    have zero variance, so t is 0/0 or infinite and no p-value follows from it: both are None."""
    from scipy import stats

    d = np.asarray(differences, dtype=np.float64)
    df = max(d.size - 1, 0)
    if d.size < 2:
        return TTest(None, None, df, f"{d.size} pair{'s' if d.size != 1 else ''}: a t-test needs 2")
    if np.ptp(d) == 0:
        return TTest(None, None, df, f"every difference equals {float(d[0]):g}: no variance, t is undefined")
    result = stats.ttest_1samp(d, 0.0)
    return TTest(float(result.statistic), float(result.pvalue), df)


def paired_log_ratio(values: Sequence[float], baseline: Sequence[float], level: float = LEVEL) -> RatioInterval:
    """The ratio of ``values`` to ``baseline``, paired by position (e.g. ms/token of two configurations in the same
    rounds): the log ratios' :func:`mean_interval` exponentiated, and the p-value of their :func:`paired_t_test`
    against 0. Raises ``ValueError`` for unequal lengths, no pairs or a value that is not positive."""
    a = np.asarray(values, dtype=np.float64)
    b = np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"values and baseline must be paired 1-d sequences of equal length >= 1, got shapes "
                         f"{a.shape} and {b.shape}")
    if not (np.all(a > 0) and np.all(b > 0)):
        raise ValueError("a log ratio needs positive values and baseline")
    logs = np.log(a / b)
    interval = mean_interval(logs, level)
    return RatioInterval(math.exp(interval.mean), math.exp(interval.low), math.exp(interval.high),
                         paired_t_test(logs).p, tuple(float(r) for r in np.exp(logs)), level)


# ---------------------------------------------------------------------------------------------------- paired tests
@dataclass(frozen=True)
class PairedStatistic:
    """A paired comparison of B with A on one column, in the metric's own units (proportions, nats).

    ``p``: the two-sided p-value, None where the test is undefined (``details["no_test"]`` says why);
    ``counts``: discordant counts (``reference_only``/``run_only`` questions; for clustered metrics also prompts
    where B or A followed more instructions); ``details``: what the test used (permutations, seed, df, ...).
    """

    difference: float
    se: float
    p: float | None
    test: str
    statistic: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


def paired_binary(a: Sequence[float], b: Sequence[float]) -> PairedStatistic:
    """0/1 outcomes of A and B on the same questions: mean difference B - A, its paired SE sd(b - a) / sqrt(n),
    and the exact McNemar test on the discordant questions (statsmodels: the two-sided binomial test of
    min(a_only, b_only) out of a_only + b_only at 1/2)."""
    from statsmodels.stats.contingency_tables import mcnemar

    a = np.asarray(a, dtype=bool)
    b = np.asarray(b, dtype=bool)
    n = a.size
    d = b.astype(np.float64) - a.astype(np.float64)
    reference_only = int(np.sum(a & ~b))
    run_only = int(np.sum(b & ~a))
    table = [[int(np.sum(a & b)), reference_only], [run_only, int(np.sum(~a & ~b))]]
    result = mcnemar(table, exact=True)
    return PairedStatistic(float(d.mean()) if n else math.nan, standard_error(d), float(result.pvalue),
                           "mcnemar-exact", float(result.statistic),
                           {"reference_only": reference_only, "run_only": run_only, "both": table[0][0],
                            "neither": table[1][1]})


def cluster_robust_se(d: Sequence[float], sizes: Sequence[float]) -> float:
    """SE of sum(d) / sum(sizes) with clusters i: sqrt(G / (G - 1) * sum((d_i - r m_i)^2)) / sum(m).

    Equal to statsmodels' OLS of the per-item differences on a constant with ``cov_type="cluster"`` (its default
    small-sample factor G / (G - 1) * (N - 1) / (N - K), with K = 1).
    """
    d = np.asarray(d, dtype=np.float64)
    m = np.asarray(sizes, dtype=np.float64)
    g = d.size
    total = m.sum()
    if g < 2 or total <= 0:
        return math.nan
    u = d - (d.sum() / total) * m
    return float(math.sqrt(g / (g - 1) * float(np.sum(u * u))) / total)


@dataclass(frozen=True)
class SignFlip:
    """A sign-flip permutation test: ``method`` is ``exact`` (all ``resamples`` = 2^k sign patterns) or
    ``monte-carlo`` (``resamples`` seeded draws)."""

    p: float
    method: str
    resamples: int


def sign_flip_test(d: Sequence[float], *, permutations: int = 100_000, seed: int = 0) -> SignFlip:
    """Two-sided sign-flip permutation test of sum(d) = 0 (scipy ``permutation_test``, ``permutation_type=
    "samples"``): over all 2^k sign patterns of the k non-zero entries (a zero flips to itself) when
    2^k <= ``permutations``, else ``permutations`` draws seeded by ``seed`` (p = (hits + 1) / (draws + 1))."""
    from scipy.stats import permutation_test

    d = np.asarray(d, dtype=np.float64)
    nonzero = d[d != 0]
    k = nonzero.size
    if k == 0:
        return SignFlip(1.0, "exact", 1)
    if k == 1:  # two sign patterns, one as extreme as the observed sum each way (scipy needs two observations)
        return SignFlip(1.0, "exact", 2)
    exact = k < 63 and 2**k <= permutations
    result = permutation_test((nonzero,), lambda x, axis: np.sum(x, axis=axis), vectorized=True,
                              permutation_type="samples", n_resamples=permutations, alternative="two-sided",
                              rng=np.random.default_rng(seed), batch=1000)  # bounded memory on long tasks
    return SignFlip(float(result.pvalue), "exact" if exact else "monte-carlo", 2**k if exact else permutations)


def paired_clustered(a_sums: Sequence[float], b_sums: Sequence[float], sizes: Sequence[float], *,
                     permutations: int = 100_000, seed: int = 0) -> PairedStatistic:
    """Per-prompt sums of followed instructions of A and B and instructions per prompt (IFEval instruction level):
    difference sum(b - a) / sum(sizes), cluster-robust SE, sign-flip permutation test on the per-prompt sums."""
    a = np.asarray(a_sums, dtype=np.float64)
    b = np.asarray(b_sums, dtype=np.float64)
    m = np.asarray(sizes, dtype=np.float64)
    d = b - a
    flip = sign_flip_test(d, permutations=permutations, seed=seed)
    details: dict[str, Any] = {"units": "prompts", "items": int(m.sum()), "resamples": flip.resamples}
    if flip.method == "monte-carlo":
        details["seed"] = seed
    return PairedStatistic(float(d.sum() / m.sum()), cluster_robust_se(d, m), flip.p, f"sign-flip-{flip.method}",
                           float(d.sum()),
                           {"run_better": int(np.sum(d > 0)), "reference_better": int(np.sum(d < 0))},
                           details)


def _t_test_details(test: TTest, details: dict[str, Any]) -> dict[str, Any]:
    return {**details, "df": test.df, **({"no_test": test.reason} if test.reason else {})}


def paired_perplexity_ratio(nll_a: Sequence[float], nll_b: Sequence[float], counts: Sequence[float]
                            ) -> PairedStatistic:
    """Per-document negative log-likelihoods of A and B and the words (bytes) of each document: the log of the
    perplexity ratio B / A, i.e. the difference in NLL per word sum(b - a) / sum(counts) (positive: B worse), its
    cluster-robust SE with documents as clusters, and the :func:`paired_t_test` of the per-document NLL."""
    a = np.asarray(nll_a, dtype=np.float64)
    b = np.asarray(nll_b, dtype=np.float64)
    m = np.asarray(counts, dtype=np.float64)
    d = b - a
    test = paired_t_test(d)
    return PairedStatistic(float(d.sum() / m.sum()), cluster_robust_se(d, m), test.p, "paired-t", test.statistic,
                           {"run_better": int(np.sum(d < 0)), "reference_better": int(np.sum(d > 0))},
                           _t_test_details(test, {"units": "documents", "items": int(m.sum())}))


def paired_continuous(a: Sequence[float], b: Sequence[float]) -> PairedStatistic:
    """Numbers of A and B on the same questions: mean difference, SE sd / sqrt(n), :func:`paired_t_test`."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    d = b - a
    test = paired_t_test(d)
    return PairedStatistic(float(d.mean()), standard_error(d), test.p, "paired-t", test.statistic,
                           {"run_better": int(np.sum(d > 0)), "reference_better": int(np.sum(d < 0))},
                           _t_test_details(test, {}))


@dataclass(frozen=True)
class Holm:
    """Holm-adjusted p-values and which hypotheses are rejected at the family's alpha (no p-value: NaN, never)."""

    adjusted: np.ndarray  # [tests]
    reject: np.ndarray  # [tests] bool


def holm(pvalues: Sequence[float | None], alpha: float = 0.05) -> Holm:
    """Holm's step-down correction (statsmodels ``multipletests``) over ``pvalues``; None or NaN ones (no test)
    stay out of the family."""
    from statsmodels.stats.multitest import multipletests

    p = np.array([math.nan if v is None else v for v in pvalues], dtype=np.float64)
    adjusted = np.full(p.shape, np.nan)
    reject = np.zeros(p.shape, dtype=bool)
    finite = np.isfinite(p)
    if finite.any():
        reject[finite], adjusted[finite], _, _ = multipletests(p[finite], alpha=alpha, method="holm")
    return Holm(adjusted, reject)


def mean_over_tasks(differences: Sequence[float], ses: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of per-task differences with a normal interval that treats tasks as independent:
    se = sqrt(sum se_t^2) / k, mean +- z_(1+level)/2 * se (:func:`normal_interval`)."""
    d = np.asarray(differences, dtype=np.float64)
    s = np.asarray(ses, dtype=np.float64)
    k = d.size
    if k == 0:
        return Interval(math.nan, math.nan, math.nan, math.nan, level)
    return normal_interval(float(d.mean()), float(math.sqrt(float(np.sum(s * s))) / k), level)
