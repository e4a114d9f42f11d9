"""Surfaces: named shared-memory buffers of `height` rows of `width` elements, each row padded to 64 bytes.

A surface lives in a file under /dev/shm (`onecopy-<name>`) that every process maps. Another process opens it by
name; the creator owns the name and removes it with `unlink()` (or by leaving its `with` block).

    import numpy as np
    from onecopy.surface import Surface

    with Surface.create(4, 360, dtype="float16") as surface:      # 720-byte rows padded to 768
        with surface.lock() as frame:                              # exclusive, across processes
            frame[:] = np.arange(360, dtype=np.float16)
        with Surface.open(surface.name) as same:                   # what a second process does
            with same.lock(readonly=True) as frame:
                assert frame[3, 359] == 359
        assert surface.generation == 1                             # one writable unlock so far

The data starts one page after a 64-byte header (magic, header version, format, height, width, bytes_per_row,
data offset, generation, flags) that `open` validates before it hands out any memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import stat
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from onecopy.errors import InvalidArgument, OnecopyError
from onecopy.surface.header import (
    CODES,
    DATA_OFFSET,
    FLAG_UNLINKED,
    FLAGS_AT,
    FORMATS,
    GENERATION_AT,
    HEADER,
    HEADER_VERSION,
    MAGIC,
    PREFIX,
    SHM_DIR,
    U64,
    check_dimension,
    check_dtype,
    check_header,
    check_name,
    row_bytes,
)
from onecopy.surface.lock import SurfaceLock, closed_error

__all__ = ["Surface"]

logger = logging.getLogger(__name__)

class Surface:
    """A shared-memory buffer of `height` rows of `width` elements, each row padded to 64 bytes.

    Make one with `Surface.create` or `Surface.open`, not with the constructor. Not reentrant for writing;
    do not use one `Surface` object on both sides of a `fork()` (the lock would be shared): open it by name there.
    """

    def __init__(self, _fd: int, _map: mmap.mmap, *, _name: str, _created: bool, _header: tuple) -> None:
        _, _, code, height, width, bytes_per_row, data_offset, _, _ = _header
        self._name = _name
        self._created = _created
        self._height = height
        self._width = width
        self._dtype = FORMATS[code]
        self._bytes_per_row = bytes_per_row
        self._data_offset = data_offset
        st = os.fstat(_fd)
        self._identity = (st.st_dev, st.st_ino)  # so unlink() never removes a newer surface that took the name
        self._fd = _fd
        self._map: mmap.mmap | None = _map
        probe = ctypes.c_char.from_buffer(_map)
        self._map_address = ctypes.addressof(probe)
        del probe  # it holds an export of the map; close() could not unmap while it lives
        # One class per surface so each exported view holds its own weak-referenceable export of the map.
        self._bytes_type = type("_SurfaceBytes", (ctypes.c_ubyte * self.nbytes,), {"__hash__": object.__hash__})
        self._exports: weakref.WeakSet = weakref.WeakSet()
        self._closed = False
        self._lock = SurfaceLock(_fd, _name, _map, GENERATION_AT)
        self._cond = self._lock.cond  # also guards `_closed` and the exports
        # acquire(readonly=False, timeout=None) / release(readonly=False): the lock without a view, the cheap half
        # of `lock()` for a caller that holds a surface around every call (the engine does, for bound surfaces).
        # Pair them in one thread. The lock's own methods, bound here: no wrapper frame on the engine's hot path.
        self.acquire = self._lock.acquire
        self.release = self._lock.release
        self._unlinked_here = False
        # A surface dropped without close() still gives its descriptor back; the map goes with the last view.
        self._finalizer = weakref.finalize(self, os.close, _fd)

    @classmethod
    def create(cls, height: int, width: int, dtype: Any = "float16", name: str | None = None) -> Surface:
        """Create a surface named `name` (None: a unique generated name). Its memory starts zeroed.

        Raises:
            InvalidArgument: a bad height, width, dtype or name, or a surface of that name already exists.
            OnecopyError: the system cannot provide the shared memory (e.g. /dev/shm is full).
        """
        height = check_dimension(height, "height")
        width = check_dimension(width, "width")
        dtype = check_dtype(dtype)
        name = f"surface-{secrets.token_hex(8)}" if name is None else check_name(name)
        bytes_per_row = row_bytes(width, dtype)
        size = DATA_OFFSET + height * bytes_per_row
        path = os.path.join(SHM_DIR, PREFIX + name)
        header = (MAGIC, HEADER_VERSION, CODES[dtype], height, width, bytes_per_row, DATA_OFFSET, 0, 0)
        # Build the whole surface under a private name and link it into place: an opener never sees a half-written
        # header, and link() fails if the name exists, with no window between the check and the creation.
        temporary = os.path.join(SHM_DIR, f".onecopy-tmp-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise OnecopyError(f"Cannot create surface '{name}' in {SHM_DIR}: {e.strerror}.") from e
        try:
            # Reserve the pages now: on a full tmpfs a sparse file would kill us with SIGBUS on first write.
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, HEADER.pack(*header), 0)
            st = os.fstat(fd)
            os.link(temporary, path)
        except FileExistsError as e:
            raise InvalidArgument(
                f"A surface named '{name}' already exists ({path}); open it with Surface.open('{name}'), "
                "pick another name, or unlink it."
            ) from e
        except OSError as e:
            raise OnecopyError(f"Cannot create surface '{name}' ({size} bytes in {SHM_DIR}): {e.strerror}.") from e
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        # Map it through its final name, so /proc/<pid>/maps shows onecopy-<name> rather than a deleted temporary.
        return cls._from_path(name, created=(st.st_dev, st.st_ino))

    @classmethod
    def open(cls, name: str) -> Surface:
        """Open the surface another process (or this one) created. Closing it never removes the name.

        Raises:
            InvalidArgument: no surface has that name, or its file is not a valid surface.
        """
        return cls._from_path(check_name(name), created=None)

    @classmethod
    def _from_path(cls, name: str, created: tuple[int, int] | None) -> Surface:
        path = os.path.join(SHM_DIR, PREFIX + name)
        where = f"Surface '{name}' ({path})"
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError as e:
            if created:
                raise OnecopyError(f"{where} was unlinked by another process while it was being created.") from e
            raise InvalidArgument(
                f"No surface named '{name}' ({path}); create it first with Surface.create(..., name='{name}')."
            ) from e
        except OSError as e:
            raise OnecopyError(f"Cannot open {where}: {e.strerror}.") from e
        try:
            st = os.fstat(fd)
            if created and (st.st_dev, st.st_ino) != created:
                raise OnecopyError(f"{where} was replaced by another process while it was being created.")
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"{where} is not a regular file; unlink it or pick another name.")
            if st.st_size < HEADER.size:
                raise InvalidArgument(
                    f"{where} holds {st.st_size} bytes, too few for a surface header; unlink it or pick another name."
                )
            surface_map = mmap.mmap(fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        try:
            header = HEADER.unpack_from(surface_map, 0)
            check_header(header, st.st_size, where)
            return cls(fd, surface_map, _name=name, _created=created is not None, _header=header)
        except BaseException:
            with contextlib.suppress(BufferError):  # a view made before the failure keeps it mapped
                surface_map.close()
            os.close(fd)
            raise

    @property
    def name(self) -> str:
        return self._name

    @property
    def path(self) -> str:
        """The backing file: /dev/shm/onecopy-<name>."""
        return os.path.join(SHM_DIR, PREFIX + self._name)

    @property
    def height(self) -> int:
        return self._height

    @property
    def width(self) -> int:
        return self._width

    @property
    def shape(self) -> tuple[int, int]:
        return (self._height, self._width)

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def bytes_per_row(self) -> int:
        """Bytes from one row's start to the next's: width * itemsize rounded up to 64."""
        return self._bytes_per_row

    @property
    def nbytes(self) -> int:
        """Bytes of data, padding included: height * bytes_per_row."""
        return self._height * self._bytes_per_row

    @property
    def dense(self) -> bool:
        """True when rows carry no padding, so `array()` is C-contiguous and can be handed to the engine as is."""
        return self._bytes_per_row == self._width * self._dtype.itemsize

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def views_alive(self) -> int:
        """How many arrays from `array()` / `lock()` (and their slices) still hold the memory."""
        return len(self._exports)

    @property
    def base_address(self) -> int:
        """Address of the first data byte in this process (page-aligned). Keep an `array()` alive while you use it."""
        self._check_open("base_address")
        return self._map_address + self._data_offset

    @property
    def generation(self) -> int:
        """How many writable locks were released, by any process. Read it under a lock for a settled value."""
        self._check_open("generation")
        return U64.unpack_from(self._map, GENERATION_AT)[0]

    @property
    def unlinked(self) -> bool:
        """True once any process has unlinked the surface; the memory stays valid for those that have it mapped."""
        self._check_open("unlinked")
        return bool(U64.unpack_from(self._map, FLAGS_AT)[0] & FLAG_UNLINKED)

    def array(self, *, include_padding: bool = False) -> np.ndarray:
        """A writable numpy view of the shared memory, no copy.

        Shape (height, width) with strides (bytes_per_row, itemsize); with `include_padding=True`, the dense
        (height, bytes_per_row // itemsize) view that also covers the padding. Take `lock()` around reads and writes
        that must not interleave with other processes.
        """
        with self._cond:
            self._check_open("array()")
            exported = self._bytes_type.from_buffer(self._map, self._data_offset)
            self._exports.add(exported)
        itemsize = self._dtype.itemsize
        columns = self._bytes_per_row // itemsize if include_padding else self._width
        return np.ndarray(
            (self._height, columns), self._dtype, buffer=exported, strides=(self._bytes_per_row, itemsize)
        )

    @contextlib.contextmanager
    def lock(
        self, readonly: bool = False, *, blocking: bool = True, timeout: float | None = None
    ) -> Iterator[np.ndarray]:
        """Lock the surface across processes and threads; yields `array()` (read-only when `readonly`).

        Readers share the lock; a writer holds it alone, and its release increments `generation` (even when the
        block raised: the data may have changed). `blocking=False` or `timeout=` seconds give up with
        `OnecopyError` instead of waiting forever. A process that dies releases its locks.
        """
        if not blocking and timeout is not None:
            raise InvalidArgument("Surface.lock: give either blocking=False or timeout=, not both.")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise InvalidArgument(f"Surface.lock: timeout must be a number of seconds >= 0 or None, got {timeout!r}.")
        self._lock.acquire(readonly, 0.0 if not blocking else timeout)
        try:
            view = self.array()
            if readonly:
                view.flags.writeable = False
            yield view
        finally:
            self._lock.release(readonly)

    def close(self) -> None:
        """Stop using the surface in this process. Idempotent; never removes the name (see `unlink`).

        Views from `array()` that are still alive keep the memory mapped until the last of them goes; everything
        else (`array`, `lock`, `base_address`, `generation`) raises `InvalidArgument` from now on.
        """
        with self._cond:
            if self._closed:
                return
            held = self._lock.held()
            if held:
                raise InvalidArgument(
                    f"Surface '{self._name}' cannot be closed while this process holds {held} on it; "
                    "leave the `with surface.lock()` block first."
                )
            self._closed = True
            self._lock.mark_closed()  # threads waiting in lock() wake and raise
            surface_map, self._map = self._map, None
            # Close lazily when views are alive: refusing would make `with Surface.create(...)` raise on exit
            # whenever a frame array outlives it, and unmapping would leave those arrays pointing at freed memory
            # (a segfault). Each view holds an export of the map, so dropping our reference frees it with the last.
            try:
                surface_map.close()
            except BufferError:
                logger.debug("surface '%s' closed with %d views alive; unmapped when they go", self._name,
                             self.views_alive)
            self._finalizer()  # closes the descriptor, exactly once

    def unlink(self) -> None:
        """Remove the name, so no process can open the surface any more; those that have it mapped keep it.

        Sets the shared `unlinked` flag every other holder reads, through this process's mapping, or, once this
        surface is closed, through the file while it still has the name. Idempotent. The creator does it when leaving
        its `with` block; an opener does it only when asked.
        """
        if self._unlinked_here:
            return
        path = self.path
        # Under the condition, so a close() in another thread cannot unmap between the check and the flag's write.
        with self._cond:
            fd = None
            try:
                try:
                    if self._closed:  # no mapping left: reach the header through the file, if it is still ours
                        with contextlib.suppress(OSError):  # gone, a link, not ours: decided below, as when open
                            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                    st = os.fstat(fd) if fd is not None else os.stat(path, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == self._identity:
                        os.unlink(path)
                    elif fd is not None:  # a newer surface that took the name: neither ours to remove nor to flag
                        os.close(fd)
                        fd = None
                except FileNotFoundError:
                    pass  # another process unlinked it first (and set the flag)
                except OSError as e:
                    raise OnecopyError(f"Cannot unlink surface '{self._name}' ({path}): {e.strerror}.") from e
                self._unlinked_here = True
                if not self._closed:
                    flags = U64.unpack_from(self._map, FLAGS_AT)[0]
                    U64.pack_into(self._map, FLAGS_AT, flags | FLAG_UNLINKED)
                elif fd is not None:
                    flags = U64.unpack(os.pread(fd, U64.size, FLAGS_AT))[0]
                    os.pwrite(fd, U64.pack(flags | FLAG_UNLINKED), FLAGS_AT)
            finally:
                if fd is not None:
                    os.close(fd)

    def __enter__(self) -> Surface:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # The creator unlinks first, while its mapping can still set the shared `unlinked` flag; close() runs even
        # when unlink() fails.
        try:
            if self._created:
                self.unlink()
        finally:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"Surface(name={self._name!r}, height={self._height}, width={self._width}, dtype={self._dtype}, "
            f"bytes_per_row={self._bytes_per_row}, {state})"
        )

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise closed_error(self._name, what)
