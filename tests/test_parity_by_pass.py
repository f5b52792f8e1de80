"""benchmarks/parity_by_pass.py on one layer of the tiny preset (fp32, CPU): a distance per configuration, zero for
eager against itself, and a pass turned off really off (its sites gone, the others' kept)."""

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_each_configuration_is_measured_with_its_pass_off(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("parity_by_pass", BENCHMARKS / "parity_by_pass.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out = tmp_path / "parity.json"
        module.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--layers", "1", "--cells", "1x5",
                     "--passes", "norm_rope_quant", "--out", str(out)])
    finally:
        sys.path.remove(str(BENCHMARKS))
    cell = json.loads(out.read_text())["cells"]["1x5"]
    distance, sites = cell["distance"], cell["sites"]
    assert list(distance) == ["eager again", "inductor", "dsfuse", "dsfuse without norm_rope_quant"]
    assert distance["eager again"] == 0.0
    assert all(0.0 <= value < 1e-4 for value in distance.values())
    assert sites["dsfuse"]["norm_rope_quant"] > 0
    without = sites["dsfuse without norm_rope_quant"]
    assert "norm_rope_quant" not in without
    assert without == {family: n for family, n in sites["dsfuse"].items() if family != "norm_rope_quant"}
