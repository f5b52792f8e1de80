"""A DeepSeek V4 cache that `torch.compile` prefills with few graphs and decodes as one CUDA graph.

HF's V4 cache layers (`DeepseekV4CSACache`, `DeepseekV4HCACache`) grow by `torch.cat`, count their tokens and
compressed entries in Python ints, keep 0 .. m-1 pending tokens as a view of the last call's projections and hand
the CSA compressor the previous call's last window as a prior written into its window 0, so a compiled call's graph
depends on where the call falls in a compression window: Dynamo guards on those ints, on the pending buffer's size
(sizes 0 and 1 are always specialised) and strides and on the branches `chunk_kv.shape[1] > 0` that the model takes
on it, and recompiles at most decode steps and at most prefill chunks. `V4DecodeCache` is HF's cache with state of
fixed shapes and fixed addresses:

* the token count is kept twice: as the size of an empty `[0, t]` tensor (marked dynamic: one symbol for a prefill
  chunk's graph, where a Python int would be a constant guarded at every call) and as a `[1]` device tensor that a
  decode step advances on the device. A decode step's graph reads only the device count, so nothing in it changes
  from step to step and it can replay as a CUDA graph; the host reads the device count back (one `.item()`) when
  it next asks for the length, which `generate` does before every step (`get_mask_sizes`). A caller that builds the
  mask inside the compiled call reads the count there: that step's graph then keeps it as its symbol;
* the sliding window's last `sliding_window - 1` rows live in one buffer written in place; a decode step reads a
  window of fixed length, filled from the front while it is not full (see `_Window`);
* the projections of the last 2m tokens are a `[B, 2m, C]` stream buffer. A multi-token call (a prefill chunk)
  hands the compressor the last whole window before the call again, then the pending tokens and the call's own up
  to the last whole window, cut from `cat(stream, new)` at a symbolic offset: every chunk starts on a window
  boundary with a window to pool, the compressor reads each new window's first series (CSA) from the chunk
  itself, not from a prior written into window 0 (an in-place write the `compressors` pass does not fuse), and
  the repeated window's entry is dropped. Before the first call the stream is a window of zero projections gated
  -inf, which pools as HF's own zero / -inf padding of the first window;
* compressed entries live in a `[B, 1 + max_cache_len // m, D]` buffer, entry e at slot 1 + e (slot 0 takes the
  repeated window's entry). A prefill chunk's compressor sees the first `t // m` entries (the finished windows,
  what HF keeps). A decode step's CSA layer sees all slots: its indexer masks every entry at or past
  `(position + 1) // m` and picks among the rest, so the unfinished ones are never attended. HCA attends to every
  entry it is handed at one query, so its decode step sees the first `t // m'`, a length the host prepares before
  the step as the size of an empty tensor (a new CUDA graph every m' tokens);
* for one-token calls (decode steps) the window in progress is a fixed `[B, m, C]` buffer written at slot
  `(t - 1) % m`; its unfilled slots are handed to the compressor with a gate of -inf (softmax weight 0, as HF's
  padding of a first window), so the compressor pools one entry every step, the entry of the window in progress,
  written at its slot;
* the CSA overlap state (a window's first series, the next window's prior) is a two-window ring, written by every
  call.

Every buffer is written in place and marked as a static address (`allocate` fills them with an eager one-token
call before anything is compiled; `reset` zeroes them). The values the model reads are HF's: each entry is pooled
from the same m or 2m tokens, gates and position bias; a prefill, chunked or not, gives the logits of HF's cache fed
the same chunks, bit for bit, and a decode step the same up to the order of the zeros a CSA step adds to its sums.
Decoding in one graph needs `max_cache_len` positions and, at first, HCA entries (a view of 0 or 1 entries is a
specialised length: the steps before the second entry compile a graph each); a multi-token call after one-token
calls (a prefill into a cache that decoded) is refused: `reset()` first.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache

def _index(index, device: torch.device) -> torch.Tensor:
    if isinstance(index, torch.Tensor):
        return index.reshape(1)
    return torch.full((1,), index, dtype=torch.long, device=device)


def _write(buffer: torch.Tensor, index, rows: torch.Tensor) -> None:
    """`buffer[:, index] = rows[:, 0]` for a symbolic or device `index`, as an indexed copy: a view at a symbolic
    offset would make Inductor guard on whether that offset is zero (a recompile when a window starts)."""
    buffer.index_copy_(1, _index(index, buffer.device), rows.to(buffer.dtype))


def _read(buffer: torch.Tensor, index) -> torch.Tensor:
    """`buffer[:, index]` for a symbolic or device `index` (see `_write`)."""
    return buffer.index_select(1, _index(index, buffer.device)).squeeze(1)


def _static(buffer: torch.Tensor) -> torch.Tensor:
    """A buffer a decode step's CUDA graph reads and writes in place: marked as a static address (allocated
    eagerly; one allocated inside a compiled call stays an ordinary tensor, and the step is then not captured)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(buffer)
    return buffer


def _size_carrier(like: torch.Tensor, size: int) -> torch.Tensor:
    """An empty `[0, size]` tensor whose size Dynamo reads as a symbol rather than a guarded constant (floating
    point: the backend reads a graph's 2-D integer inputs as its tokens)."""
    carrier = torch.empty((0, size), device=like.device)
    if not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(carrier, 1)
    return carrier


@torch.compiler.disable
def _read_back(clock: "_Clock") -> None:
    """The host's count from the device's, after decode steps that advanced only the device's. Never traced: a
    compiled call that gets here (a caller that read no length since the last step) breaks its graph to run it."""
    clock.count = _size_carrier(clock.position, int(clock.position.item()))
    clock.counted = True


@torch.compiler.disable
def _prepare_outside(clock: "_Clock") -> None:
    """`_Clock._prepare` for the current count, never traced (see `_read_back`)."""
    clock._prepare(clock.tokens())


class _Clock:
    """The cache's token count, shared by its layers and advanced once a call (by the first layer's update)."""

    def __init__(self, rates: tuple[int, ...], max_cache_len: int):
        self.rates = rates
        self.max_cache_len = max_cache_len
        self.position: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        self.count = torch.empty((0, 0))  # [0, t]: the host's count
        if self.position is not None:
            self.position.zero_()
        self.counted = True  # False after a decode step: `count` lags `position` until the host reads it back
        self.ready = False  # `visible` holds the lengths of the next one-token step
        self.started = False  # a call since the last reset
        self.decoding = False  # the calls since the first prefill have been one-token steps
        self.read_in_call = False  # the compiled call being traced read the count (its mask is built inside)
        self.visible: dict[int, torch.Tensor] = {}

    def tokens(self) -> int:
        if not self.counted:
            _read_back(self)
        return self.count.shape[1]

    def host_tokens(self) -> int:
        """The token count for the mask and `generate`. Outside a compiled region this also prepares the next
        one-token step's lengths; inside one (a caller that builds the mask in the compiled call) the step then
        keeps the count in its graph, as a symbol."""
        tokens = self.tokens()
        if torch.compiler.is_compiling():
            self.read_in_call = True
        elif self.position is not None and tokens < self.max_cache_len:
            self._prepare(tokens)
        return tokens

    def _prepare(self, tokens: int) -> None:
        if tokens + 1 > self.max_cache_len:
            raise ValueError(f"V4DecodeCache holds {self.max_cache_len} positions (max_cache_len); the next step "
                             f"would be position {tokens + 1}")
        sizes = {m: (tokens + 1) // m for m in self.rates}
        # traced (a count read inside the call): always new carriers, no guard on the old ones
        if torch.compiler.is_compiling() or any(m not in self.visible or self.visible[m].shape[1] != size
                                                for m, size in sizes.items()):
            self.visible = {m: _size_carrier(self.position, size) for m, size in sizes.items()}
        self.ready = True

    def begin_call(self, key_states: torch.Tensor) -> None:
        """Advance the count by the call's tokens: on the device only for a decode step, on both for a prefill."""
        tokens = key_states.shape[-2]
        if self.position is None or self.position.device != key_states.device:
            self.position = _static(torch.zeros(1, dtype=torch.long, device=key_states.device))
        read_in_call, self.read_in_call = self.read_in_call, False
        if tokens == 1 and self.started:
            if read_in_call:  # the count is a symbol of this graph: the lengths follow from it, and it stays current
                self._prepare(self.tokens())
                self.count = _size_carrier(key_states, self.count.shape[1] + 1)
            else:
                if not self.ready:
                    _prepare_outside(self)
                self.counted = False
            self.position.add_(1)
            self.decoding, self.ready = True, False
            return
        if self.decoding:
            raise RuntimeError("V4DecodeCache: a multi-token call after one-token decode steps; reset() the cache "
                               "before a new prefill")
        self.count = _size_carrier(key_states, self.tokens() + tokens)
        self.position.fill_(self.count.shape[1])
        self.started, self.ready = True, False


class _Window:
    """A V4 layer's shared K=V sliding window, its last `sliding_window - 1` rows in one buffer written in place.

    A prefill call sees HF's window: the rows so far (at most `sliding_window - 1`) and its own. A decode step sees a
    window of fixed length whatever the count: the buffer's rows and its own, its row at its position while fewer
    rows than the window have been seen (the buffer fills from the front, like a static cache's; `get_mask_sizes`
    then gives the window's full length at offset 0, so the rows past the position are masked as the future)."""

    is_compileable = True
    is_croppable = False
    _layer_type = None  # never registered in transformers' layer-type mappings

    def _init_window(self, clock: _Clock) -> None:
        self._clock = clock
        self._window: torch.Tensor | None = None

    def tokens(self) -> int:
        return self._clock.tokens()

    def _update_window(self, key_states: torch.Tensor) -> torch.Tensor:
        rows = self.sliding_window - 1
        if self._window is None or self._window.shape[0] != key_states.shape[0]:
            batch, heads, _, width = key_states.shape
            self._window = _static(key_states.new_zeros((batch, heads, rows, width)))
            self.keys = self.values = key_states.new_zeros((batch, heads, 0, width))
            self.device, self.is_initialized = key_states.device, True
        if self._clock.decoding:
            position = self._clock.position - 1
            full = torch.cat([self._window, key_states], dim=-2)
            full.index_copy_(2, position.clamp(max=rows), key_states)
            self._window.copy_(torch.where((position >= rows).view(1, 1, 1, 1), full[:, :, 1:], full[:, :, :-1]))
            self.keys = self.values = self._window
            return full
        full = torch.cat([self.keys, key_states], dim=-2)
        if full.shape[-2] >= rows:
            self._window.copy_(full[:, :, -rows:])
            self.keys = self.values = self._window
        else:
            self._window.copy_(torch.nn.functional.pad(full, (0, 0, 0, rows - full.shape[-2])))
            self.keys = self.values = full.clone(memory_format=torch.contiguous_format)
        return full

    def _reset_window(self) -> None:
        if self._window is not None:
            self._window.zero_()
            self.keys = self.values = self._window[:, :, :0].clone()

    def get_seq_length(self):
        return self._clock.host_tokens()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        tokens = self._clock.host_tokens()
        kv_offset = max(tokens - self.sliding_window + 1, 0)
        if query_length == 1 and self._clock.started:  # a decode step: the window's full length (class docstring)
            return self.sliding_window, kv_offset
        kv_length = (self.sliding_window - 1 if tokens >= self.sliding_window else tokens) + query_length
        return kv_length, kv_offset

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("V4DecodeCache cannot be cropped (V4's compressor state is not rewindable)")


class V4SlidingWindowLayer(_Window, DynamicSlidingWindowLayer):
    """A V4 sliding-attention layer's cache: HF's sliding window in one buffer."""

    def __init__(self, sliding_window: int, clock: _Clock, **kwargs):
        DynamicSlidingWindowLayer.__init__(self, sliding_window=sliding_window)
        self._init_window(clock)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        full = self._update_window(key_states)
        return full, full

    def reset(self) -> None:
        self._reset_window()


class _CompressedState(_Window):
    """Fixed-shape compressor state for every call (see the module docstring); the HF cache layer it is mixed into is
    set up first: its sliding window is used, its own compressor state (pending buffer, running entries, counters)
    is not."""

    sees_every_slot_at_decode = False

    def __init__(self, config, max_cache_len: int, clock: _Clock, **kwargs):
        super().__init__(config)
        self._init_window(clock)
        self.max_cache_len = max_cache_len
        self.max_entries = -(-max_cache_len // self.compress_rate)
        self._stream_kv: dict[str, torch.Tensor] = {}  # [B, 2m, C]: the projections of the last 2m tokens
        self._stream_gate: dict[str, torch.Tensor] = {}
        self._entries: dict[str, torch.Tensor] = {}  # [B, 1 + max_entries, D]: entry e at slot 1 + e
        self._window_kv: dict[str, torch.Tensor] = {}  # [B, m, C]: the window in progress, slot = position % m
        self._window_gate: dict[str, torch.Tensor] = {}
        self._ring_kv: dict[str, torch.Tensor] = {}  # CSA: [B, 2, m, C / 2], the first series of the last 2 windows
        self._ring_gate: dict[str, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        full = self._update_window(key_states)
        return full, full

    def _position(self) -> torch.Tensor:
        """This decode step's position, on the device."""
        return self._clock.position - 1

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        if not self._clock.decoding:
            return self._store_prefill(name, kv, gate)
        position = self._position()
        slot = position % self.compress_rate
        _write(self._window_kv[name], slot, kv)
        _write(self._window_gate[name], slot, gate)
        filled = torch.arange(self.compress_rate, device=kv.device) <= slot
        chunk_gate = self._window_gate[name].masked_fill(~filled.view(1, -1, 1), float("-inf"))
        return self._window_kv[name], chunk_gate, position - slot

    def _store_prefill(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        """A multi-token call's chunk for the compressor: the last whole window before this call again, then the
        pending tokens and this call's up to the last whole window (see the module docstring)."""
        m = self.compress_rate
        if name not in self._stream_kv or self._stream_kv[name].shape[0] != kv.shape[0]:
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
        batch, width, m = kv.shape[0], kv.shape[-1], self.compress_rate
        self._stream_kv[name] = _static(kv.new_empty((batch, 2 * m, width)))
        self._stream_gate[name] = _static(gate.new_empty((batch, 2 * m, width)))
        self._window_kv[name] = _static(kv.new_empty((batch, m, width)))
        self._window_gate[name] = _static(gate.new_empty((batch, m, width)))
        if hasattr(self, "overlap_kv"):
            self._ring_kv[name] = _static(kv.new_empty((batch, 2, m, width // 2)))
            self._ring_gate[name] = _static(torch.empty((batch, 2, m, width // 2), dtype=torch.float32,
                                                        device=gate.device))
        self._entries.pop(name, None)
        self._clear(name)

    def _clear(self, name: str) -> None:
        """The state before any call. The stream starts as a window of zero projections gated -inf: pooled as the
        first window's prior it is HF's own zero / -inf padding of a first call."""
        self._stream_kv[name].zero_()
        self._stream_gate[name].fill_(float("-inf"))
        self._window_kv[name].zero_()
        self._window_gate[name].zero_()
        if name in self._ring_kv:
            self._ring_kv[name].zero_()
            self._ring_gate[name].fill_(float("-inf"))
        if name in self._entries:
            self._entries[name].zero_()

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        if self._clock.decoding:
            window = self._position() // self.compress_rate
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
        m = self.compress_rate
        if self._clock.decoding:
            _write(self._entries[name], self._position() // m + 1, compressed)
            if self.sees_every_slot_at_decode:
                return self._entries[name][:, 1:]
            return self._entries[name][:, 1: 1 + self._clock.visible[m].shape[1]]
        count = self.tokens() // m
        if count > self.max_entries:
            raise ValueError(f"V4DecodeCache holds {self.max_entries} compressed entries per layer "
                             f"(max_cache_len); the prompt made {count}")
        if name not in self._entries or self._entries[name].shape[0] != compressed.shape[0]:
            self._entries[name] = _static(compressed.new_zeros((compressed.shape[0], 1 + self.max_entries,
                                                                compressed.shape[-1])))
        # The chunk's first entry (its repeated window, already kept) goes to slot 0, the new ones after the kept
        windows = compressed.shape[1]
        index = torch.arange(windows, device=compressed.device)
        self._entries[name].index_copy_(1, torch.where(index == 0, 0, index + (count + 1 - windows)), compressed)
        return self._entries[name][:, 1: 1 + count]

    def reset(self) -> None:
        """Back to an empty cache, every buffer zeroed in place (same addresses: a recorded decode step replays)."""
        self._reset_window()
        for name in self._stream_kv:
            self._clear(name)


class V4HCALayer(_CompressedState, DeepseekV4HCACache):
    """An HCA layer's cache (window + heavily compressed entries) with fixed-shape compressor state."""


class V4CSALayer(_CompressedState, DeepseekV4CSACache):
    """A CSA layer's cache (window + compressed entries + the indexer's own) with fixed-shape compressor state."""

    sees_every_slot_at_decode = True


_LAYERS = {"compressed_sparse_attention": V4CSALayer, "heavily_compressed_attention": V4HCALayer}


class V4DecodeCache(DynamicCache):
    """HF's V4 cache with state of fixed shapes and addresses: `generate` compiles its decode step once, and the step
    replays as a CUDA graph (a compileable cache that is not a plain `DynamicCache` is what transformers' generate
    compiles the step for)."""

    def __init__(self, config, max_cache_len: int):
        super().__init__(config=config)
        self.clock = _Clock((config.compress_rates["heavily_compressed_attention"],), max_cache_len)
        layers = []
        for layer_type in config.layer_types:
            if layer_type in _LAYERS:
                layers.append(_LAYERS[layer_type](config, max_cache_len=max_cache_len, clock=self.clock))
            else:
                layers.append(V4SlidingWindowLayer(sliding_window=config.sliding_window, clock=self.clock))
        self.layers = layers
        self.max_cache_len = max_cache_len
        self.allocated_batch: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self.clock.begin_call(key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.clock.reset()

    def allocate(self, model, batch_size: int) -> "V4DecodeCache":
        """Allocate every buffer for `batch_size` with an eager one-token call of `model` (the shapes and dtypes its
        layers give them), then `reset()`: allocated outside any compiled call, they are static addresses, which
        a decode step's CUDA graph needs for the buffers it writes."""
        self.reset()
        token = torch.zeros((batch_size, 1), dtype=torch.long, device=model.device)
        self.allocated_batch = batch_size
        with torch.no_grad():
            model(input_ids=token, cache=self, use_cache=True, logits_to_keep=1)
        self.reset()
        return self
