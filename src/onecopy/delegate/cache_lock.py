"""One specialization per key: concurrent first loads of a key wait for the one that specializes it.

Within a process a lock per key (threads), across processes a file lock per key in the cache's locks/ folder.
Loads of different keys never wait on each other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["KeyLocks"]


class KeyLocks:
    def __init__(self, locks: Path):
        self._dir = locks
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def in_process(self, key: str) -> threading.Lock:
        """The lock of `key` among this process's threads."""
        with self._guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.Lock()
            return lock

    @contextmanager
    def across_processes(self, key: str) -> Iterator[None]:
        """Hold the file lock of `key` (released by the OS if this process dies holding it)."""
        from filelock import FileLock

        with FileLock(self._dir / f"{key}.lock"):
            yield
