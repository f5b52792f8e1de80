"""Module floats under `torch.compile(dynamic=True)`: baked in and guarded, as the default compile does.

Dynamo passes every Python float in as a 0-d tensor under `dynamic=True`; dsfuse puts the ones read from module
attributes back as constants (the passes and kernels need them) with a guard on each value, and leaves floats passed
to the compiled call as inputs."""

import torch

import dsfuse
from dsfuse.passes import PASS_NAMES


class ScaledNorm(torch.nn.Module):
    scale = 0.5  # a class attribute, read through the instance

    def __init__(self):
        super().__init__()
        self.eps = 1e-6

    def forward(self, x, shift=None):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale
        return y if shift is None else y + shift


def _run(model, lengths, options=None, **kwargs):
    compiled = torch.compile(model, backend="dsfuse", dynamic=True, options=options)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for seq in lengths:
            x = torch.randn(2, seq, 8, generator=gen)
            torch.testing.assert_close(compiled(x, **kwargs), model(x, **kwargs))
    return len(dsfuse.report().graphs)


def test_attribute_floats_are_baked_and_a_change_recompiles():
    model = ScaledNorm()
    assert _run(model, (5, 9, 13)) == 1  # one graph serves every length
    model.eps = 1e-2
    assert _run(model, (5, 9)) == 2  # the guard on eps: a new graph, with the new value
    ScaledNorm.scale = 0.25
    try:
        assert _run(model, (5,)) == 3  # the class attribute is guarded too
    finally:
        ScaledNorm.scale = 0.5


def test_argument_floats_stay_inputs():
    """A float the caller passes may differ every call: it is not baked, so no new graph per value."""
    model = ScaledNorm()
    compiled = torch.compile(model, backend="dsfuse", dynamic=True)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        for shift in (0.5, 1.5, 2.5):
            torch.testing.assert_close(compiled(x, shift=shift), model(x, shift=shift))
    assert len(dsfuse.report().graphs) == 1


def test_with_every_pass_off_dsfuse_is_inductor_and_bakes_nothing():
    model = ScaledNorm()
    assert _run(model, (5,), options={"disable": list(PASS_NAMES)}) == 1
    model.eps = 1e-2
    assert _run(model, (5,), options={"disable": list(PASS_NAMES)}) == 1  # eps stayed an input: no recompile
