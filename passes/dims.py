"""Following tensor dimensions through layout-only ops, so a pass can recognise the same contraction
however it was spelled (`matmul` broadcasting, `einsum`, explicit `bmm`).

Each dimension carries a tuple of atoms `(name, size)`: a merged dim carries several, a size-1 dim
none, and a dim created by `expand` carries the wildcard `("*", size)`, which matches any atom of
the same size. Sizes may be SymInts; every comparison is proven symbolically or treated as a
mismatch, so a dynamic graph is never specialised.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .graph_utils import LAYOUT_OPS, VIEW_OPS, aten, is_op, is_upcast, same_size, shape, walk_back

Atom = tuple[str, object]
Labels = list[tuple[Atom, ...]]

WILDCARD = "*"


def _is_one(size) -> bool:
    return same_size(size, 1)


def layout_chain(node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """(leaf, ops): walk back through layout ops and fp32 upcasts; `ops` run from the leaf forward."""
    chain = walk_back(node, lambda n: is_op(n, *LAYOUT_OPS) or is_upcast(n))
    return chain[0], chain[1:]


def views_along(chain: list[torch.fx.Node], keep: Callable[[torch.fx.Node], bool]) -> list[tuple[torch.fx.Node, list]]:
    """Every (node, the ops after it) on `chain` ([leaf, ..., node]) that `keep` accepts, nearest the leaf first."""
    return [(node, chain[i + 1:]) for i, node in enumerate(chain) if keep(node)]


def views_of_rank(node, rank: int) -> list[tuple[torch.fx.Node, list[torch.fx.Node]]]:
    """Every (tensor, ops after it) on `layout_chain(node)` with `rank` dims, nearest the leaf first."""
    leaf, ops = layout_chain(node)
    return views_along([leaf, *ops], lambda n: len(shape(n)) == rank)


def leaf_of_rank(node, rank: int) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """Like `layout_chain`, but stop at the node nearest the true leaf that has `rank` dims.

    A fused op wants, say, keys as [B, T, D]; a model may hold them as [B, T, 1, D] and squeeze. The
    dims are checked afterwards, so picking a view of the leaf never accepts a wrong contraction.
    """
    found = views_of_rank(node, rank)
    return found[0] if found else layout_chain(node)


def leaf_labels(node, names: Sequence[str]) -> Labels | None:
    dims = shape(node)
    if len(dims) != len(names):
        return None
    return [((name, size),) if not _is_one(size) else () for name, size in zip(names, dims)]


def normalise(labels: Labels) -> list[tuple[Atom, ...]]:
    """Drop atoms of size 1 (they can be squeezed or merged anywhere without changing the data)."""
    return [tuple(a for a in dim if not _is_one(a[1])) for dim in labels]


def atoms_match(a: Atom, b: Atom) -> bool:
    if WILDCARD in (a[0], b[0]):
        return same_size(a[1], b[1])
    return a[0] == b[0]


def dims_match(x: tuple[Atom, ...], y: tuple[Atom, ...]) -> bool:
    x = tuple(a for a in x if not _is_one(a[1]))
    y = tuple(a for a in y if not _is_one(a[1]))
    return len(x) == len(y) and all(atoms_match(a, b) for a, b in zip(x, y))


def _concrete(x: tuple[Atom, ...], y: tuple[Atom, ...]) -> tuple[Atom, ...]:
    """Of two matching dims, the one that names real atoms."""
    return x if all(a[0] != WILDCARD for a in x) else y


def _reshape(labels: Labels, out_shape) -> Labels | None:
    queue = [a for dim in labels for a in dim if not _is_one(a[1])]
    result: Labels = []
    for size in out_shape:
        if _is_one(size):
            result.append(())
            continue
        taken, product = [], 1
        while queue and not same_size(product, size):
            atom = queue.pop(0)
            taken.append(atom)
            product = product * atom[1]
        if not same_size(product, size):
            return None
        result.append(tuple(taken))
    return result if not queue else None


def apply_op(labels: Labels, node: torch.fx.Node) -> Labels | None:
    """Labels of `node`'s output given its input's labels, or None for an op this cannot follow."""
    target, args = node.target, node.args
    rank = len(labels)
    if target in (aten.clone.default, aten.contiguous.default) or is_upcast(node):
        return list(labels)
    if target is aten.unsqueeze.default:
        dim = args[1] % (rank + 1)
        return labels[:dim] + [()] + labels[dim:]
    if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        dims = range(rank) if target is aten.squeeze.default else (
            [args[1]] if target is aten.squeeze.dim else list(args[1]))
        drop = {d % rank for d in dims if _is_one(shape(node.args[0])[d % rank])}
        return [dim for i, dim in enumerate(labels) if i not in drop]
    if target is aten.permute.default:
        return [labels[p % rank] for p in args[1]]
    if target is aten.transpose.int:
        a, b = args[1] % rank, args[2] % rank
        out = list(labels)
        out[a], out[b] = out[b], out[a]
        return out
    if target is aten.expand.default:
        out_shape = shape(node)
        padded = [()] * (len(out_shape) - rank) + list(labels)
        return [dim if dim or _is_one(size) else ((WILDCARD, size),) for dim, size in zip(padded, out_shape)]
    if target in VIEW_OPS:
        return _reshape(labels, shape(node))
    return None


def follow(labels: Labels | None, ops: list[torch.fx.Node]) -> Labels | None:
    """`labels` after each of `ops` in order; None once an op does not carry them (or they are None)."""
    for op in ops:
        if labels is None:
            return None
        labels = apply_op(labels, op)
    return labels


def bmm_labels(a: Labels, b: Labels) -> Labels | None:
    """Output labels of `bmm(a, b)` (or of `mm(a, b)`: Inductor turns a batch-1 bmm into squeeze, mm,
    unsqueeze on CUDA), or None unless batch and contracted dims carry the same atoms."""
    if len(a) == len(b) == 2:
        return [a[0], b[1]] if dims_match(a[1], b[0]) else None
    if len(a) != 3 or len(b) != 3 or not dims_match(a[0], b[0]) or not dims_match(a[2], b[1]):
        return None
    return [_concrete(a[0], b[0]), a[1], b[2]]


def contracted(a: Labels, b: Labels) -> tuple[Atom, ...]:
    return tuple(x for x in _concrete(a[-1], b[-2]) if not _is_one(x[1]))


def broadcast(a: Labels, b: Labels) -> Labels | None:
    """Labels of an elementwise op over two broadcast operands."""
    rank = max(len(a), len(b))
    a = [()] * (rank - len(a)) + list(a)
    b = [()] * (rank - len(b)) + list(b)
    out = []
    for x, y in zip(a, b):
        if not normalise([x])[0]:
            out.append(y)
        elif not normalise([y])[0] or dims_match(x, y):
            out.append(_concrete(x, y) if normalise([y])[0] else x)
        else:
            return None
    return out


def names(labels: Labels) -> list[tuple[str, ...]]:
    return [tuple(a[0] for a in dim) for dim in normalise(labels)]
