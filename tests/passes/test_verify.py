"""`passes/verify.py`: slicing from an anchor to its frontier, running the slice on probes against a reference,
the verdict cache, and symbolic sizes."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dsfuse.passes import verify


def _graph(fn, *args, mode="fake"):
    gm = make_fx(fn, tracing_mode=mode)(*args)
    nodes = list(gm.graph.nodes)
    return [n for n in nodes if n.op == "placeholder"], next(n for n in nodes if n.op == "output").args[0][0]


def _scaled_relu(a, b):
    return (torch.relu(a) * 2 + b,)


def _family(calls):
    def probes(shapes, dtypes):
        gen = torch.Generator().manual_seed(0)
        return [("random", {role: torch.randn(shape, generator=gen) for role, shape in shapes.items()})]

    def reference(probe):
        calls.append({role: tuple(t.shape) for role, t in probe.items()})
        return torch.relu(probe["x"]) * 2 + probe["bias"]

    def compare(got, want, probe):
        return None if torch.equal(got[0], want) else "values differ"

    return verify.Family(probes, reference, compare)


def test_right_binding_verifies_once_then_from_the_cache():
    verify.clear_cache()
    (a, b), out = _graph(_scaled_relu, torch.randn(3, 5), torch.randn(3, 5))
    calls = []
    assert verify.verify([out], {"x": a, "bias": b}, _family(calls)).ok is True
    assert verify.verify([out], {"x": a, "bias": b}, _family(calls)).ok is True
    assert len(calls) == 1


def test_swapped_binding_names_the_failing_probe():
    verify.clear_cache()
    (a, b), out = _graph(_scaled_relu, torch.randn(3, 5), torch.randn(3, 5))
    verdict = verify.verify([out], {"x": b, "bias": a}, _family([]))
    assert verdict == verify.Verdict(False, "random probe: values differ")


def test_unbound_frontier_tensor_is_named():
    verify.clear_cache()
    (a, b), out = _graph(_scaled_relu, torch.randn(3, 5), torch.randn(3, 5))
    verdict = verify.verify([out], {"x": a}, _family([]))
    assert verdict.ok is False and "bound to no role" in verdict.reason


def test_inputs_too_large_to_probe_are_not_built():
    """A small slice over a large input (a checkpoint's expert stack read by index): the probes would have to build
    the input at its static size, so the slice is not run and no probe is drawn (the verdict is None, not False)."""
    verify.clear_cache()
    (stack, ids), out = _graph(lambda w, i: (torch.index_select(w, 0, i),), torch.empty(verify.MAX_ELEMENTS + 1, 1),
                               torch.zeros(2, dtype=torch.long))
    drawn = []

    def probes(shapes, dtypes):
        drawn.append(shapes)
        return []

    family = verify.Family(probes, lambda probe: None, lambda got, want, probe: None)
    verdict = verify.verify([out], {"stack": stack, "ids": ids}, family)
    assert verdict.ok is None and "elements" in verdict.reason and not drawn, verdict


def test_symbolic_sizes_get_two_small_distinct_assignments():
    verify.clear_cache()
    (a, b), out = _graph(_scaled_relu, torch.randn(3, 6), torch.randn(3, 6), mode="symbolic")
    calls = []
    assert verify.verify([out], {"x": a, "bias": b}, _family(calls)).ok is True
    assert len(calls) == 2 and calls[0] != calls[1]
    for shapes in calls:
        assert len(set(shapes["x"])) == 2, "the two dims get distinct sizes"


def test_slice_over_the_node_bound_is_refused():
    verify.clear_cache()
    (a, b), out = _graph(_scaled_relu, torch.randn(3, 5), torch.randn(3, 5))
    verdict = verify.verify([out], {"x": a, "bias": b}, _family([]), max_nodes=1)
    assert verdict.ok is False and "more than 1 nodes" in verdict.reason


def _sdpa_family(dropout_p):
    def probes(shapes, dtypes):
        gen = torch.Generator().manual_seed(0)
        return [("random", {role: torch.randn(shape, generator=gen) for role, shape in shapes.items()})]

    def reference(probe):
        return torch.nn.functional.scaled_dot_product_attention(probe["q"], probe["k"], probe["v"], scale=0.5)

    def compare(got, want, probe):
        return None if torch.allclose(got[0], want, atol=1e-6) else "values differ"

    return verify.Family(probes, reference, compare)


def test_cuda_only_attention_without_dropout_runs_as_its_cpu_math():
    """The memory-efficient SDPA op (no CPU kernel) is pure at dropout 0 and runs as the math SDPA on the probes; with
    dropout it is impure, so the slice stops at it."""
    for dropout_p, ok in ((0.0, True), (0.1, False)):
        verify.clear_cache()
        q, k, v = (torch.randn(1, 2, 5, 4, device="meta") for _ in range(3))
        gm = make_fx(lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, False, dropout_p, scale=0.5)[0] * 1.0, tracing_mode="fake")(q, k, v)
        nodes = list(gm.graph.nodes)
        roles = dict(zip("qkv", (n for n in nodes if n.op == "placeholder")))
        out = next(n for n in nodes if n.op == "output").args[0]
        assert verify.verify([out], roles, _sdpa_family(dropout_p)).ok is ok


def _guarded(a, b):
    """A length guarded to be at least 16 and 1 mod 4, and a width guarded to be over a quarter of it."""
    torch._check(a.shape[0] >= 16)
    torch._check(a.shape[0] % 4 == 1)
    torch._check(4 * a.shape[1] > a.shape[0])
    return (a + b,)


def test_symbolic_sizes_are_ones_the_shape_environment_admits():
    """The graph's guards (a range, a modulus, a relation of two symbols) choose the sizes: values SYMBOL_SIZES alone
    would give (5 and 7 for the length) are ones this graph never runs at."""
    placeholders, _ = _graph(_guarded, torch.randn(17, 6), torch.randn(17, 6), mode="symbolic")
    length, width = (placeholders[0].meta["val"].shape[i].node.expr for i in (0, 1))
    assignments = verify.size_assignments(placeholders, {1})
    assert len(assignments) == 2, assignments
    values = [size for assignment in assignments for size in assignment.values()]
    assert len(set(values)) == len(values) and 1 not in values, assignments
    for assignment in assignments:
        assert assignment[length] >= 16 and assignment[length] % 4 == 1, assignments
        assert 4 * assignment[width] > assignment[length], assignments
    assert assignments[0] == {length: 17, width: 5}, "SYMBOL_SIZES first, then the smallest"


def test_sizes_the_search_cannot_find_fall_back_to_the_unguarded_choice():
    """No length within verify.SEARCH_SPAN of its lower bound is 127 mod 128: the sizes are SYMBOL_SIZES, as for a
    graph without guards."""
    def guarded(a):
        torch._check(a.shape[0] % 128 == 127)
        return (a * 2,)

    placeholders, _ = _graph(guarded, torch.randn(127), mode="symbolic")
    length = placeholders[0].meta["val"].shape[0].node.expr
    assert verify.size_assignments(placeholders, set()) == [{length: 5}, {length: 7}]


# --------------------------------------------------------------------------------------------
# ulps_beyond: the families' comparison of an output with its reference
# --------------------------------------------------------------------------------------------
def test_ulps_are_counted_at_each_rows_largest_magnitude_or_the_tensors():
    """One fp32 row at magnitude 1, one at 1024: an error of 8 ulps of the small row is within 8 ulps there and far
    under one ulp of the tensor's largest magnitude; at 9 ulps it is past a budget of 8 per row, not per tensor."""
    eps = torch.finfo(torch.float32).eps
    ref = torch.tensor([[1.0, -0.5], [1024.0, 3.0]])
    assert verify.ulps_beyond(ref + torch.tensor([[8 * eps, 0.0], [0.0, 0.0]]), ref, 8, "row") is None
    miss = verify.ulps_beyond(ref + torch.tensor([[9 * eps, 0.0], [0.0, 0.0]]), ref, 8, "row")
    assert miss.where == (0,) and round(miss.ulps) == 9 and str(miss).endswith(
        "9 ulps of torch.float32 at its largest magnitude (budget 8)"), miss
    assert verify.ulps_beyond(ref + torch.tensor([[9 * eps, 0.0], [0.0, 0.0]]), ref, 8, "tensor") is None
    assert verify.ulps_beyond(ref + 9 * eps, ref, 8, 1.0).where == (0, 0)


def test_ulps_beyond_reads_nan_and_infinities_exactly_and_floors_the_ulp():
    """NaN and the infinities only where the reference has them (an output of 1 or 2 there too: no placeholder
    value passes); a reference infinity leaves the other values' magnitude finite; a zero row exact unless floored."""
    nan, inf = float("nan"), float("inf")
    ref = torch.tensor([[nan, inf, 1.0], [0.0, 0.0, 0.0]])
    assert verify.ulps_beyond(ref.clone(), ref, 2, "row") is None
    for value, where in ((1.0, (0, 0)), (2.0, (0, 1)), (-inf, (0, 1))):
        out = ref.clone()
        out[where] = value
        miss = verify.ulps_beyond(out, ref, 2, "row")
        assert miss.where == (0,) and str(miss) == f"holds {value:g} where the reference holds {ref[where]:g}", miss
    wide = ref.clone()
    wide[0, 2] = 1.5
    assert verify.ulps_beyond(wide, ref, 2, "tensor").where == (0, 2)
    dust = ref.clone()
    dust[1, 0] = 1e-40
    assert verify.ulps_beyond(dust, ref, 2, "row").where == (1,)
    assert verify.ulps_beyond(dust, ref, 2, "row", floor=verify.TINY) is None
