"""H200 benchmark of `dsfuse::compressed_attention` (DeepSeek V4 sink attention over a sliding window plus
compressed entries) at V4-Flash shapes: H=64, D=512, one shared K=V head, window 128, CSA (rate 4, top-512) and
HCA (rate 128) layers, the inverse RoPE epilogue on the trailing 64 dims.

Sections, in priority order (the JSON is rewritten after each, so a run cut short still reports what it measured):
the bf16 matmul ceiling; agreement of the fused op with the reference (HF's math, eager on the GPU) and, as the
noise floor of "another summation order", of the reference under Inductor with the eager reference; a launch
sweep at S=8192; do_bench medians of the fused op at every S, of HF's eager attention (the reference's math with
HF's additive masks built from positions and indices, as the model builds them) eagerly and under
`torch.compile`. TFLOP/s count the work asked for: 2 * H * D * 2 flops per visible (query, key) pair.
Prints a table last; writes $OUT/compressed_attention.json.  Environment: SEQS (fused op lengths, default
"4096 8192 16384 32768 65536"), HF_SEQS (default "4096 8192"), COMPILE_SEQS (default "4096 8192 16384"),
AGREE_SEQS (default "4096 8192"), SWEEP (0 skips).

`python benchmarks/compressed_attention_gpu.py split` runs only the sweep of the two CUDA paths (the fused kernel
and the split scores / p.v kernels) at S=8192, CSA and HCA, 12 launch configs a layer, then each layer's fastest
at S=4096, 16384 and 32768; writes $OUT/compressed_attention_split.json.  SPLIT_BUDGET_S (default 170) stops
the S=8192 sweep early (half of it for each layer), so the whole run stays under 4 minutes with compiles.

`python benchmarks/compressed_attention_gpu.py gluon` compares the split path's Triton and Gluon scores kernels
(see `gluon_main`); writes $OUT/compressed_attention_gluon.json.
"""

import json
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from dsfuse.bench import profile_stages
from dsfuse.kernels import compressed_attention as ca

H, D, WINDOW, ROPE = 64, 512, 128, 32
LAYERS = {"csa": {"rate": 4, "topk": 512}, "hca": {"rate": 128, "topk": 0}}
RESULTS = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": None, "commit":
           os.environ.get("DSFUSE_COMMIT"), "shapes": {"H": H, "D": D, "window": WINDOW, "rope_dims": 2 * ROPE},
           "ceilings": {}, "agreement": {}, "sweep": {}, "timings": {}}
ROWS = []
START = time.time()
SAVE_AS = "compressed_attention.json"


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def save():
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, SAVE_AS), "w") as f:
            json.dump(RESULTS, f, indent=1)


def bench(fn, rep=100):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def seqs(name, default):
    return [int(s) for s in os.environ.get(name, default).split()]


def make_inputs(S, layer, seed=0):
    """Random bf16 activations, prompt positions, real RoPE angles and top-k-like picks: for query s, the
    min(512, (s + 1) // 4) visible entries of a random top-k, the rest -1 (HF's indexer)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rate, topk = LAYERS[layer]["rate"], LAYERS[layer]["topk"]
    T = S // rate
    q = torch.randn(1, S, H, D, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(1, S, D, device="cuda", generator=g).to(torch.bfloat16)
    compressed = torch.randn(1, T, D, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.arange(S, device="cuda").view(1, S)
    sinks = torch.randn(H, device="cuda", generator=g)
    inv_freq = 10000.0 ** (-torch.arange(ROPE, device="cuda").float() / ROPE)
    angle = pos.float().unsqueeze(-1) * inv_freq
    cos, sin = angle.cos(), angle.sin()
    indices = None
    if topk:
        k = min(topk, T)
        visible = (pos.view(S, 1) + 1) // rate
        chunks = []
        for lo in range(0, S, 4096):
            scores = torch.rand(min(4096, S - lo), T, device="cuda", generator=g)
            entry = torch.arange(T, device="cuda").view(1, T)
            scores = scores.masked_fill(entry >= visible[lo:lo + 4096], float("-inf"))
            top = scores.topk(k, dim=-1).indices
            chunks.append(torch.where(top >= visible[lo:lo + 4096], -1, top))
        indices = torch.cat(chunks).view(1, S, k)
    scale = D ** -0.5
    return (q, kv, pos, pos.clone(), compressed, indices, sinks, scale, WINDOW, rate, cos, sin)


def work_flops(args):
    """4 * H * D per visible (query, key) pair: q.k and p.v."""
    q, kv, pos, kv_pos, compressed, indices, sinks, scale, window, rate, cos, sin = args
    s = pos[0].long()
    window_pairs = torch.clamp(s + 1, max=window).sum().item()
    if indices is not None:
        entry_pairs = (indices >= 0).sum().item()
    else:
        entry_pairs = torch.clamp((s + 1) // rate, max=compressed.shape[1]).sum().item()
    return 4 * H * D * (window_pairs + entry_pairs)


def hf_attention(q, kv, q_pos, kv_pos, compressed, indices, sinks, scale, window, rate, cos, sin):
    """What HF V4 computes: sliding-window additive mask plus the compressed block bias (scatter of the picks, or
    the causal entry limit), eager_attention_forward's sink softmax over every key, then the inverse RoPE."""
    B, S, Hq, Dq = q.shape
    T = compressed.shape[1]
    delta = q_pos.unsqueeze(-1) - kv_pos.unsqueeze(1)
    seen = (kv_pos.unsqueeze(1) >= 0) & (delta >= 0) & (delta < window)
    bias = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(~seen, torch.finfo(q.dtype).min)
    if indices is None:
        future = torch.arange(T, device=q.device).view(1, 1, T) >= ((q_pos + 1) // rate).unsqueeze(-1)
        block = torch.zeros(B, S, T, device=q.device).masked_fill(future, float("-inf"))
    else:
        block = torch.full((B, S, T + 1), float("-inf"), device=q.device)
        block = block.scatter(-1, torch.where(indices >= 0, indices, T), 0.0)[..., :T]
    bias = torch.cat([bias, block.to(q.dtype)], dim=-1).unsqueeze(1)
    keys = torch.cat([kv, compressed], dim=1).unsqueeze(1)
    weights = torch.matmul(q.transpose(1, 2), keys.transpose(2, 3)) * scale + bias
    combined = torch.cat([weights, sinks.view(1, -1, 1, 1).expand(B, -1, S, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(q.dtype)
    out = torch.matmul(probs, keys).transpose(1, 2).contiguous()
    return ca.inverse_rope_reference(out, cos, sin)


def agreement(got, want):
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    return {"bit_equal_fraction": (got == want).float().mean().item(), "max_abs_diff": diff.max().item(),
            "max_abs_ref": want.abs().max().item(),
            "rel_l2": (diff.norm() / want.norm().clamp_min(1e-30)).item(),
            "elements_over_1e-2": int((diff > 1e-2).sum().item()), "nan": bool(torch.isnan(got).any().item())}


FALLBACK = {}  # launch options that replace the default, if the default does not compile here


def dsfuse_op(args, **cfg):
    return ca.compressed_attention_triton(*args, **{**FALLBACK, **cfg})


def probe_default():
    """Compile the default launch on a small case of each layer; fall back to the position-checking window tile
    (the run-1 kernel) if this Triton cannot compile it, so the run still measures."""
    for layer in LAYERS:
        try:
            dsfuse_op(make_inputs(512, layer))
        except Exception as e:
            FALLBACK["check_positions"] = True
            RESULTS["fallback"] = {"options": dict(FALLBACK), "error": repr(e)[-300:]}
            log(f"default launch failed to compile ({e!r:.120}); timing with {FALLBACK}")
            return


def compiled_kernels(kernel=ca._compressed_attention_kernel):
    """Registers, spills and shared memory of every compiled variant of a kernel, by cache key."""
    found = {}
    for entry in getattr(kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for key, kernel in dict(cache).items():
            try:
                kernel._init_handles()
            except Exception:
                pass
            found[str(key)] = {"regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                               "shared": getattr(kernel.metadata, "shared", None)}
    return found


@triton.jit
def _l2_read_kernel(x_ptr, out_ptr, rows, TILES: tl.constexpr, BLOCK_R: tl.constexpr, COLS: tl.constexpr):
    """Each program sums TILES tiles of [BLOCK_R, COLS] rows of an L2-resident buffer: L2 -> SM read rate."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK_R, COLS], tl.float32)
    offs_c = tl.arange(0, COLS)
    for i in range(TILES):
        r = ((pid * 7 + i) * BLOCK_R) % rows + tl.arange(0, BLOCK_R)
        acc += tl.load(x_ptr + r[:, None].to(tl.int64) * COLS + offs_c[None, :]).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def l2_read_rate():
    rows, cols, block_r, tiles = 8192, 512, 64, 64
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    programs = 132 * 8
    out = torch.empty(programs, device="cuda")
    ms = bench(lambda: _l2_read_kernel[(programs,)](x, out, rows, TILES=tiles, BLOCK_R=block_r, COLS=cols,
                                                     num_warps=8))
    return programs * tiles * block_r * cols * 2 / ms / 1e9


# the split path's sweep: kernel 1 (scores) first with kernel 2 at its default, then kernel 2 (p.v) with kernel
# 1 at the best of those, then the normaliser's place and the fast exp at the best pair: 12 configs a layer, the
# likeliest first (SPLIT_BUDGET_S cuts the tail)
# (the Triton scores kernel's launches: named, since on Hopper the split path's default scores kernel is Gluon's)
SCORES_CONFIGS = {name: dict(cfg, scores_kernel="triton") for name, cfg in {
    "n32_w4_s1": dict(block_n=32, num_warps=4, num_stages=1),  # 2 programs / SM (96 KiB, 255 regs)
    "n32_w8_s1_r128": dict(block_n=32, num_warps=8, num_stages=1, scores_maxnreg=128),  # 2 / SM
    "n64_w8_s2": dict(block_n=64, num_warps=8, num_stages=2),  # the fused kernel's tiles
    "n32_w8_s2": dict(block_n=32, num_warps=8, num_stages=2),
    "n64_w4_s2": dict(block_n=64, num_warps=4, num_stages=2)}.items()}
VALUES_CONFIGS = {"d256_w8_s2": dict(d_chunk=256, pv_num_warps=8, pv_num_stages=2),
                  "d128_w4_s3": dict(d_chunk=128, pv_num_warps=4, pv_num_stages=3),
                  "d128_w8_s2": dict(d_chunk=128, pv_num_warps=8, pv_num_stages=2),
                  "d256_w4_s2": dict(d_chunk=256, pv_num_warps=4, pv_num_stages=2)}
VALUES_DEFAULT = dict(d_chunk=128, pv_num_warps=4, pv_num_stages=2)


def split_sweep():
    """Both paths at S=8192 (ms, TFLOP/s on the work asked, bit-equality with the reference and with the fused
    default), then each layer's fastest config against the fused default at the other lengths."""
    budget = float(os.environ.get("SPLIT_BUDGET_S", "170"))
    split = RESULTS.setdefault("split", {})
    best = {}
    for number, layer in enumerate(LAYERS):
        layer_deadline = START + budget * (number + 1) / len(LAYERS)  # each layer gets its share
        args = make_inputs(8192, layer)
        flops = work_flops(args)
        want = ca.compressed_attention_reference(*args)
        torch.cuda.empty_cache()
        baseline = dsfuse_op(args, path="fused")
        timed = {}

        def measure(name, cfg):
            key = f"{layer}_{name}"
            if name != "fused_default" and time.time() > layer_deadline:
                split[key] = {"skipped": "over this layer's share of SPLIT_BUDGET_S", **cfg}
                log(f"split sweep {layer} {name}: skipped (over this layer's share of {budget:.0f} s)")
                return
            try:
                got = dsfuse_op(args, **cfg)
                ms = bench(lambda: dsfuse_op(args, **cfg))
            except Exception as e:  # out of shared memory, or a compile this Triton cannot do
                split[key] = {"error": repr(e)[:300], **cfg}
                log(f"split sweep {layer} {name}: {e!r:.200}")
                return
            agree = agreement(got, want)
            split[key] = {"ms": ms, "tflops": flops / ms / 1e9, "bit_equal_ref": agree["bit_equal_fraction"],
                          "max_abs_diff_ref": agree["max_abs_diff"], "equal_to_fused": bool(torch.equal(got, baseline)),
                          "equal_to_fused_fraction": (got == baseline).float().mean().item(), **cfg}
            timed[name] = (ms, cfg)
            log(f"split sweep {layer} S=8192 {name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s, bit-equal to ref "
                f"{agree['bit_equal_fraction']:.5f} (max {agree['max_abs_diff']:.3g}), same bits as fused "
                f"{split[key]['equal_to_fused']} ({split[key]['equal_to_fused_fraction']:.5f})")
            save()

        measure("fused_default", {"path": "fused"})
        for name, cfg in SCORES_CONFIGS.items():
            measure(f"split_{name}_d128_w4_s2", {"path": "split", **cfg, **VALUES_DEFAULT})
        splits = {k: v for k, v in timed.items() if k.startswith("split_")}
        if not splits:
            continue
        scores_cfg = {k: v for k, v in min(splits.values(), key=lambda t: t[0])[1].items()
                      if k not in VALUES_DEFAULT}
        scores_name = next(n for n, c in SCORES_CONFIGS.items() if {"path": "split", **c} == scores_cfg)
        for name, cfg in VALUES_CONFIGS.items():
            measure(f"split_{scores_name}_{name}", {**scores_cfg, **cfg})
        splits = {k: v for k, v in timed.items() if k.startswith("split_")}
        top_name, (top_ms, top_cfg) = min(splits.items(), key=lambda kv: kv[1][0])
        measure(f"{top_name}_normalize_in_pv", {**top_cfg, "normalize": "values"})
        measure(f"{top_name}_fast_exp", {**top_cfg, "accurate_exp": False})
        exact = {k: v for k, v in timed.items() if k.startswith("split_") and not k.endswith("_fast_exp")}
        best[layer] = min(exact.items(), key=lambda kv: kv[1][0])
        log(f"split sweep {layer}: fastest split with the default roundings {best[layer][0]}: "
            f"{best[layer][1][0]:.3f} ms")
        del args, want, baseline
        torch.cuda.empty_cache()
    split["kernels"] = {"scores": compiled_kernels(ca._attention_scores_kernel),
                        "values": compiled_kernels(ca._attention_values_kernel)}
    for kind, found in split["kernels"].items():
        for key, res in found.items():
            log(f"compiled {kind} kernel: {res}")
    save()

    for S in (4096, 16384, 32768):
        for layer, (name, (_, cfg)) in best.items():
            args = make_inputs(S, layer)
            flops = work_flops(args)
            row = {"best_split": name, "work_tflop": flops / 1e12}
            baseline = dsfuse_op(args, path="fused")
            got = dsfuse_op(args, **cfg)
            row["equal_to_fused_fraction"] = (got == baseline).float().mean().item()
            for provider, launch in (("fused_default", {"path": "fused"}), ("split_best", cfg)):
                ms = bench(lambda: dsfuse_op(args, **launch))
                row[provider] = {"ms": ms, "tflops": flops / ms / 1e9}
                ROWS.append((f"{layer} S={S}", provider, ms, flops / ms / 1e9))
                log(f"{layer} S={S} {provider}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
            split[f"{layer}_S{S}"] = row
            del args, baseline, got
            torch.cuda.empty_cache()
            save()


def matmul_ceiling():
    """The device's name and its bf16 matmul rate (8192^3), recorded: the ceiling the attention rates sit beside."""
    RESULTS["device"] = torch.cuda.get_device_name()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192 ** 3 / bench(lambda: a @ b) / 1e9
    RESULTS["ceilings"]["bf16_matmul_tflops"] = peak
    log(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s")
    return peak


def split_main():
    peak = matmul_ceiling()
    split_sweep()
    print(f"\nbf16 matmul ceiling {peak:.0f} TFLOP/s")
    print(f"{'case':<14} {'config':<44} {'ms':>8} {'TFLOP/s':>8} {'ref bits':>9} {'=fused':>7}")
    for key, res in RESULTS["split"].items():
        if "ms" in res and "bit_equal_ref" in res:
            layer, name = key.split("_", 1)
            print(f"{layer + ' S=8192':<14} {name:<44} {res['ms']:8.3f} {res['tflops']:8.0f} "
                  f"{res['bit_equal_ref']:9.5f} {str(res['equal_to_fused']):>7}")
    for case, name, ms, tf in ROWS:
        print(f"{case:<14} {name:<44} {ms:8.3f} {tf:8.0f}")


# the Gluon scores kernel's sweep (the values kernel follows the tile width): keys a tile, pipeline stages, where
# the probabilities are normalised (their own kernel, the default; the scores kernel; the values kernel), and the
# fast exp (different roundings: how much of the time the exact exp and division take)
GLUON_CONFIGS = {
    "n32_s3": {"block_n": 32, "scores_stages": 3},
    "n32_s2": {"block_n": 32, "scores_stages": 2},
    "n16_s4": {"block_n": 16, "scores_stages": 4},
    "n32_s3_scores_normalize": {"block_n": 32, "scores_stages": 3, "normalize": "scores"},
    "n32_s3_values_normalize": {"block_n": 32, "scores_stages": 3, "normalize": "values"},
    "n32_s3_fast_exp": {"block_n": 32, "scores_stages": 3, "accurate_exp": False},
}


def gluon_main():
    """The split path with the Triton and the Gluon scores kernels side by side at S=8192 (CSA, HCA), bit-equality
    between them at equal tile width, agreement with the reference, per-kernel GPU times of the defaults and the
    fastest Gluon launch, then the fastest at S=4096, 16384 and 32768."""
    peak = matmul_ceiling()
    gl = RESULTS.setdefault("gluon", {})
    best = {}
    for layer in LAYERS:
        args = make_inputs(8192, layer)
        flops = work_flops(args)
        want = ca.compressed_attention_reference(*args)
        triton_outs = {}
        for block_n in sorted({c["block_n"] for c in GLUON_CONFIGS.values()}):
            cfg = {"path": "split", "scores_kernel": "triton", "block_n": block_n}
            triton_outs[block_n] = dsfuse_op(args, **cfg)
            ms = bench(lambda: dsfuse_op(args, **cfg))
            gl[f"{layer}_triton_n{block_n}"] = {"ms": ms, "tflops": flops / ms / 1e9, **agreement(
                triton_outs[block_n], want)}
            log(f"{layer} S=8192 triton scores n{block_n}: {ms:.3f} ms")
        for name, launch in GLUON_CONFIGS.items():
            cfg = {"path": "split", "scores_kernel": "gluon", **launch}
            block_n = launch["block_n"]
            key = f"{layer}_gluon_{name}"
            try:
                out = dsfuse_op(args, **cfg)
                ms = bench(lambda: dsfuse_op(args, **cfg))
            except Exception as e:
                gl[key] = {"error": repr(e)[-400:]}
                log(f"{key}: {e!r:.300}")
                continue
            gl[key] = {"ms": ms, "tflops": flops / ms / 1e9, "equal_to_triton": bool(torch.equal(
                out, triton_outs[block_n])), **agreement(out, want)}
            log(f"{key}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, = triton {gl[key]['equal_to_triton']}, "
                f"ref bits {gl[key]['bit_equal_fraction']:.5f}")
            if gl[key]["equal_to_triton"] and launch.get("accurate_exp", True) and (
                    layer not in best or ms < best[layer][1]):
                best[layer] = (cfg, ms)
        save()
        triton_split = {"path": "split", "scores_kernel": "triton"}
        gl[f"{layer}_kernels_triton_default"] = dict(profile_stages(lambda: dsfuse_op(args, **triton_split))[
            "top_kernels_ms"])
        if layer in best:
            gl[f"{layer}_kernels_gluon_best"] = dict(profile_stages(lambda: dsfuse_op(args, **best[layer][0]))[
                "top_kernels_ms"])
            gl[f"{layer}_gluon_best"] = best[layer][0]
        for name in (f"{layer}_kernels_triton_default", f"{layer}_kernels_gluon_best"):
            for kernel, ms in gl.get(name, {}).items():
                log(f"{name}: {kernel[:60]} {ms:.3f} ms")
        del args, want, triton_outs
        save()
    for S in (4096, 16384, 32768):
        for layer, (cfg, _) in best.items():
            args = make_inputs(S, layer)
            flops = work_flops(args)
            for name, launch in (("triton_default", {"path": "split", "scores_kernel": "triton"}), ("gluon_best", cfg)):
                ms = bench(lambda: dsfuse_op(args, **launch))
                gl[f"{layer}_S{S}_{name}"] = {"ms": ms, "tflops": flops / ms / 1e9}
                ROWS.append((f"{layer} S={S}", name, ms, flops / ms / 1e9))
            del args
        save()
    print(f"\nbf16 matmul ceiling {peak:.0f} TFLOP/s")
    for key, res in gl.items():
        if "ms" in res:
            bits = res.get("bit_equal_fraction", float("nan"))
            print(f"{key:<28} {res['ms']:8.3f} ms {res['tflops']:6.0f} TFLOP/s "
                  f"ref bits {bits:.5f} = triton {res.get('equal_to_triton', '-')}")
        elif "error" in res:
            print(f"{key:<28} error {res['error'][-200:]}")


def main():
    torch.manual_seed(0)
    peak = matmul_ceiling()
    RESULTS["ceilings"]["l2_read_tb_s"] = l2_read_rate()
    log(f"L2 -> SM read of an 8 MiB buffer: {RESULTS['ceilings']['l2_read_tb_s']:.2f} TB/s")
    save()

    probe_default()
    compiled = torch.compile(hf_attention, dynamic=False)
    for S in seqs("AGREE_SEQS", "4096 8192"):
        for layer in LAYERS:
            args = make_inputs(S, layer, seed=S + 1)
            want = ca.compressed_attention_reference(*args)
            entry = {"fused": agreement(dsfuse_op(args), want),
                     "fused_fast_exp": agreement(dsfuse_op(args, accurate_exp=False), want),
                     "fused_recompute": agreement(dsfuse_op(args, store_logits=False), want),
                     "hf_eager": agreement(hf_attention(*args), want)}
            if S in seqs("COMPILE_SEQS", "4096 8192 16384"):
                entry["hf_inductor"] = agreement(compiled(*args), want)
            RESULTS["agreement"][f"{layer}_S{S}"] = entry
            log(f"agreement {layer} S={S}: " + ", ".join(
                f"{k} bits={v['bit_equal_fraction']:.5f} max={v['max_abs_diff']:.3g}" for k, v in entry.items()))
            del want
            save()

    if os.environ.get("SWEEP", "1") != "0":
        variants = {"default": {}, "check_positions": {"check_positions": True},
                    "recompute": {"store_logits": False}, "fast_exp": {"accurate_exp": False},
                    "n128_s1": {"block_n": 128, "num_stages": 1}}
        for layer in LAYERS:
            args = make_inputs(8192, layer)
            flops = work_flops(args)
            for name, cfg in variants.items():
                try:
                    ms = bench(lambda: dsfuse_op(args, **cfg))
                except Exception as e:  # a config that does not compile (shared memory) is a result too
                    RESULTS["sweep"][f"{layer}_{name}"] = {"error": repr(e)[:300]}
                    log(f"sweep {layer} {name}: {e!r:.200}")
                    continue
                RESULTS["sweep"][f"{layer}_{name}"] = {"ms": ms, "tflops": flops / ms / 1e9, **cfg}
                log(f"sweep {layer} S=8192 {name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
                save()
            # the epilogue's cost: the same call without the inverse RoPE
            plain = args[:10] + (None, None)
            for name, cfg in (("default_no_rope", {}),):
                ms = bench(lambda: dsfuse_op(plain, **cfg))
                RESULTS["sweep"][f"{layer}_{name}"] = {"ms": ms, "tflops": flops / ms / 1e9, **cfg}
                log(f"sweep {layer} S=8192 {name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
        RESULTS["kernels"] = compiled_kernels()
        for key, res in RESULTS["kernels"].items():
            log(f"compiled attention kernel: {res}")
        save()

    hf_seqs, compile_seqs = seqs("HF_SEQS", "4096 8192"), seqs("COMPILE_SEQS", "4096 8192 16384")
    for S in seqs("SEQS", "4096 8192 16384 32768 65536"):
        for layer in LAYERS:
            args = make_inputs(S, layer)
            flops = work_flops(args)
            row = {"S": S, "layer": layer, "work_tflop": flops / 1e12}
            if FALLBACK:
                providers = [("dsfuse", lambda: dsfuse_op(args))]
            else:
                providers = [("dsfuse", lambda: torch.ops.dsfuse.compressed_attention(*args))]
            if S in hf_seqs:
                providers.append(("hf_eager", lambda: hf_attention(*args)))
            if S in compile_seqs:
                providers.append(("hf_inductor", lambda: compiled(*args)))
            for name, fn in providers:
                try:
                    fn()
                    ms = bench(fn, rep=100 if name == "dsfuse" else 30)
                    row[name] = {"ms": ms, "tflops": flops / ms / 1e9}
                    ROWS.append((f"{layer} S={S}", name, ms, flops / ms / 1e9))
                    log(f"{layer} S={S} {name}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s on {flops / 1e12:.3f} TFLOP")
                except Exception as e:  # out of memory, mostly
                    row[name] = repr(e)[:200]
                    log(f"{layer} S={S} {name}: {e!r:.200}")
                torch.cuda.empty_cache()
            RESULTS["timings"][f"{layer}_S{S}"] = row
            del args
            save()

    print(f"\nbf16 matmul ceiling {peak:.0f} TFLOP/s")
    print(f"{'case':<14} {'provider':<12} {'ms':>9} {'TFLOP/s':>8} {'% peak':>7}")
    for case, name, ms, tf in ROWS:
        print(f"{case:<14} {name:<12} {ms:9.3f} {tf:8.0f} {100 * tf / peak:6.1f}%")


if __name__ == "__main__":
    if sys.argv[1:] == ["split"]:
        SAVE_AS = "compressed_attention_split.json"
        split_main()
    elif sys.argv[1:] == ["gluon"]:
        SAVE_AS = "compressed_attention_gluon.json"
        gluon_main()
    else:
        main()
