"""H200 check + benchmark of the fused indexer top-k against eager and Inductor, in one process.

Checks the Triton op against the reference at real shapes (fresh random data), then times with
`triton.testing.do_bench` (median): the reference eagerly, under `torch.compile` (default), and the
fused op (a small config sweep; the default config is what users get). Prints a table (ms, TFLOP/s
counting causal FLOPs, % of a bf16 matmul measured in the same run) and writes
`$OUT/indexer_topk.json` when `OUT` is set.
"""

import json
import os
import time
import traceback

import torch
import triton
from dsfuse.kernels.indexer_topk import (
    default_config,
    flops,
    indexer_topk_reference,
    indexer_topk_triton,
    tuned_configs,
)
from triton.testing import do_bench, do_bench_cudagraph

START = time.time()
COMPILE_BUDGET_S = 230  # skip torch.compile timings once this much wall time has passed
DEV = "cuda"
RESULTS = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shapes": []}


def median_ms(fn, rep=200):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def save():
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "indexer_topk.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def bf16_peak_tflops():
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b)
    return 2 * 8192 ** 3 / ms / 1e9


def make_case(B, S, T, H, D, fp8, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, S, H, D, device=DEV, generator=g)
    k = torch.randn(B, T, D, device=DEV, generator=g)
    weights = torch.randn(B, S, H, device=DEV, generator=g) * H ** -0.5
    if fp8:
        q, k = (q * 8).to(torch.float8_e4m3fn), (k * 8).to(torch.float8_e4m3fn)
        k_scale = torch.rand(B, T, device=DEV, generator=g) + 0.5
    else:
        q, k, k_scale = q.bfloat16(), k.bfloat16(), None
    causal = torch.arange(T, device=DEV)[None, :] <= torch.arange(S, device=DEV)[:, None] + (T - S)
    mask = causal[None, None].expand(B, 1, S, T)[:, 0]  # HF passes attention_mask[:, 0] of a [B,1,S,T] mask
    return q, k, weights, k_scale, mask, D ** -0.5


def check_exact(out, q, k, weights, k_scale, mask, scale, topk, rows_per_chunk=256):
    """Per row: indices in range, distinct, and their reference scores equal the reference top-k scores."""
    B, S = q.shape[:2]
    T = k.shape[1]
    width = min(topk, T)
    worst, bad_rows = 0.0, 0
    assert out.shape == (B, S, width) and out.dtype == torch.int32
    for s0 in range(0, S, rows_per_chunk):
        s1 = min(S, s0 + rows_per_chunk)
        scores = torch.relu(torch.matmul(q[:, s0:s1].float(), k.float().transpose(-1, -2).unsqueeze(1)) * scale)
        index = torch.matmul(weights[:, s0:s1].unsqueeze(-2), scores).squeeze(-2)
        del scores
        if k_scale is not None:
            index = index * k_scale.unsqueeze(1)
        index = index.masked_fill(~mask[:, s0:s1], float("-inf"))
        got_idx = out[:, s0:s1].long()
        in_range = (got_idx >= 0) & (got_idx < T)
        dup = (got_idx.sort(dim=-1).values.diff(dim=-1) == 0).any(dim=-1)
        got = torch.gather(index, -1, got_idx.clamp(0, T - 1)).sort(dim=-1).values
        want = index.topk(width, dim=-1).values.sort(dim=-1).values
        diff = (got - want).abs().nan_to_num(0.0)
        tol = 1e-5 + 1e-5 * want.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
        row_bad = (~in_range).any(dim=-1) | dup | (diff > tol).any(dim=-1)
        bad_rows += int(row_bad.sum())
        worst = max(worst, float(diff.max()))
    return bad_rows, worst


def kernel_breakdown_us(fn, iters=5):
    """GPU time per kernel name (microseconds per call), from the profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.key[:60]] = round(evt.device_time_total / iters, 1)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def run_shape(label, B, S, T, H, D, topk, fp8, peak, sweep, seed):
    q, k, weights, k_scale, mask, scale = make_case(B, S, T, H, D, fp8, seed)
    work = flops(B, S, T, H, D, causal_offset=T - S)
    row = {"label": label, "B": B, "S": S, "T": T, "H": H, "D": D, "topk": topk, "dtype": "fp8_e4m3" if fp8 else "bf16",
           "causal_gflop": work / 1e9, "default_config": default_config(B, S, T, H, D, topk, q.dtype, q.device)}

    stats = {}
    fallback = None
    try:
        out = indexer_topk_triton(q, k, weights, k_scale, mask, scale, topk, stats=stats)
        torch.cuda.synchronize()
    except Exception:  # the autotuned launch failed: measure the fixed default config instead, and say so
        traceback.print_exc()
        fallback = sweep[0] if sweep else {"num_warps": 8}
        row["autotune_failed_used_config"] = fallback
        out = indexer_topk_triton(q, k, weights, k_scale, mask, scale, topk, stats=stats, config=fallback)
        torch.cuda.synchronize()
    row["repaired_rows"] = int(stats["repaired"].sum())
    row["mean_candidates"] = float(stats["candidates"].float().mean())
    row["bad_rows"], row["max_score_diff"] = check_exact(out, q, k, weights, k_scale, mask, scale, topk)

    def ours(cfg=None):
        return lambda: indexer_topk_triton(q, k, weights, k_scale, mask, scale, topk, config=cfg or fallback)

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ours()()
    torch.cuda.synchronize()
    row["fused_peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20

    row["fused_ms"] = median_ms(ours())
    row["tuned_configs"] = tuned_configs()
    row["kernel_breakdown_us"] = kernel_breakdown_us(ours())
    row["fused_cudagraph_ms"] = do_bench_cudagraph(ours(), rep=100, return_mode="median")
    row["sweep"] = []
    for cfg in sweep:
        try:
            ms = median_ms(ours(cfg))
        except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
            ms = None
            cfg = {**cfg, "error": type(e).__name__}
        row["sweep"].append({"config": cfg, "ms": ms})
    thr = stats["threshold"].reshape(B, S).clone()  # the sampled thresholds, given: the op minus sampling
    row["fused_fixed_threshold_ms"] = median_ms(
        lambda: indexer_topk_triton(q, k, weights, k_scale, mask, scale, topk, threshold=thr, config=fallback))

    if fp8:  # fp8 straight into the tensor cores: faster, but Hopper's fp8 MMA accumulates imprecisely
        fast = indexer_topk_triton(q, k, weights, k_scale, mask, scale, topk, fp8_tensor_cores=True)
        row["fp8_tensor_cores_bad_rows"], row["fp8_tensor_cores_max_score_diff"] = check_exact(
            fast, q, k, weights, k_scale, mask, scale, topk)
        row["fp8_tensor_cores_ms"] = median_ms(
            lambda: indexer_topk_triton(q, k, weights, k_scale, mask, scale, topk, fp8_tensor_cores=True))

    ref_rep = 300 if work > 1e12 else 100
    row["eager_ms"] = median_ms(lambda: indexer_topk_reference(q, k, weights, k_scale, mask, scale, topk), rep=ref_rep)
    row["_inputs"] = (q, k, weights, k_scale, mask, scale, topk)
    for key in ("fused_ms", "fused_cudagraph_ms", "eager_ms"):
        row[key.replace("_ms", "_tflops")] = work / row[key] / 1e9
    row["fused_pct_of_bf16_peak"] = 100 * work / row["fused_ms"] / 1e9 / peak
    return row


def main():
    peak = bf16_peak_tflops()
    RESULTS["bf16_matmul_8192_tflops"] = peak
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)
    prefill_sweep = [{"block_q": 4, "block_t": 128, "num_warps": 8, "num_stages": 3}]  # untuned, for reference
    decode_sweep = [{"splits": 64, "block_q": 1, "block_t": 128, "num_warps": 4, "num_stages": 4}]
    shapes = [
        ("prefill S4096 T32768 bf16", 1, 4096, 32768, 64, 128, 2048, False, prefill_sweep),
        ("prefill S4096 T32768 fp8", 1, 4096, 32768, 64, 128, 2048, True, prefill_sweep),
        ("prefill S2048 T16384 bf16", 1, 2048, 16384, 64, 128, 2048, False, prefill_sweep),
        ("decode B8 S1 T131072 bf16", 8, 1, 131072, 64, 128, 2048, False, decode_sweep),
    ]
    rows = []
    for i, (label, *dims, sweep) in enumerate(shapes):
        try:
            row = run_shape(label, *dims, peak=peak, sweep=sweep, seed=i + 1)
        except Exception:  # report and go on: one broken shape must not hide the others
            traceback.print_exc()
            RESULTS.setdefault("errors", []).append(label)
            continue
        rows.append(row)
        RESULTS["shapes"].append({k: v for k, v in row.items() if not k.startswith("_")})
        save()
        print(f"{label}: fused {row['fused_ms']:.3f} ms ({row['fused_pct_of_bf16_peak']:.0f}% of bf16 peak), "
              f"graph {row['fused_cudagraph_ms']:.3f}, fixed-thr {row['fused_fixed_threshold_ms']:.3f}, eager "
              f"{row['eager_ms']:.2f}; bad rows {row['bad_rows']}, repaired {row['repaired_rows']}, "
              f"mean cand {row['mean_candidates']:.0f}, extra {row['fused_peak_extra_mib']:.0f} MiB, "
              f"kernels(us) {row['kernel_breakdown_us']}, "
              f"sweep {[(s['config'], None if s['ms'] is None else round(s['ms'], 3)) for s in row['sweep']]}",
              flush=True)

    for row, saved in zip(rows, RESULTS["shapes"]):
        if time.time() - START > COMPILE_BUDGET_S:
            saved["inductor_ms"] = None
            continue
        compiled = torch.compile(indexer_topk_reference)
        args = row.pop("_inputs")
        compiled(*args)
        saved["inductor_ms"] = median_ms(lambda compiled=compiled, args=args: compiled(*args), rep=300)
        saved["inductor_tflops"] = saved["causal_gflop"] / saved["inductor_ms"]
        torch._dynamo.reset()
        save()

    print(f"\n{'shape':30s} {'eager ms':>9s} {'inductor ms':>11s} {'fused ms':>9s} {'graph ms':>9s} "
          f"{'TFLOP/s':>8s} {'% peak':>7s} {'x inductor':>10s}")
    for r in RESULTS["shapes"]:
        ind = r.get("inductor_ms")
        print(f"{r['label']:30s} {r['eager_ms']:9.3f} {('%11.3f' % ind) if ind else '    skipped':>11s} "
              f"{r['fused_ms']:9.3f} {r['fused_cudagraph_ms']:9.3f} {r['fused_tflops']:8.0f} "
              f"{r['fused_pct_of_bf16_peak']:7.1f} {('%10.2f' % (ind / r['fused_ms'])) if ind else '':>10s}")
    by_label = {r["label"]: r for r in RESULTS["shapes"]}
    bf, f8 = by_label.get(shapes[0][0]), by_label.get(shapes[1][0])
    RESULTS["fp8_speedup_over_bf16"] = bf["fused_ms"] / f8["fused_ms"] if bf and f8 else None
    RESULTS["decode_bytes_floor_ms"] = 8 * 131072 * 128 * 2 / 4.2e12 * 1e3
    print(f"fp8 / bf16 speedup: {RESULTS['fp8_speedup_over_bf16']}; decode floor "
          f"{RESULTS['decode_bytes_floor_ms']:.3f} ms; total wall {time.time() - START:.0f} s")
    save()


if __name__ == "__main__":
    main()
