"""DeepSeek V4 attention with sinks over a sliding window plus compressed entries (`torch.ops.dsfuse.compressed_attention`).

Math (HF `DeepseekV4Attention` with `eager_attention_forward`, every head reading one shared K=V row set):

    keys        = [window rows kv[b, n] | compressed entries c[b, t]]                 (K = V)
    logit[h, j] = round(round(q[b, s, h] . keys[j]) * scale)          in the input dtype, as HF's matmul and scale
    visible     = window:      kv_pos[b, n] >= 0  and  0 <= q_pos[b, s] - kv_pos[b, n] < window
                               (or, when a window_mask is given, window_mask[b, s, n]: the rows an input mask lets
                               each query see, positions and window unused for them)
                  CSA entries: t in indices[b, s]  (-1 = no entry)
                  HCA entries: t < (q_pos[b, s] + 1) // compress_rate                 (indices is None)
    p           = softmax over [visible logits | sinks[h]] in fp32, sink column dropped, rounded to the input dtype
    out[b,s,h]  = p @ keys  (then, when cos / sin are given, the inverse interleaved RoPE on the trailing 2R dims)

A fully masked row is well defined: the sink takes all the mass and the output is 0, as in HF.
`window_mask` is how the rewrite reads a mask `generate` built outside the compiled call over several queries: HF's
0 / finfo.min rows, of any shape (additive finfo.min gives the same probabilities as leaving the row out).
The reference below is also the CPU implementation; it spells the HF roundings out one by one.

The CUDA path (`compressed_attention_triton`) reads the keys where they live: per query the window rows
`kv[b, lo:hi]` (found by binary search, which asks `kv_positions[b]` to be -1 left padding, then increasing
positions: the layout of a prompt and of a sliding cache), then the selected entries
`compressed[b, indices[b, s]]` (CSA; the indices of a row must be distinct, as a top-k's are) or the first
(q_pos + 1) // compress_rate entries (HCA). All heads of a query share the key rows, so they sit on the MMA M
dimension. HF rounds the normalised probabilities to the input dtype before `p @ v`, which an online softmax
cannot reproduce, so the kernel makes two passes over a query's keys: the first finds the row max and the sum
(the sink folded in as the starting value) and keeps the logits (exact in the input dtype) in a scratch, the
second reads them back and accumulates `round(exp(logit - max) / sum) @ v`. The inverse RoPE runs on the output
tile before it is stored. Measured alternatives (H200, notes/compressed_attention.md): recomputing q.k in pass 2
instead of the scratch (1.45x slower: it spills), one loop over both key sources (1.3-1.6x slower), and an
online softmax in one pass (no faster at equal structure, and only ~54 % of outputs bit-equal to HF's against
99.95 %). With a `window_mask` each query's window rows are the span from its first to its last seen row (found
from the mask, no host sync), tested row by row against the mask; as that span has no bound known before the
launch, the fused kernel runs without the logits scratch (q.k again in pass 2: the 1.45x above, on the GPU not yet
measured with a mask).

`path="split"` (the default) runs the two passes as two kernels with small accumulators, so several programs
share an SM: scores (q.k, max and sum, the logits stored and by default turned into the rounded probabilities in
place), then p @ v over (query, D chunk) programs with the inverse RoPE in the chunks that hold the rotated dims.
Same roundings in the same order, so the same bits as the fused kernel at equal keys per tile.  On Hopper the
scores run in a Gluon kernel (`compressed_attention_gluon.py`: cp.async gathers pipelined ahead of wgmma, the query
in registers) with the Triton kernel's bits, 1.2x faster on the whole op at V4-Flash's CSA shapes (H200,
notes/compressed_attention.md); the Triton kernel elsewhere.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dsfuse.kernels.triton_math import exp_as_torch
from dsfuse.kernels.triton_support import cdiv, direct_kernel, interpreting, next_power_of_2

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
POSITION_DTYPES = (torch.int32, torch.int64)


def _visible(q_positions, kv_positions, compressed, indices, window, compress_rate, window_mask=None):
    """[B, S, N + T] bool: which keys each query sees (window rows, then compressed entries)."""
    if window_mask is None:
        delta = q_positions.unsqueeze(-1) - kv_positions.unsqueeze(1)
        seen = (kv_positions.unsqueeze(1) >= 0) & (delta >= 0) & (delta < window)
    else:
        seen = window_mask
    if compressed is None:
        return seen
    B, S = q_positions.shape
    T = compressed.shape[1]
    if indices is None:
        entries = torch.arange(T, device=q_positions.device)
        chosen = entries.view(1, 1, T) < torch.div(q_positions + 1, compress_rate, rounding_mode="floor").unsqueeze(-1)
    else:
        # one spare column catches the -1 picks, as HF's scatter into a [.., T + 1] bias does
        safe = torch.where(indices >= 0, indices, torch.full_like(indices, T)).long()
        chosen = torch.zeros((B, S, T + 1), dtype=torch.bool, device=q_positions.device)
        chosen.scatter_(-1, safe, True)
        chosen = chosen[..., :T]
    return torch.cat([seen, chosen], dim=-1)


def inverse_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF V4's `apply_rotary_pos_emb(x, cos, -sin)` on [B, S, H, D]: interleaved pairs of the trailing 2R dims."""
    c = cos.repeat_interleave(2, dim=-1).unsqueeze(2)
    s = -sin.repeat_interleave(2, dim=-1).unsqueeze(2)
    width = c.shape[-1]
    nope, rope = x[..., :-width], x[..., -width:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = ((rope.float() * c) + (turned.float() * s)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def compressed_attention_reference(q, kv, q_positions, kv_positions, compressed, indices, sinks, scale, window,
                                   compress_rate, cos=None, sin=None, window_mask=None):
    """Plain PyTorch V4 attention in HF's order of roundings; returns [B, S, H, D] in q's dtype."""
    B, S, H, D = q.shape
    keys = kv if compressed is None else torch.cat([kv, compressed], dim=1)
    logits = torch.matmul(q.transpose(1, 2), keys.unsqueeze(1).transpose(-1, -2)) * scale  # [B, H, S, N + T]
    visible = _visible(q_positions, kv_positions, compressed, indices, window, compress_rate, window_mask)
    logits = logits.float().masked_fill(~visible.unsqueeze(1), float("-inf"))
    combined = torch.cat([logits, sinks.float().view(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(q.dtype)
    out = torch.matmul(probs, keys.unsqueeze(1)).transpose(1, 2)  # [B, S, H, D]
    if cos is not None:
        out = inverse_rope_reference(out, cos, sin)
    return out.contiguous()


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"dsfuse.compressed_attention: {message}")


def _validate(q, kv, q_positions, kv_positions, compressed, indices, sinks, window, compress_rate, cos, sin,
              window_mask, check_values: bool) -> None:
    _check(q.dim() == 4, f"q must be [B, S, H, D], got shape {tuple(q.shape)}")
    B, S, H, D = q.shape
    _check(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} not in {FLOAT_DTYPES}")
    _check(kv.dim() == 3 and kv.shape[0] == B and kv.shape[2] == D,
           f"kv must be [B={B}, N, D={D}], got {tuple(kv.shape)}")
    _check(kv.dtype == q.dtype, f"kv dtype {kv.dtype} differs from q's {q.dtype}")
    _check(q_positions.shape == (B, S) and q_positions.dtype in POSITION_DTYPES,
           f"q_positions must be integer [B={B}, S={S}], got {q_positions.dtype} {tuple(q_positions.shape)}")
    _check(kv_positions.shape == (B, kv.shape[1]) and kv_positions.dtype in POSITION_DTYPES,
           f"kv_positions must be integer [B={B}, N={kv.shape[1]}], got {kv_positions.dtype} {tuple(kv_positions.shape)}")
    _check(sinks.shape == (H,) and sinks.dtype == torch.float32, f"sinks must be fp32 [H={H}], got {sinks.dtype} "
           f"{tuple(sinks.shape)}")
    _check(window >= 1 and compress_rate >= 1, f"window ({window}) and compress_rate ({compress_rate}) must be >= 1")
    if window_mask is not None:
        _check(window_mask.shape == (B, S, kv.shape[1]) and window_mask.dtype == torch.bool,
               f"window_mask must be bool [B={B}, S={S}, N={kv.shape[1]}], got {window_mask.dtype} "
               f"{tuple(window_mask.shape)}")
    devices = {t.device for t in (q, kv, q_positions, kv_positions, sinks, compressed, indices, cos, sin, window_mask)
               if t is not None}
    _check(len(devices) == 1, f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if compressed is None:
        _check(indices is None, "indices given without compressed entries")
    else:
        _check(compressed.dim() == 3 and compressed.shape[0] == B and compressed.shape[2] == D,
               f"compressed must be [B={B}, T, D={D}], got {tuple(compressed.shape)}")
        _check(compressed.dtype == q.dtype, f"compressed dtype {compressed.dtype} differs from q's {q.dtype}")
    if indices is not None:
        _check(indices.dim() == 3 and indices.shape[:2] == (B, S) and indices.dtype in INDEX_DTYPES,
               f"indices must be int32/int64 [B={B}, S={S}, k], got {indices.dtype} {tuple(indices.shape)}")
        if check_values and indices.numel():
            T = compressed.shape[1]
            low, high = int(indices.min()), int(indices.max())
            _check(low >= -1 and high < T, f"indices must lie in [-1, {T}), got values in [{low}, {high}]")
    _check((cos is None) == (sin is None), "cos and sin come together")
    if cos is not None:
        _check(cos.shape == sin.shape and cos.dim() == 3 and cos.shape[:2] == (B, S) and 2 * cos.shape[2] <= D,
               f"cos / sin must be [B={B}, S={S}, R] with 2R <= D={D}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
        _check(cos.dtype == torch.float32 and sin.dtype == torch.float32, "cos / sin must be fp32")


_SLIDING, _CSA, _HCA = 0, 1, 2


@triton.jit(do_not_specialize=["S", "N", "K", "T", "window", "compress_rate", "search_steps"])
def _key_ranges_kernel(qpos_ptr, kvpos_ptr, idx_ptr, ranges_ptr,
                       stride_qp_b, stride_kp_b, stride_idx_b, stride_idx_s,
                       S, N, K, T, window, compress_rate, search_steps,
                       MODE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per query: the window rows [lo, hi) of kv whose positions lie in [max(q_pos - window + 1, 0), q_pos] (two
    lower bounds in the kv_positions row, searched side by side; at most `window` rows, as the positions of
    real rows are distinct), and how many compressed slots the attention scans: up to the last in-range pick
    (CSA) or the (q_pos + 1) // compress_rate visible entries (HCA).  `ranges` is [3, B * S] int32."""
    b = tl.program_id(0).to(tl.int64)
    offs_q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = offs_q < S
    pos = tl.load(qpos_ptr + b * stride_qp_b + offs_q, mask=q_ok, other=0).to(tl.int64)
    # lanes 2i and 2i + 1 look for query i's first row at or past q_pos - window + 1 and past q_pos
    lane = tl.arange(0, 2 * BLOCK_Q)
    lane_pos = tl.reshape(tl.join(pos, pos), [2 * BLOCK_Q])
    target = tl.where(lane % 2 == 0, tl.maximum(lane_pos - window + 1, 0), lane_pos + 1)
    low = tl.zeros([2 * BLOCK_Q], tl.int64)
    high = tl.zeros([2 * BLOCK_Q], tl.int64) + N
    kvpos_row = kvpos_ptr + b * stride_kp_b
    for _ in range(search_steps):
        active = low < high
        mid = (low + high) // 2
        seen = tl.load(kvpos_row + tl.minimum(mid, N - 1), mask=active, other=0).to(tl.int64)
        right = active & (seen < target)
        low = tl.where(right, mid + 1, low)
        high = tl.where(active & ~right, mid, high)
    lo, hi = tl.split(tl.reshape(low, [BLOCK_Q, 2]))
    hi = tl.minimum(hi, lo + window)
    total = tl.num_programs(0).to(tl.int64) * S
    flat = b * S + offs_q
    tl.store(ranges_ptr + flat, lo.to(tl.int32), mask=q_ok)
    tl.store(ranges_ptr + total + flat, hi.to(tl.int32), mask=q_ok)
    if MODE == 1:
        slots = tl.zeros([BLOCK_Q], tl.int32)
        idx_rows = idx_ptr + b * stride_idx_b + offs_q.to(tl.int64)[:, None] * stride_idx_s
        for start in range(0, K, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            ids = tl.load(idx_rows + offs_k[None, :], mask=q_ok[:, None] & (offs_k < K)[None, :], other=-1)
            picked = (ids >= 0) & (ids < T)
            slots = tl.maximum(slots, tl.max(tl.where(picked, offs_k[None, :] + 1, 0), 1))
    elif MODE == 2:
        # clamped, so C-style division of a negative q_pos + 1 gives the same 0 as floor division
        slots = tl.minimum(tl.maximum((pos + 1) // compress_rate, 0), T).to(tl.int32)
    else:
        slots = tl.zeros([BLOCK_Q], tl.int32)
    tl.store(ranges_ptr + 2 * total + flat, slots, mask=q_ok)


@triton.jit
def _window_keys(kv_row_ptr, kvpos_row_ptr, mask_row_ptr, stride_kv_n, q_pos, lo, hi, start, window, offs_d,
                 D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr, CHECK_POSITIONS: tl.constexpr,
                 HAS_MASK: tl.constexpr):
    """Rows lo + start .. of kv and which of them the query sees.  Within [lo, hi) the positions are the query's
    window already (the key ranges say so), so by default no position is read and the tile's addresses and mask
    depend on nothing loaded in the loop; CHECK_POSITIONS repeats the reference's window test on every row, and
    HAS_MASK reads the query's row of the window mask instead (its span only bounds [lo, hi))."""
    rows = lo + start + tl.arange(0, BLOCK_N)
    ok = rows < hi
    if HAS_MASK:
        ok = ok & (tl.load(mask_row_ptr + rows, mask=ok, other=0) != 0)
    if CHECK_POSITIONS:
        kv_pos = tl.load(kvpos_row_ptr + rows, mask=ok, other=-1).to(tl.int64)
        delta = q_pos - kv_pos
        ok = ok & (kv_pos >= 0) & (delta >= 0) & (delta < window)
    if D == DP:
        mask = ok[:, None]
    else:
        mask = ok[:, None] & (offs_d < D)[None, :]
    keys = tl.load(kv_row_ptr + rows.to(tl.int64)[:, None] * stride_kv_n + offs_d[None, :], mask=mask, other=0.0)
    return keys, ok


@triton.jit
def _entry_keys(c_row_ptr, idx_row_ptr, stride_c_t, slots, T, start, offs_d,
                MODE: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Compressed entries of slots start .. : the picks indices[b, s, slot] (CSA, -1 and out-of-range picks
    read nothing) or the entries themselves (HCA, slots counts the visible ones)."""
    offs = start + tl.arange(0, BLOCK_N)
    if MODE == 1:
        ids = tl.load(idx_row_ptr + offs, mask=offs < slots, other=-1).to(tl.int64)
        ok = (ids >= 0) & (ids < T)
        rows = tl.where(ok, ids, 0)
    else:
        ok = offs < slots
        rows = offs.to(tl.int64)
    if D == DP:
        mask = ok[:, None]
    else:
        mask = ok[:, None] & (offs_d < D)[None, :]
    keys = tl.load(c_row_ptr + rows[:, None] * stride_c_t + offs_d[None, :], mask=mask, other=0.0)
    return keys, ok


@triton.jit
def _scratch_tile(logits_ptr, block, slot_tiles, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Addresses of the first [BLOCK_H, BLOCK_N] tile of a program's scratch rows.  A row holds slot_tiles * BLOCK_N
    slots (window tiles, then compressed tiles): a runtime count, so a new number of compressed entries (HCA's
    grows with the sequence) compiles nothing, and a multiple of BLOCK_N, so the tiles stay aligned."""
    row = slot_tiles * BLOCK_N
    return logits_ptr + block * (BLOCK_H * row) + tl.arange(0, BLOCK_H)[:, None] * row \
        + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def _logits(q, keys, ok, scale, DOT_PRECISION: tl.constexpr):
    """HF's rounding: q.k to the input dtype, times scale in the input dtype, then fp32 with -inf where unseen."""
    dtype = q.dtype
    qk = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)
    x = (qk.to(dtype).to(tl.float32) * scale).to(dtype).to(tl.float32)
    return tl.where(ok[None, :], x, float("-inf"))


@triton.jit
def _max_and_sum(x, m, l, ACCURATE_EXP: tl.constexpr):
    """Online row max and sum of exp(x - max); m starts at the sink, so it is never -inf."""
    m_new = tl.maximum(m, tl.max(x, 1))
    l = l * exp_as_torch(m - m_new, ACCURATE_EXP) + tl.sum(exp_as_torch(x - m_new[:, None], ACCURATE_EXP), 1)
    return m_new, l


@triton.jit
def _probabilities(x, m, l, dtype: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    """round(exp(x - m) / l) to the input dtype: the probabilities HF hands to its p @ v matmul (without
    ACCURATE_EXP the division is a multiply by 1 / l, which can round differently)."""
    if ACCURATE_EXP:
        return tl.div_rn(exp_as_torch(x - m[:, None], ACCURATE_EXP), l[:, None]).to(dtype)
    else:
        return (exp_as_torch(x - m[:, None], ACCURATE_EXP) * (1.0 / l)[:, None]).to(dtype)


@triton.jit
def _accumulate(x, keys, m, l, acc, ACCURATE_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += round(exp(x - m) / l) @ keys."""
    p = _probabilities(x, m, l, keys.dtype, ACCURATE_EXP)
    return tl.dot(p, keys, acc, input_precision=DOT_PRECISION)


@triton.jit
def _inverse_rope(out, cos_row_ptr, sin_row_ptr, first_pair, D: tl.constexpr, R: tl.constexpr,
                  BLOCK_H: tl.constexpr, WIDTH: tl.constexpr):
    """HF's apply_rotary_pos_emb(out, cos, -sin) on the interleaved pairs of the trailing 2R of D dims, in fp32
    from the rounded output; `out` holds the WIDTH columns from column 2 * first_pair on (an even column, so
    no pair straddles two tiles)."""
    even, odd = tl.split(tl.reshape(out, [BLOCK_H, WIDTH // 2, 2]))
    pair = first_pair + tl.arange(0, WIDTH // 2)
    j = pair - (D // 2 - R)
    turn = (j >= 0) & (pair < D // 2)
    c = tl.load(cos_row_ptr + j, mask=turn, other=1.0)[None, :]
    neg_sin = -tl.load(sin_row_ptr + j, mask=turn, other=0.0)[None, :]
    e = even.to(tl.float32)
    o = odd.to(tl.float32)
    new_even = tl.where(turn[None, :], (e * c + (-o) * neg_sin).to(out.dtype), even)
    new_odd = tl.where(turn[None, :], (o * c + e * neg_sin).to(out.dtype), odd)
    return tl.reshape(tl.join(new_even, new_odd), [BLOCK_H, WIDTH])


@triton.jit(do_not_specialize=["S", "H", "T", "window", "slot_tiles"])
def _compressed_attention_kernel(
    q_ptr, kv_ptr, c_ptr, idx_ptr, qpos_ptr, kvpos_ptr, ranges_ptr, sink_ptr, cos_ptr, sin_ptr, out_ptr,
    logits_ptr, mask_ptr,
    stride_q_b, stride_q_s, stride_q_h,
    stride_kv_b, stride_kv_n,
    stride_c_b, stride_c_t,
    stride_idx_b, stride_idx_s,
    stride_qp_b, stride_kp_b,
    stride_cs_b, stride_cs_s, stride_sn_b, stride_sn_s,
    stride_o_b, stride_o_s, stride_o_h,
    stride_m_b, stride_m_s,
    S, H, T, window, slot_tiles, scale,
    D: tl.constexpr, DP: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, ACCURATE_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STORE_LOGITS: tl.constexpr, WINDOW_SLOTS: tl.constexpr, CHECK_POSITIONS: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """One program: one query and BLOCK_H of its heads (the M dimension), every key row loaded once per pass
    and shared by those heads.  Pass 1: row max and sum with the sink; pass 2: the rounded probabilities times
    the same rows.  With STORE_LOGITS pass 1 keeps its logits (exact in the input dtype) in this program's
    [BLOCK_H, slot_tiles * BLOCK_N] scratch and pass 2 reads them back instead of repeating q.k.  Then the
    output tile is rounded, inverse-rotated on its trailing 2R dims and stored."""
    total = tl.num_programs(0).to(tl.int64)
    flat = total - 1 - tl.program_id(0)  # latest queries (most visible HCA entries) first
    b = flat // S
    s = flat % S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, DP)
    h_ok = offs_h < H
    d_ok = offs_d < D

    q = tl.load(q_ptr + b * stride_q_b + s * stride_q_s + offs_h[:, None] * stride_q_h + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(qpos_ptr + b * stride_qp_b + s).to(tl.int64)
    lo = tl.load(ranges_ptr + flat)
    hi = tl.load(ranges_ptr + total + flat)
    slots = tl.load(ranges_ptr + 2 * total + flat)
    kv_row = kv_ptr + b * stride_kv_b
    kvpos_row = kvpos_ptr + b * stride_kp_b
    mask_row = mask_ptr + b * stride_m_b + s * stride_m_s
    c_row = c_ptr + b * stride_c_b
    idx_row = idx_ptr + b * stride_idx_b + s * stride_idx_s
    own_logits = _scratch_tile(logits_ptr, flat * tl.num_programs(1) + tl.program_id(1), slot_tiles, BLOCK_H,
                               BLOCK_N)

    m = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
    l = tl.full([BLOCK_H], 1.0, tl.float32)  # exp(sink - m) with m = sink
    for start in range(0, hi - lo, BLOCK_N):
        keys, ok = _window_keys(kv_row, kvpos_row, mask_row, stride_kv_n, q_pos, lo, hi, start, window, offs_d,
                                D, DP, BLOCK_N, CHECK_POSITIONS, HAS_MASK)
        x = _logits(q, keys, ok, scale, DOT_PRECISION)
        if STORE_LOGITS:
            tl.store(own_logits + start, x.to(q.dtype))
        m, l = _max_and_sum(x, m, l, ACCURATE_EXP)
    if MODE != 0:
        for start in range(0, slots, BLOCK_N):
            keys, ok = _entry_keys(c_row, idx_row, stride_c_t, slots, T, start, offs_d, MODE, D, DP, BLOCK_N)
            x = _logits(q, keys, ok, scale, DOT_PRECISION)
            if STORE_LOGITS:
                tl.store(own_logits + WINDOW_SLOTS + start, x.to(q.dtype))
            m, l = _max_and_sum(x, m, l, ACCURATE_EXP)
    if STORE_LOGITS:
        tl.debug_barrier()  # pass 2 reads logits that other threads of this program stored

    acc = tl.zeros([BLOCK_H, DP], tl.float32)
    for start in range(0, hi - lo, BLOCK_N):
        keys, ok = _window_keys(kv_row, kvpos_row, mask_row, stride_kv_n, q_pos, lo, hi, start, window, offs_d,
                                D, DP, BLOCK_N, CHECK_POSITIONS, HAS_MASK)
        if STORE_LOGITS:
            x = tl.load(own_logits + start).to(tl.float32)
        else:
            x = _logits(q, keys, ok, scale, DOT_PRECISION)
        acc = _accumulate(x, keys, m, l, acc, ACCURATE_EXP, DOT_PRECISION)
    if MODE != 0:
        for start in range(0, slots, BLOCK_N):
            keys, ok = _entry_keys(c_row, idx_row, stride_c_t, slots, T, start, offs_d, MODE, D, DP, BLOCK_N)
            if STORE_LOGITS:
                x = tl.load(own_logits + WINDOW_SLOTS + start).to(tl.float32)
            else:
                x = _logits(q, keys, ok, scale, DOT_PRECISION)
            acc = _accumulate(x, keys, m, l, acc, ACCURATE_EXP, DOT_PRECISION)

    out = acc.to(q.dtype)
    if R > 0:
        out = _inverse_rope(out, cos_ptr + b * stride_cs_b + s * stride_cs_s, sin_ptr + b * stride_sn_b
                            + s * stride_sn_s, 0, D, R, BLOCK_H, DP)
    tl.store(out_ptr + b * stride_o_b + s * stride_o_s + offs_h[:, None] * stride_o_h + offs_d[None, :], out,
             mask=h_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["S", "H", "T", "window", "slot_tiles"])
def _attention_scores_kernel(
    q_ptr, kv_ptr, c_ptr, idx_ptr, qpos_ptr, kvpos_ptr, ranges_ptr, sink_ptr, logits_ptr, stats_ptr,
    stride_q_b, stride_q_s, stride_q_h,
    stride_kv_b, stride_kv_n,
    stride_c_b, stride_c_t,
    stride_idx_b, stride_idx_s,
    stride_qp_b, stride_kp_b,
    S, H, T, window, slot_tiles, scale,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, ACCURATE_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW_SLOTS: tl.constexpr, CHECK_POSITIONS: tl.constexpr, NORMALIZE: tl.constexpr,
):
    """Split path, kernel 1: the fused kernel's pass 1 (one query, BLOCK_H heads, every visible key once) with
    only a [BLOCK_H, BLOCK_N] accumulator, so several programs share an SM.  Stores the logits (exact in the
    input dtype) in the same scratch as the fused kernel; with NORMALIZE it then rewrites them in place as the
    rounded probabilities (each exp and division once per logit, not once per D chunk of kernel 2), otherwise
    it stores the row max and sum for kernel 2."""
    total = tl.num_programs(0).to(tl.int64)
    flat = total - 1 - tl.program_id(0)  # latest queries (most visible HCA entries) first
    b = flat // S
    s = flat % S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, DP)
    h_ok = offs_h < H
    d_ok = offs_d < D

    q = tl.load(q_ptr + b * stride_q_b + s * stride_q_s + offs_h[:, None] * stride_q_h + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(qpos_ptr + b * stride_qp_b + s).to(tl.int64)
    lo = tl.load(ranges_ptr + flat)
    hi = tl.load(ranges_ptr + total + flat)
    slots = tl.load(ranges_ptr + 2 * total + flat)
    kv_row = kv_ptr + b * stride_kv_b
    kvpos_row = kvpos_ptr + b * stride_kp_b
    c_row = c_ptr + b * stride_c_b
    idx_row = idx_ptr + b * stride_idx_b + s * stride_idx_s
    block = flat * tl.num_programs(1) + tl.program_id(1)
    own_logits = _scratch_tile(logits_ptr, block, slot_tiles, BLOCK_H, BLOCK_N)

    m = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
    l = tl.full([BLOCK_H], 1.0, tl.float32)  # exp(sink - m) with m = sink
    for start in range(0, hi - lo, BLOCK_N):
        keys, ok = _window_keys(kv_row, kvpos_row, kvpos_row, stride_kv_n, q_pos, lo, hi, start, window, offs_d,
                                D, DP, BLOCK_N, CHECK_POSITIONS, False)
        x = _logits(q, keys, ok, scale, DOT_PRECISION)
        tl.store(own_logits + start, x.to(q.dtype))
        m, l = _max_and_sum(x, m, l, ACCURATE_EXP)
    if MODE != 0:
        for start in range(0, slots, BLOCK_N):
            keys, ok = _entry_keys(c_row, idx_row, stride_c_t, slots, T, start, offs_d, MODE, D, DP, BLOCK_N)
            x = _logits(q, keys, ok, scale, DOT_PRECISION)
            tl.store(own_logits + WINDOW_SLOTS + start, x.to(q.dtype))
            m, l = _max_and_sum(x, m, l, ACCURATE_EXP)
    if NORMALIZE:
        tl.debug_barrier()  # the logits were stored by other threads of this program
        for start in range(0, hi - lo, BLOCK_N):
            x = tl.load(own_logits + start).to(tl.float32)
            tl.store(own_logits + start, _probabilities(x, m, l, q.dtype, ACCURATE_EXP))
        if MODE != 0:
            for start in range(0, slots, BLOCK_N):
                x = tl.load(own_logits + WINDOW_SLOTS + start).to(tl.float32)
                tl.store(own_logits + WINDOW_SLOTS + start, _probabilities(x, m, l, q.dtype, ACCURATE_EXP))
    else:
        rows = block * BLOCK_H + tl.arange(0, BLOCK_H)
        tl.store(stats_ptr + rows, m)
        tl.store(stats_ptr + total * tl.num_programs(1) * BLOCK_H + rows, l)


@triton.jit(do_not_specialize=["S", "H", "T", "window", "slot_tiles"])
def _attention_values_kernel(
    kv_ptr, c_ptr, idx_ptr, qpos_ptr, kvpos_ptr, ranges_ptr, cos_ptr, sin_ptr, out_ptr, logits_ptr, stats_ptr,
    stride_kv_b, stride_kv_n,
    stride_c_b, stride_c_t,
    stride_idx_b, stride_idx_s,
    stride_qp_b, stride_kp_b,
    stride_cs_b, stride_cs_s, stride_sn_b, stride_sn_s,
    stride_o_b, stride_o_s, stride_o_h,
    S, H, T, window, slot_tiles,
    D: tl.constexpr, D_CHUNK: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, ACCURATE_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW_SLOTS: tl.constexpr, CHECK_POSITIONS: tl.constexpr, NORMALIZED: tl.constexpr,
):
    """Split path, kernel 2: one query, BLOCK_H heads and D_CHUNK of the D output columns ([BLOCK_H, D_CHUNK]
    fp32 accumulator).  Reads kernel 1's scratch in the key order kernel 1 wrote it: the rounded probabilities
    (NORMALIZED) or the logits, turned into them here with the stored max and sum exactly as the fused kernel
    does, times the chunk's columns of the same key rows.  The chunk holding any of the trailing 2R dims
    inverse-rotates them before the store.  The chunks of one query are neighbouring programs, so its scratch
    is read from DRAM once and from L2 by the other chunks."""
    CHUNKS: tl.constexpr = (D + D_CHUNK - 1) // D_CHUNK
    queries = tl.num_programs(0).to(tl.int64) // CHUNKS
    flat = queries - 1 - tl.program_id(0) // CHUNKS  # latest queries first, as kernel 1
    chunk = tl.program_id(0) % CHUNKS
    b = flat // S
    s = flat % S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = chunk * D_CHUNK + tl.arange(0, D_CHUNK)
    h_ok = offs_h < H
    d_ok = offs_d < D

    q_pos = tl.load(qpos_ptr + b * stride_qp_b + s).to(tl.int64)
    lo = tl.load(ranges_ptr + flat)
    hi = tl.load(ranges_ptr + queries + flat)
    slots = tl.load(ranges_ptr + 2 * queries + flat)
    kv_row = kv_ptr + b * stride_kv_b
    kvpos_row = kvpos_ptr + b * stride_kp_b
    c_row = c_ptr + b * stride_c_b
    idx_row = idx_ptr + b * stride_idx_b + s * stride_idx_s
    block = flat * tl.num_programs(1) + tl.program_id(1)
    own_logits = _scratch_tile(logits_ptr, block, slot_tiles, BLOCK_H, BLOCK_N)
    if not NORMALIZED:
        rows = block * BLOCK_H + tl.arange(0, BLOCK_H)
        m = tl.load(stats_ptr + rows)
        l = tl.load(stats_ptr + queries * tl.num_programs(1) * BLOCK_H + rows)

    acc = tl.zeros([BLOCK_H, D_CHUNK], tl.float32)
    for start in range(0, hi - lo, BLOCK_N):
        keys, ok = _window_keys(kv_row, kvpos_row, kvpos_row, stride_kv_n, q_pos, lo, hi, start, window, offs_d,
                                D, CHUNKS * D_CHUNK, BLOCK_N, CHECK_POSITIONS, False)
        p = tl.load(own_logits + start)
        if not NORMALIZED:
            p = _probabilities(p.to(tl.float32), m, l, keys.dtype, ACCURATE_EXP)
        acc = tl.dot(p, keys, acc, input_precision=DOT_PRECISION)
    if MODE != 0:
        for start in range(0, slots, BLOCK_N):
            keys, ok = _entry_keys(c_row, idx_row, stride_c_t, slots, T, start, offs_d, MODE, D,
                                   CHUNKS * D_CHUNK, BLOCK_N)
            p = tl.load(own_logits + WINDOW_SLOTS + start)
            if not NORMALIZED:
                p = _probabilities(p.to(tl.float32), m, l, keys.dtype, ACCURATE_EXP)
            acc = tl.dot(p, keys, acc, input_precision=DOT_PRECISION)

    out = acc.to(out_ptr.dtype.element_ty)
    if R > 0:
        if (chunk + 1) * D_CHUNK > D - 2 * R:
            out = _inverse_rope(out, cos_ptr + b * stride_cs_b + s * stride_cs_s, sin_ptr + b * stride_sn_b
                                + s * stride_sn_s, chunk * (D_CHUNK // 2), D, R, BLOCK_H, D_CHUNK)
    tl.store(out_ptr + b * stride_o_b + s * stride_o_s + offs_h[:, None] * stride_o_h + offs_d[None, :], out,
             mask=h_ok[:, None] & d_ok[None, :])


# the normalising kernel's tile: rows of one (query, head block) a program, columns an iteration
_NORMALIZE_ROWS = 16
_NORMALIZE_COLS = 64


@triton.jit
def _normalize_kernel(logits_ptr, stats_ptr, ranges_ptr, queries, head_blocks, slot_tiles,
                      BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW_SLOTS: tl.constexpr, ROWS: tl.constexpr,
                      COLS: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    """Split path, between the two kernels (`normalize="separate"`): ROWS scratch rows of one (query, head block)
    rewritten in place as round(exp(logit - max) / sum), over the key tiles the values kernel reads: the window's,
    then the picks' or the visible entries'.  In the scores kernel this pass runs in one warpgroup a program with
    nothing beside it to hide its exp and division; in the values kernel it runs once per D chunk."""
    block = tl.program_id(0)
    flat = block // head_blocks
    rows = queries * head_blocks * BLOCK_H
    r = block * BLOCK_H + tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    m = tl.load(stats_ptr + r)
    l = tl.load(stats_ptr + rows + r)
    lo = tl.load(ranges_ptr + flat)
    hi = tl.load(ranges_ptr + queries + flat)
    slots = tl.load(ranges_ptr + 2 * queries + flat)
    row_ptr = logits_ptr + r.to(tl.int64)[:, None] * (slot_tiles * BLOCK_N)
    _normalize_span(row_ptr, tl.cdiv(hi - lo, BLOCK_N) * BLOCK_N, m, l, COLS, ACCURATE_EXP)
    _normalize_span(row_ptr + WINDOW_SLOTS, tl.cdiv(slots, BLOCK_N) * BLOCK_N, m, l, COLS, ACCURATE_EXP)


@triton.jit
def _normalize_span(row_ptr, end, m, l, COLS: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    """Columns [0, end) of the rows at `row_ptr`, COLS at a time."""
    cols = tl.arange(0, COLS)[None, :]
    for start in range(0, end, COLS):
        seen = start + cols < end
        x = tl.load(row_ptr + start + cols, mask=seen, other=0.0).to(tl.float32)
        tl.store(row_ptr + start + cols, _probabilities(x, m, l, row_ptr.dtype.element_ty, ACCURATE_EXP), mask=seen)


def compressed_attention_default_config(H: int, D: int, path: str = "split") -> dict:
    """All heads of a query in one program up to 64 (one MMA M tile), the stored logits, and each path's fastest
    launch of the H200 sweeps (V4-Flash shapes, S=8192; benchmarks/results/
    2026-12-02_h200_compressed_attention_gluon_*):
    the split path (the default) with 32 keys per scores tile (the Gluon kernel with 3 stages where it runs,
    otherwise the Triton one with 4 warps and 1 stage), the probabilities normalised in their own kernel, then p.v
    over 128-wide D chunks with 4 warps and 3 stages: CSA 2.80 ms, HCA 0.98 ms (run 66; Triton scores: 3.29, 1.06);
    the fused kernel with 64 keys per tile, 8 warps, 2 stages: CSA 3.97 ms, HCA 1.55 ms."""
    block_h = max(16, min(64, next_power_of_2(H)))
    dp = max(16, next_power_of_2(D))
    common = {"block_h": block_h, "accurate_exp": True, "store_logits": True, "check_positions": False,
              "path": path, "d_chunk": 128, "normalize": "separate", "pv_num_warps": 4, "pv_num_stages": 3,
              "scores_maxnreg": None, "scores_kernel": "auto", "scores_stages": 3}
    if path == "split":
        return {**common, "block_n": 32, "num_warps": 4, "num_stages": 1}
    return {**common, "block_n": 64, "num_warps": 8 if block_h * dp >= 64 * 256 else 4, "num_stages": 2}


GLUON_SCORES_REQUIREMENTS = (
    "scores_kernel='gluon' needs a Hopper GPU (sm_90), bf16 or fp16 inputs, a head dim of 64-512 (a power of two), "
    "64 heads a block, 16-64 keys a tile, no position checks, key rows 16-byte aligned, and scores_stages >= 2")


def gluon_scores_supported(q: torch.Tensor, kv: torch.Tensor, keys: torch.Tensor, cfg: dict) -> bool:
    """Whether the split path's scores can run in the Gluon kernel (kernels/compressed_attention_gluon.py): wgmma
    is Hopper's, the query tile sits in registers (D <= 512), and the key rows are gathered 16 bytes at a time."""
    D = q.shape[-1]
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(1) * t.element_size() % 16 == 0 for t in (kv, keys))
    return (not interpreting() and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype in (torch.bfloat16, torch.float16) and 64 <= D <= 512 and D & (D - 1) == 0
            and cfg["block_h"] == 64 and cfg["block_n"] in (16, 32, 64) and not cfg["check_positions"] and aligned
            and cfg["scores_stages"] >= 2)


def _unit_last(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Kernels take any outer strides but want unit stride in the last dim."""
    if x is None or x.stride(-1) == 1 or x.shape[-1] <= 1:
        return x
    return x.contiguous()


def compressed_attention_triton(q, kv, q_positions, kv_positions, compressed, indices, sinks, scale, window,
                                compress_rate, cos=None, sin=None, window_mask=None, *, block_h=None, block_n=None,
                                num_warps=None,
                                num_stages=None, accurate_exp=None, store_logits=None, check_positions=None,
                                path=None, d_chunk=None, normalize=None, pv_num_warps=None,
                                pv_num_stages=None, scores_maxnreg=None, scores_kernel=None, scores_stages=None):
    """The CUDA path (or CPU tensors under TRITON_INTERPRET): no host sync, no shape that depends on data.
    `kv_positions[b]` must be -1 padding then increasing positions (see the module docstring); indices are
    never trusted.  `store_logits` (default) trades pass 2's q.k for a [B * S, H, window + k] scratch in the
    input dtype (80 KiB per query at V4-Flash's CSA shapes); `accurate_exp=False` uses the approximate exp and
    a reciprocal multiply (5-10 % faster, a few more one-ulp differences).  `path="split"` runs the two passes
    as two kernels (see `_split_attention`); both paths give the same bits at equal block_n, and so do the split
    path's three places to normalise the probabilities (`normalize`: "separate", the default, "scores" or
    "values").  `scores_kernel` picks the split path's scores kernel: "auto" (Gluon where `gluon_scores_supported`,
    else Triton), "triton" or "gluon"; `scores_stages` is the Gluon kernel's ring depth.  A `window_mask` runs the
    fused kernel without the scratch and without position checks (see the module docstring)."""
    _validate(q, kv, q_positions, kv_positions, compressed, indices, sinks, window, compress_rate, cos, sin,
              window_mask, check_values=False)
    _check(cos is None or q.shape[-1] % 2 == 0, f"the inverse RoPE needs an even head dim, got {q.shape[-1]}")
    B, S, H, D = q.shape
    N = kv.shape[1]
    q, kv, compressed, indices, cos, sin = (_unit_last(t) for t in (q, kv, compressed, indices, cos, sin))
    q_positions, kv_positions = q_positions.contiguous(), kv_positions.contiguous()
    # a window_mask runs the fused kernel: its launch defaults, not the split path's scores-kernel ones (4 warps
    # would hold the [64, 512] fp32 accumulator in 256 registers a thread)
    cfg = compressed_attention_default_config(H, D, "fused" if window_mask is not None else path or "split")
    for key, value in (("block_h", block_h), ("block_n", block_n), ("num_warps", num_warps),
                       ("num_stages", num_stages), ("accurate_exp", accurate_exp), ("store_logits", store_logits),
                       ("check_positions", check_positions), ("path", path), ("d_chunk", d_chunk),
                       ("normalize", normalize), ("pv_num_warps", pv_num_warps),
                       ("pv_num_stages", pv_num_stages), ("scores_maxnreg", scores_maxnreg),
                       ("scores_kernel", scores_kernel), ("scores_stages", scores_stages)):
        if value is not None:
            cfg[key] = value
    _check(cfg["path"] in ("fused", "split"), f"path must be 'fused' or 'split', got {cfg['path']!r}")
    _check(cfg["normalize"] in ("scores", "separate", "values"),
           f"normalize must be 'scores', 'separate' or 'values', got {cfg['normalize']!r}")
    _check(cfg["scores_kernel"] in ("auto", "triton", "gluon"),
           f"scores_kernel must be 'auto', 'triton' or 'gluon', got {cfg['scores_kernel']!r}")
    if window_mask is not None:
        cfg.update(path="fused", store_logits=False, check_positions=False)
    _check(cfg["d_chunk"] >= 16 and cfg["d_chunk"] & (cfg["d_chunk"] - 1) == 0,
           f"d_chunk must be a power of two >= 16, got {cfg['d_chunk']}")
    out = torch.empty((B, S, H, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    mode = _SLIDING if compressed is None else (_HCA if indices is None else _CSA)
    T = 0 if compressed is None else compressed.shape[1]
    K = 0 if indices is None else indices.shape[2]
    ranges = torch.empty((3, B * S), dtype=torch.int32, device=q.device)
    idx_arg = indices if indices is not None else ranges  # never read outside CSA
    block_q = 64
    _key_ranges_kernel[(B, cdiv(S, block_q))](
        q_positions, kv_positions, idx_arg, ranges,
        q_positions.stride(0), kv_positions.stride(0),
        idx_arg.stride(0) if indices is not None else 0, idx_arg.stride(1) if indices is not None else 0,
        S, N, K, T, window, compress_rate, max(1, N.bit_length()) if N else 0,
        MODE=mode, BLOCK_Q=block_q, BLOCK_K=min(128, max(16, next_power_of_2(max(K, 1)))))
    if window_mask is not None:
        mask_arg = _masked_spans(window_mask, ranges)
    else:
        mask_arg = ranges  # never read
    c_arg = compressed if compressed is not None else kv
    rope = cos is not None
    cos_arg, sin_arg = (cos, sin) if rope else (sinks, sinks)
    dp = max(16, next_power_of_2(D))
    accurate = bool(cfg["accurate_exp"]) and not interpreting()
    block_h, block_n = cfg["block_h"], cfg["block_n"]
    head_blocks = cdiv(H, block_h)
    window_slots = cdiv(window, block_n) * block_n
    slots = window_slots + cdiv({_SLIDING: 0, _CSA: K, _HCA: T}[mode], block_n) * block_n
    if cfg["path"] == "split":
        _split_attention(q, kv, c_arg, idx_arg, q_positions, kv_positions, ranges, sinks, cos_arg, sin_arg, out,
                         indices is not None, rope, scale, T, window, mode, cfg, accurate, window_slots, slots)
        return out
    if cfg["store_logits"]:
        logits = torch.empty((B * S * head_blocks * block_h * slots,), dtype=q.dtype, device=q.device)
    else:
        logits = out  # never touched
    _compressed_attention_kernel[(B * S, head_blocks)](
        q, kv, c_arg, idx_arg, q_positions, kv_positions, ranges, sinks, cos_arg, sin_arg, out, logits, mask_arg,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        c_arg.stride(0), c_arg.stride(1),
        idx_arg.stride(0) if indices is not None else 0, idx_arg.stride(1) if indices is not None else 0,
        q_positions.stride(0), kv_positions.stride(0),
        cos.stride(0) if rope else 0, cos.stride(1) if rope else 0,
        sin.stride(0) if rope else 0, sin.stride(1) if rope else 0,
        out.stride(0), out.stride(1), out.stride(2),
        mask_arg.stride(0) if window_mask is not None else 0, mask_arg.stride(1) if window_mask is not None else 0,
        S, H, T, window, slots // block_n, float(scale),
        D=D, DP=dp, R=cos.shape[2] if rope else 0, BLOCK_H=block_h, BLOCK_N=block_n,
        MODE=mode, ACCURATE_EXP=accurate, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        STORE_LOGITS=bool(cfg["store_logits"]), WINDOW_SLOTS=window_slots,
        CHECK_POSITIONS=bool(cfg["check_positions"]), HAS_MASK=window_mask is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _masked_spans(window_mask: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """Each query's window rows [lo, hi) from its first to its last seen row of `window_mask` ([0, 0) when it sees
    none), written over the key ranges' first two rows; the mask as bytes with unit stride in the last dim."""
    seen = _unit_last(window_mask).view(torch.uint8)
    N = seen.shape[-1]
    if N:
        some = seen.amax(-1) > 0
        first = seen.argmax(-1)
        end = N - seen.flip(-1).argmax(-1)
        ranges[0].copy_(torch.where(some, first, 0).flatten())
        ranges[1].copy_(torch.where(some, end, 0).flatten())
    return seen


def _split_attention(q, kv, c_arg, idx_arg, q_positions, kv_positions, ranges, sinks, cos_arg, sin_arg, out,
                     has_indices, rope, scale, T, window, mode, cfg, accurate, window_slots, slots):
    """The split path: kernel 1 (scores: the logits, and the row max and sum) over (query, head block), the
    probabilities where `normalize` says (in kernel 1, in `_normalize_kernel` between the two, or in kernel 2),
    kernel 2 (p @ v and the epilogue) over (query x D chunk, head block).  The scratch is the fused kernel's
    [B * S, head blocks, BLOCK_H, slots] in the input dtype, plus [2, B * S * H] fp32 row statistics unless
    kernel 1 normalises; nothing is stored in the output until kernel 2."""
    B, S, H, D = q.shape
    dp = max(16, next_power_of_2(D))
    block_h, block_n = cfg["block_h"], cfg["block_n"]
    head_blocks = cdiv(H, block_h)
    d_chunk = min(cfg["d_chunk"], dp)
    in_scores = cfg["normalize"] == "scores"
    rows = B * S * head_blocks * block_h
    logits = torch.empty((rows * slots,), dtype=q.dtype, device=q.device)
    stats = logits if in_scores else torch.empty((2 * rows,), dtype=torch.float32, device=q.device)
    common = dict(BLOCK_H=block_h, BLOCK_N=block_n, MODE=mode, ACCURATE_EXP=accurate,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WINDOW_SLOTS=window_slots,
                  CHECK_POSITIONS=bool(cfg["check_positions"]))
    idx_strides = (idx_arg.stride(0), idx_arg.stride(1)) if has_indices else (0, 0)
    # a register cap lets two 8-warp scores programs share an SM (their 64 x D query tile sits in shared memory)
    cap = {} if cfg["scores_maxnreg"] is None else {"maxnreg": cfg["scores_maxnreg"]}
    use_gluon = cfg["scores_kernel"] != "triton" and gluon_scores_supported(q, kv, c_arg, cfg)
    _check(use_gluon or cfg["scores_kernel"] != "gluon", GLUON_SCORES_REQUIREMENTS)
    if use_gluon:
        from dsfuse.kernels import compressed_attention_gluon

        pick_tiles = next_power_of_2(cdiv(idx_arg.shape[2], block_n)) if has_indices else 1
        compressed_attention_gluon.launch_scores(
            q, kv, c_arg, idx_arg, ranges, sinks, logits, stats, has_indices, scale, T, mode, block_n,
            cfg["scores_stages"], window_slots, slots, pick_tiles * block_n, in_scores, accurate)
    else:
        _attention_scores_kernel[(B * S, head_blocks)](
            q, kv, c_arg, idx_arg, q_positions, kv_positions, ranges, sinks, logits, stats,
            q.stride(0), q.stride(1), q.stride(2),
            kv.stride(0), kv.stride(1),
            c_arg.stride(0), c_arg.stride(1),
            *idx_strides,
            q_positions.stride(0), kv_positions.stride(0),
            S, H, T, window, slots // block_n, float(scale),
            D=D, DP=dp, NORMALIZE=in_scores, **common,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **cap,
        )
    if cfg["normalize"] == "separate":
        norm_rows = min(_NORMALIZE_ROWS, block_h)
        _normalize_kernel[(B * S * head_blocks, block_h // norm_rows)](
            logits, stats, ranges, B * S, head_blocks, slots // block_n, BLOCK_H=block_h, BLOCK_N=block_n,
            WINDOW_SLOTS=window_slots, ROWS=norm_rows, COLS=_NORMALIZE_COLS, ACCURATE_EXP=accurate)
    _attention_values_kernel[(B * S * cdiv(D, d_chunk), head_blocks)](
        kv, c_arg, idx_arg, q_positions, kv_positions, ranges, cos_arg, sin_arg, out, logits, stats,
        kv.stride(0), kv.stride(1),
        c_arg.stride(0), c_arg.stride(1),
        *idx_strides,
        q_positions.stride(0), kv_positions.stride(0),
        cos_arg.stride(0) if rope else 0, cos_arg.stride(1) if rope else 0,
        sin_arg.stride(0) if rope else 0, sin_arg.stride(1) if rope else 0,
        out.stride(0), out.stride(1), out.stride(2),
        S, H, T, window, slots // block_n,
        D=D, D_CHUNK=d_chunk, R=cos_arg.shape[2] if rope else 0, NORMALIZED=cfg["normalize"] != "values",
        **common,
        num_warps=cfg["pv_num_warps"], num_stages=cfg["pv_num_stages"],
    )


@torch.library.custom_op("dsfuse::compressed_attention", mutates_args=())
def compressed_attention(q: torch.Tensor, kv: torch.Tensor, q_positions: torch.Tensor, kv_positions: torch.Tensor,
                         compressed: Optional[torch.Tensor], indices: Optional[torch.Tensor], sinks: torch.Tensor,
                         scale: float, window: int, compress_rate: int, cos: Optional[torch.Tensor],
                         sin: Optional[torch.Tensor], window_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """V4 attention output [B, S, H, D] in q's dtype (reference math on CPU)."""
    _validate(q, kv, q_positions, kv_positions, compressed, indices, sinks, window, compress_rate, cos, sin,
              window_mask, check_values=True)
    return compressed_attention_reference(q, kv, q_positions, kv_positions, compressed, indices, sinks, scale, window,
                                          compress_rate, cos, sin, window_mask)


@compressed_attention.register_fake
def _compressed_attention_fake(q, kv, q_positions, kv_positions, compressed, indices, sinks, scale, window,
                               compress_rate, cos, sin, window_mask=None):
    _validate(q, kv, q_positions, kv_positions, compressed, indices, sinks, window, compress_rate, cos, sin,
              window_mask, check_values=False)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@direct_kernel(compressed_attention)
def _compressed_attention_cuda(q, kv, q_positions, kv_positions, compressed, indices, sinks, scale, window,
                               compress_rate, cos, sin, window_mask=None):
    return compressed_attention_triton(q, kv, q_positions, kv_positions, compressed, indices, sinks, scale, window,
                                       compress_rate, cos, sin, window_mask)


__all__ = ["compressed_attention", "compressed_attention_reference", "compressed_attention_triton",
           "inverse_rope_reference"]
