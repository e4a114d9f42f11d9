"""The lock of one surface: readers share it, a writer holds it alone, across threads and processes.

Across processes it is a `flock` on the surface's descriptor (a process that dies drops its locks). Threads of
one process share that descriptor's open file description, where a second flock would silently convert or drop
the first; so the process-level lock is taken once, and a condition guards which threads hold it.

`acquire`/`release` are the cheap pair a caller on a hot path uses (the engine locks bound surfaces around every
call); `Surface.lock()` wraps them in a context manager that also yields the data.
"""

from __future__ import annotations

import fcntl
import mmap
import sys
import threading
import time
from threading import get_ident

from onecopy.errors import InvalidArgument, OnecopyError

__all__ = ["SurfaceLock", "closed_error"]

_POLL_MAX_S = 0.002  # a lock held by another process is retried at most this far apart
_U64_MAX = 2**64 - 1
_SHARED_NOW = fcntl.LOCK_SH | fcntl.LOCK_NB
_EXCLUSIVE_NOW = fcntl.LOCK_EX | fcntl.LOCK_NB


def closed_error(name: str, what: str) -> InvalidArgument:
    return InvalidArgument(
        f"Surface '{name}' is closed; {what} needs an open surface. Open it again with Surface.open('{name}')."
    )


class SurfaceLock:
    """Reader/writer lock over the surface file `fd`. A writer's release moves the generation counter at byte
    `generation_at` of `surface_map` on, under the exclusive flock (so no other process bumps it at once).

    It holds no reference to its `Surface` (a cycle would keep a dropped surface, and its descriptor, alive
    until the garbage collector runs): the surface calls `mark_closed()` under `cond`, which wakes waiters with
    an error."""

    def __init__(self, fd: int, name: str, surface_map: mmap.mmap, generation_at: int) -> None:
        self._fd = fd
        self._name = name
        # The counter as a one-element view: a writer's release bumps it right after an engine call, when every
        # Python object touched misses the caches (invocation.py); indexing a view costs a third of a struct
        # unpack and pack on the map. The header is little-endian (header.py), as this view is on the CPUs onecopy
        # runs on (x86_64, aarch64).
        if sys.byteorder != "little":
            raise OnecopyError("onecopy surfaces need a little-endian CPU.")
        self._generation = memoryview(surface_map)[generation_at:generation_at + 8].cast("Q")
        self.closed = False
        # Guards the in-process state below; flock alone cannot, since threads share one file description. A plain
        # Lock, entered directly on the fast paths: a bound surface is locked around every engine call, and what
        # runs after a call that streamed a frame runs cache-cold (a Python-level RLock/Condition enter costs more).
        self._mutex = threading.Lock()
        self.cond = threading.Condition(self._mutex)
        self._readers = 0
        self._reader_threads: dict[int, int] = {}  # thread -> read locks it holds
        self._waiting = 0  # threads in cond.wait(): a release wakes them only if there are any
        self._writer_thread: int | None = None

    def mark_closed(self) -> None:
        """The surface is closed: later acquires raise, waiting ones wake and raise. Call under `cond`."""
        self.closed = True
        self._generation.release()  # gives the map's export back, so the surface's close can unmap it
        self.cond.notify_all()

    def _check_open(self) -> None:
        if self.closed:
            raise closed_error(self._name, "lock()")

    def held(self) -> str | None:
        """What this process holds ("a write lock", "2 read lock(s)"), or None. Call under `cond`."""
        if self._writer_thread is not None:
            return "a write lock"
        return f"{self._readers} read lock(s)" if self._readers else None

    def acquire(self, readonly: bool = False, timeout: float | None = None) -> None:
        """Take the lock for the calling thread; `timeout` seconds (0: don't wait) or None (wait for ever)."""
        thread = get_ident()
        # Fast path, written out flat (it runs twice per bound surface per engine call): the lock is free in this
        # process and the flock is granted at once, or this process already holds the shared one.
        with self._mutex:
            if not self.closed and self._writer_thread is None:
                try:
                    if readonly:
                        if not self._readers:
                            fcntl.flock(self._fd, _SHARED_NOW)
                        self._readers += 1
                        threads = self._reader_threads
                        threads[thread] = threads.get(thread, 0) + 1
                        return
                    if not self._readers:
                        fcntl.flock(self._fd, _EXCLUSIVE_NOW)
                        self._writer_thread = thread
                        return
                except BlockingIOError:
                    pass  # held by another process: wait below
        self._acquire_waiting(readonly, timeout, thread)

    def _try_flock(self, operation: int) -> bool:
        try:
            fcntl.flock(self._fd, operation | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _acquire_waiting(self, readonly: bool, timeout: float | None, thread: int) -> None:
        """The slow path of `acquire`: closed, nested, or held elsewhere (then poll until free or timed out)."""
        with self.cond:
            self._check_open()
            # flock on one descriptor would silently convert or drop a lock this thread already holds: refuse.
            if self._writer_thread == thread or (not readonly and thread in self._reader_threads):
                raise InvalidArgument(
                    f"Surface '{self._name}': this thread already holds a lock on it; a write lock cannot be nested. "
                    "Leave the outer `with surface.lock()` block first."
                )
            deadline = None if timeout is None else time.monotonic() + timeout
            poll = 0.0001
            while True:
                self._check_open()
                if self._writer_thread is None and readonly and self._readers:
                    self._take_read(thread)  # this process already holds the shared flock
                    return
                if self._writer_thread is None and (readonly or not self._readers):
                    if self._try_flock(fcntl.LOCK_SH if readonly else fcntl.LOCK_EX):
                        if readonly:
                            self._take_read(thread)
                        else:
                            self._writer_thread = thread
                        return
                # Poll rather than block in flock(): a blocked flock could not honour a timeout, and would keep
                # this condition held so other threads could neither time out nor close.
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    mode = "read" if readonly else "write"
                    waited = "without waiting" if timeout == 0 else f"within {timeout:g} s"
                    raise OnecopyError(
                        f"Surface '{self._name}' is locked by another process or thread; could not take the {mode} "
                        f"lock {waited}. Retry later or pass a longer timeout=."
                    )
                self._waiting += 1
                try:
                    self.cond.wait(poll if remaining is None else min(poll, remaining))
                finally:
                    self._waiting -= 1
                poll = min(poll * 2, _POLL_MAX_S)

    def _take_read(self, thread: int) -> None:
        self._readers += 1
        self._reader_threads[thread] = self._reader_threads.get(thread, 0) + 1

    def release(self, readonly: bool = False) -> None:
        """Give back the lock the calling thread took with `acquire(readonly)`."""
        thread = get_ident()
        with self._mutex:
            try:
                if readonly:
                    self._readers -= 1
                    held = self._reader_threads[thread] - 1
                    if held:
                        self._reader_threads[thread] = held
                    else:
                        del self._reader_threads[thread]
                    if self._readers == 0:
                        fcntl.flock(self._fd, fcntl.LOCK_UN)
                else:
                    try:
                        generation = self._generation
                        generation[0] = (generation[0] + 1) & _U64_MAX
                    finally:
                        self._writer_thread = None
                        fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                if self._waiting:
                    self.cond.notify_all()
