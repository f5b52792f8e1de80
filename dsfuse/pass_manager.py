"""Runs the enabled dsfuse passes over Inductor's post-grad graph, each one after the canonicaliser
(`passes/canonicalize.py`), which brings equal math to one spelling without changing its numbers.

Inductor calls the manager as its `post_grad_custom_post_pass`. Its `uuid()` goes into the FX graph
cache key, so it hashes the enabled set together with the sources of every pass and kernel: toggling
a flag or editing a kernel can never be answered with a graph compiled for another configuration.
`DSFUSE_DEBUG` is in the key too, so turning it on compiles afresh and the passes log what they skip.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import report as _report
from .config import PASS_NAMES, debug_enabled

PACKAGE_ROOT = Path(__file__).resolve().parent


def _source_files() -> list[Path]:
    from dsfuse import kernels, passes

    roots = [PACKAGE_ROOT, Path(passes.__file__).parent, Path(kernels.__file__).parent]
    return sorted(path for root in roots for path in root.glob("*.py"))


def sources_digest() -> str:
    """A hash of every source file that decides what a compiled graph contains."""
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class DsfusePassManager(CustomGraphPass):
    """Applies the enabled passes in dependency order and records what each one did."""

    def __init__(self, enabled: tuple[str, ...]):
        unknown = [name for name in enabled if name not in PASS_NAMES]
        if unknown:
            raise ValueError(f"unknown dsfuse pass(es) {unknown}; valid pass names: {', '.join(PASS_NAMES)}")
        from dsfuse.passes import FAMILIES

        self.enabled = tuple(name for name in PASS_NAMES if name in enabled)
        # What actually runs, in run order: a pass that is off matches nothing whatever the flags say.
        self.families = tuple(f for f in FAMILIES if f.name in self.enabled and f.implemented)
        self.active = tuple(f.name for f in self.families)
        self.sites: list[_report.Site] = []
        self.near_misses: list[_report.NearMiss] = []
        self.runs = 0  # graphs this manager rewrote (none when Inductor served them from its cache)

    def __call__(self, graph: torch.fx.Graph) -> None:
        from dsfuse.passes import PassContext
        from dsfuse.passes.canonicalize import canonicalize
        from dsfuse.passes.graph_utils import drop_copies_of_fused_outputs, unpadded_inputs_of_fused_ops

        self.runs += 1
        graph_index = _report.current_graph()
        debug = debug_enabled()
        start = time.perf_counter()
        for family in self.families:
            fired = canonicalize(graph)  # again before each family: the one before may have left new spellings
            if debug and fired:
                _report.log.info("graph %d: canonicalised before %s: %s", graph_index, family.name, fired)
            ctx = PassContext(name=family.name, graph_index=graph_index)
            family.run(graph, ctx)
            # What a family replaced is dead now: left in, a later family would match it again (a phantom site).
            graph.eliminate_dead_code()
            self.sites.extend(ctx.sites)
            self.near_misses.extend(ctx.near_misses)
        if self.families:
            dropped = drop_copies_of_fused_outputs(graph)
            if debug and dropped:
                _report.log.info("graph %d: %d copies of fused outputs dropped", graph_index, dropped)
            unpadded_inputs_of_fused_ops(graph)
        graph.eliminate_dead_code()
        graph.lint()
        _report.record_pass_seconds(graph_index, time.perf_counter() - start)

    def uuid(self) -> str:
        families = ",".join(f"{f.name}:{f.uuid()}" for f in self.families)
        return hashlib.sha256(
            f"dsfuse|{families}|{debug_enabled()}|{torch.__version__}|{sources_digest()}".encode()
        ).hexdigest()
