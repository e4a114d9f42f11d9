"""A cache entry: the files it is made of, where they live in a cache directory, and a restored entry held open.

    <dir>/v1/entries/<key>/module.vmfb   the specialized module, memory-mapped on restore; empty in the entry of
                                         a `vmfb` program, whose code runs from the program file: that entry
                                         holds the encoded weights only (the file still anchors the entry's lock)
    <dir>/v1/entries/<key>/encoded.bin   the weights encoded (packed) for this machine, each distinct page once
    <dir>/v1/entries/<key>/entry.json    sizes, checksums, what it was built from, how it was tuned and how fast
                                         each function ran on each CPU executor
    <dir>/v1/entries/<key>/verified      stat stamp of encoded.bin at its last full check (see cache_publish)
    <dir>/v1/index.sqlite                size, last access and hits per entry (LRU eviction)
    <dir>/v1/locks/<key>.lock            cross-process "one specializes, the others wait"
    <dir>/v1/tmp/                        entries being written (published by one rename), and the scratch of a
                                         specialization (iree-compile's encoder output); each named for its process
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onecopy.delegate.cache_key import CACHE_FORMAT_VERSION
from onecopy.delegate.page_map import map_pages

__all__ = ["MODULE", "ENCODED", "META", "VERIFIED", "CacheEntry", "CacheLayout"]

MODULE = "module.vmfb"
ENCODED = "encoded.bin"
META = "entry.json"
VERIFIED = "verified"  # stat stamp of encoded.bin when it last passed a full check (not part of the entry's files)


@dataclass(frozen=True)
class CacheLayout:
    """The folders of one cache directory (format version in the path, so a new format never reads an old one)."""

    directory: Path

    @property
    def root(self) -> Path:
        return self.directory / f"v{CACHE_FORMAT_VERSION}"

    @property
    def entries(self) -> Path:
        return self.root / "entries"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def create(self) -> None:
        for d in (self.entries, self.tmp, self.locks):
            d.mkdir(parents=True, exist_ok=True)


class CacheEntry:
    """A restored entry held open: its files, mapped, and a shared lock that keeps eviction away until `close()`.

    The mappings are made from the open files, so they stay valid even if the entry is removed meanwhile.
    `meta` is its entry.json: what it was built from, `tuning` (the configuration chosen and its timings)
    when the specialization was tuned, and `executors` (each function timed on both CPU executors) on a CPU.
    """

    def __init__(self, key: str, path: Path, fd: int | None, maps: dict[str, mmap.mmap], meta: dict[str, Any]):
        self.key = key
        self.path = path
        self.meta = meta
        self._fd: int | None = fd
        self._maps = maps
        self._encoded: list[dict] = meta.get("encoded", [])
        self._encoded_views: dict[str, memoryview] | None = None

    @property
    def tuning(self) -> dict[str, Any] | None:
        return self.meta.get("tuning")

    @property
    def executors(self) -> dict[str, Any] | None:
        return self.meta.get("executors")

    def module(self) -> memoryview | None:
        """The specialized module's bytes, in place (page cache), for `VmModule.wrap_buffer`; None for an entry
        that holds encoded parameters only (a `vmfb` program's: its module runs from the program file)."""
        mapped = self._maps.get(MODULE)
        return memoryview(mapped) if mapped is not None else None

    def encoded(self) -> dict[str, memoryview]:
        """The encoded parameters (scope `encoded`), each rebuilt from encoded.bin's distinct pages."""
        if self._encoded_views is None:
            self._encoded_views = {}
            if self._encoded:
                fd = os.open(self.path.parent / ENCODED, os.O_RDONLY)
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
