"""The `.onecopy` file: a fixed preamble, a JSON header (the typed schema) and the named data segments.

    offset 0   magic (8 bytes) | format version (u32) | reserved (u32) | header length (u64) | data offset (u64)
    32         header: JSON of `ProgramDef`
    data       segments, each aligned as recorded (parameters and bundles on a page boundary)

Saving is atomic (temp file, fsync, rename): a crash never leaves a half-written program under the final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Union

import msgspec

from onecopy.errors import ExportError, InvalidArgument, OnecopyError, ProgramFormatError
from onecopy.program.data_store import PAGE_SIZE, Blob, NamedData, NamedDataStore
from onecopy.program.schema import ProgramDef, SegmentDef
from onecopy.program.validate import Problem, hash_problems, structure_problems

__all__ = ["MAGIC", "FORMAT_VERSION", "ProgramFile", "LoadedProgramFile", "read_program", "check_program"]

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

    def _layout(self) -> tuple[bytes, int, list[tuple[int, Blob]]]:
        offsets: dict[str, int] = {}
        placed: list[tuple[int, Blob]] = []
        cursor = 0
        for blob in self.data.unique_blobs():
            cursor = _align(cursor, blob.alignment)
            offsets[blob.sha256] = cursor
            placed.append((cursor, blob))
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
        for offset, blob in placed:
            view = blob.data
            out.write(b"\0" * (data_offset + offset - position))
            out.write(view)
            position = data_offset + offset + view.nbytes
            # The store holds its blobs by reference: an exported program's parameters are the model's own tensors.
            # Changed in place since they were added (a training step, load_state_dict into the same model), they
            # would be written under the hash of their old bytes: a file whose weights are not the exported ones,
            # which verify calls corrupted and the specialization cache (keyed by those hashes) may mix up with
            # the old weights' packed copy.
            if hashlib.sha256(view).hexdigest() != blob.sha256:
                keys = [key for key, b in self.data.items() if b is blob]
                raise ExportError(
                    f"Named data {', '.join(repr(k) for k in keys)} changed after the program was made (a program "
                    "holds the model's weights by reference, not a copy: they were modified in place since "
                    "export_program, e.g. by a training step or load_state_dict). Save the program before changing "
                    "the model, or export it again."
                )
        return position

    def to_bytes(self) -> bytes:
        import io

        buffer = io.BytesIO()
        self.write_to(buffer)
        return buffer.getvalue()

    def save(self, path: Union[str, os.PathLike[str]]) -> Path:
        """Write the program to `path` atomically and return the path."""
        return write_atomically(path, self.write_to, "the program")


def write_atomically(path: Union[str, os.PathLike[str]], write: Callable[[BinaryIO], object], what: str) -> Path:
    """Write `path` through `write(file)` into a temporary file beside it, fsync, rename: readers see the old file
    or the whole new one, never a half-written one, whatever happens midway. `what` names it in errors."""
    target = Path(path)
    if target.is_dir():
        raise InvalidArgument(f"Cannot save {what} to '{target}': it is a directory; give a file name.")
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise InvalidArgument(f"Cannot save {what} to '{target}': directory '{directory}' does not exist.")
    # Made with mode 0666 for the kernel to apply the umask, as to any new file (mkstemp makes 0600: renamed into
    # place, a program saved for a server running as another user could be read by its owner alone).
    tmp = str(directory / f".{target.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise InvalidArgument(f"Cannot save {what} to '{target}': no file can be made in directory '{directory}' "
                              f"({e.strerror or e}); give a path in a writable directory.") from e
    try:
        with contextlib.suppress(OSError):  # a file saved over keeps its mode (none there: the new file's)
            os.fchmod(fd, target.stat().st_mode & 0o7777)
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise OnecopyError(f"Could not save {what} to '{target}' ({e.strerror or e}); nothing was written there "
                           "(a file already at that path is unchanged). Free space or give another path.") from e
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


Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]


def read_program(source: Source) -> LoadedProgramFile:
    """Parse a program from a path (memory-mapped, read-only) or from bytes (used in place, not copied).

    The whole header is checked against itself and the file's size (`onecopy.program.validate`): a damaged,
    truncated or foreign file raises `ProgramFormatError` naming the file and the first problem; segment bytes
    are not hashed (`check_program` does, for `onecopy verify`)."""
    buffer, mapped, path, where = _open(source)
    try:
        definition, header_end, data_offset = _parse_header(buffer, where)
        problems = structure_problems(definition, file_size=buffer.nbytes, header_end=header_end,
                                      data_offset=data_offset, page_size=PAGE_SIZE)
        if problems:
            others = len(problems) - 1
            more = f" (and {others} more problem{'s' if others > 1 else ''})" if others else ""
            raise ProgramFormatError(
                f"Program '{where}' is damaged or was not written by onecopy: {problems[0]}{more}. Re-export or "
                f"re-copy the program; {_verify_hint(path)} lists every problem."
            )
        named_data = _named_data(buffer, definition, data_offset)
    except BaseException:
        _release(buffer, mapped)
        raise
    return LoadedProgramFile(definition, named_data, where, path, buffer, mapped)


def _verify_hint(path: Path | None) -> str:
    return f"`onecopy verify {path}`" if path is not None else "onecopy.runtime.verify_program(data)"


def check_program(source: Source) -> tuple[LoadedProgramFile | None, list[Problem]]:
    """Every structural problem of a program and, when its segments lie within the file, the program (views of
    the segments that can be read) with each segment's bytes checked against its sha256.

    Never raises for what the file holds; a path that cannot be opened (missing, a directory, no permission)
    is `InvalidArgument`. The caller closes the program it gets."""
    try:
        buffer, mapped, path, where = _open(source)
    except ProgramFormatError as e:  # empty
        return None, [Problem("file", str(e))]
    try:
        try:
            definition, header_end, data_offset = _parse_header(buffer, where)
        except ProgramFormatError as e:
            _release(buffer, mapped)
            return None, [Problem("header", str(e))]
        problems = structure_problems(definition, file_size=buffer.nbytes, header_end=header_end,
                                      data_offset=data_offset, page_size=PAGE_SIZE)
        named_data = _named_data(buffer, definition, data_offset, skip_outside=True)
        problems.extend(hash_problems(definition.segments, named_data))
    except BaseException:
        _release(buffer, mapped)
        raise
    return LoadedProgramFile(definition, named_data, where, path, buffer, mapped), problems


def _open(source: Source) -> tuple[memoryview, mmap.mmap | None, Path | None, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        try:
            buffer = memoryview(source).cast("B")
        except TypeError as e:
            raise InvalidArgument(f"A program given as bytes must be one contiguous buffer: {e}.") from e
        return buffer, None, None, "<bytes>"
    if not isinstance(source, (str, os.PathLike)):
        # export_program's result is the ordinary thing to pass by mistake: say how to get one of the two.
        hint = (" Save it first (program.save(path)) or pass program.to_bytes()."
                if isinstance(source, ProgramFile) else "")
        raise InvalidArgument(f"A program is loaded from a path or bytes, got {type(source).__name__}.{hint}")
    path = Path(source)
    where = str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ProgramFormatError(f"Program file '{where}' is empty; re-export it.")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # Weights read in place from the program come into the page cache in huge folios where the filesystem
        # can, so the engine can map them with huge pages (onecopy.delegate.page_map); no THP: 4 KiB pages.
        with contextlib.suppress(OSError, AttributeError):
            mapped.madvise(mmap.MADV_HUGEPAGE)
    except FileNotFoundError:
        raise InvalidArgument(f"Program file '{where}' does not exist.") from None
    except IsADirectoryError:
        raise InvalidArgument(f"Program path '{where}' is a directory, not a program file.") from None
    except PermissionError as e:
        raise InvalidArgument(f"Program file '{where}' cannot be read: {e.strerror}.") from e
    except (OSError, ValueError) as e:  # a FIFO, a device, a file mmap refuses
        raise InvalidArgument(f"Program file '{where}' cannot be mapped: {e}. Give a regular file.") from e
    return memoryview(mapped), mapped, path, where


def _release(buffer: memoryview, mapped: mmap.mmap | None) -> None:
    """Drop the buffer after a failed parse without hiding the failure: a view still referenced (by a traceback,
    say) keeps the mapping alive until it goes, which is safe; raising BufferError over the real error is not."""
    try:
        buffer.release()
    except BufferError:
        pass
    if mapped is not None:
        try:
            mapped.close()
        except BufferError:
            pass


def _parse_header(buffer: memoryview, where: str) -> tuple[ProgramDef, int, int]:
    """The header's definition, where the header ends and where the data starts (checked by the caller)."""
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
        with buffer[_PREAMBLE.size : header_end] as header:
            definition = msgspec.json.decode(header, type=ProgramDef)
    except msgspec.ValidationError as e:
        raise ProgramFormatError(f"Program '{where}' violates the schema: {e}. Re-export the program.") from e
    except (msgspec.DecodeError, RecursionError) as e:
        raise ProgramFormatError(f"Program '{where}' has a corrupted header: {e}. Re-export the program.") from e
    return definition, header_end, data_offset


def _named_data(buffer: memoryview, definition: ProgramDef, data_offset: int, *,
                skip_outside: bool = False) -> NamedData:
    """Views of the segments: checked to lie within the buffer already, or (`skip_outside`) left out if not."""
    size = buffer.nbytes
    views: dict[str, memoryview] = {}
    offsets: dict[str, tuple[int, int]] = {}
    digests: dict[str, str] = {}
    for segment in definition.segments:
        start = data_offset + segment.offset
        end = start + segment.length
        if skip_outside and not (data_offset <= start <= end <= size):
            continue
        views[segment.key] = buffer[start:end]
        offsets[segment.key] = (start, segment.length)
        digests[segment.key] = segment.sha256
    return NamedData(views, offsets, digests)
