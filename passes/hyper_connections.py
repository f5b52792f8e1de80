"""`hyper_connections`: DeepSeek V4's manifold-constrained hyper-connections (HF `DeepseekV4HyperConnection`,
`DeepseekV4HyperHead`, and the expand + mix of `DeepseekV4DecoderLayer.forward`) rewritten into
`dsfuse::hc_collapse` / `dsfuse::hc_head` and `dsfuse::hc_expand_mix`.

The anchor is the collapse, `sum(unsqueeze(pre, -1) * x, stream_dim)` (then `.to(x.dtype)`), where x is the
[*, n, D] streams and `pre` traces back (through views and casts) to

    pre    = sigmoid(w * scale + b) + hc_eps
    w      = split(mixes, [n, n, n*n], -1)[0]            (hyper-connection; the head: w = mixes, n columns)
    mixes  = view(mm(view(h), fn^T))                      (F.linear in fp32)
    h      = a * rsqrt(mean(a^2, -1, keepdim) + eps)      (unweighted RMSNorm; a = x.flatten(-2).float())

For a hyper-connection the other two pieces of the same split are then proven:

    post   = 2 * sigmoid(split[1] * scale[1] + base[n:2n])
    comb   = softmax(view(split[2], n, n) * scale[2] + view(base[2n:], n, n), -1) + hc_eps, then Sinkhorn:
             a column step c / (sum(c, -2, keepdim) + hc_eps), then (iters - 1) row + column steps,

where the chain of steps is walked to its end (the Sinkhorn loop is unrolled in the graph: any iteration
count), and it must alternate column, row, ..., column with the same eps, as HF's loop does. The collapse,
`post` and `comb` are replaced by the outputs of one `hc_collapse` call.

Then the block exits: `post.to(dtype)[..., None] * out[..., None, :] + bmm(comb.to(dtype)^T, residual)` (the
`matmul` as Inductor lowers it: views and no-op expands around a `bmm`) whose post and comb are one
`hc_collapse` call's outputs become one `hc_expand_mix` call.

The exit and the next collapse stay two launches: one kernel computing both (`hc_exit_collapse` /
`hc_exit_head`) measured slower on the H200 than the two it replaces (1.71 against 0.16 + 0.65 ms at T=8192,
D=4096: its collapse walks each row block's whole streams in one program), so the pass does not emit it.
"""

from __future__ import annotations

import operator

import torch

import dsfuse.kernels.hyper_connections  # noqa: F401  (registers torch.ops.dsfuse.hc_*)

from .canonicalize import canonical_bmm
from .context import NoMatch, PassContext, rewrite_anchored
from .graph_utils import (CONVERT, VIEW_OPS, aten, dtype, fake_call, insert_call, is_op, only_user, op_name,
                          same_shape, scalar_arg, shape, softmax_parts, strip)

NAME = "hyper_connections"
IMPLEMENTED = True

HC_COLLAPSE = torch.ops.dsfuse.hc_collapse.default
HC_HEAD = torch.ops.dsfuse.hc_head.default
HC_EXPAND_MIX = torch.ops.dsfuse.hc_expand_mix.default


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, (aten.sum.dim_IntList,), _match_collapse, _rewrite_collapse)
    rewrite_anchored(graph, ctx, (aten.add.Tensor,), _match_expand_mix, _rewrite_expand_mix)


# --------------------------------------------------------------------------------------------
# Small structural helpers
# --------------------------------------------------------------------------------------------
def _strip_casts(node):
    return strip(node, (CONVERT,))


def _strip_layout(node):
    """Through views, casts and no-op expands."""
    while True:
        if is_op(node, CONVERT, *VIEW_OPS):
            node = node.args[0]
        elif is_op(node, aten.expand.default) and same_shape(shape(node.args[0]), shape(node)):
            node = node.args[0]
        else:
            return node


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


# --------------------------------------------------------------------------------------------
# The collapse and what it proves
# --------------------------------------------------------------------------------------------
def _pre_source(factor):
    """unsqueeze(pre, -1) (pre through casts): pre, else None."""
    if not is_op(factor, aten.unsqueeze.default):
        return None
    rank = len(shape(factor))
    if _dim(factor.args[1], rank) != rank - 1:
        return None
    return _strip_casts(factor.args[0])


def _is_sigmoid_plus_eps(node) -> bool:
    found = _add_const(node)
    return found is not None and is_op(_strip_casts(found[0]), aten.sigmoid.default)


def _match_collapse(total: torch.fx.Node) -> dict:
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
    pre = _pre_source(factor)
    x = _strip_casts(streams_operand)
    if dims != [rank - 2] or not same_shape(shape(x), shape(prod)):
        raise NoMatch("a sum of sigmoid-weighted values that is not a collapse over the stream dim", reported=False)
    hc, hidden = shape(x)[-2], shape(x)[-1]
    if not isinstance(hc, int) or not isinstance(hidden, int):
        raise NoMatch(f"hyper-connection collapse: stream count {hc} / hidden {hidden} not static")
    sig_arg, hc_eps = _add_const(pre)
    z = _strip_casts(sig_arg).args[0]
    found = _affine(z)
    if found is None:
        raise NoMatch("hyper-connection collapse: pre is not sigmoid(w * scale + base) + eps")
    w, scale_node, base_node = found
    head = not is_op(w, operator.getitem)
    mixes = w if head else _mixes_of_split(w, hc)
    norm = _match_projection(mixes, x, hc, hidden, head)
    m = dict(x=x, hc=hc, hidden=hidden, hc_eps=hc_eps, head=head, norm_eps=norm["eps"], fn=norm["fn"], total=total)
    if head:
        m.update(scale=_param(scale_node, (1,), "scale"), base=_param(base_node, (hc,), "base"))
    else:
        m.update(_match_mixing(w, scale_node, base_node, hc, hc_eps))
    m["output"], m["upcast"] = _collapsed_output(total, x)
    return m


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
    node = _strip_casts(node)
    if not same_shape(shape(node), expected_shape):
        raise NoMatch(f"hyper-connection: {name} {node} has shape {list(shape(node))}, expected {list(expected_shape)}")
    return node


def _mixes_of_split(w, hc):
    split, index = _getitem_of(w, aten.split_with_sizes.default) or (None, None)
    if split is None or index != 0:
        raise NoMatch("hyper-connection collapse: pre weights are not the first piece of a split of the mixes")
    sizes = list(split.args[1])
    dim = split.args[2] if len(split.args) > 2 else 0
    if sizes != [hc, hc, hc * hc] or _dim(dim, len(shape(split.args[0]))) != len(shape(split.args[0])) - 1:
        raise NoMatch(f"hyper-connection collapse: mixes split {sizes} (dim {dim}), expected [{hc}, {hc}, {hc * hc}] "
                      "over the last dim")
    return split.args[0]


def _match_projection(mixes, x, hc, hidden, head) -> dict:
    """mixes = view(mm(view(rmsnorm(view(x))), permute(fn))); returns fn and the norm's eps."""
    rows = hc if head else (2 + hc) * hc
    mm = strip(mixes, VIEW_OPS)
    if not is_op(mm, aten.mm.default):
        raise NoMatch(f"hyper-connection: mixing logits {mixes} are not an fp32 projection (mm)")
    lhs, rhs = mm.args
    if not is_op(rhs, aten.permute.default) or list(rhs.args[1]) != [1, 0]:
        raise NoMatch("hyper-connection: projection weight is not fn^T")
    fn = _param(rhs.args[0], (rows, hc * hidden), "fn")
    if dtype(mm) != torch.float32:
        raise NoMatch(f"hyper-connection: projection runs in {dtype(mm)}, HF's in fp32")
    normed = strip(lhs, VIEW_OPS)
    ops = _operands(normed, aten.mul.Tensor)
    if ops is None:
        raise NoMatch("hyper-connection: projection input is not x * rsqrt(mean(x^2) + eps)")
    picked = _split_off(ops, lambda r: is_op(_strip_casts(r), aten.rsqrt.default))
    if picked is None:
        raise NoMatch("hyper-connection: projection input is not x * rsqrt(mean(x^2) + eps)")
    rsqrt, a = picked
    found = _add_const(_strip_casts(rsqrt).args[0])
    mean = found[0] if found else None
    if not is_op(mean, aten.mean.dim) or _reduce_dims(mean) != ([len(shape(mean)) - 1], True):
        raise NoMatch("hyper-connection: norm is not rsqrt(mean(x^2, -1, keepdim) + eps)")
    sq = mean.args[0]
    if not (is_op(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2) and not (
            is_op(sq, aten.mul.Tensor) and sq.args[0] is sq.args[1]):
        raise NoMatch("hyper-connection: norm statistic is not a mean of squares")
    if _strip_layout(sq.args[0]) is not _strip_layout(a):
        raise NoMatch("hyper-connection: the norm's square and its scaled value read different tensors")
    if _strip_layout(a) is not _strip_layout(x):
        raise NoMatch("hyper-connection: the norm reads other values than the collapsed streams")
    if dtype(a) != torch.float32 or not same_shape(shape(a)[-1:], (hc * hidden,)):
        raise NoMatch(f"hyper-connection: norm over {list(shape(a))} in {dtype(a)}, expected the flattened "
                      f"{hc} x {hidden} streams in fp32")
    if not same_shape(shape(a)[:-1], shape(x)[:-2]):
        raise NoMatch("hyper-connection: norm rows are not the streams' tokens")
    return dict(fn=fn, eps=found[1])


def _scale_piece(node, index, count):
    """getitem(unbind(scale), index) (through casts): scale."""
    found = _getitem_of(_strip_casts(node), aten.unbind.int)
    if found is None or found[1] != index:
        raise NoMatch(f"hyper-connection: scale {node} is not scale.unbind(0)[{index}]")
    scale = _param(found[0].args[0], (count,), "scale")
    return scale


def _base_piece(node, index, base=None):
    node = strip(node, VIEW_OPS)
    found = _getitem_of(node, aten.split_with_sizes.default)
    if found is None or found[1] != index:
        raise NoMatch(f"hyper-connection: bias {node} is not base.split(...)[{index}]")
    src = _strip_casts(found[0].args[0])
    if base is not None and src is not base:
        raise NoMatch("hyper-connection: pre, post and comb biases come from different tensors")
    return src, list(found[0].args[1])


def _match_mixing(w_pre, pre_scale, pre_base, hc, hc_eps) -> dict:
    split = w_pre.args[0]
    scale = _scale_piece(pre_scale, 0, 3)
    base, sizes = _base_piece(pre_base, 0)
    if sizes != [hc, hc, hc * hc]:
        raise NoMatch(f"hyper-connection: bias split {sizes}, expected [{hc}, {hc}, {hc * hc}]")
    base = _param(base, ((2 + hc) * hc,), "base")
    pieces = {u.args[1]: u for u in split.users if is_op(u, operator.getitem)}
    if set(pieces) != {0, 1, 2}:
        raise NoMatch("hyper-connection: post / comb logits unused (not a hyper-connection's three outputs)")
    post = _match_post(pieces[1], scale, base)
    comb, iters = _match_comb(pieces[2], scale, base, hc, hc_eps)
    return dict(scale=scale, base=base, post=post, comb=comb, iters=iters)


def _affine_user(w, scale, base, index):
    """The (unique) user chain w * scale[index] + base[index] of logits w: the add node."""
    mul = only_user(w, aten.mul.Tensor)
    add = only_user(mul, aten.add.Tensor) if mul is not None else None
    found = _affine(add) if add is not None else None
    if found is None or found[0] is not w and strip(found[0], VIEW_OPS) is not w:
        return None
    _, s, b = found
    if _scale_piece(s, index, 3) is not scale or _base_piece(b, index, base)[0] is not base:
        return None
    return add


def _match_post(w_post, scale, base):
    add = _affine_user(w_post, scale, base, 1)
    sig = only_user(add, aten.sigmoid.default) if add is not None else None
    post = only_user(sig, aten.mul.Tensor) if sig is not None else None
    if post is None or 2.0 not in [scalar_arg(a) for a in post.args]:
        raise NoMatch("hyper-connection: post is not 2 * sigmoid(w * scale[1] + base[n:2n])")
    return post


def _match_comb(w_comb, scale, base, hc, hc_eps):
    view = only_user(w_comb, *VIEW_OPS)
    if view is None or not same_shape(shape(view)[-2:], (hc, hc)):
        raise NoMatch(f"hyper-connection: comb logits are not viewed as {hc} x {hc}")
    add = _affine_user(view, scale, base, 2)
    if add is None:
        raise NoMatch("hyper-connection: comb is not w * scale[2] + base[2n:]")
    soft = _match_softmax(add)
    c = soft.users and only_user(soft, aten.add.Tensor)
    if not c or _add_const(c) is None or _add_const(c)[1] != hc_eps:
        raise NoMatch("hyper-connection: comb is not softmax(...) + hc_eps (the pre's eps)")
    rank = len(shape(c))
    steps = []
    while True:
        step = _sinkhorn_step(c, rank)
        if step is None:
            break
        axis, eps, c = step
        if eps != hc_eps:
            raise NoMatch(f"hyper-connection: Sinkhorn eps {eps} differs from hc_eps {hc_eps}")
        steps.append(axis)
    expected = [rank - 2 if i % 2 == 0 else rank - 1 for i in range(len(steps))]
    if not steps or steps != expected or len(steps) % 2 == 0:
        names = ["col" if a == rank - 2 else "row" for a in steps]
        raise NoMatch(f"hyper-connection: Sinkhorn steps {names or 'none'} are not HF's col, (row, col)*")
    return c, (len(steps) + 1) // 2


def _match_softmax(z):
    """softmax(z, -1) as `_softmax`, decomposed, or in Inductor's online form (CUDA): its output."""
    rank = len(shape(z))
    soft = only_user(z, aten._softmax.default)
    if soft is not None and _dim(soft.args[1], rank) == rank - 1:
        return soft
    parts = softmax_parts(z)
    if parts is None:
        raise NoMatch("hyper-connection: comb is not a softmax over the last dim")
    return parts["probs"]


def _sinkhorn_step(c, rank):
    """c / (sum(c, axis, keepdim) + eps) among c's users: (axis, eps, the quotient), or None."""
    for total in c.users:
        if not is_op(total, aten.sum.dim_IntList):
            continue
        dims, keepdim = _reduce_dims(total)
        add = only_user(total, aten.add.Tensor)
        found = _add_const(add) if add is not None else None
        div = only_user(add, aten.div.Tensor) if found else None
        if keepdim and len(dims) == 1 and div is not None and div.args == (c, add):
            return dims[0], found[1], div
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


def _rewrite_collapse(graph: torch.fx.Graph, total: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    x = m["x"]
    replaced = [m["output"]] if m["head"] else [m["output"], m["post"], m["comb"]]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(replaced, key=order.__getitem__)
    if m["head"]:
        call = insert_call(graph, first, HC_HEAD, (x, m["fn"], m["base"], m["scale"], m["norm_eps"], m["hc_eps"]))
        m["output"].replace_all_uses_with(_as_read(graph, call, m))
        ctx.site(total, "dsfuse.hc_head", [x, m["fn"]], f"n={m['hc']} D={m['hidden']}{_upcast_note(m)}", call=call)
        return
    call = insert_call(graph, first, HC_COLLAPSE,
                       (x, m["fn"], m["base"], m["scale"], m["norm_eps"], m["hc_eps"], m["iters"]))
    outputs = []
    with graph.inserting_after(call):
        for i in range(3):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta["val"] = call.meta["val"][i]
            outputs.append(item)
    outputs[0] = _as_read(graph, outputs[0], m)
    for node, item in zip(replaced, outputs):
        node.replace_all_uses_with(item)
    ctx.site(total, "dsfuse.hc_collapse", [x, m["fn"]],
             f"n={m['hc']} D={m['hidden']} sinkhorn_iters={m['iters']}{_upcast_note(m)}", call=call)


def _as_read(graph: torch.fx.Graph, collapsed: torch.fx.Node, m: dict) -> torch.fx.Node:
    """The collapsed value as the graph reads it: upcast to fp32 where Inductor had dropped HF's round trip."""
    if not m["upcast"]:
        return collapsed
    with graph.inserting_after(collapsed):
        up = graph.call_function(CONVERT, (collapsed, torch.float32))
    up.meta["val"] = fake_call(CONVERT, (collapsed, torch.float32))
    return up


def _upcast_note(m: dict) -> str:
    return f", rounded to {dtype(m['x'])} as HF's .to(dtype) (Inductor had dropped the round trip)" if m["upcast"] else ""


# --------------------------------------------------------------------------------------------
# The block exit
# --------------------------------------------------------------------------------------------
def _hc_output(node, index):
    """getitem(hc_collapse call, index) through casts: the call, or None."""
    found = _getitem_of(_strip_casts(node), HC_COLLAPSE)
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
    mix = strip(mixed, VIEW_OPS)
    operands = canonical_bmm(mix)
    if operands is None:
        raise NoMatch(f"hyper-connection exit: post * out is added to {op_name(mix)}, not to comb^T @ residual "
                      "(a bmm)")
    lhs, rhs = (_strip_layout(a) for a in operands)
    permute = lhs
    rank = len(shape(permute))
    if not (is_op(permute, aten.permute.default)
            and list(permute.args[1]) == list(range(rank - 2)) + [rank - 1, rank - 2]):
        raise NoMatch("hyper-connection exit: the mix does not read comb transposed")
    comb_cast = permute.args[0]
    if _hc_output(comb_cast, 2) is not call:
        raise NoMatch("hyper-connection exit: post and comb come from different hyper-connections")
    residual = rhs
    hc, hidden = shape(call.args[0])[-2:]
    rdtype = dtype(residual)
    if not same_shape(shape(residual), shape(add)) or not same_shape(shape(out), shape(add)[:-2] + (hidden,)):
        raise NoMatch(f"hyper-connection exit: residual {list(shape(residual))} / out {list(shape(out))} do not "
                      f"match the new streams {list(shape(add))}")
    if dtype(out) != rdtype or dtype(post_cast) != rdtype or dtype(comb_cast) != rdtype or dtype(add) != rdtype:
        raise NoMatch(f"hyper-connection exit: mixes out {dtype(out)}, post {dtype(post_cast)}, comb "
                      f"{dtype(comb_cast)} into {dtype(add)} streams, HF casts all to the streams' {rdtype}")
    return dict(call=call, out=out, residual=residual, hc=hc, hidden=hidden)


def _rewrite_expand_mix(graph: torch.fx.Graph, add: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    items = {u.args[1]: u for u in m["call"].users if is_op(u, operator.getitem)}
    node = insert_call(graph, add, HC_EXPAND_MIX, (m["out"], m["residual"], items[1], items[2]))
    add.replace_all_uses_with(node)
    ctx.site(add, "dsfuse.hc_expand_mix", [m["out"], m["residual"]], f"n={m['hc']} D={m['hidden']}", call=node)
