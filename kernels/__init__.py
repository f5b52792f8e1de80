"""dsfuse's fused kernels, each a `torch.ops.dsfuse.*` custom op with a reference implementation beside it."""

import importlib

FAMILY_MODULES = ("indexer_topk", "sparse_attention", "compressed_attention", "moe_experts", "norm_rope_quant",
                  "hyper_connections", "compressor", "fp8_linear", "moe_experts_fp8")


def register_all() -> None:
    """Import every kernel family so its custom ops exist, also when Inductor's cache serves a graph
    that calls them without running the passes that would have imported them."""
    for name in FAMILY_MODULES:
        importlib.import_module(f"{__name__}.{name}")
