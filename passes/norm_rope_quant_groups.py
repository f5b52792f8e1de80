"""Launch groups of the `norm_rope_quant` pass: the glue calls of one layer that do not depend on each other,
merged into one `dsfuse::norm_rope_group` call, which runs them all in one kernel launch.

A call's *depth* is one more than the deepest glue call it depends on (through any path in the graph). Calls
of equal depth cannot depend on one another, and every dependency between groups of equal-depth calls runs
from a lower depth to a higher one, so merging each depth's calls keeps the graph acyclic. In an HF V3.2
layer this gives two launches: the q_a RMSNorm, the kv RMSNorm + RoPE and the indexer key's LayerNorm + RoPE
(all read only the first projections of the layer's input), then the main query's and the indexer query's
RoPE + cat (both read projections of the q_a norm's output). An HF V4 layer also gives two: the q_a norm, the
K=V head's and the compressors' norm + RoPE, then q_b's norm + RoPE and the indexer query's RoPE.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch._inductor.pattern_matcher import stable_topological_sort

from dsfuse.kernels.norm_rope_quant import GROUP_MEMBERS, group_member_lists

from .context import PassContext
from .graph_utils import insert_call, val

MEMBERS = {getattr(torch.ops.dsfuse, name).default: name for name in GROUP_MEMBERS}


def group_launches(graph: torch.fx.Graph, ctx: PassContext) -> None:
    """Merge the graph's glue calls of equal depth (on one device) into one `norm_rope_group` call each."""
    groups: dict[tuple, list[torch.fx.Node]] = {}
    level: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        level[node] = max((level[n] for n in node.all_input_nodes), default=0)
        if node.op == "call_function" and node.target in MEMBERS:
            level[node] += 1
            groups.setdefault((level[node], str(val(node.args[0]).device)), []).append(node)
    merged = [calls for calls in groups.values() if len(calls) > 1]
    for calls in merged:
        _merge(graph, calls, ctx)
    if merged:
        stable_topological_sort(graph)  # users of an earlier member may sit before the group call
        graph.eliminate_dead_code()


def _merge(graph: torch.fx.Graph, calls: list[torch.fx.Node], ctx: PassContext) -> None:
    tensors, ints, floats = [], [], []
    for call in calls:
        t, i, f = group_member_lists(MEMBERS[call.target], call.args, call.kwargs)
        tensors += t
        ints += i
        floats += f
    names = [MEMBERS[call.target] for call in calls]
    anchor = calls[-1].next
    group = insert_call(graph, anchor, torch.ops.dsfuse.norm_rope_group.default,
                        (",".join(names), tensors, ints, floats))
    offset = 0
    for call in calls:
        value = val(call)
        if isinstance(value, (tuple, list)):
            for user in [u for u in call.users if u.target is operator.getitem]:
                user.replace_all_uses_with(insert_call(graph, anchor, operator.getitem, (group, offset + user.args[1])))
            offset += len(value)
        else:
            call.replace_all_uses_with(insert_call(graph, anchor, operator.getitem, (group, offset)))
            offset += 1
    for call in calls:
        index = ctx.call_sites.get(call)
        if index is not None:
            site = ctx.sites[index]
            others = ", ".join(n for j, n in enumerate(names) if calls[j] is not call)
            ctx.sites[index] = dataclasses.replace(
                site, detail=f"{site.detail}; one launch with {len(calls) - 1} other site(s) ({others})")
