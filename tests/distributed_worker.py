"""One rank of the sharded-model parity check (launched by tests/test_distributed.py through torchrun).

Loads the tiny HF checkpoint sharded by transformers' tensor-parallel plan (and its expert-parallel plan
with --ep), compiles it with dsfuse, and compares its logits with the unsharded model run eagerly.
Rank 0 writes what it saw as JSON.
"""

import argparse
import json

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--ep", action="store_true", help="expert parallel across all ranks as well")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    from transformers import DeepseekV32ForCausalLM
    from transformers.distributed import DistributedConfig

    import dsfuse

    common = dict(dtype=torch.float32, experts_implementation="grouped_mm")
    sharding = ({"distributed_config": DistributedConfig(tp_size=world, tp_plan="auto", ep_size=world)} if args.ep
                else {"tp_plan": "auto"})
    sharded = DeepseekV32ForCausalLM.from_pretrained(args.checkpoint, **common, **sharding).eval()
    full = DeepseekV32ForCausalLM.from_pretrained(args.checkpoint, **common).eval()
    ids = torch.randint(0, full.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full(ids).logits
        dsfuse.reset_report()
        logits = torch.compile(sharded, backend="dsfuse")(ids).logits
    error = ((logits - expected).norm() / expected.norm()).item()
    errors = [None] * world
    dist.all_gather_object(errors, error)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"world": world, "errors": errors, "counts": dsfuse.report().counts,
                       "near_misses": [m.reason for m in dsfuse.report().near_misses]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
