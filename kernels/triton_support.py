"""Running dsfuse's Triton kernels with and without a GPU.

On a CUDA device the custom ops launch their Triton kernels. Without one, tests run the same kernels
through Triton's interpreter: set `TRITON_INTERPRET=1` in the environment *before* `triton` is first
imported (the test suite's conftest does this when no GPU is present) and call a kernel's launcher
(`<family>_triton(...)`) on CPU tensors. Under the interpreter a bf16 `tl.dot` can be wrong while
fp16 and fp8 dots are right, so interpreter tests feed fp16 where the GPU path uses bf16.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter instead of a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
