"""indexer_topk: reference math, custom op registration, and the Triton path (interpreter on CPU)."""

import pytest
import sm90_offline
import torch
from dsfuse.kernels.indexer_topk import (
    _select_kernel,
    flops,
    indexer_topk,
    indexer_topk_reference,
    indexer_topk_triton,
    topk_lowest_index_ties,
)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter's bf16 dot is wrong; fp16 takes its place there (both are exact products in fp32).
HALF = torch.bfloat16 if ON_GPU else torch.float16


def masked_index_scores(q, k, weights, k_scale, mask, softmax_scale, fill=float("-inf")):
    """The [B, S, T] fp32 scores the top-k is taken over (the reference's own intermediate)."""
    scores = torch.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * softmax_scale)
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if k_scale is not None:
        index = index * k_scale.unsqueeze(1)
    if mask is not None:
        index = index.masked_fill(~mask, fill) if mask.dtype == torch.bool else index + mask
    return index


def assert_exact_topk(out, q, k, weights, k_scale, mask, softmax_scale, topk):
    """Indices in range, distinct per row, and their scores equal the reference's top-k scores."""
    index = masked_index_scores(q, k, weights, k_scale, mask, softmax_scale).cpu()
    B, S, T = index.shape
    width = min(topk, T)
    out = out.cpu()
    assert out.dtype == torch.int32
    assert tuple(out.shape) == (B, S, width)
    if out.numel() == 0:
        return
    assert int(out.min()) >= 0 and int(out.max()) < T
    sorted_idx = out.sort(dim=-1).values
    assert not bool((sorted_idx.diff(dim=-1) == 0).any()), "duplicate indices in a row"
    got = torch.gather(index, -1, out.long()).sort(dim=-1).values
    want = index.topk(width, dim=-1).values.sort(dim=-1).values
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def causal_mask(B, S, T):
    offset = T - S
    allowed = torch.arange(T)[None, :] <= torch.arange(S)[:, None] + offset
    return allowed[None].expand(B, S, T)


def make_inputs(B, S, T, H, D, dtype=HALF, seed=0, with_k_scale=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, T, D, generator=g)
    if dtype == torch.float8_e4m3fn:
        q, k = q * 4, k * 4
    weights = torch.randn(B, S, H, generator=g)
    k_scale = (torch.rand(B, T, generator=g) + 0.5) if with_k_scale else None
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return to(q.to(dtype)), to(k.to(dtype)), to(weights), to(k_scale)


# ------------------------------------------------------------------------------------------ reference
def test_reference_matches_hand_built_loops():
    q, k, w, ks = make_inputs(2, 3, 11, 3, 8, dtype=torch.float32, with_k_scale=True)
    q, k, w, ks = q.cpu(), k.cpu(), w.cpu(), ks.cpu()
    mask = causal_mask(2, 3, 11).clone()
    mask[1, :, :2] = False
    scale = 0.3
    index = torch.empty(2, 3, 11)
    for b in range(2):
        for s in range(3):
            for t in range(11):
                total = 0.0
                for h in range(3):
                    total += float(w[b, s, h]) * max(float(q[b, s, h] @ k[b, t]) * scale, 0.0)
                total *= float(ks[b, t])
                index[b, s, t] = total if mask[b, s, t] else float("-inf")
    out = indexer_topk_reference(q, k, w, ks, mask, scale, 4)
    assert out.dtype == torch.int32 and tuple(out.shape) == (2, 3, 4)
    torch.testing.assert_close(torch.gather(index, -1, out.long()), index.topk(4, dim=-1).values)


def test_reference_additive_mask_and_width_clamp():
    q, k, w, _ = make_inputs(1, 4, 6, 2, 8, dtype=torch.float32)
    q, k, w = q.cpu(), k.cpu(), w.cpu()
    additive = torch.zeros(4, 6)
    additive[:, 0] = float("-inf")
    out = indexer_topk_reference(q, k, w, None, additive, 1.0, 10)
    assert tuple(out.shape) == (1, 4, 6)
    # the -inf key ranks last in every row
    assert bool((out[..., -1] == 0).all())


# ------------------------------------------------------------------------------------------ custom op
def test_opcheck_custom_op():
    q, k, w, ks = make_inputs(1, 5, 24, 4, 16, dtype=torch.float32, with_k_scale=True)
    mask = causal_mask(1, 5, 24).to(DEVICE)
    torch.library.opcheck(indexer_topk, (q, k, w, ks, mask, 0.25, 8))
    torch.library.opcheck(indexer_topk, (q, k, w, None, None, 0.25, 40))
    torch.library.opcheck(indexer_topk, (q, k, w, ks, mask, 0.25, 8, True))
    torch.library.opcheck(indexer_topk, (q, k, w, ks, mask, 0.25, 8, False, -1e9))


def test_fake_output_width_is_symbolic_min():
    def fn(q, k, w):
        return torch.ops.dsfuse.indexer_topk(q, k, w, None, None, 0.5, 8)

    compiled = torch.compile(fn, backend="eager", dynamic=True, fullgraph=True)
    for T in (5, 12, 20):
        q, k, w, _ = make_inputs(1, 3, T, 2, 16, dtype=torch.float32)
        out = compiled(q, k, w)
        assert tuple(out.shape) == (1, 3, min(8, T))
        assert_exact_topk(out, q, k, w, None, None, 0.5, 8)


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda a: a.update(q=a["q"][0]), ValueError),
        (lambda a: a.update(k=a["k"][:, :, :8]), ValueError),
        (lambda a: a.update(k=a["k"].float()), TypeError),
        (lambda a: a.update(weights=a["weights"].half()), TypeError),
        (lambda a: a.update(weights=a["weights"][:, :, :2]), ValueError),
        (lambda a: a.update(k_scale=a["weights"][:, 0]), ValueError),
        (lambda a: a.update(mask=torch.ones(3, 5, 7, dtype=torch.bool)), ValueError),
        (lambda a: a.update(mask=torch.ones(5, 20, dtype=torch.int32)), TypeError),
        (lambda a: a.update(topk=0), ValueError),
        (lambda a: a.update(fill=-1e9), ValueError),  # a fill without a bool mask
        (lambda a: a.update(mask=torch.zeros(1, 5, 20), fill=-1e9), ValueError),
    ],
)
def test_bad_input_raises(mutate, error):
    q, k, w, _ = make_inputs(1, 5, 20, 4, 16)
    args = dict(q=q, k=k, weights=w, k_scale=None, mask=None, softmax_scale=0.5, topk=4)
    mutate(args)
    with pytest.raises(error):
        indexer_topk(**args)
    with pytest.raises(error):
        indexer_topk_triton(**args)


# ------------------------------------------------------------------------------------------ Triton path
def padded_causal_additive(B, S, T, pad):
    allowed = causal_mask(B, S, T).clone()
    for b, p in enumerate(pad):
        allowed[b, :, :p] = False
    return torch.zeros(B, S, T).masked_fill(~allowed, float("-inf"))


def causal_with_holes(B, S, T):
    """Causal, plus masked keys inside the visible range of even rows: those rows are not "plain"
    (their mask is not a range test), odd rows are, so one query block mixes both."""
    t = torch.arange(T)[None, :]
    s = torch.arange(S)[:, None]
    holes = (t % 5 == 2) & (s % 2 == 0)
    return causal_mask(B, S, T) & ~holes[None]


CASES = {
    "causal_bool_tiny": dict(B=1, S=5, T=40, H=4, D=32, topk=8, mask="causal"),
    "causal_prefill_no_cache": dict(B=1, S=40, T=40, H=4, D=32, topk=16, mask="causal"),
    # the same keys fit the candidate buffer (64): every key a candidate above, a sampled threshold here
    "causal_prefill_sampled_threshold": dict(B=1, S=40, T=40, H=4, D=32, topk=16, mask="causal",
                                             config={"every_key": False}),
    "padding_additive": dict(B=2, S=17, T=100, H=4, D=32, topk=16, mask="padded_additive"),
    "no_mask_odd_heads_dim": dict(B=1, S=9, T=200, H=3, D=24, topk=64, mask=None),
    "topk_above_T": dict(B=2, S=6, T=40, H=4, D=32, topk=64, mask="causal"),
    "fp8_with_k_scale": dict(B=1, S=33, T=150, H=4, D=32, topk=16, mask="causal", dtype=torch.float8_e4m3fn,
                             with_k_scale=True),
    "fp32_exact_dot": dict(B=1, S=7, T=64, H=4, D=16, topk=8, mask="causal", dtype=torch.float32),
    "split_keys_atomic_counts": dict(B=2, S=3, T=130, H=4, D=32, topk=8, mask="causal", config={"splits": 3}),
    "repair_underflow": dict(B=1, S=6, T=90, H=4, D=32, topk=8, mask="causal", threshold=float("inf")),
    "repair_overflow": dict(B=1, S=6, T=90, H=4, D=32, topk=8, mask="causal", threshold=float("-inf"),
                            candidate_capacity=16),
    "additive_finite_min_mask": dict(B=1, S=9, T=60, H=4, D=32, topk=8, mask="finite_min"),
    "fp8_tensor_cores_flag": dict(B=1, S=5, T=70, H=4, D=32, topk=8, mask="causal", dtype=torch.float8_e4m3fn,
                                  fp8_tensor_cores=True),
    "long_rows_chunked_ranges": dict(B=1, S=2, T=9000, H=4, D=16, topk=8, mask="padded_additive", pad=[8500]),
    "bool_mask_holes_in_some_rows": dict(B=1, S=9, T=70, H=4, D=32, topk=8, mask="holes_bool"),
    "additive_mask_holes_in_some_rows": dict(B=1, S=9, T=70, H=4, D=32, topk=8, mask="holes_additive"),
    "fused_select_padding": dict(B=2, S=9, T=100, H=4, D=32, topk=16, mask="padded_additive",
                                 config={"fuse_select": True}),
    "fused_select_fill_topk_above_T": dict(B=2, S=6, T=40, H=4, D=32, topk=64, mask="causal",
                                           config={"fuse_select": True}),
    "fused_select_repair_overflow": dict(B=1, S=6, T=90, H=4, D=32, topk=8, mask="causal", threshold=float("-inf"),
                                         candidate_capacity=16, config={"fuse_select": True}),
    "heads_64_chained_head_sum": dict(B=1, S=5, T=96, H=64, D=16, topk=8, mask="causal"),
    "heads_64_tree_head_sum": dict(B=1, S=5, T=96, H=64, D=16, topk=8, mask="causal", config={"head_sum": "tree"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name):
    case = dict(CASES[name])
    B, S, T, H, D, topk = (case.pop(x) for x in ("B", "S", "T", "H", "D", "topk"))
    kind = case.pop("mask")
    pad = case.pop("pad", [0, 7])
    q, k, w, ks = make_inputs(B, S, T, H, D, dtype=case.pop("dtype", HALF),
                              with_k_scale=case.pop("with_k_scale", False))
    mask = {
        None: lambda: None,
        "causal": lambda: causal_mask(B, S, T),
        "padded_additive": lambda: padded_causal_additive(B, S, T, pad=pad),
        "finite_min": lambda: torch.zeros(B, S, T).masked_fill(~causal_mask(B, S, T), torch.finfo(torch.float32).min),
        "holes_bool": lambda: causal_with_holes(B, S, T),
        "holes_additive": lambda: torch.zeros(B, S, T).masked_fill(~causal_with_holes(B, S, T), float("-inf")),
    }[kind]()
    mask = None if mask is None else mask.to(DEVICE)
    if "threshold" in case:
        case["threshold"] = torch.full((B, S), case["threshold"], device=DEVICE)
    scale = D ** -0.5
    out = indexer_topk_triton(q, k, w, ks, mask, scale, topk, **case)
    assert_exact_topk(out, q, k, w, ks, mask, scale, topk)


@pytest.mark.parametrize("case", [
    dict(B=2, S=9, T=70, H=4, D=32, topk=8, mask="causal"),
    dict(B=1, S=6, T=40, H=4, D=32, topk=64, mask="causal"),  # width clamped to T; masked picks last
    dict(B=1, S=7, T=50, H=4, D=32, topk=8, mask="additive", dtype=torch.float8_e4m3fn, with_k_scale=True),
], ids=["causal_bool", "topk_above_T", "fp8_k_scale_additive"])
def test_triton_ordered_picks_follow_topk_order(case):
    """`ordered=True`: each row's picks in torch.topk's slot order (score descending), masked picks last."""
    case = dict(case)
    B, S, T, H, D, topk = (case.pop(x) for x in ("B", "S", "T", "H", "D", "topk"))
    q, k, w, ks = make_inputs(B, S, T, H, D, dtype=case.pop("dtype", HALF), with_k_scale=case.pop("with_k_scale", False))
    mask = causal_mask(B, S, T)
    if case.pop("mask") == "additive":
        mask = torch.zeros(B, S, T).masked_fill(~mask, float("-inf"))
    mask = mask.to(DEVICE)
    out = indexer_topk_triton(q, k, w, ks, mask, D ** -0.5, topk, ordered=True)
    assert_exact_topk(out, q, k, w, ks, mask, D ** -0.5, topk)
    index = masked_index_scores(q, k, w, ks, mask, D ** -0.5).cpu()
    want = index.topk(min(topk, T), dim=-1)
    got = torch.gather(index, -1, out.cpu().long())
    torch.testing.assert_close(got, want.values, rtol=1e-5, atol=1e-5)
    assert bool((got[..., :-1] >= got[..., 1:]).all()), "picks not in descending score order"
    unordered = indexer_topk_triton(q, k, w, ks, mask, D ** -0.5, topk)
    assert not torch.equal(unordered.cpu(), out.cpu()), "the unordered picks were already sorted: test cannot fail"


def test_triton_nan_scores_are_selected_first():
    B, S, T, H, D = 1, 6, 48, 4, 32
    q, k, w, _ = make_inputs(B, S, T, H, D)
    k[0, 3] = float("nan")  # visible to every row
    k[0, 47] = float("nan")  # masked for all but the last row
    mask = causal_mask(B, S, T).to(DEVICE)
    out = indexer_topk_triton(q, k, w, None, mask, 0.2, 8)
    assert bool((out == 3).any(dim=-1).all())
    assert bool((out[0, -1] == 47).any())
    assert_exact_topk(out, q, k, w, None, mask, 0.2, 8)


def test_triton_many_tied_scores():
    """Integer-valued scores: long runs of equal keys at the k-th place (the select's tie rule and its
    early stop), and keys sharing their high bits (the select's common-prefix shortcut)."""
    B, S, T, H, D, topk = 1, 6, 80, 4, 16, 24
    q, k, w, _ = make_inputs(B, S, T, H, D)
    q, k, w = q.sign(), k.sign(), torch.ones_like(w)
    mask = causal_mask(B, S, T).to(DEVICE)
    out = indexer_topk_triton(q, k, w, None, mask, 1.0, topk)
    assert_exact_topk(out, q, k, w, None, mask, 1.0, topk)
    q = torch.zeros_like(q)  # every score 0: all candidate keys equal, no bit left to search
    out = indexer_topk_triton(q, k, w, None, mask, 1.0, topk)
    assert_exact_topk(out, q, k, w, None, mask, 1.0, topk)


# ------------------------------------------------------------------------------------------ tie rule
# CUDA's torch.topk keeps, of the keys tied at the k-th value, the lowest indices; the kernel picks that set
# (`topk_lowest_index_ties`). CPU torch.topk does not always: std::partial_sort (k * 64 <= T) keeps the first tied
# keys it meets but lets a larger later key evict any one of them, std::nth_element (otherwise) picks any (torch
# 2.13: the top 4 of [-inf, 2, -inf, -inf, 5, -inf] are keys {0, 1, 4, 5} on the CPU, {0, 1, 2, 4} by the rule).
# So these tests compare the kernel against the rule, never against CPU torch.topk's indices.
def test_lowest_index_rule_by_hand():
    nan, inf = float("nan"), float("inf")
    index = torch.tensor([[0.0, 3.0, 0.0, -0.0, nan, 1.0, 0.0, -inf, nan, -1.0]])
    assert topk_lowest_index_ties(index, 6).tolist() == [[4, 8, 1, 5, 0, 2]]  # NaN first, -0.0 ties with 0.0
    assert topk_lowest_index_ties(index, 10).tolist() == [[4, 8, 1, 5, 0, 2, 3, 6, 9, 7]]
    masked = torch.tensor([[-inf, 2.0, -inf, -inf, 5.0, -inf]])  # fewer than k unmasked keys: the lowest -inf
    assert topk_lowest_index_ties(masked, 4).tolist() == [[4, 1, 0, 2]]


def run_select(rows, T, width, cap):
    """`_select_kernel` over hand-made candidate buffers, each row's (key, score) pairs in the given order."""
    n = len(rows)
    cand_score = torch.zeros(n, cap)
    cand_idx = torch.zeros(n, cap, dtype=torch.int32)
    for r, pairs in enumerate(rows):
        cand_idx[r, :len(pairs)] = torch.tensor([t for t, _ in pairs], dtype=torch.int32)
        cand_score[r, :len(pairs)] = torch.tensor([v for _, v in pairs])
    count = torch.tensor([len(p) for p in rows], dtype=torch.int32)
    thr = torch.full((n,), float("-inf"))
    out = torch.full((n, width), -1, dtype=torch.int32)
    fail = torch.full((n,), -1, dtype=torch.int32)
    args = [x.to(DEVICE) for x in (cand_score, cand_idx, count, thr, out, out, fail)]
    args[4] = args[5]  # no ranges (HAS_RANGES=False): any int32 pointer
    _select_kernel[(n,)](*args, T, width, CAP_P=cap, HAS_RANGES=False, FILL_BLOCK=256)
    return args[5].cpu(), args[6].cpu()


def test_select_breaks_ties_by_key_index_not_buffer_order():
    """Candidates appended out of key order (split key ranges append through atomics): of the keys tied at the
    k-th place the lowest key indices win, whatever their buffer positions."""
    g = torch.Generator().manual_seed(3)
    T, width, cap = 1000, 12, 64
    levels = [
        [9.0] * 5 + [4.0] * 20 + [1.0] * 5,  # a tie straddling the k-th place
        [0.0] * 20 + [-0.0] * 20,  # every candidate 0 (signed zeros, as a head sum leaves them)
        [float("nan")] * 15 + [2.0] * 10,  # more NaN than k: NaN ranks first, ties among NaN too
        [float(v) for v in range(40)],  # no tie: the common path
        [7.0] * 12 + [3.0] * 30,  # exactly k keys above the rest: nothing to break
    ]
    rows = []
    for values in levels:
        keys = torch.randperm(T, generator=g)[:len(values)].tolist()
        rows.append([(t, v) for t, v in zip(keys, values)])  # randperm: buffer order is not key order
    out, fail = run_select(rows, T, width, cap)
    assert fail.tolist() == [0] * len(rows)
    for r, pairs in enumerate(rows):
        dense = torch.full((1, T), float("-inf"))
        for t, v in pairs:
            dense[0, t] = v
        want = sorted(topk_lowest_index_ties(dense, width)[0].tolist())
        assert sorted(out[r].tolist()) == want, r


def integer_scores_inputs(B, S, T, H, D, seed=0):
    """q, k in {-1, 0, 1} and weights in {-1, 1}: every index score an exact small integer in the kernel and the
    reference alike, so tie classes (zeros from the relu, duplicated keys, -inf from the mask) are the same."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).sign()
    k = torch.randn(B, T, D, generator=g).sign() * (torch.rand(B, T, D, generator=g) < 0.3)
    k[:, 1::3] = k[:, :1]  # every third key a copy of the first
    q[:, ::5] = -q[:, ::5].abs()  # rows with few positive dot products: many relu zeros
    weights = torch.randint(0, 2, (B, S, H), generator=g).float() * 2 - 1
    return q.to(HALF).to(DEVICE), k.to(HALF).to(DEVICE), weights.to(DEVICE)


TIE_MASKS = {
    "causal": lambda B, S, T: causal_mask(B, S, T),
    "holes": lambda B, S, T: causal_with_holes(B, S, T),
    "padded_additive": lambda B, S, T: padded_causal_additive(B, S, T, pad=[0, 5]),
}


@pytest.mark.parametrize("config", [None, {"splits": 3}, {"fuse_select": True}, {"every_key": False}],
                         ids=["default", "split_keys", "fused_select", "sampled_threshold"])
@pytest.mark.parametrize("mask_kind", list(TIE_MASKS))
def test_triton_picks_lowest_index_among_ties(mask_kind, config):
    """Tie-heavy exact-integer scores: the picked set is exactly the lowest-index rule's, also in rows with fewer
    than k unmasked keys (the -inf filler keys: the lowest masked ones, holes inside the range included)."""
    B, S, T, H, D, topk = 2, 24, 24, 4, 16, 12  # query s sees s + 1 keys: rows 0-10 fill with masked keys
    q, k, w = integer_scores_inputs(B, S, T, H, D)
    mask = TIE_MASKS[mask_kind](B, S, T).to(DEVICE)
    out = indexer_topk_triton(q, k, w, None, mask, 1.0, topk, config=config).cpu()
    index = masked_index_scores(q, k, w, None, mask, 1.0).cpu()
    want = topk_lowest_index_ties(index, topk)
    straddling = (index == torch.gather(index, -1, want[..., -1:].long())).sum(-1) > 1
    assert int(straddling.sum()) >= S, "too few rows with a tie at the k-th place: the test cannot fail"
    assert torch.equal(out.sort(-1).values, want.sort(-1).values)
    ordered = indexer_topk_triton(q, k, w, None, mask, 1.0, topk, config=config, ordered=True).cpu()
    assert torch.equal(ordered, want)  # score descending, ties in key order


FILLS = {"finfo.min": torch.finfo(torch.float32).min, "-2": -2.0, "zero": 0.0}
FILL_CONFIGS = {"default": None, "split_keys": {"splits": 3}, "fused_select": {"fuse_select": True},
                "sampled_threshold": {"every_key": False}}


# Every path with a fill that ranks where -inf would (finfo.min) and with one that relu-zero keys tie with (zero);
# a negative fill that unmasked keys score below (-2) on the default path.
@pytest.mark.parametrize("fill, config", [(fill, config) for fill in ("finfo.min", "zero") for config in FILL_CONFIGS]
                         + [("-2", "default")])
def test_triton_finite_fill_scores_masked_keys_as_the_source_does(fill, config):
    """A bool mask whose masked keys score a finite `fill` (`masked_fill(~mask, fill)`): exactly the lowest-index
    rule over those scores, at odd sizes, with a fully masked row, rows of fewer than k unmasked keys (masked keys
    tied at the fill), padding that masks whole key tiles before a row's first unmasked key (which -inf lets the
    kernel skip), and, for fills of -2 and 0, unmasked keys scoring below the fill (which -inf would rank first)."""
    B, S, T, H, D, topk = 2, 13, 75, 3, 12, 9
    q, k, w = integer_scores_inputs(B, S, T, H, D, seed=2)
    mask = causal_with_holes(B, S, T).clone()
    mask[0, :, :3] = False
    mask[1, :, :45] = False
    mask[1, 4] = False
    mask = mask.to(DEVICE)
    value, config = FILLS[fill], FILL_CONFIGS[config]
    index = masked_index_scores(q, k, w, None, mask, 1.0, value).cpu()
    want = topk_lowest_index_ties(index, topk)
    as_neg_inf = topk_lowest_index_ties(masked_index_scores(q, k, w, None, mask, 1.0).cpu(), topk)
    differs = (want.sort(-1).values != as_neg_inf.sort(-1).values).any(-1)
    assert bool(differs.any()) == (fill != "finfo.min"), "the fill decides no row: the test cannot fail"
    out = indexer_topk_triton(q, k, w, None, mask, 1.0, topk, config=config, fill=value).cpu()
    assert torch.equal(out.sort(-1).values, want.sort(-1).values)
    ordered = indexer_topk_triton(q, k, w, None, mask, 1.0, topk, config=config, ordered=True, fill=value).cpu()
    assert torch.equal(ordered, want)
    cpu = indexer_topk(q.cpu(), k.cpu(), w.cpu(), None, mask.cpu(), 1.0, topk, fill=value)
    got = torch.gather(index, -1, cpu.long()).sort(-1).values
    assert torch.equal(got, torch.gather(index, -1, want.long()).sort(-1).values)


def test_triton_ties_in_rows_longer_than_the_candidate_buffer():
    """A zero query row (every key scores 0) and relu-zero rows over more keys than the candidate buffer holds:
    the sampled threshold is 0, the candidates overflow, and the repair picks in key order."""
    B, S, T, H, D, topk = 1, 4, 300, 4, 16, 8
    q, k, w = integer_scores_inputs(B, S, T, H, D, seed=1)
    q[0, 0] = 0
    stats = {}
    out = indexer_topk_triton(q, k, w, None, None, 1.0, topk, stats=stats).cpu()
    assert int(stats["repaired"][0]) == 1
    want = topk_lowest_index_ties(masked_index_scores(q, k, w, None, None, 1.0).cpu(), topk)
    assert out[0, 0].sort().values.tolist() == list(range(topk))
    assert torch.equal(out.sort(-1).values, want.sort(-1).values)


def test_triton_expanded_and_broadcast_masks_and_strided_inputs():
    B, S, T, H, D = 2, 7, 56, 4, 32
    q, k, w, _ = make_inputs(B, S, T, H, D)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B,S,H,D] view with H-major storage
    k_strided = torch.cat([k, k], dim=-1)[..., :D]  # row stride 2*D
    four_d = causal_mask(1, S, T)[:, None].to(DEVICE)  # [1,1,S,T] like HF's attention_mask
    expanded = four_d.expand(B, 1, S, T)[:, 0, :, :]  # zero batch stride
    for mask in (expanded, causal_mask(1, S, T)[0].to(DEVICE)):
        out = indexer_topk_triton(q_strided, k_strided, w, None, mask, 0.2, 8)
        assert_exact_topk(out, q, k, w, None, mask.expand(B, S, T), 0.2, 8)


def test_every_key_is_a_candidate_while_the_buffer_holds_the_keys():
    """40 keys, top 16: the candidate buffer (64) holds every key, so the default filters at -inf (no sample pass);
    every_key=False samples a finite threshold; 90 keys outgrow a buffer of 64 and are sampled either way."""
    for T, config, sampled in ((40, None, False), (40, {"every_key": False}, True), (90, None, True)):
        q, k, w, _ = make_inputs(1, 6, T, 4, 32)
        stats = {}
        indexer_topk_triton(q, k, w, None, None, 0.5, 16, config=config, stats=stats)
        assert bool(torch.isfinite(stats["threshold"]).all()) == sampled, (T, config)


def test_autotuned_filter_launch_passes_every_kernel_flag(monkeypatch):
    """The CUDA launch through the autotuner takes its flags apart from the fixed-tile launch; run it here with the
    autotuner replaced by its first config (the interpreter has no timer), at H = 6 (padded heads) and a mask."""
    import dsfuse.kernels.indexer_topk as m

    real_autotuned = m._autotuned_score_filter

    class FirstConfig:
        def __init__(self, block_qs):
            self.config = real_autotuned(block_qs).configs[0]

        def __getitem__(self, grid):
            def launch(*args, **flags):
                meta = dict(self.config.kwargs, num_warps=self.config.num_warps, num_stages=self.config.num_stages)
                assert not set(meta) & set(flags), "the caller passed a key the autotuner sets"
                return m._score_filter_kernel[grid(meta)](*args, **flags, **meta)
            return launch

    monkeypatch.setattr(m, "_autotunes", lambda device: True)
    monkeypatch.setattr(m, "AUTOTUNE_MIN_WORK", 0)
    monkeypatch.setattr(m, "_autotuned_score_filter", FirstConfig)
    B, S, T, H, D, topk = 1, 5, 96, 6, 32, 8
    q, k, w, _ = make_inputs(B, S, T, H, D)
    mask = causal_mask(B, S, T).to(DEVICE)
    out = indexer_topk_triton(q, k, w, None, mask, 0.2, topk)
    assert_exact_topk(out, q, k, w, None, mask, 0.2, topk)


def test_triton_empty_sequence():
    q, k, w, _ = make_inputs(1, 0, 30, 4, 32)
    out = indexer_topk_triton(q, k, w, None, None, 0.2, 8)
    assert tuple(out.shape) == (1, 0, 8) and out.dtype == torch.int32


def test_flops_counts_causal_pairs():
    assert flops(1, 3, 5, 2, 4, causal_offset=2) == 2 * 2 * 4 * (3 + 4 + 5)
    assert flops(2, 3, 5, 2, 4) == 2 * 2 * 4 * 15 * 2



# ----------------------------------------------------------------------- offline sm_90 compile
# Runs in a subprocess: the interpreter (TRITON_INTERPRET, set by conftest on CPU) replaces the JIT
# functions that `triton.compile` needs. Constexprs and options come from `default_config` at the
# H200's SM count, and integer arguments are specialized as Triton's launcher does (== 1 becomes a
# constant, multiples of 16 get the divisibility hint), so the compiled code is what the GPU runs.
SM90_COMPILE_SCRIPT = sm90_offline.PROBE_PREAMBLE + r"""
import traceback
import torch
import dsfuse.kernels.indexer_topk as m

m._num_sms = lambda device: 132  # H200
INT_POINTERS = {"range_ptr", "cand_idx_ptr", "count_ptr", "out_ptr", "fail_ptr"}


def compile_sm90(fn, constexprs, ints, options, element="*bf16"):
    pointer = lambda name: "*i32" if name in INT_POINTERS else {"q_ptr": element, "k_ptr": element,  # noqa: E731
                                                                "mask_ptr": "*u8"}.get(name, "*fp32")
    return sm90_offline.compile_sm90(fn, constexprs, ints, options, pointer,
                                     scalars={"softmax_scale": "fp32", "fill": "fp32"})


def filter_case(B, S, T, topk, dense=False, **overrides):
    H, D = 64, 128
    cfg = {**m.default_config(B, S, T, H, D, topk, torch.bfloat16, torch.device("cuda")), **overrides}
    width = min(topk, T)
    n_keys = T
    if dense:
        n_keys = triton.cdiv(T, max(1, 2 * width // cfg["sample_target_rank"]))
    constexprs = dict(HP=H, PAD_H=False, DP=D, BLOCK_Q=cfg["block_q"], BLOCK_T=cfg["block_t"], SPLITS=cfg["splits"],
                      HAS_KSCALE=False, MASK_KIND=m.MASK_BOOL, USE_RANGES=not dense, DENSE=dense,
                      EXACT_FP32=False, EVEN_D=True, FOLD_SCALE=True, FP8_AS_FP16=False,
                      APPEND=0 if dense else m.APPEND_MODES[cfg["append"]], T_ALIGN=m._pow2_dividing(n_keys),
                      HEAD_CHAIN=cfg["head_sum"] == "chain",
                      FUSE_SELECT=bool(cfg["fuse_select"]) and cfg["splits"] == 1 and not dense,
                      CAP_P=16 if dense else max(16, triton.next_power_of_2(4 * width)))
    ints = dict(S=S, T=n_keys, H=H, D=D, sqb=S * H * D, sqs=H * D, sqh=D, sqd=1, skb=T * D, skt=D, skd=1,
                swb=S * H, sws=H, swh=1, sksb=0, skst=0, smb=0, sms=T, smt=1, CAP=constexprs["CAP_P"],
                tune_bucket=3, K_OUT=width)
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return m._score_filter_kernel, constexprs, ints, options


PREFILL = (1, 4096, 32768, 2048)
cases = {
    "filter prefill (default)": filter_case(*PREFILL),
    "filter prefill append=store": filter_case(*PREFILL, append="store"),
    "filter prefill head_sum=tree": filter_case(*PREFILL, head_sum="tree"),
    "filter prefill fuse_select": filter_case(*PREFILL, fuse_select=True),
    "filter decode (default)": filter_case(8, 1, 131072, 2048),
    "sample pass": filter_case(*PREFILL, dense=True),
    "select": (m._select_kernel, dict(CAP_P=8192, HAS_RANGES=True, FILL_BLOCK=256), dict(T=32768, K_OUT=2048),
               dict(num_warps=8)),
    "repair": (m._repair_kernel, dict(HP=64, PAD_H=False, DP=128, BLOCK_Q=1, BLOCK_T=64, CHUNK=1024, HAS_KSCALE=False,
                                      MASK_KIND=m.MASK_BOOL, EXACT_FP32=False, EVEN_D=True, FOLD_SCALE=True,
                                      FP8_AS_FP16=False, HEAD_CHAIN=True),
               dict(S=4096, T=32768, H=64, D=128, n_rows=4096, K_OUT=2048, sqb=4096 * 8192, sqs=8192, sqh=128,
                    sqd=1, skb=32768 * 128, skt=128, skd=1, swb=4096 * 64, sws=64, swh=1, sksb=0, skst=0, smb=0,
                    sms=32768, smt=1),
               dict(num_warps=4)),
}
for name, (fn, constexprs, ints, options) in cases.items():
    try:
        compile_sm90(fn, constexprs, ints, options)
        print(json.dumps({"case": name, "ok": True, "triton": triton.__version__}), flush=True)
    except Exception as error:
        chain = []
        while error is not None:
            chain.append(f"{type(error).__name__}: {str(error)[-600:]}")
            error = error.__cause__ or error.__context__
        print(json.dumps({"case": name, "ok": False, "error": chain[-2:], "triton": triton.__version__}),
              flush=True)
"""


def test_default_kernels_compile_for_sm90_offline():
    """The kernels the H200 runs compile for sm_90 with the installed Triton (CPU only: no driver).

    The interpreter accepts constructs the GPU compiler rejects (Triton 3.6 failed on two of them), so
    only a real compile catches those. Check another Triton by putting it first on PYTHONPATH."""
    lines = sm90_offline.run_probe(SM90_COMPILE_SCRIPT, timeout=300)
    failed = {line["case"]: line["error"] for line in lines if not line["ok"]}
    assert len(lines) == 8 and not failed, failed


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_op_matches_reference_at_model_shape(dtype):
    B, S, T, H, D, topk = 1, 256, 4096, 64, 128, 2048
    q, k, w, ks = make_inputs(B, S, T, H, D, dtype=dtype, with_k_scale=dtype == torch.float8_e4m3fn)
    mask = causal_mask(B, S, T).to(DEVICE)
    out = torch.ops.dsfuse.indexer_topk(q, k, w, ks, mask, D ** -0.5, topk)
    assert_exact_topk(out, q, k, w, ks, mask, D ** -0.5, topk)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{"append": "store", "head_sum": "tree"},
                                    {"append": "asm", "block_q": 2, "block_t": 64, "num_warps": 4, "num_stages": 2},
                                    {"fuse_select": True, "block_q": 4, "block_t": 64, "num_warps": 4, "num_stages": 2}])
def test_cuda_filter_variants_match_reference(config):
    """The non-default candidate writers / head sums / tiles / fused select stay exact (the default is
    tested above)."""
    B, S, T, H, D, topk = 1, 256, 4096, 64, 128, 2048
    q, k, w, _ = make_inputs(B, S, T, H, D)
    mask = causal_mask(B, S, T).to(DEVICE)
    out = indexer_topk_triton(q, k, w, None, mask, D ** -0.5, topk, config=config)
    assert_exact_topk(out, q, k, w, None, mask, D ** -0.5, topk)
