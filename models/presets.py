"""Named configurations of transformers' DeepSeek models (V3.2, V4, and the DSA relative GLM-MoE-DSA) and
deterministic random builders.

The passes are developed against the unmodified HF model, so these builders only choose sizes and the
attention / experts implementation; they never patch the model.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to build and run in well under a second on a laptop CPU, yet with S > index_topk
    # reachable in tests (index_topk=8) so the sparse mask really drops keys.
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        mlp_layer_types=["dense", "sparse"],
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=512,
        rope_parameters=dict(_DEFAULT_ROPE),
    ),
    # Real DeepSeek V3.2 layer dimensions, two layers (one dense, one MoE): about 14 B parameters.
    # Plain (non-YaRN) RoPE: the passes do not depend on the frequency schedule.
    "v32-real-2l": dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=2,
        mlp_layer_types=["dense", "sparse"],
        first_k_dense_replace=1,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        max_position_embeddings=163840,
        rope_parameters=dict(_DEFAULT_ROPE),
    ),
}
# `tiny` with every FP8-quantised projection a whole number of 128 x 128 blocks on its split dims (the routed
# experts' gate and up halves keep their own scale rows), for checkpoints in the released FP8 layout.
PRESETS["fp8-tiny"] = dict(PRESETS["tiny"], hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                           q_lora_rank=128, kv_lora_rank=128)
# `fp8-tiny` whose tensor-parallel shards are whole 128 x 128 blocks on up to 4 ranks (transformers splits a weight
# and its block scales by the same even split): q_b, kv_b and o_proj 128 wide per rank at 2 heads a rank, the
# dense and expert MLPs 512 wide.
PRESETS["fp8-tp-tiny"] = dict(PRESETS["fp8-tiny"], num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=64,
                              qk_rope_head_dim=64, v_head_dim=64, index_head_dim=128, intermediate_size=512,
                              moe_intermediate_size=512)

# DeepSeek V4 (`transformers.DeepseekV4ForCausalLM`). Every attention kind appears in `v4-tiny`: a sliding-window
# layer, a compressed sparse (CSA, m=4, indexer top-k 4) and a heavily compressed (HCA, m'=8) one, with the hash
# router on the first layer; the real preset is V4-Flash's layer dimensions on two layers (CSA then HCA, both top-k
# routed), as measured in the issue tracker's baseline.
V4_PRESETS: dict[str, dict[str, Any]] = {
    "v4-tiny": dict(
        vocab_size=256,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.25,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        sliding_window=8,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=4,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        max_position_embeddings=512,
    ),
    "v4-flash-real-2l": dict(
        vocab_size=129280,
        hidden_size=4096,
        moe_intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=64,
        num_key_value_heads=1,
        head_dim=512,
        partial_rotary_factor=0.125,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        n_routed_experts=256,
        num_experts_per_tok=6,
        n_shared_experts=1,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        sliding_window=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["moe", "moe"],
        max_position_embeddings=1048576,
    ),
}
# `v4-tiny` with the grouped output projection's per-group rank a whole 128-row block, which transformers'
# `FP8GroupedLinear` needs to split its scales by group, for checkpoints in V4-Flash's released FP8 / FP4 layout.
V4_PRESETS["v4-fp8-tiny"] = dict(V4_PRESETS["v4-tiny"], o_lora_rank=128)
V4_ATTN_IMPLEMENTATIONS = ("eager",)

# transformers' GlmMoeDsaForCausalLM at a V3.2 preset's dims (the fields GLM's config has).
GLM_PRESETS: dict[str, str] = {"glm-tiny": "tiny", "glm-fp8-tiny": "fp8-tiny"}

ROUTER_FP32_TENSORS = ("e_score_correction_bias", "gate.weight")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


def preset_names() -> list[str]:
    """Every preset `build_hf_model` builds (V3.2, V4 and GLM), sorted: what a command line may name."""
    return sorted([*PRESETS, *V4_PRESETS, *GLM_PRESETS])


def preset_kwargs(preset: str, registry: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """A deep copy of a preset's config kwargs (V3.2 or V4); unknown names raise with the list of valid ones."""
    if registry is None and preset in GLM_PRESETS:
        from transformers import GlmMoeDsaConfig

        fields = GlmMoeDsaConfig.__dataclass_fields__
        return {k: v for k, v in preset_kwargs(GLM_PRESETS[preset]).items() if k in fields}
    names = preset_names() if registry is None else list(registry)
    registry = {**PRESETS, **V4_PRESETS} if registry is None else registry
    if preset not in registry:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(sorted(names))}")
    return json.loads(json.dumps(registry[preset]))


def is_v4_preset(preset: Any) -> bool:
    """Whether `preset` (a name or a config) describes a `DeepseekV4ForCausalLM`."""
    if isinstance(preset, str):
        return preset in V4_PRESETS
    return getattr(preset, "model_type", None) == "deepseek_v4"


def is_glm_preset(preset: Any) -> bool:
    """Whether `preset` (a name or a config) describes a `GlmMoeDsaForCausalLM`."""
    if isinstance(preset, str):
        return preset in GLM_PRESETS
    return getattr(preset, "model_type", None) == "glm_moe_dsa"


def _check_choice(kind: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}")


def hf_config(
    preset: str = "tiny",
    *,
    attn_implementation: str = "sdpa",
    experts_implementation: str = "grouped_mm",
    **overrides: Any,
):
    """A `DeepseekV32Config` (or, for a V4 preset, `DeepseekV4Config`) for `preset`, with `overrides` applied.

    The attention and experts implementations are recorded on the config (`_attn_implementation`,
    `_experts_implementation`): HF's `@use_experts_implementation` experts read the latter at every forward.
    HF V4 supports eager attention only, so a V4 preset's `sdpa` default becomes `eager`.
    """
    from transformers import DeepseekV4Config, DeepseekV32Config, GlmMoeDsaConfig

    v4 = is_v4_preset(preset)
    if v4 and attn_implementation == "sdpa":
        attn_implementation = "eager"
    _check_choice("attn_implementation", attn_implementation, V4_ATTN_IMPLEMENTATIONS if v4 else ATTN_IMPLEMENTATIONS)
    _check_choice("experts_implementation", experts_implementation, EXPERTS_IMPLEMENTATIONS)
    kwargs = preset_kwargs(preset)
    kwargs.update(overrides)
    if "num_hidden_layers" in overrides and "mlp_layer_types" not in overrides:
        # The preset's explicit layer list would no longer match: rebuild it from first_k_dense_replace.
        kwargs.pop("mlp_layer_types", None)
    if v4 and "num_hidden_layers" in overrides and "layer_types" not in overrides:
        kwargs.pop("layer_types", None)
    config_class = DeepseekV4Config if v4 else GlmMoeDsaConfig if is_glm_preset(preset) else DeepseekV32Config
    return config_class(
        **kwargs,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )


def seeded_build(build, *, seed: int, device: torch.device | str, dtype: torch.dtype):
    """Run `build()` with a private RNG seeded by `seed`, on `device` and with `dtype` as default dtype.

    Building directly on the target device keeps the 14 B preset from spending minutes initialising on the CPU;
    forking the RNG keeps the caller's random stream untouched.
    """
    device = torch.device(device)
    rng_devices = [device] if device.type == "cuda" else []
    previous_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        try:
            torch.set_default_dtype(dtype)
            with torch.device(device):
                return build()
        finally:
            torch.set_default_dtype(previous_dtype)


def keep_fp32_modules(model: torch.nn.Module) -> torch.nn.Module:
    """Store the tensors HF lists in `_keep_in_fp32_modules_strict` (router weight, correction bias) in fp32.

    transformers 5.24 already creates them in fp32; older 5.x releases (5.17 on the GPU machine) follow the model
    dtype and lack the list, so this makes the stored dtypes (and checkpoints) the same on every version.
    """
    v4 = getattr(model.config, "model_type", None) == "deepseek_v4"  # V4's router multiplies in the model dtype
    patterns = {*(() if v4 else ROUTER_FP32_TENSORS), *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and tensor.dtype != torch.float32 and any(p in name for p in patterns):
            tensor.data = tensor.data.float()
    return model


def build_hf_model(
    preset: str | Any = "tiny",
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
    experts_implementation: str = "grouped_mm",
    seed: int = 0,
    **overrides: Any,
):
    """A randomly initialised `DeepseekV32ForCausalLM` (`DeepseekV4ForCausalLM` for a V4 preset,
    `GlmMoeDsaForCausalLM` for a GLM one) in eval mode.

    The same seed gives the same weights. `preset` is a `PRESETS` / `V4_PRESETS` / `GLM_PRESETS` name (with
    `overrides` applied)
    or a ready config. The router weight and `e_score_correction_bias` stay fp32 whatever `dtype` is, as
    transformers 5.24 keeps them (`keep_fp32_modules`).
    """
    from transformers import DeepseekV4ForCausalLM, DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM

    v4 = is_v4_preset(preset)
    if v4 and attn_implementation == "sdpa":
        attn_implementation = "eager"
    if isinstance(preset, str):
        config = hf_config(
            preset, attn_implementation=attn_implementation, experts_implementation=experts_implementation, **overrides
        )
    else:
        _check_choice("attn_implementation", attn_implementation, V4_ATTN_IMPLEMENTATIONS if v4 else ATTN_IMPLEMENTATIONS)
        _check_choice("experts_implementation", experts_implementation, EXPERTS_IMPLEMENTATIONS)
        config = copy.deepcopy(preset)
    model_class = (DeepseekV4ForCausalLM if v4 else GlmMoeDsaForCausalLM if is_glm_preset(config)
                   else DeepseekV32ForCausalLM)
    model = seeded_build(
        lambda: model_class._from_config(
            config,
            dtype=dtype,
            attn_implementation=attn_implementation,
            experts_implementation=experts_implementation,
        ),
        seed=seed,
        device=device,
        dtype=dtype,
    )
    return keep_fp32_modules(model).eval()


def build_hf_model_from_dir(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
    experts_implementation: str = "grouped_mm",
):
    """Load a local `DeepseekV32ForCausalLM` directory (config.json + safetensors) through transformers.

    `config.json` and every tensor's name, shape and dtype are validated from the headers first (see
    `dsfuse.models.checkpoint.validate_checkpoint`), so a bad directory fails with the file and key named; the
    weights must use the in-memory key layout (fused `experts.gate_up_proj`), as `write_random_checkpoint` writes.
    Pickle weights are never read (`use_safetensors=True`).
    """
    from transformers import DeepseekV32ForCausalLM

    from dsfuse.models.checkpoint import read_config_json, validate_checkpoint

    _check_choice("attn_implementation", attn_implementation, ATTN_IMPLEMENTATIONS)
    _check_choice("experts_implementation", experts_implementation, EXPERTS_IMPLEMENTATIONS)
    path = Path(path)
    read_config_json(path, expected_model_type="deepseek_v32")
    validate_checkpoint(path)
    model = DeepseekV32ForCausalLM.from_pretrained(
        path,
        local_files_only=True,
        use_safetensors=True,
        dtype=dtype if dtype is not None else "auto",
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )
    return keep_fp32_modules(model).to(device).eval()
