"""Fuzz the norm / RoPE / fp8 glue ops: the Triton kernels (through the interpreter on CPU) against the references.

Inputs lie on a 1/8 grid and the complex rotations on a 1/16 grid: every product and short sum is then exact in
fp32, so the kernels' and torch's rounding orders agree and RoPE outputs must match bit for bit (the reference's
complex multiply may be any of the lane roundings, see `LANE_ROUNDINGS`). Norm statistics are sums over a row
that a kernel may order differently (the numerics rules allow it): normed outputs are compared within two ulps."""

import torch
from fuzz_support import DEVICE, assert_rel_close, assert_same, fuzzes, layouts, reference_output, restride, seeds, sizes, values
from hypothesis import given
from hypothesis import strategies as st

from dsfuse.kernels import norm_rope_quant as nrq

ROPE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NORM_TOL = {torch.float32: 2.4e-7, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}  # two ulps of each dtype


def _rotations(shape, seed):
    """complex64 rotations on a 1/16 grid (exact products with grid inputs)."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randint(-16, 17, (*shape, 2), generator=g).float() / 16
    return torch.view_as_complex(parts)


def _specials():
    return st.lists(st.sampled_from(["nan", "inf", "-inf", "zero", "tie"]), max_size=2, unique=True)


@st.composite
def row_views(draw, dims=4, width=None, dtypes=ROPE_DTYPES, finite=False):
    """x [A0, A1, A2, D]: edge sizes, a non-contiguous layout, grid values with specials."""
    shape = [draw(sizes(0 if i == 1 else 1, 5)) for i in range(dims - 1)] + [width or 2 * draw(sizes(1, 17))]
    dtype = draw(st.sampled_from(dtypes))
    specials = draw(st.lists(st.sampled_from(["zero", "tie"]), max_size=2, unique=True) if finite else _specials())
    x = values(shape, dtype, draw(seeds()), scale=2.0, specials=specials, grid=8)
    return restride(x.to(DEVICE), draw(layouts(dims)))


@st.composite
def complex_rope_args(draw):
    x = draw(row_views())
    broadcast = [draw(st.sampled_from([a, 1])) for a in x.shape[:-1]]
    return x, _rotations((*broadcast, x.shape[-1] // 2), draw(seeds())).to(DEVICE), draw(st.booleans())


@fuzzes("dsfuse::complex_rope")
@given(args=complex_rope_args())
def test_complex_rope_kernel_is_the_reference(args):
    want = reference_output(nrq.complex_rope, nrq.complex_rope_reference, *args)
    assert_same(nrq.complex_rope_triton(*args), want, what="triton")


@st.composite
def rope_cat_args(draw, layer_norm=None, rms_norm=None):
    """x, cos, sin, rope_start, interleaved, then optionally a LayerNorm or an RMSNorm (`nrq.RMS_NORMS`, by
    `x * rsqrt` or `x / sqrt`), V4's fp32 pair RoPE (half-width tables, in x's dtype or fp32) and GPT-J's pairs
    written in place (half-width tables in x's dtype, interleaved)."""
    x = draw(row_views())
    pairs = draw(st.sampled_from(["none", "fp32_pairs", "pairs_in_place"]))
    fp32_pairs, pairs_in_place = pairs == "fp32_pairs", pairs == "pairs_in_place"
    c_rope = 2 * draw(st.integers(1, x.shape[-1] // 2))
    start = draw(st.integers(0, x.shape[-1] - c_rope))
    seed = draw(seeds())
    table_dtype = draw(st.sampled_from([x.dtype, torch.float32])) if fp32_pairs else x.dtype
    angle = values((*x.shape[:-1], c_rope if pairs == "none" else c_rope // 2), torch.float32, seed,
                   grid=16).clamp(-1, 1)
    cos, sin = angle.to(table_dtype).to(DEVICE), angle.flip(-1).to(table_dtype).to(DEVICE)
    norm = draw(st.sampled_from(["none", "layer", "rms"])) if layer_norm is None else "layer" if layer_norm else "none"
    if rms_norm is not None:
        norm = "rms" if rms_norm else "none" if norm == "rms" else norm
    ln, rms, div_sqrt = (None, None, 0.0), (0, None, 0.0), False
    if norm == "layer":
        ln = (values((x.shape[-1],), x.dtype, seed + 1, grid=8).to(DEVICE),
              values((x.shape[-1],), x.dtype, seed + 2, grid=8).to(DEVICE), 1e-6)
    elif norm == "rms":
        kind = draw(st.integers(1, len(nrq.RMS_NORMS) - 1))
        weight = None
        if kind in nrq.RMS_WEIGHTED:
            weight_dtype = torch.float32 if nrq.RMS_NORMS[kind] == "weight_fp32" else x.dtype
            weight = values((x.shape[-1],), weight_dtype, seed + 1, grid=8).to(DEVICE)
        rms, div_sqrt = (kind, weight, 1e-6), draw(st.booleans())
    interleaved = True if pairs_in_place else draw(st.booleans())
    return (x, cos, sin, start, interleaved, *ln, *rms, fp32_pairs, div_sqrt, pairs_in_place)


@fuzzes("dsfuse::rope_cat")
@given(args=rope_cat_args())
def test_rope_cat_kernel_is_the_reference(args):
    normed = args[5] is not None or args[8] != 0
    want = reference_output(nrq.rope_cat, nrq.rope_cat_reference, *args)
    got = nrq.rope_cat_triton(*args)
    if not normed:
        assert_same(got, want, what="triton")
    else:
        # the norm's own rounding order; RoPE's a cos - b sin then cancels, so its error (an ulp of the larger
        # operand) is bounded by the largest value, not by each output (dev-profile finding: 4.8e-7 at -0.61, an
        # ulp of 4, in a tensor up to 5.7)
        assert_rel_close(got, want, NORM_TOL[args[0].dtype], what="triton")


@st.composite
def rmsnorm_rope_args(draw):
    dtype, weight_in_fp32 = draw(st.sampled_from(ROPE_DTYPES)), draw(st.booleans())
    rows, c_norm, c_rope = draw(sizes(1, 9)), draw(sizes(1, 33)), 2 * draw(sizes(1, 9))
    seed = draw(seeds())
    wide = values((rows, c_norm + c_rope + draw(st.integers(0, 3))), dtype, seed, scale=2.0,
                  specials=draw(_specials()), grid=8).to(DEVICE)
    x = wide[:, :c_norm + c_rope]  # a row slice of a wider projection output
    weight = values((c_norm,), torch.float32 if weight_in_fp32 else dtype, seed + 1, grid=8).to(DEVICE)
    cos = sin = freqs = None
    if draw(st.booleans()):  # the official complex form
        freq_rows = draw(st.sampled_from([r for r in range(1, rows + 1) if rows % r == 0]))
        freqs = _rotations((freq_rows, c_rope // 2), seed + 2).to(DEVICE)
    pairs = "none"
    if freqs is None:  # the table forms: HF's full-width tables, or one column per pair (fp32, or GPT-J's in place)
        pairs = draw(st.sampled_from(["none", "fp32_pairs", "pairs_in_place"]))
        angle = values((rows, c_rope if pairs == "none" else c_rope // 2), torch.float32, seed + 2,
                       grid=16).clamp(-1, 1)
        table_dtype = torch.float32 if pairs == "fp32_pairs" else dtype
        cos, sin = angle.to(table_dtype).to(DEVICE), angle.flip(-1).to(table_dtype).to(DEVICE)
    interleaved = True if pairs == "pairs_in_place" else draw(st.booleans())
    return (x, weight, 1e-6, cos, sin, interleaved, weight_in_fp32, freqs, draw(st.booleans()),
            pairs == "fp32_pairs", pairs == "pairs_in_place")


@fuzzes("dsfuse::rmsnorm_rope")
@given(args=rmsnorm_rope_args())
def test_rmsnorm_rope_kernel_is_the_reference(args):
    dtype = args[0].dtype
    normed, roped = reference_output(nrq.rmsnorm_rope, nrq.rmsnorm_rope_reference, *args)
    got_normed, got_roped = nrq.rmsnorm_rope_triton(*args)
    assert_same(got_normed, normed, exact=False, rtol=NORM_TOL[dtype], atol=NORM_TOL[dtype], what="triton normed")
    assert_same(got_roped, roped, what="triton roped")


MEMBERS = {"complex_rope": complex_rope_args(), "rope_cat": rope_cat_args(layer_norm=False, rms_norm=False),
           "rmsnorm_rope": rmsnorm_rope_args()}


def _outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


@fuzzes("dsfuse::norm_rope_group")
@given(data=st.data(), ops=st.lists(st.sampled_from(sorted(MEMBERS)), min_size=1, max_size=3))
def test_norm_rope_group_is_its_members(data, ops):
    """The group op is its members' ops in order; one grouped launch gives each member's own launch's outputs."""
    members = [(op, data.draw(MEMBERS[op])) for op in ops]
    lists = [nrq.group_member_lists(op, args) for op, args in members]
    tensors, ints, floats = ([v for part in lists for v in part[i]] for i in range(3))
    got = nrq.norm_rope_group(",".join(ops), tensors, ints, floats)
    want = [out for op, args in members for out in _outputs(getattr(torch.ops.dsfuse, op)(*args))]
    assert len(got) == len(want)
    for one, other in zip(got, want):
        assert_same(one, other, what="op")
    launches = {"complex_rope": nrq.complex_rope_launch, "rope_cat": nrq.rope_cat_launch,
                "rmsnorm_rope": nrq.rmsnorm_rope_launch}
    grouped = nrq.launch_blocks([launches[op](*args) for op, args in members])
    for (op, args), outputs in zip(members, grouped):
        for one, other in zip(outputs, nrq.launch_blocks([launches[op](*args)])[0]):
            assert_same(one, other, what=f"grouped {op}")


def _fp8_codes_within_one(got, want):
    got_code, want_code = got.view(torch.uint8).int().cpu(), want.view(torch.uint8).int().cpu()
    gap = ((got_code & 0x7F) - (want_code & 0x7F)).abs()
    same_sign = ((got_code >> 7) == (want_code >> 7)) | ((got_code & 0x7F) == 0) | ((want_code & 0x7F) == 0)
    assert bool((same_sign & (gap <= 1)).all()), int(gap.max())


@fuzzes("dsfuse::rope_quant_fp8")
@given(data=st.data(), interleaved=st.booleans(), ue8m0=st.booleans(), layer_norm=st.booleans())
def test_rope_quant_fp8_kernel_is_the_reference(data, interleaved, ue8m0, layer_norm):
    block = data.draw(st.sampled_from([1, 2, 4, 8, 16]))
    # finite rows only: the kernel's clamp drops NaN where torch's keeps it (a block with an Inf gets NaN codes in
    # torch, +-448 from the kernel), and the interpreter's fp8 cast drops NaN too, so a fix cannot be checked here
    x = data.draw(row_views(width=block * data.draw(st.sampled_from([1, 2, 3, 5])),
                            dtypes=(torch.float32, torch.bfloat16), finite=True))
    if x.shape[-1] < 2:
        x = torch.cat([x, x], -1)
    c_rope = 2 * data.draw(st.integers(1, x.shape[-1] // 2))
    start = data.draw(st.integers(0, x.shape[-1] - c_rope))
    seed = data.draw(seeds())
    broadcast = [data.draw(st.sampled_from([a, 1])) for a in x.shape[:-1]]
    freqs = _rotations((*broadcast, c_rope // 2), seed).to(DEVICE)
    ln = ()
    if layer_norm:
        ln = (values((x.shape[-1],), x.dtype, seed + 1, grid=8).to(DEVICE),
              values((x.shape[-1],), x.dtype, seed + 2, grid=8).to(DEVICE), 1e-6)
    q, scale = reference_output(nrq.rope_quant_fp8, nrq.rope_quant_fp8_reference, x, freqs, start, interleaved,
                                block, ue8m0, *ln)
    # the kernel's default scale rounding is the device's eager one (CUDA: amax * fp32(1/448); CPU: amax / 448), as
    # the reference's on the same device; forcing CPU's division failed on the H200 (run 39: a scale 2 ulps off)
    got_q, got_scale = nrq.rope_quant_fp8_triton(x, freqs, start, interleaved, block, ue8m0, *ln)
    if not layer_norm:
        assert_same(got_scale, scale, what="triton scale")
        assert_same(got_q.view(torch.uint8), q.view(torch.uint8), what="triton codes")
    else:  # the LayerNorm's statistics may be summed in another order: an ulp in a row moves its amax and codes
        finite = scale.isfinite()
        assert torch.equal(finite, got_scale.isfinite())
        ratio = (got_scale[finite] / scale[finite]).cpu()
        assert bool((((ratio - 1).abs() <= 1e-6) | (ue8m0 & ((ratio == 0.5) | (ratio == 2)))).all()), ratio
        same = (got_scale == scale).repeat_interleave(block, -1)  # codes of blocks with equal scales
        _fp8_codes_within_one(got_q[same], q[same])
