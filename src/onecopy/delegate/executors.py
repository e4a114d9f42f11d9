"""Which executor runs a CPU model: IREE's task workers or the calling thread, measured once per machine.

A CPU model runs its dispatches either on IREE's task workers, one per core ("parallel", HAL driver `local-task`),
or on the calling thread alone ("inline", `local-sync`); the compiled code is the same. Neither is right for
every function (benchmarks/README.md, latency.py and llm_decode.py, 2 cores):

- a transformer encoder's dispatches split well across the workers: inline is 1.3x (B=1) to 2x (B=16) slower;
- an LLM's decode step is a chain of small dispatches, each paying a wake-up of the workers: inline is 2-2.7x
  faster (0.05 against 0.13 ms per token on the tiny Llama of llm_decode.py);
- the built-in model's B=16 prefill has the same median on both, but the workers' p90 is 2x their median and the
  calling thread's 1.03x.

So specialization times each public function of the module on both executors (`calibrate`) and the cache entry
keeps the figures; a load picks the executor from them (`choose`), unless the user named one (backend option
`executor`). The score of an executor is the mean latency of back-to-back calls, which counts the tail the
workers' wake-ups add, not only the median (the median and p90 are kept too, for `onecopy inspect`). Where
one model serves several functions that must run in the same VM contexts (a module holding state), one executor
serves them all: the one whose geometric mean of time ratios over those functions is lower, so that each
function counts alike whatever its absolute time. A shared multifunction model without state runs each function
on its own choice (onecopy.delegate.model_set). The record names the number of task workers it was measured with; a process
with another number (another CPU quota, same CPU) does not use it and runs on the workers. It also names how the
calling thread waited for the workers (`caller_wait`, onecopy.delegate.caller_wait): that moves the workers' times
by up to 40% (prefill B=16 on 2 vCPUs: mean 3.2 against 1.9 ms), so figures measured with another wait (a record
made before the batch wait existed names none) are `stale`, and a load times the functions it serves again, once.
Figures timed while other processes, or threads of this one that are not the calibration's, took half a core or
more (`other_cpu`, `measured_busy`) are timed again by the next restores, up to BUSY_RETIMES times.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from onecopy.delegate import caller_wait
from onecopy.delegate.cpus import worker_count
from onecopy.errors import DelegateError, ExecutionError
from onecopy.runtime.copy_stats import CopyStats

__all__ = ["BUSY_CORES", "BUSY_RETIMES", "EXECUTORS", "caller_wait_mode", "calibrate", "calibrate_models", "choose",
           "describe", "measured_busy", "merge", "stale"]

log = logging.getLogger("onecopy")

EXECUTORS = ("parallel", "inline")
# Figures timed while other processes (or threads of this one) took at least this many cores on average
# (`other_cpu`) may not be this machine's: ResNet-18 (2 vCPUs) timed while another process took a core read 40.2 ms
# on the workers against 40.4 on the calling thread, a coin toss, where a quiet machine runs it in 21-24 against
# 37-39 (one benchmark run's bf16 load, likely so chosen, ran 36.8 against 21.0). A restore times such figures
# again (`measured_busy`), at most BUSY_RETIMES times per entry, so that a machine that stays busy does not pay a
# calibration at every load.
BUSY_CORES = 0.5
BUSY_RETIMES = 3
_MIN_ROUNDS, _MAX_ROUNDS = 5, 200
_CALLS_PER_BLOCK = 3  # back to back, as a caller making repeated calls (a decode loop) does


# run(executor, function) makes one call of `function` on its example arguments; raises what the engine raises.
Run = Callable[[str, str], Any]


def calibrate(run: Run, functions: Sequence[str], budget_s: float) -> dict[str, Any]:
    """Time every function of `functions` on each executor, in interleaved rounds (executor order alternating)
    until at least `_MIN_ROUNDS` were run and `budget_s` is spent. Returns the record the cache entry keeps: per
    function the mean, median and p90 (ms) of each executor, and the time it took."""
    started = time.perf_counter()
    times: dict[str, dict[str, list[float]]] = {f: {e: [] for e in EXECUTORS} for f in functions}
    for executor in EXECUTORS:  # warm-up: the first call of a context loads its executables
        for function in functions:
            run(executor, function)
    rounds = 0
    while rounds < _MIN_ROUNDS or (rounds < _MAX_ROUNDS and time.perf_counter() - started < budget_s):
        order = EXECUTORS if rounds % 2 == 0 else EXECUTORS[::-1]
        for executor in order:
            for function in functions:
                for _ in range(_CALLS_PER_BLOCK):
                    t = time.perf_counter()
                    run(executor, function)
                    times[function][executor].append(time.perf_counter() - t)
        rounds += 1
    figures: dict[str, dict[str, float]] = {}
    for function, by_executor in times.items():
        figures[function] = {}
        for executor, samples in by_executor.items():
            figures[function][f"{executor}_ms"] = round(statistics.fmean(samples) * 1e3, 4)
            figures[function][f"{executor}_p50_ms"] = round(float(np.median(samples)) * 1e3, 4)
            figures[function][f"{executor}_p90_ms"] = round(float(np.quantile(samples, 0.9)) * 1e3, 4)
    return {"functions": figures, "rounds": rounds, "elapsed_s": round(time.perf_counter() - started, 3)}


def caller_wait_mode() -> str:
    """How a call on the workers waits in this process: "batch" (onecopy.delegate.caller_wait) or "normal"."""
    return "batch" if caller_wait.enabled() else "normal"


def stale(record: Mapping[str, Any] | None, functions: Collection[str], workers: int | None = None) -> bool:
    """Whether any of `functions` has figures in `record` measured with the calling thread waiting otherwise than
    calls wait in this process now: worth timing again. A function's figures carry the wait they were timed with
    when the record also holds newer ones (`merge`), else the record's; a record without it predates the batch
    wait ("normal"). A record of another number of workers is not used at all (`choose`), so not stale."""
    if not record or (workers is not None and record.get("workers") not in (None, workers)):
        return False
    timed, mode = record.get("functions") or {}, caller_wait_mode()
    default = record.get("caller_wait", "normal")
    return any(f in timed and timed[f].get("caller_wait", default) != mode for f in functions)


def measured_busy(record: Mapping[str, Any] | None, workers: int | None = None) -> bool:
    """Whether `record` was timed while other processes (or threads) took BUSY_CORES or more and has not been
    timed again BUSY_RETIMES times yet (`busy_retimes`): worth timing again. A record of another number of
    workers is not used at all (`choose`), so not busy either."""
    if not record or not record.get("functions"):
        return False
    if workers is not None and record.get("workers") not in (None, workers):
        return False
    others = record.get("other_cpu")
    return (isinstance(others, (int, float)) and others >= BUSY_CORES
            and int(record.get("busy_retimes", 0)) < BUSY_RETIMES)


def choose(record: Mapping[str, Any] | None, functions: Collection[str], workers: int | None = None) -> str | None:
    """The executor to run `functions` (one model) on, from a calibration record; None when the record does not
    cover them (no record, a function not timed) or was measured with another number of task workers than
    `workers` (a cache directory shared by containers of different CPU quotas): then the caller keeps its
    default."""
    if not record:
        return None
    if workers is not None and record.get("workers") not in (None, workers):
        return None
    timed = record.get("functions") or {}
    try:
        ratios = [float(timed[f]["inline_ms"]) / float(timed[f]["parallel_ms"]) for f in functions]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if not ratios or not all(r > 0 and math.isfinite(r) for r in ratios):
        return None
    return "inline" if math.exp(statistics.fmean(math.log(r) for r in ratios)) <= 1.0 else "parallel"


def calibrate_models(load: Callable[[str], Any], calls: Mapping[str, tuple[Sequence[np.ndarray], int]],
                     budget_s: float, where: str) -> dict[str, Any]:
    """`calibrate` on models made by `load(executor)` (a LoadedModel on that executor's driver), closed after.
    `calls`: function name -> (example arguments, number of results).
    A function that cannot run on its example inputs leaves the record without figures (and a note): loads then
    keep the default executor."""
    models: dict[str, Any] = {}
    functions: dict[tuple[str, str], Any] = {}

    def run(executor: str, function: str) -> Any:
        arrays, results = calls[function]
        call = functions.get((executor, function))
        if call is None:
            call = functions[executor, function] = models[executor].function(function).copied_call(arrays, results)
        return call(arrays, CopyStats())

    try:
        for executor in EXECUTORS:
            models[executor] = load(executor)
        caller = threading.get_native_id()
        busy, own, foreign = _machine_busy_s(), time.process_time(), _foreign_threads_s(caller)
        record = {**calibrate(run, list(calls), budget_s), "workers": worker_count(), "caller_wait": caller_wait_mode(),
                  "measured": int(time.time())}  # floored: a record is never dated after the moment it was read
        # What else ran meanwhile: a choice made while other processes (or the hypervisor's other guests), or
        # other threads of this one (an application's, another engine's pool), took the cores may not be the
        # quiet machine's; the backend option `recalibrate` measures again.
        if busy is not None and (now := _machine_busy_s()) is not None and record["elapsed_s"] > 0:
            others = (now - busy) - (time.process_time() - own) + (_foreign_threads_s(caller) - foreign)
            record["other_cpu"] = round(max(others, 0.0) / record["elapsed_s"], 2)
    except (RuntimeError, ValueError, DelegateError, ExecutionError) as e:
        log.info("%s: executors not calibrated: %s", where, e)
        return {"functions": {}, "note": f"not calibrated: its functions could not run on example inputs ({e})"}
    finally:
        for model in models.values():
            model.close()
    log.info("%s: executors calibrated in %.2f s: %s", where, record["elapsed_s"], describe(record))
    return record


def _machine_busy_s() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot, steal time included (/proc/stat); None
    where unreadable (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
    ticks = [int(v) for v in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _foreign_threads_s(caller: int) -> float:
    """CPU seconds the threads of this process have used but the calling thread (`caller`, a native thread id)
    and IREE's own (named iree-*: task workers, the proactor): work the calibration does not do, which takes the
    cores from it as surely as another process would (an application's threads, another engine's pool spinning
    after its calls as ONNX Runtime's does), and which the process's own CPU time hid. Read in nanoseconds from
    schedstat where the kernel keeps it (a small model's calibration lasts 40 ms: clock ticks of 10 ms would
    make its share a coin toss), else from stat's ticks. A thread that ended meanwhile takes its time with it
    (what it used is not counted); 0.0 where /proc is unreadable."""
    total = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    precise = _schedstat_kept()
    for task in tasks:
        if task == str(caller):
            continue
        folder = f"/proc/self/task/{task}"
        try:
            with open(f"{folder}/stat") as f:
                stat = f.read()
            if precise:
                with open(f"{folder}/schedstat") as f:
                    on_cpu_ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # ended since the listing
            continue
        name, _, rest = stat.partition(" (")[2].rpartition(") ")
        if name.startswith("iree-"):
            continue
        if precise:
            total += on_cpu_ns / 1e9
        else:
            fields = rest.split()  # from the state on: utime and stime are the 12th and 13th
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@functools.lru_cache(maxsize=1)
def _schedstat_kept() -> bool:
    """Whether this kernel counts each thread's time on the CPU in /proc/.../schedstat (CONFIG_SCHED_INFO): the
    calling thread, running now, has used some."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[0]) > 0
    except (OSError, ValueError, IndexError):
        return False


def merge(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """The record after measuring again (backend option `recalibrate`): `new`'s figures replace those of the
    functions it timed; `old`'s figures of other functions (served by other loads of the entry) stay, unless they
    were measured with another number of task workers or `new` timed nothing, then `new` alone."""
    if not old or not new.get("functions") or old.get("workers") != new.get("workers"):
        return dict(new)
    # Figures kept from another wait of the calling thread say so: the record's wait becomes the new figures'.
    waited, kept = old.get("caller_wait", "normal"), dict(old.get("functions") or {})
    if waited != new.get("caller_wait", "normal"):
        kept = {f: {"caller_wait": waited, **t} for f, t in kept.items()}
    return {**old, **new, "functions": {**kept, **new["functions"]}}


def describe(record: Mapping[str, Any] | None) -> str:
    """One line for logs and `onecopy inspect`: each function's mean latency on both executors, the choice, the
    medians where the record has them, and how busy the machine was (and how often that made loads time it again)."""
    if not record:
        return "not calibrated"
    timed = record.get("functions") or {}
    if not timed:
        return str(record.get("note") or "not calibrated")
    def medians(t: Mapping[str, Any]) -> str:  # records made before medians were kept have none
        return (f"; medians {t['parallel_p50_ms']:.3f} / {t['inline_p50_ms']:.3f}"
                if "parallel_p50_ms" in t and "inline_p50_ms" in t else "")

    line = ", ".join(f"{f} parallel {t['parallel_ms']:.3f} / inline {t['inline_ms']:.3f} ms "
                     f"({choose(record, [f])}{medians(t)})" for f, t in timed.items())
    others = record.get("other_cpu")
    waited = f"; the caller waited as a {record['caller_wait']} thread" if "caller_wait" in record else ""
    retimes = record.get("busy_retimes")
    again = (f" (timed again by {retimes} of at most {BUSY_RETIMES} loads, earlier figures having been taken on "
             "a busy machine)" if isinstance(retimes, int) and retimes > 0 else "")
    return line + waited + (f"; other processes and threads used {others:.2f} cores meanwhile{again}"
                            if isinstance(others, (int, float)) else "")
