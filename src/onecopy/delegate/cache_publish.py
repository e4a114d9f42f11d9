"""Publishing an entry whole, and restoring it checked, healing a damaged one by removing it.

- An entry appears whole or not at all: written into tmp/ on the same filesystem, fsynced, renamed into place.
  A process killed at any point leaves at most a tmp/ leftover, which cache_eviction sweeps.
- A restored entry is checked against its recorded sizes and checksums (xxh3-128; sha256 of the encoded weights
  would cost a warm load ~80 ms); a bad one is removed, with a warning, and the caller specializes again. The
  module is checksummed on every restore. The encoded weights (as large as the model) are checksummed in full
  until they pass once; the entry then records their stat stamp (inode, size, mtime, ctime), and later restores
  rehash only if it moved: any write, truncation or replacement through the filesystem does. `onecopy cache
  verify` always checks every byte. Entries are never unpickled: JSON metadata and a vmfb, nothing else.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onecopy.delegate.cache_entry import ENCODED, META, MODULE, VERIFIED, CacheEntry, CacheLayout
from onecopy.delegate.cache_eviction import owned_prefix, remove_entry
from onecopy.delegate.cache_index import CacheIndex
from onecopy.delegate.cache_key import CACHE_FORMAT_VERSION
from onecopy.delegate.page_map import MADV_HUGEPAGE, MADV_POPULATE_READ, write_pages
from onecopy.errors import DelegateError

if TYPE_CHECKING:
    from onecopy.delegate.specialize import Specialization

__all__ = ["check_entry", "publish_entry", "restore_entry", "update_meta"]

log = logging.getLogger("onecopy")

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
    """The file, mapped read-only with its page tables filled at once: the restore checksums every byte, and one
    populate costs a fraction of a page fault per 4 KiB (33 MB: ~8 ms of faults otherwise). Advised huge first, so
    that the read which brings the file into the page cache brings it in 2 MiB folios where the filesystem can
    (page_map's docstring): every later mapping of the encoded weights, in any process, can then map them huge."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with contextlib.suppress(OSError):  # no THP: 4 KiB pages
        mapped.madvise(MADV_HUGEPAGE)
    with contextlib.suppress(OSError):  # before Linux 5.14: the checksum faults the pages in
        mapped.madvise(MADV_POPULATE_READ)
    return mapped


def _drop_cached(fd: int) -> None:
    """Drop a just-written file's pages from the page cache (they are on disk: fsync). `write_pages` writes page
    by page, which leaves them in 4 KiB folios that no process could map huge; read back through `_map`, they
    come in as 2 MiB folios where the filesystem can (page_map's docstring). Costs one read from disk."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: nothing to gain
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_checked(path: Path, key: str, trusted: str | None = None) -> tuple[dict[str, mmap.mmap], dict, str | None] | str:
    """Check the entry's files against entry.json and map the module: (maps, meta, stamp), or what is wrong.

    Every file's size is checked, and every file is checksummed except the encoded weights when their stat
    stamp equals `trusted`, the stamp recorded when they last passed a full check (see `_stamp`). `stamp` is
    the stamp to record now: that of weights just checked in full and settled, else None.
    """
    stamp_to_record = None
    try:
        meta = json.loads((path / META).read_text())
        files = meta["files"]
        maps = {}
        for name, info in files.items():
            st = (path / name).stat()
            if st.st_size != info["size"]:
                return f"truncated: {name} has {st.st_size} bytes, recorded {info['size']}"
            stamp = _stamp(st) if name == ENCODED else None
            if stamp is not None and stamp == trusted:
                continue  # unchanged since it last checked whole; restore maps it page by page itself
            mapped = _map(path / name)
            if _checksum(mapped if mapped is not None else b"") != info["checksum"]:
                return f"checksum mismatch in {name}"
            if name != MODULE:
                if mapped is not None:
                    mapped.close()
                stamp_to_record = stamp if stamp is not None and _settled(st) else None
            elif mapped is not None:
                maps[name] = mapped
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable ({e.__class__.__name__}: {e})"
    if meta.get("key") != key or MODULE not in files or (MODULE not in maps and meta.get("module", True)):
        return "metadata names another key or no module"
    return maps, meta, stamp_to_record


def check_entry(layout: CacheLayout, key: str) -> str | None:
    """None when the entry is whole (every byte checked), else what is wrong with it."""
    result = _open_checked(layout.entries / key, key)
    if isinstance(result, str):
        return result
    for mapped in result[0].values():
        mapped.close()
    return None


def restore_entry(layout: CacheLayout, index: CacheIndex, key: str) -> CacheEntry | None:
    """The entry of `key`, checked and held open; None when there is none, or it was damaged (then removed)."""
    path = layout.entries / key
    if not path.exists():
        return None
    try:
        fd = os.open(path / MODULE, os.O_RDONLY)
    except FileNotFoundError:  # evicted, or never whole
        fd = None
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_SH)  # from here on no process evicts it under us
    result = _open_checked(path, key, _read_stamp(path / VERIFIED))
    if isinstance(result, str):
        if fd is not None:
            os.close(fd)
        log.warning("cache entry %s in %s is corrupted (%s); removing it and specializing again",
                    key[:12], layout.directory, result)
        remove_entry(layout, index, key)
        return None
    maps, meta, stamp = result
    if stamp is not None:
        _write_stamp(path / VERIFIED, stamp)
    index.touch_later(key)
    return CacheEntry(key, path / MODULE, fd, maps, meta)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def publish_entry(layout: CacheLayout, index: CacheIndex, key: str, result: "Specialization",
                  info: dict[str, str], extra: dict[str, Any]) -> None:
    """Write `result` as the entry of `key`, whole or not at all. `info` goes into the index and entry.json
    (what it was built from), `extra` into entry.json only."""
    staging = Path(tempfile.mkdtemp(prefix=f"{owned_prefix('entry')}{key[:16]}.", dir=layout.tmp))
    try:
        with open(staging / ENCODED, "w+b") as f:
            encoded = write_pages(f, result.encoded)  # each distinct page once
            f.flush()
            os.fsync(f.fileno())
            _drop_cached(f.fileno())  # read back in huge folios by `_map` below
        _write_synced(staging / MODULE, result.module if result.module is not None else b"")  # empty: encoded only
        files = {}
        for name in (MODULE, ENCODED):
            mapped = _map(staging / name)
            files[name] = {"size": (staging / name).stat().st_size,
                           "checksum": _checksum(mapped if mapped is not None else b"")}
            if mapped is not None:
                mapped.close()
        meta = {"key": key, "files": files, "encoded": encoded, "data_tiling": result.data_tiling,
                "module": result.module is not None, "created": time.time(), "format": CACHE_FORMAT_VERSION,
                **({"tuning": result.tuning} if result.tuning is not None else {}),
                **({"executors": result.executors} if result.executors is not None else {}), **extra, **info}
        _write_synced(staging / META, json.dumps(meta, indent=1).encode())
        _fsync_dir(staging)
        os.rename(staging, layout.entries / key)
        _fsync_dir(layout.entries)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise DelegateError(f"The cache directory '{layout.directory}' is full; run `onecopy cache clear`.") from e
        raise
    index.record(key, size=sum(f["size"] for f in files.values()), **info)


def update_meta(layout: CacheLayout, key: str, update: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any] | None:
    """Replace the entry's entry.json with `update(meta)`, whole or not at all (written aside, fsynced, renamed
    over it), and return the new metadata; None when the entry is gone (evicted meanwhile). The caller holds the
    key's cross-process lock, so two updates never interleave. Only what entry.json says beyond its files may
    change: sizes and checksums are kept from the file read, whatever `update` returns."""
    path = layout.entries / key / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DelegateError(f"The cache entry {key[:12]} in '{layout.directory}' has unreadable metadata ({e}); "
                            "run `onecopy cache verify`.") from e
    new = {**update(dict(meta)), "key": meta["key"], "files": meta["files"], "encoded": meta.get("encoded", [])}
    # Staged in tmp/ (same filesystem), named for this process: a kill before the rename leaves a file the next
    # process's sweep removes, never a stray one in the entry.
    fd, name = tempfile.mkstemp(prefix=owned_prefix("meta"), dir=layout.tmp)
    os.close(fd)
    staging = Path(name)
    try:
        _write_synced(staging, json.dumps(new, indent=1).encode())
        os.replace(staging, path)
        _fsync_dir(path.parent)
    except OSError as e:
        staging.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise DelegateError(f"The cache directory '{layout.directory}' is full; run `onecopy cache clear`.") from e
        raise
    return new
