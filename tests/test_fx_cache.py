"""The FX graph cache never serves a graph compiled under another ablation."""

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

import dsfuse
from dsfuse.pass_manager import DsfusePassManager


def indexer(q, k, w, mask):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * 0.25)
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2).masked_fill(~mask, float("-inf"))
    return index.topk(3, dim=-1, sorted=False).indices


def indexer_renamed(query, key, weight, keep):
    """`indexer` with other argument names: another Dynamo graph, the same AOT graph for Inductor."""
    scores = F.relu(torch.matmul(query.float(), key.transpose(-1, -2).float().unsqueeze(1)) * 0.25)
    index = torch.matmul(weight.unsqueeze(-2), scores).squeeze(-2).masked_fill(~keep, float("-inf"))
    return index.topk(3, dim=-1, sorted=False).indices


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, 6, 2, 8, generator=gen), torch.randn(1, 6, 8, generator=gen),
            torch.randn(1, 6, 2, generator=gen), torch.ones(6, 6, dtype=torch.bool).tril()[None])


def _compile_and_run(options, fn=indexer):
    torch._dynamo.reset()
    dsfuse.reset_report()
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    out = torch.compile(fn, backend="dsfuse", options=options)(*_inputs())
    return (out, dsfuse.report(), counters["inductor"]["fxgraph_cache_hit"] - hits,
            counters["inductor"]["fxgraph_cache_miss"] - misses)


def test_toggling_a_pass_never_serves_a_stale_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with inductor_config.patch(fx_graph_cache=True, force_disable_caches=False):
        _, on, hit, miss = _compile_and_run({"enable": ["indexer_topk"]})
        assert (hit, miss) == (0, 1) and on.counts["indexer_topk"] == 1
        assert on.graphs[0].note == "", "a compiled (not cached) graph carries no cache note"

        _, off, hit, miss = _compile_and_run({"disable": ["indexer_topk"]})
        assert (hit, miss) == (0, 1), "a different enabled set must not hit the cached fused graph"
        assert off.counts["indexer_topk"] == 0

        _, again, hit, miss = _compile_and_run({"enable": ["indexer_topk"]})
        assert (hit, miss) == (1, 0)
        assert again.counts["indexer_topk"] == 1, "sites are restored for a graph served from the cache"
        assert "served from Inductor's FX graph cache" in again.graphs[0].note


def test_a_graph_served_for_another_dynamo_graph_reports_its_sites(tmp_path, monkeypatch):
    """Inductor's FX cache keys the AOT graph, not Dynamo's code: the record must be found under the same key."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with inductor_config.patch(fx_graph_cache=True, force_disable_caches=False):
        first_out, first, hit, miss = _compile_and_run({"enable": ["indexer_topk"]})
        assert (hit, miss) == (0, 1) and first.counts["indexer_topk"] == 1

        out, renamed, hit, miss = _compile_and_run({"enable": ["indexer_topk"]}, fn=indexer_renamed)
        assert (hit, miss) == (1, 0), "the renamed function's AOT graph is the cached one"
        assert renamed.counts["indexer_topk"] == 1
        assert "sites restored" in renamed.graphs[0].note
        assert [s.detail for s in renamed.sites] == [s.detail for s in first.sites]
        assert torch.equal(out.sort(-1).values, first_out.sort(-1).values)


def test_uuid_covers_enabled_set_and_sources(monkeypatch):
    a, b = DsfusePassManager(("indexer_topk",)).uuid(), DsfusePassManager(("indexer_topk", "sparse_attention")).uuid()
    assert a != b
    assert a == DsfusePassManager(("indexer_topk",)).uuid()
    import dsfuse.pass_manager as pm

    monkeypatch.setattr(pm, "sources_digest", lambda: "edited-kernel-source")
    assert DsfusePassManager(("indexer_topk",)).uuid() != a


def test_uuid_follows_what_runs_not_the_flags(monkeypatch):
    """A pass that is off rewrites nothing, so flags naming it must not split the cache; switching it on must."""
    import dsfuse.passes.moe_experts as moe

    monkeypatch.setattr(moe, "IMPLEMENTED", False)
    assert DsfusePassManager(("indexer_topk",)).uuid() == DsfusePassManager(("indexer_topk", "moe_experts")).uuid()
    monkeypatch.setattr(moe, "IMPLEMENTED", True)
    assert DsfusePassManager(("indexer_topk",)).uuid() != DsfusePassManager(("indexer_topk", "moe_experts")).uuid()


def test_a_cache_hit_without_dsfuse_record_says_sites_are_not_counted(tmp_path, monkeypatch):
    """Inductor's cache can outlive dsfuse's record of a compile (a deleted or foreign record folder): the graph is
    then served with its fused ops, but the report cannot count them, and says so instead of claiming 0 sites."""
    from dsfuse.backend import UNRECORDED_NOTE, _records_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with inductor_config.patch(fx_graph_cache=True, force_disable_caches=False):
        first, _, hit, miss = _compile_and_run({"enable": ["indexer_topk"]})
        assert (hit, miss) == (0, 1)
        for record in _records_dir().glob("*.json"):
            record.unlink()
        again, rep, hit, miss = _compile_and_run({"enable": ["indexer_topk"]})
    assert (hit, miss) == (1, 0)
    assert rep.graphs[0].note == UNRECORDED_NOTE and rep.counts["indexer_topk"] == 0
    assert torch.equal(again, first)


def test_a_dynamic_graph_served_at_another_size_reports_its_sites(tmp_path, monkeypatch):
    """Under dynamic shapes one cached graph serves every size: a later compile at another length (a fresh Dynamo, the
    same symbolic graph) is served from the caches and must find the record of the first."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(0)

    def inputs(batch, seq):
        return (torch.randn(batch, seq, 2, 8, generator=gen), torch.randn(batch, seq, 8, generator=gen),
                torch.randn(batch, seq, 2, generator=gen),
                torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, seq, seq))

    reports = []
    with inductor_config.patch(fx_graph_cache=True, force_disable_caches=False):
        for seq in (6, 7):
            torch._dynamo.reset()
            dsfuse.reset_report()
            hits = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
            torch.compile(indexer, backend="dsfuse", dynamic=True)(*inputs(3, seq))
            reports.append(dsfuse.report())
    assert counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"] > hits
    first, second = reports
    assert first.counts["indexer_topk"] == 1 and first.graphs[0].note == ""
    assert second.counts["indexer_topk"] == 1, second.graphs[0].note
    assert "sites restored" in second.graphs[0].note
