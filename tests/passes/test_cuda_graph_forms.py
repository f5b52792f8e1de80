"""The graph forms torch 2.11's Inductor hands the passes on CUDA (online softmax; `x.to(bf16).to(fp32)` round
trips folded away: see inductor_forms), applied to HF `DeepseekV4ForCausalLM` (v4-tiny's CSA and HCA layers, bf16)
on CPU: every family still rewrites every site, with no near-miss, and the logits are bit for bit those of the
compile without these forms. (Every pass runs: the CPU backend cannot lower an online softmax, so every softmax
must be rewritten.)"""

import torch
from inductor_forms import CONVERT, REWRITES, as_torch_2_11_on_cuda, batch_one_bmm_as_mm

import dsfuse
from dsfuse.models.presets import build_hf_model


def test_v4_families_rewrite_on_torch_2_11_cuda_graph_forms():
    model = build_hf_model("v4-tiny", dtype=torch.bfloat16, hc_sinkhorn_iters=2, num_hidden_layers=2,
                           layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                           mlp_layer_types=["moe", "moe"])
    ids = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = torch.compile(model, backend="dsfuse")(ids).logits
        plain = dict(dsfuse.report().counts)
        torch._dynamo.reset()
        dsfuse.reset_report()
        REWRITES.clear()
        options = {"inductor": {"post_grad_custom_pre_pass": as_torch_2_11_on_cuda}}
        got = torch.compile(model, backend="dsfuse", options=options)(ids).logits
    assert {n.target for n in REWRITES} == {torch.ops.prims.prepare_softmax_online.default, CONVERT}
    rep = dsfuse.report()
    assert rep.counts == plain and plain["compressors"] == 3 and plain["hyper_connections"] == 9, (plain, str(rep))
    assert not rep.near_misses, str(rep)
    details = [s.detail for s in rep.sites if s.pass_name == "hyper_connections"]
    assert sum("Inductor had dropped the round trip" in d for d in details) == 5, details
    assert torch.equal(got, want)


def test_hyper_connection_exits_rewrite_when_cuda_computes_the_one_token_bmm_as_mm():
    """A decode step's exit mixes one token's streams: on CUDA its bmm arrives as a batch-1 mm."""
    model = build_hf_model("v4-tiny", dtype=torch.bfloat16, hc_sinkhorn_iters=2, num_hidden_layers=1,
                           layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    ids = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = torch.compile(model, backend="dsfuse")(ids).logits
        torch._dynamo.reset()
        dsfuse.reset_report()
        REWRITES.clear()
        options = {"inductor": {"post_grad_custom_pre_pass": batch_one_bmm_as_mm}}
        got = torch.compile(model, backend="dsfuse", options=options)(ids).logits
    assert REWRITES, "the forward has no batch-1 bmm to turn into an mm"
    rep = dsfuse.report()
    exits = [s for s in rep.sites if s.op == "dsfuse.hc_expand_mix"]
    assert rep.counts["hyper_connections"] == 5 and len(exits) == 2, str(rep)
    assert not [m for m in rep.near_misses if m.pass_name == "hyper_connections"], str(rep)
    assert torch.equal(got, want)
