"""Shared helpers of the benchmark scripts: timing, machine description, tables, results JSON, peers.

Every script measures onecopy and its peers side by side in ONE process run: the peers are timed in interleaved
rounds (the order is shuffled each round), after a warm-up, and each reported time is the median of many calls.
Ratios are paired (`paired_ratio`): onecopy's median over the peer's within each round, then the median over the
rounds (below 1: onecopy is faster); the ratio of the overall medians is recorded beside it. Nothing here knows a
result in advance.

A script imports this module as `common` (it runs as `python benchmarks/<name>.py`, so benchmarks/ is on sys.path).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The parameter scope of weights that specialization encoded (packed) for this CPU, in onecopy's cache entries.
ENCODED_SCOPE = "encoded"
VERSIONED_PACKAGES = (
    "onecopy", "torch", "iree-base-compiler", "iree-base-runtime", "iree-turbine", "onnxruntime", "onnx",
    "onnxscript", "numpy",
)

# torch.onnx (TorchScript exporter), torch.export and iree-turbine warn a lot about their own internals; the
# benchmarks' output is a table, not their deprecation notices.
for _category in (DeprecationWarning, FutureWarning, UserWarning):
    warnings.filterwarnings("ignore", category=_category)


# -- command line ----------------------------------------------------------------------------------------------


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


# -- other processes on the CPUs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float
    busy: float  # CPU-seconds all processes of the machine spent, from /proc/stat
    ours: float  # CPU-seconds this process and its waited-for children spent


def cpu_snapshot() -> CpuSnapshot:
    import resource

    busy = float("nan")
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    ours = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
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


# -- temporary directories and the cache -------------------------------------------------------------------------


@contextlib.contextmanager
def temp_workdir(prefix: str) -> Iterator[Path]:
    """A temporary directory, removed afterwards. Program files and caches of a run live here."""
    path = Path(tempfile.mkdtemp(prefix=f"onecopy-bench-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def isolated_cache(directory: Path) -> Iterator[Path]:
    """Point ONECOPY_CACHE_DIR at `directory` for the duration, so nothing touches the user's cache even where a
    Runtime is created without cache_dir (scripts pass Runtime(cache_dir=...) as well)."""
    directory.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("ONECOPY_CACHE_DIR")
    os.environ["ONECOPY_CACHE_DIR"] = str(directory)
    try:
        yield directory
    finally:
        if old is None:
            os.environ.pop("ONECOPY_CACHE_DIR", None)
        else:
            os.environ["ONECOPY_CACHE_DIR"] = old


def cache_entries(cache_dir: Path) -> set[str]:
    """Keys of the specialization cache entries in `cache_dir` (layout: <dir>/v1/entries/<key>/module.vmfb)."""
    entries = cache_dir / "v1" / "entries"
    return {p.name for p in entries.iterdir() if (p / "module.vmfb").exists()} if entries.exists() else set()


# -- timing ----------------------------------------------------------------------------------------------------


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


def paired_ratio(a: Stats, b: Stats) -> float:
    """Median over the rounds of (a's median in the round / b's median in the same round).

    This machine drifts between fast and slow periods lasting seconds (the same call runs 1.0 or 1.6 ms); a
    period that covers a few rounds moves both peers of those rounds alike, so a ratio taken within each round
    cancels it, where a ratio of the overall medians does not (seen: bound / raw of one frame model read 1.18,
    then 0.79, in two runs minutes apart). Both ratios are recorded; targets use this one."""
    ratios = [x / y for x, y in zip(a.round_medians_ms, b.round_medians_ms) if y > 0]
    return statistics.median(ratios) if ratios else a.median_ms / b.median_ms


def paired_difference_ms(a: Stats, b: Stats) -> float:
    """Median over the rounds of (a's median in the round - b's): what a adds to b, paired like `paired_ratio`."""
    differences = [x - y for x, y in zip(a.round_medians_ms, b.round_medians_ms)]
    return statistics.median(differences) if differences else a.median_ms - b.median_ms


def paired_interval(a: Stats, b: Stats, *, confidence: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float] | None:
    """A bootstrap interval of `paired_ratio`: the rounds resampled with replacement `resamples` times (seeded),
    the middle `confidence` of the medians. It says whether a run resolved a target: on this machine a round's
    medians can differ 4x within one run, and a ratio 2% under a threshold may be 5% over it in the next run."""

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


def measure(
    peers: Mapping[str, Callable[[], Any]],
    *,
    budget_s: float,
    min_rounds: int = 12,
    max_rounds: int = 80,
    warmup: int = 5,
    min_inner: int = 3,
    max_inner: int = 200,
    settle_s: float = 0.005,
    prime: bool = True,
    seed: int = 0,
    busy_threshold: float = 0.15,
) -> dict[str, Stats]:
    """Time `peers` side by side: warm-up, then interleaved rounds; each round runs every peer `inner` times in a
    row, timing each call. `inner` is chosen from the warm-up so the whole measurement takes about `budget_s`.

    The order of the peers is shuffled every round (seeded): a fixed rotation would always run a peer right
    after the same other one, whose thread pool may still be spinning (ONNX Runtime's and torch's OpenMP
    workers spin for a while after a call, and this machine may have few cores). Before each peer's block the
    process sleeps `settle_s` so such workers go idle, then (`prime`) makes one untimed call; neither is timed.

    A round during which other processes kept more than `busy_threshold` of the CPUs busy is thrown away and
    measured again (at most as many extra rounds as planned): on a shared machine a burst of someone else's work
    would otherwise land on whichever peer happened to run then.
    """
    import random

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
    clock = time.perf_counter
    order = list(names)
    shuffle = random.Random(seed).shuffle
    kept = discarded = 0
    while kept < rounds:
        shuffle(order)
        snapshot = cpu_snapshot() if busy_threshold < 1 else None
        this_round: dict[str, list[float]] = {name: [] for name in names}
        for name in order:
            fn, out = peers[name], this_round[name]
            if settle_s:
                time.sleep(settle_s)
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
    return {name: _stats(samples[name], kept, discarded, round_medians[name]) for name in names}


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
                   max_inner=1, settle_s=0.0, prime=False, seed=seed, busy_threshold=float("inf"))


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


# -- targets ---------------------------------------------------------------------------------------------------


def target(name: str, value: float | None, op: str, threshold: float, note: str = "",
           interval: tuple[float, float] | None = None) -> dict[str, Any]:
    """One target of the issue and whether this run met it. `op` is '<=' or '>='. `interval` (`paired_interval`):
    when it contains the threshold, the run did not resolve the target either way, and the verdict says so."""
    if value is None:
        met = None
    elif op == "<=":
        met = value <= threshold
    elif op == ">=":
        met = value >= threshold
    else:
        raise ValueError(op)
    entry = {"name": name, "value": value, "op": op, "threshold": threshold, "met": met}
    if interval is not None:
        entry["interval_95"] = [interval[0], interval[1]]
        entry["resolved"] = not interval[0] <= threshold <= interval[1]
    if note:
        entry["note"] = note
    return entry


TARGET_COLUMNS = ["target", "measured", "95% interval", "wanted", "verdict"]


def target_row(t: Mapping[str, Any]) -> list[str]:
    """A target as a table row (TARGET_COLUMNS)."""
    value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
    verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
    if t.get("resolved") is False:
        verdict += " (unresolved)"
    interval = t.get("interval_95")
    spread = f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else "-"
    return [t["name"], value, spread, f"{t['op']} {t['threshold']}", verdict]


def print_targets(targets: Sequence[Mapping[str, Any]]) -> None:
    print_table(TARGET_COLUMNS, [target_row(t) for t in targets], title="targets")


# -- tables ----------------------------------------------------------------------------------------------------


def fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else (f"{ms:.3f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}")


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n:,}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if title:
        print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


# -- machine description -----------------------------------------------------------------------------------------


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
    try:
        mem_total = None
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
                    break
    except OSError:
        mem_total = None
    return {
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags_of_interest(),
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "memory_bytes": mem_total,
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


# -- results ---------------------------------------------------------------------------------------------------


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
    import re

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


# -- peers -----------------------------------------------------------------------------------------------------


class TorchEager:
    """torch eager under torch.no_grad(); takes numpy like the other peers (torch.from_numpy: no copy)."""

    name = "torch eager"

    def __init__(self, model):
        import torch

        self._torch = torch
        self.model = model

    def __call__(self, x):
        torch = self._torch
        with torch.no_grad():
            return self.model(torch.from_numpy(x)).numpy()


class OnnxRuntime:
    """The model exported with torch.onnx.export and run by an InferenceSession on the default CPU execution
    provider with default threading (intra-op threads: one per physical core).

    The export uses torch's default (dynamo) exporter with static shapes; if it fails, the TorchScript exporter
    (dynamo=False). `exporter` says which one made the file.
    """

    name = "onnxruntime"

    def __init__(self, model, example, path: Path):
        import io
        import logging

        import onnxruntime as ort
        import torch


        # "torchvision is not installed. Skipping torchvision::nms": true and beside the point here.
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        self.exporter = "dynamo"
        with torch.no_grad():
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # the dynamo exporter narrates its steps
                    torch.onnx.export(model, (torch.from_numpy(example),), str(path), dynamo=True, verbose=False,
                                      input_names=["x"], output_names=["y"])
            except Exception as e:  # noqa: BLE001  (any exporter failure: fall back to the other exporter)
                print(f"(torch.onnx dynamo exporter failed: {type(e).__name__}; using dynamo=False)")
                self.exporter = "torchscript (dynamo=False)"
                torch.onnx.export(model, (torch.from_numpy(example),), str(path), dynamo=False,
                                  input_names=["x"], output_names=["y"], opset_version=17)
        self.path = path
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.intra_op_threads = self.session.get_session_options().intra_op_num_threads

    def __call__(self, x):
        return self.session.run(None, {"x": x})[0]


class OnnxRuntimeDecoder:
    """A decoder-only LM's one-token step run by ONNX Runtime the way ORT users run decoders: the KV cache as
    inputs and outputs (`past_key.i`/`past_value.i` in, `present_key.i`/`present_value.i` out), fed back each step.

    The exported module is a wrapper around `model` with a transformers `StaticCache` of `max_cache_len` built from
    its k/v inputs each call, so every k/v input and output is [1, kv_heads, max_cache_len, head_dim] (static: the
    same cache shape as onecopy's State); forward(input_ids [1, 1], cache_position [1], k/v...) -> (logits, k/v...).
    Exported with torch's dynamo exporter (`dynamo=False` as a fallback; `exporter` says which).

    `step_iobinding` (what the benchmark times): IOBinding with every input and output bound to preallocated
    buffers, two k/v sets used in turn (one step reads A and writes B, the next reads B and writes A), so nothing
    is allocated or copied between steps; the logits are copied out, as onecopy returns a fresh array.
    `step_run`: plain `InferenceSession.run` with numpy feeds, the outputs fed back."""

    def __init__(self, model, max_cache_len: int, path: Path):
        import io
        import logging

        import numpy as np
        import onnxruntime as ort
        import torch
        from transformers import StaticCache

        config = model.config.get_text_config()
        layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

        class KVStep(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, cache_position, *kv):
                cache = StaticCache(config=self.model.config, max_cache_len=max_cache_len)
                for i, layer in enumerate(cache.layers):
                    keys, values = kv[2 * i].clone(), kv[2 * i + 1].clone()  # written in place by the update
                    layer.dtype, layer.device = keys.dtype, keys.device
                    layer.batch_size, layer.num_heads = keys.shape[:2]
                    layer.k_head_dim = layer.v_head_dim = keys.shape[-1]
                    layer.keys, layer.values = keys, values
                    layer.cumulative_length = cache_position[0].clone()  # where the update writes
                    layer.is_initialized = True
                out = self.model(input_ids=input_ids, cache_position=cache_position, past_key_values=cache,
                                 use_cache=True)
                return (out.logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])

        self.kv_names = [f"{n}.{i}" for i in range(layers) for n in ("past_key", "past_value")]
        self.input_names = ["input_ids", "cache_position", *self.kv_names]
        self.output_names = ["logits", *[n.replace("past", "present") for n in self.kv_names]]
        self.kv_shape = (1, kv_heads, max_cache_len, head_dim)
        example = (torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]),
                   *[torch.zeros(self.kv_shape) for _ in self.kv_names])
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        wrapper = KVStep().eval()
        self.exporter = "dynamo"
        with torch.no_grad():
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    torch.onnx.export(wrapper, example, str(path), dynamo=True, verbose=False,
                                      input_names=self.input_names, output_names=self.output_names)
            except Exception as e:  # noqa: BLE001  (any exporter failure: fall back to the other exporter)
                print(f"(torch.onnx dynamo exporter failed: {type(e).__name__}: {e}; using dynamo=False)")
                self.exporter = "torchscript (dynamo=False)"
                torch.onnx.export(wrapper, example, str(path), dynamo=False, input_names=self.input_names,
                                  output_names=self.output_names, opset_version=17)
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.intra_op_threads = self.session.get_session_options().intra_op_num_threads
        vocab = int(config.vocab_size)
        # IOBinding: the token and position are numpy arrays shared with their OrtValues, rewritten in place.
        self.ids, self.pos = np.zeros((1, 1), np.int64), np.zeros(1, np.int64)
        self.logits = np.zeros((1, 1, vocab), np.float32)
        sets = [[np.zeros(self.kv_shape, np.float32) for _ in self.kv_names] for _ in range(2)]
        value = ort.OrtValue.ortvalue_from_numpy
        self._kv_sets = sets
        self._bindings = []
        for src, dst in ((0, 1), (1, 0)):
            binding = self.session.io_binding()
            binding.bind_ortvalue_input("input_ids", value(self.ids))
            binding.bind_ortvalue_input("cache_position", value(self.pos))
            for name, arr in zip(self.kv_names, sets[src]):
                binding.bind_ortvalue_input(name, value(arr))
            binding.bind_ortvalue_output("logits", value(self.logits))
            for name, arr in zip(self.output_names[1:], sets[dst]):
                binding.bind_ortvalue_output(name, value(arr))
            self._bindings.append(binding)
        self.reset()

    def reset(self) -> None:
        """An empty cache for both ways of running."""
        import numpy as np

        for arrays in self._kv_sets:
            for a in arrays:
                a.fill(0)
        self._turn = 0
        self._feeds = [np.zeros(self.kv_shape, np.float32) for _ in self.kv_names]

    def step_iobinding(self, ids, position):
        self.ids[...] = ids
        self.pos[0] = position
        self.session.run_with_iobinding(self._bindings[self._turn])
        self._turn ^= 1
        return self.logits.copy()

    def step_run(self, ids, position):
        import numpy as np

        outs = self.session.run(None, dict(zip(self.input_names, [ids, np.array([position]), *self._feeds])))
        self._feeds = outs[1:]
        return outs[0]


class OnecopyMethod:
    name = "onecopy"

    def __init__(self, method):
        self.method = method

    def __call__(self, x):
        return self.method.execute([x])[0]


class RawIree:
    """The same specialized module onecopy runs, called straight through iree.runtime: no onecopy in between.

    It loads what onecopy's cache entry holds, the way onecopy's engine does: `module.vmfb` (memory-mapped), the
    program's parameters as in-place buffers of a ParameterIndex (scope `model`) and, when the specialization
    encoded (packed) the weights for this CPU, `encoded.bin` as a second provider (scope `encoded`; either layout
    of entry.json: a byte range per parameter, or page-deduplicated runs). It calls
    `function` with a VmVariantList and VmContext.invoke: the input copied into a device buffer, the output mapped
    and copied into a new numpy array (the same work per call as onecopy's engine). It has its own VmInstance
    and local-task device unless `device` is given.
    """

    name = "raw IREE"

    def __init__(self, entry_dir: Path, program_path: Path, function: str, *, device: Any = None):
        import iree.runtime as rt
        import numpy as np

        # the file format reader only: to find the parameter bytes
        from onecopy.program import read_program

        self._rt, self._np = rt, np
        self._program = read_program(program_path)
        manifest = next(d.manifest for d in self._program.definition.delegates if d.manifest["function"] == function)
        self.instance = rt.VmInstance()
        self.device = device if device is not None else rt.get_driver("local-task").create_default_device()
        index = rt.ParameterIndex()
        for name, key in manifest["parameters"].items():
            index.add_buffer(name, self._program.named_data[key])
        providers = [index.create_provider(scope="model")]
        meta = json.loads((entry_dir / "entry.json").read_text())
        self.encoded_parameters = len(meta.get("encoded") or [])
        self._maps = []
        if meta.get("encoded"):
            encoded = rt.ParameterIndex()
            for e in meta["encoded"]:
                encoded.add_buffer(e["name"], self._encoded_view(entry_dir / "encoded.bin", e))
            providers.append(encoded.create_provider(scope=ENCODED_SCOPE))
        self.module = rt.VmModule.mmap(self.instance, str(entry_dir / "module.vmfb"))
        self.context = rt.VmContext(self.instance, modules=[
            rt.create_hal_module(self.instance, self.device),
            rt.create_io_parameters_module(self.instance, *providers),
            self.module,
        ])
        self.function = self.module.lookup_function(function)
        if self.function is None:
            raise RuntimeError(f"{entry_dir} has no function {function}: {self.module.function_names}")
        self._memory_type = rt.MemoryType.DEVICE_LOCAL
        self._usage = rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING
        self._f32 = rt.HalElementType.FLOAT_32

    def _encoded_view(self, path: Path, e: Mapping[str, Any]) -> Any:
        """One encoded parameter of the cache entry, laid out as its entry.json describes: a byte range
        (`offset`, `size`) of encoded.bin, or (the page-deduplicated layout) `runs` of (virtual page, file page,
        count), rebuilt in one address range with onecopy's own page mapper (the same pages the engine maps)."""
        import mmap

        if "offset" in e:
            if not self._maps:
                with open(path, "rb") as f:
                    self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            return memoryview(self._maps[0])[e["offset"]: e["offset"] + e["size"]]
        if "runs" in e:
            # onecopy's page mapper, at load only: nothing of onecopy runs per call
            from onecopy.delegate.page_map import map_pages

            fd = os.open(path, os.O_RDONLY)
            try:
                view = map_pages(fd, e, owner=self)  # unmapped when this peer is collected
            finally:
                os.close(fd)
            self._maps.append(view)
            return view
        raise RuntimeError(f"{path}: unknown layout of encoded parameter {e.get('name')!r}: {sorted(e)}")

    def __call__(self, x):
        rt, np = self._rt, self._np
        device = self.device
        args = rt.VmVariantList(1)
        args.push_ref(device.allocator.allocate_buffer_copy(
            memory_type=self._memory_type, allowed_usage=self._usage, device=device, buffer=x,
            element_type=self._f32))
        results = rt.VmVariantList(1)
        self.context.invoke(self.function, args, results)
        view = results.get_as_object(0, rt.HalBufferView)
        return np.array(view.map().asarray(tuple(view.shape), np.dtype(np.float32)), copy=True)


class RawIreeInPlace(RawIree):
    """Pure engine compute of a destination-passing function (manifest `outputs_in_place`: the outputs are
    trailing arguments, written in place; the function returns a 0-d tensor): the same module as onecopy's cache
    entry, its arguments imported ONCE from the caller's arrays (`import_host_allocation`, no copy) and pushed
    into one argument list, so a call is `VmContext.invoke` and nothing else. `bind(inputs, outputs)` first."""

    name = "pure engine compute"

    def bind(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        rt = self._rt
        memory_type = rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE
        usage = rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING
        args = rt.VmVariantList(len(inputs) + len(outputs))
        self._held = [*inputs, *outputs]  # the imported buffers point into these arrays: keep them alive
        for array in self._held:
            if not array.flags.c_contiguous:
                raise ValueError("RawIreeInPlace imports dense arrays only")
            buffer = self.device.allocator.import_host_allocation(array, memory_type=memory_type,
                                                                  allowed_usage=usage)
            # The constructor, not HalBuffer.create_view (which computes a wrong size for fp16).
            args.push_ref(rt.HalBufferView(buffer, list(array.shape),
                                           rt.array_interop.map_dtype_to_element_type(array.dtype)))
        self._args = args

    def __call__(self, *_: Any) -> None:
        rt = self._rt
        self.context.invoke(self.function, self._args, rt.VmVariantList(1))


# -- memory of processes ---------------------------------------------------------------------------------------

SMAPS_FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Shared_Clean", "Shared_Dirty", "Private_Clean",
                "Private_Dirty", "Anonymous")


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Memory of a process from /proc/<pid>/smaps_rollup, in bytes: Rss, Pss (each page divided by the number of
    mappings of it, so memory shared by processes (or mapped twice) counts once in total), Pss_Anon/File/Shmem,
    Shared/Private Clean/Dirty, Anonymous."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB" and parts[0].rstrip(":") in SMAPS_FIELDS:
                found[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return found


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def max_abs_diff(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def run_script(script: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run benchmarks/<script> in a fresh interpreter (the same Python)."""
    return subprocess.run([sys.executable, str(Path(__file__).resolve().parent / script), *args],
                          env={**os.environ, **(env or {})}, timeout=timeout)


def collect_load_states() -> list[str]:
    """Load states ('specialized' / 'restored') from onecopy's log, one per delegate load."""
    import logging

    states: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            for state in ("specialized", "restored"):
                if f" {state} " in message:
                    states.append(state)

    logger = logging.getLogger("onecopy")
    logger.setLevel(logging.INFO)
    logger.addHandler(Collect())
    return states
