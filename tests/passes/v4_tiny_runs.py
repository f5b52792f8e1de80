"""v4-tiny's CSA-then-HCA model in bf16, compiled once with every pass, for the pass tests that read its logits and
report. Tests marked `SHARED_BF16` run on one pytest-xdist worker, which compiles it once."""

import functools

import pytest
import torch

import dsfuse
from dsfuse.models.presets import build_hf_model

CSA_THEN_HCA = dict(num_hidden_layers=2, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                    mlp_layer_types=["moe", "moe"], hc_sinkhorn_iters=2)
SHARED_BF16 = pytest.mark.xdist_group("v4_tiny_csa_hca_bf16")


@functools.cache
def csa_then_hca_bf16():
    """(model, ids, eager logits, dsfuse logits, report) at batch 2 and 33 tokens (odd, so that pad_mm would pad the
    products: see inductor_forms.pad_matmuls)."""
    model = build_hf_model("v4-tiny", dtype=torch.bfloat16, **CSA_THEN_HCA)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    dsfuse.reset_report()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend="dsfuse")(ids).logits
    report = dsfuse.report()
    torch._dynamo.reset()
    dsfuse.reset_report()
    return model, ids, eager, compiled, report
