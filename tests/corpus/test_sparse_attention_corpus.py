"""Spelling corpus for DSA sparse attention: independent formulations of attention restricted to the keys an indexer
picked (and a few that only look like it), each with its declared outcome, compiled with `backend="dsfuse"` on tiny
CPU shapes. Every entry must end exactly as declared (rewritten into the named op / reported near-miss with that
reason / left alone) and agree with eager.

Each formulation is written after the code named in its `source`: the official DeepSeek V3.2 inference MLA (absorbed
`wkv_b`, einsum spellings, a `full(-inf).scatter_(-1, topk, 0)` index mask added to the scores), vLLM's / SGLang's
torch references for sparse MLA (`kv[indices]` gathers, -1 for no key, dense softmax over the picks), FlashMLA's
sparse-prefill test reference (gather, log-sum-exp), transformers' DeepseekV32 / GlmMoeDsa attention (bool selection
mask combined with the attention mask, SDPA and eager) and transformers' DeepseekV4 sink attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from harness import LEFT_ALONE, NEAR_MISS, REWRITTEN, Entry, check_coverage, run_entry

B, S, H, K = 2, 8, 2, 4
T = S
C, R = 16, 8  # latent (absorbed nope) width and rope width of the gather forms
D, DV = 16, 8  # per-head q/k and v widths of the HF forms (DV != D keeps CPU SDPA off its flash kernel)
SCALE = (C + R) ** -0.5
WINDOW, RATIO = 4, 2  # V4: sliding window, CSA compress rate (S // RATIO compressed entries)


# --------------------------------------------------------------------------------------- inputs
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _causal_picks(batch=B, seq=S, keys=T, k=K, seed=0, pad=-1):
    """[B, S, k] distinct causal picks per query (key t <= s), the slots past a query's causal keys `pad`."""
    gen = _gen(seed)
    idx = torch.full((batch, seq, k), pad, dtype=torch.int64)
    for b in range(batch):
        for s in range(seq):
            seen = s + keys - seq + 1
            picks = torch.randperm(seen, generator=gen)[:k]
            idx[b, s, : len(picks)] = picks
    return idx


def _mla(dtype=torch.float32, seed=0):
    """Absorbed MLA operands: q_abs [B,S,H,C], q_pe [B,S,H,R], latent cache [B,T,C], rope keys [B,T,R], picks."""
    gen = _gen(seed)
    return (torch.randn(B, S, H, C, generator=gen).to(dtype), torch.randn(B, S, H, R, generator=gen).to(dtype),
            torch.randn(B, T, C, generator=gen).to(dtype), torch.randn(B, T, R, generator=gen).to(dtype),
            _causal_picks(seed=seed))


def _mla_sink():
    return (*_mla(), torch.randn(H, generator=_gen(5)))


def _mla_one_sequence():
    q_abs, q_pe, kv, pe, idx = _mla()
    return q_abs[0], q_pe[0], kv[0], pe[0], idx[0]


def _mla_one_batch():
    return tuple(t[:1] for t in _mla())


def _mla_minus_one_past_first_sequence():
    """Picks with -1 in the second sequence only (`index_select` raises on a -1 of the first, offset by 0)."""
    *operands, idx = _mla()
    idx[0] = idx[0].clamp(min=0)
    return (*operands, idx)


def _mla_index_scores():
    """Index scores over the whole cache (a decode step sees every cached key), for a top-k inside the graph."""
    q_abs, q_pe, kv, pe, _ = _mla()
    return q_abs, q_pe, kv, pe, torch.randn(B, S, T, generator=_gen(3))


def _mla_index_scores_bf16():
    return tuple(t.to(torch.bfloat16) if i < 4 else t for i, t in enumerate(_mla_index_scores()))


def _mla_given_picks():
    q_abs, q_pe, kv, pe, scores = _mla_index_scores()
    return q_abs, q_pe, kv, pe, scores.topk(K, dim=-1).indices


def _hf(mask_kind="bool", dtype=torch.float32, seed=1):
    """HF operands [B,H,S,D] / [B,H,T,D] / [B,H,T,DV], in-range picks, and a causal mask with left padding (bool
    keep mask, or HF's additive finfo.min one)."""
    gen = _gen(seed)
    q = torch.randn(B, H, S, D, generator=gen).to(dtype)
    k = torch.randn(B, H, T, D, generator=gen).to(dtype)
    v = torch.randn(B, H, T, DV, generator=gen).to(dtype)
    idx = _causal_picks(seed=seed, pad=0)
    keep = torch.ones(S, T, dtype=torch.bool).tril().expand(B, 1, S, T).clone()
    keep[1, :, :, :2] = False  # left padding in the second row
    keep[1, :, :2, :] = False  # its padding queries see no key at all
    if mask_kind == "bool":
        return q, k, v, idx, keep
    return q, k, v, idx, torch.zeros(B, 1, S, T, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _official_prefill():
    """Per-head q [B,S,H,D], k [B,T,H,D], v [B,T,H,DV], picks, and the official [S, T] causal -inf mask."""
    gen = _gen(2)
    q, k = torch.randn(B, S, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    v = torch.randn(B, T, H, DV, generator=gen)
    mask = torch.full((S, T), float("-inf")).triu(1)
    return q, k, v, _causal_picks(seed=2, pad=0), mask


def _v4_csa():
    """V4 CSA operands: q [B,H,S,D], window K=V rows [B,1,S,D], compressed entries [B,1,S//RATIO,D], the indexer's
    picks over the entries (-1 = none), per-head sinks."""
    gen = _gen(4)
    entries = S // RATIO
    idx = torch.full((B, S, 2), -1, dtype=torch.int64)
    for s in range(S):
        visible = (s + 1) // RATIO
        picks = torch.randperm(max(visible, 1), generator=gen)[: min(2, visible)]
        idx[:, s, : len(picks)] = picks
    return (torch.randn(B, H, S, D, generator=gen), torch.randn(B, 1, S, D, generator=gen),
            torch.randn(B, 1, entries, D, generator=gen), idx, torch.randn(H, generator=gen))


def _v4_csa_bf16():
    """The V4 CSA operands in bf16 (sinks stay fp32, as HF keeps them): the model's 0 / -inf masks, built from Python
    floats, are fp32, so the masked scores are promoted to fp32."""
    q, window, compressed, idx, sinks = _v4_csa()
    return q.bfloat16(), window.bfloat16(), compressed.bfloat16(), idx, sinks


def _v4_one_query_fp32_mask():
    """One query per sequence over N window rows (a decode step, no compressed entries), bf16, and the additive
    mask an fp32 input [B, 1, 1, N] (0 = seen)."""
    gen = _gen(5)
    mask = torch.zeros(B, 1, 1, S)
    mask[0, ..., : S // 2] = torch.finfo(torch.float32).min
    return (torch.randn(B, H, 1, D, generator=gen).bfloat16(), torch.randn(B, 1, S, D, generator=gen).bfloat16(),
            mask, torch.randn(H, generator=gen))


def _chunk_mask():
    """What generate hands a V4 prefill chunk as its mask: an fp32 [B, 1, S, S] input, 0 where the sliding causal
    window sees a row, finfo.min elsewhere and on the second sequence's 3 padding rows."""
    q_pos, kv_pos = torch.arange(S).view(S, 1), torch.arange(S).view(1, S)
    seen = ((kv_pos > q_pos - WINDOW) & (kv_pos <= q_pos)).expand(B, 1, S, S).clone()
    seen[1, ..., :3] = False
    return torch.zeros(B, 1, S, S).masked_fill(~seen, torch.finfo(torch.float32).min)


def _v4_csa_chunk():
    return (*_v4_csa(), _chunk_mask())


def _v4_hca_chunk():
    """V4 HCA operands of a prefill chunk: q, window rows, compressed entries, the [B, S] positions (the padded
    sequence's start at 0 after its padding), sinks, the input mask."""
    q, window, compressed, _, sinks = _v4_csa()
    positions = torch.arange(S).expand(B, S).clone()
    positions[1] = (positions[1] - 3).clamp(min=0)
    return q, window, compressed, positions, sinks, _chunk_mask()


def _dense():
    gen = _gen(6)
    return torch.randn(B, H, S, D, generator=gen), torch.randn(B, H, T, D, generator=gen), \
        torch.randn(B, H, T, DV, generator=gen)


def _embedding_bag():
    gen = _gen(7)
    return torch.randn(B, T, C, generator=gen), _causal_picks(seed=7)


# --------------------------------------------------------------------------------------- gather forms (absorbed MLA)
def _batch_rows(src, idx):
    return src[torch.arange(src.shape[0])[:, None, None], idx]


def official_gather_einsum(q_abs, q_pe, kv, pe, idx):
    """Official V3.2 absorbed MLA written over gathered picks: einsum latent and rope scores, scale, fp32 upcast,
    `masked_fill(idx < 0, -inf)`, softmax, probabilities back to the input dtype, einsum with the same rows."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    probs = scores.softmax(dim=-1).type_as(q_abs)
    return torch.einsum("bshk,bskc->bshc", probs, rows)


def vllm_gather_matmul(q_abs, q_pe, kv, pe, idx):
    """vLLM-style torch reference: -1 picks replaced by 0 with `masked_fill` before the gather, matmul products
    against the transposed rows, softmax with `dtype=float32`, `~valid` as the mask."""
    valid = idx >= 0
    safe = idx.masked_fill(~valid, 0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = torch.matmul(q_abs, rows.transpose(-1, -2)) + torch.matmul(q_pe, pe_rows.transpose(-1, -2))
    scores = (scores * SCALE).masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q_abs.dtype)
    return torch.matmul(probs, rows)


def where_keep_polarity(q_abs, q_pe, kv, pe, idx):
    """The keep polarity throughout: `where(idx >= 0, idx, 0)` for the gather, `torch.where(keep, scores, -inf)` for
    the mask (canonicalised to `clamp_min(idx, 0)` and `where(idx < 0, -inf, scores)`)."""
    safe = torch.where(idx >= 0, idx, 0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = torch.einsum("bshc,bskc->bshk", q_abs.float(), rows.float()) + torch.einsum(
        "bshr,bskr->bshk", q_pe.float(), pe_rows.float())
    scores = torch.where((idx >= 0).unsqueeze(2), scores * SCALE, float("-inf"))
    return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=-1).to(q_abs.dtype), rows)


def sglang_concatenated_rows(q_abs, q_pe, kv, pe, idx):
    """SGLang / FlashMLA cache layout: one [latent | rope] row per key, gathered once; the scores read the whole row,
    the values its latent slice. The op takes the latent and rope caches apart (slices of this one would do); the
    matcher only reads two gathers by the same indices, and says so."""
    keys = torch.cat([kv, pe], dim=-1)
    rows = _batch_rows(keys, idx.clamp(min=0))
    q = torch.cat([q_abs, q_pe], dim=-1)
    scores = torch.einsum("bshd,bskd->bshk", q.float(), rows.float()) * SCALE
    scores = scores.masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=-1).to(q_abs.dtype), rows[..., :C])


def scale_folded_into_q(q_abs, q_pe, kv, pe, idx):
    """The softmax scale folded into both query parts before the products (as fused-kernel wrappers pass it)."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = torch.einsum("bshc,bskc->bshk", q_abs * SCALE, rows) + torch.einsum("bshr,bskr->bshk", q_pe * SCALE,
                                                                                 pe_rows)
    probs = scores.float().masked_fill((idx < 0)[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("bshk,bskc->bshc", probs.to(q_abs.dtype), rows)


def scale_after_mask(q_abs, q_pe, kv, pe, idx):
    """The scale applied after the -1 picks are masked, as the softmax's direct input: Inductor rewrites
    `softmax(x * c)` into its own scaled form (`exp((x - max x) * c)` with an infinity guard) before dsfuse sees the
    graph; the matcher takes c as a scale inside the softmax, and the verifier proves it."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    raw = torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)
    masked = raw.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    probs = torch.softmax(masked * SCALE, dim=-1)
    return torch.einsum("bshk,bskc->bshc", probs.to(q_abs.dtype), rows)


def bmm_over_flat_queries(q_abs, q_pe, kv, pe, idx):
    """Explicit `bmm` over flattened (batch, query) rows: [B*S, H, C] x [B*S, C, K]."""
    b, s, h, _ = q_abs.shape
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe).flatten(0, 1), _batch_rows(pe, safe).flatten(0, 1)
    scores = torch.bmm(q_abs.reshape(b * s, h, C), rows.transpose(1, 2)) + torch.bmm(q_pe.reshape(b * s, h, R),
                                                                                      pe_rows.transpose(1, 2))
    scores = (scores.view(b, s, h, -1) * SCALE).float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    probs = scores.softmax(dim=-1).to(q_abs.dtype).view(b * s, h, -1)
    return torch.bmm(probs, rows).view(b, s, h, C)


def sink_column(q_abs, q_pe, kv, pe, idx, sink):
    """Per-head sink logits appended as one more column of the fp32 softmax and dropped after it (V4-style sinks
    over gathered picks)."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    column = sink.float().view(1, 1, H, 1).expand(scores.shape[0], scores.shape[1], H, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bshk,bskc->bshc", probs.type_as(q_abs), rows)



def sink_in_denominator(q_abs, q_pe, kv, pe, idx, sink):
    """The per-head sink as a term of the softmax's denominator, the max shift taken over the scores and the sink
    (gpt-oss-style attention sinks): the sink column's math without the column."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    sink = sink.float().view(1, 1, H, 1)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(scores - top)
    probs = weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
    return torch.einsum("bshk,bskc->bshc", probs.type_as(q_abs), rows)


def logsumexp_weights(q_abs, q_pe, kv, pe, idx):
    """Weights as `exp(x - logsumexp(x))`, the softmax of a log-domain reference."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    probs = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
    return torch.einsum("bshk,bskc->bshc", probs.type_as(q_abs), rows)


def denominator_plus_one(q_abs, q_pe, kv, pe, idx):
    """`exp(x - max) / (sum + 1)`: the softmax's ops with a constant in the denominator, which is no sink (a sink
    enters as exp(sink - max)); only its numbers tell it apart."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    probs = weights / (weights.sum(dim=-1, keepdim=True) + 1.0)
    return torch.einsum("bshk,bskc->bshc", probs.type_as(q_abs), rows)

def one_sequence_gather(q_abs, q_pe, kv, pe, idx):
    """vLLM / FlashMLA references hold one flat sequence: q [S,H,C], kv [T,C], idx [S,K], `kv[idx]` without a batch
    index. The same math as the batched gather at B=1, which the op could take through batch-1 views; the matcher
    does not build them yet, and says so."""
    safe = idx.clamp(min=0)
    rows, pe_rows = kv[safe], pe[safe]
    scores = (torch.einsum("shc,skc->shk", q_abs, rows) + torch.einsum("shr,skr->shk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(1), float("-inf"))
    return torch.einsum("shk,skc->shc", scores.softmax(-1).to(q_abs.dtype), rows)


def bf16_softmax(q_abs, q_pe, kv, pe, idx):
    """The softmax called on the masked bf16 scores (no explicit upcast): a bf16 softmax upcasts inside, and masking
    commutes with the exact upcast, so this is the official bf16 form with the cast moved."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    probs = scores.masked_fill((idx < 0).unsqueeze(2), float("-inf")).softmax(dim=-1)
    return torch.einsum("bshk,bskc->bshc", probs, rows)


def minus_one_only(q_abs, q_pe, kv, pe, idx):
    """Only `idx == -1` is masked: an index below -1 would be read (clamped to row 0) and attended, where the fused
    op treats every negative index as no key, so the two differ on such indices."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx == -1).unsqueeze(2), float("-inf"))
    return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=-1).type_as(q_abs), rows)


def flashmla_lse(q_abs, q_pe, kv, pe, idx):
    """FlashMLA's sparse-prefill test reference: weights `exp(P - lse)` with the log-sum-exp of an empty row set to
    +inf, so a query without keys gives 0 where the fused op's softmax gives NaN: the verifier's probe with such a
    query tells them apart."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    p = (torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)).float()
    p = (p * SCALE).masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(p, dim=-1, keepdim=True)
    lse = torch.where(torch.isneginf(lse), float("inf"), lse)
    return torch.einsum("bshk,bskc->bshc", torch.exp(p - lse).to(q_abs.dtype), rows)


def softmax_over_heads(q_abs, q_pe, kv, pe, idx):
    """The softmax normalises over the heads (dim 2), not over the picked keys."""
    safe = idx.clamp(min=0)
    rows, pe_rows = _batch_rows(kv, safe), _batch_rows(pe, safe)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=2).type_as(q_abs), rows)


def torch_gather_rows(q_abs, q_pe, kv, pe, idx):
    """The picked rows read with `torch.gather` over the cache broadcast along the queries (a plain-torch spelling
    of the batch-index gather)."""
    safe = idx.clamp(min=0)
    b, s, k = safe.shape

    def rows(src):
        return torch.gather(src.unsqueeze(1).expand(b, s, *src.shape[1:]), 2,
                            safe.unsqueeze(-1).expand(b, s, k, src.shape[-1]))

    kv_rows, pe_rows = rows(kv), rows(pe)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, kv_rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=-1).type_as(q_abs), kv_rows)


def take_along_dim_rows(q_abs, q_pe, kv, pe, idx):
    """The picked rows read with `torch.take_along_dim` (gather of the clamped picks, wrapped modulo T)."""
    safe = idx.clamp(min=0)[..., None]
    kv_rows, pe_rows = torch.take_along_dim(kv[:, None], safe, dim=2), torch.take_along_dim(pe[:, None], safe, dim=2)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, kv_rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=-1).type_as(q_abs), kv_rows)


def _flat_rows_attention(q_abs, q_pe, kv, pe, idx, flat):
    """Absorbed MLA over the rows `index_select` reads from the flattened caches at `flat`, viewed back per pick."""
    b, t = kv.shape[:2]
    kv_rows = kv.reshape(b * t, -1).index_select(0, flat).view(*idx.shape, -1)
    pe_rows = pe.reshape(b * t, -1).index_select(0, flat).view(*idx.shape, -1)
    scores = (torch.einsum("bshc,bskc->bshk", q_abs, kv_rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * SCALE
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    return torch.einsum("bshk,bskc->bshc", scores.softmax(dim=-1).type_as(q_abs), kv_rows)


def index_select_rows(q_abs, q_pe, kv, pe, idx):
    """The picked rows read with `index_select` from the flattened caches at `b * T + idx.clamp(min=0)`: the
    per-batch row gather, written as a paged-cache reader flattens it."""
    b, t = kv.shape[:2]
    flat = (idx.clamp(min=0) + torch.arange(b)[:, None, None] * t).reshape(-1)
    return _flat_rows_attention(q_abs, q_pe, kv, pe, idx, flat)


def index_select_one_sequence_cache(q_abs, q_pe, kv, pe, idx):
    """A batch of one: the clamped picks flattened index the [1*T, C] cache as they are, no offset."""
    return _flat_rows_attention(q_abs, q_pe, kv, pe, idx, idx.clamp(min=0).flatten())


def index_select_without_offset(q_abs, q_pe, kv, pe, idx):
    """Two sequences indexed without `b * T`: every query reads the first sequence's rows, not its own."""
    return _flat_rows_attention(q_abs, q_pe, kv, pe, idx, idx.clamp(min=0).flatten())


def index_select_wrong_stride(q_abs, q_pe, kv, pe, idx):
    """Sequences offset by `b * (T - 1)`: the second one's picks read the wrong rows, which the verifier's probes
    find."""
    b, t = kv.shape[:2]
    flat = (idx.clamp(min=0) + torch.arange(b)[:, None, None] * (t - 1)).reshape(-1)
    return _flat_rows_attention(q_abs, q_pe, kv, pe, idx, flat)


def index_select_unclamped(q_abs, q_pe, kv, pe, idx):
    """`b * T + idx` with the -1 picks left in: a -1 of the second sequence reads the first one's last row (masked
    in the scores, but a NaN there would reach the output), one of the first sequence no row at all."""
    b, t = kv.shape[:2]
    return _flat_rows_attention(q_abs, q_pe, kv, pe, idx, (idx + torch.arange(b)[:, None, None] * t).flatten())


def gathered_rows_summed(kv, idx):
    """A per-batch row gather that is no attention (an embedding-bag style sum of the picked rows)."""
    return _batch_rows(kv, idx.clamp(min=0)).sum(dim=2)


# --------------------------------------------------------------------------------------- scatter-mask forms
def _not_selected(idx, keys):
    """HF's `index_mask`: True at the keys the indexer did not pick, [B, 1, S, T]."""
    b, s, _ = idx.shape
    return torch.ones(b, s, keys, dtype=torch.bool).scatter(-1, idx, False).unsqueeze(1)


def hf_v32_sdpa(q, k, v, idx, keep):
    """transformers DeepseekV32Attention, SDPA interface: `keep & ~index_mask` as SDPA's bool mask."""
    mask = keep & ~_not_selected(idx, k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE).transpose(1, 2)


def hf_v32_eager(q, k, v, idx, additive):
    """transformers DeepseekV32Attention, eager interface: the additive mask filled with finfo.min where not
    selected, matmul * scale + mask, fp32 softmax cast back, matmul, transpose."""
    mask = additive.masked_fill(_not_selected(idx, k.shape[2]), torch.finfo(q.dtype).min)
    weights = torch.matmul(q, k.transpose(2, 3)) * SCALE + mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v).transpose(1, 2).contiguous()


def glm_sdpa_positions(q, k, v, idx):
    """transformers GlmMoeDsaAttention with no padding: the bool mask built from query / key positions (causal only),
    so the fused op applies causality from positions."""
    s, t = q.shape[2], k.shape[2]
    causal = torch.arange(t)[None, None, None, :] <= torch.arange(s)[None, None, :, None] + (t - s)
    mask = causal.expand(q.shape[0], 1, s, t) & ~_not_selected(idx, t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)


def eager_finite_fill(q, k, v, idx, additive):
    """The unselected keys filled with -1e4 instead of finfo.min: the fused op's fill differs (a row whose selected
    keys are all masked would average other keys than eager's)."""
    mask = additive.masked_fill(_not_selected(idx, k.shape[2]), -1e4)
    weights = F.softmax(torch.matmul(q, k.transpose(2, 3)) * SCALE + mask, dim=-1, dtype=torch.float32)
    return torch.matmul(weights.to(q.dtype), v)


def eager_weights_returned(q, k, v, idx, additive):
    """HF eager with `output_attentions`: the probabilities are returned too."""
    mask = additive.masked_fill(_not_selected(idx, k.shape[2]), torch.finfo(q.dtype).min)
    weights = F.softmax(torch.matmul(q, k.transpose(2, 3)) * SCALE + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v), weights


def official_prefill(q, k, v, idx, mask):
    """Official V3.2 MLA prefill: per-head scores `einsum('bshd,bthd->bsht')`, `full(-inf).scatter_(-1, topk, 0)`
    plus the causal mask, added to the scores; fp32 softmax, `type_as`, einsum with v. Not rewritten: a plain
    softmax over the combined -inf bias is NaN in a row whose picks are all in the future, where
    `sparse_attention_masked` returns 0, so reading it needs proof that every row keeps a causal pick."""
    scores = torch.einsum("bshd,bthd->bsht", q, k) * SCALE
    index_mask = torch.full((q.shape[0], q.shape[1], k.shape[1]), float("-inf")).scatter_(-1, idx, 0)
    index_mask = index_mask + mask
    scores = (scores + index_mask.unsqueeze(2)).softmax(dim=-1, dtype=torch.float32).type_as(q)
    return torch.einsum("bsht,bthd->bshd", scores, v)


def _official_decode(q_abs, q_pe, kv, pe, picks):
    scores = (torch.einsum("bshc,btc->bsht", q_abs, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)) * SCALE
    index_mask = torch.full((q_abs.shape[0], q_abs.shape[1], kv.shape[1]), float("-inf")).scatter_(-1, picks, 0)
    scores = (scores + index_mask.unsqueeze(2)).softmax(dim=-1, dtype=torch.float32).type_as(q_abs)
    return torch.einsum("bsht,btc->bshc", scores, kv)


def official_decode_absorbed(q_abs, q_pe, kv, pe, index_scores):
    """Official V3.2 MLA decode (absorbed `wkv_b`): the indexer's top-k, scores against the whole latent and rope
    caches, the index mask `full(-inf).scatter_(-1, topk, 0)` added (no causal mask in decode), fp32 softmax, einsum
    with the latent cache. Top-k picks have no repeats and at least one per row, so only the picked keys get weight:
    `sparse_mla_attention` on the caches."""
    return _official_decode(q_abs, q_pe, kv, pe, index_scores.topk(K, dim=-1).indices)


def official_decode_given_picks(q_abs, q_pe, kv, pe, picks):
    """The same decode attention over picks that are not a top-k's (an input): a pick repeated in a row is merged by
    the scatter but would count twice in the gathering op."""
    return _official_decode(q_abs, q_pe, kv, pe, picks)


def keep_polarity_sdpa(q, k, v, idx, keep):
    """The picks scattered as True into a zeros mask (keep polarity) and ANDed with the bool mask for SDPA."""
    picked = torch.zeros(idx.shape[0], idx.shape[1], k.shape[2], dtype=torch.bool).scatter(-1, idx, True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep & picked.unsqueeze(1), scale=SCALE)


def selection_bias_only(q, k, v, idx):
    """No attention mask: the unpicked keys get a -inf bias written by a boolean `index_put`; MQA keys and values
    (one [B, T, D] tensor each, broadcast over the heads)."""
    k, v = k[:, :1], v[:, :1]
    bias = torch.zeros(idx.shape[0], 1, idx.shape[1], k.shape[2])
    bias[_not_selected(idx, k.shape[2])] = float("-inf")
    weights = F.softmax(torch.matmul(q, k.transpose(-1, -2)) * SCALE + bias, dim=-1)
    return torch.matmul(weights, v)



def selection_bias_logsumexp(q, k, v, idx):
    """The -inf selection bias alone, the weights as `exp(x - logsumexp(x))`: the masked op's softmax in a log-domain
    spelling."""
    bias = torch.zeros(idx.shape[0], 1, idx.shape[1], k.shape[2]).masked_fill(_not_selected(idx, k.shape[2]),
                                                                             float("-inf"))
    scores = torch.matmul(q, k.transpose(-1, -2)) * SCALE + bias
    return torch.matmul(torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True)), v)


def selection_bias_sink(q, k, v, idx, sink):
    """The -inf selection bias alone with a per-head sink in the denominator (gpt-oss style)."""
    bias = torch.zeros(idx.shape[0], 1, idx.shape[1], k.shape[2]).masked_fill(_not_selected(idx, k.shape[2]),
                                                                             float("-inf"))
    scores = torch.matmul(q, k.transpose(-1, -2)) * SCALE + bias
    sink = sink.view(1, -1, 1, 1)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(scores - top)
    return torch.matmul(weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top)), v)


def hf_v32_eager_sink_column(q, k, v, idx, additive, sink):
    """HF's eager V3.2 attention (finfo.min fill) with a V4-style sink column: the column beside the masked scores,
    fp32 softmax, the column dropped. The padding queries' rows, at finfo.min throughout, go to the sink."""
    mask = additive.masked_fill(_not_selected(idx, k.shape[2]), torch.finfo(q.dtype).min)
    scores = torch.matmul(q, k.transpose(2, 3)) * SCALE + mask
    column = sink.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    probs = F.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def selection_bias_plus_mask_sdpa(q, k, v, idx, additive):
    """The -inf selection bias summed with HF's additive mask and handed to SDPA as one mask: a row whose picks are
    all masked attends over its picks alone (HF's finfo.min fill would spread it over every key)."""
    bias = torch.zeros_like(additive).masked_fill(_not_selected(idx, k.shape[2]), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive + bias, scale=SCALE)


def dense_attention(q, k, v):
    return F.softmax(torch.matmul(q, k.transpose(-1, -2)) * SCALE, dim=-1) @ v


# --------------------------------------------------------------------------------------- V4 sink attention
def v4_csa_sinks(q, window, compressed, idx, sinks):
    """transformers DeepseekV4Attention on a CSA layer (eager): sliding-window causal 0 / -inf mask from positions,
    the indexer's picks scattered into a -inf block bias (-1 moved to a spare column sliced off), both concatenated
    over [window rows | compressed entries], sink logit column, max-subtracted fp32 softmax, sink dropped."""
    b, s, entries = q.shape[0], q.shape[2], compressed.shape[2]
    q_pos, kv_pos = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
    allowed = (kv_pos > q_pos - WINDOW) & (kv_pos <= q_pos)
    window_mask = torch.where(allowed, 0.0, float("-inf")).expand(b, 1, s, s)
    safe = torch.where(idx >= 0, idx, torch.full_like(idx, entries))
    block_bias = torch.full((b, 1, s, entries + 1), float("-inf")).scatter(-1, safe.unsqueeze(1), 0.0)
    mask = torch.cat([window_mask, block_bias[..., :entries]], dim=-1)
    kv = torch.cat([window, compressed], dim=2)
    logits = torch.matmul(q, kv.expand(-1, q.shape[1], -1, -1).transpose(2, 3)) * SCALE + mask
    logits = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1].to(kv.dtype)
    return torch.matmul(probs, kv.expand(-1, q.shape[1], -1, -1)).transpose(1, 2)


def _v4_sinks_attention(q, kv, mask, sinks):
    b, s = q.shape[0], q.shape[2]
    logits = torch.matmul(q, kv.expand(-1, q.shape[1], -1, -1).transpose(2, 3)) * SCALE + mask
    logits = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1].to(kv.dtype)
    return torch.matmul(probs, kv.expand(-1, q.shape[1], -1, -1)).transpose(1, 2)


def v4_csa_chunk_input_mask(q, window, compressed, idx, sinks, mask):
    """transformers DeepseekV4Attention on a CSA layer for a prefill chunk under generate: the window mask built
    outside the compiled call (an additive input), the indexer's picks scattered into the block bias."""
    b, s, entries = q.shape[0], q.shape[2], compressed.shape[2]
    safe = torch.where(idx >= 0, idx, torch.full_like(idx, entries))
    block_bias = torch.full((b, 1, s, entries + 1), float("-inf")).scatter(-1, safe.unsqueeze(1), 0.0)
    return _v4_sinks_attention(q, torch.cat([window, compressed], dim=2),
                               torch.cat([mask, block_bias[..., :entries]], dim=-1), sinks)


def v4_hca_chunk_input_mask(q, window, compressed, positions, sinks, mask):
    """transformers DeepseekV4Attention on an HCA layer for a prefill chunk under generate: the input window mask,
    then HCA's causal block bias `entry >= (position + 1) // m` at the chunk's positions."""
    b, s, entries = q.shape[0], q.shape[2], compressed.shape[2]
    threshold = (positions + 1) // RATIO
    block_bias = compressed.new_zeros((b, 1, s, entries)).masked_fill(
        torch.arange(entries).view(1, 1, 1, -1) >= threshold.unsqueeze(1).unsqueeze(-1), float("-inf"))
    return _v4_sinks_attention(q, torch.cat([window, compressed], dim=2), torch.cat([mask, block_bias], dim=-1),
                               sinks)


def v4_one_query_input_mask(q, window, mask, sinks):
    """A V4 sliding layer's decode step written with the step's additive input mask added to the bf16 scores."""
    b = q.shape[0]
    kv = window.expand(-1, q.shape[1], -1, -1)
    logits = torch.matmul(q, kv.transpose(2, 3)) * SCALE + mask
    logits = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(b, -1, 1, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1].to(kv.dtype)
    return torch.matmul(probs, kv).transpose(1, 2)


# --------------------------------------------------------------------------------------- the corpus
GATHER, MASKED, COMPRESSED = "dsfuse.sparse_mla_attention", "dsfuse.sparse_attention_masked", \
    "dsfuse.compressed_attention"


@dataclass(frozen=True)
class AttentionEntry(Entry):
    tolerance: float = 1e-5


NUMERIC = "numeric check against the reference failed: "
EMPTY_ROW_ZERO = NUMERIC + "a query without keys probe: 64 of 512 outputs differ beyond rtol=atol=1e-05 (largest inf)"
PLUS_ONE = NUMERIC + "random probe: 478 of 512 outputs differ beyond rtol=atol=1e-05 (largest 0.375)"
OVER_HEADS = NUMERIC + "random probe: 510 of 512 outputs differ beyond rtol=atol=1e-05 (largest inf)"
NOT_MINUS_ONE = "the score mask is not `idx < 0` of the gather's indices"
FINITE_FILL = f"unselected keys are filled with -10000.0, not finfo({torch.float32}).min"
ONE_SEQUENCE = ("the picked rows are gathered from one sequence (`kv[idx.clamp(min=0)]`, no batch index); the "
                "matcher reads per-batch [B, T, C] row gathers")
CONCATENATED_ROWS = ("the values are a slice of the gathered key rows (one [latent | rope] row per key); the matcher "
                     "reads latent and rope rows gathered apart")
INDEX_BIAS = ("the -inf index mask is combined with another mask before the scores (a plain softmax over it is NaN "
              "in rows without keys, which the fused ops do not reproduce)")
NOT_TOPK = ("the index mask's picks are not a top-k's indices: the scatter merges repeated picks, the gather op would "
            "count them twice")
FLAT_ROWS = "an index-driven selection (aten.index.Tensor) feeds an attention the matcher does not read: "
NO_OFFSET = FLAT_ROWS + ("the picks index the flattened cache of 2 sequences without a per-batch offset: every query "
                         "reads the first sequence's rows")
WRONG_STRIDE = NUMERIC + "random probe: 244 of 512 outputs differ beyond rtol=atol=1e-05 (largest 1.42)"
UNCLAMPED = FLAT_ROWS + ("the picks index the flattened cache without being clamped to 0: a -1 pick reads another "
                         "batch's row (or none), where the op finds no key")
PROBS_USED = "the attention probabilities are also used elsewhere"
FP32_INPUT_MASK = "the masked scores are computed in torch.float32, not in the input dtype torch.bfloat16"

CORPUS = {
    "official_gather_einsum": AttentionEntry(official_gather_einsum, "DeepSeek V3.2 inference MLA (absorbed), over gathered "
                                    "picks", _mla, REWRITTEN, 1, GATHER),
    "official_gather_bf16": AttentionEntry(official_gather_einsum, "DeepSeek V3.2 inference MLA (absorbed), bf16",
                                  lambda: _mla(torch.bfloat16), REWRITTEN, 1, GATHER, tolerance=2e-2),
    "vllm_gather_matmul": AttentionEntry(vllm_gather_matmul, "vLLM sparse MLA torch reference", _mla, REWRITTEN, 1, GATHER),
    "where_keep_polarity": AttentionEntry(where_keep_polarity, "written for the corpus (keep polarity)", _mla, REWRITTEN, 1,
                                 GATHER),
    "sglang_concatenated_rows": AttentionEntry(sglang_concatenated_rows, "SGLang NSA torch fallback / FlashMLA layout", _mla,
                                      NEAR_MISS, reason=CONCATENATED_ROWS),
    "scale_folded_into_q": AttentionEntry(scale_folded_into_q, "written for the corpus (scale in q)", _mla, REWRITTEN, 1,
                                 GATHER),
    "scale_after_mask": AttentionEntry(scale_after_mask, "written for the corpus (scale after the mask)", _mla,
                                       REWRITTEN, 1, GATHER),
    "bmm_over_flat_queries": AttentionEntry(bmm_over_flat_queries, "written for the corpus (explicit bmm)", _mla, REWRITTEN,
                                   1, GATHER),
    "sink_column": AttentionEntry(sink_column, "DeepSeek V4-style sinks over gathered picks", _mla_sink, REWRITTEN, 1, GATHER),
    "sink_in_denominator": AttentionEntry(sink_in_denominator, "written for the corpus (gpt-oss-style sink)", _mla_sink,
                                          REWRITTEN, 1, GATHER),
    "logsumexp_weights": AttentionEntry(logsumexp_weights, "written for the corpus (exp(x - logsumexp))", _mla,
                                        REWRITTEN, 1, GATHER),
    "denominator_plus_one": AttentionEntry(denominator_plus_one, "written for the corpus", _mla, NEAR_MISS,
                                           reason=PLUS_ONE),
    "one_sequence_gather": AttentionEntry(one_sequence_gather, "vLLM / FlashMLA reference (one sequence)", _mla_one_sequence,
                                 NEAR_MISS, reason=ONE_SEQUENCE),
    "official_decode_absorbed": AttentionEntry(official_decode_absorbed, "DeepSeek V3.2 inference MLA decode (absorbed)",
                                      _mla_index_scores, REWRITTEN, 1, GATHER),
    "official_decode_absorbed_bf16": AttentionEntry(official_decode_absorbed, "DeepSeek V3.2 inference MLA decode, bf16",
                                           _mla_index_scores_bf16, REWRITTEN, 1, GATHER, tolerance=2e-2),
    "official_decode_given_picks": AttentionEntry(official_decode_given_picks, "DeepSeek V3.2 inference MLA decode, picks "
                                         "from outside", _mla_given_picks, NEAR_MISS, reason=NOT_TOPK),
    "hf_v32_sdpa_bool": AttentionEntry(hf_v32_sdpa, "transformers DeepseekV32Attention (sdpa)", _hf, REWRITTEN, 1, MASKED),
    "hf_v32_eager_additive": AttentionEntry(hf_v32_eager, "transformers DeepseekV32Attention (eager)",
                                   lambda: _hf("additive"), REWRITTEN, 1, MASKED),
    "glm_sdpa_positions_causal": AttentionEntry(glm_sdpa_positions, "transformers GlmMoeDsaAttention (sdpa, no padding)",
                                       lambda: _hf()[:4], REWRITTEN, 1, MASKED),
    "v4_csa_sinks": AttentionEntry(v4_csa_sinks, "transformers DeepseekV4Attention (CSA layer, eager)", _v4_csa, REWRITTEN, 1,
                          COMPRESSED),
    "v4_csa_sinks_bf16_fp32_masks": AttentionEntry(v4_csa_sinks, "transformers DeepseekV4Attention (CSA layer, eager), "
                                          "bf16 with its fp32 0 / -inf masks", _v4_csa_bf16, REWRITTEN, 1, COMPRESSED,
                                          tolerance=2e-2),
    "v4_one_query_fp32_input_mask": AttentionEntry(v4_one_query_input_mask, "written for the corpus (an fp32 input mask "
                                          "promotes bf16 scores)", _v4_one_query_fp32_mask, NEAR_MISS,
                                          reason=FP32_INPUT_MASK, tolerance=2e-2),
    "v4_csa_chunk_input_mask": AttentionEntry(v4_csa_chunk_input_mask, "transformers DeepseekV4Attention (CSA layer), "
                                     "a prefill chunk's mask from generate", _v4_csa_chunk, REWRITTEN, 1, COMPRESSED),
    "v4_hca_chunk_input_mask": AttentionEntry(v4_hca_chunk_input_mask, "transformers DeepseekV4Attention (HCA layer), "
                                     "a prefill chunk's mask from generate", _v4_hca_chunk, REWRITTEN, 1, COMPRESSED),
    "official_prefill_index_mask": AttentionEntry(official_prefill, "DeepSeek V3.2 inference MLA prefill", _official_prefill,
                                         NEAR_MISS, reason=INDEX_BIAS),
    "bf16_softmax": AttentionEntry(bf16_softmax, "written for the corpus", lambda: _mla(torch.bfloat16), REWRITTEN, 1,
                          GATHER, tolerance=2e-2),
    "minus_one_only": AttentionEntry(minus_one_only, "written for the corpus", _mla, NEAR_MISS, reason=NOT_MINUS_ONE),
    "flashmla_lse": AttentionEntry(flashmla_lse, "FlashMLA sparse prefill test reference", _mla, NEAR_MISS, reason=EMPTY_ROW_ZERO),
    "softmax_over_heads": AttentionEntry(softmax_over_heads, "written for the corpus", _mla, NEAR_MISS, reason=OVER_HEADS),
    "eager_finite_fill": AttentionEntry(eager_finite_fill, "written for the corpus", lambda: _hf("additive"), NEAR_MISS,
                               reason=FINITE_FILL),
    "eager_weights_returned": AttentionEntry(eager_weights_returned, "transformers eager with output_attentions",
                                    lambda: _hf("additive"), NEAR_MISS, reason=PROBS_USED),
    "torch_gather_rows": AttentionEntry(torch_gather_rows, "written for the corpus (torch.gather rows)", _mla, REWRITTEN,
                                        1, GATHER),
    "take_along_dim_rows": AttentionEntry(take_along_dim_rows, "written for the corpus (take_along_dim rows)", _mla,
                                          REWRITTEN, 1, GATHER),
    "index_select_rows": AttentionEntry(index_select_rows, "written for the corpus (index_select rows)", _mla,
                                        REWRITTEN, 1, GATHER),
    "index_select_one_sequence_cache": AttentionEntry(index_select_one_sequence_cache, "written for the corpus "
                                                      "(index_select rows, B = 1)", _mla_one_batch, REWRITTEN, 1,
                                                      GATHER),
    "index_select_without_offset": AttentionEntry(index_select_without_offset, "written for the corpus", _mla,
                                                  NEAR_MISS, reason=NO_OFFSET),
    "index_select_wrong_stride": AttentionEntry(index_select_wrong_stride, "written for the corpus", _mla, NEAR_MISS,
                                                reason=WRONG_STRIDE),
    "index_select_unclamped": AttentionEntry(index_select_unclamped, "written for the corpus",
                                             _mla_minus_one_past_first_sequence, NEAR_MISS, reason=UNCLAMPED),
    "keep_polarity_sdpa": AttentionEntry(keep_polarity_sdpa, "written for the corpus (keep-polarity scatter)", _hf,
                                         REWRITTEN, 1, MASKED),
    "selection_bias_only_mqa": AttentionEntry(selection_bias_only, "written for the corpus (index_put bias, MQA)",
                                              lambda: _hf()[:4], REWRITTEN, 1, MASKED),
    "selection_bias_logsumexp": AttentionEntry(selection_bias_logsumexp, "written for the corpus (logsumexp weights)",
                                               lambda: _hf()[:4], REWRITTEN, 1, MASKED),
    "selection_bias_sink": AttentionEntry(selection_bias_sink, "written for the corpus (a sink over the selection)",
                                          lambda: (*_hf()[:4], torch.randn(H, generator=_gen(5))), REWRITTEN, 1,
                                          MASKED, detail="sink"),
    "hf_v32_eager_sink_column": AttentionEntry(hf_v32_eager_sink_column, "transformers DeepseekV32Attention (eager) "
                                               "with a V4-style sink column", lambda: (*_hf("additive"),
                                               torch.randn(H, generator=_gen(6))), REWRITTEN, 1, MASKED,
                                               detail="additive mask, K=4, scale=0.204124, sink"),
    "selection_bias_plus_mask_sdpa": AttentionEntry(selection_bias_plus_mask_sdpa, "written for the corpus (two "
                                                    "additive masks summed for SDPA)", lambda: _hf("additive"),
                                                    REWRITTEN, 1, MASKED,
                                                    detail="additive mask plus a -inf selection bias"),
    "dense_attention": AttentionEntry(dense_attention, "plain attention (no selection)", _dense, LEFT_ALONE),
    "gathered_rows_summed": AttentionEntry(gathered_rows_summed, "written for the corpus", _embedding_bag, LEFT_ALONE),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_entry_ends_as_declared(name):
    entry = CORPUS[name]
    got, want, _ = run_entry(entry, "sparse_attention")
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=entry.tolerance, atol=entry.tolerance, equal_nan=True)


def test_corpus_covers_the_family():
    """At least 12 independent formulations rewritten, every fused op and every declared outcome kind appears."""
    check_coverage(CORPUS, ops={GATHER, MASKED, COMPRESSED})
