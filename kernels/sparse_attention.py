"""Sparse attention over indexer-selected keys (DeepSeek V3.2 / V4 style).

Three custom ops, each with a plain-PyTorch reference (the CPU implementation and the
numerics contract) and a Triton CUDA path:

* ``dsfuse::sparse_mla_attention`` -- absorbed MLA / MQA form: every head of a query
  attends to the same ``K`` latent rows ``kv[idx]`` (which are also the values) plus
  their rope part ``pe[idx]``.  The kernel stacks heads into the MMA M dimension and
  reads the selected rows straight from the cache by index (no gathered copy).
* ``dsfuse::sparse_attention_masked`` -- what HF ``DeepseekV32Attention`` computes:
  the top-k indices are scattered into a mask, combined with the causal/padding mask,
  and dense SDPA runs over all ``T`` keys with per-head K/V.  The kernel turns the
  indices into a per-query bitmap, skips key tiles that no query of a block selected,
  and decides selection per element in-kernel; a per-head sink (as V4 and gpt-oss write one) joins
  each row's softmax when given.
* ``dsfuse::absorbed_mla_attention`` -- the same HF attention read from its latent cache
  in absorbed form (``kv_b_proj`` folded into the query and the output), for decode, where
  HF would expand all ``T`` cached latents at every step; it runs the first op's kernel. A released
  checkpoint's e4m3 ``kv_b_proj`` comes with its block scales and is dequantised once while unchanged.

Index tensors are never trusted: the kernels treat any index outside ``[0, T)`` as
"no key"; the reference paths raise for indices ``>= T`` or ``< -1``.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from dsfuse.kernels.quant_formats import check_fp8_weight, dequantize_fp8_blocks, dequantized_once
from dsfuse.kernels.triton_support import cdiv, direct_kernel, next_power_of_2

LOG2E = 1.4426950408889634

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take arbitrary outer strides but want unit stride in the last dim."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to tf32 on the GPU."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------
# Op 1: absorbed MLA sparse attention (shared keys across heads)
# ---------------------------------------------------------------------------


def _check_sink(op: str, sink: Optional[torch.Tensor], H: int, tensors: list) -> None:
    """A sink, when given, is fp32 [H]; it joins `tensors` for the device check."""
    if sink is None:
        return
    if sink.dtype != torch.float32 or tuple(sink.shape) != (H,):
        raise ValueError(f"{op}: sink must be fp32 [H={H}], got {sink.dtype} {tuple(sink.shape)}")
    tensors.append(sink)


def _check_sparse_mla_inputs(q_nope, q_pe, kv, pe, idx, scale, sink):
    if q_nope.dim() != 4 or q_pe.dim() != 4:
        raise ValueError(
            f"sparse_mla_attention: q_nope and q_pe must be [B,S,H,D], got {tuple(q_nope.shape)} and {tuple(q_pe.shape)}"
        )
    if kv.dim() != 3 or pe.dim() != 3:
        raise ValueError(
            f"sparse_mla_attention: kv and pe must be [B,T,D], got {tuple(kv.shape)} and {tuple(pe.shape)}"
        )
    if idx.dim() != 3:
        raise ValueError(f"sparse_mla_attention: idx must be [B,S,K], got {tuple(idx.shape)}")
    B, S, H, Dc = q_nope.shape
    Dr = q_pe.shape[-1]
    if tuple(q_pe.shape[:3]) != (B, S, H):
        raise ValueError(f"sparse_mla_attention: q_pe {tuple(q_pe.shape)} does not match q_nope {tuple(q_nope.shape)}")
    T = kv.shape[1]
    if tuple(kv.shape) != (B, T, Dc):
        raise ValueError(f"sparse_mla_attention: kv must be [B={B}, T, Dc={Dc}], got {tuple(kv.shape)}")
    if tuple(pe.shape) != (B, T, Dr):
        raise ValueError(f"sparse_mla_attention: pe must be [B={B}, T={T}, Dr={Dr}], got {tuple(pe.shape)}")
    if idx.shape[0] != B or idx.shape[1] != S or idx.shape[2] < 1:
        raise ValueError(f"sparse_mla_attention: idx must be [B={B}, S={S}, K>=1], got {tuple(idx.shape)}")
    if q_nope.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sparse_mla_attention: q_nope dtype {q_nope.dtype} not in {_FLOAT_DTYPES}")
    for name, t in (("q_pe", q_pe), ("kv", kv), ("pe", pe)):
        if t.dtype != q_nope.dtype:
            raise TypeError(f"sparse_mla_attention: {name} dtype {t.dtype} differs from q_nope dtype {q_nope.dtype}")
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"sparse_mla_attention: idx dtype must be int32 or int64, got {idx.dtype}")
    if not math.isfinite(scale):
        raise ValueError(f"sparse_mla_attention: scale must be finite, got {scale}")
    tensors = [q_pe, kv, pe, idx]
    _check_sink("sparse_mla_attention", sink, H, tensors)
    for t in tensors:
        if t.device != q_nope.device:
            raise ValueError(f"sparse_mla_attention: all inputs must be on {q_nope.device}, found {t.device}")


def _check_index_range(idx: torch.Tensor, T: int, allow_minus_one: bool, op: str) -> None:
    """Reference-path range check (syncs the host; the CUDA path never calls this)."""
    low = -1 if allow_minus_one else 0
    if idx.numel() and bool(((idx < low) | (idx >= T)).any()):
        bad = idx[(idx < low) | (idx >= T)][0].item()
        raise IndexError(f"{op}: index {bad} outside [{low}, {T})")


def sparse_mla_attention_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    pe: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    sink: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The gather form of the official code: fp32 scores and softmax, probabilities cast
    to q's dtype, then P @ kv[idx].  Duplicate indices count twice; -1 means no key."""
    _check_sparse_mla_inputs(q_nope, q_pe, kv, pe, idx, scale, sink)
    _check_index_range(idx, kv.shape[1], True, "sparse_mla_attention")
    return sparse_mla_attention_math(q_nope, q_pe, kv, pe, idx, scale, sink)


def sparse_mla_attention_math(q_nope, q_pe, kv, pe, idx, scale, sink=None):
    """The reference math without checks (what benchmarks hand to torch.compile).  A -1 entry gathers key 0 and
    zeroes it, so a NaN / Inf in key 0 does not reach a row that did not select it (0 * NaN is NaN)."""
    B, H = q_nope.shape[0], q_nope.shape[2]
    valid = idx >= 0
    rows = idx.long().clamp_min(0)
    batch = torch.arange(B, device=idx.device).view(B, 1, 1)
    kv_sel = kv[batch, rows].masked_fill(~valid[..., None], 0)  # [B,S,K,Dc]
    pe_sel = pe[batch, rows]  # [B,S,K,Dr]
    scores = torch.matmul(q_nope.float(), kv_sel.float().transpose(-1, -2))
    scores = scores + torch.matmul(q_pe.float(), pe_sel.float().transpose(-1, -2))
    scores = (scores * scale).masked_fill(~valid[:, :, None, :], float("-inf"))  # [B,S,H,K]
    if sink is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = _softmax_with_sink(scores, sink.view(1, 1, H, 1), scores.amax(dim=-1, keepdim=True))
    return torch.matmul(probs.to(q_nope.dtype), kv_sel)


def _softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """The softmax over the last dim of fp32 `scores` with one more score per row, `sink` (broadcast to the rows;
    its value row is zero), both shifted by `top` (the row max the kernel shifts by; 0 where it is -inf)."""
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weights = torch.exp(scores - top)
    return weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))


@triton.jit(do_not_specialize=["S"])
def _sparse_mla_kernel(
    q_nope_ptr, q_pe_ptr, kv_ptr, pe_ptr, idx_ptr, sink_ptr, out_ptr, part_ptr, stats_ptr, row_len_ptr,
    stride_qn_b, stride_qn_s, stride_qn_h,
    stride_qp_b, stride_qp_s, stride_qp_h,
    stride_kv_b, stride_kv_t,
    stride_pe_b, stride_pe_t,
    stride_idx_b, stride_idx_s,
    stride_o_b, stride_o_s, stride_o_h,
    S, H, T, K, scale_log2e, split_len,
    DC: tl.constexpr, DR: tl.constexpr, DC_P: tl.constexpr, DR_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SINK: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_ROW_LEN: tl.constexpr,
):
    """One program: one query, BLOCK_H heads, BLOCK_DV output columns, and one of NUM_SPLITS
    ranges of the selected keys.  Heads sit on the MMA M dimension; each selected key row is
    loaded once per program and serves as K (scores) and V (output); online softmax in the log2
    domain.  With several splits (decode: few queries would leave most SMs idle) each program
    stores its unnormalised fp32 partial output and (max, sum) for `_mla_split_combine_kernel`.
    With HAS_ROW_LEN a query reads only its first `row_len[query]` index entries."""
    pid_bss = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_v = tl.program_id(2)
    pid_bs = pid_bss // NUM_SPLITS
    split = pid_bss % NUM_SPLITS
    b = pid_bs // S
    s = pid_bs % S
    b64 = b.to(tl.int64)
    s64 = s.to(tl.int64)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, DC_P)
    offs_r = tl.arange(0, DR_P)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    h_ok = offs_h < H
    c_ok = offs_c < DC
    r_ok = offs_r < DR
    v_ok = offs_v < DC

    qn_base = q_nope_ptr + b64 * stride_qn_b + s64 * stride_qn_s
    qp_base = q_pe_ptr + b64 * stride_qp_b + s64 * stride_qp_s
    q_nope = tl.load(qn_base + offs_h[:, None] * stride_qn_h + offs_c[None, :],
                     mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_pe = tl.load(qp_base + offs_h[:, None] * stride_qp_h + offs_r[None, :],
                   mask=h_ok[:, None] & r_ok[None, :], other=0.0)

    kv_base = kv_ptr + b64 * stride_kv_b
    pe_base = pe_ptr + b64 * stride_pe_b
    idx_base = idx_ptr + b64 * stride_idx_b + s64 * stride_idx_s

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    key_lo = split * split_len
    key_hi = tl.minimum(key_lo + split_len, K)
    if HAS_ROW_LEN:
        key_hi = tl.minimum(key_hi, tl.load(row_len_ptr + pid_bs))
    for start in range(key_lo, key_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ids = tl.load(idx_base + offs_n, mask=offs_n < key_hi, other=-1).to(tl.int64)
        valid = (ids >= 0) & (ids < T)
        rows = tl.where(valid, ids, 0)
        if DC == DC_P:
            kv_mask = valid[:, None]
        else:
            kv_mask = valid[:, None] & c_ok[None, :]
        if DR == DR_P:
            pe_mask = valid[:, None]
        else:
            pe_mask = valid[:, None] & r_ok[None, :]
        kv_tile = tl.load(kv_base + rows[:, None] * stride_kv_t + offs_c[None, :], mask=kv_mask, other=0.0)
        pe_tile = tl.load(pe_base + rows[:, None] * stride_pe_t + offs_r[None, :], mask=pe_mask, other=0.0)
        qk = tl.dot(q_nope, tl.trans(kv_tile), input_precision=DOT_PRECISION)
        qk = tl.dot(q_pe, tl.trans(pe_tile), qk, input_precision=DOT_PRECISION)
        qk = tl.where(valid[None, :], qk * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if BLOCK_DV == DC_P:
            v_tile = kv_tile
        else:
            v_tile = tl.load(kv_base + rows[:, None] * stride_kv_t + offs_v[None, :],
                             mask=valid[:, None] & v_ok[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS > 1:
        row = pid_bss.to(tl.int64) * H + offs_h  # [B*S, NUM_SPLITS, H] rows
        tl.store(part_ptr + row[:, None] * DC + offs_v[None, :], acc, mask=h_ok[:, None] & v_ok[None, :])
        if pid_v == 0:
            tl.store(stats_ptr + row * 2, m_i, mask=h_ok)
            tl.store(stats_ptr + row * 2 + 1, l_i, mask=h_ok)
    else:
        denom = l_i
        if HAS_SINK:
            sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
            m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
            denom = denom + tl.exp2(sink * 1.4426950408889634 - m_use)
        out = acc / denom[:, None]
        o_base = out_ptr + b64 * stride_o_b + s64 * stride_o_s
        tl.store(o_base + offs_h[:, None] * stride_o_h + offs_v[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & v_ok[None, :])


@triton.jit
def _mla_split_combine_kernel(
    part_ptr, stats_ptr, sink_ptr, out_ptr,
    stride_o_b, stride_o_s, stride_o_h,
    S, H,
    DC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """Merge the splits of one query: rescale each partial output to the common max, divide by the
    total sum (plus the sink), round once to the output dtype."""
    pid_bs = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_v = tl.program_id(2)
    b = (pid_bs // S).to(tl.int64)
    s = (pid_bs % S).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    h_ok = offs_h < H
    v_ok = offs_v < DC
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        row = (pid_bs.to(tl.int64) * NUM_SPLITS + split) * H + offs_h
        m = tl.maximum(m, tl.load(stats_ptr + row * 2, mask=h_ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for split in range(NUM_SPLITS):
        row = (pid_bs.to(tl.int64) * NUM_SPLITS + split) * H + offs_h
        weight = tl.exp2(tl.load(stats_ptr + row * 2, mask=h_ok, other=float("-inf")) - m_use)
        denom += weight * tl.load(stats_ptr + row * 2 + 1, mask=h_ok, other=0.0)
        part = tl.load(part_ptr + row[:, None] * DC + offs_v[None, :], mask=h_ok[:, None] & v_ok[None, :], other=0.0)
        acc += weight[:, None] * part
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
        denom = denom + tl.exp2(sink * 1.4426950408889634 - m_use)
    out = acc / denom[:, None]
    o_base = out_ptr + b * stride_o_b + s * stride_o_s
    tl.store(o_base + offs_h[:, None] * stride_o_h + offs_v[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & v_ok[None, :])


def sparse_mla_default_config(S: int, H: int, Dc: int) -> dict:
    """Launch parameters from the H200 sweep in benchmarks/sparse_attention_gpu.py (2026-11-29):
    64 heads x 64 keys, whole Dc per program, 8 warps, 2 stages was fastest for prefill and
    decode; 4 warps spill the [64, 512] fp32 accumulator, splitting Dc repeats q.k."""
    block_h = max(16, min(64, next_power_of_2(H)))
    dc_p = next_power_of_2(Dc)
    return {"block_h": block_h, "block_n": 64, "block_dv": max(16, dc_p),
            "num_warps": 8 if block_h * dc_p >= 64 * 256 else 4, "num_stages": 2}


def sparse_mla_num_splits(queries: int, head_blocks: int, K: int, block_n: int, sms: int = 132) -> int:
    """Key splits per query so that few queries (decode) still spread over the SMs: none once the queries
    alone fill half of them, else up to one split per 256 selected keys (H200, 2026-11-29, K=2048: 8 splits
    beat 16 and 32 at batch 8; at batch 1 the timings were launch-bound)."""
    programs = queries * head_blocks
    if 2 * programs >= sms:
        return 1
    return max(1, min(cdiv(K, max(256, block_n)), cdiv(sms, programs)))


def sparse_mla_attention_triton(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    pe: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    sink: Optional[torch.Tensor] = None,
    *,
    block_h: Optional[int] = None,
    block_n: Optional[int] = None,
    block_dv: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    num_splits: Optional[int] = None,
    row_len: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the fused kernel (CUDA, or CPU tensors under TRITON_INTERPRET).  No host
    sync, output shape depends only on input shapes.  `row_len` ([B*S] int32, optional): each
    query reads only that many leading index entries (0: none, its output is then NaN)."""
    _check_sparse_mla_inputs(q_nope, q_pe, kv, pe, idx, scale, sink)
    B, S, H, Dc = q_nope.shape
    Dr = q_pe.shape[-1]
    T, K = kv.shape[1], idx.shape[-1]
    q_nope, q_pe, kv, pe, idx = (_last_dim_contiguous(t) for t in (q_nope, q_pe, kv, pe, idx))
    cfg = sparse_mla_default_config(S, H, Dc)
    for key, val in (("block_h", block_h), ("block_n", block_n), ("block_dv", block_dv),
                     ("num_warps", num_warps), ("num_stages", num_stages)):
        if val is not None:
            cfg[key] = val
    dc_p = next_power_of_2(Dc)
    dr_p = max(16, next_power_of_2(Dr))
    out = torch.empty((B, S, H, Dc), dtype=q_nope.dtype, device=q_nope.device)
    if out.numel() == 0:
        return out
    head_blocks = cdiv(H, cfg["block_h"])
    if num_splits is None:
        sms = torch.cuda.get_device_properties(out.device).multi_processor_count if out.is_cuda else 132
        num_splits = sparse_mla_num_splits(B * S, head_blocks, K, cfg["block_n"], sms)
    split_len = cdiv(cdiv(K, num_splits), cfg["block_n"]) * cfg["block_n"]
    num_splits = cdiv(K, split_len)
    if num_splits > 1:
        part = torch.empty((B * S * num_splits * H, Dc), dtype=torch.float32, device=out.device)
        stats = torch.empty((B * S * num_splits * H, 2), dtype=torch.float32, device=out.device)
    else:
        part = stats = out  # never touched with one split
    grid = (B * S * num_splits, head_blocks, cdiv(dc_p, cfg["block_dv"]))
    sink_arg = sink if sink is not None else q_nope  # never read when HAS_SINK is False
    _sparse_mla_kernel[grid](
        q_nope, q_pe, kv, pe, idx, sink_arg, out, part, stats, row_len if row_len is not None else idx,
        q_nope.stride(0), q_nope.stride(1), q_nope.stride(2),
        q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
        kv.stride(0), kv.stride(1),
        pe.stride(0), pe.stride(1),
        idx.stride(0), idx.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        S, H, T, K, float(scale) * LOG2E, split_len,
        DC=Dc, DR=Dr, DC_P=max(16, dc_p), DR_P=dr_p,
        BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], BLOCK_DV=cfg["block_dv"],
        HAS_SINK=sink is not None, DOT_PRECISION=_dot_precision(q_nope.dtype), NUM_SPLITS=num_splits,
        HAS_ROW_LEN=row_len is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        combine_dv = min(128, max(16, dc_p))
        _mla_split_combine_kernel[(B * S, head_blocks, cdiv(dc_p, combine_dv))](
            part, stats, sink_arg, out, out.stride(0), out.stride(1), out.stride(2), S, H,
            DC=Dc, BLOCK_H=cfg["block_h"], BLOCK_DV=combine_dv, NUM_SPLITS=num_splits, HAS_SINK=sink is not None,
            num_warps=4,
        )
    return out


@torch.library.custom_op("dsfuse::sparse_mla_attention", mutates_args=())
def sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    pe: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    sink: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Absorbed-MLA sparse attention; the default (CPU) implementation is the reference."""
    return sparse_mla_attention_reference(q_nope, q_pe, kv, pe, idx, scale, sink)


@sparse_mla_attention.register_fake
def _sparse_mla_attention_fake(q_nope, q_pe, kv, pe, idx, scale, sink=None):
    _check_sparse_mla_inputs(q_nope, q_pe, kv, pe, idx, scale, sink)
    return q_nope.new_empty(q_nope.shape)


@direct_kernel(sparse_mla_attention)
def _sparse_mla_attention_cuda(q_nope, q_pe, kv, pe, idx, scale, sink=None):
    return sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, scale, sink)


# ---------------------------------------------------------------------------
# Op 2: HF scatter-mask sparse attention (per-head K/V)
# ---------------------------------------------------------------------------

_MASK_NONE, _MASK_BOOL, _MASK_ADD = 0, 1, 2


def _check_masked_inputs(q, k, v, idx, attn_mask, scale, empty_rows_see_all=False, sink=None):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "sparse_attention_masked: q, k, v must be [B,H,S,D], [B,H,T,D], [B,H,T,Dv], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, H, S, D = q.shape
    T = k.shape[2]
    if tuple(k.shape) != (B, H, T, D):
        raise ValueError(f"sparse_attention_masked: k must be [B={B}, H={H}, T, D={D}], got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (B, H, T):
        raise ValueError(f"sparse_attention_masked: v must be [B={B}, H={H}, T={T}, Dv], got {tuple(v.shape)}")
    if idx.dim() != 3 or idx.shape[0] != B or idx.shape[1] != S or idx.shape[2] < 1:
        raise ValueError(f"sparse_attention_masked: idx must be [B={B}, S={S}, K>=1], got {tuple(idx.shape)}")
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"sparse_attention_masked: q, k, v must share one of {_FLOAT_DTYPES}, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"sparse_attention_masked: idx dtype must be int32 or int64, got {idx.dtype}")
    if not math.isfinite(scale):
        raise ValueError(f"sparse_attention_masked: scale must be finite, got {scale}")
    tensors = [k, v, idx]
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise TypeError(f"sparse_attention_masked: attn_mask must be bool or floating, got {attn_mask.dtype}")
        try:
            broadcast = tuple(torch.broadcast_shapes(tuple(attn_mask.shape), (B, H, S, T)))
        except RuntimeError:
            broadcast = None
        if broadcast != (B, H, S, T):
            raise ValueError(
                f"sparse_attention_masked: attn_mask {tuple(attn_mask.shape)} does not broadcast to {(B, H, S, T)}"
            )
        tensors.append(attn_mask)
    per_head = attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] != 1
    if empty_rows_see_all and attn_mask is not None and (attn_mask.dtype != torch.bool or per_head):
        raise ValueError("sparse_attention_masked: empty_rows_see_all needs a bool attn_mask shared by the heads "
                         f"([B, 1, S, T]), got {attn_mask.dtype} {tuple(attn_mask.shape)}")
    _check_sink("sparse_attention_masked", sink, H, tensors)
    for t in tensors:
        if t.device != q.device:
            raise ValueError(f"sparse_attention_masked: all inputs must be on {q.device}, found {t.device}")


def sparse_attention_masked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    causal: bool = False,
    empty_rows_see_all: bool = False,
    sink: Optional[torch.Tensor] = None,
    hard_selection: bool = False,
) -> torch.Tensor:
    """Exactly the HF graph: scatter the indices into a "not selected" mask, combine it with
    the attention mask (bool: AND; additive: fill with finfo(dtype).min), then SDPA.
    ``causal`` adds the bottom-right aligned causal mask (key t allowed iff t <= s + T - S).
    ``empty_rows_see_all``: a query row left without any allowed key attends over all T keys unmasked, what
    a finite bias (cuDNN SDPA's form of a bool mask) gives there; without it such a row is 0 (bool masks).
    ``sink`` (fp32 [H]): one more score per head in every row's softmax, with a zero value row (a sink column,
    or a term of the denominator), so a row without keys is 0.
    ``hard_selection``: an additive mask gets -inf at unselected keys instead of finfo.min, the selection as a
    -inf bias summed with the mask; the two differ in a row whose selected keys are all at finfo.min, a softmax
    over those keys here and over all T keys with HF's fill. Bool masks and no mask select hard either way.
    Off the CPU the math backend computes it: CUDA's memory-efficient SDPA scales the scores by log2(e) first, so
    a row whose every key is at finfo(bf16 / fp32).min overflows to -inf there and comes out 0, where the math
    (the op's definition, and the kernel's) is a softmax over equal scores: the mean of V."""
    _check_masked_inputs(q, k, v, idx, attn_mask, scale, empty_rows_see_all, sink)
    _check_index_range(idx, k.shape[2], False, "sparse_attention_masked")
    args = (q, k, v, idx, attn_mask, scale, causal, empty_rows_see_all, sink, hard_selection)
    if q.device.type == "cpu":
        return sparse_attention_masked_math(*args)
    with sdpa_kernel(SDPBackend.MATH):
        return sparse_attention_masked_math(*args)


def sparse_attention_masked_math(q, k, v, idx, attn_mask, scale, causal=False, empty_rows_see_all=False, sink=None,
                                 hard_selection=False):
    """The reference math without checks (what benchmarks hand to torch.compile). SDPA takes no sink: with one, the
    softmax is written out, in fp32 as the sink forms of the source are."""
    B, S, T = q.shape[0], q.shape[2], k.shape[2]
    index_mask = torch.ones((B, S, T), dtype=torch.bool, device=q.device).scatter(-1, idx.long(), False)
    index_mask = index_mask.unsqueeze(1)  # [B,1,S,T], True = not selected
    if causal:
        future = torch.ones((S, T), dtype=torch.bool, device=q.device).triu(T - S + 1)
        index_mask = index_mask | future
    if attn_mask is None:
        combined = ~index_mask
    elif attn_mask.dtype == torch.bool:
        combined = attn_mask & ~index_mask
    else:
        combined = attn_mask.masked_fill(index_mask, float("-inf") if hard_selection else torch.finfo(q.dtype).min)
    if empty_rows_see_all:
        combined = combined | ~combined.any(dim=-1, keepdim=True)
    if sink is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=combined, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~combined, float("-inf")) if combined.dtype == torch.bool else scores + combined
    sink = sink.view(1, -1, 1, 1)
    probs = _softmax_with_sink(scores, sink, torch.maximum(scores.amax(dim=-1, keepdim=True), sink))
    return torch.matmul(probs.to(q.dtype), v)


@triton.jit
def _selection_bitmap_kernel(idx_ptr, bits_ptr, mask_ptr, stride_idx_b, stride_idx_s,
                             stride_m_b, stride_m_s, stride_m_t, S, T, K, W,
                             BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr):
    """bits[b, s, t // 32] |= 1 << (t % 32) for every selected t; duplicates set one bit.
    With CAUSAL, future keys (t > s + T - S) are dropped here, and with HAS_MASK a
    head-independent boolean mask [B,S,T] is ANDed in here (read only at the K selected keys),
    so the attention kernel needs no causal test and no mask read of its own."""
    pid_bs = tl.program_id(0)
    b = pid_bs // S
    s = pid_bs % S
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ids = tl.load(idx_ptr + b.to(tl.int64) * stride_idx_b + s.to(tl.int64) * stride_idx_s + offs,
                  mask=offs < K, other=-1)
    ok = (ids >= 0) & (ids < T)
    if CAUSAL:
        ok = ok & (ids <= s + T - S)
    if HAS_MASK:
        allowed = tl.load(mask_ptr + b.to(tl.int64) * stride_m_b + s.to(tl.int64) * stride_m_s
                          + tl.where(ok, ids, 0).to(tl.int64) * stride_m_t, mask=ok, other=0)
        ok = ok & (allowed != 0)
    ids = tl.where(ok, ids, 0).to(tl.int32)
    word = tl.full([BLOCK_K], 1, tl.int32) << (ids & 31)
    tl.atomic_or(bits_ptr + pid_bs.to(tl.int64) * W + (ids >> 5), word, mask=ok, sem="relaxed")


@triton.jit
def _active_tiles_kernel(bits_ptr, list_ptr, count_ptr, S, W, NUM_QB, NUM_TILES,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_CHUNK: tl.constexpr):
    """For one (batch, query block): the key tiles in which any query of the block selected
    a key, compacted in ascending order."""
    pid = tl.program_id(0)
    b = pid // NUM_QB
    qb = pid % NUM_QB
    WPT: tl.constexpr = BLOCK_N // 32
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < S
    row_base = bits_ptr + (b.to(tl.int64) * S + offs_m) * W
    offs_w = tl.arange(0, TILE_CHUNK * WPT)
    count = tl.zeros([], tl.int32)
    for start in range(0, NUM_TILES, TILE_CHUNK):
        w = start * WPT + offs_w
        words = tl.load(row_base[:, None] + w[None, :], mask=m_ok[:, None] & (w < W)[None, :], other=0)
        per_word = tl.max((words != 0).to(tl.int32), 0)  # [TILE_CHUNK * WPT]
        active = tl.max(tl.reshape(per_word, [TILE_CHUNK, WPT]), 1) > 0
        tiles = start + tl.arange(0, TILE_CHUNK)
        active = active & (tiles < NUM_TILES)
        slots = count + tl.cumsum(active.to(tl.int32), 0) - 1
        tl.store(list_ptr + pid.to(tl.int64) * NUM_TILES + slots, tiles, mask=active)
        count += tl.sum(active.to(tl.int32), 0)
    tl.store(count_ptr + pid, count)


@triton.jit
def _masked_attention_tile(acc, m_i, l_i, q_a, q_b, k_base, v_base, bits_rows, mask_base, tile, offs_m, m_ok,
                           stride_k_t, stride_v_t, stride_m_s, stride_m_t, T, scale, unselected,
                           D: tl.constexpr, DV: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                           DV_P: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, ALL_KEYS: tl.constexpr):
    """One key tile of the online softmax.  Normally the selected keys only, in log2 units.  ALL_KEYS (additive
    masks): SDPA's row over every key, the unselected ones at `unselected` (finfo.min, or -inf for a hard
    selection), in natural units, so that a row at finfo(bf16 / fp32).min everywhere is a softmax over equal scores
    instead of exp2(-inf)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    offs_local = tl.arange(0, BLOCK_N)
    offs_n = tile * BLOCK_N + offs_local
    n_ok = offs_n < T
    offs_da = tl.arange(0, DA)
    if DA > D:
        k_a_mask = n_ok[:, None] & (offs_da < D)[None, :]
    else:
        k_a_mask = n_ok[:, None]
    k_a = tl.load(k_base + offs_n[:, None] * stride_k_t + offs_da[None, :], mask=k_a_mask, other=0.0)
    qk = tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PRECISION)
    if DB > 0:
        offs_db = DA + tl.arange(0, DB)
        k_b = tl.load(k_base + offs_n[:, None] * stride_k_t + offs_db[None, :],
                      mask=n_ok[:, None] & (offs_db < D)[None, :], other=0.0)
        qk = tl.dot(q_b, tl.trans(k_b), qk, input_precision=DOT_PRECISION)
    WORDS_PER_TILE: tl.constexpr = BLOCK_N // 32
    words = tl.load(bits_rows + tile * WORDS_PER_TILE, mask=m_ok, other=0)[:, None]
    for j in tl.static_range(1, WORDS_PER_TILE):
        word_j = tl.load(bits_rows + (tile * WORDS_PER_TILE + j), mask=m_ok, other=0)
        words = tl.where((offs_local >> 5 == j)[None, :], word_j[:, None], words)
    allowed = (words << (31 - (offs_local & 31))[None, :]) < 0  # bit (t % 32) moved to the sign bit
    if MASK_KIND == 1:
        mvals = tl.load(mask_base + offs_m[:, None] * stride_m_s + offs_n[None, :] * stride_m_t,
                        mask=m_ok[:, None] & n_ok[None, :], other=0)
        allowed = allowed & (mvals != 0)
    if MASK_KIND == 2:
        mvals = tl.load(mask_base + offs_m[:, None] * stride_m_s + offs_n[None, :] * stride_m_t,
                        mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        if ALL_KEYS:
            x = tl.where(n_ok[None, :], qk * scale + tl.where(allowed, mvals, unselected), float("-inf"))
        else:
            x = tl.where(allowed, (qk * scale + mvals) * LOG2E, float("-inf"))
    else:
        x = tl.where(allowed, qk * (scale * LOG2E), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(x, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    if ALL_KEYS:
        alpha = tl.exp2((m_i - m_use) * LOG2E)
        p = tl.exp2((x - m_use[:, None]) * LOG2E)
    else:
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(x - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    offs_v = tl.arange(0, DV_P)
    v_tile = tl.load(v_base + offs_n[:, None] * stride_v_t + offs_v[None, :],
                     mask=n_ok[:, None] & (offs_v < DV)[None, :], other=0.0)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v_tile.dtype), v_tile, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _masked_attention_sink(acc, m_i, l_i, sink_ptr, h, NATURAL: tl.constexpr):
    """The head's sink as one more score of the row's softmax, with a zero value row: the running max and sum take
    it in, the accumulator is rescaled to the new max. m_i is in natural units with NATURAL, else in log2 units."""
    LOG2E: tl.constexpr = 1.4426950408889634
    sink = tl.load(sink_ptr + h).to(tl.float32)
    if NATURAL:
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2((m_i - m_new) * LOG2E)
        l_i = l_i * alpha + tl.exp2((sink - m_new) * LOG2E)
    else:
        m_new = tl.maximum(m_i, sink * LOG2E)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink * LOG2E - m_new)
    return acc * alpha[:, None], l_i


@triton.jit
def _masked_attention_store(o_ptrs, acc, l_i, q_nan, rows, v_ok):
    """acc / l_i.  A row where no key got weight (l_i == 0; a NaN score keeps l_i NaN) is SDPA's 0 for an
    all-False row, or NaN when its query holds a NaN: SDPA still multiplies it with the masked keys."""
    empty = l_i == 0.0
    out = tl.where(empty[:, None], tl.where(q_nan, float("nan"), 0.0)[:, None],
                   acc / tl.where(empty, 1.0, l_i)[:, None])
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=rows[:, None] & v_ok[None, :])


@triton.jit
def _sparse_masked_attention_kernel(
    q_ptr, k_ptr, v_ptr, bits_ptr, list_ptr, count_ptr, mask_ptr, dense_ptr, sink_ptr, out_ptr,
    stride_q_b, stride_q_h, stride_q_s,
    stride_k_b, stride_k_h, stride_k_t,
    stride_v_b, stride_v_h, stride_v_t,
    stride_m_b, stride_m_h, stride_m_s, stride_m_t,
    stride_o_b, stride_o_h, stride_o_s,
    H, S, T, W, NUM_QB, NUM_TILES, scale, fill_min, unselected,
    D: tl.constexpr, DV: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, ALL_KEYS_PASS: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """Flash attention over the active key tiles of one (query block, batch, head).  The head
    dim is split into a power-of-two part DA and a tail DB (192 = 128 + 64) so no MMA work is
    wasted on padding.  Selection (causal limit included) comes from the bitmap; the attention
    mask, if any, is read per tile.  Bits past T are never set, so tile tails need no test.
    Additive masks: a row whose best score is at the fill (every key at finfo.min, say) is SDPA's softmax over
    all T keys, unselected ones included.  This pass flags such rows in dense_ptr; a second launch with
    ALL_KEYS_PASS redoes them over every tile (one kernel with both loops ran 33 % slower on the H200).
    HAS_SINK: the head's sink joins each row's softmax before the division."""
    qb = NUM_QB - 1 - tl.program_id(0)  # longest (latest) query blocks first under causal masks
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < S
    offs_da = tl.arange(0, DA)
    offs_v = tl.arange(0, DV_P)
    v_ok = offs_v < DV

    q_base = q_ptr + b64 * stride_q_b + h64 * stride_q_h
    k_base = k_ptr + b64 * stride_k_b + h64 * stride_k_h
    v_base = v_ptr + b64 * stride_v_b + h64 * stride_v_h
    if DA > D:  # head dims below 16 are padded up to the smallest MMA width
        q_a_mask = m_ok[:, None] & (offs_da < D)[None, :]
    else:
        q_a_mask = m_ok[:, None]
    q_a = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_da[None, :], mask=q_a_mask, other=0.0)
    q_nan = tl.max((q_a != q_a).to(tl.int32), 1) > 0
    q_b = None
    if DB > 0:
        offs_db = DA + tl.arange(0, DB)
        q_b = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_db[None, :],
                      mask=m_ok[:, None] & (offs_db < D)[None, :], other=0.0)
        q_nan = q_nan | (tl.max((q_b != q_b).to(tl.int32), 1) > 0)
    bits_rows = bits_ptr + (b64 * S + offs_m) * W
    mask_base = mask_ptr + b64 * stride_m_b + h64 * stride_m_h
    o_ptrs = out_ptr + b64 * stride_o_b + h64 * stride_o_h + offs_m[:, None] * stride_o_s + offs_v[None, :]

    dense_rows = dense_ptr + (b64 * H + h64) * S + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P], tl.float32)
    if ALL_KEYS_PASS:
        dense = tl.load(dense_rows, mask=m_ok, other=0) != 0
        if tl.max(dense.to(tl.int32), 0) > 0:
            for tile in range(0, NUM_TILES):
                acc, m_i, l_i = _masked_attention_tile(
                    acc, m_i, l_i, q_a, q_b, k_base, v_base, bits_rows, mask_base, tile, offs_m, m_ok,
                    stride_k_t, stride_v_t, stride_m_s, stride_m_t, T, scale, unselected,
                    D, DV, DA, DB, DV_P, BLOCK_N, MASK_KIND, DOT_PRECISION, True)
            if HAS_SINK:
                acc, l_i = _masked_attention_sink(acc, m_i, l_i, sink_ptr, h, True)
            _masked_attention_store(o_ptrs, acc, l_i, q_nan, dense, v_ok)
    else:
        tile_list = list_ptr + (b64 * NUM_QB + qb) * NUM_TILES
        n_active = tl.load(count_ptr + b * NUM_QB + qb)
        for i in range(0, n_active):
            acc, m_i, l_i = _masked_attention_tile(
                acc, m_i, l_i, q_a, q_b, k_base, v_base, bits_rows, mask_base, tl.load(tile_list + i), offs_m,
                m_ok, stride_k_t, stride_v_t, stride_m_s, stride_m_t, T, scale, unselected,
                D, DV, DA, DB, DV_P, BLOCK_N, MASK_KIND, DOT_PRECISION, False)
        if MASK_KIND == 2:
            # Unselected keys score q.k * scale + fill_min: they weigh nothing unless the row's best score is near
            # the fill too (half of it: a gap of 32752 for fp16, far past exp's underflow).
            tl.store(dense_rows, (m_i <= fill_min * 0.5 * 1.4426950408889634).to(tl.int8), mask=m_ok)
        if HAS_SINK:
            acc, l_i = _masked_attention_sink(acc, m_i, l_i, sink_ptr, h, False)
        _masked_attention_store(o_ptrs, acc, l_i, q_nan, m_ok, v_ok)


def _split_head_dim(D: int):
    """D = DA + tail with DA a power of two >= 16; tail padded to a power of two (0 if none)."""
    da = max(16, 1 << (D.bit_length() - 1))
    tail = D - da
    return da, (max(16, next_power_of_2(tail)) if tail > 0 else 0)


def sparse_masked_default_config() -> dict:
    """Launch parameters from the H200 sweep in benchmarks/sparse_attention_gpu.py (2026-11-29,
    D=192, Dv=128): 64 queries x 64 keys, 4 warps, 3 stages was fastest (8.27 ms against
    9.06 ms for 128 x 64 with 8 warps)."""
    return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}


def sparse_attention_masked_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    causal: bool = False,
    empty_rows_see_all: bool = False,
    sink: Optional[torch.Tensor] = None,
    hard_selection: bool = False,
    *,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Build the selection bitmap and active-tile lists, then run the attention kernel.
    Scratch is O(B*S*T/8) bytes for the bitmap plus O(B*S/BLOCK_M*T/BLOCK_N) for the lists."""
    _check_masked_inputs(q, k, v, idx, attn_mask, scale, empty_rows_see_all, sink)
    B, H, S, D = q.shape
    T, Dv, K = k.shape[2], v.shape[3], idx.shape[2]
    q, k, v, idx = (_last_dim_contiguous(t) for t in (q, k, v, idx))
    cfg = sparse_masked_default_config()
    for key, val in (("block_m", block_m), ("block_n", block_n), ("num_warps", num_warps),
                     ("num_stages", num_stages)):
        if val is not None:
            cfg[key] = val
    bm, bn = cfg["block_m"], cfg["block_n"]
    if bn % 32:
        raise ValueError(f"sparse_attention_masked: block_n must be a multiple of 32, got {bn}")
    out = torch.empty((B, H, S, Dv), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    num_qb, num_tiles = cdiv(S, bm), cdiv(T, bn)
    words = num_tiles * (bn // 32)  # rows padded to whole key tiles: no word index past a row
    bits = torch.zeros((B, S, words), dtype=torch.int32, device=q.device)
    mask_kind, mask_arg, mstrides = _MASK_NONE, bits, (0, 0, 0, 0)
    bitmap_mask, bitmap_mstrides = bits, (0, 0, 0)
    if attn_mask is not None:
        expanded = attn_mask.expand(B, H, S, T)
        if attn_mask.dtype == torch.bool and (H == 1 or expanded.stride(1) == 0):
            # The HF case ([B,1,S,T]): selection AND mask is the same for every head.
            bitmap_mask = expanded[:, 0].view(torch.uint8)
            bitmap_mstrides = tuple(bitmap_mask.stride())
        else:
            mask_kind = _MASK_BOOL if attn_mask.dtype == torch.bool else _MASK_ADD
            mask_arg = expanded.view(torch.uint8) if attn_mask.dtype == torch.bool else expanded
            mstrides = tuple(mask_arg.stride())
    block_k = min(1024, next_power_of_2(K))
    _selection_bitmap_kernel[(B * S, cdiv(K, block_k))](
        idx, bits, bitmap_mask, idx.stride(0), idx.stride(1), *bitmap_mstrides, S, T, K, words,
        BLOCK_K=block_k, CAUSAL=causal, HAS_MASK=bitmap_mask is not bits)
    if empty_rows_see_all:
        bits = _rows_without_keys_see_all(bits, T)
    tile_list = torch.empty((B, num_qb, num_tiles), dtype=torch.int32, device=q.device)
    tile_count = torch.empty((B, num_qb), dtype=torch.int32, device=q.device)
    _active_tiles_kernel[(B * num_qb,)](
        bits, tile_list, tile_count, S, words, num_qb, num_tiles,
        BLOCK_M=bm, BLOCK_N=bn, TILE_CHUNK=min(32, next_power_of_2(num_tiles)))

    da, db = _split_head_dim(D)
    dense = torch.empty((B, H, S), dtype=torch.int8, device=q.device) if mask_kind == _MASK_ADD else bits
    for all_keys_pass in (False, True) if mask_kind == _MASK_ADD else (False,):
        _sparse_masked_attention_kernel[(num_qb, B * H)](
            q, k, v, bits, tile_list, tile_count, mask_arg, dense, q if sink is None else sink, out,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            *mstrides,
            out.stride(0), out.stride(1), out.stride(2),
            H, S, T, words, num_qb, num_tiles, float(scale), torch.finfo(q.dtype).min,
            float("-inf") if hard_selection else torch.finfo(q.dtype).min,
            D=D, DV=Dv, DA=da, DB=db, DV_P=max(16, next_power_of_2(Dv)),
            BLOCK_M=bm, BLOCK_N=bn, MASK_KIND=mask_kind,
            DOT_PRECISION=_dot_precision(q.dtype), ALL_KEYS_PASS=all_keys_pass, HAS_SINK=sink is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return out


def _rows_without_keys_see_all(bits: torch.Tensor, T: int) -> torch.Tensor:
    """Set every key t < T in the bitmap rows [B, S, W] that selected none (no host sync: a `where`; no copy from
    the host either, so a CUDA graph captures it)."""
    keys_in_word = (T - 32 * torch.arange(bits.shape[-1], device=bits.device, dtype=torch.int64)).clamp(0, 32)
    low_bits = (1 << keys_in_word.clamp(max=31)) - 1  # bit i of word w set iff 32w + i < T
    full = torch.where(keys_in_word == 32, -1, low_bits).to(torch.int32)
    empty = (bits == 0).all(dim=-1, keepdim=True)
    return torch.where(empty, full, bits)


@torch.library.custom_op("dsfuse::sparse_attention_masked", mutates_args=())
def sparse_attention_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    causal: bool = False,
    empty_rows_see_all: bool = False,
    sink: Optional[torch.Tensor] = None,
    hard_selection: bool = False,
) -> torch.Tensor:
    """HF scatter-mask sparse attention; the default (CPU) implementation is the reference."""
    return sparse_attention_masked_reference(q, k, v, idx, attn_mask, scale, causal, empty_rows_see_all, sink,
                                             hard_selection)


@sparse_attention_masked.register_fake
def _sparse_attention_masked_fake(q, k, v, idx, attn_mask, scale, causal=False, empty_rows_see_all=False, sink=None,
                                  hard_selection=False):
    _check_masked_inputs(q, k, v, idx, attn_mask, scale, empty_rows_see_all, sink)
    return q.new_empty((*q.shape[:3], v.shape[-1]))


@direct_kernel(sparse_attention_masked)
def _sparse_attention_masked_cuda(q, k, v, idx, attn_mask, scale, causal=False, empty_rows_see_all=False, sink=None,
                                  hard_selection=False):
    return sparse_attention_masked_triton(q, k, v, idx, attn_mask, scale, causal, empty_rows_see_all, sink,
                                          hard_selection)


# ---------------------------------------------------------------------------
# Op 3: HF latent-cache attention in absorbed form (decode)
# ---------------------------------------------------------------------------


# The absorbed op's names for an FP8 kv_b_proj's weight, scales and blocks, in `check_fp8_weight`'s errors.
KV_B_ARGUMENTS = ("kv_b_weight", "kv_b_scale", "kv_b_block_n", "kv_b_block_k")


def _check_absorbed_inputs(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, kv_b_scale=None,
                           kv_b_block_n=128, kv_b_block_k=128):
    op = "absorbed_mla_attention"
    if q.dim() != 4 or latent.dim() != 4 or rope.dim() != 4:
        raise ValueError(f"{op}: q must be [B,H,S,D] and latent/rope [B,1,T,C]/[B,1,T,R], got "
                         f"{tuple(q.shape)}, {tuple(latent.shape)}, {tuple(rope.shape)}")
    B, H, S, D = q.shape
    _, one, T, C = latent.shape
    R = D - nope_dim
    if one != 1 or tuple(rope.shape) != (B, 1, T, R) or latent.shape[0] != B:
        raise ValueError(f"{op}: latent {tuple(latent.shape)} and rope {tuple(rope.shape)} must be [B={B}, 1, T, C] "
                         f"and [B, 1, T, R={R}]")
    if not 0 < nope_dim < D:
        raise ValueError(f"{op}: nope_dim {nope_dim} must split the query head dim {D}")
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[1] != C or kv_b_weight.shape[0] % H \
            or kv_b_weight.shape[0] // H <= nope_dim:
        raise ValueError(f"{op}: kv_b_weight must be [H*(nope+v), C={C}] with H={H}, got {tuple(kv_b_weight.shape)}")
    if tuple(idx.shape[:2]) != (B, S) or idx.dim() != 3 or idx.shape[2] < 1:
        raise ValueError(f"{op}: idx must be [B={B}, S={S}, K>=1], got {tuple(idx.shape)}")
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{op}: idx dtype must be int32 or int64, got {idx.dtype}")
    if kv_b_scale is not None:
        check_fp8_weight(op, kv_b_weight, kv_b_scale, kv_b_block_n, kv_b_block_k, KV_B_ARGUMENTS)
    if q.dtype not in _FLOAT_DTYPES or {latent.dtype, rope.dtype} != {q.dtype} or (
            kv_b_scale is None and kv_b_weight.dtype != q.dtype):
        raise TypeError(f"{op}: q, latent, rope and kv_b_weight (unless FP8 with kv_b_scale) must share one float "
                        f"dtype, got {q.dtype}, {latent.dtype}, {rope.dtype}, {kv_b_weight.dtype}")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1] != 1:
            raise ValueError(f"{op}: attn_mask must be a bool [B|1, 1, S|1, T] mask, got {attn_mask.dtype} "
                             f"{tuple(attn_mask.shape)}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (B, 1, S, T))
        except RuntimeError:
            raise ValueError(f"{op}: attn_mask {tuple(attn_mask.shape)} does not broadcast to {(B, 1, S, T)}") from None
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be finite, got {scale}")
    for t in (latent, rope, kv_b_weight, idx) + tuple(t for t in (attn_mask, kv_b_scale) if t is not None):
        if t.device != q.device:
            raise ValueError(f"{op}: all inputs must be on {q.device}, found {t.device}")


def _distinct_allowed_keys(idx: torch.Tensor, attn_mask: Optional[torch.Tensor], T: int, causal: bool,
                           indices_distinct: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys HF's scatter mask lets through: each selected index once, allowed by the bool mask (and, with
    `causal`, at most `s + T - S`); everything else (repeats, masked keys, indices outside [0, T)) becomes -1.
    Also returns `no_key` [B,S]: rows left without any key.  Sorting puts a row's repeats side by side (one
    block radix sort of K entries per row, O(S·K), independent of T; int32 keys halve its passes) and its
    largest key last, so `no_key` reads one column instead of reducing the row."""
    keys = idx.long()
    nearest = keys.clamp(0, T - 1)
    if causal:
        S = idx.shape[1]
        nearest = nearest.minimum(torch.arange(T - S, T, device=idx.device).view(1, S, 1))
    allowed = nearest == keys
    if attn_mask is not None:
        B, S = idx.shape[:2]
        allowed &= attn_mask.expand(B, 1, S, T)[:, 0].gather(-1, nearest)
    narrow = torch.int32 if T <= torch.iinfo(torch.int32).max else torch.int64
    if indices_distinct:  # the caller knows the row holds no repeats (a top-k's indices): no sort needed
        keys = torch.where(allowed, keys, -1).to(narrow)
        return keys, ~allowed.any(dim=-1)
    keys = torch.where(allowed, keys, -1).to(narrow).sort(dim=-1).values
    no_key = keys[..., -1] < 0
    keys[..., 1:].masked_fill_(keys[..., 1:] == keys[..., :-1], -1)
    return keys, no_key


@triton.jit
def _allowed_keys_kernel(idx_ptr, mask_ptr, keys_ptr, no_key_ptr, S, K, T, si_b, si_s, si_k, sm_b, sm_s, sm_t,
                         HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """One query row of `_distinct_allowed_keys` for indices without repeats: each index allowed (in [0, T), by
    the mask at its nearest key, causally) kept, every other one -1 (int32), and whether the row kept none."""
    row = tl.program_id(0)
    b, s = row // S, row % S
    kept = tl.zeros((BLOCK_K,), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_row = ks < K
        key = tl.load(idx_ptr + b.to(tl.int64) * si_b + s.to(tl.int64) * si_s + ks * si_k, mask=in_row,
                      other=-1).to(tl.int64)
        nearest = tl.minimum(tl.maximum(key, 0), T - 1)
        if CAUSAL:
            nearest = tl.minimum(nearest, s + T - S)
        allowed = (nearest == key) & in_row
        if HAS_MASK:
            allowed &= tl.load(mask_ptr + b.to(tl.int64) * sm_b + s.to(tl.int64) * sm_s + nearest * sm_t,
                               mask=in_row, other=0) != 0
        tl.store(keys_ptr + row.to(tl.int64) * K + ks, tl.where(allowed, key, -1).to(tl.int32), mask=in_row)
        kept |= allowed.to(tl.int32)
    tl.store(no_key_ptr + row, (tl.max(kept, axis=0) == 0).to(tl.int8))


def _distinct_allowed_keys_triton(idx, attn_mask, T, causal, indices_distinct=False):
    """`_distinct_allowed_keys` in one launch where the row holds no repeats (a top-k's indices, int32 keys): the ~9
    torch ops of a decode step's key selection, each a launch, become one; otherwise the torch ops."""
    if not indices_distinct or T > torch.iinfo(torch.int32).max or idx.numel() == 0:
        return _distinct_allowed_keys(idx, attn_mask, T, causal, indices_distinct)
    B, S, K = idx.shape
    keys = torch.empty((B, S, K), dtype=torch.int32, device=idx.device)
    no_key = torch.empty((B, S), dtype=torch.int8, device=idx.device)
    mask = idx if attn_mask is None else attn_mask.expand(B, 1, S, T)[:, 0].view(torch.uint8)
    _allowed_keys_kernel[(B * S,)](idx, mask, keys, no_key, S, K, T, *idx.stride(), *mask.stride(),
                                   HAS_MASK=attn_mask is not None, CAUSAL=causal,
                                   BLOCK_K=min(1024, next_power_of_2(K)))
    return keys, no_key.view(torch.bool)


def _per_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x[h] @ w[h]` for an [H, B, S, *] view `x`, heads as the batch dim: [H, B, S, N].  cuBLAS takes any batch
    stride and a row- or column-major matrix, so a head slice of `kv_b_proj`'s weight is read in place (no copy,
    no fp32 conversion: the GEMM accumulates in fp32 and rounds once to the input dtype)."""
    H, B, S, _ = x.shape
    return torch.bmm(x.reshape(H, B * S, -1), w).view(H, B, S, -1)  # reshape copies only if B > 1 and S > 1


def _absorbed_attention(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal, empty_rows_see_all,
                        indices_distinct, attend, allowed_keys=_distinct_allowed_keys):
    B, H, S, D = q.shape
    T, C = latent.shape[2], latent.shape[3]
    heads = kv_b_weight.view(H, -1, C)
    w_key, w_value = heads[:, :nope_dim], heads[:, nope_dim:]
    q_nope, q_rope = q.split([nope_dim, D - nope_dim], dim=-1)
    q_latent = _per_head_matmul(q_nope.transpose(0, 1), w_key).permute(1, 2, 0, 3)  # [B,S,H,C] view, unit last stride
    q_rope = q_rope.transpose(1, 2)
    kv, pe = latent.reshape(B, T, C), rope.reshape(B, T, -1)
    keys, no_key = allowed_keys(idx, attn_mask, T, causal, indices_distinct)
    out_latent = attend(q_latent, q_rope, kv, pe, keys, scale)
    if empty_rows_see_all:
        every_key = torch.arange(T, device=q.device).expand(B, S, T)  # stride 0 on B and S: no [B,S,T] tensor
        everything = attend(q_latent, q_rope, kv, pe, every_key, scale, only=no_key)
        out_latent = torch.where(no_key[:, :, None, None], everything, out_latent)
    out = _per_head_matmul(out_latent.permute(2, 0, 1, 3), w_value.transpose(1, 2)).transpose(0, 1)
    if not empty_rows_see_all:
        out = out.masked_fill(no_key[:, None, :, None], 0)
    return out.contiguous()


def _attend_math(q_nope, q_pe, kv, pe, idx, scale, only=None):
    if only is not None:
        idx = torch.where(only[..., None], idx, -1)
    return sparse_mla_attention_math(q_nope, q_pe, kv, pe, idx, scale)


_SEE_ALL_MAX_SPLITS = 8


def _attend_triton(q_nope, q_pe, kv, pe, idx, scale, only=None):
    """With `only`, the other rows read no index entry.  Their split programs still store (and the combine still
    merges) fp32 partials, so that pass splits the T keys at most `_SEE_ALL_MAX_SPLITS` ways instead of the
    automatic up-to-32 (B1, T8192: 2 MiB of partials instead of 8 MiB and a 4x shorter combine on every call);
    a row that does see all keys (a mask excluding every selected key: rare) then takes ~T/8 keys per program."""
    if only is None:
        return sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, scale)
    B, S, H, Dc = q_nope.shape
    cfg = sparse_mla_default_config(S, H, Dc)
    sms = torch.cuda.get_device_properties(q_nope.device).multi_processor_count if q_nope.is_cuda else 132
    splits = sparse_mla_num_splits(B * S, cdiv(H, cfg["block_h"]), idx.shape[-1], cfg["block_n"], sms)
    row_len = torch.where(only.view(-1), idx.shape[-1], 0).to(torch.int32)
    return sparse_mla_attention_triton(q_nope, q_pe, kv, pe, idx, scale, row_len=row_len,
                                       num_splits=min(splits, _SEE_ALL_MAX_SPLITS))


def absorbed_mla_attention_reference(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal=False,
                                     empty_rows_see_all=False, indices_distinct=False, kv_b_scale=None,
                                     kv_b_block_n=128, kv_b_block_k=128):
    """What HF `DeepseekV32Attention` computes from its latent cache, in absorbed form.

    HF expands every cached latent through `kv_b_proj` (`k_nope | v` per head), appends the shared
    rope key, and attends over the keys its scatter mask selects. Folding `kv_b_proj` into the query
    (`q_nope @ W_k`) and the output (`(P @ latent) @ W_v^T`) gives the same sums in another order, with
    work proportional to the K selected keys instead of the T cached ones. Roundings that differ from
    HF: the absorbed query and the latent output are rounded to q's dtype (HF rounds the expanded K
    and V instead); exact up to summation order in fp32. `causal` adds the bottom-right aligned causal
    mask (key t allowed iff t <= s + T - S). Rows with no allowed key return 0 (SDPA's bool-mask result),
    or with `empty_rows_see_all` attend over all T keys unmasked: what a finite mask bias (cuDNN SDPA's
    -65536) gives when it shifts every key of a row alike. `indices_distinct` is the caller's promise that no
    row of `idx` repeats an index (a top-k's indices): the repeats HF's scatter would merge are then not searched
    for (no sort). With `kv_b_scale`, `kv_b_weight` is a released checkpoint's e4m3 kv_b_proj with its
    `kv_b_block_n` x `kv_b_block_k` block scales, read as its exact values rounded once to q's dtype.
    """
    _check_absorbed_inputs(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, kv_b_scale, kv_b_block_n,
                           kv_b_block_k)
    _check_index_range(idx, latent.shape[2], False, "absorbed_mla_attention")
    if kv_b_scale is not None:
        kv_b_weight = dequantize_fp8_blocks(kv_b_weight, kv_b_scale, kv_b_block_n, kv_b_block_k).to(q.dtype)
    return absorbed_mla_attention_math(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal,
                                       empty_rows_see_all, indices_distinct)


def absorbed_mla_attention_math(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal=False,
                                empty_rows_see_all=False, indices_distinct=False):
    """The reference math without checks (what benchmarks hand to torch.compile)."""
    return _absorbed_attention(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal,
                               empty_rows_see_all, indices_distinct, _attend_math)


def absorbed_mla_attention_triton(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal=False,
                                  empty_rows_see_all=False, indices_distinct=False, kv_b_scale=None,
                                  kv_b_block_n=128, kv_b_block_k=128):
    """The CUDA path (or CPU tensors under TRITON_INTERPRET): absorption in torch ops, the key selection of top-k
    indices in one launch (in torch ops where indices may repeat), the attention in the MLA kernel. No host sync.
    An FP8 kv_b_proj is dequantised once while it is unchanged (`dequantized_once`): every decode step reads the
    whole weight, ~25 us a layer on an H200 (run 140)."""
    _check_absorbed_inputs(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, kv_b_scale, kv_b_block_n,
                           kv_b_block_k)
    if kv_b_scale is not None:
        kv_b_weight = dequantized_once(kv_b_weight, kv_b_scale, kv_b_block_n, kv_b_block_k, q.dtype)
    return _absorbed_attention(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal,
                               empty_rows_see_all, indices_distinct, _attend_triton, _distinct_allowed_keys_triton)


@torch.library.custom_op("dsfuse::absorbed_mla_attention", mutates_args=())
def absorbed_mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    kv_b_weight: torch.Tensor,
    idx: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    nope_dim: int,
    causal: bool = False,
    empty_rows_see_all: bool = False,
    indices_distinct: bool = False,
    kv_b_scale: Optional[torch.Tensor] = None,
    kv_b_block_n: int = 128,
    kv_b_block_k: int = 128,
) -> torch.Tensor:
    """HF latent-cache sparse attention in absorbed form; the default (CPU) implementation is the reference."""
    return absorbed_mla_attention_reference(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal,
                                            empty_rows_see_all, indices_distinct, kv_b_scale, kv_b_block_n,
                                            kv_b_block_k)


@absorbed_mla_attention.register_fake
def _absorbed_mla_attention_fake(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal=False,
                                 empty_rows_see_all=False, indices_distinct=False, kv_b_scale=None, kv_b_block_n=128,
                                 kv_b_block_k=128):
    _check_absorbed_inputs(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, kv_b_scale, kv_b_block_n,
                           kv_b_block_k)
    H = q.shape[1]
    return q.new_empty((*q.shape[:3], kv_b_weight.shape[0] // H - nope_dim))


@direct_kernel(absorbed_mla_attention)
def _absorbed_mla_attention_cuda(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal=False,
                                 empty_rows_see_all=False, indices_distinct=False, kv_b_scale=None, kv_b_block_n=128,
                                 kv_b_block_k=128):
    return absorbed_mla_attention_triton(q, latent, rope, kv_b_weight, idx, attn_mask, scale, nope_dim, causal,
                                         empty_rows_see_all, indices_distinct, kv_b_scale, kv_b_block_n,
                                         kv_b_block_k)
