"""The lock of one surface: readers share it, a writer holds it alone, across threads and processes.

Across processes it is a slot per process in the surface's shared header, read and written with atomics: no
system call when nobody else holds the lock. A process that dies holding it is found out by whoever waits for it
(`LockCore.reap`: the dead owner's byte lock on its slot is gone) and its slot is cleared. Within a process the
slot is taken once, and the in-process state says which threads hold the lock.

That state and the slots live in a small C type (`_lockcore.c`): the engine locks bound surfaces around every
call, right after a call that streamed a frame through the caches, and in Python that bookkeeping cost 25-30 us
a 1080p frame. `take_all`/`give_all` take and give back all of one engine call's locks in one C call each;
`acquire`/`release` are the pair for everything else, and `Surface.lock()` wraps them in a context manager that
also yields the data. What may wait (a lock held by another process or thread, with a timeout) is Python, here.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Sequence
from threading import get_ident

from onecopy.errors import InvalidArgument, OnecopyError
from onecopy.surface._lockcore import LockCore, give_all, take_all
from onecopy.surface.header import SLOT_COUNT, SLOTS_AT, SLOTS_USED_AT

__all__ = ["SurfaceLock", "closed_error", "take_all", "give_all", "wake_waiting"]

_POLL_MAX_S = 0.002  # a lock held by another process is retried at most this far apart


def closed_error(name: str, what: str) -> InvalidArgument:
    return InvalidArgument(
        f"Surface '{name}' is closed; {what} needs an open surface. Open it again with Surface.open('{name}')."
    )


class SurfaceLock:
    """Reader/writer lock of the surface mapped as `surface_map` (file `fd`). A writer's release moves the
    generation counter at byte `generation_at` on while it still holds the lock (so no other process bumps it at
    once).

    It holds no reference to its `Surface` (a cycle would keep a dropped surface, and its descriptor, alive
    until the garbage collector runs): the surface calls `mark_closed()` under `cond`, which wakes waiters with
    an error."""

    def __init__(self, fd: int, name: str, surface_map: mmap.mmap, generation_at: int) -> None:
        self._name = name
        try:
            self.core = LockCore(fd, surface_map, generation_at, SLOTS_USED_AT, SLOTS_AT, SLOT_COUNT)
        except BlockingIOError as e:
            raise OnecopyError(
                f"Surface '{name}' is in use by {SLOT_COUNT} surface objects at once (processes, or the same surface "
                "opened several times), the most its lock can serve; close it where it is no longer needed."
            ) from e
        # Waiters of the slow path sleep on it (a release wakes them); the surface also guards its own state with
        # it (closed, views handed out).
        self.cond = threading.Condition()
        # Read locks taken through `acquire`, per thread: a thread that reads may not also ask for the write lock
        # (it would wait for itself: the write lock waits until no thread of this process reads). The engine's own
        # read locks are not counted here: no thread can ask for another lock while it is inside an engine call.
        self._reader_threads: dict[int, int] = {}

    @property
    def closed(self) -> bool:
        return bool(self.core.closed)

    def mark_closed(self) -> None:
        """The surface is closed: later acquires raise, waiting ones wake and raise, and the lock lets go of the
        map (the surface can unmap it). Call under `cond`."""
        self.core.mark_closed()
        self.cond.notify_all()

    def _check_open(self) -> None:
        if self.core.closed:
            raise closed_error(self._name, "lock()")

    def held(self) -> str | None:
        """What this process holds ("a write lock", "2 read lock(s)"), or None."""
        core = self.core
        if core.writer:
            return "a write lock"
        return f"{core.readers} read lock(s)" if core.readers else None

    def acquire(self, readonly: bool = False, timeout: float | None = None, *, track: bool = True) -> None:
        """Take the lock for the calling thread; `timeout` seconds (0: don't wait) or None (wait for ever).
        `track=False` (the engine's read locks): not counted as this thread's, see `_reader_threads`."""
        thread = get_ident()
        if not self.core.try_acquire(readonly, thread):
            self._acquire_waiting(readonly, timeout, thread)
        if readonly and track:
            threads = self._reader_threads
            threads[thread] = threads.get(thread, 0) + 1

    def _acquire_waiting(self, readonly: bool, timeout: float | None, thread: int) -> None:
        """The slow path of `acquire`: closed, nested, or held elsewhere (then poll until free or timed out)."""
        core = self.core
        with self.cond:
            self._check_open()
            # A thread asking for the write lock while it holds the lock would wait for itself for ever: refuse.
            if core.writer == thread or (not readonly and thread in self._reader_threads):
                raise InvalidArgument(
                    f"Surface '{self._name}': this thread already holds a lock on it; a write lock cannot be nested. "
                    "Leave the outer `with surface.lock()` block first."
                )
            deadline = None if timeout is None else time.monotonic() + timeout
            poll = 0.0001
            while True:
                self._check_open()
                if core.try_acquire(readonly, thread) or (core.reap() and core.try_acquire(readonly, thread)):
                    return  # (reap: a process that held the lock and died no longer blocks it)
                # Poll: a timeout and close() must be honoured, and another process cannot signal this one.
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    mode = "read" if readonly else "write"
                    waited = "without waiting" if timeout == 0 else f"within {timeout:g} s"
                    raise OnecopyError(
                        f"Surface '{self._name}' is locked by another process or thread; could not take the {mode} "
                        f"lock {waited}. Retry later or pass a longer timeout=."
                    )
                core.waiting += 1
                try:
                    self.cond.wait(poll if remaining is None else min(poll, remaining))
                finally:
                    core.waiting -= 1
                poll = min(poll * 2, _POLL_MAX_S)

    def release(self, readonly: bool = False, *, track: bool = True) -> None:
        """Give back the lock the calling thread took with `acquire(readonly, track=track)`. Releasing a lock this
        thread does not hold is an error: it would release another thread's (the slot and the counters are the
        process's), and that thread would then write while a reader or a second writer gets in."""
        if readonly and track:
            thread = get_ident()
            threads = self._reader_threads
            held = threads.get(thread, 0) - 1
            if held < 0:
                raise InvalidArgument(f"Surface '{self._name}': this thread holds no read lock on it to release.")
            if held:
                threads[thread] = held
            else:
                del threads[thread]
        elif not readonly and self.core.writer != get_ident():
            holder = "another thread holds it" if self.core.writer else "nobody in this process holds it"
            raise InvalidArgument(
                f"Surface '{self._name}': this thread holds no write lock on it to release ({holder}); release only "
                "a lock the same thread acquired, or use `with surface.lock():`."
            )
        if self.core.release(readonly):
            self.wake_waiters()

    def wake_waiters(self) -> None:
        """Wake the threads waiting for this lock (after a release that said some wait)."""
        with self.cond:
            self.cond.notify_all()


def wake_waiting(locks: Sequence[SurfaceLock]) -> None:
    """After `give_all` said threads wait: wake those of every lock given back."""
    for lock in locks:
        if lock.core.waiting:
            lock.wake_waiters()
