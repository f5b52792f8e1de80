"""`moe_experts`: routed SwiGLU experts (route -> expert GEMM -> SwiGLU -> expert GEMM -> weight -> combine)
rewritten into one `dsfuse::moe_experts_bf16`, `dsfuse::moe_experts_fp4` or `dsfuse::moe_experts_fp8` call.

The anchor is an expert GEMM: `aten._grouped_mm`, transformers' `grouped_mm_fallback` (its CPU/fp32 stand-in) or
`dsfuse::fp8_grouped_linear` (a released checkpoint's FP8 / FP4 experts, block-scaled) over expert-sorted rows, or a
`bmm` of per-slot gathered expert weights `W[ids]` (`matmul` and `einsum` lower to it; its output squeezed or
reshaped). From the first GEMM of a block:

    slots      s = t*k + j of `ids [T,k]`, visited in `perm = sort(ids.flatten())` order (grouped, own model) or
               in place (HF batched_mm); rows `x[perm // k]` or `x.repeat_interleave(k)`
    offsets    `cumsum(counts)` of `histc(ids, bins=E, min=0, max=E-1)` or a one-hot sum `(ids[:, None] ==
               arange(E)).sum(0)` (of the sorted or the flat ids: a count ignores order), or the group ends
               `searchsorted(sorted_ids, arange(E), right=True)` (grouped)
    gate       `split(h, I)` or slices `[:, :I]`, `[:, I:]` -> `silu(gate) * up` in x's dtype (SiLU checked by
               evaluating the gate's ops), or DeepSeek V4's `silu(gate.clamp(max=L)) * up.clamp(-L, L)` (both
               clamps evaluated around +-L: one L)
    weighting  `out * w.flatten()[perm]` (optionally cast to x's dtype first); batched also
               `out.view(T, k, H) * w.view(T, k, 1)`
    combine    `out[inverse(perm)].view(T, k, H).sum(1)` (HF), `out.view(T, k, H).sum(1)` (batched; sorted slots
               put back by the inverse permutation before or after the weighting),
               `einsum('tkh,tk->th', out.view(T, k, H).float(), w)` (fp32 weights), or an accumulation into
               `zeros(T, H)` at `perm // k` (slots in place: `arange(T*k) // k`): `index_add_` (own model),
               `scatter_add_`, `scatter_reduce(sum)`, in the activations' dtype or in fp32 and then cast

Every matched block (plain, FP4-decoded or block-scaled weights) is then run on probes against its op's reference
(`verify.py`): a random routing whose unrouted expert holds NaN weights or scales (reading it shows), every slot on
one expert (duplicate ids), zero router weights, and under expert parallelism other ranks' sentinel ids. The output
must have the reference's NaNs and be within `BUDGET` of it; a block that is not is a near-miss naming the failing
probe. Probes run at the graph's static sizes: a block whose stacks hold more than `verify.MAX_ELEMENTS` values (a
real checkpoint's experts) is not run, and its structural match stands.

Dense weights `[E, 2I, H]` / `[E, H, I]` become `moe_experts_bf16`; block-scaled weights with their scales (both
GEMMs `fp8_grouped_linear` in one format and block size) become `moe_experts_fp8`; weights decoded in the graph from FP4
(E2M1 nibbles + E8M0 per-32 scales) become `moe_experts_fp4` on the packed bytes. The decode is recognised by
what it computes, not by its spelling: each nibble branch, the value table and the scale transform are evaluated
on all 256 byte values and compared with the format (LUT gather, `exp2`, `ldexp` and `pow` all pass).

transformers' expert-parallel path (`_is_expert_parallel`) gives local ids with the sentinel `E` for other
ranks' slots and masks those rows to 0 (grouped: after each GEMM in bf16, after the router weighting in FP8) or
clamps the ids and zeroes their weights (batched); the fused ops skip every id outside `[0, E)`, so it maps to
`local_expert_offset=0` on the local ids.

Separate gate and up stacks (DeepSeek's w1/w3: two expert GEMMs of the same rows, in either order) bind
`moe_experts_bf16`'s gate (`gate_up`) and `up` arguments; two GEMMs over the halves `W[:, :I]`, `W[:, I:]` of one
stack bind that stack. Stacks stored `[E, K, N]` (`rows @ W[ids]`, `grouped_mm(rows, W)`, HF's `is_transposed`) are
passed as their `.transpose(1, 2)` views, which the op reads through their strides: nothing is copied. FP4-decoded and
block-scaled weights apart or stored `[E, K, N]` are reported: their ops read one K-contiguous gate_up stack.

A dense MoE (every expert on every token over whole weight stacks, by `einsum` or a loop over the experts, the
router weights spread over all experts by a scatter or a one-hot) is the op with k = E: token t's slot e is expert e,
weighted by the dense `[T, E]` weights, so a zero weight on a non-finite output gives NaN as in the source. It is
bound by what it reads (the gate GEMM's rows, the two whole stacks, the one `[T, E]` tensor that weights the expert
outputs, and the first `[T, H]` tensor in x's dtype that every down GEMM reaches) and proven on probes, each stack
tried in the op's layout and stored `[E, K, N]` where the sizes cannot tell. A loop over the experts whose rows a
`nonzero()` picks is reported (compiled whole only when Dynamo captures data-dependent shapes). A bmm that does not gather expert weights, and the second GEMM of a
block, are skipped silently; a first expert GEMM that cannot be rewritten is reported with the reason. transformers'
eager experts loop never reaches a graph whole (it breaks at `nonzero()`); its expert-mask graph is reported so users
see why nothing fused.

Stages: anchors `GROUPED_ANCHORS` (with transformers' fallback op where it is registered) and `GATHERED_ANCHORS`, then
`EAGER_LOOP_ANCHORS` (reported only) and `DENSE_ANCHORS`; binders `_match` and, for dense blocks, `_dense_block`;
verifiers `_verify` and `_verify_dense`, against `moe_experts_bf16_reference` and `moe_experts_reference` (FP4,
kernels/moe_experts.py) and `moe_experts_fp8_reference` (kernels/moe_experts_fp8.py); rewrites `_rewrite` into
`dsfuse::moe_experts_bf16`, `_fp4` or `_fp8` and `_rewrite_dense` into `dsfuse::moe_experts_bf16`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dsfuse.kernels.fp8_linear import weight_dims
# Importing the references also registers the ops they are the CPU implementations of (torch.ops.dsfuse.moe_experts_*).
from dsfuse.kernels.moe_experts import moe_experts_bf16_reference, moe_experts_reference
from dsfuse.kernels.moe_experts_fp8 import moe_experts_fp8_reference

from .context import NoMatch, PassContext, rewrite_anchored
from .dims import WILDCARD, follow, leaf_labels, leaf_of_rank, normalise
from .graph_utils import (CONVERT, FLOAT_DTYPES, INDEX_DTYPES, LAYOUT_OPS, ORDER_KEEPING_OPS, SPLIT_OPS,
                          TRANSPOSE_OPS, VIEW_OPS, aten, dtype, fill_value, in_graph_order, insert_call, is_op,
                          node_arg, only_user, reaches_back, same_shape, same_size, shape, size_arg, slice_args,
                          slice_position, strip, tensor_val, walk_back)
from .verify import MAX_ELEMENTS, MAX_NODES, Family, Verdict, pure_slice, verify

NAME = "moe_experts"
IMPLEMENTED = True

SORTS = (aten.sort.default, aten.sort.stable)
BROADCASTING = {aten.expand.default}
LIFT = aten.lift_fresh_copy.default

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_BLOCK = 32

EAGER_LOOP_REASON = (
    "transformers' eager experts loop: the loop over the experts hit (`nonzero()`) breaks the graph, so the expert "
    "GEMMs run one expert at a time outside any compiled graph and there is no whole block to fuse (use "
    "experts_implementation='grouped_mm' or 'batched_mm')")


PICKED_ROWS_REASON = (
    "a loop over the experts, each run on the rows a nonzero() of the routing picks (E GEMMs of data-dependent sizes): "
    "the same math as the fused ops, but the unrolled loop is not bound to them (only sorted, per-slot gathered and "
    "dense forms are matched)")


# ---------------------------------------------------------------------------
# Anchors
# ---------------------------------------------------------------------------

# Expert GEMMs, by op class: a grouped GEMM over expert-sorted rows, and a bmm of per-slot gathered expert weights.
GROUPED_ANCHORS = (aten._grouped_mm.default, torch.ops.dsfuse.fp8_grouped_linear.default)
GATHERED_ANCHORS = (aten.bmm.default,)
# The eager loop's expert mask, `one_hot(ids, E + 1)` as a compare (reported, never rewritten), and a dense block's
# SwiGLU product, whose gate a GEMM of a whole weight stack computes (one site per gate stack, so not an anchor of
# `rewrite_anchored`: several products may reach one stack).
EAGER_LOOP_ANCHORS = (aten.eq.Tensor,)
DENSE_ANCHORS = (aten.mul.Tensor,)


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, _gemm_targets(), _match, _rewrite)
    _report_eager_loops(graph, ctx)
    _fuse_dense_experts(graph, ctx)


def _grouped_targets() -> tuple:
    """`GROUPED_ANCHORS` and transformers' CPU / fp32 stand-in, looked up per call: its op exists only once
    transformers' MoE integration is imported, which may be after this module."""
    try:
        return GROUPED_ANCHORS + (torch.ops.transformers.grouped_mm_fallback.default,)
    except (AttributeError, RuntimeError):
        return GROUPED_ANCHORS  # transformers' MoE integration not imported: no fallback op can be in the graph


def _gemm_targets() -> tuple:
    return _grouped_targets() + GATHERED_ANCHORS


# ---------------------------------------------------------------------------
# Binding: evaluating a node as an elementwise function of one tensor
# ---------------------------------------------------------------------------


class _Opaque(Exception):
    """The node is not an elementwise function of the chosen leaf and constants."""


def _constant_table(node) -> torch.Tensor:
    """A small 1-D constant baked into the graph (`torch.tensor([...])` in forward)."""
    if is_op(node, LIFT):
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        raise _Opaque
    value = node.graph.owning_module
    for part in node.target.split("."):
        value = getattr(value, part, None)
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() > 4096:
        raise _Opaque
    return value.detach().cpu()


def _is_pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    return target is CONVERT or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags)


def evaluate(node, leaf: torch.fx.Node, probe: torch.Tensor, known: dict | None = None,
             layout=ORDER_KEEPING_OPS) -> torch.Tensor | None:
    """`node`'s value as an elementwise function of `leaf`, at the values `probe` (1-D), or None.

    Layout ops in `layout` are taken as identity (each element keeps its value), pointwise ops are run on the
    probe, `full`/scalars are constants and `table[i]` reads a graph constant; anything else (another input, a
    reduction, a permute) makes the node something other than an elementwise function of `leaf`.
    """
    memo = dict(known or {})
    memo[leaf] = probe

    def ev(n):
        if isinstance(n, (list, tuple)):
            return type(n)(ev(a) for a in n)
        if isinstance(n, dict):
            return {key: ev(v) for key, v in n.items()}
        if not isinstance(n, torch.fx.Node):
            return n
        if n not in memo:
            memo[n] = _evaluate_node(n, ev, layout)
        return memo[n]

    try:
        with torch.no_grad():
            return ev(node)
    except (_Opaque, RuntimeError, TypeError, IndexError, ValueError):
        return None


def _evaluate_node(n: torch.fx.Node, ev, layout) -> torch.Tensor:
    if n.op != "call_function":
        raise _Opaque
    if is_op(n, aten.full.default):
        return torch.tensor(n.args[1], dtype=dtype(n))
    if is_op(n, aten.scalar_tensor.default):
        return torch.tensor(n.args[0], dtype=dtype(n))
    if n.target in layout:
        return ev(n.args[0])
    if is_op(n, aten.index.Tensor):
        indices = n.args[1]
        if len(indices) != 1 or indices[0] is None:
            raise _Opaque
        return _constant_table(n.args[0])[ev(indices[0]).long()]
    if _is_pointwise(n):
        # Two probe-valued operands line up element by element only where the graph does not broadcast them.
        operands = [a for a in n.all_input_nodes if ev(a).dim() > 0]
        if len(operands) > 1 and not all(same_shape(shape(a), shape(n)) for a in operands):
            raise _Opaque
        return n.target(*ev(n.args), **ev(dict(n.kwargs)))
    raise _Opaque


def _roots(node, depth: int = 24) -> set:
    """The tensors `node` is computed from through pointwise and layout ops (constants excluded)."""
    found, stack, seen = set(), [(node, 0)], set()
    while stack:
        n, d = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if is_op(n, aten.full.default, aten.scalar_tensor.default, LIFT) or n.op == "get_attr":
            continue
        if n.op == "call_function" and d < depth and (_is_pointwise(n) or n.target in ORDER_KEEPING_OPS | BROADCASTING
                                                       | {aten.cat.default, aten.index.Tensor}):
            args = n.args[1] if is_op(n, aten.index.Tensor) else n.args
            for a in torch.utils._pytree.tree_leaves((args, dict(n.kwargs))):
                stack.append((a, d + 1))
        else:
            found.add(n)
    return found


def _path_ops(start: torch.fx.Node, end: torch.fx.Node) -> set:
    """Targets of the ancestors of `end` reached without passing through `start` (`end` excluded)."""
    between, stack, seen = set(), [end], set()
    while stack:
        n = stack.pop()
        if n in seen or n is start:
            continue
        seen.add(n)
        if n is not end:
            between.add(n.target)
        stack.extend(a for a in n.all_input_nodes)
    return between


# ---------------------------------------------------------------------------
# Binding: FP4 decode
# ---------------------------------------------------------------------------

BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def _e8m0(bytes_: torch.Tensor) -> torch.Tensor:
    powers = torch.exp2(bytes_.float() - 127)
    return torch.where(bytes_ == 255, torch.full_like(powers, float("nan")), powers)


def _same_values(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    if got is None or got.shape != want.shape or not got.is_floating_point():
        return False
    got = got.float()
    return bool(((got == want) | (got.isnan() & want.isnan())).all())


@dataclass
class Fp4Weights:
    packed: torch.fx.Node
    scale: torch.fx.Node
    dtype: torch.dtype


def _fp4_decode(weight: torch.fx.Node) -> Fp4Weights | str | None:
    """The FP4 bytes `weight [E, N, K]` is decoded from, a reason if it is decoded from bytes in a form the
    fused op does not compute, or None if it is not computed from bytes at all."""
    node = strip(weight, (CONVERT, *ORDER_KEEPING_OPS))
    if is_op(node, aten.cat.default):
        return _fp4_chunks(weight, node)
    mul = node
    if not is_op(mul, aten.mul.Tensor) or not all(isinstance(a, torch.fx.Node) for a in mul.args):
        return _bytes_reason(weight)
    reason = None
    for values, scales in (mul.args, mul.args[::-1]):
        found = _decoded_pair(weight, mul, values, scales)
        if isinstance(found, Fp4Weights):
            return found
        reason = reason or found
    return _bytes_reason(weight, reason)


def _bytes_reason(weight, reason: str | None = None) -> str | None:
    if not any(dtype(r) == torch.uint8 for r in _roots(weight)):
        return None
    return reason or "the expert weights are decoded from bytes, but not as E2M1 nibbles times E8M0 per-32 scales"


def _decoded_pair(weight, mul, values, scales) -> Fp4Weights | str | None:
    scale_roots = _roots(scales)
    interleave = _interleave_of(values)
    if interleave is None or len(scale_roots) != 1:
        return None
    cat, packed = interleave
    (scale,) = scale_roots
    if dtype(packed) != torch.uint8 or dtype(scale) != torch.uint8:
        return None
    p_shape, s_shape, m_shape = shape(packed), shape(scale), shape(mul)
    if len(p_shape) != 3 or len(s_shape) != 3 or len(m_shape) != 4:
        return "the FP4 decode is not laid out as [E, N, K/32, 32] value blocks times [E, N, K/32, 1] scales"
    K = 2 * p_shape[2]
    if not (same_shape(s_shape[:2], p_shape[:2]) and same_size(s_shape[2] * FP4_BLOCK, K)
            and same_shape(m_shape, (*s_shape, FP4_BLOCK)) and same_shape(shape(values), m_shape)
            and same_shape(shape(scales), (*s_shape, 1)) and same_shape(shape(weight), (*p_shape[:2], K))):
        return "the FP4 scales do not cover blocks of 32 consecutive weights of one row"
    if dtype(mul) != torch.float32:
        return f"the FP4 decode multiplies in {dtype(mul)}, not exactly in fp32"
    # The evaluations below take only order-keeping layout ops, so neither side is rearranged or broadcast.
    if not _path_ops(mul, weight) <= ORDER_KEEPING_OPS | {CONVERT}:
        return "the scaled FP4 values are rearranged before use"
    low = evaluate(cat.args[0][0], packed, BYTES, layout=ORDER_KEEPING_OPS)
    high = evaluate(cat.args[0][1], packed, BYTES, layout=ORDER_KEEPING_OPS)
    table = torch.tensor(E2M1_VALUES)
    nibble_values = [evaluate(values, cat, branch, layout=ORDER_KEEPING_OPS) if branch is not None else None
                     for branch in (low, high)]
    if not (_same_values(nibble_values[0], table[(BYTES & 15).long()])
            and _same_values(nibble_values[1], table[(BYTES >> 4).long()])):
        return ("the FP4 nibbles do not decode to E2M1 values with the low nibble first (checked on all 256 "
                "bytes)")
    if not _same_values(evaluate(scales, scale, BYTES, layout=ORDER_KEEPING_OPS), _e8m0(BYTES)):
        return "the scale bytes do not decode as E8M0 (2^(s-127), 255 = NaN; checked on all 256 bytes)"
    return Fp4Weights(packed=packed, scale=scale, dtype=dtype(weight))


def _interleave_of(values) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(cat, packed) for values computed from `cat([f(packed)[..., None], g(packed)[..., None]], -1)`."""
    node, stack, seen = None, [values], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if is_op(n, aten.cat.default):
            if node is not None:
                return None
            node = n
            continue
        if n.op == "call_function" and (_is_pointwise(n) or n.target in ORDER_KEEPING_OPS):
            stack.extend(n.all_input_nodes)
        elif is_op(n, aten.index.Tensor):
            stack.extend(i for i in n.args[1] if isinstance(i, torch.fx.Node))
    if node is None:
        return None
    parts = node.args[0]
    dim = node_arg(node, 1, "dim", 0)
    if len(parts) != 2 or dim % len(shape(node)) != len(shape(node)) - 1 or not same_size(shape(node)[-1], 2):
        return None
    roots = _roots(parts[0]) | _roots(parts[1])
    if len(roots) != 1:
        return None
    (packed,) = roots
    if not all(same_shape(shape(p), (*shape(packed), 1)) for p in parts):
        return None
    return node, packed


def _fp4_chunks(weight, cat) -> Fp4Weights | str | None:
    """A stack decoded a few experts at a time: `cat([decode(P_i, S_i) ...])` over `P.split(c)`, `S.split(c)`."""
    parts = cat.args[0]
    dim = node_arg(cat, 1, "dim", 0)
    if dim != 0:
        return _bytes_reason(weight)
    decoded = [_fp4_decode(part) for part in parts]
    if not all(isinstance(d, Fp4Weights) for d in decoded):
        reasons = [d for d in decoded if isinstance(d, str)]
        return reasons[0] if reasons else _bytes_reason(weight)
    sources = []
    for pick in ("packed", "scale"):
        chunks = [getattr(d, pick) for d in decoded]
        if not all(c.target is operator.getitem and is_op(c.args[0], aten.split.Tensor) for c in chunks):
            return "the FP4 stack is decoded in pieces that are not consecutive splits of one packed tensor"
        split = chunks[0].args[0]
        split_dim = node_arg(split, 2, "dim", 0)
        if split_dim != 0 or any(c.args[0] is not split or c.args[1] != i for i, c in enumerate(chunks)) \
                or len(split.users) != len(chunks):
            return "the FP4 stack is decoded in pieces that are not consecutive splits of one packed tensor"
        sources.append(split.args[0])
    if len({d.dtype for d in decoded}) != 1:
        return "the FP4 pieces are decoded to different dtypes"
    return Fp4Weights(packed=sources[0], scale=sources[1], dtype=decoded[0].dtype)


# ---------------------------------------------------------------------------
# Binding: expert GEMMs
# ---------------------------------------------------------------------------


@dataclass
class ExpertGemm:
    """One expert GEMM: `rows [S, K]` times expert `weight [E, N, K]` (per expert, `F.linear` layout)."""

    kind: str  # "grouped" or "batched"
    rows: torch.fx.Node | None = None
    weight: torch.fx.Node | None = None
    route: torch.fx.Node | None = None  # grouped: offsets; batched: the per-slot expert ids
    out: torch.fx.Node | None = None  # [S, N]
    problem: str = ""
    scale: torch.fx.Node | None = None  # block-scaled weights (fp8_grouped_linear): their scales
    blocks: tuple[int, int] | None = None  # and their (block_n, block_k)
    stored_kn: bool = False  # `weight` is stored [E, K, N] (is_transposed): the op reads its transposed view

    def dims(self) -> tuple:
        """(E, N, K) of the weight, K counted in values (FP4 bytes hold two)."""
        if self.scale is None:
            E, rows, cols = shape(self.weight)
            return (E, cols, rows) if self.stored_kn else (E, rows, cols)
        return (shape(self.weight)[0], *weight_dims(tensor_val(self.weight)))


SEPARATE_STACKS_REASON = (
    "gate and up are separate expert GEMMs over two weight stacks (w1, w3) of FP4 or block-scaled weights; "
    "moe_experts_fp4 / moe_experts_fp8 read one [E, 2I, H] gate_up stack (concatenating the stacks would copy every "
    "expert's weights per call)")
K_MAJOR_REASON = ("the expert weights are FP4 or block-scaled and stored [E, K, N] (is_transposed); moe_experts_fp4 / "
                  "moe_experts_fp8 read [E, N, K] stacks with K contiguous, so binding this one would copy every "
                  "expert's weights per call")
MIXED_LAYOUTS_REASON = ("the separate gate and up stacks (w1, w3) are stored in different layouts or shapes; the "
                        "fused op reads both halves of a tile with one set of strides")
KN_SUFFIX = "_kn"  # an op role's stack stored [E, K, N]: the op gets its `.transpose(1, 2)` view


def _role(name: str, stored_kn: bool) -> str:
    return name + KN_SUFFIX if stored_kn else name


def _op_stacks(stacks: dict, transposed=lambda stored: stored.transpose(1, 2)) -> tuple:
    """`(gate_up, down, up or None)` as the bf16 op reads them, from role -> tensor; `transposed` makes the view the op
    reads of a stack stored `[E, K, N]` (a tensor's transpose, or `_stack_args`' permute in the graph)."""
    def read(name):
        if name in stacks:
            return stacks[name]
        stored = stacks.get(name + KN_SUFFIX)
        return None if stored is None else transposed(stored)
    return read("gate_up"), read("down"), read("up")


def _stack_args(graph: torch.fx.Graph, before: torch.fx.Node, stacks: dict) -> tuple:
    """`_op_stacks` in the graph: a `permute(0, 2, 1)` view inserted for each stack stored `[E, K, N]` (Inductor
    passes it as a view of the stack: the op reads it through its strides)."""
    return _op_stacks(stacks, lambda stored: insert_call(graph, before, aten.permute.default, (stored, [0, 2, 1])))


def _layout_detail(stacks: dict) -> str:
    """What the report says of stacks bound apart or stored [E, K, N] (nothing for one gate_up stack)."""
    detail = ", gate and up stacks apart" if "up" in stacks or "up" + KN_SUFFIX in stacks else ""
    if any(role.endswith(KN_SUFFIX) for role in stacks):
        detail += ", stacks stored [E, K, N] read transposed"
    return detail


def _given(swiglu_limit: float | None) -> tuple:
    """The trailing `swiglu_limit` argument of an op call, left out when None (the op's default)."""
    return () if swiglu_limit is None else (swiglu_limit,)


def _bf16_args(x, ids, weights, stacks: tuple, swiglu_limit: float | None) -> tuple:
    """`moe_experts_bf16`'s arguments, the trailing defaults left out (the graphs of one gate_up stack are unchanged)."""
    gate_up, down, up = stacks
    if up is not None:
        return (x, ids, weights, gate_up, down, 0, swiglu_limit, up)
    return (x, ids, weights, gate_up, down, 0, *_given(swiglu_limit))


def _transposed(node) -> torch.fx.Node | None:
    """`w` for `w.transpose(1, 2)` / `w.permute(0, 2, 1)` of a 3-D `w`, else None."""
    if is_op(node, aten.permute.default) and list(node.args[1]) in ([0, 2, 1], [0, -1, -2], [-3, -1, -2]):
        return node.args[0]
    if is_op(node, aten.transpose.int) and sorted(d % 3 for d in node.args[1:3]) == [1, 2]:
        return node.args[0]
    return None


def _weight_gather(node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(W [E, ...], ids [S]) for `W[ids]`."""
    if not is_op(node, aten.index.Tensor) or len(shape(node.args[0])) != 3:
        return None
    indices = node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node) or len(shape(indices[0])) != 1 \
            or dtype(indices[0]) not in INDEX_DTYPES:
        return None
    return node.args[0], indices[0]


def _squeezed(node, dim: int) -> torch.fx.Node | None:
    """The user of a bmm's `[S, N, 1]` / `[S, 1, N]` output that drops its size-1 `dim`: a squeeze, or a reshape to
    `[S, N]` (an einsum's) or straight to `[T, k, N]`."""
    user = only_user(node)
    if is_op(user, aten.squeeze.dim) and user.args[1] % 3 == dim:
        return user
    if is_op(user, aten.squeeze.dims) and [d % 3 for d in user.args[1]] == [dim]:
        return user
    rows, width = [size for d, size in enumerate(shape(node)) if d != dim]
    if not (is_op(user, *VIEW_OPS) and same_size(shape(node)[dim], 1)):
        return None
    if same_shape(shape(user), (rows, width)):
        return user
    viewed = shape(user)  # straight to the combine's [T, k, N]
    return user if len(viewed) == 3 and same_size(viewed[2], width) and same_size(viewed[0] * viewed[1], rows) \
        else None


def _expert_gemm(node: torch.fx.Node) -> ExpertGemm | None:
    """Recognise an expert GEMM at `node`; None for a bmm that does not gather expert weights."""
    if is_op(node, torch.ops.dsfuse.fp8_grouped_linear.default):
        rows, weight, scale, offsets, block_n, block_k = node.args
        return ExpertGemm(kind="grouped", rows=rows, weight=weight, route=offsets, out=node, scale=scale,
                          blocks=(block_n, block_k))
    if node.target in _grouped_targets():
        args = dict(zip(("rows", "mat2", "offs", "bias", "out_dtype"), node.args))
        args.update(node.kwargs)
        gemm = ExpertGemm(kind="grouped", rows=args["rows"], route=args.get("offs"), out=node)
        if args.get("bias") is not None or args.get("out_dtype") not in (None, dtype(node)):
            gemm.problem = "the grouped GEMM has a bias or an output dtype of its own"
        elif gemm.route is None or len(shape(gemm.rows)) != 2:
            gemm.problem = "the grouped GEMM is not over 2-D rows with group offsets"
        elif _transposed(args["mat2"]) is not None:
            gemm.weight = _transposed(args["mat2"])
        elif len(shape(args["mat2"])) == 3:
            gemm.weight, gemm.stored_kn = args["mat2"], True
        else:
            gemm.problem = "the grouped GEMM's weights are not a 3-D expert stack"
        return gemm
    a, b = node.args[:2]
    gather = _weight_gather(a)
    if gather is not None and is_op(b, aten.unsqueeze.default) and b.args[1] % 3 == 2:
        return ExpertGemm(kind="batched", rows=b.args[0], weight=gather[0], route=gather[1],
                          out=_squeezed(node, 2))
    gather = _weight_gather(_transposed(b)) if _transposed(b) is not None else None
    if gather is not None and is_op(a, aten.unsqueeze.default) and a.args[1] % 3 == 1:
        return ExpertGemm(kind="batched", rows=a.args[0], weight=gather[0], route=gather[1],
                          out=_squeezed(node, 1))
    # A stack stored [E, K, N]: `rows @ W[ids]`, or an einsum's `W[ids].transpose(1, 2) @ rows`.
    gather = _weight_gather(b)
    if gather is not None and is_op(a, aten.unsqueeze.default) and a.args[1] % 3 == 1:
        return ExpertGemm(kind="batched", rows=a.args[0], weight=gather[0], route=gather[1], out=_squeezed(node, 1),
                          stored_kn=True)
    gather = _weight_gather(_transposed(a)) if _transposed(a) is not None else None
    if gather is not None and is_op(b, aten.unsqueeze.default) and b.args[1] % 3 == 2:
        return ExpertGemm(kind="batched", rows=b.args[0], weight=gather[0], route=gather[1], out=_squeezed(node, 2),
                          stored_kn=True)
    return None


def _after_expert_gemm(rows: torch.fx.Node) -> bool:
    """Whether `rows` is computed from another expert GEMM's output (the second GEMM of a block)."""
    stack, seen = [(rows, 0)], set()
    while stack:
        n, depth = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or depth > 12:
            continue
        seen.add(n)
        if n.op != "call_function":
            continue
        if n.target in _gemm_targets():
            if _expert_gemm(n) is not None:
                return True
        elif _is_pointwise(n) or n.target in ORDER_KEEPING_OPS | {operator.getitem, aten.split.Tensor,
                                                                aten.split_with_sizes.default, aten.slice.Tensor}:
            stack.extend((a, depth + 1) for a in n.all_input_nodes)
    return False


# ---------------------------------------------------------------------------
# Binding: the block
# ---------------------------------------------------------------------------


@dataclass
class Block:
    x: torch.fx.Node
    ids: torch.fx.Node
    weights: torch.fx.Node
    weights_cast: torch.dtype | None
    gate_up: torch.fx.Node
    down: torch.fx.Node
    out: torch.fx.Node
    kind: str
    combine: str
    top_k: int
    swiglu_limit: float | None = None
    expert_parallel: bool = False
    fp4: tuple[Fp4Weights, Fp4Weights] | None = None
    notes: list[str] = field(default_factory=list)
    quantized: tuple[ExpertGemm, ExpertGemm] | None = None  # block-scaled weights: (gate_up GEMM, down GEMM)
    stacks: dict = field(default_factory=dict)  # plain weights: op role -> stack (see `_op_stacks`)


def _flattened(node) -> torch.fx.Node | None:
    """`t` for `t.reshape(-1)` of a 2-D `t`."""
    if is_op(node, *VIEW_OPS) and len(shape(node)) == 1 and len(shape(node.args[0])) == 2:
        return node.args[0]
    return None


def _floordiv(node, by: int) -> torch.fx.Node | None:
    if is_op(node, aten.div.Tensor_mode) and node.kwargs.get("rounding_mode") == "floor" and node.args[1] == by:
        return node.args[0]
    if is_op(node, aten.floor_divide.Scalar, aten.floor_divide.default) and node.args[1] == by:
        return node.args[0]
    return None


def _scalar_value(node):
    """A constant of one element: a python scalar, or a `full` / `scalar_tensor` node of size-1 dims."""
    return fill_value(node) if all(same_size(s, 1) for s in shape(node)) else None


def _sentinel_masked(node, ids: torch.fx.Node, num_experts, unsqueezed: bool) -> torch.fx.Node | None:
    """`t` for `t.masked_fill(ids >= E, 0)` (with `ids` unsqueezed to a column if asked), else None."""
    if not is_op(node, aten.where.self) or _scalar_value(node.args[1]) != 0:
        return None
    cond = node.args[0]
    if unsqueezed:
        if not (is_op(cond, aten.unsqueeze.default) and cond.args[1] in (-1, 1)):
            return None
        cond = cond.args[0]
    if is_op(cond, aten.ge.Scalar) and cond.args[0] is ids and cond.args[1] == num_experts:
        return node.args[2]
    if is_op(cond, aten.gt.Scalar) and cond.args[0] is ids and cond.args[1] == num_experts - 1:
        return node.args[2]
    return None


def _clamped_ids(node, num_experts) -> torch.fx.Node | None:
    """`ids` for `ids.clamp(0, E - 1)` in any of its spellings."""
    if is_op(node, aten.clamp.default) and node.args[1:3] == (0, num_experts - 1):
        return node.args[0]
    if is_op(node, aten.clamp_max.default) and node.args[1] == num_experts - 1:
        inner = node.args[0]
        if is_op(inner, aten.clamp_min.default) and inner.args[1] == 0:
            return inner.args[0]
    return None


def _iota_from(node, start: int, num_experts) -> bool:
    """Whether `node` is `arange(start, start + E)`."""
    return (is_op(node, torch.ops.prims.iota.default) and node.args[0] == num_experts
            and node.kwargs.get("start", 0) == start and node.kwargs.get("step", 1) == 1)


def _one_hot_counted(node, num_experts) -> torch.fx.Node | None:
    """`ids` for `(ids[:, None] == arange(E)).sum(0)` (what `F.one_hot(ids, E).sum(0)` lowers to), else None."""
    if not (is_op(node, aten.sum.dim_IntList) and [d % 2 for d in node.args[1]] == [0]
            and not node_arg(node, 2, "keepdim", False)):
        return None
    hits = strip(node.args[0], (CONVERT,))
    if not is_op(hits, aten.eq.Tensor):
        return None
    column, classes = hits.args
    if not _iota_from(classes, 0, num_experts):
        column, classes = classes, column
    if not (_iota_from(classes, 0, num_experts) and is_op(column, aten.unsqueeze.default)
            and column.args[1] in (-1, 1) and len(shape(column.args[0])) == 1):
        return None
    return column.args[0]


def _counted_ids(offsets, num_experts) -> tuple[torch.fx.Node, bool]:
    """The expert ids whose per-expert counts, accumulated, are the group offsets: `cumsum(counts)` with `counts`
    a `histc(ids, bins=E, min=0, max=E-1)` or a one-hot sum, or the group ends `searchsorted(sorted_ids, arange(E),
    right=True)` (slots with an expert at most e), and whether those ids must be the sorted ones (a search does, a
    count does not). Each counts only ids in `[0, E)`, as the fused ops route."""
    offsets = walk_back(offsets, lambda n: is_op(n, CONVERT) and dtype(n) in INDEX_DTYPES + (torch.float32,))[0]
    if is_op(offsets, aten.searchsorted.Tensor):
        located, ends = offsets.args[:2]
        right = offsets.kwargs.get("right", False) or offsets.kwargs.get("side") == "right"
        if offsets.kwargs.get("sorter") is None and (_iota_from(ends, 0, num_experts) if right
                                                     else _iota_from(ends, 1, num_experts)):
            return located, True
        raise NoMatch("the group offsets are searched for in the sorted ids, but not as the ends of groups 0..E-1")
    if offsets.op == "placeholder":
        raise NoMatch("the group offsets are an input of the compiled graph, not computed in it from the expert ids "
                      "(a graph break before them, as at a torch.bincount, hides what they count)")
    if not (is_op(offsets, aten.cumsum.default) and offsets.args[1] in (0, -1)):
        raise NoMatch("the group offsets are not a cumulative sum of per-expert counts")
    counts = strip(offsets.args[0], (CONVERT,))
    if counts.op == "placeholder":
        raise NoMatch("the per-expert counts are an input of the compiled graph, not computed in it from the expert "
                      "ids (a torch.bincount of the ids breaks the graph: its output size depends on their values)")
    counted = _one_hot_counted(counts, num_experts)
    if counted is not None:
        return counted, False
    if not is_op(counts, aten.histc.default):
        raise NoMatch("the per-expert counts are not a histogram of the sorted expert ids")
    params = dict(zip(("input", "bins", "min", "max"), counts.args))
    params.update(counts.kwargs)
    if (params.get("bins", 100), params.get("min", 0), params.get("max", 0)) != (num_experts, 0, num_experts - 1):
        raise NoMatch(f"the expert histogram is not bins={num_experts} over [0, {num_experts - 1}]")
    return params["input"], False


def _expert_sort(counted, must_be_sorted: bool) -> tuple[torch.fx.Node, torch.fx.Node | None]:
    """(the sort of the flattened ids, its sorted values or None) for the ids the offsets count: the sorted values
    themselves, or the flattened ids that are sorted (a count does not depend on the order)."""
    counted = strip(counted, (CONVERT,))
    if counted.target is operator.getitem and counted.args[1] == 0 and is_op(counted.args[0], *SORTS):
        return counted.args[0], counted
    sorts = [u for u in counted.users if is_op(u, *SORTS)]
    if must_be_sorted:
        raise NoMatch("the group ends are searched for in ids that are not the sorted expert ids")
    if len(sorts) != 1:
        raise NoMatch("the expert GEMM's groups do not come from sorting the flattened expert ids")
    values = [u for u in sorts[0].users if u.target is operator.getitem and u.args[1] == 0]
    return sorts[0], values[0] if values else None


def _routing(g1: ExpertGemm, num_experts) -> dict:
    """Slot order and the expert ids: `order` is the sort permutation or None for slots in place."""
    if g1.kind == "grouped":
        sort, sorted_ids = _expert_sort(*_counted_ids(g1.route, num_experts))
    else:
        sorted_ids = g1.route
        clamped = _clamped_ids(sorted_ids, num_experts)
        if clamped is not None:
            flat = _flattened(clamped)
            if flat is None:
                raise NoMatch("the clamped expert ids are not the router's [T, k] ids flattened")
            return {"ids": flat, "flat": clamped, "order": None, "sorted": None, "sentinel": sorted_ids}
        if _flattened(sorted_ids) is not None:
            return {"ids": _flattened(sorted_ids), "flat": sorted_ids, "order": None, "sorted": None, "sentinel": None}
        if not (sorted_ids.target is operator.getitem and sorted_ids.args[1] == 0
                and is_op(sorted_ids.args[0], *SORTS)):
            raise NoMatch("the expert GEMM's groups do not come from sorting the flattened expert ids")
        sort = sorted_ids.args[0]
    params = dict(zip(("self", "stable", "dim", "descending") if sort.target is aten.sort.stable
                      else ("self", "dim", "descending"), sort.args))
    params.update(sort.kwargs)
    if params.get("descending", False) or params.get("dim", -1) not in (0, -1):
        raise NoMatch("the expert ids are not sorted ascending")
    ids = _flattened(params["self"])
    if ids is None:
        raise NoMatch("the sorted expert ids are not the router's [T, k] ids flattened")
    perms = [u for u in sort.users if u.target is operator.getitem and u.args[1] == 1]
    if len(perms) != 1:
        raise NoMatch("the sort permutation is not used to gather the token rows")
    return {"ids": ids, "flat": params["self"], "order": perms[0], "sorted": sorted_ids, "sentinel": None}


def _token_rows(g1: ExpertGemm, route: dict, top_k: int, num_experts) -> tuple[torch.fx.Node, bool]:
    """(x [T, H], whether sentinel rows are masked) for the first GEMM's rows."""
    rows = g1.rows
    if is_op(rows, CONVERT):
        raise NoMatch(f"the token rows are cast from {dtype(rows.args[0])} to the weights' {dtype(rows)} "
                      "before the expert GEMM")
    masked = False
    if route["order"] is not None:
        unmasked = _sentinel_masked(rows, route["sorted"], num_experts, unsqueezed=True)
        if unmasked is not None:
            rows, masked = unmasked, True
        if not is_op(rows, aten.index.Tensor) or len(rows.args[1]) != 1 or len(shape(rows.args[0])) != 2:
            raise NoMatch("the expert GEMM's rows are not token rows gathered in sorted slot order")
        if _floordiv(rows.args[1][0], top_k) is not route["order"]:
            raise NoMatch("the gathered rows are not x[perm // k] for the expert sort's permutation")
        return rows.args[0], masked
    leaf, ops = leaf_of_rank(rows, 2)
    labels = follow(leaf_labels(leaf, "th"), ops) if len(shape(leaf)) == 2 else None
    if labels is None or dtype(leaf) != dtype(rows) or not _same_labels(
            labels, [(("t", shape(leaf)[0]), (WILDCARD, top_k)), (("h", shape(leaf)[1]),)]):
        raise NoMatch("the expert GEMM's rows are not each token repeated k times in slot order")
    return leaf, masked


def _same_labels(got, want) -> bool:
    """Whether two labellings name the same atoms in the same order, size-1 atoms dropped on both sides: a
    single token (T = 1) or a single slot (k = 1) has no atom of its own, and `x.repeat_interleave(k)` of one token
    is then just `x` expanded to k rows."""
    got, want = normalise(got), normalise(want)
    return len(got) == len(want) and all(
        len(g) == len(w) and all(a[0] == b[0] and same_size(a[1], b[1]) for a, b in zip(g, w))
        for g, w in zip(got, want))


SILU_PROBE = torch.cat([torch.linspace(-8.0, 8.0, 161), torch.tensor([-1e4, -64.0, -16.0, 16.0, 64.0, 1e4])])


def _silu_side(side: torch.fx.Node, gate: torch.fx.Node) -> bool:
    """Whether `side` computes silu(gate) elementwise (checked by evaluating it on sample values; the large ones
    would show a clamp)."""
    gate_dtype = dtype(gate)
    probe = SILU_PROBE.to(gate_dtype)
    got = evaluate(side, gate, probe, layout=ORDER_KEEPING_OPS)
    if got is None or not got.is_floating_point():
        return False
    want = F.silu(probe.float())
    tol = 1e-5 if got.dtype == torch.float32 else 1e-2
    return bool(torch.allclose(got.float(), want, rtol=tol, atol=tol))


def _neighbours(value: torch.Tensor) -> torch.Tensor:
    """The representable values just below and above a positive finite 0-d `value` (in its dtype)."""
    int_dtype = {2: torch.int16, 4: torch.int32}[value.element_size()]
    bits = value.reshape(1).view(int_dtype)
    return torch.cat([bits - 1, bits + 1]).view(value.dtype)


def _clamp_probe(limit: torch.Tensor) -> torch.Tensor:
    """Values in the limit's dtype that show where a clamp bites: around +-limit, both signs of zero, far beyond the
    limit, the infinities and NaN."""
    dt = limit.dtype
    finite_max = torch.finfo(dt).max
    around = torch.cat([limit.reshape(1), _neighbours(limit),
                        limit * torch.tensor([0.25, 0.5, 0.9, 0.99, 1.01, 1.1, 2.0, 4.0], dtype=dt)])
    extremes = torch.tensor([0.0, -0.0, finite_max, float("inf"), float("nan")], dtype=dt)
    one_side = torch.cat([SILU_PROBE.to(dt), around, extremes])
    return torch.cat([one_side, -one_side])


def _up_clamp_limit(up_side: torch.fx.Node, up: torch.fx.Node) -> torch.Tensor | str:
    """The limit L (0-d, in up's dtype) for an up side that computes `up.clamp(-L, L)` exactly (bounds read off the
    evaluated function, then checked on values around them), else the reason."""
    reason = "the up half is transformed before the product, and not as a symmetric clamp up.clamp(-L, L)"
    dt = dtype(up)
    big = torch.finfo(dt).max
    ends = evaluate(up_side, up, torch.tensor([-big, big], dtype=dt), layout=ORDER_KEEPING_OPS)
    if ends is None or ends.dtype != dt:
        return reason
    low, limit = ends[0], ends[1]
    if not (0 < float(limit) < big and float(low) == -float(limit)):
        return reason
    probe = _clamp_probe(limit)
    if not _same_values(evaluate(up_side, up, probe, layout=ORDER_KEEPING_OPS), probe.clamp(-limit, limit).float()):
        return reason
    return limit


def _gate_path(side: torch.fx.Node, gate: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes between `gate` and `side` (both included), nearest the gate first."""
    found, stack, seen = [], [side], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is gate or (n.op == "call_function" and _is_pointwise(n) and gate in _roots(n)):
            found.append(n)
            if n is not gate:
                stack.extend(n.all_input_nodes)
    return in_graph_order(found)


def _clamped_silu_side(side: torch.fx.Node, gate: torch.fx.Node, limit: torch.Tensor) -> bool:
    """Whether `side` is `silu(c)` of a node `c` whose values equal `gate.clamp(max=L)` in gate's dtype exactly (a
    clamp in fp32 passes only where it gives the same values, i.e. where L is a value of gate's dtype)."""
    probe = _clamp_probe(limit)
    want = probe.clamp(max=limit).float()
    for clamped in _gate_path(side, gate):
        if clamped is gate:
            continue
        if _same_values(evaluate(clamped, gate, probe, layout=ORDER_KEEPING_OPS), want) and _silu_side(side, clamped):
            return True
    return False


def _swiglu_product(gate: torch.fx.Node, up: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """(act, gate side, up side) for `act = f(gate) * g(up)`, g elementwise ops on up alone (found forward from up)."""
    frontier, seen = [up], {up}
    while frontier:
        node = frontier.pop(0)
        for user in node.users:
            if is_op(user, aten.mul.Tensor) and node in user.args:
                side = user.args[0] if user.args[1] is node else user.args[1]
                if isinstance(side, torch.fx.Node) and _roots(side) == _roots(gate):
                    return user, side, node
            if user not in seen and user.op == "call_function" and _is_pointwise(user) and _roots(user) == _roots(up):
                seen.add(user)
                frontier.append(user)
    if is_op(only_user(up), aten.mul.Tensor):
        raise NoMatch("the up half is not multiplied by a function of the gate half")
    raise NoMatch("the up half is not multiplied by the gate activation (or is cast first)")


def _halves(out1: torch.fx.Node, inter) -> dict:
    """{0: gate, 1: up} for `out1.split(I, -1)` (or `chunk(2, -1)`) or the two slices `[:, :I]` and `[:, I:]`."""
    split = only_user(out1)
    if is_op(split, aten.split.Tensor) and split.args[1] == inter and (
            node_arg(split, 2, "dim", 0)) in (-1, 1):
        return {u.args[1]: u for u in split.users if u.target is operator.getitem}
    width = shape(out1)[1]
    slices = {}
    for user in out1.users:
        if not (is_op(user, aten.slice.Tensor) and user.args[1] in (-1, 1)):
            break
        start = user.args[2] if len(user.args) > 2 else 0
        end = user.args[3] if len(user.args) > 3 else width
        step = user.args[4] if len(user.args) > 4 else 1
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start and end >= 0 and step == 1):
            break
        slices[(start, min(end, width))] = user
    else:
        if set(slices) == {(0, inter), (inter, width)} and len(out1.users) == 2:
            return {0: slices[(0, inter)], 1: slices[(inter, width)]}
    raise NoMatch("the first expert GEMM's output is not split into gate and up halves")


def _swiglu(out1: torch.fx.Node, inter,
            halves: dict | None = None) -> tuple[torch.fx.Node, torch.fx.Node, float | None]:
    """(act, gate, swiglu limit or None) for `gate, up = out1.chunk(2, -1); act = silu(gate) * up`, or DeepSeek
    V4's `silu(gate.clamp(max=L)) * up.clamp(-L, L)` (one constant L, each clamp in the halves' dtype); `halves`
    given ({0: gate, 1: up}), the two outputs of GEMMs over the halves of one stack instead of `out1`'s."""
    halves = halves or _halves(out1, inter)
    if set(halves) != {0, 1} or len(halves[1].users) != 1:
        raise NoMatch("the gate/up halves are used outside the SwiGLU")
    gate, up = halves[0], halves[1]
    act, side, up_side = _swiglu_product(gate, up)
    limit = None
    if up_side is not up:
        found = _up_clamp_limit(up_side, up)
        if isinstance(found, str):
            raise NoMatch(found)
        if not _clamped_silu_side(side, gate, found):
            raise NoMatch(f"the up half is clamped to +-{float(found):g}, but the gate activation is not "
                          f"silu(gate.clamp(max={float(found):g})) in the GEMM dtype")
        limit = float(found)
    elif not _silu_side(side, gate):
        raise NoMatch("the gate activation is not SiLU (the fused ops compute silu(gate) * up, or DeepSeek V4's "
                      "silu(gate.clamp(max=L)) * up.clamp(-L, L))")
    if dtype(side) != dtype(up) or dtype(act) != dtype(up):
        raise NoMatch(f"SwiGLU is computed in {dtype(act)}, not rounded to the GEMM dtype {dtype(up)}")
    return act, gate, limit


def _second_gemm(act: torch.fx.Node, g1: ExpertGemm) -> ExpertGemm:
    candidates = list(act.users) + [u for user in act.users if is_op(user, aten.unsqueeze.default)
                                    for u in user.users]
    for user in candidates:
        if user.target in _gemm_targets():
            g2 = _expert_gemm(user)
            if g2 is not None and g2.kind == g1.kind and g2.rows is act:
                if g2.problem:
                    raise NoMatch(g2.problem)
                if g2.route is not g1.route:
                    raise NoMatch("the two expert GEMMs are grouped by different routings")
                return g2
    if any(_feeds_expert_gemm(user) for user in act.users if is_op(user, aten.mul.Tensor)
           and all(isinstance(a, torch.fx.Node) for a in user.args)):
        raise NoMatch("the SwiGLU activation is multiplied by another tensor before the down projection; the fused "
                      "ops apply the router weights to each expert's output, after it (another rounding)")
    raise NoMatch("the SwiGLU activation does not feed a second expert GEMM")


def _feeds_expert_gemm(node: torch.fx.Node, depth: int = 4) -> bool:
    """Whether `node` reaches the rows of an expert GEMM through casts and order-keeping layout ops."""
    frontier = [(node, 0)]
    while frontier:
        n, d = frontier.pop()
        for user in n.users:
            if user.target in _gemm_targets() and _expert_gemm(user) is not None:
                return True
            if d < depth and user.op == "call_function" and (user.target is CONVERT
                                                            or user.target in ORDER_KEEPING_OPS):
                frontier.append((user, d + 1))
    return False


def _rows_gemms(g1: ExpertGemm) -> list[torch.fx.Node]:
    """Every expert GEMM (the anchor included) over the same rows and routing as `g1`, in graph order."""
    readers = list(g1.rows.users) + [u for r in g1.rows.users if is_op(r, aten.unsqueeze.default) for u in r.users]
    gemms = []
    for n in readers:
        if n.target in _gemm_targets() and n not in gemms:
            other = _expert_gemm(n)
            if other is not None and other.rows is g1.rows and other.route is g1.route:
                gemms.append(n)
    return in_graph_order(gemms)


def _halves_of_one_stack(gemms: list[torch.fx.Node]) -> tuple[torch.fx.Node, dict] | None:
    """(the stack W [E, 2I, H], {0: gate GEMM's output, 1: up GEMM's output}) for two expert GEMMs over its halves
    `W[:, :I]` and `W[:, I:]` (views: the op reads W itself, nothing is copied), else None."""
    if len(gemms) != 2:
        return None
    halves, bases = {}, set()
    for node in gemms:
        gemm = _expert_gemm(node)
        weight = gemm.weight
        if gemm.problem or gemm.out is None or gemm.scale is not None or gemm.stored_kn \
                or not is_op(weight, aten.slice.Tensor):
            return None
        base = weight.args[0]
        dim, start, end, step = slice_args(weight)
        if len(shape(base)) != 3 or dim % 3 != 1 or step != 1:
            return None
        width = shape(base)[1]
        if not isinstance(width, int) or width % 2:
            return None
        half = {(0, width // 2): 0, (width // 2, width): 1}.get((start, min(slice_position(end, width), width)))
        if half is None or half in halves:
            return None
        halves[half] = gemm.out
        bases.add(base)
    return (bases.pop(), halves) if len(bases) == 1 else None


def _slot_weights(sw: torch.fx.Node, route: dict, num_experts) -> tuple[torch.fx.Node, torch.dtype | None]:
    """(router weights [T, k], the dtype they are cast to first or None) for the per-slot weight column."""
    cast = None
    node = sw
    while is_op(node, CONVERT, aten.unsqueeze.default):
        if is_op(node, aten.unsqueeze.default) and node.args[1] not in (-1, 1):
            break
        if is_op(node, CONVERT):
            if cast is not None:
                raise NoMatch("the router weights are cast twice")
            cast = node.args[1]
        node = node.args[0]
    if not same_size(shape(sw)[-1], 1) or len(shape(sw)) != 2:
        raise NoMatch("the expert outputs are not scaled by one router weight per slot")
    if route["order"] is not None:
        if not (is_op(node, aten.index.Tensor) and len(node.args[1]) == 1 and node.args[1][0] is route["order"]):
            raise NoMatch("the router weights are not gathered in the expert sort's order")
        node = node.args[0]
    elif route["sentinel"] is not None:
        unmasked = _sentinel_masked(node, route["flat"], num_experts, unsqueezed=False)
        if unmasked is None:
            raise NoMatch("clamped expert ids without zeroed router weights at the sentinel slots")
        node = unmasked
    weights = _flattened(node)
    if weights is None and is_op(node, *VIEW_OPS) and len(shape(node.args[0])) == 2 \
            and same_shape(shape(node), (shape(sw)[0], 1)):
        weights = node.args[0]  # `w.reshape(-1, 1)`: the flattened column in one view
    if weights is None:
        raise NoMatch("the per-slot router weights are not the router's [T, k] weights flattened")
    return weights, cast


def _token_slot_weights(sw: torch.fx.Node, T, top_k) -> tuple[torch.fx.Node, torch.dtype | None]:
    """(router weights [T, k], the dtype they are cast to first or None) for a `[T, k, 1]` weight factor of the
    slot outputs viewed `[T, k, H]`: `w.view(T, k, 1)` or `w.unsqueeze(-1)`, optionally cast."""
    cast = None
    node = sw
    if is_op(node, CONVERT):
        cast, node = node.args[1], node.args[0]
    if not same_shape(shape(sw), (T, top_k, 1)):
        raise NoMatch("the expert outputs are not scaled by one router weight per slot")
    if is_op(node, aten.unsqueeze.default) and node.args[1] in (-1, 2) or is_op(node, *VIEW_OPS):
        node = node.args[0]
        if is_op(node, CONVERT) and cast is None:
            cast, node = node.args[1], node.args[0]
        if same_shape(shape(node), (T, top_k)):
            return node, cast
    raise NoMatch("the per-slot router weights are not the router's [T, k] weights")


def _combine(weighted: torch.fx.Node, route: dict, x, top_k: int) -> tuple[torch.fx.Node, str]:
    """(the block's output node, the combine's name)."""
    T, H = shape(x)
    user = only_user(weighted)
    if _is_accumulate(user):
        zeros, dim, index, source, alpha = _accumulate_args(user)
        slots = _floordiv(index, top_k)
        own_token = slots is route["order"] if route["order"] is not None else _slot_numbers(slots, T * top_k)
        if dim != 0 or source is not weighted or alpha != 1 or not own_token:
            raise NoMatch("the index_add_ does not add each slot's output to its own token")
        if not (is_op(zeros, aten.full.default) and zeros.args[1] == 0 and same_shape(shape(zeros), (T, H))):
            raise NoMatch("the index_add_ accumulates into something other than zeros [T, H]")
        cast = only_user(user)
        out = cast if dtype(user) != dtype(x) and is_op(cast, CONVERT) and dtype(cast) == dtype(x) else user
        return out, "index_add" if is_op(user, aten.index_add.default, aten.index_put.default) else "scatter_add"
    node, combine = weighted, "sum"
    if route["order"] is not None:
        inverse = user.args[1][0] if is_op(user, aten.index.Tensor) and len(user.args[1]) == 1 else None
        if not (is_op(inverse, aten.index_put.default) and _is_inverse_permutation(inverse, route["order"])):
            raise NoMatch("the weighted expert outputs are not put back in slot order (inverse permutation)")
        node, combine = user, "inverse permutation + sum"
    view = only_user(node)
    if not (is_op(view, *VIEW_OPS) and same_shape(shape(view), (T, top_k, H))):
        raise NoMatch("the weighted slot outputs are not viewed as [T, k, H]")
    total = only_user(view)
    if not (is_op(total, aten.sum.dim_IntList) and [d % 3 for d in total.args[1]] == [1]
            and not node_arg(total, 2, "keepdim", False)
            and total.kwargs.get("dtype") is None):
        raise NoMatch("each token's k slot outputs are not summed")
    out = total
    cast = only_user(total)
    if is_op(cast, CONVERT):
        out = cast
    return out, combine


def _weighted_combine(out2, weighted, per_token: bool, route: dict, x, T, top_k, num_experts) -> tuple:
    """(router weights, their cast or None, the block's output, the combine's name, whether other ranks' slots are
    masked to zero after the weighting) for slot outputs `out2` times the router weights in `weighted`, then
    combined per token."""
    if not is_op(weighted, aten.mul.Tensor) or out2 not in weighted.args:
        raise NoMatch("the expert outputs are not multiplied by the router weights")
    sw = weighted.args[1] if weighted.args[0] is out2 else weighted.args[0]
    if not isinstance(sw, torch.fx.Node):
        raise NoMatch("the expert outputs are scaled by a constant, not by router weights")
    weights, cast = _token_slot_weights(sw, T, top_k) if per_token else _slot_weights(sw, route, num_experts)
    if per_token:
        return weights, cast, *_per_token_sum(weighted), False
    # transformers' FP8 expert-parallel form zeroes other ranks' slots after the weighting, not after each GEMM
    masked = route["order"] is not None and \
        _sentinel_masked(only_user(weighted), route["sorted"], num_experts, unsqueezed=True) is weighted
    return weights, cast, *_combine(only_user(weighted) if masked else weighted, route, x, top_k), masked


def _contracted_combine(viewed: torch.fx.Node, T, H) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(router weights, the product node, the block's output) for slot outputs viewed `[T, k, H]` and contracted with
    fp32 weights over k (`einsum('tkh,tk->th', out.float(), w)`: a bmm of `[T, H, k] @ [T, k, 1]`), else None. Each
    product is an fp32 product of the slot output and its weight summed in fp32, which is what the fused op computes
    for fp32 weights; a bf16 contraction would round differently, so only fp32 is taken."""
    node = only_user(viewed)
    if is_op(node, CONVERT):
        if node.args[1] != torch.float32:
            return None
        node = only_user(node)
    if not (is_op(node, aten.permute.default) and [d % 3 for d in node.args[1]] == [0, 2, 1]):
        return None
    bmm = only_user(node)
    if not (is_op(bmm, aten.bmm.default) and bmm.args[0] is node and dtype(bmm) == torch.float32):
        return None
    column = bmm.args[1]
    if not (is_op(column, aten.unsqueeze.default) and column.args[1] in (-1, 2)):
        return None
    total = only_user(bmm)
    if not (is_op(total, *VIEW_OPS) and same_shape(shape(total), (T, H))):
        return None
    cast = only_user(total)
    return column.args[0], bmm, (cast if is_op(cast, CONVERT) else total)


def _slot_outputs_per_token(out2, route: dict, T, top_k: int, H) -> torch.fx.Node | None:
    """The down GEMM's slot outputs as `[T, k, H]` in slot order, where the combine reads them so (viewed, or
    reshaped straight from the bmm; sorted slots first put back by the inverse permutation), else None."""
    node = out2
    if route["order"] is not None:
        user = only_user(out2)
        inverse = user.args[1][0] if is_op(user, aten.index.Tensor) and len(user.args[1]) == 1 else None
        if not (is_op(inverse, aten.index_put.default) and _is_inverse_permutation(inverse, route["order"])):
            return None
        node = user
    if same_shape(shape(node), (T, top_k, H)):
        return node
    user = only_user(node)
    return user if is_op(user, *VIEW_OPS) and same_shape(shape(user), (T, top_k, H)) else None


def _per_token_sum(weighted: torch.fx.Node) -> tuple[torch.fx.Node, str]:
    """(the block's output node, the combine's name) for weighted `[T, k, H]` slot outputs summed over k."""
    total = only_user(weighted)
    if not (is_op(total, aten.sum.dim_IntList) and [d % 3 for d in total.args[1]] == [1]
            and not node_arg(total, 2, "keepdim", False)
            and total.kwargs.get("dtype") is None):
        raise NoMatch("each token's k slot outputs are not summed")
    cast = only_user(total)
    return (cast if is_op(cast, CONVERT) else total), "[T, k, H] weighted + sum"


def _is_accumulate(node) -> bool:
    """`index_add(base, 0, index, src)`, its decomposition `index_put(base, [index], src, accumulate=True)`, or
    `scatter_add` / `scatter_reduce(..., "sum")` of whole rows (the index column expanded over H)."""
    if is_op(node, aten.index_add.default, aten.scatter_add.default):
        return True
    if is_op(node, aten.scatter_reduce.two):
        return (node.args[4] if len(node.args) > 4 else node.kwargs.get("reduce")) == "sum"
    return is_op(node, aten.index_put.default) and (node.args[3] if len(node.args) > 3
                                                     else node.kwargs.get("accumulate", False))


def _row_index(index, source) -> torch.fx.Node | None:
    """`i` for a scatter index `i[:, None].expand(S, H)` that sends each whole source row to row `i`."""
    if not (is_op(index, aten.expand.default) and same_shape(shape(index), shape(source))):
        return None
    column = index.args[0]
    if is_op(column, aten.unsqueeze.default) and column.args[1] in (-1, 1) and len(shape(column.args[0])) == 1:
        return column.args[0]
    return None


def _accumulate_args(node) -> tuple:
    """(base, dim, index, source, alpha) of an `_is_accumulate` node."""
    if is_op(node, aten.index_add.default):
        alpha = node.args[4] if len(node.args) > 4 else node.kwargs.get("alpha", 1)
        return (*node.args[:4], alpha)
    if is_op(node, aten.scatter_add.default, aten.scatter_reduce.two):
        base, dim, index, source = node.args[:4]
        return base, dim, _row_index(index, source), source, 1
    base, indices, source = node.args[:3]
    if len(indices) != 1 or indices[0] is None:
        return base, None, None, source, 1
    return base, 0, indices[0], source, 1


def _slot_numbers(node, slots) -> bool:
    """Whether `node` is `arange(slots)`: each slot in place, so slot s belongs to token s // k."""
    return (is_op(node, torch.ops.prims.iota.default) and same_shape(shape(node), (slots,))
            and node.kwargs.get("start", 0) == 0 and node.kwargs.get("step", 1) == 1)


def _is_inverse_permutation(node, perm) -> bool:
    base, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate or len(indices) != 1 or indices[0] is not perm:
        return False
    if not (is_op(base, aten.empty.memory_format, aten.empty_like.default, aten.full.default, aten.zeros.default)
            and is_op(values, torch.ops.prims.iota.default)):
        return False
    return (values.kwargs.get("start", 0) == 0 and values.kwargs.get("step", 1) == 1
            and same_shape(shape(values), shape(perm)))


ROUTING_OPS = (*SORTS, aten.histc.default, aten.bincount.default, aten.searchsorted.Tensor, aten.eq.Tensor,
               aten.eq.Scalar)


def _routed(offsets: torch.fx.Node, depth: int = 16) -> bool:
    """Whether group offsets are computed from a routing (a sort or a count of ids) rather than fixed: a block-scaled
    grouped GEMM also serves block-diagonal linears (V4's grouped output projection), whose groups are constant."""
    return reaches_back(offsets, lambda node: is_op(node, *ROUTING_OPS), lambda node: True, depth)


def _match(anchor: torch.fx.Node) -> Block:
    g1 = _expert_gemm(anchor)
    if g1 is None:
        raise NoMatch("not an expert GEMM", reported=False)
    if g1.scale is not None and not _routed(g1.route):
        raise NoMatch("a block-scaled grouped GEMM over fixed groups (a block-diagonal linear), not routed experts",
                      reported=False)
    if g1.rows is not None and _after_expert_gemm(g1.rows):
        raise NoMatch("the second GEMM of an expert block", reported=False)
    if g1.problem:
        raise NoMatch(g1.problem)
    if g1.out is None:
        raise NoMatch("the batched expert GEMM's output is not squeezed back to [S, N]")
    siblings = _rows_gemms(g1)
    one_stack = other = None
    if len(siblings) > 1:
        if siblings[0] is not anchor:
            raise NoMatch("the up GEMM of separate gate/up stacks", reported=False)
        one_stack = _halves_of_one_stack(siblings)
        if one_stack is None:
            other = _separate_stack(g1, siblings)
    if other is not None:
        E, inter, H = g1.dims()
    else:
        E, two_i, H = g1.dims() if one_stack is None else shape(one_stack[0])
        if not isinstance(two_i, int) or two_i % 2:
            raise NoMatch(f"the first expert GEMM's output width {two_i} is not 2*I")
        inter = two_i // 2

    route = _routing(g1, E)
    ids = route["ids"]
    T, top_k = shape(ids)
    if not isinstance(top_k, int):
        raise NoMatch("the number of experts per token is not a constant")
    x, masked = _token_rows(g1, route, top_k, E)
    if not same_shape(shape(x), (T, H)):
        raise NoMatch(f"token rows {shape(x)} and expert ids {shape(ids)} do not share T, or H is not {H}")
    if dtype(ids) not in INDEX_DTYPES or dtype(x) not in FLOAT_DTYPES:
        raise NoMatch(f"expert ids {dtype(ids)} / activations {dtype(x)} not supported by the fused ops")

    out1 = g1.out
    if masked:
        sentinel_users = [u for u in out1.users if _sentinel_masked(u, route["sorted"], E, True) is out1]
        if len(sentinel_users) != 1 or len(out1.users) != 1:
            raise NoMatch("expert-parallel: the first GEMM's sentinel rows are not masked to zero")
        out1 = sentinel_users[0]
    if (one_stack is not None or other is not None) and masked:
        raise NoMatch("expert-parallel: the gate and up GEMMs' sentinel rows are masked apart")
    gate_gemm, up_gemm = g1, other
    if other is None:
        act, _, swiglu_limit = _swiglu(out1, inter, one_stack[1] if one_stack is not None else None)
    else:
        try:
            act, _, swiglu_limit = _swiglu(out1, inter, {0: g1.out, 1: other.out})
        except NoMatch:
            act, _, swiglu_limit = _swiglu(out1, inter, {0: other.out, 1: g1.out})
            gate_gemm, up_gemm = other, g1
    g2 = _second_gemm(act, g1)
    if g2.out is None:
        raise NoMatch("the batched expert GEMM's output is not squeezed back to [S, N]")
    if not same_shape(g2.dims(), (E, H, inter)):
        raise NoMatch(f"down-projection weights {g2.dims()} are not [E, H, I] = {(E, H, inter)}")
    out2 = g2.out
    if masked:
        user = only_user(out2)
        if _sentinel_masked(user, route["sorted"], E, True) is not out2:
            raise NoMatch("expert-parallel: the second GEMM's sentinel rows are not masked to zero")
        out2 = user
    viewed = _slot_outputs_per_token(out2, route, T, top_k, H)
    per_token = viewed is not None
    weighted = only_user(out2)
    contracted = _contracted_combine(viewed, T, H) if per_token else None
    if contracted is not None:
        (weights, product, out), cast, combine = contracted, None, "[T, k, H] contracted with the weights"
    else:
        if per_token:  # the slot outputs viewed [T, k, H], then weighted by [T, k, 1] and summed over k
            out2, weighted = viewed, only_user(viewed)
        weights, cast, out, combine, weighted_masked = _weighted_combine(out2, weighted, per_token, route, x, T,
                                                                         top_k, E)
        masked = masked or weighted_masked
        product = weighted
    if not same_shape(shape(weights), (T, top_k)) or dtype(weights) not in FLOAT_DTYPES:
        raise NoMatch(f"router weights {shape(weights)} {dtype(weights)} are not a float [T, k] tensor")
    if dtype(out) != dtype(x) or not same_shape(shape(out), (T, H)):
        raise NoMatch(f"the block's output is {dtype(out)}, not the activations' {dtype(x)}")

    gate_up = gate_gemm.weight if one_stack is None else one_stack[0]
    block = Block(x=x, ids=ids, weights=weights, weights_cast=cast, gate_up=gate_up, down=g2.weight, out=out,
                  kind=g1.kind, combine=combine, top_k=top_k, swiglu_limit=swiglu_limit,
                  expert_parallel=masked or route["sentinel"] is not None)
    block.stacks = {_role("gate_up", gate_gemm.stored_kn): gate_up, _role("down", g2.stored_kn): g2.weight}
    if up_gemm is not None:
        block.stacks[_role("up", up_gemm.stored_kn)] = up_gemm.weight
    kn_or_apart = up_gemm is not None or gate_gemm.stored_kn or g2.stored_kn
    if kn_or_apart and (g1.scale is not None or g2.scale is not None):
        raise NoMatch(SEPARATE_STACKS_REASON if up_gemm is not None else K_MAJOR_REASON)
    if g1.scale is not None or g2.scale is not None:
        if g1.scale is None or g2.scale is None or g1.blocks != g2.blocks or dtype(g1.weight) != dtype(g2.weight):
            raise NoMatch("the two expert GEMMs are not both block-scaled in one format and block size")
        block.quantized = (g1, g2)
        return _verified(block)
    decoded = (_fp4_decode(g1.weight), _fp4_decode(g2.weight))
    if kn_or_apart and any(isinstance(d, Fp4Weights) for d in decoded):
        raise NoMatch(SEPARATE_STACKS_REASON if up_gemm is not None else K_MAJOR_REASON)
    if all(isinstance(d, Fp4Weights) for d in decoded):
        if any(d.dtype != dtype(x) for d in decoded):
            raise NoMatch("the FP4 weights are decoded to a dtype other than the activations'")
        if dtype(product) != dtype(x):
            raise NoMatch(f"the router-weight product is {dtype(product)}; moe_experts_fp4 rounds it to "
                          f"{dtype(x)}")
        block.fp4 = (decoded[0], decoded[1])
        return _verified(block)
    if any(isinstance(d, Fp4Weights) for d in decoded):
        raise NoMatch("only one of the two expert weight stacks is an FP4 decode")
    block.notes = [d for d in decoded if isinstance(d, str)]
    if any(dtype(stack) != dtype(x) for stack in block.stacks.values()):
        raise NoMatch(f"expert weights {'/'.join(str(dtype(s)) for s in block.stacks.values())} differ from the "
                      f"activations' {dtype(x)}")
    return _verified(block)


def _separate_stack(g1: ExpertGemm, gemms: list[torch.fx.Node]) -> ExpertGemm:
    """The other of two expert GEMMs over the same rows and routing, each over a stack of its own (DeepSeek's w1 and
    w3, in either order): the op reads them as gate and `up` where they share shape, dtype and layout."""
    if len(gemms) != 2:
        raise NoMatch(f"{len(gemms)} expert GEMMs read the same rows; a SwiGLU block has a gate and an up GEMM")
    other = _expert_gemm(gemms[1])
    if other.problem:
        raise NoMatch(other.problem)
    if other.out is None:
        raise NoMatch("the batched expert GEMM's output is not squeezed back to [S, N]")
    if other.stored_kn != g1.stored_kn or not same_shape(shape(other.weight), shape(g1.weight)) \
            or dtype(other.weight) != dtype(g1.weight):
        raise NoMatch(MIXED_LAYOUTS_REASON)
    return other


# ---------------------------------------------------------------------------
# Verification: the block against its op's reference, on probes
# ---------------------------------------------------------------------------

# Budget of a block's output against the op's reference, relative to the output's largest magnitude: fp32 GEMMs
# summed in another order differ far below 1e-5; 16-bit blocks round the same steps to 16 bits, but may sum the k
# slots in their dtype (index_add into a bf16 buffer) where the op sums in fp32 and rounds once.
BUDGET = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _verified(block: Block) -> Block:
    """The block, after its slice (routing, both GEMMs, SwiGLU, weighting, combine) agreed with the op's reference on
    every probe; raises with the failing probe's reason otherwise."""
    verdict = _verify(block)
    if verdict.ok is False:
        raise NoMatch(f"numeric check against the reference failed: {verdict.reason}")
    return block


def _verify(block: Block) -> Verdict:
    if block.fp4 is not None:
        w13, w2 = block.fp4
        stacks = {"w13_packed": w13.packed, "w13_scale": w13.scale, "w2_packed": w2.packed, "w2_scale": w2.scale}
    elif block.quantized is not None:
        g1, g2 = block.quantized
        stacks = {"gate_up": g1.weight, "gate_up_scale": g1.scale, "down": g2.weight, "down_scale": g2.scale}
    else:
        stacks = block.stacks
    roles = {"x": block.x, "ids": block.ids, "weights": block.weights, **stacks}
    if len(set(roles.values())) != len(roles):
        return Verdict(False, "two roles of the op are bound to one tensor")
    if sum(tensor_val(node).numel() for node in stacks.values()) > MAX_ELEMENTS:
        # Probes at these sizes would not run; a model that decodes such stacks in chunks (the own model at V3.2's
        # sizes) would also meet the slice's node bound first and be refused for the chunking alone.
        return Verdict(None, f"expert stacks over {MAX_ELEMENTS} elements: not probed")
    family = Family(probes=lambda shapes, dtypes: _probes(shapes, dtypes, block.expert_parallel),
                    reference=lambda probe: _reference(probe, block), compare=_within_budget)
    extra = (block.fp4 is not None, block.quantized is not None and block.quantized[0].blocks, block.swiglu_limit,
             block.weights_cast, block.expert_parallel, *sorted(stacks))
    return verify([block.out], roles, family, extra)


def _grid(shape, dt: torch.dtype, gen: torch.Generator, step: float) -> torch.Tensor:
    """Small values on multiples of `step` (exact in every float dtype, so the first GEMM's sums are exact)."""
    return ((torch.randn(shape, generator=gen) * 3).round().clamp(-8, 8) * step).to(dt)


def _stack_probe(name: str, shape, dt: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values for a weight stack or its scales, by dtype: grid values for float weights (e4m3 included), random bytes
    for FP4 (two E2M1 nibbles a byte), E8M0 scale bytes near 1, and float scales on a grid of 1/8."""
    if name.endswith("_scale"):
        if dt == torch.uint8:
            return torch.randint(123, 127, shape, generator=gen, dtype=torch.uint8)
        return (torch.randint(1, 9, shape, generator=gen) / 8).to(dt)
    if dt in (torch.uint8, torch.int8):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dt)
    return _grid(shape, dt, gen, 1 / 16 if dt.itemsize > 1 else 1 / 4)


def _poisoned(stack: torch.Tensor) -> torch.Tensor:
    """The stack with its last expert made NaN where its format has a NaN: float weights or scales, or E8M0's 255
    (an FP4 decode's scales); e4m3 weights keep their values (their scales carry the NaN)."""
    stack = stack.clone()
    if stack.dtype in FLOAT_DTYPES:
        stack[-1] = float("nan")
    return stack


def _probes(shapes: dict, dtypes: dict, expert_parallel: bool) -> list:
    """A random routing whose last expert gets no slot and holds NaN weights or scales (an op or a slice that reads
    an unrouted expert shows a NaN), every slot routed to expert 0 (duplicate ids in each token), a zero router
    weight on every slot of the first token and on one slot of each other token, and under expert parallelism other
    ranks' slots (id E, the sentinel) that add nothing."""
    gen = torch.Generator().manual_seed(0)
    T, top_k = shapes["ids"]
    stacks = [name for name in shapes if name not in ("x", "ids", "weights")]
    E = shapes[stacks[0]][0]
    base = {"x": _grid(shapes["x"], dtypes["x"], gen, 0.25),
            "ids": torch.randint(0, max(E - 1, 1), (T, top_k), generator=gen).to(dtypes["ids"]),
            "weights": ((torch.rand(shapes["weights"], generator=gen) * 8).round() / 8 + 0.125).to(dtypes["weights"]),
            }
    finite = {name: _stack_probe(name, shapes[name], dtypes[name], gen) for name in stacks}
    base.update(finite)
    if E > 1:
        base.update({name: _poisoned(stack) for name, stack in finite.items()})
        if "w13_packed" in shapes:
            base.update({name: finite[name].clone().index_fill_(0, torch.tensor([E - 1]), 255)
                         for name in ("w13_scale", "w2_scale")})
    one_expert = dict(base, ids=torch.zeros_like(base["ids"]))
    zero_weights = dict(base, weights=base["weights"].clone())
    zero_weights["weights"][0] = 0
    zero_weights["weights"][:, -1] = 0
    probes = [("random routing", base), ("one expert for every slot", one_expert), ("zero weights", zero_weights)]
    if expert_parallel:
        # Finite stacks here: transformers' batched expert-parallel form clamps the sentinel onto expert E - 1 and
        # zeroes its weight, so it computes that expert where the op skips the slot (they differ only where that
        # expert's output is not finite, which the structural match accepts).
        other_ranks = dict(base, ids=base["ids"].clone(), **finite)
        other_ranks["ids"][:, 0] = E
        probes.append(("other ranks' slots", other_ranks))
    return probes


def _reference(probe: dict, block: Block) -> torch.Tensor:
    weights = probe["weights"]
    if block.fp4 is not None:
        return moe_experts_reference(probe["x"], probe["ids"], weights, probe["w13_packed"], probe["w13_scale"],
                                     probe["w2_packed"], probe["w2_scale"], 0, block.swiglu_limit)
    if block.weights_cast is not None:
        weights = weights.to(block.weights_cast)
    if block.quantized is not None:
        return moe_experts_fp8_reference(probe["x"], probe["ids"], weights, probe["gate_up"], probe["gate_up_scale"],
                                         probe["down"], probe["down_scale"], *block.quantized[0].blocks, 0,
                                         block.swiglu_limit)
    gate_up, down, up = _op_stacks(probe)
    return moe_experts_bf16_reference(probe["x"], probe["ids"], weights, gate_up, down, 0, block.swiglu_limit, up)


def _within_budget(got: list, want: torch.Tensor, probe: dict) -> str | None:
    """None when the slice's output has the reference's shape, dtype and NaN positions and is within `BUDGET`."""
    (out,) = got
    if out.shape != want.shape or out.dtype != want.dtype:
        return f"an output {out.dtype}{list(out.shape)}, the reference's {want.dtype}{list(want.shape)}"
    budget = BUDGET.get(want.dtype, BUDGET[torch.bfloat16])
    out, want = out.float(), want.float()
    if not torch.equal(out.isnan(), want.isnan()):
        return "NaN where the reference has none, or the reverse (an unrouted expert read, or a slot lost)"
    if out.numel() == 0:
        return None
    diff = (out - want).nan_to_num(0.0).abs().max()
    size = want.nan_to_num(0.0).abs().max().clamp_min(1e-6)
    if diff > budget * size:
        return f"outputs differ by {float(diff / size):.1e} of their size (budget {budget:g})"
    return None


# ---------------------------------------------------------------------------
# Rewrite
# ---------------------------------------------------------------------------


def _rewrite(graph: torch.fx.Graph, anchor: torch.fx.Node, m: Block, ctx: PassContext) -> None:
    out = m.out
    weights = m.weights
    if m.fp4 is not None:
        w13, w2 = m.fp4
        args = (m.x, m.ids, weights, w13.packed, w13.scale, w2.packed, w2.scale, 0, *_given(m.swiglu_limit))
        op, target = "dsfuse.moe_experts_fp4", torch.ops.dsfuse.moe_experts_fp4.default
    elif m.quantized is not None:
        if m.weights_cast is not None and m.weights_cast != dtype(weights):
            weights = insert_call(graph, out, CONVERT, (weights, m.weights_cast))
        g1, g2 = m.quantized
        args = (m.x, m.ids, weights, g1.weight, g1.scale, g2.weight, g2.scale, *g1.blocks, 0,
                *_given(m.swiglu_limit))
        op, target = "dsfuse.moe_experts_fp8", torch.ops.dsfuse.moe_experts_fp8.default
    else:
        if m.weights_cast is not None and m.weights_cast != dtype(weights):
            weights = insert_call(graph, out, CONVERT, (weights, m.weights_cast))
        args = _bf16_args(m.x, m.ids, weights, _stack_args(graph, out, m.stacks), m.swiglu_limit)
        op, target = "dsfuse.moe_experts_bf16", torch.ops.dsfuse.moe_experts_bf16.default
    fused = insert_call(graph, out, target, args)
    out.replace_all_uses_with(fused)
    E = shape(m.gate_up)[0] if m.fp4 is None else shape(m.fp4[0].packed)[0]
    detail = f"{m.kind} GEMMs, {m.combine}, E={E}, k={m.top_k}"
    if m.quantized is not None and dtype(m.gate_up) in (torch.int8, torch.uint8):
        detail += ", FP4 weights, a scale per row and 32 values"
    elif m.quantized is not None:
        detail += f", FP8 weights in {m.quantized[0].blocks[0]} x {m.quantized[0].blocks[1]} blocks"
    if m.fp4 is None and m.quantized is None:
        detail += _layout_detail(m.stacks)
    if m.swiglu_limit is not None:
        detail += f", SwiGLU clamped at {m.swiglu_limit:g}"
    if m.expert_parallel:
        detail += ", expert-parallel sentinel slots skipped"
    ctx.site(anchor, op, [a for a in args if isinstance(a, torch.fx.Node)], detail=detail)
    for note in m.notes:
        ctx.near_miss(anchor, f"{note}: fused with the decoded weight stack (moe_experts_bf16), not from the bytes")


# ---------------------------------------------------------------------------
# Binding: dense experts, every expert on every token
# ---------------------------------------------------------------------------

DENSE_GEMMS = (aten.mm.default, aten.bmm.default)
STACK_READS = LAYOUT_OPS | {aten.select.int, aten.slice.Tensor, CONVERT}
# How a dense MoE spreads the router's [T, k] weights over [T, E]: a scatter, an index_put or a one-hot compare
# (summed with the weights over k).
DENSE_WEIGHTING = (aten.scatter.src, aten.scatter.value, aten.index_put.default, aten.eq.Tensor)


def _fuse_dense_experts(graph: torch.fx.Graph, ctx: PassContext) -> None:
    """Fuse, or report, each SwiGLU expert block that multiplies whole weight stacks (`einsum` over all experts, or a
    loop over the experts) and weights its outputs by routing weights spread over every expert, once per gate stack:
    the expert GEMM anchors no rewrite there, and a dense MoE must not pass silently."""
    if not any(_dense_gemm(node) for node in graph.nodes if is_op(node, *DENSE_GEMMS)):
        return  # most graphs: no GEMM reads a whole 3-D stack, so no product needs tracing back
    done = set()
    for node in list(graph.nodes):
        if not is_op(node, *DENSE_ANCHORS) or not all(isinstance(a, torch.fx.Node) for a in node.args):
            continue
        for side in node.args:
            roots = _roots(side)
            found = _dense_gemm(next(iter(roots))) if len(roots) == 1 else None
            if found is None or found[1] in done:
                continue
            if not _silu_side(side, next(iter(roots))):
                continue
            if _rows_picked_by_nonzero(found[0], found[1]):
                done.add(found[1])
                ctx.near_miss(found[0], PICKED_ROWS_REASON)
            elif _densely_weighted(node):
                done.add(found[1])
                try:
                    block = _dense_block(node, *found)
                except NoMatch as miss:
                    ctx.near_miss(found[0], miss.reason)
                else:
                    _rewrite_dense(graph, found[0], block, ctx)


def _rows_picked_by_nonzero(gemm: torch.fx.Node, stack: torch.fx.Node) -> bool:
    """Whether the GEMM's rows (its operand other than the stack) are picked by a `nonzero` of the routing: a loop
    over the experts that runs each on its own tokens (`torch.where(ids == e)`), compiled whole only where Dynamo
    captures data-dependent shapes."""
    rows = [a for a in gemm.args[:2] if strip(a, STACK_READS) is not stack]
    return any(reaches_back(a, lambda n: is_op(n, aten.nonzero.default), lambda n: n.op == "call_function", 8)
               for a in rows)


def _whole_stack(operand) -> torch.fx.Node | None:
    """The 3-D graph input a GEMM operand reads whole (through layout ops, a per-expert `select` included), else
    None."""
    stack = strip(operand, STACK_READS)
    if isinstance(stack, torch.fx.Node) and stack.op in ("placeholder", "get_attr") and len(shape(stack)) == 3:
        return stack
    return None


def _dense_gemm(gate: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(the GEMM, its weight stack) for a gate computed by an `mm` / `bmm` of a whole 3-D graph input, else None."""
    gemm = strip(gate, (*STACK_READS, operator.getitem, *SPLIT_OPS))
    if not is_op(gemm, *DENSE_GEMMS):
        return None
    for operand in gemm.args[:2]:
        stack = _whole_stack(operand)
        if stack is not None:
            return gemm, stack
    return None


def _spreads(node: torch.fx.Node) -> bool:
    """Whether `node` may lie between the routing and the dense [T, E] weights: a read of them, an elementwise op, or
    a sum (`(one_hot(ids, E) * w[..., None]).sum(1)`)."""
    return node.op == "call_function" and (node.target in STACK_READS or _is_pointwise(node)
                                           or is_op(node, aten.sum.dim_IntList))


def _densely_weighted(product: torch.fx.Node, depth: int = 12) -> bool:
    """Whether the SwiGLU `product`'s downstream (the down GEMM and its weighting) reads router weights spread over
    every expert."""
    frontier, seen = [(product, 0)], {product}
    while frontier:
        node, d = frontier.pop()
        for user in node.users:
            if user in seen or d >= depth or user.op != "call_function":
                continue
            seen.add(user)
            for other in user.all_input_nodes:
                if other not in seen and reaches_back(other, lambda n: is_op(n, *DENSE_WEIGHTING), _spreads, 6):
                    return True
            frontier.append((user, d + 1))
    return False


@dataclass
class DenseBlock:
    """Every expert on every token: the op's routed form with k = E (token t's slot e is expert e) and the dense
    router weights `[T, E]` as the slots' weights."""

    x: torch.fx.Node
    weights: torch.fx.Node
    stacks: dict  # op role -> stack: "gate_up" / "down" (/ "up"), "_kn" added for a stack stored [E, K, N]
    out: torch.fx.Node


# What lies between the dense [T, E] router weights and the products that read them (a column per expert, a view).
DENSE_WEIGHT_READS = LAYOUT_OPS | {aten.select.int, aten.slice.Tensor}


def _next_dense_gemm(node: torch.fx.Node, depth: int = 6) -> torch.fx.Node | None:
    """The first `mm` / `bmm` that reads `node` through layout ops and casts."""
    frontier = [(node, 0)]
    while frontier:
        n, d = frontier.pop(0)
        for user in n.users:
            if is_op(user, *DENSE_GEMMS):
                return user
            if d < depth and user.op == "call_function" and user.target in STACK_READS:
                frontier.append((user, d + 1))
    return None


def _dense_block(product: torch.fx.Node, gemm: torch.fx.Node, gate_stack: torch.fx.Node) -> DenseBlock:
    """Bind a dense MoE to the op's roles: the rows the gate GEMM reads, the two stacks, the [T, E] weights that the
    expert outputs are multiplied by, and the first [T, H] tensor in x's dtype that every down GEMM reaches; then
    prove the binding on probes (each stack tried in the op's layout and stored [E, K, N] where sizes allow both)."""
    rows = [strip(a, STACK_READS) for a in gemm.args[:2] if _whole_stack(a) is not gate_stack]
    if len(rows) != 1 or len(shape(rows[0])) != 2:
        raise NoMatch("the dense expert GEMM's rows are not a [T, H] tensor")
    x = rows[0]
    down_gemm = _next_dense_gemm(product)
    down = next((s for s in map(_whole_stack, down_gemm.args[:2]) if s is not None), None) if down_gemm else None
    if down is None or down is gate_stack:
        raise NoMatch("the dense SwiGLU activation does not feed a GEMM of a second whole weight stack")
    gate_stacks, down_gemms = set(), []
    for node in product.graph.nodes:
        if not is_op(node, *DENSE_GEMMS):
            continue
        a, b = node.args[:2]
        for stack_side, rows_side in ((a, b), (b, a)):
            stack = _whole_stack(stack_side)
            if stack is down:
                down_gemms.append(node)
            elif stack is not None and strip(rows_side, STACK_READS) is x:
                gate_stacks.add(stack)
    gate_stacks.discard(gate_stack)
    if len(gate_stacks) > 1:
        raise NoMatch(f"{len(gate_stacks) + 1} weight stacks multiply the dense experts' rows; a SwiGLU block has a "
                      f"gate and an up stack")
    up = gate_stacks.pop() if gate_stacks else None
    stacks_read = [s for s in (gate_stack, up, down) if s is not None]
    if any(dtype(stack) != dtype(x) for stack in stacks_read):
        raise NoMatch(f"expert weights {'/'.join(str(dtype(s)) for s in stacks_read)} differ from the activations' "
                      f"{dtype(x)}")
    out = _reached_by_all(down_gemms, shape(x), dtype(x))
    if out is None:
        raise NoMatch("the dense experts' outputs are not summed into one [T, H] tensor in the activations' dtype")
    num_experts = shape(gate_stack)[0]
    weights = _dense_weights(out, set(stacks_read) | {x}, num_experts)
    failures = []
    for stacks in _stack_bindings(gate_stack, down, num_experts, shape(x)[1], up):
        block = DenseBlock(x=x, weights=weights, stacks=stacks, out=out)
        verdict = _verify_dense(block)
        if verdict.ok is None:
            raise NoMatch(f"the dense experts are not checked on probes ({verdict.reason}), so not rewritten")
        if verdict.ok:
            return block
        failures.append(verdict.reason)
    if not failures:
        raise NoMatch(f"the dense expert stacks {' / '.join(str(shape(s)) for s in stacks_read)} are not "
                      f"[E, 2I, H] / [E, H, I] (or gate and up [E, I, H] apart, or stored [E, K, N]) for "
                      f"H = {shape(x)[1]}")
    raise NoMatch(f"numeric check against the reference failed: {failures[0]}")


def _reached_by_all(gemms: list[torch.fx.Node], want_shape: tuple, want_dtype: torch.dtype) -> torch.fx.Node | None:
    """The first node (graph order) of `want_shape` and `want_dtype` that every one of `gemms` reaches."""
    bits = {gemm: 1 << i for i, gemm in enumerate(gemms)}
    every = (1 << len(gemms)) - 1
    reached = {}
    for node in gemms[0].graph.nodes:
        mask = bits.get(node, 0)
        for source in node.all_input_nodes:
            mask |= reached.get(source, 0)
        if not mask:
            continue
        reached[node] = mask
        if mask == every and node.op == "call_function" and tensor_val(node) is not None \
                and same_shape(shape(node), want_shape) and dtype(node) == want_dtype:
            return node
    return None


def _dense_weights(out: torch.fx.Node, sources: set, num_experts) -> torch.fx.Node:
    """The one [T, E] float tensor through which the routing reaches the slice from `sources` to `out` (read whole,
    by columns or viewed)."""
    found = pure_slice([out], sources, max_nodes=_dense_max_nodes(num_experts))
    if found is None:
        raise NoMatch(f"the dense block has more than {_dense_max_nodes(num_experts)} nodes")
    nodes, frontier = found
    # Tensors only: a size read off the routing (a symbolic T under dynamic=True) is not the weights.
    computed = set(sources)
    routed = {n for n in frontier if n not in sources and n.op != "get_attr" and tensor_val(n) is not None}
    readers = set()
    for node in nodes:
        inputs = node.all_input_nodes
        if any(a in computed for a in inputs):
            computed.add(node)
            readers.update(a for a in inputs if a in routed)
        elif tensor_val(node) is not None and any(a in routed for a in inputs):
            routed.add(node)
    read = {strip(node, DENSE_WEIGHT_READS) for node in readers}
    if len(read) != 1:
        raise NoMatch("the dense expert outputs are not weighted by one [T, E] tensor of router weights")
    (weights,) = read
    if not same_shape(shape(weights), (shape(out)[0], num_experts)) or dtype(weights) not in FLOAT_DTYPES:
        raise NoMatch(f"the dense router weights {shape(weights)} {dtype(weights)} are not a float [T, E] tensor")
    return weights


def _dense_max_nodes(num_experts) -> int:
    """A loop over the experts unrolls into a few dozen nodes per expert."""
    return max(MAX_NODES, 40 * num_experts)


def _stack_bindings(gate: torch.fx.Node, down: torch.fx.Node, num_experts, hidden,
                    up: torch.fx.Node | None = None) -> list[dict]:
    """The op roles the stacks may take by their sizes: each in the op's [E, N, K] layout or stored [E, K, N] (both
    where the sizes cannot tell), the op's layout first; with `up`, the gate and up stacks apart, in one layout."""
    bindings = []
    _, rows, cols = shape(gate)
    if up is not None and not same_shape(shape(up), shape(gate)):
        return bindings
    for stored_kn, width, contracted in ((False, rows, cols), (True, cols, rows)):
        if not (same_size(contracted, hidden) and isinstance(width, int) and (up is not None or width % 2 == 0)):
            continue
        inter = width if up is not None else width // 2
        for down_kn, want in ((False, (num_experts, hidden, inter)), (True, (num_experts, inter, hidden))):
            if same_shape(shape(down), want):
                binding = {_role("gate_up", stored_kn): gate, _role("down", down_kn): down}
                if up is not None:
                    binding[_role("up", stored_kn)] = up
                bindings.append(binding)
    return bindings


# ---------------------------------------------------------------------------
# Verification: dense experts
# ---------------------------------------------------------------------------


def _verify_dense(block: DenseBlock) -> Verdict:
    roles = {"x": block.x, "weights": block.weights, **block.stacks}
    family = Family(probes=_dense_probes, reference=_dense_reference, compare=_within_budget)
    return verify([block.out], roles, family, ("dense", *sorted(block.stacks)),
                  max_nodes=_dense_max_nodes(shape(block.weights)[1]))


def _dense_probes(shapes: dict, dtypes: dict) -> list:
    """Random dense weights with zeros (every token's weight of the last expert among them), the last expert's
    stacks NaN under those zeros (a dense block reads it: NaN everywhere, where skipping zero-weight experts would
    not be), and a token whose every weight is zero."""
    gen = torch.Generator().manual_seed(0)
    T, E = shapes["weights"]
    weights = (torch.rand(T, E, generator=gen) * 8).round() / 8 * (torch.rand(T, E, generator=gen) < 0.6)
    weights[:, -1] = 0
    stacks = {name: _stack_probe(name, shapes[name], dtypes[name], gen) for name in shapes
              if name not in ("x", "weights")}
    base = {"x": _grid(shapes["x"], dtypes["x"], gen, 0.25), "weights": weights.to(dtypes["weights"]), **stacks}
    zero_token = dict(base, weights=base["weights"].clone())
    zero_token["weights"][0] = 0
    probes = [("dense weights", base), ("a token without weights", zero_token)]
    if E > 1:
        probes.append(("an expert with NaN weights", dict(base, **{n: _poisoned(s) for n, s in stacks.items()})))
    return probes


def _dense_reference(probe: dict) -> torch.Tensor:
    weights = probe["weights"]
    gate_up, down, up = _op_stacks(probe)
    ids = torch.arange(weights.shape[1]).expand(weights.shape)
    return moe_experts_bf16_reference(probe["x"], ids, weights, gate_up, down, up=up)


# ---------------------------------------------------------------------------
# Rewrite: dense experts
# ---------------------------------------------------------------------------


def _rewrite_dense(graph: torch.fx.Graph, anchor: torch.fx.Node, block: DenseBlock, ctx: PassContext) -> None:
    """`moe_experts_bf16` with ids `[T, E]` = arange(E) on every row: each token runs every expert, weighted by its
    dense weights (a zero weight times a non-finite output stays NaN, as in the dense source)."""
    out, weights = block.out, block.weights
    num_experts = shape(weights)[1]
    experts = insert_call(graph, out, torch.ops.prims.iota.default, (num_experts,),
                          {"start": 0, "step": 1, "dtype": torch.int64, "device": tensor_val(weights).device,
                           "requires_grad": False})
    tokens = size_arg(graph, out, weights, 0)
    every = insert_call(graph, out, aten.expand.default, (experts, [tokens, num_experts]))
    ids = insert_call(graph, out, aten.clone.default, (every,), {"memory_format": torch.contiguous_format})
    args = _bf16_args(block.x, ids, weights, _stack_args(graph, out, block.stacks), None)
    fused = insert_call(graph, out, torch.ops.dsfuse.moe_experts_bf16.default, args)
    out.replace_all_uses_with(fused)
    ctx.site(anchor, "dsfuse.moe_experts_bf16", [a for a in args if isinstance(a, torch.fx.Node)],
             detail=f"dense GEMMs (every expert on every token, k = E), E={num_experts}{_layout_detail(block.stacks)}")


# ---------------------------------------------------------------------------
# Binding: transformers' eager experts loop (reported, never rewritten)
# ---------------------------------------------------------------------------


def _report_eager_loops(graph: torch.fx.Graph, ctx: PassContext) -> None:
    """Report the expert-mask graph of the eager loop: `one_hot(ids, E + 1)` summed to "experts hit" that
    leaves the graph for `nonzero()`."""
    for node in graph.nodes:
        if not is_op(node, *EAGER_LOOP_ANCHORS):
            continue
        column, classes = node.args
        if not (is_op(column, aten.unsqueeze.default) and column.args[1] == -1 and is_op(classes,
                torch.ops.prims.iota.default) and len(shape(column.args[0])) == 2
                and dtype(column.args[0]) in INDEX_DTYPES):
            continue
        if _hit_mask_leaves_graph(node):
            ctx.near_miss(node, EAGER_LOOP_REASON)


def _hit_mask_leaves_graph(one_hot: torch.fx.Node) -> bool:
    stack, seen = [one_hot], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if is_op(user, CONVERT, *TRANSPOSE_OPS):
                stack.append(user)
            elif is_op(user, aten.sum.dim_IntList):
                hit = only_user(user)
                if is_op(hit, aten.gt.Scalar) and hit.args[1] == 0 and any(u.op == "output" for u in hit.users):
                    return True
    return False
