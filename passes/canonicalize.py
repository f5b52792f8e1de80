"""One canonicalising pass, run by the pass manager before every family, to a fixpoint: small rewrite
rules that bring equal math to one spelling, so no family has to know every spelling.

Numerics policy. dsfuse computes what the source computes, and a graph that no family rewrites must
compile to the same numbers with dsfuse on as with it off. So every rule is one of two kinds:

* exact (`Rule.exact`): the rewritten graph computes the same bits as the original, for every input, NaN, infinities
  and signed zeros included, both in eager and in Inductor's lowering. Only these change the graph: layout no-ops, a
  cast to a tensor's own dtype or through an exact widening, `add.Scalar` spelled `add.Tensor`, a scalar moved to
  the second operand of a commutative op, `clamp_min(x, 0)` as `relu`, `x * 1` as `x`, `x * x` as `pow(x, 2)`
  (Inductor lowers both to one multiply), a division by a power of two as a multiplication by its exact reciprocal,
  one mask polarity for `where`, a double `~` on a bool mask, a keep-polarity scatter of picks as the negated drop
  one, a bool `index_put` of a scalar as `where`, split/cat coalescing, `~` of an integer comparison as
  the negated comparison, `where(i < 0, 0, i)` on integers as `clamp_min(i, 0)`, `select` of a size-1 dim as
  `squeeze`, a `repeat` of size-1 dims as `expand` + `clone`, and `t[t.argsort()]` as the sort's own values.
* inexact equivalences (`Rule.exact` false): the two forms agree up to rounding (`x / 3` vs `x * (1/3)`, a chain of
  constant scalings vs one collected scale, `sum / n` vs `mean`, a batch-1 `bmm` vs the unbatched `mm` Inductor
  turns it into, a bmm vs the zero-padded bmm Inductor's pad_mm benchmarks faster; each may run another GEMM
  kernel). These never touch the graph: they record the canonical form in `node.meta` (`SCALE`, `MEAN`, `BMM`),
  which a structure matcher may read, and a family that then fuses the site owns the rounding difference (and says
  so in its own numerics notes).

Each rule looks at nodes of a few targets and either rewrites one node (returning True) or leaves it.
`canonicalize` applies them until nothing changes; `apply_rule` applies one, for its tests.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._guards import detect_fake_mode

from .graph_utils import (CONVERT, NOT_OPS, SPLIT_OPS, TRANSPOSE_OPS, VIEW_OPS, aten, dtype, fake_call, is_op,
                          is_upcast, node_arg, only_user, same_shape, same_size, scalar_arg, scalar_constant, shape,
                          slice_args, tensor_val, val)

# Keys of the canonical forms recorded by the inexact rules.
SCALE = "dsfuse_scale"  # (input, factor): the node is `input * factor` up to rounding
MEAN = "dsfuse_mean"  # (input, dims, keepdim): the node is `mean(input, dims, keepdim)` up to rounding
BMM = "dsfuse_bmm"  # (a, b): the node is `bmm(a, b)` of batch-1 operands, computed as an unbatched `mm`
MM = "dsfuse_mm"  # (a, b): the node is `mm(a, b)`, computed by Inductor's pad_mm on zero-padded operands

MAX_ROUNDS = 32

# Casts that represent every value of the source dtype exactly in the target dtype.
EXACT_WIDENINGS = {
    torch.float16: (torch.float32, torch.float64),
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
    torch.float8_e4m3fn: (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    torch.float8_e5m2: (torch.float16, torch.bfloat16, torch.float32, torch.float64),
}
SCALAR_TO_TENSOR = {
    aten.add.Scalar: aten.add.Tensor,
    aten.sub.Scalar: aten.sub.Tensor,
    aten.mul.Scalar: aten.mul.Tensor,
    aten.div.Scalar: aten.div.Tensor,
}
# For fp16 every power of two 2^k with |k| <= 14 and its reciprocal are normal numbers.
MAX_EXACT_EXPONENT = 14


@dataclass(frozen=True)
class Rule:
    """One rewrite: `apply(node)` changes the graph (or the node's meta) at `node` and says whether it did."""

    name: str
    targets: tuple | None  # the targets of the nodes it looks at; None: every call_function node
    apply: Callable[[torch.fx.Node], bool]
    exact: bool = True


# ---------------------------------------------------------------------------
# Editing helpers
# ---------------------------------------------------------------------------


def _is_output(node: torch.fx.Node) -> bool:
    return any(user.op == "output" for user in node.users)


def _replace(node: torch.fx.Node, new: Any, fresh: bool = False) -> bool:
    """Send `node`'s readers to `new` and drop `node` (and what only it read, if now unused).

    A node the graph returns is replaced only by a `fresh` node (one built for it): replacing it by an
    existing node could make an output alias an input or another output, which Inductor must not see
    appear (the same care as its `remove_noop_ops`).
    """
    if new is node or not fresh and _is_output(node):
        return False
    node.replace_all_uses_with(new)
    _erase_unused(node)
    return True


def _erase_unused(node: torch.fx.Node) -> None:
    """Erase `node` if nothing reads it and it has no side effect, then its inputs likewise."""
    if node.op != "call_function" or node.users or node.is_impure():
        return
    inputs = [a for a in node.all_input_nodes]
    node.graph.erase_node(node)
    for arg in inputs:
        _erase_unused(arg)


def _call(before: torch.fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> torch.fx.Node | None:
    """A new node `target(*args)` before `before`, or None if its fake value cannot be computed."""
    try:
        value = fake_call(target, args, kwargs)
    except Exception:  # noqa: BLE001  (a shape the new spelling cannot take: leave the graph as it was)
        return None
    with before.graph.inserting_before(before):
        node = before.graph.call_function(target, args, kwargs or {})
    node.meta["val"] = value
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in before.meta:
            node.meta[key] = before.meta[key]
    return node


def _swap(node: torch.fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> bool:
    """Replace `node` by a new `target(*args)`; False (graph unchanged) if that cannot be built or placed."""
    new = _call(node, target, args, kwargs)
    if new is None:
        return False
    old, value = tensor_val(node), new.meta["val"]
    same_kind = old is not None and value.dtype == old.dtype and same_shape(value.shape, old.shape)
    if not same_kind or not _replace(node, new, fresh=True):
        node.graph.erase_node(new)
        return False
    return True


# ---------------------------------------------------------------------------
# Exact rules
# ---------------------------------------------------------------------------


def view_of_view(node: torch.fx.Node) -> bool:
    """`view(view(x, a), b)` -> `view(x, b)`: one reshape says the same."""
    inner = node.args[0]
    return is_op(inner, *VIEW_OPS) and _swap(node, node.target, (inner.args[0], *node.args[1:]), node.kwargs)


def _no_op(node: torch.fx.Node) -> bool:
    x = node.args[0]
    if not isinstance(x, torch.fx.Node) or tensor_val(x) is None or tensor_val(node) is None:
        return False
    if not same_shape(shape(node), shape(x)):
        return False
    if node.target is aten.permute.default:
        rank = len(shape(x))
        return [d % rank for d in node.args[1]] == list(range(rank))
    if node.target is aten.transpose.int:
        rank = len(shape(x))
        return node.args[1] % rank == node.args[2] % rank
    return True  # a view / reshape / expand to the shape it already has


def no_op_layout(node: torch.fx.Node) -> bool:
    """A view, reshape or expand to the input's own shape, or an identity permute/transpose -> the input."""
    return _no_op(node) and _replace(node, node.args[0])


def convert_to_own_dtype(node: torch.fx.Node) -> bool:
    """`convert(x, x.dtype)` -> `x`."""
    x = node.args[0]
    return dtype(x) is not None and dtype(x) == node.args[1] and _replace(node, x)


def convert_through_widening(node: torch.fx.Node) -> bool:
    """`convert(convert(x, wide), d)` -> `convert(x, d)` when `x -> wide` is exact (so the second cast rounds
    the very values of `x`); with `d == x.dtype` the next round drops the cast altogether."""
    inner = node.args[0]
    if not is_op(inner, CONVERT) or dtype(inner.args[0]) is None:
        return False
    if inner.args[1] not in EXACT_WIDENINGS.get(dtype(inner.args[0]), ()):
        return False
    return _swap(node, CONVERT, (inner.args[0], node.args[1]))


def scalar_overload(node: torch.fx.Node) -> bool:
    """`add.Scalar(x, c)` (and sub, mul, div) -> `add.Tensor(x, c)`: one overload for a python-scalar operand
    (both promote a wrapped number the same way)."""
    return _swap(node, SCALAR_TO_TENSOR[node.target], node.args, node.kwargs)


def scalar_second(node: torch.fx.Node) -> bool:
    """`c * x` -> `x * c`, `c + x` -> `x + c` (no alpha): the constant operand goes second."""
    a, b = node.args[:2]
    if node.kwargs or scalar_arg(a) is None or not isinstance(b, torch.fx.Node):
        return False
    return _swap(node, node.target, (b, a))


def clamp_min_zero_is_relu(node: torch.fx.Node) -> bool:
    """`clamp_min(x, 0)` and `clamp(x, min=0)` -> `relu(x)` for a float `x` (both keep NaN and -0.0 as they are)."""
    x = node.args[0]
    if node.target is aten.clamp.default:
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
        if high is not None:
            return False
    else:
        low = node.args[1]
    if isinstance(low, bool) or low != 0 or dtype(x) is None or not dtype(x).is_floating_point:
        return False  # integer clamps are index arithmetic (expert ids clamped to [0, E)), not activations
    return _swap(node, aten.relu.default, (x,))


def square_is_pow(node: torch.fx.Node) -> bool:
    """`x * x` -> `pow(x, 2)` (Inductor lowers `pow(x, 2)` to that one multiply)."""
    a, b = node.args[:2]
    if a is not b or not isinstance(a, torch.fx.Node) or dtype(a) is None or not dtype(a).is_floating_point:
        return False
    return _swap(node, aten.pow.Tensor_Scalar, (a, 2))


def mul_by_one(node: torch.fx.Node) -> bool:
    """`x * 1` -> `x` for a float `x` (`1 / t` is traced as `reciprocal(t) * 1`): the product is x, bit for bit,
    NaN and signed zeros included."""
    x, one = node.args[:2]
    if node.kwargs or scalar_arg(one) != 1.0 or isinstance(one, bool) or dtype(x) is None \
            or not dtype(x).is_floating_point or dtype(node) != dtype(x) or not same_shape(shape(node), shape(x)):
        return False
    return _replace(node, x)


def _exact_reciprocal(c: Any) -> float | None:
    """1/c when c is a power of two whose reciprocal every float dtype holds exactly, else None."""
    c = scalar_arg(c)
    if c is None or c == 0 or not math.isfinite(c):
        return None
    mantissa, exponent = math.frexp(abs(c))
    if mantissa != 0.5 or abs(exponent - 1) > MAX_EXACT_EXPONENT:
        return None
    return 1.0 / c


def div_by_power_of_two(node: torch.fx.Node) -> bool:
    """`x / 2^k` -> `x * 2^-k`: both round the same exact value once."""
    x, c = node.args[:2]
    reciprocal = _exact_reciprocal(c)
    if node.kwargs or reciprocal is None or dtype(x) is None or not dtype(x).is_floating_point:
        return False
    return _swap(node, aten.mul.Tensor, (x, reciprocal))


def mask_fill_first(node: torch.fx.Node) -> bool:
    """`where(m, x, c)` -> `where(~m, c, x)` for a bool `m`, a constant `c` and a tensor `x`: a mask is
    always read as 'where the condition holds, the fill' (the form `masked_fill` lowers to)."""
    cond, x, fill = node.args
    if scalar_constant(x) is not None or scalar_constant(fill) is None or dtype(cond) != torch.bool:
        return False
    flipped = _call(node, aten.bitwise_not.default, (cond,))
    if flipped is None:
        return False
    if not _swap(node, aten.where.self, (flipped, fill, x)):
        node.graph.erase_node(flipped)
        return False
    return True


def double_not(node: torch.fx.Node) -> bool:
    """`~~m` -> `m` for a bool mask."""
    inner = node.args[0]
    return (is_op(inner, *NOT_OPS) and dtype(inner.args[0]) == torch.bool
            and dtype(node) == torch.bool and _replace(node, inner.args[0]))


def keep_scatter_is_negated_drop(node: torch.fx.Node) -> bool:
    """`full(False).scatter(d, i, True)` -> `~full(True).scatter(d, i, False)`: a selection is always built as
    'True where not picked' (HF's polarity), so its keep form reads as the negation of that."""
    base, dim, index, value = node.args[:4]
    if not (is_op(base, aten.full.default) and base.args[1] is False and dtype(base) == torch.bool and value is True):
        return False
    fake_mode = detect_fake_mode([tensor_val(base)])
    if fake_mode is None:
        return False
    with fake_mode:  # from the base's value: its size list may hold symbolic sizes as graph nodes
        value = torch.full_like(tensor_val(base), True)
    with node.graph.inserting_before(node):
        full = node.graph.call_function(aten.full.default, (base.args[0], True), dict(base.kwargs))
    full.meta["val"] = value
    drop = _call(node, aten.scatter.value, (full, dim, index, False))
    if drop is None:
        node.graph.erase_node(full)
        return False
    if not _swap(node, aten.bitwise_not.default, (drop,)):
        node.graph.erase_node(drop)
        node.graph.erase_node(full)
        return False
    return True


def bool_index_put_is_where(node: torch.fx.Node) -> bool:
    """`x[m] = c` (`index_put(x, [m], c)` with a bool `m` of x's shape and a 0-d `c`, no accumulation) ->
    `where(m, c, x)`: the same elements, the mask in the form every family reads."""
    x, indices, values = node.args[:3]
    accumulate = node_arg(node, 3, "accumulate", False)
    if accumulate or len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
        return False
    mask = indices[0]
    if dtype(mask) != torch.bool or not same_shape(shape(mask), shape(x)) or scalar_constant(values) is None \
            or dtype(values) != dtype(x):
        return False
    return _swap(node, aten.where.self, (mask, values, x))


def _returns_its_input(node: torch.fx.Node) -> bool:
    """A call of Inductor's `cat_splitwithsizes_replace` lowering: `split_with_sizes(cat(input_))` with the
    cat's own sizes, left in the post-grad graph as a call that returns `input_` (seen under tensor-parallel
    plans)."""
    target = getattr(node.target, "func", node.target)
    return node.op == "call_function" and getattr(target, "__name__", "") == "cat_splitwithsizes_replace"


def split_of_cat_identity(node: torch.fx.Node) -> bool:
    """Each read of a `cat_splitwithsizes_replace` call -> the input it returns, so a family sees the
    tensors it splits apart (HF's kv split under a TP plan)."""
    if not _returns_its_input(node) or node.args or set(node.kwargs) != {"input_"}:
        return False
    parts = node.kwargs["input_"]
    readers = list(node.users)
    if not all(is_op(r, operator.getitem) and isinstance(r.args[1], int) for r in readers):
        return False
    if any(_is_output(r) and isinstance(parts[r.args[1]], torch.fx.Node) and parts[r.args[1]].op == "placeholder"
           for r in readers):
        return False
    for reader in readers:
        reader.replace_all_uses_with(parts[reader.args[1]])
        node.graph.erase_node(reader)
    node.graph.erase_node(node)
    return True


def duplicate_split(node: torch.fx.Node) -> bool:
    """A second split of the same tensor with the same sizes -> the first one's pieces."""
    twin = next((u for u in node.args[0].users if u is not node and u.target is node.target
                 and u.args == node.args and u.kwargs == node.kwargs), None)
    if twin is None or not _precedes(twin, node) or not all(is_op(r, operator.getitem) for r in node.users):
        return False
    for reader in list(node.users):
        same = next((u for u in twin.users if is_op(u, operator.getitem) and u.args[1] == reader.args[1]), None)
        if same is None:
            with twin.graph.inserting_after(twin):
                same = twin.graph.call_function(operator.getitem, (twin, reader.args[1]))
            same.meta.update(reader.meta)
        reader.replace_all_uses_with(same)
        node.graph.erase_node(reader)
    node.graph.erase_node(node)
    return True


# The comparison that is true exactly where another is false, for operands without NaN (integers).
NEGATED_COMPARISON = {
    aten.lt.Scalar: aten.ge.Scalar, aten.ge.Scalar: aten.lt.Scalar, aten.le.Scalar: aten.gt.Scalar,
    aten.gt.Scalar: aten.le.Scalar, aten.eq.Scalar: aten.ne.Scalar, aten.ne.Scalar: aten.eq.Scalar,
    aten.lt.Tensor: aten.ge.Tensor, aten.ge.Tensor: aten.lt.Tensor, aten.le.Tensor: aten.gt.Tensor,
    aten.gt.Tensor: aten.le.Tensor, aten.eq.Tensor: aten.ne.Tensor, aten.ne.Tensor: aten.eq.Tensor,
}
MASK_LAYOUT_OPS = VIEW_OPS | TRANSPOSE_OPS | {aten.unsqueeze.default, aten.expand.default}


def _integer(x: Any) -> bool:
    if isinstance(x, torch.fx.Node):
        return dtype(x) is not None and not dtype(x).is_floating_point and not dtype(x).is_complex
    return isinstance(x, int)


def not_of_integer_comparison(node: torch.fx.Node) -> bool:
    """`~(a >= b)` -> `a < b` (and the other five) for integer operands, seen through layout ops between the `~`
    and the comparison (`~(idx >= 0)[:, :, None]` -> `(idx < 0)[:, :, None]`): exact, integers have no NaN.
    Top-k indices with -1 for "no key" are tested both ways round (`idx < 0`, `~(idx >= 0)`)."""
    layouts, inner = [], node.args[0]
    while is_op(inner, *MASK_LAYOUT_OPS):
        layouts.append(inner)
        inner = inner.args[0]
    if dtype(node) != torch.bool or not is_op(inner, *NEGATED_COMPARISON) or not all(map(_integer, inner.args[:2])):
        return False
    negated = _call(node, NEGATED_COMPARISON[inner.target], inner.args, inner.kwargs)
    built = [negated]
    for layout in reversed(layouts):
        if built[-1] is None:
            break
        built.append(_call(node, layout.target, (built[-1], *layout.args[1:]), layout.kwargs))
    if built[-1] is None or not same_shape(shape(built[-1]), shape(node)) or not _replace(node, built[-1], fresh=True):
        for made in reversed(built):
            if made is not None:
                node.graph.erase_node(made)
        return False
    return True


def negative_to_zero_is_clamp(node: torch.fx.Node) -> bool:
    """`where(x < 0, 0, x)` -> `clamp_min(x, 0)` for an integer `x` (how -1 "no key" indices are made safe to read
    with `masked_fill` or `where`, `clamp(min=0)` in other code): exact for every integer."""
    cond, fill, x = node.args
    if not (is_op(cond, aten.lt.Scalar) and cond.args[0] is x and cond.args[1] == 0) or not _integer(x):
        return False
    if isinstance(scalar_constant(fill), bool) or scalar_constant(fill) != 0:
        return False
    return _swap(node, aten.clamp_min.default, (x, 0))


def _precedes(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    node = a.next
    while node.op != "root":
        if node is b:
            return True
        node = node.next
    return False


def select_of_unit_dim_is_squeeze(node: torch.fx.Node) -> bool:
    """`x.select(d, 0)` of a size-1 dim `d` -> `x.squeeze(d)` (`t[:, :, 0]` and `t.squeeze(-1)` read the same
    elements)."""
    x, dim, index = node.args[:3]
    rank = len(shape(x))
    if not rank or index not in (0, -1) or not same_size(shape(x)[dim % rank], 1):
        return False
    return _swap(node, aten.squeeze.dim, (x, dim % rank))


def repeat_of_unit_dims_is_expand(node: torch.fx.Node) -> bool:
    """`x.repeat(r)` that repeats only size-1 dims -> `x.expand(...).clone()`: the same elements in the same order
    in a fresh contiguous tensor (`x.view(T, 1, H).repeat(1, k, 1)` is each row repeated k times, as `expand` says)."""
    x, repeats = node.args[:2]
    dims = shape(x)
    if len(repeats) != len(dims) or not all(r == 1 or same_size(d, 1) for r, d in zip(repeats, dims)):
        return False
    expanded = _call(node, aten.expand.default, (x, list(shape(node))))
    if expanded is None:
        return False
    if not _swap(node, aten.clone.default, (expanded,), {"memory_format": torch.contiguous_format}):
        node.graph.erase_node(expanded)
        return False
    return True


def gather_by_own_sort_is_sorted(node: torch.fx.Node) -> bool:
    """`t[t.argsort()]` -> `t.sort().values` for a 1-D `t`: the elements the permutation gathers are the sorted
    values, bit for bit (argsort is the permutation output of the same sort)."""
    t, indices = node.args[:2]
    if len(indices) != 1 or len(shape(t)) != 1:
        return False
    perm = indices[0]
    if not (is_op(perm, operator.getitem) and perm.args[1] == 1):
        return False
    sort = perm.args[0]
    if not is_op(sort, aten.sort.default, aten.sort.stable) or sort.args[0] is not t:
        return False
    values = next((u for u in sort.users if is_op(u, operator.getitem) and u.args[1] == 0), None)
    if values is None:
        with sort.graph.inserting_after(sort):
            values = sort.graph.call_function(operator.getitem, (sort, 0))
        values.meta["val"] = sort.meta["val"][0]
    if not _precedes(values, node):
        return False
    return _replace(node, values)


# ---------------------------------------------------------------------------
# Inexact equivalences: recorded in node.meta, never rewritten
# ---------------------------------------------------------------------------


def _scale_step(node: torch.fx.Node) -> tuple[torch.fx.Node, float] | None:
    """(x, c) for `x * c` or `x / c` with a python constant c (after `scalar_overload`/`scalar_second`)."""
    if is_op(node, aten.mul.Tensor) and not node.kwargs:
        x, c = node.args[:2]
        if isinstance(x, torch.fx.Node) and scalar_arg(c) is not None:
            return x, scalar_arg(c)
    if is_op(node, aten.div.Tensor) and not node.kwargs:
        x, c = node.args[:2]
        if isinstance(x, torch.fx.Node) and scalar_arg(c) not in (None, 0.0):
            return x, 1.0 / scalar_arg(c)
    return None


def collect_scale(node: torch.fx.Node) -> bool:
    """Record `SCALE = (x, c1 * c2 * ...)` on a chain of constant scalings of `x`."""
    step = _scale_step(node)
    if step is None:
        return False
    x, factor = step
    if SCALE in x.meta:
        x, inner = x.meta[SCALE]
        factor *= inner
    if node.meta.get(SCALE) == (x, factor):
        return False
    node.meta[SCALE] = (x, factor)
    return True


def sum_over_count_is_mean(node: torch.fx.Node) -> bool:
    """Record `MEAN = (x, dims, keepdim)` on `sum(x, dims) / n` (or `* (1/n)`) where n is the number of summed
    elements, also where the sum runs in a narrower dtype and is upcast before the division (`sum(x, dims,
    dtype=float16).float() / n`): a mean up to rounding, whose rounding the reading family's verifier judges."""
    total, n = node.args[:2]
    if is_upcast(total) and is_op(total.args[0], aten.sum.dim_IntList):
        total = total.args[0]
    n = val(n)  # a constant, or the SymInt of a symbolic size
    if node.target is aten.mul.Tensor:  # `sum / 2^k`, spelled `sum * 2^-k` by `div_by_power_of_two`
        n = 1.0 / n if isinstance(n, float) and n != 0 else None
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if node.kwargs or not is_op(total, aten.sum.dim_IntList) or not isinstance(n, (int, torch.SymInt)):
        return False
    if isinstance(n, bool) or MEAN in node.meta:
        return False
    x, dims = total.args[0], total.args[1]
    keepdim = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    x_shape = shape(x)
    if not x_shape or not dims:
        return False
    count = 1
    for d in dims:
        count = count * x_shape[d % len(x_shape)]
    if not same_size(count, n):
        return False
    node.meta[MEAN] = (x, tuple(d % len(x_shape) for d in dims), bool(keepdim))
    return True


def _unbatched(node: Any) -> Any:
    """`t` for a `[1, M, K]` tensor `t` squeezed (or viewed) to `[M, K]`, else None."""
    if is_op(node, aten.squeeze.dim, *VIEW_OPS) and len(shape(node)) == 2:
        t = node.args[0]
        if len(shape(t)) == 3 and same_size(shape(t)[0], 1) and (node.target is not aten.squeeze.dim
                                                               or node.args[1] == 0):
            return t
    return None


def batch_one_mm_is_bmm(node: torch.fx.Node) -> bool:
    """Record `BMM = (a, b)` on `mm(a[0], b[0])[None]` (`unsqueeze` or `view`): a batch-1 bmm as Inductor
    unbatches it. Not rewritten: a bmm and an mm may run different GEMM kernels, so the bits may differ."""
    if BMM in node.meta or len(shape(node)) != 3 or not same_size(shape(node)[0], 1):
        return False
    if node.target is aten.unsqueeze.default and node.args[1] != 0:
        return False
    mm = node.args[0]
    if not is_op(mm, aten.mm.default):
        return False
    a, b = _unbatched(mm.args[0]), _unbatched(mm.args[1])
    if a is None or b is None:
        return False
    node.meta[BMM] = (a, b)
    return True


def _zero_padded(node: Any) -> tuple[Any, int, int] | None:
    """(x, pad of dim -1, pad of dim -2) for `constant_pad_nd(x, [0, p1, 0, p2, (0, 0)])` with value 0 (padding at
    the end of a [B, R, C] operand's two matrix dims, as Inductor's pad_mm writes it); (node, 0, 0) unpadded."""
    if not is_op(node, aten.constant_pad_nd.default):
        return node, 0, 0
    pads = list(node.args[1])
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if value != 0 or len(pads) not in (4, 6) or any(p != 0 for p in pads[0::2]) or pads[4:] not in ([], [0, 0]):
        return None
    return node.args[0], pads[1], pads[3]


def padded_matmul_is_matmul(node: torch.fx.Node) -> bool:
    """Record `BMM = (a, b)` (`MM` for an mm) where Inductor's pad_mm computes `a @ b` as `bmm(pad(a), pad(b))` or
    `mm(pad(a), pad(b))` sliced back: zeros appended to the contraction dim of both operands (and to M / N, cut off
    again by the slices that follow). Recorded on the product, or on the slice that has `a @ b`'s shape. Not
    rewritten: the padded GEMM may run another kernel."""
    rank = 3 if is_op(node, aten.bmm.default) else 2
    left, right = _zero_padded(node.args[0]), _zero_padded(node.args[1])
    if left is None or right is None or len(shape(node)) != rank:
        return False
    (a, k_left, m_pad), (b, n_pad, k_right) = left, right
    if k_left != k_right or not (k_left or m_pad or n_pad) or len(shape(a)) != rank or len(shape(b)) != rank:
        return False
    want = (*shape(a)[:-1], shape(b)[-1])
    product = node
    while not same_shape(shape(product), want):
        product = only_user(product)
        if not is_op(product, aten.slice.Tensor):
            return False
        dim, start, _, step = slice_args(product)
        if dim % rank not in (rank - 2, rank - 1) or start != 0 or step != 1:
            return False
    key = BMM if rank == 3 else MM
    if key in product.meta:
        return False
    product.meta[key] = (a, b)
    return True


def padded_product(left: Any) -> torch.fx.Node | None:
    """The node that computes `left @ b` for `left`'s only use: its bmm, or the product recorded where Inductor's
    pad_mm padded `left` first (`padded_matmul_is_matmul`)."""
    user = only_user(left)
    if is_op(user, aten.bmm.default) and user.args[0] is left:
        return user
    if not is_op(user, aten.constant_pad_nd.default):
        return None
    node = only_user(user)
    while is_op(node, aten.bmm.default, aten.slice.Tensor):
        if BMM in node.meta and node.meta[BMM][0] is left:
            return node
        node = only_user(node)
    return None


def canonical_bmm(node: Any) -> tuple[Any, Any] | None:
    """(a, b) when `node` computes `bmm(a, b)`: as written, or as recorded (`BMM`: a batch-1 `mm`, or a padded bmm
    sliced back)."""
    if isinstance(node, torch.fx.Node) and BMM in node.meta:
        return node.meta[BMM]
    if is_op(node, aten.bmm.default):
        return node.args[0], node.args[1]
    return None


def canonical_mm(node: Any) -> tuple[Any, Any] | None:
    """(a, b) when `node` computes `mm(a, b)`: as written, or as recorded (`MM`: a zero-padded mm sliced back)."""
    if isinstance(node, torch.fx.Node) and MM in node.meta:
        return node.meta[MM]
    if is_op(node, aten.mm.default):
        return node.args[0], node.args[1]
    return None


def canonical_scale(node: Any) -> tuple[Any, float]:
    """(x, c) with `node == x * c` up to rounding, from the recorded `SCALE`; (node, 1.0) when unscaled."""
    if isinstance(node, torch.fx.Node) and SCALE in node.meta:
        return node.meta[SCALE]
    return node, 1.0


def row_mean(square: Any) -> torch.fx.Node | None:
    """The single reader of `square` that is `mean(square, -1, keepdim=True)`: a `mean`, or a `sum / C` recorded as
    one (`MEAN`); None otherwise."""
    users = list(square.users) if isinstance(square, torch.fx.Node) else []
    if len(users) != 1:
        return None
    rank = len(shape(square))
    if is_op(users[0], aten.mean.dim):
        mean = users[0]
        dims = [d % rank for d in mean.args[1]] if len(mean.args) > 1 and mean.args[1] else []
        keepdim = len(mean.args) > 2 and mean.args[2]
        return mean if dims == [rank - 1] and keepdim else None
    total = users[0]
    scaled = list(total.users) if is_op(total, aten.sum.dim_IntList) else []
    if len(scaled) == 1 and is_upcast(scaled[0]):  # the sum in a narrower dtype, upcast before the division
        scaled = list(scaled[0].users)
    marked = scaled[0].meta.get(MEAN) if len(scaled) == 1 else None
    return scaled[0] if marked is not None and marked[0] is square and marked[1:] == ((rank - 1,), True) else None


# ---------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------

RULES: tuple[Rule, ...] = (
    Rule("split_of_cat_identity", None, split_of_cat_identity),
    Rule("duplicate_split", tuple(SPLIT_OPS), duplicate_split),
    Rule("view_of_view", tuple(VIEW_OPS), view_of_view),
    Rule("no_op_layout", (*VIEW_OPS, aten.expand.default, aten.permute.default, aten.transpose.int), no_op_layout),
    Rule("convert_to_own_dtype", (CONVERT,), convert_to_own_dtype),
    Rule("convert_through_widening", (CONVERT,), convert_through_widening),
    Rule("scalar_overload", tuple(SCALAR_TO_TENSOR), scalar_overload),
    Rule("scalar_second", (aten.mul.Tensor, aten.add.Tensor), scalar_second),
    Rule("clamp_min_zero_is_relu", (aten.clamp_min.default, aten.clamp.default), clamp_min_zero_is_relu),
    Rule("square_is_pow", (aten.mul.Tensor,), square_is_pow),
    Rule("mul_by_one", (aten.mul.Tensor,), mul_by_one),
    Rule("div_by_power_of_two", (aten.div.Tensor,), div_by_power_of_two),
    Rule("mask_fill_first", (aten.where.self,), mask_fill_first),
    Rule("double_not", tuple(NOT_OPS), double_not),
    Rule("keep_scatter_is_negated_drop", (aten.scatter.value,), keep_scatter_is_negated_drop),
    Rule("bool_index_put_is_where", (aten.index_put.default,), bool_index_put_is_where),
    Rule("select_of_unit_dim_is_squeeze", (aten.select.int,), select_of_unit_dim_is_squeeze),
    Rule("repeat_of_unit_dims_is_expand", (aten.repeat.default,), repeat_of_unit_dims_is_expand),
    Rule("gather_by_own_sort_is_sorted", (aten.index.Tensor,), gather_by_own_sort_is_sorted),
    Rule("collect_scale", (aten.mul.Tensor, aten.div.Tensor), collect_scale, exact=False),
    Rule("batch_one_mm_is_bmm", (aten.unsqueeze.default, *VIEW_OPS), batch_one_mm_is_bmm, exact=False),
    Rule("padded_matmul_is_matmul", (aten.bmm.default, aten.mm.default), padded_matmul_is_matmul, exact=False),
    Rule("sum_over_count_is_mean", (aten.div.Tensor, aten.mul.Tensor), sum_over_count_is_mean, exact=False),
    Rule("not_of_integer_comparison", tuple(NOT_OPS),
         not_of_integer_comparison),
    Rule("negative_to_zero_is_clamp", (aten.where.self,), negative_to_zero_is_clamp),
)
BY_NAME: dict[str, Rule] = {rule.name: rule for rule in RULES}


def _applies(rule: Rule, node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (rule.targets is None or node.target in rule.targets)


def _sweep(graph: torch.fx.Graph, rules: tuple[Rule, ...], counts: dict[str, int]) -> bool:
    changed = False
    for node in list(graph.nodes):
        for rule in rules:
            if getattr(node, "_erased", False):
                break
            if _applies(rule, node) and rule.apply(node):
                counts[rule.name] = counts.get(rule.name, 0) + 1
                changed = True
    return changed


def canonicalize(graph: torch.fx.Graph, rules: tuple[Rule, ...] = RULES) -> dict[str, int]:
    """Apply `rules` until none changes anything; returns how often each one fired."""
    counts: dict[str, int] = {}
    for _ in range(MAX_ROUNDS):
        if not _sweep(graph, rules, counts):
            return counts
    raise RuntimeError(f"canonicalisation did not reach a fixpoint in {MAX_ROUNDS} rounds: {counts}")


def apply_rule(graph: torch.fx.Graph, name: str) -> int:
    """Apply the one rule `name` to a fixpoint (for its tests); returns how often it fired."""
    return canonicalize(graph, (BY_NAME[name],)).get(name, 0)
