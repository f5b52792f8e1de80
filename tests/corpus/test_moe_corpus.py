"""Spelling corpus for routed MoE experts: independent formulations of the same math (router top-k ids and weights
given, a SwiGLU MLP per expert, the weighted combine), and a few that only look like it, each with its declared
outcome, compiled with `backend="dsfuse"` on tiny CPU shapes. Every entry must end exactly as declared (rewritten /
reported near-miss with that reason / left alone) and agree with eager.

Each formulation is written after the code named in its `source`: the official DeepSeek V3 / V4 inference MoE
(a loop over experts with `torch.where(indices == i)`, separate w1/w3/w2, V4's clamped SwiGLU and FP4 experts),
vLLM's torch reference MoE (per-expert masks over repeated rows), SGLang's torch-native fallback, and transformers'
experts implementations (`grouped_mm`, `batched_mm`, the eager loop) with their router renormalisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from harness import LEFT_ALONE, NEAR_MISS, REWRITTEN, Entry, check_coverage, run_entry

from dsfuse.models.official import E2M1_VALUES, quantize_fp4

T, H, E, I, K = 6, 32, 8, 32, 2  # FP4 needs H and I multiples of 32
LIMIT = 4.0  # V4's swiglu_limit, low enough that the clamps bite on these inputs
FP8_BLOCK = 16  # block-scale tile of the FP8 weights (128 in the real checkpoints)


def _routing(seed=0):
    """Distinct expert ids per token (int64) and positive fp32 router weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return ids, torch.rand(T, K, generator=gen) + 0.1


def _stacks(seed=1, scale=0.2):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * scale).to(torch.bfloat16)
    down = (torch.randn(E, H, I, generator=gen) * scale).to(torch.bfloat16)
    return gate_up, down


def _tokens(seed=2):
    return (torch.randn(T, H, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


# --------------------------------------------------------------------------------------- shared steps
def _grouped_linear(rows, weight, offsets):
    """`rows` sorted by expert times each group's `weight[e]` in F.linear layout."""
    return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)


def _histc_offsets(sorted_ids):
    counts = torch.histc(sorted_ids.float(), bins=E, min=0, max=E - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def _inverse(perm):
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


# --------------------------------------------------------------------------------------- formulations
def hf_grouped_mm(x, ids, weights, gate_up, down):
    """transformers `grouped_mm_experts_forward`: sort the flat ids, gather `x[perm // k]`, histc offsets, fused
    gate/up grouped GEMM, `silu(gate) * up`, down GEMM, times the sorted weights, inverse permutation, [T,k,H] sum."""
    flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)
    sorted_ids, perm = torch.sort(flat_ids)
    offsets = _histc_offsets(sorted_ids)
    gate, up = _grouped_linear(x[perm // K], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, offsets) * flat_w[perm].unsqueeze(-1)
    return out[_inverse(perm)].view(T, K, H).sum(dim=1).to(x.dtype)


def hf_batched_mm(x, ids, weights, gate_up, down):
    """transformers `batched_mm_experts_forward`: every token repeated k times, each slot's expert weights gathered
    `W[ids]`, bmm against the row column, weights per slot, `view(T, k, H).sum(1)`."""
    rows = x.repeat_interleave(K, dim=0)
    flat_ids = ids.reshape(-1)
    proj = torch.bmm(gate_up[flat_ids], rows.unsqueeze(-1)).squeeze(-1)
    gate, up = proj.chunk(2, dim=-1)
    out = torch.bmm(down[flat_ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return (out * weights.reshape(-1).unsqueeze(-1)).view(T, K, H).sum(dim=1).to(x.dtype)


def sorted_index_add(x, ids, weights, gate_up, down):
    """Sort-based dispatch with a stable sort, weights cast to the activations' dtype before the product, and an
    `index_add_` of every slot's output into its token (the own FP4 module's combine, here on plain stacks)."""
    sorted_ids, order = torch.sort(ids.view(-1), stable=True)
    token = order // K
    offsets = _histc_offsets(sorted_ids)
    gate, up = _grouped_linear(x[token], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, offsets)
    out = out * weights.view(-1)[order].to(out.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token, out)


def bincount_offsets(x, ids, weights, gate_up, down):
    """Group sizes from `torch.bincount(ids, minlength=E)` (as the official inference code counts them). Dynamo
    breaks the graph at bincount (its output size depends on the ids' values), so the graph with the expert GEMMs
    receives the counts as an input and cannot see what they count: reported, not fused. `histc`, a one-hot sum or
    `searchsorted` keep the block in one graph."""
    sorted_ids, perm = torch.sort(ids.flatten())
    offsets = torch.bincount(sorted_ids, minlength=E).cumsum(0).to(torch.int32)
    gate, up = _grouped_linear(x[perm // K], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, offsets) * weights.flatten()[perm].unsqueeze(-1)
    return out[_inverse(perm)].view(T, K, H).sum(dim=1).to(x.dtype)


def searchsorted_offsets(x, ids, weights, gate_up, down):
    """Group ends read off the sorted ids with `searchsorted(sorted, arange(E), right=True)`: the number of slots
    whose expert is at most e, which is the cumulative count."""
    sorted_ids, perm = torch.sort(ids.flatten())
    offsets = torch.searchsorted(sorted_ids, torch.arange(E), right=True, out_int32=True)
    gate, up = _grouped_linear(x[perm // K], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, offsets) * weights.flatten()[perm].unsqueeze(-1)
    return out[_inverse(perm)].view(T, K, H).sum(dim=1).to(x.dtype)


def one_hot_count_offsets(x, ids, weights, gate_up, down):
    """Group sizes as a one-hot sum over the (unsorted) slots: counting does not care about the order."""
    flat_ids = ids.flatten()
    sorted_ids, perm = flat_ids.sort()
    counts = F.one_hot(flat_ids, E).sum(dim=0)
    offsets = counts.cumsum(dim=0).to(torch.int32)
    gate, up = _grouped_linear(x[perm // K], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, offsets) * weights.flatten()[perm].unsqueeze(-1)
    return out[_inverse(perm)].view(T, K, H).sum(dim=1).to(x.dtype)


def argsort_then_gather(x, ids, weights, gate_up, down):
    """`argsort` for the permutation and the sorted ids gathered with it, instead of sort's two outputs."""
    flat_ids = ids.flatten()
    perm = torch.argsort(flat_ids, stable=True)
    offsets = _histc_offsets(flat_ids[perm])
    token = torch.div(perm, K, rounding_mode="floor")
    gate, up = _grouped_linear(x[token], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, offsets)
    out = out * weights.flatten()[perm].to(out.dtype).unsqueeze(-1)
    return torch.zeros(T, H, dtype=out.dtype).index_add_(0, token, out)


def sigmoid_spelled_silu(x, ids, weights, gate_up, down):
    """SiLU spelled `g * sigmoid(g)`, the per-slot GEMMs as `matmul` of gathered weights against a row column."""
    rows = x.repeat_interleave(K, dim=0)
    flat_ids = ids.reshape(-1)
    proj = torch.matmul(gate_up[flat_ids], rows[:, :, None])[:, :, 0]
    gate, up = proj[:, :I], proj[:, I:]
    out = torch.matmul(down[flat_ids], (gate * torch.sigmoid(gate) * up)[:, :, None])[:, :, 0]
    return (out * weights.reshape(-1, 1)).view(T, K, H).sum(dim=1).to(x.dtype)


def v4_clamped_swiglu(x, ids, weights, gate_up, down):
    """DeepSeek V4's clamped SwiGLU (transformers DeepseekV4 experts): `silu(gate.clamp(max=L)) *
    up.clamp(-L, L)` between the grouped GEMMs."""
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    offsets = _histc_offsets(sorted_ids)
    gate, up = _grouped_linear(x[perm // K], gate_up, offsets).chunk(2, dim=-1)
    act = F.silu(torch.clamp(gate, max=LIMIT)) * torch.clamp(up, min=-LIMIT, max=LIMIT)
    out = _grouped_linear(act, down, offsets) * weights.reshape(-1)[perm].unsqueeze(-1)
    return out[_inverse(perm)].view(T, K, H).sum(dim=1).to(x.dtype)


def router_renormalised(x, router, bias, gate_up, down):
    """The whole DeepSeek V3 MoE step on the token rows: sigmoid scores, top-k of the bias-corrected scores, weights
    gathered from the uncorrected scores, renormalised and scaled, then transformers' grouped experts. The router
    stays with Inductor; the experts take its [T, k] weights."""
    scores = torch.sigmoid(x.float() @ router.t())
    ids = torch.topk(scores + bias, K, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * 2.5
    return hf_grouped_mm(x, ids, weights, gate_up, down)


def weights_after_view(x, ids, weights, gate_up, down):
    """vLLM `torch_moe` / SGLang torch-native combine: slot outputs viewed [T, k, H], times the weights viewed
    [T, k, 1] (cast to the outputs' dtype), summed over k."""
    rows = x.view(T, 1, H).repeat(1, K, 1).reshape(-1, H)
    flat_ids = ids.view(-1)
    proj = torch.bmm(gate_up[flat_ids], rows.unsqueeze(2)).squeeze(2)
    gate, up = proj.chunk(2, -1)
    out = torch.bmm(down[flat_ids], (F.silu(gate) * up).unsqueeze(2)).squeeze(2)
    return (out.view(T, K, H) * weights.view(T, K, 1).to(out.dtype)).sum(dim=1)


def einsum_combine(x, ids, weights, gate_up, down):
    """The k slot outputs combined by `einsum('tkh,tk->th')` with the router weights."""
    rows = x.repeat_interleave(K, dim=0)
    flat_ids = ids.reshape(-1)
    gate, up = torch.bmm(gate_up[flat_ids], rows.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    out = torch.bmm(down[flat_ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return torch.einsum("tkh,tk->th", out.view(T, K, H).float(), weights).to(x.dtype)


def _sorted_weighted_outputs(x, ids, weights, gate_up, down):
    """Sort-based dispatch: (each sorted slot's token, its weighted expert output)."""
    sorted_ids, perm = torch.sort(ids.reshape(-1), stable=True)
    token = perm // K
    offsets = _histc_offsets(sorted_ids)
    gate, up = _grouped_linear(x[token], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, offsets)
    return token, out * weights.reshape(-1)[perm].to(out.dtype)[:, None]


def scatter_add_combine(x, ids, weights, gate_up, down):
    """Sort-based dispatch whose weighted outputs are scattered back with `scatter_add_` over an expanded token
    index."""
    token, out = _sorted_weighted_outputs(x, ids, weights, gate_up, down)
    return torch.zeros_like(x).scatter_add_(0, token[:, None].expand(-1, H), out)


def scatter_reduce_combine(x, ids, weights, gate_up, down):
    """The same combine as `scatter_reduce(0, index, src, 'sum')`."""
    token, out = _sorted_weighted_outputs(x, ids, weights, gate_up, down)
    return torch.zeros_like(x).scatter_reduce(0, token[:, None].expand(-1, H), out, reduce="sum")


def separate_gate_up(x, ids, weights, w1, w3, w2):
    """DeepSeek V3 / V4 official experts keep w1 (gate) and w3 (up) apart: two grouped GEMMs of the same rows. The op
    reads the two stacks as its gate and `up` arguments (building one [E, 2I, H] stack in the graph would copy every
    expert's weights on every call)."""
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    offsets = _histc_offsets(sorted_ids)
    rows = x[perm // K]
    act = F.silu(_grouped_linear(rows, w1, offsets)) * _grouped_linear(rows, w3, offsets)
    out = _grouped_linear(act, w2, offsets) * weights.reshape(-1)[perm].unsqueeze(-1)
    return out[_inverse(perm)].view(T, K, H).sum(dim=1).to(x.dtype)


def hf_grouped_mm_transposed(x, ids, weights, gate_up_kn, down_kn):
    """transformers `grouped_mm_experts_forward` on `is_transposed` experts: stacks stored [E, K, N] (`[E, H, 2I]`,
    `[E, I, H]`) go to `grouped_mm` as they are; the op reads their transposed views."""
    sorted_ids, perm = torch.sort(ids.reshape(-1), stable=True)
    offsets = _histc_offsets(sorted_ids)
    gate, up = torch._grouped_mm(x[perm // K], gate_up_kn, offs=offsets).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down_kn, offs=offsets) * weights.reshape(-1)[perm].unsqueeze(-1)
    return out[_inverse(perm)].view(T, K, H).sum(dim=1).to(x.dtype)


def separate_stored_kn_per_slot(x, ids, weights, w1_kn, w3_kn, w2_kn):
    """w1 and w3 apart and every stack stored [E, K, N], each slot's rows times its gathered weights (`rows @ W[ids]`,
    the up GEMM written first)."""
    flat_ids = ids.reshape(-1)

    def linear(rows, stack_kn):
        return torch.bmm(rows.unsqueeze(1), stack_kn[flat_ids]).squeeze(1)

    rows = x.repeat_interleave(K, dim=0)
    up = linear(rows, w3_kn)
    out = linear(F.silu(linear(rows, w1_kn)) * up, w2_kn)
    return (out.view(T, K, H) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def _lut_fp4_decode(packed, scale, dtype):
    """E2M1 nibbles (low first) through a value table times E8M0 per-32 scales `2^(s - 127)` (255: NaN), in `dtype`:
    the in-graph FP4 decode of the two FP4 entries."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
    blocks = torch.tensor(E2M1_VALUES)[codes.long()].unflatten(-1, (-1, 32))
    powers = torch.exp2(scale.float() - 127)
    powers = torch.where(scale == 255, torch.full_like(powers, float("nan")), powers)
    return (blocks * powers.unsqueeze(-1)).flatten(-2).to(dtype)


def fp4_separate_gate_up(x, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale):
    """FP4 experts with w1 and w3 apart (the official V4 Expert on FP4 bytes): `moe_experts_fp4` reads one packed
    gate_up stack, so this stays a reported near-miss."""
    def decode(packed, scale):
        return _lut_fp4_decode(packed, scale, x.dtype)

    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    token = order // K
    offsets = _histc_offsets(sorted_ids)
    rows = x[token]
    act = F.silu(_grouped_linear(rows, decode(w1_packed, w1_scale), offsets)) * _grouped_linear(
        rows, decode(w3_packed, w3_scale), offsets)
    out = _grouped_linear(act, decode(w2_packed, w2_scale), offsets)
    out = out * weights.reshape(-1)[order].to(out.dtype).unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token, out)


def halves_of_one_stack(x, ids, weights, gate_up, down):
    """w1 and w3 as the two halves of one gate_up stack, sliced in forward, each in its own per-slot GEMM: views of
    the stack the fused op reads, so nothing is copied."""
    rows = x.repeat_interleave(K, dim=0)
    flat_ids = ids.reshape(-1)
    w1, w3 = gate_up[:, :I], gate_up[:, I:]
    gate = torch.bmm(w1[flat_ids], rows.unsqueeze(-1)).squeeze(-1)
    up = torch.bmm(w3[flat_ids], rows.unsqueeze(-1)).squeeze(-1)
    out = torch.bmm(down[flat_ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return (out * weights.reshape(-1, 1)).view(T, K, H).sum(dim=1).to(x.dtype)


def fp4_experts(x, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale):
    """DeepSeek V4 FP4 experts decoded in the graph: E2M1 nibbles (low first) through a value table times E8M0
    per-32 scales `2^(s - 127)` (`_lut_fp4_decode`), rounded to bf16, then the sort-based grouped experts with an
    index_add combine."""

    def decode(packed, scale):
        return _lut_fp4_decode(packed, scale, x.dtype)

    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    token = order // K
    offsets = _histc_offsets(sorted_ids)
    gate, up = _grouped_linear(x[token], decode(w13_packed, w13_scale), offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, decode(w2_packed, w2_scale), offsets)
    out = out * weights.reshape(-1)[order].to(out.dtype).unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token, out)


def fp8_block_dequant(x, ids, weights, gate_up8, gate_up_scale, down8, down_scale):
    """DeepSeek V3 FP8 expert weights with per-tile scales, dequantised in the graph (`repeat_interleave` of the
    tile scales over both dims) to bf16, then transformers' grouped experts on the decoded stacks."""

    def dequant(w8, scale):
        tiles = scale.repeat_interleave(FP8_BLOCK, dim=1).repeat_interleave(FP8_BLOCK, dim=2)
        return (w8.float() * tiles).to(torch.bfloat16)

    return hf_grouped_mm(x, ids, weights, dequant(gate_up8, gate_up_scale), dequant(down8, down_scale))


def official_v3_loop(x, ids, weights, gate_up, down):
    """The official DeepSeek V3 inference MoE: `bincount(...).tolist()` for the experts hit, then a python loop with
    `idx, top = torch.where(indices == i)` and `y[idx] += expert(x[idx]) * weights[idx, top, None]`. The data-
    dependent loop breaks the graph (`tolist`, `nonzero`): the only graph Dynamo builds holds the flattened ids and
    the zeros, no expert GEMM, so there is nothing of the family's to rewrite or report."""
    y = torch.zeros_like(x)
    counts = torch.bincount(ids.flatten(), minlength=E).tolist()
    for i in range(E):
        if counts[i] == 0:
            continue
        idx, top = torch.where(ids == i)
        gate, up = (x[idx] @ gate_up[i].t()).chunk(2, dim=-1)
        y[idx] += (F.silu(gate) * up) @ down[i].t() * weights[idx, top, None].to(x.dtype)
    return y


def vllm_dense_masks(x, ids, weights, gate_up, down):
    """vLLM `torch_moe`: the rows repeated k times, every expert applied to the rows its boolean mask selects
    (`out[mask] = ...`), then `(out.view(T, k, H) * w.view(T, k, 1)).sum(1)`. Boolean-mask indexing breaks the
    graph per expert: Dynamo runs the frame eagerly, no graph reaches the backend."""
    rows = x.view(T, 1, H).repeat(1, K, 1).reshape(-1, H)
    out = torch.zeros(T * K, H, dtype=x.dtype)
    flat_ids = ids.view(-1)
    for i in range(E):
        mask = flat_ids == i
        gate, up = (rows[mask] @ gate_up[i].t()).chunk(2, dim=-1)
        out[mask] = (F.silu(gate) * up) @ down[i].t()
    return (out.view(T, K, H) * weights.view(T, K, 1).to(out.dtype)).sum(dim=1)


def dense_all_experts(x, ids, weights, gate_up, down):
    """Every expert on every token (`einsum` over the whole stacks), combined with a dense [T, E] weight matrix that
    holds the router weights at the routed experts and zeros elsewhere: the op with k = E, each token's slot e on
    expert e weighted by its dense weight (a zero weight still takes a non-finite output to NaN, as here)."""
    dense_w = torch.zeros(T, E).scatter(1, ids, weights)
    gate, up = torch.einsum("th,eih->eti", x, gate_up).chunk(2, dim=-1)
    out = torch.einsum("eti,ehi->eth", F.silu(gate) * up, down)
    return torch.einsum("eth,te->th", out.float(), dense_w).to(x.dtype)


def dense_expert_loop(x, ids, weights, gate_up, down):
    """A python loop over every expert, each on every token, its output weighted by that expert's column of a
    one-hot-summed [T, E] weight matrix and accumulated in fp32: the dense MoE once more, unrolled."""
    dense_w = (F.one_hot(ids, E).float() * weights.unsqueeze(-1)).sum(dim=1)
    total = torch.zeros(T, H)
    for e in range(E):
        gate, up = (x @ gate_up[e].t()).chunk(2, dim=-1)
        total = total + ((F.silu(gate) * up) @ down[e].t()).float() * dense_w[:, e:e + 1]
    return total.to(x.dtype)


def einsum_gathered_index_add(x, ids, weights, gate_up, down):
    """Per-slot GEMMs as `einsum('snh,sh->sn')` of the gathered weights (a bmm whose output is reshaped, not
    squeezed), the fp32 weighted outputs accumulated per token by `index_add_` into fp32 zeros, then cast."""
    rows = x.repeat_interleave(K, dim=0)
    flat_ids = ids.reshape(-1)
    gate, up = torch.einsum("snh,sh->sn", gate_up[flat_ids], rows).chunk(2, dim=-1)
    out = torch.einsum("shi,si->sh", down[flat_ids], F.silu(gate) * up)
    token = torch.arange(T * K) // K
    return torch.zeros(T, H).index_add_(0, token, out * weights.reshape(-1, 1)).to(x.dtype)


def sorted_then_unsorted_weights(x, ids, weights, gate_up, down):
    """Sort-based grouped GEMMs whose slot outputs are put back in slot order first, then weighted by the router's
    [T, k] weights and summed per token."""
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    offsets = _histc_offsets(sorted_ids)
    gate, up = _grouped_linear(x[perm // K], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, offsets)[_inverse(perm)]
    return (out.view(T, K, H) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def gelu_gate(x, ids, weights, gate_up, down):
    """A GeGLU expert: GELU of the gate half instead of SiLU."""
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    offsets = _histc_offsets(sorted_ids)
    gate, up = _grouped_linear(x[perm // K], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.gelu(gate) * up, down, offsets) * weights.reshape(-1)[perm].unsqueeze(-1)
    return out[_inverse(perm)].view(T, K, H).sum(dim=1).to(x.dtype)


def weights_before_down(x, ids, weights, gate_up, down):
    """The router weight scales the SwiGLU activation before the down projection (linear, so equal up to rounding,
    but the rounding differs: the product is rounded to bf16 before the GEMM)."""
    rows = x.repeat_interleave(K, dim=0)
    flat_ids = ids.reshape(-1)
    gate, up = torch.bmm(gate_up[flat_ids], rows.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    act = (F.silu(gate) * up) * weights.reshape(-1, 1).to(x.dtype)
    out = torch.bmm(down[flat_ids], act.unsqueeze(-1)).squeeze(-1)
    return out.view(T, K, H).sum(dim=1)


def unweighted_mean(x, ids, weights, gate_up, down):
    """The k expert outputs averaged, the router weights unused. The fused ops always scale each slot by a [T, k]
    weight tensor the graph provides; this graph has none (a synthesised 1/k tensor could stand in, but no source
    combines experts this way), so it is reported rather than fused."""
    rows = x.repeat_interleave(K, dim=0)
    flat_ids = ids.reshape(-1)
    gate, up = torch.bmm(gate_up[flat_ids], rows.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    out = torch.bmm(down[flat_ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return out.view(T, K, H).mean(dim=1)


def per_channel_expert_scale(x, ids, weights, gate_up, down, channel_scale):
    """Each slot's output scaled by its expert's per-channel vector `[E, H]` gathered per slot, not by one router
    weight: outside the fused ops, which take one scalar weight per slot."""
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    offsets = _histc_offsets(sorted_ids)
    gate, up = _grouped_linear(x[perm // K], gate_up, offsets).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, offsets) * channel_scale[sorted_ids]
    return out[_inverse(perm)].view(T, K, H).sum(dim=1).to(x.dtype)


# --------------------------------------------------------------------------------------- inputs
def _plain():
    return (_tokens(), *_routing(), *_stacks())


def _clamped():
    gate_up, down = _stacks(scale=1.0)  # gate/up outputs of std ~10 cross +-LIMIT on most slots
    return (_tokens(), *_routing(), gate_up, down)


def _router():
    gen = torch.Generator().manual_seed(3)
    return (_tokens(), torch.randn(E, H, generator=gen), torch.randn(E, generator=gen) * 0.1, *_stacks())


def _separate():
    gate_up, down = _stacks()
    return (_tokens(), *_routing(), gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous(), down)


def _stored_kn():
    gate_up, down = _stacks()
    return (_tokens(), *_routing(), gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous())


def _separate_stored_kn():
    gate_up, down = _stacks()
    return (_tokens(), *_routing(), *(w.transpose(1, 2).contiguous() for w in (gate_up[:, :I], gate_up[:, I:], down)))


def _fp4_separate():
    gate_up, down = _stacks()
    return (_tokens(), *_routing(), *quantize_fp4(gate_up[:, :I].float()), *quantize_fp4(gate_up[:, I:].float()),
            *quantize_fp4(down.float()))


def _channel_scale():
    gen = torch.Generator().manual_seed(5)
    return (*_plain(), (torch.rand(E, H, generator=gen) + 0.5).to(torch.bfloat16))


def _fp4():
    gate_up, down = _stacks()
    return (_tokens(), *_routing(), *quantize_fp4(gate_up.float()), *quantize_fp4(down.float()))


def _fp8():
    gen = torch.Generator().manual_seed(4)
    gate_up, down = _stacks()

    def quantise(w):
        scale = torch.rand(E, w.shape[1] // FP8_BLOCK, w.shape[2] // FP8_BLOCK, generator=gen) * 0.01 + 0.005
        tiles = scale.repeat_interleave(FP8_BLOCK, dim=1).repeat_interleave(FP8_BLOCK, dim=2)
        return (w.float() / tiles).to(torch.float8_e4m3fn), scale

    return (_tokens(), *_routing(), *quantise(gate_up), *quantise(down))


# --------------------------------------------------------------------------------------- the corpus
@dataclass(frozen=True)
class MoeEntry(Entry):
    op: str = "dsfuse.moe_experts_bf16"


COUNTS_OUTSIDE = ("the per-expert counts are an input of the compiled graph, not computed in it from the expert ids "
                  "(a torch.bincount of the ids breaks the graph: its output size depends on their values)")
SEPARATE_FP4_STACKS = ("gate and up are separate expert GEMMs over two weight stacks (w1, w3) of FP4 or block-scaled "
                       "weights; moe_experts_fp4 / moe_experts_fp8 read one [E, 2I, H] gate_up stack (concatenating "
                       "the stacks would copy every expert's weights per call)")
NOT_SILU = ("the gate activation is not SiLU (the fused ops compute silu(gate) * up, or DeepSeek V4's "
            "silu(gate.clamp(max=L)) * up.clamp(-L, L))")
WEIGHTED_BEFORE_DOWN = ("the SwiGLU activation is multiplied by another tensor before the down projection; the fused "
                        "ops apply the router weights to each expert's output, after it (another rounding)")
NOT_WEIGHTED = "the expert outputs are not multiplied by the router weights"
NOT_PER_SLOT = "the expert outputs are not scaled by one router weight per slot"

CORPUS = {
    "hf_grouped_mm": MoeEntry(hf_grouped_mm, "transformers grouped_mm_experts_forward", _plain, REWRITTEN, 1,
                           detail="grouped GEMMs, inverse permutation + sum, E=8, k=2"),
    "hf_batched_mm": MoeEntry(hf_batched_mm, "transformers batched_mm_experts_forward", _plain, REWRITTEN, 1,
                           detail="batched GEMMs, sum, E=8, k=2"),
    "sorted_index_add": MoeEntry(sorted_index_add, "dsfuse's own FP4 experts' grouped forward (plain stacks)", _plain,
                              REWRITTEN, 1, detail="grouped GEMMs, index_add"),
    "searchsorted_offsets": MoeEntry(searchsorted_offsets, "written for the corpus (searchsorted group ends)", _plain,
                                  REWRITTEN, 1),
    "one_hot_count_offsets": MoeEntry(one_hot_count_offsets, "written for the corpus (one-hot counts)", _plain,
                                   REWRITTEN, 1),
    "argsort_then_gather": MoeEntry(argsort_then_gather, "written for the corpus (argsort + gather)", _plain,
                                 REWRITTEN, 1, detail="index_add"),
    "sigmoid_spelled_silu": MoeEntry(sigmoid_spelled_silu, "written for the corpus (g * sigmoid(g), matmul)", _plain,
                                  REWRITTEN, 1, detail="batched GEMMs, sum"),
    "v4_clamped_swiglu": MoeEntry(v4_clamped_swiglu, "transformers DeepseekV4 experts (swiglu_limit)", _clamped,
                               REWRITTEN, 1, detail="SwiGLU clamped at 4"),
    "router_renormalised": MoeEntry(router_renormalised, "DeepSeek V3 MoEGate (noaux_tc) + transformers grouped_mm",
                                 _router, REWRITTEN, 1),
    "weights_after_view": MoeEntry(weights_after_view, "vLLM torch_moe / SGLang torch-native MoE combine", _plain,
                                REWRITTEN, 1),
    "einsum_combine": MoeEntry(einsum_combine, "written for the corpus (einsum combine)", _plain, REWRITTEN, 1),
    "scatter_add_combine": MoeEntry(scatter_add_combine, "written for the corpus (scatter_add_)", _plain, REWRITTEN, 1),
    "scatter_reduce_combine": MoeEntry(scatter_reduce_combine, "written for the corpus (scatter_reduce sum)", _plain,
                                    REWRITTEN, 1),
    "halves_of_one_stack": MoeEntry(halves_of_one_stack, "written for the corpus (w1, w3 sliced from one stack)",
                                 _plain, REWRITTEN, 1, detail="batched GEMMs, sum"),
    "fp4_experts": MoeEntry(fp4_experts, "DeepSeek V4 inference FP4 experts", _fp4, REWRITTEN, 1,
                         op="dsfuse.moe_experts_fp4"),
    "fp8_block_dequant": MoeEntry(fp8_block_dequant, "DeepSeek V3 FP8 block-scaled weights, dequantised", _fp8,
                               REWRITTEN, 1),
    "official_v3_loop": MoeEntry(official_v3_loop, "DeepSeek V3 inference MoE.forward", _plain, LEFT_ALONE),
    "vllm_dense_masks": MoeEntry(vllm_dense_masks, "vLLM torch_moe (tests reference)", _plain, LEFT_ALONE),
    "dense_all_experts": MoeEntry(dense_all_experts, "written for the corpus (all experts, dense weights)", _plain,
                               REWRITTEN, 1, detail="dense GEMMs (every expert on every token, k = E), E=8"),
    "dense_expert_loop": MoeEntry(dense_expert_loop, "written for the corpus (a loop over every expert)", _plain,
                               REWRITTEN, 1, detail="dense GEMMs (every expert on every token, k = E), E=8"),
    "einsum_gathered_index_add": MoeEntry(einsum_gathered_index_add, "written for the corpus (einsum, fp32 index_add)",
                                       _plain, REWRITTEN, 1, detail="batched GEMMs, index_add"),
    "sorted_then_unsorted_weights": MoeEntry(sorted_then_unsorted_weights, "written for the corpus (weights after "
                                          "the inverse permutation)", _plain, REWRITTEN, 1,
                                          detail="grouped GEMMs, [T, k, H] weighted + sum"),
    "bincount_graph_break": MoeEntry(bincount_offsets, "DeepSeek V3 inference MoE (bincount counts)", _plain, NEAR_MISS,
                                  reason=COUNTS_OUTSIDE),
    "separate_gate_up": MoeEntry(separate_gate_up, "DeepSeek V3 / V4 inference Expert (w1, w3, w2)", _separate,
                              REWRITTEN, 1, detail="grouped GEMMs, inverse permutation + sum, E=8, k=2, gate and up "
                              "stacks apart"),
    "hf_grouped_mm_transposed": MoeEntry(hf_grouped_mm_transposed, "transformers grouped_mm_experts_forward "
                                         "(is_transposed)", _stored_kn, REWRITTEN, 1,
                                         detail="stacks stored [E, K, N] read transposed"),
    "separate_stored_kn_per_slot": MoeEntry(separate_stored_kn_per_slot, "written for the corpus (w1, w3 apart, "
                                            "stored [E, K, N], rows @ W[ids])", _separate_stored_kn, REWRITTEN, 1,
                                            detail="gate and up stacks apart, stacks stored [E, K, N] read "
                                            "transposed"),
    "fp4_separate_gate_up": MoeEntry(fp4_separate_gate_up, "DeepSeek V4 inference Expert (w1, w3, w2) on FP4 bytes",
                                     _fp4_separate, NEAR_MISS, reason=SEPARATE_FP4_STACKS),
    "gelu_gate": MoeEntry(gelu_gate, "written for the corpus (GeGLU)", _plain, NEAR_MISS, reason=NOT_SILU),
    "weights_before_down": MoeEntry(weights_before_down, "written for the corpus", _plain, NEAR_MISS,
                                 reason=WEIGHTED_BEFORE_DOWN),
    "unweighted_mean": MoeEntry(unweighted_mean, "written for the corpus", _plain, NEAR_MISS, reason=NOT_WEIGHTED),
    "per_channel_expert_scale": MoeEntry(per_channel_expert_scale, "written for the corpus", _channel_scale, NEAR_MISS,
                                      reason=NOT_PER_SLOT),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_entry_ends_as_declared(name):
    (got,), (want,), _ = run_entry(CORPUS[name], "moe_experts")
    # bf16 GEMMs summed in another order differ by an ulp of the output's size.
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_corpus_covers_the_family():
    """At least 12 independent rewritten formulations, and each declared outcome kind appears."""
    check_coverage(CORPUS)
