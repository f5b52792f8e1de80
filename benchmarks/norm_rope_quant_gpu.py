"""H200 benchmark of `dsfuse.rmsnorm_rope` at T=16384.

1. Bit-exactness on CUDA, as mismatch counts (normed, roped) against HF's own functions
   (`DeepseekV32RMSNorm`, `apply_rotary_pos_emb_interleave` / `apply_rotary_pos_emb`, run by torch's CUDA
   ops) and against the references, for every launch variant; `rope_cat` against HF's split, RoPE and
   `cat` of the main query (interleaved) and the indexer's query (half-split); `rope_cat` with its
   LayerNorm against HF's indexer key path (`k_norm` LayerNorm, split, half-split RoPE, cat), both with
   eager's `layer_norm` kernel and with torch's decomposition of it (what the pass replaces).
2. Timings, medians in µs, two ways: `do_bench` (host launch cost included: what an un-graphed caller
   pays) and `do_bench_cudagraph` (GPU time only), for eager, torch.compile of the reference and each
   launch variant (rows per program x warps), as GB/s beside a copy bandwidth measured in the same run.

3. dsfuse's own model (models/official.py), `rope_quant_fp8`: the indexer's q (64 heads x 128, complex-multiply
   half-split RoPE on 64, fp8 per-128 quantisation) and k (LayerNorm 128 first) against the source functions
   (`apply_rope_half_split`, `quantize_fp8_blockwise`, `DsfuseLayerNorm`'s math) run eagerly on CUDA: fp8
   mismatches (count and worst distance in e4m3 ulps) and scale mismatches (must be 0), for each rounding of the
   complex product the kernel offers, fp8 mismatches split by RoPE lane (which rounding eager CUDA uses in the
   real and in the imaginary lane is what this measures), plus ue8m0 scales.

`CASES=own_indexer_q_quant,own_indexer_k_quant` runs only the named cases (names as in the JSON).
Prints a table last; writes $OUT/norm_rope_quant.json (rewritten after each case). Runs in ~40-55 s."""

import importlib.util
import json
import os
import pathlib
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

try:
    from dsfuse.kernels import norm_rope_quant as nrq
except Exception:  # a bare checkout without `pip install -e .`
    _path = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "norm_rope_quant.py"
    _spec = importlib.util.spec_from_file_location("dsfuse_norm_rope_quant", _path)
    nrq = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(nrq)

try:
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32RMSNorm,
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )
except Exception as exc:  # reported in the JSON; the reference check still runs
    DeepseekV32RMSNorm = None
    HF_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    HF_IMPORT_ERROR = None

RESULTS = {"device": None, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": {},
           "hf_import_error": HF_IMPORT_ERROR}
ROWS = []  # (case, provider, host us, graph us, graph GB/s, fraction of copy bandwidth)
START = time.time()
T = 16384
DEVICE = "cuda"
EPS = 1e-6
HBM_GB_PER_S = 4800  # the H200's HBM3e bandwidth (specification)
BUDGET_S = float(os.environ.get("BUDGET_S", 42))  # cases not started by then are skipped (listed in the JSON)
# launch variants (rows per program, warps); `None` = the launcher's default for the case
KV_VARIANTS = (None, (1, 4), (2, 4), (4, 8), (8, 8), (16, 8))
Q_A_VARIANTS = (None, (1, 4), (4, 8), (8, 8))


def save():
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "norm_rope_quant.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def time_both(fn):
    """(host-inclusive µs, CUDA-graph µs); a failure of one is logged and gives None."""
    times = []
    for timer, kwargs in ((do_bench, {"warmup": 10, "rep": 40}), (do_bench_cudagraph, {"rep": 20})):
        try:
            times.append(timer(fn, return_mode="median", **kwargs) * 1e3)
        except Exception as exc:
            log(f"  {timer.__name__} failed: {type(exc).__name__}: {str(exc)[:200]}")
            times.append(None)
    return times


def copy_bandwidth():
    x = torch.empty(1 << 30, device=DEVICE, dtype=torch.uint8)
    y = torch.empty_like(x)
    host_us, graph_us = time_both(lambda: y.copy_(x))
    us = graph_us or host_us
    gbps = 2 * x.numel() / us / 1e3
    RESULTS["copy_gb_per_s_read_plus_write"] = gbps
    log(f"copy bandwidth {gbps:.0f} GB/s")
    return gbps


def make_case(c_proj, c_norm, c_rope, dtype, tokens=None):
    """x as the [T, c_norm + c_rope] row slice of a [T, c_proj] projection output, HF-form cos/sin."""
    proj = torch.randn(tokens or T, c_proj, device=DEVICE, dtype=dtype)
    x = proj[:, :c_norm + c_rope]
    w = (1 + 0.1 * torch.randn(c_norm, device=DEVICE)).to(dtype)
    if c_rope == 0:
        return x, w, None, None
    return x, w, *rope_tables(c_rope, dtype, tokens)


def rope_tables(c_rope, dtype, tokens=None):
    """HF-form [T, C_rope] cos/sin: fp32 angles, `cat(freqs, freqs)`, cast to the activation dtype."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, c_rope, 2, device=DEVICE, dtype=torch.float32) / c_rope))
    freqs = torch.arange(tokens or T, device=DEVICE, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def hf_outputs(x, w, cos, sin, interleaved):
    """HF's modules/functions on CUDA: the rounding the rewrite must reproduce."""
    c_norm = w.shape[0]
    norm = DeepseekV32RMSNorm(c_norm, EPS).to(device=x.device, dtype=w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        normed = norm(x[:, :c_norm])
        if cos is None:
            return normed, None
        rot = x[:, c_norm:][None, None]  # [B=1, H=1, T, C_rope]
        rope = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
        roped, _ = rope(rot, rot, cos[None], sin[None])
    return normed, roped[0, 0]


def mismatches(got, want):
    """Mismatched element count and max |diff|, per output (None where there is no such output)."""
    out = []
    for g, r in zip(got, want):
        if r is None or g.numel() == 0:
            out.append(None)
            continue
        r = r.contiguous()
        out.append({"count": int((g != r).sum()), "max_abs_diff": float((g.float() - r.float()).abs().max())})
    return out


def variant_label(variant, c_norm, default_rows=None):
    rows = variant[0] if variant else (default_rows or nrq.default_rows(c_norm))
    warps = variant[1] if variant else nrq.default_num_warps(c_norm, rows)
    return f"dsfuse rows={rows} warps={warps}" + (" (default)" if variant is None else "")


def launch_variant(case, name, label, launch):
    """One launch of a kernel variant; a failure (compile error, OOM) is recorded in the case and logged, and
    gives None so the other variants still run."""
    try:
        out = launch()
        torch.cuda.synchronize()
        return out
    except Exception as exc:
        case["variants"][label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        log(f"{name} {label}: failed {case['variants'][label]['error']}")
        return None


def add_compiled(case, name, providers, label, fn, args, check=None, key=None):
    """torch.compile(fn) on `args` as provider `label`, with `check(outputs)` kept as case[key]; a failure to
    compile is logged and leaves the provider out (each call is one more Inductor compile: seconds)."""
    compiled = torch.compile(fn)
    try:
        out = compiled(*args)
        if check is not None:
            case[key] = check(out)
        providers[label] = lambda: compiled(*args)
    except Exception as exc:
        log(f"{name} torch.compile failed: {type(exc).__name__}: {str(exc)[:200]}")


def time_providers(case, name, providers, nbytes, copy_gbps):
    """Host-inclusive and CUDA-graph µs of every provider, its GB/s and fraction of the copy ceiling."""
    for provider, fn in providers.items():
        host_us, graph_us = time_both(fn)
        case["us"][provider] = {"host_inclusive": host_us, "cuda_graph": graph_us}
        gbps = nbytes / graph_us / 1e3 if graph_us else None
        ROWS.append((name, provider, host_us, graph_us, gbps, gbps / copy_gbps if gbps else None))
    save()


def run_case(name, c_proj, c_norm, c_rope, interleaved, copy_gbps, variants, dtype=torch.bfloat16,
             with_compile=True):
    x, w, cos, sin = make_case(c_proj, c_norm, c_rope, dtype)
    args = (x, w, EPS, cos, sin, interleaved, False)
    ref = nrq.rmsnorm_rope_reference(*args)
    hf = hf_outputs(x, w, cos, sin, interleaved) if DeepseekV32RMSNorm is not None else None
    nbytes = nrq.bytes_moved(T, c_norm, c_rope, x.element_size())
    case = {"T": T, "c_norm": c_norm, "c_rope": c_rope, "interleaved": interleaved, "dtype": str(dtype),
            "bytes": nbytes, "reference_vs_hf": mismatches(ref, hf) if hf else None, "variants": {}, "us": {}}
    RESULTS["cases"][name] = case
    providers = {"eager reference": lambda: nrq.rmsnorm_rope_reference(*args)}
    if with_compile:  # each case is one more Inductor compile (seconds)
        add_compiled(case, name, providers, "torch.compile reference", nrq.rmsnorm_rope_reference, args)
    for variant in variants:
        label = variant_label(variant, c_norm)
        kwargs = {"rows_per_program": variant[0], "num_warps": variant[1]} if variant else {}
        out = launch_variant(case, name, label, lambda: nrq.rmsnorm_rope_triton(*args, **kwargs))
        if out is None:
            continue
        check = {"vs_hf": mismatches(out, hf) if hf else None, "vs_reference": mismatches(out, ref)}
        case["variants"][label] = check
        log(f"{name} {label}: mismatches [normed, roped] vs HF {check['vs_hf']}, vs reference {check['vs_reference']}")
        providers[label] = lambda kwargs=kwargs: nrq.rmsnorm_rope_triton(*args, **kwargs)
    time_providers(case, name, providers, nbytes, copy_gbps)


def hf_query(q, cos, sin, c_pass, interleaved):
    """HF's main query (pass part first, interleaved) or the indexer's (rope part first, half-split)."""
    c_rope = cos.shape[-1]
    if interleaved:
        q_pass, q_rot = torch.split(q, [c_pass, c_rope], dim=-1)
        q_rot, _ = apply_rotary_pos_emb_interleave(q_rot, q_rot, cos, sin)
        return torch.cat((q_pass, q_rot), dim=-1)
    q_rot, q_pass = torch.split(q, [c_rope, c_pass], dim=-1)
    q_rot, _ = apply_rotary_pos_emb(q_rot, q_rot, cos, sin)
    return torch.cat([q_rot, q_pass], dim=-1)


def run_rope_cat_case(name, heads, c_pass, c_rope, interleaved, copy_gbps, variants, with_compile=True):
    """`rope_cat` on `q_b_proj`'s output [1, T, heads*(c_pass+c_rope)] viewed as [1, heads, T, D] (strided)."""
    width = c_pass + c_rope
    proj = torch.randn(1, T, heads * width, device=DEVICE, dtype=torch.bfloat16)
    q = proj.view(1, T, heads, width).transpose(1, 2)
    cos, sin = (t[None] for t in rope_tables(c_rope, torch.bfloat16))  # [1, T, C_rope], HF's position_embeddings
    cos4, sin4 = (t.unsqueeze(1).expand(1, heads, T, c_rope) for t in (cos, sin))
    start = c_pass if interleaved else 0
    nbytes = 2 * q.numel() * q.element_size() + 2 * cos.numel() * cos.element_size()
    case = {"T": T, "heads": heads, "c_pass": c_pass, "c_rope": c_rope, "interleaved": interleaved, "bytes": nbytes,
            "variants": {}, "us": {}}
    RESULTS["cases"][name] = case
    want = hf_query(q, cos, sin, c_pass, interleaved) if HF_IMPORT_ERROR is None else None
    providers = {}
    if want is not None:
        providers["eager HF"] = lambda: hf_query(q, cos, sin, c_pass, interleaved)
        if with_compile:
            add_compiled(case, name, providers, "torch.compile HF", hf_query, (q, cos, sin, c_pass, interleaved),
                         lambda out: mismatches([out], [want])[0], "torch.compile_vs_hf")
    for variant in variants:
        label = variant_label(variant, width)
        kwargs = {"rows_per_program": variant[0], "num_warps": variant[1]} if variant else {}
        out = launch_variant(case, name, label,
                             lambda: nrq.rope_cat_triton(q, cos4, sin4, start, interleaved, **kwargs))
        if out is None:
            continue
        ref = nrq.rope_cat_reference(q, cos4, sin4, start, interleaved)
        check = {"vs_hf": [None, mismatches([out], [want])[0]] if want is not None else None,
                 "vs_reference": [None, mismatches([out], [ref])[0]]}
        case["variants"][label] = check
        log(f"{name} {label}: mismatches vs HF {check['vs_hf']}, vs reference {check['vs_reference']}")
        providers[label] = lambda kwargs=kwargs: nrq.rope_cat_triton(q, cos4, sin4, start, interleaved, **kwargs)
    time_providers(case, name, providers, nbytes, copy_gbps)


def hf_key(k, weight, bias, cos, sin, layer_norm=torch.nn.functional.layer_norm):
    """HF `DeepseekV32Indexer`'s key path after `wk`: `k_norm`, unsqueeze, split, half-split RoPE, cat."""
    c_rope = cos.shape[-1]
    k = layer_norm(k, [k.shape[-1]], weight, bias, EPS).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [c_rope, k.shape[-1] - c_rope], dim=-1)
    _, k_rot = apply_rotary_pos_emb(k_rot, k_rot, cos, sin, unsqueeze_dim=2)
    return torch.cat([k_rot, k_pass], dim=-1)


def decomposed_layer_norm(x, shape, weight, bias, eps):
    return torch._refs.native_layer_norm(x, shape, weight, bias, eps)[0]


def run_key_case(name, dim, c_rope, copy_gbps, variants, with_compile=True):
    """The indexer key: `wk`'s output [1, T, dim] -> LayerNorm (weight, bias) + half-split RoPE + cat as one
    `rope_cat`; against HF (eager `layer_norm` kernel and torch's decomposition), the reference, and the
    two launches the pass made before (Inductor-free stand-in: eager `layer_norm` + `rope_cat`)."""
    k = torch.randn(1, T, dim, device=DEVICE, dtype=torch.bfloat16) * 2 + 0.5
    weight = (1 + 0.1 * torch.randn(dim, device=DEVICE)).to(torch.bfloat16)
    bias = (0.1 * torch.randn(dim, device=DEVICE)).to(torch.bfloat16)
    cos, sin = (t[None] for t in rope_tables(c_rope, torch.bfloat16))  # [1, T, C_rope]
    x4, cos4, sin4 = k.unsqueeze(2), cos.unsqueeze(2), sin.unsqueeze(2)
    args = (x4, cos4, sin4, 0, False, weight, bias, EPS)
    nbytes = 2 * k.numel() * k.element_size() + 2 * cos.numel() * cos.element_size() + 2 * dim * 2
    case = {"T": T, "dim": dim, "c_rope": c_rope, "interleaved": False, "layer_norm": True, "bytes": nbytes,
            "variants": {}, "us": {}}
    RESULTS["cases"][name] = case
    ref = nrq.rope_cat_reference(*args)
    want = want_decomposed = None
    providers = {"eager reference": lambda: nrq.rope_cat_reference(*args)}
    if HF_IMPORT_ERROR is None:
        want = hf_key(k, weight, bias, cos, sin)
        want_decomposed = hf_key(k, weight, bias, cos, sin, decomposed_layer_norm)
        case["reference_vs_hf"] = mismatches([ref], [want])[0]
        case["reference_vs_hf_decomposed"] = mismatches([ref], [want_decomposed])[0]
        providers["eager HF"] = lambda: hf_key(k, weight, bias, cos, sin)
        providers["eager layer_norm + dsfuse rope_cat (before)"] = lambda: nrq.rope_cat_triton(
            torch.nn.functional.layer_norm(k, [dim], weight, bias, EPS).unsqueeze(2), cos4, sin4, 0, False)
        if with_compile:
            add_compiled(case, name, providers, "torch.compile HF", hf_key, (k, weight, bias, cos, sin),
                         lambda out: mismatches([out], [want])[0], "torch.compile_vs_hf")
    for variant in variants:
        label = variant_label(variant, dim)
        kwargs = {"rows_per_program": variant[0], "num_warps": variant[1]} if variant else {}
        out = launch_variant(case, name, label, lambda: nrq.rope_cat_triton(*args, **kwargs))
        if out is None:
            continue
        check = {"vs_hf": [None, mismatches([out], [want])[0]] if want is not None else None,
                 "vs_hf_decomposed": mismatches([out], [want_decomposed])[0] if want is not None else None,
                 "vs_reference": [None, mismatches([out], [ref])[0]]}
        case["variants"][label] = check
        log(f"{name} {label}: mismatches vs HF {check['vs_hf']}, vs HF with decomposed LayerNorm "
            f"{check['vs_hf_decomposed']}, vs reference {check['vs_reference']}")
        providers[label] = lambda kwargs=kwargs: nrq.rope_cat_triton(*args, **kwargs)
    time_providers(case, name, providers, nbytes, copy_gbps)


def hf_rmsnorm(x, weight):
    """`DeepseekV32RMSNorm.forward` as a function (compilable without building a module per call)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def hf_layer_first_glue(x_qa, w_qa, x_kv, w_kv, cos, sin, k, ln_w, ln_b, k_cos, k_sin):
    """The glue on a layer's first projections: `q_a_layernorm`, `kv_a_layernorm` + the interleaved RoPE of
    k_rot, and the indexer key's LayerNorm + half-split RoPE + cat."""
    c_norm = w_kv.shape[0]
    rot = x_kv[:, c_norm:][None, None]
    roped, _ = apply_rotary_pos_emb_interleave(rot, rot, cos[None], sin[None])
    return hf_rmsnorm(x_qa, w_qa), hf_rmsnorm(x_kv[:, :c_norm], w_kv), roped[0, 0], hf_key(k, ln_w, ln_b, k_cos, k_sin)


def hf_layer_second_glue(q, cos, sin, iq, i_cos, i_sin):
    """The glue on the second projections: the main query's and the indexer query's RoPE + cat."""
    return (hf_query(q, cos, sin, q.shape[-1] - cos.shape[-1], True),
            hf_query(iq, i_cos, i_sin, iq.shape[-1] - i_cos.shape[-1], False))


def layer_glue_inputs(which, tokens, variant=None):
    """(source arguments, dsfuse launches factory, bytes) of one HF V3.2 layer's first or second glue launch at
    T tokens with the real shapes (q_a 1536, kv 512 + 64, indexer key 128; 128 query heads x 192, 64 indexer
    heads x 128). `variant` ((rows per program, warps) for every member) overrides the launch shape."""
    bf16 = torch.bfloat16
    shape = {"rows_per_program": variant[0], "num_warps": variant[1]} if variant else {}
    if which == "first":
        x_qa, w_qa, _, _ = make_case(1536, 1536, 0, bf16, tokens)
        x_kv, w_kv, cos, sin = make_case(576, 512, 64, bf16, tokens)
        k = torch.randn(1, tokens, 128, device=DEVICE, dtype=bf16) * 2 + 0.5
        ln_w = (1 + 0.1 * torch.randn(128, device=DEVICE)).to(bf16)
        ln_b = (0.1 * torch.randn(128, device=DEVICE)).to(bf16)
        k_cos, k_sin = (t[None] for t in rope_tables(64, bf16, tokens))
        args = (x_qa, w_qa, x_kv, w_kv, cos, sin, k, ln_w, ln_b, k_cos, k_sin)

        def launches():
            return [nrq.rmsnorm_rope_launch(x_qa, w_qa, EPS, None, None, True, False, **shape),
                    nrq.rmsnorm_rope_launch(x_kv, w_kv, EPS, cos, sin, True, False, **shape),
                    nrq.rope_cat_launch(k.unsqueeze(2), k_cos.unsqueeze(2), k_sin.unsqueeze(2), 0, False, ln_w, ln_b,
                                        EPS, **shape)]
        nbytes = (nrq.bytes_moved(tokens, 1536, 0, 2) + nrq.bytes_moved(tokens, 512, 64, 2)
                  + 2 * k.numel() * 2 + 2 * k_cos.numel() * 2 + 2 * 128 * 2)
        return hf_layer_first_glue, args, launches, nbytes
    views = []
    for heads, c_pass in ((128, 128), (64, 64)):
        proj = torch.randn(1, tokens, heads * (c_pass + 64), device=DEVICE, dtype=bf16)
        views.append(proj.view(1, tokens, heads, c_pass + 64).transpose(1, 2))
    cos, sin = (t[None] for t in rope_tables(64, bf16, tokens))
    args = (views[0], cos, sin, views[1], cos, sin)

    def launches():
        return [nrq.rope_cat_launch(views[0], *(t.unsqueeze(1).expand(*views[0].shape[:3], 64) for t in (cos, sin)),
                                    128, True, **shape),
                nrq.rope_cat_launch(views[1], *(t.unsqueeze(1).expand(*views[1].shape[:3], 64) for t in (cos, sin)),
                                    0, False, **shape)]
    nbytes = sum(2 * v.numel() * 2 for v in views) + 2 * 2 * cos.numel() * 2
    return hf_layer_second_glue, args, launches, nbytes


def run_layer_glue_case(name, which, copy_gbps, tokens=None, variants=()):
    """One layer's glue launch as the pass emits it (`norm_rope_group`: the members' blocks in one kernel)
    against the same members launched one by one, HF eager and torch.compile of HF's code. The grouped outputs
    must equal the separate launches' bit for bit; mismatches against HF are counted per output. `variants`:
    more (rows per program, warps) shapes of the one launch, timed only."""
    tokens = tokens or T
    source, args, launches, nbytes = layer_glue_inputs(which, tokens)
    case = {"T": tokens, "which": which, "bytes": nbytes, "variants": {}, "us": {}}
    RESULTS["cases"][name] = case
    grouped = [t for outs in nrq.launch_blocks(launches()) for t in outs if t.numel()]
    separate = [t for launch in launches() for outs in nrq.launch_blocks([launch]) for t in outs if t.numel()]
    torch.cuda.synchronize()
    want = [t.contiguous() for t in source(*args)] if HF_IMPORT_ERROR is None else None
    check = {"vs_separate": mismatches(grouped, separate), "vs_hf": mismatches(grouped, want) if want else None}
    case["variants"]["dsfuse one launch (default)"] = check
    log(f"{name}: mismatches per output, one launch vs separate launches "
        f"{[m['count'] for m in check['vs_separate']]}, vs HF {[m['count'] for m in check['vs_hf'] or []]}")
    providers = {}
    if want is not None:
        providers["eager HF"] = lambda: source(*args)
        add_compiled(case, name, providers, "torch.compile HF", source, args, lambda out: mismatches(list(out), want),
                     "torch.compile_vs_hf")
    providers["dsfuse separate launches"] = lambda: [nrq.launch_blocks([launch]) for launch in launches()]
    providers["dsfuse one launch (default)"] = lambda: nrq.launch_blocks(launches())
    for variant in variants:
        shaped = layer_glue_inputs(which, tokens, variant)[2]
        providers[f"dsfuse one launch rows={variant[0]} warps={variant[1]}"] = lambda shaped=shaped: nrq.launch_blocks(
            shaped())
    time_providers(case, name, providers, nbytes, copy_gbps)


def own_kv_source(proj, weight, freqs):
    """dsfuse's own model's kv side (`DsfuseAttention.forward`): `kv_a_layernorm` (RMSNorm, weight in fp32) and
    the complex-multiply interleaved RoPE of k_pe, with models/official.py's own functions."""
    from dsfuse.models.official import apply_rope_interleaved, rms_norm_official

    c_norm = weight.shape[0]
    kv, k_pe = torch.split(proj, [c_norm, proj.shape[-1] - c_norm], dim=-1)
    return rms_norm_official(kv, weight, EPS), apply_rope_interleaved(k_pe.unsqueeze(2), freqs).squeeze(2)


def run_own_kv_case(name, c_norm, c_rope, copy_gbps):
    """The own kv side as one `rmsnorm_rope` with complex `freqs`, against the source run eagerly on CUDA (the
    fp32 complex product's lane rounding as eager CUDA does it: mismatches must be 0 but for the norm's
    summation order) and torch.compile of it."""
    from dsfuse.models.official import rope_frequencies

    proj = torch.randn(1, T, c_norm + c_rope, device=DEVICE, dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(c_norm, device=DEVICE)).to(torch.bfloat16)
    freqs = rope_frequencies(torch.arange(T, device=DEVICE), c_rope, 10000.0)
    args = (proj.view(T, -1), weight, EPS, None, None, True, True, freqs)
    nbytes = 2 * proj.numel() * 2 + freqs.numel() * 8 + c_norm * 2  # x read and written, complex64 freqs read
    case = {"T": T, "c_norm": c_norm, "c_rope": c_rope, "interleaved": True, "complex": True, "bytes": nbytes,
            "variants": {}, "us": {}}
    RESULTS["cases"][name] = case
    want = [t.reshape(T, -1) for t in own_kv_source(proj, weight, freqs)]
    providers = {"eager source": lambda: own_kv_source(proj, weight, freqs)}
    add_compiled(case, name, providers, "torch.compile source", own_kv_source, (proj, weight, freqs),
                 lambda out: mismatches([t.reshape(T, -1) for t in out], want), "torch.compile_vs_source")
    label = variant_label(None, c_norm)
    out = launch_variant(case, name, label, lambda: nrq.rmsnorm_rope_triton(*args))
    if out is not None:
        case["variants"][label] = {"vs_hf": mismatches(out, want)}
        log(f"{name} {label}: mismatches [normed, roped] vs the source {case['variants'][label]['vs_hf']}")
        providers[label] = lambda: nrq.rmsnorm_rope_triton(*args)
    time_providers(case, name, providers, nbytes, copy_gbps)


def own_indexer_source(x, freqs, c_rope, ln_weight=None, ln_bias=None, scale_fmt=None):
    """`DsfuseIndexer.forward`'s q (x [1, T, H, D]) or k (x [1, T, 1, D], `ln_*` given) up to the fp8 tensors,
    with models/official.py's own functions: what the pass replaces."""
    from dsfuse.models.official import apply_rope_half_split, quantize_fp8_blockwise

    if ln_weight is not None:
        x = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), ln_weight.float(), ln_bias.float(),
                                           EPS).to(x.dtype)
    rot, kept = torch.split(x, [c_rope, x.shape[-1] - c_rope], dim=-1)
    rows = torch.cat([apply_rope_half_split(rot, freqs), kept], dim=-1)
    return quantize_fp8_blockwise(rows, x.shape[-1], scale_fmt)


def signed_code(codes):
    """e4m3 bytes (sign-magnitude) as signed integers in value order: adjacent values differ by 1."""
    return torch.where(codes >= 128, -(codes & 0x7F), codes)


def fp8_mismatches(got, want, c_rope=None):
    """fp8 values: mismatch count and the worst distance in e4m3 ulps (adjacent codes are 1 apart), with
    `c_rope` also per lane of a half-split RoPE at column 0 (real: the first C/2 columns, imaginary: the next
    C/2, pass: the rest); scales: mismatch count and max relative difference."""
    (q, scale), (want_q, want_scale) = got, want
    codes, want_codes = q.view(torch.uint8).int(), want_q.view(torch.uint8).int()
    ulps = (signed_code(codes) - signed_code(want_codes)).abs()
    rel = ((scale - want_scale).abs() / want_scale.abs()).max() if scale.numel() else torch.tensor(0.0)
    found = {"fp8_count": int((codes != want_codes).sum()), "fp8_max_ulps": int(ulps.max()) if ulps.numel() else 0,
             "scale_count": int((scale != want_scale).sum()), "scale_max_rel": float(rel)}
    if c_rope:
        differs = (codes != want_codes).reshape(-1, codes.shape[-1]).sum(0)
        half = c_rope // 2
        found["fp8_by_lane"] = {"real": int(differs[:half].sum()), "imag": int(differs[half:c_rope].sum()),
                                "pass": int(differs[c_rope:].sum())}
    return found


def complex_lanes_vs_eager(x, freqs, c_rope):
    """Per lane of the half-split complex product, how many fp32 results of each `LANE_ROUNDINGS` formula differ
    from eager CUDA's own `view_as_complex(x) * freqs` (the source's kernel, same shapes): the rounding eager
    uses shows 0. An fp64 sum of exact fp32 products stands for an FMA (double rounding: ~never differs)."""
    half = c_rope // 2
    rot = x[..., :c_rope].float()
    a, b = rot[..., :half], rot[..., half:c_rope]
    eager = torch.view_as_real(torch.view_as_complex(torch.stack([a, b], -1).contiguous()) * freqs[None, :, None, :])
    c, s = freqs.real[None, :, None, :], freqs.imag[None, :, None, :]
    d = torch.Tensor.double
    lanes = {
        "real": {"rounded": a * c - b * s, "fma_first": (d(a) * d(c) - d(b * s)).float(),
                 "fma_second": (d(a * c) - d(b) * d(s)).float()},
        "imag": {"rounded": a * s + b * c, "fma_first": (d(a) * d(s) + d(b * c)).float(),
                 "fma_second": (d(a * s) + d(b) * d(c)).float()},
    }
    return {lane: {mode: int((value != eager[..., index]).sum()) for mode, value in modes.items()}
            for index, (lane, modes) in enumerate(lanes.items())}


def run_own_quant_case(name, heads, dim, c_rope, layer_norm, copy_gbps, variants, with_compile=True):
    """`rope_quant_fp8` on the own model's indexer q (`wq_b` output viewed per head) or k (`wk` output,
    LayerNorm'd): eager source, torch.compile of the source, and the fused op (each complex rounding at the
    default launch, then launch variants with the shipped rounding)."""
    from dsfuse.models.official import rope_frequencies

    x = (torch.randn(1, T, heads * dim, device=DEVICE) * 2 + (0.5 if layer_norm else 0)).to(torch.bfloat16)
    x = x.view(1, T, heads, dim)
    freqs = rope_frequencies(torch.arange(T, device=DEVICE), c_rope, 10000.0)  # [T, C/2] complex64
    freqs4 = freqs[None, :, None, :]
    ln = ()
    if layer_norm:  # DsfuseLayerNorm's parameters (bf16 in a bf16 model), read as fp32 by the graph
        ln = ((1 + 0.1 * torch.randn(dim, device=DEVICE)).to(torch.bfloat16),
              (0.1 * torch.randn(dim, device=DEVICE)).to(torch.bfloat16))
    ln_args = () if not ln else (ln[0].float(), ln[1].float(), EPS)
    nbytes = x.numel() * 3 + T * heads * 4 + freqs.numel() * 8
    case = {"T": T, "heads": heads, "dim": dim, "c_rope": c_rope, "layer_norm": layer_norm, "interleaved": False,
            "bytes": nbytes, "variants": {}, "us": {}, "shipped_complex_mul": list(nrq.CUDA_COMPLEX_MUL)}
    RESULTS["cases"][name] = case
    want = own_indexer_source(x, freqs, c_rope, *ln)
    want_ue8m0 = own_indexer_source(x, freqs, c_rope, *ln, scale_fmt="ue8m0")
    case["complex_lanes_vs_eager"] = complex_lanes_vs_eager(x, freqs, c_rope)
    log(f"{name} complex product, formula mismatches vs eager CUDA per lane: {case['complex_lanes_vs_eager']}")
    case["reference_vs_source"] = fp8_mismatches(
        nrq.rope_quant_fp8_reference(x, freqs4, 0, False, dim, False, *ln_args), want)
    providers = {"eager source": lambda: own_indexer_source(x, freqs, c_rope, *ln)}
    if with_compile:
        add_compiled(case, name, providers, "torch.compile source", own_indexer_source, (x, freqs, c_rope, *ln),
                     lambda out: fp8_mismatches(out, want), "torch.compile_vs_source")
    shipped = tuple(nrq.CUDA_COMPLEX_MUL)
    roundings = [(m, m) for m in nrq.LANE_ROUNDINGS if (m, m) != shipped] + [shipped]
    launches = [(None, rounding) for rounding in roundings] + [(v, None) for v in variants if v]
    for variant, rounding in launches:
        n_rows = x.shape[0] * x.shape[1] * x.shape[2]
        label = (variant_label(variant, dim, nrq.rope_quant_default_rows(n_rows, dim))
                 + (f" {'/'.join(rounding)}" if rounding else ""))
        kwargs = {"rows_per_program": variant[0], "num_warps": variant[1]} if variant else {}
        kwargs["complex_mul"] = rounding
        out = launch_variant(case, name, label,
                             lambda: nrq.rope_quant_fp8_triton(x, freqs4, 0, False, dim, False, *ln_args, **kwargs))
        if out is None:
            continue
        check = {"vs_source": fp8_mismatches(out, want, c_rope)}
        if variant is None and rounding == shipped:
            check["ue8m0_vs_source"] = fp8_mismatches(
                nrq.rope_quant_fp8_triton(x, freqs4, 0, False, dim, True, *ln_args, **kwargs), want_ue8m0)
        case["variants"][label] = check
        log(f"{name} {label}: {check}")
        if rounding in (None, shipped):
            providers[label] = lambda kwargs=kwargs: nrq.rope_quant_fp8_triton(x, freqs4, 0, False, dim, False,
                                                                               *ln_args, **kwargs)
    time_providers(case, name, providers, nbytes, copy_gbps)


def fmt(v, spec):
    return format(v, spec) if v is not None else "-"


def main():
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    copy_gbps = copy_bandwidth()
    save()
    cases = [
        # q side: q_a_layernorm over q_a_proj's 1536 outputs (no rope)
        ("q_a_norm_1536", lambda: run_case("q_a_norm_1536", 1536, 1536, 0, True, copy_gbps, Q_A_VARIANTS)),
        # kv side: kv_a_layernorm over the first 512 of kv_a_proj_with_mqa's 576 outputs + interleaved rope on 64
        ("kv_norm512_rope64_interleaved", lambda: run_case("kv_norm512_rope64_interleaved", 576, 512, 64, True,
                                                           copy_gbps, KV_VARIANTS)),
        # main query: 16 heads (one tensor-parallel shard of 128) x (128 pass + 64 interleaved rope), rope + cat
        ("q_rope_cat_16x192_interleaved", lambda: run_rope_cat_case("q_rope_cat_16x192_interleaved", 16, 128, 64,
                                                                    True, copy_gbps, (None, (16, 4), (32, 8)))),
        # indexer key: LayerNorm over wk's 128 outputs + half-split rope on the first 64, one rope_cat
        ("indexer_k_layernorm128_rope64_half_split", lambda: run_key_case(
            "indexer_k_layernorm128_rope64_half_split", 128, 64, copy_gbps, (None, (16, 4), (32, 8)))),
        # the kv slice with half-split rope, to show the form costs the same
        ("kv_norm512_rope64_half_split", lambda: run_case("kv_norm512_rope64_half_split", 576, 512, 64, False,
                                                          copy_gbps, (None,), with_compile=False)),
        # indexer query: 16 heads x (64 half-split rope + 64 pass), rope first
        ("indexer_q_rope_cat_16x128_half_split", lambda: run_rope_cat_case(
            "indexer_q_rope_cat_16x128_half_split", 16, 64, 64, False, copy_gbps, (None,), with_compile=False)),
        # dsfuse's own model, indexer q: 64 heads x 128, complex half-split rope 64 + fp8 per-128 quantisation
        ("own_indexer_q_quant", lambda: run_own_quant_case("own_indexer_q_quant", 64, 128, 64, False, copy_gbps,
                                                           (None, (16, 4), (32, 8)))),
        # one HF layer's glue as the pass launches it (issue #6's whole site: q_a + kv + indexer key in one launch)
        ("hf_layer_first_glue", lambda: run_layer_glue_case("hf_layer_first_glue", "first", copy_gbps)),
        ("hf_layer_second_glue", lambda: run_layer_glue_case("hf_layer_second_glue", "second", copy_gbps,
                                                             variants=((8, 4), (32, 8), (16, 8)))),
        # the same launches for a short prompt (1024 tokens), where launch count and tails weigh more
        ("hf_layer_first_glue_t1024", lambda: run_layer_glue_case("hf_layer_first_glue_t1024", "first", copy_gbps,
                                                                  tokens=1024)),
        ("hf_layer_second_glue_t1024", lambda: run_layer_glue_case("hf_layer_second_glue_t1024", "second",
                                                                   copy_gbps, tokens=1024)),
        # dsfuse's own model, kv side: RMSNorm 512 (weight in fp32) + complex-multiply interleaved RoPE 64
        ("own_kv_norm512_complex_rope64", lambda: run_own_kv_case("own_kv_norm512_complex_rope64", 512, 64,
                                                                  copy_gbps)),
        # its k: LayerNorm 128 + the same rope + quantisation
        ("own_indexer_k_quant", lambda: run_own_quant_case("own_indexer_k_quant", 1, 128, 64, True, copy_gbps,
                                                           (None, (32, 8)))),
    ]
    wanted = [c.strip() for c in os.environ.get("CASES", "").split(",") if c.strip()]
    unknown = sorted(set(wanted) - {n for n, _ in cases})
    if unknown:
        raise SystemExit(f"unknown CASES {unknown}; valid: {', '.join(n for n, _ in cases)}")
    RESULTS["skipped_for_time"] = []
    for index, (case_name, case) in enumerate(cases):
        if wanted and case_name not in wanted:
            continue
        if time.time() - START > BUDGET_S:
            RESULTS["skipped_for_time"].append(case_name)
            log(f"case {index} ({case_name}) skipped: past the {BUDGET_S} s budget")
            continue
        try:
            case()
        except Exception as exc:  # one case's failure (OOM, compile error) must not lose the others
            RESULTS["cases"].setdefault(case_name, {})["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"case {case_name} failed: {RESULTS['cases'][case_name]['error']}")
            save()
    print(f"\n{'case':38s} {'provider':32s} {'host us':>8s} {'graph us':>8s} {'GB/s':>6s} {'of copy':>7s}")
    for name, provider, host_us, graph_us, gbps, frac in ROWS:
        print(f"{name:38s} {provider:32s} {fmt(host_us, '8.1f')} {fmt(graph_us, '8.1f')} {fmt(gbps, '6.0f')} "
              f"{fmt(frac, '7.2f')}")
    print("\nbit-exactness (mismatched elements [normed, roped] vs HF):")
    for name, case in RESULTS["cases"].items():
        for label, check in case.get("variants", {}).items():
            if "vs_source" in check:  # rope_quant_fp8: [fp8 mismatches, worst e4m3 ulps, scale mismatches]
                source = check["vs_source"]
                print(f"  {name:38s} {label:32s} vs source {[source[k] for k in FP8_KEYS]} by lane "
                      f"{source.get('fp8_by_lane')}")
                continue
            counts = [c["count"] if c else None for c in check.get("vs_hf") or []] or check.get("error")
            if counts and not isinstance(counts, str) and counts[0] is None and case.get("c_norm") is None:
                counts = counts[1:]  # rope_cat: one output
            print(f"  {name:38s} {label:32s} {counts}")
    print_summary()
    RESULTS["elapsed_s"] = time.time() - START
    save()
    log("done")


FP8_KEYS = ("fp8_count", "fp8_max_ulps", "scale_count")


def print_summary():
    """One line per case (the session shows only the last lines): worst HF mismatch counts over the
    variants, best dsfuse CUDA-graph time and variant, torch.compile's, the speedup and the copy fraction."""
    print("\nsummary (CUDA-graph us; mismatches = max over variants [normed, roped] vs HF; own_indexer_*: [fp8 "
          "mismatches, worst e4m3 ulps, scale mismatches] vs the source, shipped complex rounding):")
    for name, case in RESULTS["cases"].items():
        worst = None
        for label, check in case.get("variants", {}).items():
            if "vs_source" in check:  # the shipped rounding's launches only
                if "/" in label and not label.endswith("/".join(nrq.CUDA_COMPLEX_MUL)):
                    continue
                counts = [check["vs_source"][k] for k in FP8_KEYS]
            else:
                counts = [c["count"] if c else 0 for c in check.get("vs_hf") or []]
            worst = counts if worst is None else [max(a, b) for a, b in zip(worst, counts)]
        graph = {p: t["cuda_graph"] for p, t in case.get("us", {}).items() if t["cuda_graph"]}
        ours = {p: t for p, t in graph.items() if p.startswith("dsfuse")}
        best = min(ours, key=ours.get) if ours else None
        compiled = next((t for p, t in graph.items() if p.startswith("torch.compile")), None)
        speedup = compiled / ours[best] if best and compiled else None
        frac = case["bytes"] / ours[best] / 1e3 / RESULTS["copy_gb_per_s_read_plus_write"] if best else None
        hbm = case["bytes"] / ours[best] / 1e3 / HBM_GB_PER_S if best else None
        print(f"  {name:38s} mism {worst} best {fmt(ours.get(best), '.1f')} ({best}) compile {fmt(compiled, '.1f')} "
              f"x{fmt(speedup, '.2f')} copy-frac {fmt(frac, '.2f')} of-4.8TB/s {fmt(hbm, '.2f')}")
        if "complex_lanes_vs_eager" in case:  # the rounding CUDA_COMPLEX_MUL should name: 0 mismatches
            lanes = case["complex_lanes_vs_eager"]
            print(f"  {'':38s} complex product vs eager: real {lanes['real']} imag {lanes['imag']} "
                  f"(shipped {'/'.join(nrq.CUDA_COMPLEX_MUL)})")


if __name__ == "__main__":
    main()
