"""benchmarks/model_fuzz_gpu.py's CPU smoke mode: one left-padded tiny-preset case, its JSON and markdown; a prefill
and, with --generate, a greedy generate through dsfuse's recipe (the tiny preset's and v4-tiny's)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

# one layer of the tiny preset, in every graph: the norm/rope glue, the indexer and the sparse attention
ONE_LAYER_SITES = {"norm_rope_quant": 5, "indexer_topk": 1, "sparse_attention": 1}
# one layer of v4-tiny (an HCA layer with the hash-routed MoE), in the prefill graph and the decode graph alike
V4_ONE_LAYER_SITES = {"norm_rope_quant": 3, "sparse_attention": 1, "moe_experts": 1, "hyper_connections": 5,
                      "compressors": 1}


def _module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "model_fuzz_gpu.py"
    spec = importlib.util.spec_from_file_location("model_fuzz_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_fuzz_cpu_smoke(tmp_path):
    assert _module().main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    (case,) = json.loads((tmp_path / "model_fuzz.json").read_text())
    assert (case["preset"], case["batch"], case["seq"]) == ("tiny", 2, 5) and "error" not in case, case
    # one layer: the norm/rope glue, the indexer and the sparse attention each rewritten, nothing left as a near-miss
    assert case["sites"]["indexer_topk"] == 1 and case["sites"]["sparse_attention"] == 1, case
    assert case["near_misses"] == [], case
    assert case["dsfuse_err"] <= max(1e-5, 2 * case["inductor_err"]), case
    assert "| tiny | fresh | 2 | 5 | 1 |" in (tmp_path / "model_fuzz.md").read_text()


def _generate_smoke(tmp_path, preset, sites, preset_argv=()):
    """`--cpu-smoke --generate 3` (B=2, S=5): one prefill and one decode graph, each rewriting `sites` with no
    near-miss, and dsfuse's tokens equal to eager's (fp32). Returns the case and the markdown."""
    argv = ["--cpu-smoke", *preset_argv, "--generate", "3", "--no-inductor", "--out", str(tmp_path)]
    assert _module().main(argv) == 0
    (case,) = json.loads((tmp_path / "model_fuzz.json").read_text())
    assert (case["preset"], case["batch"], case["seq"], case["generate"]) == (preset, 2, 5, 3), case
    assert "error" not in case, case
    for kind in ("prefill", "decode"):
        assert case[kind]["graphs"] == 1 and case[kind]["sites"] == sites, case
        assert case[kind]["near_misses"] == [], case
    assert case["tokens_equal"] and case["prefix"] == 3, case
    return case, (tmp_path / "model_fuzz.md").read_text()


def test_model_fuzz_cpu_smoke_generate(tmp_path):
    """The prefill graph and the decode graph (one token per sequence) each rewrite every family of the layer, no
    near-miss, and dsfuse's tokens are eager's (fp32)."""
    case, table = _generate_smoke(tmp_path, "tiny", ONE_LAYER_SITES)
    assert case["inductor_prefix"] is None, case
    assert "| tiny | sdpa | 2 | 5 | 3 | 1 + 1 |" in table


@pytest.mark.slow
def test_model_fuzz_cpu_smoke_generate_v4(tmp_path):
    """V4's decode step (through `V4DecodeCache`) is told from its prefill as V3.2's is: the hash-routed MoE's
    [vocab, top-k] integer table, a graph input like the token ids, is not read as the graph's tokens."""
    _, table = _generate_smoke(tmp_path, "v4-tiny", V4_ONE_LAYER_SITES, ("--presets", "v4-tiny"))
    assert "| v4-tiny | eager | 2 | 5 | 3 | 1 + 1 | norm_rope_quant 3," in table


def test_matching_prefix_counts_new_tokens_every_row_shares():
    prefix = _module()._matching_prefix
    ref = torch.tensor([[7, 7, 1, 2, 3], [7, 7, 4, 5, 6]])
    assert prefix(ref.clone(), ref, 2) == 3
    assert prefix(torch.tensor([[7, 7, 1, 2, 0], [7, 7, 4, 0, 6]]), ref, 2) == 1  # row 1 differs at its 2nd
    assert prefix(torch.tensor([[7, 7, 9, 2, 3], [7, 7, 4, 5, 6]]), ref, 2) == 0


# Cells at the lengths the kernels split on: one token, the index top-k (8) minus and plus one, a compressor
# window (V4: m = 4) plus one; batches of 1 to 3 rows, rows after the first left-padded.
GRID = [("tiny", 3, 9), ("tiny", 1, 7), ("tiny", 2, 1), ("glm-tiny", 3, 9), ("v4-tiny", 3, 9), ("v4-tiny", 1, 5)]
@pytest.mark.slow
def test_model_fuzz_cpu_grid():
    """Every cell runs, rewrites its layer's families with no near-miss (one token attends to itself alone: no sparse
    attention to fuse), and in fp32 gives eager's logits to fp32 rounding."""
    from dsfuse.models.presets import build_hf_model

    fuzz = _module()
    models = {}
    for preset, batch, seq in GRID:
        if preset not in models:
            models[preset] = build_hf_model(preset, num_hidden_layers=1)
        case = fuzz.run_case(models[preset], preset, batch, seq, "cpu", with_inductor=False)
        assert "error" not in case, case
        want = dict(V4_ONE_LAYER_SITES if preset == "v4-tiny" else ONE_LAYER_SITES)
        if preset != "v4-tiny":
            want["moe_experts"] = 0  # the tiny presets' first layer is dense
        if seq == 1:
            want.pop("sparse_attention")
        if preset == "v4-tiny" and seq < 8:
            want.pop("compressors")  # the HCA window (m' = 8) is not filled yet: HF compresses nothing
        assert {k: v for k, v in case["sites"].items() if v} == {k: v for k, v in want.items() if v}, case
        assert case["near_misses"] == [] and not case["nan"], case
        assert case["dsfuse_err"] <= 1e-4, case


@pytest.mark.slow
def test_model_fuzz_cpu_dynamic_true_keeps_every_family():
    """`torch.compile(dynamic=True)` on V4: one graph serves two lengths and keeps every family of the layer with no
    near-miss (Dynamo passes the modules' floats, eps and softmax scales, in as tensors unless dsfuse has them
    specialised; the H200 grid once lost the sparse attention, compressors and hyper-connections to that)."""
    import dsfuse
    from dsfuse.models.presets import build_hf_model

    fuzz = _module()
    model = build_hf_model("v4-tiny", num_hidden_layers=1)
    reuse = (None, torch.compile(model, backend="dsfuse", dynamic=True), "dynamic")
    # two lengths with the same size specialisations (S % 8 == 1 leaves a one-row remainder: a graph of its own)
    first, second = (fuzz.run_case(model, "v4-tiny", 2, seq, "cpu", with_inductor=False, reuse=reuse) for seq in (10, 14))
    for case in (first, second):
        assert "error" not in case and case["near_misses"] == [] and case["dsfuse_err"] <= 1e-4, case
    want = {k: v for k, v in V4_ONE_LAYER_SITES.items() if k != "norm_rope_quant"}
    assert {k: v for k, v in first["sites"].items() if k in want} == want, first
    assert first["sites"]["norm_rope_quant"] >= V4_ONE_LAYER_SITES["norm_rope_quant"], first
    assert first["graphs"] == 1 and second["graphs"] == 0, (first, second)
    assert len(dsfuse.report().graphs) == 1


def _cell(preset, batch, reuse, seq, **fields):
    return {"preset": preset, "attn": "sdpa", "batch": batch, "seq": seq, "reuse": reuse, "graphs": 1,
            "sites": {"norm_rope_quant": 10}, "near_misses": [], "notes": [], "dsfuse_err": 0.01,
            "inductor_err": 0.01, "nan": False, "vs_fp32": None, "seconds": 1.0, **fields}


def test_merge_orders_cells_sets_apart_replaced_cases_and_lists_the_cells_not_run(tmp_path):
    """Two sources, each with its environment: the cells in length order whatever the source order, an error whose
    cell ran again without one and a cell the later source ran again listed apart (not in the table), and the
    boundary lengths of the grid no source ran."""
    env = {"date": "2026-12-05T09:00:00+00:00", "torch": "2.11.0", "triton": "3.6.0", "device": "GPU"}
    first = {"env": [{**env, "commit": "aaaaaaa"}],
             "cases": [_cell("tiny", 1, "auto", 129), _cell("tiny", 1, "auto", 4097, error="OutOfMemoryError: x")]}
    second = {"env": [{**env, "commit": "bbbbbbb"}],
              "cases": [_cell("tiny", 1, "auto", 4097), _cell("tiny", 1, "auto", 7),
                        _cell("tiny", 1, "auto", 129, sites={"norm_rope_quant": 9})]}
    paths = []
    for name, data in (("first.json", first), ("second.json", second)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(data))
    cases = _module().merge([str(p) for p in paths], tmp_path / "merged")
    assert [(c["seq"], c["commit"], "error" in c) for c in cases] == [(7, "bbbbbbb", False), (129, "bbbbbbb", False),
                                                                    (4097, "bbbbbbb", False)]
    text = (tmp_path / "merged" / "model_fuzz.md").read_text()
    assert "commit aaaaaaa, GPU" in text and "commit bbbbbbb, GPU" in text
    assert "| tiny | auto | 1 | 4097 | aaaaaaa | OutOfMemoryError: x |" in text
    assert "| tiny | auto | 1 | 129 | aaaaaaa | norm_rope_quant 10; near-misses: none |" in text
    assert "| tiny | auto | 1 | 1 2 3 8 9 13 127 128 1000 2049 |" in text  # the tiny preset's other boundary lengths
    assert "| tiny | dynamic | 3 | 1 2 3 7 8 9 13 127 128 129 1000 2049 4097 |" in text
    saved = json.loads((tmp_path / "merged" / "model_fuzz.json").read_text())
    assert [c["seq"] for c in saved["replaced"]] == [129, 4097] and len(saved["env"]) == 2
