"""`indexer_topk` on small graphs written like the HF / official indexer: what matches, what is
reported as a near-miss, what is left alone silently, and dynamic sequence lengths."""

import pytest
import torch
import torch.nn.functional as F

import dsfuse
from dsfuse.kernels.indexer_topk import indexer_topk_reference
from dsfuse.passes import indexer_topk, verify

B, S, T, H, D, K = 2, 9, 9, 4, 16, 5
SCALE = D**-0.5


def hf_indexer(q, k, w, mask, topk=K):
    """HF `DeepseekV32Indexer`'s scoring, verbatim in structure."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE
    scores = F.relu(scores)
    index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    if mask is None:
        pass
    elif mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~mask, float("-inf"))
    else:
        index_scores = index_scores + mask
    return index_scores.topk(min(topk, index_scores.shape[-1]), dim=-1).indices.to(torch.int32)


def hf_scores(q, k, w, mask):
    s = torch.matmul(F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE).transpose(2, 3),
                     w.unsqueeze(-1)).squeeze(-1)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s


def _data(dtype=torch.bfloat16, seq=S):
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(B, seq, H, D, generator=gen).to(dtype)
    k = torch.randn(B, seq, D, generator=gen).to(dtype)
    w = torch.randn(B, seq, H, generator=gen)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().expand(B, seq, seq)
    return q, k, w, causal


def selection(idx, num_keys):
    """What attention sees of the top-k: the set of picked keys (HF scatters the indices into a mask).
    Slot `num_keys` collects -1 picks."""
    idx = torch.where(idx < 0, num_keys, idx).long()
    return torch.zeros(*idx.shape[:-1], num_keys + 1, dtype=torch.bool, device=idx.device).scatter(-1, idx, True)


def selecting(fn):
    def wrapped(q, k, *args):
        return selection(fn(q, k, *args), k.shape[1])

    return wrapped


def _assert_same_selection(sel, q, k, w, mask, count=K):
    """Each row picks `count` distinct keys whose scores are the reference's top-k scores."""
    scores = hf_scores(q, k, w, mask)
    count = min(count, scores.shape[-1])
    picked = sel[..., :-1]
    assert torch.equal(picked.sum(-1), torch.full(picked.shape[:-1], count))
    got = scores.masked_select(picked).view(*scores.shape[:-1], count).sort(dim=-1, descending=True).values
    torch.testing.assert_close(got, scores.topk(count, dim=-1).values)


def _compile(fn, **kw):
    return torch.compile(selecting(fn), backend="dsfuse", options={"enable": ["indexer_topk"]}, **kw)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_hf_spelling_matches_once(mask_kind):
    q, k, w, causal = _data()
    mask = {"bool": causal, "additive": torch.zeros(B, S, S).masked_fill(~causal, float("-inf")), "none": None}[mask_kind]
    sel = _compile(hf_indexer)(q, k, w, mask)
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 1, str(rep)
    assert "in topk order" not in rep.sites[0].detail, "only scattered: the order is not seen"
    _assert_same_selection(sel, q, k, w, mask)


def test_official_fp8_form_with_key_scale():
    q, k, w, causal = _data(torch.float8_e4m3fn)
    k_scale = torch.rand(B, S) + 0.5

    def fp8_indexer(q, k, w, k_scale, mask):
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2) * k_scale.unsqueeze(1)
        return index.masked_fill(~mask, float("-inf")).topk(K, dim=-1).indices

    sel = _compile(fp8_indexer)(q, k, w, k_scale, causal)
    assert dsfuse.report().counts["indexer_topk"] == 1, str(dsfuse.report())
    expected = selection(indexer_topk_reference(q, k, w, k_scale, causal, 1.0, K), S)
    ref_scores = (torch.matmul(w.unsqueeze(-2), F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))))
                  .squeeze(-2) * k_scale.unsqueeze(1)).masked_fill(~causal, float("-inf"))

    def picked(sel):
        return ref_scores.masked_select(sel[..., :-1]).view(B, S, K).sort(-1, descending=True).values

    torch.testing.assert_close(picked(sel), picked(expected))


def test_k_larger_than_keys_gives_all_keys():
    q, k, w, causal = _data(seq=4)
    sel = _compile(hf_indexer)(q, k, w, causal[:, :4, :4], 8)
    assert dsfuse.report().counts["indexer_topk"] == 1
    assert sel[..., :4].all() and not sel[..., 4].any()


def test_used_values_are_a_reported_near_miss():
    q, k, w, causal = _data()

    def values_too(q, k, w, mask):
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~mask, float("-inf"))
        top = index.topk(K, dim=-1)
        return top.indices, top.values

    torch.compile(values_too, backend="dsfuse")(q, k, w, causal)
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 0
    assert [m.reason for m in rep.near_misses] == ["the top-k values are used downstream (the fused op returns indices only)"]
    assert "top-k values are used downstream" in str(rep)


def test_smallest_k_is_a_reported_near_miss():
    q, k, w, _ = _data()

    def smallest(q, k, w):
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
        return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).topk(K, dim=-1, largest=False).indices

    torch.compile(smallest, backend="dsfuse")(q, k, w)
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 0
    assert [m.reason for m in rep.near_misses] == ["top-k of the smallest scores"]


def test_unrelated_topk_is_left_alone_silently():
    def router(x, weight):
        return torch.topk(torch.sigmoid(x @ weight.t()), 2, dim=-1).indices

    torch.compile(router, backend="dsfuse")(torch.randn(6, 8), torch.randn(4, 8))
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 0 and rep.near_misses == []


def test_negative_scale_is_not_fused():
    q, k, w, causal = _data()

    def negative(q, k, w, mask):
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * -0.5)
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~mask, float("-inf"))
        return index.topk(K, dim=-1).indices

    _compile(negative)(q, k, w, causal)
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 0
    assert [m.reason for m in rep.near_misses] == ["a non-positive score scale does not commute with relu"]


def test_dynamic_sequence_length_does_not_recompile_per_length():
    fn = _compile(hf_indexer)
    for seq in (9, 13, 17, 21):
        q, k, w, causal = _data(seq=seq)
        _assert_same_selection(fn(q, k, w, causal), q, k, w, causal)
    rep = dsfuse.report()
    # One static graph for the first length, then one graph with a symbolic length for all others.
    assert len(rep.graphs) == 2, str(rep)
    assert rep.counts["indexer_topk"] == 2


def test_disabled_pass_leaves_graph_alone():
    q, k, w, causal = _data()
    out = torch.compile(hf_indexer, backend="dsfuse", options={"disable": ["indexer_topk"]})(q, k, w, causal)
    assert dsfuse.report().counts["indexer_topk"] == 0
    torch._dynamo.reset()
    assert torch.equal(out, torch.compile(hf_indexer, backend="inductor")(q, k, w, causal))


def test_sorted_indices_leaving_the_graph_come_in_topk_order():
    """The caller sees the slots: the fused op is asked for torch.topk's order and the indices equal eager's."""
    q, k, w, _ = _data()
    mask = torch.ones(S, S, dtype=torch.bool).tril() | (torch.arange(S) < K)  # K valid keys in every row
    mask = mask.expand(B, S, S)
    idx = torch.compile(hf_indexer, backend="dsfuse")(q, k, w, mask)
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 1 and rep.near_misses == [], str(rep)
    assert "in topk order" in rep.sites[0].detail
    assert torch.equal(idx, hf_indexer(q, k, w, mask))


def test_unsorted_indices_may_leave_the_graph():
    q, k, w, causal = _data()

    def unsorted(q, k, w, mask):
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~mask, float("-inf"))
        return index.topk(K, dim=-1, sorted=False).indices

    idx = torch.compile(unsorted, backend="dsfuse")(q, k, w, causal)
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 1 and "in topk order" not in rep.sites[0].detail
    _assert_same_selection(selection(idx, S), q, k, w, causal)


def einsum_mul_sum(q, k, w, mask):
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * SCALE)
    index = (scores * w.unsqueeze(-1)).sum(dim=2)
    return index.masked_fill(~mask, float("-inf")).topk(K, dim=-1).indices


def einsum_einsum(q, k, w, mask):
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * SCALE)
    return (torch.einsum("bsht,bsh->bst", scores, w) + mask).topk(K, dim=-1).indices


@pytest.mark.parametrize("fn", [einsum_mul_sum, einsum_einsum], ids=["einsum+mul-sum", "einsum+einsum"])
def test_einsum_spellings_match(fn):
    q, k, w, causal = _data()
    mask = causal if fn is einsum_mul_sum else torch.zeros(B, S, S).masked_fill(~causal, float("-inf"))
    sel = _compile(fn)(q, k, w, mask)
    assert dsfuse.report().counts["indexer_topk"] == 1, str(dsfuse.report())
    _assert_same_selection(sel, q, k, w, mask)


def batch1_mm(q, k, w, mask):
    """The decode-step indexer at batch 1 as Inductor leaves it on CUDA: each batch-1 bmm is squeeze -> mm ->
    unsqueeze."""
    heads = q.shape[2]
    scores = torch.mm(q.float().reshape(1, heads, D).squeeze(0), k.float().transpose(1, 2).squeeze(0)).unsqueeze(0)
    scores = torch.relu(scores.view(1, 1, heads, -1) * SCALE)
    index = torch.mm(w.reshape(1, 1, heads).squeeze(0), scores.reshape(1, heads, -1).squeeze(0)).unsqueeze(0)
    return index.view(1, 1, -1).masked_fill(~mask, float("-inf")).topk(K, dim=-1).indices


def test_batch1_mm_form_matches():
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 1, H, D, generator=gen), torch.randn(1, T + 3, D, generator=gen)
    w, mask = torch.randn(1, 1, H, generator=gen), torch.ones(1, 1, T + 3, dtype=torch.bool)
    mask[..., -2:] = False
    sel = _compile(batch1_mm)(q, k, w, mask)
    assert dsfuse.report().counts["indexer_topk"] == 1, str(dsfuse.report())
    _assert_same_selection(sel, q, k, w, mask)


def test_transposed_scores_are_a_reported_near_miss():
    q, k, w, _ = _data()

    def keys_first(q, k, w):
        scores = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * SCALE)
        return torch.einsum("bsht,bsh->bts", scores, w).topk(K, dim=-1).indices

    torch.compile(keys_first, backend="dsfuse")(q, k, w)
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 0
    assert [m.reason for m in rep.near_misses] == [
        "the contraction is not sum_h w[b,s,h] * relu(q[b,s,h,:] . k[b,t,:]) over [B, S, T]"]


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_masked_picks_marked_minus_one(mask_kind):
    """Official-style consumers mark picks of masked keys with -1 through `values == -inf`."""
    q, k, w, causal = _data(seq=7)  # 7 keys, K=5: the first rows have fewer valid keys than K
    mask = {"bool": causal, "additive": torch.zeros(B, 7, 7).masked_fill(~causal, float("-inf")), "none": None}[mask_kind]

    def marked(q, k, w, mask):
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
        if mask is not None:
            index = index.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else index + mask
        values, indices = index.topk(K, dim=-1)
        return torch.where(values == float("-inf"), torch.full_like(indices, -1), indices)

    sel = _compile(marked)(q, k, w, mask)
    assert dsfuse.report().counts["indexer_topk"] == 1, str(dsfuse.report())
    expected = selecting(marked)(q, k, w, mask)
    # The -1 slot and the valid picks are the same sets as eager's (the random scores have no ties).
    assert torch.equal(sel, expected)
    if mask is not None:
        assert sel[..., -1].any(), "rows with fewer valid keys than K must get -1 picks"


def test_v4_csa_indexer_is_rewritten_once_and_matches_eager():
    """DeepSeek V4's CSA indexer over compressed keys (causal threshold (pos + 1) // m, picks past it
    replaced by -1). S = 14 with m = 4: not a multiple of m, fewer compressed entries (3) than
    index_topk (4), so every row has masked picks, which must all come back as -1; batch 2."""
    from dsfuse.models.presets import build_hf_model

    model = build_hf_model("v4-tiny", num_hidden_layers=2, hc_sinkhorn_iters=2,
                           layer_types=["sliding_attention", "compressed_sparse_attention"],
                           mlp_layer_types=["moe", "moe"])
    ids = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        got = torch.compile(model, backend="dsfuse", options={"enable": ["indexer_topk"]})(ids, use_cache=False).logits
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 1 and rep.near_misses == [], str(rep)
    assert "in topk order" not in rep.sites[0].detail, "the picks are only scattered into the block bias"
    torch.testing.assert_close(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_dynamic_true_keeps_a_module_scale_and_reports_a_scale_passed_as_an_argument():
    """`dynamic=True` passes every Python float in as a 0-d tensor. dsfuse bakes back the one read from the module
    (the HF indexer's `softmax_scale`), so the site is fused as under the default compile; a scale the caller passes
    to the compiled function stays an input whose value may change between calls, and the report says so."""

    class Indexer(torch.nn.Module):
        softmax_scale = SCALE

        def forward(self, q, k, w, mask, scale=None):
            scale = self.softmax_scale if scale is None else scale
            scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
            index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~mask, float("-inf"))
            return index_scores.topk(K, dim=-1).indices

    q, k, w, causal = _data()
    with torch.no_grad():
        want = Indexer()(q, k, w, causal)
        got = torch.compile(Indexer(), backend="dsfuse", dynamic=True)(q, k, w, causal)
    assert dsfuse.report().counts["indexer_topk"] == 1 and not dsfuse.report().near_misses, str(dsfuse.report())
    torch.testing.assert_close(selection(got, S), selection(want, S), rtol=0, atol=0)

    torch._dynamo.reset()
    dsfuse.reset_report()
    with torch.no_grad():
        torch.compile(Indexer(), backend="dsfuse", dynamic=True)(q, k, w, causal, SCALE)
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 0
    assert [m.reason for m in rep.near_misses] == [
        "the score scale is a 0-d tensor, not a constant: a Python float passed to the compiled call under "
        "torch.compile(dynamic=True) is a graph input whose value may change between calls (dsfuse bakes in the "
        "floats it reads from module attributes, guarded, not the call's arguments)"], str(rep)


def test_indexer_with_a_wrong_mask_polarity_is_refused_by_the_numeric_check(monkeypatch):
    """A hand walk that bound the mask with the wrong polarity: the probes catch it, and the site is a near-miss
    naming the failing probe, not a wrong rewrite."""
    split = indexer_topk._split_mask

    def flipped(x):
        scores, mask = split(x)
        return scores, (("keep" if mask[0] == "drop" else "drop"), mask[1]) if mask else None

    monkeypatch.setattr(indexer_topk, "_split_mask", flipped)
    verify.clear_cache()  # a verdict for this slice may be cached from a right binding
    gen = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(2, 9, 4, 16, generator=gen), torch.randn(2, 9, 16, generator=gen), torch.rand(2, 9, 4) + 0.5
    keep = (torch.ones(9, 9, dtype=torch.bool).tril() | (torch.arange(9) < 4)).expand(2, 9, 9)

    def indexer(q, k, w, keep):
        scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * 0.25)
        return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~keep, float("-inf")).topk(4).indices

    with torch._inductor.config.patch(force_disable_caches=True):
        got = torch.compile(indexer, backend="dsfuse", options={"enable": ["indexer_topk"]})(q, k, w, keep)
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 0, str(rep)
    [miss] = rep.near_misses
    assert miss.reason.startswith("numeric check against the reference failed: random probe:"), miss.reason
    assert torch.equal(got, indexer(q, k, w, keep))
