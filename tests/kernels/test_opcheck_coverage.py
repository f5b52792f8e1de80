"""Every `dsfuse::*` custom op is `opcheck`ed (its fake outputs against its real ones: shapes, strides, aliasing):
a new op fails here until a kernel test calls `torch.library.opcheck` on it."""

import ast
from pathlib import Path

import torch

from dsfuse.kernels import register_all


def _names_in_opcheck_tests() -> set[str]:
    """The names and attributes used inside every test function of tests/kernels that calls `opcheck`."""
    names = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            used |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if "opcheck" in used:
                names |= used
    return names


def test_every_custom_op_is_opchecked():
    register_all()
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("dsfuse::")}
    assert registered, "no dsfuse op registered"
    missing = sorted(registered - _names_in_opcheck_tests())
    assert not missing, f"custom ops no kernel test opchecks (fake against real outputs): {missing}"
