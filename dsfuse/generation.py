"""`model.generate(...)` with both its prefill and its decode steps compiled by dsfuse.

    from dsfuse.generation import generate_kwargs
    kwargs = generate_kwargs(model, batch_size=1, max_cache_len=8192 + 256)
    out = model.generate(ids, max_new_tokens=256, do_sample=False, **kwargs)

By default transformers compiles only the decode step of `generate` (static cache, `CompileConfig`) and runs
the prefill eagerly. These keyword arguments use transformers' own mechanisms to route the prefill through the
same compiled call, without patching the model:

* `prefill_chunk_size`: the prompt is prefilled in chunks through the compiled call, each chunk's queries at
  an offset against the static cache (this also bounds the prefill's memory for long prompts).
* a `StaticCache` of a fixed `max_cache_len` whose buffers are allocated before anything is compiled (a
  one-token eager step fills them, `reset()` zeroes them): transformers cannot pre-allocate an MLA cache, and a
  cache allocated inside the compiled prefill would not be marked as static buffers, so the decode step could
  not run as a CUDA graph. One length for every call keeps the graphs' shapes, so prompts of new lengths
  do not recompile.
* `CompileConfig(backend="dsfuse")` in Inductor's "reduce-overhead" mode with dsfuse's `cudagraphs="decode"`:
  the decode step (static shapes) replays as a CUDA graph, the chunk graphs (the first with a static length, the
  others with the length Dynamo marks dynamic after the first recompile) run without one: a prefill is
  GPU-bound, and recorded chunk graphs would hold their memory and be recorded again for each new tail length.

DeepSeek V4 (`DeepseekV4ForCausalLM`) has no static cache (its compressors keep state on HF's own cache layers).
For V4 the keyword arguments are a `dsfuse.v4_cache.V4DecodeCache` (HF's V4 cache with state of fixed shapes and
addresses, allocated by an eager one-token call: the prefill chunks compile to a few graphs, the decode step to one
that replays as a CUDA graph, recorded again every m' tokens when the heavily compressed layers gain an entry),
the same `prefill_chunk_size` (each chunk's queries against the cache's sliding window and compressed entries; the
`[B, 1, S, N]` mask `generate` builds for a chunk is read by the fused attention) and the same `CompileConfig`. A V4
chunk is a multiple of every compression rate and at least the sliding window: every chunk but the last then starts
on a window boundary with a full window of keys, the shapes the chunk graphs are compiled for.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

DEFAULT_PREFILL_CHUNK = 4096


def compile_options(options: Mapping[str, Any] | None = None) -> dict:
    """dsfuse options for generate: "reduce-overhead" with CUDA graphs for the decode steps only (the prefill chunks
    are GPU-bound, and a recorded chunk graph would hold its memory and be recorded again for each new tail
    length); `options` adds to them or overrides them (`disable`, `inductor`, ...)."""
    return {"mode": "reduce-overhead", "cudagraphs": "decode", **dict(options or {})}


def compile_config(options: Mapping[str, Any] | None = None, compile_all_devices: bool = False):
    """A transformers `CompileConfig` for dsfuse. The mode travels inside `options` (torch.compile refuses `mode=`
    together with `options=`). `compile_all_devices` also compiles on CPU (tests)."""
    from transformers import CompileConfig

    config = CompileConfig(backend="dsfuse", mode=None, options=compile_options(options))
    if compile_all_devices:
        config._compile_all_devices = True
    return config


def static_cache(model, batch_size: int, max_cache_len: int):
    """HF's `StaticCache` for `model`, its buffers already allocated (and marked static) and zeroed.

    transformers allocates a static cache lazily at the first update, and pre-allocates it only where keys and
    values share one head size (not for MLA's latent cache). A one-token eager step lets every layer allocate its
    own buffers, shapes and dtypes as the model defines them, and `reset()` zeroes them in place.
    """
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    token = torch.zeros((batch_size, 1), dtype=torch.long, device=model.device)
    with torch.no_grad():
        model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
    cache.reset()
    return cache


def is_v4(model) -> bool:
    """Whether `model` is a DeepSeek V4 (`DeepseekV4ForCausalLM`), which gets `v4_generate_kwargs`."""
    return getattr(model.config, "model_type", None) == "deepseek_v4"


def v4_prefill_chunk(config, prefill_chunk_size: int | None) -> int | None:
    """`prefill_chunk_size` if it is a multiple of every compression rate of a V4 `config` and at least its sliding
    window, else a ValueError naming the nearest chunk that is. Other chunks give the same tokens (the cache is
    exact for any split) but more graphs: a chunk that ends inside a window leaves the next one a new pending
    count, and chunks shorter than the window grow its keys from chunk to chunk, whose mask the fused attention
    can then not match to its rows. None is transformers' own prefill: eager, in one call."""
    if prefill_chunk_size is None:
        return None
    step = math.lcm(*config.compress_rates.values())
    if prefill_chunk_size % step or prefill_chunk_size < config.sliding_window:
        good = max(-(-prefill_chunk_size // step), -(-config.sliding_window // step)) * step
        raise ValueError(f"a V4 prefill_chunk_size is a multiple of {step} (the compression rates "
                         f"{sorted(config.compress_rates.values())}) and at least the sliding window "
                         f"{config.sliding_window}; got {prefill_chunk_size}, try {good}")
    return prefill_chunk_size


def v4_generate_kwargs(model, batch_size: int, max_cache_len: int, cache=None,
                       prefill_chunk_size: int | None = DEFAULT_PREFILL_CHUNK,
                       options: Mapping[str, Any] | None = None, compile_all_devices: bool = False) -> dict:
    """V4's keyword arguments: a `V4DecodeCache` of `max_cache_len` positions, its buffers allocated for
    `batch_size` (reset when reused), the prompt prefilled in chunks of `prefill_chunk_size` (`v4_prefill_chunk`)
    and decoded through the same compiled call, the decode step as a CUDA graph (`compile_config`)."""
    from dsfuse.v4_cache import V4DecodeCache

    chunk = v4_prefill_chunk(model.config, prefill_chunk_size)
    if cache is None:
        cache = V4DecodeCache(model.config, max_cache_len).allocate(model, batch_size)
    elif not isinstance(cache, V4DecodeCache) or cache.max_cache_len != max_cache_len:
        raise ValueError(f"cache {type(cache).__name__} does not hold {max_cache_len} positions of a V4DecodeCache")
    elif cache.allocated_batch != batch_size:
        cache.allocate(model, batch_size)
    else:
        cache.reset()
    return {"cache": cache, "prefill_chunk_size": chunk, "compile_config": compile_config(options, compile_all_devices)}


def generate_kwargs(model, batch_size: int, max_cache_len: int, cache=None,
                    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK, options: Mapping[str, Any] | None = None,
                    compile_all_devices: bool = False) -> dict:
    """Keyword arguments for `model.generate` that run the prefill (in chunks) and the decode steps through dsfuse.

    `max_cache_len` is the longest prompt plus new tokens any call will use: keep it the same across calls (a new
    length recompiles). Pass the `cache` of an earlier call to reuse its buffers (it is reset here): the decode CUDA
    graph then replays at the same addresses instead of being recorded again. A DeepSeek V4 model gets
    `v4_generate_kwargs` (a `V4DecodeCache`; its prefill chunks and decode steps compiled by dsfuse alike).
    """
    if is_v4(model):
        return v4_generate_kwargs(model, batch_size, max_cache_len, cache=cache,
                                  prefill_chunk_size=prefill_chunk_size, options=options,
                                  compile_all_devices=compile_all_devices)
    if cache is None:
        cache = static_cache(model, batch_size, max_cache_len)
    else:
        layer = cache.layers[0]
        if (layer.batch_size, layer.max_cache_len) != (batch_size, max_cache_len):
            raise ValueError(f"cache holds batch {layer.batch_size} x {layer.max_cache_len} positions, "
                             f"asked for {batch_size} x {max_cache_len}")
        cache.reset()
    return {"cache": cache, "prefill_chunk_size": prefill_chunk_size,
            "compile_config": compile_config(options, compile_all_devices)}
