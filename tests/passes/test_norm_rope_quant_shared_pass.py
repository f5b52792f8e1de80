"""`norm_rope_quant`'s FP8 projections of one input (`passes/norm_rope_quant_shared.py`): `dsfuse::fp8_linear` calls
that read one tensor, directly or through views, become one `dsfuse::fp8_linears` call (one activation quantisation),
equal to eager bit for bit; projections that cannot share it (other activation blocks or scale kinds) are a reported
near-miss naming both, FP4 weights and a projection alone are left silently."""

import torch

import dsfuse
import dsfuse.kernels.fp8_linear  # noqa: F401  (registers the ops even when the FX cache serves the graph)
from dsfuse.kernels.quant_formats import E8M0_DTYPE
from dsfuse.models.quantized import quantize_fp8_weight

K = 256
FP8_LINEAR = torch.ops.dsfuse.fp8_linear.default
FP8_LINEARS = torch.ops.dsfuse.fp8_linears.default


def _fp8(N, seed, scale_fmt="ue8m0", block=128):
    return quantize_fp8_weight(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05, block,
                               scale_fmt)


def _fp4(N, seed):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    return packed, torch.randint(118, 126, (N, K // 32), generator=g, dtype=torch.uint8).view(E8M0_DTYPE)


class Projections(torch.nn.Module):
    """Projections of one normed input, as an HF layer's FP8Linear calls read it: each `(weight, scale, block,
    view)`; `view` "flat" reads `h.view(-1, K)` (transformers' 2-D form), "unsqueezed" `h.unsqueeze(0)`."""

    def __init__(self, projections):
        super().__init__()
        self.blocks, self.views = [], []
        for i, (weight, scale, block, view) in enumerate(projections):
            self.register_buffer(f"weight{i}", weight)
            self.register_buffer(f"scale{i}", scale)
            self.blocks.append(block)
            self.views.append(view)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        outs = []
        for i, (block, view) in enumerate(zip(self.blocks, self.views)):
            read = {"flat": h.view(-1, K), "unsqueezed": h.unsqueeze(0)}.get(view, h)
            outs.append(torch.ops.dsfuse.fp8_linear(read, getattr(self, f"weight{i}"), getattr(self, f"scale{i}"),
                                                    *block) * 2)
        return outs


def _x(seed=1, shape=(2, 5, K)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _pass_on(module, x):
    """The module traced to aten (its buffers as graph inputs, as Inductor's post-grad graph holds parameters), then
    `norm_rope_quant`."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dsfuse.passes import run_pass
    from dsfuse.passes.context import PassContext

    names = [name for name, _ in module.named_buffers()]

    def traced(x, *buffers):
        return torch.func.functional_call(module, dict(zip(names, buffers)), (x,))

    buffers = [b for _, b in module.named_buffers()]
    gm = make_fx(traced, tracing_mode="fake")(x, *buffers)
    ctx = PassContext(name="norm_rope_quant")
    run_pass("norm_rope_quant", gm.graph, ctx)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, ctx, (x, *buffers)


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def test_projections_of_one_input_and_its_views_share_one_quantisation_bit_for_bit():
    """Three projections, one reading the normed input, one its 2-D view, one an unsqueezed view: one call on the
    input, each output viewed back; compiled with dynamic sizes (the views' sizes symbolic), the eager bits at two
    sizes from one graph."""
    module = Projections([(*_fp8(48, 1), (128, 128), None), (*_fp8(40, 2), (128, 128), "flat"),
                          (*_fp8(33, 3), (128, 128), "unsqueezed")])
    compiled = torch.compile(module, backend="dsfuse", dynamic=True, options={"enable": ["norm_rope_quant"]})
    for shape in ((2, 5, K), (3, 7, K)):
        x = _x(shape[1], shape)
        with torch.no_grad():
            got, want = compiled(x), module(x)
        assert [o.shape for o in got] == [(*shape[:2], 48), (shape[0] * shape[1], 40), (1, *shape[:2], 33)]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    report = dsfuse.report()
    sites = [s for s in report.sites if s.op == "dsfuse.fp8_linears"]
    assert [s.detail for s in sites] == ["one activation quantisation for 3 FP8 projections (N = 48, 40, 33) of "
                                         "[..., 256] (block 128 x 128, E8M0 scales)"], str(report)
    assert report.near_misses == [], str(report)


def test_the_call_reads_the_shared_input_and_outputs_are_viewed_back():
    module = Projections([(*_fp8(48, 1, "float"), (128, 128), "flat"), (*_fp8(40, 2, "float"), (128, 128), None)])
    gm, ctx, args = _pass_on(module, _x(2, (3, 7, K)))
    (call,) = _calls(gm, FP8_LINEARS)
    assert not _calls(gm, FP8_LINEAR) and call.args[0].target is torch.ops.aten.mul.Tensor
    assert [s.detail for s in ctx.sites] == ["one activation quantisation for 2 FP8 projections (N = 48, 40) of "
                                             "[..., 256] (block 128 x 128, fp32 scales)"]
    with torch.no_grad():
        got, want = gm(*args), module(args[0])
    assert got[0].shape == (21, 48) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_projections_with_other_scale_kinds_are_a_near_miss_naming_both():
    """Two FP8 projections of one input, fp32 and E8M0 scales: each quantises the input (its scales are powers of two
    for E8M0), no call can serve both: reported, naming both projections and the reason."""
    module = Projections([(*_fp8(48, 1, "float"), (128, 128), None), (*_fp8(40, 2, "ue8m0"), (128, 128), None)])
    gm, ctx, _ = _pass_on(module, _x())
    assert not _calls(gm, FP8_LINEARS) and len(_calls(gm, FP8_LINEAR)) == 2 and not ctx.sites
    (miss,) = ctx.near_misses
    first, second = (n.name for n in _calls(gm, FP8_LINEAR))
    assert miss.anchor == second and f"FP8 projection {second} ([40, 256] weight" in miss.reason, miss
    assert f"reads the same input as {first} ([48, 256] weight" in miss.reason, miss
    assert "its weight scales are E8M0, the other's fp32 (one call takes one scale kind)" in miss.reason, miss


def test_a_group_beside_a_projection_of_other_blocks_is_one_call_and_a_near_miss():
    """Blocks of 128 x 128 twice and of 64 x 64 once: the two share a call, the third is reported."""
    module = Projections([(*_fp8(48, 1), (128, 128), None), (*_fp8(40, 2), (128, 128), "flat"),
                          (*_fp8(33, 3, block=64), (64, 64), None)])
    gm, ctx, args = _pass_on(module, _x())
    assert len(_calls(gm, FP8_LINEARS)) == 1 and len(_calls(gm, FP8_LINEAR)) == 1 and len(ctx.sites) == 1
    (miss,) = ctx.near_misses
    assert "it quantises its activations per 64 channels, the other per 128 (one call quantises them once)" in \
        miss.reason, miss
    with torch.no_grad():
        assert all(torch.equal(g, w) for g, w in zip(gm(*args), module(args[0])))


def test_per_tensor_scales_of_other_heights_share_one_call():
    """A checkpoint without `weight_block_size`: each weight one block (block_n its N, block_k = K, one fp32 scale).
    The activations' quantisation reads only block_k: one call, each projection with its own block height."""
    module = Projections([(*_fp8(48, 1, "float", block=K), (48, K), None),
                          (*_fp8(40, 2, "float", block=K), (40, K), "flat")])
    gm, ctx, args = _pass_on(module, _x())
    (call,) = _calls(gm, FP8_LINEARS)
    assert call.args[3] == [48, 40] and not ctx.near_misses
    assert [s.detail for s in ctx.sites] == ["one activation quantisation for 2 FP8 projections (N = 48, 40) of "
                                             "[..., 256] (block 48 x 256, 40 x 256, fp32 scales)"]
    with torch.no_grad():
        assert all(torch.equal(g, w) for g, w in zip(gm(*args), module(args[0])))


def test_fp4_weights_and_a_lone_projection_are_left_silently():
    """An FP4 projection reads its activations dequantised: no group with the FP8 one, nothing reported; a lone FP8
    projection of its input has nothing to share."""
    module = Projections([(*_fp8(48, 1), (128, 128), None), (*_fp4(40, 2), (128, 128), None)])
    gm, ctx, _ = _pass_on(module, _x())
    assert not _calls(gm, FP8_LINEARS) and not ctx.sites and not ctx.near_misses

