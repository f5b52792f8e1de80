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
