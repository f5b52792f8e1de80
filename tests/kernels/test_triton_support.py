"""The host-side helpers that stand in for Triton's constexpr functions in the launch paths give Triton's values."""

import triton

from dsfuse.kernels.triton_support import cdiv, next_power_of_2

VALUES = [*range(0, 1100), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**31 + 1, 2**40 - 1, 2**40, 2**40 + 3]


def test_next_power_of_2_matches_triton():
    assert [next_power_of_2(n) for n in VALUES] == [triton.next_power_of_2(n) for n in VALUES]


def test_cdiv_matches_triton():
    divisors = (1, 2, 3, 7, 16, 64, 128, 1000)
    assert [cdiv(n, d) for n in VALUES for d in divisors] == [triton.cdiv(n, d) for n in VALUES for d in divisors]


def test_direct_kernel_replaces_the_default_implementation_on_its_device():
    import torch

    from dsfuse.kernels.triton_support import direct_kernel

    @torch.library.custom_op("dsfuse_test::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the default implementation must not run on the device with a direct kernel")

    direct_kernel(double, "cpu")(lambda x: x * 2)
    assert torch.equal(torch.ops.dsfuse_test.double(torch.ones(3)), torch.full((3,), 2.0))


def test_every_dsfuse_op_has_its_cuda_kernel_registered_directly():
    import importlib
    import pkgutil

    import torch
    from torch._library.custom_ops import OPDEFS

    import dsfuse.kernels
    from dsfuse.kernels.triton_support import DIRECT_KERNELS

    for module in pkgutil.iter_modules(dsfuse.kernels.__path__):
        importlib.import_module(f"dsfuse.kernels.{module.name}")
    ops = {name for name in OPDEFS if name.startswith("dsfuse::")}
    assert len(ops) >= 18 and ops == {name for name, device in DIRECT_KERNELS if device == "cuda"}
    for name in ops:
        table = torch._C._dispatch_dump(name).splitlines()
        cuda = next(line for line in table if line.startswith("CUDA:"))
        autograd = next(line for line in table if line.startswith("AutogradCUDA:"))
        assert "triton_support.py" in cuda and "fallthrough" in autograd, table


def test_direct_kernels_can_be_swapped_for_recorders_and_restored():
    """benchmarks/launch_overhead.py's recorder on the GPU, here on CPU: the recorder replaces the direct kernel (torch
    2.11 refuses a second Python kernel for one dispatch key, so it must not be stacked over it), and afterwards the
    direct kernel serves the op again."""
    import torch

    from dsfuse.kernels.triton_support import direct_kernel, register_direct_kernels, remove_direct_kernels

    @torch.library.custom_op("dsfuse_test::triple", mutates_args=())
    def triple(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the default implementation must not run on the device with a direct kernel")

    direct_kernel(triple, "cpu")(lambda x: x * 3)
    seen = []

    def recording(name, fn):
        def record(*args):
            seen.append(name)
            return fn(*args)
        return record

    remove_direct_kernels("cpu")
    register_direct_kernels("cpu", recording)
    try:
        assert torch.equal(torch.ops.dsfuse_test.triple(torch.ones(2)), torch.full((2,), 3.0))
        assert seen == ["dsfuse_test::triple"]
        assert_one_direct_cpu_kernel("dsfuse_test::triple")
    finally:
        remove_direct_kernels("cpu")
        register_direct_kernels("cpu")
    assert torch.equal(torch.ops.dsfuse_test.triple(torch.ones(2)), torch.full((2,), 3.0))
    assert seen == ["dsfuse_test::triple"]
    assert_one_direct_cpu_kernel("dsfuse_test::triple")


def assert_one_direct_cpu_kernel(name: str):
    """The op's CPU key holds one kernel, registered by triton_support (none stacked inactive beneath it), and its
    autograd key falls through."""
    import torch

    table = torch._C._dispatch_dump(name).splitlines()
    cpu = [line for line in table if line.startswith("CPU")]
    autograd = [line for line in table if line.startswith("AutogradCPU")]
    assert len(cpu) == 1 and "triton_support.py" in cpu[0], table
    assert len(autograd) == 1 and "fallthrough" in autograd[0], table


def _test_op(name: str, kernel):
    """A custom op `dsfuse_test::<name>` (x -> x's shape and dtype) whose CPU kernel is `kernel`, registered the way
    dsfuse's CUDA kernels are (`direct_kernel`), so a call goes through the checks every direct kernel gets."""
    import torch

    from dsfuse.kernels.triton_support import direct_kernel

    def replaced(x):
        raise AssertionError("replaced by the direct kernel")

    op = torch.library.custom_op(f"dsfuse_test::{name}", replaced, mutates_args=(), schema="(Tensor x) -> Tensor")
    op.register_fake(lambda x: torch.empty_like(x, memory_format=torch.contiguous_format))
    direct_kernel(op, "cpu")(kernel)
    return getattr(torch.ops.dsfuse_test, name).default


def test_a_view_reaching_past_its_storage_is_refused_before_the_kernel_runs():
    """Inductor's generated code reinterprets buffers without checks. A bool [2, 33, 33] mask given padded strides
    (1152, 33, 1) over an unpadded 2178-byte buffer (the layout of issue 34's crash) must never reach a kernel."""
    import pytest
    import torch

    ran = []
    op = _test_op("sum_rows", lambda x: ran.append(1) or x.clone())
    buffer = torch.zeros(2 * 33 * 33, dtype=torch.bool)
    reinterpret = torch._C._dynamo.guards._reinterpret_tensor
    padded = reinterpret(buffer, (2, 33, 33), (1152, 33, 1), 0)
    with pytest.raises(RuntimeError, match=r"dsfuse_test::sum_rows: tensor argument 0 .* strides \[1152, 33, 1\].* "
                                           r"reaches byte 2241 of a storage of 2178 bytes"):
        op(padded)
    assert not ran
    assert op(reinterpret(buffer, (2, 33, 33), (1089, 33, 1), 0)).shape == (2, 33, 33)  # the same view, in bounds
    assert op(torch.zeros(2, 1152)[:, :33 * 33].view(2, 33, 33)).shape == (2, 33, 33)  # padded, and in bounds
    assert ran == [1, 1]


def test_debug_mode_checks_the_outputs_against_the_fake_implementation(monkeypatch):
    import pytest
    import torch

    x = torch.randn(3, 5)
    honest = _test_op("honest", lambda x: x * 2)
    transposed = _test_op("transposed", lambda x: (x * 2).t().contiguous().t())
    aliasing = _test_op("aliasing", lambda x: x.view(x.shape))
    monkeypatch.delenv("DSFUSE_DEBUG", raising=False)
    transposed(x), aliasing(x)  # unchecked without DSFUSE_DEBUG
    monkeypatch.setenv("DSFUSE_DEBUG", "1")
    assert torch.equal(honest(x), x * 2)
    with pytest.raises(RuntimeError, match=r"output 0 has strides \[1, 3\], its fake implementation promised \[5, 1\]"):
        transposed(x)
    with pytest.raises(RuntimeError, match="shares memory with an input"):
        aliasing(x)
