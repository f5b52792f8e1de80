"""Fuzz `dsfuse::fp8_linear`, `dsfuse::fp8_grouped_linear`, `dsfuse::fp8_linears`, the weight dequantisation and
`dsfuse::moe_experts_fp8`: the op against the reference bit for bit (CPU), and the Triton kernels against the
reference (bit for bit under the interpreter; on CUDA within the fp8 MMA's rounding), over row counts at the edges
(and on either side of the decode path's DECODE_MAX_ROWS), K
not a multiple of the 128-channel group, FP8 weights with fp32 or UE8M0 scales and FP4 weights, strided activations,
expert groups that are empty or end before the last row, routed experts with repeated and other ranks' ids, and
zeros / ties."""

import torch
from fuzz_support import DEVICE, assert_rel_close, assert_same, fuzzes, layouts, reference_output, restride, seeds, \
    sizes, values
from hypothesis import given
from hypothesis import strategies as st

from dsfuse.kernels import fp8_linear as ops
from dsfuse.kernels.quant_formats import E8M0_DTYPE, dequantize_weight_triton
from dsfuse.models.quantized import quantize_fp8_weight

DTYPE = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # the interpreter computes bf16 unlike the GPU


def _weight(kind, lead, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "fp4":
        packed = torch.randint(0, 256, (*lead, N, K // 2), generator=g, dtype=torch.uint8).view(torch.int8)
        return packed, torch.randint(117, 128, (*lead, N, K // 32), generator=g, dtype=torch.uint8).view(E8M0_DTYPE)
    return quantize_fp8_weight(torch.randn(*lead, N, K, generator=g) * 0.1, scale_fmt=kind)


@st.composite
def linear_inputs(draw, grouped=False):
    kind = draw(st.sampled_from(["float", "ue8m0", "fp4"]))
    K = draw(st.sampled_from([64, 128, 160, 256, 320] if kind == "fp4" else [16, 64, 130, 256, 300]))
    rows = st.one_of(sizes(0 if grouped else 1, 33), st.sampled_from([ops.DECODE_MAX_ROWS, ops.DECODE_MAX_ROWS + 1]))
    N, M, seed = draw(sizes(1, 33)), draw(rows), draw(seeds())
    specials = draw(st.lists(st.sampled_from(["zero", "tie"]), max_size=1))
    x = restride(values((M, K), DTYPE, seed, scale=3.0, specials=specials), draw(layouts(2))).to(DEVICE)
    if not grouped:
        return x, *(t.to(DEVICE) for t in _weight(kind, (), N, K, seed + 1)), 128, 128
    E = draw(st.integers(1, 5))
    cuts = sorted(draw(st.lists(st.integers(0, M), min_size=E, max_size=E)))
    offsets = torch.tensor(cuts, dtype=torch.int32, device=DEVICE)
    return x, *(t.to(DEVICE) for t in _weight(kind, (E,), N, K, seed + 1)), offsets, 128, 128


def _compare(got, want, what):
    if DEVICE == "cpu":
        assert_same(got, want, what=what)
    else:
        assert_rel_close(got, want, 1e-2, what)


@fuzzes("dsfuse::fp8_linear")
@given(args=linear_inputs())
def test_fp8_linear(args):
    want = reference_output(torch.ops.dsfuse.fp8_linear, ops.fp8_linear_reference, *args)
    _compare(ops.fp8_linear_triton(*args), want, "fp8_linear")


@fuzzes("dsfuse::fp8_grouped_linear")
@given(args=linear_inputs(grouped=True))
def test_fp8_grouped_linear(args):
    want = reference_output(torch.ops.dsfuse.fp8_grouped_linear, ops.fp8_grouped_linear_reference, *args)
    _compare(ops.fp8_grouped_linear_triton(*args), want, "fp8_grouped_linear")


@st.composite
def linears_inputs(draw):
    """One input through one to three FP8 weights of its K (one scale kind), rows on either side of the decode
    kernel's own quantisation (DECODE_QUANTIZE_MAX_ROW_TILE) and of DECODE_MAX_ROWS."""
    kind = draw(st.sampled_from(["float", "ue8m0"]))
    K, seed = draw(st.sampled_from([16, 64, 130, 256, 300])), draw(seeds())
    edges = [ops.DECODE_QUANTIZE_MAX_ROW_TILE, ops.DECODE_QUANTIZE_MAX_ROW_TILE + 1, ops.DECODE_MAX_ROWS + 1]
    M = draw(st.one_of(sizes(1, 33), st.sampled_from(edges)))
    widths = draw(st.lists(sizes(1, 33), min_size=1, max_size=3))
    specials = draw(st.lists(st.sampled_from(["zero", "tie"]), max_size=1))
    x = restride(values((M, K), DTYPE, seed, scale=3.0, specials=specials), draw(layouts(2))).to(DEVICE)
    pairs = [[t.to(DEVICE) for t in _weight(kind, (), N, K, seed + 1 + i)] for i, N in enumerate(widths)]
    return x, [w for w, _ in pairs], [s for _, s in pairs], [128] * len(pairs), 128


@fuzzes("dsfuse::fp8_linears")
@given(args=linears_inputs())
def test_fp8_linears(args):
    want = reference_output(torch.ops.dsfuse.fp8_linears, ops.fp8_linears_reference, *args)
    for i, (got, one) in enumerate(zip(ops.fp8_linears_triton(*args), want)):
        _compare(got, one, f"fp8_linears[{i}]")


@given(kind=st.sampled_from(["float", "ue8m0", "fp4"]), lead=st.sampled_from([(), (1,), (3,)]), N=sizes(1, 300),
       K=st.sampled_from([64, 128, 160, 320]), dtype=st.sampled_from([torch.float32, DTYPE]), seed=seeds())
def test_weight_dequantization(kind, lead, N, K, dtype, seed):
    """The exact values rounded once, on the kernels' device, whatever the stack, block remainder or format."""
    weight, scale = (t.to(DEVICE) for t in _weight(kind, lead, N, K, seed))
    got = dequantize_weight_triton(weight, scale, 128, 128, dtype)
    assert_same(got.cpu(), ops.dequantize_weight(weight.cpu(), scale.cpu(), 128, 128).to(dtype),
                what="dequantize_weight_triton")


@st.composite
def experts_inputs(draw):
    """Routed experts over FP8 / FP4 stacks: T tokens (one to an odd count), k of E experts each (ids repeating,
    other ranks' ids with an expert offset), router weights of either float dtype, an optional SwiGLU clamp."""
    kind = draw(st.sampled_from(["float", "ue8m0", "fp4"]))
    H, inter = draw(st.sampled_from([64, 128, 256])), draw(st.sampled_from([64, 128]))
    T, E, seed = draw(sizes(1, 9)), draw(st.integers(1, 4)), draw(seeds())
    top_k = draw(st.integers(1, min(E, 3)))
    offset = draw(st.sampled_from([0, 0, E]))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E + offset, (T, top_k), generator=g)
    weights = torch.rand(T, top_k, generator=g).to(draw(st.sampled_from([torch.float32, DTYPE])))
    x = values((T, H), DTYPE, seed, scale=3.0, specials=draw(st.lists(st.sampled_from(["zero", "tie"]), max_size=1)))
    up, down = _weight(kind, (E,), 2 * inter, H, seed + 1), _weight(kind, (E,), H, inter, seed + 2)
    limit = draw(st.sampled_from([None, 0.75]))
    tensors = (x, ids, weights, *up, *down)
    return (*(t.to(DEVICE) for t in tensors), 128, 128, offset, limit)


@fuzzes("dsfuse::moe_experts_fp8")
@given(args=experts_inputs())
def test_moe_experts_fp8(args):
    from dsfuse.kernels import moe_experts_fp8 as experts

    want = reference_output(torch.ops.dsfuse.moe_experts_fp8, experts.moe_experts_fp8_reference, *args)
    _compare(experts.moe_experts_fp8_triton(*args), want, "moe_experts_fp8")
