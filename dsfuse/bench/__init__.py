"""Benchmarks: eager, Inductor and dsfuse side by side in one process (`python -m dsfuse.bench`, `dsfuse-bench`).

Imports go one way: `cli` (the command line) uses `model`, `families`, `generate` and `report`; those use `measure`
(configurations, timing, profiling, the environment line), and `model` and `families` use `report`.
"""

from dsfuse.bench.cli import main
from dsfuse.bench.measure import CONFIGS, environment, profile_stages, resolve_configs, time_ms
from dsfuse.bench.model import FilledCache, StaticFilledCache

__all__ = ["CONFIGS", "FilledCache", "StaticFilledCache", "environment", "main", "profile_stages", "resolve_configs",
           "time_ms"]
