"""Block-scaled FP8 checkpoints in the layout DeepSeek V3.2 and GLM-5 are released in, written from random weights
(real weights cannot be downloaded here), and loaded the way a user loads the released ones: through transformers'
`from_pretrained`, whose FP8 layers then call dsfuse's FP8 ops (`dsfuse.hf_fp8`).

The layout is the one transformers reads for these models: every linear transformers turns into an `FP8Linear`
stores `<name>.weight` (float8_e4m3fn, [N, K]) and `<name>.weight_scale_inv` (one scale per 128 x 128 block: F32,
or F8_E8M0 for `scale_fmt="ue8m0"`); the routed experts are stored one expert at a time
(`mlp.experts.<e>.{gate,up,down}_proj.weight` and `.weight_scale_inv`), which transformers merges on load; the rest
(embeddings, norms, the router, `lm_head`) stays bf16 / fp32; `config.json` carries the `quantization_config`.

DeepSeek V4-Flash is released in its own names (`embed`, `layers.<i>.attn.wq_a`, `layers.<i>.ffn.experts.<e>.w1`,
`head`, ...), with the block scales under `<name>.scale` and the routed experts in FP4 (E2M1 packed two per int8 byte,
one E8M0 scale per 32 values; `expert_dtype: "fp4"` in config.json). transformers maps those names onto its modules at
load (`conversion_mapping.py`, "deepseek_v4"; the FP8 quantizer renames `.scale` to `.weight_scale_inv`), so
`V4_FLASH_LAYOUT` writes the inverse of that mapping.

On a machine without a GPU transformers would dequantise such a checkpoint to bf16 at load;
`load_quantized_model` keeps it quantised (dsfuse's FP8 ops run on the CPU too, as their reference math).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsfuse.kernels.quant_formats import E8M0_DTYPE, FP8_BLOCK, FP8_DTYPE, FP8_MAX, power_of_two_ceil_exact

SCALE_FORMATS = ("float", "ue8m0")


@dataclass(frozen=True)
class ReleasedLayout:
    """How a model family's released checkpoint names and stores what transformers loads as FP8 / FP4 layers: the
    per-expert projections each fused expert stack is split into, the name of a weight's block scales, the routed
    experts' format, extra config.json fields, and the renames (regex on transformers' key, in order) to its names."""

    expert_parts: dict[str, tuple[str, ...]]
    scale_name: str = "weight_scale_inv"
    expert_dtype: str = "fp8"
    config_fields: dict[str, Any] = field(default_factory=dict)
    renames: tuple[tuple[str, str], ...] = ()

    def released_name(self, key: str) -> str:
        for pattern, replacement in self.renames:
            key = re.sub(pattern, replacement, key)
        return key


V32_LAYOUT = ReleasedLayout({"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)})
# transformers' "deepseek_v4" conversion mapping read backwards (specific names before the general `.attn.` / `.ffn.`)
V4_FLASH_LAYOUT = ReleasedLayout(
    {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}, scale_name="scale", expert_dtype="fp4",
    config_fields={"expert_dtype": "fp4"},
    renames=(
        (r"^lm_head\.", "head."), (r"^model\.", ""), (r"^embed_tokens\.", "embed."),
        (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
        (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
        (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
        (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
        (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
        (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
        (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"), (r"\.sinks$", ".attn_sink"),
        (r"\.compressor\.kv_norm\.", ".compressor.norm."), (r"\.position_bias$", ".ape"),
        (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
        (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
        (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
        (r"\.q_a_proj\.", ".wq_a."), (r"\.q_b_proj\.", ".wq_b."), (r"\.kv_proj\.", ".wkv."),
        (r"\.gate_proj\.", ".wgate."), (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."),
        (r"\.q_a_norm\.", ".q_norm."), (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    ),
)


def released_layout(config) -> ReleasedLayout:
    """The layout `config`'s model family is released in (V4-Flash's for DeepSeek V4, V3.2's otherwise)."""
    return V4_FLASH_LAYOUT if getattr(config, "model_type", None) == "deepseek_v4" else V32_LAYOUT


def _one_matrix_at_a_time(quantize):
    """`quantize` applied to each [N, K] matrix of a stack and the results stacked: a real-dimension expert stack
    (V4-Flash: 256 x 4096 x 4096) would otherwise need its intermediates all at once (128 GiB asked on the H200)."""

    @functools.wraps(quantize)
    def per_matrix(weight: torch.Tensor, *args, **kwargs):
        if weight.dim() <= 2:
            return quantize(weight, *args, **kwargs)
        parts = [quantize(matrix, *args, **kwargs) for matrix in weight.reshape(-1, *weight.shape[-2:])]
        return tuple(torch.stack(items).view(*weight.shape[:-2], *items[0].shape) for items in zip(*parts))

    return per_matrix


@_one_matrix_at_a_time
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


@_one_matrix_at_a_time
def quantize_fp4_weight(weight: torch.Tensor):
    """`weight [..., N, K]` to V4-Flash's FP4 experts: (E2M1 codes packed two per byte, low nibble first, as int8
    `[..., N, K / 2]`; E8M0 scales `[..., N, K / 32]`, each the power of two that maps its 32 values' amax to <= 6)."""
    from dsfuse.models.official import quantize_fp4

    packed, scales = quantize_fp4(weight)
    return packed.view(torch.int8), scales.view(E8M0_DTYPE)


def fp8_skeleton(model_class, config, quantization: dict[str, Any] | None = None, dtype: torch.dtype | None = None):
    """A meta-device `model_class` for `config` (unquantised tensors in `dtype`) with the FP8 / FP4 layers
    transformers builds for a checkpoint with `quantization` (config.json's `quantization_config`; by default
    `config`'s own, else V3.2's), by transformers' own rule: what such a checkpoint must hold."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from dsfuse.models.presets import keep_fp32_modules

    quantization = dict(quantization or getattr(config, "quantization_config", None) or quantization_config())
    quantization.pop("fmt", None)
    quant_config = FineGrainedFP8Config(**quantization)
    with torch.device("meta"):
        skeleton = keep_fp32_modules(model_class._from_config(config, dtype=dtype))
    quantizer = FineGrainedFP8HfQuantizer(quant_config, pre_quantized=True)
    skip = quantizer.get_modules_to_not_convert(skeleton, quant_config.modules_to_not_convert,
                                                skeleton._keep_in_fp32_modules)
    return replace_with_fp8_linear(skeleton, modules_to_not_convert=skip, quantization_config=quant_config,
                                   pre_quantized=True)


def fp8_layer_names(model: torch.nn.Module, scale_fmt: str = "ue8m0") -> list[str]:
    """The modules transformers turns into FP8 layers for this model (its own rule, asked on a meta copy)."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    skeleton = fp8_skeleton(type(model), model.config, quantization_config(scale_fmt))
    return [name for name, module in skeleton.named_modules() if isinstance(module, (FP8Linear, FP8Experts))]


def released_state(state: dict[str, torch.Tensor], layout: ReleasedLayout) -> dict[str, torch.Tensor]:
    """transformers' in-memory FP8 state (`<name>.weight_scale_inv`, fused `experts.gate_up_proj` stacks and their
    `_scale_inv`) in `layout`'s names, each expert stack split per expert and projection (views, no copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        owner, _, leaf = name.rpartition(".")
        stack = leaf.removesuffix("_scale_inv")
        if owner.endswith(".experts") and stack in layout.expert_parts:
            parts = layout.expert_parts[stack]
            if tensor.shape[-2] % len(parts):
                raise ValueError(f"{name} {tuple(tensor.shape)}: its rows do not split into {len(parts)} projections")
            released_owner = layout.released_name(f"{owner}.{stack}").rpartition(".")[0]
            what = "weight" if leaf == stack else layout.scale_name
            for part, rows in zip(parts, tensor.chunk(len(parts), dim=-2)):
                for expert in range(rows.shape[0]):
                    out[f"{released_owner}.{expert}.{part}.{what}"] = rows[expert]
        elif leaf == "weight_scale_inv":
            out[f"{layout.released_name(f'{owner}.weight').rpartition('.')[0]}.{layout.scale_name}"] = tensor
        else:
            out[layout.released_name(name)] = tensor
    return out


def quantized_state_dict(model: torch.nn.Module, scale_fmt: str = "ue8m0",
                         layout: ReleasedLayout | None = None) -> dict[str, torch.Tensor]:
    """`model`'s weights in its family's released layout (see the module docstring; `layout` defaults to
    `released_layout(model.config)`)."""
    layout = layout or released_layout(model.config)
    if layout.expert_dtype == "fp4" and scale_fmt != "ue8m0":
        raise ValueError(f"FP4 experts carry E8M0 scales: scale_fmt must be 'ue8m0', got {scale_fmt!r}")
    layers = set(fp8_layer_names(model, scale_fmt))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in layers and (leaf == "weight" or leaf in layout.expert_parts):
            fp4 = leaf != "weight" and layout.expert_dtype == "fp4"
            rows = tensor.shape[-2] // len(layout.expert_parts.get(leaf, (leaf,)))
            if not fp4 and rows != tensor.shape[-2] and rows % FP8_BLOCK:  # each part keeps its own scale rows
                raise ValueError(f"{name}: an expert projection of {rows} rows is not a whole number of "
                                 f"{FP8_BLOCK}-row blocks")
            weight, scale = quantize_fp4_weight(tensor) if fp4 else quantize_fp8_weight(tensor, scale_fmt=scale_fmt)
            state[name], state[f"{name}_scale_inv"] = weight, scale
        else:
            state[name] = tensor
    return {key: tensor.contiguous() for key, tensor in released_state(state, layout).items()}


def write_fp8_checkpoint(directory: str | os.PathLike, preset: str = "fp8-tiny", *, scale_fmt: str = "ue8m0",
                         seed: int = 0, max_shard_bytes: int | None = None, device: torch.device | str = "cpu",
                         **overrides) -> Path:
    """A random HF `preset` model written as a released checkpoint of its family (V3.2 / GLM-5: FP8; V4: V4-Flash's
    names, FP8 linears and FP4 experts), sharded with an index when `max_shard_bytes` is given. Returns the
    directory. `device` draws and quantises the weights there (a GPU writes real-dimension checkpoints in seconds)."""
    from dsfuse.models.checkpoint import save_state
    from dsfuse.models.presets import build_hf_model

    model = build_hf_model(preset, dtype=torch.bfloat16, seed=seed, device=device, **overrides)
    layout = released_layout(model.config)
    state = {key: tensor.cpu() for key, tensor in quantized_state_dict(model, scale_fmt, layout).items()}
    config = model.config.to_dict()
    del model
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config["quantization_config"] = quantization_config(scale_fmt)
    config["dtype"] = "bfloat16"
    config.update(layout.config_fields)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return save_state(state, directory, max_shard_bytes=max_shard_bytes)


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
    if device is not None:
        settings.setdefault("device_map", str(device))
    cpu_only = not torch.cuda.is_available()
    with _fp8_layers_without_gpu() if cpu_only and not dequantize else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(path, **settings)
    return model.eval()


__all__ = ["SCALE_FORMATS", "V32_LAYOUT", "V4_FLASH_LAYOUT", "ReleasedLayout", "fp8_layer_names",
           "fp8_skeleton", "load_quantized_model", "quantization_config", "quantize_fp4_weight",
           "quantize_fp8_weight", "quantized_state_dict", "released_layout", "released_state", "write_fp8_checkpoint"]
