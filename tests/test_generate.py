"""`model.generate` with `dsfuse.generation.generate_kwargs` on the tiny preset (CPU, fp32; left-padded batch 2 on
GLM-MoE-DSA too): eager's tokens exactly, batch 1 and left-padded batch 2, no recompile per prompt length or per decode step, every family rewritten in
every graph the recipe compiles (prefill chunks against the static cache, and the decode step)."""

import pytest
import torch

import dsfuse
from dsfuse.generation import compile_options, generate_kwargs, static_cache

CHUNK = 16  # prompts of 17, 29, 41 tokens: a 16-token chunk (static), shorter tails (dynamic length), decode
MAX_CACHE_LEN = 64
NEW_TOKENS = 8
# Sites per compiled graph of the tiny preset (2 layers: one dense, one MoE): 5 norm/rope sites, the indexer and
# the sparse attention in each layer, the experts of the MoE layer.
PER_GRAPH = {"norm_rope_quant": 10, "indexer_topk": 2, "sparse_attention": 2, "moe_experts": 1}
# The tests reading `batch_one` (four compiled graphs) run on one pytest-xdist worker, which builds it once.
BATCH_ONE = pytest.mark.xdist_group("generate_batch_one")


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _model(attn: str, preset: str = "tiny"):
    from dsfuse.models.presets import build_hf_model

    model = build_hf_model(preset, dtype=torch.float32, device="cpu", attn_implementation=attn)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _prompt(batch: int, length: int, pad: int = 0):
    ids = torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    ids[1:, :pad], mask[1:, :pad] = 0, 0
    return ids, mask


def _generate(model, ids, mask, cache=None):
    """(eager tokens, dsfuse tokens, the cache, the graphs compiled, the report of that call)."""
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               cache_implementation="static", max_cache_len=MAX_CACHE_LEN, disable_compile=True)
        kwargs = generate_kwargs(model, ids.shape[0], MAX_CACHE_LEN, cache=cache, prefill_chunk_size=CHUNK,
                                 compile_all_devices=True)
        dsfuse.reset_report()
        before = _graphs()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return eager, out, kwargs["cache"], _graphs() - before, dsfuse.report()


def _assert_every_family_in_every_graph(report, graphs: int):
    assert len(report.graphs) == graphs
    for graph in range(graphs):
        counts = {name: 0 for name in PER_GRAPH}
        for site in report.sites:
            if site.graph == graph:
                counts[site.pass_name] += 1
        assert counts == PER_GRAPH, (graph, counts, str(report))
    assert report.near_misses == [], str(report)


@pytest.fixture(scope="module")
def batch_one():
    torch._dynamo.reset()
    model = _model("sdpa")
    runs, cache = {}, None
    for length in (17, 29, 41):
        eager, out, cache, compiled, report = _generate(model, *_prompt(1, length), cache=cache)
        runs[length] = dict(eager=eager, out=out, compiled=compiled, report=report)
    torch._dynamo.reset()
    return runs


@BATCH_ONE
def test_batch_one_gives_eager_tokens(batch_one):
    for length, run in batch_one.items():
        assert run["out"].shape == (1, length + NEW_TOKENS)
        assert torch.equal(run["out"], run["eager"]), length


@BATCH_ONE
def test_no_recompile_per_prompt_length_or_decode_step(batch_one):
    """17 tokens: the 16-token chunk (static length, the cache just reset), the one-token tail and the decode step.
    29: Dynamo marks the chunk length dynamic (one graph for every later tail). 41 and its 8 steps: nothing new."""
    assert [run["compiled"] for run in batch_one.values()] == [3, 1, 0]


@BATCH_ONE
def test_every_family_rewritten_in_the_prefill_and_decode_graphs(batch_one):
    first, second = batch_one[17]["report"], batch_one[29]["report"]
    _assert_every_family_in_every_graph(first, 3)
    _assert_every_family_in_every_graph(second, 1)
    attention = [s for s in first.sites + second.sites if s.pass_name == "sparse_attention"]
    # Static chunks and decode steps (<= 64 queries) read the latent cache in absorbed form; the dynamic-length
    # chunk is the masked op over the static cache (causal offset and unfilled tail come with the mask).
    assert [s.op for s in attention] == ["dsfuse.absorbed_mla_attention"] * 6 + ["dsfuse.sparse_attention_masked"] * 2
    assert all("bool mask" in s.detail for s in attention)


@pytest.mark.parametrize("attn, preset", [("sdpa", "tiny"), ("eager", "tiny"), ("sdpa", "glm-tiny")])
def test_left_padded_batch_two_gives_eager_tokens(attn, preset):
    """Row 1 left-padded by 5: its padding queries see no key (SDPA's bool mask gives them 0, the eager interface's
    finfo.min bias the mean of all values); the fused ops keep that, and the tokens are eager's. GLM-MoE-DSA (the
    tiny preset's dims) compiles the same graphs with the same sites."""
    model = _model(attn, preset)
    eager, out, _, compiled, report = _generate(model, *_prompt(2, 29, pad=5))
    assert torch.equal(out, eager)
    assert compiled == 3  # the 16-token chunk, the 13-token tail, decode
    _assert_every_family_in_every_graph(report, 3)
    kind = "bool mask" if attn == "sdpa" else "additive mask"
    assert all(kind in s.detail for s in report.sites if s.pass_name == "sparse_attention")


def test_static_cache_is_allocated_and_zeroed():
    model = _model("sdpa")
    cache = static_cache(model, 2, MAX_CACHE_LEN)
    assert cache.get_seq_length() == 0
    for layer in cache.layers:
        assert layer.is_initialized and layer.keys.shape[:3] == (2, 1, MAX_CACHE_LEN)
        assert not layer.keys.any() and not layer.values.any() and not layer.indexer_keys.any()
    with pytest.raises(ValueError, match="cache holds batch 2 x 64 positions, asked for 1 x 64"):
        generate_kwargs(model, 1, MAX_CACHE_LEN, cache=cache)


def test_compile_options_put_the_mode_in_options():
    """torch.compile refuses `mode=` with `options=`: the mode travels in dsfuse's options, with CUDA graphs for the
    decode steps only, and user options added."""
    assert compile_options() == {"mode": "reduce-overhead", "cudagraphs": "decode"}
    merged = compile_options({"disable": ["moe_experts"], "inductor": {"max_autotune": True}})
    assert merged == {"mode": "reduce-overhead", "cudagraphs": "decode", "disable": ["moe_experts"],
                      "inductor": {"max_autotune": True}}


@pytest.mark.parametrize("dynamic, want", [(False, True), (True, False)])
def test_cuda_graphs_only_for_graphs_traced_at_decode_lengths(monkeypatch, dynamic, want):
    """`cudagraphs="decode"` reads the length Dynamo traced: a graph for every length (a prompt chunk's tail) first
    compiled at 3 tokens gets no CUDA graphs; a graph of 3 tokens does."""
    import torch._inductor.compile_fx as inductor_compile

    patches = []
    monkeypatch.setattr(inductor_compile, "compile_fx",
                        lambda gm, inputs, config_patches=None, **kw: patches.append(config_patches) or gm.forward)

    def step(ids, x):
        return x * ids.sum()

    compiled = torch.compile(step, backend="dsfuse", dynamic=dynamic,
                             options={"mode": "reduce-overhead", "cudagraphs": "decode"})
    compiled(torch.ones(1, 3, dtype=torch.long), torch.ones(4))
    torch._dynamo.reset()
    assert [p["triton.cudagraphs"] for p in patches] == [want]


def test_cuda_graphs_for_decode_steps_only():
    from dsfuse.backend import _query_tokens
    from dsfuse.config import DsfuseConfigError, resolve_config

    ids = torch.zeros(2, 1, dtype=torch.long)
    assert _query_tokens([torch.zeros(2, 1, 1, 64, dtype=torch.bool), ids, torch.ones(3, 3)]) == 1
    assert _query_tokens([torch.zeros(2, 4096, dtype=torch.long)]) == 4096
    assert _query_tokens([torch.ones(3, 3)]) is None
    assert resolve_config({"cudagraphs": "decode"}).cudagraphs == "decode"
    with pytest.raises(DsfuseConfigError, match="unknown cudagraphs choice 'prefill'; valid: all, decode"):
        resolve_config({"cudagraphs": "prefill"})
    config = generate_kwargs.__globals__["compile_config"](compile_all_devices=True)
    assert config.backend == "dsfuse" and config.mode is None and config._compile_all_devices
    assert config.options == compile_options()
