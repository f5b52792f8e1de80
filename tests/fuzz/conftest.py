"""Hypothesis profiles for the fuzz suite: `ci` (the default: few examples, derandomised so CI is reproducible)
and `gpu` (more examples, random, for the H200 session), chosen by DSFUSE_FUZZ_PROFILE."""

import os

from hypothesis import HealthCheck, Phase, settings

_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
# CI and the GPU session report a failing example as drawn: shrinking through interpreted kernels can take minutes.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
settings.register_profile("ci", max_examples=6, deadline=None, derandomize=True, print_blob=True, phases=NO_SHRINK,
                          suppress_health_check=_SLOW_IS_FINE)
settings.register_profile("dev", max_examples=40, deadline=None, print_blob=True, suppress_health_check=_SLOW_IS_FINE)
# gpu: random examples on the H200, ~25 s a test. Most examples draw a new shape, and a new shape compiles the op's
# Triton kernels (~1 s an example there), so 20 examples take ~20 s, with the rest of the 25 s for the first
# example's cold start. 300 never finished (19 tests in a 4-5 minute step); benchmarks/op_fuzz_gpu.py runs each file
# under its own time limit and tabulates the examples run.
settings.register_profile("gpu", max_examples=20, deadline=None, print_blob=True, phases=NO_SHRINK,
                          suppress_health_check=_SLOW_IS_FINE)
settings.load_profile(os.environ.get("DSFUSE_FUZZ_PROFILE", "ci"))
