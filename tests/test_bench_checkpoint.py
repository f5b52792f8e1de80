"""`python -m dsfuse.bench checkpoint` writes a released-layout checkpoint; `model --checkpoint` / `generate
--checkpoint` benchmark it after loading through `from_pretrained` (CPU smoke runs, eager only: the compiled FP8
models are covered by tests/models/test_quantized*.py)."""

import json

import pytest
import torch

from dsfuse.bench import main
from dsfuse.models.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8-tiny")
    assert main(["checkpoint", "--preset", "fp8-tiny", "--out", str(out), "--device", "cpu"]) == 0
    return out


def test_checkpoint_writes_the_released_fp8_layout(fp8_dir, capsys):
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32"
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    from safetensors import safe_open

    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(key).get_dtype() for key in f.keys() if key.endswith("q_a_proj.weight")}
    assert dtypes == {"F8_E4M3"}


def test_model_bench_loads_the_checkpoint(fp8_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["model", "--checkpoint", str(fp8_dir), "--seq", "16", "--device", "cpu", "--dtype", "bfloat16",
                 "--configs", "eager", "--rep-ms", "20", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["preset"] == f"checkpoint:{fp8_dir.name}"
    (row,) = results["runs"]
    assert row["config"] == "eager" and row["ms"] > 0 and "error" not in row
    assert f"# loaded {fp8_dir}" in capsys.readouterr().out


def test_generate_bench_loads_the_checkpoint(fp8_dir, tmp_path):
    out = tmp_path / "generate.json"
    assert main(["generate", "--checkpoint", str(fp8_dir), "--device", "cpu", "--prompt", "9", "--new-tokens", "2",
                 "--configs", "eager", "--repeats", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["preset"] == f"checkpoint:{fp8_dir.name}"
    assert all("error" not in row for row in results["runs"]) and results["runs"]


def test_model_bench_refuses_a_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        main(["model", "--checkpoint", str(tmp_path), "--seq", "16", "--device", "cpu", "--configs", "eager"])


def test_v4_checkpoint_decode_is_refused_with_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    with pytest.raises(SystemExit):
        main(["model", "--checkpoint", str(tmp_path), "--mode", "decode", "--device", "cpu"])
    assert "DeepSeek V4" in capsys.readouterr().err


def test_bf16_format_writes_an_unquantised_checkpoint(tmp_path):
    out = tmp_path / "bf16"
    assert main(["checkpoint", "--preset", "tiny", "--out", str(out), "--format", "bf16", "--device", "cpu"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} <= {torch.bfloat16, torch.float32}
