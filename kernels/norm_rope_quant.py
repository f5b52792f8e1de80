"""Fused RMSNorm + RoPE on one row slice of a projection output (`torch.ops.dsfuse.rmsnorm_rope`).

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

Rounding: each bf16/fp16 op is computed in fp32 and rounded to x.dtype, which is what torch does for
each elementwise op; products of two bf16/fp16 values are exact in fp32, so this is bit-exact. The
mean's summation order may differ from torch's (allowed by the numerics rules).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from dsfuse.kernels.triton_support import interpreting

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# Reference (also the CPU implementation)
# --------------------------------------------------------------------------------------------
def rmsnorm_rope_reference(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32):
    """The source's math, op by op, in torch (so the rounding is the source's)."""
    c_norm = norm_weight.shape[0]
    xf = x[:, :c_norm].float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        normed = (h * norm_weight.float()).to(x.dtype)
    else:
        normed = norm_weight * h.to(x.dtype)
    rot = x[:, c_norm:]
    if cos is None:
        return normed, rot.new_empty((x.shape[0], 0))
    if interleaved:
        half = cos.shape[-1] // 2
        c, s = cos[:, :half], sin[:, :half]
        r1, r2 = rot[:, 0::2], rot[:, 1::2]
        roped = torch.cat([r1 * c - r2 * s, r2 * c + r1 * s], dim=-1)
    else:
        half = rot.shape[-1] // 2
        rotated_half = torch.cat((-rot[:, half:], rot[:, :half]), dim=-1)
        roped = rot * cos + rotated_half * sin
    return normed, roped


def _validate(x, norm_weight, eps, cos, sin):
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
    if cos is None:
        if c_rope:
            raise ValueError(f"rmsnorm_rope: {c_rope} columns after the norm but no cos/sin")
    else:
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape != (x.shape[0], c_rope):
                raise ValueError(f"rmsnorm_rope: {name} must be [T, C_rope] = {(x.shape[0], c_rope)}, "
                                 f"got {tuple(t.shape)}")
            if t.dtype != x.dtype:
                raise TypeError(f"rmsnorm_rope: {name} dtype {t.dtype} != x dtype {x.dtype}")
            if t.device != x.device:
                raise ValueError(f"rmsnorm_rope: {name} on {t.device}, x on {x.device}")
            if c_rope > 1 and t.stride(1) != 1:
                raise ValueError(f"rmsnorm_rope: {name}'s last dim must be contiguous")
        if c_rope % 2:
            raise ValueError(f"rmsnorm_rope: rope width {c_rope} must be even")
    if norm_weight.device != x.device:
        raise ValueError(f"rmsnorm_rope: norm_weight on {norm_weight.device}, x on {x.device}")


def _check_weight_dtype(x, norm_weight, weight_in_fp32):
    if not weight_in_fp32 and norm_weight.dtype != x.dtype:
        raise TypeError(f"rmsnorm_rope: HF form needs norm_weight dtype {x.dtype} (got {norm_weight.dtype}); "
                        "a different weight dtype would promote the output")


# --------------------------------------------------------------------------------------------
# Triton kernel
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
def _rmsnorm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, normed_ptr, roped_ptr,
    T, C_NORM, HALF, eps,
    sx, scos, ssin, snorm, srope,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, WEIGHT_FP32: tl.constexpr, HAS_ROPE: tl.constexpr,
    MANUAL_BF16_RNE: tl.constexpr,
):
    """ROWS rows per program: the norm over C_NORM columns, then the rope over 2*HALF columns."""
    dtype = normed_ptr.dtype.element_ty
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)

    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < C_NORM
    ok = row_ok[:, None] & col_ok[None, :]
    xv = tl.load(x_ptr + rows64[:, None] * sx + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(xv * xv, axis=1) / C_NORM
    h = xv * tl.rsqrt(var + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if WEIGHT_FP32:
        y = h * w[None, :]
    else:
        y = _round_to(h, dtype, MANUAL_BF16_RNE) * w[None, :]
    tl.store(normed_ptr + rows64[:, None] * snorm + cols[None, :], _round_to(y, dtype, MANUAL_BF16_RNE).to(dtype),
             mask=ok)

    if HAS_ROPE:
        j = tl.arange(0, BLOCK_H)
        hok = row_ok[:, None] & (j < HALF)[None, :]
        rope_base = x_ptr + rows64[:, None] * sx + C_NORM
        if INTERLEAVED:
            a = tl.load(rope_base + 2 * j[None, :], mask=hok, other=0.0).to(tl.float32)
            b = tl.load(rope_base + 2 * j[None, :] + 1, mask=hok, other=0.0).to(tl.float32)
            c_lo = tl.load(cos_ptr + rows64[:, None] * scos + j[None, :], mask=hok, other=0.0).to(tl.float32)
            s_lo = tl.load(sin_ptr + rows64[:, None] * ssin + j[None, :], mask=hok, other=0.0).to(tl.float32)
            c_hi = c_lo
            s_hi = s_lo
        else:
            a = tl.load(rope_base + j[None, :], mask=hok, other=0.0).to(tl.float32)
            b = tl.load(rope_base + HALF + j[None, :], mask=hok, other=0.0).to(tl.float32)
            c_lo = tl.load(cos_ptr + rows64[:, None] * scos + j[None, :], mask=hok, other=0.0).to(tl.float32)
            s_lo = tl.load(sin_ptr + rows64[:, None] * ssin + j[None, :], mask=hok, other=0.0).to(tl.float32)
            c_hi = tl.load(cos_ptr + rows64[:, None] * scos + HALF + j[None, :], mask=hok,
                           other=0.0).to(tl.float32)
            s_hi = tl.load(sin_ptr + rows64[:, None] * ssin + HALF + j[None, :], mask=hok,
                           other=0.0).to(tl.float32)
        # each product and each sum rounded to the input dtype, as torch's elementwise ops do
        ac = _round_to(a * c_lo, dtype, MANUAL_BF16_RNE)
        bs = _round_to(b * s_lo, dtype, MANUAL_BF16_RNE)
        bc = _round_to(b * c_hi, dtype, MANUAL_BF16_RNE)
        as_ = _round_to(a * s_hi, dtype, MANUAL_BF16_RNE)
        lo = _round_to(ac - bs, dtype, MANUAL_BF16_RNE).to(dtype)
        hi = _round_to(bc + as_, dtype, MANUAL_BF16_RNE).to(dtype)
        out_base = roped_ptr + rows64[:, None] * srope
        tl.store(out_base + j[None, :], lo, mask=hok)
        tl.store(out_base + HALF + j[None, :], hi, mask=hok)


def default_rows(c_norm):
    """Rows per program: enough that a program moves a few KiB, at most 8."""
    return max(1, min(8, 4096 // triton.next_power_of_2(c_norm)))


def rmsnorm_rope_triton(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32, rows_per_program=None):
    """Triton launcher (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); one launch, no host sync."""
    _validate(x, norm_weight, eps, cos, sin)
    _check_weight_dtype(x, norm_weight, weight_in_fp32)
    T, width = x.shape
    c_norm = norm_weight.shape[0]
    c_rope = width - c_norm
    normed = torch.empty((T, c_norm), dtype=x.dtype, device=x.device)
    roped = torch.empty((T, c_rope), dtype=x.dtype, device=x.device)
    if T == 0:
        return normed, roped
    rows = rows_per_program or default_rows(c_norm)
    has_rope = c_rope > 0
    cos_arg = cos if has_rope else x
    sin_arg = sin if has_rope else x
    half = c_rope // 2
    block_n = triton.next_power_of_2(c_norm)
    _rmsnorm_rope_kernel[(triton.cdiv(T, rows),)](
        x, norm_weight, cos_arg, sin_arg, normed, roped,
        T, c_norm, half, float(eps),
        x.stride(0), cos_arg.stride(0), sin_arg.stride(0), normed.stride(0), max(1, roped.stride(0)),
        ROWS=rows, BLOCK_N=block_n, BLOCK_H=triton.next_power_of_2(max(half, 1)),
        INTERLEAVED=bool(interleaved), WEIGHT_FP32=bool(weight_in_fp32), HAS_ROPE=has_rope,
        MANUAL_BF16_RNE=interpreting() and x.dtype == torch.bfloat16,
        num_warps=4 if block_n * rows <= 4096 else 8)
    return normed, roped


# --------------------------------------------------------------------------------------------
# Custom op
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("dsfuse::rmsnorm_rope", mutates_args=())
def rmsnorm_rope(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: Optional[torch.Tensor],
                 sin: Optional[torch.Tensor], interleaved: bool,
                 weight_in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed [T, C_norm], roped [T, C_rope]) in x's dtype (reference math on CPU)."""
    _validate(x, norm_weight, eps, cos, sin)
    _check_weight_dtype(x, norm_weight, weight_in_fp32)
    normed, roped = rmsnorm_rope_reference(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32)
    return normed.contiguous(), roped.contiguous()


@rmsnorm_rope.register_fake
def _rmsnorm_rope_fake(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32):
    _validate(x, norm_weight, eps, cos, sin)
    _check_weight_dtype(x, norm_weight, weight_in_fp32)
    T, width = x.shape
    c_norm = norm_weight.shape[0]
    return x.new_empty((T, c_norm)), x.new_empty((T, width - c_norm))


@rmsnorm_rope.register_kernel("cuda")
def _rmsnorm_rope_cuda(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32):
    return rmsnorm_rope_triton(x, norm_weight, eps, cos, sin, interleaved, weight_in_fp32)


def bytes_moved(T, c_norm, c_rope, itemsize, cos_itemsize=None):
    """HBM traffic: read x, cos, sin (full tables; the interleaved form needs only their first halves) and
    the weight, write both outputs."""
    cos_itemsize = cos_itemsize or itemsize
    return T * (c_norm + c_rope) * itemsize * 2 + 2 * T * c_rope * cos_itemsize + c_norm * itemsize


__all__ = ["bytes_moved", "default_rows", "rmsnorm_rope", "rmsnorm_rope_reference", "rmsnorm_rope_triton"]
