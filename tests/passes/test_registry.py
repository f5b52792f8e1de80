"""The family registry, and the debug switch that logs what the families skip silently."""

import logging

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dsfuse
from dsfuse.pass_manager import DsfusePassManager
from dsfuse.passes import FAMILIES, RUN_ORDER, PassContext, family, run_pass


def test_every_pass_name_has_one_family_in_run_order():
    assert sorted(f.name for f in FAMILIES) == sorted(dsfuse.PASS_NAMES)
    assert RUN_ORDER[0] == "indexer_topk" and RUN_ORDER.index("indexer_topk") < RUN_ORDER.index("sparse_attention")
    assert DsfusePassManager(dsfuse.PASS_NAMES).active == RUN_ORDER


def test_family_uuid_hashes_its_own_sources(monkeypatch, tmp_path):
    norm = family("norm_rope_quant")
    assert len({f.uuid() for f in FAMILIES}) == len(FAMILIES)
    family_before, manager_before = norm.uuid(), DsfusePassManager(("norm_rope_quant",)).uuid()
    edited = tmp_path / "norm_rope_quant_groups.py"
    edited.write_text(open(norm.helpers[0].__file__).read() + "\n# edited\n")
    monkeypatch.setattr(norm.helpers[0], "__file__", str(edited))
    assert norm.uuid() != family_before, "a family's helper module is one of its sources"
    assert DsfusePassManager(("norm_rope_quant",)).uuid() != manager_before


def _plain_topk_graph() -> torch.fx.Graph:
    """A top-k with nothing of the indexer's signature: the indexer family rejects it without reporting it."""
    gm = make_fx(lambda x: x.topk(2, dim=-1).indices, tracing_mode="fake")(torch.randn(1, 3, 5))
    return gm.graph


def test_debug_switch_logs_silent_rejections(monkeypatch, caplog):
    for debug, logged in (("0", False), ("1", True)):
        monkeypatch.setenv("DSFUSE_DEBUG", debug)
        caplog.clear()
        ctx = PassContext(name="indexer_topk")
        with caplog.at_level(logging.INFO, logger="dsfuse"):
            run_pass("indexer_topk", _plain_topk_graph(), ctx)
        assert ctx.sites == [] and ctx.near_misses == [], "a silent rejection stays out of the report"
        messages = [r.getMessage() for r in caplog.records if r.name == "dsfuse"]
        assert any("not a head-weighted sum of relu scores" in m for m in messages) == logged, messages


def test_debug_switch_is_in_the_cache_key(monkeypatch):
    monkeypatch.setenv("DSFUSE_DEBUG", "0")
    quiet = DsfusePassManager(("indexer_topk",)).uuid()
    monkeypatch.setenv("DSFUSE_DEBUG", "1")
    assert DsfusePassManager(("indexer_topk",)).uuid() != quiet
