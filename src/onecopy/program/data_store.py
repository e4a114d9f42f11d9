"""The named data store: blobs (parameters, bundles) addressed by key, stored once each.

Writing side (`NamedDataStore`): blobs are deduplicated by content hash, so two keys with the same bytes share one
copy in the file; one key given two different contents is an error. Reading side (`NamedData`): zero-copy
`memoryview`s into the mapped file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from onecopy.errors import InvalidArgument, ProgramFormatError

__all__ = ["PAGE_SIZE", "NamedDataStore", "NamedData", "Blob"]

# Parameters and bundles start on a page boundary so they can be memory-mapped and used in place.
PAGE_SIZE = 4096


def _buffer_bytes(data: object) -> memoryview:
    view = memoryview(data)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise InvalidArgument("Named data must be contiguous; pass a contiguous buffer (e.g. np.ascontiguousarray).")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


@dataclass(frozen=True)
class Blob:
    data: memoryview
    sha256: str
    alignment: int


class NamedDataStore:
    """Collects named blobs for a program file, one copy per distinct content."""

    def __init__(self) -> None:
        self._blobs: dict[str, Blob] = {}  # content hash -> blob
        self._keys: dict[str, str] = {}  # key -> content hash

    def add(self, key: str, data: object, *, alignment: int = PAGE_SIZE) -> str:
        """Store `data` under `key` and return its content hash. Adding the same key and bytes again is a no-op."""
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"Named data key must be a non-empty str, got {key!r}.")
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgument(f"Alignment of named data '{key}' must be a power of two, got {alignment}.")
        view = _buffer_bytes(data)
        digest = hashlib.sha256(view).hexdigest()
        known = self._keys.get(key)
        if known is not None and known != digest:
            raise InvalidArgument(
                f"Named data key '{key}' was added twice with different bytes; give each distinct blob its own key."
            )
        blob = self._blobs.get(digest)
        if blob is None or blob.alignment < alignment:
            self._blobs[digest] = Blob(view if blob is None else blob.data, digest, alignment)
        self._keys[key] = digest
        return digest

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self) -> list[str]:
        return list(self._keys)

    def digest(self, key: str) -> str:
        return self._keys[key]

    def items(self) -> Iterator[tuple[str, Blob]]:
        for key, digest in self._keys.items():
            yield key, self._blobs[digest]

    def unique_blobs(self) -> list[Blob]:
        """Each distinct content once, in the order first added."""
        return list(self._blobs.values())

    @property
    def nbytes(self) -> int:
        return sum(blob.data.nbytes for blob in self._blobs.values())


class NamedData(Mapping[str, memoryview]):
    """Read-only view of a loaded program's named data. Values are memoryviews into the program's buffer."""

    def __init__(self, views: dict[str, memoryview], offsets: dict[str, tuple[int, int]], digests: dict[str, str]):
        self._views = views
        self._offsets = offsets
        self._digests = digests

    def __getitem__(self, key: str) -> memoryview:
        try:
            return self._views[key]
        except KeyError:
            raise KeyError(f"The program has no named data '{key}'.") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def location(self, key: str) -> tuple[int, int]:
        """(offset, length) of `key` in the program file, for engines that map the file themselves."""
        return self._offsets[key]

    def sha256(self, key: str) -> str:
        return self._digests[key]

    def verify(self, key: str) -> None:
        """Check `key`'s bytes against the hash recorded at export."""
        if hashlib.sha256(self[key]).hexdigest() != self._digests[key]:
            raise ProgramFormatError(
                f"Named data '{key}' does not match its recorded sha256: the program file is corrupted; re-export it."
            )

    def release(self) -> None:
        for view in self._views.values():
            try:
                view.release()
            except BufferError:  # still exported to the engine: it goes when the engine drops it
                pass
        self._views.clear()
