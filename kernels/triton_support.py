"""Running dsfuse's Triton kernels with and without a GPU.

On a CUDA device the custom ops launch their Triton kernels. Without one, tests run the same kernels
through Triton's interpreter: set `TRITON_INTERPRET=1` in the environment *before* `triton` is first
imported (the test suite's conftest does this when no GPU is present) and call a kernel's launcher
(`<family>_triton(...)`) on CPU tensors. Under the interpreter a bf16 `tl.dot` can be wrong while
fp16 and fp8 dots are right, so interpreter tests feed fp16 where the GPU path uses bf16.
"""

from __future__ import annotations

import functools
import os


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host ints. Triton's is a constexpr function whose wrapper costs microseconds a host call,
    and a launch path makes dozens of them (decode steps are bound by the host's launch work)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host ints n >= 0 (0 for 0), without its constexpr wrapper (see `cdiv`); anything
    else (a SymInt) goes to Triton's."""
    if type(n) is not int or n < 0:
        import triton

        return triton.next_power_of_2(n)
    return 1 << (n - 1).bit_length() if n else 0


# (namespace, device type) -> the Library holding that device's direct kernels (one per device, so that one
# device's kernels can be removed and registered again without touching another's)
_DISPATCH_LIBRARIES: dict[tuple[str, str], object] = {}
# (op's qualified name, device type) -> the function `direct_kernel` registered (benchmarks time them alone)
DIRECT_KERNELS: dict[tuple[str, str], object] = {}


def direct_kernel(op, device_type: str = "cuda"):
    """Decorator: the function becomes custom op `op`'s kernel for `device_type`, registered straight in the
    dispatcher, and that device's autograd key falls through to it. `custom_op`'s own `register_kernel` and autograd
    kernel add two Python layers to every call (`benchmarks/launch_overhead.py` times both), and a V4 decode step,
    bound by the host, makes ~20 such calls. dsfuse's ops are inference ops, inserted by the backend only into graphs
    that need no gradients: on this device an op has no autograd formula (its Triton kernels are not
    differentiable). Other devices (the CPU references) keep custom_op's path."""

    def register(fn):
        DIRECT_KERNELS[(op._qualname, device_type)] = fn
        _register(op._qualname, device_type, fn)
        return fn

    return register


def remove_direct_kernels(device_type: str) -> None:
    """Take every direct kernel of `device_type` out of the dispatcher (custom_op's path serves the ops meanwhile).
    torch (2.11) refuses a second Python kernel for an op's dispatch key: a benchmark that wraps the kernels
    removes them first, and `register_direct_kernels` puts them back."""
    for namespace, device in list(_DISPATCH_LIBRARIES):
        if device == device_type:
            _DISPATCH_LIBRARIES.pop((namespace, device))._destroy()


def register_direct_kernels(device_type: str, wrap=None) -> None:
    """Register every direct kernel of `device_type` in the dispatcher again (after `remove_direct_kernels`), each as
    `wrap(qualified name, kernel)` when `wrap` is given (a benchmark's recorder), else as itself."""
    for (qualname, device), fn in DIRECT_KERNELS.items():
        if device == device_type:
            _register(qualname, device, fn if wrap is None else wrap(qualname, fn))


def _register(qualname: str, device_type: str, fn) -> None:
    import torch

    namespace, name = qualname.split("::")
    key = device_type.upper()
    library = _DISPATCH_LIBRARIES.get((namespace, device_type))
    if library is None:
        library = _DISPATCH_LIBRARIES[(namespace, device_type)] = torch.library.Library(namespace, "IMPL")
    library.impl(name, fn, key)
    library.impl(name, torch.library.fallthrough_kernel, f"Autograd{key}")


@functools.lru_cache(maxsize=None)
def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter instead of a GPU. Read once: Triton itself decides when
    a kernel is decorated (at import), and launch paths ask on every call."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fma_rounds_once(device: str = "cpu") -> bool:
    """Whether `tl.fma` on `device` rounds once, as a GPU's `fma.rn.f32` always does. Triton's interpreter
    computed it as a multiply and then an add (two fp32 roundings) before triton 3.9; tests that compare a
    kernel's FMA lanes bit for bit expect the rounding that this backend actually performs."""
    return _fma_probe(str(device))


@functools.lru_cache(maxsize=None)
def _fma_probe(device: str) -> bool:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(a_ptr, c_ptr, out_ptr):
        a = tl.load(a_ptr)
        tl.store(out_ptr, tl.fma(a, a, tl.load(c_ptr)))

    a = torch.tensor([1 + 2**-12], dtype=torch.float32, device=device)  # a*a = 1 + 2^-11 + 2^-24: not an fp32
    c = -(a * a)  # minus a*a rounded to fp32: a single rounding leaves the 2^-24, two roundings leave 0
    out = torch.empty_like(a)
    fma_kernel[(1,)](a, c, out)
    return bool(out.item() != 0.0)
