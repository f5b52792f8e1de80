"""H200 benchmark of `dsfuse.kv_compress` against HF's compressor code (`DeepseekV4CSACompressor`,
`DeepseekV4HCACompressor`, the CSA indexer's compressor) after its projections, eagerly and under torch.compile
(Inductor), at V4-Flash dims: hidden 4096, head_dim 512, rope 64, S = 8192, CSA m = 4 (two series of 8 slots), HCA
m' = 128, the indexer's compressor at 128-dim heads; bf16 projections, HF's fp32 position bias and norm weight.

The projections are GEMMs outside the op (computed once, not timed). Timed: HF's code from the projections' outputs
to the roped entries (the module's own `kv_norm`, `rotary_emb` and `apply_rotary_pos_emb`), and the op with the
cos / sin tables at the windows' positions it takes as inputs (their computation included). Reported: medians of
`triton.testing.do_bench` in ms, GB/s against the bytes floor (kv and gate read once, the entries written once:
`bytes_moved`), the fraction of a device-to-device copy's bandwidth measured in the same run, agreement with HF eager
(share of bit-equal elements, worst difference), and a BLOCK_L / num_warps sweep of the kernel.

    python benchmarks/compressor_gpu.py            # on the GPU; writes $OUT/compressor.json
    python benchmarks/compressor_gpu.py --tiny     # CPU smoke run through Triton's interpreter
"""

import argparse
import json
import os
import sys
import time

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4CSACompressor,
    DeepseekV4HCACompressor,
    apply_rotary_pos_emb,
)

from dsfuse.kernels import compressor as ck  # noqa: E402
from dsfuse.models.presets import hf_config  # noqa: E402

SWEEP = [dict(block_l=l, num_warps=w) for l in (4, 8, 16, 32) for w in (2, 4, 8)]


def hf_pooling(module, kv, gate, overlap: bool):
    """HF's compressor forward after `kv_proj` / `gate_proj` (cache None), line for line."""
    B, S, _ = kv.shape
    m, D = module.compress_rate, module.head_dim
    W = S // m
    chunk_kv = kv[:, :W * m].view(B, W, m, -1)
    chunk_gate = gate[:, :W * m].view(B, W, m, -1) + module.position_bias
    if overlap:
        new_kv = chunk_kv.new_zeros((B, W, 2 * m, D))
        new_gate = chunk_gate.new_full((B, W, 2 * m, D), float("-inf"))
        new_kv[:, :, m:] = chunk_kv[..., D:]
        new_gate[:, :, m:] = chunk_gate[..., D:]
        new_kv[:, 1:, :m] = chunk_kv[:, :-1, :, :D]
        new_gate[:, 1:, :m] = chunk_gate[:, :-1, :, :D]
        chunk_kv, chunk_gate = new_kv, new_gate
    compressed = module.kv_norm((chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(2))
    positions = (torch.arange(W, device=kv.device) * m).unsqueeze(0).expand(B, -1)
    cos, sin = module.rotary_emb(compressed, position_ids=positions, layer_type="compress")
    return apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)


def dsfuse_pooling(module, kv, gate, overlap: bool):
    B, S, C = kv.shape
    m = module.compress_rate
    W = S // m
    positions = (torch.arange(W, device=kv.device) * m).unsqueeze(0).expand(B, -1)
    cos, sin = module.rotary_emb(kv, position_ids=positions, layer_type="compress")
    return torch.ops.dsfuse.kv_compress(kv[:, :W * m].view(B, W, m, C), gate[:, :W * m].view(B, W, m, C),
                                        module.position_bias, module.kv_norm.weight, cos, sin,
                                        module.kv_norm.variance_epsilon, overlap)


def timer(device):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100)

    def cpu_time(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return cpu_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="small dims on CPU (Triton interpreter)")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    preset, seq = ("v4-tiny", 64) if args.tiny else ("v4-flash-real-2l", args.seq)
    config = hf_config(preset)
    bench = timer(device)
    torch.manual_seed(0)
    csa = DeepseekV4CSACompressor(config)
    sites = {"CSA": (csa, True), "HCA": (DeepseekV4HCACompressor(config), False), "indexer": (csa.indexer, True)}
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "seq": seq, "sites": {}}
    if device == "cuda":
        src = torch.empty(1 << 28, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        results["copy_gb_per_s"] = 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e6
    for name, (module, overlap) in sites.items():
        for p in module.parameters():
            p.data.normal_(0, 0.5 if p.dim() > 1 else 1.0)
        with torch.no_grad():
            module.kv_norm.weight.add_(1.0)
        module = module.to(device).to(torch.bfloat16).eval()
        module.position_bias.data = module.position_bias.data.float()
        module.kv_norm.float()
        hidden = torch.randn(1, seq, config.hidden_size, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            kv, gate = module.kv_proj(hidden), module.gate_proj(hidden)
            want = hf_pooling(module, kv, gate, overlap)
            got = dsfuse_pooling(module, kv, gate, overlap)
            compiled = torch.compile(lambda a, b: hf_pooling(module, a, b, overlap))
            inductor_out = compiled(kv, gate)
            row = {"m": module.compress_rate, "D": module.head_dim, "C": kv.shape[-1],
                   "bit_equal_dsfuse": (got == want).float().mean().item(),
                   "max_abs_diff_dsfuse": (got.float() - want.float()).abs().max().item(),
                   "bit_equal_inductor": (inductor_out == want).float().mean().item(),
                   "hf_eager_ms": bench(lambda: hf_pooling(module, kv, gate, overlap)),
                   "hf_inductor_ms": bench(lambda: compiled(kv, gate)),
                   "dsfuse_ms": bench(lambda: dsfuse_pooling(module, kv, gate, overlap))}
            floor = ck.bytes_moved(1, seq, kv.shape[-1], module.head_dim, module.compress_rate, torch.bfloat16)
            row["bytes_floor"] = floor
            row["dsfuse_gb_per_s"] = floor / row["dsfuse_ms"] / 1e6
            if "copy_gb_per_s" in results:
                row["floor_ms_at_copy_bw"] = floor / results["copy_gb_per_s"] / 1e6
            if device == "cuda":
                B, S, C = kv.shape
                m = module.compress_rate
                W = S // m
                positions = (torch.arange(W, device=device) * m).unsqueeze(0)
                cos, sin = module.rotary_emb(kv, position_ids=positions, layer_type="compress")
                op_args = (kv[:, :W * m].view(B, W, m, C), gate[:, :W * m].view(B, W, m, C), module.position_bias,
                           module.kv_norm.weight, cos, sin, module.kv_norm.variance_epsilon, overlap)
                row["sweep_kernel_ms"] = {f"block_l={c['block_l']} warps={c['num_warps']}":
                                          bench(lambda c=c: ck.kv_compress_triton(*op_args, **c)) for c in SWEEP}
        results["sites"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "sweep_kernel_ms"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compressor.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
