"""`hyper_connections`: DeepSeek V4's manifold-constrained hyper-connections (HF `DeepseekV4HyperConnection`,
`DeepseekV4HyperHead`, and the expand + mix of `DeepseekV4DecoderLayer.forward`; the official inference code's
`hc_pre` / `hc_post`) rewritten into `dsfuse::hc_collapse` / `dsfuse::hc_head` and `dsfuse::hc_expand_mix`.

The anchor is the collapse, `sum(unsqueeze(pre, -1) * x, stream_dim)` in fp32 (then `.to(x.dtype)`), or the same
contraction over the streams as a bmm (`pre[..., None, :] @ x`, `einsum`), where x is the [*, n, D] streams (or
their fp32 flattened copy viewed back) and `pre` traces back (through views and casts) to

    pre    = sigmoid(w * scale + b) + hc_eps                 (sigmoid also as 1 / (1 + exp(-z)))
    w      = mixes[..., :n]                                  (split or slice; the head: w = mixes, n columns)
    mixes  = flat @ fn^T,  flat = a * rsqrt(mean(a^2, -1, keepdim) + eps)   (unweighted RMSNorm of the flattened
             fp32 streams a; any mm / bmm / einsum spelling, its dims followed through layout ops (`dims.py`), or
             `(a @ fn^T) * rsqrt(...)`, the rsqrt applied after the projection as the kernel does)

For a hyper-connection the other two pieces of the same mixes are then proven:

    post   = 2 * sigmoid(mixes[..., n:2n] * scale[1] + base[n:2n])
    comb   = softmax(view(mixes[..., 2n:], n, n) * scale[2] + view(base[2n:], n, n), -1) + hc_eps (or the affine
             map viewed afterwards; the softmax also exp(z) / sum(exp(z))), then Sinkhorn: a column step
             c / (sum(c, -2, keepdim) + hc_eps) (or c * (1 / (sum + hc_eps))), then (iters - 1) row + column steps,

where scale[i] is `scale.unbind(0)[i]` or `scale[i]`, the chain of steps is walked to its end (the Sinkhorn loop is
unrolled in the graph: any iteration count), and it must alternate column, row, ..., column with the same eps, as
HF's loop does. The collapse, `post` and `comb` are replaced by the outputs of one `hc_collapse` call (the casts and
views of an fp32 copy of the streams made after post or comb moved before it; a collapse its reader views with the
token dims merged viewed so). Streams the graph holds only flattened `[*, n*D]` (their [*, n, D] view folded into
the bmm's) are followed from the flat tensor, one dim carrying both atoms, and the ops read a view of it. A softmax
written `exp(z) / sum(exp(z))` (no max subtracted) and Sinkhorn steps written `c * (1 / (sum + eps))` round otherwise
than HF's: the collapse takes the op's `exp_sum_softmax` / `reciprocal_sinkhorn`, which round as they do; steps
mixing the two forms are reported.

Then the block exits: `post.to(dtype)[..., None] * out[..., None, :] + comb.to(dtype)^T @ residual`, the mix a bmm
(`matmul`, `einsum`, `.mT`) or a broadcast sum of fp32 products (`hc_post`), its dims followed through layout ops,
whose post and comb are one `hc_collapse` call's outputs, become one `hc_expand_mix` call. A collapse or a mix
whose products are rounded to bf16 is reported (the ops multiply in fp32, as HF's promotion and matmul do).

Each matched collapse, head and exit is then run on probes against its op's reference before it is rewritten
(`verify.py`), since the walk looks through casts to find its tensors and so passes over a rounding the op does not
make (a bf16 copy of fp32 streams collapsed, post rounded before the exit). The collapse's slice runs from the
streams (as the norm and the collapse both read them, before their views and casts), fn, base and scale to the
outputs the call replaces, against `hc_collapse_reference` / `hc_head_reference` with the eps values, iterations and
flags the walk read; the exit's from out, the residual, post and comb, against `hc_expand_mix_reference`. Probes:
unit-sized logits, then large ones with a negative scale (saturated sigmoids, a peaked softmax); for an exit, the
weights a collapse gives, then weights of every sign. Budget: 128 ulps of fp32, 2 of bf16 / fp16, at an output's
largest magnitude (the spellings' summation orders; at most 12 fp32 ulps seen over the spelling fuzzer). A
disagreement is a near-miss naming the probe, the output and by how much it differs.

The exit and the next collapse stay two launches: one kernel computing both (`hc_exit_collapse` /
`hc_exit_head`) measured slower on the H200 than the two it replaces (1.71 against 0.16 + 0.65 ms at T=8192,
D=4096: its collapse walks each row block's whole streams in one program), so the pass does not emit it.

Stages: anchors `COLLAPSE_ANCHORS`, then `EXIT_ANCHORS`; binders `_match_collapse` and `_match_expand_mix`; verifiers
`_verify_collapse` and `_verify_expand_mix`, against `hc_collapse_reference`, `hc_head_reference` and
`hc_expand_mix_reference` (kernels/hyper_connections.py); rewrites `_rewrite_collapse` into `dsfuse::hc_collapse` or
`dsfuse::hc_head` and `_rewrite_expand_mix` into `dsfuse::hc_expand_mix`.
"""

from __future__ import annotations

import operator

import torch

from dsfuse.kernels.hyper_connections import hc_collapse_reference, hc_expand_mix_reference, hc_head_reference

from .canonicalize import MEAN, canonical_bmm, canonical_mm
from .context import NoMatch, PassContext, rewrite_anchored
from .dims import apply_op, bmm_labels, broadcast, contracted, follow, layout_chain, leaf_labels, names
from .graph_utils import (CONVERT, LAYOUT_OPS, VIEW_OPS, aten, dtype, element_of, fake_call, insert_call, is_op,
                          only_user, piece_of, same_shape, same_size, scalar_arg, shape, softmax_parts, strip,
                          users_of, walk_back)
from .verify import MAX_NODES, Family, Verdict, ulps_beyond, verify

NAME = "hyper_connections"
IMPLEMENTED = True

HC_COLLAPSE = torch.ops.dsfuse.hc_collapse.default
HC_HEAD = torch.ops.dsfuse.hc_head.default
HC_EXPAND_MIX = torch.ops.dsfuse.hc_expand_mix.default


# --------------------------------------------------------------------------------------------
# Anchors
# --------------------------------------------------------------------------------------------
# The collapse's contraction over the streams (a broadcast product summed, or a bmm), and the block exit's add; the
# exits after the collapses, since an exit's post and comb must be a collapse call's outputs.
COLLAPSE_ANCHORS = (aten.sum.dim_IntList, aten.bmm.default)
EXIT_ANCHORS = (aten.add.Tensor,)


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, COLLAPSE_ANCHORS, _match_collapse, _rewrite_collapse)
    rewrite_anchored(graph, ctx, EXIT_ANCHORS, _match_expand_mix, _rewrite_expand_mix)


# --------------------------------------------------------------------------------------------
# Binding: small structural helpers
# --------------------------------------------------------------------------------------------
CASTS = (CONVERT,)


def _is_upcast(node) -> bool:
    """A cast that holds every value of its input exactly (bf16 / fp16 -> fp32)."""
    return is_op(node, CONVERT) and node.args[1] == torch.float32 and dtype(node.args[0]) in (
        torch.bfloat16, torch.float16, torch.float32)


def _is_view_or_cast(node) -> bool:
    """A view, a cast or a no-op expand."""
    return is_op(node, CONVERT, *VIEW_OPS) or (
        is_op(node, aten.expand.default) and same_shape(shape(node.args[0]), shape(node)))


def _strip_layout(node):
    """Through views, casts and no-op expands."""
    return walk_back(node, _is_view_or_cast)[0]


def _streams_of(operand, streams_shape):
    """The tensor the collapse reads as streams [*, n, D]: `operand` back through views and exact upcasts to the
    node nearest the leaf with that shape (HF multiplies the streams themselves; the official code their fp32
    flattened copy viewed back)."""
    chain = walk_back(operand, lambda n: is_op(n, *VIEW_OPS) or _is_upcast(n))
    return next((n for n in chain if same_shape(shape(n), streams_shape)), None)


def _nearest(operand, accept):
    """(node, layout ops from it to `operand`): back from `operand` through layout ops and fp32 upcasts, the first
    node `accept` takes (the streams a bmm reads, not the embedding they were expanded from), else the leaf."""
    chain = walk_back(operand, lambda n: is_op(n, *LAYOUT_OPS) or _is_upcast(n))
    for i in range(len(chain) - 1, -1, -1):
        if accept(chain[i]):
            return chain[i], chain[i + 1:]
    return chain[0], chain[1:]


def _operands(node, target):
    """(a, b) of a binary `target` call, or None."""
    if is_op(node, target) and len(node.args) == 2:
        return node.args
    return None


def _split_off(node, other_test):
    """For a commutative binary node's args (a, b): (the one passing `other_test`, the other), or None."""
    a, b = node
    if other_test(a):
        return a, b
    if other_test(b):
        return b, a
    return None


def _dim(d, rank: int) -> int:
    return d + rank if d < 0 else d


def _reduce_dims(node) -> tuple[list[int], bool]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    rank = len(shape(node.args[0]))
    return sorted(_dim(d, rank) for d in (dims or [])), bool(keepdim)


def _add_const(node) -> tuple[torch.fx.Node, float] | None:
    """x + c (c a Python number): (x, c)."""
    ops = _operands(node, aten.add.Tensor)
    if ops is None:
        return None
    a, b = ops
    if scalar_arg(b) is not None and isinstance(a, torch.fx.Node):
        return a, scalar_arg(b)
    if scalar_arg(a) is not None and isinstance(b, torch.fx.Node):
        return b, scalar_arg(a)
    return None


def _getitem_of(node, target):
    """(the call of `target` that `node` = getitem(call, i) reads, i), or None."""
    if is_op(node, operator.getitem) and is_op(node.args[0], target):
        return node.args[0], node.args[1]
    return None


def _sigmoid_arg(node):
    """z of `sigmoid(z)` (through casts), also spelled `1 / (1 + exp(-z))`, the kernel's own form; else None."""
    node = strip(node, CASTS)
    if is_op(node, aten.sigmoid.default):
        return node.args[0]
    found = _add_const(node.args[0]) if is_op(node, aten.reciprocal.default) else None
    if found is not None and found[1] == 1.0 and is_op(found[0], aten.exp.default) \
            and is_op(found[0].args[0], aten.neg.default):
        return found[0].args[0].args[0]
    return None


def _sigmoid_user(z):
    """The sigmoid of z that is z's only reader (`sigmoid`, or `1 / (1 + exp(-z))`), or None."""
    sig = only_user(z, aten.sigmoid.default)
    if sig is not None:
        return sig
    neg = only_user(z, aten.neg.default)
    exp = only_user(neg, aten.exp.default) if neg is not None else None
    add = only_user(exp, aten.add.Tensor) if exp is not None else None
    if add is None or _add_const(add) != (exp, 1.0):
        return None
    return only_user(add, aten.reciprocal.default)


def _follow(labels, ops):
    """`dims.follow` that passes None (a leaf of another rank) through."""
    return follow(labels, ops) if labels is not None else None


def _bmm_labels(a, b):
    return bmm_labels(a, b) if a is not None and b is not None else None


def _flat_labels(node, tokens: int, hc: int, hidden: int):
    """Labels of the streams' values as `node` holds them: [tokens..., (n, c)] flattened or [tokens..., n, c]."""
    dims = shape(node)
    lead = [((f"t{i}", size),) if not same_size(size, 1) else () for i, size in enumerate(dims[:tokens])]
    if len(dims) == tokens + 1:
        return lead + [(("n", hc), ("c", hidden))]
    if len(dims) == tokens + 2:
        return lead + [(("n", hc),), (("c", hidden),)]
    return None


def _lead_names(rank: int) -> list[str]:
    return [f"t{i}" for i in range(rank)]


def _is_flat_streams(node, streams_shape) -> bool:
    """Whether `node` holds streams of `streams_shape` [*, n, D] flattened as [*, n*D] (static n and D)."""
    hc, hidden = streams_shape[-2:]
    return isinstance(hc, int) and isinstance(hidden, int) and len(shape(node)) == len(streams_shape) - 1 \
        and same_shape(shape(node), tuple(streams_shape[:-2]) + (hc * hidden,))


def _stream_labels(node, streams_shape, stream: str, column: str):
    """Labels of streams of `streams_shape` [*, n, D] as `node` holds them: [*, n, D], or flattened [*, n*D] (one
    dim carrying both atoms, which a view back to [*, n, D] splits), else None."""
    lead = _lead_names(len(streams_shape) - 2)
    if same_shape(shape(node), streams_shape):
        return leaf_labels(node, lead + [stream, column])
    if not _is_flat_streams(node, streams_shape):
        return None
    hc, hidden = streams_shape[-2:]
    return leaf_labels(node, lead + [stream])[:-1] + [((stream, hc), (column, hidden))]


# --------------------------------------------------------------------------------------------
# Binding: the collapse and what it proves
# --------------------------------------------------------------------------------------------
def _pre_source(factor):
    """unsqueeze(pre, -1) (pre through casts): pre, else None."""
    if not is_op(factor, aten.unsqueeze.default):
        return None
    rank = len(shape(factor))
    if _dim(factor.args[1], rank) != rank - 1:
        return None
    return strip(factor.args[0], CASTS)


def _is_sigmoid_plus_eps(node) -> bool:
    found = _add_const(node)
    return found is not None and _sigmoid_arg(found[0]) is not None


def _sum_collapse(total: torch.fx.Node) -> tuple:
    """(pre, streams, total) of `sum(unsqueeze(pre, -1) * x, -2)`."""
    dims, keepdim = _reduce_dims(total)
    prod = total.args[0]
    ops = _operands(prod, aten.mul.Tensor)
    if ops is None or keepdim or len(shape(prod)) < 3:
        raise NoMatch("not a sum of a product", reported=False)
    rank = len(shape(prod))
    picked = _split_off(ops, lambda a: _pre_source(a) is not None and _is_sigmoid_plus_eps(_pre_source(a)))
    if picked is None:
        raise NoMatch("no sigmoid weights", reported=False)
    factor, streams_operand = picked
    if dims != [rank - 2]:
        raise NoMatch("a sum of sigmoid-weighted values that is not a collapse over the stream dim", reported=False)
    x = _streams_of(strip(streams_operand, CASTS), shape(prod))
    if x is None:
        raise NoMatch("a sum of sigmoid-weighted values broadcast over the streams", reported=False)
    if dtype(prod) != torch.float32:
        raise NoMatch(f"hyper-connection collapse: pre * x is computed in {dtype(prod)}, HF's products are fp32")
    return _pre_source(factor), x, total, shape(x)


def _bmm_collapse(bmm: torch.fx.Node) -> tuple:
    """(pre, streams, the collapse's value [*, D]) of the collapse spelled as a contraction over the streams by a
    bmm (`pre[..., None, :] @ x`, `einsum('bsn,bsnd->bsd')`), dims followed through layout ops and fp32 upcasts."""
    pre, pre_ops = layout_chain(bmm.args[0])
    if not _is_sigmoid_plus_eps(pre):
        raise NoMatch("no sigmoid weights", reported=False)
    x, x_ops = _nearest(bmm.args[1], lambda n: len(shape(n)) == len(shape(pre)) + 1
                        and same_shape(shape(n)[:-1], shape(pre)))
    streams_shape = shape(x)
    if len(shape(x)) == len(shape(pre)) and same_shape(shape(x)[:-1], shape(pre)[:-1]) \
            and isinstance(shape(x)[-1], int) and isinstance(shape(pre)[-1], int) \
            and shape(x)[-1] % shape(pre)[-1] == 0:
        streams_shape = tuple(shape(pre)) + (shape(x)[-1] // shape(pre)[-1],)  # held flattened [*, n*D]
    rank = len(streams_shape)
    if rank < 3 or len(shape(pre)) != rank - 1 or dtype(bmm) != torch.float32:
        if dtype(bmm) == torch.float32 and _affine(_sigmoid_arg(_add_const(pre)[0])) is not None:
            raise NoMatch(f"hyper-connection collapse: sigmoid(w * scale + base) + eps weights contract streams "
                          f"held neither as [*, n, D] nor as [*, n*D] (read from {list(shape(x))})")
        raise NoMatch("a bmm of sigmoid weights that is not an fp32 collapse of streams", reported=False)
    lead = _lead_names(rank - 2)
    x_labels = _stream_labels(x, streams_shape, "j", "d")
    a, b = _follow(leaf_labels(pre, lead + ["j"]), pre_ops), _follow(x_labels, x_ops)
    labels = _bmm_labels(a, b)
    if labels is None or names([contracted(a, b)]) != [("j",)]:
        raise NoMatch("a bmm of sigmoid weights that does not contract the streams", reported=False)
    expected, node, result_labels = names(x_labels)[:rank - 2] + [("d",)], bmm, labels
    while names(labels) != expected or len(shape(node)) != rank - 1:
        user = only_user(node, *LAYOUT_OPS)
        labels = apply_op(labels, user) if user is not None else None
        if labels is None:
            return pre, x, _flat_collapse(bmm, result_labels, expected), streams_shape
        node = user
    return pre, x, node, streams_shape


def _flat_collapse(bmm, labels, expected):
    """The bmm itself when its result holds the collapse's values in their order, only with the token dims merged
    (its [*, D] view folded into the reader's view): the fused value is then viewed as the bmm's shape."""
    if [a for dim in names(labels) for a in dim] != [a for dim in expected for a in dim]:
        raise NoMatch("a bmm of sigmoid weights whose result is not viewed as [*, D]", reported=False)
    if not all(isinstance(size, int) for size in shape(bmm)):
        raise NoMatch(f"hyper-connection collapse: the collapse is read as {list(shape(bmm))} (its tokens merged), "
                      "a view the pass builds for static shapes only")
    return bmm


def _match_collapse(anchor: torch.fx.Node) -> dict:
    pre, x, total, streams_shape = (_bmm_collapse if is_op(anchor, aten.bmm.default) else _sum_collapse)(anchor)
    hc, hidden = streams_shape[-2], streams_shape[-1]
    if not isinstance(hc, int) or not isinstance(hidden, int):
        raise NoMatch(f"hyper-connection collapse: stream count {hc} / hidden {hidden} not static")
    if not same_shape(shape(x), streams_shape) and not all(isinstance(size, int) for size in streams_shape):
        raise NoMatch(f"hyper-connection collapse: streams held only flattened as {list(shape(x))}, a view to "
                      "[*, n, D] the pass builds for static shapes only")
    sig_arg, hc_eps = _add_const(pre)
    found = _affine(_sigmoid_arg(sig_arg))
    if found is None:
        raise NoMatch("hyper-connection collapse: pre is not sigmoid(w * scale + base) + eps")
    w, scale_node, base_node = found
    piece = piece_of(w)
    head = piece is None
    mixes = w if head else _mixes_of_pieces(piece, hc)
    norm = _match_projection(mixes, x, streams_shape, head)
    m = dict(x=x, streams_shape=streams_shape, hc=hc, hidden=hidden, hc_eps=hc_eps, head=head, norm_eps=norm["eps"],
             fn=norm["fn"], total=total)
    if head:
        m.update(scale=_param(scale_node, (1,), "scale"), base=_param(base_node, (hc,), "base"))
    else:
        m.update(_match_mixing(mixes, scale_node, base_node, hc, hc_eps))
    m["output"], m["upcast"] = _collapsed_output(total, x)
    m["before"], m["hoisted"] = _call_position(anchor.graph, [x, m["fn"], m["base"], m["scale"]],
                                 [m["output"]] if head else [m["output"], m["post"], m["comb"]])
    verdict = _verify_collapse(m)
    if verdict.ok is False:
        raise NoMatch(f"hyper-connection {'head' if head else 'collapse'}: numeric check against the reference "
                      f"failed: {verdict.reason}")
    return m


def _call_position(graph: torch.fx.Graph, inputs: list, replaced: list) -> tuple[torch.fx.Node, list]:
    """(the first node the fused call replaces, which it goes before; the views and casts its inputs need that are
    computed after that node, in graph order, to be moved before it: the collapse may read an fp32 copy of the
    streams made after post or comb)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(replaced, key=order.__getitem__)
    late, pending = set(), list(inputs)
    while pending:
        node = pending.pop()
        if order[node] < order[first] or node in late:
            continue
        if node in replaced or not is_op(node, CONVERT, *LAYOUT_OPS):
            raise NoMatch(f"hyper-connection: the collapse's input {node} is computed after {first}, which the "
                          "fused op replaces")
        late.add(node)
        pending.extend(node.all_input_nodes)
    return first, sorted(late, key=order.__getitem__)


def _affine(z):
    """w * scale + base (either operand order): (w, scale, base)."""
    ops = _operands(z, aten.add.Tensor)
    if ops is None:
        return None
    for prod, base in (ops, ops[::-1]):
        mul = _operands(prod, aten.mul.Tensor)
        if mul is not None and isinstance(base, torch.fx.Node):
            for w, scale in (mul, mul[::-1]):
                if isinstance(w, torch.fx.Node) and isinstance(scale, torch.fx.Node) and len(shape(scale)) <= 1:
                    return w, scale, base
    return None


def _param(node, expected_shape, name):
    """A weight tensor (through fp32 casts) of the given shape; the op upcasts as HF's `.float()` does."""
    node = strip(node, CASTS)
    if not same_shape(shape(node), expected_shape):
        raise NoMatch(f"hyper-connection: {name} {node} has shape {list(shape(node))}, expected {list(expected_shape)}")
    return node


def _ranges(hc):
    return {"pre": (0, hc), "post": (hc, 2 * hc), "comb": (2 * hc, (2 + hc) * hc)}


def _mixes_of_pieces(piece, hc):
    """The mixes of which the pre weights are the first n columns (`split(...)[0]` or `mixes[..., :n]`)."""
    mixes, dim, start, end = piece
    if dim != len(shape(mixes)) - 1 or not same_shape(shape(mixes)[-1:], ((2 + hc) * hc,)) \
            or (start, end) != _ranges(hc)["pre"]:
        raise NoMatch(f"hyper-connection collapse: pre weights are columns [{start}, {end}) of dim {dim} of "
                      f"{list(shape(mixes))}, expected the first {hc} of {(2 + hc) * hc} mixes over the last dim")
    return mixes


def _row_mean_input(mean):
    """x of `mean(x, -1, keepdim=True)`, also spelled `sum(x, -1, keepdim=True) / C` (`MEAN`), else None."""
    if is_op(mean, aten.mean.dim):
        return mean.args[0] if _reduce_dims(mean) == ([len(shape(mean)) - 1], True) else None
    marked = mean.meta.get(MEAN) if isinstance(mean, torch.fx.Node) else None
    if marked is not None and marked[1:] == ((len(shape(mean)) - 1,), True):
        return marked[0]
    return None


def _match_projection(mixes, x, streams_shape, head) -> dict:
    """mixes = fn-projection of the unweighted RMSNorm of the flattened streams: `mm(view(rmsnorm(flat)), fn^T)`
    (F.linear), any bmm / einsum spelling of that contraction, or the norm's rsqrt applied after the projection
    (`F.linear(flat, fn) * rsqrt`, the official code; the kernel scales after its dot as well). Returns fn and the
    norm's eps. x holds the streams of `streams_shape` [*, n, D], possibly flattened."""
    hc, hidden = streams_shape[-2:]
    rows = hc if head else (2 + hc) * hc
    chain = walk_back(mixes, lambda n: is_op(n, *LAYOUT_OPS))
    rsqrt_after = None
    ops = _operands(chain[0], aten.mul.Tensor)
    picked = _split_off(ops, lambda r: is_op(strip(r, CASTS), aten.rsqrt.default)) if ops is not None else None
    if picked is not None:
        rsqrt_after = picked[0]
        chain = walk_back(picked[1], lambda n: is_op(n, *LAYOUT_OPS)) + chain[1:]
    proj, out_ops = chain[0], chain[1:]
    operands = canonical_mm(proj) or canonical_bmm(proj)  # also as Inductor's pad_mm computes it on CUDA
    if operands is None:
        raise NoMatch(f"hyper-connection: mixing logits {mixes} are not an fp32 projection (mm)")
    if dtype(proj) != torch.float32:
        raise NoMatch(f"hyper-connection: projection runs in {dtype(proj)}, HF's in fp32")
    lhs_chain = walk_back(operands[0], lambda n: is_op(n, *LAYOUT_OPS))
    a, lhs_ops = lhs_chain[0], lhs_chain[1:]
    fn_leaf, fn_ops = layout_chain(operands[1])
    tokens = len(streams_shape) - 2
    fn_labels = [(("r", rows),), (("n", hc), ("c", hidden))] if len(shape(fn_leaf)) == 2 else None
    labels = _bmm_labels(_follow(_flat_labels(a, tokens, hc, hidden), lhs_ops), _follow(fn_labels, fn_ops))
    labels = _follow(labels, out_ops)
    if labels is None or names(labels) != names(_flat_labels(x, tokens, hc, hidden))[:tokens] + [("r",)]:
        raise NoMatch("hyper-connection: projection is not the flattened streams times fn^T")
    fn = _param(fn_leaf, (rows, hc * hidden), "fn")
    if rsqrt_after is None:
        ops = _operands(a, aten.mul.Tensor)
        picked = _split_off(ops, lambda r: is_op(strip(r, CASTS), aten.rsqrt.default)) if ops is not None else None
        if picked is None:
            raise NoMatch("hyper-connection: projection input is not x * rsqrt(mean(x^2) + eps)")
        rsqrt, a = picked
    else:
        rsqrt = rsqrt_after
    found = _add_const(strip(rsqrt, CASTS).args[0])
    sq = _row_mean_input(found[0]) if found else None
    if sq is None:
        raise NoMatch("hyper-connection: norm is not rsqrt(mean(x^2, -1, keepdim) + eps)")
    if not (is_op(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2):
        raise NoMatch("hyper-connection: norm statistic is not a mean of squares")
    flat = sq.args[0]
    if _strip_layout(flat) is not _strip_layout(a):
        raise NoMatch("hyper-connection: the norm's square and its scaled value read different tensors")
    if _strip_layout(a) is not _strip_layout(x):
        raise NoMatch("hyper-connection: the norm reads other values than the collapsed streams")
    if dtype(flat) != torch.float32 or dtype(a) != torch.float32 or not same_shape(shape(flat)[-1:], (hc * hidden,)):
        raise NoMatch(f"hyper-connection: norm over {list(shape(flat))} in {dtype(flat)}, expected the flattened "
                      f"{hc} x {hidden} streams in fp32")
    if not same_shape(shape(flat)[:-1], streams_shape[:-2]):
        raise NoMatch("hyper-connection: norm rows are not the streams' tokens")
    return dict(fn=fn, eps=found[1])


def _scale_piece(node, index, count):
    """`scale.unbind(0)[index]` or `scale[index]` (through casts): scale."""
    found = element_of(strip(node, CASTS))
    if found is None or found[1:] != (0, index):
        raise NoMatch(f"hyper-connection: scale {node} is not scale.unbind(0)[{index}]")
    return _param(found[0], (count,), "scale")


def _base_piece(node, columns, base=None):
    """`base.split(...)[i]` or `base[a:b]` (through views) of the given columns: base."""
    found = piece_of(strip(node, VIEW_OPS))
    if found is None or found[1] != 0 or (found[2], found[3]) != columns:
        raise NoMatch(f"hyper-connection: bias {node} is not base[{columns[0]}:{columns[1]}]")
    src = strip(found[0], CASTS)
    if base is not None and src is not base:
        raise NoMatch("hyper-connection: pre, post and comb biases come from different tensors")
    return src


def _match_mixing(mixes, pre_scale, pre_base, hc, hc_eps) -> dict:
    ranges = _ranges(hc)
    scale = _scale_piece(pre_scale, 0, 3)
    base = _param(_base_piece(pre_base, ranges["pre"]), ((2 + hc) * hc,), "base")
    pieces = {}
    for reader in [mixes, *users_of(mixes, aten.split_with_sizes.default)]:
        for user in reader.users:
            found = piece_of(user)
            if found is not None and found[0] is mixes and found[1] == len(shape(mixes)) - 1:
                pieces[(found[2], found[3])] = user
    if ranges["post"] not in pieces or ranges["comb"] not in pieces:
        raise NoMatch("hyper-connection: post / comb logits unused (not a hyper-connection's three outputs)")
    post = _match_post(pieces[ranges["post"]], scale, base, ranges["post"])
    comb, iters, exp_sum, reciprocal = _match_comb(pieces[ranges["comb"]], scale, base, hc, hc_eps)
    return dict(scale=scale, base=base, post=post, comb=comb, iters=iters, exp_sum_softmax=exp_sum,
                reciprocal_sinkhorn=reciprocal)


def _affine_user(w, scale, base, index, columns):
    """The (unique) user chain w * scale[index] + base[columns] of logits w: the add node."""
    mul = only_user(w, aten.mul.Tensor)
    add = only_user(mul, aten.add.Tensor) if mul is not None else None
    found = _affine(add) if add is not None else None
    if found is None or found[0] is not w and strip(found[0], VIEW_OPS) is not w:
        return None
    _, s, b = found
    if _scale_piece(s, index, 3) is not scale or _base_piece(b, columns, base) is not base:
        return None
    return add


def _match_post(w_post, scale, base, columns):
    add = _affine_user(w_post, scale, base, 1, columns)
    sig = _sigmoid_user(add) if add is not None else None
    post = only_user(sig, aten.mul.Tensor) if sig is not None else None
    if post is None or 2.0 not in [scalar_arg(a) for a in post.args]:
        raise NoMatch("hyper-connection: post is not 2 * sigmoid(w * scale[1] + base[n:2n])")
    return post


def _match_comb(w_comb, scale, base, hc, hc_eps):
    """softmax(view(w) * scale[2] + view(base[2n:]), -1) + eps (HF), or the affine map viewed afterwards (the
    official code), then the Sinkhorn steps."""
    columns = _ranges(hc)["comb"]
    view = only_user(w_comb, *VIEW_OPS)
    if view is not None:
        z = _affine_user(view, scale, base, 2, columns)
    else:
        add = _affine_user(w_comb, scale, base, 2, columns)
        z = only_user(add, *VIEW_OPS) if add is not None else None
    if z is None or not same_shape(shape(z)[-2:], (hc, hc)):
        raise NoMatch(f"hyper-connection: comb is not w * scale[2] + base[2n:] viewed as {hc} x {hc}")
    soft, exp_sum = _match_softmax(z)
    c = soft.users and only_user(soft, aten.add.Tensor)
    if not c or _add_const(c) is None or _add_const(c)[1] != hc_eps:
        raise NoMatch("hyper-connection: comb is not softmax(...) + hc_eps (the pre's eps)")
    rank = len(shape(c))
    steps, forms = [], set()
    while True:
        step = _sinkhorn_step(c, rank)
        if step is None:
            break
        axis, eps, c, reciprocal = step
        if eps != hc_eps:
            raise NoMatch(f"hyper-connection: Sinkhorn eps {eps} differs from hc_eps {hc_eps}")
        steps.append(axis)
        forms.add(reciprocal)
    if len(forms) > 1:
        raise NoMatch("hyper-connection: Sinkhorn steps mix divisions and products with 1 / (sum + eps); the op "
                      "rounds every step one way")
    expected = [rank - 2 if i % 2 == 0 else rank - 1 for i in range(len(steps))]
    if not steps or steps != expected or len(steps) % 2 == 0:
        names_ = ["col" if a == rank - 2 else "row" for a in steps]
        raise NoMatch(f"hyper-connection: Sinkhorn steps {names_ or 'none'} are not HF's col, (row, col)*")
    return c, (len(steps) + 1) // 2, exp_sum, forms == {True}


def _match_softmax(z):
    """softmax(z, -1) as `_softmax`, decomposed, or in Inductor's online form (CUDA), or exp(z) / sum(exp(z), -1)
    with no max subtracted (the op's `exp_sum_softmax` rounding): (its output, whether the last)."""
    rank = len(shape(z))
    soft = only_user(z, aten._softmax.default)
    if soft is not None and _dim(soft.args[1], rank) == rank - 1:
        return soft, False
    parts = softmax_parts(z)
    if parts is not None:
        return parts["probs"], False
    # exp(z) may be computed twice, for the numerator and for the sum: the same values
    exps = [u for u in z.users if is_op(u, aten.exp.default)]
    readers = [u for e in exps for u in e.users]
    totals = [u for u in readers if is_op(u, aten.sum.dim_IntList) and _reduce_dims(u) == ([rank - 1], True)]
    quotients = [u for u in readers if is_op(u, aten.div.Tensor) and len(totals) == 1 and u.args[1] is totals[0]]
    if len(z.users) != len(exps) or len(exps) > 2 or len(totals) != 1 or len(quotients) != 1 \
            or len(readers) != 2 or quotients[0].args[0] not in exps:
        raise NoMatch("hyper-connection: comb is not a softmax over the last dim")
    return quotients[0], True


def _sinkhorn_step(c, rank):
    """c / (sum(c, axis, keepdim) + eps) among c's users, or c * (1 / (sum + eps)) (the op's `reciprocal_sinkhorn`
    rounding): (axis, eps, the result, whether the product), or None."""
    for total in c.users:
        if not is_op(total, aten.sum.dim_IntList):
            continue
        dims, keepdim = _reduce_dims(total)
        add = only_user(total, aten.add.Tensor)
        found = _add_const(add) if add is not None else None
        if not (keepdim and len(dims) == 1 and found):
            continue
        div = only_user(add, aten.div.Tensor)
        if div is not None and div.args == (c, add):
            return dims[0], found[1], div, False
        inverse = only_user(add, aten.reciprocal.default)
        product = only_user(inverse, aten.mul.Tensor) if inverse is not None else None
        if product is not None and set(product.args) == {c, inverse}:
            return dims[0], found[1], product, True
    return None


def _collapsed_output(total, x):
    """The collapse's value in x's dtype, `sum.to(x.dtype)` (the sum itself when x is fp32): (node, upcast).
    With `upcast`, the sum is read only in fp32: Inductor's `pointless_convert` dropped HF's round trip
    `.to(x.dtype)` then `.float()` of the next norm (as it does on CUDA); the fused op still rounds, as HF does,
    and its value is upcast for those readers."""
    if dtype(x) == dtype(total):
        return total, False
    cast = only_user(total, CONVERT)
    if cast is not None and cast.args[1] == dtype(x):
        return cast, False
    if dtype(total) == torch.float32 and dtype(x) in (torch.bfloat16, torch.float16) and not any(
            is_op(u, CONVERT) for u in total.users):
        return total, True
    raise NoMatch(f"hyper-connection collapse: the fp32 sum is not cast back to the streams' {dtype(x)}")


# --------------------------------------------------------------------------------------------
# Rewrite: the collapse
# --------------------------------------------------------------------------------------------
def _rewrite_collapse(graph: torch.fx.Graph, total: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    replaced = [m["output"]] if m["head"] else [m["output"], m["post"], m["comb"]]
    first = m["before"]
    for node in m["hoisted"]:
        first.prepend(node)
    x = _as_streams(graph, first, m["x"], m["streams_shape"])
    if m["head"]:
        call = insert_call(graph, first, HC_HEAD, (x, m["fn"], m["base"], m["scale"], m["norm_eps"], m["hc_eps"]))
        m["output"].replace_all_uses_with(_as_read(graph, call, m))
        ctx.site(total, "dsfuse.hc_head", [x, m["fn"]], f"n={m['hc']} D={m['hidden']}{_upcast_note(m)}", call=call)
        return
    call = insert_call(graph, first, HC_COLLAPSE, (x, m["fn"], m["base"], m["scale"], m["norm_eps"], m["hc_eps"],
                                                  m["iters"], m["exp_sum_softmax"], m["reciprocal_sinkhorn"]))
    outputs = []
    with graph.inserting_after(call):
        for i in range(3):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta["val"] = call.meta["val"][i]
            outputs.append(item)
    outputs[0] = _as_read(graph, outputs[0], m)
    for node, item in zip(replaced, outputs):
        node.replace_all_uses_with(item)
    forms = [name for name in ("exp_sum_softmax", "reciprocal_sinkhorn") if m[name]]
    ctx.site(total, "dsfuse.hc_collapse", [x, m["fn"]],
             f"n={m['hc']} D={m['hidden']} sinkhorn_iters={m['iters']}{''.join(' ' + f for f in forms)}"
             f"{_upcast_note(m)}", call=call)


def _as_streams(graph: torch.fx.Graph, before: torch.fx.Node, node: torch.fx.Node, streams_shape) -> torch.fx.Node:
    """`node` as the ops take the streams, [*, n, D]: a view inserted before `before` where it holds them flattened
    (the graph had folded its view into the reader's)."""
    if same_shape(shape(node), streams_shape):
        return node
    return insert_call(graph, before, aten.view.default, (node, list(streams_shape)))


def _as_read(graph: torch.fx.Graph, collapsed: torch.fx.Node, m: dict) -> torch.fx.Node:
    """The collapsed value as the graph reads it: viewed as the replaced node's shape where the graph had merged
    its token dims, upcast to fp32 where Inductor had dropped HF's round trip."""
    if not same_shape(shape(collapsed), shape(m["output"])):
        with graph.inserting_after(collapsed):
            view = graph.call_function(aten.view.default, (collapsed, list(shape(m["output"]))))
        view.meta["val"] = fake_call(aten.view.default, (collapsed, list(shape(m["output"]))))
        collapsed = view
    if not m["upcast"]:
        return collapsed
    with graph.inserting_after(collapsed):
        up = graph.call_function(CONVERT, (collapsed, torch.float32))
    up.meta["val"] = fake_call(CONVERT, (collapsed, torch.float32))
    return up


def _upcast_note(m: dict) -> str:
    if not m["upcast"]:
        return ""
    return f", rounded to {dtype(m['x'])} as HF's .to(dtype) (Inductor had dropped the round trip)"


# --------------------------------------------------------------------------------------------
# Binding: the block exit
# --------------------------------------------------------------------------------------------
def _hc_output(node, index):
    """getitem(hc_collapse call, index) through casts: the call, or None."""
    found = _getitem_of(strip(node, CASTS), HC_COLLAPSE)
    return found[0] if found is not None and found[1] == index else None


def _expanded_post(node):
    """unsqueeze(post, -1) * unsqueeze(out, -2): (post's hc_collapse call, post cast node, out)."""
    ops = _operands(node, aten.mul.Tensor)
    if ops is None:
        return None
    for p, o in (ops, ops[::-1]):
        if not (is_op(p, aten.unsqueeze.default) and is_op(o, aten.unsqueeze.default)):
            continue
        rank = len(shape(node))
        call = _hc_output(p.args[0], 1)
        if call is not None and _dim(p.args[1], rank) == rank - 1 and _dim(o.args[1], rank) == rank - 2:
            return call, p.args[0], o.args[0]
    return None


def _mix_labels(core, comb, comb_ops, residual, residual_ops, comb_dims, streams_shape):
    """Labels of the mix `core` computes from comb (its [n, n] dims labelled `comb_dims`) and residual (j, d; held
    as [*, n, D] or flattened), or None: a bmm contracting j, or a product of the two broadcast and summed over j."""
    lead = _lead_names(len(streams_shape) - 2)
    a = _follow(leaf_labels(comb, lead + comb_dims), comb_ops)
    b = _follow(_stream_labels(residual, streams_shape, "j", "d"), residual_ops)
    if a is None or b is None:
        return None
    if canonical_bmm(core) is not None:
        return bmm_labels(a, b) if names([contracted(a, b)]) == [("j",)] else None
    product = broadcast(a, b)
    dims, keepdim = _reduce_dims(core)
    if product is None or keepdim or len(dims) != 1 or names([product[dims[0]]]) != [("j",)]:
        return None
    return product[:dims[0]] + product[dims[0] + 1:]


def _comb_mix(mixed, call, streams_shape):
    """(comb operand, residual) when `mixed` is comb^T @ residual per token, comb one of `call`'s outputs: a bmm
    (`matmul`, `einsum`, `.mT`) or the broadcast sum `sum(comb[..., :, :, None] * residual[..., :, None, :], -3)`
    (the official `hc_post`), dims followed through layout ops."""
    # a batch-1 bmm that CUDA computes as `mm(...)[None]` is recorded on its unsqueeze: the walk stops there
    chain = walk_back(mixed, lambda n: is_op(n, *LAYOUT_OPS) and canonical_bmm(n) is None)
    core, out_ops = chain[0], chain[1:]
    if canonical_bmm(core) is not None:
        pairs = [canonical_bmm(core)]
    elif is_op(core, aten.sum.dim_IntList) and _operands(core.args[0], aten.mul.Tensor) is not None:
        if dtype(core.args[0]) != torch.float32:
            raise NoMatch(f"hyper-connection exit: comb^T @ residual is a sum of {dtype(core.args[0])} products (each "
                          "rounded), HF's matmul sums exact products")
        pairs = [core.args[0].args, core.args[0].args[::-1]]
    else:
        raise NoMatch(f"hyper-connection exit: post * out is added to {core.target}, not to comb^T @ residual")
    for comb_operand, residual_operand in pairs:
        comb, comb_ops = layout_chain(comb_operand)
        residual, residual_ops = _nearest(residual_operand, lambda n: same_shape(shape(n), streams_shape))
        if _hc_output(comb, 2) is call and _stream_labels(residual, streams_shape, "j", "d") is None:
            raise NoMatch(f"hyper-connection exit: comb^T mixes streams held neither as {list(streams_shape)} nor "
                          f"flattened (read from {list(shape(residual))})")
        if _hc_output(comb, 2) is None or len(shape(comb)) != len(streams_shape):
            continue
        if _hc_output(comb, 2) is not call:
            raise NoMatch("hyper-connection exit: post and comb come from different hyper-connections")
        expected = [(name,) if not same_size(size, 1) else ()
                    for name, size in zip(_lead_names(len(streams_shape) - 2) + ["k", "d"], streams_shape)]
        for comb_dims, transposed in ((["j", "k"], True), (["k", "j"], False)):
            labels = _mix_labels(core, comb, comb_ops, residual, residual_ops, comb_dims, streams_shape)
            labels = _follow(labels, out_ops)
            if labels is not None and names(labels) == expected:
                if not transposed:
                    raise NoMatch("hyper-connection exit: the mix does not read comb transposed")
                return comb, residual
    raise NoMatch("hyper-connection exit: post * out is added to something other than comb^T @ residual")


def _match_expand_mix(add: torch.fx.Node) -> dict:
    ops = _operands(add, aten.add.Tensor)
    if ops is None:
        raise NoMatch("not a tensor add", reported=False)
    for expanded, mixed in (ops, ops[::-1]):
        found = _expanded_post(expanded)
        if found is not None:
            break
    else:
        raise NoMatch("no hyper-connection post", reported=False)
    call, post_cast, out = found
    comb_cast, residual = _comb_mix(mixed, call, shape(add))
    m = dict(call=call, out=out, residual=residual, post=strip(post_cast, CASTS), comb=strip(comb_cast, CASTS))
    hc, hidden = shape(call.args[0])[-2:]
    rdtype = dtype(residual)
    if _stream_labels(residual, shape(add), "j", "d") is None \
            or not same_shape(shape(out), shape(add)[:-2] + (hidden,)):
        raise NoMatch(f"hyper-connection exit: residual {list(shape(residual))} / out {list(shape(out))} do not "
                      f"match the new streams {list(shape(add))}")
    if dtype(out) != rdtype or dtype(post_cast) != rdtype or dtype(comb_cast) != rdtype or dtype(add) != rdtype:
        raise NoMatch(f"hyper-connection exit: mixes out {dtype(out)}, post {dtype(post_cast)}, comb "
                      f"{dtype(comb_cast)} into {dtype(add)} streams, HF casts all to the streams' {rdtype}")
    if not same_shape(shape(residual), shape(add)) and not all(isinstance(size, int) for size in shape(add)):
        raise NoMatch(f"hyper-connection exit: residual held only flattened as {list(shape(residual))}, a view to "
                      "[*, n, D] the pass builds for static shapes only")
    m.update(hc=hc, hidden=hidden)
    verdict = _verify_expand_mix(add, m)
    if verdict.ok is False:
        raise NoMatch(f"hyper-connection exit: numeric check against the reference failed: {verdict.reason}")
    return m


# --------------------------------------------------------------------------------------------
# Rewrite: the block exit
# --------------------------------------------------------------------------------------------
def _rewrite_expand_mix(graph: torch.fx.Graph, add: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    items = {u.args[1]: u for u in m["call"].users if is_op(u, operator.getitem)}
    residual = _as_streams(graph, add, m["residual"], shape(add))
    node = insert_call(graph, add, HC_EXPAND_MIX, (m["out"], residual, items[1], items[2]))
    add.replace_all_uses_with(node)
    ctx.site(add, "dsfuse.hc_expand_mix", [m["out"], m["residual"]], f"n={m['hc']} D={m['hidden']}", call=node)


# --------------------------------------------------------------------------------------------
# Verification: the matched slice run on probes against the ops' references (`verify.py`)
# --------------------------------------------------------------------------------------------
# An output may differ from its op's reference by this many ulps of its dtype at its largest magnitude: fp32
# outputs (post, comb, an fp32 collapse or exit) by the summation order of a spelling's projection, collapse or mix
# (an einsum, the rsqrt after the dot) carried through the sigmoid, softmax and Sinkhorn; a bf16 / fp16 output by
# a rounding that order flips, or two (the exit's product or mix, then its add).
ULPS = {torch.float32: 128, torch.bfloat16: 2, torch.float16: 2}
# Scales of the probe with large logits (the sigmoids saturated, the softmax peaked; one scale negative).
LARGE_SCALES = (12.0, -10.0, 8.0)


def _verify_collapse(m: dict) -> Verdict:
    """Run the slice from the streams (the tensor the norm and the collapse both read, before its views and casts),
    fn, base and scale to the outputs the call replaces on probes against `hc_collapse_reference` /
    `hc_head_reference` with the walk's eps values, iterations and flags."""
    chain = walk_back(m["x"], _is_view_or_cast)
    roles = {"x": chain[0], "fn": m["fn"], "base": m["base"], "scale": m["scale"]}
    if len(set(roles.values())) != len(roles):
        return Verdict(False, "two roles of the op are bound to one tensor")
    casts = tuple(node.args[1] for node in chain[1:] if is_op(node, CONVERT))
    head = m["head"]
    outputs = [m["output"]] if head else [m["output"], m["post"], m["comb"]]
    iters = 0 if head else m["iters"]
    settings = ("head" if head else "collapse", m["hc"], m["hidden"], m["norm_eps"], m["hc_eps"], iters,
                m.get("exp_sum_softmax"), m.get("reciprocal_sinkhorn"), m["upcast"], casts)
    family = Family(probes=_collapse_probes, reference=lambda probe: _collapse_reference(probe, m, casts),
                    compare=lambda got, want, probe: _within_ulps(got, want, ("collapsed", "post", "comb"),
                                                                  m["upcast"]))
    return verify(outputs, roles, family, settings, max_nodes=MAX_NODES + 8 * iters)


def _collapse_probes(shapes: dict, dtypes: dict) -> list:
    """Streams of every sign, fn scaled so the logits are about unit-sized, then two settings of scale and base:
    moderate, and large with a negative scale (saturated sigmoids, a peaked softmax)."""
    gen = torch.Generator().manual_seed(0)
    rows, width = shapes["fn"]
    x = torch.randn(shapes["x"], generator=gen) * 2
    fn = torch.randn(rows, width, generator=gen) * 2 / width ** 0.5
    base = torch.randn(shapes["base"], generator=gen)
    scale = torch.rand(shapes["scale"], generator=gen) + 0.5
    large = torch.tensor(LARGE_SCALES[:shapes["scale"][0]])
    probes = [("random", dict(x=x, fn=fn, base=base, scale=scale)),
              ("large logits", dict(x=x, fn=fn, base=base * 8, scale=large))]
    return [(name, {role: t.to(dtypes[role]) for role, t in probe.items()}) for name, probe in probes]


def _collapse_reference(probe: dict, m: dict, casts: tuple):
    """The op's reference on the probe's streams as the call reads them: the casts between the bound tensor and the
    collapse's streams applied, viewed as [T, n, D] (the slice's outputs are compared in their own shapes)."""
    x = probe["x"]
    for cast in casts:
        x = x.to(cast)
    x = x.reshape(-1, m["hc"], m["hidden"])
    if m["head"]:
        return hc_head_reference(x, probe["fn"], probe["base"], probe["scale"], m["norm_eps"], m["hc_eps"])
    return hc_collapse_reference(x, probe["fn"], probe["base"], probe["scale"], m["norm_eps"], m["hc_eps"],
                                 m["iters"], m["exp_sum_softmax"], m["reciprocal_sinkhorn"])


def _verify_expand_mix(add: torch.fx.Node, m: dict) -> Verdict:
    """Run the exit's slice from out, the residual and the collapse's post and comb to the new streams on probes
    against `hc_expand_mix_reference`."""
    roles = {"out": m["out"], "residual": m["residual"], "post": m["post"], "comb": m["comb"]}
    if len(set(roles.values())) != len(roles):
        return Verdict(False, "two roles of the op are bound to one tensor")
    hc, hidden = m["hc"], m["hidden"]
    family = Family(probes=_exit_probes, reference=lambda probe: _exit_reference(probe, hc, hidden),
                    compare=lambda got, want, probe: _within_ulps(got, want, ("streams",)))
    return verify([add], roles, family, ("exit", hc, hidden))


def _exit_probes(shapes: dict, dtypes: dict) -> list:
    """The block output and residual of every sign with the weights a collapse gives (post in (0, 2), comb in
    (0, 1)), then post and comb of every sign."""
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(shapes["out"], generator=gen) * 2
    residual = torch.randn(shapes["residual"], generator=gen) * 2
    post, comb = torch.rand(shapes["post"], generator=gen) * 2, torch.rand(shapes["comb"], generator=gen)
    probes = [("collapse weights", dict(out=out, residual=residual, post=post, comb=comb)),
              ("signed weights", dict(out=out, residual=residual, post=post - 1, comb=comb * 2 - 1))]
    return [(name, {role: t.to(dtypes[role]) for role, t in probe.items()}) for name, probe in probes]


def _exit_reference(probe: dict, hc: int, hidden: int) -> torch.Tensor:
    """`hc_expand_mix_reference` on the probe, the residual viewed as [*, n, D] where it is held flattened and the
    other operands viewed to its tokens."""
    residual = probe["residual"]
    if residual.shape[-1] == hc * hidden:
        residual = residual.reshape(*residual.shape[:-1], hc, hidden)
    lead = residual.shape[:-2]
    return hc_expand_mix_reference(probe["out"].reshape(*lead, hidden), residual, probe["post"].reshape(*lead, hc),
                                   probe["comb"].reshape(*lead, hc, hc))


def _within_ulps(got: list, want, names: tuple, rounded_first: bool = False) -> str | None:
    """None when each output has the reference's values (in the reference's shape) within `ULPS` of its dtype
    at its largest magnitude, else what differs. `rounded_first`: the first output is the fp32 sum the fused op
    rounds to the streams' dtype (Inductor had dropped HF's round trip), compared after that rounding."""
    wants = list(want) if isinstance(want, (tuple, list)) else [want]
    for i, (name, out, ref) in enumerate(zip(names, got, wants)):
        if not isinstance(out, torch.Tensor) or out.numel() != ref.numel():
            return f"{name} is not a tensor of the reference's {ref.numel()} values"
        if i == 0 and rounded_first:
            out = out.to(ref.dtype)
        if out.dtype != ref.dtype:
            return f"{name} in {out.dtype}, the op's in {ref.dtype}"
        miss = ulps_beyond(out, ref, ULPS[ref.dtype], "tensor")
        if miss is not None:
            return f"{name} {miss}"
    return None
