"""Spelling fuzzer for the `compressors` family (DeepSeek V4's KV compressors): each draw composes one compressor
on given projections (kv, gate [B, S, C]) from independent, semantics-preserving choices, compiles it with
`backend="dsfuse"` and checks it against eager: the same output within the dtype's budget, and the compressor
either fused or reported as a near-miss with its reason; never wrong, never silent.

Axes, after transformers' `DeepseekV4HCACompressor` / `DeepseekV4CSACompressor` and the official inference code's
`Compressor`: the slot layout (one series of m slots, or two overlapping series of 2m slots built by slice
assignment or by `cat`), how the tokens past the last whole window are dropped (a slice, `narrow`), the position bias
(implicit broadcast, `bias[None, None]`, `expand`), the softmax over the slots (`softmax(dtype=fp32)`,
`F.softmax` of the fp32 gate, `exp(g - max) / sum`, `exp(log_softmax)`), the weighted sum (HF's product and
`.sum(dim=2)`, the operands swapped under `torch.sum`, `einsum`), the RMSNorm (`rsqrt(mean(x^2) + eps)`, `x * x`,
`sum / D`, `F.rms_norm`, `x / sqrt(mean + eps)`), the RoPE of the trailing channels (HF's `apply_rotary_pos_emb`,
widened tables with `stack`, the even / odd halves written out, the official complex product), the window count
and leftover tokens, and the dtype of the projections.

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
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

import dsfuse

DRAWS = int(os.environ.get("DSFUSE_SPELLING_DRAWS", "8"))
D, R, EPS = 16, 8, 1e-6  # entry width, RoPE width (the trailing R channels)

AXES = {
    "slots": ("one series", "two series, slice assignment", "two series, cat"),
    "drop": ("slice", "narrow"),
    "bias": ("implicit", "bias[None, None]", "expand"),
    "softmax": ("softmax(dtype=fp32)", "F.softmax(g.float())", "exp(g-max)/sum", "exp(log_softmax)"),
    "pool": ("(kv * p).sum(2)", "torch.sum(p * kv, 2)", "einsum"),
    "norm": ("rsqrt(mean(x^2)+eps)", "rsqrt(mean(x*x)+eps)", "rsqrt(sum(x*x)/D+eps)", "F.rms_norm",
             "x / sqrt(mean+eps)"),
    "rope": ("HF apply_rotary_pos_emb", "widened tables + stack", "halves written out", "complex product"),
    "dtype": ("bf16", "fp32"),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
OUTCOMES: dict[tuple[str, str], list[str]] = defaultdict(list)  # (axis, choice) -> "fused" or the reasons, per draw


class Spelled(torch.nn.Module):
    """A compressor of window m over given projections, written with the drawn choices; the position bias and the
    norm weight fp32, as transformers keeps them."""

    def __init__(self, choice: dict, m: int, seed: int):
        super().__init__()
        self.choice, self.m = choice, m
        self.overlap = choice["slots"] != "one series"
        width = 2 * D if self.overlap else D
        gen = torch.Generator().manual_seed(seed)
        self.bias = torch.nn.Parameter(torch.randn(m, width, generator=gen))
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(D, generator=gen))

    def _windows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, W, m, C] windows of the whole windows' tokens."""
        windows = x.shape[1] // self.m
        kept = x[:, :windows * self.m] if self.choice["drop"] == "slice" else x.narrow(1, 0, windows * self.m)
        return kept.view(x.shape[0], windows, self.m, x.shape[-1])

    def _biased(self, gate: torch.Tensor) -> torch.Tensor:
        kind = self.choice["bias"]
        if kind == "bias[None, None]":
            return gate + self.bias[None, None]
        if kind == "expand":
            return gate + self.bias.expand(gate.shape)
        return gate + self.bias

    def _slots(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, gate) over the slots: the windows, or the two overlapping series of 2m slots (window w's second
        half, and window w - 1's first half before it; -inf gates and zero values where there is none)."""
        if not self.overlap:
            return kv, gate
        B, W, m, _ = kv.shape
        if self.choice["slots"] == "two series, cat":
            empty_kv, empty_gate = kv.new_zeros(B, 1, m, D), gate.new_full((B, 1, m, D), float("-inf"))
            previous_kv = torch.cat([empty_kv, kv[:, :-1, :, :D]], dim=1)
            previous_gate = torch.cat([empty_gate, gate[:, :-1, :, :D]], dim=1)
            return (torch.cat([previous_kv, kv[..., D:]], dim=2), torch.cat([previous_gate, gate[..., D:]], dim=2))
        new_kv = kv.new_zeros((B, W, 2 * m, D))
        new_gate = gate.new_full((B, W, 2 * m, D), float("-inf"))
        new_kv[:, :, m:] = kv[..., D:]
        new_gate[:, :, m:] = gate[..., D:]
        if W > 1:
            new_kv[:, 1:, :m] = kv[:, :-1, :, :D]
            new_gate[:, 1:, :m] = gate[:, :-1, :, :D]
        return new_kv, new_gate

    def _weights(self, gate: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """The fp32 softmax over the slots, rounded to the values' dtype."""
        kind = self.choice["softmax"]
        if kind == "softmax(dtype=fp32)":
            p = gate.softmax(dim=2, dtype=torch.float32)
        elif kind == "F.softmax(g.float())":
            p = F.softmax(gate.float(), dim=2)
        elif kind == "exp(g-max)/sum":
            g = gate.float()
            e = torch.exp(g - g.amax(dim=2, keepdim=True))
            p = e / e.sum(dim=2, keepdim=True)
        else:
            p = torch.exp(torch.log_softmax(gate.float(), dim=2))
        return p.to(dt)

    def _pool(self, kv: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        kind = self.choice["pool"]
        if kind == "torch.sum(p * kv, 2)":
            return torch.sum(p * kv, dim=2)
        if kind == "einsum":
            return torch.einsum("bwld,bwld->bwd", kv, p)
        return (kv * p).sum(dim=2)

    def _norm(self, pooled: torch.Tensor) -> torch.Tensor:
        kind, x = self.choice["norm"], pooled.float()
        if kind == "F.rms_norm":
            return F.rms_norm(x, (D,), self.weight, EPS).to(pooled.dtype)
        if kind == "rsqrt(mean(x*x)+eps)":
            x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS)
        elif kind == "rsqrt(sum(x*x)/D+eps)":
            x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) / D + EPS)
        elif kind == "x / sqrt(mean+eps)":
            x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        else:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        return (self.weight * x).to(pooled.dtype)

    def _rope(self, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of the trailing R channels over interleaved pairs, cos / sin [B, W, R/2]."""
        kind = self.choice["rope"]
        if kind == "HF apply_rotary_pos_emb":
            return apply_rotary_pos_emb(normed.unsqueeze(1), cos, sin).squeeze(1)
        nope, rope = normed[..., :-R], normed[..., -R:]
        if kind == "complex product":
            pairs = torch.view_as_complex(rope.float().unflatten(-1, (-1, 2)).contiguous())
            turned = torch.view_as_real(pairs * torch.complex(cos.float(), sin.float())).flatten(-2)
            return torch.cat([nope, turned.to(normed.dtype)], dim=-1)
        if kind == "halves written out":
            even, odd = rope[..., 0::2].float(), rope[..., 1::2].float()
            c, s = cos.float(), sin.float()
            turned = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
            return torch.cat([nope, turned.to(normed.dtype)], dim=-1)
        c2, s2 = (t.unsqueeze(-1).expand(*t.shape, 2).flatten(-2) for t in (cos, sin))
        half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat([nope, ((rope.float() * c2) + (half.float() * s2)).to(normed.dtype)], dim=-1)

    def forward(self, kv, gate, cos, sin):
        values, logits = self._slots(self._windows(kv), self._biased(self._windows(gate)))
        pooled = self._pool(values, self._weights(logits, values.dtype))
        return self._rope(self._norm(pooled), cos, sin)


def inputs(module: Spelled, windows: int, leftover: int, seed: int) -> tuple:
    """kv, gate [2, windows * m + leftover, C] in the drawn dtype, and the RoPE tables [2, windows, R / 2]."""
    gen, dt = torch.Generator().manual_seed(seed), DTYPES[module.choice["dtype"]]
    width = 2 * D if module.overlap else D
    tokens = windows * module.m + leftover
    kv, gate = (torch.randn(2, tokens, width, generator=gen).to(dt) for _ in range(2))
    angles = torch.rand(2, windows, R // 2, generator=gen) * 3
    return kv, gate, angles.cos().to(dt), angles.sin().to(dt)


def _outcome(rep) -> str:
    """"fused" when the compressor is rewritten into one `kv_compress`, else its near-miss reasons; fails when it is
    neither (silent) or rewritten more than once."""
    sites = [s for s in rep.sites if s.pass_name == "compressors"]
    reasons = [m.reason for m in rep.near_misses if m.pass_name == "compressors"]
    assert len(sites) + len(reasons) == 1 and all(s.op == "dsfuse.kv_compress" for s in sites), str(rep)
    return "fused" if sites else reasons[0]


@settings(max_examples=DRAWS, deadline=None)
@given(choice=st.fixed_dictionaries({axis: st.sampled_from(values) for axis, values in AXES.items()}),
       m=st.sampled_from([4, 8]), windows=st.sampled_from([1, 3]), leftover=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**16))
def test_every_spelling_is_fused_with_parity_or_reported(choice, m, windows, leftover, seed):
    torch._dynamo.reset()
    dsfuse.reset_report()
    module = Spelled(choice, m, seed)
    args = inputs(module, windows, leftover, seed)
    with torch.no_grad():
        got = torch.compile(module, backend="dsfuse", options={"enable": ["compressors"]})(*args)
        want = module(*args)
    rep = dsfuse.report()
    tolerance = TOLERANCE[want.dtype]
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item(),
                               msg=lambda msg: f"{msg}\n{choice}\n{rep}")
    outcome = _outcome(rep)
    for axis in AXES:
        OUTCOMES[axis, choice[axis]].append(outcome)
    write_spelling_stats(OUTCOMES)


def test_every_axis_value_computes_transformers_compressor():
    """Each axis value gives a module that agrees (fp32, eagerly) with HF's compressor math as
    `DeepseekV4HCACompressor` / `DeepseekV4CSACompressor` write it, so a draw is never a wrong program that eager and
    compiled both reproduce."""
    first = {axis: values[0] for axis, values in AXES.items()} | {"dtype": "fp32"}
    for axis, values in AXES.items():
        for value in values:
            for slots in AXES["slots"]:
                choice = first | {axis: value} | {"slots": slots} | {"dtype": "fp32"}
                module = Spelled(choice, 4, 0)
                reference = Spelled(first | {"slots": "two series, slice assignment" if module.overlap else
                                             "one series"}, 4, 0)
                args = inputs(module, 3, 1, 0)
                with torch.no_grad():
                    torch.testing.assert_close(module(*args), reference(*args), rtol=1e-5, atol=1e-5,
                                               msg=lambda msg: f"{msg}\n{choice}")
