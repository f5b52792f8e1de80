"""`python -m dsfuse.bench model` on the tiny preset: the CPU smoke run of the benchmark tool."""

import json

from dsfuse.bench import main


def test_model_bench_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["model", "--preset", "tiny", "--seq", "16", "--device", "cpu", "--configs", "eager,inductor,dsfuse-off,only:indexer_topk",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["env"]["device"] == "cpu" and results["preset"] == "tiny"
    rows = {r["config"]: r for r in results["runs"]}
    assert set(rows) == {"eager", "inductor", "dsfuse-off", "only:indexer_topk"}
    assert rows["only:indexer_topk"]["rewritten"]["indexer_topk"] == 2 and rows["dsfuse-off"]["rewritten"]["indexer_topk"] == 0
    assert all(r["ms"] > 0 and "error" not in r for r in rows.values())
    assert rows["dsfuse-off"]["bitwise_equal_to_inductor"] is True
    assert rows["inductor"]["rel_l2_vs_eager"] < 1e-5
    assert "vs Inductor" in capsys.readouterr().out


def test_unknown_config_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["model", "--preset", "tiny", "--device", "cpu", "--configs", "only:indexer"])
    assert "unknown config 'only:indexer'" in capsys.readouterr().err


def test_families_tiny_cpu_rewrites_each_family(tmp_path):
    out = tmp_path / "families.json"
    assert main(["families", "--device", "cpu", "--configs", "eager,dsfuse", "--rep-ms", "5", "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["config"] == "dsfuse"]
    assert len(rows) == 3
    for row in rows:
        assert row["rewritten"] == 1, row
        assert row.get("agreement", 1.0) == 1.0 and row.get("rel_l2", 0.0) < 1e-5, row
