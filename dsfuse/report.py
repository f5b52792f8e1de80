"""What dsfuse rewrote, and why it left near-misses alone.

Every compilation appends to one process-wide record; `reset_report()` clears it and `report()`
returns a snapshot, so a user can compile, run, and then read what happened.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

from .config import PASS_NAMES

log = logging.getLogger("dsfuse")


@dataclass(frozen=True)
class Site:
    """One subgraph replaced by a fused op."""

    pass_name: str
    graph: int
    anchor: str
    op: str
    inputs: tuple[str, ...]
    detail: str = ""


@dataclass(frozen=True)
class NearMiss:
    """A candidate a pass found and did not rewrite, with the reason."""

    pass_name: str
    graph: int
    anchor: str
    reason: str


@dataclass
class GraphRecord:
    """One graph dsfuse compiled, with the passes that ran over it."""

    index: int
    nodes: int
    enabled: tuple[str, ...]
    note: str = ""
    # tokens per sequence of the step the graph computes (1: a decode step); None when the length is symbolic
    tokens: int | None = None
    # Dynamo's (frame, compile of that frame): graphs of one frame with a later compile number are its recompiles
    frame: tuple[int, int] | None = None
    # seconds dsfuse's passes (canonicaliser, matching, verification, rewrites) took on this graph; None when Inductor
    # served the graph from its cache and no pass ran
    pass_seconds: float | None = None


@dataclass
class Report:
    """Everything compiled since the last `reset_report()`."""

    graphs: list[GraphRecord] = field(default_factory=list)
    sites: list[Site] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return _counts(self.sites)

    @property
    def pass_seconds(self) -> float:
        """The compile time dsfuse's passes added: their seconds summed over the graphs they ran on."""
        return sum(g.pass_seconds for g in self.graphs if g.pass_seconds is not None)

    def _table(self) -> list[str]:
        lines = [f"dsfuse report: {len(self.graphs)} graph(s) compiled"]
        enabled = sorted({name for g in self.graphs for name in g.enabled}, key=PASS_NAMES.index)
        width = max(len(name) for name in PASS_NAMES)
        lines.append(f"  {'pass':<{width}}  {'rewritten':>9}  {'near-misses':>11}  state")
        misses = {name: 0 for name in PASS_NAMES}
        for miss in self.near_misses:
            misses[miss.pass_name] += 1
        from dsfuse.passes import implemented, not_ready_reason

        for name in PASS_NAMES:
            state = "enabled" if name in enabled else ("disabled" if self.graphs else "-")
            if not implemented(name):
                state += f" ({not_ready_reason(name)})"
            lines.append(f"  {name:<{width}}  {self.counts[name]:>9}  {misses[name]:>11}  {state}")
        return lines

    def summary(self) -> str:
        """One screen: sites and near-misses per pass, each graph note and each near-miss reason once, with where it
        happened (`details()` lists every site and every near-miss)."""
        lines = self._table()
        for note, graphs in _grouped((g.note, g.index) for g in self.graphs if g.note):
            lines.append(f"  {_graphs(graphs)}: {note}")
        if self.near_misses:
            lines.append("not rewritten:")
            for (pass_name, reason), where in _grouped(((m.pass_name, m.reason), (m.graph, m.anchor))
                                                       for m in self.near_misses):
                at = ", ".join(f"graph {g} at {anchor}" for g, anchor in where[:2])
                more = f" and {len(where) - 2} more" if len(where) > 2 else ""
                lines.append(f"  [{pass_name}] {reason} ({at}{more})")
        if self.sites:
            lines.append("every site: print(dsfuse.report().details())")
        return "\n".join(lines)

    def details(self) -> str:
        """Every graph note, every rewritten site with its inputs and every near-miss."""
        lines = self._table()
        for graph in self.graphs:
            if graph.note:
                lines.append(f"  graph {graph.index}: {graph.note}")
        if self.sites:
            lines.append("rewritten sites:")
            for site in self.sites:
                lines.append(f"  [{site.pass_name}] graph {site.graph} at {site.anchor} -> {site.op}"
                             f" ({', '.join(site.inputs)}){' ' + site.detail if site.detail else ''}")
        if self.near_misses:
            lines.append("not rewritten:")
            for miss in self.near_misses:
                lines.append(f"  [{miss.pass_name}] graph {miss.graph} at {miss.anchor}: {miss.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _counts(sites) -> dict[str, int]:
    """Sites per pass, every pass name a key."""
    counts = {name: 0 for name in PASS_NAMES}
    for site in sites:
        counts[site.pass_name] += 1
    return counts


def _grouped(pairs) -> list[tuple]:
    """(key, [values]) in the order keys first appear."""
    groups: dict = {}
    for key, value in pairs:
        groups.setdefault(key, []).append(value)
    return list(groups.items())


def _graphs(indices: list[int]) -> str:
    return f"graph {indices[0]}" if len(indices) == 1 else f"graphs {', '.join(map(str, indices))}"


_REPORT = Report()


def reset_report() -> None:
    """Forget everything recorded so far."""
    global _REPORT
    _REPORT = Report()


def report() -> Report:
    """A snapshot of what was compiled since the last `reset_report()`."""
    return copy.deepcopy(_REPORT)


def start_graph(nodes: int, enabled: tuple[str, ...], note: str = "", tokens: int | None = None,
                frame: tuple[int, int] | None = None) -> int:
    index = len(_REPORT.graphs)
    _REPORT.graphs.append(GraphRecord(index=index, nodes=nodes, enabled=enabled, note=note, tokens=tokens,
                                      frame=frame))
    if note:
        log.info("graph %d: %s", index, note)
    return index


def current_graph() -> int:
    return len(_REPORT.graphs) - 1


def record_site(site: Site) -> None:
    _REPORT.sites.append(site)
    log.info("[%s] graph %d: rewrote %s into %s", site.pass_name, site.graph, site.anchor, site.op)


def record_near_miss(miss: NearMiss) -> None:
    _REPORT.near_misses.append(miss)
    log.info("[%s] graph %d: left %s alone: %s", miss.pass_name, miss.graph, miss.anchor, miss.reason)


def record_pass_seconds(index: int, seconds: float) -> None:
    if 0 <= index < len(_REPORT.graphs):  # the manager called outside the backend has no graph record
        graph = _REPORT.graphs[index]
        graph.pass_seconds = (graph.pass_seconds or 0.0) + seconds


def annotate_graph(index: int, note: str) -> None:
    graph = _REPORT.graphs[index]
    graph.note = f"{graph.note}; {note}" if graph.note else note


def note_sites_lost_to_recompile(index: int) -> None:
    """Annotate graph `index` where it is a recompile of an earlier graph's frame with fewer sites of a family than
    that graph had: a length, batch or dtype the first compile did not see can cost a family, and the user should
    not have to diff reports to find out."""
    graph = _REPORT.graphs[index]
    if graph.frame is None:
        return
    earlier = [g for g in _REPORT.graphs[:index] if g.frame is not None and g.frame[0] == graph.frame[0]
               and g.frame[1] < graph.frame[1]]
    if not earlier:
        return
    previous = earlier[-1].index
    now, before = (_counts(s for s in _REPORT.sites if s.graph == of) for of in (index, previous))
    lost = [f"{name} {now[name]} (graph {previous}: {before[name]})" for name in PASS_NAMES if now[name] < before[name]]
    if lost:
        annotate_graph(index, f"a recompile of graph {previous}'s function with fewer sites: {', '.join(lost)}; "
                              "the near-misses say why where a pass saw a candidate")
