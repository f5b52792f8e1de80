"""dsfuse's own model (models/official.py, `own-v32-2l`: V3.2 shapes, 2 layers, FP4 experts) on one GPU: prefill
under eager, Inductor and dsfuse in one process, ms per step, distance to eager, the sites rewritten and the
glue kernels launched per step (from a profile).

    python3 benchmarks/own_model_gpu.py [--seq 2048 8192] [--json $OUT/own_model.json]
    python3 benchmarks/own_model_gpu.py --preset own-tiny --device cpu --seq 16     (a smoke run without a GPU)
"""

import argparse
import json
import os
import pathlib
import time

import torch

import dsfuse
from dsfuse.bench import environment, time_ms
from dsfuse.models import build_own_model



def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def glue_launches(fn) -> dict[str, int]:
    """dsfuse's glue kernels (`_launch_*`, one per launch group) launched by one call, with counts."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name.startswith("_launch_"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--preset", default="own-v32-2l")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args()
    snapshot = pathlib.Path(__file__).resolve().parents[1] / ".commit"  # a `git archive` snapshot names its commit
    if snapshot.exists():
        os.environ.setdefault("DSFUSE_COMMIT", snapshot.read_text().strip())
    torch.manual_seed(0)
    model = build_own_model(args.preset, dtype=torch.bfloat16, device=args.device)
    results = {"env": environment(), "preset": args.preset, "runs": []}
    print(results["env"])
    compiled = {"inductor": torch.compile(model, dynamic=False),
                "dsfuse": torch.compile(model, backend="dsfuse", dynamic=False)}
    for seq in args.seq:
        ids = torch.randint(0, model.config.vocab_size, (1, seq), device=args.device)
        with torch.no_grad():
            want = model(ids).logits
            row = {"seq": seq, "eager_ms": time_ms(lambda: model(ids), args.device, args.rep_ms)}
            for name, fn in compiled.items():
                dsfuse.reset_report()
                start = time.time()
                got = fn(ids).logits
                row[f"{name}_first_call_s"] = round(time.time() - start, 1)
                row[f"{name}_ms"] = time_ms(lambda fn=fn: fn(ids), args.device, args.rep_ms)
                row[f"{name}_rel_l2_vs_eager"] = rel_l2(got, want)
                if name == "dsfuse":
                    row["rewritten"] = {k: v for k, v in dsfuse.report().counts.items() if v}
                    row["near_misses"] = [m.reason for m in dsfuse.report().near_misses]
                if args.device.startswith("cuda"):
                    row[f"{name}_glue_launches"] = glue_launches(lambda fn=fn: fn(ids))
        row["dsfuse_vs_inductor"] = row["inductor_ms"] / row["dsfuse_ms"]
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
        print(f"S={seq}: eager {row['eager_ms']:.2f} ms, Inductor {row['inductor_ms']:.2f}, "
              f"dsfuse {row['dsfuse_ms']:.2f} ({row['dsfuse_vs_inductor']:.2f}x); "
              f"rel_l2 vs eager: Inductor {row['inductor_rel_l2_vs_eager']:.2e}, dsfuse {row['dsfuse_rel_l2_vs_eager']:.2e}; sites {row['rewritten']}", flush=True)
        del ids, want
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
