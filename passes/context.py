"""What a pass reports while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsfuse.config import debug_enabled
from dsfuse.report import NearMiss, Site, log


class NoMatch(Exception):
    """Raised by a matcher to stop at a candidate; `reported` says whether users should hear why.

    A candidate that already shows its family's signature (say, a top-k over head-weighted relu
    scores) is a near-miss worth reporting; a top-k elsewhere in the model is not.
    """

    def __init__(self, reason: str, reported: bool = True):
        super().__init__(reason)
        self.reason = reason
        self.reported = reported


@dataclass
class PassContext:
    name: str
    graph_index: int = -1
    sites: list[Site] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    call_sites: dict[torch.fx.Node, int] = field(default_factory=dict)  # fused call -> index of its site

    def site(self, anchor: torch.fx.Node | str, op: str, inputs: list[torch.fx.Node], detail: str = "",
             call: torch.fx.Node | None = None) -> None:
        """Record a rewritten site; `call` (the fused call) lets a later step of the pass amend its detail."""
        from .graph_utils import describe

        if call is not None:
            self.call_sites[call] = len(self.sites)
        self.sites.append(Site(
            pass_name=self.name, graph=self.graph_index, anchor=str(anchor), op=op,
            inputs=tuple(describe(n) for n in inputs if n is not None), detail=detail,
        ))

    def near_miss(self, anchor: torch.fx.Node | str, reason: str) -> None:
        self.near_misses.append(NearMiss(pass_name=self.name, graph=self.graph_index, anchor=str(anchor), reason=reason))


def rewrite_anchored(graph: torch.fx.Graph, ctx: PassContext, targets: tuple, match: Callable[[torch.fx.Node], Any],
                     rewrite: Callable[[torch.fx.Graph, torch.fx.Node, Any, PassContext], None]) -> None:
    """Try `match` at every node calling one of `targets`; rewrite what matches, report reported misses.

    Under `DSFUSE_DEBUG=1` the silent misses are logged too, so a spelling a family does not know shows up.
    """
    debug = debug_enabled()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        try:
            found = match(node)
        except NoMatch as miss:
            if miss.reported:
                ctx.near_miss(node, miss.reason)
            elif debug:
                log.info("[%s] graph %d: skipped %s (not reported): %s", ctx.name, ctx.graph_index, node, miss.reason)
            continue
        rewrite(graph, node, found, ctx)
