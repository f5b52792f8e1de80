"""Routed SwiGLU experts with FP4 weights (E2M1 nibbles + E8M0 per-32 scales), DeepSeek V3.2 / V4 style.

One custom op, `dsfuse::moe_experts_fp4`, with a plain-PyTorch reference (the CPU implementation and the numerics
contract: the math of `dsfuse.models.official.DsfuseFp4Experts.forward`) and a Triton CUDA path that never builds a
dequantised weight stack:

1. routing (torch ops, no host sync): slots whose expert is local are sorted by expert; a per-expert padded tile
   schedule of fixed length `T*k // BLOCK_M + E` is built with `cumsum` / `searchsorted`;
2. grouped GEMM 1: each program decodes FP4 gate and up rows of one expert in registers, runs two `tl.dot`s on the
   gathered token rows and applies SwiGLU in the epilogue, writing the activation `[slots, I]` in x's dtype;
3. grouped GEMM 2: decodes the down projection the same way and writes each slot's output times its router weight;
4. combine: each token sums its k slot outputs in fp32 in slot order (deterministic, no atomics), reading only the
   slots whose expert is local (expert parallelism: other ranks own the rest), and casts once.

Weights are `[E, N, K//2]` uint8 (low nibble = even element) with scales `[E, N, K//32]` uint8, as `quantize_fp4`
writes them. Expert ids are global; `local_expert_offset` says which `E` of them this rank holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsfuse.models.official import FP4_BLOCK_SIZE, dequantize_fp4

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


def _check_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale, local_expert_offset):
    """Shapes, dtypes and devices; raises with the offending argument's name."""
    if x.dim() != 2:
        raise ValueError(f"moe_experts_fp4: x must be [T, H], got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"moe_experts_fp4: x dtype {x.dtype} not in {_FLOAT_DTYPES}")
    T, H = x.shape
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T or expert_ids.shape[1] < 1:
        raise ValueError(f"moe_experts_fp4: expert_ids must be [T={T}, k>=1], got {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in _INDEX_DTYPES:
        raise TypeError(f"moe_experts_fp4: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if expert_weights.shape != expert_ids.shape:
        raise ValueError(
            f"moe_experts_fp4: expert_weights {tuple(expert_weights.shape)} must match expert_ids "
            f"{tuple(expert_ids.shape)}"
        )
    if expert_weights.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"moe_experts_fp4: expert_weights dtype {expert_weights.dtype} not in {_FLOAT_DTYPES}")
    for name, t in (("w13_packed", w13_packed), ("w13_scale", w13_scale), ("w2_packed", w2_packed),
                    ("w2_scale", w2_scale)):
        if t.dtype != torch.uint8:
            raise TypeError(f"moe_experts_fp4: {name} must be uint8, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"moe_experts_fp4: {name} must be 3-D, got {tuple(t.shape)}")
    E = w13_packed.shape[0]
    if E < 1:
        raise ValueError("moe_experts_fp4: need at least one local expert")
    if H % FP4_BLOCK_SIZE:
        raise ValueError(f"moe_experts_fp4: hidden size {H} is not a multiple of the FP4 block size {FP4_BLOCK_SIZE}")
    two_i = w13_packed.shape[1]
    if two_i % 2 or (two_i // 2) % FP4_BLOCK_SIZE or two_i == 0:
        raise ValueError(
            f"moe_experts_fp4: w13_packed dim 1 must be 2*I with I a positive multiple of {FP4_BLOCK_SIZE}, "
            f"got {two_i}"
        )
    inter = two_i // 2
    expected = {
        "w13_packed": (w13_packed, (E, 2 * inter, H // 2)),
        "w13_scale": (w13_scale, (E, 2 * inter, H // FP4_BLOCK_SIZE)),
        "w2_packed": (w2_packed, (E, H, inter // 2)),
        "w2_scale": (w2_scale, (E, H, inter // FP4_BLOCK_SIZE)),
    }
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"moe_experts_fp4: {name} must be {shape} for x {tuple(x.shape)}, got {tuple(t.shape)}")
    for name, t in (("expert_ids", expert_ids), ("expert_weights", expert_weights), ("w13_packed", w13_packed),
                    ("w13_scale", w13_scale), ("w2_packed", w2_packed), ("w2_scale", w2_scale)):
        if t.device != x.device:
            raise ValueError(f"moe_experts_fp4: {name} is on {t.device}, x is on {x.device}")
    if local_expert_offset < 0:
        raise ValueError(f"moe_experts_fp4: local_expert_offset must be >= 0, got {local_expert_offset}")


def moe_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    local_expert_offset: int = 0,
) -> torch.Tensor:
    """The own model's expert math, one local expert at a time; slots of other experts are skipped unread.

    Per slot, in x's dtype: `gate, up = (x @ w13^T).chunk(2)`, `silu(gate) * up`, `@ w2^T`, times the router
    weight cast to x's dtype. Each token's slots are then summed in fp32 in slot order and cast once. Expert ids
    must be in `[0, num_global_experts)`: negative ids raise.
    """
    _check_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale, local_expert_offset)
    if expert_ids.numel() and int(expert_ids.min()) < 0:
        raise ValueError(f"moe_experts_fp4: expert ids must be >= 0, got {int(expert_ids.min())}")
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
        activated = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out = (activated @ w2.t()) * flat_weights[slots].to(x.dtype).unsqueeze(-1)
        slot_out[slots] = out.float()
    return slot_out.view(T, top_k, -1).sum(dim=1).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# FP4 decode (shared by both GEMMs and tested on its own)
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def fp4_decode(nibble, scale_byte):
    """E2M1 nibble (int32, 0..15) times 2^(scale_byte - 127) as fp32, exactly as `dequantize_fp4` rounds it.

    The nibble moved into an fp16 (sign to bit 15, the 3 magnitude bits to bits 9-11) encodes `value * 2^-14`
    exactly (codes 0/1 land on fp16 zero/subnormal, the sign gives -0), so the only arithmetic is an exact widening
    and fp32 multiplies by powers of two; the scale is built from bits: byte 0 is the subnormal 2^-127, byte 255
    is NaN. Plain fp32 multiplies keep subnormals on the GPU (Triton applies FTZ to libdevice calls only).
    """
    half_bits = (((nibble & 8) << 12) | ((nibble & 7) << 9)).to(tl.int16)
    value = half_bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
    scale_int = scale_byte.to(tl.int32)
    scale_bits = tl.where(scale_int == 0, 0x00400000, scale_int << 23)
    scale_bits = tl.where(scale_int == 255, 0x7FC00000, scale_bits)
    return value * scale_bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_decode_table_kernel(packed_ptr, scale_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """Decodes `N` bytes with one scale byte each into `[N, 2]` fp32 (low nibble first): the decode under test."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + offs, mask=mask, other=127)
    tl.store(out_ptr + 2 * offs, fp4_decode(byte & 15, scale), mask=mask)
    tl.store(out_ptr + 2 * offs + 1, fp4_decode(byte >> 4, scale), mask=mask)


def fp4_decode_triton(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`packed [N]` uint8 with one E8M0 byte per packed byte -> `[N, 2]` fp32 through `fp4_decode`."""
    packed, scales = packed.contiguous(), scales.contiguous()
    out = torch.empty(packed.numel(), 2, dtype=torch.float32, device=packed.device)
    block = 256
    _fp4_decode_table_kernel[(triton.cdiv(packed.numel(), block),)](packed, scales, out, packed.numel(), BLOCK=block)
    return out


@triton.jit
def _load_fp4_tile(packed_row_ptr, scale_row_ptr, stride_pn, stride_sn, offs_n, n_mask, k0, K,
                   HALF_BK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Decode `[BN, BK]` weights of one expert as two `[BK/2, BN]` operands: even and odd K columns."""
    offs_byte = k0 // 2 + tl.arange(0, HALF_BK)
    byte_mask = n_mask[:, None] & (offs_byte[None, :] < K // 2)
    packed = tl.load(packed_row_ptr + offs_n[:, None] * stride_pn + offs_byte[None, :], mask=byte_mask, other=0)
    # Byte j holds elements 2j and 2j+1, both in scale block 2j // 32 = j // 16.
    scales = tl.load(scale_row_ptr + offs_n[:, None] * stride_sn + offs_byte[None, :] // 16, mask=byte_mask,
                     other=127)
    packed = packed.to(tl.int32)
    even = fp4_decode(packed & 15, scales).to(DOT_DTYPE)
    odd = fp4_decode(packed >> 4, scales).to(DOT_DTYPE)
    return tl.trans(even), tl.trans(odd)


# ---------------------------------------------------------------------------------------------------------------
# Grouped GEMMs and combine
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _gate_up_swiglu_kernel(
    x_ptr, sorted_slot_ptr, tile_row_start_ptr, tile_row_end_ptr, tile_expert_ptr,
    w_ptr, s_ptr, act_ptr,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_am,
    H, INTER, TOP_K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One M tile of one expert x one N block of I: gate and up accumulate side by side, SwiGLU in the epilogue."""
    num_n_blocks = tl.cdiv(INTER, BLOCK_N)
    tile = tl.program_id(0) // num_n_blocks
    n_block = tl.program_id(0) % num_n_blocks
    row_start = tl.load(tile_row_start_ptr + tile)
    row_end = tl.load(tile_row_end_ptr + tile)
    if row_start >= row_end:
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    dot_dtype = x_ptr.dtype.element_ty
    offs_m = row_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row_end
    slot = tl.load(sorted_slot_ptr + offs_m, mask=m_mask, other=0)
    token = (slot // TOP_K).to(tl.int64)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    half = tl.arange(0, BLOCK_K // 2)
    w_expert = w_ptr + expert * stride_we
    s_expert = s_ptr + expert * stride_se
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        cols = k0 + 2 * half
        a_mask = m_mask[:, None] & (cols[None, :] < H)
        a_row = x_ptr + token[:, None] * stride_xt + cols[None, :]
        a_even = tl.load(a_row, mask=a_mask, other=0.0)
        a_odd = tl.load(a_row + 1, mask=a_mask, other=0.0)
        g_even, g_odd = _load_fp4_tile(w_expert, s_expert, stride_wn, stride_sn, offs_n, n_mask, k0, H,
                                       BLOCK_K // 2, dot_dtype)
        acc_gate = tl.dot(a_even, g_even, acc_gate, input_precision=DOT_PRECISION)
        acc_gate = tl.dot(a_odd, g_odd, acc_gate, input_precision=DOT_PRECISION)
        u_even, u_odd = _load_fp4_tile(w_expert, s_expert, stride_wn, stride_sn, offs_n + INTER, n_mask, k0, H,
                                       BLOCK_K // 2, dot_dtype)
        acc_up = tl.dot(a_even, u_even, acc_up, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a_odd, u_odd, acc_up, input_precision=DOT_PRECISION)
    # Round as the source does: each GEMM output, silu and the product are all in x's dtype.
    gate = acc_gate.to(dot_dtype).to(tl.float32)
    up = acc_up.to(dot_dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dot_dtype).to(tl.float32)
    act = (silu * up).to(dot_dtype)
    tl.store(act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :], act,
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, sorted_slot_ptr, weight_ptr, tile_row_start_ptr, tile_row_end_ptr, tile_expert_ptr,
    w_ptr, s_ptr, slot_out_ptr,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    H, INTER,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One M tile of one expert x one N block of H; writes `out * router_weight` (both rounded to x's dtype)."""
    num_n_blocks = tl.cdiv(H, BLOCK_N)
    tile = tl.program_id(0) // num_n_blocks
    n_block = tl.program_id(0) % num_n_blocks
    row_start = tl.load(tile_row_start_ptr + tile)
    row_end = tl.load(tile_row_end_ptr + tile)
    if row_start >= row_end:
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    dot_dtype = act_ptr.dtype.element_ty
    offs_m = row_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row_end
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    half = tl.arange(0, BLOCK_K // 2)
    w_expert = w_ptr + expert * stride_we
    s_expert = s_ptr + expert * stride_se
    a_base = act_ptr + offs_m[:, None].to(tl.int64) * stride_am
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        cols = k0 + 2 * half
        a_mask = m_mask[:, None] & (cols[None, :] < INTER)
        a_even = tl.load(a_base + cols[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_base + cols[None, :] + 1, mask=a_mask, other=0.0)
        b_even, b_odd = _load_fp4_tile(w_expert, s_expert, stride_wn, stride_sn, offs_n, n_mask, k0, INTER,
                                       BLOCK_K // 2, dot_dtype)
        acc = tl.dot(a_even, b_even, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(a_odd, b_odd, acc, input_precision=DOT_PRECISION)
    slot = tl.load(sorted_slot_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    router = tl.load(weight_ptr + slot, mask=m_mask, other=0.0).to(dot_dtype).to(tl.float32)
    out = (acc.to(dot_dtype).to(tl.float32) * router[:, None]).to(dot_dtype)
    tl.store(slot_out_ptr + slot[:, None] * stride_om + offs_n[None, :], out,
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _combine_kernel(
    slot_out_ptr, expert_ids_ptr, out_ptr, stride_om, stride_ot, H, TOP_K, LOCAL_LO, LOCAL_HI,
    BLOCK_H: tl.constexpr,
):
    """Token t = sum over its slots j = 0..k-1, in that order, of the local slots' outputs, in fp32."""
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(TOP_K):
        slot = token * TOP_K + j
        expert = tl.load(expert_ids_ptr + slot).to(tl.int64)
        is_local = ((expert >= LOCAL_LO) & (expert < LOCAL_HI)).to(tl.int32)
        row_mask = h_mask & ((offs_h * 0 + is_local) != 0)
        row = tl.load(slot_out_ptr + slot * stride_om + offs_h, mask=row_mask, other=0.0)
        total += row.to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs_h, total.to(out_ptr.dtype.element_ty), mask=h_mask)


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------


def moe_default_config(num_slots: int, num_experts: int) -> dict:
    """Tile sizes from static shapes only: BLOCK_M covers 1.5x the mean rows per expert (up to 128), so that with
    few tokens nearly every expert needs one tile and its weights are decoded once (decode is ALU-bound)."""
    rows_per_expert = max(1, -(-3 * num_slots // (2 * num_experts)))
    block_m = min(128, max(16, triton.next_power_of_2(rows_per_expert)))
    # BLOCK_K 64 with 8 warps: the largest tiles that compile for sm_90 without register spills (ptxas, triton 3.9).
    return {"block_m": block_m, "block_n1": 64, "block_n2": 64, "block_k": 64, "num_warps": 8, "num_stages": 3}


def build_tile_schedule(expert_ids: torch.Tensor, num_experts: int, local_expert_offset: int, block_m: int):
    """Expert-sorted slot order and a fixed-length tile list, with torch ops only (no `.item()`, static shapes).

    Non-local slots sort after every local one and are covered by no tile. Returns `(sorted_slot [T*k] int32,
    tile_row_start, tile_row_end, tile_expert)`, each tile list of length `T*k // block_m + E`; a tile with
    `start >= end` is idle. The bound holds because each expert wastes less than one tile.
    """
    flat = expert_ids.reshape(-1).to(torch.int64) - local_expert_offset
    is_local = (flat >= 0) & (flat < num_experts)
    key = torch.where(is_local, flat, torch.full_like(flat, num_experts))
    sorted_slot = torch.sort(key, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    starts = torch.cumsum(counts, 0) - counts
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    max_tiles = flat.numel() // block_m + num_experts
    tile = torch.arange(max_tiles, device=flat.device)
    tile_expert = torch.searchsorted(tile_end, tile, right=True)
    used = tile_expert < num_experts
    expert = tile_expert.clamp(max=num_experts - 1)
    row_start = starts[expert] + (tile - (tile_end - tiles_per_expert)[expert]) * block_m
    row_end = torch.where(used, starts[expert] + counts[expert], torch.zeros_like(row_start))
    return (sorted_slot, row_start.to(torch.int32), row_end.to(torch.int32), expert.to(torch.int32))


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to tf32 on the GPU."""
    return "ieee" if dtype == torch.float32 else "tf32"


def moe_experts_fp4_triton(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    local_expert_offset: int = 0,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Routing, two FP4 grouped GEMMs and the combine (CUDA, or CPU tensors under TRITON_INTERPRET).

    No host sync and every shape depends on input shapes only, so it can be captured in a CUDA graph. Expert ids
    are not range-checked here (that would sync): out-of-range ids count as non-local and are never dereferenced.
    """
    _check_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale, local_expert_offset)
    T, H = x.shape
    top_k = expert_ids.shape[1]
    num_experts, two_i = w13_packed.shape[:2]
    inter = two_i // 2
    cfg = moe_default_config(T * top_k, num_experts)
    cfg.update(config or {})
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    expert_ids = expert_ids.contiguous()
    weights = expert_weights.contiguous().reshape(-1)
    w13_packed, w13_scale, w2_packed, w2_scale = (t if t.stride(-1) == 1 else t.contiguous()
                                                  for t in (w13_packed, w13_scale, w2_packed, w2_scale))
    block_m = cfg["block_m"]
    sorted_slot, row_start, row_end, tile_expert = build_tile_schedule(expert_ids, num_experts,
                                                                       local_expert_offset, block_m)
    num_tiles = row_start.numel()
    precision = _dot_precision(x.dtype)
    act = torch.empty(T * top_k, inter, dtype=x.dtype, device=x.device)
    _gate_up_swiglu_kernel[(num_tiles * triton.cdiv(inter, cfg["block_n1"]),)](
        x, sorted_slot, row_start, row_end, tile_expert, w13_packed, w13_scale, act,
        x.stride(0), w13_packed.stride(0), w13_packed.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        act.stride(0), H, inter, top_k,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n1"], BLOCK_K=cfg["block_k"], DOT_PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    slot_out = torch.empty(T * top_k, H, dtype=x.dtype, device=x.device)
    _down_kernel[(num_tiles * triton.cdiv(H, cfg["block_n2"]),)](
        act, sorted_slot, weights, row_start, row_end, tile_expert, w2_packed, w2_scale, slot_out,
        act.stride(0), w2_packed.stride(0), w2_packed.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        slot_out.stride(0), H, inter,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n2"], BLOCK_K=cfg["block_k"], DOT_PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](
        slot_out, expert_ids, out, slot_out.stride(0), out.stride(0), H, top_k,
        local_expert_offset, local_expert_offset + num_experts, BLOCK_H=block_h,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# Custom op
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
) -> torch.Tensor:
    """FP4 routed experts; the default (CPU) implementation is the reference."""
    return moe_experts_reference(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                 local_expert_offset)


@moe_experts_fp4.register_fake
def _moe_experts_fp4_fake(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                          local_expert_offset=0):
    _check_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale, local_expert_offset)
    return x.new_empty(x.shape)


@moe_experts_fp4.register_kernel("cuda")
def _moe_experts_fp4_cuda(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                          local_expert_offset=0):
    return moe_experts_fp4_triton(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                  local_expert_offset)
