"""A DeepSeek V4 cache that `torch.compile` decodes from with one graph for every step.

HF's V4 cache layers (`DeepseekV4CSACache`, `DeepseekV4HCACache`) grow by `torch.cat`, count their tokens and
compressed entries in Python ints, and hand the compressors a buffer of 0 .. m-1 pending tokens, so the decode
step's graph depends on where the step falls in a compression window: Dynamo guards on those ints, on the pending
buffer's size (sizes 0 and 1 are always specialised) and on the branches `chunk_kv.shape[1] > 0` that the model
takes on it, and recompiles at most steps. `V4DecodeCache` is the same cache for the prefill (multi-token calls
run HF's own layer methods) and keeps, for one-token calls, every step's shapes the same:

* the pending window is a fixed `[B, m, C]` buffer written at slot `(t - 1) % m`; its unfilled slots are handed
  to the compressor with a gate of -inf (softmax weight 0, as HF's own padding of the first window), so the
  compressor pools one entry every step, the entry of the window in progress;
* compressed entries live in a `[B, max_cache_len // m, D]` buffer; the step writes its entry at slot
  `(t - 1) // m` and the compressor sees the first `t // m` entries (the finished windows, what HF keeps), a
  view whose length is a symbol;
* the CSA overlap state (the previous window's first series) is a two-window ring, written every step;
* the token count `t` is the size of an empty `[0, t]` tensor, marked dynamic: Dynamo reads it as one symbol
  from the first compiled step on, where a Python int would be a constant guarded at every step.

Every buffer is written in place; the values the model reads are HF's (the pooled entry of a finished window is
computed from the same m tokens, prior series and gates). Decoding needs a prompt of at least the sliding window
for one graph (the window's keys stop growing there) and `max_cache_len` positions; a multi-token call after
one-token calls (a prefill into a cache that decoded) is refused: `reset()` first.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache


def _write(buffer: torch.Tensor, index, rows: torch.Tensor) -> None:
    """`buffer[:, index] = rows[:, 0]` for a symbolic `index`, as an indexed copy: a view at a symbolic offset would
    make Inductor guard on whether that offset is zero (a recompile when a window starts)."""
    buffer.index_copy_(1, torch.full((1,), index, dtype=torch.long, device=buffer.device), rows.to(buffer.dtype))


def _read(buffer: torch.Tensor, index) -> torch.Tensor:
    """`buffer[:, index]` for a symbolic `index` (see `_write`)."""
    return buffer.index_select(1, torch.full((1,), index, dtype=torch.long, device=buffer.device)).squeeze(1)


class _TokenCount:
    """The layer's token count as the size of an empty tensor (a symbol under Dynamo, not a guarded constant)."""

    is_compileable = True
    is_croppable = False
    _layer_type = None  # never registered in transformers' layer-type mappings

    def _init_count(self) -> None:
        self._count = torch.empty((0, 0))

    def tokens(self):
        return self._count.shape[1]

    def _advance(self, like: torch.Tensor, tokens: int) -> None:
        count = like.new_empty((0, self.tokens() + tokens))
        if not torch.compiler.is_compiling():
            torch._dynamo.maybe_mark_dynamic(count, 1)
        self._count = count

    def get_seq_length(self):
        return self.tokens()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        tokens = self.tokens()
        kv_offset = max(tokens - self.sliding_window + 1, 0)
        kv_length = (self.sliding_window - 1 if tokens >= self.sliding_window else tokens) + query_length
        return kv_length, kv_offset

    def _update_window(self, key_states: torch.Tensor) -> torch.Tensor:
        """The shared K=V sliding window: the last `sliding_window - 1` rows kept as a fresh tensor (the same strides
        after a prefill and after a step: a view of the prefill's rows would keep its strides, and Dynamo guards on
        them), the window plus the new rows returned for both keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, key_states)
        self._advance(key_states, key_states.shape[-2])
        full = torch.cat([self.keys, key_states], dim=-2)
        self.keys = self.values = full[:, :, -self.sliding_window + 1:].clone(memory_format=torch.contiguous_format)
        return full

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("V4DecodeCache cannot be cropped (V4's compressor state is not rewindable)")


class V4SlidingWindowLayer(_TokenCount, DynamicSlidingWindowLayer):
    """A V4 sliding-attention layer's cache: HF's sliding window, its token count a tensor size."""

    def __init__(self, sliding_window: int, **kwargs):
        DynamicSlidingWindowLayer.__init__(self, sliding_window=sliding_window)
        self._init_count()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        full = self._update_window(key_states)
        return full, full

    def reset(self) -> None:
        super().reset()
        self._init_count()


class _CompressedDecode(_TokenCount):
    """Fixed-shape compressor state for one-token calls (see the module docstring), filled from HF's state at the
    end of every multi-token call; the HF cache layer it is mixed into is set up first."""

    def __init__(self, config, max_cache_len: int, **kwargs):
        super().__init__(config)
        self._init_decode(max_cache_len)

    def _init_decode(self, max_cache_len: int) -> None:
        self._init_count()
        self.max_cache_len = max_cache_len
        self.max_entries = -(-max_cache_len // self.compress_rate)
        self._window_kv: dict[str, torch.Tensor] = {}
        self._window_gate: dict[str, torch.Tensor] = {}
        self._ring_kv: dict[str, torch.Tensor] = {}
        self._ring_gate: dict[str, torch.Tensor] = {}
        self._entries: dict[str, torch.Tensor] = {}
        self._decoding = False

    def _one_token(self, kv: torch.Tensor) -> bool:
        if kv.shape[1] == 1 and self._entries:
            return True
        if self._decoding:
            raise RuntimeError("V4DecodeCache: a multi-token call after one-token decode steps; reset() the cache "
                               "before a new prefill")
        return False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        full = self._update_window(key_states)
        return full, full

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        if not self._one_token(kv):
            return super().store_compression_weights(name, kv, gate)
        self._decoding = True
        position = self.tokens() - 1
        slot, window = position % self.compress_rate, position // self.compress_rate
        _write(self._window_kv[name], slot, kv)
        _write(self._window_gate[name], slot, gate)
        filled = torch.arange(self.compress_rate, device=kv.device) <= slot
        chunk_gate = self._window_gate[name].masked_fill(~filled.view(1, -1, 1), float("-inf"))
        return self._window_kv[name], chunk_gate, window * self.compress_rate

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        if chunk_kv.shape[1] != 1 or not self._decoding:
            return super().update_overlap_state(name, chunk_kv, chunk_gate, head_dim)
        window = (self.tokens() - 1) // self.compress_rate
        # This window's first series, written every step (final once the window is full); the previous window's
        # is the prior HF saved when that window closed.
        _write(self._ring_kv[name], window % 2, chunk_kv[:, -1:, :, :head_dim])
        _write(self._ring_gate[name], window % 2, chunk_gate[:, -1:, :, :head_dim])
        previous = (window + 1) % 2
        return _read(self._ring_kv[name], previous), _read(self._ring_gate[name], previous)

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        if self._decoding:
            window = (self.tokens() - 1) // self.compress_rate
            _write(self._entries[name], window, compressed)
            return self._entries[name][:, : self.tokens() // self.compress_rate]
        running = super().update_compressor_states(name, compressed)
        self._sync_decode_state(name, running)
        return running

    def _sync_decode_state(self, name: str, running: torch.Tensor) -> None:
        """Copy HF's state after a multi-token call into the fixed-shape buffers the one-token calls use."""
        pending_kv, pending_gate = self.buffer_kv[name], self.buffer_gate[name]
        batch, count = running.shape[0], running.shape[1]
        if count > self.max_entries:
            raise ValueError(f"V4DecodeCache holds {self.max_entries} compressed entries per layer "
                             f"(max_cache_len); the prompt made {count}")
        if name not in self._entries:
            width = pending_kv.shape[-1]
            self._entries[name] = running.new_zeros((batch, self.max_entries, running.shape[-1]))
            self._window_kv[name] = pending_kv.new_zeros((batch, self.compress_rate, width))
            self._window_gate[name] = pending_gate.new_zeros((batch, self.compress_rate, width))
            if hasattr(self, "overlap_kv"):
                series = width // 2
                self._ring_kv[name] = pending_kv.new_zeros((batch, 2, self.compress_rate, series))
                self._ring_gate[name] = torch.full((batch, 2, self.compress_rate, series), float("-inf"),
                                                   dtype=torch.float32, device=pending_gate.device)
        self._entries[name][:, :count].copy_(running)
        self._window_kv[name][:, : pending_kv.shape[1]].copy_(pending_kv)
        self._window_gate[name][:, : pending_gate.shape[1]].copy_(pending_gate)
        prior_kv, prior_gate = getattr(self, "overlap_kv", {}).get(name), getattr(self, "overlap_gate", {}).get(name)
        if prior_kv is not None:
            previous = (self.tokens() // self.compress_rate + 1) % 2  # the ring half of the last finished window
            self._ring_kv[name][:, previous].copy_(prior_kv)
            self._ring_gate[name][:, previous].copy_(prior_gate)

    def reset(self) -> None:
        """Back to an empty cache; the decode buffers are dropped (the next prefill allocates them for its batch)."""
        super().reset()
        self._init_decode(self.max_cache_len)


class V4HCALayer(_CompressedDecode, DeepseekV4HCACache):
    """An HCA layer's cache (window + heavily compressed entries) with fixed-shape decode state."""


class V4CSALayer(_CompressedDecode, DeepseekV4CSACache):
    """A CSA layer's cache (window + compressed entries + the indexer's own) with fixed-shape decode state."""


_LAYERS = {"compressed_sparse_attention": V4CSALayer, "heavily_compressed_attention": V4HCALayer}


class V4DecodeCache(DynamicCache):
    """HF's V4 cache with decode state of fixed shapes: `generate` compiles its decode step once (a compileable
    cache that is not a plain `DynamicCache` is what transformers' generate compiles the step for)."""

    def __init__(self, config, max_cache_len: int):
        super().__init__(config=config)
        layers = []
        for layer_type in config.layer_types:
            if layer_type in _LAYERS:
                layers.append(_LAYERS[layer_type](config, max_cache_len=max_cache_len))
            else:
                layers.append(V4SlidingWindowLayer(sliding_window=config.sliding_window))
        self.layers = layers
        self.max_cache_len = max_cache_len
