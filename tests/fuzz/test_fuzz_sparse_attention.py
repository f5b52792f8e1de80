"""Fuzz the sparse attention ops: the Triton paths (interpreter on CPU) against the references, rows without keys,
NaN inputs, repeated indices, and indices out of range: a clear IndexError on the reference path, while the
kernels treat them as "no key" and read nothing outside their inputs (kv, pe, k, v, latent and rope sit inside
NaN guard bands, so a stray read shows up as NaN in the output)."""

import pytest
import torch
from fuzz_support import DEVICE, SPECIALS, assert_rel_close, fuzzes, guarded, reference_output, seeds, sizes, values
from hypothesis import given
from hypothesis import strategies as st

from dsfuse.kernels import sparse_attention as sa

# The interpreter's bf16 dot is wrong: fp16 stands for the half-precision path there.
DTYPES = (torch.float32, torch.float16)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
BAD_INDICES = (-100, -2)  # with T, T + 7 added per case


def _bad_values(T):
    return list(BAD_INDICES) + [T, T + 7]


def _indices(g, B, S, K, T, low):
    return torch.randint(low, T, (B, S, K), generator=g)


@fuzzes("dsfuse::sparse_mla_attention")
@given(data=st.data(), with_sink=st.booleans(), out_of_range=st.booleans())
def test_sparse_mla_kernel_is_the_reference(data, with_sink, out_of_range):
    B, S, H, T, K = (data.draw(sizes(1, n)) for n in (2, 5, 5, 33, 17))
    Dc, Dr = data.draw(st.sampled_from([8, 16, 24])), data.draw(st.sampled_from([4, 8]))
    dtype, seed = data.draw(st.sampled_from(DTYPES)), data.draw(seeds())
    g = torch.Generator().manual_seed(seed)
    specials = data.draw(st.lists(st.sampled_from(SPECIALS), max_size=1))
    kv_specials = data.draw(st.lists(st.sampled_from(SPECIALS), max_size=1))
    q_nope = values((B, S, H, Dc), dtype, seed, specials=specials)
    q_pe, kv, pe = values((B, S, H, Dr), dtype, seed + 1), values((B, T, Dc), dtype, seed + 2, specials=kv_specials), \
        values((B, T, Dr), dtype, seed + 3)
    idx = _indices(g, B, S, K, T, -1)  # -1 = no key; repeats count twice
    idx[:, data.draw(st.integers(0, S - 1))] = -1  # a row without keys: NaN without a sink, 0 with one
    sink = torch.randn(H, generator=g).to(DEVICE) if with_sink else None
    args = [t.to(DEVICE) for t in (q_nope, q_pe, kv, pe)]
    want = reference_output(sa.sparse_mla_attention, sa.sparse_mla_attention_reference, *args, idx.to(DEVICE), 0.3,
                            sink)
    if out_of_range:
        bad = idx.clone()
        bad.view(-1)[torch.randint(0, bad.numel(), (max(1, bad.numel() // 5),), generator=g)] = \
            torch.tensor(_bad_values(T))[torch.randint(0, 4, (max(1, bad.numel() // 5),), generator=g)]
        with pytest.raises(IndexError, match="outside"):
            sa.sparse_mla_attention_reference(*args, bad.to(DEVICE), 0.3, sink)
        want = sa.sparse_mla_attention_reference(*args, torch.where((bad >= 0) & (bad < T), bad, -1).to(DEVICE),
                                                 0.3, sink)
        idx = bad
    q_nope, q_pe, kv, pe = (guarded(t) for t in args)
    got = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx.to(DEVICE), 0.3, sink)
    assert_rel_close(got, want, TOL[dtype], "triton")


@fuzzes("dsfuse::sparse_attention_masked")
@given(data=st.data(), mask_kind=st.sampled_from(["none", "bool", "additive", "causal"]),
       out_of_range=st.booleans(), with_sink=st.booleans())
def test_sparse_attention_masked_kernel_is_the_reference(data, mask_kind, out_of_range, with_sink):
    B, H, S, K = (data.draw(sizes(1, n)) for n in (2, 3, 9, 9))
    T = data.draw(sizes(S if mask_kind == "causal" else 1, 33))
    D, Dv = data.draw(st.sampled_from([8, 16, 24])), data.draw(st.sampled_from([4, 8, 12]))
    dtype, seed = data.draw(st.sampled_from(DTYPES)), data.draw(seeds())
    g = torch.Generator().manual_seed(seed)
    # No +-Inf in q: SDPA then reads it against the keys the row does not select, and the kernel does not
    # (test_nonfinite_outside_the_selection_is_not_read pins it).  The additive mask may hold -inf instead.
    specials = data.draw(st.lists(st.sampled_from(["nan", "zero", "tie"]), max_size=1))
    q = values((B, H, S, D), dtype, seed, specials=specials).to(DEVICE)
    k, v = values((B, H, T, D), dtype, seed + 1).to(DEVICE), values((B, H, T, Dv), dtype, seed + 2).to(DEVICE)
    idx = _indices(g, B, S, K, T, 0)
    mask, causal = None, mask_kind == "causal"
    if mask_kind in ("bool", "additive"):
        keep = torch.rand(B, 1, S, T, generator=g) < 0.7
        keep[:, :, data.draw(st.integers(0, S - 1))] = False  # a fully masked row
        mask = keep if mask_kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(dtype).min)
        if mask_kind == "additive" and data.draw(st.booleans()):
            mask = mask.masked_fill(torch.rand(keep.shape, generator=g) < 0.3, float("-inf"))
        mask = mask.to(DEVICE, dtype=torch.bool if mask_kind == "bool" else dtype)
        if data.draw(st.booleans()):
            mask = mask.expand(B, H, S, T)  # an expanded (stride 0) head dim
    sink = (torch.randn(H, generator=g) * 3).to(DEVICE) if with_sink else None
    hard = mask_kind == "additive" and data.draw(st.booleans())  # the selection as a -inf bias beside the mask
    options = (causal, False, sink, hard)
    want = reference_output(sa.sparse_attention_masked, sa.sparse_attention_masked_reference, q, k, v,
                            idx.to(DEVICE), mask, 0.25, *options)
    if out_of_range:
        extra = torch.tensor(_bad_values(T))[torch.randint(0, 4, (B, S, 2), generator=g)]
        bad = torch.cat([idx, extra], -1)
        with pytest.raises(IndexError, match="outside"):
            sa.sparse_attention_masked_reference(q, k, v, bad.to(DEVICE), mask, 0.25, *options)
        idx = bad  # the kernel selects the in-range keys only: the reference over idx is the answer
    got = sa.sparse_attention_masked_triton(q, guarded(k), guarded(v), idx.to(DEVICE), mask, 0.25, *options)
    assert_rel_close(got, want, TOL[dtype], "triton")


@fuzzes("dsfuse::absorbed_mla_attention")
@given(data=st.data(), masked=st.booleans(), causal=st.booleans(), empty_rows_see_all=st.booleans(),
       out_of_range=st.booleans())
def test_absorbed_mla_kernel_is_the_reference(data, masked, causal, empty_rows_see_all, out_of_range):
    B, H, S = (data.draw(sizes(1, n)) for n in (2, 4, 5))
    T = data.draw(sizes(S, 33))
    K = data.draw(sizes(1, T))
    nope, rope_dim, vdim, latent_dim = 16, 8, data.draw(st.sampled_from([8, 12])), data.draw(st.sampled_from([16, 32]))
    dtype, seed = data.draw(st.sampled_from(DTYPES)), data.draw(seeds())
    g = torch.Generator().manual_seed(seed)
    q_specials, latent_specials = (data.draw(st.lists(st.sampled_from(SPECIALS), max_size=1)) for _ in range(2))
    q = values((B, H, S, nope + rope_dim), dtype, seed, specials=q_specials).to(DEVICE)
    latent = values((B, 1, T, latent_dim), dtype, seed + 1, specials=latent_specials).to(DEVICE)
    rope = values((B, 1, T, rope_dim), dtype, seed + 2).to(DEVICE)
    weight = (values((H * (nope + vdim), latent_dim), torch.float32, seed + 3) / latent_dim**0.5).to(DEVICE, dtype)
    distinct = data.draw(st.booleans())
    if distinct:
        idx = torch.stack([torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(S)]) for _ in range(B)])
    else:
        idx = _indices(g, B, S, K, T, 0)
    mask = None
    if masked:
        keep = torch.rand(B, 1, S, T, generator=g) < 0.7
        keep[:, :, data.draw(st.integers(0, S - 1))] = False  # a row without allowed keys
        mask = keep.to(DEVICE)
    args = (q, latent, rope, weight)
    flags = (0.2, nope, causal, empty_rows_see_all, distinct)
    want = reference_output(sa.absorbed_mla_attention, sa.absorbed_mla_attention_reference, *args, idx.to(DEVICE),
                            mask, *flags)
    if out_of_range:
        bad = idx.clone()
        bad[..., -1] = torch.tensor(_bad_values(T))[torch.randint(0, 4, (B, S), generator=g)]
        with pytest.raises(IndexError, match="outside"):
            sa.absorbed_mla_attention_reference(*args, bad.to(DEVICE), mask, *flags)
        return
    got = sa.absorbed_mla_attention_triton(q, guarded(latent), guarded(rope), weight, idx.to(DEVICE), mask, *flags)
    assert_rel_close(got, want, TOL[dtype], "triton")


def test_fp32_additive_fully_masked_row_is_the_mean_of_v():
    """Regression for a fuzz finding on the H200 (run 40): one key, at finfo(fp32).min. The math is a softmax over
    equal scores (the mean of V); CUDA's memory-efficient SDPA overflows the row to -inf and returned 0, so the
    reference now runs the math backend off the CPU."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(DEVICE) for shape in ((1, 1, 1, 8), (1, 1, 1, 8), (1, 1, 1, 4)))
    idx = torch.zeros(1, 1, 1, dtype=torch.int64, device=DEVICE)
    mask = torch.full((1, 1, 1, 1), torch.finfo(torch.float32).min, device=DEVICE)
    want = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.25)
    assert torch.equal(want, v)
    assert_rel_close(sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.25), want, TOL[torch.float32], "row")


def test_fp16_additive_fully_masked_row():
    """Regression for a fuzz finding: fp16, an additive mask at finfo(fp16).min on every key of a query row. SDPA
    adds the bias in fp32, where -65504 does not absorb the scores, so the row is the softmax over all T scores
    (unselected keys get the same fill); the kernel once skipped unselected tiles and weighed the visited keys'
    fill alone."""
    g = torch.Generator().manual_seed(0)
    B, H, S, T, K = 1, 2, 4, 31, 5
    q, k, v = (torch.randn(shape, generator=g).to(torch.float16).to(DEVICE)
               for shape in ((B, H, S, 16), (B, H, T, 16), (B, H, T, 8)))
    idx = torch.randint(0, T, (B, S, K), generator=g).to(DEVICE)
    mask = torch.zeros(B, 1, S, T, dtype=torch.float16, device=DEVICE)
    mask[:, :, 1] = torch.finfo(torch.float16).min
    want = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.25)
    assert_rel_close(sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.25), want, TOL[torch.float16], "row")


def test_nan_query_in_a_row_without_keys():
    """Regression for a fuzz finding: a NaN query in a row without selected, allowed keys. SDPA still multiplies it
    with the masked keys (NaN + -inf is NaN), so the row is NaN, not the 0 of an all-False row."""
    g = torch.Generator().manual_seed(0)
    B, H, S, T, K = 1, 1, 2, 9, 2
    q, k, v = (torch.randn(shape, generator=g).to(DEVICE) for shape in ((B, H, S, 16), (B, H, T, 16), (B, H, T, 8)))
    q[0, 0, 1, 0] = float("nan")
    idx = torch.randint(0, T, (B, S, K), generator=g).to(DEVICE)
    keep = torch.ones(B, 1, S, T, dtype=torch.bool, device=DEVICE)
    keep[:, :, 1] = False
    want = sa.sparse_attention_masked_reference(q, k, v, idx, keep, 0.25)
    assert_rel_close(sa.sparse_attention_masked_triton(q, k, v, idx, keep, 0.25), want, TOL[torch.float32], "row")


def test_mla_no_key_entry_does_not_read_key_zero():
    """Regression for a fuzz finding (kv drawn with NaN): the reference gathered key 0 for each -1 entry and
    multiplied it by its zero probability, so a NaN in key 0 made every row holding a -1 NaN; the kernel reads
    nothing there.  -1 means no key: the reference now zeroes those rows of its gather."""
    g = torch.Generator().manual_seed(0)
    q_nope, q_pe, kv, pe = (torch.randn(shape, generator=g).to(DEVICE)
                            for shape in ((1, 2, 2, 16), (1, 2, 2, 8), (1, 5, 16), (1, 5, 8)))
    kv[0, 0, 3] = float("nan")
    idx = torch.tensor([[[1, -1, 2], [-1, -1, -1]]], device=DEVICE)
    sink = torch.zeros(2, device=DEVICE)
    want = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.3, sink)
    assert want.isfinite().all() and torch.equal(want[0, 1], torch.zeros_like(want[0, 1]))
    assert_rel_close(sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, 0.3, sink), want,
                     TOL[torch.float32], "triton")


def test_nonfinite_outside_the_selection_is_not_read():
    """Documented difference (notes/sparse_attention.md, "Non-finite inputs"): SDPA multiplies every query with
    every key and every probability with every value, masked or not, so a non-finite value there reaches rows that
    did not select it (+Inf + -inf, NaN + -inf and 0 * Inf are NaN); the kernel scores the selected keys only.
    Query row 0 holds +Inf and selects a key it scores -Inf (SDPA: NaN through the unselected keys scoring +Inf;
    kernel: 0, no key got weight).  Key 3, selected by no row, holds a NaN in k (SDPA: every row NaN) and an Inf
    in v: the kernel multiplies v tiles it visits by zero weights, so that column may be NaN (a subset of SDPA's
    NaNs, depending on tiling).  Everything else is SDPA's answer with the unread values made finite."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(DEVICE) for shape in ((1, 1, 3, 8), (1, 1, 4, 8), (1, 1, 4, 4)))
    k[0, 0, :, 0] = torch.tensor([-1.0, 1.0, 1.0, 1.0])
    finite_q, finite_k, finite_v = q.clone(), k.clone(), v.clone()
    q[0, 0, 0, 0], k[0, 0, 3, 1], v[0, 0, 3, 1] = float("inf"), float("nan"), float("inf")
    idx = torch.tensor([[[0, 0], [1, 2], [2, 0]]], device=DEVICE)
    assert sa.sparse_attention_masked_reference(q, k, v, idx, None, 0.25).isnan().all()
    got = sa.sparse_attention_masked_triton(q, k, v, idx, None, 0.25)
    assert torch.equal(got[0, 0, 0], torch.zeros(4, device=DEVICE))
    assert not got[..., 1:, :].isnan().any(-2)[..., [0, 2, 3]].any()
    want = sa.sparse_attention_masked_reference(finite_q, finite_k, finite_v, idx, None, 0.25)
    got_rows = got[..., 1:, :].masked_fill(got[..., 1:, :].isnan(), 0)
    assert_rel_close(got_rows, want[..., 1:, :].masked_fill(got[..., 1:, :].isnan(), 0), TOL[torch.float32],
                     "rows without Inf")
