"""`dsfuse.rmsnorm_rope`: reference and Triton kernel against HF's and the official functions, bit for bit.

Sums of squares are made exact (values on a 1/8 grid) where a test asserts the norm bit for bit: the
kernel may sum in another order than torch (allowed), and every other rounding must then agree.
bf16 runs under the interpreter too: the kernel rounds by hand there (the interpreter's cast truncates).
"""

import pytest
import torch
from dsfuse.kernels.norm_rope_quant import (
    rmsnorm_rope,
    rmsnorm_rope_reference,
    rmsnorm_rope_triton,
)
from dsfuse.models.official import rms_norm_official
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32RMSNorm,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T, c_norm, c_rope, dtype, dyadic=True, row_pad=5, seed=0):
    """x as a non-contiguous row slice of a wider projection output, HF-form cos/sin, a weight."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(T, c_norm + c_rope + 2 * row_pad, generator=g) * 2
    if dyadic:
        wide = (wide * 8).round() / 8
    x = wide.to(dtype)[:, row_pad:row_pad + c_norm + c_rope]
    angles = torch.randn(T, c_rope // 2, generator=g) * 3
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    weight = (1 + 0.5 * torch.randn(c_norm, generator=g)).to(dtype)
    return x.to(DEVICE), weight.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)


def _hf(x, weight, eps, cos, sin, interleaved):
    c_norm = weight.shape[0]
    norm = DeepseekV32RMSNorm(c_norm, eps).to(device=x.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    rot = x[:, c_norm:][None, None]  # [B=1, H=1, T, C_rope]
    rope = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    roped, _ = rope(rot, rot, cos[None], sin[None])
    return norm(x[:, :c_norm]), roped[0, 0]


def _assert_equal(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_reference_and_kernel_match_hf_bit_for_bit(dtype, interleaved):
    x, w, cos, sin = _inputs(7, 48, 16, dtype)
    want_norm, want_rope = _hf(x, w, 1e-6, cos, sin, interleaved)
    for fn in (rmsnorm_rope_reference, rmsnorm_rope_triton):
        normed, roped = fn(x, w, 1e-6, cos, sin, interleaved, False)
        _assert_equal(normed, want_norm)
        _assert_equal(roped, want_rope)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_inputs_rope_exact_norm_within_summation_order(dtype):
    x, w, cos, sin = _inputs(5, 64, 16, dtype, dyadic=False, seed=3)
    want_norm, want_rope = _hf(x, w, 1e-6, cos, sin, True)
    normed, roped = rmsnorm_rope_triton(x, w, 1e-6, cos, sin, True, False)
    _assert_equal(roped, want_rope)
    ulp = torch.finfo(dtype).eps * want_norm.float().abs().clamp(min=1e-3)
    assert ((normed.float() - want_norm.float()).abs() <= ulp * 2).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_official_weight_in_fp32_matches(dtype):
    x, w, cos, sin = _inputs(6, 32, 8, dtype)
    w32 = w.float() * 1.01  # an fp32 weight, not representable in the input dtype
    want = rms_norm_official(x[:, :32], w32, 1e-6)
    for fn in (rmsnorm_rope_reference, rmsnorm_rope_triton):
        normed, _ = fn(x, w32, 1e-6, cos, sin, True, True)
        _assert_equal(normed, want)


def test_interleaved_and_half_split_differ_and_each_matches_only_its_own_form():
    x, w, cos, sin = _inputs(4, 16, 16, torch.float32)
    _, inter = rmsnorm_rope_triton(x, w, 1e-6, cos, sin, True, False)
    _, half = rmsnorm_rope_triton(x, w, 1e-6, cos, sin, False, False)
    _, hf_inter = _hf(x, w, 1e-6, cos, sin, True)
    _, hf_half = _hf(x, w, 1e-6, cos, sin, False)
    _assert_equal(inter, hf_inter)
    _assert_equal(half, hf_half)
    assert not torch.allclose(inter, hf_half, atol=1e-2)
    assert not torch.allclose(half, hf_inter, atol=1e-2)


def test_interleaved_output_is_hf_layout_evens_then_odds():
    """Zero angle: the rotation is the identity, so the output is x's even lanes, then its odd lanes."""
    x, w, _, _ = _inputs(3, 8, 8, torch.float32)
    ones, zeros = torch.ones(3, 8, device=DEVICE), torch.zeros(3, 8, device=DEVICE)
    _, roped = rmsnorm_rope_triton(x, w, 1e-6, ones, zeros, True, False)
    rot = x[:, 8:]
    _assert_equal(roped, torch.cat([rot[:, 0::2], rot[:, 1::2]], -1))


@pytest.mark.parametrize("T", [0, 1, 9])
def test_odd_and_empty_row_counts(T):
    x, w, cos, sin = _inputs(T, 24, 8, torch.float16)
    want = rmsnorm_rope_reference(x, w, 1e-5, cos, sin, False, False)
    got = rmsnorm_rope_triton(x, w, 1e-5, cos, sin, False, False, rows_per_program=4)
    for g, r in zip(got, want):
        _assert_equal(g, r)


def test_norm_only_without_rope():
    x, w, _, _ = _inputs(5, 40, 0, torch.bfloat16)
    normed, roped = rmsnorm_rope_triton(x, w, 1e-6, None, None, True, False)
    _assert_equal(normed, rmsnorm_rope_reference(x, w, 1e-6, None, None, True, False)[0])
    assert roped.shape == (5, 0)


def test_custom_op_cpu_matches_reference_and_passes_opcheck():
    x, w, cos, sin = _inputs(5, 32, 16, torch.bfloat16)
    normed, roped = torch.ops.dsfuse.rmsnorm_rope(x, w, 1e-6, cos, sin, True, False)
    ref = rmsnorm_rope_reference(x, w, 1e-6, cos, sin, True, False)
    _assert_equal(normed, ref[0])
    _assert_equal(roped, ref[1])
    torch.library.opcheck(rmsnorm_rope, (x, w, 1e-6, cos, sin, True, False))
    torch.library.opcheck(rmsnorm_rope, (x, w.float(), 1e-6, cos, sin, False, True))


def test_nan_and_inf_propagate_like_hf():
    x, w, cos, sin = _inputs(3, 16, 8, torch.float32)
    x = x.clone()
    x[0, 2] = float("nan")
    x[1, 17] = float("inf")
    want_norm, want_rope = _hf(x, w, 1e-6, cos, sin, True)
    normed, roped = rmsnorm_rope_triton(x, w, 1e-6, cos, sin, True, False)
    torch.testing.assert_close(normed, want_norm, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(roped, want_rope, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("case, error", [
    ("odd_rope", ValueError), ("cos_dtype", TypeError), ("cos_shape", ValueError),
    ("weight_dtype", TypeError), ("strided_cols", ValueError), ("int_x", TypeError), ("missing_sin", ValueError),
])
def test_bad_input_raises_clearly(case, error):
    x, w, cos, sin = _inputs(4, 16, 8, torch.bfloat16)
    args = {"x": x, "norm_weight": w, "eps": 1e-6, "cos": cos, "sin": sin, "interleaved": True, "weight_in_fp32": False}
    if case == "odd_rope":
        args.update(x=x[:, :23], cos=cos[:, :7], sin=sin[:, :7])
    elif case == "cos_dtype":
        args.update(cos=cos.float())
    elif case == "cos_shape":
        args.update(cos=cos[:3])
    elif case == "weight_dtype":
        args.update(norm_weight=w.float())
    elif case == "strided_cols":
        args.update(x=torch.randn(4, 48, dtype=torch.bfloat16, device=DEVICE)[:, ::2])
    elif case == "int_x":
        args.update(x=torch.ones(4, 24, dtype=torch.int32, device=DEVICE))
    elif case == "missing_sin":
        args.update(sin=None)
    with pytest.raises(error, match="rmsnorm_rope"):
        torch.ops.dsfuse.rmsnorm_rope(**args)
    with pytest.raises(error, match="rmsnorm_rope"):
        rmsnorm_rope_triton(*args.values())
