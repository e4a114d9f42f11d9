"""Where an engine function's time goes: each dispatch timed where it runs, between the calls of the function.

`profile_model` runs one function of a loaded model back to back under IREE's HAL profiler (host-execution and
queue events of the CPU drivers) and reads, per call: each dispatch's time, the time between dispatches (the task
workers finishing one and starting the next), how long the workers took to start after the call was ready, and
the call as the caller saw it. `onecopy profile` prints it; `Method.profile` returns it.

Why in place and not each dispatch alone: IREE's executable benchmarks (`--iree-hal-dump-executable-benchmarks-to`)
run a dispatch on buffers nothing wrote, so every input is the kernel's shared zero page and in cache whatever
its size. Measured on a Xeon (2 vCPUs, AVX-512), a 2048x256 @ 256x1024 fp32 matmul, the same code on one thread:
7.8 ms alone, 11.2 ms inside its module (IREE's caching allocator, as onecopy's engine); an input's packing
80 us alone, 300 us in place.

How: IREE's Python bindings do not expose the profiler's output (`HalDevice.begin_profiling` wants a sink), so the
function runs in a child process, `iree-benchmark-module` from the iree-base-runtime wheel, on the very module
bytes, weights (an IRPA copy in a temporary directory, removed after), executor and task-worker flags of the
loaded model, with IREE's caching allocator as onecopy's CPU devices use. The first fifth of the calls is left out
(the benchmark's first calls warm the allocator and the caches). A call is usually one command-buffer submission;
a function that submits several per call has them grouped into calls by the number of calls run (`summarize`).
What differs from a `Method.execute` loop:
the child's calling thread waits for the workers the way IREE's tools do, not as onecopy's calls do
(onecopy.delegate.caller_wait: the caller gives way to the workers while a call runs), so on few cores the rest
of the call and its tail read longer than onecopy's; the dispatches' own times are the engine's.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onecopy.delegate.cpus import worker_count
from onecopy.delegate.engine import CPU_DRIVERS, task_executor_flags
from onecopy.errors import DelegateError, InvalidArgument

__all__ = ["DispatchProfile", "DispatchRow", "profile_model", "summarize", "tool"]

_WARMUP_SHARE = 0.2  # of the profiled calls, the first ones, left out
_MODES = "queue-events,host-execution"
_PROBE_CALLS = 10  # unprofiled, to size the profiled run
_MIN_CALLS, _MAX_CALLS = 20, 2000  # profiled calls, whatever `seconds` asks for


@dataclass(frozen=True)
class DispatchRow:
    """One dispatch function of the module: how many times a call runs it and its time per call."""

    name: str  # the dispatch as IREE names it, the function's prefix dropped: "dispatch_3_matmul_16x1024x1024_f32"
    per_call: float  # runs per call
    ms_per_call: float  # summed over those runs, mean over the profiled calls
    share: float  # of all dispatch time


@dataclass
class DispatchProfile:
    """A function's calls, dispatch by dispatch. Times in milliseconds, means over the profiled calls unless named
    otherwise; `gap_p90_us` and `wake_us` are microseconds."""

    function: str
    driver: str  # local-task (IREE's task workers) or local-sync (the calling thread)
    workers: int | None  # task workers (local-task); None on the calling thread
    calls: int  # profiled (after the warm-up ones)
    call_ms: float  # one call as the calling loop saw it: first dispatch to the next call's first dispatch
    dispatches: float  # per call
    dispatch_ms: float  # the dispatches' own time per call
    span_ms: float  # first dispatch's start to last one's end, per call
    gaps_ms: float  # between consecutive dispatches, summed per call
    gap_p90_us: float  # one gap, 90th percentile
    wake_us: float | None  # from the call ready to its first dispatch started (None where not recorded)
    rows: list[DispatchRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self, top: int = 20) -> list[str]:
        """The profile as text: a summary line, then the `top` dispatches by time."""
        where = f"{self.workers} task workers" if self.driver == "local-task" else "the calling thread"
        wake = (f", workers started {self.wake_us:.0f} us after the call was ready"
                if self.wake_us is not None and self.driver == "local-task" else "")
        out = [(
            f"{self.function} on {self.driver} ({where}), {self.calls} calls: {self.call_ms:.3f} ms a call; "
            f"dispatches {self.dispatch_ms:.3f} ms ({self.dispatches:g} of them), between them {self.gaps_ms:.3f} ms "
            f"(p90 of one gap {self.gap_p90_us:.0f} us){wake}; the rest of the call "
            f"{max(self.call_ms - self.span_ms, 0.0):.3f} ms (submit, allocate, wait, copies)")]
        for row in self.rows[:top]:
            runs = f"x{row.per_call:g}"
            out.append(f"  {row.ms_per_call:9.3f} ms {row.share:6.1%} {runs:>6}  {row.name}")
        if len(self.rows) > top:
            rest = self.rows[top:]
            out.append(f"  {sum(r.ms_per_call for r in rest):9.3f} ms {sum(r.share for r in rest):6.1%}"
                       f"         {len(rest)} more")
        return out


def tool(name: str) -> Path:
    """One of IREE's command-line tools as the iree-base-runtime wheel ships them (beside its native library)."""
    import iree._runtime_libs as libs

    path = Path(libs.__file__).parent / name
    if not os.access(path, os.X_OK):
        raise DelegateError(f"IREE's {name} is not in {path.parent}: profiling needs the iree-base-runtime wheel's "
                            "tools. Reinstall it: pip install --force-reinstall iree-base-runtime")
    return path


def profile_model(model: Any, function: str, inputs: Sequence[np.ndarray], *, seconds: float = 2.0) -> DispatchProfile:
    """Profile `function` of `model` (an onecopy.delegate.engine.LoadedModel) called on `inputs` for about
    `seconds` (at least 20 calls, at most 2000), on the model's own executor. Raises DelegateError with IREE's
    message if the run fails."""
    if model.driver not in CPU_DRIVERS:
        raise InvalidArgument(f"profiling covers IREE's CPU executors ({', '.join(CPU_DRIVERS)}); this model runs on "
                              f"{model.driver}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgument(f"profile seconds must be a positive number, got {seconds!r}")
    with tempfile.TemporaryDirectory(prefix="onecopy-profile-") as scratch:
        directory = Path(scratch)
        module, archives = model.write_for_tools(directory)
        arguments = []
        for i, array in enumerate(inputs):
            np.save(directory / f"input{i}.npy", np.ascontiguousarray(array))
            arguments.append(f"--input=@{directory / f'input{i}.npy'}")
        trace = directory / "profile.ireeprof"
        command = [
            str(tool("iree-benchmark-module")), f"--module={module}",
            *(f"--parameters={scope}={path}" for scope, path in archives.items()),
            f"--function={function}", *arguments, f"--device={model.driver}", "--device_allocator=caching",
            "--benchmark_format=json",
        ]
        # the engine's task executor: the same worker count and worker memory
        workers = (model.workers or worker_count()) if model.driver == "local-task" else None
        if workers is not None:
            command += task_executor_flags("", workers)
        # A few calls unprofiled first: how many fit in `seconds` (a profile of a microsecond call would otherwise
        # record millions of events). Two repetitions, the second read: the first calls of a process are cold.
        estimate = _benchmark(command + [f"--benchmark_min_time={_PROBE_CALLS}x", "--benchmark_repetitions=2"],
                              function, which=1)
        calls = min(max(round(seconds / (estimate / 1e3)), _MIN_CALLS), _MAX_CALLS)
        call_ms = _benchmark(command + [f"--benchmark_min_time={calls}x", f"--device_profiling_mode={_MODES}",
                                        f"--device_profiling_output={trace}"], function)
        if not trace.exists():
            raise DelegateError(f"IREE's profiler wrote no profile of '{function}' ({trace.name} is missing)")
        lines = []
        for view in (["queue"], ["dispatch", "--dispatch_events"]):  # calls' ready times; dispatches with names
            read = subprocess.run([str(tool("iree-profile")), *view, "--format=jsonl", str(trace)],
                                  capture_output=True, text=True, check=False)
            if read.returncode != 0:
                raise DelegateError(f"IREE's iree-profile could not read the profile of '{function}': "
                                    f"{read.stderr.strip()[-300:]}")
            lines += read.stdout.splitlines()
    return summarize(lines, function=function, driver=model.driver, workers=workers, call_ms=call_ms,
                     calls_run=calls)


def _benchmark(command: Sequence[str], function: str, which: int = 0) -> float:
    """Run iree-benchmark-module; the wall time of one call (ms) in its repetition `which`."""
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        benchmark = json.loads(run.stdout)["benchmarks"][which] if run.returncode == 0 else None
    except (ValueError, LookupError):
        benchmark = None
    if benchmark is None:
        detail = (run.stderr.strip() or run.stdout.strip()).splitlines()[-3:]
        raise DelegateError(f"IREE could not profile '{function}' (iree-benchmark-module exit {run.returncode}): "
                            + " / ".join(detail))
    return benchmark["real_time"] * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[benchmark["time_unit"]]


def summarize(lines: Iterable[str], *, function: str, driver: str, workers: int | None,
              call_ms: float, calls_run: int | None = None) -> DispatchProfile:
    """The profile from what IREE's profiler recorded, as `iree-profile --format=jsonl` prints it: the calls'
    `queue_event`s (`queue`) and the `host_dispatch_event`s (`dispatch --dispatch_events`); other lines are
    skipped. `call_ms`: the benchmark's wall time per call, used where one call alone was profiled. `calls_run`:
    how many calls the benchmark made, when known: a function whose call is several submissions (the engine
    waits on the host between them, as at a `util.optimization_barrier` or a size read back) has that many
    times more, and its consecutive submissions make one call."""
    executes: dict[int, int] = {}  # submission -> when it was ready to run (ns)
    by_submission: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        record = json.loads(line)
        kind = record.get("type")
        if kind == "queue_event" and record.get("op") == "execute":
            executes[record["submission_id"]] = record["ready_host_time_ns"]
        elif kind == "host_dispatch_event" and record.get("valid", True):
            by_submission[record["submission_id"]].append(record)
    calls = [sorted(events, key=lambda e: e["start_host_time_ns"])
             for _, events in sorted(by_submission.items())]
    per_call = len(calls) // calls_run if calls_run else 1
    if per_call > 1:  # counted from the last call: a remainder in front is the tool's warm-up
        calls = [[e for events in calls[i:i + per_call] for e in events]
                 for i in range(len(calls) % per_call, len(calls), per_call)]
    calls = calls[int(len(calls) * _WARMUP_SHARE):]
    if not calls:
        raise DelegateError(f"IREE's profiler recorded no dispatch of '{function}'")
    per_name: dict[str, float] = defaultdict(float)
    runs: dict[str, int] = defaultdict(int)
    gaps: list[float] = []
    spans, busy, call_gaps, wakes = [], [], [], []
    prefix = f"{function}$async_"
    for events in calls:
        for event in events:
            name = event.get("key") or f"function {event['function_ordinal']}"
            name = name.removeprefix(prefix)
            per_name[name] += event["duration_ns"]
            runs[name] += 1
        between = [(b["start_host_time_ns"] - a["end_host_time_ns"]) / 1e3 for a, b in itertools.pairwise(events)]
        gaps += between
        call_gaps.append(sum(between))
        spans.append((events[-1]["end_host_time_ns"] - events[0]["start_host_time_ns"]) / 1e6)
        busy.append(sum(e["duration_ns"] for e in events) / 1e6)
        ready = executes.get(events[0]["submission_id"])
        if ready is not None:
            wakes.append((events[0]["start_host_time_ns"] - ready) / 1e3)
    # A call as the loop saw it: from one call's first dispatch to the next one's (the benchmark's own mean
    # counts the warm-up calls too); with a single profiled call, the benchmark's figure.
    starts = [events[0]["start_host_time_ns"] for events in calls]
    if len(starts) > 1:
        call_ms = (starts[-1] - starts[0]) / (len(starts) - 1) / 1e6
    n, total = len(calls), sum(per_name.values())
    rows = [DispatchRow(name, runs[name] / n, ns / n / 1e6, ns / total if total else 0.0)
            for name, ns in sorted(per_name.items(), key=lambda kv: -kv[1])]
    return DispatchProfile(
        function=function, driver=driver, workers=workers, calls=n, call_ms=call_ms,
        dispatches=sum(len(events) for events in calls) / n, dispatch_ms=statistics.fmean(busy),
        span_ms=statistics.fmean(spans), gaps_ms=statistics.fmean(call_gaps) / 1e3,
        gap_p90_us=float(np.percentile(gaps, 90)) if gaps else 0.0,
        wake_us=statistics.median(wakes) if wakes else None, rows=rows)
