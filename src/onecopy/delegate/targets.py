"""Targets and compute units: which engine backend, driver and compiler flags run a bundle where.

A target is a name a user writes in `CompileSpec(targets=...)` (`x86_64`, `aarch64`, `vulkan`, `cuda`, `rocm`);
a compute unit is what they choose at export or load (`cpu`, `gpu`, `all`). One table maps both, so a new target
is one entry here, not a branch in five places.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass

from onecopy.errors import DelegateError, InvalidArgument

__all__ = [
    "COMPUTE_UNITS",
    "CPU_EXECUTORS",
    "runtime_driver",
    "Target",
    "TARGETS",
    "host_cpu_target",
    "available_compute_units",
    "select_target",
    "check_target_runs_here",
    "compiler_flags",
    "host_features",
    "cpu_flags",
]

log = logging.getLogger("onecopy")

COMPUTE_UNITS = ("cpu", "gpu", "all")


@dataclass(frozen=True)
class Target:
    name: str
    compute_unit: str  # cpu | gpu
    backend: str  # iree-compile --iree-hal-target-backends
    driver: str  # iree runtime HAL driver
    triple: str | None = None  # llvm-cpu target triple
    # AOT code for a CPU family is compiled for a baseline that still vectorizes (the generic target is 10-100x
    # slower); a device must have these /proc/cpuinfo flags to run it.
    aot_cpu: str | None = None
    aot_cpu_flags: tuple[str, ...] = ()


TARGETS: dict[str, Target] = {
    "x86_64": Target(
        "x86_64", "cpu", "llvm-cpu", "local-task", "x86_64-unknown-linux-gnu",
        aot_cpu="x86-64-v3", aot_cpu_flags=("avx2", "fma", "bmi2", "f16c"),
    ),
    "aarch64": Target("aarch64", "cpu", "llvm-cpu", "local-task", "aarch64-unknown-linux-gnu", aot_cpu="generic"),
    "vulkan": Target("vulkan", "gpu", "vulkan-spirv", "vulkan"),
    "cuda": Target("cuda", "gpu", "cuda", "cuda"),
    "rocm": Target("rocm", "gpu", "rocm", "hip"),
}

# How a CPU model runs its dispatches (backend option `executor`): "parallel" on IREE's task workers, one per core
# (local-task); "inline" on the calling thread alone (local-sync), no worker to wake or wait for. The same compiled
# code runs on both. "auto", the default, takes the one measured faster for the model's functions at
# specialization (onecopy.delegate.executors, where the figures that make neither right everywhere are).
CPU_EXECUTORS = {"parallel": "local-task", "inline": "local-sync"}

_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def host_cpu_target() -> Target:
    machine = platform.machine().lower()
    name = _MACHINE_ALIASES.get(machine, machine)
    if name not in TARGETS:
        raise DelegateError(f"This machine's CPU ({machine}) is not a supported target; onecopy runs on x86_64 and aarch64.")
    return TARGETS[name]


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo `flags` on x86, `Features` on Arm); empty where unreadable."""
    return _cpu_flags()


@functools.lru_cache(maxsize=None)
def _gpu_targets() -> tuple[Target, ...]:
    """GPU targets whose driver finds a device here. Probed once: creating drivers is slow."""
    import iree.runtime as ireert

    found = []
    available = set(ireert.query_available_drivers())
    for target in TARGETS.values():
        if target.compute_unit != "gpu" or target.driver not in available:
            continue
        try:
            if ireert.get_driver(target.driver).query_available_devices():
                found.append(target)
        except Exception as e:  # a driver without its system library raises; that unit is simply absent
            log.debug("GPU driver %s unavailable: %s", target.driver, e)
    return tuple(found)


def available_compute_units() -> tuple[str, ...]:
    return ("cpu", "gpu") if _gpu_targets() else ("cpu",)


def select_target(compute_units: str, where: str, *, candidates: tuple[str, ...] | None = None) -> Target:
    """The target that runs `compute_units` on this machine, among `candidates` (a vmfb bundle's targets) if given.

    `all` takes the best available: a GPU when there is one, else the CPU.
    """
    if compute_units not in COMPUTE_UNITS:
        raise InvalidArgument(
            f"{where}: unknown compute units '{compute_units}'; expected one of {', '.join(COMPUTE_UNITS)}."
        )
    # Probing GPU drivers costs milliseconds a warm CPU load should not pay: only look when a GPU may be used.
    have = ("cpu",) if compute_units == "cpu" else available_compute_units()
    if compute_units != "all" and compute_units not in have:
        raise DelegateError(
            f"{where}: compute units '{compute_units}' are not available on this machine; it has {', '.join(have)}. "
            "Pass backend option compute_units='cpu' (or 'all')."
        )
    ordered: list[Target] = []
    if compute_units in ("gpu", "all"):
        ordered.extend(_gpu_targets())
    if compute_units in ("cpu", "all"):
        ordered.append(host_cpu_target())
    if candidates is not None:
        ordered = [t for t in ordered if t.name in candidates]
        if not ordered:
            raise DelegateError(
                f"{where}: the program has code for {', '.join(sorted(candidates))} but this machine runs "
                f"{host_cpu_target().name} ({', '.join(have)}); re-export with targets including "
                f"'{host_cpu_target().name}' or packaging='mlir'."
            )
    return ordered[0]


def check_target_runs_here(target: Target, where: str) -> None:
    """AOT CPU code needs the CPU features it was compiled for: refuse it before it faults."""
    flags = _cpu_flags()
    missing = [flag for flag in target.aot_cpu_flags if flags and flag not in flags]
    if missing:
        raise DelegateError(
            f"{where}: the program's {target.name} code needs CPU features {', '.join(missing)} that this CPU "
            "lacks; re-export it with packaging='mlir' so it is compiled for this machine."
        )


def runtime_driver(target: Target, executor: str | None, where: str, *, threads: int | None = None) -> str:
    """The HAL driver a model of `target` runs on: for a CPU target the one of `executor`, or "" when the load
    picks it from the specialization's calibration (executor "auto" or unset); otherwise the target's own.
    `threads` (backend option): IREE's task workers, that many, so the parallel executor."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InvalidArgument(f"{where}: backend option threads={threads!r} must be a positive int.")
        if target.compute_unit != "cpu":
            raise InvalidArgument(f"{where}: backend option threads applies to CPU targets only; this delegate runs "
                                  f"on {target.name}. Drop the option or use compute_units='cpu'.")
        if executor == "inline":
            raise InvalidArgument(f"{where}: backend options threads={threads} and executor='inline' contradict "
                                  "each other: inline runs on the calling thread alone. Drop one of them.")
        executor = "parallel"
    if executor is None or executor == "auto":
        return "" if target.compute_unit == "cpu" else target.driver
    if executor not in CPU_EXECUTORS:
        raise InvalidArgument(f"{where}: backend option executor='{executor}' is not one of "
                              f"{', '.join(map(repr, ('auto', *CPU_EXECUTORS)))}; use 'auto' (the default: the one "
                              "measured faster here), 'parallel' (IREE's workers) or 'inline' (the calling thread).")
    if target.compute_unit != "cpu":
        raise InvalidArgument(f"{where}: backend option executor='{executor}' applies to CPU targets only; this "
                              f"delegate runs on {target.name}. Drop the option or use compute_units='cpu'.")
    return CPU_EXECUTORS[executor]


def compiler_flags(target: Target, *, for_host: bool, data_tiling: bool = True) -> list[str]:
    """iree-compile flags for `target`. `for_host`: specialize for this very machine's CPU features."""
    flags = [f"--iree-hal-target-backends={target.backend}"]
    if target.backend == "llvm-cpu":
        flags.append(f"--iree-llvmcpu-target-triple={target.triple}")
        cpu = "host" if for_host else (target.aot_cpu or "generic")
        flags.append(f"--iree-llvmcpu-target-cpu={cpu}")
        # float64 stays float64, as torch computes it: IREE demotes it to float32 by default, which gave a
        # method's float64 inputs and outputs half the bytes its header promises (refused at the first call).
        flags.append("--iree-input-demote-f64-to-f32=false")
        if data_tiling:
            # Measured faster on the host CPU (AVX2): packed layouts and microkernels for matmuls.
            flags += ["--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all"]
    return flags


@functools.lru_cache(maxsize=None)
def host_features(target: Target) -> str:
    """What `--iree-llvmcpu-target-cpu=host` compiles for: the CPU model and its feature flags. Part of the cache
    key, so a cache directory shared by different machines never restores code built for another CPU."""
    if target.compute_unit != "cpu":
        return target.name
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "CPU part")):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{' '.join(sorted(_cpu_flags()))}"
