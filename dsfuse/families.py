"""Each fused family's source subgraph, written as the model writes it, at benchmark shapes.

`python -m dsfuse.bench families` compiles these with Inductor and with dsfuse, so a number here
includes the pattern match: it is what a user of `backend="dsfuse"` gets for that subgraph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Family:
    name: str
    pass_name: str
    shape: str
    fn: Callable
    make_inputs: Callable[[], tuple]
    flops: float  # useful FLOPs (causal / selected work only)


def hf_indexer(q, k, w, mask, topk: int, scale: float):
    """`DeepseekV32Indexer` scoring and selection, consumed like HF does (scattered into a mask)."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale
    scores = F.relu(scores)
    index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    index_scores = index_scores.masked_fill(~mask, float("-inf"))
    idx = index_scores.topk(min(topk, index_scores.shape[-1]), dim=-1).indices.to(torch.int32)
    return torch.ones_like(mask).scatter(-1, idx.long(), False)


def hf_sparse_attention(q, k, v, idx, scale: float):
    """`DeepseekV32Attention`'s selection mask + SDPA over all keys, with the causal mask built from positions
    as transformers' `sdpa_mask` builds it for an unpadded batch."""
    B, _, S, _ = q.shape
    T = k.shape[2]
    queries = torch.arange(S, device=q.device)[None, None, :, None] + (T - S)
    causal = torch.arange(T, device=q.device)[None, None, None, :] <= queries
    index_mask = torch.ones((B, S, T), dtype=torch.bool, device=q.device).scatter(-1, idx.long(), False).unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~index_mask, scale=scale)


def mla_gather_attention(q_nope, q_pe, kv, pe, idx, scale: float):
    """Absorbed-MLA sparse attention by explicit gather, as the official inference code writes it."""
    batch = torch.arange(kv.shape[0], device=kv.device)[:, None, None]
    safe = idx.clamp(min=0)
    kv_rows, pe_rows = kv[batch, safe], pe[batch, safe]
    scores = (torch.einsum("bshc,bskc->bshk", q_nope, kv_rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)) * scale
    scores = scores.float().masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    probs = scores.softmax(dim=-1).to(q_nope.dtype)
    return torch.einsum("bshk,bskc->bshc", probs, kv_rows)


def _causal(B, S, T, device):
    rows = torch.arange(S, device=device)[:, None] + (T - S)
    return (torch.arange(T, device=device)[None, :] <= rows).expand(B, S, T)


def _random_topk(B, S, T, K, device, gen):
    """K distinct causal keys per query (fewer valid ones than K are filled with later keys)."""
    scores = torch.rand(B, S, T, device=device, generator=gen).masked_fill(~_causal(B, S, T, device), -1.0)
    return scores.topk(K, dim=-1).indices.to(torch.int32)


SHAPES = {
    # name: (indexer B,S,T,H,D,K) (attention B,S,T,H,K) (MLA B,S,T,H,K)
    "real": dict(indexer=(1, 4096, 32768, 64, 128, 2048), attention=(1, 8192, 8192, 128, 2048),
                 mla=(1, 4096, 65536, 128, 2048)),
    "tiny": dict(indexer=(1, 24, 48, 4, 32, 8), attention=(1, 24, 24, 4, 8), mla=(1, 24, 48, 4, 8)),
}


def families(size: str, device: str, dtype: torch.dtype) -> list[Family]:
    shapes = SHAPES[size]
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    B, S, T, H, D, K = shapes["indexer"]
    pairs = S * (T - S) + S * (S + 1) // 2
    indexer = Family(
        "indexer (HF form)", "indexer_topk", f"S{S} T{T} H{H} D{D} k{K}",
        lambda q, k, w, m: hf_indexer(q, k, w, m, K, D**-0.5),
        lambda: (randn(B, S, H, D), randn(B, T, D), randn(B, S, H, dt=torch.float32), _causal(B, S, T, device)),
        2.0 * pairs * H * D)

    B2, S2, T2, H2, K2 = shapes["attention"]
    dq, dv = (192, 128) if size == "real" else (24, 16)
    attention = Family(
        "sparse attention (HF mask + SDPA)", "sparse_attention", f"S{S2} T{T2} H{H2} k{K2} D{dq}/{dv}",
        lambda q, k, v, idx: hf_sparse_attention(q, k, v, idx, dq**-0.5),
        lambda: (randn(B2, H2, S2, dq), randn(B2, H2, T2, dq), randn(B2, H2, T2, dv),
                 _random_topk(B2, S2, T2, K2, device, gen)),
        2.0 * B2 * S2 * K2 * H2 * (dq + dv))

    B3, S3, T3, H3, K3 = shapes["mla"]
    dc, dr = (512, 64) if size == "real" else (32, 8)
    mla = Family(
        "sparse MLA (gather, absorbed)", "sparse_attention", f"S{S3} T{T3} H{H3} k{K3} D{dc + dr}/{dc}",
        lambda qn, qp, kv, pe, idx: mla_gather_attention(qn, qp, kv, pe, idx, (dc + dr) ** -0.5),
        lambda: (randn(B3, S3, H3, dc), randn(B3, S3, H3, dr), randn(B3, T3, dc), randn(B3, T3, dr),
                 _random_topk(B3, S3, T3, K3, device, gen)),
        2.0 * B3 * S3 * H3 * K3 * (2 * dc + dr))
    return [indexer, attention, mla]
