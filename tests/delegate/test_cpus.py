"""The CPUs a process may use: affinity, physical cores and cgroup CPU quotas (v1 and v2), read from fake trees."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from onecopy.delegate import cpus
from onecopy.delegate.cpus import cpu_quota, physical_cores, worker_count


def tree(tmp_path: Path, files: dict[str, str], self_cgroup: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self").write_text(self_cgroup)
    return root, tmp_path / "self"


def test_a_v2_quota_is_the_tightest_limit_from_the_cgroup_up(tmp_path):
    root, own = tree(tmp_path, {
        "cpu.max": "max 100000\n",
        "kubepods/cpu.max": "400000 100000\n",       # 4 CPUs for the pod
        "kubepods/app/cpu.max": "150000 100000\n",   # 1.5 for the container
    }, "0::/kubepods/app\n")
    assert cpu_quota(root, own) == 1.5


@pytest.mark.parametrize("text", ["max 100000\n", "max\n"])
def test_no_v2_limit_is_none(tmp_path, text):
    root, own = tree(tmp_path, {"app/cpu.max": text}, "0::/app\n")
    assert cpu_quota(root, own) is None


def test_a_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    root, own = tree(tmp_path, {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "memory/docker/abc/memory.limit_in_bytes": "1073741824\n",
    }, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n")
    assert cpu_quota(root, own) == 0.5


@pytest.mark.parametrize("files, self_cgroup", [
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu:/\n"),
    ({"cpu/cpu.cfs_quota_us": "garbage\n", "cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu:/\n"),
    ({}, "0::/gone\n"),  # the cgroup's folder is not there: nothing read is nothing limited
    ({}, ""),
])
def test_no_readable_limit_is_none(tmp_path, files, self_cgroup):
    root, own = tree(tmp_path, files, self_cgroup)
    assert cpu_quota(root, own) is None


def test_an_unreadable_proc_file_is_none(tmp_path):
    assert cpu_quota(tmp_path, tmp_path / "missing") is None


@pytest.mark.parametrize("quota, expected", [(None, 8), (0.5, 1), (1.5, 2), (3.0, 3), (64.0, 8)])
def test_the_workers_are_the_cores_within_the_quota(monkeypatch, quota, expected):
    monkeypatch.setattr(cpus, "physical_cores", lambda: 8)
    monkeypatch.setattr(cpus, "cpu_quota", lambda: quota)
    assert worker_count() == expected


def test_physical_cores_count_the_cpus_of_the_affinity_only():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    one = min(os.sched_getaffinity(0))
    # In a child: its affinity is set before it counts, and this process's is left alone.
    code = f"import os; os.sched_setaffinity(0, {{{one}}}); from onecopy.delegate.cpus import physical_cores; print(physical_cores())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))
