"""dsfuse graph passes: one module per fused family, applied to Inductor's post-grad graph.

`FAMILIES` is the one registry: the pass manager, the report and the tests reach every family through
it, so a reader (or a static tool) can follow the backend into each pass without a lookup by name.
Adding a family is one import and one `FamilyPass(module)` line below, in run order, plus its name in
`dsfuse.config.PASS_NAMES`. A family module provides `NAME`, `IMPLEMENTED`, `run(graph, ctx)` and
optionally `NOT_READY` (why it matches nothing while `IMPLEMENTED` is false).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from dsfuse.config import PASS_NAMES

from . import compressors
from . import hyper_connections
from . import indexer_topk
from . import moe_experts
from . import norm_rope_quant
from . import norm_rope_quant_groups
from . import norm_rope_quant_shared
from . import sparse_attention
from .context import NoMatch, PassContext

NOT_IMPLEMENTED = "matcher not implemented yet: matches nothing"


@dataclass(frozen=True)
class FamilyPass:
    """One family: its module's matcher and rewriter, and the sources that decide what it rewrites."""

    module: ModuleType
    helpers: tuple[ModuleType, ...] = ()  # modules of the family's own beside its main one

    @property
    def name(self) -> str:
        return self.module.NAME

    @property
    def implemented(self) -> bool:
        """Whether the family's matcher is on; until then the pass matches nothing (read live, not cached)."""
        return self.module.IMPLEMENTED

    @property
    def not_ready_reason(self) -> str:
        return getattr(self.module, "NOT_READY", NOT_IMPLEMENTED)

    def uuid(self) -> str:
        """A hash of the family's own sources (the pass manager's key also covers every shared source)."""
        digest = hashlib.sha256(self.name.encode())
        for module in (self.module, *self.helpers):
            digest.update(Path(module.__file__).read_bytes())
        return digest.hexdigest()

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> None:
        """Rewrite this family's sites in `graph`, recording sites and near-misses in `ctx`."""
        if self.implemented:
            self.module.run(graph, ctx)


# In run order: indices produced by the indexer feed sparse attention, so the indexer is rewritten first;
# the V4 compressors next (the indexer and the attention only read the compressed entries), before the norm/rope
# glue, which would otherwise take a compressor's own RMSNorm + RoPE and leave its pooling unfused; the glue after
# them because the other families only read its outputs; the hyper-connections last: they only read the blocks'
# outputs, so the other families see the graph they were written against.
FAMILIES: tuple[FamilyPass, ...] = (
    FamilyPass(indexer_topk),
    FamilyPass(sparse_attention),
    FamilyPass(moe_experts),
    FamilyPass(compressors),
    FamilyPass(norm_rope_quant, helpers=(norm_rope_quant_groups, norm_rope_quant_shared)),
    FamilyPass(hyper_connections),
)

BY_NAME: dict[str, FamilyPass] = {family.name: family for family in FAMILIES}
RUN_ORDER: tuple[str, ...] = tuple(BY_NAME)
assert sorted(RUN_ORDER) == sorted(PASS_NAMES), "every name in PASS_NAMES needs exactly one FamilyPass entry"


def family(name: str) -> FamilyPass:
    if name not in BY_NAME:
        raise ValueError(f"unknown dsfuse pass {name!r}; valid pass names: {', '.join(PASS_NAMES)}")
    return BY_NAME[name]


def implemented(name: str) -> bool:
    """Whether the family's matcher is on; until then the pass matches nothing."""
    return family(name).implemented


def not_ready_reason(name: str) -> str:
    """Why a pass that is not on matches nothing, as the report says it."""
    return family(name).not_ready_reason


def run_pass(name: str, graph: torch.fx.Graph, ctx: PassContext) -> None:
    """Run one pass over `graph`, recording sites and near-misses in `ctx`."""
    family(name).run(graph, ctx)


__all__ = ["FAMILIES", "FamilyPass", "NoMatch", "PassContext", "RUN_ORDER", "family", "implemented",
           "not_ready_reason", "run_pass"]
