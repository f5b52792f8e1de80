"""Offline sm_90 compiles for the kernel tests: what the H200 runs, compiled on a machine without a GPU.

The probes run in a subprocess without TRITON_INTERPRET (the interpreter replaces the JIT functions
`triton.compile` needs); `run_probe` starts one and `compile_sm90` is what its script calls.
"""

import json
import os
import subprocess
import sys

import pytest


# The start of every probe script: the probe's directory on the path (this module), and a skip line when this Triton
# has no offline compile API.
PROBE_PREAMBLE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
try:
    import triton
    from triton.backends.compiler import GPUTarget  # noqa: F401 (the offline compile API)
    from triton.compiler import ASTSource  # noqa: F401
except ImportError as error:
    print(json.dumps({"skip": f"no offline compile API in this triton: {error}"}))
    sys.exit(0)
import sm90_offline
"""


def compile_sm90(fn, constexprs, ints, options, pointer_type, scalars=None):
    """Compile a Triton kernel for sm_90 with its integer arguments specialised as Triton's launcher does (== 1 becomes
    a constant, multiples of 16 get the divisibility hint), every pointer 16-byte aligned; `pointer_type(name)` gives
    a pointer argument's type and `scalars` the type of each non-integer scalar (default i32)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_type(name)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif scalars and name in scalars:
            signature[name] = scalars[name]
        elif ints[name] == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def run_probe(script, timeout, env_defaults=None):
    """Run a probe script (it prints one JSON object a line, `{"skip": why}` first when this Triton has no offline
    compile API) and return its lines; skips the test in that case."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for name, value in (env_defaults or {}).items():
        env.setdefault(name, value)
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", script, here], capture_output=True, text=True, env=env, check=False,
                         timeout=timeout)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    if "skip" in lines[0]:
        pytest.skip(lines[0]["skip"])
    return lines
