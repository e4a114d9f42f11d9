"""How busy other processes keep the CPUs while a benchmark runs: a run with a high share measured a contended
machine, and its absolute times (even its ratios) are suspect. See benchmarks/README.md, "Other processes"."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

__all__ = ["CpuSnapshot", "cpu_snapshot", "foreign_cpu", "wait_quiet"]


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float
    busy: float  # CPU-seconds all processes of the machine spent (steal included)
    ours: float  # CPU-seconds this process and its waited-for children spent


def cpu_snapshot() -> CpuSnapshot:
    machine = psutil.cpu_times()
    # Busy is everything but idle and iowait. guest and guest_nice are already inside user and nice.
    busy = machine.user + machine.nice + machine.system + machine.irq + machine.softirq + machine.steal
    mine = psutil.Process().cpu_times()
    ours = mine.user + mine.system + mine.children_user + mine.children_system
    return CpuSnapshot(time.perf_counter(), busy, ours)


def foreign_cpu(start: CpuSnapshot, end: CpuSnapshot | None = None) -> dict[str, float]:
    """How busy OTHER processes kept the CPUs between two snapshots: `fraction` 0 (idle) .. 1 (every CPU busy).
    A run with a high fraction measured a contended machine; its absolute times and even ratios are suspect."""
    end = end or cpu_snapshot()
    wall = max(end.wall - start.wall, 1e-9)
    foreign = max(0.0, (end.busy - start.busy) - (end.ours - start.ours))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"seconds": wall, "foreign_cpu_seconds": foreign, "fraction": foreign / (wall * cpus)}


def wait_quiet(limit_s: float, *, threshold: float = 0.1, window_s: float = 2.0) -> dict[str, float]:
    """Wait (up to `limit_s`) until other processes use less than `threshold` of the CPUs over `window_s`."""
    deadline = time.monotonic() + limit_s
    while True:
        start = cpu_snapshot()
        time.sleep(window_s)
        seen = foreign_cpu(start)
        if seen["fraction"] < threshold or time.monotonic() >= deadline:
            quiet = seen["fraction"] < threshold
            print(f"{'quiet' if quiet else 'still busy'}: other processes used {seen['fraction']:.0%} of the CPUs")
            return seen
        print(f"waiting for a quiet machine: other processes use {seen['fraction']:.0%} of the CPUs", flush=True)
