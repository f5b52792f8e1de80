"""The checkpoint validator on released quantised layouts (V3.2 and GLM-5 FP8 with F32 or F8_E8M0 block scales,
V4-Flash's names with FP8 linears and FP4 experts): accepted as transformers would load them, and every wrong dtype,
shape or name refused from the headers alone, with the file and key named."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsfuse.models.checkpoint import CheckpointError, load_checkpoint, validate_checkpoint
from dsfuse.models.quantized import write_fp8_checkpoint

FP4_WEIGHT = "layers.1.ffn.experts.5.w3.weight"
FP4_SCALE = "layers.1.ffn.experts.5.w3.scale"
FP8_SCALE = "layers.0.attn.wq_b.scale"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One unsharded checkpoint per layout, written once."""
    root = tmp_path_factory.mktemp("quantised")
    return {(preset, fmt): write_fp8_checkpoint(root / f"{preset}-{fmt}", preset, scale_fmt=fmt)
            for preset, fmt in [("fp8-tiny", "float"), ("fp8-tiny", "ue8m0"), ("glm-fp8-tiny", "ue8m0"),
                                ("v4-fp8-tiny", "ue8m0")]}


@pytest.fixture
def v4(written, tmp_path):
    """A fresh copy of the V4-Flash checkpoint for a test to damage."""
    return shutil.copytree(written["v4-fp8-tiny", "ue8m0"], tmp_path / "v4")


def rewrite(directory, edit):
    state = load_file(directory / "model.safetensors")
    edit(state)
    save_file(state, directory / "model.safetensors")


@pytest.mark.parametrize("layout", [("fp8-tiny", "float"), ("fp8-tiny", "ue8m0"), ("glm-fp8-tiny", "ue8m0"),
                                    ("v4-fp8-tiny", "ue8m0")])
def test_released_layouts_are_accepted(written, layout):
    directory = written[layout]
    kind, config, files = validate_checkpoint(directory)
    assert kind == "hf" and config.quantization_config["scale_fmt"] == layout[1]
    assert set(files) == set(load_file(directory / "model.safetensors"))


def test_fp4_bytes_may_be_unsigned_and_mtp_layers_are_ignored_as_transformers_does(v4):
    rewrite(v4, lambda state: state.update({FP4_WEIGHT: state[FP4_WEIGHT].view(torch.uint8),
                                            "mtp.0.emb.weight": torch.zeros(4, 2)}))
    validate_checkpoint(v4)


def test_a_v4_flash_checkpoint_loads_with_dsfuse_ops(v4):
    from transformers.integrations.finegrained_fp8 import FP8Experts

    model = load_checkpoint(v4, dtype=torch.float32)
    assert isinstance(model.model.layers[2].mlp.experts, FP8Experts)
    assert model.model.layers[2].mlp.experts.down_proj.dtype == torch.int8


@pytest.mark.parametrize("key, edit, message", [
    (FP4_WEIGHT, lambda t: torch.zeros(t.shape, dtype=torch.float8_e4m3fn),
     r"has dtype F8_E4M3, expected I8 or U8 \(packed FP4"),
    (FP4_WEIGHT, lambda t: torch.zeros(t.shape[0], 2 * t.shape[1], dtype=torch.int8),
     r"has shape \(32, 64\), expected \(32, 32\) \(packed FP4: two E2M1 values a byte"),
    (FP4_SCALE, lambda t: t.float(), r"has dtype F32, expected F8_E8M0 \(E8M0 block scales\)"),
    (FP4_SCALE, lambda t: t.view(torch.uint8), r"has dtype U8, expected F8_E8M0"),
    (FP4_SCALE, lambda t: t[:, :1].contiguous(), r"has shape \(32, 1\), expected \(32, 2\)"),
    (FP8_SCALE, lambda t: torch.ones(2, 1, dtype=t.dtype), r"has shape \(2, 1\), expected \(1, 1\)"),
    ("layers.0.attn.wq_b.weight", lambda t: t.bfloat16(), "has dtype BF16, expected F8_E4M3"),
])
def test_a_wrong_dtype_or_shape_names_file_and_key(v4, key, edit, message):
    rewrite(v4, lambda state: state.update({key: edit(state[key])}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{key}' {message}"):
        validate_checkpoint(v4)


def test_v32_names_or_a_missing_scale_are_refused(v4):
    rewrite(v4, lambda state: state.update({"layers.0.attn.wq_b.weight_scale_inv": state.pop(FP8_SCALE)}))
    with pytest.raises(CheckpointError, match=f"missing tensor '{FP8_SCALE}'"):
        validate_checkpoint(v4)


def test_float_scales_must_stay_float(written, tmp_path):
    directory = shutil.copytree(written["fp8-tiny", "float"], tmp_path / "v32")
    key = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    rewrite(directory, lambda state: state.update({key: state[key].to(torch.float8_e8m0fnu)}))
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' has dtype F8_E8M0, expected F32"):
        validate_checkpoint(directory)


def test_an_unsupported_quantisation_names_config_json(v4):
    config = json.loads((v4 / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (v4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config quant_method 'awq' is not supported"):
        validate_checkpoint(v4)


@pytest.mark.parametrize("preset", ["v4-tiny", "glm-tiny"])
def test_bf16_v4_and_glm_checkpoints_round_trip(tmp_path, preset):
    from dsfuse.models.checkpoint import save_model
    from dsfuse.models.presets import build_hf_model

    reference = build_hf_model(preset, seed=2)
    loaded = load_checkpoint(save_model(reference, tmp_path))
    assert type(loaded) is type(reference)
    assert loaded.config._attn_implementation == ("eager" if preset == "v4-tiny" else "sdpa")  # V4: eager only
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
