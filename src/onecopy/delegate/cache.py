"""The specialization cache: a portable bundle is compiled once per machine, then restored by every process.

Layout of a cache directory (format version in the path, so a new format never reads an old one):

    <dir>/v1/entries/<key>/module.vmfb   the specialized module, memory-mapped on restore; empty in the entry of
                                         a `vmfb` program, whose code runs from the program file: that entry
                                         holds the encoded weights only (the file still anchors the entry's lock)
    <dir>/v1/entries/<key>/encoded.bin   the weights encoded (packed) for this machine, each distinct page once
    <dir>/v1/entries/<key>/entry.json    sizes, checksums and what it was built from
    <dir>/v1/entries/<key>/verified      stat stamp of encoded.bin at its last full check (see Guarantees)
    <dir>/v1/index.sqlite                size, last access and hits per entry (LRU eviction)
    <dir>/v1/locks/<key>.lock            cross-process "one specializes, the others wait"
    <dir>/v1/tmp/                        entries being written (published by one rename), and the scratch of a
                                         specialization (iree-compile's encoder output); each named for its process

Guarantees:
- An entry appears whole or not at all: written into tmp/ on the same filesystem, fsynced, renamed into place.
  A process killed at any point leaves at most a tmp/ leftover, named `<kind>-<pid>-...`: the next process to
  open the cache removes it once that pid is gone (anything else there after a day).
- A restored entry is checked against its recorded sizes and checksums (xxh3-128; sha256 of the encoded weights
  would cost a warm load ~80 ms); a bad one is removed, with a warning, and specialized again. The module is
  checksummed on every restore. The encoded weights (as large as the model) are checksummed in full until they
  pass once; the entry then records their stat stamp (inode, size, mtime, ctime), and later restores rehash only
  if it moved: any write, truncation or replacement through the filesystem does. `onecopy cache verify` always
  checks every byte. Entries are never unpickled: JSON metadata and a vmfb, nothing else.
- Within a process, concurrent first loads of one key specialize once (a lock per key); across processes a file
  lock does the same. Loads of different keys never wait on each other.
- The directory stays under `max_bytes` by evicting least recently used entries; an entry that a process holds
  open (a shared flock on its module) is never evicted.

Thread-safety: `SpecializationCache` is safe to use from several threads; `caches.get` returns one instance per
directory identity (device, inode), so a symlink to a cache directory is the same cache.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import re
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from onecopy.delegate.cache_index import CacheIndex, EntryInfo
from onecopy.delegate.page_map import MAP_POPULATE, map_pages, write_pages
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

log = logging.getLogger("onecopy")

CACHE_FORMAT_VERSION = 1
DEFAULT_MAX_CACHE_BYTES = 4 * 2**30
ENV_CACHE_DIR = "ONECOPY_CACHE_DIR"
ENV_DISABLE_CACHE = "ONECOPY_DISABLE_CACHE"
_TMP_MAX_AGE_S = 24 * 3600
# What this process writes into tmp/ starts with `<kind>-<pid>-`, so a later process can tell a dead one's.
_OWNED = re.compile(r"^[a-z]+-(\d+)-")


def _owned_prefix(kind: str) -> str:
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
_MODULE = "module.vmfb"
_ENCODED = "encoded.bin"
_META = "entry.json"
_VERIFIED = "verified"  # stat stamp of encoded.bin when it last passed a full check (not part of the entry's files)


def default_cache_dir() -> Path:
    """`$ONECOPY_CACHE_DIR`, else the platform's user cache directory for onecopy."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("onecopy"))


def cache_disabled() -> bool:
    """`ONECOPY_DISABLE_CACHE=1`: every load specializes (for debugging the compiler path)."""
    return os.environ.get(ENV_DISABLE_CACHE, "").strip().lower() not in ("", "0", "false", "no")


def cache_key(
    *, export_hash: str, packaging: str, compute_units: str, target: str, features: str, compiler: str
) -> str:
    """sha256 of what decides the compiled code. Function bindings are not in it: all delegates of a
    multifunction program share one entry."""
    fields = {
        "export_hash": export_hash,
        "packaging": packaging,
        "compute_units": compute_units,
        "target": target,
        "features": features,
        "compiler": compiler,
        "format": CACHE_FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class CacheIdentity:
    """(st_dev, st_ino) of the opened cache directory: the same for every path (symlink) that reaches it."""

    device: int
    inode: int


class CacheEntry:
    """A restored entry held open: its files, mapped, and a shared lock that keeps eviction away until `close()`.

    The mappings are made from the open files, so they stay valid even if the entry is removed meanwhile.
    """

    def __init__(self, key: str, path: Path, fd: int, maps: dict[str, mmap.mmap], encoded: list[dict]):
        self.key = key
        self.path = path
        self._fd: int | None = fd
        self._maps = maps
        self._encoded = encoded
        self._encoded_views: dict[str, memoryview] | None = None

    def module(self) -> memoryview | None:
        """The specialized module's bytes, in place (page cache), for `VmModule.wrap_buffer`; None for an entry
        that holds encoded parameters only (a `vmfb` program's: its module runs from the program file)."""
        mapped = self._maps.get(_MODULE)
        return memoryview(mapped) if mapped is not None else None

    def encoded(self) -> dict[str, memoryview]:
        """The encoded parameters (scope `encoded`), each rebuilt from encoded.bin's distinct pages."""
        if self._encoded_views is None:
            self._encoded_views = {}
            if self._encoded:
                fd = os.open(self.path.parent / _ENCODED, os.O_RDONLY)
                try:
                    self._encoded_views = {e["name"]: map_pages(fd, e, owner=self) for e in self._encoded}
                finally:
                    os.close(fd)  # the mappings hold the file; the descriptor is not needed
        return self._encoded_views

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops the shared flock

    def __del__(self) -> None:
        self.close()


_SETTLE_S = 2.0


def _checksum(data: object) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def _stamp(st: os.stat_result) -> str:
    """What identifies a file's content without reading it: inode, size, mtime and ctime (ns). Any write through
    the filesystem moves ctime, which no user call can set back; so weights whose stamp matches the one recorded
    at their last full check are the bytes that passed it (the approach Bazel and git take to skip rehashing)."""
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _read_stamp(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _write_stamp(path: Path, stamp: str) -> None:
    """Record a stamp atomically (concurrent restores may write the same one); a failure only costs a rehash."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        tmp.write_text(stamp)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("cache: could not record the verified stamp %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def _settled(st: os.stat_result) -> bool:
    """ctime ticks coarsely (a jiffy): a stamp taken within that tick of the last change could also match a write
    that follows in the same tick (git's "racy" entries). Such a stamp is not recorded; the next restore rehashes."""
    return time.time() - st.st_ctime > _SETTLE_S


def _map(path: Path) -> mmap.mmap | None:
    """The file, mapped read-only with its page tables filled at once (MAP_POPULATE): the restore checksums every
    byte, and one populate costs a fraction of a page fault per 4 KiB (33 MB: ~8 ms of faults otherwise)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | MAP_POPULATE, prot=mmap.PROT_READ)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpecializationCache:
    def __init__(self, directory: Path, identity: CacheIdentity, max_bytes: int):
        self.directory = directory
        self.identity = identity
        self.max_bytes = max_bytes
        self.root = directory / f"v{CACHE_FORMAT_VERSION}"
        self.entries = self.root / "entries"
        self.tmp = self.root / "tmp"
        self.locks = self.root / "locks"
        for d in (self.entries, self.tmp, self.locks):
            d.mkdir(parents=True, exist_ok=True)
        self.index = CacheIndex(self.root / "index.sqlite")
        self._key_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._sweep_tmp()

    # -- public ----------------------------------------------------------------------------------------------

    def scratch(self, kind: str) -> "tempfile.TemporaryDirectory[str]":
        """A directory of this process in tmp/ (a context manager yielding its path), removed on exit, and swept
        by the next process to open the cache if this one is killed first."""
        return tempfile.TemporaryDirectory(prefix=_owned_prefix(kind), dir=self.tmp)

    def entry_dir(self, key: str) -> Path:
        return self.entries / key

    def get_or_specialize(
        self, key: str, specialize: Callable[[], "Specialization"], *, program: str, packaging: str,
        compute_units: str, target: str,
    ) -> tuple[CacheEntry, str]:
        """Restore `key`, or run `specialize(scratch)` (once across threads and processes; `scratch` is a directory
        of its own in tmp/, removed after, for what the compiler writes on the way) and publish its result.

        Returns the opened entry and "restored" or "specialized".
        """
        with self._key_lock(key):
            entry = self._restore(key)
            if entry is not None:
                return entry, "restored"
            from filelock import FileLock

            with FileLock(self.locks / f"{key}.lock"):
                entry = self._restore(key)  # another process may have published it while we waited
                if entry is not None:
                    return entry, "restored"
                with self.scratch("specialize") as scratch:
                    result = specialize(scratch)
                self._publish(key, result, program=program, packaging=packaging, compute_units=compute_units,
                              target=target)
            entry = self._restore(key)
            if entry is None:
                raise DelegateError(f"The cache entry {key[:12]} in '{self.directory}' vanished right after it was written.")
            self._evict(keep=key)
            return entry, "specialized"

    def ls(self) -> list[EntryInfo]:
        return self.index.ls()

    def total_bytes(self) -> int:
        return self.index.total_bytes()

    def verify(self) -> list[tuple[str, str]]:
        """Check every entry; remove bad ones. Returns (key, problem) for each removed entry."""
        removed = []
        for path in sorted(self.entries.iterdir()):
            problem = self._check(path.name)
            if problem is not None:
                removed.append((path.name, problem))
                self._remove(path.name)
        # Rows whose entry directory is gone (removed by hand) are dropped too.
        for info in self.index.ls():
            if not (self.entries / info.key).exists():
                self.index.forget(info.key)
        return removed

    def clear(self) -> int:
        """Remove every entry not in use. Returns how many were removed."""
        count = 0
        for path in sorted(self.entries.iterdir()):
            if self._remove(path.name, only_if_unused=True):
                count += 1
        return count

    # -- internals -------------------------------------------------------------------------------------------

    def _key_lock(self, key: str) -> threading.Lock:
        with self._guard:
            lock = self._key_locks.get(key)
            if lock is None:
                lock = self._key_locks[key] = threading.Lock()
            return lock

    def _open_checked(
        self, key: str, trusted: str | None = None
    ) -> tuple[dict[str, mmap.mmap], dict, str | None] | str:
        """Check the entry's files against entry.json and map the module: (maps, meta, stamp), or what is wrong.

        Every file's size is checked, and every file is checksummed except the encoded weights when their stat
        stamp equals `trusted`, the stamp recorded when they last passed a full check (see `_stamp`). `stamp` is
        the stamp to record now: that of weights just checked in full and settled, else None.
        """
        path = self.entries / key
        stamp_to_record = None
        try:
            meta = json.loads((path / _META).read_text())
            files = meta["files"]
            maps = {}
            for name, info in files.items():
                st = (path / name).stat()
                if st.st_size != info["size"]:
                    return f"truncated: {name} has {st.st_size} bytes, recorded {info['size']}"
                stamp = _stamp(st) if name == _ENCODED else None
                if stamp is not None and stamp == trusted:
                    continue  # unchanged since it last checked whole; restore maps it page by page itself
                mapped = _map(path / name)
                if _checksum(mapped if mapped is not None else b"") != info["checksum"]:
                    return f"checksum mismatch in {name}"
                if name != _MODULE:
                    if mapped is not None:
                        mapped.close()
                    stamp_to_record = stamp if stamp is not None and _settled(st) else None
                elif mapped is not None:
                    maps[name] = mapped
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"unreadable ({e.__class__.__name__}: {e})"
        if meta.get("key") != key or _MODULE not in files or (_MODULE not in maps and meta.get("module", True)):
            return "metadata names another key or no module"
        return maps, meta, stamp_to_record

    def _check(self, key: str) -> str | None:
        """None when the entry is whole (every byte checked), else what is wrong with it."""
        result = self._open_checked(key)
        if isinstance(result, str):
            return result
        for mapped in result[0].values():
            mapped.close()
        return None

    def _restore(self, key: str) -> CacheEntry | None:
        path = self.entries / key
        if not path.exists():
            return None
        try:
            fd = os.open(path / _MODULE, os.O_RDONLY)
        except FileNotFoundError:  # evicted, or never whole
            fd = None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)  # from here on no process evicts it under us
        trusted = _read_stamp(path / _VERIFIED)
        result = self._open_checked(key, trusted)
        if isinstance(result, str):
            if fd is not None:
                os.close(fd)
            log.warning("cache entry %s in %s is corrupted (%s); removing it and specializing again",
                        key[:12], self.directory, result)
            self._remove(key)
            return None
        maps, meta, stamp = result
        if stamp is not None:
            _write_stamp(path / _VERIFIED, stamp)
        self.index.touch_later(key)
        return CacheEntry(key, path / _MODULE, fd, maps, meta.get("encoded", []))  # type: ignore[arg-type]

    def _publish(self, key: str, result: "Specialization", **info: str) -> None:
        staging = Path(tempfile.mkdtemp(prefix=f"{_owned_prefix('entry')}{key[:16]}.", dir=self.tmp))
        try:
            with open(staging / _ENCODED, "w+b") as f:
                encoded = write_pages(f, result.encoded)  # each distinct page once
                f.flush()
                os.fsync(f.fileno())
            with open(staging / _MODULE, "wb") as f:
                f.write(result.module if result.module is not None else b"")  # empty: encoded parameters only
                f.flush()
                os.fsync(f.fileno())
            files = {}
            for name in (_MODULE, _ENCODED):
                mapped = _map(staging / name)
                files[name] = {"size": (staging / name).stat().st_size,
                               "checksum": _checksum(mapped if mapped is not None else b"")}
                if mapped is not None:
                    mapped.close()
            meta = {"key": key, "files": files, "encoded": encoded, "data_tiling": result.data_tiling,
                    "module": result.module is not None,
                    "created": time.time(),
                    "format": CACHE_FORMAT_VERSION, **info}
            with open(staging / _META, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(staging)
            os.rename(staging, self.entries / key)
            _fsync_dir(self.entries)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            if e.errno == errno.ENOSPC:
                raise DelegateError(f"The cache directory '{self.directory}' is full; run `onecopy cache clear`.") from e
            raise
        self.index.record(key, size=sum(f["size"] for f in files.values()), **info)

    def _remove(self, key: str, *, only_if_unused: bool = False) -> bool:
        path = self.entries / key
        if only_if_unused and self._in_use(path):
            return False
        # Rename out of entries/ first so no reader ever sees a half-deleted entry.
        trash = self.tmp / f"{_owned_prefix('trash')}{key[:16]}-{time.monotonic_ns()}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            pass
        else:
            shutil.rmtree(trash, ignore_errors=True)
        self.index.forget(key)
        return True

    @staticmethod
    def _in_use(path: Path) -> bool:
        try:
            fd = os.open(path / _MODULE, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def _evict(self, *, keep: str) -> None:
        total = self.total_bytes()
        if total <= self.max_bytes:
            return
        for info in sorted(self.ls(), key=lambda e: e.last_access):
            if total <= self.max_bytes:
                break
            if info.key == keep:
                continue
            if self._remove(info.key, only_if_unused=True):
                log.info("cache: evicted %s (%d bytes) from %s", info.key[:12], info.size, self.directory)
                total -= info.size

    def _sweep_tmp(self) -> None:
        cutoff = time.time() - _TMP_MAX_AGE_S
        for path in self.tmp.iterdir():
            try:
                if _owner_gone(path.name) or path.stat().st_mtime < cutoff:
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
            except OSError:
                pass


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
    path = Path(directory) if directory is not None else default_cache_dir()
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
