"""Fuzz `indexer_topk`: the Triton path (interpreter on CPU) selects keys whose scores are the reference's top-k
scores, distinct and in range, with bool / additive / broadcast masks (a bool mask's keys at -inf or at a finite
`fill`), fully masked rows, tied keys, strided inputs and fp8 key scales; on grid-valued inputs (every score exact, so ties are the same ties in both) it selects exactly
the lowest-index tie rule's keys (CUDA torch.topk's set)."""

import torch
from fuzz_support import DEVICE, SPECIALS, fuzzes, layouts, restride, seeds, sizes, values
from hypothesis import given
from hypothesis import strategies as st

from dsfuse.kernels.indexer_topk import (
    indexer_topk,
    indexer_topk_reference,
    indexer_topk_triton,
    topk_lowest_index_ties,
)

HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong


def _scores(q, k, weights, k_scale, mask, scale, fill=None):
    index = torch.matmul(weights.unsqueeze(-2),
                         torch.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * scale))
    index = index.squeeze(-2)
    if k_scale is not None:
        index = index * k_scale.unsqueeze(1)
    if mask is not None:
        fill = float("-inf") if fill is None else fill
        index = index.masked_fill(~mask, fill) if mask.dtype == torch.bool else index + mask
    return index


@fuzzes("dsfuse::indexer_topk")
@given(data=st.data(), mask_kind=st.sampled_from(["none", "bool", "additive", "broadcast", "causal_holes"]),
       with_k_scale=st.booleans(), tied_keys=st.booleans(), exact=st.booleans())
def test_indexer_topk_kernel_selects_the_reference_scores(data, mask_kind, with_k_scale, tied_keys, exact):
    B, S, H = (data.draw(sizes(1, n)) for n in (2, 9, 5))
    T, D = data.draw(sizes(1, 65)), data.draw(st.sampled_from([8, 16, 24]))
    topk = data.draw(st.integers(1, T + 3))
    dtype, seed = data.draw(st.sampled_from([HALF, torch.float32])), data.draw(seeds())
    g = torch.Generator().manual_seed(seed)
    # No NaN / Inf with an additive mask: a key at -inf whose raw score is NaN or +Inf is NaN there and ranks first
    # in torch.topk; the kernel scans only the tiles its rows can see
    # (test_additive_masked_nan_key_the_kernel_does_not_scan).
    specials = SPECIALS if mask_kind != "additive" else ("zero", "tie")
    q_specials, k_specials = (data.draw(st.lists(st.sampled_from(specials), max_size=1)) for _ in range(2))
    # exact: q, k and weights on multiples of 1/4, so products and sums are exact in fp32 in any order
    grid = 4 if exact else None
    q = restride(values((B, S, H, D), dtype, seed, specials=q_specials, grid=grid).to(DEVICE), data.draw(layouts(4)))
    k = values((B, T, D), dtype, seed + 1, specials=k_specials, grid=grid)
    if tied_keys:
        k[:, ::2] = k[:, :1].clone()  # every other key equals the first: many tied scores
    k = restride(k.to(DEVICE), data.draw(layouts(3)))
    weights = values((B, S, H), torch.float32, seed + 2, grid=grid).to(DEVICE)
    k_scale = (torch.rand(B, T, generator=g) + 0.5).to(DEVICE) if with_k_scale else None
    mask = None
    if mask_kind != "none":
        keep = torch.rand(B, S, T, generator=g) < 0.6
        if mask_kind == "causal_holes":  # query s sees keys 0..s, a few masked: rows with fewer than k keys
            keep = (torch.arange(T)[None, :] <= torch.arange(S)[:, None]) & (torch.rand(B, S, T, generator=g) < 0.8)
        keep[:, data.draw(st.integers(0, S - 1))] = False  # a fully masked row
        if mask_kind == "broadcast":
            keep = keep[:1, :, :]  # [1, S, T], broadcast over the batch
        mask = keep if mask_kind != "additive" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        mask = mask.to(DEVICE)
    # a bool mask's fill: -inf, or a finite score masked keys take (ties with real scores at 0 included)
    fill = data.draw(st.sampled_from([None, -3.0e38, -1e9, 0.0])) if mask is not None and mask.dtype == torch.bool \
        else None
    args = (q, k, weights, k_scale, mask, 0.125, topk)
    if DEVICE == "cpu":  # the CPU op is the reference (on CUDA it is the kernel, checked below)
        assert torch.equal(indexer_topk(*args, fill=fill), indexer_topk_reference(*args, fill=fill))
    got = indexer_topk_triton(*args, fill=fill).cpu()
    index = _scores(*(t.cpu() if t is not None else None for t in args[:5]), 0.125, fill).cpu()
    width = min(topk, T)
    assert got.dtype == torch.int32 and tuple(got.shape) == (B, S, width)
    assert int(got.min()) >= 0 and int(got.max()) < T
    assert not bool((got.sort(-1).values.diff(dim=-1) == 0).any()), "a key selected twice in a row"
    chosen = torch.gather(index, -1, got.long()).sort(-1).values
    best = index.topk(width, dim=-1).values.sort(-1).values
    torch.testing.assert_close(chosen, best, rtol=1e-5, atol=1e-5, equal_nan=True)
    if exact:  # the same scores bit for bit: the tie rule decides every pick
        assert torch.equal(got.sort(-1).values, topk_lowest_index_ties(index, width).sort(-1).values)


def test_inf_key_with_padding_heads():
    """Regression for a fuzz finding: H = 3 heads run as 4, the padding head with a zero query and weight; a key
    holding Inf made its dot product 0 * Inf = NaN, the zero weight kept it NaN, and that key ranked first although
    every real head scores it relu(-Inf) = 0 (the other key scores 12)."""
    g = torch.Generator().manual_seed(0)
    q, k, w = torch.ones(1, 1, 3, 8), torch.randn(1, 2, 8, generator=g), torch.ones(1, 1, 3)
    k[0, 0, 0], k[0, 1] = float("-inf"), 0.5
    args = tuple(t.to(DEVICE) for t in (q, k, w))
    assert indexer_topk_reference(*args, None, None, 1.0, 1).tolist() == [[[1]]]
    assert indexer_topk_triton(*args, None, None, 1.0, 1).tolist() == [[[1]]]


def test_nan_key_outside_the_row_range_is_picked_once():
    """Regression for a fuzz finding: an additive mask, a row with fewer allowed keys than k, and a NaN key at -inf
    (NaN + -inf is NaN: a candidate, and torch.topk's first pick).  The kernel's fill of masked keys picked it a
    second time; such a row now goes to the exact repair."""
    g = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 3, 8, generator=g), torch.randn(1, 2, 1, generator=g)
    k[0, 0, 5] = float("nan")
    mask = torch.zeros(1, 2, 3)
    mask[0, 0], mask[0, 1, 0] = float("-inf"), float("-inf")
    args = tuple(t.to(DEVICE) for t in (q, k, w)) + (None, mask.to(DEVICE), 0.125, 3)
    want = indexer_topk_reference(*args)
    assert want[..., 0].tolist() == [[0, 0]]
    assert torch.equal(indexer_topk_triton(*args).sort(-1).values.cpu(), want.sort(-1).values.cpu())


def test_additive_masked_nan_key_the_kernel_does_not_scan():
    """Documented difference (notes/indexer_topk.md, "Non-finite inputs"): with an additive mask, a key at -inf
    whose raw score is NaN (or +Inf: +Inf + -inf is NaN) is NaN and torch.topk's first pick.  The kernel scans only
    the key tiles inside its query block's allowed ranges, so such a key there is picked (first) and one beyond
    them is not: these rows get the top k of their allowed keys, what a bool mask gives."""
    g = torch.Generator().manual_seed(0)
    B, S, H, T, D, topk = 1, 4, 4, 256, 16, 4
    q, k, w = torch.randn(B, S, H, D, generator=g), torch.randn(B, T, D, generator=g), torch.randn(B, S, H, generator=g)
    k[0, 200, 3] = float("nan")
    allowed = torch.zeros(B, S, T, dtype=torch.bool)
    allowed[..., :11] = True
    additive = torch.zeros(B, S, T).masked_fill(~allowed, float("-inf"))
    args = tuple(t.to(DEVICE) for t in (q, k, w))
    assert bool((indexer_topk_reference(*args, None, additive.to(DEVICE), 0.125, topk) == 200).any(-1).all())
    got = indexer_topk_triton(*args, None, additive.to(DEVICE), 0.125, topk).sort(-1).values.cpu()
    assert torch.equal(got, indexer_topk_reference(*args, None, allowed.to(DEVICE), 0.125, topk).sort(-1).values.cpu())
