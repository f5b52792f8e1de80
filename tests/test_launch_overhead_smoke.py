"""benchmarks/launch_overhead.py on CPU: it records the ops of v4-tiny's compiled decode steps and times each one's
CUDA launcher (Triton's launches stubbed) and the dispatch probe."""

import importlib.util
import json
from pathlib import Path

DECODE_OPS = {"dsfuse::compressed_attention", "dsfuse::hc_collapse", "dsfuse::hc_expand_mix", "dsfuse::hc_head",
              "dsfuse::indexer_topk", "dsfuse::moe_experts_bf16", "dsfuse::norm_rope_group"}


def test_launch_overhead_cpu(tmp_path):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "launch_overhead.py"
    spec = importlib.util.spec_from_file_location("launch_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "launch.json"
    assert module.main(["--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and DECODE_OPS <= {row["op"] for row in result["rows"]}, result["rows"]
    assert all(row["launcher_us"] > 0 for row in result["rows"])
    assert result["dispatch"]["custom_op_us"] > 0 and result["dispatch"]["direct_kernel_us"] > 0
