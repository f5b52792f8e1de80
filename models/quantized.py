"""Block-scaled FP8 checkpoints in the layout DeepSeek V3.2 and GLM-5 are released in, written from random weights
(real weights cannot be downloaded here), and loaded the way a user loads the released ones: through transformers'
`from_pretrained`, whose FP8 layers then call dsfuse's FP8 ops (`dsfuse.hf_fp8`).

The layout is the one transformers reads for these models: every linear transformers turns into an `FP8Linear`
stores `<name>.weight` (float8_e4m3fn, [N, K]) and `<name>.weight_scale_inv` (one scale per 128 x 128 block: F32,
or F8_E8M0 for `scale_fmt="ue8m0"`); the routed experts are stored one expert at a time
(`mlp.experts.<e>.{gate,up,down}_proj.weight` and `.weight_scale_inv`), which transformers merges on load; the rest
(embeddings, norms, the router, `lm_head`) stays bf16 / fp32; `config.json` carries the `quantization_config`.

On a machine without a GPU transformers would dequantise such a checkpoint to bf16 at load;
`load_quantized_model` keeps it quantised (dsfuse's FP8 ops run on the CPU too, as their reference math).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from dsfuse.kernels.quant_formats import E8M0_DTYPE, FP8_BLOCK, FP8_DTYPE, FP8_MAX, power_of_two_ceil_exact

SCALE_FORMATS = ("float", "ue8m0")
EXPERT_STACKS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def quantize_fp8_weight(weight: torch.Tensor, block: int = FP8_BLOCK, scale_fmt: str = "float"):
    """`weight [..., N, K]` to (e4m3 `[..., N, K]`, scales `[..., ceil(N / block), ceil(K / block)]`): each block's
    scale is its amax / 448 (rounded up to a power of two and stored as E8M0 for `scale_fmt="ue8m0"`)."""
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"unknown scale_fmt {scale_fmt!r}; valid: {', '.join(SCALE_FORMATS)}")
    *lead, N, K = weight.shape
    nb, kb = -(-N // block), -(-K // block)
    padded = torch.nn.functional.pad(weight.float(), (0, kb * block - K, 0, nb * block - N))
    blocks = padded.view(*lead, nb, block, kb, block)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = power_of_two_ceil_exact(scale)
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*lead, nb * block, kb * block)[..., :N, :K].contiguous()
    return q, (scale.to(E8M0_DTYPE) if scale_fmt == "ue8m0" else scale)


def quantization_config(scale_fmt: str = "ue8m0") -> dict[str, Any]:
    """The `quantization_config` of a block-scaled FP8 release (DeepSeek V3.2's, with `scale_fmt` as given)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": scale_fmt,
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def fp8_layer_names(model: torch.nn.Module, scale_fmt: str = "ue8m0") -> list[str]:
    """The modules transformers turns into FP8 layers for this model (its own rule, asked on a meta copy)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear, replace_with_fp8_linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = FineGrainedFP8Config(scale_fmt=scale_fmt)
    with torch.device("meta"):
        skeleton = type(model)._from_config(model.config)
    quantizer = FineGrainedFP8HfQuantizer(config, pre_quantized=True)
    skip = quantizer.get_modules_to_not_convert(skeleton, None, skeleton._keep_in_fp32_modules)
    replace_with_fp8_linear(skeleton, modules_to_not_convert=skip, quantization_config=config, pre_quantized=True)
    return [name for name, module in skeleton.named_modules() if isinstance(module, (FP8Linear, FP8Experts))]


def quantized_state_dict(model: torch.nn.Module, scale_fmt: str = "ue8m0") -> dict[str, torch.Tensor]:
    """`model`'s weights in the released FP8 layout (see the module docstring)."""
    layers = set(fp8_layer_names(model, scale_fmt))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in layers and leaf in EXPERT_STACKS:
            weight, scale = quantize_fp8_weight(tensor, scale_fmt=scale_fmt)
            for part, (w, s) in zip(EXPERT_STACKS[leaf], _halves(weight, scale, len(EXPERT_STACKS[leaf]))):
                for expert in range(w.shape[0]):
                    state[f"{owner}.{expert}.{part}.weight"] = w[expert].contiguous()
                    state[f"{owner}.{expert}.{part}.weight_scale_inv"] = s[expert].contiguous()
        elif owner in layers and leaf == "weight":
            state[name], state[f"{owner}.weight_scale_inv"] = quantize_fp8_weight(tensor, scale_fmt=scale_fmt)
        else:
            state[name] = tensor.contiguous()
    return state


def _halves(weight, scale, parts):
    """A fused [E, parts * I, H] stack and its scales split into `parts` stacks of I rows (I a multiple of the block,
    so each part keeps its own scale rows)."""
    if parts == 1:
        return [(weight, scale)]
    rows, scale_rows = weight.shape[-2] // parts, scale.shape[-2] // parts
    if rows % FP8_BLOCK:
        raise ValueError(f"an expert projection of {rows} rows is not a whole number of {FP8_BLOCK}-row blocks")
    return [(weight[..., i * rows:(i + 1) * rows, :], scale[..., i * scale_rows:(i + 1) * scale_rows, :])
            for i in range(parts)]


def write_fp8_checkpoint(directory: str | os.PathLike, preset: str = "fp8-tiny", *, scale_fmt: str = "ue8m0",
                         seed: int = 0, max_shard_bytes: int | None = None, **overrides) -> Path:
    """A random HF `preset` model written as a released FP8 checkpoint (sharded, with an index, when
    `max_shard_bytes` is given). Returns the directory."""
    from dsfuse.models.checkpoint import save_state
    from dsfuse.models.presets import build_hf_model

    model = build_hf_model(preset, dtype=torch.bfloat16, seed=seed, **overrides)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(scale_fmt)
    config["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return save_state(quantized_state_dict(model, scale_fmt), directory, max_shard_bytes=max_shard_bytes)


@contextlib.contextmanager
def _fp8_layers_without_gpu():
    """transformers dequantises an FP8 checkpoint to bf16 on a machine without a GPU; dsfuse's FP8 ops run on the
    CPU, so its FP8 layers are kept (transformers' check for a GPU is skipped while loading)."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check


def load_quantized_model(path: str | os.PathLike, *, device: str | torch.device | None = None, dequantize=False,
                         dtype: torch.dtype = torch.bfloat16, experts_implementation: str = "grouped_mm", **kwargs):
    """A released (or `write_fp8_checkpoint`) FP8 checkpoint through transformers' `from_pretrained`, its FP8 layers
    served by dsfuse's ops, everything else in `dtype`; with `dequantize=True` the same weights in `dtype`
    (transformers' exact dequantisation: the reference the FP8 model is compared with). `experts_implementation`
    "grouped_mm" keeps the routed experts in one graph; `kwargs` go to `from_pretrained` (`device_map`, `tp_plan`)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from dsfuse import hf_fp8

    hf_fp8.install()
    config = json.loads((Path(path) / "config.json").read_text())
    quant = dict(config.get("quantization_config") or {})
    if quant.get("quant_method") != "fp8":
        raise ValueError(f"{path}: config.json has no fp8 quantization_config")
    quant.pop("quant_method", None)
    quant.pop("fmt", None)
    settings = dict(quantization_config=FineGrainedFP8Config(dequantize=dequantize, **quant), dtype=dtype,
                    experts_implementation=experts_implementation, use_safetensors=True, local_files_only=True,
                    **kwargs)
    cpu_only = not torch.cuda.is_available()
    with _fp8_layers_without_gpu() if cpu_only and not dequantize else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(path, **settings)
    if device is not None:
        model = model.to(device)
    return model.eval()


__all__ = ["SCALE_FORMATS", "fp8_layer_names", "load_quantized_model", "quantization_config",
           "quantize_fp8_weight", "quantized_state_dict", "write_fp8_checkpoint"]
