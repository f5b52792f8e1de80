"""`indexer_topk`: the DSA lightning indexer (scores -> relu -> head-weighted sum -> mask -> top-k)
rewritten into one `dsfuse::indexer_topk` call.

The anchor is an `aten.topk` over the last dim of a `[B, S, T]` tensor. Walking back from it:

    topk(mask(k_scale[b,t]? * sum_h weights[b,s,h] * relu(scale * q[b,s,h,:] . k[b,t,:])))

`mask` is `where(~keep, -inf, x)` (bool mask, HF `masked_fill`), `x + additive` (float mask) or absent;
the head sum may be a bmm (HF's matmul, einsum) or a mul + sum; `q`/`k` may be fp32 upcasts of
bf16/fp16/fp8 tensors, which the kernel reads in their narrow form. Which dims are contracted is
checked by following them through every reshape/permute/expand (`dims.py`), so any spelling of the
same math matches and nothing else does. Top-k values may only be compared with -inf (how
official-style code marks picks of masked keys as -1); that comparison is rebuilt from the mask.

A top-k whose input is not a head-weighted relu score is not an indexer and is skipped silently;
one that is but cannot be rewritten is reported with the reason.
"""

from __future__ import annotations

import math
import operator

import torch

import dsfuse.kernels.indexer_topk  # noqa: F401  (registers torch.ops.dsfuse.indexer_topk)

from .context import NoMatch, PassContext, rewrite_anchored
from .dims import (bmm_labels, broadcast, contracted, follow, layout_chain, leaf_labels, leaf_of_rank, names,
                   normalise)
from .graph_utils import (CONVERT, aten, dtype, insert_call, is_op, only_user, same_shape, same_size, scalar_arg,
                          shape)

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
                   aten.lt.Scalar, aten.ge.Scalar, aten.ne.Scalar, aten.clone.default}


def _order_escapes(indices: list[torch.fx.Node]) -> bool:
    """Whether the slot order of the indices reaches the graph's outputs.

    The fused op returns each row's top-k as a set (in no particular order). Consumers inside the
    graph that scatter or gather by index, and attention over the gathered keys, do not see the
    order; a caller who receives the indices might.
    """
    seen, frontier = set(), list(indices)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "output":
                return True
            if user not in seen and (user.target in SLOT_PRESERVING or user.target is operator.getitem):
                seen.add(user)
                frontier.append(user)
    return False


def _split_mask(x: torch.fx.Node) -> tuple:
    """(scores, mask) where mask is ("keep", bool), ("drop", bool), ("add", float) or None."""
    if is_op(x, aten.where.self):
        cond, fill, scores = x.args
        fill_value = fill.args[1] if is_op(fill, aten.full.default) else scalar_arg(fill)
        if fill_value is None or not (isinstance(fill_value, float) and math.isinf(fill_value) and fill_value < 0):
            raise NoMatch("masked with a fill value other than -inf", reported=False)
        if is_op(cond, aten.bitwise_not.default, aten.logical_not.default):
            return scores, ("keep", cond.args[0])
        return scores, ("drop", cond)
    if is_op(x, aten.add.Tensor) and all(isinstance(a, torch.fx.Node) for a in x.args):
        for scores, mask in (x.args, x.args[::-1]):
            if _head_sum(scores, probe=True) is not None:
                return scores, ("add", mask)
    return x, None


def _relu_side(node) -> tuple | None:
    leaf, ops = layout_chain(node)
    return (leaf, ops) if is_op(leaf, aten.relu.default) else None


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
                found["k_scale"] = leaf_of_rank(scale, 2)
                found["scale_then"] = post_ops
                return found
        return None
    if is_op(node, *PRODUCTS):
        for relu_pos in (1, 0):
            relu = _relu_side(node.args[relu_pos])
            if relu is not None:
                return dict(kind="bmm", relu_first=relu_pos == 0, sum_node=node, relu=relu,
                            weights=leaf_of_rank(node.args[1 - relu_pos], 3), post_ops=post_ops, k_scale=k_scale,
                            scale_then=[])
        return None
    if is_op(node, aten.sum.dim_IntList) and is_op(node.args[0], aten.mul.Tensor):
        a, b = node.args[0].args
        for r, w in ((a, b), (b, a)):
            relu = _relu_side(r) if isinstance(r, torch.fx.Node) else None
            if relu is not None and isinstance(w, torch.fx.Node):
                return dict(kind="sum", sum_node=node, relu=relu, weights=leaf_of_rank(w, 3), post_ops=post_ops,
                            k_scale=k_scale, scale_then=[])
    return None


def _match(topk: torch.fx.Node) -> dict:
    x, k, dim, largest, ordered = _topk_params(topk)
    if len(shape(x)) != 3:
        raise NoMatch("top-k input is not [B, S, T]", reported=False)
    scores, mask = _split_mask(x)
    head = _head_sum(scores)
    if head is None:
        raise NoMatch("top-k input is not a head-weighted sum of relu scores", reported=False)

    # From here on the candidate looks like an indexer: every miss is reported.
    if dim not in (-1, 2):
        raise NoMatch(f"top-k over dim {dim}, not the key dim")
    if largest is not True:
        raise NoMatch("top-k of the smallest scores")
    relu, relu_ops = head["relu"]
    relu_in = relu.args[0]
    softmax_scale = 1.0
    if is_op(relu_in, aten.mul.Tensor):
        a, b = relu_in.args
        scalar = scalar_arg(b) if scalar_arg(b) is not None else scalar_arg(a)
        if scalar is None:
            raise NoMatch("scores are scaled by a tensor, not a constant")
        if scalar <= 0:
            raise NoMatch("a non-positive score scale does not commute with relu")
        softmax_scale = scalar
        relu_in = a if scalar_arg(b) is not None else b
    qk, qk_ops = layout_chain(relu_in)
    if not is_op(qk, *PRODUCTS):
        raise NoMatch("relu input is not a q.k product")
    (q, q_ops), (k_node, k_ops) = leaf_of_rank(qk.args[0], 4), leaf_of_rank(qk.args[1], 3)
    weights, w_ops = head["weights"]

    q_shape, k_shape, w_shape = shape(q), shape(k_node), shape(weights)
    if len(q_shape) != 4 or len(k_shape) != 3 or len(w_shape) != 3:
        raise NoMatch(f"expected q [B,S,H,D], k [B,T,D], weights [B,S,H]; got {q_shape}, {k_shape}, {w_shape}")
    B, S, H, D = q_shape
    if not (same_shape(k_shape[::2], (B, D)) and same_shape(w_shape, (B, S, H))):
        raise NoMatch(f"shapes do not line up: q {q_shape}, k {k_shape}, weights {w_shape}")
    if not _computes_indexer(head, q, q_ops, k_node, k_ops, qk, qk_ops, relu_ops, weights, w_ops, x):
        raise NoMatch("the contraction is not sum_h w[b,s,h] * relu(q[b,s,h,:] . k[b,t,:]) over [B, S, T]")
    if dtype(q) not in SCORE_DTYPES or dtype(k_node) != dtype(q):
        raise NoMatch(f"q/k dtypes {dtype(q)}/{dtype(k_node)} not supported by the fused kernel")
    if dtype(weights) != torch.float32:
        raise NoMatch(f"head weights are {dtype(weights)}, the kernel sums them in fp32")
    if dtype(qk) != torch.float32:
        raise NoMatch(f"scores are computed in {dtype(qk)}, not fp32")
    masked_checks = []
    for getter in topk.users:
        if getter.target is operator.getitem and getter.args[1] == 0:
            for user in getter.users:
                if not (is_op(user, aten.eq.Scalar) and user.args[1] == float("-inf")):
                    raise NoMatch("the top-k values are used downstream (the fused op returns indices only)")
                masked_checks.append(user)
    index_getters = [g for g in topk.users if g.target is operator.getitem and g.args[1] == 1]
    if ordered and _order_escapes(index_getters):
        raise NoMatch("the indices leave the graph in torch.topk's sorted order, and the fused op returns each "
                      "row's top-k unordered (use sorted=False where order does not matter)")

    k_scale = None
    if head["k_scale"] is not None:
        k_scale = head["k_scale"][0]
        if dtype(k_scale) != torch.float32:
            raise NoMatch(f"per-key scale is {dtype(k_scale)}, not fp32")
    return dict(q=q, k=k_node, weights=weights, k_scale=k_scale, mask=mask, scale=softmax_scale,
                topk=_topk_count(k), masked_checks=masked_checks)


def _computes_indexer(head, q, q_ops, k_node, k_ops, qk, qk_ops, relu_ops, weights, w_ops, x) -> bool:
    """Follow the dims from the leaves to the top-k input and check the contraction is the indexer's."""
    B, S, H, D = shape(q)
    T = shape(k_node)[1]

    def only(atoms, name, size) -> bool:
        return tuple(a[0] for a in atoms) == (() if same_size(size, 1) else (name,))

    q_labels, k_labels = follow(leaf_labels(q, "bshd"), q_ops), follow(leaf_labels(k_node, "btd"), k_ops)
    qk_labels = bmm_labels(q_labels, k_labels) if q_labels and k_labels else None
    if qk_labels is None or not only(contracted(q_labels, k_labels), "d", D):
        return False
    relu_labels = follow(qk_labels, qk_ops)
    expected_atoms = sorted(n for n, size in zip("bsht", (B, S, H, T)) if not same_size(size, 1))
    if relu_labels is None or sorted(n for dim in names(relu_labels) for n in dim) != expected_atoms:
        return False
    w_labels, r_labels = follow(leaf_labels(weights, "bsh"), w_ops), follow(relu_labels, relu_ops)
    if w_labels is None or r_labels is None:
        return False
    if head["kind"] == "bmm":
        left, right = (r_labels, w_labels) if head["relu_first"] else (w_labels, r_labels)
        summed = bmm_labels(left, right)
        if summed is None or not only(contracted(left, right), "h", H):
            return False
    else:
        product = broadcast(r_labels, w_labels)
        if product is None:
            return False
        dims = {d % len(product) for d in head["sum_node"].args[1]}
        if not only(tuple(a for i in sorted(dims) for a in normalise([product[i]])[0]), "h", H):
            return False
        summed = [dim for i, dim in enumerate(product) if i not in dims]
    summed = follow(summed, head["post_ops"])
    if summed is not None and head["k_scale"] is not None:
        scale_leaf, scale_ops = head["k_scale"]
        scale_labels = follow(leaf_labels(scale_leaf, "bt"), scale_ops)
        summed = broadcast(summed, scale_labels) if scale_labels is not None else None
        summed = follow(summed, head["scale_then"]) if summed is not None else None
    return summed is not None and names(summed) == names([((n, size),) for n, size in zip("bst", (B, S, T))])


def _topk_count(k) -> int:
    """The constant k; `min(k, T)` spellings are fine since the op takes min(k, T) itself."""
    if isinstance(k, int):
        return k
    if isinstance(k, torch.fx.Node) and k.target in (torch.sym_min, min):
        consts = [a for a in k.args if isinstance(a, int)]
        if len(consts) == 1:
            return consts[0]
    raise NoMatch(f"top-k count {k} is not a constant")


def _rewrite(graph: torch.fx.Graph, topk: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    count = m["topk"]
    mask = m["mask"]
    mask_node = None
    if mask is not None:
        kind, mask_node = mask
        if kind == "drop":
            mask_node = insert_call(graph, topk, aten.bitwise_not.default, (mask_node,))
        elif dtype(mask_node) not in (torch.float32, torch.bool):
            mask_node = insert_call(graph, topk, CONVERT, (mask_node, torch.float32))
    fused = insert_call(graph, topk, torch.ops.dsfuse.indexer_topk.default,
                        (m["q"], m["k"], m["weights"], m["k_scale"], mask_node, m["scale"], count))
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
    ctx.site(topk, "dsfuse.indexer_topk", [m["q"], m["k"], m["weights"], m["k_scale"], mask_node],
             detail=f"{kind}, k={count}, scale={m['scale']:.6g}{', fp8 k_scale' if m['k_scale'] is not None else ''}")


def _size(graph: torch.fx.Graph, before: torch.fx.Node, node: torch.fx.Node, dim: int):
    size = shape(node)[dim]
    return size if isinstance(size, int) else insert_call(graph, before, aten.sym_size.int, (node, dim))


def _replace_masked_checks(graph: torch.fx.Graph, topk: torch.fx.Node, fused: torch.fx.Node, mask_node, m: dict) -> None:
    """`values == -inf` marks the picks that landed on masked keys (the scores are finite elsewhere), so
    it is the mask read at the picked indices: O(S*k) work instead of keeping the values."""
    picked = insert_call(graph, topk, CONVERT, (fused, torch.int64))
    if mask_node is None:
        masked = insert_call(graph, topk, aten.lt.Scalar, (picked, 0))
    else:
        sizes = [_size(graph, topk, fused, 0), _size(graph, topk, fused, 1), _size(graph, topk, m["k"], 1)]
        full = insert_call(graph, topk, aten.expand.default, (mask_node, sizes))
        gathered = insert_call(graph, topk, aten.gather.default, (full, -1, picked))
        if dtype(mask_node) == torch.bool:
            masked = insert_call(graph, topk, aten.bitwise_not.default, (gathered,))
        else:
            masked = insert_call(graph, topk, aten.eq.Scalar, (gathered, float("-inf")))
    for check in m["masked_checks"]:
        check.replace_all_uses_with(masked)
