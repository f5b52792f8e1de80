"""Random checkpoints on disk and a validating loader (config.json + safetensors only, never pickle).

Validation reads only `config.json` and the safetensors headers, and compares every tensor's name, shape and
dtype with a meta-device skeleton of the model, so a bad checkpoint fails with the file and key named before any
weight is copied or any kernel runs. A checkpoint whose config.json has an fp8 `quantization_config` (DeepSeek V3.2,
GLM-5, V4-Flash as released) is checked in its family's released layout (`dsfuse.models.quantized`): e4m3 weights,
F32 or F8_E8M0 block scales, and for V4-Flash FP4 experts packed two per byte (I8 or U8) with F8_E8M0 scales.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsfuse.models.official import DsfuseDeepseekConfig, DsfuseDeepseekForCausalLM, OWN_PRESETS, build_own_model
from dsfuse.models.presets import PRESETS, build_hf_model, keep_fp32_modules

CONFIG_NAME = "config.json"
SINGLE_WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MODEL_TYPE_TO_KIND = {"deepseek_v32": "hf", "glm_moe_dsa": "hf", "deepseek_v4": "hf", "dsfuse_deepseek": "own"}
HF_CLASSES = {"deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
              "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
              "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM")}
KINDS = ("hf", "own")

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# What each dtype of a model tensor may be stored as when that is not one safetensors name, and what it holds.
STORAGE = {torch.int8: (("I8", "U8"), "packed FP4: two E2M1 values a byte, [N, K / 2]"),
           torch.float8_e8m0fnu: (("F8_E8M0",), "E8M0 block scales")}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and, where known, the key."""


# --- writing ----------------------------------------------------------------------------------------------------


def _resolve_kind(preset_or_config: Any, kind: str | None) -> str:
    if isinstance(preset_or_config, DsfuseDeepseekConfig):
        inferred = "own"
    elif isinstance(preset_or_config, str):
        inferred = "own" if preset_or_config in OWN_PRESETS else "hf" if preset_or_config in PRESETS else None
        if inferred is None:
            valid = sorted(PRESETS) + sorted(OWN_PRESETS)
            raise ValueError(f"unknown preset {preset_or_config!r}; valid presets: {', '.join(valid)}")
    else:
        inferred = "hf"
    if kind is None:
        return inferred
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; valid: {', '.join(KINDS)}")
    if kind != inferred:
        raise ValueError(f"{preset_or_config!r} is a {inferred!r} model, but kind={kind!r} was asked for")
    return kind


def _shard(state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    if max_shard_bytes is None:
        return [state]
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for key, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][key] = tensor
        used += size
    return shards


def save_model(model: torch.nn.Module, directory: str | os.PathLike, *, max_shard_bytes: int | None = None) -> Path:
    """Write `config.json` and the state dict as safetensors: one `model.safetensors`, or HF-style shards plus
    `model.safetensors.index.json` when `max_shard_bytes` splits it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(directory / CONFIG_NAME)
    state = {key: value.detach().to("cpu").contiguous().clone() for key, value in model.state_dict().items()}
    return save_state(state, directory, max_shard_bytes=max_shard_bytes)


def save_state(state: dict[str, torch.Tensor], directory: str | os.PathLike, *,
               max_shard_bytes: int | None = None) -> Path:
    """Write `state` (contiguous CPU tensors) as safetensors into an existing `directory`: one `model.safetensors`, or
    HF-style shards plus `model.safetensors.index.json` when `max_shard_bytes` splits it."""
    directory = Path(directory)
    shards = _shard(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], directory / SINGLE_WEIGHTS_NAME, metadata={"format": "pt"})
        return directory
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return directory


def write_random_checkpoint(
    preset_or_config: Any,
    directory: str | os.PathLike,
    *,
    kind: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    max_shard_bytes: int | None = None,
) -> Path:
    """Build a random model (`kind="hf"`: `DeepseekV32ForCausalLM`, `"own"`: `DsfuseDeepseekForCausalLM`) from a
    preset name or config and save it to `directory`. The kind is inferred from the preset or config when omitted."""
    kind = _resolve_kind(preset_or_config, kind)
    if kind == "hf":
        model = build_hf_model(preset_or_config, dtype=dtype, device=device, seed=seed)
    else:
        model = build_own_model(preset_or_config, dtype=dtype, device=device, seed=seed)
    return save_model(model, directory, max_shard_bytes=max_shard_bytes)


# --- reading and validation -------------------------------------------------------------------------------------


def read_config_json(directory: str | os.PathLike, expected_model_type: str | None = None) -> dict[str, Any]:
    """Parse `directory/config.json` into a dict, or raise `CheckpointError` naming the file and the problem."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a checkpoint directory needs config.json)")
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path}: not UTF-8 text ({error})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"{path}: malformed JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPE_TO_KIND:
        raise CheckpointError(
            f"{path}: key 'model_type' is {model_type!r}; supported: {', '.join(sorted(MODEL_TYPE_TO_KIND))}"
        )
    if expected_model_type is not None and model_type != expected_model_type:
        raise CheckpointError(f"{path}: key 'model_type' is {model_type!r}, expected {expected_model_type!r}")
    return data


def config_from_dir(directory: str | os.PathLike):
    """`(kind, config)` from `config.json`; wrong field types or impossible values raise `CheckpointError`."""
    path = Path(directory) / CONFIG_NAME
    data = read_config_json(directory)
    kind = MODEL_TYPE_TO_KIND[data["model_type"]]
    if kind == "hf":
        import transformers

        config_class = getattr(transformers, HF_CLASSES[data["model_type"]][0])
    else:
        config_class = DsfuseDeepseekConfig
    try:
        config = config_class.from_dict(data)
    except Exception as error:  # strict-dataclass and __post_init__ errors come in several types
        raise CheckpointError(f"{path}: invalid config: {error}") from None
    for key, value in data.items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 0 and not key.endswith("token_id"):
            raise CheckpointError(f"{path}: key {key!r} is negative ({value})")
    return kind, config


def _model_class(kind: str, config):
    if kind == "own":
        return DsfuseDeepseekForCausalLM
    import transformers

    return getattr(transformers, HF_CLASSES[config.model_type][1])


def quantization(config, source: str | os.PathLike = CONFIG_NAME) -> dict[str, Any] | None:
    """config.json's `quantization_config` when the checkpoint is quantised (only fp8 is supported), else None;
    `source` names the config file in errors."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "fp8":
        raise CheckpointError(f"{source}: quantization_config quant_method {method!r} is not supported; "
                              "supported: 'fp8' (block-scaled FP8, FP4 experts)")
    return quant


def _instantiate(kind: str, config, dtype: torch.dtype):
    model_class = _model_class(kind, config)
    if kind == "hf":
        return keep_fp32_modules(model_class._from_config(config, dtype=dtype))
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        return model_class(config)
    finally:
        torch.set_default_dtype(previous)


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def expected_tensors(kind: str, config, source: str | os.PathLike = CONFIG_NAME,
                     saved_names: bool = False) -> dict[str, tuple]:
    """Every state-dict key of the model `config` describes, as key → (shape, dtype), from a meta-device skeleton.
    With `saved_names`, the names and shapes transformers' `save_pretrained` writes for it (DeepSeek V4 saves in
    its released names, e.g. `attn.attn_sink` for `self_attn.sinks`). `source` names the config file in errors."""
    from dsfuse.models.quantized import fp8_skeleton, released_layout, released_state

    quant = quantization(config, source)
    try:
        if quant:
            skeleton = fp8_skeleton(_model_class(kind, config), config, quant, _config_dtype(config))
            state = released_state(skeleton.state_dict(), released_layout(config))
        else:
            with torch.device("meta"):
                skeleton = _instantiate(kind, config, _config_dtype(config))
            state = skeleton.state_dict()
            if saved_names:
                from transformers.core_model_loading import revert_weight_conversion

                state = revert_weight_conversion(skeleton, dict(state))
    except Exception as error:
        raise CheckpointError(f"{source}: cannot build the model this config describes: {error}") from None
    return {key: (tuple(value.shape), value.dtype) for key, value in state.items()}


def safetensors_files(directory: str | os.PathLike) -> dict[str, Path]:
    """Map each tensor key to the safetensors file holding it, from the index or the single weights file.

    Pickle weights are refused; an index that names a missing shard, or a file that is not safetensors, raises.
    """
    directory = Path(directory)
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("'weight_map' is not an object")
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index_path}: malformed index: {error}") from None
        files = {}
        for key, name in weight_map.items():
            shard = directory / str(name)
            if not shard.is_file():
                raise CheckpointError(f"{index_path}: key {key!r} points to missing file {shard.name!r}")
            files[key] = shard
        return files
    candidates = sorted(directory.glob("*.safetensors"))
    if not candidates:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        found = f"; found pickle files {pickles}, which are never loaded" if pickles else ""
        raise CheckpointError(f"{directory}: no safetensors weights ({SINGLE_WEIGHTS_NAME} or {INDEX_NAME}){found}")
    files = {}
    for path in candidates:
        for key in _header_keys(path):
            if key in files:
                raise CheckpointError(f"{path}: key {key!r} also stored in {files[key].name}")
            files[key] = path
    return files


def _header_keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except Exception as error:
        raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from None


def validate_checkpoint(directory: str | os.PathLike):
    """Check config.json and every tensor's presence, shape and dtype from headers alone. Returns
    `(kind, config, key → file)`; raises `CheckpointError` naming the file and key of the first problem."""
    return _validated(directory)[:3]


def _validated(directory: str | os.PathLike):
    """`validate_checkpoint`'s result and whether the tensors are in the names transformers' `save_pretrained`
    writes (only transformers' own loader maps those back) rather than the in-memory ones (`save_model`'s)."""
    directory = Path(directory)
    kind, config = config_from_dir(directory)
    expected = expected_tensors(kind, config, directory / CONFIG_NAME)
    files = safetensors_files(directory)

    missing = [key for key in expected if key not in files]
    saved_names = False
    if missing and kind == "hf" and not quantization(config):  # or in the names save_pretrained writes?
        saved = expected_tensors(kind, config, directory / CONFIG_NAME, saved_names=True)
        missing_saved = [key for key in saved if key not in files]
        if len(missing_saved) < len(missing):
            expected, missing, saved_names = saved, missing_saved, True
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{directory}: missing tensor {missing[0]!r}{more}")
    ignored = getattr(_model_class(kind, config), "_keys_to_ignore_on_load_unexpected", None) or []
    unexpected = [key for key in files if key not in expected and not any(re.search(p, key) for p in ignored)]
    if unexpected:
        raise CheckpointError(f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]!r} for {kind!r} model")

    by_file: dict[Path, list[str]] = {}
    for key, path in files.items():
        if key in expected:
            by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as handle:
                present = set(handle.keys())
                for key in keys:
                    if key not in present:
                        raise CheckpointError(f"{path}: missing tensor {key!r} (listed in {INDEX_NAME})")
                    tensor_slice = handle.get_slice(key)
                    shape = tuple(tensor_slice.get_shape())
                    stored = tensor_slice.get_dtype()
                    want_shape, want_dtype = expected[key]
                    accepted, holds = STORAGE.get(want_dtype, ((SAFETENSORS_DTYPES.get(want_dtype),), None))
                    note = f" ({holds})" if holds else ""
                    if shape != want_shape:
                        raise CheckpointError(f"{path}: tensor {key!r} has shape {shape}, expected {want_shape}{note}")
                    if stored not in accepted:
                        raise CheckpointError(
                            f"{path}: tensor {key!r} has dtype {stored}, expected {' or '.join(accepted)}{note}"
                        )
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from None
    return kind, config, files, saved_names


def load_checkpoint(
    directory: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
    experts_implementation: str = "grouped_mm",
):
    """Validate `directory`, then build the model on `device` without random init and copy the weights in.

    `dtype` casts floating weights (the router stays fp32); by default the checkpoint's own dtype is kept. The
    implementation arguments only apply to `kind="hf"` checkpoints (V4 has eager attention only: `"sdpa"` means
    eager there). A quantised checkpoint loads through transformers with dsfuse's FP8 / FP4 ops
    (`dsfuse.models.quantized.load_quantized_model`, the unquantised tensors in `dtype`, bf16 by default).
    """
    from transformers.initialization import no_init_weights

    kind, config, files, saved_names = _validated(directory)
    if quantization(config):
        from dsfuse.models.quantized import load_quantized_model

        v4 = config.model_type == "deepseek_v4" and attn_implementation == "sdpa"
        return load_quantized_model(directory, device=device, dtype=dtype or torch.bfloat16,
                                    experts_implementation=experts_implementation,
                                    attn_implementation="eager" if v4 else attn_implementation)
    dtype = dtype or _config_dtype(config)
    if kind == "hf":
        v4 = config.model_type == "deepseek_v4" and attn_implementation == "sdpa"
        attn_implementation = "eager" if v4 else attn_implementation
        if saved_names:
            model = _model_class(kind, config).from_pretrained(
                directory, config=config, local_files_only=True, use_safetensors=True, dtype=dtype,
                attn_implementation=attn_implementation, experts_implementation=experts_implementation)
            return keep_fp32_modules(model).to(device).eval()
        config._attn_implementation = attn_implementation
        config._experts_implementation = experts_implementation
    with no_init_weights(), torch.device(device):
        model = _instantiate(kind, config, dtype)
    for path in sorted(set(files.values())):
        model.load_state_dict(load_file(str(path), device=str(device)), strict=False)
    config.dtype = dtype
    return model.eval()
