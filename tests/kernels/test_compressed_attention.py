"""`dsfuse::compressed_attention`: the reference against HF V4's own eager attention, and the op's contract."""

import pytest
import sm90_offline
import torch

from dsfuse.kernels.compressed_attention import (
    compressed_attention_reference,
    compressed_attention_triton,
    inverse_rope_reference,
)

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402


class _Module(torch.nn.Module):
    def __init__(self, sinks):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.num_key_value_groups = sinks.shape[0]


def _hf_attention(q, kv, compressed, visible_bias, sinks, scale):
    """HF's eager attention on [B, H, S, D] queries over cat(kv, compressed) with an additive bias."""
    keys = kv if compressed is None else torch.cat([kv, compressed], dim=1)
    out, _ = hf_v4.eager_attention_forward(_Module(sinks), q.transpose(1, 2), keys.unsqueeze(1), keys.unsqueeze(1),
                                           visible_bias, scaling=scale)
    return out


def _inputs(B, S, H, D, T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    kv = torch.randn(B, S, D, generator=g).to(dtype)
    compressed = torch.randn(B, T, D, generator=g).to(dtype) if T else None
    sinks = torch.randn(H, generator=g)
    return q, kv, compressed, sinks


def _sliding_bias(q_pos, kv_pos, window, dtype):
    delta = q_pos.unsqueeze(-1) - kv_pos.unsqueeze(1)
    ok = (kv_pos.unsqueeze(1) >= 0) & (delta >= 0) & (delta < window)
    return torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min).unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_reference_equals_hf_eager_attention(dtype, kind):
    B, S, H, D, W, rate = 2, 23, 3, 16, 5, 4
    T = S // rate if kind != "sliding" else 0
    q, kv, compressed, sinks = _inputs(B, S, H, D, T, dtype)
    q_pos = torch.arange(S).expand(B, S).clone()
    kv_pos = q_pos.clone()
    kv_pos[1, :3] = -1  # left padding of the second row's keys
    bias = _sliding_bias(q_pos, kv_pos, W, dtype)
    indices = None
    if kind == "csa":
        g = torch.Generator().manual_seed(1)
        threshold = (q_pos + 1) // rate
        indices = torch.stack([torch.randperm(T, generator=g)[:3] for _ in range(B * S)]).view(B, S, 3)
        indices = torch.where(indices >= threshold.unsqueeze(-1), -1, indices)
        block = torch.full((B, 1, S, T + 1), float("-inf"))
        block.scatter_(-1, torch.where(indices >= 0, indices, T).unsqueeze(1), 0.0)
        bias = torch.cat([bias, block[..., :T].to(dtype)], dim=-1)
    elif kind == "hca":
        future = torch.arange(T).view(1, 1, -1) >= ((q_pos + 1) // rate).unsqueeze(-1)
        bias = torch.cat([bias, torch.zeros(B, 1, S, T).masked_fill(future.unsqueeze(1), float("-inf")).to(dtype)], -1)
    want = _hf_attention(q, kv, compressed, bias, sinks, D ** -0.5)
    got = compressed_attention_reference(q, kv, q_pos, kv_pos, compressed, indices, sinks, D ** -0.5, W, rate)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _window_mask(B, S, N, W, seed=8):
    """Rows each query sees, as generate's masks give them (a causal window over [N - S cache rows | S new rows],
    the second sequence's first 3 rows padding), then some rows flipped at random: any pattern is allowed."""
    query_rows = torch.arange(N - S, N).view(1, S, 1)
    delta = query_rows - torch.arange(N).view(1, 1, N)
    seen = ((delta >= 0) & (delta < W)).expand(B, S, N).clone()
    seen[1, :, :3] = False
    g = torch.Generator().manual_seed(seed)
    seen ^= torch.rand(B, S, N, generator=g) < 0.1
    seen[0, 2] = False  # a query that sees no window row
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_reference_with_a_window_mask_equals_hf_with_its_additive_mask(dtype, kind):
    """A 0 / finfo.min additive mask over the window rows (what generate hands a prefill chunk) gives HF's
    probabilities exactly as leaving the masked rows out, whatever its pattern."""
    B, S, N, H, D, W, rate = 2, 9, 14, 3, 16, 4, 4
    T = N // rate
    q, kv, compressed, sinks = _inputs(B, N, H, D, T, dtype)
    q = q[:, :S]
    seen = _window_mask(B, S, N, W)
    q_pos = torch.arange(N - S, N).expand(B, S).clone()
    q_pos[1] -= 3  # the padded sequence's positions
    additive = torch.zeros(B, 1, S, N, dtype=dtype).masked_fill(~seen.unsqueeze(1), torch.finfo(dtype).min)
    indices = None
    if kind == "csa":
        indices = _picks(B, S, T, 3, rate)
        block = torch.full((B, 1, S, T + 1), float("-inf"))
        block.scatter_(-1, torch.where(indices >= 0, indices, T).unsqueeze(1), 0.0)
        block = block[..., :T]
    else:
        future = torch.arange(T).view(1, 1, -1) >= ((q_pos + 1) // rate).unsqueeze(-1)
        block = torch.zeros(B, 1, S, T).masked_fill(future.unsqueeze(1), float("-inf"))
    want = _hf_attention(q, kv, compressed, torch.cat([additive, block.to(dtype)], -1), sinks, D ** -0.5)
    zeros = torch.zeros(B, N, dtype=torch.long)
    got = compressed_attention_reference(q, kv, q_pos, zeros, compressed, indices, sinks, D ** -0.5, 1, rate,
                                         window_mask=seen)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inverse_rope_equals_hf_conjugate_rotation():
    x = torch.randn(2, 7, 3, 16).to(torch.bfloat16)
    cos, sin = torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    want = hf_v4.apply_rotary_pos_emb(x.transpose(1, 2), cos, -sin).transpose(1, 2)
    torch.testing.assert_close(inverse_rope_reference(x, cos, sin), want, rtol=0, atol=0)


def test_fully_masked_rows_give_zero_and_op_checks_its_inputs():
    q, kv, compressed, sinks = _inputs(1, 4, 2, 8, 2, torch.float32)
    q_pos = torch.arange(4).view(1, 4)
    kv_pos = torch.full((1, 4), -1)
    # no window key is valid and no compressed entry is complete yet ((3 + 1) // 8 = 0)
    out = torch.ops.dsfuse.compressed_attention(q, kv, q_pos, kv_pos, compressed, None, sinks, 0.3, 4, 8, None, None)
    assert torch.equal(out, torch.zeros_like(out))
    bad = torch.full((1, 4, 2), 5)
    with pytest.raises(ValueError, match=r"indices must lie in \[-1, 2\)"):
        torch.ops.dsfuse.compressed_attention(q, kv, q_pos, q_pos, compressed, bad, sinks, 0.3, 4, 4, None, None)
    with pytest.raises(ValueError, match="sinks must be fp32"):
        torch.ops.dsfuse.compressed_attention(q, kv, q_pos, q_pos, None, None, sinks.half(), 0.3, 4, 4, None, None)


def test_opcheck():
    q, kv, compressed, sinks = _inputs(2, 6, 2, 8, 3, torch.float32)
    pos = torch.arange(6).expand(2, 6).contiguous()
    idx = torch.tensor([[[0, -1]] * 6] * 2)
    cos, sin = torch.randn(2, 6, 2), torch.randn(2, 6, 2)
    seen = torch.rand(2, 6, 6, generator=torch.Generator().manual_seed(0)) < 0.5
    for args in [(q, kv, pos, pos, compressed, idx, sinks, 0.3, 3, 2, cos, sin),
                 (q, kv, pos, pos, compressed, None, sinks, 0.3, 3, 2, None, None),
                 (q, kv, pos, pos, None, None, sinks, 0.3, 3, 2, None, None),
                 (q, kv, pos, pos, compressed, idx, sinks, 0.3, 1, 2, cos, sin, seen)]:
        torch.library.opcheck(torch.ops.dsfuse.compressed_attention.default, args)
    with pytest.raises(ValueError, match=r"window_mask must be bool \[B=2, S=6, N=6\]"):
        torch.ops.dsfuse.compressed_attention(q, kv, pos, pos, None, None, sinks, 0.3, 1, 2, None, None, seen[:1])


# --- the Triton path (CPU: Triton's interpreter with fp16 / fp32, as a bf16 tl.dot is wrong there) ---------


def _positions(B, S, pad=3):
    q_pos = torch.arange(S).expand(B, S).clone()
    kv_pos = q_pos.clone()
    if B > 1:
        kv_pos[1, :pad] = -1  # left padding of the second row's keys
    return q_pos, kv_pos


def _picks(B, S, T, k, rate, seed=1):
    """A top-k's picks: distinct entries, the not-yet-visible ones replaced by -1 (HF's indexer)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(max(T, k), generator=g)[:k] for _ in range(B * S)]).view(B, S, k)
    visible = (torch.arange(S) + 1) // rate
    return torch.where(idx >= visible.view(1, S, 1), -1, idx)


def _rope(B, S, R, seed=2):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(B, S, R, generator=g) * 6.3
    return angle.cos(), angle.sin()


# both CUDA code paths: the fused kernel, and the split scores / p.v kernels with D chunks narrower than the
# head dim (so the inverse RoPE runs in a chunk of its own or across two)
PATHS = {"fused": {"path": "fused"}, "split": {"path": "split", "d_chunk": 16}}


def _assert_matches(got, want):
    """fp32: up to summation order. fp16: the roundings HF makes are the kernel's, so all but a few elements are
    bit-equal (the kernel's q.k and softmax sum run in another order and can flip a rounding by one ulp)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        assert (got == want).float().mean() > 0.98


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_triton_matches_reference(kind, path):
    B, S, H, D, rate = 2, 23, 3, 32, 4  # S not a multiple of the rate
    W = 20 if kind == "sliding" else 5  # sliding: window rows over two 16-key tiles
    T = S // rate if kind != "sliding" else 0
    q, kv, compressed, sinks = _inputs(B, S, H, D, T, torch.float16)
    q = torch.cat([q, q], dim=-1)[..., :D]  # non-contiguous: head stride 2 * D
    assert not q.is_contiguous()
    q_pos, kv_pos = _positions(B, S)
    indices = _picks(B, S, T, 3, rate) if kind == "csa" else None
    cos, sin = _rope(B, S, 4) if kind != "sliding" else (None, None)
    args = (q, kv, q_pos, kv_pos, compressed, indices, sinks, D ** -0.5, W, rate, cos, sin)
    got = compressed_attention_triton(*args, block_n=16, **PATHS[path])
    _assert_matches(got, compressed_attention_reference(*args))


@pytest.mark.parametrize("path", PATHS)
def test_triton_fp32_csa_with_rope_head_blocks_recomputed_logits_and_checked_positions(path):
    B, S, H, D, rate = 1, 19, 20, 16, 2
    T = S // rate
    q, kv, compressed, sinks = _inputs(B, S, H, D, T, torch.float32, seed=3)
    q_pos, kv_pos = _positions(B, S)
    indices = _picks(B, S, T, 6, rate)
    cos, sin = _rope(B, S, 2)
    args = (q, kv, q_pos, kv_pos, compressed, indices, sinks, D ** -0.5, 6, rate, cos, sin)
    want = compressed_attention_reference(*args)
    _assert_matches(compressed_attention_triton(*args, block_h=16, block_n=16, **PATHS[path]), want)
    _assert_matches(compressed_attention_triton(*args, block_h=16, block_n=16, store_logits=False,
                                                check_positions=True, **PATHS[path]), want)
    _assert_matches(compressed_attention_triton(*args, block_h=8, block_n=16, **PATHS[path]), want)


@pytest.mark.parametrize("path", PATHS)
def test_triton_sequence_shorter_than_window_and_untrusted_indices(path):
    B, S, H, D, rate = 1, 3, 2, 16, 2
    q, kv, compressed, sinks = _inputs(B, S, H, D, 1, torch.float16, seed=4)
    q_pos, kv_pos = _positions(B, S)
    hca = (q, kv, q_pos, kv_pos, compressed, None, sinks, 0.25, 8, rate, None, None)
    _assert_matches(compressed_attention_triton(*hca, **PATHS[path]), compressed_attention_reference(*hca))
    wild = torch.tensor([[[0, 7, -5], [-1, 0, 1], [3, 0, -1]]])  # picks outside [0, T) read nothing
    tame = torch.where((wild >= 0) & (wild < 1), wild, -1)
    got = compressed_attention_triton(q, kv, q_pos, kv_pos, compressed, wild, sinks, 0.25, 8, rate, None, None,
                                      **PATHS[path])
    want = compressed_attention_reference(q, kv, q_pos, kv_pos, compressed, tame, sinks, 0.25, 8, rate, None, None)
    _assert_matches(got, want)


@pytest.mark.parametrize("path", PATHS)
def test_triton_fully_masked_rows_give_zero(path):
    q, kv, compressed, sinks = _inputs(1, 4, 2, 16, 2, torch.float16, seed=5)
    q_pos = torch.arange(4).view(1, 4)
    kv_pos = torch.full((1, 4), -1)
    out = compressed_attention_triton(q, kv, q_pos, kv_pos, compressed, None, sinks, 0.3, 4, 8, None, None,
                                      **PATHS[path])
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_split_path_gives_the_fused_paths_bits(kind):
    """The split kernels make the fused kernel's roundings in its order (logits, max and sum over the same key
    tiles, the same exp and division, p @ v over the same tiles), so at equal block_n every output bit agrees:
    D chunks of 16 and 32 (the 40 rotated dims of D=64 span several), probabilities normalised in the scores
    kernel, in their own kernel or in the values kernel."""
    B, S, H, D, W, rate = 1, 8, 3, 64, 5, 2
    T = S // rate
    q, kv, compressed, sinks = _inputs(B, S, H, D, T, torch.float16, seed=6)
    q_pos, kv_pos = _positions(B, S)
    indices = _picks(B, S, T, 4, rate) if kind == "csa" else None
    cos, sin = _rope(B, S, 20)
    args = (q, kv, q_pos, kv_pos, compressed, indices, sinks, D ** -0.5, W, rate, cos, sin)
    fused = compressed_attention_triton(*args, block_n=16, path="fused")
    assert (fused == compressed_attention_reference(*args)).float().mean() > 0.98
    for d_chunk, normalize in ((16, "scores"), (32, "values"), (16, "separate"), (32, "separate")):
        split = compressed_attention_triton(*args, block_n=16, path="split", d_chunk=d_chunk, normalize=normalize)
        assert torch.equal(split, fused), (d_chunk, normalize)


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_triton_with_a_window_mask_matches_reference(kind):
    """Each query's span from its first to its last seen row, over more than one 16-row tile, tested row by row
    against the mask (rows flipped inside the span, a query with no row); either path asked for."""
    B, S, N, H, D, W, rate = 2, 9, 30, 3, 32, 20, 4
    T = N // rate if kind != "sliding" else 0
    q, kv, compressed, sinks = _inputs(B, N, H, D, T, torch.float16, seed=9)
    q = q[:, :S]
    seen = _window_mask(B, S, N, W)
    q_pos = torch.arange(N - S, N).expand(B, S).clone()
    indices = _picks(B, S, T, 3, rate) if kind == "csa" else None
    cos, sin = _rope(B, S, 4) if kind != "sliding" else (None, None)
    zeros = torch.zeros(B, N, dtype=torch.long)
    args = (q, kv, q_pos, zeros, compressed, indices, sinks, D ** -0.5, 1, rate, cos, sin, seen)
    want = compressed_attention_reference(*args)
    for path in PATHS.values():
        _assert_matches(compressed_attention_triton(*args, block_n=16, **path), want)


def test_triton_rejects_unknown_paths_chunks_and_normalisers():
    q, kv, compressed, sinks = _inputs(1, 4, 2, 16, 2, torch.float16, seed=5)
    pos = torch.arange(4).view(1, 4)
    args = (q, kv, pos, pos, compressed, None, sinks, 0.3, 4, 2, None, None)
    with pytest.raises(ValueError, match="path must be 'fused' or 'split'"):
        compressed_attention_triton(*args, path="fast")
    with pytest.raises(ValueError, match="d_chunk must be a power of two >= 16"):
        compressed_attention_triton(*args, path="split", d_chunk=48)
    with pytest.raises(ValueError, match="normalize must be 'scores', 'separate' or 'values'"):
        compressed_attention_triton(*args, path="split", normalize=True)


# --- the CUDA path at V4-Flash head shapes -------------------------------------------------------------------


def _cuda_case(kind, B=2, S=1024, H=64, D=512, W=128, seed=7):
    rate = {"sliding": 4, "csa": 4, "hca": 128}[kind]
    T = S // rate if kind != "sliding" else 0
    q, kv, compressed, sinks = (t.cuda() if t is not None else None for t in _inputs(B, S, H, D, T, torch.bfloat16,
                                                                                      seed))
    q_pos, kv_pos = (t.cuda() for t in _positions(B, S, pad=100))
    indices = _picks(B, S, T, 64, rate).cuda() if kind == "csa" else None
    cos, sin = (t.cuda() for t in _rope(B, S, 32))
    return (q, kv, q_pos, kv_pos, compressed, indices, sinks, D ** -0.5, W, rate, cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["fused", "split"])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_cuda_matches_reference_in_bf16(kind, path):
    """Same roundings as HF; the kernel's q.k and softmax sums run in another order than cuBLAS and PyTorch's
    softmax, so a rare logit or probability lands one bf16 ulp away and moves an output by about one ulp (H200,
    S=8192: 99.95 % of outputs bit-equal, max diff 0.0039).  Rounding the probabilities after normalising, as
    HF does, is what keeps the equal fraction high: an online softmax gets ~54 %."""
    args = _cuda_case(kind)
    got = compressed_attention_triton(*args, path=path)
    want = compressed_attention_reference(*args)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert (got == want).float().mean() > 0.95
    if path == "split":  # the op's default
        assert torch.equal(torch.ops.dsfuse.compressed_attention(*args), got)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cuda_window_mask_matches_reference_in_bf16_and_replays(kind):
    """A prefill chunk as generate hands it over: 512 queries after 127 cached rows, generate's causal window of 128
    over [cache | chunk] as the mask, padding on the second sequence; captured into a CUDA graph, replayed exactly."""
    q, kv, q_pos, kv_pos, compressed, indices, sinks, scale, W, rate, cos, sin = _cuda_case(kind, S=639)
    S, N = 512, 639
    q, q_pos, cos, sin = q[:, -S:], q_pos[:, -S:], cos[:, -S:], sin[:, -S:]
    if indices is not None:
        indices = indices[:, -S:]
    delta = torch.arange(N - S, N, device="cuda").view(1, S, 1) - torch.arange(N, device="cuda").view(1, 1, N)
    seen = ((delta >= 0) & (delta < W) & (kv_pos >= 0).unsqueeze(1))
    args = (q, kv, q_pos, torch.zeros_like(kv_pos), compressed, indices, sinks, scale, 1, rate, cos, sin, seen)
    got = torch.ops.dsfuse.compressed_attention(*args)
    want = compressed_attention_reference(*args)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert (got == want).float().mean() > 0.95
    # the same rows through positions: the window path's bits
    positional = compressed_attention_triton(q, kv, q_pos, kv_pos, compressed, indices, sinks, scale, W, rate, cos,
                                             sin, path="fused", store_logits=False)
    assert torch.equal(got, positional)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dsfuse.compressed_attention(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, got)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["fused", "split"])
def test_cuda_graph_replay_gives_the_eager_result(path):
    """No host sync and no data-dependent shape: the op captures into a CUDA graph and replays exactly."""
    args = _cuda_case("csa", B=1, S=512)
    eager = compressed_attention_triton(*args, path=path)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compressed_attention_triton(*args, path=path)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


# --- the Gluon scores kernel (Hopper only; no interpreter: compiled offline here, run on the GPU) ----------------


@pytest.mark.gpu
@pytest.mark.parametrize("block_n, stages", [(32, 3), (16, 4), (64, 2)])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_cuda_gluon_scores_give_the_triton_split_paths_bits(kind, block_n, stages):
    """The Gluon scores kernel makes the Triton scores kernel's roundings in its order (same MMA tile, same
    reductions), so the op's output is bit-equal to the Triton split path at equal block_n; padded heads (H=48),
    int64 picks and a second sequence with left padding included."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma: Hopper only")
    args = list(_cuda_case(kind, H=48))
    if args[5] is not None:
        args[5] = args[5].long()
    triton_split = compressed_attention_triton(*args, path="split", block_n=block_n, scores_kernel="triton")
    for normalize in ("separate", "scores", "values"):
        gluon_split = compressed_attention_triton(*args, path="split", block_n=block_n, scores_kernel="gluon",
                                                  scores_stages=stages, normalize=normalize)
        assert torch.equal(gluon_split, triton_split), normalize
    want = compressed_attention_reference(*args)
    assert (gluon_split == want).float().mean() > 0.95


@pytest.mark.gpu
def test_cuda_gluon_scores_replay_in_a_cuda_graph():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma: Hopper only")
    args = _cuda_case("csa", B=1, S=512)
    eager = compressed_attention_triton(*args, path="split", scores_kernel="gluon")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compressed_attention_triton(*args, path="split", scores_kernel="gluon")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_gluon_scores_are_refused_where_they_cannot_run():
    """Off Hopper (here: the CPU), a named scores_kernel='gluon' is an error that says what it needs, not a silent
    fallback; unknown kernels are rejected."""
    q, kv, compressed, sinks = _inputs(1, 4, 2, 64, 2, torch.float16, seed=5)
    pos = torch.arange(4).view(1, 4)
    args = (q, kv, pos, pos, compressed, None, sinks, 0.3, 4, 2, None, None)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        compressed_attention_triton(*args, path="split", scores_kernel="gluon")
    with pytest.raises(ValueError, match="scores_kernel must be 'auto', 'triton' or 'gluon'"):
        compressed_attention_triton(*args, path="split", scores_kernel="cuda")


_GLUON_PTX_PROBE = sm90_offline.PROBE_PREAMBLE + r"""
import re
from triton.experimental.gluon._runtime import GluonASTSource
from dsfuse.kernels import compressed_attention_gluon as g

kernel = g.attention_scores_gluon_kernel
names = list(kernel.arg_names)
found = {}
for mode, block_n, stages, idx, normalize in ((0, 32, 3, "*i32", True), (1, 32, 3, "*i64", True),
                                             (2, 16, 4, "*i32", False), (1, 64, 2, "*i32", True)):
    consts = dict(D=512, BLOCK_H=64, BLOCK_N=block_n, STAGES=stages, MODE=mode, K_SLOTS=512, WINDOW_SLOTS=128,
                  NORMALIZE=normalize, ACCURATE_EXP=True)
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "c_ptr": "*bf16", "logits_ptr": "*bf16", "idx_ptr": idx,
            "ranges_ptr": "*i32", "sink_ptr": "*fp32", "stats_ptr": "*fp32"}
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "scale" else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n.startswith("stride")}
    compiled = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    found[f"{mode}_{block_n}_{stages}"] = {
        "ops": sorted(set(re.findall(r"\b(?:wgmma\.mma_async|cp\.async)\.[a-z0-9.]*", ptx))),
        "shared": compiled.metadata.shared}
print(json.dumps(found))
"""


def test_gluon_scores_kernel_compiles_for_sm90_offline():
    """What the GPU runs, compiled here for sm_90 (no GPU needed): each key-source mode, int32 and int64 picks,
    three tile shapes, the probabilities normalised here or in the values kernel; gathers by cp.async 16 bytes at
    a time, the MMA as wgmma with the N of the tile, and shared memory that lets two programs share an SM at 32
    keys a tile (q in registers, 3 stages of 32 KiB)."""
    found = sm90_offline.run_probe(_GLUON_PTX_PROBE, timeout=600)[-1]
    for key, got in found.items():
        block_n = int(key.split("_")[1])
        assert "cp.async.cg.shared.global" in got["ops"], key
        assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16" in got["ops"], key
    assert found["1_32_3"]["shared"] <= 228 * 1024 // 2 - 1024, found["1_32_3"]
