"""The public contract of design.md: backend by name, pass names, options, env vars, errors, report."""

import contextlib
import subprocess
import sys
import warnings

import pytest
import torch

import dsfuse
from dsfuse.config import resolve_config


def _run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_backend_by_name_without_import():
    out = _run_python(
        "import sys, torch\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='dsfuse')\n"
        "print(f(torch.arange(3.)).tolist(), 'dsfuse' in sys.modules)\n"
    )
    assert out.strip() == "[1.0, 3.0, 5.0] True"


def test_import_does_not_register_backend_itself():
    out = _run_python(
        "import dsfuse\n"
        "from torch._dynamo.backends.registry import _COMPILER_FNS\n"
        "print('dsfuse' in _COMPILER_FNS)\n"
        "import torch\n"
        "print('dsfuse' in torch._dynamo.list_backends())\n"
    )
    assert out.split() == ["False", "True"]


def test_pass_names():
    assert {"norm_rope_quant", "indexer_topk", "sparse_attention", "moe_experts", "hyper_connections",
            "compressors"} <= set(
        dsfuse.PASS_NAMES)


@pytest.mark.parametrize(
    "options, environ, expected",
    [
        ({}, {}, ("norm_rope_quant", "indexer_topk", "sparse_attention", "moe_experts", "hyper_connections",
                  "compressors")),
        ({"disable": ["moe_experts"]}, {}, ("norm_rope_quant", "indexer_topk", "sparse_attention", "hyper_connections",
                                            "compressors")),
        ({"disable": ["hyper_connections", "compressors"]}, {},
         ("norm_rope_quant", "indexer_topk", "sparse_attention", "moe_experts")),
        ({"enable": ["indexer_topk"]}, {}, ("indexer_topk",)),
        ({"enable": "indexer_topk,moe_experts", "disable": ["moe_experts"]}, {}, ("indexer_topk",)),
        ({}, {"DSFUSE_DISABLE": "indexer_topk, sparse_attention"},
         ("norm_rope_quant", "moe_experts", "hyper_connections", "compressors")),
        ({}, {"DSFUSE_ENABLE": "sparse_attention"}, ("sparse_attention",)),
        ({"disable": list(dsfuse.PASS_NAMES)}, {}, ()),
    ],
)
def test_enable_disable(options, environ, expected):
    assert resolve_config(options, environ=environ).enabled == expected


@pytest.mark.parametrize(
    "options, environ, bad",
    [
        ({"disable": ["indexer"]}, {}, "'indexer'"),
        ({"enable": ["moe"]}, {}, "'moe'"),
        ({}, {"DSFUSE_DISABLE": "norm_rope"}, "'norm_rope'"),
        ({"enabel": ["moe_experts"]}, {}, "'enabel'"),
    ],
)
def test_unknown_names_raise_and_list_valid_ones(options, environ, bad):
    with pytest.raises(dsfuse.DsfuseConfigError) as err:
        resolve_config(options, environ=environ)
    message = str(err.value)
    assert bad in message
    valid = dsfuse.OPTION_NAMES if bad == "'enabel'" else dsfuse.PASS_NAMES
    assert all(name in message for name in valid)


def test_unknown_pass_raises_through_torch_compile_as_itself():
    """torch.compile hands the options over at the first call; the error reaches the caller as DsfuseConfigError
    (not wrapped by Dynamo), its text the one line that names the bad pass and the valid ones."""
    f = torch.compile(lambda x: x + 1, backend="dsfuse", options={"disable": ["no_such_pass"]})
    with pytest.raises(dsfuse.DsfuseConfigError) as err:
        f(torch.ones(2))
    assert str(err.value) == ("unknown dsfuse pass 'no_such_pass' in options['disable']; valid pass names: "
                              + ", ".join(dsfuse.PASS_NAMES))
    assert isinstance(err.value, ValueError)


def test_unknown_preset_on_the_command_line_is_one_line(capsys):
    from dsfuse import bench, quickstart

    for main, argv in ((quickstart.main, ["--preset", "nope"]), (bench.main, ["model", "--preset", "nope"])):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "invalid choice: 'nope' (choose from 'fp8-tiny'" in capsys.readouterr().err


def test_env_flags_reach_the_backend(monkeypatch):
    monkeypatch.setenv("DSFUSE_DISABLE", "moe_experts")
    torch.compile(lambda x: x.relu(), backend="dsfuse")(torch.randn(4))
    assert dsfuse.report().graphs[0].enabled == ("norm_rope_quant", "indexer_topk", "sparse_attention", "hyper_connections",
                                                 "compressors")


def test_inductor_options_pass_through_and_mode_is_checked():
    f = torch.compile(lambda x: x.sin(), backend="dsfuse", options={"inductor": {"max_autotune": False}})
    assert torch.allclose(f(torch.ones(3)), torch.ones(3).sin())
    with pytest.raises(dsfuse.DsfuseConfigError, match="unknown mode 'fastest'"):
        resolve_config({"mode": "fastest"})


def test_report_has_all_keys_and_reads_well():
    torch.compile(lambda x: x.relu() + 1, backend="dsfuse")(torch.randn(8))
    rep = dsfuse.report()
    assert rep.counts == {name: 0 for name in dsfuse.PASS_NAMES}
    text = str(rep)
    assert text.startswith("dsfuse report: 1 graph(s) compiled")
    for name in dsfuse.PASS_NAMES:
        assert name in text
    dsfuse.reset_report()
    assert dsfuse.report().graphs == [] and dsfuse.report().counts["indexer_topk"] == 0


def test_report_records_each_graphs_tokens_per_sequence():
    """The report gives each graph's tokens per sequence (the length of its 2-D integer inputs; 1 for a decode
    step), None for a graph whose length is dynamic: a benchmark tells decode graphs from prefill graphs by it."""
    table = torch.nn.Embedding(16, 4)
    with torch.no_grad():
        compiled = torch.compile(table, backend="dsfuse")
        for length in (1, 7, 9):  # 7: a recompile for the new length; 9: none (Dynamo marked the length dynamic)
            compiled(torch.zeros(2, length, dtype=torch.long))
    assert [graph.tokens for graph in dsfuse.report().graphs] == [1, None]


def test_graph_tokens_leave_out_integer_weights():
    """A [vocab, top-k] integer buffer (V4's hash-routing table) is a graph input beside the token ids, not a length
    of the step: a one-token step reads 1 token."""

    class HashRouted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("tid2eid", torch.randint(0, 8, (16, 2)))

        def forward(self, ids):
            return self.tid2eid[ids].sum(-1)

    with torch.no_grad():
        torch.compile(HashRouted(), backend="dsfuse")(torch.zeros(2, 1, dtype=torch.long))
    assert [graph.tokens for graph in dsfuse.report().graphs] == [1]


def test_training_graphs_are_left_to_inductor_with_one_warning(monkeypatch):
    from dsfuse import backend

    monkeypatch.setattr(backend, "_WARNED", set())
    lin = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="dsfuse: graph needs gradients"):
        out = torch.compile(lin, backend="dsfuse")(torch.randn(2, 4))
    out.sum().backward()
    assert "inference graphs only" in dsfuse.report().graphs[0].note
    assert lin.weight.grad is not None
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second graph needing gradients is only in the report
        torch.compile(lin, backend="dsfuse")(torch.randn(3, 4))
    assert "inference graphs only" in dsfuse.report().graphs[1].note


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "frozen"])
def test_inference_graphs_carry_no_training_note(context):
    """Graphs without gradients (no_grad, inference_mode, or no input that requires one) get no note at all."""
    lin = torch.nn.Linear(4, 4)
    if context == "frozen":
        lin.requires_grad_(False)
    guard = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(context, contextlib.nullcontext)
    with guard(), torch._inductor.config.patch(fx_graph_cache=False):  # a cache hit would add its own note
        torch.compile(lin, backend="dsfuse")(torch.randn(2, 4))
    graphs = dsfuse.report().graphs
    assert len(graphs) == 1 and graphs[0].note == "" and graphs[0].enabled, graphs


class CudaStandIn(torch.Tensor):  # no GPU here: a CPU tensor that says it lives on CUDA
    @property
    def is_cuda(self):
        return True


def _absorbed_site(queries: str, keys: str):
    """An absorbed attention site as the pass records it: q [B, H, S, D], latent [B, 1, T, C], ..."""
    from dsfuse.report import Site

    return Site("sparse_attention", 0, "scatter", "dsfuse.absorbed_mla_attention",
                (f"q:bfloat16[2x16x{queries}x192]", f"latent:bfloat16[2x1x{keys}x512]",
                 f"rope:bfloat16[2x1x{keys}x64]", "w:bfloat16[4096x512]", f"idx:int32[2x{queries}x8]"))


def test_a_cuda_decode_graph_without_cuda_graphs_is_flagged():
    """Absorbed attention over a KV cache compiled for CUDA without CUDA graphs runs several times slower than its
    GPU time: the report says so (and how to fix it); CPU graphs, captured graphs and prefill graphs stay quiet."""
    from dsfuse.backend import DECODE_WITHOUT_GRAPHS_NOTE, _decode_without_graphs
    from dsfuse.report import Site

    on_gpu, on_cpu = [torch.empty(2).as_subclass(CudaStandIn)], [torch.empty(2)]
    for decode in (_absorbed_site("1", "8193"), _absorbed_site("1", "s0 + 1"), _absorbed_site("4", "s0")):
        assert _decode_without_graphs([decode], on_gpu, {}) is DECODE_WITHOUT_GRAPHS_NOTE, decode
        assert _decode_without_graphs([decode], on_gpu, {"triton.cudagraphs": True}) is None
        assert _decode_without_graphs([decode], on_cpu, {}) is None
    masked = Site("sparse_attention", 0, "scatter", "dsfuse.sparse_attention_masked", ())
    assert _decode_without_graphs([masked], on_gpu, {}) is None


def _v4_site(queries: str, keys: str):
    """A V4 attention site as the pass records it: q [B, H, S, D], the K=V window [B, 1, T, D], ..."""
    from dsfuse.report import Site

    return Site("sparse_attention", 0, "cat", "dsfuse.compressed_attention",
                (f"q:bfloat16[1x64x{queries}x512]", f"kv:bfloat16[1x1x{keys}x512]", "pos:int64[1x1]",
                 "sinks:float32[64]"))


def test_a_v4_cuda_decode_graph_says_it_runs_without_cuda_graphs():
    """A V4 decode step compiled for CUDA without CUDA graphs is host-bound: the report says so, with the step time
    and the remedy (generate_kwargs' V4DecodeCache under "reduce-overhead"), and nothing fires for a captured step,
    a V4 prefill or a CPU graph."""
    from dsfuse.backend import V4_DECODE_WITHOUT_GRAPHS_NOTE, _decode_without_graphs

    on_gpu, on_cpu = [torch.empty(2).as_subclass(CudaStandIn)], [torch.empty(2)]
    assert _decode_without_graphs([_v4_site("1", "128")], on_gpu, {}) is V4_DECODE_WITHOUT_GRAPHS_NOTE
    assert "generate_kwargs" in V4_DECODE_WITHOUT_GRAPHS_NOTE
    assert _decode_without_graphs([_v4_site("1", "128")], on_gpu, {"triton.cudagraphs": True}) is None
    assert _decode_without_graphs([_v4_site("1", "128")], on_cpu, {}) is None
    assert _decode_without_graphs([_v4_site("s0", "s0")], on_gpu, {}) is None


@pytest.mark.parametrize("queries,keys", [("4096", "8256"), ("65", "8256"), ("s0", "s1")])
def test_a_prompt_chunk_over_the_cache_is_not_a_decode_step(queries, keys):
    """generate's prefill chunks attend over the cache's earlier chunks, GPU-bound and left without CUDA graphs by
    dsfuse's own recipe (`cudagraphs="decode"`): no warning for them, while a step of up to DECODE_MAX_TOKENS
    tokens over the same cache is flagged."""
    from dsfuse.backend import V4_DECODE_WITHOUT_GRAPHS_NOTE, _decode_without_graphs
    from dsfuse.config import DECODE_MAX_TOKENS

    on_gpu = [torch.empty(2).as_subclass(CudaStandIn)]
    assert _decode_without_graphs([_v4_site(queries, keys)], on_gpu, {}) is None
    assert _decode_without_graphs([_absorbed_site(queries, keys)], on_gpu, {}) is None
    step = str(DECODE_MAX_TOKENS)
    assert _decode_without_graphs([_v4_site(step, keys)], on_gpu, {}) is V4_DECODE_WITHOUT_GRAPHS_NOTE


@pytest.mark.parametrize("queries", [str(s) for s in range(1, 10)] + ["64", "s0"])
def test_a_short_prefill_is_not_a_decode_step(queries):
    """A prefill of up to ABSORB_MAX_QUERIES tokens without a cache is absorbed too, but its keys are its own
    tokens (T = S): no decode note for it."""
    from dsfuse.backend import _decode_without_graphs

    on_gpu = [torch.empty(2).as_subclass(CudaStandIn)]
    assert _decode_without_graphs([_absorbed_site(queries, queries)], on_gpu, {}) is None
