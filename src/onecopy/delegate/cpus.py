"""The CPUs this process may use, and so how many task workers the engine starts.

IREE picks one worker per physical core of the machine. What a process may really use is often less: its CPU
affinity (`taskset`, cpusets) and, in containers (Docker `--cpus`, Kubernetes limits), a cgroup CPU quota. A
worker beyond the quota does not add compute: the group is throttled for the rest of each period once the quota
is used, so a call that fanned out over more workers than the quota allows stalls until the next period
(100 ms by default). ONNX Runtime and Go's runtime size their thread pools by the quota for this reason.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["cpu_quota", "physical_cores", "worker_count"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (its affinity): the worker count IREE itself picks."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology in sysfs (containers, some VMs): count the CPU itself
    return max(len(cores), 1)


def cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time per period this process's cgroup may use (2.5 for `docker run --cpus 2.5`), the
    tightest limit on the way from its cgroup up to the root; None when nothing limits it or it cannot be read.
    Reads cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us` of the cpu controller)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hierarchy or not path.startswith("/"):
            continue
        if controllers == "":  # v2: the unified hierarchy, mounted at the root itself
            base, read = root, _v2_limit
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            base, read = root / controllers, _v1_limit
            if not base.is_dir():
                base = root / "cpu"
        else:
            continue
        folder = base / path.lstrip("/")
        while True:
            limit = read(folder)
            if limit is not None:
                limits.append(limit)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return min(limits) if limits else None


def worker_count() -> int:
    """Task workers for this process: one per physical core it may run on, no more than its CPU quota allows
    (rounded up: a quota of 1.5 CPUs still runs two workers half the time)."""
    cores = physical_cores()
    quota = cpu_quota()
    if quota is None:
        return cores
    return max(1, min(cores, math.ceil(quota)))


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
    except OSError:
        return None
    return _ratio(quota, period or "100000")


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = (folder / "cpu.cfs_quota_us").read_text().strip()
        period = (folder / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    if quota in ("max", "-1"):
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
