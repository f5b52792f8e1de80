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
For V4 the keyword arguments are a `dsfuse.v4_cache.V4DecodeCache` (HF's V4 cache with decode state of fixed
shapes, so the decode step compiles once for every step) and a `CompileConfig(backend="dsfuse")` without CUDA
graphs (the compressed entries the step reads grow by one every m tokens, a new shape each time); the prefill runs
eagerly (`prefill_chunk_size=None`).
"""

from __future__ import annotations

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


def v4_compile_config(options: Mapping[str, Any] | None = None, compile_all_devices: bool = False):
    """`CompileConfig(backend="dsfuse")` for V4's decode step: no CUDA graphs (the step's compressed entries grow)."""
    from transformers import CompileConfig

    config = CompileConfig(backend="dsfuse", mode=None, options=dict(options) if options else None)
    if compile_all_devices:
        config._compile_all_devices = True
    return config


def v4_generate_kwargs(model, batch_size: int, max_cache_len: int, cache=None,
                       options: Mapping[str, Any] | None = None, compile_all_devices: bool = False) -> dict:
    """V4's keyword arguments: a `V4DecodeCache` of `max_cache_len` positions (reset when reused; its buffers take
    the batch size of the prefill), the eager prefill, the decode step compiled by dsfuse once for every step."""
    from dsfuse.v4_cache import V4DecodeCache

    if cache is None:
        cache = V4DecodeCache(model.config, max_cache_len)
    elif not isinstance(cache, V4DecodeCache) or cache.max_cache_len != max_cache_len:
        raise ValueError(f"cache {type(cache).__name__} does not hold {max_cache_len} positions of a V4DecodeCache")
    else:
        cache.reset()
    return {"cache": cache, "compile_config": v4_compile_config(options, compile_all_devices)}


def generate_kwargs(model, batch_size: int, max_cache_len: int, cache=None,
                    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK, options: Mapping[str, Any] | None = None,
                    compile_all_devices: bool = False) -> dict:
    """Keyword arguments for `model.generate` that run the prefill (in chunks) and the decode steps through dsfuse.

    `max_cache_len` is the longest prompt plus new tokens any call will use: keep it the same across calls (a new
    length recompiles). Pass the `cache` of an earlier call to reuse its buffers (it is reset here): the decode CUDA
    graph then replays at the same addresses instead of being recorded again. A DeepSeek V4 model gets
    `v4_generate_kwargs` (`prefill_chunk_size` does not apply: its prefill runs eagerly).
    """
    if is_v4(model):
        return v4_generate_kwargs(model, batch_size, max_cache_len, cache=cache, options=options,
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
