"""Test setup: Triton's interpreter on machines without a GPU, and a clean dsfuse state per test."""

import os

import torch

if not torch.cuda.is_available():
    # Must happen before triton is imported anywhere, so kernels run on the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
