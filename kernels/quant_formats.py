"""The number formats of released DeepSeek checkpoints, for the kernels: FP8 e4m3 activations and weights with
per-block scales (fp32, or UE8M0 powers of two), and FP4 E2M1 weights with E8M0 scales per 32 values.

    fp8 activation block   s = max(amax, 1e-4) / 448, rounded up to a power of two for UE8M0 checkpoints;
                           q = e4m3(x * (1 / s))  (DeepGEMM's `per_token_cast_to_fp8`; with a power-of-two scale
                           the reciprocal is exact and it is the official inference code's `x / s`)
    fp8 weight block       w = e4m3 * s, one s per `block_size` (128 x 128) block
    fp4 weight             w = E2M1[nibble] * 2^(e8m0 - 127), low nibble first, one E8M0 byte per 32 values

The reference implementations of the quantised ops read these; the models' own copies of the same math (in
`dsfuse.models.official`) are kept apart on purpose: that model is an independent spelling the passes are tested
against.
"""

from __future__ import annotations

import threading
import weakref

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_INV_MAX = float(torch.tensor(1.0) / FP8_MAX)  # the fp32 reciprocal CUDA multiplies by for `amax / 448`
FP8_AMAX_FLOOR = 1e-4
FP8_BLOCK = 128
FP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Decode at most this many FP4 weight elements at once (eager mode must not hold a real expert stack in fp32).
DEQUANT_CHUNK_ELEMENTS = 1 << 28


def is_e8m0(scales: torch.Tensor) -> bool:
    return E8M0_DTYPE is not None and scales.dtype == E8M0_DTYPE


def scales_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """Block scales as fp32: fp32 as they are; E8M0 (`torch.float8_e8m0fnu`, or its bytes as uint8) as `2^(byte -
    127)`, byte 255 as NaN."""
    if scales.dtype == torch.float32:
        return scales
    if is_e8m0(scales):
        scales = scales.view(torch.uint8)
    if scales.dtype != torch.uint8:
        raise TypeError(f"block scales must be float32 or E8M0, got {scales.dtype}")
    # built from the exponent bits (byte 0: the subnormal 2^-127), exact on every device: CUDA's exp2 is only
    # promised to within 2 ulp
    bits = torch.where(scales == 0, 0x00400000, scales.int() << 23)
    powers = bits.view(torch.float32)
    return torch.where(scales == E8M0_NAN, torch.full_like(powers, float("nan")), powers)


def power_of_two_ceil_exact(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each positive normal fp32 `scale` (NaN and Inf kept), from its bits
    (`power_of_two_ceil` in a kernel); `exp2(ceil(log2(s)))` can miss by one binade where log2 rounds to an
    integer."""
    bits = scale.view(torch.int32)
    up = ((bits & 0x7F800000) + 0x00800000).view(torch.float32)
    return torch.where(((bits & 0x007FFFFF) == 0) | scale.isnan(), scale, up)


def quantize_activations(x: torch.Tensor, block: int = FP8_BLOCK, pow2: bool = False, reciprocal: bool = True):
    """`x [..., K]` to (`q [..., K]` e4m3, `s [..., ceil(K / block)]` fp32): one scale per row and `block` channels
    (a last group of fewer channels when `block` does not divide K). With `reciprocal` (dsfuse's linears, as
    DeepGEMM on CUDA) s = amax * fp32(1 / 448) and q = x * (1 / s); without it (the official inference code's
    indexer, as it computes on CPU) s = amax / 448 and q = x / s. With `pow2` s is rounded up to a power of two."""
    K = x.shape[-1]
    groups = -(-K // block)
    padded = torch.nn.functional.pad(x.float(), (0, groups * block - K)).unflatten(-1, (groups, block))
    amax = padded.abs().amax(dim=-1).clamp(min=FP8_AMAX_FLOOR)
    scale = amax * FP8_INV_MAX if reciprocal else amax / FP8_MAX
    if pow2:
        scale = power_of_two_ceil_exact(scale) if reciprocal else torch.exp2(torch.ceil(torch.log2(scale)))
    scaled = padded * (1.0 / scale).unsqueeze(-1) if reciprocal else padded / scale.unsqueeze(-1)
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2)[..., :K], scale


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP4 weights `packed [..., N, K // 2]` (uint8 or int8 bytes, low nibble = even element) with `scales [..., N,
    K // 32]` (E8M0 bytes) to `dtype`: exact in fp32, rounded once. Large stacks are decoded a few experts at a
    time (a static split: compiled graphs stay single)."""
    packed, scales = packed.view(torch.uint8), scales.view(torch.uint8)
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * FP4_BLOCK != packed.shape[-1] * 2:
        raise ValueError(f"FP4 scales {tuple(scales.shape)} do not match packed weights {tuple(packed.shape)}")
    if packed.dim() == 3:
        per_chunk = max(1, DEQUANT_CHUNK_ELEMENTS // max(2 * packed[0].numel(), 1))
        if packed.shape[0] > per_chunk:
            chunks = zip(packed.split(per_chunk), scales.split(per_chunk), strict=True)
            return torch.cat([_dequantize_fp4_chunk(p, s, dtype) for p, s in chunks])
    return _dequantize_fp4_chunk(packed, scales, dtype)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15) as fp32 `E2M1_VALUES`, computed from the bits on the codes' device (no table copied from
    the host, so a CUDA graph captures it): exponent e and mantissa bit m give m / 2 for e = 0, else
    2^(e - 1) * (1 + m / 2); bit 3 is the sign."""
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).float()
    power = torch.bitwise_left_shift(torch.ones_like(exponent), (exponent - 1).clamp(min=0)).float()  # exact
    magnitude = torch.where(exponent == 0, mantissa * 0.5, power * (1 + mantissa * 0.5))
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def _dequantize_fp4_chunk(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    values = e2m1_values(codes.int()).unflatten(-1, (-1, FP4_BLOCK)) * scales_to_float32(scales).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


FP8_WEIGHT_ARGUMENTS = ("weight", "weight_scale", "block_n", "block_k")


def check_fp8_weight(op: str, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                     names: tuple[str, str, str, str] = FP8_WEIGHT_ARGUMENTS, lead: tuple[int, ...] = (),
                     block_k_multiple: int = 1) -> None:
    """Raise unless `weight` is an e4m3 `[*lead, N, K]` weight with float32 or E8M0 block scales `[*lead,
    ceil(N / block_n), ceil(K / block_k)]`, the blocks positive and `block_k` a multiple of `block_k_multiple` (what
    a kernel's K steps need). The errors name `op` and its own arguments: `names` are those of the weight, its scales
    and the two block sizes."""
    w, s, bn, bk = names
    rank = 2 + len(lead)
    if weight.dtype != FP8_DTYPE or weight.dim() != rank:
        raise TypeError(f"{op}: with {s}, {w} must be a {rank}-D {FP8_DTYPE} weight, got {weight.dtype} "
                        f"{tuple(weight.shape)}")
    if block_n < 1 or block_k < 1 or block_k % block_k_multiple:
        multiple = f" with {bk} a multiple of {block_k_multiple}" if block_k_multiple > 1 else ""
        raise ValueError(f"{op}: {bn} and {bk} must be positive{multiple}, got [{block_n}, {block_k}]")
    N, K = weight.shape[-2:]
    want = (*lead, -(-N // block_n), -(-K // block_k))
    if tuple(scale.shape) != want:
        raise ValueError(f"{op}: {s} must be {list(want)} for {w} {tuple(weight.shape)} with blocks [{block_n}, "
                         f"{block_k}], got {tuple(scale.shape)}")
    if not (scale.dtype == torch.float32 or is_e8m0(scale)):
        raise TypeError(f"{op}: {s} must be float32 or E8M0, got {scale.dtype}")


def dequantize_fp8_blocks(weight: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """`weight [..., N, K]` e4m3 with `scales [..., ceil(N / block_n), ceil(K / block_k)]` to fp32 (exact)."""
    N, K = weight.shape[-2:]
    s = scales_to_float32(scales).repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)
    return weight.float() * s[..., :N, :K]


# Exact roundings for kernels (Triton's own can differ: see each)
@triton.jit
def round_to_e4m3_grid(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: the interpreter's
    fp32 -> fp8 cast mis-rounds values that round up across a power of two (the GPU's `cvt.rn` does not)."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude_bits = bits & 0x7FFFFFFF
    normal = ((magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0) * 0.001953125  # multiples of 2^-9, RNE by the add
    rounded = tl.where(magnitude < 0.015625, subnormal, normal)
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(v):
    """The e4m3fn byte of `v`, an fp32 value already on the e4m3 grid (`round_to_e4m3_grid`, |v| <= 448) or NaN:
    what the GPU's conversion gives, built from the bits, for Triton's interpreter, whose fp8 cast turns NaN, Inf
    and values it should round across a binade into other numbers."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint32)
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 120
    normal = (exponent << 3) | ((bits >> 20) & 7).to(tl.int32)
    magnitude = tl.abs(v)
    subnormal = (magnitude * 512.0).to(tl.int32)  # multiples of 2^-9 below 2^-6: exact
    byte = tl.where(magnitude < 0.015625, subnormal, normal)
    byte = tl.where(v != v, 0x7F, byte)
    return (byte.to(tl.uint32) | sign).to(tl.uint8)


@triton.jit
def e2m1_to_float(nibble):
    """E2M1 code (int32, 0..15; higher bits must be zero) -> its value as fp32, exactly.

    Sign to fp16 bit 15, the 3 magnitude bits to bits 9-11: that fp16 is `value * 2^-14` exactly (codes 0/1 land
    on zero/subnormal, the sign gives -0); widening is exact and so is `* 2^14`.
    """
    half_bits = (((nibble & 8) << 12) | ((nibble & 7) << 9)).to(tl.int16)
    return half_bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_to_float(scale_byte):
    """E8M0 byte -> fp32 `2^(byte - 127)` built from bits: byte 0 is the subnormal 2^-127, byte 255 is NaN."""
    scale_int = scale_byte.to(tl.int32)
    scale_bits = tl.where(scale_int == 0, 0x00400000, scale_int << 23)
    scale_bits = tl.where(scale_int == 255, 0x7FC00000, scale_bits)
    return scale_bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_float(byte):
    """e4m3fn byte (any integer type) -> its value as fp32, exactly, from the bits: the same on the GPU and in the
    interpreter (whose fp8 loads and casts differ), -0 and NaN (exponent and mantissa all ones) kept."""
    bits = byte.to(tl.uint32) & 0xFF
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    sign = (bits & 0x80) << 24
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    # m * 2^-9, signed through its bit (triton 3.6's interpreter negates 0.0 to +0.0)
    subnormal = mantissa.to(tl.float32) * 0.001953125
    subnormal = (subnormal.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((exponent == 15) & (mantissa == 7), float("nan"), value)


@triton.jit
def _dequantize_weight_kernel(w_ptr, s_ptr, out_ptr, N, K, block_n, block_k, sw_e, sw_n, ss_e, ss_n, ss_g, so_e, so_n,
                              FP4: tl.constexpr, E8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of one stacked weight: code -> fp32 value, times its block's scale (exact for
    power-of-two scales, one fp32 rounding for fp32 scales, as the reference's multiply), stored in out's dtype."""
    e = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (rows[:, None] < N) & (cols[None, :] < K)
    if FP4:  # two codes a byte, low nibble first; one scale per row and FP4_BLOCK channels
        byte = tl.load(w_ptr + e * sw_e + rows[:, None] * sw_n + cols[None, :] // 2, mask=inside, other=0)
        value = e2m1_to_float((byte.to(tl.int32) >> ((cols[None, :] % 2) * 4)) & 15)
        scale_at = rows[:, None] * ss_n + (cols[None, :] // 32) * ss_g
    else:
        byte = tl.load(w_ptr + e * sw_e + rows[:, None] * sw_n + cols[None, :], mask=inside, other=0)
        value = e4m3_to_float(byte)
        scale_at = (rows[:, None] // block_n) * ss_n + (cols[None, :] // block_k) * ss_g
    scale = tl.load(s_ptr + e * ss_e + scale_at, mask=inside, other=1)
    scale = e8m0_to_float(scale) if E8M0 else scale.to(tl.float32)
    tl.store(out_ptr + e * so_e + rows[:, None] * so_n + cols[None, :], (value * scale).to(out_ptr.dtype.element_ty),
             mask=inside)


def dequantize_weight_triton(weight: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int,
                             dtype: torch.dtype) -> torch.Tensor:
    """A block-scaled e4m3 weight `[..., N, K]` (scales `[..., ceil(N / block_n), ceil(K / block_k)]`) or FP4 weight
    `[..., N, K / 2]` (E8M0 scales `[..., N, K / 32]`) in `dtype`, in one pass over the bytes: the torch form makes
    three fp32 copies of the weight, which on a decode step costs more than the attention it feeds."""
    fp4 = weight.dtype in (torch.int8, torch.uint8)
    N, width = weight.shape[-2:]
    K = width * 2 if fp4 else width
    w3 = weight.view(torch.uint8).reshape(-1, N, width)
    e8m0 = scales.dtype != torch.float32
    if e8m0 and not (is_e8m0(scales) or scales.dtype == torch.uint8):
        raise TypeError(f"block scales must be float32 or E8M0, got {scales.dtype}")
    s3 = (scales.view(torch.uint8) if e8m0 else scales).reshape(-1, *scales.shape[-2:])
    out = torch.empty((w3.shape[0], N, K), dtype=dtype, device=weight.device)
    BLOCK_N, BLOCK_K = 32, 128
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(K, BLOCK_K), w3.shape[0])
    _dequantize_weight_kernel[grid](w3, s3, out, N, K, block_n, block_k, w3.stride(0), w3.stride(1), s3.stride(0),
                                    s3.stride(1), s3.stride(2), out.stride(0), out.stride(1), FP4=fp4, E8M0=e8m0,
                                    BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out.reshape(*weight.shape[:-2], N, K)


# (id(weight), id(scales), blocks, dtype) -> (weakrefs to the weight and the scales, what identifies their contents,
# the dequantised weight)
_DEQUANTIZED: dict[tuple, tuple] = {}


def _contents(weight: torch.Tensor, scales: torch.Tensor) -> tuple:
    """What changes when a tensor is written or its storage replaced (`param.data = ...`)."""
    return weight.data_ptr(), weight._version, scales.data_ptr(), scales._version


def _dequantized_outside_graph_pools(weight: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int,
                                     dtype: torch.dtype) -> torch.Tensor:
    """Dequantise on a thread of its own, on a side stream the caller's stream then waits for: a CUDA-graph tree's
    warmup routes every allocation of the calling thread, on any stream, to its memory pool, and a kept copy there
    fails the tree's check that all live pool memory is its outputs."""
    current = torch.cuda.current_stream(weight.device)
    made: dict[str, object] = {}

    def work() -> None:
        try:
            with torch.cuda.device(weight.device):
                side = torch.cuda.Stream(weight.device)
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    made["value"] = dequantize_weight_triton(weight, scales, block_n, block_k, dtype)
                    made["done"] = side.record_event()
        except BaseException as error:  # re-raised on the caller's thread
            made["error"] = error

    worker = threading.Thread(target=work, name="dsfuse-dequantize")
    worker.start()
    worker.join()
    if "error" in made:
        raise made["error"]
    current.wait_event(made["done"])
    value = made["value"]
    value.record_stream(current)
    return value


def dequantized_once(weight: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_weight_triton`'s result, kept while the weight and its scales live unchanged: a decode step that
    reads a quantised weight whole (the absorbed MLA's kv_b_proj) dequantises it once, not on every step. Kept
    copies live outside any CUDA-graph memory pool (`_dequantized_outside_graph_pools`); one made while a graph is
    being captured is not kept (the graph replays its kernel)."""
    key = (id(weight), id(scales), block_n, block_k, dtype)
    kept = _DEQUANTIZED.get(key)
    if kept is not None and kept[0]() is weight and kept[1]() is scales and kept[2] == _contents(weight, scales):
        return kept[3]
    if not weight.is_cuda:
        value = dequantize_weight_triton(weight, scales, block_n, block_k, dtype)
    elif torch.cuda.is_current_stream_capturing():
        return dequantize_weight_triton(weight, scales, block_n, block_k, dtype)
    else:
        value = _dequantized_outside_graph_pools(weight, scales, block_n, block_k, dtype)

    def forget(_, key=key):
        _DEQUANTIZED.pop(key, None)

    _DEQUANTIZED[key] = (weakref.ref(weight, forget), weakref.ref(scales, forget), _contents(weight, scales), value)
    return value


@triton.jit
def power_of_two_ceil(scale):
    """exp2(ceil(log2(scale))) for a positive normal fp32 `scale`, exactly: scale itself when it is a power
    of two, else the next power of two (mantissa cleared, exponent + 1)."""
    bits = scale.to(tl.uint32, bitcast=True)
    up = ((bits & 0x7F800000) + 0x00800000).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x007FFFFF) == 0, scale, up)


__all__ = ["E8M0_DTYPE", "E2M1_VALUES", "FP4_BLOCK", "FP8_AMAX_FLOOR", "FP8_BLOCK", "FP8_DTYPE", "FP8_MAX",
           "FP8_INV_MAX", "dequantize_fp4", "dequantize_fp8_blocks", "dequantize_weight_triton", "dequantized_once",
           "e2m1_values", "e4m3_bits", "e4m3_to_float", "e8m0_to_float", "is_e8m0", "power_of_two_ceil",
           "power_of_two_ceil_exact", "quantize_activations", "round_to_e4m3_grid", "scales_to_float32"]
