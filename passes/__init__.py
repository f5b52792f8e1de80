"""dsfuse graph passes: one module per fused family, applied to Inductor's post-grad graph."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from dsfuse.config import PASS_NAMES

from .context import PassContext

# Indices produced by the indexer feed sparse attention, so the indexer is rewritten first; the
# norm/rope glue goes after them because the other families only read its outputs; the hyper-connections
# last: they only read the blocks' outputs, so the other families see the graph they were written against.
RUN_ORDER: tuple[str, ...] = ("indexer_topk", "sparse_attention", "moe_experts", "norm_rope_quant", "hyper_connections")
assert sorted(RUN_ORDER) == sorted(PASS_NAMES)


def pass_module(name: str) -> ModuleType:
    if name not in PASS_NAMES:
        raise ValueError(f"unknown dsfuse pass {name!r}; valid pass names: {', '.join(PASS_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")


def implemented(name: str) -> bool:
    """Whether the family's matcher is on; until then the pass matches nothing."""
    return pass_module(name).IMPLEMENTED


def not_ready_reason(name: str) -> str:
    """Why a pass that is not on matches nothing, as the report says it."""
    return getattr(pass_module(name), "NOT_READY", "matcher not implemented yet: matches nothing")


def run_pass(name: str, graph: torch.fx.Graph, ctx: PassContext) -> None:
    """Run one pass over `graph`, recording sites and near-misses in `ctx`."""
    module = pass_module(name)
    if module.IMPLEMENTED:
        module.run(graph, ctx)


__all__ = ["PassContext", "RUN_ORDER", "implemented", "not_ready_reason", "pass_module", "run_pass"]
