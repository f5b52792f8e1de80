"""Routed experts on block-scaled FP8 / FP4 weights (`dsfuse::moe_experts_fp8`): the reference is transformers'
grouped FP8 experts math written slot by slot, the Triton path (interpreter on CPU) gives the reference's bits, expert
parallelism skips other ranks' slots, opcheck, bad input."""

import pytest
import torch

from dsfuse.kernels.fp8_linear import fp8_linear_reference
from dsfuse.kernels.moe_experts_fp8 import moe_experts_fp8, moe_experts_fp8_reference, moe_experts_fp8_triton
from dsfuse.kernels.quant_formats import E8M0_DTYPE
from dsfuse.models.quantized import quantize_fp8_weight

E, H, INTER, T, TOP_K = 4, 256, 128, 7, 2


def _stacks(kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "fp4":
        def fp4(N, K):
            packed = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8).view(torch.int8)
            return packed, torch.randint(118, 124, (E, N, K // 32), generator=g, dtype=torch.uint8).view(E8M0_DTYPE)
        return (*fp4(2 * INTER, H), *fp4(H, INTER))
    up = quantize_fp8_weight(torch.randn(E, 2 * INTER, H, generator=g) * 0.05, scale_fmt=kind)
    down = quantize_fp8_weight(torch.randn(E, H, INTER, generator=g) * 0.05, scale_fmt=kind)
    return (*up, *down)


def _routing(seed, dtype=torch.float16, offset=0, experts=E, tokens=T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(tokens)]) + offset
    weights = torch.rand(tokens, TOP_K, generator=g)
    return x, ids, weights


def _slot_by_slot(x, ids, weights, w13, s13, w2, s2, limit=None):
    """Each (token, expert) pair through its expert's two FP8 linears, weighted and summed over the k slots."""
    out = torch.zeros(T, H, dtype=torch.promote_types(x.dtype, weights.dtype))
    for t in range(T):
        for j in range(TOP_K):
            e = int(ids[t, j])
            h = fp8_linear_reference(x[t:t + 1], w13[e], s13[e], 128, 128)
            gate, up = h.chunk(2, dim=-1)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            y = fp8_linear_reference(torch.nn.functional.silu(gate) * up, w2[e], s2[e], 128, 128)
            out[t] += (y * weights[t, j])[0]
    return out.to(x.dtype)


@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_reference_is_each_slot_through_its_experts_fp8_linears(kind, limit):
    x, ids, weights = _routing(1)
    stacks = _stacks(kind, 2)
    got = moe_experts_fp8_reference(x.float(), ids, weights, *stacks, 128, 128, 0, limit)
    want = _slot_by_slot(x.float(), ids, weights, *stacks, limit)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,x_dtype,weights_dtype", [
    ("ue8m0", torch.float16, torch.float32), ("fp4", torch.float16, torch.float32),
    ("ue8m0", torch.float16, torch.float16)])
def test_triton_path_gives_the_references_bits(kind, x_dtype, weights_dtype, monkeypatch):
    """The combine rounds each weighted row to the product's dtype (fp16 router weights) as the reference does, with
    silu's exp as the interpreter takes it (see below). (bf16 is the GPU test's: the interpreter truncates fp32 to
    bf16 where the GPU rounds to nearest.)"""
    from test_fp8_linear import swiglu_as_the_interpreter

    from dsfuse.kernels import moe_experts_fp8 as module

    monkeypatch.setattr(module, "swiglu", swiglu_as_the_interpreter)
    x, ids, weights = _routing(3, dtype=x_dtype)
    weights = weights.to(weights_dtype)
    stacks = _stacks(kind, 4)
    assert torch.equal(moe_experts_fp8_triton(x, ids, weights, *stacks, 128, 128),
                       moe_experts_fp8_reference(x, ids, weights, *stacks, 128, 128))


@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_past_decode_sizes_swiglu_and_its_quantisation_are_one_pass(kind, limit, monkeypatch):
    """40 tokens x top-2 = 80 slots (past the decode path's 64 rows): SwiGLU is applied while the second GEMM's
    activations are quantised, with the reference's bits (V4's clamp too) where the reference's silu takes its exp
    as the interpreter does (`swiglu_as_the_interpreter`: torch's CPU exp differs in the last bit at times)."""
    from test_fp8_linear import swiglu_as_the_interpreter

    from dsfuse.kernels import moe_experts_fp8 as module

    passes = []
    quantize = module.quantize_for_weight
    monkeypatch.setattr(module, "quantize_for_weight",
                        lambda *args, **kwargs: passes.append(kwargs) or quantize(*args, **kwargs))
    x, ids, weights = _routing(5, dtype=torch.float16, tokens=40)
    stacks = _stacks(kind, 6)
    got = moe_experts_fp8_triton(x, ids, weights, *stacks, 128, 128, 0, limit)
    assert passes == [{"swiglu": (limit,)}]
    monkeypatch.setattr(module, "swiglu", swiglu_as_the_interpreter)
    assert torch.equal(got, moe_experts_fp8_reference(x, ids, weights, *stacks, 128, 128, 0, limit))


def test_expert_parallel_slots_of_other_ranks_add_nothing(monkeypatch):
    """Global ids 0..2E-1 on the rank holding experts E..2E-1: the other slots contribute zero, even with NaN
    router weights, on both paths."""
    from test_fp8_linear import swiglu_as_the_interpreter

    from dsfuse.kernels import moe_experts_fp8 as module

    x, ids, weights = _routing(5, experts=2 * E)
    weights = torch.where(ids < E, float("nan"), weights)
    stacks = _stacks("float", 6)
    got = moe_experts_fp8_reference(x, ids, weights, *stacks, 128, 128, E)
    local = ids >= E
    want = _slot_by_slot(x, (ids - E).clamp(min=0), torch.where(local, weights, 0), *stacks)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    monkeypatch.setattr(module, "swiglu", swiglu_as_the_interpreter)
    assert torch.equal(moe_experts_fp8_triton(x, ids, weights, *stacks, 128, 128, E),
                       moe_experts_fp8_reference(x, ids, weights, *stacks, 128, 128, E))


@pytest.mark.parametrize("kind", ["ue8m0", "fp4"])
def test_decode_sized_call_is_five_launches_and_no_torch_op(kind, monkeypatch):
    """A decode step's routed experts (one token, top-2 here; any count up to TRITON_ROUTING_MAX_SLOTS slots): the
    routing, both GEMMs, SwiGLU with the second GEMM's quantisation and the combine, one Triton launch each (FP4: and
    the first GEMM's activations quantised before it, as FP4 GEMMs read them), and no torch op computing on a tensor
    between them (on the GPU each would be a launch of its own: the routing in torch ops and a tile list per GEMM
    took ~65)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    launches, torch_ops, inside = [], [], []
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        inside.append(True)
        try:
            return run(self, *args, **kwargs)
        finally:
            inside.pop()

    class TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            allocates = func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided)
            if not inside and isinstance(out, torch.Tensor) and not func.is_view and not allocates:
                torch_ops.append(func.__name__)
            return out

    x, ids, weights = _routing(19, dtype=torch.float16, tokens=1)
    stacks = _stacks(kind, 20)
    moe_experts_fp8_triton(x, ids, weights, *stacks, 128, 128)  # first call: the GEMMs' arrival counters
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)
    with TorchOps():
        moe_experts_fp8_triton(x, ids, weights, *stacks, 128, 128)
    first = ["_act_quant_kernel", "_fp4_gemm_kernel"] if kind == "fp4" else ["_fp8_decode_kernel"]
    assert launches == ["_routing_kernel", *first, "_act_quant_kernel", first[-1], "_combine_kernel"]
    assert torch_ops == []


def test_op_dispatches_to_the_reference_and_passes_opcheck():
    from dsfuse.kernels.triton_support import check_outputs_match_fake

    x, ids, weights = _routing(7)
    args = (x, ids, weights, *_stacks("ue8m0", 8), 128, 128, 0, None)
    out = moe_experts_fp8(*args)
    assert torch.equal(out, moe_experts_fp8_reference(*args))
    torch.library.opcheck(moe_experts_fp8, args,
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    check_outputs_match_fake("dsfuse::moe_experts_fp8", args, {}, out)


@pytest.mark.parametrize("change,message", [
    (lambda a: (a[0][:, :100], *a[1:]), r"weights must be gate_up \[E, 2I, H\] and down \[E, H, I\] with H = 100"),
    (lambda a: (a[0], a[1].float(), *a[2:]), "expert_ids must be integer"),
    (lambda a: (*a[:2], a[2][:, :1], *a[3:]), "expert_weights must be float"),
    (lambda a: (*a[:5], a[5][:2], *a[6:]), "gate_up and down must be"),
    (lambda a: (*a[:9], -1, None), "local_expert_offset must be >= 0"),
    (lambda a: (*a[:9], 0, float("inf")), "swiglu_limit must be a positive finite float"),
])
def test_bad_inputs_are_refused_with_the_argument_named(change, message):
    x, ids, weights = _routing(9)
    args = change((x, ids, weights, *_stacks("float", 10), 128, 128, 0, None))
    with pytest.raises(ValueError, match=message):
        moe_experts_fp8(*args)


def test_negative_ids_raise_on_the_reference():
    x, ids, weights = _routing(11)
    ids[0, 0] = -1
    with pytest.raises(ValueError, match="expert ids must be >= 0"):
        moe_experts_fp8(x, ids, weights, *_stacks("float", 12), 128, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ue8m0", "fp4"])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_the_reference_and_replays_in_a_cuda_graph(kind, weights_dtype):
    """The CUDA path within the fp8 MMA's rounding of the reference, with no host sync: a CUDA graph captures it and
    replays it on new tokens and new routing."""
    x, ids, weights = (t.cuda() for t in _routing(13, torch.bfloat16))
    weights = weights.to(weights_dtype)
    stacks = tuple(t.cuda() for t in _stacks(kind, 14))

    def rel(got, want):
        return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

    assert rel(moe_experts_fp8(x, ids, weights, *stacks, 128, 128), moe_experts_fp8_reference(
        x, ids, weights, *stacks, 128, 128)) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe_experts_fp8(x, ids, weights, *stacks, 128, 128)
    new_x, new_ids, new_weights = _routing(15, torch.bfloat16)
    x.copy_(new_x), ids.copy_(new_ids), weights.copy_(new_weights)
    graph.replay()
    assert rel(replayed, moe_experts_fp8_reference(x, ids, weights, *stacks, 128, 128)) < 2e-2


@pytest.mark.gpu
def test_cuda_skips_other_ranks_slots():
    """Expert parallelism on the GPU: other ranks' slots (NaN router weights here) add nothing."""
    x, ids, weights = (t.cuda() for t in _routing(17, torch.bfloat16, experts=2 * E))
    weights = torch.where(ids < E, float("nan"), weights)
    stacks = tuple(t.cuda() for t in _stacks("ue8m0", 18))
    got = moe_experts_fp8(x, ids, weights, *stacks, 128, 128, E)
    want = moe_experts_fp8_reference(x, ids, weights, *stacks, 128, 128, E)
    assert not got.isnan().any()
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < 2e-2
