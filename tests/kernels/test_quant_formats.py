"""`dequantize_weight_triton` (the one-pass weight dequantisation of decode steps) equals the torch reference bit
for bit: every e4m3 code, fp32 and E8M0 block scales, block remainders, stacked experts, FP4 bytes. The FP8 weight
check the ops share names each op's own arguments."""

import pytest
import torch

from dsfuse.kernels.quant_formats import (E2M1_VALUES, E8M0_DTYPE, check_fp8_weight, dequantize_fp4,
                                          dequantize_fp8_blocks, dequantize_weight_triton, e2m1_values,
                                          scales_to_float32)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """NaN where NaN (its payload aside), else the same bits: equal values and the sign of zeros."""
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[got.dtype]
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def test_every_e8m0_byte_and_e2m1_code_is_exact():
    """The references build powers of two from bits (exact on every device), byte 0 the subnormal 2^-127."""
    scales = scales_to_float32(torch.arange(256, dtype=torch.uint8))
    assert scales[:255].tolist() == [2.0 ** (b - 127) for b in range(255)] and scales[255].isnan()
    assert e2m1_values(torch.arange(16)).tolist() == list(E2M1_VALUES)
    assert torch.signbit(e2m1_values(torch.tensor([8]))).item()


def test_every_e4m3_code_decodes_exactly():
    codes = torch.arange(256, dtype=torch.uint8).reshape(2, 128).view(torch.float8_e4m3fn)
    got = dequantize_weight_triton(codes, torch.ones(1, 1), 128, 128, torch.float32)
    assert same_bits(got, codes.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("stack", [(), (3,)], ids=["matrix", "stack"])
def test_block_scaled_e4m3_equals_reference(dtype, stack):
    g = torch.Generator().manual_seed(0)
    N, K, block = 77, 200, 64  # neither dimension a multiple of the block
    weight = (torch.randn(*stack, N, K, generator=g) * 40).to(torch.float8_e4m3fn)
    scales = torch.randn(*stack, 2, 4, generator=g) * 1e-2  # negative scales too: one fp32 product each
    got = dequantize_weight_triton(weight, scales, block, block, dtype)
    assert same_bits(got, dequantize_fp8_blocks(weight, scales, block, block).to(dtype))


@pytest.mark.parametrize("as_e8m0_dtype", [False, True], ids=["uint8", "float8_e8m0fnu"])
def test_e8m0_scales_equal_reference(as_e8m0_dtype):
    if as_e8m0_dtype and E8M0_DTYPE is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(2, 256, 384, generator=g) * 100).to(torch.float8_e4m3fn)
    scales = torch.randint(100, 140, (2, 2, 3), generator=g, dtype=torch.uint8)
    scales[0, 0, 0], scales[1, 1, 2] = 255, 0  # NaN and the smallest power of two
    if as_e8m0_dtype:
        scales = scales.view(E8M0_DTYPE)
    got = dequantize_weight_triton(weight, scales, 128, 128, torch.float32)
    assert same_bits(got, dequantize_fp8_blocks(weight, scales, 128, 128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp4_equals_reference(dtype):
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (3, 40, 48), generator=g, dtype=torch.uint8).view(torch.int8)  # K = 96
    scales = torch.randint(118, 130, (3, 40, 3), generator=g, dtype=torch.uint8)
    got = dequantize_weight_triton(packed, scales, 1, 32, dtype)
    assert same_bits(got, dequantize_fp4(packed, scales, torch.float32).to(dtype))


def test_scales_of_another_dtype_are_refused():
    weight = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float32 or E8M0"):
        dequantize_weight_triton(weight, torch.ones(1, 1, dtype=torch.float16), 128, 128, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fp4", [False, True], ids=["e4m3", "fp4"])
def test_cuda_bfloat16_equals_reference_and_replays_in_a_cuda_graph(fp4):
    g = torch.Generator().manual_seed(3)
    if fp4:
        weight = torch.randint(0, 256, (2, 300, 256), generator=g, dtype=torch.uint8).cuda()
        scales, block_n, block_k = torch.randint(110, 140, (2, 300, 16), generator=g, dtype=torch.uint8).cuda(), 1, 32
        want = dequantize_fp4(weight, scales, torch.float32).to(torch.bfloat16)
    else:
        weight = (torch.randn(32768 // 64, 512, generator=g) * 50).to(torch.float8_e4m3fn).cuda()
        scales, block_n, block_k = torch.rand(4, 4, generator=g).cuda() * 1e-2, 128, 128
        want = dequantize_fp8_blocks(weight, scales, block_n, block_k).to(torch.bfloat16)
    assert same_bits(dequantize_weight_triton(weight, scales, block_n, block_k, torch.bfloat16), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = dequantize_weight_triton(weight, scales, block_n, block_k, torch.bfloat16)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(replayed, want)


def test_the_fp8_weight_check_names_the_ops_arguments():
    """fp8_linear's names and its K step (block_k a multiple of 16), the absorbed attention's kv_b_* names (any
    positive blocks): a wrong dtype, a zero block (refused before the scale shape divides by it), a scale shape or
    dtype each raise naming the argument; stacked experts' scales have the stack's lead dim."""
    from dsfuse.kernels.fp8_linear import fp8_linear
    from dsfuse.kernels.sparse_attention import KV_B_ARGUMENTS

    weight, scale = torch.zeros(48, 40).to(torch.float8_e4m3fn), torch.ones(2, 2)
    check_fp8_weight("op", weight, scale, 24, 24, KV_B_ARGUMENTS)
    check_fp8_weight("op", weight[None].expand(3, -1, -1), scale.expand(3, -1, -1), 24, 24, lead=(3,))
    refusals = [((weight.float(), scale, 24, 24), TypeError, "op: with kv_b_scale, kv_b_weight must be a 2-D"),
                ((weight, scale, 0, 24), ValueError, r"op: kv_b_block_n and kv_b_block_k must be positive, got \[0, "),
                ((weight, scale[:1], 24, 24), ValueError, r"op: kv_b_scale must be \[2, 2\] for kv_b_weight \(48, "),
                ((weight, scale.double(), 24, 24), TypeError, "op: kv_b_scale must be float32 or E8M0")]
    for args, error, message in refusals:
        with pytest.raises(error, match=message):
            check_fp8_weight("op", *args, KV_B_ARGUMENTS)
    with pytest.raises(ValueError, match="block_k a multiple of 16"):
        check_fp8_weight("op", weight, scale, 24, 24, block_k_multiple=16)
    with pytest.raises(ValueError, match=r"fp8_linear: block_n and block_k must be positive .*got \[0, 128\]"):
        fp8_linear(torch.zeros(2, 40), weight, scale, 0, 128)
