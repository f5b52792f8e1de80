"""DeepSeek V4 attention (HF `DeepseekV4Attention` with `eager_attention_forward`) into `dsfuse::compressed_attention`.

HF computes, for every layer, dense scores of all heads against one shared K=V row set (the sliding-window rows,
then the compressor's entries on CSA / HCA layers), adds an additive mask (the sliding-window causal mask, with
padding, `cat` the compressor's `block_bias`), appends the per-head sink logit, softmaxes in fp32, drops the sink,
rounds the probabilities to the value dtype and multiplies by the same rows; the layer then undoes RoPE on the
output (`apply_rotary_pos_emb(out, cos, -sin)`). The anchor is the `cat` of the sink column. From it the matcher
proves, step by step:

* the softmax over `[scores | sink]` (max-subtracted, fp32), the slice dropping the sink, the cast to the value
  dtype and `P @ V`, with V and K the same `[B, 1, T, D]` tensor broadcast over the heads (labelled dims);
* the scores `q . k` scaled by one constant after the product;
* the window mask: a bool conjunction of `kv > q - window`, `kv <= q`, and optionally the padding read of the
  attention mask at the key, or HF's packed-sequence test on an `arange` of positions (always true there), where
  q / kv are query / key positions read either from a `[B, S]` position table or from `arange`s; or an additive
  `[B, 1, S, N]` graph input, the mask `generate` builds outside the compiled call (HF's 0 = seen, finfo.min form):
  for one query the seen rows become positions, for several the op reads the rows each query sees from it
  (`window_mask`), whatever their pattern;
* the compressed part (keys after the window rows): CSA's scatter of the indexer's top-k (`-1` = none, moved to a
  spare column that is sliced off) into a `-inf` bias, or HCA's causal threshold `entry >= (pos + 1) // m` at the
  same query positions as the window mask;
* optionally the inverse interleaved RoPE on the trailing `2R` dims of the output, folded into the op's epilogue.

A model cast as a whole (`.to(torch.bfloat16)`, `.half()`) has bf16 / fp16 sinks, so HF's `cat` and the shift by the
row max are in that dtype (the softmax itself still computes in fp32 and rounds its output, as the op does). The
rewrite widens the sinks (exact) and the op shifts the logits in fp32 instead of rounding `logit - max` to the input
dtype first: the one rounding of the cast graph it leaves out, which moves the result towards the fp32 model's (the
distances are measured in tests/models/test_cast_models.py).

The rewrite reads the window rows and the compressed entries where they are (not their `cat`) and builds the
positions from the nodes the mask was built from, with symbolic sizes and no host sync.

Before the rewrite, every match is run on probes against the op's reference (`verify.py`): random q / rows /
entries, sinks of both signs and large ones, distinct picks with -1 and a query without any, a padded start, the
first queries seeing fewer window rows and no HCA entry, RoPE tables of angles, an input mask of HF's 0 / finfo.min;
symbolic sizes at two small assignments the graph's guards admit, within `ULPS`. What the walk does not read (an
add's `alpha` scaling the scores) is caught there: a disagreement is a near-miss naming the probe. Unprobed, the
structural match standing: a slice over `verify.MAX_ELEMENTS` values at static sizes (a real-dimension prefill) or
one whose probe sizes the graph's guards rule out. Not established by probes (the probes take them as given): that
CSA's picks are distinct (the op's CUDA path asks it, as a top-k gives it; the reference, like HF's scatter, reads a
repeat as one pick) and that an input mask holds only 0 / finfo.min (what `generate` builds; the op reads its 0
entries as seen).

Stages (run from `sparse_attention.run`): anchors `ANCHORS`; binder `_match`; verifier `_verify`, against
`compressed_attention_reference` (kernels/compressed_attention.py), fed as the rewrite feeds the op; rewrite `_rewrite`
into `dsfuse::compressed_attention`.
"""

from __future__ import annotations

import operator

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from dsfuse.kernels.compressed_attention import compressed_attention_reference  # (and the op)

from .canonicalize import canonical_bmm, padded_product
from .context import NoMatch, PassContext, rewrite_anchored
from .dims import apply_op, bmm_labels, contracted, follow, leaf_labels, names
from .graph_utils import (AND_OPS, CONVERT, FLOAT_DTYPES, INDEX_DTYPES, LAYOUT_OPS, VIEW_OPS, WHERE_OPS, aten,
                          attention_softmax, dtype, fill_value, insert_call, is_last_dim, is_last_dim_cat, is_neg_inf, is_op, masking_bias,
                          node_arg, only_user, same_shape, same_size, scale_factor, scaled_input, shape, size_arg,
                          slice_args, slice_position, strip, val, walk_back, walk_forward)
from .verify import TINY, Family, Verdict, ulps_beyond, verify

IOTA = torch.ops.prims.iota.default
# What position tables and aranges are broadcast through on their way into the mask.
SHAPE_OPS = (aten.unsqueeze.default, aten.expand.default, *VIEW_OPS)


# ---------------------------------------------------------------------------
# Anchors
# ---------------------------------------------------------------------------

# The `cat` that appends the per-head sink column to the scores.
ANCHORS = (aten.cat.default,)


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, ANCHORS, _match, _rewrite)


# ---------------------------------------------------------------------------
# Binding: small helpers
# ---------------------------------------------------------------------------


def _layout_chain(node) -> list[torch.fx.Node]:
    """[leaf, ..., node] through layout ops only."""
    return walk_back(node, lambda n: is_op(n, *LAYOUT_OPS))


# ---------------------------------------------------------------------------
# Binding: positions, `arange`s and `[B, S]` position tables read at (batch, query / key) indices
# ---------------------------------------------------------------------------


def _arange(node) -> tuple | None:
    """(1-d node, length, start) for `iota(n, start, step=1) + c` seen through unsqueeze / expand / view."""
    node = strip(node, SHAPE_OPS)
    offset = 0
    base = node
    while is_op(node, aten.add.Tensor) and isinstance(val(node.args[1]), (int, torch.SymInt)):
        node, offset = node.args[0], offset + val(node.args[1])
    if not is_op(node, IOTA) or node.kwargs.get("step", 1) != 1:
        return None
    return base, val(node.args[0]), node.kwargs.get("start", 0) + offset


def _index_along(node, rank_dim: int) -> tuple | None:
    """(1-d node, length, start) when `node` is an arange laid out as a rank-4 tensor wide only in `rank_dim`."""
    found = _arange(node)
    dims = shape(node)
    if found is None or len(dims) != 4:
        return None
    wide = [i for i, size in enumerate(dims) if not same_size(size, 1)]
    if wide not in ([rank_dim], []):
        return None
    return found


def _table_read(node, rank_dim: int) -> tuple | None:
    """(table [B', L], index length) for `table[arange(B)[:, None, None, None], arange(L) along rank_dim]`."""
    if not is_op(node, aten.index.Tensor) or len(node.args[1]) != 2:
        return None
    table, (batch, position) = node.args[0], node.args[1]
    if len(shape(table)) != 2 or any(i is None for i in (batch, position)):
        return None
    b = _arange(batch)
    p = _index_along(position, rank_dim)
    if b is None or p is None or b[2] != 0 or p[2] != 0 or len(shape(batch)) != 4:
        return None
    if not (same_size(shape(batch)[0], shape(table)[0]) and all(same_size(s, 1) for s in shape(batch)[1:])):
        return None
    return table, p[1]


def _position_term(node, rank_dim: int) -> dict | None:
    """A query (rank_dim 2) or key (rank_dim 3) position in the mask: a table read or an arange."""
    read = _table_read(node, rank_dim)
    if read is not None:
        return dict(kind="table", table=strip(read[0], (aten.expand.default,)), length=read[1])
    found = _index_along(node, rank_dim)
    if found is not None:
        return dict(kind="arange", base=found[0], length=found[1], start=found[2])
    return None


def _same_term(a: dict, b: dict) -> bool:
    if a["kind"] != b["kind"]:
        return False
    if a["kind"] == "table":
        return a["table"] is b["table"]
    return same_size(a["start"], b["start"])


def _packed_sequence_ids(node, table: torch.fx.Node) -> bool:
    """HF's packed-sequence ids: `cumsum(diff(cat([p[:, :1] - 1, p], -1)) != 1, -1)` of the position table."""
    if not is_op(node, aten.cumsum.default) or not is_last_dim(node, node.args[1]):
        return False
    ne = node.args[0]
    if not (is_op(ne, aten.ne.Scalar) and ne.args[1] == 1 and is_op(ne.args[0], aten.sub.Tensor)):
        return False
    later, earlier = ne.args[0].args
    if not (is_op(later, aten.slice.Tensor) and is_op(earlier, aten.slice.Tensor) and later.args[0] is earlier.args[0]):
        return False
    cat = later.args[0]
    source = strip(table, SHAPE_OPS)
    if not (is_op(cat, aten.cat.default) and len(cat.args[0]) == 2 and strip(cat.args[0][1], SHAPE_OPS) is source):
        return False
    first = cat.args[0][0]
    return is_op(first, aten.sub.Tensor) and first.args[1] == 1 and is_op(first.args[0], aten.slice.Tensor) \
        and strip(first.args[0].args[0], SHAPE_OPS) is source


def _conjuncts(node) -> list:
    """The terms of a bool `and` tree, without `full(True)` constants and broadcasting expands."""
    node = strip(node, (aten.expand.default,))
    if is_op(node, *AND_OPS):
        return [t for a in node.args for t in _conjuncts(a)]
    if fill_value(node) is True:
        return []
    return [node]


def _window_mask(mask: torch.fx.Node, B, S, N) -> dict:
    """Prove that the bool `mask` [B, 1, S, N] is the sliding-window causal mask (with padding) and say where its
    query and key positions come from."""
    q_term = kv_term = None
    window = causal = padding = packed = None

    def positions(kv, q):
        nonlocal q_term, kv_term
        k_t, q_t = _position_term(kv, 3), _position_term(q, 2)
        if k_t is None or q_t is None:
            return False
        for have, new in ((kv_term, k_t), (q_term, q_t)):
            if have is not None and not _same_term(have, new):
                raise NoMatch("the window mask compares positions from different sources")
        kv_term, q_term = k_t, q_t
        return True

    for term in _conjuncts(mask):
        if is_op(term, aten.gt.Tensor) and is_op(term.args[1], aten.sub.Tensor) \
                and isinstance(term.args[1].args[1], int) and positions(term.args[0], term.args[1].args[0]):
            window = term.args[1].args[1]
        elif is_op(term, aten.le.Tensor) and positions(*term.args):
            causal = True
        elif is_op(term, aten.ge.Tensor) and positions(term.args[1], term.args[0]):
            causal = True
        elif is_op(term, aten.eq.Tensor) and all(is_op(a, aten.index.Tensor) for a in term.args) \
                and term.args[0].args[0] is term.args[1].args[0]:
            packed = term
        elif is_op(term, aten.index.Tensor) and _table_read(term, 3) is not None and dtype(term) == torch.bool:
            padding = term
        else:
            raise NoMatch(f"the attention mask has a term ({term.target}) that is not the sliding-window causal "
                          "mask, padding or HF's packed-sequence test")
    if q_term is None or not causal:
        raise NoMatch("the attention mask is not causal in the query and key positions")
    if window is None or window < 1:
        raise NoMatch("the attention mask has no sliding window (kv > q - window)")
    if not same_size(q_term["length"], S) or not same_size(kv_term["length"], N):
        raise NoMatch("the mask's position ranges do not cover the queries and window rows")
    if packed is not None:
        ids = [a.args[0] for a in packed.args]
        if q_term["kind"] != "table" or _arange(q_term["table"]) is None \
                or not _packed_sequence_ids(ids[0], q_term["table"]):
            raise NoMatch("the mask separates packed sequences by their position_ids, which the fused op does not "
                          "model (only positions that are one arange are proven to hold one sequence)")
        if not (_table_read(packed.args[0], 2) or _table_read(packed.args[1], 2)):
            raise NoMatch("the packed-sequence test does not read the query and key positions")
    if q_term["kind"] == "table":
        table = q_term["table"]
        if not same_size(shape(table)[1], S) or not same_size(shape(table)[1], N):
            raise NoMatch("the position table does not give one position per query and window row")
        found = _arange(table)
        if found is None or not (isinstance(found[2], int) and found[2] >= 0):
            raise NoMatch("the mask's position table is not a non-negative arange (key position -1 marks padding "
                          "in the fused op)")
    elif not (isinstance(q_term["start"], int) and q_term["start"] >= 0):
        raise NoMatch("the mask's positions do not start at a non-negative constant")
    if padding is not None:  # kept as eager reads it, table[b, key]: the table may be longer than the keys, and
        # under dynamic shapes its length is a symbol of its own
        table, length = _table_read(padding, 3)
        read = shape(padding)
        if not (same_size(length, N) and same_size(shape(table)[0], B) and len(read) == 4
                and all(same_size(d, 1) for d in read[1:3])):
            raise NoMatch(f"the padding mask's read {read} of {shape(table)} is not one value per batch row and key "
                          f"([B, 1, 1, N] = [{B}, 1, 1, {N}])")
    return dict(q=q_term, kv=kv_term, window=window, padding=padding)


def _additive_window(node) -> torch.fx.Node | None:
    """The bool mask of `where(mask, 0, big negative)` (converts allowed), else None."""
    node = strip(node, (CONVERT, aten.expand.default))
    if is_op(node, *WHERE_OPS) \
            and fill_value(node.args[1]) == 0 and masking_bias(fill_value(node.args[2])) is not None \
            and dtype(node.args[0]) == torch.bool:
        return node.args[0]
    return None


def _csa_indices(bias: torch.fx.Node, B, S, T) -> torch.fx.Node | None:
    """The top-k indices of CSA's `full(-inf, [B, 1, S, T + 1]).scatter(-1, where(i >= 0, i, T)[:, None], 0)[..., :T]`."""
    bias = strip(bias, (CONVERT,))
    if not is_op(bias, aten.slice.Tensor):
        return None
    dim, start, end, step = slice_args(bias)
    if not (is_last_dim(bias, dim) and start == 0 and same_size(end, T) and step == 1):
        return None
    scatter = strip(bias.args[0], (CONVERT,))
    if is_op(scatter, aten.scatter.value) and is_last_dim(scatter, scatter.args[1]) and scatter.args[3] == 0:
        base, index = scatter.args[0], scatter.args[2]
        if not (is_op(base, aten.full.default) and is_neg_inf(base.args[1])
                and same_shape(shape(base), (B, 1, S, T + 1))):
            return None
    else:
        # One pick per query (k = 1): Inductor writes the scatter as `where(index == arange(T + 1), 0, -inf)`.
        if not (is_op(scatter, aten.where.self) and fill_value(scatter.args[1]) == 0 and is_neg_inf(fill_value(scatter.args[2]))
                and is_op(scatter.args[0], aten.eq.Tensor) and same_shape(shape(scatter), (B, 1, S, T + 1))):
            return None
        picked, entries = scatter.args[0].args
        found = _index_along(entries, 3)
        if found is None or found[2] != 0 or not same_size(found[1], T + 1) or not is_op(picked, aten.expand.default):
            return None
        index = picked.args[0]
        if not same_size(shape(index)[-1], 1):
            return None
    if not (is_op(index, aten.unsqueeze.default) and index.args[1] == 1):
        return None
    safe = index.args[0]
    if not is_op(safe, aten.where.self, aten.where.ScalarOther):
        return None
    cond, idx, spare = safe.args
    if not (is_op(cond, aten.ge.Scalar) and cond.args[0] is idx and cond.args[1] == 0):
        return None
    if val(fill_value(spare)) is None or not same_size(val(fill_value(spare)), T):
        return None
    if dtype(idx) not in INDEX_DTYPES or not same_shape(shape(idx)[:2], (B, S)) or len(shape(idx)) != 3:
        return None
    return idx


def _hca_threshold(bias: torch.fx.Node, B, S, T) -> tuple | None:
    """(positions, m) of HCA's `where(arange(T) >= (positions + 1) // m, -inf, 0)` over [B, 1, S, T]."""
    bias = strip(bias, (CONVERT,))
    if not is_op(bias, aten.where.self) or not is_neg_inf(fill_value(bias.args[1])) or fill_value(bias.args[2]) != 0:
        return None
    cond = bias.args[0]
    if not is_op(cond, aten.ge.Tensor):
        return None
    entries, threshold = cond.args
    found = _index_along(entries, 3)
    if found is None or found[2] != 0 or not same_size(found[1], T):
        return None
    div = strip(threshold, (aten.unsqueeze.default,))
    if not (is_op(div, aten.div.Tensor_mode) and div.kwargs.get("rounding_mode") == "floor"
            and isinstance(div.args[1], int) and div.args[1] >= 1) and not is_op(div, aten.floor_divide.default):
        return None
    plus = div.args[0]
    if not (is_op(plus, aten.add.Tensor) and plus.args[1] == 1):
        return None
    positions = plus.args[0]
    if len(shape(positions)) != 2 or not same_size(shape(positions)[1], S) or len(shape(threshold)) != 4 \
            or not same_size(shape(threshold)[2], S):
        return None
    return positions, div.args[1]


# ---------------------------------------------------------------------------
# Binding: the inverse RoPE epilogue
# ---------------------------------------------------------------------------


def _repeated_pairs(node) -> torch.fx.Node | None:
    """The [B', S, R] table x of `x.repeat_interleave(2, -1).unsqueeze(1)` as Inductor writes it (unsqueeze, expand,
    clone, view, unsqueeze), proven by following its dims to [B', 1, S, (R, 2)]."""
    chain = []
    while is_op(node, *LAYOUT_OPS, CONVERT):
        chain.append(node)
        node = node.args[0]
    if len(shape(node)) != 3 or not chain:
        return None
    B, S, R = shape(node)
    labels = leaf_labels(node, "bsr")
    for op in chain[::-1]:
        if labels is None:
            return None
        if is_op(op, CONVERT):
            continue
        labels = apply_op(labels, op)
    pairs = [n for n in chain if is_op(n, aten.expand.default)]
    if labels is None or len(pairs) != 1 or not same_size(shape(pairs[0])[-1], 2):
        return None
    got = names(labels)
    return node if len(got) == 4 and got[0] == names([(("b", B),)])[0] and got[1] == () \
        and got[2] == names([(("s", S),)])[0] and got[3] == names([(("r", R), ("*", 2))])[0] else None


def _rotate_half_of(node, rope: torch.fx.Node) -> bool:
    """Whether `node` is `stack((-rope[..., 1::2], rope[..., 0::2]), -1).flatten(-2)` (casts allowed)."""
    node = strip(node, (CONVERT, *VIEW_OPS))
    if not (is_last_dim_cat(node) and len(node.args[0]) == 2):
        return False
    parts = node.args[0]
    if not all(is_op(p, aten.unsqueeze.default) and is_last_dim(p, p.args[1]) for p in parts):
        return False
    first, second = (p.args[0] for p in parts)
    if not is_op(first, aten.neg.default):
        return False
    odd, even = first.args[0], second

    def strided(s, start):
        if not (is_op(s, aten.slice.Tensor) and s.args[0] is rope):
            return False
        dim, first, end, step = slice_args(s)
        width = shape(rope)[-1]
        return is_last_dim(rope, dim) and first == start and same_size(slice_position(end, width), width) and step == 2

    return strided(odd, 1) and strided(even, 0)


def _inverse_rope(out_bhsd: torch.fx.Node, D) -> dict | None:
    """`cat([x[..., :-2R], rotate(x[..., -2R:], cos, -sin)], -1)` on the attention output x [B, H, S, D], as HF's
    `apply_rotary_pos_emb(x, cos, -sin)` writes it (interleaved pairs, fp32 math), or None."""
    slices = [u for u in out_bhsd.users if is_op(u, aten.slice.Tensor) and is_last_dim(u, slice_args(u)[0])
              and slice_args(u)[3] == 1]
    span = {s: [slice_position(bound, D) for bound in slice_args(s)[1:3]] for s in slices}
    nope = next((s for s in slices if span[s][0] == 0), None)
    rope = next((s for s in slices if s is not nope and same_size(span[s][1], D)), None)
    if nope is None or rope is None or not same_size(span[nope][1], span[rope][0]):
        return None
    width = D - span[rope][0]
    cats = [u for u in nope.users if is_last_dim_cat(u) and len(u.args[0]) == 2 and u.args[0][0] is nope]
    if len(cats) != 1:
        return None
    cat = cats[0]
    rotated = strip(cat.args[0][1], (CONVERT,))
    if not is_op(rotated, aten.add.Tensor) or not all(is_op(t, aten.mul.Tensor) for t in rotated.args):
        return None
    cos = neg_sin = None
    for term in rotated.args:
        for x, table in (term.args, term.args[::-1]):
            source = _repeated_pairs(table) if isinstance(table, torch.fx.Node) else None
            if source is None or not isinstance(x, torch.fx.Node):
                continue
            x = strip(x, (CONVERT,))
            if x is rope:
                cos = source
            elif _rotate_half_of(x, rope):
                neg_sin = source
    if cos is None or neg_sin is None or not is_op(neg_sin, aten.neg.default):
        return None
    sin = neg_sin.args[0]
    if not same_size(2 * shape(cos)[-1], width) or not same_shape(shape(cos), shape(sin)):
        return None
    return dict(cat=cat, cos=cos, sin=sin, rope_dim=width)


# ---------------------------------------------------------------------------
# Binding: the walk from the sink column's `cat`
# ---------------------------------------------------------------------------


def _sink_column(part: torch.fx.Node, H) -> torch.fx.Node | None:
    """The [H] sink parameter broadcast as `sinks.reshape(1, -1, 1, 1).expand(B, -1, S, -1)`."""
    leaf = strip(part, (aten.expand.default, *VIEW_OPS, aten.unsqueeze.default))
    if len(shape(leaf)) == 1 and same_size(shape(leaf)[0], H) and same_size(shape(part)[-1], 1):
        return leaf
    return None


def _softmax_of(cat: torch.fx.Node) -> torch.fx.Node:
    """The probabilities of `softmax(cat - cat.max(-1, keepdim=True))`, max taken as `max.dim` or `amax`."""
    users = list(cat.users)
    subs = [u for u in users if is_op(u, aten.sub.Tensor) and u.args[0] is cat]
    maxes = [u for u in users if is_op(u, aten.max.dim, aten.amax.default)]
    if len(subs) != 1 or len(maxes) != 1 or len(users) != 2:
        raise NoMatch("the sink-extended scores are not max-subtracted once before the softmax")
    row_max = maxes[0]
    if is_op(row_max, aten.max.dim):
        values = [g for g in row_max.users if g.target is operator.getitem and g.args[1] == 0]
        keepdim = len(row_max.args) > 2 and row_max.args[2]
        if len(values) != 1 or len(row_max.users) != 1 or not is_last_dim(cat, row_max.args[1]) or not keepdim:
            raise NoMatch("the row max is not the keep-dim max over the keys")
        row_max = values[0]
    elif not (len(row_max.args) > 2 and row_max.args[2] and len(row_max.args[1]) == 1
              and is_last_dim(cat, row_max.args[1][0])):
        raise NoMatch("the row max is not the keep-dim max over the keys")
    if subs[0].args[1] is not row_max:
        raise NoMatch("the scores are shifted by something other than their row max")
    soft = attention_softmax(subs[0])
    if soft is None or soft["safe"]:
        raise NoMatch("the shifted scores do not feed a softmax over the keys and the sink")
    return soft["probs"]


def _match(cat: torch.fx.Node) -> dict:
    parts = cat.args[0]
    if len(parts) != 2 or len(shape(cat)) != 4 or not is_last_dim_cat(cat):
        raise NoMatch("not a cat of scores and a sink column", reported=False)
    scores_in, sink_part = parts
    B, H, S, _ = shape(cat)
    sinks = _sink_column(sink_part, H) if isinstance(sink_part, torch.fx.Node) else None
    if sinks is None or not is_op(strip(scores_in, (CONVERT,)), aten.add.Tensor):
        raise NoMatch("not a cat of scores and a sink column", reported=False)
    users = list(cat.users)
    if not any(is_op(u, aten.max.dim, aten.amax.default) for u in users):
        raise NoMatch("not a cat of scores and a sink column", reported=False)
    if dtype(sinks) not in FLOAT_DTYPES:
        raise NoMatch(f"sink attention with {dtype(sinks)} sinks (the fused op widens bf16 / fp16 / fp32 sinks)")

    probs = _softmax_of(cat)
    # The sink column is dropped, the probabilities rounded to the value dtype and multiplied by the rows (a softmax
    # over bf16 / fp16 logits rounds its output before the slice).
    early_casts = walk_forward(probs, lambda n: is_op(n, CONVERT))[1:]
    drop = only_user(early_casts[-1] if early_casts else probs)
    bounds = slice_args(drop) if is_op(drop, aten.slice.Tensor) else None
    if bounds is None or not (is_last_dim(drop, bounds[0]) and bounds[1] == 0 and bounds[3] == 1
                              and (bounds[2] == -1 or same_size(bounds[2], shape(cat)[3] - 1))):
        raise NoMatch("the softmax output is not sliced to drop the trailing sink column")
    chain = walk_forward(drop, lambda n: is_op(n, *LAYOUT_OPS, CONVERT))
    node, prob_ops = chain[-1], early_casts + chain[1:]
    nxt = only_user(node)
    if nxt is None:
        raise NoMatch("the attention probabilities are also used elsewhere (returned attention weights?)")
    pv = padded_product(node)  # the bmm, or the product Inductor computes by zero-padding it (pad_mm)
    if pv is None and is_op(nxt, aten.bmm.default):
        raise NoMatch("the attention probabilities are not the left operand of P @ V")
    if pv is None:
        raise NoMatch(f"the attention probabilities pass through {nxt.target} before P @ V (dropout?)")
    _, pv_right = canonical_bmm(pv)

    scores_add = strip(scores_in, (CONVERT,))
    a, b = scores_add.args
    score_side = [x for x in (a, b) if isinstance(x, torch.fx.Node) and _chain_back_scaled(x)[0] is not None]
    if len(score_side) != 1:
        raise NoMatch("the masked scores are not a scaled q @ k^T product")
    scaled = score_side[0]
    mask = b if scaled is a else a
    qk, score_ops, scale = _chain_back_scaled(scaled)

    # q . k and P . v over one K=V tensor [B, 1, T, D] broadcast over the heads
    q_operand, k_operand = canonical_bmm(qk)
    q_chain, k_chain, v_chain = _layout_chain(q_operand), _layout_chain(k_operand), _layout_chain(pv_right)
    q = next((n for n in q_chain if same_shape(shape(n), (B, H, S, shape(n)[-1] if shape(n) else 0))), None)
    kv_all = k_chain[0]
    if kv_all is not v_chain[0]:
        raise NoMatch("keys and values are different tensors (V4 reads one shared K=V row set)")
    if q is None or len(shape(kv_all)) != 4 or not same_size(shape(kv_all)[1], 1):
        raise NoMatch("q is not [B, H, S, D] or the K=V rows are not one [B, 1, T, D] head")
    Dq = shape(q)[-1]
    T_all, D = shape(kv_all)[2], shape(kv_all)[3]
    if not same_shape(shape(q), (B, H, S, D)) or not same_size(Dq, D):
        raise NoMatch(f"q {shape(q)} and the K=V rows {shape(kv_all)} do not fit [B, H, S, D] x [B, 1, T, D]")
    q_l = follow(leaf_labels(q, "bhsd"), q_chain[q_chain.index(q) + 1:])
    k_l = follow(leaf_labels(kv_all, "bxtd"), k_chain[1:])
    qk_l = bmm_labels(q_l, k_l) if q_l and k_l else None
    if qk_l is None or names([contracted(q_l, k_l)]) != names([(("d", D),)]):
        raise NoMatch("the score product is not q[b,h,s,:] . kv[b,t,:]")
    s_l = follow(qk_l, score_ops)
    want = names([(("b", B),), (("h", H),), (("s", S),), (("t", T_all),)])
    if s_l is None or names(s_l) != want:
        raise NoMatch("the scores are not laid out as [B, H, S, T] where the mask is added")
    p_l = follow(s_l, [op for op in prob_ops if not is_op(op, CONVERT)])
    v_l = follow(leaf_labels(kv_all, "bxtd"), v_chain[1:])
    pv_l = bmm_labels(p_l, v_l) if p_l and v_l else None
    if pv_l is None or names([contracted(p_l, v_l)]) != names([(("t", T_all),)]):
        raise NoMatch("the output product is not P[b,h,s,:] . kv[b,:,e]")

    x_dtype = dtype(q)
    if x_dtype not in FLOAT_DTYPES or dtype(kv_all) != x_dtype or dtype(pv) != x_dtype:
        raise NoMatch(f"q / K=V / P @ V dtypes {x_dtype} / {dtype(kv_all)} / {dtype(pv)} differ or are unsupported")
    if dtype(qk) != x_dtype or dtype(scaled) != x_dtype:
        raise NoMatch(f"the scores are computed in {dtype(scaled)}, not in the input dtype {x_dtype}")
    if dtype(cat) not in (torch.float32, x_dtype):
        raise NoMatch(f"sink attention softmax over {dtype(cat)} logits, neither fp32 nor the input dtype {x_dtype}")
    casts = [op for op in prob_ops if is_op(op, CONVERT)]
    if any(op.args[1] != x_dtype for op in casts):
        raise NoMatch(f"the probabilities are rounded to {casts[-1].args[1]}, not {x_dtype}")

    # The output: [B, H, S, D] viewed as [B, S, H, D] (eager's transpose), then maybe the inverse RoPE
    out_l, node = follow(pv_l, []), pv
    rows_bshd = names([(("b", B),), (("s", S),), (("h", H),), (("d", D),)])
    rows_bhsd = names([(("b", B),), (("h", H),), (("s", S),), (("d", D),)])
    bshd = bhsd = None
    while True:
        current = names(out_l) if out_l is not None else None
        if current == rows_bhsd and len(shape(node)) == 4 and bshd is not None:
            bhsd = node
            break
        if current == rows_bshd and len(shape(node)) == 4:
            bshd = node
        nxt = only_user(node)
        if nxt is None or not is_op(nxt, *LAYOUT_OPS):
            break
        out_l = apply_op(out_l, nxt) if out_l is not None else None
        node = nxt
    out_is_bhsd = False
    if bshd is None and same_size(S, 1) and current == rows_bhsd and len(shape(node)) == 4:
        # One query per sequence (decode): [B, H, 1, D] and [B, 1, H, D] are one layout, and eager's transposes
        # around the inverse RoPE are gone from the graph; the output is read as [B, H, S, D].
        bshd = bhsd = node
        out_is_bhsd = True
    if bshd is None:
        raise NoMatch("the attention output is not viewed as [B, S, H, D]")
    epilogue = _inverse_rope(bhsd, D) if bhsd is not None else None

    # The mask: window part over the N window rows, then the compressed part over the T entries
    window_bias, block_bias = _mask_parts(mask)
    window_bool = _additive_window(window_bias)
    input_mask = _input_mask(window_bias, B, S) if window_bool is None else None
    if window_bool is None and input_mask is None:
        raise NoMatch("the window part of the attention mask is not where(bool mask, 0, -inf or finfo.min)")
    if block_bias is None:
        kv_rows, compressed, N, T = kv_all, None, T_all, 0
    else:
        if not (is_op(kv_all, aten.cat.default) and len(kv_all.args[0]) == 2
                and node_arg(kv_all, 1, "dim", 0) in (2, -2)):
            raise NoMatch("the mask has a compressed part but the K=V rows are not cat([window rows, compressed])")
        kv_rows, compressed = kv_all.args[0]
        N, T = shape(kv_rows)[2], shape(compressed)[2]
        if not same_size(shape(strip(window_bias, (CONVERT,)))[-1], N):
            raise NoMatch("the window mask and the window rows differ in length")
    if input_mask is not None and same_size(S, 1):
        # Positions that make the fused op's window and causal tests pass for every row: the query at N - 1 + T,
        # window row n at T + n (-1 where the mask is not 0), every HCA entry below (q + 1) // 1.
        win = dict(input=input_mask, window=N, padding=None, T=T)
    elif input_mask is not None:
        # Several queries (a prefill chunk under generate): the op reads the rows each query sees from the mask
        # itself (`window_mask`); HCA's entries keep their causal threshold at the block bias's own positions.
        win = dict(rows=input_mask, window=1, padding=None, q=None)
    else:
        win = _window_mask(window_bool, B, S, N)
    if dtype(scores_add) != x_dtype and not (dtype(scores_add) == torch.float32 and input_mask is None):
        # A float32 sum of x_dtype scores is the x_dtype sum only for a mask of 0 / -inf / finfo.min constants
        # (torch 2.11 on CUDA, and torch 2.12 on CPU too, drop the cast of CSA's decomposed scatter, so the block
        # bias arrives in float32).
        raise NoMatch(f"the masked scores are computed in {dtype(scores_add)}, not in the input dtype {x_dtype}")
    indices = hca = None
    if block_bias is _ZERO_PAD:
        if "input" not in win:
            raise NoMatch("the compressed entries are appended with a zero mask, which only a one-query step over "
                          "an additive input mask is read as (all entries visible)")
        hca = (None, 1)
    elif block_bias is not None:
        indices = _csa_indices(block_bias, B, S, T)
        if "input" in win and indices is None:
            raise NoMatch("the compressed entries' block bias is not CSA's scatter of the indexer's top-k")
        if indices is None:
            hca = _hca_threshold(block_bias, B, S, T)
            if hca is None:
                raise NoMatch("the compressed entries' block bias is neither CSA's scatter of the indexer's top-k "
                              "nor HCA's causal threshold (pos + 1) // m")
            if "rows" in win:
                win["q"] = dict(kind="table", table=strip(hca[0], (aten.expand.default,)))
            elif not _same_positions(hca[0], win["q"]):
                raise NoMatch("HCA's causal threshold reads other positions than the sliding-window mask")
    kind = "sliding" if block_bias is None else ("CSA" if indices is not None else "HCA")
    found = dict(q=q, kv_rows=kv_rows, compressed=compressed, indices=indices, sinks=sinks, scale=scale,
                 win=win, compress_rate=hca[1] if hca else 1, out=bshd, out_is_bhsd=out_is_bhsd, epilogue=epilogue,
                 kind=kind, B=B, S=S)
    verdict = _verify(found)
    if verdict.ok is False:
        raise NoMatch(f"numeric check against the reference failed: {verdict.reason}")
    return found


def _chain_back_scaled(node) -> tuple:
    """(bmm, layout ops after it, scale) for `bmm(...)` (as written or recorded by the canonicaliser) viewed and
    multiplied by one constant, else (None, ...)."""
    ops, scale = [], 1.0
    while canonical_bmm(node) is None:
        factor = scale_factor(node)
        if factor is not None:
            scale *= factor
            node = scaled_input(node)
        elif is_op(node, *LAYOUT_OPS):
            ops.append(node)
            node = node.args[0]
        else:
            break
    if canonical_bmm(node) is None:
        return None, [], 1.0
    return node, ops[::-1], scale


_ZERO_PAD = object()  # the compressed part of the mask is HF's zero padding (HCA at one query: every entry seen)


def _mask_parts(mask) -> tuple:
    """(window part, compressed part or None) of the additive mask: `cat([window, block_bias], -1)`, the window
    zero-padded over the compressed entries (`_ZERO_PAD`), or the window."""
    node = strip(mask, (CONVERT, aten.expand.default))
    if is_last_dim_cat(node) and len(node.args[0]) == 2:
        return node.args[0][0], node.args[0][1]
    if is_op(node, aten.constant_pad_nd.default) and len(node.args[1]) == 2 and node.args[1][0] == 0 \
            and (len(node.args) < 3 or node.args[2] == 0):
        return node.args[0], _ZERO_PAD
    return mask, None


def _input_mask(node, B, S) -> torch.fx.Node | None:
    """The [B, 1, S, N] additive mask when it is a graph input (as `generate` builds it outside the compiled call, for
    a decode step and for each prefill chunk: 0 where a row is seen, finfo.min where not), else None."""
    leaf = strip(node, (CONVERT, aten.expand.default))
    if leaf.op != "placeholder" or len(shape(leaf)) != 4:
        return None
    if not (same_size(shape(leaf)[0], B) and same_size(shape(leaf)[1], 1) and same_size(shape(leaf)[2], S)):
        return None
    return leaf if dtype(leaf).is_floating_point else None


def _same_positions(positions: torch.fx.Node, term: dict) -> bool:
    """Whether `positions` [B', S] holds the same values as the mask's query positions."""
    if term["kind"] == "table":
        return strip(positions, (aten.expand.default,)) is term["table"]
    found = _arange(positions)
    return found is not None and same_size(found[2], term["start"])


# ---------------------------------------------------------------------------
# Verification: the bound slice against the op's reference, on probes
# ---------------------------------------------------------------------------

# The budget, in ulps of the output dtype at a probe's largest key magnitude (the output is a convex combination of
# key rows): the probes' values lie on a 1/4 grid, so the scores are exact and the slice and the reference differ only
# in the exponentials, the summation order and, in a model cast as a whole, the max shift the op keeps in fp32
# (v4-tiny: at most 0.6 fp32 and 0.25 bf16 / fp16 ulps; a score doubled or a sink of the wrong sign: thousands).
ULPS = {torch.float32: 16, torch.float16: 4, torch.bfloat16: 4}


def _verify(m: dict) -> Verdict:
    """Run the matched slice on probes against `compressed_attention_reference`, fed as the rewrite feeds the op.
    The query and key positions the rewrite reads from the mask's own nodes (an `arange`, a table built from one)
    are taken from the slice's run, so the proof is of the op on the values the rewrite gives it. Not run (None)
    over `verify.MAX_ELEMENTS` values at static sizes (the structural match stands) or where the graph's guards rule
    out the sizes the probes take."""
    roles = _roles(m)
    if len(set(roles.values())) != len(roles):
        return Verdict(False, "two roles of the op are bound to one tensor")
    positions = _position_sources(m)
    outputs = [m["epilogue"]["cat"] if m["epilogue"] is not None else m["out"], *positions.values()]
    count = shape(m["indices"])[-1] if m["indices"] is not None else 0
    above = count if isinstance(count, int) else 0
    family = Family(probes=lambda shapes, dtypes: _probes(shapes, dtypes, m), reference=lambda probe: None,
                    compare=lambda got, _, probe: _within_budget(got[0], _reference(m, dict(zip(positions, got[1:])),
                                                                                    probe), probe))
    win = m["win"]
    extra = ("compressed_attention", m["kind"], m["scale"], m["compress_rate"], win["window"], sorted(win),
             sorted(positions), m["out_is_bhsd"], m["epilogue"] is not None)
    return verify(outputs, roles, family, extra, above=above, takes=lambda probe: _takes(m, probe))


def _roles(m: dict) -> dict[str, torch.fx.Node]:
    """The frontier the probes set: q, the window rows, the sinks, and where present the compressed entries, the
    picks, the RoPE tables, the padding table, an input mask and, beside one, HCA's position table (any values: the op
    reads them as the slice does)."""
    win, epilogue = m["win"], m["epilogue"]
    roles = {"q": m["q"], "kv": m["kv_rows"], "sinks": m["sinks"]}
    for role in ("compressed", "indices"):
        if m[role] is not None:
            roles[role] = m[role]
    if epilogue is not None:
        roles.update(cos=epilogue["cos"], sin=epilogue["sin"])
    if win["padding"] is not None:
        roles["padding"] = _table_read(win["padding"], 3)[0]
    if "input" in win or "rows" in win:
        roles["mask"] = win.get("input", win.get("rows"))
    if "rows" in win and win["q"] is not None:
        roles["positions"] = win["q"]["table"]
    return roles


def _position_sources(m: dict) -> dict[str, torch.fx.Node]:
    """The nodes the rewrite reads positions and padding from: query / key positions, the padding read."""
    win, sources = m["win"], {}
    if "rows" in win and win["q"] is not None:
        sources["q"] = _position_rows(win["q"])
    elif "input" not in win and "rows" not in win:
        sources.update(q=_position_rows(win["q"]), kv=_position_rows(win["kv"]))
    if win["padding"] is not None:
        sources["padding"] = win["padding"]
    return sources


def _op_arguments(m: dict, sources: dict, probe: dict) -> tuple:
    """The op's arguments on a probe, built as `_rewrite` builds them in the graph."""
    win = m["win"]
    q = probe["q"].permute(0, 2, 1, 3)
    kv = probe["kv"].squeeze(1)
    compressed = probe["compressed"].squeeze(1) if "compressed" in probe else None
    (B, S), N, T = q.shape[:2], kv.shape[1], compressed.shape[1] if compressed is not None else 0
    window, window_mask = win["window"], None
    if "input" in win:
        seen = probe["mask"].reshape(B, N) == 0
        q_positions = torch.full((B, 1), N - 1 + T, dtype=torch.int64, device=q.device)
        kv_positions = torch.where(seen, torch.arange(N, device=q.device) + T, -1)
        window = N
    elif "rows" in win:
        q_positions = _expanded(sources["q"], B) if "q" in sources else \
            torch.zeros(B, S, dtype=torch.int64, device=q.device)
        kv_positions = torch.zeros(B, N, dtype=torch.int64, device=q.device)
        window_mask = probe["mask"].squeeze(1) == 0
    else:
        q_positions, kv_positions = _expanded(sources["q"], B), _expanded(sources["kv"], B)
    if "padding" in sources:
        kv_positions = torch.where(sources["padding"].squeeze(2).squeeze(1), kv_positions, -1)
    cos = sin = None
    if "cos" in probe:
        cos, sin = (probe[name].float().expand(B, -1, -1) for name in ("cos", "sin"))
    return (q, kv, q_positions, kv_positions, compressed, probe.get("indices"), probe["sinks"].float(), m["scale"],
            window, m["compress_rate"], cos, sin, window_mask)


def _expanded(rows: torch.Tensor, B) -> torch.Tensor:
    """[L] or [B', L] positions as [B, L], as `_positions_node` reads them."""
    return (rows.unsqueeze(0) if rows.dim() == 1 else rows).expand(B, -1)


def _reference(m: dict, sources: dict, probe: dict) -> torch.Tensor:
    """The op's output on a probe, laid out as the slice's output ([B, H, S, D] where the rewrite permutes it)."""
    with unset_fake_temporarily():
        want = compressed_attention_reference(*_op_arguments(m, sources, probe))
    return want.permute(0, 2, 1, 3) if m["epilogue"] is not None or m["out_is_bhsd"] else want


def _takes(m: dict, probe: dict) -> None:
    """The op's fake implementation on meta `probe` roles, fed as the rewrite feeds it (positions and padding of the
    probe's sizes)."""
    B, S, N = probe["q"].shape[0], probe["q"].shape[2], probe["kv"].shape[2]
    sources = dict(q=torch.zeros(B, S, dtype=torch.int64, device="meta"),
                   kv=torch.zeros(B, N, dtype=torch.int64, device="meta"),
                   padding=torch.ones(B, 1, 1, N, dtype=torch.bool, device="meta"))
    torch.ops.dsfuse.compressed_attention(*_op_arguments(m, sources, probe))


def _grid(dims: tuple, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values on a 1/4 grid, most within +-1: exact in every float dtype, and so are their products and short sums."""
    return (torch.randn(dims, generator=gen) * 2).round().clamp(-15, 15).div(4).to(dtype)


def _probes(shapes: dict, dtypes: dict, m: dict) -> list:
    """Random q / keys / entries on the grid with sinks of both signs; sinks large enough to take most of the mass
    (positive) or none of it (negative); CSA: distinct picks with -1 (no entry; the op's CUDA path asks a row's picks
    to be distinct, as a top-k's are), and a query whose picks are all -1; the first keys of a batch row padded;
    RoPE tables of angles; an input mask of HF's 0 / finfo.min. The mask's positions start at 0, so the first queries
    see fewer window rows than the window and, under HCA, no compressed entry."""
    gen = torch.Generator().manual_seed(0)
    base = {role: _grid(shapes[role], dtypes[role], gen) for role in ("q", "kv", "compressed") if role in shapes}
    signs = torch.ones(shapes["sinks"]).index_fill(0, torch.arange(1, shapes["sinks"][0], 2), -1)
    base["sinks"] = (_grid(shapes["sinks"], torch.float32, gen).abs() * signs).to(dtypes["sinks"])
    if "cos" in shapes:
        angles = torch.rand(shapes["cos"], generator=gen) * 6
        base.update(cos=angles.cos().to(dtypes["cos"]), sin=angles.sin().to(dtypes["sin"]))
    if "padding" in shapes:
        base["padding"] = (torch.rand(shapes["padding"], generator=gen) < 0.9).to(dtypes["padding"])
    if "mask" in shapes:
        keep = torch.rand(shapes["mask"], generator=gen) < 0.7
        keep[..., -1] = True
        fill = torch.finfo(dtypes["mask"]).min
        base["mask"] = torch.zeros(shapes["mask"]).masked_fill(~keep, fill).to(dtypes["mask"])
    if "positions" in shapes:
        B, L = shapes["positions"]
        base["positions"] = torch.arange(L, dtype=dtypes["positions"]).expand(B, L).clone()
    if "indices" in shapes:
        B, S, K = shapes["indices"]
        T = shapes["compressed"][2]
        picks = torch.full((B * S, K), -1)
        for row in picks:
            chosen = torch.randperm(T, generator=gen)[:K]
            row[:len(chosen)] = chosen
        picks = picks.masked_fill(torch.rand(picks.shape, generator=gen) < 0.25, -1).view(B, S, K)
        base["indices"] = picks.to(dtypes["indices"])
    probes = [("random", base), ("large sinks", dict(base, sinks=(signs * 12).to(dtypes["sinks"])))]
    if "padding" in base:
        padded = base["padding"].clone()
        padded[0, :2] = False
        probes.append(("left padding", dict(base, padding=padded)))
    if "positions" in base:
        probes.append(("positions from 5", dict(base, positions=base["positions"] + 5)))
    if "indices" in base:
        empty = base["indices"].clone()
        empty[:, -1] = -1
        probes.append(("a query without entries", dict(base, indices=empty)))
    return probes


def _within_budget(out, want: torch.Tensor, probe: dict) -> str | None:
    """None when the slice's output is the reference's within `ULPS` of its dtype at the probe's largest key
    magnitude (NaNs and infinities where it has them), else how far off it is."""
    if not isinstance(out, torch.Tensor) or out.dtype != want.dtype or tuple(out.shape) != tuple(want.shape):
        return f"the output is not {want.dtype}{list(want.shape)}"
    keys = max(float(probe[role].float().abs().max()) for role in ("kv", "compressed") if role in probe)
    miss = ulps_beyond(out, want, ULPS[want.dtype], max(keys, TINY))
    if miss is None:
        return None
    if miss.got is not None:
        return f"output {miss.where} {miss}"
    return (f"outputs differ by up to {miss.ulps:.3g} ulps of {want.dtype} at the largest key (budget "
            f"{ULPS[want.dtype]})")


# ---------------------------------------------------------------------------
# Rewrite
# ---------------------------------------------------------------------------


def _position_rows(term: dict) -> torch.fx.Node:
    """Where a mask's positions are read from: its [B', L] table, or the 1-d `arange` under its layout ops."""
    if term["kind"] == "table":
        return term["table"]
    rows = term["base"]
    while len(shape(rows)) > 1:
        rows = rows.args[0]
    return rows


def _positions_node(graph, before, term: dict, B) -> torch.fx.Node:
    """[B, L] int64 positions built from the mask's own position source."""
    rows = _position_rows(term)
    if term["kind"] != "table":
        rows = insert_call(graph, before, aten.unsqueeze.default, (rows, 0))
    return insert_call(graph, before, aten.expand.default, (rows, [B, -1]))


def _rewrite(graph: torch.fx.Graph, cat: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    out, epilogue = m["out"], m["epilogue"]
    before = epilogue["cat"] if epilogue is not None else out
    B = size_arg(graph, before, m["q"], 0)
    q = insert_call(graph, before, aten.permute.default, (m["q"], [0, 2, 1, 3]))
    kv = insert_call(graph, before, aten.squeeze.dim, (m["kv_rows"], 1))
    compressed = m["compressed"]
    if compressed is not None:
        compressed = insert_call(graph, before, aten.squeeze.dim, (compressed, 1))
    win = m["win"]
    window, window_mask = win["window"], None
    if "input" in win:
        q_positions, kv_positions, window = _input_mask_positions(graph, before, win, m, B)
    elif "rows" in win:
        q_positions, kv_positions, window_mask = _input_mask_rows(graph, before, win, m, B)
    else:
        q_positions = _positions_node(graph, before, win["q"], B)
        kv_positions = _positions_node(graph, before, win["kv"], B)
    if win["padding"] is not None:
        padding = insert_call(graph, before, aten.squeeze.dims, (win["padding"], [1, 2]))
        kv_positions = insert_call(graph, before, aten.where.ScalarOther, (padding, kv_positions, -1))
    cos = sin = None
    if epilogue is not None:
        cos, sin = (_fp32_rows(graph, before, t, B) for t in (epilogue["cos"], epilogue["sin"]))
    sinks = m["sinks"]
    if dtype(sinks) != torch.float32:  # a model cast as a whole (`.to(torch.bfloat16)`): the widening is exact
        sinks = insert_call(graph, before, CONVERT, (sinks, torch.float32))
    fused = insert_call(graph, before, torch.ops.dsfuse.compressed_attention.default,
                        (q, kv, q_positions, kv_positions, compressed, m["indices"], sinks, m["scale"],
                         window, m["compress_rate"], cos, sin, window_mask))
    if epilogue is not None:
        epilogue["cat"].replace_all_uses_with(insert_call(graph, before, aten.permute.default, (fused, [0, 2, 1, 3])))
    else:
        out.replace_all_uses_with(insert_call(graph, before, aten.permute.default, (fused, [0, 2, 1, 3]))
                                  if m["out_is_bhsd"] else fused)
    N = shape(m["kv_rows"])[2]
    window_rows = "the input mask's window rows" if "rows" in win else f"window {win['window']}"
    if m["kind"] == "CSA":
        what = f"{window_rows} + top-{shape(m['indices'])[2]} compressed entries"
    elif m["kind"] == "HCA" and "input" in win:
        what = f"{window_rows} + every compressed entry (one query)"
    elif m["kind"] == "HCA":
        what = f"{window_rows} + causal compressed entries (m={m['compress_rate']})"
    else:
        what = window_rows
    detail = (f"V4 {m['kind']} attention: {what}, sinks, "
              f"{'inverse RoPE epilogue' if epilogue is not None else 'no inverse RoPE epilogue'}"
              f"{', padding' if win['padding'] is not None else ''}"
              f"{', additive input mask (0 = seen)' if 'input' in win or 'rows' in win else ''}, {N} window rows, "
              f"scale={m['scale']:.6g}")
    ctx.site(cat, "dsfuse.compressed_attention",
             [m["q"], m["kv_rows"], m["compressed"], m["indices"], m["sinks"]], detail=detail, call=fused)


def _input_mask_positions(graph, before, win: dict, m: dict, B) -> tuple:
    """[B, 1] query and [B, N] window-row positions for an input mask (see `_match`), and the window N."""
    N = size_arg(graph, before, m["kv_rows"], 2)  # a node when the window rows have a symbolic length
    T = size_arg(graph, before, m["compressed"], 2) if m["compressed"] is not None else 0
    device = m["q"].meta["val"].device
    rows = insert_call(graph, before, IOTA, (N,), dict(start=0, step=1, dtype=torch.int64, device=device,
                                                     requires_grad=False))
    rows = insert_call(graph, before, aten.add.Tensor, (rows, T))
    mask = insert_call(graph, before, aten.view.default, (win["input"], [B, N]))
    seen = insert_call(graph, before, aten.eq.Scalar, (mask, 0))
    kv_positions = insert_call(graph, before, aten.where.ScalarOther, (seen, rows, -1))
    last = insert_call(graph, before, aten.full.default, ([B, 1], -1), dict(dtype=torch.int64, device=device))
    last = insert_call(graph, before, aten.add.Tensor, (insert_call(graph, before, aten.add.Tensor, (last, N)), T))
    return last, kv_positions, N


def _input_mask_rows(graph, before, win: dict, m: dict, B) -> tuple:
    """For an input mask over several queries: [B, S] query positions (HCA's threshold positions; zeros where the
    op reads none), [B, N] zero window-row positions (unread beside a window mask) and the [B, S, N] bool rows each
    query sees (the mask's 0 entries)."""
    S = size_arg(graph, before, m["q"], 2)
    N = size_arg(graph, before, m["kv_rows"], 2)
    device = m["q"].meta["val"].device
    if win["q"] is not None:
        q_positions = _positions_node(graph, before, win["q"], B)
    else:
        q_positions = insert_call(graph, before, aten.full.default, ([B, S], 0),
                                  dict(dtype=torch.int64, device=device))
    kv_positions = insert_call(graph, before, aten.full.default, ([B, N], 0), dict(dtype=torch.int64, device=device))
    rows = insert_call(graph, before, aten.squeeze.dim, (win["rows"], 1))
    return q_positions, kv_positions, insert_call(graph, before, aten.eq.Scalar, (rows, 0))


def _fp32_rows(graph, before, table: torch.fx.Node, B) -> torch.fx.Node:
    """A [B', S, R] cos / sin table as fp32 [B, S, R] (bf16 tables widen exactly, as HF's fp32 RoPE math does)."""
    if dtype(table) != torch.float32:
        table = insert_call(graph, before, CONVERT, (table, torch.float32))
    return insert_call(graph, before, aten.expand.default, (table, [B, -1, -1]))
