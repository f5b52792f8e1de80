"""Routed-experts custom ops: the FP4 decode bit for bit, the Triton paths (interpreter on CPU) against their
references, the FP4 reference against the own model's experts, the plain-weight reference against transformers'
`grouped_mm_experts_forward` (a literal copy of its math and the installed function), expert parallelism,
determinism, opcheck, bad input."""

import types

import pytest
import sm90_offline
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


@pytest.mark.parametrize("T,k,num_experts,offset,block_m", [(37, 6, 8, 0, 16), (300, 8, 16, 8, 64), (1, 1, 1, 0, 16),
                                                             (90, 8, 200, 3, 16)])
def test_row_routing_maps_rows_to_tokens_and_slots_to_rows(T, k, num_experts, offset, block_m, monkeypatch):
    """`build_row_routing`: row r reads the token of the r-th slot in `build_tile_schedule`'s order, each local slot
    lies at its row and another rank's at -1, the tiles are that schedule's; the one-launch kernel and the torch ops
    past TRITON_ROUTING_MAX_SLOTS give the same int32 maps."""
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, 2 * num_experts + offset, (T, k), generator=g)
    ids[: T // 2, 0] = offset
    order, start, end, expert = moe.build_tile_schedule(ids, num_experts, offset, block_m)
    row_token, row_of_slot, tiles = moe.build_row_routing(ids.to(DEVICE), num_experts, offset, block_m)
    local = ((ids.view(-1) >= offset) & (ids.view(-1) < offset + num_experts)).nonzero().view(-1)
    assert torch.equal(row_token.cpu(), order // k)
    assert torch.equal(order[row_of_slot.cpu()[local].long()], local.to(order.dtype))
    assert (row_of_slot.cpu() == -1).sum() == ids.numel() - local.numel()
    used = end > start
    assert torch.equal(tiles[2].cpu(), end) and torch.equal(tiles[1].cpu()[used], start[used])
    assert torch.equal(tiles[0].cpu()[used], expert[used])
    monkeypatch.setattr(moe, "TRITON_ROUTING_MAX_SLOTS", 0)
    by_torch = moe.build_row_routing(ids, num_experts, offset, block_m)
    assert all(t.dtype == torch.int32 for t in (*by_torch[:2], *by_torch[2]))
    assert torch.equal(by_torch[0], row_token.cpu()) and torch.equal(by_torch[1], row_of_slot.cpu())
    assert all(torch.equal(a, b.cpu()) for a, b in zip(by_torch[2], tiles))


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


def _bf16_inputs(T, k, num_experts=8, dtype=HALF, router_dtype=torch.float32, seed=0, expert_ids=None, hidden=HIDDEN,
                 inter=INTER):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g).to(dtype)
    if expert_ids is None:
        expert_ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g).to(router_dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).to(dtype)
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


def _stored_kn(stack):
    """The same weights stored `[E, K, N]`, as the op gets them: the transposed view of that stack."""
    return stack.transpose(1, 2).contiguous().transpose(1, 2)


def _weight_layouts(gate_up, down):
    """`(gate_up, down, up)` of the same weights in each layout the op reads without a copy."""
    inter = down.shape[2]
    gate, up = gate_up[:, :inter].contiguous(), gate_up[:, inter:].contiguous()
    return {"one stack": (gate_up, down, None), "w1 / w3": (gate, down, up),
            "[E, K, N]": (_stored_kn(gate_up), _stored_kn(down), None),
            "w1 / w3 [E, K, N]": (_stored_kn(gate), _stored_kn(down), _stored_kn(up))}


@pytest.mark.parametrize("layout", ["w1 / w3", "[E, K, N]", "w1 / w3 [E, K, N]"])
@pytest.mark.parametrize("T,k,config", [(1, 3, {}), (6, 2, {"block_m": 16, "split_k": 2}),
                                        (7, 3, {"slot_tiles": False, "block_k": 64})])
def test_bf16_strided_and_separate_stacks_give_one_stack_bit_for_bit(layout, T, k, config):
    """The Triton GEMMs read gate and up rows from two stacks and each stack through its strides: the same weights
    in any layout give the K-contiguous one-stack output bit for bit (the same tiles, the same sums), and the
    reference within the half tolerance. Odd sizes (H 72, I 20, E 5): every tile is a masked tail."""
    x, ids, weights, gate_up, down = _bf16_inputs(T, k, num_experts=5, seed=T, hidden=72, inter=20)
    want = moe.moe_experts_bf16_triton(x, ids, weights, gate_up, down, swiglu_limit=0.5, config=config)
    gate, down_view, up = _weight_layouts(gate_up, down)[layout]
    got = moe.moe_experts_bf16_triton(x, ids, weights, gate, down_view, swiglu_limit=0.5, up=up, config=config)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in (x, ids, weights, gate, down_view)], swiglu_limit=0.5,
                                         up=None if up is None else up.cpu())
    assert _rel_err(got, ref.to(got.device)) < 1e-2


@pytest.mark.parametrize("layout", ["w1 / w3", "[E, K, N]", "w1 / w3 [E, K, N]"])
def test_bf16_reference_and_grouped_mm_path_read_every_layout(layout):
    """The reference in fp32 on each layout is the one-stack reference up to summation order, and the grouped_mm path
    (forced; one grouped GEMM per stack when w1 and w3 are apart) too."""
    args = _bf16_inputs(37, 6, dtype=torch.float32, seed=3)
    x, ids, weights, gate_up, down = args
    gate, down_view, up = _weight_layouts(gate_up, down)[layout]
    want = moe.moe_experts_bf16_reference(*[a.cpu() for a in args])
    got = moe.moe_experts_bf16_reference(*[a.cpu() for a in (x, ids, weights, gate, down_view)],
                                         up=None if up is None else up.cpu())
    assert _rel_err(got, want) < 1e-6
    out = moe.moe_experts_bf16_triton(x, ids, weights, gate, down_view, up=up, config={"gemm": "grouped_mm"})
    assert _rel_err(out, want.to(out.device)) < 1e-6


def test_grouped_mm_reads_only_layouts_it_takes():
    """`grouped_mm` is used only where it reads a stack in place: either layout with aligned strides; a stack with
    neither dim contiguous or a misaligned stride goes to the Triton GEMMs, never through a copy."""
    stack = torch.zeros(4, 32, 64)
    assert moe._grouped_mm_reads(stack) and moe._grouped_mm_reads(_stored_kn(stack))
    assert not moe._grouped_mm_reads(stack[:, :, ::2])
    assert not moe._grouped_mm_reads(torch.zeros(4, 32, 63)[:, :, :60])


def test_bf16_separate_and_strided_stacks_opcheck_and_bad_input():
    x, ids, weights, gate_up, down = [a.cpu() for a in _bf16_inputs(5, 4, dtype=torch.float32)]
    gate, down_kn, up = _weight_layouts(gate_up, down)["w1 / w3 [E, K, N]"]
    op = torch.ops.dsfuse.moe_experts_bf16
    assert torch.equal(op(x, ids, weights, gate, down_kn, 0, None, up),
                       moe.moe_experts_bf16_reference(x, ids, weights, gate, down_kn, up=up))
    torch.library.opcheck(op.default, (x, ids, weights, gate, down_kn, 0, None, up))
    torch.library.opcheck(op.default, (x, ids, weights, _stored_kn(gate_up), down_kn, 0, 0.5))
    with pytest.raises(ValueError, match="up must be"):
        op(x, ids, weights, gate, down, 0, None, up[:, :-1])
    with pytest.raises(ValueError, match="with up given, gate_up must be the gate stack"):
        op(x, ids, weights, gate[:, :, :-1], down, 0, None, up)
    with pytest.raises(TypeError, match="up dtype"):
        op(x, ids, weights, gate, down, 0, None, up.double())


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
        assert moe._grouped_mm_applies(x, gate_up, ids.numel(), down) == (T == 300)  # decode tiles / CUTLASS prefill
        assert _rel_err(torch.ops.dsfuse.moe_experts_bf16(*args, 0), moe.moe_experts_bf16_reference(*args)) < 1e-2
        for layout, (gate, down_view, up) in _weight_layouts(gate_up, down).items():
            assert moe._grouped_mm_applies(x, gate, ids.numel(), down_view, up) == (T == 300), layout
            out = torch.ops.dsfuse.moe_experts_bf16(x, ids, weights, gate, down_view, 0, None, up)
            ref = moe.moe_experts_bf16_reference(x, ids, weights, gate, down_view, up=up)
            assert _rel_err(out, ref) < 1e-2, layout
            triton_out = moe.moe_experts_bf16_triton(x, ids, weights, gate, down_view, up=up, config={"gemm": "triton"})
            one_stack = moe.moe_experts_bf16_triton(*args, config={"gemm": "triton"})
            assert torch.equal(triton_out.view(torch.int16), one_stack.view(torch.int16)), layout
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


# ---------------------------------------------------------------------------------------------------------------
# Decode schedule and tiles (`compact_tiles`, `slot_tiles`, `split_k`, `combine_unroll`, DECODE_CANDIDATES)
# ---------------------------------------------------------------------------------------------------------------

DECODE_INTER = 160  # not a multiple of 64 or 128: masked K tails in the down GEMM's split slices


def test_compact_tile_list_length():
    """At most T*k tiles (each used tile holds a slot) and at most T*k // BM + E; the old length is the latter."""
    assert moe.num_schedule_tiles(6, 256, 16) == 6 and moe.num_schedule_tiles(6, 256, 16, compact=False) == 256
    assert moe.num_schedule_tiles(48, 256, 16) == 48 and moe.num_schedule_tiles(4096 * 8, 32, 256) == 160
    assert moe.moe_default_config(6, 256, fp4=False, tokens=1)["slot_tiles"]
    assert not moe.moe_default_config(48, 256, fp4=False, tokens=8)["slot_tiles"]


@pytest.mark.parametrize("triton_routing", [False, True])
def test_compact_schedule_covers_every_slot_when_the_bound_is_tight(triton_routing):
    """T*k slots on T*k different experts need exactly T*k tiles, the compact list's whole length."""
    ids = torch.tensor([[5, 0, 7, 2, 6, 1]])
    schedule = moe.build_tile_schedule_triton if triton_routing else moe.build_tile_schedule
    order, start, end, expert = schedule(ids.to(DEVICE), 8, 0, 16)
    start, end, expert, order = start.cpu(), end.cpu(), expert.cpu(), order.cpu()
    assert start.numel() == 6 and bool((end > start).all())
    covered = sorted(int(order[s]) for s, e in zip(start.tolist(), end.tolist()) for s in range(s, e))
    assert covered == list(range(6))
    assert [int(ids.view(-1)[order[s]]) for s in start.tolist()] == expert.tolist()


@pytest.mark.parametrize("name", sorted(moe.DECODE_CANDIDATES))
@pytest.mark.parametrize("T,k", [(1, 6), (3, 5)])
def test_decode_candidates_match_reference(name, T, k):
    """Every decode candidate the GPU sweep times, through the interpreter, clamped SwiGLU, K and N tails (H 96,
    I 160: the split candidates cut the down GEMM's K into slices of 128 and a 32-column tail). Candidates that only
    change the schedule (which programs run, the combine's loop) give the legacy schedule's output bit for bit."""
    args = _bf16_inputs(T, k, seed=T, inter=DECODE_INTER)
    config = moe.DECODE_CANDIDATES[name]
    out = moe.moe_experts_bf16_triton(*args, swiglu_limit=0.5, config=config)
    ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in args], swiglu_limit=0.5)
    assert out.dtype == ref.dtype and _rel_err(out, ref.to(out.device)) < 1e-2
    if set(config) <= {"compact_tiles", "slot_tiles", "combine_unroll"} or config == moe.LEGACY_SCHEDULE:
        legacy = moe.moe_experts_bf16_triton(*args, swiglu_limit=0.5, config=moe.LEGACY_SCHEDULE)
        assert torch.equal(out.view(torch.int16), legacy.view(torch.int16))


@pytest.mark.parametrize("slot_tiles", [False, True])
def test_decode_schedules_never_read_non_local_slots(slot_tiles):
    """T = 1 and 2 on a rank holding global experts 8..11: NaN router weights on other ranks' slots, and a token with
    no local slot has NaN features; slot tiles read the ids themselves and must skip those slots too."""
    for ids in ([[8, 1, 11, 30]], [[8, 1, 11, 30], [0, 2, 3, 100]]):
        ids = torch.tensor(ids, device=DEVICE)
        x, _, weights, gate_up, down = _bf16_inputs(ids.shape[0], 4, num_experts=4, inter=DECODE_INTER)
        non_local = (ids < 8) | (ids >= 12)
        x = x.masked_fill(non_local.all(dim=1, keepdim=True), float("nan"))
        weights = weights.masked_fill(non_local, float("nan"))
        args = (x, ids, weights, gate_up, down)
        for split_k in (1, 2):
            out = moe.moe_experts_bf16_triton(*args, local_expert_offset=8,
                                              config={"slot_tiles": slot_tiles, "split_k": split_k})
            ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in args], local_expert_offset=8)
            assert torch.isfinite(out).all() and _rel_err(out, ref.to(out.device)) < 1e-2
            assert (out[non_local.all(dim=1)] == 0).all()


def test_slot_tiles_with_repeated_experts():
    """Slot tiles at T > 1 (forced) with every slot on two experts: each slot reads its expert's weights again."""
    ids = torch.tensor([[3, 1], [1, 3], [3, 1], [1, 3], [3, 1]])
    args = _bf16_inputs(5, 2, expert_ids=ids, inter=DECODE_INTER)
    out = moe.moe_experts_bf16_triton(*args, config={"slot_tiles": True})
    routed = moe.moe_experts_bf16_triton(*args, config={"slot_tiles": False})
    ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in args])
    assert _rel_err(out, ref.to(out.device)) < 1e-2 and torch.equal(out.view(torch.int16), routed.view(torch.int16))


@pytest.mark.parametrize("split_k,block_k,slices", [(2, 64, 2), (4, 64, 3), (8, 128, 2)])
def test_split_k_down_projection_is_the_reference_up_to_summation_order(split_k, block_k, slices):
    """The down GEMM in K slices (fp32 partials summed by the combine in slice order, rounded once): fp32 inputs
    agree with the reference to fp32 summation order, half inputs to the usual half tolerance. I = 160 with BK 64
    gives slices of 128 and 32 columns for split 2 and 64/64/32 for split 4 (three, not four: no slice is empty)."""
    assert moe.down_splits(DECODE_INTER, split_k, block_k)[0] == slices
    config = {"split_k": split_k, "block_k": block_k}
    for T, k in ((1, 6), (7, 3)):
        args = _bf16_inputs(T, k, dtype=torch.float32, seed=T, inter=DECODE_INTER)
        out = moe.moe_experts_bf16_triton(*args, config=config)
        ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in args])
        assert _rel_err(out, ref.to(out.device)) < 1e-5
        half = [a.to(HALF) if a.is_floating_point() and a is not args[2] else a for a in args]
        out = moe.moe_experts_bf16_triton(*half, swiglu_limit=0.5, config=config)
        ref = moe.moe_experts_bf16_reference(*[a.cpu() for a in half], swiglu_limit=0.5)
        assert _rel_err(out, ref.to(out.device)) < 1e-2


def test_fp4_split_k_and_slot_tiles():
    """The FP4 op through the same decode keys: K slices start at a multiple of BLOCK_K, so the scale blocks line up."""
    assert moe.down_splits(128, 2, 64)[0] == 2
    split = {"split_k": 2, "block_k": 64}
    for T, config in ((1, split), (1, {"slot_tiles": False}), (6, split)):
        args = _inputs(T, 3, inter=128, seed=T)
        out = moe.moe_experts_fp4_triton(*args, config=config)
        ref = moe.moe_experts_reference(*[a.cpu() for a in args]).to(out.device)
        assert _rel_err(out, ref) < 1e-2


def test_split_k_rejects_bad_values():
    args = _bf16_inputs(1, 2)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="split_k must be a positive int"):
            moe.moe_experts_bf16_triton(*args, config={"split_k": bad})


@pytest.mark.parametrize("slot_tiles,split_k", [(True, 1), (True, 2), (False, 1), (False, 2)])
def test_gemms_write_only_rows_of_local_slots(slot_tiles, split_k):
    """Both GEMMs into sentinel-filled buffers, a rank holding global experts 8..11 (and ids past the stack):
    rows of local slots are written, every other row keeps the sentinel, so no program ran for another rank's slot
    (with slot tiles such a program would index the weight stack with an out-of-range expert: id 13 is local
    expert 5 of 4)."""
    ids = torch.tensor([[8, 1, 11, 13], [9, 10, 2, 8]], device=DEVICE)
    x, _, _, gate_up, down = _bf16_inputs(2, 4, num_experts=4, inter=DECODE_INTER)
    cfg = {**moe._moe_config(2, 4, 4, False, None), "slot_tiles": slot_tiles, "split_k": split_k}
    splits = moe.down_splits(DECODE_INTER, split_k, cfg["block_k"])[0]
    assert splits == split_k
    sentinel = 7.0
    act = torch.full((8, DECODE_INTER), sentinel, dtype=HALF, device=DEVICE)
    slot_out = torch.full((splits, 8, HIDDEN), sentinel, dtype=torch.float32 if splits > 1 else HALF, device=DEVICE)
    moe._expert_gemms(x, ids, gate_up, gate_up, down, down, 8, DECODE_INTER, False, None, cfg, (act, slot_out))
    local = ((ids >= 8) & (ids < 12)).view(-1).cpu()
    # act rows: by slot with slot tiles, expert-sorted (local slots first) otherwise
    act_rows = local if slot_tiles else torch.arange(8) < int(local.sum())
    act, slot_out = act.cpu(), slot_out.cpu()
    assert (act[~act_rows] == sentinel).all() and (act[act_rows] != sentinel).any(dim=1).all()
    assert (slot_out[:, ~local] == sentinel).all() and (slot_out[:, local] != sentinel).any(dim=2).all()


def test_combine_sums_split_partials_in_order_and_rounds_once():
    """Split-K partials are added in slice order in fp32 and the sum is rounded once to x's dtype before the router
    product, as the unsplit GEMM rounds its output. Three slots, router weights 1. fp32: partials (1, 2^-24, 2^-24)
    sum to 1 in that order (each 2^-24 is a tie that rounds to even), to 1 + 2^-23 in the reverse one: the token is 3,
    not 3 + 2^-21. fp16: partials (1, 0.4 ulp(1)) round to 1, so the token is 3; unrounded the three would sum to
    3 + 1.2 ulp(1) = 3 + 0.6 ulp(3), which rounds to 3 + ulp(3)."""
    ids = torch.zeros(1, 3, dtype=torch.int64, device=DEVICE)
    router = torch.ones(3, dtype=torch.float32, device=DEVICE)
    for dtype, partials, want in ((torch.float32, (1.0, 2.0**-24, 2.0**-24), 3.0),
                                  (torch.float16, (1.0, 0.4 * 2.0**-10), 3.0)):
        planes = torch.tensor(partials, dtype=torch.float32).view(-1, 1, 1).expand(-1, 3, 4).contiguous()
        out = torch.empty(1, 4, dtype=dtype, device=DEVICE)
        moe._combine(planes.to(DEVICE), None, ids, router, out, 0, 1, torch.float32, torch.float32)
        assert (out.cpu() == want).all(), (dtype, out)


# ---------------------------------------------------------------------------------------------------------------
# Offline sm_90 compile of the decode kernels (no GPU)
# ---------------------------------------------------------------------------------------------------------------

# Runs in a subprocess without TRITON_INTERPRET (the interpreter replaces the JIT functions `triton.compile` needs).
# V4-Flash decode shapes, integer arguments specialised as the launcher does (== 1 becomes a constant, multiples of 16
# get the divisibility hint), so the code is what the H200 runs; prints shared memory per CTA and the MMA used.
SM90_COMPILE_SCRIPT = sm90_offline.PROBE_PREAMBLE + r"""
import triton.language as tl
import dsfuse.kernels.moe_experts as m

H, I, E, K = 4096, 2048, 256, 6  # DeepSeek V4-Flash routed experts
INT32_POINTERS = {"sorted_slot_ptr", "tile_row_start_ptr", "tile_row_end_ptr", "tile_expert_ptr", "rank_ptr",
                  "row_of_slot_ptr"}


def compile_sm90(fn, constexprs, ints, options, pointers):
    pointer = lambda name: pointers.get(name, "*i32" if name in INT32_POINTERS else "*bf16")  # noqa: E731
    # A separate up stack's distance from the gate stack does not fit 32 bits: the launcher passes it as i64.
    scalars = {"UP_OFFSET": "i64"} if ints.get("UP_OFFSET", 0) >= 2**31 else None
    return sm90_offline.compile_sm90(fn, constexprs, ints, options, pointer, scalars)


def gemms(T, overrides, stored_kn=False):  # stored_kn: w1, w3 and down stored [E, K, N], read as transposed views
    cfg = {**m.moe_default_config(T * K, E, fp4=False, tokens=T), **overrides}
    n = T * K
    splits, k_split = m.down_splits(I, cfg["split_k"], cfg["block_k"])
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    common = dict(BLOCK_M=cfg["block_m"], BLOCK_K=cfg["block_k"], FP4=False, DECODE_ASM=False,
                  DOT_PRECISION="tf32", SLOT_TILES=bool(cfg["slot_tiles"]))
    ids = {"ids_ptr": "*i64", "s_ptr": "*bf16"}
    if stored_kn:
        gate_strides = dict(stride_we=I * H, stride_wn=1, stride_wk=I, UP_OFFSET=2**33 + 16)
        down_strides = dict(stride_we=H * I, stride_wn=1, stride_wk=H)
    else:
        gate_strides = dict(stride_we=2 * I * H, stride_wn=H, stride_wk=1, UP_OFFSET=I * H)
        down_strides = dict(stride_we=H * I, stride_wn=I, stride_wk=1)
    gate_up = (m._gate_up_swiglu_kernel, dict(common, BLOCK_N=cfg["block_n1"], SWIGLU_LIMIT=10.0),
               dict(stride_xt=H, **gate_strides, stride_se=2 * I * H, stride_sn=H, stride_am=I,
                    H=H, INTER=I, TOP_K=K, LOCAL_LO=0, NUM_EXPERTS=E), options, ids)
    down = (m._down_kernel, dict(common, BLOCK_N=cfg["block_n2"], SPLIT_K=splits),
            dict(stride_am=I, **down_strides, stride_se=H * I, stride_sn=I, stride_os=n * H,
                 stride_om=H, H=H, INTER=I, LOCAL_LO=0, NUM_EXPERTS=E, K_SPLIT=k_split), options,
            dict(ids, slot_out_ptr="*fp32" if splits > 1 else "*bf16"))
    combine = (m._combine_kernel, dict(TOP_K=K, BLOCK_H=1024, ROUTER_DTYPE=tl.float32, PRODUCT_DTYPE=tl.float32,
                                       ROW_MAP=False, SPLIT_K=splits, UNROLL=bool(cfg["combine_unroll"])),
               dict(stride_os=n * H, stride_om=H, stride_ot=H, H=H, LOCAL_LO=0, LOCAL_HI=E), dict(num_warps=4),
               dict(slot_out_ptr="*fp32" if splits > 1 else "*bf16", row_of_slot_ptr="*i64", expert_ids_ptr="*i64",
                    router_ptr="*fp32"))
    return {"gate_up": gate_up, "down": down, "combine": combine}


def fp4_gemms(T, overrides, E=32, H=7168, I=2048, K=8):  # the FP4 op's GEMMs (PTX decode), V3.2 layer shape
    cfg = {**m.moe_default_config(T * K, E, fp4=True, tokens=T), **overrides}
    splits, k_split = m.down_splits(I, cfg["split_k"], cfg["block_k"])
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    common = dict(BLOCK_M=cfg["block_m"], BLOCK_K=cfg["block_k"], FP4=True, DECODE_ASM=True, DOT_PRECISION="tf32",
                  SLOT_TILES=bool(cfg["slot_tiles"]))
    pointers = {"ids_ptr": "*i64", "w_ptr": "*u8", "s_ptr": "*u8"}
    gate_up = (m._gate_up_swiglu_kernel, dict(common, BLOCK_N=cfg["block_n1"], SWIGLU_LIMIT=None),
               dict(stride_xt=H, stride_we=I * H, stride_wn=H // 2, stride_wk=1, stride_se=2 * I * H // 32,
                    stride_sn=H // 32, stride_am=I, H=H, INTER=I, UP_OFFSET=I * H // 2, TOP_K=K, LOCAL_LO=0,
                    NUM_EXPERTS=E), options, pointers)
    down = (m._down_kernel, dict(common, BLOCK_N=cfg["block_n2"], SPLIT_K=splits),
            dict(stride_am=I, stride_we=H * I // 2, stride_wn=I // 2, stride_wk=1, stride_se=H * I // 32,
                 stride_sn=I // 32,
                 stride_os=T * K * H, stride_om=H, H=H, INTER=I, LOCAL_LO=0, NUM_EXPERTS=E, K_SPLIT=k_split),
            options, dict(pointers, slot_out_ptr="*fp32" if splits > 1 else "*bf16"))
    return {"gate_up": gate_up, "down": down}


cases = {}
for T in (1, 8):
    for name, overrides in m.DECODE_CANDIDATES.items():
        for kernel, case in gemms(T, overrides).items():
            cases[f"T{T} {name} {kernel}"] = case
for T in (1, 8, 4096):
    for kernel, case in gemms(T, {}, stored_kn=True).items():
        cases[f"[E, K, N] T{T} {kernel}"] = case
for T, name, overrides in ((1, "default", {}), (64, "default", {}), (64, "split2", {"split_k": 2}),
                           (4096, "default", {})):
    for kernel, case in fp4_gemms(T, overrides).items():
        cases[f"fp4 T{T} {name} {kernel}"] = case
for row_maps in (False, True):
    cases[f"routing T8 row maps {row_maps}"] = (
        m._routing_kernel, dict(BLOCK_M=16, E_PAD=512, CHUNK=16, ROW_MAPS=row_maps),
        dict(N=48, LOCAL_LO=0, NUM_EXPERTS=E, MAX_TILES=48, TOP_K=6), dict(num_warps=4), {"ids_ptr": "*i64"})
seen = {}
for name, (fn, constexprs, ints, options, pointers) in cases.items():
    key = (fn.__name__, json.dumps(constexprs, sort_keys=True, default=str), json.dumps(ints, sort_keys=True),
           json.dumps(options, sort_keys=True), json.dumps(pointers, sort_keys=True))
    if key in seen:
        continue
    seen[key] = name
    try:
        compiled = compile_sm90(fn, constexprs, ints, options, pointers)
        ptx = compiled.asm["ptx"]
        print(json.dumps({"case": name, "ok": True, "shared": compiled.metadata.shared,
                          "mma": "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else None}),
              flush=True)
    except Exception as error:
        chain = []
        while error is not None:
            chain.append(f"{type(error).__name__}: {str(error)[-600:]}")
            error = error.__cause__ or error.__context__
        print(json.dumps({"case": name, "ok": False, "error": chain[-2:]}), flush=True)
"""


def test_decode_candidates_compile_for_sm90_offline():
    """Both GEMMs and the combine of every decode candidate at T = 1 and 8 (V4-Flash shapes), the routing kernel, and
    the FP4 op's GEMMs (V3.2 shape: T=1 slot tiles, T=64 with and without split K, T=4096 prefill tiles) and the bf16
    GEMMs over stacks stored [E, K, N] with w1 and w3 apart (T = 1, 8, 4096) compile for sm_90 with the installed Triton and fit an H100/H200 SM's 227 KB of shared memory (a config past it compiles but
    fails to launch). BN < 64 runs mma.sync (one warpgroup's wgmma needs 64 rows), the rest wgmma."""
    lines = sm90_offline.run_probe(SM90_COMPILE_SCRIPT, timeout=600, env_defaults={"TRITON_DEFAULT_FP_FUSION": "1"})
    failed = {line["case"]: line["error"] for line in lines if not line["ok"]}
    assert not failed, failed
    cases = {line["case"]: line for line in lines}
    for name in moe.DECODE_CANDIDATES:
        assert f"T1 {name} combine" in cases or f"T1 {name} down" in cases or name == "routed", name
    assert all(line["shared"] <= 227 * 1024 for line in lines), {c: v["shared"] for c, v in cases.items()}
    assert cases["T1 default gate_up"]["shared"] == 147456 and cases["T1 default gate_up"]["mma"] == "wgmma"
    assert cases["T1 bn32_s6 gate_up"]["mma"] == "mma.sync" and cases["T1 bn64 down"]["mma"] == "wgmma"
    assert cases["routing T8 row maps False"]["ok"] and cases["routing T8 row maps True"]["ok"]
    assert "T8 split2 combine" in cases
    fp4 = [f"fp4 T{T} default {k}" for T in (1, 64, 4096) for k in ("gate_up", "down")] + ["fp4 T64 split2 down"]
    assert all(cases[name]["mma"] == "wgmma" for name in fp4)
    stored_kn = [f"[E, K, N] T{T} {k}" for T in (1, 8, 4096) for k in ("gate_up", "down")]
    assert all(cases[name]["mma"] == "wgmma" for name in stored_kn)
