"""Spelling fuzzer for the `moe_experts` family: each draw composes one program of routed SwiGLU experts (router ids
and weights given) from independent, semantics-preserving choices, compiles it with `backend="dsfuse"` and checks it
against eager: the same output within the dtype's budget, and the site either fused or reported as a near-miss with
its reason; never wrong, never silent.

Axes: the expert GEMM (`_grouped_mm` over expert-sorted rows, `bmm` or `einsum` of per-slot gathered weights, every
expert on every token by `einsum` or by a loop over the experts), how the sorted form counts its groups (`histc`, a
one-hot sum, `searchsorted` of the sorted ids, of ids gathered by `argsort`, `bincount`), the weight layout (one
gate_up stack `[E, 2I, H]` or stored `[E, H, 2I]`, separate w1 / w3 stacks, or w1 / w3 sliced from one gate_up
stack), the SiLU's spelling, the combine (`index_add`, `scatter_add`, the slot outputs summed per token, or
contracted with the weights by `einsum`), how a dense form spreads the router weights over every expert (a scatter or
a one-hot sum) and the dtype (`_grouped_mm` takes bf16 only: its programs are bf16 whatever the draw). The routing
is adversarial: tokens share experts, some experts get no token, and one router weight is zero.

The default run draws `DRAWS` programs; `DSFUSE_SPELLING_DRAWS=n` draws n. `DSFUSE_SPELLING_STATS=path` writes the
outcomes per axis value (draws, fused, each near-miss reason) as JSON, rewritten after every draw.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.nn.functional as F
from fuzz_support import write_spelling_stats
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfuse

DRAWS = int(os.environ.get("DSFUSE_SPELLING_DRAWS", "12"))
H, I, E, K = 16, 8, 5, 2
GROUPED, GATHERED, DENSE = ("grouped_mm",), ("bmm gathered", "einsum gathered"), ("dense einsum", "dense loop")

AXES = {
    "gemm": GROUPED + GATHERED + DENSE,
    "count": ("histc", "one-hot sum", "searchsorted", "argsort+searchsorted", "bincount"),
    "layout": ("gate_up [E,2I,H]", "gate_up [E,H,2I]", "w1+w3 [E,I,H]", "w1+w3 halves of gate_up"),
    "activation": ("F.silu", "x*sigmoid(x)", "x/(1+exp(-x))"),
    "combine": ("index_add", "scatter_add", "slot sum", "einsum weights"),
    "spread": ("scatter", "one-hot sum"),
    "dtype": ("bf16", "fp16", "fp32"),
}
# Axes each GEMM form reads (the others do not change its program).
READS = {"grouped_mm": ("gemm", "count", "layout", "activation", "combine"),
         "bmm gathered": ("gemm", "layout", "activation", "combine", "dtype"),
         "einsum gathered": ("gemm", "layout", "activation", "combine", "dtype"),
         "dense einsum": ("gemm", "layout", "activation", "spread", "dtype"),
         "dense loop": ("gemm", "layout", "activation", "spread", "dtype")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUTCOMES: dict[tuple[str, str], list[str]] = defaultdict(list)  # (axis, choice) -> "fused" or the reason, per draw


def silu(choice: dict, gate: torch.Tensor) -> torch.Tensor:
    kind = choice["activation"]
    if kind == "F.silu":
        return F.silu(gate)
    if kind == "x*sigmoid(x)":
        return gate * torch.sigmoid(gate)
    return gate / (1 + torch.exp(-gate))


def program(choice: dict):
    """The experts written with the drawn choices: `fn(x [T, H], ids [T, k], weights [T, k] fp32, *stacks)`, the
    stacks as `inputs` lays them out for the drawn layout."""
    layout, gemm = choice["layout"], choice["gemm"]
    stored_kn = layout == "gate_up [E,H,2I]"  # both stacks stored [E, K, N] (the GEMM's input dim first)

    def linear_all(rows, stack):
        """rows [S, K] times every expert's stack: [E, S, N]."""
        return torch.einsum("sk,ekn->esn" if stored_kn else "sk,enk->esn", rows, stack)

    def gathered(rows, stack, flat_ids):
        picked = stack[flat_ids]
        if gemm == "einsum gathered":
            return torch.einsum("skn,sk->sn" if stored_kn else "snk,sk->sn", picked, rows)
        if stored_kn:
            return torch.bmm(rows.unsqueeze(1), picked).squeeze(1)
        return torch.bmm(picked, rows.unsqueeze(-1)).squeeze(-1)

    def grouped(rows, stack, offsets):
        return torch._grouped_mm(rows, stack if stored_kn else stack.transpose(-2, -1), offs=offsets)

    def swiglu(gemm_of, rows, stacks):
        if layout.startswith("w1+w3"):
            w1, w3, down = stacks if layout == "w1+w3 [E,I,H]" else (stacks[0][:, :I], stacks[0][:, I:], stacks[1])
            return gemm_of(silu(choice, gemm_of(rows, w1)) * gemm_of(rows, w3), down)
        gate_up, down = stacks
        gate, up = gemm_of(rows, gate_up).chunk(2, dim=-1)
        return gemm_of(silu(choice, gate) * up, down)

    def offsets_of(flat_ids, sorted_ids, perm):
        kind = choice["count"]
        if kind == "histc":
            return torch.histc(sorted_ids.float(), bins=E, min=0, max=E - 1).cumsum(0).to(torch.int32)
        if kind == "one-hot sum":
            return F.one_hot(flat_ids, E).sum(0).cumsum(0).to(torch.int32)
        if kind == "searchsorted":
            return torch.searchsorted(sorted_ids, torch.arange(E), right=True, out_int32=True)
        if kind == "argsort+searchsorted":
            return torch.searchsorted(flat_ids[perm], torch.arange(E), right=True, out_int32=True)
        return torch.bincount(flat_ids, minlength=E).cumsum(0).to(torch.int32)

    def combine_slots(out, token, weights, x, order=None):
        """Slot outputs `out [S, H]` (slot order, or `order` = the sort's permutation) weighted and summed per
        token."""
        T = x.shape[0]
        kind = choice["combine"]
        if kind in ("index_add", "scatter_add"):
            flat = weights.reshape(-1)
            weighted = out * (flat if order is None else flat[order]).unsqueeze(-1)
            if kind == "index_add":
                return torch.zeros(T, H, dtype=weighted.dtype).index_add_(0, token, weighted).to(x.dtype)
            return torch.zeros(T, H, dtype=weighted.dtype).scatter_add_(
                0, token[:, None].expand(-1, H), weighted).to(x.dtype)
        if order is not None:
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel())
            out = out[inverse]
        if kind == "slot sum":
            return (out.view(T, K, H) * weights.view(T, K, 1)).sum(dim=1).to(x.dtype)
        return torch.einsum("tkh,tk->th", out.view(T, K, H).float(), weights).to(x.dtype)

    def experts(x, ids, weights, *stacks):
        T = x.shape[0]
        flat_ids = ids.reshape(-1)
        if gemm == "grouped_mm":
            sorted_ids, perm = torch.sort(flat_ids, stable=True)
            if choice["count"] == "argsort+searchsorted":
                perm = torch.argsort(flat_ids, stable=True)
            offsets = offsets_of(flat_ids, sorted_ids, perm)
            token = perm // K
            out = swiglu(lambda rows, stack: grouped(rows, stack, offsets), x[token], stacks)
            return combine_slots(out, token, weights, x, perm)
        if gemm in GATHERED:
            out = swiglu(lambda rows, stack: gathered(rows, stack, flat_ids), x.repeat_interleave(K, dim=0), stacks)
            return combine_slots(out, torch.arange(T * K) // K, weights, x)
        if choice["spread"] == "scatter":
            dense_weights = torch.zeros(T, E).scatter(1, ids, weights)
        else:
            dense_weights = (F.one_hot(ids, E).float() * weights.unsqueeze(-1)).sum(dim=1)
        if gemm == "dense einsum":
            out = swiglu(lambda rows, stack: linear_all(rows, stack) if rows.dim() == 2 else torch.einsum(
                "esk,ekn->esn" if stored_kn else "esk,enk->esn", rows, stack), x, stacks)
            return torch.einsum("eth,te->th", out.float(), dense_weights).to(x.dtype)
        total = torch.zeros(T, H)
        for e in range(E):
            out = swiglu(lambda rows, stack: rows @ (stack[e] if stored_kn else stack[e].t()), x, stacks)
            total = total + out.float() * dense_weights[:, e:e + 1]
        return total.to(x.dtype)

    return experts


def inputs(choice: dict, tokens: int, seed: int) -> tuple:
    """Tokens, routing and the stacks in the drawn layout and dtype. Each token's k experts are distinct, tokens share
    experts, the last expert gets no token, and the first token's second router weight is zero."""
    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES["bf16" if choice["gemm"] == "grouped_mm" else choice["dtype"]]
    x = torch.randn(tokens, H, generator=gen).to(dt)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=gen) + 0.1
    weights[0, 1] = 0.0
    gate_up = torch.randn(E, 2 * I, H, generator=gen) * 0.3
    down = torch.randn(E, H, I, generator=gen) * 0.3
    if choice["layout"] == "w1+w3 [E,I,H]":
        stacks = (gate_up[:, :I], gate_up[:, I:], down)
    elif choice["layout"] == "gate_up [E,H,2I]":
        stacks = (gate_up.transpose(1, 2), down.transpose(1, 2))
    else:
        stacks = (gate_up, down)
    return (x, ids, weights, *(s.contiguous().to(dt) for s in stacks))


@settings(max_examples=DRAWS)
@given(choice=st.fixed_dictionaries({axis: st.sampled_from(values) for axis, values in AXES.items()}),
       tokens=st.sampled_from([3, 6]), seed=st.integers(0, 2**16))
def test_every_spelling_is_fused_with_parity_or_reported(choice, tokens, seed):
    torch._dynamo.reset()
    dsfuse.reset_report()
    fn, args = program(choice), inputs(choice, tokens, seed)
    with torch.no_grad():
        got = torch.compile(fn, backend="dsfuse", options={"enable": ["moe_experts"]})(*args)
        want = fn(*args)
    rep = dsfuse.report()
    tolerance = 1e-4 if args[0].dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * want.abs().max().item(),
                               msg=lambda m: f"{m}\n{choice}\n{rep}")
    fused = rep.counts["moe_experts"]
    reasons = [m.reason for m in rep.near_misses if m.pass_name == "moe_experts"]
    assert (fused == 1 and not reasons) or (fused == 0 and reasons), (choice, str(rep))
    for axis in READS[choice["gemm"]]:
        OUTCOMES[axis, choice[axis]].append("fused" if fused else reasons[0])
    write_spelling_stats(OUTCOMES)


def test_every_axis_value_runs_eagerly():
    """Each axis value gives a program that runs and agrees with the reference math (so a draw is never a wrong
    program that both eager and compiled reproduce)."""
    from dsfuse.kernels.moe_experts import moe_experts_bf16_reference

    for gemm in AXES["gemm"]:
        for axis in READS[gemm]:
            for value in AXES[axis]:
                choice = {name: values[0] for name, values in AXES.items()} | {"gemm": gemm, axis: value}
                if axis != "dtype":
                    choice["dtype"] = "fp32"
                x, ids, weights, *stacks = inputs(choice, 6, 0)
                if choice["layout"] == "w1+w3 [E,I,H]":
                    gate_up, down = torch.cat(stacks[:2], dim=1), stacks[2]
                elif choice["layout"] == "gate_up [E,H,2I]":
                    gate_up, down = (s.transpose(1, 2) for s in stacks)
                else:
                    gate_up, down = stacks
                want = moe_experts_bf16_reference(x, ids, weights, gate_up, down)
                tolerance = 1e-4 if x.dtype == torch.float32 else 3e-2
                torch.testing.assert_close(program(choice)(x, ids, weights, *stacks), want, rtol=tolerance,
                                           atol=tolerance, msg=lambda m: f"{m}\n{choice}")
