"""Host time of each dsfuse op a DeepSeek V4 decode step calls: what a host-bound step (no CUDA graphs) pays per op.

Runs `generate` on a V4 preset with `V4DecodeCache` through dsfuse, records the arguments of every dsfuse op the
decode steps call (first call of each op and member list), then times each op's CUDA implementation on those
arguments, one call after another:

- on a GPU: the op as the compiled step calls it (`torch.ops.dsfuse.<op>`: dispatcher, custom-op wrapper, our
  launcher, Triton's launcher) and our CUDA function alone, in microseconds of host time per call (no sync inside
  the loop; decode-sized kernels finish faster than the host issues them);
- on CPU (no GPU): our CUDA function on CPU tensors with Triton's kernel launches replaced by a no-op: the Python
  work of our launch path alone (validation, allocation, argument binding), on this host.

    python benchmarks/launch_overhead.py                      # v4-tiny on CPU
    python benchmarks/launch_overhead.py --preset v4-flash-real-2l --prompt 8192 --json $OUT/launch.json   # H200
"""

import argparse
import json
import sys
import time
from typing import Optional

import torch
import triton
from torch._library.custom_ops import OPDEFS

import dsfuse  # noqa: F401  (registers the dsfuse ops)
from dsfuse.generation import generate_kwargs
from dsfuse.kernels.triton_support import (DIRECT_KERNELS, direct_kernel, register_direct_kernels,
                                          remove_direct_kernels)
from dsfuse.models.presets import build_hf_model


def record_decode_calls(model, prompt: int, new_tokens: int, device: str) -> dict:
    """{(op, members): (args, kwargs)} of the dsfuse ops the compiled decode steps call."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    # an eager prefill: the first call of each op recorded is then a decode step's, not a prefill chunk's
    kwargs = generate_kwargs(model, 1, prompt + new_tokens, prefill_chunk_size=None,
                             compile_all_devices=device == "cpu")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    calls = {}

    def recording(name, fn):
        def record(*args, **kw):
            calls.setdefault((name, args[0] if name == "dsfuse::norm_rope_group" else ""), (args, kw))
            return fn(*args, **kw)
        return record

    # CUDA: the direct kernels, replaced by recorders and registered again afterwards; CPU: custom_op's default impl
    originals = {}
    if device == "cuda":
        remove_direct_kernels("cuda")
        register_direct_kernels("cuda", recording)
    else:
        for name, opdef in OPDEFS.items():
            if name.startswith("dsfuse::") and None in opdef._backend_fns:
                originals[name] = opdef._backend_fns[None]
                opdef._backend_fns[None] = recording(name, originals[name])
    try:
        kwargs = generate_kwargs(model, 1, prompt + new_tokens, cache=kwargs["cache"], prefill_chunk_size=None,
                                 compile_all_devices=device == "cpu")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, **kwargs)
    finally:
        if device == "cuda":
            remove_direct_kernels("cuda")
            register_direct_kernels("cuda")
        for name, fn in originals.items():
            OPDEFS[name]._backend_fns[None] = fn
    return calls


def host_us(fn, repeats: int, rounds: int = 9) -> float:
    """The fastest round's mean host time per call (the least disturbed by other work on the host, as `timeit`)."""
    fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        samples.append((time.perf_counter() - start) / repeats * 1e6)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return min(samples)


def dispatch_overhead(device: str, repeats: int) -> dict:
    """Host us per call of a no-op op with norm_rope_group's argument kinds (11 tensors, 6 ints, 3 floats), its
    kernel registered through custom_op's `register_kernel` and through `direct_kernel`."""
    result = torch.zeros(1, device=device)

    def noop(members, tensors, ints, floats):
        return [result.clone()]

    ops = {}
    for path in ("custom_op", "direct_kernel"):
        op = torch.library.custom_op(f"dsfuse_probe::{path}", mutates_args=())(_probe_signature)
        op.register_fake(lambda members, tensors, ints, floats: [result.new_empty(1)])
        if path == "custom_op":
            op.register_kernel(device)(noop)
        else:
            direct_kernel(op, device)(noop)
        ops[path] = getattr(torch.ops.dsfuse_probe, path).default
    args = ("a,b", [torch.zeros(4, device=device) for _ in range(11)], [1] * 6, [0.5] * 3)
    with torch.no_grad():
        return {f"{path}_us": host_us(lambda op=op: op(*args), repeats) for path, op in ops.items()}


def _probe_signature(members: str, tensors: list[Optional[torch.Tensor]], ints: list[int],
                     floats: list[float]) -> list[torch.Tensor]:
    raise NotImplementedError("the probe has kernels for the device it is timed on only")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="v4-tiny")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_hf_model(args.preset, dtype=dtype, device=device)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    calls = record_decode_calls(model, args.prompt, 4, device)
    rows = []
    # On CPU every Triton launch is a no-op: compiled kernels need a GPU, and under TRITON_INTERPRET=1 the
    # interpreter's run time is not the launch path's.
    from triton.runtime.interpreter import InterpretedFunction

    launchers = (triton.runtime.jit.JITFunction, InterpretedFunction) if device == "cpu" else ()
    stubbed = {cls: cls.run for cls in launchers}
    for cls in launchers:
        cls.run = lambda self, *a, **k: None
    try:
        for (name, members), (op_args, op_kwargs) in sorted(calls.items()):
            cuda_fn = DIRECT_KERNELS[(name, "cuda")]
            row = {"op": name, "members": members,
                   "launcher_us": host_us(lambda: cuda_fn(*op_args, **op_kwargs), args.repeats)}
            if device == "cuda":
                op = getattr(torch.ops.dsfuse, name.split("::")[1])
                row["op_us"] = host_us(lambda: op(*op_args, **op_kwargs), args.repeats)
            rows.append(row)
    finally:
        for cls, run in stubbed.items():
            cls.run = run
    what = "our launcher (Triton launches stubbed)" if device == "cpu" else "our launcher"
    print(f"# {args.preset} decode ops, host us per call on {device} (torch {torch.__version__}, "
          f"triton {triton.__version__})")
    print(f"{'op':60s} {what:>40s}" + (f" {'torch.ops call':>15s}" if device == "cuda" else ""))
    for row in rows:
        label = row["op"].split("::")[1] + (f" [{row['members']}]" if row["members"] else "")
        print(f"{label:60s} {row['launcher_us']:40.1f}" + (f" {row['op_us']:15.1f}" if "op_us" in row else ""))
    dispatch = dispatch_overhead(device, args.repeats)
    print(f"dispatch of a no-op op (norm_rope_group's argument kinds): custom_op's kernel path "
          f"{dispatch['custom_op_us']:.1f} us, direct_kernel {dispatch['direct_kernel_us']:.1f} us per call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "device": device, "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows, "dispatch": dispatch}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
