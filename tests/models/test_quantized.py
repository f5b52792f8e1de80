"""Released-format FP8 checkpoints (DeepSeek V3.2 and GLM-5 layouts, random weights) loaded through transformers'
`from_pretrained` on a machine without a GPU and without the `kernels` package: the FP8 layers call dsfuse's ops,
the model runs eagerly and compiles with dsfuse, every family fires at least as on the same model dequantised (the
experts as one `moe_experts_fp8`; `norm_rope_quant` also shares one activation quantisation between the FP8
projections of one input), and the compiled model computes what the eager one does."""

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

import dsfuse
from dsfuse import hf_fp8
from dsfuse.models.quantized import load_quantized_model, write_fp8_checkpoint
from dsfuse.passes import norm_rope_quant_shared


@pytest.fixture(scope="module", params=["fp8-tiny", "glm-fp8-tiny"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_fp8_checkpoint(path, request.param, scale_fmt="ue8m0", max_shard_bytes=1 << 20)
    return path


def test_the_checkpoint_is_in_the_released_layout(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # sharded
    dtypes = {}
    for key, shard in index.items():
        with safe_open(checkpoint / shard, "pt") as f:
            dtypes[key] = f.get_slice(key).get_dtype()
    layer = "model.layers.1."
    for part in ("gate_proj", "up_proj", "down_proj"):  # one expert at a time, as released
        assert dtypes[f"{layer}mlp.experts.3.{part}.weight"] == "F8_E4M3"
        assert dtypes[f"{layer}mlp.experts.3.{part}.weight_scale_inv"] == "F8_E8M0"
    assert dtypes["model.layers.0.self_attn.q_a_proj.weight"] == "F8_E4M3"
    assert dtypes["model.embed_tokens.weight"] == "BF16" and dtypes["lm_head.weight"] == "BF16"
    assert dtypes[f"{layer}mlp.gate.weight"] == "F32"


def test_it_loads_runs_and_compiles_without_the_kernels_package(checkpoint, monkeypatch):
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    assert importlib.util.find_spec("kernels") is None or hf_fp8.kernels_choice() == "dsfuse"
    model = load_quantized_model(checkpoint, dtype=torch.float32)
    assert hf_fp8.installed()
    assert isinstance(model.model.layers[0].self_attn.q_a_proj, FP8Linear)
    assert isinstance(model.model.layers[1].mlp.experts, FP8Experts)
    ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        compiled = torch.compile(model, backend="dsfuse")(ids, use_cache=False).logits
    quantised = dsfuse.report()
    # fp32 activations: the compiled graph's own ops round as eager's, the FP8 ops are the same reference math
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert "dsfuse.fp8_linear" in str(quantised)
    # the FP8 projections of one input share one activation quantisation (`dsfuse.fp8_linears`), per layer: q_a, kv_a
    # and the indexer's wk; q_b and the indexer's wq_b; the dense MLP's or the shared expert's gate and up
    shared = [site for site in quantised.sites if site.op == "dsfuse.fp8_linears"]
    assert len(shared) == 3 * model.config.num_hidden_layers, str(quantised)
    assert sorted(site.detail.split(" FP8")[0] for site in shared) == sorted(
        model.config.num_hidden_layers * [f"one activation quantisation for {n}" for n in (3, 2, 2)])
    assert all("E8M0 scales" in site.detail for site in shared)
    if model.config.model_type == "deepseek_v32":  # (GLM's projections are grouped alike: one compile less)
        # on the CPU the same math as a call per projection: the logits of the compile without it, bit for bit
        torch._dynamo.reset()
        monkeypatch.setattr(norm_rope_quant_shared, "run", lambda graph, ctx: None)
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            unshared = torch.compile(model, backend="dsfuse")(ids, use_cache=False).logits
        monkeypatch.undo()
        assert torch.equal(compiled, unshared)

    torch._dynamo.reset()
    dsfuse.reset_report()
    dequantised = load_quantized_model(checkpoint, dequantize=True, dtype=torch.float32)
    with torch.no_grad():
        reference = dequantised(ids, use_cache=False).logits
        torch.compile(dequantised, backend="dsfuse")(ids, use_cache=False)
    plain = dsfuse.report()
    # every family at least as on the dequantised model, the FP8 experts as one dsfuse.moe_experts_fp8; norm_rope_quant
    # also has the shared activation quantisations
    assert all(quantised.counts[name] >= count for name, count in plain.counts.items()), str(quantised)
    assert quantised.counts == {**plain.counts, "norm_rope_quant": plain.counts["norm_rope_quant"] + len(shared)}
    assert plain.counts["moe_experts"] == 1, str(plain)
    assert "dsfuse.moe_experts_fp8" in quantised.details()
    assert "FP8 weights in 128 x 128 blocks" in quantised.details(), quantised.details()
    assert quantised.near_misses == [], str(quantised)
    # W8A8 against the dequantised weights: activations rounded to e4m3 per token and 128 channels; through two
    # layers of a random tiny model (no trained structure to absorb it) the logits move by a tenth to a fifth on
    # average (bf16 activations alone move them by ~2 %)
    assert ((eager - reference).abs().mean() / reference.abs().mean()).item() < 0.3


def test_layers_are_w8a8_of_the_dequantised_weights(checkpoint):
    """Layer by layer, the FP8 model is the dequantised one on e4m3-rounded activations, to fp32 rounding."""
    from dsfuse.kernels.quant_formats import quantize_activations

    model = load_quantized_model(checkpoint, dtype=torch.float32)
    dequantised = load_quantized_model(checkpoint, dequantize=True, dtype=torch.float32)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for name in ("model.layers.0.self_attn.q_a_proj", "model.layers.0.mlp.down_proj"):
        layer, plain = model.get_submodule(name), dequantised.get_submodule(name)
        inputs = x if layer.in_features == x.shape[1] else x[:, :layer.in_features]
        q, s = quantize_activations(inputs, 128, pow2=True)
        rounded = q.float() * s.repeat_interleave(128, dim=1)[:, :inputs.shape[1]]
        torch.testing.assert_close(layer(inputs), plain(rounded), rtol=1e-5, atol=1e-5)


def test_batched_entry_point_is_the_grouped_one_on_sorted_rows_and_zeroes_other_ranks():
    """transformers' `matmul_batched` (each row its own expert; ids >= E are other ranks' slots)."""
    from dsfuse.kernels.fp8_linear import fp8_linear_reference
    from dsfuse.models.quantized import quantize_fp8_weight

    g = torch.Generator().manual_seed(2)
    weight, scale = quantize_fp8_weight(torch.randn(4, 128, 256, generator=g) * 0.1, scale_fmt="ue8m0")
    x = torch.randn(9, 256, generator=g)
    ids = torch.tensor([3, 0, 4, 3, 1, 7, 0, 2, 3])
    out = hf_fp8.matmul_batched(x, weight, scale, block_size=[128, 128], expert_ids=ids)
    for row, expert in enumerate(ids.tolist()):
        want = fp8_linear_reference(x[row:row + 1], weight[expert], scale[expert], 128, 128) if expert < 4 \
            else torch.zeros(1, 128)
        torch.testing.assert_close(out[row:row + 1], want, rtol=1e-6, atol=1e-6)


def test_the_report_says_when_fp8_weights_are_served_by_something_else():
    from dsfuse.backend import quantised_layers_note

    graph = torch.fx.Graph()
    weight = graph.placeholder("weight")
    weight.meta["example_value"] = torch.empty(4, 4, dtype=torch.float8_e4m3fn)
    graph.output(graph.call_function(torch.ops.aten.clone.default, (weight,)))
    assert "served by another implementation" in quantised_layers_note(torch.fx.GraphModule({}, graph))
    assert quantised_layers_note(torch.fx.GraphModule({}, torch.fx.Graph())) == ""


def test_expert_parallel_fp8_experts_fuse_and_skip_other_ranks_slots(checkpoint):
    """transformers' FP8 expert-parallel form zeroes other ranks' slots (id E) after the router weighting, where its
    bf16 form masks each GEMM's rows: the block is still one `moe_experts_fp8`, and the sentinel slots add nothing."""
    experts = load_quantized_model(checkpoint, dtype=torch.float32).model.layers[1].mlp.experts
    experts._is_expert_parallel = True
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, experts.hidden_dim, generator=g)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(9)])
    ids[::2, 1] = experts.num_experts
    weights = torch.rand(9, 2, generator=g)
    torch._dynamo.reset()
    dsfuse.reset_report()
    with torch.no_grad():
        compiled = torch.compile(experts, backend="dsfuse")(x, ids, weights)
        torch.testing.assert_close(compiled, experts(x, ids, weights), rtol=1e-5, atol=1e-5)
    sites = [site for site in dsfuse.report().sites if site.op == "dsfuse.moe_experts_fp8"]
    assert len(sites) == 1 and "expert-parallel sentinel slots skipped" in sites[0].detail, str(dsfuse.report())
