"""Routed SwiGLU experts on block-scaled weights, one op: what transformers' `FP8Experts` computes with
`experts_implementation="grouped_mm"` for a released DeepSeek V3.2 / GLM-5 (FP8 experts, 128 x 128 block scales) or
V4-Flash (FP4 experts, E8M0 per 32) checkpoint.

    slots      the T x k (token, expert) pairs of `expert_ids`, sorted by local expert (other ranks' last)
    h          = fp8_grouped_linear(x[slot token], gate_up, gate_up_scale)          [slots, 2I]
    act        = silu(gate) * up of h's halves, in x's dtype (clamped at `swiglu_limit` as V4 does)
    y          = fp8_grouped_linear(act, down, down_scale)                          [slots, H]
    out        = sum over each token's k slots, in slot order, of y * router weight (torch's type promotion),
                 accumulated in fp32 and rounded once (to the product's dtype, then x's)

`fp8_grouped_linear` quantises each row's activations per 128 channels (W8A8, as the checkpoint's kernels do), so
gathering the rows first or after changes nothing. Slots whose expert is not local (expert parallelism) add nothing.

`dsfuse::moe_experts_fp8(x [T, H], expert_ids [T, k], expert_weights [T, k], gate_up [E, 2I, H] e4m3 (FP4:
[E, 2I, H / 2] bytes), gate_up_scale, down [E, H, I] (FP4: [E, H, I / 2]), down_scale, block_n, block_k,
local_expert_offset=0, swiglu_limit=None) -> [T, H]`.

On CUDA the routing is computed on the device (no host sync; one launch up to `TRITON_ROUTING_MAX_SLOTS` slots) and
both GEMMs are `fp8_linear`'s grouped Triton GEMM over the same tile list; each token is quantised once and read by
its slots inside the first GEMM, SwiGLU and the second GEMM's quantisation are one pass over the first GEMM's output,
and the combine is one kernel that reads the second GEMM's rows where they lie (instead of a gathered copy of x, a
weighted fp32 copy of y, its scatter back to slot order and a sum, each a pass over memory).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from dsfuse.kernels.fp8_linear import (OUT_DTYPES, fp8_grouped_linear_reference, grouped_block_m,
                                       grouped_gemm_quantized, quantize_for_weight, weight_dims)
from dsfuse.kernels.moe_experts import (build_row_routing, check_ids_non_negative, check_swiglu_limit,
                                        expert_sorted_slots, local_expert_keys, rows_of_slots, swiglu)
from dsfuse.kernels.triton_support import cdiv, direct_kernel


def _check(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, local_expert_offset,
           swiglu_limit):
    op = "moe_experts_fp8"
    if x.dim() != 2 or x.dtype not in OUT_DTYPES:
        raise ValueError(f"{op}: x must be [T, H] in one of {OUT_DTYPES}, got {x.dtype}{list(x.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0] or expert_ids.dtype.is_floating_point:
        raise ValueError(f"{op}: expert_ids must be integer [T = {x.shape[0]}, k], got "
                         f"{expert_ids.dtype}{list(expert_ids.shape)}")
    if expert_weights.shape != expert_ids.shape or not expert_weights.dtype.is_floating_point:
        raise ValueError(f"{op}: expert_weights must be float {list(expert_ids.shape)}, got "
                         f"{expert_weights.dtype}{list(expert_weights.shape)}")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(f"{op}: gate_up and down must be [E, ...] stacks of one E, got {list(gate_up.shape)} and "
                         f"{list(down.shape)}")
    if gate_up.dtype != down.dtype:
        raise ValueError(f"{op}: gate_up and down must share a format, got {gate_up.dtype} and {down.dtype}")
    two_i, H = weight_dims(gate_up)
    down_h, inter = weight_dims(down)
    if two_i % 2 or H != x.shape[1] or (down_h, inter) != (H, two_i // 2):
        raise ValueError(f"{op}: weights must be gate_up [E, 2I, H] and down [E, H, I] with H = {x.shape[1]}, got "
                         f"[.., {two_i}, {H}] and [.., {down_h}, {inter}]")
    if local_expert_offset < 0:
        raise ValueError(f"{op}: local_expert_offset must be >= 0, got {local_expert_offset}")
    check_swiglu_limit(op, swiglu_limit)
    for t in (expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale):
        if t.device != x.device:
            raise ValueError(f"{op}: all inputs must be on {x.device}, found {t.device}")


def _combine_reference(y, row_of_slot, expert_weights, dtype):
    """Each token's sum over its k slots, in slot order, of y[row_of_slot[slot]] * router weight (torch's type
    promotion), slots of other ranks (row -1) adding zero; accumulated in fp32 and rounded once (to the product's
    dtype, then `dtype`)."""
    T, top_k = expert_weights.shape
    in_slot_order = y[row_of_slot.clamp(min=0).long()] * expert_weights.reshape(-1).unsqueeze(-1)
    in_slot_order = torch.where((row_of_slot >= 0).unsqueeze(-1), in_slot_order, 0).view(T, top_k, -1)
    total = torch.zeros((T, y.shape[-1]), dtype=torch.float32, device=y.device)
    for slot in range(top_k):
        total = total + in_slot_order[:, slot].float()
    return total.to(in_slot_order.dtype).to(dtype)


def _experts_reference(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n, block_k,
                       local_expert_offset, swiglu_limit):
    top_k = expert_ids.shape[1]
    order, offsets = expert_sorted_slots(expert_ids, gate_up.shape[0], local_expert_offset)
    h = fp8_grouped_linear_reference(x[order // top_k], gate_up, gate_up_scale, offsets, block_n, block_k)
    act = swiglu(*h.chunk(2, dim=-1), swiglu_limit)
    y = fp8_grouped_linear_reference(act, down, down_scale, offsets, block_n, block_k)
    is_local = local_expert_keys(expert_ids, gate_up.shape[0], local_expert_offset) < gate_up.shape[0]
    return _combine_reference(y, rows_of_slots(order, is_local), expert_weights, x.dtype)


@triton.jit
def _round_to_product(value, PRODUCT: tl.constexpr):
    """fp32 `value` rounded to the product's dtype (PRODUCT 0 fp32: as it is, 1 bf16, 2 fp16), kept in fp32."""
    if PRODUCT == 1:
        value = value.to(tl.bfloat16).to(tl.float32)
    if PRODUCT == 2:
        value = value.to(tl.float16).to(tl.float32)
    return value


@triton.jit
def _combine_kernel(y_ptr, row_of_slot_ptr, w_ptr, out_ptr, H, sy_m, so_m,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PRODUCT: tl.constexpr):
    """One token x BLOCK_H channels: sum over its slots in order of y[row] * weight (rounded to the product's dtype:
    PRODUCT 0 fp32, 1 bf16, 2 fp16); a slot with row -1 (another rank's) is skipped, its router weight unread (the
    reference adds zero: equal up to the sign of a zero); fp32 sum, rounded once."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(row_of_slot_ptr + t * TOP_K + j)
        if row >= 0:
            weight = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
            product = tl.load(y_ptr + row.to(tl.int64) * sy_m + cols, mask=ok, other=0.0).to(tl.float32) * weight
            total += _round_to_product(product, PRODUCT)
    tl.store(out_ptr + t.to(tl.int64) * so_m + cols, _round_to_product(total, PRODUCT).to(out_ptr.dtype.element_ty),
             mask=ok)


PRODUCT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _combine_triton(y, row_of_slot, expert_weights, dtype):
    """`_combine_reference` in one launch: y is read once, in place of the weighted copy, its slot-order scatter and
    the sum. `row_of_slot`: each slot's row of y, -1 for another rank's slot."""
    T, top_k = expert_weights.shape
    product = torch.promote_types(y.dtype, expert_weights.dtype)
    if product not in PRODUCT_CODES:
        return _combine_reference(y, row_of_slot, expert_weights, dtype)
    out = torch.empty((T, y.shape[-1]), dtype=dtype, device=y.device)
    block_h = 1024
    _combine_kernel[(T, cdiv(y.shape[-1], block_h))](
        y, row_of_slot, expert_weights.contiguous(), out, y.shape[-1], y.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, PRODUCT=PRODUCT_CODES[product])
    return out


def _experts_triton(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n, block_k,
                    local_expert_offset, swiglu_limit):
    """The reference's math with each token quantised once and read by its slots inside the first GEMM, both GEMMs
    writing only the local experts' rows over one tile list, and the combine reading the second GEMM's rows where
    they lie. Routing, the two GEMMs, SwiGLU with the second GEMM's quantisation, and the combine: five launches
    at decode sizes."""
    T, top_k = expert_ids.shape
    (two_i, H), slots = weight_dims(gate_up), T * top_k
    row_token, row_of_slot, tiles = build_row_routing(expert_ids, gate_up.shape[0], local_expert_offset,
                                                      grouped_block_m(slots, gate_up))
    h = torch.empty((slots, two_i), dtype=x.dtype, device=x.device)
    # activations passed unquantised: a decode-sized GEMM quantises them in its kernel (one launch less)
    grouped_gemm_quantized(x, None, row_token, gate_up, gate_up_scale, tiles, block_n, block_k, h)
    # SwiGLU and the quantisation in one pass over h: the activation is never written
    q, s = quantize_for_weight(h, down, down_scale, block_k, swiglu=(swiglu_limit,))
    y = torch.empty((slots, H), dtype=x.dtype, device=x.device)
    grouped_gemm_quantized(q, s, None, down, down_scale, tiles, block_n, block_k, y)
    return _combine_triton(y, row_of_slot, expert_weights, x.dtype)


def moe_experts_fp8_reference(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n,
                              block_k, local_expert_offset=0, swiglu_limit=None):
    _check(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, local_expert_offset, swiglu_limit)
    check_ids_non_negative("moe_experts_fp8", expert_ids)
    return _experts_reference(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n,
                              block_k, local_expert_offset, swiglu_limit)


def moe_experts_fp8_triton(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n,
                           block_k, local_expert_offset=0, swiglu_limit=None):
    """The CUDA path (or CPU tensors under TRITON_INTERPRET): negative ids count as another rank's."""
    _check(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, local_expert_offset, swiglu_limit)
    if x.shape[0] == 0 or expert_ids.shape[1] == 0:
        return torch.zeros_like(x)
    return _experts_triton(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n, block_k,
                           local_expert_offset, swiglu_limit)


@torch.library.custom_op("dsfuse::moe_experts_fp8", mutates_args=())
def moe_experts_fp8(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, block_n: int,
                    block_k: int, local_expert_offset: int = 0, swiglu_limit: float | None = None) -> torch.Tensor:
    """Routed experts on block-scaled FP8 / FP4 weights (see the module docstring); on the CPU, the reference."""
    return moe_experts_fp8_reference(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale,
                                     block_n, block_k, local_expert_offset, swiglu_limit)


@moe_experts_fp8.register_fake
def _moe_experts_fp8_fake(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n, block_k,
                          local_expert_offset=0, swiglu_limit=None):
    _check(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, local_expert_offset, swiglu_limit)
    return x.new_empty(x.shape)


@direct_kernel(moe_experts_fp8)
def _moe_experts_fp8_cuda(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n, block_k,
                          local_expert_offset=0, swiglu_limit=None):
    return moe_experts_fp8_triton(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n,
                                  block_k, local_expert_offset, swiglu_limit)

__all__ = ["moe_experts_fp8", "moe_experts_fp8_reference", "moe_experts_fp8_triton"]
