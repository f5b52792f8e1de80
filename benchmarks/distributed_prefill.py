"""Prefill throughput of a sharded DeepSeek model: eager / Inductor / dsfuse, one process per device.

    torchrun --nproc_per_node 4 benchmarks/distributed_prefill.py --preset v32-real-2l --ep --seq 2048 8192
    torchrun --nproc_per_node 2 benchmarks/distributed_prefill.py --preset tiny --seq 16     # CPU, gloo
    python -m dsfuse.bench checkpoint --preset v32-real-2l --out v32fp8                     # released FP8 layout,
    torchrun --nproc_per_node 2 benchmarks/distributed_prefill.py --checkpoint v32fp8 --ep    # then sharded

The model is loaded with transformers' tensor-parallel plan (`tp_plan="auto"`) and, with `--ep`, its
expert-parallel plan across all ranks; a random bf16 checkpoint of the preset is written first when
`--checkpoint` does not exist yet. A checkpoint in a released quantised layout (its config.json has an fp8
`quantization_config`: V3.2 / GLM-5 FP8, V4-Flash FP8 + FP4) loads through `load_quantized_model`, its quantised
layers served by dsfuse's ops, and each dsfuse row says which kernels served them. Rank 0 prints a table and
writes `--json`.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends), as the shared GPU hosts require.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(name, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def timed_ms(fn, cuda: bool, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def quantized_layers_note(report) -> str:
    """The graph note in which dsfuse's backend says which kernels served the quantised layers ("" when none has)."""
    notes = (part for graph in report.graphs for part in graph.note.split("; "))
    return next((note for note in notes if note.startswith("quantised layers")), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--checkpoint", default=None, help="directory (written from the preset if missing)")
    parser.add_argument("--seq", type=int, nargs="+", default=[16])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ep", action="store_true", help="expert parallel over all ranks (ep_size = world size)")
    parser.add_argument("--configs", default="eager,inductor,dsfuse")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import dsfuse
    from dsfuse.models.checkpoint import write_random_checkpoint
    from dsfuse.models.quantized import load_quantized_model

    dtype = torch.bfloat16 if cuda else torch.float32
    checkpoint = Path(args.checkpoint or f"/tmp/dsfuse_{args.preset}_checkpoint")
    if rank == 0 and not (checkpoint / "config.json").exists():
        write_random_checkpoint(args.preset, checkpoint, kind="hf", seed=0, dtype=dtype, device="cuda" if cuda else "cpu")
    dist.barrier()
    sharding = ({"distributed_config": DistributedConfig(tp_size=world, tp_plan="auto", ep_size=world)} if args.ep
                else {"tp_plan": "auto"})
    quantized = "quantization_config" in json.loads((checkpoint / "config.json").read_text())
    load = load_quantized_model if quantized else AutoModelForCausalLM.from_pretrained
    model = load(checkpoint, dtype=dtype, experts_implementation="grouped_mm", **sharding).eval()
    device = model.device
    rows = []
    for seq in args.seq:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, seq), device=device,
                            generator=torch.Generator(device).manual_seed(seq))
        for config in [c for c in args.configs.split(",") if c]:
            torch._dynamo.reset()
            dsfuse.reset_report()
            fn = model if config == "eager" else torch.compile(model, backend=config)
            row = {"seq": seq, "config": config, "world": world, "ep": args.ep}
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            try:
                with torch.no_grad():
                    row["ms"] = timed_ms(lambda: fn(ids), cuda, args.repeats)
                row["tok_per_s_per_device"] = args.batch * seq / row["ms"] * 1e3 / world
                if config == "dsfuse":
                    row["rewritten"] = dsfuse.report().counts
                    if quantized:
                        row["quantized_layers"] = quantized_layers_note(dsfuse.report())
                if cuda:
                    row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30  # this config only
            except torch.OutOfMemoryError:
                row["ms"], row["error"] = None, "out of memory"
            rows.append(row)
    if rank == 0:
        print(f"{'S':>6} {'config':<9} {'ms':>9} {'tok/s/device':>13}  notes")
        for r in rows:
            ms = r["ms"]
            notes = r.get("error") or " ".join(
                [",".join(f"{k}={v}" for k, v in r.get("rewritten", {}).items() if v), r.get("quantized_layers", "")])
            print(f"{r['seq']:>6} {r['config']:<9} {round(ms, 2) if ms else '-'!s:>9} "
                  f"{round(r['tok_per_s_per_device']) if ms else '-'!s:>13}  {notes}")
        if args.json:
            Path(args.json).write_text(json.dumps({"preset": args.preset, "checkpoint": str(checkpoint),
                                                   "quantized": quantized, "device": "cuda" if cuda else "cpu",
                                                   "torch": torch.__version__, "rows": rows}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
