"""Block-scaled FP8 linears, plain and grouped by expert: what transformers' `FP8Linear`, `FP8GroupedLinear` and
`FP8Experts` compute for a released DeepSeek V3.2 / GLM-5 (FP8 weights, 128 x 128 block scales) or V4-Flash (FP8
linears, FP4 experts) checkpoint, as dsfuse ops that need neither the `kernels` package nor a download.

    q, s     = fp8 per token and per 128 channels (`quant_formats.quantize_activations`; powers of two when the
               weight scales are UE8M0, as the checkpoint's `scale_fmt` says)
    y[m, n]  = sum over channel groups g of (q[m, g] . w[n, g]) * (s[m, g] * s_w(n, g))   (fp32, g in order)
    out      = y rounded to x's dtype

`s_w(n, g)` is the weight's block scale (FP8: one per `block_n` x `block_k` block) or, for FP4 weights, applied per
32 channels inside the group: (q[m, g] . w[n, g]) becomes sum over the group's four 32-channel parts of (q . w_e2m1)
* 2^(e8m0 - 127). Every product of an e4m3 and an e4m3 or e2m1 value is exact in fp32, so the kernels agree with the
reference up to the summation order inside a group.

Ops:
- `dsfuse::fp8_linear(x [..., K], weight, weight_scale, block_n, block_k) -> [..., N]`: weight `[N, K]` e4m3 with
  scales `[ceil(N / block_n), ceil(K / block_k)]` fp32 or E8M0, or FP4 `[N, K / 2]` bytes with E8M0 scales
  `[N, K / 32]`.
- `dsfuse::fp8_grouped_linear(x [S, K], weight [E, ...], weight_scale [E, ...], offsets [E], block_n, block_k)
  -> [S, N]`: rows `offsets[e-1]:offsets[e]` through expert e (rows sorted by expert; `offsets` the running total of
  rows per expert, as transformers passes it); rows past `offsets[-1]` are zero.
- `dsfuse::fp8_linears(x [..., K], weights, weight_scales, block_ns, block_k) -> [[..., N_i]]`: exactly
  `[fp8_linear(x, w, s, bn, block_k) for w, s, bn in zip(weights, weight_scales, block_ns)]` (a block height per
  weight: a per-tensor scale is one block of the weight's N rows; the activations' quantisation reads only
  `block_k`), for projections that read the
  same activations (a layer's q_a / kv_a / indexer wk, q_b / indexer wq_b, an MLP's gate / up): e4m3 weights of one
  K, all with fp32 or all with E8M0 scales, so that one activation quantisation serves every GEMM.

CUDA: activations are quantised by one Triton kernel, then multiplied by `_fp8_gemm_kernel` (grouped or not: a
list of row tiles, each of one expert, computed on the device without a host sync), by `_fp8_decode_kernel` up to
DECODE_MAX_ROWS rows (the weight streamed as the MMA's first operand, every row in one tile; row tiles of up to 16
rows quantise their activations in it, the same arithmetic in one launch fewer), by `_fp4_gemm_kernel`
for FP4 weights (row tiles sized by an expert's rows; decode-sized calls with wider tiles), or, for FP8 weights at
`M >= SCALED_MM_MIN_ROWS`, by
cuBLAS's block-scaled FP8 GEMM (`torch._scaled_mm`), faster where the GEMM is compute-bound. Where the programs of
the output tiles alone would leave SMs idle, the channel groups are split; the last split program of a tile to finish
sums the fp32 partials in split order (no second launch).
`fp8_linears` quantises x once for all its GEMMs (cuBLAS's and the Triton GEMM's alike read the one padded (q, s));
at decode sizes, where each kernel quantises its few rows itself, it is one `fp8_linear` call per weight.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsfuse.kernels.quant_formats import (FP4_BLOCK, FP8_AMAX_FLOOR, FP8_DTYPE, FP8_INV_MAX, FP8_MAX,
                                          check_fp8_weight, dequantize_fp4, dequantize_fp8_blocks, e4m3_bits,
                                          e8m0_to_float, is_e8m0, power_of_two_ceil, quantize_activations,
                                          round_to_e4m3_grid, scales_to_float32)
from dsfuse.kernels.moe_experts import scale_tile, swiglu_rounded, weight_tile
from dsfuse.kernels.triton_support import cdiv, direct_kernel, interpreting, next_power_of_2

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# From this many rows up, FP8 weights go to cuBLAS (`torch._scaled_mm` with 1x128 / 128x128 block scales), which
# refuses a single row and is slower than a weight-streaming kernel while the GEMM is bound by the weight bytes.
SCALED_MM_MIN_ROWS = 128
# K step of the FP4 GEMM: the decoded tile in registers stays small enough for several CTAs per SM (as moe_experts');
# 256-row tiles take steps of 128 (`_tile_config`)
FP4_BLOCK_K = 64
_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_INV_MAX = tl.constexpr(FP8_INV_MAX)
_AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)


def _is_fp4(weight: torch.Tensor) -> bool:
    return weight.dtype in (torch.int8, torch.uint8)


def weight_dims(weight: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a weight `[..., N, K]` e4m3 or FP4 `[..., N, K / 2]`."""
    N, width = weight.shape[-2:]
    return N, width * 2 if _is_fp4(weight) else width


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """The weight's exact values in fp32."""
    if _is_fp4(weight):
        return dequantize_fp4(weight, scale, torch.float32)
    return dequantize_fp8_blocks(weight, scale, block_n, block_k)


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------
def _check_weight(op, weight, scale, block_n, block_k, experts=None):
    """(N, K) of an e4m3 weight (checked by `check_fp8_weight`, block_k a multiple of 16 for the GEMMs' K steps) or
    an FP4 one with its E8M0 scales, `[N, K]` or, with `experts`, `[experts, N, K]`."""
    lead = () if experts is None else (experts,)
    rank = 2 + len(lead)
    if weight.dim() != rank or scale.dim() != rank:
        raise ValueError(f"{op}: weight and weight_scale must be {rank}-D, got {tuple(weight.shape)} and "
                         f"{tuple(scale.shape)}")
    N, K = weight_dims(weight)
    if K < 1:
        raise ValueError(f"{op}: the weight {tuple(weight.shape)} has no input channels (K = 0)")
    if not _is_fp4(weight):
        if weight.dtype != FP8_DTYPE:
            raise TypeError(f"{op}: weight must be float8_e4m3fn or FP4 bytes (int8 / uint8), got {weight.dtype}")
        check_fp8_weight(op, weight, scale, block_n, block_k, lead=lead, block_k_multiple=16)
        return N, K
    if block_k % FP4_BLOCK or K % FP4_BLOCK:
        raise ValueError(f"{op}: FP4 weights need K ({K}) and block_k ({block_k}) multiples of {FP4_BLOCK}")
    want = (*lead, N, K // FP4_BLOCK)
    if tuple(scale.shape) != want:
        raise ValueError(f"{op}: weight_scale must be {list(want)} for weight {tuple(weight.shape)} with blocks "
                         f"[{block_n}, {block_k}], got {tuple(scale.shape)}")
    if not (is_e8m0(scale) or scale.dtype == torch.uint8):
        raise TypeError(f"{op}: weight_scale must be E8M0, got {scale.dtype}")
    if block_n < 1 or block_k < 1 or block_k % 16:
        raise ValueError(f"{op}: block_n and block_k must be positive with block_k a multiple of 16, got "
                         f"[{block_n}, {block_k}]")
    return N, K


def _check_input(op, x, K, tensors):
    if x.dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: x must be one of {OUT_DTYPES}, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"{op}: x {tuple(x.shape)} must end in K = {K}")
    for t in tensors:
        if t.device != x.device:
            raise ValueError(f"{op}: all inputs must be on {x.device}, found {t.device}")


def _check_linear(x, weight, scale, block_n, block_k):
    N, K = _check_weight("fp8_linear", weight, scale, block_n, block_k)
    _check_input("fp8_linear", x, K, (weight, scale))
    return N, K


def _check_grouped(x, weight, scale, offsets, block_n, block_k):
    op = "fp8_grouped_linear"
    if weight.dim() != 3:
        raise ValueError(f"{op}: weight must be [E, N, K] (FP4: [E, N, K / 2]), got {tuple(weight.shape)}")
    E = weight.shape[0]
    N, K = _check_weight(op, weight, scale, block_n, block_k, experts=E)
    _check_input(op, x, K, (weight, scale, offsets))
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [S, K], got {tuple(x.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] != E or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: offsets must be [E = {E}] int32 / int64 running row totals, got "
                         f"{offsets.dtype}{list(offsets.shape)}")
    return E, N, K


def _check_linears(x, weights, scales, block_ns, block_k):
    """The widths N of `fp8_linears`' weights, and their common K: e4m3 weights only (FP4 weights quantise their
    activations otherwise), scales all fp32 or all E8M0 (one activation quantisation), one K."""
    op = "fp8_linears"
    if not all(isinstance(given, (list, tuple)) for given in (weights, scales, block_ns)):
        raise TypeError(f"{op}: weights, weight_scales and block_ns must be lists")
    if not weights:
        raise ValueError(f"{op}: weights is empty (at least one weight)")
    for name, given in (("weight_scales", scales), ("block_ns", block_ns)):
        if len(given) != len(weights):
            raise ValueError(f"{op}: {name} has {len(given)} entries for {len(weights)} weights")
    widths, Ks = [], []
    for i, (weight, scale, block_n) in enumerate(zip(weights, scales, block_ns)):
        if _is_fp4(weight):
            raise TypeError(f"{op}: weights[{i}] is FP4 ({weight.dtype}); the op takes float8_e4m3fn weights only "
                            f"(FP4 weights read their activations dequantised, not as e4m3 and scales)")
        N, K = _check_weight(f"{op}: weights[{i}] / weight_scales[{i}]", weight, scale, block_n, block_k)
        widths.append(N)
        Ks.append(K)
    kinds = ["E8M0" if is_e8m0(scale) else "float32" for scale in scales]
    if len(set(kinds)) > 1:
        other = next(i for i, kind in enumerate(kinds) if kind != kinds[0])
        raise TypeError(f"{op}: weight_scales mix {kinds[0]} (weight_scales[0]) and {kinds[other]} "
                        f"(weight_scales[{other}]); one activation quantisation needs one scale kind")
    other = next((i for i, K in enumerate(Ks) if K != Ks[0]), None)
    if other is not None:
        raise ValueError(f"{op}: weights[{other}] has K = {Ks[other]}, weights[0] K = {Ks[0]}; every weight must "
                         f"read the same K channels")
    _check_input(op, x, Ks[0], (*weights, *scales))
    return widths, Ks[0]


# --------------------------------------------------------------------------------------------
# Reference (also the CPU implementation)
# --------------------------------------------------------------------------------------------
def _group_scales(weight, scale, block_n, block_k, N, K):
    """The weight's scale per (row, channel group of block_k) [N, G], or None for FP4 (scaled per 32 inside)."""
    if _is_fp4(weight):
        return None
    return scales_to_float32(scale).repeat_interleave(block_n, dim=0)[:N]


def _linear_math(x2, weight, scale, block_n, block_k):
    N, K = weight_dims(weight)
    q, s = quantize_activations(x2, block_k, pow2=is_e8m0(scale) or _is_fp4(weight))
    w = dequantize_weight(weight, scale, block_n, block_k) if _is_fp4(weight) else weight.float()
    w_scale = _group_scales(weight, scale, block_n, block_k, N, K)
    acc = torch.zeros((x2.shape[0], N), dtype=torch.float32, device=x2.device)
    for g in range(s.shape[1]):
        cols = slice(g * block_k, min(K, (g + 1) * block_k))
        part = q[:, cols].float() @ w[:, cols].t()
        both = s[:, g, None] if w_scale is None else s[:, g, None] * w_scale[None, :, g]
        acc += part * both
    return acc


def fp8_linear_reference(x, weight, weight_scale, block_n, block_k):
    N, _ = _check_linear(x, weight, weight_scale, block_n, block_k)
    x2 = x.reshape(-1, x.shape[-1])
    return _linear_math(x2, weight, weight_scale, block_n, block_k).to(x.dtype).view(*x.shape[:-1], N)


def fp8_grouped_linear_reference(x, weight, weight_scale, offsets, block_n, block_k):
    E, N, _ = _check_grouped(x, weight, weight_scale, offsets, block_n, block_k)
    out = x.new_zeros((x.shape[0], N))
    start = 0
    for e, end in enumerate(offsets.tolist()):
        end = min(max(end, start), x.shape[0])
        if end > start:
            out[start:end] = _linear_math(x[start:end], weight[e], weight_scale[e], block_n, block_k).to(x.dtype)
        start = end
    return out


def fp8_linears_reference(x, weights, weight_scales, block_ns, block_k):
    _check_linears(x, weights, weight_scales, block_ns, block_k)
    return [fp8_linear_reference(x, w, s, bn, block_k) for w, s, bn in zip(weights, weight_scales, block_ns)]


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _quantize_rows(x, POW2: tl.constexpr):
    """x [rows, channels] fp32 -> (x / scale clamped to +-448, still to be rounded to e4m3; scale per row) as
    `quantize_activations` computes them (an fp32 multiply by fp32(1 / 448), an IEEE reciprocal)."""
    nan_rows = tl.max((x != x).to(tl.int32), axis=1) > 0  # a GPU max reduction skips NaN; torch's amax keeps it
    amax = tl.where(nan_rows, float("nan"), tl.max(tl.abs(x), axis=1))
    scale = tl.maximum(amax, _AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL) * _FP8_INV_MAX
    if POW2:
        scale = tl.where(scale != scale, scale, power_of_two_ceil(scale))
    q = tl.maximum(x * tl.div_rn(1.0, scale)[:, None], -_FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    q = tl.minimum(q, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return q, scale


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, rows_out, K, sx_m, sx_k, ss_m, ss_g, up_offset,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, POW2: tl.constexpr, MANUAL_FP8_RNE: tl.constexpr,
                      DEQUANTIZED: tl.constexpr, SWIGLU: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
                      ACCURATE: tl.constexpr):
    """Rows [BLOCK_R] x one channel group [BLOCK_K]: the group's scale and its e4m3 values (q is [rows_out, K]
    contiguous), rounded as `quantize_activations` rounds (an fp32 multiply by fp32(1 / 448), an IEEE reciprocal).
    With DEQUANTIZED, q holds value * scale instead (bf16: exact for power-of-two scales, the FP4 GEMM's operand).
    With SWIGLU, the rows quantised are `swiglu(x, x + up_offset)` of the gate and up halves of an expert GEMM's
    output, rounded to x's dtype as `moe_experts.swiglu` rounds them (ACCURATE, on the GPU: torch's CUDA silu's bits;
    the activation is never written).
    Rows from M to rows_out (padding a GEMM asks for) are written as rows of zeros."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    cols = g * BLOCK_K + tl.arange(0, BLOCK_K)
    at_x = x_ptr + rows[:, None].to(tl.int64) * sx_m + cols[None, :] * sx_k
    read = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(at_x, mask=read, other=0.0)
    if SWIGLU:
        up = tl.load(at_x + up_offset * sx_k, mask=read, other=0.0)
        x = swiglu_rounded(x, up, x_ptr.dtype.element_ty, SWIGLU_LIMIT, ACCURATE)
    inside = (rows[:, None] < rows_out) & (cols[None, :] < K)
    q, scale = _quantize_rows(x.to(tl.float32), POW2)
    at = q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    if DEQUANTIZED:
        values = round_to_e4m3_grid(q) if MANUAL_FP8_RNE else q.to(tl.float8e4nv).to(tl.float32)
        tl.store(at, (values * scale[:, None]).to(q_ptr.dtype.element_ty), mask=inside)
    elif MANUAL_FP8_RNE:  # the interpreter: q_ptr is q's bytes
        tl.store(at, e4m3_bits(round_to_e4m3_grid(q)), mask=inside)
    else:
        tl.store(at, q.to(tl.float8e4nv), mask=inside)
    tl.store(s_ptr + rows.to(tl.int64) * ss_m + g * ss_g, scale, mask=rows < rows_out)


@triton.jit
def _program_tile(column_block, a_ptr, w_ptr, ws_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, a_row_ptr, M, N, K,
                  num_experts, sw_e, sws_e, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATHER_A: tl.constexpr,
                  GROUPED: tl.constexpr):
    """This program's row tile and column block: (expert, output rows, which are valid, the activation row each
    reads, its pointer, output columns, which are valid, the expert's weight and scale bases). Column blocks are
    program_id(0) (`column_block`: of one weight, where a launch spans several), the fastest-varying launch index:
    the programs running at once share a row tile, whose activations then come from HBM once and from L2 for its
    other column blocks (with row tiles first, each column block re-read every activation from HBM: ~19 GB a forward
    for V4-Flash's experts at T=8192). GROUPED: row tile program_id(1) is the tile list's entry, whose expert reads
    as num_experts (nothing to do) when its first row is not before its end; otherwise it is program_id(1)'s
    BLOCK_M rows of M through expert 0 (no tile list to build or read)."""
    tile = tl.program_id(1)
    if GROUPED:
        first_row = tl.load(tile_row_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        expert = tl.where(first_row < end, tl.load(tile_expert_ptr + tile), num_experts)
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < end
    else:
        expert = tl.zeros((), tl.int32)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
    if GATHER_A:
        a_row = tl.load(a_row_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        a_row = rows.to(tl.int64)
    ns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    return (expert, rows, row_ok, a_row, a_ptr + a_row[:, None] * K, ns, ns < N, w_ptr + expert.to(tl.int64) * sw_e,
            ws_ptr + expert.to(tl.int64) * sws_e)


@triton.jit
def _fp8_gemm_kernel(q_ptr, s_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, tile_expert_ptr, tile_row_ptr,
                     tile_end_ptr, a_row_ptr, M, N, K, G, num_experts, groups_per_split,
                     ss_m, ss_g, sw_e, sw_n, sw_k, sws_e, sws_n, sws_k, so_m, so_n, splits, sp_k,
                     block_n_scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     E8M0_SCALES: tl.constexpr, SPLIT_PARTIALS: tl.constexpr, GATHER_A: tl.constexpr,
                     GROUPED: tl.constexpr):
    """One row tile (of one expert) x BLOCK_N outputs x one split of the channel groups, e4m3 weights. A group of
    BLOCK_K channels: its e4m3 MMA, then the product of both scales, added into an fp32 accumulator. The loop runs
    over computed bounds so that Triton pipelines its loads. Writes the rounded output, or the split's fp32 partial
    sums. With GATHER_A, output row r reads activation row a_row[r] (the routed experts quantise each token once
    and read it for each of its slots)."""
    split = tl.program_id(2)
    expert, rows, row_ok, a_row, a_rows, ns, n_ok, w_base, ws_base = _program_tile(
        tl.program_id(0), q_ptr, w_ptr, ws_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, a_row_ptr, M, N, K,
        num_experts, sw_e, sws_e, BLOCK_M, BLOCK_N, GATHER_A, GROUPED)
    if expert >= num_experts:
        return
    g_first = split * groups_per_split
    g_last = tl.minimum(g_first + groups_per_split, G)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(g_first, g_last):
        a_scale = tl.load(s_ptr + a_row * ss_m + g * ss_g, mask=row_ok, other=0.0)
        ks = g * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
            w = tl.load(w_base + ns[None, :].to(tl.int64) * sw_n + ks[:, None] * sw_k, mask=n_ok[None, :],
                        other=0.0)
        else:
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
            w = tl.load(w_base + ns[None, :].to(tl.int64) * sw_n + ks[:, None] * sw_k,
                        mask=n_ok[None, :] & (ks[:, None] < K), other=0.0)
        scale_at = ws_base + (ns // block_n_scale).to(tl.int64) * sws_n + g * sws_k
        if E8M0_SCALES:
            w_scale = e8m0_to_float(tl.load(scale_at, mask=n_ok, other=127))
        else:
            w_scale = tl.load(scale_at, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
    _store_tile(out_ptr, part_ptr, count_ptr, acc, rows[:, None], ns[None, :], row_ok[:, None] & n_ok[None, :], so_m,
                so_n, split, splits, sp_k, SPLIT_PARTIALS)


@triton.jit
def _store_tile(out_ptr, part_ptr, count_ptr, acc, rows, ns, mask, so_m, so_n, split, splits, sp_k,
                SPLIT_PARTIALS: tl.constexpr):
    """The tile's output, rounded. SPLIT_PARTIALS: each split stores its fp32 partial sums, then counts itself in at
    the tile's counter; the last split to arrive adds the partials in split order (so the bits do not depend on
    which one is last), rounds them once, writes the output and sets the counter back to zero for the next launch.
    The barrier and the release make every thread's partials visible before the count; the sums are read past L1."""
    at = rows.to(tl.int64) * so_m + ns * so_n
    if SPLIT_PARTIALS:
        tl.store(part_ptr + split.to(tl.int64) * sp_k + at, acc, mask=mask)
        tl.debug_barrier()
        counter = count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
            total = tl.load(part_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
            for other in range(1, splits):
                total += tl.load(part_ptr + other * sp_k + at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0, sem="relaxed")
    else:
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp4_gemm_kernel(a_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr,
                     a_row_ptr, M, N, K, num_experts, k_per_split, sw_e, sw_n, sws_e, sws_n, so_m, so_n, splits, sp_k,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_PARTIALS: tl.constexpr, GATHER_A: tl.constexpr, DECODE_ASM: tl.constexpr,
                     GROUPED: tl.constexpr):
    """FP4 weights (row-major packed bytes, E8M0 scales per 32 along K) x activations already dequantised to bf16
    (`quantize_activations_triton(..., dequantized=True)`: e4m3 value times its power-of-two scale, exact), so one
    fp32 accumulation over K serves every channel group. The weight tile is decoded in registers by `moe_experts`'
    tile decode (exact bf16; integer ops and bf16x2 multiplies with DECODE_ASM) and is the MMA's first operand, the
    activations (from shared memory) its second: acc is [outputs, rows] and is stored transposed. The scales of a
    K step are loaded one step ahead (`scale_tile`)."""
    split = tl.program_id(2)
    expert, rows, row_ok, a_row, a_rows, ns, n_ok, w_base, ws_base = _program_tile(
        tl.program_id(0), a_ptr, w_ptr, ws_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, a_row_ptr, M, N, K,
        num_experts, sw_e, sws_e, BLOCK_M, BLOCK_N, GATHER_A, GROUPED)
    if expert >= num_experts:
        return
    operand = tl.bfloat16 if DECODE_ASM else tl.float32
    k_first = split * k_per_split
    k_last = tl.minimum(k_first + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    w_scales = scale_tile(ws_base, ns, n_ok, k_first, K, sws_n, BLOCK_K, True)
    for k0 in range(k_first, k_last, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K), other=0.0).to(operand)
        w = weight_tile(w_base, w_scales, ns, n_ok, k0, K, sw_n, BLOCK_K, True, DECODE_ASM, operand)
        w_scales = scale_tile(ws_base, ns, n_ok, k0 + BLOCK_K, K, sws_n, BLOCK_K, True)
        acc = tl.dot(w, tl.trans(a), acc)
    _store_tile(out_ptr, part_ptr, count_ptr, acc, rows[None, :], ns[:, None], n_ok[:, None] & row_ok[None, :], so_m,
                so_n, split, splits, sp_k, SPLIT_PARTIALS)


@triton.jit
def _fp8_decode_kernel(q_ptr, s_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, tile_expert_ptr, tile_row_ptr,
                       tile_end_ptr, a_row_ptr, M, N, K, G, num_experts, groups_per_split,
                       ss_m, ss_g, sw_e, sw_n, sw_k, sws_e, sws_n, sws_k, so_m, so_n, splits, sp_k, sx_m, sx_k,
                       block_n_scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       E8M0_SCALES: tl.constexpr, SPLIT_PARTIALS: tl.constexpr, GATHER_A: tl.constexpr,
                       GROUPED: tl.constexpr, QUANTIZE_A: tl.constexpr, POW2: tl.constexpr,
                       MANUAL_FP8_RNE: tl.constexpr):
    """`_fp8_gemm_kernel`'s math for decode-sized row tiles, shaped to stream the weight (`_decode_program`)."""
    _decode_program(tl.program_id(0), q_ptr, s_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, tile_expert_ptr,
                    tile_row_ptr, tile_end_ptr, a_row_ptr, M, N, K, G, num_experts, groups_per_split, ss_m, ss_g,
                    sw_e, sw_n, sw_k, sws_e, sws_n, sws_k, so_m, so_n, splits, sp_k, sx_m, sx_k, block_n_scale,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, E8M0_SCALES, SPLIT_PARTIALS, GATHER_A, GROUPED, QUANTIZE_A,
                    POW2, MANUAL_FP8_RNE)


@triton.jit
def _fp8_decode_weights_kernel(x_ptr, w0_ptr, ws0_ptr, out0_ptr, part0_ptr, w1_ptr, ws1_ptr, out1_ptr, part1_ptr,
                               w2_ptr, ws2_ptr, out2_ptr, part2_ptr, count_ptr, N0, N1, N2, columns0, columns1,
                               sw0_n, sw1_n, sw2_n, sws0_n, sws1_n, sws2_n, block_n0, block_n1, block_n2, M, K, G,
                               groups_per_split, splits, sx_m, sx_k,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               EVEN_K: tl.constexpr, E8M0_SCALES: tl.constexpr, SPLIT_PARTIALS: tl.constexpr,
                               POW2: tl.constexpr, MANUAL_FP8_RNE: tl.constexpr):
    """`_fp8_decode_kernel` through two or three weights of one input in one launch (`fp8_linears` at decode sizes):
    the launch's column blocks are the first weight's, then the second's, then the third's (unread for two), each
    program `_decode_program` of its weight's, the rows quantised in the program. Weights and scales K-contiguous,
    outputs contiguous; x row-major with strides sx_m, sx_k."""
    column_block = tl.program_id(0)
    if column_block < columns0:
        _decode_program(column_block, x_ptr, x_ptr, w0_ptr, ws0_ptr, out0_ptr, part0_ptr, count_ptr, x_ptr, x_ptr,
                        x_ptr, x_ptr, M, N0, K, G, 1, groups_per_split, 0, 0, 0, sw0_n, 1, 0, sws0_n, 1, N0, 1,
                        splits, M * N0, sx_m, sx_k, block_n0, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, E8M0_SCALES,
                        SPLIT_PARTIALS, False, False, True, POW2, MANUAL_FP8_RNE)
    elif column_block < columns0 + columns1:
        _decode_program(column_block - columns0, x_ptr, x_ptr, w1_ptr, ws1_ptr, out1_ptr, part1_ptr, count_ptr,
                        x_ptr, x_ptr, x_ptr, x_ptr, M, N1, K, G, 1, groups_per_split, 0, 0, 0, sw1_n, 1, 0, sws1_n, 1,
                        N1, 1, splits, M * N1, sx_m, sx_k, block_n1, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                        E8M0_SCALES, SPLIT_PARTIALS, False, False, True, POW2, MANUAL_FP8_RNE)
    else:
        _decode_program(column_block - columns0 - columns1, x_ptr, x_ptr, w2_ptr, ws2_ptr, out2_ptr, part2_ptr,
                        count_ptr, x_ptr, x_ptr, x_ptr, x_ptr, M, N2, K, G, 1, groups_per_split, 0, 0, 0, sw2_n, 1, 0,
                        sws2_n, 1, N2, 1, splits, M * N2, sx_m, sx_k, block_n2, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                        E8M0_SCALES, SPLIT_PARTIALS, False, False, True, POW2, MANUAL_FP8_RNE)


@triton.jit
def _decode_program(column_block, q_ptr, s_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, tile_expert_ptr,
                    tile_row_ptr, tile_end_ptr, a_row_ptr, M, N, K, G, num_experts, groups_per_split,
                    ss_m, ss_g, sw_e, sw_n, sw_k, sws_e, sws_n, sws_k, so_m, so_n, splits, sp_k, sx_m, sx_k,
                    block_n_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, E8M0_SCALES: tl.constexpr, SPLIT_PARTIALS: tl.constexpr,
                    GATHER_A: tl.constexpr, GROUPED: tl.constexpr, QUANTIZE_A: tl.constexpr, POW2: tl.constexpr,
                    MANUAL_FP8_RNE: tl.constexpr):
    """One program of the decode path, column block `column_block` of its weight: the weight tile [BLOCK_N, BLOCK_K]
    is the MMA's first operand (BLOCK_N >= 64 fills its M; the few rows are its N), loaded straight into the dot so
    that Triton pipelines it, and both scales of the next channel group are loaded one group ahead (a small load
    Triton does not pipeline would otherwise wait its full latency every group). QUANTIZE_A: q_ptr is x itself
    (strides sx_m, sx_k), each group quantised in the program as `_act_quant_kernel` does (a few rows: re-reading
    them from L2 per program costs less than a launch and q's round trip), its channels loaded one group ahead as
    the scales are."""
    split = tl.program_id(2)
    expert, rows, row_ok, a_row, a_rows, ns, n_ok, w_base, ws_base = _program_tile(
        column_block, q_ptr, w_ptr, ws_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, a_row_ptr, M, N, K,
        num_experts, sw_e, sws_e, BLOCK_M, BLOCK_N, GATHER_A, GROUPED)
    if expert < num_experts:
        g_first = split * groups_per_split
        g_last = tl.minimum(g_first + groups_per_split, G)
        w_scale_rows = ws_base + (ns // block_n_scale).to(tl.int64) * sws_n
        a_scale, w_scale = _group_scales_of(s_ptr, a_row, row_ok, w_scale_rows, n_ok, g_first, ss_m, ss_g, sws_k,
                                            E8M0_SCALES, not QUANTIZE_A)
        x = _x_group(q_ptr, a_row, row_ok, g_first, K, sx_m, sx_k, BLOCK_K, QUANTIZE_A)
        w_rows = w_base + ns[:, None].to(tl.int64) * sw_n
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for g in range(g_first, g_last):
            ks = g * BLOCK_K + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :] * sw_k, mask=n_ok[:, None], other=0.0)
            else:
                w = tl.load(w_rows + ks[None, :] * sw_k, mask=n_ok[:, None] & (ks[None, :] < K), other=0.0)
            if QUANTIZE_A:
                a, a_scale = _quantized_group(x, POW2, MANUAL_FP8_RNE)
            elif EVEN_K:
                a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
            g_next = tl.minimum(g + 1, G - 1)
            a_next, w_next = _group_scales_of(s_ptr, a_row, row_ok, w_scale_rows, n_ok, g_next, ss_m, ss_g, sws_k,
                                              E8M0_SCALES, not QUANTIZE_A)
            x = _x_group(q_ptr, a_row, row_ok, g_next, K, sx_m, sx_k, BLOCK_K, QUANTIZE_A)
            if MANUAL_FP8_RNE:  # the interpreter: fp32 operands (rows it quantises are fp32 there), an fp32 product
                part = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(w, tl.trans(a))
            acc += part * (a_scale[None, :] * w_scale[:, None])
            a_scale, w_scale = a_next, w_next
        _store_tile(out_ptr, part_ptr, count_ptr, acc, rows[None, :], ns[:, None], n_ok[:, None] & row_ok[None, :],
                    so_m, so_n, split, splits, sp_k, SPLIT_PARTIALS)


@triton.jit
def _group_scales_of(s_ptr, a_row, row_ok, w_scale_rows, n_ok, g, ss_m, ss_g, sws_k, E8M0_SCALES: tl.constexpr,
                     LOAD_A: tl.constexpr):
    """Channel group g's activation scales [rows] (zeros without LOAD_A: the kernel quantises the rows itself)
    and weight scales [columns] as fp32 (g < G: the prefetch past a split's last group reads the last group's
    again, unused)."""
    if LOAD_A:
        a_scale = tl.load(s_ptr + a_row * ss_m + g * ss_g, mask=row_ok, other=0.0)
    else:
        a_scale = tl.zeros(a_row.shape, tl.float32)
    if E8M0_SCALES:
        w_scale = e8m0_to_float(tl.load(w_scale_rows + g * sws_k, mask=n_ok, other=127))
    else:
        w_scale = tl.load(w_scale_rows + g * sws_k, mask=n_ok, other=0.0)
    return a_scale, w_scale


@triton.jit
def _x_group(x_ptr, a_row, row_ok, g, K, sx_m, sx_k, BLOCK_K: tl.constexpr, LOAD: tl.constexpr):
    """Channel group g of the rows of x [rows, BLOCK_K] as stored, converted where it is used so that nothing waits
    for the load before then (fp32 zeros without LOAD: x is quantised already)."""
    ks = g * BLOCK_K + tl.arange(0, BLOCK_K)
    if LOAD:
        x = tl.load(x_ptr + a_row[:, None] * sx_m + ks[None, :] * sx_k, mask=row_ok[:, None] & (ks[None, :] < K),
                    other=0.0)
    else:
        x = tl.zeros((a_row.shape[0], BLOCK_K), tl.float32)
    return x


@triton.jit
def _quantized_group(x, POW2: tl.constexpr, MANUAL_FP8_RNE: tl.constexpr):
    """x [rows, channels] quantised as `_act_quant_kernel` quantises it: (e4m3 values, or on the interpreter the
    same values in fp32; scale per row)."""
    q, scale = _quantize_rows(x.to(tl.float32), POW2)
    if MANUAL_FP8_RNE:
        values = round_to_e4m3_grid(q)
    else:
        values = q.to(tl.float8e4nv)
    return values, scale


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def quantize_activations_triton(x2: torch.Tensor, block_k: int, pow2: bool, scales_column_major: bool = False,
                                rows_out: int | None = None, dequantized: bool = False, swiglu: tuple | None = None):
    """`quant_formats.quantize_activations` on the device: (q [M, K] e4m3, s [M, G] fp32); with
    `scales_column_major` s is laid out as [G, M] (the GEMMs read the scales of a group across rows), and with
    `rows_out` both have that many rows, those past M zero (cuBLAS wants a multiple of 4). `dequantized` (with
    `pow2`): q is value * scale in bf16, exactly (an e4m3 value times a power of two). `swiglu` = (limit,): x2 is
    [M, 2K], the gate and up halves, and what is quantised is `moe_experts.swiglu(gate, up, limit)`, in one pass."""
    M, K = x2.shape
    K = K // 2 if swiglu else K
    rows_out = M if rows_out is None else rows_out
    G = cdiv(K, block_k)
    q = torch.empty((rows_out, K), dtype=torch.bfloat16 if dequantized else FP8_DTYPE, device=x2.device)
    s = torch.empty((G, rows_out), dtype=torch.float32, device=x2.device).t() if scales_column_major else \
        torch.empty((rows_out, G), dtype=torch.float32, device=x2.device)
    if rows_out and K:
        block_r, manual = 16, interpreting()
        _act_quant_kernel[(cdiv(rows_out, block_r), G)](
            x2, q.view(torch.uint8) if manual and not dequantized else q, s, M, rows_out, K, x2.stride(0),
            x2.stride(1), s.stride(0), s.stride(1), K, BLOCK_R=block_r, BLOCK_K=block_k, POW2=pow2,
            MANUAL_FP8_RNE=manual, DEQUANTIZED=dequantized, SWIGLU=swiglu is not None,
            SWIGLU_LIMIT=None if swiglu is None or swiglu[0] is None else float(swiglu[0]), ACCURATE=not manual)
    return q, s


def quantize_for_weight(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_k: int,
                        swiglu: tuple | None = None):
    """Activations quantised as `weight`'s GEMM reads them: per row and block_k channels, column-major scales,
    power-of-two scales for E8M0 or FP4 weights; for FP4 weights the dequantised values in bf16 (exact). `swiglu`:
    as `quantize_activations_triton` takes it."""
    fp4 = _is_fp4(weight)
    return quantize_activations_triton(x2, block_k, pow2=is_e8m0(weight_scale) or fp4, scales_column_major=True,
                                       dequantized=fp4, swiglu=swiglu)


def quantizes_in_kernel(rows: int, weight: torch.Tensor, grouped: bool) -> bool:
    """Whether a GEMM of `rows` rows through `weight`, given its activations unquantised, quantises them inside its
    kernel rather than in a launch of its own before (`_gemm` on its default path)."""
    return _decode_quantizes(rows <= DECODE_MAX_ROWS, _is_fp4(weight), _decode_block_m(rows, grouped))


def _decode_quantizes(decode: bool, fp4: bool, block_m: int) -> bool:
    """The rule: FP8 weights on the decode path, row tiles of at most DECODE_QUANTIZE_MAX_ROW_TILE rows."""
    return decode and not fp4 and block_m <= DECODE_QUANTIZE_MAX_ROW_TILE


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _offset_tiles_kernel(offsets_ptr, expert_ptr, first_row_ptr, end_ptr, E, rows, count, BLOCK_M: tl.constexpr,
                         E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """`_expert_row_tiles` in one program: each expert's row range from the running totals (clamped to [0, rows], a
    running maximum), its tiles of BLOCK_M rows, and each of the `count` tiles' expert (E for the ones left over),
    first row and end of its expert's rows."""
    experts = tl.arange(0, E_PAD)
    valid = experts < E
    ends = tl.minimum(tl.maximum(tl.load(offsets_ptr + experts, mask=valid, other=0).to(tl.int64), 0), rows)
    ends = tl.associative_scan(ends, 0, _larger)
    before = tl.load(offsets_ptr + experts - 1, mask=valid & (experts > 0), other=0).to(tl.int64)
    starts = tl.associative_scan(tl.minimum(tl.maximum(before, 0), rows), 0, _larger)
    tiles = tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.cumsum(tiles, 0)
    for t0 in range(0, count, CHUNK):
        index = t0 + tl.arange(0, CHUNK)
        expert = tl.sum(((tile_ends[None, :] <= index[:, None]) & valid[None, :]).to(tl.int32), axis=1)
        pick = (experts[None, :] == tl.minimum(expert, E - 1)[:, None]).to(tl.int64)
        first_row = tl.sum(pick * starts[None, :], axis=1) + (index - tl.sum(pick * (tile_ends - tiles)[None, :],
                                                                             axis=1)) * BLOCK_M
        tl.store(expert_ptr + index, expert, mask=index < count)
        tl.store(first_row_ptr + index, first_row.to(tl.int32), mask=index < count)
        tl.store(end_ptr + index, tl.sum(pick * ends[None, :], axis=1).to(tl.int32), mask=index < count)


def _tile_count(rows: int, experts: int, block_m: int) -> int:
    """Tiles enough for any split of `rows` rows over `experts` experts: at most cdiv(rows, block_m) + E, and at most
    one per row (a decode step's few rows launch a few tiles, not one per expert)."""
    return max(1, min(cdiv(rows, block_m) + experts, rows))


def _offset_tiles(offsets: torch.Tensor, rows: int, block_m: int):
    """`_expert_row_tiles`' tile list from one Triton launch (a decode step's grouped call: ~24 torch ops, each a
    launch, otherwise)."""
    E = offsets.shape[0]
    count = _tile_count(rows, E, block_m)
    expert, first_row, end = (torch.empty(count, dtype=torch.int32, device=offsets.device) for _ in range(3))
    e_pad = next_power_of_2(E)
    _offset_tiles_kernel[(1,)](offsets, expert, first_row, end, E, rows, count, BLOCK_M=block_m, E_PAD=e_pad,
                               CHUNK=max(16, 2048 // e_pad), num_warps=4)
    return (expert, first_row, end), count


def _expert_row_tiles(offsets: torch.Tensor, rows: int, block_m: int):
    """The row tiles of a grouped GEMM, each within one expert, from the running row totals `offsets` [E], on the
    device (no host sync) with torch ops: ((expert, first row, end of its expert's rows) per tile, int32; the tile
    count), `_tile_count` tiles, the ones left over with expert E (nothing to do). `_offset_tiles`' reference."""
    E = offsets.shape[0]
    ends = offsets.to(torch.int64).clamp(0, rows).cummax(0).values
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    count = _tile_count(rows, E, block_m)
    index = torch.arange(count, device=offsets.device)
    expert = torch.searchsorted(tile_ends, index, right=True)
    safe = expert.clamp(max=E - 1)
    first_row = starts[safe] + (index - (tile_ends[safe] - tiles[safe])) * block_m
    return (expert.to(torch.int32), first_row.to(torch.int32), ends[safe].to(torch.int32)), count


def _gemm_config(rows: int, weight: torch.Tensor, experts: int = 1):
    """(BLOCK_M, BLOCK_N, warps, stages[, FP4 K step]) for a GEMM of `rows` rows through `weight`; FP4 by the rows
    of one expert (`experts` of them sharing the rows), FP8 by all rows."""
    if _is_fp4(weight):
        return _tile_config(min(1 << max(cdiv(rows, experts) - 1, 0).bit_length(), 256), True)
    return _tile_config(min(1 << max(rows - 1, 0).bit_length(), 128), False)


@functools.lru_cache(maxsize=None)
def _tile_config(rows_bucket: int, fp4: bool):
    """(BLOCK_M, BLOCK_N, warps, stages[, FP4 K step]) by row count: decode-sized calls stream the weight through many
    programs. FP8: the fastest of `benchmarks/fp8_linear_gpu.py`'s sweep on V3.2's projections (H200, run 74). FP4
    (BLOCK_N is the MMA's M there: weights first; K steps of FP4_BLOCK_K unless given): the tiles of `moe_experts`'
    FP4 GEMM, which has the same operand order, and past 128 rows an expert one 256-row tile with K steps of 128,
    which decodes each weight tile for twice the rows (V4-Flash's experts at T=8192, ~192 rows each: 7.51 ms for
    both GEMMs against 10.43 with 128-row tiles; H200, run 123)."""
    if interpreting():
        return 16, 32, 4, 1
    if fp4:
        if rows_bucket <= 64:
            return max(16, rows_bucket), 128, 8, 6
        if rows_bucket <= 128:
            return 128, 128, 8, 4
        return 256, 128, 8, 3, 128
    if rows_bucket <= 16:
        return 16, 32, 4, 4
    if rows_bucket <= 64:
        return 64, 64, 4, 4
    return 64, 128, 4, 3


# Up to this many rows a call takes the decode path (`_fp8_decode_kernel`, or `_fp4_gemm_kernel` with decode tiles):
# one row tile holds every row (grouped: tiles of DECODE_EXPERT_BLOCK_M per expert), so each program reads its
# weight columns once and the rows are the MMA's N. At 64 rows an FP8 weight byte feeds 128 flops, below what the
# H200's FP8 MMA sustains at HBM speed; beyond it `_tile_config`'s row tiles reuse each weight tile for more rows.
DECODE_MAX_ROWS = 64
# Row tile of a grouped call on the decode path: a few rows per expert, the MMA's smallest N.
DECODE_EXPERT_BLOCK_M = 16
# Row tiles up to this size quantise their activations inside the decode kernel (FP8 weights): the bf16 rows of a
# channel group each program re-reads from L2 are at most half its weight tile, and the call saves the quantising
# launch. Larger tiles read activations quantised beforehand (e4m3, half the bytes, no per-program quantising).
DECODE_QUANTIZE_MAX_ROW_TILE = 16


@functools.lru_cache(maxsize=None)
def _decode_config(fp4: bool, block_m: int):
    """(BLOCK_N, warps, stages, programs per SM, FP4 K step) of the decode path for a row tile of `block_m` rows;
    programs per SM sets the channel-group split when the columns alone are fewer (o_proj, q_a, kv_a). The fastest
    of `benchmarks/fp8_linear_gpu.py`'s `DECODE_SWEEP` on V3.2's projections and V4-Flash's FP4 expert, timed as
    CUDA-graph replays (H200, run 87). FP8: up to 16 rows, 128 columns over two warpgroups (0.72-0.81 of the copy
    bandwidth on q_b, o_proj and dense up, against 0.55-0.73 with 64); at 64 rows the accumulator is four times
    larger and 64 columns on one warpgroup keep more programs resident. FP4: the tile is decoded in registers,
    so fewer columns per program at few rows."""
    if fp4:
        return (64, 4, 4, 4, 128) if block_m <= 16 else (128, 8, 3, 2, 128)
    return (128, 8, 4, 2, 128) if block_m <= 16 else (64, 4, 4, 2, 128)


def _decode_block_m(rows: int, grouped: bool) -> int:
    if grouped:
        return DECODE_EXPERT_BLOCK_M
    return min(max(16, 1 << max(rows - 1, 0).bit_length()), DECODE_MAX_ROWS)


def _sm_count(device) -> int:
    """The SMs a GEMM's programs should fill; 0 on the interpreter (no split unless asked for)."""
    if interpreting() or device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


# Zeroed int32 counters per device, for the split programs of a tile to meet on (`_store_tile`). The last program of
# a tile sets its counter back to zero, so a buffer is zero between launches and across CUDA-graph replays. Splits
# happen only while the tiles alone are fewer than a few programs per SM, so the first buffer serves every call but
# a sweep's forced splits; a buffer is never freed (a captured graph keeps the one it was captured with). Two GEMMs
# with split partials must not run at once on one device (on two streams): they would count at the same counters.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        buffers.append(torch.zeros(max(count, 8192), dtype=torch.int32, device=device))
    return buffers[-1]


def grouped_block_m(rows: int, weight: torch.Tensor) -> int:
    """The row tile of a grouped GEMM of `rows` rows through the expert stack `weight` on `_gemm`'s default path:
    the rows a tile list passed to `_gemm` must be built for."""
    if rows <= DECODE_MAX_ROWS:
        return _decode_block_m(rows, grouped=True)
    return _gemm_config(rows, weight, weight.shape[0])[0]


def _channel_group_split(steps: int, wanted: int) -> tuple[int, int]:
    """(channel groups per split, splits) for about `wanted` splits of `steps` channel groups: whole groups, at
    least one a split, no split left empty."""
    per_split = cdiv(steps, max(1, min(wanted, steps)))
    return per_split, cdiv(steps, per_split)


def _gemm(q, s, weight, scale, out, block_n, block_k, offsets=None, a_rows=None, config=None, decode=None,
          split=None, tiles=None):
    """out = `q`, `s` (from `quantize_for_weight`) through `weight`, or with `s` None, `q` the activations x
    themselves, quantised inside the decode kernel (FP8 weights on the decode path) or first; grouped by expert with
    the running row totals `offsets` [E], or by the tile list `tiles` = (expert, first row, end of the expert's
    rows), int32, built for `grouped_block_m`'s row tile; `a_rows` [rows] int32: output row r reads activation row
    a_rows[r] of q. `decode` (by default: at most DECODE_MAX_ROWS rows) picks the decode path; `config` replaces its
    tile table's entry (`_decode_config` or `_tile_config`'s tuple: the benchmark's sweeps) and `split` the count of
    channel-group splits."""
    N, K = weight_dims(weight)
    rows, fp4 = out.shape[0], _is_fp4(weight)
    grouped = offsets is not None or tiles is not None
    experts = weight.shape[0] if grouped else 1
    decode = rows <= DECODE_MAX_ROWS if decode is None else decode
    if decode:
        BM = _decode_block_m(rows, grouped)
        BN, warps, stages, programs_per_sm, fp4_step = config or _decode_config(fp4, BM)
    else:
        BM, BN, warps, stages, *fp4_step = config or _gemm_config(rows, weight, experts)
        programs_per_sm, fp4_step = 2, fp4_step[0] if fp4_step else FP4_BLOCK_K
    quantize_a = s is None and _decode_quantizes(decode, fp4, BM)
    if s is None and not quantize_a:
        q, s = quantize_for_weight(q, weight, scale, block_k)
    if tiles is not None:
        tile_count = tiles[0].numel()
    elif offsets is None:  # row tiles from the program id: nothing to build on the device
        tiles, tile_count = (q, q, q), cdiv(rows, BM)
    else:
        tiles, tile_count = _offset_tiles(offsets, rows, BM)
    step = fp4_step if fp4 else block_k
    steps, columns = cdiv(K, step), cdiv(N, BN)
    if split is None:
        split = cdiv(programs_per_sm * _sm_count(q.device), tile_count * columns)
        split = split if decode else min(split, 16)
    per_split, split = _channel_group_split(steps, split)
    w3 = weight if weight.dim() == 3 else weight.unsqueeze(0)
    s3 = scale if scale.dim() == 3 else scale.unsqueeze(0)
    e8m0 = is_e8m0(s3) or s3.dtype == torch.uint8
    s3 = s3.view(torch.uint8) if e8m0 else s3
    partials = torch.empty((split, rows, N), dtype=torch.float32, device=q.device) if split > 1 else out
    counters = _arrival_counters(q.device, tile_count * columns if split > 1 else 1)
    partials_stride = rows * N if split > 1 else 0
    common = dict(BLOCK_M=BM, BLOCK_N=BN, SPLIT_PARTIALS=split > 1, GATHER_A=a_rows is not None,
                  GROUPED=grouped, num_warps=warps, num_stages=stages)
    a_row_arg = tiles[0] if a_rows is None else a_rows
    grid = (columns, tile_count, split)
    if fp4:  # the tile decode reads bytes and scales along K
        w3 = w3.view(torch.uint8)
        if w3.stride(-1) != 1 or s3.stride(-1) != 1:
            w3, s3 = w3.contiguous(), s3.contiguous()
        _fp4_gemm_kernel[grid](
            q, w3, s3, out, partials, counters, *tiles, a_row_arg, rows, N, K, experts, per_split * step, w3.stride(0),
            w3.stride(1), s3.stride(0), s3.stride(1), out.stride(0), out.stride(1), split, partials_stride,
            BLOCK_K=step, DECODE_ASM=not interpreting(), **common)
    elif decode:
        _fp8_decode_kernel[grid](
            q, q if quantize_a else s, w3, s3, out, partials, counters, *tiles, a_row_arg, rows, N, K, steps, experts,
            per_split,
            *((0, 0) if quantize_a else s.stride()), w3.stride(0), w3.stride(1), w3.stride(2), s3.stride(0),
            s3.stride(1), s3.stride(2), out.stride(0), out.stride(1), split, partials_stride, q.stride(0), q.stride(1),
            block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0, E8M0_SCALES=e8m0, QUANTIZE_A=quantize_a, POW2=e8m0,
            MANUAL_FP8_RNE=interpreting(), **common)
    else:
        _fp8_gemm_kernel[grid](
            q, s, w3, s3, out, partials, counters, *tiles, a_row_arg, rows, N, K, steps, experts, per_split,
            s.stride(0), s.stride(1), w3.stride(0), w3.stride(1), w3.stride(2), s3.stride(0), s3.stride(1),
            s3.stride(2), out.stride(0), out.stride(1), split, partials_stride, block_n,
            BLOCK_K=block_k, EVEN_K=K % block_k == 0, E8M0_SCALES=e8m0, **common)


@functools.lru_cache(maxsize=None)
def cublas_block_scaled_gemm(device_index: int) -> bool:
    """Whether this torch's `torch._scaled_mm` multiplies 1 x 128 / 128 x 128 block-scaled e4m3 on this device with
    the reference's result (a 256 x 256 x 512 product, checked once per device). It takes the activation scales as
    [M, K / 128] column-major and the weight's [N / 128, K / 128] scales transposed in place, with M and K / 128
    multiples of 4 (on torch 2.11 other layouts are refused, and K / 128 = 2 gives wrong results)."""
    device = torch.device("cuda", device_index)
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(256, 512, generator=g).to(device, torch.bfloat16)
    w = torch.randn(256, 512, generator=g).to(device, FP8_DTYPE)
    ws = torch.rand(2, 4, generator=g).add(0.5).to(device)
    want = _linear_math(x, w, ws, 128, 128).to(torch.bfloat16).float()
    try:
        got = _scaled_mm_linear(x, w, ws).float()
    except RuntimeError:
        return False
    return bool(((got - want).abs().max() <= 1e-2 * want.abs().max()).item())


def _scaled_mm_linear(x2, weight, scale):
    q, s = _quantize_for_scaled_mm(x2, scale)
    return _scaled_mm_quantized(q, s, weight, scale, x2.shape[0], x2.dtype)


def _quantize_for_scaled_mm(x2, scale):
    """x2's activations as cuBLAS's block-scaled GEMM reads them (per row and 128 channels, power-of-two scales for
    E8M0 weight scales): rows padded with zeros to a multiple of 4, scales column-major [rows, K / 128]. The first
    rows are `quantize_for_weight`'s bits, so `_gemm` reads them as well."""
    return quantize_activations_triton(x2, 128, pow2=is_e8m0(scale), scales_column_major=True,
                                       rows_out=cdiv(x2.shape[0], 4) * 4)


def _scaled_mm_quantized(q, s, weight, scale, rows, out_dtype):
    """`_quantize_for_scaled_mm`'s (q, s) through `weight` by `torch._scaled_mm`: the first `rows` rows."""
    out = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scales_to_float32(scale).t(), out_dtype=out_dtype)
    return out[:rows]


def _goes_to_cublas(x2, weight, block_n, block_k) -> bool:
    """Whether this call goes to cuBLAS's block-scaled GEMM: FP8 weights in 128 x 128 blocks, K a multiple of 512,
    at least SCALED_MM_MIN_ROWS rows, and the probe passed."""
    N, K = weight_dims(weight)
    return (x2.is_cuda and not _is_fp4(weight) and (block_n, block_k) == (128, 128) and x2.shape[0] >=
            SCALED_MM_MIN_ROWS and K % 512 == 0 and N % 16 == 0 and x2.dtype != torch.float32
            and cublas_block_scaled_gemm(x2.device.index or 0))


def fp8_linear_triton(x, weight, weight_scale, block_n, block_k):
    """The CUDA path (or CPU tensors under TRITON_INTERPRET)."""
    N, K = _check_linear(x, weight, weight_scale, block_n, block_k)
    return _linear_triton(x, weight, weight_scale, block_n, block_k, N, K)


def _linear_triton(x, weight, weight_scale, block_n, block_k, N, K):
    x2 = x.reshape(-1, K)
    if _goes_to_cublas(x2, weight, block_n, block_k):
        return _scaled_mm_linear(x2, weight, weight_scale).view(*x.shape[:-1], N)
    out = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    if out.numel():
        _gemm(x2, None, weight, weight_scale, out, block_n, block_k)
    return out.view(*x.shape[:-1], N)


def fp8_grouped_linear_triton(x, weight, weight_scale, offsets, block_n, block_k):
    E, N, K = _check_grouped(x, weight, weight_scale, offsets, block_n, block_k)
    out = torch.zeros((x.shape[0], N), dtype=x.dtype, device=x.device)
    if out.numel():
        _gemm(x, None, weight, weight_scale, out, block_n, block_k, offsets=offsets)
    return out


def fp8_linears_triton(x, weights, weight_scales, block_ns, block_k):
    """`fp8_linear_triton` through each weight, the activations quantised once: decode-sized calls, whose kernel
    quantises its rows itself, run per weight as they are; larger ones quantise x once, in cuBLAS's padded layout
    when any weight goes there (`_quantize_for_scaled_mm`, whose rows the Triton GEMMs read as well) else as
    `quantize_for_weight` does, and feed every GEMM from that (q, s): the same bits as a call per weight."""
    widths, K = _check_linears(x, weights, weight_scales, block_ns, block_k)
    x2 = x.reshape(-1, K)
    rows = x2.shape[0]
    if quantizes_in_kernel(rows, weights[0], grouped=False):
        if rows and all(w.stride(-1) == 1 and s.stride(-1) == 1 for w, s in zip(weights, weight_scales)):
            outs = _decode_linears(x2, weights, weight_scales, block_ns, block_k, widths, K)
            return [out.view(*x.shape[:-1], N) for out, N in zip(outs, widths)]
        return [_linear_triton(x, w, s, bn, block_k, N, K) for w, s, bn, N in zip(weights, weight_scales, block_ns,
                                                                                   widths)]
    cublas = [_goes_to_cublas(x2, w, bn, block_k) for w, bn in zip(weights, block_ns)]
    if any(cublas):
        q, s = _quantize_for_scaled_mm(x2, weight_scales[0])
    else:
        q, s = quantize_for_weight(x2, weights[0], weight_scales[0], block_k)
    outs = []
    for weight, scale, block_n, N, to_cublas in zip(weights, weight_scales, block_ns, widths, cublas):
        if to_cublas:
            out = _scaled_mm_quantized(q, s, weight, scale, rows, x.dtype)
        else:
            out = torch.empty((rows, N), dtype=x.dtype, device=x.device)
            if out.numel():
                _gemm(q, s, weight, scale, out, block_n, block_k)
        outs.append(out.view(*x.shape[:-1], N))
    return outs


# Weights one launch of `_fp8_decode_weights_kernel` streams at most.
DECODE_WEIGHTS_PER_LAUNCH = 3


def _decode_linears(x2, weights, scales, block_ns, block_k, widths, K):
    """Decode-sized `fp8_linears` (rows quantised in the kernel; weights and scales K-contiguous): each run of up to
    DECODE_WEIGHTS_PER_LAUNCH weights one launch of `_fp8_decode_weights_kernel`, with `_gemm`'s decode tiles and
    channel-group split over the run's column blocks together, so the narrow projections of one input (q_a, kv_a and
    the indexer's wk) fill the GPU as one weight would. Each output is a launch per weight's up to the fp32 order in
    which split channel groups are summed (the launch splits by all its columns, a launch per weight by its own)."""
    rows = x2.shape[0]
    BM = _decode_block_m(rows, grouped=False)
    BN, warps, stages, programs_per_sm, _ = _decode_config(False, BM)
    outs = [torch.empty((rows, N), dtype=x2.dtype, device=x2.device) for N in widths]
    e8m0 = is_e8m0(scales[0])
    steps, row_tiles = cdiv(K, block_k), cdiv(rows, BM)
    for first in range(0, len(weights), DECODE_WEIGHTS_PER_LAUNCH):
        run = slice(first, first + DECODE_WEIGHTS_PER_LAUNCH)
        ws, ss, bns, Ns, run_outs = weights[run], scales[run], block_ns[run], widths[run], outs[run]
        columns = [cdiv(N, BN) for N in Ns]
        per_split, split = _channel_group_split(
            steps, cdiv(programs_per_sm * _sm_count(x2.device), row_tiles * sum(columns)))
        parts = [torch.empty((split, rows, N), dtype=torch.float32, device=x2.device) if split > 1 else out
                 for N, out in zip(Ns, run_outs)]
        counters = _arrival_counters(x2.device, row_tiles * sum(columns) if split > 1 else 1)
        pad = DECODE_WEIGHTS_PER_LAUNCH - len(ws)  # a run of two passes its second weight again, never read
        ws, Ns, bns = [*ws, *ws[-1:] * pad], [*Ns, *Ns[-1:] * pad], [*bns, *bns[-1:] * pad]
        ss = [s.view(torch.uint8) if e8m0 else s for s in [*ss, *ss[-1:] * pad]]
        run_outs, parts = [*run_outs, *run_outs[-1:] * pad], [*parts, *parts[-1:] * pad]
        _fp8_decode_weights_kernel[(sum(columns), row_tiles, split)](
            x2, ws[0], ss[0], run_outs[0], parts[0], ws[1], ss[1], run_outs[1], parts[1], ws[2], ss[2], run_outs[2],
            parts[2], counters, *Ns, columns[0], columns[1] if len(columns) > 1 else 0,
            *(w.stride(0) for w in ws), *(s.stride(0) for s in ss), *bns, rows, K, steps, per_split, split,
            x2.stride(0), x2.stride(1), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
            E8M0_SCALES=e8m0, SPLIT_PARTIALS=split > 1, POW2=e8m0, MANUAL_FP8_RNE=interpreting(), num_warps=warps,
            num_stages=stages)
    return outs


def grouped_gemm_quantized(q, s, a_rows, weight, weight_scale, tiles, block_n, block_k, out):
    """The grouped GEMM on activations quantised by `quantize_for_weight` (or `q` the activations and `s` None: a
    decode-sized call quantises them in its kernel, a larger one beforehand): out[r] = q[a_rows[r]] (q[r] without
    `a_rows`) through the weight of r's expert, for the rows the tile list `tiles` (see `_gemm`; built for
    `grouped_block_m(out rows, weight)`) covers; other rows of `out` are not defined afterwards."""
    _gemm(q, s, weight, weight_scale, out, block_n, block_k, a_rows=a_rows, tiles=tiles)


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("dsfuse::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int,
               block_k: int) -> torch.Tensor:
    """`x [..., K]` through a block-scaled FP8 (or FP4) weight, in x's dtype (see the module docstring)."""
    return fp8_linear_reference(x, weight, weight_scale, block_n, block_k)


@fp8_linear.register_fake
def _fp8_linear_fake(x, weight, weight_scale, block_n, block_k):
    N, _ = _check_linear(x, weight, weight_scale, block_n, block_k)
    return x.new_empty((*x.shape[:-1], N))


@direct_kernel(fp8_linear)
def _fp8_linear_cuda(x, weight, weight_scale, block_n, block_k):
    return fp8_linear_triton(x, weight, weight_scale, block_n, block_k)


@torch.library.custom_op("dsfuse::fp8_grouped_linear", mutates_args=())
def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, offsets: torch.Tensor,
                       block_n: int, block_k: int) -> torch.Tensor:
    """Rows of `x [S, K]` sorted by expert through their expert's block-scaled weight (see the module docstring)."""
    return fp8_grouped_linear_reference(x, weight, weight_scale, offsets, block_n, block_k)


@fp8_grouped_linear.register_fake
def _fp8_grouped_linear_fake(x, weight, weight_scale, offsets, block_n, block_k):
    _, N, _ = _check_grouped(x, weight, weight_scale, offsets, block_n, block_k)
    return x.new_empty((x.shape[0], N))


@direct_kernel(fp8_grouped_linear)
def _fp8_grouped_linear_cuda(x, weight, weight_scale, offsets, block_n, block_k):
    return fp8_grouped_linear_triton(x, weight, weight_scale, offsets, block_n, block_k)


@torch.library.custom_op("dsfuse::fp8_linears", mutates_args=())
def fp8_linears(x: torch.Tensor, weights: list[torch.Tensor], weight_scales: list[torch.Tensor], block_ns: list[int],
                block_k: int) -> list[torch.Tensor]:
    """`[fp8_linear(x, w, s, bn, block_k) for w, s, bn in zip(weights, weight_scales, block_ns)]`, x quantised once
    (see the module docstring)."""
    return fp8_linears_reference(x, weights, weight_scales, block_ns, block_k)


@fp8_linears.register_fake
def _fp8_linears_fake(x, weights, weight_scales, block_ns, block_k):
    widths, _ = _check_linears(x, weights, weight_scales, block_ns, block_k)
    return [x.new_empty((*x.shape[:-1], N)) for N in widths]


@direct_kernel(fp8_linears)
def _fp8_linears_cuda(x, weights, weight_scales, block_ns, block_k):
    return fp8_linears_triton(x, weights, weight_scales, block_ns, block_k)


def weight_bytes(weight: torch.Tensor, scale: torch.Tensor) -> int:
    """The bytes a weight-streaming call must read at least: the weight and its scales once."""
    return weight.numel() * weight.element_size() + scale.numel() * scale.element_size()


__all__ = ["SCALED_MM_MIN_ROWS", "cublas_block_scaled_gemm", "dequantize_weight", "fp8_grouped_linear",
           "fp8_grouped_linear_reference", "fp8_grouped_linear_triton", "fp8_linear", "fp8_linear_reference",
           "fp8_linear_triton", "fp8_linears", "fp8_linears_reference", "fp8_linears_triton", "grouped_block_m",
           "grouped_gemm_quantized", "quantize_activations_triton", "quantize_for_weight", "weight_bytes",
           "weight_dims"]
