"""The host-side helpers that stand in for Triton's constexpr functions in the launch paths give Triton's values."""

import triton

from dsfuse.kernels.triton_support import cdiv, next_power_of_2

VALUES = [*range(0, 1100), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**31 + 1, 2**40 - 1, 2**40, 2**40 + 3]


def test_next_power_of_2_matches_triton():
    assert [next_power_of_2(n) for n in VALUES] == [triton.next_power_of_2(n) for n in VALUES]


def test_cdiv_matches_triton():
    divisors = (1, 2, 3, 7, 16, 64, 128, 1000)
    assert [cdiv(n, d) for n in VALUES for d in divisors] == [triton.cdiv(n, d) for n in VALUES for d in divisors]
