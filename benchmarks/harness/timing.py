"""Peers timed side by side in ONE process: interleaved rounds in a shuffled order after a warm-up (`measure`),
call by call for peers that share one engine (`measure_alternating`), or as whole blocks of calls that cannot be
timed one by one (`measure_blocks`: decode loops); each peer's `Stats`, and ratios paired
round by round (`paired_ratio`, with a bootstrap interval). Why each choice: benchmarks/README.md, "How times are
taken"."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.cpu import cpu_snapshot, foreign_cpu

__all__ = ["Stats", "paired_ratio", "paired_difference_ms", "paired_interval", "measure", "measure_alternating",
           "measure_blocks", "settle", "Stopwatch", "median"]

# `settle`: this process counts as quiet when it used under QUIET_CORES of a core over one window of SETTLE_WINDOW_S.
# The CPU time of a thread running on another core is brought up to date at scheduler ticks, so a window much
# shorter than a tick can read a spinning thread as idle; 5 ms windows read ORT's pool busy until it stopped here
# (the wait after ORT's blocks: 36 ms, for its ~28 ms of spinning).
SETTLE_WINDOW_S = 0.005
QUIET_CORES = 0.1
SETTLE_MAX_S = 0.25


@dataclass
class Stats:
    """Per-call times of one peer, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    calls: int
    rounds: int = 0  # rounds kept
    rounds_discarded: int = 0  # rounds measured while other processes were busy, measured again
    round_medians_ms: list[float] = field(default_factory=list)  # this peer's median in each kept round
    # how long, on average, the process took to go quiet after this peer's block (its threads spinning on): `settle`
    lingers_ms: float = 0.0


def paired_ratio(a: Stats, b: Stats) -> float:
    """Median over the rounds of (a's median in the round / b's median in the same round).

    A shared machine drifts between fast and slow periods lasting seconds; a period that covers a few rounds moves
    both peers of those rounds alike, so a ratio taken within each round cancels it, where a ratio of the overall
    medians does not (how far apart the two can read: benchmarks/README.md, "How times are taken"). Both ratios
    are recorded; targets use this one."""
    ratios = [x / y for x, y in zip(a.round_medians_ms, b.round_medians_ms) if y > 0]
    return statistics.median(ratios) if ratios else a.median_ms / b.median_ms


def paired_difference_ms(a: Stats, b: Stats) -> float:
    """Median over the rounds of (a's median in the round - b's): what a adds to b, paired like `paired_ratio`."""
    differences = [x - y for x, y in zip(a.round_medians_ms, b.round_medians_ms)]
    return statistics.median(differences) if differences else a.median_ms - b.median_ms


def paired_interval(a: Stats, b: Stats, *, confidence: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float] | None:
    """A bootstrap interval of `paired_ratio`: the rounds resampled with replacement `resamples` times (seeded),
    the middle `confidence` of the medians. It says whether a run resolved a target: a round's medians can differ
    several times over within one run (benchmarks/README.md, "How times are taken"), and a ratio just under a
    threshold may be over it in the next run."""
    import numpy as np

    ratios = np.array([x / y for x, y in zip(a.round_medians_ms, b.round_medians_ms) if y > 0])
    if len(ratios) < 5:
        return None
    rng = np.random.default_rng(seed)
    medians = np.concatenate([  # in chunks: thousands of rounds (measure_alternating) times 2000 resamples
        np.median(ratios[rng.integers(0, len(ratios), (chunk, len(ratios)))], axis=1)
        for chunk in [200] * (resamples // 200) + ([resamples % 200] if resamples % 200 else [])])
    low, high = np.quantile(medians, [(1 - confidence) / 2, 1 - (1 - confidence) / 2])
    return float(low), float(high)


def _stats(samples: Sequence[float], rounds: int = 0, discarded: int = 0,
           round_medians: Sequence[float] = ()) -> Stats:
    ordered = sorted(samples)
    n = len(ordered)

    def q(f: float) -> float:
        return ordered[min(n - 1, int(f * n))] * 1e3

    return Stats(statistics.median(ordered) * 1e3, q(0.10), q(0.90), ordered[0] * 1e3, n, rounds, discarded,
                 [m * 1e3 for m in round_medians])


def settle(max_s: float = SETTLE_MAX_S) -> float:
    """Sleep until this process is quiet: a window of SETTLE_WINDOW_S in which its threads used under QUIET_CORES of
    a core, at most `max_s`; the seconds it took (one window at least).

    Why. ONNX Runtime's intra-op pool keeps spinning for ~30 ms after a call and torch's for ~5-15 (measured on 2
    vCPUs, a 5 ms transformer-encoder call: the process burned a whole core through the first ~28 ms after ORT's
    last call). A peer timed while they spin shares the cores with them: onecopy's encoder calls right after a block
    of ORT's took 5.39 ms (median) and 8.42 (p90) against 4.62 / 4.83 after torch's, behind a fixed 5 ms sleep; with
    this wait 4.74 / 5.30. A peer's own threads spinning between its own calls stay counted: that is how it runs in a
    loop."""
    started = time.perf_counter()
    while True:
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(SETTLE_WINDOW_S)
        now = time.perf_counter()
        if (time.process_time() - cpu) / (now - wall) < QUIET_CORES or now - started >= max_s:
            return now - started


def measure(
    peers: Mapping[str, Callable[[], Any]],
    *,
    budget_s: float,
    min_rounds: int = 12,
    max_rounds: int = 80,
    warmup: int = 5,
    min_inner: int = 3,
    max_inner: int = 200,
    settle_s: float | None = SETTLE_MAX_S,
    prime: bool = True,
    seed: int = 0,
    busy_threshold: float = 0.15,
) -> dict[str, Stats]:
    """Time `peers` side by side: warm-up, then interleaved rounds; each round runs every peer `inner` times in a
    row, timing each call. `inner` is chosen from the warm-up so the whole measurement takes about `budget_s`.

    The order of the peers is shuffled every round (seeded): a fixed rotation would always run a peer right
    after the same other one, whose thread pool may still be spinning (ONNX Runtime's and torch's OpenMP
    workers spin for a while after a call, and this machine may have few cores). Before each peer's block the
    process waits until those workers went idle (`settle`, at most `settle_s`; None: no wait), then (`prime`)
    makes one untimed call; neither is timed. How long each wait took is kept as the previous peer's `lingers_ms`.

    A round during which other processes kept more than `busy_threshold` of the CPUs busy is thrown away and
    measured again (at most as many extra rounds as planned): on a shared machine a burst of someone else's work
    would otherwise land on whichever peer happened to run then.
    """
    names = list(peers)
    estimate = {}
    for name in names:
        fn = peers[name]
        for _ in range(warmup):
            fn()
        start = time.perf_counter()
        for _ in range(3):  # the cost estimate comes after the warm-up: first calls are slow
            fn()
        estimate[name] = (time.perf_counter() - start) / 3
    per_round_one_call = sum(estimate.values())
    rounds = max(min_rounds, min(max_rounds, int(budget_s / max(per_round_one_call * min_inner, 1e-9))))
    inner = max(min_inner, min(max_inner, int(budget_s / max(rounds * per_round_one_call, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in names}
    round_medians: dict[str, list[float]] = {name: [] for name in names}
    lingers: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    order = list(names)
    shuffle = random.Random(seed).shuffle
    kept = discarded = 0
    previous = None  # whose block ran last, this round or the one before: the next wait is its threads' linger
    while kept < rounds:
        shuffle(order)
        snapshot = cpu_snapshot() if busy_threshold < 1 else None
        this_round: dict[str, list[float]] = {name: [] for name in names}
        for name in order:
            fn, out = peers[name], this_round[name]
            if settle_s:
                waited = settle(settle_s)
                if previous is not None:
                    lingers[previous].append(waited)
            previous = name
            if prime:
                fn()  # one untimed call: the first after the pause pays for waking the peer's threads
            for _ in range(inner):
                start = clock()
                fn()
                out.append(clock() - start)
        if snapshot is not None and foreign_cpu(snapshot)["fraction"] > busy_threshold and discarded < rounds:
            discarded += 1
            continue
        kept += 1
        for name in names:
            samples[name].extend(this_round[name])
            round_medians[name].append(statistics.median(this_round[name]))
    stats = {name: _stats(samples[name], kept, discarded, round_medians[name]) for name in names}
    for name in names:
        stats[name].lingers_ms = statistics.fmean(lingers[name]) * 1e3 if lingers[name] else 0.0
    return stats


def measure_alternating(peers: Mapping[str, Callable[[], Any]], *, budget_s: float, seed: int = 1) -> dict[str, Stats]:
    """Time peers that share one engine and its threads (onecopy and the same IREE module called raw, on the same
    device) call by call: each round is one call of each peer, in a shuffled order, with no pause between, for
    as many rounds as `budget_s` allows (at least 50). A round's ratio then compares two calls made
    milliseconds apart, so the drift of this machine (seconds long, tens of percent) cancels within each pair,
    and the rounds are many: the interval of `paired_ratio` is a few times narrower than `measure`'s, whose
    rounds run blocks of calls, a pause and a priming call per peer (needed there for peers whose thread pools
    spin, ONNX Runtime's and torch's; not between calls on one IREE device, whose workers the previous call
    leaves in the same state for every peer)."""
    # No round is thrown away for other processes' CPU: /proc/stat counts in 10 ms ticks, too coarse to judge a
    # round of a few calls; a burst lands on both calls of a pair alike, and the caller reports the whole run's.
    return measure(peers, budget_s=budget_s, min_rounds=50, max_rounds=20_000, warmup=10, min_inner=1,
                   max_inner=1, settle_s=None, prime=False, seed=seed, busy_threshold=float("inf"))


def measure_blocks(blocks: Mapping[Any, Callable[[], Any]], calls: Mapping[Any, int] | int, *, rounds: int,
                   seed: int = 0) -> dict[Any, list[float]]:
    """ms per call of each block, `rounds` times: a block makes `calls` calls (per key, or the same for all) that
    can only be timed together, such as a decode loop whose every token moves the KV cache. One untimed run of
    each block first, then rounds in a shuffled order (seeded), each block after the process went quiet (`settle`)
    and timed whole. Each list holds one figure per round, in round order, so lists pair round by round."""
    per_block = calls if isinstance(calls, Mapping) else dict.fromkeys(blocks, calls)
    times: dict[Any, list[float]] = {key: [] for key in blocks}
    for fn in blocks.values():  # warm-up
        fn()
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(blocks)
        rng.shuffle(order)
        for key in order:
            settle()  # the previous block's threads idle first
            start = time.perf_counter()
            blocks[key]()
            times[key].append((time.perf_counter() - start) / per_block[key] * 1e3)
    return times


class Stopwatch:
    """`with Stopwatch() as watch: ...` then `watch.seconds`."""

    seconds: float = 0.0

    def __enter__(self) -> "Stopwatch":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


def median(values: Sequence[float]) -> float:
    return statistics.median(values)

