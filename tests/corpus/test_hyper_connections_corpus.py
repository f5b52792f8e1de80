"""Spelling corpus for DeepSeek V4's manifold-constrained hyper-connections (`hyper_connections`): independent
formulations of the same math (and a few that only look like it), each with its declared outcome, compiled with
`backend="dsfuse"` on tiny CPU shapes. Every entry must end exactly as declared (the fused ops it was rewritten
into / reported near-miss with that reason / left alone) and agree with eager.

Each formulation is written after the code named in its `source`: transformers' `DeepseekV4HyperConnection`,
`DeepseekV4HyperHead` and `DeepseekV4DecoderLayer` (the modules themselves), the official DeepSeek V4 inference
model's `hc_pre` / `hc_post` (the norm's rsqrt applied after the projection, the mixes sliced, the exit as a
broadcast sum of fp32 products) and `hc_split_sinkhorn`'s torch reference, or an algebraic re-spelling.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

from harness import LEFT_ALONE, Formulation, MIN_REWRITTEN, NEAR_MISS, REWRITTEN, compile_entry

from dsfuse.models.presets import hf_config

B, S, N, D = 2, 3, 4, 16  # batch, tokens, hc_mult streams, hidden
T = B * S
ITERS = 3  # Sinkhorn iterations (the op takes the count; HF's default is 20)
NORM_EPS, HC_EPS = 1e-6, 1e-6
MIXES = (2 + N) * N


# --------------------------------------------------------------------------------------- shared pieces
def _params(seed=0, head=False):
    """(fn, base, scale) as HF keeps them (fp32), biases near 0.5 so that no sigmoid saturates."""
    g = torch.Generator().manual_seed(seed)
    rows = N if head else MIXES
    fn = torch.randn(rows, N * D, generator=g) * 0.1
    base = torch.randn(rows, generator=g) * 0.1 + 0.5
    scale = torch.randn(1 if head else 3, generator=g) * 0.1 + 0.5
    return fn, base, scale


def _hf_modules():
    config = hf_config("v4-tiny", hidden_size=D, hc_mult=N, hc_sinkhorn_iters=ITERS, rms_norm_eps=NORM_EPS,
                       hc_eps=HC_EPS)
    hc, head = DeepseekV4HyperConnection(config), DeepseekV4HyperHead(config)
    for module, params in ((hc, _params()), (head, _params(1, head=True))):
        for p, value in zip(module.parameters(), params, strict=True):
            p.data = value.clone()
    return hc, head


HF_HC, HF_HEAD = _hf_modules()
BLOCK_WEIGHT = torch.randn(D, D, generator=torch.Generator().manual_seed(2)) * 0.2


def _split(mixes, base, scale):
    """HF's pieces: (pre_w, post_w, comb_w [.., n, n]), (pre_b, post_b, comb_b [n, n]), scales."""
    pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = base.split([N, N, N * N])
    return (pre_w, post_w, comb_w.view(*comb_w.shape[:-1], N, N)), (pre_b, post_b, comb_b.view(N, N)), scale.unbind(0)


def _sinkhorn(comb, iters=ITERS, eps=HC_EPS):
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _hf_weights(mixes, base, scale):
    (pre_w, post_w, comb_w), (pre_b, post_b, comb_b), (pre_s, post_s, comb_s) = _split(mixes, base, scale)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + HC_EPS
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w * comb_s + comb_b, dim=-1) + HC_EPS
    return pre, post, _sinkhorn(comb)


def _hf_norm(flat):
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + NORM_EPS)


def _collapse(pre, x):
    return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)


def _hf_exit(post, comb, out, residual):
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)


# --------------------------------------------------------------------------------------- formulations
def hf_hyper_connection(x):
    """transformers `DeepseekV4HyperConnection` itself: (post, comb, collapsed)."""
    return HF_HC(x)


def hf_hyper_head(x):
    """transformers `DeepseekV4HyperHead` itself: the final collapse (n projection rows, one scale)."""
    return HF_HEAD(x)


def hf_decoder_block(x):
    """`DeepseekV4DecoderLayer.forward`'s pattern around one block: hyper-connection, the block on the collapsed
    stream, the exit `post.to(dtype) * out + comb.to(dtype)^T @ residual`, then the head."""
    post, comb, collapsed = HF_HC(x)
    return HF_HEAD(_hf_exit(post, comb, F.linear(collapsed, BLOCK_WEIGHT.to(x.dtype)), x))


def official_hc_pre(x, fn, base, scale):
    """DeepSeek V4 inference `Block.hc_pre`: the flattened streams in fp32, the norm's rsqrt applied to the
    projection's output (`F.linear(x, fn) * rsqrt`), `hc_split_sinkhorn` (torch reference: the mixes and the base
    sliced, `scale[i]` indexed), the collapse over the fp32 streams viewed back, then one cast."""
    shape, dtype = x.size(), x.dtype
    flat = x.flatten(2).float()
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + NORM_EPS)
    mixes = F.linear(flat, fn) * rsqrt
    pre = torch.sigmoid(mixes[..., :N] * scale[0] + base[:N]) + HC_EPS
    post = 2 * torch.sigmoid(mixes[..., N:2 * N] * scale[1] + base[N:2 * N])
    comb = (mixes[..., 2 * N:] * scale[2] + base[2 * N:]).view(*mixes.shape[:-1], N, N).softmax(-1) + HC_EPS
    comb = _sinkhorn(comb)
    y = torch.sum(pre.unsqueeze(-1) * flat.view(shape), dim=2)
    return y.to(dtype), post, comb


def official_hc_post(x, out):
    """HF's hyper-connection, then the official exit `hc_post`: `post * out + sum(comb[..., None] *
    residual[..., None, :], dim=2)` (comb^T @ residual as a broadcast sum) from the fp32 post and comb, one cast at
    the end: HF's numbers for fp32 streams, another rounding (HF casts post and comb first) for bf16 ones."""
    post, comb, collapsed = HF_HC(x)
    y = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * x.unsqueeze(-2), dim=2)
    return y.type_as(x), collapsed


def token_major_functional_norm(x, fn, base, scale):
    """Token-major streams [T, n, D] (no batch dim), `reshape`, `F.rms_norm` without a weight, `F.linear`."""
    flat = F.rms_norm(x.reshape(x.shape[0], -1).float(), (N * D,), eps=NORM_EPS)
    pre, post, comb = _hf_weights(F.linear(flat, fn), base, scale)
    return _collapse(pre, x), post, comb


def product_norm_commuted_affine(x, fn, base, scale):
    """The norm's square as `a * a` over a `view`, the projection as `flat @ fn.t()`, the affine maps written
    `base + scale * w`, `post` as `sigmoid(...) * 2`."""
    flat = x.view(B, S, N * D).float()
    flat = flat * torch.rsqrt((flat * flat).mean(dim=-1, keepdim=True) + NORM_EPS)
    (pre_w, post_w, comb_w), (pre_b, post_b, comb_b), (pre_s, post_s, comb_s) = _split(flat @ fn.t(), base, scale)
    pre = torch.sigmoid(pre_b + pre_s * pre_w) + HC_EPS
    post = torch.sigmoid(post_b + post_s * post_w) * 2
    comb = _sinkhorn(torch.softmax(comb_b + comb_s * comb_w, dim=-1) + HC_EPS)
    return _collapse(pre, x), post, comb


def einsum_projection_and_collapse(x, fn, base, scale):
    """The projection as `einsum('bsk,rk->bsr')` and the collapse as `einsum('bsn,bsnd->bsd')` of the fp32
    streams."""
    flat = _hf_norm(x.flatten(2).float())
    pre, post, comb = _hf_weights(torch.einsum("bsk,rk->bsr", flat, fn), base, scale)
    return torch.einsum("bsn,bsnd->bsd", pre, x.float()).to(x.dtype), post, comb


def matmul_collapse(x, fn, base, scale):
    """The collapse as a [1, n] @ [n, D] matmul per token."""
    flat = _hf_norm(x.flatten(2).float())
    pre, post, comb = _hf_weights(F.linear(flat, fn), base, scale)
    return (pre.unsqueeze(-2) @ x.float()).squeeze(-2).to(x.dtype), post, comb


def written_out_softmax_and_sigmoid(x, fn, base, scale):
    """Softmax as `exp(z - max) / sum`, sigmoid as `1 / (1 + exp(-z))`."""
    flat = _hf_norm(x.flatten(2).float())
    (pre_w, post_w, comb_w), (pre_b, post_b, comb_b), (pre_s, post_s, comb_s) = _split(F.linear(flat, fn), base,
                                                                                       scale)
    pre = 1 / (1 + torch.exp(-(pre_w * pre_s + pre_b))) + HC_EPS
    post = 2 / (1 + torch.exp(-(post_w * post_s + post_b)))
    z = comb_w * comb_s + comb_b
    e = torch.exp(z - z.amax(dim=-1, keepdim=True))
    comb = _sinkhorn(e / e.sum(dim=-1, keepdim=True) + HC_EPS)
    return _collapse(pre, x), post, comb


def bmm_exit(x, out):
    """HF's hyper-connection, the exit's mix as an explicit `bmm` of the token-flattened comb^T (`.mT`) and
    residual."""
    post, comb, collapsed = HF_HC(x)
    mixed = torch.bmm(comb.to(x.dtype).flatten(0, 1).mT, x.flatten(0, 1)).view(x.shape)
    return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed, collapsed


def _with_comb(comb_fn):
    """HF's hyper-connection with `comb_fn(comb logits)` in place of softmax + eps + Sinkhorn."""

    def hc(x, fn, base, scale):
        flat = _hf_norm(x.flatten(2).float())
        (pre_w, post_w, comb_w), (pre_b, post_b, comb_b), (pre_s, post_s, comb_s) = _split(F.linear(flat, fn), base,
                                                                                           scale)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + HC_EPS
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        return _collapse(pre, x), post, comb_fn(comb_w * comb_s + comb_b)

    return hc


def _alternating_loop(z):
    """Sinkhorn as one loop of 2 * iters - 1 alternating steps (column first), two iterations."""
    comb = torch.softmax(z, dim=-1) + HC_EPS
    for step in range(2 * 2 - 1):
        comb = comb / (comb.sum(dim=-2 if step % 2 == 0 else -1, keepdim=True) + HC_EPS)
    return comb


def _rows_first(z):
    comb = torch.softmax(z, dim=-1) + HC_EPS
    for _ in range(ITERS):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + HC_EPS)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
    return comb


def _no_eps(z):
    comb = torch.softmax(z, dim=-1) + HC_EPS
    for _ in range(ITERS):
        comb = comb / comb.sum(dim=-2, keepdim=True)
        comb = comb / comb.sum(dim=-1, keepdim=True)
    return comb


def _column_softmax(z):
    return _sinkhorn(torch.softmax(z, dim=-2) + HC_EPS)


def norm_divides_by_sqrt(x, fn, base, scale):
    """The norm spelled `a / sqrt(mean(a^2) + eps)`: a division by a rounded sqrt, not HF's rsqrt product."""
    flat = x.flatten(2).float()
    flat = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    pre, post, comb = _hf_weights(F.linear(flat, fn), base, scale)
    return _collapse(pre, x), post, comb


def collapse_in_stream_dtype(x):
    """HF's weights, the collapse with pre cast to the streams' bf16 first: every product rounded to bf16."""
    flat = _hf_norm(x.flatten(2).float())
    pre, post, comb = _hf_weights(F.linear(flat, HF_HC.fn), HF_HC.base, HF_HC.scale)
    return (pre.to(x.dtype).unsqueeze(-1) * x).sum(dim=-2), post, comb


def exit_as_bf16_products(x, out):
    """HF's hyper-connection, the exit's mix as a broadcast sum of bf16 products (post and comb cast first, as HF
    does, but each product rounded before the sum)."""
    post, comb, collapsed = HF_HC(x)
    mixed = (comb.to(x.dtype).unsqueeze(-1) * x.unsqueeze(-2)).sum(dim=2)
    return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed, collapsed


def gated_stream_sum(x, gate_weight):
    """A sigmoid-gated sum over the streams with the gate read from each stream alone: no hyper-connection."""
    gates = torch.sigmoid(x.float() @ gate_weight).squeeze(-1)
    return (gates.unsqueeze(-1) * x).sum(dim=2)


# --------------------------------------------------------------------------------------- inputs
def _streams(dtype=torch.float32, token_major=False, seed=3):
    x = torch.randn(B, S, N, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.view(T, N, D) if token_major else x


def _only_streams(dtype=torch.float32):
    return lambda: (_streams(dtype),)


def _with_params(dtype=torch.float32, token_major=False):
    return lambda: (_streams(dtype, token_major=token_major), *_params())


def _with_block_output(dtype=torch.float32):
    return lambda: (_streams(dtype), torch.randn(B, S, D, generator=torch.Generator().manual_seed(4)).to(dtype))


def _with_gate():
    return lambda: (_streams(), torch.randn(D, 1, generator=torch.Generator().manual_seed(5)))


# --------------------------------------------------------------------------------------- the corpus
COLLAPSE, HEAD, EXIT = "dsfuse.hc_collapse", "dsfuse.hc_head", "dsfuse.hc_expand_mix"


@dataclass(frozen=True)
class Entry(Formulation):
    ops: tuple[str, ...] = ()  # the fused ops of its rewritten sites
    reason: str = ""  # the near-miss reason, word for word
    iters: int = ITERS  # the Sinkhorn iterations a rewritten collapse reports


ROWS_FIRST = ("hyper-connection: Sinkhorn steps ['row', 'col', 'row', 'col', 'row', 'col'] are not HF's "
              "col, (row, col)*")
NO_SINKHORN_EPS = "hyper-connection: Sinkhorn steps none are not HF's col, (row, col)*"
COLUMN_SOFTMAX = "hyper-connection: comb is not a softmax over the last dim"
FP32_EXIT = ("hyper-connection exit: mixes out torch.bfloat16, post torch.float32, comb torch.float32 into "
             "torch.float32 streams, HF casts all to the streams' torch.bfloat16")
BF16_COLLAPSE = "hyper-connection collapse: pre * x is computed in torch.bfloat16, HF's products are fp32"
BF16_MIX = ("hyper-connection exit: comb^T @ residual is a sum of torch.bfloat16 products (each rounded), HF's "
            "matmul sums exact products")
NO_RSQRT = "hyper-connection: projection input is not x * rsqrt(mean(x^2) + eps)"

CORPUS = {
    "hf_hyper_connection": Entry(hf_hyper_connection, "transformers DeepseekV4HyperConnection", _only_streams(),
                                 REWRITTEN, (COLLAPSE,)),
    "hf_hyper_head_bf16": Entry(hf_hyper_head, "transformers DeepseekV4HyperHead (bf16 streams)",
                                _only_streams(torch.bfloat16), REWRITTEN, (HEAD,)),
    "hf_decoder_block_bf16": Entry(hf_decoder_block, "transformers DeepseekV4DecoderLayer (one block, bf16)",
                                   _only_streams(torch.bfloat16), REWRITTEN, (COLLAPSE, EXIT, HEAD)),
    "official_hc_pre": Entry(official_hc_pre, "DeepSeek V4 inference Block.hc_pre + hc_split_sinkhorn",
                             _with_params(), REWRITTEN, (COLLAPSE,)),
    "official_hc_pre_bf16": Entry(official_hc_pre, "DeepSeek V4 inference Block.hc_pre (bf16 streams)",
                                  _with_params(torch.bfloat16), REWRITTEN, (COLLAPSE,)),
    "official_hc_post_bf16": Entry(official_hc_post, "DeepSeek V4 inference Block.hc_post (bf16 streams)",
                                   _with_block_output(torch.bfloat16), NEAR_MISS, (COLLAPSE,), reason=FP32_EXIT),
    "official_hc_post": Entry(official_hc_post, "DeepSeek V4 inference Block.hc_post (fp32 streams)",
                              _with_block_output(), REWRITTEN, (COLLAPSE, EXIT)),
    "token_major_functional_norm": Entry(token_major_functional_norm, "written for the corpus ([T, n, D], "
                                         "F.rms_norm)", _with_params(token_major=True), REWRITTEN, (COLLAPSE,)),
    "product_norm_commuted_affine": Entry(product_norm_commuted_affine, "written for the corpus (a * a, base + "
                                          "scale * w)", _with_params(), REWRITTEN, (COLLAPSE,)),
    "einsum_projection_and_collapse": Entry(einsum_projection_and_collapse, "written for the corpus (einsum)",
                                            _with_params(), REWRITTEN, (COLLAPSE,)),
    "matmul_collapse": Entry(matmul_collapse, "written for the corpus (pre @ x)", _with_params(), REWRITTEN,
                             (COLLAPSE,)),
    "written_out_softmax_and_sigmoid": Entry(written_out_softmax_and_sigmoid, "written for the corpus (exp forms)",
                                             _with_params(), REWRITTEN, (COLLAPSE,)),
    "alternating_sinkhorn_loop": Entry(_with_comb(_alternating_loop), "written for the corpus (one alternating loop)",
                                       _with_params(), REWRITTEN, (COLLAPSE,), iters=2),
    "bmm_exit": Entry(bmm_exit, "written for the corpus (bmm of comb.mT)", _with_block_output(), REWRITTEN,
                      (COLLAPSE, EXIT)),
    "sinkhorn_rows_first": Entry(_with_comb(_rows_first), "written for the corpus (row step first)", _with_params(),
                                 NEAR_MISS, reason=ROWS_FIRST),
    "sinkhorn_without_eps": Entry(_with_comb(_no_eps), "written for the corpus (no eps in the steps)",
                                  _with_params(), NEAR_MISS, reason=NO_SINKHORN_EPS),
    "softmax_over_columns": Entry(_with_comb(_column_softmax), "written for the corpus (softmax over dim -2)",
                                  _with_params(), NEAR_MISS, reason=COLUMN_SOFTMAX),
    "norm_divides_by_sqrt": Entry(norm_divides_by_sqrt, "written for the corpus (a / sqrt)", _with_params(),
                                  NEAR_MISS, reason=NO_RSQRT),
    "collapse_in_stream_dtype": Entry(collapse_in_stream_dtype, "written for the corpus (pre.to(bf16) * x)",
                                      _only_streams(torch.bfloat16), NEAR_MISS, reason=BF16_COLLAPSE),
    "exit_as_bf16_products": Entry(exit_as_bf16_products, "written for the corpus (bf16 broadcast sum)",
                                   _with_block_output(torch.bfloat16), NEAR_MISS, (COLLAPSE,), reason=BF16_MIX),
    "gated_stream_sum": Entry(gated_stream_sum, "written for the corpus (per-stream sigmoid gate)", _with_gate(),
                              LEFT_ALONE),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_entry_ends_as_declared(name):
    entry = CORPUS[name]
    got, want, rep = compile_entry(entry, "hyper_connections")
    sites = [s for s in rep.sites if s.pass_name == "hyper_connections"]
    reasons = [m.reason for m in rep.near_misses if m.pass_name == "hyper_connections"]
    if entry.outcome == REWRITTEN:
        assert (sorted(s.op for s in sites), reasons) == (sorted(entry.ops), []), str(rep)
        assert all(f"sinkhorn_iters={entry.iters}" in s.detail for s in sites if s.op == COLLAPSE), str(rep)
    elif entry.outcome == NEAR_MISS:  # the candidate is reported; the entry's other sites (`ops`) are rewritten
        assert (sorted(s.op for s in sites), reasons) == (sorted(entry.ops), [entry.reason]), str(rep)
    else:
        assert (sites, reasons) == ([], []), str(rep)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        if g.dtype == torch.bfloat16:  # a product or sum rounded to bf16 in another order: one bf16 ulp
            torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_corpus_covers_the_family():
    """At least 12 independent formulations rewritten, every fused op of the family among them, and each declared
    outcome kind appears."""
    rewritten = [e for e in CORPUS.values() if e.outcome == REWRITTEN]
    assert len(rewritten) >= MIN_REWRITTEN
    assert {op for e in rewritten for op in e.ops} == {COLLAPSE, HEAD, EXIT}
    assert {e.outcome for e in CORPUS.values()} == {REWRITTEN, NEAR_MISS, LEFT_ALONE}
