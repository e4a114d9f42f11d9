"""What a benchmark's numbers were measured on: the CPU, its flags, memory, versions, threads, load average and
the git commit (`machine_info`), and the lines a script prints about it (`print_machine`)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import psutil

from harness import ROOT

__all__ = ["VERSIONED_PACKAGES", "machine_info", "print_machine"]

VERSIONED_PACKAGES = (
    "onecopy", "torch", "iree-base-compiler", "iree-base-runtime", "iree-turbine", "onnxruntime", "onnx",
    "onnxscript", "numpy",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Hardware", "CPU part")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags_of_interest() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "amx_tile", "neon",
                              "asimd", "sve")
                    return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return {"commit": commit or None, "src_modified": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "src_modified": None}


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on. Load averages say whether something else ran at the same time."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    threads: dict[str, Any] = {"onnxruntime_intra_op": "default (0: one per physical core)",
                               "iree_local_task": "default topology"}
    if "torch" in sys.modules:
        threads["torch"] = sys.modules["torch"].get_num_threads()
    return {
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags_of_interest(),
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "memory_bytes": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in VERSIONED_PACKAGES},
        "threads": threads,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git": _git(),
    }


def print_machine(info: Mapping[str, Any]) -> None:
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    print(f"machine: {info['cpu_model']} ({info['machine']}), {info['usable_cpus']} usable CPUs; {info['python']}")
    print(f"versions: {versions}")
    print(f"load average at start: {', '.join(f'{x:.2f}' for x in info['load_average'] or [])}")
