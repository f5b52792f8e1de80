"""Fuzz the hyper-connection ops: the op (on CPU, its input checks then the reference) against the reference bit for
bit, and the Triton kernels (the interpreter on CPU, the kernels on CUDA) against the reference, over token counts
at the edges, both stream counts, Sinkhorn lengths, dtypes, empty and sliced inputs, and NaN / +-Inf in the streams."""

import torch
from fuzz_support import DEVICE, assert_rel_close, fuzzes, reference_output, seeds, sizes, values
from hypothesis import given
from hypothesis import strategies as st

from dsfuse.kernels import hyper_connections as hc_ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
NORM_EPS, HC_EPS = 1e-6, 1e-6


@st.composite
def streams(draw):
    """(streams [T, n, D], fn, base, scale, iters, dtype): T may be 0; a few elements of x may be NaN or +-Inf."""
    T, n, D = draw(sizes(0, 17)), draw(st.sampled_from([2, 4])), draw(st.sampled_from([8, 16, 24]))
    dtype, seed = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), draw(seeds())
    specials = draw(st.sampled_from([(), ("nan",), ("inf",), ("-inf",), ("inf", "-inf"), ("zero", "tie")]))
    x = values((T, n, D), dtype, seed, specials=specials).to(DEVICE)
    if draw(st.booleans()) and T > 1:
        x = values((2 * T, n, D), dtype, seed, specials=specials).to(DEVICE)[::2]  # every other token: strided
    g = torch.Generator().manual_seed(seed + 1)
    rows = hc_ops.mixes_count(n)
    fn = (torch.randn(rows, n * D, generator=g) * 0.05).to(DEVICE)
    base = (torch.randn(rows, generator=g) * 0.5).to(DEVICE)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEVICE)
    return x, fn, base, scale, draw(st.integers(1, 6)), dtype


def _mix_inputs(x, seed):
    """A block output [T, D] and mixing weights like a collapse produces: post [T, n], comb [T, n, n] (fp32)."""
    T, n, D = x.shape
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(T, D, generator=g).to(x.dtype).to(x.device)
    post = (2 * torch.rand(T, n, generator=g)).to(x.device)
    comb = torch.softmax(torch.randn(T, n, n, generator=g), -1).to(x.device)
    return out, post, comb


def _compare(got, want, dtype, what):
    for one, other, name in zip(got, want, ("streams/collapsed", "post", "comb", "collapsed")):
        assert_rel_close(one, other, TOL[dtype] if one.dtype == dtype else 1e-4, f"{what} {name}")


@fuzzes("dsfuse::hc_collapse", "dsfuse::hc_head")
@given(case=streams(), block_k=st.sampled_from([16, 128]), path=st.sampled_from(hc_ops.COLLAPSE_PATHS))
def test_collapse_and_head(case, block_k, path):
    """A launch path drawn per example (one pass; projection then weighted sum, its K split when the tiles allow
    it; split-K projection then mix and sum): the one pass at its default launch, the projections' K tiles of the
    drawn width (16: several tiles and a tail), split-K slices of two tiles. One path an example, not all of them:
    on the GPU each drawn shape compiles every kernel it runs (~1 s each), and three paths a shape ran past the H200
    session's limit (run 39)."""
    x, fn, base, scale, iters, dtype = case
    n = x.shape[1]
    head_fn, head_base, head_scale = fn[:n], base[:n], scale[:1]
    want = reference_output(hc_ops.hc_collapse, hc_ops.hc_collapse_reference, x, fn, base, scale, NORM_EPS, HC_EPS,
                            iters)
    want_head = reference_output(hc_ops.hc_head, hc_ops.hc_head_reference, x, head_fn, head_base, head_scale,
                                 NORM_EPS, HC_EPS)
    launch = {"one_pass": {}, "two_pass": dict(block_k=block_k, splits=2),
              "split_k": dict(block_k=block_k, k_per_split=2 * block_k)}[path]
    got = hc_ops.hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, iters, path=path, **launch)
    _compare(got, want, dtype, f"{path} collapse")
    got = hc_ops.hc_head_triton(x, head_fn, head_base, head_scale, NORM_EPS, HC_EPS, path=path, **launch)
    _compare([got], [want_head], dtype, f"{path} head")


@fuzzes("dsfuse::hc_expand_mix", "dsfuse::hc_exit_collapse", "dsfuse::hc_exit_head")
@given(case=streams(), seed=seeds())
def test_exits(case, seed):
    x, fn, base, scale, iters, dtype = case
    out, post, comb = _mix_inputs(x, seed)
    want = reference_output(hc_ops.hc_expand_mix, hc_ops.hc_expand_mix_reference, out, x, post, comb)
    _compare([hc_ops.hc_expand_mix_triton(out, x, post, comb)], [want], dtype, "expand_mix")
    want = reference_output(hc_ops.hc_exit_collapse, hc_ops.hc_exit_collapse_reference, out, x, post, comb, fn,
                            base, scale, NORM_EPS, HC_EPS, iters)
    got = hc_ops.hc_exit_collapse_triton(out, x, post, comb, fn, base, scale, NORM_EPS, HC_EPS, iters)
    _compare(got, want, dtype, "exit_collapse")
    n = x.shape[1]
    want = reference_output(hc_ops.hc_exit_head, hc_ops.hc_exit_head_reference, out, x, post, comb, fn[:n], base[:n],
                            scale[:1], NORM_EPS, HC_EPS)
    got = hc_ops.hc_exit_head_triton(out, x, post, comb, fn[:n], base[:n], scale[:1], NORM_EPS, HC_EPS)
    _compare([got], [want], dtype, "exit_head")
