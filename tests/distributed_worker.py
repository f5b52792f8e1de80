"""One rank of the sharded-model parity check (launched by tests/test_distributed.py through torchrun).

Loads a tiny HF checkpoint sharded by transformers' tensor-parallel plan, then by its tensor- and expert-parallel
plan, compiles each with dsfuse, and compares its logits with the unsharded model run eagerly. Both plans run in one
launch, so the ranks start and load the unsharded model once. Rank 0 writes what it saw per plan as JSON.

With `--quantized` the checkpoint is a released-layout FP8 / FP4 one, loaded through `load_quantized_model` (the FP8
layers kept on the CPU, served by dsfuse's ops); each plan's eager logits are compared too, and rank 0 also compiles
the unsharded model, so the test can hold every family's site count to the unsharded compile's. With
`--misfit-checkpoint` it records how loading a checkpoint whose shards cut its scale blocks is refused.
"""

import argparse
import json

import torch
import torch.distributed as dist


def loader(checkpoint: str, quantized: bool):
    """`load(**sharding)`: the checkpoint's model in fp32 with grouped_mm experts, sharded as asked."""
    common = dict(dtype=torch.float32, experts_implementation="grouped_mm")
    if quantized:
        from dsfuse.models.quantized import load_quantized_model

        return lambda **sharding: load_quantized_model(checkpoint, **common, **sharding)
    from transformers import DeepseekV32ForCausalLM

    return lambda **sharding: DeepseekV32ForCausalLM.from_pretrained(checkpoint, **common, **sharding).eval()


def gathered(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def relative_error(logits: torch.Tensor, expected: torch.Tensor) -> float:
    return ((logits - expected).norm() / expected.norm()).item()


def compiled_logits(model, ids):
    """(the logits of `model` compiled with dsfuse, dsfuse's report of that compile)."""
    import dsfuse

    torch._dynamo.reset()
    dsfuse.reset_report()
    with torch.no_grad():
        logits = torch.compile(model, backend="dsfuse")(ids, use_cache=False).logits
    return logits, dsfuse.report()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--quantized", action="store_true")
    parser.add_argument("--seq", type=int, default=20)
    parser.add_argument("--misfit-checkpoint", help="a quantised checkpoint whose shards cut its scale blocks: its "
                        "load's error is recorded")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    from transformers.distributed import DistributedConfig

    load = loader(args.checkpoint, args.quantized)
    plans = {"tp": {"tp_plan": "auto"},
             "tp-ep": {"distributed_config": DistributedConfig(tp_size=world, tp_plan="auto", ep_size=world)}}
    full = load()
    ids = torch.randint(0, full.config.vocab_size, (2, args.seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full(ids, use_cache=False).logits
    unsharded = compiled_logits(full, ids)[1].counts if args.quantized and rank == 0 else None
    del full
    results = {}
    for name, sharding in plans.items():
        sharded = load(**sharding)
        if args.quantized:
            with torch.no_grad():
                eager_error = relative_error(sharded(ids, use_cache=False).logits, expected)
        logits, report = compiled_logits(sharded, ids)
        results[name] = {"errors": gathered(relative_error(logits, expected)), "counts": report.counts,
                         "near_misses": [m.reason for m in report.near_misses]}
        if args.quantized:
            results[name].update(eager_errors=gathered(eager_error), summary=report.summary(),
                                 sites=[[site.op, site.detail] for site in report.sites])
    refusal = None
    if args.misfit_checkpoint:
        try:
            loader(args.misfit_checkpoint, quantized=True)(tp_plan="auto")
        except ValueError as error:
            refusal = str(error)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"world": world, "plans": results, "unsharded_counts": unsharded, "refusal": refusal}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
