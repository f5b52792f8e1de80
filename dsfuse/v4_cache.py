"""A DeepSeek V4 cache that `torch.compile` prefills and decodes from with few graphs.

HF's V4 cache layers (`DeepseekV4CSACache`, `DeepseekV4HCACache`) grow by `torch.cat`, count their tokens and
compressed entries in Python ints, keep 0 .. m-1 pending tokens as a view of the last call's projections and hand
the CSA compressor the previous call's last window as a prior written into its window 0, so a compiled call's graph
depends on where the call falls in a compression window: Dynamo guards on those ints, on the pending buffer's size
(sizes 0 and 1 are always specialised) and strides and on the branches `chunk_kv.shape[1] > 0` that the model takes
on it, and recompiles at most decode steps and at most prefill chunks. `V4DecodeCache` is HF's cache (its sliding
window layer, HF's own) with the compressor state of fixed shapes, for every call:

* the projections of the last 2m tokens are a `[B, 2m, C]` stream buffer. A multi-token call (a prefill chunk)
  hands the compressor the last whole window before the call again, then the pending tokens and the call's own up
  to the last whole window, cut from `cat(stream, new)` at a symbolic offset: every chunk starts on a window
  boundary with a window to pool, the compressor reads each new window's first series (CSA) from the chunk
  itself, not from a prior written into window 0 (an in-place write the `compressors` pass does not fuse), and
  the repeated window's entry is dropped. Before the first call the stream is a window of zero projections gated
  -inf, which pools as HF's own zero / -inf padding of the first window;
* compressed entries live in a `[B, 1 + max_cache_len // m, D]` buffer, entry e at slot 1 + e (slot 0 takes the
  repeated window's entry); the compressor sees the first `t // m` entries (the finished windows, what HF keeps),
  a view whose length is a symbol;
* for one-token calls (decode steps) the window in progress is a fixed `[B, m, C]` buffer written at slot
  `(t - 1) % m`; its unfilled slots are handed to the compressor with a gate of -inf (softmax weight 0, as HF's
  padding of a first window), so the compressor pools one entry every step, the entry of the window in progress,
  written at its slot;
* the CSA overlap state (a window's first series, the next window's prior) is a two-window ring, written by every
  call;
* the token count `t` is the size of an empty `[0, t]` tensor, marked dynamic: Dynamo reads it as one symbol, where
  a Python int would be a constant guarded at every call.

Every buffer is written in place; the values the model reads are HF's (each entry is pooled from the same m or 2m
tokens, gates and position bias; chunked or not, the logits equal those of HF's cache fed the same chunks, bit for
bit). Decoding in one graph needs a prompt of at least the sliding window (the window's keys stop growing there)
and `max_cache_len` positions; a multi-token call after one-token calls (a prefill into a cache that decoded) is
refused: `reset()` first.
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


class _CompressedState(_TokenCount):
    """Fixed-shape compressor state for every call (see the module docstring); the HF cache layer it is mixed into is
    set up first: its sliding window is used, its own compressor state (pending buffer, running entries, counters)
    is not."""

    def __init__(self, config, max_cache_len: int, **kwargs):
        super().__init__(config)
        self._init_state(max_cache_len)

    def _init_state(self, max_cache_len: int) -> None:
        self._init_count()
        self.max_cache_len = max_cache_len
        self.max_entries = -(-max_cache_len // self.compress_rate)
        self._stream_kv: dict[str, torch.Tensor] = {}  # [B, 2m, C]: the projections of the last 2m tokens
        self._stream_gate: dict[str, torch.Tensor] = {}
        self._entries: dict[str, torch.Tensor] = {}  # [B, 1 + max_entries, D]: entry e at slot 1 + e
        self._window_kv: dict[str, torch.Tensor] = {}  # [B, m, C]: the window in progress, slot = position % m
        self._window_gate: dict[str, torch.Tensor] = {}
        self._ring_kv: dict[str, torch.Tensor] = {}  # CSA: [B, 2, m, C / 2], the first series of the last 2 windows
        self._ring_gate: dict[str, torch.Tensor] = {}
        self._decoding = False

    def _one_token(self, name: str, kv: torch.Tensor) -> bool:
        if kv.shape[1] == 1 and name in self._entries:
            return True
        if self._decoding:
            raise RuntimeError("V4DecodeCache: a multi-token call after one-token decode steps; reset() the cache "
                               "before a new prefill")
        return False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        full = self._update_window(key_states)
        return full, full

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        if not self._one_token(name, kv):
            return self._store_prefill(name, kv, gate)
        self._decoding = True
        position = self.tokens() - 1
        slot, window = position % self.compress_rate, position // self.compress_rate
        _write(self._window_kv[name], slot, kv)
        _write(self._window_gate[name], slot, gate)
        filled = torch.arange(self.compress_rate, device=kv.device) <= slot
        chunk_gate = self._window_gate[name].masked_fill(~filled.view(1, -1, 1), float("-inf"))
        return self._window_kv[name], chunk_gate, window * self.compress_rate

    def _store_prefill(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        """A multi-token call's chunk for the compressor: the last whole window before this call again, then the
        pending tokens and this call's up to the last whole window (see the module docstring)."""
        m = self.compress_rate
        if name not in self._stream_kv:
            self._allocate(name, kv, gate)
        before = self.tokens() - kv.shape[1]
        pending = before % m
        stream_kv = torch.cat([self._stream_kv[name], kv], dim=1)
        stream_gate = torch.cat([self._stream_gate[name], gate], dim=1)
        length = m + (pending + kv.shape[1]) // m * m
        chunk_kv, chunk_gate = stream_kv.narrow(1, m - pending, length), stream_gate.narrow(1, m - pending, length)
        self._stream_kv[name].copy_(stream_kv[:, -2 * m:])
        self._stream_gate[name].copy_(stream_gate[:, -2 * m:])
        # The decode steps' window: the pending tokens at their slots (the slots after them are gated off there)
        index = (torch.arange(m, device=kv.device) + (2 * m - self.tokens() % m)) % (2 * m)
        self._window_kv[name].copy_(self._stream_kv[name].index_select(1, index))
        self._window_gate[name].copy_(self._stream_gate[name].index_select(1, index))
        return chunk_kv, chunk_gate, (before // m - 1) * m

    def _allocate(self, name: str, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """The stream starts as a window of zero projections gated -inf: pooled as the first window's prior it is
        HF's own zero / -inf padding of a first call."""
        batch, width, m = kv.shape[0], kv.shape[-1], self.compress_rate
        self._stream_kv[name] = kv.new_zeros((batch, 2 * m, width))
        self._stream_gate[name] = gate.new_full((batch, 2 * m, width), float("-inf"))
        self._window_kv[name] = kv.new_zeros((batch, m, width))
        self._window_gate[name] = gate.new_zeros((batch, m, width))
        if hasattr(self, "overlap_kv"):
            self._ring_kv[name] = kv.new_zeros((batch, 2, m, width // 2))
            self._ring_gate[name] = torch.full((batch, 2, m, width // 2), float("-inf"), dtype=torch.float32,
                                               device=gate.device)

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        if self._decoding:
            window = (self.tokens() - 1) // self.compress_rate
            # This window's first series, written every step (final once the window is full); the previous
            # window's is the prior written when that window closed.
            _write(self._ring_kv[name], window % 2, chunk_kv[:, -1:, :, :head_dim])
            _write(self._ring_gate[name], window % 2, chunk_gate[:, -1:, :, :head_dim])
            previous = (window + 1) % 2
            return _read(self._ring_kv[name], previous), _read(self._ring_gate[name], previous)
        # A multi-token chunk starts with its own prior window, so none is handed back; its last window (the last
        # whole one) is the prior of the window in progress, read by the decode steps.
        previous = (self.tokens() // self.compress_rate + 1) % 2
        _write(self._ring_kv[name], previous, chunk_kv[:, -1:, :, :head_dim])
        _write(self._ring_gate[name], previous, chunk_gate[:, -1:, :, :head_dim])
        return None, None

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        m, count = self.compress_rate, self.tokens() // self.compress_rate
        if self._decoding:
            _write(self._entries[name], (self.tokens() - 1) // m + 1, compressed)
            return self._entries[name][:, 1: 1 + count]
        if count > self.max_entries:
            raise ValueError(f"V4DecodeCache holds {self.max_entries} compressed entries per layer "
                             f"(max_cache_len); the prompt made {count}")
        if name not in self._entries:
            self._entries[name] = compressed.new_zeros((compressed.shape[0], 1 + self.max_entries,
                                                        compressed.shape[-1]))
        # The chunk's first entry (its repeated window, already kept) goes to slot 0, the new ones after the kept
        windows = compressed.shape[1]
        index = torch.arange(windows, device=compressed.device)
        self._entries[name].index_copy_(1, torch.where(index == 0, 0, index + (count + 1 - windows)), compressed)
        return self._entries[name][:, 1: 1 + count]

    def reset(self) -> None:
        """Back to an empty cache; the buffers are dropped (the next prefill allocates them for its batch)."""
        super().reset()
        self._init_state(self.max_cache_len)


class V4HCALayer(_CompressedState, DeepseekV4HCACache):
    """An HCA layer's cache (window + heavily compressed entries) with fixed-shape compressor state."""


class V4CSALayer(_CompressedState, DeepseekV4CSACache):
    """A CSA layer's cache (window + compressed entries + the indexer's own) with fixed-shape compressor state."""


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
