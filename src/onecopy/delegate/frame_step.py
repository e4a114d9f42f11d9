"""The frame step: one engine call on bound surfaces, with the method's bookkeeping. Its definition is here.

A frame step is the run of a planned call whose every argument is a bound surface read or written in place
(`Method.prepare(...).run()`, or `Method.execute` repeating a kept plan): it decides nothing. It refuses to run
once the program is closed, decides whether to log, checks out a VM context, takes the surfaces' locks, invokes
the engine function on argument views made once, gives context and locks back (whatever happened), records the
call's `CopyStats` (the same every run: nothing is copied) and returns the output arrays.

`FrameStep` below is that definition, in Python. `_frame_run.FrameRun` (C) is an accelerator of exactly it, built
from the same fields and run by default: what runs after the engine call runs with the interpreter's caches cold
(a call streamed a frame through them), where each Python frame and attribute lookup misses them; measured after
a cache flush, the same steps in one Python closure added ~43 us to the engine call, in C ~17-19
(benchmarks/frame_overhead.py). Set ONECOPY_PYTHON_FRAME_STEP=1 before importing onecopy (or `ACCELERATED =
False` before planning) to run this definition instead; tests/delegate/test_frame_run.py runs both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from threading import get_ident
from typing import Any

from onecopy.surface.lock import give_all, take_all

__all__ = ["ACCELERATED", "FrameStep", "engine_step", "frame_step"]

try:
    from onecopy.delegate._frame_run import FrameRun
except ImportError:  # not built (a source checkout without build_ext): the definition runs, slower
    FrameRun = None

#: Whether `frame_step` makes the C accelerator (read once, at import; tests flip it).
ACCELERATED: bool = FrameRun is not None and not os.environ.get("ONECOPY_PYTHON_FRAME_STEP")


def engine_step(pool: list[Any], new_context: Callable[[], Any], vm_function: Any, arguments: Any, results: Any,
                cores: tuple[Any, ...], modes: tuple[bool, ...], wait_locks: Callable[[int], int],
                wake: Callable[[int], None], engine_error: Callable[[Exception], Exception],
                after: Callable[[], None] | None = None) -> None:
    """The engine call of a step: a VM context checked out of `pool` (or made), the locks `cores` taken in their
    order (`modes`: True reads; `wait_locks(taken)` takes the rest when one would wait and returns how many are
    held), `vm_function` invoked, then context and locks given back whatever happened (`wake(taken)` when a
    thread waits for one); `after()`, when given, runs after the call with the locks still held (copies into
    surfaces of outputs staged in engine buffers). An engine failure (RuntimeError) or refusal (ValueError) raises
    `engine_error(e)`.
    The pool's pop and append need no lock: they are atomic under the GIL."""
    context = pool.pop() if pool else new_context()
    taken = 0
    try:
        # Held for the call: readers share, the surface written in place is exclusive (its generation moves on).
        if cores:
            taken = take_all(cores, modes, get_ident())
            if taken < len(cores):
                taken = wait_locks(taken)  # on an error it gave back what it took; the first `taken` are ours
        try:
            context.invoke(vm_function, arguments, results)
        except (RuntimeError, ValueError) as e:
            raise engine_error(e) from e
        if after is not None:
            after()
    finally:
        pool.append(context)
        if taken and give_all(cores, modes, taken):
            wake(taken)


class FrameStep:
    """A frame step, run by calling it with no arguments. Fields (keyword-only, those of `_frame_run.FrameRun`):

    is_closed() -> bool and on_closed() (raises): the program's closed flag and its error; debug_enabled(level) and
    debug_level: whether to log (`Logger.isEnabledFor`); record(stats, True): logs the stats when debug; local:
    the method's thread-local, whose `.stats` is set to `stats` after each run; outputs: tuple of the output
    arrays, returned as a new list; pool, new_context, vm_function, arguments, result_list (the VmVariantList
    type), result_count, engine_error, cores, modes, wait_locks, wake: see `engine_step`."""

    __slots__ = ("is_closed", "on_closed", "debug_enabled", "debug_level", "record", "local", "stats", "outputs",
                 "pool", "new_context", "vm_function", "arguments", "result_list", "result_count", "engine_error",
                 "cores", "modes", "wait_locks", "wake")

    def __init__(self, *, is_closed: Callable[[], bool], on_closed: Callable[[], None],
                 debug_enabled: Callable[[int], bool], debug_level: int, record: Callable[[Any, bool], None],
                 local: Any, stats: Any, outputs: tuple[Any, ...], pool: list[Any], new_context: Callable[[], Any],
                 vm_function: Any, arguments: Any, result_list: Callable[[int], Any], result_count: int,
                 engine_error: Callable[[Exception], Exception], cores: tuple[Any, ...], modes: tuple[bool, ...],
                 wait_locks: Callable[[int], int], wake: Callable[[int], None]) -> None:
        for name, value, kind in (("outputs", outputs, tuple), ("pool", pool, list), ("cores", cores, tuple),
                                  ("modes", modes, tuple)):
            if not isinstance(value, kind):
                raise TypeError(f"FrameStep: {name} must be a {kind.__name__}, not {type(value).__name__}")
        if len(cores) != len(modes):
            raise ValueError("FrameRun: one mode per lock core")
        self.is_closed, self.on_closed = is_closed, on_closed
        self.debug_enabled, self.debug_level, self.record = debug_enabled, debug_level, record
        self.local, self.stats, self.outputs = local, stats, outputs
        self.pool, self.new_context, self.vm_function, self.arguments = pool, new_context, vm_function, arguments
        self.result_list, self.result_count, self.engine_error = result_list, result_count, engine_error
        self.cores, self.modes, self.wait_locks, self.wake = cores, modes, wait_locks, wake

    def __call__(self) -> list[Any]:
        if self.is_closed():
            self.on_closed()
            raise RuntimeError("the program is closed")
        debug = self.debug_enabled(self.debug_level)  # decided before the engine runs, like everything else
        results = self.result_list(self.result_count)
        engine_step(self.pool, self.new_context, self.vm_function, self.arguments, results, self.cores, self.modes,
                    self.wait_locks, self.wake, self.engine_error)
        self.local.stats = self.stats
        if debug:
            self.record(self.stats, True)
        return list(self.outputs)


def frame_step(**fields: Any) -> Callable[[], list[Any]]:
    """A frame step built from `fields` (see `FrameStep`): the C accelerator when `ACCELERATED`, else the
    definition itself."""
    return (FrameRun if ACCELERATED else FrameStep)(**fields)
