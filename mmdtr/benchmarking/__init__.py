"""Helpers of ``tools/benchmark.py``: workloads, runs, reports.

Importing this package imports no plotting library; :mod:`.plots` needs
matplotlib (``pip install -e .[bench]``).
"""
from .largest_batch import largest_fitting
from .launch import LAUNCHERS, Launcher, Progress
from .suite import ALTERNATIVES, BenchmarkSuite
from .worker import make_spec, run_spec
from .workloads import (DEFAULT_BLOCKS, NO_EVICTION, OPTIMIZERS, TECHNIQUES,
                        Workload, apply_technique, block_names, check_workload,
                        checkpoint_segments, load_config, split_even)

__all__ = [
    'LAUNCHERS', 'Launcher', 'Progress', 'ALTERNATIVES', 'BenchmarkSuite',
    'largest_fitting', 'make_spec', 'run_spec', 'DEFAULT_BLOCKS',
    'NO_EVICTION', 'OPTIMIZERS', 'TECHNIQUES', 'Workload', 'apply_technique',
    'block_names', 'check_workload', 'checkpoint_segments', 'load_config',
    'split_even'
]
