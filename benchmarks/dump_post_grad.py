"""Write the post-grad graph Inductor hands to dsfuse's passes, for the HF tiny preset on this device.

    python benchmarks/dump_post_grad.py --out graphs/ [--attn sdpa|eager] [--dtype bfloat16]

SDPA lowers to different aten ops on CPU and CUDA; matchers are written against both dumps.
"""

import argparse
from pathlib import Path

import torch
from torch._inductor import config as inductor_config

from dsfuse.models.presets import build_hf_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=20)
    args = parser.parse_args()
    model = build_hf_model("tiny", dtype=getattr(torch, args.dtype), device=args.device, attn_implementation=args.attn)
    graphs: list[str] = []
    ids = torch.randint(0, model.config.vocab_size, (2, args.seq), device=args.device)
    with torch.no_grad(), inductor_config.patch(post_grad_custom_post_pass=lambda g: graphs.append(str(g)),
                                                fx_graph_cache=False):
        torch.compile(model, backend="inductor")(ids)
    out = Path(args.out) / f"post_grad_{args.device}_{args.attn}_{args.dtype}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(graphs))
    print(f"wrote {out} ({len(graphs)} graph(s))")


if __name__ == "__main__":
    main()
