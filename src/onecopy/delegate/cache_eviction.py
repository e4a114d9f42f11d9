"""Keeping a cache directory bounded and clean: removing entries (never one a process holds open), evicting the
least recently used ones past `max_bytes`, and sweeping what killed processes left in tmp/.

What a process writes into tmp/ is named `<kind>-<pid>-...`, so a later process can tell a dead one's leftovers
and remove them at once (anything else there after a day).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import time
from pathlib import Path

from onecopy.delegate.cache_entry import MODULE, CacheLayout
from onecopy.delegate.cache_index import CacheIndex

__all__ = ["evict", "in_use", "owned_prefix", "remove_entry", "sweep_tmp"]

log = logging.getLogger("onecopy")

_TMP_MAX_AGE_S = 24 * 3600
_OWNED = re.compile(r"^[a-z]+-(\d+)-")


def owned_prefix(kind: str) -> str:
    """The name prefix of what this process writes into tmp/."""
    return f"{kind}-{os.getpid()}-"


def _owner_gone(name: str) -> bool:
    """Whether `name` in tmp/ belongs to a process that no longer runs (a process killed mid-specialization)."""
    found = _OWNED.match(name)
    if found is None:
        return False
    pid = int(found.group(1))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def sweep_tmp(tmp: Path) -> None:
    """Remove leftovers of dead processes, and anything older than a day, from a cache's tmp/."""
    cutoff = time.time() - _TMP_MAX_AGE_S
    for path in tmp.iterdir():
        try:
            if _owner_gone(path.name) or path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
        except OSError:
            pass


def in_use(path: Path) -> bool:
    """Whether a process holds the entry at `path` open (restores hold a shared flock on its module)."""
    try:
        fd = os.open(path / MODULE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_entry(layout: CacheLayout, index: CacheIndex, key: str, *, only_if_unused: bool = False) -> bool:
    """Remove an entry and its index row. Returns False when `only_if_unused` and a process holds it open."""
    path = layout.entries / key
    if only_if_unused and in_use(path):
        return False
    # Rename out of entries/ first so no reader ever sees a half-deleted entry.
    trash = layout.tmp / f"{owned_prefix('trash')}{key[:16]}-{time.monotonic_ns()}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        pass
    else:
        shutil.rmtree(trash, ignore_errors=True)
    index.forget(key)
    return True


def evict(layout: CacheLayout, index: CacheIndex, max_bytes: int, *, keep: str) -> None:
    """Remove least recently used entries, except `keep` and those in use, until the cache fits `max_bytes`."""
    total = index.total_bytes()
    if total <= max_bytes:
        return
    for info in sorted(index.ls(), key=lambda e: e.last_access):
        if total <= max_bytes:
            break
        if info.key == keep:
            continue
        if remove_entry(layout, index, info.key, only_if_unused=True):
            log.info("cache: evicted %s (%d bytes) from %s", info.key[:12], info.size, layout.directory)
            total -= info.size
