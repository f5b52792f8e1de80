"""dsfuse's own official-style DeepSeek model: numerics helpers, attention forms, MoE, cache and compile."""

import math

import pytest
import torch
import torch.nn.functional as F

from dsfuse.models.official import (
    E2M1_VALUES,
    DsfuseDeepseekConfig,
    apply_rope_half_split,
    apply_rope_interleaved,
    build_own_model,
    dequantize_fp4,
    e8m0_to_float32,
    parameter_count,
    quantize_fp4,
    quantize_fp8_blockwise,
    rms_norm_hf,
    rms_norm_official,
    rope_frequencies,
)


def scalar_e2m1(nibble: int) -> float:
    """E2M1 from its bit fields: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign = -1.0 if nibble & 0b1000 else 1.0
    exponent = (nibble >> 1) & 0b11
    mantissa = nibble & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1.0 + 0.5 * mantissa) * 2.0 ** (exponent - 1)
    return sign * magnitude


def scalar_fp4_decode(byte: int, scale_byte: int) -> tuple[float, float]:
    """The (even, odd) elements a packed byte holds, scaled by E8M0 `scale_byte` (255 = NaN)."""
    if scale_byte == 255:
        return math.nan, math.nan
    return tuple(math.ldexp(scalar_e2m1(nibble), scale_byte - 127) for nibble in (byte & 0xF, byte >> 4))


@pytest.fixture(scope="module")
def tiny_model():
    return build_own_model("own-tiny", seed=0)


def test_e2m1_table_matches_bit_fields():
    assert E2M1_VALUES == tuple(scalar_e2m1(n) for n in range(16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_dequant_is_bit_exact_for_every_byte_and_exponent(dtype):
    exponents = list(range(256))
    # Each expert holds one exponent; each 16-byte row holds all 256 bytes across its 16 rows (K = 32: one scale).
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16).expand(len(exponents), 16, 16).contiguous()
    scales = torch.tensor(exponents, dtype=torch.uint8).view(-1, 1, 1).expand(-1, 16, 1).contiguous()
    decoded = dequantize_fp4(packed, scales, dtype)

    expected = [[value for byte in range(256) for value in scalar_fp4_decode(byte, exponent)] for exponent in exponents]
    expected = torch.tensor(expected, dtype=torch.float64).view(len(exponents), 16, 32).to(dtype)
    torch.testing.assert_close(decoded, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(decoded), torch.signbit(expected)), "signed zeros must keep their sign"

    chosen = {0: 2.0**-127, 1: 2.0**-126, 126: 0.5, 127: 1.0, 128: 2.0, 254: 2.0**127}
    for exponent, scale in chosen.items():
        assert e8m0_to_float32(torch.tensor([exponent], dtype=torch.uint8)).item() == scale
    assert torch.isnan(decoded[255]).all()
    byte_0x80 = decoded[127, 8, 0:2]  # low nibble 0 (+0), high nibble 8 (-0)
    assert byte_0x80.tolist() == [0.0, 0.0] and torch.signbit(byte_0x80).tolist() == [False, True]


def test_fp4_dequant_rejects_mismatched_scales():
    with pytest.raises(ValueError, match="do not match"):
        dequantize_fp4(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8), torch.float32)
    with pytest.raises(TypeError, match="uint8"):
        dequantize_fp4(torch.zeros(2, 4, 16), torch.zeros(2, 4, 1, dtype=torch.uint8), torch.float32)


def test_quantize_fp4_round_trips_representable_weights_and_rounds_others():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 8, 64), generator=generator)
    block_exponents = torch.randint(-20, 20, (3, 8, 2), generator=generator)
    codes[..., ::32] = 7  # make 6 * 2^e each block's amax so the chosen scale is exactly 2^e
    exact = torch.tensor(E2M1_VALUES)[codes] * torch.exp2(block_exponents.float()).repeat_interleave(32, -1)
    packed, scales = quantize_fp4(exact)
    assert packed.shape == (3, 8, 32) and scales.shape == (3, 8, 2)
    assert torch.equal(scales.long() - 127, block_exponents)
    assert torch.equal(dequantize_fp4(packed, scales, torch.float32), exact)

    weight = torch.randn(4, 16, 64, generator=generator)
    approx = dequantize_fp4(*quantize_fp4(weight), torch.float32)
    block_amax = weight.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    # A step of E2M1 is at most 2 (between 4 and 6) at a scale where amax <= 6, so the error is <= amax / 3.
    error = (approx - weight).abs().unflatten(-1, (-1, 32))
    assert (error <= block_amax / 3 + 1e-12).all()
    assert (approx - weight).abs().mean() < 0.15 * weight.abs().mean()


def test_rms_norm_official_and_hf_round_differently_in_bf16():
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RMSNorm

    from dsfuse.models.official import DsfuseRMSNorm

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(256, generator=generator)).to(torch.bfloat16)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)

    official = rms_norm_official(x, weight, 1e-6)
    hf = rms_norm_hf(x, weight, 1e-6)
    assert torch.equal(official, (normed * weight.float()).to(torch.bfloat16))  # one rounding, at the end
    assert torch.equal(hf, weight * normed.to(torch.bfloat16))  # round, multiply in bf16, round again
    assert not torch.equal(official, hf), "the two forms must differ somewhere in bf16"

    hf_module, own_module = DeepseekV32RMSNorm(256, 1e-6), DsfuseRMSNorm(256, 1e-6)
    with torch.no_grad():
        hf_module.weight.copy_(weight.float())
        own_module.weight.copy_(weight.float())
    hf_module, own_module = hf_module.to(torch.bfloat16), own_module.to(torch.bfloat16)
    assert torch.equal(hf_module(x), hf)
    assert torch.equal(own_module(x), official)

    x32 = x.float()
    assert torch.allclose(rms_norm_official(x32, weight.float(), 1e-6), rms_norm_hf(x32, weight.float(), 1e-6))


def test_rope_forms_match_hf_formulas_and_differ_from_each_other():
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    seq, dim = 6, 8
    positions = torch.arange(3, 3 + seq)
    freqs = rope_frequencies(positions, dim, 10000.0)
    angles = torch.cat([freqs.angle(), freqs.angle()], dim=-1)  # HF's cos/sin layout: cat(freqs, freqs)
    cos, sin = angles.cos()[None], angles.sin()[None]
    x = torch.randn(1, seq, 2, dim, dtype=torch.float64).float()

    interleaved = apply_rope_interleaved(x, freqs)
    half_split = apply_rope_half_split(x, freqs)
    hf_interleaved, _ = apply_rotary_pos_emb_interleave(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    hf_half, _ = apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=2)
    # HF de-interleaves its output ([evens, odds]); ours stays interleaved.
    deinterleaved = torch.cat([interleaved[..., 0::2], interleaved[..., 1::2]], dim=-1)
    torch.testing.assert_close(deinterleaved, hf_interleaved.transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(half_split, hf_half, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(interleaved, half_split, atol=1e-3)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_blockwise_quantisation(scale_fmt):
    x = torch.randn(3, 4, 256) * torch.tensor([1e-3, 1.0, 50.0, 0.0]).view(1, 4, 1)
    q, scale = quantize_fp8_blockwise(x, 128, scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (3, 4, 2)
    amax = x.unflatten(-1, (2, 128)).abs().amax(-1).clamp(min=1e-4)
    if scale_fmt is None:
        torch.testing.assert_close(scale, amax / 448, rtol=0, atol=0)
    else:
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale), "ue8m0 scales are powers of two"
        assert (scale >= amax / 448).all() and (scale < 2 * amax / 448).all()
    restored = q.float().unflatten(-1, (2, 128)) * scale.unsqueeze(-1)
    # Half of e4m3's widest step (32, between 256 and 448) times the block's scale bounds the rounding error.
    assert ((restored - x.unflatten(-1, (2, 128))).abs() <= 16 * scale.unsqueeze(-1)).all()
    assert q[:, 3].float().abs().max() == 0  # an all-zero row stays zero (amax clamped at 1e-4)


def test_presets_build_deterministically_and_keep_router_fp32(tiny_model):
    again = build_own_model("own-tiny", seed=0)
    other = build_own_model("own-tiny", seed=1)
    state, again_state, other_state = tiny_model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], again_state[k]) for k in state)
    assert not torch.equal(state["lm_head.weight"], other_state["lm_head.weight"])
    assert not torch.equal(
        state["model.layers.1.mlp.experts.gate_up_proj"], other_state["model.layers.1.mlp.experts.gate_up_proj"]
    )

    bf16 = build_own_model("own-tiny", dtype=torch.bfloat16)
    assert bf16.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert bf16.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.uint8
    assert bf16(torch.zeros(1, 4, dtype=torch.long)).logits.dtype == torch.bfloat16

    with pytest.raises(ValueError, match="own-tiny"):
        build_own_model("nope")
    with pytest.raises(ValueError, match="scale_fmt"):
        DsfuseDeepseekConfig(scale_fmt="e5m2")


def test_real_preset_has_about_14b_weights():
    model = build_own_model("own-v32-2l", dtype=torch.bfloat16, device="meta")
    assert 13.5e9 < parameter_count(model) < 14.5e9
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (256, 4096, 3584)
    assert experts.down_proj_scale.shape == (256, 7168, 64)


def dense_reference_attention(attn, x, freqs):
    """Non-absorbed MLA: per-head keys/values from kv_b_proj, all keys outside the indexer's pick masked."""
    batch, seq, _ = x.shape
    heads, nope, rope, vdim = attn.num_heads, attn.nope_dim, attn.rope_dim, attn.v_dim
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(batch, seq, heads, nope + rope)
    q_nope, q_pe = q.split([nope, rope], -1)
    q_pe = apply_rope_interleaved(q_pe, freqs)
    kv, k_pe = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rope], -1)
    kv = attn.kv_a_layernorm(kv)
    k_pe = apply_rope_interleaved(k_pe.unsqueeze(2), freqs)
    k_nope, value = attn.kv_b_proj(kv).view(batch, seq, heads, nope + vdim).split([nope, vdim], -1)
    keys = torch.cat([k_nope, k_pe.expand(-1, -1, heads, -1)], -1)
    queries = torch.cat([q_nope, q_pe], -1)
    scores = torch.einsum("bshd,bthd->bhst", queries, keys) * attn.softmax_scale

    indices = attn.indexer(x, attn.q_a_layernorm(attn.q_a_proj(x)), freqs, 0, None)
    selected = torch.zeros(batch, seq, seq + 1, dtype=torch.bool)
    selected.scatter_(-1, torch.where(indices < 0, seq, indices), True)
    scores = scores.masked_fill(~selected[..., :seq].unsqueeze(1), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), value)
    return attn.o_proj(out.flatten(2)), indices


def test_absorbed_sparse_attention_equals_dense_masked_reference(tiny_model):
    attn = tiny_model.model.layers[0].self_attn
    seq = 20
    x = torch.randn(2, seq, 64)
    freqs = rope_frequencies(torch.arange(seq), attn.rope_dim, 10000.0)
    with torch.no_grad():
        expected, indices = dense_reference_attention(attn, x, freqs)
        actual = attn(x, freqs, 0, None)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)

    assert indices.shape == (2, seq, 8)
    for row in range(seq):
        picked = indices[:, row]
        valid = picked[picked >= 0]
        assert (picked >= 0).sum(-1).tolist() == [min(8, row + 1)] * 2, "every visible key up to top-k is picked"
        assert (valid <= row).all()
        for b in range(2):
            chosen = picked[b][picked[b] >= 0]
            assert chosen.unique().numel() == chosen.numel()


def test_indexer_scores_equal_the_dequantised_fp8_formula(tiny_model):
    """relu(s_q s_k q8·k8) = s_q s_k relu(q8·k8) for positive scales, so scoring the dequantised fp8 values must
    select keys with the same scores as the factored official form."""
    indexer = tiny_model.model.layers[0].self_attn.indexer
    generator = torch.Generator().manual_seed(5)
    seq = 16
    x, q_latent = torch.randn(2, seq, 64, generator=generator), torch.randn(2, seq, 32, generator=generator)
    freqs = rope_frequencies(torch.arange(seq), 8, 10000.0)
    with torch.no_grad():
        picks = indexer(x, q_latent, freqs, 0, None)
        q = indexer._rope_first_dims(indexer.wq_b(q_latent).view(2, seq, 4, 32), freqs)
        k = indexer._rope_first_dims(indexer.k_norm(indexer.wk(x)).unsqueeze(2), freqs).squeeze(2)
        q8, q_scale = quantize_fp8_blockwise(q, 32)
        k8, k_scale = quantize_fp8_blockwise(k, 32)
        per_head = F.relu(torch.einsum("bshd,btd->bsht", q8.float() * q_scale, k8.float() * k_scale)) * 32**-0.5
        head_weights = indexer.weights_proj(x).float() * 4**-0.5
        scores = torch.einsum("bsht,bsh->bst", per_head, head_weights)
        scores = scores + torch.full((seq, seq), float("-inf")).triu(1)
    expected = scores.topk(8, dim=-1).values
    picked = scores.gather(-1, picks.clamp(min=0)).masked_fill(picks < 0, float("-inf"))
    torch.testing.assert_close(picked.sort(-1, descending=True).values, expected, rtol=1e-5, atol=1e-6)


def test_attention_sink_only_enters_the_denominator():
    model = build_own_model("own-tiny", seed=0, attn_sink=True)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 10, 64)
    freqs = rope_frequencies(torch.arange(10), attn.rope_dim, 10000.0)
    with torch.no_grad():
        attn.attn_sink.fill_(-1e4)
        without = attn(x, freqs, 0, None)
        plain = build_own_model("own-tiny", seed=0).model.layers[0].self_attn(x, freqs, 0, None)
        attn.attn_sink.fill_(1e4)
        swamped = attn(x, freqs, 0, None)
    torch.testing.assert_close(without, plain, rtol=1e-6, atol=1e-6)
    # A dominant sink takes all probability mass: P·V is ~0 and only o_proj's zero input remains.
    assert swamped.abs().max() < 1e-6


def test_moe_matches_a_per_expert_loop(tiny_model):
    moe = tiny_model.model.layers[1].mlp
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        actual = moe(x)
        flat = x.view(-1, 64)
        weights, indices = moe.gate(flat)
        gate_up = dequantize_fp4(moe.experts.gate_up_proj, moe.experts.gate_up_proj_scale, torch.float32)
        down = dequantize_fp4(moe.experts.down_proj, moe.experts.down_proj_scale, torch.float32)
        expected = torch.zeros_like(flat)
        for token in range(flat.shape[0]):
            for slot in range(indices.shape[1]):
                expert = indices[token, slot]
                gate, up = (gate_up[expert] @ flat[token]).chunk(2)
                expected[token] += weights[token, slot] * (down[expert] @ (F.silu(gate) * up))
        expected = expected.view_as(x) + moe.shared_experts(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert weights.shape == (14, 2)
    torch.testing.assert_close(weights.sum(-1), torch.full((14,), 2.5))
    groups = indices // 4
    assert (groups[:, 0] == groups[:, 1]).all(), "topk_group=1 keeps both experts in one group"


def test_grouped_and_batched_expert_gemms_agree():
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        grouped = build_own_model("own-tiny", expert_gemm="grouped_mm")(ids).logits
        batched = build_own_model("own-tiny", expert_gemm="batched_mm")(ids).logits
    torch.testing.assert_close(grouped, batched, rtol=1e-5, atol=1e-6)


def test_decode_with_cache_equals_full_prefill(tiny_model):
    ids = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = tiny_model(ids).logits
        cache = tiny_model.new_cache()
        prefill = tiny_model(ids[:, :12], cache=cache).logits
        step1 = tiny_model(ids[:, 12:13], cache=cache).logits
        step2 = tiny_model(ids[:, 13:14], cache=cache).logits
    assert cache.get_seq_length() == 14
    assert cache.layers[0].index_k.dtype == torch.float8_e4m3fn and cache.layers[0].index_k_scale.shape == (2, 14)
    torch.testing.assert_close(prefill, full[:, :12], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step1[:, 0], full[:, 12], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step2[:, 0], full[:, 13], rtol=1e-5, atol=1e-5)


def test_sparsity_is_active_when_sequence_exceeds_topk(tiny_model):
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    dense = build_own_model("own-tiny", seed=0, index_topk=64)
    with torch.no_grad():
        sparse_logits, dense_logits = tiny_model(ids).logits, dense(ids).logits
    torch.testing.assert_close(sparse_logits[:, :8], dense_logits[:, :8], rtol=1e-5, atol=1e-5)
    assert (sparse_logits[:, 8:] - dense_logits[:, 8:]).abs().max() > 1e-4


@pytest.mark.slow
def test_prefill_compiles_fullgraph_and_matches_eager(tiny_model):
    torch._dynamo.reset()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(tiny_model, backend="inductor", fullgraph=True)
    with torch.no_grad():
        expected = tiny_model(ids).logits
        actual = compiled(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
