"""Where a benchmark's model comes from: a preset built with random weights, or a checkpoint directory (bf16, or a
released FP8 / FP4 layout, which loads through transformers' `from_pretrained` with dsfuse's quantised ops).

`checkpoint` writes such a directory with random weights at a preset's dimensions, so the released formats can be
benchmarked where the real weights cannot be downloaded:

    python -m dsfuse.bench checkpoint --preset v32-real-2l --out /tmp/v32-fp8      # released FP8 layout
    python -m dsfuse.bench model --checkpoint /tmp/v32-fp8 --seq 8192
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dsfuse.models.presets import is_v4_preset, preset_names


def add_source_arguments(parser) -> None:
    parser.add_argument("--preset", default="v32-real-2l", choices=preset_names(), metavar="PRESET")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="load this checkpoint directory instead of building --preset (a released FP8 / FP4 "
                             "layout loads with dsfuse's quantised ops; `checkpoint` writes one)")


def model_is_v4(args) -> bool:
    """Whether the benchmarked model is a DeepSeek V4, read from the checkpoint's config.json when there is one."""
    if args.checkpoint is None:
        return is_v4_preset(args.preset)
    from dsfuse.models.checkpoint import read_config_json

    return read_config_json(args.checkpoint).get("model_type") == "deepseek_v4"


def source_label(args) -> str:
    """What the results files call the model: the preset, or the checkpoint directory's name."""
    return args.preset if args.checkpoint is None else f"checkpoint:{Path(args.checkpoint).name}"


def load_model(args):
    """The model `args` name (`--preset` or `--checkpoint`) on `args.device`, in eval mode."""
    dtype = getattr(torch, args.dtype)
    if args.checkpoint is None:
        from dsfuse.models.presets import build_hf_model

        return build_hf_model(args.preset, dtype=dtype, device=args.device, attn_implementation=args.attn)
    from dsfuse.models.checkpoint import load_checkpoint

    started = time.perf_counter()
    model = load_checkpoint(args.checkpoint, dtype=dtype, device=args.device, attn_implementation=args.attn)
    print(f"# loaded {args.checkpoint} in {time.perf_counter() - started:.1f} s", flush=True)
    return model


def write_checkpoint(args) -> Path:
    """`checkpoint`: random weights at `args.preset`'s dimensions, written in the released layout of its family
    (`--format released`: V3.2 / GLM FP8, V4-Flash FP8 + FP4 experts) or as a bf16 checkpoint."""
    from dsfuse.models.quantized import write_fp8_checkpoint

    started = time.perf_counter()
    out = Path(args.out)
    if args.format == "released":
        write_fp8_checkpoint(out, args.preset, device=args.device, max_shard_bytes=args.shard_gib << 30)
    else:
        from dsfuse.models.checkpoint import write_random_checkpoint

        write_random_checkpoint(args.preset, out, dtype=torch.bfloat16, device=args.device,
                                max_shard_bytes=args.shard_gib << 30)
    files = sorted(out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    config = json.loads((out / "config.json").read_text())
    print(f"wrote {out}: {len(files)} shard(s), {size / 2**30:.2f} GiB, model_type {config.get('model_type')}, "
          f"{'quantised' if config.get('quantization_config') else 'bf16'}, "
          f"in {time.perf_counter() - started:.1f} s", flush=True)
    return out


def add_checkpoint_arguments(parser) -> None:
    parser.add_argument("--preset", default="v32-real-2l", choices=preset_names(), metavar="PRESET")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write (created)")
    parser.add_argument("--format", default="released", choices=("released", "bf16"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the random weights are drawn and quantised")
    parser.add_argument("--shard-gib", type=int, default=4, help="largest shard, GiB")
