"""Routed SwiGLU experts on block-scaled weights, one op: what transformers' `FP8Experts` computes with
`experts_implementation="grouped_mm"` for a released DeepSeek V3.2 / GLM-5 (FP8 experts, 128 x 128 block scales) or
V4-Flash (FP4 experts, E8M0 per 32) checkpoint.

    slots      the T x k (token, expert) pairs of `expert_ids`, sorted by local expert (other ranks' last)
    h          = fp8_grouped_linear(x[slot token], gate_up, gate_up_scale)          [slots, 2I]
    act        = silu(gate) * up of h's halves, in x's dtype (clamped at `swiglu_limit` as V4 does)
    y          = fp8_grouped_linear(act, down, down_scale)                          [slots, H]
    out        = sum over each token's k slots, in slot order, of y * router weight (torch's type promotion),
                 rounded to x's dtype once

`fp8_grouped_linear` quantises each row's activations per 128 channels (W8A8, as the checkpoint's kernels do), so
gathering the rows first or after changes nothing. Slots whose expert is not local (expert parallelism) add nothing.

`dsfuse::moe_experts_fp8(x [T, H], expert_ids [T, k], expert_weights [T, k], gate_up [E, 2I, H] e4m3 (FP4:
[E, 2I, H / 2] bytes), gate_up_scale, down [E, H, I] (FP4: [E, H, I / 2]), down_scale, block_n, block_k,
local_expert_offset=0, swiglu_limit=None) -> [T, H]`.

On CUDA the routing is computed on the device (no host sync) and both GEMMs are `fp8_linear`'s grouped Triton GEMM.
"""

from __future__ import annotations

import torch

from dsfuse.kernels.fp8_linear import (OUT_DTYPES, fp8_grouped_linear_reference, fp8_grouped_linear_triton,
                                       weight_dims)
from dsfuse.kernels.moe_experts import check_ids_non_negative, check_swiglu_limit, swiglu
from dsfuse.kernels.triton_support import direct_kernel


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


def _experts(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n, block_k,
             local_expert_offset, swiglu_limit, grouped_linear):
    """The op's math with `grouped_linear` for both GEMMs; only device ops, so no host sync on CUDA."""
    T, top_k = expert_ids.shape
    E = gate_up.shape[0]
    local = expert_ids.reshape(-1).long() - local_expert_offset
    is_local = (local >= 0) & (local < E)
    key = torch.where(is_local, local, E)
    _, order = torch.sort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device).scatter_add_(
        0, key, torch.ones_like(key, dtype=torch.int32))
    offsets = counts[:E].cumsum(0, dtype=torch.int32)
    h = grouped_linear(x[order // top_k], gate_up, gate_up_scale, offsets, block_n, block_k)
    y = grouped_linear(swiglu(*h.chunk(2, dim=-1), swiglu_limit), down, down_scale, offsets, block_n, block_k)
    weighted = y * expert_weights.reshape(-1)[order].unsqueeze(-1)
    weighted = torch.where(is_local[order].unsqueeze(-1), weighted, 0)
    in_slot_order = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return in_slot_order.view(T, top_k, -1).sum(dim=1).to(x.dtype)


def moe_experts_fp8_reference(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n,
                              block_k, local_expert_offset=0, swiglu_limit=None):
    _check(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, local_expert_offset, swiglu_limit)
    check_ids_non_negative("moe_experts_fp8", expert_ids)
    return _experts(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n, block_k,
                    local_expert_offset, swiglu_limit, fp8_grouped_linear_reference)


def moe_experts_fp8_triton(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n,
                           block_k, local_expert_offset=0, swiglu_limit=None):
    """The CUDA path (or CPU tensors under TRITON_INTERPRET): negative ids count as another rank's."""
    _check(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, local_expert_offset, swiglu_limit)
    return _experts(x, expert_ids, expert_weights, gate_up, gate_up_scale, down, down_scale, block_n, block_k,
                    local_expert_offset, swiglu_limit, fp8_grouped_linear_triton)


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
