"""Each canonicalising rule alone: op counts before and after, and the same values (bit for bit) after.

Graphs are traced with Inductor's decompositions, so they are spelled as the post-grad graphs the
passes see; the inexact rules must leave the graph's code exactly as it was.
"""

import functools
import operator

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.post_grad import cat_splitwithsizes_replace
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dsfuse.passes.graph_utils import fake_call
from dsfuse.passes.canonicalize import (BMM, BY_NAME, MEAN, MM, RULES, SCALE, apply_rule, canonical_bmm, canonical_mm,
                                        canonical_scale, canonicalize, padded_product, row_mean)

aten, prims = torch.ops.aten, torch.ops.prims
NEG_INF = float("-inf")


def _trace(fn, inputs, decompose=True) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=select_decomp_table() if decompose else None, tracing_mode="fake")(*inputs)


def _count(graph: torch.fx.Graph, targets) -> dict:
    return {t: sum(1 for n in graph.nodes if n.target is t) for t in targets}


def _same(got, want) -> None:
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(torch.signbit(g), torch.signbit(w)), "signed zeros must survive"


def _manual(inputs, body) -> torch.fx.GraphModule:
    """A graph built call by call (spellings tracing would not produce), with fake values on every node."""
    graph, mode = torch.fx.Graph(), FakeTensorMode()
    placeholders = []
    for i, t in enumerate(inputs):
        placeholders.append(graph.placeholder(f"x{i}"))
        placeholders[-1].meta["val"] = mode.from_tensor(t)

    def call(target, *args):
        node = graph.call_function(target, args)
        node.meta["val"] = fake_call(target, args)
        return node

    graph.output(body(call, *placeholders))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _check(fn, inputs, rule: str, before: dict, after: dict, fired: int = 1, decompose=True) -> torch.fx.GraphModule:
    gm = _trace(fn, inputs, decompose)
    want = gm(*inputs)
    _same(want, fn(*inputs))
    assert _count(gm.graph, before) == before
    assert apply_rule(gm.graph, rule) == fired
    gm.graph.lint()
    gm.recompile()
    assert _count(gm.graph, after) == after, gm.code
    _same(gm(*inputs), want)
    return gm


def _floats(*shape, dtype=torch.float32):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    flat = x.view(-1)
    flat[:4] = torch.tensor([NEG_INF, float("nan"), -0.0, 0.0], dtype=dtype)
    return x


def test_every_rule_is_classified_and_named_once():
    assert len(BY_NAME) == len(RULES)
    assert {r.name for r in RULES if not r.exact} == {"collect_scale", "sum_over_count_is_mean", "batch_one_mm_is_bmm",
                                                     "padded_matmul_is_matmul"}


def test_view_of_view_collapses():
    _check(lambda x: x.view(2, 12).view(4, 6) + 1, [_floats(2, 3, 4)], "view_of_view",
           {aten.view.default: 2}, {aten.view.default: 1})


def test_view_of_view_keeps_a_view_the_graph_returns_as_a_fresh_view():
    _check(lambda x: x.view(2, 12).view(4, 6), [_floats(2, 3, 4)], "view_of_view",
           {aten.view.default: 2}, {aten.view.default: 1})


def test_view_of_a_reshape_that_copies_is_left_alone():
    """`view(reshape(x.T))`: the reshape copies, and `x.T` itself cannot be viewed to the outer shape."""
    x = _floats(4, 3)
    gm = _manual([x], lambda call, t: call(aten.add.Tensor, call(aten.view.default, call(
        aten.reshape.default, call(aten.permute.default, t, [1, 0]), [12]), [2, 6]), 1))
    want = gm(x)
    assert apply_rule(gm.graph, "view_of_view") == 0
    gm.recompile()
    kept = {aten.view.default: 1, aten.reshape.default: 1}
    assert _count(gm.graph, kept) == kept
    _same(gm(x), want)


@pytest.mark.parametrize("layout", ["view", "expand", "permute", "transpose"])
def test_no_op_layouts_are_removed(layout):
    x = _floats(2, 3, 4)
    op = {"view": lambda t: t.view(2, 3, 4), "expand": lambda t: t.expand(2, 3, 4),
          "permute": lambda t: t.permute(0, 1, 2), "transpose": lambda t: torch.ops.aten.transpose.int(t, 1, 1)}[layout]
    target = {"view": aten.view.default, "expand": aten.expand.default, "permute": aten.permute.default,
              "transpose": aten.transpose.int}[layout]
    _check(lambda t: op(t) + 1, [x], "no_op_layout", {target: 1}, {target: 0}, decompose=False)


def test_a_no_op_the_graph_returns_is_kept_so_no_output_aliases_its_input():
    _check(lambda x: x.expand(2, 3), [_floats(2, 3)], "no_op_layout", {aten.expand.default: 1},
           {aten.expand.default: 1}, fired=0)


def test_real_layout_changes_are_kept():
    _check(lambda x: (x.permute(0, 2, 1) + 1, x.expand(2, 3, 4) + 1), [_floats(2, 1, 4)], "no_op_layout",
           {aten.permute.default: 1, aten.expand.default: 1}, {aten.permute.default: 1, aten.expand.default: 1}, fired=0,
           decompose=False)


def test_cast_to_own_dtype_is_removed():
    _check(lambda x: prims.convert_element_type(x, torch.float32) * 2, [_floats(3, 4)], "convert_to_own_dtype",
           {prims.convert_element_type.default: 1}, {prims.convert_element_type.default: 0})


def test_round_trip_through_an_exact_widening_is_one_cast():
    x = _floats(3, 4, dtype=torch.bfloat16)
    gm = _check(lambda t: t.float().half() * 2, [x], "convert_through_widening",
                {prims.convert_element_type.default: 2}, {prims.convert_element_type.default: 1})
    cast = next(n for n in gm.graph.nodes if n.target is prims.convert_element_type.default)
    assert cast.args[1] == torch.float16 and cast.args[0].op == "placeholder"


def test_widening_then_back_disappears_under_the_fixpoint():
    x = _floats(3, 4, dtype=torch.bfloat16)
    gm = _trace(lambda t: t.float().bfloat16() * 2, [x])
    counts = canonicalize(gm.graph)
    assert counts["convert_through_widening"] == 1 and counts["convert_to_own_dtype"] == 1
    gm.recompile()
    assert _count(gm.graph, [prims.convert_element_type.default]) == {prims.convert_element_type.default: 0}
    _same(gm(x), x.float().bfloat16() * 2)


def test_a_rounding_cast_in_the_middle_is_kept():
    _check(lambda t: t.bfloat16().float() * 2, [_floats(3, 4)], "convert_through_widening",
           {prims.convert_element_type.default: 2}, {prims.convert_element_type.default: 2}, fired=0)


def test_scalar_overloads_become_tensor_overloads():
    def fn(x):
        return aten.add.Scalar(x, 2) + aten.mul.Scalar(x, 3) - aten.sub.Scalar(x, 1.5) + aten.div.Scalar(x, 4)

    _check(fn, [_floats(3, 4)], "scalar_overload",
           {aten.add.Scalar: 1, aten.mul.Scalar: 1, aten.sub.Scalar: 1, aten.div.Scalar: 1},
           {aten.add.Scalar: 0, aten.mul.Scalar: 0, aten.sub.Scalar: 0, aten.div.Scalar: 0}, fired=4, decompose=False)


def test_scalar_operand_goes_second():
    x = _floats(3, 4)
    gm = _manual([x], lambda call, t: call(aten.relu.default,
                                           call(aten.add.Tensor, 0.5, call(aten.mul.Tensor, 2.0, t))))
    want = gm(x)
    assert apply_rule(gm.graph, "scalar_second") == 2
    gm.recompile()
    arithmetic = [n for n in gm.graph.nodes if n.target in (aten.mul.Tensor, aten.add.Tensor)]
    assert len(arithmetic) == 2 and all(isinstance(n.args[0], torch.fx.Node) for n in arithmetic)
    _same(gm(x), want)


@pytest.mark.parametrize("spelling", ["clamp_min", "clamp"])
def test_clamp_at_zero_is_relu(spelling):
    op = {"clamp_min": lambda t: aten.clamp_min.default(t, 0), "clamp": lambda t: aten.clamp.default(t, 0.0)}[spelling]
    target = {"clamp_min": aten.clamp_min.default, "clamp": aten.clamp.default}[spelling]
    _check(lambda t: op(t) * 3, [_floats(4, 5)], "clamp_min_zero_is_relu", {target: 1, aten.relu.default: 0},
           {target: 0, aten.relu.default: 1}, decompose=False)


def test_other_clamps_are_kept():
    fn = lambda t: t.clamp(min=0, max=6) + t.clamp_min(0.5)  # noqa: E731
    _check(fn, [_floats(4, 5)], "clamp_min_zero_is_relu", {aten.relu.default: 0}, {aten.relu.default: 0}, fired=0,
           decompose=False)


def test_integer_clamps_are_kept():
    """Expert ids clamped into range are index arithmetic that moe_experts reads in its clamp spelling."""
    ids = torch.tensor([[-1, 3], [7, 0]])
    _check(lambda t: t.clamp_min(0).clamp_max(5) * 2, [ids], "clamp_min_zero_is_relu",
           {aten.clamp_min.default: 1, aten.relu.default: 0}, {aten.clamp_min.default: 1, aten.relu.default: 0},
           fired=0)


def test_square_is_pow():
    _check(lambda t: (t * t).sum(-1), [_floats(4, 5, dtype=torch.bfloat16)], "square_is_pow",
           {aten.mul.Tensor: 1, aten.pow.Tensor_Scalar: 0}, {aten.mul.Tensor: 0, aten.pow.Tensor_Scalar: 1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_with_one_is_the_value(dtype):
    """`1 / t` traces as `reciprocal(t) * 1`; NaN, infinities and signed zeros pass through unchanged."""
    _check(lambda t: (1 / t) + t * 1.0, [_floats(4, 5, dtype=dtype)], "mul_by_one",
           {aten.mul.Tensor: 2, aten.reciprocal.default: 1}, {aten.mul.Tensor: 0, aten.reciprocal.default: 1},
           fired=2)


def test_product_with_one_that_changes_dtype_or_shape_is_kept():
    """A bool mask times 1 is an integer tensor, a broadcast against a ones tensor is not a scalar product."""
    mask = torch.tensor([True, False, True])
    _check(lambda m, t: (m * 1) + (t * torch.ones(2, 1, 3)).sum(), [mask, _floats(2, 3)], "mul_by_one",
           {aten.mul.Tensor: 2}, {aten.mul.Tensor: 2}, fired=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_division_by_a_power_of_two_is_a_multiplication(dtype):
    x = _floats(4, 5, dtype=dtype)
    x.view(-1)[4:6] = torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).tiny], dtype=dtype)
    _check(lambda t: t / 8 + t / 0.25, [x], "div_by_power_of_two", {aten.div.Tensor: 2, aten.mul.Tensor: 0},
           {aten.div.Tensor: 0, aten.mul.Tensor: 2}, fired=2)


def test_division_by_other_constants_is_kept():
    _check(lambda t: t / 3 + t / 2.0 ** 40, [_floats(4, 5)], "div_by_power_of_two", {aten.div.Tensor: 2},
           {aten.div.Tensor: 2}, fired=0)


def test_mask_polarity_puts_the_fill_first():
    x, m = _floats(3, 5), torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) > 0.5
    gm = _check(lambda t, keep: torch.where(keep, t, NEG_INF) + 1, [x, m], "mask_fill_first",
                {aten.where.self: 1, aten.bitwise_not.default: 0}, {aten.where.self: 1, aten.bitwise_not.default: 1})
    where = next(n for n in gm.graph.nodes if n.target is aten.where.self)
    assert where.args[0].target is aten.bitwise_not.default and where.args[2].op == "placeholder"


def test_mask_polarity_of_masked_fill_of_a_negated_mask_ends_as_the_plain_mask():
    x, m = _floats(3, 5), torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) > 0.5
    a = _trace(lambda t, keep: torch.where(keep, t, NEG_INF) + 1, [x, m])
    b = _trace(lambda t, keep: t.masked_fill(~keep, NEG_INF) + 1, [x, m])
    canonicalize(a.graph), canonicalize(b.graph)
    for gm in (a, b):
        gm.recompile()
        _same(gm(x, m), torch.where(m, x, NEG_INF) + 1)
    assert _spelling(_output(a)) == _spelling(_output(b))


def _output(gm):
    return gm.graph.find_nodes(op="output")[0].args[0]


def _spelling(node):
    """The expression under `node`, ignoring node names and order."""
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    if node.op == "placeholder":
        return node.name
    return (str(node.target), tuple(_spelling(a) for a in node.args))


def test_double_not_is_the_mask():
    m = torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) > 0.5
    _check(lambda keep: (~~keep).sum(-1), [m], "double_not", {aten.bitwise_not.default: 2},
           {aten.bitwise_not.default: 0})


def test_where_between_two_constants_or_two_tensors_is_kept():
    x, m = _floats(3, 5), torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) > 0.5
    fn = lambda t, keep: torch.where(keep, 0.0, NEG_INF) + torch.where(keep, t, t * 2)  # noqa: E731
    _check(fn, [x, m], "mask_fill_first", {aten.where.self: 2}, {aten.where.self: 2}, fired=0)


def test_identity_lowering_calls_are_inlined():
    """Inductor leaves `split_with_sizes(cat(parts))` as a call of its lowering that returns `parts`; the reads
    of that call become the parts themselves, so a pass sees what the split produced."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    split = graph.call_function(aten.split_with_sizes.default, (x, [3, 1], -1))
    parts = [graph.call_function(operator.getitem, (split, i)) for i in range(2)]
    lowering = graph.create_node("call_function", functools.partial(cat_splitwithsizes_replace, None), (),
                                 {"input_": parts}, name="cat_splitwithsizes_replace")
    reads = [graph.call_function(operator.getitem, (lowering, i)) for i in range(2)]
    out = graph.call_function(aten.mul.Tensor, (reads[0], 2.0))
    graph.output((out, reads[1]))
    assert apply_rule(graph, "split_of_cat_identity") == 1
    assert lowering not in graph.nodes and all(r not in graph.nodes for r in reads)
    assert out.args[0] is parts[0]
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x_val = torch.arange(8.0).view(2, 4)
    scaled, last = gm(x_val)
    assert torch.equal(scaled, x_val[:, :3] * 2) and torch.equal(last, x_val[:, 3:])


def test_other_calls_are_not_identity_lowerings():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(aten.relu.default, (x,)))
    assert apply_rule(graph, "split_of_cat_identity") == 0 and len(graph.nodes) == 3


def test_duplicate_splits_coalesce():
    def fn(t):
        a, b = t.split([2, 3], dim=-1)
        c, d = t.split([2, 3], dim=-1)
        return a * 2 + c, d - b

    _check(fn, [_floats(3, 5)], "duplicate_split", {aten.split_with_sizes.default: 2},
           {aten.split_with_sizes.default: 1})


def test_a_chain_of_constant_scalings_records_one_scale_and_keeps_the_graph():
    gm = _trace(lambda t: (t * 3) / 7 * 0.5, [_floats(4, 5)])
    code = gm.code
    assert apply_rule(gm.graph, "collect_scale") == 3
    gm.recompile()
    assert gm.code == code, "an inexact equivalence must never change the graph"
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    x, factor = canonical_scale(last)
    assert x.op == "placeholder" and factor == pytest.approx(3 / 7 * 0.5, rel=1e-15)
    assert last.meta[SCALE] == (x, factor)


def test_sum_over_its_count_records_a_mean_and_keeps_the_graph():
    gm = _trace(lambda t: t.sum(-1, keepdim=True) / 5 + t.sum(-1) / 4, [_floats(3, 5)])
    code = gm.code
    assert apply_rule(gm.graph, "sum_over_count_is_mean") == 1
    gm.recompile()
    assert gm.code == code
    (mean,) = [n for n in gm.graph.nodes if MEAN in n.meta]
    assert mean.meta[MEAN][1:] == ((1,), True) and mean.meta[MEAN][0].op == "placeholder"


@pytest.mark.parametrize("spelling", ["mean", "sum_over_count"])
def test_row_mean_reads_a_mean_in_either_spelling(spelling):
    def fn(t):
        square = t.pow(2)
        return square.mean(-1, keepdim=True) if spelling == "mean" else square.sum(-1, keepdim=True) / 5

    gm = _trace(fn, [_floats(3, 5)])
    canonicalize(gm.graph)
    (square,) = [n for n in gm.graph.nodes if n.target is aten.pow.Tensor_Scalar]
    mean = row_mean(square)
    assert mean is not None and list(mean.users)[0].op == "output"


@pytest.mark.parametrize("fn", [lambda t: t.pow(2).mean(0, keepdim=True), lambda t: t.pow(2).mean(-1),
                                lambda t: t.pow(2).sum(-1, keepdim=True) / 4])
def test_row_mean_is_none_for_other_reductions(fn):
    gm = _trace(fn, [_floats(3, 5)])
    canonicalize(gm.graph)
    (square,) = [n for n in gm.graph.nodes if n.target is aten.pow.Tensor_Scalar]
    assert row_mean(square) is None


def test_sum_over_a_symbolic_count_is_a_mean():
    """The count is the SymInt of the summed dim: proven equal to it, never specialised."""
    gm = make_fx(lambda t: t.sum(-1) / t.shape[-1], decomposition_table=select_decomp_table(),
                 tracing_mode="symbolic")(_floats(3, 5))
    assert apply_rule(gm.graph, "sum_over_count_is_mean") == 1


@pytest.mark.parametrize("spelling", ["squeeze", "view"])
def test_an_unbatched_batch_one_product_records_its_bmm_and_keeps_the_graph(spelling):
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(1, 3, 4, generator=gen), torch.randn(1, 4, 5, generator=gen)
    if spelling == "squeeze":
        fn = lambda x, y: torch.mm(x.squeeze(0), y.squeeze(0)).unsqueeze(0) + 1  # noqa: E731
    else:
        fn = lambda x, y: torch.mm(x.view(3, 4), y.view(4, 5)).view(1, 3, 5) + 1  # noqa: E731
    gm = _trace(fn, [a, b], decompose=False)
    code, want = gm.code, gm(a, b)
    assert apply_rule(gm.graph, "batch_one_mm_is_bmm") == 1
    gm.recompile()
    assert gm.code == code
    (node,) = [n for n in gm.graph.nodes if BMM in n.meta]
    assert [x.name for x in node.meta[BMM]] == [p.name for p in gm.graph.find_nodes(op="placeholder")]
    _same(gm(a, b), want)
    # Why it is only recorded: bmm and mm agree up to rounding, not bit for bit (they do here on CPU).
    torch.testing.assert_close(torch.bmm(a, b) + 1, want)


def test_fixpoint_brings_several_spellings_to_one():
    x = _floats(4, 6, dtype=torch.bfloat16)

    def fn(t):
        up = t.float().float()
        return (up.clamp_min(0) * up.clamp_min(0)).view(2, 12).view(24) / 2

    gm = _trace(fn, [x], decompose=False)
    want = gm(x)
    canonicalize(gm.graph)
    gm.graph.lint()
    gm.recompile()
    _same(gm(x), want)
    kinds = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.clamp_min.default not in kinds and aten.div.Tensor not in kinds
    assert kinds.count(aten.view.default) == 1


def test_the_pass_manager_canonicalises_a_graph_no_family_rewrites_without_changing_its_numbers():
    from dsfuse import PASS_NAMES
    from dsfuse.pass_manager import DsfusePassManager

    x, m = _floats(4, 8, dtype=torch.bfloat16), torch.rand(4, 8, generator=torch.Generator().manual_seed(2)) > 0.5

    def fn(t, keep):
        up = t.float()
        sq = up.clamp_min(0) * up.clamp_min(0)
        scaled = torch.where(keep, sq / 8, NEG_INF) / 3
        return scaled.view(2, 16).view(32).bfloat16().float(), (scaled.sum(-1) / 8).bfloat16()

    gm = _trace(fn, [x, m])
    want = gm(x, m)
    manager = DsfusePassManager(PASS_NAMES)
    manager(gm.graph)
    gm.recompile()
    assert manager.sites == []
    _same(gm(x, m), want)
    kinds = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.clamp_min.default not in kinds and kinds.count(aten.view.default) == 1
    assert kinds.count(aten.div.Tensor) == 1, "only the divisions by powers of two become multiplications"
    (mean,) = [n for n in gm.graph.nodes if MEAN in n.meta]
    assert mean.target is aten.mul.Tensor and mean.meta[MEAN][1:] == ((1,), False)


def _indices():
    idx = torch.randint(-1, 6, (2, 3, 4), generator=torch.Generator().manual_seed(2))
    idx[0, 0, 0] = -7  # below -1 too: the rules must hold for every integer
    return idx


def test_not_of_an_integer_comparison_is_the_negated_comparison_through_layout_ops():
    comparisons = (aten.ge.Scalar, aten.lt.Scalar)
    gm = _check(lambda i: ~(i >= 0).unsqueeze(2).expand(2, 3, 5, 4), [_indices()], "not_of_integer_comparison",
                {aten.bitwise_not.default: 1, **dict.fromkeys(comparisons, 0)} | {aten.ge.Scalar: 1},
                {aten.bitwise_not.default: 0, aten.ge.Scalar: 0, aten.lt.Scalar: 1})
    lt = next(n for n in gm.graph.nodes if n.target is aten.lt.Scalar)
    assert [u.target for u in lt.users] == [aten.unsqueeze.default]
    _check(lambda i, j: ~(i == j), [_indices(), _indices().flip(0)], "not_of_integer_comparison",
           {aten.bitwise_not.default: 1, aten.eq.Tensor: 1}, {aten.bitwise_not.default: 0, aten.ne.Tensor: 1})


def test_not_of_a_float_comparison_is_kept():
    """`~(x >= 0)` is true at NaN, `x < 0` is not."""
    _check(lambda x: ~(x >= 0), [_floats(3, 5)], "not_of_integer_comparison", {aten.bitwise_not.default: 1},
           {aten.bitwise_not.default: 1}, fired=0)


@pytest.mark.parametrize("spelling", ["where", "masked_fill", "where_keep"])
def test_negative_indices_replaced_by_zero_are_a_clamp(spelling):
    fn = {"where": lambda i: torch.where(i < 0, 0, i), "masked_fill": lambda i: i.masked_fill(i < 0, 0),
          "where_keep": lambda i: torch.where(i >= 0, i, 0)}[spelling]
    gm = _trace(fn, [_indices()])
    want = gm(_indices())
    canonicalize(gm.graph)
    gm.recompile()
    assert _count(gm.graph, [aten.where.self, aten.clamp_min.default]) == {aten.where.self: 0,
                                                                           aten.clamp_min.default: 1}, gm.code
    _same(gm(_indices()), want)


def test_other_index_replacements_are_kept():
    _check(lambda i: torch.where(i < 0, 1, i), [_indices()], "negative_to_zero_is_clamp", {aten.where.self: 1},
           {aten.where.self: 1}, fired=0)
    _check(lambda x: torch.where(x < 0, 0.0, x), [_floats(3, 5)], "negative_to_zero_is_clamp", {aten.where.self: 1},
           {aten.where.self: 1}, fired=0)


def test_select_of_a_unit_dim_is_squeeze():
    """`t[:, :, 0]` of a `[S, N, 1]` bmm output reads the elements `squeeze(-1)` does."""
    _check(lambda a, b: torch.bmm(a, b)[:, :, 0] * 2, [_floats(3, 4, 5), _floats(3, 5, 1)],
           "select_of_unit_dim_is_squeeze", {aten.select.int: 1, aten.squeeze.dim: 0},
           {aten.select.int: 0, aten.squeeze.dim: 1})


def test_select_of_a_longer_dim_is_kept():
    _check(lambda t: t[:, 1] * 2, [_floats(3, 4)], "select_of_unit_dim_is_squeeze", {aten.select.int: 1},
           {aten.select.int: 1}, fired=0)


def test_repeat_of_unit_dims_is_an_expanded_copy():
    """`x.view(T, 1, H).repeat(1, k, 1)` repeats each row k times: the elements of an expand, copied."""
    _check(lambda t: t.view(3, 1, 4).repeat(1, 2, 1).reshape(6, 4) * 2, [_floats(3, 4)],
           "repeat_of_unit_dims_is_expand", {aten.repeat.default: 1, aten.expand.default: 0},
           {aten.repeat.default: 0, aten.expand.default: 1, aten.clone.default: 1}, decompose=False)


def test_repeat_of_a_longer_dim_is_kept():
    """Tiling a dim of size 3 interleaves differently from an expand: not this rule's."""
    _check(lambda t: t.repeat(2, 1) * 2, [_floats(3, 4)], "repeat_of_unit_dims_is_expand",
           {aten.repeat.default: 1}, {aten.repeat.default: 1}, fired=0, decompose=False)


def test_gather_by_own_argsort_is_the_sorted_values():
    """`t[t.argsort()]` -> the sort's values (a getitem 0 of the same sort), for ints and floats with NaN."""
    for t in (torch.tensor([3, 1, 2, 1, 0, 3]), _floats(7)):
        gm = _check(lambda v: v[torch.argsort(v, stable=True)] + 1, [t], "gather_by_own_sort_is_sorted",
                    {aten.index.Tensor: 1}, {aten.index.Tensor: 0})
        reads = [n for n in gm.graph.nodes if n.target is operator.getitem]
        assert [n.args[1] for n in reads] == [0], gm.code


def test_gather_of_another_tensor_by_a_sort_is_kept():
    """The sort permutation applied to another tensor (the router weights in slot order) is a real gather."""
    _check(lambda ids, w: w[torch.sort(ids)[1]] * 2, [torch.tensor([3, 1, 2, 0]), _floats(4)],
           "gather_by_own_sort_is_sorted", {aten.index.Tensor: 1}, {aten.index.Tensor: 1}, fired=0)


def _pad_mm_form(a, b, pm, pk, pn, value=0.0):
    """`a @ b` as Inductor's pad_mm writes it: zeros appended to K (both operands) and to M / N, sliced back."""
    out = torch.bmm(torch.constant_pad_nd(a, [0, pk, 0, pm, 0, 0], value),
                    torch.constant_pad_nd(b, [0, pn, 0, pk, 0, 0], value))
    if pm:
        out = out[:, :-pm]
    if pn:
        out = out[:, :, :-pn]
    return out + 1


@pytest.mark.parametrize("pm, pk, pn", [(0, 3, 0), (2, 3, 1), (5, 0, 0), (0, 0, 7)])
def test_a_zero_padded_bmm_sliced_back_is_recorded_as_the_bmm(pm, pk, pn):
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 5, 4, generator=gen)
    gm = _trace(lambda x, y: _pad_mm_form(x, y, pm, pk, pn), [a, b], decompose=False)
    code, want = gm.code, gm(a, b)
    assert apply_rule(gm.graph, "padded_matmul_is_matmul") == 1
    gm.recompile()
    assert gm.code == code
    (node,) = [n for n in gm.graph.nodes if BMM in n.meta]
    assert node.meta["val"].shape == (2, 3, 4)
    assert [x.name for x in node.meta[BMM]] == [p.name for p in gm.graph.find_nodes(op="placeholder")]
    assert padded_product(node.meta[BMM][0]) is node and canonical_bmm(node) == node.meta[BMM]
    torch.testing.assert_close(torch.bmm(a, b) + 1, want)


@pytest.mark.parametrize("pm, pk, pn", [(0, 3, 0), (2, 3, 1), (5, 0, 0)])
def test_a_zero_padded_mm_sliced_back_is_recorded_as_the_mm(pm, pk, pn):
    """pad_mm's unbatched form (a hyper-connection's projection at a static token count off the alignment)."""
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(3, 5, generator=gen), torch.randn(5, 4, generator=gen)

    def padded(x, y):
        out = torch.mm(torch.constant_pad_nd(x, [0, pk, 0, pm]), torch.constant_pad_nd(y, [0, pn, 0, pk]))
        return (out[:-pm] if pm else out)[:, :out.shape[1] - pn] + 1

    gm = _trace(padded, [a, b], decompose=False)
    want = gm(a, b)
    assert apply_rule(gm.graph, "padded_matmul_is_matmul") == 1
    (node,) = [n for n in gm.graph.nodes if MM in n.meta]
    assert node.meta["val"].shape == (3, 4) and BMM not in node.meta
    assert canonical_mm(node) == node.meta[MM] == tuple(gm.graph.find_nodes(op="placeholder"))
    torch.testing.assert_close(torch.mm(a, b) + 1, want)


@pytest.mark.parametrize("case", ["nonzero pad", "pad in front", "padded rows kept"])
def test_padding_pad_mm_does_not_write_is_not_recorded(case):
    """Only pad_mm's form: zeros at the end of the matrix dims, M / N cut off again (ones in K would add to every
    sum; rows padded and kept change the product's shape)."""
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 5, 4, generator=gen)
    fns = {
        "nonzero pad": lambda x, y: _pad_mm_form(x, y, 0, 3, 0, value=1.0),
        "pad in front": lambda x, y: torch.bmm(torch.constant_pad_nd(x, [3, 0, 0, 0, 0, 0]),
                                               torch.constant_pad_nd(y, [0, 0, 3, 0, 0, 0])),
        "padded rows kept": lambda x, y: torch.bmm(torch.constant_pad_nd(x, [0, 0, 0, 2, 0, 0]), y),
    }
    gm = _trace(fns[case], [a, b], decompose=False)
    assert apply_rule(gm.graph, "padded_matmul_is_matmul") == 0


def test_keep_polarity_scatter_is_the_negated_drop_scatter():
    idx = torch.randint(0, 7, (2, 3, 4), generator=torch.Generator().manual_seed(2))
    gm = _check(lambda i: torch.zeros(2, 3, 7, dtype=torch.bool).scatter(-1, i, True).unsqueeze(1), [idx],
                "keep_scatter_is_negated_drop", {aten.scatter.value: 1, aten.bitwise_not.default: 0},
                {aten.scatter.value: 1, aten.bitwise_not.default: 1})
    scatter = next(n for n in gm.graph.nodes if n.target is aten.scatter.value)
    assert scatter.args[0].args[1] is True and scatter.args[3] is False


def test_scatter_of_other_values_is_kept():
    idx = torch.randint(0, 7, (2, 3, 4), generator=torch.Generator().manual_seed(2))
    _check(lambda i: torch.ones(2, 3, 7, dtype=torch.bool).scatter(-1, i, False), [idx],
           "keep_scatter_is_negated_drop", {aten.scatter.value: 1}, {aten.scatter.value: 1}, fired=0)
    _check(lambda i: torch.zeros(2, 3, 7).scatter(-1, i, 1.0), [idx],
           "keep_scatter_is_negated_drop", {aten.scatter.value: 1}, {aten.scatter.value: 1}, fired=0)


def _index_put(inputs, index_of, accumulate=False):
    """`x[index] = -inf` as the post-grad graph spells it: a functional `index_put` of a 0-d `full`."""
    def body(call, x, *rest):
        fill = x.graph.call_function(aten.full.default, ([], NEG_INF))
        fill.meta["val"] = x.meta["val"].new_full((), NEG_INF)
        return call(aten.add.Tensor, call(aten.index_put.default, x, [index_of(call, *rest)], fill, accumulate), 1.0)
    return _manual(inputs, body)


def test_bool_index_put_of_a_scalar_is_where():
    x, m = _floats(3, 5), torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) > 0.5
    gm = _index_put([x, m], lambda call, drop: drop)
    want = gm(x, m)
    _same(want, torch.where(m, NEG_INF, x) + 1)
    assert apply_rule(gm.graph, "bool_index_put_is_where") == 1
    gm.recompile()
    assert _count(gm.graph, [aten.index_put.default, aten.where.self]) == {aten.index_put.default: 0,
                                                                          aten.where.self: 1}
    _same(gm(x, m), want)


def test_index_put_by_integer_indices_or_with_accumulation_is_kept():
    x, m = _floats(3, 5), torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) > 0.5
    for gm in (_index_put([x, torch.tensor([0, 2])], lambda call, rows: rows),
               _index_put([x, m], lambda call, drop: drop, accumulate=True)):
        assert apply_rule(gm.graph, "bool_index_put_is_where") == 0
