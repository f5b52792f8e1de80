"""Every `dsfuse::*` custom op has a fuzz test: a new op fails here until one is added (see fuzz_support)."""

import re
from pathlib import Path

import torch

from dsfuse.kernels import register_all


def test_every_custom_op_is_fuzzed():
    register_all()
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("dsfuse::")}
    sources = "".join(path.read_text() for path in Path(__file__).parent.glob("test_*.py"))
    fuzzed = set(re.findall(r'@fuzzes\(([^)]*)\)', sources))
    fuzzed = {name for group in fuzzed for name in re.findall(r'"(dsfuse::\w+)"', group)}
    assert registered, "no dsfuse op registered"
    missing = sorted(registered - fuzzed)
    assert not missing, f"custom ops without a fuzz test (add a strategy and a @fuzzes test): {missing}"
