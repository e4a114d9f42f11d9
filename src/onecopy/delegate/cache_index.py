"""The cache index: one sqlite row per cache entry (what it was built from, size, last access, hits).

It only orders eviction and feeds `onecopy cache ls`; the entries on disk are the truth (`verify` drops rows
whose entry is gone). Each use opens a short-lived connection: sqlite connections are not for sharing across
threads, and other processes write the same index (the busy timeout makes them take turns).
"""

from __future__ import annotations

import sqlite3
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
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, program TEXT, packaging TEXT, "
                "compute_units TEXT, target TEXT, size INTEGER, created REAL, last_access REAL, hits INTEGER)"
            )

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # WAL with synchronous=NORMAL stays consistent across a crash without an fsync per restore; the
            # entries themselves are fsynced when published.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("BEGIN IMMEDIATE")
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    def record(self, key: str, *, size: int, program: str, packaging: str, compute_units: str, target: str) -> None:
        now = time.time()
        with self._db() as db:
            db.execute(
                f"INSERT OR REPLACE INTO entries ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (key, program, packaging, compute_units, target, size, now, now),
            )

    def touch(self, key: str) -> None:
        with self._db() as db:
            db.execute("UPDATE entries SET last_access = ?, hits = hits + 1 WHERE key = ?", (time.time(), key))

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
