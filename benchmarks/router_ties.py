"""How near a tie each token's expert routing is, and what a rounding-sized change does to it (eager, no compile).

    python benchmarks/router_ties.py --preset v32-real-2l --cells 1x13 3x7 --out ties.json
    python benchmarks/router_ties.py --preset v32-real-2l --perturb attention        # noise on the attention outputs

A compiled model whose logits jump at one token where Inductor's do not may have resolved a near-tied routing
decision the other way: a rounding difference upstream, not a wrong result. For each DeepSeek-style group-limited
router (`*TopkRouter`: sigmoid scores plus the correction bias, top-2 sums per group, top groups, top experts) this
prints per token the gap between the last kept and the first dropped group score and expert score, and the largest
logit change (relative to the logits' max) when only that token's router input (or attention output) is multiplied
by 1 +- 2^-noise_exp with random signs, the size of bf16's rounding at the default 8.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_fuzz_gpu import _inputs  # noqa: E402


def routing_margins(router, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (group margin, expert margin) of `router`'s choice for `hidden`, in fp32 as the router computes."""
    flat = hidden.reshape(-1, router.hidden_dim).float()
    scores = torch.nn.functional.linear(flat, router.weight.float()).sigmoid() + router.e_score_correction_bias
    per_group = router.num_experts // router.num_group
    group_scores = scores.view(-1, router.num_group, per_group).topk(2, dim=-1)[0].sum(-1)
    ordered_groups = group_scores.sort(dim=-1, descending=True)[0]
    group_margin = ordered_groups[:, router.topk_group - 1] - ordered_groups[:, router.topk_group]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
        1, group_scores.topk(router.topk_group, dim=-1)[1], True)
    masked = scores.masked_fill(~kept.repeat_interleave(per_group, 1), float("-inf"))
    ordered = masked.sort(dim=-1, descending=True)[0]
    return group_margin, ordered[:, router.top_k - 1] - ordered[:, router.top_k]


class _Noise:
    """Multiplies one token's row of a hooked tensor by 1 +- 2^-exp (random signs) while armed."""

    def __init__(self, exp: int):
        self.exp, self.target, self.captured = exp, None, {}

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        if self.target is None or self.target[0] != name:
            return None
        _, row, generator = self.target
        flat = tensor.reshape(-1, tensor.shape[-1]).clone()
        signs = torch.randint(0, 2, flat[row].shape, generator=generator).to(flat.device) * 2 - 1
        flat[row] = (flat[row].float() * (1 + signs * 2.0 ** -self.exp)).to(flat.dtype)
        return flat.view_as(tensor)

    def router_hook(self, name):
        def hook(module, args):
            if self.target is None:  # the unperturbed forward's input, whose margins are reported
                self.captured[name] = args[0].detach().clone()
            changed = self.apply(name, args[0])
            return None if changed is None else (changed, *args[1:])
        return hook

    def output_hook(self, name):
        def hook(module, args, output):
            changed = self.apply(name, output[0])
            return None if changed is None else (changed, *output[1:])
        return hook


def measure(model, cells, perturb: str = "router", noise_exp: int = 8, trials: int = 6) -> dict:
    """{cell: {module: {"group_margin", "expert_margin" (routers), f"max_jump_{perturb}" (perturbed modules)}}},
    each a list over the cell's tokens."""
    routers = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopkRouter")]
    if not routers:
        raise ValueError("the model has no group-limited top-k router (*TopkRouter)")
    noise = _Noise(noise_exp)
    handles = [m.register_forward_pre_hook(noise.router_hook(n)) for n, m in routers]
    targets = routers
    if perturb == "attention":
        targets = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
        handles += [m.register_forward_hook(noise.output_hook(n)) for n, m in targets]
    device = next(model.parameters()).device
    results = {}
    try:
        with torch.no_grad():
            for batch, seq in cells:
                ids, mask = _inputs(model.config.vocab_size, batch, seq, device)
                real = mask.bool()
                noise.target = None
                eager = model(input_ids=ids, attention_mask=mask).logits.float()
                scale = eager.abs().amax()
                cell = {}
                for name, router in routers:
                    group_margin, expert_margin = routing_margins(router, noise.captured[name])
                    cell[name] = {"group_margin": group_margin.tolist(), "expert_margin": expert_margin.tolist()}
                for name, _ in targets:
                    jumps = []
                    for row in range(batch * seq):
                        worst = 0.0
                        for trial in range(trials):
                            noise.target = (name, row, torch.Generator().manual_seed(trial))
                            logits = model(input_ids=ids, attention_mask=mask).logits.float()
                            per_token = (logits - eager).abs().amax(-1) / scale * real
                            worst = max(worst, per_token.max().item())
                        jumps.append(worst)
                    cell.setdefault(name, {})[f"max_jump_{perturb}"] = jumps
                noise.target = None
                results[f"{batch}x{seq}"] = cell
    finally:
        for handle in handles:
            handle.remove()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="v32-real-2l")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--cells", nargs="+", default=["1x13", "3x7"], help="BxS: batch x length (left-padded rows)")
    parser.add_argument("--perturb", choices=("router", "attention"), default="router")
    parser.add_argument("--noise-exp", type=int, default=8)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from dsfuse.models.presets import build_hf_model

    model = build_hf_model(args.preset, dtype=getattr(torch, args.dtype), device=args.device,
                           attn_implementation="sdpa")
    cells = [tuple(int(v) for v in cell.split("x")) for cell in args.cells]
    results = measure(model, cells, args.perturb, args.noise_exp, args.trials)
    for cell, modules in results.items():
        for name, rows in modules.items():
            print(f"{cell} {name}")
            for key, values in rows.items():
                print(f"  {key:22s} " + " ".join(f"{v:.2e}" for v in values))
    if args.out:
        Path(args.out).write_text(json.dumps({"preset": args.preset, "noise_exp": args.noise_exp, "cells": results},
                                             indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
