"""The cache index: one sqlite row per cache entry (what it was built from, size, last access, hits).

It only orders eviction and feeds `onecopy cache ls`; the entries on disk are the truth (`verify` drops rows
whose entry is gone). Each thread keeps one connection open for the life of the index (sqlite connections are
not for sharing across threads): opening and closing one per use cost ~6 ms a restore, most of it the WAL
checkpoint sqlite runs when the last connection closes. Other processes write the same index; the busy timeout
makes them take turns, and each use is one short IMMEDIATE transaction.

A restore only counts a use (`touch_later`), and that is off its path: one writer thread per index applies the
touches (connecting to sqlite costs a process ~3 ms, a third of a warm load). Whatever reads the index (`ls`,
eviction, `record`) first waits for the touches queued before it, so it never sees an older order than the
process that asked. Python waits for the writer at exit, so no touch is lost.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EntryInfo", "CacheIndex"]

log = logging.getLogger("onecopy")


@dataclass(frozen=True)
class EntryInfo:
    key: str
    program: str
    packaging: str
    compute_units: str
    target: str
    size: int
    created: float
    last_access: float
    hits: int


_COLUMNS = "key, program, packaging, compute_units, target, size, created, last_access, hits"


class CacheIndex:
    def __init__(self, path: Path):
        self.path = path
        self._local = threading.local()
        self._writer: ThreadPoolExecutor | None = None
        self._writer_pid = 0  # a forked child has no writer thread: it starts its own
        self._pending: list[Future] = []
        self._guard = threading.Lock()

    def _connection(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            # WAL with synchronous=NORMAL stays consistent across a crash without an fsync per restore; the
            # entries themselves are fsynced when published.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, program TEXT, packaging TEXT, "
                "compute_units TEXT, target TEXT, size INTEGER, created REAL, last_access REAL, hits INTEGER)"
            )
            self._local.db = db
        return db

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = self._connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        """Close this thread's connection (others close when their thread's storage goes)."""
        db = getattr(self._local, "db", None)
        if db is not None:
            self._local.db = None
            db.close()

    def record(self, key: str, *, size: int, program: str, packaging: str, compute_units: str, target: str) -> None:
        now = time.time()
        self.flush()
        with self._db() as db:
            db.execute(
                f"INSERT OR REPLACE INTO entries ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (key, program, packaging, compute_units, target, size, now, now),
            )

    def touch(self, key: str) -> None:
        """Count a use of `key` now."""
        with self._db() as db:
            db.execute("UPDATE entries SET last_access = ?, hits = hits + 1 WHERE key = ?", (time.time(), key))

    def touch_later(self, key: str) -> None:
        """Count a use of `key` on the index's writer thread (the time of the use is taken now)."""
        used = time.time()

        def apply() -> None:
            try:
                with self._db() as db:
                    db.execute("UPDATE entries SET last_access = MAX(last_access, ?), hits = hits + 1 WHERE key = ?",
                               (used, key))
            except sqlite3.Error as e:  # the order of eviction is advisory: a lost touch is worth a warning only
                log.warning("cache index %s: could not record a use of %s: %s", self.path, key[:12], e)

        with self._guard:
            if self._writer is None or self._writer_pid != os.getpid():
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onecopy-cache-index")
                self._writer_pid = os.getpid()
                self._pending = []
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._writer.submit(apply))

    def flush(self) -> None:
        """Wait for the touches queued so far (by this process)."""
        with self._guard:
            pending, self._pending = (self._pending, []) if self._writer_pid == os.getpid() else ([], [])
        for future in pending:
            future.result()

    def forget(self, key: str) -> None:
        self.flush()
        with self._db() as db:
            db.execute("DELETE FROM entries WHERE key = ?", (key,))

    def ls(self) -> list[EntryInfo]:
        self.flush()
        with self._db() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY last_access DESC").fetchall()
        return [EntryInfo(*row) for row in rows]

    def total_bytes(self) -> int:
        self.flush()
        with self._db() as db:
            (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
        return int(total)
