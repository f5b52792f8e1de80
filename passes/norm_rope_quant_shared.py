"""FP8 projections of one input, for the `norm_rope_quant` pass: the `dsfuse::fp8_linear` calls of a quantised
checkpoint that read the same tensor, rewritten into one `dsfuse::fp8_linears` call, which quantises the
activations once (per row and `block_k` channels, e4m3) and feeds every projection's GEMM from that.

In an HF DeepSeek V3.2 / GLM-MoE-DSA layer `q_a_proj`, `kv_a_proj_with_mqa` and the indexer's `wk` all read the
input_layernorm's output, `q_b_proj` and the indexer's `wq_b` the q_a_layernorm's, and an MLP's `gate_proj` and
`up_proj` (dense layers, shared experts) the post_attention_layernorm's; in a V4 layer `wq_a` and `wkv`, `wq_b` and
the indexer's `wq_b`, the shared experts' `w1` and `w3`. Each `fp8_linear` call quantises its input itself: at a
prefill that is the same [S, hidden] activations quantised two or three times over.

Binding: a call's input is looked through to the *shared input*: up through ops that keep the row-major order
of the elements (views, reshapes, squeezes, copies) while the last dim stays the weight's K, so `x` and
`x.view(-1, K)` are one input. The calls reading one shared input with e4m3 weights (graph inputs or attributes:
parameters), one `block_k` and one scale kind (fp32 or E8M0: the activations' scales are powers of two for
E8M0) form a group. The group's call reads the shared input; a projection that read a view of it gets its output
viewed back to its own shape. A group of one is left alone, as are FP4 weights (their activations are
dequantised to bf16, not quantised as these are). Two FP8 projections of one input that cannot share the call,
since their `block_k` or scale kinds differ, quantise it twice: a reported near-miss naming both (the later
one's group, if it has several projections, is still one call of its own).

Verification: the slice from the shared input through its views to each projection's output is run on probes
(rows of every magnitude with a zero row, random e4m3 weights and scales of the graph's kind) against
`fp8_linears_reference` on the shared input, each output viewed as the projection's: bit for bit. Unprobed, the
structural match standing: a slice over `verify.MAX_ELEMENTS` values (a real-dimension prefill's weights).

Stages: anchors `ANCHORS` (`dsfuse::fp8_linear`); binder `_match`; verifier `_verify` against
`fp8_linears_reference` (kernels/fp8_linear.py); rewrite `_rewrite`.
"""

from __future__ import annotations

import operator

import torch

from dsfuse.kernels.fp8_linear import fp8_linears_reference  # (also registers torch.ops.dsfuse.fp8_linears)
from dsfuse.kernels.quant_formats import E8M0_DTYPE, FP8_DTYPE

from .context import NoMatch, PassContext, rewrite_anchored
from .graph_utils import ORDER_KEEPING_OPS, aten, dtype, in_graph_order, insert_call, is_op, node_arg, shape, size_arg
from .verify import Family, Verdict, verify

ANCHORS = (torch.ops.dsfuse.fp8_linear.default,)
OP = torch.ops.dsfuse.fp8_linears.default
SITE = "dsfuse.fp8_linears"
PARAMETER_NODES = ("placeholder", "get_attr")


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, ANCHORS, _match, _rewrite)


# ---------------------------------------------------------------------------
# Binding
# ---------------------------------------------------------------------------
def _projection(node: torch.fx.Node) -> dict:
    """An `fp8_linear` call's arguments by name, its weight's (N, K) and its scale kind."""
    args = {name: node_arg(node, i, name) for i, name in enumerate(("x", "weight", "weight_scale", "block_n",
                                                                     "block_k"))}
    N, K = shape(args["weight"])[-2:]
    return {**args, "N": N, "K": K, "scales": "E8M0" if dtype(args["weight_scale"]) == E8M0_DTYPE else "fp32"}


def _groupable(node: torch.fx.Node) -> bool:
    """An `fp8_linear` call that can join a group: e4m3 weights held as parameters (read or not: a call replaced by
    an earlier group's still says which projection came first)."""
    if not is_op(node, *ANCHORS):
        return False
    p = _projection(node)
    return (dtype(p["weight"]) == FP8_DTYPE and all(isinstance(p[name], torch.fx.Node) and p[name].op in
                                                     PARAMETER_NODES for name in ("weight", "weight_scale"))
            and all(type(p[name]) is int for name in ("block_n", "block_k", "K")))


def _ends_in(node: torch.fx.Node, K: int) -> bool:
    """Whether `node` is a tensor whose last dim is K, a static size (a symbolic one is never read: no guard)."""
    size = shape(node)[-1:]
    return bool(size) and type(size[0]) is int and size[0] == K


def _keeps_rows(node, K: int) -> bool:
    """An op that keeps the row-major order of its input's elements, whose input and output both end in K."""
    return (is_op(node, *ORDER_KEEPING_OPS) and isinstance(node.args[0], torch.fx.Node) and _ends_in(node, K)
            and _ends_in(node.args[0], K))


def _shared_input(x: torch.fx.Node, K: int) -> torch.fx.Node:
    """`x`, or the node it is an order-keeping view of, up through such ops while the last dim stays K."""
    while _keeps_rows(x, K):
        x = x.args[0]
    return x


def _readers(root: torch.fx.Node, K: int) -> list[torch.fx.Node]:
    """The groupable `fp8_linear` calls whose input is `root` or an order-keeping view of it (last dim K), in graph
    order."""
    found, pending, seen = set(), [root], set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if _groupable(user) and node_arg(user, 0, "x") is node and _projection(user)["K"] == K:
                found.add(user)
            elif _keeps_rows(user, K) and user.args[0] is node:
                pending.append(user)
    return in_graph_order(found)


def _key(p: dict) -> tuple:
    """What projections sharing one call must agree on: the activations' quantisation (block_k channels, power-of-two
    scales or not). Block heights may differ (a per-tensor scale is one block of the weight's N rows)."""
    return p["block_k"], p["scales"]


def _describe(node: torch.fx.Node, p: dict) -> str:
    return f"{node} ([{p['N']}, {p['K']}] weight, block {p['block_n']} x {p['block_k']}, {p['scales']} scales)"


def _mismatch(node: torch.fx.Node, first: torch.fx.Node) -> str:
    """Why `node` cannot share `first`'s call, both named."""
    p, q = _projection(node), _projection(first)
    if p["scales"] != q["scales"]:
        why = f"its weight scales are {p['scales']}, the other's {q['scales']} (one call takes one scale kind)"
    else:
        why = (f"it quantises its activations per {p['block_k']} channels, the other per {q['block_k']} (one call "
               f"quantises them once)")
    return (f"FP8 projection {_describe(node, p)} reads the same input as {_describe(first, q)}, but {why}: "
            f"the input is quantised once for each")


def _match(node: torch.fx.Node) -> dict:
    if not node.users:
        raise NoMatch("replaced by its group's fp8_linears call", reported=False)
    if not _groupable(node):
        raise NoMatch("FP4 weights (activations dequantised to bf16) or weights computed in the graph",
                      reported=False)
    p = _projection(node)
    root = _shared_input(p["x"], p["K"])
    readers = _readers(root, p["K"])
    mine = [n for n in readers if n.users and _key(_projection(n)) == _key(p)]
    if node is not mine[0]:
        raise NoMatch(f"in the group of {mine[0]}", reported=False)
    first = readers[0]
    mismatch = None if _key(_projection(first)) == _key(p) else _mismatch(node, first)
    if len(mine) < 2:
        raise NoMatch(mismatch or "the only FP8 projection of its input", reported=mismatch is not None)
    verdict = _verify(root, mine)
    if verdict.ok is False:
        raise NoMatch(f"FP8 projections of one input: numeric check against fp8_linears' reference failed: "
                      f"{verdict.reason}")
    return {"root": root, "members": mine, "mismatch": mismatch}


# ---------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------
def _verify(root: torch.fx.Node, members: list[torch.fx.Node]) -> Verdict:
    """Run the slice from the shared input through its views to each projection on `_probes` against
    `fp8_linears_reference` on the shared input, each output viewed as the projection's own: bit for bit."""
    projections = [_projection(m) for m in members]
    p = projections[0]
    pairs = [(q["weight"], q["weight_scale"]) for q in projections]
    block_ns = [q["block_n"] for q in projections]
    params = list(dict.fromkeys(n for pair in pairs for n in pair))  # a tensor read twice is one role
    roles = {"x": root, **{f"param{i}": n for i, n in enumerate(params)}}
    role_of = {n: role for role, n in roles.items()}
    order = [(role_of[weight], role_of[scale]) for weight, scale in pairs]

    def reference(probe):
        return fp8_linears_reference(probe["x"], [probe[w] for w, _ in order], [probe[s] for _, s in order],
                                     block_ns, p["block_k"])

    family = Family(probes=_probes, reference=reference, compare=_same_bits)
    return verify(members, roles, family, ("fp8_linears", tuple(block_ns), p["block_k"], tuple(order)))


def _probes(shapes: dict, dtypes: dict) -> list[tuple[str, dict]]:
    """Rows at magnitudes 2^-8 to 2^8 about offsets of every sign, the first row zero (the amax floor); e4m3 weights
    of every sign; fp32 scales about 1, or E8M0 ones from 2^-4 to 2^4."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shapes["x"], generator=gen) + torch.randn((*shapes["x"][:-1], 1), generator=gen)
    x = x * torch.exp2(torch.randint(-8, 9, (*shapes["x"][:-1], 1), generator=gen).float())
    x.view(-1, x.shape[-1])[:1] = 0.0
    probe = {"x": x.to(dtypes["x"])}
    for role, kind in dtypes.items():
        if kind == FP8_DTYPE:
            probe[role] = (torch.randn(shapes[role], generator=gen) * 32).clamp(-448, 448).to(FP8_DTYPE)
        elif kind == E8M0_DTYPE:
            probe[role] = torch.randint(123, 132, shapes[role], generator=gen, dtype=torch.uint8).view(E8M0_DTYPE)
        elif role != "x":
            probe[role] = (torch.rand(shapes[role], generator=gen) + 0.5).to(kind)
    return [("rows of every magnitude, a zero row", probe)]


def _same_bits(got: list, want: list, probe: dict) -> str | None:
    """None when each projection's output is the reference's, viewed as the projection's, bit for bit."""
    for i, (out, ref) in enumerate(zip(got, want)):
        if not isinstance(out, torch.Tensor) or out.dtype != ref.dtype or out.numel() != ref.numel():
            return f"projection {i}: not {ref.numel()} {ref.dtype} values"
        ref = ref.reshape(out.shape)
        same = (out == ref) | (out.isnan() & ref.isnan())
        if not same.all():
            return f"projection {i}: {int((~same).sum())} of {ref.numel()} values differ"
    return None


# ---------------------------------------------------------------------------
# Rewrite
# ---------------------------------------------------------------------------
def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, found: dict, ctx: PassContext) -> None:
    root, members = found["root"], found["members"]
    projections = [_projection(m) for m in members]
    p = projections[0]
    call = insert_call(graph, members[0], OP, (root, [q["weight"] for q in projections],
                                               [q["weight_scale"] for q in projections],
                                               [q["block_n"] for q in projections], p["block_k"]))
    for i, (member, q) in enumerate(zip(members, projections)):
        out = insert_call(graph, member, operator.getitem, (call, i))
        if q["x"] is not root:  # the projection read a view of the shared input: its output viewed back
            lead = [size_arg(graph, member, q["x"], d) for d in range(len(shape(q["x"])) - 1)]
            out = insert_call(graph, member, aten.reshape.default, (out, [*lead, q["N"]]))
        member.replace_all_uses_with(out)
    widths = ", ".join(str(q["N"]) for q in projections)
    blocks = ", ".join(dict.fromkeys(f"{q['block_n']} x {q['block_k']}" for q in projections))
    detail = (f"one activation quantisation for {len(members)} FP8 projections (N = {widths}) of [..., {p['K']}] "
              f"(block {blocks}, {p['scales']} scales)")
    ctx.site(members[0], SITE, [root, *(q["weight"] for q in projections)], detail=detail, call=call)
    if found["mismatch"]:
        ctx.near_miss(members[0], found["mismatch"])
