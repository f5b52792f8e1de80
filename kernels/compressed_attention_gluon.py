"""Gluon (Hopper) scores kernel of `dsfuse::compressed_attention`'s split path.

The Triton scores kernel (`compressed_attention._attention_scores_kernel`) reaches ~110 TFLOP/s on V4-Flash's
shapes: each key tile is a gather Triton does not pipeline there, so the load, the MMA and the softmax of a tile run
one after the other. This kernel computes the same thing with the pipeline spelled out:

- the query's [64 heads, D] tile lives in registers as the wgmma A operand (no shared memory, no re-reads);
- key tiles are gathered row by row with cp.async into a ring of STAGES shared-memory buffers, STAGES - 1 tiles
  ahead of the MMA, so loads stay in flight while a tile is multiplied and its softmax statistics are updated;
- a CSA query's picks are copied to shared memory once, so the gathers never wait on an index load;
- the window rows, then the picks (CSA) or the visible entries (HCA), are one stream of tiles.

The arithmetic is the Triton kernel's, operation for operation: logits rounded as HF rounds them, stored in the
same scratch layout, the row max and sum folded from the sink, then either stored for the split path's normalising
kernel (the default) or used here to rewrite the stored logits in place as round(exp(logit - max) / sum). Gluon has
no CPU interpreter: the GPU tests compare this kernel with the Triton one, and the CPU tests compile it for sm_90.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# the CTA-wide barrier: `thread_barrier` up to triton 3.6, `barrier` since
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# cp.async of a pointer tensor into shared memory: `async_copy_global_to_shared` up to 3.6, `async_load` since
_async_load = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
NUM_WARPS = gl.constexpr(4)  # one warpgroup: the 64 heads of a query are one wgmma M tile


@gluon.jit
def _tile_source(t, tiles_w, lo, hi, slots, T, kv_row, c_row, stride_kv_n, stride_c_t, idx_smem, offs,
                 MODE: gl.constexpr, BLOCK_N: gl.constexpr, WINDOW_SLOTS: gl.constexpr, KT: gl.constexpr):
    """Tile t of a query's key stream: window tiles first, then compressed tiles.  Returns the key rows' base
    pointer and stride, the rows, which of them the query sees, and the tile's first scratch column."""
    if t < tiles_w:
        rows = lo + t * BLOCK_N + offs
        ok = rows < hi
        base = kv_row
        stride = stride_kv_n
        col = t * BLOCK_N
    else:
        u = t - tiles_w
        slot = u * BLOCK_N + offs
        if MODE == 1:
            ids = idx_smem.index(gl.minimum(u, KT - 1)).load(offs.type.layout)
            ok = (ids >= 0) & (slot < slots)
            rows = gl.where(ok, ids, 0)
        else:
            ok = slot < slots
            rows = slot
        base = c_row
        stride = stride_c_t
        col = WINDOW_SLOTS + u * BLOCK_N
    return base, stride, rows, ok, col


@gluon.jit
def _issue_tile(t, tiles, tiles_w, lo, hi, slots, T, kv_row, c_row, stride_kv_n, stride_c_t, idx_smem, k_bufs,
                offs_n, offs_d, MODE: gl.constexpr, BLOCK_N: gl.constexpr, WINDOW_SLOTS: gl.constexpr,
                KT: gl.constexpr, STAGES: gl.constexpr):
    """cp.async the key rows of tile t into its ring slot (rows the query does not see, and tiles past the last,
    are zero-filled) and close the copy group, so every iteration waits on the same group count."""
    base, stride, rows, ok, col = _tile_source(t, tiles_w, lo, hi, slots, T, kv_row, c_row, stride_kv_n,
                                               stride_c_t, idx_smem, offs_n, MODE, BLOCK_N, WINDOW_SLOTS, KT)
    ok = ok & (t < tiles)
    ptrs = base + rows.to(gl.int64)[:, None] * stride + offs_d[None, :]
    _async_load(k_bufs.index(t % STAGES), ptrs, mask=ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _exp(x, ACCURATE_EXP: gl.constexpr):
    """expf as PyTorch's softmax computes it (libdevice), or the approximate exp2-based one."""
    if ACCURATE_EXP:
        return libdevice.exp(x)
    else:
        return gl.exp(x)


@gluon.jit
def _logits_tile(qk, ok, ptrs, m, l, scale, dtype: gl.constexpr, ACCURATE_EXP: gl.constexpr):
    """HF's rounding of a tile's logits (q.k, then times scale, in the input dtype), -inf where unseen, stored;
    the row max and sum updated (online, from the sink)."""
    x = (qk.to(dtype).to(gl.float32) * scale).to(dtype).to(gl.float32)
    x = gl.where(ok[None, :], x, float("-inf"))
    gl.store(ptrs, x.to(dtype))
    m_new = gl.maximum(m, gl.max(x, 1))
    l = l * _exp(m - m_new, ACCURATE_EXP) + gl.sum(_exp(x - m_new[:, None], ACCURATE_EXP), 1)
    return m_new, l


@gluon.jit
def _finish_scores(own_logits, stats_ptr, m, l, tiles, tiles_w, block, offs_key, dtype: gl.constexpr,
                   BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, WINDOW_SLOTS: gl.constexpr, NORMALIZE: gl.constexpr,
                   ACCURATE_EXP: gl.constexpr):
    """The stored logits rewritten as round(exp(logit - max) / sum), loads one tile ahead of the math; or (not
    NORMALIZE) the row max and sum stored for the values kernel."""
    if NORMALIZE:
        _cta_barrier()  # the loop's logit stores are complete before the pass reads them back
        first = 0
        if tiles_w == 0:
            first = WINDOW_SLOTS
        x = gl.load(own_logits + first, mask=(tiles > 0) & (offs_key < BLOCK_N)[None, :], other=0.0).to(gl.float32)
        for t in range(0, tiles):
            col = t * BLOCK_N
            if t >= tiles_w:
                col = WINDOW_SLOTS + (t - tiles_w) * BLOCK_N
            next_col = col + BLOCK_N
            if t + 1 == tiles_w:
                next_col = WINDOW_SLOTS
            x_next = gl.load(own_logits + next_col, mask=(t + 1 < tiles) & (offs_key < BLOCK_N)[None, :],
                             other=0.0).to(gl.float32)
            if ACCURATE_EXP:
                p = gl.div_rn(_exp(x - m[:, None], ACCURATE_EXP), l[:, None])
            else:
                p = _exp(x - m[:, None], ACCURATE_EXP) * (1.0 / l)[:, None]
            gl.store(own_logits + col, p.to(dtype))
            x = x_next
    else:
        rows = block * BLOCK_H + gl.arange(0, BLOCK_H, layout=m.type.layout)
        gl.store(stats_ptr + rows, m)
        gl.store(stats_ptr + gl.num_programs(0).to(gl.int64) * gl.num_programs(1) * BLOCK_H + rows, l)


@gluon.jit(do_not_specialize=["S", "H", "T", "slot_tiles"])
def attention_scores_gluon_kernel(
    q_ptr, kv_ptr, c_ptr, idx_ptr, ranges_ptr, sink_ptr, logits_ptr, stats_ptr,
    stride_q_b, stride_q_s, stride_q_h,
    stride_kv_b, stride_kv_n,
    stride_c_b, stride_c_t,
    stride_idx_b, stride_idx_s,
    S, H, T, slot_tiles, scale,
    D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
    K_SLOTS: gl.constexpr, WINDOW_SLOTS: gl.constexpr, NORMALIZE: gl.constexpr, ACCURATE_EXP: gl.constexpr,
):
    """One query and its BLOCK_H (= 64) heads a program: the split path's kernel 1.  With NORMALIZE the stored
    logits become the rounded probabilities (the loads of that pass run one tile ahead of the math); otherwise
    the row max and sum go to `stats_ptr` for the values kernel, as the Triton kernel stores them."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                                 warps_per_cta=[NUM_WARPS, 1], order=[1, 0])
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    KT: gl.constexpr = (K_SLOTS + BLOCK_N - 1) // BLOCK_N
    idx_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    total = gl.num_programs(0).to(gl.int64)
    flat = total - 1 - gl.program_id(0)  # latest queries (most visible HCA entries) first, as the Triton kernel
    b = flat // S
    s = flat % S
    head0 = gl.program_id(1) * BLOCK_H

    offs_qh = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_layout))
    offs_qd = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(q_ptr + b * stride_q_b + s * stride_q_s + offs_qh[:, None] * stride_q_h + offs_qd[None, :],
                mask=(offs_qh < H)[:, None], other=0.0)

    lo = gl.load(ranges_ptr + flat)
    hi = gl.load(ranges_ptr + total + flat)
    slots = gl.load(ranges_ptr + 2 * total + flat)
    kv_row = kv_ptr + b * stride_kv_b
    c_row = c_ptr + b * stride_c_b
    tiles_w = gl.cdiv(hi - lo, BLOCK_N)
    tiles = tiles_w
    if MODE != 0:
        tiles = tiles_w + gl.cdiv(slots, BLOCK_N)

    # CSA: the query's picks in shared memory, [KT, BLOCK_N] (a rank-1 layout, so a row can be indexed), -1 past
    # `slots`, range-checked before narrowing to int32
    idx_smem = gl.allocate_shared_memory(gl.int32, [KT, BLOCK_N], idx_smem_layout)
    if MODE == 1:
        pick = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, rows_layout))
        idx_row = idx_ptr + b * stride_idx_b + s * stride_idx_s
        for kt in gl.static_range(KT):
            ids = gl.load(idx_row + kt * BLOCK_N + pick, mask=kt * BLOCK_N + pick < slots, other=-1)
            idx_smem.index(kt).store(gl.where((ids >= 0) & (ids < T), ids, -1).to(gl.int32))
    _cta_barrier()

    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], key_smem)
    _scores_loop(q, k_bufs, idx_smem, logits_ptr, stats_ptr, sink_ptr, head0, flat, tiles, tiles_w, lo, hi, slots, T,
                 kv_row, c_row, stride_kv_n, stride_c_t, H, slot_tiles, scale, MODE, BLOCK_H, BLOCK_N, WINDOW_SLOTS,
                 KT, STAGES, D, NORMALIZE, ACCURATE_EXP)


@gluon.jit
def _scores_loop(q, k_bufs, idx_smem, logits_ptr, stats_ptr, sink_ptr, head0, flat, tiles, tiles_w, lo, hi, slots, T,
                 kv_row, c_row, stride_kv_n, stride_c_t, H, slot_tiles, scale, MODE: gl.constexpr,
                 BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, WINDOW_SLOTS: gl.constexpr, KT: gl.constexpr,
                 STAGES: gl.constexpr, D: gl.constexpr, NORMALIZE: gl.constexpr, ACCURATE_EXP: gl.constexpr):
    """Every warp loads and computes: cp.async groups STAGES - 1 tiles ahead of the MMA, a CTA barrier a tile."""
    dtype: gl.constexpr = q.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                                 warps_per_cta=[NUM_WARPS, 1], order=[1, 0])
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, rows_layout))
    for i in gl.static_range(STAGES - 1):
        _issue_tile(i, tiles, tiles_w, lo, hi, slots, T, kv_row, c_row, stride_kv_n, stride_c_t, idx_smem, k_bufs,
                    offs_n, offs_d, MODE, BLOCK_N, WINDOW_SLOTS, KT, STAGES)

    offs_h = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, mma))
    offs_key = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    block = flat * gl.num_programs(1) + gl.program_id(1)
    row_len = slot_tiles * BLOCK_N
    own_logits = logits_ptr + block * (BLOCK_H * row_len) + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, mma))[
        :, None] * row_len + offs_key[None, :]
    m = gl.load(sink_ptr + offs_h, mask=offs_h < H, other=0.0)
    l = gl.full([BLOCK_H], 1.0, gl.float32, layout=gl.SliceLayout(1, mma))  # exp(sink - m) with m = sink
    zeros = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=mma)

    for t in range(0, tiles):
        async_copy.wait_group(STAGES - 2)
        _cta_barrier()  # every thread's rows of tile t landed; every warp is done with tile t - 1's slot
        fence_async_shared()
        _issue_tile(t + STAGES - 1, tiles, tiles_w, lo, hi, slots, T, kv_row, c_row, stride_kv_n, stride_c_t,
                    idx_smem, k_bufs, offs_n, offs_d, MODE, BLOCK_N, WINDOW_SLOTS, KT, STAGES)
        acc = warpgroup_mma(q, k_bufs.index(t % STAGES).permute((1, 0)), zeros, use_acc=False, is_async=True)
        _, _, _, ok, col = _tile_source(t, tiles_w, lo, hi, slots, T, kv_row, c_row, stride_kv_n, stride_c_t,
                                        idx_smem, offs_key, MODE, BLOCK_N, WINDOW_SLOTS, KT)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        m, l = _logits_tile(qk, ok, own_logits + col, m, l, scale, dtype, ACCURATE_EXP)
    async_copy.wait_group(0)
    _finish_scores(own_logits, stats_ptr, m, l, tiles, tiles_w, block, offs_key, dtype, BLOCK_H, BLOCK_N,
                   WINDOW_SLOTS, NORMALIZE, ACCURATE_EXP)


def launch_scores(q, kv, c_arg, idx_arg, ranges, sinks, logits, stats, has_indices, scale, T, mode, block_n, stages,
                  window_slots, slots, pick_slots, normalize, accurate_exp):
    """Kernel 1 of the split path in Gluon (see the module docstring); same arguments, scratch and statistics as
    the Triton scores kernel.  `pick_slots`: a CSA query's picks rounded up to a power-of-two count of tiles
    (a compile-time size: it depends on the model's top-k only)."""
    B, S, H, D = q.shape
    idx_strides = (idx_arg.stride(0), idx_arg.stride(1)) if has_indices else (0, 0)
    attention_scores_gluon_kernel[(B * S, (H + 63) // 64)](
        q, kv, c_arg, idx_arg, ranges, sinks, logits, stats,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        c_arg.stride(0), c_arg.stride(1),
        *idx_strides,
        S, H, T, slots // block_n, float(scale),
        D=D, BLOCK_H=64, BLOCK_N=block_n, STAGES=stages, MODE=mode, K_SLOTS=pick_slots,
        WINDOW_SLOTS=window_slots, NORMALIZE=normalize,
        ACCURATE_EXP=accurate_exp, num_warps=NUM_WARPS,
    )
