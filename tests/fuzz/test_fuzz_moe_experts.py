"""Fuzz the routed-experts ops: the Triton paths (interpreter on CPU) against the references, with expert ids of
other ranks (expert parallel: they add nothing and are never read), repeated experts, one-hot routing, NaN / +-Inf
/ zeros / ties in the tokens and NaN / +-Inf router weights, and negative ids (a clear error on the reference path)."""

import pytest
import torch
from fuzz_support import DEVICE, SPECIALS, assert_rel_close, fuzzes, guarded, reference_output, seeds, sizes, values
from hypothesis import given
from hypothesis import strategies as st

from dsfuse.kernels import moe_experts as moe
from dsfuse.models.official import quantize_fp4

HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong


@st.composite
def routing(draw):
    T, k = draw(sizes(1, 17)), draw(sizes(1, 5))
    experts, offset = draw(st.integers(1, 5)), draw(st.sampled_from([0, 2]))
    seed = draw(seeds())
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts + offset + 3, (T, k), generator=g)  # ids below offset or past it: other ranks
    if draw(st.booleans()):
        ids[:, :] = ids[:1, :1]  # one expert for every slot
    weights = torch.rand(T, k, generator=g)
    special = draw(st.sampled_from([None, "nan", "inf", "-inf"]))
    if special is not None:
        weights.view(-1)[torch.randint(0, T * k, (1,), generator=g)] = float(special)
    return T, k, experts, offset, seed, ids, weights


def guarded_stack(stack: torch.Tensor, stored_kn: bool) -> torch.Tensor:
    """The stack inside a NaN band, stored `[E, K, N]` (the op gets the transposed view) when `stored_kn`."""
    return guarded(stack.transpose(1, 2).contiguous()).transpose(1, 2) if stored_kn else guarded(stack)


@fuzzes("dsfuse::moe_experts_bf16")
@given(case=routing(), hidden=st.sampled_from([16, 48]), inter=st.sampled_from([16, 32]),
       router_fp32=st.booleans(), specials=st.lists(st.sampled_from(SPECIALS), max_size=1),
       up_apart=st.booleans(), stored_kn=st.booleans())
def test_moe_bf16_kernel_is_the_reference(case, hidden, inter, router_fp32, specials, up_apart, stored_kn):
    """Also with w1 / w3 apart (`up`) and the stacks stored `[E, K, N]`, read through their strides."""
    T, k, experts, offset, seed, ids, weights = case
    x = values((T, hidden), HALF, seed, specials=specials).to(DEVICE)
    gate_up = (values((experts, 2 * inter, hidden), torch.float32, seed + 1) * 0.1).to(DEVICE, HALF)
    down = (values((experts, hidden, inter), torch.float32, seed + 2) * 0.1).to(DEVICE, HALF)
    weights = weights.to(DEVICE, torch.float32 if router_fp32 else HALF)
    stacks = (gate_up[:, :inter], down, gate_up[:, inter:]) if up_apart else (gate_up, down, None)
    stacks = tuple(None if w is None else guarded_stack(w.contiguous(), stored_kn) for w in stacks)
    want = reference_output(moe.moe_experts_bf16, moe.moe_experts_bf16_reference, x, ids.to(DEVICE), weights,
                            *stacks[:2], offset, None, stacks[2])
    got = moe.moe_experts_bf16_triton(guarded(x), ids.to(DEVICE), weights, *stacks[:2], offset, up=stacks[2])
    assert_rel_close(got, want, 1e-2, "triton")
    with pytest.raises(ValueError, match="negative|>= 0"):
        moe.moe_experts_bf16_reference(x, -ids.to(DEVICE) - 1, weights, gate_up, down, offset)


@fuzzes("dsfuse::moe_experts_fp4")
@given(case=routing(), hidden=st.sampled_from([32, 64]), inter=st.sampled_from([32, 64]),
       specials=st.lists(st.sampled_from(SPECIALS), max_size=1))
def test_moe_fp4_kernel_is_the_reference(case, hidden, inter, specials):
    T, k, experts, offset, seed, ids, weights = case
    x = values((T, hidden), HALF, seed, specials=specials).to(DEVICE)
    w13, w13_scale = quantize_fp4(values((experts, 2 * inter, hidden), torch.float32, seed + 1) * 0.1)
    w2, w2_scale = quantize_fp4(values((experts, hidden, inter), torch.float32, seed + 2) * 0.1)
    weights_ = (w13.to(DEVICE), w13_scale.to(DEVICE), w2.to(DEVICE), w2_scale.to(DEVICE))
    want = reference_output(moe.moe_experts_fp4, moe.moe_experts_reference, x, ids.to(DEVICE), weights.to(DEVICE),
                            *weights_, offset)
    got = moe.moe_experts_fp4_triton(guarded(x), ids.to(DEVICE), weights.to(DEVICE), *weights_, offset)
    assert_rel_close(got, want, 1e-2, "triton")
    with pytest.raises(ValueError, match="negative|>= 0"):
        moe.moe_experts_reference(x, -ids.to(DEVICE) - 1, weights.to(DEVICE), *weights_, offset)
