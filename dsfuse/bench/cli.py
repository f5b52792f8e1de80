"""Benchmarks: eager, Inductor and dsfuse side by side in one process.

    python -m dsfuse.bench model --preset v32-real-2l --seq 2048 8192
    python -m dsfuse.bench model --preset tiny --seq 32 --device cpu      # smoke run
    python -m dsfuse.bench model --preset v4-flash-real-2l --seq 8192     # DeepSeek V4 prefill (use_cache=False)
    python -m dsfuse.bench model --profile --json r.json --markdown r.md  # keep the results
    python -m dsfuse.bench model --seq 8192 --logits last                 # prefill as generate runs it
    python -m dsfuse.bench model --preset v4-flash-real-2l --cast bfloat16  # the whole model cast, as .to() does
    python -m dsfuse.bench model --mode decode --decode-batch 1 8 --context 8192 32768
    python -m dsfuse.bench ablate --seq 8192 --json a.json --markdown a.md  # each pass off, each pass alone
    python -m dsfuse.bench plot r.json --out r.png                        # speedup vs S, decode, time by stage
    python -m dsfuse.bench generate --prompt 2048 8192 --batch 1 8         # whole model.generate calls
    python -m dsfuse.bench checkpoint --preset v32-real-2l --out ckpt      # random weights, released FP8 layout
    python -m dsfuse.bench model --checkpoint ckpt --seq 8192              # ... loaded with from_pretrained

The subcommands live in `dsfuse.bench.model` (model, ablate), `dsfuse.bench.families`, `dsfuse.bench.generate`
`dsfuse.bench.report` (plot, and the Markdown of every subcommand) and `dsfuse.bench.source` (checkpoint, and the
model a benchmark loads).
"""

from __future__ import annotations

import argparse
import json

import torch

from dsfuse.bench.families import bench_families
from dsfuse.bench.generate import add_arguments as add_generate_arguments
from dsfuse.bench.generate import generate_markdown
from dsfuse.bench.generate import run as run_generate
from dsfuse.bench.measure import CONFIGS, resolve_configs
from dsfuse.bench.model import FALLBACK_PREFILL, bench_ablate, bench_model
from dsfuse.bench.report import ablation_markdown, families_markdown, model_markdown, plot_model
from dsfuse.config import PASS_NAMES
from dsfuse.bench.source import (add_checkpoint_arguments, add_source_arguments, model_is_v4, source_label,
                                 write_checkpoint)


def _add_model_arguments(parser: argparse.ArgumentParser, seq_default: list[int]) -> None:
    add_source_arguments(parser)
    parser.add_argument("--seq", type=int, nargs="+", default=seq_default, help="prefill sequence lengths")
    parser.add_argument("--batch", type=int, default=1, help="prefill batch")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    parser.add_argument("--cast", default=None, choices=("bfloat16", "float16"),
                        help="cast the whole built model, as `model.to(dtype)` does (also what transformers keeps in "
                             "fp32: V4's sinks, compressor biases, hyper-connections, routers)")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rep-ms", type=int, default=1000)
    parser.add_argument("--logits", default="all", choices=("all", "last"),
                        help="prefill logits for every position, or the last one only (as generate asks)")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--markdown", default=None, help="write Markdown tables here")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model", help="whole model, prefill and/or decode with a KV cache: "
                                         "eager / Inductor / dsfuse")
    _add_model_arguments(model, [2048, 8192])
    model.add_argument("--configs", default=",".join(CONFIGS),
                       help=f"comma list of {', '.join(CONFIGS)}, only:PASS (one pass alone), no:PASS (all but one)")
    model.add_argument("--profile", action="store_true", help="add a per-kernel GPU-time breakdown of one call")
    model.add_argument("--mode", default="prefill", choices=("prefill", "decode", "both"))
    model.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    model.add_argument("--context", type=int, nargs="+", default=[8192, 32768], help="decode context lengths T")
    model.add_argument("--prefill-cache", default="same", choices=("same", FALLBACK_PREFILL),
                       help=f"who fills the decode cache: each configuration itself (falling back to "
                            f"{FALLBACK_PREFILL} where it runs out of memory), or {FALLBACK_PREFILL} for all")
    model.add_argument("--growing-steps", type=int, default=2,
                       help="decode steps that really append to the cache, to count recompiles")
    ablate = sub.add_parser("ablate", help="prefill with each pass off in turn and each pass alone: "
                                           "per-pass contribution and GPU time by stage")
    _add_model_arguments(ablate, [8192])
    ablate.add_argument("--passes", default=",".join(PASS_NAMES), help="comma list of the passes to ablate")
    ablate.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="per-kernel GPU-time breakdown of each configuration (CUDA only)")
    fam = sub.add_parser("families", help="each fused family's source subgraph: eager / Inductor / dsfuse")
    fam.add_argument("--size", default=None, choices=("real", "tiny"), help="default: real on CUDA, tiny on CPU")
    fam.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    fam.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    fam.add_argument("--configs", default="eager,inductor,dsfuse")
    fam.add_argument("--rep-ms", type=int, default=300)
    fam.add_argument("--json", default=None, help="write results here")
    fam.add_argument("--markdown", default=None, help="write a Markdown table here")
    ckpt = sub.add_parser("checkpoint", help="write random weights at a preset's dimensions in its family's released "
                                             "layout (FP8 / FP4), for `model --checkpoint` and `generate --checkpoint`")
    add_checkpoint_arguments(ckpt)
    gen = sub.add_parser("generate", help="whole model.generate calls: time to first token, ms/token, peak memory")
    add_generate_arguments(gen)
    plot = sub.add_parser("plot", help="figure from a `model` or `ablate` --json file (matplotlib)")
    plot.add_argument("results", help="JSON written by `model --json` or `ablate --json`")
    plot.add_argument("--out", required=True, help="image to write, e.g. bench.png")
    args = parser.parse_args(argv)
    if args.command == "plot":
        with open(args.results) as f:
            results = json.load(f)
        try:
            plot_model(results, args.out)
        except ValueError as err:
            parser.error(f"{args.results}: {err}")
        print(f"wrote {args.out}")
        return 0
    if args.command == "checkpoint":
        write_checkpoint(args)
        return 0
    if args.command == "generate":
        _write(run_generate(args, parser), args.json, args.markdown, generate_markdown)
        return 0
    if args.command == "families":
        args.size = args.size or ("real" if args.device.startswith("cuda") else "tiny")
        args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
        args.configs = resolve_configs([c for c in args.configs.split(",") if c])
        results = bench_families(args)
        _write(results, args.json, args.markdown, families_markdown)
        return 0
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.cast is not None and args.checkpoint is not None:
        parser.error("--cast casts a --preset model; a checkpoint keeps the dtypes it was saved in")
    if args.command == "ablate":
        args.passes = [name for name in args.passes.split(",") if name]
        unknown = [name for name in args.passes if name not in PASS_NAMES]
        if unknown or not args.passes:
            parser.error(f"--passes: unknown or no pass names {unknown}; valid: {', '.join(PASS_NAMES)}")
        results = bench_ablate(args)
        _write(results, args.json, args.markdown, ablation_markdown)
        return 0
    try:
        args.configs = resolve_configs([c for c in args.configs.split(",") if c])
    except ValueError as err:
        parser.error(str(err))
    if model_is_v4(args) and args.mode != "prefill":
        parser.error(f"--mode {args.mode}: decode is benchmarked on V3.2 models only; {source_label(args)} "
                     "(DeepSeek V4) runs prefill (use_cache=False); its decode is in `generate`")
    results = bench_model(args)
    _write(results, args.json, args.markdown, model_markdown)
    return 0


def _write(results: dict, json_path: str | None, markdown_path: str | None, to_markdown) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(to_markdown(results))


