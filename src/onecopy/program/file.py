"""The `.onecopy` file: a fixed preamble, a JSON header (the typed schema) and the named data segments.

    offset 0   magic (8 bytes) | format version (u32) | reserved (u32) | header length (u64) | data offset (u64)
    32         header: JSON of `ProgramDef`
    data       segments, each aligned as recorded (parameters and bundles on a page boundary)

Saving is atomic (temp file, fsync, rename): a crash never leaves a half-written program under the final name.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Union

import msgspec

from onecopy.errors import InvalidArgument, ProgramFormatError
from onecopy.program.data_store import PAGE_SIZE, NamedData, NamedDataStore
from onecopy.program.schema import ProgramDef, SegmentDef

__all__ = ["MAGIC", "FORMAT_VERSION", "ProgramFile", "LoadedProgramFile", "read_program"]

MAGIC = b"\x89ONECPY\n"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<8sIIQQ")


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class ProgramFile:
    """A program ready to be written: its schema (without segments) and its named data."""

    def __init__(self, definition: ProgramDef, data: NamedDataStore):
        self.definition = definition
        self.data = data

    def _layout(self) -> tuple[bytes, int, list[tuple[int, memoryview]]]:
        offsets: dict[str, int] = {}
        placed: list[tuple[int, memoryview]] = []
        cursor = 0
        for blob in self.data.unique_blobs():
            cursor = _align(cursor, blob.alignment)
            offsets[blob.sha256] = cursor
            placed.append((cursor, blob.data))
            cursor += blob.data.nbytes
        segments = [
            SegmentDef(key=key, offset=offsets[blob.sha256], length=blob.data.nbytes, sha256=blob.sha256,
                       alignment=blob.alignment)
            for key, blob in self.data.items()
        ]
        definition = msgspec.structs.replace(self.definition, segments=segments)
        header = msgspec.json.encode(definition)
        data_offset = _align(_PREAMBLE.size + len(header), PAGE_SIZE)
        return header, data_offset, placed

    def write_to(self, out: BinaryIO) -> int:
        header, data_offset, placed = self._layout()
        out.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(header), data_offset))
        out.write(header)
        position = _PREAMBLE.size + len(header)
        for offset, view in placed:
            out.write(b"\0" * (data_offset + offset - position))
            out.write(view)
            position = data_offset + offset + view.nbytes
        return position

    def to_bytes(self) -> bytes:
        import io

        buffer = io.BytesIO()
        self.write_to(buffer)
        return buffer.getvalue()

    def save(self, path: Union[str, os.PathLike[str]]) -> Path:
        """Write the program to `path` atomically and return the path."""
        target = Path(path)
        if target.is_dir():
            raise InvalidArgument(f"Cannot save the program to '{target}': it is a directory; give a file name.")
        directory = target.parent if str(target.parent) else Path(".")
        if not directory.is_dir():
            raise InvalidArgument(f"Cannot save the program to '{target}': directory '{directory}' does not exist.")
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as out:
                self.write_to(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target


@dataclass
class LoadedProgramFile:
    """A parsed program backed by its buffer (an mmap of the file, or the caller's bytes).

    Holds the buffer so the memoryviews of `named_data` (and whatever the engine built on them) stay valid until
    `close()`.
    """

    definition: ProgramDef
    named_data: NamedData
    source: str
    path: Path | None
    _buffer: object
    _mmap: mmap.mmap | None

    def close(self) -> None:
        """Release the views and unmap. A view the engine still holds keeps the mapping alive until it lets go
        (the mapping then goes with its last reference), never freed under the engine."""
        self.named_data.release()
        buffer, self._buffer = self._buffer, None
        if isinstance(buffer, memoryview):
            try:
                buffer.release()
            except BufferError:
                pass
        mapped, self._mmap = self._mmap, None
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:
                pass


def read_program(source: Union[str, os.PathLike[str], bytes, bytearray, memoryview]) -> LoadedProgramFile:
    """Parse a program from a path (memory-mapped, read-only) or from bytes (used in place, not copied)."""
    mapped: mmap.mmap | None = None
    path: Path | None = None
    if isinstance(source, (bytes, bytearray, memoryview)):
        buffer = memoryview(source).cast("B")
        where = "<bytes>"
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        where = str(path)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise ProgramFormatError(f"Program file '{where}' is empty; re-export it.")
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise InvalidArgument(f"Program file '{where}' does not exist.") from None
        except IsADirectoryError:
            raise InvalidArgument(f"Program path '{where}' is a directory, not a program file.") from None
        except PermissionError as e:
            raise InvalidArgument(f"Program file '{where}' cannot be read: {e.strerror}.") from e
        buffer = memoryview(mapped)
    else:
        raise InvalidArgument(f"A program is loaded from a path or bytes, got {type(source).__name__}.")
    try:
        definition, named_data = _parse(buffer, where)
    except BaseException:
        buffer.release()
        if mapped is not None:
            mapped.close()
        raise
    return LoadedProgramFile(definition, named_data, where, path, buffer, mapped)


def _parse(buffer: memoryview, where: str) -> tuple[ProgramDef, NamedData]:
    size = buffer.nbytes
    if size < _PREAMBLE.size:
        if bytes(buffer[: len(MAGIC)]) != MAGIC[: min(size, len(MAGIC))]:
            raise ProgramFormatError(f"'{where}' is not a onecopy program (wrong magic).")
        raise ProgramFormatError(f"Program '{where}' is truncated: {size} bytes, shorter than its preamble.")
    magic, version, _, header_len, data_offset = _PREAMBLE.unpack_from(buffer, 0)
    if magic != MAGIC:
        raise ProgramFormatError(f"'{where}' is not a onecopy program (wrong magic {magic!r}).")
    if version > FORMAT_VERSION:
        raise ProgramFormatError(
            f"Program '{where}' has format version {version}, newer than this onecopy reads ({FORMAT_VERSION}); "
            "upgrade onecopy or re-export the program."
        )
    if version < 1:
        raise ProgramFormatError(f"Program '{where}' has an invalid format version {version}.")
    header_end = _PREAMBLE.size + header_len
    if header_end > size:
        raise ProgramFormatError(
            f"Program '{where}' is truncated: its header needs {header_end} bytes, the file has {size}."
        )
    try:
        definition = msgspec.json.decode(buffer[_PREAMBLE.size : header_end], type=ProgramDef)
    except msgspec.ValidationError as e:
        raise ProgramFormatError(f"Program '{where}' violates the schema: {e}. Re-export the program.") from e
    except msgspec.DecodeError as e:
        raise ProgramFormatError(f"Program '{where}' has a corrupted header: {e}. Re-export the program.") from e
    views: dict[str, memoryview] = {}
    offsets: dict[str, tuple[int, int]] = {}
    digests: dict[str, str] = {}
    for segment in definition.segments:
        start = data_offset + segment.offset
        end = start + segment.length
        if segment.offset < 0 or segment.length < 0 or data_offset < header_end:
            raise ProgramFormatError(f"Program '{where}' has an invalid segment '{segment.key}'. Re-export it.")
        if end > size:
            raise ProgramFormatError(
                f"Program '{where}' is truncated: named data '{segment.key}' ends at byte {end}, "
                f"the file has {size}. Re-export or re-copy the program."
            )
        views[segment.key] = buffer[start:end]
        offsets[segment.key] = (start, segment.length)
        digests[segment.key] = segment.sha256
    return definition, NamedData(views, offsets, digests)
