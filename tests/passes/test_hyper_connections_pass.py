"""`hyper_connections` on HF `DeepseekV4ForCausalLM` (v4-tiny) and on small graphs written with HF's modules: exact
site counts, parity with eager, symbolic sequence lengths, and near-misses with their reasons."""

import functools

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead
from torch._inductor import config as inductor_config
from v4_tiny_runs import FP32_SINKHORN_ITERS, SHARED_FP32, csa_then_hca_fp32_dynamic

import dsfuse
from dsfuse.models.presets import build_hf_model, hf_config
from dsfuse.passes import verify


def _ops(report, graph=None):
    sites = [s for s in report.sites if s.pass_name == "hyper_connections" and graph in (None, s.graph)]
    return [s.op for s in sites], [s.detail for s in sites]


def _expected_ops(layers):
    return sorted(["dsfuse.hc_collapse"] * 2 * layers + ["dsfuse.hc_expand_mix"] * 2 * layers + ["dsfuse.hc_head"])


@SHARED_FP32
def test_v4_tiny_counts_parity_batch_two_and_dynamic_lengths():
    """Two layers (CSA then HCA), every pass, batch 2, odd lengths: 2 collapses and 2 exits per layer plus the head,
    logits equal eager; the graph is compiled once with a symbolic length (as Dynamo compiles after its first
    recompile) and serves every length."""
    calls, rep = csa_then_hca_fp32_dynamic()
    for compiled, eager in calls:
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert len(rep.graphs) == 1, str(rep)
    ops, details = _ops(rep, 0)
    assert sorted(ops) == _expected_ops(2), str(rep)
    collapses = [d for op, d in zip(ops, details) if op == "dsfuse.hc_collapse"]
    assert all(f"sinkhorn_iters={FP32_SINKHORN_ITERS}" in d for d in collapses), collapses
    assert not any("one launch" in d for d in details), details  # exits and collapses stay separate launches
    assert rep.counts["hyper_connections"] == 9 and not rep.near_misses, str(rep)


def test_default_twenty_sinkhorn_iterations():
    model = build_hf_model("v4-tiny", dtype=torch.float32, num_hidden_layers=1, layer_types=["sliding_attention"],
                           mlp_layer_types=["moe"])
    assert model.config.hc_sinkhorn_iters == 20
    compiled = torch.compile(model, backend="dsfuse", options={"enable": ["hyper_connections"]})
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    ops, details = _ops(dsfuse.report())
    assert sorted(ops) == _expected_ops(1), str(dsfuse.report())
    assert [d for op, d in zip(ops, details) if op == "dsfuse.hc_collapse"] == [
        "n=4 D=64 sinkhorn_iters=20", "n=4 D=64 sinkhorn_iters=20"]


# --------------------------------------------------------------------------------------------
# Small graphs: one decoder-layer-like block written with HF's modules
# --------------------------------------------------------------------------------------------
class HcBlock(torch.nn.Module):
    """A hyper-connection around a linear block, its exit as `DeepseekV4DecoderLayer.forward` writes it, and the
    head; `exit_form` varies the exit (HF's, or with comb not transposed)."""

    def __init__(self, hidden=32, hc_mult=4, iters=4, exit_form="hf"):
        super().__init__()
        config = hf_config("v4-tiny", hidden_size=hidden, hc_mult=hc_mult, hc_sinkhorn_iters=iters)
        gen = torch.Generator().manual_seed(0)
        self.hc = DeepseekV4HyperConnection(config)
        self.head = DeepseekV4HyperHead(config)
        for p in (*self.hc.parameters(), *self.head.parameters()):
            p.data = torch.randn(p.shape, generator=gen) * 0.1 + (0.5 if p.dim() <= 1 else 0.0)
        self.block = torch.nn.Linear(hidden, hidden, bias=False)
        self.exit_form = exit_form

    def forward(self, streams):
        dtype = streams.dtype
        post, comb, collapsed = self.hc(streams)
        out = self.block(collapsed)
        comb = comb.to(dtype) if self.exit_form == "not_transposed" else comb.to(dtype).transpose(-1, -2)
        streams = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb, streams)
        return self.head(streams)


class RowLastHc(DeepseekV4HyperConnection):
    """A hyper-connection whose Sinkhorn loop ends on a row normalisation: not HF's iteration."""

    def forward(self, hidden_streams):
        post, comb, collapsed = super().forward(hidden_streams)
        return post, comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps), collapsed


def _run_block(block, streams, enable=("hyper_connections",)):
    compiled = torch.compile(block, backend="dsfuse", options={"enable": list(enable)})
    with torch.no_grad():
        return compiled(streams), block(streams)


@pytest.mark.parametrize("dtype, hc_mult", [(torch.bfloat16, 4), (torch.float32, 2)])
def test_block_is_rewritten_and_equals_eager(dtype, hc_mult):
    block = HcBlock(hc_mult=hc_mult).to(dtype)
    for p in (*block.hc.parameters(), *block.head.parameters()):  # HF keeps the hyper-connections in fp32
        p.data = p.data.float()
    streams = torch.randn(2, 5, hc_mult, 32).to(dtype)
    got, want = _run_block(block, streams)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    ops, details = _ops(dsfuse.report())
    assert sorted(ops) == ["dsfuse.hc_collapse", "dsfuse.hc_expand_mix", "dsfuse.hc_head"], str(dsfuse.report())
    assert sorted(details) == [f"n={hc_mult} D=32"] * 2 + [f"n={hc_mult} D=32 sinkhorn_iters=4"], details


def test_disabled_pass_rewrites_nothing():
    block = HcBlock()
    got, want = _run_block(block, torch.randn(1, 3, 4, 32), enable=())
    torch.testing.assert_close(got, want)
    assert dsfuse.report().counts["hyper_connections"] == 0


def test_exit_without_transposed_comb_is_a_near_miss():
    block = HcBlock(exit_form="not_transposed")
    got, want = _run_block(block, torch.randn(1, 3, 4, 32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rep = dsfuse.report()
    assert sorted(_ops(rep)[0]) == ["dsfuse.hc_collapse", "dsfuse.hc_head"], str(rep)
    assert [m.reason for m in rep.near_misses] == ["hyper-connection exit: the mix does not read comb transposed"]


def test_sinkhorn_ending_on_rows_is_a_near_miss():
    block = HcBlock()
    row_last = RowLastHc(hf_config("v4-tiny", hidden_size=32, hc_sinkhorn_iters=4))
    row_last.load_state_dict(block.hc.state_dict())
    block.hc = row_last
    got, want = _run_block(block, torch.randn(1, 3, 4, 32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rep = dsfuse.report()
    assert _ops(rep)[0] == ["dsfuse.hc_head"], str(rep)
    assert [m.reason for m in rep.near_misses] == [
        "hyper-connection: Sinkhorn steps ['col', 'row', 'col', 'row', 'col', 'row', 'col', 'row'] are not HF's "
        "col, (row, col)*"], str(rep)



# --------------------------------------------------------------------------------------------
# Spellings the spelling fuzzer found: rewritten, or reported with their reason
# --------------------------------------------------------------------------------------------
N, D, EPS = 4, 16, 1e-6


def _hc_params():
    g = torch.Generator().manual_seed(0)
    mixes = (2 + N) * N
    return (torch.randn(mixes, N * D, generator=g) * 0.1, torch.randn(mixes, generator=g) * 0.1 + 0.5,
            torch.randn(3, generator=g) * 0.1 + 0.5, torch.randn(D, D, generator=g) * 0.2)


def _spelled_block(x, fn, base, scale, block, flat_streams=False, collapse="einsum", reciprocal_steps=(),
                   exp_sum_softmax=False, rounded_post=False):
    """HF's hyper-connection and exit written out: the collapse (`einsum`, `bmm` or a broadcast sum) over an fp32
    copy of the streams made after post and comb; optionally the streams given flattened [B, S, n*D], the Sinkhorn
    steps numbered in `reciprocal_steps` as products with a reciprocal, or the softmax as exp(z) / sum(exp(z)).
    Two spellings whose math differs only in a rounding the structural walk looks through (it strips casts): the
    collapse "sum of bf16 streams" (the weights times a bf16 copy of fp32 streams, promoted back to fp32) and
    `rounded_post` (the exit's post rounded to bf16 and back in an fp32 block)."""
    streams = x.view(*x.shape[:-1], N, D) if flat_streams else x
    flat = streams.flatten(-2).float()
    mixes = F.linear(flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS), fn)
    pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = base.split([N, N, N * N])
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    z = comb_w.view(*comb_w.shape[:-1], N, N) * scale[2] + comb_b.view(N, N)
    comb = (torch.exp(z) / torch.exp(z).sum(-1, keepdim=True) if exp_sum_softmax else torch.softmax(z, dim=-1)) + EPS
    for i, dim in enumerate((-2, -1, -2)):
        total = comb.sum(dim=dim, keepdim=True) + EPS
        comb = comb * (1 / total) if i in reciprocal_steps else comb / total
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + EPS
    if collapse == "sum":
        collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=-2)
    elif collapse == "sum of bf16 streams":
        collapsed = (pre.unsqueeze(-1) * streams.to(torch.bfloat16)).sum(dim=-2)
    elif collapse == "einsum":
        collapsed = torch.einsum("...n,...nd->...d", pre, streams.float())
    else:
        collapsed = torch.bmm(pre.reshape(-1, 1, N), streams.float().reshape(-1, N, D)).view(*streams.shape[:-2], D)
    out = F.linear(collapsed.to(x.dtype), block.to(x.dtype))
    mixed = torch.matmul(comb.to(x.dtype).transpose(-1, -2), streams)
    post = post.to(torch.bfloat16) if rounded_post else post
    new = post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed
    return new.flatten(-2) if flat_streams else new


def _block_rewritten_with_parity(block, x) -> tuple[list, list]:
    """(ops, details) of the sites of `block` compiled on streams `x`: one collapse and one mix, no near-miss, eager's
    result within the dtype's budget."""
    compiled = torch.compile(block, backend="dsfuse", options={"enable": ["hyper_connections"]})
    with torch.no_grad():
        got, want = compiled(x, *_hc_params()), block(x, *_hc_params())
    tol = 1e-5 if x.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    rep = dsfuse.report()
    ops, details = _ops(rep)
    assert sorted(ops) == ["dsfuse.hc_collapse", "dsfuse.hc_expand_mix"] and not rep.near_misses, str(rep)
    return ops, details


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_collapse_of_a_late_fp32_copy_is_rewritten(dtype):
    """The collapse reads `streams.float()` made after post and comb (the cast is moved before the fused call); in
    fp32 the graph reads the collapse with its tokens merged (the fused value is viewed so)."""
    _block_rewritten_with_parity(_spelled_block, torch.randn(2, 3, N, D).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("collapse", ["bmm", "einsum", "sum"])
def test_streams_held_only_flattened_are_viewed_back(collapse, dtype):
    """Streams given flattened [B, S, n*D]: the graph folds their [*, n, D] view into the collapse's and the mix's
    bmm views, so only the flat tensor is left; its dims are followed from it and the ops read a view of it."""
    block = functools.partial(_spelled_block, flat_streams=True, collapse=collapse)
    _block_rewritten_with_parity(block, torch.randn(2, 3, N * D).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spelling, forms", [
    (dict(reciprocal_steps=(0, 1, 2)), " reciprocal_sinkhorn"),
    (dict(exp_sum_softmax=True), " exp_sum_softmax"),
    (dict(exp_sum_softmax=True, reciprocal_steps=(0, 1, 2)), " exp_sum_softmax reciprocal_sinkhorn"),
])
def test_comb_spellings_that_round_otherwise_take_the_ops_roundings(spelling, forms, dtype):
    """A softmax with no max subtracted and Sinkhorn steps as products with the reciprocal round otherwise than
    HF's; the collapse is rewritten with the op's matching flags (named in the site's detail)."""
    block = functools.partial(_spelled_block, **spelling)
    ops, details = _block_rewritten_with_parity(block, torch.randn(2, 3, N, D).to(dtype))
    collapse_detail = details[ops.index("dsfuse.hc_collapse")]
    assert collapse_detail.startswith(f"n={N} D={D} sinkhorn_iters=2{forms}"), collapse_detail


@pytest.mark.parametrize("spelling, reason", [
    (dict(reciprocal_steps=(2,)), "hyper-connection: Sinkhorn steps mix divisions and products with 1 / (sum + eps); "
                                  "the op rounds every step one way"),
])
def test_spellings_the_op_does_not_take_are_near_misses(spelling, reason):
    x = torch.randn(2, 3, N * D) if spelling.get("flat_streams") else torch.randn(2, 3, N, D)
    block = functools.partial(_spelled_block, **spelling)
    compiled = torch.compile(block, backend="dsfuse", options={"enable": ["hyper_connections"]})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, *_hc_params()), block(x, *_hc_params()), rtol=1e-5, atol=1e-5)
    rep = dsfuse.report()
    assert [m.reason for m in rep.near_misses] == [reason], str(rep)


# --------------------------------------------------------------------------------------------
# The numeric check: spellings the walk accepts whose math is not the op's, and the verdict cache
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling, ops, reason", [
    (dict(collapse="sum of bf16 streams"), [],
     "hyper-connection collapse: numeric check against the reference failed: random probe: collapsed differs by "),
    (dict(rounded_post=True), ["dsfuse.hc_collapse"],
     "hyper-connection exit: numeric check against the reference failed: collapse weights probe: streams differs by "),
])
def test_roundings_the_walk_looks_through_are_caught_on_probes(spelling, ops, reason):
    """fp32 streams collapsed through a bf16 copy, or the exit's post rounded to bf16: the walk strips the casts and
    binds every role, the op would not round there; the probes see it (an error of about 2^-9 of the values, far
    over the 128 fp32 ulps allowed). Not rewritten, reported with the verifier's reason. (Inductor keeps the bf16
    intermediate in fp32 itself, not emulating the cast: the compiled result is eager's within bf16's budget.)"""
    x = torch.randn(2, 3, N, D)
    block = functools.partial(_spelled_block, **spelling)
    compiled = torch.compile(block, backend="dsfuse", options={"enable": ["hyper_connections"]})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, *_hc_params()), block(x, *_hc_params()), rtol=2e-2, atol=2e-2)
    rep = dsfuse.report()
    assert _ops(rep)[0] == ops, str(rep)
    assert len(rep.near_misses) == 1 and rep.near_misses[0].reason.startswith(reason), str(rep)
    assert "ulps of torch.float32" in rep.near_misses[0].reason, str(rep)


class HcLayers(torch.nn.Module):
    """`layers` hyper-connection blocks of HF's modules (each its own weights), then the head."""

    def __init__(self, layers=3, hidden=32):
        super().__init__()
        config = hf_config("v4-tiny", hidden_size=hidden, hc_sinkhorn_iters=4)
        self.hcs = torch.nn.ModuleList(DeepseekV4HyperConnection(config) for _ in range(layers))
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers))
        self.head = DeepseekV4HyperHead(config)
        gen = torch.Generator().manual_seed(0)
        for p in (*self.hcs.parameters(), *self.head.parameters()):
            p.data = torch.randn(p.shape, generator=gen) * 0.1 + (0.5 if p.dim() <= 1 else 0.0)

    def forward(self, streams):
        dtype = streams.dtype
        for hc, block in zip(self.hcs, self.blocks):
            post, comb, collapsed = hc(streams)
            out = block(collapsed)
            streams = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), streams)
        return self.head(streams)


def test_repeated_layers_are_verified_once(tmp_path, monkeypatch):
    """Four layers: four collapses and four exits rewritten, the head too, and the probes run 4 times, not 9 (the
    verdicts are cached by the slice's structure): every exit once, the head once, the collapses twice: the first
    layer's streams are the graph's input, ahead of its weights in graph order, the others an exit's output, after
    them, and the cache key names the slice's frontier in graph order. A fresh Inductor cache, so the passes run."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    verify.clear_cache()
    runs = []
    probe = verify._run
    monkeypatch.setattr(verify, "_run", lambda *args: runs.append(args[0]) or probe(*args))
    with inductor_config.patch(fx_graph_cache=False):
        got, want = _run_block(HcLayers(layers=4), torch.randn(2, 5, 4, 32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rep = dsfuse.report()
    assert sorted(_ops(rep)[0]) == ["dsfuse.hc_collapse"] * 4 + ["dsfuse.hc_expand_mix"] * 4 + ["dsfuse.hc_head"], \
        str(rep)
    assert not rep.near_misses and len(runs) == 4, (len(runs), str(rep))
