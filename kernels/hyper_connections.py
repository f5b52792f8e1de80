"""DeepSeek V4's manifold-constrained hyper-connections (HF `DeepseekV4HyperConnection`, `DeepseekV4HyperHead`
and the expand + mix of `DeepseekV4DecoderLayer.forward`) as three custom ops:

`torch.ops.dsfuse.hc_collapse(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, exp_sum_softmax=False,
reciprocal_sinkhorn=False) -> (collapsed, post, comb)`,
one launch per hyper-connection, x = [*, n, D] streams (T tokens in all):

    flat    = x.flatten(-2).float();  flat = flat * rsqrt(mean(flat^2) + norm_eps)        (unweighted RMSNorm)
    mixes   = flat @ fn.float().T                                      [*, (2 + n) n] fp32
    pre     = sigmoid(mixes[:n] * scale[0] + base[:n]) + hc_eps
    post    = 2 * sigmoid(mixes[n:2n] * scale[1] + base[n:2n])
    comb    = softmax(mixes[2n:].view(n, n) * scale[2] + base[2n:].view(n, n), -1) + hc_eps
    comb    = comb / (comb.sum(-2) + hc_eps);  (iters - 1) x: rows / (sum(-1) + hc_eps), columns / (sum(-2) + hc_eps)
    collapsed = (pre[..., None] * x).sum(-2).to(x.dtype)

with `exp_sum_softmax` (default off) the softmax is exp(z) / sum(exp(z)), no max subtracted, and with
`reciprocal_sinkhorn` each step is c * (1 / (sum + hc_eps)), rounded twice: as those spellings compute it.

`torch.ops.dsfuse.hc_head(x, fn, base, scale, norm_eps, hc_eps) -> collapsed`: the same with fn of n rows, only
`pre` (scale [1]): `DeepseekV4HyperHead`.

`torch.ops.dsfuse.hc_expand_mix(out, residual, post, comb) -> streams`, the block's exit:

    streams = post.to(dtype)[..., None] * out[..., None, :] + comb.to(dtype).transpose(-1, -2) @ residual

every op rounded to the streams' dtype as torch rounds it (the product, the matmul once after its fp32 sum
over n, the add).

`torch.ops.dsfuse.hc_exit_collapse(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, iters) ->
(streams, collapsed, post, comb)`: an exit and the next hyper-connection in one launch; pass 1 computes each
chunk of the new streams, stores it and reduces it for the projection from registers (one read of the residual
instead of a write and a read back). `torch.ops.dsfuse.hc_exit_head(out, residual, post, comb, fn, base, scale,
norm_eps, hc_eps) -> collapsed`: the last exit and the head, the streams never written (nothing else reads them):
pass 2 computes them again from the residual.

Kernel design (bandwidth: a hyper-connection moves T x n x D stream elements and nothing else of size):
`hc_collapse` gives each program BLOCK_T tokens. Pass 1 walks D in chunks, and per chunk every stream j:
the sum of squares, and the projection as a tensor-core dot of the raw streams with fn's columns (`tf32x3`:
fp32-accurate; bf16 streams are exact in tf32), scaled by the token's rsqrt afterwards (HF scales before the
dot: the same value up to the rounding of one product). The mixing logits go through a [T, 32] fp32 scratch
(stored, barrier, read back in the [n, n] layout Sinkhorn needs); softmax and every Sinkhorn step run in
registers with IEEE divisions (`tl.div_rn`), HF's order and eps. Pass 2 collapses the streams, walking D
backwards so the chunks pass 1 read last are read first, while they are still in L2. `hc_expand_mix` is one
pass over the residual and the block output.

The second path of `hc_collapse` / `hc_head` (`path="two_pass"` in the launch, `COLLAPSE_PATH` the default) reads
the streams twice but in bandwidth-shaped kernels: `_hc_project_kernel` walks each row block's contiguous flattened
rows (K = n D) in wide [BLOCK_T, BLOCK_K] tiles that load straight into a software-pipelined dot and writes the
mixing weights (pre [T, n], post, comb: the mixing code above, shared); `_hc_weighted_sum_kernel` is a 2-D grid
like the exit's. For bf16 streams the dot is a bf16 tensor-core dot of the raw tiles with fn split once per call
into three bf16 pieces, fn = hi + mid + lo exactly (`split_projection_weights`): every product is exact, the sums
fp32, as accurate as tf32x3 at twice tf32's MMA rate and with no conversion of the stream tiles.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsfuse.kernels.norm_rope_quant import COMPILE_OPTIONS, _round_to
from dsfuse.kernels.triton_support import cdiv, direct_kernel, interpreting, next_power_of_2

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


def hc_collapse_reference(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, exp_sum_softmax=False,
                          reciprocal_sinkhorn=False):
    """`DeepseekV4HyperConnection.forward` on streams x [*, n, D]: (collapsed, post, comb). `exp_sum_softmax`: the
    softmax as exp(z) / sum(exp(z)), no max subtracted; `reciprocal_sinkhorn`: each step c * (1 / (sum + eps))."""
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
    z = comb_w * comb_scale + comb_b
    if exp_sum_softmax:
        comb = torch.exp(z) / torch.exp(z).sum(dim=-1, keepdim=True) + hc_eps
    else:
        comb = torch.softmax(z, dim=-1) + hc_eps

    def step(c, dim):
        total = c.sum(dim=dim, keepdim=True) + hc_eps
        return c * (1 / total) if reciprocal_sinkhorn else c / total

    comb = step(comb, -2)
    for _ in range(sinkhorn_iters - 1):
        comb = step(step(comb, -1), -2)
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
def _normalized_logits(acc, sumsq, width, norm_eps, logits_ptr, rows, row_ok, cols, NP: tl.constexpr):
    """The mixing logits acc * rsqrt(mean(x^2) + eps) of a row block through a scratch row per token (fenced by a
    barrier), so the pieces are read back in the layouts the mixing needs: the scratch rows of the block."""
    rstd = tl.rsqrt(tl.div_rn(sumsq, tl.zeros(sumsq.shape, dtype=tl.float32) + width) + norm_eps)
    tl.store(logits_ptr + rows[:, None] * NP + cols[None, :], acc * rstd[:, None], mask=row_ok[:, None])
    tl.debug_barrier()
    return logits_ptr + rows * NP


@triton.jit
def _pre_weight(l_rows, row_ok, base_ptr, pre_scale, hc_eps, j: tl.constexpr):
    """pre_j = sigmoid(logit_j * scale[0] + base[j]) + hc_eps of every token of a row block."""
    return _sigmoid(tl.load(l_rows + j, mask=row_ok, other=0.0) * pre_scale
                    + tl.load(base_ptr + j).to(tl.float32)) + hc_eps


@triton.jit
def _sinkhorn_step(comb, total, RECIPROCAL: tl.constexpr):
    """comb / total (one IEEE division), or with RECIPROCAL comb * (1 / total): two roundings, as that spelling."""
    total = tl.broadcast_to(total, comb.shape)
    if RECIPROCAL:
        return comb * tl.div_rn(tl.full(comb.shape, 1.0, tl.float32), total)
    return tl.div_rn(comb, total)


@triton.jit
def _post_and_comb(l_rows, rows, row_ok, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps, iters, N: tl.constexpr,
                   NN: tl.constexpr, EXP_SUM_SOFTMAX: tl.constexpr, RECIPROCAL_SINKHORN: tl.constexpr):
    """post = 2 * sigmoid(post_w * scale[1] + base[n:2n]) and comb: softmax over each row of the n x n logits,
    + eps, then Sinkhorn as HF iterates it (IEEE divisions), stored for every token of a row block.
    EXP_SUM_SOFTMAX, RECIPROCAL_SINKHORN: the op's `exp_sum_softmax` / `reciprocal_sinkhorn` roundings."""
    k = tl.arange(0, NN)
    k_ok = k < N
    post_l = tl.load(l_rows[:, None] + N + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    post_b = tl.load(base_ptr + N + k, mask=k_ok, other=0.0).to(tl.float32)
    post = 2.0 * _sigmoid(post_l * tl.load(scale_ptr + 1).to(tl.float32) + post_b[None, :])
    tl.store(post_ptr + rows[:, None] * N + k[None, :], post, mask=row_ok[:, None] & k_ok[None, :])
    i3 = k[None, :, None]
    j3 = k[None, None, :]
    ij_ok = (i3 < N) & (j3 < N)
    comb_l = tl.load(l_rows[:, None, None] + 2 * N + i3 * N + j3, mask=row_ok[:, None, None] & ij_ok, other=0.0)
    comb_b = tl.load(base_ptr + 2 * N + i3 * N + j3, mask=ij_ok, other=0.0).to(tl.float32)
    z = comb_l * tl.load(scale_ptr + 2).to(tl.float32) + comb_b
    z = tl.where(ij_ok, z, float("-inf"))
    if EXP_SUM_SOFTMAX:
        e = tl.exp(z)
    else:
        e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    comb = tl.div_rn(e, tl.broadcast_to(tl.sum(e, axis=2)[:, :, None], e.shape))
    comb = tl.where(ij_ok, comb + hc_eps, 0.0)
    comb = _sinkhorn_step(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps, RECIPROCAL_SINKHORN)
    for _ in range(iters - 1):
        comb = _sinkhorn_step(comb, tl.sum(comb, axis=2)[:, :, None] + hc_eps, RECIPROCAL_SINKHORN)
        comb = _sinkhorn_step(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps, RECIPROCAL_SINKHORN)
    tl.store(comb_ptr + rows[:, None, None] * (N * N) + i3 * N + j3, comb, mask=row_ok[:, None, None] & ij_ok)


@triton.jit
def _hc_collapse_kernel(
    x_ptr, fn_ptr, base_ptr, scale_ptr, logits_ptr, collapsed_ptr, post_ptr, comb_ptr,
    out_ptr, res_ptr, post_in_ptr, comb_in_ptr,
    T, D, width, norm_eps, hc_eps, iters,
    N: tl.constexpr, NN: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr, EXIT: tl.constexpr,
    STORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    MANUAL_BF16_RNE: tl.constexpr, EXP_SUM_SOFTMAX: tl.constexpr, RECIPROCAL_SINKHORN: tl.constexpr,
):
    """With EXIT, the streams x are first computed by the previous block's exit (`_exit_chunk`) in pass 1 and
    reduced from registers: the exit and this collapse in one pass over the residual. STORE writes them to x
    (pass 2 reads them back); without it pass 2 computes them again from the residual (the head's streams, which
    nothing else reads)."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    K = N * D
    M: tl.constexpr = N if HEAD else (2 + N) * N
    cols = tl.arange(0, NP)
    col_ok = cols < M
    x_rows = x_ptr + rows[:, None] * K

    # Pass 1: sum of squares and the projection, D-chunk by D-chunk, every stream of a chunk together.
    acc = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        d_ok = dd < D
        if EXIT:
            new = _exit_chunk(out_ptr, res_ptr, post_in_ptr, comb_in_ptr, x_ptr, rows, row_ok, dd, d_ok, D, N, NN,
                              BLOCK_T, BLOCK_D, STORE, MANUAL_BF16_RNE)
            flat = tl.reshape(new, [BLOCK_T, NN * BLOCK_D])
            sumsq += tl.sum(flat * flat, axis=1)
            r = tl.arange(0, NN * BLOCK_D)
            r_stream = r // BLOCK_D
            r_col = d0 + r % BLOCK_D
            w = tl.load(fn_ptr + cols[None, :] * K + r_stream[:, None] * D + r_col[:, None],
                        mask=(r_stream < N)[:, None] & (r_col < D)[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(flat, w.to(tl.float32), acc, input_precision=PRECISION)
        else:
            for j in tl.static_range(N):
                xj = tl.load(x_rows + j * D + dd[None, :], mask=row_ok[:, None] & d_ok[None, :],
                             other=0.0).to(tl.float32)
                sumsq += tl.sum(xj * xj, axis=1)
                w = tl.load(fn_ptr + cols[None, :] * K + j * D + dd[:, None], mask=d_ok[:, None] & col_ok[None, :],
                            other=0.0).to(tl.float32)
                acc = tl.dot(xj, w, acc, input_precision=PRECISION)
    l_rows = _normalized_logits(acc, sumsq, width, norm_eps, logits_ptr, rows, row_ok, cols, NP)
    if not HEAD:
        _post_and_comb(l_rows, rows, row_ok, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps, iters, N, NN,
                       EXP_SUM_SOFTMAX, RECIPROCAL_SINKHORN)

    # Pass 2: collapsed = sum_j pre_j * x_j (fp32 products summed in stream order), D walked backwards.
    pre_scale = tl.load(scale_ptr).to(tl.float32)
    n_chunks = tl.cdiv(D, BLOCK_D)
    for c in range(n_chunks):
        dd = (n_chunks - 1 - c) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (dd < D)[None, :]
        if EXIT and not STORE:
            new = _exit_chunk(out_ptr, res_ptr, post_in_ptr, comb_in_ptr, x_ptr, rows, row_ok, dd, dd < D, D, N, NN,
                              BLOCK_T, BLOCK_D, False, MANUAL_BF16_RNE)
            k = tl.arange(0, NN)
            k_ok = k < N
            pre = _sigmoid(tl.load(l_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                           * pre_scale + tl.load(base_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]) + hc_eps
            total = tl.sum(tl.where(k_ok[None, :], pre, 0.0)[:, :, None] * new, axis=1)
        else:
            total = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for j in tl.static_range(N):
                pre_j = _pre_weight(l_rows, row_ok, base_ptr, pre_scale, hc_eps, j)
                xj = tl.load(x_rows + j * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
                total += pre_j[:, None] * xj
        value = _round_to(total, collapsed_ptr.dtype.element_ty, MANUAL_BF16_RNE)
        tl.store(collapsed_ptr + rows[:, None] * D + dd[None, :], value.to(collapsed_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _hc_split_weights_kernel(fn_ptr, pieces_ptr, numel, BLOCK: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr):
    """fn (fp32) = hi + mid + lo, three bf16 pieces stored one after the other (pieces [3, rows, n D]): hi and mid
    rounded to nearest, each remainder exact in fp32, and lo, at most 8 significant bits, exact in bf16."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    w = tl.load(fn_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    hi = _round_to(w, tl.bfloat16, MANUAL_BF16_RNE)
    rest = w - hi
    mid = _round_to(rest, tl.bfloat16, MANUAL_BF16_RNE)
    lo = rest - mid
    tl.store(pieces_ptr + offs, hi.to(tl.bfloat16), mask=ok)
    tl.store(pieces_ptr + numel + offs, mid.to(tl.bfloat16), mask=ok)
    tl.store(pieces_ptr + 2 * numel + offs, lo.to(tl.bfloat16), mask=ok)


@triton.jit
def _hc_project_kernel(
    x_ptr, w_ptr, base_ptr, scale_ptr, logits_ptr, pre_ptr, post_ptr, comb_ptr, acc_ptr, sumsq_ptr,
    T, K, K_PER_SPLIT, width, norm_eps, hc_eps, iters,
    N: tl.constexpr, NN: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr, PIECES: tl.constexpr,
    FP32_DOT: tl.constexpr, PRECISION: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, EXP_SUM_SOFTMAX: tl.constexpr, RECIPROCAL_SINKHORN: tl.constexpr,
):
    """The projection and mixing of a row block, one pass over its K_PER_SPLIT columns of the contiguous
    flattened rows (K = n D) in [BLOCK_T, BLOCK_K] tiles that feed the dot straight from their loads
    (software-pipelined by `num_stages`). w is fn as PIECES pieces [PIECES, rows, K]: bf16 streams dot their raw
    tiles with fn's three bf16 pieces (exact products, fp32 sums: fp32-accurate at the bf16 MMA rate); FP32_DOT
    streams (fp16, fp32, and bf16 under the interpreter, whose bf16 dot is wrong) dot their fp32 tiles with fp32
    pieces. One split (K_PER_SPLIT >= K) writes pre [T, n] (and post, comb) for `_hc_weighted_sum_kernel`; with
    PARTIAL, program (row block, split) writes its partial projection and sum of squares for `_hc_mix_kernel`
    (more programs than the 128 row blocks of 8192 tokens: a second one per SM hides the loads' latency)."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    M: tl.constexpr = N if HEAD else (2 + N) * N
    cols = tl.arange(0, NP)
    col_ok = cols < M
    x_rows = x_ptr + rows[:, None] * K
    w_cols = w_ptr + cols[None, :] * K
    acc = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    k_lo = tl.program_id(1) * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
        for p in tl.static_range(PIECES):
            w = tl.load(w_cols + p * M * K + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if FP32_DOT:
                acc = tl.dot(xf, w.to(tl.float32), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(x, w, acc)
    if PARTIAL:
        _store_partials(acc_ptr, sumsq_ptr, acc, sumsq, tl.program_id(1), T, rows, row_ok, cols, NP)
    else:
        _mix_and_store_pre(acc, sumsq, width, norm_eps, logits_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr,
                           comb_ptr, hc_eps, iters, rows, row_ok, cols, N, NN, NP, HEAD, EXP_SUM_SOFTMAX,
                           RECIPROCAL_SINKHORN)


@triton.jit
def _store_partials(acc_ptr, sumsq_ptr, acc, sumsq, split, T, rows, row_ok, cols, NP: tl.constexpr):
    """A split's partial projection and sum of squares of each row: acc [splits, T, NP], sumsq [splits, T]."""
    part = split * T + rows
    tl.store(acc_ptr + part[:, None] * NP + cols[None, :], acc, mask=row_ok[:, None])
    tl.store(sumsq_ptr + part, sumsq, mask=row_ok)


@triton.jit
def _sum_partials(acc_ptr, sumsq_ptr, T, SPLITS, rows, row_ok, cols, BLOCK_T: tl.constexpr, NP: tl.constexpr):
    """The rows' projection and sum of squares from their partials, added in split order (deterministic)."""
    acc = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for s in range(SPLITS):
        part = s * T + rows
        acc += tl.load(acc_ptr + part[:, None] * NP + cols[None, :], mask=row_ok[:, None], other=0.0)
        sumsq += tl.load(sumsq_ptr + part, mask=row_ok, other=0.0)
    return acc, sumsq


@triton.jit
def _mix_and_store_pre(acc, sumsq, width, norm_eps, logits_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
                       hc_eps, iters, rows, row_ok, cols, N: tl.constexpr, NN: tl.constexpr, NP: tl.constexpr,
                       HEAD: tl.constexpr, EXP_SUM_SOFTMAX: tl.constexpr, RECIPROCAL_SINKHORN: tl.constexpr):
    """pre [T, n] (and post, comb unless HEAD) of a row block from its projection and sum of squares."""
    l_rows = _normalized_logits(acc, sumsq, width, norm_eps, logits_ptr, rows, row_ok, cols, NP)
    if not HEAD:
        _post_and_comb(l_rows, rows, row_ok, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps, iters, N, NN,
                       EXP_SUM_SOFTMAX, RECIPROCAL_SINKHORN)
    pre_scale = tl.load(scale_ptr).to(tl.float32)
    for j in tl.static_range(N):
        tl.store(pre_ptr + rows * N + j, _pre_weight(l_rows, row_ok, base_ptr, pre_scale, hc_eps, j), mask=row_ok)


@triton.jit
def _hc_mix_kernel(acc_ptr, sumsq_ptr, base_ptr, scale_ptr, logits_ptr, pre_ptr, post_ptr, comb_ptr,
                   T, SPLITS, width, norm_eps, hc_eps, iters, N: tl.constexpr, NN: tl.constexpr, NP: tl.constexpr,
                   HEAD: tl.constexpr, BLOCK_T: tl.constexpr, EXP_SUM_SOFTMAX: tl.constexpr,
                   RECIPROCAL_SINKHORN: tl.constexpr):
    """The split two-pass projection's mixing: a row block's partials summed, then pre (post, comb) as the
    one-split projection writes them."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    cols = tl.arange(0, NP)
    acc, sumsq = _sum_partials(acc_ptr, sumsq_ptr, T, SPLITS, rows, row_ok, cols, BLOCK_T, NP)
    _mix_and_store_pre(acc, sumsq, width, norm_eps, logits_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
                       hc_eps, iters, rows, row_ok, cols, N, NN, NP, HEAD, EXP_SUM_SOFTMAX, RECIPROCAL_SINKHORN)


@triton.jit
def _hc_weighted_sum_kernel(x_ptr, pre_ptr, collapsed_ptr, T, D, N: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_D: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr):
    """collapsed = sum_j pre_j * x_j over a [BLOCK_T, BLOCK_D] tile: fp32 products summed in stream order, as
    `_hc_collapse_kernel`'s pass 2 sums them. The D blocks run last to first (programs start row block fastest):
    the projection read the rows' last columns last, so the first programs find some of them still in L2."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    dd = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (dd < D)[None, :]
    total = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(N):
        pre_j = tl.load(pre_ptr + rows * N + j, mask=row_ok, other=0.0)
        xj = tl.load(x_ptr + rows[:, None] * (N * D) + j * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
        total += pre_j[:, None] * xj
    value = _round_to(total, collapsed_ptr.dtype.element_ty, MANUAL_BF16_RNE)
    tl.store(collapsed_ptr + rows[:, None] * D + dd[None, :], value.to(collapsed_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _hc_mix_sum_kernel(x_ptr, acc_ptr, sumsq_ptr, base_ptr, scale_ptr, logits_ptr, collapsed_ptr, post_ptr, comb_ptr,
                       T, D, SPLITS, width, norm_eps, hc_eps, iters,
                       N: tl.constexpr, NN: tl.constexpr, NP: tl.constexpr, HEAD: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, MANUAL_BF16_RNE: tl.constexpr,
                       EXP_SUM_SOFTMAX: tl.constexpr, RECIPROCAL_SINKHORN: tl.constexpr):
    """The split-K path's second kernel, after `_hc_project_kernel`'s PARTIAL fp32 projection of each
    `k_per_split` slice (few tokens leave the two other paths a handful of programs walking all of K serially;
    there every split runs at once): program (row block, D block) sums the rows' partials in split order,
    mixes them (every D block of a row block the same way, through its own logits scratch [D blocks, T, NP];
    D block 0 stores post and comb) and collapses its D block as `_hc_weighted_sum_kernel` does."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    d_block = tl.program_id(1)
    cols = tl.arange(0, NP)
    acc, sumsq = _sum_partials(acc_ptr, sumsq_ptr, T, SPLITS, rows, row_ok, cols, BLOCK_T, NP)
    l_rows = _normalized_logits(acc, sumsq, width, norm_eps, logits_ptr + d_block * T * NP, rows, row_ok, cols, NP)
    if not HEAD:
        if d_block == 0:
            _post_and_comb(l_rows, rows, row_ok, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps, iters, N, NN,
                       EXP_SUM_SOFTMAX, RECIPROCAL_SINKHORN)
    pre_scale = tl.load(scale_ptr).to(tl.float32)
    dd = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (dd < D)[None, :]
    total = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(N):
        pre_j = _pre_weight(l_rows, row_ok, base_ptr, pre_scale, hc_eps, j)
        xj = tl.load(x_ptr + rows[:, None] * (N * D) + j * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
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
COLLAPSE_PATHS = ("one_pass", "two_pass", "split_k")
# The path `hc_collapse` / `hc_head` launch by default: "two_pass" (`_hc_project_kernel` then
# `_hc_weighted_sum_kernel`), measured 2.8x / 2.3x faster than "one_pass" (`_hc_collapse_kernel`: one program per
# row block projects, mixes and collapses it) on the H200 at T=8192, D=4096 (run 32: 0.215 / 0.187 ms against
# 0.609 / 0.425). The fused exits (`hc_exit_collapse`, `hc_exit_head`) always run one_pass. Calls of fewer than
# `SPLIT_K_MAX_TOKENS` tokens (decode steps, short prompts) run "split_k" (`_hc_project_kernel`'s partials then
# `_hc_mix_sum_kernel`): at 1-64 tokens the other two paths leave a few programs walking the whole flattened row
# serially, 0.38 ms a call in a V4 decode step on the H200 (run 36: 62 % of the step's GPU time); split-K took 24 us
# there (run 37). By token count (run 37, `--path-tokens`): split-K ahead of two_pass at 256 tokens (collapse 0.19
# against 0.28 ms, head 0.23 against 0.30), behind at 1024 (collapse 0.34 against 0.24).
COLLAPSE_PATH = "two_pass"
SPLIT_K_MAX_TOKENS = 512


def default_collapse_launch(hidden: int, path: str | None = None, head: bool = False,
                           dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch parameters of `hc_collapse` (or `hc_head`, `head=True`) on `path` (default `COLLAPSE_PATH`) for streams
    of `dtype`: the H200 sweep's best at T=8192, D=4096, bf16 (benchmarks/results/
    2026-12-01_h200_hyper_connections_run32.json).

    one_pass: 32 tokens per program, 64-wide D chunks, 4 warps, 2 stages for both ops (collapse 0.609 ms, head
    0.425 ms; run 23: 128-wide D chunks 0.95 / 0.76 ms).
    two_pass: the projection with 64 tokens per program (one warpgroup's MMA tile; 16-32 tokens were 1.8-2.9x
    slower), K tiles of 128 in 4 stages (run 38: collapse 0.128 ms, 256 wide in 3 stages 0.136), the head's K
    split 4 ways (0.096 ms against 0.109 unsplit; the collapse's split did not help); the weighted sum in 8 x 128
    tiles with 4 warps (0.087 ms, 3.8 TB/s)."""
    path = path or COLLAPSE_PATH
    if path == "one_pass":
        return dict(path=path, block_t=32, block_d=max(16, min(64, next_power_of_2(hidden))), num_warps=4,
                    num_stages=2)
    if path == "two_pass":
        return dict(path=path, block_t=64, block_k=128, num_warps=4, num_stages=4, splits=4 if head else 1,
                    sum_block_t=8, sum_block_d=max(16, min(128, next_power_of_2(hidden))), sum_num_warps=4)
    if path == "split_k":
        return dict(path=path, block_t=16, block_k=128, k_per_split=256, num_warps=4, num_stages=2, sum_block_t=8,
                    sum_block_d=max(16, min(128, next_power_of_2(hidden))), sum_num_warps=4)
    raise ValueError(f"hyper-connection path must be one of {COLLAPSE_PATHS}, got {path!r}")


def _resolve_launch(op, hidden, tokens, launch, exit_inputs, head, dtype):
    """default_collapse_launch for the requested path with the given overrides (None keeps a default)."""
    path = launch.get("path") or ("one_pass" if exit_inputs else "split_k" if tokens < SPLIT_K_MAX_TOKENS else None)
    if exit_inputs and path != "one_pass":
        raise ValueError(f"{op}: the fused exit runs one_pass only, got path={path!r}")
    config = default_collapse_launch(hidden, path, head, dtype)
    unknown = sorted(set(launch) - set(config))
    if unknown:
        raise ValueError(f"{op}: unknown launch parameter(s) {unknown} for path {config['path']!r}; valid: "
                         f"{sorted(config)}")
    config.update({key: value for key, value in launch.items() if value is not None})
    return config


def _collapse_launch(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head, exit_inputs=None,
                     exp_sum_softmax=False, reciprocal_sinkhorn=False, **launch):
    """(collapsed, post, comb, streams): with `exit_inputs` = (out, post_in, comb_in), x is the exit's residual and
    the streams collapsed are the exit's, written to `streams` (not for the head: streams is None, as without
    `exit_inputs`). `exp_sum_softmax`, `reciprocal_sinkhorn`: `hc_collapse`'s roundings."""
    exp_sum_softmax, reciprocal_sinkhorn = bool(exp_sum_softmax), bool(reciprocal_sinkhorn)
    forms = dict(exp_sum_softmax=exp_sum_softmax, reciprocal_sinkhorn=reciprocal_sinkhorn)
    op = ("hc_exit_" if exit_inputs else "hc_") + ("head" if head else "collapse")
    _validate_collapse(op, x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head)
    hc, hidden = x.shape[-2], x.shape[-1]
    config = _resolve_launch(op, hidden, math.prod(x.shape[:-2]), launch, exit_inputs, head, x.dtype)
    lead = tuple(x.shape[:-2])
    if config["path"] == "two_pass":
        x = x.contiguous()
        pre, post, comb = hc_project_triton(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head=head,
                                            block_t=config["block_t"], block_k=config["block_k"],
                                            num_warps=config["num_warps"], num_stages=config["num_stages"],
                                            splits=config["splits"], **forms)
        collapsed = hc_weighted_sum_triton(x, pre, block_t=config["sum_block_t"], block_d=config["sum_block_d"],
                                           num_warps=config["sum_num_warps"])
        return collapsed, post, comb, None
    if config["path"] == "split_k":
        return (*_split_k_collapse(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head, config, **forms),
                None)
    source = x.contiguous().view(-1, hc, hidden)
    T = source.shape[0]
    n_pad = max(16, next_power_of_2(hc if head else mixes_count(hc)))
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
        logits = torch.empty((T, n_pad), dtype=torch.float32, device=x.device)
        _hc_collapse_kernel[(cdiv(T, config["block_t"]),)](
            streams, fn.contiguous(), base.contiguous(), scale.contiguous(), logits, collapsed, post, comb, *exit_args,
            T, hidden, float(hc * hidden), float(norm_eps), float(hc_eps), int(sinkhorn_iters),
            N=hc, NN=next_power_of_2(hc), NP=n_pad, HEAD=bool(head), EXIT=exit_inputs is not None,
            STORE=store, BLOCK_T=config["block_t"], BLOCK_D=config["block_d"], PRECISION=PROJECTION_PRECISION,
            MANUAL_BF16_RNE=interpreting() and x.dtype == torch.bfloat16, EXP_SUM_SOFTMAX=exp_sum_softmax,
            RECIPROCAL_SINKHORN=reciprocal_sinkhorn, num_warps=config["num_warps"], num_stages=config["num_stages"],
            **COMPILE_OPTIONS)
    return (collapsed.view(lead + (hidden,)), post.view(lead + (hc,)), comb.view(lead + (hc, hc)),
            streams.view(lead + (hc, hidden)) if store else None)


def _split_k_collapse(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head, config, exp_sum_softmax=False,
                      reciprocal_sinkhorn=False):
    """(collapsed, post, comb) on the split-K path: partial projections of `k_per_split`-wide column slices, then
    one program per (row block, D block) that sums them in split order, mixes and collapses."""
    hc, hidden = x.shape[-2], x.shape[-1]
    lead = tuple(x.shape[:-2])
    source = x.contiguous().view(-1, hc * hidden)
    T, K = source.shape
    if config["k_per_split"] % config["block_k"]:
        raise ValueError(f"hc split_k: k_per_split {config['k_per_split']} is not a multiple of block_k "
                         f"{config['block_k']}")
    n_pad = max(16, next_power_of_2(hc if head else mixes_count(hc)))
    collapsed = torch.empty((T, hidden), dtype=x.dtype, device=x.device)
    post = torch.empty((T, hc), dtype=torch.float32, device=x.device)
    comb = torch.empty((T, hc, hc), dtype=torch.float32, device=x.device)
    if T:
        splits = cdiv(K, config["k_per_split"])
        acc = torch.empty((splits, T, n_pad), dtype=torch.float32, device=x.device)
        sumsq = torch.empty((splits, T), dtype=torch.float32, device=x.device)
        # fn itself as one fp32 piece with an IEEE dot (no weight-split launch in a decode step); a PARTIAL
        # projection does not read the mixing arguments
        _hc_project_kernel[(cdiv(T, config["block_t"]), splits)](
            source, fn.contiguous(), acc, acc, acc, acc, acc, acc, acc, sumsq, T, K, config["k_per_split"], 0.0, 0.0,
            0.0, 0, N=hc, NN=next_power_of_2(hc), NP=n_pad, HEAD=bool(head), PIECES=1, FP32_DOT=True,
            PRECISION="ieee", PARTIAL=True, BLOCK_T=config["block_t"], BLOCK_K=config["block_k"],
            EXP_SUM_SOFTMAX=False, RECIPROCAL_SINKHORN=False, num_warps=config["num_warps"],
            num_stages=config["num_stages"], **COMPILE_OPTIONS)
        d_blocks = cdiv(hidden, config["sum_block_d"])
        logits = torch.empty((d_blocks, T, n_pad), dtype=torch.float32, device=x.device)
        _hc_mix_sum_kernel[(cdiv(T, config["sum_block_t"]), d_blocks)](
            source, acc, sumsq, base.contiguous(), scale.contiguous(), logits, collapsed, post, comb,
            T, hidden, splits, float(hc * hidden), float(norm_eps), float(hc_eps), int(sinkhorn_iters),
            N=hc, NN=next_power_of_2(hc), NP=n_pad, HEAD=bool(head), BLOCK_T=config["sum_block_t"],
            BLOCK_D=config["sum_block_d"], MANUAL_BF16_RNE=interpreting() and x.dtype == torch.bfloat16,
            EXP_SUM_SOFTMAX=exp_sum_softmax, RECIPROCAL_SINKHORN=reciprocal_sinkhorn,
            num_warps=config["sum_num_warps"], **COMPILE_OPTIONS)
    return collapsed.view(lead + (hidden,)), post.view(lead + (hc,)), comb.view(lead + (hc, hc))


def split_projection_weights(fn: torch.Tensor) -> torch.Tensor:
    """fn [rows, K] (fp32) as three bf16 pieces [3, rows, K] with fn = hi + mid + lo exactly (one launch): the
    operands of the two-pass projection's bf16 dot. Exact for |fn| above 2^-110 (below that lo falls under bf16's
    normal range) and below bf16's largest value (hi would round to infinity)."""
    source = fn.contiguous()
    pieces = torch.empty((3, *source.shape), dtype=torch.bfloat16, device=fn.device)
    numel, block = source.numel(), 1024
    if numel:
        _hc_split_weights_kernel[(cdiv(numel, block),)](
            source, pieces, numel, BLOCK=block, MANUAL_BF16_RNE=interpreting(), num_warps=4, **COMPILE_OPTIONS)
    return pieces


def hc_project_triton(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head=False, block_t=None, block_k=None,
                      num_warps=None, num_stages=None, splits=None, exp_sum_softmax=False, reciprocal_sinkhorn=False):
    """The two-pass path's first kernel: (pre [*, n], post [*, n], comb [*, n, n]), all fp32 (the head's post
    and comb are None). bf16 streams dot their raw tiles with `split_projection_weights(fn)` (split per call);
    fp16 and fp32 streams dot their fp32 tiles with fn (`PROJECTION_PRECISION`). `splits` > 1 divides each row's
    K columns among that many programs (whole K tiles each), whose partials `_hc_mix_kernel` sums and mixes."""
    op = "hc_head" if head else "hc_collapse"
    _validate_collapse(op, x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head)
    defaults = default_collapse_launch(x.shape[-1], "two_pass", head, x.dtype)
    hc, hidden = x.shape[-2], x.shape[-1]
    lead = tuple(x.shape[:-2])
    source = x.contiguous().view(-1, hc * hidden)
    T = source.shape[0]
    pre = torch.empty((T, hc), dtype=torch.float32, device=x.device)
    post = pre if head else torch.empty((T, hc), dtype=torch.float32, device=x.device)
    comb = pre if head else torch.empty((T, hc, hc), dtype=torch.float32, device=x.device)
    if T:
        split = x.dtype == torch.bfloat16
        weights = split_projection_weights(fn) if split else fn.contiguous()
        n_pad = max(16, next_power_of_2(hc if head else mixes_count(hc)))
        logits = torch.empty((T, n_pad), dtype=torch.float32, device=x.device)
        block_t, block_k = block_t or defaults["block_t"], block_k or defaults["block_k"]
        K = hc * hidden
        k_per_split = cdiv(cdiv(K, splits or defaults["splits"]), block_k) * block_k
        n_splits = cdiv(K, k_per_split)
        partial = n_splits > 1
        acc = torch.empty((n_splits, T, n_pad) if partial else (0,), dtype=torch.float32, device=x.device)
        sumsq = torch.empty((n_splits, T) if partial else (0,), dtype=torch.float32, device=x.device)
        _hc_project_kernel[(cdiv(T, block_t), n_splits)](
            source, weights, base.contiguous(), scale.contiguous(), logits, pre, post, comb, acc, sumsq,
            T, K, k_per_split, float(K), float(norm_eps), float(hc_eps), int(sinkhorn_iters),
            N=hc, NN=next_power_of_2(hc), NP=n_pad, HEAD=bool(head), PIECES=3 if split else 1,
            FP32_DOT=not split or interpreting(), PRECISION="ieee" if split else PROJECTION_PRECISION,
            PARTIAL=partial, BLOCK_T=block_t, BLOCK_K=block_k, EXP_SUM_SOFTMAX=bool(exp_sum_softmax),
            RECIPROCAL_SINKHORN=bool(reciprocal_sinkhorn), num_warps=num_warps or defaults["num_warps"],
            num_stages=num_stages or defaults["num_stages"], **COMPILE_OPTIONS)
        if partial:
            _hc_mix_kernel[(cdiv(T, 16),)](
                acc, sumsq, base.contiguous(), scale.contiguous(), logits, pre, post, comb, T, n_splits, float(K),
                float(norm_eps), float(hc_eps), int(sinkhorn_iters), N=hc, NN=next_power_of_2(hc), NP=n_pad,
                HEAD=bool(head), BLOCK_T=16, EXP_SUM_SOFTMAX=bool(exp_sum_softmax),
                RECIPROCAL_SINKHORN=bool(reciprocal_sinkhorn), num_warps=4, **COMPILE_OPTIONS)
    if head:
        return pre.view(lead + (hc,)), None, None
    return pre.view(lead + (hc,)), post.view(lead + (hc,)), comb.view(lead + (hc, hc))


def hc_weighted_sum_triton(x, pre, block_t=None, block_d=None, num_warps=None):
    """The two-pass path's second kernel: collapsed [*, D] = sum_j pre[..., j] * x[..., j, :] in x's dtype."""
    _check_streams("hc_weighted_sum", x)
    hc, hidden = x.shape[-2], x.shape[-1]
    lead = tuple(x.shape[:-2])
    if not isinstance(pre, torch.Tensor) or tuple(pre.shape) != lead + (hc,) or pre.dtype != torch.float32:
        raise ValueError(f"hc_weighted_sum: pre must be fp32 {lead + (hc,)}, got "
                         f"{getattr(pre, 'dtype', type(pre))} {getattr(pre, 'shape', '')}")
    defaults = default_collapse_launch(hidden, "two_pass")
    source = x.contiguous().view(-1, hc, hidden)
    T = source.shape[0]
    collapsed = torch.empty((T, hidden), dtype=x.dtype, device=x.device)
    block_t, block_d = block_t or defaults["sum_block_t"], block_d or defaults["sum_block_d"]
    if T:
        _hc_weighted_sum_kernel[(cdiv(T, block_t), cdiv(hidden, block_d))](
            source, pre.contiguous().view(T, hc), collapsed, T, hidden, N=hc, BLOCK_T=block_t, BLOCK_D=block_d,
            MANUAL_BF16_RNE=interpreting() and x.dtype == torch.bfloat16,
            num_warps=num_warps or defaults["sum_num_warps"], **COMPILE_OPTIONS)
    return collapsed.view(lead + (hidden,))


def hc_collapse_triton(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, **launch):
    """`hc_collapse` on the GPU (launch overrides: `default_collapse_launch`'s keys for the path asked for)."""
    return _collapse_launch(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False, **launch)[:3]


def hc_head_triton(x, fn, base, scale, norm_eps, hc_eps, **launch):
    """`hc_head` on the GPU."""
    return _collapse_launch(x, fn, base, scale, norm_eps, hc_eps, 1, True, **launch)[0]


def hc_exit_collapse_triton(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, **launch):
    """One launch of `hc_exit_collapse`: (streams, collapsed, post, comb)."""
    collapsed, post_next, comb_next, streams = _collapse_launch(
        residual, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False, exit_inputs=(out, post, comb), **launch)
    return streams, collapsed, post_next, comb_next


def hc_exit_head_triton(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps, **launch):
    """One launch of `hc_exit_head`: collapsed (the streams are not written)."""
    return _collapse_launch(residual, fn, base, scale, norm_eps, hc_eps, 1, True, exit_inputs=(out, post, comb),
                            **launch)[0]


def hc_expand_mix_triton(out, residual, post, comb, block_t=None, block_d=None, num_warps=None):
    """One launch of `hc_expand_mix`."""
    _validate_expand_mix(out, residual, post, comb)
    hc, hidden = residual.shape[-2], residual.shape[-1]
    res = residual.contiguous().view(-1, hc, hidden)
    T = res.shape[0]
    new = torch.empty((T, hc, hidden), dtype=residual.dtype, device=residual.device)
    block_t = block_t or 8  # 8 x 128 with 4 warps: 0.156 ms at T=8192, D=4096 (3.9 TB/s, run 23's sweep)
    block_d = block_d or min(128, next_power_of_2(hidden))
    if T:
        _hc_expand_mix_kernel[(cdiv(T, block_t), cdiv(hidden, block_d))](
            out.contiguous().view(T, hidden), res, post.contiguous().view(T, hc), comb.contiguous().view(T, hc, hc),
            new, T, hidden, N=hc, NN=next_power_of_2(hc), BLOCK_T=block_t, BLOCK_D=block_d,
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
                hc_eps: float, sinkhorn_iters: int, exp_sum_softmax: bool = False,
                reciprocal_sinkhorn: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(collapsed [*, D] in x's dtype, post [*, n] fp32, comb [*, n, n] fp32) of streams x [*, n, D]:
    `DeepseekV4HyperConnection.forward`; the two flags round as those spellings of the softmax and the Sinkhorn
    steps do (`hc_collapse_reference`). Reference math on CPU."""
    _validate_collapse("hc_collapse", x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False)
    collapsed, post, comb = hc_collapse_reference(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters,
                                                  exp_sum_softmax, reciprocal_sinkhorn)
    return collapsed.contiguous(), post.contiguous(), comb.contiguous()


@hc_collapse.register_fake
def _hc_collapse_fake(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, exp_sum_softmax=False,
                      reciprocal_sinkhorn=False):
    _validate_collapse("hc_collapse", x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False)
    lead, hc = tuple(x.shape[:-2]), x.shape[-2]
    return (x.new_empty(lead + (x.shape[-1],)), x.new_empty(lead + (hc,), dtype=torch.float32),
            x.new_empty(lead + (hc, hc), dtype=torch.float32))


@direct_kernel(hc_collapse)
def _hc_collapse_cuda(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, exp_sum_softmax=False,
                      reciprocal_sinkhorn=False):
    return hc_collapse_triton(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, exp_sum_softmax=exp_sum_softmax,
                              reciprocal_sinkhorn=reciprocal_sinkhorn)


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


@direct_kernel(hc_head)
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


@direct_kernel(hc_expand_mix)
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


@direct_kernel(hc_exit_collapse)
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


@direct_kernel(hc_exit_head)
def _hc_exit_head_cuda(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps):
    return hc_exit_head_triton(out, residual, post, comb, fn, base, scale, norm_eps, hc_eps)


__all__ = ["COLLAPSE_PATH", "COLLAPSE_PATHS", "SPLIT_K_MAX_TOKENS", "bytes_moved", "default_collapse_launch", "hc_collapse",
           "hc_collapse_reference", "hc_collapse_triton",
           "hc_exit_collapse", "hc_exit_collapse_reference", "hc_exit_collapse_triton", "hc_exit_head",
           "hc_exit_head_reference", "hc_exit_head_triton", "hc_expand_mix", "hc_expand_mix_reference",
           "hc_expand_mix_triton", "hc_head", "hc_head_reference", "hc_head_triton", "hc_project_triton",
           "hc_weighted_sum_triton", "mixes_count", "split_projection_weights"]
