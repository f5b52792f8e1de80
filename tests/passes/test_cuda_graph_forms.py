"""The graph forms Inductor hands the passes on CUDA (torch 2.11's online softmax and folded `x.to(bf16).to(fp32)`
round trips, pad_mm's zero-padded products, a batch-1 bmm as `mm`: see inductor_forms), applied on CPU to HF
`DeepseekV4ForCausalLM` (v4-tiny's CSA and HCA layers, bf16) and V3.2's eager attention: every family still rewrites
every site, with no near-miss, and the logits are bit for bit those of the compile without these forms. (Every pass
runs: the CPU backend cannot lower an online softmax, so every softmax must be rewritten.)"""

import functools

import torch
from inductor_forms import (CONVERT, FLOAT32_WHERES, REWRITES, as_torch_2_11_on_cuda, batch_one_bmm_as_mm,
                            inductor_folds_narrowing_round_trips, keep_constant_wheres_in_float32, pad_matmuls)
from v4_tiny_runs import SHARED_BF16, csa_then_hca_bf16

import dsfuse
from dsfuse.models.presets import build_hf_model


def _cuda_forms_and_padding(graph: torch.fx.Graph) -> None:
    """torch 2.11's CUDA forms, and pad_mm's padding of the products at this odd length (33 tokens)."""
    as_torch_2_11_on_cuda(graph)
    pad_matmuls(graph)


def _with(form, model, *args, **kwargs):
    """(logits, report) of the model compiled with `form` applied to its graph first."""
    torch._dynamo.reset()
    dsfuse.reset_report()
    REWRITES.clear()
    FLOAT32_WHERES.clear()
    with torch.no_grad():
        logits = torch.compile(model, backend="dsfuse",
                               options={"inductor": {"post_grad_custom_pre_pass": form}})(*args, **kwargs).logits
    return logits, dsfuse.report()


def _without_and_with(form, model, *args, **kwargs):
    """(logits, report) of the model compiled as it is, then of it compiled with `form` applied to the graph first."""
    torch._dynamo.reset()
    dsfuse.reset_report()
    with torch.no_grad():
        plain = torch.compile(model, backend="dsfuse")(*args, **kwargs).logits, dsfuse.report()
    return (*plain, *_with(form, model, *args, **kwargs))


@SHARED_BF16
def test_v4_families_rewrite_on_torch_2_11_cuda_graph_forms():
    """v4-tiny's CSA and HCA layers, batch 2, 33 tokens; the compile without the forms is the one the compressors'
    bf16 test reads."""
    model, ids, _, want, plain_rep = csa_then_hca_bf16()
    got, rep = _with(_cuda_forms_and_padding, model, ids)
    plain = dict(plain_rep.counts)
    # torch 2.11 and 2.12 fold the round trips themselves (on CPU too): their plain compile is already in that form,
    # and the emulation finds none left to drop; 2.13 and later keep them, and it drops them.
    folded = inductor_folds_narrowing_round_trips()
    assert {n.target for n in REWRITES} == {torch.ops.prims.prepare_softmax_online.default,
                                            torch.ops.aten.slice.Tensor} | (set() if folded else {CONVERT})
    assert rep.counts == plain and plain["compressors"] == 3 and plain["hyper_connections"] == 9, (plain, str(rep))
    assert not rep.near_misses, str(rep)
    dropped = "Inductor had dropped the round trip"
    details = [s.detail for s in rep.sites if s.pass_name == "hyper_connections"]
    assert sum(dropped in d for d in details) == 5, details
    plain_details = [s.detail for s in plain_rep.sites if s.pass_name == "hyper_connections"]
    assert sum(dropped in d for d in plain_details) == (5 if folded else 0), plain_details
    assert torch.equal(got, want)


@SHARED_BF16
def test_the_indexer_rewrites_when_cuda_pads_its_scores_product():
    """pad_mm pads a product whose dims are not multiples of 8 once each is large enough: on the H200 grid the
    indexer's q . k at 3 x 127 tokens (127 queries, 31 compressed keys), which then reached the relu as a slice of a
    padded bmm and was reported ("relu input is not a q.k product"). Every small product padded here, the scores'
    included: the indexer reads the product the slice holds."""
    model, ids, _, want, plain_rep = csa_then_hca_bf16()
    got, rep = _with(functools.partial(pad_matmuls, min_dim=4), model, ids)
    assert REWRITES, "no product was padded"
    assert rep.counts == plain_rep.counts and rep.counts["indexer_topk"] == 1, (dict(plain_rep.counts), str(rep))
    assert not rep.near_misses, str(rep)
    assert torch.equal(got, want)


def test_hyper_connection_exits_rewrite_when_cuda_computes_the_one_token_bmm_as_mm():
    """A decode step's exit mixes one token's streams: on CUDA its bmm arrives as a batch-1 mm."""
    model = build_hf_model("v4-tiny", dtype=torch.bfloat16, hc_sinkhorn_iters=2, num_hidden_layers=1,
                           layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    ids = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(3))
    want, _, got, rep = _without_and_with(batch_one_bmm_as_mm, model, ids)
    assert REWRITES, "the forward has no batch-1 bmm to turn into an mm"
    exits = [s for s in rep.sites if s.op == "dsfuse.hc_expand_mix"]
    assert rep.counts["hyper_connections"] == 5 and len(exits) == 2, str(rep)
    assert not [m for m in rep.near_misses if m.pass_name == "hyper_connections"], str(rep)
    assert torch.equal(got, want)


def test_csa_attention_with_one_compressed_entry_rewrites_with_its_block_bias_in_float32():
    """Five tokens make one compressed entry: the indexer picks one per query and Inductor writes CSA's scatter of
    the pick as `where(pick == arange, 0., -inf)`, cast to bf16 (CPU, torch 2.13 and later) or left in fp32 so the
    masked scores are promoted to fp32 (CUDA with torch 2.11; torch 2.12 on CPU already). Both forms rewrite every
    attention site. Where the plain compile is already in the fp32 form, the emulation has no cast to drop."""
    model = build_hf_model("v4-tiny", dtype=torch.bfloat16, hc_sinkhorn_iters=2, num_hidden_layers=2,
                           layer_types=["compressed_sparse_attention", "sliding_attention"],
                           mlp_layer_types=["moe", "moe"])
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(4))
    want, plain, got, rep = _without_and_with(keep_constant_wheres_in_float32, model, ids)
    assert plain.counts["sparse_attention"] == 2 and plain.counts["indexer_topk"] == 1, str(plain)
    assert not plain.near_misses, str(plain)
    assert REWRITES or FLOAT32_WHERES, "the graph has no constant where, cast or in fp32"
    assert rep.counts == plain.counts and not rep.near_misses, str(rep)
    assert torch.equal(got, want)


def test_v32_eager_attention_rewrites_when_cuda_pads_its_products():
    """The same for HF V3.2's eager attention (decomposed softmax between two bmms), a left-padded batch of 2."""
    model = build_hf_model("tiny", attn_implementation="eager")
    ids = torch.randint(1, 256, (2, 37), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    want, plain, got, rep = _without_and_with(functools.partial(pad_matmuls, min_dim=8), model, ids,
                                              attention_mask=mask)
    plain = dict(plain.counts)
    assert REWRITES, "no product was padded"
    assert rep.counts == plain and plain["sparse_attention"] == 2, (plain, str(rep))
    assert not rep.near_misses, str(rep)
    assert torch.equal(got, want)


def test_v4_hyper_connections_rewrite_when_cuda_pads_their_projections():
    """At a static length whose token count is not a multiple of 8 (the H200 grid's batch 3 x 7 tokens) pad_mm pads
    the hyper-connections' fp32 projections, `mm(pad(flat), pad(fn^T))` sliced back: every site is still rewritten."""
    model = build_hf_model("v4-tiny", dtype=torch.bfloat16, hc_sinkhorn_iters=2, num_hidden_layers=1,
                           layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    ids = torch.randint(1, 256, (3, 7), generator=torch.Generator().manual_seed(7))
    padded_mms = []

    def pad_products(graph):
        pad_matmuls(graph, mms=True)
        padded_mms.extend(n for n in REWRITES if n.args[0].target is torch.ops.aten.mm.default)

    want, plain, got, rep = _without_and_with(pad_products, model, ids)
    assert padded_mms, "no projection was padded"
    assert plain.counts["hyper_connections"] == 5 and rep.counts["hyper_connections"] == 5, (str(plain), str(rep))
    assert not [m for m in rep.near_misses if m.pass_name == "hyper_connections"], str(rep)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_v4_projection_norms_rewrite_when_cuda_pads_their_projections():
    """pad_mm pads a projection whose dims are not multiples of 8 (`mm(pad(x), pad(w^T))` sliced back, here every
    mm): the RMSNorm of its output is still an `rmsnorm_rope` site (the H200 grid lost these at some lengths, with
    no near-miss, when pad_mm's benchmark chose the padded product)."""
    model = build_hf_model("v4-tiny", dtype=torch.bfloat16, hc_sinkhorn_iters=2, num_hidden_layers=1,
                           layer_types=["sliding_attention"], mlp_layer_types=["moe"]).eval()
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(7))

    def pad_every_product(graph):
        pad_matmuls(graph, min_dim=1, mms=True)

    want, plain, got, rep = _without_and_with(pad_every_product, model, ids)
    assert REWRITES, "no product was padded"
    norms = [s for s in rep.sites if s.op == "dsfuse.rmsnorm_rope"]
    assert len(norms) == sum(s.op == "dsfuse.rmsnorm_rope" for s in plain.sites) == 1, (str(plain), str(rep))
    assert rep.counts == plain.counts and not rep.near_misses, (str(plain), str(rep))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
