"""Models dsfuse is developed and tested against: HF `DeepseekV32ForCausalLM` presets, dsfuse's own
official-style DeepSeek model (absorbed MLA, fp8 indexer, FP4 experts), and safetensors checkpoints."""

from dsfuse.models.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_model,
    validate_checkpoint,
    write_random_checkpoint,
)
from dsfuse.models.official import (
    OWN_PRESETS,
    DsfuseCache,
    DsfuseDeepseekConfig,
    DsfuseDeepseekForCausalLM,
    build_own_model,
    dequantize_fp4,
    own_config,
    quantize_fp4,
    quantize_fp8_blockwise,
)
from dsfuse.models.presets import GLM_PRESETS, PRESETS, V4_PRESETS, build_hf_model, build_hf_model_from_dir, hf_config

__all__ = [
    "CheckpointError",
    "DsfuseCache",
    "DsfuseDeepseekConfig",
    "DsfuseDeepseekForCausalLM",
    "GLM_PRESETS",
    "OWN_PRESETS",
    "PRESETS",
    "V4_PRESETS",
    "build_hf_model",
    "build_hf_model_from_dir",
    "build_own_model",
    "dequantize_fp4",
    "hf_config",
    "load_checkpoint",
    "own_config",
    "quantize_fp4",
    "quantize_fp8_blockwise",
    "save_model",
    "validate_checkpoint",
    "write_random_checkpoint",
]
