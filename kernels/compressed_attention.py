"""DeepSeek V4 attention with sinks over a sliding window plus compressed entries (`torch.ops.dsfuse.compressed_attention`).

Math (HF `DeepseekV4Attention` with `eager_attention_forward`, every head reading one shared K=V row set):

    keys        = [window rows kv[b, n] | compressed entries c[b, t]]                 (K = V)
    logit[h, j] = round(round(q[b, s, h] . keys[j]) * scale)          in the input dtype, as HF's matmul and scale
    visible     = window:      kv_pos[b, n] >= 0  and  0 <= q_pos[b, s] - kv_pos[b, n] < window
                  CSA entries: t in indices[b, s]  (-1 = no entry)
                  HCA entries: t < (q_pos[b, s] + 1) // compress_rate                 (indices is None)
    p           = softmax over [visible logits | sinks[h]] in fp32, sink column dropped, rounded to the input dtype
    out[b,s,h]  = p @ keys  (then, when cos / sin are given, the inverse interleaved RoPE on the trailing 2R dims)

A fully masked row is well defined: the sink takes all the mass and the output is 0, as in HF.
The reference below is also the CPU implementation; it spells the HF roundings out one by one.
"""

from __future__ import annotations

from typing import Optional

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
POSITION_DTYPES = (torch.int32, torch.int64)


def _visible(q_positions, kv_positions, compressed, indices, window, compress_rate):
    """[B, S, N + T] bool: which keys each query sees (window rows, then compressed entries)."""
    delta = q_positions.unsqueeze(-1) - kv_positions.unsqueeze(1)
    seen = (kv_positions.unsqueeze(1) >= 0) & (delta >= 0) & (delta < window)
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
                                   compress_rate, cos=None, sin=None):
    """Plain PyTorch V4 attention in HF's order of roundings; returns [B, S, H, D] in q's dtype."""
    B, S, H, D = q.shape
    keys = kv if compressed is None else torch.cat([kv, compressed], dim=1)
    logits = torch.matmul(q.transpose(1, 2), keys.unsqueeze(1).transpose(-1, -2)) * scale  # [B, H, S, N + T]
    visible = _visible(q_positions, kv_positions, compressed, indices, window, compress_rate)
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
              check_values: bool) -> None:
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
    devices = {t.device for t in (q, kv, q_positions, kv_positions, sinks, compressed, indices, cos, sin)
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


@torch.library.custom_op("dsfuse::compressed_attention", mutates_args=())
def compressed_attention(q: torch.Tensor, kv: torch.Tensor, q_positions: torch.Tensor, kv_positions: torch.Tensor,
                         compressed: Optional[torch.Tensor], indices: Optional[torch.Tensor], sinks: torch.Tensor,
                         scale: float, window: int, compress_rate: int, cos: Optional[torch.Tensor],
                         sin: Optional[torch.Tensor]) -> torch.Tensor:
    """V4 attention output [B, S, H, D] in q's dtype (reference math on CPU)."""
    _validate(q, kv, q_positions, kv_positions, compressed, indices, sinks, window, compress_rate, cos, sin,
              check_values=True)
    return compressed_attention_reference(q, kv, q_positions, kv_positions, compressed, indices, sinks, scale, window,
                                          compress_rate, cos, sin)


@compressed_attention.register_fake
def _compressed_attention_fake(q, kv, q_positions, kv_positions, compressed, indices, sinks, scale, window,
                               compress_rate, cos, sin):
    _validate(q, kv, q_positions, kv_positions, compressed, indices, sinks, window, compress_rate, cos, sin,
              check_values=False)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


__all__ = ["compressed_attention", "compressed_attention_reference", "inverse_rope_reference"]
