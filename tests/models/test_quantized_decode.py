"""Decode steps of a released-format FP8 V3.2 checkpoint (random weights, CPU): dsfuse reads the latent cache in
absorbed form with the FP8 kv_b_proj dequantised, where eager expands every cached latent through the W8A8 linear."""

import pytest
import torch

import dsfuse
from dsfuse.models.quantized import load_quantized_model, write_fp8_checkpoint

# Eager quantises the cached latents to e4m3 per 128 channels before kv_b_proj; the absorbed form multiplies the
# latents by the exact dequantised weight. On these random tiny weights W8A8's activation rounding alone moves a
# decode step's logits ~7 % (relative L2, eager FP8 against eager dequantised); dsfuse sits ~6 % from eager FP8.
# The bound is the W8A8 one of tests/models/test_quantized.py.
ABSORBED_FP8_BOUND = 0.15


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8-tiny-decode")
    write_fp8_checkpoint(path, "fp8-tiny", scale_fmt="ue8m0")
    return load_quantized_model(path, dtype=torch.float32, attn_implementation="sdpa")


def test_fp8_decode_is_absorbed_with_the_weight_dequantised(model):
    from transformers import DynamicCache

    dsfuse.reset_report()
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="dsfuse")
    eager_cache, fused_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    worst = 0.0
    with torch.no_grad():
        model(ids, past_key_values=eager_cache, use_cache=True)
        model(ids, past_key_values=fused_cache, use_cache=True)
        token = ids[:, -1:]
        for _ in range(2):
            expected = model(token, past_key_values=eager_cache, use_cache=True).logits
            out = compiled(token, past_key_values=fused_cache, use_cache=True).logits
            worst = max(worst, ((out - expected).norm() / expected.norm()).item())
            token = expected.argmax(-1)
    rep = dsfuse.report()
    sites = [s for s in rep.sites if s.pass_name == "sparse_attention"]
    assert sites and {s.op for s in sites} == {"dsfuse.absorbed_mla_attention"}, str(rep)
    assert all("FP8 kv_b_proj dequantised" in s.detail for s in sites), str(rep)
    assert not rep.near_misses, str(rep)
    assert worst < ABSORBED_FP8_BOUND, worst
