"""`python -m dsfuse.bench generate` on the tiny preset: a CPU smoke run of whole `generate` calls and its report."""

import json

import pytest
import torch

from dsfuse.bench import main
from dsfuse.bench.generate import matching_prefix, prompt_batch


@pytest.mark.xdist_group("generate_tiny_p17")  # examples/generate.ipynb's CPU run compiles the same graphs
def test_generate_bench_tiny_cpu(tmp_path):
    out, markdown = tmp_path / "generate.json", tmp_path / "generate.md"
    assert main(["generate", "--preset", "tiny", "--device", "cpu", "--prompt", "17", "--new-tokens", "2",
                 "--chunk", "16", "--repeats", "1", "--configs", "eager,dsfuse", "--json", str(out),
                 "--markdown", str(markdown)]) == 0
    results = json.loads(out.read_text())
    assert results["kind"] == "generate" and results["prefill_chunk"] == 16 and results["new_tokens"] == 2
    rows = {r["config"]: r for r in results["runs"]}
    assert set(rows) == {"eager", "dsfuse"} and all("error" not in r for r in rows.values())
    assert all(r["ttft_ms"] > 0 and r["generate_ms"] > 0 and r["tok_per_s"] > 0 for r in rows.values())
    assert all(0 < r["step_ms_median"] <= r["step_ms_max"] < r["generate_ms"] for r in rows.values())
    assert rows["dsfuse"]["tokens_equal_eager"] is True and rows["dsfuse"]["matching_prefix"] == 2
    assert rows["dsfuse"]["recompiles_timed"] == 0
    # Three graphs (16-token chunk, one-token tail, decode), each with every family.
    assert rows["dsfuse"]["rewritten"] == {"norm_rope_quant": 30, "indexer_topk": 6, "sparse_attention": 6,
                                           "moe_experts": 3, "hyper_connections": 0,
                                           "compressors": 0}
    lines = markdown.read_text().splitlines()
    assert lines[0] == "# dsfuse generate benchmark: preset tiny, float32, 2 new tokens"
    table = [line for line in lines if line.startswith("| 1 | 17 |")]
    assert [row.split(" | ")[2] for row in table] == ["eager", "dsfuse"]
    assert " | equal | " in table[1]


def test_padded_prompts_and_matching_prefix():
    ids, mask = prompt_batch(256, 4, 16, True, "cpu")
    assert mask.sum(dim=1).tolist() == [16, 14, 12, 10] and (ids[mask == 0] == 0).all()
    reference = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3]])
    assert matching_prefix(torch.tensor([[5, 1, 2, 9], [5, 1, 7, 3]]), reference, 1) == 1
    assert matching_prefix(reference, reference, 1) == 3


def test_v4_inductor_config_is_dsfuses_recipe_with_inductor():
    """DeepSeek V4: Inductor prefills in the same chunks through the same cache and compiled call as dsfuse."""
    from dsfuse.bench.generate import Recipe
    from dsfuse.models.presets import build_hf_model
    from dsfuse.v4_cache import V4DecodeCache

    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2)
    inductor, fused = (Recipe(name, model, 1, 64, 16, True).kwargs() for name in ("inductor", "dsfuse"))
    assert isinstance(inductor["cache"], V4DecodeCache) and inductor["prefill_chunk_size"] == 16
    assert inductor["compile_config"].backend == "inductor" and inductor["compile_config"]._compile_all_devices
    assert fused["prefill_chunk_size"] == 16 and fused["compile_config"].backend == "dsfuse"


def test_a_decode_time_inside_the_calls_spread_is_reported_as_unresolved():
    """A long prefill beside a short decode: when the N-token call is not longer than the 1-token call by more than
    the repeats' spread, the difference is noise (run 58 printed -0.84 ms/token for a 32768-token prompt)."""
    from dsfuse.bench.generate import decode_step_ms, generate_markdown

    assert decode_step_ms([100.0, 101.0], [131.0, 131.5], 16) == (30.75 / 15, "")
    ms, why = decode_step_ms([1001.0, 1003.0], [989.0, 1020.0], 16)
    assert ms is None and "not resolved" in why and "more new tokens" in why
    ms, why = decode_step_ms([10.0], [10.0], 4)  # one repeat, no difference
    assert ms is None
    ms, why = decode_step_ms([1123.0], [696.0], 4)  # one repeat, the longer call timed shorter (a CPU run)
    assert ms is None and "427.00 ms shorter than the 1-token call" in why and "-427" not in why
    runs = [{"config": "inductor", "batch": 1, "prompt": 32768, "ttft_ms": 1002.0, "ms_per_token": None,
             "decode_unresolved": why, "tok_per_s": 16.2, "padded": False},
            {"config": "dsfuse", "batch": 1, "prompt": 32768, "ttft_ms": 194.6, "ms_per_token": 2.13,
             "tok_per_s": 70.7, "padded": False}]
    table = generate_markdown({"env": {}, "preset": "p", "dtype": "bfloat16", "new_tokens": 16, "padded": False,
                               "prefill_chunk": 4096, "weights_gib": 1.0, "runs": runs}).splitlines()[-2:]
    assert table[0].split(" | ")[4] == "-" and "not resolved" in table[0]
    assert table[1].split(" | ")[5:9] == ["-", "70.7", "0.19x", "-"]


def test_step_clock_marks_every_new_token_and_never_stops():
    """The stopping criterion behind ms/step: one mark per call (HF calls it after each new token), a gap per pair
    of marks, and an all-False answer of the batch's size so that generation runs its full length."""
    from dsfuse.bench.generate import StepClock

    clock = StepClock(3, "cpu", cuda=False)
    answers = [clock(torch.zeros(3, 5), None) for _ in range(4)]
    assert all(a.shape == (3,) and a.dtype == torch.bool and not a.any() for a in answers)
    gaps = clock.step_ms()
    assert len(gaps) == 3 and all(g >= 0 for g in gaps)
    clock.marks = [1.0, 1.002, 1.005]
    assert clock.step_ms() == pytest.approx([2.0, 3.0])


def test_decode_speedup_compares_step_medians_where_both_have_them():
    from dsfuse.bench.generate import generate_markdown

    runs = [{"config": "inductor", "batch": 1, "prompt": 8192, "ttft_ms": 60.0, "ms_per_token": 3.0,
             "step_ms_median": 4.0, "step_ms_max": 5.0, "tok_per_s": 250.0, "padded": False},
            {"config": "dsfuse", "batch": 1, "prompt": 8192, "ttft_ms": 30.0, "ms_per_token": 2.5,
             "step_ms_median": 1.6, "step_ms_max": 2.25, "tok_per_s": 500.0, "padded": False}]
    table = generate_markdown({"env": {}, "preset": "p", "dtype": "bfloat16", "new_tokens": 64, "padded": False,
                               "prefill_chunk": 4096, "weights_gib": 1.0, "runs": runs}).splitlines()[-1]
    assert table.split(" | ")[4:9] == ["2.500", "1.600 (2.250)", "500.0", "0.50x", "2.50x"]


def test_decode_step_profile_is_the_long_call_less_the_prefill_call_per_step(monkeypatch):
    """Kernels of the 1-token call (the prefill) come off the N-token call's, and what is left is shared over the
    N - 1 steps; a kernel only the prefill launches is not a decode kernel."""
    from dsfuse.bench import generate as gen

    profiles = {5: {"attn": (900.0, 9), "gemm": (500.0, 6), "prefill_only": (300.0, 1)},
                1: {"attn": (100.0, 1), "gemm": (100.0, 2), "prefill_only": (300.0, 1)}}
    monkeypatch.setattr(gen, "kernel_times", lambda fn: (profiles[fn()], {}))
    step = gen.decode_step_profile(lambda tokens: tokens, 5)
    assert step["top_kernels_ms"] == [("attn", 0.2), ("gemm", 0.1)]
    assert step["launches_by_kernel"] == {"attn": 2, "gemm": 1}
    assert step["kernel_launches"] == 3
    assert step["gpu_ms"] == pytest.approx(0.3)


def _decode_step_work():
    return sum(i * i for i in range(20000))


def test_host_step_profile_names_the_work_each_step_repeats():
    """The function a call runs once per new token leads the per-step host profile; work both calls share (the
    prefill) cancels."""
    from dsfuse.bench.generate import host_step_profile

    def generate(tokens):
        _decode_step_work()  # the prefill: once per call
        for _ in range(tokens - 1):
            _decode_step_work()

    top = dict(host_step_profile(generate, 9))
    work = {name: ms for name, ms in top.items() if name.endswith(("<genexpr>", "builtins.sum>"))}
    assert len(work) == 2 and min(work.values()) > 0, top
    assert max(ms for name, ms in top.items() if name not in work) < min(work.values()), top
    assert any(name.endswith("_decode_step_work") for name in top), top


def test_markdown_splits_a_profiled_step_into_gpu_work_and_host_wait():
    from dsfuse.bench.generate import generate_markdown

    run = {"config": "dsfuse", "batch": 1, "prompt": 8192, "ttft_ms": 30.0, "ms_per_token": 2.5,
           "step_ms_median": 2.25, "step_ms_max": 2.5, "tok_per_s": 400.0, "padded": False,
           "step_profile": {"gpu_ms": 1.5}, "step_gpu_idle_ms": 0.75}
    table = generate_markdown({"env": {}, "preset": "p", "dtype": "bfloat16", "new_tokens": 64, "padded": False,
                               "prefill_chunk": 4096, "weights_gib": 1.0, "runs": [run]}).splitlines()[-1]
    assert "step: 1.500 ms of GPU work, 0.750 ms waiting for the host" in table, table
