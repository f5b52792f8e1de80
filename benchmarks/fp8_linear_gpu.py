"""H200 benchmark of dsfuse's block-scaled FP8 / FP4 linears against cuBLAS and bf16, at DeepSeek V3.2's projection
shapes and its and V4-Flash's expert shapes.

1. Ceilings measured in the same run: bf16 8192^3 matmul (TFLOP/s) and a device copy (GB/s, read + write).
2. Linears `[M, K] x [N, K]^T` for M from 1 to 8192: dsfuse's op as dispatched (cuBLAS block-scaled from
   SCALED_MM_MIN_ROWS rows when the probe passes and K is a multiple of 512, else Triton), dsfuse's Triton GEMM
   alone (activation quantisation included), `torch._scaled_mm` with 1x128 / 128x128 block scales on pre-quantised
   operands (the GEMM alone: the quantisation it needs is not timed), and bf16 `x @ w.T`. TFLOP/s, and for M <= 64
   the weight bytes read over the time as a fraction of the copy bandwidth (the floor of a weight-streaming call).
   Each provider's result is checked against the reference (max error over max |reference|).
3. Grouped experts: V3.2 FP8 (64 of its 256 experts, as on a 4-way expert-parallel rank: 7168 -> 2 x 2048 -> 7168,
   top-8) and V4-Flash FP4 (256 experts, 4096 -> 2 x 2048 -> 4096, top-6) at T tokens, the two expert GEMMs as
   `fp8_grouped_linear` against bf16 `torch._grouped_mm` of the dequantised weights (and, at decode size, against
   the row-tiled GEMM's tiles as before the decode path).
4. The decode path (issue 31: at most DECODE_MAX_ROWS rows): for M in 1, 8, 16, 64 on V3.2's projections and
   V4-Flash's FP4 expert up (4096 -> 4096), the op's path as dispatched (activation quantisation, inside the decode
   GEMM for FP8 tiles of up to 16 rows, decode GEMM and, where the channel groups are split, the sum of the
   partials), the decode GEMM alone on activations quantised beforehand,
   and the row-tiled GEMM with its decode-sized tiles of run 74 (BLOCK_M 16, BLOCK_N 32, 4 warps, 4 stages and its
   split rule; its partials now summed by the same kernel, no tile list built) with the same quantisation: ms,
   weight GB/s and the fraction of the copy bandwidth, timed as CUDA-graph replays (as a decode step runs them; the
   host's launch time, which eagerly exceeds these kernels', is left out); then each FP8 launch of a V3.2 decode step
   as the compiled model makes it (`fp8_linears` groups, the routed experts' grouped GEMMs on 8 experts), as
   bandwidth. `DECODE_SWEEP=1` adds a sweep of the decode tiles (BLOCK_N,
   warps, stages, programs per SM, FP4 K step) at M = 1, 16, 64; `DECODE_ONLY=1` runs this section alone.

Writes $OUT/fp8_linear.json and prints markdown tables last. ~2 minutes. `ROWS="4096"` limits the linears' row
counts; `SWEEP=1` adds the tile sweep, `SWEEP_SHAPES="v4 expert up"` limits it to the named shapes; `EXPERTS_SWEEP=1`
sweeps the grouped GEMM's tiles on the experts' up projection (V3.2 FP8 at T=4096, V4-Flash FP4 at T=8192); `EXPERTS_ONLY=1` runs section 3 alone."""

import json
import os
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

from dsfuse.kernels import fp8_linear as ops
from dsfuse.kernels.quant_formats import E8M0_DTYPE, scales_to_float32
from dsfuse.models.quantized import quantize_fp4_weight, quantize_fp8_weight

OUT = os.environ.get("OUT", ".")
REP_MS = int(os.environ.get("REP_MS", 60))
LINEARS = {"q_a 1536x7168": (1536, 7168), "q_b 24576x1536": (24576, 1536), "kv_a 576x7168": (576, 7168),
           "o_proj 7168x16384": (7168, 16384), "dense up 18432x7168": (18432, 7168)}
ROWS = [int(m) for m in os.environ.get("ROWS", "1 8 16 64 128 512 4096 8192").split()]
RESULTS = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "linears": [], "experts": []}


def bench(fn):
    return do_bench(fn, warmup=25, rep=REP_MS, return_mode="median")


def bench_replayed(fn):
    """GPU time of `fn` replayed from a CUDA graph: how a decode step under CUDA graphs runs a decode-sized call,
    without the host's launch time (which, for kernels of tens of microseconds, is what `bench` would measure)."""
    fn()
    return do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")


def rel(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def ceilings():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = bench(lambda: a @ a)
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(big)
    copy = bench(lambda: other.copy_(big))
    return 2 * 8192**3 / mm / 1e9, 2 * big.numel() / copy / 1e6


def linear_case(name, N, K, M, copy_gbs):
    g = torch.Generator(device="cuda").manual_seed(M + N)
    w_bf16 = torch.randn(N, K, device="cuda", generator=g) * 0.02
    w, s = quantize_fp8_weight(w_bf16, scale_fmt="ue8m0")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    want = ops.fp8_linear_reference(x, w, s, 128, 128)
    w_deq = ops.dequantize_weight(w, s, 128, 128).to(torch.bfloat16)
    row = {"shape": name, "M": M}
    flops = 2 * M * N * K
    providers = {
        "dsfuse": lambda: torch.ops.dsfuse.fp8_linear(x, w, s, 128, 128),
        "dsfuse triton": lambda: _triton_only(x, w, s),
        "bf16": lambda: x @ w_deq.t(),
    }
    q, qs = ops.quantize_activations_triton(x, 128, pow2=True, scales_column_major=True)
    if M % 4 == 0 and RESULTS["cublas_block_scaled"]:
        ws = scales_to_float32(s).t()
        providers["scaled_mm (GEMM only)"] = lambda: torch._scaled_mm(q, w.t(), scale_a=qs, scale_b=ws,
                                                                     out_dtype=torch.bfloat16)
    for provider, fn in providers.items():
        try:
            got = fn()
            ms = bench(fn)
        except Exception as error:  # noqa: BLE001  (a provider that refuses a shape is a finding)
            row[provider] = f"{type(error).__name__}: {str(error)[:80]}"
            continue
        row[provider] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "err": round(rel(got, want), 5)}
        if M <= 64 and provider != "bf16":
            row[provider]["hbm"] = round(ops.weight_bytes(w, s) / ms / 1e6 / copy_gbs, 3)
    return row


def _triton_only(x, w, s, decode=None):
    out = torch.empty((x.shape[0], ops.weight_dims(w)[0]), dtype=x.dtype, device=x.device)
    q, qs = ops.quantize_for_weight(x, w, s, 128)
    ops._gemm(q, qs, w, s, out, 128, 128, decode=decode)
    return out


def _fp4_weight(shape, g):
    """V4-Flash-style FP4 bytes with E8M0 scales per 32: a Gaussian weight quantised as the release is (each 32 values'
    scale the power of two that maps their amax to <= 6)."""
    *lead, N, K = shape
    packed = torch.empty((*lead, N, K // 2), device="cuda", dtype=torch.int8)
    scales = torch.empty((*lead, N, K // 32), device="cuda", dtype=E8M0_DTYPE)
    for matrix_bytes, matrix_scales in zip(packed.view(-1, N, K // 2), scales.view(-1, N, K // 32)):
        # one fp32 matrix at a time: a stack of them would not fit
        matrix_bytes[:], matrix_scales[:] = quantize_fp4_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    return packed, scales


def _weight(N, K, fp4, seed, lead=()):
    """A V3.2-style FP8 weight (UE8M0 block scales) or V4-Flash-style FP4 weight (`_fp4_weight`)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if fp4:
        return _fp4_weight((*lead, N, K), g)
    return quantize_fp8_weight(torch.randn(*lead, N, K, device="cuda", generator=g) * 0.02, scale_fmt="ue8m0")


DECODE_ROWS = (1, 8, 16, 64)
DECODE_SHAPES = {**{name: (N, K, False) for name, (N, K) in LINEARS.items()}, "v4 expert up fp4": (4096, 4096, True)}


def _bandwidth(entry, w, s, ms, copy_gbs):
    gbs = ops.weight_bytes(w, s) / ms / 1e6
    entry.update(ms=round(ms, 4), gbs=round(gbs), copy_frac=round(gbs / copy_gbs, 3))
    return entry


def decode_case(name, N, K, fp4, M, copy_gbs):
    """One decode-sized linear: the op's path, the decode GEMM alone on activations quantised beforehand, and the
    old row-tiled tiles, as bandwidth."""
    w, s = _weight(N, K, fp4, M + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(M))
    want = ops.fp8_linear_reference(x, w, s, 128, 128)
    q, qs = ops.quantize_for_weight(x, w, s, 128)
    out = torch.empty((M, N), dtype=x.dtype, device="cuda")

    def gemm_only():
        ops._gemm(q, qs, w, s, out, 128, 128, decode=True)
        return out

    row = {"shape": name, "M": M, "weight_mb": round(ops.weight_bytes(w, s) / 1e6, 1)}
    providers = {"decode": lambda: torch.ops.dsfuse.fp8_linear(x, w, s, 128, 128), "decode GEMM only": gemm_only,
                 "old tiles": lambda: _triton_only(x, w, s, decode=False)}
    for provider, fn in providers.items():
        try:
            err = rel(fn(), want)
            row[provider] = _bandwidth({"err": round(err, 5)}, w, s, bench_replayed(fn), copy_gbs)
        except Exception as error:  # noqa: BLE001  (a failing provider is a finding)
            row[provider] = f"{type(error).__name__}: {str(error)[:80]}"
    return row


# A V3.2 decode step's FP8 launches at batch 1, as the compiled model makes them (`fp8_linears` groups the
# projections of one input; the routed experts' two GEMMs read 8 experts' weights): (launch, input width, widths).
STEP_LINEARS = [("q_a + kv_a + wk", 7168, (1536, 576, 128)), ("q_b + indexer wq_b", 1536, (24576, 8192)),
                ("o_proj", 16384, (7168,)), ("dense gate + up", 7168, (18432, 18432)), ("dense down", 18432, (7168,)),
                ("shared gate + up", 7168, (2048, 2048)), ("shared down", 2048, (7168,))]
# experts held, chosen, hidden, intermediate: the launch reads only the chosen experts' weights, so 16 held of
# V3.2's 256 read the same bytes (and keep the fp32 weights being quantised small)
STEP_EXPERTS = (16, 8, 7168, 2048)


def step_launches(copy_gbs):
    """Each FP8 launch of a V3.2 decode step (batch 1, one layer's worth: the dense MLP and the MoE layer's shared
    expert and routed experts), replayed from a CUDA graph: its weight bytes over its time against the copy
    bandwidth, so the step's FP8 time (the model's profile) can be laid against each launch's share."""
    rows = []
    for name, K, widths in STEP_LINEARS:
        weights = [_weight(N, K, False, N + K) for N in widths]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ws, ss = [w for w, _ in weights], [sc for _, sc in weights]
        if len(ws) == 1:
            fn = lambda: torch.ops.dsfuse.fp8_linear(x, ws[0], ss[0], 128, 128)  # noqa: E731
        else:
            fn = lambda: torch.ops.dsfuse.fp8_linears(x, ws, ss, [128] * len(ws), 128)  # noqa: E731
        read = sum(ops.weight_bytes(w, sc) for w, sc in weights)
        rows.append(_step_bandwidth({"launch": name, "weight_mb": round(read / 1e6, 1)}, read, fn, copy_gbs))
    E, chosen, H, inter = STEP_EXPERTS
    up, down = _weight(2 * inter, H, False, 1, lead=(E,)), _weight(H, inter, False, 2, lead=(E,))
    picked = torch.randperm(E, device="cuda")[:chosen].sort().values
    offsets = torch.zeros(E, dtype=torch.long, device="cuda").index_fill_(0, picked, 1).cumsum(0).to(torch.int32)
    x, mid = (torch.randn(chosen, width, device="cuda", dtype=torch.bfloat16) for width in (H, inter))
    for name, a, (w, sc) in (("routed experts up", x, up), ("routed experts down", mid, down)):
        fn = lambda: torch.ops.dsfuse.fp8_grouped_linear(a, w, sc, offsets, 128, 128)  # noqa: E731
        read = ops.weight_bytes(w, sc) * chosen / E
        rows.append(_step_bandwidth({"launch": name, "weight_mb": round(read / 1e6, 1)}, read, fn, copy_gbs))
    return rows


def _step_bandwidth(entry, weight_bytes, fn, copy_gbs):
    ms = bench_replayed(fn)
    gbs = weight_bytes / ms / 1e6
    entry.update(ms=round(ms, 4), gbs=round(gbs), copy_frac=round(gbs / copy_gbs, 3))
    return entry


# (BLOCK_N, warps, stages, programs per SM, FP4 K step); `ops._decode_config` picks among them by row tile
DECODE_SWEEP = [(64, 4, 4, 2, 128), (64, 4, 6, 2, 128), (64, 4, 4, 1, 128), (64, 4, 4, 4, 128), (32, 4, 4, 2, 128),
                (128, 8, 4, 2, 128), (128, 8, 4, 1, 128), (128, 8, 3, 1, 128), (128, 4, 4, 1, 128), (128, 8, 4, 4, 128),
                (128, 8, 5, 2, 128), (128, 8, 6, 2, 128), (128, 8, 4, 3, 128), (256, 8, 3, 1, 128), (256, 8, 4, 1, 128)]
DECODE_SWEEP_FP4 = [(128, 8, 4, 4, 128), (128, 8, 3, 2, 128), (64, 4, 4, 4, 128), (128, 4, 4, 4, 64)]


def decode_sweep_case(name, N, K, fp4, M, copy_gbs):
    """The decode path as the op runs it (activations quantised in the kernel where its row tile allows, else
    first) under each decode tile config."""
    w, s = _weight(N, K, fp4, M + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(M))
    want = ops.fp8_linear_reference(x, w, s, 128, 128)
    out = torch.empty((M, N), dtype=x.dtype, device="cuda")
    row = {"shape": name, "M": M, "default": ops._decode_config(fp4, ops._decode_block_m(M, False))}
    for config in DECODE_SWEEP_FP4 if fp4 else DECODE_SWEEP:
        fn = lambda: ops._gemm(x, None, w, s, out, 128, 128, config=config, decode=True)  # noqa: E731
        try:
            fn()
            err = rel(out, want)
            row[str(config)] = _bandwidth({"err": round(err, 5)}, w, s, bench_replayed(fn), copy_gbs)
        except Exception as error:  # noqa: BLE001
            row[str(config)] = f"{type(error).__name__}: {str(error)[:60]}"
    timed = {k: v["ms"] for k, v in row.items() if isinstance(v, dict)}
    row["best"] = min(timed, key=timed.get) if timed else None
    return row


SWEEP = [(16, 32, 4, 4), (16, 64, 4, 4), (16, 128, 4, 4), (32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3),
         (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3), (64, 256, 8, 3)]
# FP4 (weights as the MMA's first operand: BLOCK_N is its M, at least 64 for wgmma)
SWEEP_FP4 = [(16, 128, 8, 6), (16, 64, 4, 6), (32, 128, 8, 6), (64, 128, 8, 6), (64, 128, 8, 4), (128, 128, 8, 4),
             (128, 128, 8, 3), (128, 64, 4, 4), (256, 128, 8, 3), (128, 256, 8, 3)]


def sweep_case(name, N, K, M, fp4=False):
    """The Triton GEMM alone (activations quantised beforehand) under each SWEEP tile config: ms per config."""
    g = torch.Generator(device="cuda").manual_seed(M + N)
    w, s = _fp4_weight((N, K), g) if fp4 else quantize_fp8_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02,
                                                                  scale_fmt="ue8m0")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    q, qs = ops.quantize_for_weight(x, w, s, 128)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    want = ops.fp8_linear_reference(x, w, s, 128, 128)
    row = {"shape": name, "M": M, "fp4": fp4, "default": ops._gemm_config(M, w)}
    for config in SWEEP_FP4 if fp4 else SWEEP:
        if config[0] > 16 * max(M, 1):
            continue
        fn = lambda: ops._gemm(q, qs, w, s, out, 128, 128, config=config, decode=False)  # noqa: E731
        try:
            fn()
            err = rel(out, want)
            row[str(config)] = {"ms": round(bench(fn), 4), "err": round(err, 5)}
        except Exception as error:  # noqa: BLE001
            row[str(config)] = f"{type(error).__name__}: {str(error)[:60]}"
    timed = {k: v["ms"] for k, v in row.items() if isinstance(v, dict)}
    row["best"] = min(timed, key=timed.get) if timed else None
    return row


# Grouped GEMM tiles (BLOCK_M, BLOCK_N, warps, stages) swept on the expert up projection (`EXPERTS_SWEEP=1`):
# FP4 (V4-Flash, T=8192; weights first, BLOCK_N is the MMA's M) and FP8 (V3.2, T=4096; rows first)
EXPERT_SWEEP = {True: [(128, 128, 8, 4), (256, 128, 8, 3, 128), (256, 128, 8, 3), (256, 128, 8, 4),
                       (64, 128, 8, 6), (128, 128, 8, 3, 128)],
                False: [(64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 256, 8, 3), (128, 256, 8, 3),
                        (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3)]}


def experts_case(name, E, H, inter, T, top_k, fp4):
    g = torch.Generator(device="cuda").manual_seed(T)
    rows = T * top_k
    ids = torch.randint(0, E, (rows,), device="cuda", generator=g).sort().values
    offsets = torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, generator=g)
    if fp4:
        up = _fp4_weight((E, 2 * inter, H), g)
        down = _fp4_weight((E, H, inter), g)
    else:
        up = quantize_fp8_weight(torch.randn(E, 2 * inter, H, device="cuda", generator=g) * 0.02, scale_fmt="ue8m0")
        down = quantize_fp8_weight(torch.randn(E, H, inter, device="cuda", generator=g) * 0.02, scale_fmt="ue8m0")
    mid = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16, generator=g)

    def quantised():
        torch.ops.dsfuse.fp8_grouped_linear(x, *up, offsets, 128, 128)
        return torch.ops.dsfuse.fp8_grouped_linear(mid, *down, offsets, 128, 128)

    up_bf16 = ops.dequantize_weight(*up, 128, 128).to(torch.bfloat16).transpose(1, 2)
    down_bf16 = ops.dequantize_weight(*down, 128, 128).to(torch.bfloat16).transpose(1, 2)

    def plain():
        torch._grouped_mm(x, up_bf16, offs=offsets)
        return torch._grouped_mm(mid, down_bf16, offs=offsets)

    def old_tiles():
        """Both GEMMs through the row-tiled GEMM's tiles, as before the decode path."""
        for a, (w, s), out in ((x, up, h_out), (mid, down, y_out)):
            q, qs = ops.quantize_for_weight(a, w, s, 128)
            ops._gemm(q, qs, w, s, out, 128, 128, offsets=offsets, decode=False)
        return y_out

    h_out = torch.zeros((rows, 2 * inter), device="cuda", dtype=torch.bfloat16)
    y_out = torch.zeros((rows, H), device="cuda", dtype=torch.bfloat16)
    got, want = quantised(), ops.fp8_grouped_linear_reference(mid, *down, offsets, 128, 128)
    flops = 2 * rows * (2 * inter * H + H * inter)
    row = {"case": name, "T": T, "rows": rows, "err": round(rel(got, want), 5)}
    providers = [("dsfuse fp8_grouped_linear x2", quantised), ("bf16 _grouped_mm x2", plain)]
    if rows <= ops.DECODE_MAX_ROWS:
        row["old tiles err"] = round(rel(old_tiles(), want), 5)
        providers.append(("old tiles x2", old_tiles))
    for provider, fn in providers:
        ms = bench(fn)
        row[provider] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
    if rows > ops.DECODE_MAX_ROWS and os.environ.get("EXPERTS_SWEEP"):
        q, qs = ops.quantize_for_weight(x, *up, 128)
        want_up = ops.fp8_grouped_linear_reference(x, *up, offsets, 128, 128)
        sweep = {"default": ops._gemm_config(rows, up[0], E)}
        for config in EXPERT_SWEEP[fp4]:
            fn = lambda: ops._gemm(q, qs, *up, h_out, 128, 128, offsets=offsets, config=config, decode=False)  # noqa: E731
            fn()
            sweep[str(config)] = {"ms": round(bench(fn), 3), "err": round(rel(h_out[:rows], want_up), 5)}
        row["expert up sweep"] = sweep
    return row


def main():
    mm_tflops, copy_gbs = ceilings()
    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__, bf16_tflops=round(mm_tflops, 1),
                   copy_gbs=round(copy_gbs), cublas_block_scaled=ops.cublas_block_scaled_gemm(0))
    print(f"ceilings: bf16 {mm_tflops:.0f} TFLOP/s, copy {copy_gbs:.0f} GB/s; cuBLAS block-scaled usable: "
          f"{RESULTS['cublas_block_scaled']}", flush=True)
    experts_only = bool(os.environ.get("EXPERTS_ONLY"))
    for name, (N, K) in LINEARS.items() if not (os.environ.get("DECODE_ONLY") or experts_only) else ():
        for M in ROWS:
            RESULTS["linears"].append(linear_case(name, N, K, M, copy_gbs))
            print(json.dumps(RESULTS["linears"][-1]), flush=True)
            (open(f"{OUT}/fp8_linear.json", "w")).write(json.dumps(RESULTS, indent=1))
    if os.environ.get("SWEEP"):
        RESULTS["sweep"] = []
        shapes = (("q_b", 24576, 1536, False), ("o_proj", 7168, 16384, False), ("dense up", 18432, 7168, False),
                  ("v4 expert up", 4096, 4096, True))
        only = [name for name in os.environ.get("SWEEP_SHAPES", "").split(",") if name]
        for name, N, K, fp4 in (shape for shape in shapes if not only or shape[0] in only):
            for M in (1, 16, 64, 512, 4096):
                RESULTS["sweep"].append(sweep_case(name, N, K, M, fp4))
                print(json.dumps(RESULTS["sweep"][-1]), flush=True)
    RESULTS["decode"] = []
    for name, (N, K, fp4) in DECODE_SHAPES.items() if not experts_only else ():
        for M in DECODE_ROWS:
            RESULTS["decode"].append(decode_case(name, N, K, fp4, M, copy_gbs))
            print(json.dumps(RESULTS["decode"][-1]), flush=True)
        torch.cuda.empty_cache()
    RESULTS["step_launches"] = step_launches(copy_gbs) if not experts_only else []
    for entry in RESULTS["step_launches"]:
        print(json.dumps(entry), flush=True)
    torch.cuda.empty_cache()
    (open(f"{OUT}/fp8_linear.json", "w")).write(json.dumps(RESULTS, indent=1))
    if os.environ.get("DECODE_SWEEP"):
        RESULTS["decode_sweep"] = []
        for name in DECODE_SHAPES:
            for M in (1, 16, 64):
                RESULTS["decode_sweep"].append(decode_sweep_case(name, *DECODE_SHAPES[name], M, copy_gbs))
                print(json.dumps(RESULTS["decode_sweep"][-1]), flush=True)
        (open(f"{OUT}/fp8_linear.json", "w")).write(json.dumps(RESULTS, indent=1))
    for args in () if os.environ.get("DECODE_ONLY") else (("V3.2 fp8", 64, 7168, 2048, 4096, 8, False), ("V3.2 fp8", 64, 7168, 2048, 1, 8, False),
                 ("V4-Flash fp4", 256, 4096, 2048, 8192, 6, True),
                 ("V4-Flash fp4", 256, 4096, 2048, 1, 6, True)):
        try:
            RESULTS["experts"].append(experts_case(*args))
        except Exception as error:  # noqa: BLE001
            RESULTS["experts"].append({"case": args[0], "T": args[4], "error": f"{type(error).__name__}: {error}"})
        print(json.dumps(RESULTS["experts"][-1]), flush=True)
        torch.cuda.empty_cache()
    (open(f"{OUT}/fp8_linear.json", "w")).write(json.dumps(RESULTS, indent=1))
    print(table())


def _cell(entry, key="tflops"):
    return entry.get(key, "-") if isinstance(entry, dict) else "x"


def table():
    lines = ["| shape | M | dsfuse ms | dsfuse TFLOP/s | triton TFLOP/s | scaled_mm TFLOP/s | bf16 TFLOP/s | "
             "dsfuse / scaled_mm | triton HBM frac | err |", "|" + " --- |" * 10]
    for r in RESULTS["linears"]:
        d, t, c, b = (r.get(k) for k in ("dsfuse", "dsfuse triton", "scaled_mm (GEMM only)", "bf16"))
        ratio = round(c["ms"] / d["ms"], 2) if isinstance(c, dict) and isinstance(d, dict) else "-"
        lines.append(f"| {r['shape']} | {r['M']} | {_cell(d, 'ms')} | {_cell(d)} | {_cell(t)} | {_cell(c)} | "
                     f"{_cell(b)} | {ratio} | {_cell(t, 'hbm')} | {_cell(d, 'err')} |")
    for r in RESULTS["experts"]:
        lines.append(f"| experts {r['case']} T={r['T']} | {r.get('rows')} | " + " | ".join(
            f"{k}: {v}" for k, v in r.items() if k not in ("case", "T", "rows")) + " |")
    lines += ["", "| decode shape | M | op ms | op GB/s | op / copy | GEMM only ms | GEMM only / copy | old tiles ms | "
              "old tiles / copy | old / op | err |", "|" + " --- |" * 11]
    for r in RESULTS["decode"]:
        d, g, o = (r.get(k) for k in ("decode", "decode GEMM only", "old tiles"))
        ratio = round(o["ms"] / d["ms"], 2) if isinstance(o, dict) and isinstance(d, dict) else "-"
        lines.append(f"| {r['shape']} | {r['M']} | {_cell(d, 'ms')} | {_cell(d, 'gbs')} | {_cell(d, 'copy_frac')} | "
                     f"{_cell(g, 'ms')} | {_cell(g, 'copy_frac')} | {_cell(o, 'ms')} | {_cell(o, 'copy_frac')} | "
                     f"{ratio} | {_cell(d, 'err')} |")
    launches = RESULTS.get("step_launches", [])
    if launches:
        lines += ["", "| V3.2 decode step launch (B=1) | weight MB | ms | GB/s | of copy |", "|" + " --- |" * 5]
        lines += [f"| {r['launch']} | {r['weight_mb']} | {r['ms']} | {r['gbs']} | {r['copy_frac']} |" for r in launches]
        total_mb, total_ms = sum(r["weight_mb"] for r in launches), sum(r["ms"] for r in launches)
        lines.append(f"| all | {total_mb:.1f} | {total_ms:.4f} | {total_mb / total_ms:.0f} | "
                     f"{total_mb / total_ms / RESULTS['copy_gbs']:.3f} |")
    for r in RESULTS.get("decode_sweep", []):
        best = r.get(r["best"]) if r["best"] else None
        lines.append(f"| sweep {r['shape']} | {r['M']} | best {r['best']}: {_cell(best, 'ms')} ms, "
                     f"{_cell(best, 'copy_frac')} of copy; default {r['default']}: "
                     f"{_cell(r.get(str(r['default'])), 'copy_frac')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
