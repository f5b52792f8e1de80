"""DeepSeek V4's manifold-constrained hyper-connections (HF `DeepseekV4HyperConnection`, `DeepseekV4HyperHead`
and the expand + mix of `DeepseekV4DecoderLayer.forward`) as three custom ops:

`torch.ops.dsfuse.hc_collapse(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters) -> (collapsed, post, comb)`,
one launch per hyper-connection, x = [*, n, D] streams (T tokens in all):

    flat    = x.flatten(-2).float();  flat = flat * rsqrt(mean(flat^2) + norm_eps)        (unweighted RMSNorm)
    mixes   = flat @ fn.float().T                                      [*, (2 + n) n] fp32
    pre     = sigmoid(mixes[:n] * scale[0] + base[:n]) + hc_eps
    post    = 2 * sigmoid(mixes[n:2n] * scale[1] + base[n:2n])
    comb    = softmax(mixes[2n:].view(n, n) * scale[2] + base[2n:].view(n, n), -1) + hc_eps
    comb    = comb / (comb.sum(-2) + hc_eps);  (iters - 1) x: rows / (sum(-1) + hc_eps), columns / (sum(-2) + hc_eps)
    collapsed = (pre[..., None] * x).sum(-2).to(x.dtype)

`torch.ops.dsfuse.hc_head(x, fn, base, scale, norm_eps, hc_eps) -> collapsed`: the same with fn of n rows, only
`pre` (scale [1]): `DeepseekV4HyperHead`.

`torch.ops.dsfuse.hc_expand_mix(out, residual, post, comb) -> streams`, the block's exit:

    streams = post.to(dtype)[..., None] * out[..., None, :] + comb.to(dtype).transpose(-1, -2) @ residual

every op rounded to the streams' dtype as torch rounds it (the product, the matmul once after its fp32 sum
over n, the add).

`torch.ops.dsfuse.hc_exit_collapse(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, iters) ->
(streams, collapsed, post, comb)`: an exit and the next hyper-connection; the partials kernel computes each chunk
of the new streams, stores it and reduces it from registers (the residual read once, the streams not read back
for the projection). `torch.ops.dsfuse.hc_exit_head(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps)
-> collapsed`: the last exit and the head, the streams never written (nothing else reads them): the mixing
kernel computes them again from the residual.

Kernel design (bandwidth: a hyper-connection moves T x n x D stream elements and nothing else of size). Two
launches, neither walks a whole row serially:
- `_hc_partials_kernel`, grid (row blocks, K splits): each program takes BLOCK_T tokens and one D range of every
  stream, and writes the partial sum of squares and the partial projection (a tensor-core dot of the raw streams
  with fn's columns, `tf32x3`: fp32-accurate; bf16 streams are exact in tf32) to an fp32 scratch [splits, T, NP]
  (the projection in columns < M, the sum of squares in column M). fn is read once per row block and split.
- `_hc_mix_kernel`, grid (row blocks, D tiles): each program sums its rows' partials over the splits in split
  order (every tile alike: the tiles agree bit for bit), scales the projection by the token's rsqrt afterwards
  (HF scales before the dot: the same value up to the rounding of one product), then the mixing: pre in every
  tile, post and comb (softmax and every Sinkhorn step in registers with IEEE divisions, `tl.div_rn`, HF's order
  and eps) stored by the first tile only; then its tile of collapsed = sum_j pre_j x_j.
Each logit piece is loaded straight from the scratch in the layout its step needs (no barrier). The streams are
read twice (partials, collapse): keeping them on chip in between would need BLOCK_T x n x D x 2 bytes per program
(32 KiB a token at n = 4, D = 4096, bf16). `hc_expand_mix` is one pass over the residual and the block output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse.kernels.norm_rope_quant import COMPILE_OPTIONS, _round_to
from dsfuse.kernels.triton_support import interpreting

STREAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# fp32-accurate tensor-core dot (three tf32 products); the interpreter computes the dot in fp32 whatever it is told.
PROJECTION_PRECISION = "tf32x3"


def mixes_count(hc_mult: int) -> int:
    """Rows of a hyper-connection's `fn`: pre (n), post (n) and comb (n x n) logits."""
    return (2 + hc_mult) * hc_mult


# --------------------------------------------------------------------------------------------
# Reference (also the CPU implementation): HF's modules, op by op
# --------------------------------------------------------------------------------------------
def _unweighted_rms_norm(x, eps):
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_collapse_reference(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """`DeepseekV4HyperConnection.forward` on streams x [*, n, D]: (collapsed, post, comb)."""
    hc = x.shape[-2]
    flat = _unweighted_rms_norm(x.flatten(-2).float(), norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
    comb_b = comb_b.view(hc, hc)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = torch.softmax(comb_w * comb_scale + comb_b, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
    return collapsed, post, comb


def hc_head_reference(x, fn, base, scale, norm_eps, hc_eps):
    """`DeepseekV4HyperHead.forward` on streams x [*, n, D]."""
    flat = _unweighted_rms_norm(x.flatten(-2).float(), norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)


def hc_expand_mix_reference(out, residual, post, comb):
    """The block exit of `DeepseekV4DecoderLayer.forward`: post * out + comb^T @ residual, in residual's dtype."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)


def hc_exit_collapse_reference(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """A block exit and the next hyper-connection: (streams, collapsed, post, comb)."""
    streams = hc_expand_mix_reference(out, residual, post, comb)
    return (streams, *hc_collapse_reference(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters))


def hc_exit_head_reference(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps):
    """The head of the last block exit's streams (which nothing else reads): collapsed."""
    return hc_head_reference(hc_expand_mix_reference(out, residual, post, comb), fn, base, scale, norm_eps, hc_eps)


# --------------------------------------------------------------------------------------------
# Input checks (shared by the ops, their fakes and the launchers)
# --------------------------------------------------------------------------------------------
def _check_streams(op, x):
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise ValueError(f"{op}: x must be streams [*, hc_mult, hidden] (3 or more dims), got "
                         f"{getattr(x, 'shape', type(x))}")
    if x.dtype not in STREAM_DTYPES:
        raise ValueError(f"{op}: x must be bf16, fp16 or fp32, got {x.dtype}")


def _check_param(op, name, t, shape, device):
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {getattr(t, 'shape', type(t))}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{op}: {name} must be floating point, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, x on {device}")


def _validate_collapse(op, x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head):
    _check_streams(op, x)
    hc, hidden = x.shape[-2], x.shape[-1]
    rows = hc if head else mixes_count(hc)
    _check_param(op, "fn", fn, (rows, hc * hidden), x.device)
    _check_param(op, "base", base, (rows,), x.device)
    _check_param(op, "scale", scale, (1 if head else 3,), x.device)
    if not (norm_eps >= 0 and hc_eps >= 0):
        raise ValueError(f"{op}: eps values must be >= 0, got norm_eps={norm_eps}, hc_eps={hc_eps}")
    if not head and sinkhorn_iters < 1:
        raise ValueError(f"{op}: sinkhorn_iters must be >= 1, got {sinkhorn_iters}")


def _validate_expand_mix(out, residual, post, comb):
    op = "hc_expand_mix"
    _check_streams(op, residual)
    lead, hc, hidden = tuple(residual.shape[:-2]), residual.shape[-2], residual.shape[-1]
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != lead + (hidden,):
        raise ValueError(f"{op}: out must have shape {lead + (hidden,)}, got {getattr(out, 'shape', type(out))}")
    if out.dtype != residual.dtype:
        raise ValueError(f"{op}: out is {out.dtype}, residual {residual.dtype}: HF's mix needs one dtype")
    for name, t, shape in (("post", post, lead + (hc,)), ("comb", comb, lead + (hc, hc))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise ValueError(f"{op}: {name} must have shape {shape}, got {getattr(t, 'shape', type(t))}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{op}: {name} must be floating point, got {t.dtype}")
    for t in (out, post, comb):
        if t.device != residual.device:
            raise ValueError(f"{op}: all inputs must be on {residual.device}, got one on {t.device}")


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _sigmoid(z):
    """1 / (1 + exp(-z)) with an IEEE division (`tl.sigmoid` divides approximately on the GPU)."""
    return tl.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + tl.exp(-z))


@triton.jit
def _split_sum(ptrs, mask, splits, split_stride):
    """The partials at ptrs summed over the K splits in split order (every program sums them alike)."""
    total = tl.load(ptrs, mask=mask, other=0.0)
    for s in range(1, splits):
        total += tl.load(ptrs + s * split_stride, mask=mask, other=0.0)
    return total


@triton.jit(do_not_specialize=["T", "d_split"])
def _hc_partials_kernel(
    x_ptr, fn_ptr, part_ptr, out_ptr, res_ptr, post_in_ptr, comb_in_ptr, T, D, d_split,
    N: tl.constexpr, NN: tl.constexpr, M: tl.constexpr, NP: tl.constexpr, EXIT: tl.constexpr, STORE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr,
):
    """Split s of a row block, over the D range [s d_split, (s + 1) d_split) of every stream: the partial projection
    (columns < M) and sum of squares (column M) -> part[s, rows, :]. With EXIT the streams of each chunk are first
    computed by the previous block's exit (`_exit_stream`, stored with STORE) and reduced from registers."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    split = tl.program_id(1)
    K = N * D
    cols = tl.arange(0, NP)
    col_ok = cols < M
    x_rows = x_ptr + rows[:, None] * K
    acc = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    d_lo = split * d_split
    d_hi = tl.minimum(d_lo + d_split, D)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        d_ok = dd < d_hi
        ok = row_ok[:, None] & d_ok[None, :]
        if EXIT:
            o = tl.load(out_ptr + rows[:, None] * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
        for j in tl.static_range(N):
            if EXIT:
                xj = _exit_stream(o, res_ptr, post_in_ptr, comb_in_ptr, x_ptr, rows, row_ok, dd, ok, D, j, N, STORE,
                                  MANUAL_BF16_RNE)
            else:
                xj = tl.load(x_rows + j * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
            sumsq += tl.sum(xj * xj, axis=1)
            w = tl.load(fn_ptr + cols[None, :] * K + j * D + dd[:, None], mask=d_ok[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            acc = tl.dot(xj, w, acc, input_precision=PRECISION)
    acc = tl.where(cols[None, :] == M, sumsq[:, None], acc)
    tl.store(part_ptr + (split.to(tl.int64) * T + rows)[:, None] * NP + cols[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["T", "splits"])
def _hc_mix_kernel(
    x_ptr, part_ptr, base_ptr, scale_ptr, collapsed_ptr, post_ptr, comb_ptr, out_ptr, res_ptr, post_in_ptr,
    comb_in_ptr, T, D, splits, width, norm_eps, hc_eps, iters,
    N: tl.constexpr, NN: tl.constexpr, M: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr, EXIT: tl.constexpr,
    STORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr,
):
    """A row block's mixing weights from the partials of `_hc_partials_kernel` (post and comb stored by the first D
    tile, pre computed by every tile) and its collapsed D tile. With EXIT and without STORE the streams are computed
    again from the exit's inputs (the head's streams, which nothing else reads)."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    p_rows = part_ptr + rows * NP
    split_stride = T.to(tl.int64) * NP
    # The rows' whole partials in one [BLOCK_T, NP] load per split; columns picked from registers (adding zeros).
    cols = tl.arange(0, NP)
    part = _split_sum(p_rows[:, None] + cols[None, :], row_ok[:, None], splits, split_stride)
    sumsq = tl.sum(tl.where(cols[None, :] == M, part, 0.0), axis=1)
    rstd = tl.rsqrt(tl.div_rn(sumsq, tl.zeros([BLOCK_T], dtype=tl.float32) + width) + norm_eps)
    k = tl.arange(0, NN)
    k_ok = k < N

    if not HEAD:
        if tl.program_id(1) == 0:
            # post = 2 * sigmoid(post_w * scale[1] + base[n:2n])
            post_l = _split_sum(p_rows[:, None] + N + k[None, :], row_ok[:, None] & k_ok[None, :], splits,
                                split_stride) * rstd[:, None]
            post_b = tl.load(base_ptr + N + k, mask=k_ok, other=0.0).to(tl.float32)
            post = 2.0 * _sigmoid(post_l * tl.load(scale_ptr + 1).to(tl.float32) + post_b[None, :])
            tl.store(post_ptr + rows[:, None] * N + k[None, :], post, mask=row_ok[:, None] & k_ok[None, :])
            # comb: softmax over each row of the n x n logits, + eps, then Sinkhorn as HF iterates it.
            i3 = k[None, :, None]
            j3 = k[None, None, :]
            ij_ok = (i3 < N) & (j3 < N)
            comb_l = _split_sum(p_rows[:, None, None] + 2 * N + i3 * N + j3, row_ok[:, None, None] & ij_ok, splits,
                                split_stride) * rstd[:, None, None]
            comb_b = tl.load(base_ptr + 2 * N + i3 * N + j3, mask=ij_ok, other=0.0).to(tl.float32)
            z = comb_l * tl.load(scale_ptr + 2).to(tl.float32) + comb_b
            z = tl.where(ij_ok, z, float("-inf"))
            e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
            comb = tl.div_rn(e, tl.broadcast_to(tl.sum(e, axis=2)[:, :, None], e.shape))
            comb = tl.where(ij_ok, comb + hc_eps, 0.0)
            comb = tl.div_rn(comb, tl.broadcast_to(tl.sum(comb, axis=1)[:, None, :] + hc_eps, comb.shape))
            for _ in range(iters - 1):
                comb = tl.div_rn(comb, tl.broadcast_to(tl.sum(comb, axis=2)[:, :, None] + hc_eps, comb.shape))
                comb = tl.div_rn(comb, tl.broadcast_to(tl.sum(comb, axis=1)[:, None, :] + hc_eps, comb.shape))
            tl.store(comb_ptr + rows[:, None, None] * (N * N) + i3 * N + j3, comb,
                     mask=row_ok[:, None, None] & ij_ok)

    # collapsed = sum_j pre_j * x_j (fp32 products summed in stream order), pre = sigmoid(pre_w * scale[0] + base[:n])
    pre_scale = tl.load(scale_ptr).to(tl.float32)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = dd < D
    ok = row_ok[:, None] & d_ok[None, :]
    if EXIT and not STORE:
        new = _exit_chunk(out_ptr, res_ptr, post_in_ptr, comb_in_ptr, x_ptr, rows, row_ok, dd, d_ok, D, N, NN,
                          BLOCK_T, BLOCK_D, False, MANUAL_BF16_RNE)
        pre_l = _split_sum(p_rows[:, None] + k[None, :], row_ok[:, None] & k_ok[None, :], splits, split_stride)
        pre = _sigmoid(pre_l * rstd[:, None] * pre_scale
                       + tl.load(base_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]) + hc_eps
        total = tl.sum(tl.where(k_ok[None, :], pre, 0.0)[:, :, None] * new, axis=1)
    else:
        x_rows = x_ptr + rows[:, None] * (N * D)
        total = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(N):
            pre_j = _sigmoid(tl.sum(tl.where(cols[None, :] == j, part, 0.0), axis=1) * rstd * pre_scale
                             + tl.load(base_ptr + j).to(tl.float32)) + hc_eps
            xj = tl.load(x_rows + j * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
            total += pre_j[:, None] * xj
    value = _round_to(total, collapsed_ptr.dtype.element_ty, MANUAL_BF16_RNE)
    tl.store(collapsed_ptr + rows[:, None] * D + dd[None, :], value.to(collapsed_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _exit_chunk(out_ptr, res_ptr, post_ptr, comb_ptr, new_ptr, rows, row_ok, dd, d_ok, D, N: tl.constexpr,
                NN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, STORE: tl.constexpr,
                MANUAL_BF16_RNE: tl.constexpr):
    """New streams [BLOCK_T, NN, BLOCK_D] of one D chunk in fp32 (rows k >= n are 0), stored with STORE."""
    k = tl.arange(0, NN)
    k_ok = k < N
    ok = row_ok[:, None] & d_ok[None, :]
    dtype = new_ptr.dtype.element_ty
    o = tl.load(out_ptr + rows[:, None] * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
    p = tl.load(post_ptr + rows[:, None] * N + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    p = _round_to(p.to(tl.float32), dtype, MANUAL_BF16_RNE)
    expanded = _round_to(p[:, :, None] * o[:, None, :], dtype, MANUAL_BF16_RNE)
    mixed = tl.zeros([BLOCK_T, NN, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(N):
        rj = tl.load(res_ptr + rows[:, None] * (N * D) + j * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + rows[:, None] * (N * N) + j * N + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                     other=0.0)
        cj = _round_to(cj.to(tl.float32), dtype, MANUAL_BF16_RNE)
        mixed += cj[:, :, None] * rj[:, None, :]
    new = _round_to(expanded + _round_to(mixed, dtype, MANUAL_BF16_RNE), dtype, MANUAL_BF16_RNE)
    if STORE:
        ptrs = new_ptr + rows[:, None, None] * (N * D) + k[None, :, None] * D + dd[None, None, :]
        tl.store(ptrs, new.to(dtype), mask=ok[:, None, :] & k_ok[None, :, None])
    return new


@triton.jit
def _exit_stream(o, res_ptr, post_ptr, comb_ptr, new_ptr, rows, row_ok, dd, ok, D, k, N: tl.constexpr,
                 STORE: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr):
    """New stream k [BLOCK_T, BLOCK_D] of one D chunk in fp32 from the block output's chunk o, rounded as
    `_exit_chunk` rounds it (stored with STORE); one stream at a time keeps the partials kernel's registers few (the
    residual's chunk is read again from L1 for every k)."""
    dtype = new_ptr.dtype.element_ty
    p = _round_to(tl.load(post_ptr + rows * N + k, mask=row_ok, other=0.0).to(tl.float32), dtype, MANUAL_BF16_RNE)
    expanded = _round_to(p[:, None] * o, dtype, MANUAL_BF16_RNE)
    mixed = tl.zeros(o.shape, dtype=tl.float32)
    for j in tl.static_range(N):
        rj = tl.load(res_ptr + rows[:, None] * (N * D) + j * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + rows * (N * N) + j * N + k, mask=row_ok, other=0.0)
        mixed += _round_to(cj.to(tl.float32), dtype, MANUAL_BF16_RNE)[:, None] * rj
    new = _round_to(expanded + _round_to(mixed, dtype, MANUAL_BF16_RNE), dtype, MANUAL_BF16_RNE)
    if STORE:
        tl.store(new_ptr + rows[:, None] * (N * D) + k * D + dd[None, :], new.to(dtype), mask=ok)
    return new


@triton.jit
def _hc_expand_mix_kernel(
    out_ptr, res_ptr, post_ptr, comb_ptr, new_ptr, T, D,
    N: tl.constexpr, NN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    _exit_chunk(out_ptr, res_ptr, post_ptr, comb_ptr, new_ptr, rows, rows < T, dd, dd < D, D, N, NN, BLOCK_T, BLOCK_D,
                True, MANUAL_BF16_RNE)


# --------------------------------------------------------------------------------------------
# Launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); no host sync
# --------------------------------------------------------------------------------------------
def default_collapse_launch(hidden: int, fused_exit: bool = False) -> dict:
    """Launch of the collapse kernels from static shapes (the GPU benchmark sweeps them): the partials kernel's
    tokens per program (16 or more: a tensor-core dot), D chunk, K splits and warps; the mixing kernel's tokens,
    D tile and warps. With `fused_exit` the partials kernel computes the exit's streams too: a narrower D chunk
    keeps its registers from spilling (sm_90: 64 x 16 x 8 warps 233 registers, 64 x 32 spills)."""
    block_d = max(16, min(16 if fused_exit else 32, triton.next_power_of_2(hidden)))
    return dict(block_t=64, block_d=block_d, splits=max(1, min(8, triton.cdiv(hidden, block_d))), num_warps=8,
                mix_block_t=8, mix_block_d=max(16, min(256, triton.next_power_of_2(hidden))), mix_warps=4)


def _collapse_launch(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head, exit_inputs=None, **launch):
    """(collapsed, post, comb, streams): with `exit_inputs` = (out, post_in, comb_in), x is the exit's residual and
    the streams collapsed are the exit's, written to `streams` (not for the head: streams is None, as without
    `exit_inputs`). Two launches: the split-K partials of the projection and the sum of squares, then the mixing
    and the collapse by D tiles."""
    op = ("hc_exit_" if exit_inputs else "hc_") + ("head" if head else "collapse")
    _validate_collapse(op, x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head)
    cfg = default_collapse_launch(x.shape[-1], fused_exit=exit_inputs is not None)
    unknown = set(launch) - set(cfg)
    if unknown:
        raise ValueError(f"{op}: unknown launch parameters {sorted(unknown)}, expected some of {sorted(cfg)}")
    cfg.update({key: value for key, value in launch.items() if value is not None})
    hc, hidden = x.shape[-2], x.shape[-1]
    lead = tuple(x.shape[:-2])
    source = x.contiguous().view(-1, hc, hidden)
    T = source.shape[0]
    mixes = hc if head else mixes_count(hc)
    n_pad = max(16, triton.next_power_of_2(mixes + 1))  # the projection's columns, then the sum of squares
    collapsed = torch.empty((T, hidden), dtype=x.dtype, device=x.device)
    post = torch.empty((T, hc), dtype=torch.float32, device=x.device)
    comb = torch.empty((T, hc, hc), dtype=torch.float32, device=x.device)
    store = bool(exit_inputs) and not head
    if exit_inputs:
        out, post_in, comb_in = exit_inputs
        _validate_expand_mix(out, x, post_in, comb_in)
        streams = torch.empty((T, hc, hidden), dtype=x.dtype, device=x.device) if store else source
        exit_args = (out.contiguous().view(T, hidden), source, post_in.contiguous().view(T, hc),
                     comb_in.contiguous().view(T, hc, hc))
    else:
        streams, exit_args = source, (source, source, post, comb)
    if T:
        block_d = cfg["block_d"]
        d_split = triton.cdiv(triton.cdiv(hidden, max(1, cfg["splits"])), block_d) * block_d
        splits = triton.cdiv(hidden, d_split)
        partials = torch.empty((splits, T, n_pad), dtype=torch.float32, device=x.device)
        common = dict(N=hc, NN=triton.next_power_of_2(hc), M=mixes, NP=n_pad, EXIT=exit_inputs is not None,
                      STORE=store, MANUAL_BF16_RNE=interpreting() and x.dtype == torch.bfloat16)
        _hc_partials_kernel[(triton.cdiv(T, cfg["block_t"]), splits)](
            streams, fn.contiguous(), partials, *exit_args, T, hidden, d_split, BLOCK_T=cfg["block_t"],
            BLOCK_D=block_d, PRECISION=PROJECTION_PRECISION, num_warps=cfg["num_warps"], **common, **COMPILE_OPTIONS)
        _hc_mix_kernel[(triton.cdiv(T, cfg["mix_block_t"]), triton.cdiv(hidden, cfg["mix_block_d"]))](
            streams, partials, base.contiguous(), scale.contiguous(), collapsed, post, comb, *exit_args, T, hidden,
            splits, float(hc * hidden), float(norm_eps), float(hc_eps), int(sinkhorn_iters), HEAD=bool(head),
            BLOCK_T=cfg["mix_block_t"], BLOCK_D=cfg["mix_block_d"], num_warps=cfg["mix_warps"], **common,
            **COMPILE_OPTIONS)
    return (collapsed.view(lead + (hidden,)), post.view(lead + (hc,)), comb.view(lead + (hc, hc)),
            streams.view(lead + (hc, hidden)) if store else None)


def hc_collapse_triton(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, **launch):
    """`hc_collapse` (launch overrides: the keys of `default_collapse_launch`)."""
    return _collapse_launch(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False, **launch)[:3]


def hc_head_triton(x, fn, base, scale, norm_eps, hc_eps, **launch):
    """`hc_head`."""
    return _collapse_launch(x, fn, base, scale, norm_eps, hc_eps, 1, True, **launch)[0]


def hc_exit_collapse_triton(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, **launch):
    """`hc_exit_collapse`: (streams, collapsed, post, comb)."""
    collapsed, post_next, comb_next, streams = _collapse_launch(
        residual, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False, exit_inputs=(out, post, comb), **launch)
    return streams, collapsed, post_next, comb_next


def hc_exit_head_triton(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, **launch):
    """`hc_exit_head`: collapsed (the streams are not written)."""
    return _collapse_launch(residual, fn, base, scale, norm_eps, hc_eps, 1, True, exit_inputs=(out, post, comb),
                            **launch)[0]


def hc_expand_mix_triton(out, residual, post, comb, block_t=None, block_d=None, num_warps=None):
    """One launch of `hc_expand_mix`."""
    _validate_expand_mix(out, residual, post, comb)
    hc, hidden = residual.shape[-2], residual.shape[-1]
    res = residual.contiguous().view(-1, hc, hidden)
    T = res.shape[0]
    new = torch.empty((T, hc, hidden), dtype=residual.dtype, device=residual.device)
    block_t = block_t or 8
    block_d = block_d or min(256, triton.next_power_of_2(hidden))
    if T:
        _hc_expand_mix_kernel[(triton.cdiv(T, block_t), triton.cdiv(hidden, block_d))](
            out.contiguous().view(T, hidden), res, post.contiguous().view(T, hc), comb.contiguous().view(T, hc, hc),
            new, T, hidden, N=hc, NN=triton.next_power_of_2(hc), BLOCK_T=block_t, BLOCK_D=block_d,
            MANUAL_BF16_RNE=interpreting() and residual.dtype == torch.bfloat16, num_warps=num_warps or 4,
            **COMPILE_OPTIONS)
    return new.view(residual.shape)


def bytes_moved(T: int, hc: int, hidden: int, dtype: torch.dtype) -> dict[str, int]:
    """The bytes each op must move at least: the streams read once, the block input / output and the new
    streams once (weights, logits and mixing weights are a few KiB per program and stay in L2)."""
    size = torch.finfo(dtype).bits // 8
    streams, row = T * hc * hidden * size, T * hidden * size
    return {"hc_collapse": streams + row, "hc_head": streams + row, "hc_expand_mix": 2 * streams + row,
            "hc_exit_collapse": 2 * streams + 2 * row, "hc_exit_head": streams + 2 * row}


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("dsfuse::hc_collapse", mutates_args=())
def hc_collapse(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(collapsed [*, D] in x's dtype, post [*, n] fp32, comb [*, n, n] fp32) of streams x [*, n, D]:
    `DeepseekV4HyperConnection.forward`. Reference math on CPU."""
    _validate_collapse("hc_collapse", x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False)
    collapsed, post, comb = hc_collapse_reference(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return collapsed.contiguous(), post.contiguous(), comb.contiguous()


@hc_collapse.register_fake
def _hc_collapse_fake(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    _validate_collapse("hc_collapse", x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False)
    lead, hc = tuple(x.shape[:-2]), x.shape[-2]
    return (x.new_empty(lead + (x.shape[-1],)), x.new_empty(lead + (hc,), dtype=torch.float32),
            x.new_empty(lead + (hc, hc), dtype=torch.float32))


@hc_collapse.register_kernel("cuda")
def _hc_collapse_cuda(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    return hc_collapse_triton(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)


@torch.library.custom_op("dsfuse::hc_head", mutates_args=())
def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """collapsed [*, D] in x's dtype of streams x [*, n, D]: `DeepseekV4HyperHead.forward`. Reference on CPU."""
    _validate_collapse("hc_head", x, fn, base, scale, norm_eps, hc_eps, 1, True)
    return hc_head_reference(x, fn, base, scale, norm_eps, hc_eps).contiguous()


@hc_head.register_fake
def _hc_head_fake(x, fn, base, scale, norm_eps, hc_eps):
    _validate_collapse("hc_head", x, fn, base, scale, norm_eps, hc_eps, 1, True)
    return x.new_empty(tuple(x.shape[:-2]) + (x.shape[-1],))


@hc_head.register_kernel("cuda")
def _hc_head_cuda(x, fn, base, scale, norm_eps, hc_eps):
    return hc_head_triton(x, fn, base, scale, norm_eps, hc_eps)


@torch.library.custom_op("dsfuse::hc_expand_mix", mutates_args=())
def hc_expand_mix(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [*, n, D] = post * out + comb^T @ residual in residual's dtype (HF's roundings). Reference on CPU."""
    _validate_expand_mix(out, residual, post, comb)
    return hc_expand_mix_reference(out, residual, post, comb).contiguous()


@hc_expand_mix.register_fake
def _hc_expand_mix_fake(out, residual, post, comb):
    _validate_expand_mix(out, residual, post, comb)
    return torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)


@hc_expand_mix.register_kernel("cuda")
def _hc_expand_mix_cuda(out, residual, post, comb):
    return hc_expand_mix_triton(out, residual, post, comb)


@torch.library.custom_op("dsfuse::hc_exit_collapse", mutates_args=())
def hc_exit_collapse(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float,
                     sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_expand_mix` and then `hc_collapse` of its streams in one pass: (streams, collapsed, post, comb) of the
    next hyper-connection. Reference math on CPU."""
    _validate_expand_mix(out, residual, post, comb)
    _validate_collapse("hc_exit_collapse", residual, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False)
    found = hc_exit_collapse_reference(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return tuple(t.contiguous() for t in found)


@hc_exit_collapse.register_fake
def _hc_exit_collapse_fake(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    _validate_expand_mix(out, residual, post, comb)
    return (torch.empty(residual.shape, dtype=residual.dtype, device=residual.device),
            *_hc_collapse_fake(residual, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters))


@hc_exit_collapse.register_kernel("cuda")
def _hc_exit_collapse_cuda(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    return hc_exit_collapse_triton(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)


@torch.library.custom_op("dsfuse::hc_exit_head", mutates_args=())
def hc_exit_head(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                 base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                 hc_eps: float) -> torch.Tensor:
    """`hc_head` of the last `hc_expand_mix`'s streams in one pass, the streams not kept: collapsed [*, D].
    Reference on CPU."""
    _validate_expand_mix(out, residual, post, comb)
    _validate_collapse("hc_exit_head", residual, fn, base, scale, norm_eps, hc_eps, 1, True)
    return hc_exit_head_reference(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps).contiguous()


@hc_exit_head.register_fake
def _hc_exit_head_fake(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps):
    _validate_expand_mix(out, residual, post, comb)
    return _hc_head_fake(residual, fn, base, scale, norm_eps, hc_eps)


@hc_exit_head.register_kernel("cuda")
def _hc_exit_head_cuda(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps):
    return hc_exit_head_triton(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps)


__all__ = ["bytes_moved", "default_collapse_launch", "hc_collapse", "hc_collapse_reference", "hc_collapse_triton",
           "hc_exit_collapse", "hc_exit_collapse_reference", "hc_exit_collapse_triton", "hc_exit_head",
           "hc_exit_head_reference", "hc_exit_head_triton", "hc_expand_mix", "hc_expand_mix_reference",
           "hc_expand_mix_triton", "hc_head", "hc_head_reference", "hc_head_triton", "mixes_count"]
