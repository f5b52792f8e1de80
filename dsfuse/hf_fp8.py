"""dsfuse's implementation of transformers' `finegrained-fp8` hub kernel, so that released FP8 / FP4 checkpoints
run (eagerly and under `torch.compile`) without the `kernels` package, without a download, and with ops dsfuse's
passes own.

transformers' `FP8Linear`, `FP8GroupedLinear` and `FP8Experts` (`integrations/finegrained_fp8.py`) call three entry
points of that kernel: `matmul_2d`, `matmul_batched` and `matmul_grouped`. `install()` (run by `import dsfuse`)
hands transformers dsfuse's versions of the three, built on `torch.ops.dsfuse.fp8_linear` and
`fp8_grouped_linear`, unless `DSFUSE_FP8_KERNELS=hub` asks to keep the hub's: at once when transformers' FP8 module
is loaded already, else when transformers loads it (for a quantised checkpoint), so `import dsfuse` does not
import transformers. With dsfuse's, transformers' own DeepGEMM preference for plain linears is switched off
(`TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR=1`, unless the user set it), so every quantised linear reaches dsfuse's ops.
A model loaded with a tensor-parallel plan is checked after loading: a shard that cuts a weight's scale blocks is
refused (`check_sharded_blocks`), since transformers would hand that rank scales that are not its rows'.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

import torch

ENV_KERNELS = "DSFUSE_FP8_KERNELS"
KERNEL_CHOICES = ("dsfuse", "hub")
DEEPGEMM_LINEAR_ENV = "TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR"
DEFAULT_BLOCK = 128


def _blocks(weight: torch.Tensor, scale: torch.Tensor, block_size) -> tuple[torch.Tensor, int, int]:
    """(scale, block_n, block_k) as dsfuse's ops take them: FP4 weights carry their per-32 scales and quantise
    activations per 128 channels; FP8 weights without a block size are one block (a per-tensor scale)."""
    from dsfuse.kernels.fp8_linear import weight_dims

    N, K = weight_dims(weight)
    if weight.dtype in (torch.int8, torch.uint8):
        return scale, DEFAULT_BLOCK, DEFAULT_BLOCK
    if block_size is None:
        lead = scale.shape[:-2] if scale.dim() > 2 else weight.shape[:-2]
        return scale.reshape(*lead, 1, 1), N, K
    return scale, int(block_size[0]), int(block_size[1])


def _static_scale_refused(activation_scale) -> None:
    if activation_scale is not None:
        raise NotImplementedError("dsfuse's FP8 linears quantise activations dynamically (per token and 128 "
                                  "channels); static activation scales (activation_scheme='static') are not supported")


def matmul_2d(input, weight, weight_scale_inv, block_size, output_dtype=None, activation_scale=None):
    """`input [..., K]` through a block-scaled FP8 (or FP4) weight `[N, K]`: `torch.ops.dsfuse.fp8_linear`."""
    _static_scale_refused(activation_scale)
    scale, block_n, block_k = _blocks(weight, weight_scale_inv, block_size)
    out = torch.ops.dsfuse.fp8_linear(input, weight, scale, block_n, block_k)
    return out if output_dtype in (None, out.dtype) else out.to(output_dtype)


def matmul_grouped(input, weight, weight_scale_inv, offsets=None, tokens_per_expert=None, block_size=None,
                   activation_scale=None):
    """Rows of `input [S, K]` sorted by expert through their expert's weight `[E, N, K]`, `offsets` the running row
    totals: `torch.ops.dsfuse.fp8_grouped_linear` (rows past `offsets[-1]`, expert-parallel sentinels, are 0)."""
    _static_scale_refused(activation_scale)
    scale, block_n, block_k = _blocks(weight, weight_scale_inv, block_size)
    return torch.ops.dsfuse.fp8_grouped_linear(input, weight, scale, offsets, block_n, block_k)


def matmul_batched(input, weight, weight_scale_inv, block_size=None, expert_ids=None, activation_scale=None):
    """Row i of `input [S, K]` through expert `expert_ids[i]`'s weight (ids of other ranks' experts, >= E, give 0):
    the rows sorted by expert on the device, the grouped op, and the order restored; no host sync."""
    experts = weight.shape[0]
    ids = expert_ids.reshape(-1)
    order = torch.argsort(ids, stable=True)
    local = ids < experts
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids.clamp(max=experts - 1).to(torch.int64), local.to(torch.int64))
    grouped = matmul_grouped(input[order], weight, weight_scale_inv, offsets=counts.cumsum(0).to(torch.int32),
                             block_size=block_size, activation_scale=activation_scale)
    return torch.empty_like(grouped).index_copy_(0, order, grouped)


def _scale_block_per_dim(module: torch.nn.Module, weight: torch.Tensor) -> dict[int, int]:
    """How many of `weight`'s elements along each of its last two dims share one scale: the block size for FP8,
    one row and 32 values (16 packed bytes) for FP4."""
    from dsfuse.kernels.quant_formats import FP4_BLOCK

    if weight.dtype in (torch.int8, torch.uint8):
        return {weight.dim() - 2: 1, weight.dim() - 1: FP4_BLOCK // 2}
    block_size = getattr(module, "block_size", None)
    if block_size is None:  # one scale for the whole weight, replicated
        return {}
    return {weight.dim() - 2: int(block_size[0]), weight.dim() - 1: int(block_size[1])}


def sharded_block_misfits(model: torch.nn.Module) -> list[str]:
    """Each quantised weight that a tensor-parallel plan splits off its scale blocks, in words.

    transformers shards a block-scaled weight and its scales by the same even split, so a rank's scales are the
    scales of its rows only when every rank's share starts on a block boundary; otherwise some rank's weight would
    be scaled by another block's scales (or by none: transformers then hands it an empty scale tensor)."""
    from torch.distributed.tensor import DTensor, Shard

    misfits = []
    for name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not isinstance(param, DTensor) or param.dtype not in (torch.float8_e4m3fn, torch.int8, torch.uint8):
                continue
            blocks = _scale_block_per_dim(module, param)
            ranks = param.device_mesh.size()
            for placement in param.placements:
                if not isinstance(placement, Shard):
                    continue
                dim = placement.dim % param.dim()
                block = blocks.get(dim, 1)
                segment = param.shape[dim] // getattr(placement, "split_factor", 1)
                per_rank = -(-segment // ranks)
                if ranks > 1 and block > 1 and (segment % block or per_rank % block):
                    unit = " bytes (two FP4 values a byte)" if param.dtype != torch.float8_e4m3fn else ""
                    misfits.append(f"{name}.{param_name} {tuple(param.shape)} ({param.dtype}): dim {dim} is split "
                                   f"{per_rank} per rank over {ranks} ranks, not whole blocks of {block}{unit}")
    return misfits


def check_sharded_blocks(model: torch.nn.Module) -> None:
    """Refuse a model whose tensor-parallel shards cut through FP8 / FP4 scale blocks (`sharded_block_misfits`)."""
    misfits = sharded_block_misfits(model)
    if misfits:
        raise ValueError("tensor parallelism cuts these quantised weights inside their scale blocks; transformers "
                         "splits the scales evenly as well, so a rank would scale rows by another block's scales. "
                         "Use fewer ranks (each rank's share a whole number of blocks) or no tp_plan:\n  "
                         + "\n  ".join(misfits))


def _checked_after_loading(after_loading):
    """transformers' FP8 quantizer's post-load step, then `check_sharded_blocks` on the loaded model."""

    def after_loading_then_check(self, model, **kwargs):
        model = after_loading(self, model, **kwargs)
        check_sharded_blocks(model)
        return model

    after_loading_then_check.checks_sharded_blocks = True
    return after_loading_then_check


def kernels_choice(environ=None) -> str:
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV_KERNELS, "dsfuse").strip().lower() or "dsfuse"
    if choice not in KERNEL_CHOICES:
        from .config import DsfuseConfigError

        raise DsfuseConfigError(f"unknown {ENV_KERNELS}={choice!r}; valid: {', '.join(KERNEL_CHOICES)}")
    return choice


FP8_MODULE = "transformers.integrations.finegrained_fp8"


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Runs `install()` right after transformers' FP8 module is first imported."""

    def find_spec(self, name, path, target=None):
        if name != FP8_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            install()

        spec.loader.exec_module = exec_then_install
        return spec


def install_when_loaded() -> None:
    """`install()` now if transformers' FP8 module is loaded, else as soon as it is (what `import dsfuse` runs)."""
    if FP8_MODULE in sys.modules:
        install()
    elif not any(isinstance(finder, _InstallOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallOnImport())


def install() -> bool:
    """Hand transformers dsfuse's FP8 entry points and check each loaded model's tensor-parallel shards
    (`check_sharded_blocks`), once; a no-op without transformers, or with `DSFUSE_FP8_KERNELS=hub`. Returns whether
    dsfuse's entry points are the ones transformers will call."""
    if kernels_choice() == "hub":
        return False
    try:
        from transformers.integrations import finegrained_fp8
        from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    except ImportError:
        return False
    import dsfuse.kernels.fp8_linear  # noqa: F401  (registers the ops)

    if not installed():
        finegrained_fp8._FINEGRAINED_FP8 = finegrained_fp8.FineGrainedFP8(
            matmul=matmul_2d, batched_matmul=matmul_batched, grouped_matmul=matmul_grouped)
    after_loading = FineGrainedFP8HfQuantizer._process_model_after_weight_loading
    if not getattr(after_loading, "checks_sharded_blocks", False):
        FineGrainedFP8HfQuantizer._process_model_after_weight_loading = _checked_after_loading(after_loading)
    os.environ.setdefault(DEEPGEMM_LINEAR_ENV, "1")
    return True


def installed() -> bool:
    """Whether transformers currently calls dsfuse's FP8 entry points."""
    try:
        from transformers.integrations import finegrained_fp8
    except ImportError:
        return False
    current = finegrained_fp8._FINEGRAINED_FP8
    return current is not None and current.matmul is matmul_2d


__all__ = ["ENV_KERNELS", "KERNEL_CHOICES", "check_sharded_blocks", "install", "install_when_loaded", "installed",
           "kernels_choice", "matmul_2d", "matmul_batched", "matmul_grouped", "sharded_block_misfits"]
