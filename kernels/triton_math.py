"""Device math shared by the Triton kernels that must round as PyTorch's CUDA kernels do.

torch's softmax and log_softmax compute exp and log with libdevice's `expf` / `logf`; `tl.exp` / `tl.log` lower to
the faster approximate instructions, which differ in the last bits. Kernels that claim HF's rounding pass
`ACCURATE=True` on the GPU. Triton's interpreter has no libdevice: there `ACCURATE` is False and NumPy's exp and log
(correctly rounded in practice) stand in.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def exp_as_torch(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log_as_torch(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.log(x)
    else:
        return tl.log(x)
