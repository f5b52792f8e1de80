"""`python -m dsfuse.bench model` on the tiny preset: the CPU smoke run of the benchmark tool."""

import io
import json
import sys

import pytest

from dsfuse.bench import main


def test_model_bench_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    markdown = tmp_path / "bench.md"
    assert main(["model", "--preset", "tiny", "--seq", "16", "--device", "cpu", "--configs", "eager,inductor,dsfuse-off,only:indexer_topk",
                 "--json", str(out), "--markdown", str(markdown)]) == 0
    results = json.loads(out.read_text())
    assert results["env"]["device"] == "cpu" and results["preset"] == "tiny"
    rows = {r["config"]: r for r in results["runs"]}
    assert set(rows) == {"eager", "inductor", "dsfuse-off", "only:indexer_topk"}
    assert rows["only:indexer_topk"]["rewritten"]["indexer_topk"] == 2 and rows["dsfuse-off"]["rewritten"]["indexer_topk"] == 0
    assert all(r["ms"] > 0 and "error" not in r for r in rows.values())
    assert rows["dsfuse-off"]["bitwise_equal_to_inductor"] is True
    assert rows["inductor"]["rel_l2_vs_eager"] < 1e-5
    assert "vs Inductor" in capsys.readouterr().out
    lines = markdown.read_text().splitlines()
    assert lines[0] == "# dsfuse model benchmark: preset tiny, float32, batch 1"
    assert lines[2].startswith("date ") and "device cpu" in lines[2] and "torch " in lines[2]
    header = next(i for i, line in enumerate(lines) if line.startswith("| S | config | ms |"))
    table = [line.split(" | ") for line in lines[header + 2:] if line.startswith("| ")]
    assert [(cells[0], cells[1]) for cells in table] == [
        ("| 16", "eager"), ("| 16", "inductor"), ("| 16", "dsfuse-off"), ("| 16", "only:indexer_topk")]
    assert table[1][4] == "1.00x"
    assert "bitwise==inductor: True" in table[2][-1] and "indexer_topk=2" in table[3][-1]
    assert "Time by stage" not in markdown.read_text()


def test_unknown_config_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["model", "--preset", "tiny", "--device", "cpu", "--configs", "only:indexer"])
    assert "unknown config 'only:indexer'" in capsys.readouterr().err


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
    runs[2]["profile"] = {"gpu_ms": 5.5, "dsfuse_ops_ms": {}, "dsfuse_ops_share": {},
                          "top_kernels_ms": [["triton_red_fused_topk_0", 3.0], ["sm90_gemm_bf16", 2.0]]}
    runs[3]["profile"] = {"gpu_ms": 2.8, "dsfuse_ops_ms": {"dsfuse::indexer_topk": 1.2},
                          "dsfuse_ops_share": {"dsfuse::indexer_topk": 1.2 / 2.8},
                          "top_kernels_ms": [["sm90_gemm_bf16", 1.4], ["indexer_topk_kernel", 1.2]]}
    return {"env": {"date": "2026-01-01T00:00:00+00:00", "commit": "abc1234", "device": "NVIDIA H200",
                    "torch": "2.11.0", "triton": "3.6.0"}, "preset": "v32-real-2l", "dtype": "bfloat16",
            "batch": 1, "runs": runs}


def test_markdown_time_by_stage_from_profiles():
    from dsfuse.bench_report import model_markdown

    text = model_markdown(_hand_made_results())
    assert "date 2026-01-01T00:00:00+00:00 · commit abc1234 · device NVIDIA H200 · torch 2.11.0 · triton 3.6.0" in text
    assert "| 256 | dsfuse | 3.000 | 85,333 | 2.00x |" in text
    assert "| 256 | eager | - | - | - |" in text and "out of memory" in text
    stages = text.split("## Time by stage")[1]
    assert "| 256 | dsfuse | 2.800 | dsfuse::indexer_topk 42.9% | 1.400 ms sm90_gemm_bf16<br>1.200 ms indexer_topk_kernel |" in stages
    assert "| 256 | inductor | 5.500 | none |" in stages
    assert "| 128 |" not in stages


def test_stage_breakdown_at_largest_seq():
    from dsfuse.bench_report import speedups_vs_inductor, stage_breakdown

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
    from dsfuse.bench_report import plot_model

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match="needs matplotlib"):
        plot_model(_hand_made_results(), str(tmp_path / "fig.png"))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(monkeypatch):
    from dsfuse.bench_report import progress

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
