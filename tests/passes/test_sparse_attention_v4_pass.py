"""`sparse_attention` on HF DeepSeek V4 (`v4-tiny`: a sliding, a CSA and an HCA layer): each layer's sink attention
becomes one `dsfuse::compressed_attention` call, logits stay those of eager, and what cannot be proven is a reported
near-miss with its reason.

The whole model is compiled once (the logits); the other cases compile the model's three attention layers alone on
one hidden state, with the masks and RoPE tables the model builds (same HF code, a fraction of the compile time)."""

import copy

import pytest
import torch
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

import dsfuse
from dsfuse.models.presets import build_hf_model

OPTIONS = {"enable": ["sparse_attention"]}
LAYER_KINDS = ["sliding", "CSA", "HCA"]  # v4-tiny: window 8, CSA m=4 top-4, HCA m'=8


@pytest.fixture(scope="module")
def model():
    return build_hf_model("v4-tiny", hc_sinkhorn_iters=2)


# The tests reading `whole_model` run on one pytest-xdist worker, which compiles the model once for them.
WHOLE_MODEL = pytest.mark.xdist_group("sparse_attention_v4_whole_model")


@pytest.fixture(scope="module")
def whole_model(model):
    """(eager logits, dsfuse logits, report, Inductor's output code) of the whole model at S=21: not a multiple of
    m=4 nor of m'=8, longer than the window and than index_topk * m."""
    from torch._inductor.utils import run_and_get_code

    ids = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    dsfuse.reset_report()
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        out, codes = run_and_get_code(torch.compile(model, backend="dsfuse", options=OPTIONS), ids, use_cache=False)
    report = dsfuse.report()
    torch._dynamo.reset()
    return reference, out.logits, report, "\n".join(codes)


class Attentions(torch.nn.Module):
    """The model's attention layers on one hidden state, with its own sliding-window mask and RoPE tables."""

    def __init__(self, model):
        super().__init__()
        self.inner = model.model

    def forward(self, hidden, attention_mask=None):
        inner = self.inner
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_sliding_window_causal_mask(config=inner.config, inputs_embeds=hidden,
                                                 attention_mask=attention_mask, cache=None, position_ids=position_ids)
        tables = {kind: inner.rotary_emb(hidden, position_ids=position_ids, layer_type=kind)
                  for kind in ("main", "compress")}
        return torch.stack([layer.self_attn(hidden, position_embeddings=tables, position_ids=position_ids,
                                            attention_mask=mask)[0] for layer in inner.layers])


def _sites():
    return [s for s in dsfuse.report().sites if s.pass_name == "sparse_attention"]


def _kinds(sites):
    return [s.detail.split(" attention:")[0].removeprefix("V4 ") for s in sites]


def _hidden(batch, seq):
    return torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(seq))


def _left_padding(batch, seq, pad=3):
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1:, :pad] = 0
    return mask


@WHOLE_MODEL
def test_every_layer_kind_is_rewritten_and_logits_match_eager(whole_model):
    reference, logits, rep, _ = whole_model
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    sites = [s for s in rep.sites if s.pass_name == "sparse_attention"]
    assert rep.counts["sparse_attention"] == 3 and [s.op for s in sites] == ["dsfuse.compressed_attention"] * 3
    assert _kinds(sites) == LAYER_KINDS, [s.detail for s in sites]
    assert sites[0].detail.startswith("V4 sliding attention: window 8, sinks, inverse RoPE epilogue")
    assert sites[1].detail.startswith("V4 CSA attention: window 8 + top-4 compressed entries, sinks, inverse RoPE")
    assert sites[2].detail.startswith("V4 HCA attention: window 8 + causal compressed entries (m=8), sinks, inverse")
    assert [m for m in rep.near_misses if m.pass_name == "sparse_attention"] == []


@WHOLE_MODEL
def test_the_output_projection_reads_the_attention_output_without_a_copy(whole_model):
    """HF turns the attention output [B, S, H, D] into [B, H, S, D] for the inverse RoPE and back, then `reshape`
    copies it; with the RoPE inside the fused op that copy is of a tensor already in order, and the pass manager drops
    it: the grouped output projection's bmm reads the op's own buffer, and no kernel rewrites that buffer first
    (every layer kind). Without the drop, Inductor reuses the buffer for the copy, so the bmm alone proves nothing."""
    import re

    code = whole_model[3]
    names = {m.group(1): m.group(1) for m in re.finditer(r"(buf\d+) = torch\.ops\.dsfuse\.compressed_attention", code)}
    for alias, source in re.findall(r"\b(buf\d+) = (buf\d+)\b(?!\[)", code):
        if source in names:
            names[alias] = names[source]
    bmm_inputs = re.findall(r"extern_kernels\.bmm\(reinterpret_tensor\((buf\d+)", code)
    read_by_bmm = {names[m] for m in bmm_inputs if m in names}
    assert len(set(names.values())) == 3 and read_by_bmm == set(names.values()), code[-4000:]
    # without the drop, Inductor keeps the copy as a kernel rewriting the op's buffer in place before the bmm
    kernel_arguments = re.findall(r"^\s*(?:cpp_fused_\w+|triton_\w+\.run)\((.*)\)", code, re.MULTILINE)
    copied = {buffer for arguments in kernel_arguments for buffer in re.findall(r"\bbuf\d+\b", arguments)
              if buffer in names}
    assert not copied, sorted(copied)


@pytest.mark.parametrize("seq", [6, 13])
def test_short_prompts(model, seq):
    """S=6: shorter than the window, one CSA entry, no HCA entry yet; S=13: fewer than index_topk * m tokens."""
    hidden = _hidden(1, seq)
    attentions = Attentions(model)
    with torch.no_grad():
        reference = attentions(hidden)
        out = torch.compile(attentions, backend="dsfuse", options=OPTIONS)(hidden)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert dsfuse.report().counts["sparse_attention"] == 3, str(dsfuse.report())
    # Before its first full window of m'=8 tokens the HCA layer has no entry and no block bias: sliding attention.
    assert _kinds(_sites()) == (["sliding", "CSA", "sliding"] if seq < 8 else LAYER_KINDS)
    if seq == 6:
        assert "top-1 compressed entries" in _sites()[1].detail  # one pick: Inductor's one-hot form of the scatter


def test_left_padding_and_dynamic_lengths_do_not_recompile(model):
    """Batch 2, the second row left-padded through `attention_mask`; the length marked dynamic (as Dynamo marks it at
    a second length), the symbolic graph (positions built from symbolic sizes) serves every later length. A left-padded
    batch at a static length: `test_generate_v4.py::test_generate_left_padded_batch_two`."""
    attentions = Attentions(model)
    compiled = torch.compile(attentions, backend="dsfuse", options=OPTIONS)
    with torch.no_grad():
        for seq in (21, 26, 17):
            hidden, mask = _hidden(2, seq), _left_padding(2, seq)
            torch._dynamo.mark_dynamic(hidden, 1)
            torch._dynamo.mark_dynamic(mask, 1)
            torch.testing.assert_close(compiled(hidden, mask), attentions(hidden, mask), rtol=1e-5, atol=1e-5)
    rep = dsfuse.report()
    assert len(rep.graphs) == 1 and rep.graphs[0].tokens is None, str(rep)
    assert rep.counts["sparse_attention"] == 3 and _kinds(_sites()) == LAYER_KINDS
    assert all("padding" in s.detail for s in _sites())


def test_whole_model_at_a_dynamic_length_keeps_every_layer(model):
    """Through the model, `input_ids` and `attention_mask` are separate inputs: once the length is dynamic each gets
    a symbol of its own, and the padding table is no longer provably [B, N]. The op reads it as eager does,
    `table[b, key]`, so the dynamic graph keeps all three layers (it lost them, a near-miss, on the H200 grid). Both
    lengths are marked dynamic, as Dynamo marks them at a second length, so the one compile is the dynamic graph."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(12))
    mask = _left_padding(2, 12)
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(mask, 1)
    with torch.no_grad():
        logits = torch.compile(model, backend="dsfuse", options=OPTIONS)(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(logits, model(input_ids=ids, attention_mask=mask).logits, rtol=1e-4, atol=1e-4)
    rep = dsfuse.report()
    assert len(rep.graphs) == 1 and rep.graphs[0].tokens is None, str(rep)
    assert [s.pass_name for s in rep.sites].count("sparse_attention") == 3, str(rep)
    assert not [m for m in rep.near_misses if m.pass_name == "sparse_attention"], str(rep)


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
def test_model_cast_as_a_whole(model, cast):
    """`model.to(torch.bfloat16)` / `.half()` casts the sinks too: HF's sink column and the shift by the row max are
    then in the model dtype. Each layer is still rewritten (the sinks widened, exactly); the op shifts in fp32, so its
    output is as close to the fp32 layers' as eager's cast layers are (10 % slack for summation order)."""
    hidden = _hidden(2, 29)
    cast_attentions = Attentions(copy.deepcopy(model).to(cast))
    with torch.no_grad():
        reference = Attentions(model)(hidden).double()
        eager = cast_attentions(hidden.to(cast)).double()
        out = torch.compile(cast_attentions, backend="dsfuse", options=OPTIONS)(hidden.to(cast)).double()
    rep = dsfuse.report()
    assert rep.counts["sparse_attention"] == 3 and _kinds(_sites()) == LAYER_KINDS, str(rep)
    assert rep.near_misses == [], str(rep)
    eager_distance = ((eager - reference).norm() / reference.norm()).item()
    fused_distance = ((out - reference).norm() / reference.norm()).item()
    assert 0 < fused_distance <= 1.1 * eager_distance, (fused_distance, eager_distance)


class _Stub(torch.nn.Module):
    """What `eager_attention_forward` reads from its module: the sinks, the K=V broadcast and the mode."""

    def __init__(self, heads):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.num_key_value_groups = heads


def test_unprovable_mask_is_a_reported_near_miss():
    """A plain causal mask (no sliding window) over the shared K=V rows: HF's sink attention, but not V4's mask."""
    stub = _Stub(4).eval()

    def attention(q, kv):
        seq = q.shape[2]
        allowed = torch.arange(seq).view(1, 1, 1, seq) <= torch.arange(seq).view(1, 1, seq, 1)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        return eager_attention_forward(stub, q, kv, kv, mask, scaling=0.25)[0]

    reasons, rep = _unrewritten(attention)
    assert reasons == ["the attention mask has no sliding window (kv > q - window)"], str(rep)


def _unrewritten(attention) -> tuple[list[str], object]:
    """Compile `attention` on a 10-token sequence, check it equals eager with no site rewritten; the near-misses'
    reasons and the report."""
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(1, 4, 10, 16, generator=gen), torch.randn(1, 1, 10, 16, generator=gen)
    with torch.no_grad():
        out = torch.compile(attention, backend="dsfuse", options=OPTIONS)(q, kv)
        torch.testing.assert_close(out, attention(q, kv))
    rep = dsfuse.report()
    assert rep.counts["sparse_attention"] == 0, str(rep)
    return [m.reason for m in rep.near_misses if m.pass_name == "sparse_attention"], rep


def test_a_spelling_the_walk_passes_but_that_computes_otherwise_is_a_near_miss():
    """The mask added to the scores with `alpha=2` (the scores doubled): the walk reads the add's operands, not its
    alpha, so only the verifier's probes against the op's reference tell this from V4's attention."""
    stub = _Stub(4).eval()

    def attention(q, kv):
        seq = q.shape[2]
        key, query = torch.arange(seq).view(1, 1, 1, seq), torch.arange(seq).view(1, 1, seq, 1)
        mask = torch.where((key <= query) & (key > query - 3), 0.0, torch.finfo(torch.float32).min)
        keys = kv.expand(-1, 4, -1, -1)
        scores = torch.add(mask, torch.matmul(q, keys.transpose(2, 3)) * 0.25, alpha=2)
        sinks = stub.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, seq, -1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.matmul(probs, keys).transpose(1, 2).contiguous()

    reasons, rep = _unrewritten(attention)
    assert len(reasons) == 1 and reasons[0].startswith("numeric check against the reference failed: random probe: "
                                                       "outputs differ by up to"), str(rep)
