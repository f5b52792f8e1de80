"""Tiny real models compiled with dsfuse: exact rewrite counts and parity with eager."""

import pytest
import torch

import dsfuse
from dsfuse.models.presets import build_hf_model

SEQ = 20  # > index_topk (8) of the tiny preset, so the sparse mask really drops keys


def _inputs(model, batch=2, seq=SEQ, pad=3):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :pad] = 0  # left padding on the second row
    return ids, mask


def _run(model, backend, options=None):
    ids, mask = _inputs(model)
    torch._dynamo.reset()
    dsfuse.reset_report()
    fn = model if backend is None else torch.compile(model, backend=backend, options=options)
    with torch.no_grad():
        return fn(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_tiny_fp32_counts_and_parity(attn):
    model = build_hf_model("tiny", attn_implementation=attn)
    expected = _run(model, None)
    out = _run(model, "dsfuse")
    rep = dsfuse.report()
    layers = model.config.num_hidden_layers
    assert rep.counts["indexer_topk"] == layers, str(rep)
    assert [m for m in rep.near_misses if m.pass_name == "indexer_topk"] == [], str(rep)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_all_passes_off_is_plain_inductor():
    model = build_hf_model("tiny")
    inductor = _run(model, "inductor")
    off = _run(model, "dsfuse", {"disable": list(dsfuse.PASS_NAMES)})
    rep = dsfuse.report()
    assert rep.counts == {name: 0 for name in dsfuse.PASS_NAMES}
    assert rep.graphs[0].enabled == ()
    assert torch.equal(off, inductor)


def test_hf_tiny_bf16_parity():
    model = build_hf_model("tiny", dtype=torch.bfloat16)
    expected = _run(model, None).float()
    inductor = _run(model, "inductor").float()
    out = _run(model, "dsfuse").float()
    assert dsfuse.report().counts["indexer_topk"] == model.config.num_hidden_layers
    inductor_error = ((inductor - expected).norm() / expected.norm()).item()
    dsfuse_error = ((out - expected).norm() / expected.norm()).item()
    assert dsfuse_error <= max(2e-2, 1.25 * inductor_error), (dsfuse_error, inductor_error)


def test_hf_eager_experts_loop_with_graph_breaks_stays_correct():
    model = build_hf_model("tiny", experts_implementation="eager")
    expected = _run(model, None)
    out = _run(model, "dsfuse")
    rep = dsfuse.report()
    assert len(rep.graphs) > 1, "the eager experts loop is expected to break the graph"
    assert rep.counts["indexer_topk"] == model.config.num_hidden_layers
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_hf_decode_step_with_cache_is_rewritten_and_matches():
    import copy

    model = build_hf_model("tiny")
    ids, _ = _inputs(model, pad=0)
    with torch.no_grad():
        prefill = model(ids, use_cache=True)
        step = prefill.logits[:, -1:].argmax(-1)
        compiled_cache = copy.deepcopy(prefill.cache)
        expected = model(step, cache=prefill.cache, use_cache=True).logits
        dsfuse.reset_report()
        out = torch.compile(model, backend="dsfuse")(step, cache=compiled_cache, use_cache=True).logits
    assert dsfuse.report().counts["indexer_topk"] == model.config.num_hidden_layers
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_new_sequence_lengths_do_not_recompile():
    model = build_hf_model("tiny")
    compiled = torch.compile(model, backend="dsfuse")
    with torch.no_grad():
        for seq in (20, 24, 28):
            ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    rep = dsfuse.report()
    # The first length compiles a static graph; the second marks the length dynamic; the third reuses it.
    assert len(rep.graphs) == 2, str(rep)
    assert rep.counts["indexer_topk"] == 2 * model.config.num_hidden_layers
