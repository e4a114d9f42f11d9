"""Shared helpers of the benchmark scripts, under the one name every script imports (`import common`): they live
in `harness/`, one job a module, and are re-exported here.

Every script measures onecopy and its peers side by side in ONE process run: the peers are timed in interleaved
rounds (the order is shuffled each round), after a warm-up, and each reported time is the median of many calls.
Ratios are paired (`paired_ratio`): onecopy's median over the peer's within each round, then the median over the
rounds (below 1: onecopy is faster); the ratio of the overall medians is recorded beside it. Nothing here knows a
result in advance.

A script imports this module as `common` (it runs as `python benchmarks/<name>.py`, so benchmarks/ is on sys.path).
"""

from __future__ import annotations

import warnings

from harness import RESULTS_DIR, ROOT
from harness.cpu import CpuSnapshot, cpu_snapshot, foreign_cpu, wait_quiet
from harness.machine import VERSIONED_PACKAGES, machine_info, print_machine
from harness.peers import OnecopyMethod, OnnxRuntime, OnnxRuntimeDecoder, TorchEager, max_abs_diff
from harness.process_memory import SMAPS_FIELDS, smaps_rollup
from harness.raw_iree import ENCODED_SCOPE, RawIree, RawIreeInPlace, engine_device, engine_driver
from harness.results import BenchmarkRun, _jsonable, parse_args, results_path, write_results
from harness.tables import fmt_bytes, fmt_ms, fmt_ratio, mib, print_table
from harness.targets import TARGET_COLUMNS, print_targets, target, target_row
from harness.timing import (Stats, Stopwatch, _stats, measure, measure_alternating, measure_blocks, median,
                            paired_difference_ms, paired_interval, paired_ratio, settle)
from harness.workspace import (cache_entries, collect_load_states, isolated_cache, run_script, specializations,
                               temp_workdir)

__all__ = [
    "ROOT", "RESULTS_DIR", "CpuSnapshot", "cpu_snapshot", "foreign_cpu", "wait_quiet", "VERSIONED_PACKAGES",
    "machine_info", "print_machine", "OnecopyMethod", "OnnxRuntime", "OnnxRuntimeDecoder", "TorchEager",
    "max_abs_diff", "SMAPS_FIELDS", "smaps_rollup", "ENCODED_SCOPE", "RawIree", "RawIreeInPlace", "engine_device",
    "engine_driver", "BenchmarkRun", "parse_args", "results_path", "write_results", "fmt_bytes", "fmt_ms", "fmt_ratio", "mib", "print_table",
    "TARGET_COLUMNS", "print_targets", "target", "target_row", "Stats", "Stopwatch", "measure",
    "measure_alternating", "measure_blocks", "median", "settle", "paired_difference_ms", "paired_interval", "paired_ratio",
    "cache_entries",
    "collect_load_states", "isolated_cache", "run_script", "specializations", "temp_workdir", "_jsonable", "_stats",
]

# torch.onnx (TorchScript exporter), torch.export and iree-turbine warn a lot about their own internals; the
# benchmarks' output is a table, not their deprecation notices.
for _category in (DeprecationWarning, FutureWarning, UserWarning):
    warnings.filterwarnings("ignore", category=_category)
