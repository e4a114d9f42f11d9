"""The cache index: one sqlite row per cache entry (what it was built from, size, last access, hits).

It only orders eviction and feeds `onecopy cache ls`; the entries on disk are the truth (`verify` drops rows
whose entry is gone). Each thread keeps one connection open for the life of the index (sqlite connections are
not for sharing across threads): opening and closing one per use cost ~6 ms a restore, most of it the WAL
checkpoint sqlite runs when the last connection closes. Other processes write the same index; the busy timeout
makes them take turns, and each use is one short IMMEDIATE transaction.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EntryInfo", "CacheIndex"]


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
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, program TEXT, packaging TEXT, "
                "compute_units TEXT, target TEXT, size INTEGER, created REAL, last_access REAL, hits INTEGER, "
                "verified TEXT)"
            )
            # An index made before `verified` existed: add the column (NULL: check in full on the next restore).
            if "verified" not in {row[1] for row in db.execute("PRAGMA table_info(entries)")}:
                db.execute("ALTER TABLE entries ADD COLUMN verified TEXT")

    def _connection(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            # WAL with synchronous=NORMAL stays consistent across a crash without an fsync per restore; the
            # entries themselves are fsynced when published.
            db.execute("PRAGMA synchronous=NORMAL")
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
        with self._db() as db:
            db.execute(
                f"INSERT OR REPLACE INTO entries ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (key, program, packaging, compute_units, target, size, now, now),
            )

    def touch(self, key: str) -> str | None:
        """Count a use of `key`; returns the stamp recorded when its weights last passed a full check (or None)."""
        with self._db() as db:
            row = db.execute(
                "UPDATE entries SET last_access = ?, hits = hits + 1 WHERE key = ? RETURNING verified",
                (time.time(), key),
            ).fetchone()
        return row[0] if row else None

    def mark_verified(self, key: str, stamp: str) -> None:
        with self._db() as db:
            db.execute("UPDATE entries SET verified = ? WHERE key = ?", (stamp, key))

    def forget(self, key: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM entries WHERE key = ?", (key,))

    def ls(self) -> list[EntryInfo]:
        with self._db() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY last_access DESC").fetchall()
        return [EntryInfo(*row) for row in rows]

    def total_bytes(self) -> int:
        with self._db() as db:
            (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
        return int(total)
