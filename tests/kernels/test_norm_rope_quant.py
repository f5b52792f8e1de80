"""`dsfuse.rmsnorm_rope` and `dsfuse.rope_cat`: references and Triton kernels against HF's and the official
functions, bit for bit; the kernels' sm_90 PTX keeps every rounding (no FMA contraction).

Sums of squares are made exact (values on a 1/8 grid) where a test asserts the norm bit for bit: the
kernel may sum in another order than torch (allowed), and every other rounding must then agree.
bf16 runs under the interpreter too: the kernel rounds by hand there (the interpreter's cast truncates).
"""

import unittest.mock

import pytest
import torch
from dsfuse.kernels.norm_rope_quant import (
    RMS_NORMS,
    complex_rope_reference,
    layer_norm_reference,
    rms_norm_reference,
    rmsnorm_rope,
    rmsnorm_rope_reference,
    rmsnorm_rope_triton,
    rope_cat,
    rope_cat_reference,
    rope_cat_triton,
    rope_quant_fp8,
    rope_quant_fp8_reference,
    rope_quant_fp8_triton,
)
from dsfuse.kernels.triton_support import fma_rounds_once
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


_PTX_PROBE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from dsfuse.kernels import norm_rope_quant as nrq

found = {}
for label, members, options in json.loads(sys.argv[1]):
    # the kernel a launch of these block functions runs (one block: a plain launch; more: a launch group)
    kernel = nrq._group_kernel(tuple(getattr(nrq, block) for block, _ in members))
    consts = {f"m{i}_{name}": value for i, (_, member) in enumerate(members) for name, value in member.items()}
    names = list(kernel.arg_names)
    base = {n: re.sub(r"^m[0-9]+_", "", n) for n in names}
    sig = {n: "constexpr" if n in consts else "*bf16" if base[n].endswith("_ptr") else
           "fp32" if base[n].endswith("eps") else "i32" for n in names}
    # 16-divisible pointers and sizes, as the launch specialises them on the GPU (kv rows of 576, D = 192)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] in ("*bf16", "i32")}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options}).asm["ptx"]
    ops = r"\b(?:fma|mul|add|sub|neg|cvt|div|sqrt|rsqrt)\.[a-z0-9.]*(?:bf16x2|bf16|f32)\b"
    found[label] = sorted(set(re.findall(ops, ptx)))
print(json.dumps(found))
"""


def _sm90_float_instructions(configs):
    """Float instructions in the kernels' sm_90 PTX, compiled offline (no GPU) in a fresh process where
    the interpreter is off."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _PTX_PROBE, json.dumps(configs)], env=env, capture_output=True,
                          check=False, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sm90_ptx_rounds_every_op_like_eager():
    """The shipped options leave no FMA and only explicitly rounded (`.rn`) multiplies, adds and subtracts,
    so each torch op's rounding survives; Triton's default (fusion on) contracts the bf16 RoPE into
    `fma.rn.bf16`, the 1-ulp mismatch measured on the H200 (this half shows the check can fail). The RMSNorm's
    division form takes an IEEE square root and quotient (`sqrt.rn`, `div.rn`), as torch does."""
    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    from dsfuse.kernels.norm_rope_quant import COMPILE_OPTIONS

    def norm(interleaved, div_sqrt=False, fp32_pairs=False, in_place=False):
        return {"ROWS": 8, "BLOCK_N": 512, "BLOCK_H": 32, "INTERLEAVED": interleaved, "WEIGHT_FP32": False,
                "HAS_ROPE": True, "COMPLEX": False, "REAL_MUL": 0, "IMAG_MUL": 0, "MANUAL_BF16_RNE": False,
                "DIV_SQRT": div_sqrt, "FP32_PAIRS": fp32_pairs, "IN_PLACE": in_place}

    def cat(interleaved, layer_norm=False, v4=False, div_sqrt=False, in_place=False):
        norm_kind = 1 + RMS_NORMS.index("unweighted_scale_cast") if v4 else int(layer_norm)
        return {"ROWS": 16, "BLOCK_D": 256, "BLOCK_H": 32, "INTERLEAVED": interleaved, "NORM": norm_kind,
                "FP32_PAIRS": v4, "MANUAL_BF16_RNE": False, "DIV_SQRT": div_sqrt, "IN_PLACE": in_place}

    q_a_norm = {**norm(True), "ROWS": 2, "BLOCK_N": 2048, "HAS_ROPE": False}

    found = _sm90_float_instructions([
        ["norm_interleaved", [["_rmsnorm_rope_block", norm(True)]], COMPILE_OPTIONS],
        ["norm_half_split", [["_rmsnorm_rope_block", norm(False)]], COMPILE_OPTIONS],
        ["cat_interleaved", [["_rope_cat_block", cat(True)]], COMPILE_OPTIONS],
        ["cat_half_split", [["_rope_cat_block", cat(False)]], COMPILE_OPTIONS],
        ["cat_layer_norm_half_split", [["_rope_cat_block", cat(False, layer_norm=True)]], COMPILE_OPTIONS],
        ["cat_v4_rms_norm_pairs", [["_rope_cat_block", cat(True, v4=True)]], COMPILE_OPTIONS],
        ["norm_div_sqrt", [["_rmsnorm_rope_block", norm(True, div_sqrt=True)]], COMPILE_OPTIONS],
        ["cat_v4_rms_div_sqrt", [["_rope_cat_block", cat(True, v4=True, div_sqrt=True)]], COMPILE_OPTIONS],
        ["norm_fp32_pairs", [["_rmsnorm_rope_block", norm(True, fp32_pairs=True)]], COMPILE_OPTIONS],
        ["norm_pairs_in_place", [["_rmsnorm_rope_block", norm(True, in_place=True)]], COMPILE_OPTIONS],
        ["cat_pairs_in_place", [["_rope_cat_block", cat(True, in_place=True)]], COMPILE_OPTIONS],
        ["layer_group", [["_rmsnorm_rope_block", norm(True)], ["_rmsnorm_rope_block", q_a_norm],
                         ["_rope_cat_block", cat(False, layer_norm=True)]], COMPILE_OPTIONS],
        ["fusion_on", [["_rmsnorm_rope_block", norm(True)]], {"enable_fp_fusion": True}],
    ])
    division = ("norm_div_sqrt", "cat_v4_rms_div_sqrt")
    for label, ops in found.items():
        if label == "fusion_on":
            continue
        assert not [op for op in ops if op.startswith("fma")], (label, ops)
        arithmetic = [op for op in ops if op.split(".")[0] in ("mul", "add", "sub")]
        assert label in (*division, "norm_fp32_pairs") or any("bf16" in op for op in arithmetic), (label, ops)
        assert all(".rn." in op for op in arithmetic), (label, ops)
    assert "fma.rn.bf16" in found["fusion_on"], found["fusion_on"]
    for label in division:  # IEEE square root and quotient, no reciprocal square root
        ops = found[label]
        assert {"sqrt.rn.f32", "div.rn.f32"} <= set(ops), (label, ops)
        assert not [op for op in ops if op.startswith("rsqrt") or op.startswith("sqrt.approx")], (label, ops)


def _q_states(dtype, heads=3, seq=5, batch=2, c_pass=12, c_rope=8, seed=1):
    """HF's main query: a [B, S, H*D] projection viewed per head and transposed to [B, H, S, D] (strided),
    with cos/sin [B, S, C_rope] expanded to [B, H, S, C_rope] (stride 0 over the heads)."""
    g = torch.Generator().manual_seed(seed)
    proj = (torch.randn(batch, seq, heads * (c_pass + c_rope), generator=g) * 2).to(dtype)
    q = proj.view(batch, seq, heads, c_pass + c_rope).transpose(1, 2)
    angles = torch.randn(batch, seq, c_rope // 2, generator=g) * 3
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    return q.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half_split"])
@pytest.mark.parametrize("rope_first", [False, True], ids=["pass_then_rope", "rope_then_pass"])
def test_rope_cat_matches_hf_split_rope_cat(dtype, interleaved, rope_first):
    """Main query (pass part first, interleaved) and indexer (rope part first, half-split) orders, both forms."""
    q, cos, sin = _q_states(dtype)
    c_rope = cos.shape[-1]
    c_pass = q.shape[-1] - c_rope
    sizes = [c_rope, c_pass] if rope_first else [c_pass, c_rope]
    parts = list(torch.split(q, sizes, dim=-1))
    rot = parts[0] if rope_first else parts[1]
    rope = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    roped, _ = rope(rot, rot, cos, sin)  # unsqueeze_dim=1: the heads
    want = torch.cat([roped, parts[1]] if rope_first else [parts[0], roped], dim=-1)
    cos4, sin4 = (t.unsqueeze(1).expand(*q.shape[:3], c_rope) for t in (cos, sin))
    start = 0 if rope_first else c_pass
    for fn in (rope_cat_reference, rope_cat_triton):
        _assert_equal(fn(q, cos4, sin4, start, interleaved), want)
    assert torch.ops.dsfuse.rope_cat(q, cos4, sin4, start, interleaved).is_contiguous()


def test_rope_cat_opcheck_and_bad_input():
    q, cos, sin = _q_states(torch.bfloat16)
    cos4, sin4 = (t.unsqueeze(1).expand(*q.shape[:3], 8).contiguous() for t in (cos, sin))
    torch.library.opcheck(rope_cat, (q, cos4, sin4, 12, True))
    with pytest.raises(ValueError, match="rope_cat"):
        rope_cat(q, cos4, sin4, 13, True)  # rope columns past the end
    with pytest.raises(TypeError, match="rope_cat"):
        rope_cat(q, cos4.float(), sin4, 12, True)
    with pytest.raises(ValueError, match="rope_cat"):
        rope_cat(q[0], cos4[0], sin4[0], 12, True)


# --------------------------------------------------------------------------------------------
# The indexer key: LayerNorm + half-split RoPE + cat in one `rope_cat`
# --------------------------------------------------------------------------------------------
def _key_states(dtype, batch=2, seq=5, dim=32, c_rope=8, exact_stats=True, seed=3):
    """HF's indexer key before `k_norm`: `wk`'s output [B, S, D] unsqueezed to [B, S, 1, D], a LayerNorm
    weight and bias, cos/sin [B, S, C_rope] unsqueezed to [B, S, 1, C_rope]. With `exact_stats` each row
    is m ± v on a 1/8 grid (shuffled), so its mean and variance are exact in any summation order."""
    g = torch.Generator().manual_seed(seed)
    if exact_stats:
        centre = torch.randint(-8, 9, (batch * seq, 1), generator=g) / 8
        offsets = torch.randint(-16, 17, (batch * seq, dim // 2), generator=g) / 8
        rows = torch.cat([centre + offsets, centre - offsets], -1)
        rows = rows.gather(-1, torch.argsort(torch.rand(batch * seq, dim, generator=g), -1))
    else:
        rows = torch.randn(batch * seq, dim, generator=g) * 2 + 0.5
    k = rows.view(batch, seq, dim).to(dtype)
    weight = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype)
    bias = (0.2 * torch.randn(dim, generator=g)).to(dtype)
    angles = torch.randn(batch, seq, c_rope // 2, generator=g) * 3
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    return *(t.to(DEVICE) for t in (k, weight, bias, cos, sin)),


def _hf_key_path(k, cos, sin, layer_norm, interleaved=False):
    """`DeepseekV32Indexer.forward`'s key path after `wk`, with `layer_norm` standing for `self.k_norm`."""
    c_rope = cos.shape[-1]
    k = layer_norm(k).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [c_rope, k.shape[-1] - c_rope], dim=-1)
    rope = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    _, k_rot = rope(k_rot, k_rot, cos, sin, unsqueeze_dim=2)
    return torch.cat([k_rot, k_pass], dim=-1)


def _decomposed_layer_norm(weight, bias, eps=1e-6):
    """torch's own op sequence for `layer_norm` (what Inductor compiles in place of the eager kernel)."""
    return lambda x: torch._refs.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)[0]


def _key_args(k, weight, bias, cos, sin):
    return k.unsqueeze(2), cos.unsqueeze(2), sin.unsqueeze(2), 0, False, weight, bias, 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_reference_is_torchs_decomposition_and_eager_up_to_its_fma(dtype):
    """Bit-exact against torch's decomposition; eager's CPU kernel (Welford statistics, fused multiply-adds)
    rounds differently: a few fp32 ulps on most fp32 elements, the last bit of a few bf16/fp16 ones."""
    k, weight, bias, _, _ = _key_states(dtype, seq=64, dim=128)
    got = layer_norm_reference(k, weight, bias, 1e-6)
    _assert_equal(got, _decomposed_layer_norm(weight, bias)(k))
    module = torch.nn.LayerNorm(128, eps=1e-6).to(device=k.device, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
        eager = module(k)
    ulp = torch.finfo(dtype).eps * eager.float().abs().clamp_min(1)
    assert ((got.float() - eager.float()).abs() <= 4 * ulp).all()
    if dtype != torch.float32:
        assert (got != eager).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
def test_layer_norm_rope_cat_matches_hf_key_path(dtype, interleaved):
    """The indexer key path (LayerNorm, split, RoPE, cat) as one `rope_cat`: reference and kernel equal HF's
    code (with torch's decomposed LayerNorm) bit for bit."""
    k, weight, bias, cos, sin = _key_states(dtype)
    want = _hf_key_path(k, cos, sin, _decomposed_layer_norm(weight, bias), interleaved)
    args = list(_key_args(k, weight, bias, cos, sin))
    args[4] = interleaved
    for fn in (rope_cat_reference, rope_cat_triton):
        _assert_equal(fn(*args), want)


def test_layer_norm_rope_cat_random_statistics_within_an_ulp():
    """Random rows: the kernel's summation order may move mean or variance by an fp32 ulp (allowed)."""
    k, weight, bias, cos, sin = _key_states(torch.bfloat16, seq=16, exact_stats=False)
    got = rope_cat_triton(*_key_args(k, weight, bias, cos, sin)).float()
    want = rope_cat_reference(*_key_args(k, weight, bias, cos, sin)).float()
    assert ((got - want).abs() <= 2 * torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1)).all()
    assert (got != want).float().mean() < 0.02


def test_layer_norm_rope_cat_half_split_is_not_interleaved():
    """The two RoPE forms give different keys on these inputs, so the bit-exact test above tells them apart."""
    k, weight, bias, cos, sin = _key_states(torch.float32)
    args = list(_key_args(k, weight, bias, cos, sin))
    half_split = rope_cat_triton(*args)
    args[4] = True
    assert not torch.allclose(half_split, rope_cat_triton(*args), atol=1e-3)
    assert not torch.allclose(half_split, rope_cat_reference(*args), atol=1e-3)


def test_layer_norm_rope_cat_opcheck_and_bad_input():
    k, weight, bias, cos, sin = _key_states(torch.bfloat16)
    x, cos4, sin4, start, interleaved, *_ = _key_args(k, weight, bias, cos, sin)
    torch.library.opcheck(rope_cat, (x, cos4, sin4, start, interleaved, weight, bias, 1e-6))
    with pytest.raises(ValueError, match="both"):
        rope_cat(x, cos4, sin4, start, interleaved, weight, None, 1e-6)
    with pytest.raises(ValueError, match="ln_weight"):
        rope_cat(x, cos4, sin4, start, interleaved, weight[:-1], bias[:-1], 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rope_cat(x, cos4, sin4, start, interleaved, weight, bias, -1.0)


# --- dsfuse.rope_quant_fp8: the official indexer's complex RoPE + cat + fp8 per-block quantisation ----------
QUANT_DTYPES = (torch.bfloat16, torch.float32)
# one lane of (a + ib)(c + is) in each rounding: real = a*c - b*s, imag = a*s + b*c; an fp64 sum of exact fp32
# products stands for a fused multiply-add
REAL_LANE = {
    "rounded": lambda a, b, c, s: a * c - b * s,
    "fma_first": lambda a, b, c, s: (a.double() * c.double() - (b * s).double()).float(),
    "fma_second": lambda a, b, c, s: ((a * c).double() - b.double() * s.double()).float(),
}
IMAG_LANE = {
    "rounded": lambda a, b, c, s: a * s + b * c,
    "fma_first": lambda a, b, c, s: (a.double() * s.double() + (b * c).double()).float(),
    "fma_second": lambda a, b, c, s: ((a * s).double() + b.double() * c.double()).float(),
}
COMPLEX_MULS = [("rounded", "rounded"), ("fma_first", "fma_first"), ("fma_second", "fma_second"),
                ("fma_first", "fma_second")]


def _lanes_performed(complex_mul):
    """The lane roundings that the kernel's `tl.fma` performs on this backend. The GPU's FMA rounds once; Triton's
    interpreter before 3.9 multiplied and then added (two roundings), and then fma(a, c, -(b*s)) is
    round(round(a*c) - round(b*s)): every named rounding is "rounded" there. The comparison then still checks
    every other rounding and the lane layout; the single rounding of each FMA lane is checked on the GPU (the
    PTX test and the eager-CUDA tests) and by the interpreter of triton >= 3.9."""
    return complex_mul if fma_rounds_once(DEVICE) else ("rounded", "rounded")


def test_fma_probe_knows_which_backends_round_once():
    """The probe behind `_lanes_performed`: the GPU and the interpreter of triton >= 3.9 round an FMA once."""
    import triton

    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    assert fma_rounds_once(DEVICE) == (DEVICE == "cuda" or version >= (3, 9))


def _indexer_rows(dtype, heads=3, seq=5, batch=2, dim=32, c_rope=8, seed=5):
    """x [B, S, H, D] as a strided view of a wider projection output, the model's complex rotations
    `freqs [S, C_rope/2]`, and a LayerNorm weight / bias."""
    from dsfuse.models.official import rope_frequencies

    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(batch, seq, heads, dim + 6, generator=g) * 3).to(dtype)
    x = wide[..., 4:4 + dim]
    freqs = rope_frequencies(torch.arange(seq) * 7 + 3, c_rope, 10000.0)
    weight = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype)
    bias = (0.2 * torch.randn(dim, generator=g)).to(dtype)
    return x.to(DEVICE), freqs.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE)


def _official_indexer_path(x, freqs, interleaved, block, ue8m0, layer_norm=None, complex_mul=None, quantize=None):
    """`quantize_fp8_blockwise(cat([rope(x[..., :C]), x[..., C:]]))` as `DsfuseIndexer` computes it (the RoPE
    from models/official.py), or with the complex product's (real, imaginary) lanes in named roundings
    (`complex_mul`, `LANE_ROUNDINGS` names), or another `quantize(rows, block, scale_fmt)`."""
    from dsfuse.models.official import apply_rope_half_split, apply_rope_interleaved, quantize_fp8_blockwise

    if layer_norm is not None:
        x = layer_norm_reference(x, *layer_norm, 1e-6)
    c_rope = 2 * freqs.shape[-1]
    rot = x[..., :c_rope]
    if complex_mul is None:
        roped = (apply_rope_interleaved if interleaved else apply_rope_half_split)(rot, freqs)
    else:
        pairs = rot.float().unflatten(-1, (-1, 2) if interleaved else (2, -1))
        a, b = (pairs[..., 0], pairs[..., 1]) if interleaved else (pairs[..., 0, :], pairs[..., 1, :])
        c, s = freqs.real[None, :, None, :], freqs.imag[None, :, None, :]
        real, imag = (lane[mode](a, b, c, s) for lane, mode in zip((REAL_LANE, IMAG_LANE), complex_mul))
        roped = torch.stack([real, imag], -1 if interleaved else -2).flatten(-2).to(x.dtype)
    return (quantize or quantize_fp8_blockwise)(torch.cat([roped, x[..., c_rope:]], -1), block,
                                                "ue8m0" if ue8m0 else None)


def _quantize_as_eager_cuda(x, block, scale_fmt):
    """`quantize_fp8_blockwise` as eager CUDA runs it: `amax / 448` (a Python scalar) becomes a multiply by the
    fp32 reciprocal there; `x / scale` (a tensor) stays a division."""
    blocks = x.float().unflatten(-1, (-1, block))
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-4) * (torch.tensor(1.0) / 448.0)
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    quantized = (blocks / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return quantized.flatten(-2), scale


def _rows_freqs(freqs):
    """The model's `freqs [S, C/2]` in the fused op's broadcast form `[1, S, 1, C/2]`."""
    return freqs[None, :, None, :]


def _assert_fp8_equal(got, want):
    q, scale = got
    want_q, want_scale = want
    assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape and scale.shape == want_scale.shape
    assert torch.equal(scale, want_scale), (scale - want_scale).abs().max()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (q.float() - want_q.float()).abs().max()


def _assert_fp8_within_one_ulp(got, want):
    """e4m3 codes equal in sign and at most one apart in magnitude (adjacent e4m3 values)."""
    got_code, want_code = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    magnitude_gap = ((got_code & 0x7F) - (want_code & 0x7F)).abs()
    same_sign = ((got_code >> 7) == (want_code >> 7)) | ((got_code & 0x7F) == 0) | ((want_code & 0x7F) == 0)
    assert bool((same_sign & (magnitude_gap <= 1)).all()), int(magnitude_gap.max())


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32_scale", "ue8m0"])
def test_rope_quant_reference_is_the_official_indexer_path(dtype, interleaved, ue8m0):
    """The CPU op (the reference) multiplies in the source's broadcast shapes, so it is the source bit for bit."""
    x, freqs, weight, bias = _indexer_rows(dtype)
    for layer_norm in (None, (weight, bias)):
        ln_args = () if layer_norm is None else (*layer_norm, 1e-6)
        got = rope_quant_fp8(x, _rows_freqs(freqs), 0, interleaved, 16, ue8m0, *ln_args)
        _assert_fp8_equal(got, _official_indexer_path(x, freqs, interleaved, 16, ue8m0, layer_norm))


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("complex_mul", COMPLEX_MULS, ids="/".join)
def test_rope_quant_kernel_bit_exact_in_each_complex_rounding(dtype, interleaved, complex_mul):
    """Kernel (interpreter) vs the indexer path with the complex product in the same rounding: fp8 values and
    scales bit for bit, plain and ue8m0 scales, with and without the LayerNorm (rows' statistics summed in
    another order may move an fp32 LayerNorm output by an ulp, so fp32 LayerNorm rows are compared within it)."""
    x, freqs, weight, bias = _indexer_rows(dtype)
    for ue8m0, layer_norm in ((False, None), (True, (weight, bias))):
        ln_args = () if layer_norm is None else (*layer_norm, 1e-6)
        got = rope_quant_fp8_triton(x, _rows_freqs(freqs), 0, interleaved, 16, ue8m0, *ln_args,
                                    complex_mul=complex_mul)
        want = _official_indexer_path(x, freqs, interleaved, 16, ue8m0, layer_norm, _lanes_performed(complex_mul))
        if layer_norm is not None and dtype == torch.float32:
            _assert_fp8_within_one_ulp(got[0], want[0])
            torch.testing.assert_close(got[1], want[1], rtol=2e-7, atol=0)  # ue8m0: equal (power of two)
        else:
            _assert_fp8_equal(got, want)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_rope_quant_cuda_scale_rule_is_eager_cudas(dtype):
    """The CUDA setting (`reciprocal_scale`, on by default for CUDA tensors) reproduces eager CUDA's `amax / 448`
    (a multiply by fp32(1/448)), against the source run that way. The true division it replaces is the source on
    CPU tensors (on CUDA tensors `amax / 448` is itself that multiply)."""
    x, freqs, _, _ = _indexer_rows(dtype, heads=8, seq=16)
    complex_mul = ("rounded", "rounded")
    got = rope_quant_fp8_triton(x, _rows_freqs(freqs), 0, False, 16, False, complex_mul=complex_mul,
                                reciprocal_scale=True)
    _assert_fp8_equal(got, _official_indexer_path(x, freqs, False, 16, False, None, complex_mul,
                                                  quantize=_quantize_as_eager_cuda))
    divided = _official_indexer_path(x.cpu(), freqs.cpu(), False, 16, False, None, complex_mul)
    assert not torch.equal(got[1].cpu(), divided[1])  # the two scale rules differ on these rows


def test_complex_roundings_differ_so_each_test_can_fail():
    """The roundings of the fp32 complex product give different fp32 RoPE outputs on these rows, per lane."""
    x, freqs, _, _ = _indexer_rows(torch.float32, heads=8, seq=16)
    scales = [_official_indexer_path(x, freqs, False, 32, False, complex_mul=m)[1] for m in COMPLEX_MULS]
    for i, one in enumerate(scales):
        assert not any(torch.equal(one, other) for other in scales[i + 1:])


@pytest.mark.parametrize("T", [0, 1, 9])
def test_rope_quant_odd_and_empty_rows_non_contiguous(T):
    """Odd and zero token counts; x a per-head view with the heads transposed ahead of the tokens."""
    x, freqs, weight, bias = _indexer_rows(torch.bfloat16, seq=max(T, 1), heads=3)
    x = x[:, :T].transpose(1, 2)  # [B, H, T, D], strided
    freqs4 = freqs[:T][None, None]  # [1, 1, T, C/2]
    got = rope_quant_fp8_triton(x, freqs4, 0, False, 32, True, weight, bias, 1e-6,
                                complex_mul=("rounded", "rounded"))
    want = rope_quant_fp8_reference(x, freqs4, 0, False, 32, True, weight, bias, 1e-6)
    assert got[0].shape == (2, 3, T, 32) and got[1].shape == (2, 3, T, 1)
    if T:
        assert not x.is_contiguous()
        _assert_fp8_equal(got, want)


def test_rope_in_the_last_part_and_several_blocks_per_row():
    x, freqs, _, _ = _indexer_rows(torch.bfloat16, dim=64)
    got = rope_quant_fp8_triton(x, _rows_freqs(freqs), 40, True, 16, False, complex_mul=("rounded", "rounded"))
    rows = torch.cat([x[..., :40], complex_rope_reference(x[..., 40:48], _rows_freqs(freqs), True), x[..., 48:]], -1)
    from dsfuse.models.official import quantize_fp8_blockwise

    _assert_fp8_equal(got, quantize_fp8_blockwise(rows, 16))


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_ue8m0_scales_exact_over_every_amax(dtype):
    """Every positive bf16 amax from 2^-14 to 2^100 (fp32: plus random values) as one row's largest value:
    the kernel's exact power-of-two ceiling equals exp2(ceil(log2(amax / 448)))."""
    amax = torch.arange(0x3880, 0x71FF, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    if dtype == torch.float32:
        amax = torch.cat([amax, torch.rand(2048, generator=torch.Generator().manual_seed(6)) * 1000 + 1e-3])
    x = torch.zeros(amax.numel(), 1, 1, 16, dtype=dtype)
    x[..., 5] = amax.to(dtype).view(-1, 1, 1)
    x[..., 9] = -amax.to(dtype).view(-1, 1, 1) / 3
    freqs = torch.polar(torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
    got = rope_quant_fp8_triton(x.to(DEVICE), freqs.to(DEVICE), 0, False, 16, True, rows_per_program=1024)
    from dsfuse.models.official import quantize_fp8_blockwise

    _assert_fp8_equal(got, quantize_fp8_blockwise(x.to(DEVICE), 16, "ue8m0"))


def test_rope_quant_opcheck_and_bad_input():
    x, freqs, weight, bias = _indexer_rows(torch.bfloat16)
    torch.library.opcheck(rope_quant_fp8, (x, _rows_freqs(freqs), 0, False, 32, False))
    torch.library.opcheck(rope_quant_fp8, (x, _rows_freqs(freqs), 0, True, 16, True, weight, bias, 1e-6))
    with pytest.raises(TypeError, match="complex64"):
        rope_quant_fp8(x, torch.view_as_real(_rows_freqs(freqs)), 0, False, 32, False)
    with pytest.raises(ValueError, match="block size"):
        rope_quant_fp8(x, _rows_freqs(freqs), 0, False, 24, False)
    with pytest.raises(ValueError, match="outside"):
        rope_quant_fp8(x, _rows_freqs(freqs), 28, False, 32, False)
    with pytest.raises(ValueError, match="broadcast"):
        rope_quant_fp8(x, freqs[None, :2, None, :], 0, False, 32, False)


_QUANT_PTX_PROBE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from dsfuse.kernels import norm_rope_quant as nrq

kernel = nrq._group_kernel((nrq._rope_quant_fp8_block,))
names = [n.removeprefix("m0_") for n in kernel.arg_names]
pointers = {"x_ptr": "*bf16", "f_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "lnw_ptr": "*fp32",
            "lnb_ptr": "*fp32"}
found = {}
for mode, layer_norm in ((0, True), (1, False)):
    consts = dict(ROWS=8, NB_P2=1, BS=128, INTERLEAVED=False, LAYER_NORM=layer_norm, UE8M0=True, REAL_MUL=mode,
                  IMAG_MUL=mode, MANUAL_BF16_RNE=False, MANUAL_FP8_RNE=False, RECIPROCAL_SCALE=bool(mode),
                  INV_FP8_MAX=1.0 / 448.0)
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n.endswith("eps") else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] != "constexpr" and sig[n] != "fp32"}
    src = triton.compiler.ASTSource(fn=kernel, signature={f"m0_{n}": t for n, t in sig.items()},
                                    constexprs={f"m0_{n}": v for n, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **nrq.COMPILE_OPTIONS}).asm["ptx"]
    found[mode] = sorted(set(re.findall(r"\b(?:fma|mul|add|sub|div|cvt)\.[a-z0-9.]*(?:f32|e4m3x2)\b", ptx)))
print(json.dumps(found))
"""


def test_sm90_ptx_quantises_with_true_divisions_and_rne():
    """x / scale is an IEEE division (`div.rn`, not Triton's default approximate `div.full`), and so is
    amax / 448 under the CPU rule (the CUDA rule multiplies by the reciprocal, `mul.rn`); the e4m3 cast rounds
    to nearest even after the clamp, and only the chosen complex rounding uses an FMA."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    done = subprocess.run([sys.executable, "-c", _QUANT_PTX_PROBE], env={**os.environ, "TRITON_INTERPRET": "0"},
                          capture_output=True, check=False, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for mode, ops in found.items():
        assert "div.rn.f32" in ops and "div.full.f32" not in ops, (mode, ops)
        assert "cvt.rn.satfinite.e4m3x2.f32" in ops, (mode, ops)
        assert all(".rn." in op for op in ops if op.split(".")[0] in ("mul", "add", "sub")), (mode, ops)
    assert not [op for op in found["0"] if op.startswith("fma")], found["0"]
    assert "fma.rn.f32" in found["1"], found["1"]


# --------------------------------------------------------------------------------------------
# Launch groups: independent glue ops of one layer in one kernel launch
# --------------------------------------------------------------------------------------------
def _layer_members(dtype, T=7, exact_sums=False):
    """One of each member kind with odd sizes: a kv RMSNorm + RoPE, a q_a RMSNorm (no RoPE), an indexer key
    LayerNorm + RoPE + cat, an official indexer query RoPE + fp8 quantisation, and an empty kv slice (T = 0).
    `exact_sums`: norm inputs whose statistics are exact in any summation order."""
    x, w, cos, sin = _inputs(T, 48, 16, dtype, dyadic=exact_sums)
    qa, qw, _, _ = _inputs(T, 40, 0, dtype, dyadic=exact_sums, seed=1)
    k, lw, lb, kcos, ksin = _key_states(dtype, seq=T, exact_stats=exact_sums)
    k4, kcos4, ksin4 = k.unsqueeze(2), kcos.unsqueeze(2), ksin.unsqueeze(2)
    q, freqs, _, _ = _indexer_rows(dtype)
    return [
        ("rmsnorm_rope", (x, w, 1e-6, cos, sin, True, False)),
        ("rmsnorm_rope", (qa, qw, 1e-5, None, None, True, dtype == torch.float32)),
        ("rope_cat", (k4, kcos4, ksin4, 0, False, lw, lb, 1e-6)),
        ("rope_quant_fp8", (q, _rows_freqs(freqs), 0, False, 16, True, None, None, 0.0)),
        ("rmsnorm_rope", (x[:0], w, 1e-6, cos[:0], sin[:0], False, False)),
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_launch_group_equals_each_launch_alone(dtype):
    """Every member's outputs from one grouped launch equal its own launch's, bit for bit (the same block code
    on its own range of programs; a member with no rows launches nothing)."""
    from dsfuse.kernels.norm_rope_quant import launch_blocks, rmsnorm_rope_launch, rope_cat_launch, rope_quant_fp8_launch

    launches = {"rmsnorm_rope": rmsnorm_rope_launch, "rope_cat": rope_cat_launch,
                "rope_quant_fp8": rope_quant_fp8_launch}
    members = _layer_members(dtype)
    grouped = launch_blocks([launches[op](*args) for op, args in members])
    for (op, args), outputs in zip(members, grouped):
        alone = launch_blocks([launches[op](*args)])[0]
        assert len(outputs) == len(alone)
        for got, want in zip(outputs, alone):
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                               want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want), op


def _group_args(members):
    """A group call's arguments (members, tensors, ints, floats) for (op, args) members."""
    from dsfuse.kernels.norm_rope_quant import group_member_lists

    tensors, ints, floats = [], [], []
    for op, args in members:
        t, i, f = group_member_lists(op, args)
        tensors += t
        ints += i
        floats += f
    return ",".join(op for op, _ in members), tensors, ints, floats


def test_norm_rope_group_op_is_its_members_in_order():
    """The group op's outputs are each member op's outputs in order; opcheck passes (fake and real agree)."""
    from dsfuse.kernels.norm_rope_quant import norm_rope_group

    members = _layer_members(torch.bfloat16)
    got = norm_rope_group(*_group_args(members))
    want = []
    for op, args in members:
        out = getattr(torch.ops.dsfuse, op)(*args)
        want += list(out) if isinstance(out, tuple) else [out]
    assert len(got) == len(want) == 9
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g.float(), w.float())
    torch.library.opcheck(norm_rope_group, _group_args(members[:3]))


def test_norm_rope_group_bad_input():
    from dsfuse.kernels.norm_rope_quant import norm_rope_group

    members, tensors, ints, floats = _group_args(_layer_members(torch.bfloat16)[:2])
    with pytest.raises(ValueError, match="unknown member"):
        norm_rope_group("rmsnorm_rope,layer_norm", tensors, ints, floats)
    with pytest.raises(ValueError, match="too few arguments for member rmsnorm_rope"):
        norm_rope_group(members, tensors[:-1], ints, floats)
    with pytest.raises(ValueError, match="left over"):
        norm_rope_group(members, tensors, ints, floats + [1e-6])


# --------------------------------------------------------------------------------------------
# The official kv side: RMSNorm (weight in fp32) + the complex-multiply RoPE in one `rmsnorm_rope`
# --------------------------------------------------------------------------------------------
def _official_kv(batch=3, seq=5, c_norm=48, c_rope=16, dtype=torch.bfloat16, seed=7):
    """`kv_a_proj_with_mqa`'s output [B, S, C_norm + C_rope] (a row slice of a wider one, on a 1/8 grid so the
    norm's statistics are exact), the fp32 norm weight's source dtype and `freqs [S, C_rope/2]`."""
    from dsfuse.models.official import rope_frequencies

    g = torch.Generator().manual_seed(seed)
    wide = ((torch.randn(batch, seq, c_norm + c_rope + 4, generator=g) * 16).round() / 8).to(dtype)
    weight = (1 + 0.3 * torch.randn(c_norm, generator=g)).to(dtype)
    freqs = rope_frequencies(torch.arange(seq) * 5 + 2, c_rope, 10000.0)
    return wide[..., :c_norm + c_rope].to(DEVICE), weight.to(DEVICE), freqs.to(DEVICE)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half_split"])
def test_official_kv_reference_is_the_source(dtype, interleaved):
    """The CPU op equals `rms_norm_official` + `apply_rope_interleaved` / `apply_rope_half_split` bit for bit,
    rows of the flattened [B, S] repeating freqs' S rows."""
    from dsfuse.models.official import apply_rope_half_split, apply_rope_interleaved

    proj, weight, freqs = _official_kv(dtype=dtype)
    c_norm = weight.shape[0]
    kv, k_pe = torch.split(proj, [c_norm, proj.shape[-1] - c_norm], -1)
    rope = apply_rope_interleaved if interleaved else apply_rope_half_split
    normed, roped = rmsnorm_rope(proj.reshape(-1, proj.shape[-1]), weight, 1e-6, None, None, interleaved, True, freqs)
    _assert_equal(normed, rms_norm_official(kv, weight, 1e-6).reshape(normed.shape))
    _assert_equal(roped, rope(k_pe.unsqueeze(2), freqs).reshape(roped.shape))


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half_split"])
@pytest.mark.parametrize("complex_mul", COMPLEX_MULS, ids="/".join)
def test_official_kv_kernel_bit_exact_in_each_complex_rounding(dtype, interleaved, complex_mul):
    """Kernel (interpreter) vs the complex product computed lane by lane in the same rounding, and the norm vs
    the reference: bit for bit."""
    proj, weight, freqs = _official_kv(dtype=dtype)
    x = proj.reshape(-1, proj.shape[-1])
    c_norm = weight.shape[0]
    normed, roped = rmsnorm_rope_triton(x, weight, 1e-6, None, None, interleaved, True, freqs,
                                        complex_mul=complex_mul)
    _assert_equal(normed, rmsnorm_rope_reference(x, weight, 1e-6, None, None, interleaved, True, freqs)[0])
    rows = x[:, c_norm:].float().unflatten(-1, (-1, 2) if interleaved else (2, -1))
    a, b = (rows[..., 0], rows[..., 1]) if interleaved else (rows[..., 0, :], rows[..., 1, :])
    per_row = freqs.repeat(x.shape[0] // freqs.shape[0], 1)
    c, s = per_row.real, per_row.imag
    performed = _lanes_performed(complex_mul)
    real, imag = (lane[mode](a, b, c, s) for lane, mode in zip((REAL_LANE, IMAG_LANE), performed))
    want = torch.stack([real, imag], -1 if interleaved else -2).flatten(-2).to(dtype)
    _assert_equal(roped, want)


def test_official_kv_bad_input():
    proj, weight, freqs = _official_kv()
    x = proj.reshape(-1, proj.shape[-1])
    cos = torch.zeros(x.shape[0], 16, dtype=x.dtype, device=x.device)
    with pytest.raises(ValueError, match="not both"):
        rmsnorm_rope(x, weight, 1e-6, cos, cos, True, True, freqs)
    with pytest.raises(ValueError, match="do not divide"):
        rmsnorm_rope(x[:7], weight, 1e-6, None, None, True, True, freqs)
    with pytest.raises(ValueError, match="complex64"):
        rmsnorm_rope(x, weight, 1e-6, None, None, True, True, torch.view_as_real(freqs))
    torch.library.opcheck(rmsnorm_rope, (x, weight, 1e-6, None, None, True, True, freqs))


# --------------------------------------------------------------------------------------------
# On the GPU: the compiled kernels against eager CUDA
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_launch_group_equals_each_launch_alone():
    """The generated group kernel, compiled for the GPU, gives each member's outputs bit for bit (4099 rows:
    many programs per member, a partial last one). The norms' inputs have exact sums: the H200 showed that the
    group kernel may sum a row in another order than the member's own kernel (1 q_a element in 164 k on random
    rows, deterministic in each; run 17), which the numerics rules allow."""
    from dsfuse.kernels.norm_rope_quant import launch_blocks, rmsnorm_rope_launch, rope_cat_launch, rope_quant_fp8_launch

    launches = {"rmsnorm_rope": rmsnorm_rope_launch, "rope_cat": rope_cat_launch,
                "rope_quant_fp8": rope_quant_fp8_launch}
    members = _layer_members(torch.bfloat16, T=4099, exact_sums=True)
    grouped = launch_blocks([launches[op](*args) for op, args in members])
    for (op, args), outputs in zip(members, grouped):
        for got, want in zip(outputs, launch_blocks([launches[op](*args)])[0]):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), op


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half_split"])
def test_gpu_official_kv_equals_eager_cuda(interleaved):
    """The own kv side on CUDA equals the source run eagerly on CUDA bit for bit: the complex product in eager
    CUDA's lane rounding (`CUDA_COMPLEX_MUL`), the norm exact (rows on a 1/8 grid)."""
    from dsfuse.models.official import apply_rope_half_split, apply_rope_interleaved

    proj, weight, freqs = _official_kv(batch=2, seq=257, c_norm=512, c_rope=64)
    kv, k_pe = torch.split(proj, [512, 64], -1)
    rope = apply_rope_interleaved if interleaved else apply_rope_half_split
    normed, roped = rmsnorm_rope(proj.reshape(-1, 576), weight, 1e-6, None, None, interleaved, True, freqs)
    _assert_equal(normed, rms_norm_official(kv, weight, 1e-6).reshape(normed.shape))
    _assert_equal(roped, rope(k_pe.unsqueeze(2), freqs).reshape(roped.shape))


@pytest.mark.gpu
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32_scale", "ue8m0"])
def test_gpu_rope_quant_equals_eager_cuda(ue8m0):
    """The own indexer query on CUDA: fp8 values and scales equal the source run eagerly on CUDA."""
    x, freqs, _, _ = _indexer_rows(torch.bfloat16, heads=8, seq=257, dim=128, c_rope=64)
    got = rope_quant_fp8(x, _rows_freqs(freqs), 0, False, 128, ue8m0)
    _assert_fp8_equal(got, _official_indexer_path(x, freqs, False, 128, ue8m0))


# --------------------------------------------------------------------------------------------
# The official main query's q_pe: the complex-multiply RoPE alone (`complex_rope`)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half_split"])
@pytest.mark.parametrize("complex_mul", COMPLEX_MULS, ids="/".join)
def test_complex_rope_kernel_bit_exact_in_each_complex_rounding(dtype, interleaved, complex_mul):
    """Kernel (interpreter) on a strided per-head view vs the product lane by lane in the same rounding; the
    CPU op vs the source's own function."""
    from dsfuse.kernels.norm_rope_quant import complex_rope, complex_rope_triton
    from dsfuse.models.official import apply_rope_half_split, apply_rope_interleaved

    x, freqs, _, _ = _indexer_rows(dtype, dim=16, c_rope=16)  # [B, S, H, 16] inside a wider row: strided
    got = complex_rope_triton(x, _rows_freqs(freqs), interleaved, complex_mul=complex_mul)
    pairs = x.float().unflatten(-1, (-1, 2) if interleaved else (2, -1))
    a, b = (pairs[..., 0], pairs[..., 1]) if interleaved else (pairs[..., 0, :], pairs[..., 1, :])
    c, s = freqs.real[None, :, None, :], freqs.imag[None, :, None, :]
    performed = _lanes_performed(complex_mul)
    real, imag = (lane[mode](a, b, c, s) for lane, mode in zip((REAL_LANE, IMAG_LANE), performed))
    _assert_equal(got, torch.stack([real, imag], -1 if interleaved else -2).flatten(-2).to(dtype))
    rope = apply_rope_interleaved if interleaved else apply_rope_half_split
    _assert_equal(complex_rope(x, _rows_freqs(freqs), interleaved), rope(x, freqs))


@pytest.mark.parametrize("T", [0, 1, 9])
def test_complex_rope_odd_and_empty_rows(T):
    from dsfuse.kernels.norm_rope_quant import complex_rope_triton

    x, freqs, _, _ = _indexer_rows(torch.bfloat16, seq=max(T, 1), dim=16, c_rope=16)
    x = x[:, :T].transpose(1, 2)  # [B, H, T, 16]
    freqs4 = freqs[:T][None, None]
    got = complex_rope_triton(x, freqs4, True, complex_mul=("rounded", "rounded"))
    assert got.shape == x.shape and got.is_contiguous()
    _assert_equal(got, complex_rope_reference(x, freqs4, True))


def test_complex_rope_bad_input_and_opcheck():
    from dsfuse.kernels.norm_rope_quant import complex_rope

    x, freqs, _, _ = _indexer_rows(torch.bfloat16, dim=16, c_rope=16)
    with pytest.raises(ValueError, match="do not pair"):
        complex_rope(x, _rows_freqs(freqs[:, :4]), True)
    with pytest.raises(TypeError, match="complex64"):
        complex_rope(x, _rows_freqs(freqs).real, True)
    with pytest.raises(ValueError, match="broadcast"):
        complex_rope(x, freqs[None, :2, None, :], True)
    torch.library.opcheck(complex_rope, (x, _rows_freqs(freqs), True))


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half_split"])
def test_gpu_complex_rope_equals_eager_cuda(interleaved):
    """The own main query's q_pe on CUDA equals the source run eagerly on CUDA bit for bit."""
    from dsfuse.kernels.norm_rope_quant import complex_rope
    from dsfuse.models.official import apply_rope_half_split, apply_rope_interleaved

    x, freqs, _, _ = _indexer_rows(torch.bfloat16, heads=16, seq=257, dim=64, c_rope=64)
    rope = apply_rope_interleaved if interleaved else apply_rope_half_split
    _assert_equal(complex_rope(x, _rows_freqs(freqs), interleaved), rope(x, freqs))


def test_complex_rope_reference_on_rows_of_odd_stride():
    """Regression (found by tests/fuzz): fp32 rows of odd width viewed as complex pairs have odd row strides, which
    `view_as_complex` rejects; the reference copies them first, like an odd storage offset."""
    x = torch.randn(2, 1, 3, 3)  # rows of 3 fp32 values: strides (9, 9, 3, 1)
    freqs = torch.polar(torch.ones(1, 1, 3, 1), torch.randn(1, 1, 3, 1))
    got = rope_quant_fp8(x, freqs, 0, True, 1, False)
    assert torch.equal(got[0].view(torch.uint8), rope_quant_fp8_reference(x.clone(), freqs, 0, True, 1, False)[0]
                       .view(torch.uint8))
    rotated = complex_rope_reference(x[..., :2], freqs, True)
    want = torch.view_as_real(torch.view_as_complex(x[..., :2].contiguous()) * freqs[..., 0])
    assert torch.equal(rotated, want)


# --------------------------------------------------------------------------------------------
# DeepSeek V4: an RMSNorm of the whole row, then the fp32 pair RoPE of its trailing slice, in one `rope_cat`
# --------------------------------------------------------------------------------------------
def _v4_states(dtype, heads=3, seq=5, batch=2, dim=32, c_rope=8, seed=7):
    """HF V4's query (`q_b_proj`'s output viewed per head, transposed: strided [B, H, S, D]) on a 1/8 grid (exact
    sums of squares), its K=V head (`kv_proj`'s [B, S, D]), fp32 norm weights, and V4's half-width cos/sin
    [B, S, C_rope/2] in x's dtype."""
    g = torch.Generator().manual_seed(seed)
    q = ((torch.randn(batch, seq, heads, dim, generator=g) * 16).round() / 8).to(dtype).transpose(1, 2)
    kv = ((torch.randn(batch, seq, dim, generator=g) * 16).round() / 8).to(dtype)
    weight = 1 + 0.3 * torch.randn(dim, generator=g)
    angles = torch.randn(batch, seq, c_rope // 2, generator=g) * 3
    return *(t.to(DEVICE) for t in (q, kv, weight, angles.cos().to(dtype), angles.sin().to(dtype))),


def _hf_v4_norm(weight, eps=1e-6):
    from types import SimpleNamespace

    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

    return lambda x: DeepseekV4RMSNorm.forward(SimpleNamespace(weight=weight, variance_epsilon=eps), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_v4_query_and_kv_head_match_hf_bit_for_bit(dtype):
    """`q_b_norm` (unweighted, rsqrt rounded to x's dtype) + `apply_rotary_pos_emb` on the strided per-head query,
    `kv_norm` (fp32 weight) + the same RoPE on the K=V head, and the RoPE alone (the indexer's query): reference
    and kernel (interpreter on CPU) equal HF's eager functions bit for bit."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4UnweightedRMSNorm,
        apply_rotary_pos_emb as v4_rope,
    )

    q, kv, weight, cos, sin = _v4_states(dtype)
    b, h, s, d = q.shape
    r = 2 * cos.shape[-1]
    cos4, sin4 = (t.unsqueeze(1).expand(b, h, s, r // 2) for t in (cos, sin))
    kv4 = kv.view(b, s, 1, d).transpose(1, 2)
    cases = {
        "q_b": (v4_rope(DeepseekV4UnweightedRMSNorm(1e-6)(q), cos, sin), (q, cos4, sin4), (4, None, 1e-6)),
        "kv": (v4_rope(_hf_v4_norm(weight)(kv).view(b, s, 1, d).transpose(1, 2), cos, sin),
               (kv4, cos.unsqueeze(1), sin.unsqueeze(1)), (1, weight, 1e-6)),
        "indexer_q": (v4_rope(q, cos, sin), (q, cos4, sin4), (0, None, 0.0)),
    }
    for name, (want, (x, c, s_), rms) in cases.items():
        args = (x, c, s_, d - r, True, None, None, 0.0, *rms, True)
        for fn in (rope_cat_reference, rope_cat_triton):
            got = fn(*args)
            assert torch.equal(got, want), (name, fn.__name__, (got.float() - want.float()).abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms_norm", [1, 2, 3, 4], ids=lambda i: RMS_NORMS[i])
def test_rope_cat_rms_norm_roundings_are_the_sources(dtype, rms_norm):
    """Each RMSNorm rounding of the reference is its source's expression; the kernel equals the reference."""
    q, _, weight, cos, sin = _v4_states(dtype)
    xf = q.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    w = weight if rms_norm == 1 else weight.to(dtype)
    source = {1: lambda: (w * (xf * r)).to(dtype), 2: lambda: w * (xf * r).to(dtype),
              3: lambda: (xf * r).to(dtype), 4: lambda: q * r.to(dtype)}[rms_norm]()
    weighted = w if rms_norm in (1, 2) else None
    b, h, s, d = q.shape
    cos4, sin4 = (t.unsqueeze(1).expand(b, h, s, 4) for t in (cos, sin))
    args = (q, cos4, sin4, 0, True, None, None, 0.0, rms_norm, weighted, 1e-6, True)
    want = rope_cat_reference(*args)
    _assert_equal(want[..., 8:], source[..., 8:])
    _assert_equal(rope_cat_triton(*args), want)


def test_pair_rope_is_neither_hf_v3_form():
    """V4's in-place pairs in fp32 are another function than V3's interleaved (evens then odds, rounded per op)."""
    q, _, _, cos, sin = _v4_states(torch.bfloat16)
    b, h, s, d = q.shape
    half = (t.unsqueeze(1).expand(b, h, s, 4) for t in (cos, sin))
    pairs = rope_cat_reference(q, *half, 24, True, fp32_pairs=True)
    full = [torch.cat([t, t], -1).unsqueeze(1).expand(b, h, s, 8) for t in (cos, sin)]
    for interleaved in (True, False):
        assert not torch.equal(pairs, rope_cat_reference(q, *full, 24, interleaved))


def test_rope_cat_rms_norm_opcheck_and_bad_input():
    q, kv, weight, cos, sin = _v4_states(torch.bfloat16)
    b, h, s, d = q.shape
    cos4, sin4 = (t.unsqueeze(1).expand(b, h, s, 4).contiguous() for t in (cos, sin))
    torch.library.opcheck(rope_cat, (q, cos4, sin4, 24, True, None, None, 0.0, 4, None, 1e-6, True))
    torch.library.opcheck(rope_cat, (q, cos4, sin4, 24, True, None, None, 0.0, 1, weight, 1e-6, True))
    bad = {
        "needs weight": dict(rms_norm=1),
        "takes no weight": dict(rms_norm=4, rms_weight=weight),
        "not an index": dict(rms_norm=5),
        "without an RMSNorm": dict(rms_weight=weight),
        "LayerNorm and an RMSNorm": dict(ln_weight=weight.to(q.dtype), ln_bias=weight.to(q.dtype), rms_norm=4),
        "in x's dtype": dict(rms_norm=2, rms_weight=weight),
        "must be \\[32\\]": dict(rms_norm=1, rms_weight=weight[:8]),
    }
    for message, kwargs in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            rope_cat(q, cos4, sin4, 24, True, fp32_pairs=True, **kwargs)
    with pytest.raises(ValueError, match="rope_cat"):
        rope_cat(q, cos4, sin4, 25, True, fp32_pairs=True)  # pair columns past the end
    with pytest.raises(ValueError, match="rope_cat"):
        rope_cat(q, torch.cat([cos4, cos4], -1), sin4, 24, True, fp32_pairs=True)  # a full-width table


def _gpt_j(rot, cos, sin):
    """GPT-J's RoPE as sources write it: pairs by `unbind`, each op in rot's dtype, stacked back in place."""
    even, odd = rot.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms_norm", [0, 1, 4], ids=lambda i: RMS_NORMS[i])
def test_rope_cat_pairs_in_place_is_gpt_j_in_the_input_dtype(dtype, rms_norm):
    """`pairs_in_place`: the trailing columns of a strided [B, H, S, 30] query (odd sizes) rotated as GPT-J's
    `unbind` pairs in x's dtype, stacked back in place, after each RMSNorm rounding: reference and kernel
    (interpreter) equal the source's expression bit for bit, and in bf16 / fp16 that is neither V4's fp32 pairs
    nor HF's interleaved layout."""
    q, _, weight, cos, sin = _v4_states(dtype, heads=3, seq=7, batch=1, dim=30, c_rope=10)
    b, h, s, d = q.shape
    cos4, sin4 = (t.unsqueeze(1).expand(b, h, s, 5) for t in (cos, sin))
    rms = (rms_norm, weight if rms_norm == 1 else None, 1e-6 if rms_norm else 0.0)
    normed = rms_norm_reference(q, rms_norm, weight, 1e-6) if rms_norm else q
    want = torch.cat([normed[..., :20], _gpt_j(normed[..., 20:], cos4, sin4)], -1)
    args = (q, cos4, sin4, 20, True, None, None, 0.0, *rms, False, False, True)
    _assert_equal(rope_cat_reference(*args), want)
    _assert_equal(rope_cat_triton(*args), want)
    if dtype != torch.float32:
        assert not torch.equal(want, rope_cat_reference(q, cos4, sin4, 20, True, None, None, 0.0, *rms, True))
    else:  # fp32: every op already rounds to fp32, so GPT-J's form is V4's
        _assert_equal(want, rope_cat_reference(q, cos4, sin4, 20, True, None, None, 0.0, *rms, True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["fp32_pairs", "pairs_in_place"])
@pytest.mark.parametrize("T", [1, 7, 13])
def test_rmsnorm_rope_pair_forms_are_the_sources(dtype, form, T):
    """The kv side with a pair RoPE (cos / sin [T, C_rope/2]): V4's fp32 pairs (`(r.float() * cos2 +
    rotate_half(r).float() * sin2).to(dtype)`) or GPT-J's `unbind` pairs in x's dtype, each in place; reference and
    kernel (interpreter) at odd row counts, bit for bit."""
    x, weight, _, _ = _inputs(T, 24, 10, dtype)
    g = torch.Generator().manual_seed(1)
    angles = torch.randn(T, 5, generator=g) * 3
    cos, sin = (f(angles).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    rot = x[:, 24:]
    if form == "fp32_pairs":
        turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), -1).flatten(-2)
        cos2, sin2 = (t.repeat_interleave(2, -1) for t in (cos, sin))
        source = (rot.float() * cos2 + turned.float() * sin2).to(dtype)
    else:
        source = _gpt_j(rot, cos, sin)
    flags = {form: True}
    want = rmsnorm_rope_reference(x, weight, 1e-6, cos, sin, True, False, **flags)
    _assert_equal(want[1], source)
    got = rmsnorm_rope_triton(x, weight, 1e-6, cos, sin, True, False, **flags)
    _assert_equal(got[0], want[0])
    _assert_equal(got[1], want[1])


def test_pair_flags_opcheck_and_bad_input():
    x, weight, _, _ = _inputs(5, 24, 8, torch.bfloat16)
    cos, sin = torch.rand(5, 4).to(torch.bfloat16), torch.rand(5, 4).to(torch.bfloat16)
    torch.library.opcheck(rmsnorm_rope, (x, weight, 1e-6, cos, sin, True, False), {"pairs_in_place": True})
    torch.library.opcheck(rmsnorm_rope, (x, weight, 1e-6, cos.float(), sin.float(), True, False),
                          {"fp32_pairs": True})
    q, _, _, c, s_ = _v4_states(torch.bfloat16)
    b, h, s, d = q.shape
    cos4, sin4 = (t.unsqueeze(1).expand(b, h, s, 4).contiguous() for t in (c, s_))
    torch.library.opcheck(rope_cat, (q, cos4, sin4, 24, True), {"pairs_in_place": True})
    with pytest.raises(ValueError, match="pairs_in_place"):
        rope_cat(q, cos4, sin4, 24, False, pairs_in_place=True)
    with pytest.raises(ValueError, match="pairs_in_place"):
        rmsnorm_rope(x, weight, 1e-6, cos, sin, True, False, fp32_pairs=True, pairs_in_place=True)
    with pytest.raises(ValueError, match="C_rope/2"):
        rmsnorm_rope(x, weight, 1e-6, torch.cat([cos, cos], -1), sin, True, False, pairs_in_place=True)
    with pytest.raises(TypeError, match="dtype"):
        rmsnorm_rope(x, weight, 1e-6, cos.float(), sin.float(), True, False, pairs_in_place=True)


@pytest.mark.gpu
def test_gpu_v4_query_and_kv_head_equal_eager_cuda():
    """V4-Flash's layer dims (64 heads of 512, rope 64, 1024 tokens): the compiled kernel's q_b_norm + RoPE and
    kv_norm + RoPE against HF's eager CUDA functions. The RoPE must be bit for bit (fp32 products and sums, no FMA);
    the norms may differ from eager's reduction order and rsqrt only (within one bf16 ulp)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4UnweightedRMSNorm,
        apply_rotary_pos_emb as v4_rope,
    )

    q, kv, weight, cos, sin = _v4_states(torch.bfloat16, heads=64, seq=1024, batch=1, dim=512, c_rope=64)
    b, h, s, d = q.shape
    cos4, sin4 = (t.unsqueeze(1).expand(b, h, s, 32) for t in (cos, sin))
    got_q = rope_cat_triton(q, cos4, sin4, d - 64, True, None, None, 0.0, 4, None, 1e-6, True)
    want_q = v4_rope(DeepseekV4UnweightedRMSNorm(1e-6)(q), cos, sin)
    kv4 = kv.view(b, s, 1, d).transpose(1, 2)
    got_kv = rope_cat_triton(kv4, cos.unsqueeze(1), sin.unsqueeze(1), d - 64, True, None, None, 0.0, 1, weight, 1e-6,
                             True)
    want_kv = v4_rope(_hf_v4_norm(weight)(kv).view(b, s, 1, d).transpose(1, 2), cos, sin)
    for got, want in ((got_q, want_q), (got_kv, want_kv)):
        torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3)
    roped = rope_cat_triton(q, cos4, sin4, d - 64, True, None, None, 0.0, 0, None, 0.0, True)  # the indexer query
    _assert_equal(roped, v4_rope(q, cos, sin))


# --------------------------------------------------------------------------------------------
# RMSNorm written as a division, `x / sqrt(mean(x^2) + eps)`: `rmsnorm_rope`'s `div_sqrt`, `rope_cat`'s `rms_div_sqrt`
# --------------------------------------------------------------------------------------------
def _ieee_sqrt(t):
    """t's square root correctly rounded, as CUDA's `sqrtf` and the kernels' `sqrt.rn` are (a float64 root rounds
    once more without error). torch's CPU float32 sqrt is not correctly rounded on every host: through MKL's vector
    math on an AMD EPYC about 15 % of floats come out one ulp off, so a kernel is held to this root, not to it."""
    return t.double().sqrt().to(t.dtype)


def _with_ieee_sqrt(fn, *args):
    """fn(*args) with `torch.sqrt` correctly rounded: the reference as the GPU computes it, on any CPU."""
    with unittest.mock.patch.object(torch, "sqrt", _ieee_sqrt):
        return fn(*args)


def _divided_norm(x, weight, eps, rounding):
    """The sources' RMSNorm with a division, in rounding `rounding` (a name of `RMS_NORMS`), op by op."""
    xf = x.float()
    root = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if rounding == "unweighted_scale_cast":
        return x / root.to(x.dtype)
    h = xf / root
    if rounding == "weight_fp32":
        return (h * weight.float()).to(x.dtype)
    if rounding == "weight_after_cast":
        return weight * h.to(x.dtype)
    return h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_in_fp32", [False, True], ids=["hf", "official"])
@pytest.mark.parametrize("T", [1, 7])
def test_div_sqrt_kernel_is_the_division_bit_for_bit(dtype, weight_in_fp32, T):
    """Odd widths (37 normed, 10 roped), sums of squares exact (1/8 grid): the reference and the kernel equal the
    source's `x / sqrt(mean + eps)` bit for bit, and in fp32 that is not what `x * rsqrt(..)` gives (so this test
    tells the roundings apart)."""
    x, w, cos, sin = _inputs(T, 37, 10, dtype)
    weight = w.float() * 1.01 if weight_in_fp32 else w
    rounding = "weight_fp32" if weight_in_fp32 else "weight_after_cast"
    want = _divided_norm(x[:, :37], weight, 1e-6, rounding)
    for fn, want_normed in ((rmsnorm_rope_reference, want),
                            (rmsnorm_rope_triton, _with_ieee_sqrt(_divided_norm, x[:, :37], weight, 1e-6, rounding))):
        normed, roped = fn(x, weight, 1e-6, cos, sin, False, weight_in_fp32, None, True)
        _assert_equal(normed, want_normed)
        _assert_equal(roped, rmsnorm_rope_reference(x, weight, 1e-6, cos, sin, False, weight_in_fp32)[1])
    if dtype == torch.float32 and T > 1:
        assert not torch.equal(want, rmsnorm_rope_reference(x, weight, 1e-6, cos, sin, False, weight_in_fp32)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_div_sqrt_random_inputs_within_summation_order(dtype):
    """Sums that round: the kernel's division form is within two ulps of the source's (summation order only)."""
    x, w, cos, sin = _inputs(5, 61, 16, dtype, dyadic=False, seed=3)
    want = _divided_norm(x[:, :61], w, 1e-6, "weight_after_cast")
    normed, _ = rmsnorm_rope_triton(x, w, 1e-6, cos, sin, True, False, None, True)
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=1e-3)
    assert ((normed.float() - want.float()).abs() <= ulp * 2).all()


def test_div_sqrt_norm_only_and_opcheck():
    x, w, cos, sin = _inputs(5, 33, 0, torch.bfloat16)
    normed, roped = rmsnorm_rope_triton(x, w, 1e-6, None, None, True, False, div_sqrt=True)
    _assert_equal(normed, _divided_norm(x, w, 1e-6, "weight_after_cast"))
    assert roped.shape == (5, 0)
    _assert_equal(torch.ops.dsfuse.rmsnorm_rope(x, w, 1e-6, None, None, True, False, div_sqrt=True)[0], normed)
    x, w, cos, sin = _inputs(5, 32, 16, torch.bfloat16)
    torch.library.opcheck(rmsnorm_rope, (x, w, 1e-6, cos, sin, True, False, None, True))
    torch.library.opcheck(rmsnorm_rope, (x, w.float(), 1e-6, cos, sin, False, True), {"div_sqrt": True})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms_norm", [1, 2, 3, 4], ids=lambda i: RMS_NORMS[i])
def test_rope_cat_rms_div_sqrt_is_the_sources_division(dtype, rms_norm):
    """Each RMSNorm rounding, written as a division, on V4's strided query (odd width 37, exact sums): the
    reference is the source's expression and the kernel equals it bit for bit."""
    q, _, weight, cos, sin = _v4_states(dtype, dim=37)
    w = weight if rms_norm == 1 else weight.to(dtype)
    weighted = w if rms_norm in (1, 2) else None
    b, h, s, d = q.shape
    cos4, sin4 = (t.unsqueeze(1).expand(b, h, s, 4) for t in (cos, sin))
    args = (q, cos4, sin4, 0, True, None, None, 0.0, rms_norm, weighted, 1e-6, True, True)
    want = rope_cat_reference(*args)
    _assert_equal(want[..., 8:], _divided_norm(q, w, 1e-6, RMS_NORMS[rms_norm])[..., 8:])
    _assert_equal(rope_cat_triton(*args), _with_ieee_sqrt(rope_cat_reference, *args))
    if dtype == torch.float32:
        assert not torch.equal(want, rope_cat_reference(*args[:-1]))


def test_rope_cat_rms_div_sqrt_opcheck_and_bad_input():
    q, _, weight, cos, sin = _v4_states(torch.bfloat16)
    b, h, s, d = q.shape
    cos4, sin4 = (t.unsqueeze(1).expand(b, h, s, 4).contiguous() for t in (cos, sin))
    torch.library.opcheck(rope_cat, (q, cos4, sin4, 24, True, None, None, 0.0, 1, weight, 1e-6, True, True))
    torch.library.opcheck(rope_cat, (q, cos4, sin4, 24, True, None, None, 0.0, 4, None, 1e-6, True),
                          {"rms_div_sqrt": True})
    with pytest.raises(ValueError, match="rms_div_sqrt given without an RMSNorm"):
        rope_cat(q, cos4, sin4, 24, True, fp32_pairs=True, rms_div_sqrt=True)


def test_launch_group_with_div_sqrt_members_equals_each_launch_alone():
    """A kv norm in the division form beside the same norm in the rsqrt form and V4's query in the division form,
    in one launch (fp32, where the forms differ): each member's outputs are its own launch's, bit for bit, and the
    group op's are its members' ops' (the flag is a member argument like any other)."""
    from dsfuse.kernels.norm_rope_quant import launch_blocks, norm_rope_group, rmsnorm_rope_launch, rope_cat_launch

    launches = {"rmsnorm_rope": rmsnorm_rope_launch, "rope_cat": rope_cat_launch}
    x, w, cos, sin = _inputs(7, 48, 16, torch.float32)
    q, _, weight, qcos, qsin = _v4_states(torch.float32)
    b, h, s, d = q.shape
    qcos4, qsin4 = (t.unsqueeze(1).expand(b, h, s, 4) for t in (qcos, qsin))
    members = [("rmsnorm_rope", (x, w, 1e-6, cos, sin, True, False, None, True)),
               ("rmsnorm_rope", (x, w, 1e-6, cos, sin, True, False)),
               ("rope_cat", (q, qcos4, qsin4, 24, True, None, None, 0.0, 1, weight, 1e-6, True, True))]
    grouped = launch_blocks([launches[op](*args) for op, args in members])
    for (op, args), outputs in zip(members, grouped):
        for got, want in zip(outputs, launch_blocks([launches[op](*args)])[0]):
            _assert_equal(got, want)
    assert not torch.equal(grouped[0][0], grouped[1][0])
    got = norm_rope_group(*_group_args(members))
    want = [out for op, args in members for out in _flat(getattr(torch.ops.dsfuse, op)(*args))]
    for g, w_ in zip(got, want):
        _assert_equal(g, w_)


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]
