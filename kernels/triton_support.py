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
    library.impl(name, _checked(qualname, fn), key)
    library.impl(name, torch.library.fallthrough_kernel, f"Autograd{key}")


def _checked(qualname: str, fn):
    """`fn` behind the checks every direct kernel gets: its tensor arguments must lie inside their storage (a kernel
    reads raw pointers, so a view that reaches past its memory would be read silently), and with DSFUSE_DEBUG set,
    its outputs must be what the op's fake implementation promised Inductor (`check_outputs_match_fake`)."""
    from dsfuse.config import debug_enabled

    def kernel(*args, **kwargs):
        check_views_in_storage(qualname, args, kwargs)
        out = fn(*args, **kwargs)
        if debug_enabled():
            check_outputs_match_fake(qualname, args, kwargs, out)
        return out

    return kernel


def _tensors(values):
    """The tensors among `values`, looking one level into lists and tuples (the ops' `Tensor[]` arguments)."""
    import torch

    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def view_end_bytes(t) -> int:
    """One past the last byte `t`'s sizes and strides reach in its storage (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def check_views_in_storage(qualname: str, args, kwargs) -> None:
    """Raise if a tensor argument's view reaches past its storage. Such a view cannot come from PyTorch's checked
    view ops; it comes from an unchecked reinterpretation of a buffer (the kind Inductor's generated code makes), and
    a Triton kernel given it would read or write memory that is not the tensor's."""
    for position, t in enumerate(_tensors([*args, *kwargs.values()])):
        end, have = view_end_bytes(t), t.untyped_storage().nbytes()
        if end > have:
            raise RuntimeError(
                f"{qualname}: tensor argument {position} (sizes {list(t.shape)}, strides {list(t.stride())}, offset "
                f"{t.storage_offset()}, {t.dtype}) reaches byte {end} of a storage of {have} bytes: a view outside its "
                f"memory, refused before any kernel reads it. The caller's buffer layout disagrees with this view "
                f"(please report it with the model and input sizes)")


def check_outputs_match_fake(qualname: str, args, kwargs, out) -> None:
    """Raise unless `out` is what the op's fake implementation returns for the same inputs: the same sizes, strides
    and dtypes, each output inside its own storage, and no output sharing memory with an input (the ops are declared
    without aliasing). Inductor plans buffers from the fake outputs, so any difference is a memory-safety defect."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    namespace, name = qualname.split("::")
    op = getattr(getattr(torch.ops, namespace), name).default
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = op(*tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, args),
                  **tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, kwargs))
    real_outs = list(_tensors([out]))
    fake_outs = list(_tensors([fake]))
    if len(real_outs) != len(fake_outs):
        raise RuntimeError(f"{qualname}: {len(real_outs)} tensor outputs, its fake implementation gives "
                           f"{len(fake_outs)}")
    inputs = {t.untyped_storage().data_ptr() for t in _tensors([*args, *kwargs.values()]) if t.numel()}
    for position, (real, promised) in enumerate(zip(real_outs, fake_outs)):
        what = f"{qualname}: output {position}"
        if real.shape != promised.shape or real.dtype != promised.dtype:
            raise RuntimeError(f"{what} is {real.dtype}{list(real.shape)}, its fake implementation promised "
                               f"{promised.dtype}{list(promised.shape)}")
        significant = [(r, f) for r, f, size in zip(real.stride(), promised.stride(), real.shape) if size > 1]
        if any(r != f for r, f in significant):
            raise RuntimeError(f"{what} has strides {list(real.stride())}, its fake implementation promised "
                               f"{list(promised.stride())}")
        if view_end_bytes(real) > real.untyped_storage().nbytes():
            raise RuntimeError(f"{what} reaches past its storage")
        if real.numel() and real.untyped_storage().data_ptr() in inputs:
            raise RuntimeError(f"{what} shares memory with an input, but the op is declared without aliasing")


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
