"""`moe_experts` on transformers' experts (grouped_mm, its fp32 fallback, batched_mm, expert parallel, the eager
loop) and dsfuse's own FP4 experts (grouped and batched, several spellings of the FP4 decode): exact site counts,
parity with eager, near-misses with their reasons, dynamic token counts."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import dsfuse
from dsfuse.models import build_own_model, official
from dsfuse.models.official import E2M1_VALUES, FP4_BLOCK_SIZE
from dsfuse.models.presets import build_hf_model
from dsfuse.passes import PassContext, run_pass
from dsfuse.passes.moe_experts import EAGER_LOOP_REASON

HIDDEN, EXPERTS, TOP_K = 64, 8, 2


def _compile(fn, **kw):
    return torch.compile(fn, backend="dsfuse", options={"enable": ["moe_experts"]}, **kw)


def _routing(tokens, seed=0, sentinel=False):
    """Distinct expert ids per token and positive weights; with `sentinel`, some slots belong to another rank."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
    if sentinel:
        off_rank = torch.rand(tokens, TOP_K, generator=gen) < 0.4
        ids = ids.masked_fill(off_rank, EXPERTS)
        weights = weights.masked_fill(off_rank, 0.0)
    return ids, weights


def _tokens(tokens, dtype, seed=0):
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _hf_experts(impl, dtype, layer=1, **overrides):
    return build_hf_model("tiny", dtype=dtype, experts_implementation=impl, **overrides).model.layers[layer].mlp


def _sites(op):
    return [s for s in dsfuse.report().sites if s.op == op]


def _close(got, want):
    tol = 1e-5 if want.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_hf_grouped_mm_two_moe_layers_and_dynamic_tokens():
    """Two MoE layers of the real model (router, grouped_mm experts, shared expert): one site per layer, and
    one graph with a symbolic token count serves every length."""
    model = build_hf_model("tiny", dtype=torch.bfloat16, num_hidden_layers=3)
    assert model.config._experts_implementation == "grouped_mm"
    moe1, moe2 = model.model.layers[1].mlp, model.model.layers[2].mlp

    def two_layers(h):
        return moe2(moe1(h))

    compiled = _compile(two_layers, dynamic=True)
    with torch.no_grad():
        for seq in (7, 11, 16):
            h = torch.randn(2, seq, HIDDEN, generator=torch.Generator().manual_seed(seq)).to(torch.bfloat16)
            _close(compiled(h), two_layers(h))
    rep = dsfuse.report()
    assert len(rep.graphs) == 1, str(rep)
    assert rep.counts["moe_experts"] == 2, str(rep)
    assert {s.op for s in rep.sites} == {"dsfuse.moe_experts_bf16"}
    assert all("grouped GEMMs, inverse permutation + sum, E=8, k=2" in s.detail for s in rep.sites)
    assert rep.near_misses == []


@pytest.mark.parametrize("impl,dtype", [("grouped_mm", torch.float32), ("batched_mm", torch.bfloat16)],
                         ids=["grouped-fp32-fallback", "batched-bf16"])
def test_hf_experts_forms(impl, dtype):
    """fp32 grouped_mm runs transformers' `grouped_mm_fallback` op; batched_mm gathers weights per slot."""
    experts = _hf_experts(impl, dtype).experts
    x, (ids, weights) = _tokens(10, dtype), _routing(10)
    with torch.no_grad():
        out = _compile(experts)(x, ids, weights)
        _close(out, experts(x, ids, weights))
    rep = dsfuse.report()
    assert len(_sites("dsfuse.moe_experts_bf16")) == 1, str(rep)
    assert rep.near_misses == []


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_hf_expert_parallel_sentinel(impl):
    """transformers' EP path: off-rank slots carry the sentinel id E with weight 0; the fused op skips them."""
    experts = _hf_experts(impl, torch.bfloat16).experts
    experts._is_expert_parallel = True
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10, sentinel=True)
    assert (ids == EXPERTS).any()
    with torch.no_grad():
        out = _compile(experts)(x, ids, weights)
        _close(out, experts(x, ids, weights))
    sites = _sites("dsfuse.moe_experts_bf16")
    assert len(sites) == 1, str(dsfuse.report())
    assert "expert-parallel sentinel slots skipped" in sites[0].detail


def test_hf_grouped_mm_cuda_form_on_meta_tensors():
    """Structural: off the CPU, HF counts experts with `histc` over int32 ids; traced on meta tensors with
    Inductor's decompositions (the post-grad op set) the block still matches."""
    experts = _hf_experts("grouped_mm", torch.bfloat16).experts.to("meta")

    def forward(x, ids, weights, gate_up, down):
        return torch.func.functional_call(experts, {"gate_up_proj": gate_up, "down_proj": down}, (x, ids, weights))

    args = (torch.empty(10, HIDDEN, dtype=torch.bfloat16, device="meta"),
            torch.zeros(10, TOP_K, dtype=torch.int64, device="meta"), torch.empty(10, TOP_K, device="meta"),
            experts.gate_up_proj, experts.down_proj)
    gm = make_fx(torch.func.functionalize(forward), decomposition_table=select_decomp_table(),
                 tracing_mode="fake")(*args)
    histc = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.histc.default)
    assert histc.args[0].args[1] == torch.int32
    ctx = PassContext(name="moe_experts")
    run_pass("moe_experts", gm.graph, ctx)
    assert [s.op for s in ctx.sites] == ["dsfuse.moe_experts_bf16"] and ctx.near_misses == []


def test_hf_eager_loop_is_a_reported_near_miss_and_stays_correct():
    experts = _hf_experts("eager", torch.bfloat16).experts
    x, ids, weights = _tokens(3, torch.bfloat16), torch.tensor([[0, 1], [1, 2], [0, 2]]), torch.rand(3, TOP_K)
    with torch.no_grad():
        _close(_compile(experts)(x, ids, weights), experts(x, ids, weights))
    rep = dsfuse.report()
    assert rep.counts["moe_experts"] == 0
    assert [m.reason for m in rep.near_misses] == [EAGER_LOOP_REASON], str(rep)


# --- dsfuse's own FP4 experts ------------------------------------------------------------------------------------


def _own_experts(dtype):
    return build_own_model("own-tiny", dtype=dtype).model.layers[1].mlp.experts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["grouped-bf16", "batched-fp32"])
def test_own_fp4_experts(dtype):
    experts = _own_experts(dtype)
    x, (ids, weights) = _tokens(10, dtype), _routing(10)
    with torch.no_grad():
        out = _compile(experts)(x, ids, weights)
        want = experts(x, ids, weights)
    # The fused op sums each token's slots in fp32 (the module adds them in x's dtype in expert order).
    _close(out, want)
    sites = _sites("dsfuse.moe_experts_fp4")
    assert len(sites) == 1, str(dsfuse.report())
    assert sites[0].detail.endswith("index_add, E=8, k=2")
    assert [i.split(":")[1].split("[")[0] for i in sites[0].inputs[3:]] == ["uint8"] * 4


def test_own_fp4_experts_decoded_in_chunks(monkeypatch):
    """Large stacks are decoded a few experts at a time (`split` + `cat`): still one op on the whole stacks."""
    experts = _own_experts(torch.bfloat16)
    monkeypatch.setattr(official, "DEQUANT_CHUNK_ELEMENTS", 3 * 2 * experts.gate_up_proj[0].numel())
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    with torch.no_grad():
        _close(_compile(experts)(x, ids, weights), experts(x, ids, weights))
    sites = _sites("dsfuse.moe_experts_fp4")
    assert len(sites) == 1, str(dsfuse.report())
    assert sites[0].inputs[3].endswith("uint8[8x64x32]") and sites[0].inputs[5].endswith("uint8[8x64x16]")


def _lut_values(codes):
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def _arithmetic_values(codes):
    """E2M1 from its bits: sign, 2-bit exponent, 1-bit mantissa (subnormal when the exponent is 0)."""
    codes = codes.int()
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).float()
    magnitude = torch.where(exponent == 0, mantissa * 0.5, torch.exp2(exponent.float() - 1) * (1 + mantissa * 0.5))
    return torch.where(codes >= 8, -magnitude, magnitude)


def _exp2_scale(scales):
    powers = torch.exp2(scales.float() - 127)
    return torch.where(scales == 255, torch.full_like(powers, float("nan")), powers)


def _ldexp_scale(scales):
    powers = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.int() - 127)
    return powers.masked_fill(scales == 255, float("nan"))


def _pow_scale(scales):
    powers = torch.pow(2.0, scales.float() - 127)
    return torch.where(scales != 255, powers, torch.full_like(powers, float("nan")))


def _decoder(values, scale, high_first=False):
    def decode(packed, scales, dtype):
        low, high = packed & 0x0F, packed >> 4
        codes = torch.stack([high, low] if high_first else [low, high], dim=-1).flatten(-2)
        blocks = values(codes).unflatten(-1, (-1, FP4_BLOCK_SIZE)) * scale(scales).unsqueeze(-1)
        return blocks.flatten(-2).to(dtype)

    return decode


def _fp4_moe(decode, experts):
    """The own module's grouped forward with another FP4 decode spelling."""

    def forward(x, ids, weights):
        top_k = ids.shape[1]
        sorted_experts, order = torch.sort(ids.reshape(-1), stable=True)
        token = order // top_k
        counts = torch.histc(sorted_experts.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        w13 = decode(experts.gate_up_proj, experts.gate_up_proj_scale, x.dtype)
        gate, up = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        w2 = decode(experts.down_proj, experts.down_proj_scale, x.dtype)
        out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token, out)

    return forward


@pytest.mark.parametrize("values,scale", [(_arithmetic_values, _ldexp_scale), (_lut_values, _pow_scale)],
                         ids=["bit-arithmetic+ldexp", "lut+pow"])
def test_fp4_decode_spellings(values, scale):
    experts = _own_experts(torch.bfloat16)
    fn = _fp4_moe(_decoder(values, scale), experts)
    reference = _fp4_moe(_decoder(_lut_values, _exp2_scale), experts)
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    with torch.no_grad():
        assert torch.equal(fn(x, ids, weights), reference(x, ids, weights))
        _close(_compile(fn)(x, ids, weights), reference(x, ids, weights))
    assert len(_sites("dsfuse.moe_experts_fp4")) == 1, str(dsfuse.report())


def test_other_byte_decode_keeps_its_weights_and_says_why():
    """High nibble first is not the FP4 layout: the block is fused on the decoded stacks, with a near-miss."""
    experts = _own_experts(torch.bfloat16)
    fn = _fp4_moe(_decoder(_lut_values, _exp2_scale, high_first=True), experts)
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    with torch.no_grad():
        _close(_compile(fn)(x, ids, weights), fn(x, ids, weights))
    rep = dsfuse.report()
    assert len(_sites("dsfuse.moe_experts_bf16")) == 1 and not _sites("dsfuse.moe_experts_fp4"), str(rep)
    assert {m.reason for m in rep.near_misses} == {
        ("the FP4 nibbles do not decode to E2M1 values with the low nibble first (checked on all 256 bytes): "
         "fused with the decoded weight stack (moe_experts_bf16), not from the bytes")}


# --- near-misses and unrelated GEMMs ----------------------------------------------------------------------------


def _dense_moe(act):
    def forward(x, ids, weights, gate_up, down):
        top_k = ids.shape[1]
        sorted_experts, order = torch.sort(ids.reshape(-1))
        counts = torch.histc(sorted_experts.float(), bins=gate_up.shape[0], min=0, max=gate_up.shape[0] - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        activated = (act(gate) * up).to(down.dtype)
        out = torch._grouped_mm(activated, down.transpose(1, 2), offs=offsets)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return out[inverse].view(x.shape[0], top_k, -1).sum(1).to(x.dtype)

    return forward


def _dense_weights(dtype):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(EXPERTS, 64, HIDDEN, generator=gen).to(dtype) * 0.1,
            torch.randn(EXPERTS, HIDDEN, 32, generator=gen).to(dtype) * 0.1)


@pytest.mark.parametrize("act,reason", [
    (F.gelu, "the gate activation is not SiLU (the fused ops compute silu(gate) * up, or DeepSeek V4's "
              "silu(gate.clamp(max=L)) * up.clamp(-L, L))"),
    (lambda g: F.silu(g.float()), "SwiGLU is computed in torch.float32, not rounded to the GEMM dtype torch.bfloat16"),
], ids=["gelu", "fp32-swiglu"])
def test_unfusable_gate_is_a_reported_near_miss(act, reason):
    fn = _dense_moe(act)
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    args = (x, ids, weights, *_dense_weights(torch.bfloat16))
    with torch.no_grad():
        _close(_compile(fn)(*args), fn(*args))
    rep = dsfuse.report()
    assert rep.counts["moe_experts"] == 0
    assert [m.reason for m in rep.near_misses] == [reason], str(rep)


def test_weights_stored_k_major_are_a_reported_near_miss():
    """`is_transposed` experts keep `[E, K, N]` stacks; the fused ops read `[E, N, K]`."""

    def k_major(x, ids, weights, gate_up_t, down_t):
        return _dense_moe(F.silu)(x, ids, weights, gate_up_t.transpose(1, 2), down_t.transpose(1, 2))

    gate_up, down = _dense_weights(torch.bfloat16)
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    args = (x, ids, weights, gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous())
    with torch.no_grad():
        _close(_compile(k_major)(*args), k_major(*args))
    rep = dsfuse.report()
    assert rep.counts["moe_experts"] == 0
    assert [m.reason for m in rep.near_misses] == [
        "the expert weights are stored [E, K, N] (is_transposed); the fused ops take [E, N, K] as F.linear does"]


def test_unrelated_bmm_is_left_alone_silently():
    def attention_like(q, k):
        return torch.bmm(q, k.transpose(1, 2)).softmax(-1)

    _compile(attention_like)(torch.randn(2, 5, 8), torch.randn(2, 6, 8))
    rep = dsfuse.report()
    assert rep.counts["moe_experts"] == 0 and rep.near_misses == []
