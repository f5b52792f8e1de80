"""`norm_rope_quant`: RMSNorm / LayerNorm + RoPE + fp8 quantisation glue -> one launch per side.

The matcher for this family has not landed yet: the pass is registered (so flags, the report and the
cache key already know it) and matches nothing; the report says so.
"""

NAME = "norm_rope_quant"
IMPLEMENTED = False
