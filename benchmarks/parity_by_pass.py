"""Which dsfuse pass moves a cell's logits away from eager's: the cell compiled afresh with every pass, with each
pass off in turn, and with Inductor alone, each measured against eager.

    python benchmarks/parity_by_pass.py --preset v4-flash-real-2l --attn eager --cells 2x5 --out parity.json
    python benchmarks/parity_by_pass.py --preset tiny --cells 1x13 --passes moe_experts sparse_attention

The distance is model_fuzz_gpu.py's: max |logits - eager| over max |eager| on the rows' real (unpadded) tokens, with
the same inputs (rows after the first left-padded). With random bf16 weights one discrete choice at a near-tie (an
expert, a top-k pick) can dominate it: a distance that jumps with a pass that does not compute that choice, or that
differs by an order of magnitude between equally valid roundings, is such a choice, not an error of the pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_fuzz_gpu import _inputs, _rel_err  # noqa: E402


def configurations(passes: list[str]) -> list[tuple[str, str, dict | None]]:
    """(name, backend, dsfuse options): Inductor, dsfuse with every pass, and dsfuse with each of `passes` off."""
    return [("inductor", "inductor", None), ("dsfuse", "dsfuse", {})] + [
        (f"dsfuse without {name}", "dsfuse", {"disable": [name]}) for name in passes]


def measure(model, cells: list[tuple[int, int]], passes: list[str]) -> dict[str, dict[str, dict]]:
    """Per cell 'BxS': each configuration's distance from eager (and eager's from a second eager call), and the sites
    each dsfuse configuration rewrote."""
    import dsfuse

    device = next(model.parameters()).device
    results = {}
    for batch, seq in cells:
        ids, mask = _inputs(model.config.vocab_size, batch, seq, device)
        keep = mask.bool()
        with torch.no_grad():
            eager = model(input_ids=ids, attention_mask=mask).logits
            row = {"eager again": _rel_err(model(input_ids=ids, attention_mask=mask).logits, eager, keep)}
            sites = {}
            for name, backend, options in configurations(passes):
                torch._dynamo.reset()
                dsfuse.reset_report()
                compiled = torch.compile(model, backend=backend, options=options)
                row[name] = _rel_err(compiled(input_ids=ids, attention_mask=mask).logits, eager, keep)
                if backend == "dsfuse":
                    sites[name] = {family: n for family, n in dsfuse.report().counts.items() if n}
                print(f"{batch}x{seq} {name:36s} {row[name]:.4f} {sites.get(name, '')}", flush=True)
        results[f"{batch}x{seq}"] = {"distance": row, "sites": sites}
    return results


def main(argv: list[str] | None = None) -> int:
    import dsfuse
    from dsfuse.bench.measure import environment
    from dsfuse.models.presets import build_hf_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="v4-flash-real-2l")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--cells", nargs="+", default=["2x5"], help="BxS: batch x length (left-padded rows)")
    parser.add_argument("--passes", nargs="+", default=list(dsfuse.PASS_NAMES), choices=dsfuse.PASS_NAMES,
                        help="the passes to turn off one at a time")
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model = build_hf_model(args.preset, dtype=getattr(torch, args.dtype), device=args.device,
                           attn_implementation=args.attn, **overrides)
    cells = [tuple(int(v) for v in cell.split("x")) for cell in args.cells]
    results = measure(model, cells, args.passes)
    if args.out:
        Path(args.out).write_text(json.dumps({"env": environment(), "preset": args.preset, "dtype": args.dtype,
                                              "attn": args.attn, "cells": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
