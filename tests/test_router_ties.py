"""benchmarks/router_ties.py on the tiny preset (fp32, CPU): the routers' margins per token, and a token's logits
moved only by noise that its router input (or attention output) can hold."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def router_ties():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("router_ties", BENCHMARKS / "router_ties.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def model():
    from dsfuse.models.presets import build_hf_model

    return build_hf_model("tiny", dtype=torch.float32, device="cpu", attn_implementation="sdpa")


def test_margins_are_the_gaps_of_the_routers_own_choice(router_ties, model):
    (cell,) = router_ties.measure(model, [(1, 5)], trials=1).values()
    (name, rows), = [(n, r) for n, r in cell.items() if "group_margin" in r]
    router = model.get_submodule(name)
    assert len(rows["group_margin"]) == len(rows["expert_margin"]) == 5
    assert min(rows["group_margin"]) >= 0 and min(rows["expert_margin"]) > 0
    hidden = torch.randn(3, router.hidden_dim, generator=torch.Generator().manual_seed(0))
    chosen = router(hidden)[2].sort(-1)[0]
    group_margin, expert_margin = router_ties.routing_margins(router, hidden)
    scores = torch.nn.functional.linear(hidden, router.weight).sigmoid() + router.e_score_correction_bias
    kept = scores.gather(1, chosen)
    # the expert margin: the smallest kept score less the best score dropped from the groups it kept from
    dropped = scores.scatter(1, chosen, float("-inf")).view(3, router.num_group, -1)
    groups_kept_from = ~dropped.isfinite().all(-1)
    best_dropped = dropped.masked_fill(~groups_kept_from[..., None], float("-inf")).flatten(1).max(-1)[0]
    assert torch.allclose(expert_margin, kept.min(-1)[0] - best_dropped)
    assert (group_margin >= 0).all()


@pytest.mark.parametrize("perturb", ["router", "attention"])
def test_noise_below_fp32_resolution_moves_nothing_and_large_noise_moves_logits(router_ties, model, perturb):
    quiet = router_ties.measure(model, [(1, 4)], perturb, noise_exp=40, trials=1)["1x4"]
    loud = router_ties.measure(model, [(1, 4)], perturb, noise_exp=1, trials=1)["1x4"]
    key = f"max_jump_{perturb}"
    assert all(v == 0.0 for rows in quiet.values() for v in rows.get(key, []))
    assert max(v for rows in loud.values() for v in rows.get(key, [])) > 1e-3


def test_cli_writes_the_cells(router_ties, tmp_path):
    out = tmp_path / "ties.json"
    assert router_ties.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--cells", "2x3",
                             "--trials", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["preset"] == "tiny" and set(data["cells"]) == {"2x3"}
