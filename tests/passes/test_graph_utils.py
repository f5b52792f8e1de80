"""Graph clean-up the pass manager runs before the passes."""

import functools
import operator

import torch
from torch._inductor.fx_passes.post_grad import cat_splitwithsizes_replace

from dsfuse.passes.graph_utils import inline_identity_lowerings


def test_identity_lowering_calls_are_inlined():
    """Inductor leaves `split_with_sizes(cat(parts))` as a call of its lowering that returns `parts`; the reads
    of that call become the parts themselves, so a pass sees what the split produced."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    split = graph.call_function(torch.ops.aten.split_with_sizes.default, (x, [3, 1], -1))
    parts = [graph.call_function(operator.getitem, (split, i)) for i in range(2)]
    lowering = graph.create_node("call_function", functools.partial(cat_splitwithsizes_replace, None), (),
                                 {"input_": parts}, name="cat_splitwithsizes_replace")
    reads = [graph.call_function(operator.getitem, (lowering, i)) for i in range(2)]
    out = graph.call_function(torch.ops.aten.mul.Tensor, (reads[0], 2.0))
    graph.output((out, reads[1]))
    assert inline_identity_lowerings(graph) == 1
    assert lowering not in graph.nodes and all(r not in graph.nodes for r in reads)
    assert out.args[0] is parts[0]
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x_val = torch.arange(8.0).view(2, 4)
    scaled, last = gm(x_val)
    assert torch.equal(scaled, x_val[:, :3] * 2) and torch.equal(last, x_val[:, 3:])


def test_other_calls_are_left_alone():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.relu.default, (x,)))
    assert inline_identity_lowerings(graph) == 0 and len(graph.nodes) == 3
