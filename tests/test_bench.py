"""`python -m dsfuse.bench` on the tiny preset: CPU smoke runs of prefill, decode, ablate and families, and its reports."""

import io
import json
import re
import sys

import pytest

import dsfuse
from dsfuse import PASS_NAMES
from dsfuse.bench import main

# The V4 bench and quickstart tests compile one graph (S=12): on one pytest-xdist worker, Inductor's FX graph cache
# serves it to the second.
V4_TINY_S12 = pytest.mark.xdist_group("bench_v4_tiny_s12")
# The tiny model bench, the ablation and examples/ablation.ipynb compile the same tiny-preset graphs (S=16): on one
# worker, the FX graph cache serves each after its first compile.
TINY_S16 = pytest.mark.xdist_group("bench_tiny_s16")


@TINY_S16
def test_model_bench_tiny_cpu(tmp_path, capsys):
    """Prefill: eager, Inductor and dsfuse with every pass off (`only:PASS` / `no:PASS` run in the ablate test)."""
    out = tmp_path / "bench.json"
    markdown = tmp_path / "bench.md"
    assert main(["model", "--preset", "tiny", "--seq", "16", "--device", "cpu", "--configs", "eager,inductor,dsfuse-off",
                 "--json", str(out), "--markdown", str(markdown)]) == 0
    results = json.loads(out.read_text())
    assert results["env"]["device"] == "cpu" and results["preset"] == "tiny" and results["mode"] == "prefill"
    assert "decode" not in results and results["wall_s"] > 0
    rows = {r["config"]: r for r in results["runs"]}
    assert set(rows) == {"eager", "inductor", "dsfuse-off"}
    assert all(count == 0 for count in rows["dsfuse-off"]["rewritten"].values())
    assert all(r["ms"] > 0 and "error" not in r for r in rows.values())
    assert rows["dsfuse-off"]["bitwise_equal_to_inductor"] is True
    assert "dsfuse_pass_s" in rows["dsfuse-off"] and "dsfuse_pass_s" not in rows["inductor"]
    assert rows["dsfuse-off"]["near_misses"] == [] and "near_misses" not in rows["inductor"]
    assert rows["inductor"]["rel_l2_vs_eager"] < 1e-5
    assert "vs Inductor" in capsys.readouterr().out
    lines = markdown.read_text().splitlines()
    assert lines[0] == "# dsfuse model benchmark: preset tiny, float32, batch 1"
    assert lines[2].startswith("date ") and "device cpu" in lines[2] and "torch " in lines[2]
    header = next(i for i, line in enumerate(lines) if line.startswith("| S | config | ms |"))
    table = [line.split(" | ") for line in lines[header + 2:] if line.startswith("| ")]
    assert [(cells[0], cells[1]) for cells in table] == [("| 16", "eager"), ("| 16", "inductor"), ("| 16", "dsfuse-off")]
    assert table[1][4] == "1.00x" and table[1][6] == "-" and float(table[2][6]) >= 0
    assert "bitwise==inductor: True" in table[2][-1]
    assert "Time by stage" not in markdown.read_text() and "Decode" not in markdown.read_text()


@V4_TINY_S12
def test_model_bench_v4_tiny_cpu(tmp_path):
    """DeepSeek V4 prefill (eager attention, `use_cache=False`): all three attention layers fused, parity with eager;
    decode is refused for V4 with the reason. The same S=12 graph as the V4 quickstart test (FX cache shared)."""
    out = tmp_path / "bench.json"
    assert main(["model", "--preset", "v4-tiny", "--seq", "12", "--device", "cpu", "--configs", "eager,dsfuse",
                 "--rep-ms", "1", "--json", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["runs"]}
    assert all(r["ms"] > 0 and "error" not in r for r in rows.values()), rows
    assert rows["dsfuse"]["rewritten"]["sparse_attention"] == 3
    assert rows["dsfuse"]["rel_l2_vs_eager"] < 1e-5
    with pytest.raises(SystemExit):
        main(["model", "--preset", "v4-tiny", "--device", "cpu", "--mode", "decode"])


@V4_TINY_S12
def test_quickstart_v4_tiny_cpu(capsys):
    from dsfuse.quickstart import main as quickstart

    assert quickstart(["--preset", "v4-tiny", "--seq", "12", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "preset v4-tiny" in text and "-> PASS" in text
    assert re.search(r"sparse_attention +3 +0 +enabled", text)  # the sliding, the CSA and the HCA layer
    sites = [site.detail for site in dsfuse.report().sites if site.pass_name == "sparse_attention"]
    assert all(any(f"V4 {kind} attention" in detail for detail in sites) for kind in ("sliding", "CSA", "HCA"))


def test_prefill_last_logits_under_the_cuda_graph_config(tmp_path):
    """`--logits last` (generate's prefill) through the step wrapper the CUDA-graph configurations use."""
    out, markdown = tmp_path / "bench.json", tmp_path / "bench.md"
    assert main(["model", "--preset", "tiny", "--seq", "12", "--device", "cpu", "--configs", "eager,dsfuse-cudagraphs",
                 "--logits", "last", "--json", str(out), "--markdown", str(markdown)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["runs"]}
    assert all(r["logits"] == "last" and r["ms"] > 0 and "error" not in r for r in rows.values())
    assert rows["dsfuse-cudagraphs"]["rewritten"]["indexer_topk"] == 2
    assert rows["dsfuse-cudagraphs"]["rel_l2_vs_eager"] < 1e-5
    assert "last position's logits only (logits_to_keep=1)" in markdown.read_text()


def test_unknown_config_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["model", "--preset", "tiny", "--device", "cpu", "--configs", "only:indexer"])
    assert "unknown config 'only:indexer'" in capsys.readouterr().err


def test_cuda_graph_configs_compile_with_reduce_overhead():
    from dsfuse.bench import resolve_configs

    resolved = resolve_configs(["inductor-cudagraphs", "dsfuse-cudagraphs"])
    assert resolved == {"inductor-cudagraphs": ("inductor", {"triton.cudagraphs": True}),
                        "dsfuse-cudagraphs": ("dsfuse", {"mode": "reduce-overhead"})}


def test_families_tiny_cpu_rewrites_each_family(tmp_path):
    out = tmp_path / "families.json"
    markdown = tmp_path / "families.md"
    assert main(["families", "--device", "cpu", "--configs", "eager,dsfuse", "--rep-ms", "5", "--json", str(out),
                 "--markdown", str(markdown)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["config"] == "dsfuse"]
    assert len(rows) == 3
    table = [line for line in markdown.read_text().splitlines() if line.startswith("| ")]
    assert table[0].startswith("| family | shape | config | ms | TFLOP/s | % peak | vs Inductor | check |")
    assert [line.split(" | ")[2] for line in table[1:]] == ["eager", "dsfuse"] * 3
    assert all("rewritten 1" in line for line in table[1:] if " | dsfuse | " in line)
    for row in rows:
        assert row["rewritten"] == 1, row
        assert row.get("agreement", 1.0) == 1.0 and row.get("rel_l2", 0.0) < 1e-5, row


def _hand_made_results() -> dict:
    """Two sequence lengths, Inductor and dsfuse, profiled at the larger one; dsfuse is 2x faster at S=256."""
    runs = []
    for seq, inductor_ms, dsfuse_ms in ((128, 2.0, 1.6), (256, 6.0, 3.0)):
        runs.append({"seq": seq, "config": "inductor", "ms": inductor_ms, "tok_per_s": seq / inductor_ms * 1e3})
        runs.append({"seq": seq, "config": "dsfuse", "ms": dsfuse_ms, "tok_per_s": seq / dsfuse_ms * 1e3,
                     "rewritten": {"indexer_topk": 2}})
    runs.append({"seq": 256, "config": "eager", "ms": None, "error": "out of memory"})
    runs[1]["near_misses"] = ["moe_experts: the experts' weights are not parameters"]
    runs[2]["profile"] = {"gpu_ms": 5.5, "dsfuse_ops_ms": {}, "dsfuse_ops_share": {},
                          "top_kernels_ms": [["triton_red_fused_topk_0", 3.0], ["sm90_gemm_bf16", 2.0]]}
    runs[3]["profile"] = {"gpu_ms": 2.8, "dsfuse_ops_ms": {"dsfuse::indexer_topk": 1.2},
                          "dsfuse_ops_share": {"dsfuse::indexer_topk": 1.2 / 2.8},
                          "top_kernels_ms": [["sm90_gemm_bf16", 1.4], ["indexer_topk_kernel", 1.2]]}
    return {"env": {"date": "2026-01-01T00:00:00+00:00", "commit": "abc1234", "device": "NVIDIA H200",
                    "torch": "2.11.0", "triton": "3.6.0"}, "preset": "v32-real-2l", "dtype": "bfloat16",
            "batch": 1, "runs": runs}


def test_markdown_time_by_stage_from_profiles():
    from dsfuse.bench.report import model_markdown

    text = model_markdown(_hand_made_results())
    assert "date 2026-01-01T00:00:00+00:00 · commit abc1234 · device NVIDIA H200 · torch 2.11.0 · triton 3.6.0" in text
    assert "| 256 | dsfuse | 3.000 | 85,333 | 2.00x |" in text
    assert "| 256 | eager | - | - | - |" in text and "out of memory" in text
    assert "rewritten indexer_topk=2; near-misses: moe_experts: the experts' weights are not parameters |" in text
    stages = text.split("## Time by stage")[1]
    assert "| 256 | dsfuse | 2.800 | dsfuse::indexer_topk 42.9% | 1.400 ms sm90_gemm_bf16<br>1.200 ms indexer_topk_kernel |" in stages
    assert "| 256 | inductor | 5.500 | none |" in stages
    assert "| 128 |" not in stages


def test_stage_breakdown_at_largest_seq():
    from dsfuse.bench.report import speedups_vs_inductor, stage_breakdown

    assert speedups_vs_inductor(_hand_made_results()) == {"inductor": {128: 1.0, 256: 1.0},
                                                          "dsfuse": {128: 1.25, 256: 2.0}}
    seq, stages = stage_breakdown(_hand_made_results())
    assert seq == 256
    assert stages["dsfuse"] == pytest.approx({"triton_red_fused_topk_0": 0.0, "sm90_gemm_bf16": 1.4,
                                              "indexer_topk_kernel": 1.2, "other": 0.2})
    assert stages["inductor"]["other"] == pytest.approx(0.5)


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_hand_made_results()))
    figure = tmp_path / "fig.png"
    assert main(["plot", str(results), "--out", str(figure)]) == 0
    data = figure.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert f"wrote {figure}" in capsys.readouterr().out


def test_time_by_stage_legend_keeps_kernels_named_with_a_leading_underscore():
    """matplotlib leaves labels that start with "_" out of a legend; dsfuse's Triton kernels are named so."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from dsfuse.bench.report import _draw_stages

    results = _hand_made_results()
    results["runs"][3]["profile"]["top_kernels_ms"][1][0] = "_indexer_topk_kernel"
    fig, ax = plt.subplots()
    _draw_stages(ax, results)
    assert "indexer_topk_kernel" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)


@pytest.mark.parametrize("content", [{"env": {}, "preset": "tiny", "runs": []}, {"env": {}, "size": "tiny", "rows": []}])
def test_plot_without_runs_is_refused(tmp_path, capsys, content):
    results = tmp_path / "empty.json"
    results.write_text(json.dumps(content))
    with pytest.raises(SystemExit):
        main(["plot", str(results), "--out", str(tmp_path / "fig.png")])
    err = capsys.readouterr().err
    assert "empty.json" in err and ("nothing to plot" in err or "not a `model` results file" in err)
    assert not (tmp_path / "fig.png").exists()


def test_plot_names_missing_matplotlib(tmp_path, monkeypatch):
    from dsfuse.bench.report import plot_model

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match="needs matplotlib"):
        plot_model(_hand_made_results(), str(tmp_path / "fig.png"))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(monkeypatch):
    from dsfuse.bench.report import progress

    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    with progress(4, "quiet") as bar:
        bar.update()
    assert quiet.getvalue() == ""
    pytest.importorskip("tqdm")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress(4, "shown") as bar:
        bar.update(2)
        bar.refresh()  # tqdm throttles redraws; force one so the count is on the "terminal"
    assert "shown" in terminal.getvalue() and "2/4" in terminal.getvalue()
    monkeypatch.setitem(sys.modules, "tqdm", None)
    silent = _Terminal()
    monkeypatch.setattr(sys, "stderr", silent)
    with progress(4, "no tqdm") as bar:
        bar.update()
    assert silent.getvalue() == ""


def test_filled_cache_puts_the_context_back():
    """A decode step from a restored cache is the last position of a full forward over the T+1 tokens."""
    import torch

    from dsfuse.bench.model import FilledCache, _prefill
    from dsfuse.models.presets import build_hf_model

    model = build_hf_model("tiny")
    filled = _prefill(model, model, 2, 12, "eager", "cpu")
    layer = filled.cache.layers[0]
    assert filled.length == 12 and set(filled.tensors[0]) == {"keys", "values", "indexer_keys"}
    assert layer.indexer_keys.shape[1] == 12
    tokens = torch.tensor([[3], [7]])
    positions = torch.full((2, 1), 12)
    with torch.no_grad():
        first = model(tokens, cache=filled.cache, position_ids=positions, use_cache=True).logits
        assert filled.cache.get_seq_length() == 13 and layer.indexer_keys.shape[1] == 13
        filled.restore()
        assert filled.cache.get_seq_length() == 12 and layer.indexer_keys.shape[1] == 12
        again = model(tokens, cache=filled.cache, position_ids=positions, use_cache=True).logits
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator("cpu").manual_seed(12 + 2))
        full = model(torch.cat([ids, tokens], dim=1)).logits[:, -1:]
    assert torch.equal(first, again)
    torch.testing.assert_close(first, full, rtol=1e-4, atol=1e-4)
    assert isinstance(filled, FilledCache)


def test_static_filled_cache_decodes_like_the_dynamic_one():
    """The StaticCache copy (what the CUDA-graph configurations decode from) gives the dynamic cache's logits, and
    putting it back to T makes a repeated step identical even after steps that wrote past T."""
    import torch

    from dsfuse.bench.model import StaticFilledCache, _prefill
    from dsfuse.models.presets import build_hf_model

    model = build_hf_model("tiny")
    filled = _prefill(model, model, 2, 12, "eager", "cpu")
    static = StaticFilledCache(filled, model, max_len=15)
    assert static.length == 12 and static.prefill_by == "eager" and static.source is filled
    layer = static.cache.layers[0]
    assert layer.keys.shape[2] == 15 and layer.indexer_keys.shape[1] == 15
    assert torch.equal(layer.indexer_keys[:, :12], filled.tensors[0]["indexer_keys"])
    tokens, positions = torch.tensor([[3], [7]]), torch.full((2, 1), 12)
    with torch.no_grad():
        dynamic = model(tokens, cache=filled.cache, position_ids=positions, use_cache=True).logits
        first = model(tokens, cache=static.cache, position_ids=positions, use_cache=True).logits
        model(tokens, cache=static.cache, position_ids=positions + 1, use_cache=True)
        assert int(layer.cumulative_length) == 14 and int(layer.indexer_cumulative_length) == 14
        static.restore()
        assert int(layer.cumulative_length) == 12 and int(layer.indexer_cumulative_length) == 12
        again = model(tokens, cache=static.cache, position_ids=positions, use_cache=True).logits
    torch.testing.assert_close(first, dynamic, rtol=1e-5, atol=1e-5)
    assert torch.equal(first, again)


def test_decode_tiny_cpu_counts_recompiles_and_falls_back_on_oom(tmp_path, monkeypatch, capsys):
    """dsfuse's own prefill "runs out of memory", so it decodes from the fallback cache (eager here, so the
    test compiles one graph: the dynamic-length decode graph, which must serve the appended steps too)."""
    import torch

    from dsfuse.bench import model as bench_model

    real_prefill = bench_model._prefill

    def prefill_without_memory_for_dsfuse(fn, model, batch, context, prefill_by, device):
        if prefill_by == "dsfuse":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_prefill(fn, model, batch, context, prefill_by, device)

    monkeypatch.setattr(bench_model, "FALLBACK_PREFILL", "eager")
    monkeypatch.setattr(bench_model, "_prefill", prefill_without_memory_for_dsfuse)
    out, markdown = tmp_path / "decode.json", tmp_path / "decode.md"
    assert main(["model", "--preset", "tiny", "--mode", "decode", "--decode-batch", "2", "--context", "16",
                 "--configs", "eager,dsfuse,dsfuse-cudagraphs", "--device", "cpu", "--growing-steps", "2", "--json", str(out),
                 "--markdown", str(markdown)]) == 0
    results = json.loads(out.read_text())
    assert results["runs"] == [] and results["growing_steps"] == 2 and results["prefill_cache"] == "same"
    rows = {r["config"]: r for r in results["decode"]}
    assert set(rows) == {"eager", "dsfuse", "dsfuse-cudagraphs"}
    eager, fused, static = rows["eager"], rows["dsfuse"], rows["dsfuse-cudagraphs"]
    assert eager["cache"] == fused["cache"] == "dynamic" and static["cache"] == "static"
    assert static["prefill_by"] == "eager" and "prefill_error" not in static and static["recompiles_growing"] == 0
    assert static["rewritten"]["indexer_topk"] == 2 and static["rewritten"]["sparse_attention"] == 2
    assert static["rel_l2_vs_eager"] < 1e-5
    assert eager["prefill_by"] == "eager" and "prefill_error" not in eager and eager["rel_l2_vs_eager"] == 0.0
    assert "graphs_first_call" not in eager and "recompiles_growing" not in eager
    assert fused["prefill_by"] == "eager" and fused["prefill_error"] == "dsfuse prefill out of memory"
    assert fused["graphs_first_call"] == 1 and fused["recompiles_growing"] == 0 and fused["recompiles_timed"] == 0
    assert fused["rewritten"]["indexer_topk"] == 2 and fused["rewritten"]["sparse_attention"] == 2
    assert fused["rel_l2_vs_eager"] < 1e-5
    for row in rows.values():
        assert row["batch"] == 2 and row["context"] == 16 and row["ms"] > 0
        assert row["tok_per_s"] == pytest.approx(2e3 / row["ms"])
    assert "recompiles" in capsys.readouterr().out
    text = markdown.read_text()
    assert text.startswith("# dsfuse model benchmark: preset tiny, float32, decode, batch 2\n")
    assert "## Decode with a KV cache" in text and "| S | config |" not in text
    assert "| 2 | 16 | dsfuse | dynamic | eager |" in text and "| 2 | 16 | dsfuse-cudagraphs | static | eager |" in text and "dsfuse prefill out of memory" in text


def test_decode_out_of_memory_is_a_row_not_a_crash(tmp_path, monkeypatch):
    import torch

    from dsfuse.bench import model as bench_model

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(bench_model, "_time_decode", no_memory)
    out = tmp_path / "decode.json"
    assert main(["model", "--preset", "tiny", "--mode", "decode", "--decode-batch", "1", "--context", "8",
                 "--configs", "eager", "--device", "cpu", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["decode"]
    assert row["ms"] is None and row["error"] == "out of memory" and row["prefill_by"] == "eager"


@TINY_S16
def test_ablate_tiny_cpu(tmp_path, capsys):
    out, markdown = tmp_path / "ablate.json", tmp_path / "ablate.md"
    assert main(["ablate", "--preset", "tiny", "--seq", "16", "--passes", "indexer_topk", "--device", "cpu",
                 "--json", str(out), "--markdown", str(markdown)]) == 0
    results = json.loads(out.read_text())
    assert results["kind"] == "ablate" and results["passes"] == ["indexer_topk"]
    rows = {r["config"]: r for r in results["runs"]}
    assert list(rows) == ["eager", "inductor", "dsfuse", "no:indexer_topk", "only:indexer_topk"]
    assert all(r["ms"] > 0 and "error" not in r for r in rows.values())
    assert all(r["rel_l2_vs_eager"] < 1e-5 for r in rows.values())
    assert rows["no:indexer_topk"]["rewritten"]["indexer_topk"] == 0
    assert rows["no:indexer_topk"]["rewritten"]["sparse_attention"] == 2
    assert rows["only:indexer_topk"]["rewritten"] == {name: 2 if name == "indexer_topk" else 0 for name in PASS_NAMES}
    [summary] = results["ablation"]
    assert summary["pass"] == "indexer_topk" and summary["sites"] == 2 and summary["seq"] == 16
    assert summary["alone_vs_inductor"] == pytest.approx(rows["inductor"]["ms"] / rows["only:indexer_topk"]["ms"])
    assert summary["all_vs_without"] == pytest.approx(rows["no:indexer_topk"]["ms"] / rows["dsfuse"]["ms"])
    assert "all on / without" in capsys.readouterr().out
    text = markdown.read_text()
    assert text.startswith("# dsfuse ablation: preset tiny, float32, batch 1\n")
    assert "## Per-pass contribution" in text and "| 16 | indexer_topk | 2 |" in text
    configurations = text.split("## All configurations")[1]
    assert "| 16 | only:indexer_topk |" in configurations and "indexer_topk=2" in configurations


def _hand_made_decode_results() -> dict:
    """Decode rows at B1 and B8: Inductor recompiles at every appended step, eager runs out of memory at B8."""
    decode = [
        {"batch": 1, "context": 8192, "config": "eager", "prefill_by": "eager", "ms": 50.0, "tok_per_s": 20.0,
         "recompiles_growing": 0, "rel_l2_vs_eager": 0.0},
        {"batch": 1, "context": 8192, "config": "inductor", "prefill_by": "inductor", "ms": 4.0, "tok_per_s": 250.0,
         "recompiles_growing": 2, "recompiles_timed": 0, "rel_l2_vs_eager": 0.01},
        {"batch": 1, "context": 8192, "config": "dsfuse", "prefill_by": "dsfuse", "ms": 2.0, "tok_per_s": 500.0,
         "recompiles_growing": 0, "rewritten": {"indexer_topk": 2, "moe_experts": 0}},
        {"batch": 8, "context": 8192, "config": "eager", "prefill_by": "dsfuse", "ms": None, "error": "out of memory",
         "prefill_error": "eager prefill out of memory"},
        {"batch": 8, "context": 8192, "config": "dsfuse", "prefill_by": "dsfuse", "ms": 2.5, "tok_per_s": 3200.0,
         "recompiles_growing": 0,
         "profile": {"gpu_ms": 2.2, "dsfuse_ops_ms": {"dsfuse::indexer_topk": 0.2},
                     "dsfuse_ops_share": {"dsfuse::indexer_topk": 0.2 / 2.2},
                     "top_kernels_ms": [["sm90_gemm_bf16", 1.5], ["indexer_topk_kernel", 0.2]]}},
    ]
    return {"env": {"device": "NVIDIA H200"}, "preset": "v32-real-2l", "dtype": "bfloat16", "batch": 1,
            "mode": "decode", "runs": [], "decode": decode, "decode_batches": [1, 8], "contexts": [8192],
            "prefill_cache": "same", "growing_steps": 2}


def test_decode_markdown_shows_recompiles_and_oom():
    from dsfuse.bench.report import decode_speedups_vs_inductor, model_markdown

    results = _hand_made_decode_results()
    assert decode_speedups_vs_inductor(results) == {"eager": {(1, 8192): 0.08}, "inductor": {(1, 8192): 1.0},
                                                    "dsfuse": {(1, 8192): 2.0}}
    text = model_markdown(results)
    assert text.startswith("# dsfuse model benchmark: preset v32-real-2l, bfloat16, decode, batch 1, 8\n")
    assert "| 1 | 8192 | dsfuse | dynamic | dsfuse | 2.000 | 500.0 | 2.00x |" in text
    assert "recompiled 2x in 2 appended steps" in text.split("| 1 | 8192 | inductor |")[1].splitlines()[0]
    assert "eager prefill out of memory; out of memory" in text
    assert "## Decode time by stage" in text and "| 8 | 8192 | dsfuse | 2.200 | dsfuse::indexer_topk 9.1% |" in text


def test_plot_decode_and_ablation(tmp_path):
    pytest.importorskip("matplotlib")
    from dsfuse.bench.report import plot_model

    plot_model(_hand_made_decode_results(), str(tmp_path / "decode.png"))
    ablation = _hand_made_results()
    ablation["kind"] = "ablate"
    ablation["runs"] += [{"seq": 256, "config": "only:indexer_topk", "ms": 4.0}, {"seq": 256, "config": "no:indexer_topk", "ms": None}]
    plot_model(ablation, str(tmp_path / "ablation.png"))
    for name in ("decode.png", "ablation.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_name_this_checkouts_commit_from_any_working_directory(tmp_path, monkeypatch):
    """Run from a notebook's or a results folder's directory, the commit is still the one the code comes from."""
    import subprocess
    from pathlib import Path

    from dsfuse.bench.measure import git_commit

    root = Path(__file__).resolve().parents[1]
    want = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    monkeypatch.delenv("DSFUSE_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert git_commit() == (want.stdout.strip() or "unknown")
