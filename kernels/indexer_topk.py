"""Fused DeepSeek V3.2 lightning-indexer score + exact top-k (`torch.ops.dsfuse.indexer_topk`).

Math (HF `DeepseekV32Indexer.forward`, plus the official fp8 form's per-key scale):

    scores[b,s,h,t] = relu((q[b,s,h] . k[b,t]) * softmax_scale)          (fp32)
    index[b,s,t]    = sum_h weights[b,s,h] * scores[b,s,h,t]  (* k_scale[b,t])
    index           = masked_fill(~mask, -inf)  or  index + mask
    out             = index.topk(min(topk, T)).indices.int()

CUDA path, never materialising [B,S,H,T] nor [B,S,T]:
  1. `_row_range_kernel`: first/last unmasked key of every query row (read from the mask), so the
     scoring loop visits only key tiles that some row of its query block can see (causal = half).
  2. threshold: the scoring kernel in dense mode over a strided key sample ([B,S,T/step]), whose
     r-th largest value per row estimates the score that ~2k keys of the full row reach.
  3. `_score_filter_kernel`: tensor-core scores with keys on the MMA M dimension and (query, head)
     pairs on N (the head sum is then a reduction along accumulator rows), appending every key whose
     score is >= the row threshold to a per-row candidate buffer of CAP entries.
  4. `_select_kernel`: per row, the certificate "count >= k and no overflow" (or "every unmasked key
     is a candidate, and enough keys lie outside the row's unmasked range to fill the rest"), then
     an exact 32-step radix (bitwise) select of the k-th largest key over the candidates.
  5. `_repair_kernel`: rows whose certificate failed are rescored in full into a per-program scratch
     row and selected exactly there. The sample only decides speed, never the answer.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)

# B*max(S,64)*T below this runs the default config: tuning would cost more than it saves
AUTOTUNE_MIN_WORK = 1 << 22

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADDITIVE = 2


# --------------------------------------------------------------------------------------------
# Reference (also the CPU implementation)
# --------------------------------------------------------------------------------------------
def indexer_topk_reference(q, k, weights, k_scale, mask, softmax_scale, topk):
    """Plain PyTorch indexer top-k, the exact math of the HF module (fp32 upcast, relu after scale)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * softmax_scale
    scores = torch.relu(scores)
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if k_scale is not None:
        index = index * k_scale.unsqueeze(1)
    if mask is not None:
        if mask.dtype == torch.bool:
            index = index.masked_fill(~mask, float("-inf"))
        else:
            index = index + mask
    width = min(topk, index.shape[-1])
    return index.topk(width, dim=-1).indices.to(torch.int32)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _validate(q, k, weights, k_scale, mask, topk):
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
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"indexer_topk: topk must be a positive int, got {topk!r}")


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _score_tile(
    k_ptr, ks_ptr, mask_ptr, k_base, ks_base, mask_base,
    t, t_ok, rows64, row_ok, d, d_ok, qT, w, softmax_scale,
    skt, skd, skst, sms, smt,
    BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, HP: tl.constexpr,
    HAS_KSCALE: tl.constexpr, MASK_KIND: tl.constexpr, EXACT_FP32: tl.constexpr, EVEN_D: tl.constexpr, FOLD_SCALE: tl.constexpr,
    FP8_AS_FP16: tl.constexpr,
):
    """Scores of BLOCK_T keys against BLOCK_Q queries: [BLOCK_T, BLOCK_Q] fp32, mask applied."""
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
    if FOLD_SCALE:
        x = tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
    else:
        x = tl.maximum(acc * softmax_scale, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
    sc = tl.sum(tl.reshape(x, [BLOCK_T, BLOCK_Q, HP]), axis=2)
    if HAS_KSCALE:
        sc = sc * tl.load(ks_ptr + ks_base + t * skst, mask=t_ok, other=0.0)[:, None]
    if MASK_KIND == 1:
        m = tl.load(mask_ptr + mask_base + rows64[None, :] * sms + t[:, None] * smt,
                    mask=t_ok[:, None] & row_ok[None, :], other=0)
        sc = tl.where(m != 0, sc, float("-inf"))
    if MASK_KIND == 2:
        m = tl.load(mask_ptr + mask_base + rows64[None, :] * sms + t[:, None] * smt,
                    mask=t_ok[:, None] & row_ok[None, :], other=0.0)
        sc = sc + m.to(tl.float32)
    return sc


@triton.jit
def _load_query_block(q_ptr, w_ptr, b, s0, S, H, D, sqb, sqs, sqh, sqd, swb, sws, swh, n_rows, softmax_scale,
                      BLOCK_Q: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, FOLD_SCALE: tl.constexpr,
                      FP8_AS_FP16: tl.constexpr):
    """q^T [DP, BLOCK_Q*HP] and weights [BLOCK_Q*HP] of queries s0..s0+n_rows-1 (zero padded)."""
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
    return qT, w


@triton.jit
def _score_filter_kernel(
    q_ptr, k_ptr, w_ptr, ks_ptr, mask_ptr, range_ptr, thr_ptr,
    cand_score_ptr, cand_idx_ptr, count_ptr, dense_ptr,
    S, T, H, D, softmax_scale,
    sqb, sqs, sqh, sqd, skb, skt, skd, swb, sws, swh, sksb, skst, smb, sms, smt,
    CAP, tune_bucket,
    HP: tl.constexpr, DP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr, HAS_KSCALE: tl.constexpr, MASK_KIND: tl.constexpr, USE_RANGES: tl.constexpr,
    DENSE: tl.constexpr, EXACT_FP32: tl.constexpr, EVEN_D: tl.constexpr, FOLD_SCALE: tl.constexpr,
    FP8_AS_FP16: tl.constexpr,
):
    """One query block x one split of its key range: dense scores (sample pass) or candidates >= threshold."""
    num_qblocks = tl.num_programs(0)
    qblk = num_qblocks - 1 - tl.program_id(0)  # causal: the longest rows first, for a short tail
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    s0 = qblk * BLOCK_Q
    rows = s0 + tl.arange(0, BLOCK_Q)
    row_ok = rows < S
    rows64 = rows.to(tl.int64)
    flat_rows = b * S + rows64

    qT, w = _load_query_block(q_ptr, w_ptr, b, s0, S, H, D, sqb, sqs, sqh, sqd, swb, sws, swh, BLOCK_Q,
                              softmax_scale, BLOCK_Q, HP, DP, FOLD_SCALE, FP8_AS_FP16)
    d = tl.arange(0, DP)
    d_ok = d < D

    if USE_RANGES:
        first = T - tl.load(range_ptr + flat_rows * 2, mask=row_ok, other=0)
        last = tl.load(range_ptr + flat_rows * 2 + 1, mask=row_ok, other=0) - 1
        t_lo = tl.min(first, axis=0)
        t_hi = tl.max(last, axis=0) + 1
    else:
        t_lo = tl.zeros([], dtype=tl.int32)
        t_hi = tl.zeros([], dtype=tl.int32) + T
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
        t_ok = t < T
        sc = _score_tile(k_ptr, ks_ptr, mask_ptr, b * skb, b * sksb, b * smb,
                         t, t_ok, rows64, row_ok, d, d_ok, qT, w, softmax_scale,
                         skt, skd, skst, sms, smt,
                         BLOCK_T, BLOCK_Q, HP, HAS_KSCALE, MASK_KIND, EXACT_FP32, EVEN_D, FOLD_SCALE,
                         FP8_AS_FP16)
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
            tl.store(cand_score_ptr + dst, sc, mask=room)
            tl.store(cand_idx_ptr + dst, t[:, None] + tl.zeros([BLOCK_T, BLOCK_Q], dtype=tl.int32), mask=room)
    if (not DENSE) and SPLITS == 1:
        tl.store(count_ptr + flat_rows, count, mask=row_ok)


@triton.jit
def _row_range_kernel(mask_ptr, range_ptr, S, T, smb, sms, smt, keys_per_program,
                      MASK_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """First and last unmasked key of a query row, over one chunk of its keys.

    Stored as (T - first, last + 1) with atomic max into zeros, so a fully masked row reads back
    first = T, last = -1, and the buffer needs only a memset."""
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    t_begin = tl.program_id(1) * keys_per_program
    t_end = tl.minimum(t_begin + keys_per_program, T)
    first = tl.full([], 0, tl.int32) + T
    last = tl.full([], -1, tl.int32)
    for t0 in range(t_begin, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        ok = t < t_end
        if MASK_KIND == 1:
            m = tl.load(mask_ptr + b * smb + s * sms + t * smt, mask=ok, other=0)
            valid = ok & (m != 0)
        else:
            m = tl.load(mask_ptr + b * smb + s * sms + t * smt, mask=ok, other=float("-inf")).to(tl.float32)
            valid = ok & (m != float("-inf"))
        first = tl.minimum(first, tl.min(tl.where(valid, t, T), axis=0))
        last = tl.maximum(last, tl.max(tl.where(valid, t, -1), axis=0))
    tl.atomic_max(range_ptr + row * 2, T - first)
    tl.atomic_max(range_ptr + row * 2 + 1, last + 1)


@triton.jit
def _order_key(sc):
    """Order-preserving map fp32 -> uint32 (1 and up; 0 marks empty slots), NaN above +inf like torch.topk."""
    bits = sc.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(sc != sc, 0x7FFFFFFF, key)
    return key.to(tl.uint32, bitcast=True) ^ tl.full([], 0x80000000, tl.uint32)


@triton.jit
def _kth_largest_key(key, k):
    """Largest v with #(key >= v) >= k, by deciding one bit per step from the top (32 steps)."""
    kth = tl.zeros([], dtype=tl.uint32)
    for bit_rank in range(32):
        trial = kth | (tl.full([], 1, tl.uint32) << (31 - bit_rank))
        n_ge = tl.sum((key >= trial).to(tl.int32), axis=0)
        kth = tl.where(n_ge >= k, trial, kth)
    return kth


@triton.jit
def _sample_threshold_kernel(sample_ptr, thr_ptr, n_sample, rank, CHUNK: tl.constexpr):
    """Per row, the rank-th largest sampled score (exact, bitwise search): the filter threshold."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNK)
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
def _select_kernel(cand_score_ptr, cand_idx_ptr, count_ptr, thr_ptr, range_ptr, out_ptr, fail_ptr,
                   T, K_OUT, CAP_P: tl.constexpr, HAS_RANGES: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """Certificate check and exact top-k over one row's candidates; flags the row for repair otherwise."""
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(count_ptr + row)
    thr = tl.load(thr_ptr + row)
    if HAS_RANGES:
        first = T - tl.load(range_ptr + row * 2)
        last = tl.load(range_ptr + row * 2 + 1) - 1
    else:
        first = tl.full([], 0, tl.int32)
        last = tl.full([], 0, tl.int32) + T - 1
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
        kth = _kth_largest_key(key, K_OUT)
        gt = key > kth
        n_gt = tl.sum(gt.to(tl.int32), axis=0)
        eq = key == kth
        eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = gt | (eq & (eq_rank < K_OUT - n_gt))
        pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        idx = tl.load(cand_idx_ptr + row * CAP_P + i, mask=sel, other=0)
        tl.store(out_row + pos, idx, mask=sel)
        tl.store(fail_ptr + row, 0)
    elif fill:
        idx = tl.load(cand_idx_ptr + row * CAP_P + i, mask=ok, other=0)
        tl.store(out_row + i, idx, mask=ok)
        n_fill = K_OUT - count
        for j0 in range(0, n_fill, FILL_BLOCK):
            j = j0 + tl.arange(0, FILL_BLOCK)
            t = tl.where(j < first, j, last + 1 + j - first)
            tl.store(out_row + count + j, t, mask=j < n_fill)
        tl.store(fail_ptr + row, 0)
    else:
        tl.store(fail_ptr + row, 1)


@triton.jit
def _repair_kernel(
    q_ptr, k_ptr, w_ptr, ks_ptr, mask_ptr, fail_ptr, scratch_ptr, out_ptr,
    S, T, H, D, softmax_scale, n_rows, K_OUT,
    sqb, sqs, sqh, sqd, skb, skt, skd, swb, sws, swh, sksb, skst, smb, sms, smt,
    HP: tl.constexpr, DP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
    HAS_KSCALE: tl.constexpr, MASK_KIND: tl.constexpr, EXACT_FP32: tl.constexpr, EVEN_D: tl.constexpr, FOLD_SCALE: tl.constexpr,
    FP8_AS_FP16: tl.constexpr,
):
    """Exact path for rows whose certificate failed: full row scores in scratch, bitwise select."""
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
            qT, w = _load_query_block(q_ptr, w_ptr, b, s, S, H, D, sqb, sqs, sqh, sqd, swb, sws, swh, 1,
                                      softmax_scale, BLOCK_Q, HP, DP, FOLD_SCALE, FP8_AS_FP16)
            tl.debug_barrier()
            for t0 in range(0, T, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                t_ok = t < T
                sc = _score_tile(k_ptr, ks_ptr, mask_ptr, b * skb, b * sksb, b * smb,
                                 t, t_ok, rows64, row_ok, d, d_ok, qT, w, softmax_scale,
                                 skt, skd, skst, sms, smt,
                                 BLOCK_T, BLOCK_Q, HP, HAS_KSCALE, MASK_KIND, EXACT_FP32, EVEN_D, FOLD_SCALE,
                         FP8_AS_FP16)
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


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def default_config(B, S, T, H, D, topk, dtype, device):
    """Tile sizes: N = BLOCK_Q*HP ~ 256 for prefill, one query per block (split along T) for decode."""
    HP = triton.next_power_of_2(H)
    on_gpu = device.type == "cuda"
    min_q = max(1, 16 // HP)
    block_q = max(min_q, min(max(1, 256 // HP), triton.next_power_of_2(max(S, 1))))
    block_t = 128 if on_gpu else 32
    if not on_gpu:
        block_q = max(min_q, min(block_q, 4))
    programs = triton.cdiv(S, block_q) * B
    want = 2 * _num_sms(device)
    splits = 1
    if programs < want:
        splits = max(1, min(triton.cdiv(want, programs), triton.cdiv(T, block_t)))
    wide = block_q * HP >= 256
    cfg = {
        "block_q": block_q,
        "block_t": block_t,
        "splits": splits,
        "num_warps": 8 if wide else 4,
        "num_stages": 3 if wide else 4,
        "sample_target_rank": 64,
    }
    if dtype == torch.float32 and on_gpu:  # 4-byte operands: smaller key tiles to fit shared memory
        cfg.update(block_t=64, num_warps=4, num_stages=2)
    return cfg


def _block_q_choices(S, HP):
    """Queries per program: N = BLOCK_Q*HP of 256 or 128 (>= 16 for the MMA), no more than S needs."""
    min_q = max(1, 16 // HP)
    cap = triton.next_power_of_2(max(S, 1))
    return tuple(sorted({max(min_q, min(cap, max(1, n // HP))) for n in (256, 128)}, reverse=True))


_AUTOTUNED = {}


def _autotuned_score_filter(block_qs):
    """The filter kernel autotuned per (S, T) bucket over a few tile shapes (CUDA only).

    One CTA of 8 warps with a 128x256 accumulator, or two CTAs per SM of 4 warps each (64-key tiles),
    which lets one CTA's epilogue overlap the other's MMA. Tuning runs on the first call of a bucket,
    so the first call must not be inside a CUDA graph capture."""
    if block_qs not in _AUTOTUNED:
        if block_qs == (1,):
            shapes = [(1, 128, 4, 4), (1, 64, 4, 6), (1, 128, 8, 3)]
        else:
            wide, narrow = block_qs[0], block_qs[-1]
            shapes = [(wide, 128, 8, 3), (wide, 64, 4, 2), (narrow, 64, 4, 3), (narrow, 128, 8, 3)]
        configs = [triton.Config({"BLOCK_Q": bq, "BLOCK_T": bt}, num_warps=w, num_stages=st) for bq, bt, w, st in shapes]
        unique = list({str(c): c for c in configs}.values())
        _AUTOTUNED[block_qs] = triton.autotune(configs=unique, key=["tune_bucket"], reset_to_zero=["count_ptr"])(
            _score_filter_kernel)
    return _AUTOTUNED[block_qs]


def tuned_configs():
    """Best filter-kernel config per autotune key so far, and the last tuning's timings (for reports)."""
    report = {}
    for tuner in _AUTOTUNED.values():
        for key, cfg in tuner.cache.items():
            report[str(key)] = str(cfg)
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
                        fp8_tensor_cores: bool = False):
    """Triton launcher (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    `threshold` ([B, S] fp32) replaces the sampled per-row filter threshold and
    `candidate_capacity` the per-row candidate buffer size; both change speed only, never the result.
    fp8 q/k are widened to fp16 in registers (exact: every e4m3 value is an fp16 value) so the MMA
    accumulates in full fp32 like the reference; `fp8_tensor_cores=True` feeds fp8 to the tensor cores
    instead: faster, but Hopper's fp8 MMA accumulates with reduced precision (measured: scores off by
    up to ~0.5 %, so the selected set can differ from the reference near the k-th score).
    `stats`, when given, receives device tensors (no host sync): per-row repair flags ("repaired"),
    candidate counts ("candidates") and filter thresholds ("threshold").
    """
    _validate(q, k, weights, k_scale, mask, topk)
    B, S, H, D = q.shape
    T = k.shape[1]
    width = min(topk, T)
    out = torch.empty((B, S, width), dtype=torch.int32, device=q.device)
    if B * S == 0 or width == 0:
        return out
    cfg = default_config(B, S, T, H, D, topk, q.dtype, q.device)
    if config:
        cfg.update(config)
    HP = triton.next_power_of_2(H)
    DP = max(16, triton.next_power_of_2(D))
    block_q, block_t, splits = cfg["block_q"], cfg["block_t"], cfg["splits"]
    exact_fp32 = q.dtype == torch.float32
    fp8_as_fp16 = q.dtype == torch.float8_e4m3fn and not fp8_tensor_cores
    n_rows = B * S
    dev = q.device

    fold_scale = softmax_scale > 0  # relu(x * c) * w == relu(x) * (c * w) for c > 0
    mask3, mask_kind, (smb, sms, smt) = _mask_3d(mask, B, S, T)
    mask_arg = mask3 if mask3 is not None else q
    ks_arg = k_scale if k_scale is not None else weights
    sksb, skst = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
    strides = (*q.stride(), *k.stride(), *weights.stride(), sksb, skst, smb, sms, smt)

    ranges = None
    if mask_kind != MASK_NONE:
        ranges = torch.zeros((n_rows, 2), dtype=torch.int32, device=dev)
        chunks = max(triton.cdiv(T, 8192), min(triton.cdiv(T, 2048), triton.cdiv(4 * _num_sms(dev), n_rows)))
        keys_per_program = triton.cdiv(T, chunks)
        _row_range_kernel[(n_rows, chunks)](mask3, ranges, S, T, smb, sms, smt, keys_per_program,
                                            MASK_KIND=mask_kind, BLOCK=1024)
    ranges_arg = ranges if ranges is not None else out

    cap = candidate_capacity or 4 * width
    cap = max(16, triton.next_power_of_2(cap))
    target = 2 * width
    qblocks = triton.cdiv(S, block_q)
    common = dict(HP=HP, DP=DP, BLOCK_Q=block_q, BLOCK_T=block_t, HAS_KSCALE=k_scale is not None,
                  MASK_KIND=mask_kind, EXACT_FP32=exact_fp32, EVEN_D=D == DP, FOLD_SCALE=fold_scale,
                  FP8_AS_FP16=fp8_as_fp16,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    if threshold is not None:
        thr = threshold.to(device=dev, dtype=torch.float32).reshape(n_rows).contiguous()
    elif T <= target:
        thr = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
    else:
        step = max(1, target // cfg["sample_target_rank"])
        n_sample = triton.cdiv(T, step)
        rank = max(1, min(n_sample, round(target / step)))
        sample = torch.empty((B, S, n_sample), dtype=torch.float32, device=dev)
        sq = strides
        sample_strides = (*sq[:4], sq[4], sq[5] * step, sq[6], *sq[7:10], sq[10], sq[11] * step, sq[12], sq[13],
                          sq[14] * step)
        sample_splits = max(1, min(splits, triton.cdiv(n_sample, block_t)))
        _score_filter_kernel[(qblocks, B, sample_splits)](
            q, k, weights, ks_arg, mask_arg, ranges_arg, out, out, out, out, sample,
            S, n_sample, H, D, softmax_scale, *sample_strides, 0, 0,
            SPLITS=sample_splits, USE_RANGES=False, DENSE=True, **common)
        thr = torch.empty((n_rows,), dtype=torch.float32, device=dev)
        chunk = min(4096, triton.next_power_of_2(n_sample))
        _sample_threshold_kernel[(n_rows,)](sample, thr, n_sample, rank, CHUNK=chunk,
                                            num_warps=1 if chunk <= 2048 else 4)  # one warp: no barriers

    cand_score = torch.empty((n_rows, cap), dtype=torch.float32, device=dev)
    cand_idx = torch.empty((n_rows, cap), dtype=torch.int32, device=dev)
    if splits == 1:
        count = torch.empty((n_rows,), dtype=torch.int32, device=dev)
    else:
        count = torch.zeros((n_rows,), dtype=torch.int32, device=dev)
    filter_args = (q, k, weights, ks_arg, mask_arg, ranges_arg, thr, cand_score, cand_idx, count, out,
                   S, T, H, D, softmax_scale, *strides, cap)
    filter_flags = dict(HP=HP, DP=DP, SPLITS=splits, HAS_KSCALE=k_scale is not None, MASK_KIND=mask_kind,
                        USE_RANGES=ranges is not None, DENSE=False, EXACT_FP32=exact_fp32, EVEN_D=D == DP,
                        FOLD_SCALE=fold_scale, FP8_AS_FP16=fp8_as_fp16)
    if dev.type == "cuda" and not config and B * max(S, 64) * T >= AUTOTUNE_MIN_WORK:
        tuned = _autotuned_score_filter(_block_q_choices(S, HP))
        bucket = (triton.next_power_of_2(S) << 8) + int(math.log2(triton.next_power_of_2(T)))
        tuned[lambda meta: (triton.cdiv(S, meta["BLOCK_Q"]), B, splits)](*filter_args, bucket, **filter_flags)
    else:
        _score_filter_kernel[(qblocks, B, splits)](*filter_args, 0, **common, **{
            k_: v for k_, v in filter_flags.items() if k_ not in common})

    fail = torch.empty((n_rows,), dtype=torch.int32, device=dev)
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
        S, T, H, D, softmax_scale, n_rows, width, *strides,
        HP=HP, DP=DP, BLOCK_Q=max(1, 16 // HP), BLOCK_T=min(block_t, 64), CHUNK=1024,
        HAS_KSCALE=k_scale is not None, MASK_KIND=mask_kind, EXACT_FP32=exact_fp32, EVEN_D=D == DP,
        FOLD_SCALE=fold_scale, FP8_AS_FP16=fp8_as_fp16, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------
# Custom op
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("dsfuse::indexer_topk", mutates_args=())
def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, k_scale: Optional[torch.Tensor],
                 mask: Optional[torch.Tensor], softmax_scale: float, topk: int) -> torch.Tensor:
    """Indices [B, S, min(topk, T)] int32 of the top-k indexer scores (reference math on CPU)."""
    _validate(q, k, weights, k_scale, mask, topk)
    return indexer_topk_reference(q, k, weights, k_scale, mask, softmax_scale, topk)


@indexer_topk.register_fake
def _indexer_topk_fake(q, k, weights, k_scale, mask, softmax_scale, topk):
    _validate(q, k, weights, k_scale, mask, topk)
    B, S = q.shape[0], q.shape[1]
    return q.new_empty((B, S, torch.sym_min(topk, k.shape[1])), dtype=torch.int32)


@indexer_topk.register_kernel("cuda")
def _indexer_topk_cuda(q, k, weights, k_scale, mask, softmax_scale, topk):
    return indexer_topk_triton(q, k, weights, k_scale, mask, softmax_scale, topk)


def flops(B, S, T, H, D, causal_offset=None):
    """Indexer FLOPs, 2*H*D per visible (s, t) pair; with causal_offset query s sees keys t <= s + offset."""
    if causal_offset is None:
        pairs = S * T
    else:
        pairs = sum(min(T, max(0, s + causal_offset + 1)) for s in range(S))
    return 2.0 * H * D * pairs * B


__all__ = ["default_config", "flops", "indexer_topk", "indexer_topk_reference", "indexer_topk_triton"]
