"""DeepSeek V4 `model.generate` with `dsfuse.generation.generate_kwargs` (CPU, fp32 `v4-tiny`): HF's growing V4 cache
recompiles at most calls (Python-int counters, a 0 .. m-1 token pending buffer and the model's branches on it);
`V4DecodeCache` keeps its state in fixed shapes and addresses, so the prefill chunks (through the compiled call,
every family rewritten as in a plain compiled forward) compile to a bounded few graphs, the decode step to one whose
only symbol is the heavily compressed layers' entry count (what lets it replay as a CUDA graph), and both give
eager's tokens, batch 1 and a left-padded batch 2. The cache fed chunks eagerly gives HF's prefill logits bit for
bit, and its decode steps HF's up to fp32 rounding (a CSA step reads every entry slot, the unfinished ones masked
by its indexer, so its sums add zeros HF's do not)."""

import pytest
import torch
from transformers import DynamicCache

import dsfuse
from dsfuse.generation import generate_kwargs
from dsfuse.models.presets import build_hf_model
from dsfuse.v4_cache import V4DecodeCache

NEW_TOKENS = 6
MAX_CACHE_LEN = 64
# Per decode graph of the 2-layer model (CSA then HCA): the q / kv glue of both layers, the CSA compressors' norms
# and the indexer query, the CSA indexer, both MoE blocks, 2 collapses + 2 exits per layer and the head, the HCA
# compressor. The CSA compressor and its indexer's read the decode cache's pending window (reported, not fused).
DECODE_SITES = {"norm_rope_quant": 9, "indexer_topk": 1, "sparse_attention": 2, "moe_experts": 2,
                "hyper_connections": 9, "compressors": 1}
PENDING_WINDOW = "is a window written into a cache buffer (select_scatter: a decode step's pending window)"
# Per prefill graph, static or dynamic length, as a plain `torch.compile(model, backend="dsfuse")` forward of the
# same length has them: the q / kv glue in 7 sites (each norm fused once), all three compressors (CSA, its
# indexer's, HCA).
PREFILL_SITES = {"norm_rope_quant": 7, "indexer_topk": 1, "sparse_attention": 2, "moe_experts": 2,
                 "hyper_connections": 9, "compressors": 3}
CHUNK = 8
# The tests reading `batch_one` (six compiled graphs) run on one pytest-xdist worker, which builds it once; the short
# prompt's test runs there after them, so its batch-1 decode graph with the HCA entry count as a symbol is
# `batch_one`'s, served by Inductor's caches (43 s alone, 27 s after them, cold caches).
BATCH_ONE = pytest.mark.xdist_group("generate_v4_batch_one")


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _prompt(batch: int, length: int, pad: int = 0):
    ids = torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(length + batch))
    mask = torch.ones_like(ids)
    ids[1:, :pad], mask[1:, :pad] = 0, 0
    return ids, mask


def _decode(model, cache, ids, mask, steps: int) -> torch.Tensor:
    """Eager prefill, then `steps` one-token forwards with generate's inputs; the logits of every step."""
    logits = []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
        for step in range(steps):
            logits.append(out.logits[:, -1])
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:].clone(memory_format=torch.contiguous_format)
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True)
    return torch.stack(logits)


# A decode step's logits against HF's cache: fp32 rounding of sums over a different number of zero terms (measured
# 1.3e-7 at most over 13 steps; a wrong entry or window row moves them by ~1e-2).
DECODE_ATOL = 1e-6


def _assert_decode_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=DECODE_ATOL)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("batch, pad", [(1, 0), (2, 5)])
def test_decode_cache_gives_hf_logits(batch, pad):
    """Eager, 13 steps from a 21-token prompt (window 8, CSA m=4, HCA m'=8: windows close and open mid-run): the
    prefill's logits are HF's bit for bit, the fixed-shape decode state's HF's up to fp32 rounding."""
    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2)
    ids, mask = _prompt(batch, 21, pad)
    reference = _decode(model, DynamicCache(config=model.config), ids, mask, 13)
    got = _decode(model, V4DecodeCache(model.config, MAX_CACHE_LEN), ids, mask, 13)
    assert torch.equal(got[0], reference[0])
    _assert_decode_logits(got[1:], reference[1:])


def test_decode_cache_full_reads_its_length_and_refuses_one_more_step():
    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2)
    ids, mask = _prompt(1, 21)
    cache = V4DecodeCache(model.config, 23).allocate(model, 1)
    _decode(model, cache, ids, mask, 2)
    assert cache.get_seq_length() == 23
    with torch.no_grad(), pytest.raises(ValueError, match="holds 23 positions .* would be position 24"):
        model(ids[:, :1], cache=cache, use_cache=True, position_ids=torch.tensor([[23]]))


def test_compiled_forward_decodes_with_the_mask_it_builds(model):
    """A compiled forward called step by step with a 2-D mask, so the model builds its mask inside the compiled call
    from the cache's count: the count is then a symbol of the step's graph (one graph for every step; no CUDA graph
    replay), HF's logits to compiler rounding."""
    torch._dynamo.reset()
    ids, mask = _prompt(1, 21)
    reference = _decode(model, DynamicCache(config=model.config), ids, mask, 5)
    before = _graphs()
    cache = V4DecodeCache(model.config, MAX_CACHE_LEN).allocate(model, 1)
    got = _decode(torch.compile(model, backend="dsfuse"), cache, ids, mask, 5)
    assert _graphs() - before == 2  # the prefill and the decode step
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), reference.argmax(-1))
    torch._dynamo.reset()


def _chunked(model, cache, ids, mask, chunk: int, steps: int = 6) -> torch.Tensor:
    """The prompt in chunks of `chunk` tokens as generate's chunked prefill feeds them (the mask up to the chunk's
    end, the chunk's positions), then `steps` one-token forwards; the logits of every call (the prompt's positions
    first, then one per step)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            end = min(start + chunk, ids.shape[1])
            out = model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                        cache=cache, use_cache=True)
            logits.append(out.logits)
        for step in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, position_ids=positions[:, -1:] + step + 1,
                        cache=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("batch, pad", [(1, 0), (2, 5)])
@pytest.mark.parametrize("length", [7, 21])
def test_chunked_prefill_gives_hf_logits_bit_for_bit(batch, pad, length):
    """Eager, chunks of 1 (a one-token first call), 3 and 5 (boundaries off the CSA m=4 and HCA m'=8 windows) and 8,
    a prompt shorter than the window (7) and one over two HCA windows (21), then decode steps: what HF's own cache
    gives for the same chunks, bit for bit for the multi-token chunks, up to fp32 rounding for one-token calls."""
    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2)
    ids, mask = _prompt(batch, length, pad)
    for chunk in (1, 3, 5, 8):
        reference = _chunked(model, DynamicCache(config=model.config), ids, mask, chunk)
        got = _chunked(model, V4DecodeCache(model.config, MAX_CACHE_LEN), ids, mask, chunk)
        # a one-token call after the first is a decode step (chunks of 1, the 7th token in chunks of 3)
        prefilled = next((start for start in range(chunk, length, chunk) if length - start == 1 or chunk == 1), length)
        assert torch.equal(got[:, :prefilled], reference[:, :prefilled]), chunk
        _assert_decode_logits(got[:, prefilled:], reference[:, prefilled:])


def test_decode_cache_refuses_a_prefill_after_decoding():
    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2)
    cache = V4DecodeCache(model.config, MAX_CACHE_LEN)
    ids, mask = _prompt(1, 21)
    _decode(model, cache, ids, mask, 2)
    with torch.no_grad(), pytest.raises(RuntimeError, match="reset\\(\\) the cache before a new prefill"):
        model(ids[:, :4], cache=cache, use_cache=True)
    cache.reset()
    assert cache.get_seq_length() == 0
    _assert_decode_logits(_decode(model, cache, ids, mask, 2),
                          _decode(model, DynamicCache(config=model.config), ids, mask, 2))


@pytest.fixture(scope="module")
def model():
    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2, num_hidden_layers=2,
                           layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                           mlp_layer_types=["moe", "moe"])
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _decode_graph_symbols(gm, example_inputs, **kwargs):
    """dsfuse's backend, recording the free symbols of a one-token graph's inputs."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    from dsfuse.backend import _traced_tokens, dsfuse_backend

    if _traced_tokens(gm) == 1:
        values = [node.meta["example_value"] for node in gm.graph.find_nodes(op="placeholder")]
        DECODE_GRAPHS.append({str(symbol) for value in values for symbol in free_symbols(value)})
    return dsfuse_backend(gm, example_inputs, **kwargs)


DECODE_GRAPHS: list = []


def _generate(model, ids, mask, cache=None, chunk=None, new_tokens=NEW_TOKENS):
    """(eager tokens, dsfuse tokens, the cache, graphs compiled, the report of that call)."""
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        kwargs = generate_kwargs(model, ids.shape[0], MAX_CACHE_LEN, cache=cache, compile_all_devices=True,
                                 **({"prefill_chunk_size": chunk} if chunk else {}))
        kwargs["compile_config"].backend = _decode_graph_symbols
        dsfuse.reset_report()
        before = _graphs()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    return eager, out, kwargs["cache"], _graphs() - before, dsfuse.report()


def _counts(report, graph: int) -> dict:
    counts = {name: 0 for name in DECODE_SITES}
    for site in report.sites:
        if site.graph == graph:
            counts[site.pass_name] += 1
    return counts


def _assert_prefill_graph(report, graph: int, expected: dict):
    """A prefill chunk's graph: every family as in a plain compiled forward, no near-miss; the attention reads the
    [B, 1, S, N] mask generate built for the chunk."""
    assert _counts(report, graph) == expected, (graph, str(report))
    assert not [m for m in report.near_misses if m.graph == graph], str(report)
    attention = [s for s in report.sites if s.pass_name == "sparse_attention" and s.graph == graph]
    assert [s.op for s in attention] == ["dsfuse.compressed_attention"] * 2
    assert attention[0].detail.startswith("V4 CSA attention: the input mask's window rows + top-"), attention[0].detail
    assert attention[1].detail.startswith("V4 HCA attention: the input mask's window rows + causal compressed entries")
    assert all("additive input mask (0 = seen)" in s.detail for s in attention)


def _assert_decode_graph(report, graph: int):
    """Every family in the decode graph; the attention reads generate's additive [B, 1, 1, N] input mask."""
    assert _counts(report, graph) == DECODE_SITES, str(report)
    reasons = [(m.pass_name, PENDING_WINDOW in m.reason) for m in report.near_misses if m.graph == graph]
    assert reasons == [("compressors", True)] * 2, str(report)
    attention = [s for s in report.sites if s.pass_name == "sparse_attention" and s.graph == graph]
    assert [s.op for s in attention] == ["dsfuse.compressed_attention"] * 2
    # the CSA step reads every entry slot: a fixed entry and pick count
    assert attention[0].detail.startswith("V4 CSA attention: window 8 + top-4 compressed entries"), attention[0].detail
    assert attention[1].detail.startswith("V4 HCA attention: window 8 + every compressed entry (one query)")
    assert all("additive input mask (0 = seen)" in s.detail for s in attention)


@pytest.fixture(scope="module")
def batch_one(model):
    """Prompts of 21, 29 and 45 tokens in chunks of 8 (a multiple of m=4 and m'=8, the sliding window) through one
    cache, each then decoded for 6 steps."""
    torch._dynamo.reset()
    DECODE_GRAPHS.clear()
    runs, cache = {}, None
    for length in (21, 29, 45):
        eager, out, cache, compiled, report = _generate(model, *_prompt(1, length), cache=cache, chunk=CHUNK)
        runs[length] = dict(eager=eager, out=out, compiled=compiled, report=report)
    torch._dynamo.reset()
    return runs


@BATCH_ONE
def test_chunked_generate_gives_eager_tokens(batch_one):
    for length, run in batch_one.items():
        assert run["out"].shape == (1, length + NEW_TOKENS)
        assert torch.equal(run["out"], run["eager"]), length


@BATCH_ONE
def test_chunked_generate_compiles_a_bounded_few_graphs(batch_one):
    """21 = 8 + 8 + 5: the first chunk (an empty cache), a chunk continuing the prefill, the 5-token tail (Dynamo
    marks the length dynamic) and the decode step, once for every step. 29: generate cuts each chunk's positions out
    of the prompt's, so their stride is the prompt's length: the two graphs compiled with a static stride compile
    once more. 45 (five chunks, a tail, 6 steps): nothing new."""
    assert [run["compiled"] for run in batch_one.values()] == [4, 2, 0]


@BATCH_ONE
def test_decode_step_reads_one_symbol_the_hca_entry_count(batch_one):
    """The decode graph's inputs carry one symbol: the number of entries the HCA layer attends to, which changes every
    m' = 8 tokens. The token count, a symbol in the prefill graphs, is not among them: a CUDA graph (keyed by the
    graph's integer inputs) is recorded once per HCA entry count, not once per step."""
    report = batch_one[21]["report"]
    hca = [s for s in report.sites if s.graph == 3 and s.detail.startswith("V4 HCA attention")]
    assert len(DECODE_GRAPHS) == 1 and len(DECODE_GRAPHS[0]) == 1, DECODE_GRAPHS
    (symbol,) = DECODE_GRAPHS[0]
    assert hca[0].inputs[2].endswith(f"[1x1x{symbol}x32]"), hca[0].inputs


@BATCH_ONE
def test_chunked_generate_rewrites_every_family_in_every_graph(batch_one):
    first, second = batch_one[21]["report"], batch_one[29]["report"]
    assert len(first.graphs) == 4 and len(second.graphs) == 2
    # 8-token chunks (static length), the 5-token tail (dynamic length; the HCA compressor pools the chunk's repeated
    # window), then 29's chunks
    for graph in (0, 1, 2):
        _assert_prefill_graph(first, graph, PREFILL_SITES)
    _assert_decode_graph(first, 3)
    for graph in (0, 1):
        _assert_prefill_graph(second, graph, PREFILL_SITES)


@BATCH_ONE
def test_generate_short_prompt_fills_the_window_without_new_graphs(model):
    """A prompt shorter than the window (5 < 8), 12 steps: the window fills from the front of its fixed buffer, so
    its growth compiles nothing. The HCA layer's entry count (m' = 8) is 0, 1, then 2: Dynamo specialises a view of 0
    or 1 entries, so those steps get a graph each, and the third decode graph reads the count as its one symbol;
    every decode graph a one-token graph (a CUDA graph on a GPU); eager's tokens."""
    torch._dynamo.reset()
    DECODE_GRAPHS.clear()
    eager, out, _, compiled, report = _generate(model, *_prompt(1, 5), new_tokens=12)
    assert torch.equal(out, eager)
    assert compiled == 4 and [g.tokens for g in report.graphs] == [5, 1, 1, 1], (compiled, report.graphs)
    assert [len(symbols) for symbols in DECODE_GRAPHS] == [0, 0, 1], DECODE_GRAPHS
    for graph in (1, 2, 3):
        assert _counts(report, graph) == DECODE_SITES, str(report)
    torch._dynamo.reset()


def test_generate_left_padded_batch_two(model):
    """Row 1 left-padded by 5, the default chunk (the whole prompt in one): the prefill graph and one decode graph
    for the batch of 2, eager's tokens."""
    torch._dynamo.reset()
    eager, out, _, compiled, report = _generate(model, *_prompt(2, 21, pad=5))
    assert torch.equal(out, eager)
    assert compiled == 2
    _assert_prefill_graph(report, 0, PREFILL_SITES)
    _assert_decode_graph(report, 1)


def test_generate_kwargs_for_v4(model):
    from transformers import CompileConfig

    kwargs = generate_kwargs(model, 1, MAX_CACHE_LEN)
    cache = kwargs["cache"]
    assert isinstance(cache, V4DecodeCache) and cache.is_compileable
    assert set(kwargs) == {"cache", "prefill_chunk_size", "compile_config"}
    assert kwargs["prefill_chunk_size"] == 4096 and isinstance(kwargs["compile_config"], CompileConfig)
    assert kwargs["compile_config"].backend == "dsfuse" and kwargs["compile_config"].mode is None
    assert kwargs["compile_config"].options == {"mode": "reduce-overhead", "cudagraphs": "decode"}
    # allocated before anything is compiled: every buffer a decode step writes is a static address, zeroed
    buffers = [cache.clock.position] + [layer._window for layer in cache.layers]
    for layer in cache.layers:  # CSA (compressor and indexer: 4 buffers each), HCA (3)
        buffers += [*layer._stream_kv.values(), *layer._window_kv.values(), *layer._entries.values(),
                    *layer._ring_kv.values()]
    assert len(buffers) == 14 and cache.get_seq_length() == 0
    assert all(hasattr(b, "_dynamo_static_input_type") and not b.any() for b in buffers)
    assert generate_kwargs(model, 1, MAX_CACHE_LEN, cache=kwargs["cache"])["cache"] is kwargs["cache"]
    with pytest.raises(ValueError, match="does not hold 32 positions"):
        generate_kwargs(model, 1, 32, cache=kwargs["cache"])
    with pytest.raises(ValueError, match=r"a multiple of 8 \(the compression rates \[4, 8\]\) and at least the "
                                         r"sliding window 8; got 12, try 16"):
        generate_kwargs(model, 1, MAX_CACHE_LEN, prefill_chunk_size=12)
    with pytest.raises(ValueError, match="got 4, try 8"):
        generate_kwargs(model, 1, MAX_CACHE_LEN, prefill_chunk_size=4)
    assert generate_kwargs(model, 1, MAX_CACHE_LEN, prefill_chunk_size=None)["prefill_chunk_size"] is None
