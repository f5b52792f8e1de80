"""`sparse_attention`: attention restricted to indexer-selected keys, rewritten into one fused op.

Anchors, by op class: index-driven selections, i.e. masks built by scattering the picks (`scatter.value`, either
polarity once canonicalised, `scatter.src`) and rows read by an index tensor (`index.Tensor`, `gather`, which
`take_along_dim` lowers to, `index_select`). From each, a walk binds the roles of the op's reference:

* HF `DeepseekV32Attention` / `GlmMoeDsaAttention` (eager / SDPA interfaces): the selection mask
  `full(True, [B,S,T]).scatter(-1, idx, False)` combined with the attention mask (`mask & ~sel` for bool masks,
  `where(sel, finfo.min, mask)` for additive ones, or a -inf selection bias summed with an additive mask, the op's
  hard selection) or used alone (a `where` on the scores, a -inf bias added to them or given to SDPA), consumed by
  the decomposed attention `softmax(scale * q @ k^T + bias) @ v` (eager, or Inductor's CPU SDPA math with its "safe
  softmax", or a softmax spelled otherwise, a log-sum-exp form say or one with a per-head sink, bound as the gather
  forms' is) or by a fused SDPA op (`_scaled_dot_product_{efficient,cudnn}_attention`,
  `..._flash_attention_for_cpu`); K/V per head or shared by the heads (read through an expand). The
  chain from the scatter to the attention output becomes `dsfuse::sparse_attention_masked`, which gets the
  original attention mask and applies the selection itself; a bool mask built only from query/key positions
  (`key <= query + T - S`, no padding) is replaced by `causal=True`; decode-sized steps over HF's latent cache are
  read in absorbed form (`dsfuse::absorbed_mla_attention`).
* Official-style absorbed MLA (and dsfuse's own model): latent rows `kv[arange(B)[:,None,None], idx.clamp(min=0)]`
  (or the same rows by `gather`, or by `index_select` from the flattened cache at `b * T + idx.clamp(min=0)`, the
  offsets proven on probes) used both as keys and as values, rope rows gathered by the same indices, `-1`
  picks masked to -inf, an fp32 softmax and P @ kv_rows, q tokens- or heads-first: `dsfuse::sparse_mla_attention`.
  The softmax is bound by what it reads, not by its ops (a max-shifted or logsumexp form, Inductor's scaled form, a
  per-head sink as a column or as a term of the denominator): the verifier proves which function it is. The
  official decode form (`full(-inf).scatter(-1, topk, 0)` added to scores over the whole caches) too, when the
  picks are a top-k's.
* HF `DeepseekV4Attention` (sink attention over the sliding window plus compressed entries): matched in
  `sparse_attention_v4.py` and rewritten into `dsfuse::compressed_attention`.

Every contraction is checked by following labelled dims (`dims.py`), and the slice from the bound roles to the
attention output is then run on probes against the op's reference math (`verify.py`): random picks with repeats,
tied keys, fully masked rows, finfo.min and -inf masks, -1 and lower picks and a query without keys for the gather
forms; a disagreement is a near-miss naming the probe. A selection that reaches an attention (a mask reaching a
softmax or SDPA, rows used as an operand of the score or output product) ends in a site or a near-miss with the
reason; one that does not (an unrelated scatter or gather) is skipped silently.

Stages: anchors `ANCHORS` (`MASK_ANCHORS` and `ROW_ANCHORS`), then V4's `sparse_attention_v4.ANCHORS`; binders
`_match_masked` (the scatter forms) and `_match_mla` (the gather forms), dispatched by `_match`; verifier `_verify`,
against `sparse_attention_masked_math` and `sparse_mla_attention_math` (kernels/sparse_attention.py); rewrites
`_rewrite_masked` into `dsfuse::sparse_attention_masked` or `dsfuse::absorbed_mla_attention` and `_rewrite_mla` into
`dsfuse::sparse_mla_attention`. V4's sites (`sparse_attention_v4.py`): its own binder, verifier (against
`compressed_attention_reference`) and rewrite.
"""

from __future__ import annotations

import math
import operator

import torch

from dsfuse.kernels.sparse_attention import sparse_attention_masked_math, sparse_mla_attention_math  # and the ops
import dsfuse.kernels.indexer_topk  # noqa: F401  (torch.ops.dsfuse.indexer_topk: a source of top-k indices)
from dsfuse.kernels.fp8_linear import weight_dims  # and the ops of an FP8 checkpoint's kv_b_proj

from . import sparse_attention_v4
from .canonicalize import canonical_bmm, padded_product
from .context import NoMatch, PassContext, rewrite_anchored
from .dims import Labels, apply_op, bmm_labels, contracted, follow, leaf_labels, names, views_along
from .graph_utils import (AND_OPS, CONVERT, FLOAT_DTYPES, INDEX_DTYPES, LAYOUT_OPS, NOT_OPS, PREPARE_SOFTMAX_ONLINE,
                          VIEW_OPS, WHERE_OPS, aten, attention_softmax, broadcasts_to, dtype, fill_value, insert_call, is_last_dim,
                          is_last_dim_cat, is_neg_inf, is_op, is_upcast, masking_bias, node_arg, only_user, reaches_back,
                          refuse_changed_keyword, same_shape, same_size, scalar_constant, scale_factor, scaled_input,
                          shape, size_arg, strip, val, walk_back, walk_forward)
from .verify import Family, Verdict, verify

NAME = "sparse_attention"
IMPLEMENTED = True

# Up to this many queries per step (decode, speculative steps) attention over HF's latent cache is rewritten
# into the absorbed form: it does O(K) work per query instead of expanding all T cached latents each step.
ABSORB_MAX_QUERIES = 64
# Fused SDPA ops and the name of their mask argument (flash takes none, so never carries a selection).
FUSED_SDPA = {
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
}


# ---------------------------------------------------------------------------
# Anchors, and the binder and rewrite each anchor class goes to
# ---------------------------------------------------------------------------

# Index-driven selections, by op class: a mask built by scattering the picks (a scattered constant of either
# polarity, bool or additive, or scattered values), and rows read by an index tensor (advanced indexing, `gather`,
# which `take_along_dim` lowers to, `index_select`).
MASK_ANCHORS = (aten.scatter.value, aten.scatter.src)
ROW_ANCHORS = (aten.index.Tensor, aten.gather.default, aten.index_select.default)
ANCHORS = MASK_ANCHORS + ROW_ANCHORS


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    rewrite_anchored(graph, ctx, ANCHORS, _match, _rewrite)
    sparse_attention_v4.run(graph, ctx)  # V4's sink attention: its own anchors, binder and rewrite


def _match(anchor: torch.fx.Node) -> dict:
    """The structural walk binds the roles (q, k, v, indices, mask, scale); the slice it found is then run on probes
    against the op's reference. A selection that feeds an attention is a site or a near-miss with its reason."""
    if getattr(anchor, "_erased", False):
        raise NoMatch("part of a site already rewritten", reported=False)
    try:
        found = _match_masked(anchor) if anchor.target in MASK_ANCHORS else _match_mla(anchor)
    except NoMatch as miss:
        if miss.reported or not _feeds_attention(anchor) or _beside_a_row_gather(anchor):
            raise
        raise NoMatch(f"an index-driven selection ({anchor.target}) feeds an attention the matcher does not read: "
                      f"{miss.reason}") from None
    verdict = _verify(found)
    if verdict.ok is False:
        raise NoMatch(f"numeric check against the reference failed: {verdict.reason}")
    return found


def _rewrite(graph: torch.fx.Graph, anchor: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    if anchor.target in MASK_ANCHORS:
        _rewrite_masked(graph, anchor, m, ctx)
    else:
        _rewrite_mla(graph, anchor, m, ctx)
    # The replaced slice goes now, so its other anchors (the rope rows gathered beside the latent ones) are not
    # matched again.
    graph.eliminate_dead_code()


# ---------------------------------------------------------------------------
# Binding: the family's signature, a selection that reaches an attention
# ---------------------------------------------------------------------------

SIGNATURE_DEPTH = 12
NORMALISERS = (aten.amax.default, aten.exp.default, aten._softmax.default, aten.logsumexp.default)
PRODUCTS = (aten.bmm.default, aten.mm.default)


def _elementwise(node: torch.fx.Node) -> bool:
    target = node.target if node.op == "call_function" else None
    return target in LAYOUT_OPS or target in (CONVERT, aten.slice.Tensor) or (
        isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags)


def _reaches(start: torch.fx.Node, found, through, depth: int = SIGNATURE_DEPTH) -> bool:
    """Whether a user of `start` (or its users, through nodes for which `through` holds) satisfies `found`."""
    pending, seen = [(start, 0)], set()
    while pending:
        node, level = pending.pop()
        for user in node.users:
            if user in seen or level >= depth:
                continue
            seen.add(user)
            if found(user, node):
                return True
            if through(user):
                pending.append((user, level + 1))
    return False


def _index_sources(node: torch.fx.Node) -> set:
    """The integer tensors a row gather's indices are computed from (through elementwise integer arithmetic, layout
    ops and casts: clamps, flattening offsets), constants left out."""
    indices = [a for a in node.args[1] if isinstance(a, torch.fx.Node)] if is_op(node, aten.index.Tensor) \
        else [node.args[2]]
    found, pending, seen = set(), list(indices), set()
    while pending:
        cur = pending.pop()
        if cur in seen or dtype(cur) not in INDEX_DTYPES:
            continue
        seen.add(cur)
        if _elementwise(cur):
            pending.extend(cur.all_input_nodes)
        elif not is_op(cur, torch.ops.prims.iota.default, aten.full.default, aten.arange.start, aten.arange.default):
            found.add(cur)
    return found


def _beside_a_row_gather(anchor: torch.fx.Node) -> bool:
    """Rows gathered by the same indices as another row gather that reads them as keys and values (the rope rows
    beside the latent ones): that gather's site or near-miss speaks for both."""
    if anchor.target in MASK_ANCHORS:
        return False
    sources = _index_sources(anchor)
    return bool(sources) and any(
        node is not anchor and node.op == "call_function" and node.target in ROW_ANCHORS
        and _index_sources(node) & sources and _used_as_keys_and_values(node) for node in anchor.graph.nodes)


def _used_as_keys_and_values(rows: torch.fx.Node) -> bool:
    return sum(pos >= 0 for _, pos, _ in _bmms_using(rows)) >= 2


def _softmax_reduction(node: torch.fx.Node) -> bool:
    """A softmax's row statistic: its max, its log-sum-exp, the op itself, Inductor's online (max, sum), or a sum of
    exponentials. An exponential alone is not one: SiLU's `x / (1 + exp(-x))` between an expert's GEMMs has one."""
    if is_op(node, aten.amax.default, aten._softmax.default, aten.logsumexp.default, PREPARE_SOFTMAX_ONLINE):
        return True
    if node.op == "call_function" and node.target is operator.getitem:
        return is_op(node.args[0], PREPARE_SOFTMAX_ONLINE)
    return is_op(node, aten.sum.dim_IntList) and reaches_back(
        node.args[0], lambda n: is_op(n, aten.exp.default), _elementwise, SIGNATURE_DEPTH)


def _feeds_attention(anchor: torch.fx.Node) -> bool:
    """Whether the selection reaches an attention: a mask reaches a softmax's normaliser or a fused SDPA op through
    elementwise and layout ops; gathered rows, through layout ops and casts only, are an operand of a product that
    is either P @ V (its other operand an exponential over a softmax statistic) or the scores (a softmax statistic
    read after it). Expert weights gathered by the routing feed products too, between which SiLU's exponential sits
    but no softmax statistic. A mask that becomes one part of a key concatenation is DeepSeek V4's form,
    `sparse_attention_v4`'s to match or report."""
    if anchor.target in MASK_ANCHORS:
        if _reaches(anchor, lambda user, _: is_last_dim_cat(user), _elementwise):
            return False
        return _reaches(anchor, lambda user, _: user.target in FUSED_SDPA or is_op(user, *NORMALISERS), _elementwise)

    def direct(node):
        return is_op(node, *LAYOUT_OPS, CONVERT, aten.slice.Tensor)

    def attention_product(user, operand):
        if user.target in FUSED_SDPA:
            return True
        if not is_op(user, *PRODUCTS):
            return False
        other = user.args[0] if user.args[1] is operand else user.args[1]
        normalised = reaches_back(other, lambda n: is_op(n, aten.exp.default), _elementwise, SIGNATURE_DEPTH) \
            and reaches_back(other, _softmax_reduction, _elementwise, SIGNATURE_DEPTH)
        return normalised or _reaches(user, lambda u, _: _softmax_reduction(u), _elementwise)

    return _reaches(anchor, attention_product, direct)


# ---------------------------------------------------------------------------
# Binding: small structural helpers
# ---------------------------------------------------------------------------


def _is_float_cast(node) -> bool:
    return is_op(node, CONVERT) and node.args[1] in FLOAT_DTYPES


def _is_widening(node) -> bool:
    src = dtype(node.args[0])
    return src is not None and src.is_floating_point and node.args[1] in (torch.float32, src)


def _chain_back(node, narrowing: bool = False) -> list[torch.fx.Node]:
    """[leaf, ..., node]: walk back through layout ops, constant scalings and widening float casts
    (narrowing ones too if asked: a tensor read before a rounding cast is not the tensor used)."""
    chain = [node]
    while canonical_bmm(node) is None:  # a product Inductor wrote another way stops the walk where it is recorded
        if is_op(node, *LAYOUT_OPS) or _is_float_cast(node) and (narrowing or _is_widening(node)):
            node = node.args[0]
        elif scale_factor(node) is not None:
            node = scaled_input(node)
        else:
            break
        chain.append(node)
    return chain[::-1]


def _pick(chain: list[torch.fx.Node], want: tuple) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """The earliest node of `chain` whose shape is `want`, and the ops after it."""
    return next(iter(views_along(chain, lambda node: same_shape(shape(node), want))), None)


def _scale_of(ops: list[torch.fx.Node]) -> float:
    scale = 1.0
    for op in ops:
        factor = scale_factor(op)
        if factor is not None:
            scale *= factor
    return scale


def _through(labels: Labels | None, ops: list[torch.fx.Node]) -> Labels | None:
    """Follow labels through layout ops; casts and constant scalings keep them."""
    return follow(labels, [op for op in ops if not (_is_float_cast(op) or scale_factor(op) is not None)])


def _expected(letters: str, sizes: tuple) -> list[tuple[str, ...]]:
    return names([((n, size),) for n, size in zip(letters, sizes)])


def _bias_passthrough(node) -> bool:
    """Ops a bias may pass on its way into a fused SDPA op: layout ops, casts, and the memory-efficient
    kernel's alignment padding (pad at the end, slice back from 0), which keep every element in place."""
    if is_op(node, *LAYOUT_OPS, CONVERT):
        return True
    if is_op(node, aten.constant_pad_nd.default):
        return all(before == 0 for before in node.args[1][::2])
    if is_op(node, aten.slice.Tensor):
        start = node.args[2] if len(node.args) > 2 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        return start in (0, None) and step == 1
    return False


def _single_user_chain(node, passthrough) -> tuple[torch.fx.Node, torch.fx.Node | None]:
    """Follow single users through ops in `passthrough` (a set of targets or a predicate):
    (last node, its single user or None if shared)."""
    passes = passthrough if callable(passthrough) else (lambda n: is_op(n, *passthrough))
    last = walk_forward(node, passes)[-1]
    return last, only_user(last)


def _viewed_as(out: torch.fx.Node, want: tuple, dims: str) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The attention output `out` followed through single-user layout ops to its view of shape `want`, and
    those ops."""
    ops = []
    while not same_shape(shape(out), want):
        nxt = only_user(out, *LAYOUT_OPS)
        if nxt is None:
            raise NoMatch(f"the attention output is not viewed back to [{dims}]")
        ops.append(nxt)
        out = nxt
    return out, ops


def _schema_args(node: torch.fx.Node) -> dict:
    schema = node.target._schema
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        else:
            out[arg.name] = node.kwargs.get(arg.name, arg.default_value)
    return out


def _index_source(index) -> torch.fx.Node:
    """The index tensor before integer casts (the indexer's int32 output or topk's int64)."""
    return walk_back(index, lambda n: is_op(n, CONVERT) and dtype(n.args[0]) in INDEX_DTYPES)[0]


# ---------------------------------------------------------------------------
# Binding: HF form, a scatter mask + dense attention over all keys
# ---------------------------------------------------------------------------


def _combined_mask(scatter: torch.fx.Node) -> dict:
    """Follow the selection mask into its combination with the attention mask."""
    sel, user = _single_user_chain(scatter, LAYOUT_OPS)
    while is_op(user, *NOT_OPS):  # `~(~sel)[:, None]`: a keep mask negated back, through layout ops
        after, again = _single_user_chain(user, LAYOUT_OPS)
        if not is_op(again, *NOT_OPS):
            break
        sel, user = _single_user_chain(again, LAYOUT_OPS)
    if user is None:
        raise NoMatch("the selection mask is also used outside the attention mask")
    if is_op(user, *NOT_OPS):
        inverted, user = _single_user_chain(user, LAYOUT_OPS)
        if is_op(user, *WHERE_OPS) and user.args[0] is inverted and scalar_constant(user.args[1]) == 0 \
                and masking_bias(scalar_constant(user.args[2])) is not None:
            # The kept keys alone as a bias (`where(keep, 0, -inf)`: how SDPA reads a bool mask), no attention mask.
            return dict(kind="none", combined=user, attn_mask=None, fill=scalar_constant(user.args[2]))
        if not is_op(user, *AND_OPS) or inverted not in user.args:
            raise NoMatch("the inverted selection mask is not ANDed with the attention mask")
        other = user.args[0] if user.args[1] is inverted else user.args[1]
        if dtype(other) != torch.bool:
            raise NoMatch(f"the selection is ANDed with a {dtype(other)} mask, not a bool one")
        return dict(kind="bool", combined=user, attn_mask=other, fill=None)
    if is_op(user, *WHERE_OPS) and user.args[0] is sel:
        fill, other = scalar_constant(user.args[1]), user.args[2]
        if isinstance(fill, float) and masking_bias(fill) is not None and fill_value(other) == 0:
            # The selection alone as a bias (`zeros.masked_fill(sel, -inf)`, `bias[sel] = -inf`), no attention mask.
            return dict(kind="none", combined=user, attn_mask=None, fill=fill)
        if isinstance(fill, float) and masking_bias(fill) is not None and _are_scores(other):
            # The selection applied to the scores themselves (`scores.masked_fill(sel, -inf)`).
            return dict(kind="none", combined=None, masked_scores=user, attn_mask=None, fill=fill)
        if not isinstance(other, torch.fx.Node) or not isinstance(fill, float):
            raise NoMatch("the selection mask fills a constant, not an attention mask")
        return dict(kind="additive", combined=user, attn_mask=other, fill=fill)
    raise NoMatch(f"the selection mask is combined with the attention mask through {user.target}")


def _are_scores(node) -> bool:
    """Whether `node` is a product (q @ k^T) seen through layout ops, casts and constant scalings: scores, not a
    mask."""
    return isinstance(node, torch.fx.Node) and canonical_bmm(_chain_back(node)[0]) is not None


def _bias_consumer(comb: dict) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(consumer, the input of it that carries the mask): an `add` to scores or a fused SDPA op; for the selection
    applied to the scores, that `where` itself."""
    if comb.get("masked_scores") is not None:
        return comb["masked_scores"], comb["masked_scores"]
    if comb["kind"] == "none":
        node, user = _single_user_chain(comb["combined"], _bias_passthrough)
        if user is None or not (is_op(user, aten.add.Tensor) or user.target in FUSED_SDPA):
            raise NoMatch("the selection bias is not added to the scores alone")
        other = user.args[0] if user.args[1] is node else user.args[1]
        refuse_changed_keyword(user, "the selection bias added to the scores")  # (an SDPA call has no keyword)
        if not is_op(user, aten.add.Tensor) or _are_scores(other):
            return user, node
        if not (is_neg_inf(comb["fill"]) and dtype(other) in FLOAT_DTYPES):
            raise NoMatch(f"the selection's bias ({comb['fill']}) is summed with another additive mask; the op "
                          "fills unpicked keys with finfo.min or drops them (a -inf bias)")
        # A -inf selection bias summed with another additive mask: that mask, with the selection hard (unpicked
        # keys at -inf, not at HF's finfo.min fill). Added to the masked scores (`scores + mask + bias`), the bias
        # meets the scores here; summed first (`scores + (mask + bias)`), the sum reaches them as one mask.
        scored = [a for a in other.args[:2] if _are_scores(a)] if is_op(other, aten.add.Tensor) else []
        if scored:
            refuse_changed_keyword(other, "the attention mask added to the scores")
        if len(scored) == 1:
            mask = other.args[1] if other.args[0] is scored[0] else other.args[0]
            comb.update(kind="additive", combined=node, attn_mask=mask, hard=True, scores=scored[0])
            return user, node
        comb.update(kind="additive", combined=user, attn_mask=other, hard=True)
    node, user = _single_user_chain(comb["combined"], LAYOUT_OPS | {CONVERT})
    if user is None:
        raise NoMatch("the combined attention mask is also used elsewhere")
    if comb["kind"] == "bool":
        if is_op(user, *NOT_OPS):
            flipped = only_user(user)
            if is_op(flipped, *WHERE_OPS) and flipped.args[0] is user and _are_scores(flipped.args[2]) \
                    and masking_bias(scalar_constant(flipped.args[1])):
                # The combined mask applied to the scores themselves (`scores.masked_fill(~mask, -inf)`).
                comb["bias"], comb["masked_scores"] = masking_bias(scalar_constant(flipped.args[1])), flipped
                return flipped, flipped
            if not (is_op(flipped, *WHERE_OPS) and flipped.args[0] is user
                    and masking_bias(scalar_constant(flipped.args[1])) and scalar_constant(flipped.args[2]) == 0):
                raise NoMatch("the combined bool mask is not turned into a -inf bias")
            comb["bias"] = masking_bias(scalar_constant(flipped.args[1]))
            user = flipped
        elif is_op(user, *WHERE_OPS):
            if not (user.args[0] is node and scalar_constant(user.args[1]) == 0
                    and masking_bias(scalar_constant(user.args[2]))):
                raise NoMatch("the combined bool mask is not turned into a -inf bias")
            comb["bias"] = masking_bias(scalar_constant(user.args[2]))
        elif user.target not in FUSED_SDPA:
            raise NoMatch(f"the combined bool mask is consumed by {user.target}")
        if is_op(user, *WHERE_OPS):
            node, user = _single_user_chain(user, _bias_passthrough)
            if user is None:
                raise NoMatch("the attention bias is also used elsewhere")
    if is_op(user, aten.add.Tensor):
        refuse_changed_keyword(user, "the combined attention mask added to the scores")
    if is_op(user, aten.add.Tensor) or user.target in FUSED_SDPA:
        return user, node
    raise NoMatch(f"the combined attention mask is consumed by {user.target}, not by attention")


def _positions(node) -> tuple | None:
    """(length, first position, dim) for `iota(n) + c` unsqueezed to a rank-4 tensor that is 1 except in `dim`."""
    dims = shape(node)
    offset = 0
    while True:
        if is_op(node, aten.unsqueeze.default):
            node = node.args[0]
        elif is_op(node, aten.add.Tensor) and isinstance(node.args[1], (int, torch.SymInt)):
            refuse_changed_keyword(node, "a position offset")
            node, offset = node.args[0], offset + node.args[1]
        else:
            break
    if not is_op(node, torch.ops.prims.iota.default) or node.kwargs.get("step", 1) != 1 or len(dims) != 4:
        return None
    wide = [i for i, size in enumerate(dims) if not same_size(size, 1)]
    if len(wide) > 1:
        return None
    length = node.args[0]
    return length, node.kwargs.get("start", 0) + offset, wide[0] if wide else None


def _plain_causal(mask: torch.fx.Node, S, T) -> bool:
    """Whether the bool `mask` is provably `key <= query + T - S` (bottom-right causal) and nothing else:
    built from two position ranges, no padding input."""
    node = strip(mask, (aten.expand.default,))
    while is_op(node, *AND_OPS):
        consts = [i for i, a in enumerate(node.args) if is_op(a, aten.full.default) and a.args[1] is True]
        if not consts:
            return False
        node = node.args[1 - consts[0]]
    if is_op(node, aten.le.Tensor):
        keys, queries = node.args
    elif is_op(node, aten.ge.Tensor):
        queries, keys = node.args
    else:
        return False
    k_pos, q_pos = _positions(keys), _positions(queries)
    if k_pos is None or q_pos is None or k_pos[2] not in (3, None) or q_pos[2] not in (2, None):
        return False
    return same_size(k_pos[0], T) and same_size(q_pos[0], S) and same_size(q_pos[1] - k_pos[1], T - S)


def _match_masked(scatter: torch.fx.Node) -> dict:
    base, dim, index, value = scatter.args[:4]
    if is_op(base, aten.full.default) and is_neg_inf(base.args[1]) and value == 0 and len(shape(base)) == 3 \
            and dim in (-1, 2) and dtype(_index_source(index)) in INDEX_DTYPES:
        return _index_bias_attention(scatter, _index_source(index))
    if not (is_op(base, aten.full.default) and base.args[1] is True and dtype(base) == torch.bool
            and value is False and len(shape(base)) == 3 and dim in (-1, 2)):
        raise NoMatch("not a scatter of False into an all-True [B, S, T] mask", reported=False)
    idx = _index_source(index)
    if dtype(idx) not in INDEX_DTYPES or len(shape(idx)) != 3:
        raise NoMatch("the selection indices are not an integer [B, S, K] tensor", reported=False)

    comb = _combined_mask(scatter)
    consumer, bias = _bias_consumer(comb)
    if consumer.target in FUSED_SDPA:
        att = _fused_attention(consumer, bias)
    else:
        att = _decomposed_attention(consumer, bias, comb)
    q = att["q"]
    B, H, S, _ = shape(q)
    T = shape(att["k"])[2]
    if not same_shape(shape(base), (B, S, T)) or not same_shape(shape(idx)[:2], (B, S)):
        raise NoMatch(f"selection mask {shape(base)} does not match attention over q {shape(q)}, k {shape(att['k'])}")
    if dtype(q) not in FLOAT_DTYPES or dtype(att["k"]) != dtype(q) or dtype(att["v"]) != dtype(q):
        raise NoMatch(f"q/k/v dtypes {dtype(q)}/{dtype(att['k'])}/{dtype(att['v'])} not supported by the fused op")
    if comb["kind"] == "additive":
        if not comb.get("hard") and comb["fill"] != torch.finfo(dtype(q)).min:
            raise NoMatch(f"unselected keys are filled with {comb['fill']}, not finfo({dtype(q)}).min")
        if not dtype(comb["attn_mask"]).is_floating_point:
            raise NoMatch(f"additive attention mask has dtype {dtype(comb['attn_mask'])}")
    if comb["attn_mask"] is not None and not broadcasts_to(shape(comb["attn_mask"]), (B, H, S, T)):
        raise NoMatch(f"attention mask {shape(comb['attn_mask'])} does not broadcast to [B, H, S, T]")
    if not _selection_in_place(scatter, bias, B, S, T):
        raise NoMatch("the selection mask is not laid out as [B, 1, S, T] where it meets the scores")
    causal = comb["kind"] == "bool" and _plain_causal(comb["attn_mask"], S, T)
    found = dict(att, idx=idx, comb=comb, causal=causal)
    if isinstance(S, int) and S <= ABSORB_MAX_QUERIES:
        try:
            found["absorbed"] = _latent_cache_source(found)
        except NoMatch as why:
            if why.reported:
                found["absorb_refused"] = why.reason
    # A finite bias shifts every key of a row without selected, allowed keys alike, so that row attends over
    # all T keys (a left-padding query, one whose selection holds only padding, or only future keys under a causal
    # mask); both ops reproduce that for a mask shared by the heads.
    found["empty_rows_see_all"] = comb.get("bias") == "finite"
    mask_dims = shape(comb["attn_mask"])
    per_head = len(mask_dims) >= 3 and not same_size(mask_dims[-3], 1)
    if found["empty_rows_see_all"] and "absorbed" not in found and per_head:
        raise NoMatch("the bool mask becomes a finite bias (cuDNN SDPA), which attends to all keys in a row left "
                      "without keys; the masked op reproduces that for a mask shared by the heads, not a per-head one")
    return found


def _copied_into(scatter: torch.fx.Node, start: int, end: int | None) -> torch.fx.Node | None:
    """The source of `slice_scatter(base, copy(slice(base), src), -1, start, end)` (`end=None`: to the
    end of the dim), else None."""
    if not is_op(scatter, aten.slice_scatter.default):
        return None
    args = list(scatter.args)
    _, src, dim, lo, hi = (args + [None, None, 0, None, None][len(args):])[:5]
    to_end = hi is None or isinstance(hi, int) and hi >= 2**62
    if dim not in (-1, 3) or (lo or 0) != start or (not to_end if end is None else hi != end):
        return None
    return src.args[1] if is_op(src, aten.copy.default) else src


def _key_parts(k: torch.fx.Node, D: int) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(per-head nope part, shared rope part) of a key built as HF `expand_kv` does: two slice copies
    into an empty tensor (or a `cat` on the last dim)."""
    if is_op(k, aten.cat.default) and len(k.args[0]) == 2 and node_arg(k, 1, "dim", 0) in (-1, 3):
        return k.args[0][0], k.args[0][1]
    outer = k
    if not is_op(outer, aten.slice_scatter.default) or not is_op(outer.args[0], aten.slice_scatter.default):
        raise NoMatch("keys are not written as [nope | rope] slices", reported=False)
    inner = outer.args[0]
    nope_dim = inner.args[4] if len(inner.args) > 4 else None
    if not isinstance(nope_dim, int) or not 0 < nope_dim < D:
        raise NoMatch("keys are not written as [nope | rope] slices", reported=False)
    nope, rope = _copied_into(inner, 0, nope_dim), _copied_into(outer, nope_dim, None)
    if nope is None or rope is None or not is_op(inner.args[0], aten.empty.memory_format):
        raise NoMatch("keys are not written as [nope | rope] slices of a fresh tensor", reported=False)
    return nope, rope


def _latent_cache_source(m: dict) -> dict:
    """`kv_b_proj(latent)` split into per-head k_nope and v, and a rope key shared by all heads: the
    attention can read the latent cache directly in absorbed form."""
    q, k, v = m["q"], m["k"], m["v"]
    B, H, S, D = shape(q)
    T = shape(k)[2]
    nope, rope_keys = _key_parts(k, D)
    if m["comb"]["kind"] == "additive":
        raise NoMatch("additive attention mask")
    if m.get("sink") is not None:
        raise NoMatch("a per-head sink (the absorbed op takes none)")
    if m["comb"]["attn_mask"] is not None and not m["causal"] and not same_size(shape(m["comb"]["attn_mask"])[1], 1):
        raise NoMatch("per-head attention mask")
    if not (is_op(nope, operator.getitem) and nope.args[1] == 0 and is_op(v, operator.getitem) and v.args[1] == 1
            and nope.args[0] is v.args[0] and is_op(nope.args[0], aten.split_with_sizes.default)):
        raise NoMatch("k_nope and v are not the two parts of one projection")
    split = nope.args[0]
    nope_dim, v_dim = split.args[1]
    if node_arg(split, 2, "dim", 0) not in (-1, 3) or shape(nope)[-1] != nope_dim:
        raise NoMatch("k_nope and v are not split on the head dim")
    heads = split.args[0]
    if not (is_op(heads, aten.permute.default) and list(heads.args[1]) == [0, 2, 1, 3]):
        raise NoMatch("the projection is not transposed to [B, H, T, nope + v]")
    node = heads.args[0]
    if not same_shape(shape(node), (B, T, H, nope_dim + v_dim)):
        raise NoMatch(f"the projection is not viewed as [B, T, H, nope + v], got {shape(node)}")
    node = strip(node, VIEW_OPS)
    quantized = None
    if is_op(node, torch.ops.dsfuse.fp8_linear.default):
        # A released FP8 checkpoint's kv_b_proj: the op reads its weight dequantised (once while it is unchanged).
        if same_size(T, S):
            raise NoMatch("an FP8 kv_b_proj is absorbed only in steps over a longer cache (the absorbed form leaves "
                          "out W8A8's rounding of the latents; without a cache the masked form does no extra work)")
        flat, *quantized = node.args
        N, C = weight_dims(val(quantized[0]))
        if not same_size(N, H * (nope_dim + v_dim)) or not same_size(C, shape(flat)[-1]):
            raise NoMatch("the per-head keys and values are not one FP8 kv_b_proj(latent) product")
        weight = None
    elif is_op(node, aten.mm.default) and same_shape(shape(node), (B * T, H * (nope_dim + v_dim))):
        flat, weight_t = node.args
        transposed = is_op(weight_t, aten.t.default) or (
            is_op(weight_t, aten.permute.default) and list(weight_t.args[1]) == [1, 0])
        if not transposed:
            raise NoMatch("kv_b_proj's weight is not used transposed")
        weight = weight_t.args[0]
        C = shape(weight)[1]
    else:
        raise NoMatch("the per-head keys and values are not one latent @ kv_b_proj.T product")
    # HF views the latents as [B, 1, T, C]; after the canonicaliser folds that view into the next one, the chain
    # reaches the [B, T, C] latents directly, which the rewrite unsqueezes.
    latent = flat
    while is_op(latent, *VIEW_OPS) and not any(same_shape(shape(latent), want) for want in ((B, 1, T, C), (B, T, C))):
        latent = latent.args[0]
    unsqueeze = same_shape(shape(latent), (B, T, C))
    if not (unsqueeze or same_shape(shape(latent), (B, 1, T, C))):
        raise NoMatch(f"the latents are not viewed as [B, 1, T, C], got {shape(latent)}")
    if not is_op(rope_keys, aten.expand.default):
        raise NoMatch("the rope key is not one tensor expanded over the heads")
    rope = rope_keys.args[0]
    if not same_shape(shape(rope), (B, 1, T, D - nope_dim)):
        raise NoMatch(f"the shared rope key is not [B, 1, T, {D - nope_dim}], got {shape(rope)}")
    if len({dtype(q), dtype(latent), dtype(rope), dtype(node if weight is None else weight)}) != 1:
        raise NoMatch("q, latent cache, rope key and kv_b_proj weight dtypes differ")
    return dict(latent=latent, unsqueeze=unsqueeze, rope=rope, weight=weight, quantized=quantized, nope_dim=nope_dim)


def _selection_in_place(scatter: torch.fx.Node, bias: torch.fx.Node, B, S, T) -> bool:
    """Whether the selection reaches the attention's mask input as `[B, *, S, T]`, position by position.

    The path from the scatter to `bias` is a chain of single users (checked while matching); layout
    ops on it are followed with labelled dims, elementwise ops (the combination, the bias `where`,
    casts, the efficient kernel's end padding) keep positions, so a permuted selection is caught.
    """
    labels, node = leaf_labels(scatter, "bst"), scatter
    while node is not bias and labels is not None:
        node = next(iter(node.users))
        if is_op(node, *LAYOUT_OPS):
            labels = apply_op(labels, node)
        elif len(shape(node)) > len(labels):
            labels = [()] * (len(shape(node)) - len(labels)) + labels
    if labels is None or len(labels) != 4:
        return False
    got, want = names(labels), _expected("bhst", (B, 1, S, T))
    return got[0] == want[0] and got[1] in ((), ("*",)) and got[2:] == want[2:]


def _decomposed_attention(add: torch.fx.Node, bias: torch.fx.Node, comb: dict) -> dict:
    """softmax(scale * q @ k^T + bias) @ v (or the selection `where` on the scores), written with bmm and a
    decomposed softmax."""
    scores = comb.get("scores") or (add.args[2] if is_op(add, *WHERE_OPS) else
                                    add.args[0] if add.args[1] is bias else add.args[1])
    if not isinstance(scores, torch.fx.Node) or len(shape(add)) != 4:
        raise NoMatch("the attention mask is added to something other than [B, H, S, T] scores")
    soft = attention_softmax(add) or _normalised_weights(add)
    # A sink keeps every row's denominator above 0: no NaN to reproduce.
    plain = not soft["safe"] and soft.get("sink") is None
    if comb["kind"] == "bool" and plain and comb.get("bias") != "finite":
        raise NoMatch("plain softmax over a -inf bias gives NaN for fully masked rows; the fused op returns 0")
    if comb.get("hard") and plain:
        raise NoMatch("plain softmax over a -inf selection bias summed with an additive mask gives NaN in a row "
                      "whose picks the mask sets to -inf; the fused op returns 0")
    probs_end, after = _single_user_chain(soft["probs"], LAYOUT_OPS | {CONVERT})
    if after is None:
        raise NoMatch("the attention probabilities are also used elsewhere")
    pv = padded_product(probs_end)  # the bmm, or the product Inductor computes by zero-padding it (pad_mm)
    if pv is None:
        raise NoMatch(f"the attention probabilities pass through {after.target} before P @ V (dropout?)")
    pv_right = canonical_bmm(pv)[1]
    prob_ops = _chain_back(probs_end, narrowing=True)
    if soft["probs"] not in prob_ops:
        raise NoMatch("the attention probabilities are not reshaped straight into P @ V")
    prob_ops = prob_ops[prob_ops.index(soft["probs"]) + 1:]

    score_chain = _chain_back(scores)
    qk = canonical_bmm(score_chain[0])
    if qk is None:
        raise NoMatch("the masked scores are not a q @ k^T product")
    B, H, S, T = shape(add)
    D = shape(qk[0])[-1]
    Dv = shape(pv)[-1]
    q_pick = _pick(_chain_back(qk[0]), (B, H, S, D))
    k_pick = _pick(_chain_back(qk[1]), (B, H, T, D)) or _pick(_chain_back(qk[1]), (B, 1, T, D))
    v_pick = _pick(_chain_back(pv_right), (B, H, T, Dv)) or _pick(_chain_back(pv_right), (B, 1, T, Dv))
    if q_pick is None or k_pick is None or v_pick is None:
        raise NoMatch("q, k or v is not a [B, H, *, D] tensor")
    (q, q_ops), (k, k_ops), (v, v_ops) = q_pick, k_pick, v_pick

    out, out_ops = _viewed_as(pv, (B, H, S, Dv), "B, H, S, Dv")
    cast = only_user(out)
    if is_op(cast, CONVERT) and cast.args[1] == dtype(q):
        out = cast

    q_l = _through(leaf_labels(q, "bhsd"), q_ops)
    k_l = _through(leaf_labels(k, "bhtd"), k_ops)
    qk_l = bmm_labels(q_l, k_l) if q_l and k_l else None
    if qk_l is None or names([contracted(q_l, k_l)]) != _expected("d", (D,)):
        raise NoMatch("the score product is not q[b,h,s,:] . k[b,h,t,:]")
    s_l = _through(qk_l, score_chain[1:])
    if s_l is None or names(s_l) != _expected("bhst", (B, H, S, T)):
        raise NoMatch("the scores are not laid out as [B, H, S, T] where the mask is added")
    p_l = _through(s_l, prob_ops)
    v_l = _through(leaf_labels(v, "bhtv"), v_ops)
    pv_l = bmm_labels(p_l, v_l) if p_l and v_l else None
    if pv_l is None or names([contracted(p_l, v_l)]) != _expected("t", (T,)):
        raise NoMatch("the output product is not P[b,h,s,:] . v[b,h,:,e]")
    o_l = _through(pv_l, out_ops)
    if o_l is None or names(o_l) != _expected("bhsv", (B, H, S, Dv)):
        raise NoMatch("the attention output is not [B, H, S, Dv]")
    scale = _scale_of(q_ops) * _scale_of(k_ops) * _scale_of(score_chain[1:]) * soft.get("scale", 1.0)
    return dict(q=q, k=k, v=v, scale=scale, out=out, sink=soft.get("sink"),
                form="decomposed " + ("SDPA" if soft["safe"] else "softmax"))


def _normalised_weights(scores: torch.fx.Node) -> dict:
    """The softmax over the keys of the masked `scores` in a spelling other than Inductor's decomposition (through a
    logsumexp, say, or with a per-head sink): the one normaliser node whose layout chain reaches a product, bound back
    to `scores` and at most a sink. Which function it is, the verifier proves."""
    region, pending = set(), [scores]
    while pending:
        for user in pending.pop().users:
            if user not in region and is_op(user, *NORMALISER_OPS):
                region.add(user)
                pending.append(user)
        if len(region) > NORMALISER_MAX_NODES:
            break
    ends = [node for node in region if not is_op(node, *LAYOUT_OPS, CONVERT)
            and padded_product(_single_user_chain(node, LAYOUT_OPS | {CONVERT})[0]) is not None]
    if len(ends) != 1:
        raise NoMatch("the masked scores do not feed a softmax over the keys")
    read, sink, factor = _normaliser_inputs(ends[0], lambda node: node is scores)
    if read != [scores]:
        raise NoMatch("the masked scores do not feed a softmax over the keys")
    heads = shape(scores)[1]
    if sink is not None and not same_shape(shape(sink), (heads,)):
        raise NoMatch(f"the weights read {shape(sink)} values beside the scores, not a per-head [H] sink")
    return dict(input=scores, probs=ends[0], safe=False, scale=factor, sink=sink)


def _fused_attention(op: torch.fx.Node, bias: torch.fx.Node) -> dict:
    """A fused SDPA op whose mask argument carries the combined selection."""
    args = _schema_args(op)
    mask_name = FUSED_SDPA[op.target]
    if args.get(mask_name) is not bias:
        raise NoMatch(f"the selection reaches {op.target} through an argument other than {mask_name}")
    if args.get("dropout_p", 0.0) != 0.0:
        raise NoMatch(f"attention dropout p={args['dropout_p']} > 0")
    if args.get("is_causal", False):
        raise NoMatch("is_causal=True together with an explicit mask")
    q, k, v = args["query"], args["key"], args["value"]
    if len(shape(q)) != 4 or len(shape(k)) != 4 or len(shape(v)) != 4:
        raise NoMatch("q, k, v are not 4-d [B, H, S, D]")
    B, H, _, D = shape(q)
    T = shape(k)[2]
    if not same_shape(shape(k), (B, H, T, D)) or not same_shape(shape(v)[:3], (B, H, T)):
        raise NoMatch(f"cannot prove k {shape(k)} and v {shape(v)} share q's batch and heads {shape(q)} and one key "
                      "length (grouped heads, or unrelated dynamic sizes)")
    scale = args.get("scale")
    if scale is None:
        if not isinstance(D, int):
            raise NoMatch("default scale over a symbolic head dim")
        scale = D ** -0.5
    getters = list(op.users)
    outs = [g for g in getters if g.target is operator.getitem and g.args[1] == 0]
    if len(outs) != 1 or any(g.users for g in getters if g not in outs):
        raise NoMatch("the fused attention's auxiliary outputs (log-sum-exp) are used")
    return dict(q=q, k=k, v=v, scale=float(scale), out=outs[0], form=str(op.target).split(".")[-2], fused_sdpa=op)


def _top_k_indices(idx: torch.fx.Node) -> bool:
    """A top-k's indices (`aten.topk`, or the indexer op that replaced one): no row repeats an index, so the
    absorbed op need not search for the repeats HF's scatter would merge."""
    if is_op(idx, operator.getitem) and idx.args[1] == 1 and is_op(idx.args[0], aten.topk.default):
        return True
    return is_op(idx, torch.ops.dsfuse.indexer_topk.default)


def _rank3_leaf(node, B, T) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """The earliest [B, T, *] node on `node`'s chain back, and the ops after it."""
    found = views_along(_chain_back(node), lambda n: len(shape(n)) == 3 and same_shape(shape(n)[:2], (B, T)))
    return found[0] if found else None


def _index_bias_attention(scatter: torch.fx.Node, idx: torch.fx.Node) -> dict:
    """The official V3.2 decode form: `full(-inf, [B, S, T]).scatter(-1, idx, 0)` added (unsqueezed over the heads) to
    absorbed scores against the whole latent and rope caches, an fp32 softmax and P @ latent cache. With top-k picks
    (no repeats, K >= 1 in range) only the picked keys get weight, so this is `sparse_mla_attention` on the caches."""
    bias, add = _single_user_chain(scatter, LAYOUT_OPS)
    if add is None or not is_op(add, aten.add.Tensor):
        raise NoMatch("the -inf index mask (`full(-inf).scatter(-1, idx, 0)`) is not added to the scores")
    refuse_changed_keyword(add, "the -inf index mask added to the scores")
    scores = add.args[0] if add.args[1] is bias else add.args[1]
    soft = attention_softmax(add)
    if soft is None:
        raise NoMatch("the -inf index mask is combined with another mask before the scores (a plain softmax over it "
                      "is NaN in rows without keys, which the fused ops do not reproduce)")
    if len(shape(add)) != 4:
        raise NoMatch("the -inf index mask is added to scores that are not [B, S, H, T]")
    B, S, H, T = shape(add)
    if not same_shape(shape(scatter), (B, S, T)) or not same_shape(shape(idx)[:2], (B, S)):
        raise NoMatch(f"the index mask {shape(scatter)} does not match the scores {shape(add)} as [B, S, H, T]")
    bias_l = names(_through(leaf_labels(scatter, "bst"), _chain_back(bias)[1:]) or [])
    if len(bias_l) != 4 or bias_l[:2] + bias_l[3:] != _expected("bst", (B, S, T)) or bias_l[2] not in ((), ("*",)):
        raise NoMatch("the index mask is not laid out as [B, S, 1, T] over the scores")
    x = only_user(add) if is_op(only_user(add), CONVERT) else add
    if dtype(x) != torch.float32:
        raise NoMatch(f"softmax over {dtype(x)} scores, not fp32")
    probs_end, pv = _single_user_chain(soft["probs"], LAYOUT_OPS | {CONVERT})
    if pv is None or not is_op(pv, aten.bmm.default) or pv.args[0] is not probs_end:
        raise NoMatch("the attention probabilities are not used only by P @ V")
    prob_ops = _chain_back(probs_end, narrowing=True)
    prob_ops = prob_ops[prob_ops.index(soft["probs"]) + 1:] if soft["probs"] in prob_ops else None
    if prob_ops is None:
        raise NoMatch("the attention probabilities are not reshaped straight into P @ V")

    score_chain = _chain_back(scores)
    summed = score_chain[0]
    parts = [_chain_back(a) for a in summed.args] if is_op(summed, aten.add.Tensor) else []
    if len(parts) != 2 or not all(is_op(c[0], aten.bmm.default) for c in parts):
        raise NoMatch("the scores are not the sum of a latent and a rope product")
    found = []
    for chain in parts:
        bmm = chain[0]
        q_pick = _rank3_leaf(bmm.args[1], B, T)
        if q_pick is None:
            raise NoMatch("a score product does not read [B, T, *] cache rows")
        cache, cache_ops = q_pick
        width = shape(cache)[2]
        query = _pick(_chain_back(bmm.args[0]), (B, S, H, width))
        if query is None:
            raise NoMatch("a score product's query is not [B, S, H, D]")
        labels = _product(query[0], "bshc", query[1], leaf_labels(cache, "btc"), cache_ops, "c", width)
        labels = _through(_through(labels, chain[1:]), score_chain[1:])
        if labels is None or names(labels) != _expected("bsht", (B, S, H, T)):
            raise NoMatch("the score products are not q[b,s,h,:] . cache[b,t,:] over [B, S, H, T]")
        found.append(dict(q=query[0], q_ops=query[1], cache=cache, cache_ops=cache_ops, ops=chain[1:]))
    latent = next((f for f in found if f["cache"] in _chain_back(pv.args[1])), None)
    if latent is None:
        raise NoMatch("the values are not the latent cache the scores read")
    rope = found[1 - found.index(latent)]
    v_pick = _rank3_leaf(pv.args[1], B, T)
    p_l = _through(leaf_labels(add, "bsht"), prob_ops)
    v_l = _through(leaf_labels(v_pick[0], "btc"), v_pick[1])
    o_l = bmm_labels(p_l, v_l) if p_l and v_l else None
    if v_pick[0] is not latent["cache"] or o_l is None or names([contracted(p_l, v_l)]) != _expected("t", (T,)):
        raise NoMatch("the output product is not P[b,s,h,:] . cache[b,:,c]")
    C = shape(latent["cache"])[2]
    q_nope, q_pe, kv, pe = latent["q"], rope["q"], latent["cache"], rope["cache"]
    out = _mla_output(pv, o_l, (B, S, H, C), (q_nope, q_pe, kv, pe), prob_ops)
    scales = [_scale_of(f["q_ops"]) * _scale_of(f["cache_ops"]) * _scale_of(f["ops"]) for f in (latent, rope)]
    if not math.isclose(*scales, rel_tol=1e-6):
        raise NoMatch("the latent and rope scores are scaled differently")
    if not _top_k_indices(idx):
        raise NoMatch("the index mask's picks are not a top-k's indices: the scatter merges repeated picks, the "
                      "gather op would count them twice")
    return dict(index_bias=True, q_nope=q_nope, q_pe=q_pe, kv=kv, pe=pe, idx=idx, sink=None,
                scale=scales[0] * _scale_of(score_chain[1:]), out=out)


# ---------------------------------------------------------------------------
# Rewrite: HF form
# ---------------------------------------------------------------------------


def _over_heads(graph: torch.fx.Graph, before: torch.fx.Node, node: torch.fx.Node, q: torch.fx.Node) -> torch.fx.Node:
    """K or V as the op reads them, [B, H, T, *]: a tensor shared by the heads ([B, 1, T, *]) expanded (a view)."""
    heads = shape(q)[1]
    if same_size(shape(node)[1], heads):
        return node
    sizes = [size_arg(graph, before, q, 0), size_arg(graph, before, q, 1)] + [-1, -1]
    return insert_call(graph, before, aten.expand.default, (node, sizes))


def _rewrite_masked(graph: torch.fx.Graph, scatter: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    if m.get("index_bias"):
        _rewrite_mla(graph, scatter, m, ctx, "official -inf index mask over the latent cache, ")
        return
    out, comb = m["out"], m["comb"]
    # A provably plain causal mask is applied in-kernel from positions instead of being read.
    attn_mask = None if m["causal"] else comb["attn_mask"]
    absorbed = m.get("absorbed")
    see_all = m["empty_rows_see_all"]
    if absorbed is not None:
        latent = absorbed["latent"]
        if absorbed["unsqueeze"]:
            latent = insert_call(graph, out, aten.unsqueeze.default, (latent, 1))
        weight, fp8 = absorbed["weight"], ()
        if weight is None:  # the FP8 weight, its scales and blocks: the op dequantises it once while unchanged
            weight, *fp8 = absorbed["quantized"]
        args = (m["q"], latent, absorbed["rope"], weight, m["idx"], attn_mask, m["scale"],
                absorbed["nope_dim"], m["causal"], see_all, _top_k_indices(m["idx"]), *fp8)
        fused = insert_call(graph, out, torch.ops.dsfuse.absorbed_mla_attention.default, args)
    else:
        k, v = (_over_heads(graph, out, m[name], m["q"]) for name in ("k", "v"))
        fused = insert_call(graph, out, torch.ops.dsfuse.sparse_attention_masked.default,
                            (m["q"], k, v, m["idx"], attn_mask, m["scale"], m["causal"], see_all, m.get("sink"),
                             bool(comb.get("hard"))))
    if dtype(out) != dtype(fused):
        fused = insert_call(graph, out, CONVERT, (fused, dtype(out)))
    out.replace_all_uses_with(fused)
    sdpa = m.get("fused_sdpa")
    if sdpa is not None:
        # Random-seeded SDPA ops count as impure, so dead-code elimination would keep them alive.
        for getter in list(sdpa.users):
            graph.erase_node(getter)
        graph.erase_node(sdpa)
    mask_kind = "causal (from positions)" if m["causal"] else "selection only" if comb["kind"] == "none" \
        else "additive mask plus a -inf selection bias" if comb.get("hard") else f"{comb['kind']} mask"
    detail = f"{m['form']}, {mask_kind}, K={shape(m['idx'])[2]}, scale={m['scale']:.6g}"
    if see_all:
        detail += ", rows without keys attend to all keys (finite bias)"
    if m.get("sink") is not None:
        detail += ", sink"
    if absorbed is not None:
        if args[-1]:
            detail += ", top-k indices (no repeats)"
        if absorbed["weight"] is None:
            detail += (", FP8 kv_b_proj dequantised once while unchanged (no activation quantisation of the "
                       "latents)")
        ctx.site(scatter, "dsfuse.absorbed_mla_attention", [m["q"], absorbed["latent"], absorbed["rope"],
                 absorbed["quantized"][0] if absorbed["weight"] is None else absorbed["weight"], m["idx"],
                 attn_mask],
                 detail="absorbed from the latent cache, " + detail)
        return
    if "absorb_refused" in m:
        detail += f"; not absorbed: {m['absorb_refused']}"
    ctx.site(scatter, "dsfuse.sparse_attention_masked", [m["q"], m["k"], m["v"], m["idx"], attn_mask, m.get("sink")],
             detail=detail)


# ---------------------------------------------------------------------------
# Binding: own model, absorbed MLA over gathered latent rows
# ---------------------------------------------------------------------------


def _gather_rows(node: torch.fx.Node) -> tuple | None:
    """(source [B,T,C], idx [B,S,K], the clamp) for `src[arange(B)[:,None,None], idx.clamp(min=0)]`, or the same
    rows read by `gather` / `take_along_dim` or by `index_select` from the flattened source, else None."""
    if is_op(node, aten.gather.default):
        return _gathered_along_keys(node)
    if not is_op(node, aten.index.Tensor):
        return None
    src, indices = node.args[:2]
    if len(indices) == 1 and len(shape(src)) == 2:
        return _flattened_row_gather(node)
    if len(indices) != 2 or any(i is None for i in indices) or len(shape(src)) != 3:
        return None
    batch, safe = indices
    leaf = strip(batch, LAYOUT_OPS)
    if not (is_op(leaf, torch.ops.prims.iota.default) and leaf.kwargs.get("start", 0) == 0
            and leaf.kwargs.get("step", 1) == 1 and same_shape(shape(batch), (shape(src)[0], 1, 1))):
        return None
    if not is_op(safe, aten.clamp_min.default, aten.clamp.default) or safe.args[1] != 0:
        return None
    if len(safe.args) > 2 and safe.args[2] is not None:
        return None
    idx = safe.args[0]
    if len(shape(idx)) != 3 or dtype(idx) not in INDEX_DTYPES:
        return None
    return src, idx, safe


def _gathered_along_keys(node: torch.fx.Node) -> tuple | None:
    """(source [B,T,C], idx [B,S,K], the clamp) for `gather(src[:, None].expand(B,S,T,C), 2,
    idx.clamp(min=0)[..., None].expand(B,S,K,C))`: row `idx[b,s,k]` of `src[b]` at [b,s,k,:], as the batch-index
    gather reads it. `take_along_dim` adds `% T` to the clamped indices, which keeps every index below T."""
    expanded, dim, index = node.args[:3]
    if dim not in (2, -2) or len(shape(node)) != 4 or not is_op(expanded, aten.expand.default):
        return None
    unsqueezed = expanded.args[0]
    if not is_op(unsqueezed, aten.unsqueeze.default) or unsqueezed.args[1] != 1:
        return None
    src = unsqueezed.args[0]
    B, T, C = (shape(src) + (None, None, None))[:3] if len(shape(src)) == 3 else (None, None, None)
    if B is None or not same_shape(shape(expanded), (B, shape(node)[1], T, C)):
        return None
    if is_op(index, aten.remainder.Scalar) and same_size(index.args[1], T):
        index = index.args[0]
    if not (is_op(index, aten.expand.default) and is_op(index.args[0], aten.unsqueeze.default)
            and index.args[0].args[1] in (-1, 3)):
        return None
    safe = index.args[0].args[0]
    if not is_op(safe, aten.clamp_min.default) or safe.args[1] != 0:
        return None
    idx = safe.args[0]
    if dtype(idx) not in INDEX_DTYPES or not same_shape(shape(idx), shape(node)[:3]) \
            or not same_shape(shape(node), (B, shape(idx)[1], shape(idx)[2], C)):
        return None
    return src, idx, safe


def _flattened_row_gather(node: torch.fx.Node) -> tuple | None:
    """(source [B,T,C], idx [B,S,K], the clamp) for `src.reshape(B*T, C).index_select(0, flat)` (post-grad: `[flat]`)
    with `flat` the clamped picks flattened, plus offsets (`b * T` for batch b) or none (B == 1), else None: one row
    per pick in the picks' order, [B*S*K, C]. Which rows the offsets pick is the verifier's to prove on probes; a
    pick that is not clamped reads another batch's row (or none) where the op finds no key, a real difference."""
    flat_src, (flat,) = node.args[:2]
    views = views_along(walk_back(flat_src, lambda n: is_op(n, *LAYOUT_OPS)), lambda n: len(shape(n)) == 3)
    if not views or not is_op(flat, *VIEW_OPS) or len(shape(flat)) != 1:
        return None
    src = views[0][0]
    B, T, C = shape(src)
    picked = flat.args[0]
    if not same_shape(shape(flat_src), (B * T, C)) or len(shape(picked)) != 3 or dtype(picked) not in INDEX_DTYPES:
        return None
    terms = picked.args if is_op(picked, aten.add.Tensor) else (picked,)
    clamps = [t for t in terms if is_op(t, aten.clamp_min.default) and t.args[1] == 0]
    if not clamps:
        raise NoMatch("the picks index the flattened cache without being clamped to 0: a -1 pick reads another "
                      "batch's row (or none), where the op finds no key", reported=False)
    safe = clamps[0]
    idx = safe.args[0]
    if len(shape(idx)) != 3 or not same_shape(shape(idx), shape(picked)):
        return None
    if picked is safe and not same_size(B, 1):
        raise NoMatch(f"the picks index the flattened cache of {B} sequences without a per-batch offset: every "
                      "query reads the first sequence's rows", reported=False)
    return src, idx, safe


def _rows_labels(rows: torch.fx.Node, idx: torch.fx.Node, letters: str) -> Labels | None:
    """Labels of the rows gathered by the picks `idx` [B, S, K]: [B, S, K, W] read per batch, or [B*S*K, W] read from
    a flattened source (one row per pick, in the picks' order)."""
    if len(shape(rows)) == 4:
        return leaf_labels(rows, letters)
    picks = tuple((name, size) for name, size in zip(letters, shape(idx)) if not same_size(size, 1))
    return [picks, ((letters[3], shape(rows)[1]),)]


def _one_sequence_gather(node: torch.fx.Node) -> bool:
    """Whether `node` is `src[idx.clamp(min=0)]` for [T, C] rows and [S, K] integer picks, read by two products
    (keys and values: the latent rows, not the rope rows gathered beside them)."""
    if not is_op(node, aten.index.Tensor):
        return False
    src, indices = node.args[:2]
    if len(indices) != 1 or len(shape(src)) != 2 or not is_op(indices[0], aten.clamp_min.default):
        return False
    idx = indices[0].args[0]
    return indices[0].args[1] == 0 and len(shape(idx)) == 2 and dtype(idx) in INDEX_DTYPES \
        and sum(pos >= 0 for _, pos, _ in _bmms_using(node)) == 2


def _product(a, a_names, a_ops, b_labels: Labels | None, b_ops, over: str, size) -> Labels | None:
    """Labels of `bmm(a', b')` where a' is `a` after its layout ops and b' the operand labelled `b_labels` after
    its, or None unless the product contracts exactly the dim `over`."""
    a_l, b_l = _through(leaf_labels(a, a_names), a_ops), _through(b_labels, b_ops)
    out = bmm_labels(a_l, b_l) if a_l and b_l else None
    if out is None or names([contracted(a_l, b_l)]) != _expected(over, (size,)):
        return None
    return out


def _bmms_using(node: torch.fx.Node) -> list[tuple[torch.fx.Node, int, list[torch.fx.Node]]]:
    """(bmm, operand position, layout ops from `node` to it) for every bmm fed by `node`."""
    found, stack = [], [(node, [])]
    while stack:
        cur, ops = stack.pop()
        for user in cur.users:
            if is_op(user, aten.bmm.default):
                found.append((user, user.args.index(cur), ops))
            elif is_op(user, *LAYOUT_OPS) or _is_float_cast(user):
                stack.append((user, ops + [user]))
            else:
                found.append((user, -1, ops))
    return found


def _match_mla(index: torch.fx.Node) -> dict:
    gather = _gather_rows(index)
    if gather is None:
        if _one_sequence_gather(index):
            raise NoMatch("the picked rows are gathered from one sequence (`kv[idx.clamp(min=0)]`, no batch index); "
                          "the matcher reads per-batch [B, T, C] row gathers")
        raise NoMatch("not a per-batch row gather", reported=False)
    kv, idx, safe = gather
    uses = _bmms_using(index)
    products = [u for u in uses if u[1] >= 0]
    if len(products) == 1 and any(is_op(u, aten.slice.Tensor) and is_last_dim(index, u.args[1]) for u, _, _ in uses):
        raise NoMatch("the values are a slice of the gathered key rows (one [latent | rope] row per key); the matcher "
                      "reads latent and rope rows gathered apart")
    if len(products) != 2 or len(uses) != 2:
        raise NoMatch("gathered rows are not used as both keys and values", reported=False)
    # The same rows serve as keys (score product) and values (output product): an MLA sparse attention.
    by_order = sorted(products, key=lambda u: list(index.graph.nodes).index(u[0]))
    (qk, qk_pos, kv_ops_k), (pv, pv_pos, kv_ops_v) = by_order
    if qk_pos != 1 or pv_pos != 1:
        raise NoMatch("gathered rows are not the right-hand operand of the score and output products")
    B, T, C = shape(kv)
    _, S, K = shape(idx)

    probs_end = _chain_back(pv.args[0], narrowing=True)
    sliced = [probs_end[0]] if is_op(probs_end[0], aten.slice.Tensor) else []
    if sliced:
        probs_end = _chain_back(sliced[0].args[0], narrowing=True) + probs_end
    probs = probs_end[0]
    masked, sink, softmax_scale = _normalised_scores(probs)
    H = shape(masked)[2]
    if sink is not None and not same_shape(shape(sink), (H,)):
        raise NoMatch(f"the weights read {shape(sink)} values beside the scores, not a per-head [H] sink")
    if sliced and (sink is None or sliced[0].args[1] % 4 != 3 or sliced[0].args[2] not in (0, None)
                   or sliced[0].args[3] not in (-1, K)):
        raise NoMatch("the softmax output is sliced other than to drop a trailing sink column")
    cond_chain = _chain_back(masked.args[0])
    cond = cond_chain[0]
    if not (is_op(cond, aten.lt.Scalar) and cond.args[0] is idx and cond.args[1] == 0):
        raise NoMatch("the score mask is not `idx < 0` of the gather's indices")
    cond_l = names(_through(leaf_labels(cond, "bsk"), cond_chain[1:]) or [])
    want_cond = _expected("bsk", (B, S, K))
    if len(cond_l) != 4 or cond_l[:2] + cond_l[3:] != want_cond or cond_l[2] not in ((), ("*",)):
        raise NoMatch("the `idx < 0` mask is not laid out as [B, S, 1, K] over the scores")
    score_chain = _chain_back(masked.args[2])
    summed = score_chain[0]
    if not is_op(summed, aten.add.Tensor) or not all(isinstance(a, torch.fx.Node) for a in summed.args):
        raise NoMatch("the scores are not the sum of a latent and a rope product")
    nope_bmm = pe_bmm = None
    for part in summed.args:
        chain = _chain_back(part)
        if is_op(chain[0], aten.bmm.default):
            if chain[0] is qk:
                nope_bmm = (chain[0], chain[1:])
            else:
                pe_bmm = (chain[0], chain[1:])
    if nope_bmm is None or pe_bmm is None:
        raise NoMatch("the scores are not the sum of a latent and a rope product")
    pe_chain = _chain_back(pe_bmm[0].args[1])
    pe_index = pe_chain[0]
    pe_gather = _gather_rows(pe_index)
    if pe_gather is None or pe_gather[1] is not idx:
        raise NoMatch("the rope product does not read rows gathered with the same indices")
    pe, _, _ = pe_gather
    R = shape(pe)[2]

    q_pick = _pick(_chain_back(qk.args[0]), (B, S, H, C))
    qpe_pick = _pick(_chain_back(pe_bmm[0].args[0]), (B, S, H, R))
    heads_first = q_pick is None or qpe_pick is None
    if heads_first:  # q held as [B, H, S, D] throughout: the op reads the leaf through a permute
        q_pick, qpe_pick = _heads_first_leaf(qk.args[0], (B, H, S, C)), _heads_first_leaf(pe_bmm[0].args[0],
                                                                                          (B, H, S, R))
    if q_pick is None or qpe_pick is None:
        raise NoMatch("q_nope / q_pe are not [B, S, H, D] tensors (nor [B, H, S, D] leaves)")
    (q_nope, q_ops), (q_pe, qpe_ops) = q_pick, qpe_pick

    want = _expected("bshk", (B, S, H, K))
    nope_l = _product(q_nope, "bhsc" if heads_first else "bshc", q_ops, _rows_labels(index, idx, "bskc"), kv_ops_k,
                      "c", C)
    pe_ops = pe_chain[1:]
    pe_l = _product(q_pe, "bhsr" if heads_first else "bshr", qpe_ops, _rows_labels(pe_index, idx, "bskr"), pe_ops,
                    "r", R)
    nope_l = _through(_through(nope_l, nope_bmm[1]), score_chain[1:])
    pe_l = _through(_through(pe_l, pe_bmm[1]), score_chain[1:])
    if nope_l is None or pe_l is None or names(nope_l) != want or names(pe_l) != want:
        raise NoMatch("the score products are not q[b,s,h,:] . rows[b,s,k,:] over [B, S, H, K]")
    p_ops = probs_end[1:]
    p_l = _through([((n, size),) if not same_size(size, 1) else () for n, size in zip("bshk", (B, S, H, K))],
                   [op for op in p_ops if not is_op(op, aten.slice.Tensor)])
    v_l = _through(_rows_labels(index, idx, "bskc"), kv_ops_v)
    o_l = bmm_labels(p_l, v_l) if p_l and v_l else None
    if o_l is None or names([contracted(p_l, v_l)]) != _expected("k", (K,)):
        raise NoMatch("the output product is not P[b,s,h,:] . rows[b,s,:,c]")
    out = _mla_output(pv, o_l, (B, S, H, C), (q_nope, q_pe, kv, pe), p_ops)
    nope_scale = _scale_of(q_ops) * _scale_of(kv_ops_k) * _scale_of(nope_bmm[1])
    pe_scale = _scale_of(qpe_ops) * _scale_of(pe_ops) * _scale_of(pe_bmm[1])
    if not math.isclose(nope_scale, pe_scale, rel_tol=1e-6):
        raise NoMatch("the latent and rope scores are scaled differently")
    scale = nope_scale * _scale_of(score_chain[1:]) * softmax_scale
    return dict(q_nope=q_nope, q_pe=q_pe, kv=kv, pe=pe, idx=idx, sink=sink, scale=scale, out=out,
                heads_first=heads_first)


# What a softmax over the keys is written with in any of its spellings (max-shifted or not, through a logsumexp
# whose max is guarded against -inf, a sink as a column or as a term of the denominator, CUDA's online form): the
# ops between the masked scores and the output product's weights. Which function they compute is not read from
# them: the verifier runs the slice against the op's reference on probes.
NORMALISER_OPS = LAYOUT_OPS | {aten.amax.default, aten.maximum.default, aten.sub.Tensor, aten.add.Tensor,
                               aten.mul.Tensor, aten.div.Tensor, aten.reciprocal.default, aten.exp.default,
                               aten.log.default, aten.logsumexp.default, aten.sum.dim_IntList, aten.abs.default,
                               aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.logical_not.default,
                               aten.any.dims, aten.where.self, aten.cat.default, aten.slice.Tensor, aten.full.default,
                               CONVERT, PREPARE_SOFTMAX_ONLINE, operator.getitem}
NORMALISER_MAX_NODES = 64


def _normaliser_inputs(probs: torch.fx.Node, is_scores) -> tuple[list, torch.fx.Node | None, float]:
    """What the weights `probs` are computed from through normaliser ops alone: (the frontier nodes `is_scores`
    accepts, the per-head sink or None, a scale inside the softmax). The sink is the one other tensor they read
    (seen through layout ops and casts), in fp32. Inductor writes `softmax(x * c)` as `exp((x - max x) * c)`
    (guarded against infinite rows): a single constant every product in the normaliser takes is that c (1 when
    there is none)."""
    region, frontier, pending = set(), [], [probs]
    while pending:
        node = pending.pop()
        if node in region or node in frontier:
            continue
        if is_scores(node) or not is_op(node, *NORMALISER_OPS):
            frontier.append(node)
            continue
        region.add(node)
        if len(region) > NORMALISER_MAX_NODES:
            raise NoMatch("the output product's weights are not a softmax of the masked scores")
        pending.extend(node.all_input_nodes)
    scores = [node for node in frontier if is_scores(node)]
    others = [node for node in frontier if node not in scores]
    if len(others) > 1 or others and dtype(others[0]) != torch.float32:
        raise NoMatch("the output product's weights read more than the masked scores and an fp32 per-head sink")
    # Masking with -inf and upcasting to fp32 commute exactly: a bf16 softmax (upcast inside) over masked bf16
    # scores is the fp32 softmax of the same masked values.
    for node in scores:
        if dtype(node) != torch.float32 and not all(is_upcast(user) for user in node.users if user in region):
            raise NoMatch(f"softmax over {dtype(node)} scores, not fp32")
    factors = {node.args[1] for node in region if is_op(node, aten.mul.Tensor) and isinstance(node.args[1], float)}
    return scores, others[0] if others else None, factors.pop() if len(factors) == 1 else 1.0


def _normalised_scores(probs: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node | None, float]:
    """(the scores masked with -inf, the per-head sink or None, a scale inside the softmax) of the gather forms'
    weights `probs` (`_normaliser_inputs`)."""
    masked, sink, factor = _normaliser_inputs(probs, _masks_with_neg_inf)
    if len(masked) != 1:
        raise NoMatch("the scores are not masked with -inf where the index is -1" if not masked else
                      "the output product's weights read more than one masked score tensor")
    return masked[0], sink, factor


def _masks_with_neg_inf(node) -> bool:
    return is_op(node, aten.where.self) and is_neg_inf(scalar_constant(node.args[1]))


def _heads_first_leaf(node: torch.fx.Node, want: tuple) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the leaf of `node`'s chain, the ops after it) when the leaf is shaped `want` ([B, H, S, D])."""
    chain = _chain_back(node)
    return (chain[0], chain[1:]) if same_shape(shape(chain[0]), want) else None


def _mla_output(pv: torch.fx.Node, o_l: Labels, bshc: tuple, operands: tuple, prob_ops: list) -> torch.fx.Node:
    """The MLA output product `pv` followed through layout ops to its [B, S, H, C] view (labels proven), with
    q / kv / pe in one attention dtype and the probabilities multiplied in it: the output node."""
    out, out_ops = _viewed_as(pv, bshc, "B, S, H, C")
    o_l = _through(o_l, out_ops)
    if o_l is None or names(o_l) != _expected("bshc", bshc):
        raise NoMatch("the attention output is not [B, S, H, C]")
    q_nope, q_pe, kv, pe = operands
    if dtype(q_nope) not in FLOAT_DTYPES or {dtype(q_pe), dtype(kv), dtype(pe)} != {dtype(q_nope)}:
        raise NoMatch(f"q/kv/pe dtypes {dtype(q_nope)}/{dtype(q_pe)}/{dtype(kv)}/{dtype(pe)} not supported")
    prob_cast = [op for op in prob_ops if is_op(op, CONVERT)]
    if dtype(pv) != dtype(q_nope) or (prob_cast and prob_cast[-1].args[1] != dtype(q_nope)):
        raise NoMatch(f"probabilities are multiplied with the values in {dtype(pv)}, not {dtype(q_nope)}")
    return out


# ---------------------------------------------------------------------------
# Rewrite: own model
# ---------------------------------------------------------------------------


def _rewrite_mla(graph: torch.fx.Graph, index: torch.fx.Node, m: dict, ctx: PassContext, form: str = "") -> None:
    out = m["out"]
    q_nope, q_pe = m["q_nope"], m["q_pe"]
    if m.get("heads_first"):
        q_nope, q_pe = (insert_call(graph, out, aten.permute.default, (q, [0, 2, 1, 3])) for q in (q_nope, q_pe))
        form += "q heads-first, "
    fused = insert_call(graph, out, torch.ops.dsfuse.sparse_mla_attention.default,
                        (q_nope, q_pe, m["kv"], m["pe"], m["idx"], m["scale"], m["sink"]))
    out.replace_all_uses_with(fused)
    ctx.site(index, "dsfuse.sparse_mla_attention", [m["q_nope"], m["q_pe"], m["kv"], m["pe"], m["idx"], m["sink"]],
             detail=f"{form}K={shape(m['idx'])[2]}, scale={m['scale']:.6g}{', sink' if m['sink'] is not None else ''}")


# ---------------------------------------------------------------------------
# Verification: the bound slice against the op's reference, on probes
# ---------------------------------------------------------------------------

# (rtol, atol) of the attention output per dtype: the probes' q / k values lie on a 1/4 grid, so every score is
# exact and the slice and the reference differ only in the exponentials, the summation order and, in 16 bits,
# where the probabilities are rounded.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def _verify(m: dict) -> Verdict:
    """Run the matched slice on probes against `sparse_mla_attention`'s reference (the gather and index-bias
    forms) or `sparse_attention_masked`'s (the scatter-mask forms), with the roles the walk bound."""
    if "q_nope" in m:
        roles = {name: m[name] for name in ("q_nope", "q_pe", "kv", "pe", "idx", "sink") if m[name] is not None}
        distinct = bool(m.get("index_bias"))  # top-k picks: in range, no repeats (proved structurally)
        order = (0, 2, 1, 3) if m.get("heads_first") else (0, 1, 2, 3)
        family = Family(probes=lambda shapes, dtypes: _mla_probes(shapes, dtypes, distinct),
                        reference=lambda probe: sparse_mla_attention_math(
                            probe["q_nope"].permute(order), probe["q_pe"].permute(order), probe["kv"], probe["pe"],
                            probe["idx"], m["scale"], probe.get("sink")),
                        compare=_close)
        extra = ("mla", m["scale"], distinct, order)
    else:
        comb = m["comb"]
        roles = {name: m[name] for name in ("q", "k", "v", "idx")}
        if comb["attn_mask"] is not None:
            roles["attn_mask"] = comb["attn_mask"]
        if m.get("sink") is not None:
            roles["sink"] = m["sink"]
        kind, see_all, hard = comb["kind"], m["empty_rows_see_all"], bool(comb.get("hard"))
        family = Family(probes=lambda shapes, dtypes: _masked_probes(shapes, dtypes, kind),
                        reference=lambda probe: sparse_attention_masked_math(
                            probe["q"], *(probe[name].expand(*probe["q"].shape[:2], -1, -1) for name in "kv"),
                            probe["idx"], probe.get("attn_mask"), m["scale"], empty_rows_see_all=see_all,
                            sink=probe.get("sink"), hard_selection=hard),
                        compare=lambda got, want, probe: _close(got, want, probe, _rows_without_keys(probe)
                                                                if see_all else None))
        extra = ("masked", kind, m["scale"], see_all, hard)
    count = shape(m["idx"])[-1]
    return verify([m["out"]], roles, family, extra, above=count if isinstance(count, int) else 0)


def _grid(dims: tuple, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values on a 1/4 grid, most within +-1: exact in every float dtype, and so are their products and short sums;
    scores stay small, so a source that rounds them to 16 bits before the softmax stays within the tolerance."""
    return (torch.randn(dims, generator=gen) * 2).round().clamp(-15, 15).div(4).to(dtype)


def _tied(x: torch.Tensor) -> torch.Tensor:
    """Every key row (dim -2) a copy of the first: all scores of a query tie."""
    return x[..., :1, :].expand(x.shape).clone()


def _masked_probes(shapes: dict, dtypes: dict, kind: str) -> list:
    """Random picks (repeats happen), picks repeated on purpose, tied keys, and, with an attention mask, the first
    query row fully masked; an additive mask holds HF's finfo.min, then -inf; a sink, when the softmax reads one, on
    the grid too. Picks are in range: the scatter spelling raises on any other, as the op's reference does."""
    gen = torch.Generator().manual_seed(0)
    base = {name: _grid(shapes[name], dtypes[name], gen) for name in ("q", "k", "v")}
    if "sink" in shapes:
        base["sink"] = _grid(shapes["sink"], dtypes["sink"], gen)
    B, S, K = shapes["idx"]
    T = shapes["k"][-2]
    base["idx"] = torch.randint(0, T, (B, S, K), generator=gen).to(dtypes["idx"])
    probes = []
    if "attn_mask" in shapes:
        keep = torch.rand(shapes["attn_mask"], generator=gen) < 0.7
        if keep.dim() >= 2:
            keep[..., 0, :] = False
        if kind == "bool":
            base["attn_mask"] = keep
        else:
            fill = torch.finfo(dtypes["attn_mask"]).min
            base["attn_mask"] = torch.zeros(keep.shape, dtype=dtypes["attn_mask"]).masked_fill(~keep, fill)
            probes.append(("-inf mask", dict(base, attn_mask=base["attn_mask"].masked_fill(~keep, float("-inf")))))
    repeated = base["idx"].clone()
    repeated[:, ::2, 1:] = repeated[:, ::2, :1]
    return [("random", base), ("repeated picks", dict(base, idx=repeated)),
            ("tied keys", dict(base, k=_tied(base["k"])))] + probes


def _mla_probes(shapes: dict, dtypes: dict, distinct: bool) -> list:
    """Random picks with -1 (no key) among them and repeats, a query with no key at all, indices below -1 (no key
    for the op), tied keys; top-k picks (`distinct`): in range and distinct in every row."""
    gen = torch.Generator().manual_seed(0)
    base = {name: _grid(shapes[name], dtypes[name], gen) for name in ("q_nope", "q_pe", "kv", "pe")}
    if "sink" in shapes:
        base["sink"] = _grid(shapes["sink"], dtypes["sink"], gen)
    B, S, K = shapes["idx"]
    T = shapes["kv"][-2]
    if distinct:
        picks = torch.stack([torch.randperm(T, generator=gen)[:K] for _ in range(B * S)]).view(B, S, K)
        base["idx"] = picks.to(dtypes["idx"])
        return [("random", base), ("tied keys", dict(base, kv=_tied(base["kv"]), pe=_tied(base["pe"])))]
    idx = torch.randint(0, T, (B, S, K), generator=gen)
    base["idx"] = idx.masked_fill(torch.rand(idx.shape, generator=gen) < 0.25, -1).to(dtypes["idx"])
    empty = base["idx"].clone()
    empty[:, 0] = -1
    below = base["idx"].masked_fill(base["idx"] < 0, -2)
    return [("random", base), ("a query without keys", dict(base, idx=empty)),
            ("indices below -1", dict(base, idx=below)),
            ("tied keys", dict(base, kv=_tied(base["kv"]), pe=_tied(base["pe"])))]


def _rows_without_keys(probe: dict) -> torch.Tensor:
    """[B, 1 or H, S, 1]: the query rows of a masked-form probe where no selected key is allowed."""
    q, idx, mask = probe["q"], probe["idx"].long(), probe.get("attn_mask")
    B, S, T = q.shape[0], q.shape[2], probe["k"].shape[2]
    selected = torch.zeros(B, 1, S, T, dtype=torch.bool).scatter(-1, idx.unsqueeze(1), True)
    if mask is not None:
        selected = selected & (mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min)
    return ~selected.any(dim=-1, keepdim=True)


def _close(got: list, want: torch.Tensor, probe: dict, finite_bias_rows: torch.Tensor | None = None) -> str | None:
    """The slice's output against the reference's, within the output dtype's tolerance, NaN where it is NaN. In the
    `finite_bias_rows` (a row without keys under a finite bias, which then attends to every key) the bias rounds
    each score to half its own ulp (2^-8 for cuDNN's -65536 in fp32): there the outputs may differ by 2^-6 max|v|."""
    out = got[0]
    if tuple(out.shape) != tuple(want.shape):
        return f"output of shape {list(out.shape)}, the reference's {list(want.shape)}"
    rtol, atol = TOLERANCE.get(out.dtype, TOLERANCE[torch.float32])
    ok = torch.isclose(out.float(), want.float(), rtol=rtol, atol=atol, equal_nan=True)
    if finite_bias_rows is not None:
        loose = 2.0**-6 * probe["v"].float().abs().max()
        ok |= finite_bias_rows & ((out.float() - want.float()).abs() <= loose)
    if ok.all():
        return None
    worst = (out.float() - want.float()).abs().nan_to_num(float("inf")).max()
    return f"{int((~ok).sum())} of {ok.numel()} outputs differ beyond rtol=atol={rtol:g} (largest {float(worst):.3g})"
