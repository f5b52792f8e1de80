"""DeepSeek V4's KV compressors (HF `DeepseekV4CSACompressor`, `DeepseekV4HCACompressor` and the CSA indexer's
own compressor) as one custom op, from the projections' outputs to the roped compressed entries:

`torch.ops.dsfuse.kv_compress(kv, gate, position_bias, norm_weight, cos, sin, eps, overlap, div_sqrt=False,
exp_log_softmax=False) -> [B, W, D]`, kv and gate the `kv_proj` / `gate_proj` outputs viewed as W windows of m
tokens, [B, W, m, C]:

    g        = gate + position_bias                                  (torch's promotion: fp32 for HF's fp32 bias)
    overlap (CSA, C = 2D): slots [0, m) of window w are window w-1's first channel half (none for w = 0: kv 0,
             gate -inf), slots [m, 2m) window w's second half; without overlap (HCA, C = D) the m slots of w
    pooled   = (kv * softmax(g, slots, fp32).to(kv.dtype)).sum(slots)          (product and sum in kv's dtype)
    normed   = (norm_weight * (p * rsqrt(mean(p^2) + eps))).to(kv.dtype),  p = pooled.float()
               (div_sqrt: p / sqrt(mean(p^2) + eps), a division that rounds otherwise than the rsqrt product)
    out      = cat([normed[..., :-R], rope(normed[..., -R:])]),  R = 2 * cos.shape[-1]
    rope(r)  = (r.float() * c + rotate_half(r).float() * s).to(kv.dtype),  c, s = cos / sin repeated twice
               (interleaved pairs (2i, 2i + 1): rotate_half(r) = (-r[2i+1], r[2i]))

exp_log_softmax: the weights are exp(log_softmax(g)) = exp((g - max) - log(sum(exp(g - max)))), which rounds
otherwise than softmax's exp(g - max) / sum. cos / sin [B, W, R/2] are the tables at the windows' positions,
computed outside (HF's `DeepseekV4RotaryEmbedding` at `i * m + first_window_position`). The reference below is HF's
code op by op (also the CPU implementation).

Kernel design: one program per window, the whole head (D channels) in registers. The softmax runs per channel
over the window's slots, in three passes over slot chunks of BLOCK_L (max, sum of exp, then the normalised weights
rounded to kv's dtype, the rounded products summed in fp32), so every value is rounded where torch rounds it and
an HCA window of 128 slots never has to fit in registers; gate chunks are re-read from L1/L2. RMSNorm and the
interleaved RoPE follow on the pooled row in registers (pairs split with `tl.reshape` + `tl.split`), one store of
the entry. No dot products: nothing the interpreter mis-computes. Compiled without fp fusion (`COMPILE_OPTIONS`)
so no product's rounding is folded into an FMA; divisions and the division form's sqrt are IEEE (`tl.div_rn`,
`tl.sqrt_rn`), and exp and log are libdevice's on the GPU, as torch's softmax and log_softmax compute them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse.kernels.norm_rope_quant import COMPILE_OPTIONS, _over_rms, _rms_scale, _round_to
from dsfuse.kernels.triton_math import exp_as_torch, log_as_torch
from dsfuse.kernels.triton_support import direct_kernel, interpreting, next_power_of_2

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# Reference (also the CPU implementation): HF's compressor code, op by op
# --------------------------------------------------------------------------------------------
def _rotate_half_interleaved(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def interleaved_rope(rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF V4's RoPE of `rope` over interleaved pairs, in fp32, rounded to rope's dtype; cos / sin one column per
    pair, broadcast over rope's leading dims. The op's RoPE, and what the pass proves a spelling computes."""
    c, s = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    return ((rope.float() * c) + (_rotate_half_interleaved(rope).float() * s)).to(rope.dtype)


def window_slots(kv: torch.Tensor, gate: torch.Tensor, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv, gate) laid out as [B, W, slots, D]: the two overlapping series of CSA, or HCA's windows as they are."""
    if not overlap:
        return kv, gate
    B, W, m, C = kv.shape
    D = C // 2
    slot_kv = kv.new_zeros((B, W, 2 * m, D))
    slot_gate = gate.new_full((B, W, 2 * m, D), float("-inf"))
    slot_kv[:, :, m:] = kv[..., D:]
    slot_gate[:, :, m:] = gate[..., D:]
    if W > 1:
        slot_kv[:, 1:, :m] = kv[:, :-1, :, :D]
        slot_gate[:, 1:, :m] = gate[:, :-1, :, :D]
    return slot_kv, slot_gate


def kv_compress_reference(kv, gate, position_bias, norm_weight, cos, sin, eps: float, overlap: bool,
                          div_sqrt: bool = False, exp_log_softmax: bool = False) -> torch.Tensor:
    slot_kv, slot_gate = window_slots(kv, gate + position_bias, overlap)
    if exp_log_softmax:
        weights = torch.exp(torch.log_softmax(slot_gate, dim=2, dtype=torch.float32))
    else:
        weights = slot_gate.softmax(dim=2, dtype=torch.float32)
    pooled = (slot_kv * weights.to(slot_kv.dtype)).sum(dim=2)
    x = pooled.to(torch.float32)
    mean_square = x.pow(2).mean(-1, keepdim=True) + eps
    x = x / torch.sqrt(mean_square) if div_sqrt else x * torch.rsqrt(mean_square)
    normed = (norm_weight * x).to(pooled.dtype)
    rope_dim = 2 * cos.shape[-1]
    return torch.cat([normed[..., :-rope_dim], interleaved_rope(normed[..., -rope_dim:], cos, sin)], dim=-1)


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------
def _validate(kv, gate, position_bias, norm_weight, cos, sin, eps, overlap, div_sqrt=False, exp_log_softmax=False
              ) -> None:
    op = "dsfuse::kv_compress"
    named = {"kv": kv, "gate": gate, "position_bias": position_bias, "norm_weight": norm_weight, "cos": cos,
             "sin": sin}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be bf16, fp16 or fp32, got {t.dtype}")
        if t.device != kv.device:
            raise ValueError(f"{op}: {name} is on {t.device}, kv on {kv.device}")
    if kv.dim() != 4:
        raise ValueError(f"{op}: kv must be [B, windows, m, C], got shape {tuple(kv.shape)}")
    if gate.shape != kv.shape:
        raise ValueError(f"{op}: gate shape {tuple(gate.shape)} differs from kv's {tuple(kv.shape)}")
    B, W, m, C = kv.shape
    if tuple(position_bias.shape) != (m, C):
        raise ValueError(f"{op}: position_bias must be [m={m}, C={C}], got {tuple(position_bias.shape)}")
    if overlap and C % 2:
        raise ValueError(f"{op}: overlapping windows need an even channel count (two series), got C={C}")
    D = C // 2 if overlap else C
    if tuple(norm_weight.shape) != (D,):
        raise ValueError(f"{op}: norm_weight must be [D={D}], got {tuple(norm_weight.shape)}")
    if cos.dim() != 3 or tuple(cos.shape[:2]) != (B, W) or sin.shape != cos.shape:
        raise ValueError(f"{op}: cos and sin must both be [B={B}, windows={W}, R/2], got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    rope = 2 * cos.shape[-1]
    if rope == 0 or rope > D or (D - rope) % 2:
        raise ValueError(f"{op}: RoPE width {rope} must be in (0, D={D}] and leave an even number of leading channels")
    if not isinstance(eps, float) or not eps >= 0.0:
        raise ValueError(f"{op}: eps must be a finite float >= 0, got {eps!r}")
    for name, flag in {"overlap": overlap, "div_sqrt": div_sqrt, "exp_log_softmax": exp_log_softmax}.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {type(flag).__name__}")


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _slot_chunk(kv_ptr, gate_ptr, bias_ptr, b, w, l0, d, d_ok, s_kb, s_kw, s_km, s_kc, s_gb, s_gw, s_gm, s_gc,
                s_pm, s_pc, M, D, GATE_DT: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_L: tl.constexpr,
                GATE_RNE: tl.constexpr):
    """(gate + bias, kv) of slots [l0, l0 + BLOCK_L) of window (b, w), [BLOCK_L, BLOCK_D] fp32: -inf / 0 where a
    slot has no token (window 0's first half, slots past the window), 0 / 0 in the padding channels."""
    slot = l0 + tl.arange(0, BLOCK_L)
    L = 2 * M if OVERLAP else M
    if OVERLAP:
        first = slot < M
        token = tl.where(first, slot, slot - M)
        window = tl.where(first, w - 1, w)
        channel = tl.where(first, 0, D)
        present = (slot < L) & (window >= 0)
    else:
        token = slot
        window = tl.zeros([BLOCK_L], tl.int32) + w
        channel = tl.zeros([BLOCK_L], tl.int32)
        present = slot < L
    ok = present[:, None] & d_ok[None, :]
    ch = channel[:, None] + d[None, :]
    window64 = window.to(tl.int64)
    g = tl.load(gate_ptr + b * s_gb + window64[:, None] * s_gw + token[:, None] * s_gm + ch * s_gc, mask=ok,
                other=0.0).to(tl.float32)
    g = g + tl.load(bias_ptr + token[:, None] * s_pm + ch * s_pc, mask=ok, other=0.0).to(tl.float32)
    g = _round_to(g, GATE_DT, GATE_RNE)
    g = tl.where(ok, g, tl.where(d_ok[None, :], float("-inf"), 0.0))
    kv = tl.load(kv_ptr + b * s_kb + window64[:, None] * s_kw + token[:, None] * s_km + ch * s_kc, mask=ok,
                 other=0.0).to(tl.float32)
    return g, kv


@triton.jit
def _kv_compress_kernel(
    kv_ptr, gate_ptr, bias_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr,
    W, M, D, R, eps,
    s_kb, s_kw, s_km, s_kc, s_gb, s_gw, s_gm, s_gc, s_pm, s_pc, s_cb, s_cw, s_cr, s_sb, s_sw, s_sr,
    GATE_DT: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    ACCURATE_EXP: tl.constexpr, KV_RNE: tl.constexpr, GATE_RNE: tl.constexpr, DIV_SQRT: tl.constexpr,
    EXP_LOG_SOFTMAX: tl.constexpr,
):
    """KV_RNE / GATE_RNE: round to bf16 by hand (the interpreter's fp32 -> bf16 cast truncates). DIV_SQRT,
    EXP_LOG_SOFTMAX: the op's `div_sqrt`, `exp_log_softmax` roundings."""
    pid = tl.program_id(0)
    b = (pid // W).to(tl.int64)
    w = pid % W
    KV_DT: tl.constexpr = out_ptr.dtype.element_ty
    L = 2 * M if OVERLAP else M
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    peak = tl.full([BLOCK_D], float("-inf"), tl.float32)
    for l0 in range(0, L, BLOCK_L):
        g, kv = _slot_chunk(kv_ptr, gate_ptr, bias_ptr, b, w, l0, d, d_ok, s_kb, s_kw, s_km, s_kc, s_gb, s_gw, s_gm,
                            s_gc, s_pm, s_pc, M, D, GATE_DT, OVERLAP, BLOCK_L, GATE_RNE)
        peak = tl.maximum(peak, tl.max(g, axis=0))
    total = tl.zeros([BLOCK_D], tl.float32)
    for l0 in range(0, L, BLOCK_L):
        g, kv = _slot_chunk(kv_ptr, gate_ptr, bias_ptr, b, w, l0, d, d_ok, s_kb, s_kw, s_km, s_kc, s_gb, s_gw, s_gm,
                            s_gc, s_pm, s_pc, M, D, GATE_DT, OVERLAP, BLOCK_L, GATE_RNE)
        total += tl.sum(exp_as_torch(g - peak[None, :], ACCURATE_EXP), axis=0)
    log_total = log_as_torch(total, ACCURATE_EXP)
    pooled = tl.zeros([BLOCK_D], tl.float32)
    for l0 in range(0, L, BLOCK_L):
        g, kv = _slot_chunk(kv_ptr, gate_ptr, bias_ptr, b, w, l0, d, d_ok, s_kb, s_kw, s_km, s_kc, s_gb, s_gw, s_gm,
                            s_gc, s_pm, s_pc, M, D, GATE_DT, OVERLAP, BLOCK_L, GATE_RNE)
        if EXP_LOG_SOFTMAX:
            p = exp_as_torch((g - peak[None, :]) - log_total[None, :], ACCURATE_EXP)
        else:
            p = tl.div_rn(exp_as_torch(g - peak[None, :], ACCURATE_EXP), total[None, :])
        p = _round_to(p, KV_DT, KV_RNE)
        pooled += tl.sum(_round_to(kv * p, KV_DT, KV_RNE), axis=0)
    pooled = tl.where(d_ok, _round_to(pooled, KV_DT, KV_RNE), 0.0)

    variance = tl.div_rn(tl.sum(pooled * pooled, axis=0), D.to(tl.float32))
    h = _over_rms(pooled, _rms_scale(variance + eps, DIV_SQRT), DIV_SQRT)
    weight = tl.load(weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    normed = _round_to(weight * h, KV_DT, KV_RNE)

    even, odd = tl.split(tl.reshape(normed, [BLOCK_D // 2, 2]))
    pair = tl.arange(0, BLOCK_D // 2)
    first_rope_pair = (D - R) // 2
    is_rope = (pair >= first_rope_pair) & (pair < D // 2)
    i = tl.where(is_rope, pair - first_rope_pair, 0)
    c = tl.load(cos_ptr + b * s_cb + w * s_cw + i * s_cr, mask=is_rope, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + b * s_sb + w * s_sw + i * s_sr, mask=is_rope, other=0.0).to(tl.float32)
    new_even = tl.where(is_rope, _round_to(even * c + (-odd) * s, KV_DT, KV_RNE), even)
    new_odd = tl.where(is_rope, _round_to(odd * c + even * s, KV_DT, KV_RNE), odd)
    out = tl.reshape(tl.join(new_even, new_odd), [BLOCK_D])
    tl.store(out_ptr + (b * W + w) * D + d, out.to(KV_DT), mask=d_ok)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def default_launch(D: int, slots: int) -> dict[str, int]:
    """Slot chunk and warps: a [BLOCK_L, BLOCK_D] fp32 tile of about 8K elements over the warps."""
    block_d = next_power_of_2(max(D, 2))
    block_l = max(1, min(next_power_of_2(slots), 8192 // block_d))
    return {"block_l": block_l, "num_warps": 8 if block_d >= 512 else 4}


def kv_compress_triton(kv, gate, position_bias, norm_weight, cos, sin, eps: float, overlap: bool,
                       div_sqrt: bool = False, exp_log_softmax: bool = False, block_l: int | None = None,
                       num_warps: int | None = None) -> torch.Tensor:
    """One launch of `kv_compress` (launch overrides: block_l, num_warps); any strides."""
    _validate(kv, gate, position_bias, norm_weight, cos, sin, eps, overlap, div_sqrt, exp_log_softmax)
    B, W, m, C = kv.shape
    D = C // 2 if overlap else C
    out = torch.empty((B, W, D), dtype=kv.dtype, device=kv.device)
    if B * W == 0:
        return out
    gate_dtype = torch.result_type(gate, position_bias)
    defaults = default_launch(D, 2 * m if overlap else m)
    _kv_compress_kernel[(B * W,)](
        kv, gate, position_bias, norm_weight, cos, sin, out, W, m, D, 2 * cos.shape[-1], float(eps),
        *kv.stride(), *gate.stride(), *position_bias.stride(), *cos.stride(), *sin.stride(),
        GATE_DT=_TL_DTYPES[gate_dtype], OVERLAP=bool(overlap), BLOCK_L=block_l or defaults["block_l"],
        BLOCK_D=next_power_of_2(max(D, 2)), ACCURATE_EXP=not interpreting(),
        KV_RNE=interpreting() and kv.dtype == torch.bfloat16,
        GATE_RNE=interpreting() and gate_dtype == torch.bfloat16, DIV_SQRT=bool(div_sqrt),
        EXP_LOG_SOFTMAX=bool(exp_log_softmax), num_warps=num_warps or defaults["num_warps"], **COMPILE_OPTIONS)
    return out


def bytes_moved(B: int, S: int, C: int, D: int, m: int, dtype: torch.dtype) -> int:
    """The bytes a compressor must move at least: kv and gate once each, the entries written once."""
    size = torch.finfo(dtype).bits // 8
    return 2 * B * S * C * size + B * (S // m) * D * size


# --------------------------------------------------------------------------------------------
# Custom op
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("dsfuse::kv_compress", mutates_args=())
def kv_compress(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, norm_weight: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, eps: float, overlap: bool, div_sqrt: bool = False,
                exp_log_softmax: bool = False) -> torch.Tensor:
    """The compressed entries [B, W, D] in kv's dtype of W windows (see the module docstring). Reference math on
    CPU."""
    _validate(kv, gate, position_bias, norm_weight, cos, sin, eps, overlap, div_sqrt, exp_log_softmax)
    return kv_compress_reference(kv, gate, position_bias, norm_weight, cos, sin, eps, overlap, div_sqrt,
                                 exp_log_softmax).contiguous()


@kv_compress.register_fake
def _kv_compress_fake(kv, gate, position_bias, norm_weight, cos, sin, eps, overlap, div_sqrt=False,
                      exp_log_softmax=False):
    _validate(kv, gate, position_bias, norm_weight, cos, sin, eps, overlap, div_sqrt, exp_log_softmax)
    B, W, _, C = kv.shape
    return kv.new_empty((B, W, C // 2 if overlap else C))


@direct_kernel(kv_compress)
def _kv_compress_cuda(kv, gate, position_bias, norm_weight, cos, sin, eps, overlap, div_sqrt=False,
                      exp_log_softmax=False):
    return kv_compress_triton(kv, gate, position_bias, norm_weight, cos, sin, eps, overlap, div_sqrt,
                              exp_log_softmax)


__all__ = ["bytes_moved", "default_launch", "interleaved_rope", "kv_compress", "kv_compress_reference",
           "kv_compress_triton", "window_slots"]
