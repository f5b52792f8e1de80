"""`compressors`: DeepSeek V4's KV compressors (HF `DeepseekV4CSACompressor`, `DeepseekV4HCACompressor` and the
compressor inside `DeepseekV4Indexer`) rewritten into one `dsfuse::kv_compress` call each.

The anchor is the softmax over the window slots, `amax(G, [2], keepdim)` (on CUDA Inductor's
`prepare_softmax_online(G, 2)`) of a 4-D gate G [B, W, slots, D]; the
match proves, from there, the whole compressor (the projections stay where they are, GEMMs for Inductor):

    P      = exp(G - amax(G)) / sum(exp(G - amax(G)), 2)  [.to(kv dtype)]
             or exp((G - amax(G)) - log(sum(exp(G - amax(G)), 2)))  (exp(log_softmax): the op's `exp_log_softmax`)
    pooled = sum(KVs * P, 2)                                                        [B, W, D]
    normed = (w * (p * rsqrt(mean(p^2, -1) + eps))).to(dtype),  p = pooled.float()   (HF RMSNorm, 1-D weight)
             or p / sqrt(mean(p^2, -1) + eps)                                        (the op's `div_sqrt`)
    out    = cat([n[..., :-R], rope(r)], -1),  n = normed [unsqueezed], r = n[..., -R:],
    rope   = (r.float() * c2 + rotate_half(r).float() * s2).to(dtype),  rotate_half the interleaved
             (-r[1::2], r[0::2]) pairs, c2 / s2 = cos / sin [B, W, R/2] repeated twice along the last dim
             (`repeat_interleave(2, -1)`)

The RoPE in HF's spelling is proven by its structure; any other part cat'ed back after n[..., :-R] (the even / odd
halves written out, the official complex product, tables negated or widened otherwise) by what it computes: the two
latest [B, W, R/2] nodes not derived from r are taken as cos and sin, and the slice from r and them to the part
must equal `interleaved_rope` on probes (`verify.py`: free tables and tables of angles, two ulps of the dtype; a
complex product may fuse a multiply-add that the op rounds twice).

and the slot layout of (G, KVs), each from the 4-D windows X = view(chunk, [B, W, m, C]) of a projection (the
gate's with `+ position_bias [m, C]`):

    HCA (no overlap): G, KVs are the windows themselves (C = D).
    CSA (overlap, C = 2D): full([B, W, 2m, D], -inf / 0) with slots [m, 2m) <- X[..., D:] and, when W > 1, slots
        [0, m) of windows [1, W) <- X[:, :-1, :, :D], as `slice_scatter`s of `copy`s (HF's slice assignments), or
        the same values by `cat`: cat([cat([full([B, 1, m, D], -inf / 0), X[:, :-1, :, :D]], 1), X[..., D:]], 2).

The weighted sum may be any contraction over the slots (`einsum('bwld,bwld->bwd')`: a bmm, or Inductor's mul + sum
of it), proven with `dims.py` labels; the bias may be broadcast from [m, C] explicitly; the norm's mean may be
`sum / D`. A softmax over slots whose weights pool values but whose surroundings differ is reported with the
reason; other softmaxes over dim 2 are skipped silently. Not fused (reported): window 0's first half taken from
the cache's overlap state (a step that continues from a cache: a later prefill chunk, the decode step that closes a
window), a gate without a [m, C] bias, a biased gate rounded to bf16 other than by the sum itself, a part cat'ed
back that is not the op's RoPE at two tables the graph holds.

Each match is then run on probes against the op's reference before it is rewritten (`verify.py`,
`kv_compress_reference` with the walk's eps and flags): the slice from the two projections' windows X (the gate's
before its bias), the [m, C] position bias, the norm weight and the two tables to the roped entries, so the pooling,
the bias, the slot layout and its fills, the norm and the RoPE are proven by what they compute, not by their shape
alone (the walk reads neither an add's `alpha` nor a reduction's `dtype=`: a bias added twice, a softmax's sum or a
mean square rounded to bf16 passed it). Three probes of values, biases and norm weights of every sign at tables of
angles: unit logits; large logits (a peaked softmax) with a -inf slot in every other channel and a negative bias;
logits near -100 (a fill slot not -inf would take every weight) with an entry that pools only zeros (eps alone under
the root) and one a thousandth of the others (eps of the order of the mean square). Symbolic lengths are probed at
verify's two assignments, over 2m tokens so that every window after the first reads its predecessor's. An entry may
differ from the reference by `ULPS` of its dtype (32 fp32, 4 bf16 / fp16 ulps) at its largest magnitude; more is a
near-miss naming the probe and the entry. As in the other families, the structural match stands unprobed where the
slice holds more than `verify.MAX_ELEMENTS` values at a static graph's sizes (a real V4-Flash prefill: the CSA kv
windows alone are [1, 2048, 4, 1024] at S = 8192) or where the graph's guards rule out the probes' sizes (the op's
arguments disagree in shape there: a prefill tail whose window count is guarded to be 1).

A model cast as a whole (`.to(torch.bfloat16)`, `.half()`) has a bias in the model dtype, so `gate + bias` is rounded
to that dtype before the fp32 softmax; the op, given that bias, rounds at the same point. Summing in fp32 instead (the
bias widened) was measured no closer to the fp32 model (`v4-tiny` cast to bf16, S=64: 0.02878 relative distance of
the logits either way, Inductor 0.02550 there: its gap is the products rounded to the model dtype, as in
transformers' dtypes).

Stages: anchors `ANCHORS`; binder `_match` (the pooling, the norm, the RoPE, the slot layout; a RoPE in another
spelling proven on probes by `_rotation_by_probes`); verifier `_verify_compressor`, against `kv_compress_reference`
(kernels/compressor.py); rewrite `_rewrite` into `dsfuse::kv_compress`.
"""

from __future__ import annotations

import operator

import torch

from dsfuse.kernels.compressor import interleaved_rope, kv_compress_reference  # (registers dsfuse::kv_compress)

from .canonicalize import row_mean
from .context import NoMatch, PassContext, rewrite_anchored
from .dims import apply_op, bmm_labels, broadcast, contracted, follow, leaf_labels, names
from .graph_utils import (CONVERT, FLOAT_DTYPES, LAYOUT_OPS, PREPARE_SOFTMAX_ONLINE, VIEW_OPS, aten, describe, dtype,
                          insert_call, is_op, is_upcast, normalised_by, only_user, same_shape, same_size, scalar_arg,
                          scalar_constant, shape, softmax_parts, users_of, walk_back)
from .verify import TINY, Family, Verdict, latest_independent, rope_table_probes, ulps_beyond, verify

NAME = "compressors"
IMPLEMENTED = True
END = 9223372036854775807  # how a slice to the end appears in the graph


# --------------------------------------------------------------------------------------------
# Anchors
# --------------------------------------------------------------------------------------------
# The row max of the softmax over a window's slots, as written (`amax`) or as Inductor's online softmax computes it.
ANCHORS = (aten.amax.default, PREPARE_SOFTMAX_ONLINE)


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, ANCHORS, _match, _rewrite)


# --------------------------------------------------------------------------------------------
# Binding: small structural predicates
# --------------------------------------------------------------------------------------------
def _dim(node, dim) -> int:
    return dim % len(shape(node))


def _other(node: torch.fx.Node, known) -> object:
    a, b = node.args[:2]
    return b if a is known else a if b is known else None


def _dims_are(arg, node, dims: tuple[int, ...]) -> bool:
    return isinstance(arg, (list, tuple)) and tuple(sorted(_dim(node, d) for d in arg)) == dims


def _bound(value, size, default):
    """A slice bound as a size: None -> default, END -> size, negative -> size + value."""
    if value is None:
        return default
    if isinstance(value, int) and value >= END:
        return size
    if isinstance(value, int) and value < 0:
        return size + value
    return value


def _is_slice(node, src, dim: int, start, end) -> bool:
    """node = src[dim: start:end] (step 1), bounds compared symbolically."""
    if not is_op(node, aten.slice.Tensor) or node.args[0] is not src:
        return False
    args = list(node.args[1:]) + [None] * (4 - len(node.args[1:]))
    node_dim, node_start, node_end, step = args[:4]
    size = shape(src)[_dim(src, node_dim if node_dim is not None else 0)]
    return (_dim(src, node_dim if node_dim is not None else 0) == dim and step in (None, 1)
            and same_size(_bound(node_start, size, 0), start) and same_size(_bound(node_end, size, size), end))


def _is_strided_slice(node, src, start: int) -> bool:
    """node = src[..., start::2]."""
    if not is_op(node, aten.slice.Tensor) or node.args[0] is not src or len(node.args) < 5:
        return False
    size = shape(src)[-1]
    return (_dim(src, node.args[1]) == len(shape(src)) - 1 and node.args[2] == start and node.args[4] == 2
            and same_size(_bound(node.args[3], size, size), size))


def _cast_from(node, to: torch.dtype):
    """The input of `node` when it is a cast to `to`; `node` itself when no cast is needed (already `to`)."""
    if is_op(node, CONVERT) and node.args[1] == to:
        return node.args[0]
    return node if dtype(node) == to else None


def _cast_user(node, to: torch.dtype):
    """`node` cast to `to` by one of its users (the only such cast), or `node` when it already has that dtype (the
    canonicaliser drops casts to a tensor's own dtype)."""
    if dtype(node) == to:
        return node
    casts = [u for u in users_of(node, CONVERT) if u.args[1] == to]
    return casts[0] if len(casts) == 1 else None


# --------------------------------------------------------------------------------------------
# Binding: the walk from the softmax over the slots to the windows, the norm and the RoPE
# --------------------------------------------------------------------------------------------
def _match(stats: torch.fx.Node) -> dict:
    G = stats.args[0]
    keepdim = stats.target is PREPARE_SOFTMAX_ONLINE or (len(stats.args) > 2 and stats.args[2])
    dims = stats.args[1] if isinstance(stats.args[1], (list, tuple)) else [stats.args[1]]
    if len(shape(G)) != 4 or not _dims_are(dims, G, (2,)) or not keepdim:
        raise NoMatch("not a softmax over the slots of 4-D windows", reported=False)
    parts = softmax_parts(G, dim=2)
    exp_log_softmax = parts is None or parts["stats"] is not stats
    weights = _exp_of_log_softmax(stats, G) if exp_log_softmax else parts["probs"]
    if weights is None:
        raise NoMatch("amax over dim 2 that is not a softmax", reported=False)
    pooled, kv_slots = _pooling(weights)
    kv_dtype = dtype(pooled)
    if dtype(G) != torch.float32:
        raise NoMatch(f"compressor softmax over a {dtype(G)} gate, not fp32 (HF: softmax(dtype=float32))")
    norm = _rmsnorm(pooled, kv_dtype)
    rope = _rope(norm["out"], kv_dtype)
    layout = _slots(G, kv_slots)
    m = dict(pooled=pooled, exp_log_softmax=exp_log_softmax, **norm, **rope, **layout)
    verdict = _verify_compressor(m)
    if verdict.ok is False:
        raise NoMatch(f"compressor: numeric check against the reference failed: {verdict.reason}")
    return m


def _exp_of_log_softmax(stats, G):
    """The weights exp(log_softmax(G, 2)) as decomposed, exp((G - max) - log(sum(exp(G - max), 2, keepdim))), from
    their max (an amax, or Inductor's online softmax giving the max and the sum); else None. They round otherwise
    than exp(G - max) / sum: the op's `exp_log_softmax`."""
    row_max, row_sum = stats, None
    if stats.target is PREPARE_SOFTMAX_ONLINE:
        getters = {u.args[1]: u for u in stats.users if u.target is operator.getitem}
        row_max, row_sum = getters.get(0), getters.get(1)
    shifted = next((u for u in users_of(row_max, aten.sub.Tensor) if u.args == (G, row_max)), None) \
        if row_max is not None else None
    for log_sum in users_of(shifted, aten.sub.Tensor) if shifted is not None else ():
        log = log_sum.args[1]
        total = log.args[0] if is_op(log, aten.log.default) else None
        if row_sum is None and is_op(total, aten.sum.dim_IntList) and _dims_are(total.args[1], shifted, (2,)) \
                and len(total.args) > 2 and total.args[2]:
            exps = total.args[0]
            summed = is_op(exps, aten.exp.default) and exps.args[0] is shifted
        else:
            summed = row_sum is not None and total is row_sum
        if log_sum.args[0] is shifted and summed:
            return only_user(log_sum, aten.exp.default)
    return None


def _pooling(probs):
    """(pooled, KVs) of sum(KVs * P.to(KVs.dtype), 2): the softmax weights pooling values over the slots."""
    weights = [probs] + [c for c in users_of(probs, CONVERT)]
    for w in weights:
        for mul in users_of(w, aten.mul.Tensor):
            total = only_user(mul, aten.sum.dim_IntList)
            if total is None or not _dims_are(total.args[1], mul, (2,)) or (len(total.args) > 2 and total.args[2]):
                continue
            values = _other(mul, w)
            if not isinstance(values, torch.fx.Node) or dtype(w) != dtype(values) or dtype(total) != dtype(values):
                raise NoMatch(f"softmax-pooled values {describe(values)} are not multiplied by the weights cast to "
                              "their dtype (HF: softmax(...).to(kv.dtype))")
            if not same_shape(shape(values), shape(mul)):
                raise NoMatch(f"softmax-pooled values {describe(values)} are broadcast over the windows")
            return total, values
        found = _contracted_pooling(w)
        if found is not None:
            return found
    raise NoMatch("softmax over dim 2 that pools no values", reported=False)


def _forward_layout(node, labels):
    """Follow `node`'s single-reader chain of layout ops and fp32 upcasts forward: (the first reader that is
    neither, its input, the input's labels)."""
    while True:
        reader = only_user(node)
        if not (is_op(reader, *LAYOUT_OPS) or is_upcast(reader)):
            return reader, node, labels
        labels = apply_op(labels, reader) if labels is not None else None
        node = reader


def _contracted_pooling(w):
    """(pooled [B, W, D], KVs) of the weighted sum spelled as a contraction over the slots (`einsum('bwld,bwld->
    bwd')`: a bmm, or Inductor's mul + sum of its operands laid out [B*W*D, l], which for 16-bit operands widens
    them to fp32 and rounds the sum back once, as the bmm does), dims followed through layout ops; None otherwise."""
    core, w_end, w_labels = _forward_layout(w, leaf_labels(w, "bwld"))
    if w_labels is None or not is_op(core, aten.mul.Tensor, aten.bmm.default) or len(core.args) != 2:
        return None
    other = _other(core, w_end)
    if not isinstance(other, torch.fx.Node):
        return None
    chain = walk_back(other, lambda n: is_op(n, *LAYOUT_OPS) or is_upcast(n))
    # the earliest node of the weights' shape: a later one may be a transpose that only looks alike (2m == D)
    at = next((i for i in range(len(chain)) if same_shape(shape(chain[i]), shape(w))), None)
    if at is None:
        return None
    values, ops = chain[at], chain[at + 1:]
    # a partner of the weights' own shape: a pooling, reported from here on when it cannot be followed
    unfollowed = NoMatch(f"softmax-pooled values {describe(values)}: the weighted sum over the slots is a "
                         "contraction whose layout ops could not be followed to [B, W, D] (size-1 dims?)")
    v_labels = follow(leaf_labels(values, "bwld"), ops)
    if v_labels is None:
        raise unfollowed
    if is_op(core, aten.bmm.default):
        pair = (w_labels, v_labels) if core.args[0] is w_end else (v_labels, w_labels)
        labels = bmm_labels(*pair)
        if labels is None or names([contracted(*pair)]) != [("l",)]:
            raise unfollowed
        node = core
    else:
        product = broadcast(w_labels, v_labels)
        total = only_user(core, aten.sum.dim_IntList)
        if product is None or total is None or len(total.args[1]) != 1:
            raise unfollowed
        dim = total.args[1][0] % len(product)
        keepdim = len(total.args) > 2 and total.args[2]
        if names([product[dim]]) != [("l",)]:
            raise unfollowed
        labels = product[:dim] + ([()] if keepdim else []) + product[dim + 1:]
        node = total
    while not (names(labels) == names(leaf_labels(values, "bwld"))[:2] + [("d",)] and len(shape(node)) == 3
               and dtype(node) == dtype(values)):
        reader = only_user(node, *LAYOUT_OPS, CONVERT)
        if is_op(reader, CONVERT):  # the widened sum rounded back to the values' dtype
            labels = labels if dtype(node) == torch.float32 and reader.args[1] == dtype(values) else None
        else:
            labels = apply_op(labels, reader) if reader is not None else None
        if labels is None:
            raise unfollowed
        node = reader
    if dtype(w) != dtype(values) or dtype(node) != dtype(values):
        raise NoMatch(f"softmax-pooled values {describe(values)} are not multiplied by the weights cast to their "
                      "dtype (HF: softmax(...).to(kv.dtype))")
    return node, values


def _rmsnorm(pooled, kv_dtype) -> dict:
    """HF `DeepseekV4RMSNorm` of the pooled entries: (weight * (x * rsqrt(mean(x^2) + eps))).to(dtype), or with
    `x / sqrt(mean(x^2) + eps)` (`div_sqrt`: the quotient rounds otherwise than the product)."""
    miss = "compressor: the pooled entries are not RMS-normalised as HF's DeepseekV4RMSNorm"
    xf = _cast_user(pooled, torch.float32)
    if xf is None:
        raise NoMatch(f"{miss} (no single fp32 upcast)")
    squares = [u for u in users_of(xf, aten.pow.Tensor_Scalar) if u.args[1] == 2]
    if len(squares) != 1:
        raise NoMatch(f"{miss} (no square)")
    mean = row_mean(squares[0])
    if mean is None:
        raise NoMatch(f"{miss} (no mean over the last dim)")
    add = only_user(mean, aten.add.Tensor)
    root = only_user(add, aten.rsqrt.default, aten.sqrt.default) if add is not None else None
    eps = scalar_arg(add.args[1]) if add is not None else None
    if root is None or eps is None:
        raise NoMatch(f"{miss} (no rsqrt(mean + eps) or sqrt(mean + eps) with a constant eps)")
    div_sqrt = is_op(root, aten.sqrt.default)
    scaled = normalised_by(root, xf, div_sqrt)
    if scaled is None or len(xf.users) != 2:
        raise NoMatch(f"{miss} ({'x / sqrt(...)' if div_sqrt else 'x * rsqrt(...)'} not found, or x has other "
                      "readers)")
    weighted = only_user(scaled, aten.mul.Tensor)
    weight = _other(weighted, scaled) if weighted is not None else None
    if not isinstance(weight, torch.fx.Node) or len(shape(weight)) != 1 \
            or not same_size(shape(weight)[0], shape(pooled)[-1]) or dtype(weighted) != torch.float32:
        raise NoMatch(f"{miss} (no fp32 product with a 1-D [D] weight)")
    out = _cast_user(weighted, kv_dtype)
    if out is None:
        raise NoMatch(f"{miss} (the weighted value is not cast back to {kv_dtype})")
    return dict(norm_weight=weight, eps=eps, div_sqrt=div_sqrt, out=out)


def _repeated_table(node, rows):
    """cos / sin [B, W, R/2] when node is `table.repeat_interleave(2, -1)` (unsqueezed to `rows`' rank):
    unsqueeze(table, -1) -> expand [..., R/2, 2] -> clone -> reshape [..., R] [-> unsqueeze]."""
    while is_op(node, aten.unsqueeze.default) and len(shape(node)) > 3:
        node = node.args[0]
    if not is_op(node, *VIEW_OPS):
        return None
    clone = node.args[0]
    expand = clone.args[0] if is_op(clone, aten.clone.default) else clone
    if not is_op(expand, aten.expand.default):
        return None
    pair = expand.args[0]
    if not is_op(pair, aten.unsqueeze.default) or _dim(expand, pair.args[1]) != len(shape(expand)) - 1:
        return None
    table = pair.args[0]
    if len(shape(table)) != 3 or not same_size(shape(expand)[-1], 2) \
            or not same_shape(shape(expand)[:-1], shape(table)) \
            or not same_size(shape(node)[-1], 2 * shape(table)[-1]) or not same_shape(shape(table)[:2], rows):
        return None
    return table


def _rope(normed, kv_dtype) -> dict:
    """The RoPE of the normed entries' trailing R channels at the windows' tables, cat'ed back after the rest: HF's
    `apply_rotary_pos_emb` by its structure, any other spelling (even / odd halves written out, the official
    complex product) by what it computes on probes (`_rotation_by_probes`)."""
    miss = "compressor: the normed entries are not roped as HF's apply_rotary_pos_emb computes"
    base = normed
    lifted = [u for u in normed.users if is_op(u, aten.unsqueeze.default) and _dim(u, u.args[1]) == 1]
    if len(lifted) == 1 and len(normed.users) == 1:
        base = lifted[0]
    D = shape(normed)[-1]
    last = len(shape(base)) - 1
    slices = users_of(base, aten.slice.Tensor)
    for rope_part in [s for s in slices if _dim(base, s.args[1]) == last]:
        R = shape(rope_part)[-1]
        if not _is_slice(rope_part, base, last, D - R, D):
            continue
        nope = [s for s in slices if s is not rope_part and _is_slice(s, base, last, 0, D - R)]
        if len(nope) != 1:
            raise NoMatch(f"{miss} (no leading [..., :-{R}] part)")
        cat = [c for c in users_of(nope[0], aten.cat.default) if len(c.args[0]) == 2 and c.args[0][0] is nope[0]
               and _dim(c, c.args[1] if len(c.args) > 1 else 0) == last]
        if len(cat) != 1:
            raise NoMatch(f"{miss} (the roped part is not cat'ed back after the rest)")
        rotated = cat[0].args[0][1]
        found = _rotation(rope_part, kv_dtype, shape(normed)[:2])
        if found is None or found[0] is not rotated:
            found = _rotation_by_probes(rope_part, rotated, kv_dtype, shape(normed)[:2])
        if found is None:
            raise NoMatch(f"{miss} (the part cat'ed back is not its RoPE over interleaved pairs at two [B, W, R/2] "
                          "tables: not x*cos + rotate_half(x)*sin on probes)")
        _, cos, sin = found
        return dict(cos=cos, sin=sin, final=cat[0], lifted=base is not normed)
    raise NoMatch(f"{miss} (no trailing RoPE slice)")


def _rotation(r, kv_dtype, rows):
    """(rotated, cos, sin) of ((r.float() * c2) + (rotate_half(r).float() * s2)).to(dtype)."""
    rf = _cast_user(r, torch.float32) if kv_dtype != torch.float32 else r
    odd = [s for s in users_of(r, aten.slice.Tensor) if _is_strided_slice(s, r, 1)]
    even = [s for s in users_of(r, aten.slice.Tensor) if _is_strided_slice(s, r, 0)]
    if rf is None or len(odd) != 1 or len(even) != 1:
        return None
    neg = only_user(odd[0], aten.neg.default)
    lift_odd = only_user(neg, aten.unsqueeze.default) if neg is not None else None
    lift_even = only_user(even[0], aten.unsqueeze.default)
    if lift_odd is None or lift_even is None:
        return None
    stack = only_user(lift_odd, aten.cat.default)
    if stack is None or list(stack.args[0]) != [lift_odd, lift_even] \
            or _dim(stack, stack.args[1]) != len(shape(stack)) - 1 or not same_size(shape(stack)[-1], 2):
        return None
    flat = only_user(stack, *VIEW_OPS)
    if flat is None or not same_shape(shape(flat), shape(r)):
        return None
    turned = _cast_user(flat, torch.float32)
    for cos_mul in users_of(rf, aten.mul.Tensor):
        for add in users_of(cos_mul, aten.add.Tensor):
            sin_mul = _other(add, cos_mul)
            if not is_op(sin_mul, aten.mul.Tensor) or turned is None or turned not in sin_mul.args:
                continue
            cos = _repeated_table(_other(cos_mul, rf), rows)
            sin = _repeated_table(_other(sin_mul, turned), rows)
            rotated = _cast_user(add, kv_dtype)
            if cos is not None and sin is not None and rotated is not None and add.args[0] is cos_mul:
                return rotated, cos, sin
    return None


def _rotation_by_probes(r, rotated, kv_dtype, rows):
    """(rotated, cos, sin) when `rotated`, computed from `r` and two tables [B, W, R/2] (the latest such nodes not
    derived from r), equals the op's RoPE of r at those tables on probes (`verify.py`), in one of the two
    orders; None otherwise."""
    if dtype(rotated) != kv_dtype or not same_shape(shape(rotated), shape(r)) or not same_size(shape(r)[-1] % 2, 0):
        return None
    table_shape = (*rows, shape(r)[-1] // 2)
    tables = latest_independent(rotated, r, lambda n: dtype(n) in FLOAT_DTYPES and same_shape(shape(n), table_shape))
    if tables is None or len(tables) != 2:
        return None
    family = Family(probes=lambda shapes, dtypes: rope_table_probes(shapes, dtypes, "rope"),
                    reference=lambda probe: interleaved_rope(*_lifted_tables(probe)), compare=_same_rope)
    for cos, sin in (tables, tables[::-1]):
        if verify([rotated], {"rope": r, "cos": cos, "sin": sin}, family).ok:
            return rotated, cos, sin
    return None


def _lifted_tables(probe: dict) -> tuple:
    """(rope, cos, sin) with the tables unsqueezed at dim 1 where the rope part is lifted to [B, 1, W, R]."""
    rope, cos, sin = probe["rope"], probe["cos"], probe["sin"]
    if rope.dim() == 4:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return rope, cos, sin


def _same_rope(got: list, want: torch.Tensor, probe: dict) -> str | None:
    """None when the slice's RoPE is the reference's up to two ulps of its dtype at the largest magnitude (a complex
    product may fuse a multiply-add where the op rounds both products)."""
    out = got[0]
    if not isinstance(out, torch.Tensor) or out.dtype != want.dtype or out.shape != want.shape:
        return f"the RoPE is not a {want.dtype} tensor of shape {list(want.shape)}"
    error = (out.float() - want.float()).abs().max().item()
    budget = 2 * torch.finfo(want.dtype).eps * want.float().abs().max().item()
    return None if error <= budget else f"differs from x*cos + rotate_half(x)*sin by {error:.3g} (> {budget:.3g})"


def _broadcast_source(bias):
    """The [m, C] tensor that `bias` broadcasts over leading dims: through unsqueezes, expands and views that keep
    the trailing [m, C] (`bias[None, None]`, `bias.expand(B, W, m, C)`)."""
    while is_op(bias, aten.unsqueeze.default, aten.expand.default, *VIEW_OPS) and len(shape(bias)) > 2:
        source = bias.args[0]
        if not isinstance(source, torch.fx.Node) or len(shape(source)) < 2 \
                or not same_shape(shape(source)[-2:], shape(bias)[-2:]) \
                or not all(same_size(s, 1) for s in shape(source)[:-2]):
            break
        bias = source
    return bias


def _windows(X):
    """(kv or gate windows [B, W, m, C], position bias [m, C] or None) of X = windows [+ bias broadcast from
    [m, C]]."""
    if is_op(X, aten.add.Tensor):
        for added in X.args[:2]:
            windows = _other(X, added)
            bias = _broadcast_source(added)
            if isinstance(bias, torch.fx.Node) and len(shape(bias)) == 2 and len(shape(windows)) == 4 \
                    and same_shape(shape(bias), shape(windows)[2:]):
                return windows, bias
    return X, None


def _slots(G, kv_slots) -> dict:
    """The two inputs' windows and the layout (overlap or not) of the slots they fill.

    A model cast as a whole (`.to(torch.bfloat16)`) has a bf16 / fp16 position bias: the gate slots are then
    `gate + bias` rounded to that dtype and upcast for the fp32 softmax. The op rounds the biased gate to
    `result_type(gate, bias)`, the same point, so the upcast is looked through when that rounding is the sum's own.
    """
    narrow = None
    if is_op(G, CONVERT) and dtype(G.args[0]) in (torch.bfloat16, torch.float16):
        G, narrow = G.args[0], dtype(G.args[0])
    if is_op(G, aten.slice_scatter.default, aten.cat.default) or is_op(kv_slots, aten.slice_scatter.default,
                                                                        aten.cat.default):
        gate_x = _overlap_source(G, float("-inf"), "gate")
        kv_x = _overlap_source(kv_slots, 0.0, "kv")
        overlap = True
    else:
        gate_x, kv_x, overlap = G, kv_slots, False
    if is_op(gate_x, aten.select_scatter.default):
        raise NoMatch(f"compressor gate {describe(gate_x)} is a window written into a cache buffer (select_scatter: "
                      "a decode step's pending window), not windows viewed from the projection: not fused")
    if narrow is not None and is_op(gate_x, CONVERT):
        raise NoMatch(f"compressor gate {describe(gate_x)} is the {dtype(gate_x.args[0])} biased gate rounded to "
                      f"{narrow} before the fp32 softmax; the op rounds it only as the sum's own dtype "
                      f"(a {narrow} bias)")
    gate, bias = _windows(gate_x)
    if bias is None:
        raise NoMatch(f"compressor gate {describe(gate_x)} has no [m, C] position bias added to its windows")
    if _windows(kv_x)[1] is not None or not same_shape(shape(kv_x), shape(gate)) or len(shape(gate)) != 4:
        raise NoMatch(f"compressor kv windows {describe(kv_x)} and gate windows {describe(gate)} differ in shape")
    return dict(kv=kv_x, gate=gate, position_bias=bias, overlap=overlap)


def _overlap_source(slots, fill: float, what: str):
    """X of HF's two-series layout `slots` [B, W, 2m, D] (module docstring), proven slice by slice."""
    miss = f"compressor {what} slots are not HF's two overlapping series"
    if is_op(slots, aten.cat.default):
        return _concatenated_source(slots, fill, miss)
    if is_op(slots, aten.select_scatter.default):
        raise NoMatch(f"{miss}: window 0's first half is filled from the cache's overlap state (a step that "
                      "continues from a cache), not fused yet")
    B, W, L, D = shape(slots)
    m = L // 2
    if not same_size(L, 2 * m):
        raise NoMatch(f"{miss} (odd slot count {L})")
    inner = None
    first_windows = slots
    if is_op(slots, aten.slice_scatter.default) and _scatter_at(slots, 1, 1, W):
        first_windows, inner = slots.args[0], slots.args[1]
    if not is_op(first_windows, aten.slice_scatter.default) or not _scatter_at(first_windows, 2, m, L):
        raise NoMatch(f"{miss} (no scatter of the current window's series into slots [m, 2m))")
    full, current = first_windows.args[0], first_windows.args[1]
    if not is_op(full, aten.full.default) or scalar_constant(full.args[1]) != fill:
        raise NoMatch(f"{miss} (the slots do not start as full({fill}))")
    source = _copied(current, lambda base: base is full, 2, m, L)
    if source is None or not is_op(source, aten.slice.Tensor) or not _is_slice(source, source.args[0], 3, D, 2 * D):
        raise NoMatch(f"{miss} (slots [m, 2m) are not X[..., D:])")
    X = source.args[0]
    if not same_shape(shape(X), (B, W, m, 2 * D)):
        raise NoMatch(f"{miss} (windows {describe(X)} are not [B, W, m, 2D])")
    if inner is None:
        if not same_size(W, 1):
            raise NoMatch(f"{miss} (windows after the first have no previous-window series)")
        return X

    def later_windows(node) -> bool:
        return _is_slice(node, first_windows, 1, 1, W)

    previous = None
    if is_op(inner, aten.slice_scatter.default) and later_windows(inner.args[0]) and _scatter_at(inner, 2, 0, m):
        previous = _copied(inner.args[1], later_windows, 2, 0, m)
    if previous is None or not is_op(previous, aten.slice.Tensor) \
            or not _is_slice(previous, previous.args[0], 3, 0, D) or not _is_slice(previous.args[0], X, 1, 0, W - 1):
        raise NoMatch(f"{miss} (slots [0, m) of window w are not X[w - 1, :, :, :D])")
    return X


def _concatenated_source(slots, fill: float, miss: str):
    """X of the two series built by `cat` instead of slice assignments (the same values):
    cat([cat([full([B, 1, m, D], fill), X[:, :-1, :, :D]], 1), X[..., D:]], 2), the previous windows' halves
    sliced in either order; at one window the previous series may be the full alone."""
    B, W, L, D = shape(slots)
    items = slots.args[0]
    if _dim(slots, slots.args[1] if len(slots.args) > 1 else 0) != 2 or len(items) != 2:
        raise NoMatch(f"{miss} (a cat of other than the previous and the current series along the slots)")
    previous, current = items
    m = shape(current)[2]
    if not same_size(L, 2 * m) or not same_shape(shape(previous), shape(current)):
        raise NoMatch(f"{miss} (the concatenated series are not m slots each)")
    X = current.args[0] if is_op(current, aten.slice.Tensor) else None
    if X is None or not _is_slice(current, X, 3, D, 2 * D) or not same_shape(shape(X), (B, W, m, 2 * D)) \
            or dtype(X) != dtype(slots):
        raise NoMatch(f"{miss} (slots [m, 2m) are not X[..., D:] of windows X [B, W, m, 2D] in the slots' dtype)")
    pieces = list(previous.args[0]) if is_op(previous, aten.cat.default) \
        and _dim(previous, previous.args[1] if len(previous.args) > 1 else 0) == 1 else [previous]
    first, earlier = pieces[0], pieces[1:]
    if not (is_op(first, aten.full.default) and scalar_constant(first.args[1]) == fill and dtype(first) == dtype(X)
            and same_shape(shape(first), (B, 1, m, D))):
        raise NoMatch(f"{miss} (window 0's first half is not full([B, 1, m, D], {fill}))")
    if not (earlier and len(earlier) == 1 and _first_halves_before_last(earlier[0], X, W, D)) \
            and not (not earlier and same_size(W, 1)):
        raise NoMatch(f"{miss} (slots [0, m) of window w are not X[w - 1, :, :, :D])")
    return X


def _first_halves_before_last(node, X, W, D) -> bool:
    """node = X[:, :W - 1, :, :D], the two slices in either order."""
    inner = node.args[0] if is_op(node, aten.slice.Tensor) else None
    if not is_op(inner, aten.slice.Tensor) or inner.args[0] is not X:
        return False
    return ((_is_slice(inner, X, 1, 0, W - 1) and _is_slice(node, inner, 3, 0, D))
            or (_is_slice(inner, X, 3, 0, D) and _is_slice(node, inner, 1, 0, W - 1)))


def _scatter_at(node, dim: int, start, end) -> bool:
    args = list(node.args[2:]) + [None] * (4 - len(node.args[2:]))
    scatter_dim, scatter_start, scatter_end, step = args[:4]
    size = shape(node)[dim]
    return (_dim(node, scatter_dim if scatter_dim is not None else 0) == dim and step in (None, 1)
            and same_size(_bound(scatter_start, size, 0), start) and same_size(_bound(scatter_end, size, size), end))


def _copied(value, base_ok, dim: int, start, end):
    """The source of value = copy(base[dim: start:end], source) with base_ok(base) (HF's slice assignment, same
    dtype and shape: no cast, no broadcast), or None."""
    if not is_op(value, aten.copy.default) or not is_op(value.args[0], aten.slice.Tensor):
        return None
    dst = value.args[0]
    if not base_ok(dst.args[0]) or not _is_slice(dst, dst.args[0], dim, start, end):
        return None
    source = value.args[1]
    if dtype(source) != dtype(value) or not same_shape(shape(source), shape(value)):
        return None
    return source


# --------------------------------------------------------------------------------------------
# Verification: the matched compressor run on probes against the op's reference (`verify.py`)
# --------------------------------------------------------------------------------------------
# An entry may differ from `kv_compress_reference` by this many ulps of its dtype at the largest magnitude of its row
# (the D channels of one window's entry): fp32 entries by a spelling's order of sums and its exp (a written-out
# softmax, `sum / D`, an einsum's bmm, a complex RoPE) carried through the norm; bf16 / fp16 entries by the products
# an einsum sums unrounded (the op rounds each to kv's dtype) and the roundings of the normed row and its RoPE that
# this flips. The corpus and the spelling fuzzer stay within 2.4 fp32 and 1 bf16 ulps; the margin is for the longer
# rows and windows of real models. The smallest wrong spelling seen (eps scaled, a mean or a softmax sum in bf16 in an
# fp32 compressor) is off by thousands of fp32 ulps.
ULPS = {torch.float32: 32, torch.bfloat16: 4, torch.float16: 4}
ROLES = ("kv", "gate", "position_bias", "norm_weight", "cos", "sin")


def _verify_compressor(m: dict) -> Verdict:
    """Run the slice from the windows of the two projections, the position bias, the norm weight and the RoPE tables
    to the roped entries on probes against `kv_compress_reference` with the walk's eps and flags. Not run (None) when
    it is over `verify.MAX_ELEMENTS` values or the graph's guards rule out the sizes the probes take."""
    roles = {role: m[role] for role in ROLES}
    if len(set(roles.values())) != len(roles):
        return Verdict(False, "two roles of the op are bound to one tensor")
    flags = (m["eps"], m["overlap"], m["div_sqrt"], m["exp_log_softmax"])
    family = Family(probes=lambda shapes, dtypes: _compressor_probes(shapes, dtypes, m["overlap"]),
                    reference=lambda probe: kv_compress_reference(*(probe[role] for role in ROLES), *flags),
                    compare=_within_ulps)
    window = shape(m["kv"])[2]
    # symbolic lengths at values over two windows' slots: every window after the first reads its predecessor's
    above = 2 * window if isinstance(window, int) else 0
    # A prefill tail's windows W = (s + r % 8) // 8 + 1, guarded to be 1, beside static [B, 1, R/2] tables, probed
    # as if unguarded (W = 2) would not fit the op: such a site stays on the walk's proof.
    return verify([m["final"]], roles, family, ("compressor", *flags, m["lifted"]), above=above,
                  takes=lambda meta: torch.ops.dsfuse.kv_compress(*(meta[role] for role in ROLES), float(m["eps"]),
                                                                  m["overlap"]))


def _compressor_probes(shapes: dict, dtypes: dict, overlap: bool) -> list:
    """Values, biases and norm weights of every sign at tables of angles, in three settings: unit-sized logits; large
    logits (a peaked softmax, overflowing without its max shift) with a -inf slot in every other channel and a
    negative bias; logits near -100 (underflowing without the max shift; a fill slot not -inf would take every
    weight) with window 0 of batch 0 pooling only zeros (the norm's eps alone below the square root) and the last
    window of the last batch a thousandth of the others (eps of the order of the mean square)."""
    gen = torch.Generator().manual_seed(0)
    B, W, window, C = shapes["kv"]
    D = C // 2 if overlap else C
    kv = torch.randn(shapes["kv"], generator=gen) * 2
    gate = torch.randn(shapes["gate"], generator=gen)
    bias = torch.randn(shapes["position_bias"], generator=gen)
    weight = torch.randn(shapes["norm_weight"], generator=gen)
    angles = torch.rand(shapes["cos"], generator=gen) * 6
    tables = dict(cos=angles.cos(), sin=angles.sin())
    peaked = gate * 30
    if window > 1:
        peaked[:, :, 0, ::2] = float("-inf")
    edges = kv.clone()
    # the last entry pools window W - 1 (in two series its second half, and window W - 2's first half); the first
    # entry's other slots, in two series, are the fill
    edges[-1, -1, :, D - C:] *= 1e-3
    if overlap and W > 1:
        edges[-1, -2, :, :D] *= 1e-3
    edges[0, 0, :, D - C:] = 0.0
    probes = [("unit logits", dict(kv=kv, gate=gate, position_bias=bias, norm_weight=weight, **tables)),
              ("large logits and -inf slots", dict(kv=kv, gate=peaked, position_bias=-bias.abs() * 8,
                                                   norm_weight=-weight.abs(), **tables)),
              ("zero and small rows", dict(kv=edges, gate=gate * 4 - 100, position_bias=bias, norm_weight=weight,
                                           **tables))]
    return [(name, {role: t.to(dtypes[role]) for role, t in probe.items()}) for name, probe in probes]


def _within_ulps(got: list, want: torch.Tensor, probe: dict) -> str | None:
    """None when the slice's entries are the reference's (equal NaNs and infinities) within `ULPS` of their dtype at
    the largest magnitude of each entry, else the worst entry and by how much."""
    out = got[0]
    if not isinstance(out, torch.Tensor) or out.dtype != want.dtype or out.numel() != want.numel():
        return f"the entries are not {want.numel()} values in {want.dtype}"
    miss = ulps_beyond(out, want, ULPS[want.dtype], "row", floor=TINY)
    return None if miss is None else f"entry (batch, window) {miss.where} {miss}"


# --------------------------------------------------------------------------------------------
# Rewrite
# --------------------------------------------------------------------------------------------
def _rewrite(graph: torch.fx.Graph, stats: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    final = m["final"]
    args = (m["kv"], m["gate"], m["position_bias"], m["norm_weight"], m["cos"], m["sin"], float(m["eps"]),
            bool(m["overlap"]), bool(m["div_sqrt"]), bool(m["exp_log_softmax"]))
    call = insert_call(graph, final, torch.ops.dsfuse.kv_compress.default, args)
    out = insert_call(graph, final, aten.unsqueeze.default, (call, 1)) if m["lifted"] else call
    final.replace_all_uses_with(out)
    B, W, m_slots, C = shape(m["kv"])
    D = shape(m["norm_weight"])[0]
    kind = "two overlapping series" if m["overlap"] else "one series"
    roundings = "".join(f" {name}" for name in ("exp_log_softmax", "div_sqrt") if m[name])
    ctx.site(stats, "dsfuse.kv_compress", [m["kv"], m["gate"]],
             f"m={m_slots} D={D} R={2 * shape(m['cos'])[-1]}{roundings}, {kind}", call=call)
