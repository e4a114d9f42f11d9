"""The cache index: one sqlite row per cache entry (what it was built from, size, last access, hits).

It only orders eviction and feeds `onecopy cache ls`; the entries on disk are the truth (`verify` drops rows
whose entry is gone). Each thread keeps one connection open for the life of the index (sqlite connections are
not for sharing across threads): opening and closing one per use cost ~6 ms a restore, most of it the WAL
checkpoint sqlite runs when the last connection closes. Other processes write the same index; the busy timeout
makes them take turns, and each use is one short IMMEDIATE transaction.

A restore only queues its use (`touch_later`): connecting to sqlite costs a process ~3 ms, a third of a warm
load, and even on another thread it competed with the load for the GIL. A daemon writer applies the queued uses
in one transaction a moment later (`TOUCH_DELAY_S`, once the load has returned its first result), at once when
anything in the process reads the index (`ls`, eviction, `record`: they never see an older order than the
process that asked), and at exit. A forked child starts with no queue, writer or connection of its parent's
(the parent writes what it queued; sqlite connections must not cross a fork).
"""

from __future__ import annotations

import atexit
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EntryInfo", "CacheIndex"]

log = logging.getLogger("onecopy")

TOUCH_DELAY_S = 0.25  # a warm load returns its first result within ~10 ms; its use is written after that


class _Uses:
    """Uses of entries (key, time) waiting to be written by `apply`, on a daemon thread; see the module doc."""

    def __init__(self, apply: Callable[[list[tuple[str, float]]], None]) -> None:
        self._apply = apply
        self.reset()
        atexit.register(self.flush)

    def reset(self) -> None:
        self._cond = threading.Condition()
        self._queued: list[tuple[str, float]] = []
        self._writing = False
        self._urgent = False
        self._thread: threading.Thread | None = None

    def add(self, key: str) -> None:
        with self._cond:
            self._queued.append((key, time.time()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="onecopy-cache-index", daemon=True)
                self._thread.start()

    def flush(self) -> None:
        """Write every use queued so far, now, and return when they are written."""
        with self._cond:
            self._urgent = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._queued and not self._writing, timeout=60)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._urgent, timeout=TOUCH_DELAY_S)
                batch, self._queued = self._queued, []
                if not batch:
                    self._thread = None
                    self._urgent = False
                    self._cond.notify_all()
                    return
                self._writing = True
            try:
                self._apply(batch)
            except sqlite3.Error as e:  # the order of eviction is advisory: a lost use is worth a warning only
                log.warning("cache index: could not record %d use(s): %s", len(batch), e)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()


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


_indexes: weakref.WeakSet[CacheIndex] = weakref.WeakSet()


def _reset_after_fork() -> None:
    # A forked child has no writer thread, a lock its parent's writer held at the fork would stay held for ever,
    # and sqlite connections must not cross a fork: each index starts afresh (the parent writes what it queued).
    for index in list(_indexes):
        index._local = threading.local()
        index._uses.reset()


os.register_at_fork(after_in_child=_reset_after_fork)


class CacheIndex:
    def __init__(self, path: Path):
        self.path = path
        self._local = threading.local()
        self._uses = _Uses(self._apply_uses)
        _indexes.add(self)

    def _connection(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            try:
                db = self._connect()
            except sqlite3.DatabaseError as e:
                if getattr(e, "sqlite_errorcode", None) not in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
                    raise
                # A damaged index (a crash on a filesystem that lost the WAL, or a stray file) failed every load
                # with sqlite's "file is not a database", blamed on the program. The index is advisory (the
                # entries are the truth): remove it and start an empty one.
                log.warning("cache index %s is damaged (%s): starting a new one (`onecopy cache verify` lists the "
                            "entries already on disk in it again)", self.path, e)
                for suffix in ("", "-wal", "-shm"):
                    try:
                        os.unlink(f"{self.path}{suffix}")
                    except FileNotFoundError:
                        pass
                db = self._connect()
            self._local.db = db
        return db

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # WAL with synchronous=NORMAL stays consistent across a crash without an fsync per restore; the
            # entries themselves are fsynced when published.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, program TEXT, packaging TEXT, "
                "compute_units TEXT, target TEXT, size INTEGER, created REAL, last_access REAL, hits INTEGER)"
            )
        except BaseException:
            db.close()
            raise
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

    def record(self, key: str, *, size: int, program: str, packaging: str, compute_units: str, target: str) -> None:
        now = time.time()
        self.flush()
        with self._db() as db:
            db.execute(
                f"INSERT OR REPLACE INTO entries ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (key, program, packaging, compute_units, target, size, now, now),
            )

    def touch_later(self, key: str) -> None:
        """Count a use of `key` (at this time) soon, off the caller's path."""
        self._uses.add(key)

    def _apply_uses(self, uses: list[tuple[str, float]]) -> None:
        with self._db() as db:
            db.executemany("UPDATE entries SET last_access = MAX(last_access, ?), hits = hits + 1 WHERE key = ?",
                           [(used, key) for key, used in uses])

    def flush(self) -> None:
        """Write the uses queued so far (by this process)."""
        self._uses.flush()

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
