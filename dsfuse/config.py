"""Backend options: which passes run, and what else is forwarded to Inductor.

Options come from `torch.compile(..., options={...})` and from the environment variables
`DSFUSE_ENABLE` / `DSFUSE_DISABLE` (comma lists). Every name is checked: a typo raises instead of
silently running a different ablation than the one asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

PASS_NAMES: tuple[str, ...] = ("norm_rope_quant", "indexer_topk", "sparse_attention", "moe_experts",
                               "hyper_connections", "compressors")

OPTION_NAMES: tuple[str, ...] = ("enable", "disable", "inductor", "mode", "cudagraphs")
# `options={"cudagraphs": ...}` under "reduce-overhead": "all" graphs (the default) or only "decode" steps (graphs of
# at most DECODE_MAX_TOKENS query tokens), so prefill graphs, GPU-bound anyway, run without a CUDA graph.
CUDAGRAPH_CHOICES: tuple[str, ...] = ("all", "decode")
DECODE_MAX_TOKENS = 64

ENV_ENABLE = "DSFUSE_ENABLE"
ENV_DISABLE = "DSFUSE_DISABLE"
# Set to 1 to also log, on the `dsfuse` logger, every candidate a family rejected without reporting it.
ENV_DEBUG = "DSFUSE_DEBUG"


def _raised_through_dynamo() -> tuple[type, ...]:
    """The base that makes Dynamo hand a backend's exception to the caller as it is (torch 2.11 - 2.14:
    `ShortenTraceback`), rather than wrapped in `BackendCompilerFailed`, which `except DsfuseConfigError` misses."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:
        return ()
    return (ShortenTraceback,)


class DsfuseConfigError(*_raised_through_dynamo(), ValueError):
    """A backend option, pass name or environment variable that dsfuse does not know. Raised at the first call of
    the compiled model (torch.compile looks the options at only then), as itself: `except dsfuse.DsfuseConfigError`
    catches it there."""

    def __init__(self, message: str):
        self.message = message
        if _raised_through_dynamo():
            super().__init__(message, first_useful_frame=None)
        else:
            super().__init__(message)

    def __str__(self) -> str:  # without the hints Dynamo appends to the arguments for PyTorch's own errors
        return self.message


@dataclass(frozen=True)
class BackendConfig:
    """The resolved configuration for one compilation."""

    enabled: tuple[str, ...]
    inductor_options: Mapping[str, Any] = field(default_factory=dict)
    mode: str | None = None
    cudagraphs: str = "all"

    def is_enabled(self, name: str) -> bool:
        return name in self.enabled


def debug_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `DSFUSE_DEBUG` asks for the silent rejections too (read at each compile, not at import)."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV_DEBUG, "").strip().lower() not in ("", "0", "false", "no", "off")


def _as_names(value: Any, source: str) -> list[str]:
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, Iterable):
        names = list(value)
    else:
        raise DsfuseConfigError(f"{source} must be a list of pass names or a comma-separated string, got {value!r}")
    for name in names:
        if not isinstance(name, str) or name not in PASS_NAMES:
            raise DsfuseConfigError(
                f"unknown dsfuse pass {name!r} in {source}; valid pass names: {', '.join(PASS_NAMES)}"
            )
    return names


def resolve_config(options: Mapping[str, Any] | None = None, mode: str | None = None,
                   environ: Mapping[str, str] | None = None) -> BackendConfig:
    """Combine `options` with the environment into the set of passes to run.

    `enable` keeps only the named passes, `disable` removes the named ones; both may come from the
    options dict or the environment, and all of them apply (the most restrictive result wins).
    """
    options = dict(options or {})
    environ = os.environ if environ is None else environ
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise DsfuseConfigError(
            f"unknown dsfuse option(s) {', '.join(map(repr, unknown))}; valid options: {', '.join(OPTION_NAMES)}"
        )
    enabled = list(PASS_NAMES)
    for source, value in (
        ("options['enable']", options.get("enable")),
        (ENV_ENABLE, environ.get(ENV_ENABLE)),
    ):
        if value is not None:
            keep = set(_as_names(value, source))
            enabled = [name for name in enabled if name in keep]
    for source, value in (
        ("options['disable']", options.get("disable")),
        (ENV_DISABLE, environ.get(ENV_DISABLE)),
    ):
        if value is not None:
            drop = set(_as_names(value, source))
            enabled = [name for name in enabled if name not in drop]
    inductor_options = options.get("inductor") or {}
    if not isinstance(inductor_options, Mapping):
        raise DsfuseConfigError(f"options['inductor'] must be a dict of Inductor config values, got {inductor_options!r}")
    mode = options.get("mode", mode)
    if mode not in (None, "default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"):
        raise DsfuseConfigError(
            f"unknown mode {mode!r}; valid modes: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs"
        )
    cudagraphs = options.get("cudagraphs", "all")
    if cudagraphs not in CUDAGRAPH_CHOICES:
        raise DsfuseConfigError(f"unknown cudagraphs choice {cudagraphs!r}; valid: {', '.join(CUDAGRAPH_CHOICES)}")
    return BackendConfig(enabled=tuple(enabled), inductor_options=dict(inductor_options), mode=mode,
                         cudagraphs=cudagraphs)
