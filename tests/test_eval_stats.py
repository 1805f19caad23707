"""The one confidence-interval helper (psr_hf.eval.stats): against hand computations and against scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from psr_hf.eval.stats import (
    Interval,
    mean_interval,
    normal_interval,
    paired_continuous,
    paired_log_ratio,
    paired_perplexity_ratio,
    paired_t_test,
    standard_error,
)

# Student t quantile q = 0.975 with 2 degrees of freedom, closed form: (2q - 1) / sqrt(2q(1 - q))
T975_DF2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
Z975 = 1.959963984540054


def test_mean_interval_equals_a_hand_computation():
    # [1, 2, 4]: mean 7/3, sd sqrt(7/3), se sqrt(7)/3
    got = mean_interval([1.0, 2.0, 4.0])
    se = math.sqrt(7.0) / 3.0
    assert got.mean == pytest.approx(7 / 3, rel=1e-15) and got.se == pytest.approx(se, rel=1e-14)
    assert (got.low, got.high) == (pytest.approx(7 / 3 - T975_DF2 * se, rel=1e-12),
                                   pytest.approx(7 / 3 + T975_DF2 * se, rel=1e-12))
    assert got.level == 0.95


@pytest.mark.parametrize("level", [0.8, 0.95, 0.99])
def test_mean_interval_equals_scipys_one_sample_t_interval(level):
    values = np.random.default_rng(3).normal(10.0, 2.0, size=17)
    got = mean_interval(values, level)
    expected = stats.ttest_1samp(values, 0.0).confidence_interval(level)
    assert (got.low, got.high) == (pytest.approx(expected.low, rel=1e-12), pytest.approx(expected.high, rel=1e-12))
    assert got.se == pytest.approx(stats.sem(values), rel=1e-12)


def test_mean_interval_with_fewer_than_two_values_has_nan_bounds():
    one = mean_interval([3.5])
    assert one.mean == 3.5 and math.isnan(one.se) and math.isnan(one.low) and math.isnan(one.high)
    none = mean_interval([])
    assert math.isnan(none.mean) and math.isnan(none.low)
    assert math.isnan(standard_error([1.0]))


def test_equal_values_give_a_zero_width_interval():
    assert mean_interval([2.0, 2.0, 2.0]) == Interval(2.0, 0.0, 2.0, 2.0, 0.95)


def test_a_level_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="level=95 must be in \\(0, 1\\)"):
        mean_interval([1.0, 2.0], level=95)


def test_normal_interval_is_mean_plus_minus_z_se():
    got = normal_interval(1.5, 0.25)
    assert (got.low, got.high) == (pytest.approx(1.5 - Z975 * 0.25), pytest.approx(1.5 + Z975 * 0.25))
    assert normal_interval(1.5, 0.0) == Interval(1.5, 0.0, 1.5, 1.5, 0.95)
    assert math.isnan(normal_interval(1.5, math.nan).high)


def test_paired_log_ratio_equals_a_hand_computation():
    values, baseline = [3.0, 4.0, 5.0], [2.0, 2.0, 2.0]
    logs = [math.log(1.5), math.log(2.0), math.log(2.5)]
    mean = sum(logs) / 3
    se = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
    t = mean / se
    p = 1 - abs(t) / math.sqrt(2 + t * t)  # two-sided p of Student t with 2 degrees of freedom, closed form
    got = paired_log_ratio(values, baseline)
    assert got.ratio == pytest.approx(math.exp(mean), rel=1e-12)
    assert (got.low, got.high) == (pytest.approx(math.exp(mean - T975_DF2 * se), rel=1e-9),
                                   pytest.approx(math.exp(mean + T975_DF2 * se), rel=1e-9))
    assert got.p == pytest.approx(p, rel=1e-9)
    assert got.ratios == pytest.approx((1.5, 2.0, 2.5))


def test_paired_log_ratio_without_spread_or_with_one_pair_has_no_p_value():
    same = paired_log_ratio([2.0, 4.0], [1.0, 2.0])
    assert same.ratio == pytest.approx(2.0) and same.low == pytest.approx(2.0) and same.p is None
    one = paired_log_ratio([2.0], [1.0])
    assert one.ratio == pytest.approx(2.0) and math.isnan(one.low) and one.p is None


@pytest.mark.parametrize("values, baseline", [([1.0, 2.0], [1.0]), ([], []), ([1.0, 0.0], [1.0, 1.0])])
def test_paired_log_ratio_refuses_unpaired_or_non_positive_values(values, baseline):
    with pytest.raises(ValueError):
        paired_log_ratio(values, baseline)


@pytest.mark.parametrize("differences", [[0.25, 0.25, 0.25], [-1.5, -1.5], [0.0, 0.0, 0.0], [0.5], [0.2, -0.1, 0.4]])
def test_the_comparison_and_the_benchmarks_get_one_t_test_for_the_same_differences(differences):
    # the benchmarks' log ratios, the comparison's continuous scores and per-document NLL: the same differences
    n = len(differences)
    expected = paired_t_test(differences)
    timed = paired_log_ratio(np.exp(differences), np.ones(n))
    scores = paired_continuous(np.zeros(n), differences)
    nll = paired_perplexity_ratio(np.zeros(n), differences, np.ones(n))
    if n < 2 or len(set(differences)) == 1:  # zero variance: t is undefined, so no p-value, with the reason
        assert expected.p is None and expected.statistic is None and expected.reason
        assert timed.p is None and scores.p is None and nll.p is None
        assert scores.details["no_test"] == nll.details["no_test"] == expected.reason
    else:
        assert expected.p == pytest.approx(stats.ttest_1samp(differences, 0.0).pvalue, rel=1e-12)
        assert timed.p == pytest.approx(expected.p, rel=1e-9)
        assert scores.p == nll.p == expected.p and scores.statistic == expected.statistic
        assert "no_test" not in scores.details


def test_sign_flip_with_one_nonzero_difference_is_exact_and_not_significant():
    from psr_hf.eval.stats import sign_flip_test

    result = sign_flip_test([0.0, 0.0, 3.0, 0.0])
    assert (result.p, result.method, result.resamples) == (1.0, "exact", 2)
