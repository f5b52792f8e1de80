"""Graph forms other Inductor configurations hand dsfuse's passes, applied to CPU graphs as a
`post_grad_custom_pre_pass` so the matchers can be tested against them on any machine.

- `to_online_softmax`: on CUDA, Inductor rewrites amax / sub / exp / sum into `prepare_softmax_online`.
- `batch_one_bmm_as_mm`: on CUDA, Inductor's joint-graph `bmm_to_mm` computes a bmm of batch 1 as
  `mm(a.squeeze(0), b.squeeze(0)).unsqueeze(0)` (a decode step's one token makes the batch of a per-token bmm 1).
- `pad_matmuls`: on CUDA, Inductor's pad_mm (when its benchmark finds it faster: compute-bound products with dims
  that are not multiples of the dtype's alignment, at static shapes) computes `a @ b` as `bmm(pad(a), pad(b))` (or
  `mm`) with zeros appended to the contraction dim and to M / N, then slices M / N back.
- `drop_narrowing_round_trips`: torch 2.11's and 2.12's `pointless_convert` (a joint-graph pattern, for every
  device in 2.12's source) folds `x.to(bf16).to(fp32)` into `x.to(fp32)` (2.13 and later keep a narrower
  intermediate); with an fp32 x the chain disappears. `inductor_folds_narrowing_round_trips()` asks the installed
  torch whether it does so itself.
- `keep_constant_wheres_in_float32`: torch 2.11 on CUDA drops the cast of a `where` of two fp32 scalar constants
  (Inductor's one-index scatter `where(index == arange, 0., -inf)`) to bf16, so what it feeds is promoted to fp32.
  torch 2.12 writes that form on CPU too: such wheres, found already without a cast, are listed in `FLOAT32_WHERES`.
"""

import functools
import operator

import torch
import torch._inductor.inductor_prims  # noqa: F401  (defines prims.prepare_softmax_online)

from dsfuse.passes.graph_utils import fake_call, insert_call

aten = torch.ops.aten
CONVERT = torch.ops.prims.convert_element_type.default
REWRITES: list = []
FLOAT32_WHERES: list = []  # constant fp32 wheres that reached the pass without a cast (the form it would write)


def to_online_softmax(graph: torch.fx.Graph) -> None:
    for amax in [n for n in graph.nodes if n.target is aten.amax.default]:
        x = amax.args[0]
        sums = [s for u in amax.users if u.target is aten.sub.Tensor for e in u.users
                if e.target is aten.exp.default for s in e.users if s.target is aten.sum.dim_IntList]
        if len(sums) != 1:
            continue
        with graph.inserting_before(amax):
            online = graph.call_function(torch.ops.prims.prepare_softmax_online.default, (x, amax.args[1][0]))
            row_max = graph.call_function(operator.getitem, (online, 0))
            row_sum = graph.call_function(operator.getitem, (online, 1))
        online.meta["val"] = (amax.meta["val"], sums[0].meta["val"])
        row_max.meta["val"], row_sum.meta["val"] = amax.meta["val"], sums[0].meta["val"]
        amax.replace_all_uses_with(row_max)
        sums[0].replace_all_uses_with(row_sum)
        graph.erase_node(sums[0])
        graph.erase_node(amax)
        REWRITES.append(online)


def drop_narrowing_round_trips(graph: torch.fx.Graph) -> None:
    for outer in [n for n in graph.nodes if n.target is CONVERT and n.args[0].target is CONVERT]:
        inner = outer.args[0]
        source = inner.args[0]
        if outer.args[1] != torch.float32 or inner.args[1] not in (torch.bfloat16, torch.float16):
            continue
        if source.meta["val"].dtype == torch.float32:
            outer.replace_all_uses_with(source)
        else:
            with graph.inserting_before(outer):
                direct = graph.call_function(CONVERT, (source, torch.float32))
            direct.meta["val"] = outer.meta["val"]
            outer.replace_all_uses_with(direct)
        graph.erase_node(outer)
        if not inner.users:
            graph.erase_node(inner)
        REWRITES.append(outer)


@functools.cache
def inductor_folds_narrowing_round_trips() -> bool:
    """Whether the installed torch's Inductor folds `x.to(bf16).to(fp32)` into `x.to(fp32)` before the post-grad
    passes (torch 2.11 and 2.12: then its graphs are already in `drop_narrowing_round_trips`' form)."""
    kept = []

    def record(graph: torch.fx.Graph) -> None:
        kept.extend(n for n in graph.nodes if n.target is CONVERT and n.args[1] == torch.bfloat16)

    with torch._inductor.config.patch(post_grad_custom_pre_pass=record, force_disable_caches=True):
        torch.compile(lambda x: x.to(torch.bfloat16).to(torch.float32) * 2, backend="inductor",
                      dynamic=False)(torch.ones(4))
    return not kept


def _constant(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.target in (aten.scalar_tensor.default, aten.full.default)


def keep_constant_wheres_in_float32(graph: torch.fx.Graph) -> None:
    FLOAT32_WHERES.extend(
        n for n in graph.nodes
        if n.target is aten.where.self and _constant(n.args[1]) and _constant(n.args[2])
        and n.meta["val"].dtype == torch.float32 and not any(u.target is CONVERT for u in n.users))
    for cast in [n for n in graph.nodes if n.target is CONVERT and n.args[0].target is aten.where.self]:
        where = cast.args[0]
        if not (_constant(where.args[1]) and _constant(where.args[2]) and where.meta["val"].dtype == torch.float32):
            continue
        cast.replace_all_uses_with(where)
        graph.erase_node(cast)
        REWRITES.append(where)
        promoted = {where}
        for node in graph.nodes:  # the consumers' fake values, re-derived where their inputs' dtypes changed
            if node.op == "call_function" and promoted & set(node.all_input_nodes):
                value = fake_call(node.target, node.args, node.kwargs)
                if isinstance(value, torch.Tensor) and value.dtype != node.meta["val"].dtype:
                    node.meta["val"] = value
                    promoted.add(node)


def batch_one_bmm_as_mm(graph: torch.fx.Graph) -> None:
    for bmm in [n for n in graph.nodes if n.target is aten.bmm.default]:
        a, b = bmm.args
        if a.meta["val"].shape[0] != 1 or b.meta["val"].shape[0] != 1:
            continue
        squeezed = tuple(insert_call(graph, bmm, aten.squeeze.dim, (t, 0)) for t in (a, b))
        mm = insert_call(graph, bmm, aten.mm.default, squeezed)
        bmm.replace_all_uses_with(insert_call(graph, bmm, aten.unsqueeze.default, (mm, 0)))
        graph.erase_node(bmm)
        REWRITES.append(mm)


def _padding(size: int, align: int = 8) -> int:
    return -size % align


def pad_matmuls(graph: torch.fx.Graph, min_dim: int = 16, mms: bool = False) -> None:
    """Every bmm (and with `mms` every mm) with all of M, K, N at least `min_dim` (the compute-bound ones pad_mm
    considers), one of them not a multiple of 8, written as pad_mm writes it."""
    targets = (aten.bmm.default, aten.mm.default) if mms else (aten.bmm.default,)
    for product in [n for n in graph.nodes if n.target in targets]:
        a, b = product.args
        M, K = a.meta["val"].shape[-2:]
        N = b.meta["val"].shape[-1]
        pm, pk, pn = _padding(M), _padding(K), _padding(N)
        if min(M, K, N) < min_dim or not (pm or pk or pn):
            continue
        batch = [0, 0] if product.target is aten.bmm.default else []
        a_pad = insert_call(graph, product, aten.constant_pad_nd.default, (a, [0, pk, 0, pm, *batch]))
        b_pad = insert_call(graph, product, aten.constant_pad_nd.default, (b, [0, pn, 0, pk, *batch]))
        out = insert_call(graph, product, product.target, (a_pad, b_pad))
        rank = len(a.meta["val"].shape)
        for dim, pad in ((rank - 2, pm), (rank - 1, pn)):
            if pad:
                out = insert_call(graph, product, aten.slice.Tensor, (out, dim, 0, -pad))
        product.replace_all_uses_with(out)
        graph.erase_node(product)
        REWRITES.append(out)


def as_torch_2_11_on_cuda(graph: torch.fx.Graph) -> None:
    to_online_softmax(graph)
    drop_narrowing_round_trips(graph)
