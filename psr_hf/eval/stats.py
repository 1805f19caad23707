"""Confidence intervals, from scipy: the one place psr_hf turns repeated measurements into a mean and its interval.

- :func:`mean_interval`: the mean of independent values (benchmark rounds, text windows) with its Student t
  interval;
- :func:`paired_log_ratio`: the ratio of paired values (two configurations timed in the same rounds), as the
  exponentiated mean of the per-pair log ratios with that interval and a one-sample t-test of the logs;
- :func:`normal_interval`: a mean with a known standard error and its normal interval (a mean over tasks);
- :func:`standard_error`: the standard error of a mean (``scipy.stats.sem``).

Used by :mod:`psr_hf.eval` (divergence, compare) and by every benchmark in :mod:`psr_hf.bench`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


def paired_log_ratio(values: Sequence[float], baseline: Sequence[float], level: float = LEVEL) -> RatioInterval:
    """The ratio of ``values`` to ``baseline``, paired by position (e.g. ms/token of two configurations in the same
    rounds): the log ratios' :func:`mean_interval` exponentiated, and the two-sided p-value of
    ``scipy.stats.ttest_1samp`` of the log ratios against 0. Raises ``ValueError`` for unequal lengths, no pairs
    or a value that is not positive."""
    from scipy import stats

    a = np.asarray(values, dtype=np.float64)
    b = np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"values and baseline must be paired 1-d sequences of equal length >= 1, got shapes "
                         f"{a.shape} and {b.shape}")
    if not (np.all(a > 0) and np.all(b > 0)):
        raise ValueError("a log ratio needs positive values and baseline")
    logs = np.log(a / b)
    interval = mean_interval(logs, level)
    p = None
    if logs.size > 1 and np.ptp(logs) > 0:  # equal log ratios: t is 0/0 or infinite, no p-value
        p = float(stats.ttest_1samp(logs, 0.0).pvalue)
    return RatioInterval(math.exp(interval.mean), math.exp(interval.low), math.exp(interval.high), p,
                         tuple(float(r) for r in np.exp(logs)), level)
