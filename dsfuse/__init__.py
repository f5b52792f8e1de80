"""dsfuse: a torch.compile backend for DeepSeek sparse-attention MoE models.

    model = torch.compile(model, backend="dsfuse")                       # all passes
    model = torch.compile(model, backend="dsfuse", options={"disable": ["moe_experts"]})
    dsfuse.reset_report(); model(x); print(dsfuse.report())

The backend itself is registered through the `torch_dynamo_backends` entry point, so
`backend="dsfuse"` works without importing this package.
"""

from . import hf_fp8
from .backend import dsfuse_backend
from .config import ENV_DISABLE, ENV_ENABLE, OPTION_NAMES, PASS_NAMES, DsfuseConfigError
from .report import NearMiss, Report, Site, report, reset_report

__version__ = "0.1.0"

hf_fp8.install_when_loaded()

__all__ = [
    "ENV_DISABLE", "ENV_ENABLE", "OPTION_NAMES", "PASS_NAMES", "DsfuseConfigError", "NearMiss", "Report", "Site",
    "dsfuse_backend", "report", "reset_report",
]
