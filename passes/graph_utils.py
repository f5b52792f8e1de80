"""Helpers shared by the passes: the op sets every family walks through, reading fake-tensor metadata,
proving size relations symbolically, and splicing a fused op into the graph (following labelled dims
through layout ops lives in `dims.py`, bringing spellings to one form in `canonicalize.py`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import math
import operator

import torch
import torch._inductor.inductor_prims  # noqa: F401  (defines prims.prepare_softmax_online)
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .context import NoMatch

aten = torch.ops.aten
prims = torch.ops.prims

CONVERT = prims.convert_element_type.default
VIEW_OPS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
SQUEEZE_OPS = frozenset({aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})
TRANSPOSE_OPS = frozenset({aten.permute.default, aten.transpose.int})
# Layout ops that keep row-major element order: an element's flat position is the same before and after
# (so, in moe_experts, a decoded weight value's flat position is its position in the weight).
ORDER_KEEPING_OPS = VIEW_OPS | SQUEEZE_OPS | {aten.unsqueeze.default, aten.clone.default, aten.contiguous.default}
# Every op that only moves or repeats elements: what a matcher looks through to find a tensor's source.
LAYOUT_OPS = ORDER_KEEPING_OPS | TRANSPOSE_OPS | {aten.expand.default}
WHERE_OPS = frozenset({aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar})
SPLIT_OPS = frozenset({aten.split_with_sizes.default, aten.split.Tensor})
NOT_OPS = frozenset({aten.bitwise_not.default, aten.logical_not.default})
AND_OPS = frozenset({aten.bitwise_and.Tensor, aten.logical_and.default})
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
END = 9223372036854775807  # how a slice to the end appears in the graph
# A finite bias this negative masks a key exactly (exp underflows to 0) except in a row where every key is
# masked: the cuDNN path of SDPA turns bool masks into such a bias (-65536 in bf16), and a row with a finite
# sink logit (V4) always keeps one.
FINITE_MASK_BIAS = -1e4


def walk_back(node: Any, through: Callable[[Any], bool]) -> list:
    """[leaf, ..., node]: follow first arguments back while `through(node)` holds."""
    chain = [node]
    while through(node):
        node = node.args[0]
        chain.append(node)
    return chain[::-1]


def reaches_back(node: Any, found: Callable[[torch.fx.Node], bool], through: Callable[[torch.fx.Node], bool],
                 depth: int) -> bool:
    """Whether a node for which `found` holds is among `node` and its ancestors up to `depth` steps back, walking back
    only from nodes for which `through` holds."""
    pending, seen = [(node, 0)], set()
    while pending:
        n, level = pending.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or level > depth:
            continue
        seen.add(n)
        if found(n):
            return True
        if through(n):
            pending.extend((arg, level + 1) for arg in n.all_input_nodes)
    return False


def walk_forward(node: Any, through: Callable[[Any], bool]) -> list:
    """[node, ..., last]: follow single users forward while `through(user)` holds."""
    chain = [node]
    while len(node.users) == 1 and through(next(iter(node.users))):
        node = next(iter(node.users))
        chain.append(node)
    return chain


def strip(node: Any, targets: Iterable) -> Any:
    """The first node below `node` (through its first arguments) that is not one of `targets`."""
    targets = tuple(targets)
    return walk_back(node, lambda n: is_op(n, *targets))[0]


def val(node: Any) -> Any:
    """The fake value Inductor attached to a node (or the constant itself)."""
    if isinstance(node, torch.fx.Node):
        return node.meta.get("val")
    return node


def tensor_val(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def shape(node: Any) -> tuple:
    v = tensor_val(node)
    return tuple(v.shape) if v is not None else ()


def dtype(node: Any) -> torch.dtype | None:
    v = tensor_val(node)
    return v.dtype if v is not None else None


def describe(node: Any) -> str:
    v = tensor_val(node)
    if v is None:
        return str(node)
    dims = "x".join(str(s) for s in v.shape)
    return f"{node}:{str(v.dtype).replace('torch.', '')}[{dims}]"


def same_size(a: Any, b: Any) -> bool:
    """True only when a == b is proven for every value of the graph's symbols (no new guard)."""
    return statically_known_true(a == b) if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt) else a == b


def same_shape(a: Iterable, b: Iterable) -> bool:
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def node_arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """A call's argument, given at position `index` or as keyword `name` (else `default`)."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def broadcasts_to(small: Iterable, target: Iterable) -> bool:
    """Proven (no guard) that a tensor of shape `small` broadcasts to `target` (dims aligned from the right)."""
    small, target = tuple(small), tuple(target)
    if len(small) > len(target):
        return False
    return all(same_size(a, 1) or same_size(a, b) for a, b in zip(small[::-1], target[::-1]))


def is_op(node: Any, *targets: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _reduced_in_own_dtype(node: torch.fx.Node, asked: Any) -> bool:
    """A reduction's `dtype=` that is what it gives anyway: none, its input's, or int64 over integers or bools."""
    source = dtype(node.args[0])
    return asked is None or asked == source or (
        asked == torch.int64 and source is not None and not source.is_floating_point and not source.is_complex)


# Keyword arguments that change what a call computes from what its operands alone say: (name, position, default,
# whether a value is the default) per op. An add's or sub's `alpha` (x + alpha * y), a reduction's `dtype` (the input
# cast first: a sum or mean rounded to bf16), a softmax's `half_to_float` (a half input's softmax in fp32). A
# division's rounding mode is its own overload (`div.Tensor_mode`), which a walk asks for by name.
KEYWORD_DEFAULTS: dict[Any, tuple[str, int, Any, Callable[[torch.fx.Node, Any], bool]]] = {
    **dict.fromkeys((aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar),
                    ("alpha", 2, 1, lambda node, alpha: alpha == 1)),
    **dict.fromkeys((aten.sum.dim_IntList, aten.mean.dim), ("dtype", 3, None, _reduced_in_own_dtype)),
    **dict.fromkeys((aten.sum.default, aten.mean.default), ("dtype", 1, None, _reduced_in_own_dtype)),
    **dict.fromkeys((aten._softmax.default, aten._log_softmax.default),
                    ("half_to_float", 2, False, lambda node, half_to_float: not half_to_float)),
}


def changed_keyword(node: torch.fx.Node) -> str | None:
    """`name=value` of the call's `KEYWORD_DEFAULTS` argument where it is not at its default, else None."""
    if node.target not in KEYWORD_DEFAULTS:
        return None
    name, position, default, at_default = KEYWORD_DEFAULTS[node.target]
    value = node_arg(node, position, name, default)
    return None if at_default(node, value) else f"{name}={value}"


class KeywordMiss(NoMatch):
    """A spelling the walk reads, but for a keyword argument that changes its math: a near-miss wherever the walk
    stands (a caller that passes over other misses of a part lets this one through)."""


def refuse_changed_keyword(node: torch.fx.Node, what: str) -> None:
    """Raise a `KeywordMiss` when `node`, which a walk is about to read by its operands as `what`, has a
    `changed_keyword`. Where no probe runs what the walk read (no verifier covers it), this is what keeps
    `add(x, y, alpha=2)` from being taken for x + y; where one does, the walk may leave the call to it."""
    changed = changed_keyword(node)
    if changed is not None:
        raise KeywordMiss(f"{what}: {node.target} with {changed}, which changes what its operands say it computes")


def other_operand(node: torch.fx.Node, known: Any) -> Any:
    """The operand of a binary call that is not `known`, or None when neither is."""
    a, b = node.args[:2]
    return b if a is known else a if b is known else None


def is_upcast(node: Any) -> bool:
    """A convert to fp32 (`x.float()`)."""
    return is_op(node, CONVERT) and node.args[1] == torch.float32


def scalar_constant(value: Any) -> float | bool | None:
    """A python scalar, or the value of a 0-d `full` / `scalar_tensor` node."""
    if isinstance(value, (bool, int, float)):
        return value
    if is_op(value, aten.full.default) and len(shape(value)) == 0:
        return value.args[1]
    if is_op(value, aten.scalar_tensor.default):
        return value.args[0]
    return None


def fill_value(value: Any) -> float | bool | None:
    """The value of a `full(shape, c)` node of any shape, or a `scalar_constant`."""
    if is_op(value, aten.full.default):
        return value.args[1]
    return scalar_constant(value)


def is_neg_inf(value: Any) -> bool:
    return isinstance(value, float) and math.isinf(value) and value < 0


def masking_bias(value: Any) -> str | None:
    """'inf' for a -inf bias, 'finite' for one at most `FINITE_MASK_BIAS`, None for one that masks nothing."""
    if is_neg_inf(value):
        return "inf"
    if isinstance(value, float) and value <= FINITE_MASK_BIAS:
        return "finite"
    return None


def scale_factor(node: Any) -> float | None:
    """The constant factor of `x * c`, `c * x` or `x / c` (c a python number), else None."""
    if is_op(node, aten.mul.Tensor, aten.mul.Scalar):
        a, b = node.args[:2]
        if scalar_arg(b) is not None and isinstance(a, torch.fx.Node):
            return scalar_arg(b)
        if scalar_arg(a) is not None and isinstance(b, torch.fx.Node):
            return scalar_arg(a)
    if is_op(node, aten.div.Tensor, aten.div.Scalar) and scalar_arg(node.args[1]) not in (None, 0.0):
        return 1.0 / scalar_arg(node.args[1])
    return None


def scaled_input(node: torch.fx.Node) -> Any:
    """The tensor operand of a constant scaling (`scale_factor` is not None)."""
    a, b = node.args[:2]
    return a if isinstance(a, torch.fx.Node) else b


def slice_args(node: torch.fx.Node) -> tuple:
    """(dim, start, end, step) of a `slice.Tensor` node, defaults filled in (an open end is `END`), symbolic
    bounds as SymInts."""
    args = list(node.args[1:5]) + [0, None, None, 1][len(node.args) - 1:]
    dim, start, end, step = (val(a) for a in args[:4])
    return dim, start or 0, END if end is None else end, step or 1


def slice_position(bound: Any, size: Any) -> Any:
    """A slice bound (of `slice_args`) as a position in a dim of `size`: `END` is the size, a negative int counts
    from the end."""
    if isinstance(bound, int) and bound >= END:
        return size
    if isinstance(bound, int) and bound < 0:
        return bound + size
    return bound


def scalar_arg(node: Any) -> float | None:
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    return None


def unspecialised_float(node: Any) -> bool:
    """Whether `node` is a 0-d floating tensor in the graph where the source had a Python scalar: what
    `torch.compile(dynamic=True)` makes of a float argument (`dsfuse.module_floats` specialises module attributes)."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


UNSPECIALISED_FLOAT = ("is a 0-d tensor, not a constant: a Python float passed to the compiled call under "
                       "torch.compile(dynamic=True) is a graph input whose value may change between calls (dsfuse "
                       "bakes in the floats it reads from module attributes, guarded, not the call's arguments)")


def only_user(node: torch.fx.Node, *targets: Any) -> torch.fx.Node | None:
    """The node's single user (one of `targets`' calls, when given), or None."""
    users = list(node.users)
    return users[0] if len(users) == 1 and (not targets or is_op(users[0], *targets)) else None


def users_of(node: torch.fx.Node, *targets: Any) -> list[torch.fx.Node]:
    """The node's users that call one of `targets`."""
    return [u for u in node.users if is_op(u, *targets)]


def normalised_by(scale: torch.fx.Node, x: torch.fx.Node, div_sqrt: bool) -> torch.fx.Node | None:
    """The one node that normalises `x` by an RMSNorm's `scale`: `x / scale` with `div_sqrt` (scale a sqrt; the
    quotient, not a product by its reciprocal), else `x * scale` (either order); None when there is not exactly
    one."""
    if div_sqrt:
        found = [u for u in users_of(scale, aten.div.Tensor) if u.args[:2] == (x, scale)]
    else:
        found = [u for u in users_of(scale, aten.mul.Tensor) if other_operand(u, scale) is x]
    return found[0] if len(found) == 1 else None


def is_last_dim(node: Any, dims_arg: Any, dim: int = -1) -> bool:
    """Whether a reduction's dims argument names exactly the last dim of `node` (or `dim`)."""
    rank = len(shape(node))
    dims = dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg]
    return rank > 0 and len(dims) == 1 and isinstance(dims[0], int) and dims[0] % rank == dim % rank


def is_last_dim_cat(node: Any) -> bool:
    """Whether `node` is a `cat` along its last dim."""
    return is_op(node, aten.cat.default) and is_last_dim(node, node_arg(node, 1, "dim", 0))


PREPARE_SOFTMAX_ONLINE = prims.prepare_softmax_online.default


def softmax_parts(x: Any, dim: int = -1) -> dict | None:
    """A softmax over the last dim of `x` (or `dim`) among its users, in either form Inductor hands the passes:
    amax / sub / exp / sum / div, or (CUDA, Inductor's online-softmax pattern) `prepare_softmax_online` giving
    the max and the sum, then sub / exp / div. Returns its nodes (stats: the amax or the online call; row_max,
    row_sum, sub, exp, probs), or None."""
    if not isinstance(x, torch.fx.Node):
        return None
    stats = [u for u in x.users if is_op(u, aten.amax.default, PREPARE_SOFTMAX_ONLINE) and is_last_dim(x, u.args[1], dim)
             and (u.target is PREPARE_SOFTMAX_ONLINE or (len(u.args) > 2 and u.args[2]))]
    if len(stats) != 1:
        return None
    online = stats[0].target is PREPARE_SOFTMAX_ONLINE
    if online:
        getters = {u.args[1]: u for u in stats[0].users if u.target is operator.getitem}
        if set(getters) != {0, 1}:
            return None
        row_max, row_sum = getters[0], getters[1]
    else:
        row_max, row_sum = stats[0], None
    subs = [u for u in x.users if is_op(u, aten.sub.Tensor) and u.args[0] is x and u.args[1] is row_max]
    if len(subs) != 1:
        return None
    exp = only_user(subs[0])
    if not is_op(exp, aten.exp.default):
        return None
    if row_sum is None:
        sums = [u for u in exp.users if is_op(u, aten.sum.dim_IntList) and is_last_dim(exp, u.args[1], dim)
                and len(u.args) > 2 and u.args[2]]
        if len(sums) != 1:
            return None
        row_sum = sums[0]
    divs = [u for u in exp.users if is_op(u, aten.div.Tensor) and u.args[0] is exp and u.args[1] is row_sum]
    if len(divs) != 1 or len(exp.users) != (1 if online else 2):
        return None
    return dict(stats=stats[0], row_max=row_max, row_sum=row_sum, sub=subs[0], exp=exp, probs=divs[0])


def _rows_all_neg_inf(cond, check: torch.fx.Node) -> bool:
    """Whether `cond` is `~any(~(x == -inf), dim=-1, keepdim=True)`, with `check` the `x == -inf`."""
    if not is_op(cond, *NOT_OPS):
        return False
    row_any = cond.args[0]
    if not (is_op(row_any, aten.any.dim) and row_any.args[1] in (-1, len(shape(check)) - 1)):
        return False
    inner = row_any.args[0]
    return is_op(inner, *NOT_OPS) and inner.args[0] is check


def attention_softmax(x: torch.fx.Node) -> dict | None:
    """Recognise Inductor's decomposed softmax over the last dim of `x` (optionally upcast first):
    amax / sub / exp / sum / div, or on CUDA the online form (`prepare_softmax_online` giving max and
    sum, then sub / exp / div), and the SDPA math's `where(row all -inf, 0, probs)` around it."""
    source = x
    users = list(x.users)
    if len(users) == 1 and is_upcast(users[0]):
        x = users[0]
        users = list(x.users)
    parts = softmax_parts(x)
    if parts is None:
        return None
    probs, safe = parts["probs"], False
    expected_users = {parts["sub"], parts["stats"]}
    checks = [u for u in users if is_op(u, aten.eq.Scalar) and is_neg_inf(u.args[1])]
    user = only_user(probs)
    if len(checks) == 1 and is_op(user, aten.where.self) and user.args[2] is probs and fill_value(user.args[1]) == 0 \
            and _rows_all_neg_inf(user.args[0], checks[0]):
        probs, safe = user, True
        expected_users |= set(checks)
    if set(users) != expected_users:
        raise NoMatch("the attention scores are also used outside the softmax")
    return dict(input=source, probs=probs, safe=safe)


def in_graph_order(nodes: Iterable[torch.fx.Node]) -> list[torch.fx.Node]:
    """`nodes` (of one graph) sorted in the order the graph runs them."""
    nodes = list(nodes)
    if not nodes:
        return []
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


def fake_call(target: Any, args: tuple, kwargs: dict | None = None) -> Any:
    """`target(*args, **kwargs)` on the fake values of the argument nodes: what a new node would hold."""
    kwargs = kwargs or {}
    flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Node)]
    fake_args = torch.fx.map_arg((args, kwargs), lambda n: n.meta["val"])
    values = torch.utils._pytree.tree_leaves([n.meta.get("val") for n in flat])  # a list-valued node's tensors too
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        raise RuntimeError(f"no fake mode found on the inputs of {target}")
    with fake_mode:
        return target(*fake_args[0], **fake_args[1])


def size_arg(graph: torch.fx.Graph, before: torch.fx.Node, node: torch.fx.Node, dim: int) -> Any:
    """`node`'s size at `dim` as a new node's argument: the int, or a `sym_size` node inserted before `before`
    when it is symbolic (never specialised)."""
    size = shape(node)[dim]
    return size if isinstance(size, int) else insert_call(graph, before, aten.sym_size.int, (node, dim))


def size_args(graph: torch.fx.Graph, before: torch.fx.Node, node: torch.fx.Node) -> list:
    """Every size of `node` as new nodes' arguments (`size_arg`)."""
    return [size_arg(graph, before, node, d) for d in range(len(shape(node)))]


def insert_call(graph: torch.fx.Graph, before: torch.fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """Insert `target(*args)` before `before`, with its fake value computed from the inputs' fake values."""
    value = fake_call(target, args, kwargs)
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = value
    return node


SLICE_END = 9223372036854775807  # how a slice to the end appears in the graph


def piece_of(node: Any) -> tuple[torch.fx.Node, int, Any, Any] | None:
    """(source, dim, start, end) when `node` is the contiguous range [start, end) of `source` along `dim`: a step-1
    `slice`, or a piece of `split_with_sizes` (`split(...)[i]` and `x[..., a:b]` read the same elements); dim is
    non-negative and the bounds are sizes (SymInts where the graph's are)."""
    if is_op(node, aten.slice.Tensor):
        source = node.args[0]
        args = list(node.args[1:]) + [None] * (4 - len(node.args[1:]))
        dim, start, end, step = (0 if args[0] is None else args[0]), args[1], args[2], args[3]
        if step not in (None, 1) or not shape(source):
            return None
        dim %= len(shape(source))
        size = shape(source)[dim]
        start = 0 if start is None else size + start if isinstance(start, int) and start < 0 else start
        end = size if end is None or isinstance(end, int) and end >= SLICE_END else (
            size + end if isinstance(end, int) and end < 0 else end)
        return source, dim, start, end
    if is_op(node, operator.getitem) and is_op(node.args[0], aten.split_with_sizes.default):
        split, index = node.args
        source, sizes = split.args[0], list(split.args[1])
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if not shape(source):
            return None
        return source, dim % len(shape(source)), sum(sizes[:index]), sum(sizes[:index + 1])
    return None


def element_of(node: Any) -> tuple[torch.fx.Node, int, int] | None:
    """(source, dim, index) when `node` is `source.select(dim, index)` or `source.unbind(dim)[index]` (the same
    view); dim and index non-negative."""
    if is_op(node, aten.select.int):
        source, dim, index = node.args[:3]
    elif is_op(node, operator.getitem) and is_op(node.args[0], aten.unbind.int):
        source = node.args[0].args[0]
        dim = node.args[0].args[1] if len(node.args[0].args) > 1 else node.args[0].kwargs.get("dim", 0)
        index = node.args[1]
    else:
        return None
    if not shape(source) or not isinstance(index, int):
        return None
    dim %= len(shape(source))
    return source, dim, index % shape(source)[dim] if isinstance(shape(source)[dim], int) else index


LAYOUT_VIEWS = VIEW_OPS | SQUEEZE_OPS | TRANSPOSE_OPS | {aten.unsqueeze.default}


READ_VIEWS = LAYOUT_VIEWS | {aten.select.int, aten.slice.Tensor, aten.expand.default}


def unpadded_inputs_of_fused_ops(graph: torch.fx.Graph) -> int:
    """Mark every buffer a dsfuse op reads, and every view of it, `dislike_padding` for Inductor.

    A dsfuse op asks Inductor for its inputs in the exact strides of their fake values. On a GPU Inductor pads the
    strides of the buffers it allocates (comprehensive padding), and it may decide that while lowering a view of
    the buffer: a `squeeze` of HF's [B, 1, S, T] mask, lowered first, takes padded strides without fixing them; then
    the exact-stride request of the op that reads the whole mask fixes the buffer unpadded, and the view reads past
    it (issue 34: [2, 33, 33] at strides (1152, 33, 1) over 2178 bytes). A buffer a dsfuse op reads gains nothing
    from padding (the op would only have it copied back), so neither it nor any view of it is padded. Returns how
    many nodes were marked."""
    bases = []
    for op in graph.nodes:
        if _fused_output(op) and not is_op(op, operator.getitem):
            for node in op.all_input_nodes:
                while is_op(node, *READ_VIEWS):
                    node = node.args[0]
                bases.append(node)
    marked, pending = 0, bases
    while pending:
        node = pending.pop()
        if node.op != "call_function" or node.meta.get("dislike_padding"):
            continue
        node.meta["dislike_padding"] = True
        marked += 1
        pending.extend(user for user in node.users if is_op(user, *READ_VIEWS))
    return marked


def _fused_output(node: Any) -> bool:
    """Whether `node` is what a dsfuse op returned (the op, or one output of a tuple-returning op)."""
    if is_op(node, operator.getitem):
        node = node.args[0]
    return (isinstance(node, torch.fx.Node) and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "dsfuse")


def _known_contiguous(value: torch.Tensor) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(value.shape, value.stride()))):
        if not (statically_known_true(size == 1) or statically_known_true(stride == expected)):
            return False
        expected = expected * size
    return True


def drop_copies_of_fused_outputs(graph: torch.fx.Graph) -> int:
    """Remove each `clone` of a dsfuse op's output, seen through layout views, where that view is already
    contiguous: the source made the copy for its own layout (HF V4 turns its attention output [B, S, H, D] into
    [B, H, S, D] and back, then `reshape` copies), which the fused op's output no longer needs; Inductor would
    still read and write the whole tensor (0.5 GiB a V4 layer at S=8192).  The views' fake values are recomputed
    first, since a pass replaced what they view.  Returns how many copies went."""
    dropped = 0
    for clone in list(graph.nodes):
        if not is_op(clone, aten.clone.default) or any(user.op == "output" for user in clone.users):
            continue
        if clone.kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
            continue
        chain, source = [], clone.args[0]
        while is_op(source, *LAYOUT_VIEWS):
            chain.append(source)
            source = source.args[0]
        if not _fused_output(source):
            continue
        try:
            for node in reversed(chain):
                node.meta["val"] = fake_call(node.target, node.args, node.kwargs)
        except RuntimeError:
            continue
        value = clone.args[0].meta.get("val")
        if isinstance(value, torch.Tensor) and _known_contiguous(value):
            clone.replace_all_uses_with(clone.args[0])
            graph.erase_node(clone)
            dropped += 1
    return dropped
