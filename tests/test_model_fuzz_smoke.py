"""benchmarks/model_fuzz_gpu.py's CPU smoke mode: one left-padded tiny-preset case, its JSON and markdown."""

import importlib.util
import json
from pathlib import Path


def test_model_fuzz_cpu_smoke(tmp_path):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "model_fuzz_gpu.py"
    spec = importlib.util.spec_from_file_location("model_fuzz_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    (case,) = json.loads((tmp_path / "model_fuzz.json").read_text())
    assert (case["preset"], case["batch"], case["seq"]) == ("tiny", 2, 5) and "error" not in case, case
    # one layer: the norm/rope glue, the indexer and the sparse attention each rewritten, nothing left as a near-miss
    assert case["sites"]["indexer_topk"] == 1 and case["sites"]["sparse_attention"] == 1, case
    assert case["near_misses"] == [], case
    assert case["dsfuse_err"] <= max(1e-5, 2 * case["inductor_err"]), case
    assert "| tiny | 2 | 5 |" in (tmp_path / "model_fuzz.md").read_text()
