"""H200 check + benchmark of the fused indexer top-k: exactness, whole-op time, per-kernel breakdown.

One process, <= 90 s. For each shape: the default op (autotuned filter kernel) is checked against the
reference (bad rows = rows whose selected scores differ from the reference top-k scores), timed
(`do_bench` median, and under a CUDA graph for decode), and split into its kernels with the profiler:
row ranges, sample pass, threshold, filter, select, repair. A few variants of the filter kernel run with
the tiles the autotuner picked, to separate its costs:

  store_append  candidates written by `tl.store` (layout conversions through shared memory)
  tree_head_sum head sum by `tl.sum` instead of the FFMA chain
  no_append     the filter kernel without its candidate writes (scores + epilogue + counts only;
                the op's output is garbage then, so only its filter-kernel time is reported)
  fused_select  the select run by each filter program on its own rows (no select launch)

Prints a compact table (the last lines) and writes `$OUT/indexer_topk.json`.
"""

import functools
import json
import os
import time
import traceback

import torch
import triton
from dsfuse.kernels.indexer_topk import TILE_KEYS, flops, indexer_topk_triton, tuned_configs
from triton.testing import do_bench, do_bench_cudagraph

START = time.time()
BUDGET_S = 70  # variants still pending past this wall time are skipped (and listed in the JSON)
DEV = "cuda"
RESULTS = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shapes": [], "skipped": [], "errors": []}
KERNELS = {"_row_range_kernel": "ranges", "_sample_threshold_kernel": "threshold", "_score_filter_kernel": "filter",
           "_select_kernel": "select", "_repair_kernel": "repair"}


def elapsed():
    return time.time() - START


def save():
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "indexer_topk.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def median_ms(fn, rep=100):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def bf16_peak_tflops():
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / median_ms(lambda: a @ b) / 1e9


def visible(S, T, device, compress=None):
    """[S, T] keys each query may see: causal with the keys' end at the last query; with `compress` m, DeepSeek
    V4's CSA threshold over compressed entries (query s sees entries t < (s + 1) // m)."""
    t, s = torch.arange(T, device=device)[None, :], torch.arange(S, device=device)[:, None]
    return t < (s + 1) // compress if compress else t <= s + (T - S)


def make_case(B, S, T, H, D, seed, compress=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, S, H, D, device=DEV, generator=g).bfloat16()
    k = torch.randn(B, T, D, device=DEV, generator=g).bfloat16()
    weights = torch.randn(B, S, H, device=DEV, generator=g) * H ** -0.5
    # HF passes attention_mask[:, 0] of a [B,1,S,T] mask (V3.2), or the negated future mask (V4)
    mask = visible(S, T, DEV, compress)[None].expand(B, S, T)
    return q, k, weights, mask, D ** -0.5


def bad_rows(out, q, k, weights, mask, scale, topk, rows_per_chunk=256):
    """Rows with an index out of range, a duplicate, or selected scores != the reference top-k scores."""
    B, S = q.shape[:2]
    T = k.shape[1]
    width = min(topk, T)
    assert out.shape == (B, S, width) and out.dtype == torch.int32
    bad = 0
    for s0 in range(0, S, rows_per_chunk):
        s1 = min(S, s0 + rows_per_chunk)
        scores = torch.relu(torch.matmul(q[:, s0:s1].float(), k.float().transpose(-1, -2).unsqueeze(1)) * scale)
        index = torch.matmul(weights[:, s0:s1].unsqueeze(-2), scores).squeeze(-2)
        del scores
        index = index.masked_fill(~mask[:, s0:s1], float("-inf"))
        got_idx = out[:, s0:s1].long()
        in_range = (got_idx >= 0) & (got_idx < T)
        dup = (got_idx.sort(dim=-1).values.diff(dim=-1) == 0).any(dim=-1)
        got = torch.gather(index, -1, got_idx.clamp(0, T - 1)).sort(dim=-1).values
        want = index.topk(width, dim=-1).values.sort(dim=-1).values
        tol = 1e-5 + 1e-5 * want.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
        diff = (got - want).abs().nan_to_num(0.0)
        bad += int(((~in_range).any(dim=-1) | dup | (diff > tol).any(dim=-1)).sum())
    return bad


def kernel_us(fn, iters=5):
    """GPU microseconds per call for each of the op's kernels (same-named launches summed)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            name = next((short for full, short in KERNELS.items() if full in evt.key), "other")
            totals[name] = round(totals.get(name, 0.0) + evt.device_time_total / iters, 1)
    return totals


def breakdown(op, q, k, weights, mask, scale, topk, cfg, thr):
    """Per-kernel µs of `op` (the variant's call); the filter and sample passes share a kernel name, so the filter
    kernel alone is timed with the sampled thresholds passed in, and the sample pass is the difference."""
    full = kernel_us(lambda: op(q, k, weights, None, mask, scale, topk, config=cfg))
    fixed = kernel_us(lambda: op(q, k, weights, None, mask, scale, topk, config=cfg, threshold=thr))
    out = dict(full)
    out["filter"] = fixed.get("filter", 0.0)
    out["sample_pass"] = round(full.get("filter", 0.0) - out["filter"], 1)
    return out


def run_variant(row, name, q, k, weights, mask, scale, topk, cfg, *, check=True, graph=False, filter_only=False):
    if elapsed() > BUDGET_S:
        RESULTS["skipped"].append(f"{row['label']}: {name}")
        return None
    rec = {"config": cfg}
    try:
        stats = {}
        op = indexer_topk_triton
        out = op(q, k, weights, None, mask, scale, topk, config=cfg, stats=stats)
        torch.cuda.synchronize()
        if check:
            rec["bad_rows"] = bad_rows(out, q, k, weights, mask, scale, topk)
            rec["repaired_rows"] = int(stats["repaired"].sum())
            rec["mean_candidates"] = round(float(stats["candidates"].float().mean()), 1)
        thr = stats["threshold"].reshape(q.shape[0], q.shape[1]).clone()
        if not filter_only:
            rec["ms"] = median_ms(lambda: op(q, k, weights, None, mask, scale, topk, config=cfg))
            rec["tflops"] = row["causal_gflop"] / rec["ms"]
            rec["pct_of_bf16_peak"] = 100 * rec["tflops"] / RESULTS["bf16_matmul_8192_tflops"]
        if graph:
            rec["graph_ms"] = do_bench_cudagraph(
                lambda: indexer_topk_triton(q, k, weights, None, mask, scale, topk, config=cfg), rep=100,
                return_mode="median")
        rec["kernels_us"] = breakdown(op, q, k, weights, mask, scale, topk, cfg, thr)
        if filter_only:
            rec = {key: rec[key] for key in ("config", "kernels_us")}
    except Exception as e:  # a variant that fails (compile, resources) is reported, not fatal
        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["variants"][name] = rec
    save()
    return rec


def prepare_shape(label, B, S, T, H, D, topk, seed, graph, compress=None):
    """Inputs of a shape and its default run; the row carries the tiles the autotuner picked."""
    q, k, weights, mask, scale = make_case(B, S, T, H, D, seed, compress)
    pairs = int(mask.sum()) if compress else None
    gflop = (2.0 * H * D * pairs if compress else flops(B, S, T, H, D, causal_offset=T - S)) / 1e9
    row = {"label": label, "B": B, "S": S, "T": T, "H": H, "D": D, "topk": topk, "dtype": "bf16",
           "compress": compress, "causal_gflop": gflop, "variants": {}, "picked_tiles": None}
    RESULTS["shapes"].append(row)
    # the default, or (if it fails to compile or run) the older filter variants, still autotuned
    for name, base in (("default", {}), ("default_tree", {"head_sum": "tree"}),
                       ("default_store_tree", {"append": "store", "head_sum": "tree"})):
        before = tuned_configs()
        default = run_variant(row, name, q, k, weights, mask, scale, topk, base or None, graph=graph)
        row["autotune"] = {key: v for key, v in tuned_configs().items() if before.get(key) != v}
        if default is None or "error" not in default:
            break
    if default is not None and "error" not in default:
        row["picked_tiles"] = next(
            (v for key, v in row["autotune"].items() if not key.startswith("last timings")), None)
    return row, (q, k, weights, mask, scale, topk), graph


def run_variants(prepared, variants):
    """Filter-kernel variants at the tiles the autotuner picked for the default (fixed tiles replace them)."""
    row, args, graph = prepared
    for name, extra in variants:
        if set(extra) & TILE_KEYS:
            run_variant(row, name, *args, extra, graph=graph)
            continue
        if row["picked_tiles"] is None:
            RESULTS["skipped"].append(f"{row['label']}: {name} (no tuned default)")
            continue
        run_variant(row, name, *args, {**row["picked_tiles"], **extra}, graph=graph,
                    check=extra.get("append") != "none", filter_only=extra.get("append") == "none")


def fmt_field(rec, key, spec):
    return format(rec[key], spec) if key in rec else "-"


# DeepSeek V4's CSA indexer at S=8192: 2048 compressed entries (m = 4), each query sees (s + 1) // 4 of them; the
# fixed tiles (autotuning off) beside the tuned default: queries per program x key tile x warps x stages.
V4_TILES = [(f"tiles q{bq} t{bt} w{w} s{st}", {"block_q": bq, "block_t": bt, "num_warps": w, "num_stages": st})
            for bq, bt, w, st in ((4, 128, 8, 3), (4, 64, 4, 3), (2, 64, 4, 3), (1, 64, 4, 4), (2, 128, 4, 2))]


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=None, help="labels to run (default: the V3.2 shapes)")
    args = parser.parse_args()
    RESULTS["bf16_matmul_8192_tflops"] = bf16_peak_tflops()
    shapes = {  # label: (B, S, T, H, D, topk, seed, CUDA-graph timing too[, V4 compression rate])
        "prefill S4096 T32768": (1, 4096, 32768, 64, 128, 2048, 1, False),
        "decode B8 S1 T131072": (8, 1, 131072, 64, 128, 2048, 2, True),
        "prefill S2048 T16384": (1, 2048, 16384, 64, 128, 2048, 3, False),
        "v4 csa S8192 T2048": (1, 8192, 2048, 64, 128, 512, 4, False, 4),
        "prefill S8192 T8192": (1, 8192, 8192, 64, 128, 2048, 5, False),
    }
    plan = [  # in priority order: whatever is left at BUDGET_S is skipped
        ("prefill S4096 T32768", [("fused_select", {"fuse_select": True}), ("store_append", {"append": "store"}),
                                  ("no_append", {"append": "none"})]),
        ("decode B8 S1 T131072", [("store_append", {"append": "store"})]),
        ("prefill S4096 T32768", [("tree_head_sum", {"head_sum": "tree"})]),
        ("prefill S2048 T16384", []),
        ("v4 csa S8192 T2048", [("fused_select", {"fuse_select": True}), ("no_append", {"append": "none"})]),
        ("v4 csa S8192 T2048", [("sampled threshold", {"every_key": False}),
                                ("sampled threshold, tiles q4 t64 w4 s3", {"every_key": False, **V4_TILES[1][1]})]),
        ("prefill S8192 T8192", [("sampled threshold", {"every_key": False})]),
        ("v4 csa S8192 T2048", V4_TILES),
    ]
    wanted = args.shapes or [label for label in shapes if not label.startswith("v4")]
    unknown = sorted(set(wanted) - set(shapes))
    if unknown:
        parser.error(f"unknown shapes {unknown}; valid: {list(shapes)}")
    plan = [(label, variants) for label, variants in plan if label in wanted]
    prepared = {}
    for label, variants in plan:
        try:
            if label not in prepared:
                if elapsed() > BUDGET_S:
                    RESULTS["skipped"].append(label)
                    continue
                prepared[label] = prepare_shape(label, *shapes[label])
            run_variants(prepared[label], variants)
        except Exception:  # one broken shape must not hide the others
            traceback.print_exc()
            RESULTS["errors"].append(label)
        save()
    RESULTS["decode_bytes_floor_ms"] = 8 * 131072 * 128 * 2 / 4.2e12 * 1e3
    RESULTS["wall_s"] = round(elapsed(), 1)
    save()

    print(f"bf16 peak {RESULTS['bf16_matmul_8192_tflops']:.0f} TFLOP/s; wall {RESULTS['wall_s']} s; "
          f"skipped {RESULTS['skipped']}; errors {RESULTS['errors']}")
    cols = ("ranges", "sample_pass", "threshold", "filter", "select", "repair")
    print(f"{'shape / variant':36s} {'ms':>7s} {'graph':>6s} {'%peak':>5s} {'bad':>4s} {'rep':>4s} "
          + " ".join(f"{c[:7]:>7s}" for c in cols))
    for row in RESULTS["shapes"]:
        for name, rec in row["variants"].items():
            if rec is None or "error" in rec:
                print(f"{row['label'] + ' ' + name:36s} ERROR {rec and rec.get('error', '')[:80]}")
                continue
            us = rec.get("kernels_us", {})
            fmt = functools.partial(fmt_field, rec)
            print(f"{row['label'][:22] + ' ' + name:36s} {fmt('ms', '7.3f'):>7s} {fmt('graph_ms', '6.3f'):>6s} "
                  f"{fmt('pct_of_bf16_peak', '5.1f'):>5s} {fmt('bad_rows', 'd'):>4s} {fmt('repaired_rows', 'd'):>4s} "
                  + " ".join(f"{us.get(c, 0.0):7.0f}" for c in cols))


if __name__ == "__main__":
    main()
