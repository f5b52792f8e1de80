"""dsfuse on a model sharded with torch.distributed (gloo on CPU): tensor and expert parallel plans
from transformers, parity with the unsharded model, and the same rewrites on every rank."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsfuse.models.checkpoint import write_random_checkpoint

WORKER = Path(__file__).with_name("distributed_worker.py")


def launch(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a torchrun command; launch it once more if a rank was killed by a signal.

    Once in about a dozen CI runs a gloo rank aborted (exit -6) before doing any work; the checks
    themselves are never retried (a rank that fails an assertion exits with an error, not a signal).
    """
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 and "exitcode: -" in done.stderr:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return done


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hf")
    write_random_checkpoint("tiny", path, kind="hf", seed=0)
    return path


def test_sharded_model_parity(checkpoint, tmp_path):
    """Two ranks, the tensor-parallel plan and the tensor- and expert-parallel one (four experts a rank): each
    sharded model compiled with dsfuse gives the unsharded model's logits on every rank, with every site rewritten."""
    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           "--checkpoint", str(checkpoint), "--result", str(result)]
    done = launch(cmd)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(result.read_text())
    assert data["world"] == 2 and set(data["plans"]) == {"tp", "tp-ep"}, data
    for plan in data["plans"].values():
        assert len(plan["errors"]) == 2 and all(error < 1e-5 for error in plan["errors"]), data
        assert plan["counts"]["indexer_topk"] == 2 and plan["counts"]["sparse_attention"] == 2, data
        assert plan["counts"]["norm_rope_quant"] == 10, data  # the kv split too, behind Inductor's identity lowering


@pytest.fixture(scope="module")
def quantized_checkpoints(tmp_path_factory):
    """(`fp8-tp-tiny`, whose shards are whole 128 x 128 blocks on 2 and 4 ranks; `fp8-tiny`, whose are not)."""
    from dsfuse.models.quantized import write_fp8_checkpoint

    return tuple(write_fp8_checkpoint(tmp_path_factory.mktemp(preset), preset) for preset in ("fp8-tp-tiny", "fp8-tiny"))


# Both world sizes on one pytest-xdist worker, 2 ranks first: rank 0's compile of the unsharded model (the same graph
# in both launches) is served to the 4-rank launch by Inductor's caches.
@pytest.mark.xdist_group("distributed_fp8_unsharded")
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_fp8_model_parity(quantized_checkpoints, tmp_path, world):
    """A released-layout FP8 checkpoint on 2 and 4 ranks, under the tensor-parallel plan and the tensor- and
    expert-parallel one: eager and compiled logits are the unsharded FP8 model's, every family fires as often as in
    the unsharded compile, dsfuse's FP8 ops serve the quantised layers, and a checkpoint whose shards cut its scale
    blocks is refused at load, naming the weights.

    Bound: the activations are fp32 and every shard is whole 128-channel blocks, so each rank quantises the same
    activation groups as the unsharded model and sharding changes only the order of fp32 sums (row-parallel partial
    sums all-reduced, experts summed across ranks): fp32 rounding, ~1e-7 measured. A sum that rounds differently can
    move an activation across an e4m3 rounding boundary (a step of 1/16 to 1/8); 40 routings on 2 ranks showed none."""
    aligned, misfit = quantized_checkpoints
    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(WORKER),
           "--checkpoint", str(aligned), "--result", str(result), "--quantized", "--seq", "12",
           "--misfit-checkpoint", str(misfit)]
    done = launch(cmd)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(result.read_text())
    assert data["world"] == world and set(data["plans"]) == {"tp", "tp-ep"}, data
    unsharded = data["unsharded_counts"]
    assert all(unsharded[family] > 0 for family in ("norm_rope_quant", "indexer_topk", "sparse_attention",
                                                      "moe_experts")), unsharded
    for name, plan in data["plans"].items():
        assert len(plan["errors"]) == world and max(plan["errors"] + plan["eager_errors"]) < 1e-5, (name, plan)
        assert plan["counts"] == unsharded and plan["near_misses"] == [], (name, plan)
        assert "(dsfuse's FP8 kernels)" in plan["summary"], plan["summary"]
        moe = [detail for op, detail in plan["sites"] if op == "dsfuse.moe_experts_fp8"]
        assert len(moe) == 1 and ("expert-parallel sentinel slots skipped" in moe[0]) == (name == "tp-ep"), moe
    assert "cuts these quantised weights inside their scale blocks" in data["refusal"], data["refusal"]
    assert "model.layers.0.self_attn.q_b_proj.weight (96, 128)" in data["refusal"], data["refusal"]


def test_distributed_prefill_benchmark_runs_on_cpu(checkpoint, tmp_path):
    out = tmp_path / "ep.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "distributed_prefill.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           "--checkpoint", str(checkpoint), "--seq", "16", "--ep", "--configs", "eager,dsfuse", "--repeats", "2",
           "--json", str(out)]
    done = launch(cmd)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"eager", "dsfuse"} and all(r["ms"] > 0 and r["world"] == 2 and r["ep"] for r in rows.values())
    assert rows["dsfuse"]["rewritten"]["indexer_topk"] == 2 and rows["dsfuse"]["rewritten"]["sparse_attention"] == 2
    assert "tok/s/device" in done.stdout


@pytest.mark.xdist_group("distributed_fp8_unsharded")
def test_distributed_prefill_benchmark_takes_a_released_fp8_checkpoint(quantized_checkpoints, tmp_path):
    """The benchmark loads a released-layout checkpoint through `load_quantized_model`, sharded under the tensor- and
    expert-parallel plan, and its dsfuse row says dsfuse's FP8 kernels served the quantised layers."""
    out = tmp_path / "fp8.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "distributed_prefill.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           "--checkpoint", str(quantized_checkpoints[0]), "--seq", "12", "--ep", "--configs", "dsfuse", "--repeats",
           "1", "--json", str(out)]
    done = launch(cmd)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["quantized"] and row["config"] == "dsfuse" and row["ms"] > 0, result
    assert row["rewritten"]["moe_experts"] == 1 and row["rewritten"]["sparse_attention"] == 2, row
    assert "(dsfuse's FP8 kernels)" in row["quantized_layers"], row
    assert "dsfuse's FP8 kernels" in done.stdout
