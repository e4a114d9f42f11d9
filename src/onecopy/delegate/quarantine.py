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
  scheduler ticks), then a timer thread frees it, with the GIL. A process that closed a program therefore gives
  its memory back `HOLD_S` later, not at once.
- At exit, whatever is still held, and the buffers of every model still open, are leaked on purpose: freeing
  them during interpreter finalization would race the same way, and the process is going away anyway.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["HOLD_S", "drain", "hold", "release_due", "track"]

HOLD_S = 0.25

_lock = threading.Lock()
_held: collections.deque[tuple[float, Sequence[Any]]] = collections.deque()  # (due time, objects), oldest first
_open: weakref.WeakSet[Any] = weakref.WeakSet()  # models whose `handed_to_engine` IREE may still reference


def track(model: Any) -> None:
    """`model.handed_to_engine` lists what it gave IREE; pinned at exit if the model is still open then."""
    with _lock:
        _open.add(model)


def hold(objects: Sequence[Any], *, now: float | None = None) -> None:
    """Keep `objects` referenced for `HOLD_S` seconds from now; free what is due meanwhile."""
    now = time.monotonic() if now is None else now
    with _lock:
        _held.append((now + HOLD_S, list(objects)))
    release_due(now=now)
    timer = threading.Timer(HOLD_S + 0.01, release_due)
    timer.daemon = True  # never holds up exit: what is still held then is pinned instead
    timer.start()


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


def _pin_at_exit() -> None:
    pin = ctypes.pythonapi.Py_IncRef
    pin.argtypes = [ctypes.py_object]
    with _lock:
        groups = [objects for _, objects in _held] + [getattr(m, "handed_to_engine", ()) for m in list(_open)]
    for objects in groups:
        for obj in objects:
            if obj is not None:
                pin(obj)


atexit.register(_pin_at_exit)
