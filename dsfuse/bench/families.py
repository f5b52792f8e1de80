"""`families`: each fused family's source subgraph (`dsfuse.families`) alone, eager / Inductor / dsfuse, against
the bf16 matmul rate measured in the same process."""

from __future__ import annotations

import json

import torch

import dsfuse
from dsfuse.bench.measure import compile_with, environment, error_text, time_ms
from dsfuse.bench.report import progress


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
                fn = compile_with(family.fn, backend, options)
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
                row["error"] = error_text(err)
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


