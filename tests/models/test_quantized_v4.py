"""A DeepSeek V4 checkpoint in V4-Flash's released layout (its own tensor names, FP8 linears with E8M0 block scales,
FP4 routed experts), random weights, loaded through transformers' `from_pretrained` on a machine without a GPU and
without the `kernels` package: the FP8 / FP4 layers call dsfuse's ops, the model runs eagerly and compiles with
dsfuse, and every family fires at least as on the same model dequantised (the FP4 routed experts as `moe_experts_fp8`;
`norm_rope_quant` also shares one activation quantisation between the FP8 projections of one input)."""

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

import dsfuse
from dsfuse import hf_fp8
from dsfuse.kernels.quant_formats import dequantize_fp4, dequantize_fp8_blocks, quantize_activations
from dsfuse.models.quantized import V4_FLASH_LAYOUT, load_quantized_model, released_state, write_fp8_checkpoint

PRESET = "v4-fp8-tiny"
IDS = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
# The tests reading the compiled runs run on one pytest-xdist worker, which compiles each model once.
COMPILED_RUNS = pytest.mark.xdist_group("quantized_v4_compiled_runs")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp(PRESET)
    write_fp8_checkpoint(path, PRESET, scale_fmt="ue8m0", max_shard_bytes=1 << 18)
    return path


def stored(checkpoint):
    """Every tensor of the checkpoint, key -> tensor, through its index."""
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        with safe_open(checkpoint / shard, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    assert tensors.keys() == index.keys()
    return tensors


def test_the_checkpoint_has_v4_flash_names_and_dtypes(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert config["expert_dtype"] == "fp4"
    tensors = stored(checkpoint)
    dtypes = {key: str(t.dtype).removeprefix("torch.") for key, t in tensors.items()}
    assert not [key for key in tensors if key.startswith("model.") or "weight_scale_inv" in key]
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    for part, (rows, cols) in {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}.items():
        weight, scale = (tensors[f"layers.1.ffn.experts.7.{part}.{leaf}"] for leaf in ("weight", "scale"))
        assert weight.dtype == torch.int8 and weight.shape == (rows, cols // 2)  # FP4, two a byte
        assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (rows, cols // 32)  # one per 32 values
    for linear in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "ffn.shared_experts.w1",
                   "ffn.shared_experts.w2", "ffn.shared_experts.w3"):
        assert dtypes[f"layers.0.{linear}.weight"] == "float8_e4m3fn"
        assert dtypes[f"layers.0.{linear}.scale"] == "float8_e8m0fnu"
    assert dtypes["layers.1.attn.indexer.wq_b.scale"] == "float8_e8m0fnu"
    for bf16 in ("embed.weight", "head.weight", "layers.1.attn.compressor.wkv.weight",
                 "layers.1.attn.compressor.wgate.weight", "layers.1.attn.indexer.compressor.wkv.weight",
                 "layers.1.attn.indexer.weights_proj.weight", "layers.1.ffn.gate.weight"):
        assert dtypes[bf16] == "bfloat16" and bf16.replace(".weight", ".scale") not in dtypes
    for fp32 in ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale", "layers.0.hc_attn_fn",
                 "layers.0.hc_ffn_scale", "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight",
                 "layers.1.attn.attn_sink", "layers.1.attn.q_norm.weight", "layers.1.attn.kv_norm.weight",
                 "layers.1.attn.compressor.ape", "layers.1.attn.compressor.norm.weight",
                 "layers.1.attn.indexer.compressor.ape", "layers.1.ffn.gate.bias"):
        assert dtypes[fp32] == "float32", fp32
    assert dtypes["layers.0.ffn.gate.tid2eid"] == "int64"


def test_transformers_loads_every_tensor_where_it_belongs(checkpoint):
    """Read back through transformers' own V4 renames and expert merges, every loaded tensor is the stored one."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8GroupedLinear, FP8Linear

    model = load_quantized_model(checkpoint)
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.q_a_proj, FP8Linear)
    assert isinstance(layers[0].self_attn.o_a_proj, FP8GroupedLinear)
    assert isinstance(layers[1].mlp.experts, FP8Experts) and layers[1].mlp.experts.gate_up_proj.dtype == torch.int8
    assert type(layers[1].self_attn.compressor.kv_proj) is torch.nn.Linear
    tensors = stored(checkpoint)
    loaded = released_state(model.state_dict(), V4_FLASH_LAYOUT)
    assert loaded.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype, key
        assert torch.equal(loaded[key].contiguous().view(torch.uint8), tensor.view(torch.uint8)), key


def test_the_quantised_weights_are_what_transformers_dequantises(checkpoint):
    """dsfuse's FP4 decode and FP8 block scaling give, bit for bit, the weights transformers' `dequantize=True`
    load builds: the dequantised model is the FP8 / FP4 model's weights exactly."""
    model = load_quantized_model(checkpoint)
    plain = load_quantized_model(checkpoint, dequantize=True, dtype=torch.float32)
    for layer in range(3):
        experts, reference = model.model.layers[layer].mlp.experts, plain.model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            decoded = dequantize_fp4(getattr(experts, name), getattr(experts, f"{name}_scale_inv"), torch.float32)
            assert torch.equal(decoded, getattr(reference, name))
        for name in ("self_attn.q_b_proj", "self_attn.o_a_proj", "self_attn.o_b_proj", "mlp.shared_experts.down_proj"):
            fp8, dense = model.model.layers[layer].get_submodule(name), plain.model.layers[layer].get_submodule(name)
            assert torch.equal(dequantize_fp8_blocks(fp8.weight, fp8.weight_scale_inv, 128, 128), dense.weight)


def test_layers_are_w8a8_of_the_dequantised_weights(checkpoint):
    """Plain, grouped (the grouped output projection) and FP4 expert layers: the dequantised layer on activations
    rounded to e4m3 per token and 128 channels (power-of-two scales), to fp32 rounding."""
    model = load_quantized_model(checkpoint, dtype=torch.float32)
    plain = load_quantized_model(checkpoint, dequantize=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)

    def rounded(x):
        q, s = quantize_activations(x, 128, pow2=True)
        return q.float() * s.repeat_interleave(128, dim=-1)[..., :x.shape[-1]]

    attn, reference = model.model.layers[1].self_attn, plain.model.layers[1].self_attn
    x = torch.randn(5, attn.q_a_proj.in_features, generator=g)
    torch.testing.assert_close(attn.q_a_proj(x), reference.q_a_proj(rounded(x)), rtol=1e-5, atol=1e-5)
    groups = torch.randn(5, attn.o_a_proj.n_groups, attn.o_a_proj.in_features, generator=g)
    torch.testing.assert_close(attn.o_a_proj(groups), reference.o_a_proj(rounded(groups)), rtol=1e-5, atol=1e-5)
    experts = model.model.layers[1].mlp.experts
    x = torch.randn(6, experts.hidden_dim, generator=g)
    offsets = torch.tensor([0, 2, 2, 3, 3, 5, 6, 6], dtype=torch.int32)
    out = hf_fp8.matmul_grouped(x, experts.gate_up_proj, experts.gate_up_proj_scale_inv, offsets=offsets)
    weights = plain.model.layers[1].mlp.experts.gate_up_proj
    rows = torch.repeat_interleave(torch.arange(8), torch.diff(offsets, prepend=offsets.new_zeros(1)))
    want = torch.einsum("sk,snk->sn", rounded(x), weights[rows])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def quantised_run(checkpoint):
    """(eager logits, compiled logits, report) of the FP8 / FP4 model, fp32 activations."""
    assert importlib.util.find_spec("kernels") is None or hf_fp8.kernels_choice() == "dsfuse"
    torch._dynamo.reset()
    dsfuse.reset_report()
    model = load_quantized_model(checkpoint, dtype=torch.float32)
    assert hf_fp8.installed()
    with torch.no_grad():
        eager = model(IDS, use_cache=False).logits
        compiled = torch.compile(model, backend="dsfuse")(IDS, use_cache=False).logits
    return eager, compiled, dsfuse.report()


@pytest.fixture(scope="module")
def dequantised_run(checkpoint):
    """(eager logits, report) of the same weights dequantised to fp32 by transformers."""
    torch._dynamo.reset()
    dsfuse.reset_report()
    model = load_quantized_model(checkpoint, dequantize=True, dtype=torch.float32)
    with torch.no_grad():
        reference = model(IDS, use_cache=False).logits
        torch.compile(model, backend="dsfuse")(IDS, use_cache=False)
    return reference, dsfuse.report()


@COMPILED_RUNS
def test_it_runs_and_compiles_without_the_kernels_package(quantised_run):
    eager, compiled, report = quantised_run
    # fp32 activations: the compiled graph's own ops round as eager's, the FP8 / FP4 ops are the same reference math
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert "dsfuse.fp8_linear" in str(report) and "dsfuse.fp8_grouped_linear" in str(report)


@COMPILED_RUNS
def test_every_family_fires_as_on_the_dequantised_model(quantised_run, dequantised_run):
    _, _, quantised = quantised_run
    _, plain = dequantised_run
    assert plain.counts["moe_experts"] == 3 and all(plain.counts.values())  # one MoE block per layer
    # at least as often; norm_rope_quant also shares one activation quantisation between FP8 projections of one
    # input (`dsfuse.fp8_linears`): per layer wq_a and wkv, the shared experts' w1 and w3, and in the CSA layer (the
    # one with an indexer) wq_b and the indexer's wq_b. The routed FP4 experts are no FP8 linears.
    shared = [site for site in quantised.sites if site.op == "dsfuse.fp8_linears"]
    assert len(shared) == 2 * 3 + 1, str(quantised)
    assert all("2 FP8 projections" in site.detail and "E8M0 scales" in site.detail for site in shared), str(quantised)
    assert all(quantised.counts[name] >= count for name, count in plain.counts.items()), str(quantised)
    assert quantised.counts == {**plain.counts, "norm_rope_quant": plain.counts["norm_rope_quant"] + len(shared)}
    assert "dsfuse.moe_experts_fp8" in quantised.details()
    assert "FP4 weights, a scale per row and 32 values" in quantised.details(), quantised.details()
    # each layer's grouped output projection (wo_a, fixed groups) is a block-diagonal linear, not an experts block
    assert quantised.near_misses == [], str(quantised)


@COMPILED_RUNS
def test_the_shared_activation_quantisation_changes_no_bit(quantised_run, checkpoint, monkeypatch):
    """On the CPU `fp8_linears` is the same math as a call per projection: the compiled logits are those of the
    compile without the rewrite, bit for bit."""
    from dsfuse.passes import norm_rope_quant_shared

    _, compiled, _ = quantised_run
    torch._dynamo.reset()
    monkeypatch.setattr(norm_rope_quant_shared, "run", lambda graph, ctx: None)
    model = load_quantized_model(checkpoint, dtype=torch.float32)
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        unshared = torch.compile(model, backend="dsfuse")(IDS, use_cache=False).logits
    assert not [site for site in dsfuse.report().sites if site.op == "dsfuse.fp8_linears"]
    assert torch.equal(compiled, unshared)


@COMPILED_RUNS
def test_logits_move_by_the_activation_rounding_only(quantised_run, dequantised_run):
    """W8A8 against the dequantised weights (exactly the same weights, see above): activations are rounded to e4m3
    per token and 128 channels, up to 2^-4 relative each; through three layers and the hyper-connections of a random
    tiny model the logits move by 6 % on average (seed 0), bounded here at 15 %."""
    eager, _, _ = quantised_run
    reference, _ = dequantised_run
    assert ((eager - reference).abs().mean() / reference.abs().mean()).item() < 0.15


def test_the_writer_refuses_what_transformers_could_not_load(tmp_path):
    with pytest.raises(ValueError, match="FP4 experts carry E8M0 scales"):
        write_fp8_checkpoint(tmp_path / "v4", PRESET, scale_fmt="float")
    with pytest.raises(ValueError, match="expert projection of 32 rows is not a whole number of 128-row blocks"):
        write_fp8_checkpoint(tmp_path / "v32", "tiny")
