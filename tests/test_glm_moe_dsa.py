"""transformers' `GlmMoeDsaForCausalLM` (a DSA relative of V3.2) at the tiny preset's dims: every family rewrites on
every layer with no near-miss, and the logits match eager."""

import torch
from transformers import GlmMoeDsaForCausalLM

import dsfuse
from dsfuse.models.presets import build_hf_model


def test_glm_moe_dsa_tiny_rewrites_every_family_and_matches_eager():
    model = build_hf_model("glm-tiny")
    config = model.config
    assert isinstance(model, GlmMoeDsaForCausalLM)
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
