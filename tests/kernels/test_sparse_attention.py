"""Sparse-attention custom ops: Triton kernels (interpreter on CPU) against the references,
the references against the HF / official source math, opcheck, and input validation."""

import math

import pytest
import torch
import torch.nn.functional as F

from dsfuse.kernels import sparse_attention as sa
from dsfuse.kernels.quant_formats import dequantize_fp8_blocks
from dsfuse.kernels.triton_support import check_outputs_match_fake
from dsfuse.models.quantized import quantize_fp8_weight

# The interpreter evaluates in numpy, which warns on the intended 0/0 (rows without keys) and
# finfo.min * log2(e) (= -inf) of additive masks.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter's bf16 tl.dot is broken; fp16 exercises the same half-precision path.
HALF = torch.float16


def _mla_inputs(B, S, H, Dc, Dr, T, K, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(B, S, H, Dc, generator=g).to(dtype)
    q_pe = torch.randn(B, S, H, Dr, generator=g).to(dtype)
    kv = torch.randn(B, T, Dc, generator=g).to(dtype)
    pe = torch.randn(B, T, Dr, generator=g).to(dtype)
    idx = torch.randint(0, T, (B, S, K), generator=g)
    sink = torch.randn(H, generator=g)
    return [t.to(device) for t in (q_nope, q_pe, kv, pe, idx, sink)]


def _rel_err(out, ref):
    both_nan = out.isnan() & ref.isnan()
    assert torch.equal(out.isnan(), ref.isnan()), "NaN pattern differs"
    diff = (out.float() - ref.float()).masked_fill(both_nan, 0).abs().max()
    scale = ref.float().masked_fill(both_nan, 0).abs().max().clamp_min(1e-6)
    return (diff / scale).item()


# --------------------------------------------------------------------------- op 1


MLA_SHAPES = [
    # B, S, H, Dc, Dr, T, K
    (1, 1, 4, 32, 16, 20, 1),
    (2, 3, 16, 32, 16, 64, 7),
    (1, 17, 6, 32, 16, 100, 32),
    (2, 5, 5, 16, 16, 33, 13),
    (1, 2, 3, 8, 4, 12, 5),  # latent and rope dims below the smallest MMA width
]


@pytest.mark.parametrize("shape", MLA_SHAPES)
@pytest.mark.parametrize("with_sink", [False, True])
def test_mla_kernel_matches_reference_fp32(shape, with_sink):
    B, S, H, Dc, Dr, T, K = shape
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(B, S, H, Dc, Dr, T, K, torch.float32)
    idx[..., ::3] = -1  # "no key" entries
    if K > 1:
        idx[..., 1] = idx[..., 0].clamp_min(0)  # duplicates
    sink = sink if with_sink else None
    out = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, 0.17, sink)
    ref = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.17, sink)
    assert _rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("block_h,block_n,block_dv", [(16, 16, 32), (16, 32, 16)])
def test_mla_kernel_launch_variants(block_h, block_n, block_dv):
    """Head blocks smaller than H, key tails, and the output split across programs."""
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(2, 3, 20, 32, 16, 50, 21, torch.float32)
    out = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, 0.2, sink,
                                         block_h=block_h, block_n=block_n, block_dv=block_dv)
    ref = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.2, sink)
    assert _rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("with_sink", [False, True])
def test_mla_kernel_key_splits(num_splits, with_sink):
    """Decode splits the selected keys across programs and merges them: same result for any split count,
    including splits whose keys are all -1 and a row with no key at all."""
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(1, 2, 20, 32, 16, 300, 90, torch.float32)
    idx[0, 0, :40] = -1  # the first splits of this row have no key
    idx[0, 1] = -1  # no key at all: NaN without a sink, 0 with one
    sink = sink if with_sink else None
    out = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, 0.2, sink, block_h=16, block_n=16,
                                         num_splits=num_splits)
    ref = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.2, sink)
    assert _rel_err(out, ref) <= 1e-5
    assert sa.sparse_mla_num_splits(1, 2, 2048, 64) == 8 and sa.sparse_mla_num_splits(64, 2, 2048, 64) == 1


@pytest.mark.parametrize("with_sink", [False, True])
def test_mla_kernel_half_precision(with_sink):
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(2, 4, 8, 32, 16, 48, 19, HALF)
    sink = sink if with_sink else None
    out = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, 0.15, sink)
    ref = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.15, sink)
    exact = sa.sparse_mla_attention_reference(*(t.float() for t in (q_nope, q_pe, kv, pe)), idx, 0.15, sink)
    assert out.dtype == HALF
    # Online softmax rounds unnormalised probabilities to half: same order as the reference's rounding.
    assert _rel_err(out, ref) <= 4e-3
    assert _rel_err(out, exact) <= 2 * max(_rel_err(ref, exact), 2e-3)


def test_mla_row_without_keys_nan_without_sink_zero_with_sink():
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(1, 3, 4, 32, 16, 20, 5, torch.float32)
    idx[0, 1] = -1
    for s in (None, sink):
        out = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, 0.3, s)
        ref = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.3, s)
        if s is None:
            assert out[0, 1].isnan().all() and ref[0, 1].isnan().all()
        else:
            assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
            assert torch.equal(ref[0, 1], torch.zeros_like(ref[0, 1]))
        assert torch.isfinite(out[0, [0, 2]]).all()


def test_mla_kernel_treats_out_of_range_indices_as_no_key():
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(2, 3, 4, 32, 16, 20, 6, torch.float32)
    bad = idx.clone()
    bad[0, 0, 0] = 20
    bad[1, 2, 3] = 10**6
    bad[1, 0, 1] = -7
    cleaned = bad.masked_fill((bad < 0) | (bad >= 20), -1)
    out = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, bad, 0.3, sink)
    ref = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, cleaned, 0.3, sink)
    assert _rel_err(out, ref) <= 1e-5
    with pytest.raises(IndexError, match="outside"):
        sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, bad, 0.3, sink)


def test_mla_reference_counts_duplicates_twice_and_matches_official_math():
    """Official gather code: softmax over the K gathered scores, duplicates included."""
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(1, 2, 3, 16, 16, 10, 4, torch.float32)
    idx[0, 0] = torch.tensor([2, 2, 5, -1])
    out = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.5, sink)
    rows = [2, 2, 5]
    scores = (q_nope[0, 0] @ kv[0, rows].T + q_pe[0, 0] @ pe[0, rows].T) * 0.5  # [H,3]
    weights = torch.exp(scores)
    probs = weights / (weights.sum(-1, keepdim=True) + torch.exp(sink)[:, None])
    expected = probs @ kv[0, rows]
    torch.testing.assert_close(out[0, 0], expected, rtol=1e-5, atol=1e-6)
    kernel = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, 0.5, sink)
    torch.testing.assert_close(kernel[0, 0], expected, rtol=1e-5, atol=1e-6)


def test_mla_sink_is_not_folded_into_the_max():
    """A sink far above every score must still leave exp(score - max) in the numerator."""
    q_nope, q_pe, kv, pe, idx, _ = _mla_inputs(1, 1, 4, 16, 16, 12, 3, torch.float32)
    sink = torch.full((4,), 30.0, device=q_nope.device)
    out = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, 0.01, sink)
    ref = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.01, sink)
    assert ref.abs().max() > 0
    assert _rel_err(out, ref) <= 1e-5


def test_mla_op_dispatches_and_opcheck():
    args = _mla_inputs(1, 3, 4, 16, 16, 20, 5, torch.float32, device="cpu")
    q_nope, q_pe, kv, pe, idx, sink = args
    out = torch.ops.dsfuse.sparse_mla_attention(q_nope, q_pe, kv, pe, idx, 0.25, sink)
    torch.testing.assert_close(out, sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.25, sink))
    torch.library.opcheck(torch.ops.dsfuse.sparse_mla_attention.default, (q_nope, q_pe, kv, pe, idx, 0.25, sink))
    torch.library.opcheck(torch.ops.dsfuse.sparse_mla_attention.default,
                          (q_nope, q_pe, kv, pe, idx.int(), 0.25, None))


def test_mla_bad_inputs_raise():
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(1, 2, 4, 16, 16, 20, 5, torch.float32, device="cpu")
    op = torch.ops.dsfuse.sparse_mla_attention
    with pytest.raises(ValueError, match="q_nope and q_pe"):
        op(q_nope[0], q_pe, kv, pe, idx, 1.0, None)
    with pytest.raises(ValueError, match="kv must be"):
        op(q_nope, q_pe, kv[..., :8], pe, idx, 1.0, None)
    with pytest.raises(TypeError, match="differs"):
        op(q_nope, q_pe, kv.double(), pe, idx, 1.0, None)
    with pytest.raises(TypeError, match="int32 or int64"):
        op(q_nope, q_pe, kv, pe, idx.float(), 1.0, None)
    with pytest.raises(ValueError, match="sink"):
        op(q_nope, q_pe, kv, pe, idx, 1.0, sink[:2])
    with pytest.raises(ValueError, match="K>=1"):
        op(q_nope, q_pe, kv, pe, idx[..., :0], 1.0, None)
    with pytest.raises(ValueError, match="finite"):
        op(q_nope, q_pe, kv, pe, idx, math.nan, None)
    with pytest.raises(IndexError, match="outside"):
        op(q_nope, q_pe, kv, pe, idx.masked_fill(idx == idx[0, 0, 0], -2), 1.0, None)


# --------------------------------------------------------------------------- op 2


def _masked_inputs(B, H, S, T, D, Dv, K, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g).to(dtype)
    k = torch.randn(B, H, T, D, generator=g).to(dtype)
    v = torch.randn(B, H, T, Dv, generator=g).to(dtype)
    # Like the indexer's top-k over causally masked scores: the first K keys of a random order
    # in which the query's causal keys come first.
    offset = T - S
    scores = torch.rand(B, S, T, generator=g)
    future = torch.arange(T)[None, :] > (torch.arange(S)[:, None] + offset)
    scores = scores.masked_fill(future, -1.0)
    idx = scores.topk(K, dim=-1).indices
    return [t.to(device) for t in (q, k, v, idx)]


def _causal_bool(B, S, T, device=DEVICE):
    mask = torch.ones(S, T, dtype=torch.bool).tril(T - S)
    return mask[None, None].expand(B, 1, S, T).contiguous().to(device)


MASKED_SHAPES = [
    # B, H, S, T, D, Dv, K
    (1, 4, 1, 20, 32, 16, 5),
    (2, 3, 17, 40, 32, 16, 9),
    (1, 2, 9, 100, 48, 32, 32),
    (2, 2, 33, 70, 16, 16, 1),
    (1, 3, 5, 30, 8, 4, 6),  # head dims below the smallest MMA width
]


@pytest.mark.parametrize("shape", MASKED_SHAPES)
@pytest.mark.parametrize("mask_kind", ["none", "causal_flag", "bool", "bool_broadcast", "bool_per_head", "additive"])
def test_masked_kernel_matches_reference_fp32(shape, mask_kind):
    B, H, S, T, D, Dv, K = shape
    q, k, v, idx = _masked_inputs(B, H, S, T, D, Dv, K, torch.float32)
    idx[..., -1] = idx[..., 0]  # a duplicate: HF's scatter selects the key once
    causal, mask = False, None
    if mask_kind == "causal_flag":
        causal = True
    elif mask_kind == "bool":
        mask = _causal_bool(B, S, T)
    elif mask_kind == "bool_broadcast":
        mask = torch.ones(S, T, dtype=torch.bool).tril(T - S).to(q.device)
    elif mask_kind == "bool_per_head":  # read per tile in the attention kernel, not folded into the bitmap
        mask = _causal_bool(B, S, T).repeat(1, H, 1, 1)
        mask[:, -1, :, 0] = False
    elif mask_kind == "additive":
        mask = torch.zeros(B, 1, S, T, device=q.device).masked_fill(~_causal_bool(B, S, T),
                                                                   torch.finfo(torch.float32).min)
    out = sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.21, causal)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.21, causal)
    assert _rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 64)])
def test_masked_kernel_tile_variants(block_m, block_n):
    q, k, v, idx = _masked_inputs(2, 2, 37, 37, 24, 16, 7, torch.float32)
    mask = _causal_bool(2, 37, 37)
    out = sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.3, True, block_m=block_m, block_n=block_n)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.3, True)
    assert _rel_err(out, ref) <= 1e-5


def test_masked_fully_masked_rows_match_sdpa():
    """Bool: SDPA returns zeros for an all-False row.  Additive (finfo.min everywhere): SDPA's
    softmax is uniform over all T keys, i.e. the mean of V over all keys."""
    B, H, S, T = 2, 3, 6, 40
    q, k, v, idx = _masked_inputs(B, H, S, T, 32, 16, 4, torch.float32)
    bool_mask = _causal_bool(B, S, T)
    bool_mask[1, :, 2] = False  # a padded query row
    bool_mask[0, :, :, :] &= torch.arange(T, device=q.device) >= 38  # row 0..: only keys 38,39 allowed
    add_mask = torch.zeros(B, 1, S, T, device=q.device).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    for mask in (bool_mask, bool_mask.expand(B, H, S, T).clone(), add_mask):
        out = sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.3)
        ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.3)
        assert _rel_err(out, ref) <= 1e-5
    out_bool = sa.sparse_attention_masked_triton(q, k, v, idx, bool_mask, 0.3)
    assert torch.equal(out_bool[1, :, 2], torch.zeros_like(out_bool[1, :, 2]))
    out_add = sa.sparse_attention_masked_triton(q, k, v, idx, add_mask, 0.3)
    torch.testing.assert_close(out_add[1, :, 2], v[1].mean(dim=1), rtol=1e-5, atol=1e-6)



def _causal_mask_with_rows_at_the_fill(B, S, T, dtype, device):
    """An additive causal mask at finfo.min, with query 1 of batch 0 wholly at the fill, query 5 of batch 1 at -inf
    and query 6 of batch 1 at a quarter of the fill (far below 0, yet it wins over the fill)."""
    fill = torch.finfo(dtype).min
    mask = torch.zeros(B, 1, S, T, device=device).masked_fill(~_causal_bool(B, S, T), fill)
    mask[0, :, 1] = fill
    mask[1, :, 5] = float("-inf")
    mask[1, :, 6] = fill / 4
    return mask.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_masked_additive_rows_at_the_fill_see_every_key(dtype):
    """Additive rows whose selected keys sit at finfo.min (or -inf) are SDPA's softmax over all T keys with the
    unselected ones at finfo.min too: the mean of V for fp32, softmax(q.k) for fp16 (-65504 does not absorb the
    scores), over the unselected keys alone where the selected ones are -inf. Blocks of 4 queries, so the pass
    over every key runs for some blocks, in blocks that mix such rows with ordinary ones."""
    B, H, S, T = 2, 2, 12, 45
    q, k, v, idx = _masked_inputs(B, H, S, T, 24, 8, 5, dtype)
    mask = _causal_mask_with_rows_at_the_fill(B, S, T, dtype, q.device)
    out = sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.3, block_m=4, block_n=32)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.3)
    assert _rel_err(out, ref) <= (1e-5 if dtype == torch.float32 else 2e-3)


def test_masked_empty_rows_see_all_keys():
    """`empty_rows_see_all` (a finite bias's semantics): a row left without keys, a padding query or one whose
    selection is all padding, attends over all T keys unmasked (T past the last whole 32-key word too)."""
    B, H, S, T = 2, 3, 6, 45
    q, k, v, idx = _masked_inputs(B, H, S, T, 32, 16, 4, torch.float32)
    mask = _causal_bool(B, S, T)
    mask[1, :, :, :3] = False  # left padding of 3: ...
    idx[1, 4] = torch.tensor([0, 1, 2, 1])  # ... and a query that selected only padding
    mask[1, :, 2] = False
    allowed = mask & ~torch.ones(B, S, T, dtype=torch.bool, device=q.device).scatter(-1, idx, False).unsqueeze(1)
    empty = ~allowed.any(-1)
    assert empty[1, 0, 2] and empty[1, 0, 4] and empty.sum() >= 2
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | empty[..., None], scale=0.3)
    out = sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.3, False, True)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.3, False, True)
    assert _rel_err(out, expected) <= 1e-5 and _rel_err(ref, expected) <= 1e-5
    assert not torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))
    cpu = [t.cpu() for t in (q, k, v, idx, mask)]
    torch.library.opcheck(torch.ops.dsfuse.sparse_attention_masked.default, (*cpu[:5], 0.3, False, True))
    with pytest.raises(ValueError, match="empty_rows_see_all needs a bool attn_mask shared by the heads"):
        sa.sparse_attention_masked_reference(*cpu[:4], cpu[4].expand(B, H, S, T), 0.3, False, True)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "causal_flag"])
def test_masked_kernel_half_precision(mask_kind):
    B, H, S, T = 2, 3, 17, 50
    q, k, v, idx = _masked_inputs(B, H, S, T, 32, 16, 11, HALF)
    causal = mask_kind == "causal_flag"
    mask = None
    if mask_kind == "bool":
        mask = _causal_bool(B, S, T)
    elif mask_kind == "additive":
        mask = torch.zeros(B, 1, S, T, dtype=HALF, device=q.device).masked_fill(~_causal_bool(B, S, T),
                                                                                torch.finfo(HALF).min)
    out = sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.2, causal)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.2, causal)
    assert out.dtype == HALF
    assert _rel_err(out, ref) <= 4e-3


def _hf_eager_sparse_attention(q, k, v, idx, attn_mask, scale):
    """HF DeepseekV32Attention with the eager interface: scatter mask, softmax in fp32, cast, P @ V."""
    B, H, S, _ = q.shape
    index_mask = torch.ones((B, S, k.shape[2]), dtype=torch.bool, device=q.device).scatter(-1, idx.long(), False)
    combined = attn_mask.masked_fill(index_mask.unsqueeze(1), torch.finfo(q.dtype).min)
    weights = torch.matmul(q, k.transpose(2, 3)) * scale + combined
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def test_masked_reference_matches_hf_eager_at_bf16_level():
    q, k, v, idx = _masked_inputs(1, 4, 12, 30, 32, 16, 6, torch.bfloat16, device="cpu")
    mask = torch.zeros(1, 1, 12, 30, dtype=torch.bfloat16).masked_fill(
        ~_causal_bool(1, 12, 30, device="cpu"), torch.finfo(torch.bfloat16).min)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.18)
    eager = _hf_eager_sparse_attention(q, k, v, idx, mask, 0.18)
    exact = sa.sparse_attention_masked_reference(q.float(), k.float(), v.float(), idx, mask.float(), 0.18)
    assert _rel_err(ref, exact) <= 1e-2
    assert _rel_err(eager, exact) <= 1e-2
    assert _rel_err(ref, eager) <= 2e-2


@pytest.mark.parametrize("causal,with_mask", [(False, False), (True, False), (False, True)])
def test_selection_bitmap_sets_each_selected_key_once(causal, with_mask):
    """Two query rows (S=2, T=70): the causal limit of row s is key s + 68; the mask (when
    given) forbids key 33 for row 0 and key 1 for row 1."""
    idx = torch.tensor([[[0, 31, 32, 33, 33, 69, 5], [69, 68, 70, -1, 1, 1, 1]]], device=DEVICE)
    bits = torch.zeros((1, 2, 3), dtype=torch.int32, device=DEVICE)
    mask = torch.ones((1, 2, 70), dtype=torch.bool, device=DEVICE)
    mask[0, 0, 33] = False
    mask[0, 1, 1] = False
    mask = mask.view(torch.uint8)
    sa._selection_bitmap_kernel[(2, 1)](idx, bits, mask, idx.stride(0), idx.stride(1), *mask.stride(),
                                        2, 70, 7, 3, BLOCK_K=8, CAUSAL=causal, HAS_MASK=with_mask)
    row0 = [(1 << 0) | (1 << 31) | (1 << 5), (1 << 0) | (0 if with_mask else 1 << 1), 0 if causal else 1 << 5]
    row1 = [0 if with_mask else 1 << 1, 0, (1 << 5) | (1 << 4)]
    got = [w & 0xFFFFFFFF for w in bits.view(-1).tolist()]
    assert got == row0 + row1


def test_masked_kernel_ignores_out_of_range_indices():
    q, k, v, idx = _masked_inputs(1, 2, 5, 20, 16, 16, 4, torch.float32)
    bad = idx.clone()
    bad[0, 1, 0] = 20
    bad[0, 3, 2] = -5
    out = sa.sparse_attention_masked_triton(q, k, v, bad, None, 0.3, True)
    # Out-of-range entries select nothing: same as repeating a valid entry of that row.
    cleaned = bad.clone()
    cleaned[0, 1, 0] = cleaned[0, 1, 1]
    cleaned[0, 3, 2] = cleaned[0, 3, 0]
    ref = sa.sparse_attention_masked_reference(q, k, v, cleaned, None, 0.3, True)
    assert _rel_err(out, ref) <= 1e-5
    with pytest.raises(IndexError, match="outside"):
        sa.sparse_attention_masked_reference(q, k, v, bad, None, 0.3, True)


@pytest.mark.parametrize("mask_kind", ["causal_flag", "additive"])
def test_masked_kernel_propagates_nan_like_sdpa(mask_kind):
    q, k, v, idx = _masked_inputs(1, 2, 6, 20, 16, 16, 4, torch.float32)
    q[0, 1, 3, 5] = float("nan")
    mask = None
    if mask_kind == "additive":
        mask = torch.zeros(1, 1, 6, 20, device=q.device).masked_fill(~_causal_bool(1, 6, 20),
                                                                    torch.finfo(torch.float32).min)
    out = sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.3, mask is None)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.3, mask is None)
    assert ref[0, 1, 3].isnan().all()
    assert _rel_err(out, ref) <= 1e-5


def test_mla_kernel_propagates_nan():
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(1, 3, 4, 16, 16, 20, 5, torch.float32)
    q_nope[0, 1, 2, 0] = float("nan")
    for s in (None, sink):
        out = sa.sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, 0.3, s)
        ref = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.3, s)
        assert ref[0, 1, 2].isnan().all()
        assert _rel_err(out, ref) <= 1e-5


def test_masked_op_dispatches_and_opcheck():
    q, k, v, idx = _masked_inputs(1, 2, 5, 12, 16, 8, 3, torch.float32, device="cpu")
    bool_mask = _causal_bool(1, 5, 12, device="cpu")
    add_mask = torch.zeros(1, 1, 5, 12).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    op = torch.ops.dsfuse.sparse_attention_masked
    out = op(q, k, v, idx, bool_mask, 0.25, False)
    torch.testing.assert_close(out, sa.sparse_attention_masked_reference(q, k, v, idx, bool_mask, 0.25))
    for mask, causal in ((bool_mask, False), (add_mask, False), (None, True)):
        torch.library.opcheck(op.default, (q, k, v, idx, mask, 0.25, causal))


def test_masked_bad_inputs_raise():
    q, k, v, idx = _masked_inputs(1, 2, 5, 12, 16, 8, 3, torch.float32, device="cpu")
    op = torch.ops.dsfuse.sparse_attention_masked
    with pytest.raises(ValueError, match="k must be"):
        op(q, k[:, :1], v, idx, None, 1.0, False)
    with pytest.raises(TypeError, match="share one of"):
        op(q, k.half(), v, idx, None, 1.0, False)
    with pytest.raises(ValueError, match="does not broadcast"):
        op(q, k, v, idx, torch.ones(5, 13, dtype=torch.bool), 1.0, False)
    with pytest.raises(ValueError, match="does not broadcast"):
        op(q, k, v, idx, torch.ones(2, 1, 5, 12, dtype=torch.bool), 1.0, False)
    with pytest.raises(TypeError, match="bool or floating"):
        op(q, k, v, idx, torch.ones(5, 12, dtype=torch.int32), 1.0, False)
    with pytest.raises(IndexError, match="outside"):
        op(q, k, v, idx.masked_fill(idx == idx[0, 0, 0], -1), None, 1.0, False)
    with pytest.raises(ValueError, match="K>=1"):
        op(q, k, v, idx[..., :0], None, 1.0, False)


def _sink_column_attention(q, k, v, idx, combined, scale, sink):
    """What V4-style source writes: a sink column beside the masked fp32 scores, softmax, the column dropped.
    `combined` is the bool keep mask (selection folded in) or the additive mask to add."""
    B, H, S, T = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~combined, float("-inf")) if combined.dtype == torch.bool else scores + combined
    column = sink.view(1, H, 1, 1).expand(B, H, S, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :T]
    return torch.matmul(probs.to(q.dtype), v)


@pytest.mark.parametrize("shape", MASKED_SHAPES)
@pytest.mark.parametrize("mask_kind", ["none", "causal_flag", "bool", "bool_per_head", "additive"])
def test_masked_kernel_with_sink_matches_reference(shape, mask_kind):
    """A per-head sink over every mask kind, a padded query row without keys among them (0 with a sink; an additive
    row at the fill weighs its keys against the sink, which takes it all)."""
    B, H, S, T, D, Dv, K = shape
    q, k, v, idx = _masked_inputs(B, H, S, T, D, Dv, K, torch.float32)
    sink = torch.randn(H, generator=torch.Generator().manual_seed(1)).to(q.device) * 2
    keep = _causal_bool(B, S, T)
    padded = S > 1  # a single query keeps its keys
    keep[-1, :, 0] &= not padded
    causal, mask = mask_kind == "causal_flag", None
    if mask_kind == "bool":
        mask = keep
    elif mask_kind == "bool_per_head":
        mask = keep.repeat(1, H, 1, 1)
        mask[:, -1, :, 0] = False
    elif mask_kind == "additive":
        mask = torch.zeros(B, 1, S, T, device=q.device).masked_fill(~keep, torch.finfo(torch.float32).min)
    out = sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.21, causal, False, sink, block_m=16, block_n=32)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.21, causal, False, sink)
    assert _rel_err(out, ref) <= 1e-5
    if mask is not None and padded:
        assert torch.equal(out[-1, :, 0], torch.zeros_like(out[-1, :, 0]))
    plain = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.21, causal)
    assert _rel_err(ref, plain) > 1e-2  # the sink takes weight from every row


def test_masked_sink_reference_is_a_sink_column():
    """The reference's sink against the sink column spelled out, over a bool and an additive mask and over the
    selection alone, with a large sink (most of the weight) and a very negative one (almost none)."""
    B, H, S, T = 2, 3, 7, 19
    q, k, v, idx = _masked_inputs(B, H, S, T, 16, 8, 4, torch.float32, device="cpu")
    selected = torch.zeros(B, 1, S, T, dtype=torch.bool).scatter(-1, idx.unsqueeze(1), True)
    keep = _causal_bool(B, S, T, device="cpu")
    keep[1, :, :2] = False
    additive = torch.zeros(B, 1, S, T).masked_fill(~keep, torch.finfo(torch.float32).min)
    sink = torch.tensor([4.0, -30.0, 0.5])
    for mask, combined in ((None, selected), (keep, keep & selected),
                           (additive, additive.masked_fill(~selected, torch.finfo(torch.float32).min))):
        want = _sink_column_attention(q, k, v, idx, combined, 0.3, sink)
        got = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.3, False, False, sink)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_masked_hard_selection(dtype):
    """`hard_selection`: the selection as a -inf bias summed with an additive mask. A row whose selected keys are all
    at finfo.min (or -inf) is a softmax over those keys alone (the mean of their V in fp32), 0 where they are all
    -inf; HF's fill (the default) spreads such a row over every key. Rows with an allowed pick are the same."""
    B, H, S, T = 2, 2, 12, 45
    q, k, v, idx = _masked_inputs(B, H, S, T, 24, 8, 5, dtype)
    mask = _causal_mask_with_rows_at_the_fill(B, S, T, dtype, q.device)
    selected = torch.zeros(B, 1, S, T, dtype=torch.bool, device=q.device).scatter(-1, idx.unsqueeze(1), True)
    summed = mask + torch.zeros_like(mask).masked_fill(~selected, float("-inf"))
    want = F.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), attn_mask=summed.cpu(), scale=0.3)
    for sink in (None, torch.randn(H, generator=torch.Generator().manual_seed(2)).to(q.device)):
        out = sa.sparse_attention_masked_triton(q, k, v, idx, mask, 0.3, False, False, sink, True, block_m=4,
                                                block_n=32)
        ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.3, False, False, sink, True)
        assert _rel_err(out, ref) <= (1e-5 if dtype == torch.float32 else 2e-3)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.3, False, False, None, True)
    assert _rel_err(ref.cpu(), want) <= (1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(ref[1, :, 5], torch.zeros_like(ref[1, :, 5]))
    soft = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 0.3)
    assert _rel_err(soft[0, :, 1], ref[0, :, 1]) > 1e-2 and _rel_err(soft[0, :, 2:], ref[0, :, 2:]) <= 1e-5


def test_masked_op_with_sink_and_hard_selection_opcheck():
    q, k, v, idx = _masked_inputs(1, 2, 5, 12, 16, 8, 3, torch.float32, device="cpu")
    bool_mask = _causal_bool(1, 5, 12, device="cpu")
    add_mask = torch.zeros(1, 1, 5, 12).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    sink = torch.tensor([0.5, -1.0])
    op = torch.ops.dsfuse.sparse_attention_masked
    torch.testing.assert_close(op(q, k, v, idx, add_mask, 0.25, False, False, sink, True),
                               sa.sparse_attention_masked_reference(q, k, v, idx, add_mask, 0.25, False, False, sink,
                                                                    True))
    for mask, causal, hard in ((bool_mask, False, False), (add_mask, False, True), (None, True, False)):
        torch.library.opcheck(op.default, (q, k, v, idx, mask, 0.25, causal, False, sink, hard))
    with pytest.raises(ValueError, match="sink must be fp32"):
        op(q, k, v, idx, None, 1.0, False, False, sink[:1])
    with pytest.raises(ValueError, match="sink must be fp32"):
        op(q, k, v, idx, None, 1.0, False, False, sink.double())


# --------------------------------------------------------------------------- absorbed (HF latent cache)

NOPE, ROPE, VDIM, LATENT = 16, 8, 12, 32


def _absorbed_inputs(B, H, S, T, K, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, NOPE + ROPE, generator=g).to(dtype)
    latent = torch.randn(B, 1, T, LATENT, generator=g).to(dtype)
    rope = torch.randn(B, 1, T, ROPE, generator=g).to(dtype)
    weight = (torch.randn(H * (NOPE + VDIM), LATENT, generator=g) / LATENT**0.5).to(dtype)
    idx = torch.stack([torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(S)]) for _ in range(B)])
    return [t.to(device) for t in (q, latent, rope, weight, idx)]


def _hf_latent_attention(q, latent, rope, weight, idx, attn_mask, scale):
    """HF `DeepseekV32Attention` from its latent cache: expand through kv_b_proj, scatter mask, SDPA."""
    B, H, S, _ = q.shape
    T = latent.shape[2]
    kv = F.linear(latent, weight).view(B, T, H, NOPE + VDIM).transpose(1, 2)
    k_nope, v = kv.split([NOPE, VDIM], dim=-1)
    k = torch.cat([k_nope, rope.expand(-1, H, -1, -1)], dim=-1)
    unselected = torch.ones(B, S, T, dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
    keep = ~unselected if attn_mask is None else attn_mask & ~unselected
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal"])
def test_absorbed_reference_is_hf_latent_attention_fp32(mask_kind):
    B, S, T = 2, 3, 40
    q, latent, rope, weight, idx = _absorbed_inputs(B, 3, S, T, 9, torch.float32, device="cpu")
    idx[0, 1, :3] = idx[0, 1, 3]  # repeated indices select a key once, as HF's scatter does
    mask, hf_mask = None, None
    if mask_kind == "padding":
        mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
        mask[1, ..., :25] = False  # left padding of batch 1
        mask[1, ..., 30:] = False
        idx[1, 0] = torch.arange(9)  # this query sees no allowed key at all: SDPA's bool result is 0
        hf_mask = mask
    if mask_kind == "causal":
        idx[:, :, 0] = T - 1  # the last key is in the future of every query but the last one
        hf_mask = torch.ones(S, T, dtype=torch.bool).tril(T - S)[None, None]
    out = sa.absorbed_mla_attention_reference(q, latent, rope, weight, idx, mask, 0.3, NOPE, mask_kind == "causal")
    expected = _hf_latent_attention(q, latent, rope, weight, idx, hf_mask, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if mask_kind == "padding":
        assert out[1, :, 0].abs().max() == 0


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_absorbed_empty_rows_see_all_keys_like_a_finite_bias(path):
    """cuDNN SDPA turns HF's bool mask into a finite bias (-65536): a row whose selected keys are all masked is
    shifted alike everywhere and attends over all T keys. Rows with keys are unaffected."""
    B, S, T = 2, 2, 48
    dtype = torch.float32 if path == "reference" else HALF
    q, latent, rope, weight, idx = _absorbed_inputs(B, 4, S, T, 8, dtype)
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool, device=q.device)
    mask[1, ..., :40] = False
    idx[1, 1] = torch.arange(8)  # batch 1, query 1: every selected key is masked
    args = (q, latent, rope, weight, idx, mask, 0.2, NOPE, False, True)
    if path == "reference":
        out = sa.absorbed_mla_attention_reference(*args)
    else:
        out = sa.absorbed_mla_attention_triton(*args)
    f32 = [t.cpu().float() for t in (q, latent, rope, weight)]
    finite_bias = torch.zeros(B, 1, S, T).masked_fill(
        ~(mask.cpu() & ~torch.ones(B, S, T, dtype=torch.bool).scatter(-1, idx.cpu().long(), False)[:, None]), -65536.0)
    B_, H_ = q.shape[:2]
    kv = F.linear(f32[1], f32[3]).view(B_, T, H_, NOPE + VDIM).transpose(1, 2)
    k = torch.cat([kv[..., :NOPE], f32[2].expand(-1, H_, -1, -1)], dim=-1)
    expected = F.scaled_dot_product_attention(f32[0], k, kv[..., NOPE:], attn_mask=finite_bias, scale=0.2)
    # score - 65536 keeps scores only to 2^-7 in fp32; the op uses the scores themselves.
    assert _rel_err(out.cpu().float(), expected) <= 3e-3
    no_bias_rows = out[0].cpu().float(), expected[0]
    assert _rel_err(*no_bias_rows) <= (1e-5 if path == "reference" else 3e-3)


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_absorbed_repeated_largest_key_still_counts(path):
    """Key selection sorts each row and reads "has a key" from its largest entry: a row whose largest key (or
    only key) repeats still has that key, once, and must not come out as a keyless row of zeros."""
    B, S, T = 2, 2, 24
    dtype = torch.float32 if path == "reference" else HALF
    q, latent, rope, weight, idx = _absorbed_inputs(B, 2, S, T, 6, dtype)
    idx[0, 0] = 7  # a single key, selected six times
    idx[1, 1] = torch.tensor([T - 1, 3, T - 1, 5, 8, T - 1])
    absorbed = sa.absorbed_mla_attention_reference if path == "reference" else sa.absorbed_mla_attention_triton
    out = absorbed(q, latent, rope, weight, idx, None, 0.3, NOPE).cpu().float()
    expected = _hf_latent_attention(*(t.cpu().float() for t in (q, latent, rope, weight)), idx.cpu(), None, 0.3)
    assert _rel_err(out, expected) <= (1e-5 if path == "reference" else 2e-3)
    assert out[0, :, 0].abs().amin() > 0


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_absorbed_top_k_indices_skip_the_repeat_search(path):
    """`indices_distinct` (a top-k's indices) takes the selection without sorting: the same result on rows without
    repeats, with a padding mask that leaves one row keyless and the finite-bias rows that then see all keys."""
    B, S, T = 2, 3, 40
    dtype = torch.float32 if path == "reference" else HALF
    q, latent, rope, weight, idx = _absorbed_inputs(B, 2, S, T, 7, dtype)
    idx[1] = torch.stack([torch.arange(7), torch.arange(10, 17).flip(0), torch.arange(20, 27)]).to(idx)
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool, device=idx.device)
    mask[1, ..., 1:] = False  # row (1, 0) keeps key 0, rows (1, 1) and (1, 2) none
    absorbed = sa.absorbed_mla_attention_reference if path == "reference" else sa.absorbed_mla_attention_triton
    for see_all in (False, True):
        args = (q, latent, rope, weight, idx, mask, 0.3, NOPE, False, see_all)
        sorted_out, direct = absorbed(*args), absorbed(*args, True)
        torch.testing.assert_close(direct, sorted_out, rtol=1e-5, atol=1e-6)  # keys in another order
        assert (direct[1, :, 1:].abs().amax() > 0) == see_all


@pytest.mark.parametrize("mask_kind,causal,idx_dtype,K", [
    ("none", False, torch.int64, 7), ("padding", False, torch.int32, 7), ("per_query", True, torch.int64, 7),
    ("padding", True, torch.int32, 1500)])
def test_top_k_key_selection_in_one_launch_is_the_torch_ops(mask_kind, causal, idx_dtype, K):
    """The key selection of top-k indices (`_distinct_allowed_keys_triton`, one launch a call) keeps what the torch
    ops keep: indices in [0, T) that the mask (broadcast over batch or queries) and the causal bound allow, the rest
    -1, and names the rows left without a key; rows longer than one block of the kernel included."""
    B, S, T = 2, 3, 2000
    g = torch.Generator().manual_seed(K)
    idx = torch.stack([torch.stack([torch.randperm(T + 8, generator=g)[:K] - 4 for _ in range(S)]) for _ in range(B)])
    idx[0, 1] = -1  # a row of no index at all
    mask = None
    if mask_kind == "padding":
        mask = torch.rand(B, 1, 1, T, generator=g) < 0.7
        mask[1, ..., :] = False
        mask[1, ..., 5] = True  # row (1, s) keeps index 5 at most
    if mask_kind == "per_query":
        mask = torch.rand(1, 1, S, T, generator=g) < 0.5
    idx, mask = idx.to(DEVICE, idx_dtype), None if mask is None else mask.to(DEVICE)
    keys, no_key = sa._distinct_allowed_keys_triton(idx, mask, T, causal, indices_distinct=True)
    want_keys, want_no_key = sa._distinct_allowed_keys(idx, mask, T, causal, indices_distinct=True)
    assert keys.dtype == want_keys.dtype == torch.int32 and no_key.dtype == torch.bool
    assert torch.equal(keys, want_keys) and torch.equal(no_key, want_no_key)
    assert no_key[0, 1] and (keys >= 0).any() and (keys == -1).any()


def test_absorbed_bf16_error_is_hf_bf16_error():
    """The absorbed form rounds the absorbed query and the latent output where HF rounds the expanded K
    and V: one rounding each, so its bf16 error against fp32 matches HF's own bf16 error."""
    q, latent, rope, weight, idx = _absorbed_inputs(2, 8, 1, 300, 64, torch.float32, device="cpu")
    expected = _hf_latent_attention(q, latent, rope, weight, idx, None, 0.2)
    half = [t.bfloat16() for t in (q, latent, rope, weight)]
    hf_err = _rel_err(_hf_latent_attention(*half, idx, None, 0.2).float(), expected)
    absorbed_err = _rel_err(sa.absorbed_mla_attention_reference(*half, idx, None, 0.2, NOPE).float(), expected)
    assert absorbed_err <= 1.5 * hf_err, (absorbed_err, hf_err)


def test_absorbed_kernel_path_half_precision():
    q, latent, rope, weight, idx = _absorbed_inputs(2, 4, 1, 64, 16, HALF)
    out = sa.absorbed_mla_attention_triton(q, latent, rope, weight, idx, None, 0.2, NOPE)
    ref = sa.absorbed_mla_attention_reference(*(t.cpu() for t in (q, latent, rope, weight, idx)), None, 0.2, NOPE)
    hf = _hf_latent_attention(*(t.cpu().float() for t in (q, latent, rope, weight)), idx.cpu(), None, 0.2)
    assert _rel_err(out.cpu(), ref) <= 2e-3
    assert _rel_err(ref, hf) <= 2e-3


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_absorbed_fp8_kv_b_is_its_exact_values_dequantised_once(scale_fmt):
    """A released checkpoint's e4m3 kv_b_proj with its block scales (blocks that do not divide the weight): the op
    equals itself on the weight's exact values rounded once to q's dtype, and its kernel path dequantises the
    weight on the first call only."""
    q, latent, rope, weight, idx = _absorbed_inputs(2, 4, 1, 40, 8, HALF)
    fp8, scales = quantize_fp8_weight(weight.cpu().float(), block=24, scale_fmt=scale_fmt)
    fp8, scales = fp8.to(q.device), scales.to(q.device)
    exact = dequantize_fp8_blocks(fp8, scales, 24, 24).to(HALF)
    args = (q, latent, rope)
    fp8_args = (idx, None, 0.3, NOPE, False, False, False, scales, 24, 24)
    want = sa.absorbed_mla_attention_reference(*(t.cpu() for t in (*args, exact, idx)), None, 0.3, NOPE)
    assert torch.equal(sa.absorbed_mla_attention_reference(*(t.cpu() for t in args), fp8.cpu(), idx.cpu(), None, 0.3,
                                                           NOPE, False, False, False, scales.cpu(), 24, 24), want)
    calls = []
    real = sa.dequantized_once
    sa.dequantized_once = lambda *a: calls.append(a) or real(*a)
    try:
        got = [sa.absorbed_mla_attention_triton(*args, fp8, *fp8_args) for _ in range(2)]
    finally:
        sa.dequantized_once = real
    kernel = sa.absorbed_mla_attention_triton(*args, exact, idx, None, 0.3, NOPE)
    assert torch.equal(got[0], kernel) and torch.equal(got[1], kernel) and len(calls) == 2
    assert real(fp8, scales, 24, 24, HALF) is real(fp8, scales, 24, 24, HALF)
    op = torch.ops.dsfuse.absorbed_mla_attention.default
    cpu = [t.cpu() for t in (*args, fp8)]
    fp8_call = (*cpu, idx.cpu(), None, 0.3, NOPE, False, False, False, scales.cpu(), 24, 24)
    # opcheck's schema test compares inputs with an op CPU lacks for float8; the fake-against-real check stands in.
    torch.library.opcheck(op, fp8_call, test_utils=("test_faketensor", "test_autograd_registration",
                                                    "test_aot_dispatch_dynamic"))
    check_outputs_match_fake("dsfuse::absorbed_mla_attention", fp8_call, {}, op(*fp8_call))
    with pytest.raises(ValueError, match="kv_b_scale must be"):
        op(*cpu, idx.cpu(), None, 0.3, NOPE, False, False, False, scales.cpu()[:1], 24, 24)
    with pytest.raises(TypeError, match="kv_b_weight must be a 2-D"):
        op(*cpu[:3], exact.cpu(), idx.cpu(), None, 0.3, NOPE, False, False, False, scales.cpu(), 24, 24)


def test_absorbed_op_opcheck_and_bad_inputs():
    q, latent, rope, weight, idx = _absorbed_inputs(1, 2, 1, 20, 4, torch.float32, device="cpu")
    mask = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    op = torch.ops.dsfuse.absorbed_mla_attention.default
    torch.library.opcheck(op, (q, latent, rope, weight, idx, mask, 0.25, NOPE))
    torch.library.opcheck(op, (q, latent, rope, weight, idx, None, 0.25, NOPE))
    with pytest.raises(ValueError, match="attn_mask"):
        op(q, latent, rope, weight, idx, torch.ones(1, 2, 1, 20, dtype=torch.bool), 0.25, NOPE)
    with pytest.raises(ValueError, match="kv_b_weight"):
        op(q, latent, rope, weight[:-1], idx, None, 0.25, NOPE)
    with pytest.raises(TypeError, match="dtype"):
        op(q, latent.double(), rope, weight, idx, None, 0.25, NOPE)
    with pytest.raises(IndexError, match="outside"):
        op(q, latent, rope, weight, idx + 20, None, 0.25, NOPE)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_mla_gpu_bf16_real_head_dims_and_cuda_graph():
    q_nope, q_pe, kv, pe, idx, sink = _mla_inputs(2, 8, 128, 512, 64, 3000, 300, torch.bfloat16, device="cuda")
    idx[:, :, ::7] = -1
    for s in (None, sink):
        out = torch.ops.dsfuse.sparse_mla_attention(q_nope, q_pe, kv, pe, idx, 0.04, s)
        ref = sa.sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, 0.04, s)
        assert _rel_err(out, ref) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dsfuse.sparse_mla_attention(q_nope, q_pe, kv, pe, idx, 0.04, sink)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, out)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["causal_flag", "bool", "additive", "bool_empty_rows_see_all"])
def test_masked_gpu_bf16_real_head_dims_and_cuda_graph(mask_kind):
    """Each mask form, and the finite-bias semantics (`empty_rows_see_all`: the FP8 checkpoints' decode), within
    bf16 rounding of the reference, captured in a CUDA graph (no host copy or sync inside) and replayed."""
    B, H, S, T = 1, 4, 300, 300
    q, k, v, idx = _masked_inputs(B, H, S, T, 192, 128, 64, torch.bfloat16, device="cuda")
    causal = mask_kind == "causal_flag"
    see_all = mask_kind == "bool_empty_rows_see_all"
    mask = None if causal else _causal_bool(B, S, T, device="cuda")
    if mask_kind == "additive":
        mask = torch.zeros(B, 1, S, T, dtype=torch.bfloat16, device="cuda").masked_fill(
            ~mask, torch.finfo(torch.bfloat16).min)
    out = torch.ops.dsfuse.sparse_attention_masked(q, k, v, idx, mask, 192 ** -0.5, causal, see_all)
    ref = sa.sparse_attention_masked_reference(q, k, v, idx, mask, 192 ** -0.5, causal, see_all)
    assert _rel_err(out, ref) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dsfuse.sparse_attention_masked(q, k, v, idx, mask, 192 ** -0.5, causal, see_all)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, out)


@pytest.mark.gpu
def test_absorbed_gpu_fp8_kv_b_under_cuda_graph_trees():
    """The FP8 kv_b_proj dequantised once, in a graph compiled with CUDA-graph trees: the kept copy, made during the
    trees' warmup, lives outside their memory pool (their pool check passes) and the replays read it."""
    B, H, T, K, C = 2, 16, 600, 64, 512
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 1, 192, generator=g).to("cuda", torch.bfloat16)
    latent = torch.randn(B, 1, T, C, generator=g).to("cuda", torch.bfloat16)
    rope = torch.randn(B, 1, T, 64, generator=g).to("cuda", torch.bfloat16)
    fp8, scales = (t.cuda() for t in quantize_fp8_weight(torch.randn(H * 256, C, generator=g) / C**0.5,
                                                           scale_fmt="ue8m0"))
    idx = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B)])[:, None].to("cuda", torch.int32)

    def step(q):
        return torch.ops.dsfuse.absorbed_mla_attention(q, latent, rope, fp8, idx, None, 192**-0.5, 128, False, False,
                                                       True, scales, 128, 128)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    exact = dequantize_fp8_blocks(fp8, scales, 128, 128).to(torch.bfloat16)
    for seed in range(4):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q))
        want = sa.absorbed_mla_attention_triton(q, latent, rope, exact, idx, None, 192**-0.5, 128, False, False, True)
        torch.testing.assert_close(compiled(q).clone(), want, rtol=0, atol=0)


@pytest.mark.gpu
def test_absorbed_gpu_bf16_real_dims_and_cuda_graph():
    B, H, T, K, C = 2, 128, 3000, 512, 512
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, 1, 192, generator=g).to("cuda", torch.bfloat16)
    latent = torch.randn(B, 1, T, C, generator=g).to("cuda", torch.bfloat16)
    rope = torch.randn(B, 1, T, 64, generator=g).to("cuda", torch.bfloat16)
    weight = (torch.randn(H * 256, C, generator=g) / C**0.5).to("cuda", torch.bfloat16)
    idx = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B)])[:, None].to("cuda", torch.int32)
    out = torch.ops.dsfuse.absorbed_mla_attention(q, latent, rope, weight, idx, None, 192**-0.5, 128)
    ref = sa.absorbed_mla_attention_reference(q, latent, rope, weight, idx, None, 192**-0.5, 128)
    assert _rel_err(out, ref) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dsfuse.absorbed_mla_attention(q, latent, rope, weight, idx, None, 192**-0.5, 128)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, out)
