"""FP4 routed-experts custom op: the FP4 decode bit for bit, the Triton path (interpreter on CPU) against the
reference, the reference against the own model's experts, expert parallelism, determinism, opcheck, bad input."""

import pytest
import torch
from dsfuse.kernels import moe_experts as moe
from dsfuse.models.official import (
    DsfuseDeepseekConfig,
    DsfuseFp4Experts,
    dequantize_fp4,
    quantize_fp4,
)

# The decode test multiplies 6 by 2^127 on purpose (reference and kernel both give inf).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter's bf16 tl.dot is broken; fp16 exercises the same half-precision path.
HALF = torch.bfloat16 if ON_GPU else torch.float16
HIDDEN, INTER = 96, 64  # neither a multiple of 64: the K and N loops run masked tails


def _inputs(T, k, num_experts=8, hidden=HIDDEN, inter=INTER, dtype=HALF, seed=0, expert_ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g).to(dtype)
    if expert_ids is None:
        expert_ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    w13_packed, w13_scale = quantize_fp4(torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1)
    w2_packed, w2_scale = quantize_fp4(torch.randn(num_experts, hidden, inter, generator=g) * 0.1)
    tensors = (x, expert_ids, weights, w13_packed, w13_scale, w2_packed, w2_scale)
    return [t.to(DEVICE) for t in tensors]


def _rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def _all_bytes_by_all_scales(device):
    packed = torch.arange(256, dtype=torch.uint8).repeat_interleave(256).to(device)
    scales = torch.arange(256, dtype=torch.uint8).repeat(256).to(device)
    return packed, scales


def test_fp4_decode_bit_exact_all_bytes_all_scales():
    packed, scales = _all_bytes_by_all_scales(DEVICE)
    decoded = moe.fp4_decode_triton(packed, scales).cpu()
    # One scale per 32 elements: widen each byte to a 16-byte row so every pair gets its own scale byte.
    ref = dequantize_fp4(packed.cpu().view(-1, 1).expand(-1, 16).contiguous(), scales.cpu().view(-1, 1),
                         torch.float32)[:, :2]
    nan = ref.isnan()
    assert torch.equal(decoded.isnan(), nan)
    assert nan.view(256, 256, 2)[:, 255].all() and nan.sum() == 256 * 2
    assert torch.equal(decoded.view(torch.int32)[~nan], ref.view(torch.int32)[~nan])  # signed zeros included
    assert decoded[scales.cpu() == 0][:, 0].abs().max() == 6 * 2.0**-127  # E8M0 0 is 2^-127, not 0
    for dtype in (torch.bfloat16, torch.float16):
        ref_cast = dequantize_fp4(packed.cpu().view(-1, 1).expand(-1, 16).contiguous(), scales.cpu().view(-1, 1),
                                  dtype)[:, :2]
        assert torch.equal(decoded.to(dtype).view(torch.int16)[~nan], ref_cast.view(torch.int16)[~nan])


@pytest.mark.parametrize("T,k", [(1, 1), (5, 4), (37, 6)])
def test_triton_matches_reference(T, k):
    args = _inputs(T, k, seed=T)
    out = moe.moe_experts_fp4_triton(*args)
    ref = moe.moe_experts_reference(*[a.cpu() for a in args]).to(out.device)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _rel_err(out, ref) < 1e-2


def test_reference_matches_own_model_experts():
    """Same math as `DsfuseFp4Experts.forward` (which sums slots in x's dtype, sorted by expert): fp32 here."""
    config = DsfuseDeepseekConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=8, n_group=1,
                                  topk_group=1, num_experts_per_tok=4, expert_gemm="batched_mm")
    experts = DsfuseFp4Experts(config)
    x, ids, weights, w13p, w13s, w2p, w2s = [a.cpu() for a in _inputs(9, 4, dtype=torch.float32)]
    experts.gate_up_proj.copy_(w13p)
    experts.gate_up_proj_scale.copy_(w13s)
    experts.down_proj.copy_(w2p)
    experts.down_proj_scale.copy_(w2s)
    ref = moe.moe_experts_reference(x, ids, weights, w13p, w13s, w2p, w2s)
    torch.testing.assert_close(ref, experts(x, ids, weights), rtol=1e-5, atol=1e-6)


def test_unused_experts_and_one_hot_expert():
    sparse_ids = torch.tensor([[0, 1], [1, 0], [0, 1]])  # experts 2..7 get no tokens
    one_expert = torch.full((6, 3), 5)  # every slot of every token on expert 5 (more rows than one tile)
    for ids in (sparse_ids, one_expert):
        args = _inputs(ids.shape[0], ids.shape[1], expert_ids=ids)
        out = moe.moe_experts_fp4_triton(*args, config={"block_m": 16})
        ref = moe.moe_experts_reference(*[a.cpu() for a in args]).to(out.device)
        assert _rel_err(out, ref) < 1e-2


def test_non_local_slots_are_never_read():
    """Rank holding global experts 8..11: other slots have NaN weights, and tokens with no local slot NaN rows."""
    T, k, local = 6, 3, 4
    args = _inputs(T, k, num_experts=local)
    x, _, weights = args[:3]
    ids = torch.tensor([[8, 1, 11], [0, 2, 3], [9, 10, 8], [15, 20, 9], [11, 0, 100], [4, 5, 6]], device=DEVICE)
    non_local = (ids < 8) | (ids >= 12)
    weights = weights.masked_fill(non_local, float("nan"))
    x = x.masked_fill(non_local.all(dim=1, keepdim=True), float("nan"))
    args = [x, ids, weights] + args[3:]
    out = moe.moe_experts_fp4_triton(*args, local_expert_offset=8)
    ref = moe.moe_experts_reference(*[a.cpu() for a in args], local_expert_offset=8).to(out.device)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert (ref[non_local.all(dim=1)] == 0).all()
    assert _rel_err(out, ref) < 1e-2


def test_deterministic():
    args = _inputs(37, 6, seed=3)
    first = moe.moe_experts_fp4_triton(*args)
    assert torch.equal(first.view(torch.int16), moe.moe_experts_fp4_triton(*args).view(torch.int16))


def test_tile_schedule_covers_each_local_slot_once():
    ids = torch.tensor([[3, 0], [3, 7], [3, 1], [9, 3], [0, 3]])
    block_m = 2
    sorted_slot, start, end, expert = moe.build_tile_schedule(ids, num_experts=4, local_expert_offset=0,
                                                              block_m=block_m)
    assert start.numel() == ids.numel() // block_m + 4
    covered = []
    for s, e, x in zip(start.tolist(), end.tolist(), expert.tolist()):
        rows = sorted_slot[s:min(e, s + block_m)].tolist() if s < e else []
        assert all(ids.view(-1)[r] == x for r in rows)
        covered += rows
    local = [i for i, e in enumerate(ids.view(-1).tolist()) if e < 4]
    assert sorted(covered) == local


def test_op_cpu_is_reference_and_opcheck():
    args = [a.cpu() for a in _inputs(5, 4, dtype=torch.float32)]
    out = torch.ops.dsfuse.moe_experts_fp4(*args, 0)
    assert torch.equal(out, moe.moe_experts_reference(*args))
    torch.library.opcheck(torch.ops.dsfuse.moe_experts_fp4.default, (*args, 0))


def test_bad_input_raises():
    x, ids, weights, w13p, w13s, w2p, w2s = [a.cpu() for a in _inputs(3, 2)]
    op = torch.ops.dsfuse.moe_experts_fp4
    with pytest.raises(ValueError, match="expert ids must be >= 0"):
        op(x, ids - 5, weights, w13p, w13s, w2p, w2s)
    with pytest.raises(TypeError, match="w13_packed must be uint8"):
        op(x, ids, weights, w13p.to(torch.int16), w13s, w2p, w2s)
    with pytest.raises(ValueError, match="w2_scale must be"):
        op(x, ids, weights, w13p, w13s, w2p, w2s[:, :, :1])
    with pytest.raises(ValueError, match="expert_weights"):
        op(x, ids, weights[:, :1], w13p, w13s, w2p, w2s)
    with pytest.raises(ValueError, match="multiple of the FP4 block size"):
        op(x[:, :80], ids, weights, w13p, w13s, w2p, w2s)
    with pytest.raises(TypeError, match="expert_ids must be int32 or int64"):
        moe.moe_experts_fp4_triton(x, ids.float(), weights, w13p, w13s, w2p, w2s)


@pytest.mark.gpu
def test_gpu_bf16_op_tails_and_opcheck():
    """bf16 on the GPU through the custom op, with K and N tails in both GEMMs and both tile sizes."""
    for T in (3, 300):
        args = _inputs(T, 8, num_experts=16, hidden=1056, inter=160, dtype=torch.bfloat16, seed=T)
        out = torch.ops.dsfuse.moe_experts_fp4(*args, 0)
        ref = moe.moe_experts_reference(*args)
        assert _rel_err(out, ref) < 1e-2
    torch.library.opcheck(torch.ops.dsfuse.moe_experts_fp4.default, (*args, 0))


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_replays():
    """No host sync and no data-dependent shapes: the launcher captures into a CUDA graph and replays on new routing."""
    x, ids, weights, *packed = _inputs(40, 6, num_experts=8, dtype=torch.bfloat16)
    moe.moe_experts_fp4_triton(x, ids, weights, *packed)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_experts_fp4_triton(x, ids, weights, *packed)
    ids.copy_(torch.roll(ids, 1, dims=0))
    graph.replay()
    assert _rel_err(out, moe.moe_experts_reference(x, ids, weights, *packed)) < 1e-2
