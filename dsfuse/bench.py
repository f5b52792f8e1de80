"""Benchmarks: eager, Inductor and dsfuse side by side in one process.

    python -m dsfuse.bench model --preset v32-real-2l --seq 2048 8192
    python -m dsfuse.bench model --preset tiny --seq 32 --device cpu      # smoke run
    python -m dsfuse.bench model --profile --json r.json --markdown r.md  # keep the results
    python -m dsfuse.bench plot r.json --out r.png                        # speedup vs S, time by stage

Every configuration is checked before it is timed: dsfuse with all passes off must reproduce Inductor
bit for bit, and every compiled model is compared with eager. Times are medians of
`triton.testing.do_bench` (CUDA) or of wall-clock repeats (CPU); an out-of-memory configuration is
reported as such.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

import dsfuse
from dsfuse.bench_report import families_markdown, model_markdown, plot_model, progress
from dsfuse.config import PASS_NAMES

CONFIGS: dict[str, tuple[str | None, dict | None]] = {
    "eager": (None, None),
    "inductor": ("inductor", None),
    "dsfuse-off": ("dsfuse", {"disable": list(PASS_NAMES)}),
    "dsfuse": ("dsfuse", None),
}


def resolve_configs(names: list[str]) -> dict[str, tuple[str | None, dict | None]]:
    """`CONFIGS` entries plus ablations: `only:PASS` runs one pass alone, `no:PASS` all but one."""
    resolved = {}
    for name in names:
        kind, _, pass_name = name.partition(":")
        if name in CONFIGS:
            resolved[name] = CONFIGS[name]
        elif kind in ("only", "no") and pass_name in PASS_NAMES:
            resolved[name] = ("dsfuse", {"enable" if kind == "only" else "disable": [pass_name]})
        else:
            raise ValueError(f"unknown config {name!r}; valid: {', '.join(CONFIGS)}, only:PASS, no:PASS "
                             f"with PASS in {', '.join(PASS_NAMES)}")
    return resolved


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def environment() -> dict:
    import triton

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "device": "cpu"}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    return env


def time_ms(fn: Callable[[], object], device: str, rep_ms: int) -> float:
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(rep_ms // 4, 25), rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _device_us(event, self_only: bool) -> float:
    for name in (("self_device_time_total", "self_cuda_time_total") if self_only
                 else ("device_time_total", "cuda_time_total")):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profile_stages(fn: Callable[[], object], top: int = 12) -> dict:
    """GPU time of one call by kernel, and the share of each dsfuse fused op."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = list(prof.key_averages())
    # Only device-side events are kernels: an operator's own self device time repeats its kernels'.
    kernels = [(e.key, _device_us(e, True)) for e in events
               if e.device_type != torch.autograd.DeviceType.CPU and _device_us(e, True) > 0]
    total = sum(us for _, us in kernels)
    fused = {e.key: _device_us(e, False) for e in events if e.key.startswith("dsfuse::")}
    return {
        "gpu_ms": total / 1e3,
        "dsfuse_ops_ms": {k: v / 1e3 for k, v in fused.items()},
        "dsfuse_ops_share": {k: v / total for k, v in fused.items()} if total else {},
        "top_kernels_ms": [(k[:80], us / 1e3) for k, us in sorted(kernels, key=lambda kv: -kv[1])[:top]],
    }


def _compiled(model, backend: str | None, options: dict | None):
    if backend is None:
        return model
    torch._dynamo.reset()
    return torch.compile(model, backend=backend, options=options) if options else torch.compile(model, backend=backend)


def bench_model(args) -> dict:
    from dsfuse.models.presets import build_hf_model

    dtype = getattr(torch, args.dtype)
    cuda = args.device.startswith("cuda")
    model = build_hf_model(args.preset, dtype=dtype, device=args.device, attn_implementation=args.attn)
    results = {"env": environment(), "preset": args.preset, "dtype": args.dtype, "batch": args.batch, "runs": []}
    print(f"# {results['env']} preset={args.preset} dtype={args.dtype} batch={args.batch}", flush=True)
    bar = progress(len(args.seq) * len(args.configs), f"{args.preset} prefill")
    for seq in args.seq:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, seq), device=args.device,
                            generator=torch.Generator(args.device).manual_seed(seq))
        outputs: dict[str, torch.Tensor] = {}
        for name, (backend, options) in args.configs.items():
            bar.set_postfix_str(f"S={seq} {name}")
            row = {"seq": seq, "config": name}
            try:
                fn = _compiled(model, backend, options)
                dsfuse.reset_report()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                with torch.no_grad():
                    start = time.perf_counter()
                    logits = fn(ids).logits
                    if cuda:
                        torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - start, 2)
                    if cuda:
                        row["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
                    row["ms"] = time_ms(lambda: fn(ids), args.device, args.rep_ms)
                    if name == "inductor":
                        row["deterministic"] = bool(torch.equal(fn(ids).logits, logits))
                row["tok_per_s"] = args.batch * seq / row["ms"] * 1e3
                if args.profile and cuda:
                    with torch.no_grad():
                        row["profile"] = profile_stages(lambda: fn(ids))
                if backend == "dsfuse":
                    row["rewritten"] = dsfuse.report().counts
                outputs[name] = logits.float()
                del logits
            except torch.OutOfMemoryError:
                row["ms"] = None
                row["error"] = "out of memory"
            except Exception as err:  # a broken configuration is reported, the others still run
                row["ms"] = None
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            results["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            if "profile" in row:
                prof = row["profile"]
                shares = ", ".join(f"{k} {v:.1%}" for k, v in prof["dsfuse_ops_share"].items())
                print(f"  profile: {prof['gpu_ms']:.2f} ms GPU; fused ops: {shares or 'none'}", flush=True)
                for kernel, ms in prof["top_kernels_ms"][:8]:
                    print(f"    {ms:8.3f} ms  {kernel}", flush=True)
            bar.update()
        _check_parity(outputs, seq, results)
        outputs.clear()
        if cuda:
            torch.cuda.empty_cache()
    bar.close()
    _print_table(results)
    return results


def matmul_peak_tflops(device: str) -> float | None:
    """bf16 8192^3 matmul rate measured now: the ceiling the families are compared with."""
    if not device.startswith("cuda"):
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, device, 300)
    return 2 * 8192**3 / ms / 1e9


def _agreement(out: torch.Tensor, ref: torch.Tensor) -> dict:
    if out.dtype == torch.bool:
        return {"agreement": (out == ref).float().mean().item()}
    out, ref = out.float(), ref.float()
    return {"rel_l2": ((out - ref).norm() / ref.norm()).item()}


def bench_families(args) -> dict:
    from dsfuse.families import families

    dtype = getattr(torch, args.dtype)
    results = {"env": environment(), "size": args.size, "dtype": args.dtype, "rows": []}
    peak = matmul_peak_tflops(args.device)
    results["bf16_matmul_tflops"] = peak
    print(f"# {results['env']} size={args.size} bf16 matmul peak={peak and round(peak)} TFLOP/s", flush=True)
    all_families = families(args.size, args.device, dtype)
    bar = progress(len(all_families) * len(args.configs), "families")
    for family in all_families:
        inputs = family.make_inputs()
        reference = family.fn(*inputs)
        for name, (backend, options) in args.configs.items():
            bar.set_postfix_str(f"{family.name} {name}")
            row = {"family": family.name, "shape": family.shape, "config": name}
            try:
                fn = _compiled(family.fn, backend, options)
                dsfuse.reset_report()
                with torch.no_grad():
                    out = fn(*inputs)
                    row["ms"] = time_ms(lambda: fn(*inputs), args.device, args.rep_ms)
                row["tflops"] = family.flops / row["ms"] / 1e9
                if peak:
                    row["pct_peak"] = 100 * row["tflops"] / peak
                row.update(_agreement(out, reference))
                if backend == "dsfuse":
                    row["rewritten"] = dsfuse.report().counts[family.pass_name]
            except Exception as err:  # a broken configuration is reported, the others still run
                row["ms"] = None
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            bar.update()
    bar.close()
    base = {r["family"]: r["ms"] for r in results["rows"] if r["config"] == "inductor" and r.get("ms")}
    print(f"\n{'family':<34} {'shape':<30} {'config':<11} {'ms':>9} {'TFLOP/s':>8} {'% peak':>7} {'vs Ind.':>7}  check")
    for r in results["rows"]:
        ms = r.get("ms")
        check = r.get("error") or (f"agree {r['agreement']:.4f}" if "agreement" in r else f"rel_l2 {r.get('rel_l2', float('nan')):.2e}")
        if "rewritten" in r:
            check += f", rewritten {r['rewritten']}"
        ratio = f"{base[r['family']] / ms:.2f}x" if ms and r["family"] in base else "-"
        print(f"{r['family']:<34} {r['shape']:<30} {r['config']:<11} {round(ms, 3) if ms else '-'!s:>9} "
              f"{round(r['tflops']) if ms else '-'!s:>8} {round(r['pct_peak'], 1) if 'pct_peak' in r else '-'!s:>7} "
              f"{ratio:>7}  {check}")
    return results


def _check_parity(outputs: dict[str, torch.Tensor], seq: int, results: dict) -> None:
    reference = outputs.get("eager")
    for row in results["runs"]:
        if row["seq"] != seq or row["config"] not in outputs:
            continue
        out = outputs[row["config"]]
        if reference is not None:
            row["rel_l2_vs_eager"] = ((out - reference).norm() / reference.norm()).item()
        if row["config"] == "dsfuse-off" and "inductor" in outputs:
            row["bitwise_equal_to_inductor"] = bool(torch.equal(out, outputs["inductor"]))


def _print_table(results: dict) -> None:
    base = {(r["seq"]): r["ms"] for r in results["runs"] if r["config"] == "inductor" and r.get("ms")}
    print(f"\n{'S':>6} {'config':<11} {'ms':>9} {'tok/s':>10} {'vs Inductor':>11} {'peak GiB':>9} {'rel_l2 eager':>12}  notes")
    for r in results["runs"]:
        ms = r.get("ms")
        ratio = f"{base[r['seq']] / ms:.2f}x" if ms and r["seq"] in base else "-"
        notes = r.get("error", "")
        if "deterministic" in r:
            notes += f"run twice bitwise equal: {r['deterministic']}"
        if "bitwise_equal_to_inductor" in r:
            notes += f"bitwise==inductor: {r['bitwise_equal_to_inductor']}"
        if r.get("rewritten"):
            notes += " rewritten " + ",".join(f"{k}={v}" for k, v in r["rewritten"].items() if v)
        print(f"{r['seq']:>6} {r['config']:<11} {ms if ms is None else round(ms, 2)!s:>9} "
              f"{round(r['tok_per_s']) if ms else '-'!s:>10} {ratio:>11} {r.get('peak_extra_gib', '-')!s:>9} "
              f"{r.get('rel_l2_vs_eager', float('nan')):>12.3e}  {notes}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model", help="whole-model prefill: eager / Inductor / dsfuse")
    model.add_argument("--preset", default="v32-real-2l")
    model.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    model.add_argument("--batch", type=int, default=1)
    model.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    model.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    model.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    model.add_argument("--configs", default=",".join(CONFIGS),
                       help=f"comma list of {', '.join(CONFIGS)}, only:PASS (one pass alone), no:PASS (all but one)")
    model.add_argument("--rep-ms", type=int, default=1000)
    model.add_argument("--json", default=None, help="write results here")
    model.add_argument("--markdown", default=None, help="write a Markdown table here (and time by stage with --profile)")
    model.add_argument("--profile", action="store_true", help="add a per-kernel GPU-time breakdown of one call")
    fam = sub.add_parser("families", help="each fused family's source subgraph: eager / Inductor / dsfuse")
    fam.add_argument("--size", default=None, choices=("real", "tiny"), help="default: real on CUDA, tiny on CPU")
    fam.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    fam.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    fam.add_argument("--configs", default="eager,inductor,dsfuse")
    fam.add_argument("--rep-ms", type=int, default=300)
    fam.add_argument("--json", default=None, help="write results here")
    fam.add_argument("--markdown", default=None, help="write a Markdown table here")
    plot = sub.add_parser("plot", help="figure from a `model --json` file: speedup vs S, GPU time by stage (matplotlib)")
    plot.add_argument("results", help="JSON written by `model --json`")
    plot.add_argument("--out", required=True, help="image to write, e.g. bench.png")
    args = parser.parse_args(argv)
    if args.command == "plot":
        with open(args.results) as f:
            results = json.load(f)
        try:
            plot_model(results, args.out)
        except ValueError as err:
            parser.error(f"{args.results}: {err}")
        print(f"wrote {args.out}")
        return 0
    if args.command == "families":
        args.size = args.size or ("real" if args.device.startswith("cuda") else "tiny")
        args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
        args.configs = resolve_configs([c for c in args.configs.split(",") if c])
        results = bench_families(args)
        _write(results, args.json, args.markdown, families_markdown)
        return 0
    try:
        args.configs = resolve_configs([c for c in args.configs.split(",") if c])
    except ValueError as err:
        parser.error(str(err))
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    results = bench_model(args)
    _write(results, args.json, args.markdown, model_markdown)
    return 0


def _write(results: dict, json_path: str | None, markdown_path: str | None, to_markdown) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(to_markdown(results))


if __name__ == "__main__":
    sys.exit(main())
