"""Helpers shared by the passes: reading fake-tensor metadata, proving size relations symbolically,
and splicing a fused op into the graph (walking through layout ops lives in `dims.py`)."""

from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
prims = torch.ops.prims

VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
CONVERT = prims.convert_element_type.default


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


def is_op(node: Any, *targets: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def scalar_arg(node: Any) -> float | None:
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    return None


def only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def insert_call(graph: torch.fx.Graph, before: torch.fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """Insert `target(*args)` before `before`, with its fake value computed from the inputs' fake values."""
    kwargs = kwargs or {}
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Node)]
    fake_args = torch.fx.map_arg((args, kwargs), lambda n: n.meta["val"])
    values = torch.utils._pytree.tree_leaves([n.meta.get("val") for n in flat])  # a list-valued node's tensors too
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        raise RuntimeError(f"no fake mode found on the inputs of {target}")
    with fake_mode:
        node.meta["val"] = target(*fake_args[0], **fake_args[1])
    return node


def _returns_its_input(node: torch.fx.Node) -> bool:
    """A call of Inductor's `cat_splitwithsizes_replace` lowering: `split_with_sizes(cat(input_))` with the cat's
    own sizes, left in the post-grad graph as a call that returns `input_` (seen under tensor-parallel plans)."""
    target = getattr(node.target, "func", node.target)
    return node.op == "call_function" and getattr(target, "__name__", "") == "cat_splitwithsizes_replace"


def inline_identity_lowerings(graph: torch.fx.Graph) -> int:
    """Replace each read of such a call by the input it returns, so a pass sees the tensors it splits apart
    (HF's kv split under a TP plan); returns how many calls were removed."""
    removed = 0
    for node in list(graph.nodes):
        if not _returns_its_input(node) or node.args or set(node.kwargs) != {"input_"}:
            continue
        parts = node.kwargs["input_"]
        readers = list(node.users)
        if not all(is_op(r, operator.getitem) and isinstance(r.args[1], int) for r in readers):
            continue
        for reader in readers:
            reader.replace_all_uses_with(parts[reader.args[1]])
            graph.erase_node(reader)
        graph.erase_node(node)
        removed += 1
    return removed
