"""H200 benchmark of the hyper-connection ops (`dsfuse.hc_collapse`, `dsfuse.hc_head`, `dsfuse.hc_expand_mix`)
against HF's modules (`DeepseekV4HyperConnection`, `DeepseekV4HyperHead`, the exit of `DeepseekV4DecoderLayer`)
run eagerly and under torch.compile (Inductor), at T = 8192 tokens, hidden 4096, hc_mult 4, 20 Sinkhorn
iterations, bf16 streams (fp32 hyper-connection weights, as HF keeps them).

1. Agreement with HF eager: worst absolute difference and count of differing elements for every output
   (collapsed, post, comb, head, new streams), for dsfuse and for Inductor.
2. Timings: medians of `triton.testing.do_bench` (L2 flushed between runs) in ms, GB/s against the bytes each op
   must move (streams read once, the block input / output and new streams once: `bytes_moved`), and the fraction
   of a device-to-device copy's bandwidth measured in the same run; a launch sweep of each dsfuse kernel.
   `hc_collapse` / `hc_head` are swept on both paths: one_pass (`_hc_collapse_kernel`: block_t x num_stages) and
   two_pass, whose kernels are timed and swept apart (the projection, fn's split included, by a coordinate search
   over block_t {8,16,32,64}, block_k {64,128,256}, num_warps {4,8}, num_stages {2,3,4}, splits of K {1,2,4}
   (more than one: partials, then `_hc_mix_kernel`) from the default; the
   weighted sum, shared by both ops, over block_t {4,8,16}, block_d {128,256,512}, num_warps {4,8}), then the path
   end to end at the best of each. An op's row reports its best path; each path's best launch is printed.
   About 45 Triton compilations (~1-3 s each) plus 5 Inductor compiles: ~2-2.5 min on the H200 host
   (`--no-compile` skips Inductor, `--ops` picks ops).
3. The whole hyper-connection work of a 2-layer model from the best launches: as the pass emits it (the first
   collapse, each exit fused with the next collapse or the head: `hc_exit_collapse`, `hc_exit_head`) and as
   separate ops (4 collapses, 4 exits, 1 head).

    python benchmarks/hyper_connections_gpu.py             # on the GPU; writes $OUT/hyper_connections.json
    python benchmarks/hyper_connections_gpu.py --tiny      # CPU smoke run through Triton's interpreter
    python benchmarks/hyper_connections_gpu.py --ops hc_collapse,hc_head --no-compile   # the two paths only
    python benchmarks/hyper_connections_gpu.py --path-tokens 1 8 64 256 1024 8192   # each path by token count

`--path-tokens` times `hc_collapse` and `hc_head` on every path at its default launch (split_k also at a few
slice widths and row blocks) for each token count, against HF's modules run eagerly, and marks the path the
op picks by default (`SPLIT_K_MAX_TOKENS`): where the token thresholds come from. On the GPU each call is
replayed as a CUDA graph (`do_bench_cudagraph`): at decode sizes an event-timed call measures the host's
launch work, not the kernels (run 37: ~0.15 ms a call event-timed, 24 us of kernel time in the profile).
"""

import argparse
import json
import os
import sys
import time

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from triton.compiler.errors import CompilationError  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

from dsfuse.kernels import hyper_connections as hck  # noqa: E402

HBM_GB_PER_S = 4800  # the H200's HBM3e bandwidth (specification)
# Trimmed to the regions runs 23 and 26 found competitive (8 warps and 128-wide D chunks were 1.5-2x slower on the
# one-pass kernel; the fused exits' 64-wide chunks and 8 warps 2-20x): the benchmark stays near 2 minutes.
ONE_PASS_SWEEP = [dict(path="one_pass", block_t=t, block_d=64, num_warps=4, num_stages=s) for t in (16, 32)
                  for s in (1, 2, 3)]
# Coordinate searches from the default launch: (key, values) axes walked in order, each from the best so far.
PROJECT_AXES = (("block_t", (8, 16, 32, 64)), ("block_k", (64, 128, 256)), ("num_warps", (4, 8)),
                ("num_stages", (2, 3, 4)), ("splits", (1, 2, 4)))
WEIGHTED_SUM_AXES = (("block_t", (4, 8, 16)), ("block_d", (128, 256, 512)), ("num_warps", (4, 8)))
EXIT_SWEEP = [dict(block_t=t, block_d=d, num_warps=w) for t, d, w in
              ((4, 256, 4), (8, 128, 4), (4, 512, 8), (8, 256, 8), (16, 128, 8), (8, 128, 8))]
FUSED_SWEEP = [dict(block_t=t, block_d=32, num_warps=4) for t in (16, 32)]
PATH_OPS = ("hc_collapse", "hc_head")


def timer(device):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100)

    def cpu_time(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return cpu_time


def copy_gbps(device, bench):
    if device != "cuda":
        return None
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (bench(lambda: dst.copy_(src)) * 1e-3) / 1e9


def modules(hidden, hc, iters, device):
    config = DeepseekV4Config(hidden_size=hidden, hc_mult=hc, hc_sinkhorn_iters=iters)
    conn, head = DeepseekV4HyperConnection(config), DeepseekV4HyperHead(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (*conn.parameters(), *head.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if p.dim() == 2 else 0.5) + (1.0 if p.dim() == 1 and
                                                                                              p.numel() <= 3 else 0))
    return conn.to(device).float().eval(), head.to(device).float().eval()


def hf_exit(out, residual, post, comb):
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)


def exit_then(conn, out, residual, post, comb):
    """An exit and the next hyper-connection as HF runs them: (streams, collapsed, post, comb)."""
    streams = hf_exit(out, residual, post, comb)
    next_post, next_comb, collapsed = conn(streams)
    return streams, collapsed, next_post, next_comb


def agreement(got, want):
    got, want = got.float(), want.float()
    return {"max_abs": (got - want).abs().max().item() if got.numel() else 0.0,
            "differing": int((got != want).sum().item()), "elements": got.numel()}


def best(bench, launches):
    """(best ms, its launch, every launch's ms) over a sweep of keyword launches; a launch whose tiles do not fit
    the SM's shared memory (or that this Triton cannot compile) is listed with ms None."""
    timings = []
    for kw, fn in launches:
        try:
            timings.append((bench(fn), kw))
        except (OutOfResources, CompilationError):
            timings.append((None, kw))
    ms, kw = min((r for r in timings if r[0] is not None), key=lambda r: r[0])
    return ms, kw, [{"launch": k, "ms": t} for t, k in timings]


def coordinate_best(bench, make, start, axes):
    """best() over a coordinate search: `start`, then along each (key, values) axis the launches that change only
    that key of the best launch so far (each launch timed once)."""
    timings = {}

    def leader():
        return min((r for r in timings.values() if r[0] is not None), key=lambda r: r[0])[1]

    def time_one(kw):
        key = tuple(sorted(kw.items()))
        if key not in timings:
            try:
                timings[key] = (bench(make(kw)), kw)
            except (OutOfResources, CompilationError):
                timings[key] = (None, kw)

    time_one(start)
    for key, values in axes:
        base = leader()
        for value in values:
            time_one({**base, key: value})
    ms, kw = min((r for r in timings.values() if r[0] is not None), key=lambda r: r[0])
    return ms, kw, [{"launch": k, "ms": t} for t, k in timings.values()]


SPLIT_K_SWEEP = [dict(k_per_split=k, sum_block_t=t) for k in (128, 256, 512) for t in (1, 8)]


def paths_by_tokens(token_counts, hidden, n, iters, dtype, device, bench):
    """{op: {T: {launch name: ms}}} of the path ops at each token count, and the default path's name."""
    conn, head = modules(hidden, n, iters, device)
    eps = dict(norm_eps=conn.input_norm.eps, hc_eps=conn.hc_eps)
    weights = {"hc_collapse": (conn.fn, conn.base, conn.scale, iters),
               "hc_head": (head.hc_fn, head.hc_base, head.hc_scale, 1)}
    found = {op: {} for op in PATH_OPS}
    with torch.no_grad():
        for T in token_counts:
            x = torch.randn(1, T, n, hidden, device=device).to(dtype)
            for op in PATH_OPS:
                fn_, base_, scale_, op_iters = weights[op]
                launches = {"one_pass": dict(path="one_pass"), "two_pass": dict(path="two_pass"),
                            "split_k": dict(path="split_k")}
                launches.update({f"split_k {kw}": dict(path="split_k", **kw) for kw in SPLIT_K_SWEEP})
                row = {"eager": bench(lambda: conn(x) if op == "hc_collapse" else head(x))}
                for name, kw in launches.items():
                    row[name] = bench(lambda: hck._collapse_launch(x, fn_, base_, scale_, **eps,
                                                                   sinkhorn_iters=op_iters, head=op == "hc_head",
                                                                   **kw))
                default = hck._resolve_launch(op, hidden, T, {}, None, op == "hc_head", dtype)["path"]
                found[op][T] = {"ms": row, "default_path": default}
                best_name = min((k for k in row if k != "eager"), key=row.get)
                print(f"{op:12s} T={T:6d} default {default:8s} {row[default]:.4f} ms | one_pass "
                      f"{row['one_pass']:.4f} two_pass {row['two_pass']:.4f} split_k {row['split_k']:.4f} | best "
                      f"{best_name} {row[best_name]:.4f} | eager {row['eager']:.4f}", flush=True)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--hc", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: T=7, hidden 64, interpreter, no sweep")
    parser.add_argument("--no-compile", action="store_true", help="skip the Inductor baseline")
    parser.add_argument("--ops", default=None, help="comma list of ops to run (default: all five)")
    parser.add_argument("--path-tokens", type=int, nargs="*", default=None,
                        help="time each path of hc_collapse / hc_head at these token counts instead")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny:
        args.tokens, args.hidden = 7, 64
    T, D, n, iters, dtype = args.tokens, args.hidden, args.hc, args.iters, getattr(torch, args.dtype)
    bench = timer(device)
    if args.path_tokens:
        if device == "cuda":
            from triton.testing import do_bench_cudagraph

            bench = lambda fn: do_bench_cudagraph(fn, rep=50)  # noqa: E731
        found = paths_by_tokens(args.path_tokens, D, n, iters, dtype, device, bench)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "hyper_connections_paths.json"), "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
                           "hidden": D, "hc_mult": n, "iters": iters, "dtype": args.dtype,
                           "split_k_max_tokens": hck.SPLIT_K_MAX_TOKENS, "paths": found}, f, indent=1)
        return
    conn, head = modules(D, n, iters, device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, T, n, D, generator=gen, device=device).to(dtype)
    out = torch.randn(1, T, D, generator=gen, device=device).to(dtype)
    eps = dict(norm_eps=conn.input_norm.eps, hc_eps=conn.hc_eps)
    nbytes = hck.bytes_moved(T, n, D, dtype)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name()
              if device == "cuda" else "cpu (Triton interpreter)", "torch": torch.__version__,
              "triton": __import__("triton").__version__, "shape": dict(T=T, hidden=D, hc_mult=n, iters=iters,
                                                                          dtype=args.dtype),
              "bytes": nbytes, "copy_gbps": copy_gbps(device, bench), "ops": {}}

    with torch.no_grad():
        post, comb, collapsed = conn(x)
        want_head = head(x)
        want_exit = hf_exit(out, x, post, comb)
        next_post, next_comb, next_collapsed = conn(want_exit)
        next_conn = (next_collapsed, next_post, next_comb)
        next_head = head(want_exit)
        sources = {
            "hc_collapse": (lambda: conn(x), (collapsed, post, comb), lambda o: (o[2], o[0], o[1])),
            "hc_head": (lambda: head(x), (want_head,), lambda o: (o,)),
            "hc_expand_mix": (lambda: hf_exit(out, x, post, comb), (want_exit,), lambda o: (o,)),
            # an exit and the next hyper-connection (HF: two modules; dsfuse: one launch)
            "hc_exit_collapse": (lambda: exit_then(conn, out, x, post, comb), (want_exit, *next_conn),
                                 lambda o: o),
            "hc_exit_head": (lambda: head(hf_exit(out, x, post, comb)), (next_head,), lambda o: (o,)),
        }
        compiled = {}
        if not args.no_compile:
            compiled = {"hc_collapse": torch.compile(conn), "hc_head": torch.compile(head),
                        "hc_expand_mix": torch.compile(hf_exit),
                        "hc_exit_collapse": torch.compile(lambda *a: exit_then(conn, *a)),
                        "hc_exit_head": torch.compile(lambda *a: head(hf_exit(*a)))}
        exit_args = (out, x, post, comb)
        fn_args = {"hc_collapse": (x,), "hc_head": (x,), "hc_expand_mix": exit_args, "hc_exit_collapse": exit_args,
                   "hc_exit_head": exit_args}
        sweeps = {"hc_collapse": ONE_PASS_SWEEP, "hc_head": ONE_PASS_SWEEP, "hc_expand_mix": EXIT_SWEEP,
                  "hc_exit_collapse": FUSED_SWEEP, "hc_exit_head": FUSED_SWEEP}
        project_start = {op: {k: v for k, v in hck.default_collapse_launch(D, "two_pass", op == "hc_head").items()
                              if k in ("block_t", "block_k", "num_warps", "num_stages", "splits")} for op in PATH_OPS}
        two_pass_default = hck.default_collapse_launch(D, "two_pass")
        sum_start = dict(block_t=two_pass_default["sum_block_t"], block_d=two_pass_default["sum_block_d"],
                         num_warps=two_pass_default["sum_num_warps"])
        project_axes, sum_axes = PROJECT_AXES, WEIGHTED_SUM_AXES
        if args.tiny:
            sweeps = {k: [dict(block_d=16, **({"path": "one_pass"} if k in PATH_OPS else {}))] for k in sweeps}
            project_start = {op: dict(block_t=16, block_k=32) for op in PATH_OPS}
            sum_start = dict(block_t=4, block_d=16)
            project_axes = sum_axes = ()
        ops_run = args.ops.split(",") if args.ops else list(sources)
        unknown = sorted(set(ops_run) - set(sources))
        if unknown:
            parser.error(f"unknown ops {unknown}; valid: {list(sources)}")
        weights = {"hc_collapse": (conn.fn, conn.base, conn.scale),
                   "hc_head": (head.hc_fn, head.hc_base, head.hc_scale)}
        weighted_sum = {}

        def two_pass(op):
            """The two-pass path of a path op: each kernel swept alone (the weighted sum once for both ops: same
            kernel, same shapes), then the path end to end at the best of both."""
            fn_, base_, scale_ = weights[op]

            def project(kw):
                return lambda: hck.hc_project_triton(x, fn_, base_, scale_, **eps, sinkhorn_iters=iters,
                                                     head=op == "hc_head", **kw)

            p_ms, p_kw, p_sweep = coordinate_best(bench, project, project_start[op], project_axes)
            if not weighted_sum:
                pre = hck.hc_project_triton(x, fn_, base_, scale_, **eps, sinkhorn_iters=iters)[0]
                w_ms, w_kw, w_sweep = coordinate_best(
                    bench, lambda kw: lambda: hck.hc_weighted_sum_triton(x, pre, **kw), sum_start, sum_axes)
                weighted_sum.update(ms=w_ms, launch=w_kw, sweep=w_sweep)
            launch = {"path": "two_pass", **p_kw, **{f"sum_{k}": v for k, v in weighted_sum["launch"].items()}}
            fn = dsfuse_launch(op, launch)
            return {"ms": bench(fn), "launch": launch, "vs_eager": [agreement(g, w) for g, w in zip(fn(), want)],
                    "split_ms": bench(lambda: hck.split_projection_weights(fn_)) if x.dtype == torch.bfloat16
                    else None,
                    "projection": {"ms": p_ms, "launch": p_kw, "sweep": p_sweep}, "weighted_sum": weighted_sum}

        def dsfuse_launch(op, kw):
            if op == "hc_collapse":
                return lambda: hck.hc_collapse_triton(x, conn.fn, conn.base, conn.scale, **eps,
                                                      sinkhorn_iters=iters, **kw)
            if op == "hc_head":
                return lambda: (hck.hc_head_triton(x, head.hc_fn, head.hc_base, head.hc_scale, **eps, **kw),)
            if op == "hc_exit_collapse":
                return lambda: hck.hc_exit_collapse_triton(out, x, post, comb, conn.fn, conn.base, conn.scale, **eps,
                                                           sinkhorn_iters=iters, **kw)
            if op == "hc_exit_head":
                return lambda: (hck.hc_exit_head_triton(out, x, post, comb, head.hc_fn, head.hc_base, head.hc_scale,
                                                        **eps, **kw),)
            return lambda: (hck.hc_expand_mix_triton(out, x, post, comb, **kw),)

        for op in ops_run:
            eager_fn, want, names = sources[op]
            row = {"bytes": nbytes[op]}
            got = dsfuse_launch(op, {})()
            row["dsfuse_vs_eager"] = [agreement(g, w) for g, w in zip(got, want)]
            row["eager_ms"] = bench(eager_fn)
            if op in compiled:
                fn = compiled[op]
                produced = names(fn(*fn_args[op]))
                row["inductor_vs_eager"] = [agreement(g, w) for g, w in zip(produced, want)]
                row["inductor_ms"] = bench(lambda: fn(*fn_args[op]))
            ms, kw, sweep = best(bench, [(kw, dsfuse_launch(op, kw)) for kw in sweeps[op]])
            if op in PATH_OPS:
                row["paths"] = {"one_pass": {"ms": ms, "launch": kw}, "two_pass": two_pass(op)}
                for path, found in row["paths"].items():
                    extra = "" if path == "one_pass" else (
                        f" (projection alone {found['projection']['ms']:.4f} ms, weighted sum alone "
                        f"{found['weighted_sum']['ms']:.4f} ms, fn split {found['split_ms'] or 0:.4f} ms)")
                    print(f"{op:14s} {path}: best {found['ms']:8.4f} ms launch {found['launch']}{extra}", flush=True)
                ms, kw = min(((p["ms"], p["launch"]) for p in row["paths"].values()), key=lambda r: r[0])
            row.update(dsfuse_ms=ms, dsfuse_launch=kw, sweep=sweep, dsfuse_gbps=nbytes[op] / (ms * 1e-3) / 1e9)
            row["fraction_of_hbm"] = row["dsfuse_gbps"] / HBM_GB_PER_S
            if result["copy_gbps"]:
                row["fraction_of_copy"] = row["dsfuse_gbps"] / result["copy_gbps"]
            for base in ("eager", "inductor"):
                if f"{base}_ms" in row:
                    row[f"speedup_vs_{base}"] = row[f"{base}_ms"] / ms
            result["ops"][op] = row
            print(f"{op:14s} dsfuse {ms:8.4f} ms ({row['dsfuse_gbps']:7.1f} GB/s, {row['fraction_of_hbm']:.2f} of "
                  f"HBM) eager {row['eager_ms']:8.4f} ms inductor {row.get('inductor_ms', float('nan')):8.4f} ms "
                  f"launch {kw} agreement {row['dsfuse_vs_eager']}", flush=True)

    ops = result["ops"]
    layers = 2
    # What the pass emits for 2 layers: the first collapse, 3 exits fused with the next collapse, the last exit
    # fused with the head; the separate ops' total beside it (HF's modules compose the same way).
    plans = {"fused": {"hc_collapse": 1, "hc_exit_collapse": 2 * layers - 1, "hc_exit_head": 1},
             "separate": {"hc_collapse": 2 * layers, "hc_expand_mix": 2 * layers, "hc_head": 1}}
    result["two_layer_model"] = {}
    for plan, sites in plans.items():
        if not all(op in ops for op in sites):
            continue
        model = {"launches": sites}
        for provider in ("dsfuse", "inductor", "eager"):
            if all(f"{provider}_ms" in ops[op] for op in sites):
                model[f"{provider}_ms"] = sum(k * ops[op][f"{provider}_ms"] for op, k in sites.items())
        total_bytes = sum(k * nbytes[op] for op, k in sites.items())
        model.update(bytes=total_bytes, floor_ms_at_hbm=total_bytes / (HBM_GB_PER_S * 1e9) * 1e3,
                     dsfuse_gbps=total_bytes / (model["dsfuse_ms"] * 1e-3) / 1e9)
        model["dsfuse_fraction_of_hbm"] = model["dsfuse_gbps"] / HBM_GB_PER_S
        result["two_layer_model"][plan] = model
        print(f"2-layer model hyper-connection work, {plan} launches: {json.dumps(model)}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "hyper_connections.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
