"""`moe_experts`: FP4 dequant -> grouped GEMM -> SwiGLU -> grouped GEMM -> combine -> one expert pipeline.

The matcher for this family has not landed yet: the pass is registered (so flags, the report and the
cache key already know it) and matches nothing; the report says so.
"""

NAME = "moe_experts"
IMPLEMENTED = False
