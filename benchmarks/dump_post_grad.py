"""Write the post-grad graph Inductor hands to dsfuse's passes, for the HF tiny preset on this device.

    python benchmarks/dump_post_grad.py --out graphs/ [--attn sdpa|eager] [--dtype bfloat16] [--decode] [--batch 2]

SDPA lowers to different aten ops on CPU and CUDA; matchers are written against both dumps.
"""

import argparse
from pathlib import Path

import torch
from torch._inductor import config as inductor_config

from dsfuse.models.presets import build_hf_model


def run_model(model, backend: str, ids: torch.Tensor, decode: bool) -> None:
    """One compiled forward, or (decode) an eager prefill into a KV cache then two compiled decode steps, the
    second with a dynamic cache length."""
    compiled = torch.compile(model, backend=backend)
    if not decode:
        compiled(ids)
        return
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(ids, past_key_values=cache, use_cache=True)
    for _ in range(2):
        compiled(ids[:, -1:], past_key_values=cache, use_cache=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="also compile with dsfuse and print its report")
    parser.add_argument("--decode", action="store_true",
                        help="prefill a KV cache eagerly, then dump two decode steps (the second has a dynamic length)")
    args = parser.parse_args()
    model = build_hf_model("tiny", dtype=getattr(torch, args.dtype), device=args.device, attn_implementation=args.attn)
    graphs: list[str] = []
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=args.device)
    with torch.no_grad(), inductor_config.patch(post_grad_custom_post_pass=lambda g: graphs.append(str(g)),
                                                fx_graph_cache=False):
        run_model(model, "inductor", ids, args.decode)
    kind = f"decode_b{args.batch}" if args.decode else f"b{args.batch}"
    out = Path(args.out) / f"post_grad_{args.device}_{args.attn}_{args.dtype}_{kind}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(graphs))
    print(f"wrote {out} ({len(graphs)} graph(s))")
    if args.report:
        import dsfuse

        torch._dynamo.reset()
        with torch.no_grad():
            run_model(model, "dsfuse", ids, args.decode)
        print(dsfuse.report())


if __name__ == "__main__":
    main()
