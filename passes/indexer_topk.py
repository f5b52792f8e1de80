"""`indexer_topk`: the DSA lightning indexer (scores -> relu -> head-weighted sum -> mask -> top-k)
rewritten into one `dsfuse::indexer_topk` call.

The anchors are selections over the last dim of a `[B, S, T]` tensor (or `[S, T]`: one sequence, as
vLLM's and SGLang's references write it): `aten.topk`, and a descending `sort` / `argsort` whose indices
(and values, when read) are read as a prefix `[..., :k]`; a `kthvalue` threshold is reported. Walking back:

    topk(mask(k_scale[b,t]? * sum_h weights[b,s,h] * relu(scale * q[b,s,h,:] . k[b,t,:])))

`mask` is `where(c, fill, x)` (the canonical polarity; a negated condition keeps) with fill -inf or another
constant (finfo.min, -1e9, 0: the op's `fill`, the masked keys' score), `x + additive` (or two additive masks
added in turn, which the op takes summed) or absent; the scale is a constant (chains of
constant scalings are collected by the canonicaliser) before relu or after it (equal for a positive
constant); the product may put q or k first;
the head sum may be a bmm (HF's matmul, einsum) or a mul + sum; `q`/`k` may be fp32 upcasts of
bf16/fp16/fp8 tensors, which the kernel reads in their narrow form (when only one of them is narrow,
both are widened to fp32, which is exact). Which dims are contracted is checked by following them
through every reshape/permute/expand (`dims.py`), so any spelling of the same math matches and nothing
else does; q held heads-first (or k held as [D, T]) throughout is read through a permute of its leaf.
Top-k values may only be compared with -inf (how official-style code marks picks of masked keys as -1), under a
-inf fill; that comparison is rebuilt from the mask.

The fused op returns each row's picks as a set; when anything may see their slot order (they leave
the graph, or are read slot by slot) and the top-k was sorted, the op is asked for `torch.topk`'s order.

Before rewriting, the matched slice is run on probes against `indexer_topk_reference` (`verify.py`: random,
tied keys, a zero query row, masked rows; symbolic sizes at two small assignments); a disagreement is a
near-miss naming the failing probe. Slices too large to probe at a static graph's sizes rest on the dims proof.

A selection whose input no head-weighted relu score reaches (through elementwise and layout ops) is not an
indexer and is skipped silently; one that is but cannot be rewritten is reported with the reason.

Stages: anchors `ANCHORS`; binder `_match` (the selection, the mask, the head sum, then the dims proof in
`_computes_indexer`); verifier `_verify`, against `indexer_topk_reference` (kernels/indexer_topk.py); rewrite
`_rewrite` into `dsfuse::indexer_topk`.
"""

from __future__ import annotations

import itertools
import math
import operator

import torch

from dsfuse.kernels.indexer_topk import indexer_topk_reference  # also registers torch.ops.dsfuse.indexer_topk

from .canonicalize import canonical_bmm, canonical_mm, canonical_scale
from .context import NoMatch, PassContext, rewrite_anchored
from .dims import (bmm_labels, broadcast, contracted, follow, layout_chain, leaf_labels, leaf_of_rank, names, normalise,
                   views_of_rank)
from .graph_utils import (CONVERT, LAYOUT_OPS, NOT_OPS, UNSPECIALISED_FLOAT, aten, dtype, fill_value, insert_call,
                          is_neg_inf, is_op, node_arg, only_user, piece_of, reaches_back, refuse_changed_keyword,
                          same_shape, same_size, scalar_arg, shape, size_arg, unspecialised_float)
from .verify import Family, Verdict, verify

NAME = "indexer_topk"
IMPLEMENTED = True

SCORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
# Batched products; Inductor turns a batch-1 bmm into squeeze -> mm -> unsqueeze on CUDA (decode at batch 1).
PRODUCTS = (aten.bmm.default, aten.mm.default)


# ---------------------------------------------------------------------------
# Anchors
# ---------------------------------------------------------------------------

SORTS = (aten.sort.default, aten.sort.stable)
# Selections by op class: a top-k, a sort whose indices are read as a prefix, and a k-th value (reported only).
ANCHORS = (aten.topk.default, *SORTS, aten.kthvalue.default)


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, ANCHORS, _match, _rewrite)


# ---------------------------------------------------------------------------
# Binding: the walk from the selection back to q, k, the head weights and the mask
# ---------------------------------------------------------------------------


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


def _order_observed(outputs: list[torch.fx.Node]) -> bool:
    """Whether anything may see the slot order of the top-k.

    The fused op returns each row's top-k as a set unless asked for `torch.topk`'s order. Scattering
    one value by index (HF's sparse masks) does not see the order; anything else might (a caller who
    receives the indices, a gather read slot by slot, a slot-wise mix with a tensor that varies along
    the slots, such as `arange(k) < n`), so the order is kept for it.
    """
    traced, frontier = set(outputs), list(outputs)
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
    """(scores, mask) where mask is ("keep", bool), ("drop", bool), ("add", float), ("add", (float, float)) or None.

    `where(c, fill, x)` drops where c holds (HF `masked_fill`; canonicalize brings `where(c, x, fill)` to
    this polarity), the fill a constant (`_fill`); a negated condition keeps where its operand holds."""
    if is_op(x, aten.where.self):
        cond, fill, scores = x.args
        _fill(fill)
        if is_op(cond, *NOT_OPS):
            return scores, ("keep", cond.args[0])
        return scores, ("drop", cond)
    if is_op(x, aten.add.Tensor) and all(isinstance(a, torch.fx.Node) for a in x.args):
        for scores, mask in (x.args, x.args[::-1]):
            if _head_sum(scores, probe=True) is not None:
                refuse_changed_keyword(x, "an additive mask added to the scores")
                return scores, ("add", mask)
            inner, inner_mask = _split_mask(scores) if is_op(scores, aten.add.Tensor) else (scores, None)
            if inner_mask is not None and inner_mask[0] == "add" and isinstance(inner_mask[1], torch.fx.Node):
                refuse_changed_keyword(x, "an additive mask added to the scores")
                return inner, ("add", (inner_mask[1], mask))  # two additive masks (causal + padding), summed
    return x, None


def _fill(node) -> float | None:
    """A bool mask's fill as the op's `fill` argument: None for -inf, else the constant as the source's `where`
    reads it (a `full` rounded to its dtype). Any constant is exact: the op gives masked keys that very score."""
    if _neg_inf(node):
        return None
    value = fill_value(node)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise NoMatch("masked with a fill value that is not a constant")
    if isinstance(node, torch.fx.Node):
        value = torch.tensor(value, dtype=dtype(node)).item()
    if math.isnan(value):
        raise NoMatch("masked with a NaN fill")
    return float(value)


SIGNATURE_DEPTH = 8


def _has_signature(x: torch.fx.Node) -> bool:
    """Whether a head-weighted sum of relu scores reaches `x` through a few elementwise or layout ops: the
    indexer's signature, which makes any selection of `x` a site or a reported near-miss."""
    def through(node):
        target = node.target if node.op == "call_function" else None
        return target in LAYOUT_OPS or target is CONVERT or (
            isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags)

    return reaches_back(x, lambda node: _head_sum(node, probe=True) is not None, through, SIGNATURE_DEPTH)


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


def _selection(anchor: torch.fx.Node) -> dict:
    """What a selection anchor selects: its input, count, dim, direction, whether its slots are sorted, and the
    nodes that carry its indices and values. `topk(x, k)`; `sort(x, descending)` (or `argsort`) read through
    prefix slices `[..., :k]` of its indices (and of its values, when those are read)."""
    if anchor.target is aten.topk.default:
        x, k, dim, largest, ordered = _topk_params(anchor)
        outputs = {i: [g for g in anchor.users if g.args[1] == i] for i in (0, 1)}
        return dict(x=x, count=k, dim=dim, largest=largest, ordered=ordered, values=outputs[0], indices=outputs[1])
    x = anchor.args[0]
    dim, descending = node_arg(anchor, 1, "dim", -1), node_arg(anchor, 2, "descending", False)
    outputs, ends = {0: [], 1: []}, set()
    for getter in anchor.users:
        for user in getter.users:
            piece = piece_of(user)
            if piece is None or piece[1] != len(shape(x)) - 1 or piece[2] != 0:
                raise NoMatch("the sorted scores are read other than as a prefix [..., :k] along the key dim")
            outputs[getter.args[1]].append(user)
            ends.add(piece[3])
    if len(ends) != 1 or not isinstance(next(iter(ends)), int):
        raise NoMatch("the sort's prefixes are not of one constant length")
    if not outputs[1]:
        raise NoMatch("only the sorted values are read (the fused op returns indices)")
    return dict(x=x, count=ends.pop(), dim=dim, largest=descending, ordered=True, values=outputs[0],
                indices=outputs[1])


def _match(anchor: torch.fx.Node) -> dict:
    x = anchor.args[0]
    batched = len(shape(x)) == 3
    if len(shape(x)) not in (2, 3):
        raise NoMatch("top-k input is not [B, S, T] or [S, T]", reported=False)
    if not _has_signature(x):
        raise NoMatch("top-k input is not a head-weighted sum of relu scores", reported=False)

    # From here on the candidate looks like an indexer: every miss is reported.
    scores, mask = _split_mask(x)
    fill = _fill(x.args[1]) if mask is not None and mask[0] in ("keep", "drop") else None
    head = _head_sum(scores)
    if head is None:
        raise NoMatch("the head-weighted relu scores reach the selection through ops other than one constant-fill or "
                      "additive mask")
    if anchor.target is aten.kthvalue.default:
        raise NoMatch("keys selected by a kthvalue threshold (the fused op returns a top-k index set)")
    sel = _selection(anchor)
    k, dim, largest = sel["count"], sel["dim"], sel["largest"]
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
    # the product as written, or as Inductor's pad_mm computes it (zero-padded operands, the result sliced back)
    operands = canonical_bmm(qk) or canonical_mm(qk)
    if operands is None:
        raise NoMatch("relu input is not a q.k product")
    extra = 1 if batched else 0
    weights, w_ops = leaf_of_rank(head["weights"], 2 + extra)
    k_scale = leaf_of_rank(head["k_scale"], 1 + extra) if head["k_scale"] is not None else None
    found = None
    # the op reads any strided view, and the dims check picks the one laid out as it wants (V4 keeps q as
    # [B, H, S, D] until a transpose); failing that, a permutation of q's or k's leaf (q held heads-first
    # throughout, k held as [D, T])
    for permuted in (False, True):
        pairs = ((q_pos, q, k) for q_pos in (0, 1) for q in _candidates(operands[q_pos], 3 + extra, permuted)
                 for k in _candidates(operands[1 - q_pos], 2 + extra, permuted))
        for q_pos, q_view, k_view in pairs:
            if len(shape(weights)) == 2 + extra and _computes_indexer(
                    head, batched, q_pos, q_view, k_view, qk_ops, relu_ops, weights, w_ops, k_scale):
                found = q_view[0], q_view[2], k_view[0], k_view[2]
                break
        if found is not None:
            break
    if found is None:
        b, form = ("b,", "[B, S, T]") if batched else ("", "[S, T]")
        raise NoMatch(f"the contraction is not sum_h w[{b}s,h] * relu(q[{b}s,h,:] . k[{b}t,:]) over {form}")
    q, q_order, k_node, k_order = found
    if dtype(qk) != torch.float32:
        raise NoMatch(f"scores are computed in {dtype(qk)}, not fp32")
    if dtype(q) not in SCORE_DTYPES or dtype(k_node) not in SCORE_DTYPES:
        raise NoMatch(f"q/k dtypes {dtype(q)}/{dtype(k_node)} not supported by the fused kernel")
    if not (dtype(weights).is_floating_point and dtype(weights).itemsize <= 4):
        raise NoMatch(f"head weights are {dtype(weights)}, the kernel sums them in fp32")
    masked_checks = []
    for values in sel["values"]:
        for user in values.users:
            if not (is_op(user, aten.eq.Scalar) and user.args[1] == float("-inf")):
                raise NoMatch("the top-k values are used downstream (the fused op returns indices only)")
            if fill is not None:
                raise NoMatch(f"the top-k values are compared with -inf under a fill of {fill:g} (only a -inf fill "
                              "marks the masked picks)")
            masked_checks.append(user)
    if k_scale is not None:
        k_scale = k_scale[0]
        if dtype(k_scale) not in (torch.float32, torch.bfloat16, torch.float16):
            raise NoMatch(f"per-key scale is {dtype(k_scale)}, not a float the kernel can widen to fp32")
    found = dict(q=q, q_order=q_order, k=k_node, k_order=k_order, weights=weights, k_scale=k_scale, mask=mask,
                 fill=fill, scale=softmax_scale, topk=_topk_count(k), masked_checks=masked_checks, batched=batched,
                 indices=sel["indices"])
    found["ordered"] = bool(sel["ordered"]) and _order_observed(sel["indices"] + sel["values"])
    verdict = _verify(x, found)
    if verdict.ok is False:
        raise NoMatch(f"numeric check against the reference failed: {verdict.reason}")
    return found


def _candidates(node, rank: int, permuted: bool) -> list:
    """(tensor, ops after it, order): each view of `rank` dims on `node`'s layout chain (order None), or with
    `permuted`, every order of the dims of the one nearest the leaf (the op then reads `tensor.permute(order)`)."""
    views = views_of_rank(node, rank)
    if not permuted:
        return [(view, ops, None) for view, ops in views]
    if not views:
        return []
    view, ops = views[0]
    identity = tuple(range(rank))
    return [(view, ops, None if order == identity else order) for order in itertools.permutations(identity)]


def _leaf_names(view: tuple, dims: str) -> tuple[list, list]:
    """(the sizes of `dims` as the op reads the view, the name of each of the view's own dims)."""
    node, _, order = view
    order = order or tuple(range(len(shape(node))))
    names_ = [""] * len(order)
    for name, i in zip(dims, order):
        names_[i] = name
    return [shape(node)[i] for i in order], names_


def _computes_indexer(head, batched, q_pos, q_view, k_view, qk_ops, relu_ops, weights, w_ops, k_scale) -> bool:
    """Follow the dims from the leaves to the top-k input and check the contraction is the indexer's."""
    lead = "b" if batched else ""
    (q, q_ops, _), (k_node, k_ops, _) = q_view, k_view
    q_shape, q_names = _leaf_names(q_view, lead + "shd")
    k_shape, k_names = _leaf_names(k_view, lead + "td")
    sizes = dict(zip(lead + "shd", q_shape))
    sizes["t"] = k_shape[-2]
    if not (same_shape(k_shape, [sizes[n] for n in lead + "td"])
            and same_shape(shape(weights), [sizes[n] for n in lead + "sh"])):
        return False

    def only(atoms, name) -> bool:
        return tuple(a[0] for a in atoms) == (() if same_size(sizes[name], 1) else (name,))

    q_labels, k_labels = follow(leaf_labels(q, q_names), q_ops), follow(leaf_labels(k_node, k_names), k_ops)
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


# ---------------------------------------------------------------------------
# Verification: the bound slice against `indexer_topk_reference`, on probes
# ---------------------------------------------------------------------------


def _verify(x: torch.fx.Node, m: dict) -> Verdict:
    """Run the matched slice (scores and picks) on probes against `indexer_topk_reference` with the bound q, k,
    weights, k_scale and mask; the picks must be distinct, in range, and score what the reference's score."""
    roles = {name: m[name] for name in ("q", "k", "weights", "k_scale") if m[name] is not None}
    kind = None
    if m["mask"] is not None:
        kind, masks = m["mask"]
        roles.update(zip(("mask", "mask2"), masks if isinstance(masks, tuple) else (masks,)))
    orders = {"q": m["q_order"], "k": m["k_order"]}
    family = Family(probes=lambda shapes, dtypes: _probes(shapes, dtypes, kind, orders),
                    reference=lambda probe: _reference(probe, m, kind), compare=_same_picks)
    extra = (kind, m["fill"], m["scale"], m["topk"], m["batched"], m["q_order"], m["k_order"])
    return verify([m["indices"][0], x], roles, family, extra, above=m["topk"])


def _grid(shape, dtype, gen, low=None) -> torch.Tensor:
    """Values on a 1/4 grid, small enough that every product and short sum is exact in fp32 (so any summation
    order gives the same scores) and representable in fp8 e4m3; `low` given: uniform in [low, low + 1)."""
    if low is not None:
        return ((torch.rand(shape, generator=gen) + low) * 4).round().div(4).clamp_min(0.25).to(dtype)
    return (torch.randn(shape, generator=gen) * 6).round().clamp(-15, 15).div(4).to(dtype)


def _probes(shapes: dict, dtypes: dict, kind, orders: dict) -> list:
    """A generic probe (a fully masked query row where a mask may), one with every other key a copy of the first
    (tied scores), and one with the first query row zero (every score of that row ties at 0). q and k are drawn
    as the op reads them, then laid out as the graph holds them (`orders`: the op reads `x.permute(order)`)."""
    gen = torch.Generator().manual_seed(0)
    op_shapes = {name: [shapes[name][i] for i in order] if order else shapes[name] for name, order in orders.items()}
    base = {name: _grid(op_shapes.get(name, shapes[name]), dtypes[name], gen) for name in ("q", "k", "weights")}
    if "k_scale" in shapes:
        base["k_scale"] = _grid(shapes["k_scale"], dtypes["k_scale"], gen, low=0.5)
    if kind is not None:
        keep = torch.rand(shapes["mask"], generator=gen) < 0.6
        if keep.dim() >= 2:
            keep[..., 0, :] = False
        base["mask"] = {"keep": keep, "drop": ~keep}.get(
            kind, torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).to(dtypes["mask"]))
        if "mask2" in shapes:
            drop = torch.rand(shapes["mask2"], generator=gen) < 0.2
            base["mask2"] = torch.zeros(drop.shape).masked_fill(drop, float("-inf")).to(dtypes["mask2"])
    tied, zero = dict(base), dict(base)
    tied["k"] = base["k"].clone()
    tied["k"][..., ::2, :] = base["k"][..., :1, :]
    zero["q"] = base["q"].clone()
    zero["q"][..., 0, :, :] = 0
    probes = [("random", base), ("tied keys", tied), ("zero query", zero)]
    for probe in (p for _, p in probes):
        for name, order in orders.items():
            if order:
                probe[name] = probe[name].permute([order.index(i) for i in range(len(order))]).contiguous()
    return probes


def _reference(probe: dict, m: dict, kind) -> torch.Tensor:
    """`indexer_topk_reference` on a probe, with the op's argument conventions (keep-True mask, fp32 weights)."""
    q, k = probe["q"], probe["k"]
    if m["q_order"] is not None:
        q = q.permute(m["q_order"])
    if m["k_order"] is not None:
        k = k.permute(m["k_order"])
    if q.dtype != k.dtype:
        q, k = q.float(), k.float()
    weights, k_scale = probe["weights"].float(), probe.get("k_scale")
    mask = probe.get("mask")
    if kind == "drop":
        mask = ~mask
    elif kind == "add":
        mask = mask.float() + probe["mask2"].float() if "mask2" in probe else mask.float()
    if not m["batched"]:
        q, k, weights = q[None], k[None], weights[None]
        k_scale = k_scale[None] if k_scale is not None else None
    picks = indexer_topk_reference(q, k, weights, k_scale.float() if k_scale is not None else None, mask, m["scale"],
                                   m["topk"], m["fill"])
    return picks if m["batched"] else picks[0]


def _same_picks(got: list, want: torch.Tensor, probe: dict) -> str | None:
    """The slice's picks against the reference's, by the family's tie rule: distinct, in range, and the same
    sorted scores (the slice's own) as the reference's picks; without ties that is the same index set."""
    picks, scores = got
    if picks.shape != want.shape:
        return f"picks of shape {list(picks.shape)}, the reference's {list(want.shape)}"
    picks, want = picks.long(), want.long()
    if picks.numel() == 0:
        return None
    if (picks < 0).any() or (picks >= scores.shape[-1]).any():
        return "a pick out of range"
    ordered = picks.sort(dim=-1).values
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        return "a key picked twice in one row"
    chosen = scores.gather(-1, picks).sort(dim=-1).values
    expected = scores.gather(-1, want).sort(dim=-1).values
    differ = (chosen != expected).any(dim=-1)
    return f"{int(differ.sum())} rows pick other scores than the reference" if differ.any() else None


# ---------------------------------------------------------------------------
# Rewrite
# ---------------------------------------------------------------------------


def _widened(graph: torch.fx.Graph, before: torch.fx.Node, node, to: torch.dtype, batched: bool):
    """`node` as the op wants it: converted to `to` (exact: the source computes in fp32 anyway) and, for
    one sequence, with a batch dim of 1 in front."""
    if node is None:
        return None
    if dtype(node) != to:
        node = insert_call(graph, before, CONVERT, (node, to))
    return node if batched else insert_call(graph, before, aten.unsqueeze.default, (node, 0))


def _rewrite(graph: torch.fx.Graph, anchor: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    count, mask, batched = m["topk"], m["mask"], m["batched"]
    mask_node = None
    if mask is not None:
        kind, mask_node = mask
        if kind == "drop":
            mask_node = insert_call(graph, anchor, aten.bitwise_not.default, (mask_node,))
        elif kind == "add":
            parts = mask_node if isinstance(mask_node, tuple) else (mask_node,)
            parts = [insert_call(graph, anchor, CONVERT, (node, torch.float32)) if dtype(node) != torch.float32
                     else node for node in parts]
            mask_node = parts[0] if len(parts) == 1 else insert_call(graph, anchor, aten.add.Tensor, tuple(parts))
    qk_dtype = dtype(m["q"]) if dtype(m["q"]) == dtype(m["k"]) else torch.float32  # mixed: both widened
    q, k = ((m[name] if m[f"{name}_order"] is None else
             insert_call(graph, anchor, aten.permute.default, (m[name], list(m[f"{name}_order"])))) for name in "qk")
    q, k = (_widened(graph, anchor, node, qk_dtype, batched) for node in (q, k))
    weights, k_scale = (_widened(graph, anchor, m[name], torch.float32, batched) for name in ("weights", "k_scale"))
    args = (q, k, weights, k_scale, mask_node, m["scale"], count, m["ordered"])
    fused = insert_call(graph, anchor, torch.ops.dsfuse.indexer_topk.default,
                        args if m["fill"] is None else (*args, m["fill"]))
    if not batched:
        fused = insert_call(graph, anchor, aten.squeeze.dim, (fused, 0))
    if m["masked_checks"]:
        _replace_masked_checks(graph, anchor, fused, mask_node, m)
    for user in m["indices"]:
        cast = only_user(user)
        if is_op(cast, CONVERT) and cast.args[1] == torch.int32:
            cast.replace_all_uses_with(fused)
        else:
            widened = insert_call(graph, anchor, CONVERT, (fused, torch.int64))
            user.replace_all_uses_with(widened)
    kind = "no mask" if mask is None else {"keep": "bool mask", "drop": "bool mask", "add": "additive mask"}[mask[0]]
    if m["fill"] is not None:
        kind += f" filled with {m['fill']:g}"
    detail = (f"{kind}, k={count}, scale={m['scale']:.6g}{', fp8 k_scale' if m['k_scale'] is not None else ''}"
              f"{', one sequence' if not batched else ''}{', in topk order' if m['ordered'] else ''}")
    ctx.site(anchor, "dsfuse.indexer_topk", [m["q"], m["k"], m["weights"], m["k_scale"], mask_node], detail=detail)


def _replace_masked_checks(graph: torch.fx.Graph, anchor: torch.fx.Node, fused: torch.fx.Node, mask_node,
                           m: dict) -> None:
    """`values == -inf` marks the picks that landed on masked keys (the scores are finite elsewhere), so
    it is the mask read at the picked indices: O(S*k) work instead of keeping the values."""
    picked = insert_call(graph, anchor, CONVERT, (fused, torch.int64))
    if mask_node is None:
        masked = insert_call(graph, anchor, aten.lt.Scalar, (picked, 0))
    else:
        sizes = [size_arg(graph, anchor, fused, d) for d in range(len(shape(fused)) - 1)]
        sizes.append(size_arg(graph, anchor, m["k"], -2))
        full = insert_call(graph, anchor, aten.expand.default, (mask_node, sizes))
        gathered = insert_call(graph, anchor, aten.gather.default, (full, -1, picked))
        if dtype(mask_node) == torch.bool:
            masked = insert_call(graph, anchor, aten.bitwise_not.default, (gathered,))
        else:
            masked = insert_call(graph, anchor, aten.eq.Scalar, (gathered, float("-inf")))
    for check in m["masked_checks"]:
        check.replace_all_uses_with(masked)
