"""H200 benchmark of `dsfuse.rmsnorm_rope` at T=16384: bit-exactness against the reference on CUDA
(the reference runs torch's own CUDA elementwise ops, so this checks the GPU rounding), then
do_bench medians of the eager reference, torch.compile (default) of the reference and the Triton
kernel, as GB/s beside a copy bandwidth measured in the same run.  Prints a table last; writes
$OUT/norm_rope_quant.json when OUT is set (rewritten after each case)."""

import importlib.util
import json
import os
import pathlib
import time

import torch
from triton.testing import do_bench

try:
    from dsfuse.kernels import norm_rope_quant as nrq
except Exception:  # a bare checkout without `pip install -e .`
    _path = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "norm_rope_quant.py"
    _spec = importlib.util.spec_from_file_location("dsfuse_norm_rope_quant", _path)
    nrq = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(nrq)

RESULTS = {"device": None, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": {}}
ROWS = []  # (case, provider, us, GB/s, fraction of copy bandwidth)
START = time.time()
T = 16384


def save():
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "norm_rope_quant.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def bench(fn):
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def copy_bandwidth():
    x = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    gbps = 2 * x.numel() / ms / 1e6
    RESULTS["copy_gb_per_s_read_plus_write"] = gbps
    log(f"copy bandwidth {gbps:.0f} GB/s")
    return gbps


def make_case(c_proj, c_norm, c_rope, dtype, offset=0):
    """x as the [T, c_norm + c_rope] row slice of a [T, c_proj] projection output, HF cos/sin."""
    proj = torch.randn(T, c_proj, device="cuda", dtype=dtype)
    x = proj[:, offset:offset + c_norm + c_rope]
    w = (1 + 0.1 * torch.randn(c_norm, device="cuda")).to(dtype)
    if c_rope == 0:
        return x, w, None, None
    angles = torch.arange(T, device="cuda", dtype=torch.float32)[:, None] * torch.rand(c_rope // 2, device="cuda")
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    return x, w, cos, sin


def run_case(name, c_proj, c_norm, c_rope, interleaved, copy_gbps, dtype=torch.bfloat16, with_compile=True):
    x, w, cos, sin = make_case(c_proj, c_norm, c_rope, dtype)
    args = (x, w, 1e-6, cos, sin, interleaved, False)
    ref = nrq.rmsnorm_rope_reference(*args)
    out = nrq.rmsnorm_rope_triton(*args)
    torch.cuda.synchronize()
    exact = [torch.equal(o, r.contiguous()) for o, r in zip(out, ref)]
    mismatch = [int((o != r).sum()) for o, r in zip(out, ref)]
    max_diff = [float((o.float() - r.float()).abs().max()) if o.numel() else 0.0 for o, r in zip(out, ref)]
    case = {"T": T, "c_norm": c_norm, "c_rope": c_rope, "interleaved": interleaved, "dtype": str(dtype),
            "bit_exact_normed_roped": exact, "mismatched_elements": mismatch, "max_abs_diff": max_diff}
    log(f"{name}: bit-exact normed/roped {exact}, mismatches {mismatch}, max diff {max_diff}")
    nbytes = nrq.bytes_moved(T, c_norm, c_rope, x.element_size())
    providers = {"eager reference": lambda: nrq.rmsnorm_rope_reference(*args)}
    if with_compile:  # each case is one more Inductor compile (seconds): keep the script under 30 s
        compiled = torch.compile(nrq.rmsnorm_rope_reference)
        providers["torch.compile reference"] = lambda: compiled(*args)
    providers["dsfuse triton"] = lambda: nrq.rmsnorm_rope_triton(*args)
    case["us"] = {}
    for provider, fn in providers.items():
        try:
            ms = bench(fn)
        except Exception as exc:  # keep the other providers' numbers
            log(f"{name} {provider}: failed {type(exc).__name__}: {exc}")
            continue
        gbps = nbytes / ms / 1e6
        case["us"][provider] = ms * 1e3
        ROWS.append((name, provider, ms * 1e3, gbps, gbps / copy_gbps))
    case["bytes"] = nbytes
    RESULTS["cases"][name] = case
    save()


def main():
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    copy_gbps = copy_bandwidth()
    save()
    # q side: q_a_layernorm over q_a_proj's 1536 outputs (no rope)
    run_case("q_a_norm_1536", 1536, 1536, 0, True, copy_gbps)
    # kv side: kv_a_layernorm over the first 512 of kv_a_proj_with_mqa's 576 outputs + interleaved rope on 64
    run_case("kv_norm512_rope64_interleaved", 576, 512, 64, True, copy_gbps)
    # the same slice with half-split rope (the indexer's form), to show the form costs the same
    run_case("kv_norm512_rope64_half_split", 576, 512, 64, False, copy_gbps, with_compile=False)
    print(f"\n{'case':32s} {'provider':26s} {'us':>9s} {'GB/s':>8s} {'of copy':>8s}")
    for name, provider, us, gbps, frac in ROWS:
        print(f"{name:32s} {provider:26s} {us:9.1f} {gbps:8.0f} {frac:8.2f}")
    log("done")


if __name__ == "__main__":
    main()
