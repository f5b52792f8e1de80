"""Block-scaled FP8 / FP4 linears: the reference is W8A8 (the dequantised weight times e4m3-rounded activations),
the Triton kernels (interpreter on CPU) give the reference's bits on the decode path (up to DECODE_MAX_ROWS rows,
grouped or not, split channel groups summed in order) and the row-tiled GEMM, opcheck, bad input; on the GPU, the
kernels and cuBLAS's block-scaled GEMM against the reference, and a CUDA-graph replay."""

import gc

import pytest
import sm90_offline
import torch

from dsfuse.kernels import fp8_linear as ops, quant_formats
from dsfuse.kernels.fp8_linear import (dequantize_weight, fp8_grouped_linear, fp8_grouped_linear_reference,
                                       fp8_grouped_linear_triton, fp8_linear, fp8_linear_reference, fp8_linear_triton,
                                       quantize_activations_triton, quantize_for_weight)
from dsfuse.kernels.quant_formats import E8M0_DTYPE, dequantized_once, quantize_activations
from dsfuse.models.quantized import quantize_fp8_weight

CPU_DTYPE = torch.float16  # the interpreter's bf16 arithmetic is not the GPU's; fp16 inputs, fp8 dots


def _fp8_weight(N, K, seed, scale_fmt="float", lead=()):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8_weight(torch.randn(*lead, N, K, generator=g) * 0.05, scale_fmt=scale_fmt)


def _fp4_weight(N, K, seed, lead=()):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (*lead, N, K // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    scales = torch.randint(118, 126, (*lead, N, K // 32), generator=g, dtype=torch.uint8).view(E8M0_DTYPE)
    return packed, scales


def _x(M, K, seed, dtype=CPU_DTYPE):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _weights(kind, N, K, seed, lead=()):
    return _fp4_weight(N, K, seed, lead) if kind == "fp4" else _fp8_weight(N, K, seed, kind, lead)


@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
def test_reference_is_the_dequantised_weight_times_fp8_rounded_activations(kind):
    """W8A8 exactly: e4m3 activations (per token and 128 channels) against the weight's exact values, in fp32."""
    x = _x(7, 320, 0, torch.float32)
    w, s = _weights(kind, 48, 320, 1)
    q, scale = quantize_activations(x, 128, pow2=kind != "float")
    rounded = (q.float().view(7, -1) * scale.repeat_interleave(128, dim=1)[:, :320])
    want = rounded @ dequantize_weight(w, s, 128, 128).t()
    torch.testing.assert_close(fp8_linear_reference(x, w, s, 128, 128), want, rtol=2e-6, atol=2e-6)


def test_activation_scales_follow_the_checkpoint_format():
    """UE8M0 checkpoints get power-of-two activation scales, fp32 ones amax * fp32(1 / 448); the floor is 1e-4."""
    x = _x(3, 256, 2, torch.float32)
    x[2, :128] = 0
    _, plain = quantize_activations(x, 128)
    _, pow2 = quantize_activations(x, 128, pow2=True)
    assert torch.equal(plain[0], x[0].view(2, 128).abs().amax(-1) * torch.tensor(1 / 448.0))
    assert torch.equal(torch.exp2(torch.log2(pow2).round()), pow2)
    assert (pow2 >= plain).all() and (pow2 < 2 * plain).all()
    assert plain[2, 0].item() == pytest.approx(1e-4 / 448)


@pytest.mark.parametrize("pow2", [False, True])
def test_triton_activation_quantisation_gives_the_references_bytes(pow2):
    x = _x(19, 300, 3) * 7
    x[4, 5], x[6, 200] = float("nan"), 1e-6
    q, s = quantize_activations_triton(x, 128, pow2)
    q_ref, s_ref = quantize_activations(x, 128, pow2=pow2)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0, equal_nan=True)


def swiglu_as_the_interpreter(gate, up, limit):
    """`moe_experts.swiglu` with silu's exp from NumPy, as Triton's interpreter computes it (torch's CPU exp may differ
    in the last fp32 bit, which a rounding to fp16 can show); fp16 and fp32 halves (the interpreter rounds those to
    nearest, as torch does)."""
    import numpy as np

    dtype = gate.dtype
    gate = gate.float()
    if limit is not None:
        gate = gate.clamp(max=limit).to(dtype).float()
        up = up.float().clamp(-limit, limit).to(dtype)
    silu = (gate / (1.0 + torch.from_numpy(np.exp(-gate.numpy())))).to(dtype).float()
    return (silu * up.float()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("pow2,dequantized", [(False, False), (True, False), (True, True)])
def test_swiglu_quantisation_is_one_pass_with_the_two_passes_bits(dtype, limit, pow2, dequantized):
    """`swiglu=(limit,)`: the gate and up halves of an expert GEMM's output [M, 2 x 300] (300 channels: a partial
    last group) quantised as SwiGLU then the quantisation give them, NaN, inf and values past the limit included."""
    h = (_x(19, 600, 9) * 3).to(dtype)
    h[2, 7], h[3, 310], h[5, 40], h[8, 450] = float("nan"), float("inf"), -float("inf"), 50.0
    fused = quantize_activations_triton(h, 128, pow2, scales_column_major=True, dequantized=dequantized,
                                        swiglu=(limit,))
    act = swiglu_as_the_interpreter(*h.chunk(2, dim=-1), limit)
    two_pass = quantize_activations_triton(act, 128, pow2, scales_column_major=True, dequantized=dequantized)
    assert fused[0].shape == (19, 300) and fused[1].stride() == two_pass[1].stride()
    assert torch.equal(fused[0].view(torch.uint8), two_pass[0].view(torch.uint8))
    torch.testing.assert_close(fused[1], two_pass[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("limit", [None, 0.75])
def test_cuda_swiglu_quantisation_gives_torchs_silu_bits(limit):
    """On the GPU the one-pass SwiGLU rounds as torch's CUDA silu (libdevice exp, IEEE division): the bits of
    `swiglu` on bf16 halves then the quantisation, over a million values."""
    from dsfuse.kernels.moe_experts import swiglu

    h = (_x(1024, 2048, 10) * 3).to(torch.bfloat16).cuda()
    fused = quantize_activations_triton(h, 128, True, scales_column_major=True, swiglu=(limit,))
    two_pass = quantize_activations_triton(swiglu(*h.chunk(2, dim=-1), limit), 128, True, scales_column_major=True)
    assert torch.equal(fused[0].view(torch.uint8), two_pass[0].view(torch.uint8))
    assert torch.equal(fused[1], two_pass[1])


@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
@pytest.mark.parametrize("M,N,K", [(1, 48, 256), (17, 40, 320), (5, 33, 64), (80, 33, 320)])
def test_triton_linear_gives_the_references_bits(kind, M, N, K):
    """Both paths: the decode path up to DECODE_MAX_ROWS rows, the row-tiled GEMM past it (80)."""
    if kind == "fp4" and K % 32:
        pytest.skip("FP4 rows are whole 32-value blocks")
    w, s = _weights(kind, N, K, M + N)
    x = _x(M, K, K)
    assert torch.equal(fp8_linear_triton(x, w, s, 128, 128), fp8_linear_reference(x, w, s, 128, 128))


@pytest.mark.parametrize("kind", ["float", "fp4"])
@pytest.mark.parametrize("S,offsets", [(30, [0, 17, 17, 20, 26]), (90, [0, 40, 40, 70, 80])])
def test_triton_grouped_linear_gives_the_references_bits_with_empty_experts_and_spare_rows(kind, S, offsets):
    """Experts with no rows, one with a tile's worth plus one, and rows past the last offset (other ranks' slots);
    30 rows take the decode path, 90 the row-tiled GEMM."""
    E, N, K = 5, 40, 256
    w, s = _weights(kind, N, K, 4, lead=(E,))
    x = _x(S, K, 5)
    got = fp8_grouped_linear_triton(x, w, s, torch.tensor(offsets, dtype=torch.int32), 128, 128)
    want = fp8_grouped_linear_reference(x, w, s, torch.tensor(offsets, dtype=torch.int32), 128, 128)
    assert torch.equal(got, want) and not got[offsets[-1]:].any()
    for e, (start, end) in enumerate(zip([0, *offsets[:-1]], offsets)):
        if end > start:
            assert torch.equal(want[start:end], fp8_linear_reference(x[start:end], w[e], s[e], 128, 128))


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("step", [64, 128])
def test_row_tiled_fp4_gives_the_references_bits_at_either_k_step(grouped, step):
    """The FP4 GEMM's row tiles with K steps of 64 (its tiles up to 128 rows) or 128 (256-row tiles), K = 320 so the
    last step is partial: the reference's bits, grouped (experts with no rows, a tile and one row) or not."""
    E, N, K, S = 4, 40, 320, 90
    w, s = _weights("fp4", N, K, 40 + step, lead=(E,) if grouped else ())
    x = _x(S, K, 41)
    out = torch.zeros((S, N), dtype=x.dtype)
    offsets = torch.tensor([0, 33, 33, 80], dtype=torch.int32) if grouped else None
    ops._gemm(*quantize_for_weight(x, w, s, 128), w, s, out, 128, 128, offsets=offsets, config=(16, 32, 4, 1, step),
              decode=False)
    want = (fp8_grouped_linear_reference(x, w, s, offsets, 128, 128) if grouped
            else fp8_linear_reference(x, w, s, 128, 128))
    assert torch.equal(out[:80] if grouped else out, want[:80] if grouped else want)


class _LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's grid (column blocks, row tiles, splits), BLOCK_M and
    whether it quantises the activations itself, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs["BLOCK_M"], kwargs.get("QUANTIZE_A", False)))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _record_decode_launches(monkeypatch, kind):
    name = "_fp4_gemm_kernel" if kind == "fp4" else "_fp8_decode_kernel"
    recorder = _LaunchRecorder(getattr(ops, name))
    monkeypatch.setattr(ops, name, recorder)
    return recorder


def _k_slices(kind, K, bounds):
    """Per channel range [k0, k1): the slices of x, the weight (FP4: bytes) and its scales (FP4: per 32)."""
    for k0, k1 in zip(bounds[:-1], bounds[1:]):
        if kind == "fp4":
            yield slice(k0, k1), slice(k0 // 2, k1 // 2), slice(k0 // 32, k1 // 32)
        else:
            yield slice(k0, k1), slice(k0, k1), slice(k0 // 128, (k1 + 127) // 128)


def _split_sums(x, w, s, kind, bounds):
    """The fp32 sums of a GEMM split at the channels `bounds` (multiples of 128): each split the reference over its
    channels, the splits added in order."""
    total = 0
    for xs, ws, ss in _k_slices(kind, x.shape[1], bounds):
        total = total + ops._linear_math(x[:, xs], w[..., ws], s[..., ss], 128, 128)
    return total


@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
@pytest.mark.parametrize("M,N,K", [(1, 70, 320), (2, 33, 448), (7, 129, 192), (16, 64, 256), (33, 65, 320),
                                   (64, 40, 160)])
def test_decode_path_gives_the_references_bits(kind, M, N, K, monkeypatch):
    """Up to DECODE_MAX_ROWS rows, one row tile (16 to 64 rows) through the decode kernel (FP8 tiles of up to 16
    rows quantise their activations in it), N and K not multiples of the tiles or the scale blocks: the
    reference's bits."""
    recorder = _record_decode_launches(monkeypatch, kind)
    w, s = _weights(kind, N, K, M + N)
    x = _x(M, K, K + M)
    assert torch.equal(fp8_linear_triton(x, w, s, 128, 128), fp8_linear_reference(x, w, s, 128, 128))
    (grid, block_m, quantises), = recorder.launches
    assert M <= ops.DECODE_MAX_ROWS and grid[1] == 1 and block_m == max(16, 1 << (M - 1).bit_length())
    assert quantises == (kind != "fp4" and block_m <= ops.DECODE_QUANTIZE_MAX_ROW_TILE)


def _activations(x, w, s, quantise_first):
    """(activations, scales) as `_gemm` takes them: quantised beforehand, or x itself (FP8: quantised in the
    kernel)."""
    return quantize_for_weight(x, w, s, 128) if quantise_first else (x, None)


@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
def test_decode_path_gives_nan_rows_for_nan_and_inf_activations(kind):
    """A NaN or an infinity in a row makes the row's scale NaN or infinite, and the row NaN, as in the reference;
    the other rows keep their values (the activations are quantised in the decode kernel)."""
    w, s = _weights(kind, 40, 256, 24)
    x = _x(4, 256, 25)
    x[1, 3], x[2, 200] = float("nan"), float("inf")
    got, want = fp8_linear_triton(x, w, s, 128, 128), fp8_linear_reference(x, w, s, 128, 128)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got[1].isnan().all() and got[2].isnan().all() and not got[[0, 3]].isnan().any()


@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
@pytest.mark.parametrize("quantise_first", [False, True])
@pytest.mark.parametrize("M,split,bounds", [(1, 2, [0, 256, 448]), (7, 4, [0, 128, 256, 384, 448]),
                                            (64, 3, [0, 256, 448])])
def test_decode_split_partials_are_summed_in_split_order(kind, quantise_first, M, split, bounds, monkeypatch):
    """Channel groups split across programs (3 splits of 4 groups become 2 of 2): each split's fp32 partials, summed
    in split order by the tile's last split program, rounded once: the bits of the reference run per split and added
    in that order; the tiles' counters are back at zero for the next call."""
    N, K = 70, 448
    recorder = _record_decode_launches(monkeypatch, kind)
    w, s = _weights(kind, N, K, M)
    x = _x(M, K, M + 1)
    out = torch.empty((M, N), dtype=x.dtype)
    ops._gemm(*_activations(x, w, s, quantise_first), w, s, out, 128, 128, split=split)
    assert recorder.launches[0][0][2] == len(bounds) - 1
    assert torch.equal(out, _split_sums(x, w, s, kind, bounds).to(x.dtype))
    assert not any(counters.any() for counters in ops._COUNTERS[out.device])


@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
@pytest.mark.parametrize("quantise_first", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_decode_grouped_gives_the_references_bits_with_empty_experts_and_spare_rows(kind, quantise_first, split,
                                                                                     monkeypatch):
    """A decode step's experts: 16 experts, most empty, one row or a few each, rows past the last offset left as
    they are (zeros here), tiles of 16 rows per expert and at most one tile per row; with split channel groups too
    (the last split program of a tile writes its computed rows; tiles past the last expert count nothing)."""
    E, N, K, S = 16, 70, 320, 12
    recorder = _record_decode_launches(monkeypatch, kind)
    w, s = _weights(kind, N, K, 20 + split, lead=(E,))
    x = _x(S, K, 21)
    offsets = torch.tensor([0, 1, 1, 1, 4, 4, 9, 10] + [10] * 8, dtype=torch.int32)
    out = torch.zeros((S, N), dtype=x.dtype)
    ops._gemm(*_activations(x, w, s, quantise_first), w, s, out, 128, 128, offsets=offsets, split=split)
    bounds = [0, 256, 320] if split == 2 else [0, 320]
    for e, (start, end) in enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist())):
        want = _split_sums(x[start:end], w[e], s[e], kind, bounds).to(x.dtype)
        assert torch.equal(out[start:end], want)
    assert not out[10:].any()
    assert not any(counters.any() for counters in ops._COUNTERS[out.device])
    (grid, block_m, quantises), = recorder.launches
    assert grid[1] <= S and block_m == ops.DECODE_EXPERT_BLOCK_M and quantises == (kind != "fp4" and not quantise_first)


# opcheck's schema test compares the inputs before and after with an op CPU lacks for float8 tensors; the fake
# against real comparison with aliasing (`check_outputs_match_fake`) stands in for it.
OPCHECK_TESTS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_ops_dispatch_to_the_reference_and_pass_opcheck():
    from dsfuse.kernels.triton_support import check_outputs_match_fake

    w, s = _fp8_weight(48, 256, 6, "ue8m0")
    x = _x(3, 256, 7).view(1, 3, 256)
    out = fp8_linear(x, w, s, 128, 128)
    assert torch.equal(out, fp8_linear_reference(x, w, s, 128, 128))
    torch.library.opcheck(fp8_linear, (x, w, s, 128, 128), test_utils=OPCHECK_TESTS)
    check_outputs_match_fake("dsfuse::fp8_linear", (x, w, s, 128, 128), {}, out)
    wg, sg = _fp4_weight(40, 256, 8, lead=(3,))
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32)
    xg = _x(6, 256, 9)
    out = fp8_grouped_linear(xg, wg, sg, offsets, 128, 128)
    assert torch.equal(out, fp8_grouped_linear_reference(xg, wg, sg, offsets, 128, 128))
    torch.library.opcheck(fp8_grouped_linear, (xg, wg, sg, offsets, 128, 128), test_utils=OPCHECK_TESTS)
    check_outputs_match_fake("dsfuse::fp8_grouped_linear", (xg, wg, sg, offsets, 128, 128), {}, out)


@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
def test_weight_dequantized_once_gives_the_exact_values_and_keeps_them_while_unchanged(kind):
    """Rounded once from the exact values; the same tensor again until the weight is written, its storage replaced
    or the weight freed (then the kept copy goes too). fp16: the interpreter rounds to bf16 unlike the GPU."""
    w, s = _weights(kind, 200, 256, 10)
    out = dequantized_once(w, s, 128, 128, CPU_DTYPE)
    assert out.dtype == CPU_DTYPE and out.shape == (200, 256)
    assert torch.equal(out, dequantize_weight(w, s, 128, 128).to(CPU_DTYPE))
    assert dequantized_once(w, s, 128, 128, CPU_DTYPE) is out
    assert dequantized_once(w, s, 128, 128, torch.float32) is not out
    w.view(torch.uint8)[0].zero_()
    written = dequantized_once(w, s, 128, 128, CPU_DTYPE)
    assert written is not out and not written[0].any()
    w.data = w.clone()
    assert dequantized_once(w, s, 128, 128, CPU_DTYPE) is not written
    kept = len(quant_formats._DEQUANTIZED)
    del w
    gc.collect()
    assert len(quant_formats._DEQUANTIZED) < kept


def test_e2m1_values_are_the_table_with_signed_zero():
    from dsfuse.kernels.quant_formats import E2M1_VALUES, e2m1_values

    got, want = e2m1_values(torch.arange(16)), torch.tensor(E2M1_VALUES)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("change,error,message", [
    (lambda w, s, x: (w, s[:, :1], x), ValueError, r"weight_scale must be \[1, 2\]"),
    (lambda w, s, x: (w.float(), s, x), TypeError, "weight must be float8_e4m3fn or FP4"),
    (lambda w, s, x: (w, s.double(), x), TypeError, "weight_scale must be float32 or E8M0"),
    (lambda w, s, x: (w, s, x[:, :100]), ValueError, "must end in K = 256"),
    (lambda w, s, x: (w, s, x.int()), TypeError, "x must be one of"),
    (lambda w, s, x: (w[:, :0], s[:, :0], x[:, :0]), ValueError, r"no input channels \(K = 0\)"),
])
def test_bad_inputs_are_refused_with_the_argument_named(change, error, message):
    w, s = _fp8_weight(48, 256, 10)
    w, s, x = change(w, s, _x(2, 256, 11))
    with pytest.raises(error, match=message):
        fp8_linear(x, w, s, 128, 128)


# --- fp8_linears: several projections of one input, the activations quantised once ------------------------------
def _projections(kind, widths, K, seed):
    """FP8 weights of one input: `widths` output columns each (not multiples of the tiles), one scale kind."""
    pairs = [_fp8_weight(N, K, seed + i, kind) for i, N in enumerate(widths)]
    return [w for w, _ in pairs], [s for _, s in pairs]


class _QuantisationCounter:
    """Stands in for `quantize_activations_triton`: counts the launches, then quantises."""

    def __init__(self, quantise):
        self.quantise, self.calls = quantise, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.quantise(*args, **kwargs)


def test_linears_are_fp8_linear_per_weight_and_pass_opcheck():
    """The op (its CPU implementation: the reference) is the list of `fp8_linear` calls, bit for bit, at any
    leading shape; opcheck, and the fake outputs against the real ones."""
    from dsfuse.kernels.fp8_linear import fp8_linears, fp8_linears_reference
    from dsfuse.kernels.triton_support import check_outputs_match_fake

    weights, scales = _projections("ue8m0", (48, 33, 129), 320, 30)
    x = _x(6, 320, 31).view(2, 3, 320)
    got = fp8_linears(x, weights, scales, [128] * len(weights), 128)
    assert len(got) == 3
    for out, w, s in zip(got, weights, scales):
        assert out.shape == (2, 3, w.shape[0]) and torch.equal(out, fp8_linear(x, w, s, 128, 128))
    assert all(torch.equal(a, b) for a, b in zip(got, fp8_linears_reference(x, weights, scales, [128] * 3, 128)))
    torch.library.opcheck(fp8_linears, (x, weights, scales, [128] * 3, 128), test_utils=OPCHECK_TESTS)
    check_outputs_match_fake("dsfuse::fp8_linears", (x, weights, scales, [128] * 3, 128), {}, got)


@pytest.mark.parametrize("kind,M,launches", [("ue8m0", 5, 0), ("float", 40, 1), ("ue8m0", ops.DECODE_MAX_ROWS + 6, 1)])
def test_triton_linears_give_each_linears_bits_from_one_quantisation(kind, M, launches, monkeypatch):
    """Through the interpreter, `fp8_linear_triton`'s bits per weight: at 5 rows each decode kernel quantises its own
    rows (no launch), at 40 (the decode kernel on rows quantised first) and past DECODE_MAX_ROWS (the row-tiled
    GEMM) one quantisation feeds every GEMM, where a call per weight quantises once per weight."""
    from dsfuse.kernels.fp8_linear import fp8_linears_triton

    weights, scales = _projections(kind, (48, 33, 70), 320, M)
    x = _x(M, 320, M + 1)
    counter = _QuantisationCounter(ops.quantize_activations_triton)
    monkeypatch.setattr(ops, "quantize_activations_triton", counter)
    got = fp8_linears_triton(x, weights, scales, [128] * 3, 128)
    assert counter.calls == launches
    for out, w, s in zip(got, weights, scales):
        assert torch.equal(out, fp8_linear_triton(x, w, s, 128, 128))
    assert counter.calls == launches + (3 if launches else 0)


@pytest.mark.parametrize("E,rows,block_m", [(1, 1, 16), (5, 3, 16), (8, 300, 16), (37, 1000, 64), (256, 64, 16)])
def test_grouped_tile_list_is_one_launch_with_the_torch_ops_tiles(E, rows, block_m):
    """A grouped call's tile list from its running row totals (`_offset_tiles`, one Triton launch) is the torch ops'
    (`_expert_row_tiles`): running totals that fall, go negative or pass the rows included (clamped, a running
    maximum), tiles left over given expert E."""
    g = torch.Generator().manual_seed(E + rows)
    offsets = torch.randint(0, rows + 1, (E,), generator=g).sort().values.to(torch.int32)
    offsets[E // 2:E // 2 + 1] = -3
    offsets[-1:] = rows + 5 if E > 2 else offsets[-1:]
    want, want_count = ops._expert_row_tiles(offsets, rows, block_m)
    got, count = ops._offset_tiles(offsets, rows, block_m)
    assert count == want_count and all(a.dtype == torch.int32 for a in got)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("kind,widths,runs", [("ue8m0", (48, 33, 70), [3]), ("float", (200, 40), [3]),
                                              ("ue8m0", (48, 33, 70, 130), [3, 2])])
@pytest.mark.parametrize("sms", [0, 8])
def test_decode_linears_are_one_launch_for_up_to_three_weights(kind, widths, runs, sms, monkeypatch):
    """At decode sizes `fp8_linears` streams up to three weights in one launch of `_fp8_decode_weights_kernel` (its
    column blocks the weights' in turn: `runs` counts them a launch), block heights per weight (64 for the second),
    K not a multiple of the channel group, and with `sms` 8 the channel groups split as on a GPU (each tile's last
    program sums the partials): `fp8_linear_triton`'s bits per weight."""
    from dsfuse.kernels.fp8_linear import fp8_linears_triton

    weights, scales = _projections(kind, widths, 320, 60)
    scales[1] = scales[1].repeat_interleave(2, dim=0)[:-(-widths[1] // 64)]
    block_ns = [128, 64] + [128] * (len(widths) - 2)
    x = _x(3, 320, 61)
    monkeypatch.setattr(ops, "_sm_count", lambda device: sms)
    want = [fp8_linear_triton(x, w, s, bn, 128) for w, s, bn in zip(weights, scales, block_ns)]
    kernel, grids = ops._fp8_decode_weights_kernel, []

    class CountedLaunches:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(ops, "_fp8_decode_weights_kernel", CountedLaunches())
    got = fp8_linears_triton(x, weights, scales, block_ns, 128)
    assert [grid[0] for grid in grids] == runs and all(grid[2] == (3 if sms else 1) for grid in grids), grids
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_triton_linears_feed_cublas_and_triton_gemms_from_one_padded_quantisation(monkeypatch):
    """Past SCALED_MM_MIN_ROWS, weights that go to cuBLAS read the quantisation in its padded layout (rows to a
    multiple of 4, column-major scales) and the others' Triton GEMM reads the same one: each output is
    `fp8_linear_triton`'s. On the CPU, cuBLAS's GEMM is stood in for by the Triton GEMM on the padded (q, s)."""
    from dsfuse.kernels.fp8_linear import fp8_linears_triton

    seen = []

    def scaled_mm_stand_in(q, s, weight, scale, rows, out_dtype):
        seen.append((q.shape[0], s.stride()))
        out = torch.empty((q.shape[0], weight.shape[0]), dtype=out_dtype)
        ops._gemm(q, s, weight, scale, out, 128, 128)
        return out[:rows]

    monkeypatch.setattr(ops, "_goes_to_cublas", lambda x2, weight, block_n, block_k: weight.shape[0] % 16 == 0)
    monkeypatch.setattr(ops, "_scaled_mm_quantized", scaled_mm_stand_in)
    weights, scales = _projections("ue8m0", (48, 33, 64), 256, 50)
    x = _x(ops.DECODE_MAX_ROWS + 7, 256, 51)
    counter = _QuantisationCounter(ops.quantize_activations_triton)
    monkeypatch.setattr(ops, "quantize_activations_triton", counter)
    got = fp8_linears_triton(x, weights, scales, [128] * 3, 128)
    assert counter.calls == 1 and seen == [(72, (1, 72))] * 2
    for out, w, s in zip(got, weights, scales):
        assert torch.equal(out, fp8_linear_triton(x, w, s, 128, 128))
        assert torch.equal(out, fp8_linear_reference(x, w, s, 128, 128))


@pytest.mark.parametrize("change,error,message", [
    (lambda ws, ss, x: ([], [], x), ValueError, "fp8_linears: weights is empty"),
    (lambda ws, ss, x: ([ws[0], _fp4_weight(40, 256, 3)[0]], [ss[0], _fp4_weight(40, 256, 3)[1]], x), TypeError,
     r"fp8_linears: weights\[1\] is FP4"),
    (lambda ws, ss, x: (ws, [ss[0], _fp8_weight(40, 256, 4, "ue8m0")[1]], x), TypeError,
     r"fp8_linears: weight_scales mix float32 \(weight_scales\[0\]\) and E8M0 \(weight_scales\[1\]\)"),
    (lambda ws, ss, x: ([ws[0], ws[1][:, :128]], [ss[0], ss[1][:, :1]], x), ValueError,
     r"fp8_linears: weights\[1\] has K = 128, weights\[0\] K = 256"),
    (lambda ws, ss, x: (ws, ss[:1], x), ValueError, "fp8_linears: weight_scales has 1 entries for 2 weights"),
    (lambda ws, ss, x: (ws, [ss[0], ss[1][:, :1]], x), ValueError,
     r"fp8_linears: weights\[1\] / weight_scales\[1\]: weight_scale must be \[1, 2\]"),
    (lambda ws, ss, x: (ws, ss, x[:, :100]), ValueError, "fp8_linears: x .* must end in K = 256"),
])
def test_linears_refuse_bad_inputs_naming_the_argument(change, error, message):
    from dsfuse.kernels.fp8_linear import fp8_linears

    weights, scales = _projections("float", (48, 40), 256, 10)
    weights, scales, x = change(weights, scales, _x(2, 256, 11))
    with pytest.raises(error, match=message):
        fp8_linears(x, weights, scales, [128] * len(weights), 128)


def test_weight_quantisation_round_trips_within_the_e4m3_step():
    g = torch.Generator().manual_seed(12)
    weight = torch.randn(3, 200, 300, generator=g)
    for scale_fmt in ("float", "ue8m0"):
        q, s = quantize_fp8_weight(weight, scale_fmt=scale_fmt)
        assert q.shape == weight.shape and s.shape == (3, 2, 3)
        back = dequantize_weight(q, s, 128, 128)
        assert ((back - weight).abs() <= weight.abs() * 2**-4 + 1e-3).all()


# --------------------------------------------------------------------------------------------
# GPU (H200)
# --------------------------------------------------------------------------------------------
def _rel(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
@pytest.mark.parametrize("M", [1, 7, 64, 129, 1024])
def test_cuda_linear_matches_the_reference(kind, M):
    """Triton (M < 128, FP4) or cuBLAS's block-scaled GEMM (FP8 from 128 rows): the reference's sums up to the
    order inside a 128-channel group (the fp8 MMA's own accumulation: within 1e-2 of the largest output)."""
    N, K = 1536, 2048
    w, s = (t.cuda() for t in _weights(kind, N, K, M))
    x = _x(M, K, M, torch.bfloat16).cuda()
    got = fp8_linear(x, w, s, 128, 128)
    want = fp8_linear_reference(x, w, s, 128, 128)
    assert got.shape == want.shape and not got.isnan().any()
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float", "ue8m0"])
@pytest.mark.parametrize("M", [1, 40, 129, 1024])
def test_cuda_linears_give_each_linears_bits(kind, M):
    """On the GPU, `fp8_linears` is `fp8_linear` per weight bit for bit where a call per weight runs the same
    programs: at 40 rows (the decode kernel on rows quantised once) and past SCALED_MM_MIN_ROWS (one padded
    quantisation read by cuBLAS, widths multiples of 16, and by the Triton GEMM: 576 + 8 columns, which cuBLAS's path
    does not take). At one row the three weights are one launch, whose channel groups split by all their columns:
    the same sums in another fp32 order."""
    from dsfuse.kernels.fp8_linear import fp8_linears

    weights, scales = _projections(kind, (1536, 584, 128), 2048, M)
    weights, scales = [w.cuda() for w in weights], [s.cuda() for s in scales]
    x = _x(M, 2048, M, torch.bfloat16).cuda()
    for out, w, s in zip(fp8_linears(x, weights, scales, [128] * 3, 128), weights, scales):
        want = fp8_linear(x, w, s, 128, 128)
        assert torch.equal(out, want) if M > 1 else _rel(out, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float", "fp4"])
def test_cuda_grouped_linear_matches_the_reference_and_replays_in_a_cuda_graph(kind):
    E, N, K, S = 8, 512, 1024, 300
    w, s = (t.cuda() for t in _weights(kind, N, K, 13, lead=(E,)))
    x = _x(S, K, 14, torch.bfloat16).cuda()
    offsets = torch.tensor([10, 10, 80, 81, 150, 200, 260, 290], dtype=torch.int32, device="cuda")
    want = fp8_grouped_linear_reference(x, w, s, offsets, 128, 128)
    got = fp8_grouped_linear(x, w, s, offsets, 128, 128)
    assert _rel(got, want) < 1e-2 and not got[290:].any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp8_grouped_linear(x, w, s, offsets, 128, 128)
    x.copy_(_x(S, K, 15, torch.bfloat16))
    graph.replay()
    assert _rel(replayed, fp8_grouped_linear_reference(x, w, s, offsets, 128, 128)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float", "ue8m0", "fp4"])
def test_cuda_decode_path_with_split_groups_replays_in_a_cuda_graph(kind):
    """The decode path under capture: one row through a weight whose columns alone are too few programs (channel
    groups split, the partials summed by each tile's last split program) and a decode step's grouped call (8 rows,
    one each for 8 of 64 experts, rows past the last offset zero)."""
    E = 64
    w, s = (t.cuda() for t in _weights(kind, 512, 4096, 18))
    wg, sg = (t.cuda() for t in _weights(kind, 256, 512, 19, lead=(E,)))
    counts = torch.zeros(E, dtype=torch.int32)
    counts[[3, 10, 17, 24, 31, 38, 45, 52]] = 1
    offsets = counts.cumsum(0, dtype=torch.int32).cuda()
    x, xg = _x(1, 4096, 20, torch.bfloat16).cuda(), _x(10, 512, 21, torch.bfloat16).cuda()

    def both():
        return fp8_linear(x, w, s, 128, 128), fp8_grouped_linear(xg, wg, sg, offsets, 128, 128)

    both()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got, got_grouped = both()
    x.copy_(_x(1, 4096, 22, torch.bfloat16))
    xg.copy_(_x(10, 512, 23, torch.bfloat16))
    graph.replay()
    assert _rel(got, fp8_linear_reference(x, w, s, 128, 128)) < 1e-2
    assert _rel(got_grouped, fp8_grouped_linear_reference(xg, wg, sg, offsets, 128, 128)) < 1e-2
    assert not got_grouped[8:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ue8m0", "fp4"])
def test_cuda_weight_dequantized_once_in_and_out_of_a_cuda_graph(kind):
    """No copy from the host inside (FP4 decodes its codes from the bits): a CUDA graph captures it. A copy kept
    before the capture is read by the graph as it is; one made during a capture is not kept."""
    w, s = (t.cuda() for t in _weights(kind, 256, 512, 11))
    want = dequantize_weight(w.cpu(), s.cpu(), 128, 128).to(torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dequantized_once(w, s, 128, 128, torch.bfloat16)
    graph.replay()
    kept = dequantized_once(w, s, 128, 128, torch.bfloat16)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert dequantized_once(w, s, 128, 128, torch.bfloat16) is kept
    assert kept is not captured and dequantized_once(w, s, 128, 128, torch.bfloat16) is kept
    torch.cuda.synchronize()
    assert torch.equal(captured.cpu(), want) and torch.equal(kept.cpu(), want)


@pytest.mark.gpu
def test_cuda_nan_and_inf_activations_give_nan_rows():
    w, s = (t.cuda() for t in _fp8_weight(256, 256, 16))
    x = _x(4, 256, 17, torch.bfloat16).cuda()
    x[1, 3], x[2, 200] = float("nan"), float("inf")
    got = fp8_linear(x, w, s, 128, 128)
    assert got[1].isnan().all() and got[2].isnan().all() and not got[[0, 3]].isnan().any()


# Runs in a subprocess without TRITON_INTERPRET: the FP4 GEMM's row tiles as `_tile_config` picks them by an expert's
# rows (V4-Flash's expert up: 256 experts, 4096 -> 2 x 2048, T=8192 top-6), compiled for sm_90 down to the cubin.
FP4_GEMM_SM90_SCRIPT = sm90_offline.PROBE_PREAMBLE + r"""
import dsfuse.kernels.fp8_linear as ops

H, I, ROWS = 4096, 2048, 8192 * 6
POINTERS = {"a_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16"}
ints = dict(M=ROWS, N=2 * I, K=H, num_experts=256, k_per_split=H, sw_e=2 * I * H // 2, sw_n=H // 2,
            sws_e=2 * I * H // 32, sws_n=H // 32, so_m=2 * I, so_n=1, splits=1, sp_k=0)
for rows_per_expert in (64, 128, 192):
    BM, BN, warps, stages, *step = ops._gemm_config(rows_per_expert * 256, ops.torch.empty(1, dtype=ops.torch.int8), 256)
    kernel = sm90_offline.compile_sm90(
        ops._fp4_gemm_kernel, dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=step[0] if step else ops.FP4_BLOCK_K,
                                   SPLIT_PARTIALS=False, GATHER_A=True, DECODE_ASM=True, GROUPED=True),
        ints, dict(num_warps=warps, num_stages=stages), lambda name: POINTERS.get(name, "*i32"))
    print(json.dumps({"rows": rows_per_expert, "tile": [BM, BN, warps, stages, *step],
                      "shared": kernel.metadata.shared, "wgmma": "wgmma.mma_async" in kernel.asm["ptx"]}), flush=True)
"""


def test_fp4_row_tiles_compile_for_sm90():
    """Each FP4 row tile the table picks by an expert's rows compiles for sm_90 with the installed Triton (ptxas:
    registers) within an SM's 227 KB of shared memory, on wgmma; past 128 rows an expert, one 256-row tile with K
    steps of 128."""
    lines = sm90_offline.run_probe(FP4_GEMM_SM90_SCRIPT, timeout=300, env_defaults={"TRITON_DEFAULT_FP_FUSION": "1"})
    tiles = {line["rows"]: line["tile"] for line in lines}
    assert tiles[192] == [256, 128, 8, 3, 128] and tiles[128][0] == 128 and tiles[64][0] == 64, tiles
    assert all(line["wgmma"] and line["shared"] <= 227 * 1024 for line in lines), lines


# The decode paths with split channel groups (a decode step's o_proj through FP8 weights, its FP4 experts), compiled for
# sm_90: the last split program of a tile sums the partials, after an acquire-release count.
SPLIT_SM90_SCRIPT = sm90_offline.PROBE_PREAMBLE + r"""
import dsfuse.kernels.fp8_linear as ops

POINTERS = {"q_ptr": "*bf16", "a_ptr": "*bf16", "s_ptr": "*fp32", "ws_ptr": "*u8", "out_ptr": "*bf16",
            "part_ptr": "*fp32", "x_ptr": "*bf16"}
POINTERS.update({f"{name}{i}_ptr": kind for i in range(3) for name, kind in
                 (("w", "*fp8e4nv"), ("ws", "*u8"), ("out", "*bf16"), ("part", "*fp32"))})
N, K, ROWS = 7168, 16384, 16
BN, warps, stages, _, _ = ops._decode_config(False, 16)
common = dict(M=ROWS, N=N, K=K, num_experts=1, so_m=N, so_n=1, splits=4, sp_k=ROWS * N, sw_e=N * K, sws_e=8192)
kernels = {
    "fp8": (ops._fp8_decode_kernel, dict(BLOCK_M=16, BLOCK_N=BN, BLOCK_K=128, EVEN_K=True, E8M0_SCALES=True,
                                         SPLIT_PARTIALS=True, GATHER_A=False, GROUPED=False, QUANTIZE_A=True,
                                         POW2=True, MANUAL_FP8_RNE=False),
            dict(G=K // 128, groups_per_split=K // 512, ss_m=0, ss_g=0, sw_n=K, sw_k=1, sws_n=K // 128, sws_k=1,
                 sx_m=K, sx_k=1, block_n_scale=128), warps, stages, "*fp8e4nv"),
    "fp4": (ops._fp4_gemm_kernel, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_PARTIALS=True, GATHER_A=True,
                                       DECODE_ASM=True, GROUPED=True),
            dict(k_per_split=K // 4, sw_n=K // 2, sws_n=K // 32), 4, 4, "*u8"),
    "fp8 weights": (ops._fp8_decode_weights_kernel, dict(BLOCK_M=16, BLOCK_N=BN, BLOCK_K=128, EVEN_K=True,
                                                         E8M0_SCALES=True, SPLIT_PARTIALS=True, POW2=True,
                                                         MANUAL_FP8_RNE=False),
                    dict(N0=1536, N1=576, N2=128, columns0=12, columns1=5, G=K // 128, groups_per_split=K // 512,
                         sw0_n=K, sw1_n=K, sw2_n=K, sws0_n=K // 128, sws1_n=K // 128, sws2_n=K // 128,
                         block_n0=128, block_n1=128, block_n2=128, sx_m=K, sx_k=1), warps, stages, "*fp8e4nv"),
}
tiles = sm90_offline.compile_sm90(ops._offset_tiles_kernel, dict(BLOCK_M=16, E_PAD=64, CHUNK=32),
                                  dict(E=64, rows=48, count=48), dict(num_warps=4), lambda name: "*i32")
print(json.dumps({"kind": "tile list", "shared": tiles.metadata.shared}), flush=True)
for kind, (fn, constexprs, ints, warps, stages, weight) in kernels.items():
    types = {**POINTERS, "w_ptr": weight}
    kernel = sm90_offline.compile_sm90(fn, constexprs, {**common, **ints}, dict(num_warps=warps, num_stages=stages),
                                       lambda name: types.get(name, "*i32"))
    ptx = kernel.asm["ptx"]
    print(json.dumps({"kind": kind, "acq_rel": "atom.global.gpu.acq_rel.add" in ptx,
                      "l2_loads": "ld.global.cg" in ptx, "atoms": ptx.count("atom.")}), flush=True)
"""


def test_split_partials_are_summed_by_the_last_program_on_sm90():
    """The decode kernels with split channel groups (one weight, or a decode step's q_a, kv_a and wk in one launch)
    compile for sm_90 with the installed Triton: each split counts itself in with an acquire-release atomic, and the
    last one reads the partials past L1 (no stale lines). A grouped call's tile list kernel compiles as well."""
    lines = sm90_offline.run_probe(SPLIT_SM90_SCRIPT, timeout=300, env_defaults={"TRITON_DEFAULT_FP_FUSION": "1"})
    assert {line["kind"] for line in lines} == {"fp8", "fp4", "fp8 weights", "tile list"}, lines
    split = [line for line in lines if line["kind"] != "tile list"]
    assert all(line["acq_rel"] and line["l2_loads"] and line["atoms"] >= 2 for line in split), lines

