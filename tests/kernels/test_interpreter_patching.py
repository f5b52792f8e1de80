"""The tests' interpreter speed-up (`tests/interpreter_patching.py`): installed wherever kernels run on the
interpreter, kernels calling `@triton.jit` helpers still compute the same, and each launch leaves `triton.language`
as it found it."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs on Triton's interpreter")


@triton.jit
def _row_sum(x):
    return tl.sum(x, axis=1)


@triton.jit
def _scaled_row_sums_kernel(x_ptr, out_ptr, scale, N: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * N + tl.arange(0, N))[None, :]
    total = _row_sum(x) + tl.max(x, axis=1) * 0
    tl.store(out_ptr + row + tl.arange(0, 1), total * scale)


def test_it_is_installed_where_kernels_run_on_the_interpreter():
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "once_per_launch", False), (
        "this triton's interpreter no longer has the shape tests/interpreter_patching.py relies on")


def test_helpers_compute_the_same_and_the_language_is_restored_after_each_launch():
    original_sum, original_add = tl.sum, tl.core.tensor.__add__
    x = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    out = torch.empty(3)
    for scale in (1.0, -2.0):
        _scaled_row_sums_kernel[(3,)](x, out, scale, N=8)
        torch.testing.assert_close(out, x.sum(1) * scale, rtol=0, atol=0)
        assert tl.sum is original_sum and tl.core.tensor.__add__ is original_add
