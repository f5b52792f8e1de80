"""Spelling fuzzer for the `hyper_connections` family (DeepSeek V4's manifold-constrained hyper-connections): each
draw composes one module of a hyper-connection block (the weights from the streams, the collapse into the block's
input, a linear block, the exit back into the streams, and optionally the final head collapse) from independent,
semantics-preserving choices, compiles it with `backend="dsfuse"` and checks it against eager: the same output within
the dtype's budget, and every candidate either fused or reported as a near-miss with its reason; never wrong, never
silent.

Axes, after transformers' `DeepseekV4HyperConnection` / `DeepseekV4HyperHead` / `DeepseekV4DecoderLayer` and the
official inference code's `hc_pre` / `hc_post`: the stream layout (`[B, S, n, D]`, flattened `[B, S, n*D]`,
token-major `[T, n, D]`), the projection (`F.linear`, `@ fn.T`, `einsum`, `matmul` of the token-flattened rows), the
unweighted RMSNorm (`rsqrt(mean(a^2) + eps)`, `a * a`, `sum(a^2) / K`, `F.rms_norm`, the rsqrt applied after the
projection), how the mixes are cut (`split` with `base.split` / `scale.unbind`, or slices with `scale[i]`) and in
which order the three weights are computed, the comb's `n x n` view (before the affine map or after it), the sigmoid
(`sigmoid`, `1 / (1 + exp(-z))`, `special.expit`), the affine map and constant placement, the Sinkhorn loop (HF's
column then (row, column) pairs, one alternating loop, a written-out softmax, a softmax without its max, the steps as
a product with the reciprocal) and its iteration count, the collapse (broadcast sum, the official sum over the fp32
flattened copy, `einsum`, `matmul`, `bmm`), the exit's mix (`matmul` of comb^T, `einsum`, `bmm` of `.mT`, the
official broadcast sum of fp32 products, the operands swapped) and the dtype of the streams (the weights stay fp32,
as transformers keeps them).

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
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

import dsfuse
from dsfuse.models.presets import hf_config

DRAWS = int(os.environ.get("DSFUSE_SPELLING_DRAWS", "12"))
N, NORM_EPS, HC_EPS = 4, 1e-6, 1e-6
MIXES = (2 + N) * N

AXES = {
    "layout": ("[B,S,n,D]", "[B,S,n*D]", "[T,n,D]"),
    "projection": ("F.linear", "@ fn.T", "einsum", "matmul of token rows"),
    "norm": ("rsqrt(mean(a^2)+eps)", "rsqrt(mean(a*a)+eps)", "rsqrt(sum(a^2)/K+eps)", "F.rms_norm",
             "rsqrt after projection"),
    "split": ("split + unbind", "slices + scale[i]"),
    "order": ("pre, post, comb", "comb, post, pre", "post, comb, pre"),
    "comb_view": ("view logits", "view after affine"),
    "gate": ("sigmoid", "1/(1+exp(-z))", "special.expit"),
    "affine": ("w*s+b, 2*g, g+eps", "b+s*w, g*2, eps+g"),
    "sinkhorn": ("HF col, (row, col)*", "one alternating loop", "exp(z-max)/sum softmax", "exp(z)/sum softmax",
                 "steps as c * (1/(sum+eps))"),
    "iters": (1, 2, 3),
    "collapse": ("(pre[...,None]*x).sum", "sum over fp32 flat view", "einsum", "pre[...,None,:] @ x", "bmm"),
    "exit": ("matmul(comb^T, x)", "einsum", "bmm of .mT", "official fp32 broadcast sum", "mix + expanded post"),
    "head": ("none", "head"),
    "dtype": ("bf16", "fp32"),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
OUTCOMES: dict[tuple[str, str], list[str]] = defaultdict(list)  # (axis, choice) -> "fused" or the reasons, per draw


class Spelled(torch.nn.Module):
    """A hyper-connection around a linear block, then optionally the head, written with the drawn choices; the
    parameters as transformers keeps them (fp32 `fn`, `base`, `scale`; the block in the streams' dtype)."""

    def __init__(self, choice: dict, hidden: int, seed: int):
        super().__init__()
        self.choice, self.hidden = choice, hidden
        gen = torch.Generator().manual_seed(seed)

        def param(*size, shift=0.0, spread=0.1):
            return torch.nn.Parameter(torch.randn(*size, generator=gen) * spread + shift)

        self.fn, self.base, self.scale = param(MIXES, N * hidden), param(MIXES, shift=0.5), param(3, shift=0.5)
        self.hc_fn, self.hc_base, self.hc_scale = param(N, N * hidden), param(N, shift=0.5), param(1, shift=0.5)
        self.block = torch.nn.Parameter(
            (torch.randn(hidden, hidden, generator=gen) * 0.2).to(DTYPES[choice["dtype"]]))

    # ---------------------------------------------------------------- the weights
    def _norm_and_project(self, flat: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        """fn-projection of the unweighted RMSNorm of the fp32 flattened streams `flat` [..., n*D]."""
        kind, size = self.choice["norm"], flat.shape[-1]
        rsqrt = None
        if kind == "F.rms_norm":
            normed = F.rms_norm(flat, (size,), eps=NORM_EPS)
        else:
            if kind == "rsqrt(mean(a*a)+eps)":
                stat = (flat * flat).mean(-1, keepdim=True)
            elif kind == "rsqrt(sum(a^2)/K+eps)":
                stat = flat.pow(2).sum(-1, keepdim=True) / size
            else:
                stat = flat.pow(2).mean(-1, keepdim=True)
            rsqrt = torch.rsqrt(stat + NORM_EPS)
            normed = flat if kind == "rsqrt after projection" else flat * rsqrt
        mixes = self._project(normed, fn)
        return mixes * rsqrt if kind == "rsqrt after projection" else mixes

    def _project(self, a: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        kind = self.choice["projection"]
        if kind == "F.linear":
            return F.linear(a, fn)
        if kind == "@ fn.T":
            return a @ fn.T
        if kind == "einsum":
            return torch.einsum("...k,rk->...r", a, fn)
        return torch.matmul(a.reshape(-1, a.shape[-1]), fn.t()).view(*a.shape[:-1], fn.shape[0])

    def _gate(self, z: torch.Tensor) -> torch.Tensor:
        kind = self.choice["gate"]
        if kind == "sigmoid":
            return torch.sigmoid(z)
        if kind == "1/(1+exp(-z))":
            return 1 / (1 + torch.exp(-z))
        return torch.special.expit(z)

    def _affine(self, w, s, b):
        return w * s + b if self.choice["affine"].startswith("w*s+b") else b + s * w

    def _pre(self, z):
        g = self._gate(z)
        return g + HC_EPS if self.choice["affine"].startswith("w*s+b") else HC_EPS + g

    def _post(self, z):
        g = self._gate(z)
        return 2 * g if self.choice["affine"].startswith("w*s+b") else g * 2

    def _softmax(self, z):
        kind = self.choice["sinkhorn"]
        if kind == "exp(z-max)/sum softmax":
            e = torch.exp(z - z.amax(dim=-1, keepdim=True))
            return e / e.sum(dim=-1, keepdim=True)
        if kind == "exp(z)/sum softmax":
            e = torch.exp(z)
            return e / e.sum(dim=-1, keepdim=True)
        return torch.softmax(z, dim=-1)

    def _sinkhorn(self, comb):
        kind, iters = self.choice["sinkhorn"], self.choice["iters"]

        def step(c, dim):
            if kind == "steps as c * (1/(sum+eps))":
                return c * (1 / (c.sum(dim=dim, keepdim=True) + HC_EPS))
            return c / (c.sum(dim=dim, keepdim=True) + HC_EPS)

        if kind == "one alternating loop":
            for i in range(2 * iters - 1):
                comb = step(comb, -2 if i % 2 == 0 else -1)
            return comb
        comb = step(comb, -2)
        for _ in range(iters - 1):
            comb = step(step(comb, -1), -2)
        return comb

    def _weights(self, mixes):
        """(pre, post, comb) from the mixes [..., (2 + n) n], computed in the drawn order."""
        if self.choice["split"] == "split + unbind":
            pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
            pre_b, post_b, comb_b = self.base.split([N, N, N * N])
            pre_s, post_s, comb_s = self.scale.unbind(0)
        else:
            pre_w, post_w, comb_w = mixes[..., :N], mixes[..., N:2 * N], mixes[..., 2 * N:]
            pre_b, post_b, comb_b = self.base[:N], self.base[N:2 * N], self.base[2 * N:]
            pre_s, post_s, comb_s = self.scale[0], self.scale[1], self.scale[2]

        def comb():
            if self.choice["comb_view"] == "view logits":
                z = self._affine(comb_w.view(*comb_w.shape[:-1], N, N), comb_s, comb_b.view(N, N))
            else:
                z = self._affine(comb_w, comb_s, comb_b).view(*comb_w.shape[:-1], N, N)
            return self._sinkhorn(self._softmax(z) + HC_EPS)

        makers = {"pre": lambda: self._pre(self._affine(pre_w, pre_s, pre_b)),
                  "post": lambda: self._post(self._affine(post_w, post_s, post_b)), "comb": comb}
        made = {name: makers[name]() for name in self.choice["order"].split(", ")}
        return made["pre"], made["post"], made["comb"]

    # ---------------------------------------------------------------- collapse, block, exit
    def _collapse(self, pre, streams, flat):
        """sum_j pre[..., j] * streams[..., j, :] in fp32, cast back to the streams' dtype."""
        kind, dt = self.choice["collapse"], streams.dtype
        if kind == "(pre[...,None]*x).sum":
            total = (pre.unsqueeze(-1) * streams).sum(dim=-2)
        elif kind == "sum over fp32 flat view":
            total = torch.sum(pre.unsqueeze(-1) * flat.view(streams.shape), dim=-2)
        elif kind == "einsum":
            total = torch.einsum("...n,...nd->...d", pre, streams.float())
        elif kind == "pre[...,None,:] @ x":
            total = (pre.unsqueeze(-2) @ streams.float()).squeeze(-2)
        else:
            total = torch.bmm(pre.reshape(-1, 1, N), streams.float().reshape(-1, N, self.hidden)).view(
                *streams.shape[:-2], self.hidden)
        return total.to(dt)

    def _exit(self, post, comb, out, streams):
        """post * out + comb^T @ streams per token, in the streams' dtype."""
        kind, dt = self.choice["exit"], streams.dtype
        if kind == "official fp32 broadcast sum":
            mixed = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * streams.unsqueeze(-2),
                                                                        dim=-3)
            return mixed.type_as(streams)
        expanded = post.to(dt).unsqueeze(-1) * out.unsqueeze(-2)
        comb = comb.to(dt)
        if kind == "einsum":
            return expanded + torch.einsum("...jk,...jd->...kd", comb, streams)
        if kind == "bmm of .mT":
            return expanded + torch.bmm(comb.flatten(0, -3).mT, streams.flatten(0, -3)).view(streams.shape)
        mixed = torch.matmul(comb.transpose(-1, -2), streams)
        return mixed + expanded if kind == "mix + expanded post" else expanded + mixed

    def _head(self, streams, flat):
        mixes = self._norm_and_project(flat, self.hc_fn)
        return self._collapse(self._pre(self._affine(mixes, self.hc_scale, self.hc_base)), streams, flat)

    def _unflatten(self, x):
        """(streams [..., n, D], their fp32 flattened copy [..., n*D]) from the module's input layout."""
        if self.choice["layout"] == "[B,S,n*D]":
            return x.view(*x.shape[:-1], N, self.hidden), x.float()
        return x, x.flatten(-2).float()

    def forward(self, x):
        streams, flat = self._unflatten(x)
        pre, post, comb = self._weights(self._norm_and_project(flat, self.fn))
        out = F.linear(self._collapse(pre, streams, flat), self.block)
        streams = self._exit(post, comb, out, streams)
        if self.choice["head"] == "head":
            return self._head(streams, streams.flatten(-2).float())
        return streams.flatten(-2) if self.choice["layout"] == "[B,S,n*D]" else streams


def streams_input(choice: dict, hidden: int, tokens: int, seed: int) -> torch.Tensor:
    """The streams in the drawn layout and dtype."""
    x = torch.randn(2, tokens, N, hidden, generator=torch.Generator().manual_seed(seed)).to(DTYPES[choice["dtype"]])
    if choice["layout"] == "[B,S,n*D]":
        return x.flatten(-2)
    if choice["layout"] == "[T,n,D]":
        return x.flatten(0, 1)
    return x


def _outcome(rep, choice: dict) -> str:
    """"fused" when every candidate of the draw is rewritten, else its near-miss reasons; fails when a candidate is
    neither (silent) or a site is rewritten into the wrong op."""
    ops = [s.op for s in rep.sites if s.pass_name == "hyper_connections"]
    reasons = [m.reason for m in rep.near_misses if m.pass_name == "hyper_connections"]
    exit_reasons = [r for r in reasons if r.startswith("hyper-connection exit")]
    collapses, heads, exits = (ops.count(f"dsfuse.{op}") for op in ("hc_collapse", "hc_head", "hc_expand_mix"))
    want_heads = int(choice["head"] == "head")
    assert len(ops) == collapses + heads + exits and collapses <= 1 and heads <= want_heads, (choice, str(rep))
    # each collapse candidate (the block's and the head's) is rewritten or reported
    assert collapses + heads + len(reasons) - len(exit_reasons) == 1 + want_heads, (choice, str(rep))
    # the exit reads the collapse's post and comb: rewritten or reported once that collapse is, else left
    assert exits + len(exit_reasons) == collapses, (choice, str(rep))
    return "fused" if not reasons else "; ".join(sorted(set(reasons)))


@settings(max_examples=DRAWS)
@given(choice=st.fixed_dictionaries({axis: st.sampled_from(values) for axis, values in AXES.items()}),
       hidden=st.sampled_from([16, 24, 64]), tokens=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_every_spelling_is_fused_with_parity_or_reported(choice, hidden, tokens, seed):
    torch._dynamo.reset()
    dsfuse.reset_report()
    module, x = Spelled(choice, hidden, seed), streams_input(choice, hidden, tokens, seed)
    with torch.no_grad():
        got = torch.compile(module, backend="dsfuse", options={"enable": ["hyper_connections"]})(x)
        want = module(x)
    rep = dsfuse.report()
    tolerance = TOLERANCE[x.dtype]
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item(),
                               msg=lambda m: f"{m}\n{choice}\n{rep}")
    outcome = _outcome(rep, choice)
    for axis in AXES:
        OUTCOMES[axis, choice[axis]].append(outcome)
    write_spelling_stats(OUTCOMES)


def _hf_reference(module: Spelled, x: torch.Tensor) -> torch.Tensor:
    """The same block with transformers' modules and `DeepseekV4DecoderLayer`'s exit, fp32, streams [B, S, n, D]."""
    config = hf_config("v4-tiny", hidden_size=module.hidden, hc_mult=N, hc_sinkhorn_iters=module.choice["iters"],
                       rms_norm_eps=NORM_EPS, hc_eps=HC_EPS)
    hc, head = DeepseekV4HyperConnection(config), DeepseekV4HyperHead(config)
    hc.load_state_dict({"fn": module.fn, "base": module.base, "scale": module.scale}, strict=False)
    head.load_state_dict({"hc_fn": module.hc_fn, "hc_base": module.hc_base, "hc_scale": module.hc_scale}, strict=False)
    post, comb, collapsed = hc(x)
    out = F.linear(collapsed, module.block)
    streams = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
    return head(streams) if module.choice["head"] == "head" else streams


def test_every_axis_value_agrees_with_transformers():
    """Each axis value gives a module that agrees (fp32, eagerly) with transformers' hyper-connection, exit and
    head, so a draw is never a wrong program that eager and compiled both reproduce."""
    first = {axis: values[0] for axis, values in AXES.items()} | {"dtype": "fp32"}
    for axis, values in AXES.items():
        for value in values:
            for head in AXES["head"]:
                choice = first | {"head": head, axis: value}
                if choice["dtype"] != "fp32":
                    continue
                module, x = Spelled(choice, 24, 0), streams_input(choice, 24, 3, 0)
                with torch.no_grad():
                    got = module(x)
                    want = _hf_reference(module, x.view(2, 3, N, 24))
                torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{m}\n{choice}")
