"""The shared graph readers: a contiguous range of a tensor (`slice` or a `split` piece) and one element of a dim
(`select` or an `unbind` item) read as the same thing, whichever spelling the graph holds."""

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dsfuse.passes.graph_utils import aten, element_of, piece_of


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
