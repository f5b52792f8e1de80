"""Fused DeepSeek V3.2 lightning-indexer score + exact top-k (`torch.ops.dsfuse.indexer_topk`).

Math (HF `DeepseekV32Indexer.forward`, plus the official fp8 form's per-key scale):

    scores[b,s,h,t] = relu((q[b,s,h] . k[b,t]) * softmax_scale)          (fp32)
    index[b,s,t]    = sum_h weights[b,s,h] * scores[b,s,h,t]  (* k_scale[b,t])
    index           = masked_fill(~mask, fill)  or  index + mask          (fill: -inf unless given)
    out             = index.topk(min(topk, T)).indices.int()

CUDA path, never materialising [B,S,H,T] nor [B,S,T]:
  1. `_row_range_kernel`: first/last unmasked key of every query row (read from the mask), so the
     scoring loop visits only key tiles that some row of its query block can see (causal = half).
  2. threshold: the scoring kernel in dense mode over a strided key sample ([B,S,T/step]), whose
     r-th largest value per row estimates the score that ~2k keys of the full row reach.
  3. `_score_filter_kernel`: tensor-core scores with keys on the MMA M dimension and (query, head)
     pairs on N (the head sum is then a reduction along accumulator rows, one FFMA chain per thread
     for 64 heads), appending every key whose score is >= the row threshold to a per-row candidate
     buffer of CAP entries (inline-PTX stores on CUDA: no layout conversions). Rows whose mask is
     exactly their unmasked range ("plain": causal, padding) read no mask at all.
  4. `_select_kernel`: per row, the certificate "count >= k and no overflow" (or "every unmasked key
     is a candidate, and enough keys lie outside the row's unmasked range to fill the rest"), then
     an exact radix (bitwise, at most 32 steps) select of the k-th largest key over the candidates; of the keys
     tied at the k-th score the lowest key indices win, as in CUDA's `torch.topk` (`indexer_topk_reference`).
  5. `_repair_kernel`: rows whose certificate failed are rescored in full into a per-program scratch
     row and selected exactly there. The sample only decides speed, never the answer.

A finite `fill` (a bool mask's masked keys scoring finfo.min, -1e9, 0, ...) is the source's own score for them:
such a key can outrank an unmasked key that scores below it, so step 1's ranges (which skip masked keys as if
they scored -inf) are off and every key is scored.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from dsfuse.kernels.triton_support import cdiv, direct_kernel, next_power_of_2

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)

# B*max(S,64)*T below this runs the default config: tuning would cost more than it saves
AUTOTUNE_MIN_WORK = 1 << 22

# how the filter kernel writes candidates; "none" is for benchmarks only (the output is garbage)
APPEND_MODES = {"store": 0, "asm": 1, "none": 2}
# config keys that fix the filter kernel's tiles (and so switch its autotuning off)
TILE_KEYS = {"block_q", "block_t", "splits", "num_warps", "num_stages"}
# what the filter kernel's autotune configs set (the rest of a launch's flags come from the caller)
AUTOTUNED_META = {"BLOCK_Q", "BLOCK_T", "num_warps", "num_stages"}

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADDITIVE = 2


# --------------------------------------------------------------------------------------------
# Reference (also the CPU implementation)
# --------------------------------------------------------------------------------------------
def indexer_topk_reference(q, k, weights, k_scale, mask, softmax_scale, topk, fill=None):
    """Plain PyTorch indexer top-k, the exact math of the HF module (fp32 upcast, relu after scale); a bool
    mask's masked keys score `fill` (None: -inf).

    Ties: keys whose scores equal the k-th largest are common (relu zeros in rows with fewer than k positive
    scores, -inf in rows with fewer than k unmasked keys). CUDA's `torch.topk` radix-selects the k-th value,
    then gathers in key order the keys above it and the first keys equal to it: of the tied keys, the lowest
    indices (`topk_lowest_index_ties`). The CUDA kernel picks that set, so dsfuse's picks are eager's on CUDA.
    This CPU reference calls `torch.topk` itself so that the op on CPU is eager on CPU; CPU `topk` breaks ties
    by `std::partial_sort` / `std::nth_element`, not always by lowest index."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * softmax_scale
    scores = torch.relu(scores)
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if k_scale is not None:
        index = index * k_scale.unsqueeze(1)
    if mask is not None:
        if mask.dtype == torch.bool:
            index = index.masked_fill(~mask, float("-inf") if fill is None else fill)
        else:
            index = index + mask
    width = min(topk, index.shape[-1])
    return index.topk(width, dim=-1).indices.to(torch.int32)


def topk_lowest_index_ties(index, width):
    """[..., width] int32: the top `width` of `index` along its last dim, of the keys tied at the k-th value the
    lowest indices (the kernel's and CUDA `torch.topk`'s set), by score descending then index.

    Order as the kernel's `_order_key`: NaN above +inf, every NaN equal, -0.0 equal to +0.0 (CUDA's radix puts
    -0.0 below +0.0; the kernel does not, because a head sum's zero sign depends on its summation order)."""
    bits = torch.where(index == 0, torch.zeros_like(index), index.float()).view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = torch.where(torch.isnan(index), torch.iinfo(torch.int32).max, key)
    return key.sort(dim=-1, descending=True, stable=True).indices[..., :width].to(torch.int32)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _validate(q, k, weights, k_scale, mask, topk, fill=None):
    if q.dim() != 4:
        raise ValueError(f"indexer_topk: q must be [B, S, H, D], got shape {tuple(q.shape)}")
    if k.dim() != 3:
        raise ValueError(f"indexer_topk: k must be [B, T, D], got shape {tuple(k.shape)}")
    B, S, H, D = q.shape
    T = k.shape[1]
    if k.shape[0] != B or k.shape[2] != D:
        raise ValueError(f"indexer_topk: k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} (need [B, T, D])")
    if tuple(weights.shape) != (B, S, H):
        raise ValueError(f"indexer_topk: weights must be [B, S, H] = {(B, S, H)}, got {tuple(weights.shape)}")
    if q.dtype not in INPUT_DTYPES or k.dtype != q.dtype:
        raise TypeError(
            f"indexer_topk: q and k must share one dtype among {INPUT_DTYPES}, got q {q.dtype}, k {k.dtype}"
        )
    if weights.dtype != torch.float32:
        raise TypeError(f"indexer_topk: weights must be float32, got {weights.dtype}")
    devices = {q.device, k.device, weights.device}
    if k_scale is not None:
        if tuple(k_scale.shape) != (B, T):
            raise ValueError(f"indexer_topk: k_scale must be [B, T] = {(B, T)}, got {tuple(k_scale.shape)}")
        if k_scale.dtype != torch.float32:
            raise TypeError(f"indexer_topk: k_scale must be float32, got {k_scale.dtype}")
        devices.add(k_scale.device)
    if mask is not None:
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise TypeError(f"indexer_topk: mask must be bool (True = keep) or floating (additive), got {mask.dtype}")
        if mask.dim() > 3:
            raise ValueError(f"indexer_topk: mask must be broadcastable to [B, S, T], got shape {tuple(mask.shape)}")
        target = (B, S, T)[3 - mask.dim():]
        for have, want in zip(mask.shape, target):
            if have != 1 and have != want:
                raise ValueError(
                    f"indexer_topk: mask shape {tuple(mask.shape)} is not broadcastable to [B, S, T] = {(B, S, T)}"
                )
        devices.add(mask.device)
    if len(devices) != 1:
        raise ValueError(f"indexer_topk: all tensors must be on one device, got {sorted(map(str, devices))}")
    if fill is not None and (mask is None or mask.dtype != torch.bool):
        raise ValueError("indexer_topk: fill is the masked keys' score under a bool mask; there is none")
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"indexer_topk: topk must be a positive int, got {topk!r}")


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _fma_halves(r, w, acc):
    """acc + r0*w0 + r1*w1 over the two halves of the last (size 2) dim, in that order."""
    r0, r1 = tl.split(r)
    w0, w1 = tl.split(w)
    acc = acc + r0 * w0
    return acc + r1 * w1


@triton.jit
def _fma_quarters(r, w, acc):
    r0, r1 = tl.split(r)
    w0, w1 = tl.split(w)
    return _fma_halves(r1, w1, _fma_halves(r0, w0, acc))


@triton.jit
def _fma_eighths(r, w, acc):
    r0, r1 = tl.split(r)
    w0, w1 = tl.split(w)
    return _fma_quarters(r1, w1, _fma_quarters(r0, w0, acc))


@triton.jit
def _fma_sixteenths(r, w, acc):
    r0, r1 = tl.split(r)
    w0, w1 = tl.split(w)
    return _fma_eighths(r1, w1, _fma_eighths(r0, w0, acc))


@triton.jit
def _head_sum_64(r, w, BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr):
    """sum_h r[:, q*64 + h] * w[q*64 + h] for 64 heads, as one FFMA chain per thread.

    `tl.sum` reduces a thread's 16 values as a tree (8 FMUL + 8 FFMA + 7 FADD per output); a chain is
    16 FFMA. Head bits 1-2 of a wgmma accumulator live on the 4 lanes of a quad, the other four
    bits in registers: split those four register bits off one by one (free, no data movement) and
    leave the lane bits for the final `tl.sum` (two shuffles). Measured offline (sm_90 SASS): 56
    fewer instructions per 64x256 tile."""
    r = _split_head_bits(r, BLOCK_T, BLOCK_Q)
    w = _split_head_bits(tl.broadcast_to(w[None, :], [BLOCK_T, BLOCK_Q * 64]), BLOCK_T, BLOCK_Q)
    part = _fma_sixteenths(r, w, tl.zeros([BLOCK_T, BLOCK_Q, 4], dtype=tl.float32))
    return tl.sum(part, axis=2)


@triton.jit
def _split_head_bits(x, BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr):
    """[BLOCK_T, BLOCK_Q*64] -> [keys, queries, lane bits (h2 h1), h5, h4, h3, h0].

    Shape and order are literals on purpose: triton 3.6 rejects a list bound to a `tl.constexpr`
    local as a shape (`object of type 'constexpr' has no len()`)."""
    return tl.permute(tl.reshape(x, [BLOCK_T, BLOCK_Q, 2, 2, 2, 4, 2]), (0, 1, 5, 2, 3, 4, 6))


@triton.jit
def _load_mask_tile(mask_ptr, mask_base, t, t_ok, rows64, row_ok, sms, smt, MASK_KIND: tl.constexpr):
    """The [len(t), len(rows64)] mask tile (bool as uint8, or additive); zeros when there is no mask."""
    if MASK_KIND == 1:
        m = tl.load(mask_ptr + mask_base + rows64[None, :] * sms + t[:, None] * smt,
                    mask=t_ok[:, None] & row_ok[None, :], other=0)
    elif MASK_KIND == 2:
        m = tl.load(mask_ptr + mask_base + rows64[None, :] * sms + t[:, None] * smt,
                    mask=t_ok[:, None] & row_ok[None, :], other=0.0).to(tl.float32)
    else:
        m = tl.zeros([t.shape[0], rows64.shape[0]], dtype=tl.int8)
    return m


@triton.jit
def _score_tile(
    k_ptr, ks_ptr, mask_ptr, k_base, ks_base, mask_base,
    t, t_ok, rows64, row_load, plain, first, last, d, d_ok, qT, w, h_real, softmax_scale, fill,
    skt, skd, skst, sms, smt,
    BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, HP: tl.constexpr, PAD_H: tl.constexpr,
    HAS_KSCALE: tl.constexpr, MASK_KIND: tl.constexpr, EXACT_FP32: tl.constexpr, EVEN_D: tl.constexpr, FOLD_SCALE: tl.constexpr,
    FP8_AS_FP16: tl.constexpr, HEAD_CHAIN: tl.constexpr, RANGE_MASK: tl.constexpr,
):
    """Scores of BLOCK_T keys against BLOCK_Q queries: [BLOCK_T, BLOCK_Q] fp32, mask applied.

    The mask tile is loaded after the MMA on purpose: loaded first (or a tile ahead), it no longer
    anchors the scores' layout, and the scan/stores fall back to a replicated layout with cross-warp
    scans (sm_90 SASS: 683 instead of 478 instructions and 8 instead of 2 barriers per tile).

    HEAD_CHAIN (HP == 64 only) sums the heads with `_head_sum_64`, else with `tl.sum`. Only rows in
    row_load read their mask; with RANGE_MASK, a `plain` row's mask is known from its unmasked range
    [first, last] (all keys inside it unmasked and neutral), so causal or padding masks cost no loads:
    the load stays in the code, predicated off, because it anchors the layout (see above).  PAD_H (H not a
    power of two) zeroes the padding heads' columns after the relu: their zero query times an Inf in k is NaN.
    A bool mask's masked keys score `fill` (-inf unless the caller's fill is finite; RANGE_MASK only with -inf)."""
    if EVEN_D:
        kt = tl.load(k_ptr + k_base + t[:, None] * skt + d[None, :] * skd, mask=t_ok[:, None], other=0.0)
    else:
        kt = tl.load(k_ptr + k_base + t[:, None] * skt + d[None, :] * skd, mask=t_ok[:, None] & d_ok[None, :],
                     other=0.0)
    if FP8_AS_FP16:
        kt = kt.to(tl.float16)
    if EXACT_FP32:
        acc = tl.dot(kt, qT, input_precision="ieee")
    else:
        acc = tl.dot(kt, qT)
    if not FOLD_SCALE:
        acc = acc * softmax_scale
    r = tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL)
    if PAD_H:
        r = tl.where(h_real[None, :], r, 0.0)
    if HEAD_CHAIN:
        sc = _head_sum_64(r, w, BLOCK_T, BLOCK_Q)
    else:
        sc = tl.sum(tl.reshape(r * w[None, :], [BLOCK_T, BLOCK_Q, HP]), axis=2)
    if HAS_KSCALE:
        sc = sc * tl.load(ks_ptr + ks_base + t * skst, mask=t_ok, other=0.0)[:, None]
    m = _load_mask_tile(mask_ptr, mask_base, t, t_ok, rows64, row_load, sms, smt, MASK_KIND)
    if RANGE_MASK:
        inside = (t[:, None] >= first[None, :]) & (t[:, None] <= last[None, :])
        if MASK_KIND == 1:
            sc = tl.where(tl.where(plain[None, :], inside, m != 0), sc, fill)
        if MASK_KIND == 2:  # -inf added, not assigned: NaN + -inf stays NaN as in the reference
            sc = tl.where(plain[None, :], tl.where(inside, sc, sc + float("-inf")), sc + m)
    else:
        if MASK_KIND == 1:
            sc = tl.where(m != 0, sc, fill)
        if MASK_KIND == 2:
            sc = sc + m
    return sc


@triton.jit
def _load_query_block(q_ptr, w_ptr, b, s0, S, H, D, sqb, sqs, sqh, sqd, swb, sws, swh, n_rows, softmax_scale,
                      BLOCK_Q: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, FOLD_SCALE: tl.constexpr,
                      FP8_AS_FP16: tl.constexpr):
    """q^T [DP, BLOCK_Q*HP] and weights [BLOCK_Q*HP] of queries s0..s0+n_rows-1 (zero padded), and which
    columns are real (query, head) pairs."""
    n = tl.arange(0, BLOCK_Q * HP)
    qi = n // HP
    h = n % HP
    s = s0 + qi
    col_ok = (qi < n_rows) & (s < S) & (h < H)
    d = tl.arange(0, DP)
    d_ok = d < D
    q_off = b * sqb + s.to(tl.int64)[None, :] * sqs + h[None, :] * sqh + d[:, None] * sqd
    qT = tl.load(q_ptr + q_off, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
    if FP8_AS_FP16:
        qT = qT.to(tl.float16)
    w = tl.load(w_ptr + b * swb + s.to(tl.int64) * sws + h * swh, mask=col_ok, other=0.0)
    if FOLD_SCALE:
        w = w * softmax_scale
    return qT, w, col_ok


@triton.jit
def _store_pair_asm(score_ptrs, idx_ptrs, score, idx, keep):
    """Predicated scattered stores of (score, index) pairs, as inline PTX.

    `tl.store` of a scattered pointer tensor makes Triton's coalesce pass move pointers, values and mask
    into its own blocked layout: four `convert_layout`s through shared memory and eight more CTA barriers
    per key tile. An elementwise asm op is not a memory op to that pass, so the stores stay in the
    layout the scores are computed in. Both pointer operands have one type: triton 3.6 type-checks the
    asm operands pairwise like a binary op and rejects `*fp32` beside `*i32`."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.ne.s32 p, $5, 0;
        @p st.global.b32 [$1], $3;
        @p st.global.b32 [$2], $4;
        mov.u32 $0, 0;
        }""",
        "=r,l,l,r,r,r",
        [score_ptrs.to(tl.pointer_type(tl.int32), bitcast=True), idx_ptrs, score.to(tl.int32, bitcast=True), idx,
         keep.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _score_filter_kernel(
    q_ptr, k_ptr, w_ptr, ks_ptr, mask_ptr, range_ptr, thr_ptr,
    cand_score_ptr, cand_idx_ptr, count_ptr, dense_ptr,
    S, T, H, D, softmax_scale, fill,
    sqb, sqs, sqh, sqd, skb, skt, skd, swb, sws, swh, sksb, skst, smb, sms, smt,
    CAP, tune_bucket, out_ptr, fail_ptr, K_OUT,
    HP: tl.constexpr, PAD_H: tl.constexpr, DP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr, HAS_KSCALE: tl.constexpr, MASK_KIND: tl.constexpr, USE_RANGES: tl.constexpr,
    DENSE: tl.constexpr, EXACT_FP32: tl.constexpr, EVEN_D: tl.constexpr, FOLD_SCALE: tl.constexpr,
    FP8_AS_FP16: tl.constexpr, APPEND: tl.constexpr, T_ALIGN: tl.constexpr, HEAD_CHAIN: tl.constexpr,
    FUSE_SELECT: tl.constexpr, CAP_P: tl.constexpr,
):
    """One query block x one split of its key range: dense scores (sample pass) or candidates >= threshold.

    APPEND picks how candidates are written: 0 `tl.store`, 1 inline-PTX stores in the layout the scores
    already have, 2 not at all (counts only; a benchmark of the kernel minus its append, wrong output).
    T_ALIGN is a power of two dividing T: when BLOCK_T divides it, key tiles need no bounds mask.
    FUSE_SELECT (SPLITS == 1, CAP == CAP_P) runs `_select_row` on the program's own rows after its key
    loop: no select launch, and that ALU-bound tail overlaps the MMA of the SM's other CTA."""
    num_qblocks = tl.num_programs(0)
    qblk = num_qblocks - 1 - tl.program_id(0)  # causal: the longest rows first, for a short tail
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    s0 = qblk * BLOCK_Q
    rows = s0 + tl.arange(0, BLOCK_Q)
    row_ok = rows < S
    rows64 = rows.to(tl.int64)
    flat_rows = b * S + rows64

    qT, w, h_real = _load_query_block(q_ptr, w_ptr, b, s0, S, H, D, sqb, sqs, sqh, sqd, swb, sws, swh, BLOCK_Q,
                              softmax_scale, BLOCK_Q, HP, DP, FOLD_SCALE, FP8_AS_FP16)
    d = tl.arange(0, DP)
    d_ok = d < D

    if USE_RANGES:
        first = T - tl.load(range_ptr + flat_rows * 3, mask=row_ok, other=0)
        last = tl.load(range_ptr + flat_rows * 3 + 1, mask=row_ok, other=0) - 1
        n_neutral = tl.load(range_ptr + flat_rows * 3 + 2, mask=row_ok, other=0)
        plain = n_neutral == tl.maximum(last - first + 1, 0)
        t_lo = tl.min(first, axis=0)
        t_hi = tl.max(last, axis=0) + 1
    else:
        first = tl.zeros([BLOCK_Q], dtype=tl.int32)
        last = first + T - 1
        plain = tl.zeros([BLOCK_Q], dtype=tl.int1)
        t_lo = tl.zeros([], dtype=tl.int32)
        t_hi = tl.zeros([], dtype=tl.int32) + T
    row_load = row_ok & ~plain
    tile_lo = t_lo // BLOCK_T
    tile_hi = tl.where(t_hi > t_lo, (t_hi + BLOCK_T - 1) // BLOCK_T, tile_lo)
    per_split = (tile_hi - tile_lo + SPLITS - 1) // SPLITS
    my_lo = tile_lo + split * per_split
    my_hi = tl.minimum(my_lo + per_split, tile_hi)

    if not DENSE:
        thr = tl.load(thr_ptr + flat_rows, mask=row_ok, other=float("inf"))
    count = tl.zeros([BLOCK_Q], dtype=tl.int32)
    for tile in range(my_lo, my_hi):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        if T_ALIGN % BLOCK_T == 0:  # tiles never cross T (the tile range ends at cdiv(T, BLOCK_T))
            t_ok = tl.full([BLOCK_T], 1, tl.int1)
        else:
            t_ok = t < T
        sc = _score_tile(k_ptr, ks_ptr, mask_ptr, b * skb, b * sksb, b * smb,
                         t, t_ok, rows64, row_load, plain, first, last, d, d_ok, qT, w, h_real, softmax_scale,
                         fill, skt, skd, skst, sms, smt,
                         BLOCK_T, BLOCK_Q, HP, PAD_H, HAS_KSCALE, MASK_KIND, EXACT_FP32, EVEN_D, FOLD_SCALE,
                         FP8_AS_FP16, HEAD_CHAIN, USE_RANGES)
        in_bounds = t_ok[:, None] & row_ok[None, :]
        if DENSE:
            tl.store(dense_ptr + flat_rows[None, :] * T + t[:, None], sc, mask=in_bounds)
        else:
            keep = in_bounds & (((sc >= thr[None, :]) & (sc != float("-inf"))) | (sc != sc))
            keep_i = keep.to(tl.int32)
            rank = tl.cumsum(keep_i, axis=0) - 1
            if SPLITS == 1:
                pos = count[None, :] + rank
                count += tl.sum(keep_i, axis=0)
            else:
                base = tl.atomic_add(count_ptr + flat_rows, tl.sum(keep_i, axis=0), mask=row_ok)
                pos = base[None, :] + rank
            dst = flat_rows[None, :] * CAP + pos
            room = keep & (pos < CAP)
            idx = t[:, None] + tl.zeros([BLOCK_T, BLOCK_Q], dtype=tl.int32)
            if APPEND == 0:
                tl.store(cand_score_ptr + dst, sc, mask=room)
                tl.store(cand_idx_ptr + dst, idx, mask=room)
            if APPEND == 1:
                _store_pair_asm(cand_score_ptr + dst, cand_idx_ptr + dst, sc, idx, room)
    if (not DENSE) and SPLITS == 1:
        tl.store(count_ptr + flat_rows, count, mask=row_ok)
        if FUSE_SELECT:
            tl.debug_barrier()  # every thread's candidate stores are visible to the whole CTA past this
            qi = tl.arange(0, BLOCK_Q)
            for r in range(BLOCK_Q):
                if s0 + r < S:
                    pick = qi == r
                    _select_row(b * S + s0 + r, tl.sum(tl.where(pick, count, 0), axis=0),
                                tl.sum(tl.where(pick, thr, 0.0), axis=0), tl.sum(tl.where(pick, first, 0), axis=0),
                                tl.sum(tl.where(pick, last, 0), axis=0), cand_score_ptr, cand_idx_ptr, out_ptr,
                                fail_ptr, T, K_OUT, CAP_P, 256)


@triton.jit
def _row_range_kernel(mask_ptr, range_ptr, S, T, smb, sms, smt, keys_per_program,
                      MASK_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """First and last unmasked key of a query row, and its count of neutral keys (bool True or additive
    exactly 0), over one chunk of its keys.

    Stored as (T - first, last + 1, n_neutral) with atomics into zeros, so a fully masked row reads
    back first = T, last = -1, and the buffer needs only a memset. A row whose neutral count equals
    last - first + 1 is "plain": its mask is exactly the range test first <= t <= last."""
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    t_begin = tl.program_id(1) * keys_per_program
    t_end = tl.minimum(t_begin + keys_per_program, T)
    first = tl.zeros([BLOCK], dtype=tl.int32) + T  # elementwise while scanning: one reduction at the end
    last = tl.zeros([BLOCK], dtype=tl.int32) - 1
    n_neutral = tl.zeros([BLOCK], dtype=tl.int32)
    for t0 in range(t_begin, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        ok = t < t_end
        if MASK_KIND == 1:
            m = tl.load(mask_ptr + b * smb + s * sms + t * smt, mask=ok, other=0)
            valid = ok & (m != 0)
            neutral = valid
        else:
            m = tl.load(mask_ptr + b * smb + s * sms + t * smt, mask=ok, other=float("-inf")).to(tl.float32)
            valid = ok & (m != float("-inf"))
            neutral = ok & (m == 0.0)
        first = tl.minimum(first, tl.where(valid, t, T))
        last = tl.maximum(last, tl.where(valid, t, -1))
        n_neutral += neutral.to(tl.int32)
    tl.atomic_max(range_ptr + row * 3, T - tl.min(first, axis=0))
    tl.atomic_max(range_ptr + row * 3 + 1, tl.max(last, axis=0) + 1)
    tl.atomic_add(range_ptr + row * 3 + 2, tl.sum(n_neutral, axis=0))


@triton.jit
def _order_key(sc):
    """Order-preserving map fp32 -> uint32 (1 and up; 0 marks empty slots), NaN above +inf like torch.topk.

    -0.0 maps to +0.0's key: CUDA's topk ranks it below +0.0, but a head sum of signed zeros is -0.0 in one
    summation order and +0.0 in another, so keys that tie at zero in eager must tie here too."""
    bits = tl.where(sc == 0.0, 0.0, sc).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(sc != sc, 0x7FFFFFFF, key)
    return key.to(tl.uint32, bitcast=True) ^ tl.full([], 0x80000000, tl.uint32)


@triton.jit
def _kth_largest_key(key, k, STOP_AT_K: tl.constexpr):
    """A v with #(key >= v) >= k (key 0 marks an empty slot; needs 1 <= k <= #non-empty), deciding one
    bit per step from the top, each step a CTA-wide count.

    Bits above the highest bit where the smallest and largest keys differ are common to every key
    and copied without counting (about the 9 sign and exponent bits of similar scores). Without
    STOP_AT_K the result is the largest such v, the k-th largest key itself. With it, the search
    stops as soon as exactly k keys are >= v: then "all keys > v, plus the first k - #(key > v) keys
    equal to v" (the caller's tie rule) still selects exactly the top k, in about half the steps."""
    one = tl.full([], 1, tl.uint32)
    lo = tl.min(tl.where(key != 0, key, tl.full([], 0xFFFFFFFF, tl.uint32)), axis=0)
    diff = lo ^ tl.max(key, axis=0)
    kth = tl.zeros([], dtype=tl.uint32)
    bit = 31
    while (bit >= 0) & (((diff >> tl.maximum(bit, 0)) & one) == 0):  # no shift by -1 once bit < 0
        kth = kth | (lo & (one << bit))
        bit -= 1
    n_at = tl.sum((key != 0).to(tl.int32), axis=0)  # keys >= kth: all non-empty ones
    if not STOP_AT_K:
        n_at = n_at + 1  # never equal to k: search every remaining bit
    while (bit >= 0) & (n_at != k):
        trial = kth | (one << bit)
        n_ge = tl.sum((key >= trial).to(tl.int32), axis=0)
        if n_ge >= k:
            kth = trial
            if STOP_AT_K:
                n_at = n_ge
        bit -= 1
    return kth


@triton.jit
def _mth_smallest_index(idx, member, m):
    """The m-th smallest of the distinct non-negative `idx` where `member` (needs 1 <= m <= #member), one bit per
    step from the top, each step a CTA-wide count; the high bits every member shares are copied without counting."""
    lo = tl.min(tl.where(member, idx, 0x7FFFFFFF), axis=0)
    diff = lo ^ tl.max(tl.where(member, idx, 0), axis=0)
    cut = tl.zeros([], dtype=tl.int32)
    bit = 30
    while (bit >= 0) & (((diff >> tl.maximum(bit, 0)) & 1) == 0):  # no shift by -1 once bit < 0
        cut = cut | (lo & (1 << bit))
        bit -= 1
    while bit >= 0:
        trial = cut | (1 << bit)
        if tl.sum((member & (idx < trial)).to(tl.int32), axis=0) < m:
            cut = trial
        bit -= 1
    return cut


@triton.jit
def _sample_threshold_kernel(sample_ptr, thr_ptr, n_sample, rank, CHUNK: tl.constexpr):
    """Per row, the rank-th largest sampled score (exact, bitwise search): the filter threshold.

    A row of at most CHUNK samples is loaded once and searched in registers; longer rows are
    re-read in chunks on each of the 32 steps."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNK)
    if n_sample <= CHUNK:
        ok = c < n_sample
        sc = tl.load(sample_ptr + row * n_sample + c, mask=ok, other=0.0)
        kth = _kth_largest_key(tl.where(ok, _order_key(sc), tl.zeros([CHUNK], dtype=tl.uint32)), rank, False)
    else:
        kth = tl.zeros([], dtype=tl.uint32)
        for bit_rank in range(32):
            trial = kth | (tl.full([], 1, tl.uint32) << (31 - bit_rank))
            n_ge = tl.zeros([], dtype=tl.int32)
            for t0 in range(0, n_sample, CHUNK):
                ok = t0 + c < n_sample
                sc = tl.load(sample_ptr + row * n_sample + t0 + c, mask=ok, other=0.0)
                key = tl.where(ok, _order_key(sc), tl.zeros([CHUNK], dtype=tl.uint32))
                n_ge += tl.sum((key >= trial).to(tl.int32), axis=0)
            kth = tl.where(n_ge >= rank, trial, kth)
    key32 = (kth ^ tl.full([], 0x80000000, tl.uint32)).to(tl.int32, bitcast=True)
    bits = key32 ^ ((key32 >> 31) & 0x7FFFFFFF)  # the signed order map is its own inverse
    tl.store(thr_ptr + row, bits.to(tl.float32, bitcast=True))


@triton.jit
def _select_row(row, count, thr, first, last, cand_score_ptr, cand_idx_ptr, out_ptr, fail_ptr, T, K_OUT,
                CAP_P: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """Certificate check and exact top-k over one row's candidates; flags the row for repair otherwise.

    count: the row's candidates; thr: its filter threshold; [first, last]: its unmasked key range.
    Tie rule (CUDA torch.topk's): of the keys equal to the k-th largest, the lowest key indices. Candidates
    are not in key order when the key range is split (atomic appends), so the rule looks at key indices:
    the m-th smallest index among the tied candidates bounds the picks."""
    outside = tl.where(last >= first, first + (T - 1 - last), T)
    fits = count <= CAP_P
    fast = fits & (count >= K_OUT)
    fill = fits & (count < K_OUT) & (thr == float("-inf")) & (outside >= K_OUT - count)
    i = tl.arange(0, CAP_P)
    ok = i < count
    out_row = out_ptr + row * K_OUT
    if fast:
        sc = tl.load(cand_score_ptr + row * CAP_P + i, mask=ok, other=0.0)
        key = tl.where(ok, _order_key(sc), tl.zeros([CAP_P], dtype=tl.uint32))
        kth = _kth_largest_key(key, K_OUT, True)
        gt = key > kth
        eq = ok & (key == kth)  # not the empty slots (key 0): kth is 0 when k keys share no high bit
        need = K_OUT - tl.sum(gt.to(tl.int32), axis=0)
        if tl.sum(eq.to(tl.int32), axis=0) > need:  # a tie straddles the k-th place
            tied = tl.load(cand_idx_ptr + row * CAP_P + i, mask=eq, other=0)
            sel = gt | (eq & (tied <= _mth_smallest_index(tied, eq, need)))
        else:
            sel = gt | eq
        pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        idx = tl.load(cand_idx_ptr + row * CAP_P + i, mask=sel, other=0)
        tl.store(out_row + pos, idx, mask=sel)
        tl.store(fail_ptr + row, 0)
    elif fill:
        idx = tl.load(cand_idx_ptr + row * CAP_P + i, mask=ok, other=0)
        # The fill appends the lowest keys outside [first, last]: torch.topk's -inf picks only when no key inside
        # is -inf too (a mask with holes, or an infinite score), i.e. when every key inside is a candidate. A key
        # outside the range is a candidate when its score is NaN (NaN + -inf under an additive mask): the fill
        # would pick it twice. Other rows go to repair (exact, in key order).
        in_range = tl.sum((ok & (idx >= first) & (idx <= last)).to(tl.int32), axis=0)
        if (in_range == count) & (count == tl.maximum(last - first + 1, 0)):
            tl.store(out_row + i, idx, mask=ok)
            n_fill = K_OUT - count
            for j0 in range(0, n_fill, FILL_BLOCK):
                j = j0 + tl.arange(0, FILL_BLOCK)
                t = tl.where(j < first, j, last + 1 + j - first)
                tl.store(out_row + count + j, t, mask=j < n_fill)
            tl.store(fail_ptr + row, 0)
        else:
            tl.store(fail_ptr + row, 1)
    else:
        tl.store(fail_ptr + row, 1)


@triton.jit
def _select_kernel(cand_score_ptr, cand_idx_ptr, count_ptr, thr_ptr, range_ptr, out_ptr, fail_ptr,
                   T, K_OUT, CAP_P: tl.constexpr, HAS_RANGES: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """One program per row: `_select_row`."""
    row = tl.program_id(0).to(tl.int64)
    if HAS_RANGES:
        first = T - tl.load(range_ptr + row * 3)
        last = tl.load(range_ptr + row * 3 + 1) - 1
    else:
        first = tl.full([], 0, tl.int32)
        last = tl.full([], 0, tl.int32) + T - 1
    _select_row(row, tl.load(count_ptr + row), tl.load(thr_ptr + row), first, last, cand_score_ptr, cand_idx_ptr,
                out_ptr, fail_ptr, T, K_OUT, CAP_P, FILL_BLOCK)


@triton.jit
def _repair_kernel(
    q_ptr, k_ptr, w_ptr, ks_ptr, mask_ptr, fail_ptr, scratch_ptr, out_ptr,
    S, T, H, D, softmax_scale, fill, n_rows, K_OUT,
    sqb, sqs, sqh, sqd, skb, skt, skd, swb, sws, swh, sksb, skst, smb, sms, smt,
    HP: tl.constexpr, PAD_H: tl.constexpr, DP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_KSCALE: tl.constexpr, MASK_KIND: tl.constexpr, EXACT_FP32: tl.constexpr, EVEN_D: tl.constexpr, FOLD_SCALE: tl.constexpr,
    FP8_AS_FP16: tl.constexpr, HEAD_CHAIN: tl.constexpr,
):
    """Exact path for rows whose certificate failed: full row scores in scratch, bitwise select; the scan is in key
    order, so the keys tied at the k-th score that it keeps are the lowest indices."""
    pid = tl.program_id(0)
    scratch = scratch_ptr + pid.to(tl.int64) * T
    d = tl.arange(0, DP)
    d_ok = d < D
    qi = tl.arange(0, BLOCK_Q)
    c = tl.arange(0, CHUNK)
    empty = tl.zeros([CHUNK], dtype=tl.uint32)
    for row in range(pid, n_rows, tl.num_programs(0)):
        if tl.load(fail_ptr + row) != 0:
            row64 = row + tl.zeros([], dtype=tl.int64)
            b = row64 // S
            s = row64 % S
            rows64 = s + qi
            row_ok = qi == 0
            qT, w, h_real = _load_query_block(q_ptr, w_ptr, b, s, S, H, D, sqb, sqs, sqh, sqd, swb, sws, swh, 1,
                                      softmax_scale, BLOCK_Q, HP, DP, FOLD_SCALE, FP8_AS_FP16)
            tl.debug_barrier()
            for t0 in range(0, T, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                t_ok = t < T
                sc = _score_tile(k_ptr, ks_ptr, mask_ptr, b * skb, b * sksb, b * smb,
                                 t, t_ok, rows64, row_ok, row_ok, qi, qi, d, d_ok, qT, w, h_real, softmax_scale,
                                 fill, skt, skd, skst, sms, smt,
                                 BLOCK_T, BLOCK_Q, HP, PAD_H, HAS_KSCALE, MASK_KIND, EXACT_FP32, EVEN_D, FOLD_SCALE,
                                 FP8_AS_FP16, HEAD_CHAIN, False)
                sc = tl.sum(tl.where(row_ok[None, :], sc, 0.0), axis=1)
                tl.store(scratch + t, sc, mask=t_ok)
            tl.debug_barrier()
            kth = tl.zeros([], dtype=tl.uint32)
            for bit_rank in range(32):
                trial = kth | (tl.full([], 1, tl.uint32) << (31 - bit_rank))
                n_ge = tl.zeros([], dtype=tl.int32)
                for t0 in range(0, T, CHUNK):
                    ok = t0 + c < T
                    key = tl.where(ok, _order_key(tl.load(scratch + t0 + c, mask=ok, other=0.0)), empty)
                    n_ge += tl.sum((key >= trial).to(tl.int32), axis=0)
                kth = tl.where(n_ge >= K_OUT, trial, kth)
            n_gt = tl.zeros([], dtype=tl.int32)
            for t0 in range(0, T, CHUNK):
                ok = t0 + c < T
                key = tl.where(ok, _order_key(tl.load(scratch + t0 + c, mask=ok, other=0.0)), empty)
                n_gt += tl.sum((key > kth).to(tl.int32), axis=0)
            written = tl.zeros([], dtype=tl.int32)
            eq_seen = tl.zeros([], dtype=tl.int32)
            out_row = out_ptr + row64 * K_OUT
            for t0 in range(0, T, CHUNK):
                ok = t0 + c < T
                key = tl.where(ok, _order_key(tl.load(scratch + t0 + c, mask=ok, other=0.0)), empty)
                eq = (key == kth).to(tl.int32)
                eq_rank = eq_seen + tl.cumsum(eq, axis=0) - 1
                sel = (key > kth) | ((eq != 0) & (eq_rank < K_OUT - n_gt))
                sel_i = sel.to(tl.int32)
                tl.store(out_row + written + tl.cumsum(sel_i, axis=0) - 1, t0 + c, mask=sel)
                written += tl.sum(sel_i, axis=0)
                eq_seen += tl.sum(eq, axis=0)


@triton.jit
def _rescore_picks_kernel(
    q_ptr, k_ptr, w_ptr, ks_ptr, mask_ptr, out_ptr, picked_ptr,
    S, T, H, D, softmax_scale, fill, K_OUT,
    sqb, sqs, sqh, sqd, skb, skt, skd, swb, sws, swh, sksb, skst, smb, sms, smt,
    HP: tl.constexpr, PAD_H: tl.constexpr, DP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_KSCALE: tl.constexpr, MASK_KIND: tl.constexpr, EXACT_FP32: tl.constexpr, EVEN_D: tl.constexpr,
    FOLD_SCALE: tl.constexpr, FP8_AS_FP16: tl.constexpr, HEAD_CHAIN: tl.constexpr,
):
    """One program per row: the scores of the row's K_OUT picks (keys gathered by index), so the picks
    can be put in `torch.topk`'s order (score descending) by a sort of K_OUT values, not of T."""
    row64 = tl.program_id(0).to(tl.int64)
    b = row64 // S
    s = row64 % S
    d = tl.arange(0, DP)
    d_ok = d < D
    qi = tl.arange(0, BLOCK_Q)
    rows64 = s + qi
    row_ok = qi == 0
    qT, w, h_real = _load_query_block(q_ptr, w_ptr, b, s, S, H, D, sqb, sqs, sqh, sqd, swb, sws, swh, 1,
                              softmax_scale, BLOCK_Q, HP, DP, FOLD_SCALE, FP8_AS_FP16)
    for j0 in range(0, K_OUT, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        j_ok = j < K_OUT
        t = tl.load(out_ptr + row64 * K_OUT + j, mask=j_ok, other=0)
        sc = _score_tile(k_ptr, ks_ptr, mask_ptr, b * skb, b * sksb, b * smb,
                         t, j_ok, rows64, row_ok, row_ok, qi, qi, d, d_ok, qT, w, h_real, softmax_scale,
                         fill, skt, skd, skst, sms, smt,
                         BLOCK_T, BLOCK_Q, HP, PAD_H, HAS_KSCALE, MASK_KIND, EXACT_FP32, EVEN_D, FOLD_SCALE,
                         FP8_AS_FP16, HEAD_CHAIN, False)
        sc = tl.sum(tl.where(row_ok[None, :], sc, 0.0), axis=1)
        tl.store(picked_ptr + row64 * K_OUT + j, sc, mask=j_ok)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _pow2_dividing(n, cap=256):
    """The largest power of two (at most cap) that divides n."""
    return min(cap, n & -n) if n > 0 else cap


def default_config(B, S, T, H, D, topk, dtype, device):
    """Tile sizes: N = BLOCK_Q*HP ~ 256 for prefill, one query per block (split along T) for decode."""
    HP = next_power_of_2(H)
    on_gpu = device.type == "cuda"
    min_q = max(1, 16 // HP)
    block_q = max(min_q, min(max(1, 256 // HP), next_power_of_2(max(S, 1))))
    block_t = 128 if on_gpu else 32
    if not on_gpu:
        block_q = max(min_q, min(block_q, 4))
    programs = cdiv(S, block_q) * B
    want = 2 * _num_sms(device)
    splits = 1
    if programs < want:
        splits = max(1, min(cdiv(want, programs), cdiv(T, block_t)))
    wide = block_q * HP >= 256
    cfg = {
        "block_q": block_q,
        "block_t": block_t,
        "splits": splits,
        "num_warps": 8 if wide else 4,
        "num_stages": 3 if wide else 4,
        "sample_target_rank": 64,
        "append": "asm" if on_gpu else "store",
        "head_sum": "tree",  # H200, triton 3.6 (2026-11-29): filter 3.52 ms vs 3.72 with the FFMA chain
        "fuse_select": False,
        # every visible key a candidate whenever the candidate buffer holds them all: no sample pass and no
        # threshold kernel (H200 run 39, V4's CSA indexer, S=8192 over 2048 entries, top 512: 0.442 against 0.518 ms
        # at equal fixed tiles)
        "every_key": True,
    }
    if dtype == torch.float32 and on_gpu:  # 4-byte operands: smaller key tiles to fit shared memory
        cfg.update(block_t=64, num_warps=4, num_stages=2)
    return cfg


def _block_q_choices(S, HP):
    """Queries per program: N = BLOCK_Q*HP of 256 or 128 (>= 16 for the MMA), no more than S needs."""
    min_q = max(1, 16 // HP)
    cap = next_power_of_2(max(S, 1))
    return tuple(sorted({max(min_q, min(cap, max(1, n // HP))) for n in (256, 128)}, reverse=True))


_AUTOTUNED = {}


def _autotunes(device: torch.device) -> bool:
    """Whether large filter launches are autotuned: on CUDA (the interpreter has no timer to tune with)."""
    return device.type == "cuda"


def _autotuned_score_filter(block_qs):
    """The filter kernel autotuned per (S, T) bucket over a few tile shapes (CUDA only).

    One CTA of 8 warps with a 128x256 accumulator, or several CTAs per SM of 4 warps each (64-key
    tiles), which lets one CTA's epilogue overlap another's MMA: two with N = 256 (2 or 3 K stages:
    3 fills the 228 KB of shared memory exactly) or three with N = 128 (~165 registers). Tuning runs on
    the first call of a bucket, so the first call must not be inside a CUDA graph capture."""
    if block_qs not in _AUTOTUNED:
        if block_qs == (1,):
            shapes = [(1, 128, 4, 4), (1, 64, 4, 6), (1, 128, 8, 3)]
        else:
            wide, narrow = block_qs[0], block_qs[-1]
            shapes = [(wide, 128, 8, 3), (wide, 64, 4, 2), (wide, 64, 4, 3), (narrow, 64, 4, 2)]
        configs = [triton.Config({"BLOCK_Q": bq, "BLOCK_T": bt}, num_warps=w, num_stages=st) for bq, bt, w, st in shapes]
        unique = list({str(c): c for c in configs}.values())
        _AUTOTUNED[block_qs] = triton.autotune(configs=unique, key=["tune_bucket"], reset_to_zero=["count_ptr"])(
            _score_filter_kernel)
    return _AUTOTUNED[block_qs]


def tuned_configs():
    """Best filter-kernel tiles per autotune key so far, as `config` dicts (pass one back to fix the
    tiles), and the last tuning's timings (for reports)."""
    report = {}
    for tuner in _AUTOTUNED.values():
        for key, cfg in tuner.cache.items():
            report[str(key)] = {"block_q": cfg.kwargs["BLOCK_Q"], "block_t": cfg.kwargs["BLOCK_T"],
                                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        timings = getattr(tuner, "configs_timings", None)
        if timings:
            report[f"last timings {id(tuner)}"] = {str(c): t for c, t in timings.items()}
    return report


def _mask_3d(mask, B, S, T):
    if mask is None:
        return None, MASK_NONE, (0, 0, 0)
    while mask.dim() < 3:
        mask = mask.unsqueeze(0)
    mask = mask.expand(B, S, T)
    kind = MASK_BOOL if mask.dtype == torch.bool else MASK_ADDITIVE
    if kind == MASK_BOOL:
        mask = mask.view(torch.uint8)
    return mask, kind, tuple(mask.stride())


def indexer_topk_triton(q, k, weights, k_scale, mask, softmax_scale, topk,
                        threshold: Optional[torch.Tensor] = None,
                        candidate_capacity: Optional[int] = None,
                        config: Optional[dict] = None, stats: Optional[dict] = None,
                        fp8_tensor_cores: bool = False, ordered: bool = False, fill: Optional[float] = None):
    """Triton launcher (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    `threshold` ([B, S] fp32) replaces the sampled per-row filter threshold and
    `candidate_capacity` the per-row candidate buffer size; both change speed only, never the result.
    fp8 q/k are widened to fp16 in registers (exact: every e4m3 value is an fp16 value) so the MMA
    accumulates in full fp32 like the reference; `fp8_tensor_cores=True` feeds fp8 to the tensor cores
    instead: faster, but Hopper's fp8 MMA accumulates with reduced precision (measured: scores off by
    up to ~0.5 %, so the selected set can differ from the reference near the k-th score).
    `stats`, when given, receives device tensors (no host sync): per-row repair flags ("repaired"),
    candidate counts ("candidates") and filter thresholds ("threshold").
    The picks are `indexer_topk_reference`'s tie rule: the set CUDA's `torch.topk` returns. Unordered, a row's
    picks come in no particular order (it varies from run to run when the key range is split);
    `ordered=True` returns them in `torch.topk`'s order (score descending, ties in key order): the picks are
    rescored (K keys per row, gathered) and sorted on the device, no host sync.
    `fill` (bool masks only; None: -inf): the masked keys' score, the source's `masked_fill` value.
    `config` overrides `default_config` keys. Tile keys (TILE_KEYS) switch the filter kernel's
    autotuning off; "append" ("asm" | "store" | "none": benchmark only, wrong output),
    "head_sum" ("chain" | "tree") and "fuse_select" (select inside the filter kernel, when its key
    range is not split) pick filter-kernel variants and keep autotuning on; "every_key" (default on) makes
    every visible key a candidate when the candidate buffer holds T keys, instead of sampling a threshold.
    """
    _validate(q, k, weights, k_scale, mask, topk, fill)
    B, S, H, D = q.shape
    T = k.shape[1]
    width = min(topk, T)
    out = torch.empty((B, S, width), dtype=torch.int32, device=q.device)
    if B * S == 0 or width == 0:
        return out
    cfg = default_config(B, S, T, H, D, topk, q.dtype, q.device)
    if config:
        cfg.update(config)
    HP = next_power_of_2(H)
    DP = max(16, next_power_of_2(D))
    block_q, block_t, splits = cfg["block_q"], cfg["block_t"], cfg["splits"]
    exact_fp32 = q.dtype == torch.float32
    fp8_as_fp16 = q.dtype == torch.float8_e4m3fn and not fp8_tensor_cores
    head_chain = HP == 64 and not exact_fp32 and cfg["head_sum"] == "chain"
    n_rows = B * S
    dev = q.device

    fold_scale = softmax_scale > 0  # relu(x * c) * w == relu(x) * (c * w) for c > 0
    mask3, mask_kind, (smb, sms, smt) = _mask_3d(mask, B, S, T)
    mask_arg = mask3 if mask3 is not None else q
    ks_arg = k_scale if k_scale is not None else weights
    sksb, skst = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
    strides = (*q.stride(), *k.stride(), *weights.stride(), sksb, skst, smb, sms, smt)

    mask_fill = float("-inf") if fill is None else float(fill)
    ranges = None
    use_ranges = mask_kind == MASK_ADDITIVE or (mask_kind == MASK_BOOL and mask_fill == float("-inf"))
    # the buffers the kernels fill with atomics, zeroed by one fill: the rows' key ranges (`_row_range_kernel`) and,
    # when the score filter is split, its candidate counts
    zeroed_size = n_rows * (3 * use_ranges + (splits > 1))
    zeroed = torch.zeros(zeroed_size, dtype=torch.int32, device=dev) if zeroed_size else None
    if use_ranges:
        ranges = zeroed[:3 * n_rows].view(n_rows, 3)
        chunks = max(cdiv(T, 8192), min(cdiv(T, 2048), cdiv(4 * _num_sms(dev), n_rows)))
        keys_per_program = cdiv(T, chunks)
        _row_range_kernel[(n_rows, chunks)](mask3, ranges, S, T, smb, sms, smt, keys_per_program,
                                            MASK_KIND=mask_kind, BLOCK=1024)
    ranges_arg = ranges if ranges is not None else out

    cap = candidate_capacity or 4 * width
    cap = max(16, next_power_of_2(cap))
    target = 2 * width
    qblocks = cdiv(S, block_q)
    common = dict(HP=HP, PAD_H=HP != H, DP=DP, BLOCK_Q=block_q, BLOCK_T=block_t,
                  HAS_KSCALE=k_scale is not None,
                  MASK_KIND=mask_kind, EXACT_FP32=exact_fp32, EVEN_D=D == DP, FOLD_SCALE=fold_scale,
                  FP8_AS_FP16=fp8_as_fp16, APPEND=APPEND_MODES[cfg["append"]], HEAD_CHAIN=head_chain,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    if threshold is not None:
        thr = threshold.to(device=dev, dtype=torch.float32).reshape(n_rows).contiguous()
    elif T <= target or (cfg["every_key"] and T <= cap):
        thr = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
    else:
        step = max(1, target // cfg["sample_target_rank"])
        n_sample = cdiv(T, step)
        rank = max(1, min(n_sample, round(target / step)))
        sample = torch.empty((B, S, n_sample), dtype=torch.float32, device=dev)
        sq = strides
        sample_strides = (*sq[:4], sq[4], sq[5] * step, sq[6], *sq[7:10], sq[10], sq[11] * step, sq[12], sq[13],
                          sq[14] * step)
        sample_splits = max(1, min(splits, cdiv(n_sample, block_t)))
        _score_filter_kernel[(qblocks, B, sample_splits)](
            q, k, weights, ks_arg, mask_arg, ranges_arg, out, out, out, out, sample,
            S, n_sample, H, D, softmax_scale, mask_fill, *sample_strides, 0, 0, out, out, 0,
            SPLITS=sample_splits, USE_RANGES=False, DENSE=True, T_ALIGN=_pow2_dividing(n_sample),
            FUSE_SELECT=False, CAP_P=16,
            **{**common, "APPEND": 0})  # APPEND is unused in dense mode: one compiled sample pass for all
        thr = torch.empty((n_rows,), dtype=torch.float32, device=dev)
        chunk = min(4096, next_power_of_2(n_sample))
        _sample_threshold_kernel[(n_rows,)](sample, thr, n_sample, rank, CHUNK=chunk,
                                            num_warps=1 if chunk <= 2048 else 4)  # one warp: no barriers

    cand_score = torch.empty((n_rows, cap), dtype=torch.float32, device=dev)
    cand_idx = torch.empty((n_rows, cap), dtype=torch.int32, device=dev)
    if splits == 1:
        count = torch.empty((n_rows,), dtype=torch.int32, device=dev)
    else:
        count = zeroed[3 * n_rows * use_ranges:]
    fail = torch.empty((n_rows,), dtype=torch.int32, device=dev)
    fuse_select = bool(cfg["fuse_select"]) and splits == 1
    filter_args = (q, k, weights, ks_arg, mask_arg, ranges_arg, thr, cand_score, cand_idx, count, out,
                   S, T, H, D, softmax_scale, mask_fill, *strides, cap)
    select_args = (out, fail, width)
    # the autotuned launch takes every flag of `common` but the tiles and launch shape its configs choose
    filter_flags = {key: value for key, value in common.items() if key not in AUTOTUNED_META}
    filter_flags.update(SPLITS=splits, USE_RANGES=ranges is not None, DENSE=False, T_ALIGN=_pow2_dividing(T),
                        FUSE_SELECT=fuse_select, CAP_P=cap)
    fixed_tiles = bool(set(config or {}) & TILE_KEYS)
    if _autotunes(dev) and not fixed_tiles and B * max(S, 64) * T >= AUTOTUNE_MIN_WORK:
        tuned = _autotuned_score_filter(_block_q_choices(S, HP))
        variant = (common["APPEND"] * 2 + int(head_chain)) * 2 + int(fuse_select)  # tuned separately
        bucket = ((next_power_of_2(S) << 8) + int(math.log2(next_power_of_2(T)))) * 16 + variant
        tuned[lambda meta: (cdiv(S, meta["BLOCK_Q"]), B, splits)](*filter_args, bucket, *select_args,
                                                                         **filter_flags)
    else:
        _score_filter_kernel[(qblocks, B, splits)](*filter_args, 0, *select_args, **common, **{
            k_: v for k_, v in filter_flags.items() if k_ not in common})

    if not fuse_select:
        _select_kernel[(n_rows,)](cand_score, cand_idx, count, thr, ranges_arg, out, fail, T, width,
                                  CAP_P=cap, HAS_RANGES=ranges is not None, FILL_BLOCK=256,
                                  num_warps=8 if cap >= 4096 else 4)

    if stats is not None:
        stats["repaired"] = fail
        stats["candidates"] = count
        stats["threshold"] = thr
    repair_programs = min(n_rows, _num_sms(dev))
    scratch = torch.empty((repair_programs, T), dtype=torch.float32, device=dev)
    _repair_kernel[(repair_programs,)](
        q, k, weights, ks_arg, mask_arg, fail, scratch, out,
        S, T, H, D, softmax_scale, mask_fill, n_rows, width, *strides,
        HP=HP, PAD_H=HP != H, DP=DP, BLOCK_Q=max(1, 16 // HP), BLOCK_T=min(block_t, 64), CHUNK=1024,
        HAS_KSCALE=k_scale is not None, MASK_KIND=mask_kind, EXACT_FP32=exact_fp32, EVEN_D=D == DP,
        FOLD_SCALE=fold_scale, FP8_AS_FP16=fp8_as_fp16, HEAD_CHAIN=head_chain, num_warps=4)
    if ordered:
        out = out.sort(dim=-1).values  # key order first, so that the stable sort below leaves ties in key order
        picked = torch.empty((n_rows, width), dtype=torch.float32, device=dev)
        _rescore_picks_kernel[(n_rows,)](
            q, k, weights, ks_arg, mask_arg, out, picked, S, T, H, D, softmax_scale, mask_fill, width, *strides,
            HP=HP, PAD_H=HP != H, DP=DP, BLOCK_Q=max(1, 16 // HP), BLOCK_T=min(block_t, 64),
            HAS_KSCALE=k_scale is not None,
            MASK_KIND=mask_kind, EXACT_FP32=exact_fp32, EVEN_D=D == DP, FOLD_SCALE=fold_scale,
            FP8_AS_FP16=fp8_as_fp16, HEAD_CHAIN=head_chain, num_warps=4)
        order = picked.view(B, S, width).sort(dim=-1, descending=True, stable=True).indices
        out = out.gather(-1, order)
    return out


# --------------------------------------------------------------------------------------------
# Custom op
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("dsfuse::indexer_topk", mutates_args=())
def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, k_scale: Optional[torch.Tensor],
                 mask: Optional[torch.Tensor], softmax_scale: float, topk: int, ordered: bool = False,
                 fill: Optional[float] = None) -> torch.Tensor:
    """Indices [B, S, min(topk, T)] int32 of the top-k indexer scores (reference math on CPU).

    `ordered=False`: each row's picks in no particular order (a set); `ordered=True`: in `torch.topk`'s
    order, score descending (for callers who see the slots). The reference always gives topk's order.
    `fill`: the score a bool mask gives masked keys (None: -inf), for sources that `masked_fill` with finfo.min,
    -1e9 or another constant: it decides which keys win wherever an unmasked key scores below it."""
    _validate(q, k, weights, k_scale, mask, topk, fill)
    return indexer_topk_reference(q, k, weights, k_scale, mask, softmax_scale, topk, fill)


@indexer_topk.register_fake
def _indexer_topk_fake(q, k, weights, k_scale, mask, softmax_scale, topk, ordered=False, fill=None):
    _validate(q, k, weights, k_scale, mask, topk, fill)
    B, S = q.shape[0], q.shape[1]
    return q.new_empty((B, S, torch.sym_min(topk, k.shape[1])), dtype=torch.int32)


@direct_kernel(indexer_topk)
def _indexer_topk_cuda(q, k, weights, k_scale, mask, softmax_scale, topk, ordered=False, fill=None):
    return indexer_topk_triton(q, k, weights, k_scale, mask, softmax_scale, topk, ordered=ordered, fill=fill)


def flops(B, S, T, H, D, causal_offset=None):
    """Indexer FLOPs, 2*H*D per visible (s, t) pair; with causal_offset query s sees keys t <= s + offset."""
    if causal_offset is None:
        pairs = S * T
    else:
        pairs = sum(min(T, max(0, s + causal_offset + 1)) for s in range(S))
    return 2.0 * H * D * pairs * B


__all__ = ["default_config", "flops", "indexer_topk", "indexer_topk_reference", "indexer_topk_triton",
           "topk_lowest_index_ties"]
