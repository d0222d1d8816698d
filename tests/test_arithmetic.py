"""pipeloom.arithmetic: the divisors the planners, the cluster search and the server's limits share."""

from __future__ import annotations

import pytest

from pipeloom.arithmetic import divisors


@pytest.mark.parametrize("cap", [None, 1, 5, 12, 1000])
def test_divisors_are_those_counting_finds_in_order(cap):
    for n in range(1, 400):
        expected = [d for d in range(1, n + 1) if n % d == 0 and (cap is None or d <= cap)]
        assert divisors(n, cap) == expected, (n, cap)


def test_a_huge_count_with_a_small_cap_is_answered_without_counting_to_its_root():
    assert divisors(10**18, 1024) == [d for d in range(1, 1025) if 10**18 % d == 0]
    assert divisors(2**61 - 1, 16) == [1]  # a prime: trial division to its root would take minutes
