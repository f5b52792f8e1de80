"""Routed-experts custom ops: the FP4 decode bit for bit, the Triton paths (interpreter on CPU) against their
references, the FP4 reference against the own model's experts, the plain-weight reference against transformers'
`grouped_mm_experts_forward` (a literal copy of its math and the installed function), expert parallelism,
determinism, opcheck, bad input."""

import types

import pytest
import torch
import torch.nn.functional as F
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


def _bf16_from_bits(bits):
    """int64 tensor of 16-bit patterns -> bf16 tensor with those bits."""
    return (bits - ((bits & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def test_bf16_decode_recipe_bit_exact_all_bytes_all_scales():
    """The integer/bf16 steps of `fp4_decode_bf16_pair` (inline PTX, CUDA only), replayed with torch ops on the CPU:
    word = both codes as bf16 `value * 2^-126`, then `* f1 * f2` in bf16 (exact products, subnormals kept)."""
    packed, scales = (t.long() for t in _all_bytes_by_all_scales("cpu"))
    word = ((packed * 0x40040) & 0x01C001C0) | ((packed * 0x1001000) & 0x80008000)
    f1 = _bf16_from_bits((scales.clamp(max=128) + 126) << 7)
    f2 = _bf16_from_bits(torch.where(scales == 255, 0x7FC0, (scales.clamp(min=128) - 1) << 7))
    decoded = torch.stack([_bf16_from_bits(word & 0xFFFF) * f1 * f2, _bf16_from_bits(word >> 16) * f1 * f2], 1)
    ref = dequantize_fp4(packed.to(torch.uint8).view(-1, 1).expand(-1, 16).contiguous(),
                         scales.to(torch.uint8).view(-1, 1), torch.bfloat16)[:, :2]
    nan = ref.isnan()
    assert torch.equal(decoded.isnan(), nan)
    assert torch.equal(decoded.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


@pytest.mark.gpu
def test_gpu_bf16_decode_bit_exact_all_bytes_all_scales():
    """The inline-PTX bf16 decode the GEMMs use for bf16 activations, on the device."""
    packed, scales = _all_bytes_by_all_scales("cuda")
    decoded = moe.fp4_decode_triton(packed, scales, bf16=True).cpu().to(torch.bfloat16)
    ref = dequantize_fp4(packed.cpu().view(-1, 1).expand(-1, 16).contiguous(), scales.cpu().view(-1, 1),
                         torch.bfloat16)[:, :2]
    nan = ref.isnan()
    assert torch.equal(decoded.isnan(), nan)
    assert torch.equal(decoded.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


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


@pytest.mark.parametrize("T,k,num_experts,offset,block_m", [(37, 6, 8, 0, 16), (300, 8, 16, 8, 16), (1, 1, 1, 0, 16),
                                                             (90, 8, 200, 0, 64)])
def test_triton_routing_matches_torch_schedule(T, k, num_experts, offset, block_m):
    """One-launch routing kernel: the same stable order, and the same used tiles (idle ones have end 0)."""
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, 2 * num_experts + offset, (T, k), generator=g)
    ids[: T // 2, 0] = offset  # a crowded expert
    torch_order, torch_start, torch_end, torch_expert = moe.build_tile_schedule(ids, num_experts, offset, block_m)
    order, start, end, expert = moe.build_tile_schedule_triton(ids.to(DEVICE), num_experts, offset, block_m)
    used = torch_end > torch_start
    assert torch.equal(order.cpu(), torch_order)
    assert torch.equal(end.cpu(), torch_end)
    assert torch.equal(start.cpu()[used], torch_start[used]) and torch.equal(expert.cpu()[used], torch_expert[used])


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


# ---------------------------------------------------------------------------------------------------------------
# Plain-weight op (transformers' grouped_mm experts)
# ---------------------------------------------------------------------------------------------------------------


def _bf16_inputs(T, k, num_experts=8, dtype=HALF, router_dtype=torch.float32, seed=0, expert_ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, HIDDEN, generator=g).to(dtype)
    if expert_ids is None:
        expert_ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g).to(router_dtype)
    gate_up = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) * 0.1).to(dtype)
    down = (torch.randn(num_experts, HIDDEN, INTER, generator=g) * 0.1).to(dtype)
    return [t.to(DEVICE) for t in (x, expert_ids, weights, gate_up, down)]


def _hf_grouped_mm_literal(x, expert_ids, expert_weights, gate_up, down, local_expert_offset=0):
    """transformers' `grouped_mm_experts_forward` step by step, with its expert-parallel sentinels (ids mapped to
    local, non-local ones to `E`) and a per-group matmul in place of `grouped_mm`."""
    num_experts = gate_up.shape[0]
    T, top_k = expert_ids.shape
    local = expert_ids.long() - local_expert_offset
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    sample_weights = expert_weights.reshape(-1)
    expert_ids_g, perm = torch.sort(local.reshape(-1), stable=True)
    selected = x[perm // top_k]
    sample_weights_g = sample_weights[perm]
    counts = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32).tolist()
    sentinel = (expert_ids_g >= num_experts).unsqueeze(-1)
    selected = selected.masked_fill(sentinel, 0.0)

    def grouped_linear(inp, weight):
        out = torch.zeros(inp.shape[0], weight.shape[1], dtype=inp.dtype)
        for e, (lo, hi) in enumerate(zip([0] + offsets[:-1], offsets)):
            out[lo:hi] = inp[lo:hi] @ weight[e].t()
        return out

    proj = grouped_linear(selected, gate_up).masked_fill(sentinel, 0.0)
    gate, up = proj.chunk(2, dim=-1)
    proj = grouped_linear(F.silu(gate) * up, down).masked_fill(sentinel, 0.0)
    weighted = proj * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel())
    return weighted[inv_perm].view(T, top_k, -1).sum(dim=1).to(x.dtype)


@pytest.mark.parametrize("T,k", [(1, 1), (5, 4), (37, 6)])
def test_bf16_op_matches_hf_literal(T, k):
    args = _bf16_inputs(T, k, seed=T)
    cpu = [a.cpu() for a in args]
    ref = moe.moe_experts_bf16_reference(*cpu)
    assert torch.equal(ref, _hf_grouped_mm_literal(*cpu))
    out = moe.moe_experts_bf16_triton(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _rel_err(out, ref.to(out.device)) < 1e-2


@pytest.mark.parametrize("dtype,router_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float32), (torch.float32, torch.float32)])
def test_bf16_reference_is_bit_exact_with_installed_hf_function(dtype, router_dtype):
    """The installed transformers function itself (its CPU `grouped_mm`), every rounding included. One thread: with
    more, the CPU `grouped_mm` splits its sums by thread, an order that is the machine's and not the math's."""
    moe_integration = pytest.importorskip("transformers.integrations.moe")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare_with_installed_hf_function(moe_integration, dtype, router_dtype)
    finally:
        torch.set_num_threads(threads)


def _compare_with_installed_hf_function(moe_integration, dtype, router_dtype):
    x, ids, weights, gate_up, down = [a.cpu() for a in _bf16_inputs(37, 6, dtype=dtype, router_dtype=router_dtype)]
    module = types.SimpleNamespace(num_experts=gate_up.shape[0], has_gate=True, has_bias=False, gate_up_proj=gate_up,
                                   down_proj=down, is_transposed=False, act_fn=F.silu, _is_expert_parallel=False,
                                   has_post_expert_norm=False)
    module._apply_gate = lambda proj: moe_integration._default_apply_gate(module, proj)
    expected = moe_integration.grouped_mm_experts_forward(module, x, ids, weights)
    assert torch.equal(moe.moe_experts_bf16_reference(x, ids, weights, gate_up, down), expected)


def test_bf16_router_rounding_follows_type_promotion():
    """bf16 router weights round the product to bf16, fp32 ones keep it in fp32: the Triton combine does the same."""
    x, ids, weights, gate_up, down = _bf16_inputs(5, 4, dtype=torch.float32)
    for router_dtype in (torch.float16, torch.float32):
        args = (x.to(HALF), ids, weights.to(router_dtype), gate_up.to(HALF), down.to(HALF))
        ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in args])
        assert torch.equal(ref, _hf_grouped_mm_literal(*[a.cpu() for a in args]))
        assert _rel_err(moe.moe_experts_bf16_triton(*args), ref.to(DEVICE)) < 1e-2


def test_bf16_unused_experts_one_hot_and_non_local():
    """Experts without tokens, all slots on one expert, and a rank holding global experts 8..11 where non-local
    slots carry NaN router weights and tokens without a local slot NaN rows: nothing of them may leak."""
    sparse_ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    one_expert = torch.full((6, 3), 5)
    for ids in (sparse_ids, one_expert):
        args = _bf16_inputs(ids.shape[0], ids.shape[1], expert_ids=ids)
        out = moe.moe_experts_bf16_triton(*args, config={"block_m": 16})
        ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in args])
        assert torch.equal(ref, _hf_grouped_mm_literal(*[a.cpu() for a in args]))
        assert _rel_err(out, ref.to(out.device)) < 1e-2
    x, _, weights, gate_up, down = _bf16_inputs(6, 3, num_experts=4)
    ids = torch.tensor([[8, 1, 11], [0, 2, 3], [9, 10, 8], [15, 20, 9], [11, 0, 100], [4, 5, 6]], device=DEVICE)
    non_local = (ids < 8) | (ids >= 12)
    x = x.masked_fill(non_local.all(dim=1, keepdim=True), float("nan"))
    finite_weights = weights
    weights = weights.masked_fill(non_local, float("nan"))
    out = moe.moe_experts_bf16_triton(x, ids, weights, gate_up, down, local_expert_offset=8)
    ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in (x, ids, weights, gate_up, down)], local_expert_offset=8)
    # HF itself multiplies its zeroed sentinel rows by the router weight, so it gets finite weights here.
    hf = _hf_grouped_mm_literal(*[a.cpu() for a in (x, ids, finite_weights, gate_up, down)], local_expert_offset=8)
    assert torch.isfinite(out).all() and torch.equal(ref, hf)
    assert (ref[non_local.all(dim=1).cpu()] == 0).all()
    assert _rel_err(out, ref.to(out.device)) < 1e-2


def test_bf16_op_cpu_is_reference_and_opcheck():
    args = [a.cpu() for a in _bf16_inputs(5, 4, dtype=torch.float32)]
    out = torch.ops.dsfuse.moe_experts_bf16(*args, 0)
    assert torch.equal(out, moe.moe_experts_bf16_reference(*args))
    torch.library.opcheck(torch.ops.dsfuse.moe_experts_bf16.default, (*args, 0))
    torch.library.opcheck(torch.ops.dsfuse.moe_experts_bf16.default, (*args, 3))


def test_bf16_bad_input_raises():
    x, ids, weights, gate_up, down = [a.cpu() for a in _bf16_inputs(3, 2)]
    op = torch.ops.dsfuse.moe_experts_bf16
    with pytest.raises(ValueError, match="expert ids must be >= 0"):
        op(x, ids - 5, weights, gate_up, down)
    with pytest.raises(TypeError, match="gate_up dtype"):
        op(x, ids, weights, gate_up.float(), down)
    with pytest.raises(ValueError, match="down must be"):
        op(x, ids, weights, gate_up, down[:, :, :8])
    with pytest.raises(ValueError, match="gate_up must be"):
        op(x[:, :32], ids, weights, gate_up, down)
    with pytest.raises(ValueError, match="local_expert_offset"):
        op(x, ids, weights, gate_up, down, -1)


@pytest.mark.parametrize("T,k,limit", [(1, 1, None), (37, 6, None), (37, 6, 0.5)])
def test_bf16_grouped_mm_path_matches_reference(T, k, limit):
    """The prefill path (`torch._grouped_mm` GEMMs over expert-sorted rows, Triton SwiGLU and a combine reading
    the sorted rows through the inverse permutation), forced at small sizes; in fp32 it is the reference up to
    summation order."""
    args = _bf16_inputs(T, k, dtype=torch.float32, seed=T)
    out = moe.moe_experts_bf16_triton(*args, swiglu_limit=limit, config={"gemm": "grouped_mm"})
    ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in args], swiglu_limit=limit)
    assert out.dtype == ref.dtype and _rel_err(out, ref.to(out.device)) < 1e-6
    half = [a.to(HALF) if a.is_floating_point() and a is not args[2] else a for a in args]
    out = moe.moe_experts_bf16_triton(*half, swiglu_limit=limit, config={"gemm": "grouped_mm"})
    ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in half], swiglu_limit=limit)
    assert out.dtype == HALF and _rel_err(out, ref.to(out.device)) < 1e-2


def test_bf16_grouped_mm_path_never_reads_non_local_slots():
    """Other ranks' slots sort past the last group offset, rows `grouped_mm` leaves unwritten: with NaN router
    weights on them and NaN tokens that have no local slot, nothing may leak into the output."""
    x, _, weights, gate_up, down = _bf16_inputs(6, 3, num_experts=4)
    ids = torch.tensor([[8, 1, 11], [0, 2, 3], [9, 10, 8], [15, 20, 9], [11, 0, 100], [4, 5, 6]], device=DEVICE)
    non_local = (ids < 8) | (ids >= 12)
    x = x.masked_fill(non_local.all(dim=1, keepdim=True), float("nan"))
    weights = weights.masked_fill(non_local, float("nan"))
    out = moe.moe_experts_bf16_triton(x, ids, weights, gate_up, down, local_expert_offset=8,
                                      config={"gemm": "grouped_mm"})
    ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in (x, ids, weights, gate_up, down)], local_expert_offset=8)
    assert torch.isfinite(out).all() and _rel_err(out, ref.to(out.device)) < 1e-2


@pytest.mark.gpu
def test_gpu_bf16_weight_op_tails_and_opcheck():
    """bf16 plain weights on the GPU through the custom op, K and N tails, decode and prefill tile sizes."""
    for T in (3, 300):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, 1056, generator=g).to(torch.bfloat16).cuda()
        ids = torch.stack([torch.randperm(16, generator=g)[:8] for _ in range(T)]).cuda()
        weights = torch.rand(T, 8, generator=g).cuda()
        gate_up = (torch.randn(16, 2 * 160, 1056, generator=g) * 0.05).to(torch.bfloat16).cuda()
        down = (torch.randn(16, 1056, 160, generator=g) * 0.05).to(torch.bfloat16).cuda()
        args = (x, ids, weights, gate_up, down)
        assert moe._grouped_mm_applies(x, gate_up, ids.numel()) == (T == 300)  # decode tiles / CUTLASS prefill
        assert _rel_err(torch.ops.dsfuse.moe_experts_bf16(*args, 0), moe.moe_experts_bf16_reference(*args)) < 1e-2
    torch.library.opcheck(torch.ops.dsfuse.moe_experts_bf16.default, (*args, 0))


# ---------------------------------------------------------------------------------------------------------------
# Clamped SwiGLU (DeepSeek V4's `swiglu_limit`)
# ---------------------------------------------------------------------------------------------------------------

LIMIT = 0.5  # the gate/up GEMM outputs here are ~N(0, 1): the clamp bites on most slots


def _clamped_error_and_effect(op_triton, op_reference, args):
    """(Triton's relative error vs the clamped reference, how far the clamp moves the reference)."""
    out = op_triton(*args, swiglu_limit=LIMIT)
    ref = op_reference(*[a.cpu() for a in args], swiglu_limit=LIMIT)
    unclamped = op_reference(*[a.cpu() for a in args])
    return _rel_err(out, ref.to(out.device)), _rel_err(unclamped, ref)


@pytest.mark.parametrize("T,k", [(1, 1), (37, 6)])
def test_clamped_swiglu_triton_matches_reference(T, k):
    error, effect = _clamped_error_and_effect(moe.moe_experts_fp4_triton, moe.moe_experts_reference,
                                              _inputs(T, k, seed=T))
    assert error < 1e-2 and effect > 0.1
    error, effect = _clamped_error_and_effect(moe.moe_experts_bf16_triton, moe.moe_experts_bf16_reference,
                                              _bf16_inputs(T, k, seed=T))
    assert error < 1e-2 and effect > 0.1


def test_clamped_swiglu_keeps_nan_and_rounds_the_limit_as_torch():
    """A limit that is not representable in x's dtype clamps to its rounding (torch's clamp of a half tensor), and a
    NaN gate/up output stays NaN through the clamp (torch.clamp propagates it)."""
    x, ids, weights, gate_up, down = _bf16_inputs(5, 2)
    limit = 0.30001  # not an fp16 value
    ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in (x, ids, weights, gate_up, down)], swiglu_limit=limit)
    out = moe.moe_experts_bf16_triton(x, ids, weights, gate_up, down, swiglu_limit=limit)
    assert _rel_err(out, ref.to(out.device)) < 1e-2
    x = x.clone()
    x[2, 0] = float("nan")
    out = moe.moe_experts_bf16_triton(x, ids, weights, gate_up, down, swiglu_limit=limit)
    assert out[2].isnan().all() and not out[[0, 1, 3, 4]].isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_clamped_bf16_reference_is_bit_exact_with_installed_hf_v4_experts(dtype):
    """transformers' `grouped_mm_experts_forward` with DeepSeek V4's clamped `_apply_gate`, every rounding included."""
    moe_integration = pytest.importorskip("transformers.integrations.moe")
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    x, ids, weights, gate_up, down = [a.cpu() for a in _bf16_inputs(37, 6, dtype=dtype)]
    module = types.SimpleNamespace(num_experts=gate_up.shape[0], has_gate=True, has_bias=False, gate_up_proj=gate_up,
                                   down_proj=down, is_transposed=False, act_fn=F.silu, _is_expert_parallel=False,
                                   has_post_expert_norm=False, limit=LIMIT)
    module._apply_gate = lambda proj: v4.DeepseekV4Experts._apply_gate(module, proj)
    expected = moe_integration.grouped_mm_experts_forward(module, x, ids, weights)
    got = moe.moe_experts_bf16_reference(x, ids, weights, gate_up, down, swiglu_limit=LIMIT)
    assert torch.equal(got, expected)
    assert not torch.equal(got, moe.moe_experts_bf16_reference(x, ids, weights, gate_up, down))


def test_clamped_ops_opcheck_and_bad_limit():
    fp4_args = [a.cpu() for a in _inputs(5, 4, dtype=torch.float32)]
    bf16_args = [a.cpu() for a in _bf16_inputs(5, 4, dtype=torch.float32)]
    assert torch.equal(torch.ops.dsfuse.moe_experts_fp4(*fp4_args, 0, LIMIT),
                       moe.moe_experts_reference(*fp4_args, swiglu_limit=LIMIT))
    assert torch.equal(torch.ops.dsfuse.moe_experts_bf16(*bf16_args, 0, LIMIT),
                       moe.moe_experts_bf16_reference(*bf16_args, swiglu_limit=LIMIT))
    torch.library.opcheck(torch.ops.dsfuse.moe_experts_fp4.default, (*fp4_args, 0, LIMIT))
    torch.library.opcheck(torch.ops.dsfuse.moe_experts_bf16.default, (*bf16_args, 0, LIMIT))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="swiglu_limit must be a positive finite float"):
            torch.ops.dsfuse.moe_experts_bf16(*bf16_args, 0, bad)
        with pytest.raises(ValueError, match="swiglu_limit must be a positive finite float"):
            moe.moe_experts_fp4_triton(*fp4_args, swiglu_limit=bad)
