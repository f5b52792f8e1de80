"""Fuzz `compressed_attention`: the op and its reference against a per-query float64 computation of the same
definition, fully masked rows (the sink takes all the mass: 0), -1 index entries, positions of padding (-1), and
indices out of range (a clear ValueError); then both Triton paths (fused, and split into a scores and a p.v kernel
over D chunks; the interpreter on CPU) against the reference on the position layouts they are specified for (left
padding, then increasing positions)."""

import pytest
import torch
from fuzz_support import DEVICE, SPECIALS, fuzzes, seeds, sizes, values
from hypothesis import given
from hypothesis import strategies as st

from dsfuse.kernels.compressed_attention import (compressed_attention, compressed_attention_reference,
                                                compressed_attention_triton)


def _on_device(*args):
    """The op's arguments on the device the suite runs on (its kernel path on CUDA, the interpreter on CPU)."""
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _per_query(q, kv, q_pos, kv_pos, compressed, indices, sinks, scale, window, rate):
    """One query at a time in float64: the visible keys' logits plus the sink, softmax, the weighted keys."""
    B, S, H, D = q.shape
    out = torch.zeros(B, S, H, D, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            rows = [kv[b, n] for n in range(kv.shape[1])
                    if kv_pos[b, n] >= 0 and 0 <= q_pos[b, s] - kv_pos[b, n] < window]
            if compressed is not None:
                if indices is None:
                    picked = range(min(compressed.shape[1], int(q_pos[b, s] + 1) // rate))
                else:
                    picked = sorted({int(i) for i in indices[b, s] if i >= 0})
                rows += [compressed[b, t] for t in picked]
            if not rows:
                continue
            keys = torch.stack(rows).double()
            for h in range(H):
                logits = torch.cat([keys @ q[b, s, h].double() * scale, sinks[h:h + 1].double()])
                out[b, s, h] = torch.softmax(logits, 0)[:-1] @ keys
    return out


def _rope_tables(data, g, B, S, D):
    """cos / sin [B, S, R] of random angles for the inverse RoPE epilogue, R drawn up to D / 2."""
    angle = torch.randn(B, S, data.draw(st.integers(1, D // 2)), generator=g)
    return angle.cos(), angle.sin()


@fuzzes("dsfuse::compressed_attention")
@given(data=st.data(), form=st.sampled_from(["window", "csa", "hca"]), rope=st.booleans())
def test_compressed_attention_is_its_definition(data, form, rope):
    B, S, H, N = (data.draw(sizes(1, n)) for n in (2, 5, 3, 9))
    D = 2 * data.draw(sizes(1, 8))
    window, rate = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 4))
    dtype, seed = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), data.draw(seeds())
    g = torch.Generator().manual_seed(seed)
    q, kv = values((B, S, H, D), dtype, seed), values((B, N, D), dtype, seed + 1)
    q_pos = torch.randint(0, 12, (B, S), generator=g)
    kv_pos = torch.randint(-1, 12, (B, N), generator=g)  # -1: a padded slot
    sinks = torch.randn(H, generator=g)
    compressed = indices = None
    if form != "window":
        T = data.draw(sizes(1, 9))
        compressed = values((B, T, D), dtype, seed + 2)
        if form == "csa":
            indices = torch.randint(-1, T, (B, S, data.draw(sizes(1, 5))), generator=g)
    cos, sin = _rope_tables(data, g, B, S, D) if rope else (None, None)
    args = (q, kv, q_pos, kv_pos, compressed, indices, sinks, 0.3, window, rate, cos, sin)
    out = compressed_attention(*args)
    assert torch.equal(out, compressed_attention_reference(*args))
    assert out.shape == q.shape and out.dtype == dtype
    if not rope:
        want = _per_query(q, kv, q_pos, kv_pos, compressed, indices, sinks, 0.3, window, rate)
        torch.testing.assert_close(out.double(), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)
    if indices is not None:
        bad = indices.clone()
        bad[..., -1] = data.draw(st.sampled_from([-2, -100, compressed.shape[1], compressed.shape[1] + 5]))
        with pytest.raises(ValueError, match="indices must lie in"):
            compressed_attention(q, kv, q_pos, kv_pos, compressed, bad, sinks, 0.3, window, rate, cos, sin)


@fuzzes("dsfuse::compressed_attention")
@pytest.mark.parametrize("path", ["fused", "split"])
@given(data=st.data(), form=st.sampled_from(["window", "csa", "hca"]), rope=st.booleans())
def test_compressed_attention_triton_path_is_the_reference(path, data, form, rope):
    B, H, N = data.draw(sizes(1, 2)), data.draw(sizes(1, 3)), data.draw(sizes(1, 13))
    pad = data.draw(st.integers(0, N - 1))
    S = data.draw(st.integers(1, N - pad))
    D = 2 * data.draw(sizes(1, 17))  # up to 34: the split path's 16-wide D chunks, and a partial last one
    window, rate = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 4))
    dtype, seed = data.draw(st.sampled_from([torch.float32, torch.float16])), data.draw(seeds())
    g = torch.Generator().manual_seed(seed)
    # Keys get no NaN / Inf: the reference multiplies the zero weight of a key a query does not see with its
    # value (0 * Inf is NaN), the kernels do not read it (test_nonfinite_key_a_query_does_not_see_is_not_read).
    q_specials = data.draw(st.lists(st.sampled_from(SPECIALS), max_size=1))
    kv_specials = data.draw(st.lists(st.sampled_from(["zero", "tie"]), max_size=1))
    q, kv = values((B, S, H, D), dtype, seed, specials=q_specials), \
        values((B, N, D), dtype, seed + 1, specials=kv_specials)
    start = data.draw(st.integers(0, 5))
    kv_pos = torch.cat([torch.full((pad,), -1), torch.arange(start, start + N - pad)]).expand(B, N).contiguous()
    q_pos = kv_pos[:, N - S:].contiguous()  # the last S rows: a prefill (S = N - pad) or a few steps over a cache
    sinks = torch.randn(H, generator=g)
    compressed = indices = None
    if form != "window":
        T = data.draw(sizes(1, 9))
        compressed = values((B, T, D), dtype, seed + 2, specials=kv_specials)
        if form == "csa":
            k = data.draw(st.integers(1, T))
            picks = torch.stack([torch.randperm(T, generator=g)[:k] for _ in range(B * S)]).view(B, S, k)
            indices = torch.where(torch.rand(B, S, k, generator=g) < 0.2, -1, picks)  # distinct, as a top-k's
    cos, sin = _rope_tables(data, g, B, S, D) if rope else (None, None)
    args = _on_device(q, kv, q_pos, kv_pos, compressed, indices, sinks, 0.3, window, rate, cos, sin)
    launch = {"path": "fused"}
    if path == "split":
        launch = {"path": "split", "d_chunk": 16, "normalize": data.draw(st.sampled_from(["separate", "scores", "values"]))}
    got = compressed_attention_triton(*args, **launch)
    want = compressed_attention_reference(*args)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype] * 4, equal_nan=True)


@pytest.mark.parametrize("path", ["fused", "split"])
def test_nonfinite_key_a_query_does_not_see_is_not_read(path):
    """Documented difference (notes/compressed_attention.md, "Non-finite inputs"): the reference (HF's order)
    multiplies every key row with its weight, 0 for a row the query does not see, so a NaN / Inf there makes that
    output column NaN (0 * Inf is NaN); the kernels read the visible rows only and give the reference's answer with
    the unseen rows made finite.  CSA, window 1: the query at position 1 sees kv row 1 and compressed rows 2 and 0,
    not kv row 0 nor compressed rows 1 and 3."""
    g = torch.Generator().manual_seed(0)
    q, kv, compressed = (torch.randn(shape, generator=g).to(DEVICE) for shape in ((1, 1, 1, 6), (1, 2, 6), (1, 4, 6)))
    positions, sinks = torch.arange(2, device=DEVICE).view(1, 2), torch.randn(1, generator=g).to(DEVICE)
    indices = torch.tensor([[[2, 0]]], device=DEVICE)
    finite = (kv.clone(), compressed.clone())
    kv[0, 0, 2], kv[0, 0, 3], compressed[0, 1, 3], compressed[0, 3, 2] = float("nan"), float("inf"), float("inf"), \
        float("nan")
    args = (q, kv, positions[:, 1:], positions, compressed, indices, sinks, 0.3, 1, 1)
    want = compressed_attention_reference(*args)
    assert torch.equal(want.isnan().view(-1).cpu(), torch.tensor([False, False, True, True, False, False]))
    launch = {"path": "split", "d_chunk": 16} if path == "split" else {"path": "fused"}
    got = compressed_attention_triton(*args, **launch)
    want = compressed_attention_reference(q, finite[0], positions[:, 1:], positions, finite[1], *args[5:])
    torch.testing.assert_close(got, want, rtol=TOL[torch.float32], atol=TOL[torch.float32] * 4)
