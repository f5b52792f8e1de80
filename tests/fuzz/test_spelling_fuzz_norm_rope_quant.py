"""Spelling fuzzer for the `norm_rope_quant` family: each draw composes one small module (a projection, then the
RMSNorm / RoPE glue as the family's models write it) from independent, semantics-preserving choices, compiles it
with `backend="dsfuse"` and checks it against eager: the same outputs within the dtype's budget, and every norm and
RoPE of the draw either inside a fused call or reported as a near-miss with its reason; never wrong, never silent.

Axes: where the glue sits (the V3.2 / GLM kv side: a split into [C_norm, C_rope], RMSNorm of the first part and
RoPE of the second; V4's row: its leading part kept and its trailing part RoPE'd, `cat` back, the row optionally
an RMSNorm's output; an RMSNorm of the projection alone), the projection (`nn.Linear`, `x @ w.T`, `F.linear`,
`einsum`), the split (`Tensor.split`, `torch.split`, two slices, two negative slices), the RMSNorm's spelling
(`rsqrt` of `pow(2).mean`, of `(x*x).mean` or of `pow(2).sum / d`, `F.rms_norm`, or a division by `sqrt`), the
weight (HF: `weight * normed.to(dtype)`; official: `(normed * weight.float()).to(dtype)`; none), the RoPE
(HF half-split `rotate_half`, HF interleaved even/odd slices `cat` back, the official complex multiply, V4's fp32
even/odd `stack` + `flatten`, pairs by `unbind` stacked back in place) and the dtype (bf16, fp32).

The division by `sqrt` rounds otherwise than the `rsqrt` spellings, and the kernels compute each rounding as its own
(within the tolerance would not be enough: a fused norm must be the source's). Every norm spelling drawn here is one
they compute, so no draw may be reported for its RMSNorm; a draw is reported only for its RoPE.

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
from torch import nn

import dsfuse

DRAWS = int(os.environ.get("DSFUSE_SPELLING_DRAWS", "24"))
B, HIDDEN, C_NORM, EPS = 2, 16, 32, 1e-6
KV_SIDE, V4_ROW, NORM_ALONE = "split [norm, rope] (V3.2 kv)", "[keep, rope(tail)] cat (V4 row)", "norm alone (q_a)"

AXES = {
    "site": (KV_SIDE, V4_ROW, NORM_ALONE),
    "projection": ("nn.Linear", "x @ w.T", "F.linear", "einsum"),
    "split": ("Tensor.split", "torch.split", "two slices", "two negative slices"),
    "norm": ("rsqrt(pow(2).mean)", "rsqrt((x*x).mean)", "rsqrt(pow(2).sum / d)", "F.rms_norm", "x / sqrt(mean)"),
    "weight": ("HF weight * normed.to(dtype)", "official (normed * weight.float()).to(dtype)", "none"),
    "rope": ("rotate_half", "even/odd slices cat", "complex multiply", "fp32 even/odd stack+flatten",
             "unbind pairs stacked"),
    "v4_row": ("RMSNorm", "projection"),
    "dtype": ("bf16", "fp32"),
}
# Axes each site reads (the others do not change its program).
NORM_AXES = ("norm", "weight")
READS = {KV_SIDE: ("site", "projection", "split", *NORM_AXES, "rope", "dtype"),
         V4_ROW: ("site", "projection", "split", "v4_row", "rope", "dtype"),
         NORM_ALONE: ("site", "projection", *NORM_AXES, "dtype")}
# How the norm matcher's reported reasons begin: every norm spelling drawn here has a call in its own rounding.
NORM_REFUSED = "RMSNorm:"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
OUTCOMES: dict[tuple[str, str], list[str]] = defaultdict(list)  # (axis, choice) -> "fused" or the reason, per draw


def reads(choice: dict) -> tuple[str, ...]:
    axes = READS[choice["site"]]
    if choice["site"] == V4_ROW and choice["v4_row"] == "RMSNorm":
        axes += NORM_AXES
    return axes


def rms_norm(choice: dict, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf, d = x.float(), x.shape[-1]
    kind = choice["norm"]
    if kind == "rsqrt(pow(2).mean)":
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    elif kind == "rsqrt((x*x).mean)":
        normed = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + EPS)
    elif kind == "rsqrt(pow(2).sum / d)":
        normed = xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / d + EPS)
    elif kind == "F.rms_norm":
        normed = F.rms_norm(xf, (d,), eps=EPS)
    else:
        normed = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    placement = choice["weight"]
    if placement.startswith("HF"):
        return weight * normed.to(x.dtype)
    if placement.startswith("official"):
        return (normed * weight.float()).to(x.dtype)
    return normed.to(x.dtype)


def rope(choice: dict, r: torch.Tensor, angles: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE of `r` [B, (1,) S, R] in the drawn form; `angles` [B, S, R/2] (the tables are built from them as each
    source builds its own), `freqs` [S, R/2] complex64."""
    kind, dt = choice["rope"], r.dtype
    head_view = r.dim() == 4
    cos, sin = angles.cos().to(dt), angles.sin().to(dt)
    if head_view:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if kind == "rotate_half":
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        half = r.shape[-1] // 2
        return r * cos + torch.cat([-r[..., half:], r[..., :half]], -1) * sin
    if kind == "even/odd slices cat":  # HF's tables are `cat(freqs, freqs)`: the first half is the pairs' angle
        full_cos, full_sin = torch.cat([angles.cos(), angles.cos()], -1), torch.cat([angles.sin(), angles.sin()], -1)
        half = r.shape[-1] // 2
        cos, sin = full_cos.to(dt)[..., :half], full_sin.to(dt)[..., :half]
        if head_view:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        even, odd = r[..., 0::2], r[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], -1)
    if kind == "complex multiply":
        pairs = torch.view_as_complex(r.float().view(*r.shape[:-1], -1, 2))
        rows = freqs.view(*[1] * (r.dim() - 2), *freqs.shape)
        return torch.view_as_real(pairs * rows).flatten(-2).to(dt)
    if kind == "fp32 even/odd stack+flatten":
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        rotated = torch.stack((-r[..., 1::2], r[..., 0::2]), -1).flatten(-2)
        return (r.float() * cos + rotated.float() * sin).to(dt)
    even, odd = r.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


def split(choice: dict, x: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    kind, width = choice["split"], x.shape[-1]
    if kind == "Tensor.split":
        return x.split([first, width - first], -1)
    if kind == "torch.split":
        return torch.split(x, [first, width - first], dim=-1)
    if kind == "two slices":
        return x[..., :first], x[..., first:]
    return x[..., :first - width], x[..., first - width:]


class Glue(nn.Module):
    """A projection of the hidden states and the drawn norm / RoPE glue on its output."""

    def __init__(self, choice: dict, c_rope: int, seed: int):
        super().__init__()
        self.choice, self.c_rope = choice, c_rope
        width = C_NORM if choice["site"] == NORM_ALONE else C_NORM + c_rope
        norm_width = C_NORM if choice["site"] != V4_ROW else width
        gen = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(HIDDEN, width, bias=False)
        self.proj.weight.data = torch.randn(width, HIDDEN, generator=gen) * HIDDEN**-0.5
        self.norm_weight = nn.Parameter(1 + 0.3 * torch.randn(norm_width, generator=gen))
        self.to(DTYPES[choice["dtype"]]).requires_grad_(False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        kind, w = self.choice["projection"], self.proj.weight
        if kind == "nn.Linear":
            return self.proj(x)
        if kind == "x @ w.T":
            return x @ w.T
        if kind == "F.linear":
            return F.linear(x, w)
        return torch.einsum("bsh,ch->bsc", x, w)

    def forward(self, x, angles, freqs):
        choice, out = self.choice, self.project(x)
        if choice["site"] == NORM_ALONE:
            return rms_norm(choice, out, self.norm_weight)
        if choice["site"] == KV_SIDE:  # HF: k_pass = norm(kv_pass); k_rot viewed [B, 1, S, C_rope]
            kv_pass, k_rot = split(choice, out, C_NORM)
            k_rot = rope(choice, k_rot.view(B, 1, -1, self.c_rope), angles, freqs)
            return rms_norm(choice, kv_pass, self.norm_weight), k_rot
        row = rms_norm(choice, out, self.norm_weight) if choice["v4_row"] == "RMSNorm" else out
        keep, tail = split(choice, row, C_NORM)
        return torch.cat([keep, rope(choice, tail, angles, freqs)], -1)


def inputs(c_rope: int, seq: int, dtype: torch.dtype, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, seq, HIDDEN, generator=gen).to(dtype)
    positions = torch.arange(seq, dtype=torch.float32)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(0, c_rope, 2, dtype=torch.float32) / c_rope)
    angles = (positions * inv_freq).expand(B, seq, c_rope // 2).contiguous()
    return x, angles, torch.polar(torch.ones_like(angles[0]), angles[0])


def covered(sites) -> tuple[bool, bool]:
    """Whether the fused calls cover an RMSNorm and a RoPE."""
    norm = any(s.op == "dsfuse.rmsnorm_rope" or (s.op == "dsfuse.rope_cat" and "RMSNorm" in s.detail) for s in sites)
    roped = any(s.op != "dsfuse.rmsnorm_rope" or "no RoPE" not in s.detail for s in sites)
    return norm, roped


SILENT, BOTH = "silent miss", "fused and reported"


def outcome(choice: dict, rep) -> str:
    """"fused" when the fused calls cover every norm and RoPE of the draw and nothing is reported; else the first
    near-miss reason (a draw partly fused and partly reported says so); `SILENT` or `BOTH` for a draw that is
    neither."""
    sites = [s for s in rep.sites if s.pass_name == "norm_rope_quant"]
    reasons = [m.reason for m in rep.near_misses if m.pass_name == "norm_rope_quant"]
    wants_norm = choice["site"] != V4_ROW or choice["v4_row"] == "RMSNorm"
    wants_rope = choice["site"] != NORM_ALONE
    norm, roped = covered(sites)
    whole = (norm or not wants_norm) and (roped or not wants_rope)
    if whole == bool(reasons):
        return BOTH if whole else SILENT
    if whole:
        return "fused"
    return f"partly fused: {reasons[0]}" if sites else reasons[0]


@settings(max_examples=DRAWS)
@given(choice=st.fixed_dictionaries({axis: st.sampled_from(values) for axis, values in AXES.items()}),
       c_rope=st.sampled_from([8, 16]), seq=st.sampled_from([3, 5]), seed=st.integers(0, 2**16))
def test_every_spelling_is_fused_with_parity_or_reported(choice, c_rope, seq, seed):
    torch._dynamo.reset()
    dsfuse.reset_report()
    dt = DTYPES[choice["dtype"]]
    module, args = Glue(choice, c_rope, seed), inputs(c_rope, seq, dt, seed)
    with torch.no_grad():
        got = torch.compile(module, backend="dsfuse", options={"enable": ["norm_rope_quant"]})(*args)
        want = module(*args)
    rep = dsfuse.report()
    tolerance = 1e-5 if dt == torch.float32 else 1.6e-2  # fp32: rounding order; bf16: two ulps
    for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
        torch.testing.assert_close(g.float(), w.float(), rtol=tolerance, atol=tolerance * w.abs().max().item(),
                                   msg=lambda m: f"{m}\n{choice}\n{rep.details()}")
    result = outcome(choice, rep)
    assert result not in (SILENT, BOTH), (result, choice, rep.details())
    refused = [m.reason for m in rep.near_misses
               if m.pass_name == "norm_rope_quant" and m.reason.startswith(NORM_REFUSED)]
    assert not refused, ("an RMSNorm spelling a kernel computes was reported", refused, choice, rep.details())
    axes = reads(choice)
    for axis in axes:
        OUTCOMES[axis, choice[axis]].append(result)
    write_spelling_stats(OUTCOMES)


def test_every_rope_form_is_the_same_rotation():
    """Each RoPE form rotates the same pairs by the same angles (up to its pair layout), so a draw is never a wrong
    program that both eager and compiled reproduce: the interleaved forms agree with the complex multiply, and
    `rotate_half` with the complex multiply of the halves' pairs."""
    c_rope, seq = 8, 5
    x, angles, freqs = inputs(c_rope, seq, torch.float32, 0)
    r = torch.randn(B, seq, c_rope, generator=torch.Generator().manual_seed(3))
    form = {value: rope({"rope": value}, r, angles, freqs) for value in AXES["rope"]}
    interleaved_out = form["complex multiply"]
    for value in ("fp32 even/odd stack+flatten", "unbind pairs stacked"):
        torch.testing.assert_close(form[value], interleaved_out, msg=lambda m: f"{value}: {m}")
    de_interleaved = torch.cat([interleaved_out[..., 0::2], interleaved_out[..., 1::2]], -1)
    torch.testing.assert_close(form["even/odd slices cat"], de_interleaved)
    halves_as_pairs = torch.stack([r[..., :c_rope // 2], r[..., c_rope // 2:]], -1).flatten(-2)
    want = rope({"rope": "complex multiply"}, halves_as_pairs, angles, freqs)
    torch.testing.assert_close(form["rotate_half"], torch.cat([want[..., 0::2], want[..., 1::2]], -1))


def test_every_norm_spelling_is_the_same_norm():
    x = torch.randn(B, 5, C_NORM, generator=torch.Generator().manual_seed(4))
    weight = 1 + 0.3 * torch.randn(C_NORM, generator=torch.Generator().manual_seed(5))
    want = F.rms_norm(x, (C_NORM,), weight, EPS)
    for norm in AXES["norm"]:
        for placement in AXES["weight"][:2]:
            got = rms_norm({"norm": norm, "weight": placement}, x, weight)
            torch.testing.assert_close(got, want, msg=lambda m: f"{norm}, {placement}: {m}")
