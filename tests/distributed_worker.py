"""One rank of the sharded-model parity check (launched by tests/test_distributed.py through torchrun).

Loads the tiny HF checkpoint sharded by transformers' tensor-parallel plan, then by its tensor- and expert-parallel
plan, compiles each with dsfuse, and compares its logits with the unsharded model run eagerly. Both plans run in one
launch, so the ranks start and load the unsharded model once. Rank 0 writes what it saw per plan as JSON.
"""

import argparse
import json

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    from transformers import DeepseekV32ForCausalLM
    from transformers.distributed import DistributedConfig

    import dsfuse

    common = dict(dtype=torch.float32, experts_implementation="grouped_mm")
    plans = {"tp": {"tp_plan": "auto"},
             "tp-ep": {"distributed_config": DistributedConfig(tp_size=world, tp_plan="auto", ep_size=world)}}
    full = DeepseekV32ForCausalLM.from_pretrained(args.checkpoint, **common).eval()
    ids = torch.randint(0, full.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full(ids).logits
    results = {}
    for name, sharding in plans.items():
        sharded = DeepseekV32ForCausalLM.from_pretrained(args.checkpoint, **common, **sharding).eval()
        torch._dynamo.reset()
        dsfuse.reset_report()
        with torch.no_grad():
            logits = torch.compile(sharded, backend="dsfuse")(ids).logits
        error = ((logits - expected).norm() / expected.norm()).item()
        errors = [None] * world
        dist.all_gather_object(errors, error)
        results[name] = {"errors": errors, "counts": dsfuse.report().counts,
                         "near_misses": [m.reason for m in dsfuse.report().near_misses]}
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"world": world, "plans": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
