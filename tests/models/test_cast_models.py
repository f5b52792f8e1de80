"""Models cast as a whole (`model.to(torch.bfloat16)`, `.half()`), which also casts what transformers keeps in fp32
(V4's attention sinks, compressor position biases and norms, hyper-connection weights, routers; V3.2 / GLM's
router): every family is rewritten with the uncast model's site counts and no near-miss, and dsfuse's logits are as
close to the fp32 model's as eager's on the cast model are.

The bound is eager's own distance from the fp32 model (plus 10 % for summation order): dsfuse's ops round where the
cast graph rounds, or fewer times (V4's attention shifts the logits by their max in fp32 where the cast graph rounds
`logit - max` to the model dtype), so a cast model compiled with dsfuse must not be further from the fp32 model than
the cast model itself. One compile per case, shared by its tests."""

import copy

import pytest
import torch

import dsfuse
from dsfuse.models.presets import build_hf_model

# The uncast models' sites (transformers' dtypes, or fp32), as tests/passes and tests/test_models_parity.py count them.
V4_TINY_SITES = dict(norm_rope_quant=10, indexer_topk=1, sparse_attention=3, moe_experts=3, hyper_connections=13,
                     compressors=3)
V32_TINY_SITES = dict(norm_rope_quant=10, indexer_topk=2, sparse_attention=2, moe_experts=1, hyper_connections=0,
                      compressors=0)
# (preset, cast dtype, batch x length, sites): v4-tiny's S=29 gives CSA 7 entries (> index_topk 4) and HCA 3; tiny's
# S=19 is past index_topk 8. V3.2 and GLM each in one cast dtype (their graphs differ from the uncast ones only in
# the router's dtype).
CASES = [
    ("v4-tiny", torch.bfloat16, (2, 29), V4_TINY_SITES),
    ("v4-tiny", torch.float16, (2, 29), V4_TINY_SITES),
    ("tiny", torch.bfloat16, (2, 19), V32_TINY_SITES),
    ("glm-tiny", torch.float16, (2, 19), V32_TINY_SITES),
]
SLACK = 1.1
# One pytest-xdist worker runs the module, so each case is compiled once.
pytestmark = pytest.mark.xdist_group("cast_models")


def _relative(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{str(c[1]).removeprefix('torch.')}")
def compiled_case(request):
    """The fp32 model's logits, the cast model's eager logits, dsfuse's on the cast model and its report."""
    preset, cast, (batch, seq), sites = request.param
    overrides = dict(hc_sinkhorn_iters=2) if preset.startswith("v4") else {}
    fp32_model = build_hf_model(preset, dtype=torch.float32, **overrides)
    model = copy.deepcopy(fp32_model).to(cast)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seq))
    torch._dynamo.reset()
    dsfuse.reset_report()
    with torch.no_grad():
        reference = fp32_model(ids).logits.double()
        eager = model(ids).logits
        fused = torch.compile(model, backend="dsfuse")(ids).logits
    report = dsfuse.report()
    torch._dynamo.reset()
    return dict(cast=cast, sites=sites, reference=reference, eager=eager, fused=fused, counts=report.counts,
                near_misses=list(report.near_misses), text=str(report),
                dtypes={p.dtype for p in model.parameters() if p.is_floating_point()})


def test_every_family_keeps_its_sites(compiled_case):
    """The whole model is in the cast dtype (no fp32 parameter left), and each family has the uncast count."""
    case = compiled_case
    assert case["dtypes"] == {case["cast"]}
    assert case["counts"] == case["sites"], case["text"]
    assert case["near_misses"] == [], case["text"]


def test_as_close_to_the_fp32_model_as_eager(compiled_case):
    """dsfuse on the cast model is no further from the fp32 model than eager on it; its logits keep the cast dtype."""
    case = compiled_case
    assert case["fused"].dtype == case["eager"].dtype == case["cast"]
    eager_distance = _relative(case["eager"], case["reference"])
    fused_distance = _relative(case["fused"], case["reference"])
    assert 0 < eager_distance < 0.05, eager_distance
    assert fused_distance <= SLACK * eager_distance, (fused_distance, eager_distance)
    assert _relative(case["fused"], case["eager"].double()) <= 2 * SLACK * eager_distance


def test_bench_casts_the_whole_model(tmp_path):
    """`python -m dsfuse.bench model --cast bfloat16` benchmarks the model cast as a whole (eager alone here: the
    compiled configurations are the cases above); a checkpoint keeps its own dtypes."""
    import json

    from dsfuse.bench import main

    out = tmp_path / "bench.json"
    assert main(["model", "--preset", "v4-tiny", "--seq", "12", "--device", "cpu", "--configs", "eager",
                 "--cast", "bfloat16", "--rep-ms", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["cast"] == "bfloat16" and results["dtype"] == "float32"
    assert [r["config"] for r in results["runs"]] == ["eager"] and results["runs"][0]["ms"] > 0
    with pytest.raises(SystemExit):
        main(["model", "--checkpoint", str(tmp_path), "--cast", "bfloat16", "--device", "cpu"])
