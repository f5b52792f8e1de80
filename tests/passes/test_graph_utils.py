"""The shared graph helpers every pass walks with, each on a small graph built call by call (fake values on
every node, symbolic sizes where a helper must not specialise), and the readers that take a contiguous range of a
tensor (`slice` or a `split` piece) and one element of a dim (`select` or an `unbind` item) as the same thing."""

import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dsfuse.passes.dims import follow, leaf_labels, leaf_of_rank, views_along, views_of_rank
from dsfuse.passes.graph_utils import (CONVERT, END, KeywordMiss, broadcasts_to, changed_keyword, element_of, fake_call,
                                       fill_value, in_graph_order, insert_call, is_last_dim_cat, is_neg_inf, is_upcast,
                                       masking_bias, node_arg, other_operand, piece_of, refuse_changed_keyword,
                                       scale_factor, scaled_input, size_arg, size_args, slice_args, slice_position,
                                       walk_back, walk_forward)

aten = torch.ops.aten


class Builder:
    """A graph built call by call; `dynamic` makes every input size a symbol."""

    def __init__(self, dynamic: bool = False):
        self.graph = torch.fx.Graph()
        self.mode = FakeTensorMode(shape_env=ShapeEnv()) if dynamic else FakeTensorMode()
        self.dynamic = dynamic

    def input(self, *sizes, dtype=torch.float32) -> torch.fx.Node:
        node = self.graph.placeholder(f"x{len(self.graph.nodes)}")
        real = torch.zeros(*sizes, dtype=dtype)
        if self.dynamic:
            from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
            context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(sizes))
            node.meta["val"] = self.mode.from_tensor(real, symbolic_context=context)
        else:
            node.meta["val"] = self.mode.from_tensor(real)
        return node

    def call(self, target, *args, **kwargs) -> torch.fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        if node.all_input_nodes:
            node.meta["val"] = fake_call(target, args, kwargs)
        else:  # a constant (`full`): no input to take the fake mode from
            with self.mode:
                node.meta["val"] = target(*args, **kwargs)
        return node


def test_walk_back_and_forward_follow_one_chain():
    b = Builder()
    x = b.input(2, 3, 4)
    v = b.call(aten.view.default, x, [6, 4])
    u = b.call(aten.unsqueeze.default, v, 0)
    e = b.call(aten.exp.default, u)
    through_views = lambda n: n.target in (aten.view.default, aten.unsqueeze.default)  # noqa: E731
    assert walk_back(e, lambda n: through_views(n) or n.target is aten.exp.default) == [x, v, u, e]
    assert walk_forward(x, through_views) == [x, v, u]
    b.call(aten.neg.default, v)  # a second reader of v: the single-user chain ends there
    assert walk_forward(x, through_views) == [x, v]


def test_fill_value_and_masking_bias():
    b = Builder()
    full = b.call(aten.full.default, [2, 3], float("-inf"), dtype=torch.float32, device="cpu", pin_memory=False)
    scalar = b.call(aten.scalar_tensor.default, -2e4, dtype=torch.float32, device="cpu")
    x = b.input(2, 3)
    assert fill_value(full) == float("-inf") and fill_value(scalar) == -2e4 and fill_value(1.5) == 1.5
    assert fill_value(x) is None
    assert is_neg_inf(fill_value(full)) and not is_neg_inf(-1e30) and not is_neg_inf(float("inf"))
    assert masking_bias(float("-inf")) == "inf" and masking_bias(fill_value(scalar)) == "finite"
    assert masking_bias(-1.0) is None and masking_bias(x) is None


def test_scale_factor_reads_constant_scalings_only():
    b = Builder()
    x, y = b.input(2, 3), b.input(2, 3)
    right, left = b.call(aten.mul.Tensor, x, 0.5), b.call(aten.mul.Tensor, 2, x)
    div, by_zero = b.call(aten.div.Tensor, x, 4.0), b.call(aten.div.Tensor, x, 0.0)
    assert (scale_factor(right), scale_factor(left), scale_factor(div)) == (0.5, 2.0, 0.25)
    assert scaled_input(right) is x and scaled_input(left) is x
    assert scale_factor(by_zero) is None and scale_factor(b.call(aten.mul.Tensor, x, y)) is None
    assert scale_factor(b.call(aten.mul.Tensor, x, True)) is None


def test_slice_args_fill_defaults_and_keep_symbols():
    b = Builder(dynamic=True)
    x = b.input(4, 8)
    sym = x.meta["val"].shape[1]
    assert slice_args(b.call(aten.slice.Tensor, x)) == (0, 0, END, 1)
    assert slice_args(b.call(aten.slice.Tensor, x, -1, 1, None, 2)) == (-1, 1, END, 2)
    width = b.call(aten.sym_size.int, x, 1)
    dim, start, end, step = slice_args(b.call(aten.slice.Tensor, x, 1, 0, width))
    assert (dim, start, step) == (1, 0, 1) and isinstance(end, torch.SymInt)
    assert end.node.expr == sym.node.expr  # the symbol itself, never a guess at its value


def test_slice_position_resolves_open_and_negative_bounds():
    b = Builder(dynamic=True)
    width = b.input(4, 8).meta["val"].shape[1]
    assert slice_position(END, 8) == 8 and slice_position(-2, 8) == 6 and slice_position(3, 8) == 3
    assert slice_position(END, width) is width
    assert (slice_position(-2, width) - width + 2).node.expr == 0  # symbolic: width - 2, no guard taken


def test_broadcasts_to_is_proven_not_guessed():
    b = Builder(dynamic=True)
    rows, cols = b.input(3, 5).meta["val"].shape
    assert broadcasts_to((1, cols), (rows, cols)) and broadcasts_to((cols,), (rows, cols))
    assert not broadcasts_to((rows, cols), (cols,)) and not broadcasts_to((rows,), (rows, cols))
    assert broadcasts_to((1, 5), (3, 5)) and not broadcasts_to((2, 5), (3, 5))


def test_in_graph_order():
    b = Builder()
    x = b.input(2)
    first, second, third = (b.call(aten.neg.default, x) for _ in range(3))
    assert in_graph_order([third, first, second]) == [first, second, third] and in_graph_order([]) == []


def test_other_operand():
    b = Builder()
    x, y = b.input(2), b.input(2)
    product = b.call(aten.mul.Tensor, x, y)
    assert other_operand(product, x) is y and other_operand(product, y) is x and other_operand(product, product) is None


def test_is_upcast():
    b = Builder()
    x = b.input(2, 3, dtype=torch.bfloat16)
    assert is_upcast(b.call(CONVERT, x, torch.float32)) and not is_upcast(b.call(CONVERT, x, torch.float16))
    assert not is_upcast(x)


def test_changed_keyword_names_what_the_operands_do_not_say():
    """An add's alpha, a reduction's dtype other than its input's (int64 over integers is the default), a softmax's
    half_to_float: named as `name=value`; at their defaults, or on an op without one, None. A walk refuses them with a
    reported `KeywordMiss`."""
    b = Builder()
    x, y, ints = b.input(2, 3), b.input(2, 3), b.input(2, 3, dtype=torch.int32)
    changed = [b.call(aten.add.Tensor, x, y, alpha=2), b.call(aten.sub.Tensor, x, y, alpha=-1),
               b.call(aten.sum.dim_IntList, x, [1], dtype=torch.bfloat16),
               b.call(aten.mean.dim, x, [1], True, dtype=torch.float16),
               b.call(aten._softmax.default, b.call(CONVERT, x, torch.float16), 1, True)]
    assert [changed_keyword(n) for n in changed] == ["alpha=2", "alpha=-1", "dtype=torch.bfloat16",
                                                     "dtype=torch.float16", "half_to_float=True"]
    plain = [b.call(aten.add.Tensor, x, y), b.call(aten.add.Tensor, x, y, alpha=1), b.call(aten.mul.Tensor, x, y),
             b.call(aten.sum.dim_IntList, x, [1], dtype=torch.float32),
             b.call(aten.sum.default, ints, dtype=torch.int64), b.call(aten._softmax.default, x, 1, False)]
    assert [changed_keyword(n) for n in plain] == [None] * len(plain)
    refuse_changed_keyword(plain[0], "x + y")
    with pytest.raises(KeywordMiss, match="x \\+ y: aten.add.Tensor with alpha=2") as refused:
        refuse_changed_keyword(changed[0], "x + y")
    assert refused.value.reported


def test_node_arg_and_last_dim_cat():
    b = Builder()
    x = b.input(2, 3)
    positional, keyword, default = (b.call(aten.cat.default, [x, x], -1), b.call(aten.cat.default, [x, x], dim=1),
                                    b.call(aten.cat.default, [x, x]))
    assert node_arg(positional, 1, "dim", 0) == -1 and node_arg(keyword, 1, "dim", 0) == 1
    assert node_arg(default, 1, "dim", 0) == 0
    assert is_last_dim_cat(positional) and is_last_dim_cat(keyword) and not is_last_dim_cat(default)
    assert not is_last_dim_cat(b.call(aten.stack.default, [x, x], -1))


def test_size_args_are_ints_or_sym_size_nodes():
    b = Builder(dynamic=True)
    x = b.input(3, 5)
    y = b.call(aten.view.default, x, [-1])
    flat = b.call(aten.unsqueeze.default, y, 0)
    assert size_arg(b.graph, flat, flat, 0) == 1
    sizes = size_args(b.graph, flat, x)
    assert all(s.target is aten.sym_size.int for s in sizes) and [s.args[1] for s in sizes] == [0, 1]
    assert sizes[0].meta["val"].node.expr == x.meta["val"].shape[0].node.expr
    reshaped = insert_call(b.graph, flat, aten.reshape.default, (y, sizes))
    assert reshaped.meta["val"].shape == x.meta["val"].shape


def test_views_of_rank_lists_every_view_nearest_the_leaf_first():
    b = Builder()
    x = b.input(2, 3, 4)
    t = b.call(aten.permute.default, x, [0, 2, 1])
    u = b.call(aten.unsqueeze.default, t, 1)
    v = b.call(aten.view.default, u, [2, 4, 3])
    assert views_of_rank(v, 3) == [(x, [t, u, v]), (t, [u, v]), (v, [])]
    assert leaf_of_rank(v, 4) == (u, [v]) and leaf_of_rank(v, 2) == (x, [t, u, v])
    assert views_along([x, t, u, v], lambda n: n is u) == [(u, [v])]
    labels = follow(leaf_labels(x, "abc"), [t, u, v])
    assert [tuple(a[0] for a in dim) for dim in labels] == [("a",), ("c",), ("b",)]
    assert follow(None, [t]) is None


@pytest.mark.parametrize("index", [0, 1])
def test_walk_forward_stops_at_a_getitem(index):
    b = Builder()
    x = b.input(2, 4)
    split = b.call(aten.split_with_sizes.default, x, [1, 3], -1)
    part = b.call(operator.getitem, split, index)
    assert walk_forward(x, lambda n: n.target is aten.split_with_sizes.default) == [x, split]
    assert walk_forward(split, lambda n: n.target is aten.view.default) == [split]
    assert part.meta["val"].shape[-1] == (1, 3)[index]


def _graph(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs).graph


def _nodes(graph, test):
    return [n for n in graph.nodes if test(n)]


@pytest.mark.parametrize("spelling", ["split", "slice"])
def test_pieces_of_a_split_and_slices_read_the_same_ranges(spelling):
    def fn(t):
        if spelling == "split":
            return t.split([2, 3, 4], dim=-1)
        return t[..., :2], t[..., 2:5], t[..., 5:]

    graph = _graph(fn, torch.randn(3, 9))
    pieces = _nodes(graph, lambda n: n.target in (aten.slice.Tensor, operator.getitem))
    source = next(n for n in graph.nodes if n.op == "placeholder")
    assert [piece_of(n) for n in pieces] == [(source, 1, 0, 2), (source, 1, 2, 5), (source, 1, 5, 9)]


def test_negative_and_stepped_slices():
    graph = _graph(lambda t: (t[-3:-1], t[::2]), torch.randn(6))
    negative, stepped = _nodes(graph, lambda n: n.target is aten.slice.Tensor)
    assert piece_of(negative)[1:] == (0, 3, 5)
    assert piece_of(stepped) is None


@pytest.mark.parametrize("spelling", ["unbind", "select"])
def test_an_unbind_item_is_a_select(spelling):
    graph = _graph(lambda t: t.unbind(0)[2] if spelling == "unbind" else t[-1], torch.randn(3))
    item = next(n for n in graph.nodes if n.op == "output").args[0]
    source = next(n for n in graph.nodes if n.op == "placeholder")
    assert element_of(item) == (source, 0, 2)
    assert element_of(source) is None


def is_clone(node):
    return node.op == "call_function" and node.target is aten.clone.default


def _streams(b, T=6, n=4, D=8):
    """A dsfuse op's output (the hyper-connection exit's new streams [T, n, D], contiguous)."""
    import dsfuse.kernels.hyper_connections  # noqa: F401  (registers the op)

    out, residual = b.input(T, D), b.input(T, n, D)
    post, comb = b.input(T, n), b.input(T, n, n)
    return b.call(torch.ops.dsfuse.hc_expand_mix.default, out, residual, post, comb)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_copy_of_a_fused_output_already_contiguous_through_its_views_is_dropped(dynamic):
    """HF V4's transpose pair around the attention output leaves a `clone` the fused op's output does not need;
    the views' stale fake values (of the layout the pass replaced) are recomputed before deciding."""
    from dsfuse.passes.graph_utils import drop_copies_of_fused_outputs

    b = Builder(dynamic)
    streams = _streams(b)
    there = b.call(aten.permute.default, streams, [1, 0, 2])
    back = b.call(aten.transpose.int, there, 0, 1)
    back.meta["val"] = there.meta["val"]  # stale: what the view held before a pass replaced its source
    copy = b.call(aten.clone.default, back, memory_format=torch.contiguous_format)
    flat = b.call(aten.view.default, copy, [-1, 32])
    b.graph.output(flat)
    assert drop_copies_of_fused_outputs(b.graph) == 1
    assert flat.args[0] is back and not any(is_clone(n) for n in b.graph.nodes)
    assert back.meta["val"].is_contiguous()


def test_copies_that_do_work_or_are_outputs_stay():
    """A copy that changes the layout, a copy of something that is not a fused output, and a copy the graph returns
    (dropping it would make two outputs alias) are kept."""
    from dsfuse.passes.graph_utils import drop_copies_of_fused_outputs

    b = Builder()
    streams = _streams(b)
    relayout = b.call(aten.clone.default, b.call(aten.permute.default, streams, [1, 0, 2]),
                      memory_format=torch.contiguous_format)
    x = b.input(3, 5)
    plain = b.call(aten.clone.default, b.call(aten.transpose.int, b.call(aten.transpose.int, x, 0, 1), 0, 1))
    returned = b.call(aten.clone.default, streams)
    b.graph.output((b.call(aten.neg.default, relayout), b.call(aten.neg.default, plain), returned, streams))
    assert drop_copies_of_fused_outputs(b.graph) == 0
    assert sum(is_clone(n) for n in b.graph.nodes) == 3


def test_buffers_fused_ops_read_and_their_views_are_never_padded():
    """HF's [B, 1, S, T] mask feeds a dsfuse op through a `squeeze` and whole: the mask and every view of it (the
    op's and any other) are marked for Inductor not to pad, and nothing else (issue 34's out-of-bounds view)."""
    import dsfuse.kernels.hyper_connections  # noqa: F401  (registers the op)
    from dsfuse.passes.graph_utils import unpadded_inputs_of_fused_ops

    b = Builder()
    x = b.input(2, 1, 6, 6)
    mask = b.call(aten.bitwise_not.default, b.call(aten.gt.Scalar, x, 0.0))
    squeezed = b.call(aten.squeeze.dim, mask, 1)
    other_view = b.call(aten.view.default, mask, [2, 36])
    unrelated = b.call(aten.neg.default, x)
    post, comb = b.input(6, 4), b.input(6, 4, 4)
    with b.graph.inserting_after(other_view):  # the op's schema is not checked: only what it reads matters here
        fused = b.graph.call_function(torch.ops.dsfuse.hc_expand_mix.default, (squeezed, mask, post, comb))
    b.graph.output((fused, other_view, unrelated))
    assert unpadded_inputs_of_fused_ops(b.graph) == 3
    assert {n for n in b.graph.nodes if n.meta.get("dislike_padding")} == {mask, squeezed, other_view}
