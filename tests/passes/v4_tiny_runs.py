"""v4-tiny's CSA-then-HCA model compiled once with every pass, in bf16 and in fp32 at dynamic lengths, for the pass
tests that read its logits and report. Tests marked `SHARED_BF16` (`SHARED_FP32`) run on one pytest-xdist worker,
which compiles the model once."""

import functools

import pytest
import torch

import dsfuse
from dsfuse.models.presets import build_hf_model

CSA_THEN_HCA = dict(num_hidden_layers=2, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                    mlp_layer_types=["moe", "moe"], hc_sinkhorn_iters=2)
SHARED_BF16 = pytest.mark.xdist_group("v4_tiny_csa_hca_bf16")
SHARED_FP32 = pytest.mark.xdist_group("v4_tiny_csa_hca_fp32")
FP32_SINKHORN_ITERS = 3


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


@functools.cache
def csa_then_hca_fp32_dynamic():
    """([(dsfuse logits, eager logits) per call], report): fp32, 3 Sinkhorn iterations, batch 2 at 21, 29 and 37
    tokens, the length marked dynamic from the first call (one graph serves them all). The lengths are odd, one is
    S % 8 = 5 (the graph guards on S % 4 only), and S // 4 > index_topk."""
    model = build_hf_model("v4-tiny", dtype=torch.float32, **{**CSA_THEN_HCA, "hc_sinkhorn_iters": FP32_SINKHORN_ITERS})
    compiled = torch.compile(model, backend="dsfuse")
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    dsfuse.reset_report()
    calls = []
    with torch.no_grad():
        for length in (21, 29, 37):
            ids = torch.randint(0, 256, (2, length), generator=gen)
            torch._dynamo.mark_dynamic(ids, 1)
            calls.append((compiled(ids).logits, model(ids).logits))
    report = dsfuse.report()
    torch._dynamo.reset()
    dsfuse.reset_report()
    return calls, report
