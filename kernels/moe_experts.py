"""Routed SwiGLU experts, DeepSeek V3.2 / V4 style: FP4 weights (E2M1 nibbles + E8M0 per-32 scales) or plain weights.

Two custom ops share one Triton pipeline, switched by a constexpr weight format:

- `dsfuse::moe_experts_fp4`: the own model's `DsfuseFp4Experts` (FP4 weights decoded in registers, never a
  dequantised stack; router weight cast to x's dtype and the product rounded, as that module does);
- `dsfuse::moe_experts_bf16`: transformers' `grouped_mm_experts_forward` (weights in x's dtype, `F.linear` shapes
  read through any strides, so a stack stored `[E, K, N]` is passed as its transposed view; the up stack optionally
  apart, DeepSeek's w1 / w3; router-weight product with torch type promotion, as HF computes it).

Each has a plain-PyTorch reference (its CPU implementation and numerics contract). The Triton path:

1. routing (no host sync): slots whose expert is local are sorted by expert (stably) and a per-expert padded tile
   schedule of fixed length `min(T*k, T*k // BLOCK_M + E)` is built: one Triton program (counting sort) for
   decode-sized batches, torch ops (`sort`, `cumsum`, `searchsorted`) for large ones; at T = 1 none: one tile per
   slot, the GEMMs read its expert from the ids (`slot_tiles`);
2. grouped GEMM 1, "swap AB": weight rows are the MMA's M dimension and tokens its N dimension
   (`acc[rows, tokens] = W @ x^T`), so a decoded FP4 tile can feed the tensor cores straight from registers and a
   handful of tokens per expert (decode) still fills the MMA. One tile holds matching gate and up rows; the
   epilogue applies SwiGLU and writes the activation `[slots, I]` in x's dtype;
3. grouped GEMM 2, same layout, writes each slot's down-projection output (rounded to x's dtype), or with
   `split_k` fp32 partials of K slices that the combine sums in slice order and rounds once;
4. combine: each token sums its k slots in fp32 in slot order (deterministic, no atomics), applying the router
   weight with the op's rounding and reading only slots whose expert is local (expert parallelism), cast once.

For plain bf16 weights at prefill sizes on sm90+ (`_grouped_mm_applies`), steps 2-3 run instead as CUTLASS
grouped GEMMs (`torch._grouped_mm`) over the expert-sorted rows, with SwiGLU in its own Triton pass and the combine
reading each slot's row through the inverse permutation: at T=8192 on the H200 CUTLASS's GEMMs took 11.2 ms
against the Triton tiles' 13.9 ms (V4-Flash experts, 2 layers), while at decode sizes the swap-AB tiles win.

FP4 tiles are decoded in registers once per K step: with bf16 activations on CUDA by integer ops and two exact
`mul.rn.bf16x2` per byte (inline PTX), otherwise exactly through fp32; both bit-exact with `dequantize_fp4`.
FP4 weights are `[E, N, K//2]` uint8 (low nibble = even element) with scales `[E, N, K//32]` uint8, as
`quantize_fp4` writes them. Expert ids are global; `local_expert_offset` says which `E` of them this rank holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse.kernels.quant_formats import FP4_BLOCK, dequantize_fp4, e2m1_to_float, e8m0_to_float
from dsfuse.kernels.triton_math import exp_as_torch
from dsfuse.kernels.triton_support import cdiv, direct_kernel, next_power_of_2

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# ---------------------------------------------------------------------------------------------------------------
# Input checks and references
# ---------------------------------------------------------------------------------------------------------------


def _check_routing(op, x, expert_ids, expert_weights, local_expert_offset):
    """x, ids and router weights of either op; raises with the offending argument's name."""
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [T, H], got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: x dtype {x.dtype} not in {_FLOAT_DTYPES}")
    T = x.shape[0]
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T or expert_ids.shape[1] < 1:
        raise ValueError(f"{op}: expert_ids must be [T={T}, k>=1], got {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{op}: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if expert_weights.shape != expert_ids.shape:
        raise ValueError(
            f"{op}: expert_weights {tuple(expert_weights.shape)} must match expert_ids {tuple(expert_ids.shape)}"
        )
    if expert_weights.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: expert_weights dtype {expert_weights.dtype} not in {_FLOAT_DTYPES}")
    if local_expert_offset < 0:
        raise ValueError(f"{op}: local_expert_offset must be >= 0, got {local_expert_offset}")


def _check_devices(op, x, named_tensors):
    for name, t in named_tensors:
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x is on {x.device}")


def _check_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale, local_expert_offset):
    """FP4 op: shapes, dtypes and devices; raises with the offending argument's name."""
    op = "moe_experts_fp4"
    _check_routing(op, x, expert_ids, expert_weights, local_expert_offset)
    H = x.shape[1]
    for name, t in (("w13_packed", w13_packed), ("w13_scale", w13_scale), ("w2_packed", w2_packed),
                    ("w2_scale", w2_scale)):
        if t.dtype != torch.uint8:
            raise TypeError(f"{op}: {name} must be uint8, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"{op}: {name} must be 3-D, got {tuple(t.shape)}")
    E = w13_packed.shape[0]
    if E < 1:
        raise ValueError(f"{op}: need at least one local expert")
    if H % FP4_BLOCK:
        raise ValueError(f"{op}: hidden size {H} is not a multiple of the FP4 block size {FP4_BLOCK}")
    two_i = w13_packed.shape[1]
    if two_i % 2 or (two_i // 2) % FP4_BLOCK or two_i == 0:
        raise ValueError(
            f"{op}: w13_packed dim 1 must be 2*I with I a positive multiple of {FP4_BLOCK}, got {two_i}"
        )
    inter = two_i // 2
    expected = {
        "w13_packed": (w13_packed, (E, 2 * inter, H // 2)),
        "w13_scale": (w13_scale, (E, 2 * inter, H // FP4_BLOCK)),
        "w2_packed": (w2_packed, (E, H, inter // 2)),
        "w2_scale": (w2_scale, (E, H, inter // FP4_BLOCK)),
    }
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{op}: {name} must be {shape} for x {tuple(x.shape)}, got {tuple(t.shape)}")
    _check_devices(op, x, (("expert_ids", expert_ids), ("expert_weights", expert_weights),
                           ("w13_packed", w13_packed), ("w13_scale", w13_scale), ("w2_packed", w2_packed),
                           ("w2_scale", w2_scale)))


def _check_inputs_bf16(x, expert_ids, expert_weights, gate_up, down, local_expert_offset, up=None):
    """Plain-weight op: `gate_up [E, 2I, H]` (or the gate `[E, I, H]` with `up [E, I, H]` apart), `down [E, H, I]`,
    all in x's dtype, any strides."""
    op = "moe_experts_bf16"
    _check_routing(op, x, expert_ids, expert_weights, local_expert_offset)
    H = x.shape[1]
    stacks = (("gate_up", gate_up), ("down", down)) + ((("up", up),) if up is not None else ())
    for name, t in stacks:
        if t.dim() != 3:
            raise ValueError(f"{op}: {name} must be 3-D, got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise TypeError(f"{op}: {name} dtype {t.dtype} must match x dtype {x.dtype}")
    E, rows = gate_up.shape[:2]
    if E < 1:
        raise ValueError(f"{op}: need at least one local expert")
    if up is None:
        if rows % 2 or rows == 0:
            raise ValueError(f"{op}: gate_up dim 1 must be 2*I with I >= 1, got {rows}")
        inter = rows // 2
        if tuple(gate_up.shape) != (E, 2 * inter, H):
            raise ValueError(f"{op}: gate_up must be {(E, 2 * inter, H)} for x {tuple(x.shape)}, got "
                             f"{tuple(gate_up.shape)}")
    else:
        inter = rows
        if rows == 0 or tuple(gate_up.shape) != (E, inter, H):
            raise ValueError(f"{op}: with up given, gate_up must be the gate stack [E, I>=1, H={H}], got "
                             f"{tuple(gate_up.shape)}")
        if up.shape != gate_up.shape:
            raise ValueError(f"{op}: up must be {tuple(gate_up.shape)} like the gate stack, got {tuple(up.shape)}")
    if tuple(down.shape) != (E, H, inter):
        raise ValueError(f"{op}: down must be {(E, H, inter)} for x {tuple(x.shape)}, got {tuple(down.shape)}")
    _check_devices(op, x, (("expert_ids", expert_ids), ("expert_weights", expert_weights)) + stacks)


def check_swiglu_limit(op, swiglu_limit):
    if swiglu_limit is not None and not (0.0 < swiglu_limit < float("inf")):
        raise ValueError(f"{op}: swiglu_limit must be a positive finite float or None, got {swiglu_limit}")


def swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """`silu(gate) * up`, with both halves clamped first (gate above, up on both sides) when a limit is given; each
    step in the halves' dtype, as the source computes it."""
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return torch.nn.functional.silu(gate) * up


def check_ids_non_negative(op, expert_ids):
    if expert_ids.numel() and int(expert_ids.min()) < 0:
        raise ValueError(f"{op}: expert ids must be >= 0, got {int(expert_ids.min())}")


def moe_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    local_expert_offset: int = 0,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """The own model's expert math, one local expert at a time; slots of other experts are skipped unread.

    Per slot, in x's dtype: `gate, up = (x @ w13^T).chunk(2)`, `silu(gate) * up` (with `swiglu_limit` L:
    `silu(gate.clamp(max=L)) * up.clamp(-L, L)`), `@ w2^T`, times the router weight cast to x's dtype. Each token's
    slots are then summed in fp32 in slot order and cast once. Expert ids must be in `[0, num_global_experts)`:
    negative ids raise.
    """
    _check_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale, local_expert_offset)
    check_swiglu_limit("moe_experts_fp4", swiglu_limit)
    check_ids_non_negative("moe_experts_fp4", expert_ids)
    T, top_k = expert_ids.shape
    num_experts = w13_packed.shape[0]
    inter = w13_packed.shape[1] // 2
    local_ids = expert_ids.reshape(-1).long() - local_expert_offset
    flat_weights = expert_weights.reshape(-1)
    slot_out = torch.zeros(T * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(num_experts):
        slots = (local_ids == expert).nonzero().squeeze(1)
        if slots.numel() == 0:
            continue
        rows = x[slots // top_k]
        w13 = dequantize_fp4(w13_packed[expert], w13_scale[expert], x.dtype)
        w2 = dequantize_fp4(w2_packed[expert], w2_scale[expert], x.dtype)
        gate_up = rows @ w13.t()
        activated = swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
        out = (activated @ w2.t()) * flat_weights[slots].to(x.dtype).unsqueeze(-1)
        slot_out[slots] = out.float()
    return slot_out.view(T, top_k, -1).sum(dim=1).to(x.dtype)


def moe_experts_bf16_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    local_expert_offset: int = 0,
    swiglu_limit: float | None = None,
    up: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' `grouped_mm_experts_forward` math (SiLU gate), one local expert at a time.

    Per slot, in x's dtype: `gate, up = (x @ gate_up^T).chunk(2)` (with `up` given, DeepSeek's separate w1 / w3:
    `gate = x @ gate_up^T`, `up = x @ up^T`), `silu(gate) * up` (with `swiglu_limit` L, DeepSeek
    V4's `silu(gate.clamp(max=L)) * up.clamp(-L, L)`), `@ down^T`; then
    `out * router_weight` with torch type promotion (fp32 router weights give an fp32, unrounded product), summed
    over the k slots with `view(T, k, H).sum(1)` and cast to x's dtype, as HF does. Slots of non-local experts add
    nothing and are never read. Negative ids raise. The stacks may have any strides (a `[E, K, N]` stack passed as
    its `.transpose(1, 2)` view reads the same weights).
    """
    _check_inputs_bf16(x, expert_ids, expert_weights, gate_up, down, local_expert_offset, up)
    check_swiglu_limit("moe_experts_bf16", swiglu_limit)
    check_ids_non_negative("moe_experts_bf16", expert_ids)
    T, top_k = expert_ids.shape
    num_experts = gate_up.shape[0]
    local_ids = expert_ids.reshape(-1).long() - local_expert_offset
    flat_weights = expert_weights.reshape(-1)
    product_dtype = torch.promote_types(x.dtype, expert_weights.dtype)
    weighted = torch.zeros(T * top_k, x.shape[1], dtype=product_dtype, device=x.device)
    for expert in range(num_experts):
        slots = (local_ids == expert).nonzero().squeeze(1)
        if slots.numel() == 0:
            continue
        rows = x[slots // top_k]
        if up is None:
            halves = (rows @ gate_up[expert].t()).chunk(2, dim=-1)
        else:
            halves = rows @ gate_up[expert].t(), rows @ up[expert].t()
        activated = swiglu(*halves, swiglu_limit)
        weighted[slots] = (activated @ down[expert].t()) * flat_weights[slots].unsqueeze(-1)
    return weighted.view(T, top_k, -1).sum(dim=1).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# FP4 decode (shared by both GEMMs and tested on its own)
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def fp4_decode(nibble, scale_byte):
    """E2M1 nibble times 2^(scale_byte - 127) as fp32, exactly as `dequantize_fp4` rounds it.

    Both factors are exact and the product of an E2M1 value and a power of two is exactly representable (or
    overflows to inf exactly as the reference does); plain fp32 multiplies keep subnormals on the GPU (Triton
    applies FTZ to libdevice calls only). No `exp2`: `ex2.approx` flushes subnormals.
    """
    return e2m1_to_float(nibble) * e8m0_to_float(scale_byte)


@triton.jit
def e8m0_to_bf16_factor_pairs(scale_byte):
    """E8M0 byte S -> two bf16 powers of two with `f1 * f2 = 2^(S - 1)`, each replicated into both halves of an int32
    (a bf16x2 operand): f1 = 2^(min(S, 128) - 1) and f2 = 2^(max(S, 128) - 128) are both representable, and
    S = 255 gives f2 = NaN. See `fp4_decode_bf16_pair` for why `(value * 2^-126) * f1 * f2` is exact."""
    scale_int = scale_byte.to(tl.int32)
    f1 = (tl.minimum(scale_int, 128) + 126) << 7
    f2 = tl.where(scale_int == 255, 0x7FC0, (tl.maximum(scale_int, 128) - 1) << 7)
    return f1 | (f1 << 16), f2 | (f2 << 16)


@triton.jit
def fp4_decode_bf16_pair(byte, f1_pair, f2_pair):
    """Both weights of a packed byte (int32, 0..255) as bf16, low nibble first, exactly `dequantize_fp4(...,
    bfloat16)`: integer ops and two packed bf16 multiplies per byte, no float conversions (CUDA only, inline PTX).

    One 32-bit word holds both codes as bf16 `value * 2^-126`: each code's sign goes to its half's bit 15 and its
    3 magnitude bits to bits 6-8 (the exponent's two low bits and the top mantissa bit), so codes 0/1 land on zero
    and the subnormal 2^-127 and the rest on normal numbers. Multiplying the byte by `2^6 + 2^18` (`2^12 + 2^24`
    for the signs) places two non-overlapping copies, a mask keeps each half's bits. Then `* f1 * f2` (from
    `e8m0_to_bf16_factor_pairs`): both products are exact powers-of-two scalings, `mul.rn.bf16x2` keeps
    subnormals (S = 0 gives `value * 2^-127`) and overflows to inf where the fp32 reference does.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 w, s;
        mul.lo.u32 w, $2, 0x40040;
        and.b32 w, w, 0x01C001C0;
        mul.lo.u32 s, $2, 0x1001000;
        and.b32 s, s, 0x80008000;
        or.b32 w, w, s;
        mul.rn.bf16x2 w, w, $3;
        mul.rn.bf16x2 w, w, $4;
        mov.b32 {$0, $1}, w;
        }""",
        constraints="=h,=h,r,r,r",
        args=[byte, f1_pair, f2_pair],
        dtype=(tl.int16, tl.int16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _fp4_decode_table_kernel(packed_ptr, scale_ptr, out_ptr, N, BLOCK: tl.constexpr, BF16: tl.constexpr):
    """Decodes `N` bytes with one scale byte each into `[N, 2]` fp32 (low nibble first) with the fp32 decode or,
    with `BF16` (CUDA only), the bf16 decode the GEMMs use for bf16 activations (widened exactly to fp32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + offs, mask=mask, other=127)
    if BF16:
        f1, f2 = e8m0_to_bf16_factor_pairs(scale)
        lo, hi = fp4_decode_bf16_pair(byte, f1, f2)
        lo = lo.to(tl.bfloat16, bitcast=True).to(tl.float32)
        hi = hi.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        lo, hi = fp4_decode(byte & 15, scale), fp4_decode(byte >> 4, scale)
    tl.store(out_ptr + 2 * offs, lo, mask=mask)
    tl.store(out_ptr + 2 * offs + 1, hi, mask=mask)


def fp4_decode_triton(packed: torch.Tensor, scales: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """`packed [N]` uint8 with one E8M0 byte per packed byte -> `[N, 2]` fp32 through `fp4_decode` (or, with
    `bf16`, CUDA only, through `fp4_decode_bf16_pair`)."""
    packed, scales = packed.contiguous(), scales.contiguous()
    out = torch.empty(packed.numel(), 2, dtype=torch.float32, device=packed.device)
    block = 256
    _fp4_decode_table_kernel[(cdiv(packed.numel(), block),)](packed, scales, out, packed.numel(), BLOCK=block,
                                                                    BF16=bf16)
    return out


@triton.jit
def _per_byte(block_values, BN: tl.constexpr, BLOCK_K: tl.constexpr):
    """`[BN, BK/32]` per-block values -> `[BN, BK/2]` per packed byte (byte j holds elements 2j, 2j+1: block j // 16)."""
    return tl.reshape(tl.broadcast_to(block_values[:, :, None], (BN, BLOCK_K // 32, 16)), (BN, BLOCK_K // 2))


@triton.jit
def scale_tile(s_ptr, rows, row_mask, k0, K, stride_sn, BLOCK_K: tl.constexpr, FP4: tl.constexpr):
    """The `[BN, BK/32]` E8M0 bytes of a K step (zeros when the weights are not FP4).

    Loaded one K step ahead by the GEMM loops: with a few bytes per thread Triton does not stream this load
    through `cp.async`, so in-step it would be a synchronous global load (full latency) every K step.
    """
    if FP4:
        offs_block = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        mask = row_mask[:, None] & (offs_block[None, :] < K // 32)
        return tl.load(s_ptr + rows[:, None] * stride_sn + offs_block[None, :], mask=mask, other=127)
    else:
        return tl.zeros((rows.shape[0], BLOCK_K // 32), dtype=tl.uint8)


@triton.jit
def weight_tile(w_ptr, scale, rows, row_mask, k0, K, stride_wn,
                 BLOCK_K: tl.constexpr, FP4: tl.constexpr, DECODE_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """`[len(rows), BLOCK_K]` weights of one expert in the dot dtype (K columns from `k0`), K contiguous: rows `rows`
    of `w_ptr`, `stride_wn` apart (see `weight_rows_tile`)."""
    return weight_rows_tile(w_ptr + rows * stride_wn, scale, row_mask, k0, K, 1, BLOCK_K, FP4, DECODE_ASM, DOT_DTYPE)


@triton.jit
def weight_rows_tile(row_ptrs, scale, row_mask, k0, K, stride_wk,
                     BLOCK_K: tl.constexpr, FP4: tl.constexpr, DECODE_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """`[len(row_ptrs), BLOCK_K]` weights of one expert in the dot dtype (K columns from `k0`; `row_ptrs` point at
    each weight row's first element, `stride_wk` steps along K: 1 for the `F.linear` layout, N for a stack stored
    `[E, K, N]`, the rows then being adjacent).

    FP4: one load of the packed bytes `[BN, BK/2]`; the step's scales `[BN, BK/32]` (`scale_tile`) are turned into
    factors once per 32 elements and broadcast, both nibbles are decoded and interleaved back into K order. bf16 on
    CUDA (`DECODE_ASM`) decodes with integer ops and two exact bf16x2 multiplies (`fp4_decode_bf16_pair`); other
    dtypes and the interpreter go through fp32 (`fp4_decode`), rounded once.
    Otherwise a plain load of the weights, already in x's dtype.
    """
    if FP4:
        offs_byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte_mask = row_mask[:, None] & (offs_byte[None, :] < K // 2)
        packed = tl.load(row_ptrs[:, None] + offs_byte[None, :] * stride_wk, mask=byte_mask, other=0)
        packed = packed.to(tl.int32)
        if DECODE_ASM:
            f1, f2 = e8m0_to_bf16_factor_pairs(scale)
            even, odd = fp4_decode_bf16_pair(packed, _per_byte(f1, row_ptrs.shape[0], BLOCK_K),
                                             _per_byte(f2, row_ptrs.shape[0], BLOCK_K))
            even = even.to(tl.bfloat16, bitcast=True)
            odd = odd.to(tl.bfloat16, bitcast=True)
        else:
            scale = _per_byte(e8m0_to_float(scale), row_ptrs.shape[0], BLOCK_K)
            even = (e2m1_to_float(packed & 15) * scale).to(DOT_DTYPE)
            odd = (e2m1_to_float(packed >> 4) * scale).to(DOT_DTYPE)
        return tl.interleave(even, odd)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (offs_k[None, :] < K)
        return tl.load(row_ptrs[:, None] + offs_k[None, :] * stride_wk, mask=mask, other=0.0)


# ---------------------------------------------------------------------------------------------------------------
# Grouped GEMMs and combine
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _weight_rows_times_tokens(a_rows, a_row_mask, w_row_ptrs, s_expert, w_rows, w_mask, k_lo, K, stride_wk,
                              stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              FP4: tl.constexpr, DECODE_ASM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              DOT_DTYPE: tl.constexpr):
    """The K loop both GEMMs share: `acc[rows, tokens] = W[rows, k_lo:K] @ A[tokens, k_lo:K]^T` in fp32 (`k_lo` is 0,
    or a split-K slice's start: a multiple of BLOCK_K), the weight rows given by pointers (`w_row_ptrs`, K strided by
    `stride_wk`) and FP4 scales by row numbers (`w_rows` of `s_expert`), one expert's weights decoded per K step in
    registers, the next step's scales prefetched (see `scale_tile`)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    scale = scale_tile(s_expert, w_rows, w_mask, k_lo, K, stride_sn, BLOCK_K, FP4)
    for k0 in range(k_lo, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_tile = tl.load(a_rows + offs_k[None, :], mask=a_row_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        next_scale = scale_tile(s_expert, w_rows, w_mask, k0 + BLOCK_K, K, stride_sn, BLOCK_K, FP4)
        w_tile = weight_rows_tile(w_row_ptrs, scale, w_mask, k0, K, stride_wk, BLOCK_K, FP4, DECODE_ASM, DOT_DTYPE)
        scale = next_scale
        acc = tl.dot(w_tile, tl.trans(a_tile), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _program_tile(tile, tile_row_start_ptr, tile_row_end_ptr, tile_expert_ptr, ids_ptr, LOCAL_LO, NUM_EXPERTS,
                  SLOT_TILES: tl.constexpr):
    """`(row_start, row_end, expert)` of a tile; `row_start >= row_end` is an idle tile.

    From the routing schedule (rows of the expert-sorted order), or with `SLOT_TILES` (T = 1: no routing launch)
    tile = slot: one row, the slot's own, its expert read from the ids, and no row at all when that expert is another
    rank's (which is then never read)."""
    if SLOT_TILES:
        expert = tl.load(ids_ptr + tile).to(tl.int64) - LOCAL_LO
        row_start = tile
        row_end = tl.where((expert >= 0) & (expert < NUM_EXPERTS), tile + 1, tile)
    else:
        row_start = tl.load(tile_row_start_ptr + tile)
        row_end = tl.load(tile_row_end_ptr + tile)
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    return row_start, row_end, expert


@triton.jit
def _tile_slots(sorted_slot_ptr, offs_m, m_mask, SLOT_TILES: tl.constexpr):
    """The slot of each row: `sorted_slot[row]`, or the row itself with `SLOT_TILES`."""
    if SLOT_TILES:
        return offs_m
    else:
        return tl.load(sorted_slot_ptr + offs_m, mask=m_mask, other=0)


@triton.jit
def _gate_up_swiglu_kernel(
    x_ptr, sorted_slot_ptr, tile_row_start_ptr, tile_row_end_ptr, tile_expert_ptr, ids_ptr,
    w_ptr, s_ptr, act_ptr,
    stride_xt, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_am,
    H, INTER, UP_OFFSET, TOP_K, LOCAL_LO, NUM_EXPERTS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr,
    DECODE_ASM: tl.constexpr, DOT_PRECISION: tl.constexpr, SWIGLU_LIMIT: tl.constexpr, SLOT_TILES: tl.constexpr,
):
    """One M tile of one expert x `BLOCK_N/2` columns of I: a `[BLOCK_N, BLOCK_K]` weight tile holds the gate rows
    (first half) and the matching up rows (second half), `UP_OFFSET` elements after them (`I * stride_wn` in one
    gate_up stack; from the gate stack to a separate up stack of the same strides, their distance); `acc[rows,
    tokens]`, SwiGLU in the epilogue (clamped when `SWIGLU_LIMIT` is not None). FP4 scales are rows of one
    `[E, 2I, H/32]` stack."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    num_n_blocks = tl.cdiv(INTER, HALF_N)
    tile = tl.program_id(0) // num_n_blocks
    n_block = tl.program_id(0) % num_n_blocks
    row_start, row_end, expert = _program_tile(tile, tile_row_start_ptr, tile_row_end_ptr, tile_expert_ptr, ids_ptr,
                                               LOCAL_LO, NUM_EXPERTS, SLOT_TILES)
    if row_start >= row_end:
        return
    offs_m = row_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row_end
    dot_dtype = x_ptr.dtype.element_ty
    slot = _tile_slots(sorted_slot_ptr, offs_m, m_mask, SLOT_TILES)
    x_rows = x_ptr + (slot // TOP_K).to(tl.int64)[:, None] * stride_xt
    offs_r = tl.arange(0, BLOCK_N)
    col = n_block * HALF_N + offs_r % HALF_N
    w_rows = col + (offs_r // HALF_N) * INTER
    w_mask = col < INTER
    w_row_ptrs = w_ptr + expert * stride_we + col * stride_wn + (offs_r // HALF_N) * UP_OFFSET
    s_expert = s_ptr + expert * stride_se
    acc = _weight_rows_times_tokens(x_rows, m_mask, w_row_ptrs, s_expert, w_rows, w_mask, 0, H, stride_wk, stride_sn,
                                    BLOCK_M, BLOCK_N, BLOCK_K, FP4, DECODE_ASM, DOT_PRECISION, dot_dtype)
    # Round as the source does: each GEMM output, silu and the product are all in x's dtype.
    gate, up = tl.split(tl.permute(tl.reshape(acc.to(dot_dtype), (2, HALF_N, BLOCK_M)), (2, 1, 0)))
    act = swiglu_rounded(gate, up, dot_dtype, SWIGLU_LIMIT)
    out_col = n_block * HALF_N + tl.arange(0, HALF_N)
    tl.store(act_ptr + offs_m[:, None].to(tl.int64) * stride_am + out_col[None, :], act,
             mask=m_mask[:, None] & (out_col[None, :] < INTER))


@triton.jit
def _down_kernel(
    act_ptr, sorted_slot_ptr, tile_row_start_ptr, tile_row_end_ptr, tile_expert_ptr, ids_ptr,
    w_ptr, s_ptr, slot_out_ptr,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_os, stride_om,
    H, INTER, LOCAL_LO, NUM_EXPERTS, K_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr,
    DECODE_ASM: tl.constexpr, DOT_PRECISION: tl.constexpr, SLOT_TILES: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """One M tile of one expert x `BLOCK_N` columns of H: `acc[rows, tokens]`, stored (rounded to x's dtype) to each
    slot's own row of `slot_out`; the router weight is applied by the combine.

    With `SPLIT_K` > 1 (decode), program `split` sums only K columns `[split * K_SPLIT, (split + 1) * K_SPLIT)` and
    stores its fp32 partial, unrounded, to `slot_out[split]`; the combine adds the partials in split order and rounds
    the sum to x's dtype once (the source's rounding of the down output; only the fp32 summation order differs)."""
    num_n_blocks = tl.cdiv(H, BLOCK_N)
    if SPLIT_K == 1:
        program = tl.program_id(0)
        k_lo = 0
        k_hi = INTER
    else:
        program = tl.program_id(0) // SPLIT_K
        split = tl.program_id(0) % SPLIT_K
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(INTER, k_lo + K_SPLIT)
    tile = program // num_n_blocks
    n_block = program % num_n_blocks
    row_start, row_end, expert = _program_tile(tile, tile_row_start_ptr, tile_row_end_ptr, tile_expert_ptr, ids_ptr,
                                               LOCAL_LO, NUM_EXPERTS, SLOT_TILES)
    if row_start >= row_end:
        return
    offs_m = row_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row_end
    dot_dtype = act_ptr.dtype.element_ty
    a_rows = act_ptr + offs_m[:, None].to(tl.int64) * stride_am
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    w_row_ptrs = w_ptr + expert * stride_we + offs_n * stride_wn
    s_expert = s_ptr + expert * stride_se
    acc = _weight_rows_times_tokens(a_rows, m_mask, w_row_ptrs, s_expert, offs_n, n_mask, k_lo, k_hi, stride_wk,
                                    stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, FP4, DECODE_ASM, DOT_PRECISION, dot_dtype)
    slot = _tile_slots(sorted_slot_ptr, offs_m, m_mask, SLOT_TILES).to(tl.int64)
    out_rows = slot_out_ptr + slot[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_rows, tl.trans(acc.to(dot_dtype)), mask=m_mask[:, None] & n_mask[None, :])
    else:
        tl.store(out_rows + split.to(tl.int64) * stride_os, tl.trans(acc), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _slot_row(slot_out_ptr, row_index, offs_h, mask, stride_os, stride_om, SPLIT_K: tl.constexpr,
              OUT_DTYPE: tl.constexpr):
    """One slot's down-projection output row as fp32: a row in x's dtype, or (split K) the sum of its fp32 partials in
    split order, rounded once to x's dtype."""
    row = tl.load(slot_out_ptr + row_index * stride_om + offs_h, mask=mask, other=0.0).to(tl.float32)
    if SPLIT_K > 1:
        for split in tl.static_range(1, SPLIT_K):
            row += tl.load(slot_out_ptr + split * stride_os + row_index * stride_om + offs_h, mask=mask, other=0.0)
        row = row.to(OUT_DTYPE).to(tl.float32)
    return row


@triton.jit
def _combine_kernel(
    slot_out_ptr, row_of_slot_ptr, expert_ids_ptr, router_ptr, out_ptr, stride_os, stride_om, stride_ot, H, LOCAL_LO,
    LOCAL_HI, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, ROUTER_DTYPE: tl.constexpr, PRODUCT_DTYPE: tl.constexpr,
    ROW_MAP: tl.constexpr, SPLIT_K: tl.constexpr, UNROLL: tl.constexpr,
):
    """Token t = sum over its slots j = 0..k-1, in that order and in fp32, of `round(out * round(router))`.

    The router weight is first rounded to `ROUTER_DTYPE` and the product to `PRODUCT_DTYPE` (FP4 op: both x's
    dtype; HF op: the router's own dtype and the promoted dtype). Non-local slots are skipped unread. With
    `ROW_MAP`, slot s's output is row `row_of_slot[s]` of `slot_out` (the expert-sorted rows of `grouped_mm`); with
    `SPLIT_K` > 1 it is the sum of `SPLIT_K` fp32 partials (`_slot_row`).

    `UNROLL`: the k slots unrolled with masked loads (a masked-off load reads nothing), so all k rows are in flight
    at once; otherwise a loop that branches per slot (each iteration waits for its id, then its row). Same sums.
    """
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    out_dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if UNROLL:
        for j in tl.static_range(TOP_K):
            slot = token * TOP_K + j
            expert = tl.load(expert_ids_ptr + slot).to(tl.int64)
            is_local = (expert >= LOCAL_LO) & (expert < LOCAL_HI)
            router = tl.load(router_ptr + slot, mask=is_local, other=0.0).to(ROUTER_DTYPE).to(tl.float32)
            if ROW_MAP:
                row_index = tl.load(row_of_slot_ptr + slot, mask=is_local, other=0).to(tl.int64)
            else:
                row_index = slot
            # `offs_h < H` where the slot is local, nothing elsewhere (one compare: the interpreter mistypes
            # `h_mask & is_local` with a scalar `is_local`)
            row_mask = offs_h < tl.where(is_local, H, 0)
            row = _slot_row(slot_out_ptr, row_index, offs_h, row_mask, stride_os, stride_om, SPLIT_K, out_dtype)
            total = tl.where(is_local, total + (row * router).to(PRODUCT_DTYPE).to(tl.float32), total)
    else:
        for j in range(TOP_K):
            slot = token * TOP_K + j
            expert = tl.load(expert_ids_ptr + slot).to(tl.int64)
            is_local = (expert >= LOCAL_LO) & (expert < LOCAL_HI)
            if is_local:
                router = tl.load(router_ptr + slot).to(ROUTER_DTYPE).to(tl.float32)
                row_index = tl.load(row_of_slot_ptr + slot).to(tl.int64) if ROW_MAP else slot
                row = _slot_row(slot_out_ptr, row_index, offs_h, h_mask, stride_os, stride_om, SPLIT_K, out_dtype)
                total += (row * router).to(PRODUCT_DTYPE).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs_h, total.to(out_dtype), mask=h_mask)


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------


def moe_default_config(num_slots: int, num_experts: int, fp4: bool = True, tokens: int | None = None) -> dict:
    """Tile sizes and schedule from static shapes only (slots = T*k, local experts, weight format, T if known).

    BLOCK_M (tokens: the MMA's N dimension) covers 1.5x the mean rows per expert, from 16 up to 256: at decode
    nearly every expert needs one tile, so each weight is read and decoded once; at prefill a 256-token tile halves
    the FP4 decode work per MMA flop against 128. BLOCK_N 128 weight rows = two warpgroups of 64 with 8 warps, so
    no warpgroup decodes another's rows. FP4 decode tiles use BLOCK_K 64 with 6 stages: 63 registers (sm_90,
    triton 3.9), so four CTAs share an SM and hide each other's load and wgmma latency (BLOCK_K 128 needs 138
    registers: one CTA per SM). Prefill tiles are the largest that compile without spills.

    Schedule keys (all but `split_k` change only which programs run and how many launches, not one result bit):
    - `compact_tiles`: the tile list is `min(T*k, T*k // BLOCK_M + E)` long (a used tile holds at least one slot),
      not `T*k // BLOCK_M + E`: at decode with many experts nearly every program of the old grid was idle (T=1,
      E=256: 8192 programs per GEMM for 192 with work);
    - `slot_tiles` (default at T = 1): one tile per slot read straight from the ids, no routing launch (a slot
      sharing its expert with another would read that expert's weights again: only T = 1 is sure not to);
    - `split_k` (default 1): the down GEMM's K split into that many slices, fp32 partials summed by the combine
      (changes the fp32 summation order of the down projection, nothing else);
    - `combine_unroll`: the combine's k slots unrolled with masked loads.
    `LEGACY_SCHEDULE` restores the schedule before these keys.
    """
    rows_per_expert = max(1, -(-3 * num_slots // (2 * num_experts)))
    block_m = min(256, max(16, next_power_of_2(rows_per_expert)))
    config = {"block_m": block_m, "block_n1": 128, "block_n2": 128, "num_warps": 8, "compact_tiles": True,
              "slot_tiles": tokens == 1, "split_k": 1, "combine_unroll": True}
    if block_m <= 64:  # bandwidth-bound decode: deep pipelines keep weight bytes in flight
        return {**config, "block_k": 64, "num_stages": 6} if fp4 else {**config, "block_k": 128, "num_stages": 4}
    return {**config, "block_k": 64, "num_stages": 4 if block_m == 128 else 3}


# The schedule before the decode keys above (the launches and grids measured on the H200 at V4-Flash shapes: T=1
# 0.166 ms), run by today's kernels.
LEGACY_SCHEDULE = {"compact_tiles": False, "slot_tiles": False, "split_k": 1, "combine_unroll": False}


# Decode tile candidates on top of the defaults (benchmarks/moe_experts_gpu.py --v4-flash --decode-sweep times each;
# the offline sm_90 compile test builds each). Shared memory per CTA at BM 16 with bf16 weights (triton 3.9) and
# CTAs per SM by shared memory (227 KB): default BN128 BK128 4 stages 144 KB (1), BN64 4 warps 80 KB (2), BN64 5
# stages 100 KB (2), BN32 6 stages 60 KB (3; BN < 64 runs mma.sync, not wgmma), BK64 8 stages 144 KB (1).
DECODE_CANDIDATES = {
    "legacy": LEGACY_SCHEDULE,
    "default": {},
    "routed": {"slot_tiles": False},
    "bn64": {"block_n1": 64, "block_n2": 64, "num_warps": 4},
    "bn64_s5": {"block_n1": 64, "block_n2": 64, "num_warps": 4, "num_stages": 5},
    "bn32_s6": {"block_n1": 32, "block_n2": 32, "num_warps": 4, "num_stages": 6},
    "bk64_s8": {"block_k": 64, "num_stages": 8},
    "split2": {"split_k": 2},
    "split4": {"split_k": 4},
    "bn64_split2": {"block_n1": 64, "block_n2": 64, "num_warps": 4, "split_k": 2},
}


def down_splits(inter: int, split_k: int, block_k: int) -> tuple[int, int]:
    """`(slices, K per slice)` of the down GEMM for `split_k`: slices of whole BLOCK_K steps, every one non-empty (so
    there may be fewer than `split_k`)."""
    k_split = cdiv(cdiv(inter, split_k), block_k) * block_k
    return cdiv(inter, k_split), k_split


def num_schedule_tiles(num_slots: int, num_experts: int, block_m: int, compact: bool = True) -> int:
    """Length of the tile list: each local expert with c slots uses ceil(c / BLOCK_M) tiles, which is at most
    `c // BLOCK_M + 1` and at most c; summed over the experts, at most `T*k // BLOCK_M + E` and (`compact`) at
    most T*k."""
    bound = num_slots // block_m + num_experts
    return min(num_slots, bound) if compact else bound


def local_expert_keys(expert_ids: torch.Tensor, num_experts: int, local_expert_offset: int) -> torch.Tensor:
    """Each slot's (flattened `expert_ids`) local expert, int64; `num_experts` for a slot of another rank's expert
    (outside [offset, offset + num_experts)), so that sorting by it puts those slots last."""
    local = expert_ids.reshape(-1).to(torch.int64) - local_expert_offset
    return torch.where((local >= 0) & (local < num_experts), local, num_experts)


def _sort_by_expert(key: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the slots stably sorted by `local_expert_keys`' key, int64; each local expert's slot count [E], int64)."""
    sorted_slot = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return sorted_slot, counts[:num_experts]


def build_tile_schedule(expert_ids: torch.Tensor, num_experts: int, local_expert_offset: int, block_m: int,
                        compact: bool = True):
    """Expert-sorted slot order and a fixed-length tile list, with torch ops only (no `.item()`, static shapes).

    Non-local slots sort after every local one and are covered by no tile. Returns `(sorted_slot [T*k] int32,
    tile_row_start, tile_row_end, tile_expert)`, each tile list of length `num_schedule_tiles(T*k, E, block_m,
    compact)`; a tile with `start >= end` is idle.
    """
    key = local_expert_keys(expert_ids, num_experts, local_expert_offset)
    sorted_slot, counts = _sort_by_expert(key, num_experts)
    sorted_slot = sorted_slot.to(torch.int32)
    starts = torch.cumsum(counts, 0) - counts
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    max_tiles = num_schedule_tiles(key.numel(), num_experts, block_m, compact)
    tile = torch.arange(max_tiles, device=key.device)
    tile_expert = torch.searchsorted(tile_end, tile, right=True)
    used = tile_expert < num_experts
    expert = tile_expert.clamp(max=num_experts - 1)
    row_start = starts[expert] + (tile - (tile_end - tiles_per_expert)[expert]) * block_m
    row_end = torch.where(used, starts[expert] + counts[expert], torch.zeros_like(row_start))
    return (sorted_slot, row_start.to(torch.int32), row_end.to(torch.int32), expert.to(torch.int32))


@triton.jit
def _routing_keys(ids_ptr, offs, N, LOCAL_LO, NUM_EXPERTS, E_PAD: tl.constexpr):
    """Per slot its local expert, `NUM_EXPERTS` for another rank's, `E_PAD` (matches no bucket) past the end."""
    local = tl.load(ids_ptr + offs, mask=offs < N, other=0).to(tl.int64) - LOCAL_LO
    key = tl.where((local >= 0) & (local < NUM_EXPERTS), local, NUM_EXPERTS).to(tl.int32)
    return tl.where(offs < N, key, E_PAD)


@triton.jit
def _routing_kernel(
    ids_ptr, rank_ptr, sorted_slot_ptr, tile_row_start_ptr, tile_row_end_ptr, tile_expert_ptr, row_token_ptr,
    row_of_slot_ptr, N, LOCAL_LO, NUM_EXPERTS, MAX_TILES, TOP_K,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, ROW_MAPS: tl.constexpr,
):
    """`build_tile_schedule` in one program (one launch instead of ~35 small torch ops): a stable counting sort.

    Pass 1 walks the slots in order, chunk by chunk: a one-hot `[CHUNK, E_PAD]` of the bucket and its running
    cumsum give each slot its rank within its bucket (the bucket counts carry over chunks). Bucket starts are the
    exclusive cumsum of the counts (other ranks' bucket `NUM_EXPERTS` last); pass 2 scatters each slot to
    `start + rank`. The tile list then follows from the per-expert tile counts as in the torch version.
    ROW_MAPS: pass 2 also writes each sorted row's token (slot // TOP_K) and each slot's row (-1 for another
    rank's slot), `build_row_routing`'s maps.
    """
    buckets = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, N, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        onehot = (_routing_keys(ids_ptr, offs, N, LOCAL_LO, NUM_EXPERTS, E_PAD)[:, None] == buckets[None, :])
        onehot = onehot.to(tl.int32)
        rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + counts[None, :]), axis=1)
        tl.store(rank_ptr + offs, rank, mask=offs < N)
        counts += tl.sum(onehot, axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    for c0 in range(0, N, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        keys = _routing_keys(ids_ptr, offs, N, LOCAL_LO, NUM_EXPERTS, E_PAD)
        onehot = keys[:, None] == buckets[None, :]
        position = tl.sum(onehot.to(tl.int32) * starts[None, :], axis=1) + tl.load(rank_ptr + offs, mask=offs < N)
        tl.store(sorted_slot_ptr + position, offs, mask=offs < N)
        if ROW_MAPS:
            tl.store(row_token_ptr + position, offs // TOP_K, mask=offs < N)
            tl.store(row_of_slot_ptr + offs, tl.where(keys < NUM_EXPERTS, position, -1), mask=offs < N)
    is_expert = buckets < NUM_EXPERTS
    local_counts = tl.where(is_expert, counts, 0)
    tiles = (local_counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    tile_begin = tile_end - tiles
    for t0 in range(0, MAX_TILES, CHUNK):
        tile = t0 + tl.arange(0, CHUNK)
        expert = tl.sum(((tile_end[None, :] <= tile[:, None]) & is_expert[None, :]).to(tl.int32), axis=1)
        used = expert < NUM_EXPERTS
        expert = tl.minimum(expert, NUM_EXPERTS - 1)
        pick = (buckets[None, :] == expert[:, None]).to(tl.int32)
        start = tl.sum(pick * starts[None, :], axis=1)
        row_start = start + (tile - tl.sum(pick * tile_begin[None, :], axis=1)) * BLOCK_M
        row_end = tl.where(used, start + tl.sum(pick * local_counts[None, :], axis=1), 0)
        tl.store(tile_row_start_ptr + tile, row_start, mask=tile < MAX_TILES)
        tl.store(tile_row_end_ptr + tile, row_end, mask=tile < MAX_TILES)
        tl.store(tile_expert_ptr + tile, expert, mask=tile < MAX_TILES)


def build_tile_schedule_triton(expert_ids: torch.Tensor, num_experts: int, local_expert_offset: int, block_m: int,
                               compact: bool = True):
    """Same outputs as `build_tile_schedule` (identical sorted order and used tiles) from one Triton launch."""
    return _launch_routing(expert_ids, num_experts, local_expert_offset, block_m, compact, row_maps=False)[:4]


def _launch_routing(expert_ids, num_experts, local_expert_offset, block_m, compact, row_maps):
    """`_routing_kernel`'s launch: (sorted_slot, row_start, row_end, tile_expert, row_token, row_of_slot), the last
    two unwritten without `row_maps`."""
    flat = expert_ids.reshape(-1)
    n = flat.numel()
    max_tiles = num_schedule_tiles(n, num_experts, block_m, compact)
    e_pad = next_power_of_2(num_experts + 1)
    sorted_slot, rank, row_token, row_of_slot = (torch.empty(n, dtype=torch.int32, device=flat.device)
                                                 for _ in range(4))
    row_start, row_end, tile_expert = (torch.empty(max_tiles, dtype=torch.int32, device=flat.device)
                                       for _ in range(3))
    # Chunks of 2048 one-hot entries: 16 registers per [CHUNK, E_PAD] tensor with 4 warps (8192 spilled on 3.6).
    _routing_kernel[(1,)](flat, rank, sorted_slot, row_start, row_end, tile_expert, row_token, row_of_slot, n,
                          local_expert_offset, num_experts, max_tiles, expert_ids.shape[-1], BLOCK_M=block_m,
                          E_PAD=e_pad, CHUNK=max(16, 2048 // e_pad), ROW_MAPS=row_maps, num_warps=4)
    return sorted_slot, row_start, row_end, tile_expert, row_token, row_of_slot


def build_row_routing(expert_ids: torch.Tensor, num_experts: int, local_expert_offset: int, block_m: int):
    """The routing of GEMMs that gather their activation rows (the block-scaled experts): `(row_token, row_of_slot,
    (tile_expert, tile_row_start, tile_row_end))`. Row r of the expert-sorted order (`build_tile_schedule`'s,
    stable, other ranks' slots last) reads token `row_token[r]`; slot s lies at row `row_of_slot[s]`, -1 when its
    expert is another rank's; the compact tile list of `block_m` rows is `build_tile_schedule`'s. All int32, on the
    device, no host sync: one Triton launch up to TRITON_ROUTING_MAX_SLOTS slots (~35 torch ops, each a launch,
    otherwise), torch ops past it."""
    if expert_ids.numel() <= TRITON_ROUTING_MAX_SLOTS:
        _, row_start, row_end, tile_expert, row_token, row_of_slot = _launch_routing(
            expert_ids.contiguous(), num_experts, local_expert_offset, block_m, True, row_maps=True)
        return row_token, row_of_slot, (tile_expert, row_start, row_end)
    sorted_slot, row_start, row_end, tile_expert = build_tile_schedule(expert_ids, num_experts, local_expert_offset,
                                                                       block_m)
    is_local = local_expert_keys(expert_ids, num_experts, local_expert_offset) < num_experts
    row_of_slot = rows_of_slots(sorted_slot, is_local)
    return (sorted_slot // expert_ids.shape[-1]), row_of_slot, (tile_expert, row_start, row_end)


def rows_of_slots(order: torch.Tensor, is_local: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of an expert-sorted slot order (`order[row]` = slot): each slot's row, in order's dtype; -1 for the
    slots `is_local` marks as another rank's."""
    rows = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    row_of_slot = torch.empty_like(rows).scatter_(0, order.long(), rows)
    return row_of_slot if is_local is None else torch.where(is_local, row_of_slot, -1)


# The inline-PTX bf16 decode for bf16 activations on CUDA (`fp4_decode_bf16_pair`); False falls back to the fp32 decode.
FP4_DECODE_PTX = True

# One program walks all slots: worth it while the ~35 launches of the torch version dominate (decode sizes).
TRITON_ROUTING_MAX_SLOTS = 8192


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to tf32 on the GPU."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _contiguous_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _moe_config(T, top_k, num_experts, fp4, config):
    cfg = moe_default_config(T * top_k, num_experts, fp4, tokens=T)
    cfg.update(config or {})
    if cfg["block_k"] % 64 or cfg["block_n1"] % 2:
        raise ValueError(f"moe_experts: block_k must be a multiple of 64 and block_n1 even, got {cfg}")
    if not isinstance(cfg["split_k"], int) or cfg["split_k"] < 1:
        raise ValueError(f"moe_experts: split_k must be a positive int, got {cfg['split_k']!r}")
    return cfg


def _moe_experts_triton(x, expert_ids, expert_weights, w13, w13_scale, w2, w2_scale, local_expert_offset, inter,
                        fp4, router_dtype, product_dtype, swiglu_limit, config, up=None):
    """Shared launcher of both ops; `w13_scale`/`w2_scale` are ignored (any tensor) when `fp4` is False, and `up`
    (plain weights only) is the up stack when `w13` holds the gate alone."""
    T = x.shape[0]
    cfg = _moe_config(T, expert_ids.shape[1], w13.shape[0], fp4, config)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    expert_ids = expert_ids.contiguous()
    router = expert_weights.contiguous().reshape(-1)
    _, slot_out = _expert_gemms(x, expert_ids, w13, w13_scale, w2, w2_scale, local_expert_offset, inter, fp4,
                                swiglu_limit, cfg, up=up)
    _combine(slot_out, None, expert_ids, router, out, local_expert_offset, w13.shape[0], router_dtype, product_dtype,
             unroll=bool(cfg["combine_unroll"]))
    return out


def _expert_gemms(x, expert_ids, w13, w13_scale, w2, w2_scale, local_expert_offset, inter, fp4, swiglu_limit, cfg,
                  buffers=None, up=None):
    """Routing (unless `slot_tiles`) and both GEMMs for T >= 1 and contiguous ids: `(act [T*k, I], slot_out [splits,
    T*k, H])`, rows of act in the tiles' row order, of slot_out by slot; `buffers` = that pair, preallocated (tests
    fill them with a sentinel to see which rows the kernels write). Plain weights are read in place through their
    strides (a stack stored `[E, K, N]` comes as its transposed view), the up rows from `up` if given, else from the
    second half of `w13`; FP4 bytes and scales are read K-contiguous."""
    T, H = x.shape
    top_k = expert_ids.shape[1]
    num_experts = w13.shape[0]
    x = _contiguous_last(x)
    if fp4:
        w13, w13_scale, w2, w2_scale = (_contiguous_last(t) for t in (w13, w13_scale, w2, w2_scale))
    if up is None:
        up_offset = inter * w13.stride(1)
    else:
        if up.stride() != w13.stride():  # the tile reads gate and up rows with one set of strides
            w13, up = w13.contiguous(), up.contiguous()
        up_offset = (up.data_ptr() - w13.data_ptr()) // w13.element_size()
    block_m = cfg["block_m"]
    num_slots = T * top_k
    slot_tiles = bool(cfg["slot_tiles"])
    if slot_tiles:  # tile = slot: the GEMMs read the ids; the schedule arguments are never dereferenced
        flat_ids = expert_ids.reshape(-1)
        sorted_slot = row_start = row_end = tile_expert = flat_ids
        num_tiles = num_slots
    else:
        use_triton_routing = cfg.get("triton_routing", num_slots <= TRITON_ROUTING_MAX_SLOTS)
        schedule = build_tile_schedule_triton if use_triton_routing else build_tile_schedule
        sorted_slot, row_start, row_end, tile_expert = schedule(expert_ids, num_experts, local_expert_offset, block_m,
                                                                compact=bool(cfg["compact_tiles"]))
        num_tiles = row_start.numel()
    precision = _dot_precision(x.dtype)
    decode_asm = fp4 and x.is_cuda and x.dtype == torch.bfloat16 and cfg.get("decode_asm", FP4_DECODE_PTX)
    splits, k_split = down_splits(inter, cfg["split_k"], cfg["block_k"])
    if buffers is not None:
        act, slot_out = buffers
    else:
        act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
        # Split K: fp32 partials, one [T*k, H] plane per slice, summed by the combine.
        slot_out = torch.empty(splits, num_slots, H, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    _gate_up_swiglu_kernel[(num_tiles * cdiv(inter, cfg["block_n1"] // 2),)](
        x, sorted_slot, row_start, row_end, tile_expert, expert_ids, w13, w13_scale, act,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), w13_scale.stride(0), w13_scale.stride(1),
        act.stride(0), H, inter, up_offset, top_k, local_expert_offset, num_experts,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n1"], BLOCK_K=cfg["block_k"], FP4=fp4, DECODE_ASM=decode_asm,
        DOT_PRECISION=precision, SWIGLU_LIMIT=None if swiglu_limit is None else float(swiglu_limit),
        SLOT_TILES=slot_tiles, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    _down_kernel[(num_tiles * cdiv(H, cfg["block_n2"]) * splits,)](
        act, sorted_slot, row_start, row_end, tile_expert, expert_ids, w2, w2_scale, slot_out,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), w2_scale.stride(0), w2_scale.stride(1),
        slot_out.stride(0), slot_out.stride(1), H, inter, local_expert_offset, num_experts, k_split,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n2"], BLOCK_K=cfg["block_k"], FP4=fp4, DECODE_ASM=decode_asm,
        DOT_PRECISION=precision, SLOT_TILES=slot_tiles, SPLIT_K=splits,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return act, slot_out


def _combine(slot_out, row_of_slot, expert_ids, router, out, local_expert_offset, num_experts, router_dtype,
             product_dtype, unroll=True):
    """`slot_out`: `[rows, H]` in x's dtype, or `[splits, rows, H]` (x's dtype for one plane, fp32 partials for
    more)."""
    T, H = out.shape
    planes = slot_out if slot_out.dim() == 3 else slot_out.unsqueeze(0)
    block_h = min(1024, next_power_of_2(H))
    _combine_kernel[(T, cdiv(H, block_h))](
        planes, expert_ids if row_of_slot is None else row_of_slot, expert_ids, router, out, planes.stride(0),
        planes.stride(1), out.stride(0), H, local_expert_offset, local_expert_offset + num_experts,
        TOP_K=expert_ids.shape[1], BLOCK_H=block_h, ROUTER_DTYPE=_TL_DTYPES[router_dtype],
        PRODUCT_DTYPE=_TL_DTYPES[product_dtype], ROW_MAP=row_of_slot is not None, SPLIT_K=planes.shape[0],
        UNROLL=unroll,
    )


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, act_ptr, rows, INTER, stride_g, stride_u, stride_a, SWIGLU_LIMIT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """act = silu(gate) * up of the gate and up rows (the halves of one `[gate | up]` output, or two GEMMs'), rounded
    as `_gate_up_swiglu_kernel`'s epilogue rounds."""
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (offs_r < rows)[:, None] & (offs_i < INTER)[None, :]
    dtype = act_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + offs_r[:, None] * stride_g + offs_i[None, :], mask=ok, other=0.0)
    up = tl.load(up_ptr + offs_r[:, None] * stride_u + offs_i[None, :], mask=ok, other=0.0)
    tl.store(act_ptr + offs_r[:, None] * stride_a + offs_i[None, :], swiglu_rounded(gate, up, dtype, SWIGLU_LIMIT),
             mask=ok)


@triton.jit
def swiglu_rounded(gate, up, dtype: tl.constexpr, SWIGLU_LIMIT: tl.constexpr, ACCURATE: tl.constexpr = False):
    """`swiglu` on tiles of the halves in `dtype`, rounded as the source rounds: each clamp, silu and the product in
    `dtype` (torch clamps in fp32 and rounds once; the bounds keep NaN as torch.clamp does). ACCURATE: silu's exp
    and division as torch's CUDA silu computes them (libdevice `expf`, an IEEE division), so the rounded activation
    is torch's bit for bit; otherwise the approximate instructions, within an ulp of it before rounding."""
    gate = gate.to(tl.float32)
    if SWIGLU_LIMIT is not None:
        gate = tl.minimum(gate, SWIGLU_LIMIT, propagate_nan=tl.PropagateNan.ALL).to(dtype).to(tl.float32)
        up = tl.maximum(up.to(tl.float32), -SWIGLU_LIMIT, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(up, SWIGLU_LIMIT, propagate_nan=tl.PropagateNan.ALL).to(dtype)
    if ACCURATE:
        silu = tl.div_rn(gate, 1.0 + exp_as_torch(-gate, True))
    else:
        silu = gate / (1.0 + tl.exp(-gate))
    return (silu.to(dtype).to(tl.float32) * up.to(tl.float32)).to(dtype)


def expert_sorted_slots(expert_ids: torch.Tensor, num_experts: int, local_expert_offset: int):
    """(slots sorted by local expert, stably, other ranks' last; cumulative local row counts as int32 `offs`):
    device ops only, no host sync."""
    sorted_slot, counts = _sort_by_expert(local_expert_keys(expert_ids, num_experts, local_expert_offset),
                                          num_experts)
    return sorted_slot, torch.cumsum(counts, 0).to(torch.int32)


def _moe_experts_grouped_mm(x, expert_ids, router, gate_up, down, local_expert_offset, router_dtype, product_dtype,
                            swiglu_limit, up=None):
    """Plain weights at prefill sizes: the two GEMMs in `torch._grouped_mm` (CUTLASS on sm90), the gathered rows in
    expert order, SwiGLU and the combine in Triton; separate gate and up stacks take one grouped GEMM each. Rows of
    other ranks' slots sit past the last offset, which `grouped_mm` leaves unwritten and the combine never reads."""
    T, H = x.shape
    num_experts = gate_up.shape[0]
    inter = down.shape[2]
    sorted_slot, offs = expert_sorted_slots(expert_ids, num_experts, local_expert_offset)
    rows = x.index_select(0, sorted_slot // expert_ids.shape[1])
    gate = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs)
    up_rows = gate[:, inter:] if up is None else torch._grouped_mm(rows, up.transpose(-2, -1), offs=offs)
    act = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    block_r, block_i = 16, min(256, next_power_of_2(inter))
    _swiglu_kernel[(cdiv(rows.shape[0], block_r), cdiv(inter, block_i))](
        gate, up_rows, act, rows.shape[0], inter, gate.stride(0), up_rows.stride(0), act.stride(0),
        SWIGLU_LIMIT=None if swiglu_limit is None else float(swiglu_limit), BLOCK_R=block_r, BLOCK_I=block_i)
    slot_out = torch._grouped_mm(act, down.transpose(-2, -1), offs=offs)
    row_of_slot = rows_of_slots(sorted_slot)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _combine(slot_out, row_of_slot, expert_ids, router, out, local_expert_offset, num_experts, router_dtype,
             product_dtype)
    return out


def _grouped_mm_reads(weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes `weight [E, N, K]` transposed in place: one of N and K contiguous, the other's
    stride 16-byte aligned and spanning the contiguous dim, the start 16-byte aligned (its stride checks)."""
    stride_n, stride_k = weight.stride(1), weight.stride(2)
    n, k = weight.shape[1:]
    if stride_k == 1:
        spans, step = stride_n >= max(1, k), stride_n
    elif stride_n == 1:
        spans, step = stride_k >= max(1, n), stride_k
    else:
        return False
    return spans and step % 8 == 0 and weight.data_ptr() % 16 == 0


def _grouped_mm_applies(x: torch.Tensor, gate_up: torch.Tensor, num_slots: int, down: torch.Tensor,
                        up: torch.Tensor | None = None) -> bool:
    """CUTLASS grouped GEMMs (sm90+, bf16, 16-byte aligned rows) beat the Triton GEMMs once experts get prefill-sized
    row counts (the Triton tiles' `block_m` reaches 128); at decode sizes the Triton swap-AB tiles win. Stacks in a
    layout `grouped_mm` cannot read go to the Triton GEMMs, which read any strides (never a copy)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0) or x.shape[1] % 8 or down.shape[2] % 8:
        return False
    if not all(_grouped_mm_reads(w) for w in (gate_up, down, up) if w is not None):
        return False
    return moe_default_config(num_slots, gate_up.shape[0], fp4=False)["block_m"] >= 128


def moe_experts_fp4_triton(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    local_expert_offset: int = 0,
    swiglu_limit: float | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Routing, two FP4 grouped GEMMs and the combine (CUDA, or CPU tensors under TRITON_INTERPRET).

    No host sync and every shape depends on input shapes only, so it can be captured in a CUDA graph. Expert ids
    are not range-checked here (that would sync): out-of-range ids count as non-local and are never dereferenced.
    """
    _check_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale, local_expert_offset)
    check_swiglu_limit("moe_experts_fp4", swiglu_limit)
    return _moe_experts_triton(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                               local_expert_offset, w13_packed.shape[1] // 2, True, x.dtype, x.dtype, swiglu_limit,
                               config)


def moe_experts_bf16_triton(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    local_expert_offset: int = 0,
    swiglu_limit: float | None = None,
    up: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """The same pipeline on plain weights (x's dtype, any strides, the up stack apart or not), with HF's
    router-weight promotion in the combine; at prefill sizes on sm90+ the GEMMs run in `torch._grouped_mm` instead
    where it reads the stacks' layout (`config={"gemm": "triton" | "grouped_mm"}` forces either)."""
    _check_inputs_bf16(x, expert_ids, expert_weights, gate_up, down, local_expert_offset, up)
    check_swiglu_limit("moe_experts_bf16", swiglu_limit)
    product_dtype = torch.promote_types(x.dtype, expert_weights.dtype)
    gemm = (config or {}).get("gemm") or ("grouped_mm" if _grouped_mm_applies(x, gate_up, expert_ids.numel(), down,
                                                                              up) else "triton")
    if gemm == "grouped_mm" and x.shape[0]:
        return _moe_experts_grouped_mm(_contiguous_last(x), expert_ids.contiguous(),
                                       expert_weights.contiguous().reshape(-1), gate_up, down, local_expert_offset,
                                       expert_weights.dtype, product_dtype, swiglu_limit, up)
    config = {k: v for k, v in (config or {}).items() if k != "gemm"}
    return _moe_experts_triton(x, expert_ids, expert_weights, gate_up, gate_up, down, down, local_expert_offset,
                               down.shape[2], False, expert_weights.dtype, product_dtype, swiglu_limit, config, up)


# ---------------------------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("dsfuse::moe_experts_fp4", mutates_args=())
def moe_experts_fp4(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    local_expert_offset: int = 0,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """FP4 routed experts; the default (CPU) implementation is the reference."""
    return moe_experts_reference(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                 local_expert_offset, swiglu_limit)


@moe_experts_fp4.register_fake
def _moe_experts_fp4_fake(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                          local_expert_offset=0, swiglu_limit=None):
    _check_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale, local_expert_offset)
    check_swiglu_limit("moe_experts_fp4", swiglu_limit)
    return x.new_empty(x.shape)


@direct_kernel(moe_experts_fp4)
def _moe_experts_fp4_cuda(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                          local_expert_offset=0, swiglu_limit=None):
    return moe_experts_fp4_triton(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                  local_expert_offset, swiglu_limit)


@torch.library.custom_op("dsfuse::moe_experts_bf16", mutates_args=())
def moe_experts_bf16(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    local_expert_offset: int = 0,
    swiglu_limit: float | None = None,
    up: torch.Tensor | None = None,
) -> torch.Tensor:
    """HF `grouped_mm`-style routed experts on plain weights; the default (CPU) implementation is the reference.

    `gate_up [E, 2I, H]`, or with `up` the gate `[E, I, H]` and the up stack apart (DeepSeek's w1 / w3); every stack
    is read through its strides, so one stored `[E, K, N]` is passed as its `.transpose(1, 2)` view, never copied."""
    return moe_experts_bf16_reference(x, expert_ids, expert_weights, gate_up, down, local_expert_offset, swiglu_limit,
                                      up)


@moe_experts_bf16.register_fake
def _moe_experts_bf16_fake(x, expert_ids, expert_weights, gate_up, down, local_expert_offset=0, swiglu_limit=None,
                           up=None):
    _check_inputs_bf16(x, expert_ids, expert_weights, gate_up, down, local_expert_offset, up)
    check_swiglu_limit("moe_experts_bf16", swiglu_limit)
    return x.new_empty(x.shape)


@direct_kernel(moe_experts_bf16)
def _moe_experts_bf16_cuda(x, expert_ids, expert_weights, gate_up, down, local_expert_offset=0, swiglu_limit=None,
                           up=None):
    return moe_experts_bf16_triton(x, expert_ids, expert_weights, gate_up, down, local_expert_offset, swiglu_limit,
                                   up)
