"""transformers' `GlmMoeDsaForCausalLM` (a DSA relative of V3.2) at the tiny preset's dims: every family rewrites on
every layer with no near-miss, and the logits match eager."""

import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

import dsfuse
from dsfuse.models.presets import preset_kwargs, seeded_build


def test_glm_moe_dsa_tiny_rewrites_every_family_and_matches_eager():
    fields = GlmMoeDsaConfig.__dataclass_fields__
    config = GlmMoeDsaConfig(**{k: v for k, v in preset_kwargs("tiny").items() if k in fields})
    model = seeded_build(lambda: GlmMoeDsaForCausalLM._from_config(
        config, dtype=torch.float32, attn_implementation="sdpa", experts_implementation="grouped_mm"),
        seed=0, device="cpu", dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        out = torch.compile(model, backend="dsfuse")(ids).logits
    report = dsfuse.report()
    layers, moe_layers = config.num_hidden_layers, sum(t == "sparse" for t in config.mlp_layer_types)
    assert report.counts == {"norm_rope_quant": 5 * layers, "indexer_topk": layers, "sparse_attention": layers,
                             "moe_experts": moe_layers, "hyper_connections": 0,
                             "compressors": 0}, str(report)
    assert report.near_misses == [], str(report)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
