"""`norm_rope_quant`: RMSNorm of one part of a projection output and RoPE of the other part, both from
the same `split`, rewritten into one `dsfuse::rmsnorm_rope` call.

The anchor is `split_with_sizes(proj, [C_norm, C_rope], -1)` (HF `DeepseekV32Attention.forward`:
`kv_pass, k_rot = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])`). Its first part must
be an RMSNorm in one of two roundings:

    HF:        weight * (xf * rsqrt(mean(xf^2, -1) + eps)).to(dtype)        (product in x's dtype)
    official:  ((xf * rsqrt(mean(xf^2, -1) + eps)) * weight.float()).to(dtype)

each also written `xf / sqrt(mean(xf^2, -1) + eps)`, which rounds otherwise (the call's `div_sqrt`; so do
`rope_cat`'s RMSNorms below, `rms_div_sqrt`). A sqrt that does not divide `xf` itself is reported.

and its second part (through views) a RoPE in one of two forms, each matched on its own structure:

    interleaved (`apply_rotary_pos_emb_interleave`):
        cat([even*c - odd*s, odd*c + even*s], -1),  even/odd = r[..., 0::2] / r[..., 1::2],
        c/s = unsqueeze(cos/sin[..., :C_rope/2])
    half-split (`apply_rotary_pos_emb`):
        r*cos + cat([-r[..., h:], r[..., :h]], -1)*sin

The split may be written as two slices (`proj[..., :C_norm]`, `proj[..., C_norm:]`): the same views, the
same call. A split whose first part is an RMSNorm but whose other part is no RoPE this pass knows is reported
with the reason. Two more site kinds, each into one launch:

- `dsfuse::rope_cat`: a two-way last-dim split whose one part goes through a RoPE (either form, same
  structural matchers) and is `cat`'ed back with the other part in the split's order: HF's main query
  (`cat((q_pass, rope(q_rot)))`, interleaved, on `q_b_proj`'s output viewed per head and transposed)
  and the indexer's query and key (`cat([rope(rot), pass])`, half-split). Other splits are skipped
  silently. When the split input is (a view of) a LayerNorm over the last dim, written as torch decomposes
  `layer_norm` (HF's indexer key: `k_norm(wk(x))`, an `nn.LayerNorm` with weight and bias), the LayerNorm
  joins the same call (`rope_cat`'s `ln_weight`, `ln_bias`, `ln_eps`):

      xf = x.float();  var, mean = var_mean(xf, -1, correction=0, keepdim=True)
      out = (((xf - mean) * rsqrt(var + eps)) * weight + bias).to(x.dtype)      (eps a constant)
- `dsfuse::rope_quant_fp8`: dsfuse's own model's indexer (models/official.py): a split part through the official
  complex-multiply RoPE (`view_as_complex(part.float().view(..)) * freqs`, interleaved or half-split, each
  recognised by its own structure), `cat` back, then `quantize_fp8_blockwise` (per-block amax, 1e-4 floor,
  /448, optional ue8m0, clamp, e4m3); the key's LayerNorm joins as for `rope_cat`. Both the fp8 values and
  the scales are replaced. The same complex RoPE beside an RMSNorm (the own kv side) is `rmsnorm_rope` with
  `freqs`; a complex RoPE'd split part not concatenated back (the own main query's q_pe), or concatenated back
  (a split's part or a row's trailing slice) with no fp8 quantisation after it (the official indexer's Hadamard
  `rotate_activation` sits between), is `dsfuse::complex_rope`: the RoPE in one launch, the cat left to Inductor.
- `dsfuse::rope_cat` for DeepSeek V4 (HF `deepseek_v4.apply_rotary_pos_emb`): the anchor is the `cat` of a
  row's leading slice and the RoPE of its trailing slice (`cat([x[..., :-R], rope(x[..., -R:])], -1)`), the RoPE
  in fp32 on pairs in place, its tables repeated per pair (`cos.repeat_interleave(2, -1)`):

      (r.float() * cos2 + rotate_half(r).float() * sin2).to(dtype),  rotate_half = stack((-r[1::2], r[0::2])).flatten

  When the row is (a view of: the K=V head's view + transpose, the compressors' unsqueeze) an RMSNorm's output,
  the norm joins the call (`rope_cat`'s `rms_norm`): `q_b_norm` (unweighted, `x * rsqrt(..).to(dtype)`),
  `kv_norm` and the compressors' `kv_norm` (fp32 weight). Without a norm: the indexer's query. The two parts may
  be a `split`'s; HF's RoPE forms (in the input dtype) on a trailing slice are `rope_cat` as on a split's part,
  and any other product of the trailing part with other tensors, `cat` back, is reported.
- `dsfuse::rmsnorm_rope` without RoPE: an RMSNorm whose input is (a view of) a projection output (`mm`,
  `addmm`, `bmm`, or `dsfuse::fp8_linear` in a quantised checkpoint): HF `q_a_layernorm(q_a_proj(x))`. Norms of the residual stream are not matched;
  an RMSNorm of a projection output that the call cannot take (`x * rsqrt(..).to(dtype)`) is reported. Without a
  weight (`(x * r).to(dtype)`, here or on the kv side) the call reads a weight of fp32 ones: the same bits.
- `dsfuse::fp8_linears`: in a quantised checkpoint, the `dsfuse::fp8_linear` projections that read one tensor (or
  order-keeping views of it) with e4m3 weights of one block size and one scale kind (V3.2 / GLM: q_a, kv_a and the
  indexer's wk; q_b and the indexer's wq_b; an MLP's gate and up; V4: wq_a and wkv, wq_b and the indexer's wq_b,
  the shared experts' w1 and w3), one call that quantises the activations once for all their GEMMs
  (norm_rope_quant_shared.py). Two FP8 projections of one input whose activation blocks (`block_k`) or scale kinds
  differ are reported: the input is quantised once for each.

Every norm and quantisation the walk matched is then run on probes (`verify.py`) before it is rewritten, against
the reference of the call that replaces it: the walk reads their ops but not what a reduction's `dtype` argument does
(a mean of fp32 squares taken in bf16, squares summed in fp16). An RMSNorm's slice runs from its input and weight to
its output against `rmsnorm_rope_reference` (kv side, projection norms) or `rms_norm_reference` (V4's rows) in the
rounding, eps and division the walk read; a LayerNorm's from its input, weight and bias against
`layer_norm_reference`; the fp8 quantisation's from the `cat` to the fp8 values and the scales against
`quantize_activations` (the quantisation of `rope_quant_fp8_reference`). Probes: rows of every sign about offsets,
a zero row (the eps floor), rows at 1e4 (squares that overflow fp16) and at sqrt(eps), weights and biases of every
sign; for the quantisation random blocks, zero blocks (the 1e-4 amax floor), blocks under it, blocks at +-448 with a
power-of-two scale and a little above one (ue8m0 rounds up). Budget: 16 ulps of fp32, 2 of bf16 / fp16 at a row's
largest magnitude for the norms; fp8 bytes and scales bit for bit. A disagreement is a near-miss naming the probe:
the site's, except where the norm is left out of a call that still takes the RoPE (V4's rows, a LayerNorm before
`rope_cat` / `rope_quant_fp8`). Unprobed, the structural match standing: a slice over `verify.MAX_ELEMENTS` values at
static sizes (a real-dimension prefill; its decode steps and graphs of a symbolic length are probed).

Then the FP8 projections of one input are grouped (`dsfuse::fp8_linears`, after the projection norms, which read
`fp8_linear` outputs). Last, the calls of one layer that do not depend on each other are merged into one
`dsfuse::norm_rope_group` call, one kernel launch (norm_rope_quant_groups.py): two launches per HF V3.2 or V4 layer.

Stages: anchors `SPLIT_ANCHORS`, `SLICED_KV_ANCHORS`, `TRAILING_ROPE_ANCHORS` and `PROJECTION_NORM_ANCHORS`, then
the FP8 projections' `norm_rope_quant_shared.ANCHORS` (`dsfuse::fp8_linear`: its own binder, verifier against
`fp8_linears_reference` and rewrite);
binders `_match_split` (which tells a split's site kind), `_match_sliced`, `_match_trailing_rope` and
`_match_projection_norm`, a pair RoPE in another spelling proven on probes by `_pair_rope_by_probes`; verifiers
`_verify_rms_norm`, `_verified_layer_norm` and `_verify_fp8_quant`, against `rmsnorm_rope_reference`,
`rms_norm_reference` and `layer_norm_reference` (kernels/norm_rope_quant.py) and `quantize_activations`
(kernels/quant_formats.py); rewrites `_rewrite_split` (to the kind's `_rewrite*`), `_rewrite_trailing_rope` and
`_rewrite_projection_norm`; then `norm_rope_quant_shared.run`; last `group_launches`.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.pattern_matcher import stable_topological_sort

import dsfuse.kernels.fp8_linear  # noqa: F401  (registers torch.ops.dsfuse.fp8_linear, a projection)
from dsfuse.kernels.norm_rope_quant import (  # (also registers torch.ops.dsfuse.rmsnorm_rope and friends)
    RMS_NORMS, layer_norm_reference, rms_norm_reference, rmsnorm_rope_reference)
from dsfuse.kernels.quant_formats import quantize_activations

from .canonicalize import MEAN, canonical_bmm, canonical_mm, row_mean
from .context import NoMatch, PassContext, rewrite_anchored
from .graph_utils import (
    CONVERT,
    END,
    FLOAT_DTYPES,
    SPLIT_OPS,
    UNSPECIALISED_FLOAT,
    VIEW_OPS,
    KeywordMiss,
    aten,
    broadcasts_to,
    dtype,
    in_graph_order,
    insert_call,
    is_last_dim,
    is_last_dim_cat,
    is_op,
    is_upcast,
    node_arg,
    normalised_by,
    only_user,
    other_operand,
    refuse_changed_keyword,
    same_shape,
    same_size,
    scalar_arg,
    shape,
    size_arg,
    size_args,
    slice_args,
    unspecialised_float,
    users_of,
    val,
    walk_back,
    walk_forward,
)
from . import norm_rope_quant_shared
from .norm_rope_quant_groups import group_launches
from .verify import Family, Verdict, latest_independent, rope_table_probes, ulps_beyond, verify

NAME = "norm_rope_quant"
# On since the kernels are compiled without FP contraction (the 1-ulp RoPE differences measured on the
# H200 on 2026-11-29 were `fma.rn.bf16` contractions; see kernels/norm_rope_quant.py).
IMPLEMENTED = True

# a projection's output: a matmul, or a quantised checkpoint's FP8 / FP4 linear (transformers' FP8Linear)
PROJECTIONS = (aten.mm.default, aten.addmm.default, aten.bmm.default, torch.ops.dsfuse.fp8_linear.default)


# --- Anchors, one site kind each ------------------------------------------------------------------------------------
# A two-way last-dim split (the kv side, RoPE + cat, the official indexer), the kv side's split written as two slices,
# V4's `cat` of a row's leading slice and its RoPE'd trailing slice, and the square in an RMSNorm of a projection.
SPLIT_ANCHORS = (aten.split_with_sizes.default,)
SLICED_KV_ANCHORS = (aten.slice.Tensor,)
TRAILING_ROPE_ANCHORS = (aten.cat.default,)
PROJECTION_NORM_ANCHORS = (aten.pow.Tensor_Scalar,)


def run(graph: torch.fx.Graph, ctx: PassContext) -> None:
    # splits first (kv: norm + rope; q and indexer: rope + cat), then norms left on a projection output (q_a)
    rewrite_anchored(graph, ctx, SPLIT_ANCHORS, _match_split, _rewrite_split)
    rewrite_anchored(graph, ctx, SLICED_KV_ANCHORS, _match_sliced, _rewrite_split)
    # V4: RoPE on the trailing slice of (a norm of) a row, `cat` back (q, the K=V head, the compressors' entries)
    rewrite_anchored(graph, ctx, TRAILING_ROPE_ANCHORS, _match_trailing_rope, _rewrite_trailing_rope)
    rewrite_anchored(graph, ctx, PROJECTION_NORM_ANCHORS, _match_projection_norm, _rewrite_projection_norm)
    # FP8 projections of one input (quantised checkpoints): one activation quantisation for them all
    norm_rope_quant_shared.run(graph, ctx)
    group_launches(graph, ctx)  # then the independent calls of a layer into one launch each


# --- Binding and rewrite: a split's parts; the kv side, an RMSNorm beside a RoPE (`rmsnorm_rope`) -------------------
def _match_split(split: torch.fx.Node) -> dict:
    """Part 0 an RMSNorm: the kv side (`rmsnorm_rope`). A part through the official complex-multiply RoPE,
    concatenated back and fp8-quantised: the official indexer (`rope_quant_fp8`); not concatenated back, or not
    quantised after: the RoPE alone (`complex_rope`). Otherwise one part RoPE'd and concatenated back with the other
    in the split's order: the main query or the indexer (`rope_cat`)."""
    parts = _getitems(split)
    if 0 in parts and _starts_rmsnorm(parts[0]):
        return {"kind": "norm_rope", **_match(split)}
    if any(_complex_rope_entry(part) is not None for part in parts.values()):
        return _match_rope_quant(split)
    return {"kind": "rope_cat", **_match_rope_cat(split)}


def _rewrite_split(graph: torch.fx.Graph, split: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    rewrite = {"norm_rope": _rewrite, "rope_cat": _rewrite_rope_cat, "rope_quant": _rewrite_rope_quant,
               "complex_rope": _rewrite_complex_rope}[m["kind"]]
    rewrite(graph, split, m, ctx)


def _starts_rmsnorm(part: torch.fx.Node) -> bool:
    """Whether `part` is upcast (or fp32) and squared: the head of an RMSNorm (the rest is then checked)."""
    heads = [part] + [u for u in users_of(part, CONVERT) if u.args[1] == torch.float32]
    return any(u.args[1] == 2 for h in heads for u in users_of(h, aten.pow.Tensor_Scalar))

def _getitems(split: torch.fx.Node) -> dict[int, torch.fx.Node]:
    return {u.args[1]: u for u in split.users if u.target is operator.getitem}


def _match(split: torch.fx.Node) -> dict:
    proj, sizes = split.args[0], split.args[1]
    dim = node_arg(split, 2, "dim", 0)
    if len(sizes) != 2 or not is_last_dim(proj, dim) or dtype(proj) not in FLOAT_DTYPES:
        raise NoMatch("not a two-way split of the last dim", reported=False)
    parts = _getitems(split)
    if 0 not in parts or 1 not in parts:
        raise NoMatch("split part unused", reported=False)
    return _match_parts(proj, sizes, parts)


def _match_sliced(first: torch.fx.Node) -> dict:
    """The kv side with the split written as two slices, `proj[..., :C_norm]` (an RMSNorm's input) and
    `proj[..., C_norm:]`: the same views as `split`'s parts, so the same call."""
    proj = first.args[0] if is_op(first, aten.slice.Tensor) else None
    width = shape(proj)[-1] if proj is not None and shape(proj) else None
    kept = _last_dim_slice(first, width) if isinstance(width, int) else None
    if kept is None or kept[1] != 0 or not 0 < kept[2] < width or dtype(proj) not in FLOAT_DTYPES:
        raise NoMatch("not a leading slice of a row", reported=False)
    rest = next((u for u in proj.users if u is not first and _last_dim_slice(u, width) == (proj, kept[2], width)),
                None)
    if rest is None or not _starts_rmsnorm(first):
        raise NoMatch("not an RMSNorm'd leading slice beside the trailing one", reported=False)
    return {"kind": "norm_rope", **_match_parts(proj, [kept[2], width - kept[2]], {0: first, 1: rest})}


def _match_parts(proj: torch.fx.Node, sizes: list, parts: dict[int, torch.fx.Node]) -> dict:
    """Part 0 of `proj` through an RMSNorm, part 1 through a RoPE (HF's forms and the complex product by their
    structure, the pair forms written in place by what they compute)."""
    norm = _match_weighted_or_unit_norm(parts[0], dtype(proj))
    try:
        rope = _match_rope(parts[1], dtype(proj))
    except NoMatch:
        rope = _pair_rope_by_probes(_view_chain(parts[1])[-1], dtype(proj))
        if rope is None:
            raise
    _check_rms_norm(parts[0], norm, "rmsnorm_rope")
    return {"proj": proj, "c_norm": sizes[0], "c_rope": sizes[1], **norm, **rope}


def _match_rmsnorm(part: torch.fx.Node, x_dtype: torch.dtype, unweighted: bool = False) -> dict:
    """The RMSNorm of `part`: its final node, weight, eps and rounding (`weight_in_fp32`; `rounding`, a name of
    `RMS_NORMS`; `div_sqrt`, written `x / sqrt(mean + eps)` instead of `x * rsqrt(mean + eps)`, each rounding
    other than the other). With `unweighted`, a norm without weight too (weight None): `(x * r).to(dtype)` or V4's
    `x * r.to(dtype)`."""
    xf = part
    if x_dtype != torch.float32:
        casts = [u for u in users_of(part, CONVERT) if u.args[1] == torch.float32]
        if len(casts) != 1:
            raise NoMatch("no fp32 upcast", reported=False)
        xf = casts[0]
    squares = [u for u in users_of(xf, aten.pow.Tensor_Scalar) if u.args[1] == 2]
    if len(squares) != 1:
        raise NoMatch("no square", reported=False)
    mean = row_mean(squares[0])
    if mean is None:
        raise NoMatch("no mean over the last dim", reported=False)
    add = only_user(mean, aten.add.Tensor)
    root = only_user(add, aten.rsqrt.default, aten.sqrt.default) if add is not None else None
    if root is None:
        raise NoMatch("no rsqrt(mean + eps) or sqrt(mean + eps)", reported=False)
    eps = scalar_arg(add.args[1])
    if eps is None:
        raise NoMatch(f"RMSNorm: eps {UNSPECIALISED_FLOAT}" if unspecialised_float(add.args[1])
                      else f"RMSNorm: eps {add.args[1]} is a graph input, not a constant")
    div_sqrt = is_op(root, aten.sqrt.default)
    scaling = {"eps": eps, "div_sqrt": div_sqrt}
    if unweighted and x_dtype != torch.float32:  # V4's `x * rsqrt(...).to(x.dtype)` (or `x / sqrt(...).to(x.dtype)`)
        scale = only_user(root, CONVERT)
        applied = normalised_by(scale, part, div_sqrt) if scale is not None and scale.args[1] == x_dtype else None
        if applied is not None:
            return {"norm_out": applied, "weight": None, **scaling, "rounding": "unweighted_scale_cast"}
    h = normalised_by(root, xf, div_sqrt)
    if h is None:
        raise NoMatch("RMSNorm: sqrt(mean + eps) does not divide x itself (another rounding than any kernel's)"
                      if div_sqrt else "RMSNorm: x * rsqrt(...) not found")
    c_norm = shape(part)[-1]
    if x_dtype == torch.float32:
        if unweighted and not users_of(h, aten.mul.Tensor):
            return {"norm_out": h, "weight": None, **scaling, "rounding": "unweighted"}
        out, weight = _weight_mul(h, c_norm, torch.float32)
        return {"norm_out": out, "weight": weight, **scaling, "weight_in_fp32": True, "rounding": "weight_fp32"}
    narrowed = [u for u in users_of(h, CONVERT) if u.args[1] == x_dtype]
    if len(narrowed) == 1 and len(h.users) == 1:
        if unweighted and not users_of(narrowed[0], aten.mul.Tensor):
            return {"norm_out": narrowed[0], "weight": None, **scaling, "rounding": "unweighted"}
        out, weight = _weight_mul(narrowed[0], c_norm, x_dtype)
        return {"norm_out": out, "weight": weight, **scaling, "weight_in_fp32": False,
                "rounding": "weight_after_cast"}
    out32, weight = _weight_mul(h, c_norm, torch.float32)
    final = only_user(out32, CONVERT)
    if final is None or final.args[1] != x_dtype:
        raise NoMatch("RMSNorm: the fp32 weight product is not cast back to the input dtype")
    if is_upcast(weight):
        weight = weight.args[0]
    return {"norm_out": final, "weight": weight, **scaling, "weight_in_fp32": True, "rounding": "weight_fp32"}


def _match_weighted_or_unit_norm(part: torch.fx.Node, x_dtype: torch.dtype) -> dict:
    """An RMSNorm `rmsnorm_rope` computes: weighted in either rounding, or without a weight, `(x * r).to(dtype)`,
    which is the fp32-weight rounding with a weight of ones (a product by 1.0 is exact; `weight` None)."""
    norm = _match_rmsnorm(part, x_dtype, unweighted=True)
    if norm["rounding"] == "unweighted_scale_cast":
        written = ("x / sqrt(...).to(dtype) rounds the divisor before the quotient" if norm["div_sqrt"]
                   else "x * rsqrt(...).to(dtype) rounds the scale before the product")
        raise NoMatch(f"RMSNorm: {written}, which rmsnorm_rope does not")
    if norm["weight"] is None:
        norm["weight_in_fp32"] = True
    return norm


def _unit_weight_if_none(graph: torch.fx.Graph, before: torch.fx.Node, m: dict, x: torch.fx.Node, width):
    """The norm's weight, or fp32 ones for an unweighted norm."""
    if m["weight"] is not None:
        return m["weight"]
    return insert_call(graph, before, aten.full.default, ([width], 1.0),
                       {"dtype": torch.float32, "device": val(x).device})


def _weight_mul(h: torch.fx.Node, c_norm, weight_dtype: torch.dtype) -> tuple[torch.fx.Node, torch.fx.Node]:
    muls = users_of(h, aten.mul.Tensor)
    if len(muls) != 1 or len(h.users) != 1:
        raise NoMatch("RMSNorm: normalised value is not multiplied by a weight (or has other users)")
    weight = other_operand(muls[0], h)
    if not isinstance(weight, torch.fx.Node) or len(shape(weight)) != 1 or not same_size(shape(weight)[0], c_norm):
        raise NoMatch(f"RMSNorm: weight {weight} is not a 1-D [{c_norm}] tensor")
    if dtype(weight) != weight_dtype and not (weight_dtype == torch.float32 and dtype(weight) in FLOAT_DTYPES):
        # an fp32 product may read a narrower weight (`F.rms_norm`): its upcast is exact
        raise NoMatch(f"RMSNorm: weight dtype {dtype(weight)} differs from the product's {weight_dtype}")
    return muls[0], weight


def _view_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and the single-user views / unsqueezes below it, in order (HF views k_rot as [B, 1, S, C_rope])."""
    return walk_forward(node, lambda user: is_op(user, *VIEW_OPS, aten.unsqueeze.default))


def _slice(node: torch.fx.Node, src: torch.fx.Node, start, end, step=1) -> bool:
    if not is_op(node, aten.slice.Tensor) or node.args[0] is not src or not is_last_dim(src, node.args[1]):
        return False
    _, got_start, got_end, got_step = slice_args(node)
    full = shape(src)[-1]
    return (same_size(got_start, start) and got_step == step
            and (got_end == end or same_size(got_end, end) or (end == END and same_size(got_end, full))))


def _match_rope(part: torch.fx.Node, x_dtype: torch.dtype) -> dict:
    rot = _view_chain(part)[-1]
    width = shape(rot)[-1]
    if not same_size(width % 2, 0):
        raise NoMatch(f"RoPE width {width} is not provably even")
    half = width // 2
    slices = users_of(rot, aten.slice.Tensor)
    even = [s for s in slices if _slice(s, rot, 0, END, 2)]
    odd = [s for s in slices if _slice(s, rot, 1, END, 2)]
    if len(even) == 1 and len(odd) == 1:
        return _match_interleaved(rot, even[0], odd[0], half, x_dtype)
    lo = [s for s in slices if _slice(s, rot, 0, half)]
    hi = [s for s in slices if _slice(s, rot, half, END)]
    if len(lo) == 1 and len(hi) == 1:
        return _match_half_split(rot, lo[0], hi[0], half, x_dtype)
    halves = [u for u in rot.users if is_op(u, *SPLIT_OPS)
              and is_last_dim(rot, node_arg(u, 2, "dim", 0))]
    if len(halves) == 1:
        return _match_chunked_half_split(rot, halves[0], half, x_dtype)
    for node in _view_chain(part):
        if _complex_rope_entry(node) is not None:
            return _match_official_kv_rope(node, x_dtype)
    raise NoMatch(NO_KNOWN_ROPE)


NO_KNOWN_ROPE = "RMSNorm beside a split part that is not RoPE'd in a known form"


def _match_chunked_half_split(rot, chunks, half, x_dtype) -> dict:
    """vLLM / SGLang's neox rotary (`x1, x2 = chunk(x, 2)`; `cat((x1*c - x2*s, x2*c + x1*s))`, c / s one column
    per pair): HF's half-split RoPE in other words (each op in x's dtype either way), its tables doubled."""
    parts = _getitems(chunks)
    if sorted(parts) != [0, 1] or not all(same_size(shape(p)[-1], half) for p in parts.values()):
        raise NoMatch("RoPE: the rotated part is split in other than two halves")
    x1, x2 = parts[0], parts[1]
    for sub in [u for m, _ in _product(x1) for u in users_of(m, aten.sub.Tensor) if u.args[0] is m]:
        x1_c, x2_s = sub.args
        c, s = other_operand(x1_c, x1), other_operand(x2_s, x2) if is_op(x2_s, aten.mul.Tensor) else None
        cat = only_user(sub, aten.cat.default)
        if s is None or cat is None or len(cat.args[0]) != 2 or cat.args[0][0] is not sub:
            continue
        add = cat.args[0][1]
        terms = set(add.args) if is_op(add, aten.add.Tensor) else set()
        if not (any(m in terms for m, f in _product(x2) if f is c) and any(m in terms for m, f in _product(x1) if f is s)):
            continue
        if not is_last_dim_cat(cat):
            continue
        for node in (sub, add):
            refuse_changed_keyword(node, "half-split RoPE of two chunks")
        for table in (c, s):
            _check_table(table, table, x1, half, x_dtype)
        return {"rope_out": cat, "cos": (c, None, True), "sin": (s, None, True), "interleaved": False, "rot": rot}
    raise NoMatch("half-split RoPE of two chunks: cat((x1*cos - x2*sin, x2*cos + x1*sin)) not found")


def _match_official_kv_rope(rot: torch.fx.Node, x_dtype: torch.dtype) -> dict:
    """The official complex-multiply RoPE of the kv side's rotated part (`apply_rope_interleaved(k_pe.unsqueeze(2),
    freqs)`): the product with `freqs` broadcast over a leading prefix of the row dims (the batch), so the
    flattened rows repeat freqs' rows."""
    rope = _match_complex_rope(rot, x_dtype)
    rows, table = shape(rot)[:-1], shape(rope["freqs"])[:-1]
    if not any(all(same_size(t, 1) for t in table[:k]) and same_shape(table[k:], rows[k:])
               for k in range(len(rows) + 1)):
        raise NoMatch(f"complex RoPE beside an RMSNorm: freqs {list(table)} broadcast over rows {list(rows)} other "
                      "than over leading dims")
    return rope


def _product(a: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Users `a * f` of `a`: (mul node, f)."""
    return [(u, other_operand(u, a)) for u in users_of(a, aten.mul.Tensor) if other_operand(u, a) is not None and other_operand(u, a) is not a]


def _cos_source(factor: torch.fx.Node, rot: torch.fx.Node, half, width, x_dtype) -> tuple:
    """`factor` = unsqueeze(table[..., :half], dim): (table, dim), the full-width table HF sliced."""
    node, dim = factor, None
    if is_op(node, aten.unsqueeze.default):
        node, dim = node.args[0], node.args[1]
    if not (is_op(node, aten.slice.Tensor) and _slice(node, node.args[0], 0, half)):
        raise NoMatch(f"RoPE: {factor} is not unsqueeze(cos/sin[..., :{half}])")
    table = node.args[0]
    _check_table(table, factor, rot, width, x_dtype)
    return table, dim


def _check_table(table, factor, rot, width, x_dtype) -> None:
    """The table must be in x's dtype and `factor` (its broadcast form) must broadcast to `rot`'s rows
    without reaching across the last dim."""
    if dtype(table) != x_dtype:
        raise NoMatch(f"RoPE: cos/sin dtype {dtype(table)} differs from the input's {x_dtype}")
    if not same_size(shape(table)[-1], width):
        raise NoMatch(f"RoPE: cos/sin width {shape(table)[-1]} is not the rotated width {width}")
    lead, rows = shape(factor)[:-1], shape(rot)[:-1]
    if len(lead) != len(rows) or not broadcasts_to(lead, rows):
        raise NoMatch(f"RoPE: cos/sin rows {lead} do not broadcast to the rotated part's {rows}")


def _match_interleaved(rot, even, odd, half, x_dtype) -> dict:
    width = shape(rot)[-1]
    for sub in [u for m, _ in _product(even) for u in users_of(m, aten.sub.Tensor) if u.args[0] is m]:
        even_c, odd_s = sub.args
        c = other_operand(even_c, even)
        if not (is_op(odd_s, aten.mul.Tensor) and other_operand(odd_s, odd) is not None):
            continue
        s = other_operand(odd_s, odd)
        cats = users_of(sub, aten.cat.default)
        if not cats and users_of(sub, aten.unsqueeze.default):
            raise NoMatch("interleaved RoPE stacked back in place (GPT-J layout), not a call's pair form on probes "
                          "(`_pair_rope_by_probes`)")
        for cat in cats:
            items = cat.args[0]
            if len(items) != 2 or items[0] is not sub or not is_last_dim_cat(cat):
                continue
            add = items[1]
            if not is_op(add, aten.add.Tensor):
                continue
            terms = set(add.args)
            want_odd_c = [m for m, f in _product(odd) if f is c]
            want_even_s = [m for m, f in _product(even) if f is s]
            if any(m in terms for m in want_odd_c) and any(m in terms for m in want_even_s):
                for node in (sub, add):
                    refuse_changed_keyword(node, "interleaved RoPE")
                cos = _cos_source(c, rot, half, width, x_dtype)
                sin = _cos_source(s, rot, half, width, x_dtype)
                return {"rope_out": cat, "cos": cos, "sin": sin, "interleaved": True, "rot": rot}
    raise NoMatch("interleaved RoPE: even*cos - odd*sin, odd*cos + even*sin not found")


def _match_half_split(rot, lo, hi, half, x_dtype) -> dict:
    width = shape(rot)[-1]
    neg = only_user(hi, aten.neg.default)
    if neg is None:
        raise NoMatch("half-split RoPE: no -x[..., h:]")
    rotated = [c for c in users_of(neg, aten.cat.default) if list(c.args[0]) == [neg, lo]
               and is_last_dim_cat(c)]
    if len(rotated) != 1:
        raise NoMatch("half-split RoPE: no cat(-x2, x1)")
    for m_sin, sin in _product(rotated[0]):
        for add in users_of(m_sin, aten.add.Tensor):
            m_cos = other_operand(add, m_sin)
            if is_op(m_cos, aten.mul.Tensor) and other_operand(m_cos, rot) is not None:
                refuse_changed_keyword(add, "half-split RoPE")
                cos = other_operand(m_cos, rot)
                for table in (cos, sin):
                    _check_table(table, table, rot, width, x_dtype)
                return {"rope_out": add, "cos": (cos, None), "sin": (sin, None), "interleaved": False, "rot": rot}
    raise NoMatch("half-split RoPE: x*cos + rotate_half(x)*sin not found")


def _rewrite(graph: torch.fx.Graph, split: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    before = in_graph_order([m["rope_out"], m["norm_out"]])[-1]
    width = shape(m["proj"])[-1]
    x = insert_call(graph, before, aten.reshape.default, (m["proj"], [-1, width]))
    pair_kwargs = {}
    if "freqs" in m:  # the official complex RoPE: freqs' rows, which the flattened rows repeat
        freqs = insert_call(graph, before, aten.reshape.default, (m["freqs"], [-1, shape(m["freqs"])[-1]]))
        rope_args = (None, None, m["interleaved"], m["weight_in_fp32"], freqs)
    elif "pairs" in m:  # one table column per pair, [T, C_rope/2]
        rows = size_args(graph, before, m["rot"])[:m["lead"]]
        rope_args = tuple(insert_call(graph, before, aten.reshape.default,
                                      (_pair_rows(graph, before, m[name], m["rope_out"], rows),
                                       [-1, m["c_rope"] // 2]))
                          for name in ("cos", "sin")) + (True, m["weight_in_fp32"])
        pair_kwargs = {m["pairs"]: True}
    else:
        rope_args = (_rows_of(graph, before, m["cos"], m["rot"]), _rows_of(graph, before, m["sin"], m["rot"]),
                     m["interleaved"], m["weight_in_fp32"])
    weight = _unit_weight_if_none(graph, before, m, x, m["c_norm"])
    fused = insert_call(graph, before, torch.ops.dsfuse.rmsnorm_rope.default, (x, weight, m["eps"], *rope_args),
                        {**_div_sqrt_kwargs(m, "div_sqrt"), **pair_kwargs})
    normed = insert_call(graph, before, operator.getitem, (fused, 0))
    roped = insert_call(graph, before, operator.getitem, (fused, 1))
    proj_lead = [size_arg(graph, before, m["proj"], d) for d in range(len(shape(m["proj"])) - 1)]
    rot_shape = size_args(graph, before, m["rot"])
    if "pairs" in m:  # the part's rows, then its width (the pairs' view flattened back)
        rot_shape = rot_shape[:m["lead"]] + [m["c_rope"]]
    for out, flat, sizes in ((m["norm_out"], normed, proj_lead + [m["c_norm"]]), (m["rope_out"], roped, rot_shape)):
        restored = insert_call(graph, before, aten.reshape.default, (flat, sizes))
        out.replace_all_uses_with(restored)
    stable_topological_sort(graph)  # the earlier output's users may sit before the fused call
    graph.eliminate_dead_code()
    form = PAIR_FORMS[m["pairs"]] if "pairs" in m else "interleaved" if m["interleaved"] else "half-split"
    if "freqs" in m:
        form = f"complex-multiply {form}"
    tables = [m["freqs"]] if "freqs" in m else [m["cos"][0], m["sin"][0]]
    ctx.site(split, "dsfuse.rmsnorm_rope", [m["proj"], m["weight"], *tables],
             detail=f"RMSNorm {m['c_norm']} ({_rounding(m)}) + {form} RoPE {m['c_rope']}, eps={m['eps']:g}",
             call=fused)


def _div_sqrt_kwargs(norm: dict, name: str) -> dict:
    """The fused call's keyword for a norm written `x / sqrt(..)` (argument `name`); none for `x * rsqrt(..)`, the
    ops' default."""
    return {name: True} if norm["div_sqrt"] else {}


def _rounding(norm: dict) -> str:
    """How an `rmsnorm_rope` norm rounds, for the report."""
    weight = "no weight" if norm["weight"] is None else "weight in fp32" if norm["weight_in_fp32"] else "HF rounding"
    return f"{weight}, x / sqrt" if norm["div_sqrt"] else weight


def _rows_of(graph: torch.fx.Graph, before: torch.fx.Node, table_dim: tuple, rot: torch.fx.Node) -> torch.fx.Node:
    """The cos/sin table as [T, C_rope], one row per row of the rotated part."""
    table = _broadcast_to_rows(graph, before, table_dim, rot)
    return insert_call(graph, before, aten.reshape.default, (table, [-1, shape(rot)[-1]]))


def _broadcast_to_rows(graph: torch.fx.Graph, before: torch.fx.Node, table_dim: tuple,
                       rot: torch.fx.Node, sizes: list | None = None) -> torch.fx.Node:
    """The cos/sin table in the rotated part's shape (HF's unsqueeze, then broadcast dims expanded; a table of
    one column per pair doubled first, as HF's `cat(freqs, freqs)`). `sizes`: rot's sizes as arguments, read off
    a node that stays in the graph when rot is to go (`_rewrite_rope_cat`)."""
    table, dim, *doubled = table_dim
    if doubled and doubled[0]:
        table = insert_call(graph, before, aten.cat.default, ([table, table], -1))
    if dim is not None:
        table = insert_call(graph, before, aten.unsqueeze.default, (table, dim))
    if not same_shape(shape(table), shape(rot)):
        sizes = size_args(graph, before, rot) if sizes is None else sizes
        table = insert_call(graph, before, aten.expand.default, (table, sizes))
    return table


def _replay_views(graph: torch.fx.Graph, before: torch.fx.Node, x: torch.fx.Node, views: list) -> torch.fx.Node:
    """`x` through the same view ops (same arguments) as `views`, in order: a norm's input viewed as the source
    viewed the norm's output (the norm keeps the shape, so the result has the shape of the last view)."""
    for view in views:
        target = aten.reshape.default if view.target is aten.view.default else view.target
        x = insert_call(graph, before, target, (x, *view.args[1:]), dict(view.kwargs))
    return x


def _with_unit_dims(graph: torch.fx.Graph, before: torch.fx.Node, node: torch.fx.Node, count: int) -> torch.fx.Node:
    """`node` with `count` leading dims of size 1 (the kernels read rank-4 tensors)."""
    for _ in range(count):
        node = insert_call(graph, before, aten.unsqueeze.default, (node, 0))
    return node


# --- Binding and rewrite: RoPE + cat of a split's parts, with the LayerNorm before it (`rope_cat`) ------------------
def _match_rope_cat(split: torch.fx.Node) -> dict:
    """`cat` of a two-way last-dim split's parts, in order, after one part went through a RoPE."""
    x, sizes = split.args[0], split.args[1]
    dim = node_arg(split, 2, "dim", 0)
    if len(sizes) != 2 or not is_last_dim(x, dim) or dtype(x) not in FLOAT_DTYPES or len(shape(x)) > 4:
        raise NoMatch("not a two-way split of the last dim", reported=False)
    parts = _getitems(split)
    if sorted(parts) != [0, 1]:
        raise NoMatch("split part unused", reported=False)
    for rope_index in (0, 1):
        rot, kept = parts[rope_index], parts[1 - rope_index]
        if not users_of(rot, aten.slice.Tensor, *SPLIT_OPS):
            continue
        try:
            rope = _match_rope(rot, dtype(x))
        except KeywordMiss:
            raise
        except NoMatch:
            continue
        if rope["rot"] is not rot:
            continue  # a viewed part (the kv side's k_rot) is not concatenated back here
        order = [rope["rope_out"], kept] if rope_index == 0 else [kept, rope["rope_out"]]
        cat = only_user(rope["rope_out"], aten.cat.default)
        if cat is None or list(cat.args[0]) != order or not is_last_dim_cat(cat):
            raise NoMatch("RoPE of a split part not concatenated back with the other part in order")
        for node in (x, rope["cos"][0], rope["sin"][0]):
            if not _last_dim_contiguous(node):
                raise NoMatch(f"RoPE + cat: {node}'s last dim is not contiguous")
        layer_norm, norm_missed = _verified_layer_norm(x, "rope_cat")
        return {"x": x, "cat": cat, "rope_start": 0 if rope_index == 0 else sizes[0], "c_rope": sizes[rope_index],
                "layer_norm": layer_norm, "norm_missed": norm_missed, **rope}
    raise NoMatch("no RoPE on either part", reported=False)


LAYER_NORM_VIEWS = (*VIEW_OPS, aten.unsqueeze.default, aten.squeeze.dim)


def _sole_views(node: torch.fx.Node, targets: tuple) -> list[torch.fx.Node]:
    """[source, view, ..., node]: back through `targets` ops whose input nothing else reads."""
    return walk_back(node, lambda n: is_op(n, *targets) and len(n.args[0].users) == 1)


def _match_layer_norm(x: torch.fx.Node) -> dict | None:
    """The LayerNorm that `x` is a view of (torch's decomposition of `layer_norm` over the last dim, with
    weight, bias and a constant eps, nothing else reading its intermediates), or None."""
    out, *views = _sole_views(x, LAYER_NORM_VIEWS)
    width = shape(x)[-1] if shape(x) else None
    if width is None or not shape(out) or not same_size(shape(out)[-1], width) or len(out.users) != 1:
        return None
    x_dtype = dtype(out)
    affine = out
    if x_dtype != torch.float32:
        if not (is_op(out, CONVERT) and out.args[1] == x_dtype):
            return None
        affine = out.args[0]
    if not is_op(affine, aten.add.Tensor) or len(affine.users) != 1 or dtype(affine) != torch.float32:
        return None
    scaled = _private_operand(affine, aten.mul.Tensor)  # (normalized * weight) + bias
    normalized = _private_operand(scaled, aten.mul.Tensor) if scaled is not None else None
    if normalized is None or not all(_is_affine_param(p, width) for p in (other_operand(scaled, normalized),
                                                                           other_operand(affine, scaled))):
        return None
    weight, bias = other_operand(scaled, normalized), other_operand(affine, scaled)
    centred = _private_operand(normalized, aten.sub.Tensor)  # (xf - mean) * rsqrt(var + eps)
    rsqrt = other_operand(normalized, centred) if centred is not None else None
    if not (is_op(rsqrt, aten.rsqrt.default) and len(rsqrt.users) == 1):
        return None
    add_eps = rsqrt.args[0]
    if not (is_op(add_eps, aten.add.Tensor) and len(add_eps.users) == 1):
        return None
    variance, eps = add_eps.args
    xf, mean = centred.args
    stats = variance.args[0] if is_op(variance, operator.getitem) and variance.args[1] == 0 else None
    if not (is_op(mean, operator.getitem) and mean.args[0] is stats and mean.args[1] == 1
            and len(mean.users) == 1 and len(variance.users) == 1 and _is_last_dim_var_mean(stats, xf)):
        return None
    if set(xf.users) != {stats, centred} or scalar_arg(eps) is None:
        return None
    source = xf
    if x_dtype != torch.float32:
        if not (is_upcast(xf) and dtype(xf.args[0]) == x_dtype):
            return None
        source = xf.args[0]
    if not _last_dim_contiguous(source):
        return None
    return {"input": source, "output": out, "weight": weight, "bias": bias, "eps": scalar_arg(eps), "views": views}


def _private_operand(node: torch.fx.Node, target) -> torch.fx.Node | None:
    """The operand of `node` that calls `target` and is read by `node` alone."""
    return next((a for a in node.args if is_op(a, target) and len(a.users) == 1), None)


def _is_affine_param(node, width) -> bool:
    return (isinstance(node, torch.fx.Node) and len(shape(node)) == 1 and same_size(shape(node)[0], width)
            and dtype(node) in FLOAT_DTYPES)


def _is_last_dim_var_mean(stats, xf) -> bool:
    """`var_mean(xf, [last], correction=0, keepdim=True)`: the biased variance and mean of each row."""
    if not is_op(stats, aten.var_mean.correction) or stats.args[0] is not xf:
        return False
    dims = node_arg(stats, 1, "dim")
    return (dims is not None and is_last_dim(xf, dims) and stats.kwargs.get("correction") == 0
            and stats.kwargs.get("keepdim") is True)


def _last_dim_contiguous(node: torch.fx.Node) -> bool:
    """The kernel reads rows with unit column stride (true of projection outputs and HF's cos/sin)."""
    value = val(node)
    return isinstance(value, torch.Tensor) and (value.shape[-1] == 1 or value.stride()[-1] == 1)


def _rewrite_rope_cat(graph: torch.fx.Graph, split: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    cat = m["cat"]
    pad = 4 - len(shape(m["x"]))
    norm = m["layer_norm"]
    if m.get("norm_missed"):
        ctx.near_miss(split, f"the LayerNorm before this RoPE is left out of its call: {m['norm_missed']}")
    x = m["x"]
    if norm is not None:  # the LayerNorm's input viewed as its output was to give x
        x = _replay_views(graph, cat, norm["input"], norm["views"])
    # Sizes read off what the call reads. Under dynamic=True a size is a `sym_size` read of its node: read off the
    # nodes the call replaces (the LayerNorm's output, the RoPE'd part), it would keep them alive for their shape.
    sizes = size_args(graph, cat, x)
    rot_sizes = [*sizes[:-1], size_arg(graph, cat, m["rot"], -1)]  # the RoPE'd part: x's rows (its width an int)
    x = _with_unit_dims(graph, cat, x, pad)
    tables = [_with_unit_dims(graph, cat, _broadcast_to_rows(graph, cat, table_dim, m["rot"], rot_sizes), pad)
              for table_dim in (m["cos"], m["sin"])]
    norm_args = () if norm is None else (norm["weight"], norm["bias"], norm["eps"])
    fused = insert_call(graph, cat, torch.ops.dsfuse.rope_cat.default,
                        (x, tables[0], tables[1], m["rope_start"], m["interleaved"], *norm_args))
    cat.replace_all_uses_with(insert_call(graph, cat, aten.reshape.default, (fused, sizes)))
    graph.eliminate_dead_code()
    form = "interleaved" if m["interleaved"] else "half-split"
    where = "first" if m["rope_start"] == 0 else "last"
    detail = f"{form} RoPE {m['c_rope']} of the {where} part, concatenated in place"
    inputs = [m["x"], m["cos"][0], m["sin"][0]]
    if norm is not None:
        detail = f"LayerNorm {shape(m['x'])[-1]} (weight, bias, eps={norm['eps']:g}) + {detail}"
        inputs = [norm["input"], m["cos"][0], m["sin"][0], norm["weight"], norm["bias"]]
    ctx.site(split, "dsfuse.rope_cat", inputs, detail=detail, call=fused)


# --- Binding and rewrite: the official indexer's complex RoPE + cat + fp8 per-block quantisation --------------------
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def _upcast(node: torch.fx.Node) -> torch.fx.Node | None:
    """`node.float()`: the convert to fp32 that is node's only user, or node itself when it is fp32."""
    if dtype(node) == torch.float32:
        return node
    cast = only_user(node, CONVERT)
    return cast if cast is not None and cast.args[1] == torch.float32 else None


def _swaps_last_two(permute: torch.fx.Node) -> bool:
    rank = len(shape(permute))
    return list(permute.args[1]) == [*range(rank - 2), rank - 1, rank - 2]


def _complex_rope_entry(part: torch.fx.Node) -> dict | None:
    """The head of the official RoPE on `part` (`apply_rope_interleaved` / `apply_rope_half_split`):

        interleaved: view_as_complex(part.float().view(..., C/2, 2))
        half-split:  view_as_complex(part.float().view(..., 2, C/2).transpose(-1, -2).contiguous())

    Each form is recognised by its own structure (pairs as the last dim, or the two halves transposed into
    it), so one is never taken for the other. None if `part` does not start one."""
    upcast = _upcast(part)
    pairs = only_user(upcast, *VIEW_OPS) if upcast is not None else None
    if pairs is None or len(shape(pairs)) != len(shape(part)) + 1:
        return None
    width = shape(part)[-1]
    to_complex = only_user(pairs, aten.view_as_complex.default)
    if to_complex is not None and same_size(shape(pairs)[-1], 2) and same_size(shape(pairs)[-2] * 2, width):
        return {"complex": to_complex, "interleaved": True}
    permute = only_user(pairs, aten.permute.default)
    if permute is None or not _swaps_last_two(permute) or not same_size(shape(pairs)[-2], 2):
        return None
    contiguous = only_user(permute, aten.clone.default)
    to_complex = only_user(contiguous, aten.view_as_complex.default) if contiguous is not None else None
    if to_complex is None or not same_size(shape(pairs)[-1] * 2, width):
        return None
    return {"complex": to_complex, "interleaved": False}


def _match_complex_rope(part: torch.fx.Node, x_dtype: torch.dtype) -> dict | None:
    """The whole official RoPE on `part`: the complex product with a broadcast complex64 `freqs`, back to
    reals in part's layout and rounded to x's dtype. None if `part` is not its input."""
    entry = _complex_rope_entry(part)
    if entry is None:
        return None
    product = only_user(entry["complex"], aten.mul.Tensor)
    if product is None:
        raise NoMatch("complex RoPE: view_as_complex(...) is not multiplied by the rotations")
    if product.args[0] is not entry["complex"]:  # eager's complex product rounds by operand order
        raise NoMatch("complex RoPE: the rotations are the left operand (the fused op computes x * freqs)")
    freqs = product.args[1]
    rows = shape(entry["complex"])
    if not (isinstance(freqs, torch.fx.Node) and dtype(freqs) == torch.complex64 and len(shape(freqs)) == len(rows)
            and same_size(shape(freqs)[-1], rows[-1])
            and broadcasts_to(shape(freqs)[:-1], rows[:-1])):
        raise NoMatch(f"complex RoPE: the rotations {freqs} are not a complex64 tensor broadcast over the rows")
    back = only_user(product, aten.view_as_real.default)
    if back is None:
        raise NoMatch("complex RoPE: the product is not viewed back as reals")
    if not entry["interleaved"]:
        permute = only_user(back, aten.permute.default)
        back = only_user(permute, aten.clone.default) if permute is not None and _swaps_last_two(permute) else None
        if back is None:
            raise NoMatch("half-split complex RoPE: the halves are not transposed back")
    flat = only_user(back, *VIEW_OPS)
    if flat is None or not same_shape(shape(flat), shape(part)):
        raise NoMatch("complex RoPE: the result is not flattened back to the rotated part's shape")
    out = flat
    if x_dtype != torch.float32:
        out = only_user(flat, CONVERT)
        if out is None or out.args[1] != x_dtype:
            raise NoMatch(f"complex RoPE: the fp32 result is not rounded to the input's {x_dtype}")
    return {"rope_out": out, "freqs": freqs, "interleaved": entry["interleaved"], "rot": part}


def _match_rope_quant(split: torch.fx.Node) -> dict:
    """`quantize_fp8_blockwise(cat(complex_rope(rot), kept))` on a two-way last-dim split (DsfuseIndexer's q and
    k), the split input optionally a LayerNorm's output (k_norm); or, when the RoPE'd part is not concatenated
    back (DsfuseAttention's q_pe) or the cat is not quantised, the complex RoPE alone (`kind` "complex_rope")."""
    x, sizes = split.args[0], split.args[1]
    dim = node_arg(split, 2, "dim", 0)
    parts = _getitems(split)
    if (len(sizes) != 2 or not is_last_dim(x, dim) or dtype(x) not in FLOAT_DTYPES or len(shape(x)) > 4
            or sorted(parts) != [0, 1]):
        raise NoMatch("not a two-way split of the last dim", reported=False)
    rope_index = 0 if _complex_rope_entry(parts[0]) is not None else 1
    rope = _match_complex_rope(parts[rope_index], dtype(x))
    kept = parts[1 - rope_index]
    order = [rope["rope_out"], kept] if rope_index == 0 else [kept, rope["rope_out"]]
    cat = only_user(rope["rope_out"], aten.cat.default)
    rope_start = 0 if rope_index == 0 else sizes[0]
    if cat is None:
        return _complex_rope_alone(rope, rope_start)
    if list(cat.args[0]) != order or not is_last_dim_cat(cat):
        raise NoMatch("complex RoPE of a split part not concatenated back with the other part in order")
    if not _last_dim_contiguous(x):
        raise NoMatch(f"complex RoPE + quantisation: {x}'s last dim is not contiguous")
    quant = _match_fp8_quant(cat, dtype(x))
    if quant is None:
        return _complex_rope_alone(rope, rope_start, cat_left=True)
    norm, norm_missed = _verified_layer_norm(x, "rope_quant_fp8")
    source = x if norm is None else norm["input"]  # the node the fused call reads (stays in the graph)
    for target in (x, quant["blocks"], quant["scale"]):
        for size in shape(target):
            if not isinstance(size, int) and not any(same_size(size, s) for s in shape(source)):
                raise NoMatch(f"fp8 quantisation: size {size} of {target} is not one of the input's sizes")
    verdict = _verify_fp8_quant(cat, quant)
    if verdict.ok is False:
        raise NoMatch(_numeric_miss("fp8 quantisation", "rope_quant_fp8", verdict))
    return {"kind": "rope_quant", "x": x, "cat": cat, "rope_start": 0 if rope_index == 0 else sizes[0],
            "c_rope": sizes[rope_index], "layer_norm": norm, "norm_missed": norm_missed, "source": source, **rope,
            **quant}


def _complex_rope_alone(rope: dict, rope_start, cat_left: bool = False) -> dict:
    """The complex RoPE of a part as `complex_rope` on its own: not concatenated back (the main query's q_pe), or
    concatenated back but not fp8-quantised after (`cat_left`: the cat, and whatever reads it, stay Inductor's)."""
    if not _last_dim_contiguous(rope["rot"]):
        raise NoMatch(f"complex RoPE: {rope['rot']}'s last dim is not contiguous")
    return {"kind": "complex_rope", "rope_start": rope_start, "cat_left": cat_left, **rope}


def _constant_arg(node: torch.fx.Node, expected: float) -> bool:
    return scalar_arg(node.args[1]) == expected


def _match_fp8_quant(cat: torch.fx.Node, x_dtype: torch.dtype) -> dict | None:
    """`quantize_fp8_blockwise` (models/official.py) of `cat`'s rows in its decomposed post-grad form:

        blocks = cat.float().view(..., D / B, B);  amax = blocks.abs().amax(-1).clamp_min(1e-4)
        scale  = amax / 448                       (ue8m0: exp2(ceil(log2(scale))))
        q      = (blocks / scale.unsqueeze(-1)).clamp_min(-448).clamp_max(448).to(float8_e4m3fn)

    with views (the key's squeeze) allowed between `cat` and the blocks (fp32 inputs have no upcast). None when no
    per-block quantisation of the rows follows `cat`; a reported miss when one does in another form."""
    blocks = cat
    while not (dtype(blocks) == torch.float32 and users_of(blocks, aten.abs.default)):
        blocks = only_user(blocks, *LAYER_NORM_VIEWS, CONVERT)
        if blocks is None or (is_op(blocks, CONVERT) and blocks.args[1] != torch.float32):
            break
    width = shape(cat)[-1]
    if (blocks is None or not users_of(blocks, aten.abs.default) or len(shape(blocks)) < 2
            or not same_size(shape(blocks)[-2] * shape(blocks)[-1], width)):
        return None
    block_size = shape(blocks)[-1]
    if not isinstance(block_size, int) or block_size & (block_size - 1):
        raise NoMatch(f"fp8 quantisation: block size {block_size} is not a power of two")
    magnitude = next((u for u in blocks.users if is_op(u, aten.abs.default)), None)
    amax = only_user(magnitude, aten.amax.default) if magnitude is not None else None
    if amax is None or not is_last_dim(blocks, amax.args[1]) or (
            len(amax.args) > 2 and amax.args[2]):
        raise NoMatch("fp8 quantisation: no per-block amax of |x|")
    floor = only_user(amax, aten.clamp_min.default)
    scale = only_user(floor, aten.div.Tensor) if floor is not None and _constant_arg(floor, AMAX_FLOOR) else None
    if scale is None or not _constant_arg(scale, FP8_MAX):
        raise NoMatch("fp8 quantisation: the scale is not max(amax, 1e-4) / 448")
    ue8m0 = False
    log2 = only_user(scale, aten.log2.default)
    if log2 is not None:
        ceil = only_user(log2, aten.ceil.default)
        power = only_user(ceil, aten.exp2.default) if ceil is not None else None
        if power is None:
            raise NoMatch("fp8 quantisation: log2 of the scale is not exp2(ceil(log2(scale)))")
        scale, ue8m0 = power, True
    expanded = next((u for u in scale.users if is_op(u, aten.unsqueeze.default) and u.args[1] in (-1, len(shape(scale)))),
                    None)
    divided = only_user(expanded, aten.div.Tensor) if expanded is not None else None
    if divided is None or divided.args[0] is not blocks or set(blocks.users) != {magnitude, divided}:
        raise NoMatch("fp8 quantisation: the blocks are not divided by their scale (or are read elsewhere)")
    low = only_user(divided, aten.clamp_min.default)
    high = only_user(low, aten.clamp_max.default) if low is not None and _constant_arg(low, -FP8_MAX) else None
    fp8 = only_user(high, CONVERT) if high is not None and _constant_arg(high, FP8_MAX) else None
    if fp8 is None or fp8.args[1] != torch.float8_e4m3fn:
        raise NoMatch("fp8 quantisation: x / scale is not clamped to +-448 and cast to float8_e4m3fn")
    return {"blocks": blocks, "scale": scale, "fp8": fp8, "block_size": block_size, "ue8m0": ue8m0}


def _sizes_like(graph: torch.fx.Graph, before: torch.fx.Node, target: torch.fx.Node, source: torch.fx.Node) -> list:
    """target's shape, symbolic sizes read off `source` (which stays in the graph)."""
    sizes = []
    for size in shape(target):
        if isinstance(size, int):
            sizes.append(size)
        else:
            dim = next(d for d, s in enumerate(shape(source)) if same_size(s, size))
            sizes.append(size_arg(graph, before, source, dim))
    return sizes


def _output(graph: torch.fx.Graph, before: torch.fx.Node, call: torch.fx.Node, index: int) -> torch.fx.Node:
    """`call[index]` with its fake value taken from the call's (no fake mode needed to derive it)."""
    with graph.inserting_before(before):
        node = graph.call_function(operator.getitem, (call, index))
    node.meta["val"] = call.meta["val"][index]
    return node


def _rewrite_rope_quant(graph: torch.fx.Graph, split: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    before = m["scale"]  # the fused call's inputs all precede the scale; the scale's and q's users follow it
    pad = 4 - len(shape(m["x"]))
    norm = m["layer_norm"]
    if m["norm_missed"]:
        ctx.near_miss(split, f"the LayerNorm before this RoPE is left out of its call: {m['norm_missed']}")
    x = m["x"]
    if norm is not None:
        x = insert_call(graph, before, aten.reshape.default, (norm["input"], _sizes_like(graph, before, x, m["source"])))
    x, freqs = (_with_unit_dims(graph, before, node, pad) for node in (x, m["freqs"]))
    norm_args = () if norm is None else (norm["weight"], norm["bias"], norm["eps"])
    fused = insert_call(graph, before, torch.ops.dsfuse.rope_quant_fp8.default,
                        (x, freqs, m["rope_start"], m["interleaved"], m["block_size"], m["ue8m0"], *norm_args))
    quantized, scale = (_output(graph, before, fused, i) for i in (0, 1))
    new_fp8 = insert_call(graph, before, aten.reshape.default,
                          (quantized, _sizes_like(graph, before, m["blocks"], m["source"])))
    new_scale = insert_call(graph, before, aten.reshape.default,
                            (scale, _sizes_like(graph, before, m["scale"], m["source"])))
    m["fp8"].replace_all_uses_with(new_fp8)
    m["scale"].replace_all_uses_with(new_scale)
    graph.eliminate_dead_code()
    form = "interleaved" if m["interleaved"] else "half-split"
    where = "first" if m["rope_start"] == 0 else "last"
    detail = (f"complex-multiply {form} RoPE {m['c_rope']} of the {where} part, concatenated, fp8 e4m3 per-"
              f"{m['block_size']} quantisation ({'ue8m0' if m['ue8m0'] else 'fp32'} scales)")
    inputs = [m["x"], m["freqs"]]
    if norm is not None:
        detail = f"LayerNorm {shape(m['x'])[-1]} (weight, bias, eps={norm['eps']:g}) + {detail}"
        inputs = [norm["input"], m["freqs"], norm["weight"], norm["bias"]]
    ctx.site(split, "dsfuse.rope_quant_fp8", inputs, detail=detail, call=fused)


def _rewrite_complex_rope(graph: torch.fx.Graph, split: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    before = m["rope_out"]
    pad = 4 - len(shape(m["rot"]))
    x, freqs = (_with_unit_dims(graph, before, node, pad) for node in (m["rot"], m["freqs"]))
    fused = insert_call(graph, before, torch.ops.dsfuse.complex_rope.default, (x, freqs, m["interleaved"]))
    sizes = size_args(graph, before, m["rot"])
    m["rope_out"].replace_all_uses_with(insert_call(graph, before, aten.reshape.default, (fused, sizes)))
    graph.eliminate_dead_code()
    form = "interleaved" if m["interleaved"] else "half-split"
    where = "first" if m["rope_start"] == 0 else "last"
    cat = "concatenated back by Inductor" if m["cat_left"] else "not concatenated"
    ctx.site(split, "dsfuse.complex_rope", [m["rot"], m["freqs"]],
             detail=f"complex-multiply {form} RoPE {shape(m['rot'])[-1]} of the {where} part ({cat})", call=fused)


# --- Binding and rewrite: an RMSNorm of a projection output (`rmsnorm_rope` without RoPE) ---------------------------
def _match_projection_norm(square: torch.fx.Node) -> dict:
    """An RMSNorm of a projection's output on its own (HF `q_a_layernorm(q_a_proj(x))`); norms of
    residual sums (the decoder's input/post-attention norms) are not this family."""
    if square.args[1] != 2:
        raise NoMatch("not a square", reported=False)
    xf = square.args[0]
    part = xf.args[0] if is_upcast(xf) else xf
    if dtype(part) not in FLOAT_DTYPES or (part is not xf and dtype(part) == torch.float32):
        raise NoMatch("not an RMSNorm input", reported=False)
    source = part
    while is_op(source, *VIEW_OPS) or _moves_unit_dims_only(source):  # an einsum's bmm output is permuted back
        source = source.args[0]
    projected = is_op(source, *PROJECTIONS) or canonical_mm(source) or canonical_bmm(source)  # or as pad_mm pads it
    if not projected or not shape(part):
        raise NoMatch("input is not a projection output", reported=False)
    norm = _match_weighted_or_unit_norm(part, dtype(part))  # one the call cannot take is reported
    try:
        _check_rms_norm(part, norm, "rmsnorm_rope")
    except NoMatch as miss:
        if miss.reported and _read_by_rope_call(norm["norm_out"]):
            raise NoMatch(f"reported with the RoPE its output feeds: {miss.reason}", reported=False) from None
        raise
    return {"part": part, **norm}


def _read_by_rope_call(out: torch.fx.Node) -> bool:
    """Whether a `rope_cat` call reads `out` (through views): a V4 row's RoPE rewritten without the norm before it,
    whose near-miss already names the norm's failing probe."""
    rows = walk_forward(out, lambda user: is_op(user, *ROW_VIEWS))
    return any(is_op(user, torch.ops.dsfuse.rope_cat.default) for row in rows for user in row.users)


def _moves_unit_dims_only(node: torch.fx.Node) -> bool:
    """A permute that keeps the order of the dims of size other than 1 (a layout no-op)."""
    if not is_op(node, aten.permute.default):
        return False
    sizes = shape(node.args[0])
    moved = [d for d in node.args[1] if not same_size(sizes[d], 1)]
    return moved == sorted(moved)


def _rewrite_projection_norm(graph: torch.fx.Graph, square: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    part, out = m["part"], m["norm_out"]
    c_norm = shape(part)[-1]
    x = insert_call(graph, out, aten.reshape.default, (part, [-1, c_norm]))
    fused = insert_call(graph, out, torch.ops.dsfuse.rmsnorm_rope.default,
                        (x, _unit_weight_if_none(graph, out, m, x, c_norm), m["eps"], None, None, True,
                         m["weight_in_fp32"]), _div_sqrt_kwargs(m, "div_sqrt"))
    normed = insert_call(graph, out, operator.getitem, (fused, 0))
    sizes = size_args(graph, out, part)
    out.replace_all_uses_with(insert_call(graph, out, aten.reshape.default, (normed, sizes)))
    graph.eliminate_dead_code()
    ctx.site(square, "dsfuse.rmsnorm_rope", [part, m["weight"]],
             detail=f"RMSNorm {c_norm} ({_rounding(m)}) of a projection output, eps={m['eps']:g}, no RoPE",
             call=fused)


# --- Binding and rewrite: V4's fp32 RoPE of a row's trailing slice, `cat` back; the row's RMSNorm -------------------
ROW_VIEWS = (*LAYER_NORM_VIEWS, aten.permute.default)


def _last_dim_slice(node: torch.fx.Node, width: int) -> tuple | None:
    """(source, start, end) of `node` = source[..., start:end] (step 1, negative bounds resolved), or None."""
    if not is_op(node, aten.slice.Tensor) or not is_last_dim(node.args[0], node.args[1]):
        return None
    _, start, end, step = slice_args(node)
    if step != 1 or not all(isinstance(b, int) for b in (start, end)):
        return None
    start, end = (b + width if b < 0 else min(b, width) for b in (start, end))
    return node.args[0], start, end


def _fp32_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """What `node` upcasts to fp32 (`x.float()`), or node itself when it is fp32 already."""
    if is_upcast(node):
        return node.args[0]
    return node if dtype(node) == torch.float32 else None


def _pair_table(factor: torch.fx.Node) -> tuple:
    """`factor` = table.repeat_interleave(2, -1) (decomposed: unsqueeze(-1), expand(..., 2), clone, reshape),
    then optionally unsqueezed: (table, the unsqueeze's dim or None)."""
    node, dim = factor, None
    if is_op(node, aten.unsqueeze.default):
        node, dim = node.args[0], node.args[1]
    clone = node.args[0] if is_op(node, *VIEW_OPS) else None
    expand = clone.args[0] if is_op(clone, aten.clone.default) else None
    pairs = expand.args[0] if is_op(expand, aten.expand.default) else None
    if not (is_op(pairs, aten.unsqueeze.default) and pairs.args[1] in (-1, len(shape(pairs)) - 1)
            and same_size(shape(expand)[-1], 2) and same_size(shape(node)[-1], 2 * shape(pairs.args[0])[-1])):
        raise NoMatch(f"V4 RoPE: {factor} is not cos/sin.repeat_interleave(2, -1)")
    return pairs.args[0], dim


def _rotate_half_pairs(node: torch.fx.Node, rot: torch.fx.Node) -> bool:
    """`node` = V4's `rotate_half(rot)`: stack((-rot[..., 1::2], rot[..., 0::2]), -1).flatten(-2)."""
    cat = node.args[0] if is_op(node, *VIEW_OPS) and same_shape(shape(node), shape(rot)) else None
    if not (is_last_dim_cat(cat) and len(cat.args[0]) == 2):
        return False
    first, second = (item.args[0] if is_op(item, aten.unsqueeze.default) else None for item in cat.args[0])
    neg_odd = first.args[0] if is_op(first, aten.neg.default) else None
    return _slice(neg_odd, rot, 1, END, 2) and _slice(second, rot, 0, END, 2)


def _match_pair_rope(rotated: torch.fx.Node, rot: torch.fx.Node, x_dtype: torch.dtype) -> dict:
    """`rotated` = (rot.float() * cos2 + rotate_half(rot).float() * sin2).to(x_dtype), cos2 / sin2 the pair
    tables repeated (HF V4 `apply_rotary_pos_emb`)."""
    total = rotated
    if x_dtype != torch.float32:
        if not (is_op(rotated, CONVERT) and rotated.args[1] == x_dtype):
            raise NoMatch("V4 RoPE: the fp32 result is not rounded to the input dtype", reported=False)
        total = rotated.args[0]
    if not is_op(total, aten.add.Tensor) or not all(is_op(t, aten.mul.Tensor) for t in total.args[:2]):
        raise NoMatch("V4 RoPE: not x*cos + rotate_half(x)*sin", reported=False)
    cos = sin = None
    for product in total.args[:2]:
        for i in (0, 1):
            operand, factor = product.args[i], product.args[1 - i]
            if _fp32_of(operand) is rot:
                cos = factor
            elif _fp32_of(operand) is not None and _rotate_half_pairs(_fp32_of(operand), rot):
                sin = factor
    if cos is None or sin is None:
        raise NoMatch("V4 RoPE: not x*cos + rotate_half(x)*sin", reported=False)
    refuse_changed_keyword(total, "V4 RoPE")
    tables = []
    for factor in (cos, sin):
        table, dim = _pair_table(factor)
        if dtype(table) not in (x_dtype, torch.float32):
            raise NoMatch(f"V4 RoPE: cos/sin dtype {dtype(table)} is neither the input's {x_dtype} nor fp32")
        lead, rows = shape(factor)[:-1], shape(rot)[:-1]
        if len(lead) != len(rows) or not broadcasts_to(lead, rows):
            raise NoMatch(f"V4 RoPE: cos/sin rows {list(lead)} do not broadcast to the rotated part's {list(rows)}")
        if not _last_dim_contiguous(table):
            raise NoMatch(f"V4 RoPE: {table}'s last dim is not contiguous")
        tables.append((table, dim))
    return {"cos": tables[0], "sin": tables[1]}


def _norm_above(row: torch.fx.Node, x_dtype: torch.dtype) -> tuple[dict | None, list[torch.fx.Node], str | None]:
    """The RMSNorm whose output `row` is, or is a view of (through single-user views, permutes, unsqueezes),
    and the views from the norm output to `row`, in order; (None, [], None) when there is none, and (None, [],
    reason) for an RMSNorm that cannot join the call (its eps a tensor under `dynamic=True`), to be reported."""
    out, *views = _sole_views(row, ROW_VIEWS)
    root = next((n for n in _ancestors(out, 3) if is_op(n, aten.rsqrt.default, aten.sqrt.default)), None)
    add = root.args[0] if root is not None else None
    mean = add.args[0] if is_op(add, aten.add.Tensor) else None
    square = mean.args[0] if is_op(mean, aten.mean.dim) else mean.meta.get(MEAN, (None,))[0] if mean else None
    if not (is_op(square, aten.pow.Tensor_Scalar) and square.args[1] == 2):
        return None, [], None
    xf = square.args[0]
    part = xf.args[0] if is_upcast(xf) else xf
    if dtype(part) != x_dtype:
        return None, [], None
    try:
        norm = _match_rmsnorm(part, x_dtype, unweighted=True)
    except NoMatch as miss:
        return None, [], miss.reason if UNSPECIALISED_FLOAT in miss.reason else None
    if norm["norm_out"] is not out:
        return None, [], None
    verdict = _verify_rms_norm(part, norm, "rope_cat")
    if verdict.ok is False:
        return None, [], _numeric_miss("RMSNorm", "rope_cat", verdict)
    return {"input": part, **norm}, views, None


def _ancestors(node: torch.fx.Node, depth: int) -> list[torch.fx.Node]:
    found, frontier = [], [node]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes]
        found += frontier
    return found


def _match_trailing_rope(cat: torch.fx.Node) -> dict:
    """`cat([row[..., :D-R], rope(row[..., D-R:])], -1)` with V4's fp32 pair RoPE, `row` optionally (a view of)
    an RMSNorm's output (`kv_norm`, `q_b_norm`, the compressors' `kv_norm`). The two parts may be a two-way
    `split`'s. HF's RoPE forms in the input dtype there are `rope_cat` as for a split (the norm then stays a call
    of its own); any other RoPE-like product of the trailing part is reported."""
    items = cat.args[0]
    if len(items) != 2 or not is_last_dim_cat(cat):
        raise NoMatch("not a two-way last-dim cat", reported=False)
    nope, rotated = items
    parts = _leading_and_trailing(nope)
    if parts is None:
        raise NoMatch("not the leading and trailing parts of one row", reported=False)
    row, kept_width, rot = parts
    width, x_dtype = shape(row)[-1], dtype(row)
    try:
        rope = _match_pair_rope(rotated, rot, x_dtype)
    except NoMatch as miss:
        if miss.reported:  # V4's RoPE in a form its call cannot take
            raise
        try:
            return _match_tail_rope_cat(cat, row, rot, rotated, miss)
        except NoMatch as tail_miss:  # a RoPE-like product of the tail: a pair form written otherwise?
            rope = _pair_rope_by_probes(rot, x_dtype, rotated) if tail_miss.reported else None
            if rope is None:
                raise
    c_rope = width - kept_width
    if c_rope < 2 or c_rope % 2:
        raise NoMatch(f"V4 RoPE: rotated width {c_rope} is not even")
    if len(shape(row)) > 4:
        raise NoMatch(f"V4 RoPE: row rank {len(shape(row))} above 4")
    norm, views, norm_missed = _norm_above(row, x_dtype)
    source = row if norm is None else norm["input"]
    if not _last_dim_contiguous(source):
        raise NoMatch(f"V4 RoPE: {source}'s last dim is not contiguous")
    return {"cat": cat, "row": row, "rot": rot, "c_rope": c_rope, "norm": norm, "views": views,
            "norm_missed": norm_missed, **rope}


def _leading_and_trailing(nope: torch.fx.Node) -> tuple | None:
    """(row, w, tail) when `nope` is `row[..., :w]` beside a `tail` = `row[..., w:]`, or part 0 of a two-way
    last-dim split of `row` (the tail its part 1); None otherwise."""
    if is_op(nope, operator.getitem) and nope.args[1] == 0 and is_op(nope.args[0], aten.split_with_sizes.default):
        split = nope.args[0]
        row, sizes, parts = split.args[0], split.args[1], _getitems(split)
        if (len(sizes) == 2 and is_last_dim(row, node_arg(split, 2, "dim", 0)) and 1 in parts
                and dtype(row) in FLOAT_DTYPES and isinstance(sizes[0], int) and isinstance(shape(row)[-1], int)):
            return row, sizes[0], parts[1]
        return None
    row = nope.args[0] if is_op(nope, aten.slice.Tensor) else None
    if row is None or dtype(row) not in FLOAT_DTYPES or not shape(row) or not isinstance(shape(row)[-1], int):
        return None
    width = shape(row)[-1]
    kept = _last_dim_slice(nope, width)
    if kept is None or kept[1] != 0:
        return None
    tail = next((u for u in row.users if u is not nope and _last_dim_slice(u, width) == (row, kept[2], width)), None)
    return None if tail is None else (row, kept[2], tail)


def _match_tail_rope_cat(cat, row, rot, rotated, pair_miss: NoMatch) -> dict:
    """The trailing part RoPE'd in one of HF's forms in the input dtype (`rope_cat`, as for a split's parts), or
    else a reported miss when the part goes through products with other tensors, as a RoPE does. The official
    complex product is `complex_rope` on its own (no kernel takes it with the cat unquantised)."""
    if _complex_rope_entry(rot) is not None:
        rope = _match_complex_rope(rot, dtype(row))
        return _complex_rope_alone(rope, shape(row)[-1] - shape(rot)[-1], cat_left=True)
    try:
        rope = _match_rope(rot, dtype(row))
    except NoMatch as miss:
        if not _rotated_by_products(rotated, rot):
            raise NoMatch(pair_miss.reason, reported=False) from None
        reason = (miss.reason if miss.reported and miss.reason != NO_KNOWN_ROPE
                  else f"{pair_miss.reason}, and not HF's half-split or interleaved form")
        raise NoMatch(f"RoPE of a row's trailing part, concatenated back, in no form a call takes: {reason}") from None
    if "freqs" in rope:
        return _complex_rope_alone(rope, shape(row)[-1] - shape(rot)[-1], cat_left=True)
    if rope["rope_out"] is not rotated or rope["rot"] is not rot or len(shape(row)) > 4:
        raise NoMatch("RoPE of a row's trailing part, concatenated back: the RoPE reads the part through views, "
                      "or the row's rank is above 4")
    for node in (row, rope["cos"][0], rope["sin"][0]):
        if not _last_dim_contiguous(node):
            raise NoMatch(f"RoPE + cat: {node}'s last dim is not contiguous")
    width = shape(row)[-1]
    return {"kind": "rope_cat", "x": row, "cat": cat, "rope_start": width - shape(rot)[-1], "c_rope": shape(rot)[-1],
            "layer_norm": None, **rope}


def _rotated_by_products(rotated: torch.fx.Node, rot: torch.fx.Node) -> bool:
    """Whether `rotated` is computed from `rot` (within a few ops) through products with tensors not derived
    from it: the cos / sin factors of a RoPE."""
    seen, frontier = set(), [rotated]
    for _ in range(8):
        frontier = [a for n in frontier if n is not rot for a in n.all_input_nodes if a not in seen]
        seen.update(frontier)
    if rot not in seen:
        return False
    derived, frontier = {rot}, [rot]
    while frontier:
        frontier = [u for n in frontier for u in n.users if u in seen and u not in derived]
        derived.update(frontier)
    return any(is_op(n, aten.mul.Tensor) and any(a not in derived for a in n.all_input_nodes)
               for n in derived if n is not rot)


def _pair_rows(graph: torch.fx.Graph, before: torch.fx.Node, table_dim: tuple, rot: torch.fx.Node,
               rows: list) -> torch.fx.Node:
    """A pair table ([..., R/2], unsqueezed as the source did) expanded to the rotated part's rows (`rows`, its
    leading sizes as arguments, read off the row the call reads: `_rewrite_trailing_rope`)."""
    table, dim = table_dim
    if dim is not None:
        table = insert_call(graph, before, aten.unsqueeze.default, (table, dim))
    if not same_shape(shape(table)[:-1], shape(rot)[:-1]):
        table = insert_call(graph, before, aten.expand.default, (table, [*rows, shape(table)[-1]]))
    return table


def _rewrite_trailing_rope(graph: torch.fx.Graph, cat: torch.fx.Node, m: dict, ctx: PassContext) -> None:
    if m.get("kind") == "rope_cat":
        _rewrite_rope_cat(graph, cat, m, ctx)
        return
    if m.get("kind") == "complex_rope":
        _rewrite_complex_rope(graph, cat, m, ctx)
        return

    norm, row = m["norm"], m["row"]
    if m["norm_missed"]:
        ctx.near_miss(cat, f"the RMSNorm before this RoPE is left out of its call: {m['norm_missed']}")
    x = row
    if norm is not None:  # the norm's input, viewed as the source viewed the norm's output
        x = _replay_views(graph, cat, norm["input"], m["views"])
    # row's shape, read off what the call reads: under dynamic=True a `sym_size` of the norm's output (or of the
    # RoPE'd slice) kept the norm alive for its shape alone, where the projection-norm matcher met it again (q_b's
    # `x * rsqrt(..).to(dtype)` reported, kv's norm fused a second time, when S is 1)
    sizes = size_args(graph, cat, x)
    pad = 4 - len(shape(row))
    x = _with_unit_dims(graph, cat, x, pad)
    tables = [_with_unit_dims(graph, cat, _pair_rows(graph, cat, table_dim, m["rot"], sizes[:-1]), pad)
              for table_dim in (m["cos"], m["sin"])]
    width = shape(row)[-1]
    rms = (0, None, 0.0) if norm is None else (RMS_NORMS.index(norm["rounding"]), norm["weight"], norm["eps"])
    form = m.get("pairs", "fp32_pairs")
    kwargs = {} if form == "fp32_pairs" else {form: True}
    if norm is not None:
        kwargs.update(_div_sqrt_kwargs(norm, "rms_div_sqrt"))
    fused = insert_call(graph, cat, torch.ops.dsfuse.rope_cat.default,
                        (x, tables[0], tables[1], width - m["c_rope"], True, None, None, 0.0, *rms,
                         form == "fp32_pairs"), kwargs)
    cat.replace_all_uses_with(insert_call(graph, cat, aten.reshape.default, (fused, sizes)))
    graph.eliminate_dead_code()
    detail = f"{PAIR_FORMS[form]} RoPE {m['c_rope']} of the trailing columns of {width}, concatenated in place"
    inputs = [row, m["cos"][0], m["sin"][0]]
    if norm is not None:
        weight = "no weight" if norm["weight"] is None else "weight"
        division = ", x / sqrt" if norm["div_sqrt"] else ""
        detail = f"RMSNorm {width} ({norm['rounding']}{division}, {weight}, eps={norm['eps']:g}) + {detail}"
        inputs = [norm["input"], m["cos"][0], m["sin"][0]] + ([norm["weight"]] if norm["weight"] is not None else [])
    ctx.site(cat, "dsfuse.rope_cat", inputs, detail=detail, call=fused)


# --- Verification: pair RoPEs written back in place, proven on probes (for the binders) -----------------------------
# The calls' pair forms (one table column per pair, the pairs written back in place), as the report names them.
PAIR_FORMS = {"fp32_pairs": "V4 fp32 pair", "pairs_in_place": "GPT-J pair (in the input dtype)"}
OUTPUT_DEPTH = 10


def _pair_rope_by_probes(rot: torch.fx.Node, x_dtype: torch.dtype, rotated: torch.fx.Node | None = None) -> dict | None:
    """The RoPE of `rot`'s interleaved pairs written back in place, however it is spelled (`unbind` pairs stacked
    back, V4's even / odd stack + flatten): `rotated` (or, None, the latest node derived from `rot` within a few ops
    in its shape and dtype) equals a call's pair form on probes (`verify.py`) at two tables of one column per pair,
    the latest nodes of the slice not derived from `rot` that broadcast to its rows. `rot` may be the part viewed
    as its [..., C_rope/2, 2] pairs (the view `unflatten` leaves). V4's fp32 form first (in fp32 the two forms are
    one). A match as `_match_rope`'s, with "pairs" naming the form and "lead" the count of `rot`'s row dims; None
    when nothing proves."""
    dims = shape(rot)
    paired = len(dims) >= 2 and same_size(dims[-1], 2) and isinstance(dims[-2], int)
    rows, width = (dims[:-2], 2 * dims[-2]) if paired else (dims[:-1], dims[-1] if dims else None)
    if not isinstance(width, int) or width < 2 or width % 2 or dtype(rot) != x_dtype:
        return None
    for out in [rotated] if rotated is not None else _rope_outputs(rot, [*rows, width]):
        tables = _pair_tables(rot, out, rows, width // 2)
        if tables is None:
            continue
        for cos, sin in (tables, tables[::-1]):
            for form in PAIR_FORMS:
                allowed = (x_dtype, torch.float32) if form == "fp32_pairs" else (x_dtype,)
                if dtype(cos) not in allowed or dtype(sin) not in allowed:
                    continue
                family = Family(probes=lambda shapes, dtypes: rope_table_probes(shapes, dtypes, "rot", 3.0),
                                compare=_same_bits,
                                reference=lambda probe, form=form: _pair_reference(probe, form, paired))
                if verify([out], {"rot": rot, "cos": cos, "sin": sin}, family, extra=(form, paired)).ok:
                    return {"rope_out": out, "cos": (cos, None), "sin": (sin, None), "interleaved": True, "rot": rot,
                            "pairs": form, "lead": len(rows)}
    return None


def _rope_outputs(rot: torch.fx.Node, out_shape: list) -> list[torch.fx.Node]:
    """Nodes derived from `rot` within `OUTPUT_DEPTH` ops of its dtype and shape `out_shape`, the latest first."""
    found, frontier, seen = [], [rot], {rot}
    for _ in range(OUTPUT_DEPTH):
        frontier = list(dict.fromkeys(u for n in frontier for u in n.users if u not in seen))
        seen.update(frontier)
        found += [n for n in frontier if dtype(n) == dtype(rot) and same_shape(shape(n), out_shape)]
    return in_graph_order(found)[::-1]


def _pair_tables(rot: torch.fx.Node, out: torch.fx.Node, rows: list, half: int) -> list[torch.fx.Node] | None:
    """The two latest nodes of the slice from `out` back to `rot` that are not derived from `rot`, one float column
    per pair, broadcasting to `rows` at their rank, last dim contiguous; None unless there are exactly two."""
    tables = latest_independent(out, rot, lambda n: (
        dtype(n) in FLOAT_DTYPES and len(shape(n)) == len(rows) + 1 and same_size(shape(n)[-1], half)
        and broadcasts_to(shape(n)[:-1], rows) and _last_dim_contiguous(n)))
    return tables if tables is not None and len(tables) == 2 else None


def _pair_reference(probe: dict, form: str, paired: bool) -> torch.Tensor:
    """The call's pair form `form` of the probe's part (given as its [..., C_rope/2, 2] pairs when `paired`)."""
    from dsfuse.kernels.norm_rope_quant import pair_rope_fp32_reference, rope_reference

    rot, cos, sin = probe["rot"], probe["cos"], probe["sin"]
    if paired:
        rot = rot.flatten(-2)
    if form == "fp32_pairs":
        return pair_rope_fp32_reference(rot, cos, sin)
    return rope_reference(rot, cos, sin, True, pairs_in_place=True)


def _same_bits(got: list, want: torch.Tensor, probe: dict) -> str | None:
    """None when the slice's output is the reference's bit for bit (the calls compute each rounding as written)."""
    out = got[0]
    if not isinstance(out, torch.Tensor) or out.dtype != want.dtype or out.shape != want.shape:
        return f"not a {want.dtype} tensor of shape {list(want.shape)}"
    if torch.equal(out, want):
        return None
    return f"differs by up to {(out.float() - want.float()).abs().max().item():.3g}"


# --- Verification: the norms and the fp8 quantisation, proven on probes ---------------------------------------------
# The walk reads each norm and quantisation op by op but not what an op's other arguments do to its rounding (a
# mean or sum of the squares taken in bf16 / fp16 through its `dtype`), so every matched RMSNorm, LayerNorm and fp8
# quantisation is run on probes (`verify.py`) against the reference of the call that replaces it before the rewrite.
# Budget, norms: this many ulps of the output's dtype at the largest magnitude of its row. A spelling may reach the
# statistic otherwise than the reference (`sum / C` for `mean`, `var_mean` for the LayerNorm's two passes), which
# moves it by a few fp32 ulps and an fp32 output by a few more through the rsqrt and the products; a bf16 / fp16
# output flips one rounding, and one more in HF's product by the weight in that dtype. (Seen: at most 2 fp32 ulps
# and no bf16 one over the pass tests, the corpus and 200 spelling-fuzzer draws.) The fp8 quantisation has none:
# it sums nothing, and each of its ops (abs, amax, the divisions, log2 / ceil / exp2, the clamps, the e4m3 cast)
# rounds alike in the source and the reference, which the kernel matches bit for bit (tests/kernels).
NORM_ULPS = {torch.float32: 16, torch.bfloat16: 2, torch.float16: 2}
LARGE_ROWS = 1e4  # a scale at which the squares overflow fp16 and stay finite in fp32, where the calls sum them


def _numeric_miss(what: str, call: str, verdict: Verdict) -> str:
    return f"{what}: numeric check against {call}'s reference failed: {verdict.reason}"


def _check_rms_norm(part: torch.fx.Node, norm: dict, call: str) -> None:
    """A reported miss when the RMSNorm matched on `part` disagrees with `call`'s reference on probes."""
    verdict = _verify_rms_norm(part, norm, call)
    if verdict.ok is False:
        raise NoMatch(_numeric_miss("RMSNorm", call, verdict))


def _verify_rms_norm(part: torch.fx.Node, norm: dict, call: str) -> Verdict:
    """Run the slice from the norm's input (and weight) to its output on `_norm_probes` against `call`'s reference
    with the rounding, eps and division the walk read."""
    if norm["weight"] is part:
        return Verdict(False, "the norm's weight is its input")
    roles = {"x": part} if norm["weight"] is None else {"x": part, "weight": norm["weight"]}
    family = Family(probes=lambda shapes, dtypes: _norm_probes(shapes, dtypes, norm["eps"]),
                    reference=lambda probe: _rms_norm_reference(probe, norm, call), compare=_within_row_ulps)
    settings = ("rms_norm", call, norm["rounding"], norm["eps"], norm["div_sqrt"], norm.get("weight_in_fp32"))
    return verify([norm["norm_out"]], roles, family, settings)


def _rms_norm_reference(probe: dict, norm: dict, call: str) -> torch.Tensor:
    """The probe's rows normalised by `call`'s reference: `rmsnorm_rope`'s (no weight read as fp32 ones, as the
    rewrite passes it), or `rope_cat`'s in the norm's rounding."""
    x, weight = probe["x"], probe.get("weight")
    if call == "rope_cat":
        return rms_norm_reference(x, RMS_NORMS.index(norm["rounding"]), weight, norm["eps"], norm["div_sqrt"])
    width = x.shape[-1]
    weight = torch.ones(width) if weight is None else weight
    normed, _ = rmsnorm_rope_reference(x.reshape(-1, width), weight, norm["eps"], None, None, True,
                                       norm["weight_in_fp32"], div_sqrt=norm["div_sqrt"])
    return normed


def _verified_layer_norm(x: torch.fx.Node, call: str) -> tuple[dict | None, str | None]:
    """The LayerNorm `x` is a view of (`_match_layer_norm`) once its slice agrees with `layer_norm_reference` on
    probes; else (None, why): `call` then reads x, the LayerNorm is Inductor's and reported."""
    norm = _match_layer_norm(x)
    if norm is None:
        return None, None
    roles = {"x": norm["input"], "weight": norm["weight"], "bias": norm["bias"]}
    if len(set(roles.values())) != len(roles):
        verdict = Verdict(False, "two roles of the LayerNorm are bound to one tensor")
    else:
        family = Family(probes=lambda shapes, dtypes: _norm_probes(shapes, dtypes, norm["eps"]),
                        reference=lambda probe: layer_norm_reference(probe["x"], probe["weight"], probe["bias"],
                                                                     norm["eps"]),
                        compare=_within_row_ulps)
        verdict = verify([norm["output"]], roles, family, ("layer_norm", norm["eps"]))
    if verdict.ok is False:
        return None, _numeric_miss("LayerNorm", call, verdict)
    return norm, None


def _norm_probes(shapes: dict, dtypes: dict, eps: float) -> list[tuple[str, dict]]:
    """Rows of every sign about offsets of every sign, the first row zero (the eps floor alone), with a weight (and
    a bias) of every sign; the same rows at `LARGE_ROWS`; and scaled to sqrt(eps), where a spelling that adds eps
    elsewhere than to the mean differs most."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shapes["x"], generator=gen) + torch.randn((*shapes["x"][:-1], 1), generator=gen)
    x.view(-1, x.shape[-1])[:1] = 0.0
    params = {role: torch.randn(shapes[role], generator=gen).to(dtypes[role]) for role in ("weight", "bias")
              if role in shapes}
    scales = (("signed rows, a zero row", 1.0), ("large rows", LARGE_ROWS),
              ("rows at the eps scale", max(eps, 1e-12) ** 0.5))
    return [(name, {"x": (x * scale).to(dtypes["x"]), **params}) for name, scale in scales]


def _within_row_ulps(got: list, want: torch.Tensor, probe: dict) -> str | None:
    """None when the norm's output has the reference's values within `NORM_ULPS` of its dtype at each row's
    largest magnitude (NaN and infinities where the reference has them), else the worst row and by how much."""
    out = got[0]
    if not isinstance(out, torch.Tensor) or out.numel() != want.numel():
        return f"not a tensor of the reference's {want.numel()} values"
    if out.dtype != want.dtype:
        return f"in {out.dtype}, the call's in {want.dtype}"
    miss = ulps_beyond(out, want.reshape(-1, want.shape[-1]), NORM_ULPS[want.dtype], "row")
    return None if miss is None else f"row {miss.where[0]} {miss}"


def _verify_fp8_quant(cat: torch.fx.Node, quant: dict) -> Verdict:
    """Run the slice from the quantised rows (`cat`) to the fp8 values and the scales on `_quant_probes` against
    `rope_quant_fp8_reference`'s quantisation (`quantize_activations`, dividing by the scale as the source does)."""
    block, ue8m0 = quant["block_size"], quant["ue8m0"]
    family = Family(probes=lambda shapes, dtypes: _quant_probes(shapes, dtypes, block),
                    reference=lambda probe: quantize_activations(probe["rows"], block, pow2=ue8m0, reciprocal=False),
                    compare=_same_fp8)
    return verify([quant["fp8"], quant["scale"]], {"rows": cat}, family, ("fp8", block, ue8m0))


def _quant_probes(shapes: dict, dtypes: dict, block: int) -> list[tuple[str, dict]]:
    """Rows in blocks of `block`, each block of its own power-of-two magnitude: random values; zero blocks (the
    1e-4 amax floor); values under the floor; the largest magnitude at +-amax with amax / 448 a power of two (those
    quantised to exactly +-448, the scale kept by ue8m0); then that largest value a little above it (ue8m0 rounds
    the scale up a binade)."""
    gen = torch.Generator().manual_seed(0)
    rows = shapes["rows"]
    blocks = (*rows[:-1], rows[-1] // block, block)
    binades = torch.exp2(torch.randint(-8, 8, (*blocks[:-1], 1), generator=gen).float())
    unit = torch.rand(blocks, generator=gen) * 2 - 1
    unit[..., -1], unit[..., 0] = -1.0, 1.0
    at_max = unit * FP8_MAX * binades
    above = at_max.clone()
    above[..., 0] *= 1 + 2 ** -6
    probes = (("random blocks", torch.randn(blocks, generator=gen) * binades), ("zero blocks", torch.zeros(blocks)),
              ("blocks under the amax floor", unit * AMAX_FLOOR / 4), ("blocks at +-448", at_max),
              ("scales a little above a power of two", above))
    return [(name, {"rows": values.reshape(rows).to(dtypes["rows"])}) for name, values in probes]


BITS = {torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}


def _same_fp8(got: list, want: tuple, probe: dict) -> str | None:
    """None when the fp8 values and the scales are the reference's bit for bit, else which differ and where first."""
    for name, out, ref in zip(("fp8 values", "scales"), got, want):
        if not isinstance(out, torch.Tensor) or out.dtype != ref.dtype or out.numel() != ref.numel():
            return f"{name}: not {ref.numel()} {ref.dtype} values"
        out, ref = out.reshape(-1), ref.reshape(-1)
        differ = (out.view(BITS[ref.dtype]) != ref.view(BITS[ref.dtype])).nonzero()
        if len(differ):
            first = differ[0, 0].item()
            return (f"{name} differ at {len(differ)} of {ref.numel()} (the first: {out[first].float().item():g} "
                    f"against {ref[first].float().item():g})")
    return None
