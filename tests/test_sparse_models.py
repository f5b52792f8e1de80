"""`sparse_attention` on the tiny real models: one rewrite per layer, indices from the fused indexer or
from a plain top-k, and parity with eager (four model compiles in all)."""

import torch

import dsfuse
from dsfuse.models.presets import build_hf_model

SEQ = 20  # > index_topk (8), so the selection really drops keys


def _hf_inputs(model):
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :3] = 0  # left padding on the second row
    return ids, mask


def _sparse_sites():
    return [s for s in dsfuse.report().sites if s.pass_name == "sparse_attention"]


def test_hf_tiny_sdpa_fp32_uses_fused_indexer_indices():
    model = build_hf_model("tiny", attn_implementation="sdpa")
    ids, mask = _hf_inputs(model)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        out = torch.compile(model, backend="dsfuse")(input_ids=ids, attention_mask=mask).logits
    rep = dsfuse.report()
    layers = model.config.num_hidden_layers
    assert rep.counts["indexer_topk"] == layers and rep.counts["sparse_attention"] == layers, str(rep)
    assert [m for m in rep.near_misses if m.pass_name == "sparse_attention"] == [], str(rep)
    for site in _sparse_sites():
        assert site.op == "dsfuse.sparse_attention_masked"
        assert site.detail.startswith("decomposed SDPA, bool mask, K=8"), site.detail
        assert site.inputs[3].startswith("indexer_topk") and ":int32[2x20x8]" in site.inputs[3], site.inputs
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_hf_tiny_eager_fp32_with_plain_topk(monkeypatch):
    monkeypatch.setenv("DSFUSE_DISABLE", "indexer_topk")
    model = build_hf_model("tiny", attn_implementation="eager")
    ids, mask = _hf_inputs(model)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        out = torch.compile(model, backend="dsfuse")(input_ids=ids, attention_mask=mask).logits
    rep = dsfuse.report()
    assert rep.counts["indexer_topk"] == 0
    assert rep.counts["sparse_attention"] == model.config.num_hidden_layers, str(rep)
    for site in _sparse_sites():
        assert site.detail.startswith("decomposed softmax, additive mask, K=8"), site.detail
        assert ":int64[2x20x8]" in site.inputs[3], site.inputs
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_own_tiny_bf16_counts_and_parity():
    """dsfuse's own official-style model: the fp8 indexer and the kv[idx] MLA attention, once per layer."""
    from dsfuse.models.official import build_own_model

    model = build_own_model("own-tiny", dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))

    def run(backend):
        torch._dynamo.reset()
        dsfuse.reset_report()
        fn = model if backend is None else torch.compile(model, backend=backend)
        with torch.no_grad():
            return fn(ids).logits.float()

    expected, inductor, out = run(None), run("inductor"), run("dsfuse")
    rep = dsfuse.report()
    assert rep.counts["sparse_attention"] == model.config.num_hidden_layers, str(rep)
    assert rep.counts["indexer_topk"] == model.config.num_hidden_layers, str(rep)
    assert all(s.op == "dsfuse.sparse_mla_attention" for s in _sparse_sites())
    assert all("fp8 k_scale" in s.detail for s in rep.sites if s.pass_name == "indexer_topk")
    inductor_err = ((inductor - expected).norm() / expected.norm()).item()
    dsfuse_err = ((out - expected).norm() / expected.norm()).item()
    assert dsfuse_err <= max(2e-2, 1.25 * inductor_err), (dsfuse_err, inductor_err)
