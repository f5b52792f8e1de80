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
from dsfuse.passes import PassContext, moe_experts, run_pass
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


def _left_alone(fn, *args):
    """The report of `fn` compiled on `args`: eager's numbers, and no moe_experts site."""
    with torch.no_grad():
        _close(_compile(fn)(*args), fn(*args))
    rep = dsfuse.report()
    assert rep.counts["moe_experts"] == 0, str(rep)
    return rep


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
    rep = _left_alone(experts, x, ids, weights)
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


def test_own_fp4_experts_too_large_to_probe_keep_their_structural_match(monkeypatch):
    """Stacks over the verifier's probe budget (a real checkpoint's; here the budget is lowered) decoded one expert at
    a time: the slice has more nodes than the verifier walks, and the block is fused on its structural match (the FP4
    decode evaluated on every byte) instead of refused for the chunking, as the own model at V3.2's sizes was on the
    H200 (run 121)."""
    experts = build_own_model("own-tiny", dtype=torch.bfloat16, n_routed_experts=40).model.layers[1].mlp.experts
    monkeypatch.setattr(official, "DEQUANT_CHUNK_ELEMENTS", 2 * experts.gate_up_proj[0].numel())
    monkeypatch.setattr(moe_experts, "MAX_ELEMENTS", experts.gate_up_proj.numel())
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    with torch.no_grad():
        _close(_compile(experts)(x, ids, weights), experts(x, ids, weights))
    assert len(_sites("dsfuse.moe_experts_fp4")) == 1, str(dsfuse.report())
    assert not dsfuse.report().near_misses, str(dsfuse.report())


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


def _dense_moe(act=F.silu, swiglu=None):
    """A grouped experts block; `swiglu(gate, up)` replaces `act(gate) * up` when given."""
    swiglu = swiglu or (lambda gate, up: act(gate) * up)

    def forward(x, ids, weights, gate_up, down):
        top_k = ids.shape[1]
        sorted_experts, order = torch.sort(ids.reshape(-1))
        counts = torch.histc(sorted_experts.float(), bins=gate_up.shape[0], min=0, max=gate_up.shape[0] - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        activated = swiglu(gate, up).to(down.dtype)
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
    rep = _left_alone(fn, x, ids, weights, *_dense_weights(torch.bfloat16))
    assert [m.reason for m in rep.near_misses] == [reason], str(rep)


def test_every_block_is_checked_on_probes_against_the_reference(monkeypatch):
    """The matched slice runs on probes against the op's reference before it is rewritten: a block read with a
    SwiGLU clamp its graph does not compute (as a wrong structural reading would) is refused on the numbers."""
    read_swiglu = moe_experts._swiglu
    monkeypatch.setattr(moe_experts, "_swiglu", lambda *args: (*read_swiglu(*args)[:2], 0.5))
    fn = _dense_moe()
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    rep = _left_alone(fn, x, ids, weights, *_dense_weights(torch.bfloat16))
    (reason,) = [m.reason for m in rep.near_misses]
    assert reason.startswith("numeric check against the reference failed: random routing probe: outputs differ"), \
        reason


def test_group_offsets_from_outside_the_graph_are_reported():
    """`bincount(ids).cumsum(0)` as the offsets, in a helper: the graph breaks at bincount and the expert GEMMs' graph
    receives the offsets as an input; what they count cannot be checked, so the block is reported with that
    reason."""

    def offsets_of(flat_ids):
        return torch.bincount(flat_ids, minlength=EXPERTS).cumsum(0).to(torch.int32)

    def bincount_offsets(x, ids, weights, gate_up, down):
        sorted_experts, order = torch.sort(ids.reshape(-1))
        offsets = offsets_of(ids.reshape(-1))  # the break in a helper: Dynamo resumes after its return
        gate, up = torch._grouped_mm(x[order // TOP_K], gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, order // TOP_K, out)

    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    rep = _left_alone(bincount_offsets, x, ids, weights, *_dense_weights(torch.bfloat16))
    assert [m.reason for m in rep.near_misses] == [
        "the group offsets are an input of the compiled graph, not computed in it from the expert ids (a graph break "
        "before them, as at a torch.bincount, hides what they count)"], str(rep)


def _dense_loop(spread):
    """A loop over the experts that runs each on every token and weights its output by a dense [T, E] matrix of the
    router weights (`spread(ids, weights)`), summed in fp32."""

    def dense_loop(x, ids, weights, gate_up, down):
        dense_weights = spread(ids, weights)
        total = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(EXPERTS):
            gate, up = (x @ gate_up[e].t()).chunk(2, dim=-1)
            total = total + ((F.silu(gate) * up) @ down[e].t()).float() * dense_weights[:, e:e + 1]
        return total.to(x.dtype)

    return dense_loop


SPREADS = [lambda ids, weights: torch.zeros(ids.shape[0], EXPERTS).scatter(1, ids, weights),
           lambda ids, weights: (F.one_hot(ids, EXPERTS).float() * weights[..., None]).sum(1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spread", SPREADS, ids=["scatter", "one-hot sum"])
def test_dense_experts_loop_is_fused_once(spread, dtype):
    """A dense MoE (every expert on every token, the router weights scattered or one-hot summed over [T, E]) is the
    op with k = E: one site for the whole unrolled loop, eager's numbers."""
    fn = _dense_loop(spread)
    x, (ids, weights) = _tokens(10, dtype), _routing(10)
    args = (x, ids, weights, *_dense_weights(dtype))
    with torch.no_grad():
        _close(_compile(fn)(*args), fn(*args))
    rep = dsfuse.report()
    assert rep.counts["moe_experts"] == 1 and rep.near_misses == [], str(rep)
    (site,) = _sites("dsfuse.moe_experts_bf16")
    assert site.detail == f"dense GEMMs (every expert on every token, k = E), E={EXPERTS}", site.detail


def test_dense_experts_with_dynamic_tokens():
    """Under `dynamic=True` the token count is a symbol: the dense weights are still found (a size read off the
    routing is not them) and one graph serves two token counts with eager's numbers."""
    gate_up, down = _dense_weights(torch.bfloat16)
    experts = torch.nn.Module()
    experts.gate_up, experts.down = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
    fn = _dense_loop(SPREADS[1])
    compiled = _compile(lambda x, ids, weights: fn(x, ids, weights, experts.gate_up, experts.down), dynamic=True)
    for tokens in (5, 9):
        x, (ids, weights) = _tokens(tokens, torch.bfloat16), _routing(tokens)
        with torch.no_grad():
            _close(compiled(x, ids, weights), fn(x, ids, weights, gate_up, down))
    rep = dsfuse.report()
    assert len(rep.graphs) == 1 and rep.counts["moe_experts"] == 1 and rep.near_misses == [], str(rep)


def test_dense_experts_keep_the_nan_of_an_unrouted_expert():
    """The fused dense block runs every expert as the source does: an expert no token is routed to, holding NaN
    weights, still makes every output NaN (0 * NaN), as in eager."""
    fn = _dense_loop(SPREADS[0])
    gate_up, down = _dense_weights(torch.float32)
    gate_up[-1] = float("nan")
    x, (ids, weights) = _tokens(10, torch.float32), _routing(10)
    ids = ids.clamp(max=EXPERTS - 2)
    with torch.no_grad():
        got = _compile(fn)(x, ids, weights, gate_up, down)
    assert dsfuse.report().counts["moe_experts"] == 1
    assert got.isnan().all() and fn(x, ids, weights, gate_up, down).isnan().all()


def _fused_once(fn, *args):
    """The one moe_experts_bf16 site of `fn` compiled on `args`, after checking eager's numbers and no near-miss."""
    with torch.no_grad():
        _close(_compile(fn)(*args), fn(*args))
    rep = dsfuse.report()
    assert rep.counts["moe_experts"] == 1 and rep.near_misses == [], str(rep)
    (site,) = _sites("dsfuse.moe_experts_bf16")
    return site


def test_dense_experts_stored_k_major_are_fused_on_views():
    """A dense block over `[E, K, N]` stacks is the op on their transposed views, which it reads through their
    strides (nothing copied)."""
    gate_up, down = _dense_weights(torch.float32)

    def dense_k_major(x, ids, weights, gate_up_t, down_t):
        dense_weights = SPREADS[0](ids, weights)
        gate, up = torch.einsum("th,ehi->eti", x, gate_up_t).chunk(2, dim=-1)
        out = torch.einsum("eti,eih->eth", F.silu(gate) * up, down_t)
        return torch.einsum("eth,te->th", out, dense_weights)

    x, (ids, weights) = _tokens(10, torch.float32), _routing(10)
    site = _fused_once(dense_k_major, x, ids, weights, gate_up.transpose(1, 2).contiguous(),
                       down.transpose(1, 2).contiguous())
    assert site.detail.endswith("E=8, stacks stored [E, K, N] read transposed"), site.detail


@pytest.mark.parametrize("stored_kn", [False, True], ids=["[E, I, H]", "[E, H, I]"])
def test_dense_experts_with_w1_w3_apart_are_fused(stored_kn):
    """DeepSeek's w1 (gate) and w3 (up) as two stacks, the up GEMM written first: the op's gate and `up` arguments,
    in either layout."""
    gate_up, down = _dense_weights(torch.float32)
    w1, w3 = gate_up[:, :32].contiguous(), gate_up[:, 32:].contiguous()
    pattern = "th,ehi->eti" if stored_kn else "th,eih->eti"

    def dense_apart(x, ids, weights, w1, w3, down):
        up = torch.einsum(pattern, x, w3)
        out = torch.einsum("eti,ehi->eth", F.silu(torch.einsum(pattern, x, w1)) * up, down)
        return torch.einsum("eth,te->th", out, SPREADS[1](ids, weights))

    x, (ids, weights) = _tokens(10, torch.float32), _routing(10)
    stacks = (w1.transpose(1, 2).contiguous(), w3.transpose(1, 2).contiguous()) if stored_kn else (w1, w3)
    site = _fused_once(dense_apart, x, ids, weights, *stacks, down)
    assert "gate and up stacks apart" in site.detail and ("[E, K, N]" in site.detail) == stored_kn, site.detail


def test_loop_over_rows_picked_by_nonzero_is_reported():
    """The official inference loop (`idx, top = torch.where(ids == e)`, each expert on its own rows, accumulated into
    `y[idx]`) reaches the backend whole only when Dynamo captures data-dependent shapes; then it is reported for what
    it is, not as a dense MoE, and keeps eager's numbers."""
    gate_up, down = _dense_weights(torch.float32)

    def picked_rows(x, ids, weights, gate_up, down):
        y = torch.zeros_like(x)
        for e in range(EXPERTS):
            idx, top = torch.where(ids == e)
            gate, up = (x[idx] @ gate_up[e].t()).chunk(2, dim=-1)
            y[idx] += (F.silu(gate) * up) @ down[e].t() * weights[idx, top, None]
        return y

    x, (ids, weights) = _tokens(10, torch.float32), _routing(10)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        rep = _left_alone(picked_rows, x, ids, weights, gate_up, down)
    assert [m.reason for m in rep.near_misses] == [moe_experts.PICKED_ROWS_REASON], str(rep)


def test_weights_stored_k_major_are_fused_on_views():
    """`is_transposed` experts keep `[E, K, N]` stacks (`grouped_mm(rows, W)`): the op gets their transposed views."""

    def k_major(x, ids, weights, gate_up_t, down_t):
        return _dense_moe(F.silu)(x, ids, weights, gate_up_t.transpose(1, 2), down_t.transpose(1, 2))

    gate_up, down = _dense_weights(torch.bfloat16)
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    args = (x, ids, weights, gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous())
    site = _fused_once(k_major, *args)
    assert "stacks stored [E, K, N] read transposed" in site.detail, site.detail


def test_unrelated_bmm_is_left_alone_silently():
    def attention_like(q, k):
        return torch.bmm(q, k.transpose(1, 2)).softmax(-1)

    _compile(attention_like)(torch.randn(2, 5, 8), torch.randn(2, 6, 8))
    rep = dsfuse.report()
    assert rep.counts["moe_experts"] == 0 and rep.near_misses == []


# --- DeepSeek V4: clamped SwiGLU, hash and sqrtsoftplus routers --------------------------------------------------

V4_FAST = dict(hc_sinkhorn_iters=2, layer_types=["sliding_attention"] * 3)  # attention kinds do not matter here
V4_LIMIT = 10.0


def _v4_model(impl, dtype):
    """v4-tiny (layer 0 hash-routed, layers 1-2 sqrtsoftplus top-k) with expert weights large enough that the
    gate/up outputs (std ~16) cross the swiglu_limit on most slots, so the clamp decides the result."""
    model = build_hf_model("v4-tiny", dtype=dtype, experts_implementation=impl, **V4_FAST)
    assert model.config.swiglu_limit == V4_LIMIT and model.config.mlp_layer_types == ["hash_moe", "moe", "moe"]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * 2.0)
            experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * 0.05)
    return model


def _without_clamp(model):
    """The same model with the experts' limit out of reach (the shared experts keep theirs)."""
    for layer in model.model.layers:
        layer.mlp.experts.limit = float("inf")
    return model


def _assert_v4_sites(rep, kind, combine):
    sites = _sites("dsfuse.moe_experts_bf16")
    assert len(sites) == 3 and rep.counts["moe_experts"] == 3, str(rep)
    assert all(s.detail == f"{kind} GEMMs, {combine}, E=8, k=2, SwiGLU clamped at 10" for s in sites), str(rep)
    # The shared expert (a plain clamped MLP of mm's) stays with Inductor: only the routed stacks reach the op.
    assert all(s.inputs[3].endswith("[8x64x64]") and s.inputs[4].endswith("[8x64x32]") for s in sites), str(rep)
    assert rep.near_misses == [], str(rep)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_v4_moe_blocks_hash_and_topk_routers(impl, dtype=torch.float32):
    """v4-tiny's three MoE blocks (router, experts, shared expert), chained as the decoder stacks them: every
    one rewrites with the clamp, the hash-routed layer 0 included, and the result equals eager's and differs from the
    unclamped experts' (the clamp matters). Both expert forms (fp32 grouped_mm runs transformers' fallback op).
    (The whole model compiled gives the same three sites; at ~5 min of CPU compile it is not a CI test.)"""
    model = _v4_model(impl, dtype)
    blocks = [layer.mlp for layer in model.model.layers]

    def moe_layers(h, input_ids):
        for block in blocks:
            h = block(h, input_ids)
        return h

    gen = torch.Generator().manual_seed(1)
    h, input_ids = torch.randn(2, 5, HIDDEN, generator=gen).to(dtype), torch.randint(0, 256, (2, 5), generator=gen)
    with torch.no_grad():
        got, want = _compile(moe_layers)(h, input_ids), moe_layers(h, input_ids)
        unclamped = _without_clamp(model) and moe_layers(h, input_ids)
    # Outputs of a few tens after three layers: GEMMs summed in another order differ by an ulp of that size.
    scale = want.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)
    assert (unclamped.float() - want.float()).abs().max() > 0.1 * scale
    _assert_v4_sites(dsfuse.report(), "batched" if impl == "batched_mm" else "grouped",
                     "sum" if impl == "batched_mm" else "inverse permutation + sum")


def test_v4_experts_bf16_grouped_mm():
    """bf16 V4 experts run `aten._grouped_mm` (HF's V4 router itself needs fp32 hidden states next to its fp32
    weight, so the experts are driven directly here)."""
    experts = _v4_model("grouped_mm", torch.float32).model.layers[1].mlp.experts.to(torch.bfloat16)
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    with torch.no_grad():
        got, want = _compile(experts)(x, ids, weights), experts(x, ids, weights)
        experts.limit = float("inf")
        unclamped = experts(x, ids, weights)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    assert (unclamped.float() - want.float()).abs().max() > 0.1 * scale
    sites = _sites("dsfuse.moe_experts_bf16")
    assert len(sites) == 1, str(dsfuse.report())
    assert sites[0].detail == "grouped GEMMs, inverse permutation + sum, E=8, k=2, SwiGLU clamped at 10"
    assert dsfuse.report().near_misses == []


def _clamp_max_spelled(t, limit):
    return torch.where(t > limit, limit, t)


def _compile_clamped_moe(swiglu):
    """Compile a dense MoE block with this SwiGLU on bf16 inputs large enough for the clamps to bite; check parity
    with eager and return the report. Outputs of a few tens: bf16 GEMMs summed in another order differ by an ulp of
    that size."""
    fn = _dense_moe(swiglu=swiglu)
    gate_up, down = _dense_weights(torch.bfloat16)
    x, (ids, weights) = _tokens(10, torch.bfloat16), _routing(10)
    args = (x, ids, weights, gate_up * 20, down)
    with torch.no_grad():
        got, want = _compile(fn)(*args), fn(*args)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    return dsfuse.report()


@pytest.mark.parametrize("swiglu", [
    lambda g, u: F.silu(g.float().clamp(max=V4_LIMIT).to(g.dtype)) * u.float().clamp(-V4_LIMIT, V4_LIMIT).to(u.dtype),
    lambda g, u: (F.silu(_clamp_max_spelled(g, V4_LIMIT))
                  * _clamp_max_spelled(-_clamp_max_spelled(-u, V4_LIMIT), V4_LIMIT)),
    lambda g, u: F.silu(g.float().clamp(max=V4_LIMIT)).to(g.dtype) * u.clamp(-V4_LIMIT, V4_LIMIT),
], ids=["fp32-clamps-rounded-back", "where-and-negations", "fp32-clamp-and-silu"])
def test_clamped_swiglu_spellings(swiglu):
    """The clamps are recognised by what they compute around the limit, not by their ops."""
    rep = _compile_clamped_moe(swiglu)
    sites = _sites("dsfuse.moe_experts_bf16")
    assert len(sites) == 1 and sites[0].detail.endswith("SwiGLU clamped at 10"), str(rep)


@pytest.mark.parametrize("swiglu,reason", [
    (lambda g, u: F.silu(g.clamp(max=7.0)) * u.clamp(-V4_LIMIT, V4_LIMIT),
     "the up half is clamped to +-10, but the gate activation is not silu(gate.clamp(max=10)) in the GEMM dtype"),
    (lambda g, u: F.silu(g.clamp(-V4_LIMIT, V4_LIMIT)) * u.clamp(-V4_LIMIT, V4_LIMIT),
     "the up half is clamped to +-10, but the gate activation is not silu(gate.clamp(max=10)) in the GEMM dtype"),
    (lambda g, u: F.silu(g.clamp(max=V4_LIMIT)) * u.clamp(-5.0, V4_LIMIT),
     "the up half is transformed before the product, and not as a symmetric clamp up.clamp(-L, L)"),
    (lambda g, u: F.silu(g.clamp(max=V4_LIMIT)) * u,
     "the gate activation is not SiLU (the fused ops compute silu(gate) * up, or DeepSeek V4's "
     "silu(gate.clamp(max=L)) * up.clamp(-L, L))"),
], ids=["gate-limit-differs", "gate-clamped-below-too", "asymmetric-up", "gate-only"])
def test_clamps_the_ops_do_not_compute_are_reported(swiglu, reason):
    rep = _compile_clamped_moe(swiglu)
    assert rep.counts["moe_experts"] == 0
    assert [m.reason for m in rep.near_misses] == [reason], str(rep)


# --- the decode step `generate` compiles --------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_static_cache_decode_graph(batch):
    """`generate(cache_implementation="static", compile_config=...)` compiles the decode step; off the CPU
    transformers switches grouped_mm to batched_mm for it, so that is the form here. Batch 1 decodes one token per
    step, whose repeated rows have no token dim (T = 1): the experts still rewrite, and the tokens equal eager's."""
    from transformers.generation import CompileConfig

    model = build_hf_model("tiny", experts_implementation="batched_mm", num_hidden_layers=1,
                           mlp_layer_types=["sparse"], first_k_dense_replace=0)  # one MoE layer: a small compile
    ids = torch.randint(0, 256, (batch, 5), generator=torch.Generator().manual_seed(batch))
    config = CompileConfig(backend="dsfuse", mode=None, options={"enable": ["moe_experts"]})
    config._compile_all_devices = True  # transformers compiles the decode step on accelerators only by default
    kwargs = dict(max_new_tokens=3, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        got = model.generate(ids, compile_config=config, **kwargs)
    rep = dsfuse.report()
    assert len(rep.graphs) == 1, str(rep)
    sites = _sites("dsfuse.moe_experts_bf16")
    assert len(sites) == 1 and rep.counts["moe_experts"] == 1, str(rep)
    assert sites[0].detail == "batched GEMMs, sum, E=8, k=2" and sites[0].inputs[0].endswith(f"[{batch}x64]")
    assert [m for m in rep.near_misses if m.pass_name == "moe_experts"] == [], str(rep)
    assert torch.equal(got, want)
