"""Fuzz `dsfuse::kv_compress`: the op (on CPU, its input checks then the reference) against the reference bit for bit,
and the Triton kernel (the interpreter on CPU, the kernel on CUDA) against the reference, over window counts at the
edges (none, one), both slot layouts, rope widths, dtypes, strided windows, and NaN / +-Inf / zeros / ties in kv and
the gate."""

import torch
from fuzz_support import DEVICE, SPECIALS, assert_rel_close, fuzzes, reference_output, seeds, sizes, values
from hypothesis import given
from hypothesis import strategies as st

from dsfuse.kernels import compressor as ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@st.composite
def compressor_inputs(draw):
    B, W, m = draw(st.sampled_from([1, 2])), draw(sizes(0, 5)), draw(st.sampled_from([1, 3, 4, 8]))
    D, overlap = draw(st.sampled_from([8, 16, 24])), draw(st.booleans())
    R = draw(st.sampled_from([r for r in (2, 8, D) if r <= D]))
    dtype, seed = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), draw(seeds())
    C = 2 * D if overlap else D
    kv_specials, gate_specials = (draw(st.lists(st.sampled_from(SPECIALS), max_size=1)) for _ in range(2))
    kv = values((B, W, m, C), dtype, seed, specials=kv_specials).to(DEVICE)
    gate = values((B, W, m, C), dtype, seed + 1, scale=2.0, specials=gate_specials)
    if draw(st.booleans()):  # the windows of a wider projection output
        wide = values((B, W, m, C + 5), dtype, seed + 2)
        wide[..., :C] = gate
        gate = wide[..., :C]
    g = torch.Generator().manual_seed(seed + 3)
    bias = torch.randn(m, C, generator=g).to(draw(st.sampled_from([torch.float32, dtype])))
    weight = torch.rand(D, generator=g) + 0.5
    angles = torch.rand(B, W, R // 2, generator=g) * 6.0
    return (kv, gate.to(DEVICE), bias.to(DEVICE), weight.to(DEVICE), angles.cos().to(dtype).to(DEVICE),
            angles.sin().to(dtype).to(DEVICE), 1e-6, overlap), dtype


@fuzzes("dsfuse::kv_compress")
@given(case=compressor_inputs())
def test_kv_compress(case):
    args, dtype = case
    want = reference_output(torch.ops.dsfuse.kv_compress, ops.kv_compress_reference, *args)
    assert_rel_close(ops.kv_compress_triton(*args), want, TOL[dtype], "kv_compress")
