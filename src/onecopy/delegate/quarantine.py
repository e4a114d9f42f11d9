"""Keeps the Python buffers handed to IREE alive until IREE's own threads can no longer drop the last reference.

IREE's runtime releases a buffer it imported from Python (a parameter's memoryview, the module's bytes) when the
last task that used it retires, and that can happen on one of its worker threads, after the call that used it
has returned. Its Python binding then releases the Python object there without taking the GIL. If that was the
last reference, the object is deallocated without a thread state and the interpreter aborts ("PyThreadState_Get:
the function must be called with the GIL held"). This was seen in 2-6% of processes that ran a call, closed the
program and exited at once (gdb: an iree-worker thread in memory_dealloc -> subtype_dealloc of a mapping).

So onecopy never lets IREE hold the last reference:
- `hold(objects)`: a model that closes hands over what it gave IREE; it stays referenced for `HOLD_S` more
  seconds (a task retires microseconds after its call returns; the margin covers a worker descheduled for a few
  scheduler ticks), then one daemon thread frees it, with the GIL. A process that closed a program therefore
  gives its memory back `HOLD_S` later, not at once.
- At exit, whatever is still held, the buffers of every model still open, and those of programs the garbage
  collector closes during finalization are leaked on purpose: freeing them then would race the same way, no
  thread may start then, and the process is going away anyway.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["HOLD_S", "drain", "hold", "release_due", "track"]

HOLD_S = 0.25

# Reentrant: `hold` runs from a model's close, which the garbage collector may call from a finalizer at any
# allocation, including one made while this very thread is inside a `with _lock` below.
_lock = threading.RLock()
_due = threading.Condition(_lock)  # wakes the releasing thread when something is held
_held: collections.deque[tuple[float, list[Any]]] = collections.deque()  # (due time, objects), oldest first
_open: weakref.WeakSet[Any] = weakref.WeakSet()  # models whose `handed_to_engine` IREE may still reference
_releaser: threading.Thread | None = None
_exiting = False


def track(model: Any) -> None:
    """`model.handed_to_engine` lists what it gave IREE; pinned at exit if the model is still open then."""
    with _lock:
        _open.add(model)


def hold(objects: Sequence[Any], *, now: float | None = None) -> None:
    """Keep `objects` referenced for `HOLD_S` seconds from now; a daemon thread frees them then."""
    objects = list(objects)
    if _exiting or sys.is_finalizing():
        # Past atexit (e.g. a program collected at interpreter exit): no thread may start now (Thread.start would
        # wait for ever), and the process is going away: leak them, as `_pin_at_exit` does.
        _pin(objects)
        return
    now = time.monotonic() if now is None else now
    with _lock:
        _held.append((now + HOLD_S, objects))
        _due.notify()
    release_due(now=now)
    _start_releaser()


def release_due(*, now: float | None = None) -> None:
    """Free what has been held long enough (here, on the calling Python thread)."""
    now = time.monotonic() if now is None else now
    due = []
    with _lock:
        while _held and _held[0][0] <= now:
            due.append(_held.popleft())
    del due  # outside the lock: a freed object's finalizer may come back here


def drain() -> None:
    """Wait until everything held now is due, then free it: for a caller that measures memory after a close."""
    with _lock:
        last = _held[-1][0] if _held else None
    if last is not None:
        delay = last - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    release_due()


def _start_releaser() -> None:
    global _releaser
    with _lock:
        if _releaser is not None:
            return
        _releaser = thread = threading.Thread(target=_release_when_due, name="onecopy-quarantine", daemon=True)
    thread.start()


def _release_when_due() -> None:
    while True:
        with _lock:
            while not _held:
                _due.wait()
            delay = _held[0][0] - time.monotonic()
            if delay > 0:
                _due.wait(delay)
                continue
        release_due()


def _pin(objects: Sequence[Any]) -> None:
    pin = ctypes.pythonapi.Py_IncRef
    pin.argtypes = [ctypes.py_object]
    for obj in objects:
        if obj is not None:
            pin(obj)


def _pin_at_exit() -> None:
    global _exiting
    with _lock:
        _exiting = True
        groups = [objects for _, objects in _held] + [getattr(m, "handed_to_engine", ()) for m in list(_open)]
    for objects in groups:
        _pin(objects)


def _after_fork_in_child() -> None:
    # The releasing thread did not come across the fork, and a lock it held would stay held for ever.
    global _lock, _due, _releaser
    _lock = threading.RLock()
    _due = threading.Condition(_lock)
    _releaser = None


atexit.register(_pin_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
