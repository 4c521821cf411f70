"""The statistics under every verdict rule, against values computed by hand or by textbook tables."""

from __future__ import annotations

import pytest

from k3load.analysis.run.stats import (
    bootstrap_median_ci,
    decide_rate,
    mcnemar_one_sided,
    more_attempts_to_decide,
    sign_test_less,
    wilson,
)


def test_wilson_interval_matches_the_textbook_values():
    rate = wilson(19, 20)  # 95%: 0.7639 - 0.9911 (Newcombe 1998, method 3)
    assert rate.low == pytest.approx(0.7639, abs=1e-4) and rate.high == pytest.approx(0.9911, abs=1e-4)
    assert wilson(0, 10).low == 0.0 and wilson(10, 10).high == 1.0
    assert wilson(0, 0).value is None


def test_a_rate_passes_on_its_lower_bound_and_fails_on_its_upper_bound():
    assert decide_rate(wilson(19, 20), 0.95) == "inconclusive"  # 95% of 20 is not proof of 95%
    assert decide_rate(wilson(200, 200), 0.95) == "pass"
    assert decide_rate(wilson(10, 20), 0.95) == "fail"


def test_how_many_more_attempts_would_decide():
    more = more_attempts_to_decide(wilson(20, 20), 0.95)
    assert more is not None and 50 <= more <= 60  # 73 of 73 clears 95%: Wilson's lower bound is 0.95 there
    assert decide_rate(wilson(20 + more, 20 + more), 0.95) == "pass"
    assert decide_rate(wilson(19 + more, 19 + more), 0.95) == "inconclusive"
    assert more_attempts_to_decide(wilson(200, 200), 0.95) == 0
    assert more_attempts_to_decide(wilson(19, 20), 0.95) is None  # sits on the threshold: nothing decides


def test_exact_mcnemar_and_sign_tests():
    assert mcnemar_one_sided(6, 0) == pytest.approx(1 / 64)
    assert mcnemar_one_sided(3, 3) == pytest.approx(0.65625)
    assert mcnemar_one_sided(0, 0) == 1.0
    assert sign_test_less([0.1] * 5, 0.9) == pytest.approx(1 / 32)
    assert sign_test_less([0.1, 0.95, 1.2, 0.3], 0.9) == pytest.approx(11 / 16)


def test_bootstrap_is_reproducible_and_brackets_the_median():
    values = [0.1, 0.12, 0.09, 0.5, 0.11, 0.13]
    first, second = bootstrap_median_ci(values), bootstrap_median_ci(values)
    assert first == second and first is not None
    assert first[0] <= 0.115 <= first[1]
    assert bootstrap_median_ci([1.0]) is None
