"""benchmarks/op_fuzz_gpu.py on CPU with the `ci` profile: one fuzz file in its own pytest process, its row of the
table (tests, examples run, outcome) and its log."""

import importlib.util
import json
from pathlib import Path


def test_op_fuzz_runs_a_file_and_tabulates_it(tmp_path):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "op_fuzz_gpu.py"
    spec = importlib.util.spec_from_file_location("op_fuzz_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--profile", "ci", "--files", "test_fuzz_compressor.py", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "op_fuzz.json").read_text())["files"]
    # the ci profile: 6 examples of the file's one test
    assert row["file"] == "tests/fuzz/test_fuzz_compressor.py" and row["status"] == "passed", row
    assert (row["tests"], row["examples"], row["passed"], row["failed"]) == (1, 6, 1, 0), row
    assert "| tests/fuzz/test_fuzz_compressor.py | 1 | 6 | 1 | 0 |" in (tmp_path / "op_fuzz.md").read_text()
    assert "test_kv_compress PASSED" in (tmp_path / "op_fuzz_logs" / "test_fuzz_compressor.txt").read_text()
