"""Spelling fuzzer for the `sparse_attention` family (V3.2 / GLM): each draw composes one program of attention over
indexer-picked keys from independent, semantics-preserving choices, compiles it with `backend="dsfuse"` and checks it
against eager: the same output (NaN where eager's is NaN), and the site either fused or reported as a near-miss with
its reason; never wrong, never silent.

Two program families share the draw. Mask forms (`sparse_attention_masked`'s math): dense attention over all keys
with the picks scattered into a mask (drop or keep polarity), combined with a bool or additive attention mask, or
alone, as a `where` on the scores or a bias built by `index_put`; softmax as `F.softmax`, `exp(x - max) / sum`,
`exp(x - logsumexp)` or SDPA; K/V per head or shared by the heads (MQA). Row forms (`sparse_mla_attention`'s math):
latent and rope rows read by the picks (batch index, `gather`, `take_along_dim`, `index_select`), `-1` picks masked
by `masked_fill` or `where`, the same softmax forms. Both: q heads-first or tokens-first, the scale on q or on the
scores, no sink, a sink as a softmax column or as a term of the denominator, fp32 or bf16.

The default run draws `DRAWS` programs; `DSFUSE_SPELLING_DRAWS=n` draws n. `DSFUSE_SPELLING_STATS=path` writes the
outcomes per axis value (draws, fused, each near-miss reason) as JSON, rewritten after every draw.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import torch
import torch.nn.functional as F
from fuzz_support import write_spelling_stats
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfuse

DRAWS = int(os.environ.get("DSFUSE_SPELLING_DRAWS", "12"))
K, D, DV, C, R = 3, 16, 8, 16, 8
MASK_SELECTIONS = ("scatter drop", "scatter keep")
ROW_SELECTIONS = ("batch index", "gather", "take_along_dim", "index_select")

AXES = {
    "selection": MASK_SELECTIONS + ROW_SELECTIONS,
    "mask": ("bool & selection", "additive finfo.min fill", "selection where(-inf)", "selection bias index_put",
             "two additive"),
    "minus_one": ("masked_fill(idx < 0)", "where(idx >= 0)"),
    "softmax": ("F.softmax", "exp(x - max) / sum", "exp(x - logsumexp)", "SDPA"),
    "sink": ("none", "column", "denominator"),
    "scale": ("on q", "on scores"),
    "q_layout": ("heads-first", "tokens-first"),
    "kv": ("per head", "shared (MQA)"),
    "dtype": ("fp32", "bf16"),
}
# Axes each family reads (the others do not change its program).
MASK_AXES = ("selection", "mask", "softmax", "sink", "scale", "q_layout", "kv", "dtype")
ROW_AXES = ("selection", "minus_one", "softmax", "sink", "scale", "q_layout", "dtype")
OUTCOMES: dict[tuple[str, str], list[str]] = defaultdict(list)  # (axis, choice) -> "fused" or the reason, per draw


def _softmax(x: torch.Tensor, choice: dict, sink: torch.Tensor | None, heads_dim: int) -> torch.Tensor:
    """Weights over the last dim of fp32 scores `x`, with the drawn softmax and sink forms (`sink` [H] broadcast
    along `heads_dim`)."""
    shape = [1] * x.dim()
    shape[heads_dim] = -1
    if choice["sink"] == "column":
        column = sink.view(shape).expand(*x.shape[:-1], 1)
        return _softmax(torch.cat([x, column], dim=-1), dict(choice, sink="none"), None, heads_dim)[..., :-1]
    kind = choice["softmax"]
    if choice["sink"] == "denominator":
        top = torch.maximum(x.amax(dim=-1, keepdim=True), sink.view(shape))
        weights = torch.exp(x - top)
        return weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink.view(shape) - top))
    if kind == "exp(x - max) / sum":
        weights = torch.exp(x - x.amax(dim=-1, keepdim=True))
        return weights / weights.sum(dim=-1, keepdim=True)
    if kind == "exp(x - logsumexp)":
        return torch.exp(x - torch.logsumexp(x, dim=-1, keepdim=True))
    return F.softmax(x, dim=-1)


def masked_program(choice: dict):
    """HF-style attention: the picks scattered into a selection mask over all T keys. q [B, H, S, D] (or
    [B, S, H, D] tokens-first), k / v [B, H, T, *] (or [B, T, *] shared by the heads), idx [B, S, K], mask
    [B, 1, S, T] (bool keep, or 0 / finfo.min), sink [H]."""
    def attention(q, k, v, idx, mask, sink):
        if choice["q_layout"] == "tokens-first":
            q = q.transpose(1, 2)
        if choice["kv"] == "shared (MQA)":
            k, v = k.unsqueeze(1), v.unsqueeze(1)
        b, h, s, d = q.shape
        t = k.shape[-2]
        if choice["selection"] == "scatter drop":
            drop = torch.ones(b, s, t, dtype=torch.bool).scatter(-1, idx, False)[:, None]
            keep = ~drop
        else:
            keep = torch.zeros(b, s, t, dtype=torch.bool).scatter(-1, idx, True)[:, None]
            drop = ~keep
        scale = d**-0.5
        if choice["scale"] == "on q":
            q, scale = q * scale, 1.0
        kind = choice["mask"]
        bias = None
        if kind in ("selection bias index_put", "two additive"):
            bias = torch.zeros(b, 1, s, t, dtype=q.dtype)
            bias[drop] = float("-inf")
        if kind == "bool & selection":
            combined = mask & keep
        elif kind == "additive finfo.min fill":
            combined = mask.masked_fill(drop, torch.finfo(q.dtype).min)
        elif kind == "selection where(-inf)":
            combined = keep
        else:
            combined = bias if kind == "selection bias index_put" else mask + bias
        if choice["softmax"] == "SDPA" and choice["sink"] == "none":
            out = F.scaled_dot_product_attention(q, k.expand(b, h, t, d), v.expand(b, h, t, v.shape[-1]),
                                                 attn_mask=combined, scale=scale)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
            if combined.dtype == torch.bool:
                scores = scores.masked_fill(~combined, float("-inf"))
            else:
                scores = scores + combined
            probs = _softmax(scores.float(), choice, sink, heads_dim=1)
            out = torch.matmul(probs.to(q.dtype), v)
        return out.transpose(1, 2) if choice["q_layout"] == "tokens-first" else out

    return attention


def _rows(src: torch.Tensor, safe: torch.Tensor, kind: str) -> torch.Tensor:
    """src [B, T, W] read at safe [B, S, K]: [B, S, K, W]."""
    b, t, w = src.shape
    s = safe.shape[1]
    if kind == "gather":
        return torch.gather(src.unsqueeze(1).expand(b, s, t, w), 2, safe.unsqueeze(-1).expand(b, s, safe.shape[2], w))
    if kind == "take_along_dim":
        return torch.take_along_dim(src[:, None], safe[..., None], dim=2)
    if kind == "index_select":
        flat = (safe + torch.arange(b)[:, None, None] * t).reshape(-1)
        return src.reshape(b * t, w).index_select(0, flat).view(b, s, -1, w)
    return src[torch.arange(b)[:, None, None], safe]


def row_program(choice: dict):
    """Official-style absorbed MLA over gathered picks: q_nope [B, S, H, C] and q_pe [B, S, H, R] (or heads-first),
    latent cache kv [B, T, C] (keys and values), rope keys pe [B, T, R], idx [B, S, K] with -1 for no key, sink [H]."""
    def attention(q_nope, q_pe, kv, pe, idx, sink):
        heads = "bhs" if choice["q_layout"] == "heads-first" else "bsh"
        safe = idx.clamp(min=0)
        rows, pe_rows = _rows(kv, safe, choice["selection"]), _rows(pe, safe, choice["selection"])
        scale = (C + R) ** -0.5
        if choice["scale"] == "on q":
            q_nope, q_pe, scale = q_nope * scale, q_pe * scale, 1.0
        scores = torch.einsum(f"{heads}c,bskc->bshk", q_nope, rows) + torch.einsum(f"{heads}r,bskr->bshk", q_pe,
                                                                                     pe_rows)
        scores = (scores * scale).float()
        if choice["minus_one"] == "masked_fill(idx < 0)":
            scores = scores.masked_fill((idx < 0).unsqueeze(2), float("-inf"))
        else:
            scores = torch.where((idx >= 0).unsqueeze(2), scores, float("-inf"))
        probs = _softmax(scores, choice, sink, heads_dim=2)
        return torch.einsum("bshk,bskc->bshc", probs.to(q_nope.dtype), rows)

    return attention


def _picks(batch: int, seq: int, gen: torch.Generator, pad: int) -> torch.Tensor:
    """[B, S, K] distinct causal picks (key t <= s), the slots past a query's causal keys `pad`."""
    idx = torch.full((batch, seq, K), pad, dtype=torch.int64)
    for b in range(batch):
        for s in range(seq):
            picks = torch.randperm(s + 1, generator=gen)[:K]
            idx[b, s, : len(picks)] = picks
    return idx


def inputs(choice: dict, batch: int, seq: int, heads: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16 if choice["dtype"] == "bf16" else torch.float32
    sink = torch.randn(heads, generator=gen)
    if choice["selection"] in ROW_SELECTIONS:
        q_nope = torch.randn(batch, seq, heads, C, generator=gen)
        q_pe = torch.randn(batch, seq, heads, R, generator=gen)
        if choice["q_layout"] == "heads-first":
            q_nope, q_pe = q_nope.transpose(1, 2).contiguous(), q_pe.transpose(1, 2).contiguous()
        kv, pe = torch.randn(batch, seq, C, generator=gen), torch.randn(batch, seq, R, generator=gen)
        return (q_nope.to(dt), q_pe.to(dt), kv.to(dt), pe.to(dt), _picks(batch, seq, gen, -1), sink)
    q = torch.randn(batch, heads, seq, D, generator=gen)
    if choice["q_layout"] == "tokens-first":
        q = q.transpose(1, 2).contiguous()
    kv_heads = () if choice["kv"] == "shared (MQA)" else (heads,)
    k, v = torch.randn(batch, *kv_heads, seq, D, generator=gen), torch.randn(batch, *kv_heads, seq, DV, generator=gen)
    keep = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, 1, seq, seq).clone()
    keep[-1, :, :, :1] = False  # left padding in the last sequence
    keep[-1, :, :1, :] = False  # its padding query sees no key
    additive = choice["mask"] in ("additive finfo.min fill", "two additive")
    mask = torch.zeros(keep.shape, dtype=dt).masked_fill(~keep, torch.finfo(dt).min) if additive else keep
    return (q.to(dt), k.to(dt), v.to(dt), _picks(batch, seq, gen, 0), mask, sink)


@settings(max_examples=DRAWS)
@given(choice=st.fixed_dictionaries({axis: st.sampled_from(values) for axis, values in AXES.items()}),
       batch=st.sampled_from([1, 2]), seq=st.sampled_from([5, 8]), heads=st.sampled_from([2, 4]),
       seed=st.integers(0, 2**16))
def test_every_spelling_is_fused_with_parity_or_reported(choice, batch, seq, heads, seed):
    torch._dynamo.reset()
    dsfuse.reset_report()
    rows = choice["selection"] in ROW_SELECTIONS
    fn = row_program(choice) if rows else masked_program(choice)
    args = inputs(choice, batch, seq, heads, seed)
    with torch.no_grad():
        got = torch.compile(fn, backend="dsfuse", options={"enable": ["sparse_attention"]})(*args)
        want = fn(*args)
    rep = dsfuse.report()
    tolerance = 3e-2 if choice["dtype"] == "bf16" else 1e-4
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, equal_nan=True,
                               msg=lambda m: f"{m}\n{choice}\n{rep}")
    fused = rep.counts["sparse_attention"]
    reasons = [m.reason for m in rep.near_misses if m.pass_name == "sparse_attention"]
    assert (fused == 1 and not reasons) or (fused == 0 and reasons), (choice, str(rep))
    # SDPA takes no sink and the row forms no SDPA: those draws write the softmax as F.softmax.
    sdpa = choice["softmax"] == "SDPA" and (rows or choice["sink"] != "none")
    drawn = dict(choice, softmax="F.softmax") if sdpa else choice
    for axis in ROW_AXES if rows else MASK_AXES:
        OUTCOMES[axis, drawn[axis]].append("fused" if fused else reasons[0])
    _write_stats()


def _write_stats():
    """The outcomes so far, per axis value, to DSFUSE_SPELLING_STATS (rewritten after every draw, so a long run
    that is stopped still leaves its table)."""
    write_spelling_stats(OUTCOMES)


def test_every_axis_has_a_spelling_for_each_family():
    """Each family's program runs eagerly for every value of the axes it reads."""
    for axis in MASK_AXES + ROW_AXES:
        for value in AXES[axis]:
            selections = ROW_SELECTIONS if axis in ROW_AXES and axis not in MASK_AXES else MASK_SELECTIONS
            if axis == "selection":
                selections = (value,)
            choice = {name: values[0] for name, values in AXES.items()} | {"selection": selections[0], axis: value}
            fn = row_program(choice) if choice["selection"] in ROW_SELECTIONS else masked_program(choice)
            out = fn(*inputs(choice, 2, 5, 2, 0))
            assert not math.isnan(float(out[0, -1].float().sum())), choice
