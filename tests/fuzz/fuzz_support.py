"""Strategies and checks shared by the fuzz tests: sizes at the edges kernels get wrong (1, primes, powers of two
plus or minus one), layouts (sliced, permuted, expanded), values with NaN / Inf / ties, and guard bands that turn an
out-of-bounds read into a NaN in the output.

Adding an op: a strategy that draws its arguments (`@st.composite`), a test `@given` it, and the op's name in a
`@fuzzes("dsfuse::name")` decorator (test_coverage.py checks that every registered op has one)."""

from __future__ import annotations

import json
import os

import torch
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EDGE_SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 13, 15, 16, 17, 31, 32, 33)
SPECIALS = ("nan", "inf", "-inf", "zero", "tie")


def fuzzes(*ops: str):
    """Marks a test as the fuzz test of these custom ops (read by test_coverage.py)."""
    def mark(test):
        test.fuzzed_ops = ops
        return test
    return mark


def sizes(low: int = 1, high: int = 33):
    return st.sampled_from([s for s in EDGE_SIZES if low <= s <= high] + ([0] if low == 0 else []))


def seeds():
    return st.integers(0, 2**31 - 1)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def values(shape, dtype, seed, scale=1.0, specials=(), grid=None):
    """randn * scale in `dtype` (on multiples of 1/grid when given: few mantissa bits, so products and short sums
    are exact in fp32 and every rounding order agrees), then a few elements set to each named special: NaN,
    +-Inf, 0, or a tie (a copy of another element)."""
    g = generator(seed)
    x = torch.randn(shape, generator=g) * scale
    if grid is not None:
        x = (x * grid).round() / grid
    x = x.to(dtype)
    flat = x.view(-1)
    if flat.numel() == 0:
        return x
    for special in specials:
        at = torch.randint(0, flat.numel(), (max(1, flat.numel() // 17),), generator=g)
        if special == "tie":
            flat[at] = flat[at[:1]].expand(at.numel())
        else:
            flat[at] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "zero": 0.0}[special]
    return x


@st.composite
def layouts(draw, dims: int, keep_last: bool = True):
    """One of: contiguous, a slice of a wider buffer, or a permutation of the leading dims in memory."""
    kind = draw(st.sampled_from(["contiguous", "sliced", "permuted"]))
    perm = None
    if kind == "permuted":
        movable = dims - 1 if keep_last else dims
        perm = draw(st.permutations(range(movable))) + ([dims - 1] if keep_last else [])
    return kind, perm, draw(st.integers(1, 5))


def restride(x: torch.Tensor, layout) -> torch.Tensor:
    """x's values in the drawn layout (same shape, other strides)."""
    kind, perm, pad = layout
    if kind == "sliced" and x.dim():
        wide = torch.full((*x.shape[:-1], x.shape[-1] + 2 * pad), float("nan") if x.is_floating_point() else 0,
                          dtype=x.dtype, device=x.device)
        wide[..., pad:pad + x.shape[-1]] = x
        return wide[..., pad:pad + x.shape[-1]]
    if kind == "permuted" and perm is not None and list(perm) != sorted(perm):
        inverse = [perm.index(i) for i in range(len(perm))]
        return x.permute(*perm).contiguous().permute(*inverse)
    return x


def guarded(x: torch.Tensor, band: int = 64) -> torch.Tensor:
    """x inside a NaN-filled buffer (a band before and after its storage): a kernel that reads past x's bounds
    puts a NaN into its output."""
    if not x.is_floating_point() or x.numel() == 0:
        return x
    store = torch.full((band + x.numel() + band,), float("nan"), dtype=x.dtype, device=x.device)
    inner = store[band:band + x.numel()].view(x.shape)
    inner.copy_(x)
    return inner


def assert_same(got: torch.Tensor, want: torch.Tensor, exact: bool = True, rtol: float | None = None,
                atol: float | None = None, what: str = ""):
    """Equal shapes and dtypes, NaN where the other has NaN, and values equal (or within rtol/atol)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    got, want = got.cpu(), want.cpu()
    if exact:
        assert torch.equal(got.isnan(), want.isnan()), (what, "NaN positions differ")
        assert torch.equal(got.masked_fill(got.isnan(), 0), want.masked_fill(want.isnan(), 0)), \
            (what, (got.float() - want.float()).abs().nan_to_num(0.0).max())
    else:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = ""):
    """NaN exactly where the reference has NaN, the same +-Inf where it has one, elsewhere
    max |got - want| <= tol * max |want| (over the finite values: an Inf scale would pass anything)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    got, want = got.cpu().float(), want.cpu().float()
    assert torch.equal(got.isnan(), want.isnan()), (what, "NaN positions differ")
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()]), \
        (what, "Inf positions or signs differ")
    both = ~got.isfinite()
    diff = (got - want).masked_fill(both, 0).abs().max() if got.numel() else torch.tensor(0.0)
    scale = want.masked_fill(both, 0).abs().max().clamp_min(1e-6) if got.numel() else torch.tensor(1.0)
    assert diff <= tol * scale, (what, diff.item(), scale.item())


def reference_output(op, reference, *args):
    """The reference's output; on CPU also checks that the op (its CPU implementation: input checks, then the
    reference) gives it bit for bit. On CUDA the op is the kernel, which each test compares with its tolerance."""
    want = reference(*args)
    if DEVICE == "cpu":
        got = op(*args)
        for one, other in zip(got if isinstance(got, (tuple, list)) else [got],
                              want if isinstance(want, (tuple, list)) else [want]):
            if one.dtype == torch.float8_e4m3fn:
                one, other = one.view(torch.uint8), other.view(torch.uint8)
            assert_same(one, other, what="op")
    return want


def write_spelling_stats(outcomes: dict) -> None:
    """A spelling fuzzer's outcomes per axis value ({(axis, value): ["fused" or a reason, ...]}) to the JSON file
    DSFUSE_SPELLING_STATS names, when it is set."""
    path = os.environ.get("DSFUSE_SPELLING_STATS")
    if path:
        table = {f"{axis}={value}": {"draws": len(runs), **{r: runs.count(r) for r in set(runs)}}
                 for (axis, value), runs in outcomes.items()}
        with open(path, "w") as out:
            json.dump(table, out, indent=1, sort_keys=True)
