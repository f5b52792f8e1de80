"""Spelling fuzzer for the `indexer_topk` family: each draw composes one program of the indexer's math from
independent, semantics-preserving choices (how the top-k is selected, how the mask is applied, where the scale
sits, how the heads are summed, whether q is laid out heads-first and k keys-last, batched or one sequence, the
q/k dtype), compiles it with `backend="dsfuse"` and checks it against eager: the same index set in every row (up
to ties), and the site either fused or reported as a near-miss with its reason; never wrong, never silent.

The default run draws `DRAWS` programs; `DSFUSE_SPELLING_DRAWS=n` draws n. `DSFUSE_SPELLING_STATS=path` writes
the outcomes per axis value (draws, fused, each near-miss reason) as JSON when the module finishes.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.nn.functional as F
from fuzz_support import write_spelling_stats
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfuse

DRAWS = int(os.environ.get("DSFUSE_SPELLING_DRAWS", "24"))
K, D = 4, 16
SCALE = D**-0.5

AXES = {
    "selection": ("topk", "sort+slice", "argsort+slice"),
    "mask": ("where(-inf)", "additive", "none", "keep-polarity", "two additive", "fill -1e9"),
    "scale": ("before relu", "after relu"),
    "head_sum": ("einsum", "bmm", "mul+sum"),
    "q_layout": ("tokens-first", "heads-first"),
    "k_layout": ("[T, D]", "[D, T]"),
    "batch": ("batched", "one sequence"),
    "dtype": ("bf16 upcast", "fp32"),
}
OUTCOMES: dict[tuple[str, str], list[str]] = defaultdict(list)  # (axis, choice) -> "fused" or the reason, per draw


def spelling(choice: dict):
    """The indexer written with the drawn choices. q arrives as [.., S, H, D], or [.., H, S, D] heads-first;
    k [.., T, D] or [.., D, T], w [.., S, H], mask [.., S, T] (bool keep, or 0 / -inf); `..` is the batch dim or
    nothing."""
    heads_first = choice["q_layout"] == "heads-first"
    keys_last = choice["k_layout"] == "[D, T]"
    upcast = choice["dtype"] == "bf16 upcast"

    def scores_of(q, k):
        q, k = (q.float(), k.float()) if upcast else (q, k)
        if choice["head_sum"] == "einsum":
            keys = "...dt" if keys_last else "...td"
            x = torch.einsum(f"...hsd,{keys}->...hst" if heads_first else f"...shd,{keys}->...sht", q, k)
        else:
            x = torch.matmul(q, (k if keys_last else k.transpose(-1, -2)).unsqueeze(-3))
        if choice["scale"] == "before relu":
            return F.relu(x * SCALE)
        return F.relu(x) * SCALE

    def head_sum(x, w):
        kind = choice["head_sum"]
        if heads_first:  # x [.., H, S, T]
            if kind == "einsum":
                return torch.einsum("...hst,...sh->...st", x, w)
            if kind == "bmm":
                return torch.matmul(w.unsqueeze(-2), x.transpose(-3, -2)).squeeze(-2)
            return (x * w.transpose(-1, -2).unsqueeze(-1)).sum(dim=-3)
        if kind == "einsum":
            return torch.einsum("...sht,...sh->...st", x, w)
        if kind == "bmm":
            return torch.matmul(w.unsqueeze(-2), x).squeeze(-2)
        return (x * w.unsqueeze(-1)).sum(dim=-2)

    def masked(index, mask):
        kind = choice["mask"]
        if kind == "where(-inf)":
            return index.masked_fill(~mask, float("-inf"))
        if kind == "keep-polarity":
            return torch.where(mask, index, float("-inf"))
        if kind == "additive":
            return index + mask
        if kind == "two additive":  # a second [.., 1, T] mask (the last query row sees every key: all zeros)
            return index + mask + mask[..., -1:, :]
        if kind == "fill -1e9":  # masked keys score -1e9, not -inf: the op takes the fill
            return index.masked_fill(~mask, -1e9)
        return index

    def select(index):
        kind = choice["selection"]
        if kind == "topk":
            return index.topk(K, dim=-1).indices
        if kind == "sort+slice":
            return index.sort(dim=-1, descending=True).indices[..., :K]
        return torch.argsort(index, dim=-1, descending=True)[..., :K]

    def index(q, k, w, mask):
        return masked(head_sum(scores_of(q, k), w), mask)

    def indexer(q, k, w, mask):
        return select(index(q, k, w, mask))

    return indexer, index


def inputs(choice: dict, batch: int, seq: int, heads: int, seed: int) -> tuple:
    """Random q, k, w and a causal mask that also shows the first K keys to every query (each row has K valid
    keys, so the index set is unique: the scores have no ties)."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16 if choice["dtype"] == "bf16 upcast" else torch.float32
    q = torch.randn(batch, seq, heads, D, generator=gen).to(dt)
    k = torch.randn(batch, seq, D, generator=gen).to(dt)
    w = torch.randn(batch, seq, heads, generator=gen)
    t, s = torch.arange(seq)[None, :], torch.arange(seq)[:, None]
    keep = ((t <= s) | (t < K)).expand(batch, seq, seq).contiguous()
    additive = choice["mask"] in ("additive", "two additive")
    mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) if additive else keep
    if choice["q_layout"] == "heads-first":
        q = q.transpose(1, 2).contiguous()
    if choice["k_layout"] == "[D, T]":
        k = k.transpose(1, 2).contiguous()
    args = (q, k, w, mask)
    return args if choice["batch"] == "batched" else tuple(a[0] for a in args)


def assert_same_picks(got, want, scores, context):
    """The family's rule: distinct picks whose scores are eager's top-k scores; rows whose sets differ may only
    swap keys of equal scores (a zero-score tie after relu, or a rounding-level near tie)."""
    got, want = got.sort(dim=-1).values, want.sort(dim=-1).values
    assert (got[..., 1:] != got[..., :-1]).all(), context
    torch.testing.assert_close(scores.gather(-1, got).sort(dim=-1).values, scores.gather(-1, want).sort(dim=-1).values,
                               msg=lambda m: f"{m}\n{context}")


@settings(max_examples=DRAWS)
@given(choice=st.fixed_dictionaries({axis: st.sampled_from(values) for axis, values in AXES.items()}),
       batch=st.sampled_from([1, 2]), seq=st.sampled_from([6, 9, 11]), heads=st.sampled_from([2, 4, 8]),
       seed=st.integers(0, 2**16))
def test_every_spelling_is_fused_with_parity_or_reported(choice, batch, seq, heads, seed):
    torch._dynamo.reset()
    dsfuse.reset_report()
    (fn, index), args = spelling(choice), inputs(choice, batch, seq, heads, seed)
    with torch.no_grad():
        got = torch.compile(fn, backend="dsfuse", options={"enable": ["indexer_topk"]})(*args)
        want, scores = fn(*args), index(*args)
    rep = dsfuse.report()
    assert_same_picks(got, want, scores, (choice, str(rep)))
    fused, reasons = rep.counts["indexer_topk"], [m.reason for m in rep.near_misses if m.pass_name == "indexer_topk"]
    assert (fused, len(reasons)) in ((1, 0), (0, 1)), (choice, str(rep))
    for axis, value in choice.items():
        OUTCOMES[axis, value].append("fused" if fused else reasons[0])


def teardown_module():
    write_spelling_stats(OUTCOMES)
