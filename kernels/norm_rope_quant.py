"""Fused RMSNorm + RoPE on one row slice of a projection output (`torch.ops.dsfuse.rmsnorm_rope`), RoPE of
one split part concatenated back with the other (`torch.ops.dsfuse.rope_cat`), the official indexer's
complex RoPE + cat + fp8 per-block quantisation (`torch.ops.dsfuse.rope_quant_fp8`), the official complex RoPE
alone (`torch.ops.dsfuse.complex_rope`), and any independent set of these in one kernel launch
(`torch.ops.dsfuse.norm_rope_group`: each op's kernel is a block function of the program id, and a launch
gives each block its own range of programs).

Math (HF `DeepseekV32Attention.forward`, kv side: `kv_a_layernorm(kv_pass)` and the RoPE of `k_rot`,
both halves of one `split` of `kv_a_proj_with_mqa`'s output):

    x      = [T, C_norm + C_rope]   (row stride free, last dim contiguous)
    xf     = x[:, :C_norm].float()
    h      = xf * rsqrt(mean(xf^2) + eps)
    normed = weight * h.to(x.dtype)                     (HF: product rounded to x.dtype)
           = (h * weight.float()).to(x.dtype)           (official, `weight_in_fp32=True`)
    roped  = HF `apply_rotary_pos_emb_interleave` (interleaved=True) or `apply_rotary_pos_emb`
             (half-split) on x[:, C_norm:], every multiply and add rounded to x.dtype as torch does.

`cos` / `sin` are HF's `[T, C_rope]` form (`cat(freqs, freqs)`, already in x's dtype). The interleaved
form reads only their first half, exactly as HF slices them; the half-split form reads every column.
The interleaved output is HF's layout: rotated even lanes, then rotated odd lanes (not re-interleaved).

`rope_cat(x, cos, sin, rope_start, interleaved)` (the main query: `cat((q_pass, rope(q_rot)))`; the
indexer: `cat([rope(q_rot), q_pass])`, half-split) reads a strided 4-D x (e.g. `q_b_proj`'s output viewed
per head and transposed) and writes the concatenation, contiguous, in one pass.

With `ln_weight` / `ln_bias` given, `rope_cat` first applies a LayerNorm over each row's D columns (HF's
indexer key: `k_norm(wk(x))`, an `nn.LayerNorm` with weight and bias, then split, RoPE, cat), in the op
sequence torch defines for `layer_norm` (`torch._refs.native_layer_norm`, which Inductor compiles):

    xf     = x.float();  mean = mean(xf);  var = mean((xf - mean)^2)
    normed = (((xf - mean) * rsqrt(var + eps)) * weight + bias).to(x.dtype)      (one rounding, at the end)

The rope then runs on the normed (rounded) columns. Eager's CPU/CUDA `layer_norm` kernels use Welford
statistics and fused multiply-adds, so they differ from this sequence in the last bit of a few elements.

With `rms_norm` (one of `RMS_NORMS`, index > 0) `rope_cat` first applies an RMSNorm over each row's D columns
instead (HF V4: `q_b_norm`, unweighted, on the query viewed per head; `kv_norm`, fp32 weight, on the single
K=V head), with `r = rsqrt(mean(xf^2) + rms_eps)` and one of the sources' roundings:

    "weight_fp32":        (xf * r * weight).to(dtype)          (V4 `DeepseekV4RMSNorm`, official)
    "weight_after_cast":  weight * (xf * r).to(dtype)          (V3.2 `DeepseekV32RMSNorm`)
    "unweighted":         (xf * r).to(dtype)
    "unweighted_scale_cast": x * r.to(dtype)                   (V4 `DeepseekV4UnweightedRMSNorm`)

The RMSNorm as a division (`rmsnorm_rope`'s `div_sqrt`, `rope_cat`'s `rms_div_sqrt`): a source that writes
`xf / sqrt(mean(xf^2) + eps)` rounds the square root and the quotient where `xf * rsqrt(..)` rounds the reciprocal
square root and the product, so the results differ in the last bit. With the flag each `xf * r` above is `xf / s`,
`s = sqrt(mean(xf^2) + eps)` (and `x * r.to(dtype)` is `x / s.to(dtype)`), the square root and the quotient
IEEE-rounded as torch computes them (`tl.sqrt_rn`, `tl.div_rn`: Triton's `sqrt` and `/` are approximate on the GPU).

With `fp32_pairs`, the RoPE is V4's `apply_rotary_pos_emb` (and GPT-J's in fp32): the rotated columns are
pairs (2j, 2j+1) rotated in place, `cos` / `sin` hold one column per pair ([..., C_rope/2], HF's table before
its `repeat_interleave(2)`), every product and sum in fp32 and one rounding at the end:

    out[2j] = a*c - b*s,   out[2j+1] = b*c + a*s      (a, b = x[2j], x[2j+1]; c, s = cos[j], sin[j]; fp32)

which is HF's `(rope.float() * cos + rotate_half(rope).float() * sin).to(dtype)` bit for bit (negation is
exact and fp32 addition commutes).

With `pairs_in_place` (and `interleaved`), the RoPE is GPT-J's in the input dtype: the pairs (2j, 2j+1) rotated
by one table column per pair as `fp32_pairs` reads them, every product and sum rounded to x's dtype as HF's
interleaved form, and written back in place (`stack([a*c - b*s, b*c + a*s], -1).flatten(-2)` of the `unbind`
pairs) instead of HF's even-lanes-then-odd-lanes layout. `rmsnorm_rope` takes both pair forms too.

Rounding: each bf16/fp16 op is computed in fp32 and rounded to x.dtype, which is what torch does for
each elementwise op; products of two bf16/fp16 values are exact in fp32, so this is bit-exact. The
mean's summation order may differ from torch's (allowed by the numerics rules).

`rope_quant_fp8(x, freqs, rope_start, interleaved, block_size, ue8m0, ln_weight, ln_bias, ln_eps)` is dsfuse's
own model's indexer q / k (models/official.py `DsfuseIndexer.forward`) up to its fp8 tensors, in one launch:

    x      = layer_norm(x)                     (optional, as above)
    rows   = cat(x[:, :r0], complex_rope(x[:, r0:r0 + C]).to(x.dtype), x[:, r0 + C:])
    amax   = max(|rows|) per block of `block_size` columns, clamped to >= 1e-4
    scale  = amax / 448                        (ue8m0: exp2(ceil(log2(scale))), done exactly on the bits)
    x_fp8  = clamp(rows / scale, -448, 448).to(float8_e4m3fn)

`complex_rope` is the official fp32 complex product (`view_as_complex(x) * freqs`), one rounding to x's dtype at
the end (also `rmsnorm_rope`'s RoPE when it is given complex `freqs` instead of cos/sin: the official kv side);
both divisions are IEEE (`tl.div_rn`: Triton's `/` is an approximate reciprocal on the GPU); the e4m3 cast rounds
to nearest even. See `LANE_ROUNDINGS` for the complex product's rounding.

The kernels are compiled with `enable_fp_fusion=False` (`COMPILE_OPTIONS`). With fusion on (Triton's
default), LLVM narrows `round(fp32(a) * fp32(c))` to a bf16 multiply (harmless: correctly rounded) and
the NVPTX backend then contracts `a*c - round(b*s)` into one `fma.rn.bf16`, which skips the rounding of
`a*c` that torch performs: on the H200 that was a 1-ulp difference on ~23 % of the roped elements.
Without fusion every multiply, add and subtract is emitted as a separate `.rn` instruction (checked in
the sm_90 PTX by the tests), so no rounding step can be folded away.
"""

import functools
import inspect
import linecache
from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl
from dsfuse.kernels.quant_formats import FP8_INV_MAX, power_of_two_ceil, quantize_activations, round_to_e4m3_grid
from dsfuse.kernels.triton_support import cdiv, direct_kernel, interpreting, next_power_of_2

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# No mul+add contraction: torch rounds every elementwise op, an FMA would skip the product's rounding.
COMPILE_OPTIONS = {"enable_fp_fusion": False}
# Roundings of one lane of the official RoPE's fp32 complex product (a + ib)(c + is), real = a*c - b*s and
# imag = a*s + b*c: "rounded" (each product and the sum rounded), "fma_first" (the first product kept exact:
# fma(a, c, -(b*s)), fma(a, s, b*c)), "fma_second" (fma(-b, s, a*c), fma(b, c, a*s)). Eager's own is not fixed:
# ATen's vectorised CPU loop rounds every op; its scalar loop (broadcast shapes, tails) is c10::complex's
# `a*c - b*d`, `a*d + b*c` contracted by the host compiler (gcc here: fma_first in both lanes). CUDA's kernel
# is the same code through nvcc's LLVM-based NVVM; LLVM's NVPTX backend (checked offline through Triton with
# fusion on) contracts the real lane as fma_first and the imaginary lane as fma_second. That is the shipped
# guess, (real, imaginary); benchmarks/norm_rope_quant_gpu.py measures each lane against eager CUDA.
LANE_ROUNDINGS = ("rounded", "fma_first", "fma_second")
# `rope_cat`'s RMSNorm roundings, by index (0: no RMSNorm); see the module docstring.
RMS_NORMS = ("none", "weight_fp32", "weight_after_cast", "unweighted", "unweighted_scale_cast")
RMS_WEIGHTED = (1, 2)
CUDA_COMPLEX_MUL = ("fma_first", "fma_first")


# --------------------------------------------------------------------------------------------
# Reference (also the CPU implementation)
# --------------------------------------------------------------------------------------------
def rmsnorm_rope_reference(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32, freqs=None, div_sqrt=False,
                           fp32_pairs=False, pairs_in_place=False):
    """The source's math, op by op, in torch (so the rounding is the source's)."""
    c_norm = norm_weight.shape[0]
    xf = x[:, :c_norm].float()
    h = _rms_normalised(xf, xf.pow(2).mean(-1, keepdim=True) + eps, div_sqrt)
    if weight_in_fp32:
        normed = (h * norm_weight.float()).to(x.dtype)
    else:
        normed = norm_weight * h.to(x.dtype)
    rot = x[:, c_norm:]
    if freqs is not None:  # the rows repeat freqs' F rows (positions shared over the batch), broadcast as the source
        rows = freqs.shape[0]
        roped = complex_rope_reference(rot.unflatten(0, (-1, rows)), freqs[None], interleaved)
        return normed, roped.flatten(0, 1)
    if cos is None:
        return normed, rot.new_empty((x.shape[0], 0))
    if fp32_pairs:
        return normed, pair_rope_fp32_reference(rot, cos, sin)
    return normed, rope_reference(rot, cos, sin, interleaved, pairs_in_place)


def rope_reference(rot, cos, sin, interleaved, pairs_in_place=False):
    """HF's RoPE of `rot` (last dim) with `[..., C_rope]` cos/sin broadcast to it, op by op; `pairs_in_place`:
    GPT-J's, the interleaved pairs rotated by `[..., C_rope/2]` tables and written back in place."""
    half = rot.shape[-1] // 2
    if pairs_in_place:
        r1, r2 = rot.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack([r1 * cos - r2 * sin, r2 * cos + r1 * sin], dim=-1).flatten(-2)
    if interleaved:
        c, s = cos[..., :half], sin[..., :half]
        r1, r2 = rot[..., 0::2], rot[..., 1::2]
        return torch.cat([r1 * c - r2 * s, r2 * c + r1 * s], dim=-1)
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return rot * cos + rotated_half * sin


def layer_norm_reference(x, weight, bias, eps):
    """`layer_norm` over the last dim as torch's decomposition computes it: fp32 statistics (two passes),
    fp32 affine, one rounding to x's dtype."""
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True)
    var = (centred * centred).mean(-1, keepdim=True)
    return ((centred * torch.rsqrt(var + eps)) * weight.float() + bias.float()).to(x.dtype)


def _rms_normalised(xf, mean_square, div_sqrt):
    """xf * rsqrt(mean_square), or with `div_sqrt` xf / sqrt(mean_square) (the sources' two roundings)."""
    return xf / torch.sqrt(mean_square) if div_sqrt else xf * torch.rsqrt(mean_square)


def rms_norm_reference(x, rms_norm, weight, eps, div_sqrt=False):
    """RMSNorm over the last dim in rounding `RMS_NORMS[rms_norm]` (by a division with `div_sqrt`), op by op as the
    sources write it."""
    xf = x.float()
    mean_square = xf.pow(2).mean(-1, keepdim=True) + eps
    kind = RMS_NORMS[rms_norm]
    if kind == "unweighted_scale_cast":
        if div_sqrt:
            return x / torch.sqrt(mean_square).to(x.dtype)
        return x * torch.rsqrt(mean_square).to(x.dtype)
    h = _rms_normalised(xf, mean_square, div_sqrt)
    if kind == "weight_fp32":
        return (h * weight.float()).to(x.dtype)
    if kind == "weight_after_cast":
        return weight * h.to(x.dtype)
    return h.to(x.dtype)


def pair_rope_fp32_reference(rot, cos, sin):
    """V4's RoPE of `rot` (last dim): pairs (2j, 2j+1) rotated in place by cos/sin[..., j] in fp32, one
    rounding (HF `apply_rotary_pos_emb` of `deepseek_v4`, without its `repeat_interleave`)."""
    a, b = rot[..., 0::2].float(), rot[..., 1::2].float()
    c, s = cos.float(), sin.float()
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2).to(rot.dtype)


def rope_cat_reference(x, cos, sin, rope_start, interleaved, ln_weight=None, ln_bias=None, ln_eps=0.0,
                       rms_norm=0, rms_weight=None, rms_eps=0.0, fp32_pairs=False, rms_div_sqrt=False,
                       pairs_in_place=False):
    """`cat` of x's column parts in their order, the part [rope_start, rope_start + C_rope) RoPE'd; with
    `ln_weight` / `ln_bias`, x's rows are LayerNorm'd first, with `rms_norm` RMSNorm'd first."""
    if ln_weight is not None:
        x = layer_norm_reference(x, ln_weight, ln_bias, ln_eps)
    if rms_norm:
        x = rms_norm_reference(x, rms_norm, rms_weight, rms_eps, rms_div_sqrt)
    if fp32_pairs:
        end = rope_start + 2 * cos.shape[-1]
        roped = pair_rope_fp32_reference(x[..., rope_start:end], cos, sin)
    elif pairs_in_place:
        end = rope_start + 2 * cos.shape[-1]
        roped = rope_reference(x[..., rope_start:end], cos, sin, interleaved, pairs_in_place)
    else:
        end = rope_start + cos.shape[-1]
        roped = rope_reference(x[..., rope_start:end], cos, sin, interleaved)
    return torch.cat([x[..., :rope_start], roped, x[..., end:]], dim=-1)


def complex_rope_reference(rot, freqs, interleaved):
    """The official complex-multiply RoPE (`apply_rope_interleaved` / `apply_rope_half_split` in
    `models/official.py`) of `rot [..., C_rope]` with complex `freqs [..., C_rope/2]` broadcast to its rows:
    fp32 complex product, rounded once to rot's dtype, in rot's layout."""
    if rot.numel() == 0:  # view_as_complex rejects an empty view
        return rot.clone()
    rot32 = rot.float()
    if interleaved:
        # view_as_complex needs an even offset and even strides but the last (an fp32 row view of odd width has odd ones)
        if rot32.storage_offset() % 2 or any(stride % 2 for stride in rot32.stride()[:-1]):
            rot32 = rot32.clone()
        pairs = torch.view_as_complex(rot32.unflatten(-1, (-1, 2)))
        return torch.view_as_real(pairs * freqs).flatten(-2).to(rot.dtype)
    halves = rot32.unflatten(-1, (2, -1)).transpose(-1, -2).contiguous()
    rotated = torch.view_as_complex(halves) * freqs
    return torch.view_as_real(rotated).transpose(-1, -2).flatten(-2).to(rot.dtype)


def rope_quant_fp8_reference(x, freqs, rope_start, interleaved, block_size, ue8m0, ln_weight=None, ln_bias=None,
                             ln_eps=0.0):
    """(x_fp8, scale): x's rows (LayerNorm'd first when `ln_weight` is given), columns [rope_start, rope_start
    + C_rope) through the complex-multiply RoPE, rounded to x's dtype, then the source's own
    fp8 block quantisation (per-`block_size` amax clamp, /448, optional ue8m0, clamp, e4m3: the source divides by
    the scale)."""
    if ln_weight is not None:
        x = layer_norm_reference(x, ln_weight, ln_bias, ln_eps)
    end = rope_start + 2 * freqs.shape[-1]
    roped = complex_rope_reference(x[..., rope_start:end], freqs, interleaved)
    rows = torch.cat([x[..., :rope_start], roped, x[..., end:]], dim=-1)
    return quantize_activations(rows, block_size, pow2=ue8m0, reciprocal=False)


def _validate(x, norm_weight, eps, cos, sin, freqs=None, fp32_pairs=False, pairs_in_place=False, interleaved=True):
    if x.dim() != 2:
        raise ValueError(f"rmsnorm_rope: x must be [T, C_norm + C_rope], got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"rmsnorm_rope: x dtype {x.dtype} not in {INPUT_DTYPES}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("rmsnorm_rope: x's last dim must be contiguous (a row slice of a projection output)")
    if norm_weight.dim() != 1 or not norm_weight.is_floating_point():
        raise ValueError(f"rmsnorm_rope: norm_weight must be a 1-D float tensor, got {tuple(norm_weight.shape)}")
    c_norm = norm_weight.shape[0]
    if c_norm < 1 or c_norm > x.shape[1]:
        raise ValueError(f"rmsnorm_rope: norm width {c_norm} must be in [1, {x.shape[1]}]")
    if not eps >= 0:
        raise ValueError(f"rmsnorm_rope: eps must be >= 0, got {eps}")
    c_rope = x.shape[1] - c_norm
    if (cos is None) != (sin is None):
        raise ValueError("rmsnorm_rope: cos and sin must both be given or both be None")
    if freqs is not None:
        if cos is not None:
            raise ValueError("rmsnorm_rope: give cos/sin (HF's RoPE) or freqs (the complex RoPE), not both")
        if freqs.dtype != torch.complex64 or freqs.dim() != 2 or 2 * freqs.shape[1] != c_rope:
            raise ValueError(f"rmsnorm_rope: freqs must be complex64 [F, C_rope/2] = [F, {c_rope // 2}], got "
                             f"{freqs.dtype} {tuple(freqs.shape)}")
        if freqs.shape[0] < 1 or x.shape[0] % freqs.shape[0]:
            raise ValueError(f"rmsnorm_rope: freqs' {freqs.shape[0]} rows do not divide x's {x.shape[0]}")
        if freqs.device != x.device:
            raise ValueError(f"rmsnorm_rope: freqs on {freqs.device}, x on {x.device}")
    elif cos is None:
        if c_rope:
            raise ValueError(f"rmsnorm_rope: {c_rope} columns after the norm but no cos/sin")
    else:
        _validate_pair_flags("rmsnorm_rope", interleaved, fp32_pairs, pairs_in_place)
        width = c_rope // 2 if fp32_pairs or pairs_in_place else c_rope
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape != (x.shape[0], width):
                raise ValueError(f"rmsnorm_rope: {name} must be [T, {'C_rope/2' if width != c_rope else 'C_rope'}] "
                                 f"= {(x.shape[0], width)}, got {tuple(t.shape)}")
            if t.dtype != x.dtype and not (fp32_pairs and t.dtype == torch.float32):
                raise TypeError(f"rmsnorm_rope: {name} dtype {t.dtype} != x dtype {x.dtype}")
            if t.device != x.device:
                raise ValueError(f"rmsnorm_rope: {name} on {t.device}, x on {x.device}")
            if c_rope > 1 and t.stride(1) != 1:
                raise ValueError(f"rmsnorm_rope: {name}'s last dim must be contiguous")
        if c_rope % 2:
            raise ValueError(f"rmsnorm_rope: rope width {c_rope} must be even")
    if norm_weight.device != x.device:
        raise ValueError(f"rmsnorm_rope: norm_weight on {norm_weight.device}, x on {x.device}")


def _validate_pair_flags(op, interleaved, fp32_pairs, pairs_in_place):
    if pairs_in_place and (fp32_pairs or not interleaved):
        raise ValueError(f"{op}: pairs_in_place is the interleaved RoPE rounded per op (fp32_pairs writes its pairs in "
                         "place already)")


def _check_weight_dtype(x, norm_weight, weight_in_fp32):
    if not weight_in_fp32 and norm_weight.dtype != x.dtype:
        raise TypeError(f"rmsnorm_rope: HF form needs norm_weight dtype {x.dtype} (got {norm_weight.dtype}); "
                        "a different weight dtype would promote the output")


def _validate_rows(op, x):
    """x as the row ops take it: 4-D [A0, A1, A2, D] of a norm dtype, any strides but a contiguous last dim."""
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be 4-D [A0, A1, A2, D], got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{op}: x dtype {x.dtype} not in {INPUT_DTYPES}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{op}: x's last dim must be contiguous")


def _validate_rope_cat(x, cos, sin, rope_start, ln_weight=None, ln_bias=None, ln_eps=0.0, rms_norm=0,
                       rms_weight=None, rms_eps=0.0, fp32_pairs=False, rms_div_sqrt=False, pairs_in_place=False,
                       interleaved=True):
    _validate_rows("rope_cat", x)
    _validate_pair_flags("rope_cat", interleaved, fp32_pairs, pairs_in_place)
    table = cos.shape[-1]
    c_rope = 2 * table if fp32_pairs or pairs_in_place else table
    if c_rope < 2 or c_rope % 2:
        raise ValueError(f"rope_cat: rope width {c_rope} must be even and positive")
    if not 0 <= rope_start <= x.shape[-1] - c_rope:
        raise ValueError(f"rope_cat: rope columns [{rope_start}, {rope_start + c_rope}) outside x's {x.shape[-1]}")
    table_dtypes = (x.dtype, torch.float32) if fp32_pairs else (x.dtype,)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (*x.shape[:-1], table):
            raise ValueError(f"rope_cat: {name} must be {(*x.shape[:-1], table)}, got {tuple(t.shape)}")
        if t.dtype not in table_dtypes:
            raise TypeError(f"rope_cat: {name} dtype {t.dtype} != x dtype {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"rope_cat: {name} on {t.device}, x on {x.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"rope_cat: {name}'s last dim must be contiguous")
    _validate_layer_norm("rope_cat", x, ln_weight, ln_bias, ln_eps)
    _validate_rms_norm(x, ln_weight, rms_norm, rms_weight, rms_eps, rms_div_sqrt)


def _validate_rms_norm(x, ln_weight, rms_norm, rms_weight, rms_eps, rms_div_sqrt):
    if not 0 <= rms_norm < len(RMS_NORMS):
        raise ValueError(f"rope_cat: rms_norm {rms_norm} is not an index of {RMS_NORMS}")
    if not rms_norm:
        if rms_weight is not None:
            raise ValueError("rope_cat: rms_weight given without an RMSNorm")
        if rms_div_sqrt:
            raise ValueError("rope_cat: rms_div_sqrt given without an RMSNorm")
        return
    if ln_weight is not None:
        raise ValueError("rope_cat: a LayerNorm and an RMSNorm on the same rows")
    if not rms_eps >= 0:
        raise ValueError(f"rope_cat: RMSNorm eps must be >= 0, got {rms_eps}")
    if (rms_weight is not None) != (rms_norm in RMS_WEIGHTED):
        raise ValueError(f"rope_cat: RMSNorm {RMS_NORMS[rms_norm]!r} "
                         f"{'needs' if rms_norm in RMS_WEIGHTED else 'takes no'} weight")
    if rms_weight is None:
        return
    if rms_weight.dim() != 1 or rms_weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rope_cat: rms_weight must be [{x.shape[-1]}], got {tuple(rms_weight.shape)}")
    if rms_weight.dtype not in INPUT_DTYPES:
        raise TypeError(f"rope_cat: rms_weight dtype {rms_weight.dtype} not in {INPUT_DTYPES}")
    if RMS_NORMS[rms_norm] == "weight_after_cast" and rms_weight.dtype != x.dtype:
        raise TypeError(f"rope_cat: a weight after the cast must be in x's dtype {x.dtype} (got {rms_weight.dtype}); "
                        "another dtype would promote the output")
    if rms_weight.device != x.device:
        raise ValueError(f"rope_cat: rms_weight on {rms_weight.device}, x on {x.device}")
    if rms_weight.shape[0] > 1 and rms_weight.stride(0) != 1:
        raise ValueError("rope_cat: rms_weight must be contiguous")


def _validate_layer_norm(op, x, ln_weight, ln_bias, ln_eps):
    if (ln_weight is None) != (ln_bias is None):
        raise ValueError(f"{op}: LayerNorm weight and bias must both be given or both be None")
    if ln_weight is None:
        return
    if not ln_eps >= 0:
        raise ValueError(f"{op}: LayerNorm eps must be >= 0, got {ln_eps}")
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t.dim() != 1 or t.shape[0] != x.shape[-1]:
            raise ValueError(f"{op}: {name} must be [{x.shape[-1]}], got {tuple(t.shape)}")
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(f"{op}: {name} dtype {t.dtype} not in {INPUT_DTYPES}")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} on {t.device}, x on {x.device}")
        if t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"{op}: {name} must be contiguous")


def _validate_row_freqs(op, x, freqs):
    """x as `_validate_rows` takes it; `freqs` complex64 [A0, A1, A2, C_rope/2] with size-1 dims broadcast."""
    _validate_rows(op, x)
    if freqs.dtype != torch.complex64:
        raise TypeError(f"{op}: freqs must be complex64, got {freqs.dtype}")
    if freqs.dim() != 4 or not all(f in (a, 1) for f, a in zip(freqs.shape[:-1], x.shape[:-1])):
        raise ValueError(f"{op}: freqs must broadcast as {(*x.shape[:-1], 'C_rope/2')}, got {tuple(freqs.shape)}")
    if freqs.device != x.device:
        raise ValueError(f"{op}: freqs on {freqs.device}, x on {x.device}")


def _validate_complex_rope(x, freqs):
    _validate_row_freqs("complex_rope", x, freqs)
    if 2 * freqs.shape[-1] != x.shape[-1]:
        raise ValueError(f"complex_rope: freqs' {freqs.shape[-1]} rotations do not pair x's {x.shape[-1]} columns")


def _validate_rope_quant(x, freqs, rope_start, block_size, ln_weight, ln_bias, ln_eps):
    _validate_row_freqs("rope_quant_fp8", x, freqs)
    c_rope = 2 * freqs.shape[-1]
    if c_rope < 2 or not 0 <= rope_start <= x.shape[-1] - c_rope:
        raise ValueError(f"rope_quant_fp8: rope columns [{rope_start}, {rope_start + c_rope}) outside x's "
                         f"{x.shape[-1]}")
    if block_size < 1 or block_size & (block_size - 1) or x.shape[-1] % block_size:
        raise ValueError(f"rope_quant_fp8: block size {block_size} must be a power of two dividing {x.shape[-1]}")
    _validate_layer_norm("rope_quant_fp8", x, ln_weight, ln_bias, ln_eps)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _round_to(v, dtype, MANUAL_BF16_RNE: tl.constexpr):
    """v (fp32) rounded to `dtype` and widened back; the manual round-to-nearest-even replaces the
    interpreter's fp32->bf16 cast, which truncates (the GPU cast rounds to nearest even)."""
    if MANUAL_BF16_RNE:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _rope_partners(k, HALF, INTERLEAVED: tl.constexpr):
    """For rotated columns k (0-based in the rotated part): whether each is a real lane, its pair index j and
    its partner's column (interleaved pairs (2j, 2j+1), half-split pairs (j, j + HALF))."""
    if INTERLEAVED:
        is_real = (k % 2) == 0
        return is_real, k // 2, tl.where(is_real, k + 1, k - 1)
    else:
        is_real = k < HALF
        return is_real, tl.where(is_real, k, k - HALF), tl.where(is_real, k + HALF, k - HALF)


@triton.jit
def _complex_rope_lanes(own, partner, cos, sin, is_real, REAL_MUL: tl.constexpr, IMAG_MUL: tl.constexpr):
    """(a + ib)(c + is) in fp32, lane by lane: real = a*c - b*s, imag = a*s + b*c, with own = a, partner = b in
    a real lane and the reverse in an imaginary lane. REAL_MUL / IMAG_MUL (`LANE_ROUNDINGS`) pick which
    product, if any, an FMA keeps unrounded in each lane."""
    own_cos = own * cos
    partner_sin = partner * sin
    if REAL_MUL == 0:  # a*c - b*s, each op rounded
        real = own_cos - partner_sin
    elif REAL_MUL == 1:  # fma(a, c, -(b*s))
        real = tl.fma(own, cos, -partner_sin)
    else:  # fma(-b, s, a*c)
        real = tl.fma(-partner, sin, own_cos)
    if IMAG_MUL == 0:  # a*s + b*c, each op rounded
        imag = partner_sin + own_cos
    elif IMAG_MUL == 1:  # fma(a, s, b*c)
        imag = tl.fma(partner, sin, own_cos)
    else:  # fma(b, c, a*s)
        imag = tl.fma(own, cos, partner_sin)
    return tl.where(is_real, real, imag)


@triton.jit
def _rmsnorm_rope_block(
    pid, x_ptr, w_ptr, cos_ptr, sin_ptr, normed_ptr, roped_ptr, f_ptr,
    T, C_NORM, HALF, eps, F_ROWS,
    sx, scos, ssin, snorm, srope, sf, sfj,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, WEIGHT_FP32: tl.constexpr, HAS_ROPE: tl.constexpr, COMPLEX: tl.constexpr,
    REAL_MUL: tl.constexpr, IMAG_MUL: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr, DIV_SQRT: tl.constexpr,
    FP32_PAIRS: tl.constexpr, IN_PLACE: tl.constexpr,
):
    """Program `pid`'s ROWS rows: the norm over C_NORM columns (by `_rms_scale`, `_over_rms`), then the rope over
    2*HALF columns (HF's, from cos/sin rows, or a pair form as `_rope_rows`; or with COMPLEX the official complex
    product, row t rotated by freqs row t % F_ROWS)."""
    dtype = normed_ptr.dtype.element_ty
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)

    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < C_NORM
    ok = row_ok[:, None] & col_ok[None, :]
    xv = tl.load(x_ptr + rows64[:, None] * sx + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = _rms_scale(tl.sum(xv * xv, axis=1) / C_NORM + eps, DIV_SQRT)
    h = _over_rms(xv, scale[:, None], DIV_SQRT)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if WEIGHT_FP32:
        y = h * w[None, :]
    else:
        y = _round_to(h, dtype, MANUAL_BF16_RNE) * w[None, :]
    tl.store(normed_ptr + rows64[:, None] * snorm + cols[None, :], _round_to(y, dtype, MANUAL_BF16_RNE).to(dtype),
             mask=ok)

    if COMPLEX:
        k = tl.arange(0, 2 * BLOCK_H)
        is_real, j, partner = _rope_partners(k, HALF, INTERLEAVED)
        kok = row_ok[:, None] & (k < 2 * HALF)[None, :]
        x_rows = x_ptr + rows64[:, None] * sx + C_NORM
        own = tl.load(x_rows + k[None, :], mask=kok, other=0.0).to(tl.float32)
        other = tl.load(x_rows + partner[None, :], mask=kok, other=0.0).to(tl.float32)
        f_rows = f_ptr + (rows64 % F_ROWS)[:, None] * sf + j[None, :] * sfj
        cos = tl.load(f_rows, mask=kok, other=0.0)
        sin = tl.load(f_rows + 1, mask=kok, other=0.0)
        roped = _complex_rope_lanes(own, other, cos, sin, is_real[None, :], REAL_MUL, IMAG_MUL)
        tl.store(roped_ptr + rows64[:, None] * srope + k[None, :],
                 _round_to(roped, dtype, MANUAL_BF16_RNE).to(dtype), mask=kok)
    elif HAS_ROPE:
        _rope_rows(x_ptr + rows64[:, None] * sx + C_NORM, cos_ptr + rows64[:, None] * scos,
                   sin_ptr + rows64[:, None] * ssin, roped_ptr + rows64[:, None] * srope, row_ok, HALF,
                   0.0, 0.0, w_ptr, w_ptr, BLOCK_H, INTERLEAVED, 0, MANUAL_BF16_RNE, FP32_PAIRS, False, IN_PLACE)


@triton.jit
def _rms_scale(mean_square, DIV_SQRT: tl.constexpr):
    """A row's RMSNorm scale: rsqrt(mean_square), or with DIV_SQRT the divisor sqrt(mean_square), IEEE-rounded
    (`tl.sqrt` is approximate on the GPU)."""
    if DIV_SQRT:
        return tl.sqrt_rn(mean_square)
    else:
        return tl.rsqrt(mean_square)


@triton.jit
def _over_rms(xf, scale, DIV_SQRT: tl.constexpr):
    """xf normalised by its row's `_rms_scale`: xf * rsqrt, or with DIV_SQRT xf / sqrt as an IEEE division
    (Triton's `/` is an approximate reciprocal on the GPU)."""
    if DIV_SQRT:
        return tl.div_rn(xf, scale)
    else:
        return xf * scale


@triton.jit
def _layer_norm_apply(xf, mean, rstd, w_ptrs, b_ptrs, col_ok, dtype, MANUAL_BF16_RNE: tl.constexpr):
    """((xf - mean) * rstd) * weight + bias in fp32, rounded once to `dtype` (torch's decomposition)."""
    w = tl.load(w_ptrs, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)
    return _round_to(((xf - mean) * rstd) * w + b, dtype, MANUAL_BF16_RNE)


@triton.jit
def _norm_apply(xf, mean, rstd, w_ptrs, b_ptrs, col_ok, dtype, NORM: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr,
                DIV_SQRT: tl.constexpr):
    """The row norm `NORM` of columns xf (fp32) from the rows' statistics, rounded to `dtype` (kept in fp32):
    1 LayerNorm (`_layer_norm_apply`), 2 + i the RMSNorm rounding `RMS_NORMS[1 + i]` (`rstd` = the rows'
    `_rms_scale`, by which `_over_rms` normalises; the weight at `w_ptrs`)."""
    if NORM == 1:
        return _layer_norm_apply(xf, mean, rstd, w_ptrs, b_ptrs, col_ok, dtype, MANUAL_BF16_RNE)
    elif NORM == 2:  # (xf * r * w).to(dtype)
        w = tl.load(w_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        return _round_to(_over_rms(xf, rstd, DIV_SQRT) * w, dtype, MANUAL_BF16_RNE)
    elif NORM == 3:  # w * (xf * r).to(dtype)
        w = tl.load(w_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        return _round_to(_round_to(_over_rms(xf, rstd, DIV_SQRT), dtype, MANUAL_BF16_RNE) * w, dtype, MANUAL_BF16_RNE)
    elif NORM == 4:  # (xf * r).to(dtype)
        return _round_to(_over_rms(xf, rstd, DIV_SQRT), dtype, MANUAL_BF16_RNE)
    else:  # x * r.to(dtype)
        return _round_to(_over_rms(xf, _round_to(rstd, dtype, MANUAL_BF16_RNE), DIV_SQRT), dtype, MANUAL_BF16_RNE)


@triton.jit
def _rope_rows(x_rows, cos_rows, sin_rows, out_rows, row_ok, HALF, ln_mean, ln_rstd, ln_w, ln_b,
               BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
               MANUAL_BF16_RNE: tl.constexpr, FP32_PAIRS: tl.constexpr = False, DIV_SQRT: tl.constexpr = False,
               IN_PLACE: tl.constexpr = False):
    """RoPE of 2*HALF columns for a [ROWS, 1] block of row pointers (x and the output at the first rotated
    column, cos / sin at their row start), in HF's op order and output layout. With NORM (`_norm_apply`), x is
    first normalised with the rows' `ln_mean` / `ln_rstd` ([ROWS]) and the weight / bias at `ln_w` / `ln_b`
    (pointers at the first rotated column), DIV_SQRT its division form. FP32_PAIRS: V4's form (pairs rotated in
    place in fp32, one table column per pair, one rounding). IN_PLACE (with INTERLEAVED): HF's op order and
    rounding, the pairs written back in place (GPT-J's layout; one table column per pair, read as the interleaved
    form reads its tables' first half)."""
    dtype = out_rows.dtype.element_ty
    j = tl.arange(0, BLOCK_H)
    hok = row_ok[:, None] & (j < HALF)[None, :]
    if INTERLEAVED or FP32_PAIRS:
        # the pairs as one contiguous [ROWS, BLOCK_H, 2] load (vectorised), split into even / odd lanes
        lane = tl.arange(0, 2)
        pair_cols = 2 * j[None, :, None] + lane[None, None, :]
        pair_mask = hok[:, :, None] & (lane < 2)[None, None, :]
        pairs = tl.load(x_rows[:, :, None] + pair_cols, mask=pair_mask, other=0.0)
        if NORM:
            pair_ok = (j < HALF)[None, :, None] & (lane < 2)[None, None, :]
            pairs = _norm_apply(pairs.to(tl.float32), ln_mean[:, None, None], ln_rstd[:, None, None],
                                ln_w + pair_cols, ln_b + pair_cols, pair_ok, dtype, NORM, MANUAL_BF16_RNE, DIV_SQRT)
        a, b = tl.split(pairs)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        c_lo = tl.load(cos_rows + j[None, :], mask=hok, other=0.0).to(tl.float32)
        s_lo = tl.load(sin_rows + j[None, :], mask=hok, other=0.0).to(tl.float32)
        c_hi = c_lo
        s_hi = s_lo
    else:
        a = tl.load(x_rows + j[None, :], mask=hok, other=0.0).to(tl.float32)
        b = tl.load(x_rows + HALF + j[None, :], mask=hok, other=0.0).to(tl.float32)
        if NORM:
            jj = j[None, :]
            j_ok = (j < HALF)[None, :]
            a = _norm_apply(a, ln_mean[:, None], ln_rstd[:, None], ln_w + jj, ln_b + jj, j_ok, dtype, NORM,
                            MANUAL_BF16_RNE, DIV_SQRT)
            b = _norm_apply(b, ln_mean[:, None], ln_rstd[:, None], ln_w + HALF + jj, ln_b + HALF + jj, j_ok,
                            dtype, NORM, MANUAL_BF16_RNE, DIV_SQRT)
        c_lo = tl.load(cos_rows + j[None, :], mask=hok, other=0.0).to(tl.float32)
        s_lo = tl.load(sin_rows + j[None, :], mask=hok, other=0.0).to(tl.float32)
        c_hi = tl.load(cos_rows + HALF + j[None, :], mask=hok, other=0.0).to(tl.float32)
        s_hi = tl.load(sin_rows + HALF + j[None, :], mask=hok, other=0.0).to(tl.float32)
    if FP32_PAIRS:
        # fp32 products and sums, one rounding; the pair written back in place
        lo = _round_to(a * c_lo - b * s_lo, dtype, MANUAL_BF16_RNE).to(dtype)
        hi = _round_to(b * c_lo + a * s_lo, dtype, MANUAL_BF16_RNE).to(dtype)
        tl.store(out_rows[:, :, None] + pair_cols, tl.join(lo, hi), mask=pair_mask)
    else:
        # each product and each sum rounded to the input dtype, as torch's elementwise ops do
        ac = _round_to(a * c_lo, dtype, MANUAL_BF16_RNE)
        bs = _round_to(b * s_lo, dtype, MANUAL_BF16_RNE)
        bc = _round_to(b * c_hi, dtype, MANUAL_BF16_RNE)
        as_ = _round_to(a * s_hi, dtype, MANUAL_BF16_RNE)
        lo = _round_to(ac - bs, dtype, MANUAL_BF16_RNE).to(dtype)
        hi = _round_to(bc + as_, dtype, MANUAL_BF16_RNE).to(dtype)
        if IN_PLACE:
            tl.store(out_rows[:, :, None] + pair_cols, tl.join(lo, hi), mask=pair_mask)
        else:
            tl.store(out_rows + j[None, :], lo, mask=hok)
            tl.store(out_rows + HALF + j[None, :], hi, mask=hok)


@triton.jit
def _program_rows(pid, N, A1, A2, ROWS: tl.constexpr):
    """Program `pid`'s ROWS rows of the flattened A0*A1*A2 rows: validity, flat index, and the 3-D index."""
    rows = pid * ROWS + tl.arange(0, ROWS)
    r = rows.to(tl.int64)
    return rows < N, r, r // A2 // A1, (r // A2) % A1, r % A2


@triton.jit
def _rope_cat_block(
    pid, x_ptr, cos_ptr, sin_ptr, out_ptr, lnw_ptr, lnb_ptr,
    N, A1, A2, D, R0, HALF, ln_eps,
    sx0, sx1, sx2, sc0, sc1, sc2, ss0, ss1, ss2,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, NORM: tl.constexpr, FP32_PAIRS: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr,
    DIV_SQRT: tl.constexpr, IN_PLACE: tl.constexpr,
):
    """Program `pid`'s ROWS rows (of the A0*A1*A2 rows of a strided 4-D x): the columns outside
    [R0, R0 + 2*HALF) copied (normalised with NORM: 1 LayerNorm, 2.. an RMSNorm, by a division with DIV_SQRT, see
    `_norm_apply`), those inside RoPE'd, into a contiguous output."""
    dtype = out_ptr.dtype.element_ty
    row_ok, r, i0, i1, i2 = _program_rows(pid, N, A1, A2, ROWS)
    x_rows = x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2
    out_rows = out_ptr + r * D
    cols = tl.arange(0, BLOCK_D)
    kept = (cols < D) & ((cols < R0) | (cols >= R0 + 2 * HALF))
    ok = row_ok[:, None] & kept[None, :]
    if NORM:
        # statistics over the whole row in fp32 (LayerNorm: two passes, as the reference), then the kept columns
        col_ok = (cols < D)[None, :]
        row_cols_ok = row_ok[:, None] & col_ok
        xf = tl.load(x_rows[:, None] + cols[None, :], mask=row_cols_ok, other=0.0).to(tl.float32)
        if NORM == 1:
            mean = tl.sum(xf, axis=1) / D
            centred = tl.where(row_cols_ok, xf - mean[:, None], 0.0)
            rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / D + ln_eps)
        else:
            mean = tl.zeros([ROWS], dtype=tl.float32)
            rstd = _rms_scale(tl.div_rn(tl.sum(xf * xf, axis=1), D.to(tl.float32)) + ln_eps, DIV_SQRT)
        normed = _norm_apply(xf, mean[:, None], rstd[:, None], lnw_ptr + cols[None, :], lnb_ptr + cols[None, :],
                             col_ok, dtype, NORM, MANUAL_BF16_RNE, DIV_SQRT)
        tl.store(out_rows[:, None] + cols[None, :], normed.to(dtype), mask=ok)
    else:
        mean = 0.0
        rstd = 0.0
        tl.store(out_rows[:, None] + cols[None, :], tl.load(x_rows[:, None] + cols[None, :], mask=ok), mask=ok)
    _rope_rows(x_rows[:, None] + R0, cos_ptr + (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None],
               sin_ptr + (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None], out_rows[:, None] + R0, row_ok, HALF,
               mean, rstd, lnw_ptr + R0, lnb_ptr + R0, BLOCK_H, INTERLEAVED, NORM, MANUAL_BF16_RNE, FP32_PAIRS,
               DIV_SQRT, IN_PLACE)


@triton.jit
def _rope_quant_fp8_block(
    pid, x_ptr, f_ptr, q_ptr, s_ptr, lnw_ptr, lnb_ptr,
    N, A1, A2, D, R0, HALF, NB, ln_eps,
    sx0, sx1, sx2, sf0, sf1, sf2, sfj,
    ROWS: tl.constexpr, NB_P2: tl.constexpr, BS: tl.constexpr,
    INTERLEAVED: tl.constexpr, LAYER_NORM: tl.constexpr, UE8M0: tl.constexpr, REAL_MUL: tl.constexpr,
    IMAG_MUL: tl.constexpr,
    MANUAL_BF16_RNE: tl.constexpr, MANUAL_FP8_RNE: tl.constexpr, RECIPROCAL_SCALE: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
):
    """Program `pid`'s ROWS rows (of the A0*A1*A2 rows of a strided 4-D x), each as an [NB, BS] tile of its
    D = NB*BS columns: LayerNorm (optional), complex-multiply RoPE of columns [R0, R0 + 2*HALF) in fp32,
    rounding to x's dtype, then per-block amax -> scale -> e4m3."""
    dtype = x_ptr.dtype.element_ty
    row_ok, r, i0, i1, i2 = _program_rows(pid, N, A1, A2, ROWS)
    x_rows = (x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None, None]
    f_rows = (f_ptr + i0 * sf0 + i1 * sf1 + i2 * sf2)[:, None, None]
    blocks = tl.arange(0, NB_P2)
    cols = (blocks[:, None] * BS + tl.arange(0, BS)[None, :])[None, :, :]
    ok = row_ok[:, None, None] & (blocks < NB)[None, :, None]
    xv = tl.load(x_rows + cols, mask=ok, other=0.0).to(tl.float32)

    # the rotated partner of each column: interleaved pairs (2j, 2j+1), half-split pairs (j, j + HALF)
    k = cols - R0
    in_rope = (k >= 0) & (k < 2 * HALF)
    is_real, j, partner = _rope_partners(k, HALF, INTERLEAVED)
    partner = partner + R0
    rope_ok = ok & in_rope
    pv = tl.load(x_rows + partner, mask=rope_ok, other=0.0).to(tl.float32)

    if LAYER_NORM:
        # statistics in fp32, two passes, true divisions (Triton's `/` is an approximate reciprocal on the GPU)
        mean = tl.div_rn(tl.sum(tl.sum(xv, axis=2), axis=1), D.to(tl.float32))
        centred = tl.where(ok, xv - mean[:, None, None], 0.0)
        rstd = tl.rsqrt(tl.div_rn(tl.sum(tl.sum(centred * centred, axis=2), axis=1), D.to(tl.float32)) + ln_eps)
        col_ok = (blocks < NB)[None, :, None]
        xv = _layer_norm_apply(xv, mean[:, None, None], rstd[:, None, None], lnw_ptr + cols, lnb_ptr + cols,
                               col_ok, dtype, MANUAL_BF16_RNE)
        pv = _layer_norm_apply(pv, mean[:, None, None], rstd[:, None, None], lnw_ptr + partner,
                               lnb_ptr + partner, col_ok & in_rope, dtype, MANUAL_BF16_RNE)

    cos = tl.load(f_rows + j * sfj, mask=rope_ok, other=0.0)
    sin = tl.load(f_rows + j * sfj + 1, mask=rope_ok, other=0.0)
    roped = _complex_rope_lanes(xv, pv, cos, sin, is_real, REAL_MUL, IMAG_MUL)
    values = _round_to(tl.where(in_rope, roped, xv), dtype, MANUAL_BF16_RNE)

    amax = tl.max(tl.where(ok, tl.abs(values), 0.0), axis=2)
    if RECIPROCAL_SCALE:  # eager CUDA divides by a Python scalar as a multiply by its fp32 reciprocal
        scale = tl.maximum(amax, 1e-4) * INV_FP8_MAX
    else:  # eager CPU divides
        scale = tl.div_rn(tl.maximum(amax, 1e-4), 448.0)
    if UE8M0:
        scale = power_of_two_ceil(scale)
    quantized = tl.div_rn(values, scale[:, :, None])
    quantized = tl.minimum(tl.maximum(quantized, -448.0), 448.0)
    if MANUAL_FP8_RNE:
        quantized = round_to_e4m3_grid(quantized)
    tl.store(q_ptr + r[:, None, None] * D + cols, quantized.to(tl.float8e4nv), mask=ok)
    tl.store(s_ptr + r[:, None] * NB + blocks[None, :], scale, mask=row_ok[:, None] & (blocks < NB)[None, :])


@triton.jit
def _complex_rope_block(
    pid, x_ptr, f_ptr, out_ptr,
    N, A1, A2, HALF,
    sx0, sx1, sx2, sf0, sf1, sf2, sfj,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, INTERLEAVED: tl.constexpr, REAL_MUL: tl.constexpr,
    IMAG_MUL: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr,
):
    """Program `pid`'s ROWS rows (of the A0*A1*A2 rows of a strided 4-D x): the complex-multiply RoPE of all
    2*HALF columns in fp32, rounded once to x's dtype, into a contiguous output."""
    dtype = out_ptr.dtype.element_ty
    row_ok, r, i0, i1, i2 = _program_rows(pid, N, A1, A2, ROWS)
    k = tl.arange(0, BLOCK_C)
    is_real, j, partner = _rope_partners(k, HALF, INTERLEAVED)
    ok = row_ok[:, None] & (k < 2 * HALF)[None, :]
    x_rows = (x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
    own = tl.load(x_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)
    other = tl.load(x_rows + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    f_rows = (f_ptr + i0 * sf0 + i1 * sf1 + i2 * sf2)[:, None] + j[None, :] * sfj
    cos = tl.load(f_rows, mask=ok, other=0.0)
    sin = tl.load(f_rows + 1, mask=ok, other=0.0)
    roped = _complex_rope_lanes(own, other, cos, sin, is_real[None, :], REAL_MUL, IMAG_MUL)
    tl.store(out_ptr + r[:, None] * (2 * HALF) + k[None, :], _round_to(roped, dtype, MANUAL_BF16_RNE).to(dtype),
             mask=ok)


def default_rows(width):
    """Rows per program for a row tile of `width` columns: a program moves a few KiB, at most 8 rows."""
    return max(1, min(8, 4096 // next_power_of_2(width)))


def default_num_warps(width, rows):
    """Warps per program: 4 up to a 4096-element tile, else 8."""
    return 4 if next_power_of_2(width) * rows <= 4096 else 8


def rmsnorm_rope_launch(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32, freqs=None, div_sqrt=False,
                        fp32_pairs=False, pairs_in_place=False, rows_per_program=None, num_warps=None,
                        complex_mul=None) -> "BlockLaunch":
    """`rmsnorm_rope`'s share of a launch (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), its outputs
    allocated. `rows_per_program` / `num_warps` override the launch shape (the GPU benchmark sweeps them);
    `complex_mul` as for `rope_quant_fp8_launch`."""
    _validate(x, norm_weight, eps, cos, sin, freqs, fp32_pairs, pairs_in_place, interleaved)
    _check_weight_dtype(x, norm_weight, weight_in_fp32)
    T, width = x.shape
    c_norm = norm_weight.shape[0]
    c_rope = width - c_norm
    normed = torch.empty((T, c_norm), dtype=x.dtype, device=x.device)
    roped = torch.empty((T, c_rope), dtype=x.dtype, device=x.device)
    rows = rows_per_program or default_rows(c_norm)
    has_rope = c_rope > 0 and cos is not None
    cos_arg = cos if has_rope else x
    sin_arg = sin if has_rope else x
    pairs = torch.view_as_real(freqs) if freqs is not None else x[:, None]  # [F, C_rope/2, 2] fp32 (cos, sin)
    real_mul, imag_mul = complex_mul or CUDA_COMPLEX_MUL
    half = c_rope // 2
    return BlockLaunch.bind(
        _rmsnorm_rope_block, cdiv(T, rows), num_warps or default_num_warps(c_norm, rows), (normed, roped),
        x, norm_weight, cos_arg, sin_arg, normed, roped, pairs,
        T, c_norm, half, float(eps), pairs.shape[0],
        x.stride(0), cos_arg.stride(0), sin_arg.stride(0), normed.stride(0), max(1, roped.stride(0)),
        pairs.stride(0), pairs.stride(1),
        ROWS=rows, BLOCK_N=next_power_of_2(c_norm), BLOCK_H=next_power_of_2(max(half, 1)),
        INTERLEAVED=bool(interleaved), WEIGHT_FP32=bool(weight_in_fp32), HAS_ROPE=has_rope,
        COMPLEX=freqs is not None, REAL_MUL=LANE_ROUNDINGS.index(real_mul), IMAG_MUL=LANE_ROUNDINGS.index(imag_mul),
        MANUAL_BF16_RNE=interpreting() and x.dtype == torch.bfloat16, DIV_SQRT=bool(div_sqrt),
        FP32_PAIRS=bool(fp32_pairs), IN_PLACE=bool(pairs_in_place))


def rmsnorm_rope_triton(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32, freqs=None, div_sqrt=False,
                        fp32_pairs=False, pairs_in_place=False, **launch):
    """One launch of `rmsnorm_rope`, no host sync (keyword arguments as `rmsnorm_rope_launch`)."""
    return launch_blocks([rmsnorm_rope_launch(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32, freqs,
                                              div_sqrt, fp32_pairs, pairs_in_place, **launch)])[0]


def rope_cat_default_rows(n_rows, width):
    """Rows per program of `rope_cat`: 16 for the query's million-row case, where it measured fastest on the
    H200 (run 8, width 192: 66 µs against 87 with 8), else the width's default."""
    return 16 if n_rows >= 1 << 18 and width <= 256 else default_rows(width)


def rope_cat_launch(x, cos, sin, rope_start, interleaved, ln_weight=None, ln_bias=None, ln_eps=0.0, rms_norm=0,
                    rms_weight=None, rms_eps=0.0, fp32_pairs=False, rms_div_sqrt=False, pairs_in_place=False,
                    rows_per_program=None, num_warps=None) -> "BlockLaunch":
    """`rope_cat`'s share of a launch (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    _validate_rope_cat(x, cos, sin, rope_start, ln_weight, ln_bias, ln_eps, rms_norm, rms_weight, rms_eps, fp32_pairs,
                       rms_div_sqrt, pairs_in_place, interleaved)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    width = x.shape[3]
    rows = rows_per_program or rope_cat_default_rows(n_rows, width)
    half = cos.shape[-1] if fp32_pairs or pairs_in_place else cos.shape[-1] // 2
    norm = 1 if ln_weight is not None else 1 + rms_norm if rms_norm else 0
    weight = ln_weight if ln_weight is not None else rms_weight if rms_weight is not None else x
    return BlockLaunch.bind(
        _rope_cat_block, cdiv(n_rows, rows), num_warps or default_num_warps(width, rows), (out,),
        x, cos, sin, out, weight, ln_bias if ln_bias is not None else x,
        n_rows, x.shape[1], x.shape[2], width, rope_start, half, float(ln_eps if ln_weight is not None else rms_eps),
        *x.stride()[:3], *cos.stride()[:3], *sin.stride()[:3],
        ROWS=rows, BLOCK_D=next_power_of_2(width), BLOCK_H=next_power_of_2(half),
        INTERLEAVED=bool(interleaved), NORM=norm, FP32_PAIRS=bool(fp32_pairs),
        MANUAL_BF16_RNE=interpreting() and x.dtype == torch.bfloat16, DIV_SQRT=bool(rms_div_sqrt),
        IN_PLACE=bool(pairs_in_place))


def rope_cat_triton(x, cos, sin, rope_start, interleaved, ln_weight=None, ln_bias=None, ln_eps=0.0, rms_norm=0,
                    rms_weight=None, rms_eps=0.0, fp32_pairs=False, rms_div_sqrt=False, pairs_in_place=False,
                    rows_per_program=None, num_warps=None):
    """One launch of `rope_cat`."""
    return launch_blocks([rope_cat_launch(x, cos, sin, rope_start, interleaved, ln_weight, ln_bias, ln_eps, rms_norm,
                                          rms_weight, rms_eps, fp32_pairs, rms_div_sqrt, pairs_in_place,
                                          rows_per_program, num_warps)])[0][0]


def _broadcast_strides(t, dims):
    """Strides of t's first `dims` dims, 0 where the size is 1 (a broadcast dim of the rows)."""
    return [0 if t.shape[d] == 1 else t.stride(d) for d in range(dims)]


def rope_quant_default_rows(n_rows, width):
    """Rows per program of `rope_quant_fp8`. H200 (run 13, width 128): 16 for the indexer query's 1M rows
    (309 µs against 452 with 8 and 347 with 32), the width's default (8) for the key's 16K rows (10.8 µs
    against 18.9 with 32)."""
    return 16 if n_rows >= 1 << 18 and width <= 128 else default_rows(width)


def rope_quant_fp8_launch(x, freqs, rope_start, interleaved, block_size, ue8m0, ln_weight=None, ln_bias=None,
                          ln_eps=0.0, rows_per_program=None, num_warps=None, complex_mul=None,
                          reciprocal_scale=None) -> "BlockLaunch":
    """`rope_quant_fp8`'s share of a launch (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).
    `complex_mul` ((real, imaginary) `LANE_ROUNDINGS` names, default `CUDA_COMPLEX_MUL`) picks the rounding of
    the complex product; the GPU benchmark compares them against eager CUDA. `reciprocal_scale` (default: on
    CUDA) computes the scale as amax * fp32(1/448), as eager CUDA's division by a Python scalar does; otherwise
    amax / 448, as eager CPU does."""
    _validate_rope_quant(x, freqs, rope_start, block_size, ln_weight, ln_bias, ln_eps)
    width = x.shape[-1]
    quantized = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], width // block_size), dtype=torch.float32, device=x.device)
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    pairs = torch.view_as_real(freqs)  # [..., C_rope/2, 2] fp32 (cos, sin), a view
    real_mul, imag_mul = complex_mul or CUDA_COMPLEX_MUL
    rows = rows_per_program or rope_quant_default_rows(n_rows, width)
    n_blocks = width // block_size
    layer_norm = ln_weight is not None
    return BlockLaunch.bind(
        _rope_quant_fp8_block, cdiv(n_rows, rows), num_warps or default_num_warps(width, rows),
        (quantized, scale),
        x, pairs, quantized, scale, ln_weight if layer_norm else x, ln_bias if layer_norm else x,
        n_rows, x.shape[1], x.shape[2], width, rope_start, freqs.shape[-1], n_blocks, float(ln_eps),
        *x.stride()[:3], *_broadcast_strides(pairs, 3), pairs.stride(3),
        ROWS=rows, NB_P2=next_power_of_2(n_blocks), BS=block_size,
        INTERLEAVED=bool(interleaved), LAYER_NORM=layer_norm, UE8M0=bool(ue8m0),
        REAL_MUL=LANE_ROUNDINGS.index(real_mul), IMAG_MUL=LANE_ROUNDINGS.index(imag_mul),
        MANUAL_BF16_RNE=interpreting() and x.dtype == torch.bfloat16, MANUAL_FP8_RNE=interpreting(),
        RECIPROCAL_SCALE=x.is_cuda if reciprocal_scale is None else bool(reciprocal_scale),
        INV_FP8_MAX=FP8_INV_MAX)


def rope_quant_fp8_triton(x, freqs, rope_start, interleaved, block_size, ue8m0, ln_weight=None, ln_bias=None,
                          ln_eps=0.0, rows_per_program=None, num_warps=None, complex_mul=None,
                          reciprocal_scale=None):
    """One launch of `rope_quant_fp8` (see `rope_quant_fp8_launch` for the keyword arguments)."""
    return launch_blocks([rope_quant_fp8_launch(x, freqs, rope_start, interleaved, block_size, ue8m0, ln_weight,
                                                ln_bias, ln_eps, rows_per_program, num_warps, complex_mul,
                                                reciprocal_scale)])[0]


def complex_rope_launch(x, freqs, interleaved, rows_per_program=None, num_warps=None,
                        complex_mul=None) -> "BlockLaunch":
    """`complex_rope`'s share of a launch (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); `complex_mul`
    as for `rope_quant_fp8_launch`."""
    _validate_complex_rope(x, freqs)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    width = x.shape[-1]
    pairs = torch.view_as_real(freqs)  # [..., C/2, 2] fp32 (cos, sin), a view
    real_mul, imag_mul = complex_mul or CUDA_COMPLEX_MUL
    rows = rows_per_program or rope_cat_default_rows(n_rows, width)
    return BlockLaunch.bind(
        _complex_rope_block, cdiv(n_rows, rows), num_warps or default_num_warps(width, rows), (out,),
        x, pairs, out, n_rows, x.shape[1], x.shape[2], width // 2,
        *x.stride()[:3], *_broadcast_strides(pairs, 3), pairs.stride(3),
        ROWS=rows, BLOCK_C=next_power_of_2(width), INTERLEAVED=bool(interleaved),
        REAL_MUL=LANE_ROUNDINGS.index(real_mul), IMAG_MUL=LANE_ROUNDINGS.index(imag_mul),
        MANUAL_BF16_RNE=interpreting() and x.dtype == torch.bfloat16)


def complex_rope_triton(x, freqs, interleaved, **launch):
    """One launch of `complex_rope` (keyword arguments as `complex_rope_launch`)."""
    return launch_blocks([complex_rope_launch(x, freqs, interleaved, **launch)])[0][0]


# --------------------------------------------------------------------------------------------
# Launch groups: several independent ops of one layer in one kernel launch
# --------------------------------------------------------------------------------------------
@dataclass
class BlockLaunch:
    """One op's share of a launch: a block function `(pid, *params)`, how many programs it needs, the values
    of its parameters (by name), its preferred warps per program and its (already allocated) outputs."""

    block: Any
    programs: int
    params: dict
    num_warps: int
    outputs: tuple

    @classmethod
    def bind(cls, block, programs, num_warps, outputs, *args, **kwargs) -> "BlockLaunch":
        params = dict(zip(_block_parameter_names(block.fn), args))
        params.update(kwargs)
        return cls(block, programs, params, num_warps, outputs)


@functools.lru_cache(maxsize=None)
def _block_parameters(fn) -> tuple[inspect.Parameter, ...]:
    """A block function's parameters after `pid` (read once per block: launches are a hot path)."""
    return tuple(inspect.signature(fn).parameters.values())[1:]


@functools.lru_cache(maxsize=None)
def _block_parameter_names(fn) -> tuple[str, ...]:
    return tuple(p.name for p in _block_parameters(fn))


_GROUP_KERNELS: dict[tuple[str, ...], Any] = {}


def _group_kernel(blocks: tuple) -> Any:
    """A kernel that runs `blocks[i]` on its i-th range of programs (the ranges start at `START_i`), generated
    once per sequence of block functions. The source lives in `linecache`, where Triton reads it."""
    key = tuple(block.fn.__name__ for block in blocks)
    if key in _GROUP_KERNELS:
        return _GROUP_KERNELS[key]
    name = "_launch" + "".join(k.removesuffix("_block") for k in key)
    params = [f"START_{i}" for i in range(1, len(blocks))]
    calls = []
    for i, block in enumerate(blocks):
        block_params = _block_parameters(block.fn)
        params += [f"m{i}_{p.name}" + (": tl.constexpr" if p.annotation is tl.constexpr else "")
                   for p in block_params]
        pid = "pid" if i == 0 else f"pid - START_{i}"
        calls.append(f"_block{i}({pid}, {', '.join(f'm{i}_{p.name}' for p in block_params)})")
    body = ["    pid = tl.program_id(0)"]
    if len(calls) == 1:
        body.append(f"    {calls[0]}")
    else:
        for i, call in enumerate(calls):
            keyword = "if" if i == 0 else "elif" if i < len(calls) - 1 else "else"
            condition = f" pid < START_{i + 1}" if keyword != "else" else ""
            body += [f"    {keyword}{condition}:", f"        {call}"]
    source = "\n".join(["@triton.jit", f"def {name}({', '.join(params)}):", *body]) + "\n"
    filename = f"<dsfuse {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": __name__, "triton": triton, "tl": tl,
                 **{f"_block{i}": block for i, block in enumerate(blocks)}}
    exec(compile(source, filename, "exec"), namespace)
    _GROUP_KERNELS[key] = namespace[name]
    return namespace[name]


def launch_blocks(launches: list[BlockLaunch]) -> list[tuple]:
    """Run every launch's block in one kernel launch (programs laid end to end; one with no programs is left
    out) and return each launch's outputs, in order. No host sync. The group kernel's arguments go positionally
    (its range starts, then each block's parameters in order): the host binds them once, by position."""
    busy = [launch for launch in launches if launch.programs > 0]
    if busy:
        starts, values, start = [], [], 0
        for i, launch in enumerate(busy):
            if i:
                starts.append(start)
            start += launch.programs
            params = launch.params
            values += [params[name] for name in _block_parameter_names(launch.block.fn)]
        kernel = _group_kernel(tuple(launch.block for launch in busy))
        kernel[(start,)](*starts, *values, num_warps=max(launch.num_warps for launch in busy), **COMPILE_OPTIONS)
    return [launch.outputs for launch in launches]


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("dsfuse::rmsnorm_rope", mutates_args=())
def rmsnorm_rope(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: Optional[torch.Tensor],
                 sin: Optional[torch.Tensor], interleaved: bool, weight_in_fp32: bool,
                 freqs: Optional[torch.Tensor] = None, div_sqrt: bool = False, fp32_pairs: bool = False,
                 pairs_in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed [T, C_norm], roped [T, C_rope]) in x's dtype (reference math on CPU). `freqs` (complex64
    [F, C_rope/2], F dividing T; row t rotated by freqs row t % F) instead of cos/sin: the official
    complex-multiply RoPE, in the source's layout. `div_sqrt`: the norm divides by sqrt(mean + eps).
    `fp32_pairs` / `pairs_in_place` (cos/sin [T, C_rope/2]): V4's fp32 pair RoPE, or GPT-J's interleaved RoPE in
    x's dtype, each written in place (as `rope_cat`'s)."""
    _validate(x, norm_weight, eps, cos, sin, freqs, fp32_pairs, pairs_in_place, interleaved)
    _check_weight_dtype(x, norm_weight, weight_in_fp32)
    normed, roped = rmsnorm_rope_reference(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32, freqs,
                                           div_sqrt, fp32_pairs, pairs_in_place)
    return normed.contiguous(), roped.contiguous()


@rmsnorm_rope.register_fake
def _rmsnorm_rope_fake(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32, freqs=None, div_sqrt=False,
                       fp32_pairs=False, pairs_in_place=False):
    _validate(x, norm_weight, eps, cos, sin, freqs, fp32_pairs, pairs_in_place, interleaved)
    _check_weight_dtype(x, norm_weight, weight_in_fp32)
    T, width = x.shape
    c_norm = norm_weight.shape[0]
    return x.new_empty((T, c_norm)), x.new_empty((T, width - c_norm))


@direct_kernel(rmsnorm_rope)
def _rmsnorm_rope_cuda(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32, freqs=None, div_sqrt=False,
                       fp32_pairs=False, pairs_in_place=False):
    return rmsnorm_rope_triton(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32, freqs, div_sqrt, fp32_pairs,
                               pairs_in_place)


@torch.library.custom_op("dsfuse::rope_cat", mutates_args=())
def rope_cat(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_start: int, interleaved: bool,
             ln_weight: Optional[torch.Tensor] = None, ln_bias: Optional[torch.Tensor] = None,
             ln_eps: float = 0.0, rms_norm: int = 0, rms_weight: Optional[torch.Tensor] = None,
             rms_eps: float = 0.0, fp32_pairs: bool = False, rms_div_sqrt: bool = False,
             pairs_in_place: bool = False) -> torch.Tensor:
    """x ([A0, A1, A2, D], any strides but a contiguous last dim) with columns [rope_start, rope_start +
    C_rope) RoPE'd and the rest copied, contiguous: HF's `cat` of a split's parts after the RoPE of one.
    cos/sin: [A0, A1, A2, C_rope] (broadcast dims may have stride 0; with `fp32_pairs`, V4's RoPE, one column
    per pair: [A0, A1, A2, C_rope/2]). With `ln_weight` / `ln_bias` ([D]), each row is first LayerNorm'd (eps
    `ln_eps`): HF's indexer key path; with `rms_norm` (an index of `RMS_NORMS`), RMSNorm'd (weight
    `rms_weight`, eps `rms_eps`, by a division with `rms_div_sqrt`): HF V4's query and K=V head. With
    `pairs_in_place` (and `interleaved`; tables of one column per pair as `fp32_pairs`): GPT-J's RoPE in x's
    dtype, pairs written back in place. Reference math on CPU."""
    _validate_rope_cat(x, cos, sin, rope_start, ln_weight, ln_bias, ln_eps, rms_norm, rms_weight, rms_eps, fp32_pairs,
                       rms_div_sqrt, pairs_in_place, interleaved)
    return rope_cat_reference(x, cos, sin, rope_start, interleaved, ln_weight, ln_bias, ln_eps, rms_norm, rms_weight,
                              rms_eps, fp32_pairs, rms_div_sqrt, pairs_in_place).contiguous()


@rope_cat.register_fake
def _rope_cat_fake(x, cos, sin, rope_start, interleaved, ln_weight=None, ln_bias=None, ln_eps=0.0, rms_norm=0,
                   rms_weight=None, rms_eps=0.0, fp32_pairs=False, rms_div_sqrt=False, pairs_in_place=False):
    _validate_rope_cat(x, cos, sin, rope_start, ln_weight, ln_bias, ln_eps, rms_norm, rms_weight, rms_eps, fp32_pairs,
                       rms_div_sqrt, pairs_in_place, interleaved)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@direct_kernel(rope_cat)
def _rope_cat_cuda(x, cos, sin, rope_start, interleaved, ln_weight=None, ln_bias=None, ln_eps=0.0, rms_norm=0,
                   rms_weight=None, rms_eps=0.0, fp32_pairs=False, rms_div_sqrt=False, pairs_in_place=False):
    return rope_cat_triton(x, cos, sin, rope_start, interleaved, ln_weight, ln_bias, ln_eps, rms_norm, rms_weight,
                           rms_eps, fp32_pairs, rms_div_sqrt, pairs_in_place)


@torch.library.custom_op("dsfuse::rope_quant_fp8", mutates_args=())
def rope_quant_fp8(x: torch.Tensor, freqs: torch.Tensor, rope_start: int, interleaved: bool, block_size: int,
                   ue8m0: bool, ln_weight: Optional[torch.Tensor] = None, ln_bias: Optional[torch.Tensor] = None,
                   ln_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [A0, A1, A2, D] float8_e4m3fn, scale [A0, A1, A2, D / block_size] fp32) of the official indexer's
    `quantize_fp8_blockwise(cat(complex_rope(split(x))))`: x [A0, A1, A2, D] (any strides but a contiguous
    last dim), optionally LayerNorm'd per row first; `freqs` complex64 [A0, A1, A2, C_rope/2] (broadcast dims
    may have stride 0). Reference math on CPU."""
    _validate_rope_quant(x, freqs, rope_start, block_size, ln_weight, ln_bias, ln_eps)
    quantized, scale = rope_quant_fp8_reference(x, freqs, rope_start, interleaved, block_size, ue8m0, ln_weight,
                                                ln_bias, ln_eps)
    return quantized.contiguous(), scale.contiguous()


@rope_quant_fp8.register_fake
def _rope_quant_fp8_fake(x, freqs, rope_start, interleaved, block_size, ue8m0, ln_weight=None, ln_bias=None,
                         ln_eps=0.0):
    _validate_rope_quant(x, freqs, rope_start, block_size, ln_weight, ln_bias, ln_eps)
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((*x.shape[:-1], x.shape[-1] // block_size), dtype=torch.float32, device=x.device))


@direct_kernel(rope_quant_fp8)
def _rope_quant_fp8_cuda(x, freqs, rope_start, interleaved, block_size, ue8m0, ln_weight=None, ln_bias=None,
                         ln_eps=0.0):
    return rope_quant_fp8_triton(x, freqs, rope_start, interleaved, block_size, ue8m0, ln_weight, ln_bias, ln_eps)


@torch.library.custom_op("dsfuse::complex_rope", mutates_args=())
def complex_rope(x: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The official complex-multiply RoPE of every column of x ([A0, A1, A2, C], any strides but a contiguous last
    dim) with `freqs` complex64 [A0, A1, A2, C/2] (size-1 dims broadcast): fp32 product, one rounding to x's
    dtype, contiguous, in the source's layout (own model: the main query's `q_pe`). Reference math on CPU."""
    _validate_complex_rope(x, freqs)
    return complex_rope_reference(x, freqs, interleaved).contiguous()


@complex_rope.register_fake
def _complex_rope_fake(x, freqs, interleaved):
    _validate_complex_rope(x, freqs)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@direct_kernel(complex_rope)
def _complex_rope_cuda(x, freqs, interleaved):
    return complex_rope_triton(x, freqs, interleaved)


GROUP_MEMBERS = ("rmsnorm_rope", "rope_cat", "rope_quant_fp8", "complex_rope")
_MEMBER_LAUNCHES = {"rmsnorm_rope": rmsnorm_rope_launch, "rope_cat": rope_cat_launch,
                    "rope_quant_fp8": rope_quant_fp8_launch, "complex_rope": complex_rope_launch}


@functools.lru_cache(maxsize=None)
def _argument_kinds(op: str) -> tuple[str, ...]:
    """The schema type of each argument of `torch.ops.dsfuse.<op>`, in order (read once per op)."""
    return tuple(str(argument.type) for argument in getattr(torch.ops.dsfuse, op).default._schema.arguments)


def group_member_lists(op: str, args: tuple, kwargs: dict | None = None) -> tuple[list, list, list]:
    """Member `op`'s arguments (positional, then by name, then the schema defaults) as a group call takes them:
    (tensors and None, ints and bools as ints, floats), the inverse of `group_member_args`. Values may be fx
    nodes (the pass builds a group call from the members' calls)."""
    kwargs = kwargs or {}
    tensors, ints, floats = [], [], []
    schema = getattr(torch.ops.dsfuse, op).default._schema
    for i, (argument, kind) in enumerate(zip(schema.arguments, _argument_kinds(op))):
        value = args[i] if i < len(args) else kwargs.get(argument.name, argument.default_value)
        if "Tensor" in kind:
            tensors.append(value)
        elif kind == "float":
            floats.append(float(value))
        elif kind in ("int", "SymInt", "bool"):
            ints.append(int(value) if kind == "bool" else value)
        else:
            raise TypeError(f"norm_rope_group: member {op} has an argument of type {kind}")
    return tensors, ints, floats


@functools.lru_cache(maxsize=None)
def _member_plan(op: str) -> tuple[tuple[int, bool], ...]:
    """For each argument of member `op`, in schema order: the group list it comes from (0 tensors, 1 ints,
    2 floats) and whether it is a bool (read once per op: group calls are a hot path)."""
    plan = []
    for kind in _argument_kinds(op):
        if "Tensor" in kind:
            plan.append((0, False))
        elif kind == "float":
            plan.append((2, False))
        elif kind in ("int", "SymInt", "bool"):
            plan.append((1, kind == "bool"))
        else:
            raise TypeError(f"norm_rope_group: member {op} has an argument of type {kind}")
    return tuple(plan)


def group_member_args(op: str, tensors: list, ints: list, floats: list) -> tuple[list, list, list, list]:
    """The arguments of member `op` taken from the front of a group's three lists, in `op`'s schema order, and
    what is left of the lists. Tensors (or None) come from `tensors`, ints and bools from `ints`, floats from
    `floats`."""
    lists, used, args = (tensors, ints, floats), [0, 0, 0], []
    for source, is_bool in _member_plan(op):
        value = lists[source][used[source]]
        used[source] += 1
        args.append(bool(value) if is_bool else value)
    return args, tensors[used[0]:], ints[used[1]:], floats[used[2]:]


def split_group(members: str, tensors: list, ints: list, floats: list) -> list[tuple[str, list]]:
    """(op, arguments) for each member of a `norm_rope_group` call; checks the names and that every list
    is used up."""
    ops = members.split(",")
    unknown = [op for op in ops if op not in GROUP_MEMBERS]
    if unknown:
        raise ValueError(f"norm_rope_group: unknown member(s) {unknown}; members are {', '.join(GROUP_MEMBERS)}")
    calls = []
    for op in ops:
        try:
            args, tensors, ints, floats = group_member_args(op, tensors, ints, floats)
        except IndexError:
            raise ValueError(f"norm_rope_group: too few arguments for member {op} of {members!r}") from None
        calls.append((op, args))
    if tensors or ints or floats:
        raise ValueError(f"norm_rope_group: {len(tensors)} tensor, {len(ints)} int and {len(floats)} float "
                         f"argument(s) left over after the members {members!r}")
    return calls


def _flat_outputs(outputs) -> list[torch.Tensor]:
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


@torch.library.custom_op("dsfuse::norm_rope_group", mutates_args=())
def norm_rope_group(members: str, tensors: list[Optional[torch.Tensor]], ints: list[int],
                    floats: list[float]) -> list[torch.Tensor]:
    """Several independent glue ops of one layer (`members`: comma-separated names from `GROUP_MEMBERS`) in one
    kernel launch on CUDA. Each member's arguments are its op's, in schema order, spread over `tensors`
    (tensors and None), `ints` (ints and bools) and `floats`; the result is every member's outputs, in order.
    On CPU each member op runs as itself (its reference)."""
    outputs = []
    for op, args in split_group(members, tensors, ints, floats):
        outputs += _flat_outputs(getattr(torch.ops.dsfuse, op)(*args))
    return outputs


@norm_rope_group.register_fake
def _norm_rope_group_fake(members, tensors, ints, floats):
    outputs = []
    for op, args in split_group(members, tensors, ints, floats):
        outputs += _flat_outputs(getattr(torch.ops.dsfuse, op)(*args))
    return outputs


@direct_kernel(norm_rope_group)
def _norm_rope_group_cuda(members, tensors, ints, floats):
    launches = [_MEMBER_LAUNCHES[op](*args) for op, args in split_group(members, tensors, ints, floats)]
    return [out for outputs in launch_blocks(launches) for out in outputs]


def bytes_moved(T, c_norm, c_rope, itemsize, cos_itemsize=None):
    """HBM traffic: read x, cos, sin (full tables; the interleaved form needs only their first halves) and
    the weight, write both outputs."""
    cos_itemsize = cos_itemsize or itemsize
    return T * (c_norm + c_rope) * itemsize * 2 + 2 * T * c_rope * cos_itemsize + c_norm * itemsize


__all__ = ["BlockLaunch", "COMPILE_OPTIONS", "GROUP_MEMBERS", "RMS_NORMS", "bytes_moved", "complex_rope", "complex_rope_launch",
           "complex_rope_reference", "complex_rope_triton", "default_num_warps", "default_rows",
           "group_member_lists", "launch_blocks", "layer_norm_reference", "pair_rope_fp32_reference", "rms_norm_reference", "norm_rope_group", "rmsnorm_rope",
           "rmsnorm_rope_launch", "rmsnorm_rope_reference", "rmsnorm_rope_triton", "rope_cat", "rope_cat_launch",
           "rope_cat_reference", "rope_cat_triton", "rope_quant_fp8", "rope_quant_fp8_launch",
           "rope_quant_fp8_reference", "rope_quant_fp8_triton", "rope_reference"]
