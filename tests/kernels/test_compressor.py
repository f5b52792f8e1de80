"""`dsfuse::kv_compress`: the reference against HF's compressor modules bit for bit, the op's checks, opcheck, and
the Triton kernel (the interpreter on CPU) against the reference over odd window counts, batch 2 and strides."""

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor, DeepseekV4HCACompressor

from dsfuse.kernels import compressor as ops
from dsfuse.models.presets import hf_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inputs(B, W, m, D, R, overlap, dtype, seed=0, bias_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    C = 2 * D if overlap else D
    kv = torch.randn(B, W, m, C, generator=g).to(dtype)
    gate = (torch.randn(B, W, m, C, generator=g) * 2).to(dtype)
    bias = torch.randn(m, C, generator=g).to(bias_dtype)
    weight = torch.rand(D, generator=g) + 0.5
    freqs = (torch.arange(W) * m)[:, None].float() * (10000.0 ** (-torch.arange(0, R, 2) / R))[None]
    cos = freqs.cos().to(dtype)[None].expand(B, -1, -1)
    sin = freqs.sin().to(dtype)[None].expand(B, -1, -1)
    return [t.to(DEVICE) for t in (kv, gate, bias, weight, cos, sin)]


def _hf_module(cls, dtype, seed):
    config = hf_config("v4-tiny")
    torch.manual_seed(seed)
    module = cls(config).eval()
    for p in module.parameters():
        p.data = torch.randn(p.shape) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0)
    return module.to(dtype), config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls, seq", [(DeepseekV4CSACompressor, 19), (DeepseekV4HCACompressor, 19),
                                      (DeepseekV4CSACompressor, 4)])
def test_reference_is_hf_bit_for_bit(cls, dtype, seq):
    """HF's stateless compressor (cache=None): the op's reference on its projections equals it exactly; a length
    not a multiple of m drops the tail, as HF does."""
    module, config = _hf_module(cls, dtype, seed=seq)
    B, m, D = 2, module.compress_rate, module.head_dim
    hidden = torch.randn(B, seq, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    q_residual = torch.randn(B, seq, config.q_lora_rank).to(dtype)
    positions = torch.arange(seq)[None].expand(B, -1)
    with torch.no_grad():
        want = module(hidden, q_residual, positions, None, 0)[0].squeeze(1)
        W = seq // m
        kv = module.kv_proj(hidden)[:, :W * m].view(B, W, m, -1)
        gate = module.gate_proj(hidden)[:, :W * m].view(B, W, m, -1)
        cos, sin = module.rotary_emb(want, position_ids=(torch.arange(W) * m)[None].expand(B, -1),
                                     layer_type="compress")
        got = torch.ops.dsfuse.kv_compress(kv, gate, module.position_bias, module.kv_norm.weight, cos, sin,
                                           module.kv_norm.variance_epsilon, cls is DeepseekV4CSACompressor)
    assert got.shape == (B, W, D) and torch.equal(got, want)


CASES = [  # (B, W, m, D, R, overlap): odd window counts, one window, long windows in chunks, R = D, m = 1
    (2, 3, 4, 32, 8, True), (1, 1, 4, 16, 16, True), (2, 3, 8, 32, 8, False), (1, 2, 32, 16, 8, False),
    (1, 5, 3, 24, 8, True), (1, 1, 1, 8, 2, False),
]
DTYPE_CASES = [(case, torch.bfloat16) for case in CASES] + [
    (CASES[i], dtype) for i in (0, 2) for dtype in (torch.float32, torch.float16)]


@pytest.mark.parametrize("case, dtype", DTYPE_CASES)
def test_kernel_matches_reference(case, dtype):
    """Slot chunks of 4 (several per window); every rounding where torch rounds: equal but for exp and the
    summation order (fp32: a few ulp; bf16 / fp16: at most one ulp on a few elements)."""
    B, W, m, D, R, overlap = case
    args = _inputs(B, W, m, D, R, overlap, dtype)
    want = ops.kv_compress_reference(*args, 1e-6, overlap)
    got = ops.kv_compress_triton(*args, 1e-6, overlap, block_l=4)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    if dtype != torch.float32:
        assert (got != want).float().mean() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_strided_inputs_and_narrow_bias(dtype):
    """The projections' windows are views of a wider GEMM output; a bias in the model dtype (a model cast as a whole)
    makes the biased gate that dtype, rounded before the fp32 softmax as torch rounds it."""
    B, W, m, D, R = 2, 4, 4, 16, 8
    kv, gate, bias, weight, cos, sin = _inputs(B, W, m, D, R, True, dtype, bias_dtype=dtype)
    weight = weight.to(dtype)
    wide = torch.randn(B, W * m + 3, 4 * D).to(kv)
    wide[:, :W * m, :2 * D] = kv.reshape(B, W * m, 2 * D)
    kv_view = wide[:, :W * m, :2 * D].view(B, W, m, 2 * D)
    want = ops.kv_compress_reference(kv, gate, bias, weight, cos, sin, 1e-6, True)
    got = ops.kv_compress_triton(kv_view, gate.transpose(0, 1).contiguous().transpose(0, 1), bias, weight, cos, sin,
                                 1e-6, True)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    # The rounding of the biased gate shows: the kernel is nearer the reference than the sum kept in fp32 is.
    fp32_sum = ops.kv_compress_reference(kv, gate, bias.float(), weight, cos, sin, 1e-6, True)
    assert (got != want).float().mean() < min(0.05, (got != fp32_sum).float().mean())


FLAGS = {"div_sqrt": dict(div_sqrt=True), "exp_log_softmax": dict(exp_log_softmax=True),
         "both": dict(div_sqrt=True, exp_log_softmax=True)}


@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
def test_reference_rounding_variants_are_the_written_spellings(flags):
    """`div_sqrt` is `x / sqrt(mean + eps)` and `exp_log_softmax` is `exp(log_softmax(g))`, bit for bit, each a
    rounding of its own: the default reference differs from the spelled one (in fp32, where no rounding to a 16-bit
    dtype hides an ulp)."""
    B, W, m, D, R, overlap = 2, 3, 4, 32, 8, True
    kv, gate, bias, weight, cos, sin = _inputs(B, W, m, D, R, overlap, torch.float32)
    slot_kv, slot_gate = ops.window_slots(kv, gate + bias, overlap)
    if flags.get("exp_log_softmax"):
        p = torch.exp(torch.log_softmax(slot_gate.float(), dim=2))
    else:
        p = slot_gate.softmax(dim=2, dtype=torch.float32)
    x = (slot_kv * p.to(kv.dtype)).sum(dim=2).float()
    mean_square = x.pow(2).mean(-1, keepdim=True) + 1e-6
    x = x / torch.sqrt(mean_square) if flags.get("div_sqrt") else x * torch.rsqrt(mean_square)
    normed = (weight * x).to(kv.dtype)
    c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    rope = normed[..., -R:]
    turned = ((rope.float() * c) + (ops._rotate_half_interleaved(rope).float() * s)).to(kv.dtype)
    want = torch.cat([normed[..., :-R], turned], dim=-1)
    assert torch.equal(ops.kv_compress_reference(kv, gate, bias, weight, cos, sin, 1e-6, overlap, **flags), want)
    assert not torch.equal(ops.kv_compress_reference(kv, gate, bias, weight, cos, sin, 1e-6, overlap), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
def test_kernel_rounding_variants_match_their_reference(flags, dtype):
    """The kernel's DIV_SQRT / EXP_LOG_SOFTMAX: equal to the flagged reference but for exp, log and the summation
    order (bf16: at most one ulp on a few elements), and in fp32, where their ulps show, not the default kernel."""
    B, W, m, D, R, overlap = 2, 5, 8, 32, 8, True
    args = _inputs(B, W, m, D, R, overlap, dtype, seed=3)
    want = ops.kv_compress_reference(*args, 1e-6, overlap, **flags)
    got = ops.kv_compress_triton(*args, 1e-6, overlap, **flags, block_l=4)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.05
    else:
        assert not torch.equal(got, ops.kv_compress_triton(*args, 1e-6, overlap, block_l=4))


def test_no_windows():
    args = _inputs(2, 0, 4, 16, 8, True, torch.float32)
    assert ops.kv_compress_triton(*args, 1e-6, True).shape == (2, 0, 16)
    assert torch.ops.dsfuse.kv_compress(*args, 1e-6, True).shape == (2, 0, 16)


@pytest.mark.parametrize("overlap", [True, False])
def test_opcheck(overlap):
    args = _inputs(2, 3, 4, 16, 8, overlap, torch.float32)
    torch.library.opcheck(torch.ops.dsfuse.kv_compress.default, (*args, 1e-6, overlap))
    torch.library.opcheck(torch.ops.dsfuse.kv_compress.default, (*args, 1e-6, overlap, True, True))


@pytest.mark.parametrize("change, message", [
    (lambda a: a.__setitem__(0, a[0][..., :-1]), "gate shape"),
    (lambda a: a.__setitem__(2, a[2][:-1]), "position_bias must be"),
    (lambda a: a.__setitem__(3, a[3][:-1]), "norm_weight must be"),
    (lambda a: a.__setitem__(4, a[4][:, :-1]), "cos and sin"),
    (lambda a: a.__setitem__(4, torch.ones(2, 3, 9, device=DEVICE)), "cos and sin"),
    (lambda a: a.__setitem__(0, a[0].long()), "must be bf16, fp16 or fp32"),
    (lambda a: a.__setitem__(0, a[0][0]), "kv must be"),
])
def test_bad_inputs_raise(change, message):
    args = _inputs(2, 3, 4, 16, 8, True, torch.float32)
    change(args)
    with pytest.raises((ValueError, TypeError), match=message):
        torch.ops.dsfuse.kv_compress(*args, 1e-6, True)


def test_rope_wider_than_head_raises():
    args = _inputs(1, 2, 4, 8, 8, True, torch.float32)
    args[4] = args[5] = torch.ones(1, 2, 6, device=DEVICE)
    with pytest.raises(ValueError, match="RoPE width 12"):
        torch.ops.dsfuse.kv_compress(*args, 1e-6, True)


_PTX_PROBE = r"""
import json, re, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from dsfuse.kernels import compressor as ck
from dsfuse.kernels.norm_rope_quant import COMPILE_OPTIONS

found = {}
for label, flags in json.loads(sys.argv[1]):
    kernel = ck._kv_compress_kernel
    consts = {"GATE_DT": tl.float32, "OVERLAP": True, "BLOCK_L": 8, "BLOCK_D": 512, "ACCURATE_EXP": True,
              "KV_RNE": False, "GATE_RNE": False, **flags}
    sig = {n: "constexpr" if n in consts else "*fp32" if n in ("gate_ptr", "bias_ptr", "weight_ptr") else
           "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32" for n in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, **COMPILE_OPTIONS}).asm["ptx"]
    found[label] = sorted(set(re.findall(r"\b(?:div|sqrt|rsqrt)\.[a-z0-9.]*f32\b", ptx)))
print(json.dumps(found))
"""


def test_sm90_ptx_divides_by_an_ieee_sqrt_with_div_sqrt():
    """Compiled offline for sm_90 (no GPU) with the shipped options: DIV_SQRT normalises by an IEEE square root and
    quotient (`sqrt.rn`, `div.rn`), as torch's `x / sqrt(..)`, and takes no reciprocal square root; the default
    takes `rsqrt` and no IEEE sqrt (this half shows the check can fail)."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    configs = [["default", {"DIV_SQRT": False, "EXP_LOG_SOFTMAX": False}],
               ["div_sqrt", {"DIV_SQRT": True, "EXP_LOG_SOFTMAX": True}]]
    done = subprocess.run([sys.executable, "-c", _PTX_PROBE, json.dumps(configs)],
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, check=False, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"sqrt.rn.f32", "div.rn.f32"} <= set(found["div_sqrt"]), found
    assert not [op for op in found["div_sqrt"] if op.startswith("rsqrt") or op.startswith("sqrt.approx")], found
    assert any(op.startswith("rsqrt") for op in found["default"]) and "sqrt.rn.f32" not in found["default"], found
