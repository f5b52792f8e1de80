"""`dsfuse::compressed_attention`: the reference against HF V4's own eager attention, and the op's contract."""

import pytest
import torch

from dsfuse.kernels.compressed_attention import compressed_attention_reference, inverse_rope_reference

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402


class _Module(torch.nn.Module):
    def __init__(self, sinks):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.num_key_value_groups = sinks.shape[0]


def _hf_attention(q, kv, compressed, visible_bias, sinks, scale):
    """HF's eager attention on [B, H, S, D] queries over cat(kv, compressed) with an additive bias."""
    keys = kv if compressed is None else torch.cat([kv, compressed], dim=1)
    out, _ = hf_v4.eager_attention_forward(_Module(sinks), q.transpose(1, 2), keys.unsqueeze(1), keys.unsqueeze(1),
                                           visible_bias, scaling=scale)
    return out


def _inputs(B, S, H, D, T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    kv = torch.randn(B, S, D, generator=g).to(dtype)
    compressed = torch.randn(B, T, D, generator=g).to(dtype) if T else None
    sinks = torch.randn(H, generator=g)
    return q, kv, compressed, sinks


def _sliding_bias(q_pos, kv_pos, window, dtype):
    delta = q_pos.unsqueeze(-1) - kv_pos.unsqueeze(1)
    ok = (kv_pos.unsqueeze(1) >= 0) & (delta >= 0) & (delta < window)
    return torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min).unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_reference_equals_hf_eager_attention(dtype, kind):
    B, S, H, D, W, rate = 2, 23, 3, 16, 5, 4
    T = S // rate if kind != "sliding" else 0
    q, kv, compressed, sinks = _inputs(B, S, H, D, T, dtype)
    q_pos = torch.arange(S).expand(B, S).clone()
    kv_pos = q_pos.clone()
    kv_pos[1, :3] = -1  # left padding of the second row's keys
    bias = _sliding_bias(q_pos, kv_pos, W, dtype)
    indices = None
    if kind == "csa":
        g = torch.Generator().manual_seed(1)
        threshold = (q_pos + 1) // rate
        indices = torch.stack([torch.randperm(T, generator=g)[:3] for _ in range(B * S)]).view(B, S, 3)
        indices = torch.where(indices >= threshold.unsqueeze(-1), -1, indices)
        block = torch.full((B, 1, S, T + 1), float("-inf"))
        block.scatter_(-1, torch.where(indices >= 0, indices, T).unsqueeze(1), 0.0)
        bias = torch.cat([bias, block[..., :T].to(dtype)], dim=-1)
    elif kind == "hca":
        future = torch.arange(T).view(1, 1, -1) >= ((q_pos + 1) // rate).unsqueeze(-1)
        bias = torch.cat([bias, torch.zeros(B, 1, S, T).masked_fill(future.unsqueeze(1), float("-inf")).to(dtype)], -1)
    want = _hf_attention(q, kv, compressed, bias, sinks, D ** -0.5)
    got = compressed_attention_reference(q, kv, q_pos, kv_pos, compressed, indices, sinks, D ** -0.5, W, rate)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inverse_rope_equals_hf_conjugate_rotation():
    x = torch.randn(2, 7, 3, 16).to(torch.bfloat16)
    cos, sin = torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    want = hf_v4.apply_rotary_pos_emb(x.transpose(1, 2), cos, -sin).transpose(1, 2)
    torch.testing.assert_close(inverse_rope_reference(x, cos, sin), want, rtol=0, atol=0)


def test_fully_masked_rows_give_zero_and_op_checks_its_inputs():
    q, kv, compressed, sinks = _inputs(1, 4, 2, 8, 2, torch.float32)
    q_pos = torch.arange(4).view(1, 4)
    kv_pos = torch.full((1, 4), -1)
    # no window key is valid and no compressed entry is complete yet ((3 + 1) // 8 = 0)
    out = torch.ops.dsfuse.compressed_attention(q, kv, q_pos, kv_pos, compressed, None, sinks, 0.3, 4, 8, None, None)
    assert torch.equal(out, torch.zeros_like(out))
    bad = torch.full((1, 4, 2), 5)
    with pytest.raises(ValueError, match=r"indices must lie in \[-1, 2\)"):
        torch.ops.dsfuse.compressed_attention(q, kv, q_pos, q_pos, compressed, bad, sinks, 0.3, 4, 4, None, None)
    with pytest.raises(ValueError, match="sinks must be fp32"):
        torch.ops.dsfuse.compressed_attention(q, kv, q_pos, q_pos, None, None, sinks.half(), 0.3, 4, 4, None, None)


def test_opcheck():
    q, kv, compressed, sinks = _inputs(2, 6, 2, 8, 3, torch.float32)
    pos = torch.arange(6).expand(2, 6).contiguous()
    idx = torch.tensor([[[0, -1]] * 6] * 2)
    cos, sin = torch.randn(2, 6, 2), torch.randn(2, 6, 2)
    for args in [(q, kv, pos, pos, compressed, idx, sinks, 0.3, 3, 2, cos, sin),
                 (q, kv, pos, pos, compressed, None, sinks, 0.3, 3, 2, None, None),
                 (q, kv, pos, pos, None, None, sinks, 0.3, 3, 2, None, None)]:
        torch.library.opcheck(torch.ops.dsfuse.compressed_attention.default, args)
