"""Test setup: Triton's interpreter on machines without a GPU, scalar Inductor C++ there, each pytest-xdist worker's
share of the cores, and a clean dsfuse state per test."""

import os

import torch

if not torch.cuda.is_available():
    # Must happen before triton is imported anywhere, so kernels run on the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Inductor's C++ for what dsfuse leaves to it, without SIMD: no probe builds of the vector ISAs in every process
    # (~10 s each, the subprocesses inherit the variable) and less code to generate per graph (~15 %). dsfuse's passes
    # run before Inductor's code generation and see the same graph either way.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    from torch._inductor import config as inductor_config

    inductor_config.cpp.vec_isa_ok = os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"
    from interpreter_patching import patch_the_language_once_per_launch

    patch_the_language_once_per_launch()

# pytest-xdist workers share the cores: each takes its share of torch's default intra-op threads (unless
# OMP_NUM_THREADS says otherwise). Two workers of two threads each on two cores leave OpenMP waiting for threads the
# other worker holds: the eager V4 chunked-prefill tests took 6.7 s with two threads beside one busy process, 0.8 s
# with one.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with empty Dynamo caches and an empty dsfuse report."""
    import dsfuse

    torch._dynamo.reset()
    dsfuse.reset_report()
    yield
    torch._dynamo.reset()
