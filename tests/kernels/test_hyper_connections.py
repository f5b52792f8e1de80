"""`dsfuse.hc_collapse`, `dsfuse.hc_head` and `dsfuse.hc_expand_mix`: the references against HF's modules bit for
bit, the Triton kernels (interpreter on CPU) against the references, opcheck, and bad input."""

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

from dsfuse.kernels.hyper_connections import (
    COLLAPSE_PATHS,
    hc_collapse,
    hc_collapse_reference,
    hc_collapse_triton,
    hc_expand_mix,
    hc_expand_mix_reference,
    hc_exit_collapse,
    hc_exit_collapse_reference,
    hc_exit_collapse_triton,
    hc_exit_head,
    hc_exit_head_reference,
    hc_exit_head_triton,
    hc_expand_mix_triton,
    hc_head,
    hc_head_reference,
    hc_head_triton,
    hc_project_triton,
    hc_weighted_sum_triton,
    mixes_count,
    split_projection_weights,
)

NORM_EPS, HC_EPS = 1e-6, 1e-6
# Small tiles per path, so the interpreter walks several chunks and their tails: D chunks of 16 (one pass); 16
# tokens x 32 columns of the flattened rows, and 4 x 16 weighted-sum tiles (two passes); splits of 32 columns in
# 16-wide tiles, the last split ragged, and 4 x 16 mix-and-sum tiles (split-K); the two-pass projection's K split
# three ways (the mixing after the partials).
SMALL_LAUNCH = {"one_pass": dict(path="one_pass", block_d=16),
                "two_pass": dict(path="two_pass", block_t=16, block_k=32, sum_block_t=4, sum_block_d=16),
                "split_k": dict(path="split_k", block_t=16, block_k=16, k_per_split=32, sum_block_t=4,
                                sum_block_d=16),
                "two_pass split": dict(path="two_pass", block_t=16, block_k=32, splits=3, sum_block_t=4,
                                       sum_block_d=16)}


def _streams(T, hc, hidden, dtype, seed=0):
    return torch.randn(T, hc, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _params(hc, hidden, head=False, seed=1):
    """fn, base, scale as HF initialises them in spirit: small projections, O(1) scales."""
    g = torch.Generator().manual_seed(seed)
    rows = hc if head else mixes_count(hc)
    fn = torch.randn(rows, hc * hidden, generator=g) * 0.05
    base = torch.randn(rows, generator=g) * 0.5
    scale = torch.rand(1 if head else 3, generator=g) + 0.5
    return fn, base, scale


def _hf_modules(hc, hidden, iters):
    config = DeepseekV4Config(hidden_size=hidden, hc_mult=hc, hc_sinkhorn_iters=iters, hc_eps=HC_EPS,
                              rms_norm_eps=NORM_EPS)
    return DeepseekV4HyperConnection(config), DeepseekV4HyperHead(config)


def _close(got, want):
    tol = 1e-5 if want.dtype == torch.float32 else {torch.bfloat16: 1e-2, torch.float16: 2e-3}[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("hc, iters, dtype", [(4, 20, torch.bfloat16), (2, 1, torch.float32), (4, 3, torch.float32)])
def test_references_equal_hf_modules_bit_for_bit(hc, iters, dtype):
    hidden = 24
    conn, head = _hf_modules(hc, hidden, iters)
    fn, base, scale = _params(hc, hidden)
    hfn, hbase, hscale = _params(hc, hidden, head=True)
    with torch.no_grad():
        for p, v in ((conn.fn, fn), (conn.base, base), (conn.scale, scale), (head.hc_fn, hfn), (head.hc_base, hbase),
                     (head.hc_scale, hscale)):
            p.copy_(v)
        x = _streams(5, hc, hidden, dtype)[None]  # [B=1, S=5, n, D], as the decoder layer holds them
        post, comb, collapsed = conn(x)
        got = hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, iters)
        assert torch.equal(got[0], collapsed) and torch.equal(got[1], post) and torch.equal(got[2], comb)
        assert torch.equal(hc_head_reference(x, hfn, hbase, hscale, NORM_EPS, HC_EPS), head(x))
        out = torch.randn(1, 5, hidden).to(dtype)
        hf_mix = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)
        assert torch.equal(hc_expand_mix_reference(out, x, post, comb), hf_mix)


@pytest.mark.parametrize("path", sorted(SMALL_LAUNCH))
@pytest.mark.parametrize("hc, iters, T, hidden, dtype", [
    (4, 20, 5, 64, torch.float32),
    (4, 1, 17, 32, torch.float32),
    (2, 20, 3, 40, torch.float32),   # hidden not a multiple of the chunk
    (2, 3, 1, 16, torch.float16),
    (4, 3, 7, 48, torch.bfloat16),
    (4, 2, 65, 37, torch.float16),   # odd hidden, more tokens than a row block
    (2, 4, 7, 21, torch.bfloat16),
])
def test_collapse_kernel_matches_reference(path, hc, iters, T, hidden, dtype):
    x = _streams(T, hc, hidden, dtype)
    fn, base, scale = _params(hc, hidden)
    want = hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, iters)
    got = hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, iters, **SMALL_LAUNCH[path])
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
    _close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    # Sinkhorn ends on a column step: every column of comb sums to 1 (up to eps).
    torch.testing.assert_close(got[2].sum(-2), torch.ones(T, hc), rtol=1e-4, atol=1e-4)


def _spelled_comb(x, fn, base, scale, iters):
    """comb as the fuzzer's spellings write it: exp(z) / sum(exp(z)) with no max, Sinkhorn steps c * (1 / (s + eps))."""
    hc = x.shape[-2]
    flat = x.flatten(-2).float()
    mixes = torch.nn.functional.linear(flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + NORM_EPS), fn)
    z = mixes[..., 2 * hc:].view(*x.shape[:-2], hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = torch.exp(z) / torch.exp(z).sum(-1, keepdim=True) + HC_EPS
    for dim in [-2] + [-1, -2] * (iters - 1):
        comb = comb * (1 / (comb.sum(dim, keepdim=True) + HC_EPS))
    return comb


def test_reference_roundings_follow_their_spellings_bit_for_bit():
    """`exp_sum_softmax` and `reciprocal_sinkhorn` compute comb as those spellings do, which rounds otherwise than
    HF's softmax and division."""
    x = _streams(9, 4, 24, torch.float32)
    fn, base, scale = _params(4, 24)
    flagged = hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, 3, exp_sum_softmax=True,
                                    reciprocal_sinkhorn=True)
    assert torch.equal(flagged[2], _spelled_comb(x, fn, base, scale, 3))
    assert not torch.equal(hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, 3)[2], flagged[2])


@pytest.mark.parametrize("path", sorted(SMALL_LAUNCH))
@pytest.mark.parametrize("exp_sum_softmax, reciprocal_sinkhorn", [(True, False), (False, True), (True, True)])
def test_collapse_kernel_roundings_match_reference(path, exp_sum_softmax, reciprocal_sinkhorn):
    x = _streams(7, 4, 32, torch.float32)
    fn, base, scale = _params(4, 32)
    flags = dict(exp_sum_softmax=exp_sum_softmax, reciprocal_sinkhorn=reciprocal_sinkhorn)
    want = hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, 3, **flags)
    got = hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, 3, **flags, **SMALL_LAUNCH[path])
    _close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", sorted(SMALL_LAUNCH))
def test_exp_sum_softmax_overflows_as_its_spelling_does(path):
    """No max subtracted: logits past exp's range give inf / inf = NaN in the spelling, so in the op (the default
    form stays finite): the flag reaches every path's kernel."""
    x = _streams(3, 4, 16, torch.float32)
    fn, base, scale = _params(4, 16)
    scale = torch.tensor([1.0, 1.0, 1e4])
    want = hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, 2, exp_sum_softmax=True)[2]
    got = hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, 2, exp_sum_softmax=True, **SMALL_LAUNCH[path])[2]
    default = hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, 2, **SMALL_LAUNCH[path])[2]
    assert want.isnan().any() and torch.equal(got.isnan(), want.isnan()) and default.isfinite().all()


@pytest.mark.parametrize("path", sorted(SMALL_LAUNCH))
@pytest.mark.parametrize("hc, T, hidden, dtype", [
    (4, 5, 64, torch.float32), (2, 9, 24, torch.bfloat16), (4, 65, 37, torch.float16), (2, 1, 21, torch.float32)])
def test_head_kernel_matches_reference(path, hc, T, hidden, dtype):
    x = _streams(T, hc, hidden, dtype)
    fn, base, scale = _params(hc, hidden, head=True)
    _close(hc_head_triton(x, fn, base, scale, NORM_EPS, HC_EPS, **SMALL_LAUNCH[path]),
           hc_head_reference(x, fn, base, scale, NORM_EPS, HC_EPS))


def test_split_projection_weights_are_exact():
    """fn = hi + mid + lo in bf16 pieces, exactly (summed in either order), hi fn rounded to nearest: over
    magnitudes from 2^-100 to 2^100, both signs, zeros and values already in bf16."""
    g = torch.Generator().manual_seed(5)
    magnitude = (1 + torch.rand(6, 1000, generator=g)) * torch.exp2(torch.randint(-100, 100, (6, 1000), generator=g))
    fn = torch.where(torch.rand(6, 1000, generator=g) < 0.5, -magnitude, magnitude)
    fn[0, :10] = 0.0
    fn[1, :10] = fn[1, :10].bfloat16().float()
    pieces = split_projection_weights(fn)
    assert pieces.dtype == torch.bfloat16 and pieces.shape == (3, 6, 1000)
    hi, mid, lo = pieces.float()
    assert torch.equal(pieces[0], fn.bfloat16())
    assert torch.equal(hi + mid + lo, fn) and torch.equal(hi + (mid + lo), fn)
    assert torch.equal(mid[1, :10], torch.zeros(10)) and torch.equal(lo[1, :10], torch.zeros(10))


@pytest.mark.parametrize("hc, T, hidden, dtype", [
    (4, 7, 37, torch.bfloat16), (2, 65, 24, torch.float16), (4, 1, 16, torch.float32)])
def test_weighted_sum_kernel_sums_in_stream_order_bit_for_bit(hc, T, hidden, dtype):
    """The two-pass collapse: fp32 products of pre and each stream, added in stream order, rounded once."""
    x = _streams(T, hc, hidden, dtype)
    pre = torch.rand(T, hc, generator=torch.Generator().manual_seed(2)) + 0.5
    total = torch.zeros(T, hidden)
    for j in range(hc):
        total = total + pre[:, j, None] * x[:, j].float()
    got = hc_weighted_sum_triton(x, pre, block_t=4, block_d=16)
    assert got.dtype == dtype and torch.equal(got, total.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_pass_projection_writes_the_mixing_weights(dtype):
    """pre / post / comb of the projection kernel against the reference's (pre is what the collapse weighs)."""
    hc, hidden, T, iters = 4, 40, 9, 6
    x = _streams(T, hc, hidden, dtype)
    fn, base, scale = _params(hc, hidden)
    pre, post, comb = hc_project_triton(x, fn, base, scale, NORM_EPS, HC_EPS, iters, block_t=16, block_k=64)
    flat = x.flatten(-2).float()
    mixes = (flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + NORM_EPS)) @ fn.T
    torch.testing.assert_close(pre, torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + HC_EPS, rtol=1e-5,
                               atol=1e-6)
    _, want_post, want_comb = hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, iters)
    torch.testing.assert_close(post, want_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, want_comb, rtol=1e-5, atol=1e-6)
    hfn, hbase, hscale = _params(hc, hidden, head=True)
    head_pre, none_post, none_comb = hc_project_triton(x, hfn, hbase, hscale, NORM_EPS, HC_EPS, 1, head=True)
    assert none_post is None and none_comb is None and head_pre.shape == (T, hc)


def test_default_path_is_split_k_below_split_k_max_tokens(monkeypatch):
    """Calls of fewer than SPLIT_K_MAX_TOKENS tokens (decode steps, short prompts) run split_k, larger ones
    COLLAPSE_PATH, an explicit path either; the fused exits stay one_pass."""
    from dsfuse.kernels import hyper_connections as hck

    ran = []
    for name, path in (("_split_k_collapse", "split_k"), ("hc_project_triton", "two_pass")):
        original = getattr(hck, name)
        monkeypatch.setattr(hck, name, lambda x, *a, _run=original, _path=path, **k: ran.append((_path, x.shape[0]))
                            or _run(x, *a, **k))
    params = _params(4, 8)
    limit = hck.SPLIT_K_MAX_TOKENS
    for T in (1, limit - 1, limit):
        hc_collapse_triton(_streams(T, 4, 8, torch.float32), *params, NORM_EPS, HC_EPS, 2)
    hc_collapse_triton(_streams(2, 4, 8, torch.float32), *params, NORM_EPS, HC_EPS, 2, path="two_pass")
    x = _streams(2, 4, 8, torch.float32)
    hc_exit_collapse_triton(x[:, 0], x, x[..., 0], x[..., :4], *params, NORM_EPS, HC_EPS, 2)
    assert hck.COLLAPSE_PATH == "two_pass"
    assert ran == [("split_k", 1), ("split_k", limit - 1), ("two_pass", limit), ("two_pass", 2)]


@pytest.mark.parametrize("call, match", [
    (lambda x, p: hc_collapse_triton(x, *p, 1e-6, 1e-6, 2, path="three_pass"), "path must be one of"),
    (lambda x, p: hc_collapse_triton(x, *p, 1e-6, 1e-6, 2, path="one_pass", block_k=64), "unknown launch"),
    (lambda x, p: hc_collapse_triton(x, *p, 1e-6, 1e-6, 2, path="two_pass", block_d=64), "unknown launch"),
    (lambda x, p: hc_exit_collapse_triton(x[:, 0], x, x[..., 0], x[..., :4], *p, 1e-6, 1e-6, 2, path="two_pass"),
     "one_pass only"),
    (lambda x, p: hc_weighted_sum_triton(x, x[..., 0].double()), "pre must be fp32"),
    (lambda x, p: hc_collapse_triton(x, *p, 1e-6, 1e-6, 2, path="split_k", block_k=32, k_per_split=48),
     "not a multiple of block_k"),
])
def test_bad_launch_raises(call, match):
    x = _streams(3, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=match):
        call(x, _params(4, 8))


@pytest.mark.parametrize("hc, T, hidden, dtype", [
    (4, 5, 64, torch.float32), (2, 9, 24, torch.bfloat16), (4, 3, 40, torch.bfloat16), (4, 2, 16, torch.float16)])
def test_expand_mix_kernel_matches_reference(hc, T, hidden, dtype):
    residual = _streams(T, hc, hidden, dtype)
    out = _streams(T, 1, hidden, dtype, seed=3)[:, 0]
    fn, base, scale = _params(hc, hidden)
    _, post, comb = hc_collapse_reference(residual, fn, base, scale, NORM_EPS, HC_EPS, 5)
    got = hc_expand_mix_triton(out, residual, post, comb, block_d=16)
    want = hc_expand_mix_reference(out, residual, post, comb)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the matmul's fp32 sum order may differ
    else:
        assert torch.equal(got, want), "every rounding is torch's: bit-exact in half precision"


@pytest.mark.parametrize("hc, iters, T, hidden, dtype", [
    (4, 20, 5, 64, torch.float32), (2, 1, 3, 40, torch.float32), (4, 3, 7, 48, torch.bfloat16)])
def test_exit_fused_with_the_next_collapse_matches_reference(hc, iters, T, hidden, dtype):
    residual = _streams(T, hc, hidden, dtype)
    out = _streams(T, 1, hidden, dtype, seed=3)[:, 0]
    fn, base, scale = _params(hc, hidden)
    _, post, comb = hc_collapse_reference(residual, *_params(hc, hidden, seed=4), NORM_EPS, HC_EPS, 4)
    want = hc_exit_collapse_reference(out, residual, post, comb, fn, base, scale, NORM_EPS, HC_EPS, iters)
    got = hc_exit_collapse_triton(out, residual, post, comb, fn, base, scale, NORM_EPS, HC_EPS, iters, block_d=16)
    if dtype != torch.float32:
        assert torch.equal(got[0], want[0])
    _close(got[0], want[0])
    _close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-6)
    hfn, hbase, hscale = _params(hc, hidden, head=True)
    want = hc_exit_head_reference(out, residual, post, comb, hfn, hbase, hscale, NORM_EPS, HC_EPS)
    _close(hc_exit_head_triton(out, residual, post, comb, hfn, hbase, hscale, NORM_EPS, HC_EPS, block_d=16), want)


@pytest.mark.parametrize("path", COLLAPSE_PATHS)
def test_leading_dims_empty_and_non_contiguous_inputs(path):
    hc, hidden = 4, 16
    fn, base, scale = _params(hc, hidden)
    x = _streams(6, hc, hidden, torch.float32).view(2, 3, hc, hidden)
    got = hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, 2, path=path)
    assert [tuple(t.shape) for t in got] == [(2, 3, hidden), (2, 3, hc), (2, 3, hc, hc)]
    _close(got[0], hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, 2)[0])
    empty = hc_collapse_triton(x[:, :0], fn, base, scale, NORM_EPS, HC_EPS, 2, path=path)
    assert [tuple(t.shape) for t in empty] == [(2, 0, hidden), (2, 0, hc), (2, 0, hc, hc)]
    strided = _streams(3, hc, 2 * hidden, torch.float32)[..., ::2]
    _close(hc_collapse_triton(strided, fn, base, scale, NORM_EPS, HC_EPS, 2, path=path)[0],
           hc_collapse_reference(strided, fn, base, scale, NORM_EPS, HC_EPS, 2)[0])


@pytest.mark.parametrize("path", COLLAPSE_PATHS)
def test_nan_propagates_like_the_reference(path):
    hc, hidden = 2, 16
    x = _streams(3, hc, hidden, torch.float32)
    x[1, 0, 3] = float("nan")
    fn, base, scale = _params(hc, hidden)
    got = hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, 3, path=path)
    want = hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, 3)
    for g, w in zip(got, want):
        assert torch.equal(g.isnan(), w.isnan())


def test_custom_ops_match_references_and_pass_opcheck():
    hc, hidden = 4, 16
    x = _streams(5, hc, hidden, torch.bfloat16)
    fn, base, scale = _params(hc, hidden)
    hfn, hbase, hscale = _params(hc, hidden, head=True)
    collapsed, post, comb = hc_collapse(x, fn, base, scale, NORM_EPS, HC_EPS, 4)
    assert torch.equal(collapsed, hc_collapse_reference(x, fn, base, scale, NORM_EPS, HC_EPS, 4)[0])
    out = torch.randn(5, hidden).to(torch.bfloat16)
    torch.library.opcheck(hc_collapse, (x, fn, base, scale, NORM_EPS, HC_EPS, 4))
    torch.library.opcheck(hc_head, (x, hfn, hbase, hscale, NORM_EPS, HC_EPS))
    torch.library.opcheck(hc_expand_mix, (out, x, post, comb))
    torch.library.opcheck(hc_exit_collapse, (out, x, post, comb, fn, base, scale, NORM_EPS, HC_EPS, 4))
    torch.library.opcheck(hc_exit_head, (out, x, post, comb, hfn, hbase, hscale, NORM_EPS, HC_EPS))


@pytest.mark.parametrize("call, match", [
    (lambda x, p: hc_collapse(x.int(), *p, 1e-6, 1e-6, 2), "bf16, fp16 or fp32"),
    (lambda x, p: hc_collapse(x[0], *p, 1e-6, 1e-6, 2), "3 or more dims"),
    (lambda x, p: hc_collapse(x, p[0][:, 1:], *p[1:], 1e-6, 1e-6, 2), "fn must have shape"),
    (lambda x, p: hc_collapse(x, p[0], p[1][:-1], p[2], 1e-6, 1e-6, 2), "base must have shape"),
    (lambda x, p: hc_collapse(x, *p, 1e-6, 1e-6, 0), "sinkhorn_iters must be >= 1"),
    (lambda x, p: hc_collapse(x, *p, -1.0, 1e-6, 2), "eps values must be >= 0"),
    (lambda x, p: hc_head(x, *p, 1e-6, 1e-6), "fn must have shape"),
    (lambda x, p: hc_expand_mix(x[:, 0].double(), x, x[..., 0], x[..., :4]), "out is torch.float64"),
    (lambda x, p: hc_expand_mix(x[:, 0], x, x[..., 0], x[..., :3]), "comb must have shape"),
    (lambda x, p: hc_exit_collapse(x[:, 0], x, x[..., 0], x[..., :4], *p, 1e-6, 1e-6, 0), "sinkhorn_iters"),
    (lambda x, p: hc_exit_head(x[:, 0], x, x[..., 0], x[..., :4], *p, 1e-6, 1e-6), "fn must have shape"),
])
def test_bad_input_raises(call, match):
    x = _streams(3, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=match):
        call(x, _params(4, 8))


def _gpu_collapse_and_head_match_references(T, hc, hidden, iters, dtype):
    """The ops on CUDA at their default launches against the CPU references: (x, collapse params, head params,
    the collapse's outputs)."""
    x = _streams(T, hc, hidden, dtype).cuda()
    fn, base, scale = (t.cuda() for t in _params(hc, hidden))
    hfn, hbase, hscale = (t.cuda() for t in _params(hc, hidden, head=True))
    got = hc_collapse(x, fn, base, scale, NORM_EPS, HC_EPS, iters)
    want = hc_collapse_reference(x.cpu(), fn.cpu(), base.cpu(), scale.cpu(), NORM_EPS, HC_EPS, iters)
    _close(got[0].cpu(), want[0])
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-4, atol=1e-5)
    _close(hc_head(x, hfn, hbase, hscale, NORM_EPS, HC_EPS).cpu(),
           hc_head_reference(x.cpu(), hfn.cpu(), hbase.cpu(), hscale.cpu(), NORM_EPS, HC_EPS))
    return x, (fn, base, scale), (hfn, hbase, hscale), got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernels_match_reference(dtype):
    hc, hidden, T, iters = 4, 512, 257, 20
    x, (fn, base, scale), (hfn, hbase, hscale), got = _gpu_collapse_and_head_match_references(T, hc, hidden, iters,
                                                                                             dtype)
    out = torch.randn(T, hidden, device="cuda").to(dtype)
    mixed = hc_expand_mix(out, x, got[1], got[2])
    eager = hc_expand_mix_reference(out, x, got[1], got[2])  # eager CUDA: cuBLAS bmm
    _close(mixed, eager)
    fused = hc_exit_collapse(out, x, got[1], got[2], fn, base, scale, NORM_EPS, HC_EPS, iters)
    assert torch.equal(fused[0], mixed), "the fused exit writes the same streams as the exit alone"
    alone = hc_collapse(mixed, fn, base, scale, NORM_EPS, HC_EPS, iters)
    # The fused form's projection sums all streams of a D chunk in one dot, the lone collapse one stream at a
    # time: the fp32 mixing weights differ in the last bits, so a rounded collapsed value may differ by an ulp.
    _close(fused[1], alone[0])
    for f, a in zip(fused[2:], alone[1:]):
        torch.testing.assert_close(f, a, rtol=1e-4, atol=1e-5)
    _close(hc_exit_head(out, x, got[1], got[2], hfn, hbase, hscale, NORM_EPS, HC_EPS),
           hc_head(mixed, hfn, hbase, hscale, NORM_EPS, HC_EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_two_pass_matches_reference_and_one_pass(dtype):
    """The two-pass path at its default launch (bf16: the split-weight bf16 MMA) against the reference, as tightly
    as the one-pass path, and its collapse against the one-pass collapse."""
    hc, hidden, T, iters = 4, 512, 257, 20
    x = _streams(T, hc, hidden, dtype).cuda()
    fn, base, scale = (t.cuda() for t in _params(hc, hidden))
    hfn, hbase, hscale = (t.cuda() for t in _params(hc, hidden, head=True))
    got = hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, iters, path="two_pass")
    want = hc_collapse_reference(x.cpu(), fn.cpu(), base.cpu(), scale.cpu(), NORM_EPS, HC_EPS, iters)
    _close(got[0].cpu(), want[0])
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-4, atol=1e-5)
    _close(got[0], hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, iters, path="one_pass")[0])
    _close(hc_head_triton(x, hfn, hbase, hscale, NORM_EPS, HC_EPS, path="two_pass").cpu(),
           hc_head_reference(x.cpu(), hfn.cpu(), hbase.cpu(), hscale.cpu(), NORM_EPS, HC_EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 8, 63])
def test_gpu_split_k_matches_reference(T, dtype):
    """The default path of decode-sized calls at its default launch, at V4's stream width (64 splits)."""
    _gpu_collapse_and_head_match_references(T, 4, 4096, 20, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("path, T", [("one_pass", 257), ("two_pass", 257), ("split_k", 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_collapse_roundings_match_reference(path, T, dtype):
    """`exp_sum_softmax` and `reciprocal_sinkhorn` on every path's CUDA kernels against the CPU reference."""
    hc, hidden, iters = 4, 512, 20
    x = _streams(T, hc, hidden, dtype).cuda()
    fn, base, scale = (t.cuda() for t in _params(hc, hidden))
    flags = dict(exp_sum_softmax=True, reciprocal_sinkhorn=True)
    got = hc_collapse_triton(x, fn, base, scale, NORM_EPS, HC_EPS, iters, path=path, **flags)
    want = hc_collapse_reference(x.cpu(), fn.cpu(), base.cpu(), scale.cpu(), NORM_EPS, HC_EPS, iters, **flags)
    _close(got[0].cpu(), want[0])
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-4, atol=1e-5)


_PTX_PROBE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from dsfuse.kernels import hyper_connections as hck

def ptx(kernel, consts, bf16_ptrs):
    names = list(kernel.arg_names)
    sig = {n: "constexpr" if n in consts else ("*bf16" if n in bf16_ptrs else "*fp32") if n.endswith("_ptr") else
           "fp32" if n in ("norm_eps", "hc_eps", "width") else "i32" for n in names}
    aligned = ("D", "K", "K_PER_SPLIT")  # Triton's launcher marks them so: multiples of 16 at V4's shapes
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*") or n in aligned}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": 4, **hck.COMPILE_OPTIONS}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

pattern = r"\b(?:wgmma\.mma_async|mma|div|bar|fma|cp\.async)\.[a-z0-9.]*"
def collapse_ptx(head, exit, store, block_d, ptrs, forms=False):
    consts = dict(N=4, NN=4, NP=16 if head else 32, HEAD=head, EXIT=exit, STORE=store, BLOCK_T=16, BLOCK_D=block_d,
                  PRECISION=hck.PROJECTION_PRECISION, MANUAL_BF16_RNE=False, EXP_SUM_SOFTMAX=forms,
                  RECIPROCAL_SINKHORN=forms)
    return ptx(hck._hc_collapse_kernel, consts, ptrs)

collapse = collapse_ptx(False, False, False, 128, ("x_ptr", "collapsed_ptr"))
fused = collapse_ptx(False, True, True, 64, ("x_ptr", "collapsed_ptr", "out_ptr", "res_ptr"))
fused_head = collapse_ptx(True, True, False, 64, ("x_ptr", "collapsed_ptr", "out_ptr", "res_ptr"))
collapse_forms = collapse_ptx(False, False, False, 128, ("x_ptr", "collapsed_ptr"), forms=True)
mix = ptx(hck._hc_expand_mix_kernel, dict(N=4, NN=4, BLOCK_T=8, BLOCK_D=256, MANUAL_BF16_RNE=False),
          ("out_ptr", "res_ptr", "new_ptr"))
def project_ptx(head, partial=False):
    launch = hck.default_collapse_launch(4096, "two_pass")
    consts = dict(N=4, NN=4, NP=16 if head else 32, HEAD=head, PIECES=3, FP32_DOT=False, PRECISION="ieee",
                  PARTIAL=partial, BLOCK_T=launch["block_t"], BLOCK_K=launch["block_k"], EXP_SUM_SOFTMAX=False,
                  RECIPROCAL_SINKHORN=False)
    return ptx(hck._hc_project_kernel, consts, ("x_ptr", "w_ptr"))
weighted = ptx(hck._hc_weighted_sum_kernel, dict(N=4, BLOCK_T=8, BLOCK_D=128, MANUAL_BF16_RNE=False),
               ("x_ptr", "collapsed_ptr"))
split = ptx(hck._hc_split_weights_kernel, dict(BLOCK=1024, MANUAL_BF16_RNE=False), ("pieces_ptr",))
mix_sum = ptx(hck._hc_mix_sum_kernel, dict(N=4, NN=4, NP=32, HEAD=False, BLOCK_T=8, BLOCK_D=128,
                                           MANUAL_BF16_RNE=False, EXP_SUM_SOFTMAX=False, RECIPROCAL_SINKHORN=False),
              ("x_ptr", "collapsed_ptr"))
print(json.dumps({name: sorted(set(re.findall(pattern, code))) for name, code in
                  (("collapse", collapse), ("collapse_forms", collapse_forms), ("fused", fused),
                   ("fused_head", fused_head), ("mix", mix),
                   ("project", project_ptx(False)), ("project_head", project_ptx(True)),
                   ("project_partial", project_ptx(False, partial=True)), ("weighted", weighted),
                   ("split", split), ("mix_sum", mix_sum))}))
"""


def test_sm90_ptx_uses_tensor_cores_true_divisions_and_no_fma():
    """Compiled offline for sm_90 (no GPU, interpreter off): the one-pass projection runs on tf32 tensor cores,
    the two-pass one of bf16 streams (default launch) on bf16 warpgroup MMAs fed by asynchronous copies,
    every division of the mixing weights is IEEE, the scratch is fenced by a barrier, and neither the exit, the
    weighted sum nor the weight split has an FMA."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _PTX_PROBE], env=env, capture_output=True, check=False, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for collapse in (found["collapse"], found["collapse_forms"], found["fused"], found["fused_head"]):
        assert any(op.startswith("mma.") and ".tf32" in op for op in collapse), collapse
        assert "div.rn.f32" in collapse and "bar.sync" in collapse and "div.full.f32" not in collapse, collapse
    for project in (found["project"], found["project_head"], found["project_partial"]):
        assert any(op.startswith("wgmma.mma_async") and op.endswith(".bf16.bf16") for op in project), project
        assert "cp.async.cg.shared.global" in project, project
    for project in (found["project"], found["project_head"], found["mix_sum"]):
        assert "div.rn.f32" in project and "bar.sync" in project and "div.full.f32" not in project, project
    for name in ("mix", "weighted", "split"):
        assert not [op for op in found[name] if op.startswith("fma")], found[name]
