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
    """`DeepseekV4HCACompressor.forward`'s math on given projections (cache None); `form` respells or breaks one
    part."""
    B, S, D = kv.shape
    W = S // m
    chunk_kv = kv[:, :W * m].view(B, W, m, -1)
    windows = gate[:, :W * m].view(B, W, m, -1)
    if form == "bias_twice":
        chunk_gate = windows.add(bias, alpha=2.0)
    else:
        chunk_gate = windows + (bias if form != "no_bias" else 0.0)
    if form == "exp_log_softmax":
        weights = torch.exp(torch.log_softmax(chunk_gate.float(), dim=2))
    elif form == "bf16_softmax_sum":
        e = torch.exp(chunk_gate.float() - chunk_gate.float().amax(dim=2, keepdim=True))
        weights = e / e.sum(dim=2, keepdim=True, dtype=torch.bfloat16)
    else:
        weights = chunk_gate.softmax(dim=2, dtype=torch.float32)
    pooled = (chunk_kv * weights.to(chunk_kv.dtype)).sum(dim=2)
    if form == "no_norm":
        return pooled * 2
    x = pooled.to(torch.float32)
    mean_square = x.pow(2).mean(-1, keepdim=True, dtype=torch.bfloat16 if form == "bf16_mean_square" else None)
    if form == "div_sqrt":
        x = x / torch.sqrt(mean_square + 1e-6)
    elif form == "eps_times_1000":
        x = x * torch.rsqrt(torch.add(mean_square, 1e-6, alpha=1000.0))
    else:
        x = x * torch.rsqrt(mean_square + 1e-6)
    normed = (weight * x).to(pooled.dtype)
    if form in SPELLED_ROPES:
        return torch.cat([normed[..., :-8], SPELLED_ROPES[form](normed[..., -8:], cos[:, :W], sin[:, :W])], dim=-1)
    return apply_rotary_pos_emb(normed.unsqueeze(1), cos[:, :W], sin[:, :W]).squeeze(1)


def _complex_rope(rope, cos, sin):
    pairs = torch.view_as_complex(rope.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * torch.complex(cos.float(), sin.float())).flatten(-2).to(rope.dtype)


def _pairs_rope(rope, cos, sin, odd_sign=1.0):
    """The even / odd channels turned by the angle in fp32; odd_sign -1 turns the odd ones by minus it, which is no
    rotation: no pair of tables gives it."""
    even, odd, c, s = rope[..., 0::2].float(), rope[..., 1::2].float(), cos.float(), sin.float()
    return torch.stack((even * c - odd * s, odd * c + odd_sign * even * s), dim=-1).flatten(-2).to(rope.dtype)


SPELLED_ROPES = {"complex_rope": _complex_rope, "pairs_rope": _pairs_rope,
                 "backwards_rope": lambda rope, cos, sin: _pairs_rope(rope, cos, -sin),
                 "not_a_rotation": lambda rope, cos, sin: _pairs_rope(rope, cos, sin, odd_sign=-1.0)}


def _small_inputs(S=19, m=4, D=16, R=8):
    g = torch.Generator().manual_seed(0)
    kv, gate = torch.randn(2, S, D, generator=g), torch.randn(2, S, D, generator=g)
    angles = torch.rand(2, S, R // 2, generator=g)
    return kv, gate, torch.randn(m, D, generator=g), torch.rand(D, generator=g) + 0.5, angles.cos(), angles.sin()


def test_hf_code_on_given_projections_is_rewritten():
    """One site: the norm + RoPE the compressor's call replaced are dead, and no later family rewrites them again."""
    args = _small_inputs()
    out = torch.compile(lambda *a: _hca(*a, m=4), backend="dsfuse")(*args)
    assert _details(dsfuse.report()) == ["m=4 D=16 R=8, one series"], str(dsfuse.report())
    assert [site.pass_name for site in dsfuse.report().sites] == ["compressors"], str(dsfuse.report())
    torch.testing.assert_close(out, _hca(*args, m=4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form, reason", [
    ("no_norm", "the pooled entries are not RMS-normalised as HF's DeepseekV4RMSNorm"),
    ("no_bias", "has no [m, C] position bias added to its windows"),
    ("not_a_rotation", "not x*cos + rotate_half(x)*sin on probes"),
])
def test_near_misses_say_why(form, reason):
    args = _small_inputs()
    out = torch.compile(lambda *a: _hca(*a, m=4, form=form), backend="dsfuse")(*args)
    rep = dsfuse.report()
    assert rep.counts["compressors"] == 0, str(rep)
    assert [miss.reason for miss in rep.near_misses if miss.pass_name == "compressors"] and all(
        reason in miss.reason for miss in rep.near_misses if miss.pass_name == "compressors"), str(rep)
    torch.testing.assert_close(out, _hca(*args, m=4, form=form), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form, detail", [
    ("exp_log_softmax", "m=4 D=16 R=8 exp_log_softmax, one series"),
    ("div_sqrt", "m=4 D=16 R=8 div_sqrt, one series"),
    ("complex_rope", "m=4 D=16 R=8, one series"),
    ("pairs_rope", "m=4 D=16 R=8, one series"),
    ("backwards_rope", "m=4 D=16 R=8, one series"),
])
def test_respelled_parts_are_rewritten_with_parity(form, detail, dtype):
    """Spellings that compute the same compressor: one site each. The roundings of their own (`exp(log_softmax)`,
    `x / sqrt`) are the op's flags, so eager's result comes back bit for bit; the RoPEs, proven on probes, are the
    op's RoPE within an ulp (turned backwards by a negated sin: the op reads -sin as its table)."""
    args = [t.to(dtype) if i < 2 else t for i, t in enumerate(_small_inputs())]
    out = torch.compile(lambda *a: _hca(*a, m=4, form=form), backend="dsfuse")(*args)
    assert _details(dsfuse.report()) == [detail], str(dsfuse.report())
    want = _hca(*args, m=4, form=form)
    if form in SPELLED_ROPES:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(out, want)


@pytest.mark.parametrize("form, dtype, probe", [
    ("bias_twice", torch.float32, "unit logits"),
    ("bf16_softmax_sum", torch.float32, "unit logits"),
    ("bf16_mean_square", torch.float32, "unit logits"),
    ("eps_times_1000", torch.bfloat16, "zero and small rows"),
])
def test_math_the_walk_passes_over_is_caught_on_probes(form, dtype, probe):
    """Spellings the walk accepts (it reads neither an add's `alpha` nor a reduction's `dtype=`) whose math is not
    the op's: the bias added twice, the softmax's sum or the norm's mean square rounded to bf16, eps 1000 times
    larger (in a bf16 compressor within the entries' rounding but for a row whose mean square is of the order of
    eps). Not rewritten, reported with the verifier's reason naming the probe. (Inductor keeps a bf16 intermediate
    in fp32, so the compiled result is eager's within bf16's budget.)"""
    args = [t.to(dtype) if i < 2 else t for i, t in enumerate(_small_inputs())]
    out = torch.compile(lambda *a: _hca(*a, m=4, form=form), backend="dsfuse",
                        options={"enable": ["compressors"]})(*args)
    rep = dsfuse.report()
    reasons = [miss.reason for miss in rep.near_misses if miss.pass_name == "compressors"]
    assert rep.counts["compressors"] == 0 and len(reasons) == 1, str(rep)
    assert reasons[0].startswith(f"compressor: numeric check against the reference failed: {probe} probe: "), reasons
    assert f"ulps of {dtype} at its largest magnitude" in reasons[0], reasons
    torch.testing.assert_close(out, _hca(*args, m=4, form=form), rtol=2e-2, atol=2e-2)


def _csa_by_cat(kv, gate, bias, weight, cos, sin, m, previous=-1):
    """CSA's compressor with its two overlapping series built by `cat` (the official code's layout): slots [0, m)
    of window w from window w + `previous` (-1: the compressor; +1: not one)."""
    B, S, C = kv.shape
    D, W = C // 2, S // m
    chunk_kv = kv[:, :W * m].view(B, W, m, C)
    chunk_gate = gate[:, :W * m].view(B, W, m, C) + bias
    empty_kv, empty_gate = chunk_kv.new_zeros(B, 1, m, D), chunk_gate.new_full((B, 1, m, D), float("-inf"))
    earlier = slice(None, -1) if previous == -1 else slice(1, None)
    series_kv = torch.cat([torch.cat([empty_kv, chunk_kv[:, earlier, :, :D]], dim=1), chunk_kv[..., D:]], dim=2)
    series_gate = torch.cat([torch.cat([empty_gate, chunk_gate[:, earlier, :, :D]], dim=1), chunk_gate[..., D:]],
                            dim=2)
    pooled = (series_kv * series_gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
    x = pooled.float()
    normed = (weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))).to(kv.dtype)
    return apply_rotary_pos_emb(normed.unsqueeze(1), cos[:, :W], sin[:, :W]).squeeze(1)


@pytest.mark.parametrize("S", [4, 5, 13])
def test_two_series_by_cat_are_rewritten(S):
    """One window (its previous series the -inf / zero fill alone) and three windows: one two-series site, the
    slice-assignment layout's result."""
    kv, gate, _, weight, cos, sin = _small_inputs(S=S)
    g = torch.Generator().manual_seed(1)
    kv, gate, bias = torch.randn(2, S, 32, generator=g), torch.randn(2, S, 32, generator=g), torch.randn(4, 32)
    out = torch.compile(lambda *a: _csa_by_cat(*a, m=4), backend="dsfuse")(kv, gate, bias, weight, cos, sin)
    assert _details(dsfuse.report()) == ["m=4 D=16 R=8, two overlapping series"], str(dsfuse.report())
    torch.testing.assert_close(out, _csa_by_cat(kv, gate, bias, weight, cos, sin, m=4), rtol=1e-5, atol=1e-5)


def test_two_series_by_cat_from_the_next_window_are_reported():
    """Slots [0, m) taken from window w + 1: another layout, reported with the slot it breaks."""
    _, _, _, weight, cos, sin = _small_inputs(S=13)
    g = torch.Generator().manual_seed(1)
    kv, gate, bias = torch.randn(2, 13, 32, generator=g), torch.randn(2, 13, 32, generator=g), torch.randn(4, 32)
    out = torch.compile(lambda *a: _csa_by_cat(*a, m=4, previous=1), backend="dsfuse")(kv, gate, bias, weight, cos,
                                                                                         sin)
    rep = dsfuse.report()
    reasons = [m.reason for m in rep.near_misses if m.pass_name == "compressors"]
    assert rep.counts["compressors"] == 0 and reasons == ["compressor gate slots are not HF's two overlapping series "
                                                          "(slots [0, m) of window w are not X[w - 1, :, :, :D])"], rep
    torch.testing.assert_close(out, _csa_by_cat(kv, gate, bias, weight, cos, sin, m=4, previous=1), rtol=1e-5,
                               atol=1e-5)
