"""HF `DeepseekV32ForCausalLM` presets: build speed, determinism, dtypes and implementation selection."""

import time

import pytest
import torch

from dsfuse.models.presets import PRESETS, build_hf_model, hf_config


@pytest.fixture(scope="module")
def tiny():
    return build_hf_model("tiny")


def test_tiny_builds_and_runs_quickly(tiny):
    start = time.perf_counter()
    model = build_hf_model("tiny")
    built = time.perf_counter() - start
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(ids).logits
    ran = time.perf_counter() - start
    assert built < 1.0 and ran < 1.0, (built, ran)
    assert logits.shape == (2, 24, 256) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert not model.training
    config = model.config
    assert config.mlp_layer_types == ["dense", "sparse"] and config.index_topk == 8
    assert config.index_head_dim >= config.qk_rope_head_dim


def test_same_seed_same_weights_other_seed_other_weights(tiny):
    again, other = build_hf_model("tiny", seed=0), build_hf_model("tiny", seed=1)
    state = tiny.state_dict()
    assert all(torch.equal(value, again.state_dict()[key]) for key, value in state.items())
    assert not torch.equal(state["lm_head.weight"], other.state_dict()["lm_head.weight"])
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(state[experts], other.state_dict()[experts])


def test_build_does_not_disturb_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_hf_model("tiny")
    assert torch.equal(torch.rand(3), expected)


def test_bf16_keeps_router_in_fp32():
    model = build_hf_model("tiny", dtype=torch.bfloat16)
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(torch.zeros(1, 5, dtype=torch.long)).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_implementations_are_selectable_and_agree(tiny, experts, attention):
    model = build_hf_model("tiny", experts_implementation=experts, attn_implementation=attention)
    assert model.config._experts_implementation == experts
    assert model.config._attn_implementation == attention
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny(ids).logits, rtol=1e-5, atol=1e-5)


def test_sequences_longer_than_index_topk_are_sparse(tiny):
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    dense = build_hf_model("tiny", index_topk=64)
    with torch.no_grad():
        sparse_logits, dense_logits = tiny(ids).logits, dense(ids).logits
    torch.testing.assert_close(sparse_logits[:, :8], dense_logits[:, :8], rtol=1e-5, atol=1e-5)
    assert (sparse_logits[:, 8:] - dense_logits[:, 8:]).abs().max() > 1e-4


def test_unknown_names_raise_with_the_valid_choices():
    with pytest.raises(ValueError, match="tiny.*v32-real-2l"):
        build_hf_model("huge")
    with pytest.raises(ValueError, match="grouped_mm"):
        build_hf_model("tiny", experts_implementation="loop")
    with pytest.raises(ValueError, match="sdpa"):
        hf_config("tiny", attn_implementation="flash")


def test_overrides_and_layer_count():
    config = hf_config("tiny", num_hidden_layers=3, first_k_dense_replace=1)
    assert config.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert PRESETS["tiny"]["num_hidden_layers"] == 2, "overrides must not mutate the registry"


def test_real_preset_dims_and_size():
    model = build_hf_model("v32-real-2l", dtype=torch.bfloat16, device="meta")
    config = model.config
    assert (config.hidden_size, config.num_attention_heads, config.kv_lora_rank, config.index_topk) == (
        7168,
        128,
        512,
        2048,
    )
    assert 13.5e9 < sum(p.numel() for p in model.parameters()) < 14.5e9
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16


def test_v4_presets_build_deepseek_v4_with_every_attention_kind():
    from dsfuse.models.presets import V4_PRESETS, build_hf_model, hf_config

    model = build_hf_model("v4-tiny")
    assert type(model).__name__ == "DeepseekV4ForCausalLM"
    assert model.config._attn_implementation == "eager"
    assert set(model.config.layer_types) == {
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (2, 19)), use_cache=False).logits
    assert logits.shape == (2, 19, 256) and torch.isfinite(logits).all()
    real = hf_config("v4-flash-real-2l")
    assert (real.hidden_size, real.num_attention_heads, real.head_dim, real.index_topk) == (4096, 64, 512, 512)
    assert real.qk_rope_head_dim == 64 and sorted(V4_PRESETS) == ["v4-flash-real-2l", "v4-fp8-tiny", "v4-tiny"]
    with pytest.raises(ValueError, match="valid: eager"):
        hf_config("v4-tiny", attn_implementation="flash_attention_2")


def test_v4_preset_runs_in_bf16_with_hf_fp32_modules():
    from dsfuse.models.presets import build_hf_model

    model = build_hf_model("v4-tiny", dtype=torch.bfloat16, num_hidden_layers=1,
                           layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    assert model.model.layers[0].attn_hc.fn.dtype == torch.float32  # HF's _keep_in_fp32_modules_strict
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (1, 11)), use_cache=False).logits
    assert torch.isfinite(logits).all()
