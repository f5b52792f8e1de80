"""`sparse_attention` on small graphs written like HF's V3.2 attention (scatter mask + SDPA / eager)
and like dsfuse's own absorbed-MLA gather: what matches, what is reported, what is left alone,
dynamic lengths, switching the pass off, and (structurally, on meta tensors) the CUDA fused-SDPA forms."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from inductor_forms import REWRITES, to_online_softmax

import dsfuse
from dsfuse.kernels.sparse_attention import sparse_attention_masked_reference
from dsfuse.passes import PassContext, run_pass

B, H, S, D, K = 2, 4, 12, 16, 5
SCALE = 0.3


def select_mask(idx, seq):
    """HF's `index_mask`: True at keys the indexer did not pick, [B, 1, S, T]."""
    return idx.new_ones((idx.shape[0], idx.shape[1], seq), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)


def combine(mask, index_mask, dtype):
    if mask.dtype == torch.bool:
        return mask & ~index_mask
    return mask.masked_fill(index_mask, torch.finfo(dtype).min)


def hf_sdpa(q, k, v, idx, mask):
    attn_mask = combine(mask, select_mask(idx, k.shape[2]), q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=SCALE)


def hf_eager(q, k, v, idx, mask):
    attn_mask = combine(mask, select_mask(idx, k.shape[2]), q.dtype)
    weights = torch.matmul(q, k.transpose(2, 3)) * SCALE + attn_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v).transpose(1, 2).contiguous()


def _data(dtype=torch.float32, seq=S, dv=D, mask_kind="bool"):
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(B, H, seq, D, generator=gen).to(dtype)
    k = torch.randn(B, H, seq, D, generator=gen).to(dtype)
    v = torch.randn(B, H, seq, dv, generator=gen).to(dtype)
    idx = torch.stack([torch.stack([torch.randperm(seq, generator=gen)[:K] for _ in range(seq)]) for _ in range(B)])
    keep = torch.ones(seq, seq, dtype=torch.bool).tril().expand(B, 1, seq, seq).clone()
    keep[1, :, :, :3] = False  # left padding: the first queries of batch 1 see no key at all
    if mask_kind == "bool":
        return q, k, v, idx, keep
    mask = torch.zeros(B, 1, seq, seq, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    return q, k, v, idx, mask


def _compile(fn, **kw):
    return torch.compile(fn, backend="dsfuse", options={"enable": ["sparse_attention"]}, **kw)


def _sites():
    return [s for s in dsfuse.report().sites if s.pass_name == "sparse_attention"]


def _misses():
    return [m.reason for m in dsfuse.report().near_misses if m.pass_name == "sparse_attention"]


# Dv != D keeps CPU SDPA off its flash kernel, so Inductor decomposes it into math with a safe softmax.
HF_CASES = {
    "sdpa-flash-bool": (hf_sdpa, "bool", D, "_scaled_dot_product_flash_attention_for_cpu, bool mask"),
    "sdpa-flash-additive": (hf_sdpa, "additive", D, "_scaled_dot_product_flash_attention_for_cpu, additive mask"),
    "sdpa-math-bool": (hf_sdpa, "bool", 8, "decomposed SDPA, bool mask"),
    "eager-additive": (hf_eager, "additive", 8, "decomposed softmax, additive mask"),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_forms_match_once_fp32(case):
    fn, mask_kind, dv, detail = HF_CASES[case]
    args = _data(dv=dv, mask_kind=mask_kind)
    with torch.no_grad():
        out = _compile(fn)(*args)
    sites = _sites()
    assert len(sites) == 1 and sites[0].op == "dsfuse.sparse_attention_masked", str(dsfuse.report())
    assert sites[0].detail.startswith(detail) and f"scale={SCALE:g}" in sites[0].detail
    assert _misses() == []
    expected = fn(*args)
    assert (expected.abs().sum(-1) == 0).any() or mask_kind == "additive"  # fully masked rows really occur
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [hf_sdpa, hf_eager], ids=["sdpa-math", "eager"])
def test_hf_forms_bf16_within_inductor_error(fn):
    args = _data(torch.bfloat16, dv=8, mask_kind="bool" if fn is hf_sdpa else "additive")
    with torch.no_grad():
        expected = fn(*args).float()
        out = _compile(fn)(*args).float()
        assert len(_sites()) == 1, str(dsfuse.report())
        torch._dynamo.reset()
        inductor = torch.compile(fn, backend="inductor")(*args).float()
    inductor_err = ((inductor - expected).norm() / expected.norm()).item()
    dsfuse_err = ((out - expected).norm() / expected.norm()).item()
    assert dsfuse_err <= max(2e-2, 1.25 * inductor_err), (dsfuse_err, inductor_err)


def test_position_built_causal_mask_is_applied_in_kernel():
    """A mask built only from query/key positions (HF without padding) need not be read at all."""
    q, k, v, idx, _ = _data(dv=8)

    def position_causal(q, k, v, idx, padding):
        queries = torch.arange(S)[None, None, :, None]
        keys = torch.arange(S)[None, None, None, :]
        causal = (keys <= queries).expand(B, -1, -1, -1)
        return hf_sdpa(q, k, v, idx, causal), hf_sdpa(q, k, v, idx, causal & padding)

    padding = torch.ones(B, 1, 1, S, dtype=torch.bool)
    padding[1, ..., :3] = False
    with torch.no_grad():
        plain, padded = _compile(position_causal)(q, k, v, idx, padding)
    details = sorted(s.detail for s in _sites())
    assert details == [f"decomposed SDPA, bool mask, K={K}, scale={SCALE:g}",
                       f"decomposed SDPA, causal (from positions), K={K}, scale={SCALE:g}"], details
    expected_plain, expected_padded = position_causal(q, k, v, idx, padding)
    torch.testing.assert_close(plain, expected_plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded, expected_padded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shift, causal", [(4, True), (3, False)])
def test_causal_offset_added_after_unsqueeze(shift, causal):
    """Queries at `arange(S) + (T - S)` (the offset added after the unsqueezes, as `families` writes it) are
    causal; any other shift is a mask to read, never mistaken for causal."""
    T = S + 4
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, S, D, generator=gen)
    k, v = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
    idx = torch.stack([torch.stack([torch.randperm(T, generator=gen)[:K] for _ in range(S)]) for _ in range(B)])

    def shifted_causal(q, k, v, idx):
        queries = torch.arange(S)[None, None, :, None] + shift
        return hf_sdpa(q, k, v, idx, torch.arange(T)[None, None, None, :] <= queries)

    with torch.no_grad():
        out = _compile(shifted_causal)(q, k, v, idx)
    kind = "causal (from positions)" if causal else "bool mask"
    assert [s.detail.split(", ")[1] for s in _sites()] == [kind], str(dsfuse.report())
    torch.testing.assert_close(out, shifted_causal(q, k, v, idx), rtol=1e-5, atol=1e-5)


def test_indices_from_plain_topk():
    q, k, v, _, mask = _data(dv=8)

    def topk_then_attend(q, k, v, scores, mask):
        return hf_sdpa(q, k, v, scores.topk(K, dim=-1).indices, mask)

    scores = torch.randn(B, S, S)
    with torch.no_grad():
        out = _compile(topk_then_attend)(q, k, v, scores, mask)
    assert len(_sites()) == 1, str(dsfuse.report())
    torch.testing.assert_close(out, topk_then_attend(q, k, v, scores, mask), rtol=1e-5, atol=1e-5)


def test_selection_mask_used_elsewhere_is_a_near_miss():
    q, k, v, idx, mask = _data(dv=8)

    def also_returned(q, k, v, idx, mask):
        index_mask = select_mask(idx, S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask & ~index_mask, scale=SCALE)
        return out, index_mask.sum()

    with torch.no_grad():
        _compile(also_returned)(q, k, v, idx, mask)
    assert _sites() == []
    assert _misses() == ["the selection mask is also used outside the attention mask"]


def test_attention_weights_used_elsewhere_is_a_near_miss():
    q, k, v, idx, mask = _data(dv=8, mask_kind="additive")

    def weights_too(q, k, v, idx, mask):
        weights = torch.matmul(q, k.transpose(2, 3)) * SCALE + combine(mask, select_mask(idx, S), q.dtype)
        weights = F.softmax(weights, dim=-1, dtype=torch.float32)
        return torch.matmul(weights, v), weights

    with torch.no_grad():
        _compile(weights_too)(q, k, v, idx, mask)
    assert _sites() == []
    assert _misses() == ["the attention probabilities are also used elsewhere"]


def test_dropout_is_a_near_miss():
    q, k, v, idx, mask = _data()

    def with_dropout(q, k, v, idx, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=combine(mask, select_mask(idx, S), q.dtype),
                                              dropout_p=0.25, scale=SCALE)

    with torch.no_grad():
        _compile(with_dropout)(q, k, v, idx, mask)
    assert _sites() == []
    assert len(_misses()) == 1 and "dropout" in _misses()[0], _misses()


def test_float64_is_a_near_miss():
    q, k, v, idx, mask = _data(torch.float64, dv=8)
    with torch.no_grad():
        _compile(hf_sdpa)(q, k, v, idx, mask)
    assert _sites() == []
    assert _misses() == ["q/k/v dtypes torch.float64/torch.float64/torch.float64 not supported by the fused op"]


def test_fill_other_than_finfo_min_is_a_near_miss():
    q, k, v, idx, mask = _data(dv=8, mask_kind="additive")

    def neg_inf_fill(q, k, v, idx, mask):
        weights = torch.matmul(q, k.transpose(2, 3)) * SCALE + mask.masked_fill(select_mask(idx, S), -1e4)
        return torch.matmul(F.softmax(weights, dim=-1), v)

    with torch.no_grad():
        _compile(neg_inf_fill)(q, k, v, idx, mask)
    assert _sites() == []
    assert _misses() == ["unselected keys are filled with -10000.0, not finfo(torch.float32).min"]


def test_transposed_selection_is_a_near_miss():
    q, k, v, idx, mask = _data(dv=8)

    def keys_by_queries(q, k, v, idx, mask):
        attn_mask = mask & ~select_mask(idx, S).transpose(-1, -2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=SCALE)

    with torch.no_grad():
        _compile(keys_by_queries)(q, k, v, idx, mask)
    assert _sites() == []
    assert _misses() == ["the selection mask is not laid out as [B, 1, S, T] where it meets the scores"]


def test_plain_softmax_over_bool_bias_is_a_near_miss():
    """Such a source returns NaN for fully masked rows where the fused op returns 0: not rewritten."""
    q, k, v, idx, mask = _data(dv=8)

    def nan_rows(q, k, v, idx, mask):
        bias = torch.where(mask & ~select_mask(idx, S), 0.0, float("-inf"))
        return torch.matmul(F.softmax(torch.matmul(q, k.transpose(2, 3)) * SCALE + bias, dim=-1), v)

    with torch.no_grad():
        _compile(nan_rows)(q, k, v, idx, mask)
    assert _sites() == []
    assert _misses() == ["plain softmax over a -inf bias gives NaN for fully masked rows; the fused op returns 0"]


def test_dense_attention_and_unrelated_scatter_are_left_alone_silently():
    q, k, v, idx, mask = _data(dv=8)

    def dense(q, k, v, idx, mask):
        hits = torch.zeros(B, S, S).scatter(-1, idx, 1.0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE), hits

    with torch.no_grad():
        _compile(dense)(q, k, v, idx, mask)
    rep = dsfuse.report()
    assert rep.counts["sparse_attention"] == 0 and rep.near_misses == [], str(rep)


@pytest.mark.parametrize("silu", [F.silu, lambda x: x / (1 + torch.exp(-x)), lambda x: x * torch.sigmoid(x)],
                         ids=["F.silu", "x/(1+exp(-x))", "x*sigmoid(x)"])
def test_expert_weights_gathered_by_the_routing_are_not_an_attention(silu):
    """A decode step's experts as transformers' batched form writes them: each slot's weights gathered by the router's
    ids, a SiLU between the gate and the down products, the slots weighted and summed. The products read gathered
    rows and an exponential sits between them (CUDA's decomposition of SiLU), but no softmax statistic: silent."""
    experts, hidden, inter, top_k = 6, 16, 8, 2
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)

    def step(x, logits):
        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        flat = ids.reshape(-1)
        rows = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)
        gate, up = torch.bmm(gate_up[flat], rows).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(down[flat], (silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (out.view(-1, top_k, hidden) * weights.unsqueeze(-1)).sum(1)

    x, logits = torch.randn(1, hidden, generator=gen), torch.randn(1, experts, generator=gen)
    with torch.no_grad():
        got = _compile(step)(x, logits)
    torch.testing.assert_close(got, step(x, logits))
    assert _sites() == [] and _misses() == [], str(dsfuse.report())


def test_dynamic_sequence_length_does_not_recompile_per_length():
    fn = _compile(hf_eager)
    with torch.no_grad():
        for seq in (12, 15, 18):
            args = _data(seq=seq, dv=8, mask_kind="additive")
            torch.testing.assert_close(fn(*args), hf_eager(*args), rtol=1e-5, atol=1e-5)
    rep = dsfuse.report()
    assert len(rep.graphs) == 2, str(rep)  # the first length static, then one symbolic graph
    assert rep.counts["sparse_attention"] == 2


def test_disabled_by_option_or_environment(monkeypatch):
    args = _data(dv=8)
    with torch.no_grad():
        out = torch.compile(hf_sdpa, backend="dsfuse", options={"disable": ["sparse_attention"]})(*args)
        assert dsfuse.report().counts["sparse_attention"] == 0
        torch._dynamo.reset()
        monkeypatch.setenv("DSFUSE_DISABLE", "sparse_attention")
        torch.compile(hf_sdpa, backend="dsfuse")(*args)
        assert dsfuse.report().counts["sparse_attention"] == 0
        assert dsfuse.report().graphs[-1].enabled == ("norm_rope_quant", "indexer_topk", "moe_experts",
                                                      "hyper_connections", "compressors")
        torch._dynamo.reset()
        assert torch.equal(out, torch.compile(hf_sdpa, backend="inductor")(*args))


# ---------------------------------------------------------------------------
# Structural: the CUDA fused SDPA ops, traced on meta tensors (no CUDA needed to build the graph)
# ---------------------------------------------------------------------------


def _efficient(q, k, v, idx, keep):
    """What AOT autograd records for CUDA SDPA with a bool mask: the mask becomes a -inf bias
    (`where(~mask, -inf, 0)`), padded to 16 keys for the memory-efficient kernel, then sliced back."""
    index_mask = torch.full((B, S, S), True, dtype=torch.bool, device=q.device).scatter(-1, idx, False).unsqueeze(1)
    combined = keep & ~index_mask
    bias = torch.where(combined.logical_not(), torch.full((), float("-inf"), device=q.device),
                       torch.full((), 0.0, device=q.device)).expand(B, H, S, S)
    bias = torch.constant_pad_nd(bias, (0, 16 - S % 16), 0.0)[..., :S]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, 0.0, False, scale=SCALE)[0]


def _cudnn(q, k, v, idx, mask):
    """Additive-mask form into the cuDNN op."""
    index_mask = torch.full((B, S, S), True, dtype=torch.bool, device=q.device).scatter(-1, idx, False).unsqueeze(1)
    bias = torch.where(index_mask, torch.full((), torch.finfo(q.dtype).min, device=q.device), mask)
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, 0.0, False, False)[0]


@pytest.mark.parametrize("fn,mask_kind", [(_efficient, "bool"), (_cudnn, "additive")], ids=["efficient", "cudnn"])
def test_structural_cuda_fused_sdpa_forms(fn, mask_kind):
    """Structural test: the graph is traced with fake meta tensors (these ops have no CPU kernel), the
    pass rewrites it, and the rewritten graph, which no longer contains the CUDA op, runs on CPU."""
    q, k, v, idx, mask = _data(mask_kind=mask_kind)
    gm = make_fx(fn, tracing_mode="fake")(*(t.to("meta") for t in (q, k, v, idx, mask)))
    assert any("scaled_dot_product" in str(n.target) for n in gm.graph.nodes)
    ctx = PassContext(name="sparse_attention")
    run_pass("sparse_attention", gm.graph, ctx)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert ctx.near_misses == [] and len(ctx.sites) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.dsfuse.sparse_attention_masked.default], targets
    fused = next(n for n in gm.graph.nodes if n.op == "call_function")
    scale = fused.args[5]
    assert math.isclose(scale, SCALE if fn is _efficient else D**-0.5)
    out = gm(q, k, v, idx, mask)
    torch.testing.assert_close(out, sparse_attention_masked_reference(q, k, v, idx, mask, scale))


def _cudnn_bool(q, k, v, idx, keep):
    """What AOT autograd records for CUDA SDPA taking the cuDNN path with HF's bool mask (seen on an H200,
    torch 2.11): the combined mask becomes a *finite* bias `where(mask, 0, -65536)` in q's dtype."""
    index_mask = torch.full((B, S, S), True, dtype=torch.bool, device=q.device).scatter(-1, idx, False).unsqueeze(1)
    bias = torch.where(keep & ~index_mask, torch.full((), 0.0, dtype=q.dtype, device=q.device),
                       torch.full((), -65536.0, dtype=q.dtype, device=q.device))
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, scale=SCALE)[0]


def _position_causal(q):
    """HF's causal mask as Inductor records it: key positions <= query positions, from iotas."""
    rows = torch.ops.prims.iota(S, start=0, step=1, dtype=torch.int64, device=q.device, requires_grad=False)
    cols = torch.ops.prims.iota(S, start=0, step=1, dtype=torch.int64, device=q.device, requires_grad=False)
    return (cols[None, None, None, :] <= rows[None, None, :, None]).expand(B, 1, S, S)


def test_structural_cudnn_finite_bias_with_causal_mask_is_fused():
    """A position-built causal mask is applied in-kernel; a query whose picks all lie in its future is left without
    keys, and the finite bias makes that row attend to every key, as the op is told to (found by the numeric
    check: the op used to return 0 there)."""
    q, k, v, idx, _ = _data()
    idx[0, 2] = torch.arange(S - K, S)  # query 2 of batch 0 picks future keys only
    gm = make_fx(lambda q, k, v, idx: _cudnn_bool(q, k, v, idx, _position_causal(q)), tracing_mode="fake")(
        *(t.to("meta") for t in (q, k, v, idx)))
    ctx = PassContext(name="sparse_attention")
    run_pass("sparse_attention", gm.graph, ctx)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert ctx.near_misses == [] and len(ctx.sites) == 1, ctx.near_misses
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.dsfuse.sparse_attention_masked.default)
    assert fused.args[4] is None and fused.args[6] is True and fused.args[7] is True  # no mask, causal, see all
    allowed = torch.ones(S, S, dtype=torch.bool).tril() & ~torch.full((B, S, S), True).scatter(-1, idx, False)
    assert not allowed[0, 2].any()
    biased = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.where(allowed.unsqueeze(1), 0.0, -65536.0), scale=SCALE)
    torch.testing.assert_close(gm(q, k, v, idx), biased, atol=5e-3, rtol=0)


def test_structural_cudnn_finite_bias_with_padding_is_fused_with_its_empty_rows():
    """Left padding under cuDNN's finite bias: a padding query's row has no allowed key, and the bias shifts all
    of its keys alike, so that row attends over all keys unmasked; the fused op is told to do the same."""
    q, k, v, idx, keep = _data()  # batch 1: its first three queries see padding keys only
    gm = make_fx(_cudnn_bool, tracing_mode="fake")(*(t.to("meta") for t in (q, k, v, idx, keep)))
    ctx = PassContext(name="sparse_attention")
    run_pass("sparse_attention", gm.graph, ctx)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert ctx.near_misses == [] and len(ctx.sites) == 1, ctx.near_misses
    assert "rows without keys attend to all keys (finite bias)" in ctx.sites[0].detail
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.dsfuse.sparse_attention_masked.default)
    assert fused.args[6] is False and fused.args[7] is True  # the mask is read; empty rows see all keys
    allowed = keep & ~torch.full((B, S, S), True).scatter(-1, idx, False).unsqueeze(1)
    empty = ~allowed.any(-1, keepdim=True)
    assert empty[1, 0, :3].all()
    out = gm(q, k, v, idx, keep)
    # The source: SDPA over the finite bias (adding -65536 rounds the scores of an empty row by up to 2**-8).
    biased = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(allowed, 0.0, -65536.0),
                                                              scale=SCALE)
    torch.testing.assert_close(out, biased, atol=5e-3, rtol=0)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed | empty, scale=SCALE))


def test_structural_cudnn_finite_bias_over_a_latent_cache_is_absorbed():
    """The decode form on the H200: keys/values expanded from HF's latent cache, a padding mask turned into
    cuDNN's finite bias. The absorbed op reproduces the bias's rows without keys (they attend to all keys)."""
    from dsfuse.kernels.sparse_attention import absorbed_mla_attention_reference

    nope, rope_dim, vdim, rank = 8, 8, 16, 24
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, S, nope + rope_dim, generator=gen)
    latent, rope = torch.randn(B, 1, S, rank, generator=gen), torch.randn(B, 1, S, rope_dim, generator=gen)
    weight = torch.randn(H * (nope + vdim), rank, generator=gen) / rank**0.5
    idx = torch.stack([torch.stack([torch.randperm(S, generator=gen)[:K] for _ in range(S)]) for _ in range(B)])
    keep = torch.ones(B, 1, S, S, dtype=torch.bool)
    keep[1, ..., :4] = False
    idx[1, 0] = torch.arange(K)  # batch 1, query 0 selects only padded keys

    def latent_cudnn(q, latent, rope, weight, idx, keep):
        kv = (latent.reshape(B * S, rank) @ weight.t()).view(B, 1, S, H * (nope + vdim))
        kv = kv.view(B, S, H, nope + vdim).permute(0, 2, 1, 3)
        k_nope, v = torch.split(kv, [nope, vdim], dim=-1)
        k = torch.empty(B, H, S, nope + rope_dim, dtype=q.dtype, device=q.device)
        k = torch.slice_scatter(k, k_nope, 3, 0, nope)
        k = torch.slice_scatter(k, rope.expand(-1, H, -1, -1), 3, nope)
        unselected = torch.full((B, S, S), True, dtype=torch.bool, device=q.device).scatter(-1, idx, False)
        bias = torch.where(keep & ~unselected.unsqueeze(1), torch.full((), 0.0, dtype=q.dtype, device=q.device),
                           torch.full((), -65536.0, dtype=q.dtype, device=q.device))
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, scale=SCALE)[0]

    args = (q, latent, rope, weight, idx, keep)
    gm = make_fx(latent_cudnn, tracing_mode="fake")(*(t.to("meta") for t in args))
    ctx = PassContext(name="sparse_attention")
    run_pass("sparse_attention", gm.graph, ctx)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert ctx.near_misses == [] and len(ctx.sites) == 1, ctx.near_misses
    assert "rows without keys attend to all keys (finite bias)" in ctx.sites[0].detail
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.dsfuse.absorbed_mla_attention.default)
    assert fused.args[9] is True and fused.args[10] is False  # see-all rows; idx is an input, not a top-k
    expected = absorbed_mla_attention_reference(q, latent, rope, weight, idx, keep, SCALE, nope, False, True)
    torch.testing.assert_close(gm(*args), expected)


def test_structural_fused_sdpa_with_dropout_is_a_near_miss():
    q, k, v, idx, mask = _data()

    def dropped(q, k, v, idx, keep):
        index_mask = torch.full((B, S, S), True, dtype=torch.bool, device=q.device).scatter(-1, idx, False).unsqueeze(1)
        bias = torch.where((keep & ~index_mask).logical_not(), torch.full((), float("-inf"), device=q.device),
                           torch.full((), 0.0, device=q.device))
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, 0.1, False)[0]

    gm = make_fx(dropped, tracing_mode="fake")(*(t.to("meta") for t in (q, k, v, idx, mask)))
    ctx = PassContext(name="sparse_attention")
    run_pass("sparse_attention", gm.graph, ctx)
    assert ctx.sites == [] and [m.reason for m in ctx.near_misses] == ["attention dropout p=0.1 > 0"]


def test_top_k_sources_are_known_to_hold_no_repeats():
    """The absorbed op skips its repeat search only for indices that come straight from a top-k."""
    from dsfuse.passes.sparse_attention import _top_k_indices

    gm = make_fx(lambda scores, other: (scores.topk(3).indices, other + 1))(torch.randn(2, 9), torch.ones(2, 3))
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert _top_k_indices(outputs[0]) is True
    assert _top_k_indices(outputs[1]) is False


# ---------------------------------------------------------------------------
# dsfuse's own model: absorbed MLA over gathered latent rows
# ---------------------------------------------------------------------------

MLA_SCALE = 0.2


def own_mla(q_absorbed, q_pe, kv, k_pe, indices, sink):
    """`DsfuseAttention.forward`'s attention core, written the same way."""
    batch, seq_len = q_absorbed.shape[:2]
    batch_index = torch.arange(batch, device=kv.device)[:, None, None]
    safe_indices = indices.clamp(min=0)
    kv_rows = kv[batch_index, safe_indices]
    pe_rows = k_pe[batch_index, safe_indices]
    scores = (torch.einsum("bshc,bskc->bshk", q_absorbed, kv_rows)
              + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * MLA_SCALE
    scores = scores.float().masked_fill((indices < 0).unsqueeze(2), float("-inf"))
    if sink is None:
        probs = scores.softmax(dim=-1)
    else:
        column = sink.float().view(1, 1, -1, 1).expand(batch, seq_len, -1, 1)
        probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bshk,bskc->bshc", probs.to(q_absorbed.dtype), kv_rows)


def _mla_data(dtype, sink, seq=S):
    gen = torch.Generator().manual_seed(seq)
    C, R = 32, 8
    indices = torch.randint(0, seq, (B, seq, K), generator=gen)
    indices[:, :, -2:] = -1  # masked picks
    indices[0, 0] = -1  # a query without keys
    return (torch.randn(B, seq, H, C, generator=gen).to(dtype), torch.randn(B, seq, H, R, generator=gen).to(dtype),
            torch.randn(B, seq, C, generator=gen).to(dtype), torch.randn(B, seq, R, generator=gen).to(dtype),
            indices, torch.randn(H, generator=gen) if sink else None)


@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
def test_own_mla_matches_fp32(sink):
    args = _mla_data(torch.float32, sink)
    with torch.no_grad():
        out = _compile(own_mla)(*args)
    sites = _sites()
    assert len(sites) == 1 and sites[0].op == "dsfuse.sparse_mla_attention", str(dsfuse.report())
    assert sites[0].detail == f"K={K}, scale={MLA_SCALE:g}" + (", sink" if sink else "")
    expected = own_mla(*args)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert out[0, 0].isnan().all() != sink  # a query without keys: NaN without a sink, 0 with one


def test_own_mla_bf16_within_inductor_error():
    args = _mla_data(torch.bfloat16, sink=True)
    with torch.no_grad():
        expected = own_mla(*args).float()
        out = _compile(own_mla)(*args).float()
        assert len(_sites()) == 1, str(dsfuse.report())
        torch._dynamo.reset()
        inductor = torch.compile(own_mla, backend="inductor")(*args).float()
    inductor_err = ((inductor - expected).norm() / expected.norm()).item()
    dsfuse_err = ((out - expected).norm() / expected.norm()).item()
    assert dsfuse_err <= max(2e-2, 1.25 * inductor_err), (dsfuse_err, inductor_err)


def test_own_mla_mask_from_other_indices_is_a_near_miss():
    args = _mla_data(torch.float32, sink=False)

    def other_mask(q_absorbed, q_pe, kv, k_pe, indices, sink):
        batch_index = torch.arange(B)[:, None, None]
        kv_rows = kv[batch_index, indices.clamp(min=0)]
        pe_rows = k_pe[batch_index, indices.clamp(min=0)]
        scores = (torch.einsum("bshc,bskc->bshk", q_absorbed, kv_rows)
                  + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * MLA_SCALE
        scores = scores.float().masked_fill((indices < 1).unsqueeze(2), float("-inf"))
        return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=-1), kv_rows)

    with torch.no_grad():
        _compile(other_mask)(*args)
    assert _sites() == []
    assert _misses() == ["the score mask is not `idx < 0` of the gather's indices"]


# ---------------------------------------------------------------------------
# CUDA's online softmax (inductor_forms.to_online_softmax), applied here on CPU graphs.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["sparse attention (HF mask + SDPA)", "sparse MLA (gather, absorbed)"])
def test_online_softmax_form_is_matched(family):

    from dsfuse.families import families

    fam = next(f for f in families("tiny", "cpu", torch.float32) if f.name == family)
    inputs = fam.make_inputs()
    options = {"enable": ["sparse_attention"], "inductor": {"post_grad_custom_pre_pass": to_online_softmax}}
    REWRITES.clear()
    out = torch.compile(fam.fn, backend="dsfuse", options=options)(*inputs)
    assert REWRITES, "the graph had no softmax to put in the online form"
    rep = dsfuse.report()
    assert rep.counts["sparse_attention"] == 1, str(rep)
    torch.testing.assert_close(out, fam.fn(*inputs), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Matching by op class, checked on probes
# ---------------------------------------------------------------------------


def keep_scatter_sdpa(q, k, v, idx, keep):
    """The selection built in keep polarity (`zeros.scatter(idx, True)`) and ANDed with the bool mask."""
    picked = torch.zeros(idx.shape[0], idx.shape[1], k.shape[2], dtype=torch.bool).scatter(-1, idx, True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep & picked[:, None], scale=SCALE)


def selection_only_where(q, k, v, idx, keep):
    """No attention mask: the scores of unpicked keys set to -inf, plain softmax (every row keeps its picks)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * SCALE
    scores = scores.masked_fill(select_mask(idx, k.shape[2]), float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


def selection_bias_index_put(q, k, v, idx, keep):
    """The selection as an additive bias written by a boolean index_put of -inf."""
    bias = torch.zeros(idx.shape[0], 1, idx.shape[1], k.shape[2])
    bias[select_mask(idx, k.shape[2])] = float("-inf")
    return torch.matmul(F.softmax(torch.matmul(q, k.transpose(-1, -2)) * SCALE + bias, dim=-1), v)


def shared_kv_additive(q, k, v, idx, mask):
    """K and V shared by the heads ([B, T, D], MQA), broadcast by matmul; HF's additive mask."""
    k, v = k[:, 0], v[:, 0]
    attn_mask = combine(mask, select_mask(idx, k.shape[1]), q.dtype)
    weights = F.softmax(torch.matmul(q, k.unsqueeze(1).transpose(-1, -2)) * SCALE + attn_mask, dim=-1)
    return torch.matmul(weights, v.unsqueeze(1))


OP_CLASS_CASES = {
    "keep-polarity": (keep_scatter_sdpa, "bool", "bool mask"),
    "selection-only": (selection_only_where, "bool", "selection only"),
    "index_put-bias": (selection_bias_index_put, "bool", "selection only"),
    "shared-kv": (shared_kv_additive, "additive", "additive mask"),
}


@pytest.mark.parametrize("case", OP_CLASS_CASES)
def test_other_spellings_of_the_selection_are_fused(case):
    fn, mask_kind, detail = OP_CLASS_CASES[case]
    args = _data(dv=8, mask_kind=mask_kind)
    with torch.no_grad():
        out = _compile(fn)(*args)
    sites = _sites()
    assert len(sites) == 1 and detail in sites[0].detail and _misses() == [], str(dsfuse.report())
    torch.testing.assert_close(out, fn(*args), rtol=1e-5, atol=1e-5, equal_nan=True)


def _rows_by(kind):
    def rows(src, safe):
        b, t, w = src.shape
        if kind == "gather":
            return torch.gather(src.unsqueeze(1).expand(b, safe.shape[1], t, w), 2,
                                safe.unsqueeze(-1).expand(*safe.shape, w))
        if kind == "take_along_dim":
            return torch.take_along_dim(src[:, None], safe[..., None], dim=2)
        flat = (safe + torch.arange(b)[:, None, None] * t).reshape(-1)
        return src.reshape(b * t, w).index_select(0, flat).view(*safe.shape, w)

    def attention(q_absorbed, q_pe, kv, k_pe, indices, sink):
        safe = indices.clamp(min=0)
        kv_rows, pe_rows = rows(kv, safe), rows(k_pe, safe)
        scores = (torch.einsum("bshc,bskc->bshk", q_absorbed, kv_rows)
                  + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * MLA_SCALE
        scores = scores.float().masked_fill((indices < 0).unsqueeze(2), float("-inf"))
        return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=-1), kv_rows)

    return attention


@pytest.mark.parametrize("kind", ["gather", "take_along_dim", "index_select"])
def test_rows_read_by_gather_are_fused(kind):
    args = _mla_data(torch.float32, sink=False)
    with torch.no_grad():
        out = _compile(_rows_by(kind))(*args)
    assert [s.op for s in _sites()] == ["dsfuse.sparse_mla_attention"] and _misses() == [], str(dsfuse.report())
    torch.testing.assert_close(out, _rows_by(kind)(*args), rtol=1e-5, atol=1e-5, equal_nan=True)


def test_the_numeric_check_refuses_a_wrong_binding():
    """The walk's binding, run on probes against the op's reference: right as found, refused with the failing probe
    named once the scale (or the roles) are wrong."""
    from torch._inductor.decomposition import select_decomp_table

    from dsfuse.passes import sparse_attention, verify
    from dsfuse.passes.canonicalize import canonicalize

    gm = make_fx(hf_eager, decomposition_table=select_decomp_table(), tracing_mode="fake")(
        *_data(dv=8, mask_kind="additive"))
    canonicalize(gm.graph)
    scatter = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.scatter.value)
    found = sparse_attention._match(scatter)
    verify.clear_cache()
    assert sparse_attention._verify(found).ok is True
    assert sparse_attention._verify(dict(found, scale=2 * found["scale"])).reason.startswith("random probe: ")
    swapped = sparse_attention._verify(dict(found, q=found["k"], k=found["q"]))
    assert swapped.ok is False and "probe" in swapped.reason


def test_heads_first_queries_over_gathered_rows_are_read_through_a_permute():
    def written_heads_first(q_absorbed, q_pe, kv, k_pe, indices, sink):
        batch_index = torch.arange(kv.shape[0])[:, None, None]
        safe = indices.clamp(min=0)
        kv_rows, pe_rows = kv[batch_index, safe], k_pe[batch_index, safe]
        scores = (torch.einsum("bhsc,bskc->bshk", q_absorbed, kv_rows)
                  + torch.einsum("bhsr,bskr->bshk", q_pe, pe_rows)) * MLA_SCALE
        scores = scores.float().masked_fill((indices < 0).unsqueeze(2), float("-inf"))
        return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=-1), kv_rows)

    q, q_pe, *rest = _mla_data(torch.float32, sink=False)
    args = (q.transpose(1, 2).contiguous(), q_pe.transpose(1, 2).contiguous(), *rest)
    with torch.no_grad():
        out = _compile(written_heads_first)(*args)
    sites = _sites()
    assert len(sites) == 1 and sites[0].detail.startswith("q heads-first, ") and _misses() == [], str(dsfuse.report())
    torch.testing.assert_close(out, own_mla(q, q_pe, *rest), rtol=1e-5, atol=1e-5, equal_nan=True)


def _selection_bias(idx, seq, dtype):
    """The selection alone as an additive bias, [B, 1, S, T]: 0 at the picks, -inf elsewhere."""
    bias = torch.zeros(idx.shape[0], 1, idx.shape[1], seq, dtype=dtype)
    bias[select_mask(idx, seq)] = float("-inf")
    return bias


def mask_then_bias_sink(q, k, v, idx, mask, sink):
    """`scores + mask + bias`, a per-head sink in the denominator."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * SCALE + mask + _selection_bias(idx, k.shape[2], q.dtype)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink.view(1, -1, 1, 1))
    weights = torch.exp(scores - top)
    return torch.matmul(weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink.view(1, -1, 1, 1) - top)), v)


def summed_masks_sdpa(q, k, v, idx, mask, sink):
    """`mask + bias` handed to SDPA as one mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask + _selection_bias(idx, k.shape[2], q.dtype),
                                          scale=SCALE)


@pytest.mark.parametrize("fn", [mask_then_bias_sink, summed_masks_sdpa])
def test_selection_bias_summed_with_an_additive_mask_is_fused(fn):
    """A -inf selection bias summed with an HF additive mask: the op with that mask and a hard selection. Without a
    sink, a row whose picks are all masked (batch 1's padding queries, early queries that picked only future keys)
    attends over its picks alone, where HF's finfo.min fill would spread it over every key: binding the mask alone
    is wrong there (with a sink, both leave such a row to the sink)."""
    args = (*_data(dv=8, mask_kind="additive"), torch.randn(H, generator=torch.Generator().manual_seed(3)))
    with torch.no_grad():
        out = _compile(fn)(*args)
        want = fn(*args)
    sites = _sites()
    assert len(sites) == 1 and _misses() == [], str(dsfuse.report())
    assert sites[0].op == "dsfuse.sparse_attention_masked" and "additive mask plus a -inf selection bias" in \
        sites[0].detail and ("sink" in sites[0].detail) == (fn is mask_then_bias_sink), sites[0].detail
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    if fn is summed_masks_sdpa:
        assert not torch.allclose(sparse_attention_masked_reference(*args[:5], SCALE), want, atol=1e-3)


def test_plain_softmax_over_summed_masks_is_reported():
    """Without a sink or SDPA's safe softmax, a row whose picks the mask sets to -inf is NaN in the source (0 in the
    op): reported, and the compiled graph stays the source's."""
    def two_additive(q, k, v, idx, mask):
        scores = torch.matmul(q, k.transpose(-1, -2)) * SCALE + mask + _selection_bias(idx, k.shape[2], q.dtype)
        return torch.matmul(F.softmax(scores, dim=-1), v)

    args = _data(dv=8, mask_kind="additive")
    with torch.no_grad():
        out = _compile(two_additive)(*args)
    assert _sites() == [] and len(_misses()) == 1 and _misses()[0].startswith(
        "plain softmax over a -inf selection bias summed with an additive mask gives NaN"), str(dsfuse.report())
    torch.testing.assert_close(out, two_additive(*args), rtol=1e-5, atol=1e-5, equal_nan=True)
