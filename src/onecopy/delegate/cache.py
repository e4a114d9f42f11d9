"""The specialization cache: a portable bundle is compiled once per machine, then restored by every process.

One job per module: `cache_key` (what names an entry and a directory), `cache_entry` (an entry's files and a
restored entry held open), `cache_publish` (writing an entry whole, restoring it checked, healing a damaged
one), `cache_eviction` (the size bound and tmp/ leftovers), `cache_lock` (one specialization per key) and
`cache_index` (sizes and last uses). This module puts them together as `SpecializationCache`.

Guarantees: an entry appears whole or not at all; a damaged one is removed and specialized again; concurrent
first loads of one key, in threads or processes, specialize once; the directory stays under `max_bytes` by
evicting least recently used entries, never one a process holds open.

Thread-safety: `SpecializationCache` is safe to use from several threads; `open_cache` returns one instance per
directory identity (device, inode), so a symlink to a cache directory is the same cache.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onecopy.delegate.cache_entry import META, CacheEntry, CacheLayout
from onecopy.delegate.cache_eviction import evict, owned_prefix, remove_entry, sweep_tmp
from onecopy.delegate.cache_index import CacheIndex, EntryInfo
from onecopy.delegate.cache_key import (
    CACHE_FORMAT_VERSION, DEFAULT_MAX_CACHE_BYTES, ENV_CACHE_DIR, ENV_DISABLE_CACHE, CacheIdentity, cache_disabled,
    cache_key, default_cache_dir,
)
from onecopy.delegate.cache_lock import KeyLocks
from onecopy.delegate.cache_publish import check_entry, publish_entry, restore_entry, update_meta
from onecopy.errors import DelegateError, InvalidArgument

if TYPE_CHECKING:
    from onecopy.delegate.specialize import Specialization

__all__ = [
    "CACHE_FORMAT_VERSION",
    "DEFAULT_MAX_CACHE_BYTES",
    "ENV_CACHE_DIR",
    "ENV_DISABLE_CACHE",
    "CacheIdentity",
    "CacheEntry",
    "EntryInfo",
    "SpecializationCache",
    "cache_key",
    "default_cache_dir",
    "open_cache",
    "cache_disabled",
]


class SpecializationCache:
    def __init__(self, directory: Path, identity: CacheIdentity, max_bytes: int):
        self.directory = directory
        self.identity = identity
        self.max_bytes = max_bytes
        self.layout = CacheLayout(directory)
        self.layout.create()
        self.root, self.entries, self.tmp = self.layout.root, self.layout.entries, self.layout.tmp
        self.index = CacheIndex(self.root / "index.sqlite")
        self._locks = KeyLocks(self.layout.locks)
        sweep_tmp(self.tmp)

    def scratch(self, kind: str) -> "tempfile.TemporaryDirectory[str]":
        """A directory of this process in tmp/ (a context manager yielding its path), removed on exit, and swept
        by the next process to open the cache if this one is killed first."""
        return tempfile.TemporaryDirectory(prefix=owned_prefix(kind), dir=self.tmp)

    def entry_dir(self, key: str) -> Path:
        return self.entries / key

    def get_or_specialize(
        self, key: str, specialize: Callable[[str], "Specialization"], *, program: str, packaging: str,
        compute_units: str, target: str, export_hash: str | None = None, precision: str | None = None,
    ) -> tuple[CacheEntry, str]:
        """Restore `key`, or run `specialize(scratch)` (once across threads and processes; `scratch` is a directory
        of its own in tmp/, removed after, for what the compiler writes on the way) and publish its result.
        `export_hash`, when given, is recorded in the entry so `onecopy inspect` can find a program's entries.
        `precision`, when given, is recorded too (its flags are in `key` already: it is there to be read).

        Returns the opened entry and "restored" or "specialized".
        """
        with self._locks.in_process(key):
            entry = restore_entry(self.layout, self.index, key)
            if entry is not None:
                return entry, "restored"
            # Its folders again: this instance lives as long as the process, and a user may have emptied the
            # directory meanwhile (`rm -rf $ONECOPY_CACHE_DIR/*`), which failed the specialization on a missing
            # tmp/ with an error that blamed the program. A few mkdirs, on a miss only.
            self.layout.create()
            with self._locks.across_processes(key):
                entry = restore_entry(self.layout, self.index, key)  # another process may have published it
                if entry is not None:
                    return entry, "restored"
                with self.scratch("specialize") as scratch:
                    result = specialize(scratch)
                info = {"program": program, "packaging": packaging, "compute_units": compute_units, "target": target}
                extra: dict[str, Any] = {"export_hash": export_hash} if export_hash is not None else {}
                if precision is not None:
                    extra["precision"] = precision
                publish_entry(self.layout, self.index, key, result, info, extra)
            entry = restore_entry(self.layout, self.index, key)
            if entry is None:
                raise DelegateError(f"The cache entry {key[:12]} in '{self.directory}' vanished right after it was written.")
            evict(self.layout, self.index, self.max_bytes, keep=key)
            return entry, "specialized"

    def update_meta(self, key: str, update: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any] | None:
        """Rewrite the entry.json of `key` as `update(meta)`, atomically, under the key's locks (so it never
        interleaves with another process's update or specialization of it); None when the entry is gone."""
        with self._locks.in_process(key), self._locks.across_processes(key):
            return update_meta(self.layout, key, update)

    def ls(self) -> list[EntryInfo]:
        return self.index.ls()

    def total_bytes(self) -> int:
        return self.index.total_bytes()

    def verify(self) -> list[tuple[str, str]]:
        """Check every entry; remove bad ones. Returns (key, problem) for each removed entry. A whole entry the
        index has no row for gets one again (see `_reindex`)."""
        removed = []
        indexed = {info.key for info in self.index.ls()}
        for path in sorted(self.entries.iterdir()):
            problem = check_entry(self.layout, path.name)
            if problem is not None:
                removed.append((path.name, problem))
                remove_entry(self.layout, self.index, path.name)
            elif path.name not in indexed:
                self._reindex(path)
        # Rows whose entry directory is gone (removed by hand) are dropped too.
        for info in self.index.ls():
            if not (self.entries / info.key).exists():
                self.index.forget(info.key)
        return removed

    def _reindex(self, entry: Path) -> None:
        """The index row of a whole entry that has none, from its entry.json: after the index was rebuilt (it
        was damaged) or deleted by hand, entries on disk were missing from `cache ls` and never evicted."""
        try:
            meta = json.loads((entry / META).read_text())
            self.index.record(entry.name, size=sum(int(f["size"]) for f in meta["files"].values()),
                              **{field: str(meta[field]) for field in ("program", "packaging", "compute_units",
                                                                       "target")})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # whole, but written without those fields: it stays out of the index, as it was

    def clear(self) -> int:
        """Remove every entry not in use. Returns how many were removed."""
        count = 0
        for path in sorted(self.entries.iterdir()):
            if remove_entry(self.layout, self.index, path.name, only_if_unused=True):
                count += 1
        return count

    def sweep_tmp(self) -> None:
        """Remove what dead processes left in tmp/ (done when the cache opens)."""
        sweep_tmp(self.tmp)


_caches: dict[CacheIdentity, SpecializationCache] = {}
_caches_lock = threading.Lock()


def _same_directory(path: Path, identity: CacheIdentity) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return CacheIdentity(st.st_dev, st.st_ino) == identity


def open_cache(directory: str | os.PathLike[str] | None, *, max_bytes: int | None = None) -> SpecializationCache:
    """The cache at `directory` (None: the default), one instance per directory identity in this process."""
    if directory is not None and os.fspath(directory) == "":
        # Path("") is ".": backend option cache_dir="" put the cache silently into the working directory
        raise InvalidArgument("The cache directory is an empty path; pass a directory, or leave it out for the "
                              f"default (${ENV_CACHE_DIR} or the user cache directory).")
    # Absolute: the instance lives as long as the process, and a relative path (a relative $ONECOPY_CACHE_DIR)
    # would otherwise point its entries, index and locks somewhere else after an os.chdir
    path = (Path(directory) if directory is not None else default_cache_dir()).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as e:
        raise InvalidArgument(
            f"Cache directory '{path}' cannot be created or written ({e.strerror or e}); pass a writable "
            f"cache_dir (Runtime(cache_dir=...) or backend option cache_dir) or set {ENV_CACHE_DIR}."
        ) from e
    if max_bytes is not None and max_bytes <= 0:
        raise InvalidArgument(f"max_cache_bytes must be positive, got {max_bytes}.")
    identity = CacheIdentity(st.st_dev, st.st_ino)
    with _caches_lock:
        cache = _caches.get(identity)
        if cache is not None and cache.directory != path and not _same_directory(cache.directory, identity):
            cache = None  # its directory was removed and the inode reused: a new cache, not an alias
        if cache is None:
            try:
                cache = SpecializationCache(path, identity, max_bytes or DEFAULT_MAX_CACHE_BYTES)
            except (OSError, sqlite3.Error) as e:
                raise InvalidArgument(f"Cache directory '{path}' cannot be used: {e}.") from e
            _caches[identity] = cache
        elif max_bytes is not None:
            cache.max_bytes = max_bytes
        return cache
