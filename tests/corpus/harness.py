"""What every spelling corpus shares: an entry's declared outcome, compiling it with one family enabled and
checking the report says exactly that, and the coverage every corpus must keep.

A corpus file lists `Entry`s (a subclass adds fields its family needs) in a `CORPUS` dict and checks each with

    got, want, rep = run_entry(entry, "family_name")   # compiled and eager outputs (lists), the report
    ... compare got with want as the family's numerics rules ask ...

and ends with `check_coverage(CORPUS, ops={...})`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

import dsfuse

REWRITTEN, NEAR_MISS, LEFT_ALONE = "rewritten", "near-miss", "left alone"
MIN_REWRITTEN = 12  # independent formulations a family's corpus must rewrite


@dataclass(frozen=True)
class Formulation:
    """What every corpus entry has; a family whose outcome needs other fields extends it."""
    fn: Callable
    source: str  # the code the formulation is written after
    inputs: Callable[[], tuple]
    outcome: str  # REWRITTEN, NEAR_MISS or LEFT_ALONE


@dataclass(frozen=True)
class Entry(Formulation):
    count: int = 0  # for a rewrite: the family's sites rewritten
    op: str = ""  # for a rewrite: the fused op of every site ("": not checked)
    reason: str = ""  # for a near-miss: the reason, word for word
    detail: str = ""  # for a rewrite: text every site's detail contains


def outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check_outcome(entry: Entry, family: str, rep) -> None:
    """The report shows the entry's declared outcome for `family`, and nothing else from it."""
    reasons = [m.reason for m in rep.near_misses if m.pass_name == family]
    sites = [s for s in rep.sites if s.pass_name == family]
    if entry.outcome == REWRITTEN:
        assert (rep.counts[family], reasons) == (entry.count, []), str(rep)
        if entry.op:
            assert [s.op for s in sites] == [entry.op] * entry.count, str(rep)
        assert all(entry.detail in s.detail for s in sites), str(rep)
    elif entry.outcome == NEAR_MISS:
        assert (rep.counts[family], reasons) == (0, [entry.reason]), str(rep)
    else:
        assert entry.outcome == LEFT_ALONE, entry.outcome
        assert (rep.counts[family], reasons) == (0, []), str(rep)


def compile_entry(entry, family: str) -> tuple[list, list, object]:
    """Compile `entry.fn` (any entry with `fn` and `inputs`) with only `family` enabled; (compiled outputs, eager
    outputs, the report). A corpus whose entries declare more than one op checks the report itself."""
    args = entry.inputs()
    with torch.no_grad():
        got = torch.compile(entry.fn, backend="dsfuse", options={"enable": [family]})(*args)
        rep = dsfuse.report()
        want = entry.fn(*args)
    got, want = outputs(got), outputs(want)
    assert len(got) == len(want), (len(got), len(want))
    return got, want, rep


@functools.cache
def inductor_drops_narrowing_casts() -> bool:
    """Whether this torch's Inductor removes `x.to(bf16).to(fp32)` before the passes see the graph: older joint-graph
    passes drop any float convert chain, newer ones keep a narrower intermediate. An entry whose only difference
    from a rewritten one is such a rounding ends as that one where the rounding is gone."""
    kept = []

    def record(graph):
        kept.append(any(n.target is torch.ops.prims.convert_element_type.default and n.args[1] == torch.bfloat16
                        for n in graph.nodes))

    with torch._inductor.config.patch(post_grad_custom_post_pass=record, fx_graph_cache=False):
        torch.compile(lambda x: x.to(torch.bfloat16).float() * 2, backend="inductor")(torch.randn(4))
    return not kept[0]


def run_entry(entry: Entry, family: str) -> tuple[list, list, object]:
    """`compile_entry`, then the declared outcome checked."""
    got, want, rep = compile_entry(entry, family)
    check_outcome(entry, family, rep)
    return got, want, rep


def check_coverage(corpus: dict[str, Entry], ops: set[str] | None = None) -> None:
    """At least `MIN_REWRITTEN` formulations rewritten, every declared outcome kind present, and (when given) every
    fused op of the family among the rewrites."""
    rewritten = [e for e in corpus.values() if e.outcome == REWRITTEN]
    assert len(rewritten) >= MIN_REWRITTEN
    assert {e.outcome for e in corpus.values()} == {REWRITTEN, NEAR_MISS, LEFT_ALONE}
    if ops is not None:
        assert {e.op for e in rewritten} == ops
