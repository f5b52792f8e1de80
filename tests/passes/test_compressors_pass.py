"""`compressors` on HF `DeepseekV4ForCausalLM` (v4-tiny, a CSA then an HCA layer) and on small graphs written with
HF's functions: exact site counts per layer, parity with eager, symbolic sequence lengths, near-misses with their
reasons."""

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb
from v4_tiny_runs import SHARED_BF16, SHARED_FP32, csa_then_hca_bf16, csa_then_hca_fp32_dynamic

import dsfuse

# Per layer: the CSA layer's indexer compressor (index_head_dim 16) and its own (head_dim 32, two series of 2m = 8
# slots); the HCA layer's (m' = 8 slots, one series). RoPE on the trailing 8 channels (partial_rotary_factor 0.25).
EXPECTED = sorted(["m=4 D=16 R=8, two overlapping series", "m=4 D=32 R=8, two overlapping series",
                   "m=8 D=32 R=8, one series"])


def _details(report, graph=None):
    return sorted(s.detail for s in report.sites if s.pass_name == "compressors" and graph in (None, s.graph))


@SHARED_FP32
def test_v4_tiny_counts_parity_batch_two_and_dynamic_lengths():
    """fp32, every pass, batch 2, lengths not multiples of m (the tail is dropped): one graph with a symbolic length
    serves every length, 3 compressors rewritten, logits equal eager."""
    calls, rep = csa_then_hca_fp32_dynamic()
    for compiled, eager in calls:
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert len(rep.graphs) == 1, str(rep)
    assert _details(rep, 0) == EXPECTED, str(rep)
    assert rep.counts["compressors"] == 3 and not rep.near_misses, str(rep)


@SHARED_BF16
def test_v4_tiny_bf16_with_every_family():
    """bf16, every pass on: the compressors are rewritten beside the indexer and attention that read their
    entries, and the logits stay within bf16 noise of eager."""
    _, _, expected, out, rep = csa_then_hca_bf16()
    expected, out = expected.float(), out.float()
    assert _details(rep) == EXPECTED, str(rep)
    assert rep.counts["indexer_topk"] == 1 and rep.counts["sparse_attention"] == 2, str(rep)
    assert not rep.near_misses, str(rep)
    assert (out - expected).abs().max() < 0.1 * expected.abs().max(), (out - expected).abs().max()


# --------------------------------------------------------------------------------------------
# Small graphs: HCA's compressor written with HF's code, and near-misses
# --------------------------------------------------------------------------------------------
def _hca(kv, gate, bias, weight, cos, sin, m, form="hf"):
    """`DeepseekV4HCACompressor.forward`'s math on given projections (cache None); `form` breaks one part."""
    B, S, D = kv.shape
    W = S // m
    chunk_kv = kv[:, :W * m].view(B, W, m, -1)
    chunk_gate = gate[:, :W * m].view(B, W, m, -1) + (bias if form != "no_bias" else 0.0)
    pooled = (chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=2)
    if form == "no_norm":
        return pooled * 2
    x = pooled.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    normed = (weight * x).to(pooled.dtype)
    return apply_rotary_pos_emb(normed.unsqueeze(1), cos[:, :W], sin[:, :W]).squeeze(1)


def _small_inputs(S=19, m=4, D=16, R=8):
    g = torch.Generator().manual_seed(0)
    kv, gate = torch.randn(2, S, D, generator=g), torch.randn(2, S, D, generator=g)
    angles = torch.rand(2, S, R // 2, generator=g)
    return kv, gate, torch.randn(m, D, generator=g), torch.rand(D, generator=g) + 0.5, angles.cos(), angles.sin()


def test_hf_code_on_given_projections_is_rewritten():
    args = _small_inputs()
    out = torch.compile(lambda *a: _hca(*a, m=4), backend="dsfuse")(*args)
    assert _details(dsfuse.report()) == ["m=4 D=16 R=8, one series"], str(dsfuse.report())
    torch.testing.assert_close(out, _hca(*args, m=4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form, reason", [
    ("no_norm", "the pooled entries are not RMS-normalised as HF's DeepseekV4RMSNorm"),
    ("no_bias", "has no [m, C] position bias added to its windows"),
])
def test_near_misses_say_why(form, reason):
    args = _small_inputs()
    out = torch.compile(lambda *a: _hca(*a, m=4, form=form), backend="dsfuse")(*args)
    rep = dsfuse.report()
    assert rep.counts["compressors"] == 0, str(rep)
    assert [miss.reason for miss in rep.near_misses if miss.pass_name == "compressors"] and all(
        reason in miss.reason for miss in rep.near_misses if miss.pass_name == "compressors"), str(rep)
    torch.testing.assert_close(out, _hca(*args, m=4, form=form), rtol=1e-5, atol=1e-5)
