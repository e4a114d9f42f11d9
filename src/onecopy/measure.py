"""Measuring what a process holds and how long calls take, side by side: the demo's figures.

- `memory(pid)`: RSS and PSS of a process from /proc/<pid>/smaps_rollup. PSS divides each page among the
  mappings of it, so weights mapped by several programs (or processes) count once: the figure for "one copy".
- `interleaved(peers, ...)`: peers timed in rounds, in a shuffled order each round, each after a short pause and
  one untimed call (thread pools of ONNX Runtime and torch spin a while after a call; the next peer must not pay
  for them); a peer's figure is its median, and `paired_ratio` compares two peers round by round, so the drift of
  a shared machine (seconds long) cancels within each round.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["memory", "release_free_memory", "Timing", "interleaved", "paired_ratio"]

_FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File")


def memory(pid: int | str = "self") -> dict[str, int]:
    """{"rss", "pss", "pss_anon", "pss_file"} of process `pid`, in bytes (Linux)."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB" and parts[0].rstrip(":") in _FIELDS:
                found[parts[0].rstrip(":").lower()] = int(parts[1]) * 1024
    return found


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc `malloc_trim(0)`; nothing elsewhere) before a
    `memory()` baseline. Otherwise what the process freed earlier (a load's temporaries) stays resident and serves
    the allocations being measured, which then seem to cost nothing: 4 States of a 128 KiB cache measured +264 KiB
    PSS without it, +1316 KiB with it (4 x (128 KiB cache + ~200 KiB of VM context))."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)


@dataclass
class Timing:
    """Per-call times of one peer, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    calls: int
    round_medians_ms: list[float] = field(default_factory=list)


def interleaved(peers: Mapping[str, Callable[[], object]], *, rounds: int = 12, inner: int = 5, warmup: int = 3,
                settle_s: float = 0.005, seed: int = 0,
                on_round: Callable[[], None] | None = None) -> dict[str, Timing]:
    """Time `peers` side by side: `warmup` calls each, then `rounds` rounds of `inner` timed calls per peer."""
    names = list(peers)
    for name in names:
        for _ in range(warmup):
            peers[name]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    medians: dict[str, list[float]] = {n: [] for n in names}
    order, shuffle, clock = list(names), random.Random(seed).shuffle, time.perf_counter
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            fn, mine = peers[name], []
            time.sleep(settle_s)
            fn()  # untimed: the first call after the pause pays for waking the peer's threads
            for _ in range(inner):
                start = clock()
                fn()
                mine.append(clock() - start)
            samples[name].extend(mine)
            medians[name].append(statistics.median(mine) * 1e3)
        if on_round is not None:
            on_round()
    result = {}
    for name in names:
        ordered = sorted(samples[name])
        n = len(ordered)
        result[name] = Timing(statistics.median(ordered) * 1e3, ordered[int(0.1 * n)] * 1e3,
                              ordered[min(n - 1, int(0.9 * n))] * 1e3, n, medians[name])
    return result


def paired_ratio(a: Timing, b: Timing) -> float:
    """a over b: the median over the rounds of a's median in the round over b's (below 1: a is faster)."""
    ratios = [x / y for x, y in zip(a.round_medians_ms, b.round_medians_ms) if y > 0]
    return statistics.median(ratios) if ratios else a.median_ms / b.median_ms
