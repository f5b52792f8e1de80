"""Spelling corpus for the DSA lightning indexer: independent formulations of the same math (and a few
that only look like it), each with its declared outcome, compiled with `backend="dsfuse"` on tiny CPU
shapes. Every entry must end exactly as declared (rewritten / reported near-miss with that reason / left
alone) and agree with eager.

Each formulation is written after the code named in its `source`: the official DeepSeek V3.2 inference
indexer (fp8 keys with per-key scales, the query scale folded into the head weights), vLLM's and SGLang's
torch references (one sequence, no batch dim), and transformers' V3.2, GLM-MoE-DSA and V4 indexers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from harness import LEFT_ALONE, NEAR_MISS, REWRITTEN, Entry, check_coverage, run_entry

B, S, H, D, K = 2, 12, 8, 16, 4
T = S
SCALE = D**-0.5
RATIO = 2  # V4 CSA compress rate: S tokens give S // RATIO compressed keys


def _inputs(dtype=torch.bfloat16, seed=0):
    """q [B,S,H,D], k [B,T,D], positive head weights [B,S,H] (no zero-score ties near the k-th pick), and a
    causal mask that also shows the first K keys to every query, so every row has K valid picks."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, S, H, D, generator=gen) * 2).to(dtype)
    k = (torch.randn(B, T, D, generator=gen) * 2).to(dtype)
    w = torch.rand(B, S, H, generator=gen) + 0.5
    t, s = torch.arange(T)[None, :], torch.arange(S)[:, None]
    visible = ((t <= s) | (t < K)).expand(B, S, T)
    return q, k, w, visible


def _additive(keep):
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))


# --------------------------------------------------------------------------------------- formulations
def hf_v32(q, k, w, keep):
    """transformers DeepseekV32Indexer: matmul of fp32 upcasts, scale, relu, [1,H] @ [H,T] head sum,
    masked_fill of the negated bool mask, top-k of min(k, T), int32 indices returned."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~keep, float("-inf"))
    return index.topk(min(K, index.shape[-1]), dim=-1).indices.to(torch.int32)


def hf_v32_additive(q, k, w, additive):
    """The same HF indexer with a float (0 / -inf) attention mask added."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2) + additive
    return index.topk(min(K, index.shape[-1]), dim=-1).indices.to(torch.int32)


def glm_moe_dsa(q, k, w, mask4d):
    """transformers GlmMoeDsa: the indexer reads the [B,1,S,T] additive mask's first head, and attention
    scatters the picks into a 0 / -inf sparse mask (the picks' order is never seen)."""
    mask = mask4d[:, 0, :, :]
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE
    index = torch.matmul(w.unsqueeze(-2), F.relu(scores)).squeeze(-2) + mask
    picks = index.topk(min(K, index.shape[-1]), dim=-1).indices.to(torch.int32)
    sparse = torch.full_like(mask4d, float("-inf")).scatter(-1, picks.long().unsqueeze(1), 0.0)
    return sparse + mask4d


def official_fp8(q8, k8, k_scale, w_folded, additive):
    """Official V3.2 inference: fp8 q/k, logits relu(q.k) per head times weights that already carry the
    query scale and softmax scale, summed over heads, times the per-key scale; mask added; `topk(...)[1]`."""
    logits = torch.einsum("bshd,btd->bsht", q8.float(), k8.float()).relu()
    index = (logits * w_folded.unsqueeze(-1)).sum(dim=2) * k_scale.unsqueeze(1)
    index += additive
    return index.topk(min(K, index.shape[-1]), dim=-1)[1]


def official_fp8_one_sequence(q8, k8, k_scale, w_folded, additive):
    """The official fp8 scorer for one sequence (no batch dim): q [S,H,D], k [T,D], k_scale [T]."""
    logits = torch.relu(torch.einsum("shd,td->sht", q8.float(), k8.float()))
    index = torch.einsum("sht,sh->st", logits, w_folded) * k_scale
    return (index + additive).topk(K, dim=-1, sorted=False).indices


def vllm_ref_logits(q, kv, weights, ks, ke):
    """vLLM's `ref_fp8_mqa_logits` form: one flat sequence, key range [ks, ke) per query from arange
    comparisons, `einsum('mhd,nd->hmn')`, relu times transposed weights summed over heads, masked_fill."""
    n = kv.shape[0]
    keep = (torch.arange(n)[None, :] >= ks[:, None]) & (torch.arange(n)[None, :] < ke[:, None])
    score = torch.einsum("mhd,nd->hmn", q.float(), kv.float())
    logits = (score.relu() * weights.unsqueeze(-1).transpose(0, 1)).sum(dim=0)
    logits = logits.masked_fill(~keep, float("-inf"))
    return torch.topk(logits, K, dim=-1).indices


def sglang_keys_first(q, k, w, keep):
    """SGLang-style torch fallback for one sequence: keys times all (query, head) columns in one mm,
    relu, head sum, then transposed to [S, T]; `torch.where(keep, x, -inf)`."""
    seq, heads, dim = q.shape
    logits = torch.mm(k.float(), q.float().reshape(seq * heads, dim).t()).view(-1, seq, heads)
    index = (F.relu(logits * SCALE) * w.unsqueeze(0)).sum(-1).t()
    return torch.where(keep, index, float("-inf")).topk(K, dim=-1, sorted=False).indices


def clamp_min_mul_sum(q, k, w, keep):
    """relu spelled `clamp_min(x, 0)`, head sum as mul + sum over the head dim, `where(keep, x, -inf)`."""
    scores = torch.clamp_min(torch.matmul(q.float(), k.float().transpose(1, 2).unsqueeze(1)) * SCALE, 0)
    index = (scores * w[..., None]).sum(dim=2)
    return torch.where(keep, index, torch.tensor(float("-inf"))).topk(K, dim=-1).indices


def div_sqrt_d(q, k, w, keep):
    """Scale spelled `x / sqrt(D)`; the result transposed [B,S,H,T] -> [B,S,T,H] before a matmul head sum."""
    scores = torch.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) / math.sqrt(D))
    index = torch.matmul(scores.transpose(2, 3), w.unsqueeze(-1)).squeeze(-1)
    return index.masked_fill(keep.logical_not(), float("-inf")).topk(K, dim=-1, sorted=False).indices


def scale_folded_into_q(q, k, w, keep):
    """The softmax scale folded into the fp32 query before the product (no scale on the scores)."""
    qs = q.float() * SCALE
    index = torch.einsum("bsht,bsh->bst", torch.relu(torch.einsum("bshd,btd->bsht", qs, k.float())), w)
    return index.masked_fill(~keep, float("-inf")).topk(K, dim=-1).indices


def keys_first_then_transpose(q, k, w, keep):
    """`k @ q^T` ([B,1,T,D] @ [B,S,D,H] = [B,S,T,H]), transposed back to [B,S,H,T] before relu."""
    scores = torch.matmul(k.float().unsqueeze(1), q.float().transpose(2, 3)).transpose(2, 3)
    index = (F.relu(scores * SCALE) * w.unsqueeze(-1)).sum(2)
    return index.masked_fill(~keep, float("-inf")).topk(K, dim=-1).indices


def fp32_relu_times_scale(q, k, w, keep):
    """fp32 inputs (no upcast), scale applied after relu (`relu(x) * c`, as V4's scorer does)."""
    scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1))) * SCALE
    index = (scores * w.unsqueeze(-1)).sum(dim=2) + _additive(keep)
    top = torch.topk(index, K, dim=-1, largest=True, sorted=True)
    return top.indices


def hf_v4_csa(q, compressed, w, position_ids):
    """transformers DeepseekV4Indexer on compressed keys: fp32 product, relu then scale, mul + sum head
    sum, entries at or past (pos + 1) // m masked, top-k, picks past the threshold replaced by -1."""
    scores = F.relu(torch.matmul(q.float(), compressed.transpose(-1, -2).float().unsqueeze(1))) * SCALE
    index = (scores * w.unsqueeze(-1)).sum(dim=2)
    threshold = (position_ids + 1) // RATIO
    entries = torch.arange(compressed.shape[1])
    future = entries.view(1, 1, -1) >= threshold.unsqueeze(-1)
    index = index.masked_fill(future, float("-inf"))
    picks = index.topk(min(K, compressed.shape[1]), dim=-1).indices
    invalid = picks >= threshold.unsqueeze(-1)
    return torch.where(invalid, torch.full_like(picks, -1), picks)


def first_picks_scattered(q, k, w, keep):
    """Only the two best of the top-k reach the sparse mask: `where(arange(k) < 2, idx, T)` reads the slots,
    so the op must give them in torch.topk's order even though they are then scattered."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~keep, float("-inf"))
    picks = index.topk(K, dim=-1).indices
    best = torch.where(torch.arange(K) < 2, picks, k.shape[1])
    return torch.zeros(*index.shape[:-1], k.shape[1] + 1, dtype=torch.bool).scatter(-1, best, True)


def _masked_index(q, k, w, keep):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~keep, float("-inf"))


def sort_descending_prefix(q, k, w, keep):
    """Top-k as the first k of a descending sort's indices, returned (the caller sees the slots)."""
    return _masked_index(q, k, w, keep).sort(dim=-1, descending=True).indices[..., :K]


def argsort_prefix_scattered(q, k, w, keep):
    """Top-k as `argsort(descending)[..., :k]`, scattered into a bool selection."""
    picks = torch.argsort(_masked_index(q, k, w, keep), dim=-1, descending=True)[..., :K]
    return torch.zeros(keep.shape, dtype=torch.bool).scatter(-1, picks, True)


def stable_sort_minus_one(q, k, w, keep):
    """A stable descending sort; picks whose sorted value is -inf marked -1 (official-style), from the prefixes."""
    values, picks = torch.sort(_masked_index(q, k, w, keep), dim=-1, descending=True, stable=True)
    return torch.where(values[..., :K] == float("-inf"), -1, picks[..., :K])


def heads_first_q(q_hf, k, w, keep):
    """q held heads-first [B,H,S,D] throughout: scores [B,H,S,T], head sum over dim 1."""
    scores = F.relu(torch.matmul(q_hf.float(), k.float().transpose(-1, -2).unsqueeze(1)) * SCALE)
    index = (scores * w.transpose(1, 2).unsqueeze(-1)).sum(dim=1)
    return index.masked_fill(~keep, float("-inf")).topk(K, dim=-1, sorted=False).indices


def keys_stored_transposed(q, k_t, w, keep):
    """k kept as k^T [B,D,T] (keys last), multiplied without a transpose."""
    scores = F.relu(torch.matmul(q.float(), k_t.float().unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    return index.masked_fill(~keep, float("-inf")).topk(K, dim=-1).indices


def finfo_min_fill(q, k, w, keep):
    """Masked keys filled with fp32's lowest finite value, not -inf (as attention masks are often built)."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    return index.masked_fill(~keep, torch.finfo(torch.float32).min).topk(K, dim=-1).indices


def zero_fill(q, k, w, keep):
    """Masked keys filled with 0 under head weights of both signs: a masked key outranks every unmasked key whose
    weighted score is negative, so the picks are not -inf's."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    return torch.where(keep, index, 0.0).topk(K, dim=-1, sorted=False).indices


def finite_fill_minus_one(q, k, w, keep):
    """Picks whose value is -inf marked -1 under a -1e9 fill: true only of unmasked keys scoring -inf."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~keep, -1e9)
    values, picks = index.topk(K, dim=-1)
    return torch.where(values == float("-inf"), -1, picks)


def ascending_argsort_tail(q, k, w, keep):
    """The last k of an ascending argsort: the same keys, read as a suffix (not a prefix)."""
    return torch.argsort(_masked_index(q, k, w, keep), dim=-1)[..., -K:]


def kthvalue_threshold(q, k, w, keep):
    """Keys at or above the k-th largest score, as a bool selection."""
    index = _masked_index(q, k, w, keep)
    return index >= torch.kthvalue(index, index.shape[-1] - K + 1, dim=-1, keepdim=True).values


def bf16_scores(q, k, w, keep):
    """No fp32 upcast: the q.k product is bf16."""
    scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores.float()).squeeze(-2).masked_fill(~keep, float("-inf"))
    return index.topk(K, dim=-1, sorted=False).indices


def values_returned(q, k, w, keep):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~keep, float("-inf"))
    top = index.topk(K, dim=-1)
    return top.values, top.indices


def per_query_scale(q, k, w, keep):
    """Scores scaled by a per-query tensor inside relu (not a constant)."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * w[..., :1].unsqueeze(-1))
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~keep, float("-inf"))
    return index.topk(K, dim=-1, sorted=False).indices


def smallest_scores(q, k, w, keep):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    return index.topk(K, dim=-1, largest=False, sorted=False).indices


def softmax_attention_topk(q, k, w, keep):
    """Top-k of softmax attention probabilities: a top-k over q.k, but no head-weighted relu sum."""
    probs = torch.softmax(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE, dim=-1)
    return probs.mean(dim=2).topk(K, dim=-1, sorted=False).indices


def router_topk(x, weight):
    return torch.topk(torch.sigmoid(x @ weight.t()), 2, dim=-1).indices


# --------------------------------------------------------------------------------------- inputs
def _v32(dtype=torch.bfloat16):
    return lambda: _inputs(dtype)


def _v32_additive():
    q, k, w, keep = _inputs()
    return q, k, w, _additive(keep)


def _glm():
    q, k, w, keep = _inputs()
    return q, k, w, _additive(keep).unsqueeze(1)


def _fp8(one_sequence=False):
    def make():
        q, k, w, keep = _inputs(torch.float8_e4m3fn)
        gen = torch.Generator().manual_seed(1)
        k_scale = torch.rand(B, T, generator=gen) + 0.5
        w_folded = w * (torch.rand(B, S, H, generator=gen) + 0.5) * SCALE  # weights * q_scale * softmax_scale
        args = q, k, k_scale, w_folded, _additive(keep)
        return tuple(a[0] for a in args) if one_sequence else args

    return make


def _vllm():
    q, k, w, _ = _inputs()
    ks = torch.zeros(S, dtype=torch.int64)
    ke = torch.arange(S) + K  # query s sees keys [0, s + K): every row has K valid keys
    ke = ke.clamp(max=T)
    return q[0], k[0], w[0], ks, ke


def _one_sequence():
    q, k, w, keep = _inputs()
    return q[0], k[0], w[0], keep[0]


def _v4(batch=B, seq=S):
    gen = torch.Generator().manual_seed(4)
    q = (torch.randn(batch, seq, H, D, generator=gen) * 2).to(torch.bfloat16)
    compressed = (torch.randn(batch, seq // RATIO, D, generator=gen) * 2).to(torch.bfloat16)
    w = torch.rand(batch, seq, H, generator=gen) + 0.5
    return q, compressed, w, torch.arange(seq).expand(batch, seq)


def _signed_weights():
    """Head weights of both signs, a causal mask (rows 0-2 see fewer than K keys: masked keys are picked too)."""
    q, k, w, _ = _inputs()
    t, s = torch.arange(T)[None, :], torch.arange(S)[:, None]
    return q, k, w - 1.0, (t <= s).expand(B, S, T)


def _fp32():
    q, k, w, keep = _inputs()
    return q.float(), k.float(), w, keep


def _heads_first():
    q, k, w, keep = _inputs()
    return q.transpose(1, 2).contiguous(), k, w, keep


def _keys_last():
    q, k, w, keep = _inputs()
    return q, k.transpose(1, 2).contiguous(), w, keep


def _router():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(6, 8, generator=gen), torch.randn(4, 8, generator=gen)


# --------------------------------------------------------------------------------------- the corpus
@dataclass(frozen=True)
class IndexerEntry(Entry):
    order_seen: bool = True  # False: compare each row's picks as a set (sorted=False, nothing sees the order)
    in_topk_order: bool | None = None  # for a rewrite: whether the op is asked for torch.topk's slot order


NOT_FP32 = "scores are computed in torch.bfloat16, not fp32"
VALUES_USED = "the top-k values are used downstream (the fused op returns indices only)"
TENSOR_SCALE = "scores are scaled by a tensor, not a constant"
SMALLEST = "top-k of the smallest scores"
NOT_A_PREFIX = "the sorted scores are read other than as a prefix [..., :k] along the key dim"
KTHVALUE = "keys selected by a kthvalue threshold (the fused op returns a top-k index set)"
FINITE_FILL_MARKS = "the top-k values are compared with -inf under a fill of -1e+09 (only a -inf fill marks the masked picks)"

CORPUS = {
    "hf_v32_bool_mask": IndexerEntry(hf_v32, "transformers DeepseekV32Indexer", _v32(), REWRITTEN, 1, in_topk_order=True),
    "hf_v32_additive_mask": IndexerEntry(hf_v32_additive, "transformers DeepseekV32Indexer", _v32_additive, REWRITTEN, 1),
    "glm_moe_dsa_scattered": IndexerEntry(glm_moe_dsa, "transformers GlmMoeDsaIndexer + attention", _glm, REWRITTEN, 1,
                                   in_topk_order=False),
    "official_fp8_k_scale": IndexerEntry(official_fp8, "DeepSeek V3.2 inference Indexer + fp8_index", _fp8(), REWRITTEN, 1),
    "official_fp8_one_sequence": IndexerEntry(official_fp8_one_sequence, "DeepSeek V3.2 inference fp8_index, one sequence",
                                       _fp8(one_sequence=True), REWRITTEN, 1, order_seen=False),
    "vllm_ref_mqa_logits": IndexerEntry(vllm_ref_logits, "vLLM ref_fp8_mqa_logits", _vllm, REWRITTEN, 1),
    "sglang_keys_first_mm": IndexerEntry(sglang_keys_first, "SGLang NSA indexer torch fallback", _one_sequence, REWRITTEN, 1,
                                  order_seen=False),
    "clamp_min_where_keep": IndexerEntry(clamp_min_mul_sum, "written for the corpus (clamp_min, where polarity)", _v32(),
                                  REWRITTEN, 1),
    "div_sqrt_d_transposed_head_sum": IndexerEntry(div_sqrt_d, "written for the corpus (x / sqrt(D))", _v32(), REWRITTEN, 1,
                                            order_seen=False),
    "scale_folded_into_q": IndexerEntry(scale_folded_into_q, "written for the corpus (scale in q)", _v32(), REWRITTEN, 1),
    "keys_first_then_transpose": IndexerEntry(keys_first_then_transpose, "written for the corpus (k @ q^T)", _v32(),
                                       REWRITTEN, 1),
    "fp32_relu_times_scale": IndexerEntry(fp32_relu_times_scale, "transformers DeepseekV4IndexerScorer (fp32 inputs)",
                                   _fp32, REWRITTEN, 1),
    "hf_v4_csa_minus_one": IndexerEntry(hf_v4_csa, "transformers DeepseekV4Indexer", _v4, REWRITTEN, 1, in_topk_order=True),
    "first_picks_scattered": IndexerEntry(first_picks_scattered, "written for the corpus (slots read, then scattered)", _v32(),
                                   REWRITTEN, 1, in_topk_order=True),
    "sort_descending_prefix": IndexerEntry(sort_descending_prefix, "written for the corpus (sort + prefix)", _v32(),
                                           REWRITTEN, 1, in_topk_order=True),
    "argsort_prefix_scattered": IndexerEntry(argsort_prefix_scattered, "written for the corpus (argsort + prefix)",
                                             _v32(), REWRITTEN, 1, in_topk_order=False),
    "stable_sort_minus_one": IndexerEntry(stable_sort_minus_one, "written for the corpus (stable sort, -1 marks)",
                                          _v32(), REWRITTEN, 1, in_topk_order=True),
    "heads_first_q": IndexerEntry(heads_first_q, "written for the corpus (q heads-first)", _heads_first, REWRITTEN, 1,
                                  order_seen=False),
    "keys_stored_transposed": IndexerEntry(keys_stored_transposed, "written for the corpus (k^T held)", _keys_last,
                                           REWRITTEN, 1),
    "finfo_min_fill": IndexerEntry(finfo_min_fill, "written for the corpus (finfo.min fill)", _v32(), REWRITTEN, 1,
                                   detail="filled with -3.40282e+38"),
    "zero_fill_signed_weights": IndexerEntry(zero_fill, "written for the corpus (0 fill, weights of both signs)",
                                             _signed_weights, REWRITTEN, 1, detail="filled with 0", order_seen=False),
    "ascending_argsort_tail": IndexerEntry(ascending_argsort_tail, "written for the corpus", _v32(), NEAR_MISS,
                                           reason=NOT_A_PREFIX),
    "kthvalue_threshold": IndexerEntry(kthvalue_threshold, "written for the corpus", _v32(), NEAR_MISS,
                                       reason=KTHVALUE),
    "finite_fill_minus_one": IndexerEntry(finite_fill_minus_one, "written for the corpus", _v32(), NEAR_MISS,
                                          reason=FINITE_FILL_MARKS),
    "bf16_product": IndexerEntry(bf16_scores, "written for the corpus", _v32(), NEAR_MISS, reason=NOT_FP32),
    "values_returned": IndexerEntry(values_returned, "written for the corpus", _v32(), NEAR_MISS, reason=VALUES_USED),
    "per_query_tensor_scale": IndexerEntry(per_query_scale, "written for the corpus", _v32(), NEAR_MISS, reason=TENSOR_SCALE),
    "smallest_k": IndexerEntry(smallest_scores, "written for the corpus", _v32(), NEAR_MISS, reason=SMALLEST),
    "softmax_attention_topk": IndexerEntry(softmax_attention_topk, "written for the corpus", _v32(), LEFT_ALONE),
    "router_topk": IndexerEntry(router_topk, "DeepSeek MoE router", _router, LEFT_ALONE),
}


def _as_set(x):
    return x.sort(dim=-1).values if isinstance(x, torch.Tensor) and not x.dtype.is_floating_point else x


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_entry_ends_as_declared(name):
    entry = CORPUS[name]
    got, want, rep = run_entry(entry, "indexer_topk")
    if entry.outcome == REWRITTEN and entry.in_topk_order is not None:
        assert ("in topk order" in rep.sites[0].detail) == entry.in_topk_order, rep.sites[0].detail
    for g, w in zip(got, want):
        if not entry.order_seen:
            g, w = _as_set(g), _as_set(w)
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g, w)
        else:
            assert g.dtype == w.dtype and torch.equal(g, w)


def test_corpus_covers_the_issue():
    """At least 12 independent indexer formulations, and each declared outcome kind appears."""
    check_coverage(CORPUS)
