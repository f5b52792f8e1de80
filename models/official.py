"""dsfuse's own HF-style DeepSeek V3.2/V4 model, written the way DeepSeek's reference inference code computes.

transformers' `DeepseekV32ForCausalLM` expands MLA keys per head, skips the indexer's fp8 quantisation and turns
top-k indices into a dense mask. This model keeps what the official inference code does, so dsfuse's passes can be
developed and tested against those forms too:

- MLA in the absorbed form: `kv_b_proj`'s key half is folded into the query, scores are taken against the shared
  latent, and the value half is applied after P·V over the latent.
- RMSNorm normalises and multiplies its weight in fp32, casting once at the end (HF casts before the weight).
- The indexer quantises q and k to fp8 e4m3 with one scale per 128-block and scores with those fp8 values.
- Sparse attention gathers the selected latent rows (`kv[idx]`) instead of masking a dense score matrix.
- Routed experts are stored as FP4 (E2M1 nibbles + E8M0 per-32 scales) and decoded in forward before
  `torch._grouped_mm`.

Plain PyTorch only (no dsfuse imports), HF config / state-dict naming, and one graph under
`torch.compile(fullgraph=True)` for prefill. Padding masks are not supported: every row is a full causal sequence.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

FP8_E4M3_MAX = 448.0
FP8_BLOCK_SIZE = 128
FP4_BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# The 16 E2M1 codes in order: bit 3 is the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)
# Decode at most this many weight elements at once, so the real-size expert stack (11 B weights) is not
# materialised in fp32 in one piece by eager mode.
DEQUANT_CHUNK_ELEMENTS = 1 << 28
EXPERT_GEMMS = ("auto", "grouped_mm", "batched_mm")


@strict
class DsfuseDeepseekConfig(PreTrainedConfig):
    r"""Configuration of `DsfuseDeepseekForCausalLM`; field names follow `DeepseekV32Config`.

    scale_fmt (`str`, *optional*): `None` for plain fp8 scales (amax / 448) or `"ue8m0"` to round each scale up to
        a power of two, as DeepSeek's deployment does.
    attn_sink (`bool`): add a learned per-head logit to the softmax denominator (V4-style attention sink).
    expert_gemm (`str`): how routed experts multiply: `"grouped_mm"` (`torch._grouped_mm` over expert-sorted rows),
        `"batched_mm"` (each row's expert weights gathered, then `torch.bmm`), or `"auto"`: grouped_mm in bf16 and
        batched_mm otherwise, because `torch._grouped_mm` only traces under `torch.compile` in bf16.
    """

    model_type = "dsfuse_deepseek"

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    scale_fmt: str | None = None
    attn_sink: bool = False
    expert_gemm: str = "auto"
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    max_position_embeddings: int = 163840
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        for name, annotation in DsfuseDeepseekConfig.__annotations__.items():
            value = getattr(self, name)
            if annotation is int and value < 0:
                raise ValueError(f"invalid DsfuseDeepseekConfig: {name} must be non-negative, got {value}")
        problems = []
        if self.scale_fmt not in (None, "ue8m0"):
            problems.append(f"scale_fmt must be None or 'ue8m0', got {self.scale_fmt!r}")
        if self.expert_gemm not in EXPERT_GEMMS:
            problems.append(f"expert_gemm must be one of {', '.join(EXPERT_GEMMS)}, got {self.expert_gemm!r}")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not self.qk_rope_head_dim <= self.index_head_dim <= FP8_BLOCK_SIZE:
            problems.append(
                f"index_head_dim must lie in [qk_rope_head_dim, {FP8_BLOCK_SIZE}] (one fp8 scale per indexer head), "
                f"got {self.index_head_dim}"
            )
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % FP4_BLOCK_SIZE:
                problems.append(f"{name} must be a multiple of {FP4_BLOCK_SIZE} (FP4 scale blocks)")
        if self.n_routed_experts % self.n_group:
            problems.append("n_routed_experts must be divisible by n_group")
        if not self.num_experts_per_tok <= self.n_routed_experts // self.n_group * self.topk_group:
            problems.append("num_experts_per_tok exceeds the experts in the top groups")
        if self.tie_word_embeddings:
            problems.append("tie_word_embeddings must be False")
        if problems:
            raise ValueError("invalid DsfuseDeepseekConfig: " + "; ".join(problems))
        super().__post_init__(**kwargs)


# --- numerics helpers (also the reference definitions the fused kernels are tested against) -------------------


def rms_norm_official(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, multiply the weight in fp32, cast once at the end (DeepSeek's inference code)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' form: normalise in fp32, cast to the input dtype, then multiply the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_frequencies(positions: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """Complex rotations `exp(i * pos * theta^(-2j/d))`, shape `[S, rope_dim // 2]`."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope_interleaved(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs `(x0, x1), (x2, x3), ...` (MLA's layout). `x`: `[B, S, H, D]`, `freqs`: `[S, D/2]`."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rotated = pairs * freqs[None, :, None, :]
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def apply_rope_half_split(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs `(x_j, x_{j+D/2})` (the indexer's non-interleaved layout). Shapes as `apply_rope_interleaved`."""
    halves = x.float().unflatten(-1, (2, -1)).transpose(-1, -2).contiguous()
    rotated = torch.view_as_complex(halves) * freqs[None, :, None, :]
    return torch.view_as_real(rotated).transpose(-1, -2).flatten(-2).to(x.dtype)


def quantize_fp8_blockwise(
    x: torch.Tensor, block_size: int = FP8_BLOCK_SIZE, scale_fmt: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 activation quantisation with one fp32 scale per `block_size` elements of the last dim.

    scale = max(amax, 1e-4) / 448, optionally rounded up to a power of two (`scale_fmt="ue8m0"`); the values are
    `x / scale` cast to e4m3. Returns `(x_fp8 [..., D], scale [..., D // block_size])`.
    """
    width = x.shape[-1]
    if width % block_size:
        raise ValueError(f"last dim {width} is not a multiple of the fp8 block size {block_size}")
    blocks = x.float().unflatten(-1, (width // block_size, block_size))
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    scale = amax / FP8_E4M3_MAX
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    quantized = (blocks / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized.flatten(-2), scale


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes to fp32: `2^(byte - 127)`, byte 255 is NaN."""
    powers = torch.exp2(scales.float() - E8M0_BIAS)
    return torch.where(scales == E8M0_NAN, torch.full_like(powers, float("nan")), powers)


def _dequantize_fp4_chunk(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    low = packed & 0x0F
    high = packed >> 4
    codes = torch.stack([low, high], dim=-1).flatten(-2)
    values = lut[codes.long()]
    scaled = values.unflatten(-1, (-1, FP4_BLOCK_SIZE)) * e8m0_to_float32(scales).unsqueeze(-1)
    return scaled.flatten(-2).to(dtype)


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP4 weights to `dtype`: `packed [E, N, K//2]` uint8 (low nibble = even element), `scales [E, N, K//32]` E8M0.

    Each element is `E2M1[nibble] * 2^(scale - 127)`, exact in fp32 and rounded once to `dtype`. Large stacks are
    decoded a few experts at a time (a static split, so compiled graphs stay single).
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"FP4 weights and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * FP4_BLOCK_SIZE != packed.shape[-1] * 2:
        raise ValueError(f"FP4 scales {tuple(scales.shape)} do not match packed weights {tuple(packed.shape)}")
    if packed.dim() == 3:
        experts_per_chunk = max(1, DEQUANT_CHUNK_ELEMENTS // max(2 * packed[0].numel(), 1))
        if packed.shape[0] > experts_per_chunk:
            chunks = zip(packed.split(experts_per_chunk), scales.split(experts_per_chunk), strict=True)
            return torch.cat([_dequantize_fp4_chunk(p, s, dtype) for p, s in chunks])
    return _dequantize_fp4_chunk(packed, scales, dtype)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `weight [..., N, K]` to FP4: per-32 power-of-two scale with the block amax mapped to at most 6.

    Each value goes to the nearest E2M1 magnitude (ties to the smaller one), keeping its sign. Returns
    `(packed [..., N, K//2] uint8, scales [..., N, K//32] uint8)` in the layout `dequantize_fp4` reads.
    """
    width = weight.shape[-1]
    if width % FP4_BLOCK_SIZE:
        raise ValueError(f"last dim {width} is not a multiple of the FP4 block size {FP4_BLOCK_SIZE}")
    blocks = weight.float().unflatten(-1, (width // FP4_BLOCK_SIZE, FP4_BLOCK_SIZE))
    amax = blocks.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax / E2M1_MAGNITUDES[-1])).clamp(-E8M0_BIAS, E8M0_BIAS)
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
    scaled = blocks / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=weight.device)
    magnitude_code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = (magnitude_code | (torch.signbit(scaled).long() << 3)).to(torch.uint8).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8)


def causal_mask(start_pos: int, num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """Additive `[S, T]` mask: query `i` (at position `start_pos + i`) sees keys `0 .. start_pos + i`."""
    return torch.full((num_queries, num_keys), float("-inf"), device=device).triu_(start_pos + 1)


# --- cache ------------------------------------------------------------------------------------------------------


@dataclass
class LayerCache:
    """One layer's decode state: latent kv `[B, T, kv_lora]`, roped key `[B, T, rope]`, indexer keys (fp8 + scale)."""

    kv: torch.Tensor | None = None
    pe: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    index_k_scale: torch.Tensor | None = None

    @staticmethod
    def _append(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        return new if old is None else torch.cat([old, new], dim=1)

    def append_latent(self, kv: torch.Tensor, pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kv = self._append(self.kv, kv)
        self.pe = self._append(self.pe, pe)
        return self.kv, self.pe

    def append_index_keys(self, k_fp8: torch.Tensor, k_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.index_k = self._append(self.index_k, k_fp8)
        self.index_k_scale = self._append(self.index_k_scale, k_scale)
        return self.index_k, self.index_k_scale


class DsfuseCache:
    """Compressed decode cache: prefill writes every layer, each decode step appends one position."""

    def __init__(self, num_layers: int):
        self.layers = [LayerCache() for _ in range(num_layers)]

    def get_seq_length(self) -> int:
        kv = self.layers[0].kv
        return 0 if kv is None else kv.shape[1]


# --- modules ----------------------------------------------------------------------------------------------------


class DsfuseRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_official(x, self.weight, self.eps)


class DsfuseLayerNorm(nn.Module):
    """LayerNorm computed in fp32 with fp32 weight and bias, cast once at the end."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)


class DsfuseIndexer(nn.Module):
    """Lightning indexer: picks each query's `index_topk` keys from fp8 scores.

    The official code rotates q and k by a Hadamard transform before quantising. The rotation is orthogonal, so
    q·k is unchanged in exact arithmetic; it only spreads outliers before fp8 rounding. It is left out here, which
    keeps the matmul-relu-weight-topk chain the passes match and makes the fp8 rounding act on q and k directly.
    """

    def __init__(self, config: DsfuseDeepseekConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.index_topk = config.index_topk
        self.scale_fmt = config.scale_fmt
        self.softmax_scale = self.head_dim**-0.5
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = DsfuseLayerNorm(self.head_dim)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def _rope_first_dims(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        rope_part, pass_part = torch.split(x, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope_half_split(rope_part, freqs), pass_part], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        freqs: torch.Tensor,
        start_pos: int,
        layer_cache: LayerCache | None,
    ) -> torch.Tensor:
        """Top-k key indices `[B, S, min(index_topk, T)]` (int64); `-1` where the pick is a masked key."""
        batch, seq_len, _ = x.shape
        q = self.wq_b(q_latent).view(batch, seq_len, self.n_heads, self.head_dim)
        q = self._rope_first_dims(q, freqs)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        k = self._rope_first_dims(k, freqs).squeeze(2)

        q_fp8, q_scale = quantize_fp8_blockwise(q, self.head_dim, self.scale_fmt)
        k_fp8, k_scale = quantize_fp8_blockwise(k, self.head_dim, self.scale_fmt)
        k_scale = k_scale.squeeze(-1)
        if layer_cache is not None:
            k_fp8, k_scale = layer_cache.append_index_keys(k_fp8, k_scale)
        num_keys = k_fp8.shape[1]

        head_weights = self.weights_proj(x).float() * self.n_heads**-0.5 * q_scale.squeeze(-1) * self.softmax_scale
        logits = torch.matmul(q_fp8.float(), k_fp8.float().transpose(1, 2).unsqueeze(1))
        scores = (F.relu(logits) * head_weights.unsqueeze(-1)).sum(dim=2)
        scores = scores * k_scale.unsqueeze(1)
        scores = scores + causal_mask(start_pos, seq_len, num_keys, x.device)
        top_scores, top_indices = scores.topk(min(self.index_topk, num_keys), dim=-1)
        return torch.where(top_scores == float("-inf"), torch.full_like(top_indices, -1), top_indices)


class DsfuseAttention(nn.Module):
    """MLA in the absorbed form with DSA sparse attention over gathered latent rows."""

    def __init__(self, config: DsfuseDeepseekConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.softmax_scale = (self.nope_dim + self.rope_dim) ** -0.5
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = DsfuseRMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = DsfuseRMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, config.hidden_size, bias=False)
        self.indexer = DsfuseIndexer(config)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads)) if config.attn_sink else None

    def forward(
        self, x: torch.Tensor, freqs: torch.Tensor, start_pos: int, layer_cache: LayerCache | None
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(batch, seq_len, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        q_pe = apply_rope_interleaved(q_pe, freqs)

        kv, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_a_layernorm(kv)
        k_pe = apply_rope_interleaved(k_pe.unsqueeze(2), freqs).squeeze(2)
        if layer_cache is not None:
            kv, k_pe = layer_cache.append_latent(kv, k_pe)

        kv_b = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        q_absorbed = torch.einsum("bshd,hdc->bshc", q_nope, kv_b[:, : self.nope_dim])

        indices = self.indexer(x, q_latent, freqs, start_pos, layer_cache)
        batch_index = torch.arange(batch, device=x.device)[:, None, None]
        safe_indices = indices.clamp(min=0)
        kv_rows = kv[batch_index, safe_indices]
        pe_rows = k_pe[batch_index, safe_indices]

        scores = (
            torch.einsum("bshc,bskc->bshk", q_absorbed, kv_rows) + torch.einsum("bshr,bskr->bshk", q_pe, pe_rows)
        ) * self.softmax_scale
        scores = scores.float().masked_fill((indices < 0).unsqueeze(2), float("-inf"))
        if self.attn_sink is None:
            probs = scores.softmax(dim=-1)
        else:
            sink = self.attn_sink.float().view(1, 1, -1, 1).expand(batch, seq_len, -1, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        probs = probs.to(x.dtype)

        out_latent = torch.einsum("bshk,bskc->bshc", probs, kv_rows)
        out = torch.einsum("bshc,hdc->bshd", out_latent, kv_b[:, self.nope_dim :])
        return self.o_proj(out.flatten(2))


class DsfuseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DsfuseRouter(nn.Module):
    """V3 router: sigmoid scores, bias-corrected group-limited top-k, weights from the uncorrected scores."""

    def __init__(self, config: DsfuseDeepseekConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [T, H]` → `(weights [T, k] fp32, expert indices [T, k])`."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias
        grouped = biased.view(x.shape[0], self.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        top_groups = group_scores.topk(self.topk_group, dim=-1).indices
        group_keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        biased = grouped.masked_fill(~group_keep.unsqueeze(-1), float("-inf")).flatten(1)
        indices = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.routed_scaling_factor, indices


class DsfuseFp4Experts(nn.Module):
    """Routed SwiGLU experts with FP4 weights: `gate_up_proj [E, 2I, H/2]`, `down_proj [E, H, I/2]` + E8M0 scales."""

    def __init__(self, config: DsfuseDeepseekConfig):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.expert_gemm = config.expert_gemm
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        u8 = torch.uint8
        self.register_buffer("gate_up_proj", torch.zeros(self.num_experts, 2 * inter, hidden // 2, dtype=u8))
        self.register_buffer("gate_up_proj_scale", torch.zeros(self.num_experts, 2 * inter, hidden // 32, dtype=u8))
        self.register_buffer("down_proj", torch.zeros(self.num_experts, hidden, inter // 2, dtype=u8))
        self.register_buffer("down_proj_scale", torch.zeros(self.num_experts, hidden, inter // 32, dtype=u8))

    @torch.no_grad()
    def randomize(self, std: float) -> None:
        """Fill with FP4-rounded N(0, std) weights, one expert at a time to bound the temporary memory."""
        for packed_name in ("gate_up_proj", "down_proj"):
            packed, scales = getattr(self, packed_name), getattr(self, packed_name + "_scale")
            for expert in range(self.num_experts):
                shape = (packed.shape[1], packed.shape[2] * 2)
                weight = torch.randn(shape, device=packed.device, dtype=torch.float32) * std
                packed[expert], scales[expert] = quantize_fp4(weight)

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        """Sort token-expert pairs by expert, two expert GEMMs with SwiGLU between, weight, add back per token."""
        top_k = expert_indices.shape[1]
        flat_experts = expert_indices.reshape(-1)
        sorted_experts, order = torch.sort(flat_experts, stable=True)
        token_of_pair = order // top_k
        counts_input = sorted_experts.float() if x.device.type == "cpu" else sorted_experts.int()
        pairs_per_expert = torch.histc(counts_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(pairs_per_expert, dim=0, dtype=torch.int32)

        use_grouped = self.expert_gemm == "grouped_mm" or (self.expert_gemm == "auto" and x.dtype == torch.bfloat16)

        def expert_matmul(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            if use_grouped:
                return torch._grouped_mm(rows, weights.transpose(1, 2), offs=offsets)
            return torch.bmm(rows.unsqueeze(1), weights[sorted_experts].transpose(1, 2)).squeeze(1)

        gate_up = dequantize_fp4(self.gate_up_proj, self.gate_up_proj_scale, x.dtype)
        gate, up = expert_matmul(x[token_of_pair], gate_up).chunk(2, dim=-1)
        activated = F.silu(gate) * up
        down = dequantize_fp4(self.down_proj, self.down_proj_scale, x.dtype)
        out = expert_matmul(activated, down)
        out = out * expert_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token_of_pair, out)


class DsfuseMoE(nn.Module):
    def __init__(self, config: DsfuseDeepseekConfig):
        super().__init__()
        self.gate = DsfuseRouter(config)
        self.experts = DsfuseFp4Experts(config)
        self.shared_experts = DsfuseMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        routed = self.experts(flat, indices, weights).view_as(x)
        return routed + self.shared_experts(x)


class DsfuseDecoderLayer(nn.Module):
    def __init__(self, config: DsfuseDeepseekConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DsfuseAttention(config, layer_idx)
        if layer_idx < config.first_k_dense_replace:
            self.mlp = DsfuseMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = DsfuseMoE(config)
        self.input_layernorm = DsfuseRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DsfuseRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, freqs: torch.Tensor, start_pos: int, layer_cache: LayerCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), freqs, start_pos, layer_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DsfuseCausalLMOutput(ModelOutput):
    """`logits [B, S, vocab]` and the decode cache (defined here because transformers renamed its cache field)."""

    logits: torch.Tensor | None = None
    cache: DsfuseCache | None = None


class DsfuseDeepseekPreTrainedModel(PreTrainedModel):
    config: DsfuseDeepseekConfig
    config_class = DsfuseDeepseekConfig
    base_model_prefix = "model"
    _no_split_modules = ["DsfuseDecoderLayer"]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        with torch.no_grad():
            if isinstance(module, DsfuseRouter):
                module.weight.normal_(0.0, std)
                module.e_score_correction_bias.zero_()
            elif isinstance(module, DsfuseFp4Experts):
                module.randomize(std)
            elif isinstance(module, DsfuseAttention) and module.attn_sink is not None:
                module.attn_sink.zero_()


class DsfuseDeepseekModel(DsfuseDeepseekPreTrainedModel):
    def __init__(self, config: DsfuseDeepseekConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DsfuseDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DsfuseRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, cache: DsfuseCache | None = None) -> torch.Tensor:
        start_pos = 0 if cache is None else cache.get_seq_length()
        seq_len = input_ids.shape[1]
        positions = torch.arange(start_pos, start_pos + seq_len, device=input_ids.device)
        freqs = rope_frequencies(positions, self.config.qk_rope_head_dim, self.config.rope_theta)
        x = self.embed_tokens(input_ids)
        for layer_idx, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache.layers[layer_idx]
            x = layer(x, freqs, start_pos, layer_cache)
        return self.norm(x)


class DsfuseDeepseekForCausalLM(DsfuseDeepseekPreTrainedModel):
    def __init__(self, config: DsfuseDeepseekConfig):
        super().__init__(config)
        self.model = DsfuseDeepseekModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def new_cache(self) -> DsfuseCache:
        return DsfuseCache(self.config.num_hidden_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: DsfuseCache | None = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
    ) -> DsfuseCausalLMOutput:
        """Logits for `input_ids [B, S]`. With `use_cache`, a new cache is made when none is passed; the cache is
        extended in place and returned as `.cache`. `logits_to_keep=n` keeps only the last n positions."""
        if use_cache and cache is None:
            cache = self.new_cache()
        hidden = self.model(input_ids, cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return DsfuseCausalLMOutput(logits=self.lm_head(hidden), cache=cache)


OWN_PRESETS: dict[str, dict] = {
    "own-tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=512,
    ),
    "own-v32-2l": dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        max_position_embeddings=163840,
    ),
}


def own_config(preset: str = "own-tiny", **overrides) -> DsfuseDeepseekConfig:
    """A `DsfuseDeepseekConfig` from an `OWN_PRESETS` entry with `overrides` on top."""
    if preset not in OWN_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(sorted(OWN_PRESETS))}")
    return DsfuseDeepseekConfig(**{**OWN_PRESETS[preset], **overrides})


def build_own_model(
    preset: str | DsfuseDeepseekConfig = "own-tiny",
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    **overrides,
) -> DsfuseDeepseekForCausalLM:
    """A randomly initialised model in eval mode, built directly on `device`; the same seed gives the same weights.

    The router weight and correction bias stay fp32 whatever `dtype` is, as in HF's DeepSeek models.
    """
    config = preset if isinstance(preset, DsfuseDeepseekConfig) else own_config(preset, **overrides)
    device = torch.device(device)
    previous_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        try:
            torch.set_default_dtype(dtype)
            with torch.device(device):
                model = DsfuseDeepseekForCausalLM(config)
        finally:
            torch.set_default_dtype(previous_dtype)
    config.dtype = dtype
    return model.eval()


def parameter_count(model: nn.Module) -> int:
    """Logical weight count: FP4 buffers count two weights per byte, scales are not counted."""
    total = sum(p.numel() for p in model.parameters())
    for name, buffer in model.named_buffers():
        if buffer.dtype == torch.uint8 and not name.endswith("_scale"):
            total += buffer.numel() * 2
    return total


__all__ = [
    "DsfuseCache",
    "DsfuseDeepseekConfig",
    "DsfuseDeepseekForCausalLM",
    "DsfuseDeepseekModel",
    "DsfuseDeepseekPreTrainedModel",
    "OWN_PRESETS",
    "build_own_model",
    "dequantize_fp4",
    "e8m0_to_float32",
    "own_config",
    "parameter_count",
    "quantize_fp4",
    "quantize_fp8_blockwise",
    "rms_norm_hf",
    "rms_norm_official",
]
