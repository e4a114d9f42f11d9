"""One run of a benchmark script: its command line (`parse_args`), and the results JSON it writes (`write_results`,
`BenchmarkRun`): the machine, the run (date, command, duration, others' CPU), then the script's payload."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness import RESULTS_DIR, ROOT
from harness.cpu import CpuSnapshot, cpu_snapshot, foreign_cpu, wait_quiet
from harness.machine import machine_info, print_machine
from harness.timing import Stats

__all__ = ["parse_args", "results_path", "write_results", "BenchmarkRun"]


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true",
                        help="a short smoke run (fewer rounds/repetitions), written to results/<name>.quick.json")
    parser.add_argument("--output", type=Path, default=None,
                        help="where to write the results JSON (default: benchmarks/results/<name>.json)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="first wait up to SECONDS for other processes to leave the CPUs idle")
    args = parser.parse_args(argv)
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet)
    return args


def _jsonable(value: Any) -> Any:
    if isinstance(value, Stats):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return round(value, 6)
    return value


def results_path(name: str, quick: bool) -> Path:
    return RESULTS_DIR / (f"{name}.quick.json" if quick else f"{name}.json")


def _relative(path: str) -> str:
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path


def _compact_number_lists(text: str) -> str:
    """Indented JSON with each list of plain numbers on one line: per-round times run to thousands of entries."""
    return re.sub(r"\[\s*(-?[0-9][-+0-9.eE]*(?:,\s*-?[0-9][-+0-9.eE]*)*)\s*\]",
                  lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text)


def write_results(name: str, payload: Mapping[str, Any], *, machine: Mapping[str, Any], quick: bool,
                  started: float, output: Path | None = None, cpu_start: CpuSnapshot | None = None) -> Path:
    """Write benchmarks/results/<name>.json atomically: machine, run info, then the script's payload. A quick
    (smoke) run writes <name>.quick.json instead, so it never replaces a real result."""
    path = output or results_path(name, quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", _relative(sys.argv[0]), *sys.argv[1:]]),
        "quick": quick,
        "duration_s": time.perf_counter() - started,
        "machine": dict(machine),
        "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "other_processes_cpu": foreign_cpu(cpu_start) if cpu_start is not None else None,
        **payload,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(_compact_number_lists(json.dumps(_jsonable(document), indent=2)) + "\n")
    os.replace(tmp, path)
    if cpu_start is not None:
        seen = foreign_cpu(cpu_start)
        print(f"\nother processes used {seen['fraction']:.0%} of the CPUs during this run"
              + (" (a contended machine: treat these numbers with care)" if seen["fraction"] > 0.1 else ""))
    print(f"\nwrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path


class BenchmarkRun:
    """One run of a benchmark script: its command line, clocks and machine, and the results file it writes.

        run = common.BenchmarkRun("frames", __doc__)   # parses --quick/--output/--wait-quiet, starts the clocks
        import torch ...                               # the script's heavy imports
        run.describe_machine()                         # after them: records e.g. torch's thread count
        run.write({...})                               # benchmarks/results/frames.json (or .quick.json)
    """

    def __init__(self, name: str, doc: str | None, argv: Sequence[str] | None = None) -> None:
        self.name = name
        self.args = parse_args((doc or name).splitlines()[0], argv)
        self.quick: bool = self.args.quick
        self.started = time.perf_counter()
        self.cpu_start = cpu_snapshot()
        self.machine: dict[str, Any] | None = None

    def describe_machine(self) -> dict[str, Any]:
        self.machine = machine_info()
        print_machine(self.machine)
        return self.machine

    def write(self, payload: Mapping[str, Any]) -> Path:
        return write_results(self.name, payload, machine=self.machine or machine_info(), quick=self.quick,
                             started=self.started, output=self.args.output, cpu_start=self.cpu_start)
