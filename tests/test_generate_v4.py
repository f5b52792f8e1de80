"""DeepSeek V4 `model.generate` with `dsfuse.generation.generate_kwargs` (CPU, fp32 `v4-tiny`): HF's growing V4 cache
recompiles at most calls (Python-int counters, a 0 .. m-1 token pending buffer and the model's branches on it);
`V4DecodeCache` keeps the compressor state in fixed shapes, so the prefill chunks (through the compiled call, every
family rewritten as in a plain compiled forward) compile to a bounded few graphs, the decode step to one, and both
give eager's tokens, batch 1 and a left-padded batch 2. The cache fed chunks eagerly equals HF's, bit for bit."""

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
# Per prefill graph, as a plain `torch.compile(model, backend="dsfuse")` forward of the same length has them: at a
# static length the q / kv glue takes 7 sites, at a dynamic one 9; all three compressors (CSA, its indexer's, HCA).
PREFILL_SITES = {"norm_rope_quant": 7, "indexer_topk": 1, "sparse_attention": 2, "moe_experts": 2,
                 "hyper_connections": 9, "compressors": 3}
PREFILL_DYNAMIC_SITES = {**PREFILL_SITES, "norm_rope_quant": 9}
CHUNK = 8


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
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True)
    return torch.stack(logits)


@pytest.mark.parametrize("batch, pad", [(1, 0), (2, 5)])
def test_decode_cache_gives_hf_logits_bit_for_bit(batch, pad):
    """Eager, 13 steps from a 21-token prompt (window 8, CSA m=4, HCA m'=8: windows close and open mid-run): the
    fixed-shape decode state computes exactly what HF's growing cache does."""
    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2)
    ids, mask = _prompt(batch, 21, pad)
    reference = _decode(model, DynamicCache(config=model.config), ids, mask, 13)
    assert torch.equal(_decode(model, V4DecodeCache(model.config, MAX_CACHE_LEN), ids, mask, 13), reference)


def _chunked(model, cache, ids, mask, chunk: int, steps: int = 6) -> torch.Tensor:
    """The prompt in chunks of `chunk` tokens as generate's chunked prefill feeds them (the mask up to the chunk's
    end, the chunk's positions), then `steps` one-token forwards; the logits of every call."""
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
    gives for the same chunks, bit for bit."""
    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2)
    ids, mask = _prompt(batch, length, pad)
    for chunk in (1, 3, 5, 8):
        reference = _chunked(model, DynamicCache(config=model.config), ids, mask, chunk)
        assert torch.equal(_chunked(model, V4DecodeCache(model.config, MAX_CACHE_LEN), ids, mask, chunk),
                           reference), chunk


def test_decode_cache_refuses_a_prefill_after_decoding():
    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2)
    cache = V4DecodeCache(model.config, MAX_CACHE_LEN)
    ids, mask = _prompt(1, 21)
    _decode(model, cache, ids, mask, 2)
    with torch.no_grad(), pytest.raises(RuntimeError, match="reset\\(\\) the cache before a new prefill"):
        model(ids[:, :4], cache=cache, use_cache=True)
    cache.reset()
    assert cache.get_seq_length() == 0
    torch.testing.assert_close(_decode(model, cache, ids, mask, 2),
                               _decode(model, DynamicCache(config=model.config), ids, mask, 2), rtol=0, atol=0)


@pytest.fixture(scope="module")
def model():
    model = build_hf_model("v4-tiny", hc_sinkhorn_iters=2, num_hidden_layers=2,
                           layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                           mlp_layer_types=["moe", "moe"])
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _generate(model, ids, mask, cache=None, chunk=None):
    """(eager tokens, dsfuse tokens, the cache, graphs compiled, the report of that call)."""
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        kwargs = generate_kwargs(model, ids.shape[0], MAX_CACHE_LEN, cache=cache, compile_all_devices=True,
                                 **({"prefill_chunk_size": chunk} if chunk else {}))
        dsfuse.reset_report()
        before = _graphs()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
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
    # top-min(index_topk, entries): the entry count is a symbol, the pick count stays one for every step
    assert attention[0].detail.startswith("V4 CSA attention: window 8 + top-Min(4, "), attention[0].detail
    assert attention[1].detail.startswith("V4 HCA attention: window 8 + every compressed entry (one query)")
    assert all("additive input mask (0 = seen)" in s.detail for s in attention)


@pytest.fixture(scope="module")
def batch_one(model):
    """Prompts of 21, 29 and 45 tokens in chunks of 8 (a multiple of m=4 and m'=8, the sliding window) through one
    cache, each then decoded for 6 steps."""
    torch._dynamo.reset()
    runs, cache = {}, None
    for length in (21, 29, 45):
        eager, out, cache, compiled, report = _generate(model, *_prompt(1, length), cache=cache, chunk=CHUNK)
        runs[length] = dict(eager=eager, out=out, compiled=compiled, report=report)
    torch._dynamo.reset()
    return runs


def test_chunked_generate_gives_eager_tokens(batch_one):
    for length, run in batch_one.items():
        assert run["out"].shape == (1, length + NEW_TOKENS)
        assert torch.equal(run["out"], run["eager"]), length


def test_chunked_generate_compiles_a_bounded_few_graphs(batch_one):
    """21 = 8 + 8 + 5: the first chunk (an empty cache), a chunk continuing the prefill, the 5-token tail (Dynamo
    marks the length dynamic) and the decode step, once for every step. 29: generate cuts each chunk's positions out
    of the prompt's, so their stride is the prompt's length: the two graphs compiled with a static stride compile
    once more. 45 (five chunks, a tail, 6 steps): nothing new."""
    assert [run["compiled"] for run in batch_one.values()] == [4, 2, 0]


def test_chunked_generate_rewrites_every_family_in_every_graph(batch_one):
    first, second = batch_one[21]["report"], batch_one[29]["report"]
    assert len(first.graphs) == 4 and len(second.graphs) == 2
    for graph in (0, 1):  # 8-token chunks (static length)
        _assert_prefill_graph(first, graph, PREFILL_SITES)
    # the 5-token tail (dynamic length; the HCA compressor pools the chunk's repeated window), 29's chunks
    _assert_prefill_graph(first, 2, PREFILL_DYNAMIC_SITES)
    _assert_decode_graph(first, 3)
    for graph in (0, 1):
        _assert_prefill_graph(second, graph, PREFILL_DYNAMIC_SITES)


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
    assert isinstance(kwargs["cache"], V4DecodeCache) and kwargs["cache"].is_compileable
    assert set(kwargs) == {"cache", "prefill_chunk_size", "compile_config"}
    assert kwargs["prefill_chunk_size"] == 4096 and isinstance(kwargs["compile_config"], CompileConfig)
    assert kwargs["compile_config"].backend == "dsfuse" and kwargs["compile_config"].mode is None
    assert generate_kwargs(model, 1, MAX_CACHE_LEN, cache=kwargs["cache"])["cache"] is kwargs["cache"]
    with pytest.raises(ValueError, match="does not hold 32 positions"):
        generate_kwargs(model, 1, 32, cache=kwargs["cache"])
    with pytest.raises(ValueError, match=r"a multiple of 8 \(the compression rates \[4, 8\]\) and at least the "
                                         r"sliding window 8; got 12, try 16"):
        generate_kwargs(model, 1, MAX_CACHE_LEN, prefill_chunk_size=12)
    with pytest.raises(ValueError, match="got 4, try 8"):
        generate_kwargs(model, 1, MAX_CACHE_LEN, prefill_chunk_size=4)
    assert generate_kwargs(model, 1, MAX_CACHE_LEN, prefill_chunk_size=None)["prefill_chunk_size"] is None
