"""The report's text is what users read: pinned with expecttest (EXPECTTEST_ACCEPT=1 to update)."""

import expecttest
import torch
import torch.nn.functional as F

import dsfuse


def indexer(q, k, w, mask):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * 0.25)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~mask, float("-inf"))
    return index.topk(3, dim=-1, sorted=False).indices


def smallest(q, k, w):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).topk(3, dim=-1, largest=False).indices


SELECT_LARGEST = True


def selected(q, k, w, mask):
    """`indexer` with the selection direction read from a global: changing it recompiles the function."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * 0.25)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~mask, float("-inf"))
    return index.topk(3, dim=-1, sorted=False, largest=SELECT_LARGEST).indices


def _indexer_inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 2, 8, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 6, 8, generator=gen).to(torch.bfloat16)
    w = torch.randn(1, 6, 2, generator=gen)
    return q, k, w, torch.ones(6, 6, dtype=torch.bool).tril()[None]


class ReportText(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        dsfuse.reset_report()

    def test_rewritten_and_near_miss(self):
        q, k, w, mask = _indexer_inputs()
        with torch._inductor.config.patch(fx_graph_cache=False):  # a cache hit would add a note to the text
            torch.compile(indexer, backend="dsfuse", options={"disable": ["moe_experts"]})(q, k, w, mask)
            torch.compile(smallest, backend="dsfuse", options={"disable": ["moe_experts"]})(q, k, w)
        self.assertExpectedInline(str(dsfuse.report()), """\
dsfuse report: 2 graph(s) compiled
  pass               rewritten  near-misses  state
  norm_rope_quant            0            0  enabled
  indexer_topk               1            1  enabled
  sparse_attention           0            0  enabled
  moe_experts                0            0  disabled
  hyper_connections          0            0  enabled
  compressors                0            0  enabled
not rewritten:
  [indexer_topk] top-k of the smallest scores (graph 1 at topk)
every site: print(dsfuse.report().details())""")
        self.assertExpectedInline(dsfuse.report().details(), """\
dsfuse report: 2 graph(s) compiled
  pass               rewritten  near-misses  state
  norm_rope_quant            0            0  enabled
  indexer_topk               1            1  enabled
  sparse_attention           0            0  enabled
  moe_experts                0            0  disabled
  hyper_connections          0            0  enabled
  compressors                0            0  enabled
rewritten sites:
  [indexer_topk] graph 0 at topk -> dsfuse.indexer_topk (arg0_1:bfloat16[1x6x2x8], arg1_1:bfloat16[1x6x8], arg2_1:float32[1x6x2], arg3_1:bool[1x6x6]) bool mask, k=3, scale=0.25
not rewritten:
  [indexer_topk] graph 1 at topk: top-k of the smallest scores""")

    def test_sites_lost_to_a_recompile(self):
        global SELECT_LARGEST
        q, k, w, mask = _indexer_inputs()
        compiled = torch.compile(selected, backend="dsfuse", options={"enable": ["indexer_topk"]})
        try:
            with torch._inductor.config.patch(fx_graph_cache=False):
                compiled(q, k, w, mask)
                SELECT_LARGEST = False
                compiled(q, k, w, mask)
        finally:
            SELECT_LARGEST = True
        self.assertExpectedInline(str(dsfuse.report()), """\
dsfuse report: 2 graph(s) compiled
  pass               rewritten  near-misses  state
  norm_rope_quant            0            0  disabled
  indexer_topk               1            1  enabled
  sparse_attention           0            0  disabled
  moe_experts                0            0  disabled
  hyper_connections          0            0  disabled
  compressors                0            0  disabled
  graph 1: a recompile of graph 0's function with fewer sites: indexer_topk 0 (graph 0: 1); the near-misses say why where a pass saw a candidate
not rewritten:
  [indexer_topk] top-k of the smallest scores (graph 1 at topk)
every site: print(dsfuse.report().details())""")


def test_pass_seconds_are_the_passes_time_on_the_graphs_they_ran_on():
    """`report().pass_seconds`: the compile time dsfuse's passes added, per graph; a graph Inductor's FX graph cache
    serves ran no pass and adds none."""
    torch._dynamo.reset()
    dsfuse.reset_report()
    q, k, w, mask = _indexer_inputs()
    with torch._inductor.config.patch(fx_graph_cache=True):
        torch.compile(indexer, backend="dsfuse")(q, k, w, mask)
        torch._dynamo.reset()
        torch.compile(indexer, backend="dsfuse")(q, k, w, mask)
    rep = dsfuse.report()
    assert len(rep.graphs) == 2 and rep.graphs[1].pass_seconds is None, rep.graphs
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        torch.compile(indexer, backend="dsfuse")(q, k, w, mask)
    rep = dsfuse.report()
    assert rep.graphs[2].pass_seconds > 0 and rep.counts["indexer_topk"] >= 1
    assert rep.pass_seconds == sum(g.pass_seconds or 0 for g in rep.graphs) >= rep.graphs[2].pass_seconds
