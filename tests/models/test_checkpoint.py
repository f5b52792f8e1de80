"""Random checkpoints round-trip; every malformed case fails with the file and key named, before any weight loads."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsfuse.models import checkpoint
from dsfuse.models.checkpoint import CheckpointError, load_checkpoint, write_random_checkpoint
from dsfuse.models.official import build_own_model
from dsfuse.models.presets import build_hf_model, build_hf_model_from_dir

EXPERT_KEY = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("hf"), seed=5, dtype=torch.float32)


@pytest.fixture
def broken_dir(tmp_path):
    """A fresh single-file own-model checkpoint for a test to damage."""
    return write_random_checkpoint("own-tiny", tmp_path / "own", seed=5, dtype=torch.float32)


def rewrite_weights(directory, edit):
    path = directory / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path)
    return path


def refuse_weight_loading(monkeypatch):
    """Make any attempt to read tensor data fail loudly, to prove validation happens first."""

    def fail(*args, **kwargs):
        raise AssertionError("weights were loaded before validation finished")

    monkeypatch.setattr(checkpoint, "load_file", fail)


@pytest.mark.parametrize("kind, preset", [("hf", "tiny"), ("own", "own-tiny")])
@pytest.mark.parametrize("max_shard_bytes", [None, 30_000])
def test_round_trip_single_and_sharded(tmp_path, kind, preset, max_shard_bytes):
    directory = write_random_checkpoint(
        preset, tmp_path, kind=kind, seed=3, dtype=torch.float32, max_shard_bytes=max_shard_bytes
    )
    names = sorted(p.name for p in directory.iterdir())
    if max_shard_bytes is None:
        assert names == ["config.json", "model.safetensors"]
    else:
        assert "model.safetensors.index.json" in names and "model-00002-of-" in " ".join(names)
    loaded = load_checkpoint(directory)
    reference = build_hf_model(preset, seed=3) if kind == "hf" else build_own_model(preset, seed=3)
    assert type(loaded) is type(reference)
    loaded_state, reference_state = loaded.state_dict(), reference.state_dict()
    assert loaded_state.keys() == reference_state.keys()
    assert all(torch.equal(loaded_state[key], reference_state[key]) for key in reference_state)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_bf16_checkpoint_keeps_router_fp32_and_loads_as_fp32_on_request(tmp_path):
    directory = write_random_checkpoint("tiny", tmp_path, seed=1, dtype=torch.bfloat16)
    loaded = load_checkpoint(directory)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert loaded.model.layers[1].mlp.gate.weight.dtype == torch.float32
    upcast = load_checkpoint(directory, dtype=torch.float32)
    assert upcast.lm_head.weight.dtype == torch.float32
    assert torch.equal(upcast.lm_head.weight, loaded.lm_head.weight.float())


def test_transformers_from_pretrained_path_loads_the_same_weights(hf_dir):
    model = build_hf_model_from_dir(hf_dir, experts_implementation="batched_mm")
    assert model.config._experts_implementation == "batched_mm"
    reference = build_hf_model("tiny", seed=5).state_dict()
    assert all(torch.equal(value, reference[key]) for key, value in model.state_dict().items())


def test_malformed_config_json_names_file_and_position(broken_dir, monkeypatch):
    (broken_dir / "config.json").write_text('{"model_type": "dsfuse_deepseek", "hidden_size": 64,,}')
    refuse_weight_loading(monkeypatch)
    with pytest.raises(CheckpointError, match=r"config\.json: malformed JSON: .* line 1 column"):
        load_checkpoint(broken_dir)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(model_type="llama"), "'model_type' is 'llama'"),
        (lambda c: c.update(hidden_size="wide"), "hidden_size"),
        (lambda c: c.update(scale_fmt="e5m2"), "scale_fmt"),
        (lambda c: c.update(num_hidden_layers=-1), "num_hidden_layers"),
    ],
)
def test_invalid_config_values_name_the_key(broken_dir, monkeypatch, edit, message):
    config = json.loads((broken_dir / "config.json").read_text())
    edit(config)
    (broken_dir / "config.json").write_text(json.dumps(config))
    refuse_weight_loading(monkeypatch)
    with pytest.raises(CheckpointError, match=message) as raised:
        load_checkpoint(broken_dir)
    assert "config.json" in str(raised.value)


def test_missing_config_json(broken_dir):
    (broken_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_checkpoint(broken_dir)


def test_missing_tensor_names_the_key(broken_dir, monkeypatch):
    rewrite_weights(broken_dir, lambda state: state.pop(EXPERT_KEY))
    refuse_weight_loading(monkeypatch)
    with pytest.raises(CheckpointError, match=f"missing tensor '{EXPERT_KEY}'"):
        load_checkpoint(broken_dir)


def test_unexpected_tensor_names_file_and_key(broken_dir, monkeypatch):
    rewrite_weights(broken_dir, lambda state: state.update(stray=torch.zeros(2)))
    refuse_weight_loading(monkeypatch)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'stray'"):
        load_checkpoint(broken_dir)


def test_wrong_shape_names_file_key_and_shapes(broken_dir, monkeypatch):
    rewrite_weights(broken_dir, lambda state: state.update({EXPERT_KEY: state[EXPERT_KEY][:, :-1].contiguous()}))
    refuse_weight_loading(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{EXPERT_KEY}' has shape \(8, 63, 32\)"):
        load_checkpoint(broken_dir)


@pytest.mark.parametrize(
    "key, dtype, stored",
    [(EXPERT_KEY, torch.float32, "F32"), ("model.layers.1.mlp.gate.weight", torch.bfloat16, "BF16")],
)
def test_wrong_dtype_names_file_and_key(broken_dir, monkeypatch, key, dtype, stored):
    rewrite_weights(broken_dir, lambda state: state.update({key: state[key].to(dtype)}))
    refuse_weight_loading(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{key}' has dtype {stored}"):
        load_checkpoint(broken_dir)


def test_sharded_index_pointing_at_missing_shard(tmp_path, monkeypatch):
    directory = write_random_checkpoint("tiny", tmp_path, seed=0, dtype=torch.float32, max_shard_bytes=30_000)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    refuse_weight_loading(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"index\.json: key .* points to missing file '{shard.name}'"):
        load_checkpoint(directory)


def test_corrupt_safetensors_file_is_named(broken_dir, monkeypatch):
    (broken_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    refuse_weight_loading(monkeypatch)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(broken_dir)


def test_pickle_weights_are_never_loaded(broken_dir):
    (broken_dir / "model.safetensors").unlink()
    (broken_dir / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match=r"no safetensors weights.*pytorch_model\.bin.*never loaded"):
        load_checkpoint(broken_dir)


def test_hf_from_dir_validates_before_transformers_loads(hf_dir, tmp_path):
    broken = tmp_path / "hf"
    broken.mkdir()
    (broken / "config.json").write_text((hf_dir / "config.json").read_text())
    state = load_file(hf_dir / "model.safetensors")
    state[EXPERT_KEY] = state[EXPERT_KEY][:4].contiguous()
    save_file(state, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor '{EXPERT_KEY}' has shape"):
        build_hf_model_from_dir(broken)


def test_kind_must_match_preset(tmp_path):
    with pytest.raises(ValueError, match="'own' model"):
        write_random_checkpoint("own-tiny", tmp_path, kind="hf")
    with pytest.raises(ValueError, match="valid presets"):
        write_random_checkpoint("enormous", tmp_path)


def test_v4_saved_by_transformers_loads_in_its_released_names(tmp_path):
    """transformers saves DeepSeek V4 in its released names (`attn.attn_sink`, `head.weight`, ...): the validator
    takes them and the loader maps them back through transformers, to the same weights."""
    model = build_hf_model("v4-tiny", seed=4)
    model.save_pretrained(tmp_path / "v4")
    assert "model.layers.0.attn.attn_sink" in load_file(tmp_path / "v4" / "model.safetensors")
    loaded = load_checkpoint(tmp_path / "v4")
    assert type(loaded) is type(model)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_v4_in_released_names_with_a_tensor_missing_names_it(tmp_path):
    build_hf_model("v4-tiny", seed=4).save_pretrained(tmp_path / "v4")
    rewrite_weights(tmp_path / "v4", lambda state: state.pop("model.layers.1.attn.attn_sink"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.attn\.attn_sink'$"):
        checkpoint.validate_checkpoint(tmp_path / "v4")
