"""What every benchmark shares: the configurations it compares, how it times and profiles a call, and the
environment line it records (date, commit, device, versions)."""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

from dsfuse.config import PASS_NAMES

CONFIGS: dict[str, tuple[str | None, dict | None]] = {
    "eager": (None, None),
    "inductor": ("inductor", None),
    "dsfuse-off": ("dsfuse", {"disable": list(PASS_NAMES)}),
    "dsfuse": ("dsfuse", None),
    # CUDA graphs (Inductor's "reduce-overhead"): decode steps are launch-bound without them.
    "inductor-cudagraphs": ("inductor", {"triton.cudagraphs": True}),
    "dsfuse-cudagraphs": ("dsfuse", {"mode": "reduce-overhead"}),
}
# The CUDA-graph configurations; they decode from HF's StaticCache (a replay needs fixed shapes and addresses).
CUDA_GRAPH_CONFIGS = frozenset({"inductor-cudagraphs", "dsfuse-cudagraphs"})


def resolve_configs(names: list[str]) -> dict[str, tuple[str | None, dict | None]]:
    """`CONFIGS` entries plus ablations: `only:PASS` runs one pass alone, `no:PASS` all but one."""
    resolved = {}
    for name in names:
        kind, _, pass_name = name.partition(":")
        if name in CONFIGS:
            resolved[name] = CONFIGS[name]
        elif kind in ("only", "no") and pass_name in PASS_NAMES:
            resolved[name] = ("dsfuse", {"enable" if kind == "only" else "disable": [pass_name]})
        else:
            raise ValueError(f"unknown config {name!r}; valid: {', '.join(CONFIGS)}, only:PASS, no:PASS "
                             f"with PASS in {', '.join(PASS_NAMES)}")
    return resolved


def git_commit() -> str:
    """The commit of the checkout this code runs from (asked there, not in the working directory, which may be
    another repository or none); `DSFUSE_COMMIT` names it where the code runs from an exported snapshot."""
    if os.environ.get("DSFUSE_COMMIT"):
        return os.environ["DSFUSE_COMMIT"]
    checkout = Path(__file__).resolve().parents[2]  # dsfuse/bench/measure.py in an editable install
    if not (checkout / "pyproject.toml").is_file() or not (checkout / "dsfuse" / "bench").is_dir():
        return "unknown"
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=checkout,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def environment() -> dict:
    import triton

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "device": "cpu"}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    return env


def time_ms(fn: Callable[[], object], device: str, rep_ms: int) -> float:
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(rep_ms // 4, 25), rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _device_us(event, self_only: bool) -> float:
    for name in (("self_device_time_total", "self_cuda_time_total") if self_only
                 else ("device_time_total", "cuda_time_total")):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def kernel_times(fn: Callable[[], object]) -> tuple[dict[str, tuple[float, int]], dict[str, float]]:
    """One profiled call of `fn` (after an unprofiled one): ({kernel: (GPU us, launches)}, {dsfuse op: GPU us with
    its kernels})."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = list(prof.key_averages())
    # Only device-side events are kernels: an operator's own self device time repeats its kernels'.
    kernels = {e.key: (_device_us(e, True), e.count) for e in events
               if e.device_type != torch.autograd.DeviceType.CPU and _device_us(e, True) > 0}
    fused = {e.key: _device_us(e, False) for e in events if e.key.startswith("dsfuse::")}
    return kernels, fused


def kernel_summary(kernels: dict[str, tuple[float, int]], top: int = 24) -> dict:
    """`profile_stages`' kernel fields from {kernel: (GPU us, launches)}."""
    total = sum(us for us, _ in kernels.values())
    return {
        "gpu_ms": total / 1e3,
        "top_kernels_ms": [(k[:80], us / 1e3) for k, (us, _) in
                           sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
        "kernel_launches": sum(count for _, count in kernels.values()),
        "launches_by_kernel": {k[:80]: count for k, (_, count) in kernels.items()},
    }


def profile_stages(fn: Callable[[], object], top: int = 24) -> dict:
    """GPU time of one call by kernel (with its launch count: a decode step's small kernels add up), and the share
    of each dsfuse fused op."""
    kernels, fused = kernel_times(fn)
    summary = kernel_summary(kernels, top)
    total = summary["gpu_ms"] * 1e3
    return {**summary, "dsfuse_ops_ms": {k: v / 1e3 for k, v in fused.items()},
            "dsfuse_ops_share": {k: v / total for k, v in fused.items()} if total else {}}


def compile_with(model, backend: str | None, options: dict | None):
    if backend is None:
        return model
    torch._dynamo.reset()
    return torch.compile(model, backend=backend, options=options) if options else torch.compile(model, backend=backend)


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def free_device_memory(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def loaded_with_weight_bytes(load: Callable[[], torch.nn.Module], cuda: bool) -> tuple[torch.nn.Module, int]:
    """`load()`'s model and the device memory it took. Dynamo's caches keep the models of earlier compiles in this
    process alive (a notebook benchmarks one preset after another): they are dropped first, so the model's own bytes
    are not counted with a previous one's."""
    if not cuda:
        return load(), 0
    torch._dynamo.reset()
    gc.collect()
    free_device_memory(cuda)
    before = torch.cuda.memory_allocated()
    model = load()
    return model, torch.cuda.memory_allocated() - before


def graph_count() -> int:
    """Dynamo graphs compiled so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
