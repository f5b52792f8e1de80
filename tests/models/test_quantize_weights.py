"""The checkpoint writer's weight quantisers on expert stacks: one matrix at a time (bounded memory at real
dimensions) gives the same bits as quantising the whole stack at once."""

import pytest
import torch

from dsfuse.models.official import quantize_fp4
from dsfuse.models.quantized import quantize_fp4_weight, quantize_fp8_weight


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_stack_equals_each_matrix(scale_fmt):
    stack = torch.randn(2, 3, 200, 300, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_weight(stack, scale_fmt=scale_fmt)
    assert q.shape == stack.shape and s.shape == (2, 3, 2, 3)
    for index in ((0, 0), (1, 2)):
        q1, s1 = quantize_fp8_weight(stack[index], scale_fmt=scale_fmt)
        assert torch.equal(q[index].view(torch.uint8), q1.view(torch.uint8))
        assert torch.equal(s[index].view(torch.uint8) if scale_fmt == "ue8m0" else s[index],
                           s1.view(torch.uint8) if scale_fmt == "ue8m0" else s1)


def test_fp4_stack_equals_the_whole_stack_quantised_at_once():
    stack = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(1)) * 3
    packed, scales = quantize_fp4_weight(stack)
    whole_packed, whole_scales = quantize_fp4(stack)
    assert packed.dtype == torch.int8 and packed.shape == (4, 64, 64) and scales.shape == (4, 64, 4)
    assert torch.equal(packed.view(torch.uint8), whole_packed.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), whole_scales.view(torch.uint8))
