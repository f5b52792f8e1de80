"""`compressors`: DeepSeek V4's KV compressors (HF `DeepseekV4CSACompressor`, `DeepseekV4HCACompressor` and the
compressor inside `DeepseekV4Indexer`) rewritten into one `dsfuse::kv_compress` call each.

The anchor is the softmax over the window slots, `amax(G, [2], keepdim)` (on CUDA Inductor's
`prepare_softmax_online(G, 2)`) of a 4-D gate G [B, W, slots, D]; the
match proves, from there, the whole compressor (the projections stay where they are, GEMMs for Inductor):

    P      = exp(G - amax(G)) / sum(exp(G - amax(G)), 2)  [.to(kv dtype)]
    pooled = sum(KVs * P, 2)                                                        [B, W, D]
    normed = (w * (p * rsqrt(mean(p^2, -1) + eps))).to(dtype),  p = pooled.float()   (HF RMSNorm, 1-D weight)
    out    = cat([n[..., :-R], (r.float() * c2 + rotate_half(r).float() * s2).to(dtype)], -1),  n = normed
             [unsqueezed], r = n[..., -R:], rotate_half the interleaved (-r[1::2], r[0::2]) pairs, c2 / s2 =
             cos / sin [B, W, R/2] repeated twice along the last dim (`repeat_interleave(2, -1)`)

and the slot layout of (G, KVs), each from the 4-D windows X = view(chunk, [B, W, m, C]) of a projection (the
gate's with `+ position_bias [m, C]`):

    HCA (no overlap): G, KVs are the windows themselves (C = D).
    CSA (overlap, C = 2D): full([B, W, 2m, D], -inf / 0) with slots [m, 2m) <- X[..., D:] and, when W > 1, slots
        [0, m) of windows [1, W) <- X[:, :-1, :, :D], as `slice_scatter`s of `copy`s (HF's slice assignments).

The weighted sum may be any contraction over the slots (`einsum('bwld,bwld->bwd')`: a bmm, or Inductor's mul + sum
of it), proven with `dims.py` labels; the bias may be broadcast from [m, C] explicitly; the norm's mean may be
`sum / D`. A softmax over slots whose weights pool values but whose surroundings differ is reported with the
reason; other softmaxes over dim 2 are skipped silently. Not fused (reported): window 0's first half taken from
the cache's overlap state (a step that continues from a cache: a later prefill chunk, the decode step that closes a
window), a gate without a [m, C] bias, a biased gate rounded to bf16 other than by the sum itself, RoPE in another
spelling than HF's (the official complex product).

A model cast as a whole (`.to(torch.bfloat16)`, `.half()`) has a bias in the model dtype, so `gate + bias` is rounded
to that dtype before the fp32 softmax; the op, given that bias, rounds at the same point. Summing in fp32 instead (the
bias widened) was measured no closer to the fp32 model (`v4-tiny` cast to bf16, S=64: 0.02878 relative distance of
the logits either way, Inductor 0.02550 there: its gap is the products rounded to the model dtype, as in
transformers' dtypes).
"""

from __future__ import annotations

import torch

import dsfuse.kernels.compressor  # noqa: F401  (registers torch.ops.dsfuse.kv_compress)

from .canonicalize import row_mean
from .context import NoMatch, PassContext, rewrite_anchored
from .dims import apply_op, bmm_labels, broadcast, contracted, follow, leaf_labels, names
from .graph_utils import (CONVERT, LAYOUT_OPS, PREPARE_SOFTMAX_ONLINE, VIEW_OPS, aten, describe, dtype, insert_call,
                          is_op, is_upcast, only_user, same_shape, same_size, scalar_arg, scalar_constant, shape,
                          softmax_parts, users_of, walk_back)

NAME = "compressors"
IMPLEMENTED = True
END = 9223372036854775807  # how a slice to the end appears in the graph


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, (aten.amax.default, PREPARE_SOFTMAX_ONLINE), _match, _rewrite)


# --------------------------------------------------------------------------------------------
# Small structural predicates
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
# Matching
# --------------------------------------------------------------------------------------------
def _match(stats: torch.fx.Node) -> dict:
    G = stats.args[0]
    keepdim = stats.target is PREPARE_SOFTMAX_ONLINE or (len(stats.args) > 2 and stats.args[2])
    dims = stats.args[1] if isinstance(stats.args[1], (list, tuple)) else [stats.args[1]]
    if len(shape(G)) != 4 or not _dims_are(dims, G, (2,)) or not keepdim:
        raise NoMatch("not a softmax over the slots of 4-D windows", reported=False)
    parts = softmax_parts(G, dim=2)
    if parts is None or parts["stats"] is not stats:
        weights = _exp_of_log_softmax(stats, G)
        if weights is not None:
            _pooling(weights)  # raises (unreported) where these weights pool no values: not a compressor
            raise NoMatch("compressor weights are exp(log_softmax(gate)) over the slots, which round otherwise than "
                          "the op's exp(g - max) / sum: not fused")
        raise NoMatch("amax over dim 2 that is not a softmax", reported=False)
    pooled, kv_slots = _pooling(parts["probs"])
    kv_dtype = dtype(pooled)
    if dtype(G) != torch.float32:
        raise NoMatch(f"compressor softmax over a {dtype(G)} gate, not fp32 (HF: softmax(dtype=float32))")
    norm = _rmsnorm(pooled, kv_dtype)
    rope = _rope(norm["out"], kv_dtype)
    layout = _slots(G, kv_slots)
    return dict(pooled=pooled, **norm, **rope, **layout)


def _exp_of_log_softmax(stats, G):
    """exp(log_softmax(G, 2)) as decomposed, exp((G - max) - log(sum(exp(G - max), 2))), from its max; else None."""
    shifted = next((u for u in users_of(stats, aten.sub.Tensor) if u.args == (G, stats)), None)
    for log_sum in users_of(shifted, aten.sub.Tensor) if shifted is not None else ():
        log = log_sum.args[1]
        total = log.args[0] if is_op(log, aten.log.default) else None
        exps = total.args[0] if is_op(total, aten.sum.dim_IntList) else None
        if log_sum.args[0] is shifted and is_op(exps, aten.exp.default) and exps.args[0] is shifted:
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
    """HF `DeepseekV4RMSNorm` of the pooled entries: (weight * (x * rsqrt(mean(x^2) + eps))).to(dtype)."""
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
    rsqrt = only_user(add, aten.rsqrt.default) if add is not None else None
    eps = scalar_arg(add.args[1]) if add is not None else None
    if rsqrt is None or eps is None:
        raise NoMatch(f"{miss} (no rsqrt(mean + eps) with a constant eps)")
    scaled = [u for u in users_of(rsqrt, aten.mul.Tensor) if _other(u, rsqrt) is xf]
    if len(scaled) != 1 or len(xf.users) != 2:
        raise NoMatch(f"{miss} (x * rsqrt(...) not found, or x has other readers)")
    weighted = only_user(scaled[0], aten.mul.Tensor)
    weight = _other(weighted, scaled[0]) if weighted is not None else None
    if not isinstance(weight, torch.fx.Node) or len(shape(weight)) != 1 \
            or not same_size(shape(weight)[0], shape(pooled)[-1]) or dtype(weighted) != torch.float32:
        raise NoMatch(f"{miss} (no fp32 product with a 1-D [D] weight)")
    out = _cast_user(weighted, kv_dtype)
    if out is None:
        raise NoMatch(f"{miss} (the weighted value is not cast back to {kv_dtype})")
    return dict(norm_weight=weight, eps=eps, out=out)


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
    """HF `apply_rotary_pos_emb` (interleaved, trailing R channels) of the normed entries at the windows' tables."""
    miss = "compressor: the normed entries are not roped as HF's apply_rotary_pos_emb"
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
        found = _rotation(rope_part, kv_dtype, shape(normed)[:2])
        if found is None:
            raise NoMatch(f"{miss} (x*cos + rotate_half(x)*sin over interleaved pairs not found)")
        rotated, cos, sin = found
        cat = [c for c in users_of(rotated, aten.cat.default) if list(c.args[0]) == [nope[0], rotated]
               and _dim(c, c.args[1] if len(c.args) > 1 else 0) == last]
        if len(cat) != 1:
            raise NoMatch(f"{miss} (the roped part is not cat'ed back after the rest)")
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
    if is_op(G, aten.cat.default) or is_op(kv_slots, aten.cat.default):
        raise NoMatch(f"compressor slots {describe(G)} are concatenated (torch.cat), not laid out as HF's two "
                      "overlapping series (slice assignments into full buffers): not fused")
    if is_op(G, aten.slice_scatter.default) or is_op(kv_slots, aten.slice_scatter.default):
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
    if previous is None or not is_op(previous, aten.slice.Tensor) or not _is_slice(previous, previous.args[0], 3, 0, D) \
            or not _is_slice(previous.args[0], X, 1, 0, W - 1):
        raise NoMatch(f"{miss} (slots [0, m) of window w are not X[w - 1, :, :, :D])")
    return X


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
# Rewrite
# --------------------------------------------------------------------------------------------
def _rewrite(graph: torch.fx.Graph, stats: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    final = m["final"]
    args = (m["kv"], m["gate"], m["position_bias"], m["norm_weight"], m["cos"], m["sin"], float(m["eps"]),
            bool(m["overlap"]))
    call = insert_call(graph, final, torch.ops.dsfuse.kv_compress.default, args)
    out = insert_call(graph, final, aten.unsqueeze.default, (call, 1)) if m["lifted"] else call
    final.replace_all_uses_with(out)
    B, W, m_slots, C = shape(m["kv"])
    D = shape(m["norm_weight"])[0]
    kind = "two overlapping series" if m["overlap"] else "one series"
    ctx.site(stats, "dsfuse.kv_compress", [m["kv"], m["gate"]],
             f"m={m_slots} D={D} R={2 * shape(m['cos'])[-1]}, {kind}", call=call)
