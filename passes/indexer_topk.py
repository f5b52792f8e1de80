"""`indexer_topk`: the DSA lightning indexer (scores -> relu -> head-weighted sum -> mask -> top-k)
rewritten into one `dsfuse::indexer_topk` call.

The anchor is an `aten.topk` over the last dim of a `[B, S, T]` tensor (or `[S, T]`: one sequence, as
vLLM's and SGLang's references write it). Walking back from it:

    topk(mask(k_scale[b,t]? * sum_h weights[b,s,h] * relu(scale * q[b,s,h,:] . k[b,t,:])))

`mask` is `where(c, -inf, x)` (the canonical polarity; a negated condition keeps), `x + additive` or
absent; the scale is a constant (chains of constant scalings are collected by the canonicaliser)
before relu or after it (equal for a positive constant); the product may put q or k first;
the head sum may be a bmm (HF's matmul, einsum) or a mul + sum; `q`/`k` may be fp32 upcasts of
bf16/fp16/fp8 tensors, which the kernel reads in their narrow form (when only one of them is narrow,
both are widened to fp32, which is exact). Which dims are contracted is checked by following them
through every reshape/permute/expand (`dims.py`), so any spelling of the same math matches and nothing
else does. Top-k values may only be compared with -inf (how official-style code marks picks of masked
keys as -1); that comparison is rebuilt from the mask.

The fused op returns each row's picks as a set; when anything may see their slot order (they leave
the graph, or are read slot by slot) and the top-k was sorted, the op is asked for `torch.topk`'s order.

A top-k whose input is not a head-weighted relu score is not an indexer and is skipped silently;
one that is but cannot be rewritten is reported with the reason.
"""

from __future__ import annotations

import operator

import torch

import dsfuse.kernels.indexer_topk  # noqa: F401  (registers torch.ops.dsfuse.indexer_topk)

from .canonicalize import canonical_scale
from .context import NoMatch, PassContext, rewrite_anchored
from .dims import (bmm_labels, broadcast, contracted, follow, layout_chain, leaf_labels, leaf_of_rank, names, normalise,
                   views_of_rank)
from .graph_utils import (CONVERT, NOT_OPS, UNSPECIALISED_FLOAT, aten, dtype, insert_call, is_neg_inf, is_op,
                          only_user, same_shape, same_size, scalar_arg, shape, size_arg, unspecialised_float)

NAME = "indexer_topk"
IMPLEMENTED = True

SCORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
# Batched products; Inductor turns a batch-1 bmm into squeeze -> mm -> unsqueeze on CUDA (decode at batch 1).
PRODUCTS = (aten.bmm.default, aten.mm.default)


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, (aten.topk.default,), _match, _rewrite)


def _topk_params(node: torch.fx.Node) -> tuple:
    names = ("self", "k", "dim", "largest", "sorted")
    defaults = {"dim": -1, "largest": True, "sorted": True}
    params = dict(zip(names, node.args))
    for name in names[2:]:
        params.setdefault(name, node.kwargs.get(name, defaults[name]))
    return params["self"], params["k"], params["dim"], params["largest"], params["sorted"]


# Ops that keep each index in its slot: what flows through them still shows the slot order.
SLOT_PRESERVING = {CONVERT, aten.unsqueeze.default, aten.squeeze.dim, aten.view.default, aten.reshape.default,
                   aten.expand.default, aten.where.self, aten.clamp.default, aten.clamp_min.default, aten.eq.Scalar,
                   aten.lt.Scalar, aten.ge.Scalar, aten.ne.Scalar, aten.ge.Tensor, aten.lt.Tensor, aten.gt.Tensor,
                   aten.le.Tensor, aten.eq.Tensor, aten.ne.Tensor, aten.clone.default}
# Consumers that use the indices as a set: writing one value at the picked slots does not see their order.
SET_CONSUMERS = {aten.scatter.value, aten.scatter_.value}


def _order_observed(getters: list[torch.fx.Node]) -> bool:
    """Whether anything may see the slot order of the top-k.

    The fused op returns each row's top-k as a set unless asked for `torch.topk`'s order. Scattering
    one value by index (HF's sparse masks) does not see the order; anything else might (a caller who
    receives the indices, a gather read slot by slot, a slot-wise mix with a tensor that varies along
    the slots, such as `arange(k) < n`), so the order is kept for it.
    """
    traced, frontier = set(getters), list(getters)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in traced:
                continue
            if user.target is operator.getitem or (
                    user.target in SLOT_PRESERVING and all(_slot_uniform(a, traced) for a in user.all_input_nodes)):
                traced.add(user)
                frontier.append(user)
            elif not (user.target in SET_CONSUMERS and user.args[2] is node and node not in user.args[:2]):
                return True
    return False


def _slot_uniform(node: torch.fx.Node, traced: set) -> bool:
    """An operand that is the top-k itself (or derived from it), a constant fill, or the same for every slot."""
    if node in traced or is_op(node, aten.full.default):
        return True
    dims = shape(node)
    return not dims or same_size(dims[-1], 1)


def _neg_inf(node) -> bool:
    return is_neg_inf(node.args[1] if is_op(node, aten.full.default) else scalar_arg(node))


def _split_mask(x: torch.fx.Node) -> tuple:
    """(scores, mask) where mask is ("keep", bool), ("drop", bool), ("add", float) or None.

    `where(c, -inf, x)` drops where c holds (HF `masked_fill`; canonicalize brings `where(c, x, -inf)` to
    this polarity); a negated condition keeps where its operand holds."""
    if is_op(x, aten.where.self):
        cond, fill, scores = x.args
        if not _neg_inf(fill):
            raise NoMatch("masked with a fill value other than -inf", reported=False)
        if is_op(cond, *NOT_OPS):
            return scores, ("keep", cond.args[0])
        return scores, ("drop", cond)
    if is_op(x, aten.add.Tensor) and all(isinstance(a, torch.fx.Node) for a in x.args):
        for scores, mask in (x.args, x.args[::-1]):
            if _head_sum(scores, probe=True) is not None:
                return scores, ("add", mask)
    return x, None


def _is_relu(node) -> bool:
    return is_op(node, aten.relu.default)  # `clamp_min(x, 0)` arrives as relu (canonicalize)


def _relu_side(node) -> tuple | None:
    """(relu, layout ops after it, scale after it): `relu(x)`, or `relu(x) * c` (V4's scorer), which
    equals relu(x * c) bit for bit when c > 0."""
    leaf, ops = layout_chain(node)
    if _is_relu(leaf):
        return leaf, ops, 1.0
    inner, scale = canonical_scale(leaf)
    inner_leaf, inner_ops = layout_chain(inner)
    if inner is not leaf and scale > 0 and _is_relu(inner_leaf):
        return inner_leaf, inner_ops + ops, scale
    return None


def _head_sum(scores: torch.fx.Node, probe: bool = False) -> dict | None:
    """Find `sum_h weights * relu(...)` (as a bmm or a mul + sum) under `scores`, with an optional
    per-key scale multiplied after the head sum. None if `scores` is not such a sum."""
    node, post_ops = layout_chain(scores)
    k_scale = None
    if is_op(node, aten.mul.Tensor) and all(isinstance(a, torch.fx.Node) for a in node.args):
        for inner, scale in (node.args, node.args[::-1]):
            found = _head_sum(inner, probe=True)
            if found is not None and found["k_scale"] is None:
                if probe:
                    return found
                found["k_scale"] = scale
                found["scale_then"] = post_ops
                return found
        return None
    if is_op(node, *PRODUCTS):
        for relu_pos in (1, 0):
            relu = _relu_side(node.args[relu_pos])
            if relu is not None:
                return dict(kind="bmm", relu_first=relu_pos == 0, sum_node=node, relu=relu,
                            weights=node.args[1 - relu_pos], post_ops=post_ops, k_scale=k_scale, scale_then=[])
        return None
    if is_op(node, aten.sum.dim_IntList) and is_op(node.args[0], aten.mul.Tensor):
        a, b = node.args[0].args
        for r, w in ((a, b), (b, a)):
            relu = _relu_side(r) if isinstance(r, torch.fx.Node) else None
            if relu is not None and isinstance(w, torch.fx.Node):
                return dict(kind="sum", sum_node=node, relu=relu, weights=w, post_ops=post_ops,
                            k_scale=k_scale, scale_then=[])
    return None


def _match(topk: torch.fx.Node) -> dict:
    x, k, dim, largest, ordered = _topk_params(topk)
    batched = len(shape(x)) == 3
    if len(shape(x)) not in (2, 3):
        raise NoMatch("top-k input is not [B, S, T] or [S, T]", reported=False)
    scores, mask = _split_mask(x)
    head = _head_sum(scores)
    if head is None:
        raise NoMatch("top-k input is not a head-weighted sum of relu scores", reported=False)

    # From here on the candidate looks like an indexer: every miss is reported.
    if dim not in (-1, len(shape(x)) - 1):
        raise NoMatch(f"top-k over dim {dim}, not the key dim")
    if largest is not True:
        raise NoMatch("top-k of the smallest scores")
    relu, relu_ops, post_scale = head["relu"]
    relu_in, scale = canonical_scale(relu.args[0])  # a chain of constant scalings, collected (canonicalize)
    if scale <= 0:
        raise NoMatch("a non-positive score scale does not commute with relu")
    softmax_scale = post_scale * scale
    if is_op(relu_in, aten.mul.Tensor, aten.div.Tensor):
        if unspecialised_float(relu_in.args[1]):
            raise NoMatch(f"the score scale {UNSPECIALISED_FLOAT}")
        raise NoMatch("scores are scaled by a tensor, not a constant")
    qk, qk_ops = layout_chain(relu_in)
    if not is_op(qk, *PRODUCTS):
        raise NoMatch("relu input is not a q.k product")
    extra = 1 if batched else 0
    weights, w_ops = leaf_of_rank(head["weights"], 2 + extra)
    k_scale = leaf_of_rank(head["k_scale"], 1 + extra) if head["k_scale"] is not None else None
    found = None
    # the op reads any strided view, and the dims check picks the one laid out as it wants (V4 keeps q as
    # [B, H, S, D] until a transpose)
    pairs = ((q_pos, q, k) for q_pos in (0, 1) for q in views_of_rank(qk.args[q_pos], 3 + extra)
             for k in views_of_rank(qk.args[1 - q_pos], 2 + extra))
    for q_pos, (q, q_ops), (k_node, k_ops) in pairs:
        if len(shape(weights)) == 2 + extra and _computes_indexer(head, batched, q_pos, q, q_ops, k_node, k_ops, qk_ops,
                                                                   relu_ops, weights, w_ops, k_scale):
            found = q, k_node
            break
    if found is None:
        b, form = ("b,", "[B, S, T]") if batched else ("", "[S, T]")
        raise NoMatch(f"the contraction is not sum_h w[{b}s,h] * relu(q[{b}s,h,:] . k[{b}t,:]) over {form}")
    q, k_node = found
    if dtype(qk) != torch.float32:
        raise NoMatch(f"scores are computed in {dtype(qk)}, not fp32")
    if dtype(q) not in SCORE_DTYPES or dtype(k_node) not in SCORE_DTYPES:
        raise NoMatch(f"q/k dtypes {dtype(q)}/{dtype(k_node)} not supported by the fused kernel")
    if not (dtype(weights).is_floating_point and dtype(weights).itemsize <= 4):
        raise NoMatch(f"head weights are {dtype(weights)}, the kernel sums them in fp32")
    masked_checks = []
    for getter in topk.users:
        if getter.target is operator.getitem and getter.args[1] == 0:
            for user in getter.users:
                if not (is_op(user, aten.eq.Scalar) and user.args[1] == float("-inf")):
                    raise NoMatch("the top-k values are used downstream (the fused op returns indices only)")
                masked_checks.append(user)
    if k_scale is not None:
        k_scale = k_scale[0]
        if dtype(k_scale) not in (torch.float32, torch.bfloat16, torch.float16):
            raise NoMatch(f"per-key scale is {dtype(k_scale)}, not a float the kernel can widen to fp32")
    return dict(q=q, k=k_node, weights=weights, k_scale=k_scale, mask=mask, scale=softmax_scale,
                topk=_topk_count(k), masked_checks=masked_checks, batched=batched,
                ordered=bool(ordered) and _order_observed(list(topk.users)))


def _computes_indexer(head, batched, q_pos, q, q_ops, k_node, k_ops, qk_ops, relu_ops, weights, w_ops, k_scale) -> bool:
    """Follow the dims from the leaves to the top-k input and check the contraction is the indexer's."""
    lead = "b" if batched else ""
    sizes = dict(zip(lead + "shd", shape(q)))
    sizes["t"] = shape(k_node)[-2]
    if not (same_shape(shape(k_node), [sizes[n] for n in lead + "td"])
            and same_shape(shape(weights), [sizes[n] for n in lead + "sh"])):
        return False

    def only(atoms, name) -> bool:
        return tuple(a[0] for a in atoms) == (() if same_size(sizes[name], 1) else (name,))

    q_labels, k_labels = follow(leaf_labels(q, lead + "shd"), q_ops), follow(leaf_labels(k_node, lead + "td"), k_ops)
    if not q_labels or not k_labels:
        return False
    first, second = (q_labels, k_labels) if q_pos == 0 else (k_labels, q_labels)
    qk_labels = bmm_labels(first, second)
    if qk_labels is None or not only(contracted(first, second), "d"):
        return False
    relu_labels = follow(qk_labels, qk_ops)
    expected_atoms = sorted(n for n in lead + "sht" if not same_size(sizes[n], 1))
    if relu_labels is None or sorted(n for dim in names(relu_labels) for n in dim) != expected_atoms:
        return False
    w_labels, r_labels = follow(leaf_labels(weights, lead + "sh"), w_ops), follow(relu_labels, relu_ops)
    if w_labels is None or r_labels is None:
        return False
    if head["kind"] == "bmm":
        left, right = (r_labels, w_labels) if head["relu_first"] else (w_labels, r_labels)
        summed = bmm_labels(left, right)
        if summed is None or not only(contracted(left, right), "h"):
            return False
    else:
        product = broadcast(r_labels, w_labels)
        if product is None:
            return False
        dims = {d % len(product) for d in head["sum_node"].args[1]}
        if not only(tuple(a for i in sorted(dims) for a in normalise([product[i]])[0]), "h"):
            return False
        summed = [dim for i, dim in enumerate(product) if i not in dims]
    summed = follow(summed, head["post_ops"])
    if summed is not None and k_scale is not None:
        scale_leaf, scale_ops = k_scale
        if not same_shape(shape(scale_leaf), [sizes[n] for n in lead + "t"]):
            return False
        scale_labels = follow(leaf_labels(scale_leaf, lead + "t"), scale_ops)
        summed = broadcast(summed, scale_labels) if scale_labels is not None else None
        summed = follow(summed, head["scale_then"]) if summed is not None else None
    return summed is not None and names(summed) == names([((n, sizes[n]),) for n in lead + "st"])


def _topk_count(k) -> int:
    """The constant k; `min(k, T)` spellings are fine since the op takes min(k, T) itself."""
    if isinstance(k, int):
        return k
    if isinstance(k, torch.fx.Node) and k.target in (torch.sym_min, min):
        consts = [a for a in k.args if isinstance(a, int)]
        if len(consts) == 1:
            return consts[0]
    raise NoMatch(f"top-k count {k} is not a constant")


def _widened(graph: torch.fx.Graph, before: torch.fx.Node, node, to: torch.dtype, batched: bool):
    """`node` as the op wants it: converted to `to` (exact: the source computes in fp32 anyway) and, for
    one sequence, with a batch dim of 1 in front."""
    if node is None:
        return None
    if dtype(node) != to:
        node = insert_call(graph, before, CONVERT, (node, to))
    return node if batched else insert_call(graph, before, aten.unsqueeze.default, (node, 0))


def _rewrite(graph: torch.fx.Graph, topk: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    count, mask, batched = m["topk"], m["mask"], m["batched"]
    mask_node = None
    if mask is not None:
        kind, mask_node = mask
        if kind == "drop":
            mask_node = insert_call(graph, topk, aten.bitwise_not.default, (mask_node,))
        elif kind == "add" and dtype(mask_node) != torch.float32:
            mask_node = insert_call(graph, topk, CONVERT, (mask_node, torch.float32))
    qk_dtype = dtype(m["q"]) if dtype(m["q"]) == dtype(m["k"]) else torch.float32  # mixed: both widened
    q, k = (_widened(graph, topk, m[name], qk_dtype, batched) for name in ("q", "k"))
    weights, k_scale = (_widened(graph, topk, m[name], torch.float32, batched) for name in ("weights", "k_scale"))
    fused = insert_call(graph, topk, torch.ops.dsfuse.indexer_topk.default,
                        (q, k, weights, k_scale, mask_node, m["scale"], count, m["ordered"]))
    if not batched:
        fused = insert_call(graph, topk, aten.squeeze.dim, (fused, 0))
    if m["masked_checks"]:
        _replace_masked_checks(graph, topk, fused, mask_node, m)
    for user in list(topk.users):
        if user.args[1] == 0:
            continue
        cast = only_user(user)
        if is_op(cast, CONVERT) and cast.args[1] == torch.int32:
            cast.replace_all_uses_with(fused)
        else:
            widened = insert_call(graph, topk, CONVERT, (fused, torch.int64))
            user.replace_all_uses_with(widened)
    kind = "no mask" if mask is None else {"keep": "bool mask", "drop": "bool mask", "add": "additive mask"}[mask[0]]
    detail = (f"{kind}, k={count}, scale={m['scale']:.6g}{', fp8 k_scale' if m['k_scale'] is not None else ''}"
              f"{', one sequence' if not batched else ''}{', in topk order' if m['ordered'] else ''}")
    ctx.site(topk, "dsfuse.indexer_topk", [m["q"], m["k"], m["weights"], m["k_scale"], mask_node], detail=detail)


def _replace_masked_checks(graph: torch.fx.Graph, topk: torch.fx.Node, fused: torch.fx.Node, mask_node, m: dict) -> None:
    """`values == -inf` marks the picks that landed on masked keys (the scores are finite elsewhere), so
    it is the mask read at the picked indices: O(S*k) work instead of keeping the values."""
    picked = insert_call(graph, topk, CONVERT, (fused, torch.int64))
    if mask_node is None:
        masked = insert_call(graph, topk, aten.lt.Scalar, (picked, 0))
    else:
        sizes = [size_arg(graph, topk, fused, d) for d in range(len(shape(fused)) - 1)]
        sizes.append(size_arg(graph, topk, m["k"], -2))
        full = insert_call(graph, topk, aten.expand.default, (mask_node, sizes))
        gathered = insert_call(graph, topk, aten.gather.default, (full, -1, picked))
        if dtype(mask_node) == torch.bool:
            masked = insert_call(graph, topk, aten.bitwise_not.default, (gathered,))
        else:
            masked = insert_call(graph, topk, aten.eq.Scalar, (gathered, float("-inf")))
    for check in m["masked_checks"]:
        check.replace_all_uses_with(masked)
